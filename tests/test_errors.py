"""One error style in every script: a bad input exits non-zero with one line `script.py: error: ...` that names
the flag, column or path, no traceback, and a pre-existing --output_dir is left as it was (even with
--overwrite_output_dir, whose moving aside happens only when training starts). Among them the values that used
to run silently wrong or crash (#25): negative learning rates, --max_prompt_length 0, ddpo's batch sizes, empty
datasets, unknown message roles, a causal LM as reward model, damaged checkpoints and checkpoints of another run."""

import json
import sys

import pytest

from conftest import ROOT, run_script


def bad_files(tmp_path):
    """A jsonl file of prompts with the wrong column, one of SFT rows, one of blank lines, a 0-row save_to_disk
    dataset, conversations with a role "usr" (as prompts, messages and preference pairs), a checkpoint whose
    weights were cut short, and one of a run with another learning rate."""
    import datasets

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(8)))
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": "c"}) + "\n" for i in range(8)))
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    empty = {"prompt": [], "completion": [], "chosen": [], "rejected": []}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(empty)}).save_to_disk(str(tmp_path / "empty"))
    usr = [{"role": "usr", "content": "hello there"}]
    answer = [{"role": "assistant", "content": "hi"}]
    for name, row in (("usr_prompt", {"prompt": usr}), ("usr_messages", {"messages": usr + answer}),
                      ("usr_pairs", {"prompt": usr, "chosen": answer, "rejected": answer})):  # fmt: skip
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in range(8)))
    damaged = tmp_path / "damaged" / "checkpoint-2"
    damaged.mkdir(parents=True)
    (damaged / "model.safetensors").write_bytes(b"\x10" * 10)
    state = {"step": 2, "run_name": "old", "world_size": 1, "files": {"model.safetensors": 4096}}
    (damaged / "trainer_state.json").write_text(json.dumps(state))
    other = tmp_path / "other" / "checkpoint-2"
    other.mkdir(parents=True)
    state = {"step": 2, "run_name": "old", "world_size": 1, "files": {}, "run": {"learning_rate": 0.5}}
    (other / "trainer_state.json").write_text(json.dumps(state))
    return wrong, good


# (script, flags, words the message must contain); {world}, {tmp} and {wrong}/{good} are filled in.
CASES = [
    ("sft.py", ["--dataset_name", "{tmp}/nowhere"], ["--dataset_name", "does not exist"]),
    ("sft.py", ["--model_name_or_path", "{tmp}/no_model"], ["--model_name_or_path", "does not exist"]),
    ("sft.py", ["--per_device_train_batch_size", "0"], ["--per_device_train_batch_size"]),
    ("sft.py", ["--max_length", "64", "--max_prompt_length", "100"], ["--max_prompt_length"]),
    (
        "sft.py",
        ["--dataset_name", "{good}", "--dataset_train_split", "train"],
        ["one file", "validation"],
    ),
    ("sft.py", ["--dataset_name", "{wrong}", "--eval_strategy", "no"], ["wrong.jsonl"]),
    ("sft.py", ["--resume_from_checkpoint", "{tmp}/damaged/checkpoint-2"], ["is damaged", "model.safetensors"]),
    ("sft.py", ["--resume_from_checkpoint", "{tmp}/other/checkpoint-2"], ["another run", "--learning_rate 0.5"]),
    ("sft.py", ["--bf16=maybe"], ["--bf16", "true or false"]),
    ("reward.py", ["--dataset_name", "{wrong}", "--eval_strategy", "no"], ["wrong.jsonl"]),
    ("reward.py", ["--model_name_or_path", "some-org/not-here-model"], ["--model_name_or_path", "hub"]),
    ("reward.py", ["--resume_from_checkpoint", "{tmp}"], ["--resume_from_checkpoint", "not a checkpoint"]),
    ("dpo.py", ["--dataset_name", "{wrong}", "--eval_strategy", "no"], ["wrong.jsonl"]),
    ("dpo.py", ["--max_length", "64", "--max_prompt_length", "100"], ["--max_prompt_length"]),
    ("dpo.py", ["--resume_from_checkpoint", "{tmp}/damaged/checkpoint-2"], ["is damaged", "4096"]),
    ("rloo.py", ["--resume_from_checkpoint", "{tmp}/other/checkpoint-2", "--reward_model_path", "{world}/reward"],
     ["another run", "--learning_rate 0.5 there"]),  # fmt: skip
    ("ppo.py", ["--reward_fn", "{tmp}/missing.py:f", "--reward_model_path", "{world}/reward"], ["--reward"]),
    ("ppo.py", ["--temperature", "0", "--reward_model_path", "{world}/reward"], ["--temperature"]),
    ("rloo.py", ["--rloo_k", "1", "--reward_model_path", "{world}/reward"], ["--rloo_k"]),
    ("rloo.py", ["--reward_fn", "{tmp}/missing.py:score"], ["--reward_fn", "missing.py"]),
    ("rloo.py", ["--reward_model_path", "{world}/reward", "--rloo_k", "3"], ["--rloo_k", "divide"]),
    ("ddpo.py", ["--sample_eta", "0"], ["--sample_eta"]),
    ("ddpo.py", ["--prompt_file", "{tmp}/prompts.txt"], ["--prompt_file", "does not exist"]),
    ("ddpo.py", ["--resume_from_checkpoint", "{tmp}/nowhere"], ["--resume_from_checkpoint", "neither"]),
    ("ddpo.py", ["--pretrained_model", "{world}/policy"], ["--pretrained_model", "no model_index.json"]),
    # empty datasets: a 0-row save_to_disk folder, a jsonl of blank lines
    ("sft.py", ["--dataset_name", "{tmp}/empty", "--dataset_train_split", "train", "--eval_strategy", "no"],
     ["--dataset_name", "no rows"]),
    ("dpo.py", ["--dataset_name", "{tmp}/empty", "--dataset_train_split", "train", "--eval_strategy", "no"],
     ["--dataset_name", "no rows"]),
    ("rloo.py", ["--dataset_name", "{tmp}/empty", "--dataset_train_split", "train", "--reward_model_path",
                 "{world}/reward"], ["--dataset_name", "no rows"]),
    ("reward.py", ["--dataset_name", "{tmp}/blank.jsonl", "--dataset_train_split", "train", "--eval_strategy", "no"],
     ["blank.jsonl", "blank lines"]),
    ("grpo.py", ["--dataset_name", "{tmp}/blank.jsonl", "--dataset_train_split", "train"], ["blank lines"]),
    ("ilql.py", ["--dataset_name", "{tmp}/blank.jsonl", "--dataset_train_split", "train"], ["blank lines"]),
    # a message role that is not one of TRL's
    ("sft.py", ["--dataset_name", "{tmp}/usr_messages.jsonl", "--dataset_train_split", "train", "--eval_strategy",
                "no", "--model_name_or_path", "{world}/policy_chat"], ["role 'usr'"]),
    ("dpo.py", ["--dataset_name", "{tmp}/usr_pairs.jsonl", "--dataset_train_split", "train", "--eval_strategy",
                "no", "--model_name_or_path", "{world}/policy_chat"], ["role 'usr'"]),
    ("rloo.py", ["--dataset_name", "{tmp}/usr_prompt.jsonl", "--dataset_train_split", "train", "--sft_model_path",
                 "{world}/policy_chat", "--reward_model_path", "{world}/reward"], ["role 'usr'"]),
    ("online_dpo.py", ["--dataset_name", "{tmp}/usr_prompt.jsonl", "--dataset_train_split", "train",
                       "--model_name_or_path", "{world}/policy_chat"], ["role 'usr'"]),
    # a causal LM whose config says num_labels=1: it would score with a freshly initialised head
    ("rloo.py", ["--reward_model_path", "{lm1}"], ["--reward_model_path", "no trained score head"]),
    ("online_dpo.py", ["--reward_model_path", "{lm1}"], ["--reward_model_path", "no trained score head"]),
    # a TRL 1.16 generation of no completions divided by zero
    ("rloo.py", ["--reward_model_path", "{world}/reward", "--generation_batch_size", "0"],
     ["--generation_batch_size 0", "positive multiple"]),
    # an attention implementation transformers refuses: the message is transformers' own, on one line
    ("sft.py", ["--attn_implementation", "foo"], ["--attn_implementation foo cannot load --model_name_or_path",
                                                  "not supported"]),
    # a sampling knob out of range or unknown: refused before any model loads, not at the first sampling
    ("rloo.py", ["--reward_model_path", "{world}/reward", "--top_p", "0"], ["--top_p in (0, 1]"]),
    ("ppo.py", ["--reward_model_path", "{world}/reward", "--repetition_penalty", "0"], ["--repetition_penalty > 0"]),
    ("grpo.py", ["--min_p", "2"], ["--min_p must be in [0, 1], got 2.0"]),
    ("online_dpo.py", ["--top_k", "-1"], ["--top_k must be >= 0"]),
]  # fmt: skip

FLAG_CASES = [  # impossible flag values, refused before main() does anything: checked in-process
    # a negative learning rate, in every script
    *[(script, ["--learning_rate", "-1e-4"], ["--learning_rate", ">= 0"])
      for script in ("sft.py", "reward.py", "dpo.py", "ppo.py", "rloo.py", "grpo.py", "online_dpo.py", "ilql.py")],
    ("ddpo.py", ["--train_learning_rate", "-1"], ["--train_learning_rate", ">= 0"]),
    # Adam's constants and the seed out of range: torch's and NumPy's tracebacks before
    *[(script, [flag, "-1"], [flag, want]) for script in ("ppo.py", "rloo.py", "grpo.py", "online_dpo.py")
      for flag, want in (("--adam_beta1", "[0, 1)"), ("--adam_beta2", "[0, 1)"), ("--adam_epsilon", ">= 0"),
                         ("--seed", "[0, 2**32 - 1]"))],
    # a negative weight decay: torch's traceback in the offline scripts, a silent one in the RL scripts' groups
    *[(script, ["--weight_decay", "-1"], ["--weight_decay", ">= 0"])
      for script in ("sft.py", "reward.py", "dpo.py", "ppo.py", "rloo.py", "grpo.py", "online_dpo.py", "ilql.py")],
    # a negative clipping norm: torch multiplied every gradient by a negative factor (gradient ascent), silently
    *[(script, ["--max_grad_norm", "-1"], ["--max_grad_norm", "at least 0"])
      for script in ("sft.py", "reward.py", "dpo.py", "ppo.py", "rloo.py", "grpo.py", "online_dpo.py", "ilql.py")],
    ("ddpo.py", ["--train_max_grad_norm", "-1"], ["--train_max_grad_norm", "at least 0"]),
    # a negative warmup ratio made a negative warmup in reward.py and dpo.py
    *[(script, ["--warmup_ratio", "-0.5"], ["--warmup_ratio", "[0, 1]"]) for script in ("reward.py", "dpo.py")],
    # --max_prompt_length 0 would mean "no truncation"
    *[(script, ["--max_prompt_length", "0"], ["--max_prompt_length", "at least 1"])
      for script in ("ppo.py", "rloo.py", "grpo.py", "online_dpo.py")],
    # ddpo's sizes: a negative one ran 0 updates and exited 0, a zero divided by zero
    ("ddpo.py", ["--train_batch_size", "-2"], ["--train_batch_size", "at least 1"]),
    ("ddpo.py", ["--train_batch_size", "0"], ["--train_batch_size", "at least 1"]),
    ("ddpo.py", ["--sample_num_batches_per_epoch", "0"], ["--sample_num_batches_per_epoch", "at least 1"]),
    # transformers' attention flag has no meaning for a diffusers UNet
    ("ddpo.py", ["--attn_implementation", "eager"], ["--attn_implementation", "diffusers"]),
]  # fmt: skip

DEFAULTS = {  # enough for each script to reach its checks on the tiny world
    "sft.py": ["--model_name_or_path", "{world}/policy", "--dataset_name", "{world}/dataset",
               "--dataset_train_split", "sft", "--dataset_test_split", "validation"],
    "reward.py": ["--model_name_or_path", "{world}/reward", "--dataset_name", "{world}/dataset",
                  "--dataset_train_split", "preference", "--dataset_test_split", "preference_validation"],
    "dpo.py": ["--model_name_or_path", "{world}/policy", "--dataset_name", "{world}/dataset",
               "--dataset_train_split", "preference", "--dataset_test_split", "preference_validation"],
    "ppo.py": ["--sft_model_path", "{world}/policy", "--dataset_name", "{world}/dataset",
               "--dataset_train_split", "sft"],
    "rloo.py": ["--sft_model_path", "{world}/policy", "--dataset_name", "{world}/dataset",
                "--dataset_train_split", "sft"],
    "grpo.py": ["--model_name_or_path", "{world}/policy", "--dataset_name", "{world}/dataset",
                "--dataset_train_split", "sft", "--reward_model_path", "{world}/reward"],
    "online_dpo.py": ["--model_name_or_path", "{world}/policy", "--dataset_name", "{world}/dataset",
                      "--dataset_train_split", "sft", "--reward_model_path", "{world}/reward"],
    "ilql.py": ["--model_name_or_path", "{world}/policy", "--dataset_name", "{good}", "--dataset_train_split",
                "train"],
    "ddpo.py": ["--pretrained_model", "{tmp}"],  # the checks come before the pipeline is loaded
}  # fmt: skip


@pytest.fixture(scope="module")
def lm1(world, tmp_path_factory):
    """The tiny world's causal LM with num_labels=1 in its config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world / "policy")
    model.config.num_labels = 1
    path = tmp_path_factory.mktemp("lm1")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("script, flags, words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_keeps_the_output_dir(script, flags, words, world, lm1, tmp_path):
    wrong, good = bad_files(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")

    def fill(flag):
        return flag.format(world=world, tmp=tmp_path, wrong=wrong, good=good, lm1=lm1)

    given = {f for f in flags if f.startswith("--")}
    defaults, i = [], 0
    base = DEFAULTS[script]
    while i < len(base):  # a flag given by the case replaces the default
        if base[i] not in given:
            defaults += base[i : i + 2]
        i += 2
    args = [
        script,
        *map(fill, defaults),
        *map(fill, flags),
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
    ]
    proc = run_script(args, check=False, timeout=180)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "LOAD REPORT" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    last = lines[-1]
    assert last.startswith(f"{script}: error: "), proc.stderr[-3000:]
    assert all(word in last for word in words), last
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize(
    "script, flags, words", FLAG_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FLAG_CASES)]
)
def test_impossible_flag_value_is_one_line(script, flags, words, tmp_path, monkeypatch, capsys):
    """The command line of the script, run in this process (these fail before main() loads or creates anything,
    so a subprocess would only add its start-up time): exit 2, one line, nothing written."""
    import importlib

    import utils.run

    module = importlib.import_module(script.removesuffix(".py"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    argv = [str(ROOT / script), *flags, "--output_dir", str(out), "--overwrite_output_dir"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        utils.run.run_cli(module.Args, module.main)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{script}: error: "), err
    assert all(word in err for word in words), err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
