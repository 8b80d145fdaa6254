# Reward modelling: Stiennon et al., "Learning to summarize from human feedback" (2020), Sec. 3.4
"""Train a reward model on pairwise preferences with the Bradley-Terry loss, then normalise its scores.

https://arxiv.org/abs/2009.01325. A language model with a scalar head reads a prompt x and a completion y and
returns a score r(x, y). For a pair where y_c was preferred over y_r, the model maximises
P(y_c > y_r) = sigmoid(r(x, y_c) - r(x, y_r) - margin), i.e. minimises -log sigmoid(r_c - r_r - margin).
The score is read at the last real token of prompt + completion + EOS with `utils.get_score`, the function
ppo.py and rloo.py use, so training and use agree. After training, the score head is shifted (and optionally
scaled) so that the reference completions of the SFT data score 0 on average, as in the paper; the result is
stored in the saved model, so every later user sees normalised scores.

Offline example on the tiny world (CPU, under a minute):
    python benchmark/tiny_world.py --output_dir tiny_world
    python reward.py --model_name_or_path tiny_world/policy --dataset_name tiny_world/dataset \
        --dataset_train_split preference --dataset_test_split preference_validation \
        --learning_rate 1e-3 --per_device_train_batch_size 16 --num_train_epochs 3 \
        --lr_scheduler_type constant_with_warmup --output_dir models/tiny_reward
"""

import json
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro

import utils
import utils.data

PROMPT, CHOSEN, REJECTED, MARGIN, COMPLETION = "prompt", "chosen", "rejected", "margin", "completion"


@dataclass
class Args:
    # --- run ---
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed of the experiment; two CPU runs with the same seed give the same weights"""
    run_name: str | None = None
    """name of the TensorBoard directory and W&B run; None uses {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """also log to Weights & Biases (set WANDB_MODE=offline to log without network)"""
    wandb_project_name: str = "rlhf-reference"
    """W&B project name"""
    wandb_entity: str | None = None
    """W&B entity (team); None uses the default one"""
    logging_dir: str = "runs"
    """TensorBoard logs go to {logging_dir}/{run_name}"""
    output_dir: str = "models/reward"
    """where the reward model, its tokenizer, a model card (README.md) and metrics.json are written"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir: its contents are moved aside to <output_dir>.replaced-<time>"""
    push_to_hub: bool = False
    """push --output_dir (without its checkpoints) to the Hugging Face hub at the end"""
    hub_model_id: str | None = None
    """hub repository for --push_to_hub; None: named like --output_dir"""
    save_steps: int = 0
    """write a checkpoint ({output_dir}/checkpoint-{step}) every this many optimizer steps (0: only on SIGTERM)"""
    save_total_limit: int | None = None
    """keep only the newest this many checkpoints (None: all)"""
    resume_from_checkpoint: str | None = None
    """a checkpoint-{step} folder, or `latest` (the newest in --output_dir), to continue exactly from"""

    # --- model and data ---
    model_name_or_path: str = "models/sft"
    """model to start from: a causal LM (the SFT model: it gets a new score head) or a one-label classifier"""
    dataset_name: str = "data/tldr/preference"
    """pairs (prompt, chosen, rejected, optional margin; or chosen, rejected with an implicit prompt), standard
    or conversational: hub id, save_to_disk dir, or json/jsonl/parquet"""
    dataset_config: str | None = None
    """dataset configuration: the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str | None = "test"
    """split evaluated every --eval_steps and at the end; None skips evaluation"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) whose chat template renders conversational data"""
    eval_group_by: str | None = None
    """a column of the test split: accuracy is also reported for each of its values"""
    max_length: int = 1024
    """longest prompt + completion + EOS in tokens: the prompt is cut from the left, a pair whose longer
    completion alone does not fit is dropped (both counted)"""
    normalize: bool = True
    """after training, shift the score so that the reference completions of --normalize_split average 0"""
    normalize_dataset: str | None = None
    """prompt-completion data holding the reference completions; None uses --dataset_name"""
    normalize_split: str | None = None
    """split of --normalize_dataset to normalise on; None: `sft`, and no normalization when neither this nor
    --normalize_dataset is given and --dataset_name has no `sft` split (as in TRL's datasets)"""
    normalize_std: bool = False
    """also scale the score so that the reference completions' scores have standard deviation 1"""

    # --- training ---
    learning_rate: float = 3e-6
    """learning rate of AdamW"""
    per_device_train_batch_size: int = 8
    """pairs per forward pass and process (chosen and rejected go through together: twice as many rows)"""
    per_device_eval_batch_size: int = 8
    """pairs (or reference completions) per evaluation forward pass and process"""
    gradient_accumulation_steps: int = 1
    """forward passes whose gradients are summed into one optimizer step"""
    num_train_epochs: int = 1
    """passes over the training pairs (unless --total_steps is set)"""
    total_steps: Annotated[int | None, tyro.conf.arg(aliases=("--max_steps",))] = None
    """optimizer steps to train (alias --max_steps); None trains for --num_train_epochs"""
    lr_scheduler_type: Literal["linear", "cosine", "constant_with_warmup"] = "cosine"
    """learning-rate schedule after the warmup"""
    warmup_ratio: float = 0.0
    """fraction of the optimizer steps spent warming the learning rate up from 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """gradients are clipped to this global norm (0 turns clipping off)"""
    center_rewards_coefficient: float | None = None
    """adds coefficient * mean((r_c + r_r)^2) to the loss, pulling scores toward 0 (Eisenstein et al.: 0.01)"""
    disable_dropout: bool = True
    """turn every dropout of the model off"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bf16 mixed precision (without it: the accelerate config's choice, fp32 when launched plainly)"""

    # --- logging ---
    logging_steps: int = 10
    """log training metrics every this many optimizer steps"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """steps: evaluate on --dataset_test_split every --eval_steps and at the end; no: never"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (0: only at the end)"""

    # --- filled in at runtime ---
    world_size: int = 0
    """number of processes (filled in at runtime)"""
    batch_size: int = 0
    """pairs per optimizer step over all processes (filled in at runtime)"""
    num_training_steps: int = 0
    """optimizer steps of the run (filled in at runtime)"""


# --- the loss: pure functions on tensors --------------------------------------------------------------------
def reward_loss(chosen, rejected, margin=None, center_rewards_coefficient=None) -> torch.Tensor:
    """Bradley-Terry loss of a batch of pairs (scores [B] each): mean of -log sigmoid(r_c - r_r - margin),
    plus center_rewards_coefficient * mean((r_c + r_r)^2) when set (Eisenstein et al. 2023)."""
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


# --- data: token ids, truncation, batches -------------------------------------------------------------------
def completion_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each completion ending with EOS (added unless the text already ends with it): the score is
    read at that EOS, as in ppo.py / rloo.py where responses are cut after their EOS."""
    eos = tokenizer.eos_token_id
    rows = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [row if row and row[-1] == eos else row + [eos] for row in rows]


def fit_to_max_length(prompt: list[int], completions: list[list[int]], max_length: int):
    """prompt + completion for each completion, the prompt cut from the left so that the longest one fits.

    Completions are never cut (a cut completion would lose the EOS where the score is read), and all of them
    keep the same prompt tokens. Returns (sequences, prompt_was_cut), or (None, False) when the longest
    completion leaves no room for a single prompt token: the row is dropped."""
    room = max_length - max(len(c) for c in completions)
    if room < 1:
        return None, False
    kept = prompt[-room:]
    return [kept + c for c in completions], len(kept) < len(prompt)


def tokenize_rows(
    tokenizer,
    dataset,
    columns: list[str],
    max_length: int,
    group_by: str | None = None,
    where: str = "the dataset",
):
    """Rows {index, sequences (one per completion column), margin, group}, counts of rows / cut / dropped, and
    the sorted names of the groups (values of column `group_by`) that `group` indexes. The columns are
    [chosen, rejected] of preference pairs or [completion] of prompt-completion data, in any of TRL's formats
    (utils.data: standard or conversational, explicit or implicit prompt)."""
    if columns == [COMPLETION]:
        prompt_texts, completion_texts = utils.data.prompt_completion_texts(dataset, tokenizer, where)
        texts = {PROMPT: prompt_texts, COMPLETION: completion_texts}
    else:
        texts = utils.data.preference_texts(dataset, tokenizer, where)
    prompts = utils.tokenize_prompts(tokenizer, texts[PROMPT])
    completions = [completion_ids(tokenizer, texts[c]) for c in columns]
    margins = list(dataset[MARGIN]) if MARGIN in dataset.column_names else [0.0] * len(dataset)
    values = [str(v) for v in dataset[group_by]] if group_by else [""] * len(dataset)
    group_names = sorted(set(values))
    group_index = {name: g for g, name in enumerate(group_names)}
    rows, cut, dropped = [], 0, 0
    for i, prompt in enumerate(prompts):
        sequences, was_cut = fit_to_max_length(prompt, [c[i] for c in completions], max_length)
        cut, dropped = cut + was_cut, dropped + (sequences is None)
        if sequences is not None:
            group, margin = group_index[values[i]], float(margins[i])
            rows.append({"index": i, "sequences": sequences, "margin": margin, "group": group})
    return rows, {"rows": len(dataset), "prompt_cut": cut, "dropped": dropped}, group_names


def collate(rows: list[dict], pad_token_id: int) -> dict:
    """Right-padded batch of the k completions of B rows, completion-major: with pairs, input_ids [2B, T]
    holds the B chosen sequences and then the B rejected ones, so that one forward pass scores both."""
    sequences = [row["sequences"][j] for j in range(len(rows[0]["sequences"])) for row in rows]
    input_ids = utils.pad(sequences, pad_token_id, "right")
    lengths = torch.tensor([len(s) for s in sequences])
    return {
        "input_ids": input_ids,
        "attention_mask": utils.lengths_to_mask(lengths, input_ids.size(1)).long(),
        "margin": torch.tensor([row["margin"] for row in rows], dtype=torch.float32),
        "group": torch.tensor([row["group"] for row in rows]),
    }


# --- the model: scoring wrapper, loading and saving, normalisation ------------------------------------------
class ScoreModel(nn.Module):
    """A sequence classifier whose forward is `utils.get_score`. get_score calls the backbone and the head
    directly; preparing this wrapper (not the classifier) with accelerate puts that call inside DDP's or
    DeepSpeed's forward, so gradients are synchronised."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return utils.get_score(self.model, input_ids, attention_mask)


def biased_head(model: nn.Module) -> nn.Linear:
    """The score head. Many classes (Llama's, GPT-NeoX's) make it without bias and load none: such a head is
    replaced by an equal nn.Linear whose bias, `config.score_bias` (0 at first), is kept in the config."""
    _, head = utils.score_head(model)
    if head.bias is None:
        biased = nn.Linear(head.in_features, 1, device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            biased.weight.copy_(head.weight)
            biased.bias.fill_(getattr(model.config, "score_bias", None) or 0.0)
        setattr(model, "score" if hasattr(model, "score") else "classifier", biased)
        model.config.score_bias, head = biased.bias.item(), biased
    return head


@torch.no_grad()
def normalize_score_head(model: nn.Module, mean: float, std: float = 1.0) -> None:
    """Edit the score head so that the model's score s becomes (s - mean) / std."""
    head = biased_head(model)
    head.weight.div_(std)
    head.bias.sub_(mean).div_(std)
    if getattr(model.config, "score_bias", None) is not None:
        model.config.score_bias = head.bias.item()


def save_reward_model(model: nn.Module, output_dir: str, state_dict: dict | None = None, **kwargs) -> None:
    """`save_pretrained`; a bias the head's class lacks goes to `config.score_bias`, not to the weights, so
    that a plain from_pretrained loads them cleanly."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    if getattr(model.config, "score_bias", None) is not None:
        key = ("score" if hasattr(model, "score") else "classifier") + ".bias"
        model.config.score_bias = state_dict[key].item()  # training (the centering term) may have moved it
        state_dict = {name: value for name, value in state_dict.items() if name != key}
    model.save_pretrained(output_dir, state_dict=state_dict, **kwargs)


def load_reward_model(path: str, flag: str = "--model_name_or_path", **kwargs) -> nn.Module:
    """AutoModelForSequenceClassification from `path`, with the head bias of `config.score_bias` put back.
    A plain from_pretrained loads a head without bias; utils.get_score then adds `config.score_bias` itself, so
    ppo.py and rloo.py see the normalized scores either way."""
    from transformers import AutoModelForSequenceClassification

    model = utils.from_pretrained(AutoModelForSequenceClassification, path, flag, **kwargs)
    if getattr(model.config, "score_bias", None) is not None:
        biased_head(model)
    return model


@torch.no_grad()
def gather_scores(score_model: nn.Module, loader, accelerator):
    """Scores [N, k] of the k completions of every row of a prepared loader, gathered over the processes (each
    row once, in dataset order), with the margins [N] and group indices [N]."""
    out = []
    for batch in loader:
        with accelerator.autocast():
            scores = score_model(batch["input_ids"], batch["attention_mask"]).float()
        per_row = scores.view(-1, batch["margin"].numel()).T  # [k * B] completion-major -> [B, k]
        extra = torch.stack([batch["margin"], batch["group"].float()], 1)
        out.append(accelerator.gather_for_metrics(torch.cat([per_row, extra], 1)))
    out = torch.cat(out).cpu()
    return out[:, :-2], out[:, -2], out[:, -1].long()


def eval_metrics(scores, margins, groups, group_names: list[str], center_rewards_coefficient=None) -> dict:
    """Accuracy (r_c > r_r), loss and reward statistics of scored pairs (scores [N, 2]: chosen, rejected)."""
    chosen, rejected = scores[:, 0], scores[:, 1]
    correct = (chosen > rejected).float()
    metrics = {
        "eval/accuracy": correct.mean().item(),
        "eval/loss": reward_loss(chosen, rejected, margins, center_rewards_coefficient).item(),
        "eval/mean_reward": scores.mean().item(),
        "eval/std_reward": scores.std().item(),
        "eval/num_pairs": len(scores),
    }
    for g, name in enumerate(group_names if len(group_names) > 1 else []):
        if (groups == g).any():
            metrics[f"eval/accuracy/{name}"] = correct[groups == g].mean().item()
    return metrics


# --- the run ------------------------------------------------------------------------------------------------
def check_args(args: Args) -> None:
    """One clear error for an impossible flag value."""
    if args.max_length < 2:
        raise ValueError(f"--max_length must be at least 2 (a prompt token and EOS), got {args.max_length}.")
    if min(args.per_device_train_batch_size, args.per_device_eval_batch_size) < 1:
        raise ValueError("--per_device_train_batch_size and --per_device_eval_batch_size must be at least 1.")
    total_steps = 1 if args.total_steps is None else args.total_steps
    if min(args.num_train_epochs, args.gradient_accumulation_steps, total_steps) < 1:
        raise ValueError("--num_train_epochs, --total_steps and --gradient_accumulation_steps must be >= 1.")
    if args.logging_steps < 1 or args.eval_steps < 0:
        raise ValueError("--logging_steps must be at least 1 and --eval_steps at least 0.")
    if args.eval_group_by and not args.dataset_test_split:
        raise ValueError("--eval_group_by needs a --dataset_test_split to evaluate on.")


def load_data(args: Args, tokenizer) -> dict:
    """Every split the run needs, checked and tokenized: {name: (rows, counts, group_names)}."""
    pairs, name, config = [CHOSEN, REJECTED], "--dataset_name", args.dataset_config
    splits = {"train": (args.dataset_name, config, args.dataset_train_split, pairs, None, name)}
    if args.dataset_test_split and args.eval_strategy == "steps":
        splits["test"] = (args.dataset_name, config, args.dataset_test_split, pairs, args.eval_group_by, name)
    optional_normalize = args.normalize_dataset is None and args.normalize_split is None
    if args.normalize:
        dataset_name, split = args.normalize_dataset or args.dataset_name, args.normalize_split or "sft"
        config = config if args.normalize_dataset is None else None
        splits["normalize"] = (dataset_name, config, split, [COMPLETION], None, "--normalize_dataset")
    data = {}
    for key, (dataset_name, config, split, columns, group_by, flag) in splits.items():
        try:
            dataset = utils.data.load_split(dataset_name, split, config, flag)
        except ValueError:
            if key != "normalize" or not optional_normalize:
                raise
            print(
                f"{dataset_name} has no split 'sft' of reference completions: the scores are not normalized."
            )
            args.normalize = False
            continue
        where = f"{flag} {dataset_name} split {split!r}"
        if group_by:
            utils.check_columns(dataset, [group_by], where)
        data[key] = tokenize_rows(tokenizer, dataset, columns, args.max_length, group_by, where)
        if not data[key][0]:
            raise ValueError(f"{where}: every row is longer than --max_length {args.max_length}; raise it.")
        if key == "normalize" and args.normalize_std and len(data[key][0]) < 2:
            raise ValueError(f"{where}: --normalize_std needs at least two reference completions.")
    return data


def main(args: Args) -> None:

    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import AutoConfig, get_scheduler

    # 1. Checks and data, before any model is loaded.
    check_args(args)
    utils.check_output_dir(args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint))
    tokenizer = utils.load_tokenizer(args.model_name_or_path, "--model_name_or_path", args.chat_template_path)
    if tokenizer.eos_token is None:
        raise ValueError(f"the tokenizer of {args.model_name_or_path} has no EOS token to read the score at.")
    data = load_data(args, tokenizer)
    config = utils.from_pretrained(AutoConfig, args.model_name_or_path, "--model_name_or_path")
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if is_classifier and config.num_labels != 1:
        raise ValueError(
            f"--model_name_or_path {args.model_name_or_path} is a classifier with {config.num_labels} labels; "
            "a reward model has exactly one (num_labels=1)."
        )

    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    accelerator = utils.run.make_accelerator(args, ga, micro)
    set_seed(args.seed)
    device, is_main, rank = accelerator.device, accelerator.is_main_process, accelerator.process_index
    args.world_size = world = accelerator.num_processes
    args.batch_size = micro * ga * world
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # takes the run name of a resumed run
    for key, (rows, counts, _) in data.items():
        accelerator.print(
            f"{key}: kept {len(rows)} of {counts['rows']} rows ({counts['prompt_cut']} with the prompt cut from "
            f"the left), dropped {counts['dropped']} whose completion does not fit in --max_length"
        )

    def loader(rows, batch_size):
        collate_fn = lambda batch: collate(batch, tokenizer.pad_token_id)  # noqa: E731
        return DataLoader(rows, batch_size, collate_fn=collate_fn)

    train_rows = data["train"][0]
    micro_per_epoch = len(train_rows) // (micro * world)
    if micro_per_epoch < ga:
        raise ValueError(
            f"the training split has {len(train_rows)} pairs, fewer than one batch of {args.batch_size} "
            "(per_device_train_batch_size x gradient_accumulation_steps x processes); lower those flags."
        )

    def micro_batch(m: int) -> dict:
        """This process's m-th micro-batch (utils.shuffled_micro_batch: found again exactly on resume)."""
        rows = utils.shuffled_micro_batch(len(train_rows), m, micro, world, rank, args.seed)
        batch = collate([train_rows[j] for j in rows], tokenizer.pad_token_id)
        return {key: value.to(device) for key, value in batch.items()}

    # 2. Model: a sequence classifier with one label (a causal LM gets a newly initialised score head).
    model = load_reward_model(args.model_name_or_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    if args.disable_dropout:
        utils.disable_dropout(model)
    if args.gradient_checkpointing:
        utils.enable_gradient_checkpointing(model)
    optimizer = utils.run.adamw(model.parameters(), lr=args.learning_rate, eps=args.adam_epsilon,
                                  weight_decay=args.weight_decay)  # fmt: skip
    score_model, optimizer = accelerator.prepare(ScoreModel(model), optimizer)
    if "test" in data:
        eval_loader = accelerator.prepare(loader(data["test"][0], args.per_device_eval_batch_size))
    steps_per_epoch = micro_per_epoch // ga
    args.num_training_steps = args.total_steps or steps_per_epoch * args.num_train_epochs
    # stepped once per optimizer step, not prepared (accelerate would step it once per process)
    warmup_steps = int(args.warmup_ratio * args.num_training_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, args.num_training_steps)
    print(utils.run.describe_sharding(score_model, accelerator), flush=True)
    resumed = checkpointer.resume({"model": score_model}, {"model": optimizer}) or {"step": 0}
    if resumed["step"]:
        scheduler.load_state_dict(resumed["scheduler"])
    tracker = utils.tracking.Tracker(args, accelerator, start_step=resumed["step"])
    log = tracker.log

    def evaluate(scorer: nn.Module, step: int) -> dict:
        scorer.eval()
        scores, margins, groups = gather_scores(scorer, eval_loader, accelerator)
        scorer.train()
        metrics = eval_metrics(scores, margins, groups, data["test"][2], args.center_rewards_coefficient)
        log(metrics, step)
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    # 3. Training: one forward pass per batch scores the chosen and the rejected completions.
    global_step, final_metrics, start = resumed["step"], {}, time.time()
    # sums over the logging window: loss * pairs, correct pairs, r_c - r_r, pairs
    sums = torch.zeros(4, device=device)
    progress = tqdm(
        total=args.num_training_steps, initial=global_step, desc="reward model", disable=not is_main
    )
    score_model.train()
    while global_step < args.num_training_steps:
        for m in range(global_step * ga, (global_step + 1) * ga):
            batch = micro_batch(m)
            with accelerator.accumulate(score_model):
                scores = score_model(batch["input_ids"], batch["attention_mask"]).float()
                chosen, rejected = scores.view(2, -1)  # the batch is [chosen rows; rejected rows]
                loss = reward_loss(chosen, rejected, batch["margin"], args.center_rewards_coefficient)
                accelerator.backward(loss)
                grad_norm = utils.run.clip_grad_norm(accelerator, score_model, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                pairs = torch.tensor(float(chosen.numel()), device=device)
                sums += torch.stack(
                    [loss * pairs, (chosen > rejected).sum(), (chosen - rejected).sum(), pairs]
                )
        scheduler.step()
        global_step += 1
        progress.update()
        grad_norm = utils.run.grad_norm_after_step(score_model, grad_norm)
        utils.tracking.check_finite(global_step, accelerator, loss=loss, grad_norm=grad_norm)
        if global_step % args.logging_steps == 0 or global_step == args.num_training_steps:
            loss_sum, correct, margin_sum, count = accelerator.reduce(sums, reduction="sum").tolist()
            sums.zero_()
            train = {"train/loss": loss_sum / count, "train/accuracy": correct / count}
            train |= {"train/margin": margin_sum / count, "train/lr": scheduler.get_last_lr()[0]}
            if grad_norm is not None:
                train["train/grad_norm"] = grad_norm
            log(train | {"train/epoch": global_step / steps_per_epoch}, global_step)
            progress.set_postfix(loss=train["train/loss"], accuracy=train["train/accuracy"])
            final_metrics.update(train)
        if "test" in data and args.eval_steps and global_step % args.eval_steps == 0:
            if global_step < args.num_training_steps:  # the last evaluation follows the loop
                evaluate(score_model, global_step)
        checkpointer.maybe_save(global_step, {"model": score_model}, {"model": optimizer},
                                state={"scheduler": scheduler.state_dict()})  # fmt: skip
    progress.close()
    final_metrics["train/seconds"] = time.time() - start
    if "test" in data:
        final_metrics.update(evaluate(score_model, global_step))

    # 4. Save: every process takes part (ZeRO-3 gathers the weights); the tokenizer goes beside.
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(score_model)
    if is_main:
        state_dict = {key.removeprefix("model."): value for key, value in state_dict.items()}
        save_reward_model(accelerator.unwrap_model(score_model).model, args.output_dir, state_dict,
                          save_function=accelerator.save)  # fmt: skip
        tokenizer.save_pretrained(args.output_dir)
    accelerator.wait_for_everyone()
    del score_model, optimizer, model, state_dict
    accelerator.free_memory()

    # 5. Normalisation: reference completions' mean score -> 0 (std -> 1), measured again after reloading.
    # Every process loads the whole saved model (outside ZeRO-3's sharded init) and scores its share.
    if args.normalize:
        norm_loader = accelerator.prepare(loader(data["normalize"][0], args.per_device_eval_batch_size))
        with utils.run.unsharded_loading(accelerator):
            trained = load_reward_model(args.output_dir, "--output_dir").to(device).eval()
        before = gather_scores(ScoreModel(trained), norm_loader, accelerator)[0][:, 0]
        mean, std = before.mean().item(), before.std().item()
        if args.normalize_std and not std > 0:
            raise ValueError("the reference completions all score the same: --normalize_std cannot scale.")
        normalize_score_head(trained, mean, std if args.normalize_std else 1.0)
        if is_main:
            save_reward_model(trained, args.output_dir)
        accelerator.wait_for_everyone()
        with utils.run.unsharded_loading(accelerator):
            reloaded = load_reward_model(args.output_dir, "--output_dir").to(device).eval()
        after = gather_scores(ScoreModel(reloaded), norm_loader, accelerator)[0][:, 0]
        stats = {"normalize/mean_before": mean, "normalize/std_before": std}
        stats |= {"normalize/mean_after": after.mean().item(), "normalize/std_after": after.std().item()}
        log(stats, global_step)
        final_metrics.update(stats)
        accelerator.print(", ".join(f"{k} {v:.4f}" for k, v in stats.items()))

    if is_main:
        for key, (rows, counts, _) in data.items():
            final_metrics |= {f"data/{key}_rows": len(rows), f"data/{key}_prompt_cut": counts["prompt_cut"],
                              f"data/{key}_dropped": counts["dropped"]}  # fmt: skip
        dataset = f"{args.dataset_name} ({args.dataset_train_split})"
        algorithm = "reward model (Bradley-Terry)"
        utils.write_model_card(args.output_dir, algorithm, args.model_name_or_path, dataset, final_metrics)
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump(final_metrics, f, indent=2)
        if args.push_to_hub:
            utils.saving.push_to_hub(args)
        print(f"reward model written to {args.output_dir}")
    tracker.close()
    utils.run.end_run(accelerator)


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
