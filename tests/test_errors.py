"""One error style in every script: a bad input exits non-zero with one line `script.py: error: ...` that names
the flag, column or path, no traceback, and a pre-existing --output_dir is left as it was (even with
--overwrite_output_dir)."""

import json

import pytest

from conftest import run_script


def bad_files(tmp_path):
    """A jsonl file of prompts with the wrong column, and one of SFT rows."""
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(8)))
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": "c"}) + "\n" for i in range(8)))
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
    (
        "sft.py",
        ["--resume_from_checkpoint", "latest"],
        ["--resume_from_checkpoint", "no complete checkpoint"],
    ),
    ("sft.py", ["--bf16=maybe"], ["--bf16", "true or false"]),
    ("reward.py", ["--dataset_name", "{wrong}", "--eval_strategy", "no"], ["wrong.jsonl"]),
    ("reward.py", ["--model_name_or_path", "some-org/not-here-model"], ["--model_name_or_path", "hub"]),
    ("reward.py", ["--resume_from_checkpoint", "{tmp}"], ["--resume_from_checkpoint", "not a checkpoint"]),
    ("dpo.py", ["--dataset_name", "{wrong}", "--eval_strategy", "no"], ["wrong.jsonl"]),
    ("dpo.py", ["--max_length", "64", "--max_prompt_length", "100"], ["--max_prompt_length"]),
    (
        "dpo.py",
        ["--resume_from_checkpoint", "latest"],
        ["--resume_from_checkpoint", "no complete checkpoint"],
    ),
    ("ppo.py", ["--reward_fn", "{tmp}/missing.py:f", "--reward_model_path", "{world}/reward"], ["--reward"]),
    ("ppo.py", ["--temperature", "0", "--reward_model_path", "{world}/reward"], ["--temperature"]),
    ("rloo.py", ["--rloo_k", "1", "--reward_model_path", "{world}/reward"], ["--rloo_k"]),
    ("rloo.py", ["--reward_fn", "{tmp}/missing.py:score"], ["--reward_fn", "missing.py"]),
    ("rloo.py", ["--reward_model_path", "{world}/reward", "--rloo_k", "3"], ["--rloo_k", "divide"]),
    ("ddpo.py", ["--sample_eta", "0"], ["--sample_eta"]),
    ("ddpo.py", ["--prompt_file", "{tmp}/prompts.txt"], ["--prompt_file", "does not exist"]),
    ("ddpo.py", ["--resume_from_checkpoint", "latest"], ["--resume_from_checkpoint"]),
]

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
    "ddpo.py": ["--pretrained_model", "{tmp}"],  # the checks come before the pipeline is loaded
}  # fmt: skip


@pytest.mark.parametrize("script, flags, words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_keeps_the_output_dir(script, flags, words, world, tmp_path):
    wrong, good = bad_files(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")

    def fill(flag):
        return flag.format(world=world, tmp=tmp_path, wrong=wrong, good=good)

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
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    last = lines[-1]
    assert last.startswith(f"{script}: error: "), proc.stderr[-3000:]
    assert all(word in last for word in words), last
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
