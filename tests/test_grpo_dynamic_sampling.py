"""grpo.py --filter_groups, DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2;
utils/dynamic_sampling.py): the group filter against a loop written from the paper's definition (keep a prompt
when 0 < |correct| < G; for any reward, when not all of its G rewards are equal), the assembly of the batch from
several rounds, the flag checks, and runs through the command line on the tiny world: groups dropped, none
without a spread trained on, exact resume, 2 processes. Also TRL 1.16's entropy and off-policy masks
(--top_entropy_quantile, --off_policy_mask_threshold) against TRL's own functions on the same tensors (their
whole updates: tests/test_update_parity_grpo.py)."""

import math
import shutil

import pytest
import torch

import grpo
from conftest import ROOT, make_rl_lab, read_metrics, run_deepspeed, run_script, run_torchrun, weights
from utils import dynamic_sampling, loss_variants

# Half the prompts (even length) get 1.0 whatever the completion: their groups never have a spread. The others get
# the parity of the completion's length, 0 or 1, an accuracy-like reward: a group of 4 is all equal 1 time in 8.
MIXED_REWARD = """
def mixed(prompts, completions):
    return [1.0 if len(p) % 2 == 0 else float(len(c) % 2) for p, c in zip(prompts, completions)]
"""


def loop_groups_with_spread(values, G):
    """The paper's filter, generalized from accuracy: group p (rows g * P + p) is kept when at least two of its
    scored (non-NaN) rewards differ."""
    P = len(values) // G
    kept = []
    for p in range(P):
        scored = [values[g * P + p] for g in range(G) if not math.isnan(values[g * P + p])]
        kept.append(len(set(scored)) > 1)
    return kept


@pytest.mark.parametrize("G,P", [(2, 7), (4, 5), (8, 3)])
def test_groups_with_spread_matches_the_papers_definition(G, P):
    g = torch.Generator().manual_seed(G * 10 + P)
    for _ in range(20):
        values = torch.randint(0, 2, (G * P,), generator=g).double()  # accuracies: many all-0 / all-1 groups
        values[torch.rand(G * P, generator=g) < 0.2] = math.nan  # unscored completions
        assert dynamic_sampling.groups_with_spread(values, G).tolist() == loop_groups_with_spread(
            values.tolist(), G
        )
    dense = torch.randn(G * P, generator=g)
    assert dynamic_sampling.groups_with_spread(dense, G).all()


def test_groups_with_spread_by_hand():
    nan = math.nan
    # G = 3, P = 4, completion-major: prompt 0 got 0, 0, 0; prompt 1 got 1, 0, 1; prompt 2 got 1, 1, 1;
    # prompt 3 got 2, nan, nan (one scored completion: nothing to compare)
    values = torch.tensor([0.0, 1.0, 1.0, 2.0, 0.0, 0.0, 1.0, nan, 0.0, 1.0, 1.0, nan])
    assert dynamic_sampling.groups_with_spread(values, 3).tolist() == [False, True, False, False]
    assert dynamic_sampling.groups_with_spread(torch.full((6,), nan), 2).tolist() == [False] * 3


def test_picked_groups_stay_whole_and_completion_major():
    """Two rounds of P = 3 prompts, G = 2: groups r * P + p. The batch takes the first 3 kept groups in sampling
    order, each group's G rows together, completion-major (row g * 3 + j is completion g of the j-th group)."""
    G, P = 2, 3
    # row value = 100 * round + 10 * prompt + completion
    rounds = [torch.tensor([100 * r + 10 * p + g for g in range(G) for p in range(P)]) for r in range(2)]
    keep = torch.tensor([False, True, False, True, True, True])  # groups (0, 1), (1, 0), (1, 1), (1, 2)
    picked = dynamic_sampling.pick_groups(keep, P)
    assert picked.tolist() == [1, 3, 4]
    assert dynamic_sampling.take_groups(rounds, picked, G).tolist() == [10, 100, 110, 11, 101, 111]
    # too few kept: the first dropped ones fill the batch, still in sampling order
    assert dynamic_sampling.pick_groups(torch.tensor([False, False, True, False]), 3).tolist() == [0, 1, 2]
    # a 2-D tensor (rows x tokens) keeps its rows' contents
    tokens = [x[:, None].repeat(1, 4) for x in rounds]
    assert dynamic_sampling.take_groups(tokens, picked, G)[:, 0].tolist() == [10, 100, 110, 11, 101, 111]


def test_bad_filter_flags_are_one_sentence():
    args = grpo.Args(
        model_name_or_path="m", reward_funcs=["r.py:mixed"], filter_groups=True, max_num_gen_batches=-1
    )
    with pytest.raises(ValueError, match="--max_num_gen_batches must be at least 0"):
        grpo.fill_sizes(args, 1)


def test_rewards_are_named_as_trl_names_them(lab, tmp_path):
    """TRL logs a reward function under its __name__, whatever path named it: `module.alias` (TRL's dotted form) of
    `alias = mixed` logs rewards/mixed/mean, and --filter_groups_metric takes that name; another name is one line,
    before any model loads."""
    (tmp_path / "lab_rewards.py").write_text(MIXED_REWARD + "alias = mixed\n")
    flags = flags_for(lab, tmp_path, "named")
    flags[flags.index("--reward_funcs") + 1] = "lab_rewards.alias"
    grpo_py = str(ROOT / "grpo.py")
    run_script([grpo_py, *flags, "--max_steps", "1", "--filter_groups_metric", "mixed"], cwd=tmp_path)
    (metrics,) = read_metrics(tmp_path / "runs" / "named")
    assert "rewards/mixed/mean" in metrics and not any("lab_rewards" in key for key in metrics)
    flags[flags.index("--output_dir") + 1] = str(tmp_path / "refused")
    proc = run_script([grpo_py, *flags, "--filter_groups_metric", "alias"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and not (tmp_path / "refused").exists()
    assert proc.stderr.strip().splitlines()[-1] == (
        "grpo.py: error: --filter_groups_metric 'alias' is neither reward nor one of the rewards ['mixed']."
    )


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    out = make_rl_lab(world, tmp_path_factory.mktemp("dynamic_sampling_lab"), num_prompts=32)
    (out / "mixed.py").write_text(MIXED_REWARD)
    return out


def flags_for(lab, tmp_path, name):
    return [
        "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--reward_funcs", f"{lab / 'mixed.py'}:mixed", "--num_generations", "4", "--per_device_train_batch_size", "8",
        "--max_completion_length", "8", "--learning_rate", "1e-3", "--filter_groups", "--max_steps", "4",
        "--logging_dir", str(tmp_path / "runs"), "--run_name", name, "--output_dir", str(tmp_path / name),
        "--num_sample_generations", "0",
    ]  # fmt: skip


def test_dynamic_sampling_drops_groups_and_resumes_exactly(lab, tmp_path):
    """About half the groups have no spread: every step needs more than one round, and the batch it trains on has
    none left (frac_reward_zero_std 0, on the batch); episode counts every completion sampled. A run resumed at
    step 2 ends with the same weights as the uninterrupted one (the extra rounds replay the same noise)."""
    run_script(["grpo.py", *flags_for(lab, tmp_path, "full"), "--save_steps", "2"])
    lines = read_metrics(tmp_path / "runs" / "full")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    rounds = [m["filter_groups/num_gen_batches"] for m in lines]
    dropped = [m["filter_groups/dropped_frac"] * r * 2 for m, r in zip(lines, rounds)]  # groups, of 2 a round
    assert sum(rounds) > 4 and sum(dropped) > 0, (rounds, dropped)
    assert dropped == [round(d) for d in dropped]  # whole groups
    for metrics in lines:
        assert metrics["frac_reward_zero_std"] == 0.0
    assert [m["episode"] for m in lines] == [8 * sum(rounds[: i + 1]) for i in range(4)]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", resumed / "checkpoint-2")
    run_script(["grpo.py", *flags_for(lab, tmp_path, "resumed"), "--resume_from_checkpoint", "latest"])
    here, there = weights(tmp_path / "full"), weights(resumed)
    assert all(torch.equal(here[n], there[n]) for n in here)


@pytest.mark.parametrize("launch", ["ddp", pytest.param("zero2", marks=pytest.mark.slow)])
def test_two_processes_stop_sampling_together(lab, tmp_path, launch):
    """2 processes (DDP, or DeepSpeed ZeRO-2): each fills its own batch of whole groups; the rounds continue until
    both have theirs, so both log (and gather) the same number of rounds, and neither trains on a group without a
    spread."""
    flags = ["grpo.py", *flags_for(lab, tmp_path, launch), "--max_steps", "2"]
    if launch == "ddp":
        run_torchrun(flags, nproc=2)
    else:
        run_deepspeed(flags, tmp_path, 2)
    lines = read_metrics(tmp_path / "runs" / launch)
    assert [m["step"] for m in lines] == [1, 2]
    for metrics in lines:
        assert metrics["frac_reward_zero_std"] == 0.0 and metrics["filter_groups/num_gen_batches"] >= 2


# ------------------------------------------------------------ TRL 1.16's token and sequence masks, on its own code
class OneProcess:
    """The two collectives TRL's get_high_entropy_mask calls, on one process."""

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor

    def gather(self, tensor):
        return tensor


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_is_trls(quantile):
    from trl import GRPOTrainer

    g = torch.Generator().manual_seed(7)
    entropy, mask = torch.rand(6, 9, generator=g) * 3, torch.rand(6, 9, generator=g) > 0.3
    trainer = type("Trainer", (), {"accelerator": OneProcess()})()
    theirs = GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask.long(), 1 - quantile)
    ours = loss_variants.high_entropy_mask(entropy, mask, quantile, OneProcess())
    assert torch.equal(ours, theirs)
    assert ours.sum() >= 1 and not (ours & ~mask).any()


def test_off_policy_mask_is_trls():
    from trl import GRPOTrainer

    g = torch.Generator().manual_seed(8)
    logprobs, sampling = -torch.rand(8, 5, generator=g), -torch.rand(8, 5, generator=g)
    sampling[0, 1] = math.nan  # a token vLLM could not score
    mask, advantages = (torch.rand(8, 5, generator=g) > 0.2).float(), torch.randn(8, generator=g)
    kept = []
    for threshold in (0.0, 0.1, 0.3):
        theirs = GRPOTrainer.get_off_policy_mask(advantages[:, None], logprobs, sampling, mask, threshold)
        ours = loss_variants.off_policy_mask(advantages, logprobs, sampling, mask, threshold)
        assert torch.equal(ours, theirs)
        kept.append(int(ours.sum()))
    assert kept[0] < kept[-1] and kept[0] >= int((advantages >= 0).sum()), kept  # A >= 0 is always kept
