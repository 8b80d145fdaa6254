"""A researcher's first hour (#52): what a run shows and where it went. --help grouped as the source is, computed
sizes refused as flags, wrong values in one sentence, a metrics line per log, the logs' folder said at the start
and the end, sample tables kept without W&B, a model card with hub metadata, the resolved flags and the curves."""

import json
import re
import struct

import pytest

import grpo
import ppo
import rloo
import sft
import utils.cli
import utils.plots
import utils.run
import utils.saving
import utils.tracking
from conftest import run_script


# ------------------------------------------------------------------------------------------------------- --help
@pytest.mark.parametrize("module", [rloo, grpo, sft])
def test_help_is_grouped_as_the_source_with_every_flag_and_default(module, capsys):
    with pytest.raises(SystemExit) as stop:
        utils.run.parse_args(module.Args, ["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    groups = utils.cli.flag_groups(module.Args)
    titles = [title for title, _ in groups]
    assert (
        titles[0] == "Run" and "Models and data" in titles and titles[-1].startswith("Filled in at runtime")
    )
    positions = [text.index(f"\n{title}") for title in titles]
    assert positions == sorted(positions)  # the source's order
    runtime = utils.cli.runtime_fields(module.Args)
    assert runtime and runtime == set(groups[-1][1])
    for field in module.Args.__dataclass_fields__:
        if field in runtime:
            assert f"\n  {field}\n" in text and f"--{field} " not in text
        else:
            flag = re.search(rf"\n  --{field}[ ,]", text).start()  # a comma: its aliases follow
            assert "(default: " in text[flag : text.find("\n  --", flag + 1)]


def test_computed_sizes_are_refused_as_flags_and_ppos_checked_ones_accepted():
    with pytest.raises(ValueError, match=r"^--world_size is computed from the other flags at runtime"):
        utils.run.parse_args(grpo.Args, ["--world_size", "4"])
    with pytest.raises(ValueError, match=r"^--num_total_batches is computed"):
        utils.run.parse_args(rloo.Args, ["--num_total_batches=3"])
    assert utils.run.parse_args(ppo.Args, ["--batch_size", "8"]).batch_size == 8  # checked by ppo.fill_sizes
    with pytest.raises(ValueError, match=r"^--world_size is computed"):
        utils.run.parse_args(ppo.Args, ["--world_size", "2"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr_scheduler_type", "cosin"], r"--lr_scheduler_type must be one of linear, cosine, .*; got 'cosin' \(did you mean cosine\?\)\.$"),
        (["--save_steps", "ten"], r"^--save_steps takes an integer, got 'ten'\.$"),
        (["--learning_rate=fast"], r"^--learning_rate takes a number, got 'fast'\.$"),
        (["--reward_weights", "1", "x"], r"^--reward_weights takes a number, got 'x'\.$"),
        (["--seed"], r"^--seed needs a value\.$"),
        (["--seed", "1", "2"], r"^--seed takes one value, got '1 2'\.$"),
    ],
)  # fmt: skip
def test_wrong_values_are_one_sentence(argv, message):
    with pytest.raises(ValueError, match=message):
        utils.run.parse_args(rloo.Args, argv)


def test_values_tyro_takes_still_parse():
    args = utils.run.parse_args(rloo.Args, ["--seed", "None", "--reward_weights", "1", "0.5", "--stop_token", "eos",
                                            "--learning_rate", "1e-5", "--bf16", "True"])  # fmt: skip
    assert (args.seed, args.reward_weights, args.stop_token, args.learning_rate, args.bf16) == (
        None, [1.0, 0.5], "eos", 1e-5, True)  # fmt: skip


def test_a_wrong_value_on_the_command_line_is_one_line():
    proc = run_script(["sft.py", "--total_steps", "ten"], check=False, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines == ["sft.py: error: --total_steps takes an integer, got 'ten'."]


# --------------------------------------------------------------------------------------------- console and curves
def test_console_line_shows_the_main_metrics_in_order():
    metrics = {"eps": 3, "val/ratio": 1.0, "grad_norm": 0.0, "loss": 0.123456, "learning_rate": 3e-6,
               "eval/reward": 0.5, "reward": 0.25, "kl": 0.01}  # fmt: skip
    line = utils.tracking.console_line(metrics, 7)
    assert (
        line
        == "step 7 | loss 0.1235 | reward 0.25 | kl 0.01 | learning_rate 3e-06 | grad_norm 0 | eval/reward 0.5"
    )
    assert utils.tracking.console_line({"eps": 3}, 1) == ""


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_curves_plot_train_and_held_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1 / s, "learning_rate": 1e-5, "eps": 2} for s in range(1, 6)]
    rows += [{"step": 5, "eval/loss": 0.3, "eval/accuracy": 0.7}, {"step": 6, "loss": float("nan")}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = utils.plots.plot_curves(str(path), str(tmp_path / "curves.png"))
    assert out == str(tmp_path / "curves.png") and png_size(out)[0] > 300
    assert utils.plots.plot_curves(str(tmp_path / "none.jsonl"), str(tmp_path / "x.png")) is None
    (tmp_path / "other.jsonl").write_text(json.dumps({"step": 1, "eps": 3}) + "\n")
    assert utils.plots.plot_curves(str(tmp_path / "other.jsonl"), str(tmp_path / "y.png")) is None


# --------------------------------------------------------------------------------------------------- a whole run
def test_an_rl_run_says_where_it_went_and_leaves_a_card_with_curves(world, tmp_path):
    out, logs = tmp_path / "out", tmp_path / "runs"
    proc = run_script(["rloo.py", "--sft_model_path", str(world / "policy"), "--reward_model_path",
                       str(world / "reward"), "--dataset_name", str(world / "dataset"), "--dataset_train_split",
                       "sft", "--per_device_train_batch_size", "4", "--rloo_k", "2",
                       "--local_rollout_forward_batch_size", "4", "--response_length", "6", "--total_episodes",
                       "16", "--num_sample_generations", "1", "--output_dir", str(out), "--logging_dir",
                       str(logs), "--run_name", "first"], timeout=300)  # fmt: skip
    stdout = proc.stdout
    assert f"logs: {logs}/first/ (metrics.jsonl, samples.jsonl, TensorBoard)" in stdout
    assert f"tensorboard --logdir {logs}" in stdout
    steps = [line for line in stdout.splitlines() if " | objective/rlhf_reward " in line]
    assert len(steps) == 4 and steps[0].strip().startswith("step 1 | ") and "grad_norm" in steps[0]
    assert (
        stdout.rstrip().splitlines()[-1]
        == f"done: logs in {logs}/first/; model in {out}/ (card: README.md, curves.png)"
    )
    rows = [json.loads(line) for line in (logs / "first" / "samples.jsonl").read_text().splitlines()]
    assert rows and {"table", "query", "response", "score"} <= set(rows[0])

    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == str(world / "policy") and card.data.datasets == [str(world / "dataset")]
    assert card.data.library_name == "transformers" and "rloo" in card.data.tags
    assert "![training curves](curves.png)" in card.text and png_size(out / "curves.png")[0] > 300
    assert "| rloo_k | `2` |" in card.text and "| num_total_batches | `4` |" in card.text  # resolved
