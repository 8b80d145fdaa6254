"""Computed (not measured) GPU memory of a training micro-batch: how many rows fit in one 80 GB GPU before and
after the chunked log-probabilities of utils.logprobs.token_logprobs, for the models users train.

    python benchmark/memory/memory_budget.py            # prints the README's table (markdown)

What a row costs, in bytes, for T tokens of which R are scored (prompt Q + response R), vocabulary V, model
dtype of s bytes (bf16: 2):
    logits before (sft, dpo: every position scored)   T*V*s (LM head output) + (T-1)*V*4 (float32 copy)
                                                       + (T-1)*V*4 (log_softmax, kept for backward)
    logits before (rloo, ppo, grpo, online_dpo)        T*V*s + R*V*4 (float32 slice) + R*V*4 (/ temperature)
                                                       + R*V*4 (log_softmax, kept for backward)
    logits after (every script)                        T*4 (per-token logprobs); plus one tile of at most
                                                       GPU_LOGIT_TILE_ELEMENTS (2**24) logits in flight per
                                                       process, whatever B, T, V: 2**24 * (s + 12) bytes
    activations (both)                                 layers * T * 2 * (10*H + 4*I): the tensors a Llama or
                                                       GPT-NeoX layer keeps for backward in bf16 (norm inputs
                                                       and outputs, q, k, v, rotated q and k, attention output,
                                                       the MLP's up/gate/activation/product), without gradient
                                                       checkpointing, with SDPA/flash attention (no T x T
                                                       matrix). An estimate, about +-30%.
Fixed per GPU: the trained model under ZeRO-2 over 8 GPUs in bf16 mixed precision (bf16 weights 2 bytes/param,
float32 master weights, gradients and Adam moments 16 bytes/param sharded 8 ways), plus for the RL shapes a
frozen bf16 reference model (2 bytes/param), plus 5 GiB for the CUDA context, the allocator and buffers.
Rows that fit = floor((80 GB - fixed) / (activations + logits)). Real runs also keep the reward model, the
generation cache and fragmentation; treat the figures as the ratio before/after, not as a promise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from utils.lm_head import GPU_LOGIT_TILE_ELEMENTS as TILE  # noqa: E402

GIB = 1024**3

# name: (parameters, layers, hidden, MLP width, vocabulary of the LM head) from the models' published configs
MODELS = {
    "Pythia-1B": (1.01e9, 16, 2048, 8192, 50304),
    "Pythia-2.8B": (2.78e9, 32, 2560, 10240, 50304),
    "Pythia-6.9B": (6.86e9, 32, 4096, 16384, 50432),
    "Qwen2.5-0.5B": (0.49e9, 24, 896, 4864, 151936),
    "Qwen2.5-1.5B": (1.54e9, 28, 1536, 8960, 151936),
    "Qwen2.5-7B": (7.62e9, 28, 3584, 18944, 152064),
}
# shape: (prompt tokens, scored tokens, every position scored (sft/dpo) or the response only (RL), frozen ref)
SHAPES = {
    "TL;DR sft/dpo (512 + 53)": (512, 53, True, False),
    "TL;DR rl (512 + 53)": (512, 53, False, True),
    "GRPO (128 + 256)": (128, 256, False, True),
}


def row_bytes(model: tuple, shape: tuple, chunked: bool, dtype_bytes: int = 2) -> float:
    """Activation and logit bytes of one row (see the module docstring)."""
    _, layers, hidden, mlp, vocab = model
    prompt, response, all_positions, _ = shape
    tokens = prompt + response
    activations = layers * tokens * dtype_bytes * (10 * hidden + 4 * mlp)
    if chunked:
        return activations + tokens * 4
    head_output = tokens * vocab * dtype_bytes
    if all_positions:  # float32 copy + log_softmax of every position
        return activations + head_output + 2 * (tokens - 1) * vocab * 4
    return activations + head_output + 3 * response * vocab * 4  # float32 slice, / temperature, log_softmax


def fixed_bytes(
    model: tuple, shape: tuple, gpus: int = 8, reserve_gib: float = 5.0, chunked: bool = False
) -> float:
    params = model[0]
    fixed = params * (2 + 16 / gpus) + reserve_gib * GIB
    if shape[3]:
        fixed += 2 * params
    if chunked:
        fixed += TILE * (2 + 12)
    return fixed


def table(budget_gb: float = 80.0) -> tuple[str, list[dict]]:
    budget = budget_gb * 1e9
    rows, lines = [], []
    lines.append("| model | shape | logits per row before | after | rows per GPU before | after |")
    lines.append("|---|---|---|---|---|---|")
    for name, model in MODELS.items():
        for shape_name, shape in SHAPES.items():
            fits = {}
            for chunked in (False, True):
                free = budget - fixed_bytes(model, shape, chunked=chunked)
                fits[chunked] = max(0, int(free // row_bytes(model, shape, chunked)))
            activations = row_bytes(model, shape, True) - (shape[0] + shape[1]) * 4
            logits_before = row_bytes(model, shape, False) - activations
            rows.append({"model": name, "shape": shape_name, "logits_before_gib": logits_before / GIB,
                         "activations_gib": activations / GIB, "rows_before": fits[False], "rows_after": fits[True]})  # fmt: skip
            lines.append(
                f"| {name} | {shape_name} | {logits_before / GIB:.2f} GiB | {(shape[0] + shape[1]) * 4 / 1024:.1f} KiB "
                f"| {fits[False]} | {fits[True]} |"
            )
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_gb", type=float, default=80.0, help="GPU memory in GB (10^9 bytes)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    text, rows = table(args.budget_gb)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_gb": args.budget_gb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
