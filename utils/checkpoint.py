"""Checkpoints that let a long run survive preemption: periodic, atomic, exact to resume, safe to load.

`{output_dir}/checkpoint-{step}/` holds
- `{name}.safetensors`: each trained model's weights (under DeepSpeed: DeepSpeed's own checkpoint folder
  `{name}/`, which also holds the sharded optimizer state);
- `{name}_optimizer.pt`: each optimizer's state (tensors, numbers and lists only: loaded with
  `weights_only=True`);
- `rng-{rank}.json`: every random state of each process (python, numpy, torch, the script's generators);
- `trainer_state.json`: the step, the run name, the number of processes, and whatever the script passes as
  `state` (counters, the data-order position, the adaptive KL controller, running moments...).

A checkpoint is written to `tmp-checkpoint-{step}` and renamed when complete, so a kill in the middle of a
write never leaves a folder that `--resume_from_checkpoint latest` would pick. SIGTERM and SIGINT are caught:
the script finishes its current step, saves, and stops with a line naming the checkpoint.

Nothing here unpickles Python objects, except DeepSpeed's own checkpoint format under DeepSpeed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal

import numpy as np
import torch
import torch.nn as nn

from utils.run import TrainingInterrupted, bare

STATE_FILE = "trainer_state.json"
_LAST_SAVED: list[str] = []


def last_saved() -> str | None:
    """The checkpoint this process wrote or resumed from most recently (None if none)."""
    return _LAST_SAVED[-1] if _LAST_SAVED else None


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints in `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.isfile(os.path.join(output_dir, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def find_checkpoint(resume_from: str, output_dir: str) -> str:
    """The checkpoint folder `--resume_from_checkpoint` names: a path, or `latest` (the newest complete one in
    `output_dir`). One-sentence ValueError when there is none."""
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise ValueError(f"--resume_from_checkpoint latest: {output_dir} holds no complete checkpoint-N.")
        return found[-1]
    if not os.path.isfile(os.path.join(resume_from, STATE_FILE)):
        raise ValueError(
            f"--resume_from_checkpoint {resume_from} is not a checkpoint (no {STATE_FILE}); pass a "
            "checkpoint-N folder or `latest`."
        )
    return resume_from


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
    """Catches SIGTERM and SIGINT (preemption, Ctrl-C) so the run can finish its step and save first."""

    def __init__(self, accelerator):
        self.accelerator, self.name = accelerator, None
        try:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        except ValueError:  # not the main thread (e.g. a notebook runner): no handlers
            pass

    def _on_signal(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    def requested(self) -> bool:
        """True on every process when any process received a signal (they must save together)."""
        flag = torch.tensor([float(self.name is not None)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        return flag.item() > 0

    def interrupt(self, path: str, step: int) -> TrainingInterrupted:
        """The exception that ends the run after the checkpoint `path` was written."""
        return TrainingInterrupted(
            f"{self.name or 'a signal'} received; saved {path} at step {step}; continue with "
            f"--resume_from_checkpoint {path}",
            self.name or "SIGTERM",
        )


# ----------------------------------------------------------------------------------------------------------------
# The checkpointer
# ----------------------------------------------------------------------------------------------------------------
class Checkpointer:
    """Saves and restores a run's checkpoints; reads `args.output_dir`, `args.save_steps` (0 or None: only on
    a signal), `args.save_total_limit` (None: keep all) and `args.resume_from_checkpoint` (a path or `latest`).

    Building it checks the resume path (before any model is loaded), takes the run name of the checkpoint so
    logs continue in the same folder, and installs the SIGTERM/SIGINT handlers."""

    def __init__(self, accelerator, args):
        self.accelerator, self.args = accelerator, args
        self.output_dir = args.output_dir
        self.save_steps = getattr(args, "save_steps", None) or 0
        self.limit = getattr(args, "save_total_limit", None)
        if self.save_steps < 0 or (self.limit is not None and self.limit < 1):
            raise ValueError("--save_steps must be >= 0 and --save_total_limit >= 1.")
        self.resume_path = None
        resume_from = getattr(args, "resume_from_checkpoint", None)
        if resume_from:
            self.resume_path = find_checkpoint(resume_from, args.output_dir)
            with open(os.path.join(self.resume_path, STATE_FILE)) as f:
                saved = json.load(f)
            if saved["world_size"] != accelerator.num_processes:
                raise ValueError(
                    f"{self.resume_path} was written by {saved['world_size']} processes; resume it with as many "
                    f"(this run has {accelerator.num_processes})."
                )
            args.run_name = saved["run_name"]
        self.stop = StopSignal(accelerator)

    # -- resume
    def resume(self, models: dict[str, nn.Module], optimizers: dict | None = None,
               generators: dict[str, torch.Generator] | None = None) -> dict | None:  # fmt: skip
        """Load the checkpoint given by --resume_from_checkpoint into the (prepared) models and optimizers and
        restore every random state; returns the saved state (with its `step`), or None when not resuming."""
        if self.resume_path is None:
            return None
        path, optimizers, generators = self.resume_path, optimizers or {}, generators or {}
        for name, model in models.items():
            if self.accelerator.state.deepspeed_plugin is not None:
                model.load_checkpoint(os.path.join(path, name), tag="state")
                continue
            from safetensors.torch import load_model

            device = self.accelerator.device  # "cpu:0" (MULTI_CPU) is not a device name safetensors takes
            load_model(
                bare(model),
                os.path.join(path, f"{name}.safetensors"),
                device=str(device) if device.type != "cpu" else "cpu",
            )
        if self.accelerator.state.deepspeed_plugin is None:  # DeepSpeed's checkpoint held the optimizers
            for name, optimizer in optimizers.items():
                state = torch.load(
                    os.path.join(path, f"{name}_optimizer.pt"), map_location="cpu", weights_only=True
                )
                optimizer.load_state_dict(state)
        with open(os.path.join(path, f"rng-{self.accelerator.process_index}.json")) as f:
            set_rng_state(json.load(f), generators)
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        _LAST_SAVED.append(path)
        return state

    # -- save
    def maybe_save(self, step: int, models: dict[str, nn.Module], optimizers: dict | None = None,
                   generators: dict[str, torch.Generator] | None = None,
                   state: dict | None = None) -> str | None:  # fmt: skip
        """At every `save_steps`-th step, and whenever a stop signal arrived, save a checkpoint; after a signal,
        raise TrainingInterrupted naming it. Every process must call this at the same steps."""
        stop = self.stop.requested()
        path = None
        if stop or (self.save_steps and step % self.save_steps == 0):
            path = self.save(step, models, optimizers, generators, state)
        if stop:
            raise self.stop.interrupt(path, step)
        return path

    def save(self, step: int, models: dict[str, nn.Module], optimizers: dict | None = None,
             generators: dict[str, torch.Generator] | None = None,
             state: dict | None = None) -> str:  # fmt: skip
        """Write checkpoint-{step} atomically (every process takes part) and keep the newest save_total_limit."""
        accelerator, optimizers, generators = self.accelerator, optimizers or {}, generators or {}
        final = os.path.join(self.output_dir, f"checkpoint-{step}")
        tmp = os.path.join(self.output_dir, f"tmp-checkpoint-{step}")
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        accelerator.wait_for_everyone()
        for name, model in models.items():
            if accelerator.state.deepspeed_plugin is not None:  # sharded weights and optimizer state
                model.save_checkpoint(os.path.join(tmp, name), tag="state")
                continue
            if accelerator.is_main_process:  # the processes hold the same weights
                from safetensors.torch import save_model

                save_model(bare(model), os.path.join(tmp, f"{name}.safetensors"))
        if accelerator.state.deepspeed_plugin is None and accelerator.is_main_process:
            for name, optimizer in optimizers.items():  # (under DeepSpeed they are in its checkpoint)
                torch.save(optimizer.state_dict(), os.path.join(tmp, f"{name}_optimizer.pt"))
        with open(os.path.join(tmp, f"rng-{accelerator.process_index}.json"), "w") as f:
            json.dump(rng_state(generators), f)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            meta = {"step": step, "run_name": self.args.run_name, "world_size": accelerator.num_processes}
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
# The final model
# ----------------------------------------------------------------------------------------------------------------
def push_to_hub(args) -> None:
    """Upload --output_dir (without its resumable checkpoints) to the hub repository --hub_model_id, by default
    named like the output folder; the repository is created if needed."""
    from huggingface_hub import HfApi

    api = HfApi()
    name = getattr(args, "hub_model_id", None) or os.path.basename(os.path.abspath(args.output_dir))
    repo_id = api.create_repo(name, exist_ok=True).repo_id
    api.upload_folder(
        repo_id=repo_id, folder_path=args.output_dir, ignore_patterns=["checkpoint-*", "tmp-checkpoint-*"]
    )


def save_model(accelerator, model: nn.Module, tokenizer, args, algorithm: str, base_model: str, metrics: dict,
               submodule: str | None = None) -> None:  # fmt: skip
    """Save the trained `model` to --output_dir as a plain transformers checkpoint with its tokenizer and a model
    card, then push it with --push_to_hub. Every process must call it: under ZeRO-3 the state dict gathers the
    shards. `submodule`: save only that attribute of the model (the policy of a policy-and-value model)."""
    import utils

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    module = accelerator.unwrap_model(model)
    if submodule is not None:
        module, prefix = getattr(module, submodule), submodule + "."
        if state_dict is not None:
            state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    os.makedirs(args.output_dir, exist_ok=True)
    module.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
        state_dict=state_dict,
    )  # fmt: skip
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        utils.write_model_card(args.output_dir, algorithm, base_model, args.dataset_name, metrics)
        if args.push_to_hub:
            push_to_hub(args)
