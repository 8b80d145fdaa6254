"""grpo.py's own training loop against TRL 1.16's GRPOTrainer.train(), step by step.

Both sides start from the same weights, read the same prompts and get the same completions (tests/fixed_run.py
gives them to grpo.py's main(), tests/fixed_completions.py's stand-in to TRL's sampler); the parameters after
every optimizer step and the metrics both log under one name must agree. Each generation covers the whole
dataset and each optimizer step a whole pass over a generation, so the two sides' different shuffles cannot make
them differ; what is compared is everything the loops do with the rows: rewards, advantages, old and reference
logprobs, the loss and its normalisation under accumulation, the KL, clipping, the schedule and AdamW."""

import json
import os

import pytest

import fixed_completions
from conftest import make_rl_lab, read_metrics, run_script, run_torchrun, weights
from fixed_completions import assert_same_steps, recorded_steps

G, P, R, T, LR = 4, 2, 8, 0.9, 2e-4  # group, prompts, completion length, temperature, learning rate
REWARD = '''
def shape(completions, **kwargs):
    """Varies within a group: the completion's distinct characters and length."""
    return [len(set(c)) / 5 + len(c) / 40 for c in completions]
'''
SHARED = dict(max_grad_norm=1.0, epsilon=0.2, seed=3)
CASES = {
    # name: (flags common to both sides, optimizer steps)
    "dapo": (dict(loss_type="dapo", beta=0.0, per_device_train_batch_size=8), 2),
    "grpo_kl_accumulation": (
        dict(loss_type="grpo", beta=0.2, per_device_train_batch_size=4, gradient_accumulation_steps=2), 2,
    ),
    "dr_grpo_iterations_truncated": (
        dict(loss_type="dr_grpo", beta=0.1, per_device_train_batch_size=8, num_iterations=2,
             mask_truncated_completions=True, use_bias_correction_kl=False), 4,
    ),
    "bnpo_delta_batch_scale": (
        dict(loss_type="bnpo", beta=0.05, per_device_train_batch_size=8, delta=1.5, epsilon_high=0.28,
             scale_rewards="batch"), 2,
    ),
    "cispo": (dict(loss_type="cispo", beta=0.1, per_device_train_batch_size=8, epsilon_high=1.2), 2),
    "sapo_no_scale": (dict(loss_type="sapo", beta=0.0, per_device_train_batch_size=8, scale_rewards="none"), 2),
    "gspo_iterations_kl": (
        dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1, per_device_train_batch_size=8,
             num_iterations=2), 4,
    ),
    "luspo_sequence_accumulation": (
        dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.1, per_device_train_batch_size=4,
             gradient_accumulation_steps=2), 2,
    ),
    "vespo_iterations_kl": (
        dict(loss_type="vespo", beta=0.1, per_device_train_batch_size=8, num_iterations=2), 4,
    ),
    "top_entropy_quantile": (dict(loss_type="dapo", beta=0.1, per_device_train_batch_size=8, top_entropy_quantile=0.3), 2),
    "off_policy_mask_iterations": (
        dict(loss_type="grpo", beta=0.0, per_device_train_batch_size=8, num_iterations=2,
             off_policy_mask_threshold=1e-7), 4,
    ),
    "cosine_warmup_decay_betas": (
        dict(loss_type="dapo", beta=0.0, per_device_train_batch_size=8, lr_scheduler_type="cosine", warmup_steps=0.25,
             weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, optim="adamw_torch"), 4,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The RL lab's policy (EOS sampled at varied places, dropout in its config), P prompts of different
    lengths (left padding) and the reward function."""
    out = make_rl_lab(world, tmp_path_factory.mktemp("lab"), num_prompts=P)
    (out / "reward.py").write_text(REWARD)
    no_dropout(out / "policy")
    return out


def no_dropout(path):
    """TRL's disable_dropout zeroes nn.Dropout modules only: a Llama reads config.attention_dropout in its
    attention call, so TRL trains with it (grpo.py zeroes it): the lab's 0.1 is set to 0 here."""
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.0
    (path / "config.json").write_text(json.dumps(config))


def ours(lab, out, flags: dict, steps: int, nproc: int = 1):
    """grpo.py's main() with fixed completions -> (weights after each step, logged metrics)."""
    argv = ["tests/fixed_run.py", "grpo.py", "--model_name_or_path", str(lab / "policy"),
            "--dataset_name", str(lab / "prompts.jsonl"), "--reward_funcs", f"{lab / 'reward.py'}:shape",
            "--num_generations", str(G), "--max_completion_length", str(R), "--temperature", str(T),
            "--max_steps", str(steps), "--output_dir", str(out / "model"),
            "--logging_dir", str(out / "runs"), "--run_name", "ours", "--num_sample_generations", "0"]  # fmt: skip
    for key, value in {"learning_rate": LR, **SHARED, **flags}.items():
        argv += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
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
    """TRL 1.16's GRPOTrainer on the same model, prompts, reward and flags, sampling the fixed completions."""
    import importlib.util

    import trl
    from datasets import load_dataset

    import fixed_completions

    lab, out, flags = spec["lab"], spec["out"], dict(spec["flags"])
    module_spec = importlib.util.spec_from_file_location("reward", f"{lab}/reward.py")
    reward = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(reward)
    peft_config = fixed_completions.trl_lora(trl.trainer.grpo_trainer, flags, flags["seed"])
    config = trl.GRPOConfig(
        output_dir=f"{out}/trl", use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        num_generations=G, max_completion_length=R, temperature=T, max_steps=spec["steps"],
        logging_steps=1, disable_dropout=True, gradient_checkpointing=False,
        **{"learning_rate": LR, "lr_scheduler_type": "linear", "warmup_steps": 0, "weight_decay": 0.0, "optim": "adamw_torch", **flags},
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=f"{lab}/policy",
        reward_funcs=[reward.shape],
        args=config,
        train_dataset=load_dataset("json", data_files=f"{lab}/prompts.jsonl", split="train"),
        peft_config=peft_config,
    )
    counter = f"{out}/trl_counter"
    os.makedirs(counter, exist_ok=True)
    trainer._generate_single_turn = fixed_completions.trl_generate(trainer, counter, R)
    return trainer


def theirs(spec: dict, nproc: int = 1):
    """TRL's train() (in this process, or on `nproc` processes) -> (weights after each step, log history)."""
    return fixed_completions.trl_train(build_trainer, "test_update_parity_grpo:build_trainer", spec, nproc)


# Metrics both log under one name. Token means of a micro-batch (kl, entropy, clip ratios) are averaged over the
# step's micro-batches on both sides, so they depend on which rows the shuffle put together: compared only when a
# step is one micro-batch.
COMPARED = ["loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/shape/mean",
            "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio"]  # fmt: skip
PER_MICRO_BATCH = ["kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                   "cispo_clip_ratio", "vespo/phi_seq_mean"]  # fmt: skip


def assert_same_metrics(our_log: list[dict], trl_log: list[dict], one_micro_batch: bool):
    assert len(our_log) == len(trl_log), (len(our_log), len(trl_log))
    names = COMPARED + (PER_MICRO_BATCH if one_micro_batch else [])
    compared = 0
    for step, (mine, trl) in enumerate(zip(our_log, trl_log), 1):
        for name in names:
            if name in mine and name in trl:
                assert mine[name] == pytest.approx(trl[name], rel=1e-4, abs=1e-6), (step, name, mine, trl)
                compared += 1
    assert compared >= 8 * len(our_log)


@pytest.mark.parametrize("case", CASES)
def test_each_step_equals_trls(lab, tmp_path, case):
    """The same parameters after every optimizer step, and the same loss, grad norm, KL, rewards..."""
    flags, steps = CASES[case]
    our_steps, our_log = ours(lab, tmp_path / "ours", flags, steps)
    trl_steps, trl_log = theirs(trl_spec(lab, tmp_path, flags, steps))
    assert_same_metrics(our_log, trl_log, flags.get("gradient_accumulation_steps", 1) == 1)
    assert_same_steps(our_steps, trl_steps, weights(lab / "policy"))
    # the run moved the weights: a step that changed nothing would compare equal trivially
    start = weights(lab / "policy")
    assert all(
        (our_steps[-1][n] - start[n]).abs().max() > LR / 2 for n in our_steps[-1]
    )  # a warmup starts at 0


def test_two_processes_equal_trls(lab, tmp_path):
    """Two processes (gloo): the loss normalised over both processes' tokens, each process's advantages from
    the gathered rewards (their batch std too), as TRL."""
    flags = dict(loss_type="dapo", beta=0.1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                 scale_rewards="batch")  # fmt: skip
    our_steps, our_log = ours(lab, tmp_path / "ours", flags, 2, nproc=2)
    trl_steps, trl_log = theirs(trl_spec(lab, tmp_path, flags, 2), nproc=2)
    assert_same_metrics(our_log, trl_log, one_micro_batch=False)
    assert_same_steps(our_steps, trl_steps, weights(lab / "policy"))


def test_lora_equals_trls(lab, tmp_path):
    """--use_peft against GRPOTrainer(peft_config=...): the adapter alone trained, the reference the policy with
    its adapter off; the second iteration's KL (beta 0.2) is taken after a step moved the adapter."""
    flags = dict(loss_type="grpo", beta=0.2, per_device_train_batch_size=8, num_iterations=2, learning_rate=LR * 3,
                 adam_epsilon=1e-6,  # rounding in near-0 gradients of a fresh lora_B is not a whole AdamW step
                 use_peft=True, **fixed_completions.LORA)  # fmt: skip
    our_steps, our_log = ours(lab, tmp_path / "ours", flags, 4)
    trl_flags = {key: value for key, value in flags.items() if key != "use_peft"}
    trl_steps, trl_log = theirs(trl_spec(lab, tmp_path, trl_flags, 4))
    assert_same_metrics(our_log, trl_log, one_micro_batch=True)
    start = fixed_completions.lora_start(lab / "policy", SHARED["seed"])
    assert all(".lora_" in name for name in our_steps[0])  # the base's weights are not trained
    assert_same_steps(our_steps, trl_steps, start)
    assert all((our_steps[-1][n] - start[n]).abs().max() > LR for n in start)
    assert our_log[0]["kl"] == 0 and our_log[1]["kl"] > 1e-6, [line["kl"] for line in our_log]
