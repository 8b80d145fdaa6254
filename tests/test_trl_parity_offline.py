"""The offline scripts against TRL 1.16's own trainers: the same weights (the tiny world's policy, perturbed so
that the policy and the reference differ) and the same rows go through our data pipeline and TRL's, which must
build the same batch; the loss and every parameter's gradient are then compared in fp32.

TRL's loss methods are private (DPOTrainer._compute_loss, SFTTrainer.compute_loss, RewardTrainer.compute_loss)
but fixed at 1.16, the version pinned for the tests. Where we differ on purpose, the test asserts the difference
and says why."""

import itertools

import datasets
import pytest
import torch
import tyro

import dpo
import reward
import sft

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":
    pytest.skip(
        f"these tests read TRL 1.16.0's private loss methods; found trl {trl.__version__}",
        allow_module_level=True,
    )

ROWS = 6  # pairs (or examples) in the compared batch
BETA = 0.3  # not TRL's default, so that a beta read from the wrong place shows
LOSS_ATOL, GRAD_RTOL = 2e-6, 2e-4  # fp32, two tilings of the LM head: rounding only

# TRL 1.16's DPO loss types that dpo.py leaves out, refused by --loss_type's choices.
NOT_OURS = ["exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down",
            "discopop", "sft", "sigmoid_norm"]  # fmt: skip


OUTPUT_DIR = {}  # the trainers write nothing, but TrainingArguments wants a folder: a temporary one


@pytest.fixture(scope="module", autouse=True)
def output_dir(tmp_path_factory):
    OUTPUT_DIR["path"] = str(tmp_path_factory.mktemp("trl_output"))


def trl_kwargs() -> dict:
    """TrainingArguments for a CPU, fp32, untracked trainer that is only asked for its loss."""
    return dict(output_dir=OUTPUT_DIR["path"], use_cpu=True, report_to=[], bf16=False, gradient_checkpointing=False,
                per_device_train_batch_size=ROWS)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "policy")


@pytest.fixture(scope="module")
def split(world):
    """{name: the first ROWS rows of the tiny world's split}."""
    data = datasets.load_from_disk(str(world / "dataset"))
    return lambda name: data[name].select(range(ROWS))


@pytest.fixture(scope="module")
def perturbed(world) -> dict:
    """The policy's weights plus seeded noise: a policy that is not its own reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    return {k: v + 0.3 * v.std().nan_to_num(1.0) * torch.randn(v.shape, generator=gen)
            for k, v in model.state_dict().items()}  # fmt: skip


def causal_lm(world, state_dict=None):
    """A fresh fp32 copy of the tiny world's policy (with `state_dict` when given), dropout off, train mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    dpo.utils.loading.disable_dropout(model)
    return model.train()


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(ours: dict, theirs: dict, names=None):
    """Every gradient equal up to fp32 rounding, relative to the largest entry of that parameter's gradient."""
    names = names or theirs.keys()
    assert names and set(names) <= ours.keys()
    for name in names:
        scale = theirs[name].abs().max().item()
        assert scale > 0, f"{name}: no gradient at all, nothing compared"
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=GRAD_RTOL * scale, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# DPO
# ----------------------------------------------------------------------------------------------------------------
def trl_dpo(world, split, tokenizer, perturbed, loss_type, **config):
    """TRL's DPOTrainer on the perturbed policy (the world's policy as reference) and its collated batch."""
    cfg = trl.DPOConfig(**trl_kwargs(), loss_type=[loss_type], beta=BETA, **config)
    trainer = trl.DPOTrainer(
        model=causal_lm(world, perturbed), ref_model=causal_lm(world), args=cfg,
        train_dataset=split("preference"), processing_class=tokenizer,
    )  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])
    return trainer, batch


def trl_dpo_loss(trainer, batch):
    """TRL's loss of `batch` and the gradients it leaves on the policy."""
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    return loss.detach(), grads(trainer.model)


def our_dpo_loss(world, perturbed, batch, args: dpo.Args):
    """Our loss of `batch` as dpo.main computes it (batch_metrics) and the gradients it leaves on the policy."""
    policy, ref = causal_lm(world, perturbed), causal_lm(world)
    logps, lengths, _ = dpo.completion_logps(policy, batch)
    with torch.no_grad():
        ref_logps = dpo.completion_logps(ref, batch)[0]
    n = logps.size(0) // 2
    losses, _, _ = dpo.preference_loss(
        args, logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], lengths[:n], lengths[n:]
    )
    loss = losses.mean()
    loss.backward()
    lengths, ref_logps = lengths[:n], ref_logps.detach()
    at_reference = dpo.preference_loss(args, *ref_logps.chunk(2), *ref_logps.chunk(2), lengths, lengths)[0]
    assert abs(loss.item() - at_reference.mean().item()) > 1e-2  # the policy is not its reference
    return loss.detach(), grads(policy)


def test_dpo_batch_is_trls(world, split, tokenizer, perturbed):
    """Our tokenization and collation of preference rows give TRL's batch, token for token: prompt + chosen rows
    then prompt + rejected rows, right-padded, with the same completion mask (EOS included, prompt excluded)."""
    _, batch = trl_dpo(world, split, tokenizer, perturbed, "sigmoid")
    rows, _ = dpo.tokenize_dataset(split("preference"), tokenizer, dpo.Args(), "rows")
    ours = dpo.collate(rows, tokenizer.pad_token_id)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key].long(), batch[key].long()), key


def test_dpo_truncation_is_trls_without_max_prompt_length(world, split, tokenizer, perturbed):
    """TRL 1.16 cuts prompt + completion to --max_length keeping the start (truncation_mode keep_start, its
    default) and drops a row whose prompt fills it; ours does the same by default (--max_prompt_length None),
    here on prompts of three lengths. Our own --max_prompt_length, not a TRL 1.16 flag, keeps each prompt's end
    so that the final instruction (TL;DR:) survives and no row is dropped."""
    # Prompts of three lengths (their beginnings cut), all ending with the instruction.
    data = split("preference").map(
        lambda row, i: {"prompt": row["prompt"][(0, 6, 60)[i % 3] :]}, with_indices=True
    )
    tail = tokenizer(data[0]["prompt"])["input_ids"][-4:]  # "TL;DR:"
    lengths = [len(tokenizer(p)["input_ids"]) for p in data["prompt"]]
    max_length = max(lengths)  # the longest prompts fill it: dropped; the others' completions cut
    cfg = trl.DPOConfig(**trl_kwargs(), max_length=max_length)
    trainer = trl.DPOTrainer(model=causal_lm(world), ref_model=causal_lm(world), args=cfg, train_dataset=data,
                             processing_class=tokenizer)  # fmt: skip
    kept = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(kept)
    args = dpo.Args(max_length=max_length)
    rows, counts = dpo.tokenize_dataset(data, tokenizer, args, "rows")
    assert 0 < counts["dropped"] == ROWS - len(kept) and counts["sequences_truncated"] > 0
    ours = dpo.collate(rows, tokenizer.pad_token_id)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key].long(), batch[key].long()), key
    cut_args = dpo.Args(max_length=max_length, max_prompt_length=max_length // 2)
    cut_rows, _ = dpo.tokenize_dataset(data, tokenizer, cut_args, "rows")
    assert len(cut_rows) == ROWS  # nothing dropped: the prompt gives way
    assert all(row["chosen_prompt"][-len(tail) :] == tail for row in cut_rows)  # and keeps the instruction


DPO_PAIRS = 20  # the tiny world's prompts are 52 tokens, its completions 2-4 and an EOS


@pytest.mark.filterwarnings("ignore:The `'keep_end'` truncation mode is deprecated:FutureWarning")
@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_dpo_max_length_and_truncation_mode_are_trls(world, tokenizer, truncation_mode):
    """A TRL 1.16 command line's --max_length and --truncation_mode, parsed with our defaults, give TRL's
    rows: DPOTrainer's prepared dataset (keep_start drops a pair whose prompt fills --max_length) through its
    collator, which cuts each prompt + completion sequence (keep_start its end, keep_end its start), equal to
    our collated rows, ids and masks. Where TRL keeps no pair, ours refuses in one sentence (#48)."""
    data = datasets.load_from_disk(str(world / "dataset"))["preference"].select(range(DPO_PAIRS))
    kept, cut = {}, {}
    for max_length in (58, 56, 53, 52, 40):
        cfg = trl.DPOConfig(**trl_kwargs(), max_length=max_length, truncation_mode=truncation_mode)
        trainer = trl.DPOTrainer(model=causal_lm(world), ref_model=causal_lm(world), args=cfg,
                                 train_dataset=data, processing_class=tokenizer)  # fmt: skip
        theirs = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
        kept[max_length] = len(theirs)
        flags = ["--max_length", str(max_length), "--truncation_mode", truncation_mode]
        args = dpo.fill_sizes(tyro.cli(dpo.Args, args=flags), 1)
        if not theirs:
            with pytest.raises(ValueError, match="no prompt leaves room for a completion under --max_length"):
                dpo.tokenize_dataset(data, tokenizer, args, "rows")
            continue
        rows, counts = dpo.tokenize_dataset(data, tokenizer, args, "rows")
        assert counts["dropped"] == DPO_PAIRS - len(theirs)
        batch, ours = trainer.data_collator(theirs), dpo.collate(rows, tokenizer.pad_token_id)
        for key in ("input_ids", "attention_mask", "completion_mask"):
            assert torch.equal(ours[key].long(), batch[key].long()), (max_length, key)
        whole = [
            len(r["prompt_ids"]) + len(r[f"{side}_ids"]) for r in theirs for side in ("chosen", "rejected")
        ]
        cut[max_length] = sum(length > max_length for length in whole)
        assert counts["sequences_truncated"] == cut[max_length]
    assert kept == {58: 20, 56: 20, 53: 20, 52: 0 if truncation_mode == "keep_start" else 20, 40: kept[52]}
    assert cut == {58: 0, 56: 15, 53: 40} | ({} if truncation_mode == "keep_start" else {52: 40, 40: 40})


@pytest.mark.parametrize(
    "loss_type, label_smoothing",
    [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.1), ("robust", 0.3)],
)
def test_dpo_loss_and_gradients_are_trls(world, split, tokenizer, perturbed, loss_type, label_smoothing):
    """Each loss type both sides have: same loss, same gradient on every parameter. IPO: both average each
    log-ratio over its completion's tokens (TRL's choice, confirmed by the IPO authors)."""
    trainer, batch = trl_dpo(world, split, tokenizer, perturbed, loss_type, label_smoothing=label_smoothing)
    theirs, their_grads = trl_dpo_loss(trainer, batch)
    args = dpo.Args(loss_type=loss_type, beta=BETA, label_smoothing=label_smoothing)
    ours, our_grads = our_dpo_loss(world, perturbed, batch, args)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOSS_ATOL)
    assert_same_grads(our_grads, their_grads)


def test_dpo_summed_ipo_would_differ(world, split, tokenizer, perturbed):
    """The averaging matters: IPO on summed log-ratios (the paper's letter) gives another loss than TRL's."""
    trainer, batch = trl_dpo(world, split, tokenizer, perturbed, "ipo")
    theirs, _ = trl_dpo_loss(trainer, batch)
    policy, ref = causal_lm(world, perturbed), causal_lm(world)
    with torch.no_grad():
        logps, lengths, _ = dpo.completion_logps(policy, batch)
        ref_logps = dpo.completion_logps(ref, batch)[0]
        n, ones = logps.size(0) // 2, torch.ones_like(lengths[:ROWS])
        summed = dpo.ipo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], ones, ones, BETA).mean()
    assert abs(summed.item() - theirs.item()) > 0.1


def test_dpo_label_smoothing_with_sigmoid_is_conservative_dpo_not_trls(world, split, tokenizer, perturbed):
    """A difference on purpose: with --loss_type sigmoid, --label_smoothing e gives conservative DPO here
    (Mitchell 2023; TRL before 1.0 did the same), -(1-e) log sig(beta h) - e log sig(-beta h), where TRL 1.16's
    sigmoid ignores label_smoothing (it documents it for robust, exo_pair and aot only). Checked exactly: ours is
    (1-e) x TRL's loss of the batch + e x TRL's loss of the batch with chosen and rejected swapped."""
    e = 0.2
    trainer, batch = trl_dpo(world, split, tokenizer, perturbed, "sigmoid", label_smoothing=e)
    plain, plain_grads = trl_dpo_loss(trainer, batch)
    swapped_batch = {k: torch.cat(v.chunk(2)[::-1]) for k, v in batch.items()}
    swapped, swapped_grads = trl_dpo_loss(trainer, swapped_batch)
    trainer_0, _ = trl_dpo(world, split, tokenizer, perturbed, "sigmoid")
    assert torch.equal(trl_dpo_loss(trainer_0, batch)[0], plain)  # TRL: label_smoothing has no effect
    ours, our_grads = our_dpo_loss(world, perturbed, batch, dpo.Args(beta=BETA, label_smoothing=e))
    assert abs(ours.item() - plain.item()) > 1e-2
    torch.testing.assert_close(ours, (1 - e) * plain + e * swapped, rtol=0, atol=LOSS_ATOL)
    expected = {k: (1 - e) * plain_grads[k] + e * swapped_grads[k] for k in plain_grads}
    assert_same_grads(our_grads, expected)


@pytest.mark.parametrize("loss_type", NOT_OURS)
def test_dpo_loss_types_we_leave_out_are_refused(loss_type):
    """TRL 1.16's loss types that dpo.py does not implement are refused by --loss_type, never run as another."""
    assert loss_type in trl.DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    with pytest.raises(SystemExit):
        tyro.cli(dpo.Args, args=["--loss_type", loss_type], console_outputs=False)


def test_simpo_is_trl_cpo_simpo(world, split, tokenizer, perturbed):
    """SimPO is not in TRL 1.16's DPOTrainer; it lives in trl.experimental.cpo (CPOTrainer, loss_type simpo,
    cpo_alpha 0). Its loss of the same length-averaged logprobs, label smoothing included, and the gradients
    through them equal ours."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    gamma, e = 0.7, 0.1
    cfg = CPOConfig(**trl_kwargs(), loss_type="simpo", cpo_alpha=0.0, simpo_gamma=gamma, beta=BETA,
                    label_smoothing=e)  # fmt: skip
    trainer = CPOTrainer(model=causal_lm(world), args=cfg, train_dataset=split("preference"),
                         processing_class=tokenizer)  # fmt: skip
    _, batch = trl_dpo(world, split, tokenizer, perturbed, "sigmoid")
    results = []
    for side in ("ours", "theirs"):
        policy = causal_lm(world, perturbed)
        logps, lengths, _ = dpo.completion_logps(policy, batch)
        pi_c, pi_r, len_c, len_r = logps[:ROWS], logps[ROWS:], lengths[:ROWS], lengths[ROWS:]
        if side == "ours":
            args = dpo.Args(loss_type="simpo", beta=BETA, simpo_gamma=gamma, label_smoothing=e)
            losses = dpo.preference_loss(args, pi_c, pi_r, pi_c * 0, pi_r * 0, len_c, len_r)[0]
        else:
            losses = trainer.cpo_loss(pi_c / len_c, pi_r / len_r)[0]
        losses.mean().backward()
        results.append((losses.mean().detach(), grads(policy)))
    (ours, our_grads), (theirs, their_grads) = results
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOSS_ATOL)
    assert_same_grads(our_grads, their_grads)


# ----------------------------------------------------------------------------------------------------------------
# SFT
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("completion_only_loss", [True, False])
def test_sft_batch_loss_and_gradients_are_trls(world, split, tokenizer, perturbed, completion_only_loss):
    """Prompt-completion rows: our labels are TRL's (completion and EOS only, or every token with
    --no_completion_only_loss), and the loss, the mean next-token NLL over the labelled tokens of the batch, and
    its gradients equal SFTTrainer's."""
    cfg = trl.SFTConfig(**trl_kwargs(), completion_only_loss=completion_only_loss)
    trainer = trl.SFTTrainer(model=causal_lm(world, perturbed), args=cfg, train_dataset=split("sft"),
                             processing_class=tokenizer)  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])
    args = sft.Args(completion_only_loss=completion_only_loss)
    rows, _ = sft.tokenize_split(split("sft"), tokenizer, args, "rows")
    ours_batch = sft.collate(rows, tokenizer.pad_token_id)
    assert ours_batch.keys() <= batch.keys()
    for key in ours_batch:
        assert torch.equal(ours_batch[key], batch[key]), key
    prompt_labelled = (ours_batch["labels"][:, 0] != sft.IGNORE_INDEX).all()
    assert prompt_labelled == (not completion_only_loss)

    trainer.model.zero_grad()
    theirs = trainer.compute_loss(trainer.model, dict(batch))
    theirs.backward()
    policy = causal_lm(world, perturbed)
    nll, tokens = sft.sum_token_nll(policy, ours_batch)
    ours = nll / tokens  # one micro-batch, one process: the optimizer batch's token count
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=LOSS_ATOL)
    assert_same_grads(grads(policy), grads(trainer.model))


# ----------------------------------------------------------------------------------------------------------------
# Reward model
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "center_rewards_coefficient, with_margin", [(None, False), (0.05, False), (None, True)]
)
def test_reward_batch_loss_accuracy_and_gradients_are_trls(
    world, split, tokenizer, center_rewards_coefficient, with_margin
):
    """Preference rows: our batch is RewardTrainer's (prompt + chosen rows, then prompt + rejected, each ending with
    EOS); the Bradley-Terry loss -log sig(r_c - r_r - margin) (a `margin` column, when there is one; the centering
    term when set), the accuracy and the gradients equal TRL's. Our score is read at the last real token from the
    attention mask, TRL's by the classifier at the last non-pad token: the same token while pad and EOS differ. Our
    score head carries a bias (0 at the start: it holds the normalisation) that TRL's has not; its gradient is
    ours alone."""
    from transformers import AutoModelForSequenceClassification

    def classifier():
        model = AutoModelForSequenceClassification.from_pretrained(world / "reward", num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        with torch.no_grad():  # a head away from the world's, so that the scores differ pair to pair
            head = model.score.weight
            head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)) * head.std())
        dpo.utils.loading.disable_dropout(model)
        return model.train()

    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    data = split("preference")
    if with_margin:
        data = data.add_column("margin", [0.5 * i - 1.0 for i in range(ROWS)])
    cfg = trl.RewardConfig(**trl_kwargs(), center_rewards_coefficient=center_rewards_coefficient)
    trainer = trl.RewardTrainer(model=classifier(), args=cfg, train_dataset=data, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])
    rows, _, _ = reward.tokenize_rows(tokenizer, data, [reward.CHOSEN, reward.REJECTED], 1024)
    ours_batch = reward.collate(rows, tokenizer.pad_token_id)
    for key in ("input_ids", "attention_mask", "margin")[: 2 + with_margin]:
        assert torch.equal(ours_batch[key], batch[key]), key

    trainer.model.zero_grad()
    theirs = trainer.compute_loss(trainer.model, dict(batch))
    theirs.backward()
    their_accuracy = trainer._metrics["train"]["accuracy"][-1]
    model = classifier()
    reward.biased_head(model)
    scores = reward.ScoreModel(model)(ours_batch["input_ids"], ours_batch["attention_mask"])
    chosen, rejected = scores.view(2, -1)
    ours = reward.reward_loss(chosen, rejected, ours_batch["margin"], center_rewards_coefficient)
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=LOSS_ATOL)
    assert 0 < their_accuracy < 1  # a batch where the accuracy can be wrong either way
    metrics = reward.eval_metrics(
        scores.detach().view(2, -1).T, ours_batch["margin"], ours_batch["group"], [""]
    )
    assert metrics["eval/accuracy"] == pytest.approx(their_accuracy, abs=1e-7)
    assert_same_grads(grads(model), grads(trainer.model))
    assert "score.bias" in grads(model) and "score.bias" not in grads(trainer.model)


# ----------------------------------------------------------------------------------------------------------------
# SFT truncation and packing
# ----------------------------------------------------------------------------------------------------------------
SFT_EXAMPLES = 20  # the tiny world's prompts are 52 tokens, its completions 2-4 and an EOS


def trl_sft(world, tokenizer, model=None, rows=SFT_EXAMPLES, **config):
    """SFTTrainer 1.16 on the first `rows` SFT examples; its train_dataset is the prepared one."""
    data = datasets.load_from_disk(str(world / "dataset"))["sft"].select(range(rows))
    cfg = trl.SFTConfig(**trl_kwargs() | config)
    return trl.SFTTrainer(
        model=model or causal_lm(world), args=cfg, train_dataset=data, processing_class=tokenizer
    )


def our_sft_rows(world, tokenizer, rows=SFT_EXAMPLES, **flags) -> list[dict]:
    data = datasets.load_from_disk(str(world / "dataset"))["sft"].select(range(rows))
    return sft.tokenize_split(data, tokenizer, sft.Args(**flags), "rows")[0]


def their_loss_mask(row: dict) -> list[int]:
    """The tokens with a label in a prepared row of TRL, less each packed example's first, which its collator
    takes off the loss."""
    mask = [int(label != sft.IGNORE_INDEX) for label in row["labels"]]
    if "seq_lengths" in row:
        for start in itertools.accumulate([0, *row["seq_lengths"][:-1]]):
            mask[start] = 0
    return mask


def assert_same_rows(ours: list[dict], theirs) -> None:
    """Our rows are TRL's prepared rows: the same ids, loss tokens and packed lengths, in order."""
    assert len(ours) == len(theirs)
    for row, their_row in zip(ours, theirs):
        assert row["input_ids"] == their_row["input_ids"]
        assert row["loss_mask"] == their_loss_mask(their_row)
        assert row.get("seq_lengths") == their_row.get("seq_lengths")


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_sft_truncation_is_trls(world, tokenizer, truncation_mode):
    """--max_length cuts as SFTTrainer 1.16: keep_start (its default) cuts the end of prompt + completion + EOS,
    the EOS first, then into the completion; a row left without a loss token is dropped (keep_end: cuts the
    prompt's start). Where TRL keeps no row, ours refuses in one sentence."""
    kept = {}
    for max_length in (57, 56, 54, 53, 52):
        theirs = trl_sft(
            world, tokenizer, max_length=max_length, truncation_mode=truncation_mode
        ).train_dataset
        kept[max_length] = len(theirs)
        if not len(theirs):
            with pytest.raises(ValueError, match=f"all {SFT_EXAMPLES} examples were dropped"):
                our_sft_rows(world, tokenizer, max_length=max_length, truncation_mode=truncation_mode)
            continue
        ours = our_sft_rows(world, tokenizer, max_length=max_length, truncation_mode=truncation_mode)
        assert_same_rows(ours, theirs)
        ended = sum(row["input_ids"][-1] == tokenizer.eos_token_id for row in ours)
        assert ended == (20 if truncation_mode == "keep_end" else {57: 20, 56: 18}.get(max_length, 0))
    assert kept == {57: 20, 56: 20, 54: 20, 53: 20, 52: 0 if truncation_mode == "keep_start" else 20}


def test_sft_packing_of_many_rows_is_trls():
    """pack_rows against TRL's pack_dataset on 2,500 sequences of mixed lengths: the same rows, in the same order,
    with the same example lengths, for each strategy (1,000 examples at a time, as TRL's batched map)."""
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 90, (2500,), generator=rng).tolist()
    ids = [torch.randint(2, 200, (n,), generator=rng).tolist() for n in lengths]
    masks = [[int(i % 3 > 0) for i in range(n)] for n in lengths]
    rows = [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks)]
    labels = [[t if m else sft.IGNORE_INDEX for t, m in zip(i, mask)] for i, mask in zip(ids, masks)]
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    for strategy in ("bfd", "bfd_split", "wrapped"):
        assert_same_rows(sft.pack_rows(rows, 64, strategy), trl.pack_dataset(data, 64, strategy))


@pytest.mark.parametrize(
    "packing_strategy, max_length, completion_only_loss",
    [("bfd", 128, True), ("bfd", 128, False), ("bfd_split", 40, False), ("wrapped", 128, True)],
)
def test_sft_packed_rows_loss_and_gradients_are_trls(
    world, tokenizer, perturbed, packing_strategy, max_length, completion_only_loss
):
    """--packing (bfd, TRL 1.16's default; bfd_split; wrapped) builds SFTTrainer's packed rows, and one batch of
    them gives TRL's collated batch (bfd: padding-free, one row, position ids from 0 in each example), loss and
    gradients."""
    config = dict(max_length=max_length, packing=True, packing_strategy=packing_strategy)
    trainer = trl_sft(world, tokenizer, causal_lm(world, perturbed), completion_only_loss=completion_only_loss,
                      **config)  # fmt: skip
    rows = our_sft_rows(world, tokenizer, completion_only_loss=completion_only_loss, **config)
    assert_same_rows(rows, trainer.train_dataset)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ours_batch = sft.collate(rows[:4], tokenizer.pad_token_id)
    real = ours_batch["attention_mask"].bool()
    for key in ("input_ids", "position_ids", "labels") if packing_strategy != "wrapped" else ours_batch:
        ours_key = ours_batch[key][real][None] if packing_strategy != "wrapped" else ours_batch[key]
        assert torch.equal(ours_key, batch[key]), key

    trainer.model.zero_grad()
    theirs = trainer.compute_loss(trainer.model, dict(batch))
    theirs.backward()
    policy = causal_lm(world, perturbed)
    nll, tokens = sft.sum_token_nll(policy, ours_batch)
    (nll / tokens).backward()
    torch.testing.assert_close((nll / tokens).detach(), theirs.detach(), rtol=0, atol=LOSS_ATOL)
    assert_same_grads(grads(policy), grads(trainer.model))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_sft_packed_examples_do_not_attend_to_each_other(world, tokenizer, attn_implementation):
    """The loss of rows packed by bfd is the loss of their examples each alone: transformers 5 builds a
    block-diagonal mask from the position ids for eager and sdpa attention. Without them it would differ."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world / "policy", dtype=torch.float32,
                                                 attn_implementation=attn_implementation).eval()  # fmt: skip
    flags = dict(max_length=128, completion_only_loss=False)
    packed = our_sft_rows(world, tokenizer, rows=8, packing=True, **flags)
    alone = our_sft_rows(world, tokenizer, rows=8, **flags)
    assert len(packed) == 4 and all(len(row["seq_lengths"]) == 2 for row in packed)
    with torch.no_grad():
        packed_nll, packed_tokens = sft.sum_token_nll(model, sft.collate(packed, tokenizer.pad_token_id))
        alone_nll, alone_tokens = sft.sum_token_nll(model, sft.collate(alone, tokenizer.pad_token_id))
        crossing = sft.collate(packed, tokenizer.pad_token_id)
        del crossing["position_ids"]
        crossing_nll, _ = sft.sum_token_nll(model, crossing)
    assert packed_tokens == alone_tokens
    torch.testing.assert_close(packed_nll, alone_nll, rtol=1e-5, atol=0)
    assert abs(crossing_nll - alone_nll) > 1e-4 * alone_nll  # 10 times the tolerance above; measured 1.4e-3


def test_reward_max_length_drops_pairs_as_trl(world, tokenizer):
    """--max_length drops a pair whose chosen or rejected sequence (prompt + completion + EOS) is longer, as
    RewardTrainer 1.16 filters its prepared dataset; nothing is cut (tests/test_reward.py: none left is refused)."""
    from transformers import AutoModelForSequenceClassification

    data = datasets.load_from_disk(str(world / "dataset"))["preference"].select(range(20))
    kept = {}
    for max_length in (58, 57, 56, 55, 54):
        model = AutoModelForSequenceClassification.from_pretrained(world / "reward", num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        cfg = trl.RewardConfig(**trl_kwargs(), max_length=max_length)
        theirs = trl.RewardTrainer(model=model, args=cfg, train_dataset=data, processing_class=tokenizer)
        theirs = theirs.train_dataset
        rows, counts, _ = reward.tokenize_rows(tokenizer, data, [reward.CHOSEN, reward.REJECTED], max_length)
        kept[max_length] = len(theirs)
        assert counts == {"rows": 20, "dropped": 20 - len(theirs)}
        assert [row["sequences"] for row in rows] == [[r["chosen_ids"], r["rejected_ids"]] for r in theirs]
    assert kept == {58: 20, 57: 17, 56: 8, 55: 2, 54: 0}
