"""A/B of two checkouts: the same tiny command of each script in both, compared line by line and bit by bit.

For a change that should not change behaviour (a reshaping, a module moved): each script but ddpo.py runs a short
training on the tiny world (benchmark/tiny/tiny_world.py), the rule-reward lab (tests/conftest.py's make_rl_lab)
or ilql's reward rows (tests/test_ilql.py's) in checkout A and in checkout B, and the two runs' metrics.jsonl
(every value but timings) and saved weights must be equal.

    python benchmark/reliability/ab_compare.py --before /path/to/old/checkout --after . --work /tmp/ab
    python benchmark/reliability/ab_compare.py --before OLD --after . --work /tmp/ab --scripts rloo grpo
    python benchmark/reliability/ab_compare.py --before OLD --work /tmp/ab --scripts grpo \
        --flags "--loss_type vespo" --name vespo

Prints one line per script (equal, or the first difference) and exits 1 if any differs.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("time", "second", "perf/", "elapsed", "memory", "_rss", "throughput")  # parts of timing names
TIMING_NAMES = {"eps"}  # episodes per second (TRL 0.19's name)


def commands(world: Path, lab: Path) -> dict[str, list[str]]:
    """Each script's tiny training (a few optimizer steps, sampling included where the script samples)."""
    rl_data = ["--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft"]
    return {
        "sft": ["--model_name_or_path", str(world / "policy"), "--dataset_name", str(world / "dataset" / "sft.jsonl"),
                "--per_device_train_batch_size", "4", "--total_steps", "3", "--max_length", "96",
                "--response_length", "8", "--num_samples", "0"],
        "reward": ["--model_name_or_path", str(world / "reward"),
                   "--dataset_name", str(world / "dataset" / "preference.jsonl"), "--per_device_train_batch_size", "4",
                   "--total_steps", "3", "--max_length", "96"],
        "dpo": ["--model_name_or_path", str(world / "policy"),
                "--dataset_name", str(world / "dataset" / "preference.jsonl"), "--per_device_train_batch_size", "4",
                "--max_steps", "3", "--max_length", "96", "--generate_during_eval", "False"],
        "ppo": ["--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"), *rl_data,
                "--per_device_train_batch_size", "4", "--total_episodes", "16", "--response_length", "8",
                "--local_rollout_forward_batch_size", "4", "--num_sample_generations", "0", "--stop_token", "eos"],
        "rloo": ["--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"), *rl_data,
                 "--rloo_k", "2", "--per_device_train_batch_size", "4", "--total_episodes", "16",
                 "--response_length", "8", "--num_sample_generations", "0"],
        "grpo": ["--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
                 "--reward_funcs", f"{lab / 'rules.py'}:key_words", "--num_generations", "4",
                 "--per_device_train_batch_size", "16", "--learning_rate", "1e-2", "--max_steps", "4",
                 "--max_completion_length", "8", "--num_sample_generations", "0", "--beta", "0.1"],
        "ilql": ["--model_name_or_path", str(world / "policy"), "--dataset_name", str(lab.parent / "ilql" / "data"),
                 "--dataset_train_split", "train", "--dataset_test_split", "validation", "--max_length", "128",
                 "--max_prompt_length", "100", "--per_device_train_batch_size", "8", "--learning_rate", "3e-3",
                 "--response_length", "4", "--logging_steps", "1", "--eval_steps", "0", "--max_steps", "4"],
        "online_dpo": ["--model_name_or_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
                       *rl_data, "--per_device_train_batch_size", "4", "--max_steps", "3", "--max_new_tokens", "8",
                       "--local_rollout_forward_batch_size", "8", "--num_sample_generations", "0"],
    }  # fmt: skip


def run(checkout: Path, script: str, flags: list[str], out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    argv = [sys.executable, f"{script}.py", *flags, "--output_dir", str(out / "model"),
            "--logging_dir", str(out / "runs"), "--run_name", "ab"]  # fmt: skip
    return subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)


def metrics(out: Path) -> list[dict]:
    lines = [
        json.loads(line) for line in (out / "runs" / "ab" / "metrics.jsonl").read_text().splitlines() if line
    ]
    return [{k: v for k, v in line.items() if k not in TIMING_NAMES and not any(w in k for w in TIMING)}
            for line in lines]  # fmt: skip


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return {name: tensor for path in sorted((out / "model").glob("*.safetensors")) for name, tensor in
            load_file(path).items()}  # fmt: skip


def first_difference(a: Path, b: Path) -> str | None:
    ma, mb = metrics(a), metrics(b)
    if len(ma) != len(mb):
        return f"{len(ma)} metric lines against {len(mb)}"
    for i, (la, lb) in enumerate(zip(ma, mb)):
        if la != lb:
            keys = sorted(k for k in la.keys() | lb.keys() if la.get(k) != lb.get(k))
            return f"line {i}: {keys[0]} {la.get(keys[0])} against {lb.get(keys[0])}"
    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys():
        return f"saved tensors differ: {sorted(wa.keys() ^ wb.keys())[:3]}"
    unequal = [name for name in wa if not wa[name].equal(wb[name])]
    return f"weights differ: {unequal[:3]}" if unequal else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout A")
    parser.add_argument("--after", type=Path, default=ROOT, help="checkout B")
    parser.add_argument("--work", type=Path, required=True, help="folder for the world, the lab and the runs")
    parser.add_argument("--scripts", nargs="+", default=None, help="a subset of the scripts")
    parser.add_argument("--flags", default="", help="flags added to each script's command (one string)")
    parser.add_argument(
        "--name", default="", help="a suffix of the run folders, to keep runs with --flags apart"
    )
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "benchmark" / "tiny"), str(ROOT / "tests")]
    import tiny_world
    from conftest import make_rl_lab

    world, lab = args.work / "world", args.work / "lab"
    if not (world / "world.json").exists():  # the tests' world (tests/conftest.py)
        tiny_world.build(tiny_world.Args(output_dir=str(world), num_sft=600, num_preference=600,
                                         num_preference_validation=200, num_validation=64, num_test=64))  # fmt: skip
    if not (lab / "rules.py").exists():
        lab.mkdir(parents=True, exist_ok=True)
        make_rl_lab(world, lab, num_prompts=64)
    if not (args.work / "ilql" / "data").exists():  # prompt, completion, reward rows (tests/test_ilql.py's)
        from test_ilql import ilql_dataset

        (args.work / "ilql").mkdir(parents=True, exist_ok=True)
        ilql_dataset(world, args.work / "ilql")
    differ = 0
    for script, flags in commands(world, lab).items():
        if args.scripts and script not in args.scripts:
            continue
        flags = [*flags, *shlex.split(args.flags)]
        outs = [
            args.work / side / (script + (f"-{args.name}" if args.name else ""))
            for side in ("before", "after")
        ]
        procs = [
            run(checkout.resolve(), script, flags, out)
            for checkout, out in zip((args.before, args.after), outs)
        ]
        failed = [f"{side}: {proc.stderr.strip().splitlines()[-1:]}" for side, proc in zip(("A", "B"), procs)
                  if proc.returncode != 0]  # fmt: skip
        result = "; ".join(failed) if failed else first_difference(*outs)
        differ += result is not None
        print(
            f"{script:11s} {'equal (metrics and weights)' if result is None else 'DIFFERS: ' + result}",
            flush=True,
        )
    raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()
