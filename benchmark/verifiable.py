"""A verifiable-reward benchmark on the tiny world: grpo.py (loss types grpo, dr_grpo, dapo) against rloo.py.

The task: after `TL;DR:` name the post's facts (its key words, in the order they appear) and nothing else. The
reward is an exact match, 1 or 0 (`facts_in_order`, computed from the prompt alone: no reward model, no judge).
The SFT start imitates the tiny world's references, which usually omit the last fact and often end with a hedge
word, so it is rarely exactly right; RL from the verifiable reward has to learn to name the last fact and to
drop the hedge.

    nice -n 10 python benchmark/verifiable.py --work_dir benchmark/work_grpo --seeds 1 2 3

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = set(KEY_WORDS)


# ----------------------------------------------------------------------------------------------------------------
# The verifiable reward (loaded by grpo.py / rloo.py as benchmark/verifiable.py:facts_in_order; the file must
# stay loadable as a bare module, hence no `from __future__ import annotations` above the dataclass)
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
    sft_steps: int = 500
    """SFT optimizer steps (batch 32)"""
    generations: int = 40
    """sampling rounds of every RL run"""
    prompts_per_generation: int = 16
    """prompts per sampling round"""
    group_size: int = 4
    """completions per prompt (--num_generations / --rloo_k)"""
    learning_rate: float = 1e-3
    """RL learning rate, every method"""
    temperature: float = 0.7
    """sampling temperature, every method"""
    jobs: int = 2
    """RL runs at a time"""
    threads: int = 1
    """OMP threads per run"""
    results: str = "benchmark/results/grpo_verifiable"
    """prefix of the .json and .png written"""


def commands(args: Args) -> tuple[dict, dict]:
    """(stage commands, RL commands keyed by (method, seed)), each a list of arguments to python."""
    w = args.work_dir
    data, logs = f"{w}/world/dataset", ["--logging_dir", f"{w}/runs"]
    stages = {
        "world": ["benchmark/tiny_world.py", "--output_dir", f"{w}/world", "--seed", "0",
                  "--post_words", str(args.post_words)],
        "sft": ["sft.py", "--model_name_or_path", f"{w}/world/policy", "--dataset_name", data,
                "--dataset_train_split", "sft", "--dataset_test_split", "validation", "--output_dir", f"{w}/sft",
                "--max_length", "128", "--response_length", "8", "--learning_rate", "3e-3",
                "--lr_scheduler_type", "cosine", "--warmup_ratio", "0.05", "--per_device_train_batch_size", "32",
                "--total_steps", str(args.sft_steps), "--eval_steps", "500", "--run_name", "sft", *logs],
    }  # fmt: skip
    batch = args.prompts_per_generation * args.group_size  # completions per sampling round, every method
    common = ["--dataset_name", data, "--dataset_train_split", "sft", "--learning_rate", str(args.learning_rate),
              "--temperature", str(args.temperature), "--max_grad_norm", "1.0", "--num_sample_generations", "0",
              "--lr_scheduler_type", "constant", *logs]  # fmt: skip
    grpo_common = ["grpo.py", "--model_name_or_path", f"{w}/sft", "--reward_funcs",
                   "benchmark/verifiable.py:facts_in_order", "--num_generations", str(args.group_size),
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
                    "rloo.py", "--sft_model_path", f"{w}/sft", "--reward_fn", "benchmark/verifiable.py:facts_in_order",
                    "--rloo_k", str(args.group_size), "--per_device_train_batch_size", str(batch // 2),
                    "--num_mini_batches", "2", "--num_ppo_epochs", "1", "--kl_coef", "0", "--response_length", "8",
                    "--stop_token", "eos", "--total_episodes", str(batch * args.generations), *common, *out,
                ]  # fmt: skip
            else:
                runs[method, seed] = [*grpo_common, *variants[method], *out]
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
    import utils

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [json.loads(line)["prompt"] for line in open(os.path.join(dataset_dir, f"{split}.jsonl"))]
    responses, lengths = utils.complete(model, tokenizer, utils.tokenize_prompts(tokenizer, prompts), 8, 64)
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

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for method, per_seed in result["curves"].items():
        curves = [c for c in per_seed.values() if c]
        length = min(len(c) for c in curves)
        xs = [c[0] for c in curves[0][:length]]
        ys = [sum(c[i][1] for c in curves) / len(curves) for i in range(length)]
        ax.plot(xs, ys, label=f"{method} ({len(curves)} seeds)")
    ax.axhline(result["sft"]["test_greedy"], color="gray", ls=":", label="SFT, greedy on test")
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("exact-match reward (training samples)")
    ax.set_title("Tiny world: naming the post's facts in order")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: Args) -> None:
    stages, runs = commands(args)
    w = args.work_dir
    run("world", stages["world"], args, reuse_output=f"{w}/world/dataset")
    sft = run("sft", stages["sft"], args, reuse_output=f"{w}/sft/model.safetensors")
    result = {"args": vars(args), "commands": {"sft": sft["command"]}, "sft": {"seconds": sft.get("seconds")}}
    result["sft"]["test_greedy"] = evaluate(f"{w}/sft", f"{w}/world/dataset")
    print(f"SFT: greedy exact match on test {result['sft']['test_greedy']:.3f}", flush=True)

    def one(key):
        method, seed = key
        record = run(
            f"{method}_s{seed}", runs[key], args, reuse_output=f"{w}/{method}_s{seed}/model.safetensors"
        )
        score = evaluate(f"{w}/{method}_s{seed}", f"{w}/world/dataset")
        print(
            f"{method} seed {seed}: {record.get('seconds')} s, greedy exact match on test {score:.3f}",
            flush=True,
        )
        return key, record, score

    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(one, runs))
    result["runs"], result["curves"] = {}, {}
    for (method, seed), record, score in done:
        points = curve(f"{w}/runs/{method}_s{seed}", method)
        result["curves"].setdefault(method, {})[str(seed)] = points
        first, last = points[0][1], sum(p[1] for p in points[-5:]) / len(points[-5:])
        result["runs"][f"{method}_s{seed}"] = {"seconds": record.get("seconds"), "test_greedy": score,
                                               "first_reward": first, "last5_reward": last}  # fmt: skip
        result["commands"][method] = (
            record["command"].replace(f"_s{seed}", "_s{seed}").replace(f"--seed {seed}", "--seed {seed}")
        )
    table = {}
    for method in args.methods:
        rows = [result["runs"][f"{method}_s{s}"] for s in args.seeds]
        keys = ("first_reward", "last5_reward", "test_greedy", "seconds")
        table[method] = {key: sum(r[key] for r in rows) / len(rows) for key in keys}
        table[method]["per_seed_last5"] = [r["last5_reward"] for r in rows]
        table[method]["per_seed_test_greedy"] = [r["test_greedy"] for r in rows]
    result["table"] = table
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.results + ".png")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args, use_underscores=True))
