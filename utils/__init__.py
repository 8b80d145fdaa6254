"""Shared helpers of the scripts: padding, truncation, batched forward passes, generation, reward-model
scores, loading data and models, and input checks. Nothing algorithm-specific lives here.

Shape names: B batch, T sequence length, Q query (prompt) length, R response length, V vocabulary.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn as nn

INVALID_LOGPROB = 1.0  # stands in for the logprob of padding; always masked out before use


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
    """Refuse, before any work, to write into a non-empty `output_dir` unless `overwrite` is set."""
    if output_dir and os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise ValueError(
            f"--output_dir {output_dir} exists and is not empty; pass another one or --overwrite_output_dir."
        )


# ----------------------------------------------------------------------------------------------------------------
# Padding and truncation
# ----------------------------------------------------------------------------------------------------------------
def pad(sequences: Sequence[Sequence[int]], pad_value: int, side: str = "right") -> torch.Tensor:
    """Stack token lists of different lengths into a LongTensor [B, max_len], padding on `side`."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
    width = max((len(s) for s in sequences), default=0)
    out = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq):
            row = torch.as_tensor(seq, dtype=torch.long)
            if side == "right":
                out[i, : len(seq)] = row
            else:
                out[i, width - len(seq) :] = row
    return out


def left_pad(
    rows: Sequence[Sequence[int]], pad_token_id: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as left-padded ids [B, Q] and their attention mask [B, Q] (the mask does not rely on the pad id,
    which may equal a real token such as EOS). Generation needs prompts flush right."""
    ids = pad(rows, pad_token_id, "left")
    mask = pad([[1] * len(r) for r in rows], 0, "left").bool()
    return ids.to(device), mask.to(device)


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True of each row of `bools` [B, T]; T for a row with none. Returns [B]."""
    width = bools.size(-1)
    positions = torch.arange(width, dtype=dtype, device=bools.device)
    return torch.where(bools, positions, torch.full_like(positions, width)).min(-1).values


def truncate_response(
    responses: torch.Tensor, stop_token_id: int | None, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each response up to and including its first `stop_token_id`; replace what follows with padding.

    responses: [B, R]. Returns (truncated [B, R], lengths [B]) where lengths counts the kept tokens, the stop
    token included (R when there is none). With `stop_token_id=None` nothing is cut. The lengths come from the
    stop token, not from the padding, so they stay right when pad and stop tokens are the same id.
    """
    width = responses.size(1)
    if stop_token_id is None:
        return responses.clone(), torch.full((responses.size(0),), width, device=responses.device)
    lengths = (first_true_indices(responses == stop_token_id) + 1).clamp(max=width)
    keep = torch.arange(width, device=responses.device)[None, :] < lengths[:, None]
    return torch.where(keep, responses, torch.full_like(responses, pad_token_id)), lengths


def lengths_to_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Boolean mask [B, width] with the first `lengths[b]` positions of row b set."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


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


# ----------------------------------------------------------------------------------------------------------------
# Forward passes
# ----------------------------------------------------------------------------------------------------------------
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as generation does for left-padded rows: [B, T]."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
    """Forward a causal LM on padded rows with the attention mask and the matching position ids."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for each position: logits [B, T, V], tokens [B, T] -> [B, T]."""
    return torch.gather(logits.float().log_softmax(-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: [B, T, V] -> [B, T]."""
    logits = logits.float()
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


def response_logits(
    model: nn.Module,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float,
) -> torch.Tensor:
    """Logits [B, R, V] that predict the response tokens (positions context_length..T-1), divided by the
    sampling temperature so that logprobs match those of sampling."""
    logits = forward(model, query_responses, attention_mask).logits[:, context_length - 1 : -1].float()
    return logits / (temperature if temperature > 0 else 1.0)


@torch.no_grad()
def batched_response_logprobs(
    model: nn.Module,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """Logprobs [B, R] of the response tokens under `model`, in chunks of `chunk_size` rows (no gradient)."""
    out = []
    for i in range(0, query_responses.size(0), chunk_size):
        qr, am = query_responses[i : i + chunk_size], attention_mask[i : i + chunk_size]
        logits = response_logits(model, qr, am, context_length, temperature)
        out.append(logprobs_from_logits(logits, qr[:, context_length:]))
    return torch.cat(out)


@torch.no_grad()
def generate(
    model: nn.Module,
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    chunk_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample exactly `response_length` tokens after left-padded `queries` [B, Q], in chunks of `chunk_size` rows.

    Sampling is from softmax(logits / temperature) (greedy when temperature == 0) with a key-value cache and the
    position ids generation needs under left padding. Sampling does not stop at EOS: every row gets R tokens
    and the caller truncates after the stop token. Returns (query_responses [B, Q+R], logprobs [B, R]): the
    logprobs of the sampled tokens under logits / temperature (under the plain logits when greedy).
    """
    all_tokens, all_logprobs = [], []
    for i in range(0, queries.size(0), chunk_size):
        tokens, mask = queries[i : i + chunk_size], query_mask[i : i + chunk_size].long()
        position_ids = position_ids_from_mask(mask)
        step_ids, past, logprobs = tokens, None, []
        for _ in range(response_length):
            out = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1].float()
            if temperature > 0:
                logits = logits / temperature
                next_ids = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            else:
                next_ids = logits.argmax(-1, keepdim=True)
            logprobs.append(logits.log_softmax(-1).gather(1, next_ids))
            tokens = torch.cat([tokens, next_ids], 1)
            mask = torch.cat([mask, torch.ones_like(next_ids)], 1)
            position_ids = position_ids[:, -1:] + 1
            step_ids = next_ids
        all_tokens.append(tokens)
        all_logprobs.append(
            torch.cat(logprobs, 1) if logprobs else tokens.new_zeros(tokens.size(0), 0).float()
        )
    return torch.cat(all_tokens), torch.cat(all_logprobs)


@torch.no_grad()
def complete(
    model: nn.Module,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    response_length: int,
    chunk_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Completions of tokenized prompts as the RL scripts sample them: left-padded, `response_length` tokens
    (greedy by default), truncated after EOS. Returns (responses [B, R], lengths [B]) on the model's device."""
    queries, query_mask = left_pad(prompt_ids, tokenizer.pad_token_id, next(model.parameters()).device)
    query_responses, _ = generate(
        model, queries, query_mask, response_length, temperature, chunk_size, generator
    )
    return truncate_response(
        query_responses[:, queries.size(1) :], tokenizer.eos_token_id, tokenizer.pad_token_id
    )


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
) -> torch.Tensor:
    """Scores [B] of truncated query+response rows, from a reward model (read at the last real token) or from a
    reward function called on the decoded prompts and completions (the completion stops at its stop token)."""
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
    return call_reward_fn(reward_fn, prompts, completions).to(query_responses.device)


def load_reward_fn(spec: str) -> Callable:
    """Load `path/to/file.py:function`, a function (prompts: list[str], completions: list[str]) -> floats."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"--reward_fn must look like path/to/file.py:function, got {spec!r}.")
    if not os.path.isfile(path):
        raise ValueError(f"--reward_fn file {path} does not exist.")
    import sys

    module_name = "reward_fn_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up there
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--reward_fn file {path} defines no function named {name!r}.")
    return getattr(module, name)


def call_reward_fn(fn: Callable, prompts: list[str], completions: list[str]) -> torch.Tensor:
    """Call a reward function and check its answer: one float per completion. Returns [B] float32. A NaN or an
    infinity is returned as it is: the training scripts stop on it with `utils.run.check_finite`, naming the
    update and the last good checkpoint (a judge that fails once mid-run is not a bad flag)."""
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
        return datasets.load_dataset(builders[ext], data_files=name_or_path, split="train")
    if os.path.isdir(name_or_path):
        if os.path.exists(os.path.join(name_or_path, "dataset_dict.json")):
            dataset_dict = datasets.load_from_disk(name_or_path)
            if split not in dataset_dict:
                raise ValueError(
                    f"{flag} {name_or_path} has no split {split!r}; its splits are {list(dataset_dict)}."
                )
            return dataset_dict[split]
        if os.path.exists(os.path.join(name_or_path, "dataset_info.json")):
            return datasets.load_from_disk(name_or_path)
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
        return datasets.load_dataset(name_or_path, split=split)
    except (ConnectionError, OSError) as error:
        raise ValueError(
            f"{flag} {name_or_path!r} could not be loaded from the hub ({type(error).__name__}); "
            "without network pass a save_to_disk directory or json/jsonl/parquet files."
        ) from None


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


def write_model_card(output_dir: str, algorithm: str, base_model: str, dataset: str, metrics: dict) -> None:
    """Write `output_dir/README.md`: the algorithm, base model, dataset, the full command and final metrics."""
    import shlex
    import sys

    lines = [
        f"# {os.path.basename(os.path.abspath(output_dir))}",
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
