"""Preemption by kill -9: runs killed at random moments (SIGKILL to every process, possibly several times) and
resumed with `--resume_from_checkpoint latest` until they finish, compared with an uninterrupted run: the
final weights bit for bit, metrics.jsonl step for step (timings aside).

    python benchmark/kill_trials.py --trials 7                  # sft.py and rloo.py, 1 and 2 processes
    python benchmark/kill_trials.py --scripts dpo ppo --nproc 2 --trials 3

Writes --out (benchmark/results/kill_trials.json); exits 1 when a trial is not bit-identical.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}  # fmt: skip
TIMING = ("eps", "second", "time")  # metric names holding these words differ between runs


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: ["sft", "rloo"])
    """among sft, dpo, reward, ppo, rloo"""
    nproc: list[int] = field(default_factory=lambda: [1, 2])
    """process counts (2: torchrun on CPU, gloo)"""
    trials: int = 7
    """killed runs per script and process count"""
    kill_again: float = 0.5
    """probability of killing a resumed run again (at most 3 kills a trial)"""
    seed: int = 0
    """seeds the kill moments"""
    world: str | None = None
    """a tiny world built before (benchmark/tiny_world.py); None: built in a temporary folder"""
    out: str = "benchmark/results/kill_trials.json"


def script_flags(script: str, world: Path, out: Path, runs: Path) -> list[str]:
    """16 steps or updates, a checkpoint after every other one, metrics every step."""
    common = ["--output_dir", str(out), "--logging_dir", str(runs), "--run_name", "run", "--save_steps", "2"]
    data = ["--dataset_name", str(world / "dataset")]
    if script in ("sft", "dpo", "reward"):
        model = world / ("reward" if script == "reward" else "policy")
        split = "sft" if script == "sft" else "preference"
        return [f"{script}.py", "--model_name_or_path", str(model), *data, "--dataset_train_split", split,
                "--eval_strategy", "no", "--max_length", "96", "--per_device_train_batch_size", "4",
                "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--max_steps", "16",
                "--logging_steps", "1", "--seed", "3", *common]  # fmt: skip
    extra = ["--rloo_k", "2", "--normalize_advantage"] if script == "rloo" else ["--whiten_rewards"]
    return [f"{script}.py", "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
            *data, "--dataset_train_split", "sft", "--response_length", "6", "--max_prompt_length", "16",
            "--local_rollout_forward_batch_size", "4", "--num_ppo_epochs", "2", "--gradient_accumulation_steps", "2",
            "--learning_rate", "1e-3", "--num_sample_generations", "0", "--total_episodes", "128", "--seed", "3",
            *extra, *common]  # fmt: skip


def start(argv: list[str], nproc: int) -> subprocess.Popen:
    """A run in a session of its own; two processes through torchrun."""
    env = {**os.environ, **ENV}
    command = [sys.executable, *argv]
    if nproc > 1:
        env["ACCELERATE_USE_CPU"] = "true"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={random.randint(20000, 60000)}", *argv]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers start sessions of their own)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def kill_all(proc: subprocess.Popen) -> None:
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def same_run(reference: Path, trial: Path, reference_runs: Path, trial_runs: Path) -> tuple[bool, bool]:
    """(weights bit-identical, metrics.jsonl equal step for step but timings)."""
    a, b = load_file(reference / "model.safetensors"), load_file(trial / "model.safetensors")
    weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def lines(runs: Path) -> list[dict]:
        rows = [json.loads(line) for line in open(runs / "run" / "metrics.jsonl") if line.strip()]
        return [{k: v for k, v in row.items() if not any(word in k for word in TIMING)} for row in rows]

    return weights, lines(reference_runs) == lines(trial_runs)


def trial(
    script: str, nproc: int, world: Path, work: Path, wall: float, rng: random.Random, args: Args
) -> dict:
    """One run killed at random moments and resumed until it finishes."""
    out, runs = work / "out", work / "runs"
    argv, kills, resumes = script_flags(script, world, out, runs), [], 0
    while True:
        proc = start(argv + (["--resume_from_checkpoint", "latest"] if kills else []), nproc)
        resumes += bool(kills)
        kill_now = len(kills) < 3 and (not kills or rng.random() < args.kill_again)
        moment = rng.uniform(0, wall) if kill_now else None
        try:
            proc.wait(timeout=moment)
        except subprocess.TimeoutExpired:
            kill_all(proc)
            kills.append(round(moment, 2))
            continue
        if proc.returncode != 0:
            return {"kills": kills, "resumes": resumes, "failed": proc.stderr.read()[-2000:]}
        return {"kills": kills, "resumes": resumes}


def main(args: Args) -> int:
    sys.path.insert(0, str(ROOT / "benchmark"))
    import tiny_world

    temporary = tempfile.TemporaryDirectory()
    world = Path(args.world or Path(temporary.name) / "world")
    if args.world is None:
        tiny_world.build(tiny_world.Args(output_dir=str(world), num_sft=600, num_preference=600,
                                         num_preference_validation=200, num_validation=64, num_test=64))  # fmt: skip
    rng, results = random.Random(args.seed), []
    for script in args.scripts:
        for nproc in args.nproc:
            base = Path(temporary.name) / f"{script}-{nproc}"
            reference, reference_runs = base / "reference", base / "reference-runs"
            began = time.time()
            proc = start(script_flags(script, world, reference, reference_runs), nproc)
            if proc.wait() != 0:
                raise SystemExit(
                    f"kill_trials.py: the uninterrupted {script} run failed:\n{proc.stderr.read()}"
                )
            wall = time.time() - began
            for i in range(args.trials):
                work = base / f"trial-{i}"
                row = {"script": script, "nproc": nproc, "reference_seconds": round(wall, 1)}
                row |= trial(script, nproc, world, work, wall, rng, args)
                if "failed" not in row:
                    row["bit_exact"], row["metrics_equal"] = same_run(
                        reference, work / "out", reference_runs, work / "runs"
                    )
                results.append(row)
                print(json.dumps(row), flush=True)
    good = [r for r in results if r.get("bit_exact") and r.get("metrics_equal")]
    print(f"{len(good)} of {len(results)} trials bit-exact with equal metrics")
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record = {"command": " ".join(["python", *sys.argv]), "commit": commit, "torch": torch.__version__,
              "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(), "trials": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if len(good) == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
