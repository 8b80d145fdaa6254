"""Held-out evaluation during RL training (utils/evaluation.py) in rloo.py, ppo.py and online_dpo.py: eval/ metrics
at the evaluation points, their means equal to a recomputation from the scored completions (one process and
two; grpo.py also with --bf16, DeepSpeed ZeRO-2/3 and --use_vllm), training untouched by evaluation (the same
metrics and weights with and without it, and a bit-exact resume with it), a missing split named on the command
line refused in one line."""

import importlib.util
import json
import math
import os
import types
from pathlib import Path

import pytest
import torch

import utils.evaluation
from conftest import make_rl_lab, read_metrics, run_deepspeed, run_script, run_torchrun, weights

# Two reward functions that record every row they score (prompt, value, the evaluation's or training's state).
RECORDING_REWARDS = """
import json, os


def record(name, prompts, values, trainer_state):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"fn": name, "step": trainer_state.global_step, "prompts": prompts,
                            "values": values}) + "\\n")


def words(prompts, completions, trainer_state, **kwargs):
    values = [float(len(c.split())) for c in completions]
    record("words", prompts, values, trainer_state)
    return values


def vowels(prompts, completions, trainer_state, **kwargs):
    values = [sum(ch in "aeiou" for ch in c) / 10 for c in completions]
    record("vowels", prompts, values, trainer_state)
    return values
"""
NUM_TRAIN, NUM_TEST = 16, 8


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The RL lab's policy; a dataset folder of train.jsonl (16 prompts) and test.jsonl (8 other prompts)."""
    out = make_rl_lab(world, tmp_path_factory.mktemp("heldout_lab"), num_prompts=NUM_TRAIN + NUM_TEST)
    rows = (out / "prompts.jsonl").read_text().splitlines()
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_text("\n".join(rows[:NUM_TRAIN]) + "\n")
    (out / "data" / "test.jsonl").write_text("\n".join(rows[NUM_TRAIN:]) + "\n")
    (out / "recording.py").write_text(RECORDING_REWARDS)
    return out


def rloo_flags(lab, tmp_path, name, *extra):
    """3 updates of 4 prompts x 2 completions, two reward functions; with a test split, evaluations before the
    first update, after the second and after the last (--eval_steps 2), in batches of 3 prompts x 2."""
    return [
        "rloo.py", "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "data"),
        "--reward_funcs", f"{lab / 'recording.py'}:words", f"{lab / 'recording.py'}:vowels",
        "--num_generations", "2", "--per_device_train_batch_size", "8", "--max_steps", "3",
        "--max_completion_length", "8", "--learning_rate", "1e-3", "--eval_steps", "2",
        "--per_device_eval_batch_size", "6", "--logging_dir", str(tmp_path / "runs"), "--run_name", name,
        "--output_dir", str(tmp_path / name), *extra,
    ]  # fmt: skip


def recorded(log: Path, test_prompts: set) -> dict:
    """{(function, step): [values of the held-out rows it scored]} from the recording reward functions."""
    found = {}
    for line in log.read_text().splitlines():
        call = json.loads(line)
        if all(p in test_prompts for p in call["prompts"]):
            found.setdefault((call["fn"], call["step"]), []).extend(call["values"])
    return found


def held_out_prompts(lab) -> set:
    """The prompts of test.jsonl."""
    return {json.loads(row)["prompt"] for row in (lab / "data" / "test.jsonl").read_text().splitlines()}


def eval_lines(lines: list[dict]) -> list[dict]:
    return [line for line in lines if any(key.startswith("eval/") for key in line)]


def check_against_recording(lines, found, steps_per_eval):
    """Each evaluation's means equal the mean over the rows the reward functions scored at that point."""
    evals = eval_lines(lines)
    eval_steps = sorted({step for _, step in found})
    assert len(eval_steps) == len(evals)
    for line, step in zip(evals, eval_steps):
        words, vowels = found[("words", step)], found[("vowels", step)]
        assert len(words) == len(vowels) == steps_per_eval
        assert line["eval/rewards/words/mean"] == pytest.approx(sum(words) / len(words), abs=1e-6)
        assert line["eval/rewards/vowels/mean"] == pytest.approx(sum(vowels) / len(vowels), abs=1e-6)
        total = sum(w + v for w, v in zip(words, vowels)) / len(words)
        assert line["eval/objective/scores"] == pytest.approx(total, abs=1e-5)


@pytest.fixture(scope="module")
def rloo_runs(lab, tmp_path_factory):
    """rloo.py with the test split (checkpoint after update 1), the same run without it, and the first resumed
    from its checkpoint: {name: (metrics lines, final weights)}."""
    tmp_path = tmp_path_factory.mktemp("heldout_rloo")
    runs = {}
    run_script(
        rloo_flags(
            lab, tmp_path, "eval", "--dataset_test_split", "test", "--eval_on_start", "--save_steps", "1"
        ),
        env={"REWARD_LOG": str(tmp_path / "eval.jsonl")},
    )
    runs["eval"] = (read_metrics(tmp_path / "runs" / "eval"), weights(tmp_path / "eval"))
    run_script(rloo_flags(lab, tmp_path, "plain"), env={"REWARD_LOG": str(tmp_path / "plain.jsonl")})
    runs["plain"] = (read_metrics(tmp_path / "runs" / "plain"), weights(tmp_path / "plain"))
    resume = [
        "--dataset_test_split",
        "test",
        "--resume_from_checkpoint",
        str(tmp_path / "eval" / "checkpoint-1"),
    ]
    run_script(
        rloo_flags(lab, tmp_path, "eval", *resume), env={"REWARD_LOG": str(tmp_path / "resumed.jsonl")}
    )
    runs["resumed"] = (read_metrics(tmp_path / "runs" / "eval"), weights(tmp_path / "eval"))
    runs["log"] = tmp_path / "eval.jsonl"
    return runs


def test_rloo_logs_eval_metrics_at_the_evaluation_points(rloo_runs, lab):
    """Before the first update (step 0, --eval_on_start), after --eval_steps 2 and after the last; every
    held-out prompt's 2 completions scored once at each, and the logged means are theirs."""
    lines, _ = rloo_runs["eval"]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert [line["step"] for line in eval_lines(lines)] == [0, 2, 3]
    names = {"eval/objective/scores", "eval/rewards/words/mean", "eval/rewards/vowels/mean",
             "eval/completions/mean_length", "eval/completions/clipped_ratio"}  # fmt: skip
    assert all(
        names <= line.keys() and math.isfinite(line["eval/objective/scores"]) for line in eval_lines(lines)
    )
    assert not [key for key in lines[1] if key.startswith("eval/")]
    check_against_recording(lines, recorded(rloo_runs["log"], held_out_prompts(lab)), 2 * NUM_TEST)


def test_rloo_trains_the_same_with_and_without_evaluation(rloo_runs):
    """The evaluation's noise is its own: the training metrics (but the clock's eps) and the final weights are
    those of the same run without a test split; a resume from the checkpoint of update 1 with evaluation ends
    with the same weights and logs."""
    (with_eval, with_weights), (plain, plain_weights) = rloo_runs["eval"], rloo_runs["plain"]
    training = [
        {k: v for k, v in line.items() if not k.startswith("eval/") and k != "eps"} for line in with_eval
    ]
    assert [line for line in training if len(line) > 1] == [
        {k: v for k, v in x.items() if k != "eps"} for x in plain
    ]
    assert all(torch.equal(with_weights[n], plain_weights[n]) for n in plain_weights)
    resumed, resumed_weights = rloo_runs["resumed"]
    assert all(torch.equal(with_weights[n], resumed_weights[n]) for n in with_weights)
    strip = lambda lines: [{k: v for k, v in line.items() if k != "eps"} for line in lines]  # noqa: E731
    assert strip(resumed) == strip(with_eval)


def test_rloo_evaluation_gathers_two_processes(lab, tmp_path):
    """Two processes share the held-out prompts (4 each, in batches of 3 and 1): the logged means are over
    every process's completions, each counted once."""
    flags = rloo_flags(lab, tmp_path, "two", "--dataset_test_split", "test")
    flags[flags.index("--per_device_train_batch_size") + 1] = "4"
    flags[flags.index("--max_steps") + 1] = "1"
    os.environ["REWARD_LOG"] = str(tmp_path / "two.jsonl")  # run_torchrun passes the environment on
    try:
        run_torchrun(flags)
    finally:
        del os.environ["REWARD_LOG"]
    lines = read_metrics(tmp_path / "runs" / "two")
    assert [line["step"] for line in eval_lines(lines)] == [1]
    check_against_recording(lines, recorded(tmp_path / "two.jsonl", held_out_prompts(lab)), 2 * NUM_TEST)


class FakeAccelerator:
    """A stand-in for one process of `world` whose reduce adds the other processes' sums (given)."""

    def __init__(self, rank, world, others=None):
        self.process_index, self.num_processes, self.device = rank, world, torch.device("cpu")
        self.others, self.sums = others or [], None

    def reduce(self, tensor, reduction):
        self.sums = tensor.clone()
        return tensor + sum(self.others)


def test_evaluate_counts_each_held_out_completion_once():
    """utils.evaluation.evaluate over 2 processes and 7 prompts (4 each, the last one padding), 2 completions
    each, batches of 3 prompts, a NaN left out: the means are those of the real completions."""

    def value(prompt, completion):
        return math.nan if (prompt, completion) == (5, 1) else float(10 * prompt + completion)

    def complete_and_score(indices):
        rows = [value(p, c) for c in range(2) for p in indices]  # completion-major
        return {"v": torch.tensor(rows), "one": torch.ones(len(rows))}, list(indices)

    sums = []
    for rank in (0, 1):
        fake = FakeAccelerator(rank, 2)
        utils.evaluation.evaluate(fake, 7, 3, complete_and_score)
        sums.append(fake.sums)
    means, first = utils.evaluation.evaluate(FakeAccelerator(0, 2, [sums[1]]), 7, 3, complete_and_score)
    real = [value(p, c) for p in range(7) for c in range(2) if not math.isnan(value(p, c))]
    assert means == {"eval/v": pytest.approx(sum(real) / len(real)), "eval/one": 1.0}
    assert first == [0, 1, 2]
    assert utils.evaluation.prompt_share(7, 1, 2) == ([4, 5, 6, 6], 3)
    assert utils.evaluation.prompt_share(1, 1, 2) == ([0], 0)


def test_evaluation_schedule():
    args = types.SimpleNamespace(eval_strategy="steps", eval_steps=None, num_sample_generations=2)
    assert [u for u in range(1, 11) if utils.evaluation.due(u, 10, args)] == [1, 5, 10]
    args.eval_steps = 4
    assert [u for u in range(1, 11) if utils.evaluation.due(u, 10, args)] == [4, 8, 10]
    args.eval_strategy = "no"
    assert not any(utils.evaluation.due(u, 10, args) for u in range(1, 11))


@pytest.mark.parametrize(
    "script,nproc",
    [("ppo.py", 1), ("online_dpo.py", 1), pytest.param("ppo.py", 2, marks=pytest.mark.slow),
     pytest.param("online_dpo.py", 2, marks=pytest.mark.slow)],
)  # fmt: skip
def test_ppo_and_online_dpo_log_eval_metrics(lab, tmp_path, script, nproc):
    """Two updates with --eval_steps 1: the held-out means after each, equal to those of the scored rows (on two
    processes too: each held-out prompt scored once, 3 + 1 a process)."""
    reward = f"{lab / 'recording.py'}:words"
    flags = [
        script, "--dataset_name", str(lab / "data"), "--dataset_test_split", "test", "--reward_fn", reward,
        "--per_device_train_batch_size", "4", "--eval_steps", "1", "--per_device_eval_batch_size", "3",
        "--logging_dir", str(tmp_path / "runs"), "--run_name", "run", "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    if script == "ppo.py":
        flags += ["--sft_model_path", str(lab / "policy"), "--response_length", "8", "--total_episodes", "8"]
        flags += ["--num_ppo_epochs", "1"]
    else:
        flags += ["--model_name_or_path", str(lab / "policy"), "--max_new_tokens", "8", "--max_steps", "2"]
    if nproc == 1:
        run_script(flags, env={"REWARD_LOG": str(tmp_path / "log.jsonl")})
    else:  # the same global batch
        flags[flags.index("--per_device_train_batch_size") + 1] = "2"
        os.environ["REWARD_LOG"] = str(tmp_path / "log.jsonl")  # run_torchrun passes the environment on
        try:
            run_torchrun(flags)
        finally:
            del os.environ["REWARD_LOG"]
    lines = read_metrics(tmp_path / "runs" / "run")
    assert [line["step"] for line in eval_lines(lines)] == [1, 2]
    found = recorded(tmp_path / "log.jsonl", held_out_prompts(lab))
    for line, step in zip(eval_lines(lines), sorted({step for _, step in found})):
        values = found[("words", step)]
        assert len(values) == NUM_TEST  # one completion of each held-out prompt
        assert line["eval/objective/scores"] == pytest.approx(sum(values) / len(values), abs=1e-6)
        assert 0 < line["eval/completions/mean_length"] <= 8


def test_a_missing_split_stops_or_is_skipped_in_one_line(lab, capsys, monkeypatch):
    """A split named on the command line that the dataset lacks: a one-sentence ValueError (run_cli prints it as
    `rloo.py: error: ...`) before any model is loaded; a script's default split left unnamed: one line, skipped."""
    args = types.SimpleNamespace(
        eval_strategy="steps",
        dataset_test_split="validation",
        dataset_name=str(lab / "data"),
        dataset_config=None,
    )
    monkeypatch.setattr("sys.argv", ["rloo.py", "--dataset_test_split", "validation"])
    with pytest.raises(ValueError, match="validation") as error:
        utils.evaluation.load_test_split(args, "rloo.py", default="validation")
    assert "\n" not in str(error.value) and str(error.value).count(". ") == 0
    monkeypatch.setattr("sys.argv", ["rloo.py"])
    assert utils.evaluation.load_test_split(args, "rloo.py", default="validation") is None
    assert capsys.readouterr().out.splitlines() == [
        f'rloo.py: no "validation" split in {lab / "data"}: evaluation skipped (give --dataset_test_split to evaluate)'
    ]
    args.dataset_test_split = "test"
    assert len(utils.evaluation.load_test_split(args, "rloo.py")) == NUM_TEST
    args.eval_strategy = "no"
    assert utils.evaluation.load_test_split(args, "rloo.py") is None


@pytest.mark.parametrize("script", ["rloo.py", "grpo.py"])
def test_a_negative_num_generations_eval_is_one_line(world, tmp_path, script):
    """--num_generations_eval below 1 (0 is TRL's unset: the group size) stops in one line before any model loads."""
    policy = "--sft_model_path" if script == "rloo.py" else "--model_name_or_path"
    flags = [script, policy, str(world / "policy"), "--reward_model_path", str(world / "reward"), "--dataset_name",
             str(world / "dataset"), "--dataset_train_split", "sft", "--dataset_test_split", "validation",
             "--num_generations_eval", "-1", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = run_script(flags, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"{script}: error: --num_generations_eval must be at least 1, got -1."
    )


# ---- grpo.py ---------------------------------------------------------------------------------------------------
OWN_ROW_REWARD = """

def own_row(prompts, completions, size, **kwargs):
    return [float(s == len(p)) for p, s in zip(prompts, size)]
"""


@pytest.fixture(scope="module")
def grpo_runs(lab, tmp_path_factory):
    """grpo.py on the lab's splits with a `size` column (each prompt's length) and a third reward, 1 where it
    gets its own row's size: with the test split (checkpoint after step 1), the same run without it, and the
    first resumed from its checkpoint: {name: (metrics lines, final weights)}."""
    tmp_path = tmp_path_factory.mktemp("heldout_grpo")
    (tmp_path / "data").mkdir()
    for split in ("train", "test"):
        rows = [json.loads(row) for row in (lab / "data" / f"{split}.jsonl").read_text().splitlines()]
        text = "".join(json.dumps({**row, "size": len(row["prompt"])}) + "\n" for row in rows)
        (tmp_path / "data" / f"{split}.jsonl").write_text(text)
    (tmp_path / "rewards.py").write_text(RECORDING_REWARDS + OWN_ROW_REWARD)

    def flags(name, *extra):
        flags = rloo_flags(lab, tmp_path, name, *extra)  # the same flags mean the same in grpo.py
        flags[0], flags[flags.index("--dataset_name") + 1] = "grpo.py", str(tmp_path / "data")
        at = flags.index("--reward_funcs") + 1
        flags[at : at + 2] = [f"{tmp_path / 'rewards.py'}:{fn}" for fn in ("words", "vowels", "own_row")]
        return flags

    runs = {"log": tmp_path / "eval.jsonl"}
    with_eval = ["--dataset_test_split", "test", "--save_steps", "1"]
    run_script(flags("eval", *with_eval, "--eval_on_start"), env={"REWARD_LOG": str(runs["log"])})
    runs["eval"] = (read_metrics(tmp_path / "runs" / "eval"), weights(tmp_path / "eval"))
    run_script(flags("plain"), env={"REWARD_LOG": str(tmp_path / "plain.jsonl")})
    runs["plain"] = (read_metrics(tmp_path / "runs" / "plain"), weights(tmp_path / "plain"))
    resume = [*with_eval, "--resume_from_checkpoint", str(tmp_path / "eval" / "checkpoint-1")]
    run_script(flags("eval", *resume), env={"REWARD_LOG": str(tmp_path / "resumed.jsonl")})
    runs["resumed"] = (read_metrics(tmp_path / "runs" / "eval"), weights(tmp_path / "eval"))
    runs["flags"] = flags
    return runs


def test_grpo_logs_eval_metrics_at_the_evaluation_points(grpo_runs, lab):
    """Before the first step (--eval_on_start), after --eval_steps 2 and after the last: each held-out prompt's
    --num_generations_eval (default --num_generations, 2) completions scored once, with its own row's columns,
    and the logged means are theirs, under training's names with eval/ before them."""
    lines, _ = grpo_runs["eval"]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert [line["step"] for line in eval_lines(lines)] == [0, 2, 3]
    assert not [key for key in lines[1] if key.startswith("eval/")]
    names = {"eval/reward", "eval/frac_reward_zero_std", "eval/completions/mean_length",
             "eval/completions/clipped_ratio", *(f"eval/rewards/{f}/mean" for f in ("words", "vowels", "own_row"))}  # fmt: skip
    assert all(set(line) - {"step"} >= names for line in eval_lines(lines))
    assert set(lines[0]) == {"step", *names}
    found = recorded(grpo_runs["log"], held_out_prompts(lab))
    assert sorted({step for _, step in found}) == [0, 2, 3]  # trainer_state.global_step: the steps done
    for line in eval_lines(lines):
        words, vowels = found[("words", line["step"])], found[("vowels", line["step"])]
        assert len(words) == len(vowels) == 2 * NUM_TEST
        assert line["eval/rewards/words/mean"] == pytest.approx(sum(words) / len(words), abs=1e-6)
        assert line["eval/rewards/vowels/mean"] == pytest.approx(sum(vowels) / len(vowels), abs=1e-6)
        assert line["eval/rewards/own_row/mean"] == 1.0
        total = sum(w + v + 1 for w, v in zip(words, vowels)) / len(words)
        assert line["eval/reward"] == pytest.approx(total, abs=1e-5)
        assert 0 < line["eval/completions/mean_length"] <= 8 and 0 <= line["eval/frac_reward_zero_std"] <= 1


def test_grpo_trains_the_same_with_and_without_evaluation(grpo_runs):
    """The evaluation's noise is its own and it leaves the policy as it found it: the training metrics (but the
    clock's eps) and final weights are those of the run without a test split; a resume from step 1's
    checkpoint with evaluation ends with the same weights and logs."""
    (with_eval, with_weights), (plain, plain_weights) = grpo_runs["eval"], grpo_runs["plain"]

    def strip(lines, prefix="eval/"):
        return [{k: v for k, v in x.items() if not k.startswith(prefix) and k != "eps"} for x in lines]

    assert [line for line in strip(with_eval) if len(line) > 1] == strip(plain)
    assert all(torch.equal(with_weights[n], plain_weights[n]) for n in plain_weights)
    resumed, resumed_weights = grpo_runs["resumed"]
    assert all(torch.equal(with_weights[n], resumed_weights[n]) for n in with_weights)
    assert strip(resumed, "eps") == strip(with_eval, "eps")


def test_grpo_missing_split_stops_before_a_model_loads(grpo_runs, tmp_path):
    """A --dataset_test_split the dataset lacks: one line, `grpo.py: error: ...`, before any model is loaded
    (the policy path given does not exist) and with --output_dir untouched."""
    flags = grpo_runs["flags"]("missing", "--dataset_test_split", "validation")
    flags[flags.index("--model_name_or_path") + 1] = str(tmp_path / "no_such_policy")
    flags[flags.index("--output_dir") + 1] = str(tmp_path / "out")
    proc = run_script(flags, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo.py: error: ") and "validation" in lines[0], (
        proc.stderr
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "launch",
    ["bf16", "zero3", pytest.param("zero2", marks=pytest.mark.slow),
     pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                                       reason="vLLM is not installed")])],
)  # fmt: skip
def test_grpo_evaluates_under_bf16_deepspeed_and_vllm(lab, tmp_path, launch):
    """grpo.py's held-out evaluation with --bf16, under DeepSpeed ZeRO-2/3 on 2 processes (the weights gathered
    for sampling, 4 held-out prompts a process) and with --use_vllm: evaluations after --eval_steps 2 and the
    last step, every held-out prompt's 2 completions scored once, the logged means theirs."""
    flags = rloo_flags(lab, tmp_path, "run", "--dataset_test_split", "test")
    flags[0] = "grpo.py"
    env = {"REWARD_LOG": str(tmp_path / "log.jsonl")}
    if launch in ("bf16", "vllm"):
        run_script([*flags, f"--{'use_vllm' if launch == 'vllm' else 'bf16'}"], env=env)
    else:
        flags[flags.index("--per_device_train_batch_size") + 1] = "4"  # the same global batch
        os.environ.update(env)  # run_deepspeed passes the environment on
        try:
            run_deepspeed(flags, tmp_path, int(launch[-1]))
        finally:
            del os.environ["REWARD_LOG"]
    lines = read_metrics(tmp_path / "runs" / "run")
    assert [line["step"] for line in eval_lines(lines)] == [2, 3]
    found = recorded(tmp_path / "log.jsonl", held_out_prompts(lab))
    for line in eval_lines(lines):
        words, vowels = found[("words", line["step"])], found[("vowels", line["step"])]
        assert len(words) == len(vowels) == 2 * NUM_TEST
        assert line["eval/rewards/words/mean"] == pytest.approx(sum(words) / len(words), abs=1e-5)
        assert line["eval/reward"] == pytest.approx((sum(words) + sum(vowels)) / len(words), abs=1e-4)
