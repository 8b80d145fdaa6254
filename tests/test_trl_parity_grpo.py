"""grpo.py against TRL 1.16's GRPOTrainer, running TRL's own code on the tiny world's policy (CPU, float32).

- the loss and every parameter's gradient of one micro-batch: TRL's `_compute_loss` and grpo.py's functions on the
  same weights and the same batch, for every loss type both have, beta 0 and > 0 (with TRL's bias-corrected KL,
  and without it), on- and off-policy, with and without vLLM importance weights (both sides get the same
  advantages, so scale_rewards is compared where advantages are made, below, and in test_update_parity_grpo.py);
- the advantages and reward metrics TRL's `_generate_and_score_completions` makes from the same rewards (some
  None), the old logprobs it recomputes (and when), and its vLLM importance weights and sampling metrics for each
  `vllm_importance_sampling_mode` (its generation stubbed with fixed completions);
- left-padded prompts: the same logprobs;
- vespo: loss_variants.vespo_weights against TRL's own `get_gamma_weights` on random tensors (clamps, vLLM weights of 0),
  and the loss and gradients with vLLM's token weights folded into the sequence weight (TRL's constraints on the
  flags: below);
- the differences we keep on purpose, asserted: the DAPO normalizer when one generation feeds several optimizer
  steps, frac_reward_zero_std under batch scaling.

TRL's luspo is compared step by step in test_update_parity_grpo.py."""

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM

import grpo
import utils.generation
import utils.loading
import utils.logprobs
import utils.run
import utils.vllm
from utils import loss_variants

assert trl.__version__ == "1.16.0", trl.__version__

G, P, Q, R, T = 4, 2, 6, 7, 0.7  # group, prompts, prompt and completion lengths, temperature
B = G * P
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo"]  # TRL 1.16's that grpo.py has too


def our_args(**flags) -> grpo.Args:
    args = grpo.Args(model_name_or_path="m", reward_funcs=["f.py:f"], num_generations=G, **flags)
    return grpo.fill_sizes(args, world_size=1)


_trainers = {}


def trl_trainer(world, tmp_path_factory, reward_funcs=None, **config):
    """A GRPOTrainer on the tiny world's policy (cached per configuration), in train mode, one process."""
    key = tuple(sorted(config.items())) if reward_funcs is None else None
    if key in _trainers:
        return _trainers[key]
    base = dict(
        output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to=[],
        per_device_train_batch_size=B, num_generations=G, max_completion_length=R, temperature=T,
        disable_dropout=True, gradient_checkpointing=False, logging_steps=1,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=str(world / "policy"),
        reward_funcs=reward_funcs or (lambda completions, **kwargs: [0.0] * len(completions)),
        args=trl.GRPOConfig(**{**base, **config}),
        train_dataset=Dataset.from_dict({"prompt": ["a"] * B}),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    if key is not None:
        _trainers[key] = trainer
    return trainer


def batch(seed=0, left_pad=0):
    """Prompt ids [B, Q] (the first `left_pad` positions of row 0 padding), completion ids [B, R] right-padded to
    varied lengths (one completion empty of loss tokens is not needed: every row keeps at least 1 token)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, 600, (B, Q), generator=g)
    prompt_mask = torch.ones(B, Q, dtype=torch.long)
    prompt_mask[0, :left_pad] = 0
    prompt_ids[0, :left_pad] = 1
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    completion_mask = utils.generation.lengths_to_mask(lengths, R).long()
    completion_ids = torch.randint(2, 600, (B, R), generator=g).masked_fill(completion_mask == 0, 1)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def our_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    query_responses = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    return utils.logprobs.response_logprobs(
        model, query_responses, attention_mask, prompt_ids.size(1), T, True
    )[:2]


@pytest.fixture(scope="module")
def ours(world):
    model = AutoModelForCausalLM.from_pretrained(world / "policy")
    utils.loading.disable_dropout(model)
    return model


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta,bias_correction", [(0.0, True), (0.1, True), (0.1, False)])
@pytest.mark.parametrize("off_policy", [False, True])
def test_loss_and_gradients_equal_trls(world, tmp_path_factory, ours, loss_type, beta, bias_correction,
                                       off_policy):  # fmt: skip
    """One micro-batch (ga = steps_per_generation = 1): TRL's `_compute_loss` and grpo.py's token losses and
    aggregation give the same loss and the same gradient of every parameter, and the same kl and entropy
    metrics. Off-policy the old and reference logprobs are the current ones plus noise (some ratios clipped);
    on-policy TRL has no old logprobs and grpo.py uses the detached current ones (ratio 1, gradient not 0)."""
    flags = dict(loss_type=loss_type, beta=beta, use_bias_correction_kl=bias_correction, epsilon_high=0.28,
                 scale_rewards="group")  # fmt: skip
    if loss_type == "cispo":
        flags["epsilon_high"] = 1.1  # CISPO caps the ratio's weight at epsilon_high
    trainer = trl_trainer(world, tmp_path_factory, **flags)
    args = our_args(**flags)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(seed=1)
    g = torch.Generator().manual_seed(2)
    rewards = torch.randint(0, 3, (B,), generator=g).float()
    advantages = grpo.group_advantages(rewards, G, "group")
    with torch.no_grad():
        current = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
    old = current + 0.3 * torch.randn(B, R, generator=g) if off_policy else None
    ref = current + 0.3 * torch.randn(B, R, generator=g)

    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages,
                  num_items_in_batch=completion_mask.sum(), ref_per_token_logps=ref)  # fmt: skip
    if off_policy:
        inputs["old_per_token_logps"] = old
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()

    ours.zero_grad()
    logprobs, entropy = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)
    old_logprobs = logprobs.detach() if old is None else old
    mask = completion_mask.bool()
    per_token_loss = grpo.policy_token_loss(args, logprobs, old_logprobs, advantages, mask=mask)
    kl = grpo.kl_penalty(logprobs, old_logprobs, ref, bias_correction)
    if beta > 0:
        per_token_loss = per_token_loss + beta * kl
    loss = grpo.aggregate_loss(per_token_loss, mask, loss_type, R, num_items=mask.sum().item())
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    theirs, mine = grads(trainer.model), grads(ours)
    assert set(theirs) == set(mine) and len(mine) > 10
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    assert trainer._metrics["train"]["entropy"][-1] == pytest.approx(
        grpo.token_mean(entropy, mask).item(), 1e-5
    )
    if beta > 0:
        assert trainer._metrics["train"]["kl"][-1] == pytest.approx(grpo.token_mean(kl, mask).item(), 1e-5)
    if loss_type == "vespo":
        phi = loss_variants.vespo_weights(
            logprobs - old_logprobs, advantages, mask, *loss_variants.vespo_flags(args)
        )
        assert trainer._metrics["train"]["vespo/phi_seq_mean"][-1] == pytest.approx(phi.mean().item(), 1e-5)
        assert off_policy == (phi.std() > 0.1)  # off-policy the weights vary; on-policy phi(1) = 1


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
def test_loss_with_vllm_importance_weights_equals_trls(world, tmp_path_factory, ours, mode):
    """The vLLM importance weights multiply the policy loss only (not the KL), in TRL and in grpo.py alike."""
    trainer = trl_trainer(world, tmp_path_factory, beta=0.1, loss_type="dapo")
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    args = our_args(beta=0.1, loss_type="dapo")
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(seed=3)
    g = torch.Generator().manual_seed(4)
    advantages = torch.randn(B, generator=g)
    with torch.no_grad():
        old = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
    sampling = old + 0.4 * torch.randn(B, R, generator=g)
    ref = old + 0.3 * torch.randn(B, R, generator=g)
    weights = utils.vllm.importance_weights(old, sampling, completion_mask, mode, 0.5, 2.0)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, num_items_in_batch=completion_mask.sum(),
                  ref_per_token_logps=ref, old_per_token_logps=old, importance_sampling_ratio=weights)  # fmt: skip
    try:
        trainer.model.zero_grad()
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        trl_loss.backward()
    finally:
        trainer.use_vllm = False
    ours.zero_grad()
    logprobs, _ = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)
    per_token_loss = grpo.policy_token_loss(args, logprobs, old, advantages, weights)
    per_token_loss = per_token_loss + 0.1 * grpo.kl_penalty(logprobs, old, ref, True)
    loss = grpo.aggregate_loss(
        per_token_loss, completion_mask.bool(), "dapo", R, completion_mask.sum().item()
    )
    loss.backward()
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    theirs = grads(trainer.model)
    for name, grad in grads(ours).items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-6, msg=name)


def test_vespo_weights_equal_trls_gamma_weights():
    """loss_variants.vespo_weights and TRL's own GRPOTrainer.get_gamma_weights on random log-ratios (some beyond the
    clamps of log r and log w), advantages of both signs and 0, vLLM token weights (some 0: token_mask's
    out-of-bounds) or none, TRL's default k, lambda and others."""
    g = torch.Generator().manual_seed(11)
    rows, length = 64, 9
    log_ratio = 0.4 * torch.randn(rows, length, generator=g)
    log_ratio[0, 0], log_ratio[1, 0], log_ratio[2, :] = 30.0, -30.0, 3.0  # a token clamp; log w over 20
    advantages = torch.randn(rows, generator=g)
    advantages[:4] = 0.0
    mask = utils.generation.lengths_to_mask(
        torch.randint(0, length + 1, (rows,), generator=g), length
    ).float()
    weights = (0.3 * torch.randn(rows, length, generator=g)).exp() * mask + (1 - mask)  # 1 on padding (TRL's)
    weights[5, 0] = 0.0
    for flags in [(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 4.0, 6.0)]:
        for iw in (None, weights):
            mine = loss_variants.vespo_weights(log_ratio, advantages, mask, *flags, iw)
            theirs = trl.GRPOTrainer.get_gamma_weights(advantages[:, None], log_ratio, mask, iw, *flags)
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
            assert mine.shape == (rows, 1) and mine.std() > 0.1 and not mine.requires_grad
    assert (
        loss_variants.vespo_weights(
            torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3), 2, 3, 3, 2
        )
        .eq(1)
        .all()
    )


@pytest.mark.parametrize("mode", ["token_mask", "token_truncate"])
def test_vespo_loss_with_vllm_importance_weights_equals_trls(world, tmp_path_factory, ours, mode):
    """vespo folds vLLM's token weights into its sequence weight w and multiplies the loss by nothing else, in
    TRL and in grpo.py alike (main() passes them so: test_update_parity_grpo.py has no vLLM)."""
    flags = dict(beta=0.1, loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    trainer = trl_trainer(world, tmp_path_factory, **flags)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    args = our_args(**flags)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(seed=12)
    g = torch.Generator().manual_seed(13)
    advantages = torch.randn(B, generator=g)
    with torch.no_grad():
        current = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
    old = current + 0.2 * torch.randn(B, R, generator=g)
    sampling = old + 0.4 * torch.randn(B, R, generator=g)
    ref = old + 0.3 * torch.randn(B, R, generator=g)
    weights = utils.vllm.importance_weights(old, sampling, completion_mask, mode, 0.5, 2.0)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, num_items_in_batch=completion_mask.sum(),
                  ref_per_token_logps=ref, old_per_token_logps=old, importance_sampling_ratio=weights)  # fmt: skip
    try:
        trainer.model.zero_grad()
        trainer._metrics["train"].clear()
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        trl_loss.backward()
    finally:
        trainer.use_vllm = False
    ours.zero_grad()
    logprobs, _ = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)
    mask = completion_mask.bool()
    per_token_loss = grpo.policy_token_loss(args, logprobs, old, advantages, None, mask, weights)
    per_token_loss = per_token_loss + 0.1 * grpo.kl_penalty(logprobs, old, ref, True)
    loss = grpo.aggregate_loss(per_token_loss, mask, "vespo", R, mask.sum().item())
    loss.backward()
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    theirs = grads(trainer.model)
    for name, grad in grads(ours).items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    phi = loss_variants.vespo_weights(
        logprobs - old, advantages, mask, *loss_variants.vespo_flags(args), weights
    )
    assert trainer._metrics["train"]["vespo/phi_seq_mean"][-1] == pytest.approx(phi.mean().item(), 1e-5)
    without = loss_variants.vespo_weights(logprobs - old, advantages, mask, *loss_variants.vespo_flags(args))
    assert (phi - without).abs().max() > 0.05  # the weights mattered


def test_vespo_flags_are_checked_as_trl_checks_them():
    """TRL 1.16 refuses vespo with vLLM's sequence-level correction and warns at importance_sampling_level
    sequence (where vespo's w stays the sum of the token log-ratios); a phi needs k >= 0 and lambda > 0."""
    with pytest.raises(ValueError, match="token_truncate or token_mask"):
        our_args(loss_type="vespo", use_vllm=True)
    our_args(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_mask")
    our_args(loss_type="vespo", use_vllm=True, vllm_importance_sampling_correction=False)
    with pytest.warns(UserWarning, match="only the KL's bias correction"):
        our_args(loss_type="vespo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="vespo_lambda"):
        our_args(loss_type="vespo", vespo_lambda_neg=0.0)


def test_dapo_normalizer_differs_when_a_generation_feeds_several_steps(world, tmp_path_factory, ours):
    """On purpose: with steps_per_generation 4 and gradient_accumulation_steps 2, TRL's dapo divides each
    micro-batch by the generation's token count * 2 / 4 (the mean count of an optimizer step), grpo.py by the
    exact count of the step the micro-batch is in (DAPO's token mean of the step). Equal when the counts are."""
    trainer = trl_trainer(world, tmp_path_factory, loss_type="dapo", gradient_accumulation_steps=2,
                          steps_per_generation=4)  # fmt: skip
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(seed=5)
    advantages = torch.randn(B, generator=torch.Generator().manual_seed(6))
    # m tokens in this micro-batch, 2 m in its step (with one like it), m in the generation's other step
    generation_tokens = 3 * completion_mask.sum()
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, num_items_in_batch=generation_tokens)  # fmt: skip
    with torch.no_grad():
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        logprobs, _ = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)
    args = our_args(loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4)
    per_token_loss = grpo.policy_token_loss(args, logprobs, logprobs, advantages)
    mask = completion_mask.bool()
    step_tokens = 2 * mask.sum().item()  # this micro-batch and one like it make the step
    # grpo.py's micro-batch loss before accelerate's division by ga = 2, so divided here to compare
    ours_loss = grpo.aggregate_loss(per_token_loss, mask, "dapo", R, num_items=step_tokens / 2) / 2
    same_count = (
        grpo.aggregate_loss(per_token_loss, mask, "dapo", R, num_items=generation_tokens.item() / 4) / 2
    )
    torch.testing.assert_close(same_count, trl_loss, rtol=1e-5, atol=1e-7)
    # TRL divides by the mean step's 1.5 m tokens, grpo.py by this step's 2 m
    assert ours_loss.item() == pytest.approx(0.75 * trl_loss.item(), rel=1e-5)


def test_left_padded_prompts_give_trls_logprobs(world, tmp_path_factory, ours):
    """Under left padding TRL's forward and grpo.py's (positions from the attention mask) agree, and both give
    the logprobs of the same prompt unpadded (what sampling computed)."""
    trainer = trl_trainer(world, tmp_path_factory, loss_type="dapo")
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(seed=7, left_pad=2)
    with torch.no_grad():
        mine = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
        theirs, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            R,
        )  # fmt: skip
        alone = our_logprobs(
            ours, prompt_ids[:1, 2:], prompt_mask[:1, 2:], completion_ids[:1], completion_mask[:1]
        )
    real = completion_mask.bool()
    torch.testing.assert_close(mine[real], theirs[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[0][real[0]], alone[0][0][real[0]], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ advantages, rewards, old logprobs
REWARDS_F1 = [
    1.0,
    None,
    2.0,
    0.0,
    3.0,
    3.0,
    3.0,
    3.0,
]  # TRL's order: prompt 0's 4 completions, then prompt 1's
REWARDS_F2 = [0.5, None, None, 1.0, 2.0, 2.0, 2.0, 2.0]  # row 1: no reward scores it; prompt 1: all equal


def f1(completions, **kwargs):
    return list(REWARDS_F1)


def f2(completions, **kwargs):
    return list(REWARDS_F2)


def to_ours(values):
    """TRL's prompt-major rows (p * G + g) to grpo.py's completion-major ones (g * P + p)."""
    values = torch.as_tensor(values)
    return values.view(P, G, *values.shape[1:]).transpose(0, 1).reshape(values.shape)


def stubbed_generation(trainer, seed=8, sampling=None):
    """Run TRL's `_generate_and_score_completions` on fixed completions `batch(seed)` (its `_generate` stubbed),
    with vLLM's logprobs `sampling` [B, R] if given. Returns (output, batch)."""
    prompt_ids, _, completion_ids, completion_mask = batch(seed)
    completions = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask)]
    trainer._generate = lambda prompts: (
        prompt_ids.tolist(), completions, None, ["text"] * B,
        None if sampling is None else [list(s) for s in sampling.tolist()], {}, None, None,
    )  # fmt: skip
    trainer._metrics["train"].clear()
    output = trainer._generate_and_score_completions([{"prompt": "a"}] * B)
    return output, (prompt_ids, completion_ids, completion_mask)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_equal_trls(world, tmp_path_factory, scale_rewards):
    """From the same rewards of two functions (weights 1 and 0.5; None for some completions, both None for one):
    TRL's advantages equal grpo.group_advantages(combine_rewards(...)) (nansum, the unscored completion left out of
    its group and given 0), and its reward metrics equal grpo.reward_metrics, except frac_reward_zero_std under
    'batch' scaling, where TRL reports whether the batch's std is 0 and grpo.py the fraction of groups whose
    rewards are equal (what the name says, under any scaling)."""
    trainer = trl_trainer(world, tmp_path_factory, reward_funcs=[f1, f2], scale_rewards=scale_rewards,
                          reward_weights=[1.0, 0.5])  # fmt: skip
    with pytest.warns(RuntimeWarning, match="every reward returned None"):
        output, _ = stubbed_generation(trainer)
        nan = lambda v: float("nan") if v is None else v  # noqa: E731
        per_func = to_ours([[nan(a), nan(b)] for a, b in zip(REWARDS_F1, REWARDS_F2)]).float()
        rewards = grpo.combine_rewards(per_func, torch.tensor([1.0, 0.5]))
    advantages = grpo.group_advantages(rewards, G, scale_rewards)
    torch.testing.assert_close(advantages, to_ours(output["advantages"]), rtol=1e-6, atol=1e-6)
    assert advantages[1 * P + 0].item() == 0.0  # completion 1 of prompt 0 (TRL's row 1): unscored
    metrics = grpo.reward_metrics(per_func, rewards, G, ["f1", "f2"])
    theirs = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    for name, value in metrics.items():
        if name == "frac_reward_zero_std" and scale_rewards == "batch":
            assert (value, theirs[name]) == (0.5, 0.0)  # prompt 1's group is all equal; the batch is not
        else:
            assert value == pytest.approx(theirs[name], rel=1e-6), name


def test_trl_style_none_rewards_combine_like_trl():
    per_func = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")], [2.0, 4.0]])
    with pytest.warns(RuntimeWarning, match="1 completion"):
        rewards = grpo.combine_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert rewards[0] == 1.0 and rewards[1].isnan() and rewards[2] == 4.0


@pytest.mark.parametrize(
    "config,recomputed",
    [
        (dict(), False),  # on-policy: old = current, detached
        (dict(num_iterations=2), True),
        (dict(gradient_accumulation_steps=2, steps_per_generation=4), True),
        (dict(gradient_accumulation_steps=2, steps_per_generation=2), False),
    ],
)
def test_old_logprobs_are_recomputed_when_trl_recomputes_them(
    world, tmp_path_factory, ours, config, recomputed
):
    """TRL computes old logprobs after generation exactly when grpo.recomputes_old_logprobs says so, and grpo.py's
    forward gives TRL's values."""
    trainer = trl_trainer(world, tmp_path_factory, reward_funcs=[f1], **config)
    assert grpo.recomputes_old_logprobs(our_args(**config)) is recomputed
    output, (prompt_ids, completion_ids, completion_mask) = stubbed_generation(trainer)
    assert ("old_per_token_logps" in output) is recomputed
    if recomputed:
        query_responses = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
        mine = utils.logprobs.batched_response_logprobs(ours, query_responses, mask, Q, T, 3)
        real = completion_mask.bool()
        torch.testing.assert_close(mine[real], output["old_per_token_logps"][real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
@pytest.mark.parametrize("clip_min,clip_max", [(None, 3.0), (0.6, 1.5)])
def test_vllm_importance_weights_and_metrics_equal_trls(
    world, tmp_path_factory, ours, mode, clip_min, clip_max
):
    """TRL's importance sampling ratio (each mode, with TRL's default bounds and with both bounds) equals
    utils.vllm.importance_weights of the same old and sampling logprobs, and its sampling/* metrics equal
    utils.vllm.importance_sampling_metrics; vLLM's logprobs here differ from the training forward's by N(0, 0.3)."""
    trainer = trl_trainer(world, tmp_path_factory, reward_funcs=[f1], vllm_importance_sampling_mode=mode,
                          vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)  # fmt: skip
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch(8)
    with torch.no_grad():
        sampling = our_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
    sampling = sampling + 0.3 * torch.randn(B, R, generator=torch.Generator().manual_seed(9))
    trainer.use_vllm = True
    try:
        output, _ = stubbed_generation(trainer, seed=8, sampling=sampling)
    finally:
        trainer.use_vllm = False
    old = output["old_per_token_logps"]
    weights = utils.vllm.importance_weights(old, sampling, completion_mask, mode, clip_min, clip_max)
    torch.testing.assert_close(weights, output["importance_sampling_ratio"], rtol=1e-6, atol=1e-7)
    if clip_min is not None:  # the bounds acted
        assert ((weights == 0) if mode.endswith("mask") else (weights == 1.5) | (weights == 0.6)).any()
    metrics = utils.vllm.importance_sampling_metrics(
        old, sampling, weights, completion_mask, trainer.accelerator
    )
    for name, value in metrics.items():
        assert value == pytest.approx(trainer._metrics["train"][name][-1], rel=1e-5), name


def test_importance_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.2, 0.2]]))
    sampling = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.1, 0.1, float("nan")]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights = utils.vllm.importance_weights(old, sampling, mask, "token_truncate", None, 3.0)
    # masked token and NaN logprob: weight 1 (no correction)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 1.0], [2.0, 2.0, 1.0]]))
    weights = utils.vllm.importance_weights(old, sampling, mask, "sequence_mask", None, 3.0)
    torch.testing.assert_close(
        weights, torch.tensor([[2.0], [0.0]])
    )  # 2 * 2 = 4 > 3: the completion is dropped
    weights = utils.vllm.importance_weights(old, sampling, mask, "sequence_truncate", 0.5, 3.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0], [3.0]]))


def test_our_args_default_like_trl():
    """The flags grpo.py shares with GRPOConfig default to TRL's values, except those listed with the reason."""
    ours_args = grpo.Args()
    theirs = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to=[])
    differ = {
        "output_dir",  # a path of our own
        "max_completion_length",  # 256 instead of 512: the TL;DR recipe's length
        "bf16",  # TRL turns bf16 on by default; the scripts run in float32 unless asked (CPU too)
        "gradient_checkpointing",  # TRL's default True; off here, as every script here
        "logging_steps",  # TRL 10; we log every optimizer step
        "disable_dropout",  # TRL False; True here, so the training forward's logprobs equal sampling's
        "seed",  # transformers' 42; the scripts' 1
        "num_train_epochs",  # transformers' 3.0: the same
        "max_prompt_length",  # not a GRPOConfig field in 1.16
        "lr_scheduler_type",  # transformers' 'linear' is a SchedulerType there
        "epsilon_high",  # None in both; ours is filled in with epsilon
        "save_steps",  # TRL 500; ours 0: checkpoints only when asked for (and on SIGTERM)
        "world_size",  # filled in at runtime here, a property there
        "eval_strategy",  # TRL 'no'; ours 'steps': a --dataset_test_split given is evaluated (None: nothing is)
    }
    shared = [f for f in vars(ours_args) if hasattr(theirs, f) and f not in differ]
    assert {"beta", "loss_type", "scale_rewards", "use_bias_correction_kl", "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max", "generation_batch_size", "num_generations"} <= set(shared)  # fmt: skip
    wrong = {f: (getattr(ours_args, f), getattr(theirs, f)) for f in shared
             if getattr(ours_args, f) != getattr(theirs, f) and f not in ("generation_batch_size", "steps_per_generation")}  # fmt: skip
    assert not wrong, wrong
    assert (ours_args.max_completion_length, theirs.max_completion_length) == (256, 512)
    assert (ours_args.logging_steps, theirs.logging_steps) == (1, 10)
