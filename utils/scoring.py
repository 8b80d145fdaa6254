"""Scoring: a reward model's score at the last real token (or at every token: a critic's values), reward
functions (`path.py:function`, plain or TRL-style), and `RewardScorer` for truncated query + response rows:

    scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
    scores = scorer(query_responses, attention_mask, context_length, chunk_size, prompts=raw_prompts)  # [B]

A reward model reads, first that applies: conversations rendered whole by its tokenizer's chat template (as
utils.examples.reward_ids trains); the policy's ids when the tokenizers match; else the text re-encoded with its
tokenizer (+ EOS when the policy finished), cut from the left to its length. What reads text is in the
optional utils/reward_tokenizer.py, imported only on those paths."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn

from utils import data
from utils.loading import disable_dropout, from_pretrained
from utils.reward_model import batched_score, score_head
from utils.run import UsageError, optional_module


# ----------------------------------------------------------------------------------------------------------------
# Reward functions: loaded and called by utils/reward_funcs.py, optional (imported with --reward_funcs)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TrainerState:
    """The `trainer_state` a TRL-style reward function gets (transformers' field names)."""

    global_step: int = 0
    """updates done so far"""
    max_steps: int = 0
    """updates the run will do in all"""
    epoch: float = 0.0
    """passes over the prompts so far (fractional)"""


def reward_funcs():
    """utils/reward_funcs.py: a scorer with a reward function exists only when the flag loaded one with it."""
    return optional_module("utils.reward_funcs", "a reward function (--reward_funcs, --reward_fn)")


def score_rows(scorers, query_responses, mask, context_length, chunk, **kwargs) -> torch.Tensor:
    """Rewards [B, F] of the rows, one column per scorer; async reward functions wait for their answers together,
    as TRL gathers them."""
    waiting = [s for s in scorers if s.reward_fn is not None and reward_funcs().is_async(s.reward_fn)]
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
        raise UsageError(
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
            raise UsageError("pass exactly one of a reward model and a reward function.")
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
            return reward_funcs().score_decoded(
                self.reward_fn, query_responses, attention_mask, context_length, self.policy_tokenizer, columns,
                trainer_state=trainer_state, log_extra=self.log_extra, log_metric=self.log_metric,
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
