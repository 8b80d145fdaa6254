"""dpo.py, sft.py and reward.py's own training loops against TRL 1.16's DPOTrainer, SFTTrainer and
RewardTrainer .train(), step by step.

Each side runs as users run it: our script through its command line (tests/fixed_run.py records the trained
parameters after every optimizer step), TRL's trainer through train(). Both start from the tiny world's weights
and read the same rows; after every optimizer step the parameters and the metrics both log under one name must
agree. Each optimizer step is one pass over the whole training file (rows = per-device batch x accumulation x
processes), so the two sides' different shuffles cannot make them differ: what is compared is everything the loops
do with the rows, the chosen and rejected halves, the reference, the masks, the loss and its normalisation over
micro-batches and processes, clipping, the schedule and AdamW. reward.py with --use_peft runs against
RewardTrainer(peft_config=LoraConfig(task_type="SEQ_CLS")), both sides' adapters started from one seed: the
adapters and the score head (peft's modules_to_save) are compared, and the saved model with TRL's merged.

Differences on purpose (docs/trl_defaults.md), kept out of the comparison:
- the logged learning rate: ours is the one the next step will use (after the scheduler's step: 0 after the last
  step of a linear schedule), TRL 1.16's (transformers 5) the one the step just used; compared shifted by a step;
- dpo.py's rewards/* of --loss_type ipo are beta times the per-token average log-ratios (what its loss uses), TRL's
  the summed ones whatever the loss: compared for the other loss types only;
- dpo.py's logits/chosen and logits/rejected average each completion's mean logit over the pairs, TRL's average
  over every completion token of the micro-batch: not compared;
- sigmoid with --label_smoothing is conservative DPO here and plain DPO in TRL 1.16 (tests/test_trl_parity_offline
  .py): label smoothing is compared with the robust loss only.
sft.py does not log TRL's mean_token_accuracy or entropy, reward.py not its min/mean/max_reward.

The two-process DPO case (hinge) is marked slow, to keep the file near two minutes on two idle cores."""

import json
import os
import subprocess
import sys

import pytest

import fixed_completions
from conftest import OFFLINE_ENV, ROOT, read_metrics, run_torchrun, weights
from fixed_completions import assert_same_steps, recorded_steps

pytest.importorskip("trl")
fixed_completions.trl_without_vllm()  # before TRL's trainers are imported (here and under torchrun)
import trl  # noqa: E402

if trl.__version__ != "1.16.0":
    pytest.skip(f"compared with TRL 1.16.0's trainers; found trl {trl.__version__}", allow_module_level=True)

LR = 3e-4
SHARED = dict(learning_rate=LR, max_grad_norm=1.0, lr_scheduler_type="linear", max_steps=2, seed=3)
CASES = {
    # name: (data kind (KINDS), flags common to both sides, processes)
    "dpo_sigmoid_accumulation": ("dpo", dict(loss_type="sigmoid", beta=0.3, per_device_train_batch_size=2,
                                             gradient_accumulation_steps=2), 1),
    "dpo_ipo_accumulation": ("dpo", dict(loss_type="ipo", beta=0.2, per_device_train_batch_size=2,
                                         gradient_accumulation_steps=2), 1),
    "dpo_robust_label_smoothing": ("dpo", dict(loss_type="robust", beta=0.1, label_smoothing=0.2,
                                               per_device_train_batch_size=4), 1),
    "dpo_hinge_two_processes": ("dpo", dict(loss_type="hinge", beta=0.5, per_device_train_batch_size=1,
                                            gradient_accumulation_steps=2), 2),
    "sft_completion_only_accumulation": ("sft", dict(per_device_train_batch_size=2,
                                                     gradient_accumulation_steps=2), 1),
    "sft_text_accumulation": ("sft_text", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2), 1),
    "sft_two_processes": ("sft", dict(per_device_train_batch_size=1, gradient_accumulation_steps=2), 2),
    "reward_margin_center_accumulation": ("reward_margin", dict(per_device_train_batch_size=2,
                                                                gradient_accumulation_steps=2,
                                                                center_rewards_coefficient=0.1), 1),
}  # fmt: skip
SLOW = {"dpo_hinge_two_processes"}
ROWS = 4  # every case's per-device batch x accumulation x processes: one step is one pass over the rows

# data kind -> (script, training file, model directory in the world)
KINDS = {
    "dpo": ("dpo.py", "preference.jsonl", "policy"),
    "sft": ("sft.py", "prompt_completion.jsonl", "policy"),
    "sft_text": ("sft.py", "text.jsonl", "policy"),
    "reward_margin": ("reward.py", "preference_margin.jsonl", "reward"),
}
# Our metric names -> TRL's, per script: the metrics both log.
METRICS = {
    "dpo.py": {name: name for name in ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
                                       "rewards/accuracies", "logps/chosen", "logps/rejected"]} | {"learning_rate": "learning_rate"},
    "sft.py": {name: name for name in ["loss", "grad_norm", "learning_rate", "num_tokens"]},
    "reward.py": {name: name for name in ["loss", "grad_norm", "learning_rate", "accuracy", "margin"]},
}  # fmt: skip
IPO_REWARDS = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]  # averaged here


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The training files, ROWS rows each, of different token counts (so that no split of a step into
    micro-batches has as many loss tokens in each part)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("offline_lab")
    rows = [json.loads(line) for line in open(world / "dataset" / "sft.jsonl")][: 4 * ROWS]
    pairs = [json.loads(line) for line in open(world / "dataset" / "preference.jsonl")][:ROWS]
    # Completions of 1, 2, 4 and 8 rows' completions, prompts cut at different places.
    sft = [{"prompt": rows[i]["prompt"][(i % 3) * 25 :],
            "completion": "".join(r["completion"] for r in rows[i : i + 2**i])} for i in range(ROWS)]  # fmt: skip
    text = [{"text": row["prompt"][: 40 + 60 * i] + row["completion"]} for i, row in enumerate(rows[:ROWS])]
    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    for texts in ([r["completion"] for r in sft], [r["text"] for r in text]):
        counts = [len(tokenizer(t)["input_ids"]) + 1 for t in texts]  # the loss tokens (EOS included)
        sums = [a + b for i, a in enumerate(counts) for b in counts[i + 1 :]]
        assert len(set(sums)) == len(sums), counts  # no two pairs of rows hold as many loss tokens
    write_jsonl(out / "prompt_completion.jsonl", sft)
    write_jsonl(out / "text.jsonl", text)
    preference = [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs]
    write_jsonl(out / "preference.jsonl", preference)
    write_jsonl(
        out / "preference_margin.jsonl", [p | {"margin": 0.6 * i - 0.8} for i, p in enumerate(preference)]
    )
    return out


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def start_ours(world, lab, out, kind: str, flags: dict, nproc: int):
    """The script's main() on its command line, under tests/fixed_run.py: started in the background (one
    process: returns the Popen) or run to its end under torchrun."""
    script, data, model = KINDS[kind]
    argv = ["tests/fixed_run.py", script, "--model_name_or_path", str(world / model), "--dataset_name",
            str(lab / data), "--eval_strategy", "no", "--logging_steps", "1", "--output_dir", str(out / "model"),
            "--logging_dir", str(out / "runs"), "--run_name", "ours"]  # fmt: skip
    argv += {"dpo.py": ["--generate_during_eval", "False"], "sft.py": ["--num_samples", "0"],
             "reward.py": ["--normalize", "False"]}[script]  # fmt: skip
    for key, value in {**SHARED, **flags}.items():
        argv += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    env = {"STEPS_OUT": str(out / "steps")}
    if nproc == 1:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env={**os.environ, **OFFLINE_ENV, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    os.environ.update(env)
    try:
        run_torchrun(argv, nproc=nproc)
    finally:
        del os.environ["STEPS_OUT"]


def our_results(script, out):
    """(our weights after each step, our logged metrics) of a finished run."""
    steps = recorded_steps(out / "steps")
    if script == "reward.py":  # our optimizer holds the ScoreModel wrapper's parameters
        steps = [{name.removeprefix("model."): p for name, p in step.items()} for step in steps]
    log = [line for line in read_metrics(out / "runs" / "ours") if "loss" in line]
    return steps, log


def build_trainer(spec: dict):
    """TRL 1.16's trainer of the case's script on the same model, rows and flags."""
    from datasets import load_dataset

    world, lab, out, kind, flags = spec["world"], spec["lab"], spec["out"], spec["kind"], dict(spec["flags"])
    script, data, model = KINDS[kind]
    common = dict(output_dir=f"{out}/trl", use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                  logging_steps=1, warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
                  gradient_checkpointing=False)  # fmt: skip
    dataset = load_dataset("json", data_files=f"{lab}/{data}", split="train")
    if script == "dpo.py":
        flags["loss_type"] = [flags["loss_type"]]
        config = trl.DPOConfig(**common, **flags, disable_dropout=True)
        return trl.DPOTrainer(model=f"{world}/{model}", args=config, train_dataset=dataset)
    if script == "sft.py":
        return trl.SFTTrainer(
            model=f"{world}/{model}", args=trl.SFTConfig(**common, **flags), train_dataset=dataset
        )
    peft_config = fixed_completions.trl_lora(trl.trainer.reward_trainer, flags, flags["seed"], "SEQ_CLS")
    config = trl.RewardConfig(**common, **flags, disable_dropout=True)
    return trl.RewardTrainer(
        model=f"{world}/{model}", args=config, train_dataset=dataset, peft_config=peft_config
    )


def theirs(spec: dict, nproc: int):
    """TRL's train() (in this process, or on `nproc` processes) -> (weights after each step, log history)."""
    return fixed_completions.trl_train(build_trainer, "test_update_parity_offline:build_trainer", spec, nproc)


def assert_same_metrics(script: str, our_log: list[dict], trl_log: list[dict], skip=()):
    assert len(our_log) == len(trl_log) == SHARED["max_steps"], (our_log, trl_log)
    # Ours log the learning rate of the next step (0 after the last, linear), TRL's that of the step taken.
    next_lrs = [h["learning_rate"] for h in trl_log[1:]] + [0.0]
    for step, (mine, trl_metrics, next_lr) in enumerate(zip(our_log, trl_log, next_lrs), 1):
        for name, trl_name in METRICS[script].items():
            if name in skip:
                continue
            assert name in mine and trl_name in trl_metrics, (step, name, mine, trl_metrics)
            expected = next_lr if trl_name == "learning_rate" else trl_metrics[trl_name]
            assert mine[name] == pytest.approx(expected, rel=1e-4, abs=1e-6), (step, name, mine, trl_metrics)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_each_step_equals_trls(world, lab, tmp_path, case):
    """The same parameters after every optimizer step, and the same loss, grad norm, learning rate, rewards..."""
    kind, flags, nproc = CASES[case]
    assert flags["per_device_train_batch_size"] * flags.get("gradient_accumulation_steps", 1) * nproc == ROWS
    script, _, model = KINDS[kind]
    process = start_ours(world, lab, tmp_path / "ours", kind, flags, nproc)  # beside TRL's on a second core
    spec = dict(world=str(world), lab=str(lab), out=str(tmp_path), kind=kind, flags={**SHARED, **flags})
    try:
        trl_steps, trl_log = theirs(spec, nproc)
    finally:
        output = process.communicate(timeout=300)[0] if process else ""
    assert process is None or process.returncode == 0, output[-6000:]
    our_steps, our_log = our_results(script, tmp_path / "ours")
    assert_same_metrics(script, our_log, trl_log, skip=IPO_REWARDS if flags.get("loss_type") == "ipo" else ())
    start = weights(world / model)
    assert_same_steps(our_steps, trl_steps, start)
    # the run moved the weights: a step that changed nothing would compare equal trivially
    assert all((our_steps[0][n] - start[n]).abs().max() > LR / 2 for n in our_steps[0])


def test_lora_equals_trls(world, lab, tmp_path):
    """--use_peft against RewardTrainer(peft_config=LoraConfig(task_type="SEQ_CLS")): the adapters and the score
    head (peft's modules_to_save of a sequence classifier) train on both sides, the base's weights on neither; the
    same parameters after every step, the same metrics, and our saved model is TRL's adapter merged into the base
    with TRL's score head."""
    flags = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, center_rewards_coefficient=0.1,
                 **fixed_completions.LORA)  # fmt: skip
    process = start_ours(world, lab, tmp_path / "ours", "reward_margin", {**flags, "use_peft": True}, 1)
    spec = dict(world=str(world), lab=str(lab), out=str(tmp_path), kind="reward_margin")
    spec["flags"] = {**SHARED, **flags}
    try:
        trl_steps, trl_log = theirs(spec, 1)
    finally:
        output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output[-6000:]
    our_steps, our_log = our_results("reward.py", tmp_path / "ours")
    assert_same_metrics("reward.py", our_log, trl_log)
    start = fixed_completions.lora_start(world / "reward", SHARED["seed"], "SEQ_CLS")
    head = "base_model.model.score.modules_to_save.default.weight"
    trained = sorted(our_steps[0])
    assert head in trained and all(".lora_" in n for n in trained if n != head), trained
    assert_same_steps(our_steps, trl_steps, start)
    # lora_A moves from the second step on (lora_B is 0 at first), at the linear schedule's LR / 2
    assert all((our_steps[-1][n] - start[n]).abs().max() > LR / 4 for n in start)
    base = weights(world / "reward")
    assert_same_steps([weights(tmp_path / "ours" / "model")], [merged(world / "reward", trl_steps[-1])], base,
                      min_steps=1)  # fmt: skip


def merged(model_path, trained: dict) -> dict:
    """The state dict of the classifier at `model_path` with `trained` (a LORA adapter and score head under
    peft's names) merged in, under the base's names."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    lora = fixed_completions.LORA
    config = LoraConfig(task_type="SEQ_CLS", r=lora["lora_r"], lora_alpha=lora["lora_alpha"],
                        target_modules=lora["lora_target_modules"])  # fmt: skip
    base = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    model = get_peft_model(base, config)
    missing = set(trained) - set(model.state_dict())
    assert not missing, sorted(missing)
    model.load_state_dict(trained, strict=False)
    return {name: p.detach().clone() for name, p in model.merge_and_unload().state_dict().items()}
