"""A researcher's first hour (#52): the mistaken commands a new user types, run on the tiny world.

    python benchmark/reliability/mistaken_commands.py            # about 4 minutes on 2 CPU cores

Each case runs one script with one mistake (a wrong path, a tokenizer folder given as the model, a typo'd flag,
a wrong value or choice, missing data columns, a single jsonl without a test split, batch sizes that do not
divide, a reward function file that is missing, lacks the function or does not parse, --use_vllm without vllm)
and records the exit code, the number of stderr lines, the last one and the seconds. "ok" means one line or
success: no traceback anywhere, and the run exits 0 or ends with a line `script.py: ...` that is its only
stderr line but progress bars (`other_lines` counts the rest: warnings, notes). It writes
benchmark/results/mistaken_commands.json and prints the table. A benchmark, not a test: some cases wait for
other work (see the `note` of each case).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = {  # enough for each script to run on the tiny world; a case's flags replace these
    "sft.py": "--model_name_or_path {w}/policy --dataset_name {w}/dataset --dataset_train_split sft "
    "--dataset_test_split validation --per_device_train_batch_size 4 --total_steps 2",
    "reward.py": "--model_name_or_path {w}/reward --dataset_name {w}/dataset --dataset_train_split preference "
    "--dataset_test_split preference_validation --per_device_train_batch_size 4 --total_steps 2",
    "dpo.py": "--model_name_or_path {w}/policy --dataset_name {w}/dataset --dataset_train_split preference "
    "--dataset_test_split preference_validation --per_device_train_batch_size 4 --max_steps 2",
    "ppo.py": "--sft_model_path {w}/policy --reward_model_path {w}/reward --dataset_name {w}/dataset "
    "--dataset_train_split sft --per_device_train_batch_size 4 --local_rollout_forward_batch_size 4 "
    "--response_length 6 --total_episodes 8 --num_sample_generations 0",
    "rloo.py": "--sft_model_path {w}/policy --reward_model_path {w}/reward --dataset_name {w}/dataset "
    "--dataset_train_split sft --per_device_train_batch_size 4 --rloo_k 2 --local_rollout_forward_batch_size 4 "
    "--response_length 6 --total_episodes 8 --num_sample_generations 0",
    "grpo.py": "--model_name_or_path {w}/policy --reward_model_path {w}/reward --dataset_name {w}/dataset "
    "--dataset_train_split sft --per_device_train_batch_size 4 --num_generations 2 --max_completion_length 6 "
    "--max_steps 1 --num_sample_generations 0",
    "online_dpo.py": "--model_name_or_path {w}/policy --reward_model_path {w}/reward --dataset_name {w}/dataset "
    "--dataset_train_split sft --per_device_train_batch_size 4 --max_new_tokens 6 --max_steps 1 "
    "--num_sample_generations 0",
    "ilql.py": "--model_name_or_path {w}/policy --dataset_name {bad}/ilql.jsonl --dataset_train_split train "
    "--per_device_train_batch_size 4 --max_steps 2",
    "ddpo.py": "--pretrained_model {bad}/no_pipeline --num_epochs 1",
}

PROGRESS_BARS = ("it/s]", "s/it]", "%|", "examples/s]")  # tqdm lines on stderr: not messages

REWARDS = "def f(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"

# (script, flags, what the user got wrong, note[, "no_vllm"]); {w}: the tiny world, {bad}: the files made here
CASES = [
    ("sft.py", "--model_name_or_path {w}/tokenizer", "tokenizer folder as the model", ""),
    ("sft.py", "--model_name_or_path {bad}/empty", "empty folder as the model", ""),
    ("sft.py", "--model_name_or_path ./models/sft", "model path that does not exist (./)", ""),
    ("sft.py", "--dataset_name data/tldr", "dataset path that does not exist (reads as a hub id)", ""),
    ("sft.py", "--dataset_name {w}/dataset/sft.jsonl --dataset_train_split train --dataset_test_split test",
     "one jsonl file, asking for a test split", ""),
    ("sft.py", "--dataset_name {w}/dataset/sft.jsonl --dataset_train_split train --dataset_test_split UNSET",
     "one jsonl file, default test split", "sft skipping a missing test split: other work"),
    ("sft.py", "--learning_rat 1e-3", "typo'd flag", ""),
    ("sft.py", "--lr_scheduler_type cosin", "wrong choice", "wrong values as one line: other work (parse_args)"),
    ("sft.py", "--total_steps ten", "wrong value type", "wrong values as one line: other work (parse_args)"),
    ("sft.py", "--dataset_name {bad}/wrong.jsonl --dataset_train_split train --eval_strategy no",
     "dataset without the columns SFT reads", ""),
    ("reward.py", "--model_name_or_path {w}/tokenizer", "tokenizer folder as the model", ""),
    ("reward.py", "--dataset_train_split sft", "prompt-completion data for a reward model", ""),
    ("reward.py", "--model_name_or_path some-org/not-a-model", "hub id that is not reachable", ""),
    ("reward.py", "--eval_strategy step", "wrong choice", "wrong values as one line: other work (parse_args)"),
    ("dpo.py", "--dataset_name {w}/dataset/preference.jsonl --dataset_train_split train --dataset_test_split UNSET",
     "one jsonl file, default test split", "dpo skipping a missing test split: other work"),
    ("dpo.py", "--beta abc", "wrong value type", "wrong values as one line: other work (parse_args)"),
    ("dpo.py", "--dataset_train_split sft --dataset_test_split validation", "no chosen/rejected columns", ""),
    ("dpo.py", "--model_name_or_path {w}/dataset", "dataset folder as the model", ""),
    ("dpo.py", "--dataset_train_split preferences", "split that does not exist", ""),
    ("ppo.py", "--reward_model_path None", "no reward at all", ""),
    ("ppo.py", "--reward_model_path None --reward_fn {bad}/nowhere.py:f", "reward file that does not exist", ""),
    ("ppo.py", "--reward_model_path None --reward_fn {bad}/rewards.py:g", "reward file without the function", ""),
    ("ppo.py", "--reward_model_path None --reward_fn {bad}/syntax.py:f", "reward file that does not parse", ""),
    ("ppo.py", "--num_mini_batches 3", "--total_episodes below one update's episodes", ""),
    ("rloo.py", "--rloo_k 1", "rloo_k 1 (no leave-one-out baseline)", ""),
    ("rloo.py", "--use_vllm", "--use_vllm without vllm installed", "vllm hidden by a stub that fails to import",
     "no_vllm"),
    ("rloo.py", "--sft_model_path {w}/tokenizer", "tokenizer folder as the model", ""),
    ("rloo.py", "--reward_model_path ./models/reward", "reward model path that does not exist", ""),
    ("rloo.py", "--per_device_train_batch_size 3", "batch not a multiple of rloo_k", ""),
    ("grpo.py", "--num_generations 3", "batch not a multiple of num_generations", ""),
    ("grpo.py", "--reward_model_path None --reward_funcs {bad}/nowhere.py:f", "reward file that does not exist", ""),
    ("grpo.py", "--use_vllm", "--use_vllm on a CPU machine", "vllm is installed here: it runs on the CPU"),
    ("grpo.py", "--model_name_or_path {w}/tokenizer", "tokenizer folder as the model", ""),
    ("online_dpo.py", "--reward_model_path None", "no reward model, function or judge", ""),
    ("online_dpo.py", "--reward_model_path {w}/policy", "causal LM as the reward model", ""),
    ("online_dpo.py", "--dataset_name {bad}/wrong.jsonl --dataset_train_split train", "no prompt column", ""),
    ("ilql.py", "--dataset_name {w}/dataset --dataset_train_split sft", "no reward column", ""),
    ("ilql.py", "--model_name_or_path {bad}/empty", "empty folder as the model", ""),
    ("ddpo.py", "--pretrained_model {w}/policy", "causal LM as the diffusion pipeline", ""),
    ("ddpo.py", "--prompt_file {bad}/prompts.txt", "prompt file that does not exist", ""),
    ("ddpo.py", "--reward_fn jpeg_compressability", "typo'd reward name", ""),
]  # fmt: skip


@dataclass
class Args:
    world: str | None = None
    """a tiny world built by benchmark/tiny/tiny_world.py (None: build a small one in a temporary folder)"""
    jobs: int = 2
    """cases run at once"""
    only: str | None = None
    """run only the cases whose script or mistake contains this text"""
    offline: bool = False
    """set HF_HUB_OFFLINE=1 (default: as a new user's shell, online, so a hub id is tried once)"""
    output: str = os.path.join(ROOT, "benchmark", "results", "mistaken_commands.json")
    """where the results go"""


def make_bad_files(bad: str) -> None:
    os.makedirs(os.path.join(bad, "empty"), exist_ok=True)
    os.makedirs(os.path.join(bad, "no_pipeline"), exist_ok=True)
    with open(os.path.join(bad, "wrong.jsonl"), "w") as f:
        f.writelines(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(16))
    with open(os.path.join(bad, "ilql.jsonl"), "w") as f:
        f.writelines(
            json.dumps({"prompt": f"p{i}", "completion": " c", "reward": 1.0}) + "\n" for i in range(16)
        )
    with open(os.path.join(bad, "rewards.py"), "w") as f:
        f.write(REWARDS)
    with open(os.path.join(bad, "syntax.py"), "w") as f:
        f.write("def f(prompts, completions:\n    return 0\n")
    os.makedirs(os.path.join(bad, "no_vllm"), exist_ok=True)
    with open(os.path.join(bad, "no_vllm", "vllm.py"), "w") as f:  # first on PYTHONPATH: as if not installed
        f.write("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")


def command(script: str, flags: str, world: str, bad: str, out: str) -> list[str]:
    """The script's base flags, those the case gives replaced, then the case's (`--flag UNSET`: left out)."""
    given = [t for t in flags.split() if t.startswith("--")]
    base, kept = BASE[script].split(), []
    i = 0
    while i < len(base):
        end = i + 1
        while end < len(base) and not base[end].startswith("--"):
            end += 1
        if base[i] not in given:
            kept += base[i:end]
        i = end
    case = flags.split()
    case = [t for i, t in enumerate(case) if t != "UNSET" and case[i + 1 : i + 2] != ["UNSET"]]
    argv = [*kept, *case, "--output_dir", out]
    return [script, *(a.format(w=world, bad=bad) for a in argv)]


def run_case(case, world: str, bad: str, env: dict) -> dict:
    script, flags, mistake, note, *hidden = case
    if hidden:
        env = {**env, "PYTHONPATH": os.path.join(bad, "no_vllm")}
    out = tempfile.mkdtemp(prefix="out-", dir=bad)
    shutil.rmtree(out)
    argv = command(script, flags, world, bad, out)
    start = time.time()
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    seconds = time.time() - start
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    last = lines[-1].split("\r")[-1] if lines else ""
    traceback = "Traceback" in proc.stderr
    others = [line for line in lines[:-1] if not any(bar in line for bar in PROGRESS_BARS)]
    one_line = not traceback and (proc.returncode == 0 or (not others and last.startswith(f"{script}: ")))
    shown = " ".join(argv).replace(world, "tiny_world").replace(bad, "bad")
    return {"script": script, "mistake": mistake, "command": f"python {shown}", "exit": proc.returncode,
            "stderr_lines": len(lines), "other_lines": len(others), "traceback": traceback, "last_line": last.replace(world, "tiny_world").replace(bad, "bad"),
            "seconds": round(seconds, 1), "one_line_or_success": one_line, "note": note}  # fmt: skip


def tiny_world_in(world: str | None, folder: str) -> str:
    """`world`, or a small tiny world built in `folder` when None; its absolute path."""
    if world is None:
        sys.path.insert(0, os.path.join(ROOT, "benchmark", "tiny"))
        import tiny_world

        world = os.path.join(folder, "world")
        sizes = dict(
            num_sft=200, num_preference=200, num_preference_validation=40, num_validation=40, num_test=40
        )
        tiny_world.build(tiny_world.Args(output_dir=world, **sizes))
    return os.path.abspath(world)


def main(args: Args) -> None:
    bad = tempfile.mkdtemp(prefix="mistaken-")
    world = tiny_world_in(args.world, bad)
    make_bad_files(bad)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
        if args.offline:
            env[name] = "1"
    cases = [c for c in CASES if args.only is None or args.only in c[0] or args.only in c[2]]
    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda case: run_case(case, world, bad, env), cases))
    shutil.rmtree(bad, ignore_errors=True)
    ok = sum(r["one_line_or_success"] for r in results)
    summary = {"cases": len(results), "one_line_or_success": ok, "seconds": round(time.time() - start),
               "offline": args.offline, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    if args.only is None:
        with open(args.output, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)
    for i, r in enumerate(results):
        mark = "ok " if r["one_line_or_success"] else "NO "
        print(f"{i:2} {mark} {r['script']:13} {r['exit']:3} {r['stderr_lines']:3} {r['seconds']:5.1f}s "
              f"{r['mistake'][:40]:40} | {r['last_line'][:150]}")  # fmt: skip
    print(f"{ok} of {len(results)} one line or success, in {summary['seconds']} s")


if __name__ == "__main__":
    main(tyro.cli(Args))
