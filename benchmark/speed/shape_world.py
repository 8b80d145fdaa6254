"""A world at real shapes for benchmark/speed/speed.py: exact prompt and response lengths, a large vocabulary.

    python benchmark/speed/shape_world.py --output_dir benchmark/work/speed-tldr/world --vocab_size 50304 \
        --prompt_length 512 --response_length 53

The tiny world (tiny_world.py) has a 1k vocabulary and short posts, so the [batch, sequence, vocabulary] logits are
negligible there. This world has the shapes of real runs, and nothing to learn: speed.py only measures work.
    tokenizer   one word per token (a word-level tokenizer over `w3 ... w{V-1}` plus <|endoftext|> (EOS),
                <|pad|> and <|unk|>): `n` words are exactly `n` tokens, and decoding then encoding gives the same
                ids back, so a trainer that re-tokenizes decoded completions for its reward model (TRL) scores the
                same lengths as one that keeps the ids (ours). Its length equals --vocab_size.
    policy/     a random-init Llama-style causal LM: --hidden_size x --num_layers, untied embeddings, float32
    reward/     the same body as a one-label sequence classifier (the reward model and PPO's critic)
    dataset/    a DatasetDict (save_to_disk) and the same splits as jsonl files:
                sft         prompt (--prompt_length words), completion (--response_length - 1 words: with the EOS
                            every side appends, --response_length tokens)
                preference  prompt, chosen, rejected (the same lengths as sft's prompt and completion)
                Words are drawn uniformly from the vocabulary: long synthetic posts cut to exactly the length.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiny"))
from tiny_world import save_models_and_data  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|pad|>", "<|unk|>"]


@dataclass
class Args:
    output_dir: str = "benchmark/work/speed-tldr/world"
    """where to write the world"""
    seed: int = 0
    """seed of the data and the models' initialization"""
    vocab_size: int = 50304
    """vocabulary of the tokenizer and of the models (embedding rows, LM head columns)"""
    prompt_length: int = 512
    """tokens of every prompt"""
    response_length: int = 53
    """tokens of every completion, chosen and rejected (EOS included)"""
    num_rows: int = 256
    """rows of each split (speed.py uses far fewer)"""
    hidden_size: int = 256
    """hidden size of the models"""
    num_layers: int = 2
    """transformer layers of the models"""
    num_heads: int = 4
    """attention heads (head dim = hidden_size / num_heads)"""
    intermediate_size: int = 1024
    """MLP width of the models"""


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer whose ids are exactly 0 .. vocab_size - 1 (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab |= {f"w{i}": i for i in range(len(SPECIAL), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIAL[0], pad_token=SPECIAL[1], unk_token=SPECIAL[2]
    )


def make_splits(args: Args) -> dict[str, list[dict]]:
    """Prompts of exactly prompt_length words; completions, chosen and rejected of response_length - 1 words,
    each starting with a space so that prompt + completion as one string is still the words of both."""
    rng = random.Random(args.seed)

    def words(n):
        return " ".join(f"w{rng.randrange(len(SPECIAL), args.vocab_size)}" for _ in range(n))

    P, C = args.prompt_length, args.response_length - 1
    sft = [{"prompt": words(P), "completion": " " + words(C)} for _ in range(args.num_rows)]
    preference = [{"prompt": words(P), "chosen": " " + words(C), "rejected": " " + words(C)}
                  for _ in range(args.num_rows)]  # fmt: skip
    return {"sft": sft, "preference": preference}


def build(args: Args) -> str:
    from transformers import LlamaConfig

    tokenizer = make_tokenizer(args.vocab_size)
    splits = make_splits(args)
    row = splits["preference"][0]
    lengths = [len(tokenizer(row[k], add_special_tokens=False)["input_ids"]) for k in ("prompt", "chosen")]
    assert lengths == [args.prompt_length, args.response_length - 1], lengths
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        max_position_embeddings=max(1024, args.prompt_length + args.response_length),
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        num_labels=1,
    )
    os.makedirs(args.output_dir, exist_ok=True)
    save_models_and_data(args, config, tokenizer, splits)
    return args.output_dir


if __name__ == "__main__":
    import tyro

    build(tyro.cli(Args, use_underscores=True))
