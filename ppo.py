"""PPO for language models (RLHF), with the implementation details of the TL;DR recipe.

Papers: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; Ziegler et al. 2019, "Fine-Tuning
Language Models from Human Preferences"; Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO".

Each update: sample `response_length` tokens for a batch of left-padded prompts, truncate after the stop token,
score the completions (reward model or a Python reward function), build per-token rewards (a KL penalty
against the frozen SFT model on every token, the score on the last response token: the EOS, never the token
after it), estimate advantages with GAE from a critic (initialised from the reward model), then run
`num_ppo_epochs` epochs of the clipped policy and value losses over shuffled mini-batches.

Example (the offline tiny world: `python benchmark/tiny_world.py --output_dir tiny_world`):

    python ppo.py --sft_model_path tiny_world/policy --reward_model_path tiny_world/reward \
        --dataset_name tiny_world/dataset --dataset_train_split sft --dataset_test_split validation \
        --total_episodes 2048 --per_device_train_batch_size 16 --response_length 8 --learning_rate 1e-4 \
        --stop_token eos
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn as nn
import tyro

import utils
import utils.checkpoint
import utils.data
import utils.run
import utils.saving
import utils.scoring
import utils.vllm


@dataclass
class Args:
    # run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment"""
    seed: int = 1
    """seed of the run: model heads, prompt order, sampling (offset per process)"""
    run_name: str | None = None
    """name of the TensorBoard / W&B run; None: {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """also log to Weights & Biases"""
    wandb_project_name: str = "rlhf-reference"
    """W&B project"""
    wandb_entity: str | None = None
    """W&B entity (team)"""
    logging_dir: str = "runs"
    """TensorBoard logs and metrics.jsonl go to {logging_dir}/{run_name}"""
    output_dir: str | None = None
    """where to save the trained policy; None: models/{run_name}"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir: its contents are moved aside to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (the policy, without its checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """write a checkpoint to {output_dir}/checkpoint-{update} every this many updates (0: only on SIGTERM/SIGINT)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint-N folder, or `latest` (the newest in --output_dir), to continue a run exactly from"""
    bf16: bool = False
    """bf16 mixed precision"""
    gradient_checkpointing: bool = False
    """gradient checkpointing in the policy and the critic (less memory, slower)"""

    # models and data
    model_name_or_path: str | None = None
    """the policy to start from and its tokenizer (hub id or local dir); --sft_model_path overrides the weights"""
    sft_model_path: str | None = None
    """the SFT model: the initial policy and the frozen reference model (None: --model_name_or_path)"""
    reward_model_path: Annotated[str | None, tyro.conf.arg(aliases=("--reward_model_name_or_path",))] = None
    """sequence-classification reward model (one label); or pass --reward_fn"""
    reward_fn: Annotated[str | None, tyro.conf.arg(aliases=("--reward_funcs",))] = None
    """path/to/file.py:function or module.function taking (prompts, completions) and returning one float each, instead of a model"""
    reward_tokenizer_path: str | None = None
    """the reward model's tokenizer (TRL: reward_processing_classes); None: the one in --reward_model_path. When it
    is not the policy's, completions are decoded and encoded again with it"""
    value_model_path: str | None = None
    """initial critic (sequence classifier on the policy's tokens); None: the reward model when it shares the
    policy's tokenizer, else the SFT model with a new head"""
    dataset_name: str = "trl-lib/tldr"
    """hub id, save_to_disk directory, or directory/file of json/jsonl/parquet; needs a `prompt` column (text,
    or conversations rendered with the chat template and its generation prompt); other columns are ignored"""
    dataset_config: str | None = None
    """dataset configuration: the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split of the training prompts"""
    dataset_test_split: str | None = None
    """split of the prompts for the sample-generation tables; None: the first training prompts"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) whose chat template renders conversational prompts"""
    max_prompt_length: int | None = None
    """keep only the last this many prompt tokens; None: keep all"""

    # optimisation and batch sizes
    learning_rate: float = 3e-6
    """AdamW learning rate, decayed linearly to 0 over the updates"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float | None = None
    """clip the gradient norm at this value; None: no clipping (as TRL's PPO)"""
    per_device_train_batch_size: int = 8
    """rows per forward/backward pass on each process (a micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into one optimizer step (one mini-batch)"""
    num_mini_batches: int = 1
    """mini-batches (optimizer steps) per PPO epoch"""
    total_episodes: int | None = None
    """completions to sample in all; None: num_train_epochs * number of prompts"""
    num_train_epochs: float = 3.0
    """passes over the prompts, used when total_episodes is None"""
    num_ppo_epochs: int = 4
    """epochs of optimisation on each batch of rollouts"""
    local_rollout_forward_batch_size: int = 64
    """rows per forward pass during rollouts (generation, reference, critic, reward)"""
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

    # generation
    response_length: int = 53
    """tokens sampled for every completion (it is truncated after the stop token afterwards)"""
    temperature: float = 0.7
    """sampling temperature; the logprobs of the policy and the reference are those of logits / temperature"""
    stop_token: Literal["eos"] | None = None
    """eos: truncate completions after the tokenizer's EOS; None (TRL's default): keep all --response_length tokens
    (unless --stop_token_id is set)"""
    stop_token_id: int | None = None
    """truncate completions after this token id"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of a completion without an EOS token (1.0 in the TL;DR recipe)"""

    # rewards
    use_score_scaling: bool = False
    """divide scores by the running standard deviation of all scores seen so far"""
    use_score_norm: bool = False
    """with use_score_scaling, also subtract the running mean"""
    score_clip: float | None = None
    """clip (scaled) scores to [-score_clip, score_clip]"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (keeping their mean) before GAE"""
    whiten_across_processes: bool = False
    """ours, off by default: whiten advantages (and --whiten_rewards' rewards) with the statistics of every
    process's tokens, so N processes update as 1 does; off: each process over its own tokens, as TRL's PPO"""
    kl_coef: float = 0.05
    """coefficient of the per-token KL penalty (the initial one with --adaptive_kl)"""
    kl_estimator: Literal["k1", "k2", "k3", "abs", "full"] = "k1"
    """per-token KL estimate: k1 logp-ref, k2 (logp-ref)^2/2, k3 unbiased low-variance, abs, full (exact over vocab; holds both models' [B, R, V] logits)"""
    adaptive_kl: bool = False
    """adapt kl_coef towards target_kl with the proportional controller of Ziegler et al."""
    target_kl: float = 6.0
    """target KL (summed over the response, in nats) of the adaptive controller"""
    kl_horizon: int = 10000
    """horizon (in episodes) of the adaptive controller"""

    # PPO
    cliprange: float = 0.2
    """clip range of the policy ratio"""
    cliprange_value: float = 0.2
    """clip range of the value predictions around the rollout values"""
    vf_coef: float = 0.1
    """coefficient of the value loss"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    max_approx_kl: float | None = None
    """stop this batch's PPO epochs early when a mini-batch's approximate KL to the rollout policy passes this"""

    # logging
    num_sample_generations: int = 10
    """how many times to print a table of test-split completions and their scores; 0: never"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """no: no sample tables; steps: --num_sample_generations tables, or one every --eval_steps updates"""
    eval_steps: int | None = None
    """print the sample table every this many updates (replaces --num_sample_generations' spacing)"""

    # filled in at runtime (a value passed on the command line is checked against the computed one)
    world_size: int = 0
    """number of processes"""
    local_batch_size: int = 0
    """prompts per update on each process: per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches"""
    batch_size: int = 0
    """prompts per update on all processes: local_batch_size * world_size"""
    mini_batch_size: int = 0
    """rows per optimizer step on all processes: batch_size / num_mini_batches"""
    local_mini_batch_size: int = 0
    """rows per optimizer step on each process: local_batch_size / num_mini_batches"""
    num_total_batches: int = 0
    """number of updates: ceil(total_episodes / batch_size)"""


# ---- The math: pure functions on tensors (B batch, R response length, V vocabulary; `mask` [B, R] marks the
# ---- response tokens up to and including the stop token)
def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs [B, R] -> [B, R].

    With r = log pi_ref(y_t) - log pi(y_t) (y_t sampled from pi):
        k1 = -r          (unbiased, can be negative)      k2 = r^2 / 2       (biased, low variance)
        k3 = e^r - 1 - r (unbiased, >= 0, low variance)   abs = |r|
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
    raise ValueError(f"unknown kl_estimator {estimator!r}; use k1, k2, k3, abs (or full with the logits).")


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || pi_ref) over the vocabulary at every position: [B, R, V] x2 -> [B, R].

    KL_t = sum_v pi(v | s_t) (log pi(v | s_t) - log pi_ref(v | s_t)), with the temperature already applied.
    """
    logp, ref_logp = logits.float().log_softmax(-1), ref_logits.float().log_softmax(-1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def per_token_rewards(
    kl: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards [B, R] and their KL part [B, R]: r_t = -kl_coef * KL_t on response tokens, plus the score [B] on
    the last response token t = L-1 (the stop token; the last sampled token when there is none), 0 after it.

    Putting the score on the token after the stop token is a known bug; this function never does.
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
    """(scores [B] minus `penalty` for each response [B, R] with no EOS among its tokens in `mask`, that flag [B]).

    Only tokens in `mask` count, so padding that happens to be the EOS id (pad == eos) is no EOS.
    """
    contains_eos = ((responses == eos_token_id) & mask.bool()).any(1)
    if penalty is None:
        return scores, contains_eos
    return scores - penalty * (~contains_eos).to(scores.dtype), contains_eos


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens: (advantages [B, R], returns [B, R]).

    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   returns_t = A_t + V_t,
    with V and A zero after the last response token (the episode ends at the stop token). Zero outside `mask`.
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


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate of PPO, as a loss: (loss, clip fraction, approximate KL, ratio [B, R]).

    ratio = exp(logp - logp_old);  loss = mean_t max(-A ratio, -A clip(ratio, 1-eps, 1+eps));
    clip fraction = share of tokens where the clipped term is the larger; approx KL = mean_t (logp - logp_old)^2 / 2.
    All means are over the tokens in `mask`.
    """
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    loss = utils.masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = utils.masked_mean((clipped > unclipped).float(), mask)
    approx_kl = 0.5 * utils.masked_mean(log_ratio.detach() ** 2, mask)
    return loss, clipfrac.detach(), approx_kl, ratio.detach()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: (loss, clip fraction).

    V_clip = old_V + clip(V - old_V, -c, c);  loss = 1/2 mean_t max((V - G)^2, (V_clip - G)^2) over `mask`;
    clip fraction = share of tokens where the clipped term is the larger.
    """
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * utils.masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)
    return loss, utils.masked_mean((clipped_loss > unclipped_loss).float(), mask).detach()


class AdaptiveKLController:
    """The proportional KL controller of Ziegler et al. (2019):

    e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n_steps / horizon),
    where KL is the mean summed KL of the last batch and n_steps the episodes in it.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class RunningMoments:
    """Mean and (population) standard deviation of every value seen so far, merged batch by batch (Chan et al.)."""

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
    """masked_whiten of values [B, R] over the tokens in `mask` [B, R], 0 elsewhere: (v - mean) / std (the mean
    added back without shift_mean). The statistics are this process's tokens' (TRL's PPO), or with `accelerator`
    those of every process's tokens gathered, so that N processes whiten as 1 does."""
    if accelerator is None:
        return utils.masked_whiten(values, mask, shift_mean) * mask
    all_values, all_masks = accelerator.gather(values), accelerator.gather(mask.long())
    rows = slice(accelerator.process_index * values.size(0), (accelerator.process_index + 1) * values.size(0))
    return utils.masked_whiten(all_values, all_masks, shift_mean)[rows] * mask


def mean_over_processes(accelerator, logged: dict[str, float]) -> dict[str, float]:
    """The mean of each value a reward function logged (scorer.take_logged), over the processes that logged it."""
    from accelerate.utils import gather_object

    every = gather_object([logged]) if accelerator.num_processes > 1 else [logged]
    names = sorted({name for one in every for name in one})
    return {name: sum(one[name] for one in every if name in one) / sum(name in one for one in every)
            for name in names}  # fmt: skip


def shape_scores(scores: torch.Tensor, moments: RunningMoments | None, norm: bool, clip: float | None):
    """Optional score scaling by the running std (and centring by the running mean), then clipping: [B] -> [B]."""
    if moments is not None:
        std = math.sqrt(moments.var) + 1e-8
        scores = (scores - moments.mean) / std if norm else scores / std
    return scores.clamp(-clip, clip) if clip is not None else scores


# ---- Checks and sizes
def compute_sizes(args: Args, world_size: int, num_prompts: int) -> Args:
    """Fill the derived sizes with TRL's PPO arithmetic; a derived size given on the command line must match."""
    given = {k: getattr(args, k) for k in ("batch_size", "mini_batch_size", "local_batch_size")}
    if given["batch_size"]:
        utils.exact_div(given["batch_size"], args.num_mini_batches, "--batch_size / --num_mini_batches")
    args.world_size = world_size
    args.local_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    )
    args.batch_size = args.local_batch_size * world_size
    args.mini_batch_size = utils.exact_div(
        args.batch_size, args.num_mini_batches, "batch_size / --num_mini_batches"
    )
    args.local_mini_batch_size = utils.exact_div(
        args.local_batch_size, args.num_mini_batches, "local_batch_size / --num_mini_batches"
    )
    for name, value in given.items():
        if value and value != getattr(args, name):
            raise ValueError(
                f"--{name} {value} does not match per_device_train_batch_size * gradient_accumulation_steps * "
                f"num_mini_batches (* world_size) = {getattr(args, name)}; change those flags instead."
            )
    given_episodes = args.total_episodes is not None
    if not given_episodes:
        args.total_episodes = int(args.num_train_epochs * num_prompts)
    args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
    if num_prompts < args.batch_size:
        raise ValueError(
            f"the train split has {num_prompts} prompts, fewer than batch_size {args.batch_size}; "
            "lower --per_device_train_batch_size, --gradient_accumulation_steps or --num_mini_batches."
        )
    if args.total_episodes < args.batch_size:  # TRL would round it up to one whole update, silently
        asked = (f"--total_episodes {args.total_episodes}" if given_episodes else
                 f"--num_train_epochs {args.num_train_epochs} ({args.total_episodes} episodes)")  # fmt: skip
        raise ValueError(
            f"{asked} is fewer than the {args.batch_size} episodes of one update (per_device_train_batch_size * "
            "gradient_accumulation_steps * num_mini_batches * processes); ask for more or lower those flags."
        )
    return args


def check_args(args: Args) -> None:
    """One clear error for impossible flag values, before anything is loaded."""
    positive = (
        "per_device_train_batch_size gradient_accumulation_steps num_mini_batches num_ppo_epochs "
        "local_rollout_forward_batch_size response_length kl_horizon"
    )
    for name in positive.split() + ["total_episodes"] * (args.total_episodes is not None):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}.")
    checks = [
        ((args.reward_model_path is None) != (args.reward_fn is None), "pass exactly one of --reward_model_path and --reward_fn"),
        (args.temperature > 0, f"--temperature must be positive for PPO's sampling, got {args.temperature}"),
        (0 <= args.gamma <= 1 and 0 <= args.lam <= 1, f"--gamma and --lam must be in [0, 1], got {args.gamma}, {args.lam}"),
        (min(args.cliprange, args.cliprange_value, args.target_kl) > 0, "--cliprange, --cliprange_value and --target_kl must be positive"),
        (args.use_score_scaling or not args.use_score_norm, "--use_score_norm needs --use_score_scaling"),
        (args.score_clip is None or args.score_clip > 0, f"--score_clip must be positive, got {args.score_clip}"),
        (args.num_sample_generations >= 0, f"--num_sample_generations must be >= 0, got {args.num_sample_generations}"),
        (args.sft_model_path or args.model_name_or_path, "pass the policy with --sft_model_path or --model_name_or_path"),
        (args.eval_steps is None or args.eval_steps >= 1, f"--eval_steps must be at least 1, got {args.eval_steps}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message + ".")


# ---- Models
class PolicyAndValue(nn.Module):
    """The policy and the critic as one module, so that accelerate wraps both and DDP sees one forward."""

    def __init__(self, policy: nn.Module, critic: nn.Module):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, query_responses, attention_mask, context_length: int, temperature: float):
        """Logprobs [B, R] of the response tokens under logits / temperature, their entropy [B, R] (a metric, no
        gradient) and the critic's values [B, R] (value of the state before each response token), with position
        ids from the attention mask as in generation. The [B, R, V] logits are never held whole."""
        logprobs, entropy, _ = utils.response_logprobs(
            self.policy, query_responses, attention_mask, context_length, temperature, with_stats=True
        )
        values = utils.per_token_scores(self.critic, query_responses, attention_mask)
        return logprobs, entropy, values[:, context_length - 1 : -1].float()


def score_completions(args, tokenizer, scorer, queries, query_mask, responses, prompts, trainer_state):
    """Truncate `responses` [B, R] after the stop token and score them: (mask [B, R] of the kept tokens,
    scores [B], whether each has an EOS [B]). The reward sees the truncated completion and its score is read
    at the last real token (the EOS); `missing_eos_penalty` is subtracted from completions without one.
    prompts: the dataset's raw prompt of each row (text or messages), what a reward function gets, as in TRL."""
    truncated, lengths = utils.truncate_response(responses, args.stop_token_id, tokenizer.pad_token_id)
    mask = utils.lengths_to_mask(lengths, responses.size(1))
    scores = scorer(
        torch.cat([queries, truncated], 1), torch.cat([query_mask, mask], 1), queries.size(1),
        args.local_rollout_forward_batch_size, prompts=prompts, trainer_state=trainer_state,
    ).float()  # fmt: skip
    scores, contains_eos = penalize_missing_eos(
        scores, truncated, mask, tokenizer.eos_token_id, args.missing_eos_penalty
    )
    return mask, scores, contains_eos


@torch.no_grad()
def rollout(args, accelerator, model, ref_model, scorer, tokenizer, queries, query_mask, update, first_prompt,
            recompute_old_logprobs, engine=None, prompts=None, trainer_state=None):  # fmt: skip
    """Sample and score completions of left-padded `queries` [B, Q]: the tensors an update needs (`prompts`:
    their raw texts or messages, and `trainer_state`, for the reward). The chunk of prompts p.. is sampled with
    the noise of (seed, update, first_prompt + p), first_prompt being the index of this process's first prompt
    in the update's global batch. The "old" logprobs are sampling's, or those of
    the training forward pass with `recompute_old_logprobs`. With `engine` (--use_vllm), vLLM samples."""
    Q, chunk = queries.size(1), args.local_rollout_forward_batch_size
    query_responses, logprobs = [], []
    if engine is not None:  # vLLM gets the policy's current weights (outside the gathering below)
        engine.sync_weights(model, accelerator, "policy")
    generate = engine.generate if engine is not None else utils.generate
    with utils.run.gathered_for_generation(model, accelerator) as unwrapped:
        for i in range(0, queries.size(0), chunk):
            noise = utils.sampling_generator(args.seed, update, first_prompt + i, device=queries.device)
            chunk_query_responses, chunk_logprobs = generate(
                unwrapped.policy, queries[i : i + chunk], query_mask[i : i + chunk], args.response_length,
                args.temperature, chunk, noise,
            )  # fmt: skip
            query_responses.append(chunk_query_responses)
            logprobs.append(chunk_logprobs)
    query_responses, logprobs = torch.cat(query_responses), torch.cat(logprobs)
    responses = query_responses[:, Q:]
    # Every forward pass attends to all R sampled tokens, as generation did, so logprobs match sampling's.
    attention_mask = torch.cat([query_mask, torch.ones_like(responses, dtype=torch.bool)], 1)
    mask, scores, contains_eos = score_completions(
        args, tokenizer, scorer, queries, query_mask, responses, prompts, trainer_state
    )
    unwrapped, ref_logprobs, values, kl_full, recomputed = utils.run.bare(model), [], [], [], []
    for i in range(0, queries.size(0), chunk):
        qr, am = query_responses[i : i + chunk], attention_mask[i : i + chunk]
        # The reference's logprobs at the sampling temperature too, as the policy's.
        if args.kl_estimator == "full":  # the whole distributions: [chunk, R, V] logits of both models
            ref_logits = utils.response_logits(ref_model, qr, am, Q, args.temperature)
            logits = utils.response_logits(unwrapped.policy, qr, am, Q, args.temperature)
            ref_logprobs.append(utils.logprobs_from_logits(ref_logits, qr[:, Q:]))
            recomputed.append(utils.logprobs_from_logits(logits, qr[:, Q:]))
            kl_full.append(full_kl(logits, ref_logits))
        else:
            ref_logprobs.append(utils.response_logprobs(ref_model, qr, am, Q, args.temperature))
            if recompute_old_logprobs:
                recomputed.append(utils.response_logprobs(unwrapped.policy, qr, am, Q, args.temperature))
        values.append(utils.per_token_scores(unwrapped.critic, qr, am)[:, Q - 1 : -1].float())
    if recompute_old_logprobs:
        logprobs = torch.cat(recomputed)
    kl = torch.cat(kl_full) if kl_full else kl_per_token(logprobs, torch.cat(ref_logprobs), args.kl_estimator)
    return dict(
        query_responses=query_responses, attention_mask=attention_mask, mask=mask, logprobs=logprobs,
        values=torch.cat(values) * mask, kl=kl * mask, scores=scores, contains_eos=contains_eos,
    )  # fmt: skip


@torch.no_grad()
def sample_table(args, accelerator, model, scorer, tokenizer, test_rows, test_prompts, raw_test_prompts,
                 trainer_state):  # fmt: skip
    """Greedy completions of this process's share of the test prompts (rendered texts, and the raw ones the
    reward gets): (mean score over processes, table)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    queries, query_mask = utils.left_pad(test_rows[rank::world], tokenizer.pad_token_id, accelerator.device)
    with utils.run.gathered_for_generation(model, accelerator) as unwrapped:
        query_responses, _ = utils.generate(
            unwrapped.policy,
            queries,
            query_mask,
            args.response_length,
            0.0,
            args.local_rollout_forward_batch_size,
        )
    responses = query_responses[:, queries.size(1) :]
    mask, scores, _ = score_completions(
        args, tokenizer, scorer, queries, query_mask, responses, raw_test_prompts[rank::world], trainer_state
    )
    columns = {
        "prompt": [p[-80:] for p in test_prompts[rank::world]],
        "completion": [tokenizer.decode(r[m]) for r, m in zip(responses, mask)],
        "score": scores.tolist(),
    }
    return accelerator.gather(scores).mean().item(), columns


# ---- Training
def main(args: Args) -> dict:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    # 1. Flags, accelerator and data: everything that can be checked before a model is loaded.
    check_args(args)
    utils.vllm.check_args(args)
    accelerator = utils.run.make_accelerator(
        args, args.gradient_accumulation_steps, micro_batch_size=args.per_device_train_batch_size
    )
    reward_fn = utils.load_reward_fn(args.reward_fn) if args.reward_fn else None
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.output_dir = args.output_dir or os.path.join("models", args.run_name)
    utils.check_output_dir(args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint))
    ckpt = utils.checkpoint.Checkpointer(accelerator, args)  # checks the resume path; takes its run name
    recompute_old_logprobs = args.recompute_old_logprobs == "true" or (
        args.recompute_old_logprobs == "auto" and accelerator.mixed_precision == "bf16"
    )

    # 2. Tokenizer and prompts (conversations rendered with the generation prompt), tokenized once (left-truncated
    # to max_prompt_length): --model_name_or_path gives the tokenizer; --sft_model_path, when given, the weights.
    policy_path, policy_flag = (
        (args.sft_model_path, "--sft_model_path") if args.sft_model_path else
        (args.model_name_or_path, "--model_name_or_path")
    )  # fmt: skip
    tokenizer_path, tokenizer_flag = (
        (args.model_name_or_path, "--model_name_or_path") if args.model_name_or_path else (policy_path, policy_flag)
    )  # fmt: skip
    where = f"--dataset_name {args.dataset_name} split {args.dataset_train_split}"
    train = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.check_columns(train, ["prompt"], where)
    compute_sizes(args, accelerator.num_processes, len(train))
    if args.eval_strategy == "no":
        args.num_sample_generations = 0
    elif args.eval_steps:
        args.num_sample_generations = max(1, args.num_total_batches // args.eval_steps)
    test = None
    if args.num_sample_generations > 0 and args.dataset_test_split:
        test = utils.data.load_split(args.dataset_name, args.dataset_test_split, args.dataset_config)
        utils.check_columns(
            test, ["prompt"], f"--dataset_name {args.dataset_name} split {args.dataset_test_split}"
        )
    elif args.num_sample_generations > 0:
        test = train
    tokenizer = utils.load_tokenizer(tokenizer_path, tokenizer_flag, args.chat_template_path)
    if args.stop_token == "eos":
        if args.stop_token_id is not None and args.stop_token_id != tokenizer.eos_token_id:
            raise ValueError(f"--stop_token eos (id {tokenizer.eos_token_id}) and --stop_token_id disagree.")
        args.stop_token_id = tokenizer.eos_token_id
    train_rows = utils.tokenize_prompts(
        tokenizer, utils.data.prompt_texts(train, tokenizer, where), args.max_prompt_length
    )
    if any(len(r) == 0 for r in train_rows):
        raise ValueError(f"the train split has {sum(len(r) == 0 for r in train_rows)} empty prompt(s).")
    # The same number of test prompts on every process (gathering needs equal shapes).
    num_eval = min(len(test), args.local_rollout_forward_batch_size * args.world_size) if test else 0
    num_eval -= num_eval % args.world_size
    test_prompts = (
        utils.data.prompt_texts(test.select(range(num_eval)), tokenizer, "the test split") if num_eval else []
    )
    # The dataset's own prompts (text or messages): what the reward gets as each row's prompt, as in TRL.
    raw_train_prompts = utils.data.column(train, "prompt")
    raw_test_prompts = utils.data.column(test.select(range(num_eval)), "prompt") if num_eval else []
    test_rows = utils.tokenize_prompts(tokenizer, test_prompts, args.max_prompt_length)

    # 3. Models: policy and reference from the SFT model; critic from the value/reward model (own head). Frozen
    # models run in the policy's precision. Seeding: the same everywhere for model init (a new value head).
    set_seed(args.seed)
    device, rank = accelerator.device, accelerator.process_index
    policy = utils.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    ref_model = utils.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    reward_model = utils.load_reward_model(args.reward_model_path) if args.reward_model_path else None
    reward_tokenizer = utils.scoring.load_reward_tokenizer(args.reward_tokenizer_path, args.reward_model_path)
    same_tokens = reward_tokenizer is None or utils.scoring.same_tokenizer(tokenizer, reward_tokenizer)
    # The critic: its own copy of the value (default: reward) model; with only a reward function and no value
    # model, or a reward model that reads other tokens than the policy's, the SFT model with a fresh head.
    critic_flag = "--value_model_path" if args.value_model_path else "--reward_model_path"
    critic_path = args.value_model_path or (args.reward_model_path if same_tokens else None)
    if not args.value_model_path and not same_tokens:
        accelerator.print("critic: the reward model has its own tokenizer, so the critic starts from "
                          "--sft_model_path with a new value head (pass --value_model_path to choose one)")  # fmt: skip
    critic_flag, critic_path = (critic_flag, critic_path) if critic_path else (policy_flag, policy_path)
    critic = utils.from_pretrained(AutoModelForSequenceClassification, critic_path, critic_flag, num_labels=1)
    critic_rows, policy_rows = (m.get_input_embeddings().num_embeddings for m in (critic, policy))
    if critic_rows < policy_rows:  # the critic reads the policy's ids: they would index past its embedding
        raise ValueError(f"{critic_flag} {critic_path} has {critic_rows} token embeddings, fewer than the policy's "
                         f"{policy_rows}; the critic reads the policy's tokens, so give it the policy's tokenizer.")  # fmt: skip
    for m in (policy, ref_model, critic) + ((reward_model,) if reward_model else ()):
        utils.disable_dropout(m)  # dropout would make the recomputed logprobs differ from the sampled ones
        if getattr(m.config, "pad_token_id", None) is None:
            m.config.pad_token_id = tokenizer.pad_token_id
    for m in (policy, critic) if args.gradient_checkpointing else ():
        utils.enable_gradient_checkpointing(m)
    model = PolicyAndValue(policy, critic)
    optimizer = utils.run.adamw(
        model.parameters(), lr=args.learning_rate, eps=args.adam_epsilon, weight_decay=0
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_model = utils.run.prepare_frozen(ref_model, accelerator)
    max_model_len = max(map(len, train_rows)) + args.response_length
    engine = utils.vllm.Engine(args, accelerator, policy_path, max_model_len) if args.use_vllm else None
    reward_model = utils.run.prepare_frozen(reward_model, accelerator) if reward_model is not None else None
    scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
    accelerator.print(scorer.describe())

    # 4. State of the run: the prompt order is the same on every process; sampling noise is keyed by update and
    # prompt (sampling_generator); weights, optimizer, the shuffling generator, the adaptive KL coefficient and
    # the running score moments come back from a checkpoint.
    kl_controller = AdaptiveKLController(args.kl_coef, args.target_kl, args.kl_horizon)
    moments = RunningMoments() if args.use_score_scaling else None
    shuffle_generator = torch.Generator().manual_seed(args.seed + 100003 * rank)
    checkpointed = dict(models={"model": model}, optimizers={"model": optimizer},
                        generators={"shuffle": shuffle_generator})  # fmt: skip
    state = ckpt.resume(**checkpointed) or {"step": 0}
    start = state["step"]
    if start:
        kl_controller.value = state["kl_coef"]
        if moments is not None:
            moments.mean, moments.var, moments.count = state["score_moments"]
    batches = utils.prompt_batches(len(train_rows), args.local_batch_size, args.world_size, rank, args.seed)
    for _ in range(state.get("prompt_batches", 0)):  # the data order continues where the checkpoint left it
        next(batches)
    tracker = utils.tracking.Tracker(args, accelerator, start_step=start)
    sample_freq = max(1, args.num_total_batches // args.num_sample_generations) if test_rows else 0
    episode, start_time, metrics = start * args.batch_size, time.time(), {}

    def mean_all(x: torch.Tensor) -> float:
        return accelerator.gather(x.detach().float().reshape(1)).mean().item()

    whitening = accelerator if args.whiten_across_processes else None  # None: per process, as TRL

    for update in tqdm(range(start + 1, args.num_total_batches + 1), initial=start, total=args.num_total_batches,
                       disable=not accelerator.is_local_main_process):  # fmt: skip
        episode += args.batch_size
        lr = args.learning_rate * (1.0 - (update - 1.0) / args.num_total_batches)  # linear decay
        for group in optimizer.param_groups:
            group["lr"] = lr
        kl_coef = kl_controller.value if args.adaptive_kl else args.kl_coef

        # 5. Rollout: sample, truncate, score; logprobs of the policy and the reference; values of the critic.
        model.eval()
        examples = next(batches)
        queries, query_mask = utils.left_pad(
            [train_rows[i] for i in examples], tokenizer.pad_token_id, device
        )
        Q = queries.size(1)
        trainer_state = utils.scoring.TrainerState(
            global_step=update - 1, max_steps=args.num_total_batches,
            epoch=(update - 1) * args.batch_size / len(train_rows),
        )  # fmt: skip
        with accelerator.autocast():
            data = rollout(
                args, accelerator, model, ref_model, scorer, tokenizer, queries, query_mask, update,
                rank * args.local_batch_size, recompute_old_logprobs, engine,
                [raw_train_prompts[i] for i in examples], trainer_state,
            )  # fmt: skip
        mask, scores = data["mask"], data["scores"]
        utils.tracking.check_finite(update, accelerator, scores=scores)
        # 6. Rewards: optional score shaping, per-token KL penalty, the score on the last response token.
        if moments is not None:
            moments.update(accelerator.gather(scores))
        shaped_scores = shape_scores(scores, moments, args.use_score_norm, args.score_clip)
        rewards, non_score_rewards = per_token_rewards(data["kl"], shaped_scores, mask, kl_coef)
        if args.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False, accelerator=whitening)
        # 7. Advantages from GAE, whitened over this process's response tokens (every process's with
        # --whiten_across_processes).
        advantages, returns = gae(rewards, data["values"], mask, args.gamma, args.lam)
        advantages = whiten(advantages, mask, accelerator=whitening)

        # 8. PPO epochs over shuffled mini-batches; each mini-batch is gradient-accumulated micro-batches.
        model.train()
        step_stats, ratio_sums, early_stopped = [], torch.zeros(3, device=device, dtype=torch.float64), False
        grad_norms = []
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.local_batch_size, generator=shuffle_generator).to(device)
            for minibatch in order.split(args.local_mini_batch_size):
                for idx in minibatch.split(args.per_device_train_batch_size):
                    mb_mask, mb_query_responses = mask[idx], data["query_responses"][idx]
                    with accelerator.accumulate(model):
                        new_logprobs, entropy, vpred = model(
                            mb_query_responses, data["attention_mask"][idx], Q, args.temperature
                        )
                        pg_loss, pg_clipfrac, approxkl, ratio = policy_loss(
                            new_logprobs, data["logprobs"][idx], advantages[idx], mb_mask, args.cliprange
                        )
                        vf_loss, vf_clipfrac = value_loss(
                            vpred, data["values"][idx], returns[idx], mb_mask, args.cliprange_value
                        )
                        accelerator.backward(pg_loss + args.vf_coef * vf_loss)
                        measured = utils.run.clip_grad_norm(accelerator, model, args.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                        if accelerator.sync_gradients:
                            grad_norms.append(utils.run.grad_norm_after_step(model, measured))
                    with torch.no_grad():
                        entropy = utils.masked_mean(entropy, mb_mask)
                        step_stats.append(
                            torch.stack([approxkl, pg_clipfrac, pg_loss, vf_loss, vf_clipfrac, entropy])
                        )
                        r = ratio[mb_mask.bool()].double()  # float64: the variance of ratios near 1 is tiny
                        ratio_sums += torch.stack([r.sum(), (r**2).sum(), r.new_tensor(r.numel())])
                # Early stop on the mini-batch's approximate KL, averaged over processes (one decision for all).
                minibatch_kl = torch.stack(step_stats[-args.gradient_accumulation_steps :])[:, 0].mean()
                if args.max_approx_kl is not None and mean_all(minibatch_kl) > args.max_approx_kl:
                    early_stopped = True
                    break
            if early_stopped:
                break

        # 9. Metrics, averaged over processes; a non-finite loss or gradient norm stops the run before it is saved.
        with torch.no_grad():
            approxkl, pg_clipfrac, pg_loss, vf_loss, vf_clipfrac, entropy = (
                accelerator.gather(torch.stack(step_stats).float().mean(0)[None]).mean(0).tolist()
            )
            measured_norms = [n for n in grad_norms if n is not None]
            grad_norm = sum(measured_norms) / len(measured_norms) if measured_norms else None
            utils.tracking.check_finite(
                update, accelerator, loss=pg_loss + args.vf_coef * vf_loss, grad_norm=grad_norm
            )
            ratio_sums = accelerator.reduce(ratio_sums, reduction="sum")
            ratio_mean = (ratio_sums[0] / ratio_sums[2]).item()
            metrics = {
                "eps": int((episode - start * args.batch_size) / (time.time() - start_time)),
                "objective/kl": mean_all(data["kl"].sum(1).mean()),
                "objective/kl_coef": kl_coef,
                "objective/entropy": mean_all((-data["logprobs"] * mask).sum(1).mean()),
                "objective/non_score_reward": mean_all(non_score_rewards.sum(1).mean()),
                "objective/scores": mean_all(scores.mean()),
                "objective/rlhf_reward": mean_all((scores + non_score_rewards.sum(1)).mean()),
                "policy/approxkl_avg": approxkl,
                "policy/clipfrac_avg": pg_clipfrac,
                "policy/entropy_avg": entropy,
                "policy/early_stopped": float(early_stopped),
                "loss/policy_avg": pg_loss,
                "loss/value_avg": vf_loss,
                "val/clipfrac_avg": vf_clipfrac,
                "val/ratio": ratio_mean,
                "val/ratio_var": max((ratio_sums[1] / ratio_sums[2]).item() - ratio_mean**2, 0.0),
                "val/num_eos_tokens": int(
                    accelerator.reduce(data["contains_eos"].sum(), reduction="sum").item()
                ),
                "val/response_length": mean_all(mask.float().sum(1).mean()),
                "lr": lr,
                "episode": episode,
            }
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            if utils.run.zero_stage(accelerator) == 3:
                metrics["zero3/local_param_share"] = utils.run.local_param_share(model)
            if not scorer.same_tokenizer:  # rows re-encoded for the reward model and cut to its length
                truncated = torch.tensor(scorer.take_num_truncated(), device=device)
                metrics["val/num_reward_truncated"] = accelerator.reduce(truncated, reduction="sum").item()
            metrics.update(mean_over_processes(accelerator, scorer.take_logged()))
        if args.adaptive_kl:
            kl_controller.update(metrics["objective/kl"], args.batch_size)
        if sample_freq and (update % sample_freq == 0 or update == args.num_total_batches):
            model.eval()
            with accelerator.autocast():
                metrics["eval/scores"], columns = sample_table(
                    args, accelerator, model, scorer, tokenizer, test_rows, test_prompts, raw_test_prompts,
                    trainer_state,
                )  # fmt: skip
            logged = mean_over_processes(accelerator, scorer.take_logged())
            metrics.update({f"eval/{name}": value for name, value in logged.items()})
            tracker.samples(columns, title=f"update {update}: test prompts (greedy)")
        tracker.log(metrics, update)
        del data, rewards, advantages, returns

        # 10. Checkpoint every --save_steps updates, and after SIGTERM/SIGINT (then stop).
        moments_state = [moments.mean, moments.var, moments.count] if moments is not None else None
        ckpt.maybe_save(update, **checkpointed, state={
            "episode": episode, "prompt_batches": update, "kl_coef": kl_controller.value,
            "score_moments": moments_state,
        })  # fmt: skip

    # 11. Save the policy alone (no value head) as a plain causal LM, with its tokenizer and a model card.
    utils.saving.save_model(accelerator, model, tokenizer, args, "PPO", policy_path, metrics, "policy")
    tracker.close()
    utils.run.end_run(accelerator)
    return metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
