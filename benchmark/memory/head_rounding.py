"""How far the tiled LM head's bf16 gradients fall from exact ones, per tile size (docs/speed_gpu.md).

Under bf16 autocast each vocabulary tile's contribution to the hidden states' gradient is a bf16 matmul product,
rounded to bf16 before it is added in float32; more tiles, more roundings. This scores random hidden states of
the TL;DR SFT shape (424 scored tokens) through a Qwen2.5-0.5B-sized head (hidden 896, vocabulary 151936) with
`utils.lm_head` at several tile sizes, and through the plain bf16 computation (full logits, as a model without
the tiling does), and compares logprobs and both gradients with a float64 computation on the same bf16-rounded
inputs. Runs on a CPU (about a minute on 2 cores):

    python benchmark/memory/head_rounding.py --output benchmark/results/head_rounding.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import utils.lm_head as lm_head  # noqa: E402


def errors(values: dict, exact: dict) -> dict:
    """Per tensor: the largest absolute error over the largest exact value, and the mean absolute error over the
    mean absolute exact value."""
    out = {}
    for name, value in values.items():
        diff = (value.double() - exact[name]).abs()
        out[name] = {
            "max_rel": float(diff.max() / exact[name].abs().max()),
            "mean_rel": float(diff.mean() / exact[name].abs().mean()),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=424)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tiles", type=int, nargs="+", default=[2**22, 2**24], help="logits a tile holds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(args.tokens, args.hidden)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    weights = torch.randn(args.tokens)  # d loss / d logprob of each token
    # autocast rounds the matmul inputs to bf16; the exact reference starts from the same rounded values
    with torch.no_grad():
        w64, h64 = head.weight.bfloat16().double(), hidden.bfloat16().double()

    h = h64.clone().requires_grad_()
    w = w64.clone().requires_grad_()
    logprobs64 = (h @ w.T).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    (logprobs64 * weights.double()).sum().backward()
    exact = {"logprobs": logprobs64.detach(), "grad_hidden": h.grad, "grad_weight": w.grad}

    def measure(run) -> dict:
        head.zero_grad()
        x = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs = run(x)
        (logprobs * weights).sum().backward()
        return errors(
            {"logprobs": logprobs.detach(), "grad_hidden": x.grad, "grad_weight": head.weight.grad}, exact
        )

    results = {}
    for tile in args.tiles:
        lm_head.LOGIT_TILE_ELEMENTS = tile
        count = len(list(lm_head._tiles(args.tokens, args.vocab, torch.device("cpu"))))
        results[f"tiled, {tile} logits a tile ({count} tiles)"] = measure(
            lambda x: lm_head.chunked_token_logprobs(head, x, targets)
        )
    results["plain bf16 (full logits)"] = measure(
        lambda x: head(x).float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    )
    for name, figures in results.items():
        print(
            name
            + ": "
            + ", ".join(f"{k} max {v['max_rel']:.2e} mean {v['mean_rel']:.2e}" for k, v in figures.items())
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
