"""Shared helpers of the scripts: input checks, masked statistics, batch orders, reward-model scores, loading
data and models, reporting. Nothing algorithm-specific lives here. Padding, forward passes and sampling live in
utils/generation.py and are re-exported here (utils.generate, utils.left_pad, ...); the run skeleton is
utils/run.py, checkpoints utils/checkpoint.py, data formats utils/data.py, reward scoring utils/scoring.py.

Shape names: B batch, T sequence length, Q query (prompt) length, R response length, V vocabulary.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from utils.generation import (  # noqa: F401  (padding, forward passes and sampling, used as utils.*)
    batched_response_logprobs,
    chunked_token_logprobs,
    complete,
    entropy_from_logits,
    first_true_indices,
    forward,
    generate,
    left_pad,
    lengths_to_mask,
    logprobs_from_logits,
    pad,
    position_ids_from_mask,
    query_response_rows,
    response_logits,
    response_logprobs,
    sampling_generator,
    token_logprobs,
    truncate_response,
)


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------
def exact_div(numerator: int, denominator: int, what: str) -> int:
    """`numerator // denominator`, or a ValueError naming the flags (`what`) when it does not divide exactly."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}; change one of these flags.")
    return numerator // denominator


def check_columns(dataset, required: Sequence[str], where: str) -> None:
    """Raise a ValueError naming the expected and the found columns when `dataset` lacks one of `required`."""
    missing = [c for c in required if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{where} is missing column(s) {missing}: expected {list(required)}, found {dataset.column_names}."
        )
    if len(dataset) == 0:
        raise ValueError(f"{where} is empty.")


def check_output_dir(output_dir: str, overwrite: bool = False) -> None:
    """Refuse, before any work, to write into a non-empty `output_dir` unless `overwrite` is set. Unfinished
    checkpoint writes (tmp-checkpoint-N, left by a kill) do not count: they are removed when the run starts."""
    import re

    held = [n for n in os.listdir(output_dir) if not re.fullmatch(r"tmp[-_]checkpoint[-_]\d+", n)] if (
        output_dir and os.path.isdir(output_dir)) else []  # fmt: skip
    if held and not overwrite:
        raise ValueError(
            f"--output_dir {output_dir} exists and is not empty; pass another one or --overwrite_output_dir."
        )


# ----------------------------------------------------------------------------------------------------------------
# Masked statistics (used by every RL script)
# ----------------------------------------------------------------------------------------------------------------
def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is true (over `dim`, or over everything)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries; with `unbiased`, Bessel's correction (needs at least two entries)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError("masked_var with unbiased=True needs at least two unmasked values.")
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the masked entries; with `shift_mean=False` the mean is kept."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def prompt_batches(
    num_prompts: int, per_process: int, world_size: int, rank: int, seed: int
) -> Iterator[list[int]]:
    """Endless batches of prompt indices for this process: a fresh seeded shuffle every pass (the same on every
    process), cut into batches of `per_process * world_size`, process `rank` taking its slice; the incomplete
    batch at the end of a pass is dropped."""
    per_update, epoch = per_process * world_size, 0
    while True:
        order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, num_prompts - per_update + 1, per_update):
            yield order[start + rank * per_process : start + (rank + 1) * per_process].tolist()
        epoch += 1


def shuffled_micro_batch(
    num_rows: int, m: int, micro: int, world_size: int, rank: int, seed: int
) -> list[int]:
    """Row indices of this process's m-th micro-batch of a supervised run: every epoch a fresh shuffle seeded by
    seed + epoch (the same on every process), cut into global micro-batches of `micro * world_size` rows,
    process `rank` taking its slice; the incomplete tail of an epoch is dropped. A pure function of m, so a
    resumed run finds any step again, and one process accumulating k micro-batches sees the rows that k
    processes see at once."""
    per_epoch = num_rows // (micro * world_size)
    epoch, i = divmod(m, per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    start = (i * world_size + rank) * micro
    return order[start : start + micro].tolist()


# ----------------------------------------------------------------------------------------------------------------
# Reward models and reward functions
# ----------------------------------------------------------------------------------------------------------------
def score_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone, head) of a sequence-classification model, so a score can be read at every token."""
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if backbone is None or head is None:
        raise ValueError(
            f"{type(model).__name__} has no backbone + `score` head; load it as a sequence classifier."
        )
    if getattr(head, "out_features", 1) != 1:
        raise ValueError(
            f"the reward model has {head.out_features} labels; it must have exactly one (num_labels=1)."
        )
    return backbone, head


def per_token_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head applied to the last hidden state at every position: [B, T] (a critic's values).

    A head made without bias (Llama's, GPT-NeoX's) gets `config.score_bias`, the shift reward.py stores when it
    normalizes a reward model, so every script that scores through here sees normalized scores."""
    backbone, head = score_head(model)
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    scores = head(hidden).squeeze(-1)
    if getattr(head, "bias", None) is None:
        scores = scores + (getattr(model.config, "score_bias", None) or 0.0)
    return scores


def last_token_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position where `attention_mask` [B, T] is set (the EOS of a truncated response)."""
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(1)


def get_score(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A reward model's score [B], read at the last real token of each row (left or right padding alike)."""
    scores = per_token_scores(model, input_ids, attention_mask)
    return scores.gather(1, last_token_indices(attention_mask)[:, None]).squeeze(1)


@torch.no_grad()
def batched_score(model, input_ids, attention_mask, chunk_size: int) -> torch.Tensor:
    """`get_score` in chunks of `chunk_size` rows, without gradient: [B]."""
    return torch.cat(
        [
            get_score(model, input_ids[i : i + chunk_size], attention_mask[i : i + chunk_size])
            for i in range(0, input_ids.size(0), chunk_size)
        ]
    )


def compute_scores(
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    tokenizer,
    chunk_size: int,
    reward_model: nn.Module | None = None,
    reward_fn: Callable | None = None,
    columns: dict[str, list] | None = None,
) -> torch.Tensor:
    """Scores [B] of truncated query+response rows, from a reward model (read at the last real token) or from a
    reward function called on the decoded prompts and completions (the completion stops at its stop token) and,
    for a TRL-style function, the dataset `columns` of each row (see call_reward_fn)."""
    if reward_fn is None:
        return batched_score(reward_model, query_responses, attention_mask, chunk_size)
    mask = attention_mask.bool()
    prompts = [
        tokenizer.decode(q[m], skip_special_tokens=True)
        for q, m in zip(query_responses[:, :context_length], mask[:, :context_length])
    ]
    completions = [
        tokenizer.decode(r[m], skip_special_tokens=True)
        for r, m in zip(query_responses[:, context_length:], mask[:, context_length:])
    ]
    return call_reward_fn(reward_fn, prompts, completions, columns).to(query_responses.device)


TRL_BUILTIN_REWARDS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)


def load_reward_fn(spec: str) -> Callable:
    """Load a reward function (prompts: list[str], completions: list[str]) -> floats, or one TRL-style with
    **kwargs (see call_reward_fn), from `path/to/file.py:function` or, as TRL takes it, a dotted import path
    `module.function` (imported from the working directory)."""
    import sys

    path, sep, name = spec.rpartition(":")
    if not sep and spec in TRL_BUILTIN_REWARDS:
        raise ValueError(
            f"--reward_fn {spec} is one of TRL's built-in rewards, which are not shipped here; pass your own "
            "as path/to/file.py:function or module.function."
        )
    if not sep and "." in spec.strip(".") and "/" not in spec and not spec.endswith(".py"):
        module_name, _, name = spec.rpartition(".")
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(
                f"--reward_fn {spec}: module {module_name!r} cannot be imported ({error})."
            ) from None
        finally:
            sys.path.pop(0)
        if not callable(getattr(module, name, None)):
            raise ValueError(
                f"--reward_fn {spec}: module {module_name!r} defines no function named {name!r}."
            )
        return getattr(module, name)
    if not sep or not path or not name:
        raise ValueError(
            f"--reward_fn must look like path/to/file.py:function or module.function, got {spec!r}."
        )
    if not os.path.isfile(path):
        raise ValueError(f"--reward_fn file {path} does not exist.")

    module_name = "reward_fn_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up there
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--reward_fn file {path} defines no function named {name!r}.")
    return getattr(module, name)


def call_reward_fn(
    fn: Callable, prompts: list[str], completions: list[str], columns: dict[str, list] | None = None
) -> torch.Tensor:
    """Call a reward function and check its answer: one float per completion. Returns [B] float32.

    A function with a `**kwargs` parameter is called as TRL calls its reward functions: with the keywords
    `prompts` (the dataset's `prompt` column when given), `completions` and every other column of the rows'
    dataset examples (`columns`, e.g. `solution`); when the prompts are conversations (message lists), each
    completion is one assistant message, [{"role": "assistant", "content": text}]. Any other function is called as
    fn(prompts, completions) on the texts. A NaN or an infinity is returned as it is: the training scripts stop
    on it with `utils.run.check_finite`, naming the update and the last good checkpoint."""
    import inspect

    from utils import data

    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        extra = {k: v for k, v in (columns or {}).items() if k not in ("prompt", "completion")}
        raw_prompts = (columns or {}).get("prompt")
        if raw_prompts:  # the dataset's own prompts, not their decoded (possibly left-truncated) tokens
            prompts = list(raw_prompts)
            if data.is_conversation(raw_prompts[0]):
                completions = [[{"role": "assistant", "content": c}] for c in completions]
        values = list(fn(prompts=prompts, completions=completions, **extra))
    else:
        values = list(fn(prompts, completions))
    if len(values) != len(completions):
        raise ValueError(
            f"the reward function returned {len(values)} values for {len(completions)} completions."
        )
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# Models and data
# ----------------------------------------------------------------------------------------------------------------
def disable_dropout(model: nn.Module) -> None:
    """Turn off every dropout (modules, attention-probability dropout, config) so logprobs are deterministic."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout_p"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(config, key, 0.0)


def _is_local(name_or_path: str) -> bool:
    return (
        os.path.exists(name_or_path)
        or name_or_path.startswith((".", "/", "~"))
        or name_or_path.count("/") > 1
    )


def from_pretrained(cls, name_or_path: str, flag: str, **kwargs):
    """`cls.from_pretrained(name_or_path)` with a one-sentence error for a missing path or an unreachable hub."""
    if _is_local(name_or_path) and not os.path.exists(name_or_path):
        raise ValueError(f"{flag} {name_or_path} does not exist.")
    try:
        return cls.from_pretrained(name_or_path, **kwargs)
    except OSError as error:
        if os.path.exists(name_or_path):
            raise
        raise ValueError(
            f"{flag} {name_or_path!r} could not be loaded from the hub ({type(error).__name__}); "
            "without network pass a local directory saved with save_pretrained."
        ) from None


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass, with PyTorch's non-reentrant checkpointing (transformers 5.20
    renamed the method; the old name still works there, with a warning)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def load_tokenizer(name_or_path: str, flag: str, chat_template_path: str | None = None):
    """The tokenizer of `name_or_path`, padding with EOS when it has no pad token (safe: every mask in these
    scripts comes from lengths, never from comparing ids with the pad id), with the Jinja chat template of
    `chat_template_path` when given (utils.data.set_chat_template)."""
    from transformers import AutoTokenizer

    from utils import data

    tokenizer = from_pretrained(AutoTokenizer, name_or_path, flag)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data.set_chat_template(tokenizer, chat_template_path)
    return tokenizer


def load_reward_model(name_or_path: str, flag: str = "--reward_model_path") -> nn.Module:
    """A reward model: a sequence classifier with exactly one label and a trained score head, dropout off.
    Anything else is refused in one sentence: a causal LM would load with a freshly initialised head (of two
    labels, or of one when its config says num_labels=1) and score at random."""
    from transformers import AutoModelForSequenceClassification

    model, info = from_pretrained(
        AutoModelForSequenceClassification, name_or_path, flag, output_loading_info=True
    )
    _, head = score_head(model)
    head_names = {
        f"{prefix}.{name}" for prefix in ("score", "classifier") for name, _ in head.named_parameters()
    }
    missing = sorted(set(info.get("missing_keys") or ()) & head_names)
    if missing:
        architectures = ", ".join(getattr(model.config, "architectures", None) or ["unknown"])
        raise ValueError(
            f"{flag} {name_or_path} has no trained score head ({architectures}; {missing[0]} would be initialised "
            "at random); pass a reward model trained with reward.py."
        )
    disable_dropout(model)
    return model


def load_split(name_or_path: str, split: str, flag: str = "--dataset_name"):
    """A `datasets.Dataset` from a hub id, a `save_to_disk` directory, a directory of `{split}.jsonl/json/parquet`
    files, or one json/jsonl/parquet/csv file (whose only split, named 'train' or like the file, is its
    content; any other split name is refused, so a test split never silently holds the training rows)."""
    import datasets

    builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
    if os.path.isfile(name_or_path):
        ext = os.path.splitext(name_or_path)[1]
        if os.path.getsize(name_or_path) == 0:
            raise ValueError(f"{flag} {name_or_path} is empty.")
        if ext not in builders:
            raise ValueError(
                f"{flag} {name_or_path}: unknown file type {ext!r}; use json, jsonl, parquet or csv."
            )
        stem = os.path.splitext(os.path.basename(name_or_path))[0]
        if split not in ("train", stem):  # one file is one split: never evaluate on the training rows
            raise ValueError(
                f"{flag} {name_or_path} is one file, whose only split is 'train' (or {stem!r}), not {split!r}; "
                "turn evaluation off (--eval_strategy no or --dataset_test_split None) or pass a folder of "
                f"{{split}}.jsonl files."
            )
        if ext in (".json", ".jsonl", ".csv"):
            with open(name_or_path, errors="replace") as f:
                if not any(line.strip() for line in f):
                    raise ValueError(f"{flag} {name_or_path} holds only blank lines: no rows.")
        return _non_empty(datasets.load_dataset(builders[ext], data_files=name_or_path, split="train"), name_or_path,
                          split, flag)  # fmt: skip
    if os.path.isdir(name_or_path):
        if os.path.exists(os.path.join(name_or_path, "dataset_dict.json")):
            dataset_dict = _load_from_disk(name_or_path, flag)
            if split not in dataset_dict:
                raise ValueError(
                    f"{flag} {name_or_path} has no split {split!r}; its splits are {list(dataset_dict)}."
                )
            return _non_empty(dataset_dict[split], name_or_path, split, flag)
        if os.path.exists(os.path.join(name_or_path, "dataset_info.json")):
            return _non_empty(_load_from_disk(name_or_path, flag), name_or_path, split, flag)
        for ext in builders:
            path = os.path.join(name_or_path, split + ext)
            if os.path.isfile(path):
                return load_split(path, split, flag)
        raise ValueError(
            f"{flag} {name_or_path} holds no dataset saved with save_to_disk and no {split}.jsonl."
        )
    if _is_local(name_or_path):
        raise ValueError(f"{flag} {name_or_path} does not exist.")
    try:
        return _non_empty(datasets.load_dataset(name_or_path, split=split), name_or_path, split, flag)
    except (ConnectionError, OSError) as error:
        raise ValueError(
            f"{flag} {name_or_path!r} could not be loaded from the hub ({type(error).__name__}); "
            "without network pass a save_to_disk directory or json/jsonl/parquet files."
        ) from None


def _load_from_disk(path: str, flag: str):
    """`datasets.load_from_disk`, with one sentence for a split saved with no rows (datasets fails on its zero
    shards with an IndexError)."""
    import datasets

    try:
        return datasets.load_from_disk(path)
    except IndexError:
        raise ValueError(f"{flag} {path} has a split with no rows (saved with save_to_disk).") from None


def _non_empty(dataset, name_or_path: str, split: str, flag: str):
    """`dataset`, or a one-sentence ValueError when it has no rows (a script would fail later with an index error)."""
    if len(dataset) == 0:
        raise ValueError(f"{flag} {name_or_path}: split {split!r} has no rows.")
    return dataset


def tokenize_prompts(
    tokenizer, prompts: Sequence[str], max_prompt_length: int | None = None
) -> list[list[int]]:
    """Token ids of each prompt as the scripts feed them (utils.data.tokenize_prompts: a BOS only where the
    tokenizer adds one itself), keeping the last `max_prompt_length` tokens."""
    from utils import data

    return data.tokenize_prompts(tokenizer, prompts, max_prompt_length)


# ----------------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------------
def print_samples(columns: dict[str, list], title: str = "samples", max_rows: int = 8) -> None:
    """Print a rich table of sample completions (one column per key)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for name in columns:
        table.add_column(name)
    for row in list(zip(*columns.values()))[:max_rows]:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


def write_model_card(output_dir: str, algorithm: str, base_model: str, dataset: str, metrics: dict,
                     title: str | None = None) -> None:  # fmt: skip
    """Write `output_dir/README.md`: the algorithm, base model, dataset, the full command and final metrics. The
    title is `title`, by default the folder's name (pass the final name when writing into a temporary folder)."""
    import shlex
    import sys

    lines = [
        f"# {title or os.path.basename(os.path.abspath(output_dir))}",
        "",
        f"- algorithm: {algorithm}",
        f"- base model: `{base_model}`",
        f"- dataset: `{dataset}`",
        "",
        "## Command",
        "",
        "```",
        shlex.join(["python", *sys.argv]),
        "```",
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()],
        "",
    ]
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


from utils import checkpoint, run  # noqa: E402, F401  (the run skeleton, used as utils.run.*)
