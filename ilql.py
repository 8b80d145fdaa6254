"""Implicit Language Q-Learning (ILQL): offline RL for language models, in one file.

Snell et al. 2022, "Offline RL for Natural Language Generation with Implicit Language Q Learning",
https://arxiv.org/abs/2206.11871, with trlX's choices (docs/scripts/ilql.md). From fixed (prompt, completion,
reward) rows, every completion token an action, heads on a causal LM learn Q by TD (two Q heads with
Polyak-averaged targets), V by expectile regression, and the LM head by weighted cloning:

    loss = L_Q + L_V + cql_scale * L_CQL + awac_scale * L_AWAC   (each term's equation in its function)

Decoding shifts the behaviour model by the advantage: log pi(a | s) + beta * (min_i Qhat_i(s, a) - V(s)).

Offline, on the tiny world (benchmark/tiny/ilql_data.py writes the SFT model's samples with their rewards):
    python benchmark/tiny/ilql_data.py --model_path models/sft --judge gold \
        --dataset_name tiny_world/dataset --response_length 8 --num_completions 2 --output_dir data/ilql
    python ilql.py --model_name_or_path models/sft --dataset_name data/ilql --dataset_test_split validation \
        --max_length 128 --max_prompt_length 112 --per_device_train_batch_size 32 --learning_rate 3e-4 \
        --alpha 0.01 --steps_for_target_q_sync 1 --beta 4 --response_length 8 --output_dir models/ilql
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import copy
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.nn as nn

import utils.chat
import utils.checkpoint
import utils.data
import utils.examples
import utils.generation
import utils.loading
import utils.logprobs
import utils.run
import utils.saving
import utils.stats
import utils.tracking
from utils.run import UsageError

HEADS_FILE = "ilql_heads.safetensors"  # the heads, beside the causal-LM weights of --output_dir


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the run (head initialisation, data order, sampling)"""
    run_name: str | None = None
    """TensorBoard folder and W&B run; None: {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """log to Weights & Biases as well as TensorBoard"""
    wandb_project_name: str = "rlhf-reference"
    """the W&B project"""
    wandb_entity: str | None = None
    """the W&B entity (team)"""
    logging_dir: str = "runs"
    """TensorBoard logs and metrics.jsonl go to {logging_dir}/{run_name}"""
    output_dir: str = "models/ilql"
    """where the backbone, ilql_heads.safetensors, tokenizer and model card are saved"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir (its contents moved to <output_dir>.replaced-<time>)"""
    push_to_hub: bool = False
    """push --output_dir (without checkpoints) to the hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""

    # Models and data
    model_name_or_path: str = "EleutherAI/pythia-1b-deduped"
    """behaviour model and tokenizer (usually the SFT model that wrote the completions)"""
    model_revision: str = "main"
    """revision (branch, tag or commit) of --model_name_or_path on the hub"""
    trust_remote_code: bool = False
    """let hub models and tokenizers run their own modelling code (every load)"""
    attn_implementation: str | None = None
    """attention of the trained model (and its reference): eager, sdpa, flash_attention_2...; None: the default"""
    dataset_name: str = "data/ilql"
    """prompt, completion and reward columns (hub id, save_to_disk dir, json/jsonl/parquet files)"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str | None = None
    """split for evaluation (loss terms) and the sample table; None: no evaluation"""
    context_overflow: Literal["refuse", "cut"] = "refuse"
    """sequences longer than the model's positions: refuse (before loading it) or cut them to fit (one line)"""
    max_length: int = 1024
    """most tokens of prompt + completion; the completion is cut to fit"""
    max_prompt_length: int | None = 512
    """keep the last this-many prompt tokens; None keeps whole prompts"""
    chat_template_path: str | None = None
    """chat template (Jinja file or tokenizer directory) for conversational data; None: the tokenizer's"""
    normalize_reward: bool = True
    """scale the training rewards to mean 0, std 1 (as trlX)"""

    # Optimization
    learning_rate: float = 5e-5
    """AdamW learning rate (backbone and heads)"""
    weight_decay: float = 1e-6
    """AdamW weight decay"""
    per_device_train_batch_size: int = 8
    """completions per process per forward pass"""
    per_device_eval_batch_size: int = 8
    """completions per process per evaluation pass, and prompts of the sample table"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    num_train_epochs: float = 1.0
    """passes over the training split (unless --max_steps > 0)"""
    max_steps: int = -1
    """optimizer steps to train for; -1 uses --num_train_epochs"""
    warmup_ratio: float = 0.0
    """fraction of the steps warming the learning rate up from 0"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "constant"
    """learning-rate schedule after warmup"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (0: no clipping)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory)"""
    bf16: bool = False
    """bfloat16 mixed precision"""

    # Algorithm (trlX's ILQLConfig names)
    tau: float = 0.7
    """expectile of V against the target Qs, in (0, 1): 0.5 fits the mean, near 1 the max"""
    gamma: float = 0.99
    """discount factor"""
    cql_scale: float = 0.1
    """weight of the conservative (CQL) term"""
    awac_scale: float = 1.0
    """weight of the AWAC term, which trains the LM head"""
    awac_beta: float = 0.0
    """AWAC weights exp(awac_beta * (Q - V)); 0: plain cross-entropy (trlX's method.beta)"""
    alpha: float = 0.001
    """Polyak rate: target <- alpha * Q + (1 - alpha) * target"""
    steps_for_target_q_sync: int = 5
    """optimizer steps between Polyak updates of the target Q heads"""
    two_qs: bool = True
    """two Q heads (and targets), their minimum used for V and decoding"""

    # Decoding (the sample table; the defaults saved with the heads)
    beta: float = 1.0
    """decoding score log pi + beta * (Q - V) (trlX's gen_kwargs beta); 0: the behaviour model"""
    top_k: int = 20
    """keep the top_k shifted scores before choosing (0: all)"""
    temperature: float = 0.0
    """sampling temperature of the shifted scores; 0: greedy"""
    response_length: int = 53
    """tokens per sample-table completion"""

    # Logging, evaluation and checkpoints
    logging_steps: int = 10
    """log training metrics every this many steps"""
    eval_steps: int = 100
    """evaluate every this many steps (0: only at the end, as always with a test split)"""
    save_steps: int = 0
    """checkpoint every this many steps into --output_dir/checkpoint-N (0: only on SIGTERM)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: all)"""
    resume_from_checkpoint: str | None = None
    """continue from a checkpoint-N folder, or `latest` in --output_dir"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes (filled in at runtime)"""
    batch_size: int = 0
    """completions per optimizer step over all processes (filled in at runtime)"""
    num_training_steps: int = 0
    """optimizer steps of the run (filled in at runtime)"""
    reward_mean: float = 0.0
    """mean subtracted from the rewards (filled in at runtime)"""
    reward_std: float = 1.0
    """std the rewards are divided by (filled in at runtime)"""


# ---- the math ----------------------------------------------------------------------------------------------
# B completions of R action tokens, V vocabulary; action t is chosen in state s_t, s_len is terminal.


def token_rewards(rewards: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Per-action rewards [B, width]: the completion's reward on its last token, 0 elsewhere."""
    out = torch.zeros(rewards.size(0), width, dtype=torch.float32, device=rewards.device)
    return out.scatter(1, (lengths - 1)[:, None], rewards[:, None].float())


def next_state_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """V(s_{t+1}) [B, R] from the values of s_0..s_R [B, R+1]; 0 when s_{t+1} is terminal or padding."""
    next_is_real = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    return values[:, 1:] * next_is_real


def q_loss(q_taken: list[torch.Tensor], rewards, next_values, mask, gamma: float) -> torch.Tensor:
    """L_Q = sum_i masked mean of (Q_i(s_t, a_t) - (r_t + gamma * V(s_{t+1})))^2, V not differentiated.
    q_taken: one [B, R] per Q head (the value of the action taken)."""
    target = rewards + gamma * next_values.detach()
    return sum(utils.stats.masked_mean((q - target) ** 2, mask) for q in q_taken)


def expectile_loss(target_q: torch.Tensor, values: torch.Tensor, mask, tau: float) -> torch.Tensor:
    """L_V = masked mean of |tau - 1{u < 0}| * u^2, u = min_i Qhat_i(s_t, a_t) - V(s_t); all [B, R]."""
    u = target_q.detach() - values
    weight = torch.where(u >= 0, torch.full_like(u, tau), torch.full_like(u, 1 - tau))
    return utils.stats.masked_mean(weight * u**2, mask)


def cql_loss(q_all: list[torch.Tensor], actions: torch.Tensor, mask) -> torch.Tensor:
    """L_CQL = sum_i masked mean of -log softmax(Q_i(s_t, .))[a_t], Q values [B, R, V] read as logits."""
    return sum(utils.stats.masked_mean(-utils.logprobs.logprobs_from_logits(q, actions), mask) for q in q_all)


def awac_loss(logits, actions, advantages, mask, awac_beta: float) -> torch.Tensor:
    """L_AWAC = masked mean of exp(awac_beta * A_t) * -log pi(a_t | s_t); logits [B, R, V], advantages [B, R]
    = min target Q - V (weights not differentiated)."""
    weights = torch.exp(awac_beta * advantages.detach().float())
    return utils.stats.masked_mean(weights * -utils.logprobs.logprobs_from_logits(logits, actions), mask)


def advantage_scores(logits, target_q, value, beta: float, top_k: int) -> torch.Tensor:
    """Decoding scores [..., V] = log softmax(logits) + beta * (Q - V), -inf outside the top_k (0: keep all).
    target_q [..., V] (min of the target heads), value [..., 1]."""
    scores = logits.float().log_softmax(-1) + beta * (target_q.float() - value.float())
    if 0 < top_k < scores.size(-1):
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return scores


@torch.no_grad()
def polyak_update(target: nn.Module, online: nn.Module, alpha: float) -> None:
    """target <- alpha * online + (1 - alpha) * target, parameter by parameter."""
    for t, o in zip(target.parameters(), online.parameters()):
        t.mul_(1 - alpha).add_(o.detach().to(t.dtype), alpha=alpha)


def normalize_rewards(rewards: torch.Tensor) -> tuple[float, float]:
    """(mean, std) that map rewards to mean 0, std 1 (std 1 when all rewards are equal)."""
    mean, std = rewards.mean().item(), rewards.std().item() if rewards.numel() > 1 else 0.0
    return mean, std if std > 1e-8 else 1.0


# ---- the model ---------------------------------------------------------------------------------------------


def mlp_head(hidden_size: int, out: int) -> nn.Sequential:
    """hidden -> 2*hidden -> ReLU -> out, as trlX builds its ILQL heads."""
    return nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size), nn.ReLU(), nn.Linear(2 * hidden_size, out))


class ILQLHeads(nn.Module):
    """V head [.., 1]; Q heads [.., V] (1 or 2) and their target copies, which have no gradient."""

    def __init__(self, hidden_size: int, vocab_size: int, two_qs: bool):
        super().__init__()
        self.v_head = mlp_head(hidden_size, 1)
        self.q_heads = nn.ModuleList(mlp_head(hidden_size, vocab_size) for _ in range(2 if two_qs else 1))
        self.target_q_heads = copy.deepcopy(self.q_heads).requires_grad_(False)

    def target_q(self, hidden: torch.Tensor) -> torch.Tensor:
        """min over the target heads of Qhat(s, .): [.., V]."""
        return torch.stack([head(hidden) for head in self.target_q_heads]).min(0).values

    def sync_target_q_heads(self, alpha: float) -> None:
        polyak_update(self.target_q_heads, self.q_heads, alpha)


class ILQLModel(nn.Module):
    """`backbone` (any AutoModelForCausalLM) + `heads` (ILQLHeads on its last hidden state)."""

    def __init__(self, backbone: nn.Module, two_qs: bool = True, heads: ILQLHeads | None = None):
        super().__init__()
        self.backbone = backbone
        hidden_size, vocab_size = backbone.config.hidden_size, backbone.get_output_embeddings().out_features
        self.heads = heads or ILQLHeads(hidden_size, vocab_size, two_qs)

    def hidden(self, input_ids, attention_mask, position_ids=None, past_key_values=None):
        """Last hidden state [B, T, H] (after the final norm) and the key-value cache."""
        decoder = getattr(self.backbone, self.backbone.base_model_prefix)
        if position_ids is None:
            position_ids = utils.generation.position_ids_from_mask(attention_mask)
        out = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=past_key_values is not None,
        )
        return out.last_hidden_state, out.past_key_values

    def forward(self, query_responses, attention_mask, context_length: int):
        """Prompts [B, Q] + completions [B, R] -> LM logits, Q per head, target Q [B, R, V]; V [B, R+1]."""
        hidden, _ = self.hidden(query_responses, attention_mask)
        # s_0 is the last prompt token's position
        states = hidden[:, context_length - 1 :]
        logits = self.backbone.get_output_embeddings()(states[:, :-1])
        q_all = [head(states[:, :-1]) for head in self.heads.q_heads]
        with torch.no_grad():
            target_q = self.heads.target_q(states[:, :-1])
        return logits, q_all, target_q, self.heads.v_head(states).squeeze(-1)

    @torch.no_grad()
    def decode_scores(self, hidden, beta: float, top_k: int) -> torch.Tensor:
        """Decoding scores [B, V] from last hidden states [B, H] (see advantage_scores)."""
        logits = self.backbone.get_output_embeddings()(hidden)
        return advantage_scores(logits, self.heads.target_q(hidden), self.heads.v_head(hidden), beta, top_k)

    def save_heads(self, output_dir: str, state_dict: dict | None = None, **metadata) -> None:
        """Write the heads to output_dir/ilql_heads.safetensors; its metadata (JSON) rebuilds them."""
        from safetensors.torch import save_file

        state_dict = state_dict if state_dict is not None else self.heads.state_dict()
        meta = {"two_qs": len(self.heads.q_heads) == 2, **metadata}
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in state_dict.items()}
        save_file(tensors, os.path.join(output_dir, HEADS_FILE), metadata={"ilql": json.dumps(meta)})

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "ILQLModel":
        """Load a directory written by ilql.py; its saved decoding defaults go to `model.decoding`."""
        from safetensors import safe_open
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        heads_path = os.path.join(path, HEADS_FILE)
        if not os.path.isfile(heads_path):
            raise UsageError(f"{path} has no {HEADS_FILE}; it was not written by ilql.py.")
        with safe_open(heads_path, "pt") as f:
            meta = json.loads(f.metadata()["ilql"])
        model = cls(AutoModelForCausalLM.from_pretrained(path, **kwargs), two_qs=meta["two_qs"])
        model.heads.load_state_dict(load_file(heads_path))
        model.heads.to(model.backbone.dtype)
        model.decoding = {k: meta[k] for k in ("beta", "top_k", "temperature") if k in meta}
        return model.eval()


@torch.no_grad()
def generate(
    model: ILQLModel,
    queries,
    query_mask,
    response_length: int,
    beta: float,
    top_k: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """query_responses [B, Q + R] after left-padded `queries` [B, Q]: greedy (temperature 0) or sampled
    from softmax(scores / temperature) of the advantage-shifted scores."""
    from transformers import DynamicCache

    mask, tokens, past = query_mask.long(), queries, DynamicCache()
    position_ids, step_ids = utils.generation.position_ids_from_mask(mask), queries
    for _ in range(response_length):
        hidden, past = model.hidden(step_ids, mask, position_ids, past)
        scores = model.decode_scores(hidden[:, -1], beta, top_k)
        if temperature > 0:
            next_ids = utils.generation.sample_categorical((scores / temperature).softmax(-1), generator)
        else:
            next_ids = scores.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_ids], 1)
        mask = torch.cat([mask, torch.ones_like(next_ids)], 1)
        position_ids, step_ids = position_ids[:, -1:] + 1, next_ids
    return tokens


@torch.no_grad()
def complete(
    model: ILQLModel,
    tokenizer,
    prompt_ids,
    response_length: int,
    chunk_size: int,
    beta=None,
    top_k=None,
    temperature=None,
    generator=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ILQL completions of tokenized prompts, cut after EOS: (responses [B, R], lengths [B]). beta, top_k and
    temperature default to the values saved with the heads (model.decoding), else 1, 20 and greedy."""
    saved = getattr(model, "decoding", {})
    beta = saved.get("beta", 1.0) if beta is None else beta
    top_k = saved.get("top_k", 20) if top_k is None else top_k
    temperature = saved.get("temperature", 0.0) if temperature is None else temperature
    device, responses = next(model.parameters()).device, []
    prompt_ids = utils.generation.fit_positions(model.backbone, prompt_ids, response_length)
    for i in range(0, len(prompt_ids), chunk_size):
        queries, query_mask = utils.generation.left_pad(
            prompt_ids[i : i + chunk_size], tokenizer.pad_token_id, device
        )
        query_responses = generate(
            model, queries, query_mask, response_length, beta, top_k, temperature, generator
        )
        responses.append(query_responses[:, queries.size(1) :])
    return utils.generation.truncate_response(
        torch.cat(responses), tokenizer.eos_token_id, tokenizer.pad_token_id
    )


def sync_target_q_heads(model: nn.Module, accelerator, alpha: float) -> None:
    """Polyak update of the prepared model's target Q heads (under ZeRO-3 on the gathered parameters)."""
    heads = utils.run.bare(model).heads
    if utils.run.zero_stage(accelerator) != 3:
        heads.sync_target_q_heads(alpha)
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(heads.parameters()), modifier_rank=0):
        if accelerator.is_main_process:
            heads.sync_target_q_heads(alpha)


# ilql_losses' stats, in order
METRICS = ["loss", "loss/q", "loss/v", "loss/cql", "loss/awac", "values/v", "values/q", "values/target_q"]
METRICS += ["values/advantage", "values/awac_weight"]


def ilql_losses(model, batch: dict, args: Args) -> tuple[torch.Tensor, torch.Tensor]:
    """The total loss and its metrics [len(METRICS)] of one batch."""
    queries, responses, lengths = batch["queries"], batch["responses"], batch["lengths"]
    mask = utils.generation.lengths_to_mask(lengths, responses.size(1))
    attention_mask = torch.cat([batch["query_mask"], mask], 1)
    logits, q_all, target_q, values = model(
        torch.cat([queries, responses], 1), attention_mask, queries.size(1)
    )
    actions = responses.unsqueeze(-1)
    q_taken = [q.float().gather(-1, actions).squeeze(-1) for q in q_all]
    target_taken = target_q.float().gather(-1, actions).squeeze(-1)
    values = values.float()
    rewards = token_rewards(batch["rewards"], lengths, responses.size(1))
    state_values = values[:, :-1]
    losses = {
        "q": q_loss(q_taken, rewards, next_state_values(values, mask), mask, args.gamma),
        "v": expectile_loss(target_taken, state_values, mask, args.tau),
        "cql": cql_loss(q_all, responses, mask),
        "awac": awac_loss(logits, responses, target_taken - state_values, mask, args.awac_beta),
    }
    total = losses["q"] + losses["v"] + args.cql_scale * losses["cql"] + args.awac_scale * losses["awac"]
    with torch.no_grad():
        advantages = target_taken - state_values
        stats = [
            total,
            *losses.values(),
            utils.stats.masked_mean(state_values, mask),
            utils.stats.masked_mean(q_taken[0], mask),
            utils.stats.masked_mean(target_taken, mask),
            utils.stats.masked_mean(advantages, mask),
            utils.stats.masked_mean(torch.exp(args.awac_beta * advantages), mask),
        ]
    return total, torch.stack([s.detach().float() for s in stats])


# ---- data --------------------------------------------------------------------------------------------------


def tokenize_split(dataset, tokenizer, args: Args, where: str) -> tuple[list[dict], dict]:
    """Rows {prompt, completion, reward} of token ids cut to the length flags, completions ending with EOS;
    and the counts of rows kept, truncated and dropped."""
    utils.data.check_columns(dataset, ["prompt", "completion", "reward"], where)
    rewards = [float(r) for r in utils.data.column(dataset, "reward")]
    if not all(math.isfinite(r) for r in rewards):
        raise UsageError(f"{where}: the reward column holds a NaN or infinite value.")
    prompt_texts, completion_texts = utils.examples.prompt_completion_texts(dataset, tokenizer, where)
    prompts = utils.chat.encode(tokenizer, prompt_texts, leading=True)
    completions = utils.chat.encode(tokenizer, completion_texts, leading=False)
    eos, rows = tokenizer.eos_token_id, []
    counts = {"rows": len(dataset), "dropped": 0, "prompts_truncated": 0, "completions_truncated": 0}
    for prompt, completion, reward in zip(prompts, completions, rewards):
        completion = completion if completion[-1:] == [eos] else completion + [eos]
        if args.max_prompt_length is not None and len(prompt) > args.max_prompt_length:
            prompt = prompt[-args.max_prompt_length :]
            counts["prompts_truncated"] += 1
        room = args.max_length - len(prompt)
        if room < 1 or not prompt:
            counts["dropped"] += 1
            continue
        counts["completions_truncated"] += len(completion) > room
        rows.append({"prompt": prompt, "completion": completion[:room], "reward": reward})
    if not rows:
        raise UsageError(
            f"{where}: no row leaves room for a completion under --max_length {args.max_length}."
        )
    return rows, counts


def collate(rows: list[dict], pad_token_id: int, reward_mean: float, reward_std: float) -> dict:
    """Prompts left-padded [B, Q] (as generation sees them), completions right-padded [B, R], their
    lengths [B] and normalized rewards [B]."""
    queries, query_mask = utils.generation.left_pad([r["prompt"] for r in rows], pad_token_id)
    lengths = torch.tensor([len(r["completion"]) for r in rows])
    return {
        "queries": queries,
        "query_mask": query_mask,
        "responses": utils.generation.pad([r["completion"] for r in rows], pad_token_id),
        "lengths": lengths,
        "rewards": (torch.tensor([r["reward"] for r in rows]) - reward_mean) / reward_std,
    }


# ---- checks and sizes --------------------------------------------------------------------------------------


def fill_sizes(args: Args, world_size: int, num_rows: int | None = None) -> Args:
    """Check the flags and fill in the sizes (the run length once the rows are known)."""
    if not 0 < args.tau < 1:
        raise UsageError(f"--tau must be in (0, 1), got {args.tau}.")
    if not 0 < args.alpha <= 1:
        raise UsageError(f"--alpha must be in (0, 1], got {args.alpha}.")
    if not 0 <= args.gamma <= 1:
        raise UsageError(f"--gamma must be in [0, 1], got {args.gamma}.")
    if min(args.cql_scale, args.awac_scale, args.beta, args.temperature, args.top_k) < 0:
        raise UsageError("--cql_scale, --awac_scale, --beta, --temperature and --top_k must not be negative.")
    for flag in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "steps_for_target_q_sync",
        "logging_steps",
        "response_length",
        "max_length",
    ):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.max_prompt_length is not None and not 0 < args.max_prompt_length < args.max_length:
        raise UsageError(f"--max_prompt_length must be in [1, --max_length - 1 = {args.max_length - 1}].")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise UsageError("set --max_steps > 0 or --num_train_epochs > 0.")
    if args.eval_steps < 0 or not 0 <= args.warmup_ratio <= 1:
        raise UsageError("--eval_steps must be at least 0 and --warmup_ratio in [0, 1].")
    args.world_size = world_size
    args.batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    if num_rows is not None:
        if num_rows < args.batch_size:
            raise UsageError(
                f"the training split has {num_rows} rows, fewer than one step of {args.batch_size}."
            )
        steps_per_epoch = num_rows // args.batch_size
        epochs_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
        args.num_training_steps = args.max_steps if args.max_steps > 0 else epochs_steps
    return args


# ---- training ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What a run holds fixed, from setup() to the save."""

    accelerator: Any
    tokenizer: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    checkpointer: utils.checkpoint.Checkpointer
    tracker: utils.tracking.Tracker
    train_rows: list[dict]
    eval_rows: list[dict]
    counts: dict
    batches: Iterator[list[int]]
    steps_per_epoch: int
    start_step: int
    last_metrics: dict


def device_batch(run: Run, args: Args, rows: list[dict]) -> dict:
    """`collate` of rows, on the run's device."""
    batch = collate(rows, run.tokenizer.pad_token_id, args.reward_mean, args.reward_std)
    return {k: v.to(run.accelerator.device) for k, v in batch.items()}


def evaluate(run: Run, args: Args, step: int) -> dict:
    """The loss terms over the test split and a table of decodes: ILQL, beta 0, the data and its reward."""
    accelerator, model, tokenizer = run.accelerator, run.model, run.tokenizer
    model.eval()
    my_rows = run.eval_rows[accelerator.process_index :: args.world_size] or run.eval_rows[:1]
    size = args.per_device_eval_batch_size
    with torch.no_grad(), accelerator.autocast():
        mb_stats = [
            ilql_losses(model, device_batch(run, args, my_rows[i : i + size]), args)[1]
            for i in range(0, len(my_rows), size)
        ]
        stats = accelerator.reduce(torch.stack(mb_stats).mean(0), reduction="mean")
        shown_rows = run.eval_rows[:size]
        with utils.run.gathered_for_generation(model, accelerator) as bare:
            prompts = [r["prompt"] for r in shown_rows]
            decode = partial(complete, bare, tokenizer, prompts, args.response_length, size)
            noise = torch.Generator(device=accelerator.device).manual_seed(args.seed)
            ilql_ids, _ = decode(args.beta, args.top_k, args.temperature, noise)
            behaviour_ids, _ = decode(0.0, 0, 0.0)
    result = {f"eval/{name}": value for name, value in zip(METRICS, stats.tolist())}
    run.tracker.log(result, step)
    if accelerator.is_main_process:
        text = partial(tokenizer.batch_decode, skip_special_tokens=True)
        table = {
            "prompt (end)": [p[-40:] for p in text([r["prompt"] for r in shown_rows])],
            f"ILQL (beta {args.beta})": text(ilql_ids),
            "beta 0": text(behaviour_ids),
            "data": text([r["completion"] for r in shown_rows]),
            "reward": [r["reward"] for r in shown_rows],
        }
        run.tracker.samples(table, title=f"step {step}: eval loss {result['eval/loss']:.4f}")
    model.train()
    return result


def save(run: Run, args: Args, final: dict) -> None:
    """Backbone and heads into a temporary directory, then moved into --output_dir (a failed run leaves it
    as it was); every process takes part, for ZeRO-3 to gather its shards."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    parent, name = os.path.split(os.path.abspath(args.output_dir))
    tmp_dir = os.path.join(parent, f".{name}.{os.path.basename(args.run_name)}.partial")
    state_dict = accelerator.get_state_dict(run.model)
    bare = accelerator.unwrap_model(run.model)
    backbone_state = {k[len("backbone.") :]: v for k, v in state_dict.items() if k.startswith("backbone.")}
    with utils.loading.config_dropout_kept(bare.backbone):
        bare.backbone.save_pretrained(
            tmp_dir,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=backbone_state,
        )
    run.checkpointer.start_over()  # a replaced run's files go aside before the new ones move in
    if accelerator.is_main_process:
        heads_state = {k[len("heads.") :]: v for k, v in state_dict.items() if k.startswith("heads.")}
        bare.save_heads(tmp_dir, heads_state, beta=args.beta, top_k=args.top_k, temperature=args.temperature)
        run.tokenizer.save_pretrained(tmp_dir)
        algorithm = f"ILQL (tau {args.tau}, gamma {args.gamma}, beta {args.beta}); decode with ilql.complete"
        title = os.path.basename(os.path.abspath(args.output_dir))
        utils.saving.write_model_card(
            tmp_dir, algorithm, args.model_name_or_path, args.dataset_name, final, title=title, args=args
        )
        os.makedirs(args.output_dir, exist_ok=True)
        for file in os.listdir(tmp_dir):
            os.replace(os.path.join(tmp_dir, file), os.path.join(args.output_dir, file))
        shutil.rmtree(tmp_dir)
        print(f"saved to {args.output_dir} (backbone and {HEADS_FILE})")
        if args.push_to_hub:
            utils.saving.push_to_hub(args)


def setup(args: Args) -> Run:
    """Everything before the first step; a bad flag or bad data fails before a model is loaded."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, get_scheduler

    utils.loading.use_model_flags(args)
    utils.loading.fit_max_length(args)  # under --context_overflow cut, before the flag checks
    fill_sizes(args, 1)
    accelerator = utils.run.make_accelerator(
        args, args.gradient_accumulation_steps, args.per_device_train_batch_size
    )
    if not args.resume_from_checkpoint:
        utils.checkpoint.check_output_dir(args.output_dir, args.overwrite_output_dir)
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    set_seed(args.seed)
    tokenizer = utils.loading.load_tokenizer(
        args.model_name_or_path, "--model_name_or_path", args.chat_template_path
    )
    split = partial(utils.data.load_split, args.dataset_name)
    train_rows, counts = tokenize_split(
        split(args.dataset_train_split), tokenizer, args, "--dataset_train_split"
    )
    eval_rows = []
    if args.dataset_test_split:
        eval_rows, _ = tokenize_split(split(args.dataset_test_split), tokenizer, args, "--dataset_test_split")
    longest = max(len(r["prompt"]) + len(r["completion"]) for r in train_rows + eval_rows)
    utils.loading.check_context_length(args.model_name_or_path, longest, "--max_length")
    fill_sizes(args, accelerator.num_processes, len(train_rows))
    if args.normalize_reward:
        args.reward_mean, args.reward_std = normalize_rewards(torch.tensor([r["reward"] for r in train_rows]))
    if accelerator.is_main_process:
        print(f"training split: {counts}; {args.num_training_steps} steps of {args.batch_size} completions")

    # the behaviour model with fresh (seeded) heads, dropout off
    backbone = utils.loading.from_pretrained(
        AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
    )
    utils.loading.disable_dropout(backbone)
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(backbone)
    model = ILQLModel(backbone, args.two_qs)
    trained = [p for p in model.parameters() if p.requires_grad]  # the target heads are not
    optimizer = utils.run.adamw(trained, lr=args.learning_rate, weight_decay=args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    warmup_steps = math.ceil(args.warmup_ratio * args.num_training_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, args.num_training_steps)
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)
    state = checkpointer.resume(models={"model": model}, optimizers={"model": optimizer})
    start_step = state["step"] if state else 0
    for _ in range(start_step):  # the schedule is a function of the step
        scheduler.step()
    tracker = utils.tracking.Tracker(args, checkpointer)
    # the same seeded order on every process; a resumed run skips what it trained on
    rank, size = accelerator.process_index, args.per_device_train_batch_size
    batches = utils.data.prompt_batches(len(train_rows), size, args.world_size, rank, args.seed)
    for _ in range(start_step * args.gradient_accumulation_steps):
        next(batches)
    return Run(
        accelerator=accelerator,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        checkpointer=checkpointer,
        tracker=tracker,
        train_rows=train_rows,
        eval_rows=eval_rows,
        counts=counts,
        batches=batches,
        steps_per_epoch=len(train_rows) // args.batch_size,
        start_step=start_step,
        last_metrics=state.get("metrics", {}) if state else {},
    )


def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, model, optimizer, device = run.accelerator, run.model, run.optimizer, run.accelerator.device
    step, metrics = run.start_step, run.last_metrics  # the last logged, for a run resumed at its end
    progress = tqdm(total=args.num_training_steps, initial=step, disable=not accelerator.is_main_process)
    sums, tokens = torch.zeros(len(METRICS), device=device), torch.zeros((), device=device)
    start, log_start, micro = time.time(), time.time(), 0
    model.train()
    while step < args.num_training_steps:
        for _ in range(args.gradient_accumulation_steps):
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            # 1. Batch: this process's slice of the epoch's seeded order
            batch = device_batch(run, args, [run.train_rows[i] for i in next(run.batches)])
            with accelerator.accumulate(model):
                # 2. Loss
                # ALGO LOGIC: Q by TD, V by expectile regression, CQL and AWAC, all on one forward pass
                with accelerator.autocast():
                    loss, stats = ilql_losses(model, batch, args)
                # 3. Update
                accelerator.backward(loss)
                # the accumulation's last micro-batch measures the norm; 0.0 is a norm and is logged
                grad_norm = utils.run.clip_grad_norm(accelerator, model, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            sums, tokens, micro = sums + stats, tokens + batch["lengths"].sum(), micro + 1
        run.scheduler.step()
        step += 1
        progress.update(1)
        grad_norm = utils.run.grad_norm_after_step(model, grad_norm)
        run.tracker.check_finite(step, loss=stats[0], grad_norm=grad_norm)
        if step % args.steps_for_target_q_sync == 0:  # ALGO LOGIC: the same Polyak update on every process
            sync_target_q_heads(model, accelerator, args.alpha)

        # 4. Metrics, averaged over micro-batches and processes
        if step % args.logging_steps == 0 or step == args.num_training_steps:
            means = accelerator.reduce(sums / micro, reduction="mean").tolist()
            metrics = dict(zip(METRICS, means))
            tokens_per_second = accelerator.reduce(tokens, "sum").item() / (time.time() - log_start)
            metrics |= {
                "learning_rate": run.scheduler.get_last_lr()[0],
                "epoch": step / run.steps_per_epoch,
                "perf/tokens_per_second": tokens_per_second,
                **({"grad_norm": grad_norm} if grad_norm is not None else {}),
            }
            run.tracker.log(metrics, step)
            progress.set_postfix(loss=f"{means[0]:.4f}", advantage=f"{means[8]:.3f}")
            sums, tokens, micro, log_start = sums * 0, tokens * 0, 0, time.time()

        # 5. Evaluate: loss terms and the sample table
        eval_due = args.eval_steps and step % args.eval_steps == 0 and step < args.num_training_steps
        if run.eval_rows and eval_due:
            evaluate(run, args, step)
        # 6. Checkpoint
        run.checkpointer.maybe_save(
            step,
            models={"model": model},
            optimizers={"model": optimizer},
            state={"step": step, "metrics": metrics},
        )
    progress.close()
    final = metrics | {"train_seconds": time.time() - start} | {f"data/{k}": v for k, v in run.counts.items()}
    if run.eval_rows:
        final |= evaluate(run, args, step)

    # 7. Save the backbone as a causal-LM directory and the heads beside it
    save(run, args, final)
    run.tracker.close()
    utils.run.end_run(accelerator)
    return final


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
