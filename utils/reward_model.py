"""A reward model's score: the one-label score head at every token (a critic's values), at each row's last real
token, in chunks. reward.py trains such a model; the RL scripts read it (utils/scoring.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from utils.generation import position_ids_from_mask
from utils.run import UsageError


def score_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone, head) of a one-label sequence classifier, to score every token."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a LoRA model (peft)
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if backbone is None or head is None:
        raise UsageError(
            f"{type(model).__name__} has no backbone + `score` head; load it as a sequence classifier."
        )
    if getattr(head, "out_features", 1) != 1:
        raise UsageError(
            f"the reward model has {head.out_features} labels; it must have exactly one (num_labels=1)."
        )
    return backbone, head


def per_token_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head at every position: [B, T]; a head without bias adds `config.score_bias` (reward.py)."""
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
    """Index [B] of the last position where `attention_mask` [B, T] is set."""
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(1)


def get_score(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A reward model's score [B] at each row's last real token (any padding side)."""
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
