"""PPO for language models (RLHF), with the implementation details of the TL;DR recipe.

Papers: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", https://arxiv.org/abs/1707.06347;
Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", https://arxiv.org/abs/1909.08593;
Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO", https://arxiv.org/abs/2403.17031.

Each update samples completions of a batch of prompts, scores them (a reward model or a Python function), and
builds per-token rewards: a KL penalty against the frozen SFT model on every token, the score on the last one.
GAE with a critic (initialised from the reward model) gives the advantages; `num_ppo_epochs` epochs of the
clipped policy and value losses over shuffled mini-batches follow.

Example (the offline tiny world: `python benchmark/tiny/tiny_world.py --output_dir tiny_world`):

    python ppo.py --sft_model_path tiny_world/policy --reward_model_path tiny_world/reward \
        --dataset_name tiny_world/dataset --dataset_train_split sft --dataset_test_split validation \
        --total_episodes 2048 --per_device_train_batch_size 16 --response_length 8 --learning_rate 1e-4 \
        --stop_token eos
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn as nn
import tyro

import utils.chat
import utils.checkpoint
import utils.data
import utils.evaluation
import utils.generation
import utils.loading
import utils.logprobs
import utils.reward_model
import utils.rollout
import utils.run
import utils.saving
import utils.scoring
import utils.stats
import utils.tracking
from utils.run import UsageError


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment"""
    seed: int = 1
    """seed of model heads, prompt order and sampling (offset per process)"""
    run_name: str | None = None
    """TensorBoard / W&B run name; None: {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """also log to Weights & Biases"""
    wandb_project_name: str = "rlhf-reference"
    """W&B project"""
    wandb_entity: str | None = None
    """W&B entity (team)"""
    logging_dir: str = "runs"
    """TensorBoard logs and metrics.jsonl go to {logging_dir}/{run_name}"""
    output_dir: str | None = None
    """where the trained policy goes; None: models/{run_name}"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir (moved to <output_dir>.replaced-<time>)"""
    push_to_hub: bool = False
    """push the policy (no checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """checkpoint every this many updates (0: only on SIGTERM/SIGINT)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint-N folder, or `latest` in --output_dir, to continue exactly from"""
    bf16: bool = False
    """bf16 mixed precision"""
    gradient_checkpointing: bool = False
    """gradient checkpointing in the policy and the critic"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters instead of every weight; the reference is then the policy with its adapter off (the critic trains whole, as TRL)"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling alpha: the adapter's update is scaled by alpha / r"""
    lora_dropout: float = 0.05
    """dropout on the adapters' inputs (off with --disable_dropout, as TRL)"""
    lora_target_modules: list[str] | None = None
    """modules given adapters (e.g. q_proj v_proj, or all-linear); None: peft's default for the model"""
    lora_modules_to_save: list[str] | None = None
    """modules trained whole beside the adapters (e.g. lm_head)"""
    use_rslora: bool = False
    """rank-stabilized LoRA: the update is scaled by alpha / sqrt(r)"""
    use_dora: bool = False
    """weight-decomposed LoRA (DoRA)"""

    # Models and data
    model_name_or_path: str | None = None
    """the policy's tokenizer, and its weights unless --sft_model_path"""
    model_revision: str = "main"
    """revision (branch, tag or commit) of --model_name_or_path on the hub"""
    trust_remote_code: bool = False
    """let hub models and tokenizers run their own modelling code (every load)"""
    attn_implementation: str | None = None
    """attention of the trained model (and its reference): eager, sdpa, flash_attention_2...; None: the default"""
    sft_model_path: str | None = None
    """the initial policy and the frozen reference (None: --model_name_or_path)"""
    reward_model_path: Annotated[str | None, tyro.conf.arg(aliases=("--reward_model_name_or_path",))] = None
    """sequence-classification reward model (one label); or --reward_fn"""
    reward_fn: Annotated[str | None, tyro.conf.arg(aliases=("--reward_funcs",))] = None
    """path/to/file.py:function or module.function: (prompts, completions) -> floats"""
    reward_tokenizer_path: str | None = None
    """the reward model's tokenizer if not in --reward_model_path (TRL: reward_processing_classes)"""
    value_model_path: str | None = None
    """initial critic; None: the reward model if it shares the policy's tokenizer, else the SFT model"""
    dataset_name: str = "trl-lib/tldr"
    """hub id, save_to_disk folder, or json/jsonl/parquet files with a `prompt` column"""
    dataset_config: str | None = None
    """the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split of the training prompts"""
    dataset_test_split: str | None = None
    """held-out prompts: evaluated (eval/...) and shown at the sample tables; None: no evaluation, tables of training prompts"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer folder) for conversational prompts"""
    context_overflow: Literal["refuse", "cut"] = "refuse"
    """sequences longer than the model's positions: refuse (before loading it) or cut them to fit (one line)"""
    max_prompt_length: int | None = None
    """keep only the last this many prompt tokens; None: all"""

    # Sampling
    response_length: int = 53
    """tokens sampled per completion (then truncated after the stop token)"""
    temperature: float = 0.7
    """sampling temperature; the logprobs are of logits / temperature"""
    top_p: float = 1.0
    """sample from the smallest set of most likely tokens whose probability exceeds this (1: all)"""
    top_k: int = 0
    """sample from the this-many most likely tokens only (0: all)"""
    min_p: float | None = None
    """sample only tokens at least this times as likely as the most likely one (None: all)"""
    repetition_penalty: float = 1.0
    """divide positive logits (multiply negative ones) of tokens already in the prompt or completion by this"""
    generation_kwargs: str | None = None
    """a JSON object of the four flags above, over them (TRL's generation_kwargs, these names only)"""
    stop_token: Literal["eos"] | None = None
    """eos: cut after the EOS; None (TRL's default): keep all --response_length tokens (or --stop_token_id)"""
    stop_token_id: int | None = None
    """truncate completions after this token id"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of a completion without EOS (1.0 in the TL;DR recipe)"""
    local_rollout_forward_batch_size: int = 64
    """rows per rollout forward pass (generation, reference, critic, reward)"""
    use_vllm: bool = False
    """sample with vLLM (pip install -r requirements-vllm.txt)"""
    vllm_mode: Literal["colocate"] = "colocate"
    """colocate: one vLLM engine per training process (TRL's server mode is not provided)"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of GPU memory for vLLM (CPU: VLLM_CPU_KVCACHE_SPACE GiB, default 1)"""
    vllm_tensor_parallel_size: int = 1
    """processes sharing one vLLM engine (must divide the number of processes)"""
    recompute_old_logprobs: Literal["auto", "true", "false"] = "auto"
    """old logprobs from the training forward pass, not sampling's; auto: under bf16"""

    # Algorithm
    learning_rate: float = 3e-6
    """AdamW learning rate"""
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
    ] = "linear"
    """transformers' schedule after the warmup, stepped once an update as TRL's PPO; linear: decay to 0"""
    warmup_steps: float = 0.0
    """linear warmup over this many updates, or below 1 this fraction of them"""
    weight_decay: float = 0.0
    """AdamW weight decay, on every weight but biases and norms (as TRL's Trainer)"""
    adam_beta1: float = 0.9
    """AdamW beta1"""
    adam_beta2: float = 0.999
    """AdamW beta2"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    optim: Literal["adamw_torch_fused", "adamw_torch"] = "adamw_torch_fused"
    """AdamW with the fused kernel or without (the same update up to rounding)"""
    max_grad_norm: float | None = None
    """clip the gradient norm at this value; None: no clipping (TRL's PPO)"""
    per_device_train_batch_size: int = 8
    """rows per forward/backward pass per process (a micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step (one mini-batch)"""
    num_mini_batches: int = 1
    """mini-batches (optimizer steps) per PPO epoch"""
    total_episodes: int | None = None
    """completions to sample in all; None: num_train_epochs * prompts"""
    num_train_epochs: float = 3.0
    """passes over the prompts when total_episodes is None"""
    num_ppo_epochs: int = 4
    """epochs of optimisation on each batch of rollouts"""
    use_score_scaling: bool = False
    """divide scores by the running std of all scores so far"""
    use_score_norm: bool = False
    """with use_score_scaling, also subtract the running mean"""
    score_clip: float | None = None
    """clip (scaled) scores to [-score_clip, score_clip]"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (keeping their mean) before GAE"""
    whiten_across_processes: bool = False
    """ours: whiten over all processes' tokens; off: per process, as TRL's PPO"""
    kl_coef: float = 0.05
    """coefficient of the per-token KL penalty (initial one with --adaptive_kl)"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """per-token KL: k1, k2, k3, abs, or full (exact, holds two [B, R, V] logits)"""
    adaptive_kl: bool = False
    """adapt kl_coef towards target_kl (Ziegler et al.'s controller)"""
    target_kl: float = 6.0
    """target KL (summed over the response) of the adaptive controller"""
    kl_horizon: int = 10000
    """horizon (in episodes) of the adaptive controller"""
    cliprange: float = 0.2
    """clip range of the policy ratio"""
    cliprange_value: float = 0.2
    """clip range of the values around the rollout's"""
    vf_coef: float = 0.1
    """coefficient of the value loss"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    max_approx_kl: float | None = None
    """stop this batch's PPO epochs once a mini-batch's approximate KL passes this"""

    # Logging
    num_sample_generations: int = 10
    """times to evaluate and print a table of greedy completions after the first update; 0: never"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """no: no evaluation or sample tables; steps: at --num_sample_generations or --eval_steps points"""
    eval_steps: int | None = None
    """evaluate and print the sample table every this many updates instead (and after the last)"""
    eval_on_start: bool = False
    """evaluate before the first update too (logged at step 0; not again on resume)"""
    per_device_eval_batch_size: int = 8
    """held-out prompts (one greedy completion each) per process per evaluation batch"""

    # Filled in at runtime (a value given on the command line must match)
    local_batch_size: int = 0
    """prompts per update per process (micro-batch * accumulation * num_mini_batches)"""
    batch_size: int = 0
    """prompts per update on all processes"""
    mini_batch_size: int = 0
    """rows per optimizer step on all processes"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes"""
    local_mini_batch_size: int = 0
    """rows per optimizer step on each process"""
    num_total_batches: int = 0
    """number of updates: ceil(total_episodes / batch_size)"""


# ---- the math ----------------------------------------------------------------------------------------------
# B batch, R response length, V vocabulary; `mask` [B, R] marks the response tokens up to the stop token.
def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs [B, R] -> [B, R].

    With r = log pi_ref(y_t) - log pi(y_t), y_t ~ pi: k1 = -r (unbiased), k2 = r^2 / 2 (biased, low variance),
    k3 = e^r - 1 - r (unbiased, >= 0, low variance), abs = |r|.
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    raise UsageError(f"unknown kl_estimator {estimator!r}; use k1, k2, k3, abs (or full with the logits).")


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL over the vocabulary, temperature applied: [B, R, V] x2 -> [B, R].

    KL_t = sum_v pi(v | s_t) (log pi(v | s_t) - log pi_ref(v | s_t)).
    """
    logp, ref_logp = logits.float().log_softmax(-1), ref_logits.float().log_softmax(-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def per_token_rewards(
    kl: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards [B, R] and their KL part [B, R]: r_t = -kl_coef * KL_t, plus the score [B] at t = L-1.

    The score lands on the last response token (the stop token), never on the token after it (a known bug).
    """
    non_score_rewards = -kl_coef * kl * mask
    last = mask.long().sum(1) - 1
    rewards = non_score_rewards.clone()
    rewards[torch.arange(rewards.size(0), device=rewards.device), last] += scores
    return rewards, non_score_rewards


def penalize_missing_eos(
    scores: torch.Tensor,
    responses: torch.Tensor,
    mask: torch.Tensor,
    eos_token_id: int,
    penalty: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B] minus `penalty` where responses [B, R] have no EOS in `mask`, that flag [B]).

    Only tokens in `mask` count, so padding that shares the EOS id is no EOS.
    """
    contains_eos = ((responses == eos_token_id) & mask.bool()).any(1)
    if penalty is None:
        return scores, contains_eos
    return scores - penalty * (~contains_eos).to(scores.dtype), contains_eos


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: (advantages [B, R], returns [B, R]), zero outside `mask`.

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  returns_t = A_t + V_t;
    V and A are zero after the last response token (the episode ends at the stop token).
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    last_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.size(1))):
        next_values = values[:, t + 1] if t + 1 < values.size(1) else torch.zeros_like(last_advantage)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_advantage = (delta + gamma * lam * last_advantage) * mask[:, t]
        advantages[:, t] = last_advantage
    return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: float) -> tuple[torch.Tensor, ...]:
    """PPO's clipped surrogate as a loss, inputs [B, R]: (loss, clip fraction, approximate KL, ratio [B, R]).

    ratio = exp(logp - logp_old);  loss = mean_t max(-A ratio, -A clip(ratio, 1-eps, 1+eps));
    approx KL = mean_t (logp - logp_old)^2 / 2; means over the tokens in `mask`.
    """
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    loss = utils.stats.masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = utils.stats.masked_mean((clipped > unclipped).float(), mask)
    approx_kl = 0.5 * utils.stats.masked_mean(log_ratio.detach() ** 2, mask)
    return loss, clipfrac.detach(), approx_kl, ratio.detach()


def value_loss(
    values, old_values, returns, mask, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, all inputs [B, R]: (loss, clip fraction).

    V_clip = old_V + clip(V - old_V, -c, c);  loss = 1/2 mean_t max((V - G)^2, (V_clip - G)^2) over `mask`.
    """
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * utils.stats.masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)
    return loss, utils.stats.masked_mean((clipped_loss > unclipped_loss).float(), mask).detach()


class AdaptiveKLController:
    """Ziegler et al.'s KL controller: beta <- beta (1 + clip(KL / target - 1, +-0.2) n / horizon).

    KL is the last batch's mean summed KL, n the episodes in it.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class RunningMoments:
    """Mean and population variance of every value seen so far, merged batch by batch (Chan et al.)."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 0.0, 0

    def update(self, values: torch.Tensor) -> tuple[float, float]:
        values = values.double()
        n, batch_mean, batch_var = values.numel(), values.mean().item(), values.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total
        return self.mean, math.sqrt(self.var)


def whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, accelerator=None
) -> torch.Tensor:
    """(v - mean) / std of values [B, R] over `mask`, 0 elsewhere (the mean kept without shift_mean).

    Statistics of this process's tokens (TRL's PPO), or with `accelerator` of every process's tokens.
    """
    if accelerator is None:
        return utils.stats.masked_whiten(values, mask, shift_mean) * mask
    all_values, all_masks = accelerator.gather(values), accelerator.gather(mask.long())
    rows = slice(accelerator.process_index * values.size(0), (accelerator.process_index + 1) * values.size(0))
    return utils.stats.masked_whiten(all_values, all_masks, shift_mean)[rows] * mask


def shape_scores(scores: torch.Tensor, moments: RunningMoments | None, norm: bool, clip: float | None):
    """Scores [B] divided by the running std (and centred with `norm`), then clipped: [B] -> [B]."""
    if moments is not None:
        std = math.sqrt(moments.var) + 1e-8
        scores = (scores - moments.mean) / std if norm else scores / std
    return scores.clamp(-clip, clip) if clip is not None else scores


# ---- rollout -----------------------------------------------------------------------------------------------
class PolicyAndValue(nn.Module):
    """The policy and the critic as one module, so that accelerate wraps both and DDP sees one forward."""

    def __init__(self, policy: nn.Module, critic: nn.Module):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, query_responses, attention_mask, context_length: int, temperature: float):
        """Logprobs [B, R] of the response under logits / temperature, their entropy [B, R] (no gradient), and
        the critic's values [B, R] of the state before each response token."""
        logprobs, entropy, _ = utils.logprobs.response_logprobs(
            self.policy, query_responses, attention_mask, context_length, temperature, with_stats=True
        )
        values = utils.reward_model.per_token_scores(self.critic, query_responses, attention_mask)
        return logprobs, entropy, values[:, context_length - 1 : -1].float()


def score_completions(args, run, queries, query_mask, responses, prompts, trainer_state):
    """Truncate `responses` [B, R] after the stop token and score them: (response_mask [B, R], scores [B],
    contains_eos [B])."""
    pad_id = run.tokenizer.pad_token_id
    truncated, lengths = utils.generation.truncate_response(responses, args.stop_token_id, pad_id)
    response_mask = utils.generation.lengths_to_mask(lengths, responses.size(1))
    query_responses = torch.cat([queries, truncated], 1)
    attention_mask = torch.cat([query_mask, response_mask], 1)
    scores = run.scorer(
        query_responses,
        attention_mask,
        queries.size(1),
        args.local_rollout_forward_batch_size,
        prompts=prompts,
        trainer_state=trainer_state,
    ).float()
    scores, contains_eos = penalize_missing_eos(
        scores, truncated, response_mask, run.tokenizer.eos_token_id, args.missing_eos_penalty
    )
    return response_mask, scores, contains_eos


@torch.no_grad()
def rollout(args, run, queries, query_mask, update, prompts, trainer_state) -> dict:
    """Sample and score completions of left-padded `queries` [B, Q]: the tensors an update needs.

    A prompt's sampling noise is keyed by (seed, update, its index in the update's global batch).
    """
    accelerator, model, device = run.accelerator, run.model, queries.device
    Q, T, chunk = queries.size(1), args.temperature, args.local_rollout_forward_batch_size
    knobs = utils.generation.sampling_knobs(args)  # once a call, not once a chunk
    first_prompt = accelerator.process_index * args.local_batch_size
    query_responses, logprobs = [], []
    if run.engine is not None:  # outside the gathering below
        run.engine.sync_weights(model, accelerator, "policy")
    generate = run.engine.generate if run.engine is not None else utils.generation.generate
    with utils.run.gathered_for_generation(model, accelerator) as unwrapped:
        for i in range(0, queries.size(0), chunk):
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            rows = slice(i, i + chunk)
            noise = utils.generation.sampling_generator(args.seed, update, first_prompt + i, device=device)
            chunk_query_responses, chunk_logprobs = generate(
                unwrapped.policy,
                queries[rows],
                query_mask[rows],
                args.response_length,
                T,
                chunk,
                noise,
                **knobs,
            )
            query_responses.append(chunk_query_responses)
            logprobs.append(chunk_logprobs)
    query_responses, logprobs = torch.cat(query_responses), torch.cat(logprobs)
    responses = query_responses[:, Q:]
    # Attend to all R sampled tokens, as generation did, so that logprobs match sampling's.
    attention_mask = torch.cat([query_mask, torch.ones_like(responses, dtype=torch.bool)], 1)
    response_mask, scores, contains_eos = score_completions(
        args, run, queries, query_mask, responses, prompts, trainer_state
    )
    unwrapped, ref_logprobs, values, kl_full, recomputed = utils.run.bare(model), [], [], [], []
    for i in range(0, queries.size(0), chunk):
        run.checkpointer.boundary()
        qr, am = query_responses[i : i + chunk], attention_mask[i : i + chunk]
        if args.kl_estimator == "full":  # [chunk, R, V] logits of both models
            ref_logits = utils.logprobs.response_logits(run.ref_policy, qr, am, Q, T)
            logits = utils.logprobs.response_logits(unwrapped.policy, qr, am, Q, T)
            ref_logprobs.append(utils.logprobs.logprobs_from_logits(ref_logits, qr[:, Q:]))
            recomputed.append(utils.logprobs.logprobs_from_logits(logits, qr[:, Q:]))
            kl_full.append(full_kl(logits, ref_logits))
        else:
            ref_logprobs.append(utils.logprobs.response_logprobs(run.ref_policy, qr, am, Q, T))
            if run.recompute_old_logprobs:
                recomputed.append(utils.logprobs.response_logprobs(unwrapped.policy, qr, am, Q, T))
        values.append(utils.reward_model.per_token_scores(unwrapped.critic, qr, am)[:, Q - 1 : -1].float())
    if run.recompute_old_logprobs:
        logprobs = torch.cat(recomputed)
    kl = torch.cat(kl_full) if kl_full else kl_per_token(logprobs, torch.cat(ref_logprobs), args.kl_estimator)
    return dict(
        query_responses=query_responses,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=logprobs,
        values=torch.cat(values) * response_mask,
        kl=kl * response_mask,
        scores=scores,
        contains_eos=contains_eos,
    )


def held_out_table(args, run, update) -> dict:
    """Evaluate after `update` (0: before the first) on greedy completions of every held-out prompt and print
    a table of the first: the eval/ metrics; without a test split, a table of the first training prompts only."""
    trainer_state = utils.scoring.TrainerState(
        global_step=update,
        max_steps=args.num_total_batches,
        epoch=update * args.batch_size / len(run.prompt_ids),
    )
    run.model.eval()
    eval_metrics, columns = utils.evaluation.evaluate(
        run.accelerator,
        len(run.eval_prompt_ids),
        args.per_device_eval_batch_size,
        functools.partial(held_out_batch, args, run, trainer_state),
    )
    logged = utils.rollout.mean_over_processes(run.accelerator, run.scorer.take_logged())
    run.scorer.take_num_truncated()  # the evaluation's rows are not the next update's
    which = "test prompts" if run.held_out else "training prompts"
    run.tracker.samples(columns, title=f"update {update}: {which} (greedy)")
    if not run.held_out:
        return {}
    return {**eval_metrics, **{f"eval/{name}": value for name, value in logged.items()}}


@torch.no_grad()
def held_out_batch(args, run, trainer_state, indices: list[int]) -> tuple[dict, dict]:
    """Greedy completions of the held-out prompts `indices`, scored as in training (missing-EOS penalty
    included) -> (per completion: eval/ values, the sample table's columns)."""
    accelerator, tokenizer = run.accelerator, run.tokenizer
    eval_queries, eval_query_mask = utils.generation.left_pad(
        [run.eval_prompt_ids[i] for i in indices], tokenizer.pad_token_id, accelerator.device
    )
    with accelerator.autocast(), utils.run.gathered_for_generation(run.model, accelerator) as unwrapped:
        eval_query_responses, _ = utils.generation.generate(
            unwrapped.policy,
            eval_queries,
            eval_query_mask,
            args.response_length,
            0.0,
            args.local_rollout_forward_batch_size,
        )
    eval_responses = eval_query_responses[:, eval_queries.size(1) :]
    eval_prompts = [run.eval_raw_prompts[i] for i in indices]
    with accelerator.autocast():
        eval_response_mask, eval_scores, contains_eos = score_completions(
            args, run, eval_queries, eval_query_mask, eval_responses, eval_prompts, trainer_state
        )
    values = {
        "objective/scores": eval_scores,
        "completions/mean_length": eval_response_mask.sum(1).float(),
        "completions/clipped_ratio": (~contains_eos).float(),
    }
    columns = {
        "prompt": [run.eval_texts[i][-80:] for i in indices],
        "completion": [tokenizer.decode(r[m]) for r, m in zip(eval_responses, eval_response_mask)],
        "score": eval_scores.tolist(),
    }
    return values, columns


# ---- checks and sizes --------------------------------------------------------------------------------------
def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Check the flags; given the number of prompts, fill the derived sizes with TRL's PPO arithmetic."""
    positive = (
        "per_device_train_batch_size gradient_accumulation_steps num_mini_batches num_ppo_epochs "
        "local_rollout_forward_batch_size response_length kl_horizon"
    )
    for name in positive.split() + ["total_episodes"] * (args.total_episodes is not None):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if (args.reward_model_path is None) == (args.reward_fn is None):
        raise UsageError("pass exactly one of --reward_model_path and --reward_fn.")
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be positive for PPO's sampling, got {args.temperature}.")
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1):
        raise UsageError(f"--gamma and --lam must be in [0, 1], got {args.gamma}, {args.lam}.")
    if min(args.cliprange, args.cliprange_value, args.target_kl) <= 0:
        raise UsageError("--cliprange, --cliprange_value and --target_kl must be positive.")
    if args.use_score_norm and not args.use_score_scaling:
        raise UsageError("--use_score_norm needs --use_score_scaling.")
    if args.score_clip is not None and args.score_clip <= 0:
        raise UsageError(f"--score_clip must be positive, got {args.score_clip}.")
    if args.num_sample_generations < 0:
        raise UsageError(f"--num_sample_generations must be >= 0, got {args.num_sample_generations}.")
    if not (args.sft_model_path or args.model_name_or_path):
        raise UsageError("pass the policy with --sft_model_path or --model_name_or_path.")
    utils.evaluation.check_args(args)
    if num_prompts is None:
        return args

    given = {k: getattr(args, k) for k in ("batch_size", "mini_batch_size", "local_batch_size")}
    if given["batch_size"]:
        utils.run.exact_div(given["batch_size"], args.num_mini_batches, "--batch_size / --num_mini_batches")
    args.world_size = world_size
    args.local_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    )
    args.batch_size = args.local_batch_size * world_size
    args.mini_batch_size = utils.run.exact_div(
        args.batch_size, args.num_mini_batches, "batch_size / --num_mini_batches"
    )
    args.local_mini_batch_size = utils.run.exact_div(
        args.local_batch_size, args.num_mini_batches, "local_batch_size / --num_mini_batches"
    )
    for name, value in given.items():
        if value and value != getattr(args, name):
            raise UsageError(
                f"--{name} {value} does not match per_device_train_batch_size * "
                f"gradient_accumulation_steps * num_mini_batches (* world_size) = {getattr(args, name)}; "
                "change those flags instead."
            )
    given_episodes = args.total_episodes is not None
    if not given_episodes:
        args.total_episodes = int(args.num_train_epochs * num_prompts)
    args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    if num_prompts < args.batch_size:
        raise UsageError(
            f"the train split has {num_prompts} prompts, fewer than batch_size {args.batch_size}; "
            "lower --per_device_train_batch_size, --gradient_accumulation_steps or --num_mini_batches."
        )
    if args.total_episodes < args.batch_size:  # TRL would round it up to one whole update, silently
        if given_episodes:
            asked = f"--total_episodes {args.total_episodes}"
        else:
            asked = f"--num_train_epochs {args.num_train_epochs} ({args.total_episodes} episodes)"
        raise UsageError(
            f"{asked} is fewer than the {args.batch_size} episodes of one update "
            "(per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches * processes); "
            "ask for more or lower those flags."
        )
    return args


# ---- training ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What a run holds fixed from setup to save."""

    accelerator: object
    tokenizer: object
    model: PolicyAndValue  # the policy and the critic, prepared together
    optimizer: torch.optim.Optimizer
    ref_policy: torch.nn.Module
    scorer: utils.scoring.RewardScorer
    engine: object
    recompute_old_logprobs: bool
    policy_path: str
    prompt_ids: list
    raw_prompts: list
    eval_prompt_ids: list
    eval_texts: list
    eval_raw_prompts: list
    held_out: bool  # the eval prompts are --dataset_test_split's (else a table of the first training prompts)
    kl_controller: AdaptiveKLController
    moments: RunningMoments | None
    batches: object
    shuffle_generator: torch.Generator
    checkpointer: utils.checkpoint.Checkpointer
    checkpointed: dict
    tracker: utils.tracking.Tracker
    start_step: int


def setup(args: Args) -> Run:
    """Flags, data, tokenizer, models, optimizer, scorer, vLLM engine, resume and tracker, in that order."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    utils.loading.use_model_flags(args)
    # Everything that can be checked before a model is loaded.
    fill_sizes(args, 1)
    utils.generation.sampling_knobs(args)  # checks the sampling flags given (utils/sampling_knobs.py)
    if args.use_vllm:  # utils/vllm.py is optional: imported only with --use_vllm
        utils.run.optional_module("utils.vllm", "--use_vllm").check_args(args)
    accelerator = utils.run.make_accelerator(
        args, args.gradient_accumulation_steps, micro_batch_size=args.per_device_train_batch_size
    )
    lora = utils.run.optional_module("utils.lora", "--use_peft") if args.use_peft else None
    if lora is not None:
        lora.check_args(args, accelerator)
    reward_funcs = utils.run.optional_module("utils.reward_funcs", "--reward_fn") if args.reward_fn else None
    reward_fn = reward_funcs.load_reward_fn(args.reward_fn) if reward_funcs else None
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("models", args.run_name)
    overwrite = args.overwrite_output_dir or bool(args.resume_from_checkpoint)
    utils.checkpoint.check_output_dir(args.output_dir, overwrite)
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # checks the resume path
    recompute_old_logprobs = args.recompute_old_logprobs == "true" or (
        args.recompute_old_logprobs == "auto" and accelerator.mixed_precision == "bf16"
    )

    # Tokenizer and prompts.
    if args.sft_model_path:
        policy_path, policy_flag = args.sft_model_path, "--sft_model_path"
    else:
        policy_path, policy_flag = args.model_name_or_path, "--model_name_or_path"
    if args.model_name_or_path:
        tokenizer_path, tokenizer_flag = args.model_name_or_path, "--model_name_or_path"
    else:
        tokenizer_path, tokenizer_flag = policy_path, policy_flag
    where = f"--dataset_name {args.dataset_name} split {args.dataset_train_split}"
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.data.check_columns(dataset, ["prompt"], where)
    if reward_funcs:
        reward_funcs.check_reward_fn(reward_fn, args.reward_fn, ["prompt"])  # the only column ppo passes
    fill_sizes(args, accelerator.num_processes, len(dataset))
    eval_dataset = utils.evaluation.load_test_split(args, "ppo.py")
    held_out = eval_dataset is not None
    if not held_out:  # the sample tables show the first training prompts
        eval_dataset = dataset.select(range(min(len(dataset), 4)))
    tokenizer = utils.loading.load_tokenizer(tokenizer_path, tokenizer_flag, args.chat_template_path)
    if args.stop_token == "eos":
        if args.stop_token_id is not None and args.stop_token_id != tokenizer.eos_token_id:
            raise UsageError(f"--stop_token eos (id {tokenizer.eos_token_id}) and --stop_token_id disagree.")
        args.stop_token_id = tokenizer.eos_token_id
    prompt_texts = utils.data.prompt_texts(dataset, tokenizer, where)
    prompt_ids = utils.chat.tokenize_prompts(tokenizer, prompt_texts, args.max_prompt_length)
    if any(len(ids) == 0 for ids in prompt_ids):
        raise UsageError(f"the train split has {sum(len(ids) == 0 for ids in prompt_ids)} empty prompt(s).")
    eval_texts = utils.data.prompt_texts(eval_dataset, tokenizer, "the test split")
    # The reward reads the dataset's own prompts (text or messages), as in TRL.
    raw_prompts = utils.data.column(dataset, "prompt")
    eval_raw_prompts = utils.data.column(eval_dataset, "prompt")
    eval_prompt_ids = utils.chat.tokenize_prompts(tokenizer, eval_texts, args.max_prompt_length)
    prompt_ids, eval_prompt_ids = utils.loading.fit_prompts(
        [prompt_ids, eval_prompt_ids], args, "response_length", policy_path, policy_flag
    )

    # Models, seeded alike on every process for a new value head.
    set_seed(args.seed)
    rank = accelerator.process_index
    policy = utils.loading.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    ref_policy = None  # LoRA: the policy with its adapter off; the critic trains whole, as TRL's
    if lora is None:
        ref_policy = utils.loading.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    else:
        policy = lora.add_adapter(policy, args, args.seed)
    reward_model = utils.scoring.load_reward_model(args.reward_model_path) if args.reward_model_path else None
    reward_tokenizer = utils.scoring.load_reward_tokenizer(args.reward_tokenizer_path, args.reward_model_path)
    same_tokens = reward_tokenizer is None or utils.scoring.same_tokenizer(tokenizer, reward_tokenizer)
    # A reward model with another tokenizer cannot be the critic (it reads the policy's ids).
    critic_flag = "--value_model_path" if args.value_model_path else "--reward_model_path"
    critic_path = args.value_model_path or (args.reward_model_path if same_tokens else None)
    if not args.value_model_path and not same_tokens:
        accelerator.print(
            "critic: the reward model has its own tokenizer, so the critic starts from "
            "--sft_model_path with a new value head (pass --value_model_path to choose one)"
        )
    critic_flag, critic_path = (critic_flag, critic_path) if critic_path else (policy_flag, policy_path)
    critic = utils.loading.from_pretrained(
        AutoModelForSequenceClassification, critic_path, critic_flag, num_labels=1
    )
    critic_rows, policy_rows = (m.get_input_embeddings().num_embeddings for m in (critic, policy))
    if critic_rows < policy_rows:  # the critic reads the policy's ids: they would index past its embedding
        raise UsageError(
            f"{critic_flag} {critic_path} has {critic_rows} token embeddings, fewer than the policy's "
            f"{policy_rows}; the critic reads the policy's tokens, so give it the policy's tokenizer."
        )
    for m in [m for m in (policy, ref_policy, critic, reward_model) if m is not None]:
        utils.loading.disable_dropout(m)  # so that recomputed logprobs equal sampling's
        if getattr(m.config, "pad_token_id", None) is None:
            m.config.pad_token_id = tokenizer.pad_token_id
    for m in (policy, critic) if args.gradient_checkpointing else ():
        utils.loading.enable_gradient_checkpointing(m)
    model = PolicyAndValue(policy, critic)
    optimizer = utils.run.trainer_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    if lora is not None:
        ref_policy = lora.AdapterOff(utils.run.bare(model).policy)
    else:
        ref_policy = utils.run.prepare_frozen(ref_policy, accelerator)
    max_model_len = max(map(len, prompt_ids)) + args.response_length
    engine = None
    if args.use_vllm:
        vllm_module = utils.run.optional_module("utils.vllm", "--use_vllm")
        engine = vllm_module.Engine(args, accelerator, policy_path, max_model_len)
    reward_model = utils.run.prepare_frozen(reward_model, accelerator) if reward_model is not None else None
    scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
    accelerator.print(scorer.describe())

    # Resume, and replay the prompt order to where it stopped.
    kl_controller = AdaptiveKLController(args.kl_coef, args.target_kl, args.kl_horizon)
    moments = RunningMoments() if args.use_score_scaling else None
    shuffle_generator = torch.Generator().manual_seed(args.seed + 100003 * rank)
    checkpointed = dict(
        models={"model": model}, optimizers={"model": optimizer}, generators={"shuffle": shuffle_generator}
    )
    state = checkpointer.resume(**checkpointed) or {"step": 0}
    if state["step"]:
        kl_controller.value = state["kl_coef"]
        if moments is not None:
            moments.mean, moments.var, moments.count = state["score_moments"]
    batches = utils.data.prompt_batches(
        len(prompt_ids), args.local_batch_size, args.world_size, rank, args.seed
    )
    for _ in range(state.get("prompt_batches", 0)):
        next(batches)
    tracker = utils.tracking.Tracker(args, checkpointer)
    return Run(
        accelerator=accelerator,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        ref_policy=ref_policy,
        scorer=scorer,
        engine=engine,
        recompute_old_logprobs=recompute_old_logprobs,
        policy_path=policy_path,
        prompt_ids=prompt_ids,
        raw_prompts=raw_prompts,
        eval_prompt_ids=eval_prompt_ids,
        eval_texts=eval_texts,
        eval_raw_prompts=eval_raw_prompts,
        held_out=held_out,
        kl_controller=kl_controller,
        moments=moments,
        batches=batches,
        shuffle_generator=shuffle_generator,
        checkpointer=checkpointer,
        checkpointed=checkpointed,
        tracker=tracker,
        start_step=state["step"],
    )


def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    device, start = accelerator.device, run.start_step
    whitening = accelerator if args.whiten_across_processes else None  # None: per process, as TRL's PPO
    episode, start_time, metrics = start * args.batch_size, time.time(), {}
    updates, schedule = (
        range(start + 1, args.num_total_batches + 1),
        utils.run.lr_schedule(args, args.num_total_batches),
    )
    progress = tqdm(
        updates, initial=start, total=args.num_total_batches, disable=not accelerator.is_local_main_process
    )
    if args.eval_on_start and start == 0 and run.held_out:
        run.tracker.log(held_out_table(args, run, 0), 0)
    for update in progress:
        episode += args.batch_size
        lr = schedule(update - 1)  # stepped once an update, as TRL's PPO
        for group in optimizer.param_groups:
            group["lr"] = lr
        kl_coef = run.kl_controller.value if args.adaptive_kl else args.kl_coef

        # 1. Sample: completions, their logprobs, the reference's, the critic's values.
        model.eval()
        examples = next(run.batches)  # dataset indices of this process's prompts
        queries, query_mask = utils.generation.left_pad(
            [run.prompt_ids[i] for i in examples], run.tokenizer.pad_token_id, device
        )
        context_length = queries.size(1)
        trainer_state = utils.scoring.TrainerState(
            global_step=update - 1,
            max_steps=args.num_total_batches,
            epoch=(update - 1) * args.batch_size / len(run.prompt_ids),
        )
        prompts = [run.raw_prompts[i] for i in examples]
        with accelerator.autocast():
            data = rollout(args, run, queries, query_mask, update, prompts, trainer_state)
        response_mask, scores = data["response_mask"], data["scores"]
        run.tracker.check_finite(update, scores=scores)

        # 2. Score: optional score shaping; per-token rewards.
        # ALGO LOGIC: r_t = -kl_coef * KL_t, plus the (shaped) score at the stop token
        if run.moments is not None:
            run.moments.update(accelerator.gather(scores))
        shaped_scores = shape_scores(scores, run.moments, args.use_score_norm, args.score_clip)
        rewards, non_score_rewards = per_token_rewards(data["kl"], shaped_scores, response_mask, kl_coef)
        if args.whiten_rewards:
            rewards = whiten(rewards, response_mask, shift_mean=False, accelerator=whitening)

        # 3. Advantages: GAE, whitened over this process's tokens (all: --whiten_across_processes).
        advantages, returns = gae(rewards, data["values"], response_mask, args.gamma, args.lam)
        advantages = whiten(advantages, response_mask, accelerator=whitening)

        # 4. Update: PPO epochs over shuffled mini-batches of accumulated micro-batches.
        model.train()
        step_stats, grad_norms, early_stopped = [], [], False
        ratio_sums = torch.zeros(3, device=device, dtype=torch.float64)  # sum, sum of squares, count
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.local_batch_size, generator=run.shuffle_generator).to(device)
            for mini_batch in order.split(args.local_mini_batch_size):
                for idx in mini_batch.split(args.per_device_train_batch_size):
                    run.checkpointer.boundary()
                    mb_mask, mb_query_responses = response_mask[idx], data["query_responses"][idx]
                    with accelerator.accumulate(model):
                        # ALGO LOGIC: clipped policy and value losses
                        new_logprobs, entropy, new_values = model(
                            mb_query_responses, data["attention_mask"][idx], context_length, args.temperature
                        )
                        pg_loss, pg_clipfrac, approxkl, ratio = policy_loss(
                            new_logprobs, data["logprobs"][idx], advantages[idx], mb_mask, args.cliprange
                        )
                        vf_loss, vf_clipfrac = value_loss(
                            new_values, data["values"][idx], returns[idx], mb_mask, args.cliprange_value
                        )
                        accelerator.backward(pg_loss + args.vf_coef * vf_loss)
                        measured = utils.run.clip_grad_norm(accelerator, model, args.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                        if accelerator.sync_gradients:
                            grad_norms.append(utils.run.grad_norm_after_step(model, measured))
                    with torch.no_grad():
                        entropy_mean = utils.stats.masked_mean(entropy, mb_mask)
                        step_stats.append(
                            torch.stack([approxkl, pg_clipfrac, pg_loss, vf_loss, vf_clipfrac, entropy_mean])
                        )
                        mb_ratio = ratio[mb_mask.bool()].double()  # float64: ratios near 1 vary very little
                        ratio_sums += torch.stack(
                            [mb_ratio.sum(), (mb_ratio**2).sum(), mb_ratio.new_tensor(mb_ratio.numel())]
                        )
                # One early-stop decision for all processes, on the mini-batch's approximate KL.
                mini_batch_kl = torch.stack(step_stats[-args.gradient_accumulation_steps :])[:, 0].mean()
                if (
                    args.max_approx_kl is not None
                    and utils.run.gathered_mean(accelerator, mini_batch_kl) > args.max_approx_kl
                ):
                    early_stopped = True
                    break
            if early_stopped:
                break

        # 5. Metrics, averaged over processes; a non-finite value stops the run before a save.
        with torch.no_grad():
            update_stats = accelerator.gather(torch.stack(step_stats).float().mean(0)[None]).mean(0).tolist()
            approxkl_avg, pg_clipfrac_avg, pg_loss_avg, vf_loss_avg, vf_clipfrac_avg, entropy_avg = (
                update_stats
            )
            measured_norms = [n for n in grad_norms if n is not None]
            grad_norm = sum(measured_norms) / len(measured_norms) if measured_norms else None
            total_loss = pg_loss_avg + args.vf_coef * vf_loss_avg
            run.tracker.check_finite(update, loss=total_loss, grad_norm=grad_norm)
            all_ratio_sums = accelerator.reduce(ratio_sums, reduction="sum")
            ratio_mean = (all_ratio_sums[0] / all_ratio_sums[2]).item()
            num_eos_tokens = accelerator.reduce(data["contains_eos"].sum(), reduction="sum")
            metrics = {
                "eps": int((episode - start * args.batch_size) / (time.time() - start_time)),
                "objective/kl": utils.run.gathered_mean(accelerator, data["kl"].sum(1).mean()),
                "objective/kl_coef": kl_coef,
                "objective/entropy": utils.run.gathered_mean(
                    accelerator, (-data["logprobs"] * response_mask).sum(1).mean()
                ),
                "objective/non_score_reward": utils.run.gathered_mean(
                    accelerator, non_score_rewards.sum(1).mean()
                ),
                "objective/scores": utils.run.gathered_mean(accelerator, scores.mean()),
                "objective/rlhf_reward": utils.run.gathered_mean(
                    accelerator, (scores + non_score_rewards.sum(1)).mean()
                ),
                "policy/approxkl_avg": approxkl_avg,
                "policy/clipfrac_avg": pg_clipfrac_avg,
                "policy/entropy_avg": entropy_avg,
                "policy/early_stopped": float(early_stopped),
                "loss/policy_avg": pg_loss_avg,
                "loss/value_avg": vf_loss_avg,
                "val/clipfrac_avg": vf_clipfrac_avg,
                "val/ratio": ratio_mean,
                "val/ratio_var": max((all_ratio_sums[1] / all_ratio_sums[2]).item() - ratio_mean**2, 0.0),
                "val/num_eos_tokens": int(num_eos_tokens.item()),
                "val/response_length": utils.run.gathered_mean(
                    accelerator, response_mask.float().sum(1).mean()
                ),
                "learning_rate": lr,
                "episode": episode,
            }
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            if utils.run.zero_stage(accelerator) == 3:
                metrics["zero3/local_param_share"] = utils.run.zero3().local_param_share(model)
            if not run.scorer.same_tokenizer:  # rows re-encoded for the reward model and cut to its length
                truncated = torch.tensor(run.scorer.take_num_truncated(), device=device)
                metrics["val/num_reward_truncated"] = accelerator.reduce(truncated, reduction="sum").item()
            metrics.update(utils.rollout.mean_over_processes(accelerator, run.scorer.take_logged()))
        if args.adaptive_kl:
            run.kl_controller.update(metrics["objective/kl"], args.batch_size)

        # 6. Held-out evaluation and samples (greedy); checkpoint.
        if utils.evaluation.due(update, args.num_total_batches, args):
            metrics.update(held_out_table(args, run, update))
        run.tracker.log(metrics, update)
        del data, rewards, advantages, returns
        moments = run.moments
        moments_state = [moments.mean, moments.var, moments.count] if moments is not None else None
        checkpoint_state = {
            "episode": episode,
            "prompt_batches": update,
            "kl_coef": run.kl_controller.value,
            "score_moments": moments_state,
        }
        run.checkpointer.maybe_save(update, **run.checkpointed, state=checkpoint_state)

    # 7. Save the policy alone (no value head), with its tokenizer and a model card.
    saving = utils.run.optional_module("utils.lora", "--use_peft") if args.use_peft else utils.saving
    saving.save_model(run.checkpointer, model, run.tokenizer, args, "PPO", run.policy_path, metrics, "policy")
    run.tracker.close()
    utils.run.end_run(accelerator, run.engine)
    return metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
