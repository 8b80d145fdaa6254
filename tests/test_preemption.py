"""SIGTERM at a micro-batch boundary: a signal inside a step that has not changed the weights yet (its
micro-batches accumulating, an RL update sampling or scoring) stops the run at the next micro-batch or
generation call; the last finished step is saved as its own end-of-step checkpoint would have been, the cut
step runs again on resume, and the resumed run ends bit-identical to an uninterrupted one."""

import functools
import json

import pytest
import torch
from safetensors.torch import load_file
from test_resume import sft_flags

from conftest import run_deepspeed, run_script, run_torchrun

STEPS = 6


def steps_logged(runs, name):
    return [json.loads(line) for line in open(runs / name / "metrics.jsonl")]


def same_weights(a, b):
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def same_metrics(runs, a, b, timing):
    whole, cut = steps_logged(runs, a), steps_logged(runs, b)
    assert [m["step"] for m in cut] == list(range(1, STEPS + 1)) == [m["step"] for m in whole]
    for x, y in zip(whole, cut):
        assert {k: v for k, v in x.items() if k not in timing} == {
            k: v for k, v in y.items() if k not in timing
        }


def preempt_then_resume(run, script_args, target, call, out):
    """Run with SIGTERM after the `call`th call of `target`; return its last stderr line; then resume."""
    cut = run(["tests/sigterm_at.py", target, str(call), *script_args], check=False)
    assert cut.returncode != 0
    lines = [line for line in cut.stderr.strip().splitlines() if ": interrupted: " in line]
    assert lines, cut.stderr[-3000:]
    run([*script_args, "--resume_from_checkpoint", "latest"])
    return lines[-1]


def test_sft_sigterm_between_micro_batches_saves_the_step_before(world, tmp_path):
    """Two micro-batches a step, no periodic checkpoints: SIGTERM after step 3's first backward."""
    runs = tmp_path / "runs"
    common = ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "4", "--save_steps", "0"]
    run_script(["sft.py", *sft_flags(world, tmp_path / "whole", "whole", STEPS), *common])
    args = ["sft.py", *sft_flags(world, tmp_path / "cut", "cut", STEPS), *common]
    line = preempt_then_resume(run_script, args, "accelerate.Accelerator.backward", 5, tmp_path / "cut")
    assert line == (
        f"sft.py: interrupted: SIGTERM received; saved {tmp_path / 'cut' / 'checkpoint-2'} at step 2 (step 3 was "
        f"cut short and runs again); continue with --resume_from_checkpoint {tmp_path / 'cut' / 'checkpoint-2'}"
    )
    assert same_weights(tmp_path / "whole", tmp_path / "cut")
    same_metrics(runs, "whole", "cut", {"perf/tokens_per_second"})


def rloo_flags(world, tmp_path, name):
    return [
        "rloo.py", "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--response_length", "6",
        "--max_prompt_length", "16", "--local_rollout_forward_batch_size", "2", "--rloo_k", "2",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--num_ppo_epochs", "1",
        "--learning_rate", "1e-3", "--num_sample_generations", "0", "--total_episodes", str(8 * STEPS),
        "--save_steps", "0", "--logging_dir", str(tmp_path / "runs"), "--run_name", name,
        "--output_dir", str(tmp_path / name), "--seed", "4",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "target, call",
    [
        ("utils.generation.generate", 5),  # update 3 samples its second chunk of prompts
        pytest.param("accelerate.Accelerator.backward", 5, marks=pytest.mark.slow),  # update 3 trains
    ],
)
def test_rloo_sigterm_on_one_of_two_processes_mid_update(world, tmp_path, target, call):
    """Two processes, 4 completions each an update in 2 generation calls and 2 micro-batches: the first
    process alone gets SIGTERM inside update 3; both stop at the next boundary and save update 2."""
    run_torchrun(rloo_flags(world, tmp_path, "whole"))
    line = preempt_then_resume(
        run_torchrun, rloo_flags(world, tmp_path, "cut"), target, call, tmp_path / "cut"
    )
    assert "saved " in line and "checkpoint-2 at step 2 (step 3 was cut short and runs again)" in line
    assert same_weights(tmp_path / "whole", tmp_path / "cut")
    same_metrics(tmp_path / "runs", "whole", "cut", {"eps"})


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_sft_sigterm_between_micro_batches_under_deepspeed(world, tmp_path, stage):
    """The same cut under ZeRO-2/3 on two processes: DeepSpeed's checkpoint of step 2 is written while step 3's
    gradients are half accumulated, and the resumed run still ends with the uninterrupted run's weights."""
    run = functools.partial(run_deepspeed, tmp_path=tmp_path, zero_stage=stage)
    common = ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2", "--save_steps", "0"]
    run(["sft.py", *sft_flags(world, tmp_path / "whole", "whole", STEPS), *common])
    args = ["sft.py", *sft_flags(world, tmp_path / "cut", "cut", STEPS), *common]
    line = preempt_then_resume(run, args, "accelerate.Accelerator.backward", 5, tmp_path / "cut")
    assert "checkpoint-2 at step 2 (step 3 was cut short and runs again)" in line
    assert same_weights(tmp_path / "whole", tmp_path / "cut")
    same_metrics(tmp_path / "runs", "whole", "cut", {"perf/tokens_per_second"})


@pytest.mark.slow
@pytest.mark.parametrize("script", ["dpo.py", "reward.py", "ppo.py"])
def test_the_other_scripts_cut_a_step_as_well(world, tmp_path, script):
    """dpo and reward between micro-batches (2 a step), ppo while sampling update 3 (two generation calls an
    update): the step before is named, and the resumed run ends with the uninterrupted run's weights."""
    import test_resume
    import test_resume_rl

    if script == "ppo.py":
        make = functools.partial(test_resume_rl.flags, script, world, tmp_path)
        whole, cut = [script, *make("whole")], [script, *make("cut")]
        target, call = "utils.generation.generate", 5  # two calls an update
    else:
        make = test_resume.SCRIPTS[script]
        extra = ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2"]
        whole = [script, *make(world, tmp_path / "whole", "whole", STEPS), *extra]
        cut = [script, *make(world, tmp_path / "cut", "cut", STEPS), *extra]
        target, call = "accelerate.Accelerator.backward", 5
    run_script(whole)
    line = preempt_then_resume(run_script, cut, target, call, tmp_path / "cut")
    assert "checkpoint-2 at step 2 (step 3 was cut short and runs again)" in line
    assert same_weights(tmp_path / "whole", tmp_path / "cut")
