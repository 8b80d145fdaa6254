"""--top_k, --top_p, --min_p and --repetition_penalty: the distribution sampled is the one transformers' generate
draws from when TRL hands it these flags, and the logprobs the update uses stay those of logits / temperature."""

import math

import pytest
import torch

import utils.generation as generation
import utils.sampling_knobs as sampling_knobs


def trl_processors(model, temperature, **knobs):
    """The logits processors transformers' generate builds from the GenerationConfig TRL 1.16's GRPO makes."""
    from transformers import GenerationConfig

    defaults = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
    config = GenerationConfig(do_sample=True, temperature=temperature, **{**defaults, **knobs})
    return model._get_logits_processor(generation_config=config, input_ids_seq_length=1, device="cpu")


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config).eval()


CASES = [
    {"top_k": 5},
    {"top_p": 0.9},
    {"min_p": 0.1},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8, "top_k": 7, "top_p": 0.7, "min_p": 0.05},
    {"top_k": 1},
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("knobs", CASES, ids=lambda k: ",".join(f"{n}={v}" for n, v in k.items()))
def test_warp_logits_is_transformers_generate(tiny_model, knobs, temperature):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=generator) * 3
    seen = torch.randint(0, 50, (6, 9), generator=generator)
    theirs = trl_processors(tiny_model, temperature, **knobs)(seen, logits.clone())
    ours = sampling_knobs.warp_logits(logits, seen, temperature, **knobs)
    assert torch.equal(ours.isinf(), theirs.isinf())
    kept = ~ours.isinf()
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=1e-6, atol=1e-6)


def test_knobs_off_change_nothing_and_logprobs_stay_unshaped(tiny_model):
    queries = torch.randint(1, 50, (4, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(queries)

    def sample(**knobs):
        gen = generation.sampling_generator(0, 1)
        return generation.generate(tiny_model, queries, mask, 6, 0.9, 4, gen, **knobs)

    plain, plain_logprobs = sample()
    assert generation.sampling_knobs(type("A", (), dict(generation.SAMPLING_KNOBS))) == {}
    off, off_logprobs = sample(**generation.sampling_knobs(type("A", (), {"top_k": 0, "top_p": 1.0})))
    assert torch.equal(plain, off) and torch.equal(plain_logprobs, off_logprobs)

    # top_k 1 samples the argmax of every step: greedy decoding, whatever the temperature
    greedy, _ = generation.generate(tiny_model, queries, mask, 6, 0.0, 4)
    top1, top1_logprobs = sample(top_k=1)
    assert torch.equal(top1, greedy)
    # the logprobs returned are those of the full logits / temperature (the training forward's), not top_k's 0
    logits = tiny_model(top1).logits[:, queries.size(1) - 1 : -1].float() / 0.9
    expected = logits.log_softmax(-1).gather(-1, top1[:, queries.size(1) :, None]).squeeze(-1)
    torch.testing.assert_close(top1_logprobs, expected, rtol=1e-4, atol=1e-4)
    assert (top1_logprobs < 0).all()


def test_sampled_tokens_stay_in_the_kept_set(tiny_model):
    """Thousands of one-token draws: only ids the warp keeps appear, with the warped distribution's frequencies."""
    query = torch.randint(1, 50, (1, 4), generator=torch.Generator().manual_seed(3))
    queries, mask = query.repeat(4000, 1), torch.ones(4000, 4, dtype=torch.long)
    knobs = {"top_k": 10, "top_p": 0.8}
    tokens, _ = generation.generate(
        tiny_model, queries, mask, 1, 1.0, 4000, generation.sampling_generator(0, 2), **knobs
    )
    logits = tiny_model(query).logits[:, -1].float()
    probs = sampling_knobs.warp_logits(logits, query, 1.0, **knobs).softmax(-1)[0]
    counts = torch.bincount(tokens[:, -1], minlength=50).double() / 4000
    assert set(counts.nonzero().flatten().tolist()) <= set(probs.nonzero().flatten().tolist())
    assert (counts - probs.double()).abs().max() < 4 * math.sqrt(0.25 / 4000)


# ------------------------------------------------------------------------------------------- runs on the tiny world
def test_generation_kwargs_over_the_flags_and_refusals():
    args = type("A", (), {"top_k": 5, "top_p": 0.9, "generation_kwargs": '{"top_k": 3, "min_p": 0.1}'})
    assert generation.sampling_knobs(args) == {"top_k": 3, "top_p": 0.9, "min_p": 0.1}
    with pytest.raises(ValueError, match="not num_beams"):
        generation.sampling_knobs(type("A", (), {"generation_kwargs": '{"num_beams": 2}'}))
    with pytest.raises(ValueError, match="--top_p in"):
        generation.sampling_knobs(type("A", (), {"top_p": 0.0}))


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    from conftest import make_rl_lab

    return make_rl_lab(world, tmp_path_factory.mktemp("knobs_lab"), num_prompts=16)


def run_flags(script, world, lab, tmp_path, name, *knobs):
    """A short run of `script` with a rule reward, from the tiny world's policy (the lab's samples EOS first under
    any top_k); its output folder."""
    from conftest import run_script

    out = tmp_path / name
    flags = ["--logging_dir", str(tmp_path / "runs"), "--run_name", name, "--output_dir", str(out),
             "--dataset_name", str(lab / "prompts.jsonl"), "--learning_rate", "1e-2", "--seed", "3",
             "--local_rollout_forward_batch_size", "8", "--num_sample_generations", "0"]  # fmt: skip
    model = "--sft_model_path" if script == "ppo.py" else "--model_name_or_path"
    rules = f"{lab / 'rules.py'}:chars"
    flags += [
        model,
        str(world / "policy"),
        *(rules if f == "RULES" else f for f in SCRIPT_FLAGS[script]),
        *knobs,
    ]
    run_script([script, *flags], timeout=300)
    return out


SCRIPT_FLAGS = {
    "grpo.py": ["--reward_funcs", "RULES", "--num_generations", "4", "--per_device_train_batch_size", "8",
                "--max_completion_length", "6", "--max_steps", "2", "--temperature", "1.0"],
    "rloo.py": ["--reward_funcs", "RULES", "--num_generations", "2", "--per_device_train_batch_size", "8",
                "--max_completion_length", "6", "--max_steps", "2", "--temperature", "1.0"],
    "online_dpo.py": ["--reward_funcs", "RULES", "--per_device_train_batch_size", "4",
                      "--max_new_tokens", "6", "--max_steps", "2", "--temperature", "1.0"],
    "ppo.py": ["--reward_funcs", "RULES", "--per_device_train_batch_size", "8", "--response_length", "6",
               "--total_episodes", "16", "--temperature", "1.0"],
}  # fmt: skip


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
def test_top_k_one_samples_one_completion_per_prompt(script, world, lab, tmp_path):
    """--top_k 1 at temperature 1 samples the argmax: all of a prompt's completions are the same, so every
    advantage is 0 and the policy does not move (online DPO: every pair ties); --top_k 2 moves it."""
    from conftest import read_metrics, weights

    policy = weights(world / "policy")
    out = run_flags(script, world, lab, tmp_path, "top1", "--top_k", "1")
    if (
        script == "online_dpo.py"
    ):  # a pair's two forwards differ by rounding, which Adam scales up: read the pairs
        for line in read_metrics(tmp_path / "runs" / "top1"):
            assert line["val/num_ties"] == 4 and line["logps/chosen"] == line["logps/rejected"]
        return
    same = weights(out)
    assert all(torch.equal(same[name], policy[name]) for name in policy)
    if script == "grpo.py":  # the control: the test can fail
        moved = weights(
            run_flags(script, world, lab, tmp_path, "top2", "--top_k", "2", "--repetition_penalty", "1.2")
        )
        assert any(not torch.equal(moved[name], policy[name]) for name in policy)


def test_ppo_takes_every_knob(world, lab, tmp_path):
    knobs = ["--top_k", "5", "--top_p", "0.9", "--min_p", "0.05", "--repetition_penalty", "1.1"]
    assert (run_flags("ppo.py", world, lab, tmp_path, "ppo", *knobs) / "model.safetensors").exists()
