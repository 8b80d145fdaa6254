"""Group Relative Policy Optimization (GRPO) for language models, in one file, with the variants that matter.

Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models" (2024),
https://arxiv.org/abs/2402.03300. Variants: DAPO (Yu et al. 2025, https://arxiv.org/abs/2503.14476: clip-higher
and the token-level loss), Dr. GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783: no std scaling, loss
summed over tokens and divided by a constant), two-sided clipping `--delta` (INTELLECT-2, 2025).

For each prompt the policy samples a group of `--num_generations` completions. A completion's reward is the
weighted sum of one or more reward functions and/or a reward model; its advantage is its reward minus the
mean of its group, divided by the group's std (`--scale_rewards group`), the batch's std (`batch`) or nothing
(`none`, Dr. GRPO). Every token of the completion gets that advantage, and the loss is PPO's clipped surrogate
per token, `-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)` with r the ratio to the sampling policy, plus
`beta` times the k3 estimate of the KL to the reference model, times r (`--use_bias_correction_kl`; beta = 0 by
default: no reference model is loaded). `--loss_type` decides how the per-token losses are averaged (see
`aggregate_loss`). There is no critic and, unlike PPO/RLOO, no KL in the reward. The flags mean what TRL 1.16's
GRPOConfig means by them (the reward model comes first among the rewards, as in TRL's script); with `--use_vllm`
the loss is weighted by importance weights between the training forward and vLLM's sampler.

Batch layout, completion-major: the G*P completions of one generation are rows `g * P + p` (completion g of
prompt p), i.e. `rewards.view(G, P)`. Prompts are stored once ([P, Q]); the rows are built at forward time.
Each process samples whole groups for its own prompts, so a group is never split across processes.

    python grpo.py --model_name_or_path models/sft --dataset_name data/prompts --reward_funcs rewards.py:exact \
        --num_generations 8 --per_device_train_batch_size 32 --max_completion_length 16 --learning_rate 1e-5 \
        --loss_type dapo --epsilon_high 0.28 --max_steps 200 --output_dir models/grpo
"""

import functools
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro

import utils.chat
import utils.checkpoint
import utils.data
import utils.generation
import utils.loading
import utils.logprobs
import utils.run
import utils.saving
import utils.scoring
import utils.tracking
import utils.vllm


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (model init is the checkpoint's; this seeds sampling and shuffling)"""
    run_name: str | None = None
    """name of the run (TensorBoard folder, W&B run); None -> {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """log to Weights & Biases as well as TensorBoard"""
    wandb_project_name: str = "rlhf-reference"
    """the W&B project"""
    wandb_entity: str | None = None
    """the W&B entity (team)"""
    logging_dir: str = "runs"
    """TensorBoard logs and metrics.jsonl go to {logging_dir}/{run_name}"""
    output_dir: str = "models/grpo"
    """where the trained policy (weights, tokenizer, model card) and the checkpoints are saved"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir: its contents are moved aside to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (without its checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """save a checkpoint every this many optimizer steps (0: only when stopped by a signal)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint folder to continue from, or 'latest' for the newest one in --output_dir"""

    # Models and data
    model_name_or_path: str | None = None
    """the policy to start from (hub id or local dir) and its tokenizer; also the reference model when beta > 0"""
    reward_funcs: Annotated[list[str] | None, tyro.conf.arg(aliases=("--reward_fn",))] = None
    """reward functions, each path/to/file.py:function or module.function, returning one float per completion: called as
    function(prompts, completions) on texts, or, when it takes **kwargs, as TRL calls it (keywords prompts,
    completions and every dataset column, e.g. solution; messages for conversational prompts)"""
    reward_model_path: Annotated[str | None, tyro.conf.arg(aliases=("--reward_model_name_or_path",))] = None
    """a sequence classifier (one label) as one more reward, before the --reward_funcs (TRL's order)"""
    reward_tokenizer_path: str | None = None
    """the reward model's tokenizer when it differs from the policy's (None: the one in --reward_model_path)"""
    reward_weights: list[float] | None = None
    """one weight per reward (the reward model first, then the --reward_funcs in order, as TRL's script); None:
    all 1"""
    dataset_name: str = "trl-lib/tldr"
    """hub id, save_to_disk directory, folder of {split}.jsonl/parquet, or one file; needs a `prompt` column (text,
    or conversations rendered with the chat template and its generation prompt); other columns are ignored"""
    dataset_config: str | None = None
    """dataset configuration: the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split holding the prompts"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) whose chat template renders conversational prompts"""
    max_prompt_length: int | None = 512
    """keep only the last this-many tokens of each prompt (None: keep all)"""
    bf16: bool = False
    """bf16 mixed precision (accelerate)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""

    # Sampling
    num_generations: int = 8
    """completions sampled per prompt, the group (at least 2)"""
    max_completion_length: int = 256
    """tokens sampled per completion (then truncated after EOS); also Dr. GRPO's loss constant"""
    temperature: float = 1.0
    """sampling temperature; the logprobs of the loss are taken at the same temperature"""
    mask_truncated_completions: bool = False
    """leave completions that reached max_completion_length without EOS out of the loss (DAPO)"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / reference / reward-model forward pass"""
    use_vllm: bool = False
    """sample the rollouts with vLLM (pip install -r requirements-vllm.txt); the old logprobs then come from a
    training forward pass after sampling, and vLLM's own ones weight the loss (--vllm_importance_sampling_*)"""
    vllm_mode: Literal["colocate"] = "colocate"
    """colocate: a vLLM engine in each training process, on its device (TRL's server mode is not provided)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of the GPU memory the vLLM engine takes (on CPU: VLLM_CPU_KVCACHE_SPACE GiB, 1 unless set)"""
    vllm_tensor_parallel_size: int = 1
    """processes that share one vLLM engine, tensor-parallel (must divide the number of processes)"""
    vllm_importance_sampling_correction: bool = True
    """with --use_vllm, weight each token's policy loss by p_train / p_vllm of its sampled tokens, truncated or
    masked (see vllm_importance_weights): vLLM's kernels sample from a slightly different distribution"""
    vllm_importance_sampling_mode: Literal[
        "sequence_mask", "sequence_truncate", "token_mask", "token_truncate"
    ] = "sequence_mask"
    """one weight per sequence (product of its tokens' ratios) or per token; out-of-range weights set to 0
    (mask) or clamped into [clip_min, clip_max] (truncate)"""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """upper bound C_max of the importance weights (None: none)"""
    vllm_importance_sampling_clip_min: float | None = None
    """lower bound C_min of the importance weights (None: none)"""
    vllm_importance_sampling_cap: float | None = None
    """deprecated (TRL 1.6): sets --vllm_importance_sampling_clip_max"""

    # Algorithm
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """'linear' decays the learning rate to 0 over the optimizer steps"""
    max_grad_norm: float = 1.0
    """clip the gradient norm to this (0: no clipping)"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass per process (micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    generation_batch_size: int | None = None
    """completions per generation over all processes; a multiple of per_device_train_batch_size * processes, it
    sets --steps_per_generation (give one of the two; None: filled in from --steps_per_generation)"""
    steps_per_generation: int | None = None
    """micro-batches per process made from one generation, a multiple of --gradient_accumulation_steps (None:
    from --generation_batch_size, else gradient_accumulation_steps; filled in)"""
    num_iterations: int = 1
    """passes over each generation (mu in the paper); > 1 relies on the clipped ratio to the sampling policy"""
    max_steps: int = -1
    """optimizer steps in total (-1: from --num_train_epochs)"""
    num_train_epochs: float = 3.0
    """passes over the prompts, when --max_steps is -1"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide the group-centred rewards by the group's std, the whole batch's std, or nothing (Dr. GRPO)"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = "dapo"
    """how per-token losses are averaged: per-sequence means (grpo), token mean of the micro-batch (bnpo), sum
    over a constant (dr_grpo), token mean of the whole optimizer step over all processes (dapo); cispo (MiniMax-M1:
    clipped, detached ratio times logprob, averaged as dapo) and sapo (a sigmoid gate instead of the clip, averaged
    as grpo) change the per-token loss too (see policy_token_loss)"""
    epsilon: float = 0.2
    """lower clip range of the ratio: 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip range of the ratio: 1 + epsilon_high (None: epsilon; DAPO's clip-higher uses 0.28)"""
    delta: float | None = None
    """two-sided clipping: cap the ratio at delta also where the advantage is negative (None: off; > 1 + eps)"""
    beta: float = 0.0
    """weight of the KL to the reference model (k3 estimator) in the loss; 0 loads no reference model"""
    use_bias_correction_kl: bool = True
    """multiply the per-token KL by the ratio to the old policy (with its gradient; DeepSeek-V3.2), which makes its
    gradient the unbiased reverse-KL gradient"""
    sapo_temperature_pos: float = 1.0
    """sapo: temperature of the gate for tokens with a positive advantage"""
    sapo_temperature_neg: float = 1.05
    """sapo: temperature of the gate for tokens with a negative advantage"""

    # Logging
    logging_steps: int = 1
    """log metrics every this many optimizer steps"""
    num_sample_generations: int = 10
    """print a table of sample completions at the first generation and this many times more (0: never)"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes (filled in at runtime)"""
    local_generation_batch_size: int = 0
    """completions per process per generation = per_device_train_batch_size * steps_per_generation (filled in)"""
    local_prompts_per_generation: int = 0
    """prompts per process per generation = local_generation_batch_size / num_generations (filled in)"""
    steps_per_generation_round: int = 0
    """optimizer steps made from one generation = steps_per_generation / gradient_accumulation_steps *
    num_iterations (filled in at runtime)"""
    total_steps: int = 0
    """optimizer steps of the run: --max_steps, or from --num_train_epochs (filled in at runtime)"""


def check_importance_sampling_flags(args: Args) -> None:
    """TRL's checks of the --vllm_importance_sampling_* flags (made with or without --use_vllm, as TRL does);
    the deprecated --vllm_importance_sampling_cap becomes --vllm_importance_sampling_clip_max."""
    if args.vllm_importance_sampling_cap is not None:
        warnings.warn(
            "--vllm_importance_sampling_cap is deprecated; use --vllm_importance_sampling_clip_max.",
            FutureWarning,
            stacklevel=2,
        )
        args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_cap = (
            args.vllm_importance_sampling_cap,
            None,
        )
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"--vllm_importance_sampling_clip_min {low} must be below --vllm_importance_sampling_clip_max {high}."
        )
    truncating = args.vllm_importance_sampling_mode.endswith("_truncate")
    if args.vllm_importance_sampling_correction and truncating and low is None and high is None:
        raise ValueError(
            f"--vllm_importance_sampling_mode {args.vllm_importance_sampling_mode} needs "
            "--vllm_importance_sampling_clip_min or --vllm_importance_sampling_clip_max."
        )


def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Check the flags and compute the derived batch sizes; ValueError with one sentence on a bad value."""
    if args.num_generations < 2:
        raise ValueError(
            f"--num_generations must be at least 2 (a group needs a mean), got {args.num_generations}."
        )
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                 "max_completion_length", "local_rollout_forward_batch_size", "logging_steps"):  # fmt: skip
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.temperature <= 0:
        raise ValueError(
            f"--temperature must be positive (GRPO needs sampled completions), got {args.temperature}."
        )
    if args.epsilon_high is None:
        args.epsilon_high = args.epsilon
    if not 0 < args.epsilon < 1 or args.epsilon_high <= 0:
        raise ValueError("--epsilon must lie in (0, 1) and --epsilon_high must be positive.")
    if args.delta is not None and args.delta <= 1 + args.epsilon_high:
        raise ValueError(f"--delta must exceed 1 + epsilon_high = {1 + args.epsilon_high}, got {args.delta}.")
    if args.beta < 0:
        raise ValueError(f"--beta must be at least 0, got {args.beta}.")
    if args.loss_type == "sapo" and min(args.sapo_temperature_pos, args.sapo_temperature_neg) <= 0:
        raise ValueError("--sapo_temperature_pos and --sapo_temperature_neg must be positive.")
    check_importance_sampling_flags(args)
    if args.model_name_or_path is None:
        raise ValueError("pass the policy to train with --model_name_or_path.")
    num_rewards = (args.reward_model_path is not None) + len(args.reward_funcs or [])
    if num_rewards == 0:
        raise ValueError(
            "pass at least one reward: --reward_funcs file.py:function and/or --reward_model_path."
        )
    if args.reward_weights is not None and len(args.reward_weights) != num_rewards:
        raise ValueError(
            f"--reward_weights has {len(args.reward_weights)} values for {num_rewards} rewards (the reward model, "
            "then the --reward_funcs)."
        )
    if args.max_steps == 0 or args.max_steps < -1 or (args.max_steps == -1 and args.num_train_epochs <= 0):
        raise ValueError("set --max_steps to a positive number, or -1 with a positive --num_train_epochs.")
    if not args.world_size:  # the first call sees the flags as given; a later one the sizes it filled in
        given = (args.generation_batch_size, args.steps_per_generation)
        global_micro_batch = args.per_device_train_batch_size * world_size
        if None not in given:
            raise ValueError(
                "give --generation_batch_size or --steps_per_generation, not both (each sets the other)."
            )
        if args.generation_batch_size is not None:
            if args.generation_batch_size < 1 or args.generation_batch_size % global_micro_batch:
                raise ValueError(
                    f"--generation_batch_size {args.generation_batch_size} must be a positive multiple of "
                    f"per_device_train_batch_size * processes = {global_micro_batch}."
                )
            args.steps_per_generation = args.generation_batch_size // global_micro_batch
        elif args.steps_per_generation is None:
            args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = args.steps_per_generation * global_micro_batch
    if args.steps_per_generation < 1 or args.steps_per_generation % args.gradient_accumulation_steps:
        raise ValueError(
            f"--steps_per_generation {args.steps_per_generation} (micro-batches per process per generation) must "
            f"be a positive multiple of --gradient_accumulation_steps {args.gradient_accumulation_steps}."
        )
    args.world_size = world_size
    args.local_generation_batch_size = args.per_device_train_batch_size * args.steps_per_generation
    if args.local_generation_batch_size % args.num_generations:
        raise ValueError(
            f"--num_generations {args.num_generations} must divide the completions per process per generation, "
            f"per_device_train_batch_size * steps_per_generation = {args.local_generation_batch_size}, so that "
            "groups stay whole on one process; change one of these flags."
        )
    args.local_prompts_per_generation = args.local_generation_batch_size // args.num_generations
    args.steps_per_generation_round = (
        args.steps_per_generation // args.gradient_accumulation_steps * args.num_iterations
    )
    if args.save_steps % args.steps_per_generation_round:
        raise ValueError(
            f"--save_steps {args.save_steps} must be a multiple of the {args.steps_per_generation_round} optimizer "
            "steps made from one generation (checkpoints fall between generations)."
        )
    if num_prompts is not None:
        prompts_per_generation = args.local_prompts_per_generation * world_size
        if num_prompts < prompts_per_generation:
            raise ValueError(
                f"the dataset has {num_prompts} prompts, fewer than the {prompts_per_generation} of one generation; "
                "lower the batch flags or use a larger split."
            )
        if args.max_steps > 0:
            args.total_steps = args.max_steps
        else:
            generations = math.ceil(args.num_train_epochs * (num_prompts // prompts_per_generation))
            args.total_steps = generations * args.steps_per_generation_round
    return args


# ----------------------------------------------------------------------------------------------------------------
# The math (pure functions; B = G * P completions in completion-major order, R completion tokens)
# ----------------------------------------------------------------------------------------------------------------
ADVANTAGE_EPS = 1e-4  # added to the std before dividing (TRL's value); a group of equal rewards gets A = 0


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample std (Bessel's correction) of the values that are not NaN, along `dim` (None: all); NaN where
    fewer than 2 are."""
    if dim is None:
        values, dim = values.flatten(), 0
    count = (~values.isnan()).sum(dim, keepdim=True)
    squares = (values - values.nanmean(dim, keepdim=True)).pow(2).nansum(dim, keepdim=True)
    std = (squares / (count - 1).clamp(min=1)).sqrt().where(count > 1, torch.nan)
    return std if keepdim else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group",
                     batch_std: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """A_i = (r_i - mean of r's group) / (std + eps). rewards [B] completion-major (row g * P + p) -> [B].

    scale_rewards: 'group' divides by the std of the group (unbiased, as torch.std), 'batch' by the std of the
    whole batch (`batch_std`, for a batch spread over processes; default the std of `rewards`), 'none' by
    nothing (Dr. GRPO: the std scaling weights easy and hard prompts unequally). A NaN reward (a completion no
    reward could score) is left out of its group's mean and std and gets A = 0, as in TRL."""
    grouped = rewards.view(num_generations, -1)  # [G, P]: row g holds completion g of every prompt
    centered = grouped - grouped.nanmean(0, keepdim=True)
    if scale_rewards == "group":
        centered = centered / (nanstd(grouped, 0, keepdim=True) + ADVANTAGE_EPS)
    elif scale_rewards == "batch":
        std = nanstd(rewards) if batch_std is None else batch_std
        centered = centered / (std + ADVANTAGE_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}.")
    return centered.flatten().nan_to_num(0.0)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reward of each completion: sum_f weights[f] * rewards_per_func[:, f] over the rewards that scored it
    (a reward function returns None, here NaN, for a completion it does not judge). [B, F], [F] -> [B]; NaN where
    no reward scored the completion, with a warning, as TRL."""
    unscored = rewards_per_func.isnan().all(1)
    if unscored.any():
        warnings.warn(
            f"every reward returned None for {int(unscored.sum())} completion(s) (e.g. row "
            f"{int(unscored.nonzero()[0])}); they get advantage 0: make at least one reward score every completion.",
            RuntimeWarning,
            stacklevel=2,
        )
    return (rewards_per_func * weights[None, :]).nansum(1).masked_fill(unscored, torch.nan)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) (Schulman 2020): exp(d) - d - 1 with d = ref - logprob; >= 0."""
    diff = ref_logprobs - logprobs
    return diff.exp() - diff - 1


def kl_penalty(logprobs, old_logprobs, ref_logprobs, use_bias_correction_kl: bool = True) -> torch.Tensor:
    """The per-token KL term [B, R] the loss adds (times beta): k3_kl(logprobs, ref_logprobs), multiplied, with
    `use_bias_correction_kl`, by the ratio r = exp(logprobs - old_logprobs), not detached and not clipped
    (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556; TRL's placement): the samples come from the old policy, and
    r * grad k3 is then the unbiased gradient of KL(pi || pi_ref). On-policy r = 1, but its gradient is not 0."""
    kl = k3_kl(logprobs, ref_logprobs)
    return kl * (logprobs - old_logprobs).exp() if use_bias_correction_kl else kl


def clipped_token_loss(logprobs, old_logprobs, advantages, epsilon_low, epsilon_high, delta=None):
    """Per-token loss [B, R] = -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A), r = exp(logp - logp_old).

    advantages [B] (one per completion, the same for all its tokens). With `delta` the unclipped ratio is also
    capped at delta, so a token with A < 0 whose ratio has run away cannot give an unbounded loss (two-sided
    clipping); DAPO's clip-higher is epsilon_high > epsilon_low."""
    ratio = (logprobs - old_logprobs).exp()
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    advantages = advantages[:, None]
    return -torch.min(ratio * advantages, clipped * advantages)


def cispo_token_loss(logprobs, old_logprobs, advantages, epsilon_high):
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): -sg(min(r, epsilon_high)) A logprob per token [B, R];
    the clip bounds the ratio's weight but, unlike PPO's, never removes a token's gradient. advantages [B]."""
    weight = (logprobs - old_logprobs).exp().clamp(max=epsilon_high).detach()
    return -weight * advantages[:, None] * logprobs


def sapo_token_loss(logprobs, old_logprobs, advantages, temperature_pos, temperature_neg):
    """SAPO (https://arxiv.org/abs/2511.20347): -(4 / tau) sigmoid(tau (r - 1)) A per token [B, R], tau =
    temperature_pos where A > 0, else temperature_neg: a soft gate in place of the hard clip (its gradient at
    r = 1 is that of r A). advantages [B]."""
    advantages = advantages[:, None]
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)
    ratio = (logprobs - old_logprobs).exp()
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def policy_token_loss(args: Args, logprobs, old_logprobs, advantages, importance_weights=None):
    """The per-token policy loss [B, R] of `args.loss_type` (clipped_token_loss, cispo_token_loss or
    sapo_token_loss) times the vLLM importance weights ([B, R] or [B, 1], see vllm_importance_weights) if any."""
    if args.loss_type == "cispo":
        loss = cispo_token_loss(logprobs, old_logprobs, advantages, args.epsilon_high)
    elif args.loss_type == "sapo":
        loss = sapo_token_loss(
            logprobs, old_logprobs, advantages, args.sapo_temperature_pos, args.sapo_temperature_neg
        )
    else:
        loss = clipped_token_loss(
            logprobs, old_logprobs, advantages, args.epsilon, args.epsilon_high, args.delta
        )
    return loss if importance_weights is None else loss * importance_weights


def vllm_importance_weights(old_logprobs, sampling_logprobs, mask, mode="sequence_mask", clip_min=None,
                            clip_max=3.0) -> torch.Tensor:  # fmt: skip
    """Importance weights correcting for completions sampled by vLLM, whose kernels (and bf16) give another
    distribution than the training forward's. old_logprobs (training forward), sampling_logprobs (vLLM's), mask
    [B, R]; a NaN vLLM logprob counts as agreement. With d_t = (old_t - sampling_t) m_t:

    token_*     w_t = exp(d_t)              [B, R]
    sequence_*  w = exp(sum_t d_t)          [B, 1]  the whole completion's probability ratio
    *_truncate  w <- clamp(w, clip_min, clip_max)   (truncated importance sampling)
    *_mask      w <- w if clip_min <= w <= clip_max, else 0   (masked: drop the completion or token)

    A bound of None is no bound. No gradient: the weights multiply the per-token policy loss."""
    diff = ((old_logprobs - sampling_logprobs) * mask).nan_to_num(0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weights = diff.exp()
    if mode.endswith("_truncate"):
        return weights.clamp(min=clip_min, max=clip_max)
    if not mode.endswith("_mask"):
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}.")
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values [B, R] over the masked tokens; 0 when none is (every completion masked as truncated)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def clip_fractions(ratio, advantages, mask, epsilon_low, epsilon_high):
    """Fractions of the masked tokens whose gradient the clip removed: (low, high, region). Low: r < 1 - eps_low
    with A < 0; high: r > 1 + eps_high with A > 0; region: either. ratio, mask [B, R]; advantages [B]."""
    advantages = advantages[:, None]
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return tuple(token_mean(x.float(), mask) for x in (low, high, low | high))


def aggregate_loss(per_token_loss, mask, loss_type, max_completion_length, num_items=None):
    """One number from the per-token losses [B, R] of the kept tokens (mask [B, R]), L = max_completion_length:

    grpo    (1/B) sum_i (1/|o_i|) sum_t l_it       each completion weighs the same (Shao et al. 2024);
                                                    long completions' tokens weigh less (a length bias)
    bnpo    sum_it l_it / sum_i |o_i|               token mean of this micro-batch
    dr_grpo sum_it l_it / (B * L)                   a constant normalizer (Liu et al. 2025)
    dapo    sum_it l_it / num_items                 token mean over every token of the optimizer step, all
                                                    micro-batches and processes (Yu et al. 2025); `num_items`
                                                    is that count (default: this micro-batch's tokens)"""
    mask = mask.to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    loss_type = {"cispo": "dapo", "sapo": "grpo"}.get(loss_type, loss_type)  # their averaging, as TRL's
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return total / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        return total / (mask.sum().clamp(min=1) if num_items is None else max(num_items, 1))
    raise ValueError(f"unknown loss_type {loss_type!r}.")


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
def recomputes_old_logprobs(args: Args) -> bool:
    """Whether the old logprobs come from a forward pass of the policy after sampling, as in TRL: when the
    update is off-policy (several passes, or several optimizer steps per generation) or corrects for vLLM's
    sampler. Otherwise each micro-batch's own logprobs, detached, are the old ones: the ratio is exactly 1 even
    where sampling's logprobs differ from the training forward's (bf16, another kernel)."""
    on_policy = args.num_iterations == 1 and args.steps_per_generation == args.gradient_accumulation_steps
    return not on_policy or (args.use_vllm and args.vllm_importance_sampling_correction)


def reward_metrics(rewards_per_func, rewards, num_generations, names, num_processes=1) -> dict[str, float]:
    """TRL's reward metrics of one generation: rewards_per_func [W * B, F] and rewards [W * B] of all W processes
    (each process's B rows completion-major), NaN where a reward did not score. reward, reward_std: nan-mean and
    nan-std of the batch; rewards/<name>/mean and /std per reward; frac_reward_zero_std: the fraction of groups
    whose rewards are all equal (TRL counts the batch's std instead under scale_rewards 'batch')."""
    group_std = nanstd(rewards.view(num_processes, num_generations, -1), 1)
    per_reward = {
        f"rewards/{name}/{stat}": fn(rewards_per_func[:, f]).item()
        for f, name in enumerate(names)
        for stat, fn in (("mean", torch.nanmean), ("std", nanstd))
    }
    return {
        "reward": rewards.nanmean().item(),
        "reward_std": nanstd(rewards).item(),
        "frac_reward_zero_std": group_std.isclose(torch.zeros_like(group_std)).float().mean().item(),
        **per_reward,
    }


def importance_sampling_metrics(old_logprobs, sampling_logprobs, weights, mask, accelerator) -> dict:
    """TRL's sampling/* metrics of the vLLM correction: |training - vLLM| logprob difference over the real
    tokens (mean, max) and the importance weights (min, mean, max; per token or per sequence)."""
    mask = mask.bool()
    delta = (old_logprobs - sampling_logprobs).abs()[mask]
    delta = delta[~delta.isnan()]
    flat = weights.flatten() if weights.size(-1) == 1 else weights[mask]
    zero = torch.zeros((), device=mask.device)
    stat = lambda x, fn: fn(x) if x.numel() else zero  # noqa: E731
    return {
        "sampling/sampling_logp_difference/mean": accelerator.gather(stat(delta, torch.mean)).mean().item(),
        "sampling/sampling_logp_difference/max": accelerator.gather(stat(delta, torch.max)).max().item(),
        "sampling/importance_sampling_ratio/min": accelerator.gather(stat(flat, torch.min)).min().item(),
        "sampling/importance_sampling_ratio/mean": accelerator.gather(stat(flat, torch.mean)).mean().item(),
        "sampling/importance_sampling_ratio/max": accelerator.gather(stat(flat, torch.max)).max().item(),
    }


def reward_name(spec: str) -> str:
    """The name a reward is logged under: the function's name, or the reward model folder's."""
    return spec.rpartition(":")[2] if ":" in spec else os.path.basename(os.path.normpath(spec))


def main(args: Args) -> None:
    from accelerate.utils import gather_object
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    # 0. Checks and data: everything that can be checked before loading a model.
    accelerator = utils.run.make_accelerator(
        args, args.gradient_accumulation_steps, args.per_device_train_batch_size
    )
    fill_sizes(args, accelerator.num_processes)
    utils.vllm.check_args(args)
    if not args.resume_from_checkpoint:
        utils.checkpoint.check_output_dir(args.output_dir, args.overwrite_output_dir)
    reward_fns = [utils.scoring.load_reward_fn(spec) for spec in args.reward_funcs or []]
    reward_names = [reward_name(s) for s in [args.reward_model_path, *(args.reward_funcs or [])] if s]
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.data.check_columns(dataset, ["prompt"], f"--dataset_name {args.dataset_name}")
    fill_sizes(args, accelerator.num_processes, len(dataset))
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    device, rank, G = accelerator.device, accelerator.process_index, args.num_generations

    # 1. Models: the policy; the frozen reference only when beta > 0; the reward model if any. Dropout off, so
    # the logprobs of the training forward pass equal those of sampling.
    tokenizer = utils.loading.load_tokenizer(
        args.model_name_or_path, "--model_name_or_path", args.chat_template_path
    )
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_texts = utils.data.prompt_texts(dataset, tokenizer, f"--dataset_name {args.dataset_name}")
    prompt_ids = utils.chat.tokenize_prompts(tokenizer, prompt_texts, args.max_prompt_length)
    longest = max(map(len, prompt_ids)) + args.max_completion_length  # the longest sequence sampled
    utils.loading.check_context_length(
        args.model_name_or_path, longest, "--max_prompt_length or --max_completion_length"
    )
    policy = utils.loading.from_pretrained(
        AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
    )
    utils.loading.disable_dropout(policy)
    ref_policy = reward_model = None
    if args.beta > 0:
        ref_policy = utils.loading.from_pretrained(
            AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
        )
        utils.loading.disable_dropout(ref_policy)
    if args.reward_model_path:
        reward_model = utils.scoring.load_reward_model(args.reward_model_path)
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(policy)
    optimizer = utils.run.adamw(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    engine = None  # with --use_vllm, a vLLM engine samples the completions
    if args.use_vllm:
        max_model_len = max(map(len, prompt_ids)) + args.max_completion_length
        engine = utils.vllm.Engine(args, accelerator, args.model_name_or_path, max_model_len)
    # vLLM's own logprobs of its samples: the importance weights compare them with the training forward's.
    generate = (
        functools.partial(engine.generate, engine_logprobs=True)
        if engine is not None
        else utils.generation.generate
    )
    if ref_policy is not None:
        ref_policy = utils.run.bare(utils.run.prepare_frozen(ref_policy, accelerator))
    if reward_model is not None:
        reward_model = utils.run.bare(utils.run.prepare_frozen(reward_model, accelerator))
    # The reward model first, then the functions: the order of TRL's script, of --reward_weights and of the logs.
    scorers = [utils.scoring.RewardScorer(None, None, tokenizer, reward_fn=fn) for fn in reward_fns]
    if reward_model is not None:
        reward_tokenizer = utils.scoring.load_reward_tokenizer(
            args.reward_tokenizer_path, args.reward_model_path
        )
        scorers.insert(0, utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer))
    weights = torch.tensor(args.reward_weights or [1.0] * len(reward_names), device=device)
    # TRL-style reward functions (with **kwargs) get every dataset column of their rows, e.g. a `solution`; every
    # scorer gets the raw prompt (text or messages), so a reward model can render it with its own chat template.
    columns = utils.data.columns(dataset) if reward_fns else {}
    raw_prompts = utils.data.column(dataset, "prompt")
    correct_vllm = args.use_vllm and args.vllm_importance_sampling_correction

    # Resume: the weights, optimizer and random generators; the prompt iterator is replayed to its place.
    P, B = args.local_prompts_per_generation, args.local_generation_batch_size
    batches = utils.data.prompt_batches(len(prompt_ids), P, args.world_size, rank, args.seed)
    sampling_generator = torch.Generator(device=device).manual_seed(args.seed + rank)
    shuffle_generator = torch.Generator().manual_seed(args.seed + rank)
    generators = {"sampling": sampling_generator, "shuffle": shuffle_generator}
    ckpt = utils.checkpoint.Checkpointer(accelerator, args)
    checkpointed = dict(models={"policy": policy}, optimizers={"policy": optimizer}, generators=generators)
    state = ckpt.resume(**checkpointed)
    step, generation = (state["step"], state["generation"]) if state else (0, 0)  # generations made so far
    for _ in range(generation):
        next(batches)
    tracker = utils.tracking.Tracker(args, accelerator, start_step=step)

    chunk, R, T = args.local_rollout_forward_batch_size, args.max_completion_length, args.temperature

    def gathered_mean(values):
        return accelerator.gather(values.float()).mean().item()

    sample_every = max(
        1, args.total_steps // args.steps_per_generation_round // max(1, args.num_sample_generations)
    )
    start_time, start_generation, metrics = time.time(), generation, {}
    progress = tqdm(total=args.total_steps, initial=step, disable=not accelerator.is_local_main_process)
    while step < args.total_steps:
        # 2. Generation: P prompts stored once [P, Q], G * P completions in completion-major order (row i <-
        # prompt i % P), sampled with their logprobs and truncated after EOS. The groups stay on this process.
        examples = next(batches)  # dataset indices of this process's P prompts
        queries, query_mask = utils.generation.left_pad([prompt_ids[i] for i in examples], pad_id, device)
        generation += 1
        context_length = queries.size(1)
        completion_rows = torch.arange(B, device=device)
        policy.eval()  # dropout is off anyway; eval keeps the KV cache on under gradient checkpointing
        responses, sampled_logprobs = [], []
        if engine is not None:  # vLLM gets the policy's current weights (outside the gathering below)
            engine.sync_weights(policy, accelerator)
        with (
            torch.no_grad(),
            accelerator.autocast(),
            utils.run.gathered_for_generation(policy, accelerator) as model,
        ):
            for rows in completion_rows.split(chunk):  # prompts repeated chunk by chunk, not G times at once
                prompt = rows % P
                query_responses, logprobs = generate(
                    model, queries[prompt], query_mask[prompt], R, T, chunk, sampling_generator
                )
                responses.append(query_responses[:, context_length:])
                sampled_logprobs.append(logprobs)
        sampled_logprobs = torch.cat(sampled_logprobs)
        responses, lengths = utils.generation.truncate_response(torch.cat(responses), eos_id, pad_id)
        response_mask = utils.generation.lengths_to_mask(lengths, R)
        has_eos = ((responses == eos_id) & response_mask).any(1)
        rows_at = functools.partial(
            utils.generation.query_response_rows, queries, query_mask, responses, response_mask
        )

        # 3. Old logprobs (unless on-policy), rewards of every reward function / model, their weighted sum (NaN
        # where no reward scored a completion), and the group-relative advantages.
        rewards_per_func, ref_logprobs, old_logprobs = [], [], []
        trainer_state = utils.scoring.TrainerState(
            global_step=step,
            max_steps=args.total_steps,
            epoch=(generation - 1) * P * args.world_size / len(dataset),
        )
        with torch.no_grad(), accelerator.autocast():
            for idx in completion_rows.split(chunk):
                rows, mask = rows_at(idx)
                if recomputes_old_logprobs(args):
                    old_logprobs.append(utils.logprobs.batched_response_logprobs(policy, rows, mask, context_length, T,
                                                                        chunk))  # fmt: skip
                of_rows = utils.data.columns_of_rows(columns, examples, idx)
                of_prompts = [raw_prompts[examples[r % P]] for r in idx.tolist()]
                scores = [scorer(rows, mask, context_length, chunk, prompts=of_prompts, columns=of_rows,
                                 trainer_state=trainer_state) for scorer in scorers]  # fmt: skip
                rewards_per_func.append(torch.stack(scores, 1).float())
                if ref_policy is not None:
                    ref_logprobs.append(utils.logprobs.batched_response_logprobs(ref_policy, rows, mask, context_length,
                                                                        T, chunk))  # fmt: skip
        old_logprobs = torch.cat(old_logprobs) if old_logprobs else None
        ref_logprobs = torch.cat(ref_logprobs) if ref_policy is not None else None
        rewards_per_func = torch.cat(rewards_per_func)
        all_rewards_per_func = accelerator.gather(rewards_per_func)  # [processes * B, F], for the batch's std
        all_rewards = combine_rewards(all_rewards_per_func, weights)
        rewards = all_rewards.view(args.world_size, B)[rank]
        batch_std = nanstd(all_rewards) if args.scale_rewards == "batch" else None
        advantages = group_advantages(rewards, G, args.scale_rewards, batch_std)
        loss_mask = response_mask & has_eos[:, None] if args.mask_truncated_completions else response_mask
        importance_weights = None
        if correct_vllm:
            importance_weights = vllm_importance_weights(
                old_logprobs, sampled_logprobs, response_mask, args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max,
            )  # fmt: skip
        logged = {}  # what TRL-style reward functions reported with log_metric, averaged over processes
        for scorer in scorers:
            logged.update(scorer.take_logged())
        names = sorted(set(gather_object(list(logged)))) if args.world_size > 1 else sorted(logged)
        generation_metrics = {
            **reward_metrics(all_rewards_per_func, all_rewards, G, reward_names, args.world_size),
            "completions/mean_length": gathered_mean(lengths),
            "completions/clipped_ratio": gathered_mean(~has_eos),
            **{n: accelerator.gather(torch.tensor(logged.get(n, math.nan), device=device)).nanmean().item()
               for n in names},
        }  # fmt: skip
        if correct_vllm:
            generation_metrics.update(
                importance_sampling_metrics(
                    old_logprobs, sampled_logprobs, importance_weights, response_mask, accelerator
                )  # fmt: skip
            )

        # 4. Policy update: num_iterations passes over the generation, each freshly shuffled, cut into
        # micro-batches; gradient_accumulation_steps of them make one optimizer step (accelerate counts them).
        policy.train()
        ga = args.gradient_accumulation_steps
        orders = [
            torch.randperm(B, generator=shuffle_generator).to(device) for _ in range(args.num_iterations)
        ]
        micro_batches = [idx for order in orders for idx in order.split(args.per_device_train_batch_size)]
        for first in range(0, len(micro_batches), ga):
            if step >= args.total_steps:
                break
            lr = args.learning_rate * (
                1 - step / args.total_steps if args.lr_scheduler_type == "linear" else 1
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_batches = micro_batches[first : first + ga]
            # DAPO divides by the number of tokens of the whole optimizer step on all processes; the backward
            # averages over micro-batches and processes, so each micro-batch divides by count / (ga * processes).
            step_tokens = accelerator.reduce(sum(loss_mask[idx].sum().float() for idx in step_batches), "sum")
            num_items = step_tokens.item() / (ga * args.world_size)
            stats = torch.zeros(7, device=device)  # loss, kl, entropy, clip low, high, region, ratio
            grad_norm = None
            for idx in step_batches:
                with accelerator.accumulate(policy):
                    query_responses, attention_mask = rows_at(idx)
                    logprobs, entropy, _ = utils.logprobs.response_logprobs(
                        policy, query_responses, attention_mask, context_length, T, with_stats=True
                    )
                    mask = loss_mask[idx]
                    old = logprobs.detach() if old_logprobs is None else old_logprobs[idx]
                    per_token_loss = policy_token_loss(
                        args, logprobs, old, advantages[idx],
                        importance_weights[idx] if importance_weights is not None else None,
                    )  # fmt: skip
                    kl = torch.zeros_like(old)
                    if ref_policy is not None:
                        kl = kl_penalty(logprobs, old, ref_logprobs[idx], args.use_bias_correction_kl)
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = aggregate_loss(per_token_loss, mask, args.loss_type, R, num_items)
                    accelerator.backward(loss)
                    grad_norm = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm) or grad_norm
                    optimizer.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    ratio = (logprobs - old).exp()
                    clipped = clip_fractions(ratio, advantages[idx], mask, args.epsilon, args.epsilon_high)
                    if args.loss_type == "cispo":  # the tokens whose weight the cap lowered
                        clipped = (token_mean(((ratio > args.epsilon_high) & (advantages[idx, None] > 0)).float(),
                                              mask), 0.0, 0.0)  # fmt: skip
                    stats += torch.stack([
                        loss.detach(), token_mean(kl, mask), token_mean(entropy, mask),
                        *map(torch.as_tensor, clipped), token_mean(ratio, mask),
                    ]) / len(step_batches)  # fmt: skip
            step += 1
            progress.update(1)
            grad_norm = utils.run.grad_norm_after_step(policy, grad_norm)
            utils.tracking.check_finite(step, accelerator, loss=stats[0], grad_norm=grad_norm)

            # 5. Metrics, averaged over processes, under TRL's names.
            if step % args.logging_steps == 0 or step == args.total_steps:
                low_high = accelerator.gather(stats[3:5][None]).view(-1, 2)
                stats = accelerator.reduce(stats, reduction="mean")
                clip_metrics = {  # TRL's names; sapo has no clip
                    "clip_ratio/low_mean": stats[3].item(),
                    "clip_ratio/low_min": low_high[:, 0].min().item(),
                    "clip_ratio/high_mean": stats[4].item(),
                    "clip_ratio/high_max": low_high[:, 1].max().item(),
                    "clip_ratio/region_mean": stats[5].item(),
                } if args.loss_type not in ("cispo", "sapo") else {}  # fmt: skip
                if args.loss_type == "cispo":
                    clip_metrics = {"cispo_clip_ratio": stats[3].item()}
                metrics = {
                    **generation_metrics,
                    "loss": stats[0].item(),
                    "kl": stats[1].item(),
                    "entropy": stats[2].item(),
                    **clip_metrics,
                    "ratio": stats[6].item(),
                    **({"grad_norm": grad_norm} if grad_norm is not None else {}),
                    "learning_rate": lr,
                    "episode": generation * args.generation_batch_size,
                    "eps": int((generation - start_generation) * args.generation_batch_size
                               / (time.time() - start_time)),
                }  # fmt: skip
                tracker.log(metrics, step)

        # Checkpoints at the end of a generation only, so a resumed run starts with the next one.
        ckpt.maybe_save(step, **checkpointed, state={"generation": generation})

        if args.num_sample_generations and (generation % sample_every == 0 or generation == 1):
            shown = torch.arange(min(P, 4), device=device)
            tracker.samples({
                "query": tokenizer.batch_decode(queries[shown], skip_special_tokens=True),
                "completion": [tokenizer.decode(r[m], skip_special_tokens=True)
                               for r, m in zip(responses[shown], response_mask[shown])],
                "reward": rewards[shown].tolist(),
                "advantage": advantages[shown].tolist(),
            }, title=f"generation {generation}, step {step}")  # fmt: skip
    progress.close()

    # 6. Save the policy (every process takes part, so ZeRO-3 can gather its shards) and a model card.
    utils.saving.save_model(accelerator, policy, tokenizer, args, "GRPO", args.model_name_or_path, metrics)
    tracker.close()
    utils.run.end_run(accelerator)


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
