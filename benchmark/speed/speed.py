"""Speed and memory of the scripts side by side with TRL's trainers, on the same workload, in one run.

    python benchmark/speed/speed.py --trl_python .venv-trl/bin/python \
        --trl_ppo_python .venv-trl-ppo/bin/python
    python benchmark/speed/speed.py --preset tldr_qwen --runs 1 --parallel 2     # real shapes, see below

For each algorithm (sft, reward, dpo, rloo, ppo, grpo, online_dpo; grpo when grpo.py exists) the same workload
runs three ways, each in its own process, in `--runs` rounds of ours, TRL, bare for every algorithm (`--parallel`
of them at once; 1 runs them one after the other):
    ours   the script's real command line (sft.py, reward.py, ...);
    trl    TRL's trainer with the same model, data, batch sizes, lengths and number of optimizer steps
           (TRL runs in its own environment, see requirements-trl.txt: the project never imports TRL);
    bare   the same generation and forward/backward passes as a minimal loop (benchmark/speed/bare_work.py): the
           work no implementation can avoid, so `ours / bare` says how much the script adds on top of it.

Shapes (`--preset`; every size can still be set by its own flag):
    toy        the tiny world (tiny_world.py: vocabulary ~1k, <= 128 tokens, 8-token responses, 1.1M parameters);
               batch 32, 12 steps of sft/reward/dpo/online_dpo; 4 updates of 64 completions (2 mini-batches of 32,
               k = 4) for rloo (2 epochs), grpo (2 iterations) and ppo (4 epochs). The README's table.
    tldr       prompt 512 + response 53 tokens, vocabulary 50304;
    tldr_qwen  prompt 512 + response 53 tokens, vocabulary 151936 (Qwen's);
    grpo       prompt 128 + completion 256 tokens, vocabulary 151936.
    The three real shapes use a world of random words (shape_world.py: every prompt exactly that many tokens,
    every completion, chosen and rejected exactly the response length with its EOS; RL sides sample exactly the
    response length, TRL with min_new_tokens so no row stops early) and a Llama body of hidden 256 x 2 layers
    (MLP 1024, 4 heads), untied embeddings, float32, no gradient checkpointing, 4 rows per forward/backward
    micro-batch: 4 sequences (sft), 2 pairs (reward, dpo: 2 chosen + 2 rejected), 2 prompts x 2 completions
    (online_dpo), 4 completions (rloo, ppo, grpo). 3 optimizer steps of sft, reward, dpo and online_dpo (one
    update each); 3 updates of rloo, grpo and ppo, each a rollout of 8 completions (2 prompts x k = 4; ppo 8
    prompts) and 1 epoch of 2 mini-batches of 4 (2 optimizer steps). On a quiet 2-core CPU one side of one
    algorithm takes about 1-2 minutes at vocabulary 151936 and peaks at up to ~7 GiB: use --parallel 1 or 2.

On a GPU (`--device cuda`, the default where torch sees one; docs/speed_gpu.md): ours and TRL run on it one after
the other (--parallel 1), each in its own process, in `--precision` fp32 or bf16 (autocast on fp32 weights, both
sides); the bare loop is CPU-only and left out. Each side's peak torch.cuda.max_memory_allocated and
max_memory_reserved are recorded, and every optimizer step is timed after torch.cuda.synchronize (or by a CUDA
event: --no_cuda_sync_per_step). The presets tldr_qwen05b and grpo_qwen05b are the tldr_qwen and grpo shapes with
Qwen2.5-0.5B's body (hidden 896 x 24 layers, MLP 4864, 14 heads; 663M parameters untied) and 8 rows a micro-batch
(--micro_batch_rows sets the rows of any preset); `--profile` adds torch.profiler's counts of kernel launches and
host syncs per update. The results name the device (the GPU's name), the model's size and the precision.

    python benchmark/speed/speed.py --preset tldr_qwen05b --precision bf16 --runs 1 \
        --algorithms sft dpo rloo online_dpo --trl_python "$(command -v python3)" \
        --output $OUT/speed_tldr_qwen05b.json

Counted the same way on all three sides: every optimizer step is timed by a hook on torch's optimizers, so the
in-loop throughput is (updates - 1) * examples per update / (time from the end of the first update to the end of
the last), with examples = sequences (sft), preference pairs (reward, dpo, online_dpo) or completions (rloo, ppo,
grpo), and the in-loop CPU (process_time) and wall seconds per update are over the same span: the first update
(warm-up) and everything before and after the loop are left out. The whole-process wall time (imports, loading,
data preparation, training, saving) and the peak resident memory (`ru_maxrss` of the child) are measured by this
process; the peak private memory (RssAnon, free of shared-library pages) is sampled every 20 ms in the child.
glibc keeps freed heap blocks resident, so both peaks include memory no side holds any more; with
`--malloc_mmap_threshold 131072` every side returns large blocks when it frees them (at some CPU cost to whoever
reuses them most: see the README's Speed section). What each side holds is counted exactly by a shim loaded into
every run (benchmark/memory/live_heap.c, built with `cc`; `--no_live_heap` leaves it out): the peak of the bytes
held through malloc (live heap), the peak of torch's tensor bytes (the CPU's counterpart of
torch.cuda.max_memory_allocated), and the checkpoint files mapped (the loaded weights, which live in the file's
mapping on every side); held = peak tensors + checkpoints, the memory a GPU run would need before its allocator's
own overhead.
Every pass through the Llama body is counted by its [rows x tokens] shape and grad mode (`forward_shapes` of
each run), so the work of two sides can be compared directly. Each figure is reported as our median, TRL's
median and the median of the per-pair ratios with its min-max over the pairs (run i of ours with run i of TRL).

Writes `--output` (every run, the medians, the ratios, the commands, package and TRL versions) and a bar plot
beside it. On a shared machine, absolute numbers move with the load; the ratios of interleaved runs and the CPU
seconds are the figures to read. Evaluation, sample tables and tracking are off on every side: the loop is
training only.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Literal

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARK = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCHMARK)
ALGORITHMS = ["sft", "reward", "dpo", "rloo", "ppo", "grpo", "online_dpo"]
SIDES = ["ours", "trl", "bare"]
# toy: the tiny world (vocabulary ~1k, posts of 30-odd tokens, <= 128 tokens in all, 8-token responses), the
# workload of the README's table. The real shapes: a world of random words (shape_world.py) with a Llama body of
# hidden 256 x 2 layers (MLP 1024, 4 heads), untied embeddings, float32, no gradient checkpointing, and 4 rows
# (sequences) per forward/backward micro-batch: 4 sequences (sft), 2 pairs (reward, dpo), 2 prompts x 2
# completions (online_dpo), 4 completions (rloo, ppo, grpo mini-batches). 3 optimizer steps of sft, reward, dpo
# and online_dpo; 3 updates of rloo, ppo and grpo, each a rollout of 8 completions (2 prompts x k = 4 for rloo
# and grpo, 8 prompts for ppo) and 1 epoch of 2 mini-batches of 4. The first update is warm-up, so each in-loop
# figure is over updates 2-3. On a 2-core CPU one side of one algorithm takes about 1-2 minutes at vocabulary
# 151936 (about a third of that at 50304) and peaks at up to ~7 GiB: use --parallel 1 or 2.
REAL = {"hidden_size": 256, "num_layers": 2, "intermediate_size": 1024, "num_heads": 4, "batch_size": 4,
        "pair_batch_size": 2, "steps": 3, "updates": 3, "epochs": 1}  # fmt: skip
# Qwen2.5-0.5B's body (hidden 896 x 24 layers, MLP 4864, 14 heads; shape_world has no GQA, so 14 key-value heads
# too) with 8 rows a micro-batch: the workload /work/shared/gpu's harness measured on one H100 (docs/speed_gpu.md).
QWEN05B = {**REAL, "hidden_size": 896, "num_layers": 24, "intermediate_size": 4864, "num_heads": 14, "batch_size": 8,
           "pair_batch_size": 4}  # fmt: skip
TLDR_SHAPE = {"prompt_length": 512, "response_length": 53, "max_length": 565}
GRPO_SHAPE = {"prompt_length": 128, "response_length": 256, "max_length": 384}
PRESETS = {
    "toy": {"hidden_size": 128, "num_layers": 4, "intermediate_size": 512, "num_heads": 4, "batch_size": 32,
            "pair_batch_size": 32, "steps": 12, "updates": 4, "epochs": None, "response_length": 8,
            "prompt_length": None, "vocab_size": None, "max_length": 128},
    "tldr": {**REAL, **TLDR_SHAPE, "vocab_size": 50304},
    "tldr_qwen": {**REAL, **TLDR_SHAPE, "vocab_size": 151936},
    "grpo": {**REAL, **GRPO_SHAPE, "vocab_size": 151936},
    "tldr_qwen05b": {**QWEN05B, **TLDR_SHAPE, "vocab_size": 151936},
    "grpo_qwen05b": {**QWEN05B, **GRPO_SHAPE, "vocab_size": 151936},
}  # fmt: skip
TOY_EPOCHS = {"rloo": 2, "ppo": 4, "grpo": 2}


def cuda_available() -> bool:
    """Whether torch sees a GPU (torch is imported only here, so `--help` stays fast)."""
    import torch

    return torch.cuda.is_available()


def resolve(args: Args) -> Args:
    """Check the flags and fill in what was left at None: the device (cuda when torch sees a GPU), the runs at
    once (1 on a GPU), the micro-batch sizes from --micro_batch_rows, every other size from the preset."""
    if args.preset not in PRESETS:
        raise ValueError(f"unknown --preset {args.preset}; choose from {list(PRESETS)}.")
    if args.device is None:
        args.device = "cuda" if cuda_available() else "cpu"
    elif args.device == "cuda" and not cuda_available():
        raise ValueError("--device cuda needs a GPU, and torch sees none here; run with --device cpu.")
    if args.parallel is None:
        args.parallel = 1 if args.device == "cuda" else 6
    elif args.device == "cuda" and args.parallel != 1:
        raise ValueError(
            "--parallel must be 1 with --device cuda: runs sharing one GPU disturb each other's times."
        )
    if args.micro_batch_rows is not None:
        if args.batch_size is not None or args.pair_batch_size is not None:
            raise ValueError(
                "--micro_batch_rows sets --batch_size and --pair_batch_size; give one or the others."
            )
        if args.micro_batch_rows < 2 or args.micro_batch_rows % 2:
            raise ValueError(
                f"--micro_batch_rows must be even and at least 2 (a pair is 2 rows), got {args.micro_batch_rows}."
            )
        args.batch_size, args.pair_batch_size = args.micro_batch_rows, args.micro_batch_rows // 2
    unknown = set(args.sides) - set(SIDES)
    if unknown or "ours" not in args.sides:
        raise ValueError(f"--sides must include ours and name only {SIDES}, got {args.sides}.")
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


@dataclass
class Args:
    # Run
    runs: int = 3
    """runs of each side per algorithm (ours, TRL and bare interleaved)"""
    algorithms: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    """algorithms to measure (grpo is skipped when grpo.py does not exist)"""
    trl_python: str = ".venv-trl/bin/python"
    """python of the environment with TRL 1.16 (sft, reward, dpo, rloo, grpo); see requirements-trl.txt"""
    trl_ppo_python: str = ".venv-trl-ppo/bin/python"
    """python of the environment with the newest TRL that still ships PPO (1.12, trl.experimental.ppo)"""
    no_bare: bool = False
    """skip the bare-work runs"""
    work_dir: str | None = None
    """the world, the trained models and the logs of every run (not committed); None: benchmark/work/speed for
    the toy preset, benchmark/work/speed-<preset> for the others"""
    output: str | None = None
    """the results, the plot beside it with the extension .png; None: benchmark/results/speed.json (toy),
    benchmark/results/speed_<preset>.json (the others)"""
    threads: int = 1
    """torch threads in every run (OMP_NUM_THREADS too)"""
    malloc_mmap_threshold: int | None = None
    """bytes: set glibc's MALLOC_MMAP_THRESHOLD_ in every run of every side (131072 is glibc's starting value).
    None keeps glibc's default, whose threshold grows to the largest block freed so far (up to 32 MiB): blocks
    below it then come from the heap, and freed ones stay resident, so peak RSS counts memory nobody holds.
    A fixed threshold returns every large block to the system when it is freed: peaks are what is held"""
    live_heap: bool = True
    """also measure each run's peak live heap (the bytes held through malloc: tensors, Python objects, buffers),
    its peak tensor bytes (torch's CPU allocations) and the checkpoint files mapped (the loaded weights): a
    counting shim (benchmark/memory/live_heap.c, built with the system's C compiler `cc`) loaded into every side
    with LD_PRELOAD. Freed blocks that glibc keeps resident are in none of them. Held = tensors + checkpoints"""
    parallel: int | None = None
    """runs at once (1: ours, TRL, bare one after the other; 3: the three sides of an algorithm at the same time,
    so each pair sees the same load on a shared machine; 6: two algorithms at a time). None: 6 on a CPU, 1 (the
    only value allowed) on a GPU"""
    sides: list[str] = field(default_factory=lambda: list(SIDES))
    """the sides to run (ours always; TRL 1.16 has no PPO, so `--sides ours` where no TRL 1.12 environment is)"""

    # Device and precision (every side the same)
    device: Literal["cuda", "cpu"] | None = None
    """where every side runs (TRL's with use_cpu off on cuda; the bare loop is CPU-only and left out on cuda).
    None: cuda when torch sees a GPU, else cpu. On cuda: peak torch.cuda.max_memory_allocated and
    max_memory_reserved of each side (its own process), optimizer steps timed after torch.cuda.synchronize"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 autocast on fp32 weights (ours --bf16, TRL bf16=True, the bare loop under torch.autocast)"""
    cuda_sync_per_step: bool = True
    """on cuda, time each optimizer step after torch.cuda.synchronize; --no_cuda_sync_per_step times it with a
    CUDA event instead, so no side waits for the GPU at the step's end unless its own code does"""
    profile: bool = False
    """torch.profiler over the timed updates of every run: kernel launches, host syncs (.item(), nonzero, ...),
    GPU kernel time and the top ops per update go into the results (diagnosis only: the profiler slows the runs)"""
    ours_logit_tile_elements: int | None = None
    """our side only: the logits one tile of the LM head holds (utils.lm_head's LOGIT_TILE_ELEMENTS on a CPU, 2**22,
    and GPU_LOGIT_TILE_ELEMENTS on a GPU, 2**24) for this run, to measure what the tile count costs
    (docs/speed_gpu.md). None: the code's values"""

    # Model and workload (None: the --preset's value, see PRESETS)
    preset: str = "toy"
    """workload shapes: toy (the tiny world), tldr (prompt 512 + response 53, vocabulary 50304), tldr_qwen (the
    same at vocabulary 151936) or grpo (prompt 128 + completion 256, vocabulary 151936), all with a hidden-256 x
    2-layer body; tldr_qwen05b and grpo_qwen05b: the tldr_qwen and grpo shapes with Qwen2.5-0.5B's body (hidden
    896 x 24 layers, 663M parameters untied) and 8 rows a micro-batch, for a GPU; see PRESETS"""
    hidden_size: int | None = None
    """hidden size of the world's models"""
    num_layers: int | None = None
    """layers of the world's models"""
    intermediate_size: int | None = None
    """MLP width of the world's models"""
    num_heads: int | None = None
    """attention heads of the world's models (as many key-value heads)"""
    micro_batch_rows: int | None = None
    """rows per forward/backward micro-batch, for every algorithm: sets --batch_size to it and --pair_batch_size to
    half of it (a preference pair, or a prompt's two online-DPO completions, is two rows)"""
    batch_size: int | None = None
    """sequences (sft) or completions (rl) per optimizer step (one micro-batch)"""
    pair_batch_size: int | None = None
    """preference pairs (reward, dpo) or prompts (online_dpo, 2 completions each) per optimizer step"""
    steps: int | None = None
    """optimizer steps of sft, reward, dpo and online_dpo (one update each)"""
    updates: int | None = None
    """rollout-and-train updates of rloo, ppo and grpo (each 2 mini-batches of --batch_size completions)"""
    epochs: int | None = None
    """passes over each rollout (rloo, grpo: 2 at toy; ppo: 4 at toy; all 1 at the real shapes)"""
    rloo_k: int = 4
    """completions per prompt (rloo_k, num_generations)"""
    response_length: int | None = None
    """tokens sampled per completion; tokens of every completion, chosen and rejected (EOS included)"""
    prompt_length: int | None = None
    """tokens of every prompt (real shapes; the tiny world's prompts are its posts, 30-odd tokens)"""
    vocab_size: int | None = None
    """vocabulary of the world (real shapes; the tiny world's is about 1k)"""
    max_length: int | None = None
    """longest tokenized sequence for sft, reward and dpo (no example of the world is longer)"""
    learning_rate: float = 1e-4
    """learning rate on every side"""
    from_runs: str | None = None
    """summarize the runs.json of an earlier (possibly interrupted) run instead of running anything"""


# ----------------------------------------------------------------------------------------------------------------
# The workload: one description per algorithm, turned into our command line, TRL's config and the bare loop's
# ----------------------------------------------------------------------------------------------------------------
def workload(algorithm: str, args: Args, world: str, out: str) -> dict:
    """Everything one run needs: the sizes shared by the three sides, and our script's command line.

    `unit` is what the throughput counts, `per_update` how many of them one update trains on and
    `steps_per_update` how many optimizer steps that takes (TRL and the bare loop take the same)."""
    data = f"{world}/dataset"
    B, k, R, lr = args.batch_size, args.rloo_k, args.response_length, str(args.learning_rate)
    common = ["--output_dir", out, "--overwrite_output_dir", "--logging_dir", f"{out}-runs", "--seed", "1"]
    spec = {"algorithm": algorithm, "preset": args.preset, "world": world, "output_dir": out, "batch_size": B,
            "learning_rate": lr, "max_length": args.max_length, "prompt_length": args.prompt_length,
            "vocab_size": args.vocab_size, "response_length": R, "k": k, "temperature": 0.7, "kl_coef": 0.05,
            "beta": 0.1, "device": args.device or "cpu", "precision": args.precision,
            "cuda_sync_per_step": args.cuda_sync_per_step, "profile": args.profile,
            "logit_tile_elements": args.ours_logit_tile_elements}  # fmt: skip
    if algorithm in ("sft", "reward", "dpo"):
        if algorithm != "sft":
            B = spec["batch_size"] = args.pair_batch_size
        spec |= {
            "updates": args.steps,
            "steps_per_update": 1,
            "per_update": B,
            "epochs": 1,
            "mini_batches": 1,
        }
        spec["unit"] = "examples" if algorithm == "sft" else "pairs"
        train = ["--per_device_train_batch_size", str(B), "--learning_rate", lr, "--max_length", str(args.max_length),
                 "--max_steps", str(args.steps), "--eval_strategy", "no", "--logging_steps", "10"]  # fmt: skip
        if algorithm == "sft":
            cmd = ["sft.py", "--model_name_or_path", f"{world}/policy", "--dataset_name", data,
                   "--dataset_train_split", "sft", *train]  # fmt: skip
        elif algorithm == "reward":
            cmd = ["reward.py", "--model_name_or_path", f"{world}/policy", "--dataset_name", data,
                   "--dataset_train_split", "preference", "--normalize", "False", *train]  # fmt: skip
        else:
            prompt = args.max_length - 1 if args.prompt_length is None else args.prompt_length
            cmd = ["dpo.py", "--model_name_or_path", f"{world}/policy", "--dataset_name", data,
                   "--dataset_train_split", "preference", "--beta", "0.1", "--max_prompt_length", str(prompt),
                   *train]  # fmt: skip
    elif algorithm == "online_dpo":
        # One update = P prompts x 2 sampled completions, annotated by the reward model, one DPO step.
        P = args.pair_batch_size
        spec |= {"updates": args.steps, "steps_per_update": 1, "per_update": P, "epochs": 1, "mini_batches": 1,
                 "batch_size": P, "unit": "pairs"}  # fmt: skip
        cmd = ["online_dpo.py", "--model_name_or_path", f"{world}/policy", "--reward_model_path", f"{world}/reward",
               "--dataset_name", data, "--dataset_train_split", "sft", "--temperature", "0.7", "--learning_rate", lr,
               "--per_device_train_batch_size", str(P), "--local_rollout_forward_batch_size", str(2 * P),
               "--max_new_tokens", str(R), "--beta", "0.1", "--max_steps", str(args.steps),
               "--num_sample_generations", "0"]  # fmt: skip
    else:
        epochs = TOY_EPOCHS[algorithm] if args.epochs is None else args.epochs
        spec |= {"updates": args.updates, "steps_per_update": 2 * epochs, "per_update": 2 * B, "epochs": epochs,
                 "mini_batches": 2, "unit": "episodes"}  # fmt: skip
        episodes = str(args.updates * 2 * B)
        rollout = ["--dataset_name", data, "--dataset_train_split", "sft", "--temperature", "0.7",
                   "--learning_rate", lr, "--per_device_train_batch_size", str(B),
                   "--local_rollout_forward_batch_size", str(2 * B)]  # fmt: skip
        if args.prompt_length is not None:
            rollout += ["--max_prompt_length", str(args.prompt_length)]
        if algorithm == "grpo":
            cmd = ["grpo.py", "--model_name_or_path", f"{world}/policy", "--reward_model_path", f"{world}/reward",
                   *rollout, "--num_generations", str(k), "--max_completion_length", str(R),
                   "--steps_per_generation", "2", "--num_iterations", str(epochs),
                   "--max_steps", str(args.updates * 2 * epochs), "--num_sample_generations", "0"]  # fmt: skip
        else:
            cmd = [f"{algorithm}.py", "--sft_model_path", f"{world}/policy", "--reward_model_path", f"{world}/reward",
                   *rollout, "--response_length", str(R), "--stop_token", "eos", "--kl_coef", "0.05",
                   "--num_mini_batches", "2", "--num_ppo_epochs", str(epochs), "--total_episodes", episodes,
                   "--eval_strategy", "no"]  # fmt: skip
            if algorithm == "rloo":
                cmd += ["--rloo_k", str(k)]
    precision = ["--bf16"] if args.precision == "bf16" else []
    spec["ours_command"] = [*cmd, *common, *precision]
    return spec


# ----------------------------------------------------------------------------------------------------------------
# Child processes: the step-timing hook, then our script, TRL's trainer or the bare loop
# ----------------------------------------------------------------------------------------------------------------
def child(side: str, spec_path: str, timing_path: str) -> None:
    """Run one side of one workload with every optimizer step timed; write the times to `timing_path`. On cuda
    also the peak CUDA memory (allocated and reserved) and the GPU's name; with `profile` the profiler's summary
    of the timed updates (profile_summary)."""
    import runpy
    from contextlib import nullcontext

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with open(spec_path) as f:
        spec = json.load(f)
    step_times, step_cpu_times, checkpoints = [], [], [0]
    cuda = spec.get("device") == "cuda"
    sync_per_step, events = spec.get("cuda_sync_per_step", True), []
    S, n = spec["steps_per_update"], spec["updates"]
    profiler, profiled = None, [False]
    if spec.get("profile"):
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def timed(optimizer, args, kwargs):
        if cuda and sync_per_step:
            torch.cuda.synchronize()  # the step's kernels have run, not only been queued
        elif cuda:  # read at the end: the GPU's own clock, and no wait here
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        step_times.append(time.time())
        step_cpu_times.append(time.process_time())
        if len(step_times) == 1:  # every model is loaded by the first step (read again at the end)
            checkpoints[0] = checkpoints_mapped_kib()
        if profiler is not None and len(step_times) == S:  # the timed span: after the first (warm-up) update
            profiler.start()
        if profiler is not None and len(step_times) == n * S:
            profiler.stop()
            profiled[0] = True

    register_optimizer_step_post_hook(timed)
    # the live-heap shim measures this process, not its children
    os.environ.pop("LD_PRELOAD", None)
    os.environ.pop("LIVE_HEAP_OUTPUT", None)
    peak_anon = [0]

    def watch_memory():  # private memory (heap, tensors), free of the shared-library pages that RSS also counts
        while True:
            with open("/proc/self/status") as f:
                anon = next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0)
            peak_anon[0] = max(peak_anon[0], anon)
            time.sleep(0.02)

    threading.Thread(target=watch_memory, daemon=True).start()
    forward_shapes = record_forward_shapes()
    try:
        if side == "ours":
            sys.argv = list(spec["ours_command"])
            sys.path.insert(0, ROOT)
            if spec.get("logit_tile_elements"):  # the script imports this same module object
                import utils.lm_head

                utils.lm_head.LOGIT_TILE_ELEMENTS = int(spec["logit_tile_elements"])
                utils.lm_head.GPU_LOGIT_TILE_ELEMENTS = int(spec["logit_tile_elements"])
            runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name="__main__")
        elif side == "trl":
            run_trl(spec)
        else:
            sys.path.insert(0, HERE)
            import bare_work

            bf16 = spec.get("precision") == "bf16"
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
                bare_work.run(spec)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    finally:
        timing = {"step_times": step_times, "step_cpu_times": step_cpu_times, "peak_anon_kib": peak_anon[0],
                  "checkpoints_mapped_kib": max(checkpoints[0], checkpoints_mapped_kib()),
                  "forward_shapes": forward_shapes}  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
            if events:
                timing["step_times"] = [step_times[0] + events[0].elapsed_time(e) / 1000 for e in events]
            timing |= {"cuda_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
                       "cuda_max_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
                       "gpu": torch.cuda.get_device_name()}  # fmt: skip
        if profiled[0]:
            try:
                timing["profile"] = profile_summary(profiler.key_averages(), n - 1, cuda)
            except Exception as error:  # noqa: BLE001  a diagnosis must not cost the run's figures
                timing["profile"] = {"error": repr(error)[:300]}
        with open(timing_path, "w") as f:
            json.dump(timing, f)


# Ops that wait for the GPU: .item(), float() and bool() of a tensor (_local_scalar_dense), boolean indexing
# (nonzero), masked_select, torch.equal.
HOST_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal")
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
CUDA_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def profile_summary(averages, updates: int, cuda: bool, top: int = 25) -> dict:
    """Per timed update, from torch.profiler's key_averages(): the host-sync ops and CUDA waits by name, the aten
    ops dispatched (nested ones included), the CUDA kernel launches, the GPU's busy seconds (kernels and copies,
    summed over streams); and the top ops by self GPU time (self CPU time without a GPU) as a text table."""
    from torch.autograd import DeviceType

    counts, device_us = {}, 0.0
    for event in averages:
        counts[event.key] = counts.get(event.key, 0) + event.count
        if getattr(event, "device_type", DeviceType.CPU) != DeviceType.CPU:  # a kernel or copy, not the op
            device_us += event.self_device_time_total
    per = max(updates, 1)
    summary = {
        "updates": updates,
        "host_syncs_per_update": {k: counts[k] / per for k in HOST_SYNC_OPS if k in counts},
        "aten_ops_per_update": sum(c for k, c in counts.items() if k.startswith("aten::")) / per,
    }
    if cuda:
        summary |= {"kernel_launches_per_update": sum(counts.get(k, 0) for k in KERNEL_LAUNCHES) / per,
                    "cuda_waits_per_update": {k: counts[k] / per for k in CUDA_WAITS if k in counts},
                    "gpu_busy_s_per_update": device_us / 1e6 / per}  # fmt: skip
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    summary["top_ops"] = averages.table(sort_by=sort_by, row_limit=top, max_name_column_width=60)
    return summary


def checkpoints_mapped_kib() -> int:
    """KiB of the safetensors files this process has mapped: the weights of every model loaded from disk, which
    transformers leaves in the file's mapping on a CPU (on every side), so the live heap does not count them."""
    mapped = {}
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 5 and fields[5].endswith(".safetensors"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapped[fields[0]] = (end - start) // 1024
    return sum(mapped.values())


def record_forward_shapes() -> dict:
    """Count every pass through the Llama body (policy, reference, reward model, critic; generation steps too) by
    its [rows x tokens] shape and whether autograd records it: the same counts on two sides mean the same model
    work (the LM head and the losses aside). Returns the dict the counts go into."""
    import torch
    from transformers.models.llama import modeling_llama

    shapes = {}
    forward = modeling_llama.LlamaModel.forward

    def counted(self, input_ids=None, *args, inputs_embeds=None, **kwargs):
        x = input_ids if input_ids is not None else inputs_embeds
        key = f"{'grad' if torch.is_grad_enabled() else 'no_grad'} {x.shape[0]}x{x.shape[1]}"
        shapes[key] = shapes.get(key, 0) + 1
        return forward(self, input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)

    modeling_llama.LlamaModel.forward = counted
    return shapes


def trl_common_args(spec: dict) -> dict:
    """The config fields every TRL trainer of the workload shares: sizes, steps, the device (use_cpu off on cuda)
    and the precision (bf16 autocast on fp32 weights, or fp32), no checkpointing, tracking or saving on the way."""
    return dict(output_dir=spec["output_dir"], per_device_train_batch_size=spec["batch_size"],
                learning_rate=float(spec["learning_rate"]), max_steps=spec["updates"] * spec["steps_per_update"],
                bf16=spec.get("precision") == "bf16", gradient_checkpointing=False, report_to="none",
                save_strategy="no", use_cpu=spec.get("device", "cpu") != "cuda", seed=1, disable_tqdm=False)  # fmt: skip


def run_trl(spec: dict) -> None:
    """TRL's trainer on the workload: the spec's device (use_cpu off on cuda) and precision (fp32, or bf16 autocast
    on fp32 weights), no gradient checkpointing (TRL's defaults turn on bf16 and checkpointing; the scripts'
    defaults do neither), no evaluation, no tracking, the model saved at the end."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    datasets.disable_caching()  # every run prepares its data, as a first run would (ours have no cache)
    algorithm, world = spec["algorithm"], spec["world"]
    data = datasets.load_from_disk(f"{world}/dataset")
    tokenizer = AutoTokenizer.from_pretrained(f"{world}/policy")
    common = trl_common_args(spec)
    if algorithm == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(
            **common, max_length=spec["max_length"], logging_steps=10, completion_only_loss=True
        )
        train = data["sft"].select_columns(["prompt", "completion"])
        trainer = SFTTrainer(f"{world}/policy", args=config, train_dataset=train, processing_class=tokenizer)
    elif algorithm == "reward":
        from trl import RewardConfig, RewardTrainer

        config = RewardConfig(**common, max_length=spec["max_length"], logging_steps=10)
        train = data["preference"].select_columns(["prompt", "chosen", "rejected"])
        trainer = RewardTrainer(
            f"{world}/policy", args=config, train_dataset=train, processing_class=tokenizer
        )
    elif algorithm == "dpo":
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(**common, max_length=spec["max_length"], logging_steps=10, beta=spec["beta"])
        train = data["preference"].select_columns(["prompt", "chosen", "rejected"])
        trainer = DPOTrainer(f"{world}/policy", args=config, train_dataset=train, processing_class=tokenizer)
    elif algorithm == "online_dpo":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        R = spec["response_length"]
        config = OnlineDPOConfig(**common, max_new_tokens=R, max_length=spec["max_length"], beta=[spec["beta"]],
                                 temperature=spec["temperature"], generation_kwargs={"min_new_tokens": R},
                                 logging_steps=10)  # fmt: skip
        train = data["sft"].select_columns(["prompt"])
        trainer = OnlineDPOTrainer(f"{world}/policy", reward_funcs=f"{world}/reward", args=config,
                                   train_dataset=train, processing_class=tokenizer,
                                   reward_processing_classes=tokenizer)  # fmt: skip
    elif algorithm in ("rloo", "grpo"):
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

        Config, Trainer = (RLOOConfig, RLOOTrainer) if algorithm == "rloo" else (GRPOConfig, GRPOTrainer)
        kl = {"beta": spec["kl_coef"]} if algorithm == "rloo" else {}  # GRPO: beta 0 on both sides
        config = Config(**common, num_generations=spec["k"], max_completion_length=spec["response_length"],
                        temperature=spec["temperature"], steps_per_generation=spec["mini_batches"],
                        num_iterations=spec["epochs"], logging_steps=spec["steps_per_update"],
                        generation_kwargs={"min_new_tokens": spec["response_length"]}, **kl)  # fmt: skip
        train = data["sft"].select_columns(["prompt"])
        trainer = Trainer(f"{world}/policy", reward_funcs=f"{world}/reward", args=config, train_dataset=train,
                          processing_class=tokenizer)  # fmt: skip
    elif algorithm == "ppo":
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        # TRL 1.12 splits per_device_train_batch_size * gradient_accumulation_steps into the mini-batches (ours
        # multiplies by num_mini_batches), so the same rollout of per_update completions is per_device = per_update.
        common.pop("max_steps")
        common["per_device_train_batch_size"] = spec["per_update"]
        config = PPOConfig(**common, num_mini_batches=spec["mini_batches"], num_ppo_epochs=spec["epochs"],
                           total_episodes=spec["updates"] * spec["per_update"], response_length=spec["response_length"],
                           temperature=spec["temperature"], stop_token="eos", kl_coef=spec["kl_coef"],
                           local_rollout_forward_batch_size=spec["per_update"], num_sample_generations=0)  # fmt: skip
        tokenizer.padding_side = "left"
        train = data["sft"].map(lambda row: tokenizer(row["prompt"]), remove_columns=data["sft"].column_names)
        policy = AutoModelForCausalLM.from_pretrained(f"{world}/policy")
        ref_policy = AutoModelForCausalLM.from_pretrained(f"{world}/policy")
        reward = AutoModelForSequenceClassification.from_pretrained(f"{world}/reward", num_labels=1)
        value = AutoModelForSequenceClassification.from_pretrained(f"{world}/reward", num_labels=1)
        trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                             reward_model=reward, value_model=value, train_dataset=train)  # fmt: skip
    else:
        raise ValueError(f"no TRL trainer for {algorithm}")
    trainer.train()
    # TRL 1.12's PPOTrainer.save_model fails under transformers 5.19 (it reads a Trainer attribute that the PPO
    # trainer's __init__ never sets); what it would save is the policy.
    if algorithm == "ppo":
        trainer.policy_model.save_pretrained(spec["output_dir"])
    else:
        trainer.save_model(spec["output_dir"])


# ----------------------------------------------------------------------------------------------------------------
# Measuring and summarizing
# ----------------------------------------------------------------------------------------------------------------
def in_loop_throughput(step_times: list[float], spec: dict) -> float:
    """(updates - 1) * per_update / (end of the last update - end of the first), from the optimizer-step times."""
    S, n = spec["steps_per_update"], spec["updates"]
    if len(step_times) != n * S:
        raise RuntimeError(f"expected {n * S} optimizer steps, timed {len(step_times)}: the workloads differ")
    return (n - 1) * spec["per_update"] / (step_times[n * S - 1] - step_times[S - 1])


def per_update(times: list[float], spec: dict) -> float:
    """Seconds (wall or CPU) per update from the end of the first update to the end of the last."""
    S, n = spec["steps_per_update"], spec["updates"]
    return (times[n * S - 1] - times[S - 1]) / (n - 1)


def child_env(args: Args) -> dict:
    """The environment of every run, the same on every side: one thread count, offline, and glibc's mmap
    threshold only where --malloc_mmap_threshold sets it (never inherited, so the results record it)."""
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONHASHSEED": "0"}  # fmt: skip
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if args.device == "cpu":  # on a GPU machine, accelerate would otherwise put our side on the GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def measures_live_heap(args: Args) -> bool:
    """The live-heap shim counts host memory: it runs on cpu only (on cuda torch.cuda's peaks say what is held)."""
    return args.live_heap and args.device != "cuda"


def live_heap_path(work_dir: str) -> str:
    """Where live_heap_library builds the shim."""
    return os.path.join(os.path.abspath(work_dir), "live_heap.so")


def live_heap_library(work_dir: str) -> str:
    """benchmark/memory/live_heap.c built into `work_dir` (again when the source is newer than the build);
    its path."""
    source, library = os.path.join(BENCHMARK, "memory", "live_heap.c"), live_heap_path(work_dir)
    if not os.path.exists(library) or os.path.getmtime(library) < os.path.getmtime(source):
        if shutil.which("cc") is None:
            raise ValueError("--live_heap builds benchmark/memory/live_heap.c with `cc`, which is not "
                             "installed; install a C compiler or pass --no_live_heap.")  # fmt: skip
        os.makedirs(os.path.dirname(library), exist_ok=True)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
    return library


def run_one(side: str, spec: dict, python: str, args: Args, log_path: str) -> dict:
    """One child process; returns throughput, wall time, peak RSS, the time before/after the loop and, on cuda, the
    peak CUDA memory."""
    spec_path, timing_path = log_path + ".spec.json", log_path + ".timing.json"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = child_env(args)
    peaks_path = log_path + ".live_heap"
    if measures_live_heap(args):  # built by main() before the runs
        env["LD_PRELOAD"] = " ".join(filter(None, [live_heap_path(args.work_dir), env.get("LD_PRELOAD")]))
        env["LIVE_HEAP_OUTPUT"] = peaks_path
        if os.path.exists(peaks_path):
            os.remove(peaks_path)
    command = [python, os.path.abspath(__file__), "child", side, spec_path, timing_path]
    with open(log_path, "w") as log:
        start = time.time()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except KeyboardInterrupt:
            proc.kill()
            raise
        wall = time.time() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{side} {spec['algorithm']} exited {proc.returncode}; log {log_path}:\n{tail}")
    with open(timing_path) as f:
        timing = json.load(f)
    times = timing["step_times"]
    live = {}
    if measures_live_heap(args):  # the shim writes its peaks when the process exits
        with open(peaks_path) as f:
            heap, tensors, overflow = (int(x) for x in f.read().split())
        if overflow:
            raise RuntimeError(
                f"{side} {spec['algorithm']}: the live-heap shim's table of tensor blocks overflowed"
            )
        checkpoints = timing["checkpoints_mapped_kib"] / 1024
        live = {"peak_live_heap_mib": heap / 2**20, "peak_tensor_mib": tensors / 2**20,
                "checkpoints_mapped_mib": checkpoints, "peak_held_mib": tensors / 2**20 + checkpoints}  # fmt: skip
    return {
        "throughput": in_loop_throughput(times, spec),
        "throughput_cpu": in_loop_throughput(timing["step_cpu_times"], spec),
        "cpu_per_update_s": per_update(timing["step_cpu_times"], spec),
        "wall_per_update_s": per_update(times, spec),
        "forward_shapes": timing.get("forward_shapes"),
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": wall,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "peak_anon_mib": timing["peak_anon_kib"] / 1024,
        **live,
        "before_loop_s": times[0] - start,
        "loop_s": times[-1] - times[0],
        "after_loop_s": start + wall - times[-1],
        **{
            k: timing[k]
            for k in ("cuda_max_allocated_mib", "cuda_max_reserved_mib", "gpu", "profile")
            if k in timing
        },
    }


def pair_ratios(ours: list[float], other: list[float]) -> dict:
    """Median and min-max of ours[i] / other[i] over the pairs."""
    ratios = [a / b for a, b in zip(ours, other) if a is not None and b is not None]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def summarize(runs: dict) -> dict:
    """Per algorithm and figure: each side's median and the ratios ours/TRL and ours/bare over the pairs."""
    summary = {}
    for algorithm, sides in runs.items():
        entry = {}
        for figure in (
            "throughput",
            "throughput_cpu",
            "cpu_per_update_s",
            "wall_per_update_s",
            "wall_s",
            "cpu_s",
            "peak_rss_mib",
            "peak_anon_mib",
            "peak_live_heap_mib",
            "peak_tensor_mib",
            "checkpoints_mapped_mib",
            "peak_held_mib",
            "cuda_max_allocated_mib",
            "cuda_max_reserved_mib",
            "before_loop_s",
            "after_loop_s",
        ):
            values = {side: [run and run.get(figure) for run in sides[side]] for side in sides}
            if not any(x is not None for v in values.values() for x in v):
                continue  # a figure this run did not measure (the live heap without --live_heap)
            entry[figure] = {side: statistics.median([x for x in v if x is not None])
                             for side, v in values.items() if any(x is not None for x in v)}  # fmt: skip
            for other in ("trl", "bare"):
                if other in values:
                    entry[figure][f"ours/{other}"] = pair_ratios(values["ours"], values[other])
        summary[algorithm] = entry
    return summary


def fmt_ratio(ratio: dict | None) -> str:
    return "-" if ratio is None else f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def table(summary: dict, units: dict) -> str:
    """The README's table (markdown): in-loop throughput per CPU second and per wall second, whole-process wall
    and CPU time, peak memory."""
    lines = [
        "| algorithm | in-loop per CPU s: ours | TRL | ours / TRL | bare | ours / bare | in-loop per wall s: ours / TRL "
        "| ours / bare | process wall s: ours | TRL | ours / TRL | process CPU s: ours / TRL | peak RSS MiB: ours | TRL "
        "| ours / TRL | peak private MiB: ours | TRL | ours / TRL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(figure, side, digits=0):
        return f"{figure[side]:.{digits}f}" if side in figure else "-"

    for algorithm, e in summary.items():
        cpu, tp, wall, rss, anon = (
            e[x] for x in ("throughput_cpu", "throughput", "wall_s", "peak_rss_mib", "peak_anon_mib")
        )
        lines.append(
            f"| {algorithm} ({units[algorithm]}) | {num(cpu, 'ours')} | {num(cpu, 'trl')} | "
            f"{fmt_ratio(cpu.get('ours/trl'))} | {num(cpu, 'bare')} | {fmt_ratio(cpu.get('ours/bare'))} | "
            f"{fmt_ratio(tp.get('ours/trl'))} | {fmt_ratio(tp.get('ours/bare'))} | "
            f"{num(wall, 'ours', 1)} | {num(wall, 'trl', 1)} | {fmt_ratio(wall.get('ours/trl'))} | "
            f"{fmt_ratio(e['cpu_s'].get('ours/trl'))} | "
            f"{num(rss, 'ours')} | {num(rss, 'trl')} | {fmt_ratio(rss.get('ours/trl'))} | "
            f"{num(anon, 'ours')} | {num(anon, 'trl')} | {fmt_ratio(anon.get('ours/trl'))} |"
        )
    return "\n".join(lines)


def memory_table(summary: dict) -> str:
    """Per figure (peak RSS, peak private memory, in-loop CPU and wall seconds per update, whole-process wall):
    ours / TRL / bare medians, then the ratios ours / TRL and ours / bare (medians over the pairs)."""
    figures = [("peak_rss_mib", "peak RSS MiB", 0), ("peak_anon_mib", "peak private MiB", 0),
               ("peak_held_mib", "peak held MiB", 0),
               ("cpu_per_update_s", "CPU s / update", 1), ("wall_per_update_s", "wall s / update", 1),
               ("wall_s", "process wall s", 0)]  # fmt: skip
    head = " | ".join(f"{label}: ours / TRL / bare | ours / TRL | ours / bare" for _, label, _ in figures)
    lines = [f"| algorithm | {head} |", "|---" * (1 + 3 * len(figures)) + "|"]

    def ratio(r):
        return "-" if r is None else f"{r['median']:.2f}"

    for algorithm, e in summary.items():
        cells = []
        for figure, _, digits in figures:
            f = e.get(figure, {})
            values = " / ".join(f"{f[side]:.{digits}f}" if side in f else "-" for side in SIDES)
            cells += [values, ratio(f.get("ours/trl")), ratio(f.get("ours/bare"))]
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict, path: str, title: str, cuda: bool = False) -> None:
    """Four panels of ratios (in-loop throughput per CPU second and per wall second, whole-process wall and CPU
    time, peak memory; on cuda: in-loop throughput per wall second, whole-process wall time, peak CUDA memory
    allocated and reserved), one bar group per algorithm, whiskers min-max over the pairs."""
    try:
        import matplotlib
    except ImportError:  # a bare GPU machine: the results file is written already
        print(f"matplotlib is not installed: no plot at {path}", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    panels = [
        (
            "throughput_cpu",
            ["trl", "bare"],
            "in-loop examples per CPU second\nours / other (higher is better)",
        ),
        ("throughput", ["trl", "bare"], "in-loop examples per wall second\nours / other (higher is better)"),
        ("wall_s", ["trl"], "whole process, wall time\nours / TRL (lower is better)"),
        ("peak_anon_mib", ["trl"], "peak private (anonymous) memory\nours / TRL (lower is better)"),
    ]
    if cuda:
        panels = [
            ("throughput", ["trl"], "in-loop examples per wall second\nours / TRL (higher is better)"),
            ("wall_s", ["trl"], "whole process, wall time\nours / TRL (lower is better)"),
            ("cuda_max_allocated_mib", ["trl"], "peak CUDA memory allocated\nours / TRL (lower is better)"),
            ("cuda_max_reserved_mib", ["trl"], "peak CUDA memory reserved\nours / TRL (lower is better)"),
        ]
    colors = {"trl": "tab:blue", "bare": "tab:gray"}
    fig, axes = plt.subplots(1, len(panels), figsize=(17, 4.2))
    for ax, (figure, others, label) in zip(axes, panels):
        width = 0.8 / len(others)
        for j, other in enumerate(others):
            ratios = [summary[n].get(figure, {}).get(f"ours/{other}") for n in names]
            xs = [i + (j - (len(others) - 1) / 2) * width for i in range(len(names))]
            heights = [r["median"] if r else 0 for r in ratios]
            errors = [
                [r["median"] - r["min"] if r else 0 for r in ratios],
                [r["max"] - r["median"] if r else 0 for r in ratios],
            ]
            label_other = "ours / TRL" if other == "trl" else "ours / bare work"
            bars = ax.bar(xs, heights, width, yerr=errors, capsize=3, color=colors[other], label=label_other)
            for bar, h in zip(bars, heights):
                ax.annotate(f"{h:.2f}", (bar.get_x() + bar.get_width() / 2, h), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(label, fontsize=10)
        if len(others) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def gpu_table(summary: dict) -> str:
    """Per algorithm on cuda: peak torch.cuda.max_memory_allocated and max_memory_reserved, and wall seconds per
    update; ours / TRL (medians over the pairs) with both sides' medians."""
    figures = [("cuda_max_allocated_mib", "max allocated MiB", 0), ("cuda_max_reserved_mib", "max reserved MiB", 0),
               ("wall_per_update_s", "wall s / update", 3)]  # fmt: skip
    head = " | ".join(f"{label}: ours / TRL | ours / TRL" for _, label, _ in figures)
    lines = [f"| algorithm | {head} |", "|---" * (1 + 2 * len(figures)) + "|"]
    for algorithm, e in summary.items():
        cells = []
        for figure, _, digits in figures:
            f = e.get(figure, {})
            cells += [" / ".join(f"{f[side]:.{digits}f}" if side in f else "-" for side in ("ours", "trl")),
                      "-" if f.get("ours/trl") is None else f"{f['ours/trl']['median']:.2f}"]  # fmt: skip
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PRECISIONS = {"fp32": "fp32", "bf16": "bf16 autocast on fp32 weights"}


def device_record(device: str) -> dict:
    """The device every side ran on: the GPU (name, memory, count, torch's CUDA version) or the CPU. torch.cuda is
    asked only for cuda, which resolve() has checked is there."""
    import torch

    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        return {"type": "cuda", "name": torch.cuda.get_device_name(0), "memory_mib": properties.total_memory // 2**20,
                "count": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__}  # fmt: skip


def model_record(world: str) -> dict:
    """The world's policy model from its config: its sizes, weight dtype and parameter count (a Llama body: per
    layer the q, k, v, o projections, the gated MLP's three matrices and two norms; embeddings, the LM head unless
    tied, and the final norm)."""
    with open(os.path.join(world, "policy", "config.json")) as f:
        config = json.load(f)
    H, L, mlp, V = (
        config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    )
    heads = config["num_attention_heads"]
    kv_heads, head_dim = config.get("num_key_value_heads") or heads, config.get("head_dim") or H // heads
    attention = 2 * H * heads * head_dim + 2 * H * kv_heads * head_dim
    tied = config.get("tie_word_embeddings", False)
    parameters = V * H * (1 if tied else 2) + L * (attention + 3 * H * mlp + 2 * H) + H
    return {"hidden_size": H, "num_layers": L, "intermediate_size": mlp, "num_heads": heads, "vocab_size": V,
            "tied_embeddings": tied, "dtype": config.get("dtype") or config.get("torch_dtype"),
            "parameters": parameters}  # fmt: skip


def run_record(args: Args, world: str) -> dict:
    """What a result file says it measured: device (with the GPU's name), precision and model size."""
    return {
        "device": device_record(args.device),
        "precision": PRECISIONS[args.precision],
        "model": model_record(world),
    }


def describe(record: dict) -> str:
    """One line: the device's name, the model's size and the precision of a run_record."""
    device, model = record["device"], record["model"]
    where = (
        f"{device['name']} (cuda {device['cuda']})"
        if device["type"] == "cuda"
        else f"CPU, {device['cpus']} cores"
    )
    return (f"{where}; policy {model['parameters'] / 1e6:.0f}M parameters (hidden {model['hidden_size']} x "
            f"{model['num_layers']} layers, vocabulary {model['vocab_size']}); {record['precision']}")  # fmt: skip


def versions(python: str, names: list[str]) -> dict:
    """Package versions in the environment of `python`."""
    code = ("import importlib.metadata as m, json, platform, sys\n"
            "out = {'python': platform.python_version()}\n"
            "for n in sys.argv[1:]:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")  # fmt: skip
    result = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def ensure_world(args: Args, work: str) -> str:
    """The world of --preset's sizes in `work`/world, built (tiny_world.py or shape_world.py) unless it is there."""
    toy, world = args.preset == "toy", os.path.join(work, "world")
    size = ["--hidden_size", str(args.hidden_size), "--num_layers", str(args.num_layers),
            "--intermediate_size", str(args.intermediate_size), "--num_heads", str(args.num_heads)]  # fmt: skip
    world_config = os.path.join(world, "world.json")
    wanted = {
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "intermediate_size": args.intermediate_size,
        "num_heads": args.num_heads,
    }
    if not toy:
        wanted |= {"vocab_size": args.vocab_size, "prompt_length": args.prompt_length,
                   "response_length": args.response_length}  # fmt: skip
        size += [
            f"--{k}={v}"
            for k, v in wanted.items()
            if k not in ("hidden_size", "num_layers", "intermediate_size", "num_heads")
        ]
    if not os.path.exists(world_config) or any(
        json.load(open(world_config)).get(k) != v for k, v in wanted.items()
    ):
        builder = "tiny_world.py" if toy else "shape_world.py"
        print(f"building the world in {world} ({builder})", flush=True)
        folder = os.path.join(BENCHMARK, "tiny" if toy else "speed")
        subprocess.run([sys.executable, os.path.join(folder, builder), "--output_dir", world, *size],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return world


def main(args: Args) -> dict:
    args = resolve(args)
    toy = args.preset == "toy"
    if args.work_dir is None:
        args.work_dir = "benchmark/work/speed" if toy else f"benchmark/work/speed-{args.preset}"
    if args.output is None:
        args.output = "benchmark/results/speed.json" if toy else f"benchmark/results/speed_{args.preset}.json"
    unknown = set(args.algorithms) - set(ALGORITHMS)
    if unknown:
        raise ValueError(f"unknown algorithms {sorted(unknown)}; choose from {ALGORITHMS}.")
    algorithms = [a for a in args.algorithms if a != "grpo" or os.path.exists(os.path.join(ROOT, "grpo.py"))]
    if "bare" in args.sides and not args.no_bare and args.device == "cuda":
        print(
            "the bare loop (benchmark/speed/bare_work.py) runs on the CPU only: left out on cuda", flush=True
        )
    sides = [s for s in args.sides if s != "bare" or not (args.no_bare or args.device == "cuda")]
    pythons = {"ours": sys.executable, "bare": sys.executable}
    for name in ("trl_python", "trl_ppo_python"):
        path = getattr(args, name)
        needed = "trl" in sides and (
            any(a == "ppo" for a in algorithms)
            if name == "trl_ppo_python"
            else any(a != "ppo" for a in algorithms)
        )
        if needed and not os.path.exists(path):
            raise ValueError(
                f"--{name} {path} does not exist; create the TRL environment (requirements-trl.txt)."
            )
    work = os.path.abspath(args.work_dir)
    world = ensure_world(args, work)
    runs = {a: {s: [] for s in sides} for a in algorithms}
    failures, specs = [], {}
    started = time.time()

    lock = threading.Lock()

    def measure(i, algorithm, side):
        spec = workload(algorithm, args, world, os.path.join(work, f"{algorithm}-{side}"))
        # the result file records our command, with our output folder (TRL's side runs with its own)
        if side == "ours" or algorithm not in specs:
            specs[algorithm] = spec
        python = pythons.get(side) or (args.trl_ppo_python if algorithm == "ppo" else args.trl_python)
        log_path = os.path.join(work, "logs", f"{algorithm}-{side}-{i}.log")
        load = os.getloadavg()[0]
        try:
            result = run_one(side, spec, python, args, log_path)
            result["load_average"] = load
        except RuntimeError as error:
            failures.append(str(error))
            print(f"FAILED {error}", flush=True)
            return None
        with lock:  # runs.json keeps every finished run if the benchmark is interrupted (see --from_runs)
            runs[algorithm][side][i] = result
            with open(os.path.join(work, "runs.json"), "w") as f:
                json.dump(runs, f)
        print(f"run {i + 1}/{args.runs} {algorithm:6s} {side:4s}: {result['throughput']:8.1f} {spec['unit']}/s "
              f"in-loop ({result['throughput_cpu']:8.1f} per CPU second), {result['wall_s']:6.1f} s wall, "
              f"{result['cpu_s']:5.1f} s CPU, {result['peak_rss_mib']:5.0f} MiB peak RSS, "
              f"{result['peak_anon_mib']:5.0f} MiB private", flush=True)  # fmt: skip
        if "cuda_max_allocated_mib" in result:
            print(f"    {result['wall_per_update_s']:.3f} s per update, {result['cuda_max_allocated_mib']:.0f} MiB "
                  f"CUDA allocated at most ({result['cuda_max_reserved_mib']:.0f} reserved) on {result['gpu']}",
                  flush=True)  # fmt: skip
        return result

    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    if measures_live_heap(args):
        live_heap_library(work)  # built once here, before runs start in parallel
    if args.from_runs:
        with open(args.from_runs) as f:
            runs = json.load(f)
        runs = {a: sides_runs for a, sides_runs in runs.items() if a in algorithms}
        for algorithm in runs:
            specs[algorithm] = workload(algorithm, args, world, os.path.join(work, f"{algorithm}-ours"))
    # One round = every side of every algorithm once, in this order (ours, TRL, bare of one algorithm next to each
    # other); with --parallel > 1 the next runs of the round start as earlier ones end.
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for i in range(0 if args.from_runs else args.runs):
            for algorithm in algorithms:
                for side in sides:
                    runs[algorithm][side].append(
                        None
                    )  # a failed run stays None, so run i still pairs with run i
            list(pool.map(lambda job, i=i: measure(i, *job), [(a, s) for a in algorithms for s in sides]))
    summary = summarize(runs)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    units = {a: specs[a]["unit"] for a in algorithms}
    pairs = {a: sum(r is not None and t is not None for r, t in zip(runs[a]["ours"], runs[a].get("trl", [])))
             for a in runs}  # fmt: skip
    names = ["torch", "transformers", "accelerate", "datasets", "tokenizers", "trl"]
    trl_versions = {}
    for name, algos in (("trl_python", [a for a in algorithms if a != "ppo"]), ("trl_ppo_python", ["ppo"])):
        if "trl" in sides and set(algos) & set(algorithms):
            trl_versions[", ".join(a for a in algos if a in algorithms)] = versions(
                getattr(args, name), names
            )
    result = {
        "command": "python benchmark/speed/speed.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "args": asdict(args),
        "git_commit_at_end": commit,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },  # fmt: skip
        **run_record(args, world),
        "versions": {"ours": versions(sys.executable, names), "trl": trl_versions},
        "units": units,
        "commands": {a: {"ours": specs[a]["ours_command"]} for a in algorithms},
        "workloads": {a: {k: v for k, v in specs[a].items() if k != "ours_command"} for a in algorithms},
        "pairs": pairs,
        "summary": summary,
        "runs": runs,
        "failures": failures,
        "total_seconds": time.time() - started,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    trl_names = ", ".join(f"TRL {v['trl']} ({k})" for k, v in trl_versions.items())
    counts = (
        ", ".join(f"{a} {n}" for a, n in pairs.items()) if len(set(pairs.values())) > 1 else str(args.runs)
    )
    plot(summary, os.path.splitext(args.output)[0] + ".png",
         f"medians over runs (pairs: {counts}; whiskers: min-max over pairs); {describe(result)}; {trl_names}",
         args.device == "cuda")  # fmt: skip
    print(table(summary, units))
    print(gpu_table(summary) if args.device == "cuda" else memory_table(summary))
    print(
        f"{describe(result)}; TRL: {trl_names}; {len(failures)} failed runs; {result['total_seconds']:.0f} s in all"
    )
    return result


def cli() -> None:
    """`python benchmark/speed/speed.py ...`: a bad flag ends in one line,
    `speed.py: error: <sentence>`, exit 2."""
    import traceback

    import tyro

    args = tyro.cli(Args, use_underscores=True)
    try:
        main(args)
    except ValueError as error:
        if traceback.extract_tb(error.__traceback__)[-1].filename != os.path.abspath(__file__):
            raise  # not a flag this file checked: the whole traceback
        print(f"speed.py: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(*sys.argv[2:5])
    else:
        cli()
