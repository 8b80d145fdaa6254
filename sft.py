"""Supervised fine-tuning (SFT): maximise the likelihood of reference completions (or plain text).

The first step of the RLHF recipe: Stiennon et al. 2020, "Learning to summarize from human feedback"
(https://arxiv.org/abs/2009.01325); Ouyang et al. 2022, "Training language models to follow instructions with
human feedback" (https://arxiv.org/abs/2203.02155). A pretrained causal LM is fine-tuned on demonstrations
with the next-token cross-entropy

    loss = - sum_{t in loss tokens} log p(x_t | x_<t) / (number of loss tokens in the optimizer batch)

where the loss tokens are the completion tokens and their EOS (`--completion_only_loss`, the default) or every
token. The EOS is appended so that the model learns to stop, which the later RL scripts rely on.

    python sft.py --model_name_or_path tiny_world/policy --dataset_name tiny_world/dataset \
        --dataset_train_split sft --dataset_test_split validation --max_length 128 --response_length 8 \
        --learning_rate 3e-3 --lr_scheduler_type cosine --warmup_ratio 0.05 --per_device_train_batch_size 32 \
        --total_steps 1500 --output_dir models/sft
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import bisect
import collections
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import tyro

import utils.chat
import utils.checkpoint
import utils.data
import utils.examples
import utils.generation
import utils.loading
import utils.logprobs
import utils.run
import utils.saving
import utils.tracking
from utils.run import UsageError

IGNORE_INDEX = -100  # label of the tokens that carry no loss (prompt, padding)


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the run (model init, data order, LoRA init)"""
    run_name: str | None = None
    """TensorBoard/W&B run name; None: {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """also log to Weights & Biases"""
    wandb_project_name: str = "rlhf-reference"
    """the W&B project"""
    wandb_entity: str | None = None
    """the W&B entity (team)"""
    logging_dir: str = "runs"
    """TensorBoard logs and samples.jsonl go to {logging_dir}/{run_name}"""
    output_dir: str = "models/sft"
    """where the model, tokenizer, model card and metrics.json are saved"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir, moving its contents to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (without checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """write {output_dir}/checkpoint-{step} every this many steps (0: only on SIGTERM)"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints (None: all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint-{step} folder, or `latest` in --output_dir, to continue exactly from"""

    # Models and data
    model_name_or_path: str = "EleutherAI/pythia-1b-deduped"
    """the model to fine-tune (hub id or local directory)"""
    model_revision: str = "main"
    """revision (branch, tag or commit) of --model_name_or_path on the hub"""
    trust_remote_code: bool = False
    """let hub models and tokenizers run their own modelling code (every load)"""
    attn_implementation: str | None = None
    """attention of the trained model (and its reference): eager, sdpa, flash_attention_2...; None: the default"""
    dataset_name: str = "trl-lib/tldr"
    """hub id, save_to_disk directory, folder of {split}.jsonl files, or a json/jsonl/parquet file"""
    dataset_config: str | None = None
    """the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str | None = "test"
    """split for evaluation (loss and samples); None: no evaluation"""
    dataset_text_field: str = "text"
    """column of language-modeling data (text, or conversations if there is no messages column)"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) with the chat template for conversational data"""
    completion_only_loss: bool = True
    """loss on the completion and its EOS only; --no_completion_only_loss: on the prompt too"""
    assistant_only_loss: bool = False
    """conversational data: loss on the assistant turns only (content and end of turn)"""
    eos_token: str | None = None
    """token ending a completion, saved as the model's EOS (e.g. <|im_end|>); None: the tokenizer's"""
    packing: bool = False
    """pack the examples (each ending with EOS) into rows of --max_length tokens (see --packing_strategy)"""
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd"
    """bfd: whole examples best-fit into rows, each seeing only itself (bfd_split: long ones split); wrapped: cut"""
    context_overflow: Literal["refuse", "cut"] = "refuse"
    """sequences longer than the model's positions: refuse (before loading it) or cut them to fit (one line)"""
    max_length: int = 1024
    """longest prompt + completion + EOS, cut per --truncation_mode (dropped if no loss token is left)"""
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    """a sequence over --max_length keeps its start (its end is cut, EOS too) or its end; not under --packing"""
    max_prompt_length: int | None = None
    """keep the last this many prompt tokens, before --max_length applies (not a TRL flag); None: whole prompts"""

    # Algorithm
    learning_rate: float = 2e-5
    """peak learning rate of AdamW"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon (the N+ TL;DR runs used 1e-5)"""
    lr_scheduler_type: Literal["linear", "cosine", "constant_with_warmup"] = "linear"
    """learning-rate decay after the warmup"""
    warmup_ratio: float = 0.0
    """fraction of the steps warming the learning rate up linearly from 0"""
    per_device_train_batch_size: int = 8
    """sequences per process per forward/backward pass (micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into one optimizer step"""
    num_train_epochs: float = 3.0
    """passes over the training split (ignored when --total_steps is given)"""
    total_steps: Annotated[int | None, tyro.conf.arg(aliases=("--max_steps",))] = None
    """optimizer steps (alias --max_steps); None: from --num_train_epochs"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (0: no clipping)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bfloat16 mixed precision"""
    use_peft: bool = False
    """train LoRA adapters, merged into the saved model, instead of all weights"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = lora_alpha / lora_r)"""
    lora_dropout: float = 0.05
    """dropout on the LoRA input"""
    lora_target_modules: list[str] | None = None
    """modules given adapters (e.g. q_proj v_proj, or all-linear); None: peft's default for the model, as TRL"""

    # Logging
    logging_steps: int = 10
    """log the training metrics every this many optimizer steps"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """steps: evaluate on --dataset_test_split before, every --eval_steps and after training; no: never"""
    eval_steps: int = 500
    """evaluate every this many steps (0: only before and after training)"""
    per_device_eval_batch_size: int = 8
    """sequences per process per evaluation forward pass or generation chunk"""
    num_samples: int = 16
    """test prompts completed greedily at each evaluation, shown beside their references"""
    response_length: int = 53
    """new tokens generated for each sample (cut after the first EOS)"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes"""
    batch_size: int = 0
    """sequences per optimizer step, over all processes"""


# ---- the math ----------------------------------------------------------------------------------------------
def sum_token_nll(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t -log p(labels[:, t+1] | tokens <= t), number of loss tokens) of a batch of labels [B, T].

    A sum: the caller divides by the loss tokens of the whole optimizer batch."""
    if "position_ids" in batch:  # packed rows go in as one without a mask (TRL's padding-free batch)
        real = batch["attention_mask"].bool()
        ids, position_ids, labels = (batch[k][real][None] for k in ("input_ids", "position_ids", "labels"))
        scored = labels[:, 1:] != IGNORE_INDEX
        logprobs = utils.logprobs.token_logprobs(model, ids, None, scored, position_ids=position_ids)
        return -logprobs.sum(), scored.sum()
    scored = batch["labels"][:, 1:] != IGNORE_INDEX
    logprobs = utils.logprobs.token_logprobs(model, batch["input_ids"], batch["attention_mask"], scored)
    return -logprobs.sum(), scored.sum()


# ---- data --------------------------------------------------------------------------------------------------
PACKING_CHUNK = 1000  # TRL packs with Dataset.map(batched=True): each 1,000 examples on their own


def truncate(
    ids: list[int], mask: list[int], max_length: int, truncation_mode: str
) -> tuple[list, list, str]:
    """Cut a sequence and its loss mask to `max_length` tokens as TRL 1.16's SFTTrainer does: keep_start cuts
    the end (EOS included), keep_end the start. Returns (ids, mask, "kept" | "truncated" | "dropped"), dropped
    (empty) when no loss token is left."""
    status = "kept"
    if len(ids) > max_length:
        keep = slice(0, max_length) if truncation_mode == "keep_start" else slice(len(ids) - max_length, None)
        ids, mask, status = ids[keep], mask[keep], "truncated"
    return (ids, mask, status) if any(mask) else ([], [], "dropped")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths` (each at most `capacity`): longest first (ties in order), each into the bin
    with the least room that fits it, the first to reach that room, else into a new bin."""
    bins, rooms, bins_by_room = [], [], {}  # rooms: the sorted free spaces some bin has
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect.bisect_left(rooms, lengths[i])
        if k < len(rooms):
            room, b = rooms[k], bins_by_room[rooms[k]].popleft()
            if not bins_by_room[room]:
                del bins_by_room[room], rooms[k]
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        room -= lengths[i]
        if room > 0:
            if room not in bins_by_room:
                bins_by_room[room] = collections.deque()
                bisect.insort(rooms, room)
            bins_by_room[room].append(b)
    return bins


def pack_rows(rows: list[dict], max_length: int, strategy: str) -> list[dict]:
    """TRL 1.16's packing, PACKING_CHUNK rows at a time. bfd: each example cut to `max_length` (bfd_split:
    split into pieces of it) and placed by best_fit_decreasing; its first token carries no loss and
    `seq_lengths` gives its position ids. wrapped: the examples concatenated and cut every `max_length`."""
    packed = []
    for start in range(0, len(rows), PACKING_CHUNK):
        chunk = rows[start : start + PACKING_CHUNK]
        if strategy == "wrapped":
            ids, mask = ([t for r in chunk for t in r[key]] for key in ("input_ids", "loss_mask"))
            cuts = range(0, len(ids), max_length)
            packed += [
                {"input_ids": ids[i : i + max_length], "loss_mask": mask[i : i + max_length]} for i in cuts
            ]
            continue
        pieces = []
        for row in chunk:
            cuts = range(0, len(row["input_ids"]), max_length) if strategy == "bfd_split" else [0]
            pieces += [
                (row["input_ids"][i : i + max_length], row["loss_mask"][i : i + max_length]) for i in cuts
            ]
        for members in best_fit_decreasing([len(ids) for ids, _ in pieces], max_length):
            ids = [t for i in members for t in pieces[i][0]]
            # no loss on a first token: it would be predicted from the end of the previous example
            mask = [m for i in members for m in [0, *pieces[i][1][1:]]]
            lengths = [len(pieces[i][0]) for i in members]
            packed.append({"input_ids": ids, "loss_mask": mask, "seq_lengths": lengths})
    return packed


def collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels [B, T] (IGNORE_INDEX where loss_mask is 0); rows packed
    by bfd add position_ids, from 0 in each example."""
    # Masks come from the lengths, not the pad id: an EOS that doubles as padding is still trained on.
    input_ids = utils.generation.pad([r["input_ids"] for r in rows], pad_token_id)
    attention_mask = utils.generation.pad([[1] * len(r["input_ids"]) for r in rows], 0)
    loss_mask = utils.generation.pad([r["loss_mask"] for r in rows], 0).bool()
    labels = torch.where(loss_mask, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if "seq_lengths" in rows[0]:
        positions = [[p for n in r["seq_lengths"] for p in range(n)] for r in rows]
        batch["position_ids"] = utils.generation.pad(positions, 0)
    return batch


def tokenize_split(dataset, tokenizer, args: Args, where: str) -> tuple[list[dict], dict[str, int]]:
    """Rows {input_ids, loss_mask} of a split in any of TRL's SFT formats, cut or packed as TRL 1.16's
    SFTTrainer prepares them; kept/truncated/dropped counts of the examples."""
    kind, examples = utils.examples.sft_examples(
        dataset, tokenizer, where, args.dataset_text_field, args.assistant_only_loss
    )
    counts, rows, max_prompt_length = {"kept": 0, "truncated": 0, "dropped": 0}, [], args.max_prompt_length
    for example in examples:
        prompt_cut = False
        if kind == "prompt_completion":
            prompt_ids, completion_ids, completion_mask = example
            if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
                prompt_ids, prompt_cut = prompt_ids[len(prompt_ids) - max_prompt_length :], True
            ids = prompt_ids + completion_ids
            mask = [0 if args.completion_only_loss else 1] * len(prompt_ids) + completion_mask
        else:
            ids, mask = example
        if args.packing:  # TRL drops nothing before packing; bfd cuts what does not fit a row
            cut = args.packing_strategy == "bfd" and len(ids) > args.max_length
            status = "truncated" if cut else "kept"
        else:
            ids, mask, status = truncate(ids, mask, args.max_length, args.truncation_mode)
        counts["truncated" if prompt_cut and status == "kept" else status] += 1
        if status != "dropped":
            rows.append({"input_ids": ids, "loss_mask": mask})
    if not rows:
        raise UsageError(
            f"{where}: all {counts['dropped']} examples were dropped: none has a loss token within "
            f"--max_length {args.max_length}; raise it."
        )
    if args.packing:
        rows = pack_rows(rows, args.max_length, args.packing_strategy)
    return rows, counts


def step_rows(num_rows: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Row indices of step `step` (from 1) over every process, shuffled by seed + epoch."""
    epoch, i = divmod(step - 1, num_rows // batch_size)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    return order[i * batch_size : (i + 1) * batch_size].tolist()


def step_micro_batches(num_rows: int, step: int, micro: int, ga: int, world_size: int, rank: int, seed: int):
    """Row indices of this process's `ga` micro-batches of step `step` (from 1)."""
    rows = step_rows(num_rows, step, micro * ga * world_size, seed)
    return [rows[(j * world_size + rank) * micro :][:micro] for j in range(ga)]


@torch.no_grad()
def evaluation_loss(model, rows: list[dict], batch_size: int, pad_token_id: int, accelerator) -> float:
    """Mean next-token loss over every loss token of `rows`, process k taking rows k, k + world size, ..."""
    world, rank = accelerator.num_processes, accelerator.process_index
    # Padded to a multiple of the processes: ZeRO-3 needs all of them in each forward pass.
    positions = list(range(len(rows) + (-len(rows) % world)))[rank::world]
    totals = torch.zeros(2, device=accelerator.device)
    for i in range(0, len(positions), batch_size):
        chunk = positions[i : i + batch_size]
        batch = collate([rows[p % len(rows)] for p in chunk], pad_token_id)
        batch["labels"][torch.tensor(chunk) >= len(rows)] = IGNORE_INDEX
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        totals += torch.stack(sum_token_nll(model, batch)).float()
    totals = accelerator.reduce(totals, "sum")
    return (totals[0] / totals[1].clamp(min=1)).item()


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: list[str], args: Args) -> list[str]:
    """Greedy completions of `prompts`, left-padded as in the RL scripts, cut after the first EOS."""
    ids = utils.chat.tokenize_prompts(tokenizer, prompts, args.max_prompt_length)
    responses, _ = utils.generation.complete(
        model, tokenizer, ids, args.response_length, args.per_device_eval_batch_size
    )
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


# ---- checks and sizes --------------------------------------------------------------------------------------
POSITIVE_FLAGS = """max_length per_device_train_batch_size gradient_accumulation_steps logging_steps
per_device_eval_batch_size lora_r response_length""".split()


def fill_sizes(args: Args, world_size: int, num_rows: int | None = None) -> Args:
    """Check the flags and fill in the batch size; with the number of training rows, the steps too."""
    if args.max_prompt_length is not None and not 1 <= args.max_prompt_length < args.max_length:
        raise UsageError(
            f"--max_prompt_length ({args.max_prompt_length}) must be at least 1 and smaller than "
            f"--max_length ({args.max_length}), to leave room for the completion."
        )
    for flag in POSITIVE_FLAGS:
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.num_train_epochs <= 0 if args.total_steps is None else args.total_steps < 1:
        raise UsageError("--num_train_epochs must be positive (or --total_steps at least 1).")
    if not 0 <= args.warmup_ratio <= 1 or args.eval_steps < 0 or args.num_samples < 0:
        raise UsageError("--warmup_ratio must be in [0, 1], --eval_steps and --num_samples at least 0.")
    args.world_size = world_size
    args.batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    if num_rows is not None:
        if num_rows < args.batch_size:
            raise UsageError(
                f"the training split has {num_rows} sequences, fewer than one batch of {args.batch_size} "
                "(per_device_train_batch_size x gradient_accumulation_steps x processes); lower those flags."
            )
        steps_per_epoch = num_rows // args.batch_size
        args.total_steps = args.total_steps or max(1, int(args.num_train_epochs * steps_per_epoch))
    return args


# ---- training ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """The fixed state of a run, built by setup()."""

    accelerator: Any
    tokenizer: Any
    policy: Any
    optimizer: Any
    scheduler: Any
    checkpointer: Any
    tracker: Any
    train_rows: list[dict]
    eval_rows: list[dict]
    eval_prompts: list[str]
    eval_references: list[str]
    counts: dict[str, int]
    start_step: int
    num_tokens: int  # trained on before a resume


def setup(args: Args) -> Run:
    """Everything before the first step; flags and data are checked before the model is loaded."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

    utils.loading.use_model_flags(args)
    utils.loading.fit_max_length(args)  # under --context_overflow cut, before the flag checks
    fill_sizes(args, 1)
    utils.checkpoint.check_output_dir(
        args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint)
    )
    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    accelerator = utils.run.make_accelerator(args, ga, micro)
    fill_sizes(args, accelerator.num_processes)  # before the checkpointer, which records the batch size
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # takes the run name of a resumed run

    tokenizer = utils.loading.from_pretrained(AutoTokenizer, args.model_name_or_path, "--model_name_or_path")
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of {args.model_name_or_path} has no EOS token; SFT appends one.")
    if args.eos_token is not None:
        utils.chat.set_eos_token(tokenizer, args.eos_token)
    if tokenizer.pad_token_id is None:  # e.g. Pythia: pad with EOS (every mask here comes from lengths)
        tokenizer.pad_token = tokenizer.eos_token
    utils.chat.set_chat_template(tokenizer, args.chat_template_path, args.trust_remote_code)
    test_split = args.dataset_test_split if args.eval_strategy == "steps" else None
    if test_split == Args.dataset_test_split and "--dataset_test_split" not in " ".join(sys.argv[1:]):
        if not utils.data.has_split(args.dataset_name, test_split, args.dataset_config):  # as TRL: no eval
            accelerator.print(
                f'sft.py: no "{test_split}" split in {args.dataset_name}: evaluation skipped '
                "(give --dataset_test_split to evaluate)"
            )
            test_split = None
    train_split = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    train_rows, counts = tokenize_split(train_split, tokenizer, args, f"split {args.dataset_train_split!r}")
    eval_rows, eval_prompts, eval_references, eval_counts = [], [], [], {}
    if test_split is not None:
        eval_split = utils.data.load_split(args.dataset_name, test_split, args.dataset_config)
        where = f"split {test_split!r}"
        eval_rows, eval_counts = tokenize_split(eval_split, tokenizer, args, where)
        eval_prompts, eval_references = utils.examples.sample_prompts(
            eval_split, tokenizer, where, args.num_samples, args.dataset_text_field
        )
    # positions restart at each example packed by bfd: the model sees no more than the longest example
    longest = max(max(row.get("seq_lengths", [len(row["input_ids"])])) for row in train_rows + eval_rows)
    utils.loading.check_context_length(args.model_name_or_path, longest, "--max_length")
    fill_sizes(args, accelerator.num_processes, len(train_rows))
    evaluated = f", eval: {eval_counts}" if test_split is not None else ""
    accelerator.print(f"train: {counts}{evaluated}; {args.total_steps} steps of {args.batch_size}")

    set_seed(args.seed)
    policy = utils.loading.from_pretrained(
        AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
    )
    policy.config.pad_token_id = tokenizer.pad_token_id
    if args.eos_token is not None:  # the saved model stops where its completions were taught to end
        policy.config.eos_token_id = policy.generation_config.eos_token_id = tokenizer.eos_token_id
    deepspeed = accelerator.state.deepspeed_plugin
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(policy)
    if args.use_peft:
        from peft import LoraConfig, get_peft_model

        if deepspeed is not None and deepspeed.zero_stage == 3:
            raise UsageError("--use_peft merges the adapters when saving, which ZeRO-3 cannot; use ZeRO-2.")
        if args.gradient_checkpointing:
            policy.enable_input_require_grads()  # frozen embeddings must still pass gradients to checkpoints
        targets = args.lora_target_modules
        targets = "all-linear" if targets == ["all-linear"] else targets
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        policy = get_peft_model(policy, lora)
    params, decay = [p for p in policy.parameters() if p.requires_grad], args.weight_decay
    optimizer = utils.run.adamw(params, args.learning_rate, eps=args.adam_epsilon, weight_decay=decay)
    warmup_steps = math.ceil(args.warmup_ratio * args.total_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, args.total_steps)
    policy, optimizer = accelerator.prepare(policy, optimizer)  # the scheduler is stepped by hand, each step
    set_seed(args.seed + accelerator.process_index)  # different dropout masks on each process
    print(utils.run.describe_sharding(policy, accelerator), flush=True)
    resumed = checkpointer.resume({"model": policy}, {"model": optimizer}) or {"step": 0, "num_tokens": 0}
    if resumed["step"]:
        scheduler.load_state_dict(resumed["scheduler"])
    tracker = utils.tracking.Tracker(args, checkpointer)
    return Run(
        accelerator,
        tokenizer,
        policy,
        optimizer,
        scheduler,
        checkpointer,
        tracker,
        train_rows,
        eval_rows,
        eval_prompts,
        eval_references,
        counts,
        resumed["step"],
        resumed["num_tokens"],
    )


def evaluate(args: Args, run: Run, step: int) -> float:
    """eval/loss over the whole test split, and greedy samples beside their references."""
    accelerator, policy, tokenizer = run.accelerator, run.policy, run.tokenizer
    policy.eval()
    with accelerator.autocast():
        loss = evaluation_loss(
            policy, run.eval_rows, args.per_device_eval_batch_size, tokenizer.pad_token_id, accelerator
        )
        # Every process generates the same samples: ZeRO-3 needs every rank in each forward pass.
        unwrapped = accelerator.unwrap_model(policy)
        samples = greedy_samples(unwrapped, tokenizer, run.eval_prompts, args) if run.eval_prompts else []
    policy.train()
    accelerator.print(f"step {step}: eval/loss {loss:.4f}")
    run.tracker.log({"eval/loss": loss}, step)
    if accelerator.is_main_process and samples:
        table = {
            "prompt": [p[-100:] for p in run.eval_prompts],
            "sample": samples,
            "reference": run.eval_references,
        }
        utils.tracking.print_samples(table, title=f"greedy samples, step {step}")
        markdown = "\n".join(f"| {p!r} | {s!r} | {r!r} |" for p, s, r in zip(*table.values()))
        run.tracker.writer.add_text(
            "eval/samples", f"| prompt | sample | reference |\n|-|-|-|\n{markdown}", step
        )
        with open(os.path.join(run.tracker.run_dir, "samples.jsonl"), "a") as f:
            for p, s, r in zip(run.eval_prompts, samples, run.eval_references):
                f.write(json.dumps({"step": step, "prompt": p, "sample": s, "reference": r}) + "\n")
    return loss


def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, policy, optimizer, scheduler = run.accelerator, run.policy, run.optimizer, run.scheduler
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    metrics = {"eval/initial_loss": evaluate(args, run, 0)} if run.eval_rows and not run.start_step else {}
    # since the last log: nll sum and input tokens (on the device: read only when logged), loss tokens, seconds
    window = torch.zeros(2, dtype=torch.float64, device=device)
    window_loss_tokens, window_seconds, num_tokens = 0.0, 0.0, run.num_tokens
    loss_tokens = [sum(map(bool, row["loss_mask"][1:])) for row in run.train_rows]  # each row's, as collate's
    policy.train()
    steps = range(run.start_step + 1, args.total_steps + 1)
    hidden = not accelerator.is_main_process
    for step in tqdm(steps, disable=hidden, desc="sft", initial=run.start_step, total=args.total_steps):
        step_start = time.time()
        # 1. Batch: this process's micro-batches of the step.
        local_rows = step_micro_batches(len(run.train_rows), step, micro, ga, world, rank, args.seed)
        pad_id = run.tokenizer.pad_token_id
        batches = [collate([run.train_rows[i] for i in rows], pad_id) for rows in local_rows]

        # 2. Loss: sum(nll) / sum(loss tokens) of the optimizer batch; accelerate and DDP divide by ga * world
        every_row = step_rows(len(run.train_rows), step, args.batch_size, args.seed)  # here: no collective
        global_loss_tokens = float(sum(loss_tokens[i] for i in every_row))
        per_micro_batch = max(global_loss_tokens, 1.0) / (ga * world)
        for cpu_batch in batches:
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            batch = {k: v.to(device) for k, v in cpu_batch.items()}
            with accelerator.accumulate(policy), accelerator.autocast():
                # ALGO LOGIC: the next-token NLL of the loss tokens
                nll, _ = sum_token_nll(policy, batch)
                # 3. Update: accumulate() steps the optimizer on the last micro-batch only.
                accelerator.backward(nll / per_micro_batch)
                grad_norm = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            window += torch.stack([nll.detach(), batch["attention_mask"].sum()]).double()
        grad_norm = utils.run.grad_norm_after_step(policy, grad_norm)
        run.tracker.check_finite(step, loss=nll, grad_norm=grad_norm)
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        scheduler.step()
        window_seconds += time.time() - step_start
        window_loss_tokens += global_loss_tokens

        # 4. Metrics: over every loss token since the last log, on all processes.
        if step % args.logging_steps == 0 or step == args.total_steps:
            nll_sum, tokens = accelerator.reduce(window, "sum").tolist()
            num_tokens += int(tokens)
            metrics["loss"] = nll_sum / max(window_loss_tokens, 1.0)
            metrics["learning_rate"] = scheduler.get_last_lr()[0]
            metrics["perf/tokens_per_second"] = tokens / window_seconds
            metrics["num_tokens"] = num_tokens
            run.tracker.log({k: v for k, v in metrics.items() if not k.startswith("eval/")}, step)
            window, window_loss_tokens, window_seconds = torch.zeros_like(window), 0.0, 0.0

        # 5. Evaluate
        if run.eval_rows and (step == args.total_steps or args.eval_steps and step % args.eval_steps == 0):
            metrics["eval/loss"] = evaluate(args, run, step)

        # 6. Checkpoint
        state = {"num_tokens": num_tokens, "scheduler": scheduler.state_dict()}
        run.checkpointer.maybe_save(step, {"model": policy}, {"model": optimizer}, state=state)

    # 7. Save: every process takes part (ZeRO-3 gathers the weights).
    accelerator.wait_for_everyone()
    run.checkpointer.start_over()  # a replaced run's files go aside first
    unwrapped = accelerator.unwrap_model(policy)
    saved = unwrapped.merge_and_unload() if args.use_peft else unwrapped  # LoRA: merged into the weights
    state_dict = saved.state_dict() if args.use_peft else accelerator.get_state_dict(policy)
    metrics.update({f"data/num_{k}": v for k, v in run.counts.items()} | {"global_step": args.total_steps})
    main_process = accelerator.is_main_process
    saved.save_pretrained(
        args.output_dir, is_main_process=main_process, save_function=accelerator.save, state_dict=state_dict
    )
    if main_process:
        run.tokenizer.save_pretrained(args.output_dir)
        data = f"{args.dataset_name} ({args.dataset_train_split})"
        utils.saving.write_model_card(
            args.output_dir, "SFT", args.model_name_or_path, data, metrics, args=args
        )
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        if args.push_to_hub:
            utils.saving.push_to_hub(args)
    run.tracker.close()
    accelerator.print(f"saved to {args.output_dir}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    utils.run.end_run(accelerator)
    return metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
