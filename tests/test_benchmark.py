"""The tiny TL;DR pipeline's plumbing (quick mode) and the evaluation's arithmetic."""

import json

import pytest

from conftest import ROOT, run_script


def test_win_rate_counts_ties_half():
    from evaluate_tldr import win_rate

    result = win_rate([1.0, 0.0, 0.5, 0.5])
    assert result["win_rate"] == 0.5 and result["tie_rate"] == 0.5 and result["n"] == 4
    assert result["ci95_low"] < 0.5 < result["ci95_high"]
    assert win_rate([1.0, 1.0])["ci95_low"] == 1.0


def test_evaluate_judges_references_against_themselves_as_ties(world, tmp_path):
    """Sanity of the judge wiring: a summary identical to the reference ties with it."""
    from evaluate_tldr import judge_with_gold

    rows = [
        {"facts": ["dog", "vet", "loan"], "completion": " dog vet", "reference": " dog vet", "ends_with_eos": True},
        {"facts": ["dog", "vet", "loan"], "completion": " dog vet loan", "reference": " dog vet", "ends_with_eos": True},
    ]  # fmt: skip
    result = judge_with_gold(rows)
    assert [r["judgement"] for r in rows] == [0.5, 1.0] and result["win_rate"] == 0.75


@pytest.mark.skipif(
    not all((ROOT / s).exists() for s in ("sft.py", "reward.py", "ppo.py", "rloo.py", "dpo.py")),
    reason="the pipeline needs every language-model script",
)
def test_quick_pipeline_produces_every_model_and_win_rate(tmp_path):
    run_script(
        ["benchmark/tiny_tldr.py", "--quick", "--work_dir", str(tmp_path / "work"),
         "--results_dir", str(tmp_path / "results")],
        timeout=600,
    )  # fmt: skip
    result = json.loads((tmp_path / "results" / "tiny_tldr_quick.json").read_text())
    seed = result["per_seed"][0]
    for method in ("sft", "reward", "ppo", "rloo", "dpo"):
        assert (tmp_path / "work" / "seed0" / method / "config.json").exists()
    for method in ("sft", "ppo", "rloo", "dpo"):
        assert 0.0 <= seed["win_rates"][method]["win_rate"] <= 1.0 and seed["win_rates"][method]["n"] > 0
    assert seed["reward_model_accuracy"] is not None


def test_resume_reuses_a_stage_only_when_its_command_is_unchanged(tmp_path):
    from tiny_tldr import run_stage

    command = ["-c", "print('ran')"]
    first = run_stage("s", command, str(tmp_path), threads=1, reuse=True)  # no stamp yet: runs
    assert "reused" not in first and (tmp_path / "s.log").read_text().strip() == "ran"
    assert run_stage("s", command, str(tmp_path), threads=1, reuse=True)["reused"] is True
    assert "reused" not in run_stage("s", command, str(tmp_path), threads=1, reuse=False)
    assert "reused" not in run_stage("s", ["-c", "print(2)"], str(tmp_path), threads=1, reuse=True)


def test_summary_traits_hand_cases():
    from tiny_tldr_breakdown import summary_traits

    facts = ["dog", "vet", "loan"]
    assert summary_traits(facts, " dog vet tbh") == {"hedge": True, "all_facts": False, "bad_key": False}
    assert summary_traits(facts, " dog vet loan") == {"hedge": False, "all_facts": True, "bad_key": False}
    assert summary_traits(facts, " dog dog") == {"hedge": False, "all_facts": False, "bad_key": True}
    assert summary_traits(facts, " dog cat") == {"hedge": False, "all_facts": False, "bad_key": True}
