"""rloo.py: the leave-one-out math against loops written from the equations and hand-computed cases, the batch
arithmetic, and runs through the command line on the tiny world (invariant, learning, 2 processes, copy)."""

import math
import shutil

import pytest
import torch
import tyro

import rloo
import utils.data
import utils.generation
from conftest import (
    ROOT,
    check_trl_style_calls,
    make_rl_lab,
    read_metrics,
    run_script,
    run_torchrun,
    weights,
    write_trl_style_data,
)

METRICS = {
    "eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
    "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "policy/entropy_avg",
    "val/ratio", "val/ratio_var", "val/num_eos_tokens", "learning_rate", "episode", "grad_norm", "step",
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- advantages
def loop_rloo_advantages(rewards, k):
    """From the definition: completion c of prompt p sits at row c * P + p (completion-major)."""
    num_prompts = len(rewards) // k
    out = [0.0] * len(rewards)
    for p in range(num_prompts):
        for c in range(k):
            others = [rewards[c2 * num_prompts + p] for c2 in range(k) if c2 != c]
            out[c * num_prompts + p] = rewards[c * num_prompts + p] - sum(others) / len(others)
    return out


@pytest.mark.parametrize("k,num_prompts", [(2, 1), (2, 5), (3, 4), (5, 3)])
def test_rloo_advantages_match_loop(k, num_prompts):
    rewards = torch.randn(k * num_prompts, generator=torch.Generator().manual_seed(k * 10 + num_prompts))
    expected = torch.tensor(loop_rloo_advantages(rewards.tolist(), k))
    torch.testing.assert_close(rloo.rloo_advantages(rewards, k), expected)
    # each prompt's advantages sum to zero
    torch.testing.assert_close(rloo.rloo_advantages(rewards, k).view(k, -1).sum(0), torch.zeros(num_prompts))


def test_worked_example_of_the_documentation():
    """3 prompts, 4 completions each, completion-major: prompt 0's completions have rewards 1, 2, 5, 8."""
    rewards = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=torch.float64)
    advantages = rloo.rloo_advantages(rewards, 4)
    assert advantages[0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)
    assert advantages[3].item() == pytest.approx(2 - (1 + 5 + 8) / 3)  # completion 1 of prompt 0
    assert advantages[11].item() == pytest.approx(10 - (3 + 4 + 7) / 3)  # completion 3 of prompt 2
    assert advantages.tolist() == pytest.approx(loop_rloo_advantages(rewards.tolist(), 4))


# ------------------------------------------------------------------------------------------------------ KL layouts
def test_sequence_level_reward_sums_the_kl_of_kept_tokens():
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.5, 0.2, 9.0], [0.1, 0.1, 0.1]])  # 9.0 is after the EOS of row 0: masked out
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    out = rloo.sequence_level_rewards(scores, kl, mask, kl_coef=0.1)
    torch.testing.assert_close(out, torch.tensor([1.0 - 0.1 * 0.7, 2.0 - 0.1 * 0.3]))


def test_token_level_rewards_put_the_score_on_the_eos_token():
    scores = torch.tensor([1.0, 2.0, 3.0])
    kl = torch.tensor([[0.5, 0.2, 9.0, 9.0], [0.1, 0.1, 0.1, 0.1], [0.3, 9.0, 9.0, 9.0]])
    lengths = torch.tensor([2, 4, 1])  # row 0 ends with EOS at index 1; row 1 has no EOS; row 2 stops at once
    out = rloo.token_level_rewards(scores, kl, lengths, kl_coef=0.1)
    expected = torch.tensor(
        [
            [-0.05, 1.0 - 0.02, 0.0, 0.0],  # the score on the EOS token (index 1), not on the one after it
            [-0.01, -0.01, -0.01, 2.0 - 0.01],
            [3.0 - 0.03, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)
    # summed over the tokens it is the sequence-level reward
    mask = rloo.utils.generation.lengths_to_mask(lengths, 4)
    torch.testing.assert_close(out.sum(1), rloo.sequence_level_rewards(scores, kl, mask, 0.1))


def test_token_level_advantages_match_loop():
    k, num_prompts, width = 3, 2, 5
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = rloo.utils.generation.lengths_to_mask(lengths, width)
    rewards = torch.randn(k * num_prompts, width, generator=g) * mask
    out = rloo.token_level_advantages(rewards, mask, k)
    totals = [sum(rewards[i, : lengths[i]].tolist()) for i in range(k * num_prompts)]
    for i in range(k * num_prompts):
        p, c = i % num_prompts, i // num_prompts
        others = [totals[c2 * num_prompts + p] for c2 in range(k) if c2 != c]
        baseline = sum(others) / (k - 1)
        for t in range(width):
            reward_to_go = sum(rewards[i, t : lengths[i]].tolist())
            expected = reward_to_go - baseline if t < lengths[i] else 0.0
            assert out[i, t].item() == pytest.approx(expected, abs=1e-6)
    # at the first token it is the sequence-level leave-one-out advantage
    torch.testing.assert_close(out[:, 0], rloo.rloo_advantages(rewards.sum(1), k))


# ------------------------------------------------------------------------------------ normalization and clipping
def test_normalize_scores_and_clip():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = rloo.normalize_scores(scores, clip_range=10.0)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert out.std().item() == pytest.approx(1.0, abs=1e-6)
    # by hand: [0, 0, 0, 2] has mean 0.5 and unbiased std sqrt((3 * 0.25 + 2.25) / 3) = 1, so it normalizes to
    # [-0.5, -0.5, -0.5, 1.5], and 1.5 is clipped to 1.0
    out = rloo.normalize_scores(torch.tensor([0.0, 0.0, 0.0, 2.0]), clip_range=1.0)
    assert out.tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.0])


def test_normalize_advantage_uses_the_whitening_of_utils():
    advantages = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, 100.0]])  # the 100s are padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    out = rloo.utils.stats.masked_whiten(advantages, mask) * mask
    kept = out[mask]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert kept.std().item() == pytest.approx(1.0, abs=1e-4)
    assert out[:, 2].tolist() == [0.0, 0.0]


def test_normalize_advantages_standardizes_over_the_actions_alone():
    """TRL 1.16's --normalize_advantages, (A - mean) / (std + 1e-4) over the masked actions: by hand on [B, R] with
    padding (100s, out of the statistics and 0 after) and an unscored row (NaN, kept NaN)."""
    advantages = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, 100.0], [math.nan, math.nan, math.nan]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    out = rloo.standardize_advantages(advantages, mask)
    std = torch.tensor([1.0, 3.0, 5.0, 7.0]).std().item()  # mean 4, over the 4 scored actions
    expected = [-3 / (std + 1e-4), -1 / (std + 1e-4), 0.0, 1 / (std + 1e-4), 3 / (std + 1e-4), 0.0]
    assert out[:2].flatten().tolist() == pytest.approx(expected)
    assert out[2].isnan().all()


# ------------------------------------------------------------------------------------------------ the clipped loss
def test_policy_loss_sequence_level_hand_cases():
    eps = 0.2
    mask = torch.tensor([[1, 1, 0]] * 4, dtype=torch.bool)
    old = torch.zeros(4, 3)
    log_ratios = torch.tensor([1.0, 1.5, 0.5, 1.5]).log()  # whole-completion ratios 1, 1.5, 0.5, 1.5
    new = torch.stack([log_ratios / 2, log_ratios / 2, torch.full((4,), 7.0)], 1)  # split over 2 kept tokens
    advantages = torch.tensor([2.0, 2.0, -1.0, -1.0])
    new.requires_grad_(True)
    loss, ratio, clipfrac, approxkl = rloo.policy_loss(new, old, advantages, mask, eps)
    torch.testing.assert_close(ratio, torch.tensor([1.0, 1.5, 0.5, 1.5]))
    # per completion: ratio 1: -2; ratio 1.5 > 1.2 with A > 0: clipped, -2 * 1.2; ratio 0.5 < 0.8 with A < 0:
    # clipped, 1 * 0.8; ratio 1.5 with A < 0: unclipped (pessimistic), 1 * 1.5
    per_completion = [-2.0, -2.4, 0.8, 1.5]
    assert loss.item() == pytest.approx(sum(per_completion) / 4)
    assert clipfrac.item() == pytest.approx(0.5)
    assert approxkl.item() == pytest.approx(sum(0.5 * x**2 for x in log_ratios.tolist()) / 4)
    # gradient: REINFORCE (-A * ratio / B per kept token) where unclipped, zero where clipped or masked
    loss.backward()
    expected_grad = torch.tensor([-2.0 * 1.0, 0.0, 0.0, 1.0 * 1.5]) / 4
    torch.testing.assert_close(new.grad[:, 0], expected_grad)
    torch.testing.assert_close(new.grad[:, 1], expected_grad)
    assert new.grad[:, 2].abs().sum() == 0


def test_policy_loss_token_level_matches_loop():
    g = torch.Generator().manual_seed(1)
    new, old = torch.randn(3, 4, generator=g) * 0.3, torch.randn(3, 4, generator=g) * 0.3
    advantages = torch.randn(3, 4, generator=g)
    mask = rloo.utils.generation.lengths_to_mask(torch.tensor([4, 2, 3]), 4)
    loss, ratio, clipfrac, approxkl = rloo.policy_loss(new, old, advantages, mask, 0.1)
    losses, clipped, kls, ratios = [], [], [], []
    for i in range(3):
        for t in range(4):
            if mask[i, t]:
                r = float(torch.exp(new[i, t] - old[i, t]))
                a = float(advantages[i, t])
                losses.append(max(-a * r, -a * min(max(r, 0.9), 1.1)))
                clipped.append(float(-a * min(max(r, 0.9), 1.1) > -a * r))
                kls.append(0.5 * float(new[i, t] - old[i, t]) ** 2)
                ratios.append(r)
    assert loss.item() == pytest.approx(sum(losses) / len(losses), abs=1e-6)
    assert clipfrac.item() == pytest.approx(sum(clipped) / len(clipped))
    assert approxkl.item() == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert ratio.tolist() == pytest.approx(ratios, rel=1e-5)


# ------------------------------------------------------------------------------------------- layout and batching
def test_rows_are_built_completion_major_from_prompts_stored_once():
    queries = torch.tensor([[9, 10], [1, 11], [1, 12]])  # 3 prompts, left-padded with 1
    query_mask = queries != 1
    responses = torch.arange(6 * 2).view(6, 2) + 100  # k = 2 completions of each of the 3 prompts
    response_mask = torch.ones(6, 2, dtype=torch.bool)
    rows, mask = utils.generation.query_response_rows(
        queries, query_mask, responses, response_mask, torch.tensor([4, 0, 3])
    )
    assert rows.tolist() == [[1, 11, 108, 109], [9, 10, 100, 101], [9, 10, 106, 107]]  # row i <- prompt i % 3
    assert mask.tolist() == [[False, True, True, True], [True] * 4, [True] * 4]


def test_prompt_batches_are_disjoint_across_processes_and_seeded():
    a0 = utils.data.prompt_batches(10, 2, 2, 0, seed=3)
    a1 = utils.data.prompt_batches(10, 2, 2, 1, seed=3)
    first = [next(a0) for _ in range(2)] + [next(a1) for _ in range(2)]
    assert len({i for batch in first for i in batch}) == 8  # one pass: no prompt twice
    assert next(utils.data.prompt_batches(10, 2, 2, 0, seed=3)) == first[0]


def parse(flags):
    return tyro.cli(rloo.Args, args=flags, use_underscores=True)


def test_a_trl_1_16_flag_names_every_default_it_changes(capsys):
    """One TRL 1.16 flag makes the command line TRL 1.16's, defaults included: one line says which changed."""
    args = rloo.read_trl_flags(parse("--sft_model_path m --reward_model_path r --epsilon_high 0.3".split()))
    line = capsys.readouterr().out.strip()
    assert args.dialect == "1.16" and args.learning_rate == 1e-6 and len(line.splitlines()) == 1
    assert line.startswith("--epsilon_high is a TRL 1.16 flag, so TRL 1.16's defaults apply: ")
    for change in ("--learning_rate=3e-06->1e-06", "--seed=1->42", "--max_completion_length=53->512",
                   "--num_iterations=4->1", "--num_train_epochs=1->3.0", "--stop_token=None->eos"):  # fmt: skip
        assert change in line
    assert "--num_generations" not in line  # the same default in both
    given = "--sft_model_path m --reward_model_path r --epsilon_high 0.3 --learning_rate 3e-6 --seed 1"
    rloo.read_trl_flags(parse(given.split()))
    line = capsys.readouterr().out
    assert "--learning_rate" not in line and "--seed" not in line and "--temperature=0.7->1.0" in line
    rloo.read_trl_flags(parse("--sft_model_path m --reward_model_path r".split()))  # TRL 0.19's: nothing
    assert capsys.readouterr().out == ""


def test_seed_commands_parse_and_give_trl_batch_sizes():
    minimal = parse(
        "--dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style --dataset_train_split "
        "descriptiveness --learning_rate 3e-6 --output_dir models/minimal/rloo --per_device_train_batch_size 64 "
        "--gradient_accumulation_steps 1 --total_episodes 10000 --model_name_or_path EleutherAI/pythia-14m "
        "--reward_model_path EleutherAI/pythia-14m --missing_eos_penalty 1.0".split()
    )
    rloo.fill_sizes(minimal, world_size=1, num_prompts=5000)
    assert (minimal.local_batch_size, minimal.local_dataloader_batch_size) == (64, 32)
    assert minimal.num_total_batches == 157  # ceil(10000 / 64)
    tldr = parse(
        "--dataset_name trl-lib/tldr --output_dir models/rloo --num_ppo_epochs 2 --num_mini_batches 2 "
        "--learning_rate 3e-6 --per_device_train_batch_size 16 --gradient_accumulation_steps 16 "
        "--total_episodes 1000000 --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr "
        "--reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr "
        "--local_rollout_forward_batch_size 16 --missing_eos_penalty 1.0 --stop_token eos --kl_coef 0.03".split()
    )
    rloo.fill_sizes(tldr, world_size=8, num_prompts=100000)
    assert (tldr.local_batch_size, tldr.batch_size, tldr.local_mini_batch_size) == (512, 4096, 256)
    assert (tldr.mini_batch_size, tldr.local_dataloader_batch_size) == (2048, 256)
    assert tldr.num_total_batches == 245  # ceil(1e6 / 4096)
    assert tldr.stop_token == "eos" and tldr.kl_coef == 0.03


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--rloo_k", "1"], "--rloo_k must be at least 2"),
        (
            ["--rloo_k", "3"],
            "--rloo_k 3 must divide .* = 8; change --rloo_k or --per_device_train_batch_size",
        ),
        (["--num_mini_batches", "0"], "--num_mini_batches must be at least 1"),
        (["--reward_fn", "f.py:f"], "exactly one of --reward_model_path and --reward_fn"),
        (["--stop_token", "eos", "--stop_token_id", "3"], "only one of --stop_token"),
    ],
)
def test_bad_flags_are_refused_with_one_sentence(flags, message):
    args = parse(["--sft_model_path", "m", "--reward_model_path", "r", *flags])
    with pytest.raises(ValueError, match=message):
        rloo.fill_sizes(args, world_size=1)


def test_too_few_prompts_for_one_update():
    args = parse(["--sft_model_path", "m", "--reward_model_path", "r", "--per_device_train_batch_size", "8"])
    with pytest.raises(ValueError, match="3 prompts, fewer than the 4 of one update"):
        rloo.fill_sizes(args, world_size=1, num_prompts=3)


# ------------------------------------------------------------------------------------------- runs on the tiny world
@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The rule-reward lab (conftest.make_rl_lab): 64 prompts of different lengths, a policy that stops early
    about half of the time with dropout in its config, and the rule rewards in rules.py."""
    return make_rl_lab(world, tmp_path_factory.mktemp("rloo_lab"), num_prompts=64)


def common_flags(tmp_path, name):
    return ["--logging_dir", str(tmp_path / "runs"), "--run_name", name, "--output_dir", str(tmp_path / name),
            "--response_length", "8", "--num_sample_generations", "0"]  # fmt: skip


def test_trl_style_reward_function_gets_its_rows_columns(world, lab, tmp_path):
    """--reward_fn with **kwargs is called as TRL calls it: each completion with its own row's columns."""
    data = write_trl_style_data(lab, tmp_path / "data.jsonl", conversational=False)
    flags = common_flags(tmp_path, "trl_style") + [
        "--sft_model_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:trl_style",
        "--dataset_name", str(data), "--rloo_k", "4", "--per_device_train_batch_size", "8",
        "--num_mini_batches", "2", "--total_episodes", "32", "--local_rollout_forward_batch_size", "6",
    ]  # fmt: skip
    run_script(["rloo.py", *flags], env={"REWARD_LOG": str(tmp_path / "calls.jsonl")})
    assert check_trl_style_calls(tmp_path / "calls.jsonl", conversational=False) == 32


def test_first_update_recomputes_the_sampling_logprobs(lab, world, tmp_path):
    """Learning rate 0: every update's training forward must give back the logprobs of sampling (ratio 1, KL 0,
    nothing clipped) under left padding, truncation after EOS, a temperature, and dropout in the config."""
    flags = common_flags(tmp_path, "invariant") + [
        "--model_name_or_path", str(lab / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(lab / "prompts.jsonl"), "--learning_rate", "0", "--rloo_k", "2",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_mini_batches", "2",
        "--num_ppo_epochs", "2", "--cliprange", "0.001", "--total_episodes", "32", "--temperature", "0.7",
        "--stop_token", "eos", "--missing_eos_penalty", "1.0", "--local_rollout_forward_batch_size", "6",
        "--num_sample_generations", "1",
    ]  # fmt: skip
    proc = run_script(["rloo.py", *flags], timeout=300)
    assert "update 1" in proc.stdout  # the sample table
    lines = read_metrics(tmp_path / "runs" / "invariant")
    assert len(lines) == 2
    for metrics in lines:
        assert set(metrics) == METRICS
        assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # measured: within 1e-7
        assert metrics["val/ratio_var"] < 1e-9
        assert metrics["policy/approxkl_avg"] < 1e-9
        assert metrics["policy/clipfrac_avg"] == 0.0
        assert abs(metrics["objective/kl"]) < 1e-3  # the policy is still the reference
        assert 0 < metrics["val/num_eos_tokens"] < 16  # some completions truncated, some not
        assert metrics["learning_rate"] == 0.0
    assert [m["episode"] for m in lines] == [16, 32]
    assert list((tmp_path / "runs" / "invariant").glob("events.out.tfevents.*"))
    out = tmp_path / "invariant"
    assert "RLOO" in (out / "README.md").read_text() and (out / "tokenizer.json").exists()
    before, after = weights(lab / "policy"), weights(out)
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_missing_eos_penalty_lands_on_the_unfinished(lab, tmp_path):
    """A reward of 0 and --missing_eos_penalty 1: each update's mean score is minus the share of completions
    without EOS (the policy finishes about half of them, so the two shares differ). The learning rate is TRL
    0.19's: its linear schedule over the updates steps once an update, after it."""
    (tmp_path / "zero.py").write_text(
        "def zero(prompts, completions):\n    return [0.0] * len(completions)\n"
    )
    flags = common_flags(tmp_path, "penalty") + [
        "--model_name_or_path", str(lab / "policy"), "--reward_fn", f"{tmp_path / 'zero.py'}:zero",
        "--dataset_name", str(lab / "prompts.jsonl"), "--rloo_k", "2", "--per_device_train_batch_size", "8",
        "--total_episodes", "48", "--stop_token", "eos", "--missing_eos_penalty", "1.0",
    ]  # fmt: skip
    run_script(["rloo.py", *flags], timeout=300)
    lines = read_metrics(tmp_path / "runs" / "penalty")
    assert len(lines) == 6 and any(m["val/num_eos_tokens"] != 4 for m in lines)  # 8 completions an update
    for metrics in lines:
        assert metrics["objective/scores"] == pytest.approx(-(8 - metrics["val/num_eos_tokens"]) / 8)
    assert [m["learning_rate"] for m in lines] == pytest.approx([3e-6 * (1 - u / 6) for u in range(6)])


def test_rule_based_reward_rises(world, lab, tmp_path):
    flags = common_flags(tmp_path, "learn") + [
        "--sft_model_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:key_words",
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--rloo_k", "4",
        "--per_device_train_batch_size", "16", "--num_ppo_epochs", "1", "--learning_rate", "3e-3",
        "--kl_coef", "0.01", "--total_episodes", str(16 * 20), "--lr_scheduler_type", "constant",
    ]  # fmt: skip
    run_script(["rloo.py", *flags], timeout=300)
    scores = [m["objective/scores"] for m in read_metrics(tmp_path / "runs" / "learn")]
    assert len(scores) == 20
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    assert first < 1.0 and last > first + 2.0, scores


def test_two_processes_keep_each_prompt_group_together(world, lab, tmp_path):
    """2 processes, token-level KL and every normalization on. The score depends on the prompt alone and the KL
    weight is 0, so if every group of k completions is one prompt's, all advantages are exactly 0: nothing moves."""
    flags = common_flags(tmp_path, "ddp") + [
        "--sft_model_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:prompt_only",
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--rloo_k", "2",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--num_ppo_epochs", "2",
        "--learning_rate", "1e-2", "--kl_coef", "0", "--token_level_kl", "--normalize_reward",
        "--normalize_advantage", "--total_episodes", "16",
    ]  # fmt: skip
    run_torchrun(["rloo.py", *flags], nproc=2)
    lines = read_metrics(tmp_path / "runs" / "ddp")
    assert [m["episode"] for m in lines] == [8, 16]  # both processes' completions counted, logged once
    for metrics in lines:
        assert metrics["loss/policy_avg"] == 0.0
        assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-4)
    before, after = weights(world / "policy"), weights(tmp_path / "ddp")
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_copied_script_runs_and_is_deterministic(world, lab, tmp_path):
    """rloo.py + utils/ alone in an empty folder: --help and a run there give the same weights as from here."""
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(ROOT / "rloo.py", copy)
    shutil.copytree(ROOT / "utils", copy / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    assert "--rloo_k" in run_script(["rloo.py", "--help"], cwd=copy).stdout
    flags = [
        "--sft_model_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:chars",
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--rloo_k", "2",
        "--per_device_train_batch_size", "4", "--num_mini_batches", "2", "--num_ppo_epochs", "2",
        "--learning_rate", "1e-3", "--token_level_kl", "--whiten_rewards", "--normalize_advantage",
        "--total_episodes", "16", "--seed", "3",
    ]  # fmt: skip
    run_script(["rloo.py", *flags, *common_flags(tmp_path, "here")])
    run_script(["rloo.py", *flags, *common_flags(tmp_path, "there")], cwd=copy)
    here, there, start = weights(tmp_path / "here"), weights(tmp_path / "there"), weights(world / "policy")
    assert all(torch.equal(here[n], there[n]) for n in here)
    assert not all(torch.equal(here[n], start[n]) for n in here)  # it did train


def test_missing_prompt_column_fails_before_loading_models(lab, world, tmp_path):
    flags = common_flags(tmp_path, "out") + [
        "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(lab / "no_prompt.jsonl"),
    ]  # fmt: skip
    proc = run_script(["rloo.py", *flags], check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "missing column(s) ['prompt']" in last and "found ['query']" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_reward_fn_with_wrong_count_fails_and_leaves_output_dir(lab, world, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    flags = common_flags(tmp_path, "out") + [
        "--sft_model_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:one_short",
        "--dataset_name", str(lab / "prompts.jsonl"), "--per_device_train_batch_size", "4",
        "--overwrite_output_dir",
    ]  # fmt: skip
    proc = run_script(["rloo.py", *flags], check=False)
    assert proc.returncode != 0
    assert "returned 3 values for 4 completions" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


def test_rloo_k_below_two_through_the_command_line(tmp_path):
    proc = run_script(
        ["rloo.py", "--sft_model_path", "m", "--reward_model_path", "r", "--rloo_k", "1"], check=False
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("rloo.py: error: --rloo_k must be at least 2")
