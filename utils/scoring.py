"""Scoring: a reward model's score at the last real token (or at every token: a critic's values), reward
functions (`path.py:function`, plain or TRL-style), and `RewardScorer` for truncated query + response rows:

    scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
    scores = scorer(query_responses, attention_mask, context_length, chunk_size, prompts=raw_prompts)  # [B]

A reward model reads, first that applies: conversations rendered whole by its tokenizer's chat template (as
utils.examples.reward_ids trains); the policy's ids when the tokenizers match; else the text re-encoded with its
tokenizer (+ EOS when the policy finished), cut from the left to its length. What reads text is in the
optional utils/reward_tokenizer.py, imported only on those paths."""

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
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn

from utils import data
from utils.loading import disable_dropout, from_pretrained
from utils.reward_model import batched_score, score_head
from utils.run import optional_module


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


def compute_scores(
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    tokenizer,
    chunk_size: int,
    reward_model: nn.Module | None = None,
    reward_fn: Callable | None = None,
    columns: dict[str, list] | None = None,
    **reward_kwargs,
) -> torch.Tensor:
    """Scores [B] of query+response rows: the reward model's, or the reward function's on the texts."""
    if reward_fn is None:
        return batched_score(reward_model, query_responses, attention_mask, chunk_size)
    prompts, completions, completion_ids = decoded_rows(
        query_responses, attention_mask, context_length, tokenizer
    )
    scores = call_reward_fn(
        reward_fn, prompts, completions, columns, completion_ids=completion_ids, **reward_kwargs
    )
    return scores.to(query_responses.device)


# ----------------------------------------------------------------------------------------------------------------
# Reward functions: `path/to/file.py:function` or `module.function`, plain or TRL-style
# ----------------------------------------------------------------------------------------------------------------
TRL_BUILTIN_REWARDS = (
    "accuracy_reward",
    "reasoning_accuracy_reward",
    "think_format_reward",
    "get_soft_overlong_punishment",
)


@dataclass
class TrainerState:
    """The `trainer_state` a TRL-style reward function gets (transformers' field names)."""

    global_step: int = 0
    """updates done so far"""
    max_steps: int = 0
    """updates the run will do in all"""
    epoch: float = 0.0
    """passes over the prompts so far (fractional)"""


def import_failure(spec: str, error: BaseException) -> str | None:
    """A sentence naming the file, line and error of a failed reward-function import, or None."""
    if isinstance(error, SyntaxError):
        return f"--reward_fn {spec}: {error.filename} line {error.lineno} has a SyntaxError ({error.msg})."
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
    return f"--reward_fn {spec}: {frames[0].filename} line {frames[0].lineno} raised {detail} while being imported."


def load_reward_fn(spec: str, columns: Sequence[str] | None = None) -> Callable:
    """A reward function from `path/to/file.py:function` or `module.function` (from the working directory);
    with the dataset's `columns`, one whose required parameters are not all passed is refused."""
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
        except Exception as error:  # noqa: BLE001 - any failure of the user's module becomes one sentence
            sentence = import_failure(spec, error)
            raise ValueError(
                sentence or f"--reward_fn {spec}: module {module_name!r} cannot be imported ({error})."
            ) from None
        finally:
            sys.path.pop(0)
        if not callable(getattr(module, name, None)):
            raise ValueError(
                f"--reward_fn {spec}: module {module_name!r} defines no function named {name!r}."
            )
        return check_reward_fn(getattr(module, name), spec, columns)
    if not sep or not path or not name:
        raise ValueError(
            f"--reward_fn must look like path/to/file.py:function or module.function, got {spec!r}."
        )
    if not os.path.isfile(path):
        raise ValueError(f"--reward_fn file {path} does not exist.")

    module_name = "reward_fn_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look it up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - any failure of the user's file becomes one sentence
        del sys.modules[module_name]
        sentence = import_failure(spec, error) or f"--reward_fn {spec}: {path} cannot be imported ({error})."
        raise ValueError(sentence) from None
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--reward_fn file {path} defines no function named {name!r}.")
    return check_reward_fn(getattr(module, name), spec, columns)


def discard(*_args) -> None:
    """A log_extra / log_metric that keeps nothing."""


REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
COMPLETION_MESSAGES = "completion messages"  # a column of a multi-turn rollout's messages (utils/tools.py)
NOT_PASSED_COLUMNS = ("prompt", "completion", "completion_ids", COMPLETION_MESSAGES)  # TRL passes every other


def check_reward_fn(fn: Callable, spec: str, columns: Sequence[str] | None = None) -> Callable:
    """`fn`, or a ValueError when a parameter it requires is none of TRL's keywords and dataset `columns`."""
    if fn is None or columns is None:
        return fn
    offered = {*REWARD_KEYWORDS, *(c for c in columns if c not in NOT_PASSED_COLUMNS)}
    for parameter in inspect.signature(fn).parameters.values():
        required = parameter.default is inspect.Parameter.empty
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY and required:
            raise ValueError(
                f"--reward_fn {spec}: parameter {parameter.name!r} is positional-only; reward functions are "
                f"called by keyword, as in TRL ({', '.join(REWARD_KEYWORDS)} and the dataset's columns)."
            )
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if required and parameter.name not in offered:
            raise ValueError(
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
        raise ValueError(
            f"the reward function returned {len(values)} values for {len(completions)} completions."
        )
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


def score_rows(scorers, query_responses, mask, context_length, chunk, **kwargs) -> torch.Tensor:
    """Rewards [B, F] of the rows, one column per scorer; async reward functions wait for their answers together,
    as TRL gathers them."""
    waiting = [scorer for scorer in scorers if scorer.reward_fn is not None and is_async(scorer.reward_fn)]
    with ThreadPoolExecutor(max_workers=max(1, len(waiting))) as pool:
        futures = {
            id(s): pool.submit(s, query_responses, mask, context_length, chunk, **kwargs) for s in waiting
        }
        scores = [
            futures[id(s)].result()
            if id(s) in futures
            else s(query_responses, mask, context_length, chunk, **kwargs)
            for s in scorers
        ]
    return torch.stack(scores, 1)


# ----------------------------------------------------------------------------------------------------------------
# Loading a reward model
# ----------------------------------------------------------------------------------------------------------------
def load_reward_model(name_or_path: str, flag: str = "--reward_model_path") -> nn.Module:
    """A one-label sequence classifier with a trained score head, dropout off; a causal LM is refused."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # a missing head is said below in one line, not in a load report
    try:
        model, info = from_pretrained(
            AutoModelForSequenceClassification, name_or_path, flag, output_loading_info=True
        )
    finally:
        transformers_logging.set_verbosity(verbosity)
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


# ----------------------------------------------------------------------------------------------------------------
# Different tokenizers: the policy's ids when they match, else utils/reward_tokenizer.py reads the text
# ----------------------------------------------------------------------------------------------------------------
def same_tokenizer(a, b) -> bool:
    """True when `a` and `b` give the same ids: same vocabulary, EOS, BOS and UNK (pad is never read)."""
    if a is b:
        return True
    specials = [(t.eos_token_id, t.bos_token_id, t.unk_token_id) for t in (a, b)]
    return specials[0] == specials[1] and a.get_vocab() == b.get_vocab()


def load_reward_tokenizer(reward_tokenizer_path: str | None, reward_model_path: str | None):
    """The reward model's tokenizer (`--reward_tokenizer_path`, else its folder's); None without a model."""
    from transformers import AutoTokenizer

    if reward_model_path is None:
        return None
    path = reward_tokenizer_path or reward_model_path
    flag = "--reward_tokenizer_path" if reward_tokenizer_path else "--reward_model_path"
    return from_pretrained(AutoTokenizer, path, flag)


class RewardScorer:
    """Scores [B] of query + response rows from a reward model or function (module docstring)."""

    def __init__(
        self,
        reward_model: nn.Module | None,
        reward_tokenizer,
        policy_tokenizer,
        reward_fn: Callable | None = None,
        max_length: int | None = None,
    ):
        if (reward_model is None) == (reward_fn is None):
            raise ValueError("pass exactly one of a reward model and a reward function.")
        self.reward_model, self.reward_fn = reward_model, reward_fn
        self.policy_tokenizer = policy_tokenizer
        self.reward_tokenizer = reward_tokenizer if reward_tokenizer is not None else policy_tokenizer
        self.same_tokenizer = reward_fn is not None or same_tokenizer(policy_tokenizer, self.reward_tokenizer)
        self.max_length = max_length  # None: the reward model's own (utils/reward_tokenizer.py)
        self.vocab_rows = None  # larger ids must never reach the reward model's embedding
        if reward_model is not None:
            bare = getattr(reward_model, "module", reward_model)
            embeddings = bare.get_input_embeddings() if hasattr(bare, "get_input_embeddings") else None
            self.vocab_rows = getattr(embeddings, "num_embeddings", None) or bare.config.vocab_size
        if reward_model is not None and not self.same_tokenizer:  # before training, in a copy without it
            text = self.reading_text("a reward model with another tokenizer than the policy's")
            self.max_length = max_length or text.reward_max_length(reward_model, self.reward_tokenizer)
        self.num_truncated = 0
        self.logged_metrics: dict[str, list[float]] = defaultdict(list)
        self.logged_extra: dict[str, list] = defaultdict(list)

    def describe(self) -> str:
        """One line: which path scores."""
        if self.reward_fn is not None:
            return "scores: the reward function, on the decoded prompts and completions"
        has_template = getattr(self.reward_tokenizer, "chat_template", None)
        template = "; conversational prompts go through its chat template" if has_template else ""
        if self.same_tokenizer:
            return (
                "scores: the reward model shares the policy's tokenizer; it reads the policy's token ids"
                + template
            )
        limit = f", cut from the left to {self.max_length} tokens" if self.max_length else ""
        return (
            "scores: the reward model has its own tokenizer; completions are decoded and encoded again with it"
            + limit
            + template
        )

    def take_num_truncated(self) -> int:
        """Rows cut to the reward model's length since the last call."""
        count, self.num_truncated = self.num_truncated, 0
        return count

    def log_metric(self, name: str, value: float) -> None:
        """The `log_metric` a TRL-style reward function calls."""
        self.logged_metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """The `log_extra` a TRL-style reward function calls (a sample-table column)."""
        self.logged_extra[column].extend(values)

    def take_logged(self) -> dict[str, float]:
        """The mean of each log_metric scalar since the last call."""
        logged, self.logged_metrics = self.logged_metrics, defaultdict(list)
        return {name: sum(values) / len(values) for name, values in logged.items() if values}

    def take_extra(self) -> dict[str, list]:
        """The log_extra columns since the last call."""
        extra, self.logged_extra = self.logged_extra, defaultdict(list)
        return dict(extra)

    def renders_conversations(self, prompts: Sequence | None) -> bool:
        """True for message prompts and a reward tokenizer with a chat template."""
        return (
            self.reward_model is not None
            and bool(prompts)
            and data.is_conversation(prompts[0])
            and bool(getattr(self.reward_tokenizer, "chat_template", None))
        )

    def encode(
        self,
        query_responses: torch.Tensor,
        attention_mask: torch.Tensor,
        context_length: int,
        prompts: Sequence | None = None,
        why: str = "a reward model reading text",
    ) -> list[list[int]]:
        """The reward model's ids of every row; `prompts` replaces the decoded prompts."""
        text = self.reading_text(why)
        return text.encode(self, query_responses, attention_mask, context_length, prompts)

    @staticmethod
    def reading_text(why: str):
        """utils/reward_tokenizer.py, optional: `why` (a sentence's subject) says in a copy without it what
        needs it."""
        return optional_module("utils.reward_tokenizer", why)

    def __call__(
        self,
        query_responses: torch.Tensor,
        attention_mask: torch.Tensor,
        context_length: int,
        chunk_size: int,
        prompts: Sequence | None = None,
        columns: dict[str, list] | None = None,
        trainer_state: TrainerState | None = None,
    ) -> torch.Tensor:
        """Scores [B] of rows [B, T]: left-padded prompt, then the response cut after its stop token.

        prompts: each row's dataset prompt (else `columns["prompt"]`); columns, trainer_state: for a TRL-style
        reward function, whose reports wait in take_logged / take_extra."""
        if self.reward_fn is not None:
            columns = dict(columns or {})
            if prompts is not None:
                columns["prompt"] = list(prompts)
            return compute_scores(
                query_responses, attention_mask, context_length, self.policy_tokenizer, chunk_size,
                reward_fn=self.reward_fn, columns=columns, trainer_state=trainer_state,
                log_extra=self.log_extra, log_metric=self.log_metric,
            )  # fmt: skip
        raw_prompts = prompts if prompts is not None else (columns or {}).get("prompt")
        if self.renders_conversations(raw_prompts):
            why, prompts = "a conversation read through the reward model's chat template", raw_prompts
        elif self.same_tokenizer and (
            self.vocab_rows is None or int(query_responses.max()) < self.vocab_rows
        ):
            # the fast path: the policy's ids
            return batched_score(self.reward_model, query_responses, attention_mask, chunk_size)
        elif self.same_tokenizer:
            why = "a sampled id past the reward model's vocabulary"
        else:
            why = "a reward model with another tokenizer than the policy's"
        rows = self.encode(query_responses, attention_mask, context_length, prompts, why)
        return self.reading_text(why).score_encoded(self, rows, chunk_size, query_responses.device)
