"""DDPO on the tiny random Stable-Diffusion pipeline, on CPU: does the JPEG-compressibility reward rise?

Builds the pipeline of `benchmark/tiny/tiny_diffusion.py` in a temporary directory, runs `ddpo.py` through its
command line with `--reward_fn jpeg_compressibility` (reward = minus the JPEG size in kB), reads the
per-epoch reward statistics back from its TensorBoard log and writes them to a JSON file with a plot beside
it. A few minutes on a 2-core CPU.

    python benchmark/tiny/ddpo_compressibility.py --output_json benchmark/results/ddpo_compressibility.json

The tiny UNet is random, so its attention layers, where LoRA adapters go, barely steer the images: this run
trains the whole UNet (`--no_use_lora`), with one on-policy update per epoch over all its samples, a short
3-step chain and a learning rate suited to a small model. The defaults of `ddpo.py` are the paper's for
Stable Diffusion.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "tiny"))

from tiny_diffusion import build_tiny_sd_pipeline  # noqa: E402


@dataclass
class Args:
    output_json: str = os.path.join(ROOT, "benchmark", "results", "ddpo_compressibility.json")
    """where the per-epoch rewards are written (a .png plot goes beside it)"""
    num_epochs: int = 15
    """DDPO epochs"""
    seed: int = 0
    """seed of the run (the pipeline's weights always use seed 0)"""
    sample_batch_size: int = 16
    """images sampled at once"""
    sample_num_batches_per_epoch: int = 2
    """sampling batches per epoch; all the epoch's images form one training batch"""
    sample_num_steps: int = 3
    """DDIM steps per image"""
    train_learning_rate: float = 3e-3
    """learning rate of the whole UNet"""


def read_scalars(run_dir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def main(args: Args) -> None:
    with tempfile.TemporaryDirectory() as work:
        build_tiny_sd_pipeline(os.path.join(work, "tiny-sd"), seed=0)
        samples_per_epoch = args.sample_batch_size * args.sample_num_batches_per_epoch
        ddpo_args = [
            "--pretrained_model", os.path.join(work, "tiny-sd"), "--reward_fn", "jpeg_compressibility",
            "--no_use_lora", "--num_epochs", str(args.num_epochs), "--seed", str(args.seed),
            "--sample_num_steps", str(args.sample_num_steps),
            "--sample_batch_size", str(args.sample_batch_size),
            "--sample_num_batches_per_epoch", str(args.sample_num_batches_per_epoch),
            "--train_batch_size", str(samples_per_epoch),
            "--train_learning_rate", str(args.train_learning_rate),
            "--save_freq", str(args.num_epochs + 1), "--output_dir", "out", "--run_name", "bench",
        ]  # fmt: skip
        start = time.time()
        command = [sys.executable, os.path.join(ROOT, "ddpo.py"), *ddpo_args]
        subprocess.run(command, cwd=work, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        seconds = time.time() - start
        scalars = read_scalars(os.path.join(work, "runs", "bench"))
    means, stds = scalars["objective/reward_mean"], scalars["objective/reward_std"]
    result = {
        "what": "DDPO, reward jpeg_compressibility (minus JPEG kB), tiny random SD pipeline, CPU",
        "command": "python ddpo.py " + " ".join(ddpo_args),
        "samples_per_epoch": samples_per_epoch,
        "seconds": round(seconds, 1),
        "epochs": [
            {"epoch": i, "reward_mean": m, "reward_std": s, "reward_mean_stderr": s / samples_per_epoch**0.5}
            for i, (m, s) in enumerate(zip(means, stds))
        ],
        "first_reward_mean": means[0],
        "last_reward_mean": means[-1],
        "best_reward_mean": max(means),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    errors = [e["reward_mean_stderr"] for e in result["epochs"]]
    ax.errorbar(range(len(means)), means, yerr=errors, marker="o", capsize=2)
    ax.set(xlabel="epoch", ylabel="mean reward (-JPEG kB)", title="DDPO on the tiny pipeline (CPU)")
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.output_json)[0] + ".png", dpi=120)
    print(json.dumps({k: v for k, v in result.items() if k != "epochs"}, indent=2))
    print("reward_mean per epoch:", [round(m, 4) for m in means])


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
