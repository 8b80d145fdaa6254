"""DAPO's dynamic sampling for grpo.py's --filter_groups (optional: imported only with that flag).

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", https://arxiv.org/abs/2503.14476,
section 3.2: a group whose completions all get the same reward has advantage 0 and no gradient, so it is dropped
and more prompts are sampled until the batch is full of groups with a spread. Rows are completion-major: round r's
group p holds rows g * P + p of that round.

    *rows, metrics = utils.dynamic_sampling.sample_groups(args, run, sample_round, drawn, combine_rewards)
"""

import math
import warnings

import torch

import utils.generation


def groups_with_spread(values: torch.Tensor, num_generations: int) -> torch.Tensor:
    """DAPO's filter: keep_p = max_g v_gp > min_g v_gp over group p's scored (non-NaN) values; for 0/1 accuracy,
    0 < |correct| < G. values [G * P] completion-major -> keep [P] bool."""
    grouped = values.view(num_generations, -1)
    scored = ~grouped.isnan()
    return grouped.masked_fill(~scored, -math.inf).amax(0) > grouped.masked_fill(~scored, math.inf).amin(0)


def pick_groups(keep: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """The groups a batch trains on, in sampling order: the first `num_prompts` with keep, then (too few
    kept) the first without. keep [N] bool over every group sampled (round r's group p is r * P + p)."""
    order = torch.cat([keep.nonzero()[:, 0], (~keep).nonzero()[:, 0]])
    return order[:num_prompts].sort().values


def take_groups(
    rows_per_round: list[torch.Tensor], picked: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """Rows [G * P, ...] of each round -> the picked groups' rows [G * len(picked), ...], completion-major."""
    grouped = torch.cat([rows.view(num_generations, -1, *rows.shape[1:]) for rows in rows_per_round], 1)
    return grouped[:, picked].flatten(0, 1)


def filter_values(args, run, rewards_per_func: torch.Tensor, combine_rewards) -> torch.Tensor:
    """Per completion [B]: the weighted reward (--filter_groups_metric reward) or one reward's values."""
    if args.filter_groups_metric != "reward":
        return rewards_per_func[:, run.reward_names.index(args.filter_groups_metric)]
    with warnings.catch_warnings():  # the batch's combine_rewards warns of unscored rows
        warnings.simplefilter("ignore")
        return combine_rewards(rewards_per_func, run.weights)


def sample_groups(args, run, sample_round, drawn: int, combine_rewards) -> tuple:
    """Rounds of P new prompts, `sample_round(drawn, sync_weights)` each (examples [P], queries, query_mask,
    then tensors of a row per completion, the rewards [B, F] last), until every process holds P groups whose
    --filter_groups_metric differs (all decide on every process's counts, so all stop together), at most
    --max_num_gen_batches -> the picked groups' rows as one round's, and the filter's metrics."""
    G, P, W = args.num_generations, args.local_prompts_per_generation, args.world_size
    limit = args.max_num_gen_batches or len(run.prompt_ids) // (P * W)
    rounds, keep = [], []
    while True:
        rounds.append(sample_round(drawn + len(rounds), not rounds))  # vLLM takes the weights once
        keep.append(groups_with_spread(filter_values(args, run, rounds[-1][-1], combine_rewards), G))
        kept = run.accelerator.gather(torch.cat(keep).sum()[None])
        if kept.min() >= P or len(rounds) >= limit:
            break
    keep = torch.cat(keep)
    picked = pick_groups(keep, P)
    if not keep[picked].all():
        warnings.warn(
            f"--filter_groups: {len(rounds)} generation rounds gave fewer groups with a spread than a batch "
            "needs; groups of equal rewards (advantage 0) fill it; raise --max_num_gen_batches.",
            RuntimeWarning,
            stacklevel=2,
        )
    every_example = [i for round_ in rounds for i in round_[0]]
    examples = [every_example[i] for i in picked.tolist()]
    queries, query_mask = utils.generation.left_pad(
        [run.prompt_ids[i] for i in examples], run.pad_id, run.accelerator.device
    )
    rows = [take_groups([round_[k] for round_ in rounds], picked, G) for k in range(3, len(rounds[0]))]
    dropped = run.accelerator.reduce((~keep).sum() - (~keep[picked]).sum(), "sum")
    metrics = {
        "filter_groups/num_gen_batches": len(rounds),
        "filter_groups/dropped_frac": dropped.item() / (len(rounds) * P * W),
    }
    return examples, queries, query_mask, *rows, metrics
