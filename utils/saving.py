"""The final save (transformers checkpoint, tokenizer, model card) and the push to the hub."""

from __future__ import annotations

import os

import torch.nn as nn

from utils.loading import config_dropout_kept
from utils.run import extra_module


def card_curves(metrics_path: str, output_dir: str) -> bool:
    """Draw `output_dir/curves.png` from a metrics.jsonl for the model card with the optional utils/plots.py;
    False when a copy lacks that file or there is nothing to draw."""
    plots = extra_module("utils.plots")
    return bool(plots) and plots.plot_curves(metrics_path, os.path.join(output_dir, "curves.png")) is not None


def write_model_card(output_dir: str, algorithm: str, base_model: str, dataset: str, metrics: dict,
                     title: str | None = None, args=None) -> None:  # fmt: skip
    """Write `output_dir/README.md`: hub metadata, algorithm, base model, dataset, command, final metrics; with
    `args`, the resolved configuration and the curves of its metrics.jsonl (curves.png). `title` defaults to
    the folder's name."""
    import shlex
    import sys

    from huggingface_hub import ModelCardData

    title = title or os.path.basename(os.path.abspath(output_dir))
    script = os.path.basename(sys.argv[0])[: -len(".py")] if sys.argv[0].endswith(".py") else "rlhf-reference"
    data_name = getattr(args, "dataset_name", None) or dataset
    metadata = ModelCardData(base_model=base_model, datasets=[data_name] if data_name else None,
                             library_name="transformers", model_name=title, tags=[script, "rlhf-reference"])  # fmt: skip
    lines = [
        "---",
        metadata.to_yaml(),
        "---",
        "",
        f"# {title}",
        "",
        f"- algorithm: {algorithm}",
        f"- base model: `{base_model}`",
        f"- dataset: `{dataset}`",
        "",
        "## Command",
        "",
        "```",
        shlex.join(["python", *sys.argv]),
        "```",
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()],
        "",
    ]
    if args is not None:
        metrics_path = os.path.join(getattr(args, "logging_dir", "runs"), str(getattr(args, "run_name", "")),
                                    "metrics.jsonl")  # fmt: skip
        if card_curves(metrics_path, output_dir):
            lines += ["## Curves", "", f"![training curves](curves.png) (from `{metrics_path}`)", ""]
        config = {name: str(value).replace("|", "\\|") for name, value in vars(args).items()}  # table-safe
        lines += ["## Configuration", "", f"<details><summary>every flag, as resolved ({len(config)})</summary>",
                  "", "| flag | value |", "|---|---|", *[f"| {name} | `{value}` |" for name, value in config.items()],
                  "", "</details>", ""]  # fmt: skip
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def push_to_hub(args) -> None:
    """Upload --output_dir, without its checkpoints, to --hub_model_id (default: the folder's name)."""
    from huggingface_hub import HfApi

    api = HfApi()
    name = getattr(args, "hub_model_id", None) or os.path.basename(os.path.abspath(args.output_dir))
    repo_id = api.create_repo(name, exist_ok=True).repo_id
    api.upload_folder(
        repo_id=repo_id, folder_path=args.output_dir, ignore_patterns=["checkpoint-*", "tmp-checkpoint-*"]
    )


def save_model(checkpointer, model: nn.Module, tokenizer, args, algorithm: str, base_model: str, metrics: dict,
               submodule: str | None = None) -> None:  # fmt: skip
    """Save `model` (or its attribute `submodule`) with tokenizer and card to --output_dir (the run's
    `checkpointer` moves a replaced run's files aside first); push with --push_to_hub. Every process must call
    it: under ZeRO-3 the state dict gathers the shards."""
    accelerator = checkpointer.accelerator
    accelerator.wait_for_everyone()
    checkpointer.start_over()
    state_dict = accelerator.get_state_dict(model)
    module = accelerator.unwrap_model(model)
    if submodule is not None:
        module, prefix = getattr(module, submodule), submodule + "."
        if state_dict is not None:
            state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    os.makedirs(args.output_dir, exist_ok=True)
    with config_dropout_kept(module):
        module.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
            state_dict=state_dict,
        )  # fmt: skip
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        write_model_card(args.output_dir, algorithm, base_model, args.dataset_name, metrics, args=args)
        if args.push_to_hub:
            push_to_hub(args)
