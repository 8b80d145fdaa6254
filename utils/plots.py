"""Optional: the curves of a run's metrics.jsonl as a PNG for the model card (matplotlib). A copy of a script
without this file saves its model card without curves."""

from __future__ import annotations

import json
import math
import os

from utils.tracking import main_metrics


def plot_curves(metrics_path: str, png_path: str, limit: int = 6) -> str | None:
    """Plot the main metrics of a metrics.jsonl against the step (held-out values beside their training
    curve) into `png_path`; return it, or None when nothing was logged or matplotlib is missing."""
    if not os.path.exists(metrics_path):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line) if line.strip() else {}
            for name, value in record.items():
                if name != "step" and isinstance(value, int | float) and math.isfinite(value):
                    curves.setdefault(name, []).append((record.get("step", 0), value))
    chosen = main_metrics(curves, limit=len(curves))
    held_out_only = [name for name in chosen if name.startswith("eval/") and name[5:] not in curves]
    names = ([name for name in chosen if not name.startswith("eval/")] + held_out_only)[:limit]
    if not names:
        return None
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for label in (name, f"eval/{name}"):
            if label in curves:
                steps, values = zip(*curves[label])
                ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        if f"eval/{name}" in curves:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(png_path, dpi=90)
    plt.close(figure)
    return png_path
