"""#25 "Never silently wrong", one test per case (the bad flag values and datasets are in tests/test_errors.py):
an old run's checkpoints are never resumed by a new run (what defines a run travels with its checkpoints, and
--overwrite_output_dir moves the old contents aside); `latest` skips a damaged checkpoint and starts from scratch
when there is none; leftover temporary folders never block a run; a stop signal on two processes is one line
and exit 143 on every rank; the README's multi-GPU command on a machine without GPUs runs two real processes;
dpo.py resumed at its last step logs its final evaluation once and keeps its model card; a non-finite loss is
caught deterministically (no float overflow that depends on the CPU's kernels)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from test_resume import dpo_flags, sft_flags, wait_for, weights
from test_resume_rl import children

from conftest import OFFLINE_ENV, ROOT, free_port, run_script


def metric_lines(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


# ---- 1. an old run's checkpoints are never resumed by a new run --------------------------------------------------
def test_overwrite_starts_over_and_resume_refuses_another_runs_checkpoint(world, tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    run_script(["sft.py", *sft_flags(world, out, "same", steps=4)])  # checkpoint-2, checkpoint-4
    # Another learning rate into the same folder and run name, with --overwrite_output_dir.
    new = sft_flags(world, out, "same", steps=2, learning_rate=2e-3)
    proc = run_script(["sft.py", *new, "--overwrite_output_dir"])
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-")]
    assert (
        len(aside) == 1 and (aside[0] / "checkpoint-4").is_dir() and (aside[0] / "model.safetensors").exists()
    )
    assert f"--overwrite_output_dir: moved the previous contents of {out} (" in proc.stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    # The logs of the old run (same --run_name) were moved aside too, not truncated or appended to.
    old_logs = [p for p in runs.iterdir() if p.name.startswith("same.replaced-")]
    assert len(old_logs) == 1 and [m["step"] for m in metric_lines(old_logs[0])] == [1, 2, 3, 4]
    assert [m["step"] for m in metric_lines(runs / "same")] == [1, 2]
    # The old run's checkpoint, resumed with the new flags: refused, naming the flags that differ.
    old_checkpoint = str(aside[0] / "checkpoint-4")
    proc = run_script(["sft.py", *new, "--resume_from_checkpoint", old_checkpoint], check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("sft.py: error: --resume_from_checkpoint ") and "belongs to another run" in last
    assert "--learning_rate 0.001 there, 0.002 here" in last and "--total_steps 4 there, 2 here" in last
    assert "--output_dir" not in last.split("(")[1].split(")")[0]  # where it writes does not define a run


@pytest.mark.parametrize("script", ["sft.py", "reward.py", "dpo.py"])
def test_overwrite_without_checkpoints_moves_the_old_output_aside_at_the_final_save(world, tmp_path, script):
    """--overwrite_output_dir with --save_steps 0: the final save is the run's first write there, so it moves
    the old contents (a stale checkpoint a later `latest` would pick) aside rather than mixing them in."""
    from test_resume import SCRIPTS

    out = tmp_path / "out"
    (out / "checkpoint-9").mkdir(parents=True)
    (out / "checkpoint-9" / "trainer_state.json").write_text("{}")
    proc = run_script(
        [script, *SCRIPTS[script](world, out, "over", steps=2, save_steps=0), "--overwrite_output_dir"]
    )
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint-9").is_dir(), sorted(
        p.name for p in tmp_path.iterdir()
    )
    assert not (out / "checkpoint-9").exists() and f"moved the previous contents of {out} (" in proc.stdout


# ---- 2. leftover temporary folders never block a run; `latest` with nothing starts from scratch -------------------
def test_a_leftover_tmp_checkpoint_blocks_nothing(world, tmp_path):
    out = tmp_path / "out"
    (out / "tmp-checkpoint-2").mkdir(parents=True)  # a kill during the first checkpoint write
    (out / "tmp-checkpoint-2" / "model.safetensors").write_bytes(b"\0" * 100)
    proc = run_script(
        ["sft.py", *sft_flags(world, out, "fresh", steps=2), "--resume_from_checkpoint", "latest"]
    )
    assert (
        f"--resume_from_checkpoint latest: no complete checkpoint in {out}; starting from scratch"
        in proc.stdout
    )
    assert not (out / "tmp-checkpoint-2").exists() and (out / "model.safetensors").exists()


def test_check_output_dir_ignores_unfinished_checkpoint_writes(tmp_path):
    import utils.checkpoint

    (tmp_path / "tmp-checkpoint-7").mkdir()
    utils.checkpoint.check_output_dir(str(tmp_path))  # nothing but a leftover: a fresh run may start
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="exists and is not empty"):
        utils.checkpoint.check_output_dir(str(tmp_path))


# ---- 3. a damaged newest checkpoint: `latest` falls back to the previous complete one ------------------------------
def test_latest_skips_a_cut_checkpoint_and_resumes_exactly(world, tmp_path):
    out, runs = tmp_path / "cut", tmp_path / "runs"
    run_script(["sft.py", *sft_flags(world, out, "cut", steps=4)])
    straight = weights(out)
    newest = out / "checkpoint-4" / "model.safetensors"
    size = newest.stat().st_size
    with open(newest, "r+b") as f:  # a kill while the file was written (or a disk that filled up)
        f.truncate(size // 2)
    # Named explicitly, the damaged checkpoint is refused in one sentence.
    flags = sft_flags(world, out, "cut", steps=4)
    proc = run_script(["sft.py", *flags, "--resume_from_checkpoint", str(newest.parent)], check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert last.endswith(f"is damaged: model.safetensors has {size // 2} bytes, {size} were written; pass an "
                         "earlier checkpoint-N or `latest`.")  # fmt: skip
    # `latest` skips it, says so, and continues from checkpoint-2 to the very same weights.
    proc = run_script(["sft.py", *flags, "--resume_from_checkpoint", "latest"])
    expected = f"skipped {out / 'checkpoint-4'}: model.safetensors has {size // 2} bytes, {size} were written"
    assert expected in proc.stdout
    resumed = weights(out)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [m["step"] for m in metric_lines(runs / "cut")] == [1, 2, 3, 4]  # each step once


def test_ddpo_latest_skips_a_cut_checkpoint(tmp_path):
    import ddpo
    import utils.safeguards

    checkpoints = tmp_path / "out" / "checkpoints"
    for epoch in (0, 1):
        path = checkpoints / f"checkpoint_{epoch}"
        path.mkdir(parents=True)
        torch.save({"trained": {"w": torch.zeros(64)}, "epoch": epoch}, path / "checkpoint.pt")
        record = {"epoch": epoch, "run": {}, "files": utils.safeguards.file_sizes(str(path))}
        (path / "trainer_state.json").write_text(json.dumps(record))
    with open(checkpoints / "checkpoint_1" / "checkpoint.pt", "r+b") as f:
        f.truncate(100)
    assert ddpo.find_checkpoint("latest", str(tmp_path / "out")) == str(checkpoints / "checkpoint_0")
    with pytest.raises(ValueError, match="checkpoint_1 is damaged: checkpoint.pt has 100 bytes"):
        ddpo.find_checkpoint(str(checkpoints / "checkpoint_1"), str(tmp_path / "out"))
    (checkpoints / "checkpoint_0" / "checkpoint.pt").write_bytes(b"PK")  # an old-style one, cut: none is left
    assert ddpo.find_checkpoint("latest", str(tmp_path / "out")) is None


# ---- 4 and 9. two processes: the README's multi-GPU command on CPU, SIGTERM -------------------------------------
def test_multi_gpu_config_on_cpu_trains_two_processes_and_sigterm_is_one_line(world, tmp_path):
    """`accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 2` on a machine without
    GPUs (and without ACCELERATE_USE_CPU) used to give every process a world of its own; now it is one MULTI_CPU
    run. SIGTERM to both workers (as a scheduler sends it): one line, and 143 on every rank (torch's launcher
    reports each worker's exit code)."""
    out = tmp_path / "term"
    env = {**os.environ, **OFFLINE_ENV}
    env.pop("ACCELERATE_USE_CPU", None)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / "multi_gpu.yaml"), "--num_processes", "2", "--main_process_port",
               str(free_port()), "sft.py", *sft_flags(world, out, "term", steps=400, save_steps=0,
                                                       per_device_train_batch_size=4)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        wait_for(tmp_path / "runs" / "term" / "metrics.jsonl", proc)
        workers = children(proc.pid)
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert stderr.count(": interrupted: ") == 1, stderr[-3000:]
    # The rank that exits first with 143 makes the launcher terminate the other one (143, or -15 when it was still
    # saving): at least one 143, and never a traceback of ours.
    assert stderr.count("exitcode  : 143") >= 1, stderr[-3000:]
    (checkpoint,) = out.glob("checkpoint-*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and (checkpoint / "rng-1.json").exists()


# ---- 8. dpo.py: killed during its final save, then resumed -------------------------------------------------------
def test_dpo_resumed_at_its_last_step_logs_the_final_eval_once_and_keeps_its_card(world, tmp_path):
    out = tmp_path / "dpo"
    flags = dpo_flags(world, out, "d", steps=2, eval_strategy="steps", dataset_test_split="preference_validation",
                      per_device_eval_batch_size=50)  # fmt: skip
    run_script(["dpo.py", *flags])
    for file in out.iterdir():  # what a kill during the final save leaves: the last checkpoint, no model
        if file.is_file():
            file.unlink()
    run_script(["dpo.py", *flags, "--resume_from_checkpoint", "latest"])
    lines = metric_lines(tmp_path / "runs" / "d")
    assert [m["step"] for m in lines if "eval/loss" in m] == [2]
    card = (out / "README.md").read_text()
    assert "\n# dpo\n" in card and "| loss |" in card and "| eval/loss |" in card


# ---- 10. a non-finite loss, made deterministically (rloo.py's: tests/test_resume_rl.py) --------------------------
def test_nan_weights_stop_sft_with_one_line_and_keep_the_output_dir(world, tmp_path):
    """sft.py's divergence test without a learning rate that overflows on some CPUs and not on others."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(world / "policy")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan_policy")
    AutoTokenizer.from_pretrained(world / "policy").save_pretrained(tmp_path / "nan_policy")
    out = tmp_path / "diverge"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    flags = sft_flags(world, out, "diverge", steps=3, save_steps=1, overwrite_output_dir=True,
                      model_name_or_path=tmp_path / "nan_policy")  # fmt: skip
    proc = run_script(["sft.py", *flags], check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "sft.py: stopped: step 1: loss, grad_norm is not finite (NaN or inf); no checkpoint was written."
    )
    assert not (out / "model.safetensors").exists()
    # --overwrite_output_dir moves the old contents aside only when the run first writes there: never here.
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("diverge.replaced-")]
