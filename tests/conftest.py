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
    full_env = {key: value for key, value in full_env.items() if value is not None}  # None: unset it
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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script_args: list[str], nproc: int = 2, timeout: int = 400, cwd: Path | None = None):
    """Run a script on `nproc` CPU processes (gloo) with torchrun, as `accelerate launch` would."""
    return run_script(
        ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         *script_args],
        cwd=cwd, timeout=timeout, env={"ACCELERATE_USE_CPU": "true"},
    )  # fmt: skip


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_config(path: Path, zero_stage: int, bf16: bool = False, nproc: int = 2) -> Path:
    """An accelerate config for DeepSpeed on CPU processes: as accelerate_configs/deepspeed_zero*.yaml, but with
    real sharding of small tensors under ZeRO-3 (persistence threshold 0)."""
    zero3 = "\n  zero3_init_flag: true\n  zero3_save_16bit_model: true" if zero_stage == 3 else ""
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nuse_cpu: false\n"
        f"num_machines: 1\nnum_processes: {nproc}\nmachine_rank: 0\n"
        f"mixed_precision: {'bf16' if bf16 else repr('no')}\n"
        f"deepspeed_config:\n  zero_stage: {zero_stage}\n  offload_optimizer_device: none\n"
        f"  offload_param_device: none{zero3}\n"
    )
    return path


def run_deepspeed(script_args: list[str], tmp_path: Path, zero_stage: int, bf16: bool = False, nproc: int = 2,
                  timeout: int = 600, check=True):  # fmt: skip
    """Run a script under DeepSpeed ZeRO-`zero_stage` on `nproc` CPU processes through `accelerate launch`.

    DeepSpeed compiles a small communication op at first use (about 90 s once; cached in
    ~/.cache/torch_extensions). ACCELERATE_USE_CPU must stay unset: it would silently turn DeepSpeed off."""
    if not deepspeed_available():
        pytest.skip("deepspeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")
    config = deepspeed_config(
        tmp_path / f"zero{zero_stage}{'_bf16' if bf16 else ''}.yaml", zero_stage, bf16, nproc
    )
    env = {"DS_ACCELERATOR": "cpu", "ACCELERATE_USE_CPU": None}
    return run_script(
        ["-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
         str(free_port()), *script_args],
        timeout=timeout, env=env, check=check,
    )  # fmt: skip
