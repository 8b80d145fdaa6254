"""Models and tokenizers from the hub or a local folder with one-sentence errors; dropout off."""

from __future__ import annotations

import os

import torch.nn as nn

from utils.chat import set_chat_template
from utils.data import is_local


def disable_dropout(model: nn.Module) -> None:
    """Turn off every dropout (modules, attention, config) so logprobs are deterministic."""
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


def from_pretrained(cls, name_or_path: str, flag: str, **kwargs):
    """`cls.from_pretrained`, with a ValueError for a missing path or an unreachable hub."""
    if is_local(name_or_path) and not os.path.exists(name_or_path):
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
    """Non-reentrant activation checkpointing, under the method's new name when transformers has it."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def load_tokenizer(name_or_path: str, flag: str, chat_template_path: str | None = None):
    """The tokenizer, padding with EOS when it has none (masks come from lengths, never from the pad id), with
    the chat template of `chat_template_path` when given."""
    from transformers import AutoTokenizer

    tokenizer = from_pretrained(AutoTokenizer, name_or_path, flag)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    set_chat_template(tokenizer, chat_template_path)
    return tokenizer


POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def model_positions(name_or_path: str) -> int | None:
    """The model's positions from its config alone (POSITION_ATTRIBUTES); None when unknown."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):  # loading the model reports a bad path later
        return None
    config = getattr(config, "text_config", None) or config
    for name in POSITION_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context_length(
    name_or_path: str, length: int, flags: str, flag: str = "--model_name_or_path"
) -> None:
    """ValueError naming `flags` when sequences of `length` tokens exceed the model's positions (a rotary
    model would train silently on unseen positions). Reads the config only: call it before loading."""
    positions = model_positions(name_or_path)
    if positions is not None and length > positions:
        raise ValueError(
            f"this run's sequences reach {length} tokens, more than the {positions} positions of {flag} "
            f"{name_or_path}; lower {flags} so that they fit, or pass --context_overflow cut."
        )


def fit_max_length(
    name_or_path: str, max_length: int | None, mode: str, flag: str = "--max_length"
) -> int | None:
    """`max_length`, lowered to the model's positions with one line under --context_overflow cut."""
    positions = model_positions(name_or_path) if mode == "cut" else None
    if positions is None or (max_length is not None and max_length <= positions):
        return max_length
    say(f"--context_overflow cut: {flag} {max_length} lowered to the {positions} positions of {name_or_path}")
    return positions


def fit_prompts(prompts: list[list[int]], args, completion: str, model: str, flag: str) -> list[list[int]]:
    """Prompt ids, each of which with `args.<completion>` tokens fits the positions of `model`: refused in one
    sentence, or under --context_overflow cut, cut from the left (one line). Reads the config only."""
    positions, length = model_positions(model), getattr(args, completion)
    longest = max(map(len, prompts), default=0) + length
    if positions is None or longest <= positions:
        return prompts
    room = positions - length
    if args.context_overflow != "cut" or room < 1:
        hint = (
            f", or pass --context_overflow cut to keep each prompt's last {room} tokens" if room >= 1 else ""
        )
        raise ValueError(
            f"this run's sequences reach {longest} tokens, more than the {positions} positions of {flag} "
            f"{model}; lower --max_prompt_length or --{completion} so that they fit{hint}."
        )
    cut = sum(len(p) > room for p in prompts)
    say(
        f"--context_overflow cut: {cut} of {len(prompts)} prompts cut from the left to {room} tokens, so that "
        f"prompt + {length} completion tokens fit the {positions} positions of {model}"
    )
    return [p[-room:] for p in prompts]


def say(line: str) -> None:
    """Print `line` once per run (the first process)."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(line, flush=True)
