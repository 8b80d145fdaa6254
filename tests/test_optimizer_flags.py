"""--lr_scheduler_type, --warmup_steps, --weight_decay, --adam_beta1/2, --adam_epsilon and --optim in the RL
scripts: the optimizer TRL's Trainer builds, the learning rates its scheduler gives step by step, and each
script's logged rates on the tiny world."""

import math
from types import SimpleNamespace

import pytest
import torch

from utils.run import LR_SCHEDULES, lr_schedule, trainer_optimizer


def stepped_rates(name, warmup, total, base):
    """The rate of each optimizer step as transformers' Trainer sees it: read, step the optimizer, step the
    scheduler."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("name", LR_SCHEDULES)
@pytest.mark.parametrize("warmup_steps, warmup", [(0.0, 0), (3.0, 3), (0.25, 3)])
def test_schedule_is_the_trainers_step_by_step(name, warmup_steps, warmup):
    args = SimpleNamespace(learning_rate=2e-3, lr_scheduler_type=name, warmup_steps=warmup_steps)
    schedule = lr_schedule(args, 10)
    assert [schedule(s) for s in range(10)] == pytest.approx(stepped_rates(name, warmup, 10, 2e-3), rel=1e-12)


def test_linear_and_cosine_follow_their_equations():
    """From the definitions: warmup s / W, then linear (T - s) / (T - W) or cosine (1 + cos(pi p)) / 2 with
    p = (s - W) / (T - W)."""
    W, T = 2, 8
    linear = lr_schedule(SimpleNamespace(learning_rate=1.0, lr_scheduler_type="linear", warmup_steps=2.0), T)
    cosine = lr_schedule(SimpleNamespace(learning_rate=1.0, lr_scheduler_type="cosine", warmup_steps=0.25), T)
    for s in range(T):
        warm = s / W
        assert linear(s) == pytest.approx(warm if s < W else (T - s) / (T - W))
        assert cosine(s) == pytest.approx(warm if s < W else (1 + math.cos(math.pi * (s - W) / (T - W))) / 2)


def test_bad_schedules_are_one_sentence():
    with pytest.raises(ValueError, match="give the warmup once"):
        lr_schedule(SimpleNamespace(learning_rate=1.0, lr_scheduler_type="linear", warmup_steps=2.0,
                                    warmup_ratio=0.1), 8)  # fmt: skip
    with pytest.raises(ValueError, match="--optim adafactor"):
        trainer_optimizer(torch.nn.Linear(2, 2), SimpleNamespace(optim="adafactor"))


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_optimizer_is_the_trainers(optim, tmp_path):
    """Param groups (which weights decay), betas, epsilon, learning rate and fused kernel equal those of the
    optimizer transformers' Trainer (TRL's base class) creates from the same TrainingArguments."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, attention_bias=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.lm_head.weight.requires_grad_(False)  # frozen weights stay out, as in the Trainer
    flags = dict(
        learning_rate=3e-4, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, optim=optim
    )
    theirs = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[], **flags))
    theirs = theirs.create_optimizer()
    ours = trainer_optimizer(model, SimpleNamespace(**flags))

    def groups(optimizer):
        return sorted(
            (frozenset(id(p) for p in g["params"]), g["weight_decay"], g["betas"], g["eps"], g["lr"], bool(g["fused"]))
            for g in optimizer.param_groups if g["params"]
        )  # fmt: skip

    assert groups(ours) == groups(theirs)
    decayed = [g for g in ours.param_groups if g["weight_decay"]][0]["params"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" not in names[id(p)] and "bias" not in names[id(p)] for p in decayed)
    assert any("bias" in n for n in names.values())  # the rule had something to leave out


# ------------------------------------------------------------------------------------------- runs on the tiny world
SCRIPTS = {
    "grpo.py": ["--reward_funcs", "RULES", "--num_generations", "4", "--per_device_train_batch_size", "8",
                "--max_completion_length", "6", "--max_steps", "4", "--logging_steps", "1"],
    "rloo.py": ["--reward_funcs", "RULES", "--num_generations", "2", "--per_device_train_batch_size", "8",
                "--max_completion_length", "6", "--max_steps", "4"],
    "online_dpo.py": ["--reward_funcs", "RULES", "--per_device_train_batch_size", "4", "--max_new_tokens", "6",
                      "--max_steps", "4", "--logging_steps", "1"],
    "ppo.py": ["--reward_funcs", "RULES", "--per_device_train_batch_size", "4", "--response_length", "6",
               "--total_episodes", "16"],
}  # fmt: skip


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    from conftest import make_rl_lab

    return make_rl_lab(world, tmp_path_factory.mktemp("optim_lab"), num_prompts=16)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_scripts_log_the_schedules_rates(script, world, lab, tmp_path):
    """Cosine after half the steps of warmup, weight decay, other betas and the unfused kernel: four optimizer
    steps (updates) at the rates the schedule gives, logged as learning_rate."""
    from conftest import read_metrics, run_script

    rules = f"{lab / 'rules.py'}:chars"
    model = "--sft_model_path" if script == "ppo.py" else "--model_name_or_path"
    flags = [model, str(world / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
             "--logging_dir", str(tmp_path / "runs"), "--run_name", "run", "--output_dir", str(tmp_path / "out"),
             "--learning_rate", "1e-3", "--lr_scheduler_type", "cosine", "--warmup_steps", "0.5",
             "--weight_decay", "0.1", "--adam_beta1", "0.8", "--adam_beta2", "0.99", "--adam_epsilon", "1e-6",
             "--optim", "adamw_torch", "--num_sample_generations", "0", "--local_rollout_forward_batch_size", "8",
             *(rules if f == "RULES" else f for f in SCRIPTS[script])]  # fmt: skip
    run_script([script, *flags], timeout=300)
    rates = [m.get("learning_rate", m.get("lr")) for m in read_metrics(tmp_path / "runs" / "run")]
    expected = [1e-3 * s / 2 if s < 2 else 1e-3 * (1 + math.cos(math.pi * (s - 2) / 2)) / 2 for s in range(4)]
    assert rates == pytest.approx(expected)
