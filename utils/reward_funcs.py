"""Reward functions, TRL's contract: `path/to/file.py:function` or `module.function`, plain or `async def`, called
by keyword with the prompts, completions, completion_ids, the dataset's other columns, trainer_state, log_extra
and log_metric; one float (or None: not scored) per completion.

Optional: imported only when a flag names a reward function (`--reward_funcs`, `--reward_fn`); a copy that scores
with a reward model alone does not need it."""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

import torch

from utils import data
from utils.run import UsageError
from utils.scoring import TrainerState

TRL_BUILTIN_REWARDS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)


def import_failure(spec: str, error: BaseException, flag: str = "--reward_fn") -> str | None:
    """A sentence naming the file, line and error of a failed import of the user's code, or None."""
    if isinstance(error, SyntaxError):
        return f"{flag} {spec}: {error.filename} line {error.lineno} has a SyntaxError ({error.msg})."
    internal = (os.path.dirname(importlib.__file__), os.path.abspath(__file__))
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith("<") and not os.path.abspath(frame.filename).startswith(internal)
    ]
    if not frames:
        return None
    message = (str(error).strip().splitlines() or [""])[0]
    detail = f"{type(error).__name__} ({message})" if message else type(error).__name__
    return (
        f"{flag} {spec}: {frames[0].filename} line {frames[0].lineno} raised {detail} while being imported."
    )


def load_function(spec: str, flag: str = "--reward_fn") -> Callable:
    """The callable of `path/to/file.py:name` or `module.name` (from the working directory). A file runs once per
    process, whichever flags name it: its reward functions, tools and rollout_func share one module's state."""
    path, sep, name = spec.rpartition(":")
    if not sep and "." in spec.strip(".") and "/" not in spec and not spec.endswith(".py"):
        module_name, _, name = spec.rpartition(".")
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - any failure of the user's module becomes one sentence
            sentence = import_failure(spec, error, flag)
            raise UsageError(
                sentence or f"{flag} {spec}: module {module_name!r} cannot be imported ({error})."
            ) from None
        finally:
            sys.path.pop(0)
        if not callable(getattr(module, name, None)):
            raise UsageError(f"{flag} {spec}: module {module_name!r} defines no function named {name!r}.")
        return getattr(module, name)
    if not sep or not path or not name:
        raise UsageError(f"{flag} must look like path/to/file.py:function or module.function, got {spec!r}.")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} file {path} does not exist.")
    module_name = "user_" + os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(module_name)
    if module is None or os.path.abspath(getattr(module, "__file__", "")) != os.path.abspath(path):
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look it up there
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - any failure of the user's file becomes one sentence
            del sys.modules[module_name]
            sentence = (
                import_failure(spec, error, flag) or f"{flag} {spec}: {path} cannot be imported ({error})."
            )
            raise UsageError(sentence) from None
    if not callable(getattr(module, name, None)):
        raise UsageError(f"{flag} file {path} defines no function named {name!r}.")
    return getattr(module, name)


def load_reward_fn(spec: str, columns: Sequence[str] | None = None) -> Callable:
    """A reward function from `path/to/file.py:function` or `module.function` (load_function); with the dataset's
    `columns`, one whose required parameters are not all passed is refused."""
    if ":" not in spec and spec in TRL_BUILTIN_REWARDS:
        raise UsageError(
            f"--reward_fn {spec} is one of TRL's built-in rewards, which are not shipped here; pass your own "
            "as path/to/file.py:function or module.function."
        )
    return check_reward_fn(load_function(spec), spec, columns)


def discard(*_args) -> None:
    """A log_extra / log_metric that keeps nothing."""


REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
COMPLETION_MESSAGES = "completion messages"  # a column of a multi-turn rollout's messages (utils/tools.py)
NOT_PASSED_COLUMNS = ("prompt", "completion", "completion_ids", COMPLETION_MESSAGES)  # TRL passes every other


def check_reward_fn(fn: Callable, spec: str, columns: Sequence[str] | None = None) -> Callable:
    """`fn`, or a UsageError when a parameter it requires is none of TRL's keywords and dataset `columns`."""
    if fn is None or columns is None:
        return fn
    offered = {*REWARD_KEYWORDS, *(c for c in columns if c not in NOT_PASSED_COLUMNS)}
    for parameter in inspect.signature(fn).parameters.values():
        required = parameter.default is inspect.Parameter.empty
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            raise UsageError(
                f"--reward_fn {spec}: parameter {parameter.name!r} is positional-only; reward functions are "
                f"called by keyword, as in TRL ({', '.join(REWARD_KEYWORDS)} and the dataset's columns)."
            )
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if required and parameter.name not in offered:
            raise UsageError(
                f"--reward_fn {spec}: parameter {parameter.name!r} is none of what a reward function gets "
                f"({', '.join(REWARD_KEYWORDS)} and the dataset's columns, here: {', '.join(columns) or 'none'})."
            )
    return fn


def is_async(fn: Callable) -> bool:
    """Whether calling `fn` gives a coroutine: an `async def` function, a partial of one, or an object whose
    `__call__` is one (what TRL checks)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


_EVENT_LOOP: asyncio.AbstractEventLoop | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """One event loop on a daemon thread for every async reward function, kept between calls as TRL keeps its
    own (a client a function made in an earlier call stays on its loop)."""
    global _EVENT_LOOP
    if _EVENT_LOOP is None:
        _EVENT_LOOP = asyncio.new_event_loop()
        threading.Thread(target=_EVENT_LOOP.run_forever, daemon=True).start()
    return _EVENT_LOOP


def decoded_rows(query_responses: torch.Tensor, attention_mask: torch.Tensor, context_length: int, tokenizer):
    """(prompts, completions, completion_ids) of query+response rows: texts without special tokens, ids with
    the stop token."""
    mask = attention_mask.bool()
    prompts = [
        tokenizer.decode(q[m], skip_special_tokens=True)
        for q, m in zip(query_responses[:, :context_length], mask[:, :context_length])
    ]
    completion_ids = [
        r[m].tolist() for r, m in zip(query_responses[:, context_length:], mask[:, context_length:])
    ]
    completions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    return prompts, completions, completion_ids


def score_decoded(fn, query_responses, attention_mask, context_length, tokenizer, columns=None, **kwargs):
    """Scores [B] of query+response rows from the reward function `fn` on their decoded texts (call_reward_fn),
    on the rows' device."""
    prompts, completions, completion_ids = decoded_rows(
        query_responses, attention_mask, context_length, tokenizer
    )
    scores = call_reward_fn(fn, prompts, completions, columns, completion_ids=completion_ids, **kwargs)
    return scores.to(query_responses.device)


def call_reward_fn(
    fn: Callable,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list] | None = None,
    completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerState | None = None,
    log_extra: Callable[[str, list], None] = discard,
    log_metric: Callable[[str, float], None] = discard,
) -> torch.Tensor:
    """Call a reward function by keyword, one value per completion: [B] float32; None becomes NaN (as TRL): a
    stop. An `async def` one runs on `event_loop()`.

    The keywords are TRL 1.16's (the dataset's prompts, assistant messages as completions for conversations,
    completion_ids, the other `columns`, trainer_state, log_extra, log_metric): all of them for a function with
    **kwargs, else those its signature names (check_reward_fn refuses one it requires and does not get)."""
    columns = columns or {}
    raw_prompts = columns.get("prompt")
    if raw_prompts:  # the dataset's prompts, not their decoded (maybe truncated) tokens
        prompts = list(raw_prompts)
        if data.is_conversation(raw_prompts[0]):  # multi-turn rollouts bring their turns and tool messages
            completions = columns.get(COMPLETION_MESSAGES) or [
                [{"role": "assistant", "content": c}] for c in completions
            ]
    keywords = {k: v for k, v in columns.items() if k not in NOT_PASSED_COLUMNS}
    keywords.update(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        trainer_state=trainer_state,
        log_extra=log_extra,
        log_metric=log_metric,
    )
    parameters = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        check_reward_fn(fn, getattr(fn, "__name__", "reward function"), list(columns))
        keywords = {p.name: keywords[p.name] for p in parameters if p.name in keywords}
    values = fn(**keywords)
    if inspect.isawaitable(values):
        values = asyncio.run_coroutine_threadsafe(values, event_loop()).result()
    values = list(values)
    if len(values) != len(completions):
        raise UsageError(
            f"the reward function returned {len(values)} values for {len(completions)} completions."
        )
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
