"""Reward models that read text, not the policy's ids (docs/reward_tokenizers.md). Optional:
utils.scoring.RewardScorer imports it only when it must: a reward model with another tokenizer than the
policy's, a conversation rendered by the reward tokenizer's chat template, or a row with ids past the reward
model's vocabulary. The policy's tokenizer decodes, the reward model's encodes (+ EOS when the policy
finished), cut from the left to its length."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from utils.generation import lengths_to_mask, pad
from utils.reward_model import batched_score, last_token_indices
from utils.run import UsageError

UNBOUNDED_LENGTH = 1_000_000  # tokenizers without a limit report about 1e30


def first_id(*ids: int | None) -> int:
    """The first set one of `ids` (else 0)."""
    return next((i for i in ids if i is not None), 0)


def reward_max_length(reward_model: nn.Module, reward_tokenizer) -> int | None:
    """The longest sequence the reward model takes (positions, tokenizer), or None."""
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
    """(reward-model ids of prompt + completion, whether cut from the left to `max_length`).

    Messages with a chat template: the conversation rendered whole. Else ids(prompt) + ids(completion)
    + [EOS], the EOS only when the policy `finished` and it is not there yet."""
    if not isinstance(prompt, str) and getattr(reward_tokenizer, "chat_template", None):
        messages = [*prompt, {"role": "assistant", "content": completion}]
        text = reward_tokenizer.apply_chat_template(messages, tokenize=False)
        ids = reward_tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if not isinstance(prompt, str):  # no template: the contents, one per line
            prompt = "\n".join(m["content"] for m in prompt)
        ids = reward_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = reward_tokenizer(completion, add_special_tokens=False)["input_ids"]
        eos = reward_tokenizer.eos_token_id
        if finished and eos is not None and not (completion_ids and completion_ids[-1] == eos):
            completion_ids = completion_ids + [eos]
        ids = ids + completion_ids
    if not ids:  # empty text, no EOS: score one neutral token
        ids = [first_id(reward_tokenizer.unk_token_id, reward_tokenizer.pad_token_id)]
    cut = max_length is not None and len(ids) > max_length
    return (ids[-max_length:] if cut else ids), cut


def texts(policy_tokenizer, query_responses: torch.Tensor, attention_mask: torch.Tensor, context_length: int):
    """(prompts, completions, finished) decoded by the policy's tokenizer; finished: ends with its EOS."""
    last = last_token_indices(attention_mask)
    eos = policy_tokenizer.eos_token_id
    finished = (query_responses.gather(1, last[:, None]).squeeze(1) == eos) & (last >= context_length)
    mask = attention_mask.bool() & (query_responses < len(policy_tokenizer))
    decode = lambda ids: policy_tokenizer.decode(  # noqa: E731
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    rows = list(zip(query_responses.tolist(), mask.tolist()))
    prompts = [decode([t for t, m in zip(r[:context_length], k[:context_length]) if m]) for r, k in rows]
    completions = [decode([t for t, m in zip(r[context_length:], k[context_length:]) if m]) for r, k in rows]
    return prompts, completions, finished.tolist()


def encode(
    scorer,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    prompts: Sequence | None = None,
) -> list[list[int]]:
    """The reward model's ids of every row of a utils.scoring.RewardScorer; `prompts` replaces the decoded
    prompts. Rows cut to the reward model's length are counted in scorer.num_truncated."""
    decoded_prompts, completions, finished = texts(
        scorer.policy_tokenizer, query_responses, attention_mask, context_length
    )
    prompts = decoded_prompts if prompts is None else list(prompts)
    if len(prompts) != len(completions):
        raise UsageError(f"got {len(prompts)} prompts for {len(completions)} rows to score.")
    max_length = scorer.max_length or reward_max_length(scorer.reward_model, scorer.reward_tokenizer)
    rows = []
    for prompt, completion, done in zip(prompts, completions, finished):
        ids, cut = encode_for_reward(scorer.reward_tokenizer, prompt, completion, max_length, done)
        scorer.num_truncated += cut
        rows.append(ids)
    return rows


def score_encoded(scorer, rows: list[list[int]], chunk_size: int, device: torch.device) -> torch.Tensor:
    """Scores [B] of the reward model's id rows (from `encode`), right-padded, in chunks of `chunk_size`."""
    pad_id = first_id(scorer.reward_tokenizer.pad_token_id, scorer.reward_tokenizer.eos_token_id)
    ids = pad(rows, pad_id, "right").to(device)  # masks from lengths
    mask = lengths_to_mask(torch.tensor([len(r) for r in rows], device=ids.device), ids.size(1))
    return batched_score(scorer.reward_model, ids, mask.long(), chunk_size)
