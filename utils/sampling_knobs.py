"""The sampling knobs of the RL scripts (optional: imported only when one is given): --top_k, --top_p, --min_p,
--repetition_penalty and --generation_kwargs, checked, and the logits they shape as transformers' `generate`
shapes them for TRL's sampler.

    knobs = utils.generation.sampling_knobs(args)   # {} when none is given; else this file's read_knobs
    logits = warp_logits(logits, seen_ids, temperature, **knobs)
"""

from __future__ import annotations

import json
import math

import torch

from utils.run import UsageError


def read_knobs(args, off: dict) -> dict:
    """The flags among `off` (name -> the value that leaves it off, utils.generation.SAMPLING_KNOBS) that shape
    sampling, --generation_kwargs (a JSON object of the same names) over them, those left off left out; a
    UsageError for a value out of range or another name."""
    knobs = {name: getattr(args, name, value) for name, value in off.items()}
    extra = getattr(args, "generation_kwargs", None)
    if extra:
        extra = json.loads(extra) if isinstance(extra, str) else extra
        unknown = sorted(set(extra) - set(off))
        if unknown:
            raise UsageError(f"--generation_kwargs takes {', '.join(off)} here, not {', '.join(unknown)}.")
        knobs.update(extra)
    if knobs["top_k"] < 0 or not 0 < knobs["top_p"] <= 1 or knobs["repetition_penalty"] <= 0:
        raise UsageError("--top_k must be >= 0, --top_p in (0, 1] and --repetition_penalty > 0.")
    if knobs["min_p"] is not None and not 0 <= knobs["min_p"] <= 1:
        raise UsageError(f"--min_p must be in [0, 1], got {knobs['min_p']}.")
    return {name: value for name, value in knobs.items() if value != off[name]}


def warp_logits(
    logits: torch.Tensor,
    seen_ids: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
) -> torch.Tensor:
    """The logits [B, V] sampling draws from, as transformers' `generate` (TRL's sampler) shapes them, in its
    order: every id of `seen_ids` [B, T] (prompt, padding, tokens so far) has its logit l turned into l / p
    (l > 0) or l * p (repetition penalty p); then / temperature (not at 0); then only the top_k highest
    (0: all), the smallest set of highest-probability ids whose probability sums to more than top_p, and the
    ids whose probability is at least min_p times the highest are kept, each keeping the most likely id; the
    others get -inf."""
    if repetition_penalty != 1.0:
        seen = logits.gather(1, seen_ids)
        logits = logits.scatter(
            1, seen_ids, torch.where(seen < 0, seen * repetition_penalty, seen / repetition_penalty)
        )
    if temperature > 0:
        logits = logits / temperature
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if top_k:
        drop |= logits < logits.topk(min(top_k, logits.size(-1)), -1).values[:, -1:]
        logits = logits.masked_fill(drop, -math.inf)
    if top_p < 1.0:
        ascending, order = logits.sort(-1)
        below = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        below[:, -1] = False  # the most likely id stays
        drop |= below.scatter(1, order, below)
        logits = logits.masked_fill(drop, -math.inf)
    if min_p is not None:
        probs = logits.softmax(-1)
        small = probs < min_p * probs.amax(-1, keepdim=True)
        drop |= small.scatter(1, probs.argmax(-1, keepdim=True), False)
    return logits.masked_fill(drop, -math.inf)
