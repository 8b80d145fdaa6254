"""Metrics to TensorBoard, metrics.jsonl and W&B, sample tables, and the guard that stops a run on NaN."""

from __future__ import annotations

import json
import math
import os

import torch

from utils import checkpoint
from utils.run import NonFiniteError


def print_samples(columns: dict[str, list], title: str = "samples", max_rows: int = 8) -> None:
    """Print a rich table, one column per key."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for name in columns:
        table.add_column(name)
    for row in list(zip(*columns.values()))[:max_rows]:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


class Tracker:
    """The main process's metrics: TensorBoard and metrics.jsonl in {logging_dir}/{run_name}; W&B, --track.

    A resume (the checkpointer's) drops what was logged after its checkpoint, so no step appears twice; a fresh
    run moves an earlier run's logs of the same name aside."""

    def __init__(self, args, checkpointer):
        accelerator, resumed = checkpointer.accelerator, checkpointer.resumed
        self.accelerator, self.checkpointer = accelerator, checkpointer
        start_step = resumed.get("step", 0)
        self.active = accelerator.is_main_process
        self.run_dir = os.path.join(args.logging_dir, args.run_name)
        self.path = os.path.join(self.run_dir, "metrics.jsonl")
        self.track = getattr(args, "track", False)
        self.output_dir = getattr(args, "output_dir", None)
        if not self.active:
            return
        from torch.utils.tensorboard import SummaryWriter

        if not start_step:  # never truncate an earlier run's logs
            moved = checkpoint.move_aside(self.run_dir, f"run name {args.run_name}")
            if moved:
                print(moved, flush=True)
        os.makedirs(self.run_dir, exist_ok=True)
        kept = []
        if start_step and os.path.exists(self.path):
            # Keep the lines the checkpoint saw (an older checkpoint: those up to its step).
            same = resumed.get("step") == start_step and resumed.get("run_name") == args.run_name
            count = resumed.get("metrics_lines") if same else None
            kept = logged_until(self.path, start_step, count)
        with open(self.path, "w") as f:
            f.writelines(kept)
        self.writer = SummaryWriter(self.run_dir, purge_step=start_step + 1 if start_step else None)
        config = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | type(None))}
        if not start_step:
            table = "\n".join(f"|{key}|{value}|" for key, value in config.items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        where = f"logs: {self.run_dir}/ (metrics.jsonl, samples.jsonl, TensorBoard)"
        output = getattr(args, "output_dir", None)
        print(f"{where}; watch with: tensorboard --logdir {args.logging_dir}"
              + (f"; model: {output}/" if output else ""), flush=True)  # fmt: skip
        if self.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name,
                       id=args.run_name.replace("/", "_"), resume="allow", config=config,
                       sync_tensorboard=True)  # fmt: skip

    def check_finite(self, step: int, **values) -> None:
        """Stop the run (NonFiniteError on every process) when one of `values` is NaN or inf (check_finite)."""
        check_finite(step, self.accelerator, self.checkpointer.last_saved, **values)

    def log(self, metrics: dict, step: int) -> None:
        """Write one step's metrics (plain numbers) everywhere."""
        if not self.active:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        line = console_line(metrics, step)
        if line:
            from tqdm import tqdm

            tqdm.write(line)  # above an open progress bar, not through it

    def samples(self, columns: dict[str, list], title: str) -> None:
        """Print a table of samples (one list per column), its rows appended to samples.jsonl; W&B with --track."""
        if not self.active:
            return
        print_samples(columns, title=title)
        with open(os.path.join(self.run_dir, "samples.jsonl"), "a") as f:  # one line a row, as sft.py's
            for row in zip(*columns.values()):
                f.write(json.dumps({"table": title, **dict(zip(columns, row))}, default=str) + "\n")
        if self.track:
            import wandb

            wandb.log(
                {
                    "samples": wandb.Table(
                        columns=list(columns), data=[list(r) for r in zip(*columns.values())]
                    )
                }
            )

    def close(self) -> None:
        if not self.active:
            return
        self.writer.close()
        card = [
            name
            for name in ("README.md", "curves.png")
            if os.path.exists(os.path.join(self.output_dir or "", name))
        ]
        saved = f"; model in {self.output_dir}/ (card: {', '.join(card)})" if card else ""
        print(f"done: logs in {self.run_dir}/{saved}", flush=True)
        if self.track:
            import wandb

            wandb.finish()


def logged_until(path: str, step: int, count: int | None = None) -> list[str]:
    """The lines of a metrics.jsonl a resume at `step` keeps: the first `count` (what its checkpoint saw), or
    without a count those logged at or before `step`."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if count is not None:
        return lines[:count]
    return [line for line in lines if json.loads(line).get("step", 0) <= step]


# The metrics a console line and the curves show first, when a script logs them (docs/metrics.md).
MAIN_METRICS = ("loss", "objective/rlhf_reward", "objective/scores", "reward", "accuracy", "rewards/accuracies",
                "rewards/margins", "objective/kl", "kl", "objective/entropy", "entropy", "loss/policy_avg",
                "objective/reward_mean", "learning_rate", "grad_norm")  # fmt: skip


def main_metrics(names, limit: int = 8) -> list[str]:
    """The first `limit` of `names` by MAIN_METRICS, the held-out ones (eval/...) of those after them."""
    names = list(names)
    chosen = [name for name in MAIN_METRICS if name in names]
    chosen += [f"eval/{name}" for name in MAIN_METRICS if f"eval/{name}" in names]
    chosen += [name for name in names if name.startswith("eval/") and name not in chosen]
    return chosen[:limit]


def console_line(metrics: dict, step: int) -> str:
    """`step 10 | loss 0.1234 | kl 0.0021 | ...`: the step's main metrics, '' when it logged none of them."""
    names = main_metrics(metrics)
    if not names:
        return ""
    text = [f"{name} {metrics[name]:.3g}" if name == "learning_rate" else f"{name} {metrics[name]:.4g}"
            for name in names]  # fmt: skip
    return " | ".join([f"step {step}", *text])


def mean_by_key(window: list[dict[str, float]], skip_nan: bool = False) -> dict[str, float]:
    """Each key's mean over the dicts of `window` that have it: the metrics of the steps since the last log,
    averaged as TRL's logger does (`--logging_steps`); `skip_nan` leaves NaN values out as TRL's GRPO does (NaN
    when none is left)."""
    means = {}
    for key in dict.fromkeys(k for d in window for k in d):
        values = [d[key] for d in window if key in d and not (skip_nan and math.isnan(d[key]))]
        means[key] = sum(values) / len(values) if values else math.nan
    return means


def check_finite(step: int, accelerator=None, last_checkpoint: str | None = None, **values) -> None:
    """NonFiniteError naming the step, the quantity and `last_checkpoint` when one of `values` is NaN or inf.
    With `accelerator`, all processes raise together, else the others hang in the next collective."""
    bad = []
    for name, value in values.items():
        if value is None:
            continue
        tensor = torch.as_tensor(value).detach().float()
        if not torch.isfinite(tensor).all():
            bad.append(name)
    if accelerator is not None and accelerator.num_processes > 1:
        flag = torch.tensor([float(bool(bad))], device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() > 0 and not bad:
            bad = ["a value on another process"]
    if bad:
        kept = (
            f"the last good checkpoint is {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was written"
        )
        raise NonFiniteError(f"step {step}: {', '.join(bad)} is not finite (NaN or inf); {kept}.")
