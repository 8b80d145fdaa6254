"""Long runs survive (sft.py, reward.py, dpo.py): a run killed with SIGKILL at an arbitrary point and resumed from
its latest checkpoint ends with weights bit-identical to an uninterrupted run; metrics.jsonl holds every step
exactly once; SIGTERM saves and names the checkpoint (a diverging loss: tests/test_never_silently_wrong.py).
(ppo.py and rloo.py have their own in tests/test_resume_rl.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import OFFLINE_ENV, ROOT, run_script


def sft_flags(world, out, run_name, steps=6, **extra):
    flags = {
        "model_name_or_path": world / "policy", "dataset_name": world / "dataset", "dataset_train_split": "sft",
        "eval_strategy": "no", "max_length": 96, "per_device_train_batch_size": 8, "learning_rate": 1e-3,
        "total_steps": steps, "save_steps": 2, "logging_steps": 1, "output_dir": out,
        "logging_dir": out.parent / "runs", "run_name": run_name, "seed": 3,
    }  # fmt: skip
    flags.update(extra)
    return [f"--{k}={v}" for k, v in flags.items()]


def reward_flags(world, out, run_name, steps=6, **extra):
    flags = {
        "model_name_or_path": world / "reward", "dataset_name": world / "dataset",
        "dataset_train_split": "preference", "eval_strategy": "no", "max_length": 96,
        "per_device_train_batch_size": 8, "learning_rate": 1e-3, "total_steps": steps, "save_steps": 2,
        "logging_steps": 1, "output_dir": out, "logging_dir": out.parent / "runs", "run_name": run_name, "seed": 3,
    }  # fmt: skip
    flags.update(extra)
    return [f"--{k}={v}" for k, v in flags.items()]


def dpo_flags(world, out, run_name, steps=6, **extra):
    flags = {
        "model_name_or_path": world / "policy", "dataset_name": world / "dataset",
        "dataset_train_split": "preference", "eval_strategy": "no", "max_length": 96,
        "per_device_train_batch_size": 4, "learning_rate": 1e-3, "max_steps": steps, "save_steps": 2,
        "logging_steps": 1, "output_dir": out, "logging_dir": out.parent / "runs", "run_name": run_name, "seed": 3,
    }  # fmt: skip
    flags.update(extra)
    return [f"--{k}={v}" for k, v in flags.items()]


SCRIPTS = {"sft.py": sft_flags, "reward.py": reward_flags, "dpo.py": dpo_flags}


def start(args):
    env = {**os.environ, **OFFLINE_ENV}
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_for(path, proc, timeout=240):
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {path} appeared:\n{proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"{path} did not appear in {timeout} s")
        time.sleep(0.02)


def weights(directory):
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def logged_steps(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r["step"] for r in records if "learning_rate" in r]  # the training lines


@pytest.mark.parametrize(
    "script",
    [
        "sft.py",
        pytest.param("reward.py", marks=pytest.mark.slow),
        pytest.param("dpo.py", marks=pytest.mark.slow),
    ],
)  # the mechanism is shared (utils.checkpoint, utils.examples.shuffled_micro_batch): one script in CI, all with -m slow
def test_sigkill_then_resume_gives_the_same_weights(script, world, tmp_path):
    flags = SCRIPTS[script]
    run_script([script, *flags(world, tmp_path / "straight", "straight")])
    proc = start([script, *flags(world, tmp_path / "killed", "killed")])
    wait_for(tmp_path / "killed" / "checkpoint-2" / "trainer_state.json", proc)
    proc.send_signal(signal.SIGKILL)  # wherever it is: in step 3, or writing checkpoint-4
    proc.wait()
    proc.stdout.close(), proc.stderr.close()
    run_script([script, *flags(world, tmp_path / "killed", "killed"), "--resume_from_checkpoint=latest"])
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert logged_steps(tmp_path / "runs" / "killed") == logged_steps(tmp_path / "runs" / "straight")
    assert logged_steps(tmp_path / "runs" / "straight") == list(range(1, 7))
    assert not list((tmp_path / "killed").glob("tmp-checkpoint-*"))


def test_sigterm_saves_a_checkpoint_and_says_where(world, tmp_path):
    out = tmp_path / "term"
    proc = start(["sft.py", *sft_flags(world, out, "term", steps=400, save_steps=0)])
    wait_for(tmp_path / "runs" / "term" / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "trainer_state.json").exists()
    assert stderr.strip().splitlines()[-1].startswith("sft.py: interrupted: SIGTERM received; saved")
    assert str(checkpoints[0]) in stderr and "Traceback" not in stderr


# A diverging loss (NaN weights, on any CPU): tests/test_never_silently_wrong.py
