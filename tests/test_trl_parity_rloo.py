"""rloo.py under TRL 1.16's flags against TRL 1.16's RLOOTrainer, and rloo.py's reading of TRL 1.16's command line.

TRL's trainer is built on the tiny world (CPU, fp32) with its generation replaced by fixed completions and its
reward functions by fixed rewards (None included); both sides get the same weights (the policy perturbed, so it
is not its reference) and the same rows. TRL's `_generate_and_score_completions` computes its old log-probs, KL
penalty and advantages, `_compute_loss` its loss; ours are computed by rloo.py's functions from a TRL 1.16
command line as rloo.py reads it. TRL's rows are prompt-major (row p * K + c), ours completion-major (c * P + p).
"""

import dataclasses
import math
import re

import datasets
import pytest
import torch

import rloo
import utils.generation
import utils.loading
import utils.logprobs
import utils.stats
from utils import run

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":
    pytest.skip(
        f"these tests read TRL 1.16.0's RLOOTrainer; found trl {trl.__version__}", allow_module_level=True
    )

K, P, R = 2, 4, 6  # completions per prompt, prompts, completion length limit
B = K * P
T = 0.8  # not TRL's default temperature, so logprobs taken at the wrong one show
LOSS_ATOL, GRAD_RTOL, ADV_ATOL = 2e-6, 2e-4, 1e-5
OURS_OF_THEIRS = [
    p * K + c for c in range(K) for p in range(P)
]  # our row i holds TRL's row OURS_OF_THEIRS[i]
# TRL's rows: rewards of two functions (None: no reward); row 5 has none (unscorable), row 3's sibling 2 is the
# only scorable one of prompt 1 under the first function alone.
REWARDS = [
    [1.0, 0.2, None, 0.7, -0.5, None, 2.0, 0.1],
    [0.5, None, 0.3, None, 1.5, None, -1.0, 0.4],
]


def fixed_reward(name: str, values: list):
    def reward(completions, **kwargs):
        assert len(completions) == len(values)
        return list(values)

    reward.__name__ = name
    return reward


@pytest.fixture(scope="module")
def tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "policy")


@pytest.fixture(scope="module")
def prompts(world, tokenizer) -> list[str]:
    """P prompts of the same token length (no left padding: the math, not the position ids, is compared)."""
    rows = datasets.load_from_disk(str(world / "dataset"))["sft"]["prompt"][:40]
    length = len(tokenizer(rows[0])["input_ids"])
    same = [r for r in rows if len(tokenizer(r)["input_ids"]) == length]
    assert len(same) >= P
    return same[:P]


@pytest.fixture(scope="module")
def completions(tokenizer) -> list[list[int]]:
    """TRL's rows: seeded tokens, some ending with EOS before R tokens, the others cut at R (truncated)."""
    gen = torch.Generator().manual_seed(0)
    specials = set(tokenizer.all_special_ids)
    vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in specials])
    rows = []
    for length in [3, R, 2, R, 5, R, R, 4]:
        ids = vocab[torch.randint(len(vocab), (length,), generator=gen)].tolist()
        rows.append(ids[:-1] + [tokenizer.eos_token_id] if length < R else ids)
    return rows


def perturbed_weights(world, scale: float, seed: int, base=None) -> dict:
    from transformers import AutoModelForCausalLM

    base = base or AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32).state_dict()
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * v.std().nan_to_num(1.0) * torch.randn(v.shape, generator=gen) for k, v in base.items()
    }


@pytest.fixture(scope="module")
def weights(world) -> tuple[dict, dict]:
    """(A, B): the policy perturbed (A, the weights that sampled) and A moved a little more (B, after a step)."""
    a = perturbed_weights(world, 0.3, 0)
    return a, perturbed_weights(world, 0.15, 1, base=a)


def causal_lm(world, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    utils.loading.disable_dropout(model)
    return model.train()


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def parsed(flags: str) -> rloo.Args:
    """A TRL 1.16 command line as rloo.py reads it."""
    args = run.parse_args(rloo.Args, ["--model_name_or_path", "m", *flags.split()])
    return rloo.fill_sizes(args, world_size=1)


CASES = {
    "beta0": "--beta 0 --reward_funcs a.f",
    "beta_normalized": "--beta 0.1 --normalize_advantages --reward_funcs a.f",
    "two_iterations": "--beta 0.1 --num_iterations 2 --reward_funcs a.f",
    "everything": "--beta 0.05 --num_iterations 2 --normalize_advantages --epsilon 0.1 --epsilon_high 0.28 "
    "--mask_truncated_completions --reward_funcs a.f b.g --reward_weights 1.0 0.5 --reward_clip_range -1 1.6",
}


def trl_side(world, tokenizer, prompts, completions, weights, args: rloo.Args):
    """TRL's batch (after its scoring and advantages), loss and gradients, under the same settings as `args`."""
    funcs = [fixed_reward(f"f{i}", REWARDS[i]) for i in range(len(args.reward_funcs))]
    config = trl.RLOOConfig(
        output_dir="unused", use_cpu=True, report_to=[], bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=B, num_generations=K, max_completion_length=R, temperature=T,
        disable_dropout=True, beta=args.beta, num_iterations=args.num_iterations, epsilon=args.epsilon,
        epsilon_high=args.epsilon_high, normalize_advantages=args.normalize_advantages,
        mask_truncated_completions=args.mask_truncated_completions, reward_weights=args.reward_weights,
        reward_clip_range=args.reward_clip_range if len(args.reward_clip_range or ()) == 2 else None,
    )  # fmt: skip
    trainer = trl.RLOOTrainer(
        model=causal_lm(world, weights[0]), reward_funcs=funcs, args=config, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
    )  # fmt: skip
    trainer._generate_single_turn = lambda prompt_ids, images, fields: [list(c) for c in completions]
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(K)])
    if args.num_iterations > 1:  # a later iteration: the policy has moved since it sampled
        trainer.model.load_state_dict(weights[1])
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return batch, loss.detach(), grads(trainer.model)


def our_side(world, tokenizer, batch, completions, weights, args: rloo.Args):
    """rloo.py's phases 5-7 on the same rows: old and reference logprobs, rewards, advantages, loss, gradients."""
    queries, query_mask = batch["prompt_ids"][::K], batch["prompt_mask"][::K]
    rows = [completions[i] for i in OURS_OF_THEIRS]
    lengths = torch.tensor([len(r) for r in rows])
    responses = torch.tensor([r + [tokenizer.pad_token_id] * (R - len(r)) for r in rows])
    response_mask = utils.generation.lengths_to_mask(lengths, R)
    query_responses, mask = utils.generation.query_response_rows(
        queries, query_mask, responses, response_mask, torch.arange(B)
    )
    Q = queries.size(1)
    policy, ref = causal_lm(world, weights[0]), causal_lm(world)
    old = utils.logprobs.batched_response_logprobs(policy, query_responses, mask, Q, T, B)
    ref_logprobs = utils.logprobs.batched_response_logprobs(ref, query_responses, mask, Q, T, B)
    rewards = torch.tensor(
        [[math.nan if v is None else v for v in f] for f in REWARDS[: len(args.reward_funcs)]]
    )
    weights_ = torch.tensor(args.reward_weights or [1.0] * len(args.reward_funcs))
    scores = rloo.combine_rewards(rewards.T[OURS_OF_THEIRS], weights_)
    ids = torch.tensor([tokenizer.eos_token_id, tokenizer.pad_token_id])
    loss_mask = response_mask & rloo.finished(responses, lengths, ids)[:, None]
    loss_mask = loss_mask if args.mask_truncated_completions else response_mask
    kl = (old - ref_logprobs) * loss_mask
    advantages, _, _ = rloo.batch_advantages(args, scores, kl, loss_mask, lengths)
    if args.num_iterations > 1:
        policy.load_state_dict(weights[1])
    new = utils.logprobs.response_logprobs(policy, query_responses, mask, Q, T)
    loss, ratio, _, _ = rloo.policy_loss(new, old, advantages, loss_mask, args.cliprange, args.epsilon_high)
    loss.backward()
    return (
        dict(old_logps=(old * loss_mask).sum(1), advantages=advantages, ratio=ratio),
        loss.detach(),
        grads(policy),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_advantages_loss_and_gradients_are_trls(world, tokenizer, prompts, completions, weights, case):
    """Same old log-probs, advantages (KL in the reward, leave-one-out over the scorable siblings, TRL's
    normalization, unscorable ones 0), loss (sequence-level ratio, asymmetric clip) and every gradient."""
    args = parsed(CASES[case])
    assert args.dialect == "1.16"
    batch, theirs, their_grads = trl_side(world, tokenizer, prompts, completions, weights, args)
    ours, loss, our_grads = our_side(world, tokenizer, batch, completions, weights, args)
    for key in ("old_logps", "advantages"):
        torch.testing.assert_close(ours[key], batch[key][OURS_OF_THEIRS], rtol=0, atol=ADV_ATOL, msg=key)
    assert batch["advantages"].abs().max() > 0.1
    if args.num_iterations > 1:  # the ratio is not 1 and the clip is reached on some rows, not all
        high = args.epsilon_high or args.cliprange
        clipped = (ours["ratio"] < 1 - args.cliprange) | (ours["ratio"] > 1 + high)
        assert clipped.any() and not clipped.all(), ours["ratio"]
    torch.testing.assert_close(loss, theirs, rtol=0, atol=LOSS_ATOL)
    assert set(our_grads) == set(their_grads)
    for name, grad in their_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, f"{name}: no gradient at all"
        torch.testing.assert_close(our_grads[name], grad, rtol=0, atol=GRAD_RTOL * scale, msg=name)


def test_unscorable_completion_and_lone_sibling_get_advantage_zero(
    world, tokenizer, prompts, completions, weights
):
    """TRL's handling of None, from the rewards alone: row 5 (no reward at all) and a prompt with one scorable
    completion give advantage 0; the others' baselines leave the NaN out."""
    args = parsed("--beta 0 --reward_funcs a.f b.g")
    rewards = torch.tensor([[1.0, 2.0], [math.nan, math.nan], [4.0, math.nan], [5.0, 1.0]])
    scores = rloo.combine_rewards(rewards, torch.ones(2))
    assert scores.tolist()[::2] == [3.0, 4.0] and scores[1].isnan() and scores[3] == 6.0
    args.rloo_k = 2  # completion-major: rows (0, 2) are prompt 0, rows (1, 3) prompt 1
    zero = torch.zeros(4, 1)
    advantages, _, _ = rloo.batch_advantages(args, scores, zero, zero.bool(), torch.ones(4, dtype=torch.long))
    assert advantages.tolist() == [-1.0, 0.0, 1.0, 0.0]  # row 1 unscorable; row 3 has no scorable sibling
    three = torch.tensor([1.0, 2.0, math.nan, 4.0, 0.0, 0.0])  # k = 3: prompt 0 = rows 0, 2, 4
    args.rloo_k = 3
    zero = torch.zeros(6, 1)
    advantages, _, _ = rloo.batch_advantages(args, three, zero, zero.bool(), torch.ones(6, dtype=torch.long))
    assert advantages.tolist() == pytest.approx([1.0, 0.0, 0.0, 3.0, -1.0, -3.0])


def test_0_19_whitening_is_not_trls_normalization():
    """--normalize_advantage (TRL 0.19, kept as it was) and --normalize_advantages (TRL 1.16) differ: 1e-8 under
    the root against 1e-4 added to the std; visible on advantages of a small spread."""
    advantages = torch.tensor([1e-3, -1e-3, 2e-3, -2e-3])
    ones = torch.ones(4, dtype=torch.bool)
    ours_0_19 = utils.stats.masked_whiten(advantages, ones)
    trl_1_16 = rloo.standardize_advantages(advantages, ones)
    expected = (advantages - advantages.mean()) / (advantages.std() + 1e-4)
    torch.testing.assert_close(trl_1_16, expected)
    assert (ours_0_19 - trl_1_16).abs().max() > 0.05


# ----------------------------------------------------------------------------------------------------------------
# TRL 1.16's command line: defaults, each flag, contradictions
# ----------------------------------------------------------------------------------------------------------------
# Flags both have whose default here differs from TRL 1.16's, even under TRL 1.16's flags, and why.
DELIBERATE = {
    "bf16": "float32 is the deterministic reference (and the CPU tests' precision); pass --bf16",
    "gradient_checkpointing": "off is faster where memory allows (CPU, the tiny world); pass it on big models",
    "eval_strategy": "steps: sample tables of held-out prompts unless told not to (TRL's eval loop is not here)",
    "output_dir": "models/rloo, beside the other scripts' models/<name>, instead of trainer_output",
    "dataset_name": "trl-lib/tldr, the TL;DR prompts this script is about; TRL requires the flag",
    "dataset_test_split": "None: 'test' would fail on datasets without it; TRL reads it only when evaluating",
    "disable_dropout": "True: the training forward's logprobs equal the rollout's; --disable_dropout False for TRL's",
}
# TRL's values that rloo.py keeps under another name: TRL 1.16 name -> ours, after the sizes are filled in
DERIVED = {
    "steps_per_generation": lambda a: a.gradient_accumulation_steps * a.num_mini_batches,
    "generation_batch_size": lambda a: a.batch_size,
}


def trl_defaults() -> dict:
    """{flag: TRL 1.16's default} of RLOOConfig (after its __post_init__, on a CPU) and of its rloo script."""
    from trl.scripts.rloo import RLOOScriptArguments

    config, script = trl.RLOOConfig(use_cpu=True), RLOOScriptArguments()
    values = {f.name: getattr(script, f.name) for f in dataclasses.fields(script)}
    values |= {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {name: getattr(value, "value", value) for name, value in values.items()}  # enums as their strings


def test_a_trl_1_16_command_line_gets_trls_defaults():
    """Every flag rloo.py shares with TRL 1.16's RLOOConfig and rloo script gets TRL's default under a TRL 1.16
    command line, but the listed deliberate differences (which must still differ)."""
    args = run.parse_args(rloo.Args, "--model_name_or_path m --reward_funcs r.py:f".split())
    rloo.fill_sizes(args, world_size=1, num_prompts=1000)
    theirs = trl_defaults()
    shared = {f.name for f in dataclasses.fields(rloo.Args)} & theirs.keys() - {
        "model_name_or_path",
        "reward_funcs",
    }
    assert {"learning_rate", "max_completion_length", "num_iterations", "temperature", "beta", "seed",
            "max_grad_norm", "num_train_epochs", "max_steps", "save_steps"} <= shared  # fmt: skip
    for name in sorted(shared - DELIBERATE.keys()):
        ours = DERIVED[name](args) if name in DERIVED else getattr(args, name)
        assert ours == theirs[name], f"--{name}: ours {ours!r}, TRL 1.16 {theirs[name]!r}"
    for name in DELIBERATE:
        assert getattr(args, name) != theirs[name], f"--{name} is TRL's now: drop it from DELIBERATE"
    assert args.stop_token == "eos"  # TRL 1.16 always stops at EOS
    assert args.num_total_batches == 3 * 1000 // 4  # 3 epochs of 250 updates of 4 prompts x 2 completions
    legacy = run.parse_args(rloo.Args, "--model_name_or_path m --reward_fn r.py:f".split())
    rloo.fill_sizes(legacy, world_size=1, num_prompts=1000)
    assert legacy.dialect == "0.19" and legacy.total_episodes == 2000 and legacy.num_total_batches == 250
    assert (legacy.response_length, legacy.num_ppo_epochs, legacy.stop_token) == (53, 4, None)
    assert (legacy.learning_rate, legacy.temperature, legacy.seed, legacy.max_grad_norm) == (
        3e-6,
        0.7,
        1,
        0.0,
    )


@pytest.mark.parametrize(
    "flags, field, value",
    [
        ("--max_completion_length 64", "response_length", 64),
        ("--beta 0.2", "kl_coef", 0.2),
        ("--num_iterations 2", "num_ppo_epochs", 2),
        ("--epsilon 0.1", "cliprange", 0.1),
        ("--epsilon_high 0.28", "epsilon_high", 0.28),
        ("--num_generations 4", "rloo_k", 4),
        ("--normalize_advantages", "normalize_advantages", True),
        ("--normalize_advantages True", "normalize_advantages", True),
        ("--mask_truncated_completions", "mask_truncated_completions", True),
        ("--reward_weights 1 0.5 --reward_funcs a.f b.g", "reward_weights", [1.0, 0.5]),
        ("--reward_funcs a.f b.g", "reward_funcs", ["a.f", "b.g"]),
        ("--reward_model_name_or_path rm --reward_funcs a.f", "reward_model_path", "rm"),
        ("--reward_clip_range -1 1", "reward_clip_range", (-1.0, 1.0)),
        ("--num_train_epochs 2", "num_total_batches", 2 * 1000 // 4),
        ("--max_steps 7", "num_total_batches", 7),
        ("--max_steps 7 --num_iterations 2", "num_total_batches", 4),  # 7 optimizer steps: 4 updates of 2
        ("--steps_per_generation 4 --gradient_accumulation_steps 2", "num_mini_batches", 2),
        ("--generation_batch_size 32", "num_mini_batches", 4),
        ("--learning_rate 1e-5 --beta 0.1", "learning_rate", 1e-5),
    ],
)
def test_each_trl_1_16_flag_parses(flags, field, value):
    argv = ["--model_name_or_path", "m", *flags.split()]
    if "--reward_funcs" not in flags and "--reward_model_name_or_path" not in flags:
        argv += ["--reward_funcs", "a.f"]
    args = rloo.fill_sizes(run.parse_args(rloo.Args, argv), world_size=1, num_prompts=1000)
    assert args.dialect == "1.16" and getattr(args, field) == value


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            "--kl_coef 0.1 --beta 0.2",
            "--kl_coef 0.1 and --beta 0.2 are one setting under TRL 0.x's and TRL 1.x's",
        ),
        (
            "--response_length 53 --max_completion_length 512",
            "--response_length 53 and --max_completion_length 512",
        ),
        (
            "--total_episodes 1000 --max_steps 10",
            "--total_episodes (TRL 0.x) and --max_steps / --num_train_epochs",
        ),
        ("--total_episodes 1000 --num_train_epochs 1", "both set the length of the run; pass one."),
        (
            "--steps_per_generation 2 --generation_batch_size 16",
            "--generation_batch_size, --steps_per_generation",
        ),
        (
            "--num_mini_batches 2 --steps_per_generation 3",
            "--steps_per_generation 3 with --gradient_accumulation",
        ),
        ("--normalize_advantage --normalize_advantages", "normalize the advantages two ways"),
        ("--reward_fn a.py:f --reward_funcs b.g", "put them all in --reward_funcs."),
        ("--reward_funcs a.f b.g --reward_weights 1", "--reward_weights has 1 values for 3 rewards"),
        (
            "--reward_clip_range -1 1 --normalize_reward",
            "--reward_clip_range with two values clamps the reward",
        ),
        ("--num_generations 1 --beta 0.1", "--num_generations must be at least 2"),
        ("--max_steps 0", "--max_steps must be positive, or -1"),
    ],
)
def test_a_contradictory_mix_is_refused_in_one_sentence(flags, message):
    argv = ["--model_name_or_path", "m", "--reward_model_path", "r", *flags.split()]
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        rloo.fill_sizes(run.parse_args(rloo.Args, argv), world_size=1)
    assert str(error.value).count(". ") == 0 and str(error.value).endswith(".")
