"""ppo.py's own training loop against TRL 1.12's PPOTrainer.train(), step by step, from a committed record.

TRL dropped PPO after 1.12, so TRL's side is not run here: benchmark/speed/trl_ppo_record.py ran it once in
TRL 1.12's environment on the same tiny world, prompts and fixed completions, and wrote
benchmark/results/trl_ppo_1_12.json (how it was made, how to remake it, a digest of the policy's and the
critic's weights after every optimizer step, the metrics of every update). Here ppo.py's main() runs the same
cases through tests/fixed_run.py, and the digests of its weights after each step and the metrics both log
under one name must agree. What is compared is all that the loop does with the rows: the KL penalty, the
score's position, whitening, GAE, both clipped losses, the EOS penalty, the learning-rate schedule and AdamW.
Where the two differ on purpose (the score after a stop token, see trl_ppo_record.CASES), the case leaves that
part out."""

import json

import pytest
import trl_ppo_record as rec  # benchmark/speed/, on the path through conftest

from conftest import read_metrics, run_script
from fixed_completions import recorded_steps

RECORD = json.loads(rec.RECORD.read_text())
REMAKE = f"remake the record with `{rec.COMMAND}` (see {rec.RECORD.relative_to(rec.ROOT)})"
# Digest numbers of a parameter's update may differ by this share of its norm: AdamW turns rounding noise in a
# gradient near 0 into a whole step of a few elements (about 1e-4 of the norm here); a bug moves most of them.
REL, ATOL = 2e-3, 1e-7
# Metrics both log under one name and with one meaning in a case (TRL's approxkl, entropy and ratio are means over
# every position, ppo.py's over the response; the same without a stop token).
SCORES = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
          "objective/scores", "val/num_eos_tokens", "learning_rate", "episode"]  # fmt: skip
TRL_NAMES = {"learning_rate": "lr"}  # TRL 1.12's PPOTrainer logs the learning rate as `lr`
COMPARED = {
    "no_stop": SCORES + ["policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
                         "loss/value_avg", "val/clipfrac_avg", "val/ratio"],
    "stop_at_eos": SCORES + ["policy/clipfrac_avg", "loss/policy_avg"],
}  # fmt: skip
COMPARED_PARAMS = {"no_stop": ("policy.", "value_model."), "stop_at_eos": ("policy.",)}


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """(world, prompts file, starting weights): the recorded world, checked weight by weight."""
    out = tmp_path_factory.mktemp("ppo_lab")
    if json.loads((world / "world.json").read_text()) != RECORD["world"]:
        # the tests' world changed since the record was made: build the recorded one
        world = rec.make_world(out / "world")
    start = rec.start_weights(world)
    built, recorded = rec.start_digest(start), RECORD["start"]
    assert built.keys() == recorded.keys(), f"the tiny world's parameters changed: {REMAKE}"
    for name, numbers in built.items():
        assert numbers == pytest.approx(recorded[name], rel=1e-9), (
            f"the tiny world's {name} changed: {REMAKE}"
        )
    return world, rec.make_prompts(world, out), start


def ours(lab, out, case: dict) -> tuple[list[dict], list[dict]]:
    """ppo.py's main() with fixed completions and a recorded case's flags -> (digest after each optimizer step,
    logged metrics)."""
    world, prompts, start = lab
    argv = ["tests/fixed_run.py", "ppo.py", "--sft_model_path", str(world / "policy"),
            "--reward_model_path", str(world / "reward"), "--dataset_name", str(prompts),
            "--total_episodes", str(case["updates"] * RECORD["num_prompts"]), "--num_sample_generations", "0",
            "--output_dir", str(out / "model"), "--logging_dir", str(out / "runs"), "--run_name", "ours"]  # fmt: skip
    for key, value in case["flags"].items():
        argv += (
            [f"--{key}"] if value is True else [f"--no_{key}"] if value is False else [f"--{key}", str(value)]
        )
    (out / "counter").mkdir(parents=True)
    run_script(argv, env={"FIXED_COMPLETIONS": str(out / "counter"), "STEPS_OUT": str(out / "steps")})
    steps = [{name.replace("critic.", "value_model.", 1): p for name, p in step.items()}
             for step in recorded_steps(out / "steps")]  # fmt: skip
    return [rec.digest(step, start) for step in steps], read_metrics(out / "runs" / "ours")


def assert_same_digests(mine: list[dict], trl: list[dict], prefixes: tuple[str, ...]):
    assert len(mine) == len(trl) >= 2, (len(mine), len(trl))
    for step, (ours_step, trl_step) in enumerate(zip(mine, trl), 1):
        assert ours_step.keys() == trl_step.keys(), sorted(ours_step.keys() ^ trl_step.keys())[:5]
        names = [name for name in trl_step if name.startswith(prefixes)]
        for name in names:
            tolerance = REL * trl_step[name][0] + ATOL
            gaps = [abs(a - b) for a, b in zip(ours_step[name], trl_step[name])]
            assert max(gaps) <= tolerance, (
                f"step {step}: {name}: digest {ours_step[name]} against TRL 1.12's {trl_step[name]} "
                f"(|update| {trl_step[name][0]:.3g})"
            )


def assert_same_metrics(mine: list[dict], trl: list[dict], names: list[str]):
    assert len(mine) == len(trl), (len(mine), len(trl))
    for update, (ours_update, trl_update) in enumerate(zip(mine, trl), 1):
        for name in names:
            trl_name = TRL_NAMES.get(name, name)
            assert ours_update[name] == pytest.approx(trl_update[trl_name], rel=1e-4, abs=1e-6), (
                update, name, ours_update[name], trl_update[trl_name]
            )  # fmt: skip


def test_record_exercises_what_the_test_claims():
    """The record was made by TRL 1.12 with every flag a case names, and its runs clip (policy and values), penalise
    a KL, mix completions with and without EOS, and keep TRL's bf16, gradient checkpointing and max_grad_norm
    (with gradient norms above it), none of which PPOTrainer applies: ppo.py in float32 without clipping takes
    the same steps."""
    assert RECORD["made_by"]["versions"]["trl"] == "1.12.0"
    for name, case in rec.CASES.items():
        recorded = RECORD["cases"][name]
        assert recorded["flags"] == {**rec.SHARED, **case["flags"]}, f"{name}: the record is stale: {REMAKE}"
        trainer = recorded["trainer"]  # TRL's defaults, which PPOTrainer never applies
        assert trainer["bf16"] and trainer["mixed_precision"] == "no"
        assert trainer["gradient_checkpointing"] and not trainer["policy_is_gradient_checkpointing"]
        assert max(recorded["grad_norms_before_step"]) > trainer["max_grad_norm"] == 1.0
        metrics = recorded["metrics"]
        assert len(metrics) == case["updates"] and len(recorded["steps"]) == 2 * case["updates"]
        assert all(0 < m["val/num_eos_tokens"] < rec.NUM_PROMPTS for m in metrics)
        assert all(m["policy/clipfrac_avg"] > 0 and m["val/clipfrac_avg"] > 0 for m in metrics)
    assert RECORD["cases"]["no_stop"]["metrics"][-1]["objective/kl"] > 0.01


@pytest.mark.parametrize("case", list(rec.CASES))
def test_each_step_equals_trl_1_12s(lab, tmp_path, case):
    """The same policy (and, without a stop token, critic) after every optimizer step, and the same metrics."""
    recorded = RECORD["cases"][case]
    mine, metrics = ours(lab, tmp_path, recorded)
    assert_same_metrics(metrics, recorded["metrics"], COMPARED[case])
    assert_same_digests(mine, recorded["steps"], COMPARED_PARAMS[case])
    if case == "stop_at_eos":  # rows were cut before the last position
        assert metrics[0]["val/response_length"] < recorded["flags"]["response_length"]
