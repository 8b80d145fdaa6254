"""#26 "Scale out without surprises", one test per case: two "nodes" on loopback train the weights of one 2-process
launch, bit for bit, and a multi-machine launch without a process group is refused on every process; `latest`
with only damaged checkpoints starts from scratch in the same folder; a cut JSON line, an output folder that
cannot be written and sequences longer than the model's positions each end in one sentence before anything
trains; a resumed run names its checkpoint and counts its training time across resumes; an error after a
progress bar starts a line of its own. (SIGTERM on two processes: tests/test_never_silently_wrong.py.)"""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_distributed_rl import script_flags
from test_resume import dpo_flags, sft_flags, weights

from conftest import OFFLINE_ENV, ROOT, free_port, run_script, run_torchrun


def two_nodes(script_args, multi_gpu=True, timeout=300):
    """Launch the script as two machines of one process each on loopback, as the user would on two nodes
    (`accelerate launch --num_machines 2 --machine_rank R`); returns both CompletedProcess-like tuples."""
    env = {**os.environ, **OFFLINE_ENV}
    env.pop("ACCELERATE_USE_CPU", None)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        command = [sys.executable, "-m", "accelerate.commands.launch", *(["--multi_gpu"] if multi_gpu else []),
                   "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2",
                   "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no",
                   "--dynamo_backend", "no", *map(str, script_args)]  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))  # fmt: skip
    try:
        return [(p.wait(timeout=timeout), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)


def rloo_flags(world, tmp_path, name, *extra):
    """2 updates of 8 completions, 2 + 2 rows a micro-batch on each of two processes (tests/test_distributed_rl)."""
    return [f for f in script_flags("rloo.py", world, tmp_path, name, 2, "--total_episodes", "16", *extra)
            if f != "--normalize_reward"]  # fmt: skip


def same_weights(a, b):
    first, second = weights(a), weights(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


# ---- 1. two nodes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["rloo.py", "sft.py"])
def test_two_nodes_train_the_weights_of_one_two_process_launch(script, world, tmp_path):
    if script == "rloo.py":
        flags = lambda name: rloo_flags(world, tmp_path, name)  # noqa: E731
    else:
        flags = lambda name: sft_flags(world, tmp_path / name, name, steps=3, per_device_train_batch_size=4)  # noqa: E731
    run_torchrun([script, *flags("one_node")])
    results = two_nodes([script, *flags("two_nodes")])
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    assert same_weights(tmp_path / "one_node", tmp_path / "two_nodes")
    assert not same_weights(tmp_path / "one_node", world / "policy")  # it trained


def test_two_nodes_without_a_process_group_are_refused_on_every_process(world, tmp_path):
    import utils.data
    import utils.loading
    import utils.run

    out = tmp_path / "alone"
    results = two_nodes(["rloo.py", *rloo_flags(world, tmp_path, "alone")], multi_gpu=False)
    # The script exits 2 with its sentence; accelerate's simple launcher then raises CalledProcessError (exit 1).
    for code, _, stderr in results:
        (line,) = [line for line in stderr.splitlines() if line.startswith("rloo.py: error: ")]
        assert code == 1 and "returned non-zero exit status 2." in stderr, stderr[-3000:]
        assert line.startswith(
            "rloo.py: error: accelerate launch was asked for several processes or machines"
        )
        assert "add --multi_gpu to the launch command on every machine" in line
    assert not out.exists() and not (tmp_path / "runs").exists()
    # What each launcher exports: refused without WORLD_SIZE; torchrun, mpirun or a plain `python` are left alone.
    simple = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    assert utils.run.launch_without_process_group(simple)
    assert not utils.run.launch_without_process_group({**simple, "WORLD_SIZE": "2"})
    assert not utils.run.launch_without_process_group({**simple, "OMPI_COMM_WORLD_SIZE": "2"})
    assert not utils.run.launch_without_process_group({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert not utils.run.launch_without_process_group({"ACCELERATE_DYNAMO_BACKEND": "NO"})


# ---- 2. `latest` with nothing usable ----------------------------------------------------------------------------
def test_latest_with_only_a_damaged_checkpoint_starts_fresh_in_the_same_folder(world, tmp_path):
    out = tmp_path / "requeued"
    flags = sft_flags(world, out, "requeued", steps=2)
    run_script(["sft.py", *flags])
    straight = weights(out)
    for file in out.iterdir():  # a kill during the final save, after a kill that cut the only checkpoint
        if file.is_file():
            file.unlink()
    with open(out / "checkpoint-2" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    proc = run_script(["sft.py", *flags, "--resume_from_checkpoint", "latest"])
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("requeued.damaged-")]
    line = (
        f"--resume_from_checkpoint latest found no usable checkpoint: moved the previous contents of {out} "
    )
    assert line + f"(checkpoint-2) to {aside}" in proc.stdout
    assert (aside / "checkpoint-2" / "model.safetensors").stat().st_size == 1000
    fresh = weights(out)  # trained from scratch again, to the same weights
    assert all(torch.equal(straight[k], fresh[k]) for k in straight) and (out / "checkpoint-2").is_dir()


def test_only_damaged_checkpoints_are_set_aside(tmp_path, capsys):
    from types import SimpleNamespace

    from utils.safeguards import set_aside_damaged

    alone = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    (tmp_path / "out" / "checkpoint-4").mkdir(parents=True)
    (tmp_path / "out" / "model.safetensors").write_bytes(b"")  # a finished run's model: left where it is
    set_aside_damaged(alone, str(tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-4", "model.safetensors"]
    (tmp_path / "out" / "model.safetensors").unlink()
    (tmp_path / "out" / "tmp-checkpoint-6").mkdir()
    set_aside_damaged(alone, str(tmp_path / "out"))
    assert not list((tmp_path / "out").iterdir()) and "no usable checkpoint: moved" in capsys.readouterr().out


# ---- 3. bad inputs: one sentence, before anything trains ---------------------------------------------------------
def cut_jsonl(source, path, rows=40, cut_line=5):
    lines = open(source).read().splitlines()[:rows]
    lines[cut_line - 1] = lines[cut_line - 1][: len(lines[cut_line - 1]) // 2]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "script",
    [
        "sft.py",
        pytest.param("dpo.py", marks=pytest.mark.slow),
        pytest.param("grpo.py", marks=pytest.mark.slow),
    ],
)  # one loader (utils.data.load_split) for all: one script in CI
def test_a_jsonl_line_cut_short_is_named(script, world, tmp_path):
    data = world / "dataset" / ("preference.jsonl" if script == "dpo.py" else "sft.jsonl")
    bad = cut_jsonl(data, tmp_path / "bad.jsonl")
    common = ["--dataset_name", str(bad), "--dataset_train_split", "train", "--output_dir", str(tmp_path / "out"),
              "--logging_dir", str(tmp_path / "runs")]  # fmt: skip
    if script == "grpo.py":
        extra = ["--model_name_or_path", str(world / "policy"), "--reward_model_path", str(world / "reward")]
    else:
        extra = ["--model_name_or_path", str(world / "policy"), "--eval_strategy", "no"]
    proc = run_script([script, *common, *extra], check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith(f"{script}: error: --dataset_name {bad}: line 5 is not valid JSON (")
    assert last.endswith("); fix or remove that line.") and not (tmp_path / "out").exists()


def test_bad_json_line_finds_the_line():
    import tempfile

    from utils.paths import bad_json_line

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "x.jsonl")
        open(path, "w").write('{"a": 1}\n\n{"a": 2}\n{"a": \n')
        assert bad_json_line(path)[0] == 4
        open(path, "w").write('[\n{"a": 1},\n{"a": 2\n]\n')
        assert bad_json_line(path)[0] == 4
        open(path, "w").write('{"a": 1}\n{"a": 2}\n')
        assert bad_json_line(path) is None


@pytest.mark.parametrize("script", ["sft.py", pytest.param("ppo.py", marks=pytest.mark.slow)])
def test_an_output_dir_that_cannot_be_written_is_refused_before_training(script, world, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "out"  # a path through a file: unwritable for root too (a chmod would not stop root)
    if script == "sft.py":
        flags = sft_flags(world, out, "unwritable", steps=2)
    else:
        flags = [*script_flags("ppo.py", world, tmp_path, "unwritable", 1), "--output_dir", str(out)]
    proc = run_script([script, *flags], check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last == (f"{script}: error: --output_dir {out} cannot be written ({blocker} is a file); pass a "
                    "folder this user can write to.")  # fmt: skip
    assert not list(tmp_path.glob("**/metrics.jsonl"))  # nothing trained


def test_check_writable(tmp_path):
    from utils.safeguards import check_writable

    check_writable(str(tmp_path / "new" / "deeper"))  # a folder still to be made, under a writable one
    assert not (tmp_path / "new").exists() and not list(tmp_path.iterdir())  # the probe left nothing
    if os.geteuid() != 0:  # permissions bind everyone but root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(ValueError, match="cannot be written"):
            check_writable(str(locked / "out"))


def test_sequences_longer_than_the_model_are_refused_before_loading(world, tmp_path):
    import utils.context
    import utils.data
    import utils.run

    assert utils.context.model_positions(str(world / "policy")) == 256
    out = tmp_path / "out"
    # wrapped packing: positions run along the whole row (bfd's restart at each example, which fits)
    flags = sft_flags(world, out, "long", max_length=2000, packing=True, packing_strategy="wrapped")
    proc = run_script(["sft.py", *flags], check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last == (f"sft.py: error: this run's sequences reach 2000 tokens, more than the 256 positions of "
                    f"--model_name_or_path {world / 'policy'}; lower --max_length so that they fit, or pass "
                    "--context_overflow cut.")  # fmt: skip
    assert not out.exists()
    # Cut by choice: --max_length lowered to the model's positions, said in one line; the blocks fit.
    flags = sft_flags(world, out, "long", steps=1, max_length=2000, packing=True, packing_strategy="wrapped",
                      context_overflow="cut")  # fmt: skip
    proc = run_script(["sft.py", *flags])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("--context_overflow cut")]
    assert lines == [
        "--context_overflow cut: --max_length 2000 lowered to the 256 positions of --model_name_or_path "
        f"{world / 'policy'}"
    ]
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256  # it trained


def long_prompts(tmp_path, words=(60, 2, 70, 3)):
    """A prompt file whose 1st and 3rd prompts exceed the tiny policy's 256 positions."""
    path = tmp_path / "long.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": "the landlord kept my deposit " * n}) + "\n" for n in words)
    )
    return path


def test_rl_prompts_longer_than_the_model_are_refused_or_cut_from_the_left(world, tmp_path):
    """rloo.py: refused in one sentence before loading, naming both ways out; with --context_overflow cut, the
    long prompts keep their last 256 - 6 tokens, one line says how many were cut, and the run trains."""
    flags = ["rloo.py", "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
             "--dataset_name", str(long_prompts(tmp_path)), "--response_length", "6", "--rloo_k", "2",
             "--total_episodes", "8", "--per_device_train_batch_size", "4", "--num_sample_generations", "0",
             "--local_rollout_forward_batch_size", "8", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = run_script(flags, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("rloo.py: error: this run's sequences reach ") and last.endswith(
        f"more than the 256 positions of --sft_model_path {world / 'policy'}; lower --max_prompt_length or "
        "--response_length so that they fit, or pass --context_overflow cut to keep each prompt's last 250 tokens."
    )
    assert not (tmp_path / "out").exists()
    proc = run_script([*flags, "--context_overflow", "cut"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("--context_overflow cut")]
    assert lines == [
        "--context_overflow cut: 2 of 4 prompts cut from the left to 250 tokens, so that prompt + 6 completion "
        f"tokens fit the 256 positions of --sft_model_path {world / 'policy'}"
    ]
    assert (tmp_path / "out" / "model.safetensors").exists()  # it trained


def test_cut_from_left_keeps_the_last_tokens():
    from utils.context import fitted_lengths
    from utils.loading import cut_from_left

    splits = [[[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], None, [[11, 12, 13, 14]]]
    assert cut_from_left(splits, 3) == ([[[3, 4, 5], [6, 7], [8, 9, 10]], None, [[12, 13, 14]]], 2)
    assert cut_from_left(splits, 5) == (splits, 0)
    assert cut_from_left([[]], 2) == ([[]], 0)
    # --max_length down to the positions; a prompt limit no longer under it becomes half of it.
    assert fitted_lengths(2000, 512, 256) == (256, 128)
    assert fitted_lengths(2000, 100, 256) == (256, 100)
    assert fitted_lengths(2000, None, 256) == (256, None)


def test_fit_prompts_cuts_every_split_in_one_line_or_refuses(world, capsys, tmp_path):
    from types import SimpleNamespace

    import utils.context

    policy, flag = str(world / "policy"), "--sft_model_path"
    train, test = [list(range(300)), [7, 8, 9]], [list(range(201)), list(range(200))]
    args = SimpleNamespace(context_overflow="cut", response_length=56)
    fitted = utils.context.fit_prompts([train, test, None], args, "response_length", policy, flag)
    # 256 - 56 = 200: the end of each longer prompt stays, shorter ones are untouched.
    assert fitted == [[list(range(100, 300)), [7, 8, 9]], [list(range(1, 201)), list(range(200))], None]
    assert all(len(p) + 56 <= 256 for split in fitted[:2] for p in split)
    assert capsys.readouterr().out == (
        "--context_overflow cut: 2 of 4 prompts cut from the left to 200 tokens, so that prompt + 56 completion "
        f"tokens fit the 256 positions of --sft_model_path {policy}\n"
    )
    assert utils.context.fit_prompts(fitted, args, "response_length", policy, flag) == fitted
    assert capsys.readouterr().out == ""  # nothing to cut: nothing said
    args.context_overflow = "refuse"
    with pytest.raises(ValueError) as error:
        utils.context.fit_prompts([train, test], args, "response_length", policy, flag)
    assert str(error.value) == (
        f"this run's sequences reach 356 tokens, more than the 256 positions of --sft_model_path {policy}; lower "
        "--max_prompt_length or --response_length so that they fit, or pass --context_overflow cut to keep each "
        "prompt's last 200 tokens."
    )
    args.context_overflow, args.response_length = "cut", 256  # no room left for any prompt token
    with pytest.raises(ValueError) as error:
        utils.context.fit_prompts([train], args, "response_length", policy, flag)
    assert str(error.value) == (
        f"--response_length 256 leaves no room for a prompt in the 256 positions of --sft_model_path {policy}; "
        "lower --response_length."
    )
    with pytest.raises(
        ValueError, match=r"lower --max_completion_length\.$"
    ):  # the flag as the user named it
        utils.context.fit_prompts([train], args, "response_length", policy, flag, "--max_completion_length")
    assert capsys.readouterr().out == ""
    from transformers import MambaConfig

    MambaConfig().save_pretrained(tmp_path / "mamba")  # a config that names no positions
    unknown = SimpleNamespace(context_overflow="refuse", response_length=56)
    assert utils.context.fit_prompts([train], unknown, "response_length", str(tmp_path / "mamba"), flag) == [
        train
    ]


@pytest.mark.parametrize("script", ["sft", "dpo", "reward", "ilql", "ppo", "rloo", "grpo", "online_dpo"])
def test_every_script_with_token_sequences_refuses_overflow_by_default(script):
    import importlib
    import typing

    args_class = importlib.import_module(script).Args
    assert args_class.context_overflow == "refuse"
    assert typing.get_args(typing.get_type_hints(args_class)["context_overflow"]) == ("refuse", "cut")


@pytest.mark.parametrize("script", ["sft", "dpo", "reward", "ilql"])
def test_cut_lengths_pass_each_scripts_own_flag_checks(script, world, capsys):
    """--context_overflow cut lowers --max_length (default 1024) to the 256 positions, and a prompt limit with
    it, so that the script's own checks (0 < --max_prompt_length < --max_length) still pass."""
    import importlib

    import utils.context

    module = importlib.import_module(script)
    for mode in ("refuse", "cut"):
        args = module.Args(model_name_or_path=str(world / "policy"), context_overflow=mode)
        before = getattr(args, "max_prompt_length", None)
        utils.context.fit_max_length(args)
        module.fill_sizes(args, 1)
        assert args.max_length == (1024 if mode == "refuse" else 256)
        prompt = getattr(args, "max_prompt_length", None)
        assert prompt is None or 0 < prompt < args.max_length
    said = capsys.readouterr().out
    lowered = f", --max_prompt_length {before} to 128" if before else ""
    assert said == (
        f"--context_overflow cut: --max_length 1024 lowered to the 256 positions of --model_name_or_path "
        f"{world / 'policy'}{lowered}\n"
    )


def long_rows(tmp_path, script):
    """A train file for `script` of 8 rows, the first longer than the tiny models' 256 positions."""
    row = {"prompt": "the landlord kept my deposit " * 60}
    if script in ("dpo", "reward"):
        row.update(chosen=" ask", rejected=" wait")
    elif script == "ilql":
        row.update(completion=" ask for it back", reward=1.0)
    path = tmp_path / f"{script}.jsonl"
    path.write_text(json.dumps(row) + "\n" + (json.dumps({**row, "prompt": "short"}) + "\n") * 7)
    return path


@pytest.mark.slow  # each script twice: up to its refusal, then one update with the cut (about 30 s each)
@pytest.mark.parametrize("script", ["dpo", "reward", "ilql", "ppo", "online_dpo"])
def test_every_other_script_refuses_longer_sequences_or_cuts_them(script, world, tmp_path):
    """At the default lengths (dpo, reward: --max_length 1024; ilql with --max_prompt_length 512) a 300-token
    prompt is refused before loading; with --context_overflow cut one line says what was cut, and one update
    trains (dpo drops the long prompt's pair, as TRL 1.16's keep_start does)."""
    out, data, policy, reward = (
        tmp_path / "out",
        long_rows(tmp_path, script),
        world / "policy",
        world / "reward",
    )
    model_flag = "--sft_model_path" if script == "ppo" else "--model_name_or_path"
    model = reward if script == "reward" else policy
    flags = {
        "dpo": ["--eval_strategy", "no", "--per_device_train_batch_size", "4"],
        "reward": [
            "--eval_strategy",
            "no",
            "--per_device_train_batch_size",
            "4",
        ],  # 7 pairs left after the cut
        "ilql": [],
        "ppo": ["--reward_model_path", reward, "--response_length", "6", "--total_episodes", "8"],
        "online_dpo": ["--reward_model_path", reward, "--max_new_tokens", "6", "--max_steps", "1"],
    }[script]
    flags = [f"{script}.py", model_flag, model, *flags, "--dataset_name", data, "--output_dir", out]
    if script in ("ppo", "online_dpo"):
        flags += ["--num_sample_generations", "0"]
    proc = run_script(flags, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith(f"{script}.py: error: this run's sequences reach ") and "256 positions" in last
    assert "or pass --context_overflow cut" in last
    assert not out.exists()
    proc = run_script([*flags, "--context_overflow", "cut"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("--context_overflow cut")]
    if script in ("ppo", "online_dpo"):
        # ppo's count holds the first 4 training prompts its sample tables show (the long one among them)
        cut = "2 of 12" if script == "ppo" else "1 of 8"
        said = (
            f"{cut} prompts cut from the left to 250 tokens, so that prompt + 6 completion tokens fit the 256"
        )
        said += f" positions of {model_flag} {model}"
    else:
        said = f"--max_length 1024 lowered to the 256 positions of {model_flag} {model}"
        said += ", --max_prompt_length 512 to 128" if script == "ilql" else ""
    assert lines == [f"--context_overflow cut: {said}"]
    if script == "dpo":
        assert "kept 7 of 8 pairs, dropped 1 whose prompt fills --max_length 256" in proc.stdout
    assert (out / "config.json").exists()


@pytest.mark.slow  # the same helper as rloo.py's (utils.context.fit_prompts)
def test_grpo_prompts_longer_than_the_model_are_refused_before_loading(world, tmp_path):
    out = tmp_path / "out"
    # The longest prompt (under --max_prompt_length 2000) plus --max_completion_length.
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "the landlord kept my deposit " * 60}) + "\n")
    proc = run_script(["grpo.py", "--model_name_or_path", str(world / "policy"), "--dataset_name", str(prompts),
                       "--reward_model_path", str(world / "reward"), "--max_prompt_length", "2000",
                       "--max_completion_length", "8", "--output_dir", str(out)], check=False)  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        last.startswith("grpo.py: error: this run's sequences reach ")
        and "more than the 256 positions" in last
    )
    assert last.endswith(
        "lower --max_prompt_length or --max_completion_length so that they fit, or pass --context_overflow cut "
        "to keep each prompt's last 248 tokens."
    )
    assert not out.exists()


# ---- 5. what a resumed run says and counts; an error after a progress bar ----------------------------------------
def test_a_resumed_run_names_its_checkpoint_and_counts_every_part_of_its_time(world, tmp_path):
    out = tmp_path / "dpo"
    flags = dpo_flags(world, out, "d", steps=2)
    run_script(["dpo.py", *flags])
    for file in out.iterdir():  # a kill during the final save
        if file.is_file():
            file.unlink()
    proc = run_script(["dpo.py", *flags, "--resume_from_checkpoint", "latest"])
    assert f"resumed from {out / 'checkpoint-2'} (step 2)\n" in proc.stdout
    saved = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["elapsed_seconds"]
    card = (out / "README.md").read_text()
    (seconds,) = [
        float(line.split("|")[2]) for line in card.splitlines() if line.startswith("| train_seconds |")
    ]
    assert saved > 0.05 and seconds >= saved  # the first run's 2 steps, not the resumed run's milliseconds


def test_an_error_after_a_progress_bar_starts_its_own_line(world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(world / "policy")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan_policy")
    AutoTokenizer.from_pretrained(world / "policy").save_pretrained(tmp_path / "nan_policy")
    flags = sft_flags(world, tmp_path / "out", "nan", steps=3, model_name_or_path=tmp_path / "nan_policy")
    proc = run_script(["sft.py", *flags], check=False)
    assert proc.returncode == 1
    at = proc.stderr.index("sft.py: stopped: ")
    assert proc.stderr[at - 1] == "\n", repr(proc.stderr[max(0, at - 200) : at + 40])


def test_sample_table_prompts_are_cut_to_the_model_positions(capsys):
    """A held-out prompt that leaves too little room for the table's new tokens is cut from the left with one
    line, not generated past the positions (a model with learned positions would fail mid-run)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import utils.context
    import utils.generation

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    tokenizer = type("Tokenizer", (), {"pad_token_id": 0, "eos_token_id": 1})()
    prompts = [list(range(2, 16)), [5, 6, 7]]  # 14 + 6 new tokens would reach position 20
    with pytest.raises(IndexError):  # the failure the cut prevents
        utils.generation.generate(model, *utils.generation.left_pad(prompts[:1], 0), 6, 0.0, 2)
    utils.context._SAID.clear()
    responses, _ = utils.generation.complete(model, tokenizer, prompts, 6, 2)
    assert responses.shape == (2, 6)
    line = "sample table: 1 of 2 prompts cut from the left to 10 tokens, so that prompt + 6 new tokens fit"
    assert line in capsys.readouterr().out
    # the same cut again (the next evaluation): the same prompts, no second line
    assert utils.generation.fit_positions(model, prompts, 6) == [list(range(6, 16)), [5, 6, 7]]
    assert utils.generation.fit_positions(model, [[5, 6]], 3) == [[5, 6]]  # fits: nothing cut
    assert capsys.readouterr().out == ""
    with pytest.raises(
        ValueError, match="16 new tokens leave no room for a prompt in the model's 16 positions"
    ):
        utils.generation.fit_positions(model, prompts, 16)
