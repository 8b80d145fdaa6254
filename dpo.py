"""Direct Preference Optimization (DPO) and its main variants, trained offline on preference pairs.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(https://arxiv.org/abs/2305.18290). A policy pi and a frozen reference pi_ref define the implicit reward of a
completion y of a prompt x, r(x, y) = beta * log(pi(y|x) / pi_ref(y|x)); DPO fits the Bradley-Terry model of
the preferences with it, -log sigmoid(r(x, y_chosen) - r(x, y_rejected)), so no reward model and no sampling
are needed. `--loss_type` picks the variant (IPO, SLiC hinge, robust DPO, SimPO); `--label_smoothing` gives
conservative DPO. The logprob of a completion is the sum over its tokens (ipo and simpo average it); the
prompt tokens are never in the loss.

    python benchmark/tiny/tiny_world.py --output_dir tiny_world
    python dpo.py --model_name_or_path tiny_world/policy --dataset_name tiny_world/dataset \
        --dataset_train_split preference --dataset_test_split preference_validation --learning_rate 1e-3 \
        --per_device_train_batch_size 32 --warmup_ratio 0.1 --eval_steps 50 --output_dir models/dpo-tiny
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
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


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed of the run; with it a CPU run is reproducible"""
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
    output_dir: str = "models/dpo"
    """where the trained policy (a plain causal-LM directory), its tokenizer and a model card are written"""
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
    """policy to start from (usually the SFT model), hub id or local directory; also the reference"""
    model_revision: str = "main"
    """revision (branch, tag or commit) of --model_name_or_path on the hub"""
    trust_remote_code: bool = False
    """let hub models and tokenizers run their own modelling code (every load)"""
    attn_implementation: str | None = None
    """attention of the trained model (and its reference): eager, sdpa, flash_attention_2...; None: the default"""
    dataset_name: str = "trl-lib/tldr-preference"
    """preference pairs in any of TRL's formats: hub id, save_to_disk directory, jsonl/parquet files"""
    dataset_config: str | None = None
    """the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str | None = "test"
    """split for evaluation (implicit-reward accuracy, samples); None: no evaluation"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) with the chat template for conversational data"""
    context_overflow: Literal["refuse", "cut"] = "refuse"
    """sequences longer than the model's positions: refuse (before loading it) or cut them to fit (one line)"""
    max_length: int = 1024
    """most tokens of each prompt + completion sequence, cut per --truncation_mode (TRL 1.16's meaning)"""
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    """a sequence over --max_length keeps its start (a pair whose prompt fills it is dropped) or its end"""
    max_prompt_length: int | None = None
    """not a TRL 1.16 flag: keep each prompt's last this many tokens, before --max_length (None: all)"""
    max_completion_length: int | None = None
    """not a TRL 1.16 flag: keep each completion's first this many tokens, before --max_length; sample table length"""

    # Algorithm
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge (SLiC), robust (robust DPO), simpo (reference-free, length-normalized)"""
    beta: float = 0.1
    """inverse temperature of the implicit reward (DPO beta, IPO tau, SLiC 1/delta, SimPO beta)"""
    label_smoothing: float = 0.0
    """assumed probability that a label is flipped (conservative DPO with sigmoid/simpo; robust needs it)"""
    reference_free: bool = False
    """ignore the reference model (a uniform reference: log pi_ref = 0)"""
    simpo_gamma: float = 0.5
    """SimPO target reward margin gamma"""
    precompute_ref_log_probs: Annotated[bool, tyro.conf.arg(aliases=("--precompute_ref_logps",))] = False
    """compute the reference logprobs in one pass before training, holding no reference model"""

    # Optimizer
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    per_device_train_batch_size: int = 8
    """preference pairs per process per forward pass (2x this many sequences)"""
    per_device_eval_batch_size: int = 8
    """pairs per process per evaluation forward pass; also the prompts in the sample table"""
    gradient_accumulation_steps: int = 1
    """forward passes whose gradients are summed into one optimizer step"""
    num_train_epochs: float = 1.0
    """passes over the training split (ignored when --max_steps > 0)"""
    max_steps: int = -1
    """optimizer steps to train for; -1: from --num_train_epochs"""
    warmup_ratio: float = 0.0
    """fraction of the steps warming the learning rate up from 0"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """learning-rate schedule after warmup"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm (0: no clipping)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    disable_dropout: bool = True
    """turn the policy's dropout off, so that the implicit reward is deterministic (TRL's default)"""
    bf16: bool = False
    """bfloat16 mixed precision"""

    # LoRA
    use_peft: bool = False
    """train LoRA adapters; the reference is then the base model with the adapter disabled"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling alpha"""
    lora_dropout: float = 0.05
    """dropout on the LoRA adapters' inputs"""
    lora_target_modules: list[str] | None = None
    """modules given adapters (e.g. q_proj v_proj, or all-linear); None: peft's default for the model"""

    # Logging
    logging_steps: int = 10
    """log training metrics every this many optimizer steps"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """steps: evaluate on --dataset_test_split every --eval_steps and at the end; no: never"""
    eval_steps: int = 100
    """evaluate every this many steps (0: only at the end, which always happens)"""
    generate_during_eval: bool = True
    """at each evaluation, print greedy completions of a few test prompts"""

    # Filled in at runtime
    batch_size: int = 0
    """pairs per optimizer step, over all processes"""
    num_training_steps: int = 0
    """optimizer steps of the run"""


METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]
METRICS += ["logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"]
COLUMNS = ("prompt", "chosen", "rejected")


# ---- the math ----------------------------------------------------------------------------------------------
# Summed completion logprobs [B] of the policy (pi_c, pi_r) and the reference (ref_c, ref_r), chosen (c) and
# rejected (r); len_c, len_r count the completion tokens.
def sigmoid_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing=0.0):
    """DPO (eq. 7): -log sigmoid(beta * h), h = (pi_c - ref_c) - (pi_r - ref_r).

    Label smoothing e > 0: conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences &
    relationship to IPO"), -(1-e) log sig(beta h) - e log sig(-beta h)."""
    h = (pi_c - ref_c) - (pi_r - ref_r)
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def robust_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing):
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO"), unbiased under a label-flip rate e:
    [-(1-e) log sig(beta h) + e log sig(-beta h)] / (1 - 2e)."""
    h = (pi_c - ref_c) - (pi_r - ref_r)
    noisy = -(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)
    return noisy / (1 - 2 * label_smoothing)


def hinge_loss(pi_c, pi_r, ref_c, ref_r, beta):
    """SLiC-HF (Zhao et al. 2023): relu(1 - beta * h), on reference-corrected log-ratios (SLiC's own loss
    compares the policy's logprobs alone: --reference_free)."""
    return torch.relu(1 - beta * ((pi_c - ref_c) - (pi_r - ref_r)))


def ipo_loss(pi_c, pi_r, ref_c, ref_r, len_c, len_r, beta):
    """IPO (Azar et al. 2023): (h - 1/(2 beta))^2 with each log-ratio AVERAGED over its completion's tokens,
    as TRL does and the IPO authors confirmed."""
    len_c, len_r = len_c.clamp(min=1), len_r.clamp(min=1)  # an empty completion: no NaN
    h = (pi_c - ref_c) / len_c - (pi_r - ref_r) / len_r
    return (h - 1 / (2 * beta)) ** 2


def simpo_loss(pi_c, pi_r, len_c, len_r, beta, gamma, label_smoothing=0.0):
    """SimPO (Meng et al. 2024): -log sig(beta * (pi_c/len_c - pi_r/len_r) - gamma), reference-free, with
    label smoothing as in conservative DPO."""
    len_c, len_r = len_c.clamp(min=1), len_r.clamp(min=1)  # an empty completion: no NaN
    z = beta * (pi_c / len_c - pi_r / len_r) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def preference_loss(args: Args, pi_c, pi_r, ref_c, ref_r, len_c, len_r):
    """Per-pair losses [B] of --loss_type and the implicit rewards beta * log(pi / pi_ref) [B] of chosen and
    rejected (per-token averages for ipo and simpo)."""
    if args.reference_free or args.loss_type == "simpo":
        ref_c, ref_r = torch.zeros_like(pi_c), torch.zeros_like(pi_r)
    beta, e = args.beta, args.label_smoothing
    if args.loss_type == "sigmoid":
        losses = sigmoid_loss(pi_c, pi_r, ref_c, ref_r, beta, e)
    elif args.loss_type == "robust":
        losses = robust_loss(pi_c, pi_r, ref_c, ref_r, beta, e)
    elif args.loss_type == "hinge":
        losses = hinge_loss(pi_c, pi_r, ref_c, ref_r, beta)
    elif args.loss_type == "ipo":
        losses = ipo_loss(pi_c, pi_r, ref_c, ref_r, len_c, len_r, beta)
    else:
        losses = simpo_loss(pi_c, pi_r, len_c, len_r, beta, args.simpo_gamma, e)
    ratio_c, ratio_r = (pi_c - ref_c).detach(), (pi_r - ref_r).detach()
    if args.loss_type in ("ipo", "simpo"):
        ratio_c, ratio_r = ratio_c / len_c.clamp(min=1), ratio_r / len_r.clamp(min=1)
    return losses, beta * ratio_c, beta * ratio_r


def completion_logps(model, batch: dict[str, torch.Tensor]):
    """Summed logprob [N] of each row's completion tokens, their number [N] and their mean logit [N]."""
    mask = batch["completion_mask"][:, 1:].bool()  # position t predicts token t+1
    token_logps, _, mean_logits = utils.logprobs.token_logprobs(
        model, batch["input_ids"], batch["attention_mask"], mask, with_stats=True
    )
    lengths = mask.sum(-1).float()
    return token_logps.sum(-1), lengths, mean_logits.sum(-1) / lengths


# ---- data --------------------------------------------------------------------------------------------------
def fit_sequence(prompt: list[int], completion: list[int], args: Args) -> tuple[list[int], list[int]]:
    """prompt + completion cut to --max_length as TRL 1.16's DataCollatorForPreference cuts each sequence:
    keep_start keeps its first tokens, keep_end its last (the prompt's start goes first)."""
    if args.truncation_mode == "keep_start":
        return prompt[: args.max_length], completion[: max(0, args.max_length - len(prompt))]
    cut = max(0, len(prompt) + len(completion) - args.max_length)
    return prompt[cut:], completion[max(0, cut - len(prompt)) :]


def truncate_pair(prompt, chosen, rejected, args: Args) -> dict | None:
    """A pair's row {prompt, chosen_prompt, chosen, rejected_prompt, rejected}, each sequence cut by
    fit_sequence (its prompt part in *_prompt); None for a pair TRL 1.16 drops (keep_start and a prompt that
    fills --max_length)."""
    if args.truncation_mode == "keep_start" and len(prompt) >= args.max_length:
        return None
    chosen_prompt, chosen = fit_sequence(prompt, chosen, args)
    rejected_prompt, rejected = fit_sequence(prompt, rejected, args)
    return {"prompt": prompt, "chosen_prompt": chosen_prompt, "chosen": chosen,
            "rejected_prompt": rejected_prompt, "rejected": rejected}  # fmt: skip


def tokenize_dataset(dataset, tokenizer, args: Args, where: str) -> tuple[list[dict], dict]:
    """Rows (truncate_pair's, with their index) of pairs in any of TRL's formats, completions ending with EOS,
    after our own --max_prompt_length / --max_completion_length; the counts of pairs, dropped pairs, prompts
    and completions our flags cut, and sequences --max_length cut."""
    texts = utils.examples.preference_texts(dataset, tokenizer, where)
    ids = [utils.chat.encode(tokenizer, texts[c], leading=c == "prompt") for c in COLUMNS]
    eos, rows = tokenizer.eos_token_id, []
    counts = {"pairs": len(dataset), "dropped": 0, "prompts_truncated": 0, "completions_truncated": 0}
    counts["sequences_truncated"] = 0
    for prompt, chosen, rejected in zip(*ids):
        chosen, rejected = [t if t[-1:] == [eos] else t + [eos] for t in (chosen, rejected)]
        if args.max_prompt_length is not None:
            counts["prompts_truncated"] += len(prompt) > args.max_prompt_length
            prompt = prompt[-args.max_prompt_length :]
        if args.max_completion_length is not None:
            cap = args.max_completion_length
            counts["completions_truncated"] += sum(len(c) > cap for c in (chosen, rejected))
            chosen, rejected = chosen[:cap], rejected[:cap]
        row = truncate_pair(prompt, chosen, rejected, args)
        if row is None:
            counts["dropped"] += 1
            continue
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            counts["sequences_truncated"] += len(row[f"{side}_prompt"] + row[side]) < len(prompt + completion)
        rows.append({"index": len(rows), **row})
    if not rows:
        raise UsageError(
            f"{where}: no prompt leaves room for a completion under --max_length {args.max_length} "
            "(--truncation_mode keep_start drops a pair whose prompt fills it, as TRL 1.16 does); raise "
            "--max_length, or pass --truncation_mode keep_end or a --max_prompt_length under it."
        )
    return rows, counts


def describe_counts(counts: dict, args: Args, where: str) -> str:
    """One line on what the length flags did to a split, and a line for each of our own flags that is set."""
    lines = [
        f"{where}: kept {counts['pairs'] - counts['dropped']} of {counts['pairs']} pairs, dropped "
        f"{counts['dropped']} whose prompt fills --max_length {args.max_length} (--truncation_mode "
        f"{args.truncation_mode}, as TRL 1.16); {counts['sequences_truncated']} sequences cut to it"
    ]
    if args.max_prompt_length is not None:
        lines.append(
            f"{where}: --max_prompt_length {args.max_prompt_length} (not a TRL 1.16 flag) cut "
            f"{counts['prompts_truncated']} prompts from the left"
        )
    if args.max_completion_length is not None:
        lines.append(
            f"{where}: --max_completion_length {args.max_completion_length} (not a TRL 1.16 flag) cut "
            f"{counts['completions_truncated']} completions from the right"
        )
    return "\n".join(lines)


def concatenated_inputs(chosen_prompts, chosens, rejected_prompts, rejecteds, pad_token_id: int) -> dict:
    """One right-padded batch [2B, T], prompt+chosen rows then prompt+rejected rows, and completion_mask."""
    # Masks come from the lengths, not the pad id: pad == eos is safe.
    pairs = list(zip(list(chosen_prompts) + list(rejected_prompts), list(chosens) + list(rejecteds)))
    return {
        "input_ids": utils.generation.pad([p + c for p, c in pairs], pad_token_id),
        "attention_mask": utils.generation.pad([[1] * (len(p) + len(c)) for p, c in pairs], 0),
        "completion_mask": utils.generation.pad([[0] * len(p) + [1] * len(c) for p, c in pairs], 0).bool(),
    }


def collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    columns = ("chosen_prompt", "chosen", "rejected_prompt", "rejected")
    batch = concatenated_inputs(*[[r[c] for r in rows] for c in columns], pad_token_id)
    return {**batch, "index": torch.tensor([r["index"] for r in rows])}


def micro_batch(args: Args, run: "Run", m: int) -> dict:
    """This process's m-th micro-batch, found again exactly on resume (utils.examples.shuffled_micro_batch)."""
    accelerator, micro = run.accelerator, args.per_device_train_batch_size
    rank, world = accelerator.process_index, accelerator.num_processes
    rows = utils.examples.shuffled_micro_batch(len(run.train_rows), m, micro, world, rank, args.seed)
    batch = collate([run.train_rows[j] for j in rows], run.tokenizer.pad_token_id)
    return {key: value.to(accelerator.device) for key, value in batch.items()}


@torch.no_grad()
def sample_table(model, rows: list[dict], tokenizer, length: int) -> dict[str, list[str]]:
    """Greedy completions of the rows' prompts, cut after EOS, beside the prompt ends and chosen ones."""
    responses, _ = utils.generation.complete(model, tokenizer, [r["prompt"] for r in rows], length, len(rows))
    decode = partial(tokenizer.batch_decode, skip_special_tokens=True)
    prompts = [p[-60:] for p in decode([r["prompt"] for r in rows])]
    return {
        "prompt (end)": prompts,
        "greedy": decode(responses),
        "chosen": decode([r["chosen"] for r in rows]),
    }


# ---- checks and sizes --------------------------------------------------------------------------------------
POSITIVE_FLAGS = """per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps
logging_steps max_length""".split()


def fill_sizes(args: Args, world_size: int, num_rows: int | None = None) -> Args:
    """Check the flags; with the number of training pairs, fill in the batch size and the steps."""
    if args.beta <= 0:
        raise UsageError(f"--beta must be positive, got {args.beta}.")
    if not 0 <= args.label_smoothing < 0.5:
        raise UsageError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}.")
    if args.label_smoothing > 0 and args.loss_type in ("ipo", "hinge"):
        raise UsageError(f"--label_smoothing has no effect with --loss_type {args.loss_type}; leave it at 0.")
    if args.max_prompt_length is not None and not 0 < args.max_prompt_length < args.max_length:
        raise UsageError(f"--max_prompt_length must be in [1, --max_length - 1 = {args.max_length - 1}].")
    if args.max_completion_length is not None and args.max_completion_length < 1:
        raise UsageError(
            f"--max_completion_length must be at least 1 (or None), got {args.max_completion_length}."
        )
    for flag in POSITIVE_FLAGS:
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise UsageError("set --max_steps > 0 or --num_train_epochs > 0.")
    if num_rows is not None:
        micro, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
        if num_rows // (micro * world_size) < ga:
            raise UsageError(
                f"the training split has {num_rows} pairs, fewer than one batch of {micro * ga * world_size} "
                "(per_device_train_batch_size x gradient_accumulation_steps x processes); lower those flags."
            )
        args.batch_size = micro * ga * world_size
        epoch_steps = math.ceil(args.num_train_epochs * (num_rows // args.batch_size))
        args.num_training_steps = args.max_steps if args.max_steps > 0 else epoch_steps
    return args


# ---- training ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """The fixed state of a run, built by setup()."""

    accelerator: Any
    tokenizer: Any
    policy: Any
    ref_policy: Any  # None with LoRA, precomputed logprobs or no reference
    optimizer: Any
    scheduler: Any
    checkpointer: Any
    tracker: Any
    train_rows: list[dict]
    eval_rows: list[dict]
    eval_loader: Any
    ref_tables: dict[str, torch.Tensor]  # split -> precomputed reference logprobs [pairs, 2]
    counts: dict[str, dict]
    start_step: int
    train_metrics: dict  # the last logged, for a run resumed at its end


def needs_reference(args: Args) -> bool:
    return not args.reference_free and args.loss_type != "simpo"


@torch.no_grad()
def reference_logps(args: Args, accelerator, policy, ref_policy, batch) -> torch.Tensor:
    """Reference logprobs [2B]: the frozen copy, else the policy (before training, or LoRA's base model)."""
    module = ref_policy if ref_policy is not None else accelerator.unwrap_model(policy)
    with module.disable_adapter() if args.use_peft else nullcontext(), accelerator.autocast():
        return completion_logps(module, batch)[0]


def setup(args: Args) -> Run:
    """Everything before the first step; flags and data are checked before the models are loaded."""
    from accelerate.utils import broadcast_object_list, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, get_scheduler

    utils.loading.use_model_flags(args)
    utils.loading.fit_max_length(args)  # under --context_overflow cut, before the flag checks
    fill_sizes(args, 1)
    utils.checkpoint.check_output_dir(
        args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint)
    )
    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    accelerator = utils.run.make_accelerator(args, ga, micro)
    run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.run_name = broadcast_object_list([run_name])[0]  # the same name on every process
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # takes the run name of a resumed run
    set_seed(args.seed)

    tokenizer = utils.loading.load_tokenizer(
        args.model_name_or_path, "--model_name_or_path", args.chat_template_path
    )
    test_split = args.dataset_test_split if args.eval_strategy == "steps" else None
    if test_split == Args.dataset_test_split and "--dataset_test_split" not in " ".join(sys.argv[1:]):
        if not utils.data.has_split(args.dataset_name, test_split, args.dataset_config):  # as TRL: no eval
            accelerator.print(
                f'dpo.py: no "{test_split}" split in {args.dataset_name}: evaluation skipped '
                "(give --dataset_test_split to evaluate)"
            )
            test_split = None
    split_rows, counts, said = {"test": []}, {"test": {}}, []
    for key, split in (("train", args.dataset_train_split), ("test", test_split)):
        if split is not None:
            dataset = utils.data.load_split(args.dataset_name, split, args.dataset_config)
            split_rows[key], counts[key] = tokenize_dataset(dataset, tokenizer, args, f"split {split!r}")
            said.append(describe_counts(counts[key], args, f"split {split!r}"))
    train_rows, eval_rows = split_rows["train"], split_rows["test"]
    longest = max(
        len(r[f"{side}_prompt"]) + len(r[side])
        for r in train_rows + eval_rows
        for side in ("chosen", "rejected")
    )
    utils.loading.check_context_length(args.model_name_or_path, longest, "--max_length")
    if accelerator.is_main_process:
        print("\n".join(said))
    collate_fn = partial(collate, pad_token_id=tokenizer.pad_token_id)
    eval_loader = DataLoader(eval_rows, args.per_device_eval_batch_size, collate_fn=collate_fn)
    fill_sizes(args, accelerator.num_processes, len(train_rows))

    load_model = partial(
        utils.loading.from_pretrained, AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
    )
    policy = load_model()
    if args.gradient_checkpointing:
        utils.loading.enable_gradient_checkpointing(policy)
    if args.use_peft:
        from peft import LoraConfig, get_peft_model

        targets = "all-linear" if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        policy = get_peft_model(policy, lora)
    if args.disable_dropout:  # after LoRA wrapping, so that the adapters' dropout is off too
        utils.loading.disable_dropout(policy)
    ref_policy = None
    if needs_reference(args) and not args.use_peft and not args.precompute_ref_log_probs:
        ref_policy = load_model()
        utils.loading.disable_dropout(ref_policy)
        ref_policy = utils.run.prepare_frozen(ref_policy, accelerator)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = utils.run.adamw(trained, lr=args.learning_rate, weight_decay=args.weight_decay)
    policy, optimizer, eval_loader = accelerator.prepare(policy, optimizer, eval_loader)
    # Stepped by hand once per optimizer step (a prepared scheduler would step once per process).
    warmup_steps = math.ceil(args.warmup_ratio * args.num_training_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, args.num_training_steps)

    ref_tables = {}
    if needs_reference(args) and args.precompute_ref_log_probs:
        policy.eval()
        # In dataset order: going through the shuffled train loader would change the training order.
        sequential = accelerator.prepare(
            DataLoader(train_rows, args.per_device_eval_batch_size, collate_fn=collate_fn)
        )
        for split, loader, rows in (("train", sequential, train_rows), ("test", eval_loader, eval_rows)):
            ref_tables[split] = torch.zeros(len(rows), 2, device=accelerator.device)
            for batch in tqdm(
                loader, desc=f"reference logprobs ({split})", disable=not accelerator.is_main_process
            ):
                logps = reference_logps(args, accelerator, policy, ref_policy, batch).view(2, -1).T
                index, logps = accelerator.gather_for_metrics((batch["index"], logps))
                ref_tables[split][index] = logps.float()

    print(utils.run.describe_sharding(policy, accelerator), flush=True)
    # Resumed after the precomputation: the reference logprobs come from the initial weights.
    resumed = checkpointer.resume({"model": policy}, {"model": optimizer}) or {"step": 0}
    if resumed["step"]:
        scheduler.load_state_dict(resumed["scheduler"])
    tracker = utils.tracking.Tracker(args, checkpointer)
    return Run(
        accelerator,
        tokenizer,
        policy,
        ref_policy,
        optimizer,
        scheduler,
        checkpointer,
        tracker,
        train_rows,
        eval_rows,
        eval_loader,
        ref_tables,
        counts,
        resumed["step"],
        resumed.get("train_metrics", {}),
    )


def batch_metrics(args: Args, run: Run, batch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss of a batch and its per-pair metrics [B, len(METRICS)]."""
    logps, lengths, mean_logits = completion_logps(run.policy, batch)  # chosen rows first, then rejected
    if not needs_reference(args):
        ref = torch.zeros_like(logps)
    elif run.ref_tables:
        ref = run.ref_tables[split][batch["index"]].T.reshape(-1)
    else:
        ref = reference_logps(args, run.accelerator, run.policy, run.ref_policy, batch)
    n = logps.size(0) // 2
    # ALGO LOGIC: the chosen half against the rejected half
    losses, reward_c, reward_r = preference_loss(
        args, logps[:n], logps[n:], ref[:n], ref[n:], lengths[:n], lengths[n:]
    )
    metrics = [losses, reward_c, reward_r, reward_c - reward_r, (reward_c > reward_r).float()]
    metrics += [logps[:n], logps[n:], mean_logits[:n], mean_logits[n:]]
    return losses.mean(), torch.stack([m.detach().float() for m in metrics], 1)


def evaluate(args: Args, run: Run, step: int) -> dict:
    """Metrics over the whole test split (gathered from every process) and a table of greedy samples."""
    if not run.eval_rows:  # no test split (--eval_strategy no)
        return {}
    accelerator, policy = run.accelerator, run.policy
    policy.eval()
    with torch.no_grad():
        metrics = torch.cat(
            [accelerator.gather_for_metrics(batch_metrics(args, run, b, "test")[1]) for b in run.eval_loader]
        )
    result = {f"eval/{name}": value for name, value in zip(METRICS, metrics.mean(0).tolist())}
    if args.generate_during_eval:  # on every process: ZeRO-3 gathers the weights collectively
        rows = run.eval_rows[: args.per_device_eval_batch_size]
        length = args.max_completion_length or max(len(r["chosen"]) for r in rows)
        with accelerator.autocast():
            samples = sample_table(accelerator.unwrap_model(policy), rows, run.tokenizer, length)
    run.tracker.log(result, step)
    if accelerator.is_main_process and args.generate_during_eval:
        run.tracker.samples(samples, f"step {step}: accuracy {result['eval/rewards/accuracies']:.3f}")
        run.tracker.writer.add_text("eval/samples", "\n\n".join(map(repr, samples["greedy"])), step)
    policy.train()
    return result


def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, policy, optimizer, scheduler = run.accelerator, run.policy, run.optimizer, run.scheduler
    ga, device, is_main = args.gradient_accumulation_steps, accelerator.device, accelerator.is_main_process

    def gathered_mean(values: torch.Tensor) -> list[float]:
        return accelerator.reduce(values, reduction="mean").tolist()

    if is_main:
        processes = accelerator.num_processes
        print(f"{args.num_training_steps} steps of {args.batch_size} pairs on {processes} process(es)")
    global_step, train_metrics = run.start_step, run.train_metrics
    progress = tqdm(total=args.num_training_steps, initial=global_step, disable=not is_main)
    sums, micro_batches, tokens = torch.zeros(len(METRICS), device=device), 0, torch.zeros((), device=device)
    log_start = time.time()
    policy.train()
    while global_step < args.num_training_steps:
        for m in range(global_step * ga, (global_step + 1) * ga):
            run.checkpointer.boundary()  # a signal stops here until the step changes the weights
            # 1. Batch: this process's m-th micro-batch, chosen rows then rejected rows.
            batch = micro_batch(args, run, m)
            with accelerator.accumulate(policy):
                # 2. Loss: the preference loss of --loss_type.
                loss, pair_metrics = batch_metrics(args, run, batch, "train")
                # 3. Update: accumulate() steps the optimizer on the last micro-batch only.
                accelerator.backward(loss)
                grad_norm = utils.run.clip_grad_norm(accelerator, policy, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            sums, micro_batches = sums + pair_metrics.mean(0), micro_batches + 1
            tokens = tokens + batch["attention_mask"].sum()  # policy tokens: prompts and both completions
        scheduler.step()
        global_step += 1
        progress.update(1)
        grad_norm = utils.run.grad_norm_after_step(policy, grad_norm)
        run.tracker.check_finite(global_step, loss=loss, grad_norm=grad_norm)

        # 4. Metrics: means over the micro-batches since the last log, on all processes.
        if global_step % args.logging_steps == 0 or global_step == args.num_training_steps:
            means = gathered_mean(sums / micro_batches)
            tokens_per_second = accelerator.reduce(tokens, reduction="sum").item() / (time.time() - log_start)
            epoch = global_step / (len(run.train_rows) // args.batch_size)
            train_metrics = dict(zip(METRICS, means), learning_rate=scheduler.get_last_lr()[0], epoch=epoch)
            train_metrics["perf/tokens_per_second"] = tokens_per_second
            if grad_norm is not None:
                train_metrics["grad_norm"] = grad_norm
            run.tracker.log(train_metrics, global_step)
            progress.set_postfix(loss=f"{means[0]:.4f}", accuracy=f"{means[4]:.3f}")
            sums, micro_batches, tokens, log_start = sums * 0, 0, tokens * 0, time.time()

        # 5. Evaluate (the last evaluation follows the loop)
        if (
            args.eval_steps > 0
            and global_step % args.eval_steps == 0
            and global_step < args.num_training_steps
        ):
            evaluate(args, run, global_step)

        # 6. Checkpoint
        state = {"scheduler": scheduler.state_dict(), "train_metrics": train_metrics}
        run.checkpointer.maybe_save(global_step, {"model": policy}, {"model": optimizer}, state=state)
    progress.close()
    final = dict(train_metrics)
    final["train_seconds"] = run.checkpointer.elapsed_seconds()  # all parts of a resumed run
    final |= evaluate(args, run, global_step) | {f"data/train_{k}": v for k, v in run.counts["train"].items()}
    final |= {f"data/test_{k}": v for k, v in run.counts["test"].items()}

    # 7. Save into a temporary directory, moved in at the end: a failed run leaves --output_dir as it was.
    accelerator.wait_for_everyone()
    parent, name = os.path.split(os.path.abspath(args.output_dir))
    tmp_dir = os.path.join(parent, f".{name}.{args.run_name}.partial")
    unwrapped = accelerator.unwrap_model(policy)
    if args.use_peft:  # a plain causal-LM directory: the adapter is merged into the weights
        saved, state_dict = unwrapped.merge_and_unload(), None
    else:
        saved, state_dict = unwrapped, accelerator.get_state_dict(policy)  # gathers ZeRO-3 shards
    with utils.loading.config_dropout_kept(saved):
        saved.save_pretrained(
            tmp_dir, is_main_process=is_main, save_function=accelerator.save, state_dict=state_dict
        )
    accelerator.wait_for_everyone()  # every process is done with tmp_dir before it is moved in
    run.checkpointer.start_over()  # a replaced run's files go aside before the new ones move in
    if is_main:
        run.tokenizer.save_pretrained(tmp_dir)
        algorithm, data = f"DPO (loss_type={args.loss_type}, beta={args.beta})", args.dataset_name
        title = os.path.basename(os.path.abspath(args.output_dir))
        utils.saving.write_model_card(
            tmp_dir,
            algorithm,
            args.model_name_or_path,
            f"{data} ({args.dataset_train_split})",
            final,
            title=title,
            args=args,
        )
        os.makedirs(args.output_dir, exist_ok=True)
        for file in os.listdir(tmp_dir):
            os.replace(os.path.join(tmp_dir, file), os.path.join(args.output_dir, file))
        shutil.rmtree(tmp_dir)
        accuracy = final.get("eval/rewards/accuracies")
        print(
            f"saved to {args.output_dir}"
            + (f"; test accuracy {accuracy:.4f}" if accuracy is not None else "")
        )
        if args.push_to_hub:
            utils.saving.push_to_hub(args)
    run.tracker.close()
    utils.run.end_run(accelerator)
    return final


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
