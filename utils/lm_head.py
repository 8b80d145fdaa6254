"""Plumbing, skippable on a first read: the LM head on the scored positions only, a tile at a time.
Optional: utils.logprobs.token_logprobs uses it when the file is there, else the full logits (as TRL does).

`utils.logprobs.token_logprobs` gets log softmax(logits / temperature)[target] here without building the
[B, T, V] logits; a tile's logits are recomputed in backward, so memory is one tile (docs/memory.md). A plain
nn.Linear is tiled over tokens and vocabulary, any other head (LoRA) over tokens only. The swapped head runs
in the model's own forward, so DDP, ZeRO-3, autocast and tied embeddings work unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from utils.logprobs import scatter
from utils.run import inner_model

LOGIT_TILE_ELEMENTS = 2**22
"""float32 logits in one tile at most on a CPU (docs/memory.md)"""
GPU_LOGIT_TILE_ELEMENTS = 2**24
"""the same on a GPU, where a pass of many small tiles waits on kernel launches (docs/speed_gpu.md)"""
TILE_TOKENS = 4096
"""tokens per tile of a linear head; its vocabulary slice is the tile's elements / tokens wide"""


class _LinearHeadLogprobs(torch.autograd.Function):
    """log softmax(z)[targets] with z = (hidden @ weight.T + bias) / temperature, never whole in memory.

    hidden [N, H], weight [V, H], bias [V] or None, targets [N] -> logprobs, entropy, mean logit [N] (the last
    two without gradient, zeros unless `with_stats`). Matmuls in `compute_dtype`, the rest in float32.
    Forward, per tile z of a row: m' = max(m, max z), l = l exp(m - m') + sum exp(z - m'); at the row's end
    lse = m + log l, logprob = z[target] - lse, entropy = lse - sum exp(z - m) z / l.
    Backward recomputes z; with q = softmax(z) - onehot(target) and g = -grad_logprobs / temperature:
    grad_hidden = g * (q @ W), grad_weight = q.T @ (g * h), grad_bias = q.T @ g."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temperature, compute_dtype, with_stats):
        count, vocab = hidden.size(0), weight.size(0)
        logprobs, entropy, mean_logit = (hidden.new_zeros(count, dtype=torch.float32) for _ in range(3))
        log_normalizer = torch.empty_like(logprobs)
        logits_buffer, exp_buffer = (_tile_buffer(hidden, count, vocab) for _ in range(2))
        for rows, cols in _tiles(count, vocab, hidden.device):
            if cols.start == 0:  # a new row of tiles: cast its hidden states once
                h = hidden[rows].to(compute_dtype)
                running_max = torch.full_like(logprobs[rows], float("-inf"))
                sum_exp, sum_exp_logit = torch.zeros_like(running_max), torch.zeros_like(running_max)
            logits = _tile_logits(h, weight, bias, cols, inv_temperature, compute_dtype, logits_buffer)
            new_max = torch.maximum(running_max, logits.max(-1).values)
            rescale = (running_max - new_max).exp()
            exp = torch.sub(logits, new_max[:, None], out=_tile_view(exp_buffer, *logits.shape)).exp_()
            sum_exp = sum_exp * rescale + exp.sum(-1)
            if with_stats:  # metrics only: two more passes over the tile
                sum_exp_logit = sum_exp_logit * rescale + exp.mul_(logits).sum(-1)
                mean_logit[rows] += logits.sum(-1) / vocab
            running_max = new_max
            in_tile = (targets[rows] >= cols.start) & (targets[rows] < cols.stop)
            local = (targets[rows] - cols.start).clamp(0, logits.size(1) - 1)
            logprobs[rows] += torch.where(in_tile, logits.gather(1, local[:, None]).squeeze(1), 0.0)
            if cols.stop == vocab:
                log_normalizer[rows] = running_max + sum_exp.log()
                if with_stats:
                    entropy[rows] = log_normalizer[rows] - sum_exp_logit / sum_exp
        logprobs -= log_normalizer
        ctx.save_for_backward(hidden, weight, bias, targets, log_normalizer)
        ctx.inv_temperature, ctx.compute_dtype = inv_temperature, compute_dtype
        ctx.mark_non_differentiable(entropy, mean_logit)
        return logprobs, entropy, mean_logit

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy, _grad_mean_logit):
        hidden, weight, bias, targets, log_normalizer = ctx.saved_tensors
        inv_temperature, compute_dtype = ctx.inv_temperature, ctx.compute_dtype
        scale = grad_logprobs.float() * -inv_temperature
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = (
            None if bias is None else torch.zeros(weight.size(0), dtype=torch.float32, device=weight.device)
        )
        logits_buffer = _tile_buffer(hidden, hidden.size(0), weight.size(0))
        for rows, cols in _tiles(hidden.size(0), weight.size(0), hidden.device):
            if cols.start == 0:  # a new row of tiles: cast (and scale) its hidden states once
                h = hidden[rows].to(compute_dtype)
                scaled_h = (hidden[rows].float() * scale[rows, None]).to(compute_dtype)
            logits = _tile_logits(h, weight, bias, cols, inv_temperature, compute_dtype, logits_buffer)
            q = logits.sub_(log_normalizer[rows, None]).exp_()
            local = targets[rows] - cols.start
            in_tile = (local >= 0) & (local < q.size(1))  # subtract the one-hot without a host sync
            q.scatter_add_(1, local.clamp(0, q.size(1) - 1)[:, None], -in_tile[:, None].float())
            q_compute = q.to(compute_dtype)
            grad_hidden[rows] += (q_compute @ weight[cols].to(compute_dtype)).float()
            grad_weight[cols] += (q_compute.T @ scaled_h).float()
            if grad_bias is not None:
                grad_bias[cols] += q.T @ scale[rows]
        grad_hidden *= scale[:, None]
        return (grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype),
                None if bias is None else grad_bias.to(bias.dtype), None, None, None, None)  # fmt: skip


def tile_elements(device: torch.device) -> int:
    """Logits one tile holds on `device`."""
    return LOGIT_TILE_ELEMENTS if device.type == "cpu" else GPU_LOGIT_TILE_ELEMENTS


def _tiles(count: int, vocab: int, device: torch.device):
    """(token slice, vocabulary slice) of every tile, vocabulary innermost."""
    tokens = max(1, min(count, TILE_TOKENS))
    width = max(1, tile_elements(device) // tokens)
    for start in range(0, count, tokens):
        for col in range(0, vocab, width):
            yield slice(start, start + tokens), slice(col, min(col + width, vocab))


def _tile_buffer(hidden: torch.Tensor, count: int, vocab: int) -> torch.Tensor:
    """float32 room for a pass's largest tile, reused by every tile."""
    rows, cols = next(_tiles(count, vocab, hidden.device), (slice(0, 0), slice(0, 0)))
    return hidden.new_empty(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.float32)


def _tile_view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The top-left [rows, cols] of `buffer`: a tile's room."""
    return buffer[:rows, :cols]


def _tile_logits(h, weight, bias, cols, inv_temperature, compute_dtype, buffer):
    """float32 logits / temperature [n, width] of one tile, in `buffer` (a _tile_buffer)."""
    out = _tile_view(buffer, h.size(0), cols.stop - cols.start)
    if compute_dtype == torch.float32:  # bias and temperature folded into the matmul
        shift, beta = (out, 0.0) if bias is None else (bias[cols], inv_temperature)
        return torch.addmm(shift, h, weight[cols].T, beta=beta, alpha=inv_temperature, out=out)
    logits = out.copy_(h @ weight[cols].to(compute_dtype).T)
    if bias is not None:
        logits.add_(bias[cols].float())
    return logits.mul_(inv_temperature) if inv_temperature != 1.0 else logits


def _tile_logprobs(head, hidden, targets, inv_temperature: float, with_stats: bool):
    """log softmax(head(hidden) / temperature)[targets] [n] of one tile; `with_stats` adds entropy and mean
    logit [n] (no gradient)."""
    logits = head(hidden).float() * inv_temperature
    log_normalizer = logits.logsumexp(-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_normalizer
    if not with_stats:
        return logprobs
    with torch.no_grad():
        probs = (logits - log_normalizer.unsqueeze(-1)).exp()
        entropy = log_normalizer - (probs * logits).sum(-1)
        return logprobs, entropy, logits.mean(-1)


def chunked_token_logprobs(
    head,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_stats: bool = False,
    vocab_size: int | None = None,
):
    """log softmax(head(hidden) / temperature)[targets], tile by tile: hidden [N, H], targets [N] -> [N].

    Gradients equal the plain computation's. `with_stats` adds entropy and mean logit [N] (no gradient).
    Temperature 0 (greedy) scores the plain logits."""
    inv_temperature = 1.0 / temperature if temperature > 0 else 1.0
    # not a subclass (a quantized layer) nor a wrapper (LoRA): its weight is the head
    if type(head) is nn.Linear:
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device) and hidden.is_floating_point()
        compute_dtype = torch.get_autocast_dtype(device) if autocast else head.weight.dtype
        out = _LinearHeadLogprobs.apply(
            hidden, head.weight, head.bias, targets, inv_temperature, compute_dtype, with_stats
        )
        return out if with_stats else out[0]
    if vocab_size is None:
        with torch.no_grad():
            vocab_size = head(hidden[:1]).size(-1) if hidden.size(0) else 1
    tile = max(1, tile_elements(hidden.device) // vocab_size)
    pieces = []
    for start in range(0, hidden.size(0), tile):
        rows = slice(start, start + tile)
        args = (head, hidden[rows], targets[rows], inv_temperature, with_stats)
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_tile_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_tile_logprobs(*args))
    if not pieces:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (empty, empty, empty) if with_stats else empty
    if with_stats:
        return tuple(torch.cat(p) for p in zip(*pieces))
    return torch.cat(pieces)


# Config fields that make the forward transform the head's output: such models are scored the plain way.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _head_of(model: nn.Module) -> nn.Module | None:
    """The LM head to swap, or None when this model must be scored the plain way."""
    inner = inner_model(model)
    config = getattr(inner, "config", None)
    if getattr(inner, "_plain_logprobs", False) or any(getattr(config, a, None) for a in _LOGIT_TRANSFORMS):
        return None
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    return head if isinstance(head, nn.Module) else None


def swapped_head_logprobs(model, run_forward, score_mask, targets, temperature, with_stats):
    """token_logprobs' values [B, T-1] (and stats), the head swapped for the tiled one during `run_forward()`;
    None when the model transforms its head's output (a scale, soft-capping) and needs its full logits."""
    head = _head_of(model)
    if head is None:
        return None
    # a plain linear head is read through its weight; any other through its own forward
    original_forward, scored = head.forward, {}
    scorer = head if type(head) is nn.Linear else original_forward
    vocab_size = getattr(head, "out_features", None)

    def scoring_forward(hidden):  # hidden [B, K, H], K = T (no logits_to_keep)
        # returned as the "logits", so DeepSpeed's hooks gather the head's weight in backward too
        mask = torch.zeros(hidden.shape[:-1], dtype=torch.bool, device=hidden.device)
        mask[:, :-1] = score_mask[:, score_mask.size(1) - hidden.size(1) + 1 :]
        values = chunked_token_logprobs(scorer, hidden[mask], targets, temperature, with_stats, vocab_size)
        if with_stats:
            values, scored["stats"] = values[0], values[1:]
        scored["out"] = scatter(values, mask)
        return scored["out"]

    head.forward = scoring_forward
    try:
        output = run_forward()
    finally:
        del head.forward  # the class's forward again
    # the same tensor unless the forward transformed it; comparing values would wait for the GPU
    same = "out" in scored and (output.logits is scored["out"] or torch.equal(output.logits, scored["out"]))
    if not same:
        # the forward transformed the head's output: plain from now on
        inner_model(model)._plain_logprobs = True
        return None
    logprobs = output.logits[:, :-1]
    if not with_stats:
        return logprobs
    return (logprobs, *(scatter(v, score_mask) for v in scored["stats"]))
