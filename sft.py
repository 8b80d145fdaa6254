"""Supervised fine-tuning (SFT): maximise the likelihood of reference completions (or plain text).

The first step of the RLHF recipe (Stiennon et al. 2020, "Learning to summarize from human feedback";
Ouyang et al. 2022): fine-tune a pretrained causal LM on demonstrations with the next-token cross-entropy

    loss = - sum_{t in loss tokens} log p(x_t | x_<t) / (number of loss tokens in the optimizer batch)

where the loss tokens are the completion tokens and their EOS (`--completion_only_loss`, the default) or every
token. The EOS is appended so that the model learns to stop, which the later RL scripts rely on.

    python sft.py --model_name_or_path tiny_world/policy --dataset_name tiny_world/dataset \
        --dataset_train_split sft --dataset_test_split validation --max_length 128 --response_length 8 \
        --learning_rate 3e-3 --lr_scheduler_type cosine --warmup_ratio 0.05 --per_device_train_batch_size 32 \
        --total_steps 1500 --output_dir models/sft
"""

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import torch
import tyro

import utils
import utils.chat
import utils.data

IGNORE_INDEX = -100  # label of the tokens that carry no loss (prompt, padding)


@dataclass
class Args:
    # run
    exp_name: str = os.path.splitext(os.path.basename(__file__))[0]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (model init, data order, LoRA init)"""
    run_name: Optional[str] = None
    """name of the run (TensorBoard directory); default {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """also log to Weights & Biases"""
    wandb_project_name: str = "rlhf-reference"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    logging_dir: str = "runs"
    """TensorBoard logs and samples.jsonl go to {logging_dir}/{run_name}"""
    output_dir: str = "models/sft"
    """where the fine-tuned model, its tokenizer, model card and metrics.json are saved"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir: its contents are moved aside to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (without its checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """write a checkpoint ({output_dir}/checkpoint-{step}) every this many optimizer steps (0: only on SIGTERM)"""
    save_total_limit: Optional[int] = None
    """keep only the newest this many checkpoints (None: all)"""
    resume_from_checkpoint: Optional[str] = None
    """a checkpoint-{step} folder, or `latest` (the newest in --output_dir), to continue exactly from"""

    # model and data
    model_name_or_path: str = "EleutherAI/pythia-1b-deduped"
    """the model to fine-tune (hub id or local directory)"""
    dataset_name: str = "trl-lib/tldr"
    """hub id, save_to_disk directory, directory of {split}.jsonl files, or one json/jsonl/parquet file"""
    dataset_config: Optional[str] = None
    """dataset configuration: the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: Optional[str] = "test"
    """split for evaluation (loss and samples); None: no evaluation"""
    dataset_text_field: str = "text"
    """column of a language-modeling dataset (strings, or conversations when there is no messages column)"""
    chat_template_path: Optional[str] = None
    """Jinja file (or tokenizer directory) whose chat template renders conversational data"""
    completion_only_loss: bool = True
    """loss on the completion tokens (and EOS) only; --no_completion_only_loss: on the prompt tokens too"""
    assistant_only_loss: bool = False
    """conversational data: loss on the assistant turns only (their content and end of turn)"""
    eos_token: Optional[str] = None
    """token that ends a completion and is saved as the model's EOS (e.g. <|im_end|>); None: the tokenizer's"""
    packing: bool = False
    """concatenate the examples (each ending with EOS) and cut them into blocks of --max_length tokens"""
    max_length: int = 1024
    """longest training sequence (prompt + completion + EOS); a completion is never cut (the pair dropped)"""
    max_prompt_length: Optional[int] = None
    """keep the last this many prompt tokens (left truncation); None: cut prompts only to fit --max_length"""

    # optimisation
    learning_rate: float = 2e-5
    """peak learning rate of AdamW"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon (the N+ TL;DR runs used 1e-5)"""
    lr_scheduler_type: Literal["linear", "cosine", "constant_with_warmup"] = "linear"
    """learning-rate decay after the warmup"""
    warmup_ratio: float = 0.0
    """fraction of the optimizer steps spent warming the learning rate up linearly from 0"""
    per_device_train_batch_size: int = 8
    """sequences per process per forward/backward pass (micro-batch)"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into one optimizer step"""
    num_train_epochs: float = 3.0
    """passes over the training split (ignored when --total_steps is given)"""
    total_steps: Annotated[Optional[int], tyro.conf.arg(aliases=("--max_steps",))] = None
    """optimizer steps to take (alias --max_steps); None: filled in from --num_train_epochs"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (0: no clipping)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bfloat16 mixed precision"""
    use_peft: bool = False
    """train LoRA adapters instead of all weights; they are merged into the saved model"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = lora_alpha / lora_r)"""
    lora_dropout: float = 0.05
    """dropout on the LoRA input"""
    lora_target_modules: Optional[list[str]] = None
    """module names to adapt; None: every linear layer except the output head"""

    # logging and evaluation
    logging_steps: int = 10
    """log the training metrics every this many optimizer steps"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """steps: evaluate on --dataset_test_split every --eval_steps and before and after training; no: never"""
    eval_steps: int = 500
    """evaluate every this many optimizer steps, and always before and after training (0: only then)"""
    per_device_eval_batch_size: int = 8
    """sequences per process per evaluation forward pass and per generation chunk"""
    num_samples: int = 16
    """validation prompts completed greedily at each evaluation, shown with their references"""
    response_length: int = 53
    """new tokens generated for each sample (cut after the first EOS)"""

    # filled in at runtime
    world_size: int = 0
    """number of processes"""
    batch_size: int = 0
    """sequences per optimizer step: per_device_train_batch_size * gradient_accumulation_steps * world_size"""


# ------------------------------------------------------------------------------------------------------------
# Data and loss: pure functions
# ------------------------------------------------------------------------------------------------------------
def truncate_example(
    prompt_ids: list[int], completion_ids: list[int], max_length: int, max_prompt_length: Optional[int] = None
) -> tuple[list[int], list[int], str]:
    """Fit one prompt-completion pair into `max_length` tokens without ever cutting the completion.

    The prompt keeps its last `max_prompt_length` tokens (left truncation: the end of the prompt, e.g.
    "TL;DR:", is what the completion follows), then loses tokens from its left until prompt + completion fit.
    A pair whose completion leaves no room for at least one prompt token is dropped. Returns (prompt_ids,
    completion_ids, status), status "kept", "truncated" or "dropped" (then both lists are empty).
    """
    status = "kept"
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids, status = prompt_ids[len(prompt_ids) - max_prompt_length :], "truncated"
    room = max_length - len(completion_ids)
    if room < min(1, len(prompt_ids)):
        return [], [], "dropped"
    if len(prompt_ids) > room:
        prompt_ids, status = prompt_ids[len(prompt_ids) - room :], "truncated"
    return prompt_ids, completion_ids, status


def pack_sequences(sequences: list[list[int]], block_size: int) -> list[list[int]]:
    """Concatenate `sequences` (each ending with EOS, so the documents stay separated) and cut the stream into
    blocks of `block_size` tokens, the last block holding the remainder: no token is lost or repeated.
    Attention crosses document boundaries inside a block, as in classic packed language-model training."""
    stream = [token for sequence in sequences for token in sequence]
    return [stream[i : i + block_size] for i in range(0, len(stream), block_size)]


def collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows {input_ids, loss_mask} into input_ids, attention_mask and labels [B, T]. A label is the
    token where loss_mask is 1 and IGNORE_INDEX elsewhere (prompt, padding). The masks come from the lengths,
    never from the pad id, so an EOS that doubles as padding is still trained on."""
    input_ids = utils.pad([r["input_ids"] for r in rows], pad_token_id)
    attention_mask = utils.pad([[1] * len(r["input_ids"]) for r in rows], 0)
    loss_mask = utils.pad([r["loss_mask"] for r in rows], 0).bool()
    labels = torch.where(loss_mask, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def sum_token_nll(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over the loss tokens of -log p(label_t | tokens_<t), number of loss tokens) of a collated batch
    (input_ids, attention_mask, labels [B, T]): the logits at position t predict token t+1, so they are scored
    against labels[:, 1:]; IGNORE_INDEX labels do not count, and only the loss tokens reach the LM head
    (utils.token_logprobs: no [B, T, V] logits). A sum, not a mean: the caller divides by the loss tokens of the
    whole optimizer batch."""
    scored = batch["labels"][:, 1:] != IGNORE_INDEX
    logprobs = utils.token_logprobs(model, batch["input_ids"], batch["attention_mask"], scored)
    return -logprobs.sum(), scored.sum()


def tokenize_split(dataset, tokenizer, args: Args, where: str) -> tuple[list[dict], dict[str, int]]:
    """Rows {input_ids, loss_mask} of a split in any of TRL's SFT formats (utils.data: prompt-completion or
    language modeling, standard or conversational), EOS-terminated, with the truncation rules applied and,
    with --packing, packed. Returns (rows, counts of kept/truncated/dropped)."""
    kind, examples = utils.data.sft_examples(
        dataset, tokenizer, where, args.dataset_text_field, args.assistant_only_loss
    )
    counts, rows, max_prompt_length = {"kept": 0, "truncated": 0, "dropped": 0}, [], args.max_prompt_length
    if kind == "prompt_completion":
        for prompt_ids, completion_ids, completion_mask in examples:
            p, c, status = truncate_example(prompt_ids, completion_ids, args.max_length, max_prompt_length)
            counts[status] += 1
            if status != "dropped":
                prompt_mask = [0 if args.completion_only_loss else 1] * len(p)
                rows.append({"input_ids": p + c, "loss_mask": prompt_mask + completion_mask})
    else:
        for ids, mask in examples:
            status = "kept"
            if len(ids) > args.max_length and not args.packing:  # plain text: keep the beginning, and say so
                ids, mask, status = ids[: args.max_length], mask[: args.max_length], "truncated"
            counts[status] += 1
            rows.append({"input_ids": ids, "loss_mask": mask})
    if not rows:
        raise ValueError(f"{where}: all {counts['dropped']} examples were dropped; raise --max_length.")
    if args.packing:
        ids = pack_sequences([r["input_ids"] for r in rows], args.max_length)
        masks = pack_sequences([r["loss_mask"] for r in rows], args.max_length)
        rows = [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks)]
    return rows, counts


def check_args(args: Args) -> None:
    """One clear sentence for each impossible flag value, before anything is loaded."""
    if args.max_prompt_length is not None and not 1 <= args.max_prompt_length < args.max_length:
        raise ValueError(
            f"--max_prompt_length ({args.max_prompt_length}) must be at least 1 and smaller than "
            f"--max_length ({args.max_length}), to leave room for the completion."
        )
    for flag in ("max_length", "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps",
                 "per_device_eval_batch_size", "lora_r", "response_length"):  # fmt: skip
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.num_train_epochs <= 0 if args.total_steps is None else args.total_steps < 1:
        raise ValueError("--num_train_epochs must be positive (or --total_steps at least 1).")
    if not 0 <= args.warmup_ratio <= 1 or args.eval_steps < 0 or args.num_samples < 0:
        raise ValueError("--warmup_ratio must be in [0, 1], --eval_steps and --num_samples at least 0.")


# ------------------------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluation_loss(model, rows: list[dict], batch_size: int, pad_token_id: int, accelerator) -> float:
    """Mean next-token loss over every loss token of `rows`, process k taking rows k, k + num_processes, ...;
    the sums are reduced across processes, so the result is exact (no row left out or counted twice)."""
    world, rank = accelerator.num_processes, accelerator.process_index
    # Pad the row list to a multiple of the process count so that every process runs the same number of
    # forward passes (ZeRO-3 needs all of them in each); the padding rows carry no loss.
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
    """Greedy completions of `prompts` (left-padded, as the RL scripts feed them), cut after the first EOS."""
    ids = utils.tokenize_prompts(tokenizer, prompts, args.max_prompt_length)
    responses, _ = utils.complete(
        model, tokenizer, ids, args.response_length, args.per_device_eval_batch_size
    )
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

    # 1. Flags and accelerator.
    check_args(args)
    utils.check_output_dir(args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint))
    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    accelerator = utils.run.make_accelerator(args, ga, micro)
    args.world_size, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    world = args.world_size
    args.batch_size = micro * ga * world
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # takes the run name of a resumed run
    main_process, run_dir = accelerator.is_main_process, os.path.join(args.logging_dir, args.run_name)

    # 2. Data first, so that a bad dataset or flag fails before the model is loaded.
    tokenizer = utils.from_pretrained(AutoTokenizer, args.model_name_or_path, "--model_name_or_path")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {args.model_name_or_path} has no EOS token; SFT appends one.")
    if args.eos_token is not None:
        utils.chat.set_eos_token(tokenizer, args.eos_token)
    if tokenizer.pad_token_id is None:  # e.g. Pythia: pad with EOS (every mask here comes from lengths)
        tokenizer.pad_token = tokenizer.eos_token
    utils.chat.set_chat_template(tokenizer, args.chat_template_path)
    test_split = args.dataset_test_split if args.eval_strategy == "steps" else None
    train_split = utils.data.load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    train_rows, counts = tokenize_split(train_split, tokenizer, args, f"split {args.dataset_train_split!r}")
    eval_rows, eval_prompts, eval_references, eval_counts = [], [], [], {}
    if test_split is not None:
        eval_split = utils.data.load_split(args.dataset_name, test_split, args.dataset_config)
        where = f"split {test_split!r}"
        eval_rows, eval_counts = tokenize_split(eval_split, tokenizer, args, where)
        eval_prompts, eval_references = utils.data.sample_prompts(
            eval_split, tokenizer, where, args.num_samples, args.dataset_text_field
        )
    longest = max(len(row["input_ids"]) for row in train_rows + eval_rows)  # what the model will be run on
    utils.loading.check_context_length(args.model_name_or_path, longest, "--max_length")
    steps_per_epoch = len(train_rows) // args.batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"the training split has {len(train_rows)} sequences, fewer than one batch of {args.batch_size} "
            "(per_device_train_batch_size x gradient_accumulation_steps x processes); lower those flags."
        )
    args.total_steps = args.total_steps or max(1, int(args.num_train_epochs * steps_per_epoch))
    accelerator.print(f"train: {counts}, eval: {eval_counts}; {args.total_steps} steps of {args.batch_size}")

    # 3. Model (with LoRA adapters when asked), optimizer and schedule; the state of a resumed run.
    set_seed(args.seed)
    model = utils.from_pretrained(AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path")
    model.config.pad_token_id = tokenizer.pad_token_id
    if args.eos_token is not None:  # the saved model stops where its completions were taught to end
        model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    deepspeed = accelerator.state.deepspeed_plugin
    if args.gradient_checkpointing:
        utils.enable_gradient_checkpointing(model)
    if args.use_peft:
        from peft import LoraConfig, get_peft_model

        if deepspeed is not None and deepspeed.zero_stage == 3:
            raise ValueError("--use_peft merges the adapters when saving, which ZeRO-3 cannot; use ZeRO-2.")
        if args.gradient_checkpointing:
            model.enable_input_require_grads()  # frozen embeddings must still pass gradients to checkpoints
        targets = args.lora_target_modules or "all-linear"
        lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")  # fmt: skip
        model = get_peft_model(model, lora)
    params, decay = [p for p in model.parameters() if p.requires_grad], args.weight_decay
    optimizer = utils.run.adamw(params, args.learning_rate, eps=args.adam_epsilon, weight_decay=decay)
    warmup_steps = math.ceil(args.warmup_ratio * args.total_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, args.total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)  # the scheduler is stepped here, once per step
    set_seed(args.seed + rank)  # different dropout masks on each process
    print(utils.run.describe_sharding(model, accelerator), flush=True)
    resumed = checkpointer.resume({"model": model}, {"model": optimizer}) or {"step": 0, "num_tokens": 0}
    if resumed["step"]:
        scheduler.load_state_dict(resumed["scheduler"])
    tracker = utils.tracking.Tracker(args, accelerator, start_step=resumed["step"])

    def evaluate(step: int) -> float:
        model.eval()
        with accelerator.autocast():
            pad_id, batch_size = tokenizer.pad_token_id, args.per_device_eval_batch_size
            loss = evaluation_loss(model, eval_rows, batch_size, pad_id, accelerator)
            # Every process generates the same few samples: no gather, and ZeRO-3 has every rank in each step.
            unwrapped = accelerator.unwrap_model(model)
            samples = greedy_samples(unwrapped, tokenizer, eval_prompts, args) if eval_prompts else []
        model.train()
        accelerator.print(f"step {step}: eval/loss {loss:.4f}")
        tracker.log({"eval/loss": loss}, step)
        if main_process:
            if samples:
                prompt_ends = [p[-100:] for p in eval_prompts]
                table = {"prompt": prompt_ends, "sample": samples, "reference": eval_references}
                utils.print_samples(table, title=f"greedy samples, step {step}")
                markdown = "\n".join(f"| {p!r} | {s!r} | {r!r} |" for p, s, r in zip(*table.values()))
                tracker.writer.add_text(
                    "eval/samples", f"| prompt | sample | reference |\n|-|-|-|\n{markdown}", step
                )
                with open(os.path.join(run_dir, "samples.jsonl"), "a") as f:
                    for p, s, r in zip(eval_prompts, samples, eval_references):
                        f.write(json.dumps({"step": step, "prompt": p, "sample": s, "reference": r}) + "\n")
        return loss

    # 4. Training: the completion tokens' negative log-likelihood, evaluation and checkpoints every few steps.
    metrics = {"eval/initial_loss": evaluate(0)} if eval_rows and not resumed["step"] else {}
    window = torch.zeros(3, dtype=torch.float64)  # since the last log: nll sum, input tokens, seconds
    window_loss_tokens, num_tokens, epoch, generator = 0.0, resumed["num_tokens"], -1, torch.Generator()
    model.train()
    steps = range(resumed["step"] + 1, args.total_steps + 1)
    for step in tqdm(
        steps, disable=not main_process, desc="sft", initial=resumed["step"], total=args.total_steps
    ):
        step_start = time.time()
        # The same shuffled order on every process (seed + epoch); each process takes its own micro-batches.
        if (step - 1) // steps_per_epoch != epoch:
            epoch = (step - 1) // steps_per_epoch
            generator.manual_seed(args.seed + epoch)
            order = torch.randperm(len(train_rows), generator=generator).tolist()
        step_rows = order[((step - 1) % steps_per_epoch) * args.batch_size :][: args.batch_size]
        local_rows = [step_rows[(m * world + rank) * micro :][:micro] for m in range(ga)]
        batches = [collate([train_rows[i] for i in rows], tokenizer.pad_token_id) for rows in local_rows]
        # Normalise by the loss tokens of the whole optimizer batch (all micro-batches, all processes):
        # accelerate divides each micro-batch loss by `ga` and DDP averages over the processes, so dividing
        # each token sum by the mean token count per micro-batch gives the gradient of sum(nll) / sum(tokens).
        local_loss_tokens = sum((b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in batches).float()
        global_loss_tokens = accelerator.reduce(local_loss_tokens.to(device), "sum").item()
        per_micro_batch = max(global_loss_tokens, 1.0) / (ga * world)
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            with accelerator.accumulate(model), accelerator.autocast():
                nll, _ = sum_token_nll(model, batch)
                accelerator.backward(nll / per_micro_batch)
                grad_norm = utils.run.clip_grad_norm(accelerator, model, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            window[:2] += torch.tensor([nll.item(), batch["attention_mask"].sum().item()])
        grad_norm = utils.run.grad_norm_after_step(model, grad_norm)
        utils.tracking.check_finite(step, accelerator, loss=nll, grad_norm=grad_norm)
        if grad_norm is not None:
            metrics["train/grad_norm"] = grad_norm
        scheduler.step()
        window[2] += time.time() - step_start
        window_loss_tokens += global_loss_tokens

        if step % args.logging_steps == 0 or step == args.total_steps:
            nll_sum, tokens = accelerator.reduce(window[:2].to(device), "sum").tolist()
            num_tokens += int(tokens)
            metrics["train/loss"] = nll_sum / max(window_loss_tokens, 1.0)
            metrics["train/lr"] = scheduler.get_last_lr()[0]
            metrics["train/tokens_per_second"] = tokens / window[2].item()
            metrics["train/num_tokens"] = num_tokens
            tracker.log({k: v for k, v in metrics.items() if k.startswith("train/")}, step)
            window, window_loss_tokens = torch.zeros_like(window), 0.0
        if eval_rows and (step == args.total_steps or args.eval_steps and step % args.eval_steps == 0):
            metrics["eval/loss"] = evaluate(step)
        checkpointer.maybe_save(step, {"model": model}, {"model": optimizer},
                                state={"num_tokens": num_tokens, "scheduler": scheduler.state_dict()})  # fmt: skip

    # 5. Save: every process takes part (ZeRO-3 gathers the weights), the main process writes.
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if args.use_peft:
        unwrapped = unwrapped.merge_and_unload()
    state_dict = unwrapped.state_dict() if args.use_peft else accelerator.get_state_dict(model)
    metrics.update({f"data/num_{k}": v for k, v in counts.items()} | {"train/steps": args.total_steps})
    unwrapped.save_pretrained(args.output_dir, is_main_process=main_process, save_function=accelerator.save,
                              state_dict=state_dict)  # fmt: skip
    if main_process:
        tokenizer.save_pretrained(args.output_dir)
        data = f"{args.dataset_name} ({args.dataset_train_split})"
        utils.write_model_card(args.output_dir, "SFT", args.model_name_or_path, data, metrics)
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        if args.push_to_hub:
            utils.saving.push_to_hub(args)
    tracker.close()
    accelerator.print(f"saved to {args.output_dir}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    utils.run.end_run(accelerator)
    return metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
