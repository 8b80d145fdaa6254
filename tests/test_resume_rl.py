"""ppo.py and rloo.py survive long runs: kill -9 at an arbitrary point and resume from `latest` gives the weights of
an uninterrupted run bit for bit (1 process and 2 processes), metrics.jsonl holds every update once, SIGTERM
saves and names the checkpoint, and a NaN score or a non-finite loss stops the run with one line naming
the update while the last good checkpoint stays intact."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import OFFLINE_ENV, ROOT, free_port, run_script, run_torchrun

UPDATES = 6


def flags(script, world, tmp_path, name, *extra):
    """6 updates of 8 completions (batch 8 on one process, 4 + 4 on two), a checkpoint after every update."""
    common = [
        "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--response_length", "6",
        "--max_prompt_length", "16", "--local_rollout_forward_batch_size", "8", "--num_ppo_epochs", "2",
        "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--max_grad_norm", "1.0",
        "--num_sample_generations", "0", "--total_episodes", str(8 * UPDATES), "--save_steps", "1",
        "--save_total_limit", "2", "--logging_dir", str(tmp_path / "runs"), "--run_name", name,
        "--output_dir", str(tmp_path / name),
    ]  # fmt: skip
    if script == "ppo.py":  # every piece of state a checkpoint must carry
        common += ["--use_score_scaling", "--use_score_norm", "--adaptive_kl", "--target_kl", "0.01",
                   "--kl_horizon", "100", "--whiten_rewards"]  # fmt: skip
    else:
        common += ["--rloo_k", "2", "--normalize_advantage", "--token_level_kl"]
    return common + list(extra)


def per_device(nproc):
    return ["--per_device_train_batch_size", str(4 // nproc)]


def launch(script_args, nproc):
    """Start a run in its own process group (so kill -9 reaches torchrun's workers too)."""
    env = {**os.environ, **OFFLINE_ENV}
    command = [sys.executable, *script_args]
    if nproc > 1:
        env["ACCELERATE_USE_CPU"] = "true"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={free_port()}", *script_args]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def wait_for(path, proc, timeout=400):
    start = time.time()
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(
                f"the run ended ({proc.returncode}) before {path.name}:\n{proc.stderr.read()[-3000:]}"
            )
        if time.time() - start > timeout:
            for pid in children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {path.name} after {timeout} s")
        time.sleep(0.02)


def children(pid):
    """The processes whose parent is `pid` (torchrun's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return sorted(found)


def run(script_args, nproc):
    if nproc > 1:
        return run_torchrun(script_args, nproc=nproc)
    return run_script(script_args)


def steps_logged(tmp_path, name):
    return [json.loads(line)["step"] for line in open(tmp_path / "runs" / name / "metrics.jsonl")]


def same_weights(a, b):
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def kill_sigterm_resume(script, world, tmp_path, nproc):
    """Uninterrupted run; then a run killed with kill -9 once checkpoint-2 exists, resumed from `latest`,
    stopped by SIGTERM once it wrote a checkpoint of its own, and resumed again to the end."""
    args = [script, *per_device(nproc)]
    run([*args, *flags(script, world, tmp_path, "whole")], nproc)
    out = tmp_path / "cut"
    proc = launch([*args, *flags(script, world, tmp_path, "cut")], nproc)
    wait_for(out / "checkpoint-2", proc)
    for pid in children(proc.pid):  # torchrun starts its workers in sessions of their own
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resume = ["--resume_from_checkpoint", "latest"]
    resumed_from = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    proc = launch([*args, *flags(script, world, tmp_path, "cut", *resume)], nproc)
    wait_for(out / f"checkpoint-{resumed_from + 1}", proc)
    # One process gets SIGTERM (with torchrun: one worker); they agree to save together and stop.
    os.kill(proc.pid if nproc == 1 else children(proc.pid)[0], signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0, stderr[-2000:]
    lines = [line for line in stderr.strip().splitlines() if nproc == 1 or ": interrupted: " in line]
    assert lines, stderr[-3000:]
    message = lines[-1]
    assert (
        message.startswith(f"{script}: interrupted: SIGTERM received; saved ")
        and "--resume_from_checkpoint" in message
    )
    assert len(list(out.glob("checkpoint-*"))) == 2  # --save_total_limit 2
    run([*args, *flags(script, world, tmp_path, "cut", *resume)], nproc)
    assert same_weights(tmp_path / "whole", out)
    assert steps_logged(tmp_path, "cut") == list(range(1, UPDATES + 1)) == steps_logged(tmp_path, "whole")
    whole = [json.loads(line) for line in open(tmp_path / "runs" / "whole" / "metrics.jsonl")]
    cut = [json.loads(line) for line in open(tmp_path / "runs" / "cut" / "metrics.jsonl")]
    for a, b in zip(whole, cut):  # the same run, metric for metric (the speed aside)
        assert {k: v for k, v in a.items() if k != "eps"} == {k: v for k, v in b.items() if k != "eps"}


@pytest.mark.parametrize("script", ["ppo.py", pytest.param("rloo.py", marks=pytest.mark.slow)])  # CI: ppo's
def test_kill_sigterm_and_resume_is_bit_exact(script, world, tmp_path):
    kill_sigterm_resume(script, world, tmp_path, nproc=1)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_kill_sigterm_and_resume_is_bit_exact_on_two_processes(script, world, tmp_path):
    kill_sigterm_resume(script, world, tmp_path, nproc=2)


NAN_AT_THIRD_CALL = """
calls = 0


def f(prompts, completions):
    global calls
    calls += 1
    return [float("nan") if calls == 3 else float(len(c) % 5) for c in completions]
"""


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_nan_score_stops_with_the_update_and_keeps_the_checkpoint(script, world, tmp_path):
    """The reward function is called once per update here: NaN at update 3 stops the run with one line; the
    checkpoint of update 2 is complete and nothing else was written."""
    (tmp_path / "nan.py").write_text(NAN_AT_THIRD_CALL)
    args = flags(script, world, tmp_path, "nan", "--reward_fn", f"{tmp_path / 'nan.py'}:f")
    args[args.index("--reward_model_path") : args.index("--reward_model_path") + 2] = []
    proc = run_script([script, *per_device(1), *args], check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    checkpoint = tmp_path / "nan" / "checkpoint-2"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"{script}: stopped: step 3: scores is not finite (NaN or inf); the last good checkpoint is {checkpoint}."
    )
    assert sorted(p.name for p in (tmp_path / "nan").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["episode"] == 16
    assert steps_logged(tmp_path, "nan") == [1, 2]


# Scores that are finite (3e38 < float32's max) but whose differences are not: an IEEE overflow, the same on every
# CPU (a learning rate of 1e6 overflowed on one CPU and not on another). The two completions of a prompt (rows i
# and i + B/2, or 2j and 2j + 1) get opposite signs.
OVERFLOW_FROM_THIRD_CALL = """
calls = 0


def f(prompts, completions):
    global calls
    calls += 1
    if calls < 3:
        return [float(len(c) % 5) for c in completions]
    half = len(completions) // 2
    return [3e38 if (i % 2 == 0) != (i >= half) else -3e38 for i in range(len(completions))]
"""


@pytest.mark.parametrize("script", ["rloo.py"])  # ppo.py: its score scaling and whitening absorb the overflow
def test_a_non_finite_loss_is_caught(script, world, tmp_path):
    """Finite scores from update 3 on whose advantages overflow: the run stops at update 3 with one line."""
    (tmp_path / "overflow.py").write_text(OVERFLOW_FROM_THIRD_CALL)
    args = flags(script, world, tmp_path, "div", "--reward_fn", f"{tmp_path / 'overflow.py'}:f")
    args[args.index("--reward_model_path") : args.index("--reward_model_path") + 2] = []
    proc = run_script([script, *per_device(1), *args], check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: stopped: step 3: ") and "is not finite (NaN or inf)" in last, last
    assert "scores" not in last.split("step 3: ")[1].split(" is not")[0]  # the scores themselves were finite
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "div" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])
def test_zero2_resume_is_bit_exact(script, world, tmp_path):
    """Under DeepSpeed the checkpoint holds DeepSpeed's own shards (weights and optimizer state): resuming a
    ZeRO-2 run from checkpoint-2 into another folder gives the weights of the uninterrupted run."""
    from conftest import run_deepspeed

    args = [script, *per_device(2), *flags(script, world, tmp_path, "whole", "--save_total_limit", "10")]
    run_deepspeed(args, tmp_path, zero_stage=2)
    name = "model" if script == "ppo.py" else "policy"
    assert (tmp_path / "whole" / "checkpoint-4" / name / "state").is_dir()  # DeepSpeed's checkpoint folder
    resume = [
        "--resume_from_checkpoint",
        str(tmp_path / "whole" / "checkpoint-4"),
        "--output_dir",
        str(tmp_path / "again"),
    ]
    run_deepspeed([*args, *resume], tmp_path, zero_stage=2)
    assert same_weights(tmp_path / "whole", tmp_path / "again")
    assert steps_logged(tmp_path, "whole") == list(range(1, UPDATES + 1))
