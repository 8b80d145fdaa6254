"""Plumbing every script shares, skippable on a first read: the command line, the accelerator (DDP,
DeepSpeed ZeRO-2/3; ZeRO-3's own parts in utils/zero3.py), frozen models, gradient clipping, the end of a run.

`run_cli(Args, main)` turns a UsageError (ours, a ValueError) into `script.py: error: <sentence>` (exit 2);
RLHF_TRACEBACK=1 shows the traceback."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import typing
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn as nn


class UsageError(ValueError):
    """A mistake in the command line or its inputs, said in one sentence: run_cli prints it and exits 2."""


class NonFiniteError(RuntimeError):
    """A NaN or infinity in a loss, score or gradient norm: the run stops."""


class TrainingInterrupted(RuntimeError):
    """SIGTERM or SIGINT, after the step and a checkpoint (the message names it)."""

    def __init__(self, message: str, signal_name: str = "SIGTERM"):
        super().__init__(message)
        self.exit_code = 130 if signal_name == "SIGINT" else 143


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------
TRUE_WORDS, FALSE_WORDS = {"true", "1", "yes"}, {"false", "0", "no"}


def _bool_fields(args_class) -> set[str]:
    hints = typing.get_type_hints(args_class)
    return {f.name for f in dataclasses.fields(args_class) if hints.get(f.name) is bool}


def normalize_bool_flags(args_class, argv: list[str]) -> list[str]:
    """argv with TRL-style booleans (`--bf16 True`, `--bf16=false`) as tyro's `--bf16` / `--no_bf16`."""
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
                raise UsageError(f"--{name} takes true or false, got {value!r}.")
            token = f"--{name}" if value.lower() in TRUE_WORDS else f"--no_{name}"
        out.append(token)
        i += 1
    return out


def parse_args(args_class, argv: list[str] | None = None):
    """The Args dataclass from the command line: with utils/cli.py, TRL's flags translated or refused, one
    sentence for a bad flag or value, a grouped --help; a copy without that file parses with tyro alone."""
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    cli = extra_module("utils.cli")
    if cli:
        return cli.parse_args(args_class, argv)
    return tyro.cli(args_class, args=normalize_bool_flags(args_class, argv), use_underscores=True)


def exact_div(numerator: int, denominator: int, what: str) -> int:
    """`numerator // denominator`, or a UsageError naming the flags `what`."""
    if denominator <= 0 or numerator % denominator != 0:
        raise UsageError(f"{what}: {numerator} is not divisible by {denominator}; change one of these flags.")
    return numerator // denominator


def check_flag_values(args) -> None:
    """Shared checks: learning rates, weight decays and Adam's epsilon finite and >= 0, the clipping norm >= 0,
    the warmup ratio and Adam's betas in [0, 1] and [0, 1), the seed one NumPy takes, --max_prompt_length >= 1."""
    import math

    nonnegative = ("learning_rate", "adam_epsilon", "weight_decay")  # also ddpo.py's train_ names
    for name, value in vars(args).items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if name.endswith(nonnegative) and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{name} must be a finite number >= 0, got {value}.")
        if name.endswith("max_grad_norm") and not value >= 0:  # torch would flip every gradient's sign
            raise UsageError(f"--{name} must be at least 0 (0: no clipping), got {value}.")
        if name == "warmup_ratio" and not 0 <= value <= 1:
            raise UsageError(f"--warmup_ratio must lie in [0, 1], got {value}.")
        if name.endswith(("adam_beta1", "adam_beta2")) and not 0 <= value < 1:
            raise UsageError(f"--{name} must lie in [0, 1), got {value}.")
        if name == "seed" and not 0 <= value < 2**32:
            raise UsageError(f"--seed must lie in [0, 2**32 - 1], got {value}.")
    max_prompt_length = getattr(args, "max_prompt_length", None)
    if isinstance(max_prompt_length, int) and max_prompt_length < 1:
        raise UsageError(f"--max_prompt_length must be at least 1 (or left unset), got {max_prompt_length}.")


def optional_module(name: str, flag: str):
    """Import an optional utils module (`name`, e.g. "utils.vllm") that only `flag` needs; a copy of a script
    without its file gets one sentence saying which file to copy, not an ImportError."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name and not (error.name or "").startswith("utils."):  # a library is missing
            raise
        name = error.name  # this file, or another utils file it builds on
    path = name.replace(".", "/") + ".py"
    raise UsageError(
        f"{flag} needs {path}, which this copy lacks: copy it from the repository this script came from "
        f"into {os.path.dirname(path)}/ beside run.py."
    )


@functools.cache  # token_logprobs asks on every call: a copy without the file must not search the disk each time
def extra_module(name: str):
    """An optional utils module that no flag asks for (`name`, e.g. "utils.safeguards"), or None when this copy
    lacks its file: the caller then takes its plain path. Looked up by name: the core never imports it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:  # the file is there; something it imports is not
            raise
        return None


def run_cli(args_class, main: Callable) -> None:
    """Parse the flags and run `main(args)`. Exit codes: bad input 2, non-finite value 1, SIGTERM 143,
    SIGINT 130; one stderr line each, also for a signal before training or after the last step."""
    import utils.signals as signals

    signals.received(clear=True)
    signals.stop_before_training(imports=False)  # first thing: a Ctrl-C while the flags parse is one line too
    script = os.path.basename(sys.argv[0])
    show_traceback = os.environ.get("RLHF_TRACEBACK") == "1"
    try:
        args = parse_args(args_class)
        check_flag_values(args)
        main(args)
        signals.stop_after_training()
        late = signals.received()
        if late:  # came after the loop's last check: the run is done, but was asked to stop
            end_progress_bars()
            signals.say(f"interrupted: {late} received after the last step; the run finished and its output "
                        "is saved.")  # fmt: skip
            raise SystemExit(signals.exit_code(late))
    except UsageError as error:  # any other ValueError is a bug: its traceback shows
        if show_traceback:
            raise
        end_progress_bars()
        print(f"{script}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except NonFiniteError as error:
        if show_traceback:
            raise
        end_progress_bars()
        if main_process():  # every process stops; one line for the run
            print(f"{script}: stopped: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except TrainingInterrupted as error:
        end_progress_bars()
        if main_process():
            print(f"{script}: interrupted: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None
    except KeyboardInterrupt:  # a library put Python's default handler back: still one line
        if show_traceback:
            raise
        end_progress_bars()
        signals.say("interrupted (Ctrl-C); nothing was saved after the last checkpoint.")
        raise SystemExit(130) from None


def end_progress_bars() -> None:
    """Close open tqdm bars, so the next message starts its own line."""
    module = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(module, "tqdm", None), "_instances", ())):
        bar.close()


def main_process() -> bool:
    """Whether this is the run's first process (RANK 0, or alone)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


# ----------------------------------------------------------------------------------------------------------------
# Accelerator and models
# ----------------------------------------------------------------------------------------------------------------
def launch_without_process_group(environ) -> str | None:
    """A sentence when `accelerate launch` lacked --multi_gpu (MASTER_ADDR set, no WORLD_SIZE), else None."""
    mpi_sizes = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # mpirun's, read by accelerate
    if "WORLD_SIZE" in environ or any(int(environ.get(name) or 1) > 1 for name in mpi_sizes):
        return None
    if "MASTER_ADDR" not in environ or "ACCELERATE_DYNAMO_BACKEND" not in environ:  # not accelerate launch
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
    """The run's Accelerator: bf16 with `--bf16`, else as launched; gloo on CPU; under DeepSpeed the
    micro-batch, accumulation and `--max_grad_norm` go into its config."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    problem = launch_without_process_group(os.environ)
    if problem:
        raise UsageError(problem)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
    launched, on_cpu = world_size > 1, not torch.cuda.is_available()
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched and on_cpu else []
    # processes without GPUs run as MULTI_CPU, else each would train alone
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
        raise UsageError(
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
        if plugin.zero_stage == 3:
            zero3()  # a copy without the file stops here, not at its first sample
    return accelerator


def adamw(params, *args, **kwargs) -> torch.optim.AdamW:
    """`torch.optim.AdamW` with the fused kernel, as transformers' Trainer (docs/memory.md)."""
    return torch.optim.AdamW(params, *args, fused=True, **kwargs)


OPTIMIZERS = (
    "adamw_torch_fused",
    "adamw_torch",
)  # the --optim values: one AdamW, fused or not, as transformers'
LR_SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                "inverse_sqrt")  # fmt: skip


def trainer_optimizer(model: nn.Module, args) -> torch.optim.AdamW:
    """AdamW as TRL's Trainer builds it: --weight_decay on every trained weight but biases and norms (transformers'
    own rule), betas (--adam_beta1, --adam_beta2), --adam_epsilon, fused unless --optim adamw_torch."""
    if args.optim not in OPTIMIZERS:
        raise UsageError(f"--optim {args.optim}: only {' and '.join(OPTIMIZERS)} are written here.")
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in trained], "weight_decay": 0.0}]
    if args.weight_decay:  # one group when there is no decay: the optimizer state of older checkpoints fits
        from transformers import Trainer

        decayed = set(Trainer.get_decay_parameter_names(None, model))
        groups = [
            {"params": [p for name, p in trained if name in decayed], "weight_decay": args.weight_decay},
            {"params": [p for name, p in trained if name not in decayed], "weight_decay": 0.0},
        ]
    betas = (args.adam_beta1, args.adam_beta2)
    fused = args.optim == "adamw_torch_fused"
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon, fused=fused)


def lr_schedule(args, total_steps: int) -> Callable[[int], float]:
    """step -> learning rate: --learning_rate times transformers' --lr_scheduler_type at `step` (from 0) of
    `total_steps`, after --warmup_steps (below 1: that fraction of total_steps, as transformers 5; or
    --warmup_ratio) of linear warmup, as TRL's Trainer steps its scheduler. Stateless: a resume needs no state."""
    from transformers import get_scheduler

    if args.lr_scheduler_type not in LR_SCHEDULES:
        raise UsageError(
            f"--lr_scheduler_type must be one of {', '.join(LR_SCHEDULES)}; got {args.lr_scheduler_type}."
        )
    steps, ratio = getattr(args, "warmup_steps", 0.0) or 0.0, getattr(args, "warmup_ratio", 0.0) or 0.0
    if steps < 0 or ratio < 0 or (steps and ratio):
        raise UsageError("give the warmup once, as --warmup_steps (steps, or below 1 a fraction) >= 0.")
    warmup = int(steps) if steps >= 1 else math.ceil(total_steps * (steps or ratio))
    if not args.learning_rate:
        return lambda step: 0.0
    # the polynomial schedule reads the optimizer's rate
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    factor = get_scheduler(args.lr_scheduler_type, probe, warmup, total_steps).lr_lambdas[0]
    return lambda step: args.learning_rate * factor(step)


def release_freed_host_memory() -> None:
    """Return the host heap's freed pages to the system (glibc's `malloc_trim`; elsewhere a no-op)."""
    import ctypes

    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # Windows: no process-wide handle
        return
    if trim is not None:
        trim(0)


def end_run(accelerator, engine=None) -> None:
    """End the run together, so no process aborts at exit while a peer still holds the connection; a vLLM
    `engine` is closed first (at exit, after the process group is gone, its shutdown raises)."""
    import gc

    if engine is not None:
        engine.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    gc.collect()  # free engines and gloo work now, not at interpreter shutdown


def zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage; 0 without DeepSpeed."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin.zero_stage if plugin is not None else 0


def zero3():
    """utils/zero3.py: frozen engines, gathering for sampling, whole weights at load; only ZeRO-3 needs it."""
    return optional_module("utils.zero3", "a DeepSpeed ZeRO-3 launch")


def training_dtype(accelerator) -> torch.dtype:
    """The trained weights' dtype: bf16/fp16 under DeepSpeed mixed precision, else float32."""
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
    """A frozen model (reference, reward): eval, no gradients, on the device, in the trained model's precision
    (a reference equal to the policy gives KL 0); under ZeRO-3 a sharded engine."""
    model.eval().requires_grad_(False)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return model.to(accelerator.device)
    model.to(accelerator.device)
    dtype = training_dtype(accelerator)
    for param in model.parameters():  # as DeepSpeed casts the policy: buffers stay
        param.data = param.data.to(dtype)
    return zero3().frozen_engine(model, plugin) if plugin.zero_stage == 3 else model


def unsharded_loading(accelerator) -> AbstractContextManager[None]:
    """`from_pretrained` loads whole weights in this block, even under ZeRO-3."""
    if zero_stage(accelerator) != 3:
        return nullcontext()
    return zero3().unsharded_loading(accelerator.state.deepspeed_plugin)


def bare(model: nn.Module) -> nn.Module:
    """The transformers model inside a DDP or DeepSpeed wrapper."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model inside `bare`'s wrappers and a PEFT one."""
    model = bare(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def gathered_mean(accelerator, values) -> float:
    """Mean of every process's values (any shape), NaN entries left out; NaN when there are none."""
    values = accelerator.gather(values.detach().float().reshape(-1))
    return (values.nanmean() if values.isnan().any() else values.mean()).item()


def gathered_for_generation(model: nn.Module, accelerator) -> AbstractContextManager[nn.Module]:
    """`with gathered_for_generation(model, accelerator) as bare:` the bare model for sampling; ZeRO-3 gathers
    its shards once (every process enters together)."""
    if zero_stage(accelerator) != 3:
        return nullcontext(bare(model))
    return zero3().gathered_for_generation(model)


def gathered(model: nn.Module) -> bool:
    """Whether `model`'s ZeRO-3 shards are gathered for sampling now (no checkpoint of it can be written):
    utils/zero3.py counts the entries in `model.gathered_for_generation`."""
    return bool(getattr(model, "gathered_for_generation", 0))


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(the model's parameters, those this process holds): equal unless ZeRO-3 shards them."""
    total = held = 0
    for param in model.parameters():
        full = getattr(param, "ds_numel", None)
        total += full if full is not None else param.numel()
        held += param.ds_tensor.numel() if full is not None else param.numel()
    return total, held


def describe_sharding(model: nn.Module, accelerator) -> str:
    """One log line: the parameters this process holds."""
    total, held = parameter_counts(model)
    return f"process {accelerator.process_index}: holds {held} of the model's {total} parameters"


def clip_grad_norm(accelerator, model: nn.Module, max_norm: float | None) -> float | None:
    """Clip gradients to `max_norm` (if set) and return the norm before clipping; None under DeepSpeed
    (it clips itself: see `grad_norm_after_step`)."""
    if accelerator.state.deepspeed_plugin is not None or not accelerator.sync_gradients:
        return None
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
    return float(norm)


def grad_norm_after_step(model: nn.Module, measured: float | None) -> float | None:
    """The last step's gradient norm: `clip_grad_norm`'s, or DeepSpeed's own."""
    if measured is not None:
        return measured
    get_norm = getattr(model, "get_global_grad_norm", None)
    norm = get_norm() if get_norm is not None else None
    return None if norm is None else float(norm)


__all__ = [
    "NonFiniteError",
    "UsageError",
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
