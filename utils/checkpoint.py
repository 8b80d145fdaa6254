"""Checkpoints that survive preemption: periodic, atomic, exact to resume, no pickle (but DeepSpeed's own).

`checkpoint-{step}/` holds `{name}.safetensors` (DeepSpeed: its folder `{name}/`), `{name}_optimizer.pt`,
`rng-{rank}.json` and `trainer_state.json` (step, run name, defining flags, file sizes, the script's `state`).
Written to `tmp-checkpoint-{step}`, then renamed. SIGTERM/SIGINT save at the end of the step and stop. The finer
guards (a stop between micro-batches, damaged checkpoints, a resume with other flags) are utils/safeguards.py's.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import signal
import sys
import time

import numpy as np
import torch
import torch.nn as nn

import utils.signals
from utils.run import TrainingInterrupted, UsageError, bare, extra_module

STATE_FILE = "trainer_state.json"


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
        utils.signals.note(self.name)  # run_cli still stops a run that got it after its last check

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


def safeguards():
    """utils/safeguards.py when this copy has it (a stop between micro-batches, damaged checkpoints skipped, a
    resume with other flags refused, an unwritable --output_dir refused), else None: a copy without it stops
    at the end of the step, resumes the newest checkpoint and trusts the flags."""
    return extra_module("utils.safeguards")


def find_checkpoint(resume_from: str, output_dir: str) -> tuple[str | None, list[str]]:
    """(checkpoint folder or None, notes for the log): `latest`, the newest (None: from scratch); a path, that
    checkpoint, or a UsageError when it is not one. utils/safeguards.py's also skips a damaged one."""
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        return (found[-1], []) if found else (None, [f"--resume_from_checkpoint latest: no checkpoint in "
                                                     f"{output_dir}; starting from scratch"])  # fmt: skip
    if not os.path.isfile(os.path.join(resume_from, STATE_FILE)):
        raise UsageError(
            f"--resume_from_checkpoint {resume_from} is not a checkpoint (no {STATE_FILE}); pass a "
            "checkpoint-N folder or `latest`."
        )
    return resume_from, []


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
            raise UsageError("--save_steps must be >= 0 and --save_total_limit >= 1.")
        self.guards = guards = safeguards()
        self.definition = guards.run_definition(args) if guards else None
        self.resume_path, self.started = None, time.time()
        if guards:
            guards.check_writable(self.output_dir)
        loading = sys.modules.get("utils.loading")  # the scripts that load models with it (not ddpo.py)
        if loading is not None:  # a model path that cannot load fails now, not after the first model loads
            loading.check_model_paths(args)
        self.last_saved: str | None = None  # the checkpoint written or resumed from most recently
        self.resumed: dict = {}  # the trainer state resumed from ({} from scratch); the Tracker reads it
        self.moves_aside = False  # a fresh --overwrite_output_dir run: the old contents go at the first write
        resume_from = getattr(args, "resume_from_checkpoint", None)
        if resume_from:
            find = guards.find_checkpoint if guards else find_checkpoint
            self.resume_path, notes = find(resume_from, self.output_dir)
            for note in notes if accelerator.is_main_process else ():
                print(note, flush=True)
        if guards and resume_from == "latest" and self.resume_path is None:
            guards.set_aside_damaged(accelerator, self.output_dir)
        if self.resume_path:
            with open(os.path.join(self.resume_path, STATE_FILE)) as f:
                saved = json.load(f)
            if saved["world_size"] != accelerator.num_processes:
                raise UsageError(
                    f"{self.resume_path} was written by {saved['world_size']} processes; resume it with as many "
                    f"(this run has {accelerator.num_processes})."
                )
            mismatch = guards and guards.definition_mismatch(saved.get("run"), self.definition)
            if mismatch:
                raise UsageError(
                    f"--resume_from_checkpoint {self.resume_path} belongs to another run ({mismatch}); resume with "
                    "its flags, or start over with --overwrite_output_dir or another --output_dir."
                )
            args.run_name = saved["run_name"]
        else:
            overwrite = bool(getattr(args, "overwrite_output_dir", False))
            check_output_dir(args.output_dir, overwrite)
            held = set(os.listdir(args.output_dir)) if os.path.isdir(args.output_dir) else set()
            self.moves_aside = overwrite and bool(held - set(leftovers(args.output_dir)))
        self.stop = StopSignal(accelerator)
        self.finished: dict | None = None  # the last finished step: what boundary() saves of it
        if guards:
            guards.watch_optimizer_steps()

    # -- resume
    def resume(self, models: dict[str, nn.Module], optimizers: dict | None = None,
               generators: dict[str, torch.Generator] | None = None) -> dict | None:  # fmt: skip
        """Load the checkpoint into the prepared models and optimizers, restore every random state; the saved
        state (with `step`), or None when not resuming. Removes unfinished tmp-checkpoint-N folders."""
        self._clear_the_way()
        self.started = time.time()
        self._finished(None)
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
        except (OSError, RuntimeError, KeyError, ValueError) as error:  # another model's checkpoint
            reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise UsageError(
                f"--resume_from_checkpoint {path} could not be loaded into this run's models ({reason})."
            ) from None
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        self.last_saved, self.resumed = path, state
        self.started = time.time()
        self._finished({"step": state["step"], "path": path, "models": models})
        if self.accelerator.is_main_process:
            print(f"resumed from {path} (step {state['step']})", flush=True)
        return state

    def elapsed_seconds(self) -> float:
        """Seconds trained over every resume."""
        return float(self.resumed.get("elapsed_seconds", 0.0)) + time.time() - self.started

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
        if self.guards:  # what boundary() saves of this step, with the random state it left
            self._finished(dict(step=step, path=path, state=copy.deepcopy(state), rng=rng_state(generators or {}),
                                models=models, optimizers=optimizers, generators=generators))  # fmt: skip
        return path

    def _finished(self, record: dict | None) -> None:
        self.finished = record
        if self.guards:
            self.guards.steps_since_finished(reset=True)

    def boundary(self) -> None:
        """Between micro-batches and generation calls: with utils/safeguards.py, a signal stops the run here
        while this step has not changed the weights yet (utils.safeguards.boundary); without it, the step
        finishes and maybe_save stops. Every process calls it alike."""
        if self.guards:
            self.guards.boundary(self)

    def save(self, step: int, models: dict[str, nn.Module], optimizers: dict | None = None,
             generators: dict[str, torch.Generator] | None = None,
             state: dict | None = None) -> str:  # fmt: skip
        """Write checkpoint-{step} atomically on every process; keep the newest save_total_limit."""
        accelerator, optimizers, generators = self.accelerator, optimizers or {}, generators or {}
        self.start_over()
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
                    "run": self.definition, "metrics_lines": metrics_lines(self.args),
                    "files": self.guards.file_sizes(tmp) if self.guards else {},
                    "elapsed_seconds": self.elapsed_seconds()}  # fmt: skip
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump({**(state or {}), **meta}, f, indent=1)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if self.limit:
                for old in list_checkpoints(self.output_dir)[: -self.limit]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        self.last_saved = final
        return final

    def start_over(self) -> None:
        """At a fresh --overwrite_output_dir run's first write (a checkpoint or the final save): the old contents
        of --output_dir to `{output_dir}.replaced-{time}`. Every process must call it."""
        if not self.moves_aside:
            return
        if self.accelerator.is_main_process:
            print(move_aside(self.output_dir, "--overwrite_output_dir"), flush=True)
        self.moves_aside = False
        self.accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------------------------------------------
# The output folder: refused when full, moved aside on --overwrite_output_dir
# ----------------------------------------------------------------------------------------------------------------
def check_output_dir(output_dir: str, overwrite: bool = False) -> None:
    """UsageError for a non-empty `output_dir` without `overwrite`; unfinished checkpoints do not count."""
    held = [n for n in os.listdir(output_dir) if not re.fullmatch(r"tmp[-_]checkpoint[-_]\d+", n)] if (
        output_dir and os.path.isdir(output_dir)) else []  # fmt: skip
    if held and not overwrite:
        raise UsageError(
            f"--output_dir {output_dir} exists and is not empty; pass another one or --overwrite_output_dir."
        )
