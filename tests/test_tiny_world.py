"""The offline tiny world: determinism, formats, the gold judge, and the room it leaves for RL."""

import filecmp
import random

import pytest

import tiny_world
from tiny_world import HEDGE, gold_judge, gold_score

FACTS = ["dog", "vet", "loan"]


def test_gold_score_hand_cases():
    assert gold_score(FACTS, " dog vet loan") == 3.0
    assert gold_score(FACTS, " dog vet") == 2.0
    assert gold_score(FACTS, f" dog vet {HEDGE}") == pytest.approx(1.9)
    assert gold_score(FACTS, " dog dog") == 0.0  # repeated fact: +1 - 1
    assert gold_score(FACTS, " dog cat") == 0.0  # invented key word
    assert gold_score(FACTS, "") == 0.0


def test_gold_judge_prefers_the_better_summary_and_is_antisymmetric():
    better_worse = [
        (" dog vet loan", " dog vet"),  # coverage
        (" dog vet", f" dog vet {HEDGE}"),  # brevity
        (" dog vet", " dog vet cat"),  # no invented points
        (" dog", " dog dog"),  # no repetition
        (f" dog vet loan {HEDGE}", " dog vet"),  # a missing point costs more than a filler word
    ]
    for better, worse in better_worse:
        assert gold_judge(FACTS, better, worse) == 1.0
        assert gold_judge(FACTS, worse, better) == 0.0
    rng = random.Random(0)
    for _ in range(200):
        a, b = tiny_world.perturbed_summary(rng, FACTS), tiny_world.perturbed_summary(rng, FACTS)
        assert gold_judge(FACTS, a, b) + gold_judge(FACTS, b, a) == 1.0
    assert gold_judge(FACTS, " dog vet", " vet dog") == 0.5


def test_world_files_and_formats(world):
    import datasets
    from transformers import AutoTokenizer

    dd = datasets.load_from_disk(str(world / "dataset"))
    assert set(dd) == {"sft", "preference", "preference_validation", "validation", "test"}
    assert {"prompt", "completion", "facts"} <= set(dd["sft"].column_names)
    assert {"prompt", "chosen", "rejected"} <= set(dd["preference"].column_names)
    row = dd["sft"][0]
    assert row["prompt"].startswith("SUBREDDIT: r/") and row["prompt"].endswith("\n\nTL;DR:")
    assert "\n\nTITLE: " in row["prompt"] and "\n\nPOST: " in row["prompt"]
    assert all(f in row["prompt"] for f in row["facts"])
    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    assert (
        tok.pad_token_id is not None and tok.eos_token_id is not None and tok.pad_token_id != tok.eos_token_id
    )
    # every word of the task is one token, so summaries are short sequences
    assert len(tok(" " + " ".join(tiny_world.KEY_WORDS))["input_ids"]) == len(tiny_world.KEY_WORDS)
    held_out = set(dd["test"]["prompt"]) | set(dd["validation"]["prompt"])
    assert not held_out & set(dd["sft"]["prompt"]) and not held_out & set(dd["preference"]["prompt"])


def test_tool_task_is_answerable_only_through_the_tool(world):
    """The tool task's prompts never name the code and its test names are not in train."""
    import datasets

    dd = datasets.load_from_disk(str(world / "dataset_tools"))
    assert not set(dd["test"]["name"]) & set(dd["train"]["name"])
    for split in ("train", "test"):
        for row in dd[split]:
            assert row["answer"] == tiny_world.tool_code(row["name"]), row
            assert not set(row["prompt"][0]["content"].split()) & set(tiny_world.KEY_WORDS), row


def test_world_is_deterministic(tmp_path):
    small = dict(num_sft=50, num_preference=50, num_preference_validation=20, num_validation=10, num_test=10)
    for name in ("a", "b"):
        tiny_world.build(tiny_world.Args(output_dir=str(tmp_path / name), **small))
    for sub in ("tokenizer", "policy", "reward"):
        cmp = filecmp.dircmp(tmp_path / "a" / sub, tmp_path / "b" / sub)
        assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
    for split in ("sft", "preference", "test"):
        assert filecmp.cmp(
            tmp_path / "a/dataset" / f"{split}.jsonl", tmp_path / "b/dataset" / f"{split}.jsonl", False
        )
    assert filecmp.cmp(tmp_path / "a/world.json", tmp_path / "b/world.json", shallow=False)
    tiny_world.build(tiny_world.Args(output_dir=str(tmp_path / "c"), seed=1, **small))
    assert not filecmp.cmp(tmp_path / "a/dataset/sft.jsonl", tmp_path / "c/dataset/sft.jsonl", shallow=False)


def win_rate(rows, summaries):
    return sum(gold_judge(r["facts"], s, r["completion"]) for r, s in zip(rows, summaries)) / len(rows)


def test_task_leaves_room_for_rl(world):
    """Imitating the references' mode loses to them; naming every fact beats them; labels are noisy."""
    import datasets

    dd = datasets.load_from_disk(str(world / "dataset"))
    test = list(dd["test"])
    mode = win_rate(test, [" " + " ".join(r["facts"][:-1] + [HEDGE]) for r in test])
    best = win_rate(test, [" " + " ".join(r["facts"]) for r in test])
    assert mode < 0.4 and best > 0.8
    prefs = list(dd["preference"])
    agree = sum(gold_judge(r["facts"], r["chosen"], r["rejected"]) for r in prefs) / len(prefs)
    assert 0.65 < agree < 0.85  # about 25% of labels flipped
    gold = list(dd["preference_validation"])
    assert all(gold_judge(r["facts"], r["chosen"], r["rejected"]) == 1.0 for r in gold)


def test_content_pairs_differ_only_in_one_checked_key_word():
    """A content pair is one summary and the same words with one fact replaced by a wrong or repeated key."""
    rng = random.Random(0)
    kinds = {"invented": 0, "repeated": 0}
    for _ in range(400):
        better, worse = tiny_world.content_pair(rng, FACTS)
        a, b = better.split(), worse.split()
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1
        assert gold_score(FACTS, better) - gold_score(FACTS, worse) == pytest.approx(2.0)
        (wrong,) = [y for x, y in zip(a, b) if x != y]
        kinds["repeated" if wrong in FACTS else "invented"] += 1
        assert wrong in tiny_world.KEY_WORDS
    assert kinds["invented"] > 2 * kinds["repeated"] > 0


def test_content_pairs_change_only_the_preference_splits_share(tmp_path):
    """--content_pairs 0 (the default) writes the world it always wrote; a share p makes about p of the pairs
    content pairs, whose gold-labelled validation copies always prefer the summary with the right key word."""
    small = dict(
        num_sft=50, num_preference=400, num_preference_validation=200, num_validation=10, num_test=10
    )
    default = tiny_world.make_splits(tiny_world.Args(**small))
    again = tiny_world.make_splits(tiny_world.Args(content_pairs=0.0, **small))
    assert default == again
    mixed = tiny_world.make_splits(tiny_world.Args(content_pairs=0.5, **small))
    assert mixed["sft"] == default["sft"]  # drawn before the preference pairs

    def is_content_pair(row):
        a, b = row["chosen"].split(), row["rejected"].split()
        return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1 and a != b

    share = sum(map(is_content_pair, mixed["preference_validation"])) / 200
    assert 0.4 < share < 0.65  # random pairs of equal length that differ in one word add a little
    assert all(
        gold_judge(r["facts"], r["chosen"], r["rejected"]) == 1.0 for r in mixed["preference_validation"]
    )
