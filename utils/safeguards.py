"""The finer guards of a run, on top of utils/checkpoint.py:

- a stop signal between micro-batches or generation calls saves the last finished step and stops there, while
  the current step has not changed the weights (not after it: `boundary`);
- `--resume_from_checkpoint latest` skips a damaged checkpoint (a file cut short or of another size than was
  written), and a folder of only damaged ones is set aside so a requeue loop starts over;
- a resume whose flags change what the run computes is refused, naming them;
- an --output_dir this user cannot write is refused before anything loads.

Optional: utils.checkpoint.Checkpointer uses it when the file is there (`utils.checkpoint.safeguards()`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import zipfile

from torch.optim.optimizer import register_optimizer_step_post_hook

from utils.checkpoint import STATE_FILE, leftovers, list_checkpoints, move_aside, set_rng_state
from utils.run import UsageError, gathered

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
    a path: that checkpoint, or a UsageError when it is not one or is damaged."""
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
        raise UsageError(
            f"--resume_from_checkpoint {resume_from} is not a checkpoint (no {STATE_FILE}); pass a "
            "checkpoint-N folder or `latest`."
        )
    problem = checkpoint_problem(resume_from)
    if problem is not None:
        raise UsageError(
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


def check_writable(output_dir: str) -> None:
    """UsageError, before training, for an --output_dir this user cannot write (probes the nearest folder)."""
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
        raise UsageError(
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


# ----------------------------------------------------------------------------------------------------------------
# A stop between micro-batches
# ----------------------------------------------------------------------------------------------------------------
_STEPPED = [False]  # set by every real optimizer step (accelerate skips the inner step while it accumulates)
_HOOKED: list[bool] = []


def _note_optimizer_step(optimizer, args, kwargs) -> None:
    _STEPPED[0] = True


def watch_optimizer_steps() -> None:
    """Count optimizer steps from now on (once per process)."""
    if not _HOOKED:
        register_optimizer_step_post_hook(_note_optimizer_step)
        _HOOKED.append(True)


def steps_since_finished(reset: bool = False) -> bool:
    """Whether an optimizer step ran since the last finished step (`reset`: a step just finished)."""
    if reset:
        _STEPPED[0] = False
    return _STEPPED[0]


def boundary(checkpointer) -> None:
    """On a signal, while this step has not changed the weights yet, save the last finished step (with the
    random state it left), drop this one and stop. Later in a step, or in a fresh run's first, the step
    finishes and maybe_save stops."""
    last = checkpointer.finished
    if last is None or steps_since_finished() or any(map(gathered, last.get("models", {}).values())):
        return
    if not checkpointer.stop.requested():
        return
    path = last["path"]
    if path is None:  # its end did not save it: as that save would have, with the random state it left
        set_rng_state(last["rng"], last["generators"] or {})
        path = checkpointer.save(
            last["step"], last["models"], last["optimizers"], last["generators"], last["state"]
        )
    raise checkpointer.stop.interrupt(path, last["step"], dropped=True)
