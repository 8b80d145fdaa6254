"""Held-out evaluation in the RL scripts: completions of every prompt of --dataset_test_split, scored with the
training's rewards, averaged over all processes and logged as eval/<name> (docs/metrics.md).

The evaluation's sampling noise is keyed by (seed, EVAL_KEY, prompt index) (utils.generation.sampling_generator),
never drawn from a training generator, so a run with evaluation trains exactly as the same run without it, and
every evaluation of a run draws the same noise (their differences are the policy's)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from utils import data
from utils.loading import say_once
from utils.run import UsageError

EVAL_KEY = 0  # the evaluation's noise key; the scripts key training's by the update (from 1)


def check_args(args) -> None:
    """One-sentence UsageErrors for the evaluation flags (before any model is loaded)."""
    if args.eval_steps is not None and args.eval_steps < 1:
        raise UsageError(f"--eval_steps must be at least 1, got {args.eval_steps}.")
    if args.per_device_eval_batch_size < 1:
        raise UsageError(
            f"--per_device_eval_batch_size must be at least 1, got {args.per_device_eval_batch_size}."
        )


def named_on_command_line(flag: str) -> bool:
    """Whether `--flag` (or its dashed spelling) is on the command line."""
    spellings = (f"--{flag}", f"--{flag.replace('_', '-')}")
    return any(arg.split("=")[0] in spellings for arg in sys.argv[1:])


def load_test_split(args, script: str, default: str | None = None):
    """The held-out prompts (a dataset with a `prompt` column), or None: --eval_strategy no, no
    --dataset_test_split, or the script's `default` split left unnamed and absent (one line, as TRL evaluates
    nothing by default). A split named on the command line that the dataset lacks is a one-sentence UsageError
    (utils.data.load_split): call this before any model is loaded."""
    split = args.dataset_test_split
    if args.eval_strategy == "no" or not split:
        return None
    if split == default and not named_on_command_line("dataset_test_split"):
        if not data.has_split(args.dataset_name, split, args.dataset_config):
            say_once(
                f'{script}: no "{split}" split in {args.dataset_name}: evaluation skipped '
                "(give --dataset_test_split to evaluate)"
            )
            return None
    dataset = data.load_split(args.dataset_name, split, args.dataset_config)
    data.check_columns(dataset, ["prompt"], f"--dataset_test_split {split}")
    return dataset


def due(update: int, num_updates: int, args) -> bool:
    """Whether update `update` (from 1) ends with an evaluation and a sample table: every --eval_steps updates,
    else at the first and every num_updates // --num_sample_generations (0: never); always after the last one
    that has any; never with --eval_strategy no."""
    if args.eval_strategy == "no":
        return False
    if args.eval_steps:
        return update % args.eval_steps == 0 or update == num_updates
    if not args.num_sample_generations:
        return False
    every = max(1, num_updates // args.num_sample_generations)
    return update == 1 or update % every == 0 or update == num_updates


def prompt_share(num_prompts: int, rank: int, world: int) -> tuple[list[int], int]:
    """This process's contiguous block of the held-out prompts, padded (its last prompt repeated) to the same
    length on every process, so that all take part in the same number of batches (ZeRO-3 gathers in each):
    (indices, how many of them are real)."""
    per_process = math.ceil(num_prompts / world)
    start = min(rank * per_process, num_prompts)
    indices = list(range(start, min(start + per_process, num_prompts)))
    real = len(indices)
    filler = indices[-1] if indices else num_prompts - 1
    return indices + [filler] * (per_process - real), real


@torch.no_grad()
def evaluate(accelerator, num_prompts: int, prompts_per_batch: int, complete_and_score: Callable):
    """({"eval/<name>": mean over every completion of every held-out prompt, all processes}, what the first
    batch of this process returned for the sample table).

    complete_and_score(indices) samples and scores the completions of the held-out prompts `indices` (positions
    in the split) and returns ({name: one value per completion, completion-major: row i is of prompt
    i % len(indices)}, anything for the sample table); the same names on every process. The padding prompts
    count 0; a NaN (an unscorable completion) is left out of its mean, as TRL's nanmean."""
    indices, real = prompt_share(num_prompts, accelerator.process_index, accelerator.num_processes)
    names, sums, first = None, None, None
    for start in range(0, len(indices), prompts_per_batch):
        batch = indices[start : start + prompts_per_batch]
        values, shown = complete_and_score(batch)
        first = shown if first is None else first
        names = names or list(values)
        is_real = torch.arange(start, start + len(batch), device=accelerator.device) < real
        batch_sums = []
        for name in names:
            rows = values[name].detach().to(accelerator.device, torch.float64).reshape(-1, len(batch))
            counted = is_real[None, :] & ~rows.isnan()
            batch_sums.append(torch.stack([rows.nan_to_num(0.0)[counted].sum(), counted.sum().double()]))
        batch_sums = torch.stack(batch_sums)
        sums = batch_sums if sums is None else sums + batch_sums
    sums = accelerator.reduce(sums, reduction="sum")
    means = {f"eval/{name}": (total / count).item() for name, (total, count) in zip(names, sums) if count > 0}
    return means, first
