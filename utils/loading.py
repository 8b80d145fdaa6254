"""Models and tokenizers from the hub or a local folder with one-sentence errors; dropout off."""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import torch.nn as nn

from utils.chat import set_chat_template
from utils.data import hub_offline, is_local, missing_path
from utils.run import UsageError, extra_module, main_process, optional_module


def disable_dropout(model: nn.Module) -> None:
    """Turn off every dropout (modules, attention, config) so logprobs are deterministic. The config's values
    are kept for saving (`config_dropout_kept`): some models read them in forward, a saved model keeps them."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout_p"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        kept = _KEPT_DROPOUT.setdefault(id(config), (config, {}))[1]
        for key, value in list(vars(config).items()):
            if "dropout" in key and isinstance(value, float):
                kept.setdefault(key, value)
                setattr(config, key, 0.0)


_KEPT_DROPOUT: dict[int, tuple] = {}  # id(config) -> (config, its dropout values before disable_dropout)


@contextmanager
def config_dropout_kept(model: nn.Module):
    """While saving `model`: its config with the dropout values it had before disable_dropout."""
    config = getattr(model, "config", None)
    kept = _KEPT_DROPOUT.get(id(config), (None, {}))[1]
    for key, value in kept.items():
        setattr(config, key, value)
    try:
        yield
    finally:
        for key in kept:
            setattr(config, key, 0.0)


@dataclasses.dataclass
class ModelFlags:
    """TRL's ModelConfig flags, as a script's setup() passes them (use_model_flags) to every load here."""

    model_name_or_path: str | None = None
    sft_model_path: str | None = None
    model_revision: str = "main"
    attn_implementation: str | None = None
    trust_remote_code: bool = False


MODEL_FLAGS = ModelFlags()


def use_model_flags(args) -> None:
    """Apply the run's --model_revision, --attn_implementation and --trust_remote_code to the loads that follow
    (load_kwargs); one line when the revision cannot apply."""
    global MODEL_FLAGS
    MODEL_FLAGS = flags = ModelFlags(
        **{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(ModelFlags)}
    )
    if flags.model_revision != "main" and flags.model_name_or_path is None:
        say_once(f"--model_revision {flags.model_revision} is ignored: it applies to --model_name_or_path")
    elif flags.model_revision != "main" and is_local(flags.model_name_or_path):
        say_once(
            f"--model_revision {flags.model_revision} is ignored: --model_name_or_path "
            f"{flags.model_name_or_path} is a local folder, loaded as it is"
        )


def load_kwargs(cls, name_or_path: str) -> dict:
    """from_pretrained's keyword arguments from MODEL_FLAGS: trust_remote_code for every load, the revision for
    --model_name_or_path's, the attention for the policy's models (--model_name_or_path, --sft_model_path)."""
    flags, kwargs = MODEL_FLAGS, {}
    if flags.trust_remote_code:
        kwargs["trust_remote_code"] = True
    if name_or_path == flags.model_name_or_path and flags.model_revision != "main":
        kwargs["revision"] = flags.model_revision
    is_model = cls is not None and "Tokenizer" not in cls.__name__ and "Config" not in cls.__name__
    policy_paths = (flags.model_name_or_path, flags.sft_model_path)
    if is_model and flags.attn_implementation and name_or_path in policy_paths:
        kwargs["attn_implementation"] = flags.attn_implementation
    return kwargs


def check_model_paths(args) -> None:
    """Before anything loads, each model flag of `args` checked (utils/paths.py; without it, at its load)."""
    paths = extra_module("utils.paths")
    if paths is not None:
        paths.check_model_paths(args)


def from_pretrained(cls, name_or_path: str, flag: str, **kwargs):
    """`cls.from_pretrained` with the run's model flags (load_kwargs), with a UsageError for a missing path, a
    folder without a model, an unreachable hub or an attention implementation that transformers refuses; with
    utils/paths.py, checked before it loads (what is missing, what the folder holds instead)."""
    paths = extra_module("utils.paths")
    if paths is not None:
        paths.check_source(cls, name_or_path, flag)
    elif is_local(name_or_path) and not os.path.exists(name_or_path):
        raise missing_path(name_or_path, flag)
    kwargs = {**load_kwargs(cls, name_or_path), **kwargs}
    try:
        return cls.from_pretrained(name_or_path, **kwargs)
    except (ImportError, ValueError) as error:
        reason = " ".join(str(error).split())
        if "attn_implementation" in kwargs and (isinstance(error, ImportError) or "attn" in str(error)):
            raise UsageError(
                f"--attn_implementation {kwargs['attn_implementation']} cannot load {flag} {name_or_path}: {reason}"
            ) from None
        if isinstance(error, ImportError) or not os.path.isdir(name_or_path):
            raise
        raise UsageError(f"{flag} {name_or_path} could not be loaded: {reason[:300]}") from None
    except OSError as error:
        if os.path.isdir(name_or_path):  # a folder with a config.json but not what `cls` needs
            reason = " ".join(str(error).split())
            raise UsageError(f"{flag} {name_or_path} could not be loaded: {reason[:300]}") from None
        if os.path.exists(name_or_path):
            raise
        why = "HF_HUB_OFFLINE is set and the hub cache has no copy" if hub_offline() else type(error).__name__
        raise UsageError(
            f"{flag} {name_or_path} is not a local folder and not reachable on the hub ({why}); without network "
            "pass a local directory saved with save_pretrained."
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
    set_chat_template(tokenizer, chat_template_path, MODEL_FLAGS.trust_remote_code)
    return tokenizer


def say_once(line: str) -> None:
    """Print `line` on the run's first process only (the accelerator may not exist yet)."""
    if main_process():
        print(line, flush=True)


def cut_from_left(
    splits: list[list[list[int]] | None], room: int
) -> tuple[list[list[list[int]] | None], int]:
    """Each prompt (a list of ids) of each split with only its last `room` tokens, as tokenize_prompts keeps
    them (a split of None stays None); and how many prompts were longer than `room`."""
    cut = sum(len(p) > room for prompts in splits if prompts for p in prompts)
    return [None if prompts is None else [p[-room:] for p in prompts] for prompts in splits], cut


def cut_prompts(splits: list[list[list[int]] | None], max_prompt_length: int | None) -> list:
    """The prompt ids of every split with only their last `max_prompt_length` tokens (None: whole, as TRL 1.16),
    in one line saying how many were cut."""
    if max_prompt_length is None:
        return splits
    splits, cut = cut_from_left(splits, max_prompt_length)
    total = sum(len(prompts) for prompts in splits if prompts)
    say_once(f"--max_prompt_length {max_prompt_length}: {cut} of {total} prompts cut from the left to fit")
    return splits


def _context(args=None):
    """utils/context.py, which checks sequences against the model's positions: --context_overflow cut needs
    it; otherwise None when this copy lacks it, and the flags are trusted to fit."""
    if getattr(args, "context_overflow", None) == "cut":
        return optional_module("utils.context", "--context_overflow cut")
    return extra_module("utils.context")


def check_context_length(
    name_or_path: str, length: int, flags: str, flag: str = "--model_name_or_path"
) -> None:
    """UsageError naming `flags` when sequences of `length` tokens exceed the model's positions
    (utils/context.py; without it, trusted). Reads the config only: call it before loading."""
    context = _context()
    if context is not None:
        context.check_context_length(name_or_path, length, flags, flag)


def fit_max_length(args, flag: str = "--model_name_or_path") -> None:
    """Under --context_overflow cut, lower `args.max_length` (and `args.max_prompt_length`) to the positions
    of `args.model_name_or_path` (utils/context.py). Reads the config only."""
    context = _context(args)
    if context is not None:
        context.fit_max_length(args, flag)


def fit_prompts(
    splits: list[list[list[int]] | None],
    args,
    completion: str,
    model: str,
    flag: str,
    completion_flag: str = "",
) -> list:
    """The prompt ids of every split, each prompt with `args.<completion>` tokens fitting the positions of
    `model`: refused, or cut from the left under --context_overflow cut (utils/context.py; without it, as
    they are)."""
    context = _context(args)
    if context is None:
        return splits
    return context.fit_prompts(splits, args, completion, model, flag, completion_flag)
