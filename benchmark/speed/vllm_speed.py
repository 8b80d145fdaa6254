"""Sampling speed: vLLM (utils/vllm.py) against transformers (utils.generation.generate) on the same random Llama.

Builds a Llama of about 30M parameters (hidden 512, 8 layers, 8 heads of 64, vocabulary 8192; vLLM's CPU
attention needs head_dim >= 32) in a temporary directory, then times what an RL script does per rollout:
sampling `--num_rows` completions of `--response_length` tokens after prompts of `--prompt_length` tokens at
temperature 0.7. vLLM's time is given alone and with the logprob recomputation by the training forward that
`Engine.generate` adds (the number a script pays); engine start and one weight sync are timed too. The median
of `--repeats` timed rounds after one warm-up round.

    OMP_NUM_THREADS=1 python benchmark/speed/vllm_speed.py --output_json benchmark/results/vllm_speed.json

Needs `pip install -r requirements-vllm.txt`. The numbers are this machine's: CPU timings move with the CPU
model, its load and the thread count; on GPUs vLLM's batching and paged attention are expected to win by much
more.
"""

import json
import os
import statistics
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import utils.generation  # noqa: E402
import utils.logprobs  # noqa: E402
import utils.vllm  # noqa: E402


@dataclass
class Args:
    output_json: str | None = None
    """where the timings are written (None: printed only)"""
    num_rows: int = 32
    """completions per rollout"""
    prompt_length: int = 64
    """tokens per prompt"""
    response_length: int = 64
    """tokens sampled per completion"""
    hidden_size: int = 512
    """hidden size of the model (head_dim = hidden_size / num_heads)"""
    num_layers: int = 8
    """transformer layers"""
    num_heads: int = 8
    """attention heads"""
    vocab_size: int = 8192
    """vocabulary size"""
    threads: int = 1
    """torch threads for both samplers (more than the free cores makes OpenMP spin: on a busy 2-core machine
    2 threads ran 10x slower than 1)"""
    repeats: int = 3
    """timed rounds after the warm-up round"""
    seed: int = 0
    """seed of the weights, the prompts and the sampling"""


def build_model(args: Args, path: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=int(args.hidden_size * 8 / 3),
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_heads,
        max_position_embeddings=2 * (args.prompt_length + args.response_length), tie_word_embeddings=True,
        eos_token_id=0, pad_token_id=1, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(args: Args) -> dict:
    from accelerate import Accelerator

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(2, args.vocab_size, (args.num_rows, args.prompt_length), generator=generator)
    query_mask = torch.ones_like(prompts, dtype=torch.bool)
    R, T, B = args.response_length, 0.7, args.num_rows
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args, tmp)
        num_params = sum(p.numel() for p in model.parameters())
        accelerator = Accelerator(cpu=True)
        engine_args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                                            vllm_tensor_parallel_size=1, seed=args.seed)  # fmt: skip
        start = time.perf_counter()
        engine = utils.vllm.Engine(engine_args, accelerator, tmp, args.prompt_length + R)
        engine_start = time.perf_counter() - start
    torch.set_num_threads(args.threads)

    def with_transformers():
        utils.generation.generate(model, prompts, query_mask, R, T, B, generator)

    def with_vllm_and_recompute():
        engine.generate(model, prompts, query_mask, R, T, B, generator)

    def with_vllm_alone():
        from vllm import SamplingParams

        params = SamplingParams(temperature=T, max_tokens=R, ignore_eos=True, logprobs=0, detokenize=False)
        engine.llm.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params, use_tqdm=False)

    def recompute_only():
        query_responses = torch.cat([prompts, prompts[:, :R]], 1)
        mask = torch.ones_like(query_responses, dtype=torch.bool)
        utils.logprobs.batched_response_logprobs(model, query_responses, mask, args.prompt_length, T, B)

    results = {
        "args": asdict(args),
        "num_params": num_params,
        "threads": torch.get_num_threads(),
        "engine_start_s": engine_start,
        "weight_sync_s": median_seconds(lambda: engine.sync_weights(model, accelerator), args.repeats),
    }
    with torch.no_grad():
        for name, fn in [
            ("transformers_s", with_transformers),
            ("vllm_sampling_s", with_vllm_alone),
            ("vllm_with_logprob_recompute_s", with_vllm_and_recompute),
            ("logprob_recompute_s", recompute_only),
        ]:
            results[name] = median_seconds(fn, args.repeats)
    tokens = B * R
    results["transformers_tokens_per_s"] = tokens / results["transformers_s"]
    results["vllm_tokens_per_s"] = tokens / results["vllm_sampling_s"]
    results["speedup_sampling"] = results["transformers_s"] / results["vllm_sampling_s"]
    results["speedup_with_recompute"] = results["transformers_s"] / results["vllm_with_logprob_recompute_s"]
    print(json.dumps(results, indent=2))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
