"""utils/ against hand-computed cases and slow loop implementations."""

import json
import math

import pytest
import torch

import utils.chat
import utils.checkpoint
import utils.cli
import utils.data
import utils.examples
import utils.generation
import utils.loading
import utils.logprobs
import utils.reward_funcs
import utils.reward_model
import utils.run
import utils.saving
import utils.scoring
import utils.stats
import utils.tracking

PAD, EOS = 1, 0


# ---------------------------------------------------------------------------------------------- padding, truncation
def test_pad_right_and_left_hand_cases():
    seqs = [[5, 6, 7], [8], []]
    assert utils.generation.pad(seqs, PAD, "right").tolist() == [[5, 6, 7], [8, PAD, PAD], [PAD, PAD, PAD]]
    assert utils.generation.pad(seqs, PAD, "left").tolist() == [[5, 6, 7], [PAD, PAD, 8], [PAD, PAD, PAD]]
    assert utils.generation.pad([], PAD).shape == (0, 0)
    with pytest.raises(ValueError, match="side"):
        utils.generation.pad(seqs, PAD, "middle")


def slow_first_true(row):
    for i, b in enumerate(row):
        if b:
            return i
    return len(row)


def test_first_true_indices_matches_loop():
    g = torch.Generator().manual_seed(0)
    bools = torch.rand(50, 7, generator=g) < 0.2
    bools[0] = False  # no true at all
    bools[1] = True  # all true
    expected = [slow_first_true(row.tolist()) for row in bools]
    assert utils.generation.first_true_indices(bools).tolist() == expected
    assert expected[0] == 7 and expected[1] == 0


def slow_truncate(row, stop, pad):
    out, length = [], len(row)
    for i, t in enumerate(row):
        out.append(t)
        if t == stop:
            length = i + 1
            break
    return out + [pad] * (len(row) - len(out)), length


@pytest.mark.parametrize("pad_id", [PAD, EOS])  # pad distinct from, and equal to, the stop token
def test_truncate_response_edge_cases(pad_id):
    responses = torch.tensor(
        [
            [EOS, 5, 6, 7],  # stop at the first position
            [5, 6, 7, EOS],  # stop at the last position
            [5, 6, 7, 8],  # no stop token
            [5, EOS, 6, EOS],  # two stops: cut at the first
            [pad_id] * 4,  # all padding
        ]
    )
    truncated, lengths = utils.generation.truncate_response(responses, EOS, pad_id)
    for row, out, length in zip(responses.tolist(), truncated.tolist(), lengths.tolist()):
        exp_out, exp_len = slow_truncate(row, EOS, pad_id)
        assert out == exp_out and length == exp_len
    assert lengths.tolist()[:4] == [1, 4, 4, 2]
    same, full = utils.generation.truncate_response(responses, None, pad_id)
    assert torch.equal(same, responses) and full.tolist() == [4] * 5
    # several stop ids (a generation_config's EOS ids, as TRL 1.16): the first of any of them
    _, lengths = utils.generation.truncate_response(responses, [7, EOS], pad_id)
    assert lengths.tolist()[:4] == [1, 3, 3, 2]


def test_lengths_to_mask_and_last_token_indices():
    mask = utils.generation.lengths_to_mask(torch.tensor([0, 2, 3]), 3)
    assert mask.tolist() == [[False] * 3, [True, True, False], [True] * 3]
    # left-padded query + right-padded response: the last real token is the end of the response
    am = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    assert utils.reward_model.last_token_indices(am).tolist() == [4, 5, 2]


def test_exact_div_and_checks(tmp_path):
    assert utils.run.exact_div(12, 4, "--a / --b") == 3
    with pytest.raises(ValueError, match=r"--batch_size.*--rloo_k.*10 is not divisible by 4"):
        utils.run.exact_div(10, 4, "--batch_size / --rloo_k")
    with pytest.raises(ValueError):
        utils.run.exact_div(4, 0, "x")
    (tmp_path / "out").mkdir()
    utils.checkpoint.check_output_dir(str(tmp_path / "out"))  # empty: fine
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="not empty"):
        utils.checkpoint.check_output_dir(str(tmp_path / "out"))
    utils.checkpoint.check_output_dir(str(tmp_path / "out"), overwrite=True)
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"


def test_check_columns_names_expected_and_found():
    import datasets

    ds = datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]})
    utils.data.check_columns(ds, ["prompt"], "the train split")
    with pytest.raises(
        ValueError, match=r"missing column\(s\) \['completion'\].*found \['prompt', 'answer'\]"
    ):
        utils.data.check_columns(ds, ["prompt", "completion"], "the train split")
    with pytest.raises(ValueError, match="empty"):
        utils.data.check_columns(ds.select([]), ["prompt"], "the train split")


# ---------------------------------------------------------------------------------------------- masked statistics
def test_masked_statistics_match_loops():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.6
    picked = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(picked) / len(picked)
    var = sum((x - mean) ** 2 for x in picked) / (len(picked) - 1)
    assert utils.stats.masked_mean(values, mask).item() == pytest.approx(mean, abs=1e-6)
    assert utils.stats.masked_var(values, mask).item() == pytest.approx(var, abs=1e-5)
    assert utils.stats.masked_var(values, mask, unbiased=False).item() == pytest.approx(
        var * (len(picked) - 1) / len(picked), abs=1e-5
    )
    white = utils.stats.masked_whiten(values, mask)
    for v, w, m in zip(values.flatten().tolist(), white.flatten().tolist(), mask.flatten().tolist()):
        if m:
            assert w == pytest.approx((v - mean) / math.sqrt(var + 1e-8), abs=1e-5)
    kept = utils.stats.masked_whiten(values, mask, shift_mean=False)
    assert utils.stats.masked_mean(kept, mask).item() == pytest.approx(mean, abs=1e-5)
    row_means = utils.stats.masked_mean(values, mask, dim=1)
    for r in range(4):
        row = [v for v, m in zip(values[r].tolist(), mask[r].tolist()) if m]
        if row:
            assert row_means[r].item() == pytest.approx(sum(row) / len(row), abs=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        utils.stats.masked_var(values, torch.zeros_like(mask).index_fill_(1, torch.tensor([0]), True)[:1, :])


def test_logprobs_and_entropy_match_definitions():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, generator=g)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    lp = utils.logprobs.logprobs_from_logits(logits, tokens)
    ent = utils.logprobs.entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            z = [math.exp(x) for x in logits[b, t].tolist()]
            p = [x / sum(z) for x in z]
            assert lp[b, t].item() == pytest.approx(math.log(p[tokens[b, t]]), abs=1e-5)
            assert ent[b, t].item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-5)


# ---------------------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def tiny_models(world):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    policy = AutoModelForCausalLM.from_pretrained(world / "policy").eval()
    reward = AutoModelForSequenceClassification.from_pretrained(world / "reward").eval()
    return tok, policy, reward


def left_padded_queries(tok, texts):
    ids = utils.chat.tokenize_prompts(tok, texts)
    queries = utils.generation.pad(ids, tok.pad_token_id, "left")
    return queries, queries != tok.pad_token_id


def test_tokenize_prompts_keeps_the_end(tiny_models):
    tok = tiny_models[0]
    full = utils.chat.tokenize_prompts(tok, ["SUBREDDIT: r/pets\n\nTITLE: a b\n\nPOST: dog\n\nTL;DR:"])[0]
    cut = utils.chat.tokenize_prompts(tok, ["SUBREDDIT: r/pets\n\nTITLE: a b\n\nPOST: dog\n\nTL;DR:"], 5)[0]
    assert cut == full[-5:] and tok.eos_token_id not in full


def test_generation_logprobs_equal_forward_logprobs_with_left_padding(tiny_models):
    """The invariant behind ratio == 1 at the first PPO step: sampling logprobs == recomputed logprobs."""
    tok, policy, _ = tiny_models
    texts = ["SUBREDDIT: r/pets\n\nTITLE: a\n\nPOST: dog vet\n\nTL;DR:", "POST: the cat\n\nTL;DR:", "TL;DR:"]
    queries, qmask = left_padded_queries(tok, texts)
    for temperature in (0.7, 1.0, 0.0):
        torch.manual_seed(0)
        qr, logprobs = utils.generation.generate(policy, queries, qmask, 6, temperature, chunk_size=2)
        assert qr.shape == (3, queries.size(1) + 6) and torch.equal(qr[:, : queries.size(1)], queries)
        am = torch.cat([qmask, torch.ones(3, 6, dtype=torch.bool)], 1)
        recomputed = utils.logprobs.batched_response_logprobs(
            policy, qr, am, queries.size(1), temperature, chunk_size=3
        )
        torch.testing.assert_close(recomputed, logprobs, atol=1e-4, rtol=1e-4)
        # the same rows one at a time, without any padding
        for i, text in enumerate(texts):
            q = torch.tensor([utils.chat.tokenize_prompts(tok, [text])[0]])
            resp = qr[i : i + 1, queries.size(1) :]
            alone = torch.cat([q, resp], 1)
            lp = utils.logprobs.batched_response_logprobs(
                policy, alone, torch.ones_like(alone, dtype=torch.bool), q.size(1), temperature, 1
            )
            torch.testing.assert_close(lp, logprobs[i : i + 1], atol=1e-4, rtol=1e-4)


def test_generation_greedy_is_argmax_and_sampling_is_seeded(tiny_models):
    tok, policy, _ = tiny_models
    queries, qmask = left_padded_queries(tok, ["POST: dog\n\nTL;DR:", "TL;DR:"])
    qr, _ = utils.generation.generate(policy, queries, qmask, 3, 0.0, chunk_size=4)
    # slow greedy loop without cache, one row at a time
    for i in range(2):
        ids = queries[i][qmask[i]].tolist()
        for _ in range(3):
            ids.append(policy(torch.tensor([ids])).logits[0, -1].argmax().item())
        assert qr[i, queries.size(1) - int(qmask[i].sum()) :].tolist() == ids
    a = utils.generation.generate(policy, queries, qmask, 4, 1.0, 4, torch.Generator().manual_seed(3))[0]
    b = utils.generation.generate(policy, queries, qmask, 4, 1.0, 4, torch.Generator().manual_seed(3))[0]
    assert torch.equal(a, b)


def test_sample_categorical_draws_each_token_with_its_probability():
    # rows: zeros between and at the ends, a total that is not 1, all mass on the first or on the last entry
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 2.0, 0.0, 0.0, 6.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0]])  # fmt: skip
    n = 40_000
    ids = utils.generation.sample_categorical(probs.repeat(n, 1), torch.Generator().manual_seed(0))
    assert ids.shape == (4 * n, 1) and ids.dtype == torch.long
    counts = torch.stack([torch.bincount(ids[r::4, 0], minlength=5) for r in range(4)]).double()
    expected = probs.double() / probs.sum(1, keepdim=True)
    assert torch.equal(counts[expected == 0], torch.zeros_like(counts[expected == 0]))  # never a zero entry
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() <= 5 * sigma + 1e-12).all(), counts / n
    # at a real vocabulary width: two tokens drawn at their rates (one of them the last), none of their neighbours
    wide = torch.zeros(200, 151936)
    wide[:, 1000], wide[:, 151935] = 0.3, 0.7
    generator = torch.Generator().manual_seed(1)
    draws = torch.cat([utils.generation.sample_categorical(wide, generator) for _ in range(10)])
    assert set(draws.unique().tolist()) == {1000, 151935}
    assert abs((draws == 1000).double().mean().item() - 0.3) <= 5 * math.sqrt(0.21 / 2000)
    a, b = (utils.generation.sample_categorical(probs, torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a, b)


def test_get_score_reads_last_real_token_under_any_padding(tiny_models):
    tok, _, reward = tiny_models
    seq = torch.tensor(
        [utils.chat.tokenize_prompts(tok, ["POST: dog vet\n\nTL;DR: dog"])[0] + [tok.eos_token_id]]
    )
    with torch.no_grad():
        alone = reward(input_ids=seq).logits[0, 0]  # the model's own pooling, no padding at all
        left = torch.cat([torch.full((1, 3), tok.pad_token_id), seq], 1)
        right = torch.cat([seq, torch.full((1, 2), tok.pad_token_id)], 1)
        both = torch.cat([torch.full((1, 2), tok.pad_token_id), seq, torch.full((1, 4), tok.pad_token_id)], 1)
        for padded in (seq, left, right, both):
            batch = torch.cat([padded, padded])
            score = utils.reward_model.batched_score(reward, batch, batch != tok.pad_token_id, chunk_size=1)
            torch.testing.assert_close(score, alone.expand(2), atol=1e-4, rtol=1e-4)
        values = utils.reward_model.per_token_scores(reward, both, both != tok.pad_token_id)
        assert values.shape == both.shape


def test_reward_model_with_two_labels_is_refused(world):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        world / "reward", num_labels=2, ignore_mismatched_sizes=True
    )
    with pytest.raises(ValueError, match="exactly one"):
        utils.reward_model.score_head(model)


def test_disable_dropout():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, attention_dropout=0.5))  # fmt: skip
    model.train()
    utils.loading.disable_dropout(model)
    assert model.config.attention_dropout == 0.0
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in model.modules())
    x = torch.randint(0, 20, (2, 5))
    torch.testing.assert_close(model(x).logits, model(x).logits)


# ---------------------------------------------------------------------------------------------- loading
def test_load_split_from_every_local_format(world, tmp_path):
    ds_dir = world / "dataset"
    from_disk = utils.data.load_split(str(ds_dir), "sft")
    from_jsonl = utils.data.load_split(str(ds_dir / "sft.jsonl"), "train")
    with pytest.raises(ValueError, match="is one file, whose only split is 'train'"):
        utils.data.load_split(
            str(ds_dir / "sft.jsonl"), "validation"
        )  # never the training rows as a test split
    assert from_disk["prompt"] == from_jsonl["prompt"]
    rows = [json.loads(line) for line in open(ds_dir / "test.jsonl")]
    (tmp_path / "files").mkdir()
    with open(tmp_path / "files" / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert utils.data.load_split(str(tmp_path / "files"), "train")["prompt"] == [r["prompt"] for r in rows]
    utils.data.load_split(str(ds_dir), "test").to_parquet(str(tmp_path / "t.parquet"))
    assert utils.data.load_split(str(tmp_path / "t.parquet"), "t")["prompt"] == [r["prompt"] for r in rows]
    with pytest.raises(ValueError, match=r"no split 'nope'.*'sft'"):
        utils.data.load_split(str(ds_dir), "nope")
    with pytest.raises(ValueError, match="does not exist"):
        utils.data.load_split(str(tmp_path / "missing"), "train")
    (tmp_path / "files" / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        utils.data.load_split(str(tmp_path / "files"), "empty")
    with pytest.raises(ValueError, match="without network pass a save_to_disk directory"):
        utils.data.load_split("some-org/some-dataset-that-is-not-here", "train")


def test_from_pretrained_errors(world, tmp_path):
    from transformers import AutoModelForCausalLM

    assert (
        utils.loading.from_pretrained(AutoModelForCausalLM, str(world / "policy"), "--model_name_or_path")
        is not None
    )
    with pytest.raises(ValueError, match="--model_name_or_path .* does not exist"):
        utils.loading.from_pretrained(AutoModelForCausalLM, str(tmp_path / "nope"), "--model_name_or_path")
    with pytest.raises(ValueError, match="pass a local directory"):
        utils.loading.from_pretrained(
            AutoModelForCausalLM, "EleutherAI/pythia-not-here", "--model_name_or_path"
        )


def test_model_flags_reach_every_load(monkeypatch, capsys):
    """From the command line to from_pretrained: --trust_remote_code goes to every load, --model_revision to the
    loads of --model_name_or_path, --attn_implementation to the trained model's (here --sft_model_path) and
    never to a tokenizer; an attention transformers cannot import is one sentence."""
    import rloo

    calls = []

    class FakeModel:
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            calls.append((cls.__name__, path, kwargs))
            return cls()

    class FakeTokenizer(FakeModel):
        pass

    class FlashModel:
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            raise ImportError("FlashAttention2 has been toggled on, but it cannot be used:\nno package.")

    monkeypatch.setattr(utils.loading, "MODEL_FLAGS", utils.loading.ModelFlags())  # restored afterwards
    argv = ["--model_name_or_path", "org/tok", "--sft_model_path", "org/sft", "--model_revision", "v2",
            "--trust_remote_code", "--attn_implementation", "eager"]  # fmt: skip
    utils.loading.use_model_flags(utils.run.parse_args(rloo.Args, argv))
    utils.loading.from_pretrained(FakeTokenizer, "org/tok", "--model_name_or_path")
    utils.loading.from_pretrained(FakeModel, "org/sft", "--sft_model_path")
    utils.loading.from_pretrained(FakeModel, "org/reward", "--reward_model_path")
    assert calls == [
        ("FakeTokenizer", "org/tok", {"trust_remote_code": True, "revision": "v2"}),
        ("FakeModel", "org/sft", {"trust_remote_code": True, "attn_implementation": "eager"}),
        ("FakeModel", "org/reward", {"trust_remote_code": True}),
    ]
    with pytest.raises(ValueError, match=r"^--attn_implementation eager cannot load --sft_model_path org/sft: "
                       r"FlashAttention2 has been toggled on, but it cannot be used: no package\.$"):  # fmt: skip
        utils.loading.from_pretrained(FlashModel, "org/sft", "--sft_model_path")
    utils.loading.use_model_flags(
        utils.run.parse_args(rloo.Args, ["--sft_model_path", "/x", "--model_revision", "v2"])
    )
    assert utils.loading.load_kwargs(FakeModel, "/x") == {}
    assert capsys.readouterr().out == "--model_revision v2 is ignored: it applies to --model_name_or_path\n"


@pytest.mark.parametrize(
    "script", ["sft", "reward", "dpo", "ilql", "grpo", "online_dpo", "ppo", "rloo", "ddpo"]
)
def test_every_script_takes_the_model_flags(script, monkeypatch):
    """TRL's --model_revision, --trust_remote_code and --attn_implementation are flags of every script (ddpo.py:
    the first two), and setup() hands them to utils.loading before it does anything else."""
    import importlib

    module = importlib.import_module(script)
    model_flags = {"model_revision", "trust_remote_code"} | (
        {"attn_implementation"} if script != "ddpo" else set()
    )
    assert model_flags <= utils.cli.known_flags(module.Args)
    if script == "ddpo":
        return  # its pipeline and CLIP loads take the flags directly

    class Called(Exception):
        pass

    def called(args):
        raise Called

    monkeypatch.setattr(utils.loading, "use_model_flags", called)
    with pytest.raises(Called):
        module.setup(module.Args())


def test_attn_implementation_reaches_the_trained_policy(world, tmp_path, monkeypatch, capsys):
    """sft.py --attn_implementation eager: the policy of setup() runs eager attention (the tiny world's default
    is sdpa); --model_revision of a local folder is one line saying it is ignored."""
    import sft

    monkeypatch.setattr(utils.loading, "MODEL_FLAGS", utils.loading.ModelFlags())  # restored afterwards
    argv = ["--model_name_or_path", str(world / "policy"), "--dataset_name", str(world / "dataset"),
            "--dataset_train_split", "sft", "--eval_strategy", "no", "--output_dir", str(tmp_path / "out"),
            "--logging_dir", str(tmp_path / "runs"), "--attn_implementation", "eager", "--model_revision", "v2"]  # fmt: skip
    run = sft.setup(utils.run.parse_args(sft.Args, argv))
    run.tracker.close()
    assert run.accelerator.unwrap_model(run.policy).config._attn_implementation == "eager"
    assert (
        f"--model_revision v2 is ignored: --model_name_or_path {world / 'policy'} is a local folder"
        in capsys.readouterr().out
    )


def test_reward_fn_loading_and_checks(tmp_path):
    path = tmp_path / "rf.py"
    path.write_text(
        "def length(prompts, completions):\n    return [len(c) for c in completions]\n"
        "def short(prompts, completions):\n    return [1.0]\n"
        "def nan(prompts, completions):\n    return [float('nan')] * len(completions)\n"
    )
    fn = utils.reward_funcs.load_reward_fn(f"{path}:length")
    assert utils.reward_funcs.call_reward_fn(fn, ["p", "q"], ["ab", "c"]).tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match="returned 1 values for 2"):
        utils.reward_funcs.call_reward_fn(
            utils.reward_funcs.load_reward_fn(f"{path}:short"), ["p", "q"], ["a", "b"]
        )
    nan = utils.reward_funcs.call_reward_fn(
        utils.reward_funcs.load_reward_fn(f"{path}:nan"), ["p"], ["a"]
    )  # the scripts' guard stops
    assert nan.isnan().all()
    with pytest.raises(ValueError, match="does not exist"):
        utils.reward_funcs.load_reward_fn(f"{tmp_path}/missing.py:f")
    with pytest.raises(ValueError, match="no function named 'g'"):
        utils.reward_funcs.load_reward_fn(f"{path}:g")
    with pytest.raises(ValueError, match="must look like"):
        utils.reward_funcs.load_reward_fn("no_colon")


def test_a_reward_fn_scores_the_truncated_completion(tiny_models, tmp_path):
    tok = tiny_models[0]
    path = tmp_path / "rf.py"
    path.write_text(
        "def count_dog(prompts, completions):\n    return [c.split().count('dog') for c in completions]\n"
    )
    fn = utils.reward_funcs.load_reward_fn(f"{path}:count_dog")
    queries, qmask = left_padded_queries(tok, ["POST: dog\n\nTL;DR:", "TL;DR:"])
    dog, eos = tok(" dog")["input_ids"][0], tok.eos_token_id
    responses = torch.tensor([[dog, dog, eos, dog], [dog, eos, dog, dog]])
    truncated, lengths = utils.generation.truncate_response(responses, eos, tok.pad_token_id)
    qr = torch.cat([queries, truncated], 1)
    am = torch.cat([qmask, utils.generation.lengths_to_mask(lengths, 4)], 1)
    scores = utils.reward_funcs.score_decoded(fn, qr, am, queries.size(1), tok)
    assert scores.tolist() == [2.0, 1.0]  # the dogs after the EOS do not count


def test_write_model_card(tmp_path):
    utils.saving.write_model_card(
        str(tmp_path), "RLOO", "base/model", "data", {"objective/scores": 0.5, "episode": 10}
    )
    text = (tmp_path / "README.md").read_text()
    assert (
        "RLOO" in text and "base/model" in text and "| objective/scores | 0.5 |" in text and "python" in text
    )


def test_scores_include_the_stored_normalization_shift(tiny_models):
    tok, _, reward = tiny_models
    seq = torch.tensor(
        [utils.chat.tokenize_prompts(tok, ["POST: dog vet\n\nTL;DR: dog"])[0] + [tok.eos_token_id]]
    )
    mask = torch.ones_like(seq)
    with torch.no_grad():
        plain = utils.reward_model.get_score(reward, seq, mask)
        reward.config.score_bias = -0.25
        try:
            shifted = utils.reward_model.get_score(reward, seq, mask)
        finally:
            reward.config.score_bias = None
    torch.testing.assert_close(shifted, plain - 0.25)


def test_shuffled_micro_batch_covers_each_row_once_per_epoch_on_any_process_count():
    rows, micro, seed = 23, 3, 5
    for world in (1, 2, 3):
        per_epoch = rows // (micro * world)
        for epoch in range(2):
            seen = [
                i
                for m in range(epoch * per_epoch, (epoch + 1) * per_epoch)
                for rank in range(world)
                for i in utils.examples.shuffled_micro_batch(rows, m, micro, world, rank, seed)
            ]
            assert len(seen) == len(set(seen)) == per_epoch * micro * world  # no row twice, tail dropped
            expected = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            assert seen == expected[: len(seen)]  # the epoch's seeded order, cut into process slices


def utils_imports() -> dict[str, set[str]]:
    """For each module of utils/, the utils modules it imports (at the top or inside a function)."""
    import ast
    from pathlib import Path

    folder = Path(utils.__file__).parent
    modules = {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}
    graph = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("utils"):
                found |= (
                    {node.module.partition(".")[2]} if "." in node.module else {a.name for a in node.names}
                )
            elif isinstance(node, ast.Import):
                found |= {
                    a.name.partition(".")[2] or "__init__" for a in node.names if a.name.startswith("utils")
                }
        graph[name] = found - {name}
    return graph


def test_no_utils_module_imports_an_optional_one_but_by_name():
    """Imports point down: a core module reaches an optional one only through utils.run.extra_module or
    optional_module (looked up by name, absent in a copy without the file), never by an import statement."""
    from test_footprint import OPTIONAL_MODULES

    optional = {path.removeprefix("utils/").removesuffix(".py") for path in OPTIONAL_MODULES}
    for name, targets in utils_imports().items():
        if name not in optional:
            assert not targets & optional, (name, targets & optional)


def module_state(tree) -> set[str]:
    """Module-level names of a module that hold changing state: bound to a list, dict or set (a literal or a
    call), or rebound by a `global` statement. Constants (tuples, strings, numbers, frozensets) are not."""
    import ast

    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            mutable = isinstance(node.value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp)
            if isinstance(node.value, ast.Call):
                called = node.value.func
                mutable = getattr(called, "id", getattr(called, "attr", "")) in {
                    "list",
                    "dict",
                    "set",
                    "defaultdict",
                }
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name) and mutable}
    names |= {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    return names


def test_no_module_state_is_shared_between_utils_modules():
    """A run's changing state lives on its objects (the checkpointer, the tracker) or inside the one module
    that owns it: no utils module reads or writes another's module-level lists, dicts, sets or globals."""
    import ast

    from conftest import ROOT

    trees = {path.stem: ast.parse(path.read_text()) for path in sorted((ROOT / "utils").glob("*.py"))}
    state = {name: module_state(tree) for name, tree in trees.items()}
    assert "_RECEIVED" in state["signals"] and "MODEL_FLAGS" in state["loading"]  # the check sees state
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("utils."):
                owner = node.module.removeprefix("utils.")
                shared = {alias.name for alias in node.names} & state.get(owner, set())
                assert not shared, f"utils/{name}.py imports utils/{owner}.py's state {shared}"
            if isinstance(node, ast.Attribute) and node.attr in set().union(*state.values()):
                owners = [o for o, names in state.items() if node.attr in names and o != name]
                base = node.value
                base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                assert base_name not in owners, f"utils/{name}.py uses {base_name}.{node.attr}"


def test_utils_modules_form_no_import_circle():
    graph = utils_imports()
    assert all(targets <= set(graph) for targets in graph.values()), (
        graph
    )  # no module imports the package itself
    done, visiting = set(), []

    def visit(name):
        assert name not in visiting, f"import circle: {' -> '.join(visiting + [name])}"
        if name not in done:
            visiting.append(name)
            for target in graph[name]:
                visit(target)
            visiting.pop()
            done.add(name)

    for name in graph:
        visit(name)


def test_dropout_is_off_in_training_and_kept_in_the_saved_config(tmp_path):
    """disable_dropout zeroes the modules' and the config's dropout (some models read the config in forward);
    a model saved inside config_dropout_kept keeps the config's values, and training goes on without dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, attention_dropout=0.1)  # fmt: skip
    model = LlamaForCausalLM(config)
    utils.loading.disable_dropout(model)
    utils.loading.disable_dropout(model)  # twice (a reference sharing the config): the first values are kept
    assert model.config.attention_dropout == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    with utils.loading.config_dropout_kept(model):
        model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attention_dropout"] == 0.1
    assert model.config.attention_dropout == 0.0


def test_mean_by_key_averages_the_window_as_trls_loggers():
    """Each key over the steps that logged it; with skip_nan (TRL's GRPO) a NaN step is left out, NaN only when
    every step was NaN; without it (TRL's online DPO) a NaN stays in the mean."""
    window = [{"a": 1.0, "b": math.nan}, {"a": 3.0, "b": 2.0, "c": math.nan}, {"a": math.nan}]
    assert utils.tracking.mean_by_key(window[:2]) == {"a": 2.0, "b": pytest.approx(math.nan, nan_ok=True),
                                                      "c": pytest.approx(math.nan, nan_ok=True)}  # fmt: skip
    skipped = utils.tracking.mean_by_key(window, skip_nan=True)
    assert skipped["a"] == 2.0 and skipped["b"] == 2.0 and math.isnan(skipped["c"])


def test_an_optional_module_missing_the_optional_file_it_builds_on_names_that_file(tmp_path):
    """A copy with utils/tools.py but without utils/reward_funcs.py, which tools.py imports: asked for --tools,
    one sentence names reward_funcs.py; a missing library is still the library's own ImportError."""
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("")
    (tmp_path / "utils" / "run.py").write_text((ROOT / "utils" / "run.py").read_text())
    (tmp_path / "utils" / "tools.py").write_text("import utils.reward_funcs\n")
    (tmp_path / "utils" / "vllm.py").write_text("import a_library_not_installed\n")
    code = (
        "import utils.run\n"
        "for name, flag in [('utils.tools', '--tools'), ('utils.vllm', '--use_vllm')]:\n"
        "    try:\n"
        "        utils.run.optional_module(name, flag)\n"
        "    except Exception as error:\n"
        "        print(type(error).__name__, error)\n"
    )
    lines = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.splitlines()  # fmt: skip
    assert lines[0].startswith("UsageError --tools needs utils/reward_funcs.py, which this copy lacks"), lines
    assert lines[1] == "ModuleNotFoundError No module named 'a_library_not_installed'", lines
