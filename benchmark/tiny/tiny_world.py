"""The offline tiny world: a synthetic TL;DR task, its tokenizer, tiny models and a programmatic gold judge.

    python benchmark/tiny/tiny_world.py --output_dir tiny_world

writes, in a few seconds and deterministically for `--seed`:
    tokenizer/     byte-level BPE trained on the task's corpus (pad and eos tokens)
    policy/        a random-init Llama-style causal LM (about 1M parameters)
    reward/        the same backbone as a sequence classifier with one label
    dataset/       a DatasetDict (save_to_disk) with the splits below, and the same splits as jsonl files
    tokenizer_chat/, policy_chat/, reward_chat/
                   the tokenizer with ChatML-style <|im_start|> / <|im_end|> tokens, a chat template and
                   <|im_end|> as EOS (as in instruction-tuned models), and models of its vocabulary
    dataset_chat/  the same posts in TRL's conversational formats, one DatasetDict (train, test) per folder:
                   language_modeling (messages, some multi-turn), prompt_completion, prompt_only, preference
                   (explicit prompt) and implicit_prompt_preference (whole conversations, as UltraFeedback)
    chat_template.jinja  the template alone, for --chat_template_path
    tokenizer_tools/, policy_tools/
                   the chat tokenizer with a tool-calling template (tool schemas, <tool_call>{json}</tool_call>,
                   tool turns) and a response_template that parses the calls, and a policy of its vocabulary
    dataset_tools/ the tool task (prompt_only, train and test): 'What is the code of "{name}"?', answerable only
                   through benchmark/tiny/tiny_tools.py's lookup tool (the code is a hash of the name)

The task. A post is `--post_words` words of filler with `--num_keys` key words hidden in it (key words come
from their own vocabulary). The post's facts are its key words in order. A summary is scored by the gold
judge: +1 for each fact it names (first mention), -1 for each key word that is not a fact or is repeated,
-0.1 for every other word; the better summary has the higher score, equal scores tie.

The references are systematically imperfect, as human ones are: they omit the last fact with probability
`--ref_omit_last` and end with the hedge word `--hedge` with probability `--ref_hedge`. A model that imitates
them lands well below 50% win rate against them; one that names every fact and nothing else wins almost
always. Preference pairs are two perturbed summaries of a post, labelled by the gold judge and then flipped
with probability `--label_noise`, so a reward model is good but not perfect. With `--content_pairs p`, a share
p of the pairs are instead one summary and the same words with one fact replaced by a wrong key word: the
pairs that teach a reward model to check key words against the post rather than count them.

Splits (column names of the standard formats):
    sft                   prompt, completion (reference), facts
    preference            prompt, chosen, rejected, facts            (noisy labels)
    preference_validation prompt, chosen, rejected, facts            (gold labels)
    validation, test      prompt, completion (reference), facts      (held-out posts)
"""

from __future__ import annotations

import copy
import json
import os
import random
from dataclasses import dataclass

SUBREDDITS = [
    "relationships",
    "AskReddit",
    "personalfinance",
    "jobs",
    "legaladvice",
    "tifu",
    "dating",
    "pets",
]
KEY_WORDS = (
    "landlord deposit rent boss salary promotion sister brother wedding divorce dog cat vet loan debt "
    "credit car accident roommate lease breakup girlfriend boyfriend mother father school exam teacher "
    "doctor surgery insurance lawyer contract neighbor party birthday gift phone laptop job interview"
).split()
FILLER_WORDS = (
    "the a and so then but really just very quite today yesterday week month year we i you they it was is "
    "had have went said told felt thought maybe because about after before while when again still always "
    "never often some many much more less good bad big small long short new old happy sad angry tired"
).split()
HEDGE = "tbh"
# ChatML-style: every message is <|im_start|>{role}\n{content}<|im_end|>\n; the generation prompt opens an
# assistant turn. The same shape as the templates of Qwen's instruction-tuned models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The chat template with tools (Qwen's shape, shorter): the tools' names and arguments in a system turn, a call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the assistant turn, the answer in a tool turn.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{ ' ' + tool.function.name + '(' + (tool.function.parameters.properties | list | join(', ')) + ')' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls %}"
    "{{ '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)  # fmt: skip
# transformers' response parsing of that template's assistant turns (tokenizer.parse_response).
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
# The name in quotes: its tokens are then those of a call's JSON argument, so a call copies them one by one.
TOOL_QUESTION = 'What is the code of "{name}"?'
SYSTEM_PROMPT = "Summarize the post in a few words."
FOLLOW_UP = "Only the first fact?"


@dataclass
class Args:
    output_dir: str = "tiny_world"
    """where to write the world"""
    seed: int = 0
    """random seed; the same seed writes the same files"""
    num_sft: int = 4000
    """posts in the sft split"""
    num_preference: int = 8000
    """pairs in the preference split"""
    num_preference_validation: int = 500
    """pairs, with gold labels, in the preference_validation split"""
    num_validation: int = 200
    """held-out posts in the validation split"""
    num_test: int = 1000
    """held-out posts for the final evaluation (1000: a win rate's 95% interval is about +-3 points;
    the test split is drawn last, so its size changes no other split)"""
    post_words: int = 30
    """words in a post"""
    num_keys: int = 3
    """key words (facts) in a post"""
    ref_omit_last: float = 0.7
    """probability that a reference summary omits the last fact"""
    ref_hedge: float = 0.6
    """probability that a reference summary ends with the hedge word"""
    label_noise: float = 0.25
    """probability that a preference label is flipped"""
    content_pairs: float = 0.0
    """share of preference pairs (both splits) that differ only in content: the same summary, once with a fact
    and once with a key word the post does not have (or a repeated fact) in its place. Random pairs rarely
    differ that way (they mostly differ in how many key words they name), so a reward model trained on them
    learns to count key words rather than to check them against the post"""
    vocab_size: int = 1024
    """tokenizer vocabulary size"""
    hidden_size: int = 128
    """hidden size of the tiny models"""
    num_layers: int = 4
    """transformer layers of the tiny models"""
    num_heads: int = 4
    """attention heads of the tiny models"""
    intermediate_size: int = 512
    """MLP width of the tiny models"""
    max_position_embeddings: int = 256
    """longest sequence the tiny models accept"""


# ----------------------------------------------------------------------------------------------------------------
# The task and its gold judge (pure functions)
# ----------------------------------------------------------------------------------------------------------------
def gold_score(facts: list[str], summary: str) -> float:
    """+1 per fact named (first mention), -1 per other or repeated key word, -0.1 per any other word."""
    score, seen = 0.0, set()
    for word in summary.split():
        if word in facts and word not in seen:
            score += 1.0
            seen.add(word)
        elif word in KEY_WORDS:
            score -= 1.0
        else:
            score -= 0.1
    return round(score, 6)


def gold_judge(facts: list[str], summary_a: str, summary_b: str) -> float:
    """1.0 if summary_a is better than summary_b for a post with these facts, 0.0 if worse, 0.5 for a tie."""
    a, b = gold_score(facts, summary_a), gold_score(facts, summary_b)
    return 1.0 if a > b else 0.0 if a < b else 0.5


def make_post(rng: random.Random, post_words: int, num_keys: int) -> tuple[str, list[str]]:
    """A TL;DR-format query and its facts (the key words, in the order they appear)."""
    facts = rng.sample(KEY_WORDS, num_keys)
    words = [rng.choice(FILLER_WORDS) for _ in range(post_words - num_keys)]
    for position, fact in zip(sorted(rng.sample(range(post_words), num_keys)), facts):
        words.insert(position, fact)
    title = " ".join(rng.choice(FILLER_WORDS) for _ in range(3))
    query = f"SUBREDDIT: r/{rng.choice(SUBREDDITS)}\n\nTITLE: {title}\n\nPOST: {' '.join(words)}\n\nTL;DR:"
    return query, facts


def reference_summary(rng: random.Random, facts: list[str], omit_last: float, hedge: float) -> str:
    """A human-like reference: the facts, usually missing the last one, often ending with the hedge word."""
    words = list(facts[:-1] if rng.random() < omit_last else facts)
    if rng.random() < hedge:
        words.append(HEDGE)
    return " " + " ".join(words)


def kept_facts(rng: random.Random, facts: list[str], keep_first: bool = False) -> list[str]:
    """The facts a candidate summary names: each kept with probability 0.85, the last with 0.5 (with keep_first,
    the first always, drawing nothing for it)."""
    return [
        f
        for i, f in enumerate(facts)
        if (keep_first and i == 0) or rng.random() < (0.5 if i == len(facts) - 1 else 0.85)
    ]


def perturbed_summary(rng: random.Random, facts: list[str]) -> str:
    """A candidate summary of the kind a policy produces: facts dropped, a hedge, an invented or repeated key."""
    words = kept_facts(rng, facts)
    if rng.random() < 0.15:
        words.insert(rng.randrange(len(words) + 1), rng.choice([k for k in KEY_WORDS if k not in facts]))
    if words and rng.random() < 0.1:
        words.append(rng.choice(words))
    if rng.random() < 0.5:
        words.append(HEDGE)
    if rng.random() < 0.1:
        words.append(rng.choice(FILLER_WORDS))
    return " " + " ".join(words)


def content_pair(rng: random.Random, facts: list[str]) -> tuple[str, str]:
    """(better, worse): one summary naming some facts, and the same words with one fact replaced by a key word
    the post does not have (three times in four) or by another fact said again. Gold scores differ by 2."""
    kept = kept_facts(rng, facts, keep_first=True)  # at least one fact, so there is one to replace
    slot = rng.randrange(len(kept))
    others = [f for f in kept if f != kept[slot]]
    if others and rng.random() < 0.25:
        wrong = rng.choice(others)
    else:
        wrong = rng.choice([k for k in KEY_WORDS if k not in facts])
    tail = [HEDGE] if rng.random() < 0.5 else []
    return " " + " ".join(kept + tail), " " + " ".join(kept[:slot] + [wrong] + kept[slot + 1 :] + tail)


def make_splits(args: Args) -> dict[str, list[dict]]:
    rng = random.Random(args.seed)
    seen_queries: set[str] = set()

    def new_post():
        while True:
            query, facts = make_post(rng, args.post_words, args.num_keys)
            if query not in seen_queries:
                seen_queries.add(query)
                return query, facts

    def sft_rows(n):
        rows = []
        for _ in range(n):
            query, facts = new_post()
            ref = reference_summary(rng, facts, args.ref_omit_last, args.ref_hedge)
            rows.append({"prompt": query, "completion": ref, "facts": facts})
        return rows

    def preference_rows(n, noise):
        rows = []
        while len(rows) < n:
            query, facts = new_post()
            if args.content_pairs and rng.random() < args.content_pairs:
                a, b = content_pair(rng, facts)
            else:
                a, b = perturbed_summary(rng, facts), perturbed_summary(rng, facts)
            label = gold_judge(facts, a, b)
            if label == 0.5:
                continue
            chosen, rejected = (a, b) if label == 1.0 else (b, a)
            if rng.random() < noise:
                chosen, rejected = rejected, chosen
            rows.append({"prompt": query, "chosen": chosen, "rejected": rejected, "facts": facts})
        return rows

    return {
        "sft": sft_rows(args.num_sft),
        "preference": preference_rows(args.num_preference, args.label_noise),
        "preference_validation": preference_rows(args.num_preference_validation, 0.0),
        "validation": sft_rows(args.num_validation),
        "test": sft_rows(args.num_test),
    }


def conversational_splits(splits: dict[str, list[dict]]) -> dict[str, dict[str, list[dict]]]:
    """The posts of `splits` in TRL's conversational formats: {format folder: {"train"/"test": rows}}. Derived
    without randomness (the language-modeling rows of even index get a second exchange), so the standard
    splits and everything made from them stay as they are."""

    def user(text):
        return {"role": "user", "content": text}

    def assistant(text):
        return {"role": "assistant", "content": text.strip()}

    def messages(i, row):
        turns = [
            {"role": "system", "content": SYSTEM_PROMPT},
            user(row["prompt"]),
            assistant(row["completion"]),
        ]
        if i % 2 == 0:
            turns += [user(FOLLOW_UP), assistant(row["facts"][0])]
        return {"messages": turns}

    sft_sources = {"train": splits["sft"], "test": splits["test"]}
    pair_sources = {"train": splits["preference"], "test": splits["preference_validation"]}
    out: dict[str, dict[str, list[dict]]] = {
        "language_modeling": {k: [messages(i, r) for i, r in enumerate(rows)] for k, rows in sft_sources.items()},
        "prompt_completion": {
            k: [{"prompt": [user(r["prompt"])], "completion": [assistant(r["completion"])], "facts": r["facts"]}
                for r in rows]
            for k, rows in sft_sources.items()
        },
        "prompt_only": {
            k: [{"prompt": [user(r["prompt"])], "facts": r["facts"]} for r in rows] for k, rows in sft_sources.items()
        },
        "preference": {
            k: [{"prompt": [user(r["prompt"])], "chosen": [assistant(r["chosen"])],
                 "rejected": [assistant(r["rejected"])], "facts": r["facts"]} for r in rows]
            for k, rows in pair_sources.items()
        },
        "implicit_prompt_preference": {
            k: [{"chosen": [user(r["prompt"]), assistant(r["chosen"])],
                 "rejected": [user(r["prompt"]), assistant(r["rejected"])], "facts": r["facts"]} for r in rows]
            for k, rows in pair_sources.items()
        },
    }  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer, models, files
# ----------------------------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|pad|>"
    )


def model_config(args: Args, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        num_labels=1,
    )


def build(args: Args) -> str:
    """Write the whole world into `args.output_dir` and return that path."""

    splits = make_splits(args)
    corpus = [
        row["prompt"] + row.get("completion", row.get("chosen", ""))
        for rows in splits.values()
        for row in rows
    ]
    corpus += [" " + " ".join(KEY_WORDS + FILLER_WORDS + [HEDGE])] * 10
    tokenizer = train_tokenizer(corpus, args.vocab_size)
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))

    save_models_and_data(args, model_config(args, tokenizer), tokenizer, splits)
    build_chat(args, splits, tokenizer)
    build_tools(args)
    return args.output_dir


def save_models_and_data(args, config, tokenizer, splits: dict[str, list[dict]]) -> None:
    """Write policy/ (a random-init causal LM of `config`), reward/ (the same body as a one-label classifier),
    dataset/ (the splits with save_to_disk and as jsonl) and world.json (`args`) under args.output_dir."""
    import datasets
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(args.seed)
    policy = LlamaForCausalLM(config)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.save_pretrained(os.path.join(args.output_dir, "policy"))
    tokenizer.save_pretrained(os.path.join(args.output_dir, "policy"))
    torch.manual_seed(args.seed + 1)
    reward = LlamaForSequenceClassification(config)
    reward.save_pretrained(os.path.join(args.output_dir, "reward"))
    tokenizer.save_pretrained(os.path.join(args.output_dir, "reward"))
    dataset_dir = os.path.join(args.output_dir, "dataset")
    datasets.DatasetDict(
        {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    ).save_to_disk(dataset_dir)
    for name, rows in splits.items():
        with open(os.path.join(dataset_dir, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(os.path.join(args.output_dir, "world.json"), "w") as f:
        json.dump({k: v for k, v in vars(args).items() if k != "output_dir"}, f, indent=2)


def build_chat(args: Args, splits: dict[str, list[dict]], tokenizer) -> None:
    """The conversational part of the world, written after (and without touching) everything else: the chat
    tokenizer, models of its vocabulary, the conversational splits and the template file."""
    import datasets
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat_tokenizer.eos_token = "<|im_end|>"
    chat_tokenizer.chat_template = CHAT_TEMPLATE
    with open(os.path.join(args.output_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    config = model_config(args, chat_tokenizer)
    for name, cls, seed in (
        ("policy_chat", LlamaForCausalLM, 2),
        ("reward_chat", LlamaForSequenceClassification, 3),
    ):
        torch.manual_seed(args.seed + seed)
        model = cls(config)
        if name == "policy_chat":
            model.generation_config.pad_token_id = chat_tokenizer.pad_token_id
        model.save_pretrained(os.path.join(args.output_dir, name))
        chat_tokenizer.save_pretrained(os.path.join(args.output_dir, name))
    chat_tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer_chat"))
    for folder, parts in conversational_splits(splits).items():
        datasets.DatasetDict({k: datasets.Dataset.from_list(rows) for k, rows in parts.items()}).save_to_disk(
            os.path.join(args.output_dir, "dataset_chat", folder)
        )


def tool_code(name: str) -> str:
    """The code of a name, which only the tool knows: a key word picked by a hash of the name."""
    import hashlib

    return KEY_WORDS[int(hashlib.sha256(name.encode()).hexdigest(), 16) % len(KEY_WORDS)]


def tool_rows(rng: random.Random, n: int, taken: set) -> list[dict]:
    """`n` questions about new names (four letters), each with its code as `answer`."""
    rows = []
    while len(rows) < n:
        name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4))
        if name not in taken:
            taken.add(name)
            question = [{"role": "user", "content": TOOL_QUESTION.format(name=name)}]
            rows.append({"prompt": question, "name": name, "answer": tool_code(name)})
    return rows


def build_tools(args: Args) -> None:
    """The tool-calling part of the world, written after (and without touching) everything else: the chat
    tokenizer with <tool_call> and </tool_call> tokens, the tool template and its response template, a policy of
    that vocabulary, and the tool task (names of the test split never appear in train)."""
    import datasets
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.output_dir, "tokenizer_chat"))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    torch.manual_seed(args.seed + 4)
    model = LlamaForCausalLM(model_config(args, tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(os.path.join(args.output_dir, "policy_tools"))
    for folder in ("policy_tools", "tokenizer_tools"):
        tokenizer.save_pretrained(os.path.join(args.output_dir, folder))
    rng, taken = random.Random(args.seed + 5), set()
    parts = {"train": tool_rows(rng, args.num_sft, taken), "test": tool_rows(rng, args.num_test, taken)}
    datasets.DatasetDict({k: datasets.Dataset.from_list(rows) for k, rows in parts.items()}).save_to_disk(
        os.path.join(args.output_dir, "dataset_tools")
    )


if __name__ == "__main__":
    import tyro

    world_args = tyro.cli(Args, use_underscores=True)
    build(world_args)
    print(f"tiny world written to {world_args.output_dir}")
