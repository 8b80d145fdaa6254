"""ppo.py: the math against slow loops from the equations and hand-computed cases, then the command line on the
tiny world (the logprob invariant, learning from a rule-based reward, a reward model, 2 processes, copies)."""

import json
import math
import random
import shutil
import statistics

import pytest
import torch

import ppo
import utils.data
import utils.generation
import utils.run
import utils.stats
from conftest import ROOT, run_script, run_torchrun


# ---------------------------------------------------------------------------------------------------------- GAE
def slow_gae(rewards, values, length, gamma, lam):
    """A_t = delta_t + gamma lam A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t, the episode ending at `length`."""
    advantages = [0.0] * len(rewards)
    next_advantage, next_value = 0.0, 0.0
    for t in reversed(range(length)):
        delta = rewards[t] + gamma * next_value - values[t]
        advantages[t] = delta + gamma * lam * next_advantage
        next_advantage, next_value = advantages[t], values[t]
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.5, 0.0)])
def test_gae_matches_reversed_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(6, 7, generator=g), torch.randn(6, 7, generator=g)
    lengths = torch.tensor([7, 1, 3, 5, 7, 2])
    mask = utils.generation.lengths_to_mask(lengths, 7)
    advantages, returns = ppo.gae(rewards, values, mask, gamma, lam)
    for b in range(6):
        expected = slow_gae(rewards[b].tolist(), values[b].tolist(), int(lengths[b]), gamma, lam)
        assert advantages[b].tolist() == pytest.approx(expected, abs=1e-5)
        length = int(lengths[b])
        expected_returns = [
            a + v * (t < length) for t, (a, v) in enumerate(zip(expected, values[b].tolist()))
        ]
        assert returns[b].tolist() == pytest.approx(expected_returns, abs=1e-5)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()  # nothing after the last token


def test_gae_with_gamma_lam_one_gives_reward_to_go_returns():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    values = torch.tensor([[0.5, -1.0, 2.0, 99.0]])
    mask = torch.tensor([[True, True, True, False]])
    advantages, returns = ppo.gae(rewards, values, mask, 1.0, 1.0)
    assert returns.tolist() == [[6.0, 5.0, 3.0, 0.0]]
    assert advantages.tolist() == [[5.5, 6.0, 1.0, 0.0]]


def test_advantage_whitening_over_response_tokens_matches_statistics():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(5, 6, generator=g) * 3 + 2
    mask = utils.generation.lengths_to_mask(torch.tensor([6, 2, 4, 1, 5]), 6)
    kept = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    mean, std = statistics.mean(kept), statistics.stdev(kept)  # Bessel-corrected, as utils.stats.masked_var
    whitened = utils.stats.masked_whiten(values, mask) * mask
    assert whitened[mask].tolist() == pytest.approx([(v - mean) / std for v in kept], abs=1e-5)
    assert (whitened[~mask] == 0).all()
    kept_mean = utils.stats.masked_whiten(values, mask, shift_mean=False)
    assert kept_mean[mask].tolist() == pytest.approx([(v - mean) / std + mean for v in kept], abs=1e-5)


class OneOfTwoProcesses:
    """Process `index` of two, as ppo.whiten sees its accelerator: gather concatenates both processes' tensors."""

    def __init__(self, index, values, masks):
        self.process_index, self.values, self.masks = index, values, masks

    def gather(self, tensor):
        return torch.cat(self.values if tensor.is_floating_point() else [m.long() for m in self.masks])


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whitening_per_process_by_default_or_across_processes(shift_mean):
    """TRL's PPO whitens each process's advantages with its own statistics (the default); with
    --whiten_across_processes every process uses the statistics of all of them, which is what one process with
    the whole batch computes, so N processes update as 1 does."""
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(3, 6, generator=g), 3 * torch.randn(3, 6, generator=g) + 5]  # unlike statistics
    masks = [utils.generation.lengths_to_mask(torch.tensor(n), 6) for n in ([6, 2, 4], [1, 5, 3])]
    per_process = [ppo.whiten(v, m, shift_mean) for v, m in zip(values, masks)]
    across = [
        ppo.whiten(v, m, shift_mean, accelerator=OneOfTwoProcesses(i, values, masks))
        for i, (v, m) in enumerate(zip(values, masks))
    ]
    for v, m, w in zip(values, masks, per_process):  # each process alone: masked_whiten of its own tokens
        torch.testing.assert_close(w, utils.stats.masked_whiten(v, m, shift_mean) * m)
    one_process = ppo.whiten(torch.cat(values), torch.cat(masks), shift_mean)
    torch.testing.assert_close(torch.cat(across), one_process)
    assert (torch.cat(per_process) - one_process).abs().max() > 0.5  # the two choices really differ


def test_defaults_are_trls_and_ours_are_flags(capsys):
    """A TRL command gets TRL's PPO: no stop token unless asked (all --response_length tokens are kept and
    scored), whitening per process; ours (EOS stopping, whitening across processes) are flags in --help."""
    args = utils.run.parse_args(ppo.Args, [])
    assert args.stop_token is None and args.stop_token_id is None and not args.whiten_across_processes
    with pytest.raises(SystemExit):
        utils.run.parse_args(ppo.Args, ["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--whiten_across_processes" in help_text and "as TRL's PPO" in help_text
    assert "None (TRL's default): keep all --response_length tokens" in help_text


# ---------------------------------------------------------------------------------------------------------- KL
def test_kl_estimators_match_their_definitions():
    g = torch.Generator().manual_seed(2)
    logp, ref = -torch.rand(4, 5, generator=g) * 3, -torch.rand(4, 5, generator=g) * 3
    definitions = {
        "k1": lambda lp, lq: lp - lq,
        "k2": lambda lp, lq: 0.5 * (lq - lp) ** 2,
        "k3": lambda lp, lq: math.exp(lq - lp) - 1 - (lq - lp),
        "abs": lambda lp, lq: abs(lp - lq),
    }
    for name, definition in definitions.items():
        got = ppo.kl_per_token(logp, ref, name)
        expected = [definition(a, b) for a, b in zip(logp.flatten().tolist(), ref.flatten().tolist())]
        assert got.flatten().tolist() == pytest.approx(expected, abs=1e-6), name
    assert (ppo.kl_per_token(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="kl_estimator"):
        ppo.kl_per_token(logp, ref, "k4")


def test_full_kl_is_the_exact_kl_and_k1_k3_are_unbiased():
    g = torch.Generator().manual_seed(3)
    logits, ref_logits = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    full = ppo.full_kl(logits, ref_logits)
    for b in range(2):
        for t in range(3):
            p, q = logits[b, t].softmax(-1).tolist(), ref_logits[b, t].softmax(-1).tolist()
            exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
            assert full[b, t].item() == pytest.approx(exact, abs=1e-5)
            # Expectation over y ~ pi of the per-sample estimators, enumerated over the whole vocabulary.
            logp, logq = logits[b, t].log_softmax(-1), ref_logits[b, t].log_softmax(-1)
            for name in ("k1", "k3"):
                expectation = sum(pi * k for pi, k in zip(p, ppo.kl_per_token(logp, logq, name).tolist()))
                assert expectation == pytest.approx(exact, abs=1e-5), name
    assert (full > 0).all()
    assert ppo.full_kl(logits, logits).abs().max() < 1e-6


# ---------------------------------------------------------------------------------------------------------- rewards
def test_reward_layout_puts_the_score_on_the_last_response_token():
    kl = torch.ones(3, 5)
    mask = utils.generation.lengths_to_mask(torch.tensor([3, 5, 1]), 5)
    rewards, non_score = ppo.per_token_rewards(kl, torch.tensor([10.0, 20.0, 30.0]), mask, kl_coef=0.1)
    expected = [[-0.1, -0.1, 9.9, 0, 0], [-0.1, -0.1, -0.1, -0.1, 19.9], [29.9, 0, 0, 0, 0]]
    torch.testing.assert_close(rewards, torch.tensor(expected))
    expected = [[-0.1] * 3 + [0] * 2, [-0.1] * 5, [-0.1] + [0] * 4]
    torch.testing.assert_close(non_score, torch.tensor(expected))


@pytest.mark.parametrize("pad_id", [1, 0])  # pad distinct from, and equal to, the EOS (id 0)
def test_reward_layout_after_truncation_and_the_missing_eos_penalty(pad_id):
    EOS = 0
    responses = torch.tensor([[5, 6, EOS, 7, 8], [5, 6, 7, 8, 9], [EOS, 5, 6, 7, 8]])
    truncated, lengths = utils.generation.truncate_response(responses, EOS, pad_id)
    mask = utils.generation.lengths_to_mask(lengths, 5)
    scores, contains_eos = ppo.penalize_missing_eos(torch.tensor([1.0, 2.0, 3.0]), truncated, mask, EOS, 0.5)
    assert contains_eos.tolist() == [True, False, True]
    assert scores.tolist() == [1.0, 1.5, 3.0]
    assert ppo.penalize_missing_eos(torch.tensor([1.0, 2.0, 3.0]), truncated, mask, EOS, None)[
        0
    ].tolist() == [
        1.0,
        2.0,
        3.0,
    ]
    rewards, _ = ppo.per_token_rewards(torch.zeros(3, 5), scores, mask, kl_coef=0.1)
    eos_index = [2, 4, 0]  # the EOS itself (the last token when there is none), never the token after it
    for b, i in enumerate(eos_index):
        assert rewards[b, i] == scores[b] and rewards[b].count_nonzero() == 1


def test_running_moments_and_score_shaping():
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(n, generator=g) * 2 + 1 for n in (3, 8, 1, 5)]
    moments, seen = ppo.RunningMoments(), []
    for batch in batches:
        seen += batch.tolist()
        mean, std = moments.update(batch)
        assert mean == pytest.approx(statistics.fmean(seen), abs=1e-6)
        assert std == pytest.approx(statistics.pstdev(seen), abs=1e-6)
    scores = torch.tensor([-4.0, 0.0, 5.0])
    scaled = ppo.shape_scores(scores, moments, norm=False, clip=None)
    assert scaled.tolist() == pytest.approx((scores / statistics.pstdev(seen)).tolist(), abs=1e-5)
    normed = ppo.shape_scores(scores, moments, norm=True, clip=None)
    expected = ((scores - statistics.fmean(seen)) / statistics.pstdev(seen)).tolist()
    assert normed.tolist() == pytest.approx(expected, abs=1e-5)
    assert ppo.shape_scores(scores, None, norm=False, clip=2.0).tolist() == [-2.0, 0.0, 2.0]


# ---------------------------------------------------------------------------------------------------------- losses
def test_clipped_policy_loss_hand_cases():
    ratios = [1.5, 0.5, 1.5, 0.5, 9.0]  # the last token is padding: ignored
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 100.0]])
    old = torch.zeros(1, 5)
    new = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    mask = torch.tensor([[True, True, True, True, False]])
    loss, clipfrac, approx_kl, ratio = ppo.policy_loss(new, old, advantages, mask, cliprange=0.2)
    # per token max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 1.5, 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert clipfrac.item() == 0.5
    expected_kl = 0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4
    assert approx_kl.item() == pytest.approx(expected_kl)
    assert ratio[0, :4].tolist() == pytest.approx(ratios[:4])
    loss.backward()
    # d/dlogp of -A r is -A r: only the unclipped tokens carry a gradient, padding none.
    assert new.grad[0].tolist() == pytest.approx([0.0, -0.5 / 4, 1.5 / 4, 0.0, 0.0])


def test_clipped_value_loss_hand_cases():
    old = torch.zeros(1, 5)
    values = torch.tensor([[0.5, -0.1, 1.5, -0.5, 50.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    loss, clipfrac = ppo.value_loss(values, old, returns, mask, cliprange_value=0.2)
    # max((V-G)^2, (clip(V, -0.2, 0.2)-G)^2): 0.64 (clipped), 1.21, 0.64 (clipped), 2.25
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21 + 0.64 + 2.25) / 4)
    assert clipfrac.item() == 0.5


def test_adaptive_kl_controller_follows_ziegler_et_al():
    controller = ppo.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    beta = 0.1
    for kl in (9.0, 3.0, 6.6, 6.0, 100.0, 0.0):
        error = max(-0.2, min(0.2, (kl - 6.0) / 6.0))  # e_t = clip((KL - target) / target, -0.2, 0.2)
        beta = beta * (1 + error * 512 / 10000)  # beta_{t+1} = beta_t (1 + K_beta e_t), K_beta = n / horizon
        assert controller.update(kl, n_steps=512) == pytest.approx(beta, rel=1e-12)
    assert ppo.AdaptiveKLController(0.1, 6.0, 10000).update(9.0, 512) == pytest.approx(0.1 * 1.01024)


# ---------------------------------------------------------------------------------------------------------- sizes
def valid_args(**kwargs) -> ppo.Args:
    """Args that pass fill_sizes' flag checks (one reward, a policy), so that the size arithmetic is tested."""
    return ppo.Args(reward_fn="f.py:f", sft_model_path="policy", **kwargs)


def test_batch_arithmetic_follows_trl():
    args = valid_args(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2)
    args.total_episodes = 100
    ppo.fill_sizes(args, world_size=2, num_prompts=64)
    assert (args.local_batch_size, args.batch_size, args.mini_batch_size) == (16, 32, 16)
    assert (args.local_mini_batch_size, args.num_total_batches, args.world_size) == (8, 4, 2)
    args = valid_args(per_device_train_batch_size=4, num_train_epochs=2.0)
    assert ppo.fill_sizes(args, 1, 30).total_episodes == 60


def test_bad_batch_sizes_name_the_flags():
    with pytest.raises(ValueError, match="--batch_size / --num_mini_batches: 10 is not divisible by 4"):
        ppo.fill_sizes(valid_args(batch_size=10, num_mini_batches=4), 1, 100)
    with pytest.raises(ValueError, match="--batch_size 12 does not match .* = 8"):
        ppo.fill_sizes(valid_args(batch_size=12, num_mini_batches=1, per_device_train_batch_size=8), 1, 100)
    with pytest.raises(ValueError, match="fewer than batch_size 16"):
        ppo.fill_sizes(valid_args(per_device_train_batch_size=16), 1, 10)
    with pytest.raises(ValueError, match="--num_mini_batches must be at least 1"):
        ppo.fill_sizes(ppo.Args(num_mini_batches=0, reward_fn="f.py:f"), 1)
    with pytest.raises(ValueError, match="exactly one of --reward_model_path and --reward_fn"):
        ppo.fill_sizes(ppo.Args(), 1)


def test_fewer_episodes_than_one_update_are_refused():
    """--total_episodes 2 with a batch of 8 would silently run one update of 8 episodes (TRL rounds up)."""
    with pytest.raises(ValueError, match=r"--total_episodes 2 is fewer than the 8 episodes of one update"):
        ppo.fill_sizes(valid_args(total_episodes=2, per_device_train_batch_size=8), 1, 100)
    with pytest.raises(ValueError, match=r"--total_episodes 12 is fewer than the 16 episodes of one update"):
        ppo.fill_sizes(valid_args(total_episodes=12, per_device_train_batch_size=8), 2, 100)
    with pytest.raises(ValueError, match=r"--num_train_epochs 0.05 \(5 episodes\) is fewer than the 8"):
        ppo.fill_sizes(valid_args(num_train_epochs=0.05, per_device_train_batch_size=8), 1, 100)
    assert (
        ppo.fill_sizes(valid_args(total_episodes=8, per_device_train_batch_size=8), 1, 100).num_total_batches
        == 1
    )
    assert (
        ppo.fill_sizes(valid_args(total_episodes=9, per_device_train_batch_size=8), 1, 100).num_total_batches
        == 2
    )


def test_prompt_batches_shard_one_shuffle_across_processes():
    streams = [utils.data.prompt_batches(20, 4, 2, rank, seed=3) for rank in range(2)]
    seen = []
    for _ in range(2):  # the two full batches of the first pass: 16 distinct prompts
        a, b = next(streams[0]), next(streams[1])
        assert len(a) == len(b) == 4 and not set(a) & set(b)
        seen += a + b
    assert len(set(seen)) == 16
    assert next(utils.data.prompt_batches(20, 4, 2, 0, seed=3)) == next(
        utils.data.prompt_batches(20, 4, 2, 0, seed=3)
    )


# ---------------------------------------------------------------------------------------------------------- the CLI
def small_flags(world, tmp_path, name, *extra):
    return [
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft",
        "--dataset_test_split", "validation", "--response_length", "8", "--per_device_train_batch_size", "8",
        "--local_rollout_forward_batch_size", "16", "--logging_dir", str(tmp_path / "runs"),
        "--output_dir", str(tmp_path / name), "--run_name", name, "--stop_token", "eos", *extra,
    ]  # fmt: skip


def read_metrics(tmp_path, name):
    return [
        json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]


def gpt2_policy(world, path, eos_scale):
    """A tiny GPT-2 (absolute position embeddings, so left padding needs position ids from the attention mask)
    with every dropout at 0.1, a likelier EOS (so that truncation is common), and pad == eos in its tokenizer."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer")
    tokenizer.pad_token = tokenizer.eos_token
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=128, attn_pdrop=0.1,
        resid_pdrop=0.1, embd_pdrop=0.1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # the output embedding is tied to the input one
        model.get_input_embeddings().weight[tokenizer.eos_token_id] *= eos_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_first_update_recomputes_the_sampling_logprobs(world, tmp_path):
    """The invariant: with learning rate 0 every recomputed logprob equals the sampling one (ratio 1, approximate
    KL 0, no clipping) - with left padding, truncation after EOS, pad == eos and dropout set in the configs."""
    from transformers import AutoConfig

    policy = gpt2_policy(world, tmp_path / "policy", eos_scale=15.0)
    reward = shutil.copytree(world / "reward", tmp_path / "reward")  # also the critic: dropout in it too
    config = AutoConfig.from_pretrained(reward)
    config.attention_dropout = 0.1
    config.save_pretrained(reward)
    rng, words = random.Random(0), "the cat sat on a mat and then went to sleep again very happy".split()
    prompts = [" ".join(rng.choices(words, k=rng.randint(1, 25))) + "\n\nTL;DR:" for _ in range(32)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    run_script([
        "ppo.py", "--sft_model_path", str(policy), "--reward_model_path", str(reward),
        "--dataset_name", str(tmp_path / "prompts.jsonl"), "--learning_rate", "0", "--total_episodes", "32",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_mini_batches", "2",
        "--local_rollout_forward_batch_size", "6", "--num_ppo_epochs", "2", "--response_length", "8",
        "--missing_eos_penalty", "1.0", "--num_sample_generations", "0", "--kl_estimator", "k3",
        "--stop_token", "eos",
        "--logging_dir", str(tmp_path / "runs"), "--output_dir", str(tmp_path / "out"), "--run_name", "inv",
    ])  # fmt: skip
    metrics = read_metrics(tmp_path, "inv")
    assert len(metrics) == 2
    for m in metrics:
        assert m["val/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert m["val/ratio_var"] < 1e-9
        assert m["policy/approxkl_avg"] < 1e-10
        assert m["policy/clipfrac_avg"] == 0.0
        assert abs(m["objective/kl"]) < 1e-4  # policy == reference
        assert 0 < m["val/num_eos_tokens"] < 16  # some responses were truncated, some were not
        assert m["val/response_length"] < 8


def test_rule_based_reward_rises(world, tmp_path):
    """The random policy rarely says a key word of the tiny world; rewarded for it, it learns to within 20 updates."""
    import tiny_world

    reward_file = tmp_path / "reward.py"
    reward_file.write_text(
        f"KEYS = set({tiny_world.KEY_WORDS!r})\n\n\n"
        "def key_words(prompts, completions):\n"
        "    return [float(sum(w in KEYS for w in c.split())) for c in completions]\n"
    )
    flags = small_flags(world, tmp_path, "rule", "--sft_model_path", str(world / "policy"))
    flags += ["--reward_fn", f"{reward_file}:key_words", "--total_episodes", "320"]
    flags += ["--per_device_train_batch_size", "16", "--num_ppo_epochs", "2", "--max_prompt_length", "8"]
    flags += ["--learning_rate", "3e-3", "--num_sample_generations", "0"]
    run_script(["ppo.py", *flags])
    metrics = read_metrics(tmp_path, "rule")
    scores = [m["objective/scores"] for m in metrics]
    first, last = statistics.mean(scores[:4]), statistics.mean(scores[-4:])
    assert len(metrics) == 20 and first < 0.6 and last > first + 1.0, scores
    assert all(math.isfinite(m["objective/kl"]) and m["objective/kl"] < 100 for m in metrics)
    assert metrics[-1]["objective/kl"] > 0  # the policy moved away from the reference


STATEFUL_REWARD = """
import json, os

PROMPTS = {json.loads(line)["prompt"] for split in ("sft", "validation")
           for line in open(os.path.join(os.environ["DATASET"], split + ".jsonl"))}


def stateful(prompts, completions, trainer_state, log_metric, **kwargs):
    log_metric("custom/step", float(trainer_state.global_step))
    log_metric("custom/known_prompts", float(all(p in PROMPTS for p in prompts)))
    return [float(len(c)) for c in completions]
"""


def test_reward_function_gets_the_dataset_prompts_and_the_run_state(world, tmp_path):
    """As TRL calls a reward function: the dataset's own prompts, trainer_state (the update about to be made) and
    log_metric, whose values reach the logs (those of the held-out evaluation as eval/..., after the update: the
    updates done, as TRL's evaluation sees its state)."""
    (tmp_path / "stateful.py").write_text(STATEFUL_REWARD)
    flags = small_flags(world, tmp_path, "stateful", "--sft_model_path", str(world / "policy"))
    flags += ["--reward_fn", f"{tmp_path / 'stateful.py'}:stateful", "--total_episodes", "16"]
    flags += ["--num_ppo_epochs", "1", "--num_sample_generations", "1", "--max_prompt_length", "16"]
    run_script(["ppo.py", *flags], env={"DATASET": str(world / "dataset")})
    metrics = read_metrics(tmp_path, "stateful")
    assert [m["custom/step"] for m in metrics] == [0.0, 1.0]
    assert all(m["custom/known_prompts"] == 1.0 for m in metrics)  # not the tokens cut to --max_prompt_length
    assert metrics[-1]["eval/custom/step"] == 2.0 and metrics[-1]["eval/custom/known_prompts"] == 1.0


ISSUE_METRICS = (
    "eps objective/kl objective/entropy objective/non_score_reward objective/rlhf_reward objective/scores "
    "policy/approxkl_avg policy/clipfrac_avg loss/policy_avg loss/value_avg val/clipfrac_avg val/ratio "
    "val/ratio_var val/num_eos_tokens learning_rate episode eval/objective/scores"
).split()


def reward_model_flags(world, tmp_path, name):
    return small_flags(world, tmp_path, name) + [
        "--sft_model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
        "--total_episodes", "48", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--num_mini_batches", "2", "--num_ppo_epochs", "2", "--learning_rate", "1e-3", "--kl_estimator", "full",
        "--missing_eos_penalty", "1.0", "--use_score_scaling", "--use_score_norm", "--score_clip", "3",
        "--whiten_rewards", "--adaptive_kl", "--target_kl", "0.01", "--kl_horizon", "100",
        "--max_approx_kl", "1e-8", "--num_sample_generations", "1", "--max_prompt_length", "24",
    ]  # fmt: skip


def test_reward_model_run_from_a_copy_logs_everything_and_is_deterministic(world, tmp_path):
    """From a directory holding only ppo.py and utils/: every option on, every metric of the issue logged, a
    loadable policy saved; a second run from the repository with the same seed gives the same weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(ROOT / "ppo.py", copy)
    shutil.copytree(ROOT / "utils", copy / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    help_text = run_script(["ppo.py", "--help"], cwd=copy).stdout
    assert "--kl_estimator" in help_text and "--missing_eos_penalty" in help_text
    out = run_script(["ppo.py", *reward_model_flags(world, tmp_path, "rm")], cwd=copy)
    metrics = read_metrics(tmp_path, "rm")
    assert len(metrics) == 3 and all(math.isfinite(metrics[-1][k]) for k in ISSUE_METRICS)
    assert all(k in m for k in ISSUE_METRICS[:-1] for m in metrics)  # eval/...: at the evaluations
    assert [m["episode"] for m in metrics] == [16, 32, 48]
    assert metrics[0]["learning_rate"] > metrics[-1]["learning_rate"] > 0
    # adaptive KL: the first KL (0, policy == reference) is under the target: beta *= 1 - 0.2 * 16 / 100
    assert metrics[0]["objective/kl_coef"] == 0.05 and metrics[1]["objective/kl_coef"] == pytest.approx(
        0.0484
    )
    assert any(m["policy/early_stopped"] == 1.0 for m in metrics)
    assert "update 3: test prompts" in out.stdout
    assert list((tmp_path / "runs" / "rm").glob("events.out.tfevents.*"))
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["grad_norm"] > 0 for m in metrics)
    saved = tmp_path / "rm"
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert not any("score" in k for k in model.state_dict())
    assert "PPO" in (saved / "README.md").read_text() and (saved / "tokenizer.json").exists()
    initial = AutoModelForCausalLM.from_pretrained(world / "policy").state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items())  # it trained

    run_script(["ppo.py", *reward_model_flags(world, tmp_path, "rm2")])
    first, second = load_file(saved / "model.safetensors"), load_file(tmp_path / "rm2" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_two_processes(world, tmp_path):
    flags = small_flags(world, tmp_path, "ddp", "--sft_model_path", str(world / "policy"))
    flags += ["--reward_model_path", str(world / "reward"), "--total_episodes", "32", "--num_ppo_epochs", "1"]
    flags += [
        "--per_device_train_batch_size",
        "4",
        "--num_mini_batches",
        "2",
        "--num_sample_generations",
        "1",
    ]
    flags += ["--max_prompt_length", "16"]
    run_torchrun(["ppo.py", *flags])
    metrics = read_metrics(tmp_path, "ddp")
    assert [m["episode"] for m in metrics] == [16, 32]  # world size 2, batch size 16, 2 updates
    assert len(metrics) == 2 and all(math.isfinite(m["loss/policy_avg"]) for m in metrics)
    assert (tmp_path / "ddp" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------- bad input
def in_process_args(world, tmp_path, **overrides):
    base = dict(
        sft_model_path=str(world / "policy"), dataset_name=str(world / "dataset"), dataset_train_split="sft",
        response_length=4, per_device_train_batch_size=4, total_episodes=4, num_sample_generations=0,
        logging_dir=str(tmp_path / "runs"), output_dir=str(tmp_path / "out"), run_name="bad",
    )  # fmt: skip
    return ppo.Args(**{**base, **overrides})


@pytest.mark.parametrize(
    "body,error,message",
    [
        ("return [1.0]", ValueError, "returned 1 values for 4 completions"),
        (
            "return [float('nan')] * len(completions)",
            utils.run.NonFiniteError,
            "step 1: scores is not finite",
        ),
    ],
)
def test_bad_reward_functions(world, tmp_path, fresh_accelerate_state, body, error, message):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    (tmp_path / "r.py").write_text(f"def f(prompts, completions):\n    {body}\n")
    args = in_process_args(world, tmp_path, reward_fn=f"{tmp_path / 'r.py'}:f", overwrite_output_dir=True)
    with pytest.raises(error, match=message):
        ppo.main(args)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]  # a failed run destroys nothing


def test_bad_inputs_fail_before_loading_models(world, tmp_path, fresh_accelerate_state):
    with pytest.raises(ValueError, match="does not exist"):
        ppo.main(in_process_args(world, tmp_path, reward_fn=str(tmp_path / "missing.py:f")))
    (tmp_path / "no_prompt.jsonl").write_text('{"text": "a"}\n' * 8)
    (tmp_path / "f.py").write_text("def f(prompts, completions):\n    return [0.0] * len(completions)\n")
    args = in_process_args(
        world,
        tmp_path,
        dataset_name=str(tmp_path / "no_prompt.jsonl"),
        dataset_train_split="train",
        reward_fn=f"{tmp_path}/f.py:f",
    )
    with pytest.raises(
        ValueError, match=r"missing column\(s\) \['prompt'\]: expected \['prompt'\], found \['text'\]"
    ):
        ppo.main(args)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="exists and is not empty"):
        ppo.main(in_process_args(world, tmp_path, reward_fn=f"{tmp_path}/f.py:f"))
    proc = run_script(["ppo.py", "--reward_fn", "f.py:f", "--num_mini_batches", "0"], check=False)
    assert proc.returncode != 0 and "--num_mini_batches must be at least 1" in proc.stderr
