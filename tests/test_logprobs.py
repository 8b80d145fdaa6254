"""utils.logprobs.token_logprobs and chunked_token_logprobs: the LM head only on scored positions, tile by tile, against
the plain computation (full logits, log_softmax) and against the equation written as a loop."""

import math

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import utils.generation as generation
import utils.lm_head as tiled  # the tile sizes live here
import utils.logprobs


def tiny_llama(vocab_size=97, tie=False, seed=0, cls=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tie)  # fmt: skip
    return (cls or LlamaForCausalLM)(config).eval()


def batch(vocab_size=97, rows=3, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (rows, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding
    attention_mask[-1, -2:] = 0  # right padding
    score_mask = torch.rand(rows, length - 1, generator=g) < 0.6
    return input_ids, attention_mask, score_mask


def plain(model, input_ids, attention_mask, score_mask, temperature=1.0):
    """The computation token_logprobs replaces: logits of every position, log_softmax, gather, mask."""
    logits = utils.logprobs.forward(model, input_ids, attention_mask).logits[:, :-1].float() / temperature
    logprobs = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logprobs * score_mask, logits


def gradients(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def assert_close_grads(a, b, rel=1e-5):
    assert a.keys() == b.keys() and a
    for name in a:
        scale = b[name].abs().max().clamp(min=1e-12)
        assert (a[name] - b[name]).abs().max() / scale < rel, name


@pytest.mark.parametrize("kind", ["linear", "linear_token_tiles", "any_module"])
def test_chunked_logprobs_match_the_equation_and_plain_gradients(kind, monkeypatch):
    """Three tilings: a linear head over tokens (all 14 in one tile) and vocabulary (2 entries a tile), the same
    with 4-token tiles, and any other head (called as a function) over tokens only (3 a tile)."""
    monkeypatch.setattr(tiled, "LOGIT_TILE_ELEMENTS", 3 * 13)
    if kind == "linear_token_tiles":
        monkeypatch.setattr(tiled, "TILE_TOKENS", 4)
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(8, 13, bias=True)
    head = linear if kind.startswith("linear") else lambda h: linear(h)
    hidden = torch.randn(14, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (14,), generator=g)
    temperature = 0.7
    logprobs, entropy, mean_logit = utils.lm_head.chunked_token_logprobs(
        head, hidden, targets, temperature, True
    )
    with torch.no_grad():
        logits = (head(hidden) / temperature).tolist()
    for n, row in enumerate(logits):  # the equation, one token at a time
        log_z = math.log(sum(math.exp(v) for v in row))
        probs = [math.exp(v - log_z) for v in row]
        assert logprobs[n].item() == pytest.approx(row[targets[n]] - log_z, rel=1e-5, abs=1e-6)
        assert entropy[n].item() == pytest.approx(-sum(p * math.log(p) for p in probs), rel=1e-5)
        assert mean_logit[n].item() == pytest.approx(sum(row) / len(row), rel=1e-5, abs=1e-6)
    assert not entropy.requires_grad and not mean_logit.requires_grad

    weights = torch.randn(14, generator=g)
    (logprobs * weights).sum().backward()
    chunked = {"hidden": hidden.grad.clone(), **{n: p.grad.clone() for n, p in linear.named_parameters()}}
    hidden.grad = None
    linear.zero_grad()
    full = (linear(hidden) / temperature).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    (full * weights).sum().backward()
    reference = {"hidden": hidden.grad, **{n: p.grad for n, p in linear.named_parameters()}}
    assert_close_grads(chunked, reference)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_token_logprobs_equal_the_full_logits_path(tie, monkeypatch):
    monkeypatch.setattr(tiled, "LOGIT_TILE_ELEMENTS", 4 * 97)  # several tiles
    model = tiny_llama(tie=tie)
    input_ids, attention_mask, score_mask = batch()
    temperature = 0.7
    logprobs, entropy, mean_logit = utils.logprobs.token_logprobs(
        model, input_ids, attention_mask, score_mask, temperature, with_stats=True
    )
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(3))
    (logprobs * weights).sum().backward()
    chunked = gradients(model)
    expected, logits = plain(model, input_ids, attention_mask, score_mask, temperature)
    (expected * weights).sum().backward()
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-6)
    assert (logprobs[~score_mask] == 0).all()
    with torch.no_grad():
        torch.testing.assert_close(
            entropy, utils.logprobs.entropy_from_logits(logits) * score_mask, rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(mean_logit, logits.mean(-1) * score_mask, rtol=1e-5, atol=1e-6)
    assert_close_grads(chunked, gradients(model))


def test_response_logprobs_are_the_response_slice():
    model = tiny_llama()
    input_ids, attention_mask, _ = batch()
    with torch.no_grad():
        logprobs = utils.logprobs.response_logprobs(model, input_ids, attention_mask, 7, 0.5)
        logits = utils.logprobs.response_logits(model, input_ids, attention_mask, 7, 0.5)
    assert logprobs.shape == (3, 5)
    torch.testing.assert_close(
        logprobs, utils.logprobs.logprobs_from_logits(logits, input_ids[:, 7:]), rtol=1e-5, atol=1e-6
    )


def test_lora_on_the_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False),
    )
    input_ids, attention_mask, score_mask = batch()
    logprobs = utils.logprobs.token_logprobs(model, input_ids, attention_mask, score_mask)
    logprobs.sum().backward()
    chunked = gradients(model)
    assert any("lm_head.lora" in n for n in chunked)
    expected, _ = plain(model, input_ids, attention_mask, score_mask)
    expected.sum().backward()
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-6)
    assert_close_grads(chunked, gradients(model))


@pytest.mark.parametrize("precision", ["bf16_weights", "autocast"])
def test_bf16_within_stated_tolerance(precision, monkeypatch):
    """bf16 weights (DeepSpeed's bf16) or float32 weights under bf16 autocast (accelerate's): the head's matmul
    runs in bf16 on both paths, the rest in float32, so the chunked logprobs are within 2e-2 nats of the plain
    ones and the gradients within 5% of the largest entry (bf16 rounding of differently blocked sums; measured
    here: 5e-7 nats, gradients within 1%)."""
    monkeypatch.setattr(tiled, "LOGIT_TILE_ELEMENTS", 4 * 97)  # several vocabulary tiles
    model = tiny_llama()
    if precision == "bf16_weights":
        model = model.to(torch.bfloat16)
    input_ids, attention_mask, score_mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        logprobs = utils.logprobs.token_logprobs(model, input_ids, attention_mask, score_mask)
        logprobs.sum().backward()
        chunked = gradients(model)
        expected, _ = plain(model, input_ids, attention_mask, score_mask)
        expected.sum().backward()
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=2e-2)
    assert_close_grads(chunked, gradients(model), rel=5e-2)


def test_a_model_that_transforms_its_logits_is_scored_plainly():
    """A forward that rescales the head's output (as soft-capping or a logit scale do) is noticed: the values
    are those of the transformed logits, not of the bare head."""
    from transformers import LlamaForCausalLM

    class ScaledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    model = tiny_llama(cls=ScaledLogits)
    input_ids, attention_mask, score_mask = batch()
    with torch.no_grad():
        logprobs = utils.logprobs.token_logprobs(model, input_ids, attention_mask, score_mask)
        expected, _ = plain(model, input_ids, attention_mask, score_mask)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-6)
    assert model._plain_logprobs


class OpNames(TorchDispatchMode):
    """Records the name of every operation."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_head_check_compares_no_values_when_the_forward_returns_its_output():
    """Telling a transformed head's output apart needs no look at the values (a GPU sync) when the model
    returns the tiled head's tensor itself; a model that rescales it is still noticed (test above)."""
    model = tiny_llama()
    input_ids, attention_mask, score_mask = batch()
    with OpNames() as ops:
        utils.logprobs.token_logprobs(model, input_ids, attention_mask, score_mask)
    assert "equal" not in ops.names and "mm" in ops.names  # the mode saw the forward
    assert not getattr(model, "_plain_logprobs", False)


def test_a_gpu_tile_holds_more_logits_than_a_cpu_tile():
    """At the TL;DR SFT shape (8 rows x 53 scored tokens, Qwen2.5's vocabulary) a pass has 16 tiles on a CPU and
    4 on a GPU; the tiles cover the vocabulary once either way."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert (tiled.tile_elements(cpu), tiled.tile_elements(gpu)) == (2**22, 2**24)
    for device, count in ((cpu, 16), (gpu, 4)):
        tiles = list(tiled._tiles(424, 151936, device))
        assert len(tiles) == count and sum(c.stop - c.start for _, c in tiles) == 151936


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_all_positions_times_the_vocabulary(monkeypatch):
    """Forward and backward never create a [B, T, V] tensor: the largest is a tile of logits or the head's
    weight (gradient), whichever is larger; the plain path creates B * (T - 1) * V."""
    vocab, tile_tokens = 4099, 8
    monkeypatch.setattr(tiled, "LOGIT_TILE_ELEMENTS", tile_tokens * vocab)
    model = tiny_llama(vocab_size=vocab)
    input_ids, attention_mask, _ = batch(vocab, rows=4, length=40)
    score_mask = torch.zeros(4, 39, dtype=torch.bool)
    score_mask[:, 20:] = True  # a 19-token response
    with LargestTensor() as mode:
        utils.logprobs.token_logprobs(model, input_ids, attention_mask, score_mask).sum().backward()
    bound = max(tile_tokens * vocab, model.lm_head.weight.numel())
    assert mode.largest <= bound < 4 * 39 * vocab // 4
    with LargestTensor() as mode:
        plain(model, input_ids, attention_mask, score_mask)[0].sum().backward()
    assert mode.largest >= 4 * 39 * vocab  # the test can tell the two apart


def test_generation_keeps_only_the_last_logits():
    model = tiny_llama()
    assert generation.keeps_last_logits(model)
    queries, mask = utils.generation.left_pad([[5, 6, 7], [8, 9]], 0)
    tokens, logprobs = utils.generation.generate(model, queries, mask, 4, 0.0, 2)
    with torch.no_grad():  # the greedy tokens scored again by one forward pass
        expected = utils.logprobs.response_logprobs(
            model, tokens, torch.cat([mask, torch.ones(2, 4, dtype=torch.bool)], 1), 3, 0
        )
    torch.testing.assert_close(logprobs, expected, rtol=1e-4, atol=1e-5)
