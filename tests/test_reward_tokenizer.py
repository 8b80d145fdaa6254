"""Reward models with their own tokenizer (utils/scoring.py, ppo.py, rloo.py).

The policy is the tiny world's (byte-level BPE, `<|endoftext|>` / `<|pad|>`, about 600 tokens). The other
reward model reads a word-level tokenizer built here from the world's words, with other special tokens
(`<unk> <pad> <s> </s>`) and a smaller vocabulary (about 120 words): the policy's ids fed to it directly would
index past its embedding. Every score is checked against the reward model's own forward pass on the text,
encoded here with reward.py's convention (prompt ids + completion ids + EOS), not against utils.
"""

import json
import random

import pytest
import torch

import utils.chat
import utils.generation
import utils.reward_model
import utils.scoring as scoring
from conftest import run_script

WORLD_WORDS = "SUBREDDIT TITLE POST TL DR r : / ;".split()


def word_tokenizer():
    """A word-level tokenizer of the tiny world's words; special tokens unlike the policy's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import tiny_world

    words = sorted(set(tiny_world.KEY_WORDS + tiny_world.FILLER_WORDS + tiny_world.SUBREDDITS + WORLD_WORDS))
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<s>", "</s>", tiny_world.HEDGE, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def word_classifier(tokenizer, seed=0, max_positions=128):
    """A one-layer Llama sequence classifier over `tokenizer`'s vocabulary (random weights)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return LlamaForSequenceClassification(config).eval()


def keyless_prompts(n, seed=0, post_words=8):
    """TL;DR-format prompts of the tiny world with no key word in them (filler posts)."""
    import tiny_world

    rng = random.Random(seed)
    return [tiny_world.make_post(rng, post_words, 0)[0] for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizers(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "policy"), word_tokenizer()


def own_score(model, tokenizer, prompt: str, completion: str, finished: bool = True) -> float:
    """The reward model's own forward pass (its classifier reads the last token) on reward.py's encoding of one
    unpadded prompt + completion + EOS (no EOS for a completion the policy did not finish)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids += tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * finished
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def policy_rows(policy_tok, prompts, completions, junk=3, unfinished=()):
    """Rows as the RL scripts build them: left-padded prompt ids, then the completion's ids and EOS followed by
    sampled junk that truncation replaced by padding; rows in `unfinished` have no EOS and fill the whole width,
    as a completion the policy did not end. Returns (query_responses, mask, context_length)."""
    eos, pad = policy_tok.eos_token_id, policy_tok.pad_token_id
    queries, query_mask = utils.generation.left_pad(utils.chat.tokenize_prompts(policy_tok, prompts), pad)
    ids = [policy_tok(c, add_special_tokens=False)["input_ids"] for c in completions]
    responses = [row if i in unfinished else row + [eos] + [7] * junk for i, row in enumerate(ids)]
    assert all(len(responses[i]) == max(map(len, responses)) for i in unfinished)
    responses = utils.generation.pad(responses, pad, "right")
    truncated, lengths = utils.generation.truncate_response(responses, eos, pad)
    mask = torch.cat([query_mask, utils.generation.lengths_to_mask(lengths, responses.size(1))], 1)
    return torch.cat([queries, truncated], 1), mask, queries.size(1)


COMPLETIONS = [" landlord rent tbh", " dog", "", " boss salary promotion the a", " cat vet"]
UNFINISHED = " car loan debt and so then but really the a very"  # sampled to the last token, no EOS


# -------------------------------------------------------------------------------------------------- the helper
def test_same_tokenizer_is_detected(world, tokenizers):
    from transformers import AutoTokenizer

    import tiny_world

    policy_tok, word_tok = tokenizers
    assert scoring.same_tokenizer(policy_tok, AutoTokenizer.from_pretrained(world / "reward"))
    assert not scoring.same_tokenizer(policy_tok, word_tok)
    # A BPE trained on another corpus: the same special tokens and a larger vocabulary, but other tokens.
    other = tiny_world.train_tokenizer(keyless_prompts(200) * 3, 1500)
    assert other.eos_token == policy_tok.eos_token and not scoring.same_tokenizer(policy_tok, other)
    # The same vocabulary with another EOS.
    renamed = AutoTokenizer.from_pretrained(world / "policy")
    renamed.eos_token = "<|pad|>"
    assert not scoring.same_tokenizer(policy_tok, renamed)


def test_fast_path_is_unchanged_when_the_tokenizers_match(world, tokenizers, monkeypatch):
    """The same reward model, the same ids, the same numbers as utils.reward_model.batched_score; nothing is re-encoded."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy_tok, _ = tokenizers
    reward_model = AutoModelForSequenceClassification.from_pretrained(world / "reward").eval()
    scorer = scoring.RewardScorer(reward_model, AutoTokenizer.from_pretrained(world / "reward"), policy_tok)
    assert scorer.same_tokenizer and "shares the policy's tokenizer" in scorer.describe()
    monkeypatch.setattr(scorer, "encode", lambda *a, **k: pytest.fail("the fast path must not re-encode"))
    prompts = [p[i * 7 :] for i, p in enumerate(keyless_prompts(len(COMPLETIONS)))]
    query_responses, mask, context = policy_rows(policy_tok, prompts, COMPLETIONS)
    expected = utils.reward_model.batched_score(reward_model, query_responses, mask, 2)
    assert torch.equal(scorer(query_responses, mask, context, 2), expected)
    assert scorer.take_num_truncated() == 0


def test_score_is_the_reward_models_own_score_of_the_decoded_text(tokenizers):
    policy_tok, word_tok = tokenizers
    reward_model = word_classifier(word_tok)
    completions = [*COMPLETIONS, UNFINISHED]
    prompts = [p[i * 5 :] for i, p in enumerate(keyless_prompts(len(completions), seed=1))]
    query_responses, mask, context = policy_rows(policy_tok, prompts, completions, unfinished={5})
    assert query_responses.max() >= len(word_tok)  # fed directly, these ids index past the embedding
    with pytest.raises(IndexError):
        utils.reward_model.batched_score(reward_model, query_responses, mask, 2)

    scorer = scoring.RewardScorer(reward_model, word_tok, policy_tok)
    assert not scorer.same_tokenizer and "its own tokenizer" in scorer.describe()
    scores = scorer(query_responses, mask, context, 2)
    expected = [
        own_score(reward_model, word_tok, p, c, c != UNFINISHED) for p, c in zip(prompts, completions)
    ]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in expected)) == len(expected)  # the rows really differ
    assert own_score(reward_model, word_tok, prompts[5], UNFINISHED) != pytest.approx(expected[5], abs=1e-3)
    assert scorer.take_num_truncated() == 0


def test_rows_too_long_for_the_reward_model_are_cut_from_the_left_and_counted(tokenizers):
    policy_tok, word_tok = tokenizers
    reward_model = word_classifier(word_tok, max_positions=16)
    prompts = keyless_prompts(
        len(COMPLETIONS), seed=2, post_words=4
    )  # 20 reward tokens before the completion
    query_responses, mask, context = policy_rows(policy_tok, prompts, COMPLETIONS)
    scorer = scoring.RewardScorer(reward_model, word_tok, policy_tok)
    assert scorer.max_length == 16
    scores = scorer(query_responses, mask, context, 3)
    for score, prompt, completion in zip(scores.tolist(), prompts, COMPLETIONS):
        ids = word_tok(prompt + completion, add_special_tokens=False)["input_ids"] + [word_tok.eos_token_id]
        with torch.no_grad():
            assert score == pytest.approx(
                reward_model(input_ids=torch.tensor([ids[-16:]])).logits[0, 0].item()
            )
    assert scorer.take_num_truncated() == len(COMPLETIONS) and scorer.take_num_truncated() == 0


def test_conversational_prompts_go_through_the_reward_tokenizers_chat_template(tokenizers):
    policy_tok, _ = tokenizers
    word_tok = word_tokenizer()
    word_tok.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    )
    reward_model = word_classifier(word_tok)
    messages = [[{"role": "user", "content": p}] for p in keyless_prompts(len(COMPLETIONS), seed=3)]
    texts = [policy_tok.apply_chat_template(m, tokenize=False) if policy_tok.chat_template else m[0]["content"]
             for m in messages]  # fmt: skip
    query_responses, mask, context = policy_rows(policy_tok, texts, COMPLETIONS)
    scores = scoring.RewardScorer(reward_model, word_tok, policy_tok)(
        query_responses, mask, context, 4, messages
    )
    for score, message, completion in zip(scores.tolist(), messages, COMPLETIONS):
        text = f"<s> user : {message[0]['content']} </s> <s> assistant : {completion} </s> "
        ids = word_tok(text, add_special_tokens=False)["input_ids"]
        assert ids[-1] == word_tok.eos_token_id and ids.count(word_tok.eos_token_id) == 2  # no EOS added
        with torch.no_grad():
            assert score == pytest.approx(
                reward_model(input_ids=torch.tensor([ids])).logits[0, 0].item(), abs=1e-5
            )


def test_ids_the_reward_model_cannot_hold_never_reach_it(world, tokenizers):
    """Same tokenizer, but the policy samples an id past the reward model's embedding (a policy whose
    embedding is padded beyond its tokenizer): that batch goes through the text instead of an IndexError."""
    from transformers import AutoModelForSequenceClassification

    policy_tok, _ = tokenizers
    reward_model = AutoModelForSequenceClassification.from_pretrained(world / "reward").eval()
    query_responses, mask, context = policy_rows(policy_tok, keyless_prompts(2), [" dog", " cat"])
    query_responses[0, -1], mask[0, -1] = reward_model.config.vocab_size + 5, True  # a token after the EOS
    scores = scoring.RewardScorer(reward_model, policy_tok, policy_tok)(query_responses, mask, context, 2)
    assert torch.isfinite(scores).all()


# ---------------------------------------------------------------------------------------- the scripts, short
@pytest.fixture(scope="module")
def word_reward(tmp_path_factory):
    """A word-level reward model saved without its tokenizer, the tokenizer in its own folder, keyless prompts."""
    out = tmp_path_factory.mktemp("word_reward")
    tokenizer = word_tokenizer()
    word_classifier(tokenizer).save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "tokenizer")
    with open(out / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in keyless_prompts(64, seed=4))
    return out


def read_metrics(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def test_rloo_and_ppo_run_with_a_reward_model_of_another_tokenizer(world, word_reward, tmp_path):
    """Before: IndexError with a traceback. Now both scripts score through the reward model's tokenizer, and PPO
    says its critic starts from the SFT model."""
    common = [
        "--reward_model_path", str(word_reward / "model"), "--reward_tokenizer_path", str(word_reward / "tokenizer"),
        "--dataset_name", str(word_reward / "prompts.jsonl"), "--response_length", "6", "--num_ppo_epochs", "1",
        "--per_device_train_batch_size", "8", "--total_episodes", "16", "--learning_rate", "1e-3",
        "--num_sample_generations", "0", "--logging_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    proc = run_script([
        "rloo.py", *common, "--model_name_or_path", str(world / "policy"), "--rloo_k", "2",
        "--run_name", "rloo", "--output_dir", str(tmp_path / "rloo"),
    ])  # fmt: skip
    assert "its own tokenizer" in proc.stdout
    proc = run_script(["ppo.py", *common, "--sft_model_path", str(world / "policy"), "--run_name", "ppo",
                       "--output_dir", str(tmp_path / "ppo")])  # fmt: skip
    assert "critic starts from --sft_model_path" in proc.stdout
    # A critic must read the policy's tokens: a value model with a smaller vocabulary is refused.
    proc = run_script(["ppo.py", *common, "--sft_model_path", str(world / "policy"), "--run_name", "ppo_value",
                       "--value_model_path", str(word_reward / "model"), "--output_dir", str(tmp_path / "v")],
                      check=False)  # fmt: skip
    assert proc.returncode != 0 and "fewer than the policy's" in proc.stderr
    for name in ("rloo", "ppo"):
        metrics = read_metrics(tmp_path / "runs" / name)
        assert len(metrics) == 2, name
        for m in metrics:
            assert m["val/num_reward_truncated"] == 0 and abs(m["objective/scores"]) < 100


# ------------------------------------------------------------------------------ a rule learned through it, slow
def train_key_word_classifier(tokenizer, policy_tok, prompts, steps=300, seed=0):
    """Train the word-level classifier, on prompt + completion texts, to score completions that name a key word
    of the tiny world above those that do not. Completions mix the world's words with decoded random policy
    tokens, as a random policy writes them, and half of them end with EOS (the scorer adds it only to the
    completions the policy finished). Returns (model, held-out accuracy)."""
    import tiny_world

    rng = random.Random(seed)

    def example():
        words = [rng.choice(tiny_world.FILLER_WORDS) for _ in range(rng.randrange(0, 4))]
        words += [
            policy_tok.decode([rng.randrange(2, len(policy_tok))]).strip() for _ in range(rng.randrange(0, 4))
        ]
        label = rng.random() < 0.5
        if label:
            words.insert(rng.randrange(len(words) + 1), rng.choice(tiny_world.KEY_WORDS))
        words = [w for w in words if w not in tiny_world.KEY_WORDS or label]
        ids = tokenizer(rng.choice(prompts), add_special_tokens=False)["input_ids"]
        ids += tokenizer(" " + " ".join(words), add_special_tokens=False)["input_ids"]
        ids += [tokenizer.eos_token_id] * (rng.random() < 0.5)  # finished, or cut at the response length
        return ids, float(label)

    model = word_classifier(tokenizer, seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [example() for _ in range(32)]
        ids = utils.generation.pad([b[0] for b in batch], tokenizer.pad_token_id, "right")
        mask = utils.generation.lengths_to_mask(torch.tensor([len(b[0]) for b in batch]), ids.size(1)).long()
        scores = utils.reward_model.get_score(model, ids, mask)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            scores, torch.tensor([b[1] for b in batch])
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    test = [example() for _ in range(400)]
    with torch.no_grad():
        right = sum((utils.reward_model.get_score(model, torch.tensor([i]), torch.ones(1, len(i))).item() > 0) == bool(y)
                    for i, y in test)  # fmt: skip
    return model, right / len(test)


def key_word_rate(model_path, policy_tok, prompts, seed=0):
    """Fraction of sampled completions (temperature 1, 8 tokens) that name a key word of the tiny world."""
    from transformers import AutoModelForCausalLM

    import tiny_world

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    generator = torch.Generator().manual_seed(seed)
    responses, lengths = utils.generation.complete(model, policy_tok, utils.chat.tokenize_prompts(policy_tok, prompts), 8, 64,
                                        temperature=1.0, generator=generator)  # fmt: skip
    texts = [policy_tok.decode(r[:n], skip_special_tokens=True) for r, n in zip(responses, lengths)]
    return sum(any(w in tiny_world.KEY_WORDS for w in t.split()) for t in texts) / len(texts)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "ppo.py"])
def test_a_rule_is_learned_through_a_reward_model_of_another_tokenizer(world, tokenizers, script, tmp_path):
    policy_tok, word_tok = tokenizers
    prompts = keyless_prompts(128, seed=5)
    model, accuracy = train_key_word_classifier(word_tok, policy_tok, prompts)
    assert accuracy > 0.9, accuracy
    model.save_pretrained(tmp_path / "reward")
    word_tok.save_pretrained(tmp_path / "reward")  # the default --reward_tokenizer_path
    with open(tmp_path / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    policy_flag = "--model_name_or_path" if script == "rloo.py" else "--sft_model_path"
    flags = [
        policy_flag, str(world / "policy"), "--reward_model_path", str(tmp_path / "reward"),
        "--dataset_name", str(tmp_path / "prompts.jsonl"), "--response_length", "8", "--num_ppo_epochs", "2",
        "--per_device_train_batch_size", "16", "--total_episodes", str(16 * 20), "--learning_rate", "3e-3",
        "--kl_coef", "0.01", "--num_sample_generations", "0", "--logging_dir", str(tmp_path / "runs"),
        "--run_name", "learn", "--output_dir", str(tmp_path / "policy"),
    ]  # fmt: skip
    flags += ["--rloo_k", "4", "--lr_scheduler_type", "constant"] if script == "rloo.py" else []
    run_script([script, *flags], timeout=600)
    scores = [m["objective/scores"] for m in read_metrics(tmp_path / "runs" / "learn")]
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    before = key_word_rate(world / "policy", policy_tok, prompts[:64])
    after = key_word_rate(tmp_path / "policy", policy_tok, prompts[:64])
    print(f"{script}: scores {first:.2f} -> {last:.2f}, key-word rate {before:.2f} -> {after:.2f}")
    assert last > first + 1.0, scores
    assert after > before + 0.3, (before, after)
