"""The run skeleton every script shares: command line and error handling, the accelerator (one process, DDP,
DeepSpeed ZeRO-2/3, on CPU or GPU), frozen models in the trained model's precision, generation under ZeRO-3,
gradient clipping that DeepSpeed honours, the fused AdamW every script trains with, handing freed host memory
back between phases, and the end of a run.
Metrics and the non-finite guard are utils/tracking.py; checkpoints utils/checkpoint.py.

A script's `__main__` is one line, `utils.run.run_cli(Args, main)`. Bad input raises `ValueError` with one
sentence; it reaches the user as `script.py: error: <sentence>` (exit 2), never as a traceback. Set
`RLHF_TRACEBACK=1` to see the traceback anyway.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

TRUE_WORDS, FALSE_WORDS = {"true", "1", "yes"}, {"false", "0", "no"}


class NonFiniteError(RuntimeError):
    """A NaN or an infinity in a loss, a score or a gradient norm: the run stops, nothing more is saved."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM or SIGINT arrived; the run finished its step, wrote a checkpoint (the message names it) and stops."""

    def __init__(self, message: str, signal_name: str = "SIGTERM"):
        super().__init__(message)
        self.exit_code = 130 if signal_name == "SIGINT" else 143


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------
def _bool_fields(args_class) -> set[str]:
    hints = typing.get_type_hints(args_class)
    return {f.name for f in dataclasses.fields(args_class) if hints.get(f.name) is bool}


def normalize_bool_flags(args_class, argv: list[str]) -> list[str]:
    """Accept booleans written with a value, as TRL's HfArgumentParser does (`--bf16 True`, `--bf16=false`),
    besides tyro's `--bf16` / `--no_bf16`. Returns the argv tyro understands."""
    names, out, i = _bool_fields(args_class), [], 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        name = name.replace("-", "_")
        if name in names:
            if not eq and i + 1 < len(argv) and argv[i + 1].lower() in TRUE_WORDS | FALSE_WORDS:
                value, i = argv[i + 1], i + 1
            elif not eq:
                value = "true"
            if value.lower() not in TRUE_WORDS | FALSE_WORDS:
                raise ValueError(f"--{name} takes true or false, got {value!r}.")
            token = f"--{name}" if value.lower() in TRUE_WORDS else f"--no_{name}"
        out.append(token)
        i += 1
    return out


def known_flags(args_class) -> set[str]:
    """Every flag name the script takes, without dashes: its fields, their `no_` forms and their aliases."""
    hints = typing.get_type_hints(args_class, include_extras=True)
    names = {"help"}
    for field in dataclasses.fields(args_class):
        names |= {field.name, f"no_{field.name}"}
        for meta in getattr(hints.get(field.name), "__metadata__", ()):
            names |= {alias.lstrip("-").replace("-", "_") for alias in getattr(meta, "aliases", None) or ()}
    return names


def check_flags(args_class, argv: list[str]) -> None:
    """Refuse, in one sentence naming the closest flag, a flag the script does not take (e.g. one of TRL's that
    means nothing here), instead of tyro's usage box."""
    import difflib

    known = known_flags(args_class)
    for token in argv:
        name = _flag_name(token)
        if name and name not in known and name in TRL_REFUSED:
            raise ValueError(f"--{name} (a TRL flag) means nothing here: {TRL_REFUSED[name]}.")
        if name and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean --{close[0]}?" if close else "see --help for the flags it takes."
            raise ValueError(f"unknown flag --{name}; {hint}")


# TRL flags that mean nothing here. A harmless one is dropped, with its values, and a one-line note says why;
# any other is refused in one sentence (check_flags). A flag the script takes itself is never looked up here.
TRL_HARMLESS = {
    "remove_unused_columns": "a script reads only the columns of its data format and ignores the others anyway",
    "report_to": "metrics always go to TensorBoard (--logging_dir), and to W&B with --track",
    "bf16_full_eval": "evaluation runs in the training precision",
    "logging_first_step": "metrics are logged on the script's own schedule",
    "logging_strategy": "metrics are logged on the script's own schedule",
    "log_level": "the scripts print one line per event and a progress bar",
    "save_strategy": "checkpoints are written every --save_steps steps (0: only on SIGTERM), and at the end",
    "save_only_model": "a checkpoint holds what an exact resume needs",
    "dataset_num_proc": "data is prepared in one process",
    "dataloader_num_workers": "batches are built in the training process",
    "dataset_streaming": "the dataset is read whole",
    "attn_implementation": "the model's default attention is used",
    "use_liger_kernel": "the plain PyTorch forward is used",
    "gradient_checkpointing_kwargs": "--gradient_checkpointing always uses non-reentrant checkpointing",
    "ddp_find_unused_parameters": "every parameter gets a gradient",
    "trust_remote_code": "models load with the classes of the installed transformers",
    "model_revision": "hub models load at their main revision",
}
TRL_REFUSED = {
    "use_peft": "LoRA is only in sft.py and dpo.py",
    "lora_r": "LoRA is only in sft.py and dpo.py",
    "lora_alpha": "LoRA is only in sft.py and dpo.py",
    "lora_dropout": "LoRA is only in sft.py and dpo.py",
    "lora_task_type": "LoRA is only in sft.py and dpo.py",
    "lora_target_modules": "LoRA is only in sft.py and dpo.py",
    "load_in_4bit": "quantized training is not supported",
    "load_in_8bit": "quantized training is not supported",
    "fp16": "fp16 is not supported; use --bf16",
    "deepspeed": "give DeepSpeed to accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml (or zero3)",
    "optim": "the optimizer is AdamW, written in the script",
    "torch_dtype": "weights are trained in float32 (DeepSpeed's bf16 or --bf16 autocast give bf16 compute)",
    "dtype": "weights are trained in float32 (DeepSpeed's bf16 or --bf16 autocast give bf16 compute)",
}


def _flag_name(token: str) -> str:
    return token[2:].partition("=")[0].replace("-", "_") if token.startswith("--") else ""


def translate_trl_flags(args_class, argv: list[str], notes: list[str] | None = None) -> list[str]:
    """argv without TRL's harmless flags (each with the values after it, or `--flag=value`), a note for each
    in `notes`; `--warmup_steps` below 1 (a fraction of training, as transformers reads it) becomes
    --warmup_ratio where the script has it. Flags the script takes are left alone."""
    known, out, i = known_flags(args_class), [], 0
    while i < len(argv):
        token, name = argv[i], _flag_name(argv[i])
        base = name[3:] if name.startswith("no_") and name[3:] in TRL_HARMLESS else name
        end = i + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1  # the flag's values
        if name and name not in known and base in TRL_HARMLESS:
            if notes is not None:
                notes.append(f"--{name} (a TRL flag) is ignored: {TRL_HARMLESS[base]}.")
            i = end
            continue
        if name == "warmup_steps" and name not in known and "warmup_ratio" in known:
            value = token.partition("=")[2] if "=" in token else " ".join(argv[i + 1 : end])
            try:
                fraction = float(value)
            except ValueError:
                fraction = -1.0
            if not 0 <= fraction < 1:
                raise ValueError(
                    f"--warmup_steps {value}: give the warmup as a fraction of training, --warmup_ratio "
                    "(or --warmup_steps below 1, which is read as that fraction)."
                )
            out += ["--warmup_ratio", repr(fraction)]
            i = end
            continue
        out.append(token)
        i += 1
    return out


def parse_args(args_class, argv: list[str] | None = None):
    """The dataclass filled from the command line (tyro, underscores), booleans also written with a value; TRL's
    flags that mean nothing here dropped with a note (harmless) or refused (see TRL_HARMLESS, TRL_REFUSED)."""
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    notes: list[str] = []
    argv = translate_trl_flags(args_class, argv, notes)
    if int(os.environ.get("RANK", "0")) == 0:
        script = os.path.basename(sys.argv[0]) or "script"
        for note in notes:
            print(f"{script}: note: {note}", file=sys.stderr)
    check_flags(args_class, argv)
    return tyro.cli(args_class, args=normalize_bool_flags(args_class, argv), use_underscores=True)


def exact_div(numerator: int, denominator: int, what: str) -> int:
    """`numerator // denominator`, or a ValueError naming the flags (`what`) when it does not divide exactly."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}; change one of these flags.")
    return numerator // denominator


def check_flag_values(args) -> None:
    """Checks every script shares, before its own: learning rates finite and >= 0; --max_prompt_length, when
    set, at least 1 (0 would mean no truncation at all)."""
    import math

    for name, value in vars(args).items():
        if name.endswith("learning_rate") and isinstance(value, int | float):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"--{name} must be a finite number >= 0, got {value}.")
    max_prompt_length = getattr(args, "max_prompt_length", None)
    if isinstance(max_prompt_length, int) and max_prompt_length < 1:
        raise ValueError(f"--max_prompt_length must be at least 1 (or left unset), got {max_prompt_length}.")


def raised_here(error: BaseException, script: str) -> bool:
    """Whether `error` was raised by the project's own code (the script or utils/), i.e. is a message for the
    user; an error raised inside a library is a bug to show with its traceback."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    if frame is None:
        return False
    filename = os.path.abspath(frame.tb_frame.f_code.co_filename)
    utils_dir = os.path.dirname(os.path.abspath(__file__))
    return filename == os.path.abspath(script) or filename.startswith(utils_dir + os.sep)


def run_cli(args_class, main: Callable) -> None:
    """Parse the flags and run `main(args)`, turning the errors a user can act on into one line on stderr:
    bad input (ValueError) exits 2, a non-finite value 1, SIGTERM 143 and SIGINT 130 after a checkpoint (on
    every process; the line is printed by the main process only)."""
    script = os.path.basename(sys.argv[0])
    show_traceback = os.environ.get("RLHF_TRACEBACK") == "1"
    try:
        args = parse_args(args_class)
        check_flag_values(args)
        main(args)
    except ValueError as error:
        if show_traceback or not raised_here(error, sys.argv[0]):
            raise
        end_progress_bars()
        print(f"{script}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except NonFiniteError as error:
        if show_traceback:
            raise
        end_progress_bars()
        if main_process():  # every process stops together; one line for the run
            print(f"{script}: stopped: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except TrainingInterrupted as error:
        end_progress_bars()
        if main_process():
            print(f"{script}: interrupted: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None


def end_progress_bars() -> None:
    """Close the open tqdm bars, so that the line printed next starts a line of its own instead of landing on
    the bar's (a bar ends its line only when closed)."""
    module = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(module, "tqdm", None), "_instances", ())):
        bar.close()


def main_process() -> bool:
    """Whether this is the first process of the run (RANK 0 under torchrun / accelerate launch, or alone)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


# ----------------------------------------------------------------------------------------------------------------
# Accelerator and models
# ----------------------------------------------------------------------------------------------------------------
def launch_without_process_group(environ) -> str | None:
    """Why this process was launched to be one of several but has no process group to join (a sentence), or
    None. `accelerate launch` without --multi_gpu (or a DeepSpeed/FSDP config) uses its simple launcher, which
    starts one process and exports MASTER_ADDR/MASTER_PORT (for --num_processes or --num_machines above 1) but
    no WORLD_SIZE or RANK: each "node" would then train alone and write the same --output_dir."""
    mpi_sizes = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # mpirun, which accelerate reads
    if "WORLD_SIZE" in environ or any(int(environ.get(name) or 1) > 1 for name in mpi_sizes):
        return None
    if "MASTER_ADDR" not in environ or "ACCELERATE_DYNAMO_BACKEND" not in environ:  # not accelerate launch's
        return None
    return (
        "accelerate launch was asked for several processes or machines (it set MASTER_ADDR) but started this "
        "one alone, with no process group to join; add --multi_gpu to the launch command on every machine "
        "(on machines without GPUs too, where it runs as MULTI_CPU over gloo), or launch one process with "
        "--num_processes 1 --num_machines 1 and MASTER_ADDR unset."
    )


def make_accelerator(
    args, gradient_accumulation_steps: int = 1, micro_batch_size: int | None = None, mixed_precision=None
):
    """The Accelerator of a run. Precision: bf16 with `--bf16`, else what `accelerate launch` configured.
    On CPU the process group uses gloo (without it every process believes it is rank 0 of 1), and several
    processes on a machine without GPUs run as MULTI_CPU, whatever the accelerate config says. Under DeepSpeed
    the micro-batch size, accumulation and `--max_grad_norm` go into its config: DeepSpeed clips gradients
    itself and ignores accelerate's clip_grad_norm_ (and would otherwise clip at 1.0 silently)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    problem = launch_without_process_group(os.environ)
    if problem:
        raise ValueError(problem)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun / accelerate launch set it
    launched, on_cpu = world_size > 1, not torch.cuda.is_available()
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched and on_cpu else []
    # Several processes on a machine without GPUs, not under DeepSpeed (which ACCELERATE_USE_CPU would turn
    # off): MULTI_CPU. Otherwise a multi-GPU config there gives distributed type NO, where every process
    # trains alone and gather/reduce do nothing.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("true", "1")
    accelerator = Accelerator(
        mixed_precision=mixed_precision or ("bf16" if getattr(args, "bf16", False) else None),
        gradient_accumulation_steps=gradient_accumulation_steps,
        kwargs_handlers=handlers,
        cpu=launched and on_cpu and not deepspeed,
    )
    if launched and (
        accelerator.distributed_type == DistributedType.NO or accelerator.num_processes != world_size
    ):
        raise ValueError(
            f"launched as {world_size} processes, but accelerate set up {accelerator.num_processes} without "
            "distributed training; on a machine without GPUs launch with --cpu (or ACCELERATE_USE_CPU=true)."
        )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        config = plugin.deepspeed_config
        if micro_batch_size is not None:
            config["train_micro_batch_size_per_gpu"] = micro_batch_size
            config["train_batch_size"] = (
                micro_batch_size * gradient_accumulation_steps * accelerator.num_processes
            )
        config["gradient_accumulation_steps"] = gradient_accumulation_steps
        max_grad_norm = getattr(args, "max_grad_norm", None)
        config["gradient_clipping"] = float(max_grad_norm) if max_grad_norm else 0.0
    return accelerator


def adamw(params, *args, **kwargs) -> torch.optim.AdamW:
    """`torch.optim.AdamW(params, *args, **kwargs)` with the fused kernel, as transformers' Trainer (and so TRL) uses by
    default: it updates each parameter in one pass, where the plain loop builds temporaries as large as the
    largest parameter (two of the [V, H] embedding: 300 MiB at Qwen's vocabulary and hidden 256)."""
    return torch.optim.AdamW(params, *args, fused=True, **kwargs)


def release_freed_host_memory() -> None:
    """Hand the host heap's freed pages back to the system (glibc's `malloc_trim`; a no-op where the C library
    has none, as on macOS or musl). One walk over the heap: milliseconds.

    glibc serves blocks smaller than the largest mapped block freed so far (up to 32 MiB) from its heap and keeps
    freed heap pages resident. rloo.py calls this between its rollout and its training step: its batched sampling
    frees many such blocks, and without this the training step's blocks piled up on top of them. On a CPU at the
    GRPO shape (rloo.py as `benchmark/speed.py --preset grpo` runs it) its peak RSS was 3065-3147 MiB without it
    (3 runs) and 2400-2681 MiB with it (4 runs), at the same CPU time. The other RL scripts do not call it: at the
    same place it left the peaks of ppo.py and online_dpo.py within 4% and made grpo.py's higher and erratic
    (2168-2535 MiB in 3 runs, against 2110-2168), and trimming before rloo.py's rollout as well raised its peak
    to 2774-2884 MiB. With CUDA tensors the host heap is small and this changes little."""
    import ctypes

    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # Windows has no process-wide handle to load
        return
    if trim is not None:
        trim(0)


def end_run(accelerator) -> None:
    """Tear the run down together: every process waits for the others (the main one may still be writing the
    model card) before the process group is destroyed. A process that destroys its group and exits while a
    peer still holds the connection can abort at exit ("terminate called without an active exception", seen
    under DeepSpeed on CPU), and the launcher then fails a run that finished."""
    import gc

    accelerator.wait_for_everyone()
    accelerator.end_training()
    gc.collect()  # engines and gloo work objects go now, while the interpreter is whole, not at its shutdown


def zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage of the run; 0 without DeepSpeed."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin.zero_stage if plugin is not None else 0


def training_dtype(accelerator) -> torch.dtype:
    """The dtype the trained model's weights have: bf16/fp16 under DeepSpeed mixed precision, else float32
    (plain accelerate keeps float32 weights and autocasts the forward)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return torch.float32
    config = plugin.deepspeed_config
    if config.get("bf16", {}).get("enabled") in (True, "auto") and accelerator.mixed_precision == "bf16":
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled") in (True, "auto") and accelerator.mixed_precision == "fp16":
        return torch.float16
    return torch.float32


def prepare_frozen(model: nn.Module, accelerator) -> nn.Module:
    """A frozen model (reference, reward) ready to run beside the trained one: eval mode, no gradients, on the
    device, in the trained model's precision. Without DeepSpeed its forwards must run inside
    `accelerator.autocast()`, as the trained model's do; under DeepSpeed (where autocast is off) its weights
    take the trained model's dtype, so a reference equal to the policy gives KL 0 at the start. Under ZeRO-3 it
    becomes a sharded DeepSpeed inference engine (every process must then run its forwards together)."""
    model.eval().requires_grad_(False)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return model.to(accelerator.device)
    model.to(accelerator.device)
    dtype = training_dtype(accelerator)
    for param in model.parameters():  # as DeepSpeed casts the trained model: buffers (rotary inv_freq) stay
        param.data = param.data.to(dtype)
    if plugin.zero_stage != 3:
        return model
    import deepspeed

    config = {k: v for k, v in plugin.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
    config["train_micro_batch_size_per_gpu"] = config.get("train_micro_batch_size_per_gpu", 1)
    config.pop("train_batch_size", None)
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    return engine


@contextmanager
def unsharded_loading(accelerator) -> Iterator[None]:
    """Inside this block `from_pretrained` loads whole weights even under ZeRO-3 with zero3_init_flag (whose
    sharded init would otherwise leave every process an empty shard of a model that only it uses)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3 or not plugin.zero3_init_flag:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def bare(model: nn.Module) -> nn.Module:
    """The transformers model inside a DDP or DeepSpeed wrapper (the model itself otherwise)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DeepSpeed wrappers (`bare`) and a PEFT wrapper."""
    model = bare(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextmanager
def gathered_for_generation(model: nn.Module, accelerator) -> Iterator[nn.Module]:
    """The bare model for the many small forwards of sampling. Under ZeRO-3 its shards are gathered once for
    the whole generation and DeepSpeed's per-layer hooks are removed meanwhile (otherwise every decoding
    step gathers every layer again); they are restored on exit. Every process must enter together."""
    if zero_stage(accelerator) != 3:
        yield bare(model)
        return
    import deepspeed

    if getattr(model, "optimizer", None) is None:  # a frozen inference engine: gather only
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield bare(model)
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(model):
        yield bare(model)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(parameters of the model, parameters this process holds): equal unless ZeRO-3 sharded the weights."""
    total = held = 0
    for param in model.parameters():
        full = getattr(param, "ds_numel", None)
        total += full if full is not None else param.numel()
        held += param.ds_tensor.numel() if full is not None else param.numel()
    return total, held


def local_param_share(model: nn.Module) -> float:
    """Under ZeRO-3, the share of the model's weights this process holds (1/N when sharded over N)."""
    params = list(model.parameters())
    return sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)


def describe_sharding(model: nn.Module, accelerator) -> str:
    """One line for the log: how many of the model's parameters this process holds."""
    total, held = parameter_counts(model)
    return f"process {accelerator.process_index}: holds {held} of the model's {total} parameters"


def clip_grad_norm(accelerator, model: nn.Module, max_norm: float | None) -> float | None:
    """Clip the gradients to `max_norm` (when set) and return their norm before clipping; call it after
    `accelerator.backward` and before `optimizer.step()`. Under DeepSpeed the engine clips by its config
    (`make_accelerator` put `--max_grad_norm` there) and the norm it measured is read after the step; this
    returns None there: use `grad_norm_after_step`."""
    if accelerator.state.deepspeed_plugin is not None or not accelerator.sync_gradients:
        return None
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
    return float(norm)


def grad_norm_after_step(model: nn.Module, measured: float | None) -> float | None:
    """The gradient norm of the last optimizer step: what `clip_grad_norm` measured, or DeepSpeed's own."""
    if measured is not None:
        return measured
    get_norm = getattr(model, "get_global_grad_norm", None)
    norm = get_norm() if get_norm is not None else None
    return None if norm is None else float(norm)


__all__ = [
    "NonFiniteError",
    "TrainingInterrupted",
    "bare",
    "clip_grad_norm",
    "gathered_for_generation",
    "grad_norm_after_step",
    "make_accelerator",
    "normalize_bool_flags",
    "parse_args",
    "prepare_frozen",
    "run_cli",
    "training_dtype",
    "zero_stage",
]
