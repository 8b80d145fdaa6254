"""REINFORCE Leave-One-Out (RLOO) for language models, in one file.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs", https://arxiv.org/abs/2402.14740; the estimator is from Kool et al. 2019, "Buy 4 REINFORCE
Samples, Get a Baseline for Free!".

The policy samples `--rloo_k` completions per prompt. A completion's reward is its score minus `kl_coef`
times its summed KL to the frozen SFT model; its baseline is the mean reward of the prompt's other k-1
completions, so there is no critic. `--token_level_kl` puts the KL on every token instead (REINFORCE++ style).
Several epochs or mini-batches use PPO's clipped objective. Rows are completion-major: completion c of prompt
p is row `c * P + p`.

The flags are TRL 0.19's RLOOConfig or TRL 1.16's (TRL_RENAMED, TRL1_ONLY): a command line that sets a
TRL-1.16-only flag gets TRL 1.16's defaults and meanings.

    python rloo.py --sft_model_path models/sft --reward_model_path models/reward \
        --dataset_name data/tldr/prompts --rloo_k 2 --per_device_train_batch_size 16 \
        --gradient_accumulation_steps 16 --num_mini_batches 2 --num_ppo_epochs 2 --learning_rate 3e-6 \
        --total_episodes 1000000 --kl_coef 0.03 --stop_token eos --missing_eos_penalty 1.0 \
        --local_rollout_forward_batch_size 16 --output_dir models/rloo
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch

import utils.checkpoint
import utils.data
import utils.evaluation
import utils.generation
import utils.loading
import utils.logprobs
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
    seed: int | None = None
    """seed of sampling and shuffling; None: 1 / 42 (TRL 0.19 / 1.16)"""
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
    output_dir: str = "models/rloo"
    """where the trained policy and the checkpoints go"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir (moved to <output_dir>.replaced-<time>)"""
    push_to_hub: bool = False
    """push the policy (no checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int | None = None
    """checkpoint every this many updates (0: only on SIGTERM/SIGINT); None: 0 / 500"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint folder, or 'latest' in --output_dir, to continue from"""

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
    """the initial policy and the frozen reference of the KL penalty"""
    reward_model_path: str | None = None
    """sequence classifier (one label) as a reward, before the --reward_funcs (TRL's order)"""
    reward_model_name_or_path: str | None = None
    """TRL 1.16's name of --reward_model_path"""
    reward_tokenizer_path: str | None = None
    """the reward model's tokenizer if not the policy's (None: --reward_model_path's)"""
    reward_fn: str | None = None
    """TRL 0.19: one reward function (as in --reward_funcs)"""
    reward_funcs: list[str] | None = None
    """path/to/file.py:function or module.function: one float (or None) per completion"""
    reward_weights: list[float] | None = None
    """one weight per reward, the reward model first; None: all 1"""
    dataset_name: str = "trl-lib/tldr"
    """hub id, save_to_disk folder, or json/jsonl/parquet files with a `prompt` column"""
    dataset_config: str | None = None
    """the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split of the training prompts"""
    dataset_test_split: str | None = None
    """held-out prompts: evaluated (eval/...) and shown at the sample tables; None: no evaluation, tables of the rollout"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer folder) for conversational prompts"""
    context_overflow: Literal["refuse", "cut"] = "refuse"
    """sequences longer than the model's positions: refuse (before loading it) or cut them to fit (one line)"""
    max_prompt_length: int | None = None
    """keep only the last this many prompt tokens (not a TRL 1.16 flag); None: whole prompts, as TRL 1.16"""
    bf16: bool = False
    """bf16 mixed precision"""
    gradient_checkpointing: bool = False
    """gradient checkpointing in the policy"""
    disable_dropout: bool = True
    """turn the policy's dropout off, so that the training forward's logprobs equal sampling's (TRL: False)"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters instead of every weight; the reference is then the policy with its adapter off"""
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

    # Sampling
    rloo_k: int | None = None
    """completions per prompt (at least 2); None: 2"""
    num_generations: int | None = None
    """TRL 1.16's name of --rloo_k"""
    response_length: int | None = None
    """tokens sampled per completion (then truncated after the stop token); None: 53 / 512"""
    max_completion_length: int | None = None
    """TRL 1.16's name of --response_length"""
    temperature: float | None = None
    """sampling temperature, also of the logprobs; None: 0.7 / 1.0"""
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
    """eos: truncate after the EOS; None: no stop / eos (unless --stop_token_id)"""
    stop_token_id: int | None = None
    """truncate completions after this token id"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / reference / reward forward pass"""
    use_vllm: bool = False
    """sample with vLLM (pip install -r requirements-vllm.txt); old logprobs from a training forward"""
    vllm_mode: Literal["colocate"] = "colocate"
    """colocate: one vLLM engine per training process (TRL's server mode is not provided)"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of GPU memory for vLLM (CPU: VLLM_CPU_KVCACHE_SPACE GiB, default 1)"""
    vllm_tensor_parallel_size: int = 1
    """processes sharing one vLLM engine (must divide the number of processes)"""
    recompute_old_logprobs: Literal["auto", "true", "false"] = "auto"
    """old logprobs from the training forward pass, not sampling's; auto: under bf16"""

    # Algorithm
    trl_defaults: Literal["auto", "0.19", "1.16"] = "auto"
    """whose defaults fill unset flags (TRL 0.19 / 1.16); auto: 1.16 if a 1.16-only flag is set"""
    learning_rate: float | None = None
    """AdamW learning rate; None: 3e-6 / 1e-6"""
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
    ] = "linear"
    """transformers' schedule after the warmup; linear: decay to 0 over the updates (TRL 1.16 dialect: over the optimizer steps)"""
    warmup_steps: float = 0.0
    """linear warmup over this many optimizer steps, or below 1 this fraction of them (TRL 1.16)"""
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
    """clip the gradient norm to this (0: no clipping); None: 0 / 1.0"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    num_mini_batches: int | None = None
    """optimizer steps per epoch over an update's batch; None: 1"""
    generation_batch_size: int | None = None
    """TRL 1.16: completions per rollout on all processes = batch_size"""
    steps_per_generation: int | None = None
    """TRL 1.16: micro-batches per rollout = gradient_accumulation_steps * num_mini_batches"""
    num_ppo_epochs: int | None = None
    """epochs over each batch (> 1 relies on the clipped objective); None: 4 / 1"""
    num_iterations: int | None = None
    """TRL 1.16's name of --num_ppo_epochs"""
    max_steps: int | None = None
    """TRL 1.16: optimizer steps, rounded up to whole updates (-1: from --num_train_epochs); None: -1"""
    num_train_epochs: float | None = None
    """TRL 1.16: passes over the prompts if --max_steps is -1; None: 3"""
    total_episodes: int | None = None
    """TRL 0.19: completions to train on (None: each prompt once)"""
    kl_coef: float | None = None
    """weight of the KL penalty subtracted from the reward; None: 0.05"""
    beta: float | None = None
    """TRL 1.16's name of --kl_coef"""
    cliprange: float | None = None
    """clip range of the ratio; None: 0.2"""
    epsilon: float | None = None
    """TRL 1.16's name of --cliprange"""
    epsilon_high: float | None = None
    """TRL 1.16: upper clip range, 1 + epsilon_high (DAPO); None: --cliprange"""
    mask_truncated_completions: bool = False
    """TRL 1.16: completions without a stop token get no gradient and no KL"""
    token_level_kl: bool = False
    """KL penalty on every token, the score on the EOS token (REINFORCE++ style)"""
    whiten_rewards: bool = False
    """whiten the rewards over the batch (variance 1, mean kept)"""
    normalize_reward: bool = False
    """scores to mean 0, std 1 over the batch, clipped to +-reward_clip_range"""
    reward_clip_range: tuple[float, ...] | None = None
    """one value: clip of normalized scores (None: 10); two (TRL 1.16): clamp the reward"""
    normalize_advantage: bool = False
    """TRL 0.19: whiten the advantages over the batch, / sqrt(var + 1e-8)"""
    normalize_advantages: bool = False
    """TRL 1.16: (A - mean) / (std + 1e-4) over the batch, unscorable left out"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of completions without EOS"""

    # Logging
    num_sample_generations: int = 10
    """times to evaluate and print sample completions after the first update (0: never)"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """no: no evaluation or sample tables; steps: at --num_sample_generations or --eval_steps points"""
    eval_steps: int | None = None
    """evaluate and print the sample table every this many updates instead (and after the last)"""
    eval_on_start: bool = False
    """evaluate before the first update too (logged at step 0; not again on resume)"""
    per_device_eval_batch_size: int = 8
    """held-out completions per process per evaluation batch (whole prompts, at least one)"""
    num_generations_eval: int | None = None
    """completions sampled per held-out prompt; None: --rloo_k (TRL 1.16)"""

    # Tools (multi-turn rollouts, TRL 1.16 flags: utils/tools.py, docs/tools.md)
    tools: list[str] | None = None
    """path/to/file.py:function or module.function: Python functions (type hints, docstring) the policy may call"""
    max_tool_calling_iterations: int | None = None
    """rounds of tool calls and answers per completion at most (None: until a turn calls none or the length ends)"""
    tool_timeout: float | None = 30.0
    """seconds a tool call may take before it is a failure (not a TRL 1.16 flag; None: no limit)"""
    environment_factory: list[str] | None = None
    """path/to/file.py:Class, one per rollout: reset(**row) first, its methods tools (name=...: by row, docs/tools.md)"""
    rollout_func: str | None = None
    """path/to/file.py:function or module.function: your own sampler, as TRL's rollout_func (docs/tools.md)"""

    # Filled in at runtime
    dialect: str = ""
    """TRL version of the flags and defaults: 0.19 or 1.16"""
    world_size: int = 0
    """number of processes"""
    local_batch_size: int = 0
    """completions per process per update"""
    batch_size: int = 0
    """completions per update on all processes"""
    local_mini_batch_size: int = 0
    """completions per process per optimizer step"""
    mini_batch_size: int = 0
    """completions per optimizer step on all processes"""
    local_dataloader_batch_size: int = 0
    """prompts per process per update = local_batch_size / rloo_k"""
    num_total_batches: int = 0
    """number of updates"""


# ---- the math ----------------------------------------------------------------------------------------------
def rloo_baseline(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Baseline [B] = mean_{c' != c} rewards[c' * P + p] for row c * P + p, NaN rewards left out."""
    grouped = rewards.view(k, -1)  # [k, P]
    if not grouped.isnan().any():
        return ((grouped.sum(0, keepdim=True) - grouped) / (k - 1)).flatten()
    scored = (~grouped.isnan()).sum(0, keepdim=True)
    return ((grouped.nansum(0, keepdim=True) - grouped) / (scored - 1)).flatten()


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """A_i = R_i - mean of the other k-1 rewards of its prompt. rewards [B] completion-major -> [B]."""
    return rewards - rloo_baseline(rewards, k)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Reward [B] = sum_f w_f r_f over [B, F], NaN (a function's None) skipped; NaN where every r_f is NaN."""
    total = (rewards_per_func * weights).nansum(1)
    return total.masked_fill(rewards_per_func.isnan().all(1), math.nan)


def standardize_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean) / (std + 1e-4) over the actions in mask ([B] or [B, R]), NaN entries left out and kept."""
    kept = advantages[mask.bool() & ~advantages.isnan()]
    return (advantages - kept.mean()) / (kept.std() + 1e-4) * mask


def sequence_level_rewards(scores, kl, mask, kl_coef):
    """R [B] = score - kl_coef * sum_t kl_t over the response tokens (kl, mask [B, R])."""
    return scores - kl_coef * (kl * mask).sum(1)


def token_level_rewards(scores, kl, lengths, kl_coef):
    """r_t [B, R] = -kl_coef * kl_t, plus the score at t = lengths - 1 (the EOS if any); 0 on padding."""
    mask = utils.generation.lengths_to_mask(lengths, kl.size(1))
    rewards = -kl_coef * kl * mask
    return rewards.scatter_add(1, (lengths - 1)[:, None], scores[:, None].to(rewards.dtype))


def token_level_advantages(rewards: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """A_t [B, R] = G_t - mean of the other k-1 completions' G_0, G_t = sum_{s >= t} r_s; 0 on padding."""
    rewards = rewards * mask
    returns = rewards.flip(1).cumsum(1).flip(1)
    return (returns - rloo_baseline(returns[:, 0], k)[:, None]) * mask


def finished(responses: torch.Tensor, lengths: torch.Tensor, finished_ids: torch.Tensor) -> torch.Tensor:
    """[B] True where the last kept token is in `finished_ids` (stop, EOS, pad): not truncated."""
    return torch.isin(responses.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1), finished_ids)


def normalize_scores(scores: torch.Tensor, clip_range: float) -> torch.Tensor:
    """(scores - mean) / std over the batch, clipped to [-clip_range, clip_range]."""
    return ((scores - scores.mean()) / (scores.std() + 1e-8)).clamp(-clip_range, clip_range)


def policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange, cliprange_high=None):
    """L = mean over actions of -min(r A, clip(r, 1 - eps, 1 + eps_high) A); logprobs, mask [B, R].

    An action is a completion for advantages [B] (r of the summed log-ratio), a token for [B, R].
    Returns (loss, ratio per action, clip fraction, approximate KL 0.5 * E[log-ratio^2])."""
    log_ratio = (new_logprobs - old_logprobs) * mask
    weights = mask.float()
    if advantages.dim() == 1:
        log_ratio, weights = log_ratio.sum(1), torch.ones_like(advantages)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + (cliprange_high or cliprange))
    per_action = torch.max(unclipped, clipped)
    loss = utils.stats.masked_mean(per_action, weights)
    with torch.no_grad():
        clipfrac = utils.stats.masked_mean((clipped > unclipped).float(), weights)
        approxkl = utils.stats.masked_mean(0.5 * log_ratio**2, weights)
    return loss, ratio.detach()[weights.bool()], clipfrac, approxkl


def learning_rate(args, schedule, update: int, steps_done: int, steps_per_update: int) -> float:
    """The rate of the next optimizer step of `update` (from 1) after `steps_done` of its steps: `schedule`
    (utils.run.lr_schedule) over the updates (TRL 0.19: one rate an update) or the optimizer steps (TRL 1.16)."""
    if args.dialect == "1.16":
        return schedule((update - 1) * steps_per_update + steps_done)
    return schedule(update - 1)


def batch_advantages(args, scores, kl, mask, lengths, gather=lambda values: values, rank=0):
    """Scores [B] (clamped or normalized) - kl_coef * KL (kl, mask [B, R]) -> leave-one-out advantages,
    normalized per the flags over every process (`gather`); NaN scores get A = 0.
    Returns (advantages [B] or [B, R], action mask, scores)."""
    B, k = scores.size(0), args.rloo_k
    # NaN becomes 0 only in a group with an unscored completion; an overflow elsewhere stops the run.
    unscorable = scores.isnan().view(k, -1).any(0, keepdim=True).expand(k, -1).flatten()

    def local(values):
        return values[rank * B : (rank + 1) * B]

    def whiten(values, action_mask, shift_mean=True):
        missing = values.isnan()
        kept = gather((action_mask & ~missing).long())
        whitened = utils.stats.masked_whiten(gather(values.masked_fill(missing, 0)), kept, shift_mean)
        return (local(whitened) * action_mask).masked_fill(missing, math.nan)

    if len(args.reward_clip_range or ()) == 2:
        scores = scores.clamp(*args.reward_clip_range)
    if args.normalize_reward:
        all_scores = gather(scores).clone()
        scored = ~all_scores.isnan()
        all_scores[scored] = normalize_scores(all_scores[scored], args.reward_clip_range[0])
        scores = local(all_scores)
    if args.token_level_kl:
        rewards = token_level_rewards(scores, kl, lengths, args.kl_coef)
        action_mask = mask
    else:
        rewards = sequence_level_rewards(scores, kl, mask, args.kl_coef)
        action_mask = torch.ones_like(rewards, dtype=torch.bool)
    if args.whiten_rewards:
        rewards = whiten(rewards, action_mask, shift_mean=False)
    if args.token_level_kl:
        advantages = token_level_advantages(rewards, mask, k)
    else:
        advantages = rloo_advantages(rewards, k)
    if args.normalize_advantage:
        advantages = whiten(advantages, action_mask)
    if args.normalize_advantages:
        advantages = local(standardize_advantages(gather(advantages), gather(action_mask.long())))
    unscorable = unscorable[:, None] if advantages.dim() == 2 else unscorable
    return advantages.masked_fill(unscorable & advantages.isnan(), 0.0), action_mask, scores


# ---- rollout -----------------------------------------------------------------------------------------------
@torch.no_grad()
def sample(args, run, queries, query_mask, num_completions, key, first_prompt, engine=None):
    """(responses, lengths, response_mask [n * P, R], sampling logprobs, tool_mask): n = num_completions per
    prompt [P, Q], completion-major, cut after the stop token; tool_mask: the sampled tokens (with --tools, not
    the tool answers between turns). A call from prompt p uses noise (seed, *key, first_prompt + p), the later
    turns (seed, *key, first_prompt, 1)."""
    chunk, P = args.local_rollout_forward_batch_size, queries.size(0)
    knobs = utils.generation.sampling_knobs(args)  # once a call, not once a chunk
    if run.rollout_func is not None:  # sampled in rollout_queries (utils/rollout_func.py)
        return run.rollout_func.tensors(args.response_length, run.pad_id, queries.device)
    prompts_per_call = max(1, chunk // num_completions)
    responses, logprobs = [], []
    if engine is not None:  # outside the gathering below
        engine.sync_weights(run.policy, run.accelerator)
    generate = engine.generate if engine is not None else utils.generation.generate
    run.policy.eval()  # keeps the KV cache on under gradient checkpointing
    with utils.run.gathered_for_generation(run.policy, run.accelerator) as model:
        for start in range(0, P, prompts_per_call):
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            prompt = torch.arange(start, min(start + prompts_per_call, P), device=queries.device)
            rows = prompt.repeat(num_completions)
            noise = utils.generation.sampling_generator(
                args.seed, *key, first_prompt + start, device=queries.device
            )
            query_responses, call_logprobs = generate(
                model,
                queries[rows],
                query_mask[rows],
                args.response_length,
                args.temperature,
                rows.numel(),
                noise,
                **knobs,
            )
            responses.append(query_responses[:, queries.size(1) :].unflatten(0, (num_completions, -1)))
            logprobs.append(call_logprobs.unflatten(0, (num_completions, -1)))
        responses = torch.cat(responses, 1).flatten(0, 1)
        logprobs = torch.cat(logprobs, 1).flatten(0, 1)
        responses, lengths = utils.generation.truncate_response(responses, run.stop_token_ids, run.pad_id)
        if run.tools is not None:  # the tool calls, their answers and the next turns (utils/tools.py)
            first_turn = (queries, query_mask, responses, lengths, logprobs)
            noise = utils.generation.sampling_generator(
                args.seed, *key, first_prompt, 1, device=queries.device
            )
            R, T = args.response_length, args.temperature
            return run.tools.continue_batch(
                generate, model, first_turn, R, T, chunk, noise, run.eos_ids, **knobs
            )
    response_mask = utils.generation.lengths_to_mask(lengths, args.response_length)
    return responses, lengths, response_mask, logprobs, response_mask


def ended_at_eos(run, responses, response_mask) -> torch.Tensor:
    """[B] bool: the completion holds an EOS (with tools or a rollout_func, it ends with one: TRL's not-truncated)."""
    if run.tools is None and run.rollout_func is None:
        return (torch.isin(responses, run.eos_ids) & response_mask).any(1)
    last = responses.gather(1, (response_mask.sum(1, keepdim=True) - 1).clamp(min=0))[:, 0]
    return torch.isin(last, run.eos_ids) & response_mask.any(1)


@torch.no_grad()
def score(args, run, queries, query_mask, responses, response_mask, examples, trainer_state, held_out=False):
    """Rewards [B, F] of the sampled rows (the reward model first, then the functions); `examples` index the
    training split, or with `held_out` the test split."""
    raw_prompts, columns = (
        (run.eval_raw_prompts, run.eval_columns) if held_out else (run.raw_prompts, run.columns)
    )
    chunk, Q = args.local_rollout_forward_batch_size, queries.size(1)
    rows_at = functools.partial(
        utils.generation.query_response_rows, queries, query_mask, responses, response_mask
    )
    rewards_per_func = []
    for idx in torch.arange(responses.size(0), device=queries.device).split(chunk):
        run.checkpointer.boundary()
        query_responses, mask = rows_at(idx)
        prompts, row_columns = utils.rollout.reward_inputs(run, raw_prompts, columns, examples, idx)
        rewards = utils.scoring.score_rows(
            run.scorers,
            query_responses,
            mask,
            Q,
            chunk,
            prompts=prompts,
            columns=row_columns,
            trainer_state=trainer_state,
        )
        rewards_per_func.append(rewards.float())
    return torch.cat(rewards_per_func)


@torch.no_grad()
def old_and_ref_logprobs(args, run, queries, query_mask, responses, response_mask):
    """(recomputed old logprobs or None, reference logprobs) [B, R] of the batch's rows."""
    chunk, Q, T = args.local_rollout_forward_batch_size, queries.size(1), args.temperature
    old_logprobs, ref_logprobs = [], []
    bare = utils.run.bare(run.policy)  # training's forward without DDP's hooks
    for idx in torch.arange(responses.size(0), device=queries.device).split(chunk):
        run.checkpointer.boundary()
        rows = utils.generation.query_response_rows(queries, query_mask, responses, response_mask, idx)
        ref_logprobs.append(utils.logprobs.batched_response_logprobs(run.ref_policy, *rows, Q, T, chunk))
        if run.recompute_old_logprobs:
            old_logprobs.append(utils.logprobs.batched_response_logprobs(bare, *rows, Q, T, chunk))
    return torch.cat(old_logprobs) if old_logprobs else None, torch.cat(ref_logprobs)


# ---- checks and sizes --------------------------------------------------------------------------------------
VERSIONS = ("0.19", "1.16")
# TRL 0.19's name (the field read) -> TRL 1.16's name
TRL_RENAMED = {
    "rloo_k": "num_generations",
    "kl_coef": "beta",
    "cliprange": "epsilon",
    "num_ppo_epochs": "num_iterations",
    "response_length": "max_completion_length",
    "reward_model_path": "reward_model_name_or_path",
}
# TRL 1.16-only flags: one of them (or a 1.16 name above) makes the command line TRL 1.16's (tools: GRPOTrainer's)
TRL1_ONLY = """reward_funcs reward_weights epsilon_high normalize_advantages mask_truncated_completions
num_train_epochs max_steps steps_per_generation generation_batch_size tools environment_factory
max_tool_calling_iterations rollout_func""".split()
# flag: (TRL 0.19's default, TRL 1.16's)
TRL_DEFAULTS = {
    "rloo_k": (2, 2),
    "kl_coef": (0.05, 0.05),
    "cliprange": (0.2, 0.2),
    "num_ppo_epochs": (4, 1),
    "response_length": (53, 512),
    "learning_rate": (3e-6, 1e-6),
    "temperature": (0.7, 1.0),
    "seed": (1, 42),
    "max_grad_norm": (0.0, 1.0),
    "save_steps": (0, 500),
    "num_mini_batches": (1, 1),
}


def flag(args: Args, name: str) -> str:
    """`--name` in the command line's TRL version."""
    return f"--{TRL_RENAMED.get(name, name) if args.dialect == '1.16' else name}"


def trl1_flags_given(args: Args) -> list[str]:
    """The TRL 1.16 names set on the command line (None, or False for a switch: not set)."""
    values = {name: getattr(args, name) for name in (*TRL_RENAMED.values(), *TRL1_ONLY)}
    return [name for name, value in values.items() if value is not None and value is not False]


def read_trl019_flags(args: Args) -> Args:
    """A command line of TRL 0.19's flags alone: its defaults for the flags not given, nothing translated."""
    for name, (default, _) in TRL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for old, new in TRL_RENAMED.items():
        setattr(args, new, getattr(args, old))  # so the logged flags agree
    if args.reward_fn is not None:
        args.reward_funcs = [args.reward_fn]
    if args.reward_clip_range is None:
        args.reward_clip_range = (10.0,)
    args.dialect = "0.19"
    return args


def read_trl_flags(args: Args) -> Args:
    """Set args.dialect and fill unset flags with that TRL version's defaults; refuse contradictions."""
    if args.dialect:
        return args
    clip = args.reward_clip_range
    if clip is not None and (len(clip) not in (1, 2) or (len(clip) == 2 and clip[0] > clip[1])):
        raise UsageError(f"--reward_clip_range takes one value or two (min <= max), got {clip}.")
    two_values = clip is not None and len(clip) == 2
    choice = "1.16" if args.trl_defaults == "auto" and two_values else args.trl_defaults
    newer = trl1_flags_given(args)
    if choice != "1.16" and not newer:
        return read_trl019_flags(args)
    # utils/trl_flags.py is optional: imported only for a command line that speaks TRL 1.16
    named = f"--{newer[0]} (a TRL 1.16 flag)" if newer else "--trl_defaults 1.16"
    if not newer and args.trl_defaults != "1.16":
        named = "--reward_clip_range with two values (TRL 1.16)"
    trl_flags = utils.run.optional_module("utils.trl_flags", named)
    tables = TRL_RENAMED, TRL1_ONLY, TRL_DEFAULTS, VERSIONS
    return trl_flags.read_rloo_flags(args, newer, choice, two_values, *tables)


def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Check the flags and fill in the batch sizes; UsageError with one sentence."""
    read_trl_flags(args)
    if args.rloo_k < 2:
        k = flag(args, "rloo_k")
        raise UsageError(
            f"{k} must be at least 2 (the baseline is the mean of the other k-1), got {args.rloo_k}."
        )
    positive = "per_device_train_batch_size gradient_accumulation_steps num_mini_batches num_ppo_epochs"
    for name in f"{positive} response_length local_rollout_forward_batch_size".split():
        if getattr(args, name) < 1:
            raise UsageError(f"{flag(args, name)} must be at least 1, got {getattr(args, name)}.")
    if min(args.temperature, args.cliprange, args.epsilon_high or 1) <= 0:
        raise UsageError(
            "--temperature and the clip ranges must be positive (RLOO needs sampled completions)."
        )
    num_rewards = (args.reward_model_path is not None) + len(args.reward_funcs or [])
    if args.dialect == "0.19" and num_rewards != 1:
        raise UsageError("pass exactly one of --reward_model_path and --reward_fn.")
    if num_rewards == 0 and not args.environment_factory:  # an environment's get_reward() may be it
        raise UsageError("pass a reward: --reward_model_name_or_path and/or --reward_funcs.")
    if (args.tools or args.environment_factory or args.rollout_func) and (
        args.dialect == "0.19" or args.token_level_kl
    ):
        raise UsageError(
            "--tools, --environment_factory and --rollout_func take TRL 1.16's flags, with neither --trl_defaults "
            "0.19 nor --token_level_kl (which puts the score on the last token, maybe an inserted one)."
        )
    if args.reward_weights is not None and len(args.reward_weights) != num_rewards:
        raise UsageError(
            f"--reward_weights has {len(args.reward_weights)} values for {num_rewards} rewards (the reward "
            "model, then the --reward_funcs)."
        )
    if args.sft_model_path is None and args.model_name_or_path is None:
        raise UsageError("pass the policy to train with --sft_model_path or --model_name_or_path.")
    if args.stop_token is not None and args.stop_token_id is not None:
        raise UsageError("pass only one of --stop_token and --stop_token_id.")
    args.world_size = world_size
    if args.generation_batch_size is not None:  # TRL 1.16
        trl_flags = utils.run.optional_module("utils.trl_flags", "--generation_batch_size (a TRL 1.16 flag)")
        args.num_mini_batches = trl_flags.mini_batches(args, world_size)
    args.local_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    )
    args.batch_size = args.local_batch_size * world_size
    args.local_mini_batch_size = args.local_batch_size // args.num_mini_batches
    args.mini_batch_size = args.batch_size // args.num_mini_batches
    if args.local_batch_size % args.rloo_k:
        k = flag(args, "rloo_k")
        raise UsageError(
            f"{k} {args.rloo_k} must divide the completions per process per update, "
            f"per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches = "
            f"{args.local_batch_size}; change {k} or "
            "--per_device_train_batch_size / --gradient_accumulation_steps / --num_mini_batches."
        )
    args.local_dataloader_batch_size = args.local_batch_size // args.rloo_k
    if num_prompts is not None:
        prompts_per_update = args.local_dataloader_batch_size * world_size
        if num_prompts < prompts_per_update:
            raise UsageError(
                f"the dataset has {num_prompts} prompts, fewer than the {prompts_per_update} of one update; "
                "lower the batch flags or use a larger split."
            )
        if args.max_steps is not None:  # TRL 1.16: whole updates
            steps_per_update = args.num_ppo_epochs * args.num_mini_batches
            updates_per_epoch = num_prompts // prompts_per_update
            trl_flags = utils.run.optional_module("utils.trl_flags", "--max_steps (a TRL 1.16 flag)")
            args.num_total_batches = trl_flags.num_updates(
                args.max_steps, args.num_train_epochs, updates_per_epoch, steps_per_update
            )
            return args
        if args.total_episodes is None:
            args.total_episodes = num_prompts * args.rloo_k
        if args.total_episodes < 1:
            raise UsageError(f"--total_episodes must be at least 1, got {args.total_episodes}.")
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    return args


# ---- training ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What a run holds from setup to save."""

    accelerator: object
    tokenizer: object
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref_policy: torch.nn.Module
    scorers: list
    reward_names: list[str]
    weights: torch.Tensor
    engine: object
    tools: object  # utils.tools.Tools with --tools or --environment_factory, else None
    rollout_func: object  # utils.rollout_func.RolloutFunc with --rollout_func, else None
    pad_id: int
    eos_ids: torch.Tensor
    stop_token_ids: torch.Tensor | None
    recompute_old_logprobs: bool
    policy_path: str
    prompt_ids: list
    raw_prompts: list
    columns: dict
    eval_prompt_ids: list | None
    eval_raw_prompts: list | None
    eval_columns: dict
    batches: object
    shuffle_generator: torch.Generator
    checkpointer: utils.checkpoint.Checkpointer
    checkpointed: dict
    tracker: utils.tracking.Tracker
    start_step: int


def setup(args: Args) -> Run:
    """Flags, data, tokenizer, models, optimizer, scorers, vLLM engine, resume and tracker."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    utils.loading.use_model_flags(args)
    # Checks before any model is loaded.
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
    if args.tools or args.environment_factory:  # utils/tools.py is optional: imported only with these flags
        tools_module = utils.run.optional_module(
            "utils.tools", "--tools" if args.tools else "--environment_factory"
        )
        tools_module.check_args(args)
        tool_fns = tools_module.load_tools(args.tools or [])
    rollout_func = None  # utils/rollout_func.py is optional too: imported only with --rollout_func
    if args.rollout_func:
        rollout_func = utils.run.optional_module("utils.rollout_func", "--rollout_func").RolloutFunc(args)
    if not args.resume_from_checkpoint:
        utils.checkpoint.check_output_dir(args.output_dir, args.overwrite_output_dir)
    if args.sft_model_path:
        policy_path, policy_flag = args.sft_model_path, "--sft_model_path"
    else:
        policy_path, policy_flag = args.model_name_or_path, "--model_name_or_path"
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.data.check_columns(dataset, ["prompt"], f"--dataset_name {args.dataset_name}")
    utils.evaluation.check_args(args)
    eval_dataset = utils.evaluation.load_test_split(args, "rloo.py")
    environments = None
    if args.environment_factory:  # one per rollout, reset on its row; a class with get_reward() is a reward
        environments_module = utils.run.optional_module("utils.environments", "--environment_factory")
        environments = environments_module.load_environments(
            args, tool_fns, dataset, eval_dataset, policy_path, policy_flag
        )
    asked = "--reward_fn" if args.reward_fn else "--reward_funcs"
    reward_fns = utils.rollout.reward_fns(args, dataset, environments, rollout_func, asked)
    raw_prompts, columns = utils.rollout.reward_rows(dataset, bool(reward_fns))
    eval_raw_prompts, eval_columns = utils.rollout.reward_rows(eval_dataset, bool(reward_fns))
    reward_names = [getattr(fn, "__name__", "reward") for fn in reward_fns]  # TRL's: the function's name
    if args.reward_model_path:  # TRL's order: the reward model first, named by its folder
        reward_names.insert(0, os.path.basename(os.path.normpath(args.reward_model_path)))
    fill_sizes(args, accelerator.num_processes, len(dataset))
    args.num_generations_eval = args.num_generations_eval or args.rloo_k  # TRL 1.16's
    if args.num_generations_eval < 1:
        raise UsageError(f"--num_generations_eval must be at least 1, got {args.num_generations_eval}.")
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    # Before any model loads: it checks every model path and takes a resumed run's name.
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)
    # a rollout_func's logprobs are its sampler's, never the ratio's old ones (TRL's contract)
    recompute_old_logprobs = (
        args.recompute_old_logprobs == "true"
        or bool(args.rollout_func)
        or (args.recompute_old_logprobs == "auto" and accelerator.mixed_precision == "bf16")
    )
    set_seed(args.seed)

    # Tokenizer and prompts
    if args.model_name_or_path:
        tokenizer_path, tokenizer_flag = args.model_name_or_path, "--model_name_or_path"
    else:
        tokenizer_path, tokenizer_flag = policy_path, policy_flag
    tokenizer = utils.loading.load_tokenizer(tokenizer_path, tokenizer_flag, args.chat_template_path)
    tools = None
    if args.tools or args.environment_factory:
        timeout, rounds = args.tool_timeout, args.max_tool_calling_iterations
        tools = tools_module.Tools(tool_fns, tokenizer, timeout, rounds, environments)
    pad_id = tokenizer.pad_token_id
    completion_flag = flag(args, "response_length")  # --max_completion_length in a TRL 1.16 command line
    prompt_ids, eval_prompt_ids = utils.rollout.prompt_ids(
        args,
        tokenizer,
        dataset,
        eval_dataset,
        tools,
        "response_length",
        policy_path,
        policy_flag,
        completion_flag,
    )

    # Models: dropout off (--disable_dropout), so the training forward's logprobs equal sampling's.
    policy = utils.loading.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    ref_policy = None  # LoRA: the policy with its adapter off
    if lora is None:
        ref_policy = utils.loading.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    else:
        policy = lora.add_adapter(policy, args, args.seed)
    reward_model = utils.scoring.load_reward_model(args.reward_model_path) if args.reward_model_path else None
    for model in [policy, ref_policy] if args.disable_dropout else [ref_policy]:
        if model is not None:
            utils.loading.disable_dropout(model)
    # --stop_token eos: the tokenizer's EOS and every EOS id of the policy's generation_config (TRL 1.16).
    eos_ids = torch.tensor(utils.generation.eos_token_ids(policy, tokenizer), device=accelerator.device)
    stop_token_ids = eos_ids if args.stop_token == "eos" else None
    if args.stop_token_id is not None:
        stop_token_ids = torch.tensor([args.stop_token_id], device=accelerator.device)
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(policy)
    optimizer = utils.run.trainer_optimizer(policy, args)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    ref_policy = lora.AdapterOff(policy) if lora else utils.run.prepare_frozen(ref_policy, accelerator)
    max_model_len = max(map(len, prompt_ids)) + args.response_length
    if tools is not None:  # a reset lengthens prompts
        max_model_len = tools.longest(max_model_len)
    engine = None
    if args.use_vllm:
        vllm_module = utils.run.optional_module("utils.vllm", "--use_vllm")
        engine = vllm_module.Engine(args, accelerator, policy_path, max_model_len)
    reward_model = utils.run.prepare_frozen(reward_model, accelerator) if reward_model is not None else None
    reward_tokenizer = utils.scoring.load_reward_tokenizer(args.reward_tokenizer_path, args.reward_model_path)
    scorers = [utils.scoring.RewardScorer(None, None, tokenizer, reward_fn=fn) for fn in reward_fns]
    if reward_model is not None:  # TRL's order: the reward model first
        scorers.insert(0, utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer))
    # --reward_weights (one per reward model and function, checked), else 1; an environment's reward 1 (TRL's)
    given = args.reward_weights or []
    weights = torch.tensor(given + [1.0] * (len(reward_names) - len(given)), device=accelerator.device)
    for scorer in scorers:  # which path scores each reward
        accelerator.print(scorer.describe())

    # Resume: weights, optimizer, shuffling generator; the prompt order is replayed.
    rank = accelerator.process_index
    shuffle_generator = torch.Generator().manual_seed(args.seed + rank)
    checkpointed = dict(
        models={"policy": policy}, optimizers={"policy": optimizer}, generators={"shuffle": shuffle_generator}
    )
    state = checkpointer.resume(**checkpointed) or {"step": 0}
    batches = utils.data.prompt_batches(
        len(prompt_ids), args.local_dataloader_batch_size, args.world_size, rank, args.seed
    )
    for _ in range(state.get("prompt_batches", 0)):
        next(batches)
    tracker = utils.tracking.Tracker(args, checkpointer)
    return Run(
        accelerator=accelerator,
        tokenizer=tokenizer,
        policy=policy,
        optimizer=optimizer,
        ref_policy=ref_policy,
        scorers=scorers,
        reward_names=reward_names,
        weights=weights,
        engine=engine,
        tools=tools,
        rollout_func=rollout_func,
        pad_id=pad_id,
        eos_ids=eos_ids,
        stop_token_ids=stop_token_ids,
        recompute_old_logprobs=recompute_old_logprobs,
        policy_path=policy_path,
        prompt_ids=prompt_ids,
        raw_prompts=raw_prompts,
        columns=columns,
        eval_prompt_ids=eval_prompt_ids,
        eval_raw_prompts=eval_raw_prompts,
        eval_columns=eval_columns,
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
    accelerator, policy, optimizer = run.accelerator, run.policy, run.optimizer
    device, rank = accelerator.device, accelerator.process_index
    B, P, T = args.local_batch_size, args.local_dataloader_batch_size, args.temperature
    stops = [run.stop_token_ids] if run.stop_token_ids is not None else []
    finished_ids = torch.cat([*stops, run.eos_ids, torch.tensor([run.pad_id], device=device)])
    steps_per_update = args.num_ppo_epochs * args.num_mini_batches
    schedule = utils.run.lr_schedule(
        args, args.num_total_batches * (steps_per_update if args.dialect == "1.16" else 1)
    )
    start, start_time, metrics = run.start_step, time.time(), {}
    if args.eval_on_start and start == 0 and run.eval_prompt_ids is not None:
        run.tracker.log(held_out_table(args, run, 0, None, steps_per_update), 0)
    updates = range(start + 1, args.num_total_batches + 1)
    progress = tqdm(
        updates, initial=start, total=args.num_total_batches, disable=not accelerator.is_local_main_process
    )
    for update in progress:
        # 1. Sample: k completions of each of P prompts, completion-major (row i <- prompt i % P).
        examples = next(run.batches)  # dataset indices
        trainer_state = utils.scoring.TrainerState(
            global_step=(update - 1) * steps_per_update,
            max_steps=args.num_total_batches * steps_per_update,
            epoch=(update - 1) * P * args.world_size / len(run.prompt_ids),
        )
        queries, query_mask, rows, k = utils.rollout.rollout_queries(
            run, run.prompt_ids, examples, args.rloo_k, False, trainer_state
        )
        context_length = queries.size(1)
        with accelerator.autocast():
            responses, lengths, response_mask, sampled_logprobs, tool_mask = sample(
                args, run, queries, query_mask, k, (update,), rank * queries.size(0), run.engine
            )

        # 2. Score: rewards, reference logprobs and the KL.
        with accelerator.autocast():
            recomputed_logprobs, ref_logprobs = old_and_ref_logprobs(
                args, run, queries, query_mask, responses, response_mask
            )
            rewards_per_func = score(
                args, run, queries, query_mask, responses, response_mask, rows, trainer_state
            )
        # A tool's answer has no sampling logprob (NaN): 0 there, outside every mask below.
        sampled_logprobs = sampled_logprobs.nan_to_num(0.0) if run.tools is not None else sampled_logprobs
        old_logprobs = sampled_logprobs if recomputed_logprobs is None else recomputed_logprobs
        scores = combine_rewards(rewards_per_func, run.weights)
        # TRL 1.16 leaves an unscored completion (NaN) out; under TRL 0.19 a NaN stops the run.
        checked = scores.nan_to_num(0.0) if args.dialect == "1.16" else scores
        run.tracker.check_finite(update, scores=checked)
        rows_at = functools.partial(
            utils.generation.query_response_rows, queries, query_mask, responses, response_mask
        )
        has_eos = ended_at_eos(run, responses, response_mask)
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~has_eos).float()
        # ALGO LOGIC: the loss and the KL see the sampled tokens only, never a tool's answer
        loss_mask = tool_mask
        if args.mask_truncated_completions:
            loss_mask = tool_mask & finished(responses, response_mask.sum(1), finished_ids)[:, None]
        kl = (old_logprobs - ref_logprobs) * loss_mask  # k1 estimator per token

        # 3. Advantages
        # ALGO LOGIC: reward = score - kl_coef * KL; A = reward - mean of the other k-1 rewards
        advantages, action_mask, shaped_scores = batch_advantages(
            args, scores, kl, loss_mask, lengths, accelerator.gather, rank
        )
        non_score_reward = -args.kl_coef * kl.sum(1)
        rlhf_reward = shaped_scores + non_score_reward

        # 4. Update: num_ppo_epochs shuffled passes over the batch.
        utils.run.release_freed_host_memory()  # the rollout's, before training allocates
        policy.train()
        stats = torch.zeros(4, device=device)  # loss, approxkl, clipfrac, entropy
        ratio_sums = torch.zeros(3, device=device)  # ratio - 1, (ratio - 1)^2 (exact near 1), count
        grad_norms, lrs, num_micro_batches = [], [], 0
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(B, generator=run.shuffle_generator).to(device)
            for idx in order.split(args.per_device_train_batch_size):
                run.checkpointer.boundary()
                lr = learning_rate(args, schedule, update, len(grad_norms), steps_per_update)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                with accelerator.accumulate(policy):
                    query_responses, attention_mask = rows_at(idx)
                    logprobs, entropy, _ = utils.logprobs.response_logprobs(
                        policy, query_responses, attention_mask, context_length, T, with_stats=True
                    )
                    # ALGO LOGIC: the clipped surrogate
                    mb_old_logprobs, mb_advantages, mb_mask = (
                        old_logprobs[idx],
                        advantages[idx],
                        loss_mask[idx],
                    )
                    loss, ratio, clipfrac, approxkl = policy_loss(
                        logprobs, mb_old_logprobs, mb_advantages, mb_mask, args.cliprange, args.epsilon_high
                    )
                    accelerator.backward(loss)
                    measured = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                    if accelerator.sync_gradients:
                        grad_norms.append(utils.run.grad_norm_after_step(policy, measured))
                        lrs.append(lr)
                with torch.no_grad():
                    entropy_mean = utils.stats.masked_mean(entropy, tool_mask[idx])
                    stats += torch.stack([loss.detach(), approxkl, clipfrac, entropy_mean])
                    shift = ratio - 1
                    ratio_sums += torch.stack([shift.sum(), (shift**2).sum(), shift.new_tensor(len(shift))])
                num_micro_batches += 1

        # 5. Metrics; a non-finite loss or gradient norm stops the run.
        with torch.no_grad():
            stats = accelerator.reduce(stats / num_micro_batches, reduction="mean")
            ratio_sums = accelerator.reduce(ratio_sums, reduction="sum")
            ratio_shift = ratio_sums[0] / ratio_sums[2]
            episode = update * args.batch_size
            measured_norms = [n for n in grad_norms if n is not None]
            grad_norm = sum(measured_norms) / len(measured_norms) if measured_norms else None
            run.tracker.check_finite(update, loss=stats[0], grad_norm=grad_norm)
            metrics = {
                "eps": int((episode - start * args.batch_size) / (time.time() - start_time)),
                "objective/kl": utils.run.gathered_mean(accelerator, kl.sum(1)),
                "objective/entropy": utils.run.gathered_mean(accelerator, (-old_logprobs * tool_mask).sum(1)),
                "objective/non_score_reward": utils.run.gathered_mean(accelerator, non_score_reward),
                "objective/rlhf_reward": utils.run.gathered_mean(accelerator, rlhf_reward),
                "objective/scores": utils.run.gathered_mean(accelerator, scores),
                "policy/approxkl_avg": stats[1].item(),
                "policy/clipfrac_avg": stats[2].item(),
                "loss/policy_avg": stats[0].item(),
                "policy/entropy_avg": stats[3].item(),
                "val/ratio": 1 + ratio_shift.item(),
                "val/ratio_var": (ratio_sums[1] / ratio_sums[2] - ratio_shift**2).clamp(min=0).item(),
                "val/num_eos_tokens": accelerator.reduce(has_eos.sum(), reduction="sum").item(),
                "learning_rate": sum(lrs) / len(lrs),
                "episode": episode,
            }
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            if utils.run.zero_stage(accelerator) == 3:
                metrics["zero3/local_param_share"] = utils.run.zero3().local_param_share(policy)
            if not run.scorers[0].same_tokenizer:
                truncated = torch.tensor(run.scorers[0].take_num_truncated(), device=device)
                metrics["val/num_reward_truncated"] = accelerator.reduce(truncated, reduction="sum").item()
            if len(run.scorers) > 1:
                all_rewards_per_func = accelerator.gather(rewards_per_func)
                for f, name in enumerate(run.reward_names):
                    metrics[f"rewards/{name}/mean"] = all_rewards_per_func[:, f].nanmean().item()
            metrics.update(utils.rollout.logged_means(accelerator, run.scorers))
            metrics.update(run.tools.metrics(accelerator) if run.tools is not None else {})

        # 6. Held-out evaluation and samples (the rollout's without a test split); checkpoint
        if utils.evaluation.due(update, args.num_total_batches, args):
            rollout = (queries, responses, response_mask, scores)
            metrics.update(held_out_table(args, run, update, rollout, steps_per_update))
        run.tracker.log(metrics, update)
        run.checkpointer.maybe_save(
            update, **run.checkpointed, state={"episode": episode, "prompt_batches": update}
        )

    # 7. Save the policy and a model card (all processes: ZeRO-3 gathers shards).
    saving = utils.run.optional_module("utils.lora", "--use_peft") if args.use_peft else utils.saving
    saving.save_model(run.checkpointer, policy, run.tokenizer, args, "RLOO", run.policy_path, metrics)
    run.tracker.close()
    utils.run.end_run(accelerator, run.engine)
    return metrics


def held_out_table(args, run, update, rollout, steps_per_update) -> dict:
    """Evaluate after `update` (0: before the first) and print a sample table: the held-out prompts'
    completions with their eval/ metrics, or without a test split the first completions of this `rollout`
    (queries, responses, response_mask, scores) and no metrics."""
    device = run.accelerator.device
    eval_metrics, shown = {}, rollout
    if run.eval_prompt_ids is not None:
        trainer_state = utils.scoring.TrainerState(
            global_step=update * steps_per_update,
            max_steps=args.num_total_batches * steps_per_update,
            epoch=update * args.local_dataloader_batch_size * args.world_size / len(run.prompt_ids),
        )
        prompts_per_batch = max(1, args.per_device_eval_batch_size // args.num_generations_eval)
        eval_metrics, shown = utils.evaluation.evaluate(
            run.accelerator,
            len(run.eval_prompt_ids),
            prompts_per_batch,
            functools.partial(held_out_batch, args, run, trainer_state),
        )
        eval_metrics.update(utils.rollout.logged_means(run.accelerator, run.scorers, "eval/"))
        run.scorers[0].take_num_truncated()  # the evaluation's rows are not the next update's
    queries, responses, response_mask, scores = shown
    rows = torch.arange(min(queries.size(0), 4), device=device)
    run.tracker.samples(
        {
            "query": run.tokenizer.batch_decode(queries[rows], skip_special_tokens=True),
            "response": [
                run.tokenizer.decode(r[m], skip_special_tokens=True)
                for r, m in zip(responses[rows], response_mask[rows])
            ],
            "score": scores[rows].tolist(),
        },
        title=f"update {update}" + (": held-out prompts" if run.eval_prompt_ids is not None else ""),
    )
    return eval_metrics


@torch.no_grad()
def held_out_batch(args, run, trainer_state, indices: list[int]) -> tuple[dict, tuple]:
    """--num_generations_eval completions of the held-out prompts `indices`, sampled as in training but with the
    evaluation's noise, scored as in training -> (per completion: eval/ values, the sample table's tensors)."""
    device = run.accelerator.device
    queries, query_mask, examples, k = utils.rollout.rollout_queries(
        run, run.eval_prompt_ids, indices, args.num_generations_eval, True, trainer_state
    )
    with run.accelerator.autocast():
        key, first = (utils.evaluation.EVAL_KEY,), indices[0] * queries.size(0) // len(indices)
        responses, lengths, response_mask, _, _ = sample(
            args, run, queries, query_mask, k, key, first, run.engine
        )
        rewards_per_func = score(
            args, run, queries, query_mask, responses, response_mask, examples, trainer_state, held_out=True
        )
    scores = combine_rewards(rewards_per_func, run.weights)
    has_eos = ended_at_eos(run, responses, response_mask)
    if args.missing_eos_penalty is not None:  # as training's objective/scores
        scores = scores - args.missing_eos_penalty * (~has_eos).float()
    values = {"objective/scores": scores, "completions/mean_length": lengths.float()}
    values["completions/clipped_ratio"] = (~has_eos).float()
    if len(run.scorers) > 1:
        values.update(
            {f"rewards/{name}/mean": rewards_per_func[:, f] for f, name in enumerate(run.reward_names)}
        )
    rows = torch.arange(responses.size(0), device=device) % queries.size(0)  # each completion's query
    return values, (queries[rows], responses, response_mask, scores)


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
