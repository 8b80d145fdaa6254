"""Padding, truncation and sampling. Shapes: B batch, Q query (prompt), R response, V vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from utils.run import UsageError, extra_module, inner_model, optional_module


# ----------------------------------------------------------------------------------------------------------------
# Padding and truncation
# ----------------------------------------------------------------------------------------------------------------
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions [B, T] counted over real tokens, as generation does for left padding."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def pad(
    sequences: Sequence[Sequence], pad_value, side: str = "right", width: int | None = None, dtype=torch.long
) -> torch.Tensor:
    """Lists as a tensor [B, width] (None: the longest list's length) of `dtype`, padded on `side`."""
    if side not in ("left", "right"):
        raise UsageError(f"side must be 'left' or 'right', got {side!r}.")
    width = max((len(s) for s in sequences), default=0) if width is None else width
    out = torch.full((len(sequences), width), pad_value, dtype=dtype)
    for i, seq in enumerate(sequences):
        if len(seq):
            row = torch.as_tensor(seq, dtype=dtype)
            if side == "right":
                out[i, : len(seq)] = row
            else:
                out[i, width - len(seq) :] = row
    return out


def left_pad(
    rows: Sequence[Sequence[int]], pad_token_id: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [B, Q] and mask [B, Q]; the mask comes from lengths (pad may be a real token)."""
    ids = pad(rows, pad_token_id, "left")
    mask = pad([[1] * len(r) for r in rows], 0, "left").bool()
    return ids.to(device), mask.to(device)


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index [B] of each row's first True in `bools` [B, T]; T when none."""
    width = bools.size(-1)
    positions = torch.arange(width, dtype=dtype, device=bools.device)
    return torch.where(bools, positions, torch.full_like(positions, width)).min(-1).values


def truncate_response(
    responses: torch.Tensor, stop_token_id: int | Sequence[int] | torch.Tensor | None, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [B, R] cut after their first stop token, any of `stop_token_id` (one id or several; pad
    after) -> (truncated [B, R], lengths [B]).

    Lengths count the stop token (R when none), so pad == stop is fine."""
    width = responses.size(1)
    if stop_token_id is None:
        return responses.clone(), torch.full((responses.size(0),), width, device=responses.device)
    stops = torch.as_tensor(stop_token_id, device=responses.device).flatten()
    lengths = (first_true_indices(torch.isin(responses, stops)) + 1).clamp(max=width)
    keep = torch.arange(width, device=responses.device)[None, :] < lengths[:, None]
    return torch.where(keep, responses, torch.full_like(responses, pad_token_id)), lengths


def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """The ids sampling stops at, as in TRL 1.16's GRPO, RLOO and online DPO: the tokenizer's EOS and every
    EOS id of the model's generation_config (a chat model's end-of-turn, say)."""
    config_ids = getattr(getattr(inner_model(model), "generation_config", None), "eos_token_id", None)
    config_ids = [config_ids] if isinstance(config_ids, int) else list(config_ids or [])
    return list(dict.fromkeys([tokenizer.eos_token_id, *config_ids]))


def lengths_to_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Boolean mask [B, width], True at the first `lengths[b]` positions of row b."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


# ----------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------
def keeps_last_logits(model: nn.Module) -> bool:
    """Whether the forward takes `logits_to_keep` (sampling needs the last position only)."""
    import inspect

    inner = inner_model(model)
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of `probs` [B, V] (non-negative, any total) -> ids [B, 1], as torch.multinomial.

    Inverse transform: the first index whose float64 cumsum exceeds u * total, u ~ U[0, 1) (docs/speed.md)."""
    cumulative = probs.cumsum(-1, dtype=torch.float64)
    u = torch.rand(probs.size(0), 1, dtype=torch.float64, device=probs.device, generator=generator)
    ids = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True)
    return ids.clamp_(max=probs.size(-1) - 1)


SAMPLING_KNOBS = (("top_k", 0), ("top_p", 1.0), ("min_p", None), ("repetition_penalty", 1.0))  # off, as TRL's


def sampling_knobs(args) -> dict:
    """The sampling flags given among SAMPLING_KNOBS and --generation_kwargs, checked by utils/sampling_knobs.py
    (optional: imported only when one is given); {} when none is."""
    given = [f"--{name}" for name, off in SAMPLING_KNOBS if getattr(args, name, off) != off]
    given += ["--generation_kwargs"] if getattr(args, "generation_kwargs", None) else []
    if not given:
        return {}
    return optional_module("utils.sampling_knobs", given[0]).read_knobs(args, dict(SAMPLING_KNOBS))


@torch.no_grad()
def generate(
    model: nn.Module,
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    chunk_size: int,
    generator: torch.Generator | None = None,
    **knobs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `response_length` tokens from softmax(logits / temperature) (greedy at 0) after `queries` [B, Q],
    the logits first shaped by `knobs` (top_k, top_p, min_p, repetition_penalty: utils/sampling_knobs.py) ->
    (query_responses [B, Q+R], logprobs [B, R] under logits / temperature, unshaped, as the training forward gives
    them); no stop at EOS."""
    all_tokens, all_logprobs = [], []
    last_only = {"logits_to_keep": 1} if keeps_last_logits(model) else {}
    if knobs:  # the optional module, imported only when a knob is given
        warp_logits = optional_module("utils.sampling_knobs", f"--{next(iter(knobs))}").warp_logits
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
                **last_only,
            )
            past = out.past_key_values
            logits = out.logits[:, -1].float()
            shaped = warp_logits(logits, tokens, temperature, **knobs) if knobs else logits
            if temperature > 0:
                logits = logits / temperature
                next_ids = sample_categorical((shaped if knobs else logits).softmax(-1), generator)
            else:
                next_ids = shaped.argmax(-1, keepdim=True)
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
    """Completions as the RL scripts sample them (greedy by default), cut after any EOS id (eos_token_ids):
    (responses, lengths)."""
    prompt_ids = fit_positions(model, prompt_ids, response_length)
    queries, query_mask = left_pad(prompt_ids, tokenizer.pad_token_id, next(model.parameters()).device)
    query_responses, _ = generate(
        model, queries, query_mask, response_length, temperature, chunk_size, generator
    )
    return truncate_response(
        query_responses[:, queries.size(1) :], eos_token_ids(model, tokenizer), tokenizer.pad_token_id
    )


def fit_positions(model: nn.Module, prompt_ids: Sequence[Sequence[int]], new_tokens: int) -> list:
    """`prompt_ids` cut from the left to fit the model's positions with `new_tokens` (utils/context.py's; a copy
    without it samples them whole)."""
    context = extra_module("utils.context")
    return context.fit_positions(model, prompt_ids, new_tokens) if context else list(prompt_ids)


def sampling_generator(seed: int, *key: int, device="cpu") -> torch.Generator:
    """A generator seeded by (seed, *key): keyed by what is sampled, 1 or N processes and a resume agree."""
    state = np.random.SeedSequence([seed, *key]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) % 2**63)


def query_response_rows(queries, query_mask, responses, response_mask, idx):
    """Rows `idx` (row i has prompt i % P of `queries` [P, Q]): (query_responses, attention_mask) [n, Q+R]."""
    prompt = idx % queries.size(0)
    return (
        torch.cat([queries[prompt], responses[idx]], 1),
        torch.cat([query_mask[prompt], response_mask[idx]], 1),
    )
