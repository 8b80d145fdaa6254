"""A conversational reward model is trained and scored at the same token: reward rows are TRL 1.16
RewardTrainer's ids (the chat template's whole rendering, its newline after the end of turn included), and
RewardScorer encodes a sampled prompt + completion to those same ids."""

import pytest
import torch

import utils.scoring as scoring
from utils import chat, data, examples, reward_model

ROWS = 12


@pytest.fixture(scope="module")
def chat_tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "tokenizer_chat")


def chat_split(world, config):
    return data.load_split(str(world / "dataset_chat"), "test", config).select(range(ROWS))


def trl_ids(world, tokenizer, dataset, tmp_path):
    """(chosen_ids, rejected_ids) of TRL's RewardTrainer on `dataset`, as its own preprocessing makes them."""
    import trl
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(world / "reward_chat", num_labels=1)
    config = trl.RewardConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False)
    trainer = trl.RewardTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    rows = trainer.train_dataset
    return rows["chosen_ids"], rows["rejected_ids"]


@pytest.mark.parametrize("config", ["preference", "implicit_prompt_preference"])
def test_conversational_reward_rows_are_trl_reward_trainers_ids(world, chat_tokenizer, config, tmp_path):
    dataset = chat_split(world, config)
    chosen_ids, rejected_ids = trl_ids(world, chat_tokenizer, dataset, tmp_path)
    ids = examples.reward_ids(dataset, chat_tokenizer, "d", ["chosen", "rejected"])
    assert [p + c for p, c in zip(ids["prompt"], ids["chosen"])] == chosen_ids
    assert [p + r for p, r in zip(ids["prompt"], ids["rejected"])] == rejected_ids
    # the template's newline after <|im_end|> is kept, where DPO's rows (end_at_eos) stop at the EOS
    eos, newline = chat_tokenizer.eos_token_id, chat_tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert all(row[-1 - len(newline)] == eos and row[-len(newline) :] == newline for row in chosen_ids)
    dpo_chosen = examples.preference_texts(dataset, chat_tokenizer, "d")["chosen"]
    assert all(text.endswith("<|im_end|>") for text in dpo_chosen)
    # the prompt ends where the assistant's turn opens, the same for chosen and rejected
    assert all(chat_tokenizer.decode(p).endswith("<|im_start|>assistant\n") for p in ids["prompt"])


def test_standard_reward_rows_end_with_eos(world, chat_tokenizer):
    """Standard text keeps its rows: the prompt, then the completion with one EOS at its end."""
    dataset = data.load_split(str(world / "dataset"), "preference").select(range(ROWS))
    ids = examples.reward_ids(dataset, chat_tokenizer, "d", ["chosen", "rejected"])
    encode = lambda texts: chat_tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids["prompt"] == encode(data.column(dataset, "prompt"))
    assert ids["chosen"] == [
        row + [chat_tokenizer.eos_token_id] for row in encode(data.column(dataset, "chosen"))
    ]


def test_the_scorer_reads_a_conversation_where_reward_training_read_it(world, chat_tokenizer):
    """A policy's sampled completion of a conversational prompt, scored through RewardScorer, gives the reward
    model the ids reward training used for the same prompt + completion, so the score is read at the same token."""
    from transformers import AutoModelForSequenceClassification

    dataset = chat_split(world, "preference")
    ids = examples.reward_ids(dataset, chat_tokenizer, "d", ["chosen", "rejected"])
    prompts, chosen = data.column(dataset, "prompt"), data.column(dataset, "chosen")
    assert all(len(c) == 1 and c[0]["role"] == "assistant" for c in chosen)
    # the policy's rows: its rendered prompt, left-padded, then the sampled content and its EOS
    queries = chat.encode(chat_tokenizer, [chat.render(chat_tokenizer, p, True) for p in prompts], True)
    responses = [
        chat_tokenizer(c[0]["content"], add_special_tokens=False)["input_ids"] + [chat_tokenizer.eos_token_id]
        for c in chosen
    ]
    context_length = max(map(len, queries))
    width = context_length + max(map(len, responses))
    pad = chat_tokenizer.pad_token_id
    rows, masks = [], []
    for q, r in zip(queries, responses):
        left, right = context_length - len(q), width - context_length - len(r)
        rows.append([pad] * left + q + r + [pad] * right)
        masks.append([0] * left + [1] * (len(q) + len(r)) + [0] * right)
    query_responses, attention_mask = torch.tensor(rows), torch.tensor(masks)

    model = AutoModelForSequenceClassification.from_pretrained(world / "reward_chat", num_labels=1).eval()
    scorer = scoring.RewardScorer(model, chat_tokenizer, chat_tokenizer)
    encoded = scorer.encode(query_responses, attention_mask, context_length, prompts)
    trained = [p + c for p, c in zip(ids["prompt"], ids["chosen"])]
    assert encoded == trained
    with torch.no_grad():
        scores = scorer(query_responses, attention_mask, context_length, 4, prompts=prompts)
        one_by_one = [
            reward_model.get_score(model, torch.tensor([t]), torch.ones(1, len(t))).item() for t in trained
        ]
    torch.testing.assert_close(scores, torch.tensor(one_by_one), rtol=0, atol=1e-5)
    # reading one token earlier (the EOS, where rows cut at the EOS end) gives other scores
    with torch.no_grad():
        at_eos = [
            reward_model.get_score(model, torch.tensor([t[:-1]]), torch.ones(1, len(t) - 1)).item()
            for t in trained
        ]
    assert not torch.allclose(scores, torch.tensor(at_eos))


def test_reward_py_trains_on_trl_reward_trainers_ids(world, chat_tokenizer, tmp_path):
    import reward

    dataset = chat_split(world, "preference")
    chosen_ids, rejected_ids = trl_ids(world, chat_tokenizer, dataset, tmp_path)
    rows, _, _ = reward.tokenize_rows(chat_tokenizer, dataset, [reward.CHOSEN, reward.REJECTED], 4096)
    assert [row["sequences"] for row in rows] == [list(pair) for pair in zip(chosen_ids, rejected_ids)]
