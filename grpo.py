"""Group Relative Policy Optimization (GRPO) for language models, in one file, with its main variants.

Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
https://arxiv.org/abs/2402.03300. Variants: DAPO (Yu et al. 2025, https://arxiv.org/abs/2503.14476:
clip-higher, token-level loss, dynamic sampling `--filter_groups`), Dr. GRPO (Liu et al. 2025,
https://arxiv.org/abs/2503.20783: no std scaling, a constant loss normalizer), two-sided clipping `--delta`
(INTELLECT-2, 2025).

The policy samples a group of `--num_generations` completions per prompt. A completion's reward is a
weighted sum of reward functions and/or a reward model; its advantage, on all its tokens, is (reward - group
mean) / std (`--scale_rewards`). The loss is PPO's clipped surrogate per token, averaged per `--loss_type`,
plus `beta` times the k3 KL to the reference. No critic, no KL in the reward. Rows are completion-major:
completion g of prompt p is row `g * P + p`; a group stays on one process. Flags mean what TRL 1.16's
GRPOConfig means.

    python grpo.py --model_name_or_path models/sft --dataset_name data/prompts \
        --reward_funcs rewards.py:exact --num_generations 8 --per_device_train_batch_size 32 \
        --max_completion_length 16 --learning_rate 1e-5 --loss_type dapo --epsilon_high 0.28 --max_steps 200 \
        --output_dir models/grpo
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import functools
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro

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
import utils.tracking
from utils.run import UsageError


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment"""
    seed: int = 1
    """seed of sampling and shuffling"""
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
    output_dir: str = "models/grpo"
    """where the trained policy and the checkpoints go"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir (moved to <output_dir>.replaced-<time>)"""
    push_to_hub: bool = False
    """push the policy (no checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """checkpoint every this many optimizer steps (0: only on SIGTERM/SIGINT)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint folder, or 'latest' in --output_dir, to continue from"""

    # Models and data
    model_name_or_path: str | None = None
    """the initial policy and its tokenizer; also the reference when beta > 0"""
    model_revision: str = "main"
    """revision (branch, tag or commit) of --model_name_or_path on the hub"""
    trust_remote_code: bool = False
    """let hub models and tokenizers run their own modelling code (every load)"""
    attn_implementation: str | None = None
    """attention of the trained model (and its reference): eager, sdpa, flash_attention_2...; None: the default"""
    reward_model_path: Annotated[str | None, tyro.conf.arg(aliases=("--reward_model_name_or_path",))] = None
    """sequence classifier (one label) as a reward, before the --reward_funcs (TRL's order)"""
    reward_tokenizer_path: str | None = None
    """the reward model's tokenizer if not the policy's (None: --reward_model_path's)"""
    reward_funcs: Annotated[list[str] | None, tyro.conf.arg(aliases=("--reward_fn",))] = None
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
    """split of the held-out prompts, evaluated during training (eval/...); None: no evaluation"""
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
    num_generations: int = 8
    """completions per prompt, the group (at least 2)"""
    max_completion_length: int = 256
    """tokens sampled per completion (then truncated after EOS); Dr. GRPO's loss constant"""
    temperature: float = 1.0
    """sampling temperature, also of the logprobs"""
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
    local_rollout_forward_batch_size: int = 64
    """rows per generation / reference / reward forward pass"""
    use_vllm: bool = False
    """sample with vLLM (pip install -r requirements-vllm.txt)"""
    vllm_mode: Literal["colocate"] = "colocate"
    """colocate: one vLLM engine per training process (TRL's server mode is not provided)"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of GPU memory for vLLM (CPU: VLLM_CPU_KVCACHE_SPACE GiB, default 1)"""
    vllm_tensor_parallel_size: int = 1
    """processes sharing one vLLM engine (must divide the number of processes)"""
    vllm_importance_sampling_correction: bool = True
    """with --use_vllm, weight each token's loss by p_train / p_vllm"""
    vllm_importance_sampling_mode: Literal[
        "sequence_mask", "sequence_truncate", "token_mask", "token_truncate"
    ] = "sequence_mask"
    """one weight per sequence or token; out of bounds: 0 (mask) or clamped (truncate)"""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """upper bound of the importance weights (None: none)"""
    vllm_importance_sampling_clip_min: float | None = None
    """lower bound of the importance weights (None: none)"""
    vllm_importance_sampling_cap: float | None = None
    """deprecated (TRL 1.6): sets --vllm_importance_sampling_clip_max"""

    # Algorithm
    learning_rate: float = 1e-6
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
    """transformers' schedule after the warmup; linear: decay to 0 over the optimizer steps"""
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
    max_grad_norm: float = 1.0
    """clip the gradient norm to this (0: no clipping)"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    generation_batch_size: int | None = None
    """completions per generation on all processes (or --steps_per_generation)"""
    steps_per_generation: int | None = None
    """micro-batches per process per generation, a multiple of --gradient_accumulation_steps"""
    num_iterations: int = 1
    """passes over each generation (mu in the paper)"""
    max_steps: int = -1
    """optimizer steps in total (-1: from --num_train_epochs)"""
    num_train_epochs: float = 3.0
    """passes over the prompts if --max_steps is -1"""
    scale_rewards: str = "group"
    """divide the centred rewards by the std of the group (group, True), the batch, or not (none, False)"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """how the per-token losses are averaged (see aggregate_loss); cispo, sapo and vespo change the loss too"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """sequence: every token's ratio is its completion's exp(mean log-ratio) (GSPO; the paper's loss_type: grpo)"""
    epsilon: float = 0.2
    """lower clip range of the ratio, 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip range, 1 + epsilon_high (None: epsilon; DAPO's clip-higher: 0.28)"""
    mask_truncated_completions: bool = False
    """leave completions without EOS out of the loss (DAPO)"""
    delta: float | None = None
    """two-sided clipping: cap the ratio at delta also where A < 0 (None: off)"""
    beta: float = 0.0
    """weight of the k3 KL to the reference in the loss (0: no reference model)"""
    use_bias_correction_kl: bool = True
    """multiply the KL by the ratio to the old policy (DeepSeek-V3.2): an unbiased gradient"""
    top_entropy_quantile: float = 1.0
    """train only on the tokens whose entropy is in this top share of the micro-batch's (Beyond the 80/20 Rule: 0.2)"""
    off_policy_mask_threshold: float | None = None
    """leave out completions with A < 0 whose mean KL(sampler || policy) per token exceeds this (DeepSeek-V3.2)"""
    sapo_temperature_pos: float = 1.0
    """sapo: temperature of the gate where A > 0"""
    sapo_temperature_neg: float = 1.05
    """sapo: temperature of the gate where A <= 0"""
    vespo_k_pos: float = 2.0
    """vespo: power k of the weight phi(w) = w^k exp(lambda (1 - w)) where A >= 0 (larger: less weight at w < 1)"""
    vespo_lambda_pos: float = 3.0
    """vespo: decay lambda of phi where A >= 0 (larger: less weight at w > 1)"""
    vespo_k_neg: float = 3.0
    """vespo: power k of phi where A < 0"""
    vespo_lambda_neg: float = 2.0
    """vespo: decay lambda of phi where A < 0"""

    # Dynamic sampling (DAPO; verl's flag names, the paper's reference implementation)
    filter_groups: bool = False
    """drop the groups whose --filter_groups_metric is equal on all G completions and sample more prompts until
    each process has its batch of groups with a spread (DAPO's dynamic sampling)"""
    filter_groups_metric: str = "reward"
    """what must differ within a kept group: reward (the weighted sum) or one reward's logged name"""
    max_num_gen_batches: int = 10
    """generation rounds per batch at most; then dropped groups fill it (a warning). 0: up to one pass over the
    prompts"""

    # Logging
    logging_steps: int = 1
    """log metrics every this many optimizer steps: their means over those steps (TRL's meaning)"""
    num_sample_generations: int = 10
    """times to print sample completions after the first generation (0: never)"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """no: no held-out evaluation; steps: at --eval_steps (or --num_sample_generations) optimizer steps"""
    eval_steps: int | None = None
    """evaluate every this many optimizer steps (and after the last); None: at the first and every
    total_steps // --num_sample_generations"""
    eval_on_start: bool = False
    """evaluate before the first step too (logged at step 0; not again on resume)"""
    per_device_eval_batch_size: int = 8
    """held-out completions per process per evaluation batch (whole prompts, at least one)"""
    num_generations_eval: int | None = None
    """completions sampled per held-out prompt; None: --num_generations (TRL 1.16)"""

    # Tools (multi-turn rollouts: utils/tools.py, docs/tools.md)
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
    world_size: int = 0
    """number of processes"""
    local_generation_batch_size: int = 0
    """completions per process per generation"""
    local_prompts_per_generation: int = 0
    """prompts per process per generation = local_generation_batch_size / num_generations"""
    steps_per_generation_round: int = 0
    """optimizer steps made from one generation"""
    total_steps: int = 0
    """optimizer steps of the run"""


# ---- the math ----------------------------------------------------------------------------------------------
ADVANTAGE_EPS = 1e-4  # TRL's; a group of equal rewards gets A = 0


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample std (Bessel) of the non-NaN values along `dim` (None: all); NaN where fewer than 2."""
    if dim is None:
        values, dim = values.flatten(), 0
    count = (~values.isnan()).sum(dim, keepdim=True)
    squares = (values - values.nanmean(dim, keepdim=True)).pow(2).nansum(dim, keepdim=True)
    std = (squares / (count - 1).clamp(min=1)).sqrt().where(count > 1, torch.nan)
    return std if keepdim else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    batch_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = (r_i - mean of r's group) / (std + eps). rewards [B] completion-major -> [B].

    std: the group's ('group'), the batch's ('batch': `batch_std`, default that of `rewards`) or 1 ('none',
    Dr. GRPO). NaN rewards are left out of the mean and std and get A = 0."""
    grouped = rewards.view(num_generations, -1)  # [G, P]
    centered = grouped - grouped.nanmean(0, keepdim=True)
    if scale_rewards == "group":
        centered = centered / (nanstd(grouped, 0, keepdim=True) + ADVANTAGE_EPS)
    elif scale_rewards == "batch":
        std = nanstd(rewards) if batch_std is None else batch_std
        centered = centered / (std + ADVANTAGE_EPS)
    elif scale_rewards != "none":
        raise UsageError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}.")
    # NaN becomes 0 only in a group with an unscored completion; an overflow elsewhere stops the run.
    partly_scored = grouped.isnan().any(0, keepdim=True)
    return centered.masked_fill(partly_scored & centered.isnan(), 0.0).flatten()


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Reward [B] = sum_f w_f r_f over [B, F], NaN (a function's None) skipped; NaN, with a warning, where
    every r_f is NaN."""
    unscored = rewards_per_func.isnan().all(1)
    if unscored.any():
        warnings.warn(
            f"every reward returned None for {int(unscored.sum())} completion(s) (e.g. row "
            f"{int(unscored.nonzero()[0])}); they get advantage 0: make at least one reward score every "
            "completion.",
            RuntimeWarning,
            stacklevel=2,
        )
    return (rewards_per_func * weights[None, :]).nansum(1).masked_fill(unscored, torch.nan)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) (Schulman 2020): exp(d) - d - 1, d = ref - logprob."""
    diff = ref_logprobs - logprobs
    return diff.exp() - diff - 1


def kl_penalty(logprobs, old_logprobs, ref_logprobs, use_bias_correction_kl: bool = True) -> torch.Tensor:
    """KL term [B, R] = k3_kl, times r = exp(logprobs - old_logprobs) (not detached) with
    `use_bias_correction_kl`: unbiased for the old policy's samples (DeepSeek-V3.2,
    https://arxiv.org/abs/2512.02556)."""
    kl = k3_kl(logprobs, ref_logprobs)
    return kl * (logprobs - old_logprobs).exp() if use_bias_correction_kl else kl


def clipped_token_loss(logprobs, old_logprobs, advantages, epsilon_low, epsilon_high, delta=None):
    """Per-token loss [B, R] = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logp - logp_old).

    advantages [B]. `delta` also caps the unclipped r (two-sided clipping: a bounded loss where A < 0)."""
    ratio = (logprobs - old_logprobs).exp()
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    advantages = advantages[:, None]
    return -torch.min(ratio * advantages, clipped * advantages)


def sequence_level(logprobs, old_logprobs, mask) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, https://arxiv.org/abs/2507.18071): old logprobs [B, R] under which every token's
    ratio is its completion's, s_i = exp((1/|o_i|) sum_t (logp_it - logp_old_it)), with the gradient of s_i."""
    mask = mask.to(logprobs.dtype)
    mean_log_ratio = ((logprobs - old_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(
        -1, keepdim=True
    ).clamp(min=1)
    return logprobs - mean_log_ratio


LOSS_VARIANTS = ("cispo", "sapo", "vespo")  # utils/loss_variants.py's: imported only for these


def policy_token_loss(args: Args, logprobs, old_logprobs, advantages, importance_weights=None, mask=None,
                      vllm_weights=None):  # fmt: skip
    """Per-token loss [B, R] of --loss_type (cispo, sapo and vespo: utils/loss_variants.py), times the importance
    weights ([B, R] or [B, 1]) if any."""
    if args.loss_type in LOSS_VARIANTS:
        variants = utils.run.optional_module("utils.loss_variants", f"--loss_type {args.loss_type}")
        loss = variants.token_loss(args, logprobs, old_logprobs, advantages, mask, vllm_weights)
    else:
        loss = clipped_token_loss(
            logprobs, old_logprobs, advantages, args.epsilon, args.epsilon_high, args.delta
        )
    return loss if importance_weights is None else loss * importance_weights


def rare_flag(args: Args) -> str | None:
    """The first flag given that needs utils/loss_variants.py (the rarer losses and masks), else None."""
    given = {
        f"--loss_type {args.loss_type}": args.loss_type in LOSS_VARIANTS,
        "--off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
        "--top_entropy_quantile": args.top_entropy_quantile < 1,
    }
    return next((flag for flag, on in given.items() if on), None)


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values [B, R] over the masked tokens; 0 if none."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def clip_fractions(ratio, advantages, mask, epsilon_low, epsilon_high):
    """Fractions of masked tokens clipped: low (r < 1 - eps_low, A < 0), high (r > 1 + eps_high, A > 0),
    region (either). ratio, mask [B, R]; advantages [B]."""
    advantages = advantages[:, None]
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return tuple(token_mean(x.float(), mask) for x in (low, high, low | high))


def aggregate_loss(per_token_loss, mask, loss_type, max_completion_length, num_items=None):
    """The loss from per-token losses [B, R] of the masked tokens, L = max_completion_length:

    grpo    (1/B) sum_i (1/|o_i|) sum_t l_it       each completion weighs the same (a length bias)
    bnpo    sum_it l_it / sum_i |o_i|               token mean of this micro-batch
    dr_grpo sum_it l_it / (B * L)                   a constant normalizer (Dr. GRPO)
    dapo    sum_it l_it / num_items                 token mean over the optimizer step's tokens on all
                                                    processes (default: this micro-batch's)
    luspo   (1/B) sum_it l_it                       token sum per completion (LUSPO: long completions weigh more)"""
    mask = mask.to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    loss_type = {"cispo": "dapo", "vespo": "dapo", "sapo": "grpo"}.get(loss_type, loss_type)  # as TRL
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return total / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        return total / (mask.sum().clamp(min=1) if num_items is None else max(num_items, 1))
    if loss_type == "luspo":
        return total / per_token_loss.size(0)
    raise UsageError(f"unknown loss_type {loss_type!r}.")


# ---- rollout -----------------------------------------------------------------------------------------------
@torch.no_grad()
def sample(args, run, queries, query_mask, sync_weights=True, num_completions=None, generator=None):
    """(responses, lengths, response_mask [G * P, R], sampling logprobs, tool_mask): G = num_completions (None:
    num_generations) per prompt [P, Q], completion-major, cut after EOS; tool_mask: the sampled tokens (with
    --tools, not the tool answers between turns). Calls draw noise from `generator` (None:
    run.sampling_generator) in turn."""
    chunk, P = args.local_rollout_forward_batch_size, queries.size(0)
    G = num_completions or args.num_generations
    R, T = args.max_completion_length, args.temperature
    knobs = utils.generation.sampling_knobs(args)  # once a call, not once a chunk
    if run.rollout_func is not None:  # sampled in rollout_queries (utils/rollout_func.py)
        return run.rollout_func.tensors(R, run.pad_id, queries.device)
    responses, logprobs = [], []
    run.policy.eval()  # keeps the KV cache on under gradient checkpointing
    if run.engine is not None and sync_weights:  # outside the gathering below
        run.engine.sync_weights(run.policy, run.accelerator)
    # vLLM's own logprobs, for the importance weights.
    generate = (
        functools.partial(run.engine.generate, engine_logprobs=True)
        if run.engine is not None
        else utils.generation.generate
    )
    with utils.run.gathered_for_generation(run.policy, run.accelerator) as model:
        for rows in torch.arange(G * P, device=queries.device).split(chunk):
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            prompt = rows % P  # prompts repeated chunk by chunk, not G times at once
            query_responses, call_logprobs = generate(
                model,
                queries[prompt],
                query_mask[prompt],
                R,
                T,
                chunk,
                generator or run.sampling_generator,
                **knobs,
            )
            responses.append(query_responses[:, queries.size(1) :])
            logprobs.append(call_logprobs)
        logprobs = torch.cat(logprobs)
        responses, lengths = utils.generation.truncate_response(torch.cat(responses), run.eos_ids, run.pad_id)
        response_mask = utils.generation.lengths_to_mask(lengths, R)
        if run.tools is not None:  # the tool calls, their answers and the next turns (utils/tools.py)
            first_turn = (queries, query_mask, responses, lengths, logprobs)
            noise = generator or run.sampling_generator
            return run.tools.continue_batch(
                generate, model, first_turn, R, T, chunk, noise, run.eos_ids, **knobs
            )
    return responses, lengths, response_mask, logprobs, response_mask


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
    """(old logprobs or None on-policy, reference logprobs or None) [B, R] of the batch's rows."""
    chunk, Q, T = args.local_rollout_forward_batch_size, queries.size(1), args.temperature
    old_logprobs, ref_logprobs = [], []
    for idx in torch.arange(responses.size(0), device=queries.device).split(chunk):
        run.checkpointer.boundary()
        rows = utils.generation.query_response_rows(queries, query_mask, responses, response_mask, idx)
        if recomputes_old_logprobs(args):
            old_logprobs.append(utils.logprobs.batched_response_logprobs(run.policy, *rows, Q, T, chunk))
        if run.ref_policy is not None:
            ref_logprobs.append(utils.logprobs.batched_response_logprobs(run.ref_policy, *rows, Q, T, chunk))
    return tuple(torch.cat(logprobs) if logprobs else None for logprobs in (old_logprobs, ref_logprobs))


def ended_at_eos(responses, response_mask, eos_ids) -> torch.Tensor:
    """[B] bool: the completion's last token is an EOS (with tools, its last turn's; TRL's not-truncated)."""
    last = responses.gather(1, (response_mask.sum(1, keepdim=True) - 1).clamp(min=0))[:, 0]
    return torch.isin(last, eos_ids) & response_mask.any(1)


def sample_round(args, run, step, drawn, sync_weights=True):
    """Phase 1 on this process for the next P prompts, the run's `drawn`-th prompt batch: (examples [P],
    queries, query_mask, responses, response_mask, sampling logprobs, tool_mask, rewards [B, F]); its noise is
    run.sampling_generator's next, so a resume replays it."""
    P, W = args.local_prompts_per_generation, args.world_size
    examples = next(run.batches)  # dataset indices
    epoch = drawn * P * W / len(run.prompt_ids)
    trainer_state = utils.scoring.TrainerState(global_step=step, max_steps=args.total_steps, epoch=epoch)
    queries, query_mask, rows, k = utils.rollout.rollout_queries(
        run, run.prompt_ids, examples, args.num_generations, state=trainer_state
    )
    with run.accelerator.autocast():
        responses, _, response_mask, sampled_logprobs, tool_mask = sample(
            args, run, queries, query_mask, sync_weights, k
        )
        rewards_per_func = score(
            args, run, queries, query_mask, responses, response_mask, rows, trainer_state
        )
    rollout = (responses, response_mask, sampled_logprobs, tool_mask)
    return examples, queries, query_mask, *rollout, rewards_per_func


def reward_metrics(rewards_per_func, rewards, num_generations, names, num_processes=1) -> dict[str, float]:
    """TRL's reward metrics of all W processes (rewards_per_func [W * B, F], rewards [W * B]): NaN-mean and
    NaN-std, frac_reward_zero_std."""
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


# ---- checks and sizes --------------------------------------------------------------------------------------
def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Check the flags and fill in the batch sizes; UsageError with one sentence."""
    if args.num_generations < 2:
        raise UsageError(
            f"--num_generations must be at least 2 (a group needs a mean), got {args.num_generations}."
        )
    positive = "per_device_train_batch_size gradient_accumulation_steps num_iterations max_completion_length"
    for flag in f"{positive} local_rollout_forward_batch_size logging_steps".split():
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.temperature <= 0:
        raise UsageError(
            f"--temperature must be positive (GRPO needs sampled completions), got {args.temperature}."
        )
    # TRL's GRPOConfig reads True as group and False as none.
    args.scale_rewards = {"true": "group", "false": "none"}.get(
        args.scale_rewards.lower(), args.scale_rewards
    )
    if args.scale_rewards not in ("group", "batch", "none"):
        raise UsageError(
            f"--scale_rewards takes group, batch, none, True or False, got {args.scale_rewards!r}."
        )
    if args.epsilon_high is None:
        args.epsilon_high = args.epsilon
    if not 0 < args.epsilon < 1 or args.epsilon_high <= 0:
        raise UsageError("--epsilon must lie in (0, 1) and --epsilon_high must be positive.")
    if args.delta is not None and args.delta <= 1 + args.epsilon_high:
        raise UsageError(f"--delta must exceed 1 + epsilon_high = {1 + args.epsilon_high}, got {args.delta}.")
    if args.beta < 0:
        raise UsageError(f"--beta must be at least 0, got {args.beta}.")
    vllm_flags = utils.run.extra_module("utils.vllm")  # TRL checks these flags even without --use_vllm
    if vllm_flags is not None:
        vllm_flags.check_importance_sampling_flags(args)
    # utils/loss_variants.py is optional; vespo's checks once (the 2nd call: same flags)
    rare = rare_flag(args)
    if rare:
        utils.run.optional_module("utils.loss_variants", rare).check_flags(args, not args.world_size)
    if args.model_name_or_path is None:
        raise UsageError("pass the policy to train with --model_name_or_path.")
    num_rewards = (args.reward_model_path is not None) + len(args.reward_funcs or [])
    if num_rewards == 0 and not args.environment_factory:  # an environment's get_reward() may be it
        raise UsageError(
            "pass at least one reward: --reward_funcs file.py:function and/or --reward_model_path."
        )
    if not 0 <= args.top_entropy_quantile <= 1:
        raise UsageError(f"--top_entropy_quantile must lie in [0, 1], got {args.top_entropy_quantile}.")
    if args.max_num_gen_batches < 0:
        raise UsageError(f"--max_num_gen_batches must be at least 0, got {args.max_num_gen_batches}.")
    if args.reward_weights is not None and len(args.reward_weights) != num_rewards:
        raise UsageError(
            f"--reward_weights has {len(args.reward_weights)} values for {num_rewards} rewards (the reward "
            "model, then the --reward_funcs)."
        )
    if args.max_steps == 0 or args.max_steps < -1 or (args.max_steps == -1 and args.num_train_epochs <= 0):
        raise UsageError("set --max_steps to a positive number, or -1 with a positive --num_train_epochs.")
    if not args.world_size:  # the first call sees the flags as given
        given = (args.generation_batch_size, args.steps_per_generation)
        global_micro_batch = args.per_device_train_batch_size * world_size
        if None not in given:
            raise UsageError(
                "give --generation_batch_size or --steps_per_generation, not both (each sets the other)."
            )
        if args.generation_batch_size is not None:
            if args.generation_batch_size < 1 or args.generation_batch_size % global_micro_batch:
                raise UsageError(
                    f"--generation_batch_size {args.generation_batch_size} must be a positive multiple of "
                    f"per_device_train_batch_size * processes = {global_micro_batch}."
                )
            args.steps_per_generation = args.generation_batch_size // global_micro_batch
        elif args.steps_per_generation is None:
            args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = args.steps_per_generation * global_micro_batch
    if args.steps_per_generation < 1 or args.steps_per_generation % args.gradient_accumulation_steps:
        raise UsageError(
            f"--steps_per_generation {args.steps_per_generation} (micro-batches per process per generation) "
            "must be a positive multiple of --gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}."
        )
    args.world_size = world_size
    args.local_generation_batch_size = args.per_device_train_batch_size * args.steps_per_generation
    if args.local_generation_batch_size % args.num_generations:
        raise UsageError(
            f"--num_generations {args.num_generations} must divide the completions per process per "
            "generation, per_device_train_batch_size * steps_per_generation = "
            f"{args.local_generation_batch_size}, so that groups stay whole on one process; change one of "
            "these flags."
        )
    args.local_prompts_per_generation = args.local_generation_batch_size // args.num_generations
    args.steps_per_generation_round = (
        args.steps_per_generation // args.gradient_accumulation_steps * args.num_iterations
    )
    if args.save_steps % args.steps_per_generation_round:
        raise UsageError(
            f"--save_steps {args.save_steps} must be a multiple of the {args.steps_per_generation_round} "
            "optimizer steps made from one generation (checkpoints fall between generations)."
        )
    if num_prompts is not None:
        prompts_per_generation = args.local_prompts_per_generation * world_size
        if num_prompts < prompts_per_generation:
            raise UsageError(
                f"the dataset has {num_prompts} prompts, fewer than the {prompts_per_generation} of one "
                "generation; "
                "lower the batch flags or use a larger split."
            )
        if args.max_steps > 0:
            args.total_steps = args.max_steps
        else:
            generations = math.ceil(args.num_train_epochs * (num_prompts // prompts_per_generation))
            args.total_steps = generations * args.steps_per_generation_round
    return args


def recomputes_old_logprobs(args: Args) -> bool:
    """Old logprobs from a forward pass after sampling when off-policy or correcting vLLM (as TRL); else
    each micro-batch's own, detached (ratio 1)."""
    on_policy = args.num_iterations == 1 and args.steps_per_generation == args.gradient_accumulation_steps
    return not on_policy or (args.use_vllm and args.vllm_importance_sampling_correction)


# ---- training ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What a run holds from setup to save."""

    accelerator: object
    tokenizer: object
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref_policy: torch.nn.Module | None
    scorers: list
    reward_names: list[str]
    weights: torch.Tensor
    engine: object
    tools: object  # utils.tools.Tools with --tools, else None
    rollout_func: object  # utils.rollout_func.RolloutFunc with --rollout_func, else None
    pad_id: int
    eos_ids: torch.Tensor
    prompt_ids: list
    raw_prompts: list
    columns: dict
    eval_prompt_ids: list | None  # the held-out prompts (--dataset_test_split), or None: no evaluation
    eval_raw_prompts: list | None
    eval_columns: dict
    batches: object
    sampling_generator: torch.Generator
    shuffle_generator: torch.Generator
    checkpointer: utils.checkpoint.Checkpointer
    checkpointed: dict
    tracker: utils.tracking.Tracker
    start_step: int
    start_generation: int
    start_prompt_batches: int


def setup(args: Args) -> Run:
    """Flags, data, tokenizer, models, optimizer, scorers, vLLM engine, resume and tracker."""
    from transformers import AutoModelForCausalLM

    utils.loading.use_model_flags(args)
    # Checks before any model is loaded.
    accelerator = utils.run.make_accelerator(
        args, args.gradient_accumulation_steps, micro_batch_size=args.per_device_train_batch_size
    )
    fill_sizes(args, accelerator.num_processes)
    utils.evaluation.check_args(args)
    utils.generation.sampling_knobs(args)  # checks the sampling flags given (utils/sampling_knobs.py)
    args.num_generations_eval = args.num_generations_eval or args.num_generations  # TRL 1.16's
    if args.num_generations_eval < 1:
        raise UsageError(f"--num_generations_eval must be at least 1, got {args.num_generations_eval}.")
    if args.use_vllm:  # utils/vllm.py is optional: imported only with --use_vllm
        utils.run.optional_module("utils.vllm", "--use_vllm").check_args(args)
    if args.filter_groups:  # so is utils/dynamic_sampling.py, with --filter_groups
        utils.run.optional_module("utils.dynamic_sampling", "--filter_groups")
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
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.data.check_columns(dataset, ["prompt"], f"--dataset_name {args.dataset_name}")
    eval_dataset = utils.evaluation.load_test_split(args, "grpo.py")
    environments = None
    if args.environment_factory:  # one per rollout, reset on its row; a class with get_reward() is a reward
        environments_module = utils.run.optional_module("utils.environments", "--environment_factory")
        environments = environments_module.load_environments(args, tool_fns, dataset, eval_dataset)
    reward_fns = utils.rollout.reward_fns(args, dataset, environments, rollout_func)
    raw_prompts, columns = utils.rollout.reward_rows(dataset, bool(reward_fns))
    eval_raw_prompts, eval_columns = utils.rollout.reward_rows(eval_dataset, bool(reward_fns))
    reward_names = [getattr(fn, "__name__", "reward") for fn in reward_fns]  # TRL's: the function's name
    if args.reward_model_path:  # TRL's order: the reward model first, named by its folder
        reward_names.insert(0, os.path.basename(os.path.normpath(args.reward_model_path)))
    if args.filter_groups_metric not in ("reward", *reward_names):
        raise UsageError(
            f"--filter_groups_metric {args.filter_groups_metric!r} is neither reward nor one of the rewards "
            f"{reward_names}."
        )
    fill_sizes(args, accelerator.num_processes, len(dataset))
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    # Before any model loads: it checks every model path and takes a resumed run's name.
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)

    # Tokenizer and prompts
    tokenizer = utils.loading.load_tokenizer(
        args.model_name_or_path, "--model_name_or_path", args.chat_template_path
    )
    pad_id = tokenizer.pad_token_id
    tools = None
    if args.tools or args.environment_factory:
        timeout, rounds = args.tool_timeout, args.max_tool_calling_iterations
        tools = tools_module.Tools(tool_fns, tokenizer, timeout, rounds, environments)
    model, flag = args.model_name_or_path, "--model_name_or_path"
    prompt_ids, eval_prompt_ids = utils.rollout.prompt_ids(
        args, tokenizer, dataset, eval_dataset, tools, "max_completion_length", model, flag
    )
    longest = max(map(len, prompt_ids + (eval_prompt_ids or []))) + args.max_completion_length
    longest = longest if tools is None else tools.longest(longest)  # a reset lengthens prompts

    # Models: dropout off (--disable_dropout), so the training forward's logprobs equal sampling's.
    policy = utils.loading.from_pretrained(
        AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
    )
    if lora is not None:
        policy = lora.add_adapter(policy, args, args.seed)
    if args.disable_dropout:  # after LoRA wrapping: the adapters' dropout goes too, as TRL
        utils.loading.disable_dropout(policy)
    # TRL 1.16 stops at the tokenizer's EOS and at every EOS id of the policy's generation_config.
    eos_ids = torch.tensor(utils.generation.eos_token_ids(policy, tokenizer), device=accelerator.device)
    ref_policy = None
    if args.beta > 0 and lora is None:  # LoRA: the policy with its adapter off
        ref_policy = utils.loading.from_pretrained(
            AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
        )
        utils.loading.disable_dropout(ref_policy)
    reward_model = utils.scoring.load_reward_model(args.reward_model_path) if args.reward_model_path else None
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(policy)
    optimizer = utils.run.trainer_optimizer(policy, args)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    engine = None
    if args.use_vllm:
        vllm_module = utils.run.optional_module("utils.vllm", "--use_vllm")
        engine = vllm_module.Engine(args, accelerator, args.model_name_or_path, longest)
    if ref_policy is not None:
        ref_policy = utils.run.bare(utils.run.prepare_frozen(ref_policy, accelerator))
    elif args.beta > 0:
        ref_policy = lora.AdapterOff(policy)
    if reward_model is not None:
        reward_model = utils.run.bare(utils.run.prepare_frozen(reward_model, accelerator))
    reward_tokenizer = utils.scoring.load_reward_tokenizer(args.reward_tokenizer_path, args.reward_model_path)
    scorers = [utils.scoring.RewardScorer(None, None, tokenizer, reward_fn=fn) for fn in reward_fns]
    if reward_model is not None:  # TRL's order: the reward model first
        scorers.insert(0, utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer))
    # --reward_weights (one per reward model and function, checked), else 1; an environment's reward 1 (TRL's)
    given = args.reward_weights or []
    weights = torch.tensor(given + [1.0] * (len(reward_names) - len(given)), device=accelerator.device)
    for scorer in scorers:  # which path scores each reward
        accelerator.print(scorer.describe())

    # Resume: weights, optimizer, random generators; the prompt order is replayed.
    rank = accelerator.process_index
    batches = utils.data.prompt_batches(
        len(prompt_ids), args.local_prompts_per_generation, args.world_size, rank, args.seed
    )
    sampling_generator = torch.Generator(device=accelerator.device).manual_seed(args.seed + rank)
    shuffle_generator = torch.Generator().manual_seed(args.seed + rank)
    generators = {"sampling": sampling_generator, "shuffle": shuffle_generator}
    checkpointed = dict(models={"policy": policy}, optimizers={"policy": optimizer}, generators=generators)
    state = checkpointer.resume(**checkpointed) or {"step": 0, "generation": 0}
    # --filter_groups draws more than one prompt batch a generation
    drawn = state.get("prompt_batches", state["generation"])
    for _ in range(drawn):
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
        prompt_ids=prompt_ids,
        raw_prompts=raw_prompts,
        columns=columns,
        eval_prompt_ids=eval_prompt_ids,
        eval_raw_prompts=eval_raw_prompts,
        eval_columns=eval_columns,
        batches=batches,
        sampling_generator=sampling_generator,
        shuffle_generator=shuffle_generator,
        checkpointer=checkpointer,
        checkpointed=checkpointed,
        tracker=tracker,
        start_step=state["step"],
        start_generation=state["generation"],
        start_prompt_batches=drawn,
    )


def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, policy, optimizer = run.accelerator, run.policy, run.optimizer
    device, rank = accelerator.device, accelerator.process_index
    B, T = args.local_generation_batch_size, args.temperature
    G, R, ga = args.num_generations, args.max_completion_length, args.gradient_accumulation_steps
    correct_vllm = args.use_vllm and args.vllm_importance_sampling_correction
    vllm_module = utils.run.optional_module("utils.vllm", "--use_vllm") if correct_vllm else None
    variants = utils.run.optional_module("utils.loss_variants", rare_flag(args)) if rare_flag(args) else None
    dynamic = None  # utils/dynamic_sampling.py is optional: imported only with --filter_groups
    if args.filter_groups:
        dynamic = utils.run.optional_module("utils.dynamic_sampling", "--filter_groups")
    sample_every = max(
        1, args.total_steps // args.steps_per_generation_round // max(1, args.num_sample_generations)
    )
    step, generation, drawn = run.start_step, run.start_generation, run.start_prompt_batches
    start_drawn, start_time, metrics = drawn, time.time(), {}
    window, window_generations = [], []  # since the last log: each step's stats, each generation's metrics
    schedule = utils.run.lr_schedule(args, args.total_steps)
    eval_metrics = {}  # the last held-out evaluation's, for the model card
    if args.eval_on_start and step == 0 and run.eval_prompt_ids is not None:
        eval_metrics = held_out_metrics(args, run, 0, 0)
        run.tracker.log(eval_metrics, 0)
    progress = tqdm(total=args.total_steps, initial=step, disable=not accelerator.is_local_main_process)
    while step < args.total_steps:
        # 1. Sample and reward: G completions of each of P prompts, completion-major (row i <- prompt i % P);
        # --filter_groups: only groups whose rewards differ, from as many rounds as it takes (DAPO).
        sample_next = functools.partial(sample_round, args, run, step)
        if dynamic is not None:
            *batch, filtered = dynamic.sample_groups(args, run, sample_next, drawn, combine_rewards)
        else:
            batch, filtered = sample_next(drawn), {}
        examples, queries, query_mask, *rollout, rewards_per_func = batch
        responses, response_mask, sampled_logprobs, tool_mask = rollout
        generation += 1
        drawn += filtered.get("filter_groups/num_gen_batches", 1)
        context_length, lengths = queries.size(1), tool_mask.sum(1)  # sampled tokens (TRL's with tools)
        has_eos = ended_at_eos(responses, response_mask, run.eos_ids)
        rows_at = functools.partial(
            utils.generation.query_response_rows, queries, query_mask, responses, response_mask
        )

        # 2. Score: old (unless on-policy) and reference logprobs.
        with accelerator.autocast():
            old_logprobs, ref_logprobs = old_and_ref_logprobs(
                args, run, queries, query_mask, responses, response_mask
            )
        all_rewards_per_func = accelerator.gather(rewards_per_func)  # for the batch's std
        all_rewards = combine_rewards(all_rewards_per_func, run.weights)
        rewards = all_rewards.view(args.world_size, B)[rank]

        # 3. Advantages
        # ALGO LOGIC: A = (reward - mean of its group) / (std + eps), one per completion
        batch_std = nanstd(all_rewards) if args.scale_rewards == "batch" else None
        advantages = group_advantages(rewards, G, args.scale_rewards, batch_std)
        # ALGO LOGIC: the loss, KL and entropy see the sampled tokens only, never a tool's answer
        loss_mask = tool_mask & has_eos[:, None] if args.mask_truncated_completions else tool_mask
        importance_weights, correction_metrics = None, {}
        if correct_vllm:  # vLLM's sampler against training's forward (utils/vllm.py)
            importance_weights, correction_metrics = vllm_module.correction(
                args, old_logprobs, sampled_logprobs, tool_mask, accelerator
            )
        generation_metrics = {
            **reward_metrics(all_rewards_per_func, all_rewards, G, run.reward_names, args.world_size),
            "completions/mean_length": utils.run.gathered_mean(accelerator, lengths),
            "completions/clipped_ratio": utils.run.gathered_mean(accelerator, ~has_eos),
            **(run.tools.metrics(accelerator) if run.tools is not None else {}),
            **filtered,
            **utils.rollout.logged_means(accelerator, run.scorers),
            **correction_metrics,
        }
        window_generations.append(generation_metrics)

        # 4. Update: num_iterations shuffled passes over the generation.
        policy.train()
        orders = [
            torch.randperm(B, generator=run.shuffle_generator).to(device) for _ in range(args.num_iterations)
        ]
        micro_batches = [idx for order in orders for idx in order.split(args.per_device_train_batch_size)]
        for first in range(0, len(micro_batches), ga):
            if step >= args.total_steps:
                break
            lr = schedule(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_batches = micro_batches[first : first + ga]
            # dapo: the step's tokens / (ga * processes), since the backward averages over both.
            step_tokens = accelerator.reduce(sum(loss_mask[idx].sum().float() for idx in step_batches), "sum")
            num_items = step_tokens.item() / (ga * args.world_size)
            stats = torch.zeros(7, device=device)  # loss, kl, entropy, clip low, high, region, ratio
            grad_norm = None
            for idx in step_batches:
                run.checkpointer.boundary()
                with accelerator.accumulate(policy):
                    query_responses, attention_mask = rows_at(idx)
                    logprobs, entropy, _ = utils.logprobs.response_logprobs(
                        policy, query_responses, attention_mask, context_length, T, with_stats=True
                    )
                    # ALGO LOGIC: the clipped surrogate per token (+ beta * KL), averaged by --loss_type
                    mb_mask = loss_mask[idx]
                    mb_old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs[idx]
                    raw_old_logprobs = mb_old_logprobs
                    if args.importance_sampling_level == "sequence":
                        mb_old_logprobs = sequence_level(logprobs, mb_old_logprobs, mb_mask)
                    vllm_weights = importance_weights[idx] if importance_weights is not None else None
                    vespo = args.loss_type == "vespo"  # vLLM's weights enter its sequence weight instead
                    mb_weights = 1.0 if vllm_weights is None or vespo else vllm_weights
                    if variants is not None:  # the masks of their flags (utils/loss_variants.py)
                        given = (args.use_vllm or args.rollout_func) and sampled_logprobs is not None
                        pi_old = sampled_logprobs[idx] if given else raw_old_logprobs  # the sampler's
                        mb_weights = variants.masked_weights(
                            args, mb_weights, advantages[idx], logprobs, entropy, pi_old, mb_mask, accelerator
                        )
                    per_token_loss = policy_token_loss(
                        args, logprobs, mb_old_logprobs, advantages[idx], mb_weights, mb_mask, vllm_weights
                    )
                    kl = torch.zeros_like(mb_old_logprobs)
                    if run.ref_policy is not None:
                        kl = kl_penalty(
                            logprobs, mb_old_logprobs, ref_logprobs[idx], args.use_bias_correction_kl
                        )
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = aggregate_loss(per_token_loss, mb_mask, args.loss_type, R, num_items)
                    accelerator.backward(loss)
                    # the accumulation's last micro-batch measures the norm; 0.0 is a norm and is logged
                    grad_norm = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    ratio = (logprobs - mb_old_logprobs).exp()
                    # sequence level: one ratio a completion, its clip fractions counted per completion (TRL)
                    each = (
                        (ratio[:, :1], mb_mask.new_ones(len(idx), 1))
                        if args.importance_sampling_level == "sequence"
                        else (ratio, mb_mask)
                    )
                    clipped = clip_fractions(
                        each[0], advantages[idx], each[1], args.epsilon, args.epsilon_high
                    )
                    if args.loss_type in ("cispo", "vespo"):  # tokens the cap lowered; mean weight phi
                        log_ratio = logprobs - mb_old_logprobs
                        clipped = variants.clip_stat(
                            args, *each, log_ratio, advantages[idx], mb_mask, vllm_weights
                        )
                    mb_stats = [
                        token_mean(kl, mb_mask),
                        token_mean(entropy, mb_mask),
                        *map(torch.as_tensor, clipped),
                    ]
                    stats += torch.stack([loss.detach(), *mb_stats, token_mean(ratio, mb_mask)]) / len(
                        step_batches
                    )
            step += 1
            progress.update(1)
            grad_norm = utils.run.grad_norm_after_step(policy, grad_norm)
            run.tracker.check_finite(step, loss=stats[0], grad_norm=grad_norm)
            window.append(stats)

            # 5. Metrics: means over processes, then over the steps (and generations) since the last log, as TRL's;
            # the held-out evaluation at its steps (its own noise: training is that of the run without it).
            eval_metrics = {}
            if run.eval_prompt_ids is not None and utils.evaluation.due(step, args.total_steps, args):
                eval_metrics = held_out_metrics(args, run, step, drawn)
            if step % args.logging_steps == 0 or step == args.total_steps:
                low_high = accelerator.gather(torch.stack(window)[None, :, 3:5])  # [processes, steps, 2]
                stats = accelerator.reduce(torch.stack(window), reduction="mean").mean(0)
                if args.loss_type in LOSS_VARIANTS:  # sapo has no clip
                    clip_metrics = variants.clip_metrics(args.loss_type, stats)
                else:
                    clip_metrics = {
                        "clip_ratio/low_mean": stats[3].item(),
                        "clip_ratio/low_min": low_high[..., 0].min(0).values.mean().item(),
                        "clip_ratio/high_mean": stats[4].item(),
                        "clip_ratio/high_max": low_high[..., 1].max(0).values.mean().item(),
                        "clip_ratio/region_mean": stats[5].item(),
                    }
                # a window inside one generation repeats its metrics (TRL's leaves them out)
                generations = window_generations or [generation_metrics]
                seconds = time.time() - start_time
                metrics = {
                    **utils.tracking.mean_by_key(generations, skip_nan=True),
                    "loss": stats[0].item(),
                    "kl": stats[1].item(),
                    "entropy": stats[2].item(),
                    **clip_metrics,
                    "ratio": stats[6].item(),
                    **({"grad_norm": grad_norm} if grad_norm is not None else {}),
                    "learning_rate": lr,
                    "episode": drawn * args.generation_batch_size,  # completions sampled
                    "eps": int((drawn - start_drawn) * args.generation_batch_size / seconds),
                }
                run.tracker.log({**metrics, **eval_metrics}, step)
                window, window_generations = [], []
            elif eval_metrics:
                run.tracker.log(eval_metrics, step)

        # 6. Checkpoint and samples: between generations (a resume starts a new one).
        run.checkpointer.maybe_save(
            step, **run.checkpointed, state={"generation": generation, "prompt_batches": drawn}
        )
        if args.num_sample_generations and (generation % sample_every == 0 or generation == 1):
            sample_table(args, run, generation, step, queries, responses, response_mask, rewards, advantages)
    progress.close()

    # 7. Save the policy and a model card (all processes: ZeRO-3 gathers shards).
    saving = utils.run.optional_module("utils.lora", "--use_peft") if args.use_peft else utils.saving
    card_metrics = {**metrics, **eval_metrics}
    saving.save_model(
        run.checkpointer, policy, run.tokenizer, args, "GRPO", args.model_name_or_path, card_metrics
    )
    run.tracker.close()
    utils.run.end_run(accelerator, run.engine)
    return card_metrics


def held_out_metrics(args, run, step, drawn) -> dict:
    """The held-out evaluation after optimizer step `step` (0: before the first), `drawn` prompt batches
    sampled: --num_generations_eval completions of every --dataset_test_split prompt, sampled and scored as in
    training, each batch's noise keyed by (seed, EVAL_KEY, its first prompt) -> eval/ means over all processes."""
    epoch = drawn * args.local_prompts_per_generation * args.world_size / len(run.prompt_ids)
    trainer_state = utils.scoring.TrainerState(global_step=step, max_steps=args.total_steps, epoch=epoch)
    training = run.policy.training  # sampling sets eval mode; a step of this generation may follow
    if run.engine is not None:  # once, not every batch
        run.engine.sync_weights(run.policy, run.accelerator)
    prompts_per_batch = max(1, args.per_device_eval_batch_size // args.num_generations_eval)
    eval_metrics, _ = utils.evaluation.evaluate(
        run.accelerator,
        len(run.eval_prompt_ids),
        prompts_per_batch,
        functools.partial(held_out_batch, args, run, trainer_state),
    )
    run.policy.train(training)
    return {**eval_metrics, **utils.rollout.logged_means(run.accelerator, run.scorers, "eval/")}


@torch.no_grad()
def held_out_batch(args, run, trainer_state, indices: list[int]) -> tuple[dict, None]:
    """The held-out prompts `indices`: per completion (completion-major), the values whose means are the eval/
    metrics, named as training's."""
    device, k = run.accelerator.device, args.num_generations_eval
    queries, query_mask, rows, n = utils.rollout.rollout_queries(
        run, run.eval_prompt_ids, indices, k, True, trainer_state
    )
    noise = utils.generation.sampling_generator(
        args.seed, utils.evaluation.EVAL_KEY, indices[0], device=device
    )
    with run.accelerator.autocast():
        responses, lengths, response_mask, _, _ = sample(args, run, queries, query_mask, False, n, noise)
        rewards_per_func = score(
            args, run, queries, query_mask, responses, response_mask, rows, trainer_state, held_out=True
        )
    rewards = combine_rewards(rewards_per_func, run.weights)
    # TRL 1.16: a group of one completion has std 0
    group_std = nanstd(rewards.view(k, -1), 0) if k > 1 else torch.zeros(len(indices), device=device)
    has_eos = ended_at_eos(responses, response_mask, run.eos_ids)
    values = {
        "reward": rewards,
        "frac_reward_zero_std": group_std.isclose(torch.zeros_like(group_std)).float().repeat(k),
        **{f"rewards/{name}/mean": rewards_per_func[:, f] for f, name in enumerate(run.reward_names)},
        "completions/mean_length": lengths.float(),
        "completions/clipped_ratio": (~has_eos).float(),
    }
    return values, None


def sample_table(args, run, generation, step, queries, responses, response_mask, rewards, advantages) -> None:
    """Print the first completions of this generation with their rewards and advantages."""
    shown = torch.arange(min(args.local_prompts_per_generation, 4), device=run.accelerator.device)
    run.tracker.samples(
        {
            "query": run.tokenizer.batch_decode(queries[shown], skip_special_tokens=True),
            "completion": [
                run.tokenizer.decode(r[m], skip_special_tokens=True)
                for r, m in zip(responses[shown], response_mask[shown])
            ],
            "reward": rewards[shown].tolist(),
            "advantage": advantages[shown].tolist(),
        },
        title=f"generation {generation}, step {step}",
    )


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
