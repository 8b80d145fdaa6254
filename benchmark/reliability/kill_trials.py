"""Preemption by kill -9: runs killed at random moments (SIGKILL to every process, possibly several times) and
resumed with `--resume_from_checkpoint latest` until they finish, compared with an uninterrupted run: the
final weights bit for bit, metrics.jsonl step for step (timings aside). Each kill moment is uniform in (0, T),
T the uninterrupted run's wall time; a resumed run is killed again with probability --kill_again (at most 3
kills a trial). Two probes per script and process count kill once at a chosen state instead: as soon as
metrics.jsonl has a step and no checkpoint is started (a missing output folder is then made empty, as a
requeue script's `mkdir -p` would), and while the first tmp-checkpoint-N is being written.

    python benchmark/reliability/kill_trials.py --trials 7          # sft.py and rloo.py, 1 and 2 processes
    python benchmark/reliability/kill_trials.py --scripts dpo ppo grpo --nproc 2 --trials 3 --work /tmp/kills
    python benchmark/reliability/kill_trials.py --nproc 2 --zero_stage 2 --trials 3  # under DeepSpeed ZeRO-2 (CPU)

Writes --out (benchmark/results/kill_trials.json); exits 1 when a trial is not bit-identical.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import shlex
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

ROOT = Path(__file__).resolve().parents[2]
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
       "PYTHONHASHSEED": "0"}  # fmt: skip
TIMING = ("eps", "second", "time")  # metric names holding these words differ between runs
SCRIPTS = ("sft", "dpo", "reward", "ppo", "rloo", "grpo", "online_dpo")


@dataclass
class Args:
    scripts: list[str] = field(default_factory=lambda: ["sft", "rloo"])
    """among sft, dpo, reward, ppo, rloo, grpo, online_dpo"""
    nproc: list[int] = field(default_factory=lambda: [1, 2])
    """process counts (2: torchrun on CPU, gloo)"""
    trials: int = 7
    """randomly killed runs per script and process count"""
    probes: bool = True
    """also kill once at an output folder without checkpoints, and once at a half-written tmp-checkpoint-N"""
    kill_again: float = 0.5
    """probability of killing a resumed run again (at most 3 kills a trial)"""
    seed: int = 0
    """seeds the kill moments"""
    world: str | None = None
    """a tiny world built before (benchmark/tiny/tiny_world.py); None: built under --work"""
    work: str | None = None
    """where the runs go, kept for a look afterwards; None: a temporary folder, removed at the end"""
    out: str = "benchmark/results/kill_trials.json"
    zero_stage: int = 0
    """0: plain processes (torchrun); 2 or 3: DeepSpeed ZeRO-2/3 through accelerate launch with
    accelerate_configs/deepspeed_zero{2,3}.yaml on CPU processes in float32 (--nproc of 2 or more)"""


def script_flags(script: str, world: Path, out: Path, runs: Path) -> list[str]:
    """64 steps (RL: 32 updates on one process; grpo, online DPO: 16), a checkpoint every 4th (2 kept),
    metrics every step: training, not start-up, takes most of the wall time, so most kills land in it."""
    common = ["--output_dir", str(out), "--logging_dir", str(runs), "--run_name", "run", "--save_steps", "4",
              "--save_total_limit", "2", "--seed", "3", "--learning_rate", "1e-3",
              "--dataset_name", str(world / "dataset")]  # fmt: skip
    if script in ("sft", "dpo", "reward"):
        model = world / ("reward" if script == "reward" else "policy")
        split = "sft" if script == "sft" else "preference"
        return [f"{script}.py", "--model_name_or_path", str(model), "--dataset_train_split", split,
                "--eval_strategy", "no", "--max_length", "96", "--per_device_train_batch_size", "4",
                "--gradient_accumulation_steps", "2", "--max_steps", "64", "--logging_steps", "1",
                *common]  # fmt: skip
    if script in ("grpo", "online_dpo"):
        length = "--max_completion_length" if script == "grpo" else "--max_new_tokens"
        group = ["--num_generations", "4"] if script == "grpo" else []
        return [f"{script}.py", "--model_name_or_path", str(world / "policy"), "--reward_model_path",
                str(world / "reward"), "--dataset_train_split", "sft", length, "8",
                "--num_sample_generations", "0", "--per_device_train_batch_size", "4", "--max_steps", "16",
                *group, *common]  # fmt: skip
    extra = ["--rloo_k", "2", "--normalize_advantage"] if script == "rloo" else ["--whiten_rewards"]
    return [f"{script}.py", "--sft_model_path", str(world / "policy"), "--reward_model_path",
            str(world / "reward"), "--dataset_train_split", "sft", "--response_length", "6",
            "--max_prompt_length", "16", "--local_rollout_forward_batch_size", "4", "--num_ppo_epochs", "2",
            "--gradient_accumulation_steps", "2", "--num_sample_generations", "0", "--total_episodes", "512",
            *extra, *common]  # fmt: skip


def command(argv: list[str], nproc: int, zero_stage: int) -> tuple[list[str], dict]:
    """The command line and extra environment of a run; several processes through torchrun (as accelerate),
    or accelerate launch under --zero_stage 2/3 (ACCELERATE_USE_CPU false there: true turns DeepSpeed off)."""
    if nproc == 1:
        return [sys.executable, *argv], dict(ENV)
    port = str(random.randint(20000, 60000))
    if zero_stage:
        config = ROOT / "accelerate_configs" / f"deepspeed_zero{zero_stage}.yaml"
        launch = ["-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", str(nproc),
                  "--mixed_precision", "no", "--main_process_port", port]  # fmt: skip
        return [sys.executable, *launch, *argv], {
            **ENV,
            "DS_ACCELERATOR": "cpu",
            "ACCELERATE_USE_CPU": "false",
        }
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
            *argv], {**ENV, "ACCELERATE_USE_CPU": "true"}  # fmt: skip


def shell_line(argv: list[str], nproc: int, zero_stage: int) -> str:
    """The command to paste into a shell to run it again."""
    line, env = command(argv, nproc, zero_stage)
    return " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(line)


def start(argv: list[str], nproc: int, zero_stage: int, log: Path) -> subprocess.Popen:
    """A run in a session of its own, its output appended to `log` (a pipe could fill and stall it)."""
    line, env = command(argv, nproc, zero_stage)
    with open(log, "a") as f:
        f.write(f"\n$ {shlex.join(line)}\n")
        f.flush()
        return subprocess.Popen(line, cwd=ROOT, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers may start sessions of their own)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def kill_all(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def folder_state(out: Path) -> str:
    """What a kill left in the output folder: first and last checkpoints, unfinished ones, the final model."""
    if not out.is_dir():
        return "no folder"
    names = os.listdir(out)
    done = sorted(int(n.split("-")[1]) for n in names if re.fullmatch(r"checkpoint-\d+", n))
    parts = [f"checkpoint-{done[0]}" + (f"..{done[-1]}" if len(done) > 1 else "")] if done else []
    parts += sorted(n for n in names if n.startswith("tmp-checkpoint"))
    parts += ["final model"] if "model.safetensors" in names else []
    others = [n for n in names if "checkpoint" not in n and n != "model.safetensors"]
    return " + ".join(parts + ([f"{len(others)} other files"] if others else [])) or "empty"


def unfinished(work: Path) -> bool:
    """A checkpoint is being written."""
    out = work / "out"
    return out.is_dir() and any(n.startswith("tmp-checkpoint") for n in os.listdir(out))


def logged_before_checkpoint(work: Path) -> bool:
    """Steps are in metrics.jsonl, no checkpoint is started: starting over must not log them twice."""
    metrics, out = work / "runs" / "run" / "metrics.jsonl", work / "out"
    started = out.is_dir() and any("checkpoint" in n for n in os.listdir(out))
    return metrics.exists() and metrics.stat().st_size > 0 and not started


def compare(reference: Path, trial: Path) -> dict:
    """Weights bit-identical, each step logged once, metrics.jsonl equal to the reference's but timings."""
    a, b = load_file(reference / "out" / "model.safetensors"), load_file(trial / "out" / "model.safetensors")

    def lines(work: Path) -> list[dict]:
        rows = [json.loads(line) for line in open(work / "runs" / "run" / "metrics.jsonl") if line.strip()]
        return [{k: v for k, v in row.items() if not any(word in k for word in TIMING)} for row in rows]

    steps = [row.get("step") for row in lines(trial)]
    return {"bit_exact": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "steps_once": len(steps) == len(set(steps)),
            "metrics_equal": lines(reference) == lines(trial)}  # fmt: skip


def trial(script: str, nproc: int, world: Path, work: Path, wall: float, rng: random.Random, args: Args,
          probe=None) -> dict:  # fmt: skip
    """One run killed (at random moments, or once when `probe(work)` holds) and resumed until it finishes."""
    argv = script_flags(script, world, work / "out", work / "runs")
    kills, states, resumes = [], [], 0
    while True:
        resume = ["--resume_from_checkpoint", "latest"] if kills else []
        proc, began = start(argv + resume, nproc, args.zero_stage, work / "log.txt"), time.time()
        resumes += bool(kills)
        kill_now = len(kills) < 3 and (not kills or (probe is None and rng.random() < args.kill_again))
        moment = rng.uniform(0, wall) if kill_now and probe is None else None
        due = False
        while proc.poll() is None and not due and time.time() - began < 20 * wall + 60:
            time.sleep(0.002 if probe else 0.01)
            due = kill_now and (probe(work) if probe else time.time() - began >= moment)
        if due and proc.poll() is None:
            kill_all(proc)
            kills.append(round(time.time() - began, 2))
            states.append(folder_state(work / "out"))
            if probe and not (work / "out").exists():  # as a requeue script's `mkdir -p` would leave it
                (work / "out").mkdir()
                states[-1] += ", then made empty"
            continue
        row = {"kills": kills, "states": states, "resumes": resumes}
        if probe and not kills:
            row["probe_missed"] = True  # the run ended before the state showed
        if proc.poll() is None:
            kill_all(proc)
            return row | {"failed": "hung", "command": shell_line(argv + resume, nproc, args.zero_stage)}
        if proc.returncode != 0:
            tail = (work / "log.txt").read_text()[-2000:]
            return row | {"failed": tail, "command": shell_line(argv + resume, nproc, args.zero_stage)}
        return row


def git(*words: str) -> str:
    return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True).stdout


def good(row: dict) -> bool:
    return bool(row.get("bit_exact") and row.get("metrics_equal") and row.get("steps_once"))


def line(row: dict) -> str:
    """One trial: where it was killed, what the kills left, how it compares."""
    yes = {True: "yes", False: "NO", None: "-"}
    text = (f"{row['script']:10} nproc={row['nproc']} {row['kind']:20} kills at {row['kills']} s "
            f"({'; '.join(row['states'])}), {row['resumes']} resumes: bit-exact {yes[row.get('bit_exact')]}, "
            f"metrics equal {yes[row.get('metrics_equal')]}, "
            f"steps once {yes[row.get('steps_once')]}")  # fmt: skip
    return text + (f"\n  FAILED: {row['command']}\n{row['failed']}" if "failed" in row else "")


def main(args: Args) -> int:
    if set(args.scripts) - set(SCRIPTS):
        raise SystemExit(f"kill_trials.py: error: --scripts takes some of {', '.join(SCRIPTS)}.")
    if args.zero_stage not in (0, 2, 3) or args.zero_stage and min(args.nproc) < 2:
        raise SystemExit(
            "kill_trials.py: error: --zero_stage takes 0, 2 or 3, and 2 or 3 need --nproc 2 or more."
        )
    sys.path.insert(0, str(ROOT / "benchmark" / "tiny"))
    import tiny_world

    temporary = tempfile.TemporaryDirectory()
    base = Path(args.work or temporary.name)
    world = Path(args.world or base / "world")
    if args.world is None and not (world / "dataset").exists():
        sizes = dict(num_sft=600, num_preference=600, num_preference_validation=200, num_validation=64,
                     num_test=64)  # fmt: skip
        tiny_world.build(tiny_world.Args(output_dir=str(world), **sizes))
    # the tree the runs start from: other work may change it while they go
    commit, changed = git("rev-parse", "HEAD").strip(), git("status", "--porcelain", "--untracked-files=no")
    changed = [entry[3:] for entry in changed.splitlines()]
    rng, results = random.Random(args.seed), []
    probes = (
        {"logged, no checkpoint": logged_before_checkpoint, "tmp-checkpoint": unfinished}
        if args.probes
        else {}
    )
    for script in args.scripts:
        for nproc in args.nproc:
            folder = base / f"{script}-{nproc}"
            reference = folder / "reference"
            reference.mkdir(parents=True)
            argv = script_flags(script, world, reference / "out", reference / "runs")
            began = time.time()
            if start(argv, nproc, args.zero_stage, reference / "log.txt").wait() != 0:
                print((reference / "log.txt").read_text()[-3000:])
                raise SystemExit(
                    f"kill_trials.py: the uninterrupted run failed: {shell_line(argv, nproc, args.zero_stage)}"
                )
            wall = time.time() - began
            kinds = [("random", None)] * args.trials + list(probes.items())
            for i, (kind, probe) in enumerate(kinds):
                work = folder / f"trial-{i}"
                work.mkdir()
                row = {"script": script, "nproc": nproc, "zero_stage": args.zero_stage, "kind": kind,
                       "reference_seconds": round(wall, 1)}  # fmt: skip
                row |= trial(script, nproc, world, work, wall, rng, args, probe)
                if "failed" not in row:
                    row |= compare(reference, work)
                results.append(row)
                print(line(row), flush=True)
    print(
        f"\n{'script':10} {'nproc':>5} {'trials':>6} {'kills':>5} {'resumes':>7} {'exact':>5} {'failed':>6}"
    )
    for script in args.scripts:
        for nproc in args.nproc:
            rows = [r for r in results if (r["script"], r["nproc"]) == (script, nproc)]
            kills, resumes = sum(len(r["kills"]) for r in rows), sum(r["resumes"] for r in rows)
            failed = sum("failed" in r for r in rows)
            exact = sum(map(good, rows))
            print(f"{script:10} {nproc:5} {len(rows):6} {kills:5} {resumes:7} {exact:5} {failed:6}")
    print(f"{sum(map(good, results))} of {len(results)} trials bit-exact with equal metrics, each step once")

    record = {"command": shlex.join(["python", *sys.argv]), "commit": commit, "uncommitted": changed,
              "torch": torch.__version__, "cpus": os.cpu_count(),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "trials": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(map(good, results)) else 1


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
