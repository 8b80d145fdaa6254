"""online_dpo.py against TRL 1.16's own OnlineDPOTrainer (trl.experimental.online_dpo), on the tiny world.

Both sides get the same weights (the tiny world's policy, and as reference a perturbed copy of it so that the
log-ratios are not 0; fp32, CPU) and the same batch: 4 prompts of different
lengths (left-padded), two completions each (truncated after EOS at different places, the longest shorter than
--max_new_tokens), rewards from one reward function that returns a None for one completion and ties for two
prompts. TRL's step samples inside `training_step`; its `_generate` is replaced by one that returns this batch,
so everything after sampling is TRL's: the reward call, None -> NaN -> nansum, the choice of chosen and rejected,
the --max_length cut, the reference's and the policy's logprobs, the loss and its backward. Our side runs the
same pieces main() runs (RewardScorer, nan_as_zero, verdicts, pairs, prompt_mask_within, pair_losses) with the
loss scaled as in main(). The loss and every parameter's gradient must agree in fp32; the only rounding
between the two is RoPE at shifted positions (TRL numbers positions from the first column, padding included; we
from each row's first real token: the same attention in exact arithmetic).
"""

import functools
import json

import pytest
import torch

pytest.importorskip("trl.experimental.online_dpo")

import online_dpo  # noqa: E402
import utils.chat  # noqa: E402
import utils.generation  # noqa: E402
import utils.loading  # noqa: E402
import utils.logprobs  # noqa: E402
import utils.scoring  # noqa: E402

R = 8  # sampled tokens per completion; every completion below ends by its 6th token
REWARDS = [1.0, 0.5, None, 2.0, 3.0, 0.5, -1.0, 2.0]  # completion-major: prompts 1 and 3 tie, None -> 0
BETA = 0.1
GRADIENT_TOLERANCE = 1e-5  # of each tensor's largest gradient; measured: at most 2.5e-6 (RoPE's rounding)


def rewards(prompts, completions, **kwargs):
    """A TRL-style reward function: the fixed rewards of the batch's 8 completions, in row order."""
    assert len(completions) == len(REWARDS)
    return list(REWARDS)


@pytest.fixture(scope="module")
def batch(world):
    """Prompts (raw texts), left-padded ids [P, Q] and mask, responses [2P, R] truncated after EOS, lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    rows = [json.loads(line) for line in open(world / "dataset" / "sft.jsonl")][:4]
    texts = [row["prompt"][(i % 4) * 25 :] for i, row in enumerate(rows)]  # 52, 43, 42 and 32 tokens
    queries, query_mask = utils.generation.left_pad(
        utils.chat.tokenize_prompts(tokenizer, texts), tokenizer.pad_token_id
    )
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(2, len(tokenizer), (8, R), generator=g)
    for row, eos_at in enumerate([2, 5, 0, 3, 5, 1, 4, 2]):
        responses[row, eos_at] = tokenizer.eos_token_id
    responses, lengths = utils.generation.truncate_response(
        responses, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    return tokenizer, texts, queries, query_mask, responses, lengths


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory):
    """The policy with every weight moved by noise of scale 0.02: a reference the policy differs from."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world / "policy")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=g))
    path = tmp_path_factory.mktemp("reference")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trl_trainer(world, reference, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    config = OnlineDPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl_online_dpo")), use_cpu=True, bf16=False,
        gradient_checkpointing=False, per_device_train_batch_size=4, max_new_tokens=R, beta=BETA,
        temperature=0.7, report_to="none",
    )  # fmt: skip
    return OnlineDPOTrainer(
        model=str(world / "policy"), ref_model=AutoModelForCausalLM.from_pretrained(reference),
        reward_funcs=rewards, args=config, train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
        processing_class=AutoTokenizer.from_pretrained(world / "policy"),
    )  # fmt: skip


def trl_step(trainer, batch, loss_type, max_length):
    """TRL's training_step on the batch: (loss, {parameter name: gradient})."""
    _, texts, queries, query_mask, responses, lengths = batch
    width = int(lengths.max())  # what TRL's generate returns: as wide as the longest completion
    mask = utils.generation.lengths_to_mask(lengths, R)
    sampled = (
        queries.repeat(2, 1),
        query_mask.repeat(2, 1).long(),
        responses[:, :width],
        mask[:, :width].long(),
    )
    trainer._generate = lambda model, prompts, images=None: (*sampled, None)
    trainer.args.loss_type, trainer.max_length = loss_type, max_length
    trainer.model.zero_grad()
    loss = trainer.training_step(trainer.model, {"prompt": list(texts)})
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def our_step(world, reference, batch, loss_type, max_length, drop_ties=False, temperature=1.0):
    """Our update's pieces, as main() runs them on one micro-batch: (loss, gradients, per-pair losses, kept)."""
    from transformers import AutoModelForCausalLM

    tokenizer, texts, queries, query_mask, responses, lengths = batch
    policy, reference = (AutoModelForCausalLM.from_pretrained(path) for path in (world / "policy", reference))
    for model in (policy, reference):
        utils.loading.disable_dropout(model)
    P, rows = queries.size(0), torch.arange(8)
    response_mask = utils.generation.lengths_to_mask(lengths, R)
    rows_at = functools.partial(
        utils.generation.query_response_rows, queries, query_mask, responses, response_mask
    )
    scorer = utils.scoring.RewardScorer(None, None, tokenizer, reward_fn=rewards)
    state = utils.scoring.TrainerState(global_step=0, max_steps=1, epoch=0.0)
    scores = scorer(*rows_at(rows), queries.size(1), 8, prompts=[texts[r % P] for r in range(8)],
                    trainer_state=state)  # fmt: skip
    scores = online_dpo.nan_as_zero(scores)
    chosen, rejected, kept = online_dpo.pairs_from_verdicts(
        online_dpo.verdicts_from_scores(scores), drop_ties
    )
    forward_mask = online_dpo.prompt_mask_within(query_mask, lengths, max_length, P)
    first = int(forward_mask.any(0).long().argmax())
    forward_rows_at = functools.partial(utils.generation.query_response_rows, queries[:, first:], forward_mask[:, first:],
                                        responses, response_mask)  # fmt: skip
    context = queries.size(1) - first
    ref_logprobs = utils.logprobs.batched_response_logprobs(
        reference, *forward_rows_at(rows), context, temperature, 8
    )
    idx = torch.cat([chosen, rejected])
    losses, *_ = online_dpo.pair_losses(
        policy,
        *forward_rows_at(idx),
        context,
        response_mask[idx],
        ref_logprobs[idx],
        BETA,
        loss_type,
        temperature,
    )
    loss = (losses * kept.float()).sum() / max(1, int(kept.sum()))  # main()'s loss_scale on one process
    loss.backward()
    return loss.item(), {n: p.grad for n, p in policy.named_parameters()}, losses.detach(), kept


@pytest.mark.parametrize("max_length", [40, 512])  # 40: three of the four prompts are cut to 34 tokens
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_every_gradient_match_trl(world, reference, batch, trl_trainer, loss_type, max_length):
    """TRL's defaults are ours: ties keep the first completion as chosen, None counts 0, logprobs of the plain
    logits (sampling at 0.7 does not enter the loss), IPO on summed log-ratios, prompts cut to --max_length."""
    theirs, their_grads = trl_step(trl_trainer, batch, loss_type, max_length)
    ours, our_grads, _, kept = our_step(world, reference, batch, loss_type, max_length)
    assert kept.all()  # the two ties count
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        largest = their_grads[name].abs().max().item()
        assert (
            largest > 0 and (grad - their_grads[name]).abs().max().item() <= GRADIENT_TOLERANCE * largest
        ), name
    if max_length == 40:  # the cut changes the logprobs, so the parity above covers it
        assert online_dpo.prompt_mask_within(batch[3], batch[5], 40, 4).sum(1).tolist() == [34, 34, 34, 32]
        assert ours != pytest.approx(our_step(world, reference, batch, loss_type, None)[0], rel=1e-3)


def test_drop_ties_leaves_the_tied_pairs_out(world, reference, batch, trl_trainer):
    """Ours, off by default: with --drop_ties a pair of equal rewards has no chosen completion, so it is left out
    of the loss instead of training toward whichever completion was sampled first (TRL's rule). A tie carries no
    preference; with 0/1 rule rewards most pairs tie and TRL's rule pushes the policy at random."""
    theirs, _ = trl_step(trl_trainer, batch, "sigmoid", 512)
    ours, _, losses, kept = our_step(world, reference, batch, "sigmoid", 512, drop_ties=True)
    assert kept.tolist() == [True, False, True, False]
    assert ours == pytest.approx(losses[kept].mean().item(), rel=1e-6)
    assert theirs == pytest.approx(losses.mean().item(), rel=1e-5)  # TRL: the mean over all four pairs
    assert ours != pytest.approx(theirs, rel=1e-3)


def test_logprobs_at_temperature_uses_the_sampling_distribution(world, reference, batch, trl_trainer):
    """Ours, off by default: with --logprobs_at_temperature the loss reads log softmax(logits / T), the
    distribution that sampled the pair (on-policy, and val/logprob_gap checks the training forward against
    sampling). TRL reads the plain logits whatever the sampling temperature, as our default does."""
    theirs, _ = trl_step(trl_trainer, batch, "sigmoid", 512)
    assert our_step(world, reference, batch, "sigmoid", 512, temperature=1.0)[0] == pytest.approx(
        theirs, rel=1e-5
    )
    ours_at_t = our_step(world, reference, batch, "sigmoid", 512, temperature=0.7)[0]
    assert ours_at_t != pytest.approx(theirs, rel=1e-3)
