"""rloo.py's own training loop against TRL 1.16's RLOOTrainer.train(), step by step.

Both sides start from the same weights, read the same prompts and get the same completions (tests/fixed_run.py
gives them to rloo.py's main(), tests/fixed_completions.py's stand-in to TRL's sampler); the parameters after
every optimizer step must agree, and so must the metrics: the one name both log (`grad_norm`, and
`rewards/<f>/mean` with two reward functions) and the pairs in LOGGED_AS. rloo.py logs once an update, TRL once
an optimizer step: our line is the mean of TRL's lines of that update. Each generation covers the whole dataset
and each optimizer step a whole pass over a generation, so the two sides' different shuffles (and rows: ours
completion-major, TRL's prompt-major) cannot make them differ; what is compared is everything the loops do with
the rows: rewards and their weights, clamping, the KL penalty (k1, summed over the completion) and its sign,
the leave-one-out baseline, the normalisation of the advantages, masked truncated completions, the sequence-level
ratio and its clipping, the loss and its scale under accumulation and across processes, AdamW and the schedule.
AdamW after gradient clipping is blind to a uniform scale of the gradient (a baseline that counts the completion
itself scales every advantage by (k-1)/k, a loss divided by the accumulation twice halves it): the logged loss and
gradient norm catch those. The cases with several epochs over a generation train at LR / 10, so that the second
epoch's ratios fall both inside and outside the clip range, and with a KL coefficient of 1: the policy is its
reference until the first step, and after one step of LR / 10 the KL is small (its sign shows in the weights
at 0.1 by a hair).

TRL 0.19's dialect (`--rloo_k --kl_coef --num_ppo_epochs --total_episodes --reward_fn`, 0.19's defaults) maps
onto a TRL 1.16 configuration wherever 0.19's rules and 1.16's meet: test_0_19_dialect_equals_trls runs such a
command line against RLOOConfig(num_generations=, beta=, num_iterations=, max_steps=, max_grad_norm=0). What has
no TRL 1.16 counterpart (`--token_level_kl`, `--whiten_rewards`, `--normalize_reward`, `--normalize_advantage`'s
whitening, `--missing_eos_penalty`, no stop at EOS without `--stop_token eos`) is covered by tests/test_rloo.py's
loops written from the equations and tests/test_trl_parity_rloo.py.

Under TRL 1.16's flags the linear schedule decays after every optimizer step, as TRL 1.16's (the accumulation
case runs it over 4 steps in 2 updates); under TRL 0.19's it is set once an update, as TRL 0.19's RLOOTrainer
stepped its scheduler once a batch, so the 0.19 case uses a constant learning rate (docs/trl_defaults.md)."""

import json
import os

import pytest

import fixed_completions
from conftest import make_rl_lab, read_metrics, run_script, run_torchrun, weights
from fixed_completions import assert_same_steps, recorded_steps

G, P, R, T, LR = 4, 2, 8, 0.9, 2e-4  # group, prompts, completion length, temperature, learning rate
EPS = 1e-6  # AdamW epsilon of the 0.19 case: rounding in a near-0 gradient is not a full step (CPU-dependent)
REWARD = '''
def shape(completions, **kwargs):
    """Varies within a group: the completion's distinct characters and length."""
    return [len(set(c)) / 5 + len(c) / 40 for c in completions]


def vowels(completions, **kwargs):
    """The share of vowels; None (no reward) for a completion under 12 characters."""
    return [sum(ch in "aeiou" for ch in c) / len(c) if len(c) >= 12 else None for c in completions]
'''
SHARED = dict(learning_rate=LR, max_grad_norm=1.0, epsilon=0.2, seed=3)
CASES = {
    # name: (flags common to both sides in TRL 1.16's names, optimizer steps)
    "no_kl_normalized_clamped_weighted": (
        dict(beta=0.0, per_device_train_batch_size=8, normalize_advantages=True, reward_clip_range=(1.0, 2.6),
             reward_funcs=["shape", "vowels"], reward_weights=[1.0, -2.0]), 2,
    ),
    "kl_accumulation_iterations_truncated": (
        dict(beta=1.0, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2,
             mask_truncated_completions=True, epsilon_high=0.28, learning_rate=LR / 10), 4,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The RL lab's policy (EOS sampled at varied places, dropout in its config), P prompts of different
    lengths (left padding) and the reward functions."""
    out = make_rl_lab(world, tmp_path_factory.mktemp("lab"), num_prompts=P)
    (out / "reward.py").write_text(REWARD)
    no_dropout(out / "policy")
    return out


def no_dropout(path):
    """TRL's disable_dropout zeroes nn.Dropout modules only: a Llama reads config.attention_dropout in its
    attention call, so TRL trains with it (rloo.py zeroes it): the lab's 0.1 is set to 0 here."""
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.0
    (path / "config.json").write_text(json.dumps(config))


def command_line(flags: dict) -> list[str]:
    argv = []
    for key, value in flags.items():
        values = value if isinstance(value, list | tuple) else [value]
        argv += [f"--{key}", *map(str, values)]
    return argv


def ours_1_16(lab, flags: dict, steps: int) -> list[str]:
    """rloo.py's command line in TRL 1.16's flags."""
    flags = {**SHARED, **flags}
    funcs = [f"{lab / 'reward.py'}:{name}" for name in flags.pop("reward_funcs", ["shape"])]
    return ["--model_name_or_path", str(lab / "policy"), "--reward_funcs", *funcs, "--num_generations", str(G),
            "--max_completion_length", str(R), "--temperature", str(T), "--max_steps", str(steps),
            *command_line(flags)]  # fmt: skip


def ours(lab, out, argv: list[str], nproc: int = 1):
    """rloo.py's main() with fixed completions -> (weights after each step, logged metrics)."""
    argv = ["tests/fixed_run.py", "rloo.py", *argv, "--dataset_name", str(lab / "prompts.jsonl"),
            "--output_dir", str(out / "model"), "--logging_dir", str(out / "runs"), "--run_name", "ours",
            "--num_sample_generations", "0"]  # fmt: skip
    env = {"FIXED_COMPLETIONS": str(out / "counter"), "STEPS_OUT": str(out / "steps")}
    (out / "counter").mkdir(parents=True)
    if nproc == 1:
        run_script(argv, env=env)
    else:
        os.environ.update(env)
        try:
            run_torchrun(argv, nproc=nproc)
        finally:
            for key in env:
                del os.environ[key]
    return recorded_steps(out / "steps"), read_metrics(out / "runs" / "ours")


def trl_spec(lab, out, flags: dict, steps: int) -> dict:
    return dict(lab=str(lab), out=str(out), flags={**SHARED, **flags}, steps=steps)


def build_trainer(spec: dict):
    """TRL 1.16's RLOOTrainer on the same model, prompts, rewards and flags, sampling the fixed completions."""
    import importlib.util

    import fixed_completions

    fixed_completions.trl_without_vllm()
    import trl
    from datasets import load_dataset

    lab, out, flags = spec["lab"], spec["out"], dict(spec["flags"])
    module_spec = importlib.util.spec_from_file_location("reward", f"{lab}/reward.py")
    reward = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(reward)
    reward_funcs = [getattr(reward, name) for name in flags.pop("reward_funcs", ["shape"])]
    peft_config = fixed_completions.trl_lora(trl.trainer.rloo_trainer, flags, flags["seed"])
    config = trl.RLOOConfig(
        output_dir=f"{out}/trl", use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        num_generations=G, max_completion_length=R, temperature=T, max_steps=spec["steps"],
        **{"lr_scheduler_type": "linear", **flags}, warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        logging_steps=1, disable_dropout=True, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = trl.RLOOTrainer(
        model=f"{lab}/policy",
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=load_dataset("json", data_files=f"{lab}/prompts.jsonl", split="train"),
        peft_config=peft_config,
    )
    counter = f"{out}/trl_counter"
    os.makedirs(counter, exist_ok=True)
    trainer._generate_single_turn = fixed_completions.trl_generate_ids(trainer, counter, R)
    return trainer


def theirs(spec: dict, nproc: int = 1):
    """TRL's train() (in this process, or on `nproc` processes) -> (weights after each step, log history)."""
    return fixed_completions.trl_train(build_trainer, "test_update_parity_rloo:build_trainer", spec, nproc)


# Our metric: TRL's name for it. The loss, entropy and clip fraction are means over the update's micro-batches on
# our side, over the step's on TRL's; the entropy and clip fraction are token or row means of a micro-batch, so
# they depend on which rows the shuffle put together: compared only when a step is one micro-batch.
LOGGED_AS = {
    "grad_norm": "grad_norm",
    "loss/policy_avg": "loss",
    "objective/scores": "reward",
    "learning_rate": "learning_rate",
}
PER_MICRO_BATCH = {"policy/entropy_avg": "entropy", "policy/clipfrac_avg": "clip_ratio/region_mean"}


def assert_same_metrics(our_log: list[dict], trl_log: list[dict], one_micro_batch: bool, abs_tol=1e-6):
    """Each of our updates against the mean of TRL's lines of that update's optimizer steps."""
    assert len(trl_log) % len(our_log) == 0, (len(our_log), len(trl_log))
    steps_per_update = len(trl_log) // len(our_log)
    pairs = {**LOGGED_AS, **(PER_MICRO_BATCH if one_micro_batch else {})}
    compared = 0
    for update, mine in enumerate(our_log):
        lines = trl_log[update * steps_per_update : (update + 1) * steps_per_update]
        shared = {name: name for name in mine if name.startswith("rewards/")}
        for our_name, trl_name in {**pairs, **shared}.items():
            values = [line[trl_name] for line in lines if trl_name in line]
            if our_name in mine and values:
                trl = sum(values) / len(values)
                assert mine[our_name] == pytest.approx(trl, rel=1e-4, abs=abs_tol), (
                    update,
                    our_name,
                    mine,
                    lines,
                )
                compared += 1
    assert compared >= 4 * len(our_log)


def assert_moved(our_steps, start, lr=LR):
    """The run moved the weights: a step that changed nothing would compare equal trivially."""
    assert all((our_steps[0][n] - start[n]).abs().max() > lr / 2 for n in our_steps[0])


@pytest.mark.parametrize("case", CASES)
def test_each_step_equals_trls(lab, tmp_path, case):
    """The same parameters after every optimizer step, and the same loss, grad norm, rewards..."""
    flags, steps = CASES[case]
    our_steps, our_log = ours(lab, tmp_path / "ours", ours_1_16(lab, flags, steps))
    trl_steps, trl_log = theirs(trl_spec(lab, tmp_path, flags, steps))
    one_micro_batch = flags.get("gradient_accumulation_steps", 1) == 1 and not flags.get(
        "mask_truncated_completions"
    )
    assert_same_metrics(our_log, trl_log, one_micro_batch)
    assert_same_steps(our_steps, trl_steps, weights(lab / "policy"))
    assert_moved(our_steps, weights(lab / "policy"), flags.get("learning_rate", LR))


def test_0_19_dialect_equals_trls(lab, tmp_path):
    """A TRL 0.19 command line (its names, its defaults: no gradient clipping; --total_episodes) as the TRL 1.16
    configuration its rules mean: two updates of two epochs each."""
    argv = ["--sft_model_path", str(lab / "policy"), "--reward_fn", f"{lab / 'reward.py'}:shape", "--rloo_k",
            str(G), "--kl_coef", "1.0", "--num_ppo_epochs", "2", "--response_length", str(R), "--temperature",
            str(T), "--learning_rate", str(LR / 10), "--stop_token", "eos", "--total_episodes", str(2 * G * P),
            "--per_device_train_batch_size", str(G * P), "--lr_scheduler_type", "constant", "--seed", "3",
            "--adam_epsilon", str(EPS)]  # fmt: skip
    flags = dict(beta=1.0, per_device_train_batch_size=G * P, num_iterations=2, max_grad_norm=0.0, epsilon=0.2,
                 lr_scheduler_type="constant", learning_rate=LR / 10, adam_epsilon=EPS, seed=3)  # fmt: skip
    our_steps, our_log = ours(lab, tmp_path / "ours", argv)
    trl_steps, trl_log = theirs(dict(lab=str(lab), out=str(tmp_path), flags=flags, steps=4))
    assert_same_metrics(our_log, trl_log, one_micro_batch=True)
    assert_same_steps(our_steps, trl_steps, weights(lab / "policy"))
    assert_moved(our_steps, weights(lab / "policy"), LR / 10)


def test_two_processes_equal_trls(lab, tmp_path):
    """Two processes (gloo): rewards and advantages gathered, gradients averaged, as TRL."""
    flags = dict(beta=0.1, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    our_steps, our_log = ours(lab, tmp_path / "ours", ours_1_16(lab, flags, 2), nproc=2)
    trl_steps, trl_log = theirs(trl_spec(lab, tmp_path, flags, 2), nproc=2)
    assert_same_metrics(our_log, trl_log, one_micro_batch=False)
    assert_same_steps(our_steps, trl_steps, weights(lab / "policy"))


def test_lora_equals_trls(lab, tmp_path):
    """--use_peft against RLOOTrainer(peft_config=...): the adapter alone trained, the reference the policy with
    its adapter off. The second rollout's KL (coefficient 1) is taken against it after two steps moved the
    adapter; a reference that kept the adapter on would see no KL there."""
    flags = dict(beta=1.0, per_device_train_batch_size=8, num_iterations=2, learning_rate=LR * 3,
                 **fixed_completions.LORA)  # fmt: skip
    our_steps, our_log = ours(lab, tmp_path / "ours", [*ours_1_16(lab, flags, 4), "--use_peft"])
    trl_steps, trl_log = theirs(trl_spec(lab, tmp_path, flags, 4))
    # a loss near 0 is a difference of terms near 1: float32 rounding of those is about 1e-6 of it
    assert_same_metrics(our_log, trl_log, one_micro_batch=True, abs_tol=1e-5)
    start = fixed_completions.lora_start(lab / "policy", SHARED["seed"])
    assert all(".lora_" in name for name in our_steps[0])  # the base's weights are not trained
    assert_same_steps(our_steps, trl_steps, start)
    assert all((our_steps[-1][n] - start[n]).abs().max() > LR for n in start)
    kl = [line["objective/kl"] for line in our_log]
    assert kl[0] == 0 and abs(kl[1]) > 1e-4, kl
