"""Build a tiny, randomly initialised Stable-Diffusion pipeline offline, for testing `ddpo.py` on a CPU.

The pipeline has the same parts as Stable Diffusion v1 (UNet2DConditionModel, AutoencoderKL, CLIPTextModel,
CLIPTokenizer, DDIMScheduler; no safety checker), only very small: 32x32 RGB images, 4x16x16 latents, a
2-layer text encoder of width 32 and a byte-level BPE vocabulary of a few hundred tokens whose merges are
learned here from a short list of words. It is saved with `save_pretrained`, so
`StableDiffusionPipeline.from_pretrained(output_dir)` and `python ddpo.py --pretrained_model output_dir` load
it. The same seed gives the same weights.

    python benchmark/tiny/tiny_diffusion.py --output_dir /tmp/tiny-sd --seed 0
"""

import collections
import json
import os
import tempfile
from dataclasses import dataclass

import torch
import tyro
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

# Words the merges are learned from: the animals of ddpo.py's built-in prompts and a few common words.
CORPUS_WORDS = (
    "a photo of an the cat dog horse cow pig sheep goat rabbit fox wolf bear lion tiger zebra giraffe "
    "elephant monkey panda koala kangaroo deer owl eagle duck swan penguin frog turtle snake fish whale "
    "dolphin shark octopus crab bee butterfly ant spider mouse squirrel hedgehog camel llama raccoon"
).split()
NUM_MERGES = 120
BOS_TOKEN, EOS_TOKEN = "<|startoftext|>", "<|endoftext|>"
END_OF_WORD = "</w>"


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of GPT-2 and CLIP: each of the 256 bytes maps to a printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def learn_bpe_merges(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: repeatedly merge the most frequent adjacent pair (ties broken alphabetically)."""
    byte_char = bytes_to_unicode()
    counts = collections.Counter(words)
    # a word is a tuple of symbols; the last symbol carries the end-of-word marker as CLIP's BPE expects
    segmented = {}
    for word in counts:
        chars = [byte_char[b] for b in word.encode("utf-8")]
        segmented[word] = tuple(chars[:-1]) + (chars[-1] + END_OF_WORD,)
    merges = []
    for _ in range(num_merges):
        pair_counts = collections.Counter()
        for word, symbols in segmented.items():
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += counts[word]
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda p: (-pair_counts[p], p))
        merges.append(best)
        for word, symbols in segmented.items():
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            segmented[word] = tuple(merged)
    return merges


def write_clip_vocabulary(directory: str) -> None:
    """Write vocab.json and merges.txt in CLIP's order: bytes, bytes + </w>, merged symbols, specials."""
    byte_chars = list(bytes_to_unicode().values())
    merges = learn_bpe_merges(CORPUS_WORDS, NUM_MERGES)
    tokens = byte_chars + [c + END_OF_WORD for c in byte_chars] + ["".join(pair) for pair in merges]
    tokens = list(dict.fromkeys(tokens)) + [BOS_TOKEN, EOS_TOKEN]
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(tokens)}, f, ensure_ascii=False)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def build_tiny_sd_pipeline(output_dir: str, seed: int = 0) -> StableDiffusionPipeline:
    """Build the tiny pipeline with weights drawn from `seed`, save it to `output_dir` and return it."""
    with tempfile.TemporaryDirectory() as vocab_dir:
        write_clip_vocabulary(vocab_dir)
        tokenizer = CLIPTokenizer.from_pretrained(vocab_dir, model_max_length=16)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        sample_size=32,
    )
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = CLIPTextModel(text_config)
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(output_dir)
    return pipeline


@dataclass
class Args:
    output_dir: str
    """directory the pipeline is saved to"""
    seed: int = 0
    """seed of the random weights"""


if __name__ == "__main__":
    cli = tyro.cli(Args, use_underscores=True)
    build_tiny_sd_pipeline(cli.output_dir, cli.seed)
    print(f"saved a tiny Stable-Diffusion pipeline to {cli.output_dir}")
