"""ddpo.py: the DDIM step log-probability against diffusers and the Gaussian density, the per-prompt stat
tracker and the clipped loss on hand-computed cases, rewards, input checks, and runs through the command line
on the tiny Stable-Diffusion pipeline (log, image grid, save, exact resume, two processes)."""

import ast
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import tyro
from diffusers import DDIMScheduler
from PIL import Image

import ddpo
from conftest import ROOT, run_script, run_torchrun

TINY_RUN = [
    "--sample_num_steps", "3", "--sample_batch_size", "2", "--sample_num_batches_per_epoch", "2",
    "--train_batch_size", "2", "--num_logged_images", "4", "--per_prompt_stat_tracking_min_count", "2",
    "--train_learning_rate", "3e-3",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> Path:
    from tiny_diffusion import build_tiny_sd_pipeline

    out = tmp_path_factory.mktemp("tiny_sd")
    build_tiny_sd_pipeline(str(out), seed=0)
    return out


def test_tiny_pipeline_is_deterministic(tiny_sd, tmp_path):
    from safetensors.torch import load_file
    from tiny_diffusion import build_tiny_sd_pipeline

    build_tiny_sd_pipeline(str(tmp_path / "again"), seed=0)
    for part in ("unet/diffusion_pytorch_model", "vae/diffusion_pytorch_model", "text_encoder/model"):
        a, b = load_file(f"{tiny_sd}/{part}.safetensors"), load_file(f"{tmp_path}/again/{part}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tiny_sd / "tokenizer" / "tokenizer.json").read_text() == (
        tmp_path / "again" / "tokenizer" / "tokenizer.json"
    ).read_text()


def sd_scheduler(num_steps: int, **config) -> DDIMScheduler:
    sd_config = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False)
    scheduler = DDIMScheduler(**{**sd_config, "set_alpha_to_one": False, "steps_offset": 1, **config})
    scheduler.set_timesteps(num_steps)
    return scheduler


# ---------------------------------------------------------------- the DDIM step and its log-probability


@pytest.mark.parametrize("config", [{}, {"prediction_type": "v_prediction"}, {"clip_sample": True}])
def test_step_log_prob_is_the_gaussian_density(config):
    """Mean and std of the step from diffusers' DDIMScheduler.step; the density from the formula, in loops."""
    torch.manual_seed(0)
    scheduler, eta = sd_scheduler(10, **config), 0.7
    timestep = scheduler.timesteps[[2, 9]]  # the last step uses the final alpha
    latents, model_output, prev = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    _, log_prob = ddpo.ddim_step_with_logprob(scheduler, model_output, timestep, latents, eta, prev)
    for i in range(2):
        one = dict(model_output=model_output[i : i + 1], timestep=int(timestep[i]), sample=latents[i : i + 1])
        mean = scheduler.step(**one, eta=eta, variance_noise=torch.zeros(1, 4, 3, 3)).prev_sample
        shifted = scheduler.step(**one, eta=eta, variance_noise=torch.ones(1, 4, 3, 3)).prev_sample
        std = (shifted - mean)[0, 0, 0, 0].item()
        total = 0.0
        for x, m in zip(prev[i].flatten().tolist(), mean.flatten().tolist()):
            total += -((x - m) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        assert log_prob[i].item() == pytest.approx(total / prev[i].numel(), rel=1e-5)


def test_sampled_step_matches_diffusers_step_with_the_same_noise():
    scheduler, eta = sd_scheduler(5), 1.0
    latents, model_output = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    timestep = scheduler.timesteps[[0, 0, 0]]
    torch.manual_seed(1)
    prev, log_prob = ddpo.ddim_step_with_logprob(scheduler, model_output, timestep, latents, eta)
    torch.manual_seed(1)
    noise = torch.randn(3, 4, 2, 2)
    expected = scheduler.step(
        model_output, int(timestep[0]), latents, eta=eta, variance_noise=noise
    ).prev_sample
    torch.testing.assert_close(prev, expected, rtol=1e-5, atol=1e-6)
    # the sample is mean + std * noise: its log-density is the standard normal's of the noise minus log std
    std = ddpo.ddim_step_coefficients(scheduler, timestep)[2].sqrt() * eta
    standard = -0.5 * noise**2 - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(log_prob, standard.mean(dim=(1, 2, 3)) - std.log(), rtol=1e-5, atol=1e-5)


def test_recomputed_log_probs_equal_the_sampling_ones(tiny_sd):
    """With unchanged weights (LoRA added, B = 0), every step recomputed in training order has ratio 1."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.unet.add_adapter(LoraConfig(r=2, init_lora_weights="gaussian", target_modules=ddpo.LORA_TARGETS))
    args = ddpo.Args(sample_num_steps=4, sample_guidance_scale=5.0)
    scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(args.sample_num_steps)
    torch.manual_seed(0)
    with torch.no_grad():
        embeds = ddpo.encode_prompts(pipe.tokenizer, pipe.text_encoder, ["cat", "dog", "owl"])
        negative = ddpo.encode_prompts(pipe.tokenizer, pipe.text_encoder, [""])
        samples = ddpo.sample_trajectories(pipe.unet, pipe.vae, scheduler, embeds, negative, args)
    assert samples["latents"].shape == (3, 4, 4, 16, 16) and samples["images"].shape == (3, 3, 32, 32)
    torch.testing.assert_close(samples["latents"][:, 1:], samples["next_latents"][:, :-1])
    # as in training: samples shuffled, each with its own order of steps, trained in batches of 2
    order = torch.rand(3, 4).argsort(dim=1)
    rows = torch.arange(3)[:, None]
    shuffled = {key: samples[key][[2, 0, 1]][rows, order] for key in ddpo.TRAJECTORY_KEYS}
    shuffled["prompt_embeds"] = embeds[[2, 0, 1]]
    pipe.unet.train()
    for start in (0, 2):
        batch = {key: value[start : start + 2] for key, value in shuffled.items()}
        for step in range(4):
            log_prob = ddpo.step_log_prob(pipe.unet, scheduler, batch, step, negative, args)
            old = batch["log_probs"][:, step]
            torch.testing.assert_close(log_prob, old, rtol=0, atol=1e-5)
            _, approx_kl, clipfrac = ddpo.ddpo_loss(log_prob, old, torch.ones_like(old), 1e-4, 5.0)
            assert approx_kl.item() < 1e-10 and clipfrac.item() == 0.0


# ---------------------------------------------------------------- advantages and loss


def test_per_prompt_stat_tracker_hand_computed():
    tracker = ddpo.PerPromptStatTracker(buffer_size=3, min_count=2)
    # "a" has 2 rewards (1, 3): its own mean 2, std 1; "b" has 1 < 2: batch mean 3, std sqrt(8/3)
    adv = tracker.update(["a", "a", "b"], [1.0, 3.0, 5.0])
    np.testing.assert_allclose(adv, [-1.0, 1.0, 2 / math.sqrt(8 / 3)], rtol=1e-5)
    # "a": 1, 3, 5 -> mean 3, std sqrt(8/3); "b": 5, 7 -> mean 6, std 1
    adv = tracker.update(["a", "b"], [5.0, 7.0])
    np.testing.assert_allclose(adv, [2 / math.sqrt(8 / 3), 1.0], rtol=1e-5)
    # the buffer keeps the last 3 of "a": 3, 5, 0 -> mean 8/3, std sqrt(38/9)
    restored = ddpo.PerPromptStatTracker(buffer_size=3, min_count=2)
    restored.load_state_dict(tracker.state_dict())
    for t in (tracker, restored):
        np.testing.assert_allclose(t.update(["a"], [0.0]), [(0 - 8 / 3) / math.sqrt(38 / 9)], rtol=1e-5)


def test_batch_advantages():
    np.testing.assert_allclose(
        ddpo.batch_advantages([1.0, 2.0, 3.0]), [-(1.5**0.5), 0.0, 1.5**0.5], rtol=1e-5
    )


def test_loss_hand_cases():
    def loss(log_prob, old, adv, clip_range=0.05, adv_clip_max=5.0):
        return [x.item() for x in ddpo.ddpo_loss(torch.tensor(log_prob), torch.tensor(old), torch.tensor(adv),
                                                 clip_range, adv_clip_max)]  # fmt: skip

    assert loss([0.3], [0.3], [-1.0]) == [1.0, 0.0, 0.0]  # ratio 1, advantage -1: loss 1
    assert loss([0.3], [0.3], [1.0]) == [-1.0, 0.0, 0.0]
    assert loss([0.3], [0.3], [10.0])[0] == -5.0  # advantage clipped to 5
    # ratio e^0.1 = 1.105 > 1 + 0.05: a positive advantage gains at most 1.05, a negative one pays it all
    kl = 0.5 * 0.1**2
    assert loss([0.1], [0.0], [1.0]) == pytest.approx([-1.05, kl, 1.0])
    assert loss([0.1], [0.0], [-1.0]) == pytest.approx([math.exp(0.1), kl, 1.0])
    assert loss([0.1, 0.0], [0.0, 0.0], [1.0, 2.0]) == pytest.approx([(-1.05 - 2.0) / 2, kl / 2, 0.5])


def test_loss_gradient_is_zero_where_clipped():
    log_prob = torch.tensor([0.1, 0.0], requires_grad=True)
    loss, _, _ = ddpo.ddpo_loss(log_prob, torch.zeros(2), torch.tensor([1.0, 2.0]), 0.05, 5.0)
    loss.backward()
    torch.testing.assert_close(
        log_prob.grad, torch.tensor([0.0, -2.0 / 2])
    )  # d(-A ratio / B)/dlogp at ratio 1


# ---------------------------------------------------------------- rewards and input checks


def test_jpeg_rewards_prefer_flat_images():
    flat = Image.new("RGB", (32, 32), (120, 30, 200))
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    compressibility = ddpo.jpeg_compressibility([flat, noisy], ["a", "b"])
    assert compressibility[0] > compressibility[1] and compressibility[0] < 0
    assert ddpo.jpeg_incompressibility([flat, noisy], ["a", "b"]) == [-r for r in compressibility]


def test_aesthetic_scorer_on_a_tiny_clip(tmp_path):
    """The scorer loads a CLIP directory and a LAION-style head (keys layers.<i>.*) and scores each image."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel
    from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    torch.manual_seed(0)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    vision = dict(text, image_size=32, patch_size=8)
    clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()
    clip.save_pretrained(tmp_path / "clip")
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size=32).save_pretrained(tmp_path / "clip")
    sizes = [(8, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    head = {f"layers.{i}.weight": torch.randn(o, n) / n**0.5 for i, (n, o) in zip((0, 2, 4, 6, 7), sizes)}
    head.update({f"layers.{i}.bias": torch.zeros(o) for i, (_, o) in zip((0, 2, 4, 6, 7), sizes)})
    torch.save(head, tmp_path / "head.pth")
    args = ddpo.Args(reward_fn="aesthetic", aesthetic_clip_model=str(tmp_path / "clip"))
    args.aesthetic_head_path = str(tmp_path / "head.pth")
    scorer = ddpo.make_reward_fn(args, torch.device("cpu"))
    images = [Image.new("RGB", (32, 32), (200, 10, 10)), Image.new("RGB", (32, 32), (10, 10, 200))]
    scores = scorer(images, ["a", "b"])
    # by hand: the projected CLIP image embedding, L2-normalised, through the 5 linear layers (dropout off)
    pixels = torch.tensor(np.stack([np.asarray(i, dtype=np.float32) / 255 for i in images])).permute(
        0, 3, 1, 2
    )
    mean, std = torch.tensor(OPENAI_CLIP_MEAN), torch.tensor(OPENAI_CLIP_STD)
    pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    with torch.no_grad():
        x = clip.visual_projection(clip.vision_model(pixel_values=pixels).pooler_output)
        x = x / x.norm(dim=-1, keepdim=True)
        for i in (0, 2, 4, 6, 7):
            x = x @ head[f"layers.{i}.weight"].T + head[f"layers.{i}.bias"]
    np.testing.assert_allclose(scores, x.squeeze(-1).numpy(), rtol=1e-3, atol=1e-4)


def test_reward_fn_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def redness(images, prompts):\n    return [img.getpixel((0, 0))[0] for img in images]\n")
    fn = ddpo.make_reward_fn(ddpo.Args(reward_fn=f"{path}:redness"), torch.device("cpu"))
    assert fn([Image.new("RGB", (4, 4), (7, 0, 0))], ["x"]) == [7]
    with pytest.raises(ValueError, match="no function named 'blueness'"):
        ddpo.make_reward_fn(ddpo.Args(reward_fn=f"{path}:blueness"), torch.device("cpu"))


def check(tmp_path, **kwargs):
    return ddpo.check_args(ddpo.Args(output_dir=str(tmp_path / "out"), **kwargs))


def test_bad_input_gets_one_clear_error(tmp_path):
    assert check(tmp_path) == list(ddpo.ANIMALS)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    cases = [
        ({"sample_eta": 0.0}, "--sample_eta must be > 0"),
        ({"reward_fn": "aesthetic"}, "needs --aesthetic_head_path"),
        (
            {"reward_fn": "aesthetic", "aesthetic_head_path": str(tmp_path / "no.pth")},
            "needs --aesthetic_head_path",
        ),
        ({"prompt_file": str(empty)}, "has no prompts"),
        ({"prompt_file": str(tmp_path / "missing.txt")}, "does not exist"),
        ({"reward_fn": "sharpness"}, "no built-in reward"),
        (
            {"sample_batch_size": 3, "sample_num_batches_per_epoch": 1, "train_batch_size": 2},
            "divisible by --train_batch_size",
        ),
        ({"train_gradient_accumulation_steps": 3}, "divisible by --train_gradient_accumulation_steps"),
        ({"train_timestep_fraction": 0.01}, "--train_timestep_fraction"),
        ({"pretrained_model": str(tmp_path / "nowhere")}, "does not exist"),
        ({"resume_from_checkpoint": str(tmp_path)}, "neither a checkpoint"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            check(tmp_path, **kwargs)
            pytest.fail(f"no error for {kwargs}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="is not empty"):
        check(tmp_path)


def test_every_flag_has_a_doc_line(capsys):
    tree = ast.parse((ROOT / "ddpo.py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args").body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            doc = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), node.target.id
    with pytest.raises(SystemExit):
        tyro.cli(ddpo.Args, args=["--help"], use_underscores=True)
    help_text = capsys.readouterr().out
    for node in body:
        if isinstance(node, ast.AnnAssign):
            assert f"--{node.target.id}" in help_text


def test_cli_rejects_eta_zero_and_keeps_the_output_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    args = ["ddpo.py", "--sample_eta", "0", "--output_dir", str(out), "--overwrite_output_dir"]
    proc = run_script(args, timeout=120, check=False)
    assert proc.returncode != 0 and "--sample_eta must be > 0" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


# ---------------------------------------------------------------- end to end


def scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    values = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    values["images"] = len(events.Images("images/samples"))
    return values


def lora_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "pytorch_lora_weights.safetensors"))


def test_train_log_save_and_resume_exactly(tiny_sd, tmp_path):
    ddpo_py = str(ROOT / "ddpo.py")
    common = [ddpo_py, "--pretrained_model", str(tiny_sd), *TINY_RUN, "--num_epochs", "3"]
    proc = run_script(
        [*common, "--output_dir", "a", "--run_name", "a", "--num_checkpoint_limit", "2"], cwd=tmp_path
    )
    assert "logs: runs/a/ (TensorBoard, images/); watch with: tensorboard --logdir runs" in proc.stdout
    assert proc.stdout.count(" | objective/reward_mean ") == 3  # a metrics line per epoch
    assert proc.stdout.rstrip().endswith("done: logs in runs/a/; model in a/ (card: README.md, curves.png)")
    logged = [
        json.loads(line) for line in (tmp_path / "runs" / "a" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [line["step"] for line in logged] == [2, 4, 6] and "objective/reward_mean" in logged[0]

    metrics = scalars(tmp_path / "runs" / "a")
    for name in ("objective/reward_mean", "objective/reward_std", "loss/policy_avg", "policy/approxkl_avg",
                 "policy/clipfrac_avg", "epoch", "inner_epoch", "time/samples_per_second"):  # fmt: skip
        assert name in metrics and all(math.isfinite(v) for v in metrics[name]), name
    assert len(metrics["objective/reward_mean"]) == 3 and metrics["images"] == 3
    assert metrics["epoch"] == [0, 0, 1, 1, 2, 2]  # 4 samples in batches of 2: two optimizer steps per epoch
    assert len(set(metrics["loss/policy_avg"])) > 1 and max(metrics["policy/approxkl_avg"]) > 0
    grids = sorted(p.name for p in (tmp_path / "runs" / "a" / "images").iterdir())
    assert grids == ["epoch_0000.png", "epoch_0001.png", "epoch_0002.png"]
    assert Image.open(tmp_path / "runs" / "a" / "images" / grids[0]).size == (4 * 128, 128 + 14)

    out = tmp_path / "a"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    card = (out / "README.md").read_text()
    assert "objective/reward_mean" in card and "| num_epochs | `3` |" in card  # the resolved flags
    assert "![training curves](curves.png)" in card and (out / "curves.png").stat().st_size > 1000
    assert card.startswith("---\n") and "library_name: diffusers" in card and f"base_model: {tiny_sd}" in card
    final = lora_weights(out)
    assert max(v.abs().max().item() for k, v in final.items() if "lora.up" in k) > 0  # B moved from zero

    # the trained LoRA loads into the pipeline
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.load_lora_weights(str(out))
    assert any("lora" in name for name, _ in pipe.unet.named_parameters())

    # resuming after epoch 1 (rewards now computed in a thread pool) ends with the very same weights
    resume = ["--resume_from", str(out / "checkpoints" / "checkpoint_1"), "--async_reward_computation"]
    run_script([*common, "--output_dir", "b", "--run_name", "b", *resume], cwd=tmp_path)
    assert scalars(tmp_path / "runs" / "b")["epoch"] == [2, 2]
    resumed = lora_weights(tmp_path / "b")
    assert resumed.keys() == final.keys()
    for key in final:
        torch.testing.assert_close(resumed[key], final[key], rtol=0, atol=0)


def test_two_processes_full_unet(tiny_sd, tmp_path):
    """Two CPU processes (gloo), the whole UNet trained: the output is a pipeline directory."""
    from diffusers import StableDiffusionPipeline

    args = [str(ROOT / "ddpo.py"), "--pretrained_model", str(tiny_sd), *TINY_RUN, "--num_epochs", "1"]
    run_torchrun([*args, "--no_use_lora", "--output_dir", "out", "--run_name", "r"], cwd=tmp_path)
    checkpoint = tmp_path / "out" / "checkpoints" / "checkpoint_0"
    expected = {"checkpoint.pt", "rng_state_0.json", "rng_state_1.json", "trainer_state.json"}
    assert {p.name for p in checkpoint.iterdir()} == expected
    card = (tmp_path / "out" / "README.md").read_text()
    assert "of 8 images, the full UNet" in card  # 2 processes x 2 batches x 2 images
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "out")
    base = StableDiffusionPipeline.from_pretrained(tiny_sd)
    changed = [not torch.equal(p, q) for p, q in zip(pipe.unet.parameters(), base.unet.parameters())]
    assert any(changed)


def test_sigterm_while_sampling_saves_the_epoch_before_and_resumes_exactly(tiny_sd, tmp_path):
    """SIGTERM during epoch 1's sampling (its first prompt drawn), no periodic checkpoint: epoch 0 is saved
    with the random state it ended with, epoch 1 runs again on resume, the weights equal an uninterrupted run."""
    common = [str(ROOT / "ddpo.py"), "--pretrained_model", str(tiny_sd), *TINY_RUN, "--num_epochs", "3"]
    common += ["--save_steps", "10"]
    run_script([*common, "--output_dir", "a", "--run_name", "a"], cwd=tmp_path)
    cut = [*common, "--output_dir", "c", "--run_name", "c"]
    preempted = run_script([str(ROOT / "tests" / "sigterm_at.py"), "random.Random.choice", "5", *cut],
                           cwd=tmp_path, check=False)  # fmt: skip
    saved = os.path.join("c", "checkpoints", "checkpoint_0")
    assert preempted.returncode == 143, preempted.stderr[-3000:]
    assert preempted.stderr.strip().splitlines()[-1] == (
        f"ddpo.py: interrupted: SIGTERM received; saved {saved} at step 0 (step 1 was cut short and runs "
        f"again); continue with --resume_from_checkpoint {saved}"
    )
    run_script([*cut, "--resume_from_checkpoint", "latest"], cwd=tmp_path)
    whole, resumed = lora_weights(tmp_path / "a"), lora_weights(tmp_path / "c")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
