"""Reward modelling: fit a reward model to pairwise preferences (Bradley-Terry loss), then normalise it.

Stiennon et al. 2020, "Learning to summarize from human feedback", Sec. 3.4
(https://arxiv.org/abs/2009.01325). A language model with a scalar head reads a prompt x and a completion y
and returns a score r(x, y). For a pair where y_c was preferred over y_r, the model maximises
P(y_c > y_r) = sigmoid(r(x, y_c) - r(x, y_r) - margin), i.e. minimises -log sigmoid(r_c - r_r - margin).
The score is read at the last real token of prompt + completion + EOS with `utils.reward_model.get_score`, the
function the RL scripts use, so training and use agree. After training, the score head is shifted (and
optionally scaled) so that the reference completions of the SFT data score 0 on average, as in the paper;
the saved model holds the normalised head.

    python benchmark/tiny/tiny_world.py --output_dir tiny_world
    python reward.py --model_name_or_path tiny_world/policy --dataset_name tiny_world/dataset \
        --dataset_train_split preference --dataset_test_split preference_validation \
        --learning_rate 1e-3 --per_device_train_batch_size 16 --num_train_epochs 3 \
        --lr_scheduler_type constant_with_warmup --output_dir models/tiny_reward
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro

import utils.checkpoint
import utils.data
import utils.examples
import utils.generation
import utils.loading
import utils.reward_model
import utils.run
import utils.saving
import utils.tracking
from utils.run import UsageError

PROMPT, CHOSEN, REJECTED, MARGIN, COMPLETION = "prompt", "chosen", "rejected", "margin", "completion"


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed of the run; two CPU runs with the same seed give the same weights"""
    run_name: str | None = None
    """TensorBoard/W&B run name; None: {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """also log to Weights & Biases (WANDB_MODE=offline logs without network)"""
    wandb_project_name: str = "rlhf-reference"
    """W&B project name"""
    wandb_entity: str | None = None
    """W&B entity (team); None: the default one"""
    logging_dir: str = "runs"
    """TensorBoard logs go to {logging_dir}/{run_name}"""
    output_dir: str = "models/reward"
    """where the reward model, its tokenizer, a model card and metrics.json are written"""
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
    model_name_or_path: str = "models/sft"
    """model to start from: a causal LM (the SFT model, given a new score head) or a one-label classifier"""
    model_revision: str = "main"
    """revision (branch, tag or commit) of --model_name_or_path on the hub"""
    trust_remote_code: bool = False
    """let hub models and tokenizers run their own modelling code (every load)"""
    attn_implementation: str | None = None
    """attention of the trained model (and its reference): eager, sdpa, flash_attention_2...; None: the default"""
    dataset_name: str = "data/tldr/preference"
    """preference pairs (optional margin column) in any of TRL's formats: hub id, save_to_disk dir or files"""
    dataset_config: str | None = None
    """the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str | None = "test"
    """split evaluated every --eval_steps and at the end; None: no evaluation"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) with the chat template for conversational data"""
    eval_group_by: str | None = None
    """a column of the test split: accuracy is also reported for each of its values"""
    context_overflow: Literal["refuse", "cut"] = "refuse"
    """sequences longer than the model's positions: refuse (before loading it) or cut them to fit (one line)"""
    max_length: int = 1024
    """longest prompt + completion + EOS: a pair with a longer chosen or rejected sequence is dropped"""
    normalize: bool = True
    """after training, shift the score so that the reference completions of --normalize_split average 0"""
    normalize_dataset: str | None = None
    """prompt-completion data holding the reference completions; None: --dataset_name"""
    normalize_split: str | None = None
    """split of --normalize_dataset; None: `sft` (when neither flag is given and it is missing: none)"""
    normalize_std: bool = False
    """also scale the score so that the reference completions' scores have standard deviation 1"""

    # Algorithm
    learning_rate: float = 3e-6
    """learning rate of AdamW"""
    per_device_train_batch_size: int = 8
    """pairs per forward pass and process (chosen and rejected together: twice as many rows)"""
    per_device_eval_batch_size: int = 8
    """pairs (or reference completions) per evaluation forward pass and process"""
    gradient_accumulation_steps: int = 1
    """forward passes whose gradients are summed into one optimizer step"""
    num_train_epochs: int = 1
    """passes over the training pairs (unless --total_steps is set)"""
    total_steps: Annotated[int | None, tyro.conf.arg(aliases=("--max_steps",))] = None
    """optimizer steps (alias --max_steps); None: from --num_train_epochs"""
    lr_scheduler_type: Literal["linear", "cosine", "constant_with_warmup"] = "cosine"
    """learning-rate schedule after the warmup"""
    warmup_ratio: float = 0.0
    """fraction of the steps warming the learning rate up from 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (0: no clipping)"""
    center_rewards_coefficient: float | None = None
    """add coefficient * mean((r_c + r_r)^2) to the loss, pulling scores to 0 (Eisenstein et al.: 0.01)"""
    disable_dropout: bool = True
    """turn every dropout of the model off"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bfloat16 mixed precision (without it: the accelerate config's choice)"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters instead of every weight (the score head trains whole)"""
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
    lora_task_type: Literal["SEQ_CLS"] = "SEQ_CLS"
    """peft's task type: a reward model is a sequence classifier (TRL's default, CAUSAL_LM, would not train the head)"""

    # Logging
    logging_steps: int = 10
    """log training metrics every this many optimizer steps"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """steps: evaluate on --dataset_test_split every --eval_steps and at the end; no: never"""
    eval_steps: int = 100
    """evaluate every this many steps (0: only at the end)"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes"""
    batch_size: int = 0
    """pairs per optimizer step, over all processes"""
    num_training_steps: int = 0
    """optimizer steps of the run"""


# ---- the math ----------------------------------------------------------------------------------------------
def reward_loss(chosen, rejected, margin=None, center_rewards_coefficient=None) -> torch.Tensor:
    """Bradley-Terry loss of pairs (scores [B] each): mean of -log sigmoid(r_c - r_r - margin), plus
    center_rewards_coefficient * mean((r_c + r_r)^2) when set (Eisenstein et al. 2023)."""
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


def eval_metrics(scores, margins, groups, group_names: list[str], center_rewards_coefficient=None) -> dict:
    """Accuracy (r_c > r_r), loss and score statistics of scored pairs (scores [N, 2]: chosen, rejected)."""
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


# ---- the reward model --------------------------------------------------------------------------------------
class ScoreModel(nn.Module):
    """A sequence classifier whose forward is `utils.reward_model.get_score`."""

    # get_score calls the backbone and head directly: preparing this wrapper puts them inside DDP's forward.
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return utils.reward_model.get_score(self.model, input_ids, attention_mask)


def biased_head(model: nn.Module) -> nn.Linear:
    """The score head, given a bias (`config.score_bias`, 0 at first) where its class has none (Llama)."""
    _, head = utils.reward_model.score_head(model)
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
    """`save_pretrained`; a head bias the class lacks goes to `config.score_bias`, not to the weights."""
    # So that a plain from_pretrained loads the weights cleanly.
    state_dict = model.state_dict() if state_dict is None else state_dict
    if getattr(model.config, "score_bias", None) is not None:
        key = ("score" if hasattr(model, "score") else "classifier") + ".bias"
        model.config.score_bias = state_dict[key].item()  # training (the centering term) may have moved it
        state_dict = {name: value for name, value in state_dict.items() if name != key}
    with utils.loading.config_dropout_kept(model):
        model.save_pretrained(output_dir, state_dict=state_dict, **kwargs)


def load_reward_model(path: str, flag: str = "--model_name_or_path", **kwargs) -> nn.Module:
    """AutoModelForSequenceClassification from `path`, the head bias of `config.score_bias` put back."""
    # A plain from_pretrained loads no bias; get_score then adds config.score_bias itself: the same scores.
    from transformers import AutoModelForSequenceClassification

    model = utils.loading.from_pretrained(AutoModelForSequenceClassification, path, flag, **kwargs)
    if getattr(model.config, "score_bias", None) is not None:
        biased_head(model)
    return model


@torch.no_grad()
def gather_scores(score_model: nn.Module, loader, accelerator):
    """Scores [N, k] of the k completions of every row of a prepared loader, in dataset order over all
    processes, with the margins [N] and group indices [N]."""
    out = []
    for batch in loader:
        with accelerator.autocast():
            scores = score_model(batch["input_ids"], batch["attention_mask"]).float()
        per_row = scores.view(-1, batch["margin"].numel()).T  # [k * B] completion-major -> [B, k]
        extra = torch.stack([batch["margin"], batch["group"].float()], 1)
        out.append(accelerator.gather_for_metrics(torch.cat([per_row, extra], 1)))
    out = torch.cat(out).cpu()
    return out[:, :-2], out[:, -2], out[:, -1].long()


# ---- data --------------------------------------------------------------------------------------------------
def tokenize_rows(
    tokenizer,
    dataset,
    columns: list[str],
    max_length: int,
    group_by: str | None = None,
    where: str = "the dataset",
):
    """Rows {index, sequences (one per column), margin, group}, counts of rows / dropped (a sequence longer
    than `max_length`), and the sorted group names (values of column `group_by`). Columns: [chosen, rejected]
    of pairs or [completion]."""
    ids = utils.examples.reward_ids(dataset, tokenizer, where, columns)
    prompts, completions = ids[PROMPT], [ids[c] for c in columns]
    margins = list(dataset[MARGIN]) if MARGIN in dataset.column_names else [0.0] * len(dataset)
    values = [str(v) for v in dataset[group_by]] if group_by else [""] * len(dataset)
    group_names = sorted(set(values))
    group_index = {name: g for g, name in enumerate(group_names)}
    rows, dropped = [], 0
    for i, prompt in enumerate(prompts):
        sequences = [prompt + c[i] for c in completions]
        if max(map(len, sequences)) > max_length:  # dropped whole, never cut, as TRL 1.16's RewardTrainer
            dropped += 1
            continue
        group, margin = group_index[values[i]], float(margins[i])
        rows.append({"index": i, "sequences": sequences, "margin": margin, "group": group})
    return rows, {"rows": len(dataset), "dropped": dropped}, group_names


def collate(rows: list[dict], pad_token_id: int) -> dict:
    """Right-padded batch of the k completions of B rows, completion-major: input_ids [k * B, T] holds the B
    chosen sequences, then the B rejected ones, so that one forward pass scores both."""
    sequences = [row["sequences"][j] for j in range(len(rows[0]["sequences"])) for row in rows]
    input_ids = utils.generation.pad(sequences, pad_token_id, "right")
    lengths = torch.tensor([len(s) for s in sequences])
    return {
        "input_ids": input_ids,
        "attention_mask": utils.generation.lengths_to_mask(lengths, input_ids.size(1)).long(),
        "margin": torch.tensor([row["margin"] for row in rows], dtype=torch.float32),
        "group": torch.tensor([row["group"] for row in rows]),
    }


def loader(rows: list[dict], batch_size: int, pad_token_id: int):
    """An evaluation DataLoader of rows, in order."""
    from torch.utils.data import DataLoader

    return DataLoader(rows, batch_size, collate_fn=lambda batch: collate(batch, pad_token_id))


def micro_batch(args: Args, run: "Run", m: int) -> dict:
    """This process's m-th micro-batch, found again exactly on resume (utils.examples.shuffled_micro_batch)."""
    accelerator, micro = run.accelerator, args.per_device_train_batch_size
    rank, world = accelerator.process_index, accelerator.num_processes
    rows = utils.examples.shuffled_micro_batch(len(run.train_rows), m, micro, world, rank, args.seed)
    batch = collate([run.train_rows[j] for j in rows], run.tokenizer.pad_token_id)
    return {key: value.to(accelerator.device) for key, value in batch.items()}


def load_data(args: Args, tokenizer) -> dict:
    """Every split the run needs, checked and tokenized: {name: (rows, counts, group_names)}."""
    pairs, name, config = [CHOSEN, REJECTED], "--dataset_name", args.dataset_config
    splits = {"train": (args.dataset_name, config, args.dataset_train_split, pairs, None, name)}
    test_split = args.dataset_test_split if args.eval_strategy == "steps" else None
    if test_split == Args.dataset_test_split and "--dataset_test_split" not in " ".join(sys.argv[1:]):
        if not utils.data.has_split(args.dataset_name, test_split, config):  # as TRL: no eval
            if utils.run.main_process():
                print(
                    f'reward.py: no "{test_split}" split in {args.dataset_name}: evaluation skipped '
                    "(give --dataset_test_split to evaluate)"
                )
            test_split = None
    if test_split:
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
            utils.data.check_columns(dataset, [group_by], where)
        data[key] = tokenize_rows(tokenizer, dataset, columns, args.max_length, group_by, where)
        if not data[key][0]:
            raise UsageError(f"{where}: every row is longer than --max_length {args.max_length}; raise it.")
        if key == "normalize" and args.normalize_std and len(data[key][0]) < 2:
            raise UsageError(f"{where}: --normalize_std needs at least two reference completions.")
    return data


# ---- checks and sizes --------------------------------------------------------------------------------------
def fill_sizes(args: Args, world_size: int, num_rows: int | None = None) -> Args:
    """Check the flags and fill in the batch size; with the number of training pairs, the steps too."""
    if args.max_length < 2:
        raise UsageError(f"--max_length must be at least 2 (a prompt token and EOS), got {args.max_length}.")
    if min(args.per_device_train_batch_size, args.per_device_eval_batch_size) < 1:
        raise UsageError("--per_device_train_batch_size and --per_device_eval_batch_size must be at least 1.")
    total_steps = 1 if args.total_steps is None else args.total_steps
    if min(args.num_train_epochs, args.gradient_accumulation_steps, total_steps) < 1:
        raise UsageError("--num_train_epochs, --total_steps and --gradient_accumulation_steps must be >= 1.")
    if args.logging_steps < 1 or args.eval_steps < 0:
        raise UsageError("--logging_steps must be at least 1 and --eval_steps at least 0.")
    if args.eval_group_by and not args.dataset_test_split:
        raise UsageError("--eval_group_by needs a --dataset_test_split to evaluate on.")
    args.world_size = world_size
    args.batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    if num_rows is not None:
        if num_rows // (args.per_device_train_batch_size * world_size) < args.gradient_accumulation_steps:
            raise UsageError(
                f"the training split has {num_rows} pairs, fewer than one batch of {args.batch_size} "
                "(per_device_train_batch_size x gradient_accumulation_steps x processes); lower those flags."
            )
        args.num_training_steps = args.total_steps or num_rows // args.batch_size * args.num_train_epochs
    return args


# ---- training ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """The fixed state of a run, built by setup()."""

    accelerator: Any
    tokenizer: Any
    model: Any  # the prepared ScoreModel
    optimizer: Any
    scheduler: Any
    checkpointer: Any
    tracker: Any
    train_rows: list[dict]
    eval_loader: Any  # None without a test split
    data: dict  # split -> (rows, counts, group names)
    start_step: int


def setup(args: Args) -> Run:
    """Everything before the first step; flags and data are checked before the model is loaded."""
    from accelerate.utils import set_seed
    from transformers import AutoConfig, get_scheduler

    utils.loading.use_model_flags(args)
    utils.loading.fit_max_length(args)  # under --context_overflow cut, before the flag checks
    fill_sizes(args, 1)
    utils.checkpoint.check_output_dir(
        args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint)
    )
    tokenizer = utils.loading.load_tokenizer(
        args.model_name_or_path, "--model_name_or_path", args.chat_template_path
    )
    if tokenizer.eos_token is None:
        raise UsageError(f"the tokenizer of {args.model_name_or_path} has no EOS token to read the score at.")
    data = load_data(args, tokenizer)
    longest = max(len(s) for rows, _, _ in data.values() for row in rows for s in row["sequences"])
    utils.loading.check_context_length(args.model_name_or_path, longest, "--max_length")
    config = utils.loading.from_pretrained(AutoConfig, args.model_name_or_path, "--model_name_or_path")
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if is_classifier and config.num_labels != 1:
        raise UsageError(
            f"--model_name_or_path {args.model_name_or_path} is a classifier with {config.num_labels} "
            "labels; a reward model has exactly one (num_labels=1)."
        )

    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    accelerator = utils.run.make_accelerator(args, ga, micro)
    lora = utils.run.optional_module("utils.lora", "--use_peft") if args.use_peft else None
    if lora is not None:
        lora.check_args(args, accelerator)
    set_seed(args.seed)
    fill_sizes(args, accelerator.num_processes)  # before the checkpointer, which records the batch size
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # takes the run name of a resumed run
    for key, (rows, counts, _) in data.items():
        accelerator.print(
            f"{key}: kept {len(rows)} of {counts['rows']} rows, dropped {counts['dropped']} with a sequence "
            f"longer than --max_length {args.max_length}"
        )
    train_rows = data["train"][0]
    fill_sizes(args, accelerator.num_processes, len(train_rows))

    # A sequence classifier with one label: a causal LM gets a newly initialised score head.
    model = load_reward_model(args.model_name_or_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    if lora is not None:  # the score head trains whole beside the adapters (SEQ_CLS)
        model = lora.add_adapter(model, args, args.seed, task_type=args.lora_task_type)
    if args.disable_dropout:
        utils.loading.disable_dropout(model)
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = utils.run.adamw(
        trained, lr=args.learning_rate, eps=args.adam_epsilon, weight_decay=args.weight_decay
    )
    score_model, optimizer = accelerator.prepare(ScoreModel(model), optimizer)
    eval_loader = None
    if "test" in data:
        eval_loader = accelerator.prepare(
            loader(data["test"][0], args.per_device_eval_batch_size, tokenizer.pad_token_id)
        )
    # Stepped by hand once per optimizer step (a prepared scheduler would step once per process).
    warmup_steps = int(args.warmup_ratio * args.num_training_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, args.num_training_steps)
    print(utils.run.describe_sharding(score_model, accelerator), flush=True)
    resumed = checkpointer.resume({"model": score_model}, {"model": optimizer}) or {"step": 0}
    if resumed["step"]:
        scheduler.load_state_dict(resumed["scheduler"])
    tracker = utils.tracking.Tracker(args, checkpointer)
    return Run(
        accelerator,
        tokenizer,
        score_model,
        optimizer,
        scheduler,
        checkpointer,
        tracker,
        train_rows,
        eval_loader,
        data,
        resumed["step"],
    )


def evaluate(args: Args, run: Run, step: int) -> dict:
    """Accuracy, loss and score statistics over the whole test split, gathered from every process."""
    run.model.eval()
    scores, margins, groups = gather_scores(run.model, run.eval_loader, run.accelerator)
    run.model.train()
    metrics = eval_metrics(scores, margins, groups, run.data["test"][2], args.center_rewards_coefficient)
    run.tracker.log(metrics, step)
    run.accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


def normalize(args: Args, run: Run, step: int) -> dict:
    """Shift (with --normalize_std also scale) the saved score head so that the reference completions score 0
    on average (std 1); their scores are measured again after reloading."""
    accelerator, device = run.accelerator, run.accelerator.device
    rows = run.data["normalize"][0]
    norm_loader = accelerator.prepare(
        loader(rows, args.per_device_eval_batch_size, run.tokenizer.pad_token_id)
    )
    # Every process loads the whole saved model (outside ZeRO-3's sharded init) and scores its share.
    with utils.run.unsharded_loading(accelerator):
        trained = load_reward_model(args.output_dir, "--output_dir").to(device).eval()
    before = gather_scores(ScoreModel(trained), norm_loader, accelerator)[0][:, 0]
    mean, std = before.mean().item(), before.std().item()
    if args.normalize_std and not std > 0:
        raise UsageError("the reference completions all score the same: --normalize_std cannot scale.")
    normalize_score_head(trained, mean, std if args.normalize_std else 1.0)
    if accelerator.is_main_process:
        save_reward_model(trained, args.output_dir)
    accelerator.wait_for_everyone()
    with utils.run.unsharded_loading(accelerator):
        reloaded = load_reward_model(args.output_dir, "--output_dir").to(device).eval()
    after = gather_scores(ScoreModel(reloaded), norm_loader, accelerator)[0][:, 0]
    stats = {"normalize/mean_before": mean, "normalize/std_before": std}
    stats |= {"normalize/mean_after": after.mean().item(), "normalize/std_after": after.std().item()}
    run.tracker.log(stats, step)
    accelerator.print(", ".join(f"{k} {v:.4f}" for k, v in stats.items()))
    return stats


def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, model, optimizer, scheduler = run.accelerator, run.model, run.optimizer, run.scheduler
    ga, device, is_main = args.gradient_accumulation_steps, accelerator.device, accelerator.is_main_process
    global_step, final_metrics, start = run.start_step, {}, time.time()
    sums = torch.zeros(4, device=device)  # since the last log: loss * pairs, correct pairs, r_c - r_r, pairs
    progress = tqdm(
        total=args.num_training_steps, initial=global_step, desc="reward model", disable=not is_main
    )
    model.train()
    while global_step < args.num_training_steps:
        for m in range(global_step * ga, (global_step + 1) * ga):
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            # 1. Batch: this process's m-th micro-batch, chosen rows then rejected rows.
            batch = micro_batch(args, run, m)
            with accelerator.accumulate(model):
                # 2. Loss: ALGO LOGIC: one forward pass scores the chosen and the rejected completions.
                scores = model(batch["input_ids"], batch["attention_mask"]).float()
                chosen, rejected = scores.view(2, -1)
                loss = reward_loss(chosen, rejected, batch["margin"], args.center_rewards_coefficient)
                # 3. Update: accumulate() steps the optimizer on the last micro-batch only.
                accelerator.backward(loss)
                grad_norm = utils.run.clip_grad_norm(accelerator, model, args.max_grad_norm)
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
        grad_norm = utils.run.grad_norm_after_step(model, grad_norm)
        run.tracker.check_finite(global_step, loss=loss, grad_norm=grad_norm)

        # 4. Metrics: over every pair since the last log, on all processes.
        if global_step % args.logging_steps == 0 or global_step == args.num_training_steps:
            loss_sum, correct, margin_sum, count = accelerator.reduce(sums, reduction="sum").tolist()
            sums.zero_()
            train = {"loss": loss_sum / count, "accuracy": correct / count}
            train |= {"margin": margin_sum / count, "learning_rate": scheduler.get_last_lr()[0]}
            if grad_norm is not None:
                train["grad_norm"] = grad_norm
            epoch = global_step / (len(run.train_rows) // args.batch_size)
            run.tracker.log(train | {"epoch": epoch}, global_step)
            progress.set_postfix(loss=train["loss"], accuracy=train["accuracy"])
            final_metrics.update(train)

        # 5. Evaluate (the last evaluation follows the loop)
        if "test" in run.data and args.eval_steps and global_step % args.eval_steps == 0:
            if global_step < args.num_training_steps:
                evaluate(args, run, global_step)

        # 6. Checkpoint
        state = {"scheduler": scheduler.state_dict()}
        run.checkpointer.maybe_save(global_step, {"model": model}, {"model": optimizer}, state=state)
    progress.close()
    final_metrics["train_seconds"] = time.time() - start
    if "test" in run.data:
        final_metrics.update(evaluate(args, run, global_step))

    # 7. Save: every process takes part (ZeRO-3 gathers the weights), then the score is normalised.
    accelerator.wait_for_everyone()
    run.checkpointer.start_over()  # a replaced run's files go aside first
    state_dict = accelerator.get_state_dict(model)
    classifier = accelerator.unwrap_model(model).model
    if args.use_peft:  # the adapter to --output_dir/adapter, the merged classifier to --output_dir
        lora = utils.run.optional_module("utils.lora", "--use_peft")
        classifier = lora.save_adapter_and_merge(accelerator, classifier, args.output_dir)
        state_dict = {"model." + key: value for key, value in classifier.state_dict().items()}
    if is_main:
        state_dict = {key.removeprefix("model."): value for key, value in state_dict.items()}
        save_reward_model(classifier, args.output_dir, state_dict, save_function=accelerator.save)
        run.tokenizer.save_pretrained(args.output_dir)
    accelerator.wait_for_everyone()
    del model, optimizer, state_dict
    run.model = run.optimizer = None  # the training state is freed before the saved model is loaded again
    accelerator.free_memory()
    if args.normalize:
        final_metrics.update(normalize(args, run, global_step))
    if is_main:
        for key, (rows, counts, _) in run.data.items():
            final_metrics |= {
                f"data/{key}_rows": len(rows),
                f"data/{key}_dropped": counts["dropped"],
            }
        dataset = f"{args.dataset_name} ({args.dataset_train_split})"
        algorithm = "reward model (Bradley-Terry)"
        utils.saving.write_model_card(
            args.output_dir, algorithm, args.model_name_or_path, dataset, final_metrics, args=args
        )
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump(final_metrics, f, indent=2)
        if args.push_to_hub:
            utils.saving.push_to_hub(args)
        print(f"reward model written to {args.output_dir}")
    run.tracker.close()
    utils.run.end_run(accelerator)
    return final_metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
