"""Shared fixtures: the offline tiny world (built once per test session) and a runner for the scripts' CLIs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmark"))
for folder in ("tiny", "tldr", "speed", "memory", "reliability"):  # tests import their modules by name
    sys.path.insert(0, str(ROOT / "benchmark" / folder))

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
    """The tiny world with small splits: tokenizer/, policy/, reward/, dataset/ (see
    benchmark/tiny/tiny_world.py)."""
    import tiny_world

    out = tmp_path_factory.mktemp("world")
    args = tiny_world.Args(
        output_dir=str(out), num_sft=600, num_preference=600, num_preference_validation=200,
        num_validation=64, num_test=64,
    )  # fmt: skip
    tiny_world.build(args)
    return out


@pytest.fixture
def fresh_accelerate_state():
    """After a test that runs a script's main() in this process: accelerate's process-wide state starts over."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


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
            f"{' '.join(map(str, args))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(
    script_args: list[str], nproc: int = 2, timeout: int = 400, cwd: Path | None = None, check=True, env=None
):
    """Run a script on `nproc` CPU processes (gloo) with torchrun, as `accelerate launch` would."""
    return run_script(
        ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         *script_args],
        cwd=cwd, timeout=timeout, env={"ACCELERATE_USE_CPU": "true", **(env or {})}, check=check,
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


# ------------------------------------------------------------------------------ the RL scripts' rule-reward lab
RULE_REWARDS = '''
import json, os

KEYS = set("""landlord deposit rent boss salary promotion sister brother wedding divorce dog cat vet loan debt credit
car accident roommate lease breakup girlfriend boyfriend mother father school exam teacher doctor surgery insurance
lawyer contract neighbor party birthday gift phone laptop job interview""".split())


def key_words(prompts, completions):
    """Number of key words in the completion: the random policy averages about 0.2."""
    return [float(sum(word in KEYS for word in c.split())) for c in completions]


def prompt_only(prompts, completions):
    """Depends on the prompt alone: every completion of a prompt gets the same score (a tie in a pair)."""
    return [float(len(p) % 7) for p in prompts]


def chars(prompts, completions):
    """A dense signal: the length of the completion."""
    return [len(c) / 10 for c in completions]


def one_short(prompts, completions):
    return [0.0] * (len(completions) - 1)


def trl_style(completions, solution, prompts, **kwargs):
    """TRL's calling convention: keywords, the dataset's other columns among them; records what it got."""
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "solution": solution,
                            "extra": sorted(kwargs)}) + "\\n")
    return [float(len(str(c)) % 3) for c in completions]


def fewer_characters(prompts, pairs):
    """A pairwise judge preferring the shorter completion; records what it was asked in $JUDGE_LOG."""
    with open(os.environ["JUDGE_LOG"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "pairs": pairs}) + "\\n")
    return [-1 if len(a) == len(b) else int(len(b) < len(a)) for a, b in pairs]
'''


def make_rl_lab(world: Path, out: Path, num_prompts: int = 64) -> Path:
    """What the RL scripts' end-to-end tests train on, in `out`: prompts.jsonl (prompts of different lengths, so
    batches are left-padded), no_prompt.jsonl (the same rows under a wrong column name), policy/ (the tiny
    world's policy with its EOS embedding pointed along the mean last hidden state, so a random policy samples
    EOS at a varied position in about half of the completions, and dropout set in its config, which the
    scripts must switch off or the recomputed logprobs drift from sampling's), and rules.py (RULE_REWARDS)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import utils.chat
    import utils.generation

    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    model = AutoModelForCausalLM.from_pretrained(world / "policy")
    rows = [json.loads(line) for line in open(world / "dataset" / "sft.jsonl")][:num_prompts]
    prompts = [row["prompt"][(i % 4) * 9 :] for i, row in enumerate(rows)]
    with open(out / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    with open(out / "no_prompt.jsonl", "w") as f:
        f.writelines(json.dumps({"query": p}) + "\n" for p in prompts)
    ids = utils.generation.pad(
        utils.chat.tokenize_prompts(tokenizer, prompts[:16]), tokenizer.pad_token_id, "left"
    )
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=ids != tokenizer.pad_token_id).last_hidden_state
        mean = hidden.mean((0, 1))
        model.model.embed_tokens.weight[tokenizer.eos_token_id] = 0.4 * mean / mean.norm()
    model.config.attention_dropout = 0.1
    model.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    (out / "rules.py").write_text(RULE_REWARDS)
    return out


def write_trl_style_data(lab: Path, path: Path, conversational: bool, num_rows: int = 16) -> Path:
    """A prompt dataset with two more columns, as TRL reward functions read them: `solution` (a piece of the
    row's own prompt, so a completion scored with another row's columns shows) and `source` (the row index)."""
    import json

    rows = [json.loads(line) for line in open(lab / "prompts.jsonl")][:num_rows]
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            prompt = [{"role": "user", "content": row["prompt"]}] if conversational else row["prompt"]
            f.write(json.dumps({"prompt": prompt, "solution": row["prompt"][-40:-20], "source": i}) + "\n")
    return path


def check_trl_style_calls(log: Path, conversational: bool) -> int:
    """Check every call the rules.py:trl_style reward function logged: each completion came with its own row's
    `solution`, the other columns as keywords, and, for conversations, messages. Returns the completions seen."""
    import json

    calls = [json.loads(line) for line in open(log)]
    for call in calls:
        trl_keywords = {"completion_ids", "trainer_state", "log_extra", "log_metric"}  # TRL 1.16's
        assert sorted(set(call["extra"]) - trl_keywords) == ["source"]  # the prompt column is `prompts`
        for prompt, completion, solution in zip(call["prompts"], call["completions"], call["solution"]):
            if conversational:
                assert prompt[-1]["role"] == "user" and solution in prompt[-1]["content"]
                assert len(completion) == 1 and completion[0]["role"] == "assistant"
            else:
                assert isinstance(completion, str) and solution in prompt
    return sum(len(call["completions"]) for call in calls)


def read_metrics(run_dir: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl."""
    import json

    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def logged_every(script: str, flags_for, flags: list[str], every: int, tmp_path: Path) -> tuple[list, list]:
    """The metrics.jsonl of two runs of `script` that differ only in --logging_steps: 1 and `every`
    (`flags_for(tmp_path, name)` gives a run's output flags)."""
    runs = []
    for steps in (1, every):
        name = f"every{steps}"
        run_script([script, *flags_for(tmp_path, name), *flags, "--logging_steps", str(steps)])
        runs.append(read_metrics(tmp_path / "runs" / name))
    return runs[0], runs[1]


def weights(path: Path) -> dict:
    """The tensors of `path`/model.safetensors."""
    from safetensors.torch import load_file

    return load_file(Path(path) / "model.safetensors")
