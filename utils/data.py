"""TRL's standard and conversational datasets: loading, type and format, RL's prompts and their batch order
(the offline scripts' examples are utils/examples.py's).

A dataset's type comes from its columns, its format from its values (TRL's names):

    type                 standard (strings)                      conversational (lists of {role, content})
    language modeling    text (--dataset_text_field)             messages
    prompt-only          prompt                                  prompt
    prompt-completion    prompt, completion                      prompt, completion
    preference           prompt, chosen, rejected                prompt, chosen, rejected
      implicit prompt    chosen, rejected (sharing the prompt)   chosen, rejected (sharing the first turns)

Other columns are ignored; conversations are rendered with the chat template (utils/chat.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from utils.chat import render, require_chat_template
from utils.run import UsageError, extra_module

FORMATS = (
    "language modeling (text or messages), prompt-only (prompt), prompt-completion (prompt, completion), "
    "preference (prompt, chosen, rejected) or preference with an implicit prompt (chosen, rejected)"
)


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------
DATA_ENDINGS = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".safetensors", ".bin", ".pt")


def is_local(name_or_path: str) -> bool:
    """Whether `name_or_path` is a local path (which must exist) rather than a hub id: it exists, starts with
    . / or ~, has more than one /, a backslash or a file ending, or its first folder exists here."""
    first = name_or_path.split("/")[0]
    return (
        os.path.exists(name_or_path)
        or name_or_path.startswith((".", "/", "~"))
        or name_or_path.count("/") > 1
        or "\\" in name_or_path
        or name_or_path.lower().endswith(DATA_ENDINGS)
        or (first != name_or_path and os.path.isdir(first))
    )


def missing_path(name_or_path: str, flag: str) -> UsageError:
    """The error for a local path that does not exist; utils/paths.py's also names its first missing part."""
    paths = extra_module("utils.paths")
    return (
        paths.missing_path(name_or_path, flag)
        if paths
        else UsageError(f"{flag} {name_or_path} does not exist.")
    )


def hub_offline() -> bool:
    """Whether the hub is switched off (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE or HF_DATASETS_OFFLINE)."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in names)


def load_split(name_or_path: str, split: str, config: str | None = None, flag: str = "--dataset_name"):
    """A `datasets.Dataset` from a hub id, a `save_to_disk` folder, a folder of `{split}.jsonl` files or one
    json/jsonl/parquet/csv file (split 'train' only). `config` is a sub-folder for a local folder. Anything
    missing or empty is a UsageError (utils/paths.py, when there, says more exactly why)."""
    import datasets

    paths = extra_module("utils.paths")
    if config is not None and os.path.exists(name_or_path):
        if not os.path.isdir(name_or_path):
            raise UsageError(
                f"--dataset_config {config!r} needs a hub id or a folder of configurations, not a file."
            )
        found = sorted(d for d in os.listdir(name_or_path) if os.path.isdir(os.path.join(name_or_path, d)))
        if config not in found:
            raise UsageError(
                f"{flag} {name_or_path} has no configuration {config!r} (--dataset_config); found {found}."
            )
        name_or_path, config = os.path.join(name_or_path, config), None
    builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
    if os.path.isfile(name_or_path):
        ext = os.path.splitext(name_or_path)[1]
        if os.path.getsize(name_or_path) == 0:
            raise UsageError(f"{flag} {name_or_path} is empty.")
        if ext not in builders:
            raise UsageError(
                f"{flag} {name_or_path}: unknown file type {ext!r}; use json, jsonl, parquet or csv."
            )
        stem = os.path.splitext(os.path.basename(name_or_path))[0]
        if split not in ("train", stem):  # never evaluate on the training rows
            raise UsageError(
                f"{flag} {name_or_path} is one file, whose only split is 'train' (or {stem!r}), not {split!r}; "
                "turn evaluation off (--eval_strategy no or --dataset_test_split None) or pass a folder of "
                f"{{split}}.jsonl files."
            )
        if ext in (".json", ".jsonl", ".csv"):
            with open(name_or_path, errors="replace") as f:
                if not any(line.strip() for line in f):
                    raise UsageError(f"{flag} {name_or_path} holds only blank lines: no rows.")
        try:
            dataset = datasets.load_dataset(builders[ext], data_files=name_or_path, split="train")
        except datasets.exceptions.DatasetGenerationError:
            bad = paths.bad_json_line(name_or_path) if paths and ext in (".json", ".jsonl") else None
            if bad is None:
                raise
            raise UsageError(
                f"{flag} {name_or_path}: line {bad[0]} is not valid JSON ({bad[1]}); fix or remove that line."
            ) from None
    elif os.path.isdir(name_or_path):
        files = [os.path.join(name_or_path, split + ext) for ext in builders]
        if os.path.exists(os.path.join(name_or_path, "dataset_dict.json")):
            dataset_dict = _load_from_disk(name_or_path, flag)
            if split not in dataset_dict:
                raise UsageError(
                    f"{flag} {name_or_path} has no split {split!r}; its splits are {list(dataset_dict)}."
                )
            dataset = dataset_dict[split]
        elif os.path.exists(os.path.join(name_or_path, "dataset_info.json")):
            dataset = _load_from_disk(name_or_path, flag)
        elif any(os.path.isfile(path) for path in files):
            return load_split(next(path for path in files if os.path.isfile(path)), split, None, flag)
        else:
            holds = paths.folder_holds(name_or_path) if paths else "holds no dataset"
            if holds == "holds a dataset":
                found = sorted(n for n in os.listdir(name_or_path) if n.endswith(tuple(builders)))
                holds = f"has no {split}.jsonl (it holds {', '.join(found) or 'other files'})"
            raise UsageError(
                f"{flag} {name_or_path} {holds}; pass a dataset saved with save_to_disk or a folder of "
                "{split}.jsonl files."
            )
    elif is_local(name_or_path):
        raise missing_path(name_or_path, flag)
    else:
        instead = "without network pass a save_to_disk directory or json/jsonl/parquet files"
        if paths:  # one request to the hub: a missing id fails now, not after retries
            paths.check_hub_id(name_or_path, flag, "dataset", instead)
        try:
            dataset = datasets.load_dataset(name_or_path, config, split=split)
        except (ConnectionError, OSError) as error:
            why = "HF_HUB_OFFLINE is set" if hub_offline() else type(error).__name__
            raise UsageError(
                f"{flag} {name_or_path}{f' ({config})' if config else ''} is not a local folder and not reachable "
                f"on the hub ({why}); {instead}."
            ) from None
    if len(dataset) == 0:  # else an index error later
        raise UsageError(f"{flag} {name_or_path}: split {split!r} has no rows.")
    return dataset


def has_split(name_or_path: str, split: str, config: str | None = None) -> bool:
    """Whether `load_split` would find `split`; True where only loading can tell (a hub id offline, a missing
    path), so that loading gives the reason."""
    import json

    if config is not None and os.path.isdir(name_or_path):
        name_or_path = os.path.join(name_or_path, config)
    if os.path.isfile(name_or_path):
        return split in ("train", os.path.splitext(os.path.basename(name_or_path))[0])
    if os.path.isdir(name_or_path):
        saved = os.path.join(name_or_path, "dataset_dict.json")
        if os.path.exists(saved):
            with open(saved) as f:
                return split in json.load(f).get("splits", [split])
        saved_dataset = os.path.exists(os.path.join(name_or_path, "dataset_info.json"))  # any split: that one
        endings = (".json", ".jsonl", ".parquet", ".csv")
        return saved_dataset or any(os.path.isfile(os.path.join(name_or_path, split + e)) for e in endings)
    if is_local(name_or_path):
        return True
    try:
        import datasets

        return split in datasets.get_dataset_split_names(name_or_path, config)
    except Exception:  # offline, gated or unknown: load_split says which
        return True


def _load_from_disk(path: str, flag: str):
    """`datasets.load_from_disk`; a UsageError for a split with no rows (datasets raises IndexError)."""
    import datasets

    try:
        return datasets.load_from_disk(path)
    except IndexError:
        raise UsageError(f"{flag} {path} has a split with no rows (saved with save_to_disk).") from None


def check_columns(dataset, required: Sequence[str], where: str) -> None:
    """UsageError naming expected and found columns when `dataset` lacks one of `required`."""
    missing = [c for c in required if c not in dataset.column_names]
    if missing:
        raise UsageError(
            f"{where} is missing column(s) {missing}: expected {list(required)}, found {dataset.column_names}."
        )
    if len(dataset) == 0:
        raise UsageError(f"{where} is empty.")


# ----------------------------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------------------------
def is_conversation(value) -> bool:
    """True for a list of messages, each a dict with a role and a content."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


# The columns each type reads; the first type whose columns are all there wins.
TYPE_COLUMNS = {
    "preference": ("prompt", "chosen", "rejected"),
    "implicit_preference": ("chosen", "rejected"),
    "prompt_completion": ("prompt", "completion"),
    "prompt_only": ("prompt",),
    "language_modeling": ("messages",),  # or --dataset_text_field
}


def detect_format(
    dataset, where: str, text_field: str = "text", accepted: Sequence[str] | None = None
) -> tuple[str, bool]:
    """(type, conversational) from the columns and first row; type is a key of TYPE_COLUMNS. Only the columns
    of the first `accepted` type that fits are read, so an ignored column decides nothing. UsageError when
    none fits or the columns mix strings and conversations."""
    columns = set(dataset.column_names)
    if len(dataset) == 0:
        raise UsageError(f"{where} is empty.")
    kind, keys = None, []
    for name, needed in TYPE_COLUMNS.items():
        if name == "language_modeling":
            needed = ("messages",) if "messages" in columns else (text_field,)
        if (accepted is None or name in accepted) and set(needed) <= columns:
            kind, keys = name, list(needed)
            break
    if kind is None and accepted is not None:
        check_type(dataset, "", accepted, where, text_field)
    if kind is None:
        raise UsageError(
            f"{where} matches none of TRL's dataset types {FORMATS}; found columns {sorted(columns)}."
        )
    first = dataset[0]
    conversational = [is_conversation(first[k]) for k in keys]
    if not all(conversational) and not all(isinstance(first[k], str) for k in keys):
        raise UsageError(
            f"{where}: columns {keys} must all be strings (standard) or all lists of {{role, content}} messages "
            "(conversational)."
        )
    return kind, all(conversational)


def check_type(dataset, kind: str, accepted: Sequence[str], where: str, text_field: str = "text") -> None:
    """UsageError naming missing, expected and found columns when `kind` is not `accepted`."""
    if kind in accepted:
        return
    required = {
        "preference": [["prompt", "chosen", "rejected"]],
        "implicit_preference": [["chosen", "rejected"]],
        "prompt_completion": [["prompt", "completion"]],
        "prompt_only": [["prompt"]],
        "language_modeling": [[text_field], ["messages"]],
    }
    options = [columns for a in accepted for columns in required[a]]
    found = list(dataset.column_names)
    missing = [c for c in options[0] if c not in found]
    others = " or ".join(str(o) for o in options[1:])
    raise UsageError(
        f"{where} is missing column(s) {missing}: expected {options[0]}{f' (or {others})' if others else ''}, "
        f"found {found}."
    )


# ----------------------------------------------------------------------------------------------------------------
# Datasets to texts, by type
# ----------------------------------------------------------------------------------------------------------------
def column(dataset, name: str) -> list:
    """A column as a Python list, read at once (row by row is far slower)."""
    return dataset[name][:]


def columns(dataset) -> dict[str, list]:
    """{name: list} of every column: what a TRL-style reward function gets."""
    return {name: column(dataset, name) for name in dataset.column_names}


def columns_of_rows(columns: dict[str, list], examples, rows) -> dict[str, list]:
    """`columns` at completion rows `rows` [N] of a completion-major batch: row i is dataset row
    examples[i % len(examples)]."""
    P = len(examples)
    return {name: [values[examples[r % P]] for r in rows.tolist()] for name, values in columns.items()}


def format_of(dataset, tokenizer, where: str, accepted: Sequence[str], text_field: str = "text"):
    """(type, conversational) of a dataset whose type must be one of `accepted`; a conversational one needs a
    chat template."""
    kind, conversational = detect_format(dataset, where, text_field, accepted)
    if conversational:
        require_chat_template(tokenizer, where)
    return kind, conversational


def prompt_texts(dataset, tokenizer, where: str) -> list[str]:
    """The `prompt` column as texts, conversations rendered with the generation prompt: RL's prompts."""
    kind, conversational = format_of(dataset, tokenizer, where, ["prompt_only"])  # other columns ignored
    prompts = column(dataset, "prompt")
    if not conversational:
        return prompts
    return [render(tokenizer, p, generation_prompt=p[-1]["role"] != "assistant") for p in prompts]


# ----------------------------------------------------------------------------------------------------------------
# Batch orders: which rows each process takes, a pure function of the step
# ----------------------------------------------------------------------------------------------------------------
def prompt_batches(
    num_prompts: int, per_process: int, world_size: int, rank: int, seed: int
) -> Iterator[list[int]]:
    """Endless batches of `per_process` prompt indices for `rank`: a shuffle seeded by seed + pass, the same
    on every process; the incomplete batch of a pass is dropped."""
    per_update, epoch = per_process * world_size, 0
    while True:
        order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, num_prompts - per_update + 1, per_update):
            yield order[start + rank * per_process : start + (rank + 1) * per_process].tolist()
        epoch += 1
