"""utils.data and the scripts on TRL's dataset formats: types and formats detected, chat templates, implicit
prompts, assistant-only loss masks, the EOS and BOS policy, then each script on standard and conversational
data of the offline world (explicit and implicit prompts) for a few steps."""

import json

import datasets
import pytest

import dpo
import ppo
import reward
import rloo
import sft
import tiny_world
from utils import chat, data, examples

USER, ASSISTANT = "user", "assistant"


def msg(role, content):
    return {"role": role, "content": content}


@pytest.fixture(scope="module")
def chat_tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "tokenizer_chat")


@pytest.fixture(scope="module")
def plain_tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "tokenizer")


# ----------------------------------------------------------------------------------------------------------------
# Formats, prompts, templates
# ----------------------------------------------------------------------------------------------------------------
def test_every_type_and_format_is_detected_and_extra_columns_are_ignored():
    conv = [msg(USER, "hi")]
    cases = [
        ({"text": ["a"]}, ("language_modeling", False)),
        ({"messages": [conv + [msg(ASSISTANT, "yo")]]}, ("language_modeling", True)),
        ({"prompt": ["a"]}, ("prompt_only", False)),
        ({"prompt": [conv]}, ("prompt_only", True)),
        ({"prompt": ["a"], "completion": [" b"]}, ("prompt_completion", False)),
        ({"prompt": [conv], "completion": [[msg(ASSISTANT, "b")]]}, ("prompt_completion", True)),
        ({"prompt": ["a"], "chosen": [" b"], "rejected": [" c"]}, ("preference", False)),
        ({"chosen": ["a b"], "rejected": ["a c"]}, ("implicit_preference", False)),
        ({"chosen": [conv + [msg(ASSISTANT, "b")]], "rejected": [conv + [msg(ASSISTANT, "c")]]},
         ("implicit_preference", True)),
    ]  # fmt: skip
    for columns, expected in cases:
        extra = {"score_chosen": [7.0], "source": ["x"]}  # ignored, as in UltraFeedback or Capybara
        assert data.detect_format(datasets.Dataset.from_dict({**columns, **extra}), "d") == expected
    custom = datasets.Dataset.from_dict({"body": ["a"]})
    assert data.detect_format(custom, "d", text_field="body") == ("language_modeling", False)
    with pytest.raises(ValueError, match=r"matches none of TRL's dataset types .* found columns \['body'\]"):
        data.detect_format(custom, "split 'x'")
    mixed = datasets.Dataset.from_dict({"prompt": ["a"], "completion": [[msg(ASSISTANT, "b")]]})
    with pytest.raises(ValueError, match="must all be strings .* or all lists"):
        data.detect_format(mixed, "d")
    pairs = datasets.Dataset.from_dict({"prompt": ["a"], "rejected": [" c"]})
    with pytest.raises(ValueError, match=r"missing column\(s\) \['chosen'\]: expected \['prompt', 'chosen'"):
        examples.preference_texts(pairs, None, "split 'x'")


def test_shared_prefix_of_implicit_prompts():
    assert examples.shared_prefix("The sky is blue.", "The sky is green.") == (
        "The sky is",
        " blue.",
        " green.",
    )
    # a shared first letter of the differing word stays with the completions
    assert examples.shared_prefix("The sky is blue.", "The sky is bright.") == (
        "The sky is",
        " blue.",
        " bright.",
    )
    assert examples.shared_prefix("TL;DR: dog vet", "TL;DR: dog cat") == ("TL;DR: dog", " vet", " cat")
    q = [msg("system", "s"), msg(USER, "u")]
    chosen, rejected = q + [msg(ASSISTANT, "a")], q + [msg(ASSISTANT, "b")]
    assert examples.shared_prefix(chosen, rejected) == (q, [msg(ASSISTANT, "a")], [msg(ASSISTANT, "b")])
    with pytest.raises(ValueError, match="must share a beginning"):
        examples.shared_prefix("blue", "green")
    with pytest.raises(ValueError, match="completion that is empty"):
        examples.shared_prefix(chosen, chosen)


def test_rendering_splits_a_conversation_into_prompt_and_completion(chat_tokenizer):
    prompt, completion = [msg(USER, "dog vet")], [msg(ASSISTANT, "dog")]
    prompt_text, completion_text = chat.split_rendering(chat_tokenizer, prompt, completion)
    assert prompt_text == "<|im_start|>user\ndog vet<|im_end|>\n<|im_start|>assistant\n"
    # the completion ends at the EOS (<|im_end|>): the template's newline after it is dropped
    assert completion_text == "dog<|im_end|>" and chat_tokenizer.eos_token == "<|im_end|>"
    whole = chat_tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    assert (prompt_text + completion_text).rstrip() == whole.rstrip()
    rendered = data.prompt_texts(
        datasets.Dataset.from_dict({"prompt": [prompt], "n": [1]}), chat_tokenizer, "d"
    )
    assert rendered == [prompt_text]


def test_conversational_data_needs_a_chat_template(world, plain_tokenizer):
    rows = datasets.Dataset.from_dict({"prompt": [[msg(USER, "hi")]]})
    with pytest.raises(
        ValueError, match="split 'x' is conversational but the tokenizer has no chat template"
    ):
        data.prompt_texts(rows, plain_tokenizer, "split 'x'")
    tokenizer = plain_tokenizer.__class__.from_pretrained(world / "tokenizer")
    chat.set_chat_template(tokenizer, str(world / "chat_template.jinja"))  # a Jinja file
    assert data.prompt_texts(rows, tokenizer, "d") == [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ]
    chat.set_chat_template(tokenizer, str(world / "tokenizer_chat"))  # a tokenizer directory
    assert tokenizer.chat_template == tiny_world.CHAT_TEMPLATE
    with pytest.raises(ValueError, match="--chat_template_path .* does not exist"):
        chat.set_chat_template(tokenizer, str(world / "nope.jinja"))


def assistant_tokens_by_search(tokenizer, messages):
    """Independent reference: the tokens of every assistant content and its <|im_end|>, found by locating each
    assistant turn in the rendered text (not by rendering turn by turn)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False).rstrip()
    expected, start = [], 0
    for m in messages:
        opening = f"<|im_start|>{m['role']}\n"
        start = text.index(opening, start) + len(opening)
        end = text.index("<|im_end|>", start) + len("<|im_end|>")
        if m["role"] == ASSISTANT:
            expected += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        start = end
    return expected


def test_multi_turn_sft_puts_the_loss_on_assistant_turns_only(chat_tokenizer):
    conversation = [
        msg("system", "Summarize the post in a few words."), msg(USER, "POST: my dog saw the vet TL;DR:"),
        msg(ASSISTANT, "dog vet tbh"), msg(USER, "Only the first fact?"), msg(ASSISTANT, "dog"),
    ]  # fmt: skip
    rows = datasets.Dataset.from_dict({"messages": [conversation], "source": ["extra"]})
    kind, [(ids, mask)] = examples.sft_examples(rows, chat_tokenizer, "d", assistant_only_loss=True)
    whole = chat_tokenizer(
        chat_tokenizer.apply_chat_template(conversation, tokenize=False).rstrip(), add_special_tokens=False
    )["input_ids"]
    assert kind == "language_modeling" and ids == whole and ids[-1] == chat_tokenizer.eos_token_id
    assert [t for t, m in zip(ids, mask) if m] == assistant_tokens_by_search(chat_tokenizer, conversation)
    assert chat_tokenizer.decode([t for t, m in zip(ids, mask) if m]).split("<|im_end|>")[:2] == [
        "dog vet tbh", "dog"]  # fmt: skip
    _, [(ids_all, mask_all)] = examples.sft_examples(rows, chat_tokenizer, "d")
    assert ids_all == ids and all(mask_all)
    # conversational prompt-completion: the prompt never carries loss; the completion's assistant turns do
    pairs = datasets.Dataset.from_dict({"prompt": [conversation[:2]], "completion": [conversation[2:]]})
    _, [(prompt_ids, completion_ids, completion_mask)] = examples.sft_examples(
        pairs, chat_tokenizer, "d", assistant_only_loss=True
    )
    assert prompt_ids + completion_ids == ids and completion_mask == mask[len(prompt_ids) :]
    with pytest.raises(ValueError, match="--assistant_only_loss needs conversational data"):
        examples.sft_examples(
            datasets.Dataset.from_dict({"text": ["a"]}), chat_tokenizer, "d", assistant_only_loss=True
        )


def test_eos_and_bos_follow_the_tokenizer(world, plain_tokenizer):
    from tokenizers import processors
    from transformers import AutoTokenizer

    rows = datasets.Dataset.from_dict({"prompt": [" so then"], "completion": [" dog<|endoftext|>"]})
    _, [(prompt_ids, completion_ids, _)] = examples.sft_examples(rows, plain_tokenizer, "d")
    eos = plain_tokenizer.eos_token_id
    assert completion_ids.count(eos) == 1 and completion_ids[-1] == eos  # data carrying its EOS keeps one
    assert not chat.adds_bos(plain_tokenizer) and prompt_ids == plain_tokenizer(" so then")["input_ids"]
    bos_tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer")
    bos_tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eos)]
    )
    assert chat.adds_bos(bos_tokenizer)
    ids = chat.encode(bos_tokenizer, [" so", "<|endoftext|> so"], leading=True)
    assert ids[0][0] == eos and ids[0][1:] == ids[1][1:] and ids[1].count(eos) == 1  # one BOS, never two
    assert chat.encode(bos_tokenizer, [" so"], leading=False)[0] == plain_tokenizer(" so")["input_ids"]
    tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer_chat")
    chat.set_eos_token(tokenizer, "<|endoftext|>")
    assert tokenizer.eos_token_id == eos
    with pytest.raises(ValueError, match="--eos_token '<\\|nope\\|>' is not a token"):
        chat.set_eos_token(tokenizer, "<|nope|>")


def test_the_chat_world(world, chat_tokenizer, plain_tokenizer):
    assert (
        chat_tokenizer.eos_token == "<|im_end|>" and chat_tokenizer.chat_template == tiny_world.CHAT_TEMPLATE
    )
    assert plain_tokenizer.chat_template is None  # the standard artifacts stay as they were
    for name in ("policy_chat", "reward_chat"):
        assert json.loads((world / name / "config.json").read_text())["vocab_size"] == len(chat_tokenizer)
    assert (world / "chat_template.jinja").read_text() == tiny_world.CHAT_TEMPLATE
    folders = {p.name for p in (world / "dataset_chat").iterdir()}
    assert folders == {"language_modeling", "prompt_completion", "prompt_only", "preference",
                       "implicit_prompt_preference"}  # fmt: skip
    messages = data.load_split(str(world / "dataset_chat"), "train", "language_modeling")["messages"]
    assert [len(m) for m in messages[:2]] == [5, 3]  # every other conversation has a second exchange


def test_dataset_config_selects_a_local_configuration(world):
    split = data.load_split(str(world / "dataset_chat"), "test", "prompt_only")
    assert data.detect_format(split, "d") == ("prompt_only", True)
    with pytest.raises(
        ValueError, match=r"has no configuration 'nope' \(--dataset_config\); found \['implicit"
    ):
        data.load_split(str(world / "dataset_chat"), "train", "nope")


def test_explicit_and_implicit_conversational_preferences_give_the_same_texts(world, chat_tokenizer):
    explicit = data.load_split(str(world / "dataset_chat"), "test", "preference").select(range(20))
    implicit = data.load_split(str(world / "dataset_chat"), "test", "implicit_prompt_preference").select(
        range(20)
    )
    texts = examples.preference_texts(explicit, chat_tokenizer, "d")
    assert texts == examples.preference_texts(implicit, chat_tokenizer, "d")
    assert all(t.endswith("<|im_end|>") for t in texts["chosen"] + texts["rejected"])
    assert all(p.endswith("<|im_start|>assistant\n") for p in texts["prompt"])


# ----------------------------------------------------------------------------------------------------------------
# The scripts on each format (in process, a few steps each)
# ----------------------------------------------------------------------------------------------------------------
def chat_data(world, config):
    return {"dataset_name": str(world / "dataset_chat"), "dataset_config": config}


def common(tmp_path, name):
    return {"output_dir": str(tmp_path / name), "logging_dir": str(tmp_path / "runs"), "run_name": name}


def standard_implicit_pairs(world, tmp_path):
    """The world's standard preference pairs with the prompt folded into chosen and rejected (rows whose
    completions start with the same word would move that word into the prompt, so only others are kept)."""
    rows = []
    for split, out in (("preference", "train"), ("preference_validation", "test")):
        for r in datasets.load_from_disk(str(world / "dataset"))[split].select(range(200)):
            if r["chosen"].split()[:1] != r["rejected"].split()[:1]:
                rows.append(
                    (out, {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]})
                )
    folder = tmp_path / "implicit"
    folder.mkdir()
    for out in ("train", "test"):
        with open(folder / f"{out}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for split, row in rows if split == out)
    return str(folder)


def test_sft_on_conversations_with_assistant_only_loss(world, tmp_path, fresh_accelerate_state):
    args = sft.Args(
        model_name_or_path=str(world / "policy_chat"), **chat_data(world, "language_modeling"),
        assistant_only_loss=True, max_length=128, per_device_train_batch_size=4, per_device_eval_batch_size=16,
        total_steps=3, eval_steps=0, num_samples=2, response_length=4, learning_rate=1e-3, **common(tmp_path, "lm"),
    )  # fmt: skip
    metrics = sft.main(args)
    assert metrics["eval/loss"] < metrics["eval/initial_loss"] and metrics["data/num_kept"] > 0
    samples = [json.loads(line) for line in open(tmp_path / "runs" / "lm" / "samples.jsonl")]
    assert samples and samples[0]["prompt"].endswith("<|im_start|>assistant\n")


def test_sft_on_conversational_prompt_completion_with_a_template_file_and_eos_token(
    world, tmp_path, fresh_accelerate_state
):
    from transformers import AutoTokenizer

    args = sft.Args(
        model_name_or_path=str(world / "policy"), **chat_data(world, "prompt_completion"),
        chat_template_path=str(world / "chat_template.jinja"), eos_token="<|pad|>", max_length=128,
        per_device_train_batch_size=4, total_steps=2, eval_strategy="no", **common(tmp_path, "pc"),
    )  # fmt: skip
    metrics = sft.main(args)
    assert "eval/loss" not in metrics and metrics["data/num_kept"] == 600
    saved = AutoTokenizer.from_pretrained(tmp_path / "pc")
    assert saved.eos_token == "<|pad|>" and saved.chat_template == tiny_world.CHAT_TEMPLATE
    assert json.loads((tmp_path / "pc" / "config.json").read_text())["eos_token_id"] == saved.eos_token_id


@pytest.mark.parametrize("config", ["preference", "implicit_prompt_preference"])
def test_dpo_on_conversational_pairs(world, tmp_path, fresh_accelerate_state, config):
    evaluate = config == "implicit_prompt_preference"  # one evaluation is enough to cover the test split
    args = dpo.Args(
        model_name_or_path=str(world / "policy_chat"), **chat_data(world, config), max_length=128,
        max_prompt_length=96, per_device_train_batch_size=4, per_device_eval_batch_size=50, max_steps=2,
        eval_steps=0, eval_strategy="steps" if evaluate else "no", learning_rate=1e-3, generate_during_eval=False,
        **common(tmp_path, config),
    )  # fmt: skip
    metrics = dpo.main(args)
    assert metrics["data/train_pairs"] == 600
    assert 0 <= metrics["eval/rewards/accuracies"] <= 1 if evaluate else "eval/loss" not in metrics


def test_dpo_on_standard_implicit_prompts(world, tmp_path, fresh_accelerate_state):
    args = dpo.Args(
        model_name_or_path=str(world / "policy"), dataset_name=standard_implicit_pairs(world, tmp_path),
        max_length=128, max_prompt_length=96, per_device_train_batch_size=4, max_steps=2, eval_strategy="no", **common(tmp_path, "dpo"),
    )  # fmt: skip
    metrics = dpo.main(args)
    assert "eval/loss" not in metrics and metrics["data/train_pairs"] > 40


def test_reward_on_standard_implicit_prompts_without_an_sft_split(world, tmp_path, fresh_accelerate_state):
    args = reward.Args(
        model_name_or_path=str(world / "policy"), dataset_name=standard_implicit_pairs(world, tmp_path),
        max_length=128, per_device_train_batch_size=4, total_steps=2, eval_steps=0, **common(tmp_path, "rm"),
    )  # fmt: skip
    returned = reward.main(args)
    metrics = json.loads((tmp_path / "rm" / "metrics.json").read_text())
    assert (
        returned == metrics
        and "eval/accuracy" in metrics
        and not any(k.startswith("normalize/") for k in metrics)
    )


def test_reward_on_conversational_implicit_pairs_normalized_on_conversational_references(
    world, tmp_path, fresh_accelerate_state
):
    args = reward.Args(
        model_name_or_path=str(world / "policy_chat"), **chat_data(world, "implicit_prompt_preference"),
        normalize_dataset=str(world / "dataset_chat" / "prompt_completion"), normalize_split="test",
        max_length=128, per_device_train_batch_size=4, total_steps=2, eval_steps=0, **common(tmp_path, "rmc"),
    )  # fmt: skip
    reward.main(args)
    metrics = json.loads((tmp_path / "rmc" / "metrics.json").read_text())
    assert abs(metrics["normalize/mean_after"]) < 1e-4 and "eval/accuracy" in metrics


def rl_args(module, world, tmp_path, name, **extra):
    return module.Args(
        model_name_or_path=str(world / "policy_chat"), reward_model_path=str(world / "reward_chat"),
        **chat_data(world, "prompt_only"), dataset_test_split="test", response_length=6,
        per_device_train_batch_size=4, total_episodes=8, stop_token="eos", eval_strategy="steps", eval_steps=1,
        **common(tmp_path, name), **extra,
    )  # fmt: skip


def test_ppo_samples_conversational_prompts_with_model_name_or_path_alone(
    world, tmp_path, fresh_accelerate_state
):
    args = rl_args(ppo, world, tmp_path, "ppo", num_mini_batches=2)
    ppo.main(args)
    tables = {json.loads(line)["table"] for line in open(tmp_path / "runs" / "ppo" / "samples.jsonl")}
    assert args.num_total_batches == 1 and tables == {"update 1: test prompts (greedy)"}  # --eval_steps 1
    assert (tmp_path / "ppo" / "config.json").exists()


def test_rloo_samples_conversational_prompts(world, tmp_path, fresh_accelerate_state):
    args = rl_args(rloo, world, tmp_path, "rloo", rloo_k=2)
    rloo.main(args)
    assert (tmp_path / "rloo" / "config.json").exists()


def test_rl_scripts_refuse_conversations_without_a_template(world, tmp_path, fresh_accelerate_state):
    args = rl_args(rloo, world, tmp_path, "refused")
    args.model_name_or_path, args.reward_model_path = str(world / "policy"), str(world / "reward")
    with pytest.raises(
        ValueError, match="is conversational but the tokenizer has no chat template; pass --chat"
    ):
        rloo.main(args)
    assert not (tmp_path / "refused").exists()
