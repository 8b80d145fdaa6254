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

    python rloo.py --sft_model_path models/sft --reward_model_path models/reward --dataset_name data/tldr/prompts \
        --rloo_k 2 --per_device_train_batch_size 16 --gradient_accumulation_steps 16 --num_mini_batches 2 \
        --num_ppo_epochs 2 --learning_rate 3e-6 --total_episodes 1000000 --kl_coef 0.03 \
        --stop_token eos --missing_eos_penalty 1.0 --local_rollout_forward_batch_size 16 --output_dir models/rloo
"""

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
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
    output_dir: str = "models/rloo"
    """where the trained policy (weights, tokenizer, model card) is saved"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir: its contents are moved aside to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (without its checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """write a checkpoint to {output_dir}/checkpoint-{update} every this many updates (0: only on SIGTERM/SIGINT)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint-N folder, or `latest` (the newest in --output_dir), to continue a run exactly from"""

    # Models and data
    model_name_or_path: str | None = None
    """the policy to start from and its tokenizer (hub id or local dir); --sft_model_path overrides the weights"""
    sft_model_path: str | None = None
    """the SFT policy to start from; also the frozen reference model of the KL penalty"""
    reward_model_path: Annotated[str | None, tyro.conf.arg(aliases=("--reward_model_name_or_path",))] = None
    """sequence classifier (one label) giving the score; or use --reward_fn"""
    reward_tokenizer_path: str | None = None
    """the reward model's tokenizer (TRL: reward_processing_classes); None: the one in --reward_model_path. When it
    is not the policy's, completions are decoded and encoded again with it"""
    reward_fn: Annotated[str | None, tyro.conf.arg(aliases=("--reward_funcs",))] = None
    """path/to/file.py:function or module.function, returning one float per completion: called as function(prompts, completions) on
    texts, or, when it takes **kwargs, as TRL calls it (keywords prompts, completions and every dataset column)"""
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
    total_episodes: int | None = None
    """completions to train on in total (None: every prompt once, rloo_k completions each)"""
    learning_rate: float = 3e-6
    """Adam learning rate"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """'linear' decays the learning rate to 0 over the updates"""
    max_grad_norm: float | None = None
    """clip the gradient norm at this value (also under DeepSpeed); None: no clipping. The norm is logged"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward pass per process (micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over one update's batch"""
    num_ppo_epochs: int = 4
    """epochs over each batch of completions; > 1 relies on the clipped objective"""
    rloo_k: Annotated[int, tyro.conf.arg(aliases=("--num_generations",))] = 2
    """completions sampled per prompt (at least 2: the baseline is the mean of the other k-1)"""
    kl_coef: float = 0.05
    """weight of the KL penalty to the reference model"""
    cliprange: float = 0.2
    """clip range of the probability ratio"""
    token_level_kl: bool = False
    """KL penalty on every token and the score on the EOS token, every token an action (REINFORCE++ style)"""
    whiten_rewards: bool = False
    """whiten the rewards (variance 1, mean kept) over the batch before the advantages"""
    normalize_reward: bool = False
    """normalize the scores to mean 0, std 1 over the batch, then clip them to +-reward_clip_range"""
    reward_clip_range: float = 10.0
    """clip range of the normalized scores (used with --normalize_reward)"""
    normalize_advantage: bool = False
    """normalize the advantages to mean 0, std 1 over the batch (over its tokens with --token_level_kl)"""
    response_length: int = 53
    """tokens sampled per completion (then truncated after the stop token)"""
    temperature: float = 0.7
    """sampling temperature; logprobs of policy and reference are taken at the same temperature"""
    stop_token: Literal["eos"] | None = None
    """'eos' truncates completions after the tokenizer's EOS token"""
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


def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Check the flags and compute the derived batch sizes (TRL's arithmetic); ValueError on a bad value."""
    if args.rloo_k < 2:
        raise ValueError(
            f"--rloo_k must be at least 2 (the baseline is the mean of the other k-1), got {args.rloo_k}."
        )
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                 "num_ppo_epochs", "response_length", "local_rollout_forward_batch_size"):  # fmt: skip
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.temperature <= 0 or args.cliprange <= 0:
        raise ValueError("--temperature and --cliprange must be positive (RLOO needs sampled completions).")
    if (args.reward_model_path is None) == (args.reward_fn is None):
        raise ValueError("pass exactly one of --reward_model_path and --reward_fn.")
    if args.sft_model_path is None and args.model_name_or_path is None:
        raise ValueError("pass the policy to train with --sft_model_path or --model_name_or_path.")
    if args.stop_token is not None and args.stop_token_id is not None:
        raise ValueError("pass only one of --stop_token and --stop_token_id.")
    args.world_size = world_size
    args.local_batch_size = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    )
    args.batch_size = args.local_batch_size * world_size
    args.local_mini_batch_size = args.local_batch_size // args.num_mini_batches
    args.mini_batch_size = args.batch_size // args.num_mini_batches
    if args.local_batch_size % args.rloo_k:
        raise ValueError(
            f"--rloo_k {args.rloo_k} must divide the completions per process per update, per_device_train_batch_size "
            f"* gradient_accumulation_steps * num_mini_batches = {args.local_batch_size}; change --rloo_k or "
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
    """Leave-one-out baseline [B]: for completion c of prompt p, mean_{c' != c} rewards[c' * P + p]."""
    grouped = rewards.view(k, -1)  # [k, P]: row c holds completion c of every prompt
    return ((grouped.sum(0, keepdim=True) - grouped) / (k - 1)).flatten()


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """A_i = R_i - mean of the other k-1 rewards of the same prompt. rewards [B] completion-major -> [B]."""
    return rewards - rloo_baseline(rewards, k)


def sequence_level_rewards(scores, kl, mask, kl_coef):
    """Whole-completion reward [B]: score - kl_coef * sum_t kl_t over the response tokens (mask [B, R])."""
    return scores - kl_coef * (kl * mask).sum(1)


def token_level_rewards(scores, kl, lengths, kl_coef):
    """Per-token rewards [B, R]: -kl_coef * kl_t on every response token, plus the score on the last kept token
    (the EOS when there is one; index lengths - 1, never the token after it). Zero on padding."""
    mask = utils.lengths_to_mask(lengths, kl.size(1))
    rewards = -kl_coef * kl * mask
    return rewards.scatter_add(1, (lengths - 1)[:, None], scores[:, None].to(rewards.dtype))


def token_level_advantages(rewards: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """Advantage of token t [B, R]: reward-to-go G_t = sum_{s >= t} r_s (gamma 1) minus the leave-one-out mean
    of the other completions' total rewards G_0. At t = 0 it equals rloo_advantages of the summed rewards; later
    tokens are not charged for the KL of the tokens before them. Zero on padding."""
    rewards = rewards * mask
    returns = rewards.flip(1).cumsum(1).flip(1)
    return (returns - rloo_baseline(returns[:, 0], k)[:, None]) * mask


def normalize_scores(scores: torch.Tensor, clip_range: float) -> torch.Tensor:
    """(scores - mean) / std over the batch, then clipped to [-clip_range, clip_range]."""
    return ((scores - scores.mean()) / (scores.std() + 1e-8)).clamp(-clip_range, clip_range)


def policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange):
    """PPO's clipped surrogate, -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged over the actions.

    new/old_logprobs [B, R] of the response tokens, mask [B, R]. With advantages [B] an action is a whole
    completion (ratio = exp of the summed log-ratio); with advantages [B, R] it is a token.
    Returns (loss, ratio of each action, clip fraction, approximate KL 0.5 * E[log-ratio^2])."""
    log_ratio = (new_logprobs - old_logprobs) * mask
    weights = mask.float()
    if advantages.dim() == 1:
        log_ratio, weights = log_ratio.sum(1), torch.ones_like(advantages)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    per_action = torch.max(unclipped, clipped)
    loss = utils.masked_mean(per_action, weights)
    with torch.no_grad():
        clipfrac = utils.masked_mean((clipped > unclipped).float(), weights)
        approxkl = utils.masked_mean(0.5 * log_ratio**2, weights)
    return loss, ratio.detach()[weights.bool()], clipfrac, approxkl


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
    generate = engine.generate if engine is not None else utils.generate
    policy.eval()  # dropout is off anyway; eval keeps the KV cache on under gradient checkpointing
    with utils.run.gathered_for_generation(policy, accelerator) as sampler:
        for start in range(0, P, prompts_per_call):
            prompt = torch.arange(start, min(start + prompts_per_call, P), device=queries.device)
            rows = prompt.repeat(num_completions)  # completion-major within the call
            noise = utils.sampling_generator(args.seed, *key, first_prompt + start, device=queries.device)
            query_responses, call_logprobs = generate(
                sampler, queries[rows], query_mask[rows], args.response_length, args.temperature, rows.numel(),
                noise,
            )  # fmt: skip
            responses.append(query_responses[:, queries.size(1) :].unflatten(0, (num_completions, -1)))
            logprobs.append(call_logprobs.unflatten(0, (num_completions, -1)))
    responses = torch.cat(responses, 1).flatten(0, 1)
    logprobs = torch.cat(logprobs, 1).flatten(0, 1)
    responses, lengths = utils.truncate_response(responses, stop_token_id, pad_id)
    return responses, lengths, utils.lengths_to_mask(lengths, args.response_length), logprobs


@torch.no_grad()
def rollout(args, accelerator, policy, ref_policy, scorer, queries, query_mask, update, first_prompt,
            stop_token_id, pad_id, recompute_old_logprobs, engine=None, columns=None, examples=()):  # fmt: skip
    """Sample rloo_k completions of each prompt and score them; the logprobs of the policy (sampling's, or the
    training forward pass's with `recompute_old_logprobs`) and of the reference. `columns`, `examples`: the
    dataset's columns and the P prompts' rows in it, for a TRL-style reward function. Returns a dict of [B, ...]."""
    responses, lengths, response_mask, logprobs = sample(
        args, accelerator, policy, queries, query_mask, args.rloo_k, (update,), first_prompt, stop_token_id,
        pad_id, engine,
    )  # fmt: skip
    chunk, Q, T = args.local_rollout_forward_batch_size, queries.size(1), args.temperature
    rows_at = functools.partial(utils.query_response_rows, queries, query_mask, responses, response_mask)
    ref_logprobs, scores, recomputed = [], [], []
    for idx in torch.arange(responses.size(0), device=queries.device).split(chunk):
        query_responses, mask = rows_at(idx)
        ref_logprobs.append(utils.batched_response_logprobs(ref_policy, query_responses, mask, Q, T, chunk))
        if recompute_old_logprobs:  # the bare policy: the same forward as training, without DDP's hooks
            bare = utils.run.bare(policy)
            recomputed.append(utils.batched_response_logprobs(bare, query_responses, mask, Q, T, chunk))
        of_rows = utils.data.columns_of_rows(columns or {}, examples, idx)
        scores.append(scorer(query_responses, mask, Q, chunk, columns=of_rows))
    return dict(
        responses=responses, lengths=lengths, response_mask=response_mask, sampled_logprobs=logprobs,
        logprobs=torch.cat(recomputed) if recomputed else logprobs, ref_logprobs=torch.cat(ref_logprobs),
        scores=torch.cat(scores).float(),
    )  # fmt: skip


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
    reward_fn = utils.load_reward_fn(args.reward_fn) if args.reward_fn else None
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.check_columns(dataset, ["prompt"], f"--dataset_name {args.dataset_name}")
    # A TRL-style reward function (with **kwargs) gets every dataset column of its rows, e.g. a `solution`.
    columns = utils.data.columns(dataset) if reward_fn else {}
    if args.eval_steps is not None and args.eval_steps < 1:
        raise ValueError(f"--eval_steps must be at least 1, got {args.eval_steps}.")
    sample_prompts = None
    if args.dataset_test_split and args.num_sample_generations and args.eval_strategy == "steps":
        sample_prompts = utils.data.load_split(
            args.dataset_name, args.dataset_test_split, args.dataset_config
        )
        utils.check_columns(sample_prompts, ["prompt"], f"--dataset_test_split {args.dataset_test_split}")
        sample_prompts = sample_prompts.select(
            range(min(4, len(sample_prompts)))
        )  # rendered with the tokenizer
    sample_columns = utils.data.columns(sample_prompts) if reward_fn and sample_prompts is not None else {}
    fill_sizes(args, accelerator.num_processes, len(dataset))
    if args.eval_strategy == "no":
        args.num_sample_generations = 0
    elif args.eval_steps:
        args.num_sample_generations = max(1, args.num_total_batches // args.eval_steps)
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    utils.check_output_dir(args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint))
    ckpt = utils.checkpoint.Checkpointer(accelerator, args)  # checks the resume path; takes its run name
    recompute_old_logprobs = args.recompute_old_logprobs == "true" or (
        args.recompute_old_logprobs == "auto" and accelerator.mixed_precision == "bf16"
    )
    set_seed(args.seed)
    device, rank, k = accelerator.device, accelerator.process_index, args.rloo_k

    # 2. Tokenizer and prompts: --model_name_or_path gives the tokenizer; --sft_model_path, when given, the weights.
    policy_path, policy_flag = (
        (args.sft_model_path, "--sft_model_path") if args.sft_model_path else
        (args.model_name_or_path, "--model_name_or_path")
    )  # fmt: skip
    tokenizer_path, tokenizer_flag = (
        (args.model_name_or_path, "--model_name_or_path") if args.model_name_or_path else (policy_path, policy_flag)
    )  # fmt: skip
    tokenizer = utils.load_tokenizer(tokenizer_path, tokenizer_flag, args.chat_template_path)
    prompt_texts = utils.data.prompt_texts(dataset, tokenizer, f"--dataset_name {args.dataset_name}")
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    stop_token_id = eos_id if args.stop_token == "eos" else args.stop_token_id
    prompt_ids = utils.tokenize_prompts(tokenizer, prompt_texts, args.max_prompt_length)
    if sample_prompts is not None:
        sample_texts = utils.data.prompt_texts(sample_prompts, tokenizer, "--dataset_test_split")
        sample_prompts = utils.tokenize_prompts(tokenizer, sample_texts, args.max_prompt_length)

    # 3. Models: the policy, its frozen copy as reference, the reward model; dropout off in all of them, so the
    # logprobs of the training forward pass equal those of sampling. Frozen models run in the policy's precision.
    policy = utils.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    ref_policy = utils.from_pretrained(AutoModelForCausalLM, policy_path, policy_flag)
    reward_model = utils.load_reward_model(args.reward_model_path) if args.reward_model_path else None
    for model in (policy, ref_policy):
        utils.disable_dropout(model)
    if args.gradient_checkpointing:
        utils.enable_gradient_checkpointing(policy)
    optimizer = utils.run.adamw(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    ref_policy = utils.run.prepare_frozen(ref_policy, accelerator)
    max_model_len = max(map(len, prompt_ids)) + args.response_length
    engine = utils.vllm.Engine(args, accelerator, policy_path, max_model_len) if args.use_vllm else None
    reward_model = utils.run.prepare_frozen(reward_model, accelerator) if reward_model is not None else None
    # Scores: the reward model reads the policy's ids, or its own tokenizer's encoding of the decoded text.
    reward_tokenizer = utils.scoring.load_reward_tokenizer(args.reward_tokenizer_path, args.reward_model_path)
    scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
    accelerator.print(scorer.describe())

    # 4. State of the run: the prompt order is the same on every process; sampling noise is keyed by update and
    # prompt (sampling_generator); the shuffling generator, weights and optimizer come back from a checkpoint.
    shuffle_generator = torch.Generator().manual_seed(args.seed + rank)
    checkpointed = dict(models={"policy": policy}, optimizers={"policy": optimizer},
                        generators={"shuffle": shuffle_generator})  # fmt: skip
    state = ckpt.resume(**checkpointed) or {"step": 0}
    start = state["step"]
    batches = utils.prompt_batches(
        len(prompt_ids), args.local_dataloader_batch_size, args.world_size, rank, args.seed
    )
    for _ in range(state.get("prompt_batches", 0)):  # the data order continues where the checkpoint left it
        next(batches)
    tracker = utils.tracking.Tracker(args, accelerator, start_step=start)
    chunk, T = args.local_rollout_forward_batch_size, args.temperature
    B, P = args.local_batch_size, args.local_dataloader_batch_size

    def global_whiten(values, mask, shift_mean=True):
        """masked_whiten with the statistics of every process's completions, so N processes whiten as 1 does;
        zero where mask is 0."""
        all_values, all_masks = accelerator.gather(values), accelerator.gather(mask.long())
        whitened = utils.masked_whiten(all_values, all_masks, shift_mean)
        return whitened[rank * B : (rank + 1) * B] * mask

    def gathered_mean(values):
        return accelerator.gather(values.float()).mean().item()

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
        queries, query_mask = utils.left_pad([prompt_ids[i] for i in examples], pad_id, device)
        context_length = queries.size(1)
        with accelerator.autocast():
            data = rollout(
                args, accelerator, policy, ref_policy, scorer, queries, query_mask, update, rank * P,
                stop_token_id, pad_id, recompute_old_logprobs, engine,
                columns, examples,
            )  # fmt: skip
        responses, lengths, response_mask = data["responses"], data["lengths"], data["response_mask"]
        old_logprobs, scores = data["logprobs"], data["scores"]
        utils.tracking.check_finite(update, accelerator, scores=scores)
        rows_at = functools.partial(utils.query_response_rows, queries, query_mask, responses, response_mask)
        has_eos = ((responses == eos_id) & response_mask).any(1)
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~has_eos).float()

        # 6. Rewards and leave-one-out advantages; batch statistics over every process's completions.
        kl = (old_logprobs - data["ref_logprobs"]) * response_mask  # k1 estimator per token
        shaped_scores = scores
        if args.normalize_reward:
            all_scores = normalize_scores(accelerator.gather(scores), args.reward_clip_range)
            shaped_scores = all_scores[rank * B : (rank + 1) * B]
        non_score_reward = -args.kl_coef * kl.sum(1)
        rlhf_reward = shaped_scores + non_score_reward
        if args.token_level_kl:  # every token is an action
            rewards = token_level_rewards(shaped_scores, kl, lengths, args.kl_coef)
            action_mask = response_mask
        else:  # the whole completion is one action
            rewards = sequence_level_rewards(shaped_scores, kl, response_mask, args.kl_coef)
            action_mask = torch.ones_like(rewards, dtype=torch.bool)
        if args.whiten_rewards:
            rewards = global_whiten(rewards, action_mask, shift_mean=False)
        if args.token_level_kl:
            advantages = token_level_advantages(rewards, response_mask, k)
        else:
            advantages = rloo_advantages(rewards, k)
        if args.normalize_advantage:
            advantages = global_whiten(advantages, action_mask)

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
                    new_logprobs, entropy, _ = utils.response_logprobs(
                        policy, query_responses, attention_mask, context_length, T, with_stats=True
                    )
                    loss, ratio, clipfrac, approxkl = policy_loss(
                        new_logprobs, old_logprobs[idx], advantages[idx], response_mask[idx], args.cliprange
                    )
                    accelerator.backward(loss)
                    measured = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                    if accelerator.sync_gradients:
                        grad_norms.append(utils.run.grad_norm_after_step(policy, measured))
                with torch.no_grad():
                    entropy = utils.masked_mean(entropy, response_mask[idx])
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
            if not scorer.same_tokenizer:  # rows re-encoded for the reward model and cut to its length
                truncated = torch.tensor(scorer.take_num_truncated(), device=device)
                metrics["val/num_reward_truncated"] = accelerator.reduce(truncated, reduction="sum").item()
        tracker.log(metrics, update)

        # Sample table: completions of held-out prompts (--dataset_test_split; the same noise every time), or
        # else the first completions of this rollout. Every process samples (ZeRO-3 gathers), the main one prints.
        if args.num_sample_generations and (update % sample_every == 0 or update == 1):
            shown, table_scores = torch.arange(min(P, 4), device=device), scores
            if sample_prompts is not None:
                queries, query_mask = utils.left_pad(sample_prompts, pad_id, device)
                shown = torch.arange(queries.size(0), device=device)
                with accelerator.autocast():
                    responses, _, response_mask, _ = sample(
                        args, accelerator, policy, queries, query_mask, 1, (0,), 0, stop_token_id, pad_id
                    )
                    query_responses, mask = utils.query_response_rows(
                        queries, query_mask, responses, response_mask, shown
                    )
                    table_scores = scorer(
                        query_responses, mask, queries.size(1), chunk, columns=sample_columns
                    )
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
