"""LoRA (--use_peft, utils/lora.py) in ppo.py, rloo.py, grpo.py, online_dpo.py and reward.py: only the adapter (and
modules_to_save) trains, the base weights stay bit-for-bit; the reference is the policy with its adapter off,
equal to the base model's logprobs; the save is the merged model (--output_dir) and the adapter alone
(--output_dir/adapter); resume is exact; the engine gets the merged weights; --bf16 runs. Whole-update cases
against TRL's trainers with a peft_config: tests/test_update_parity_rloo.py, test_update_parity_grpo.py,
test_update_parity_online_dpo.py and (reward.py) test_update_parity_offline.py."""

import types

import pytest
import torch

import fixed_completions
from conftest import make_rl_lab, read_metrics, run_script, weights

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    return make_rl_lab(world, tmp_path_factory.mktemp("lora_lab"), num_prompts=16)


def script_flags(script, world, lab, out, *extra):
    """Two updates of `script` with LoRA on q_proj and v_proj, a checkpoint after the second."""
    rules = lab / "rules.py"
    common = ["--output_dir", str(out / "model"), "--logging_dir", str(out / "runs"), "--run_name", "run",
              "--use_peft", "--lora_target_modules", *TARGETS, "--lora_r", "4", "--save_steps", "2", *extra]  # fmt: skip
    if script == "reward.py":
        return ["reward.py", "--model_name_or_path", str(world / "policy"), "--dataset_name", str(world / "dataset"),
                "--dataset_train_split", "preference", "--dataset_test_split", "preference_validation",
                "--max_steps", "2", "--per_device_train_batch_size", "8",
                "--max_length", "64", "--learning_rate", "1e-3", *common]  # fmt: skip
    data = ["--dataset_name", str(lab / "prompts.jsonl"), "--learning_rate", "1e-3"]
    if script == "ppo.py":
        return ["ppo.py", "--sft_model_path", str(lab / "policy"), "--reward_fn", f"{rules}:key_words",
                "--response_length", "8", "--total_episodes", "16", "--per_device_train_batch_size", "8",
                "--num_ppo_epochs", "1", "--stop_token", "eos", *data, *common]  # fmt: skip
    if script == "online_dpo.py":
        return ["online_dpo.py", "--model_name_or_path", str(lab / "policy"), "--reward_fn", f"{rules}:key_words",
                "--max_new_tokens", "8", "--max_steps", "2", "--per_device_train_batch_size", "4",
                "--num_sample_generations", "0", *data, *common]  # fmt: skip
    return [script, "--model_name_or_path", str(lab / "policy"), "--reward_funcs", f"{rules}:key_words",
            "--num_generations", "2", "--per_device_train_batch_size", "8", "--max_steps", "2",
            "--max_completion_length", "8", "--num_sample_generations", "0", "--beta", "0.1", *data, *common]  # fmt: skip


def checkpoint_tensors(model_dir) -> dict:
    """The policy's tensors in the last checkpoint, under peft's names (ppo.py's without the critic)."""
    from safetensors.torch import load_file

    files = sorted((model_dir / "checkpoint-2").glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(str(files[0]))
    policy = {k.removeprefix("policy."): v for k, v in tensors.items() if not k.startswith("critic.")}
    return {k.removeprefix("model."): v for k, v in policy.items()}  # reward.py's ScoreModel


@pytest.mark.parametrize("script", ["rloo.py", "grpo.py", "ppo.py", "online_dpo.py", "reward.py"])
def test_only_the_adapter_trains_and_the_save_is_merged_with_the_adapter_beside(world, lab, tmp_path, script):
    base_path = world / "policy" if script == "reward.py" else lab / "policy"
    run_script(script_flags(script, world, lab, tmp_path))
    base, model_dir = weights(base_path), tmp_path / "model"
    trained = checkpoint_tensors(model_dir)
    adapters = [k for k in trained if ".lora_" in k]
    assert adapters and all(any(f".{t}.lora_" in k for t in TARGETS) for k in adapters)
    for key, value in trained.items():  # the base's own weights, bit for bit
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".lora_" not in key and name in base:
            assert torch.equal(value, base[name]), key
    assert any(k.endswith("lora_B.default.weight") and trained[k].abs().max() > 0 for k in adapters)
    # The saved model: the base where there is no adapter, base + B A * scale where there is one.
    saved = weights(model_dir)
    assert (model_dir / "adapter" / "adapter_config.json").exists()
    assert (model_dir / "adapter" / "adapter_model.safetensors").exists()
    for name, value in saved.items():
        layer = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and layer.rsplit(".", 1)[-1] in TARGETS:
            prefix = f"base_model.model.{layer}"
            scale = 32 / 4  # lora_alpha / r
            a, b = trained[f"{prefix}.lora_A.default.weight"], trained[f"{prefix}.lora_B.default.weight"]
            assert torch.allclose(value, base[name] + scale * b @ a, atol=1e-6), name
        elif name in base and "score" not in name:
            assert torch.equal(value, base[name]), name
    if (
        script != "reward.py"
    ):  # the adapter folder is peft's: loaded on the base, merged, it is the saved model
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_path), model_dir / "adapter"
        )
        merged = model.merge_and_unload().state_dict()
        assert all(torch.allclose(merged[name], saved[name], atol=1e-6) for name in saved)


def test_reference_is_the_base_with_the_adapter_off(lab):
    """utils.lora.AdapterOff's logprobs equal the base model's bit for bit once the adapter moved the policy."""
    from transformers import AutoModelForCausalLM

    import utils.generation
    import utils.logprobs
    import utils.lora

    flags = fixed_completions.lora_flags(lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"])
    base = AutoModelForCausalLM.from_pretrained(lab / "policy").eval()
    policy = utils.lora.add_adapter(
        AutoModelForCausalLM.from_pretrained(lab / "policy"), flags, seed=0
    ).eval()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 9, 12)]
    ids, mask = utils.generation.left_pad(rows, 0)
    reference = utils.lora.AdapterOff(policy)
    with torch.no_grad():
        expected = utils.logprobs.response_logprobs(base, ids, mask, 4, 0.7)
        assert torch.equal(utils.logprobs.response_logprobs(reference, ids, mask, 4, 0.7), expected)
        moved = utils.logprobs.response_logprobs(policy, ids, mask, 4, 0.7)
    assert (moved - expected).abs().max() > 1e-3  # the adapter is on outside the reference


def test_resume_is_exact(lab, world, tmp_path):
    """rloo.py with LoRA: 4 updates straight, and a resume from its checkpoint after 2: the same weights and
    the same metrics of updates 3 and 4."""
    run_script(script_flags("rloo.py", world, lab, tmp_path / "straight", "--max_steps", "4"))
    checkpoint = tmp_path / "straight" / "model" / "checkpoint-2"
    resumed = script_flags("rloo.py", world, lab, tmp_path / "resumed", "--max_steps", "4")
    run_script([*resumed, "--resume_from_checkpoint", str(checkpoint)])
    a, b = weights(tmp_path / "straight" / "model"), weights(tmp_path / "resumed" / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [read_metrics(tmp_path / name / "runs" / "run") for name in ("straight", "resumed")]
    timed = ("eps", "train_seconds")  # episodes per second: a clock, not the run
    timeless = [[{k: v for k, v in line.items() if k not in timed} for line in run] for run in lines]
    resumed_lines = timeless[1]
    assert [line["step"] for line in resumed_lines][-2:] == [3, 4]
    assert resumed_lines[-2:] == timeless[0][-2:]


def test_impossible_lora_flags_are_one_sentence():
    import utils.lora

    flags = types.SimpleNamespace(use_vllm=True, use_dora=True, lora_r=4)
    plain = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=None))
    with pytest.raises(ValueError, match=r"^--use_dora with --use_vllm: .*LoRA only\.$"):
        utils.lora.check_args(flags, plain)
    zero3 = types.SimpleNamespace(
        state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3))
    )
    with pytest.raises(ValueError, match=r"ZeRO-3 cannot; use ZeRO-2\.$"):
        utils.lora.check_args(types.SimpleNamespace(use_vllm=False, use_dora=False, lora_r=4), zero3)
    with pytest.raises(ValueError, match=r"^--lora_r 0: the rank must be at least 1\.$"):
        utils.lora.check_args(types.SimpleNamespace(use_vllm=False, use_dora=False, lora_r=0), plain)


@pytest.mark.parametrize("script", ["sft", "dpo", "reward", "ppo", "rloo", "grpo", "online_dpo"])
def test_lora_flags_default_to_trls_model_config(script):
    """Every LoRA flag a script shares with TRL 1.16's ModelConfig has its default (reward.py's task type aside:
    a reward model is a sequence classifier, docs/lora.md)."""
    import dataclasses
    import importlib

    import trl

    ours = {f.name: f.default for f in dataclasses.fields(importlib.import_module(script).Args)}
    theirs = {f.name: f.default for f in dataclasses.fields(trl.ModelConfig)}
    shared = [
        n
        for n in ours
        if n in theirs and (n.startswith("lora_") or n in ("use_peft", "use_rslora", "use_dora"))
    ]
    assert {"use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"} <= set(shared)
    differ = {n: (ours[n], theirs[n]) for n in shared if ours[n] != theirs[n]}
    assert differ == ({"lora_task_type": ("SEQ_CLS", "CAUSAL_LM")} if script == "reward" else {})


@pytest.mark.parametrize("script", ["rloo.py", "grpo.py"])
def test_bf16_lora_run_finishes_with_the_base_unchanged(world, lab, tmp_path, script):
    """--bf16 --use_peft (bf16 autocast over float32 weights): two updates and the save finish, the adapter
    moved, the base's weights stay bit for bit, and the merged save is finite."""
    run_script(script_flags(script, world, lab, tmp_path, "--bf16", "True"))
    base, trained = weights(lab / "policy"), checkpoint_tensors(tmp_path / "model")
    moved = [k for k in trained if k.endswith("lora_B.default.weight") and trained[k].abs().max() > 0]
    assert moved, sorted(trained)
    tied = {"lm_head.weight": "model.embed_tokens.weight"}  # a checkpoint keeps one name of a tied pair
    names = {key: key.removeprefix("base_model.model.").replace(".base_layer.", ".") for key in trained}
    names = {key: tied.get(name, name) for key, name in names.items()}
    compared = [key for key in trained if ".lora_" not in key]
    assert {names[key] for key in compared} == set(base), sorted({names[key] for key in compared} ^ set(base))
    assert all(torch.equal(trained[key], base[names[key]]) for key in compared)
    saved = weights(tmp_path / "model")
    assert saved.keys() == base.keys() and all(v.isfinite().all() for v in saved.values())
