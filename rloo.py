"""REINFORCE Leave-One-Out (RLOO) for language models, in one file.

Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
in LLMs" (2024), https://arxiv.org/abs/2402.14740; the estimator is from Kool et al., "Buy 4 REINFORCE
Samples, Get a Baseline for Free!" (2019).

For each prompt the policy samples `--rloo_k` completions. A completion's reward is its score (reward model or
reward function) minus `kl_coef` times the KL to the frozen SFT model, summed over its tokens; its baseline is
the mean reward of the other k-1 completions of the same prompt, so no critic is needed. By default the whole
completion is one action (sequence-level ratio); `--token_level_kl` puts the KL on every token and the score
on the EOS token (REINFORCE++ style) and makes every token an action. With `num_ppo_epochs > 1` (or several
mini-batches) the update is PPO's clipped objective; with one epoch and one mini-batch it is plain REINFORCE.

Batch layout, completion-major: the k*P completions of one update are rows `c * P + p` (completion c of prompt
p), i.e. `rewards.view(k, P)`. Prompts are stored once ([P, Q]); the rows are built at forward time.

Two versions of TRL's flags: TRL 0.19's RLOOConfig (`--rloo_k`, `--kl_coef`, `--total_episodes`, ...) and TRL 1.16's
(`--num_generations`, `--beta`, `--max_steps`, several `--reward_funcs` with `--reward_weights`, ...; see
TRL_RENAMED and TRL1_ONLY). A command line that sets any TRL-1.16-only flag gets TRL 1.16's defaults for every flag
it leaves out (stop at EOS, 512 tokens, one iteration, 3 epochs, learning rate 1e-6, ...) and TRL 1.16's meaning
(epochs and optimizer steps, advantages normalized with std + 1e-4, unscorable completions left out of the
baseline); any other command line keeps TRL 0.19's. `--trl_defaults` picks one outright.

    python rloo.py --sft_model_path models/sft --reward_model_path models/reward --dataset_name data/tldr/prompts \
        --rloo_k 2 --per_device_train_batch_size 16 --gradient_accumulation_steps 16 --num_mini_batches 2 \
        --num_ppo_epochs 2 --learning_rate 3e-6 --total_episodes 1000000 --kl_coef 0.03 \
        --stop_token eos --missing_eos_penalty 1.0 --local_rollout_forward_batch_size 16 --output_dir models/rloo
    python rloo.py --model_name_or_path models/sft --dataset_name data/prompts --reward_model_name_or_path \
        models/reward --reward_funcs rewards.py:length --reward_weights 1.0 0.1 --num_generations 4 --beta 0.03
"""

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch

import utils.chat
import utils.checkpoint
import utils.data
import utils.generation
import utils.loading
import utils.logprobs
import utils.run
import utils.saving
import utils.scoring
import utils.stats
import utils.tracking
import utils.trl_flags
import utils.vllm


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int | None = None
    """seed of sampling and shuffling (model init is the checkpoint's); None: 1 / 42 (TRL 0.19's / 1.16's flags)"""
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
    output_dir: str = "models/rloo"
    """where the trained policy (weights, tokenizer, model card) is saved"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir: its contents are moved aside to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (without its checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int | None = None
    """checkpoint to {output_dir}/checkpoint-{update} every this many updates (0: only on SIGTERM/SIGINT); None:
    0 / 500 (TRL 0.19's / 1.16's flags)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint-N folder, or `latest` (the newest in --output_dir), to continue a run exactly from"""

    # Models and data
    model_name_or_path: str | None = None
    """the policy to start from and its tokenizer (hub id or local dir); --sft_model_path overrides the weights"""
    sft_model_path: str | None = None
    """the SFT policy to start from; also the frozen reference model of the KL penalty"""
    reward_model_path: str | None = None
    """sequence classifier (one label) giving the score; or use --reward_fn"""
    reward_model_name_or_path: str | None = None
    """TRL 1.16's name of --reward_model_path (its score comes first, then the --reward_funcs')"""
    reward_tokenizer_path: str | None = None
    """the reward model's tokenizer (TRL: reward_processing_classes); None: the one in --reward_model_path. When it
    is not the policy's, completions are decoded and encoded again with it"""
    reward_fn: str | None = None
    """path/to/file.py:function or module.function, returning one float per completion: called as function(prompts,
    completions) on texts, or, when it takes **kwargs, as TRL calls it (keywords prompts, completions,
    completion_ids, trainer_state, log_metric, log_extra and every dataset column)"""
    reward_funcs: list[str] | None = None
    """TRL 1.16: reward functions as --reward_fn takes them, after the reward model, summed with --reward_weights
    (a None is no reward; a completion without any is left out)"""
    reward_weights: list[float] | None = None
    """TRL 1.16: one weight per reward (the reward model, then the --reward_funcs); None: all 1"""
    dataset_name: str = "trl-lib/tldr"
    """hub id, save_to_disk directory, folder of {split}.jsonl/parquet, or one file; needs a `prompt` column (text,
    or conversations rendered with the chat template and its generation prompt); other columns are ignored"""
    dataset_config: str | None = None
    """dataset configuration: the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split holding the prompts"""
    dataset_test_split: str | None = None
    """split whose first prompts are completed for the sample table (None: the table shows the rollout)"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) whose chat template renders conversational prompts"""
    max_prompt_length: int | None = None
    """keep only the last this-many tokens of each prompt (None: keep all)"""
    bf16: bool = False
    """bf16 mixed precision (accelerate)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""

    # Algorithm
    trl_defaults: Literal["auto", "0.19", "1.16"] = "auto"
    """whose defaults fill the flags not given (None below: TRL 0.19's / 1.16's); auto: TRL 1.16's when a flag only
    TRL 1.16 has is set"""
    total_episodes: int | None = None
    """completions to train on in total (None: every prompt once; with TRL 1.16's flags, see --max_steps)"""
    num_train_epochs: float | None = None
    """TRL 1.16: passes over the prompts (incomplete last batch dropped), when --max_steps is -1; None: 3"""
    max_steps: int | None = None
    """TRL 1.16: optimizer steps in all, rounded up to whole updates (-1: from --num_train_epochs); None: -1"""
    learning_rate: float | None = None
    """Adam learning rate; None: 3e-6 / 1e-6 (TRL 0.19's / 1.16's flags)"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """'linear' decays the learning rate to 0 over the updates"""
    max_grad_norm: float | None = None
    """clip the gradient norm (logged) at this value, also under DeepSpeed (0: no clipping); None: 0 / 1.0"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass per process (micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    num_mini_batches: int | None = None
    """optimizer steps per epoch over one update's batch; None: 1"""
    steps_per_generation: int | None = None
    """TRL 1.16: micro-batches per rollout = gradient_accumulation_steps * num_mini_batches (a multiple of it)"""
    generation_batch_size: int | None = None
    """TRL 1.16: completions per rollout over all processes = batch_size"""
    num_ppo_epochs: int | None = None
    """epochs over each batch of completions (> 1 relies on the clipped objective); None: 4 / 1"""
    num_iterations: int | None = None
    """TRL 1.16's name of --num_ppo_epochs"""
    rloo_k: int | None = None
    """completions sampled per prompt (at least 2: the baseline is the mean of the other k-1); None: 2"""
    num_generations: int | None = None
    """TRL 1.16's name of --rloo_k"""
    kl_coef: float | None = None
    """weight of the KL penalty to the reference model, subtracted from the reward; None: 0.05"""
    beta: float | None = None
    """TRL 1.16's name of --kl_coef"""
    cliprange: float | None = None
    """clip range of the probability ratio; None: 0.2"""
    epsilon: float | None = None
    """TRL 1.16's name of --cliprange"""
    epsilon_high: float | None = None
    """TRL 1.16: upper clip range of the ratio, 1 + epsilon_high (DAPO); None: --cliprange"""
    token_level_kl: bool = False
    """KL penalty on every token and the score on the EOS token, every token an action (REINFORCE++ style)"""
    whiten_rewards: bool = False
    """whiten the rewards (variance 1, mean kept) over the batch before the advantages"""
    normalize_reward: bool = False
    """normalize the scores to mean 0, std 1 over the batch, then clip them to +-reward_clip_range"""
    reward_clip_range: tuple[float, ...] | None = None
    """one value (TRL 0.19): clip range of the normalized scores (with --normalize_reward; None: 10); two values
    (TRL 1.16): clamp the summed reward to [min, max] before the KL penalty"""
    normalize_advantage: bool = False
    """TRL 0.19: whiten the advantages over the batch (its tokens with --token_level_kl), / sqrt(var + 1e-8)"""
    normalize_advantages: bool = False
    """TRL 1.16: normalize the advantages over the batch, (A - mean) / (std + 1e-4), unscorable ones left out"""
    mask_truncated_completions: bool = False
    """TRL 1.16: completions without a stop token get no gradient and no KL (they still count in the baselines)"""
    response_length: int | None = None
    """tokens sampled per completion (then truncated after the stop token); None: 53 / 512"""
    max_completion_length: int | None = None
    """TRL 1.16's name of --response_length"""
    temperature: float | None = None
    """sampling temperature, also of the logprobs of policy and reference; None: 0.7 / 1.0"""
    stop_token: Literal["eos"] | None = None
    """'eos' truncates completions after the tokenizer's EOS token; None: none / 'eos' (unless --stop_token_id)"""
    stop_token_id: int | None = None
    """truncate completions after this token id"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of completions without an EOS token"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / reference / reward forward pass"""
    use_vllm: bool = False
    """sample the rollouts with vLLM (pip install -r requirements-vllm.txt); the old logprobs still come from
    the training forward pass"""
    vllm_mode: Literal["colocate"] = "colocate"
    """colocate: a vLLM engine in each training process, on its device (TRL's server mode is not provided)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of the GPU memory the vLLM engine takes (on CPU: VLLM_CPU_KVCACHE_SPACE GiB, 1 unless set)"""
    vllm_tensor_parallel_size: int = 1
    """processes that share one vLLM engine, tensor-parallel (must divide the number of processes)"""
    recompute_old_logprobs: Literal["auto", "true", "false"] = "auto"
    """recompute the logprobs of the sampled tokens with the training forward pass instead of taking sampling's
    (cached, token by token): they differ in bf16, so the ratio would not start at 1. auto: true under bf16"""
    num_sample_generations: int = 10
    """print a table of sample completions at the first update and this many times more (0: never)"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """no: no sample tables; steps: --num_sample_generations tables, or one every --eval_steps updates"""
    eval_steps: int | None = None
    """print the sample table every this many updates (replaces --num_sample_generations' spacing)"""

    # Filled in at runtime
    dialect: str = ""
    """the TRL version whose flags and defaults the run uses, 0.19 or 1.16 (filled in at runtime)"""
    world_size: int = 0
    """number of processes (filled in at runtime)"""
    local_batch_size: int = 0
    """completions per process per update = per_device_train_batch_size * gradient_accumulation_steps *
    num_mini_batches (filled in at runtime)"""
    batch_size: int = 0
    """completions per update over all processes = local_batch_size * world_size (filled in at runtime)"""
    local_mini_batch_size: int = 0
    """completions per process per optimizer step (filled in at runtime)"""
    mini_batch_size: int = 0
    """completions per optimizer step over all processes (filled in at runtime)"""
    local_dataloader_batch_size: int = 0
    """prompts per process per update = local_batch_size / rloo_k (filled in at runtime)"""
    num_total_batches: int = 0
    """number of updates = ceil(total_episodes / batch_size) (filled in at runtime)"""


# ----------------------------------------------------------------------------------------------------------------
# Checks and sizes: TRL 0.19's and TRL 1.16's flags, then the batch arithmetic
# ----------------------------------------------------------------------------------------------------------------
VERSIONS = ("0.19", "1.16")
# TRL 0.19's name (the field the script reads) -> TRL 1.16's name of the same setting
TRL_RENAMED = {
    "rloo_k": "num_generations", "kl_coef": "beta", "cliprange": "epsilon", "num_ppo_epochs": "num_iterations",
    "response_length": "max_completion_length", "reward_model_path": "reward_model_name_or_path",
}  # fmt: skip
# Flags only TRL 1.16 has: one of them (or a 1.16 name above) makes the command line TRL 1.16's
TRL1_ONLY = ("reward_funcs", "reward_weights", "epsilon_high", "normalize_advantages", "mask_truncated_completions",
             "num_train_epochs", "max_steps", "steps_per_generation", "generation_batch_size")  # fmt: skip
# flag: (default with TRL 0.19's flags, default with TRL 1.16's)
TRL_DEFAULTS = {
    "rloo_k": (2, 2), "kl_coef": (0.05, 0.05), "cliprange": (0.2, 0.2), "num_ppo_epochs": (4, 1),
    "response_length": (53, 512), "learning_rate": (3e-6, 1e-6), "temperature": (0.7, 1.0), "seed": (1, 42),
    "max_grad_norm": (0.0, 1.0), "save_steps": (0, 500), "num_mini_batches": (1, 1),
}  # fmt: skip


def flag(args: Args, name: str) -> str:
    """`--name` as the command line's TRL version calls it."""
    return utils.trl_flags.flag_name(name, TRL_RENAMED, args.dialect, VERSIONS)


def read_trl_flags(args: Args) -> Args:
    """Settle which TRL version's flags the command line speaks (args.dialect) and fill every flag not given with
    that version's default; flags that contradict each other are refused in one sentence. Runs once."""
    if args.dialect:
        return args
    clip = args.reward_clip_range
    if clip is not None and (len(clip) not in (1, 2) or (len(clip) == 2 and clip[0] > clip[1])):
        raise ValueError(f"--reward_clip_range takes one value or two (min <= max), got {clip}.")
    two_values = clip is not None and len(clip) == 2  # TRL 1.16's (min, max)
    choice = "1.16" if args.trl_defaults == "auto" and two_values else args.trl_defaults
    version = utils.trl_flags.speaks(args, TRL_RENAMED, TRL1_ONLY, choice, VERSIONS)
    utils.trl_flags.read_sizes(args)
    if args.normalize_advantage and args.normalize_advantages:
        raise ValueError("--normalize_advantage (TRL 0.19) and --normalize_advantages (TRL 1.16) normalize the "
                         "advantages two ways (sqrt(var + 1e-8) against std + 1e-4); pass one.")  # fmt: skip
    if two_values and args.normalize_reward:
        raise ValueError("--reward_clip_range with two values clamps the reward (TRL 1.16); with --normalize_reward "
                         "it takes one, the clip range of the normalized scores.")  # fmt: skip
    if args.mask_truncated_completions and args.token_level_kl:
        raise ValueError("--mask_truncated_completions (TRL 1.16, a loss per completion) does not go with "
                         "--token_level_kl.")  # fmt: skip
    if args.reward_fn is not None and args.reward_funcs not in (None, [args.reward_fn]):
        raise ValueError("--reward_fn (TRL 0.19, one function) and --reward_funcs (TRL 1.16) both name reward "
                         "functions; put them all in --reward_funcs.")  # fmt: skip
    utils.trl_flags.resolve(args, TRL_RENAMED, TRL_DEFAULTS, version, VERSIONS)
    if args.reward_fn is not None:
        args.reward_funcs = [args.reward_fn]
    if version == "1.16" and args.stop_token is None and args.stop_token_id is None:
        args.stop_token = "eos"  # TRL 1.16 always stops at EOS
    if version == "1.16" and args.total_episodes is None:
        args.max_steps = -1 if args.max_steps is None else args.max_steps
        args.num_train_epochs = 3.0 if args.num_train_epochs is None else args.num_train_epochs
    if args.reward_clip_range is None and (version == "0.19" or args.normalize_reward):
        args.reward_clip_range = (10.0,)
    args.dialect = version
    return args


def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Read the TRL flags, check them and compute the derived batch sizes (TRL's arithmetic); ValueError on a bad
    value."""
    read_trl_flags(args)
    if args.rloo_k < 2:
        k = flag(args, "rloo_k")
        raise ValueError(
            f"{k} must be at least 2 (the baseline is the mean of the other k-1), got {args.rloo_k}."
        )
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                 "num_ppo_epochs", "response_length", "local_rollout_forward_batch_size"):  # fmt: skip
        if getattr(args, name) < 1:
            raise ValueError(f"{flag(args, name)} must be at least 1, got {getattr(args, name)}.")
    if min(args.temperature, args.cliprange, args.epsilon_high or 1) <= 0:
        raise ValueError(
            "--temperature and the clip ranges must be positive (RLOO needs sampled completions)."
        )
    num_rewards = (args.reward_model_path is not None) + len(args.reward_funcs or [])
    if args.dialect == "0.19" and num_rewards != 1:
        raise ValueError("pass exactly one of --reward_model_path and --reward_fn.")
    if num_rewards == 0:
        raise ValueError("pass a reward: --reward_model_name_or_path and/or --reward_funcs.")
    if args.reward_weights is not None and len(args.reward_weights) != num_rewards:
        raise ValueError(f"--reward_weights has {len(args.reward_weights)} values for {num_rewards} rewards (the "
                         "reward model, then the --reward_funcs).")  # fmt: skip
    if args.sft_model_path is None and args.model_name_or_path is None:
        raise ValueError("pass the policy to train with --sft_model_path or --model_name_or_path.")
    if args.stop_token is not None and args.stop_token_id is not None:
        raise ValueError("pass only one of --stop_token and --stop_token_id.")
    args.world_size, args.num_mini_batches = world_size, utils.trl_flags.mini_batches(args, world_size)
    args.local_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    )
    args.batch_size = args.local_batch_size * world_size
    args.local_mini_batch_size = args.local_batch_size // args.num_mini_batches
    args.mini_batch_size = args.batch_size // args.num_mini_batches
    if args.local_batch_size % args.rloo_k:
        k = flag(args, "rloo_k")
        raise ValueError(
            f"{k} {args.rloo_k} must divide the completions per process per update, per_device_train_batch_size "
            f"* gradient_accumulation_steps * num_mini_batches = {args.local_batch_size}; change {k} or "
            "--per_device_train_batch_size / --gradient_accumulation_steps / --num_mini_batches."
        )
    args.local_dataloader_batch_size = args.local_batch_size // args.rloo_k
    if num_prompts is not None:
        prompts_per_update = args.local_dataloader_batch_size * world_size
        if num_prompts < prompts_per_update:
            raise ValueError(
                f"the dataset has {num_prompts} prompts, fewer than the {prompts_per_update} of one update; "
                "lower the batch flags or use a larger split."
            )
        if args.max_steps is not None:  # TRL 1.16: optimizer steps, or epochs, of whole updates
            args.num_total_batches = utils.trl_flags.num_updates(
                args.max_steps, args.num_train_epochs, num_prompts // prompts_per_update,
                args.num_ppo_epochs * args.num_mini_batches,
            )  # fmt: skip
            return args
        if args.total_episodes is None:
            args.total_episodes = num_prompts * args.rloo_k
        if args.total_episodes < 1:
            raise ValueError(f"--total_episodes must be at least 1, got {args.total_episodes}.")
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    return args


# ----------------------------------------------------------------------------------------------------------------
# The math (pure functions; B = k * P completions in completion-major order, R response tokens)
# ----------------------------------------------------------------------------------------------------------------
def rloo_baseline(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Leave-one-out baseline [B]: for completion c of prompt p, mean_{c' != c} rewards[c' * P + p]. A NaN reward
    (an unscorable completion, TRL 1.16) is left out of its siblings' means; NaN where no sibling has one."""
    grouped = rewards.view(k, -1)  # [k, P]: row c holds completion c of every prompt
    if not grouped.isnan().any():
        return ((grouped.sum(0, keepdim=True) - grouped) / (k - 1)).flatten()
    scored = (~grouped.isnan()).sum(0, keepdim=True)
    return ((grouped.nansum(0, keepdim=True) - grouped) / (scored - 1)).flatten()


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """A_i = R_i - mean of the other k-1 rewards of the same prompt. rewards [B] completion-major -> [B]."""
    return rewards - rloo_baseline(rewards, k)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Reward [B] = sum_f w_f * r_f over the F rewards [B, F] (the reward model, then the functions), a NaN (a
    function's None) counting as absent; NaN where all are absent (TRL 1.16: an unscorable completion)."""
    total = (rewards_per_func * weights).nansum(1)
    return total.masked_fill(rewards_per_func.isnan().all(1), math.nan)


def standardize_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's normalize_advantages: (A - mean) / (std + 1e-4) over the actions where mask [B] or [B, R] is set,
    std with Bessel's correction; NaN (unscorable) entries are left out of both and stay NaN."""
    kept = advantages[mask.bool() & ~advantages.isnan()]
    return (advantages - kept.mean()) / (kept.std() + 1e-4) * mask


def sequence_level_rewards(scores, kl, mask, kl_coef):
    """Whole-completion reward [B]: score - kl_coef * sum_t kl_t over the response tokens (mask [B, R])."""
    return scores - kl_coef * (kl * mask).sum(1)


def token_level_rewards(scores, kl, lengths, kl_coef):
    """Per-token rewards [B, R]: -kl_coef * kl_t on every response token, plus the score on the last kept token
    (the EOS when there is one; index lengths - 1, never the token after it). Zero on padding."""
    mask = utils.generation.lengths_to_mask(lengths, kl.size(1))
    rewards = -kl_coef * kl * mask
    return rewards.scatter_add(1, (lengths - 1)[:, None], scores[:, None].to(rewards.dtype))


def token_level_advantages(rewards: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """Advantage of token t [B, R]: reward-to-go G_t = sum_{s >= t} r_s (gamma 1) minus the leave-one-out mean
    of the other completions' total rewards G_0. At t = 0 it equals rloo_advantages of the summed rewards; later
    tokens are not charged for the KL of the tokens before them. Zero on padding."""
    rewards = rewards * mask
    returns = rewards.flip(1).cumsum(1).flip(1)
    return (returns - rloo_baseline(returns[:, 0], k)[:, None]) * mask


def finished(responses: torch.Tensor, lengths: torch.Tensor, finished_ids: torch.Tensor) -> torch.Tensor:
    """[B] True where the completion's last kept token is one of `finished_ids` (stop, EOS or pad token): it was
    not cut at the length limit (TRL 1.16's test for --mask_truncated_completions)."""
    return torch.isin(responses.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1), finished_ids)


def normalize_scores(scores: torch.Tensor, clip_range: float) -> torch.Tensor:
    """(scores - mean) / std over the batch, then clipped to [-clip_range, clip_range]."""
    return ((scores - scores.mean()) / (scores.std() + 1e-8)).clamp(-clip_range, clip_range)


def policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange, cliprange_high=None):
    """PPO's clipped surrogate, -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A), averaged over the actions
    (eps_high: `cliprange_high`, else `cliprange`).

    new/old_logprobs [B, R] of the response tokens, mask [B, R]. With advantages [B] an action is a whole
    completion (ratio = exp of the summed log-ratio); with advantages [B, R] it is a token.
    Returns (loss, ratio of each action, clip fraction, approximate KL 0.5 * E[log-ratio^2])."""
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


def batch_advantages(args, scores, kl, mask, lengths, gather=lambda values: values, rank=0):
    """Phase 6 for this process's B completions: the score clamped (TRL 1.16's two-value --reward_clip_range) or
    normalized (--normalize_reward), minus kl_coef times the KL (kl, mask [B, R]; summed, or per token with
    --token_level_kl), leave-one-out advantages, then the flags' normalizations, with the statistics of every
    process's completions (`gather`: all processes' rows in process order). NaN scores (unscorable completions)
    are left out of every statistic and get advantage 0. Returns (advantages [B] or [B, R], action mask, scores)."""
    B, k = scores.size(0), args.rloo_k

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
    if args.token_level_kl:  # every token is an action
        rewards = token_level_rewards(scores, kl, lengths, args.kl_coef)
        action_mask = mask
    else:  # the whole completion is one action
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
    return advantages.masked_fill(advantages.isnan(), 0.0), action_mask, scores


# ----------------------------------------------------------------------------------------------------------------
# Rollout: sampling, truncation, and the logprobs and scores of an update (every process runs them together)
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def sample(args, accelerator, policy, queries, query_mask, num_completions, key, first_prompt, stop_token_id,
           pad_id, engine=None):  # fmt: skip
    """`num_completions` completions of each prompt [P, Q], completion-major [num_completions * P, R], truncated
    after the stop token: (responses, lengths, response mask, logprobs of sampling). One generation call samples
    every completion of max(1, chunk // num_completions) prompts, so a call has up to `chunk` rows whatever k is
    (one call per completion index would run the LM head over a k-times smaller batch k times as often). The
    prompts p.. of a call use the noise of (seed, *key, first_prompt + p): first_prompt is the index of this
    process's first prompt in the update's global batch. With `engine` (--use_vllm), vLLM samples them."""
    chunk, P = args.local_rollout_forward_batch_size, queries.size(0)
    prompts_per_call = max(1, chunk // num_completions)
    responses, logprobs = [], []  # per call: [num_completions, prompts of the call, R]
    if engine is not None:  # vLLM gets the policy's current weights (outside the gathering below)
        engine.sync_weights(policy, accelerator)
    generate = engine.generate if engine is not None else utils.generation.generate
    policy.eval()  # dropout is off anyway; eval keeps the KV cache on under gradient checkpointing
    with utils.run.gathered_for_generation(policy, accelerator) as sampler:
        for start in range(0, P, prompts_per_call):
            prompt = torch.arange(start, min(start + prompts_per_call, P), device=queries.device)
            rows = prompt.repeat(num_completions)  # completion-major within the call
            noise = utils.generation.sampling_generator(
                args.seed, *key, first_prompt + start, device=queries.device
            )
            query_responses, call_logprobs = generate(
                sampler, queries[rows], query_mask[rows], args.response_length, args.temperature, rows.numel(),
                noise,
            )  # fmt: skip
            responses.append(query_responses[:, queries.size(1) :].unflatten(0, (num_completions, -1)))
            logprobs.append(call_logprobs.unflatten(0, (num_completions, -1)))
    responses = torch.cat(responses, 1).flatten(0, 1)
    logprobs = torch.cat(logprobs, 1).flatten(0, 1)
    responses, lengths = utils.generation.truncate_response(responses, stop_token_id, pad_id)
    return responses, lengths, utils.generation.lengths_to_mask(lengths, args.response_length), logprobs


def score_rows(scorers, query_responses, mask, context_length, chunk, **kwargs) -> torch.Tensor:
    """Rewards [B, F] of the rows from each reward model / function, in TRL's order (the reward model first);
    kwargs: the RewardScorer's prompts, columns and trainer_state."""
    return torch.stack(
        [score(query_responses, mask, context_length, chunk, **kwargs) for score in scorers], 1
    )


@torch.no_grad()
def rollout(args, accelerator, policy, ref_policy, scorers, queries, query_mask, update, first_prompt,
            stop_token_id, pad_id, recompute_old_logprobs, engine=None, columns=None, examples=(), raw_prompts=(),
            trainer_state=None):  # fmt: skip
    """Sample rloo_k completions of each prompt and score them; the logprobs of the policy (sampling's, or the
    training forward pass's with `recompute_old_logprobs`) and of the reference. `columns`, `examples`,
    `raw_prompts`: the dataset's columns, the P prompts' rows in it and every row's prompt as the dataset holds it
    (text or messages), for the reward models and functions. Returns a dict of [B, ...]; rewards [B, F]."""
    responses, lengths, response_mask, logprobs = sample(
        args, accelerator, policy, queries, query_mask, args.rloo_k, (update,), first_prompt, stop_token_id,
        pad_id, engine,
    )  # fmt: skip
    chunk, Q, T = args.local_rollout_forward_batch_size, queries.size(1), args.temperature
    rows_at = functools.partial(
        utils.generation.query_response_rows, queries, query_mask, responses, response_mask
    )
    ref_logprobs, rewards, recomputed, P = [], [], [], queries.size(0)
    for idx in torch.arange(responses.size(0), device=queries.device).split(chunk):
        query_responses, mask = rows_at(idx)
        ref_logprobs.append(
            utils.logprobs.batched_response_logprobs(ref_policy, query_responses, mask, Q, T, chunk)
        )
        if recompute_old_logprobs:  # the bare policy: the same forward as training, without DDP's hooks
            bare = utils.run.bare(policy)
            recomputed.append(
                utils.logprobs.batched_response_logprobs(bare, query_responses, mask, Q, T, chunk)
            )
        of_rows = utils.data.columns_of_rows(columns or {}, examples, idx)
        prompts = [raw_prompts[examples[i % P]] for i in idx.tolist()] if len(raw_prompts) else None
        rewards.append(score_rows(scorers, query_responses, mask, Q, chunk, prompts=prompts, columns=of_rows,
                                  trainer_state=trainer_state))  # fmt: skip
    return dict(
        responses=responses, lengths=lengths, response_mask=response_mask, sampled_logprobs=logprobs,
        logprobs=torch.cat(recomputed) if recomputed else logprobs, ref_logprobs=torch.cat(ref_logprobs),
        rewards=torch.cat(rewards).float(),
    )  # fmt: skip


def logged_means(accelerator, scorers) -> dict[str, float]:
    """What TRL-style reward functions reported through log_metric this update: each name's mean over the
    processes that reported it."""
    from accelerate.utils import gather_object

    logged = {name: value for scorer in scorers for name, value in scorer.take_logged().items()}
    every = gather_object([logged]) if accelerator.num_processes > 1 else [logged]
    names = sorted({name for one in every for name in one})
    return {name: sum(one[name] for one in every if name in one) / sum(name in one for one in every)
            for name in names}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    # 1. Flags, accelerator and data: everything that can be checked before a model is loaded.
    fill_sizes(args, 1)
    utils.vllm.check_args(args)
    accelerator = utils.run.make_accelerator(
        args, args.gradient_accumulation_steps, micro_batch_size=args.per_device_train_batch_size
    )
    reward_fns = [utils.scoring.load_reward_fn(spec) for spec in args.reward_funcs or []]
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.data.check_columns(dataset, ["prompt"], f"--dataset_name {args.dataset_name}")
    # A TRL-style reward function (with **kwargs) gets every dataset column of its rows, e.g. a `solution`.
    columns = utils.data.columns(dataset) if reward_fns else {}
    raw_prompts = list(dataset["prompt"])  # what reward models and functions read: the text or the messages
    if args.eval_steps is not None and args.eval_steps < 1:
        raise ValueError(f"--eval_steps must be at least 1, got {args.eval_steps}.")
    sample_prompts = None
    if args.dataset_test_split and args.num_sample_generations and args.eval_strategy == "steps":
        sample_prompts = utils.data.load_split(
            args.dataset_name, args.dataset_test_split, args.dataset_config
        )
        utils.data.check_columns(
            sample_prompts, ["prompt"], f"--dataset_test_split {args.dataset_test_split}"
        )
        sample_prompts = sample_prompts.select(
            range(min(4, len(sample_prompts)))
        )  # rendered with the tokenizer
    sample_columns = utils.data.columns(sample_prompts) if reward_fns and sample_prompts is not None else {}
    sample_raw_prompts = list(sample_prompts["prompt"]) if sample_prompts is not None else None
    fill_sizes(args, accelerator.num_processes, len(dataset))
    if args.eval_strategy == "no":
        args.num_sample_generations = 0
    elif args.eval_steps:
        args.num_sample_generations = max(1, args.num_total_batches // args.eval_steps)
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    utils.checkpoint.check_output_dir(
        args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint)
    )
    ckpt = utils.checkpoint.Checkpointer(accelerator, args)  # checks the resume path; takes its run name
    recompute_old_logprobs = args.recompute_old_logprobs == "true" or (
        args.recompute_old_logprobs == "auto" and accelerator.mixed_precision == "bf16"
    )
    set_seed(args.seed)
    device, rank = accelerator.device, accelerator.process_index

    # 2. Tokenizer and prompts: --model_name_or_path gives the tokenizer; --sft_model_path, when given, the weights.
    policy_path, policy_flag = (
        (args.sft_model_path, "--sft_model_path") if args.sft_model_path else
        (args.model_name_or_path, "--model_name_or_path")
    )  # fmt: skip
    tokenizer_path, tokenizer_flag = (
        (args.model_name_or_path, "--model_name_or_path") if args.model_name_or_path else (policy_path, policy_flag)
    )  # fmt: skip
    tokenizer = utils.loading.load_tokenizer(tokenizer_path, tokenizer_flag, args.chat_template_path)
    prompt_texts = utils.data.prompt_texts(dataset, tokenizer, f"--dataset_name {args.dataset_name}")
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    stop_token_id = eos_id if args.stop_token == "eos" else args.stop_token_id
    prompt_ids = utils.chat.tokenize_prompts(tokenizer, prompt_texts, args.max_prompt_length)
    if sample_prompts is not None:
        sample_texts = utils.data.prompt_texts(sample_prompts, tokenizer, "--dataset_test_split")
        sample_prompts = utils.chat.tokenize_prompts(tokenizer, sample_texts, args.max_prompt_length)

    # 3. Models: the policy, its frozen copy as reference, the reward model; dropout off in all of them, so the
    # logprobs of the training forward pass equal those of sampling. Frozen models run in the policy's precision.
    policy = utils.loading.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    ref_policy = utils.loading.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    reward_model = utils.scoring.load_reward_model(args.reward_model_path) if args.reward_model_path else None
    for model in (policy, ref_policy):
        utils.loading.disable_dropout(model)
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(policy)
    optimizer = utils.run.adamw(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    ref_policy = utils.run.prepare_frozen(ref_policy, accelerator)
    max_model_len = max(map(len, prompt_ids)) + args.response_length
    engine = utils.vllm.Engine(args, accelerator, policy_path, max_model_len) if args.use_vllm else None
    reward_model = utils.run.prepare_frozen(reward_model, accelerator) if reward_model is not None else None
    # Scores: the reward model reads the policy's ids, or its own tokenizer's encoding of the decoded text.
    reward_tokenizer = utils.scoring.load_reward_tokenizer(args.reward_tokenizer_path, args.reward_model_path)
    scorers = [utils.scoring.RewardScorer(None, None, tokenizer, reward_fn=fn) for fn in reward_fns]
    reward_names = [getattr(fn, "__name__", "reward") for fn in reward_fns]
    if reward_model is not None:  # TRL's order: the reward model first
        scorers.insert(0, utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer))
        reward_names.insert(0, os.path.basename(os.path.normpath(args.reward_model_path)))
    weights = torch.tensor(args.reward_weights or [1.0] * len(scorers), device=device)
    for scorer in scorers:
        accelerator.print(scorer.describe())

    # 4. State of the run: the prompt order is the same on every process; sampling noise is keyed by update and
    # prompt (sampling_generator); the shuffling generator, weights and optimizer come back from a checkpoint.
    shuffle_generator = torch.Generator().manual_seed(args.seed + rank)
    checkpointed = dict(models={"policy": policy}, optimizers={"policy": optimizer},
                        generators={"shuffle": shuffle_generator})  # fmt: skip
    state = ckpt.resume(**checkpointed) or {"step": 0}
    start = state["step"]
    batches = utils.data.prompt_batches(
        len(prompt_ids), args.local_dataloader_batch_size, args.world_size, rank, args.seed
    )
    for _ in range(state.get("prompt_batches", 0)):  # the data order continues where the checkpoint left it
        next(batches)
    tracker = utils.tracking.Tracker(args, accelerator, start_step=start)
    chunk, T = args.local_rollout_forward_batch_size, args.temperature
    B, P = args.local_batch_size, args.local_dataloader_batch_size

    def gathered_mean(values):  # NaN: an unscorable completion (TRL 1.16), left out
        values = accelerator.gather(values.float())
        return (values.nanmean() if values.isnan().any() else values.mean()).item()

    finished_ids = torch.tensor([i for i in (stop_token_id, eos_id, pad_id) if i is not None], device=device)
    steps_per_update = args.num_ppo_epochs * args.num_mini_batches

    sample_every = max(1, args.num_total_batches // max(1, args.num_sample_generations))
    start_time, metrics = time.time(), {}
    for update in tqdm(range(start + 1, args.num_total_batches + 1), initial=start, total=args.num_total_batches,
                       disable=not accelerator.is_local_main_process):  # fmt: skip
        decay = 1 - (update - 1) / args.num_total_batches if args.lr_scheduler_type == "linear" else 1.0
        lr = args.learning_rate * decay
        for group in optimizer.param_groups:
            group["lr"] = lr

        # 5. Rollout: P prompts stored once [P, Q], k * P completions in completion-major order (row i <- prompt
        # i % P); reference logprobs and scores of the truncated rows, in the policy's precision.
        examples = next(batches)  # dataset indices of this process's P prompts
        queries, query_mask = utils.generation.left_pad([prompt_ids[i] for i in examples], pad_id, device)
        context_length = queries.size(1)
        # Reward functions see TRL's trainer state: optimizer steps done and planned, passes over the prompts.
        trainer_state = utils.scoring.TrainerState(
            global_step=(update - 1) * steps_per_update, max_steps=args.num_total_batches * steps_per_update,
            epoch=(update - 1) * P * args.world_size / len(prompt_ids),
        )  # fmt: skip
        with accelerator.autocast():
            data = rollout(
                args, accelerator, policy, ref_policy, scorers, queries, query_mask, update, rank * P,
                stop_token_id, pad_id, recompute_old_logprobs, engine,
                columns, examples, raw_prompts, trainer_state,
            )  # fmt: skip
        responses, lengths, response_mask = data["responses"], data["lengths"], data["response_mask"]
        old_logprobs, scores = data["logprobs"], combine_rewards(data["rewards"], weights)
        # TRL 1.16 leaves a completion no reward scored (NaN) out; under TRL 0.19's flags a NaN stops the run.
        checked = scores.nan_to_num(0.0) if args.dialect == "1.16" else scores
        utils.tracking.check_finite(update, accelerator, scores=checked)
        rows_at = functools.partial(
            utils.generation.query_response_rows, queries, query_mask, responses, response_mask
        )
        has_eos = ((responses == eos_id) & response_mask).any(1)
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~has_eos).float()
        loss_mask = response_mask  # TRL 1.16: a completion cut at the length limit gets no gradient and no KL
        if args.mask_truncated_completions:
            loss_mask = response_mask & finished(responses, lengths, finished_ids)[:, None]

        # 6. Rewards and leave-one-out advantages; batch statistics over every process's completions.
        kl = (old_logprobs - data["ref_logprobs"]) * loss_mask  # k1 estimator per token
        advantages, action_mask, shaped_scores = batch_advantages(
            args, scores, kl, loss_mask, lengths, accelerator.gather, rank
        )
        non_score_reward = -args.kl_coef * kl.sum(1)
        rlhf_reward = shaped_scores + non_score_reward

        # 7. Policy update: epochs over the shuffled batch; every gradient_accumulation_steps micro-batches make
        # one mini-batch and one optimizer step (accelerate counts them), num_mini_batches steps per epoch.
        utils.run.release_freed_host_memory()  # the rollout's freed blocks, before training allocates
        policy.train()
        stats = torch.zeros(4, device=device)  # sums over micro-batches: loss, approxkl, clipfrac, entropy
        ratio_sums = torch.zeros(3, device=device)  # sums of ratio - 1, (ratio - 1)^2 (exact near 1), count
        grad_norms, num_micro_batches = [], 0
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(B, generator=shuffle_generator).to(device)
            for idx in order.split(args.per_device_train_batch_size):
                with accelerator.accumulate(policy):
                    query_responses, attention_mask = rows_at(idx)
                    new_logprobs, entropy, _ = utils.logprobs.response_logprobs(
                        policy, query_responses, attention_mask, context_length, T, with_stats=True
                    )
                    loss, ratio, clipfrac, approxkl = policy_loss(
                        new_logprobs,
                        old_logprobs[idx],
                        advantages[idx],
                        loss_mask[idx],
                        args.cliprange,
                        args.epsilon_high,
                    )
                    accelerator.backward(loss)
                    measured = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                    if accelerator.sync_gradients:
                        grad_norms.append(utils.run.grad_norm_after_step(policy, measured))
                with torch.no_grad():
                    entropy = utils.stats.masked_mean(entropy, response_mask[idx])
                    stats += torch.stack([loss.detach(), approxkl, clipfrac, entropy])
                    shift = ratio - 1
                    ratio_sums += torch.stack([shift.sum(), (shift**2).sum(), shift.new_tensor(len(shift))])
                num_micro_batches += 1

        # 8. Metrics, gathered over processes; a non-finite loss or gradient norm stops the run before it is saved.
        with torch.no_grad():
            stats = accelerator.reduce(stats / num_micro_batches, reduction="mean")
            ratio_sums = accelerator.reduce(ratio_sums, reduction="sum")
            ratio_shift = ratio_sums[0] / ratio_sums[2]
            episode = update * args.batch_size
            measured_norms = [n for n in grad_norms if n is not None]
            grad_norm = sum(measured_norms) / len(measured_norms) if measured_norms else None
            utils.tracking.check_finite(update, accelerator, loss=stats[0], grad_norm=grad_norm)
            metrics = {
                "eps": int((episode - start * args.batch_size) / (time.time() - start_time)),
                "objective/kl": gathered_mean(kl.sum(1)),
                "objective/entropy": gathered_mean((-old_logprobs * response_mask).sum(1)),
                "objective/non_score_reward": gathered_mean(non_score_reward),
                "objective/rlhf_reward": gathered_mean(rlhf_reward),
                "objective/scores": gathered_mean(scores),
                "policy/approxkl_avg": stats[1].item(),
                "policy/clipfrac_avg": stats[2].item(),
                "loss/policy_avg": stats[0].item(),
                "policy/entropy_avg": stats[3].item(),
                "val/ratio": 1 + ratio_shift.item(),
                "val/ratio_var": (ratio_sums[1] / ratio_sums[2] - ratio_shift**2).clamp(min=0).item(),
                "val/num_eos_tokens": accelerator.reduce(has_eos.sum(), reduction="sum").item(),
                "lr": lr,
                "episode": episode,
            }
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            if utils.run.zero_stage(accelerator) == 3:
                metrics["zero3/local_param_share"] = utils.run.local_param_share(policy)
            if not scorers[0].same_tokenizer:  # rows re-encoded for the reward model and cut to its length
                truncated = torch.tensor(scorers[0].take_num_truncated(), device=device)
                metrics["val/num_reward_truncated"] = accelerator.reduce(truncated, reduction="sum").item()
            if len(scorers) > 1:  # each reward's mean, TRL's names
                all_rewards = accelerator.gather(data["rewards"])
                metrics.update({f"rewards/{name}/mean": all_rewards[:, f].nanmean().item()
                                for f, name in enumerate(reward_names)})  # fmt: skip
            metrics.update(logged_means(accelerator, scorers))
        tracker.log(metrics, update)

        # Sample table: completions of held-out prompts (--dataset_test_split; the same noise every time), or
        # else the first completions of this rollout. Every process samples (ZeRO-3 gathers), the main one prints.
        if args.num_sample_generations and (update % sample_every == 0 or update == 1):
            shown, table_scores = torch.arange(min(P, 4), device=device), scores
            if sample_prompts is not None:
                queries, query_mask = utils.generation.left_pad(sample_prompts, pad_id, device)
                shown = torch.arange(queries.size(0), device=device)
                with accelerator.autocast():
                    responses, _, response_mask, _ = sample(
                        args, accelerator, policy, queries, query_mask, 1, (0,), 0, stop_token_id, pad_id
                    )
                    query_responses, mask = utils.generation.query_response_rows(
                        queries, query_mask, responses, response_mask, shown
                    )
                    table_rewards = score_rows(
                        scorers, query_responses, mask, queries.size(1), chunk, prompts=sample_raw_prompts,
                        columns=sample_columns, trainer_state=trainer_state,
                    )  # fmt: skip
                    table_scores = combine_rewards(table_rewards.float(), weights)
            tracker.samples({
                "query": tokenizer.batch_decode(queries[shown], skip_special_tokens=True),
                "response": [tokenizer.decode(r[m], skip_special_tokens=True)
                             for r, m in zip(responses[shown], response_mask[shown])],
                "score": table_scores[shown].tolist(),
            }, title=f"update {update}")  # fmt: skip

        # 9. Checkpoint every --save_steps updates, and after SIGTERM/SIGINT (then stop).
        ckpt.maybe_save(update, **checkpointed, state={"episode": episode, "prompt_batches": update})

    # 10. Save the policy (every process takes part, so ZeRO-3 can gather its shards) and a model card.
    utils.saving.save_model(accelerator, policy, tokenizer, args, "RLOO", policy_path, metrics)
    tracker.close()
    utils.run.end_run(accelerator)
    return metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
