"""grpo.py: group advantages and every loss aggregation against loops written from the papers' equations,
clip-higher and two-sided clipping by hand, the batch arithmetic, and runs through the command line on the tiny
world (ratio 1 at the first step, a rule reward learned, groups kept whole on 2 processes, exact resume)."""

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
import torch

import grpo
import utils.generation
import utils.loading
import utils.reward_funcs
import utils.run
import utils.scoring
from conftest import (
    check_trl_style_calls,
    logged_every,
    make_rl_lab,
    read_metrics,
    run_deepspeed,
    run_script,
    run_torchrun,
    weights,
    write_trl_style_data,
)


# ---------------------------------------------------------------------------------------------------- advantages
def loop_advantages(rewards, G, scale, eps=1e-4):
    """Shao et al. eq. (outcome supervision): A_i = (r_i - mean(r_group)) / std(r_group); rows g * P + p."""
    P = len(rewards) // G
    out = [0.0] * len(rewards)
    batch_std = statistics.stdev(rewards)
    for p in range(P):
        group = [rewards[g * P + p] for g in range(G)]
        mean, std = sum(group) / G, statistics.stdev(group)
        for g in range(G):
            centered = rewards[g * P + p] - mean
            out[g * P + p] = {"group": centered / (std + eps), "batch": centered / (batch_std + eps),
                              "none": centered}[scale]  # fmt: skip
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("G,P", [(2, 1), (4, 3), (3, 5)])
def test_group_advantages_match_loop(scale, G, P):
    rewards = torch.randn(G * P, generator=torch.Generator().manual_seed(G * 10 + P), dtype=torch.float64)
    out = grpo.group_advantages(rewards, G, scale)
    assert out.tolist() == pytest.approx(loop_advantages(rewards.tolist(), G, scale), rel=1e-9, abs=1e-12)
    # each group's advantages sum to zero
    torch.testing.assert_close(out.view(G, P).sum(0), torch.zeros(P, dtype=torch.float64))


def test_group_advantages_by_hand():
    # 2 prompts, 3 completions each, completion-major: prompt 0 got 0, 1, 2 and prompt 1 got 1, 1, 1
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0, 1.0])
    out = grpo.group_advantages(rewards, 3, "group")
    # prompt 0: mean 1, sample std 1 -> -1, 0, 1 (over 1 + 1e-4); prompt 1: all equal -> 0, no division by 0
    assert out.tolist() == pytest.approx([-1 / 1.0001, 0.0, 0.0, 0.0, 1 / 1.0001, 0.0])
    assert grpo.group_advantages(rewards, 3, "none").tolist() == pytest.approx([-1, 0, 0, 0, 1, 0])
    # the batch's std comes from outside when the batch is spread over processes
    out = grpo.group_advantages(rewards, 3, "batch", batch_std=torch.tensor(2.0))
    assert out.tolist() == pytest.approx([-1 / 2.0001, 0, 0, 0, 1 / 2.0001, 0])


def test_unscored_completions_leave_their_group_and_get_zero():
    """A NaN reward (no reward scored the completion) is left out of its group's mean and std, as if the group
    were smaller, and gets advantage 0; a group with one scored completion has no std (advantage 0 too)."""
    nan = float("nan")
    rewards = torch.tensor([0.0, 5.0, nan, nan, 3.0, 1.0, 1.0, 2.0], dtype=torch.float64)  # G = 4, P = 2
    out = grpo.group_advantages(rewards, 4, "group")
    # prompt 0: 0, nan, 3, 1 -> the loop over [0, 3, 1]; prompt 1: 5, nan, 1, 2 -> over [5, 1, 2]
    kept = loop_advantages([0.0, 5.0, 3.0, 1.0, 1.0, 2.0], 3, "group")
    assert out.tolist() == pytest.approx([kept[0], kept[1], 0.0, 0.0, *kept[2:]], rel=1e-9)
    alone = torch.tensor([1.0, nan, nan, nan, nan, nan, nan, nan])
    assert grpo.group_advantages(alone, 4, "group").tolist() == [0.0] * 8
    # batch scaling: the std of the scored rewards
    batch = grpo.group_advantages(rewards, 4, "batch")
    scored = rewards[~rewards.isnan()]
    assert batch[0].item() == pytest.approx((0 - 4 / 3) / (scored.std().item() + 1e-4))
    assert grpo.nanstd(rewards).item() == pytest.approx(scored.std().item())


def test_combine_rewards_and_kl():
    per_func = torch.tensor([[1.0, 10.0], [0.0, 20.0]])
    assert grpo.combine_rewards(per_func, torch.tensor([1.0, 0.5])).tolist() == [6.0, 10.0]
    # a reward that returned None (NaN) for a completion adds nothing to it (TRL's nansum)
    per_func = torch.tensor([[1.0, float("nan")], [float("nan"), 20.0]])
    assert grpo.combine_rewards(per_func, torch.tensor([1.0, 0.5])).tolist() == [1.0, 10.0]
    logp, ref = torch.tensor([math.log(0.5), -1.0]), torch.tensor([math.log(0.25), -1.0])
    # KL k3: exp(d) - d - 1 with d = ref - logp = log 0.5; zero where the policies agree
    assert grpo.k3_kl(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-7)
    g = torch.Generator().manual_seed(0)
    assert (grpo.k3_kl(torch.randn(50, generator=g), torch.randn(50, generator=g)) >= 0).all()


# ------------------------------------------------------------------------------------------ clipped per-token loss
def test_clipped_token_loss_matches_loop():
    g = torch.Generator().manual_seed(1)
    new, old = torch.randn(4, 5, generator=g) * 0.3, torch.randn(4, 5, generator=g) * 0.3
    advantages = torch.randn(4, generator=g)
    for eps_low, eps_high, delta in [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 1.5)]:
        out = grpo.clipped_token_loss(new, old, advantages, eps_low, eps_high, delta)
        for i in range(4):
            for t in range(5):
                r, a = math.exp(new[i, t] - old[i, t]), float(advantages[i])
                unclipped = min(r, delta) * a if delta is not None else r * a
                expected = -min(unclipped, min(max(r, 1 - eps_low), 1 + eps_high) * a)
                assert out[i, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def loss_and_grad(ratio, advantage, eps_low, eps_high, delta=None):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss = grpo.clipped_token_loss(
        logp, torch.zeros(1, 1), torch.tensor([advantage]), eps_low, eps_high, delta
    )
    loss.sum().backward()
    return loss.item(), logp.grad.item()


def test_clip_higher_by_hand():
    # ratio 1.25 with A = 1: symmetric clipping (0.2) caps it at 1.2 and stops the gradient; DAPO's clip-higher
    # (0.28) lets it through: the low-probability token keeps being pushed up
    assert loss_and_grad(1.25, 1.0, 0.2, 0.2) == pytest.approx((-1.2, 0.0))
    assert loss_and_grad(1.25, 1.0, 0.2, 0.28) == pytest.approx((-1.25, -1.25))
    # above 1 + eps_high it is clipped again
    assert loss_and_grad(1.3, 1.0, 0.2, 0.28) == pytest.approx((-1.28, 0.0))
    # the lower side is unchanged by epsilon_high: ratio 0.75 with A = -1 is clipped at 0.8
    assert loss_and_grad(0.75, -1.0, 0.2, 0.28) == pytest.approx((0.8, 0.0))
    # ratio 0.75 with A = +1: pessimistic min takes the unclipped term, the gradient flows
    assert loss_and_grad(0.75, 1.0, 0.2, 0.28) == pytest.approx((-0.75, -0.75))
    # A < 0 and a runaway ratio 5: PPO's min keeps 5 * A (loss 5, gradient 5); delta = 2 caps it (two-sided)
    assert loss_and_grad(5.0, -1.0, 0.2, 0.28) == pytest.approx((5.0, 5.0))
    assert loss_and_grad(5.0, -1.0, 0.2, 0.28, delta=2.0) == pytest.approx((2.0, 0.0))


def test_clip_fractions_by_hand():
    ratio = torch.tensor([[0.7, 0.7, 1.3, 1.3], [1.0, 1.25, 0.5, 9.0]])
    advantages = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    low, high, region = grpo.clip_fractions(ratio, advantages, mask, 0.2, 0.28)
    # row 0 (A < 0): both 0.7 are low-clipped, 1.3 is not clipped (pessimistic side); row 1 (A > 0): nothing
    # at 1.0 / 1.25 (< 1.28) / 0.5; the 9.0 is masked
    assert (low.item(), high.item(), region.item()) == pytest.approx((2 / 7, 0.0, 2 / 7))
    low, high, region = grpo.clip_fractions(ratio, advantages, mask, 0.2, 0.2)
    assert (low.item(), high.item(), region.item()) == pytest.approx((2 / 7, 1 / 7, 3 / 7))


# ------------------------------------------------------------------------------------------------ loss aggregation
def loop_aggregate(losses, lengths, loss_type, L):
    """The papers' normalizations written as sums over completions i and their tokens t < |o_i|."""
    per_seq = [sum(row[:n]) for row, n in zip(losses, lengths)]
    if loss_type == "grpo":  # Shao et al.: (1/G) sum_i (1/|o_i|) sum_t
        return sum(s / max(n, 1) for s, n in zip(per_seq, lengths)) / len(losses)
    if loss_type in ("bnpo", "dapo"):  # Yu et al.: (1 / sum_i |o_i|) sum_i sum_t
        return sum(per_seq) / sum(lengths)
    return sum(per_seq) / (len(losses) * L)  # Liu et al.: a constant, the generation budget


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_aggregation_matches_loop(loss_type):
    g = torch.Generator().manual_seed(2)
    lengths = [
        5,
        1,
        3,
        0,
        2,
        5,
    ]  # one completion fully masked (a truncated one under mask_truncated_completions)
    losses = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = utils.generation.lengths_to_mask(torch.tensor(lengths), 5)
    out = grpo.aggregate_loss(losses, mask, loss_type, max_completion_length=8)
    assert out.item() == pytest.approx(loop_aggregate(losses.tolist(), lengths, loss_type, 8), rel=1e-12)


def test_dapo_over_micro_batches_is_the_token_mean_of_the_step():
    """Each micro-batch divides by the step's token count / number of micro-batches; the accumulated mean of
    the micro-batch losses is then the token mean of the whole step (bnpo's micro-batch means are not)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 1, 1, 1, 4, 5, 2, 3])
    losses, mask = (
        torch.randn(8, 5, generator=g, dtype=torch.float64),
        utils.generation.lengths_to_mask(lengths, 5),
    )
    micro = [slice(0, 4), slice(4, 8)]
    whole = loop_aggregate(losses.tolist(), lengths.tolist(), "dapo", 5)
    num_items = mask.sum().item() / len(micro)
    accumulated = sum(grpo.aggregate_loss(losses[s], mask[s], "dapo", 5, num_items) for s in micro) / len(
        micro
    )
    assert accumulated.item() == pytest.approx(whole, rel=1e-12)
    bnpo = sum(grpo.aggregate_loss(losses[s], mask[s], "bnpo", 5) for s in micro) / len(micro)
    assert bnpo.item() != pytest.approx(whole, rel=1e-3)
    for loss_type in ("grpo", "dr_grpo"):  # equal-sized micro-batches: their mean is the whole batch's value
        accumulated = sum(grpo.aggregate_loss(losses[s], mask[s], loss_type, 5) for s in micro) / len(micro)
        assert accumulated.item() == pytest.approx(
            loop_aggregate(losses.tolist(), lengths.tolist(), loss_type, 5)
        )


def test_grpo_aggregation_weighs_long_completions_tokens_less():
    """The length bias Dr. GRPO removes: with A > 0 a short completion's tokens get more gradient under 'grpo'."""
    mask = utils.generation.lengths_to_mask(torch.tensor([1, 4]), 4)
    logp = torch.zeros(2, 4, requires_grad=True)
    loss = grpo.aggregate_loss(grpo.clipped_token_loss(logp, torch.zeros(2, 4), torch.ones(2), 0.2, 0.2), mask,
                               "grpo", 4)  # fmt: skip
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-0.5) and logp.grad[1, 0].item() == pytest.approx(-0.125)
    logp.grad = None
    loss = grpo.aggregate_loss(grpo.clipped_token_loss(logp, torch.zeros(2, 4), torch.ones(2), 0.2, 0.2), mask,
                               "dr_grpo", 4)  # fmt: skip
    loss.backward()
    assert logp.grad[0, 0].item() == logp.grad[1, 0].item() == pytest.approx(-0.125)


def test_verifiable_benchmark_reward_is_an_exact_match():
    import verifiable

    prompt = "SUBREDDIT: r/pets\n\nTITLE: so dog sad\n\nPOST: my dog was sad and the vet told rent\n\nTL;DR:"
    assert verifiable.post_facts(prompt) == ["dog", "vet", "rent"]  # the title's key word is not a fact
    completions = [" dog vet rent", " dog vet", " dog vet rent tbh", " vet dog rent", "dog  vet rent"]
    assert verifiable.facts_in_order([prompt] * 5, completions) == [1.0, 0.0, 0.0, 0.0, 1.0]
    # loadable the way grpo.py and rloo.py load a reward function
    fn = utils.reward_funcs.load_reward_fn(str(Path(verifiable.__file__)) + ":facts_in_order")
    assert fn([prompt], [" dog vet rent"]) == [1.0]


# ---------------------------------------------------------------------------------------------- batch arithmetic
def parse(flags):
    return utils.run.parse_args(grpo.Args, ["--model_name_or_path", "m", "--reward_funcs", "f.py:f", *flags])


def test_sizes_follow_trl_meanings():
    args = parse("--num_generations 8 --per_device_train_batch_size 16 --gradient_accumulation_steps 2 "
                 "--steps_per_generation 8 --num_iterations 2 --num_train_epochs 2".split())  # fmt: skip
    grpo.fill_sizes(args, world_size=4, num_prompts=1000)
    assert (args.local_generation_batch_size, args.generation_batch_size) == (128, 512)
    assert args.local_prompts_per_generation == 16  # whole groups of 8 per process
    assert args.steps_per_generation_round == 8  # 8 micro-batches / 2 per step * 2 iterations
    assert args.total_steps == math.ceil(2 * (1000 // 64)) * 8
    assert args.epsilon_high == args.epsilon == 0.2
    args = parse(["--max_steps", "7", "--epsilon_high", "0.28"])
    grpo.fill_sizes(args, world_size=1, num_prompts=100)
    assert args.steps_per_generation == 1 and args.total_steps == 7 and args.epsilon_high == 0.28


def test_generation_batch_size_sets_steps_per_generation():
    """TRL's two ways to size a generation: --generation_batch_size (all processes) sets --steps_per_generation
    and is kept as given; --steps_per_generation (default gradient_accumulation_steps) fills it in."""
    args = parse("--generation_batch_size 16 --per_device_train_batch_size 4 --num_generations 4".split())
    grpo.fill_sizes(args, world_size=1, num_prompts=100)
    grpo.fill_sizes(args, world_size=1, num_prompts=100)  # main calls it twice: the sizes it filled in stay
    assert (args.generation_batch_size, args.steps_per_generation, args.local_prompts_per_generation) == (
        16,
        4,
        4,
    )
    args = parse("--generation_batch_size 16 --per_device_train_batch_size 4 --num_generations 4".split())
    grpo.fill_sizes(args, world_size=2)
    assert (args.steps_per_generation, args.local_generation_batch_size, args.local_prompts_per_generation) == (
        2, 8, 2,
    )  # fmt: skip
    args = parse("--steps_per_generation 3 --per_device_train_batch_size 4 --num_generations 4".split())
    grpo.fill_sizes(args, world_size=2)
    assert args.generation_batch_size == 24
    args = parse(
        "--gradient_accumulation_steps 2 --per_device_train_batch_size 4 --num_generations 4".split()
    )
    grpo.fill_sizes(args, world_size=1)
    assert (args.steps_per_generation, args.generation_batch_size) == (2, 8)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--generation_batch_size", "16", "--steps_per_generation", "2"], "not both"),
        (
            ["--generation_batch_size", "12"],
            "--generation_batch_size 12 must be a positive multiple of .* = 8",
        ),
        (
            [
                "--generation_batch_size",
                "12",
                "--gradient_accumulation_steps",
                "2",
                "--per_device_train_batch_size",
                "4",
                "--num_generations",
                "4",
            ],
            "--steps_per_generation 3 .* multiple of --gradient_accumulation_steps 2",
        ),
        (["--vllm_importance_sampling_clip_min", "3"], "clip_min 3.0 must be below"),
        (
            [
                "--vllm_importance_sampling_mode",
                "token_truncate",
                "--vllm_importance_sampling_clip_max",
                "None",
            ],
            "needs --vllm_importance_sampling_clip_min or",
        ),
        (["--num_generations", "1"], "--num_generations must be at least 2"),
        (["--num_generations", "3"], "--num_generations 3 must divide .* = 8, so that groups stay whole"),
        (
            ["--gradient_accumulation_steps", "2", "--steps_per_generation", "3"],
            "must be a positive multiple",
        ),
        (
            ["--reward_weights", "1", "2"],
            "--reward_weights has 2 values for 1 rewards \\(the reward model, then",
        ),
        (["--delta", "1.1"], "--delta must exceed 1 \\+ epsilon_high"),
        (["--max_steps", "0"], "--max_steps to a positive number"),
        (["--steps_per_generation", "2", "--num_generations", "2", "--save_steps", "3"], "multiple of the 2"),
        (["--temperature", "0"], "--temperature must be positive"),
    ],
)
def test_bad_flags_are_refused_with_one_sentence(flags, message):
    with pytest.raises(ValueError, match=message):
        grpo.fill_sizes(parse(flags), world_size=1)


def test_the_deprecated_importance_sampling_cap_sets_clip_max_with_a_warning():
    with pytest.warns(FutureWarning, match="--vllm_importance_sampling_cap is deprecated"):
        args = grpo.fill_sizes(parse(["--vllm_importance_sampling_cap", "2.5"]), world_size=1)
    assert (args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_cap) == (2.5, None)


def test_prompts_are_whole_by_default_as_trl_1_16():
    assert grpo.Args().max_prompt_length is None
    assert utils.loading.cut_prompts([[[1, 2, 3]], None], None) == [[[1, 2, 3]], None]
    assert utils.loading.cut_prompts([[[1, 2, 3], [4]], [[5, 6]]], 2) == [[[2, 3], [4]], [[5, 6]]]


@pytest.mark.parametrize("given, meant", [("True", "group"), ("false", "none"), ("batch", "batch")])
def test_scale_rewards_takes_trls_true_and_false(given, meant):
    """TRL's GRPOConfig reads scale_rewards True as group and False as none."""
    assert grpo.fill_sizes(parse(["--scale_rewards", given]), world_size=1).scale_rewards == meant
    with pytest.raises(
        ValueError, match="--scale_rewards takes group, batch, none, True or False, got 'std'"
    ):
        grpo.fill_sizes(parse(["--scale_rewards", "std"]), world_size=1)


def test_no_reward_and_too_few_prompts():
    args = utils.run.parse_args(grpo.Args, ["--model_name_or_path", "m"])
    with pytest.raises(ValueError, match="at least one reward"):
        grpo.fill_sizes(args, world_size=1)
    with pytest.raises(ValueError, match="3 prompts, fewer than the 4 of one generation"):
        grpo.fill_sizes(parse(["--num_generations", "4"]), world_size=2, num_prompts=3)


# ------------------------------------------------------------------------------------------- runs on the tiny world
@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The rule-reward lab (conftest.make_rl_lab): 32 prompts of different lengths, a policy that stops early
    about half of the time with dropout in its config, and the rule rewards in rules.py."""
    return make_rl_lab(world, tmp_path_factory.mktemp("grpo_lab"), num_prompts=32)


def common_flags(tmp_path, name):
    return ["--logging_dir", str(tmp_path / "runs"), "--run_name", name, "--output_dir", str(tmp_path / name),
            "--max_completion_length", "8", "--num_sample_generations", "0"]  # fmt: skip


def test_ratio_is_one_at_learning_rate_zero(lab, world, tmp_path):
    """Learning rate 0, two iterations over each generation, accumulation, a reference model (beta > 0), a reward
    model next to a function: the training forward gives back the sampling logprobs (ratio 1, KL 0, nothing
    clipped) under left padding, truncation after EOS, a temperature and dropout in the config."""
    flags = common_flags(tmp_path, "invariant") + [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{lab / 'rules.py'}:chars", "--reward_model_path", str(world / "reward"),
        "--reward_weights", "0.5", "1", "--learning_rate", "0", "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--steps_per_generation", "4",
        "--num_iterations", "2", "--epsilon", "0.001", "--beta", "0.1", "--max_steps", "4", "--temperature", "0.7",
        "--local_rollout_forward_batch_size", "6", "--num_sample_generations", "1", "--loss_type", "grpo",
    ]  # fmt: skip
    proc = run_script(["grpo.py", *flags], timeout=300)
    assert "generation 1" in proc.stdout  # the sample table
    said = [
        line for line in proc.stdout.splitlines() if line.startswith("scores: ")
    ]  # the model's, then the function's
    assert said == ["scores: the reward model shares the policy's tokenizer; it reads the policy's token ids",
                    "scores: the reward function, on the decoded prompts and completions"]  # fmt: skip
    lines = read_metrics(tmp_path / "runs" / "invariant")
    assert [m["step"] for m in lines] == [1, 2, 3, 4] and [m["episode"] for m in lines] == [16, 16, 16, 16]
    for metrics in lines:
        assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
        assert metrics["clip_ratio/region_mean"] == 0.0
        assert abs(metrics["kl"]) < 1e-6
        # TRL's order: the reward model's weight first (0.5), then the function's (1)
        expected = 0.5 * metrics["rewards/reward/mean"] + metrics["rewards/chars/mean"]
        assert metrics["reward"] == pytest.approx(expected, rel=1e-5)
        assert metrics["reward"] != pytest.approx(
            metrics["rewards/reward/mean"] + 0.5 * metrics["rewards/chars/mean"]
        )
        assert 0 < metrics["completions/clipped_ratio"] < 1  # some completions end with EOS, some not
        assert {"rewards/chars/mean", "rewards/reward/mean", "reward_std", "frac_reward_zero_std"} <= set(
            metrics
        )
        assert metrics["learning_rate"] == 0.0
    out = tmp_path / "invariant"
    assert "GRPO" in (out / "README.md").read_text()
    before, after = weights(lab / "policy"), weights(out)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(
    "conversational", [pytest.param(False, marks=pytest.mark.slow), True]
)  # CI: rloo, online_dpo
def test_trl_style_reward_functions_get_their_rows_columns(world, lab, tmp_path, conversational):
    """A reward function taking **kwargs is called as TRL calls it: every completion comes with the `solution`
    and `source` of its own dataset row (here derived from the prompt, so a misaligned row shows), and with a
    conversational dataset the prompts are message lists and each completion one assistant message."""
    write_trl_style_data(lab, tmp_path / "data.jsonl", conversational)
    policy = world / ("policy_chat" if conversational else "policy")
    flags = common_flags(tmp_path, "trl_style") + [
        "--model_name_or_path", str(policy), "--dataset_name", str(tmp_path / "data.jsonl"),
        "--reward_funcs", f"{lab / 'rules.py'}:trl_style", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--steps_per_generation", "2", "--max_steps", "4",
        "--local_rollout_forward_batch_size", "6",
    ]  # fmt: skip
    run_script(["grpo.py", *flags], env={"REWARD_LOG": str(tmp_path / "calls.jsonl")})
    seen = check_trl_style_calls(tmp_path / "calls.jsonl", conversational)
    assert seen == 2 * 16  # two generations of 4 prompts x 4 completions


def test_a_reward_function_needing_a_missing_column_is_one_line(lab, tmp_path):
    """Reward functions are called by keyword (TRL's): a required parameter that is neither a TRL keyword nor a
    column of the dataset stops the run before any model is loaded, in one sentence naming the columns."""
    (tmp_path / "r.py").write_text("def correct(completions, answer):\n    return [0.0] * len(completions)\n")
    flags = common_flags(tmp_path, "missing") + [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{tmp_path / 'r.py'}:correct", "--num_generations", "4", "--max_steps", "1",
    ]  # fmt: skip
    proc = run_script(["grpo.py", *flags], check=False, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and last.startswith("grpo.py: error: ")
    assert "parameter 'answer' is none of what a reward function gets" in last
    assert last.endswith("the dataset's columns, here: prompt).")


def test_sampling_stops_at_every_eos_id_of_the_generation_config(lab, tmp_path):
    """TRL 1.16 stops at the tokenizer's EOS and at every EOS id of the policy's generation_config: with a second
    EOS id (a token the policy samples often), no completion goes on past either, and some end at the second."""
    from collections import Counter

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import utils.chat

    tokenizer = AutoTokenizer.from_pretrained(lab / "policy")
    model = AutoModelForCausalLM.from_pretrained(lab / "policy")
    all_prompts = [json.loads(line)["prompt"] for line in open(lab / "prompts.jsonl")]
    prompts = all_prompts[:8]
    prompt_ids = utils.chat.tokenize_prompts(tokenizer, prompts)
    responses, lengths = utils.generation.complete(
        model, tokenizer, prompt_ids, 8, 8, 1.0, torch.Generator().manual_seed(0)
    )
    eos = tokenizer.eos_token_id
    counts = Counter(t for r, n in zip(responses.tolist(), lengths.tolist()) for t in r[:n] if t != eos)
    second = counts.most_common(1)[0][0]
    model.generation_config.eos_token_id = [eos, second]
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    assert utils.generation.eos_token_ids(model, tokenizer) == [eos, second]
    (tmp_path / "r.py").write_text(
        "import json, os\n"
        "def ids(completion_ids, **kwargs):\n"
        "    with open(os.environ['IDS_LOG'], 'a') as f:\n"
        "        f.writelines(json.dumps(row) + '\\n' for row in completion_ids)\n"
        "    return [0.0] * len(completion_ids)\n"
    )
    lengths = sorted(map(len, utils.chat.tokenize_prompts(tokenizer, all_prompts)))
    cut_at = lengths[16]
    longer = sum(n > cut_at for n in lengths)
    assert longer > 0
    flags = common_flags(tmp_path, "two_eos") + [
        "--model_name_or_path", str(tmp_path / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{tmp_path / 'r.py'}:ids", "--num_generations", "4", "--max_steps", "2",
        "--per_device_train_batch_size", "16", "--max_prompt_length", str(cut_at),
    ]  # fmt: skip
    proc = run_script(["grpo.py", *flags], env={"IDS_LOG": str(tmp_path / "ids.jsonl")})
    # --max_prompt_length, which TRL 1.16 lacks, says what it cut
    assert f"--max_prompt_length {cut_at}: {longer} of 32 prompts cut from the left to fit" in proc.stdout
    rows = [json.loads(line) for line in open(tmp_path / "ids.jsonl")]
    assert len(rows) == 32
    assert all(not {eos, second} & set(row[:-1]) for row in rows)  # nothing sampled past either EOS id
    assert sum(row[-1] == second for row in rows) >= 2


PARTIAL_REWARD = """
def half(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
    \"\"\"TRL-style: None (not judged) for completions starting with an odd token id (about half); logs a metric,
    the step it saw.\"\"\"
    log_metric("custom/step", float(trainer_state.global_step))
    return [None if ids[0] % 2 else float(len(ids)) for ids in completion_ids]


def odd_too(prompts, completions, completion_ids, **kwargs):
    \"\"\"None where `half` is None too (those completions get no reward at all), 1 for the others.\"\"\"
    return [None if ids[0] % 2 else 1.0 for ids in completion_ids]
"""


def test_generation_batch_size_and_none_rewards_through_the_cli(lab, tmp_path):
    """--generation_batch_size 16 with micro-batches of 4 and groups of 4: 16 completions per generation (4
    optimizer steps each); reward functions returning None for some completions (nansum, nan-means in the
    logs, a warning when none scores a completion), trainer_state and log_metric reaching the logs."""
    (tmp_path / "partial.py").write_text(PARTIAL_REWARD)
    flags = common_flags(tmp_path, "gbs") + [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{tmp_path / 'partial.py'}:half", f"{tmp_path / 'partial.py'}:odd_too",
        "--generation_batch_size", "16", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_steps", "8", "--learning_rate", "1e-3",
    ]  # fmt: skip
    proc = run_script(["grpo.py", *flags])
    lines = read_metrics(tmp_path / "runs" / "gbs")
    assert [m["episode"] for m in lines] == [16] * 4 + [32] * 4
    assert [m["custom/step"] for m in lines] == [0.0] * 4 + [
        4.0
    ] * 4  # the step when the rewards were computed
    for metrics in lines:
        assert all(math.isfinite(metrics[k]) for k in ("reward", "rewards/half/mean", "loss", "reward_std"))
    assert "every reward returned None" in proc.stderr


def test_logging_steps_logs_the_means_over_the_window_as_trl(lab, tmp_path):
    """--logging_steps 4 logs, at steps 4 and 8, the means of what --logging_steps 1 logs at each step of the
    window (the same run otherwise): step metrics over the window's steps, generation metrics over the window's
    generations (a generation every 2 steps here), as TRL's logger averages what it gathered since the last log."""
    flags = [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{lab / 'rules.py'}:chars", "--generation_batch_size", "8",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_steps", "8",
        "--learning_rate", "1e-3", "--epsilon", "0.05",
    ]  # fmt: skip
    each, windows = logged_every("grpo.py", common_flags, flags, 4, tmp_path)
    assert [m["step"] for m in windows] == [4, 8]
    for window, steps in zip(windows, (each[:4], each[4:])):
        for key in ("loss", "kl", "entropy", "ratio", "clip_ratio/low_mean", "clip_ratio/low_min"):
            assert window[key] == pytest.approx(sum(m[key] for m in steps) / 4, rel=1e-5, abs=1e-9), key
        for key in (
            "reward",
            "reward_std",
            "completions/mean_length",
        ):  # generations start at steps 1, 3 (5, 7)
            assert window[key] == pytest.approx((steps[0][key] + steps[2][key]) / 2, rel=1e-5), key
        assert (
            window["learning_rate"] == steps[-1]["learning_rate"]
            and window["episode"] == steps[-1]["episode"]
        )
    assert (
        len({m["loss"] for m in each}) > 1 and each[0]["reward"] != each[2]["reward"]
    )  # the means mix values


def test_disable_dropout_false_keeps_the_policys_dropout(lab, tmp_path):
    """--disable_dropout False (TRL's default for GRPO) trains with the config's dropout (0.1 in the lab's policy):
    the same seed and data give other weights than the default run with dropout off. Either way the saved config
    keeps the policy's dropout, as TRL's saved models do."""
    flags = [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{lab / 'rules.py'}:chars", "--num_generations", "4",
        "--per_device_train_batch_size", "8", "--max_steps", "1", "--learning_rate", "1e-2",
    ]  # fmt: skip
    for name, extra in (("off", []), ("on", ["--disable_dropout", "False"])):
        run_script(["grpo.py", *common_flags(tmp_path, name), *flags, *extra])
    configs = {n: json.loads((tmp_path / n / "config.json").read_text()) for n in ("off", "on")}
    assert configs["on"]["attention_dropout"] == configs["off"]["attention_dropout"] == 0.1
    off, on = weights(tmp_path / "off"), weights(tmp_path / "on")
    assert any(not torch.equal(off[n], on[n]) for n in off)


def test_bf16_off_policy_old_logprobs_come_from_the_training_forward(lab, tmp_path):
    """--bf16, two passes over each generation (off-policy), learning rate 0 and epsilon 1e-3: the old logprobs
    come from a forward pass of the policy after sampling (grpo.recomputes_old_logprobs, checked against TRL's
    rule in test_trl_parity_grpo.py), so nothing is clipped. On this CPU the bf16 sampling forward (KV cache)
    agrees with the training forward to 5e-7 for the tiny policy, so this run alone cannot tell them apart; on
    GPUs they differ by up to 0.1, which is why the old logprobs are not sampling's."""
    flags = common_flags(tmp_path, "bf16") + [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{lab / 'rules.py'}:chars", "--bf16", "--learning_rate", "0", "--epsilon", "0.001",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--num_iterations", "2",
        "--max_steps", "2", "--temperature", "0.7",
    ]  # fmt: skip
    run_script(["grpo.py", *flags])
    lines = read_metrics(tmp_path / "runs" / "bf16")
    assert [m["episode"] for m in lines] == [8, 8]  # both steps from one generation
    for metrics in lines:
        assert metrics["clip_ratio/region_mean"] == 0.0
        assert metrics["ratio"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.slow  # kept out of CI for time; run with -m slow
def test_rule_reward_is_learned_and_resume_is_exact(world, lab, tmp_path):
    """From the random tiny policy, a reward for emitting key words rises within 16 steps (dapo, clip-higher);
    a run resumed from its step-8 checkpoint ends with the same weights as the uninterrupted one."""
    flags = [
        "--model_name_or_path", str(world / "policy"), "--reward_funcs", f"{lab / 'rules.py'}:key_words",
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--num_generations", "4",
        "--per_device_train_batch_size", "16", "--learning_rate", "1e-2", "--max_grad_norm", "0", "--max_steps", "16",
        "--lr_scheduler_type", "constant", "--epsilon_high", "0.28", "--save_steps", "8", "--seed", "2",
    ]  # fmt: skip
    run_script(["grpo.py", *flags, *common_flags(tmp_path, "learn")], timeout=300)
    rewards = [m["reward"] for m in read_metrics(tmp_path / "runs" / "learn")]
    assert len(rewards) == 16
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert first < 1.0 and last > first + 1.0, rewards
    # resume: the step-8 checkpoint copied into a fresh output dir, continued to step 16
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "learn" / "checkpoint-8", resumed / "checkpoint-8")
    run_script(["grpo.py", *flags, *common_flags(tmp_path, "resumed"), "--resume_from_checkpoint", "latest"])
    here, there = weights(tmp_path / "learn"), weights(resumed)
    assert all(torch.equal(here[n], there[n]) for n in here)
    # the resumed run continues the log of the run it resumes: every step once
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "learn")] == list(range(1, 17))


def test_two_processes_keep_each_group_whole(world, lab, tmp_path):
    """2 processes, batch-std scaling. The reward depends on the prompt alone: if every group of G completions
    is one prompt's, every advantage is exactly 0, the loss is 0 and nothing moves."""
    flags = common_flags(tmp_path, "ddp") + [
        "--model_name_or_path", str(world / "policy"), "--reward_funcs", f"{lab / 'rules.py'}:prompt_only",
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--steps_per_generation", "2", "--learning_rate", "1e-2",
        "--scale_rewards", "batch", "--max_steps", "2",
    ]  # fmt: skip
    run_torchrun(["grpo.py", *flags], nproc=2)
    lines = read_metrics(tmp_path / "runs" / "ddp")
    assert [m["episode"] for m in lines] == [
        16,
        16,
    ]  # one generation: 2 processes x 2 prompts x 4 completions
    for metrics in lines:
        assert metrics["loss"] == 0.0 and metrics["frac_reward_zero_std"] == 1.0
        assert metrics["reward_std"] > 0  # TRL's meaning: the std of the whole batch, whose prompts differ
    before, after = weights(world / "policy"), weights(tmp_path / "ddp")
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_keeps_the_ratio_at_one(world, lab, tmp_path, zero_stage):
    """2 processes under DeepSpeed ZeRO-2/3 (reference and reward model sharded under ZeRO-3, weights gathered
    for sampling): at learning rate 0 the training forward still gives back the sampling logprobs."""
    flags = common_flags(tmp_path, "ds") + [
        "--model_name_or_path", str(lab / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(lab / "prompts.jsonl"), "--learning_rate", "0", "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "2",
        "--beta", "0.1", "--temperature", "0.7",
    ]  # fmt: skip
    run_deepspeed(["grpo.py", *flags], tmp_path, zero_stage)
    lines = read_metrics(tmp_path / "runs" / "ds")
    assert [m["episode"] for m in lines] == [8, 16]
    for metrics in lines:
        assert metrics["ratio"] == pytest.approx(1.0, abs=1e-4) and abs(metrics["kl"]) < 1e-4
    before, after = weights(lab / "policy"), weights(tmp_path / "ds")
    assert all(torch.equal(before[n], after[n].to(before[n].dtype)) for n in before)


def test_only_unscored_groups_turn_nan_advantages_into_zero():
    """A NaN advantage becomes 0 only in a group with an unscored completion (TRL's case: its one scored sibling
    has no std); a group whose rewards overflow float32 (the mean of 3e38 and 3e38) stays non-finite, so the run
    stops on it."""
    big = 3e38
    rewards = torch.tensor([[1.0, big], [math.nan, big]])  # [G, P]: group 0 is (1, None), group 1 (big, big)
    advantages = grpo.group_advantages(rewards.flatten(), 2, "group").view(2, 2)
    assert advantages[:, 0].tolist() == [0.0, 0.0]
    assert not advantages[:, 1].isfinite().any()
