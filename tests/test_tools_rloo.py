"""rloo.py's multi-turn rollouts (--tools, --environment_factory; TRL 1.16's flags, utils/tools.py as grpo.py's):
the taught policy calls its tool, the tool answers stay out of the loss and the KL (a ratio of 1 and a KL of 0 at
learning rate 0 hold over the sampled tokens only), environments reward, and resumes are bit-exact."""

import functools
import shutil

import pytest
import torch
from test_tools import tool_lab, tool_run  # noqa: F401 - the fixture: a policy taught to call lookup

from conftest import ROOT, read_metrics, run_script, weights

rloo_run = functools.partial(tool_run, script="rloo.py")  # the same lab and flags as grpo.py's tool tests


def test_rloo_with_tools_logs_tool_metrics_and_resumes_exactly(tool_lab, tmp_path):  # noqa: F811
    """rloo.py --tools on the policy taught to call: the tools/ metrics (calls, failures of the name that raises,
    turns), and a resume from checkpoint-2 of 4 updates gives the same weights bit for bit."""
    rloo_run(tool_lab, tmp_path / "whole", "--save_steps", "2")
    metrics = read_metrics(tmp_path / "whole" / "runs" / "r")
    assert len(metrics) == 4
    assert all(
        {"tools/call_frequency", "tools/failure_frequency", "tools/turns_mean"} <= set(m) for m in metrics
    )
    assert max(m["tools/call_frequency"] for m in metrics) > 0.3  # the taught policy calls
    assert max(m["tools/failure_frequency"] for m in metrics) > 0  # the name boom raises
    assert max(m["tools/turns_mean"] for m in metrics) > 1
    checkpoint = str(tmp_path / "whole" / "model" / "checkpoint-2")
    rloo_run(tool_lab, tmp_path / "again", "--save_steps", "2", "--resume_from_checkpoint", checkpoint)
    whole, resumed = weights(tmp_path / "whole" / "model"), weights(tmp_path / "again" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    start = weights(tool_lab / "policy")
    assert any(not torch.equal(whole[k], start[k]) for k in whole)


def test_rloo_tool_answers_stay_out_of_the_loss_and_the_kl(tool_lab, tmp_path):  # noqa: F811
    """Learning rate 0, the sampler's logprobs as the old ones: a tool's answer has none (0 stands in), so a ratio
    of 1 and a KL of 0 to the reference (the policy itself) hold only if main() keeps its tokens out of the loss
    mask and the KL; the rollouts did hold tool answers."""
    rloo_run(tool_lab, tmp_path, "--learning_rate", "0", "--recompute_old_logprobs", "false")
    metrics = read_metrics(tmp_path / "runs" / "r")
    assert max(m["tools/call_frequency"] for m in metrics) > 0.3
    for m in metrics:
        assert m["val/ratio"] == pytest.approx(1.0, abs=1e-4), m
        assert abs(m["objective/kl"]) < 1e-3 and m["policy/approxkl_avg"] < 1e-6, m


def test_rloo_with_an_environment_factory_rewards_evaluates_and_resumes_exactly(tool_lab, tmp_path):  # noqa: F811
    """rloo.py --environment_factory Book: its get_reward is a reward of its own, book_reward reads the environments,
    the held-out split resets environments of its own, and a resume is bit-exact with nothing more saved."""
    rloo_run(tool_lab, tmp_path / "whole", "--save_steps", "2", environment=True)
    metrics = read_metrics(tmp_path / "whole" / "runs" / "r")
    training = [m for m in metrics if "objective/scores" in m]
    assert len(training) == 4 and all(
        {"rewards/Book/mean", "rewards/book_reward/mean"} <= set(m) for m in training
    )
    assert max(m["tools/call_frequency"] for m in training) > 0.3
    assert max(m["rewards/Book/mean"] for m in training) > 0  # get_reward saw the calls
    assert max(m["rewards/book_reward/mean"] for m in training) > 0.5  # the answer, read from the environment
    held_out = [m for m in metrics if "eval/objective/scores" in m]
    assert len(held_out) == 2 and all(m["eval/rewards/Book/mean"] > 0 for m in held_out)
    checkpoint = str(tmp_path / "whole" / "model" / "checkpoint-2")
    rloo_run(
        tool_lab,
        tmp_path / "again",
        "--save_steps",
        "2",
        "--resume_from_checkpoint",
        checkpoint,
        environment=True,
    )
    whole, resumed = weights(tmp_path / "whole" / "model"), weights(tmp_path / "again" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_rloo_tools_refusals_are_one_line_and_a_copy_without_utils_tools_names_it(tool_lab, tmp_path):  # noqa: F811
    """With TRL 0.19's defaults or --token_level_kl, --tools is one line before any model loads; a copy of rloo.py
    with its core and the TRL 1.16 flags' module (utils/trl_flags.py) but not utils/tools.py names that file."""
    import readability

    says = "--tools, --environment_factory and --rollout_func take TRL 1.16's flags"
    for extra in (["--trl_defaults", "0.19"], ["--token_level_kl"]):
        proc = rloo_run(tool_lab, tmp_path / "refused", *extra, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(f"rloo.py: error: {says}"), proc.stderr
    assert "utils/tools.py" not in readability.footprint(ROOT, ROOT / "rloo.py")
    copy = tmp_path / "copy"
    (copy / "utils").mkdir(parents=True)
    for module in [
        "rloo.py",
        "utils/trl_flags.py",
        *readability.footprint(ROOT, ROOT / "rloo.py"),
    ]:  # 1.16 flags
        shutil.copy(ROOT / module, copy / module)
    flags = ["rloo.py", "--model_name_or_path", str(tool_lab / "policy"), "--dataset_name",
             str(tool_lab / "prompts.jsonl"), "--tools", f"{tool_lab}/tools.py:lookup", "--reward_model_path",
             str(tool_lab / "policy"), "--output_dir", str(tmp_path / "o")]  # fmt: skip
    proc = run_script(flags, cwd=copy, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--tools needs utils/tools.py, which this copy lacks" in proc.stderr.strip().splitlines()[-1], (
        proc.stderr
    )
