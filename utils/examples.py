"""The examples of the offline scripts: SFT rows with their loss masks (sft.py), preference texts (dpo.py),
reward-model ids (reward.py), prompt-completion texts (sft.py, ilql.py), and their batch order. The dataset
types and formats are utils/data.py's."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from utils.chat import encode, end_at_eos, render, split_rendering, turn_segments
from utils.data import column, detect_format, format_of
from utils.run import UsageError


def shared_prefix(chosen, rejected):
    """(prompt, chosen rest, rejected rest): the longest shared beginning, whole messages or (strings) up to
    the first differing word, so completions keep their leading space. UsageError if none or nothing left."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str):
        while n > 0 and not chosen[n - 1].isspace() and not (n < len(chosen) and chosen[n].isspace()):
            n -= 1
        while n > 0 and chosen[n - 1].isspace():
            n -= 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise UsageError(
            "an implicit-prompt pair must share a beginning (the prompt) and differ after it; found "
            f"{'no shared prompt' if n == 0 else 'a completion that is empty'}."
        )
    return chosen[:n], chosen[n:], rejected[n:]


def prompt_completion_texts(dataset, tokenizer, where: str) -> tuple[list[str], list[str]]:
    """(prompts, completions) texts of a prompt-completion dataset."""
    kind, conversational = format_of(dataset, tokenizer, where, ["prompt_completion"])
    if not conversational:
        return column(dataset, "prompt"), column(dataset, "completion")
    pairs = [
        split_rendering(tokenizer, p, c)
        for p, c in zip(column(dataset, "prompt"), column(dataset, "completion"))
    ]
    return [p for p, _ in pairs], [c for _, c in pairs]


def _raw_preference_rows(dataset, kind: str, where: str) -> list[tuple]:
    """(prompt, chosen, rejected) of each row, an implicit prompt split off."""
    prompts = column(dataset, "prompt") if kind == "preference" else [None] * len(dataset)
    rows = []
    for i, (prompt, chosen, rejected) in enumerate(
        zip(prompts, column(dataset, "chosen"), column(dataset, "rejected"))
    ):
        if prompt is None:
            try:
                prompt, chosen, rejected = shared_prefix(chosen, rejected)
            except ValueError as error:
                raise UsageError(f"{where} row {i}: {error}") from None
        rows.append((prompt, chosen, rejected))
    return rows


def preference_texts(dataset, tokenizer, where: str) -> dict[str, list[str]]:
    """{prompt, chosen, rejected} texts of a preference dataset; chosen and rejected continue the prompt."""
    kind, conversational = format_of(dataset, tokenizer, where, ["preference", "implicit_preference"])
    out: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for prompt, chosen, rejected in _raw_preference_rows(dataset, kind, where):
        if conversational:
            prompt_text, chosen = split_rendering(tokenizer, prompt, chosen)
            rejected = split_rendering(tokenizer, prompt, rejected)[1]
            prompt = prompt_text
        out["prompt"].append(prompt)
        out["chosen"].append(chosen)
        out["rejected"].append(rejected)
    return out


def reward_ids(dataset, tokenizer, where: str, names: Sequence[str]) -> dict[str, list[list[int]]]:
    """{prompt, *names} token ids for a reward model; `names` is ["chosen", "rejected"] or ["completion"].

    Standard: completions get an EOS unless they end with one. Conversational (as TRL): each whole rendering
    encoded at once, nothing added; the prompt is the ids every rendering shares with the prompt's own."""
    if list(names) == ["completion"]:
        kind, conversational = format_of(dataset, tokenizer, where, ["prompt_completion"])
        rows = list(zip(column(dataset, "prompt"), column(dataset, "completion")))
    else:
        kind, conversational = format_of(dataset, tokenizer, where, ["preference", "implicit_preference"])
        rows = _raw_preference_rows(dataset, kind, where)
    out: dict[str, list[list[int]]] = {"prompt": [], **{name: [] for name in names}}
    if not conversational:
        eos = tokenizer.eos_token_id
        out["prompt"] = encode(tokenizer, [row[0] for row in rows], leading=True)
        for j, name in enumerate(names, start=1):
            ids = encode(tokenizer, [row[j] for row in rows], leading=False)
            out[name] = [row if row and row[-1] == eos else row + [eos] for row in ids]
        return out
    for prompt, *completions in rows:
        prompt_text = render(tokenizer, prompt, generation_prompt=completions[0][0]["role"] == "assistant")
        texts = [prompt_text] + [render(tokenizer, prompt + completion) for completion in completions]
        prompt_ids, *wholes = tokenizer(texts, add_special_tokens=False)["input_ids"]
        # a token can merge across the cut: keep what all share
        shared = min(common_prefix_length(prompt_ids, whole) for whole in wholes)
        out["prompt"].append(prompt_ids[:shared])
        for name, whole in zip(names, wholes):
            out[name].append(whole[shared:])
    return out


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def sft_examples(
    dataset,
    tokenizer,
    where: str,
    text_field: str = "text",
    assistant_only_loss: bool = False,
) -> tuple[str, list[tuple]]:
    """("prompt_completion", [(prompt ids, completion ids, loss mask)]) or ("language_modeling", [(ids, loss
    mask)]), each ending with EOS. Masks are all ones, or with `assistant_only_loss` assistant turns only."""
    kind, conversational = format_of(
        dataset, tokenizer, where, ["prompt_completion", "language_modeling"], text_field
    )
    if assistant_only_loss and not conversational:
        raise UsageError(f"{where} is standard (text) data; --assistant_only_loss needs conversational data.")
    eos, rows = tokenizer.eos_token_id, []

    def with_eos(ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        return (ids, mask) if ids[-1:] == [eos] else (ids + [eos], mask + [1])

    if kind == "prompt_completion" and not assistant_only_loss:
        prompts, completions = prompt_completion_texts(dataset, tokenizer, where)
        for prompt_ids, completion_ids in zip(
            encode(tokenizer, prompts, True), encode(tokenizer, completions, False)
        ):
            rows.append((prompt_ids, *with_eos(completion_ids, [1] * len(completion_ids))))
    elif kind == "prompt_completion":  # the prompt never carries loss
        for prompt, completion in zip(column(dataset, "prompt"), column(dataset, "completion")):
            prompt_chars = len(split_rendering(tokenizer, prompt, completion)[0])
            ids, mask, ends = _encode_pieces(tokenizer, turn_segments(tokenizer, prompt + completion))
            cut = ends.get(prompt_chars)
            if cut is None:
                raise UsageError("the chat template renders a prompt that does not end where a turn does.")
            rows.append((ids[:cut], *with_eos(ids[cut:], mask[cut:])))
    elif not conversational:
        name = text_field if text_field in dataset.column_names else "messages"
        for ids in encode(tokenizer, column(dataset, name), True):
            rows.append(with_eos(ids, [1] * len(ids)))
    else:
        name = "messages" if "messages" in dataset.column_names else text_field
        for messages in column(dataset, name):
            if assistant_only_loss:
                ids, mask, _ = _encode_pieces(tokenizer, turn_segments(tokenizer, messages))
            else:
                ids = encode(tokenizer, [end_at_eos(render(tokenizer, messages), tokenizer.eos_token)], True)[
                    0
                ]
                mask = [1] * len(ids)
            rows.append(with_eos(ids, mask))
    return kind, rows


def _encode_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int], dict[int, int]]:
    """(ids, mask of assistant pieces, {character offset of a piece end: ids up to there})."""
    ids, mask, ends, chars = [], [], {0: 0}, 0
    for i, (text, is_assistant) in enumerate(pieces):
        piece = encode(tokenizer, [text], leading=i == 0)[0]
        ids += piece
        mask += [int(is_assistant)] * len(piece)
        chars += len(text)
        ends[chars] = len(ids)
    return ids, mask, ends


def sample_prompts(dataset, tokenizer, where: str, count: int, text_field: str = "text") -> tuple[list, list]:
    """Up to `count` (prompts, references) for sample tables: prompt and completion, or a conversation cut
    before its last assistant turn; none for plain text."""
    head = dataset.select(range(min(count, len(dataset))))
    kind, conversational = detect_format(head, where, text_field, ["prompt_completion", "language_modeling"])
    if kind == "prompt_completion":
        return prompt_completion_texts(head, tokenizer, where)
    if kind != "language_modeling" or not conversational:
        return [], []
    prompts, references = [], []
    name = "messages" if "messages" in head.column_names else text_field
    for messages in column(head, name):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
        if last > 0:
            prompt, reference = split_rendering(tokenizer, messages[:last], messages[last : last + 1])
            prompts.append(prompt)
            references.append(reference)
    return prompts, references


def shuffled_micro_batch(
    num_rows: int, m: int, micro: int, world_size: int, rank: int, seed: int
) -> list[int]:
    """Row indices of `rank`'s m-th micro-batch: a shuffle seeded by seed + epoch, tail dropped. A pure
    function of m, so a resume finds any step, and k accumulated micro-batches equal k processes."""
    per_epoch = num_rows // (micro * world_size)
    epoch, i = divmod(m, per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
    start = (i * world_size + rank) * micro
    return order[start : start + micro].tolist()
