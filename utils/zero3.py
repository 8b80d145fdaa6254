"""Plumbing of DeepSpeed ZeRO-3: frozen models as sharded engines, the shards gathered for sampling, whole
weights at load. Optional: utils/run.py reaches it only under a ZeRO-3 launch (`utils.run.zero3()`), through
the names the scripts call there (`prepare_frozen`, `gathered_for_generation`, `unsharded_loading`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import deepspeed
import torch.nn as nn
from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

from utils.run import bare


def frozen_engine(model: nn.Module, plugin) -> nn.Module:
    """A frozen model (on the device, cast) as a sharded DeepSpeed engine in eval mode: the run's config less
    its optimizer, scheduler and global batch."""
    config = {k: v for k, v in plugin.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
    config["train_micro_batch_size_per_gpu"] = config.get("train_micro_batch_size_per_gpu", 1)
    config.pop("train_batch_size", None)
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.eval()
    return engine


@contextmanager
def unsharded_loading(plugin) -> Iterator[None]:
    """`from_pretrained` loads whole weights in this block, though zero3_init_flag would shard them."""
    if not plugin.zero3_init_flag:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


@contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """The bare model with its shards gathered once, for sampling (every process enters together); while
    inside, `model.gathered_for_generation` counts the entries (`utils.run.gathered` reads it)."""
    if getattr(model, "optimizer", None) is None:  # a frozen engine: gather only
        context = deepspeed.zero.GatheredParameters(list(model.parameters()))
    else:
        context = unwrap_model_for_generation(model)
    model.gathered_for_generation = getattr(model, "gathered_for_generation", 0) + 1
    try:
        with context:
            yield bare(model)
    finally:
        model.gathered_for_generation -= 1


def local_param_share(model: nn.Module) -> float:
    """The share of the weights this process holds."""
    params = list(model.parameters())
    return sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)
