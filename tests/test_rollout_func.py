"""grpo.py --rollout_func (utils/rollout_func.py): TRL 1.16's `rollout_func` hook. The same function given to TRL's
GRPOTrainer(rollout_func=...) and to grpo.py trains to the same weights and metrics; a loop of one's own runs
through grpo.py's main() and resumes bit-exactly; a malformed output is one sentence."""

import os
import shutil
import types

import pytest
import torch
from test_update_parity_grpo import assert_same_metrics, no_dropout

import fixed_completions
from conftest import ROOT, make_rl_lab, read_metrics, run_script, weights
from fixed_completions import assert_same_steps, recorded_steps

FUNCS = ROOT / "tests" / "rollout_funcs.py"
G, P, R, T, LR = 4, 2, 8, 0.9, 2e-4  # group, prompts, completion length, temperature, learning rate
SHARED = dict(max_grad_norm=1.0, epsilon=0.2, seed=3)
CASES = {
    # name: flags common to both sides; two optimizer steps each
    "env_mask_kl": dict(loss_type="dapo", beta=0.1, per_device_train_batch_size=8),
    "off_policy_mask": dict(
        loss_type="grpo", beta=0.0, per_device_train_batch_size=8, off_policy_mask_threshold=0.5
    ),
    "iterations_truncated": dict(
        loss_type="dr_grpo", beta=0.05, per_device_train_batch_size=8, num_iterations=2,
        mask_truncated_completions=True,
    ),
    # logprobs None: the off-policy mask reads the old logprobs (the second pass is off-policy)
    "unknown_logprobs": dict(
        loss_type="grpo", beta=0.0, per_device_train_batch_size=8, num_iterations=2,
        off_policy_mask_threshold=1e-4,
    ),
}  # fmt: skip
FUNC = {"unknown_logprobs": "unknown_logprobs"}  # the case's rollout_func (else fixed)


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The RL lab (text prompts of different lengths, its policy with attention dropout 0, as TRL trains it)."""
    out = make_rl_lab(world, tmp_path_factory.mktemp("lab"), num_prompts=P)
    no_dropout(out / "policy")
    return out


def ours(lab, out, flags: dict, steps: int, func: str = "fixed"):
    """grpo.py's main() with --rollout_func func -> (weights after each step, logged metrics)."""
    argv = ["tests/fixed_run.py", "grpo.py", "--model_name_or_path", str(lab / "policy"),
            "--dataset_name", str(lab / "prompts.jsonl"), "--rollout_func", f"{FUNCS}:{func}",
            "--reward_funcs", f"{FUNCS}:shape", f"{FUNCS}:with_bonus",
            "--num_generations", str(G), "--max_completion_length", str(R), "--temperature", str(T),
            "--max_steps", str(steps), "--output_dir", str(out / "model"), "--learning_rate", str(LR),
            "--logging_dir", str(out / "runs"), "--run_name", "ours", "--num_sample_generations", "0"]  # fmt: skip
    for key, value in {**SHARED, **flags}.items():
        argv += [f"--{key}", str(value)]
    (out / "counter").mkdir(parents=True)
    run_script(argv, env={"FIXED_COMPLETIONS": str(out / "counter"), "STEPS_OUT": str(out / "steps")})
    return recorded_steps(out / "steps"), read_metrics(out / "runs" / "ours")


def build_trainer(spec: dict):
    """TRL 1.16's GRPOTrainer(rollout_func=spec's func) on the same model, prompts, rewards and flags."""
    fixed_completions.trl_without_vllm()
    import rollout_funcs
    import trl
    from datasets import load_dataset

    lab, out = spec["lab"], spec["out"]
    config = trl.GRPOConfig(
        output_dir=f"{out}/trl", use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        num_generations=G, max_completion_length=R, temperature=T, max_steps=spec["steps"], learning_rate=LR,
        logging_steps=1, disable_dropout=True, gradient_checkpointing=False, lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.0, optim="adamw_torch", **spec["flags"],
    )  # fmt: skip
    return trl.GRPOTrainer(
        model=f"{lab}/policy",
        reward_funcs=[rollout_funcs.shape, rollout_funcs.with_bonus],
        args=config,
        train_dataset=load_dataset("json", data_files=f"{lab}/prompts.jsonl", split="train"),
        rollout_func=getattr(rollout_funcs, spec["func"]),
    )


@pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")
@pytest.mark.parametrize("case", CASES)
def test_the_same_rollout_func_trains_as_trls(lab, tmp_path, case):
    """TRL's GRPOTrainer(rollout_func=fixed) and grpo.py --rollout_func fixed: the same parameters after each
    step and the same loss, grad norm, rewards (one reads the extra field `bonus`), lengths (env_mask's 1s)..."""
    flags, steps, func = CASES[case], 2, FUNC.get(case, "fixed")
    our_steps, our_log = ours(lab, tmp_path / "ours", flags, steps, func)
    spec = dict(lab=str(lab), out=str(tmp_path), flags={**SHARED, **flags}, steps=steps, func=func)
    trl_steps, trl_log = fixed_completions.trl_train(build_trainer, "test_rollout_func:build_trainer", spec)
    assert_same_metrics(our_log, trl_log, flags.get("gradient_accumulation_steps", 1) == 1)
    assert all(line["rewards/with_bonus/mean"] > 0.3 for line in our_log)  # the bonus reached the reward
    assert_same_steps(our_steps, trl_steps, weights(lab / "policy"))
    start = weights(lab / "policy")
    assert all((our_steps[-1][n] - start[n]).abs().max() > LR / 2 for n in our_steps[-1])


# ------------------------------------------------------------------------- a loop of one's own, through main()
@pytest.fixture(scope="module")
def chat_lab(world, tmp_path_factory):
    """Conversational prompts (a training and a test split) for the tiny world's tool policy."""
    import json

    out = tmp_path_factory.mktemp("chat_lab")
    (out / "splits").mkdir()
    rows = [
        {"prompt": [{"role": "user", "content": f"What is the code of {name}?"}]}
        for name in "abcd wxyz".split()
    ]
    for split in ("train", "test"):
        with open(out / "splits" / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows * 2)
    return out


def chat_run(world, lab, out, *extra, held_out=True, script="grpo.py"):
    evaluation = ["--dataset_test_split", "test", "--eval_steps", "2", "--num_generations_eval", "2"]
    flags = [
        script, "--model_name_or_path", str(world / "policy_tools"), "--dataset_name", str(lab / "splits"),
        *(evaluation if held_out else []),
        "--rollout_func", f"{FUNCS}:two_turns", "--reward_funcs", f"{FUNCS}:said_again",
        "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "24",
        "--temperature", "0.8", "--learning_rate", "1e-3", "--max_steps", "4", "--num_sample_generations", "0",
        "--output_dir", str(out / "model"), "--logging_dir", str(out / "runs"), "--run_name", "r", "--seed", "5",
        *extra,
    ]  # fmt: skip
    return run_script(flags, timeout=600)


def test_a_loop_of_ones_own_trains_evaluates_and_resumes_exactly(world, chat_lab, tmp_path):
    """grpo.py --rollout_func two_turns (transformers' generate on torch's global generator, an inserted text
    masked out, an extra field `turns` read by the reward): training and held-out metrics are logged, only the
    sampled tokens count in the lengths; a resume from a checkpoint is bit-exact and a run without the held-out split
    trains the same (each call's global generators are seeded by its step, the held-out ones apart)."""
    chat_run(world, chat_lab, tmp_path / "whole", "--save_steps", "2")
    metrics = read_metrics(tmp_path / "whole" / "runs" / "r")
    training = [m for m in metrics if "loss" in m]
    assert len(training) == 4 and all(m["rewards/said_again/mean"] >= 0.5 for m in training)
    assert all(m["completions/mean_length"] <= 24 - 2 for m in training)  # " Again:" is not the model's
    held_out = [m for m in metrics if "eval/reward" in m]
    assert len(held_out) == 2 and all(m["eval/reward"] >= 0.5 for m in held_out)
    checkpoint = str(tmp_path / "whole" / "model" / "checkpoint-2")
    chat_run(world, chat_lab, tmp_path / "again", "--save_steps", "2", "--resume_from_checkpoint", checkpoint)
    whole, resumed = weights(tmp_path / "whole" / "model"), weights(tmp_path / "again" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    start = weights(world / "policy_tools")
    assert any(not torch.equal(whole[k], start[k]) for k in whole)
    chat_run(world, chat_lab, tmp_path / "no_eval", held_out=False)
    no_eval = weights(tmp_path / "no_eval" / "model")
    assert all(torch.equal(whole[k], no_eval[k]) for k in whole)


def test_rloo_trains_on_a_loop_of_ones_own_and_resumes_exactly(world, chat_lab, tmp_path):
    """rloo.py --rollout_func two_turns (TRL 1.16 flags, as grpo.py's): the extra field reaches the reward, the
    held-out split is evaluated through the function, the old logprobs are the policy's (the ratio of the first
    update's pass is 1 whatever logprobs the function returned), and a resume is bit-exact."""
    chat_run(world, chat_lab, tmp_path / "whole", "--save_steps", "2", script="rloo.py")
    metrics = read_metrics(tmp_path / "whole" / "runs" / "r")
    training = [m for m in metrics if "objective/scores" in m]
    assert len(training) == 4 and all(m["objective/scores"] >= 0.5 for m in training)  # turns reached it
    assert all(m["val/ratio"] == pytest.approx(1.0, abs=1e-4) for m in training)
    held_out = [m for m in metrics if "eval/objective/scores" in m]
    assert len(held_out) == 2 and all(m["eval/objective/scores"] >= 0.5 for m in held_out)
    checkpoint = str(tmp_path / "whole" / "model" / "checkpoint-2")
    resume = ["--save_steps", "2", "--resume_from_checkpoint", checkpoint]
    chat_run(world, chat_lab, tmp_path / "again", *resume, script="rloo.py")
    whole, resumed = weights(tmp_path / "whole" / "model"), weights(tmp_path / "again" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    start = weights(world / "policy_tools")
    assert any(not torch.equal(whole[k], start[k]) for k in whole)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "name,says",
    [
        ("no_logprobs", "returned no logprobs; a rollout_func returns prompt_ids, completion_ids, logprobs."),
        ("one_short", ": completion_ids has 7 entries for the 8 prompts it was given (each of the batch's prompts "
                      "repeated num_generations times: one entry each)."),
        ("ragged_mask", ": env_mask[1] has "),
    ],
)  # fmt: skip
def test_a_malformed_output_is_one_sentence(lab, tmp_path, name, says):
    """A rollout_func that leaves out a key or returns lists of the wrong length: exit 2, one line, no traceback."""
    flags = [
        "grpo.py", "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--rollout_func", f"{FUNCS}:{name}", "--reward_funcs", f"{FUNCS}:shape", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--max_steps", "1",
        "--output_dir", str(tmp_path / "out"), "--logging_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    proc = run_script(flags, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpo.py: error: --rollout_func {FUNCS}:{name}") and says in last, last


def test_flags_it_cannot_take_are_refused_and_a_copy_without_the_module_names_it(lab, tmp_path):
    """--rollout_func with --tools (or --environment_factory, --use_vllm, --filter_groups) is one sentence before
    any model is loaded; a bad spec names the flag; a copy of grpo.py without utils/rollout_func.py says which file
    to copy, and its core does not need it."""
    import readability

    import utils.rollout_func

    base = dict(tools=None, environment_factory=None, use_vllm=False, filter_groups=False, rollout_func="x")
    for flag, value in (("tools", ["t.py:f"]), ("use_vllm", True), ("filter_groups", True)):
        with pytest.raises(ValueError, match=f"leave out --{flag} "):
            utils.rollout_func.check_args(types.SimpleNamespace(**{**base, flag: value}))
    with pytest.raises(ValueError, match="^--rollout_func file nowhere.py does not exist"):
        utils.rollout_func.RolloutFunc(types.SimpleNamespace(**{**base, "rollout_func": "nowhere.py:f"}))
    assert "utils/rollout_func.py" not in readability.footprint(ROOT, ROOT / "grpo.py")
    assert "utils/rollout_func.py" in readability.optional(ROOT, ROOT / "grpo.py")
    copy = tmp_path / "copy"
    (copy / "utils").mkdir(parents=True)
    for module in ["grpo.py", *readability.footprint(ROOT, ROOT / "grpo.py")]:
        shutil.copy(ROOT / module, copy / module)
    flags = [
        "grpo.py", "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{FUNCS}:shape", "--rollout_func", f"{FUNCS}:fixed", "--output_dir", str(tmp_path / "o"),
    ]  # fmt: skip
    proc = run_script(flags, cwd=copy, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("grpo.py: error: --rollout_func needs utils/rollout_func.py, which this copy lacks")
    )
    assert os.path.isfile(FUNCS)
