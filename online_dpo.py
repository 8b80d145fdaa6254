"""Online DPO for language models, in one file.

Guo et al., "Direct Language Model Alignment from Online AI Feedback" (2024), https://arxiv.org/abs/2402.04792;
the loss is DPO's (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) or one of its variants.

Offline DPO learns from pairs that another model wrote. Online DPO makes its pairs as it trains: for each prompt
the current policy samples two completions at `--temperature`, an annotator says which one is better, and one
DPO step on that fresh pair pulls the policy toward the better completion and away from the other, relative to
a frozen reference model (the starting policy). The annotator is a reward model (`--reward_model_path`: the
completion with the higher score is chosen), a reward function (`--reward_fn`), or a pairwise judge (`--judge`:
a Python function, or an OpenAI-compatible endpoint). Equal scores make the first completion 'chosen', as TRL
does (`--drop_ties` leaves such pairs out instead); a judge's tie or missing verdict is always left out; both are
counted (`val/num_ties`). As in TRL, the loss reads the logprobs of the plain logits (the policy at temperature 1)
on completions sampled at `--temperature`, and each prompt is cut from the left so that prompt + completion fit
`--max_length` in those forward passes.

Batch layout, completion-major as in rloo.py: the 2 * P completions of one update are rows `c * P + p`
(completion c in {0, 1} of prompt p); prompts are stored once ([P, Q]) and the rows are built at forward time.
One update samples, annotates, and takes exactly one optimizer step, so the training forward pass runs on the
weights that sampled: with `--logprobs_at_temperature` (or `--temperature 1`) its logprobs equal the sampling
ones (`val/logprob_gap`, 0 up to float rounding unless `--max_length` cut a prompt).

    python online_dpo.py --model_name_or_path models/sft --reward_model_path models/reward \
        --dataset_name data/tldr/prompts --learning_rate 5e-7 --per_device_train_batch_size 8 \
        --gradient_accumulation_steps 16 --warmup_ratio 0.1 --missing_eos_penalty 1.0 --max_new_tokens 53 \
        --output_dir models/online_dpo
"""

import concurrent.futures
import functools
import importlib.util
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro

import utils
import utils.data
import utils.scoring
from utils.checkpoint import Checkpointer
from utils.run import (
    clip_grad_norm,
    gathered_for_generation,
    grad_norm_after_step,
    make_accelerator,
    prepare_frozen,
    run_cli,
)
from utils.tracking import Tracker, check_finite


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (model init is the checkpoint's; this seeds sampling and the prompt order)"""
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
    output_dir: str = "models/online_dpo"
    """where the trained policy (weights, tokenizer, model card) is saved"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir: its contents are moved aside to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (without its checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """save a checkpoint (policy, optimizer, RNG states) every this many updates (0: only on SIGTERM)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint folder to continue from, or 'latest' for the newest one in --output_dir"""

    # Models and data
    model_name_or_path: str | None = None
    """the policy to start from (usually the SFT model) and its tokenizer; also the frozen reference model"""
    reward_model_path: Annotated[str | None, tyro.conf.arg(aliases=("--reward_model_name_or_path",))] = None
    """sequence classifier (one label) scoring each completion; or use --reward_fn or --judge"""
    reward_tokenizer_path: str | None = None
    """the reward model's own tokenizer when it differs from the policy's (None: the reward model's directory)"""
    reward_fn: Annotated[str | None, tyro.conf.arg(aliases=("--reward_funcs",))] = None
    """path/to/file.py:function or module.function, returning one float per completion: called as function(prompts, completions) on
    texts, or, when it takes **kwargs, as TRL calls it (keywords prompts, completions and every dataset column)"""
    judge: str | None = None
    """pairwise judge: path/to/file.py:function called as function(prompts, pairs) -> for each (a, b) pair 0 (a
    better), 1 (b better) or -1 (tie); or 'openai' for an OpenAI-compatible endpoint (--judge_base_url)"""
    judge_base_url: str = "https://api.openai.com/v1"
    """with --judge openai: the API root; requests go to {judge_base_url}/chat/completions"""
    judge_model: str = "gpt-4o-mini"
    """with --judge openai: the judge model's name"""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """with --judge openai: the environment variable holding the API key (unset: no Authorization header)"""
    dataset_name: str = "trl-lib/tldr"
    """prompts (a `prompt` column, text or conversational): hub id, save_to_disk dir, jsonl/parquet files"""
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

    # Sampling
    max_new_tokens: int = 64
    """tokens sampled per completion (then truncated after the EOS token)"""
    temperature: float = 0.9
    """sampling temperature (the loss's logprobs are of the plain logits, as TRL's; see --logprobs_at_temperature)"""
    logprobs_at_temperature: bool = False
    """ours, off by default: the loss's logprobs of policy and reference are those of logits / --temperature, the
    distribution that sampled (the pairs are then on-policy and val/logprob_gap checks it); off: the plain logits"""
    max_length: int | None = 512
    """longest prompt + completion in the logprob forward passes (TRL's): a prompt keeps its last max_length - W
    tokens, W the longest completion of its micro-batch (sampling and scoring see it whole); None: no limit"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of completions without an EOS token (reward model or function only)"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / reference / reward forward pass"""

    # Algorithm
    num_train_epochs: float = 1.0
    """passes over the prompts (each pass reshuffles them)"""
    max_steps: int | None = None
    """number of updates (optimizer steps); overrides --num_train_epochs"""
    learning_rate: float = 5e-7
    """AdamW learning rate"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """'linear' decays the learning rate to 0 over the updates (after the warmup)"""
    warmup_ratio: float = 0.0
    """fraction of the updates over which the learning rate rises linearly from 0"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (0: no clipping)"""
    per_device_train_batch_size: int = 8
    """prompts (pairs) per forward/backward pass per process; each pass holds 2x as many completions"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    beta: list[float] = field(default_factory=lambda: [0.1])
    """strength of the pull toward the reference (IPO's tau); several values: one per epoch, the last kept"""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """'sigmoid' (DPO), 'ipo' (log-ratios summed over tokens, as TRL's online DPO), or 'hinge' (SLiC, margin 1/beta)"""
    drop_ties: bool = False
    """ours, off by default: leave pairs with equal scores out of the loss; off: the first completion is 'chosen'
    (TRL's rule; a judge's ties are always left out)"""

    # Logging
    num_sample_generations: int = 10
    """print a table of sample completions at the first update and this many times more (0: never)"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes (filled in at runtime)"""
    local_batch_size: int = 0
    """prompts per process per update = per_device_train_batch_size * gradient_accumulation_steps (runtime)"""
    batch_size: int = 0
    """prompts (pairs) per update over all processes = local_batch_size * world_size (filled in at runtime)"""
    num_total_batches: int = 0
    """number of updates (filled in at runtime)"""


# ----------------------------------------------------------------------------------------------------------------
# The math (pure functions; P prompts, 2 * P completions in completion-major order, R response tokens)
# ----------------------------------------------------------------------------------------------------------------
def verdicts_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Which completion of each prompt is better: scores [2P] completion-major -> verdicts [P], 0 when completion 0
    scores higher, 1 when completion 1 does, -1 for a tie."""
    first, second = scores.view(2, -1)
    verdicts = (second > first).long()
    return verdicts.masked_fill(first == second, -1)


def pairs_from_verdicts(
    verdicts: torch.Tensor, drop_ties: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of the chosen and rejected completion of each prompt and which pairs count: verdicts [P] in {0, 1, -1}
    -> (chosen_rows [P], rejected_rows [P], kept [P] bool). Completion c of prompt p is row c * P + p. A tie (-1)
    keeps completion 0 as 'chosen' (TRL's rule: chosen when its score is >= the other's) and counts unless
    `drop_ties`."""
    num_prompts = verdicts.size(0)
    prompt = torch.arange(num_prompts, device=verdicts.device)
    second_wins = verdicts == 1
    chosen = torch.where(second_wins, prompt + num_prompts, prompt)
    rejected = torch.where(second_wins, prompt, prompt + num_prompts)
    return chosen, rejected, (verdicts >= 0) | (not drop_ties)


def nan_as_zero(scores: torch.Tensor) -> torch.Tensor:
    """A reward function's None (NaN) counts as 0 [B]: TRL sums its reward functions with nansum; infinities stay."""
    return torch.where(scores.isnan(), torch.zeros_like(scores), scores)


def prompt_mask_within(
    query_mask: torch.Tensor, lengths: torch.Tensor, max_length: int | None, micro_batch: int
) -> torch.Tensor:
    """TRL's max_length in the logprob forward passes: the prompts [P, Q] (left-padded, mask bool) of micro-batch m
    keep their last max_length - W_m tokens, W_m = the longest of the completions (lengths [2P], completion-major)
    of its `micro_batch` prompts. TRL drops the left columns of each micro-batch's prompt + completion tensor (W_m
    wide) until it is max_length wide: the same tokens. Returns the forward passes' prompt mask [P, Q]."""
    if max_length is None:
        return query_mask
    num_prompts, width = query_mask.shape
    longest = torch.maximum(lengths[:num_prompts], lengths[num_prompts:])
    widest = torch.cat([part.max().expand(part.numel()) for part in longest.split(micro_batch)])
    keep = (max_length - widest).clamp(min=0)
    column = torch.arange(width, device=query_mask.device)
    return query_mask & (column[None, :] >= width - keep[:, None])


def sigmoid_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta * h), h = (logp_c - ref_c) - (logp_r - ref_r) [P]."""
    return -F.logsigmoid(beta * h)


def ipo_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023): (h - 1 / (2 * tau))^2 with tau = beta [P]; h from log-ratios summed over each
    completion's tokens, as TRL's online DPO (its offline DPO averages them over the tokens)."""
    return (h - 1 / (2 * beta)) ** 2


def hinge_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC-HF (Zhao et al. 2023) calibration loss on reference-corrected log-ratios: relu(1 - beta * h) [P]."""
    return torch.relu(1 - beta * h)


def online_dpo_loss(logp_c, logp_r, ref_c, ref_r, beta: float, loss_type: str):
    """Per-pair losses [P] and implicit rewards beta * log(pi / pi_ref) [P] of the chosen and rejected completions.

    logp_* and ref_* [P] are a completion's logprob summed over its tokens under the policy and the reference;
    h = (logp_c - ref_c) - (logp_r - ref_r) for every loss type."""
    ratio_c, ratio_r = logp_c - ref_c, logp_r - ref_r
    h = ratio_c - ratio_r
    if loss_type == "sigmoid":
        losses = sigmoid_loss(h, beta)
    elif loss_type == "ipo":
        losses = ipo_loss(h, beta)
    elif loss_type == "hinge":
        losses = hinge_loss(h, beta)
    else:
        raise ValueError(f"unknown --loss_type {loss_type!r}; use sigmoid, ipo or hinge.")
    return losses, beta * ratio_c.detach(), beta * ratio_r.detach()


def beta_for_epoch(betas: list[float], epoch: int) -> float:
    """The beta of epoch `epoch` (0-based): betas[epoch], the last one once the list runs out (TRL's rule)."""
    return betas[min(epoch, len(betas) - 1)]


def learning_rate_at(update: int, num_updates: int, base: float, schedule: str, warmup_updates: int) -> float:
    """Learning rate of update `update` (1-based): a linear rise over `warmup_updates`, then constant or a linear
    decay that would reach 0 after the last update."""
    if update <= warmup_updates:
        return base * update / warmup_updates
    if schedule == "constant":
        return base
    return base * (1 - (update - 1 - warmup_updates) / max(1, num_updates - warmup_updates))


def pair_losses(policy, query_responses, attention_mask, context_length: int, response_mask, ref_logprobs,
                beta: float, loss_type: str, temperature: float):  # fmt: skip
    """The loss of a micro-batch of n pairs: rows [2n, T] hold the n chosen completions, then their n rejected
    ones. The policy's logprobs of the response tokens under logits / temperature (1: the plain logits, TRL's),
    summed over response_mask [2n, R], against the reference's ref_logprobs [2n, R] summed likewise. Returns
    (losses [n], implicit rewards of the chosen and of the rejected [n], summed logprobs [2n], logprobs [2n, R])."""
    logprobs = utils.response_logprobs(policy, query_responses, attention_mask, context_length, temperature)
    logps, ref_logps = (logprobs * response_mask).sum(1), (ref_logprobs * response_mask).sum(1)
    n = logps.size(0) // 2
    losses, reward_c, reward_r = online_dpo_loss(
        logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], beta, loss_type
    )
    return losses, reward_c, reward_r, logps, logprobs


def mean_over_processes(accelerator, logged: dict[str, float]) -> dict[str, float]:
    """The mean of each value a reward function logged, over the processes that logged it."""
    from accelerate.utils import gather_object

    every = gather_object([logged]) if accelerator.num_processes > 1 else [logged]
    names = sorted({name for one in every for name in one})
    return {name: sum(one[name] for one in every if name in one) / sum(name in one for one in every)
            for name in names}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Judges: which of two completions of a prompt is better
# ----------------------------------------------------------------------------------------------------------------
def load_function(spec: str, flag: str) -> Callable:
    """The function named by `path/to/file.py:function`; a one-sentence ValueError otherwise."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"{flag} must look like path/to/file.py:function (or 'openai'), got {spec!r}.")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} file {path} does not exist.")
    module_spec = importlib.util.spec_from_file_location("online_dpo_judge_module", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{flag} file {path} defines no function named {name!r}.")
    return getattr(module, name)


def call_judge(judge: Callable, prompts: list[str], pairs: list[tuple[str, str]]) -> torch.Tensor:
    """Ask a pairwise judge and check its answer: one verdict in {0, 1, -1} per pair. Returns [P] long."""
    verdicts = [int(v) for v in judge(prompts, pairs)]
    if len(verdicts) != len(pairs):
        raise ValueError(f"the judge returned {len(verdicts)} verdicts for {len(pairs)} pairs.")
    if any(v not in (0, 1, -1) for v in verdicts):
        raise ValueError(
            "the judge must answer 0 (first better), 1 (second better) or -1 (tie) for each pair."
        )
    return torch.tensor(verdicts, dtype=torch.long)


def openai_judge(args: Args, seed: int) -> Callable:
    """A pairwise judge on an OpenAI-compatible endpoint, through the client of benchmark/judge_tldr.py (its
    prompt, retries and strict `Preferred: A|B` parsing). Each pair is shown in a seeded random order, so the
    judge's position bias does not become the policy's; an unparseable answer or a failed request is a tie."""
    client_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark")
    if not os.path.isfile(os.path.join(client_dir, "judge_tldr.py")):
        raise ValueError(f"--judge openai needs benchmark/judge_tldr.py next to this script ({client_dir}).")
    if client_dir not in sys.path:
        sys.path.insert(0, client_dir)
    import judge_tldr

    client = judge_tldr.Args(
        input_jsonl="",
        base_url=args.judge_base_url,
        model=args.judge_model,
        api_key_env=args.judge_api_key_env,
    )
    api_key = os.environ.get(args.judge_api_key_env) or None
    order = random.Random(seed)

    def ask(prompt: str, first: str, second: str, swap: bool) -> int:
        shown = (second, first) if swap else (first, second)
        try:
            answer, _ = judge_tldr.call_with_retries(
                lambda: judge_tldr.chat_completion(client, api_key, judge_tldr.judge_prompt(prompt, *shown)),
                client.max_retries, client.initial_backoff, client.max_backoff,
            )  # fmt: skip
        except judge_tldr.RetryableError:
            return -1
        verdict = judge_tldr.parse_verdict(answer)
        if verdict is None:
            return -1
        return int((verdict == "B") != swap)

    def judge(prompts: list[str], pairs: list[tuple[str, str]]) -> list[int]:
        swaps = [order.random() < 0.5 for _ in pairs]
        with concurrent.futures.ThreadPoolExecutor(client.num_threads) as pool:
            return list(pool.map(ask, prompts, [a for a, _ in pairs], [b for _, b in pairs], swaps))

    return judge


# ----------------------------------------------------------------------------------------------------------------
# Checks and sizes
# ----------------------------------------------------------------------------------------------------------------
def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Check the flags and compute the derived batch sizes; ValueError with one sentence on a bad value."""
    annotators = [args.reward_model_path, args.reward_fn, args.judge]
    if sum(a is not None for a in annotators) != 1:
        raise ValueError("pass exactly one of --reward_model_path, --reward_fn and --judge.")
    if args.model_name_or_path is None:
        raise ValueError("pass the policy to train with --model_name_or_path.")
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_new_tokens",
                 "local_rollout_forward_batch_size"):  # fmt: skip
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.temperature <= 0:
        raise ValueError(
            f"--temperature must be positive (online DPO samples its pairs), got {args.temperature}."
        )
    if not args.beta or any(b <= 0 for b in args.beta):
        raise ValueError(f"--beta must be one or more positive values, got {args.beta}.")
    if not 0 <= args.warmup_ratio < 1:
        raise ValueError(f"--warmup_ratio must be in [0, 1), got {args.warmup_ratio}.")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max_steps must be at least 1, got {args.max_steps}.")
    if args.max_steps is None and args.num_train_epochs <= 0:
        raise ValueError(f"--num_train_epochs must be positive, got {args.num_train_epochs}.")
    if args.reward_tokenizer_path is not None and args.reward_model_path is None:
        raise ValueError(
            "--reward_tokenizer_path is the reward model's tokenizer; pass --reward_model_path too."
        )
    if args.max_length is not None and args.max_length <= args.max_new_tokens:
        raise ValueError(
            f"--max_length {args.max_length} must exceed --max_new_tokens {args.max_new_tokens}, or no prompt "
            "token would be left in the logprob forward passes."
        )
    if args.missing_eos_penalty is not None and args.judge is not None:
        raise ValueError(
            "--missing_eos_penalty changes scores; a --judge gives none, so leave the penalty out."
        )
    args.world_size = world_size
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * world_size
    if num_prompts is not None:
        if num_prompts < args.batch_size:
            raise ValueError(
                f"the dataset has {num_prompts} prompts, fewer than the {args.batch_size} of one update; "
                "lower --per_device_train_batch_size or --gradient_accumulation_steps, or use a larger split."
            )
        updates_per_epoch = num_prompts // args.batch_size
        args.num_total_batches = args.max_steps or max(
            1, math.ceil(args.num_train_epochs * updates_per_epoch)
        )
    return args


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
def main(args: Args) -> None:
    from accelerate.utils import set_seed
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    # 1. Flags, accelerator and data: everything that can be checked before loading a model.
    fill_sizes(args, world_size=1)
    accelerator = make_accelerator(
        args, gradient_accumulation_steps=args.gradient_accumulation_steps,
        micro_batch_size=2 * args.per_device_train_batch_size,
    )  # fmt: skip
    fill_sizes(args, accelerator.num_processes)
    if args.resume_from_checkpoint is None:
        utils.check_output_dir(args.output_dir, args.overwrite_output_dir)
    ckpt = Checkpointer(accelerator, args)  # checks --resume_from_checkpoint and takes its run name
    reward_fn = utils.load_reward_fn(args.reward_fn) if args.reward_fn else None
    judge = None
    if args.judge == "openai":
        judge = openai_judge(args, args.seed + accelerator.process_index)
    elif args.judge is not None:
        judge = load_function(args.judge, "--judge")
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.check_columns(dataset, ["prompt"], f"--dataset_name {args.dataset_name}")
    # A TRL-style reward function (with **kwargs) gets every dataset column of its rows, e.g. a `solution`.
    columns = utils.data.columns(dataset) if reward_fn else {}
    raw_prompts = utils.data.column(dataset, "prompt")  # what the reward sees as each row's prompt, as in TRL
    sample_dataset = None
    if args.dataset_test_split and args.num_sample_generations:
        sample_dataset = utils.data.load_split(
            args.dataset_name, args.dataset_test_split, args.dataset_config
        )
        utils.check_columns(sample_dataset, ["prompt"], f"--dataset_test_split {args.dataset_test_split}")
        sample_dataset = sample_dataset.select(range(min(4, len(sample_dataset))))
    fill_sizes(args, accelerator.num_processes, len(dataset))
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    set_seed(args.seed)
    device, rank = accelerator.device, accelerator.process_index

    # 2. The prompts as text (conversations rendered with the chat template and the assistant's opening), tokenized.
    tokenizer = utils.load_tokenizer(args.model_name_or_path, "--model_name_or_path", args.chat_template_path)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    where = f"--dataset_name {args.dataset_name}"
    prompt_ids = utils.tokenize_prompts(
        tokenizer, utils.data.prompt_texts(dataset, tokenizer, where), args.max_prompt_length
    )
    sample_prompts = None
    if sample_dataset is not None:
        texts = utils.data.prompt_texts(
            sample_dataset, tokenizer, f"--dataset_test_split {args.dataset_test_split}"
        )
        sample_prompts = utils.tokenize_prompts(tokenizer, texts, args.max_prompt_length)

    # 3. Models: the policy, its frozen copy as reference, the reward model; dropout off in all of them, so the
    # logprobs of the training forward pass equal those of sampling.
    policy = utils.from_pretrained(AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path")
    ref_policy = utils.from_pretrained(AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path")
    reward_model = utils.load_reward_model(args.reward_model_path) if args.reward_model_path else None
    for model in (policy, ref_policy):
        utils.disable_dropout(model)
    if args.gradient_checkpointing:
        utils.enable_gradient_checkpointing(policy)
    optimizer = utils.run.adamw(policy.parameters(), lr=args.learning_rate, weight_decay=0.0)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    ref_policy = prepare_frozen(ref_policy, accelerator)
    if reward_model is not None:
        reward_model = prepare_frozen(reward_model, accelerator)
    scorer = None
    if judge is None:  # the reward model reads the policy's ids, or its own tokenizer's encoding of the text
        reward_tokenizer = utils.scoring.load_reward_tokenizer(
            args.reward_tokenizer_path, args.reward_model_path
        )
        scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
        accelerator.print(scorer.describe())

    # 4. State of the run: resume (policy, optimizer, RNG streams, update counter), then logging.
    sampling_generator = torch.Generator(device=device).manual_seed(args.seed + rank)
    state = ckpt.resume(models={"policy": policy}, optimizers={"policy": optimizer},
                        generators={"sampling": sampling_generator})  # fmt: skip
    start_update = state["step"] if state else 0
    tracker = Tracker(args, accelerator, start_update)

    chunk, R, T = args.local_rollout_forward_batch_size, args.max_new_tokens, args.temperature
    P, micro = args.local_batch_size, args.per_device_train_batch_size
    logprob_temperature = T if args.logprobs_at_temperature else 1.0
    warmup_updates = math.ceil(args.warmup_ratio * args.num_total_batches)

    def sample(queries, query_mask, prompt_of_row, generator):
        """Sample a completion for each row (prompt index prompt_of_row[i]), repeating the prompts only chunk by
        chunk; truncate after EOS. Returns (responses, lengths, response mask, logprobs) [n, R]."""
        responses, logprobs = [], []
        policy.eval()  # dropout is off anyway; eval keeps the KV cache on under gradient checkpointing
        with torch.no_grad(), gathered_for_generation(policy, accelerator) as sampler:
            for rows in prompt_of_row.split(chunk):
                query_responses, chunk_logprobs = utils.generate(
                    sampler, queries[rows], query_mask[rows], R, T, chunk, generator
                )
                responses.append(query_responses[:, queries.size(1) :])
                logprobs.append(chunk_logprobs)
        responses, lengths = utils.truncate_response(torch.cat(responses), eos_id, pad_id)
        return responses, lengths, utils.lengths_to_mask(lengths, R), torch.cat(logprobs)

    def decode_rows(ids, mask):
        return [tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(ids, mask)]

    def gathered_mean(values):
        values = accelerator.gather(values.float().reshape(-1))
        return values.mean().item() if values.numel() else float("nan")

    # The prompt order is the same on every process, each taking its slice; a resumed run skips what was used.
    batches = utils.prompt_batches(len(prompt_ids), P, args.world_size, rank, args.seed)
    for _ in range(start_update):
        next(batches)
    updates_per_epoch = len(prompt_ids) // args.batch_size
    sample_every = max(1, args.num_total_batches // max(1, args.num_sample_generations))
    start_time, metrics = time.time(), {}
    progress = tqdm(
        range(start_update + 1, args.num_total_batches + 1), disable=not accelerator.is_main_process
    )
    for update in progress:
        lr = learning_rate_at(
            update, args.num_total_batches, args.learning_rate, args.lr_scheduler_type, warmup_updates
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        beta = beta_for_epoch(args.beta, (update - 1) // updates_per_epoch)
        trainer_state = utils.scoring.TrainerState(
            global_step=update - 1, max_steps=args.num_total_batches, epoch=(update - 1) / updates_per_epoch
        )

        # 5. Rollout: P prompts stored once [P, Q], two completions each in completion-major order (row i <-
        # prompt i % P), truncated after EOS; reference logprobs of the truncated rows (prompts cut to
        # --max_length), at the loss's temperature.
        examples = next(batches)  # dataset indices of this process's P prompts
        queries, query_mask = utils.left_pad([prompt_ids[i] for i in examples], pad_id, device)
        context_length = queries.size(1)
        rows = torch.arange(2 * P, device=device)
        responses, lengths, response_mask, sampled_logprobs = sample(
            queries, query_mask, rows % P, sampling_generator
        )
        rows_at = functools.partial(utils.query_response_rows, queries, query_mask, responses, response_mask)
        forward_mask = prompt_mask_within(query_mask, lengths, args.max_length, micro)
        first = int(forward_mask.any(0).long().argmax())  # columns no prompt keeps are left out
        forward_rows_at = functools.partial(utils.query_response_rows, queries[:, first:],
                                            forward_mask[:, first:], responses, response_mask)  # fmt: skip
        forward_context = context_length - first
        ref_logprobs, scores = [], []
        with torch.no_grad(), accelerator.autocast():  # the policy's precision, so the KL starts at 0 in bf16
            for idx in rows.split(chunk):
                ref_logprobs.append(utils.batched_response_logprobs(
                    ref_policy, *forward_rows_at(idx), forward_context, logprob_temperature, chunk
                ))  # fmt: skip
                if scorer is not None:
                    of_rows = utils.data.columns_of_rows(columns, examples, idx)
                    prompts = [raw_prompts[examples[r % P]] for r in idx.tolist()]
                    scores.append(scorer(*rows_at(idx), context_length, chunk, prompts=prompts, columns=of_rows,
                                         trainer_state=trainer_state))  # fmt: skip
        ref_logprobs = torch.cat(ref_logprobs)
        has_eos = ((responses == eos_id) & response_mask).any(1)

        # 6. Annotation: the better completion of each prompt is 'chosen'; a tie of scores keeps the first (TRL),
        # or is skipped with --drop_ties; a judge's tie is skipped.
        if judge is None:
            scores = torch.cat(scores).float()
            if reward_fn is not None:
                scores = nan_as_zero(scores)
            check_finite(update, accelerator, scores=scores)
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~has_eos).float()
            verdicts = verdicts_from_scores(scores)
        else:
            prompts = decode_rows(queries, query_mask)
            completions = decode_rows(responses, response_mask)
            verdicts = call_judge(judge, prompts, list(zip(completions[:P], completions[P:]))).to(device)
        chosen_rows, rejected_rows, kept = pairs_from_verdicts(verdicts, args.drop_ties or judge is not None)
        num_kept = accelerator.reduce(kept.sum(), reduction="sum").item()

        # 7. One DPO step on the fresh pairs: micro-batches of pairs (chosen and rejected rows in one forward),
        # the loss summed over kept pairs and divided by their number over every process, so it is the mean over
        # the update's kept pairs whatever the split (accelerate divides by the accumulation steps, DDP averages).
        policy.train()
        loss_scale = args.gradient_accumulation_steps * args.world_size / max(1, num_kept)
        sums = torch.zeros(7, device=device)  # loss, rewards c/r, accuracy, logps c/r, over kept pairs
        gap, measured = torch.zeros((), device=device), None
        policy_logprobs = torch.zeros_like(ref_logprobs)
        for pair_idx in torch.arange(P, device=device).split(micro):
            with accelerator.accumulate(policy):
                idx = torch.cat([chosen_rows[pair_idx], rejected_rows[pair_idx]])
                mask = response_mask[idx]
                losses, reward_c, reward_r, logps, new_logprobs = pair_losses(
                    policy, *forward_rows_at(idx), forward_context, mask, ref_logprobs[idx], beta,
                    args.loss_type, logprob_temperature,
                )  # fmt: skip
                weight = kept[pair_idx].float()
                accelerator.backward((losses * weight).sum() * loss_scale)
                if accelerator.sync_gradients and num_kept > 0:
                    measured = clip_grad_norm(accelerator, policy, args.max_grad_norm)
                if num_kept > 0:  # an update of ties only takes no step (Adam's momentum would still move)
                    optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                n = len(pair_idx)
                policy_logprobs[idx] = new_logprobs.detach().to(policy_logprobs.dtype)
                gap = torch.maximum(gap, ((new_logprobs - sampled_logprobs[idx]).abs() * mask).max())
                sums += torch.stack([
                    (losses.detach() * weight).sum(), (reward_c * weight).sum(), (reward_r * weight).sum(),
                    ((reward_c > reward_r).float() * weight).sum(), (logps[:n].detach() * weight).sum(),
                    (logps[n:].detach() * weight).sum(), weight.sum(),
                ])  # fmt: skip

        # 8. Metrics, gathered over processes (pair statistics over the kept pairs; KL and entropy of the loss's
        # logprobs, as TRL's).
        with torch.no_grad():
            sums = accelerator.reduce(sums, reduction="sum")
            pair_means = (sums[:6] / sums[6].clamp(min=1)).tolist()
            kl = ((policy_logprobs - ref_logprobs) * response_mask).sum(1)  # k1 estimator per completion
            episode = update * args.batch_size * 2
            metrics = {
                "eps": int((episode - start_update * args.batch_size * 2) / (time.time() - start_time)),
                "objective/kl": gathered_mean(kl),
                "objective/entropy": gathered_mean((-policy_logprobs * response_mask).sum(1)),
                "objective/non_score_reward": -beta * gathered_mean(kl),
                "loss/dpo_avg": pair_means[0],
                "rewards/chosen": pair_means[1],
                "rewards/rejected": pair_means[2],
                "rewards/accuracies": pair_means[3],
                "rewards/margins": pair_means[1] - pair_means[2],
                "logps/chosen": pair_means[4],
                "logps/rejected": pair_means[5],
                "val/contain_eos_token": gathered_mean(has_eos),
                "val/num_ties": accelerator.reduce((verdicts < 0).sum(), reduction="sum").item(),
                "val/num_truncated_prompts": accelerator.reduce(
                    (forward_mask != query_mask).any(1).sum(), reduction="sum"
                ).item(),
                "beta": beta,
                "lr": lr,
                "episode": episode,
            }
            if logprob_temperature == T:  # the loss's logprobs are of the distribution that sampled
                metrics["val/logprob_gap"] = accelerator.reduce(gap, reduction="max").item()
            if judge is None:
                margins = (scores[chosen_rows] - scores[rejected_rows])[kept]
                metrics["objective/scores"] = gathered_mean(scores)
                metrics["objective/scores_margin"] = gathered_mean(margins)
                metrics["objective/rlhf_reward"] = (
                    metrics["objective/scores"] + metrics["objective/non_score_reward"]
                )
                metrics.update(mean_over_processes(accelerator, scorer.take_logged()))
            grad_norm = grad_norm_after_step(policy, measured) if num_kept > 0 else None
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
        check_finite(
            update, accelerator, loss=metrics["loss/dpo_avg"], kl=metrics["objective/kl"], grad_norm=grad_norm
        )
        tracker.log(metrics, update)

        # Sample table: completions of held-out prompts (--dataset_test_split; the same noise every time), or
        # else the first completions of this rollout. Every process samples (ZeRO-3 gathers), the main one prints.
        if args.num_sample_generations and (update % sample_every == 0 or update == 1):
            shown = torch.arange(min(P, 4), device=device)
            if sample_prompts is not None:
                queries, query_mask = utils.left_pad(sample_prompts, pad_id, device)
                shown = torch.arange(queries.size(0), device=device)
                noise = torch.Generator(device=device).manual_seed(args.seed)
                responses, _, response_mask, _ = sample(queries, query_mask, shown, noise)
            tracker.samples({
                "query": tokenizer.batch_decode(queries[shown], skip_special_tokens=True),
                "response": decode_rows(responses[shown], response_mask[shown]),
            }, title=f"update {update}")  # fmt: skip

        ckpt.maybe_save(update, models={"policy": policy}, optimizers={"policy": optimizer},
                        generators={"sampling": sampling_generator})  # fmt: skip

    # 9. Save the policy (every process takes part, so ZeRO-3 can gather its shards) and a model card.
    algorithm = f"online DPO (loss_type={args.loss_type}, beta={args.beta})"
    utils.saving.save_model(accelerator, policy, tokenizer, args, algorithm, args.model_name_or_path, metrics)
    tracker.close()
    utils.run.end_run(accelerator)


if __name__ == "__main__":
    run_cli(Args, main)
