"""The README's real-shape table: peak memory and in-loop CPU time per update, ours / TRL, from speed.py's result
files, optionally beside the same figures of runs with glibc's mmap threshold fixed and of an earlier run (say,
before a change). The README's command:

    python benchmark/speed/speed_compare.py benchmark/results/speed_tldr.json \
        benchmark/results/speed_tldr_qwen.json benchmark/results/speed_grpo.json benchmark/results/speed_grpo_rloo.json \
        benchmark/results/speed_tldr_rloo_heap_release.json benchmark/results/speed_tldr_qwen_rloo_heap_release.json \
        benchmark/results/speed_grpo_rloo_heap_release.json \
        --fixed_threshold benchmark/results/speed_tldr_fixed_threshold.json \
        benchmark/results/speed_tldr_qwen_fixed_threshold.json benchmark/results/speed_grpo_fixed_threshold.json \
        --before benchmark/results/speed_tldr_before.json benchmark/results/speed_tldr_qwen_before.json

The held-memory table (runs with speed.py's live-heap shim, which every run has by default):

    python benchmark/speed/speed_compare.py --held benchmark/results/speed_tldr_live_heap.json \
        benchmark/results/speed_tldr_qwen_live_heap.json benchmark/results/speed_grpo_live_heap.json

CPU seconds per update of each side, after a change and before it (the sampling section):

    python benchmark/speed/speed_compare.py \
        --cpu benchmark/results/speed_{grpo,tldr_qwen,tldr}_sampling.json \
        --before benchmark/results/speed_{grpo,tldr_qwen,tldr}_live_heap.json

The GPU table (runs with speed.py --device cuda; docs/speed_gpu.md): peak CUDA memory allocated and reserved,
wall seconds per update, ours / TRL, with the GPU's name, the model's size and the precision of each file:

    python benchmark/speed/speed_compare.py --gpu results/speed_tldr_qwen05b.json \
        results/speed_grpo_qwen05b.json

Each file is one preset (speed.py --preset ...). A later file of the same preset (a rerun of some algorithms,
`--algorithms rloo`) replaces the rows it has figures for. `--fixed_threshold` files (runs with speed.py's
`--malloc_mmap_threshold`, whose peaks leave out the freed blocks glibc keeps) and `--before` files are matched to
them by preset and shown in their own columns. Ratios are those of the same run (ours and TRL measured side by
side), so runs under different loads can be set beside each other.
"""

from __future__ import annotations

import argparse
import json

ALGORITHMS = ["sft", "reward", "dpo", "rloo", "ppo", "grpo", "online_dpo"]


def ratio(summary: dict, algorithm: str, metric: str) -> str:
    """ours / TRL of one metric, with both figures, or '-' where a side did not run."""
    figures = summary.get(algorithm, {}).get(metric, {})
    ours, trl = figures.get("ours"), figures.get("trl")
    if ours is None or trl is None:
        return "-"
    unit = " MiB" if "mib" in metric else " s"
    return f"{ours / trl:.2f} ({ours:.0f} / {trl:.0f}{unit})" if unit == " MiB" else f"{ours / trl:.2f}"


def load(path: str) -> tuple[str, dict]:
    with open(path) as f:
        data = json.load(f)
    args = data["args"]
    name = f"{args['preset']}: {args['prompt_length']} + {args['response_length']}, V {args['vocab_size']}"
    if args["preset"] == "toy":
        name = "toy: tiny world, V ~1k"
    return args["preset"], {"name": name, "summary": data["summary"]}


def held_table(paths: list[str]) -> None:
    """Per run: peak RSS, peak live heap, peak tensor bytes, the checkpoints mapped, held (tensors + checkpoints),
    ours / TRL with both figures, and CPU per update."""
    metrics = ["peak_rss_mib", "peak_live_heap_mib", "peak_tensor_mib", "checkpoints_mapped_mib", "peak_held_mib",
               "cpu_per_update_s"]  # fmt: skip
    header = ["shape", "algorithm", "peak RSS ours / TRL (MiB)", "peak live heap", "peak tensors", "checkpoints mapped",
              "peak held (tensors + checkpoints)", "CPU s per update ours / TRL"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for path in paths:
        _, result = load(path)
        for algorithm in ALGORITHMS:
            if algorithm in result["summary"]:
                cells = [ratio(result["summary"], algorithm, m) for m in metrics]
                print("| " + " | ".join([result["name"], algorithm, *cells]) + " |")


def gpu_table(paths: list[str]) -> None:
    """Per file and algorithm, on cuda: the device, model and precision it records, peak CUDA memory allocated and
    reserved (ours / TRL with both figures) and wall seconds per update ours / TRL."""
    header = ["shape", "device, model, precision", "algorithm", "max allocated ours / TRL",
              "max reserved ours / TRL", "wall s / update ours / TRL"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        device, model = data.get("device", {}), data.get("model", {})
        where = (f"{device.get('name', '?')}, {model.get('parameters', 0) / 1e6:.0f}M parameters, "
                 f"{data.get('precision', '?')}")  # fmt: skip
        _, result = load(path)
        for algorithm in ALGORITHMS:
            summary = result["summary"]
            if algorithm not in summary:
                continue
            wall = summary[algorithm].get("wall_per_update_s", {})
            seconds = "-"
            if "ours" in wall and "trl" in wall:
                seconds = f"{wall['ours'] / wall['trl']:.2f} ({wall['ours']:.3f} / {wall['trl']:.3f} s)"
            elif "ours" in wall:
                seconds = f"- ({wall['ours']:.3f} s / -)"
            cells = [ratio(summary, algorithm, "cuda_max_allocated_mib"),
                     ratio(summary, algorithm, "cuda_max_reserved_mib"), seconds]  # fmt: skip
            print("| " + " | ".join([result["name"], where, algorithm, *cells]) + " |")


def cpu_table(paths: list[str], before_paths: list[str]) -> None:
    """In-loop CPU seconds per update of each side, ours / TRL, in the files and in the --before files of the same
    presets, and ours after / ours before (TRL's side, unchanged code, shows how much the machine moved)."""
    before = dict(load(p) for p in before_paths)
    header = ["shape", "algorithm", "CPU s per update ours / TRL", "before: ours / TRL", "ours: after / before",
              "TRL: this run / before's"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))

    def seconds(summary, algorithm):
        figures = summary.get(algorithm, {}).get("cpu_per_update_s", {})
        return figures.get("ours"), figures.get("trl")

    for path in paths:
        preset, result = load(path)
        earlier = before.get(preset, {}).get("summary", {})
        for algorithm in ALGORITHMS:
            if algorithm not in result["summary"]:
                continue
            (ours, trl), (ours_before, trl_before) = (
                seconds(result["summary"], algorithm),
                seconds(earlier, algorithm),
            )
            cells = [f"{ours / trl:.2f} ({ours:.1f} / {trl:.1f})"]
            if ours_before is None or trl_before is None:
                cells += ["-", "-", "-"]
            else:
                cells += [f"{ours_before / trl_before:.2f} ({ours_before:.1f} / {trl_before:.1f})",
                          f"{ours / ours_before:.2f}", f"{trl / trl_before:.2f}"]  # fmt: skip
            print("| " + " | ".join([result["name"], algorithm, *cells]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="speed.py result files, one per preset")
    parser.add_argument("--held", action="store_true", help="the held-memory table of the files instead")
    parser.add_argument(
        "--gpu", action="store_true", help="the GPU table (speed.py --device cuda runs) instead"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="CPU seconds per update of each side, with --before"
    )
    parser.add_argument("--before", nargs="*", default=[], help="earlier result files of the same presets")
    parser.add_argument("--fixed_threshold", nargs="*", default=[], help="runs with --malloc_mmap_threshold")
    args = parser.parse_args()
    if args.held:
        return held_table(args.results)
    if args.gpu:
        return gpu_table(args.results)
    if args.cpu:
        return cpu_table(args.results, args.before)
    before = dict(load(p) for p in args.before)
    fixed = {}
    for path in args.fixed_threshold:  # a later file of a preset replaces the rows it has figures for
        preset, result = load(path)
        fixed.setdefault(preset, {}).update(result["summary"])
    header = ["shape", "algorithm", "peak RSS ours / TRL (MiB)", "CPU s per update ours / TRL"]
    if fixed:
        header += ["glibc threshold fixed: peak RSS ours / TRL", "CPU ours / TRL"]
    if before:
        header += ["before: peak RSS ours / TRL", "before: CPU ours / TRL"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = {}
    for path in args.results:
        preset, result = load(path)
        for algorithm in ALGORITHMS:
            if algorithm not in result["summary"]:
                continue
            row = [result["name"], algorithm, ratio(result["summary"], algorithm, "peak_rss_mib"),
                   ratio(result["summary"], algorithm, "cpu_per_update_s")]  # fmt: skip
            if fixed:
                row += [
                    ratio(fixed.get(preset, {}), algorithm, m) for m in ("peak_rss_mib", "cpu_per_update_s")
                ]
            if before:
                earlier = before.get(preset, {}).get("summary", {})
                row += [
                    ratio(earlier, algorithm, "peak_rss_mib"),
                    ratio(earlier, algorithm, "cpu_per_update_s"),
                ]
            if (preset, algorithm) not in rows or row[2] != "-":
                rows[(preset, algorithm)] = row
    for row in rows.values():
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
