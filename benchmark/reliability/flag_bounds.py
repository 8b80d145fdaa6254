"""Every numeric flag at an impossible value: does the script say so in one line, or end in a traceback?

    python benchmark/reliability/flag_bounds.py                       # all nine scripts but ddpo.py, ~10 min
    python benchmark/reliability/flag_bounds.py --scripts rloo.py grpo.py

Each int or float field of a script's `Args` (the sizes it fills in at run time left out) is set to -1, and an int
one also to 0, on the tiny command of benchmark/reliability/mistaken_commands.py (its BASE, on a tiny world). A run
is "ok" when it has no traceback: it trains (the value means something, e.g. --max_steps -1) or stops with its
`script.py: ...` line. It writes benchmark/results/flag_bounds.json and prints the runs that are not ok. A
benchmark, not a test: the cases found are kept as tests (tests/test_errors.py).
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmark", "reliability")]

import mistaken_commands  # noqa: E402  the tiny commands and the bad files

SCRIPTS = ("sft.py", "reward.py", "dpo.py", "ppo.py", "rloo.py", "grpo.py", "online_dpo.py", "ilql.py")
FILLED = {"world_size", "local_batch_size", "batch_size", "local_mini_batch_size", "mini_batch_size",
          "local_dataloader_batch_size", "num_total_batches", "local_generation_batch_size",
          "local_prompts_per_generation", "steps_per_generation_round"}  # fmt: skip
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass
class Args:
    world: str | None = None
    """a tiny world built by benchmark/tiny/tiny_world.py (None: build a small one in a temporary folder)"""
    scripts: tuple[str, ...] = SCRIPTS
    """the scripts to probe"""
    jobs: int = 2
    """runs at once"""
    output: str = os.path.join(ROOT, "benchmark", "results", "flag_bounds.json")
    """where the results go"""


def numeric_flags(script: str) -> list[tuple[str, list[str]]]:
    """(flag, values to try) for each int or float field of the script's Args."""
    module = __import__(script.removesuffix(".py"))
    hints = typing.get_type_hints(module.Args)
    flags = []
    for field in dataclasses.fields(module.Args):
        kinds = {hints[field.name], *typing.get_args(hints[field.name])}
        if field.name in FILLED or bool in kinds or not kinds & {int, float}:
            continue
        flags.append((field.name, ["-1", "0"] if int in kinds else ["-1"]))
    return flags


def run_case(script: str, base: list[str], flag: str, value: str, work: str) -> dict:
    out = os.path.join(work, f"out_{script}_{flag}_{value}")
    command = [sys.executable, script, *base, f"--{flag}", value, "--output_dir", out]
    start = time.time()
    try:
        env = {**os.environ, **OFFLINE, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        code, stderr = "timeout", ""
    shutil.rmtree(out, ignore_errors=True)
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    lines = [line for line in lines if not any(bar in line for bar in mistaken_commands.PROGRESS_BARS)]
    ok = code != "timeout" and "Traceback" not in stderr
    return {"script": script, "flag": f"--{flag}", "value": value, "exit": code, "ok": ok,
            "last": lines[-1][:300] if lines else "", "seconds": round(time.time() - start, 1)}  # fmt: skip


def main(args: Args) -> None:
    work = tempfile.mkdtemp(prefix="flag_bounds_")
    world = mistaken_commands.tiny_world_in(args.world, work)
    bad = os.path.join(work, "bad")
    os.makedirs(bad)
    mistaken_commands.make_bad_files(bad)
    cases = []
    for script in args.scripts:
        base = mistaken_commands.BASE[script].format(w=world, bad=bad).split()
        cases += [
            (script, base, flag, value, work) for flag, values in numeric_flags(script) for value in values
        ]
    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda case: run_case(*case), cases))
    shutil.rmtree(work, ignore_errors=True)
    for r in results:  # paths of this machine out of the record
        r["last"] = r["last"].replace(world, "tiny_world").replace(bad, "bad").replace(work, "work")
    bad_runs = [r for r in results if not r["ok"]]
    summary = {"runs": len(results), "ok": len(results) - len(bad_runs), "seconds": round(time.time() - start),
               "scripts": list(args.scripts), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"summary": summary, "results": results}, f, indent=1)
    for r in bad_runs:
        print(f"{r['script']:14} {r['flag']} {r['value']:>3}  exit {r['exit']}  {r['last'][:120]}")
    print(f"{summary['ok']} of {summary['runs']} runs without a traceback, in {summary['seconds']} s")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
