"""LoRA (--use_peft) for the RL scripts and reward.py, with TRL's ModelConfig flags: adapters on the trained
model, the reference as the same model with its adapter switched off (no second copy), the merged weights for
vLLM, and the final save (the merged model in --output_dir, the adapter alone in --output_dir/adapter).
Optional: imported only under --use_peft.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from utils.run import UsageError, bare, inner_model, zero_stage


def check_args(args, accelerator) -> None:
    """The LoRA flags a run cannot honour, refused before any model is loaded."""
    if zero_stage(accelerator) == 3:
        raise UsageError(
            "--use_peft merges the adapter into the saved model, which ZeRO-3 cannot; use ZeRO-2."
        )
    if getattr(args, "use_vllm", False) and args.use_dora:
        raise UsageError(
            "--use_dora with --use_vllm: the engine gets merged LoRA weights, written here for LoRA only."
        )
    if args.lora_r < 1:
        raise UsageError(f"--lora_r {args.lora_r}: the rank must be at least 1.")


def add_adapter(model: nn.Module, args, seed: int, task_type: str = "CAUSAL_LM") -> nn.Module:
    """`model` with LoRA adapters (peft's PeftModel), initialised from `seed` whatever ran before, without moving
    the global random stream."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    config = LoraConfig(
        task_type=task_type,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        modules_to_save=args.lora_modules_to_save,
        use_rslora=args.use_rslora,
        use_dora=args.use_dora,
        bias="none",
    )
    if args.gradient_checkpointing:  # frozen embeddings must still pass gradients into the checkpoints
        model.enable_input_require_grads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


class AdapterOff(nn.Module):
    """The reference model without a second copy of the weights: the policy's forward with its adapter off."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule: the parameters stay the policy's alone

    @property
    def config(self):
        return inner_model(self.policy).config

    def get_output_embeddings(self):  # the tiled LM head reads the policy's head
        return inner_model(self.policy).get_output_embeddings()

    def forward(self, *args, **kwargs):
        peft_model = bare(self.policy)
        with peft_model.disable_adapter():
            return peft_model(*args, **kwargs)


@torch.no_grad()
def merged_state_dict(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own names with each adapter merged in (W + B A * scale); the model
    is not changed (merging and unmerging at every sync would round the base weights a little each time)."""
    from peft.tuners.lora import LoraLayer

    base = bare(peft_model).get_base_model()
    deltas = {
        f"{name}.base_layer.weight": sum(m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A)
        for name, m in base.named_modules()
        if isinstance(m, LoraLayer)
    }
    merged = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key or ".original_module." in key:
            continue
        value = tensor + deltas[key].to(tensor.dtype) if key in deltas else tensor
        merged[key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")] = value
    return merged


def save_adapter_and_merge(accelerator, peft_model: nn.Module, output_dir: str) -> nn.Module:
    """Save the adapter alone to `output_dir`/adapter (TRL's layout) and return the base model with the adapter
    merged in; the adapter is gone from `peft_model` afterwards."""
    if accelerator.is_main_process:
        peft_model.save_pretrained(os.path.join(output_dir, "adapter"))
    return peft_model.merge_and_unload()


def save_model(checkpointer, model: nn.Module, tokenizer, args, algorithm: str, base_model: str, metrics: dict,
               submodule: str | None = None) -> None:  # fmt: skip
    """utils.saving.save_model for a LoRA model: the adapter alone to --output_dir/adapter (TRL's layout), then
    the model with the adapter merged in to --output_dir, which vLLM, evaluation and the next stage load."""
    import utils.saving

    accelerator = checkpointer.accelerator
    checkpointer.start_over()
    holder = bare(model)
    merged = save_adapter_and_merge(
        accelerator, getattr(holder, submodule) if submodule else holder, args.output_dir
    )
    if submodule:
        setattr(holder, submodule, merged)
    utils.saving.save_model(checkpointer, model if submodule else merged, tokenizer, args,
                            f"{algorithm} (LoRA r={args.lora_r}, alpha={args.lora_alpha})", base_model, metrics,
                            submodule)  # fmt: skip
