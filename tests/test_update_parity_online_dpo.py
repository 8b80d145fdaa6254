"""online_dpo.py's own training loop against TRL 1.16's OnlineDPOTrainer.train(), step by step.

Both sides start from the same weights, read the same prompts and get the same completions (tests/fixed_run.py
gives them to online_dpo.py's main(); `model_generate` below stands in for the `generate` call in TRL's
`_generate`, whose prompt tokenization and cut after EOS stay TRL's). The parameters after every optimizer step
and the metrics both log must agree. Each optimizer step covers the whole dataset, so the two sides' different
shuffles cannot make them differ; what is compared is everything the loops do with the pairs: the reward call,
the missing-EOS penalty, which completion is chosen, the reference's and the policy's logprobs, the --max_length
cut, the loss and its mean under accumulation, beta per epoch, clipping, the schedule and AdamW. The annotator is
a reward function: a reward model reads other tokens on each side (TRL's the decoded text encoded again, without
the EOS; ours the policy's ids with it, reward.py's layout: docs/reward_tokenizers.md).

Where TRL 1.16 does something else, on purpose not copied (docs/coming_from_trl.md):
- under gradient accumulation TRL's gradient is `gradient_accumulation_steps` times the mean's: its
  training_step replaces transformers' (which divides the loss, as accelerate is given num_steps=1) and calls
  backward on each micro-batch's mean undivided. Its logged loss is the mean; its grad_norm is compared divided
  by the steps, and the case keeps the norm far above --max_grad_norm so both sides clip to the same step;
- a list of betas: TRL indexes it with the float `state.epoch` and raises a TypeError from the second optimizer
  step on. The test's subclass reads it at the whole epoch, the rule TRL's docs state and ours keeps;
- objective/kl, objective/entropy, objective/non_score_reward and objective/rlhf_reward: TRL sums the logprobs
  of the padding after each EOS into them; ours sums the completion's tokens only. Not compared (they are
  metrics only: TRL's loss masks the padding)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import fixed_completions
from conftest import OFFLINE_ENV, ROOT, make_rl_lab, read_metrics, weights
from fixed_completions import (
    StepRecorder,
    assert_same_steps,
    completion,
    cut_at_eos,
    next_index,
    recorded_steps,
)

pytest.importorskip("trl.experimental.online_dpo")

P, R, T, LR = 8, 8, 0.9, 2e-4  # prompts (52 to 43 tokens), completion length, temperature, learning rate
REWARD = '''
def shape(completions, **kwargs):
    """Distinct characters and length of the completion's text, spaces left out (decoders differ on them)."""
    texts = [c.replace(" ", "") for c in completions]
    return [len(set(t)) / 5 + len(t) / 40 for t in texts]
'''
MAX_GRAD_NORM = 1.0
CASES = {
    # name: flags common to both sides. Two optimizer steps each, the second with the policy off the reference.
    # 56 = 48 prompt tokens + 8: five of the eight prompts lose their first 1 to 4 tokens.
    "sigmoid_max_length_eos_penalty": dict(loss_type="sigmoid", beta=0.1, per_device_train_batch_size=8,
                                           max_length=56, missing_eos_penalty=1.0),
    "ipo_accumulation_betas": dict(loss_type="ipo", beta=[0.5, 0.2], per_device_train_batch_size=4,
                                   gradient_accumulation_steps=2),
}  # fmt: skip
STEPS = 2


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The RL lab's policy (EOS sampled at varied places), P prompts of different lengths (left padding) and the
    reward function."""
    out = make_rl_lab(world, tmp_path_factory.mktemp("lab"), num_prompts=P)
    (out / "reward.py").write_text(REWARD)
    no_dropout(out / "policy")
    return out


def no_dropout(path):
    """TRL's disable_dropout zeroes nn.Dropout modules only: a Llama reads config.attention_dropout in its
    attention call, so TRL would train with it (online_dpo.py zeroes it): the lab's 0.1 is set to 0 here."""
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.0
    (path / "config.json").write_text(json.dumps(config))


def our_argv(lab, out, flags: dict) -> list[str]:
    """tests/fixed_run.py's command line of online_dpo.py with `flags`."""
    argv = ["tests/fixed_run.py", "online_dpo.py", "--model_name_or_path", str(lab / "policy"),
            "--dataset_name", str(lab / "prompts.jsonl"), "--reward_fn", f"{lab / 'reward.py'}:shape",
            "--max_new_tokens", str(R), "--temperature", str(T), "--learning_rate", str(LR),
            "--max_steps", str(STEPS), "--max_grad_norm", str(MAX_GRAD_NORM), "--seed", "3",
            "--output_dir", str(out / "model"), "--logging_dir", str(out / "runs"), "--run_name", "ours",
            "--num_sample_generations", "0"]  # fmt: skip
    for key, value in flags.items():
        argv += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    return argv


def start_ours(lab, out, flags: dict) -> subprocess.Popen:
    """online_dpo.py's main() with fixed completions, started in a process of its own (TRL's side runs meanwhile)."""
    argv = our_argv(lab, out, flags)
    (out / "counter").mkdir(parents=True)
    env = {**os.environ, **OFFLINE_ENV}
    env.update(FIXED_COMPLETIONS=str(out / "counter"), STEPS_OUT=str(out / "steps"))
    with open(out / "log.txt", "w") as log:  # the child keeps its own handle
        return subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def finish_ours(process: subprocess.Popen, out) -> tuple[list[dict], list[dict]]:
    """(weights after each step, logged metrics) of our run."""
    try:
        process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    if process.returncode != 0:
        pytest.fail(f"online_dpo.py exited {process.returncode}:\n{(out / 'log.txt').read_text()[-6000:]}")
    return recorded_steps(out / "steps"), read_metrics(out / "runs" / "ours")


def model_generate(trainer, counter_dir, length: int):
    """A stand-in for the policy's `generate` in TRL 1.16's OnlineDPOTrainer._generate: the prompt rows, then
    each row's fixed completion up to its first EOS, padded to the longest (generate stops once every row has
    ended and pads the finished ones); TRL's truncate_right then masks what follows the EOS."""
    eos_ids, pad_id = list(trainer.eos_token_ids), trainer.processing_class.pad_token_id

    def generate(input_ids, attention_mask, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist()):
            prompt = [t for t, m in zip(ids, mask) if m]
            fixed = completion(prompt, next_index(counter_dir, prompt), length, eos_ids[0])
            rows.append(cut_at_eos(fixed, eos_ids))
        width = max(map(len, rows))
        padded = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=input_ids.dtype)
        return torch.cat([input_ids, padded.to(input_ids.device)], 1)

    return generate


def trainer_class():
    """TRL's OnlineDPOTrainer, with a list of betas read at the whole epoch (TRL 1.16 indexes the list with the
    float state.epoch, a TypeError from the second optimizer step on); one beta is TRL's own property."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    class WholeEpochBeta(OnlineDPOTrainer):
        @property
        def beta(self):
            if not isinstance(self._beta, list):
                return self._beta
            return self._beta[min(int(self.state.epoch), len(self._beta) - 1)]

    return WholeEpochBeta


def theirs(lab, out, flags: dict) -> tuple[list[dict], list[dict]]:
    """TRL's train() in this process -> (weights after each step, log history)."""
    import trl.experimental.utils
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig

    module_spec = importlib.util.spec_from_file_location("reward", lab / "reward.py")
    reward = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(reward)
    flags = {key: value for key, value in flags.items() if key != "use_peft"}
    peft_config = fixed_completions.trl_lora(trl.experimental.utils, flags, seed=3)
    torch.manual_seed(0)
    config = OnlineDPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        max_new_tokens=R, temperature=T, learning_rate=LR, max_steps=STEPS, max_grad_norm=MAX_GRAD_NORM, seed=3,
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, optim="adamw_torch", logging_steps=1,
        disable_dropout=True, gradient_checkpointing=False, **flags,
    )  # fmt: skip
    trainer = trainer_class()(
        model=str(lab / "policy"),
        reward_funcs=[reward.shape],
        args=config,
        train_dataset=load_dataset("json", data_files=str(lab / "prompts.jsonl"), split="train"),
        processing_class=AutoTokenizer.from_pretrained(lab / "policy"),
        peft_config=peft_config,
    )
    (out / "trl_counter").mkdir(parents=True)
    trainer.model.generate = model_generate(trainer, out / "trl_counter", R)
    recorder = StepRecorder(out / "trl_steps", model=trainer.model)
    try:
        trainer.train()
    finally:
        recorder.remove()
    return recorded_steps(out / "trl_steps"), [h for h in trainer.state.log_history if "loss" in h]


# Metrics both log (ours -> TRL's name). TRL logs the mean over a step's micro-batches of each micro-batch's mean
# over its pairs, which is the mean over the pairs, as ours, since the micro-batches hold equally many.
COMPARED = {name: name for name in ["grad_norm", "beta", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "rewards/accuracies", "logps/chosen", "logps/rejected", "val/contain_eos_token", "objective/scores",
            "objective/scores_margin"]} | {"loss/dpo_avg": "loss", "learning_rate": "learning_rate"}  # fmt: skip


def assert_same_metrics(our_log: list[dict], trl_log: list[dict], accumulation: int):
    assert len(our_log) == len(trl_log) == STEPS, (len(our_log), len(trl_log))
    for step, (mine, trl) in enumerate(zip(our_log, trl_log), 1):
        trl = {**trl, "grad_norm": trl["grad_norm"] / accumulation}  # TRL's accumulated sum of means
        for name, trl_name in COMPARED.items():
            rounding = 6e-5 if trl_name == "loss" else 1e-6  # TRL rounds its loss to 4 places
            assert mine[name] == pytest.approx(trl[trl_name], rel=1e-4, abs=rounding), (step, name)


@pytest.mark.parametrize("case", CASES)
def test_each_step_equals_trls(lab, tmp_path, case):
    """The same parameters after every optimizer step, and the same loss, grad norm, implicit rewards, scores..."""
    flags = CASES[case]
    process = start_ours(lab, tmp_path / "ours", flags)
    try:
        trl_steps, trl_log = theirs(lab, tmp_path, flags)
    finally:
        our_steps, our_log = finish_ours(process, tmp_path / "ours")
    start = weights(lab / "policy")
    assert_same_steps(our_steps, trl_steps, start)
    accumulation = flags.get("gradient_accumulation_steps", 1)
    assert_same_metrics(our_log, trl_log, accumulation)
    # the run moved the weights (a step that changed nothing would compare equal trivially), and what the case
    # is for happened: prompts cut, and under accumulation gradients far above the clip (TRL's are 2x ours)
    assert all((our_steps[0][n] - start[n]).abs().max() > LR / 2 for n in our_steps[0])
    assert all(log["rewards/accuracies"] > 0 for log in our_log[1:])
    if "max_length" in flags:
        assert all(log["val/num_truncated_prompts"] == 5 for log in our_log)
    if accumulation > 1:
        assert all(log["grad_norm"] > 10 * MAX_GRAD_NORM for log in our_log)
        assert [log["beta"] for log in our_log] == flags["beta"]


def test_lora_equals_trls(lab, tmp_path):
    """--use_peft against OnlineDPOTrainer(peft_config=...): the adapter alone trained; the second step's
    implicit rewards are log-ratios against the policy with its adapter off, after the first step moved it."""
    flags = dict(loss_type="sigmoid", beta=0.1, per_device_train_batch_size=8, use_peft=True,
                 adam_epsilon=1e-6, **fixed_completions.LORA)  # fmt: skip
    process = start_ours(lab, tmp_path / "ours", flags)
    try:
        trl_steps, trl_log = theirs(lab, tmp_path, flags)
    finally:
        our_steps, our_log = finish_ours(process, tmp_path / "ours")
    start = fixed_completions.lora_start(lab / "policy", 3)
    assert all(".lora_" in name for name in our_steps[0])  # the base's weights are not trained
    assert_same_steps(our_steps, trl_steps, start)
    assert_same_metrics(our_log, trl_log, 1)
    assert our_log[0]["rewards/margins"] == 0 and our_log[1]["rewards/margins"] != 0


def test_two_processes_take_one_processs_steps(lab, tmp_path):
    """Two processes (gloo) at the same global batch take the steps of one (TRL's two-process run is not
    compared: its val/contain_eos_token is process 0's): the loss is scaled over both processes' pairs, so the
    weights and the gradient norm (which a uniform scale would change, AdamW after clipping not) agree."""
    from conftest import run_torchrun

    flags = dict(loss_type="sigmoid", beta=0.1, gradient_accumulation_steps=2, missing_eos_penalty=1.0)
    one = start_ours(lab, tmp_path / "one", {**flags, "per_device_train_batch_size": 4})
    one_steps, one_log = finish_ours(one, tmp_path / "one")
    two = tmp_path / "two"
    argv = our_argv(lab, two, {**flags, "per_device_train_batch_size": 2})
    (two / "counter").mkdir(parents=True)
    os.environ.update(FIXED_COMPLETIONS=str(two / "counter"), STEPS_OUT=str(two / "steps"))
    try:
        run_torchrun(argv, nproc=2)
    finally:
        del os.environ["FIXED_COMPLETIONS"], os.environ["STEPS_OUT"]
    assert_same_steps(one_steps, recorded_steps(two / "steps"), weights(lab / "policy"))
    two_log = read_metrics(two / "runs" / "ours")
    for mine, theirs in zip(one_log, two_log, strict=True):
        for name in ["grad_norm", "loss/dpo_avg", "rewards/margins", "objective/scores"]:
            assert theirs[name] == pytest.approx(mine[name], rel=1e-4, abs=1e-6), name
