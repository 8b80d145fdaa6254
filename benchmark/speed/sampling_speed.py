"""The cost of drawing one token per row from softmax(logits / temperature), per generation step: torch.multinomial
(what the scripts used before, and what transformers' generate uses) against utils.generation.sample_categorical
(inverse transform on float64 cumulative sums), at real vocabulary sizes, beside the LM head's own matmul for scale.

    python benchmark/speed/sampling_speed.py               # writes benchmark/results/sampling_speed.json

Each figure is the median over --repeats timings of --steps draws (milliseconds per draw), both samplers timed
one after the other in the same process, on the same probabilities (the softmax of random logits / 0.7). The
head is F.linear of [rows, hidden] onto a [vocabulary, hidden] float32 weight: what one decoding step of the
speed presets' model spends there (hidden 256). Before timing, one 16 MiB block is freed, as in any training
process (see main).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from utils.generation import sample_categorical  # noqa: E402


@dataclass
class Args:
    vocab_sizes: tuple[int, ...] = (50304, 151936)
    """vocabulary sizes to measure"""
    rows: tuple[int, ...] = (4, 8, 64)
    """rows sampled at once (the speed presets sample 4 or 8)"""
    hidden_size: int = 256
    """hidden size of the LM head timed for scale"""
    steps: int = 20
    """draws per timing"""
    repeats: int = 5
    """timings per figure (the median is reported)"""
    output: str = "benchmark/results/sampling_speed.json"
    """where the figures go"""


def per_draw_ms(fn, steps: int, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def main(args: Args) -> list[dict]:
    # A training process has long since freed blocks of megabytes, which raises glibc's mmap threshold to the
    # largest of them (up to 32 MiB), so the draws' buffers come from its heap; in a fresh process each would be
    # a new mapping, its pages faulted in on every draw (one-off: 1.2 against 0.14 ms, 4 rows at 50304).
    torch.empty(2**22).fill_(0)  # 16 MiB, allocated, touched and freed
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    results = []
    for vocab in args.vocab_sizes:
        weight = torch.randn(vocab, args.hidden_size) / args.hidden_size**0.5
        for rows in args.rows:
            hidden = torch.randn(rows, args.hidden_size)
            probs = (F.linear(hidden, weight) * 3 / 0.7).softmax(-1)
            row = {"vocab_size": vocab, "rows": rows, "threads": torch.get_num_threads()}
            timed = {
                "multinomial_ms": partial(torch.multinomial, probs, 1, generator=generator),
                "inverse_transform_ms": partial(sample_categorical, probs, generator),
                "lm_head_ms": partial(F.linear, hidden, weight),
            }
            row |= {name: per_draw_ms(fn, args.steps, args.repeats) for name, fn in timed.items()}
            row["multinomial_over_inverse_transform"] = row["multinomial_ms"] / row["inverse_transform_ms"]
            results.append(row)
            print(
                f"V {vocab:>6}, {rows:>2} rows: multinomial {row['multinomial_ms']:7.2f} ms, inverse transform "
                f"{row['inverse_transform_ms']:6.2f} ms ({row['multinomial_over_inverse_transform']:5.1f}x); "
                f"LM head {row['lm_head_ms']:6.2f} ms"
            )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
