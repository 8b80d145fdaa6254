"""Generate summaries of held-out posts with a model and judge them against the reference summaries.

    python benchmark/tldr/evaluate_tldr.py --model_path models/rloo --dataset_name tiny_world/dataset \
        --split test --output_jsonl results/rloo_test.jsonl

Every model is decoded with the same settings (greedy by default, `--temperature` otherwise). When the rows
carry the tiny world's hidden `facts`, the programmatic gold judge compares each summary with the reference
and the win rate (ties count half) and tie rate are printed and written; for real TL;DR, pass the jsonl to
`benchmark/tldr/judge_tldr.py`, which asks an LLM judge.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch

BENCHMARK = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(BENCHMARK))
sys.path.insert(0, os.path.join(BENCHMARK, "tiny"))

import utils.chat  # noqa: E402
import utils.data  # noqa: E402
import utils.generation  # noqa: E402
import utils.loading  # noqa: E402


@dataclass
class Args:
    model_path: str
    """causal LM directory (or hub id) to generate with"""
    dataset_name: str = "tiny_world/dataset"
    """dataset with `prompt` and reference `completion` columns (hub id, save_to_disk dir or json/jsonl/parquet)"""
    split: str = "test"
    """split of held-out posts"""
    output_jsonl: str = "eval.jsonl"
    """where to write {prompt, completion, reference[, facts, judgement]} rows"""
    response_length: int = 53
    """new tokens sampled per summary (then truncated after EOS)"""
    temperature: float = 0.0
    """sampling temperature; 0 decodes greedily"""
    batch_size: int = 64
    """rows generated at once"""
    max_samples: int | None = None
    """judge only the first N rows"""
    seed: int = 0
    """seed of the sampling when temperature > 0"""


def win_rate(judgements: list[float]) -> dict[str, float]:
    """Win rate (ties count half), tie rate and a 95% normal-approximation interval of the win rate."""
    n = len(judgements)
    rate = sum(judgements) / n
    ties = sum(1 for j in judgements if j == 0.5) / n
    var = sum((j - rate) ** 2 for j in judgements) / max(n - 1, 1)
    half_width = 1.96 * (var / n) ** 0.5
    return {
        "win_rate": rate,
        "tie_rate": ties,
        "ci95_low": rate - half_width,
        "ci95_high": rate + half_width,
        "n": n,
    }


@torch.no_grad()
def generate_summaries(args: Args) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dataset = utils.data.load_split(args.dataset_name, args.split)
    utils.data.check_columns(
        dataset, ["prompt", "completion"], f"split {args.split!r} of {args.dataset_name}"
    )
    if args.max_samples:
        dataset = dataset.select(range(min(args.max_samples, len(dataset))))
    tokenizer = utils.loading.from_pretrained(AutoTokenizer, args.model_path, "--model_path")
    model = utils.loading.from_pretrained(AutoModelForCausalLM, args.model_path, "--model_path").eval()
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    for start in range(0, len(dataset), args.batch_size):
        batch = dataset[start : start + args.batch_size]
        prompt_ids = utils.chat.tokenize_prompts(tokenizer, batch["prompt"])
        responses, lengths = utils.generation.complete(
            model, tokenizer, prompt_ids, args.response_length, args.batch_size, args.temperature, generator
        )
        for i, (response, length) in enumerate(zip(responses, lengths)):
            row = {
                "prompt": batch["prompt"][i],
                "completion": tokenizer.decode(response[:length], skip_special_tokens=True),
                "reference": batch["completion"][i].removesuffix(tokenizer.eos_token or ""),
                "ends_with_eos": bool(response[length - 1] == tokenizer.eos_token_id),
            }
            if "facts" in batch:
                row["facts"] = batch["facts"][i]
            rows.append(row)
    return rows


def judge_with_gold(rows: list[dict]) -> dict[str, float]:
    """The tiny world's gold judge: summary vs reference for every row; adds `judgement` to each row."""
    from tiny_world import gold_judge, gold_score

    for row in rows:
        row["judgement"] = gold_judge(row["facts"], row["completion"], row["reference"])
        row["gold_score"] = gold_score(row["facts"], row["completion"])
    result = win_rate([row["judgement"] for row in rows])
    result["mean_gold_score"] = sum(row["gold_score"] for row in rows) / len(rows)
    result["eos_rate"] = sum(row["ends_with_eos"] for row in rows) / len(rows)
    return result


def main(args: Args) -> dict:
    rows = generate_summaries(args)
    result = judge_with_gold(rows) if rows and "facts" in rows[0] else {}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_jsonl)), exist_ok=True)
    with open(args.output_jsonl, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    if result:
        with open(args.output_jsonl.removesuffix(".jsonl") + "_result.json", "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    import tyro

    print(json.dumps(main(tyro.cli(Args, use_underscores=True)), indent=2))
