# DPO: Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a Reward Model" 2023
"""Direct Preference Optimization and its main variants, trained offline on preference pairs.

https://arxiv.org/abs/2305.18290. A policy pi and a frozen reference pi_ref define the implicit reward of a
completion y of a prompt x, r(x, y) = beta * log(pi(y|x) / pi_ref(y|x)); DPO fits the Bradley-Terry model of
the preferences with it, -log sigmoid(r(x, y_chosen) - r(x, y_rejected)), so no reward model and no sampling
are needed. `--loss_type` picks the variant (IPO, SLiC hinge, robust DPO, SimPO); `--label_smoothing` gives
conservative DPO. The logprob of a completion is the sum over its tokens (ipo and simpo average it); the
prompt tokens are never in the loss.

Offline example (the tiny world on 2 CPU cores, about 3 CPU-minutes per epoch of its 8000 pairs):
    python benchmark/tiny_world.py --output_dir tiny_world
    python dpo.py --model_name_or_path tiny_world/policy --dataset_name tiny_world/dataset \
        --dataset_train_split preference --dataset_test_split preference_validation --learning_rate 1e-3 \
        --per_device_train_batch_size 32 --warmup_ratio 0.1 --eval_steps 50 --output_dir models/dpo-tiny
TL;DR at Pythia-1B scale (8 GPUs, starting from the SFT model of sft.py; 64 pairs per step):
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml dpo.py \
        --model_name_or_path models/sft_tldr --dataset_name trl-lib/tldr-preference --learning_rate 1e-6 \
        --beta 0.1 --per_device_train_batch_size 8 --warmup_ratio 0.1 --max_length 640 \
        --max_prompt_length 512 --max_completion_length 128 --bf16 --gradient_checkpointing \
        --eval_steps 200 --output_dir models/dpo_tldr
"""

import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro

import utils
import utils.chat
import utils.data


@dataclass
class Args:
    # --- run ---
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run name starts with it)"""
    seed: int = 1
    """seed of the run; with it a CPU run is reproducible"""
    run_name: str | None = None
    """TensorBoard/W&B run name; None gives {exp_name}__{seed}__{unix time}"""
    track: bool = False
    """also log to Weights & Biases (set WANDB_MODE=offline to log without network)"""
    wandb_project_name: str = "rlhf-reference"
    """W&B project name"""
    wandb_entity: str | None = None
    """W&B entity (team); None uses the default one"""
    logging_dir: str = "runs"
    """TensorBoard logs go to {logging_dir}/{run_name}"""
    output_dir: str = "models/dpo"
    """where the trained policy (a plain causal-LM directory), its tokenizer and a model card are written"""
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
    model_name_or_path: str = "EleutherAI/pythia-1b-deduped"
    """policy to start from (usually the SFT model), hub id or local directory; also the reference model"""
    dataset_name: str = "trl-lib/tldr-preference"
    """preference pairs (prompt, chosen, rejected; or chosen, rejected with an implicit prompt), standard or
    conversational: hub id, save_to_disk dir, jsonl/parquet files"""
    dataset_config: str | None = None
    """dataset configuration: the hub's config name, or the sub-folder of a local dataset"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_test_split: str | None = "test"
    """split for evaluation (implicit-reward accuracy, sample completions); None: no evaluation"""
    chat_template_path: str | None = None
    """Jinja file (or tokenizer directory) whose chat template renders conversational data"""
    max_length: int = 1024
    """most tokens of prompt + completion: completions are cut to fit; rows with no room left are dropped"""
    max_prompt_length: int | None = 512
    """most prompt tokens (see --truncation_mode), lowered to max_length // 2 when --max_length is smaller; None
    keeps whole prompts"""
    max_completion_length: int | None = None
    """most completion tokens kept (None: only --max_length limits them); also the eval sample length"""
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    """which end of a prompt longer than --max_prompt_length is kept (keep_end keeps a final instruction)"""

    # --- DPO ---
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
    """compute the reference logprobs in one pass before training: no reference model is held in training"""

    # --- optimization ---
    learning_rate: float = 1e-6
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    per_device_train_batch_size: int = 8
    """preference pairs per process per forward pass (each pass holds 2x this many sequences)"""
    per_device_eval_batch_size: int = 8
    """pairs per process per evaluation forward pass; also the number of prompts in the sample table"""
    gradient_accumulation_steps: int = 1
    """forward passes whose gradients are summed into one optimizer step"""
    num_train_epochs: float = 1.0
    """passes over the training split (ignored when --max_steps > 0)"""
    max_steps: int = -1
    """optimizer steps to train for; -1 uses --num_train_epochs"""
    warmup_ratio: float = 0.0
    """fraction of the optimizer steps spent warming the learning rate up from 0"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """learning-rate schedule after warmup"""
    max_grad_norm: float = 1.0
    """gradients are clipped to this global norm (0 disables clipping)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    bf16: bool = False
    """bfloat16 mixed precision"""

    # --- LoRA ---
    use_peft: bool = False
    """train LoRA adapters; the reference is then the base model with the adapter disabled (no second copy)"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling alpha"""
    lora_dropout: float = 0.05
    """dropout on the LoRA adapters' inputs"""
    lora_target_modules: list[str] | None = None
    """modules given adapters (e.g. q_proj v_proj, or all-linear); None: peft's default for the model"""

    # --- logging and evaluation ---
    logging_steps: int = 10
    """log training metrics every this many optimizer steps"""
    eval_strategy: Literal["no", "steps"] = "steps"
    """steps: evaluate on --dataset_test_split every --eval_steps and at the end; no: never"""
    eval_steps: int = 100
    """evaluate every this many optimizer steps (0: only at the end, which always happens)"""
    generate_during_eval: bool = True
    """at each evaluation, print a table of greedy completions for a few test prompts"""

    # --- filled in at runtime ---
    batch_size: int = 0
    """pairs per optimizer step over all processes (filled in at runtime)"""
    num_training_steps: int = 0
    """optimizer steps of the run (filled in at runtime)"""


METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]
METRICS += ["logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"]
COLUMNS = ("prompt", "chosen", "rejected")


# ----------------------------------------------------------------------------------------------------------------
# Losses: pure functions of the summed completion logprobs [B] of the policy (pi_c, pi_r) and the reference
# (ref_c, ref_r), for the chosen (c) and rejected (r) completions; len_c, len_r count their tokens.
# ----------------------------------------------------------------------------------------------------------------
def sigmoid_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing=0.0):
    """DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta * h) with h = (pi_c - ref_c) - (pi_r - ref_r).

    With label smoothing e > 0, conservative DPO (cDPO; Mitchell 2023, "A note on DPO with noisy preferences
    & relationship to IPO"): the expected loss when each label is flipped with probability e,
    -(1-e) log sig(beta h) - e log sig(-beta h)."""
    h = (pi_c - ref_c) - (pi_r - ref_r)
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def robust_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing):
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy
    Feedback"): when labels are flipped with probability e, [-(1-e) log sig(beta h) + e log sig(-beta h)] /
    (1 - 2e) is an unbiased estimate of the DPO loss on clean labels."""
    h = (pi_c - ref_c) - (pi_r - ref_r)
    noisy = -(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)
    return noisy / (1 - 2 * label_smoothing)


def hinge_loss(pi_c, pi_r, ref_c, ref_r, beta):
    """SLiC-HF (Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback"): the
    calibration hinge loss relu(1 - beta * h), margin 1/beta, here on reference-corrected log-ratios (SLiC's
    own loss compares the policy's logprobs alone: --reference_free)."""
    return torch.relu(1 - beta * ((pi_c - ref_c) - (pi_r - ref_r)))


def ipo_loss(pi_c, pi_r, ref_c, ref_r, len_c, len_r, beta):
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences"):
    (h - 1/(2 tau))^2 with tau = beta. Here each log-ratio is AVERAGED over its completion's tokens
    (summed logprob / number of tokens), not summed, as TRL does and the IPO authors confirmed."""
    len_c, len_r = len_c.clamp(min=1), len_r.clamp(min=1)  # an empty completion: no NaN
    h = (pi_c - ref_c) / len_c - (pi_r - ref_r) / len_r
    return (h - 1 / (2 * beta)) ** 2


def simpo_loss(pi_c, pi_r, len_c, len_r, beta, gamma, label_smoothing=0.0):
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward"):
    -log sig(beta * (pi_c/len_c - pi_r/len_r) - gamma), no reference, length-normalized, target margin gamma;
    label smoothing e as in conservative DPO."""
    len_c, len_r = len_c.clamp(min=1), len_r.clamp(min=1)  # an empty completion: no NaN
    z = beta * (pi_c / len_c - pi_r / len_r) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def preference_loss(args: Args, pi_c, pi_r, ref_c, ref_r, len_c, len_r):
    """Per-pair losses [B] of --loss_type and the implicit rewards [B] of the chosen and rejected completions:
    beta * log(pi / pi_ref); per-token averages for ipo and simpo (simpo has no reference: log pi_ref = 0)."""
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


# ----------------------------------------------------------------------------------------------------------------
# Data: tokenize, truncate, put chosen and rejected in one batch
# ----------------------------------------------------------------------------------------------------------------
def truncate_pair(prompt, chosen, rejected, args: Args):
    """Fit one pair of token lists under the length flags, or None when the prompt leaves no room under
    --max_length for one completion token. A prompt longer than --max_prompt_length keeps its last (keep_end)
    or first (keep_start) tokens; each completion then keeps its first tokens that fit."""
    if args.max_prompt_length is not None and len(prompt) > args.max_prompt_length:
        keep_end = args.truncation_mode == "keep_end"
        prompt = prompt[-args.max_prompt_length :] if keep_end else prompt[: args.max_prompt_length]
    room = min(args.max_length - len(prompt), args.max_completion_length or args.max_length)
    return (prompt, chosen[:room], rejected[:room]) if args.max_length - len(prompt) >= 1 else None


def tokenize_dataset(dataset, tokenizer, args: Args, where: str) -> tuple[list[dict], dict]:
    """Token rows {index, prompt, chosen, rejected} of preference pairs in any of TRL's formats (utils.data:
    explicit or implicit prompt, standard or conversational) and counts of the rows truncated and dropped.
    Each completion ends with EOS (added unless it is already there) so that the policy learns to stop."""
    texts = utils.data.preference_texts(dataset, tokenizer, where)
    ids = [utils.chat.encode(tokenizer, texts[c], leading=c == "prompt") for c in COLUMNS]
    eos, rows = tokenizer.eos_token_id, []
    counts = {"pairs": len(dataset), "dropped": 0, "prompts_truncated": 0, "completions_truncated": 0}
    for prompt, chosen, rejected in zip(*ids):
        chosen, rejected = [t if t[-1:] == [eos] else t + [eos] for t in (chosen, rejected)]
        fitted = truncate_pair(prompt, chosen, rejected, args)
        if fitted is None:
            counts["dropped"] += 1
            continue
        counts["prompts_truncated"] += len(fitted[0]) < len(prompt)
        counts["completions_truncated"] += len(fitted[1]) + len(fitted[2]) < len(chosen) + len(rejected)
        rows.append({"index": len(rows), "prompt": fitted[0], "chosen": fitted[1], "rejected": fitted[2]})
    if not rows:
        raise ValueError(
            f"{where}: no prompt leaves room for a completion under --max_length {args.max_length}; "
            "raise --max_length or set a smaller --max_prompt_length."
        )
    return rows, counts


def concatenated_inputs(prompts, chosens, rejecteds, pad_token_id: int) -> dict[str, torch.Tensor]:
    """One right-padded batch [2B, T]: prompt+chosen of every pair, then prompt+rejected, so that both go
    through the model in one forward pass. completion_mask marks the completion tokens (the only ones in the
    loss).
    Padding is read from attention_mask, never from the pad id, so pad == eos is safe."""
    pairs = list(zip(list(prompts) * 2, list(chosens) + list(rejecteds)))
    return {
        "input_ids": utils.pad([p + c for p, c in pairs], pad_token_id),
        "attention_mask": utils.pad([[1] * (len(p) + len(c)) for p, c in pairs], 0),
        "completion_mask": utils.pad([[0] * len(p) + [1] * len(c) for p, c in pairs], 0).bool(),
    }


def collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    batch = concatenated_inputs(*[[r[c] for r in rows] for c in COLUMNS], pad_token_id)
    return {**batch, "index": torch.tensor([r["index"] for r in rows])}


def completion_logps(model, batch: dict[str, torch.Tensor]):
    """Summed logprob [N] of each row's completion tokens, their number [N], and their mean logit [N]. Only the
    completion positions reach the LM head (utils.token_logprobs: no [N, T, V] logits)."""
    mask = batch["completion_mask"][:, 1:].bool()  # position t predicts token t+1
    token_logps, _, mean_logits = utils.token_logprobs(
        model, batch["input_ids"], batch["attention_mask"], mask, with_stats=True
    )
    lengths = mask.sum(-1).float()
    return token_logps.sum(-1), lengths, mean_logits.sum(-1) / lengths


@torch.no_grad()
def sample_table(model, rows: list[dict], tokenizer, length: int) -> dict[str, list[str]]:
    """Greedy completions (`length` tokens, cut after EOS) of the rows' prompts, left-padded for generation,
    beside the end of each prompt and its chosen completion."""
    responses, _ = utils.complete(model, tokenizer, [r["prompt"] for r in rows], length, len(rows))
    decode = partial(tokenizer.batch_decode, skip_special_tokens=True)
    prompts = [p[-60:] for p in decode([r["prompt"] for r in rows])]
    return {
        "prompt (end)": prompts,
        "greedy": decode(responses),
        "chosen": decode([r["chosen"] for r in rows]),
    }


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
def check_args(args: Args) -> None:
    """Reject impossible flag values with one sentence, before anything is loaded."""
    if args.beta <= 0:
        raise ValueError(f"--beta must be positive, got {args.beta}.")
    if not 0 <= args.label_smoothing < 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}.")
    if args.label_smoothing > 0 and args.loss_type in ("ipo", "hinge"):
        raise ValueError(f"--label_smoothing has no effect with --loss_type {args.loss_type}; leave it at 0.")
    if args.max_prompt_length is not None and not 0 < args.max_prompt_length < args.max_length:
        raise ValueError(f"--max_prompt_length must be in [1, --max_length - 1 = {args.max_length - 1}].")
    sizes = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
    for flag in (*sizes, "logging_steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise ValueError("set --max_steps > 0 or --num_train_epochs > 0.")


def main(args: Args) -> dict:
    from accelerate.utils import broadcast_object_list, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, get_scheduler

    # 1. Flags and accelerator.
    if args.max_prompt_length == Args.max_prompt_length and args.max_prompt_length >= args.max_length:
        args.max_prompt_length = max(1, args.max_length // 2)  # the default follows a smaller --max_length
    check_args(args)
    utils.check_output_dir(args.output_dir, args.overwrite_output_dir or bool(args.resume_from_checkpoint))
    ga, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    accelerator = utils.run.make_accelerator(args, ga, micro)
    is_main, device, rank = accelerator.is_main_process, accelerator.device, accelerator.process_index
    world = accelerator.num_processes
    run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.run_name = broadcast_object_list([run_name])[0]  # the same name on every process
    checkpointer = utils.checkpoint.Checkpointer(accelerator, args)  # takes the run name of a resumed run
    set_seed(args.seed)

    # 2. Data first: missing columns and impossible lengths fail before any model is loaded.
    tokenizer = utils.load_tokenizer(args.model_name_or_path, "--model_name_or_path", args.chat_template_path)
    test_split = args.dataset_test_split if args.eval_strategy == "steps" else None
    (train_rows, train_counts), (eval_rows, eval_counts) = [
        tokenize_dataset(
            utils.data.load_split(args.dataset_name, split, args.dataset_config),
            tokenizer,
            args,
            f"split {split!r}",
        )
        if split is not None
        else ([], {})
        for split in (args.dataset_train_split, test_split)
    ]
    if is_main:
        print(f"train split: {train_counts}\ntest split: {eval_counts}")
    collate_fn = partial(collate, pad_token_id=tokenizer.pad_token_id)
    eval_loader = DataLoader(eval_rows, args.per_device_eval_batch_size, collate_fn=collate_fn)
    micro_per_epoch = len(train_rows) // (micro * world)
    if micro_per_epoch < ga:
        raise ValueError(
            f"the training split has {len(train_rows)} pairs, fewer than one batch of {micro * ga * world} "
            "(per_device_train_batch_size x gradient_accumulation_steps x processes); lower those flags."
        )

    def micro_batch(m: int) -> dict:
        """This process's m-th micro-batch (utils.shuffled_micro_batch: found again exactly on resume)."""
        rows = utils.shuffled_micro_batch(len(train_rows), m, micro, world, rank, args.seed)
        batch = collate_fn([train_rows[j] for j in rows])
        return {key: value.to(device) for key, value in batch.items()}

    # 3. Models: the policy (LoRA adapters when asked) and the frozen reference, unless LoRA (the base with the
    # adapters disabled) or precomputed log-probabilities stand in for it; optimizer and schedule.
    load_model = partial(
        utils.from_pretrained, AutoModelForCausalLM, args.model_name_or_path, "--model_name_or_path"
    )
    model = load_model()
    if args.gradient_checkpointing:
        utils.enable_gradient_checkpointing(model)
    if args.use_peft:
        from peft import LoraConfig, get_peft_model

        targets = "all-linear" if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
        lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")  # fmt: skip
        model = get_peft_model(model, lora)
    utils.disable_dropout(model)  # after LoRA wrapping, so the adapters' dropout is off too: the implicit
    # reward must be a deterministic function of the weights
    needs_reference = not args.reference_free and args.loss_type != "simpo"
    ref_model = None  # with LoRA or precomputed logprobs no second copy of the model is held
    if needs_reference and not args.use_peft and not args.precompute_ref_log_probs:
        ref_model = load_model()
        utils.disable_dropout(ref_model)
        ref_model = utils.run.prepare_frozen(ref_model, accelerator)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = utils.run.adamw(trained, lr=args.learning_rate, weight_decay=args.weight_decay)
    model, optimizer, eval_loader = accelerator.prepare(model, optimizer, eval_loader)

    args.batch_size = micro * ga * world
    steps_per_epoch = micro_per_epoch // ga
    epoch_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
    args.num_training_steps = args.max_steps if args.max_steps > 0 else epoch_steps
    # Stepped by hand once per optimizer step (a prepared scheduler would step once per process).
    warmup_steps = math.ceil(args.warmup_ratio * args.num_training_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup_steps, args.num_training_steps)

    @torch.no_grad()
    def live_reference_logps(batch) -> torch.Tensor:
        """Reference logprobs [2B]: the frozen copy, or the policy itself (before training, to precompute
        them; with LoRA, with its adapter disabled, which is exactly the base model)."""
        module = ref_model if ref_model is not None else accelerator.unwrap_model(model)
        with module.disable_adapter() if args.use_peft else nullcontext(), accelerator.autocast():
            return completion_logps(module, batch)[0]

    # 4. The reference log-probabilities of every pair, once, when precomputed.
    ref_tables = {}  # split -> [rows, (chosen, rejected)], filled by one pass before training
    if needs_reference and args.precompute_ref_log_probs:
        model.eval()
        # In dataset order: going through the shuffled train loader would change the training order.
        sequential = accelerator.prepare(
            DataLoader(train_rows, args.per_device_eval_batch_size, collate_fn=collate_fn)
        )
        for split, loader, rows in (("train", sequential, train_rows), ("test", eval_loader, eval_rows)):
            ref_tables[split] = torch.zeros(len(rows), 2, device=device)
            for batch in tqdm(loader, desc=f"reference logprobs ({split})", disable=not is_main):
                logps = live_reference_logps(batch).view(2, -1).T  # [B, (chosen, rejected)]
                index, logps = accelerator.gather_for_metrics((batch["index"], logps))
                ref_tables[split][index] = logps.float()

    def batch_metrics(batch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean loss of a batch and its per-pair metrics [B, len(METRICS)]."""
        logps, lengths, mean_logits = completion_logps(model, batch)  # chosen rows first, then rejected
        if not needs_reference:
            ref = torch.zeros_like(logps)
        elif ref_tables:
            ref = ref_tables[split][batch["index"]].T.reshape(-1)
        else:
            ref = live_reference_logps(batch)
        n = logps.size(0) // 2
        losses, reward_c, reward_r = preference_loss(
            args, logps[:n], logps[n:], ref[:n], ref[n:], lengths[:n], lengths[n:]
        )
        metrics = [losses, reward_c, reward_r, reward_c - reward_r, (reward_c > reward_r).float()]
        metrics += [logps[:n], logps[n:], mean_logits[:n], mean_logits[n:]]
        return losses.mean(), torch.stack([m.detach().float() for m in metrics], 1)

    print(utils.run.describe_sharding(model, accelerator), flush=True)
    # Resumed after the reference logprobs were precomputed: they come from the initial weights.
    resumed = checkpointer.resume({"model": model}, {"model": optimizer}) or {"step": 0}
    if resumed["step"]:
        scheduler.load_state_dict(resumed["scheduler"])
    train_metrics = resumed.get(
        "train_metrics", {}
    )  # the last logged, for the model card of a run resumed at its end
    tracker = utils.tracking.Tracker(args, accelerator, start_step=resumed["step"])

    def evaluate(step: int) -> dict:
        """Metrics over the whole test split (gathered from every process) and a table of greedy samples."""
        if not eval_rows:  # no test split (--eval_strategy no)
            return {}
        model.eval()
        with torch.no_grad():
            metrics = torch.cat(
                [accelerator.gather_for_metrics(batch_metrics(b, "test")[1]) for b in eval_loader]
            )
        result = {f"eval/{name}": value for name, value in zip(METRICS, metrics.mean(0).tolist())}
        if args.generate_during_eval:  # on every process: ZeRO-3 gathers the weights collectively
            rows = eval_rows[: args.per_device_eval_batch_size]
            length = args.max_completion_length or max(len(r["chosen"]) for r in rows)
            with accelerator.autocast():
                samples = sample_table(accelerator.unwrap_model(model), rows, tokenizer, length)
        tracker.log(result, step)
        if is_main:
            if args.generate_during_eval:
                utils.print_samples(samples, f"step {step}: accuracy {result['eval/rewards/accuracies']:.3f}")
                tracker.writer.add_text("eval/samples", "\n\n".join(map(repr, samples["greedy"])), step)
        model.train()
        return result

    if is_main:
        print(
            f"{args.num_training_steps} steps of {args.batch_size} pairs on {accelerator.num_processes} process(es)"
        )
    # 5. Training: the preference loss per micro-batch, an optimizer step every --gradient_accumulation_steps,
    # metrics, evaluation and checkpoints.
    global_step = resumed["step"]
    progress = tqdm(total=args.num_training_steps, initial=global_step, disable=not is_main)
    sums, micro_batches, tokens = torch.zeros(len(METRICS), device=device), 0, torch.zeros((), device=device)
    log_start = time.time()
    model.train()
    while global_step < args.num_training_steps:
        for m in range(global_step * ga, (global_step + 1) * ga):
            batch = micro_batch(m)
            with accelerator.accumulate(model):
                loss, metrics = batch_metrics(batch, "train")
                accelerator.backward(loss)
                grad_norm = utils.run.clip_grad_norm(accelerator, model, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            sums, micro_batches = sums + metrics.mean(0), micro_batches + 1
            tokens = tokens + batch["attention_mask"].sum()  # policy tokens: prompts and both completions
        scheduler.step()
        global_step += 1
        progress.update(1)
        grad_norm = utils.run.grad_norm_after_step(model, grad_norm)
        utils.tracking.check_finite(global_step, accelerator, loss=loss, grad_norm=grad_norm)
        if global_step % args.logging_steps == 0 or global_step == args.num_training_steps:
            means = accelerator.reduce(sums / micro_batches, reduction="mean").tolist()
            tokens_per_second = accelerator.reduce(tokens, reduction="sum").item() / (time.time() - log_start)
            train_metrics = dict(
                zip(METRICS, means), lr=scheduler.get_last_lr()[0], epoch=global_step / steps_per_epoch
            )
            train_metrics["perf/tokens_per_second"] = tokens_per_second
            if grad_norm is not None:
                train_metrics["grad_norm"] = grad_norm
            tracker.log(train_metrics, global_step)
            progress.set_postfix(loss=f"{means[0]:.4f}", accuracy=f"{means[4]:.3f}")
            sums, micro_batches, tokens, log_start = sums * 0, 0, tokens * 0, time.time()
        if (
            args.eval_steps > 0
            and global_step % args.eval_steps == 0
            and global_step < args.num_training_steps
        ):
            evaluate(global_step)
        checkpointer.maybe_save(global_step, {"model": model}, {"model": optimizer},
                                state={"scheduler": scheduler.state_dict(), "train_metrics": train_metrics})  # fmt: skip
    progress.close()
    final = {f"train/{k}": v for k, v in train_metrics.items()}
    final["train_seconds"] = checkpointer.elapsed_seconds()  # every part of a resumed run, not the last alone
    final |= evaluate(global_step) | {f"data/train_{k}": v for k, v in train_counts.items()}
    final |= {f"data/test_{k}": v for k, v in eval_counts.items()}

    # 6. Save into a temporary directory, moved in at the end: a failed run leaves --output_dir as it was.
    accelerator.wait_for_everyone()
    parent, name = os.path.split(os.path.abspath(args.output_dir))
    tmp_dir = os.path.join(parent, f".{name}.{args.run_name}.partial")
    unwrapped = accelerator.unwrap_model(model)
    if args.use_peft:  # a plain causal-LM directory: the adapter is merged into the weights
        unwrapped, state_dict = unwrapped.merge_and_unload(), None
    else:
        state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards
    unwrapped.save_pretrained(
        tmp_dir, is_main_process=is_main, save_function=accelerator.save, state_dict=state_dict
    )
    accelerator.wait_for_everyone()  # every process is done with tmp_dir before it is moved in
    if is_main:
        tokenizer.save_pretrained(tmp_dir)
        algorithm, dataset = f"DPO (loss_type={args.loss_type}, beta={args.beta})", args.dataset_name
        utils.write_model_card(
            tmp_dir, algorithm, args.model_name_or_path, f"{dataset} ({args.dataset_train_split})", final,
            title=os.path.basename(os.path.abspath(args.output_dir)),
        )  # fmt: skip
        os.makedirs(args.output_dir, exist_ok=True)
        for file in os.listdir(tmp_dir):
            os.replace(os.path.join(tmp_dir, file), os.path.join(args.output_dir, file))
        shutil.rmtree(tmp_dir)
        print(
            f"saved to {args.output_dir}; test accuracy {final.get('eval/rewards/accuracies', float('nan')):.4f}"
        )
        if args.push_to_hub:
            utils.saving.push_to_hub(args)
    tracker.close()
    utils.run.end_run(accelerator)
    return final


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
