"""Rewards: reward models (a score at every token for a critic, at the last real token for a reward), loading one
(a trained one-label head, or a one-sentence refusal), reward functions (`path.py:function` or TRL-style with
**kwargs, called with TRL 1.16's keywords), and scores of sampled completions when the reward model needs other
ids than the policy's.

The RL scripts build one `RewardScorer` and call it on every batch of truncated query + response rows:

    scorer = utils.scoring.RewardScorer(reward_model, reward_tokenizer, tokenizer, reward_fn=reward_fn)
    scores = scorer(query_responses, attention_mask, context_length, chunk_size,
                    prompts=raw_prompts, columns=of_rows, trainer_state=state)    # [B]
    scorer.take_logged(), scorer.take_extra()    # what a reward function reported through log_metric, log_extra

A reward model scores by one of three paths:
- conversational prompts (message lists) and a reward tokenizer with a chat template: as TRL does, the prompt
  and the decoded completion (the assistant's turn) go through that template and the text is encoded with the
  reward model's tokenizer (no special tokens added; the template closes the turn, no EOS is added), whichever
  tokenizer the policy has;
- otherwise, when the reward model's tokenizer is the policy's (same vocabulary, same EOS/BOS/UNK;
  `same_tokenizer`): the policy's token ids go to the reward model as they are and the score is read at the
  last real token, the policy's EOS when it finished (as reward.py trains);
- otherwise (a Llama or Qwen reward model behind a Pythia policy; TRL's `reward_processing_classes`): each
  prompt and truncated completion is decoded with the policy's tokenizer and encoded again with the reward
  model's, following reward.py's convention (prompt tokens, completion tokens, then the reward tokenizer's EOS
  when the policy ended the completion with its own; no other special tokens).
Re-encoded rows longer than the reward model accepts are cut from the left and counted (`take_num_truncated`).
Policy ids are never fed to a model whose vocabulary does not hold them, so a smaller vocabulary cannot raise an
IndexError.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from utils import data
from utils.generation import lengths_to_mask, pad
from utils.loading import disable_dropout, from_pretrained
from utils.logprobs import position_ids_from_mask


# ----------------------------------------------------------------------------------------------------------------
# Reward models: a score at every token, at the last token, in batches
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


def decoded_rows(query_responses: torch.Tensor, attention_mask: torch.Tensor, context_length: int, tokenizer):
    """(prompts, completions, completion_ids) of truncated query+response rows: the texts of each row's real
    prompt and response tokens (special tokens dropped) and the response's real ids, its stop token included and
    no padding (what TRL hands a reward function as `completion_ids`)."""
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
    """Scores [B] of truncated query+response rows, from a reward model (read at the last real token) or from a
    reward function called on the decoded prompts and completions (the completion stops at its stop token) and,
    for a TRL-style function, the dataset `columns` of each row and `reward_kwargs` (trainer_state, log_extra,
    log_metric; see call_reward_fn)."""
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
    """The training progress a TRL-style reward function gets as `trainer_state`: the fields of transformers'
    TrainerState that reward shaping reads (e.g. a weight that grows with global_step / max_steps)."""

    global_step: int = 0
    """updates done so far"""
    max_steps: int = 0
    """updates the run will do in all"""
    epoch: float = 0.0
    """passes over the prompts so far (fractional)"""


def import_failure(spec: str, error: BaseException) -> str | None:
    """One sentence naming the file, the line and the error of a reward-function module that failed while
    being imported (a SyntaxError, or any exception its top level raised); None when no file of the user's was
    reached (the module itself was not found)."""
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


def load_reward_fn(spec: str) -> Callable:
    """Load a reward function (prompts: list[str], completions: list[str]) -> floats, or one TRL-style with
    **kwargs (see call_reward_fn), from `path/to/file.py:function` or, as TRL takes it, a dotted import path
    `module.function` (imported from the working directory). A file that fails to import (a syntax error, an
    exception at its top level) is named in one sentence with its line."""
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
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - any failure of the user's file becomes one sentence
        del sys.modules[module_name]
        sentence = import_failure(spec, error) or f"--reward_fn {spec}: {path} cannot be imported ({error})."
        raise ValueError(sentence) from None
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--reward_fn file {path} defines no function named {name!r}.")
    return getattr(module, name)


def discard(*_args) -> None:
    """A log_extra / log_metric for a caller that keeps nothing."""


def takes_kwargs(fn: Callable) -> bool:
    """True for a TRL-style reward function: one with a **kwargs parameter."""
    parameters = inspect.signature(fn).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


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
    """Call a reward function and check its answer: one value per completion. Returns [B] float32.

    A function with a `**kwargs` parameter is called as TRL 1.16 calls its reward functions, with the keywords
    `prompts` (the dataset's `prompt` column when given), `completions`, `completion_ids` (each completion's
    token ids, stop token included, no padding), every other column of the rows' dataset examples (`columns`,
    e.g. `solution`), `trainer_state`, `log_extra(column, values)` (a column of the sample table) and
    `log_metric(name, value)` (a scalar, averaged until the next log); when the prompts are conversations
    (message lists), each completion is one assistant message, [{"role": "assistant", "content": text}]. Any
    other function is called as fn(prompts, completions) on the texts. A None (no reward for that sample)
    becomes NaN, as in TRL; a NaN or an infinity is returned as it is: the training scripts stop on it with
    `utils.tracking.check_finite`, naming the update and the last good checkpoint."""
    if takes_kwargs(fn):
        extra = {
            k: v for k, v in (columns or {}).items() if k not in ("prompt", "completion", "completion_ids")
        }
        raw_prompts = (columns or {}).get("prompt")
        if raw_prompts:  # the dataset's own prompts, not their decoded (possibly left-truncated) tokens
            prompts = list(raw_prompts)
            if data.is_conversation(raw_prompts[0]):
                completions = [[{"role": "assistant", "content": c}] for c in completions]
        extra.update(trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric)
        values = list(fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **extra))
    else:
        values = list(fn(prompts, completions))
    if len(values) != len(completions):
        raise ValueError(
            f"the reward function returned {len(values)} values for {len(completions)} completions."
        )
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# Loading a reward model
# ----------------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------------
# Different tokenizers: decode with the policy's, encode with the reward model's
# ----------------------------------------------------------------------------------------------------------------
UNBOUNDED_LENGTH = 1_000_000  # tokenizers without a limit report model_max_length as about 1e30


def first_id(*ids: int | None) -> int:
    """The first of `ids` that is set (0 when none is): a filler token for padding or an empty text."""
    return next((i for i in ids if i is not None), 0)


def same_tokenizer(a, b) -> bool:
    """True when tokenizers `a` and `b` map text to the same ids: the same vocabulary (added tokens included)
    and the same EOS, BOS and UNK tokens. The pad token is left out: the scripts never read it (masks come from
    lengths) and set it to EOS when a tokenizer has none."""
    if a is b:
        return True
    specials = [(t.eos_token_id, t.bos_token_id, t.unk_token_id) for t in (a, b)]
    return specials[0] == specials[1] and a.get_vocab() == b.get_vocab()


def load_reward_tokenizer(reward_tokenizer_path: str | None, reward_model_path: str | None):
    """The reward model's tokenizer: from `--reward_tokenizer_path`, else from the reward model's own directory;
    None without a reward model."""
    from transformers import AutoTokenizer

    if reward_model_path is None:
        return None
    path = reward_tokenizer_path or reward_model_path
    flag = "--reward_tokenizer_path" if reward_tokenizer_path else "--reward_model_path"
    return from_pretrained(AutoTokenizer, path, flag)


def reward_max_length(reward_model: nn.Module, reward_tokenizer) -> int | None:
    """The longest sequence the reward model accepts: the smaller of its position limit and the tokenizer's
    model_max_length (None when neither says)."""
    config = getattr(getattr(reward_model, "module", reward_model), "config", None)
    limits = [
        getattr(config, "max_position_embeddings", None),
        getattr(reward_tokenizer, "model_max_length", None),
    ]
    limits = [int(n) for n in limits if isinstance(n, (int, float)) and 0 < n < UNBOUNDED_LENGTH]
    return min(limits) if limits else None


def encode_for_reward(
    reward_tokenizer, prompt, completion: str, max_length: int | None, finished: bool = True
) -> tuple[list[int], bool]:
    """Reward-model ids of one prompt + completion and whether they were cut from the left to `max_length`.

    prompt: text, or a list of {role, content} messages (conversational data). With messages and a chat template,
    the whole conversation (the completion as the assistant's turn) goes through the template. Otherwise, as in
    reward.py: ids(prompt) + ids(completion) + [EOS], the EOS added unless the completion already ends with it or
    is not `finished` (the policy did not end it with its own EOS: the reward model sees it unfinished too, as
    on the fast path)."""
    if not isinstance(prompt, str) and getattr(reward_tokenizer, "chat_template", None):
        messages = [*prompt, {"role": "assistant", "content": completion}]
        text = reward_tokenizer.apply_chat_template(messages, tokenize=False)
        ids = reward_tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if not isinstance(prompt, str):  # messages without a template: their contents, one per line
            prompt = "\n".join(m["content"] for m in prompt)
        ids = reward_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = reward_tokenizer(completion, add_special_tokens=False)["input_ids"]
        eos = reward_tokenizer.eos_token_id
        if finished and eos is not None and not (completion_ids and completion_ids[-1] == eos):
            completion_ids = completion_ids + [eos]
        ids = ids + completion_ids
    if not ids:  # an empty text under a tokenizer without EOS: score one neutral token rather than nothing
        ids = [first_id(reward_tokenizer.unk_token_id, reward_tokenizer.pad_token_id)]
    cut = max_length is not None and len(ids) > max_length
    return (ids[-max_length:] if cut else ids), cut


class RewardScorer:
    """Scores [B] of truncated query + response rows from a reward model (with its own tokenizer or the policy's)
    or from a reward function; see the module docstring for the two paths."""

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
        self.max_length = None
        self.vocab_rows = None  # rows of the reward model's embedding: larger ids must never reach it
        if reward_model is not None:
            self.max_length = max_length or reward_max_length(reward_model, self.reward_tokenizer)
            bare = getattr(reward_model, "module", reward_model)
            embeddings = bare.get_input_embeddings() if hasattr(bare, "get_input_embeddings") else None
            self.vocab_rows = getattr(embeddings, "num_embeddings", None) or bare.config.vocab_size
        self.num_truncated = 0
        self.logged_metrics: dict[str, list[float]] = defaultdict(list)
        self.logged_extra: dict[str, list] = defaultdict(list)

    def describe(self) -> str:
        """One line saying which path scores the completions."""
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
        """Rows cut from the left to the reward model's length since the last call (a metric), reset to 0."""
        count, self.num_truncated = self.num_truncated, 0
        return count

    def log_metric(self, name: str, value: float) -> None:
        """The `log_metric` a TRL-style reward function calls: one scalar for this batch."""
        self.logged_metrics[name].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """The `log_extra` a TRL-style reward function calls: a column of the sample table, one value per row."""
        self.logged_extra[column].extend(values)

    def take_logged(self) -> dict[str, float]:
        """The mean of each scalar the reward function reported through log_metric since the last call; reset."""
        logged, self.logged_metrics = self.logged_metrics, defaultdict(list)
        return {name: sum(values) / len(values) for name, values in logged.items() if values}

    def take_extra(self) -> dict[str, list]:
        """The columns the reward function reported through log_extra since the last call; reset."""
        extra, self.logged_extra = self.logged_extra, defaultdict(list)
        return dict(extra)

    def renders_conversations(self, prompts: Sequence | None) -> bool:
        """True when a reward model scores through its tokenizer's chat template, as TRL does: the prompts are
        message lists and that tokenizer has a template."""
        return (
            self.reward_model is not None
            and bool(prompts)
            and data.is_conversation(prompts[0])
            and bool(getattr(self.reward_tokenizer, "chat_template", None))
        )

    def texts(self, query_responses: torch.Tensor, attention_mask: torch.Tensor, context_length: int):
        """(prompts, completions, finished) decoded with the policy's tokenizer from the real tokens of each row
        (special tokens such as EOS and padding dropped; ids the policy's tokenizer does not hold are skipped);
        finished[b]: the completion's last real token is the policy's EOS."""
        last = last_token_indices(attention_mask)
        eos = self.policy_tokenizer.eos_token_id
        finished = (query_responses.gather(1, last[:, None]).squeeze(1) == eos) & (last >= context_length)
        mask = attention_mask.bool() & (query_responses < len(self.policy_tokenizer))
        decode = lambda ids: self.policy_tokenizer.decode(  # noqa: E731
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        rows = list(zip(query_responses.tolist(), mask.tolist()))
        prompts = [decode([t for t, m in zip(r[:context_length], k[:context_length]) if m]) for r, k in rows]
        completions = [
            decode([t for t, m in zip(r[context_length:], k[context_length:]) if m]) for r, k in rows
        ]
        return prompts, completions, finished.tolist()

    def encode(
        self,
        query_responses: torch.Tensor,
        attention_mask: torch.Tensor,
        context_length: int,
        prompts: Sequence | None = None,
    ) -> list[list[int]]:
        """The reward model's ids of every row (decode with the policy's tokenizer, encode with the reward
        model's); `prompts` (text or message lists, one per row) replaces the decoded prompts when given."""
        decoded_prompts, completions, finished = self.texts(query_responses, attention_mask, context_length)
        prompts = decoded_prompts if prompts is None else list(prompts)
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts for {len(completions)} rows to score.")
        rows = []
        for prompt, completion, done in zip(prompts, completions, finished):
            ids, cut = encode_for_reward(self.reward_tokenizer, prompt, completion, self.max_length, done)
            self.num_truncated += cut
            rows.append(ids)
        return rows

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
        """Scores [B] of rows [B, T] (left-padded prompt, then the response truncated after its stop token; the
        mask marks the real tokens).

        prompts: the dataset's raw prompt of each row (text or a list of messages; else `columns["prompt"]`).
        With a reward model, message lists go through the reward tokenizer's chat template with the completion
        as the assistant's turn (TRL's way), whichever tokenizer the policy has; text prompts replace the decoded
        ones on the path of a reward model with its own tokenizer. With a reward function, they are its
        `prompts`. columns: the dataset columns of each row and trainer_state, for a TRL-style reward function
        (call_reward_fn); what it reports through log_metric / log_extra waits in take_logged / take_extra."""
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
            rows = self.encode(query_responses, attention_mask, context_length, raw_prompts)
        elif self.same_tokenizer and (
            self.vocab_rows is None or int(query_responses.max()) < self.vocab_rows
        ):
            # the fast path: the policy's ids as they are
            return batched_score(self.reward_model, query_responses, attention_mask, chunk_size)
        else:
            rows = self.encode(query_responses, attention_mask, context_length, prompts)
        pad_id = first_id(self.reward_tokenizer.pad_token_id, self.reward_tokenizer.eos_token_id)
        ids = pad(rows, pad_id, "right").to(query_responses.device)  # masks come from the lengths
        mask = lengths_to_mask(torch.tensor([len(r) for r in rows], device=ids.device), ids.size(1))
        return batched_score(self.reward_model, ids, mask.long(), chunk_size)
