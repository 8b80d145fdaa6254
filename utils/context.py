"""Sequences checked against the model's positions before loading: refused in one sentence, or fitted under
--context_overflow cut; sample-table prompts cut to fit. Optional: utils.loading and utils.generation use it when
the file is there; a copy without it trusts the flags (--context_overflow cut needs it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from utils.loading import cut_from_left, load_kwargs, say_once
from utils.paths import check_source
from utils.run import UsageError, inner_model

POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def config_positions(config) -> int | None:
    """The positions a model config names (POSITION_ATTRIBUTES); None when unknown."""
    config = getattr(config, "text_config", None) or config
    for name in POSITION_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_positions(name_or_path: str, flag: str | None = None) -> int | None:
    """The model's positions from its config alone (config_positions); None when unknown. With the `flag` that
    names it, a path that holds no model is a UsageError (check_source) first."""
    from transformers import AutoConfig

    if flag is not None:
        check_source(AutoConfig, name_or_path, flag)
    try:
        config = AutoConfig.from_pretrained(name_or_path, **load_kwargs(AutoConfig, name_or_path))
    except (OSError, ValueError):  # loading the model reports a bad path later
        return None
    return config_positions(config)


def check_context_length(
    name_or_path: str, length: int, flags: str, flag: str = "--model_name_or_path"
) -> None:
    """UsageError naming `flags` when sequences of `length` tokens exceed the model's positions (a rotary
    model would train silently on unseen positions). Reads the config only: call it before loading."""
    positions = model_positions(name_or_path, flag)
    if positions is not None and length > positions:
        raise UsageError(
            f"this run's sequences reach {length} tokens, more than the {positions} positions of {flag} "
            f"{name_or_path}; lower {flags} so that they fit, or pass --context_overflow cut."
        )


def fitted_lengths(max_length: int, max_prompt_length: int | None, positions: int) -> tuple[int, int | None]:
    """`max_length` lowered to `positions`; a `max_prompt_length` then not under it becomes half of it, so the
    scripts' rule 0 < max_prompt_length < max_length still holds."""
    max_length = min(max_length, positions)
    if max_prompt_length is not None and max_prompt_length >= max_length:
        max_prompt_length = max(1, max_length // 2)
    return max_length, max_prompt_length


def fit_max_length(args, flag: str = "--model_name_or_path") -> None:
    """Under --context_overflow cut, lower `args.max_length` (and `args.max_prompt_length` with it, when it has
    one) to the positions of `args.model_name_or_path`, in one line. Reads the config only."""
    positions = model_positions(args.model_name_or_path, flag) if args.context_overflow == "cut" else None
    if positions is None or args.max_length <= positions:
        return
    old_length, old_prompt = args.max_length, getattr(args, "max_prompt_length", None)
    args.max_length, new_prompt = fitted_lengths(old_length, old_prompt, positions)
    prompt = f", --max_prompt_length {old_prompt} to {new_prompt}" if new_prompt != old_prompt else ""
    say_once(
        f"--context_overflow cut: --max_length {old_length} lowered to the {positions} positions of {flag} "
        f"{args.model_name_or_path}{prompt}"
    )
    if new_prompt != old_prompt:
        args.max_prompt_length = new_prompt


def fit_prompts(
    splits: list[list[list[int]] | None],
    args,
    completion: str,
    model: str,
    flag: str,
    completion_flag: str = "",
) -> list:
    """The prompt ids of every split (train, eval; None stays None) such that each prompt with `args.<completion>`
    tokens (flag `completion_flag`, default --<completion>) fits the positions of `model`: refused in one
    sentence, or under --context_overflow cut, cut from the left with one line for all splits. Reads the config
    only: call it before loading the model."""
    positions, length = model_positions(model, flag), getattr(args, completion)
    completion_flag = completion_flag or f"--{completion}"
    prompts = [p for split in splits if split for p in split]
    longest = max(map(len, prompts), default=0) + length
    if positions is None or longest <= positions:
        return splits
    room = positions - length
    if room < 1:
        raise UsageError(
            f"{completion_flag} {length} leaves no room for a prompt in the {positions} positions of {flag} "
            f"{model}; lower {completion_flag}."
        )
    if args.context_overflow != "cut":
        raise UsageError(
            f"this run's sequences reach {longest} tokens, more than the {positions} positions of {flag} "
            f"{model}; lower --max_prompt_length or {completion_flag} so that they fit, or pass "
            f"--context_overflow cut to keep each prompt's last {room} tokens."
        )
    splits, cut = cut_from_left(splits, room)
    say_once(
        f"--context_overflow cut: {cut} of {len(prompts)} prompts cut from the left to {room} tokens, so that "
        f"prompt + {length} completion tokens fit the {positions} positions of {flag} {model}"
    )
    return splits


def fit_positions(model: nn.Module, prompt_ids: Sequence[Sequence[int]], new_tokens: int) -> list:
    """`prompt_ids` with each prompt cut from the left so that it and `new_tokens` fit the model's positions,
    in one line when a prompt is cut (sample tables: their prompts are not checked like training data)."""
    positions = config_positions(getattr(inner_model(model), "config", None))
    longest = max(map(len, prompt_ids), default=0) + new_tokens
    if positions is None or longest <= positions:
        return list(prompt_ids)
    room = positions - new_tokens
    if room < 1:
        raise UsageError(
            f"{new_tokens} new tokens leave no room for a prompt in the model's {positions} positions."
        )
    line = (
        f"sample table: {sum(len(p) > room for p in prompt_ids)} of {len(prompt_ids)} prompts cut from the left to "
        f"{room} tokens, so that prompt + {new_tokens} new tokens fit the model's {positions} positions"
    )
    if line not in _SAID:  # once a run, not at every evaluation
        _SAID.add(line)
        say_once(line)
    return [p[-room:] for p in prompt_ids]


_SAID: set[str] = set()
