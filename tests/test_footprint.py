"""The copy footprint: what a copy of each script carries from utils/, printed, and stated in the README."""

import shutil

import pytest
import readability

from conftest import ROOT, run_script


def test_readme_states_each_scripts_copy_footprint():
    """The README's table equals what benchmark/readability.py computes from the imports (regenerate it with
    `python benchmark/readability.py --readme`); the figures are printed for the log."""
    table = readability.footprint_table(ROOT)
    print("\n" + table)
    readme = (ROOT / "README.md").read_text()
    stated = readme[
        readme.index(readability.README_START) + len(readability.README_START) : readme.index(
            readability.README_END
        )
    ]
    assert stated.strip() == table, (
        "README's footprint table is stale: run python benchmark/readability.py --readme"
    )


def test_footprint_follows_module_level_imports_through_utils(tmp_path):
    """The core follows module-level imports through utils/ (an `if __name__` block counts); what a script or
    its core imports only inside a function, or by utils.run.optional_module, is optional, with its own imports."""
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text('"""doc"""\n')
    (tmp_path / "utils" / "b.py").write_text("from utils import e\ndef f():\n    from utils import c\n")
    (tmp_path / "utils" / "c.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "utils" / "d.py").write_text("unused = 1\n")
    (tmp_path / "utils" / "e.py").write_text("e = 1\n")
    (tmp_path / "utils" / "f.py").write_text("import utils.g\n")
    (tmp_path / "utils" / "g.py").write_text("g = 1\n")
    (tmp_path / "utils" / "h.py").write_text("h = 1\n")
    (tmp_path / "s.py").write_text(
        "import torch\nimport utils.b\nif __name__ == '__main__':\n    import utils.h\n"
        "def main(args):\n    if args.flag:\n        utils.run.optional_module('utils.f', '--flag')\n"
    )
    assert readability.footprint(tmp_path, tmp_path / "s.py") == {
        "utils/__init__.py": 1,
        "utils/b.py": 3,
        "utils/e.py": 1,
        "utils/h.py": 1,
    }
    assert readability.optional(tmp_path, tmp_path / "s.py") == {
        "utils/c.py": 2,
        "utils/f.py": 1,
        "utils/g.py": 1,
    }


def test_vllm_is_optional_for_the_scripts_that_sample_with_it():
    """rloo.py, ppo.py and grpo.py import utils/vllm.py only with --use_vllm; no core module imports it."""
    for script in ("rloo", "ppo", "grpo"):
        assert "utils/vllm.py" not in readability.footprint(ROOT, ROOT / f"{script}.py"), script
        assert "utils/vllm.py" in readability.optional(ROOT, ROOT / f"{script}.py"), script


OPTIONAL_MODULES = (
    "utils/cli.py",
    "utils/context.py",
    "utils/dynamic_sampling.py",
    "utils/environments.py",
    "utils/lm_head.py",
    "utils/judges.py",
    "utils/lora.py",
    "utils/loss_variants.py",
    "utils/paths.py",
    "utils/plots.py",
    "utils/reward_funcs.py",
    "utils/reward_tokenizer.py",
    "utils/rollout_func.py",
    "utils/safeguards.py",
    "utils/sampling_knobs.py",
    "utils/tools.py",
    "utils/trl_flags.py",
    "utils/vllm.py",
    "utils/zero3.py",
)


def test_no_core_imports_an_optional_module():
    """The optional modules stay out of every script's core (imports point down: optional on core, never back)."""
    for script in readability.SCRIPTS:
        core = readability.footprint(ROOT, ROOT / f"{script}.py")
        assert not set(OPTIONAL_MODULES) & set(core), script


@pytest.fixture(scope="module")
def core_copy(world, tmp_path_factory):
    """rloo.py copied with its core alone (no optional module), and a default tiny run of it that trained."""
    out = tmp_path_factory.mktemp("core_copy")
    shutil.copy(ROOT / "rloo.py", out / "rloo.py")
    (out / "utils").mkdir()
    for module in readability.footprint(ROOT, ROOT / "rloo.py"):
        shutil.copy(ROOT / module, out / module)
    flags = [
        "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--rloo_k", "2",
        "--per_device_train_batch_size", "4", "--total_episodes", "8", "--response_length", "8",
        "--num_sample_generations", "0", "--logging_dir", str(out / "runs"), "--run_name", "run",
    ]  # fmt: skip
    run_script(["rloo.py", *flags, "--output_dir", str(out / "trained"), "--save_steps", "1"], cwd=out)
    return out, flags


@pytest.mark.parametrize(
    "module, asked, says",
    [
        ("utils/trl_flags.py", ["--num_generations", "2"], "--num_generations (a TRL 1.16 flag) needs"),
        ("utils/reward_tokenizer.py", ["--reward_tokenizer_path", "OTHER"], "a reward model with another"),
        ("utils/lora.py", ["--use_peft"], "--use_peft needs"),
        ("utils/reward_funcs.py", ["--reward_fn", "rewards.py:length"], "--reward_fn needs"),
        ("utils/context.py", ["--context_overflow", "cut"], "--context_overflow cut needs"),
    ],
)
def test_copy_without_an_optional_module_names_it_when_asked(core_copy, world, module, asked, says):
    """A copy of rloo.py with its core alone ran a default tiny training (core_copy); asked for the feature of a
    module it lacks (a TRL 1.16 flag; a reward tokenizer other than the policy's), it exits 2 with one line
    naming the file to copy."""
    from transformers import AutoTokenizer

    out, flags = core_copy
    assert not (out / module).exists() and (out / "trained" / "config.json").exists()
    if "OTHER" in asked:  # the policy's vocabulary with another EOS: not the same tokenizer
        other = AutoTokenizer.from_pretrained(world / "policy")
        other.eos_token = "<|pad|>"
        other.save_pretrained(out / "other_tokenizer")
        asked = [str(out / "other_tokenizer") if a == "OTHER" else a for a in asked]
    if "--reward_fn" in asked:  # TRL 0.19's rloo takes one reward: the function instead of the model
        at = flags.index("--reward_model_path")
        flags = flags[:at] + flags[at + 2 :]
    proc = run_script(["rloo.py", *flags, *asked, "--output_dir", str(out / "asked")], cwd=out, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr
    assert last.startswith(f"rloo.py: error: {says}"), last
    assert f"needs {module}, which this copy lacks" in last, last
    assert "copy it" in last and "Traceback" not in proc.stderr, proc.stderr


def test_copy_without_cli_parses_with_tyro(core_copy):
    """Without utils/cli.py (TRL's flags, one-sentence flag errors, grouped --help) a copy parses with tyro
    alone: its own --help, and its own error for an unknown flag, without a traceback."""
    out, flags = core_copy
    assert not (out / "utils" / "cli.py").exists()
    shown = run_script(["rloo.py", "--help"], cwd=out)
    assert "--kl-coef" in shown.stdout or "--kl_coef" in shown.stdout, shown.stdout
    refused = run_script(["rloo.py", *flags, "--kl_coeff", "0.1"], cwd=out, check=False)
    assert refused.returncode != 0 and "kl_coeff" in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr


@pytest.mark.parametrize(
    "flag, value", [("--dataset_name", "./data/missing"), ("--sft_model_path", "./models/missing")]
)
def test_copy_without_paths_says_a_missing_path_in_one_line(core_copy, flag, value):
    """Without utils/paths.py (the finer path and hub-id diagnostics) a copy still stops on a path that does not
    exist with one line naming the flag, no traceback, before it trains."""
    out, flags = core_copy
    assert not (out / "utils" / "paths.py").exists()
    at = flags.index(flag)
    asked = [*flags[: at + 1], value, *flags[at + 2 :], "--output_dir", str(out / "missing")]
    proc = run_script(["rloo.py", *asked], cwd=out, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert last == f"rloo.py: error: {flag} {value} does not exist.", last


def test_copy_with_its_core_alone_resumes_exactly(core_copy):
    """The core copy's run saved a checkpoint at each of its 2 updates; resumed from the first into another
    folder (without utils/safeguards.py: no micro-batch stop, no damage or flag checks), it ends with the same
    weights bit for bit."""
    from safetensors.torch import load_file

    out, flags = core_copy
    assert not (out / "utils" / "safeguards.py").exists()
    first = out / "trained" / "checkpoint-1"
    assert first.is_dir() and (out / "trained" / "checkpoint-2").is_dir()
    resumed = out / "resumed"
    run_script(
        ["rloo.py", *flags, "--output_dir", str(resumed), "--resume_from_checkpoint", str(first)], cwd=out
    )
    straight, again = (
        load_file(out / "trained" / "model.safetensors"),
        load_file(resumed / "model.safetensors"),
    )
    assert straight.keys() == again.keys() and all(straight[k].equal(again[k]) for k in straight)


@pytest.mark.parametrize(
    "script",
    [
        "sft",
        *[pytest.param(s, marks=pytest.mark.slow) for s in ("reward", "dpo", "ppo", "grpo", "online_dpo")],
    ],
)
def test_each_copy_with_its_core_alone_trains_and_resumes_exactly(world, tmp_path, script):
    """Each script copied with its core alone (benchmark/reliability/ab_compare.py's tiny command, a
    checkpoint every step) trains; resumed from its first checkpoint into another folder it ends with the same
    weights bit for bit."""
    import ab_compare
    from safetensors.torch import load_file

    copy = tmp_path / "copy"
    (copy / "utils").mkdir(parents=True)
    shutil.copy(ROOT / f"{script}.py", copy / f"{script}.py")
    for module in readability.footprint(ROOT, ROOT / f"{script}.py"):
        shutil.copy(ROOT / module, copy / module)
    command = ab_compare.commands(world, tmp_path)[script]
    if (
        script == "grpo"
    ):  # ab_compare's grpo scores with a reward function (optional): the reward model instead
        at = command.index("--reward_funcs")
        command = command[:at] + command[at + 2 :] + ["--reward_model_path", str(world / "reward")]
        command[command.index("--model_name_or_path") + 1] = str(world / "policy")
        command[command.index("--dataset_name") + 1] = str(world / "dataset")
        command += ["--dataset_train_split", "sft"]
    flags = [
        *command,
        "--logging_dir",
        str(tmp_path / "runs"),
        "--save_steps",
        "1",
    ]
    run_script([f"{script}.py", *flags, "--output_dir", str(tmp_path / "a"), "--run_name", "a"], cwd=copy)
    first = sorted((tmp_path / "a").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[0]
    run_script([f"{script}.py", *flags, "--output_dir", str(tmp_path / "b"), "--run_name", "b",
                "--resume_from_checkpoint", str(first)], cwd=copy)  # fmt: skip
    straight, resumed = (
        load_file(tmp_path / "a" / "model.safetensors"),
        load_file(tmp_path / "b" / "model.safetensors"),
    )
    assert straight.keys() == resumed.keys() and all(straight[k].equal(resumed[k]) for k in straight)


TOOLS = [
    "utils/tools.py",
    "utils/reward_funcs.py",
    "utils/context.py",
    "utils/paths.py",
]  # and what tools.py imports


@pytest.mark.parametrize(
    "script, asked, module, extra",
    [
        ("grpo", ["--loss_type", "vespo"], "utils/loss_variants.py", []),
        ("grpo", ["--top_entropy_quantile", "0.5"], "utils/loss_variants.py", []),
        ("grpo", ["--filter_groups"], "utils/dynamic_sampling.py", []),
        ("grpo", ["--top_k", "5"], "utils/sampling_knobs.py", []),
        ("grpo", ["--environment_factory", "env.py:Env"], "utils/tools.py", []),
        ("grpo", ["--environment_factory", "env.py:Env"], "utils/environments.py", TOOLS),
        ("online_dpo", ["--judge", "judge.py:first"], "utils/judges.py", []),
    ],
)
def test_copy_without_an_optional_module_names_it_before_loading(
    world, tmp_path, script, asked, module, extra
):
    """A script copied with its core alone (and `extra` optional files), asked for a rarer loss or mask, dynamic
    sampling, a sampling knob or an environment (grpo.py) or a judge (online_dpo.py): exit 2 with one line naming
    the file to copy, before any model loads or --output_dir is made."""
    (tmp_path / "utils").mkdir()
    shutil.copy(ROOT / f"{script}.py", tmp_path / f"{script}.py")
    for copied in [*readability.footprint(ROOT, ROOT / f"{script}.py"), *extra]:
        shutil.copy(ROOT / copied, tmp_path / copied)
    assert not (tmp_path / module).exists()
    (tmp_path / "judge.py").write_text("def first(prompts, pairs):\n    return [0] * len(pairs)\n")
    (tmp_path / "env.py").write_text("class Env:\n    def reset(self, **row):\n        return None\n")
    reward = [] if script == "online_dpo" else ["--reward_model_path", str(world / "reward")]
    flags = ["--model_name_or_path", str(world / "policy"), *reward, "--dataset_name", str(world / "dataset"),
             "--dataset_train_split", "sft", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = run_script([f"{script}.py", *flags, *asked], cwd=tmp_path, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    says = " ".join(asked) if asked[0] == "--loss_type" else asked[0]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith(f"{script}.py: error: {says} needs {module}, which this copy lacks"), last
    assert not (tmp_path / "out").exists()


def test_layout_names_every_utils_module():
    """docs/layout.md, the map of the tree, names every module in utils/ (a new or moved module included)."""
    layout = (ROOT / "docs" / "layout.md").read_text()
    missing = [
        p.name
        for p in sorted((ROOT / "utils").glob("*.py"))
        if p.name != "__init__.py" and p.name not in layout
    ]
    assert not missing, f"docs/layout.md does not name {missing}"
