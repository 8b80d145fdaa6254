"""One metric naming scheme (docs/metrics.md): the quantities every trainer logs have TRL's names (`loss`,
`learning_rate`, `grad_norm`, `epoch`, `episode`) in every script, a gradient norm of 0 is logged, and sft.py,
dpo.py and reward.py on one jsonl file (no test split) train without evaluation after one line, as TRL does."""

import ast
import json
import re

import pytest

import utils.data
from conftest import ROOT, make_rl_lab, read_metrics, run_script

SCRIPTS = "sft.py reward.py dpo.py ppo.py rloo.py grpo.py online_dpo.py ilql.py ddpo.py".split()
# The old names of the common quantities (and of throughput and the ILQL total loss), none of which is logged now.
OLD_NAMES = {"lr", "train/loss", "train/lr", "train/grad_norm", "train/epoch", "train/accuracy", "train/margin",
             "train/num_tokens", "train/tokens_per_second", "train/steps", "train/seconds", "loss/total"}  # fmt: skip


def assert_common_names(lines: list[dict], expected: set[str]) -> None:
    """Every line of a metrics.jsonl without an old name or a `train/` prefix; the training lines with `expected`."""
    for line in lines:
        old = {key for key in line if key in OLD_NAMES or key.startswith("train/")}
        assert not old, (old, line)
    training = [line for line in lines if "loss" in line]
    assert training and all(expected <= line.keys() for line in training), (expected, training[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_logs_an_old_name(script):
    """No string in the script is an old metric name (`lr` only as a key of PyTorch's optimizer param groups),
    and no f-string builds a `train/` name."""
    tree = ast.parse((ROOT / script).read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            parent = parents.get(node)
            param_group = isinstance(parent, ast.Subscript) and "group" in ast.unparse(parent.value)
            assert node.value not in OLD_NAMES or (node.value == "lr" and param_group), (script, node.lineno)
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            assert not (isinstance(first, ast.Constant) and first.value.startswith("train/")), node.lineno


def test_has_split(world):
    dataset = world / "dataset"  # a DatasetDict saved with save_to_disk, and each split as {split}.jsonl
    assert utils.data.has_split(str(dataset), "test") and not utils.data.has_split(str(dataset), "nope")
    assert utils.data.has_split(str(dataset / "sft.jsonl"), "train")
    assert not utils.data.has_split(str(dataset / "sft.jsonl"), "test")


# Each script on one jsonl file of its data (whose only split is 'train') and the names it must log.
ONE_FILE = {
    "sft.py": ("policy", "sft.jsonl", ["--total_steps", "3", "--max_length", "96", "--response_length", "8"],
               {"loss", "learning_rate", "grad_norm", "num_tokens", "perf/tokens_per_second"}),
    "dpo.py": ("policy", "preference.jsonl", ["--max_steps", "3", "--max_length", "96"],
               {"loss", "learning_rate", "grad_norm", "epoch", "rewards/accuracies", "logps/chosen"}),
    "reward.py": ("reward", "preference.jsonl", ["--total_steps", "3", "--max_length", "96"],
                  {"loss", "learning_rate", "grad_norm", "epoch", "accuracy", "margin"}),
}  # fmt: skip


def one_file_flags(script: str, world, tmp_path) -> list[str]:
    model, data, extra, _ = ONE_FILE[script]
    return [script, "--model_name_or_path", str(world / model), "--dataset_name", str(world / "dataset" / data),
            "--per_device_train_batch_size", "4", "--logging_steps", "1", "--output_dir", str(tmp_path / "out"),
            "--logging_dir", str(tmp_path / "runs"), "--run_name", "one_file", *extra]  # fmt: skip


@pytest.mark.parametrize("script", list(ONE_FILE))
def test_one_file_trains_without_evaluation(world, tmp_path, script):
    """No 'test' split and the flag left at its default: one line says evaluation is skipped, training runs, and
    nothing (logs, output, model card) holds an evaluation or a NaN; the common quantities have the common names."""
    proc = run_script(one_file_flags(script, world, tmp_path), timeout=300)
    output = proc.stdout + proc.stderr
    skipped = [line for line in output.splitlines() if "evaluation skipped" in line]
    assert skipped == [f'{script}: no "test" split in {world / "dataset" / ONE_FILE[script][1]}: evaluation '
                       "skipped (give --dataset_test_split to evaluate)"], output[-3000:]  # fmt: skip
    assert not re.search(r"\bnan\b|\{\}", output, re.IGNORECASE), output[-3000:]
    lines = read_metrics(tmp_path / "runs" / "one_file")
    assert_common_names(lines, ONE_FILE[script][3])
    assert not [key for line in lines for key in line if key.startswith("eval/")]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| loss |" in card and "eval/" not in card and "nan" not in card
    if (tmp_path / "out" / "metrics.json").exists():
        final = json.loads((tmp_path / "out" / "metrics.json").read_text())
        assert "loss" in final and not [key for key in final if key.startswith("eval/") or key in OLD_NAMES]


@pytest.mark.parametrize("script", ["sft.py", "dpo.py"])
def test_one_file_with_a_test_split_asked_for_fails_in_one_line(world, tmp_path, script):
    proc = run_script([*one_file_flags(script, world, tmp_path), "--dataset_test_split", "test"], check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: ") and "'test'" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    return make_rl_lab(world, tmp_path_factory.mktemp("names_lab"), num_prompts=16)


def test_grpo_logs_a_gradient_norm_of_zero(lab, tmp_path):
    """A reward of the prompt alone: every advantage is 0, so is the gradient, and grad_norm is logged as 0.0
    (an `or` on the float once dropped it), beside the common names."""
    flags = [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{lab / 'rules.py'}:prompt_only", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--max_steps", "2",
        "--max_completion_length", "8", "--num_sample_generations", "0", "--output_dir", str(tmp_path / "out"),
        "--logging_dir", str(tmp_path / "runs"), "--run_name", "zero",
    ]  # fmt: skip
    run_script(["grpo.py", *flags], timeout=300)
    lines = read_metrics(tmp_path / "runs" / "zero")
    assert len(lines) == 2 and all(line["grad_norm"] == 0.0 and line["loss"] == 0.0 for line in lines), lines
    assert_common_names(lines, {"loss", "learning_rate", "grad_norm", "episode", "reward", "kl", "entropy"})
