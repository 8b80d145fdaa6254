"""The shared run skeleton: flags, one-line errors, checkpoints (atomic, rotated, exact resume, signals),
the metric tracker's resume and the non-finite guard."""

import json
import os
import random
import signal
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ROOT, run_script
from utils import checkpoint, cli, run, tracking


@dataclass
class FlagArgs:
    bf16: bool = False
    """a boolean"""
    gradient_checkpointing: bool = True
    """another"""
    learning_rate: float = 1.0
    """a number"""


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--bf16", "True"], (True, True)),
        (["--bf16=false", "--gradient_checkpointing", "False"], (False, False)),
        (["--bf16", "--no_gradient_checkpointing"], (True, False)),
        (["--bf16", "1", "--learning_rate", "0.5"], (True, True)),
        ([], (False, True)),
    ],
)
def test_booleans_take_a_value_as_in_trl(argv, expected):
    args = run.parse_args(FlagArgs, argv)
    assert (args.bf16, args.gradient_checkpointing) == expected


def test_boolean_with_a_bad_value_is_refused():
    with pytest.raises(ValueError, match="--bf16 takes true or false"):
        run.normalize_bool_flags(FlagArgs, ["--bf16=maybe"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--zzz"], "unknown flag --zzz; see --help"),
        (["--learning_rat", "0.1"], "unknown flag --learning_rat; did you mean --learning_rate?"),
        (["--bf16", "--gradient-checkpointin"], "did you mean --gradient_checkpointing?"),
    ],
)
def test_unknown_flags_are_refused_in_one_sentence(argv, message):
    with pytest.raises(ValueError, match=message):
        run.parse_args(FlagArgs, argv)


def test_aliases_and_negations_are_known_flags():
    import dpo
    import sft

    assert {"max_steps", "total_steps", "no_bf16", "help"} <= cli.known_flags(sft.Args)
    assert {"precompute_ref_logps", "no_precompute_ref_log_probs"} <= cli.known_flags(dpo.Args)
    assert run.parse_args(sft.Args, ["--max_steps", "7", "--bf16", "False"]).total_steps == 7


def test_run_cli_turns_usage_errors_into_one_line_and_shows_other_value_errors(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(os.getcwd())!r})
        from dataclasses import dataclass
        from utils import run

        @dataclass
        class Args:
            n: int = 1
            \"\"\"a number\"\"\"

        def main(args):
            if args.n == 3:
                raise run.UsageError(f"--n must be even, got {{args.n}}.")
            int("not a number")  # a bug, not a mistake in the command line

        run.run_cli(Args, main)
        """)
    )
    proc = run_script([str(script), "--n", "3"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "bad.py: error: --n must be even, got 3."
    assert "Traceback" not in proc.stderr
    proc = run_script([str(script), "--n", "4"], check=False)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ValueError: invalid literal for int()" in proc.stderr


class Accel(SimpleNamespace):
    """A one-process stand-in with the accelerator attributes the checkpointer uses."""

    def __init__(self):
        super().__init__(
            device=torch.device("cpu"), num_processes=1, process_index=0, is_main_process=True,
            state=SimpleNamespace(deepspeed_plugin=None),
        )  # fmt: skip

    def wait_for_everyone(self):
        pass


def make_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), save_steps=2, save_total_limit=2,
                resume_from_checkpoint=None, run_name="run")  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def train_steps(model, optimizer, generator, steps):
    for _ in range(steps):
        x = (
            torch.randn(4, 3, generator=generator)
            + torch.randn(4, 3)
            + float(np.random.rand())
            + random.random()
        )
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_checkpoint_resume_is_exact_and_rotates(tmp_path):
    accel = Accel()

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1), torch.Generator().manual_seed(5)

    # uninterrupted: 6 steps
    model, optimizer, generator = fresh()
    random.seed(1), np.random.seed(1)
    train_steps(model, optimizer, generator, 6)
    expected = model.weight.detach().clone()

    # 4 steps with a checkpoint every 2, then resume from `latest` and do the last 2
    args = make_args(tmp_path)
    model, optimizer, generator = fresh()
    random.seed(1), np.random.seed(1)
    ckpt = checkpoint.Checkpointer(accel, args)
    for step in range(1, 5):
        train_steps(model, optimizer, generator, 1)
        ckpt.maybe_save(
            step, {"policy": model}, {"policy": optimizer}, {"g": generator}, {"episode": step * 4}
        )
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(args.output_dir)] == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    os.makedirs(os.path.join(args.output_dir, "tmp-checkpoint-6"))  # a write killed half-way is ignored
    torch.manual_seed(123), random.seed(9), np.random.seed(9)  # the resumed process starts elsewhere
    model, optimizer, generator = fresh()
    resumed = checkpoint.Checkpointer(
        accel, make_args(tmp_path, resume_from_checkpoint="latest", run_name=None)
    )
    state = resumed.resume({"policy": model}, {"policy": optimizer}, {"g": generator})
    assert state["step"] == 4 and state["episode"] == 16 and state["run_name"] == "run"
    train_steps(model, optimizer, generator, 2)
    assert torch.equal(model.weight, expected)


def test_resume_errors_are_one_sentence(tmp_path, capsys):
    ckpt = checkpoint.Checkpointer(Accel(), make_args(tmp_path, resume_from_checkpoint="latest"))
    assert (
        ckpt.resume_path is None and "starting from scratch" in capsys.readouterr().out
    )  # nothing to resume
    with pytest.raises(ValueError, match="is not a checkpoint"):
        checkpoint.Checkpointer(Accel(), make_args(tmp_path, resume_from_checkpoint=str(tmp_path)))
    args = make_args(tmp_path, save_steps=1, seed=1)
    checkpoint.Checkpointer(Accel(), args).save(1, {"policy": torch.nn.Linear(2, 2)})
    other = make_args(tmp_path, resume_from_checkpoint="latest", seed=2)
    with pytest.raises(ValueError, match=r"belongs to another run \(--seed \d+ there, \d+ here\)"):
        checkpoint.Checkpointer(Accel(), other)


def test_sigterm_saves_and_names_the_checkpoint(tmp_path):
    args = make_args(tmp_path, save_steps=0)
    ckpt = checkpoint.Checkpointer(Accel(), args)
    model = torch.nn.Linear(2, 2)
    assert ckpt.maybe_save(1, {"policy": model}) is None  # no signal, no save_steps: nothing written
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(run.TrainingInterrupted, match="checkpoint-2") as info:
        ckpt.maybe_save(2, {"policy": model})
    assert info.value.exit_code == 143
    assert checkpoint.list_checkpoints(args.output_dir)[-1].endswith("checkpoint-2")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_sigterm_between_micro_batches_saves_the_last_finished_step(tmp_path):
    """A signal inside a step that has not stepped the optimizer yet: the last finished step is saved with
    the random state it left (as a save at its end would have been), the step is dropped. After an optimizer
    step, and in a fresh run's first step, the step finishes and the end-of-step save stops the run."""
    args = make_args(tmp_path, save_steps=0)
    ckpt = checkpoint.Checkpointer(Accel(), args)
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(5)
    saving = dict(models={"policy": model}, optimizers={"policy": optimizer}, generators={"g": generator})
    assert ckpt.resume(**saving) is None
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        ckpt.boundary()  # a fresh run's first step: nothing finished to save yet
        ckpt.stop.name = None
        train_steps(model, optimizer, generator, 1)
        ckpt.maybe_save(1, **saving, state={"tokens": [1]})
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        drawn = (torch.rand(3), torch.rand(3, generator=generator))  # step 2 starts: the same draws on resume
        model(torch.ones(1, 3)).sum().backward()  # a micro-batch, no optimizer step
        ckpt.boundary()  # no signal: nothing happens
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(run.TrainingInterrupted, match=r"checkpoint-1 at step 1 \(step 2 was cut short"):
            ckpt.boundary()
        saved = checkpoint.list_checkpoints(args.output_dir)
        assert [os.path.basename(p) for p in saved] == ["checkpoint-1"]
        with open(os.path.join(saved[0], checkpoint.STATE_FILE)) as f:
            assert json.load(f)["tokens"] == [1]
        fresh = torch.nn.Linear(3, 3)
        again = torch.Generator()
        resumed = checkpoint.Checkpointer(Accel(), make_args(tmp_path, resume_from_checkpoint="latest"))
        resumed.resume({"policy": fresh}, {"policy": torch.optim.SGD(fresh.parameters())}, {"g": again})
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
        assert torch.equal(torch.rand(3), drawn[0]) and torch.equal(torch.rand(3, generator=again), drawn[1])

        # Once the optimizer stepped, the step runs to its end and maybe_save stops the run there.
        resumed.stop.name = None
        train_steps(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), again, 1)
        os.kill(os.getpid(), signal.SIGTERM)
        resumed.boundary()
        with pytest.raises(run.TrainingInterrupted, match=r"checkpoint-2 at step 2; continue"):
            resumed.maybe_save(2, {"policy": fresh})
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_check_finite_names_step_and_quantity():
    tracking.check_finite(3, loss=torch.tensor(1.0), scores=torch.ones(4))
    with pytest.raises(run.NonFiniteError, match=r"step 7: scores is not finite"):
        tracking.check_finite(7, loss=1.0, scores=torch.tensor([1.0, float("nan")]))
    with pytest.raises(
        run.NonFiniteError, match=r"step 2: loss is not finite .*; the last good checkpoint is c-1"
    ):
        tracking.check_finite(2, None, "c-1", loss=float("inf"))


def test_tracker_resume_drops_later_steps(tmp_path):
    args = SimpleNamespace(logging_dir=str(tmp_path), run_name="r", track=False)
    accel = Accel()
    tracker = tracking.Tracker(args, SimpleNamespace(accelerator=accel, resumed={}))
    for step in range(1, 6):
        tracker.log({"loss": float(step)}, step)
    tracker.close()
    tracker = tracking.Tracker(args, SimpleNamespace(accelerator=accel, resumed={"step": 3}))
    tracker.log({"loss": 40.0}, 4)
    tracker.close()
    with open(tmp_path / "r" / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [1, 2, 3, 4]


def test_release_freed_host_memory_returns_the_heaps_freed_pages():
    """What glibc keeps after a rollout-like phase leaves RSS when the scripts call release_freed_host_memory.
    In a child process, so this process's allocator is left as it was. Where the C library has no malloc_trim
    the call must still be harmless."""
    import ctypes
    import subprocess
    import sys

    code = textwrap.dedent(
        """
        import ctypes, sys
        sys.path.insert(0, sys.argv[1])
        from utils import run
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 / 2**20

        mib = 2**20
        libc.free(libc.malloc(8 * mib))  # a freed mapped block raises glibc's threshold: 1 MiB blocks now use the heap
        blocks = [libc.malloc(mib) for _ in range(200)]
        for block in blocks:
            libc.memset(block, 1, mib)
        for block in blocks[:-1]:  # the last one keeps the heap's top in use, so glibc does not shrink it itself
            libc.free(block)
        before = rss_mib()
        run.release_freed_host_memory()
        print(before, rss_mib())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, check=True
    )
    if getattr(ctypes.CDLL(None), "malloc_trim", None) is None or not os.path.exists("/proc/self/statm"):
        return  # ran without error: all that is promised without glibc
    before, after = map(float, result.stdout.split())
    assert before - after > 150, (before, after)


def test_a_copy_without_zero3_runs_all_but_zero3(tmp_path):
    """A copy with utils/run.py but not utils/zero3.py: without ZeRO-3, frozen models, sampling and loading take
    their plain path and never look for the file; under ZeRO-3 one sentence names it."""
    import subprocess
    import sys

    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("")
    (tmp_path / "utils" / "run.py").write_text((ROOT / "utils" / "run.py").read_text())
    code = textwrap.dedent(
        """
        import sys
        from types import SimpleNamespace
        import torch
        import utils.run

        def accelerator(plugin):
            return SimpleNamespace(device=torch.device("cpu"), state=SimpleNamespace(deepspeed_plugin=plugin))

        model = torch.nn.Linear(2, 2)
        plain = accelerator(None)
        assert utils.run.prepare_frozen(model, plain) is model and not model.weight.requires_grad
        with utils.run.unsharded_loading(plain), utils.run.gathered_for_generation(model, plain) as bare:
            assert bare is model and not utils.run.gathered(model)
        assert "utils.zero3" not in sys.modules
        try:
            utils.run.gathered_for_generation(model, accelerator(SimpleNamespace(zero_stage=3)))
        except ValueError as error:
            print(error)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    said = "a DeepSpeed ZeRO-3 launch needs utils/zero3.py, which this copy lacks"
    assert proc.stdout.startswith(said), proc


@pytest.mark.parametrize(
    "script, flags",
    [
        ("grpo", dict(max_completion_length=6, num_generations=2, max_steps=1)),
        ("online_dpo", dict(max_new_tokens=6, max_steps=1)),
    ],
)
def test_main_returns_the_metrics_of_its_model_card(script, flags, world, tmp_path, fresh_accelerate_state):
    """As every sibling's main(): a notebook or a sweep gets the run's final metrics back."""
    import importlib

    module = importlib.import_module(script)
    args = module.Args(
        model_name_or_path=str(world / "policy"), reward_model_path=str(world / "reward"),
        dataset_name=str(world / "dataset"), dataset_train_split="sft", per_device_train_batch_size=4,
        output_dir=str(tmp_path / "out"), logging_dir=str(tmp_path / "runs"), run_name="r", **flags,
    )  # fmt: skip
    metrics = module.main(args)
    logged = [json.loads(line) for line in open(tmp_path / "runs" / "r" / "metrics.jsonl")]
    shared = set(logged[-1]) & set(metrics)  # the last logged line's metrics are the returned ones
    assert "loss" in " ".join(shared) and {k: metrics[k] for k in shared} == {
        k: logged[-1][k] for k in shared
    }
    assert (tmp_path / "out" / "README.md").exists()
