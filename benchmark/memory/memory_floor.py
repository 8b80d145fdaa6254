"""The memory floor of each algorithm at a speed.py shape: what any single-process float32 implementation holds
before it computes anything, and what speed.py's peak memory ratios should be read against.

    python benchmark/memory/memory_floor.py --world benchmark/work/speed-grpo/world \
        --speed benchmark/results/speed_grpo.json --output benchmark/results/memory_floor_grpo.json

The floor of an algorithm is the peak RSS of a fresh process that imports torch, transformers, accelerate and
datasets, loads the models the algorithm holds as speed.py's workload runs it (trained: weights, float32
gradients and fused AdamW state after one step; frozen: every weight read once but an untied input embedding,
of which a forward pass reads only the rows of its tokens), and does nothing else: no activations, no logits, no
generation. Both sides of speed.py hold at least this much, so with `--speed` it
prints, per algorithm, floor / TRL's peak (the lowest ours / TRL ratio any implementation can reach) and
(ours - floor) / (TRL - floor), the ratio of what each spends on the work itself.

    sft, reward   the trained model (policy; reward: the classifier)
    dpo           policy (trained), reference
    rloo          policy (trained), reference, reward model
    grpo          policy (trained), reward model (speed.py runs GRPO with beta 0: no reference)
    ppo           policy and critic (trained; the critic is a classifier like the reward model), reference, reward
    online_dpo    policy (trained), reference, reward model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODELS = {  # algorithm -> (trained, frozen); "policy" is a causal LM, "reward" a one-label classifier
    "sft": (["policy"], []),
    "reward": (["reward"], []),
    "dpo": (["policy"], ["policy"]),
    "rloo": (["policy"], ["policy", "reward"]),
    "grpo": (["policy"], ["reward"]),
    "ppo": (["policy", "reward"], ["policy", "reward"]),
    "online_dpo": (["policy"], ["policy", "reward"]),
}


def peak_rss_mib() -> dict:
    with open("/proc/self/status") as f:
        fields = {
            line.split(":")[0]: int(line.split()[1]) / 1024 for line in f if ":" in line and "kB" in line
        }
    return {"peak_rss_mib": fields["VmHWM"], "rss_anon_mib": fields["RssAnon"]}


def child(algorithm: str, world: str) -> None:
    """Hold the algorithm's models as a trainer does, print the peak RSS as JSON."""
    import accelerate  # noqa: F401  (both sides import these and more)
    import datasets  # noqa: F401
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.set_num_threads(1)

    def load(kind):
        if kind == "policy":
            return AutoModelForCausalLM.from_pretrained(f"{world}/policy")
        return AutoModelForSequenceClassification.from_pretrained(f"{world}/reward", num_labels=1)

    trained, frozen = MODELS[algorithm]
    trained = [load(kind) for kind in trained]
    frozen = [load(kind).requires_grad_(False) for kind in frozen]
    with torch.no_grad():
        # A forward pass reads every weight but an untied input embedding (only the rows of its tokens).
        for model in frozen:
            embedding = model.get_input_embeddings().weight
            tied = model.config.tie_word_embeddings
            sum(float(p.sum()) for p in model.parameters() if p is not embedding or tied)
    params = [p for model in trained for p in model.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    optimizer.step()  # writes every trained weight (copy-on-write of the mapped checkpoint) and creates the state
    print(json.dumps(peak_rss_mib()))


def speed_rows(path: str) -> dict:
    with open(path) as f:
        summary = json.load(f)["summary"]
    return {a: s["peak_rss_mib"] for a, s in summary.items() if "peak_rss_mib" in s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", required=True, help="a world written by benchmark/speed/shape_world.py")
    parser.add_argument("--algorithms", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--speed", nargs="*", default=[], help="speed.py result files of this world's preset")
    parser.add_argument(
        "--output", default=None, help="JSON file for the floors (and the ratios with --speed)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.world)
    peaks = {}
    for path in args.speed:  # a later file (a rerun of some algorithms) replaces the rows it has
        for algorithm, figures in speed_rows(path).items():
            peaks[algorithm] = figures
    rows = {}
    print(
        "| algorithm | floor (MiB) | ours / TRL peak (MiB) | floor / TRL | (ours - floor) / (TRL - floor) |"
    )
    print("|---|---|---|---|---|")
    for algorithm in args.algorithms:
        out = subprocess.run([sys.executable, __file__, "--world", args.world, "--child", algorithm],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        if out.returncode != 0:
            sys.exit(f"memory_floor.py: error: {algorithm} failed: {out.stderr.strip().splitlines()[-1]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        floor = row["peak_rss_mib"]
        line = [algorithm, f"{floor:.0f}", "-", "-", "-"]
        if algorithm in peaks and peaks[algorithm].get("trl") is not None:
            ours, trl = peaks[algorithm]["ours"], peaks[algorithm]["trl"]
            row |= {"ours_peak_rss_mib": ours, "trl_peak_rss_mib": trl, "floor_over_trl": floor / trl,
                    "above_floor_ours_over_trl": (ours - floor) / (trl - floor)}  # fmt: skip
            line[2:] = [
                f"{ours:.0f} / {trl:.0f}",
                f"{floor / trl:.2f}",
                f"{(ours - floor) / (trl - floor):.2f}",
            ]
        rows[algorithm] = row
        print("| " + " | ".join(line) + " |", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "world": args.world, "speed": args.speed, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
