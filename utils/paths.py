"""A path or hub id checked before it loads, each problem in one sentence: the first missing part of a path and
the names beside it, what a folder holds instead of a model or dataset, a hub id the hub has not, the line of a
JSON file that does not parse. The core imports it when the file is there (extra_module); a copy without it
loads what it is given, and a path that cannot load fails in a plainer sentence.
"""

from __future__ import annotations

import os

from utils.data import DATA_ENDINGS, hub_offline, is_local
from utils.run import UsageError


def missing_path(name_or_path: str, flag: str) -> UsageError:
    """The error for a local path that does not exist: its first missing part, and the closest names beside it."""
    import difflib

    path = os.path.normpath(os.path.expanduser(name_or_path))
    parent, missing = os.path.dirname(path), os.path.basename(path)
    while parent and not os.path.isdir(parent):
        parent, missing = os.path.dirname(parent), os.path.basename(parent)
    names = sorted(os.listdir(parent or "."))
    close = difflib.get_close_matches(missing, names, n=3, cutoff=0.6)
    where = f"{parent}/" if parent else "this folder"
    hint = f"; did you mean {' or '.join(close)}?" if close else "."
    return UsageError(f"{flag} {name_or_path} does not exist: {where} has no {missing}{hint}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def folder_holds(path: str) -> str:
    """What a local folder holds, as a phrase for an error: nothing, a model, a tokenizer, a dataset, checkpoints."""
    names = set(os.listdir(path))
    if not names:
        return "is an empty folder"
    if "trainer_state.json" in names:
        return "is a training checkpoint (for --resume_from_checkpoint)"
    if "config.json" in names or "adapter_config.json" in names:
        return "holds a model"
    if names & set(TOKENIZER_FILES):
        return "holds only a tokenizer"
    if names & {"dataset_dict.json", "dataset_info.json"} or any(n.endswith(DATA_ENDINGS[:4]) for n in names):
        return "holds a dataset"
    if any(n.startswith("checkpoint-") for n in names):
        return "holds only checkpoints of a run (for --resume_from_checkpoint latest)"
    shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    return f"holds no model, tokenizer or dataset ({shown})"


_HUB_CHECKED: dict[tuple[str, str], str | None] = {}  # (kind, name) -> why it cannot load, or None


def check_hub_id(name: str, flag: str, kind: str, instead: str) -> None:
    """For a `name` that is not here and reads as a hub id (`org/name`): online, one request to the hub (no
    retries) and a UsageError at once when the hub cannot be reached or has no such `kind` (model or dataset)
    and the hub cache has no copy; offline, nothing (the load reads the cache, and fails at once)."""
    if hub_offline():
        return
    if (kind, name) not in _HUB_CHECKED:
        _HUB_CHECKED[kind, name] = _hub_problem(name, kind)
    problem = _HUB_CHECKED[kind, name]
    if problem:
        raise UsageError(f"{flag} {name} is not a local folder and {problem}; {instead}.")


def _hub_problem(name: str, kind: str) -> str | None:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    info = HfApi().model_info if kind == "model" else HfApi().dataset_info
    try:
        info(name, timeout=10)
    except (HFValidationError, RepositoryNotFoundError) as error:
        if isinstance(error, HFValidationError):
            return "not a valid hub id"
        return f"no {kind} of that name is on the hub (or it is private: log in with `hf auth login`)"
    except HfHubHTTPError:  # gated, a server error: the load itself says why
        return None
    except Exception as error:  # noqa: BLE001 - any network failure: say it once instead of retrying
        cached = os.path.join(constants.HF_HUB_CACHE, f"{kind}s--{name.replace('/', '--')}")
        if os.path.isdir(cached):  # the load falls back to the cached copy
            return None
        reason = " ".join(str(error).split())[:120] or type(error).__name__
        return f"not reachable on the hub ({reason})"
    return None


def bad_json_line(path: str) -> tuple[int, str] | None:
    """(line number, JSON error) of the first line that does not parse, or None."""
    import json

    with open(path, errors="replace") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except ValueError as error:
            return getattr(error, "lineno", 1), getattr(error, "msg", str(error))
        return None
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                json.loads(line)
            except ValueError as error:
                return number, getattr(error, "msg", str(error))
    return None


def check_source(cls, name_or_path: str, flag: str) -> None:
    """UsageError, before anything loads, for a path that does not exist, a folder without what `cls` reads
    (a model needs config.json, a tokenizer its files) or a hub id the hub cannot give (one request, no retries)."""
    check_path(name_or_path, flag, "tokenizer" if "Tokenizer" in cls.__name__ else "model")


def check_path(name_or_path: str, flag: str, kind: str) -> None:
    """check_source for a `kind`: "model" (config.json), "tokenizer" (its files, or a config.json that names
    them) or "either" (a flag that may name a tokenizer alone)."""
    if os.path.isfile(name_or_path):
        raise UsageError(f"{flag} {name_or_path} is a file; pass the folder saved with save_pretrained.")
    if os.path.isdir(name_or_path):
        names = set(os.listdir(name_or_path))
        model, tokenizer = names & {"config.json", "adapter_config.json"}, names & set(TOKENIZER_FILES)
        found = {
            "model": model,
            "tokenizer": tokenizer or "config.json" in names,
            "either": model or tokenizer,
        }
        if not found[kind]:
            needed = "tokenizer.json" if kind == "tokenizer" else "config.json"
            raise UsageError(
                f"{flag} {name_or_path} {folder_holds(name_or_path)}: no {kind.replace('either', 'model')} saved "
                f"with save_pretrained there (no {needed}){saved_models_near(name_or_path)}."
            )
    elif is_local(name_or_path):
        raise missing_path(name_or_path, flag)
    else:
        check_hub_id(
            name_or_path, flag, "model", "without network pass a local directory saved with save_pretrained"
        )


def check_model_paths(args) -> None:
    """Before anything loads, each model flag of `args` (MODEL_PATH_FLAGS) through check_path: a model for all
    but --model_name_or_path, which in ppo.py and rloo.py may name the tokenizer alone."""
    for name in MODEL_PATH_FLAGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            check_path(value, f"--{name}", "either" if name == "model_name_or_path" else "model")


MODEL_PATH_FLAGS = ("model_name_or_path", "sft_model_path", "reward_model_path", "value_model_path")


def saved_models_near(path: str) -> str:
    """`; models next to it: a, b` naming up to three sibling folders that hold a model, or ''."""
    parent = os.path.dirname(os.path.normpath(path)) or "."
    found = [n for n in sorted(os.listdir(parent)) if os.path.isfile(os.path.join(parent, n, "config.json"))]
    return f"; models next to it: {', '.join(os.path.join(parent, n) for n in found[:3])}" if found else ""
