"""A researcher's first hour (#52): a folder without a model given as a model, a mistyped path, and Ctrl-C at
any moment each end in one line and a non-zero exit, at once (no hub retries), never in a traceback or in a
run that trains to the end and exits 0."""

import os
import signal
import subprocess
import sys
import time

import pytest

import utils.data
import utils.loading
import utils.paths
from conftest import OFFLINE_ENV, ROOT, run_script

SFT = ["sft.py", "--dataset_name", "{world}/dataset", "--dataset_train_split", "sft", "--eval_strategy", "no",
       "--per_device_train_batch_size", "4", "--total_steps", "2"]  # fmt: skip


def filled(args, world, tmp_path):
    return [a.format(world=world) for a in args] + ["--output_dir", str(tmp_path / "out")]


def stderr_lines(proc) -> list[str]:
    return [line for line in proc.stderr.strip().splitlines() if line.strip()]


@pytest.mark.parametrize(
    "script, flags",
    [
        ("sft.py", [*SFT[1:], "--model_name_or_path", "{world}/tokenizer"]),
        ("rloo.py", ["--sft_model_path", "{world}/tokenizer", "--reward_model_path", "{world}/reward",
                     "--dataset_name", "{world}/dataset", "--dataset_train_split", "sft"]),
    ],
)  # fmt: skip
def test_a_tokenizer_folder_given_as_model_is_one_line(script, flags, world, tmp_path):
    proc = run_script([script, *filled(flags, world, tmp_path)], check=False)
    lines = stderr_lines(proc)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith(f"{script}: error: ") and "holds only a tokenizer" in lines[-1]
    assert "no config.json" in lines[-1] and str(world / "policy") in lines[-1]  # names a folder that has one


def test_folders_without_a_model_say_what_they_hold(world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "empty").mkdir()
    cases = [(AutoModelForCausalLM, tmp_path / "empty", "is an empty folder: no model"),
             (AutoTokenizer, tmp_path / "empty", "is an empty folder: no tokenizer"),
             (AutoModelForCausalLM, world / "dataset", "holds a dataset: no model"),
             (AutoModelForCausalLM, world / "dataset" / "sft.jsonl", "is a file")]  # fmt: skip
    for cls, path, words in cases:
        with pytest.raises(ValueError, match=words):
            utils.paths.check_source(cls, str(path), "--model_name_or_path")
    with pytest.raises(ValueError, match="holds a model; pass a dataset"):
        utils.data.load_split(str(world / "policy"), "train")


@pytest.mark.parametrize("offline", ["1", None])
def test_a_mistyped_local_path_fails_at_once(offline, world, tmp_path, monkeypatch):
    """No hub retries: under HF_HUB_OFFLINE=1 (`data/x` reads as a hub id) and online for a path with ./"""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, offline) if offline else monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "sft").mkdir(parents=True)
    prefix = "" if offline else "./"
    from transformers import AutoModelForCausalLM

    start = time.time()
    with pytest.raises(
        ValueError, match=r"--dataset_name (\./)?data/x (does not exist|is not a local folder)"
    ):
        utils.data.load_split(f"{prefix}data/x", "train")
    with pytest.raises(ValueError, match=r"models/ has no sfft; did you mean sft"):
        utils.loading.from_pretrained(AutoModelForCausalLM, f"{prefix}models/sfft", "--sft_model_path")
    with pytest.raises(ValueError, match=r"sft\.jsonl does not exist: .* has no sft\.jsonl"):
        utils.data.load_split(f"{prefix}sft.jsonl", "train")
    assert time.time() - start < 3


def test_a_mistyped_path_online_is_one_line_without_retries(world, tmp_path):
    proc = run_script(
        ["sft.py", *filled(SFT[1:], world, tmp_path), "--model_name_or_path", "./models/sft"],
        check=False,
        env={"HF_HUB_OFFLINE": None, "HF_DATASETS_OFFLINE": None, "TRANSFORMERS_OFFLINE": None},
    )
    assert proc.returncode == 2 and "Retrying" not in proc.stderr, proc.stderr[-3000:]
    assert stderr_lines(proc) == ["sft.py: error: --model_name_or_path ./models/sft does not exist: this folder "
                                  "has no models."]  # fmt: skip


SIGNAL_AFTER = """
import os, runpy, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
from sigterm_at import resolve
owner, name = resolve({target!r})
original = getattr(owner, name)
def signalled(*args, **kwargs):
    result = original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
    return result
setattr(owner, name, signalled)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(
    "moment, last_line",
    [
        (0.3, "sft.py: interrupted before training started; nothing was saved."),  # torch still importing
        ("utils.run.make_accelerator", "sft.py: interrupted before training started; nothing was saved."),
        ("accelerate.Accelerator.backward", "sft.py: interrupted: SIGINT received; saved {out}/checkpoint-1 "
         "at step 1; continue with --resume_from_checkpoint {out}/checkpoint-1"),
        ("utils.saving.write_model_card", "sft.py: interrupted: SIGINT received after the last step; the run "
         "finished and its output is saved."),  # after the loop's last check: was lost, exit 0
    ],
    ids=["at_0.3s", "in_setup", "in_training", "after_last_step"],
)  # fmt: skip
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(moment, last_line, world, tmp_path):
    args = ["sft.py", *filled(SFT[1:], world, tmp_path), "--model_name_or_path", str(world / "policy")]
    if isinstance(moment, str):
        program = SIGNAL_AFTER.format(root=str(ROOT), tests=str(ROOT / "tests"), target=moment)
        args = ["-c", program, *args]
    env = {**os.environ, **OFFLINE_ENV}
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    if not isinstance(moment, str):
        time.sleep(moment)
        proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=180)
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[-1] == last_line.format(out=tmp_path / "out")
    if moment == 0.3:
        assert lines == [last_line]


@pytest.mark.parametrize(
    "script, extra", [("ppo", {}), ("rloo", {}), ("grpo", {"max_completion_length": 8}), ("online_dpo", {})]
)
def test_a_missing_reward_model_is_named_before_any_model_loads(
    script, extra, world, tmp_path, monkeypatch, fresh_accelerate_state
):
    """The Checkpointer, built before any model loads, checks every model path: a missing --reward_model_path
    stops the run in one sentence without the policy having been loaded first."""
    import importlib

    module = importlib.import_module(script)
    loaded = []
    real = utils.loading.from_pretrained
    monkeypatch.setattr(utils.loading, "from_pretrained", lambda cls, path, *a, **k: loaded.append(path) or real(cls, path, *a, **k))  # fmt: skip
    args = module.Args(
        model_name_or_path=str(world / "policy"), reward_model_path=str(tmp_path / "missing"),
        dataset_name=str(world / "dataset"), dataset_train_split="sft", output_dir=str(tmp_path / "out"),
        logging_dir=str(tmp_path / "runs"), **extra,
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"--reward_model_path {tmp_path / 'missing'} does not exist"):
        module.main(args)
    assert loaded == []
