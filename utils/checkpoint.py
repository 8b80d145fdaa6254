"""Checkpoints that survive preemption: periodic, atomic, exact to resume, no pickle (but DeepSpeed's own).

`checkpoint-{step}/` holds `{name}.safetensors` (DeepSpeed: its folder `{name}/`), `{name}_optimizer.pt`,
`rng-{rank}.json` and `trainer_state.json` (step, run name, defining flags, file sizes, the script's `state`).
Written to `tmp-checkpoint-{step}`, then renamed; `latest` skips a damaged one. SIGTERM/SIGINT save and stop.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import struct
import sys
import time
import zipfile

import numpy as np
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import utils.signals
from utils.run import TrainingInterrupted, bare, gathering

STATE_FILE = "trainer_state.json"
_LAST_SAVED: list[str] = []
_RESUMED: dict = {}  # the Tracker reads metrics_lines in it
_START_OVER: set[str] = set()  # moved aside at the run's first write there


def last_saved() -> str | None:
    """The checkpoint this process wrote or resumed from most recently (None if none)."""
    return _LAST_SAVED[-1] if _LAST_SAVED else None


def resumed_state() -> dict:
    """The trainer state of the checkpoint this process resumed from ({} when it started from scratch)."""
    return _RESUMED


def list_checkpoints(output_dir: str) -> list[str]:
    """Checkpoints renamed into place in `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.isfile(os.path.join(output_dir, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def leftovers(output_dir: str) -> list[str]:
    """Unfinished checkpoint writes (tmp-checkpoint-N), never resumed from."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir) if re.fullmatch(r"tmp[-_]checkpoint[-_]\d+", n))


# Flags that change where a run writes or what it logs, not what it computes.
NOT_DEFINING = frozenset(
    """output_dir overwrite_output_dir logging_dir run_name exp_name track wandb_project_name wandb_entity
    push_to_hub hub_model_id save_steps save_total_limit resume_from_checkpoint logging_steps eval_strategy
    eval_steps eval_on_start per_device_eval_batch_size num_generations_eval num_sample_generations
    generate_during_eval num_samples num_logged_images gradient_checkpointing world_size judge_api_key_env
    vllm_gpu_memory_utilization max_workers async_reward_computation allow_tf32""".split()
)


def run_definition(args) -> dict:
    """{flag: JSON-safe value} of the flags a resuming command must share with the checkpoint."""
    names = [f.name for f in dataclasses.fields(args)] if dataclasses.is_dataclass(args) else list(vars(args))
    definition = {}
    for name in names:
        if name in NOT_DEFINING:
            continue
        value = getattr(args, name, None)
        if isinstance(value, tuple | list):
            value = [v if isinstance(v, str | int | float | bool | type(None)) else str(v) for v in value]
        elif isinstance(value, str) and os.path.exists(value):
            value = os.path.abspath(value)
        elif not isinstance(value, str | int | float | bool | type(None)):
            value = str(value)
        definition[name] = value
    return definition


def definition_mismatch(saved: dict | None, current: dict) -> str | None:
    """The differing flags as a phrase, or None; flags the checkpoint did not record are not compared."""
    differing = [
        f"--{name} {saved[name]} there, {value} here"
        for name, value in current.items()
        if saved is not None and name in saved and saved[name] != value
    ]
    return "; ".join(differing) if differing else None


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is unreadable (cut short, bad header), or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "has no header"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return "is cut short"
        try:
            header = json.loads(f.read(length))
            ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "has an unreadable header"
    return "is cut short" if 8 + length + max(ends, default=0) > size else None


def checkpoint_problem(path: str) -> str | None:
    """Why `path` is not a complete checkpoint (a phrase: bad state, wrong size, cut-short file), or None."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return f"its {STATE_FILE} is missing or unreadable"
    for name, size in (state.get("files") or {}).items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {size} were written"
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            problem = None
            if name.endswith(".safetensors"):
                problem = _safetensors_problem(file)
            elif name.endswith(".pt") and not zipfile.is_zipfile(file):
                problem = "is cut short"
            if problem:
                return f"{os.path.relpath(file, path)} {problem}"
    return None


def find_checkpoint(resume_from: str, output_dir: str) -> tuple[str | None, list[str]]:
    """(checkpoint folder or None, notes for the log). `latest`: the newest complete one (None: from scratch);
    a path: that checkpoint, or a ValueError when it is not one or is damaged."""
    if resume_from == "latest":
        notes = []
        for path in reversed(list_checkpoints(output_dir)):
            problem = checkpoint_problem(path)
            if problem is None:
                return path, notes
            notes.append(f"skipped {path}: {problem}")
        left = leftovers(output_dir)
        if left:
            notes.append(f"ignored the unfinished {', '.join(left)}")
        notes.append(
            f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir}; starting from scratch"
        )
        return None, notes
    if not os.path.isfile(os.path.join(resume_from, STATE_FILE)):
        raise ValueError(
            f"--resume_from_checkpoint {resume_from} is not a checkpoint (no {STATE_FILE}); pass a "
            "checkpoint-N folder or `latest`."
        )
    problem = checkpoint_problem(resume_from)
    if problem is not None:
        raise ValueError(
            f"--resume_from_checkpoint {resume_from} is damaged: {problem}; pass an earlier checkpoint-N or `latest`."
        )
    return resume_from, []


def file_sizes(path: str) -> dict[str, int]:
    """{relative path: size} of every file under `path`, but trainer_state.json."""
    sizes = {}
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            relative = os.path.relpath(file, path)
            if relative != STATE_FILE:
                sizes[relative] = os.path.getsize(file)
    return sizes


def move_aside(path: str, what: str, suffix: str = "replaced") -> str | None:
    """Move what `path` holds into `{path}.{suffix}-{time}`; a line saying so, or None when it was empty."""
    if not os.path.isdir(path) or not os.listdir(path):
        return None
    names = sorted(os.listdir(path))
    base = os.path.normpath(path) + time.strftime(f".{suffix}-%Y%m%d-%H%M%S")
    aside, n = base, 1
    while os.path.exists(aside):
        aside, n = f"{base}-{n}", n + 1
    os.makedirs(aside)
    for name in names:
        os.replace(os.path.join(path, name), os.path.join(aside, name))
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{what}: moved the previous contents of {path} ({shown}) to {aside}"


def metrics_lines(args) -> int | None:
    """Lines in the run's metrics.jsonl (None without one)."""
    path = os.path.join(getattr(args, "logging_dir", "") or "", str(args.run_name), "metrics.jsonl")
    if not getattr(args, "logging_dir", None) or not os.path.isfile(path):
        return None
    with open(path) as f:
        return sum(1 for line in f if line.strip())


# ----------------------------------------------------------------------------------------------------------------
# Random states as JSON (no pickle)
# ----------------------------------------------------------------------------------------------------------------
def rng_state(generators: dict[str, torch.Generator]) -> dict:
    """Every random state of this process as JSON-safe lists."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "generators": {name: g.get_state().tolist() for name, g in generators.items()},
    }


def set_rng_state(state: dict, generators: dict[str, torch.Generator]) -> None:
    """Restore what `rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    for name, generator in generators.items():
        generator.set_state(torch.tensor(state["generators"][name], dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------------------------
# Stop signals
# ----------------------------------------------------------------------------------------------------------------
class StopSignal:
    """Catches SIGTERM and SIGINT so the run saves before it stops."""

    def __init__(self, accelerator):
        self.accelerator, self.name, self.group = accelerator, None, None
        try:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        except ValueError:  # not the main thread: no handlers
            pass
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # asking costs no GPU sync between micro-batches

    def _on_signal(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name
        utils.signals.RECEIVED.append(self.name)  # run_cli still stops a run that got it after its last check

    def requested(self) -> bool:
        """True on every process when any got a signal: they must save together."""
        flag = torch.tensor([float(self.name is not None)])
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(flag, group=self.group)
        return flag.item() > 0

    def interrupt(self, path: str, step: int, dropped: bool = False) -> TrainingInterrupted:
        """The exception that ends the run after saving `path` (`dropped`: step + 1 was cut short)."""
        cut = f" (step {step + 1} was cut short and runs again)" if dropped else ""
        return TrainingInterrupted(
            f"{self.name or 'a signal'} received; saved {path} at step {step}{cut}; continue with "
            f"--resume_from_checkpoint {path}",
            self.name or "SIGTERM",
        )


# Set by every real optimizer step (accelerate skips the inner step while it accumulates).
_STEPPED, _HOOKED = [False], []


def _note_optimizer_step(optimizer, args, kwargs) -> None:
    _STEPPED[0] = True


# ----------------------------------------------------------------------------------------------------------------
# The checkpointer
# ----------------------------------------------------------------------------------------------------------------
class Checkpointer:
    """Saves, restores checkpoints (args: output_dir, save_steps, save_total_limit, resume_from_checkpoint).

    Built before any model loads: it refuses a checkpoint of another run or world size and takes its run name;
    a fresh run needs an empty --output_dir or --overwrite_output_dir."""

    def __init__(self, accelerator, args):
        self.accelerator, self.args = accelerator, args
        self.output_dir = args.output_dir
        self.save_steps = getattr(args, "save_steps", None) or 0
        self.limit = getattr(args, "save_total_limit", None)
        if self.save_steps < 0 or (self.limit is not None and self.limit < 1):
            raise ValueError("--save_steps must be >= 0 and --save_total_limit >= 1.")
        self.definition = run_definition(args)
        self.resume_path, self.started = None, time.time()
        check_writable(self.output_dir)
        loading = sys.modules.get("utils.loading")  # the scripts that load models with it (not ddpo.py)
        if loading is not None:  # a model path that cannot load fails now, not after the first model loads
            loading.check_model_paths(args)
        _START_OVER.discard(os.path.normpath(self.output_dir))
        resume_from = getattr(args, "resume_from_checkpoint", None)
        if resume_from:
            self.resume_path, notes = find_checkpoint(resume_from, args.output_dir)
            for note in notes if accelerator.is_main_process else ():
                print(note, flush=True)
        if resume_from == "latest" and self.resume_path is None:
            set_aside_damaged(accelerator, self.output_dir)
        if self.resume_path:
            with open(os.path.join(self.resume_path, STATE_FILE)) as f:
                saved = json.load(f)
            if saved["world_size"] != accelerator.num_processes:
                raise ValueError(
                    f"{self.resume_path} was written by {saved['world_size']} processes; resume it with as many "
                    f"(this run has {accelerator.num_processes})."
                )
            mismatch = definition_mismatch(saved.get("run"), self.definition)
            if mismatch:
                raise ValueError(
                    f"--resume_from_checkpoint {self.resume_path} belongs to another run ({mismatch}); resume with "
                    "its flags, or start over with --overwrite_output_dir or another --output_dir."
                )
            args.run_name = saved["run_name"]
        else:
            overwrite = bool(getattr(args, "overwrite_output_dir", False))
            check_output_dir(args.output_dir, overwrite)
            held = set(os.listdir(args.output_dir)) if os.path.isdir(args.output_dir) else set()
            if overwrite and held - set(leftovers(args.output_dir)):
                _START_OVER.add(os.path.normpath(args.output_dir))
        self.stop = StopSignal(accelerator)
        self.finished: dict | None = None  # the last finished step: what boundary() saves of it
        if not _HOOKED:
            register_optimizer_step_post_hook(_note_optimizer_step)
            _HOOKED.append(True)

    # -- resume
    def resume(self, models: dict[str, nn.Module], optimizers: dict | None = None,
               generators: dict[str, torch.Generator] | None = None) -> dict | None:  # fmt: skip
        """Load the checkpoint into the prepared models and optimizers, restore every random state; the saved
        state (with `step`), or None when not resuming. Removes unfinished tmp-checkpoint-N folders."""
        self._clear_the_way()
        self.started = time.time()
        _STEPPED[0] = False
        if self.resume_path is None:
            return None
        path, optimizers, generators = self.resume_path, optimizers or {}, generators or {}
        try:
            for name, model in models.items():
                if self.accelerator.state.deepspeed_plugin is not None:
                    model.load_checkpoint(os.path.join(path, name), tag="state")
                    continue
                from safetensors.torch import load_model

                device = self.accelerator.device  # safetensors does not take "cpu:0"
                load_model(
                    bare(model),
                    os.path.join(path, f"{name}.safetensors"),
                    device=str(device) if device.type != "cpu" else "cpu",
                )
            if self.accelerator.state.deepspeed_plugin is None:  # else in DeepSpeed's checkpoint
                for name, optimizer in optimizers.items():
                    state = torch.load(
                        os.path.join(path, f"{name}_optimizer.pt"), map_location="cpu", weights_only=True
                    )
                    optimizer.load_state_dict(state)
            with open(os.path.join(path, f"rng-{self.accelerator.process_index}.json")) as f:
                set_rng_state(json.load(f), generators)
        except (
            OSError,
            RuntimeError,
            KeyError,
            ValueError,
        ) as error:  # another model
            reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise ValueError(
                f"--resume_from_checkpoint {path} could not be loaded into this run's models ({reason})."
            ) from None
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        _LAST_SAVED.append(path)
        _RESUMED.clear()
        _RESUMED.update(state)
        self.started = time.time()
        self.finished = {"step": state["step"], "path": path}
        if self.accelerator.is_main_process:
            print(f"resumed from {path} (step {state['step']})", flush=True)
        return state

    def elapsed_seconds(self) -> float:
        """Seconds trained over every resume."""
        return float(_RESUMED.get("elapsed_seconds", 0.0)) + time.time() - self.started

    def _clear_the_way(self) -> None:
        """Remove unfinished checkpoint writes (main process; all wait)."""
        if self.accelerator.is_main_process:
            for name in leftovers(self.output_dir):
                shutil.rmtree(os.path.join(self.output_dir, name), ignore_errors=True)
        self.accelerator.wait_for_everyone()

    # -- save
    def maybe_save(self, step: int, models: dict[str, nn.Module], optimizers: dict | None = None,
                   generators: dict[str, torch.Generator] | None = None,
                   state: dict | None = None) -> str | None:  # fmt: skip
        """At the end of every step: save every `save_steps` steps and on a signal (then raise
        TrainingInterrupted). Every process must call it at the same steps."""
        stop = self.stop.requested()
        path = None
        if stop or (self.save_steps and step % self.save_steps == 0):
            path = self.save(step, models, optimizers, generators, state)
        if stop:
            raise self.stop.interrupt(path, step)
        rng = rng_state(generators or {})  # what boundary() restores before saving this step
        self.finished = dict(step=step, path=path, state=copy.deepcopy(state), rng=rng, models=models,
                             optimizers=optimizers, generators=generators)  # fmt: skip
        _STEPPED[0] = False
        return path

    def boundary(self) -> None:
        """Between micro-batches and generation calls: on a signal, while this step has not changed the weights
        yet, save the last finished step (with the random state it left), drop this one and stop. Later in a
        step, or in a fresh run's first, the step finishes and maybe_save stops. Every process calls it alike."""
        if self.finished is None or _STEPPED[0] or gathering() or not self.stop.requested():
            return
        last = self.finished
        path = last["path"]
        if path is None:  # its end did not save it: as that save would have, with the random state it left
            set_rng_state(last["rng"], last["generators"] or {})
            path = self.save(
                last["step"], last["models"], last["optimizers"], last["generators"], last["state"]
            )
        raise self.stop.interrupt(path, last["step"], dropped=True)

    def save(self, step: int, models: dict[str, nn.Module], optimizers: dict | None = None,
             generators: dict[str, torch.Generator] | None = None,
             state: dict | None = None) -> str:  # fmt: skip
        """Write checkpoint-{step} atomically on every process; keep the newest save_total_limit."""
        accelerator, optimizers, generators = self.accelerator, optimizers or {}, generators or {}
        start_over(accelerator, self.output_dir)
        final = os.path.join(self.output_dir, f"checkpoint-{step}")
        tmp = os.path.join(self.output_dir, f"tmp-checkpoint-{step}")
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        accelerator.wait_for_everyone()
        for name, model in models.items():
            if accelerator.state.deepspeed_plugin is not None:  # sharded, with the optimizer
                model.save_checkpoint(os.path.join(tmp, name), tag="state")
                continue
            if accelerator.is_main_process:  # same weights on every process
                from safetensors.torch import save_model

                save_model(bare(model), os.path.join(tmp, f"{name}.safetensors"))
        if accelerator.state.deepspeed_plugin is None and accelerator.is_main_process:
            for name, optimizer in optimizers.items():
                torch.save(optimizer.state_dict(), os.path.join(tmp, f"{name}_optimizer.pt"))
        with open(os.path.join(tmp, f"rng-{accelerator.process_index}.json"), "w") as f:
            json.dump(rng_state(generators), f)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            meta = {"step": step, "run_name": self.args.run_name, "world_size": accelerator.num_processes,
                    "run": self.definition, "metrics_lines": metrics_lines(self.args), "files": file_sizes(tmp),
                    "elapsed_seconds": self.elapsed_seconds()}  # fmt: skip
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump({**(state or {}), **meta}, f, indent=1)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if self.limit:
                for old in list_checkpoints(self.output_dir)[: -self.limit]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        _LAST_SAVED.append(final)
        return final


# ----------------------------------------------------------------------------------------------------------------
# The output folder: refused when full, moved aside on --overwrite_output_dir
# ----------------------------------------------------------------------------------------------------------------
def check_output_dir(output_dir: str, overwrite: bool = False) -> None:
    """ValueError for a non-empty `output_dir` without `overwrite`; unfinished checkpoints do not count."""
    held = [n for n in os.listdir(output_dir) if not re.fullmatch(r"tmp[-_]checkpoint[-_]\d+", n)] if (
        output_dir and os.path.isdir(output_dir)) else []  # fmt: skip
    if held and not overwrite:
        raise ValueError(
            f"--output_dir {output_dir} exists and is not empty; pass another one or --overwrite_output_dir."
        )


def check_writable(output_dir: str) -> None:
    """ValueError, before training, for an --output_dir this user cannot write (probes the nearest folder)."""
    import tempfile

    where = os.path.abspath(output_dir)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    reason = None if os.path.isdir(where) else f"{where} is a file"
    if reason is None:
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=where)
            os.close(fd)
            os.remove(probe)
        except OSError as error:
            reason = f"{where}: {error.strerror or error}"
    if reason is not None:
        raise ValueError(
            f"--output_dir {output_dir} cannot be written ({reason}); pass a folder this user can write to."
        )


def set_aside_damaged(accelerator, output_dir: str) -> None:
    """`latest` found nothing usable: a folder of only damaged checkpoints goes to
    `{output_dir}.damaged-{time}` so a requeue loop restarts there. Every process must call it."""
    accelerator.wait_for_everyone()  # all have looked before anything moves
    names = set(os.listdir(output_dir)) if os.path.isdir(output_dir) else set()
    damaged = {name for name in names if re.fullmatch(r"checkpoint-\d+", name)}
    if damaged and names <= damaged | set(leftovers(output_dir)) and accelerator.is_main_process:
        line = move_aside(output_dir, "--resume_from_checkpoint latest found no usable checkpoint", "damaged")
        print(line, flush=True)
    accelerator.wait_for_everyone()


def start_over(accelerator, output_dir: str) -> None:
    """At a fresh --overwrite_output_dir run's first write: old contents to `{output_dir}.replaced-{time}`.
    Every process must call it."""
    if os.path.normpath(output_dir) not in _START_OVER:
        return
    if accelerator.is_main_process:
        print(move_aside(output_dir, "--overwrite_output_dir"), flush=True)
    _START_OVER.discard(os.path.normpath(output_dir))
    accelerator.wait_for_everyone()
