"""Forward passes, logprobs of given tokens, entropies (the tiled LM head: the optional utils/lm_head.py).
Shapes: B batch, T sequence length, R response length, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from utils.generation import position_ids_from_mask
from utils.run import extra_module


# ----------------------------------------------------------------------------------------------------------------
# Forward passes
# ----------------------------------------------------------------------------------------------------------------
def forward(model: nn.Module, input_ids: torch.Tensor, attention_mask, position_ids=None, **kwargs):
    """Forward a causal LM on padded rows with matching position ids; or, given `position_ids` and no attention
    mask, on packed examples (positions from 0 in each), which the model keeps from attending to each other."""
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] at each position: logits [B, T, V], tokens [B, T] -> [B, T]."""
    return torch.gather(logits.float().log_softmax(-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy at each position: [B, T, V] -> [B, T]."""
    logits = logits.float()
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    temperature: float = 1.0,
    with_stats: bool = False,
    position_ids: torch.Tensor | None = None,
):
    """Logprobs [B, T-1]: entry t is log softmax(logits_t / temperature)[input_ids[:, t + 1]] where
    `score_mask` [B, T-1] is true, 0 elsewhere. `with_stats`: (logprobs, entropy, mean logit), each [B, T-1].
    The LM head sees scored positions only. `position_ids` with attention_mask None: packed rows (see forward)."""
    score_mask = score_mask.bool()
    targets = input_ids[:, 1:][score_mask]

    def run_forward():
        return forward(model, input_ids, attention_mask, position_ids)

    tiled = tiled_head()
    out = tiled and tiled.swapped_head_logprobs(
        model, run_forward, score_mask, targets, temperature, with_stats
    )
    if out is None:
        out = _plain_token_logprobs(run_forward, score_mask, targets, temperature, with_stats)
    return out


def tiled_head():
    """utils/lm_head.py when this copy has it: the LM head tile by tile on the scored positions, without the
    [B, T, V] logits (docs/memory.md); else None, and the logprobs come from the full logits."""
    return extra_module("utils.lm_head")


def scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token values [N] into zeros of the mask's shape, at its true entries."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def _plain_token_logprobs(run_forward, score_mask, targets, temperature, with_stats):
    """token_logprobs through the full logits [N, V]: the reference, and for heads the tiling cannot swap."""
    logits = run_forward().logits[:, :-1][score_mask].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    logprobs = scatter(logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), score_mask)
    if not with_stats:
        return logprobs
    with torch.no_grad():
        return (
            logprobs,
            scatter(entropy_from_logits(logits), score_mask),
            scatter(logits.mean(-1), score_mask),
        )


def response_logits(
    model: nn.Module,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float,
) -> torch.Tensor:
    """logits / temperature [B, R, V] predicting the response tokens, for an exact KL; logprobs alone come
    cheaper from response_logprobs."""
    logits = forward(model, query_responses, attention_mask).logits[:, context_length - 1 : -1].float()
    return logits / (temperature if temperature > 0 else 1.0)


def response_logprobs(
    model: nn.Module,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float,
    with_stats: bool = False,
):
    """Logprobs [B, R] of the response tokens (positions context_length..T-1 of `query_responses` [B, T])
    under logits / temperature; `with_stats` adds entropy and mean logit [B, R]."""
    score_mask = torch.zeros_like(query_responses[:, 1:], dtype=torch.bool)
    score_mask[:, context_length - 1 :] = True
    out = token_logprobs(model, query_responses, attention_mask, score_mask, temperature, with_stats)
    if with_stats:
        return tuple(v[:, context_length - 1 :] for v in out)
    return out[:, context_length - 1 :]


@torch.no_grad()
def batched_response_logprobs(
    model: nn.Module,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    context_length: int,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """response_logprobs [B, R] in chunks of `chunk_size` rows, no gradient."""
    out = []
    for i in range(0, query_responses.size(0), chunk_size):
        qr, am = query_responses[i : i + chunk_size], attention_mask[i : i + chunk_size]
        out.append(response_logprobs(model, qr, am, context_length, temperature))
    return torch.cat(out)
