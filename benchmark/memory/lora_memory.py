"""Peak memory of RL updates with LoRA (--use_peft) against full fine-tuning: benchmark/speed/speed.py's workload
and shapes (--preset), our scripts only, both configurations of each algorithm in one run, interleaved, each in
its own process.

    python benchmark/memory/lora_memory.py --preset grpo --algorithms rloo grpo ppo

LoRA: `--use_peft --lora_target_modules all-linear` (rank 16, alpha 32), so the policy trains adapters on every
linear layer of the body, the reference is the policy with its adapter off (no second copy) and AdamW holds
state for the adapters only; ppo.py's critic trains whole in both configurations, as TRL's. The figures are
speed.py's: peak held (the peak of torch's tensor bytes plus the checkpoint files mapped: what a GPU run would
need before its allocator's overhead), peak RSS, and the CPU seconds of an update; each as full, LoRA and the
ratio LoRA / full of the pairs (run i of one with run i of the other). Writes --output (every run, the medians,
the ratios, the commands).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field

BENCHMARK = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(BENCHMARK, "speed"))

import speed  # noqa: E402

LORA = ["--use_peft", "--lora_target_modules", "all-linear"]
FIGURES = ["peak_held_mib", "peak_rss_mib", "cpu_per_update_s"]


@dataclass
class Args:
    preset: str = "grpo"
    """speed.py's workload shapes (toy, tldr, tldr_qwen, grpo, ...)"""
    algorithms: list[str] = field(default_factory=lambda: ["rloo", "grpo", "ppo"])
    """the RL scripts to measure"""
    runs: int = 1
    """runs of each configuration per algorithm, interleaved (full, LoRA, full, ...)"""
    work_dir: str | None = None
    """where the world and the runs go (None: speed.py's for the preset)"""
    output: str | None = None
    """the results' JSON (None: benchmark/results/lora_memory_<preset>.json)"""


def main(args: Args) -> dict:
    speed_args = speed.resolve(speed.Args(preset=args.preset, sides=["ours"], no_bare=True, runs=args.runs,
                                          parallel=1, device="cpu"))  # fmt: skip
    work = os.path.abspath(args.work_dir or f"benchmark/work/speed-{args.preset}")
    world = speed.ensure_world(speed_args, work)
    if speed.measures_live_heap(speed_args):
        speed.live_heap_library(work)
    speed_args.work_dir = work
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    results = {"preset": args.preset, "lora_flags": LORA, "algorithms": {}}
    for algorithm in args.algorithms:
        runs, commands = {"full": [], "lora": []}, {}
        for i in range(args.runs):
            for config in ("full", "lora"):
                spec = speed.workload(
                    algorithm, speed_args, world, os.path.join(work, f"{algorithm}-{config}")
                )
                spec["ours_command"] += LORA if config == "lora" else []
                commands[config] = spec["ours_command"]
                log = os.path.join(work, "logs", f"lora-{algorithm}-{config}-{i}.log")
                runs[config].append(speed.run_one("ours", spec, sys.executable, speed_args, log))
                print(
                    algorithm,
                    config,
                    i,
                    {k: round(runs[config][-1].get(k, float("nan")), 2) for k in FIGURES},
                )
        summary = {}
        for figure in FIGURES:
            full, lora = ([run.get(figure) for run in runs[c]] for c in ("full", "lora"))
            if None in full + lora:
                continue
            ratios = [b / a for a, b in zip(full, lora)]
            summary[figure] = {"full": statistics.median(full), "lora": statistics.median(lora),
                               "lora/full": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}  # fmt: skip
        results["algorithms"][algorithm] = {"summary": summary, "runs": runs, "commands": commands}
        print(algorithm, json.dumps(summary, indent=1))
    results["args"] = asdict(args)
    output = args.output or os.path.join(BENCHMARK, "results", f"lora_memory_{args.preset}.json")
    with open(output, "w") as f:
        json.dump(results, f, indent=1)
    print(f"written to {output}")
    return results


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
