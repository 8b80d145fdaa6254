"""Online DPO for language models, in one file.

Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", https://arxiv.org/abs/2402.04792;
the loss is DPO's (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) or one of its variants.

Online DPO makes its preference pairs as it trains: for each prompt the current policy samples two
completions at `--temperature`, an annotator picks the better one, and one DPO step on that fresh pair
pulls the policy toward it and away from the other, relative to a frozen reference (the starting policy).
The annotator is a reward model (`--reward_model_path`), a reward function (`--reward_fn`) or a pairwise
judge (`--judge`: a Python function or an OpenAI-compatible endpoint). As in TRL, equal scores make the
first completion 'chosen' (`--drop_ties` leaves them out; a judge's ties always are), the loss reads the
logprobs of the plain logits, and prompts are cut from the left to fit `--max_length` in those forwards.

Rows are completion-major as in rloo.py: completion c in {0, 1} of prompt p is row `c * P + p`; the
prompts are stored once ([P, Q]). One update takes exactly one optimizer step, on the weights that sampled.

    python online_dpo.py --model_name_or_path models/sft --reward_model_path models/reward \
        --dataset_name data/tldr/prompts --learning_rate 5e-7 --per_device_train_batch_size 8 \
        --gradient_accumulation_steps 16 --warmup_ratio 0.1 --missing_eos_penalty 1.0 --max_new_tokens 53 \
        --output_dir models/online_dpo
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro

import utils.chat
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
    """seed of sampling and the prompt order (model weights come from the checkpoint)"""
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
    output_dir: str = "models/online_dpo"
    """where the trained policy, its tokenizer and model card go"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir (moved to <output_dir>.replaced-<time>)"""
    push_to_hub: bool = False
    """push the policy (no checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """checkpoint every this many updates (0: only on SIGTERM)"""
    save_total_limit: int | None = None
    """keep only the newest this-many checkpoints (None: keep all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint folder, or 'latest' in --output_dir, to continue from"""

    # Models and data
    model_name_or_path: str | None = None
    """the starting policy (usually the SFT model) and its tokenizer; also the reference"""
    model_revision: str = "main"
    """revision (branch, tag or commit) of --model_name_or_path on the hub"""
    trust_remote_code: bool = False
    """let hub models and tokenizers run their own modelling code (every load)"""
    attn_implementation: str | None = None
    """attention of the trained model (and its reference): eager, sdpa, flash_attention_2...; None: the default"""
    reward_model_path: Annotated[str | None, tyro.conf.arg(aliases=("--reward_model_name_or_path",))] = None
    """sequence classifier (one label) scoring each completion; or --reward_fn or --judge"""
    reward_tokenizer_path: str | None = None
    """the reward model's own tokenizer if not the policy's (None: --reward_model_path's)"""
    reward_fn: Annotated[str | None, tyro.conf.arg(aliases=("--reward_funcs",))] = None
    """path/to/file.py:function or module.function: (prompts, completions[, **columns]) -> floats"""
    judge: str | None = None
    """path/to/file.py:function (prompts, pairs) -> 0, 1 or -1 (tie) per pair; or 'openai'"""
    judge_base_url: str = "https://api.openai.com/v1"
    """with --judge openai: the API root ({judge_base_url}/chat/completions)"""
    judge_model: str = "gpt-4o-mini"
    """with --judge openai: the judge model"""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """with --judge openai: the variable holding the API key (unset: none sent)"""
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
    """keep only the last this many prompt tokens; None: all"""
    bf16: bool = False
    """bf16 mixed precision"""
    gradient_checkpointing: bool = False
    """gradient checkpointing in the policy"""
    disable_dropout: bool = True
    """turn the policy's dropout off, so that the training forward's logprobs equal sampling's (TRL's default)"""

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
    max_new_tokens: int = 64
    """tokens sampled per completion (then truncated after the EOS)"""
    temperature: float = 0.9
    """sampling temperature (the loss reads the plain logits, as TRL's)"""
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
    logprobs_at_temperature: bool = False
    """ours: the loss's logprobs are of logits / --temperature; off: plain logits (TRL)"""
    max_length: int | None = 512
    """longest prompt + completion in the logprob forwards (prompts cut from the left); None: any"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of completions without EOS (reward model or function)"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / reference / reward forward pass"""

    # Algorithm
    num_train_epochs: float = 1.0
    """passes over the prompts (each reshuffled)"""
    max_steps: int | None = None
    """number of updates (optimizer steps); overrides --num_train_epochs"""
    learning_rate: float = 5e-7
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
    """transformers' schedule after the warmup; linear: decay to 0 after the warmup"""
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
    warmup_ratio: float = 0.0
    """share of the updates over which the learning rate rises from 0 (TRL 0.x's name)"""
    warmup_steps: float = 0.0
    """linear warmup over this many updates, or below 1 this fraction of them (TRL 1.16; or --warmup_ratio)"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (0: no clipping)"""
    per_device_train_batch_size: int = 8
    """prompts (pairs) per forward/backward pass per process"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    beta: list[float] = field(default_factory=lambda: [0.1])
    """pull toward the reference (IPO's tau); several: one per epoch, the last kept"""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid (DPO), ipo (log-ratios summed, as TRL's online DPO) or hinge (SLiC)"""
    drop_ties: bool = False
    """ours: leave pairs with equal scores out; off: the first is 'chosen' (TRL)"""

    # Logging
    logging_steps: int = 1
    """log metrics every this many updates (one optimizer step each): their means over them (TRL's meaning)"""
    num_sample_generations: int = 10
    """evaluations and sample tables: at the first update and this many more (0: never)"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """no: no evaluation or sample tables; steps: at --num_sample_generations or --eval_steps points"""
    eval_steps: int | None = None
    """evaluate and print the sample table every this many updates instead (and after the last)"""
    eval_on_start: bool = False
    """evaluate before the first update too (logged at step 0; not again on resume)"""
    per_device_eval_batch_size: int = 8
    """held-out prompts (one sampled completion each) per process per evaluation batch"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes"""
    local_batch_size: int = 0
    """prompts per update per process (micro-batch * accumulation)"""
    batch_size: int = 0
    """prompts (pairs) per update on all processes"""
    num_total_batches: int = 0
    """number of updates"""


# ---- the math ----------------------------------------------------------------------------------------------
# P prompts, 2 * P completions in completion-major order, R response tokens.
def verdicts_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """The better completion of each prompt: scores [2P] -> verdicts [P], 0 or 1 (the higher), -1 a tie."""
    first, second = scores.view(2, -1)
    verdicts = (second > first).long()
    return verdicts.masked_fill(first == second, -1)


def pairs_from_verdicts(
    verdicts: torch.Tensor, drop_ties: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verdicts [P] in {0, 1, -1} -> (chosen_rows [P], rejected_rows [P], kept [P] bool), row = c * P + p.

    A tie keeps completion 0 as 'chosen' (TRL: chosen if its score is >= the other's), kept unless drop_ties.
    """
    num_prompts = verdicts.size(0)
    prompt = torch.arange(num_prompts, device=verdicts.device)
    second_wins = verdicts == 1
    chosen = torch.where(second_wins, prompt + num_prompts, prompt)
    rejected = torch.where(second_wins, prompt, prompt + num_prompts)
    return chosen, rejected, (verdicts >= 0) | (not drop_ties)


def nan_as_zero(scores: torch.Tensor) -> torch.Tensor:
    """A reward function's None (NaN) counts as 0, as in TRL's nansum: [B] -> [B]; infinities stay."""
    return torch.where(scores.isnan(), torch.zeros_like(scores), scores)


def prompt_mask_within(
    query_mask: torch.Tensor, lengths: torch.Tensor, max_length: int | None, micro_batch: int
) -> torch.Tensor:
    """TRL's max_length in the logprob forwards: query_mask [P, Q] -> the prompt mask they use [P, Q].

    The prompts of micro-batch m keep their last max_length - W_m tokens, W_m the longest of its completions
    (lengths [2P]): the tokens TRL keeps when it cuts prompt + completion to max_length from the left.
    """
    if max_length is None:
        return query_mask
    num_prompts, width = query_mask.shape
    longest = torch.maximum(lengths[:num_prompts], lengths[num_prompts:])
    widest = torch.cat([part.max().expand(part.numel()) for part in longest.split(micro_batch)])
    keep = (max_length - widest).clamp(min=0)
    column = torch.arange(width, device=query_mask.device)
    return query_mask & (column[None, :] >= width - keep[:, None])


def sigmoid_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta h), h = (logp_c - ref_c) - (logp_r - ref_r)."""
    return -F.logsigmoid(beta * h)


def ipo_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023): (h - 1 / (2 tau))^2, tau = beta [P]; h of summed log-ratios (as TRL's)."""
    return (h - 1 / (2 * beta)) ** 2


def hinge_loss(h: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC-HF (Zhao et al. 2023) calibration loss: relu(1 - beta * h) [P]."""
    return torch.relu(1 - beta * h)


def online_dpo_loss(logp_c, logp_r, ref_c, ref_r, beta: float, loss_type: str):
    """Losses [P] and implicit rewards beta * log(pi / pi_ref) [P] of the chosen and the rejected.

    logp_* and ref_* [P]: summed logprobs of a completion under policy and reference; h = (logp_c - ref_c) -
    (logp_r - ref_r).
    """
    ratio_c, ratio_r = logp_c - ref_c, logp_r - ref_r
    h = ratio_c - ratio_r
    if loss_type == "sigmoid":
        losses = sigmoid_loss(h, beta)
    elif loss_type == "ipo":
        losses = ipo_loss(h, beta)
    elif loss_type == "hinge":
        losses = hinge_loss(h, beta)
    else:
        raise UsageError(f"unknown --loss_type {loss_type!r}; use sigmoid, ipo or hinge.")
    return losses, beta * ratio_c.detach(), beta * ratio_r.detach()


def beta_for_epoch(betas: list[float], epoch: int) -> float:
    """betas[epoch] (0-based), the last one once the list runs out (TRL's rule)."""
    return betas[min(epoch, len(betas) - 1)]


def pair_losses(
    policy,
    query_responses,
    attention_mask,
    context_length,
    response_mask,
    ref_logprobs,
    beta,
    loss_type,
    temperature,
):
    """The loss of n pairs: rows [2n, T], the n chosen then the n rejected; logprobs of logits / temperature.

    Returns (losses [n], implicit rewards of chosen and rejected [n], summed logprobs [2n], logprobs [2n, R]).
    """
    logprobs = utils.logprobs.response_logprobs(
        policy, query_responses, attention_mask, context_length, temperature
    )
    logps, ref_logps = (logprobs * response_mask).sum(1), (ref_logprobs * response_mask).sum(1)
    n = logps.size(0) // 2
    losses, reward_c, reward_r = online_dpo_loss(
        logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], beta, loss_type
    )
    return losses, reward_c, reward_r, logps, logprobs


# ---- rollout -----------------------------------------------------------------------------------------------
def sample(args, run, queries, query_mask, prompt_of_row, generator):
    """One completion per row (of prompt prompt_of_row[i]), prompts repeated chunk by chunk, truncated after
    EOS: (responses, lengths, response_mask, logprobs) [n, R]."""
    chunk, responses, logprobs = args.local_rollout_forward_batch_size, [], []
    knobs = utils.generation.sampling_knobs(args)  # once a call, not once a chunk
    run.policy.eval()  # dropout is off anyway; eval keeps the KV cache on under gradient checkpointing
    with torch.no_grad(), utils.run.gathered_for_generation(run.policy, run.accelerator) as sampler:
        for rows in prompt_of_row.split(chunk):
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            query_responses, chunk_logprobs = utils.generation.generate(
                sampler,
                queries[rows],
                query_mask[rows],
                args.max_new_tokens,
                args.temperature,
                chunk,
                generator,
                **knobs,
            )
            responses.append(query_responses[:, queries.size(1) :])
            logprobs.append(chunk_logprobs)
    responses, lengths = utils.generation.truncate_response(torch.cat(responses), run.eos_ids, run.pad_id)
    return (
        responses,
        lengths,
        utils.generation.lengths_to_mask(lengths, args.max_new_tokens),
        torch.cat(logprobs),
    )


def decode_rows(tokenizer, ids, mask) -> list[str]:
    return [tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(ids, mask)]


def held_out_table(args, run, update, rollout) -> dict:
    """Evaluate after `update` (0: before the first) and print a sample table: the held-out prompts'
    completions with their eval/ metrics, or without a test split the first of this `rollout` (queries,
    responses, response_mask) and no metrics. Every process samples (ZeRO-3 gathers), the main one prints."""
    eval_metrics, shown = {}, rollout
    if run.eval_prompt_ids is not None:
        updates_per_epoch = len(run.prompt_ids) // args.batch_size
        trainer_state = utils.scoring.TrainerState(
            global_step=update, max_steps=args.num_total_batches, epoch=update / updates_per_epoch
        )
        eval_metrics, shown = utils.evaluation.evaluate(
            run.accelerator,
            len(run.eval_prompt_ids),
            args.per_device_eval_batch_size,
            functools.partial(held_out_batch, args, run, trainer_state),
        )
        if run.scorer is not None:
            logged = utils.rollout.mean_over_processes(run.accelerator, run.scorer.take_logged())
            eval_metrics.update({f"eval/{name}": value for name, value in logged.items()})
            run.scorer.take_num_truncated()  # the evaluation's rows are not the next update's
    queries, responses, response_mask = shown
    rows = torch.arange(min(queries.size(0), 4), device=queries.device)
    columns = {
        "query": run.tokenizer.batch_decode(queries[rows], skip_special_tokens=True),
        "response": decode_rows(run.tokenizer, responses[rows], response_mask[rows]),
    }
    title = f"update {update}" + (": held-out prompts" if run.eval_prompt_ids is not None else "")
    run.tracker.samples(columns, title=title)
    return eval_metrics


@torch.no_grad()
def held_out_batch(args, run, trainer_state, indices: list[int]) -> tuple[dict, tuple]:
    """One completion of each held-out prompt `indices`, sampled as in training with the evaluation's noise,
    scored as in training (none with a judge: it only compares pairs) -> (per completion: eval/ values, the
    sample table's tensors)."""
    device, P = run.accelerator.device, len(indices)
    queries, query_mask = utils.generation.left_pad(
        [run.eval_prompt_ids[i] for i in indices], run.pad_id, device
    )
    noise = utils.generation.sampling_generator(
        args.seed, utils.evaluation.EVAL_KEY, indices[0], device=device
    )
    rows = torch.arange(P, device=device)
    responses, lengths, response_mask, _ = sample(args, run, queries, query_mask, rows, noise)
    has_eos = (torch.isin(responses, run.eos_ids) & response_mask).any(1)
    values = {"completions/mean_length": lengths.float(), "completions/clipped_ratio": (~has_eos).float()}
    if run.scorer is not None:
        query_responses, mask = utils.generation.query_response_rows(
            queries, query_mask, responses, response_mask, rows
        )
        kwargs = dict(
            prompts=[run.eval_raw_prompts[i] for i in indices],
            columns=utils.data.columns_of_rows(run.eval_columns, indices, rows),
            trainer_state=trainer_state,
        )
        with run.accelerator.autocast():
            scores = run.scorer(
                query_responses, mask, queries.size(1), args.local_rollout_forward_batch_size, **kwargs
            ).float()
        if run.reward_fn is not None:
            scores = nan_as_zero(scores)
        if args.missing_eos_penalty is not None:  # as training's objective/scores
            scores = scores - args.missing_eos_penalty * (~has_eos).float()
        values["objective/scores"] = scores
    return values, (queries, responses, response_mask)


# ---- checks and sizes --------------------------------------------------------------------------------------
def fill_sizes(args: Args, world_size: int, num_prompts: int | None = None) -> Args:
    """Check the flags and compute the derived batch sizes; UsageError with one sentence on a bad value."""
    annotators = [args.reward_model_path, args.reward_fn, args.judge]
    if sum(a is not None for a in annotators) != 1:
        raise UsageError("pass exactly one of --reward_model_path, --reward_fn and --judge.")
    if args.model_name_or_path is None:
        raise UsageError("pass the policy to train with --model_name_or_path.")
    positive = "per_device_train_batch_size gradient_accumulation_steps max_new_tokens "
    positive += "local_rollout_forward_batch_size logging_steps"
    for flag in positive.split():
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.temperature <= 0:
        raise UsageError(
            f"--temperature must be positive (online DPO samples its pairs), got {args.temperature}."
        )
    if not args.beta or any(b <= 0 for b in args.beta):
        raise UsageError(f"--beta must be one or more positive values, got {args.beta}.")
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError(f"--warmup_ratio must be in [0, 1), got {args.warmup_ratio}.")
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError(f"--max_steps must be at least 1, got {args.max_steps}.")
    if args.max_steps is None and args.num_train_epochs <= 0:
        raise UsageError(f"--num_train_epochs must be positive, got {args.num_train_epochs}.")
    if args.reward_tokenizer_path is not None and args.reward_model_path is None:
        raise UsageError(
            "--reward_tokenizer_path is the reward model's tokenizer; pass --reward_model_path too."
        )
    if args.max_length is not None and args.max_length <= args.max_new_tokens:
        raise UsageError(
            f"--max_length {args.max_length} must exceed --max_new_tokens {args.max_new_tokens}, "
            "or no prompt token would be left in the logprob forward passes."
        )
    if args.missing_eos_penalty is not None and args.judge is not None:
        raise UsageError(
            "--missing_eos_penalty changes scores; a --judge gives none, so leave the penalty out."
        )
    args.world_size = world_size
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * world_size
    if num_prompts is not None:
        if num_prompts < args.batch_size:
            raise UsageError(
                f"the dataset has {num_prompts} prompts, fewer than the {args.batch_size} of one update; "
                "lower --per_device_train_batch_size or --gradient_accumulation_steps, or use a larger split."
            )
        updates_per_epoch = num_prompts // args.batch_size
        args.num_total_batches = args.max_steps or max(
            1, math.ceil(args.num_train_epochs * updates_per_epoch)
        )
    return args


# ---- training ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What a run holds fixed from setup to save."""

    accelerator: object
    tokenizer: object
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref_policy: torch.nn.Module
    scorer: utils.scoring.RewardScorer | None
    reward_fn: Callable | None
    judge: Callable | None
    pad_id: int
    eos_ids: torch.Tensor
    prompt_ids: list
    raw_prompts: list
    columns: dict
    eval_prompt_ids: list | None
    eval_raw_prompts: list
    eval_columns: dict
    batches: object
    sampling_generator: torch.Generator
    checkpointer: utils.checkpoint.Checkpointer
    checkpointed: dict
    tracker: utils.tracking.Tracker
    start_step: int


def setup(args: Args) -> Run:
    """Flags, data, annotator, tokenizer, models, optimizer, scorer, resume and tracker, in that order."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    utils.loading.use_model_flags(args)
    # Everything that can be checked before a model is loaded.
    fill_sizes(args, world_size=1)
    utils.generation.sampling_knobs(args)  # checks the sampling flags given (utils/sampling_knobs.py)
    accelerator = utils.run.make_accelerator(
        args, args.gradient_accumulation_steps, micro_batch_size=2 * args.per_device_train_batch_size
    )
    fill_sizes(args, accelerator.num_processes)
    lora = utils.run.optional_module("utils.lora", "--use_peft") if args.use_peft else None
    if lora is not None:
        lora.check_args(args, accelerator)
    if args.resume_from_checkpoint is None:
        utils.checkpoint.check_output_dir(args.output_dir, args.overwrite_output_dir)
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # checks the resume path
    reward_funcs = utils.run.optional_module("utils.reward_funcs", "--reward_fn") if args.reward_fn else None
    reward_fn = reward_funcs.load_reward_fn(args.reward_fn) if reward_funcs else None
    judge = None  # utils/judges.py is optional: imported only with --judge
    if args.judge is not None:
        judge = utils.run.optional_module("utils.judges", "--judge").load_judge(
            args, args.seed + accelerator.process_index
        )
    dataset = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    utils.data.check_columns(dataset, ["prompt"], f"--dataset_name {args.dataset_name}")
    if reward_funcs:
        reward_funcs.check_reward_fn(reward_fn, args.reward_fn, dataset.column_names)
    # The reward function gets its rows' columns (those it names, or all with **kwargs) and the dataset's prompts.
    columns = utils.data.columns(dataset) if reward_fn else {}
    raw_prompts = utils.data.column(dataset, "prompt")
    utils.evaluation.check_args(args)
    eval_dataset = utils.evaluation.load_test_split(args, "online_dpo.py")
    eval_raw_prompts = utils.data.column(eval_dataset, "prompt") if eval_dataset is not None else []
    eval_columns = utils.data.columns(eval_dataset) if reward_fn and eval_dataset is not None else {}
    fill_sizes(args, accelerator.num_processes, len(dataset))
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    set_seed(args.seed)

    # Tokenizer and prompts (conversations rendered with the chat template).
    tokenizer = utils.loading.load_tokenizer(
        args.model_name_or_path, "--model_name_or_path", args.chat_template_path
    )
    texts = utils.data.prompt_texts(dataset, tokenizer, f"--dataset_name {args.dataset_name}")
    prompt_ids = utils.chat.tokenize_prompts(tokenizer, texts, args.max_prompt_length)
    eval_prompt_ids = None
    if eval_dataset is not None:
        where = f"--dataset_test_split {args.dataset_test_split}"
        eval_texts = utils.data.prompt_texts(eval_dataset, tokenizer, where)
        eval_prompt_ids = utils.chat.tokenize_prompts(tokenizer, eval_texts, args.max_prompt_length)
    model, flag = args.model_name_or_path, "--model_name_or_path"
    prompt_ids, eval_prompt_ids = utils.loading.fit_prompts(
        [prompt_ids, eval_prompt_ids], args, "max_new_tokens", model, flag
    )

    # Models: dropout off (--disable_dropout), so the training forward's logprobs equal sampling's; frozen
    # ones in the policy's dtype.
    policy_path, policy_flag = args.model_name_or_path, "--model_name_or_path"
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
    # TRL 1.16 stops at the tokenizer's EOS and at every EOS id of the policy's generation_config.
    eos_ids = torch.tensor(utils.generation.eos_token_ids(policy, tokenizer), device=accelerator.device)
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(policy)
    optimizer = utils.run.trainer_optimizer(policy, args)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    ref_policy = lora.AdapterOff(policy) if lora else utils.run.prepare_frozen(ref_policy, accelerator)
    if reward_model is not None:
        reward_model = utils.run.prepare_frozen(reward_model, accelerator)
    scorer = None
    if judge is None:  # a reward model with its own tokenizer reads the re-encoded text
        reward_tokenizer = utils.scoring.load_reward_tokenizer(
            args.reward_tokenizer_path, args.reward_model_path
        )
        scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
        accelerator.print(scorer.describe())

    # Resume, and replay the prompt order to where it stopped.
    rank = accelerator.process_index
    sampling_generator = torch.Generator(device=accelerator.device).manual_seed(args.seed + rank)
    checkpointed = dict(
        models={"policy": policy},
        optimizers={"policy": optimizer},
        generators={"sampling": sampling_generator},
    )
    state = checkpointer.resume(**checkpointed)
    start_step = state["step"] if state else 0
    tracker = utils.tracking.Tracker(args, checkpointer)
    batches = utils.data.prompt_batches(
        len(prompt_ids), args.local_batch_size, args.world_size, rank, args.seed
    )
    for _ in range(start_step):
        next(batches)
    return Run(
        accelerator=accelerator,
        tokenizer=tokenizer,
        policy=policy,
        optimizer=optimizer,
        ref_policy=ref_policy,
        scorer=scorer,
        reward_fn=reward_fn,
        judge=judge,
        pad_id=tokenizer.pad_token_id,
        eos_ids=eos_ids,
        prompt_ids=prompt_ids,
        raw_prompts=raw_prompts,
        columns=columns,
        eval_prompt_ids=eval_prompt_ids,
        eval_raw_prompts=eval_raw_prompts,
        eval_columns=eval_columns,
        batches=batches,
        sampling_generator=sampling_generator,
        checkpointer=checkpointer,
        checkpointed=checkpointed,
        tracker=tracker,
        start_step=start_step,
    )


def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, policy, optimizer = run.accelerator, run.policy, run.optimizer
    device, judge, start = accelerator.device, run.judge, run.start_step
    chunk, P, micro = (
        args.local_rollout_forward_batch_size,
        args.local_batch_size,
        args.per_device_train_batch_size,
    )
    logprob_temperature = args.temperature if args.logprobs_at_temperature else 1.0
    schedule = utils.run.lr_schedule(args, args.num_total_batches)
    updates_per_epoch = len(run.prompt_ids) // args.batch_size
    start_time, metrics, window = time.time(), {}, []  # window: the metrics of the updates since the last log
    progress = tqdm(
        range(start + 1, args.num_total_batches + 1), disable=not accelerator.is_local_main_process
    )
    if args.eval_on_start and start == 0 and run.eval_prompt_ids is not None:
        run.tracker.log(held_out_table(args, run, 0, None), 0)
    for update in progress:
        lr = schedule(update - 1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        beta = beta_for_epoch(args.beta, (update - 1) // updates_per_epoch)
        trainer_state = utils.scoring.TrainerState(
            global_step=update - 1, max_steps=args.num_total_batches, epoch=(update - 1) / updates_per_epoch
        )

        # 1. Sample: P prompts stored once [P, Q], two completions each (row i <- prompt i % P).
        examples = next(run.batches)  # dataset indices of this process's P prompts
        queries, query_mask = utils.generation.left_pad(
            [run.prompt_ids[i] for i in examples], run.pad_id, device
        )
        context_length = queries.size(1)
        rows = torch.arange(2 * P, device=device)
        responses, lengths, response_mask, sampled_logprobs = sample(
            args, run, queries, query_mask, rows % P, run.sampling_generator
        )
        has_eos = (torch.isin(responses, run.eos_ids) & response_mask).any(1)

        # 2. Score: reference logprobs (prompts cut to --max_length) and rewards.
        rows_at = functools.partial(
            utils.generation.query_response_rows, queries, query_mask, responses, response_mask
        )
        forward_mask = prompt_mask_within(query_mask, lengths, args.max_length, micro)
        first = int(forward_mask.any(0).long().argmax())  # columns no prompt keeps are left out
        forward_queries, forward_query_mask = queries[:, first:], forward_mask[:, first:]
        forward_rows_at = functools.partial(
            utils.generation.query_response_rows,
            forward_queries,
            forward_query_mask,
            responses,
            response_mask,
        )
        forward_context = context_length - first
        ref_logprobs, scores = [], []
        with torch.no_grad(), accelerator.autocast():  # the policy's precision, so the KL starts at 0 in bf16
            for idx in rows.split(chunk):
                run.checkpointer.boundary()
                ref_logprobs.append(
                    utils.logprobs.batched_response_logprobs(
                        run.ref_policy, *forward_rows_at(idx), forward_context, logprob_temperature, chunk
                    )
                )
                if run.scorer is not None:
                    kwargs = dict(
                        prompts=[run.raw_prompts[examples[r % P]] for r in idx.tolist()],
                        columns=utils.data.columns_of_rows(run.columns, examples, idx),
                        trainer_state=trainer_state,
                    )
                    scores.append(run.scorer(*rows_at(idx), context_length, chunk, **kwargs))
        ref_logprobs = torch.cat(ref_logprobs)

        # 3. Pairs: the better completion of each prompt is 'chosen' (online DPO's advantages).
        if judge is None:
            scores = torch.cat(scores).float()
            if run.reward_fn is not None:
                scores = nan_as_zero(scores)
            run.tracker.check_finite(update, scores=scores)
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~has_eos).float()
            verdicts = verdicts_from_scores(scores)
        else:
            prompts = decode_rows(run.tokenizer, queries, query_mask)
            completions = decode_rows(run.tokenizer, responses, response_mask)
            verdicts = judge(prompts, list(zip(completions[:P], completions[P:]))).to(device)
        chosen_rows, rejected_rows, kept = pairs_from_verdicts(verdicts, args.drop_ties or judge is not None)
        num_kept = accelerator.reduce(kept.sum(), reduction="sum").item()

        # 4. Update: one DPO step on micro-batches of pairs (chosen and rejected rows in one forward).
        # Scaled so that it is the mean over all kept pairs (accelerate divides by the steps, DDP averages).
        policy.train()
        loss_scale = args.gradient_accumulation_steps * args.world_size / max(1, num_kept)
        sums = torch.zeros(7, device=device)  # loss, rewards c/r, accuracy, logps c/r, kept pairs
        logprob_gap, measured = torch.zeros((), device=device), None
        policy_logprobs = torch.zeros_like(ref_logprobs)
        for pair_idx in torch.arange(P, device=device).split(micro):
            run.checkpointer.boundary()
            with accelerator.accumulate(policy):
                idx = torch.cat([chosen_rows[pair_idx], rejected_rows[pair_idx]])
                mb_mask = response_mask[idx]
                # ALGO LOGIC: the DPO loss of each pair, weighted 0 for pairs left out
                losses, reward_c, reward_r, logps, new_logprobs = pair_losses(
                    policy,
                    *forward_rows_at(idx),
                    forward_context,
                    mb_mask,
                    ref_logprobs[idx],
                    beta,
                    args.loss_type,
                    logprob_temperature,
                )
                weight = kept[pair_idx].float()
                accelerator.backward((losses * weight).sum() * loss_scale)
                if accelerator.sync_gradients and num_kept > 0:
                    measured = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm)
                if num_kept > 0:  # an update of ties only takes no step (Adam's momentum would still move)
                    optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                n = len(pair_idx)
                policy_logprobs[idx] = new_logprobs.detach().to(policy_logprobs.dtype)
                mb_gap = ((new_logprobs - sampled_logprobs[idx]).abs() * mb_mask).max()
                logprob_gap = torch.maximum(logprob_gap, mb_gap)
                pair_stats = [losses, reward_c, reward_r, (reward_c > reward_r).float(), logps[:n], logps[n:]]
                sums += torch.stack([(stat.detach() * weight).sum() for stat in pair_stats] + [weight.sum()])

        # 5. Metrics, gathered over processes; KL and entropy of the loss's logprobs, as TRL's.
        with torch.no_grad():
            sums = accelerator.reduce(sums, reduction="sum")
            pair_means = (sums[:6] / sums[6].clamp(min=1)).tolist()
            kl = ((policy_logprobs - ref_logprobs) * response_mask).sum(1)  # k1 estimator per completion
            episode = update * args.batch_size * 2
            num_truncated_prompts = (forward_mask != query_mask).any(1).sum()
            metrics = {
                "eps": int((episode - start * args.batch_size * 2) / (time.time() - start_time)),
                "objective/kl": utils.run.gathered_mean(accelerator, kl),
                "objective/entropy": utils.run.gathered_mean(
                    accelerator, (-policy_logprobs * response_mask).sum(1)
                ),
                "objective/non_score_reward": -beta * utils.run.gathered_mean(accelerator, kl),
                "loss/dpo_avg": pair_means[0],
                "rewards/chosen": pair_means[1],
                "rewards/rejected": pair_means[2],
                "rewards/accuracies": pair_means[3],
                "rewards/margins": pair_means[1] - pair_means[2],
                "logps/chosen": pair_means[4],
                "logps/rejected": pair_means[5],
                "val/contain_eos_token": utils.run.gathered_mean(accelerator, has_eos),
                "val/num_ties": accelerator.reduce((verdicts < 0).sum(), reduction="sum").item(),
                "val/num_truncated_prompts": accelerator.reduce(
                    num_truncated_prompts, reduction="sum"
                ).item(),
                "beta": beta,
                "learning_rate": lr,
                "episode": episode,
            }
            if logprob_temperature == args.temperature:  # the loss reads the sampling distribution
                metrics["val/logprob_gap"] = accelerator.reduce(logprob_gap, reduction="max").item()
            if judge is None:
                margins = (scores[chosen_rows] - scores[rejected_rows])[kept]
                metrics["objective/scores"] = utils.run.gathered_mean(accelerator, scores)
                metrics["objective/scores_margin"] = utils.run.gathered_mean(accelerator, margins)
                metrics["objective/rlhf_reward"] = (
                    metrics["objective/scores"] + metrics["objective/non_score_reward"]
                )
                metrics.update(utils.rollout.mean_over_processes(accelerator, run.scorer.take_logged()))
            grad_norm = utils.run.grad_norm_after_step(policy, measured) if num_kept > 0 else None
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
        run.tracker.check_finite(
            update, loss=metrics["loss/dpo_avg"], kl=metrics["objective/kl"], grad_norm=grad_norm
        )
        window.append(metrics)

        # 6. Held-out evaluation and samples (this rollout's without a test split); checkpoint.
        eval_metrics = {}
        if utils.evaluation.due(update, args.num_total_batches, args):
            eval_metrics = held_out_table(args, run, update, (queries, responses, response_mask))
            metrics.update(eval_metrics)
        if update % args.logging_steps == 0 or update == args.num_total_batches:
            last = {
                k: metrics[k]
                for k in ("eps", "beta", "learning_rate", "episode", "grad_norm")
                if k in metrics
            }
            means = utils.tracking.mean_by_key(window)  # as TRL's
            run.tracker.log({**means, **last, **eval_metrics}, update)
            window = []
        elif eval_metrics:
            run.tracker.log(eval_metrics, update)
        run.checkpointer.maybe_save(update, **run.checkpointed)

    # 7. Save the policy and a model card (every process takes part, so ZeRO-3 can gather its shards).
    algorithm = f"online DPO (loss_type={args.loss_type}, beta={args.beta})"
    saving = utils.run.optional_module("utils.lora", "--use_peft") if args.use_peft else utils.saving
    saving.save_model(
        run.checkpointer, policy, run.tokenizer, args, algorithm, args.model_name_or_path, metrics
    )
    run.tracker.close()
    utils.run.end_run(accelerator)
    return metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
