"""evaluate_tldr.py for a model written by ilql.py: summaries decoded with the ILQL heads, then judged.

    python benchmark/tiny/evaluate_ilql.py --model_path models/ilql --dataset_name tiny_world/dataset \
        --split test --response_length 8 --beta 4 --output_jsonl results/ilql_test.jsonl

Decoding is ilql.complete: log pi + beta * (min target Q - V), top-k, greedy by default (the same as every
other model of the benchmark). Writes the same rows and `_result.json` as evaluate_tldr.py (gold judge when the
rows carry `facts`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch

BENCHMARK = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(BENCHMARK))
sys.path.insert(0, os.path.join(BENCHMARK, "tldr"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from evaluate_tldr import judge_with_gold  # noqa: E402

import ilql  # noqa: E402
import utils.chat  # noqa: E402
import utils.data  # noqa: E402
import utils.loading  # noqa: E402


@dataclass
class Args:
    model_path: str
    """directory written by ilql.py (backbone + ilql_heads.safetensors)"""
    dataset_name: str = "tiny_world/dataset"
    """dataset with `prompt` and reference `completion` columns"""
    split: str = "test"
    """split of held-out posts"""
    output_jsonl: str = "eval.jsonl"
    """where to write {prompt, completion, reference[, facts, judgement]} rows"""
    response_length: int = 53
    """new tokens per summary (then cut after EOS)"""
    beta: float | None = None
    """advantage weight of decoding (None: the value saved with the heads)"""
    top_k: int | None = None
    """top-k of the shifted scores (None: the saved value)"""
    temperature: float = 0.0
    """0 decodes greedily"""
    batch_size: int = 64
    """rows decoded at once"""
    max_samples: int | None = None
    """judge only the first N rows"""
    seed: int = 0
    """seed of the sampling when temperature > 0"""


def main(args: Args) -> dict:
    from transformers import AutoTokenizer

    dataset = utils.data.load_split(args.dataset_name, args.split)
    utils.data.check_columns(
        dataset, ["prompt", "completion"], f"split {args.split!r} of {args.dataset_name}"
    )
    if args.max_samples:
        dataset = dataset.select(range(min(args.max_samples, len(dataset))))
    tokenizer = utils.loading.from_pretrained(AutoTokenizer, args.model_path, "--model_path")
    model = ilql.ILQLModel.from_pretrained(args.model_path)
    generator = torch.Generator().manual_seed(args.seed)
    prompt_ids = utils.chat.tokenize_prompts(tokenizer, dataset["prompt"])
    responses, lengths = ilql.complete(model, tokenizer, prompt_ids, args.response_length, args.batch_size,
                                       args.beta, args.top_k, args.temperature, generator)  # fmt: skip
    rows = []
    for i, (response, length) in enumerate(zip(responses, lengths)):
        row = {
            "prompt": dataset[i]["prompt"],
            "completion": tokenizer.decode(response[:length], skip_special_tokens=True),
            "reference": dataset[i]["completion"].removesuffix(tokenizer.eos_token or ""),
            "ends_with_eos": bool(response[length - 1] == tokenizer.eos_token_id),
        }
        if "facts" in dataset.column_names:
            row["facts"] = dataset[i]["facts"]
        rows.append(row)
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
