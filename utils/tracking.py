"""What a run reports: metrics to TensorBoard, metrics.jsonl and W&B, tables of samples, and the guard that stops
a run on a NaN or an infinity, naming the last good checkpoint."""

from __future__ import annotations

import json
import os

import torch

from utils import checkpoint
from utils.run import NonFiniteError


def print_samples(columns: dict[str, list], title: str = "samples", max_rows: int = 8) -> None:
    """Print a rich table of sample completions (one column per key)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for name in columns:
        table.add_column(name)
    for row in list(zip(*columns.values()))[:max_rows]:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


class Tracker:
    """Metrics of the run, written by the main process to TensorBoard ({logging_dir}/{run_name}),
    metrics.jsonl beside it (one JSON object per logged step, with its `step`) and W&B with --track.

    Resuming from a checkpoint at `start_step` continues the same files: the lines of metrics.jsonl after
    that step (logged by the interrupted run after its last checkpoint) are dropped and TensorBoard purges
    its events after it, so no step appears twice or goes missing. A fresh run whose {logging_dir}/{run_name}
    already holds logs (an explicit --run_name used before) moves them aside first, saying where."""

    def __init__(self, args, accelerator, start_step: int = 0):
        self.active = accelerator.is_main_process
        self.run_dir = os.path.join(args.logging_dir, args.run_name)
        self.path = os.path.join(self.run_dir, "metrics.jsonl")
        self.track = getattr(args, "track", False)
        if not self.active:
            return
        from torch.utils.tensorboard import SummaryWriter

        if (
            not start_step
        ):  # a fresh run never writes into (or truncates) an earlier run's logs of the same name
            moved = checkpoint.move_aside(self.run_dir, f"run name {args.run_name}")
            if moved:
                print(moved, flush=True)
        os.makedirs(self.run_dir, exist_ok=True)
        kept = []
        if start_step and os.path.exists(self.path):
            # The lines the checkpoint saw (what was logged after it, e.g. a final evaluation cut short, goes);
            # an older checkpoint without that count: the lines up to its step.
            resumed = checkpoint.resumed_state()
            same = resumed.get("step") == start_step and resumed.get("run_name") == args.run_name
            count = resumed.get("metrics_lines") if same else None
            with open(self.path) as f:
                lines = [line for line in f if line.strip()]
            if count is not None:
                kept = lines[:count]
            else:
                kept = [line for line in lines if json.loads(line).get("step", 0) <= start_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        self.writer = SummaryWriter(self.run_dir, purge_step=start_step + 1 if start_step else None)
        config = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | type(None))}
        if not start_step:
            table = "\n".join(f"|{key}|{value}|" for key, value in config.items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        if self.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name,
                       id=args.run_name.replace("/", "_"), resume="allow", config=config,
                       sync_tensorboard=True)  # fmt: skip

    def log(self, metrics: dict, step: int) -> None:
        """Write one step's metrics (plain numbers) everywhere."""
        if not self.active:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def samples(self, columns: dict[str, list], title: str) -> None:
        """Print a table of sampled completions (one list per column) and, with --track, log it to W&B."""
        if not self.active:
            return
        print_samples(columns, title=title)
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
        if self.track:
            import wandb

            wandb.finish()


def check_finite(step: int, accelerator=None, **values) -> None:
    """Raise NonFiniteError naming the step and the quantity when one of `values` (numbers or tensors) is NaN
    or infinite. With `accelerator`, every process raises together when any process found one (otherwise the
    others would wait forever in the next collective)."""
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
        last = checkpoint.last_saved()
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
        raise NonFiniteError(f"step {step}: {', '.join(bad)} is not finite (NaN or inf); {kept}.")
