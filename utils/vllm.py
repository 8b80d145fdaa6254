"""Plumbing: sampling with vLLM (`--use_vllm`), one engine per process or tensor-parallel group, colocated.
TRL's flag names and meanings (vllm_mode "colocate" only). Install: `pip install -r requirements-vllm.txt`.

    engine = utils.vllm.Engine(args, accelerator, policy_path, max_model_len)    # once, after the models
    engine.sync_weights(model, accelerator)     # before every rollout, outside any gathering context
    query_responses, logprobs = engine.generate(model, queries, query_mask, R, T, chunk, generator)

The logprobs are the training forward's, so the first ratio is exactly 1 (vLLM's kernels differ:
docs/gpus.md); `engine_logprobs=True` gives vLLM's own. The caller's generator draws one vLLM seed per row."""

from __future__ import annotations

import math
import os
import random
import warnings

import numpy as np
import torch
import torch.nn as nn

from utils.generation import pad
from utils.loading import load_kwargs
from utils.logprobs import batched_response_logprobs
from utils.run import UsageError, gathered_for_generation

CPU_KV_CACHE_GIB = (
    "1"  # KV cache of a CPU engine unless VLLM_CPU_KVCACHE_SPACE says otherwise (vLLM takes 11 GiB)
)


def check_args(args) -> None:
    """Refuse impossible vLLM flags and a missing vLLM before any model is loaded."""
    if not getattr(args, "use_vllm", False):
        return
    if args.vllm_mode != "colocate":
        raise UsageError(f"--vllm_mode {args.vllm_mode} is not provided; use --vllm_mode colocate.")
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise UsageError(
            f"--vllm_gpu_memory_utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}."
        )
    if args.vllm_tensor_parallel_size < 1:
        raise UsageError(
            f"--vllm_tensor_parallel_size must be at least 1, got {args.vllm_tensor_parallel_size}."
        )
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise UsageError(
            f"--use_vllm needs vLLM, which could not be imported ({error}); "
            "install it with `pip install -r requirements-vllm.txt`."
        ) from None


def check_importance_sampling_flags(args) -> None:
    """TRL's checks of the --vllm_importance_sampling_* flags (even without --use_vllm); _cap: _clip_max."""
    if args.vllm_importance_sampling_cap is not None:
        warnings.warn(
            "--vllm_importance_sampling_cap is deprecated; use --vllm_importance_sampling_clip_max.",
            FutureWarning,
            stacklevel=2,
        )
        args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_cap = (
            args.vllm_importance_sampling_cap,
            None,
        )
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise UsageError(
            f"--vllm_importance_sampling_clip_min {low} must be below --vllm_importance_sampling_clip_max "
            f"{high}."
        )
    truncating = args.vllm_importance_sampling_mode.endswith("_truncate")
    if args.vllm_importance_sampling_correction and truncating and low is None and high is None:
        raise UsageError(
            f"--vllm_importance_sampling_mode {args.vllm_importance_sampling_mode} needs "
            "--vllm_importance_sampling_clip_min or --vllm_importance_sampling_clip_max."
        )


def engine_dtype(accelerator) -> torch.dtype:
    """The training forward's precision: bf16/fp16 under mixed precision, else float32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)


class Engine:
    """A colocated vLLM engine that samples like `utils.generation.generate`."""

    def __init__(self, args, accelerator, model_path: str, max_model_len: int):
        check_args(args)
        world, rank, tp = accelerator.num_processes, accelerator.process_index, args.vllm_tensor_parallel_size
        if world % tp:
            raise UsageError(
                f"--vllm_tensor_parallel_size {tp} must divide the number of processes ({world})."
            )
        # in this process, not a subprocess: the weight sync hands over tensors
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.max_model_len = max_model_len
        if accelerator.device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        from vllm import LLM

        # a tensor-parallel group samples the same prompts with the same seeds
        self.group, self.group_rank = None, 0
        if tp > 1:
            self.group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(start, start + tp)) for start in range(0, world, tp)]
            )
            self.group_rank = rank % tp
        if world > 1:
            # vLLM's "external launcher" joins the existing process group and needs LOCAL_RANK
            os.environ.setdefault("LOCAL_RANK", str(accelerator.local_process_index))
        self.owns_process_group = not torch.distributed.is_initialized()
        # creating the engine reseeds the global generators and disables torch.set_num_threads: restore both
        set_num_threads, python_state, numpy_state = (
            torch.set_num_threads,
            random.getstate(),
            np.random.get_state(),
        )
        with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
            self.llm = LLM(
                model=model_path,
                dtype=engine_dtype(accelerator),
                seed=args.seed + rank // tp,  # sampling noise per engine; rows get their own seeds anyway
                tensor_parallel_size=tp,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                max_model_len=max_model_len,
                enforce_eager=accelerator.device.type == "cpu",  # no graphs to capture on CPU
                distributed_executor_backend="external_launcher" if world > 1 else None,
                logprobs_mode="processed_logprobs",  # logprobs of logits / temperature, as the update uses
                skip_tokenizer_init=True,  # token ids in and out; the policy folder may hold no tokenizer
                **load_kwargs(None, model_path),  # --trust_remote_code, --model_revision
            )
        torch.set_num_threads = set_num_threads
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        self.last_engine_logprobs: torch.Tensor | None = None

    @torch.no_grad()
    def generate(
        self,
        model: nn.Module,
        queries: torch.Tensor,
        query_mask: torch.Tensor,
        response_length: int,
        temperature: float,
        chunk_size: int,
        generator: torch.Generator | None = None,
        engine_logprobs: bool = False,
        **knobs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`utils.generation.generate` with vLLM -> (query_responses [B, Q+R], logprobs [B, R]); the logprobs
        are `model`'s forward's, or with `engine_logprobs` vLLM's own; `knobs` (top_k, top_p, min_p,
        repetition_penalty) go to vLLM's sampler, whose repetition penalty sees no padding. A row too long for
        R more tokens in the engine (a later turn of --tools, whose caller keeps fewer) gets what fits, padded."""
        from vllm import SamplingParams

        prompts = [row[mask].tolist() for row, mask in zip(queries, query_mask.bool())]
        if generator is not None and temperature > 0:
            seeds = torch.randint(2**31 - 1, (len(prompts),), generator=generator, device=generator.device)
            seeds = seeds.tolist()
        else:
            seeds = [None] * len(prompts)
        mine = slice(0, len(prompts))
        if self.group is not None:  # every process of the group samples the group's prompts
            shares = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(shares, (prompts, seeds), group=self.group)
            start = sum(len(p) for p, _ in shares[: self.group_rank])
            mine = slice(start, start + len(prompts))
            prompts, seeds = (
                [p for share in shares for p in share[0]],
                [s for share in shares for s in share[1]],
            )
        room = [min(response_length, self.max_model_len - len(p)) for p in prompts]
        params = [
            # ignore_eos, not min_tokens: min_tokens would forbid EOS, which generate samples then cuts at
            SamplingParams(
                n=1,
                temperature=temperature,
                max_tokens=tokens,
                ignore_eos=True,
                logprobs=0,
                seed=seed,
                detokenize=False,
                **{**knobs, "min_p": knobs.get("min_p") or 0.0},
            )  # fmt: skip
            for seed, tokens in zip(seeds, room)
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[mine]
        completions = [output.outputs[0] for output in outputs]
        if any(len(c.token_ids) != tokens for c, tokens in zip(completions, room[mine])):
            raise RuntimeError(f"vLLM returned completions shorter than {response_length} tokens.")
        responses = pad([list(c.token_ids) for c in completions], 0, width=response_length)
        self.last_engine_logprobs = pad(
            [[step[token].logprob for step, token in zip(c.logprobs, c.token_ids)] for c in completions],
            0.0,
            width=response_length,
            dtype=torch.float,
        )
        query_responses = torch.cat([queries, responses.to(queries.device)], 1)
        if engine_logprobs:
            return query_responses, self.last_engine_logprobs.to(queries.device)
        # every row attends to all R tokens, as in utils.generation.generate
        attention_mask = torch.cat(
            [query_mask.bool(), torch.ones_like(responses, dtype=torch.bool).to(queries.device)], 1
        )
        logprobs = batched_response_logprobs(
            model, query_responses, attention_mask, queries.size(1), temperature, chunk_size
        )
        return query_responses, logprobs

    @torch.no_grad()
    def sync_weights(self, model: nn.Module, accelerator, attribute: str | None = None) -> None:
        """Load the model's weights (or its submodule `attribute`) into the engine; every process calls it
        together (ZeRO-3 gathers the shards)."""
        with gathered_for_generation(model, accelerator) as bare:
            policy = getattr(bare, attribute) if attribute else bare
            state = policy.state_dict()
            if hasattr(policy, "peft_config"):  # LoRA (utils/lora.py): adapter merged in, the base's names
                from utils.lora import merged_state_dict

                state = merged_state_dict(policy)
            weights = [(name, tensor.detach()) for name, tensor in state.items()]
            # not load_weights: the CPU backend repacks linear weights only in reload_weights
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
        # cached prefixes hold the old weights' keys and values
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Free the engine, and the process group it started (single-process runs)."""
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        del self.llm
        gc.collect()
        if self.owns_process_group and torch.distributed.is_initialized():
            destroy_model_parallel()
            destroy_distributed_environment()

    @torch.no_grad()
    def sequence_logprobs(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """The engine's logprobs of each sequence's tokens but the first (temperature 1): a weights check."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)
        return [
            torch.tensor([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:])])
            for out, ids in zip(outputs, token_ids)
        ]


# ----------------------------------------------------------------------------------------------------------------
# grpo.py's correction for vLLM's sampler (--vllm_importance_sampling_correction, TRL's)
# ----------------------------------------------------------------------------------------------------------------
def importance_weights(
    old_logprobs, sampling_logprobs, mask, mode="sequence_mask", clip_min=None, clip_max=3.0
) -> torch.Tensor:
    """Weights correcting for vLLM's sampler. old_logprobs (training forward), sampling_logprobs (vLLM's;
    NaN counts as agreement), mask [B, R]; d_t = (old_t - sampling_t) m_t:

    token_*     w_t = exp(d_t)              [B, R]
    sequence_*  w = exp(sum_t d_t)          [B, 1]
    *_truncate  w <- clamp(w, clip_min, clip_max)
    *_mask      w <- w if clip_min <= w <= clip_max, else 0

    A bound of None is no bound."""
    diff = ((old_logprobs - sampling_logprobs) * mask).nan_to_num(0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weights = diff.exp()
    if mode.endswith("_truncate"):
        return weights.clamp(min=clip_min, max=clip_max)
    if not mode.endswith("_mask"):
        raise UsageError(f"unknown vllm_importance_sampling_mode {mode!r}.")
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def correction(args, old_logprobs, sampling_logprobs, mask, accelerator) -> tuple[torch.Tensor, dict]:
    """(weights, sampling/* metrics) of a generation: importance_weights by --vllm_importance_sampling_mode and
    its clip flags, and importance_sampling_metrics of them."""
    clip_min, clip_max = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    mode = args.vllm_importance_sampling_mode
    weights = importance_weights(old_logprobs, sampling_logprobs, mask, mode, clip_min, clip_max)
    return weights, importance_sampling_metrics(old_logprobs, sampling_logprobs, weights, mask, accelerator)


def importance_sampling_metrics(old_logprobs, sampling_logprobs, weights, mask, accelerator) -> dict:
    """TRL's sampling/* metrics: |training - vLLM| logprob (mean, max), weights (min, mean, max)."""
    mask = mask.bool()
    delta = (old_logprobs - sampling_logprobs).abs()[mask]
    delta = delta[~delta.isnan()]
    flat = weights.flatten() if weights.size(-1) == 1 else weights[mask]
    zero = torch.zeros((), device=mask.device)
    stat = lambda x, fn: fn(x) if x.numel() else zero  # noqa: E731
    return {
        "sampling/sampling_logp_difference/mean": accelerator.gather(stat(delta, torch.mean)).mean().item(),
        "sampling/sampling_logp_difference/max": accelerator.gather(stat(delta, torch.max)).max().item(),
        "sampling/importance_sampling_ratio/min": accelerator.gather(stat(flat, torch.min)).min().item(),
        "sampling/importance_sampling_ratio/mean": accelerator.gather(stat(flat, torch.mean)).mean().item(),
        "sampling/importance_sampling_ratio/max": accelerator.gather(stat(flat, torch.max)).max().item(),
    }
