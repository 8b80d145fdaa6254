"""ppo.py and rloo.py on the scale path, run on CPU: DDP, DeepSpeed ZeRO-2 and ZeRO-3 on 2 processes, and bf16;
grpo.py's environments under DDP.

One run per (script, launch) serves several tests: ZeRO runs save a model that `from_pretrained` reloads, the
ZeRO-3 run logs the share of the weights each process holds while it trains (sharded: about 1/2), and the four
runs of a script at the same global batch (1 process, DDP on 2, ZeRO-2, ZeRO-3) must give the same per-update
metrics.

Why the four can agree: the sampling noise of a generation call is keyed by (update, index of its first prompt
in the global batch), so the same completions are sampled however the batch is split (a call, 2 prompts for PPO
and 1 prompt's 2 completions for RLOO, divides every process's share); the prompts are longer than
--max_prompt_length, so no padding differs; responses are never truncated, so every micro-batch loss is a mean over the same number
of tokens and the mean over processes and micro-batches is the mean over the global batch; whitening and
normalisation use statistics gathered over every process. What still differs is the order of float32 sums:
one process sums a micro-batch of 4 rows, two processes sum 2 rows each and all-reduce, ZeRO reduce-scatters
flat gradient buffers. Measured over the 3 updates (largest relative difference of any compared metric to the
1-process run): RLOO 5e-6 (the KL, a difference of log-probabilities), PPO 2e-6; final weights within 5e-5
(RLOO) and 6e-6 (PPO), Adam dividing each gradient by its own running norm so tiny gradients amplify the
rounding. TOLERANCE (relative 1e-4) leaves a margin of 20 over rounding, while a real defect (a wrong gradient
scale, a process dropping its rows, whitening per process) changes the update itself, not its last bits; the
weights must agree within 5e-4, half of one Adam step at learning rate 1e-3.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_tools import tool_lab  # noqa: F401 - the fixture: a policy taught to call lookup

from conftest import run_deepspeed, run_script, run_torchrun

TOLERANCE = dict(rel=1e-4, abs=1e-6)
COMPARED = ["loss/policy_avg", "loss/value_avg", "objective/kl", "objective/scores", "policy/entropy_avg",
            "policy/approxkl_avg", "grad_norm"]  # fmt: skip
UPDATES = 3


def script_flags(script, world, out, name, nproc, *extra):
    """3 updates of a global batch of 8 (4 prompts x 2 completions for RLOO, 8 prompts for PPO), per process
    4 // nproc rows per micro-batch and 2 micro-batches per optimizer step; 2 epochs per update."""
    flags = [
        "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--response_length", "6",
        "--max_prompt_length", "16", "--local_rollout_forward_batch_size", "2", "--num_ppo_epochs", "2",
        "--per_device_train_batch_size", str(4 // nproc), "--gradient_accumulation_steps", "2",
        "--learning_rate", "1e-3", "--max_grad_norm", "1.0", "--num_sample_generations", "0",
        "--total_episodes", str(8 * UPDATES), "--logging_dir", str(out / "runs"), "--run_name", name,
        "--output_dir", str(out / name), "--seed", "3",
    ]  # fmt: skip
    if script == "ppo.py":  # no stop token: every response keeps its 6 tokens
        flags += ["--stop_token", "None", "--whiten_rewards", "--whiten_across_processes"]
    else:
        flags += ["--rloo_k", "2", "--normalize_advantage", "--normalize_reward"]
    return flags + list(extra)


LAUNCHES = {"one": 1, "ddp": 2, "zero2": 2, "zero3": 2}


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    """run(script, launch, *extra) -> the output folder; each (script, launch, extra) runs once per module."""
    done = {}

    def run(script, launch, *extra, bf16=False):
        key = (script, launch, extra, bf16)
        if key not in done:
            out = tmp_path_factory.mktemp(f"{script[:-3]}_{launch}")
            name = f"{script[:-3]}_{launch}"
            args = [script, *script_flags(script, world, out, name, LAUNCHES[launch], *extra)]
            if launch == "one":
                run_script(args + (["--bf16"] if bf16 else []))
            elif launch == "ddp":
                run_torchrun(args)
            else:
                run_deepspeed(args, out, zero_stage=int(launch[-1]), bf16=bf16)
            done[key] = out / name, [json.loads(line) for line in open(out / "runs" / name / "metrics.jsonl")]
        return done[key]

    return run


def ci(script):
    """RLOO's runs are in CI; PPO's equivalence (four more runs) is marked slow."""
    return script if script == "rloo.py" else pytest.param(script, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "script, stage",
    [
        pytest.param("ppo.py", 2, marks=pytest.mark.slow),
        ("ppo.py", 3),
        pytest.param("rloo.py", 2, marks=pytest.mark.slow),
        ("rloo.py", 3),
    ],
)  # CI: ZeRO-3, which has more to it (frozen models as DeepSpeed inference engines, sharded saving)
def test_zero_saves_a_model_that_reloads_and_zero3_shards(script, stage, runs, world):
    from transformers import AutoModelForCausalLM

    out, metrics = runs(script, f"zero{stage}")
    assert [m["step"] for m in metrics] == list(range(1, UPDATES + 1))
    assert all(math.isfinite(m["loss/policy_avg"]) and m["grad_norm"] > 0 for m in metrics)
    if stage == 3:  # each process held about half of the weights at every update, not a full copy
        assert all(0.4 < m["zero3/local_param_share"] < 0.6 for m in metrics), metrics
    else:
        assert all("zero3/local_param_share" not in m for m in metrics)
    model = AutoModelForCausalLM.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(world / "policy").state_dict()
    saved = model.state_dict()
    assert saved.keys() == initial.keys() and all(saved[k].shape == initial[k].shape for k in saved)
    assert any(not torch.equal(saved[k], initial[k]) for k in saved)  # it trained
    assert not any("score" in k for k in load_file(out / "model.safetensors"))  # PPO: the policy alone


@pytest.mark.parametrize("script", [ci("rloo.py"), ci("ppo.py")])
def test_one_process_ddp_zero2_zero3_agree_at_equal_global_batch(script, runs):
    reference_out, reference = runs(script, "one")
    reference_weights = load_file(reference_out / "model.safetensors")
    for launch in ("ddp", "zero2", "zero3"):
        out, metrics = runs(script, launch)
        assert len(metrics) == len(reference) == UPDATES
        for step, (expected, got) in enumerate(zip(reference, metrics), 1):
            for name in COMPARED:
                if name in expected:
                    assert got[name] == pytest.approx(expected[name], **TOLERANCE), (launch, step, name)
        weights = load_file(out / "model.safetensors")
        for name, value in reference_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=5e-4)


def test_lora_one_process_ddp_zero2_agree(runs):
    """rloo.py with --use_peft: the adapter's steps and the KL to the adapter-off reference the same on one
    process, DDP and ZeRO-2 (ZeRO-3 is refused: the merged save needs whole weights)."""
    lora = ("--use_peft", "--lora_target_modules", "q_proj", "v_proj")
    reference_out, reference = runs("rloo.py", "one", *lora)
    reference_weights = load_file(reference_out / "model.safetensors")
    for launch in ("ddp", "zero2"):
        out, metrics = runs("rloo.py", launch, *lora)
        assert len(metrics) == len(reference) == UPDATES
        for step, (expected, got) in enumerate(zip(reference, metrics), 1):
            for name in COMPARED:
                if name in expected:
                    assert got[name] == pytest.approx(expected[name], **TOLERANCE), (launch, step, name)
        weights = load_file(out / "model.safetensors")
        for name, value in reference_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=5e-4)
        assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert reference[-1]["objective/kl"] != 0  # the reference is not the adapted policy


@pytest.mark.parametrize(
    "script,launch",
    [("ppo.py", "one"), ("rloo.py", "zero2"), pytest.param("rloo.py", "one", marks=pytest.mark.slow),
     pytest.param("ppo.py", "zero2", marks=pytest.mark.slow), pytest.param("ppo.py", "zero3", marks=pytest.mark.slow),
     pytest.param("rloo.py", "zero3", marks=pytest.mark.slow)],
)  # fmt: skip
def test_bf16_ratio_is_one_and_kl_zero_at_the_start(script, launch, runs):
    """bf16 (autocast with one process, bf16 weights under DeepSpeed), learning rate 0: the old logprobs are
    recomputed with the training forward pass and the reference runs in the policy's precision, so the ratio
    is 1 and the KL 0 (measured: exactly; bf16 has 8 bits of mantissa, so a mismatch shows as 1e-3 or more)."""
    _, metrics = runs(script, launch, "--learning_rate", "0", bf16=True)
    for m in metrics:
        assert abs(m["objective/kl"]) < 1e-4, m
        assert m["val/ratio"] == pytest.approx(1.0, abs=1e-4) and m["val/ratio_var"] < 1e-8, m
        assert m["policy/clipfrac_avg"] == 0.0 and m["policy/approxkl_avg"] < 1e-8, m


def test_grpo_environments_on_two_processes_train_and_resume_exactly(tool_lab, tmp_path):  # noqa: F811
    """grpo.py --environment_factory under DDP on 2 processes: each process resets environments of its own for its
    rollouts, the tools/ and environment reward metrics are over both, and a resume from a checkpoint is bit-exact
    (the environments are reset on their rows, so a checkpoint carries nothing of them)."""
    from conftest import ROOT, read_metrics, weights

    def run(out, *extra):
        flags = [
            "grpo.py", "--model_name_or_path", str(tool_lab / "policy"), "--dataset_name", str(tool_lab / "prompts.jsonl"),
            "--environment_factory", f"{tool_lab}/tools.py:Book", "--reward_funcs", f"{tool_lab}/tools.py:book_reward",
            "--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "100",
            "--temperature", "1.0", "--learning_rate", "1e-4", "--max_steps", "4", "--num_sample_generations", "0",
            "--max_tool_calling_iterations", "2", "--save_steps", "2", "--output_dir", str(out / "model"),
            "--logging_dir", str(out / "runs"), "--run_name", "r", "--seed", "3", *extra,
        ]  # fmt: skip
        run_torchrun(flags, env={"TINY_WORLD_CODE": str(ROOT / "benchmark" / "tiny")})

    run(tmp_path / "whole")
    metrics = read_metrics(tmp_path / "whole" / "runs" / "r")
    assert len(metrics) == 4 and max(m["tools/call_frequency"] for m in metrics) > 0.3
    assert max(m["rewards/Book/mean"] for m in metrics) > 0
    run(tmp_path / "again", "--resume_from_checkpoint", str(tmp_path / "whole" / "model" / "checkpoint-2"))
    whole, resumed = weights(tmp_path / "whole" / "model"), weights(tmp_path / "again" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    start = weights(tool_lab / "policy")
    assert any(not torch.equal(whole[k], start[k]) for k in whole)
