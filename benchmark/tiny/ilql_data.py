"""The offline data of ILQL: completions sampled from a model (usually the SFT model), each scored once.

    python benchmark/tiny/ilql_data.py --model_path models/sft --reward_model_path models/reward \
        --dataset_name tiny_world/dataset --output_dir data/ilql

For every prompt of `--train_split` (and of `--test_split`), `--num_completions` completions of
`--response_length` tokens are sampled at `--temperature` and cut after EOS, as the RL scripts sample them. Each
completion gets one reward: the reward model's score (`--judge reward_model`, read at the EOS, as ppo.py and
rloo.py read it, minus `--missing_eos_penalty` when it has none) or the tiny world's gold score (`--judge gold`,
from the rows' hidden `facts`), minus `--reward_baseline`: a shift by a function of the prompt's own samples,
which leaves the order of its completions as it was and takes out what a reward model adds per post. Writes a
DatasetDict (save_to_disk) with `train` and `validation` splits of prompt, completion, reward (the columns
ilql.py reads), plus `score_rm` / `score_gold` when they can be computed and `has_eos`, and a `summary.json` of
the means.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Literal

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import utils.chat  # noqa: E402
import utils.data  # noqa: E402
import utils.generation  # noqa: E402
import utils.loading  # noqa: E402
import utils.reward_model  # noqa: E402
import utils.scoring  # noqa: E402


@dataclass
class Args:
    model_path: str
    """causal LM that writes the completions (the behaviour model ILQL starts from)"""
    dataset_name: str = "tiny_world/dataset"
    """dataset with a `prompt` column (hub id, save_to_disk dir, json/jsonl/parquet)"""
    train_split: str = "sft"
    """split whose prompts make the training data"""
    test_split: str | None = "validation"
    """split whose prompts make the validation data (None: none)"""
    output_dir: str = "data/ilql"
    """where the DatasetDict (train, validation) and summary.json are written"""
    judge: Literal["reward_model", "gold"] = "reward_model"
    """what the `reward` column holds: the reward model's score or the tiny world's gold score"""
    reward_model_path: str | None = None
    """sequence classifier (one label); needed with --judge reward_model"""
    num_completions: int = 4
    """completions sampled per prompt"""
    temperature: float = 1.0
    """sampling temperature (diverse completions give ILQL something to choose between)"""
    response_length: int = 53
    """tokens sampled per completion (then cut after EOS)"""
    missing_eos_penalty: float | None = None
    """subtracted from the reward model's score of a completion with no EOS"""
    reward_baseline: Literal["none", "prompt_mean"] = "none"
    """subtracted from each reward: nothing, or the mean reward of its prompt's completions"""
    max_prompts: int | None = None
    """use only the first N prompts of each split"""
    batch_size: int = 64
    """rows sampled and scored at once"""
    seed: int = 0
    """seed of the sampling"""


def subtract_prompt_baseline(rewards: torch.Tensor, baseline: str) -> torch.Tensor:
    """Each completion's reward relative to the other completions of its prompt.

    rewards: [k, b], k completions of each of b prompts. `prompt_mean`: r_i - (1/k) sum_j r_j, which is
    (k-1)/k times the leave-one-out r_i - 1/(k-1) sum_{j != i} r_j (an estimate of r_i minus the prompt's
    expected reward); ilql.py's reward normalization makes the two the same. The shift depends only on the
    prompt's own samples: it keeps the order of a prompt's completions and takes out what differs between
    prompts (for a reward model, its bias towards some posts' words).
    """
    if baseline == "none":
        return rewards
    return rewards - rewards.mean(0, keepdim=True)


@torch.no_grad()
def sample_split(args: Args, split: str, model, tokenizer, reward_model, generator) -> list[dict]:
    """Rows {prompt, completion, reward, ...}: num_completions per prompt, completion-major within a prompt."""
    dataset = utils.data.load_split(args.dataset_name, split)
    utils.data.check_columns(dataset, ["prompt"], f"split {split!r} of {args.dataset_name}")
    if args.max_prompts:
        dataset = dataset.select(range(min(args.max_prompts, len(dataset))))
    gold = None
    if "facts" in dataset.column_names:
        from tiny_world import gold_score as gold

    rows, eos = [], tokenizer.eos_token_id
    for start in range(0, len(dataset), args.batch_size):
        batch = dataset[start : start + args.batch_size]
        prompt_ids = utils.chat.tokenize_prompts(tokenizer, batch["prompt"])
        first = len(rows)
        for _ in range(args.num_completions):
            responses, lengths = utils.generation.complete(model, tokenizer, prompt_ids, args.response_length,
                                                args.batch_size, args.temperature, generator)  # fmt: skip
            has_eos = (responses == eos).any(1)
            rm_scores = None
            if reward_model is not None:
                queries, query_mask = utils.generation.left_pad(prompt_ids, tokenizer.pad_token_id)
                mask = torch.cat(
                    [query_mask, utils.generation.lengths_to_mask(lengths, responses.size(1))], 1
                )
                rm_scores = utils.reward_model.batched_score(reward_model, torch.cat([queries, responses], 1), mask.long(),
                                                args.batch_size)  # fmt: skip
                if args.missing_eos_penalty is not None:
                    rm_scores = rm_scores - args.missing_eos_penalty * (~has_eos).float()
            for i, (response, length) in enumerate(zip(responses, lengths)):
                completion = tokenizer.decode(response[:length], skip_special_tokens=True)
                row = {"prompt": batch["prompt"][i], "completion": completion, "has_eos": bool(has_eos[i])}
                if rm_scores is not None:
                    row["score_rm"] = float(rm_scores[i])
                if gold is not None:
                    row["score_gold"] = gold(batch["facts"][i], completion)
                row["reward"] = row["score_rm"] if args.judge == "reward_model" else row["score_gold"]
                rows.append(row)
        batch_rows = rows[first:]  # completion-major: row c * b + i is completion c of prompt i
        rewards = torch.tensor([r["reward"] for r in batch_rows], dtype=torch.float64)
        rewards = subtract_prompt_baseline(rewards.view(args.num_completions, -1), args.reward_baseline)
        for row, reward in zip(batch_rows, rewards.flatten().tolist()):
            row["reward"] = reward
    return rows


def main(args: Args) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    if args.judge == "reward_model" and not args.reward_model_path:
        raise ValueError("--judge reward_model needs --reward_model_path.")
    if args.num_completions < 1 or args.temperature <= 0:
        raise ValueError("--num_completions must be at least 1 and --temperature positive.")
    if args.reward_baseline != "none" and args.num_completions < 2:
        raise ValueError(f"--reward_baseline {args.reward_baseline} compares completions of one prompt: it needs "
                         "--num_completions 2 or more.")  # fmt: skip
    torch.manual_seed(args.seed)
    tokenizer = utils.loading.from_pretrained(AutoTokenizer, args.model_path, "--model_path")
    model = utils.loading.from_pretrained(AutoModelForCausalLM, args.model_path, "--model_path").eval()
    reward_model = None
    if args.reward_model_path:
        reward_model = utils.loading.from_pretrained(AutoModelForSequenceClassification, args.reward_model_path,
                                             "--reward_model_path", num_labels=1).eval()  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed)
    splits = {"train": args.train_split, "validation": args.test_split}
    data, summary = {}, {"judge": args.judge}
    for name, split in splits.items():
        if split is None:
            continue
        rows = sample_split(args, split, model, tokenizer, reward_model, generator)
        if args.judge == "gold" and "score_gold" not in rows[0]:
            raise ValueError(f"split {split!r} has no `facts` column: the gold judge cannot score it.")
        data[name] = datasets.Dataset.from_list(rows)
        for key in ("reward", "score_rm", "score_gold", "has_eos"):
            if key in rows[0]:
                summary[f"{name}/{key}_mean"] = sum(float(r[key]) for r in rows) / len(rows)
        summary[f"{name}/rows"] = len(rows)
    datasets.DatasetDict(data).save_to_disk(args.output_dir)
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    import tyro

    try:
        print(json.dumps(main(tyro.cli(Args, use_underscores=True)), indent=2))
    except ValueError as error:
        raise SystemExit(f"ilql_data.py: error: {error}") from None
