"""What the tiny TL;DR policies changed: style (the filler word) versus content (facts named, keys invented).

    python benchmark/tiny/tiny_tldr_breakdown.py  # after benchmark/tiny/tiny_tldr.py, reads its evaluation files

For every method, over the test summaries of every seed in `--work_dir`: the share ending with the hedge word,
naming all the post's facts, and inventing or repeating a key word; for every method but SFT, the mean
difference of gold scores against SFT's summary of the same post, and its standard error. Writes
`--output_json`.
"""

import glob
import json
import os
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_tldr import METHODS  # noqa: E402

from tiny_world import HEDGE, KEY_WORDS, gold_score  # noqa: E402


@dataclass
class Args:
    work_dir: str = "benchmark/work"
    """the --work_dir of benchmark/tiny/tiny_tldr.py"""
    output_json: str = "benchmark/results/tiny_tldr_breakdown.json"
    """where to write the shares"""


def summary_traits(facts: list[str], summary: str) -> dict[str, bool]:
    """Whether a summary uses the hedge word, names every fact, and invents or repeats a key word."""
    words, seen, bad_key = summary.split(), set(), False
    for word in words:
        bad_key |= word in KEY_WORDS and (word not in facts or word in seen)
        seen.add(word)
    return {"hedge": HEDGE in words, "all_facts": all(f in words for f in facts), "bad_key": bad_key}


def main(args: Args) -> dict:
    result, sft_rows = {}, None
    for method in METHODS:
        rows = [json.loads(line) for path in sorted(glob.glob(f"{args.work_dir}/seed*/eval/{method}.jsonl"))
                for line in open(path)]  # fmt: skip
        if not rows:  # a method this run did not train
            continue
        traits = [summary_traits(r["facts"], r["completion"]) for r in rows]
        result[method] = {"n": len(rows), **{k: sum(t[k] for t in traits) / len(rows) for k in traits[0]}}
        if method == "sft":
            sft_rows = rows
        elif sft_rows is not None and len(rows) == len(sft_rows):  # the same posts, in the same order
            assert all(a["prompt"] == b["prompt"] for a, b in zip(rows, sft_rows))
            diffs = [gold_score(b["facts"], b["completion"]) - gold_score(a["facts"], a["completion"])
                     for a, b in zip(sft_rows, rows)]  # fmt: skip
            result[method]["gold_minus_sft"] = statistics.mean(diffs)
            result[method]["gold_minus_sft_se"] = statistics.stdev(diffs) / len(diffs) ** 0.5
    if "sft" not in result:
        raise SystemExit(f"tiny_tldr_breakdown.py: error: no evaluations under {args.work_dir}/seed*/eval/")
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    import tyro

    print(json.dumps(main(tyro.cli(Args, use_underscores=True)), indent=2))
