"""Shared fixtures: the offline tiny world (built once per test session) and a runner for the scripts' CLIs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmark"))

# Offline and quiet for every script the tests start.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
}
os.environ.update(OFFLINE_ENV)


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> Path:
    """The tiny world with small splits: tokenizer/, policy/, reward/, dataset/ (see benchmark/tiny_world.py)."""
    import tiny_world

    out = tmp_path_factory.mktemp("world")
    args = tiny_world.Args(
        output_dir=str(out), num_sft=600, num_preference=600, num_preference_validation=200,
        num_validation=64, num_test=64,
    )  # fmt: skip
    tiny_world.build(args)
    return out


def run_script(
    args: list[str], cwd: Path | None = None, timeout: int = 300, env: dict | None = None, check=True
):
    """Run `python <args>` offline from the repository root (or `cwd`); return the CompletedProcess.

    With `check`, a non-zero exit fails the test and shows the script's output."""
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_torchrun(script_args: list[str], nproc: int = 2, timeout: int = 400, cwd: Path | None = None):
    """Run a script on `nproc` CPU processes (gloo) with torchrun, as `accelerate launch` would."""
    return run_script(
        ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *script_args],
        cwd=cwd, timeout=timeout, env={"ACCELERATE_USE_CPU": "true"},
    )  # fmt: skip
