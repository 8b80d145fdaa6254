"""A verifiable-reward benchmark on the tiny world: grpo.py (loss types grpo, dr_grpo, dapo) against rloo.py.

The task: after `TL;DR:` name the post's facts (its key words, in the order they appear) and nothing else. The
reward is an exact match, 1 or 0 (`facts_in_order`, computed from the prompt alone: no reward model, no judge).
The SFT start imitates the tiny world's references, which usually omit the last fact and often end with a hedge
word, so it is rarely exactly right; RL from the verifiable reward has to learn to name the last fact and to
drop the hedge.

    nice -n 10 python benchmark/tiny/verifiable.py --work_dir benchmark/work_grpo --seeds 1 2 3

runs, in `--work_dir`: the world, SFT (sft.py, once, reused by every seed), then for every seed and method one
RL run from the SFT model with the same number of sampled completions (`--generations` batches of
`--prompts_per_generation` prompts x `--group_size` completions), `--jobs` at a time; then a greedy evaluation
of every final policy on the test posts. Writes benchmark/results/grpo_verifiable.json (curves, table, commands)
and grpo_verifiable.png (the training reward against the completions sampled, mean over seeds).
"""

import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_world import KEY_WORDS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = set(KEY_WORDS)


# ----------------------------------------------------------------------------------------------------------------
# The verifiable reward (loaded by grpo.py / rloo.py as benchmark/tiny/verifiable.py:facts_in_order; the file
# must stay loadable as a bare module, hence no `from __future__ import annotations` above the dataclass)
# ----------------------------------------------------------------------------------------------------------------
def post_facts(prompt: str) -> list[str]:
    """The key words of the prompt's POST, in order (the tiny world's facts)."""
    post = prompt.split("POST:", 1)[-1].split("TL;DR:", 1)[0]
    return [word for word in post.split() if word in KEYS]


def facts_in_order(prompts: list[str], completions: list[str]) -> list[float]:
    """1.0 when the completion is exactly the post's facts in order (words separated by spaces), else 0.0."""
    return [float(c.split() == post_facts(p)) for p, c in zip(prompts, completions)]


# ----------------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Args:
    work_dir: str = "benchmark/work_grpo"
    """world, models, logs and TensorBoard runs go here"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """RL seeds (the world and the SFT model are shared)"""
    methods: list[str] = field(default_factory=lambda: ["grpo", "dr_grpo", "dapo", "rloo"])
    """which of grpo, dr_grpo, dapo (grpo.py) and rloo (rloo.py) to run"""
    post_words: int = 15
    """words per post in the world (tiny_world.py's default is 30; shorter posts make every step cheaper)"""
    sft_steps: list[int] = field(default_factory=lambda: [500, 700, 1800])
    """SFT rounds, optimizer steps of batch 32 each; each round starts from the one before (a cosine schedule
    per round), so a short first round can be extended without redoing it"""
    generations: int = 150
    """sampling rounds of every RL run"""
    prompts_per_generation: int = 16
    """prompts per sampling round"""
    group_size: int = 4
    """completions per prompt (--num_generations / --rloo_k)"""
    learning_rate: float = 3e-4
    """RL learning rate, every method (1e-3 rose faster, then collapsed in 2 of 4 runs)"""
    temperature: float = 0.7
    """sampling temperature, every method"""
    jobs: int = 2
    """RL runs at a time"""
    threads: int = 1
    """OMP threads per run"""
    results: str = "benchmark/results/grpo_verifiable"
    """prefix of the .json and .png written"""
    report_only: bool = False
    """launch nothing: report the runs that exist (finished or not)"""
    evaluate_test: bool = True
    """also score every finished policy greedily on the test posts"""


def commands(args: Args) -> tuple[dict, dict]:
    """(stage commands, RL commands keyed by (method, seed)), each a list of arguments to python."""
    w = args.work_dir
    data, logs = f"{w}/world/dataset", ["--logging_dir", f"{w}/runs"]
    stages = {
        "world": [
            "benchmark/tiny/tiny_world.py",
            "--output_dir",
            f"{w}/world",
            "--seed",
            "0",
            "--post_words",
            str(args.post_words),
            "--num_test",
            "200",  # the size its committed results were measured at (tiny_world.py's default is now 1000)
        ],
    }
    start = f"{w}/world/policy"
    for i, steps in enumerate(args.sft_steps):
        name = "sft" if i == 0 else f"sft{i + 1}"
        stages[name] = ["sft.py", "--model_name_or_path", start, "--dataset_name", data, "--dataset_train_split", "sft",
                        "--dataset_test_split", "validation", "--output_dir", f"{w}/{name}", "--max_length", "128",
                        "--response_length", "8", "--learning_rate", "3e-3", "--lr_scheduler_type", "cosine",
                        "--warmup_ratio", "0.05", "--per_device_train_batch_size", "32", "--total_steps", str(steps),
                        "--eval_steps", "500", "--run_name", name, *logs]  # fmt: skip
        start = f"{w}/{name}"
    batch = args.prompts_per_generation * args.group_size  # completions per sampling round, every method
    common = ["--dataset_name", data, "--dataset_train_split", "sft", "--learning_rate", str(args.learning_rate),
              "--temperature", str(args.temperature), "--max_grad_norm", "1.0", "--num_sample_generations", "0",
              "--lr_scheduler_type", "constant", *logs]  # fmt: skip
    grpo_common = ["grpo.py", "--model_name_or_path", start, "--reward_funcs",
                   "benchmark/tiny/verifiable.py:facts_in_order", "--num_generations", str(args.group_size),
                   "--per_device_train_batch_size", str(batch // 2), "--steps_per_generation", "2",
                   "--max_completion_length", "8", "--max_steps", str(2 * args.generations), *common]  # fmt: skip
    variants = {
        "grpo": ["--loss_type", "grpo", "--scale_rewards", "group"],
        "dr_grpo": ["--loss_type", "dr_grpo", "--scale_rewards", "none"],
        "dapo": ["--loss_type", "dapo", "--scale_rewards", "group", "--epsilon_high", "0.28"],
    }
    runs = {}
    for seed in args.seeds:
        for method in args.methods:
            name = f"{method}_s{seed}"
            out = [
                "--output_dir",
                f"{w}/{name}",
                "--run_name",
                name,
                "--seed",
                str(seed),
                "--overwrite_output_dir",
            ]
            if method == "rloo":
                runs[method, seed] = [
                    "rloo.py", "--sft_model_path", start, "--reward_fn", "benchmark/tiny/verifiable.py:facts_in_order",
                    "--rloo_k", str(args.group_size), "--per_device_train_batch_size", str(batch // 2),
                    "--num_mini_batches", "2", "--num_ppo_epochs", "1", "--kl_coef", "0", "--response_length", "8",
                    "--stop_token", "eos", "--total_episodes", str(batch * args.generations), *common, *out,
                ]  # fmt: skip
            else:
                runs[method, seed] = [*grpo_common, *variants[method], *out]
    stages["sft_final"] = start
    return stages, runs


def run(name: str, command: list[str], args: Args, reuse_output: str | None = None) -> dict:
    """Run `python command` (niced) with its log in {work_dir}/logs; skip it when `reuse_output` exists and the
    stamp says it was made by the same command. Returns {command, seconds}."""
    logs = os.path.join(args.work_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    stamp, record = os.path.join(logs, f"{name}.done.json"), {"command": shlex.join(["python", *command])}
    if reuse_output and os.path.exists(reuse_output) and os.path.exists(stamp):
        with open(stamp) as f:
            earlier = json.load(f)
        if earlier["command"] == record["command"]:
            return earlier
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
    start = time.time()
    with open(os.path.join(logs, f"{name}.log"), "w") as log:
        proc = subprocess.run(
            [sys.executable, *command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {logs}/{name}.log")
    record["seconds"] = round(time.time() - start, 1)
    with open(stamp, "w") as f:
        json.dump(record, f)
    return record


def evaluate(model_dir: str, dataset_dir: str, split: str = "test") -> float:
    """Greedy exact-match rate of the facts_in_order reward on a split's prompts (8 new tokens, cut at EOS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, ROOT)
    import utils.chat
    import utils.generation

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [json.loads(line)["prompt"] for line in open(os.path.join(dataset_dir, f"{split}.jsonl"))]
    responses, lengths = utils.generation.complete(
        model, tokenizer, utils.chat.tokenize_prompts(tokenizer, prompts), 8, 64
    )
    completions = [tokenizer.decode(r[:n], skip_special_tokens=True) for r, n in zip(responses, lengths)]
    rewards = facts_in_order(prompts, completions)
    return sum(rewards) / len(rewards)


def curve(run_dir: str, method: str) -> list[tuple[int, float]]:
    """(completions sampled so far, mean training reward of that sampling round) from a run's metrics.jsonl."""
    points = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        m = json.loads(line)
        points[m["episode"]] = m["objective/scores"] if method == "rloo" else m["reward"]
    return sorted(points.items())


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(ys, width=5):  # trailing mean over `width` sampling rounds (one round holds 64 samples)
        return [
            sum(ys[max(0, i - width + 1) : i + 1]) / len(ys[max(0, i - width + 1) : i + 1])
            for i in range(len(ys))
        ]

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for color, (method, per_seed) in zip(["C0", "C1", "C2", "C3"], result["curves"].items()):
        for curve_points in per_seed.values():
            ax.plot(
                [x for x, _ in curve_points],
                smooth([y for _, y in curve_points]),
                color=color,
                lw=0.6,
                alpha=0.4,
            )
        curves = [c for s, c in per_seed.items() if result["runs"][f"{method}_s{s}"]["finished"]] or list(
            per_seed.values()
        )
        length = min(len(c) for c in curves)
        mean = smooth([sum(c[i][1] for c in curves) / len(curves) for i in range(length)])
        ax.plot(
            [x for x, _ in curves[0][:length]],
            mean,
            color=color,
            lw=2,
            label=f"{method} (mean of {len(curves)})",
        )
    if result["sft"]["test_greedy"] is not None:
        ax.axhline(result["sft"]["test_greedy"], color="gray", ls=":", label="SFT, greedy on test")
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("exact-match reward of the samples (5-round mean)")
    ax.set_title("Tiny world: naming the post's facts in order")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: Args) -> None:
    stages, runs = commands(args)
    w = args.work_dir
    if not args.report_only:
        run("world", stages["world"], args, reuse_output=f"{w}/world/dataset")
        for name in [n for n in stages if n.startswith("sft") and n != "sft_final"]:
            run(name, stages[name], args, reuse_output=f"{w}/{name}/model.safetensors")

        def one(key):
            name = f"{key[0]}_s{key[1]}"
            record = run(name, runs[key], args, reuse_output=f"{w}/{name}/model.safetensors")
            print(f"{name}: {record.get('seconds')} s", flush=True)

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, runs))
    report(args, stages, runs)


def stamp(args: Args, name: str) -> dict:
    path = os.path.join(args.work_dir, "logs", f"{name}.done.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def report(args: Args, stages: dict, runs: dict) -> None:
    """Curves, greedy test scores and the table from whatever runs exist; an unfinished run (no saved model)
    contributes its curve so far and is counted apart."""
    w = args.work_dir
    sft_names = [n for n in stages if n.startswith("sft") and n != "sft_final"]
    result = {"args": vars(args), "commands": {n: shlex.join(["python", *stages[n]]) for n in sft_names}}
    result["sft"] = {"seconds": sum(stamp(args, n).get("seconds") or 0.0 for n in sft_names),
                     "test_greedy": evaluate(stages["sft_final"], f"{w}/world/dataset") if args.evaluate_test else None}  # fmt: skip
    print(f"SFT: greedy exact match on test {result['sft']['test_greedy']}", flush=True)
    result["runs"], result["curves"] = {}, {}
    for (method, seed), command in runs.items():
        name = f"{method}_s{seed}"
        result["commands"][method] = (
            shlex.join(["python", *command])
            .replace(name, f"{method}_s{{seed}}")
            .replace(f"--seed {seed}", "--seed {seed}")
        )
        points = curve(f"{w}/runs/{name}", method) if os.path.exists(f"{w}/runs/{name}/metrics.jsonl") else []
        if not points:
            continue
        finished = os.path.exists(f"{w}/{name}/model.safetensors") and bool(stamp(args, name))
        result["curves"].setdefault(method, {})[str(seed)] = points
        result["runs"][name] = {
            "finished": finished, "generations": len(points), "seconds": stamp(args, name).get("seconds"),
            "first_reward": points[0][1], "last5_reward": sum(p[1] for p in points[-5:]) / len(points[-5:]),
            "test_greedy": evaluate(f"{w}/{name}", f"{w}/world/dataset") if finished and args.evaluate_test else None,
        }  # fmt: skip
        print(name, result["runs"][name], flush=True)
    table = {}
    for method in args.methods:
        rows = [result["runs"][f"{method}_s{s}"] for s in args.seeds if f"{method}_s{s}" in result["runs"]]
        done = [r for r in rows if r["finished"]]
        if not done:
            continue
        table[method] = {key: sum(r[key] for r in done) / len(done) if None not in [r[key] for r in done] else None
                         for key in ("first_reward", "last5_reward", "test_greedy", "seconds")}  # fmt: skip
        table[method].update(
            seeds_finished=len(done), per_seed_last5=[r["last5_reward"] for r in done],
            per_seed_test_greedy=[r["test_greedy"] for r in done],
            unfinished={f"{method}_s{s}": result["runs"][f"{method}_s{s}"]["generations"] for s in args.seeds
                        if f"{method}_s{s}" in result["runs"] and not result["runs"][f"{method}_s{s}"]["finished"]},
        )  # fmt: skip
    result["table"] = table
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.results + ".png")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args, use_underscores=True))
