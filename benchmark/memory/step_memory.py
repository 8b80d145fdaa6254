"""Peak memory of one training step, phase by phase: forward, backward, optimizer step (the SFT step of sft.py,
on the completion tokens, through utils.logprobs.token_logprobs). Each configuration runs in its own process, so one
configuration's peak cannot hide another's.

    python benchmark/speed/speed.py --preset grpo --algorithms sft --runs 1 --no_bare  # builds the world once
    python benchmark/memory/step_memory.py --model benchmark/work/speed-grpo/world/policy

Prints, per configuration (AdamW plain or fused; logit tile of 2**22 or 2**24 elements), the peak RSS after
each phase of three steps and the user CPU seconds of the process; writes them as JSON with --output.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGURATIONS = [("plain", 2**24), ("fused", 2**24), ("fused", 2**22)]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(
    model_path: str, optimizer: str, tile: int, rows: int, prompt: int, completion: int, steps: int
) -> dict:
    """Run `steps` SFT steps in this process; the peak RSS after each phase."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, ROOT)
    import utils.logprobs
    import utils.run
    from utils import lm_head

    torch.set_num_threads(1)
    lm_head.LOGIT_TILE_ELEMENTS = tile
    model = AutoModelForCausalLM.from_pretrained(model_path).train()
    adamw = utils.run.adamw if optimizer == "fused" else torch.optim.AdamW
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    length = prompt + completion
    ids = torch.randint(
        0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0)
    )
    mask = torch.ones_like(ids)
    scored = torch.zeros(rows, length - 1, dtype=torch.bool)
    scored[:, prompt - 1 :] = True  # the completion tokens, as sft.py's completion-only loss
    phases = {"loaded": peak_mib()}
    start = time.process_time()
    for step in range(steps):
        logprobs = utils.logprobs.token_logprobs(model, ids, mask, scored, 1.0)
        loss = -logprobs.sum() / scored.sum()
        phases[f"step{step}/forward"] = peak_mib()
        loss.backward()
        phases[f"step{step}/backward"] = peak_mib()
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases[f"step{step}/optimizer"] = peak_mib()
    return {"optimizer": optimizer, "tile": tile, "peak_mib": phases, "cpu_s": time.process_time() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a causal LM directory (shape_world.py's policy)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt_length", type=int, default=128)
    parser.add_argument("--completion_length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default=None, help="write the results here as JSON")
    parser.add_argument(
        "--one", default=None, help=argparse.SUPPRESS
    )  # "optimizer:tile", in the child process
    args = parser.parse_args()
    shape = (args.rows, args.prompt_length, args.completion_length, args.steps)
    if args.one:
        optimizer, tile = args.one.split(":")
        print(json.dumps(one(args.model, optimizer, int(tile), *shape)))
        return
    results = []
    for optimizer, tile in CONFIGURATIONS:
        command = [sys.executable, __file__, "--model", args.model, "--one", f"{optimizer}:{tile}",
                   "--rows", str(args.rows), "--prompt_length", str(args.prompt_length),
                   "--completion_length", str(args.completion_length), "--steps", str(args.steps)]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        results.append(result)
        print(f"AdamW {optimizer:5s} tile 2**{tile.bit_length() - 1}: peak {max(result['peak_mib'].values()):.0f} MiB "
              f"(after forward {result['peak_mib']['step0/forward']:.0f}, backward "
              f"{result['peak_mib']['step0/backward']:.0f}, optimizer {result['peak_mib']['step0/optimizer']:.0f} "
              f"at the first step), {result['cpu_s']:.1f} CPU s for {args.steps} steps", flush=True)  # fmt: skip
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "shape": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
