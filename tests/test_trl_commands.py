"""TRL's published example commands, read from docs/coming_from_trl.md, each run through the
script's real command line with only the script path, the hub ids and the sizes changed, on local stand-ins of
TRL's datasets in their exact formats (columns, strings or conversations per column, split names); and TRL's flags
that mean nothing here: the harmless ones dropped with a note, the others refused in one sentence."""

import re
import shlex

import datasets
import pytest

from conftest import ROOT, run_script
from utils import cli, data, run


def readme_commands() -> dict[str, str]:
    """{name: command} of docs/coming_from_trl.md's ```bash blocks, each opening with `# name: source`."""
    page = (ROOT / "docs" / "coming_from_trl.md").read_text()
    commands = {}
    for block in re.findall(r"```bash\n(.*?)```", page, re.S):
        header, _, command = block.partition("\n")
        name = header.lstrip("# ").partition(":")[0]
        if name in commands:
            raise ValueError(f"docs/coming_from_trl.md: two commands named {name!r}")
        commands[name] = command
    return commands


COMMANDS = readme_commands()
RL_SCRIPTS = ("ppo.py", "rloo.py", "grpo.py", "online_dpo.py")

# Sizes made tiny, appended to the command (a flag given twice takes its last value).
SIZES = {
    "sft.py": "--max_steps 2 --max_length 96 --gradient_accumulation_steps 2 --eval_steps 2 --num_samples 2 "
    "--response_length 4 --per_device_eval_batch_size 8",
    "dpo.py": "--max_steps 2 --max_length 96 --gradient_accumulation_steps 2 --eval_steps 2 "
    "--per_device_eval_batch_size 8",
    "reward.py": "--max_steps 2 --max_length 96 --per_device_train_batch_size 4 --eval_steps 2",
    "online_dpo.py": "--max_steps 2 --max_new_tokens 6 --per_device_train_batch_size 4 --gradient_accumulation_steps 1",
    "grpo.py": "--max_steps 2 --max_completion_length 6 --num_generations 2 --per_device_train_batch_size 4",
    "rloo.py": "--total_episodes 16 --response_length 6 --gradient_accumulation_steps 4 --per_device_train_batch_size 2",
    "ppo.py": "--total_episodes 16 --response_length 6 --gradient_accumulation_steps 4 --per_device_train_batch_size 2",
}

REWARDS = '''
def accuracy_reward(completions, solution, **kwargs):
    """Stands in for TRL's accuracy_reward: 1 when the completion holds the solution."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(s in t) for t, s in zip(texts, solution)]
'''


def messages(*turns):
    return [{"role": role, "content": content} for role, content in zip(("user", "assistant"), turns)]


@pytest.fixture(scope="module")
def stand_ins(world, tmp_path_factory) -> dict[str, str]:
    """{TRL's hub id: a local stand-in of the same format} (see docs/coming_from_trl.md's table)."""
    out = tmp_path_factory.mktemp("stand_ins")
    world_data = datasets.load_from_disk(str(world / "dataset"))

    def rows(split, n, start=0):
        return [world_data[split][i] for i in range(start, start + n)]

    def save(name, **splits):
        datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(
            out / name
        )
        return str(out / name)

    def chat(name, split, n):
        return [
            dict(r)
            for r in datasets.load_from_disk(str(world / "dataset_chat" / name))[split].select(range(n))
        ]

    train, valid, test, pref = rows("sft", 32), rows("validation", 8), rows("test", 8), rows("preference", 32)
    ultrafeedback = {
        split: [
            {"chosen": r["chosen"], "rejected": r["rejected"], "score_chosen": 8.0, "score_rejected": 5.0}
            for r in chat("implicit_prompt_preference", split, n)
        ]
        for split, n in (("train", 32), ("test", 8))
    }

    def differ_after_a_shared_prompt(
        r,
    ):  # as hh-rlhf's pairs: the two answers differ, neither one ends the other
        return not (r["chosen"].startswith(r["rejected"]) or r["rejected"].startswith(r["chosen"]))

    hh_rows = [r for r in rows("preference", 64) if differ_after_a_shared_prompt(r)]

    def hh(r):
        human = "\n\nHuman: " + r["prompt"] + "\n\nAssistant:"
        return {"chosen": human + r["chosen"], "rejected": human + r["rejected"]}

    def tldr_sft(r, i):
        post = r["prompt"]
        return {"id": f"t3_{i}", "subreddit": post.split("\n")[0], "title": post.split("\n")[2], "post": post,
                "summary": r["completion"], "prompt": post, "messages": messages(post, r["completion"])}  # fmt: skip

    return {
        "trl-lib/Capybara": save(
            "capybara",
            train=chat("language_modeling", "train", 32),
            test=chat("language_modeling", "test", 8),
        ),
        "stanfordnlp/imdb": save(
            "imdb",
            train=[{"text": r["prompt"] + r["completion"], "label": i % 2} for i, r in enumerate(train)],
            test=[{"text": r["prompt"] + r["completion"], "label": i % 2} for i, r in enumerate(test)],
            unsupervised=[{"text": r["prompt"], "label": -1} for r in valid],
        ),
        "trl-lib/ultrafeedback_binarized": save("ultrafeedback_binarized", **ultrafeedback),
        "anthropic/hh-rlhf": save(
            "hh-rlhf", train=[hh(r) for r in hh_rows[:-8]], test=[hh(r) for r in hh_rows[-8:]]
        ),
        "trl-lib/tldr": save(
            "tldr",
            **{
                s: [{"prompt": r["prompt"], "completion": r["completion"]} for r in split_rows]
                for s, split_rows in (("train", train), ("validation", valid), ("test", test))
            },
        ),  # fmt: skip
        "trl-internal-testing/descriptiveness-sentiment-trl-style": save(
            "descriptiveness-sentiment-trl-style",
            **{
                s: [
                    {
                        "prompt": r["prompt"],
                        "chosen": messages(r["prompt"], r["chosen"]),
                        "rejected": messages(r["prompt"], r["rejected"]),
                    }
                    for r in split_rows
                ]
                for s, split_rows in (("descriptiveness", pref), ("sentiment", rows("preference", 8, 32)))
            },
        ),  # fmt: skip
        "trl-internal-testing/tldr-preference-sft-trl-style": save(
            "tldr-preference-sft-trl-style",
            train=[tldr_sft(r, i) for i, r in enumerate(train)],
            validation=[tldr_sft(r, i) for i, r in enumerate(valid)],
            test=[tldr_sft(r, i) for i, r in enumerate(test)],
        ),
        "HuggingFaceH4/Polaris-Dataset-53K": save(
            "polaris", train=[{"prompt": messages(r["prompt"]), "solution": r["facts"][0]} for r in train]
        ),
        **dict.fromkeys(
            ["Qwen/Qwen2-0.5B", "Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen2.5-0.5B"], str(world / "policy_chat")
        ),
        **dict.fromkeys(
            [
                "EleutherAI/pythia-1b-deduped",
                "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr",
                "trl-lib/pythia-1b-deduped-tldr-sft",
            ],
            str(world / "policy"),
        ),  # fmt: skip
        **dict.fromkeys(
            ["cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr", "trl-lib/pythia-1b-deduped-tldr-rm"],
            str(world / "reward"),
        ),
        "accuracy_reward": "trl_rewards.accuracy_reward",  # a TRL built-in: a local module of the working directory
    }


def test_the_readme_lists_a_command_for_every_script():
    scripts = {shlex.split(c)[1] for c in COMMANDS.values()}
    assert scripts == {"sft.py", "dpo.py", "reward.py", "online_dpo.py", "grpo.py", "rloo.py", "ppo.py"}
    assert len(COMMANDS) >= 13
    checkpointed = {shlex.split(c)[1] for c in COMMANDS.values() if "--gradient_checkpointing" in c}
    assert checkpointed >= {
        "sft.py",
        "dpo.py",
        "reward.py",
    }  # and the RL scripts get it in every command below


def run_command(script: str, args: list[str], cwd, monkeypatch, capsys) -> str:
    """`python script args` in `cwd`, through the script's own command line (utils.run.run_cli with that argv:
    parsing, TRL flags, errors as one line) but in this process, which has torch and transformers imported
    already (a fresh interpreter costs several CPU seconds per command). Returns what it wrote on stderr."""
    import importlib
    import sys

    from accelerate.state import AcceleratorState, GradientState

    module = importlib.import_module(script[:-3])
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *args])
    monkeypatch.syspath_prepend(
        str(cwd)
    )  # a dotted reward path imports from the working directory, as in TRL
    try:
        run.run_cli(module.Args, module.main)
    except SystemExit as exit:
        if exit.code:
            pytest.fail(f"{script} {' '.join(args)} exited {exit.code}: {capsys.readouterr().err[-3000:]}")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_trl_command_runs(name, stand_ins, tmp_path, monkeypatch, capsys):
    """The command as TRL published it, hub ids swapped for stand-ins, sizes made tiny, --push_to_hub dropped (no
    network); the RL commands get --gradient_checkpointing, which the LM commands of sft, dpo and reward carry."""
    tokens = shlex.split(COMMANDS[name].replace("\\\n", " "))
    assert tokens[0] == "python"
    script = tokens[1]
    args = [stand_ins.get(t, t) for t in tokens[2:] if t != "--push_to_hub"]
    # TRL's minimal PPO/RLOO commands pass the base causal LM as reward model, which TRL silently gives a random
    # score head; ours refuse that in one sentence (a meaningless reward), so the stand-in is a one-label model.
    policy, reward = stand_ins["EleutherAI/pythia-1b-deduped"], stand_ins["trl-lib/pythia-1b-deduped-tldr-rm"]
    args = [
        reward if a == policy and i and args[i - 1].startswith("--reward_model") else a
        for i, a in enumerate(args)
    ]
    args += SIZES[script].split()
    if script in RL_SCRIPTS:
        args.append("--gradient_checkpointing")
    (tmp_path / "trl_rewards.py").write_text(REWARDS)
    stderr = run_command(script, args, tmp_path, monkeypatch, capsys)
    output_dir = (
        args[len(args) - 1 - args[::-1].index("--output_dir") + 1] if "--output_dir" in args else None
    )
    output_dir = tmp_path / (output_dir or f"models/{script[:-3]}")
    assert (output_dir / "config.json").exists(), stderr[-2000:]
    if "--no_remove_unused_columns" in args:
        assert "--no_remove_unused_columns (a TRL flag) is ignored" in stderr


def test_rl_scripts_read_only_the_prompt_column():
    """TRL's PPO dataset: a string prompt beside conversational chosen/rejected. The RL scripts read the prompt
    alone, as strings; the preference readers (dpo, reward) still refuse the mix, naming the columns."""
    rows = [{"prompt": "a post", "chosen": messages("a post", "yes"), "rejected": messages("a post", "no")}]
    dataset = datasets.Dataset.from_list(rows)
    assert data.detect_format(dataset, "d", accepted=["prompt_only"]) == ("prompt_only", False)
    assert data.prompt_texts(dataset, tokenizer=None, where="d") == ["a post"]
    with pytest.raises(ValueError, match=r"columns \['prompt', 'chosen', 'rejected'\] must all be strings"):
        data.detect_format(dataset, "d", accepted=["preference", "implicit_preference"])
    # sft reads messages even beside preference columns it ignores
    both = datasets.Dataset.from_list([{"messages": messages("q", "a"), "chosen": "x", "rejected": "y"}])
    assert data.detect_format(both, "d", accepted=["prompt_completion", "language_modeling"]) == (
        "language_modeling",
        True,
    )


def test_trl_flags_that_mean_nothing_here_are_noted_or_refused():
    import dpo
    import grpo
    import online_dpo
    import ppo
    import rloo

    notes = []
    argv = ["--report_to", "wandb", "tensorboard", "--bf16_full_eval", "--logging_first_step", "True", "--beta",
            "0.2", "--no_remove_unused_columns", "--dataset_num_proc=4"]  # fmt: skip
    assert cli.translate_trl_flags(dpo.Args, argv, notes) == ["--beta", "0.2"]
    assert len(notes) == 5 and all("(a TRL flag) is ignored: " in note for note in notes)
    assert (
        run.parse_args(dpo.Args, ["--warmup_steps", "0.1"]).warmup_ratio == 0.1
    )  # dpo.py has no --warmup_steps
    assert (
        run.parse_args(online_dpo.Args, ["--warmup_steps", "0.1"]).warmup_steps == 0.1
    )  # TRL's own flag there
    for args_class, argv, message in [
        (
            online_dpo.Args,
            ["--lora_task_type", "SEQ_CLS"],
            "--lora_task_type (a TRL flag) means nothing here: the task type follows the script",
        ),
        (online_dpo.Args, ["--fp16"], "use --bf16"),
        (dpo.Args, ["--warmup_steps", "100"], "--warmup_steps 100: give the warmup as a fraction"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            run.parse_args(args_class, argv)
    # --logging_steps: TRL's means over the steps where a script has it, one sentence where it logs every update
    assert run.parse_args(online_dpo.Args, ["--logging_steps", "10"]).logging_steps == 10
    assert run.parse_args(grpo.Args, ["--disable_dropout", "False"]).disable_dropout is False
    for module in (rloo, ppo):
        with pytest.raises(
            ValueError, match=re.escape("--logging_steps (a TRL flag) means nothing here: rloo.py")
        ):
            run.parse_args(module.Args, ["--logging_steps", "10"])
    # --reward_fn and --reward_funcs, --reward_model_name_or_path and --reward_model_path: one flag each
    for module, field in [
        (ppo, "reward_fn"),
        (online_dpo, "reward_fn"),
        (grpo, "reward_funcs"),
    ]:
        for flag in ("--reward_fn", "--reward_funcs"):
            value = getattr(
                run.parse_args(module.Args, [flag, "r.py:f", "--reward_model_name_or_path", "m"]), field
            )
            assert value in ("r.py:f", ["r.py:f"])
    # rloo.py keeps TRL 0.19's and TRL 1.16's names apart: the names given pick the version's defaults
    mixed = ["--reward_fn", "f.py:f", "--reward_model_name_or_path", "m", "--sft_model_path", "p"]
    mixed = rloo.fill_sizes(run.parse_args(rloo.Args, mixed), 1)
    assert (mixed.reward_funcs, mixed.reward_model_path, mixed.dialect) == (["f.py:f"], "m", "1.16")
    parsed = ["--reward_funcs", "r.py:f", "--num_generations", "4", "--sft_model_path", "p"]
    parsed = rloo.fill_sizes(run.parse_args(rloo.Args, parsed), 1)
    assert (parsed.reward_funcs, parsed.rloo_k, parsed.dialect) == (["r.py:f"], 4, "1.16")


def test_a_refused_trl_flag_is_one_line(tmp_path):
    proc = run_script(["ilql.py", "--use_peft", "--lora_r", "8"], cwd=ROOT, check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "ilql.py: error: --use_peft (a TRL flag) means nothing here: LoRA is in sft.py, dpo.py, reward.py, "
        "ppo.py, rloo.py, grpo.py and online_dpo.py."
    )


def test_trl_reward_names_and_dotted_paths(tmp_path, monkeypatch):
    import utils.reward_funcs
    import utils.run

    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert utils.reward_funcs.load_reward_fn("my_rewards.short")(["p"], ["c"]) == [0.0]
    with pytest.raises(ValueError, match="one of TRL's built-in rewards"):
        utils.reward_funcs.load_reward_fn("accuracy_reward")
    with pytest.raises(ValueError, match="defines no function named 'long'"):
        utils.reward_funcs.load_reward_fn("my_rewards.long")
