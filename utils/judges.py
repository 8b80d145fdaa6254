"""Optional: online_dpo.py's pairwise judges (--judge), imported only with that flag.

    judge = load_judge(args, seed)                       # `path.py:function`, or `openai`
    verdicts = judge(prompts, [(first, second), ...])    # [P] long: 0 first better, 1 second, -1 tie

A function is loaded as reward functions are (utils/reward_funcs.py); `openai` asks an OpenAI-compatible
endpoint through benchmark/tldr/judge_tldr.py's client."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import random
import sys
from collections.abc import Callable

import torch

from utils.run import UsageError, optional_module


def call_judge(judge: Callable, prompts: list[str], pairs: list[tuple[str, str]]) -> torch.Tensor:
    """Ask a pairwise judge and check its answer: one verdict in {0, 1, -1} per pair. Returns [P] long."""
    verdicts = [int(v) for v in judge(prompts, pairs)]
    if len(verdicts) != len(pairs):
        raise UsageError(f"the judge returned {len(verdicts)} verdicts for {len(pairs)} pairs.")
    if any(v not in (0, 1, -1) for v in verdicts):
        raise UsageError(
            "the judge must answer 0 (first better), 1 (second better) or -1 (tie) for each pair."
        )
    return torch.tensor(verdicts, dtype=torch.long)


def load_judge(args, seed: int) -> Callable[[list[str], list[tuple[str, str]]], torch.Tensor]:
    """The --judge, its answers checked (call_judge); `seed` orders the pairs an `openai` judge is shown."""
    if args.judge == "openai":
        judge = openai_judge(args, seed)
    else:
        judge = optional_module("utils.reward_funcs", "--judge").load_function(args.judge, "--judge")
    return functools.partial(call_judge, judge)


def openai_judge(args, seed: int) -> Callable:
    """A pairwise judge on an OpenAI-compatible endpoint, through benchmark/tldr/judge_tldr.py's client (its
    prompt, retries and strict `Preferred: A|B` parsing). Each pair is shown in a seeded random order, so the
    judge's position bias does not become the policy's; an unparseable answer or a failed request is a tie."""
    client_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmark/tldr")
    if not os.path.isfile(os.path.join(client_dir, "judge_tldr.py")):
        raise UsageError(f"--judge openai needs benchmark/tldr/judge_tldr.py beside utils/ ({client_dir}).")
    if client_dir not in sys.path:
        sys.path.insert(0, client_dir)
    import judge_tldr

    client = judge_tldr.Args(
        input_jsonl="",
        base_url=args.judge_base_url,
        model=args.judge_model,
        api_key_env=args.judge_api_key_env,
    )
    api_key = os.environ.get(args.judge_api_key_env) or None
    order = random.Random(seed)

    def ask(prompt: str, first: str, second: str, swap: bool) -> int:
        shown = (second, first) if swap else (first, second)
        request = judge_tldr.judge_prompt(prompt, *shown)
        retries = (client.max_retries, client.initial_backoff, client.max_backoff)
        try:
            answer, _ = judge_tldr.call_with_retries(
                lambda: judge_tldr.chat_completion(client, api_key, request), *retries
            )
        except judge_tldr.RetryableError:
            return -1
        verdict = judge_tldr.parse_verdict(answer)
        if verdict is None:
            return -1
        return int((verdict == "B") != swap)

    def judge(prompts: list[str], pairs: list[tuple[str, str]]) -> list[int]:
        swaps = [order.random() < 0.5 for _ in pairs]
        with concurrent.futures.ThreadPoolExecutor(client.num_threads) as pool:
            return list(pool.map(ask, prompts, [a for a, _ in pairs], [b for _, b in pairs], swaps))

    return judge
