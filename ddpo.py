"""Denoising Diffusion Policy Optimization (DDPO) for Stable-Diffusion text-to-image models, in one file.

Black, Janner, Du, Kostrikov, Levine, "Training Diffusion Models with Reinforcement Learning" (2023),
https://arxiv.org/abs/2305.13301. Denoising is a multi-step decision process: with DDIM sampling at eta > 0
each step x_t -> x_{t-1} is a Gaussian with a known density, so a reward on the final image can be maximised
with a policy gradient. Every epoch samples images keeping each latent, timestep and step log-probability;
scores them; normalises the rewards per prompt into advantages; then runs PPO-style clipped updates on the
denoising steps under the current UNet (LoRA adapters by default).

Offline example on CPU (a tiny random pipeline, a few minutes):
    python benchmark/tiny/tiny_diffusion.py --output_dir /tmp/tiny-sd
    python ddpo.py --pretrained_model /tmp/tiny-sd --sample_num_steps 10 --sample_batch_size 8 \
        --train_batch_size 4 --num_epochs 5 --output_dir /tmp/ddpo-tiny
Stable Diffusion v1.5 on GPUs:
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml ddpo.py \
        --pretrained_model runwayml/stable-diffusion-v1-5 --reward_fn jpeg_compressibility --num_epochs 50
"""

if __name__ == "__main__":  # before the heavy imports: a Ctrl-C while they load is one line, not a traceback
    import utils.signals

    utils.signals.stop_before_training()

import collections
import importlib.util
import io
import json
import os
import random
import re
import shutil
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import torch
import tyro
from PIL import Image, ImageDraw

import utils.checkpoint
import utils.run
import utils.tracking
from utils.run import UsageError

ANIMALS = (
    "cat dog horse cow pig sheep goat rabbit fox wolf bear lion tiger zebra giraffe elephant monkey panda "
    "koala kangaroo deer owl eagle duck swan penguin frog turtle snake whale dolphin shark octopus crab "
    "butterfly squirrel hedgehog camel llama raccoon"
).split()  # the built-in prompts: the paper's "simple animals"
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the UNet's attention projections
STD_EPS = 1e-6  # added to a standard deviation before dividing by it
TRAJECTORY_KEYS = ("timesteps", "latents", "next_latents", "log_probs")  # (B, T, ...) tensors, one per step


@dataclass
class Args:
    # Run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run name starts with it)"""
    seed: int = 0
    """seed of the experiment (a CPU run is reproducible)"""
    run_name: str | None = None
    """TensorBoard directory runs/<run_name>; None: <exp_name>__<seed>__<unix time>"""
    track: bool = False
    """also log to Weights & Biases (WANDB_MODE=offline: without network)"""
    wandb_project_name: str = "ddpo"
    """W&B project name"""
    wandb_entity: str | None = None
    """W&B entity (team); None: the default one"""
    output_dir: str = "models/ddpo"
    """where the LoRA weights (or the whole pipeline), a model card and checkpoints/ are written"""
    overwrite_output_dir: bool = False
    """start over in a non-empty --output_dir (its contents moved to <output_dir>.replaced-<time>)"""
    push_to_hub: bool = False
    """push --output_dir (without checkpoints/) to a hub repository named like it, at the end"""
    num_epochs: int = 100
    """epochs; each samples images and then trains on them"""
    save_steps: Annotated[int, tyro.conf.arg(aliases=("--save_freq",))] = 1
    """checkpoint every this many epochs into <output_dir>/checkpoints/checkpoint_<epoch>"""
    save_total_limit: Annotated[int, tyro.conf.arg(aliases=("--num_checkpoint_limit",))] = 5
    """keep only the newest this many checkpoints"""
    resume_from_checkpoint: Annotated[str | None, tyro.conf.arg(aliases=("--resume_from",))] = None
    """a checkpoint, a checkpoints/ directory, or `latest` (the newest in <output_dir>/checkpoints)"""
    mixed_precision: Literal["no", "fp16", "bf16"] = "fp16"
    """precision of the frozen weights and forward passes; fp16 falls back to "no" without a GPU"""
    allow_tf32: bool = True
    """allow TF32 matrix multiplications on Ampere or newer GPUs"""
    num_logged_images: int = 8
    """sampled images (with prompt and reward) in each epoch's logged grid"""

    # Models
    pretrained_model: str = "runwayml/stable-diffusion-v1-5"
    """Stable-Diffusion pipeline: a hub id or a directory saved with save_pretrained"""
    pretrained_revision: Annotated[str, tyro.conf.arg(aliases=("--model_revision",))] = "main"
    """revision of --pretrained_model on the hub"""
    trust_remote_code: bool = False
    """let hub pipelines and the CLIP model run their own code"""
    use_lora: bool = True
    """train LoRA adapters on the UNet's attention projections; --no_use_lora: the whole UNet"""
    lora_rank: int = 4
    """rank (and alpha) of the LoRA adapters"""

    # Prompts and reward
    prompt_file: str | None = None
    """text file with one prompt per line; None: the built-in simple animal names"""
    negative_prompts: str = ""
    """prompt of the unconditional branch of classifier-free guidance"""
    reward_fn: str = "jpeg_compressibility"
    """jpeg_compressibility, jpeg_incompressibility, aesthetic, or file.py:function(pil_images, prompts)"""
    aesthetic_clip_model: str = "openai/clip-vit-large-patch14"
    """CLIP model (hub id or directory) whose image features the aesthetic head scores"""
    aesthetic_head_path: str | None = None
    """local .pth state dict of the LAION aesthetic MLP head (for --reward_fn aesthetic)"""
    async_reward_computation: bool = False
    """compute rewards in a thread pool while the next batch is sampled"""
    max_workers: int = 2
    """threads of the reward pool when --async_reward_computation"""

    # Sampling
    sample_num_steps: int = 50
    """number of DDIM denoising steps"""
    sample_eta: float = 1.0
    """DDIM eta; > 0, so that every step is stochastic and has a log-probability"""
    sample_guidance_scale: float = 5.0
    """classifier-free guidance scale (no guidance at 1.0 or below)"""
    sample_batch_size: int = 1
    """images sampled at once, per process"""
    sample_num_batches_per_epoch: int = 2
    """sampling batches per epoch, per process"""

    # Algorithm (training)
    train_batch_size: int = 1
    """samples per training forward pass, per process"""
    train_use_8bit_adam: bool = False
    """use bitsandbytes' 8-bit AdamW"""
    train_learning_rate: float = 3e-4
    """learning rate"""
    train_adam_beta1: float = 0.9
    """Adam beta1"""
    train_adam_beta2: float = 0.999
    """Adam beta2"""
    train_adam_weight_decay: float = 1e-4
    """AdamW weight decay"""
    train_adam_epsilon: float = 1e-8
    """Adam epsilon"""
    train_gradient_accumulation_steps: int = 1
    """training batches (each over all its trained steps) per optimizer step"""
    train_max_grad_norm: float = 1.0
    """gradients are clipped to this global norm"""
    train_num_inner_epochs: int = 1
    """passes over each epoch's samples"""
    train_cfg: bool = True
    """classifier-free guidance in training as in sampling (else the recomputed log-probs differ)"""
    train_adv_clip_max: float = 5.0
    """advantages are clipped to [-train_adv_clip_max, train_adv_clip_max]"""
    train_clip_range: float = 1e-4
    """PPO clip range of the ratio (tiny: log-probs are per-element means)"""
    train_timestep_fraction: float = 1.0
    """fraction of each trajectory's denoising steps trained on (random per sample)"""
    per_prompt_stat_tracking: bool = True
    """normalise rewards by a running mean/std per prompt (else over the whole batch)"""
    per_prompt_stat_tracking_buffer_size: int = 16
    """rewards kept per prompt for its running statistics"""
    per_prompt_stat_tracking_min_count: int = 16
    """a prompt with fewer rewards than this is normalised over the whole batch"""

    # Filled in at runtime
    world_size: int = 0
    """number of processes (filled in at runtime)"""
    samples_per_epoch: int = 0
    """images sampled per epoch over all processes (filled in at runtime)"""
    num_train_timesteps: int = 0
    """denoising steps trained per sample (filled in at runtime)"""


# ---- the math ----------------------------------------------------------------------------------------------


def ddim_step_coefficients(scheduler, timestep: torch.Tensor):
    """alpha_bar_t, alpha_bar_prev and the DDIM variance sigma_t^2 / eta^2 (Song et al. 2021, eq. 16),
    each (B,) for the per-sample timesteps (B,); the previous timestep is t - num_train_timesteps // steps."""
    alphas_cumprod = scheduler.alphas_cumprod.to(timestep.device)
    prev_timestep = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alpha_t = alphas_cumprod[timestep]
    final_alpha = scheduler.final_alpha_cumprod.to(timestep.device)
    alpha_prev = torch.where(prev_timestep >= 0, alphas_cumprod[prev_timestep.clamp(min=0)], final_alpha)
    variance = (1 - alpha_prev) / (1 - alpha_t) * (1 - alpha_t / alpha_prev)
    return alpha_t, alpha_prev, variance


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2) = -(x - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)."""
    return -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * np.log(2 * np.pi)


def ddim_step_with_logprob(scheduler, model_output, timestep, latents, eta: float, prev_latents=None):
    """One DDIM step x_t -> x_{t-1} and the log-probability of x_{t-1} under the step's Gaussian:

    x_{t-1} ~ N(sqrt(a_prev) x0_pred + sqrt(1 - a_prev - sigma^2) eps_pred, sigma^2), sigma = eta * sqrt(var),
    x0_pred and eps_pred from the UNet output (epsilon or v prediction). Draws x_{t-1} unless `prev_latents`
    is given (training). latents (B, C, H, W), timestep (B,) -> (x_{t-1}, log_prob (B,)); log_prob is the MEAN
    over the C*H*W elements, as in the reference implementations (hence a clip range of 1e-4).
    """
    model_output, latents = model_output.float(), latents.float()
    alpha_t, alpha_prev, variance = (c.view(-1, 1, 1, 1) for c in ddim_step_coefficients(scheduler, timestep))
    if scheduler.config.prediction_type == "v_prediction":
        x0_pred = alpha_t.sqrt() * latents - (1 - alpha_t).sqrt() * model_output
        eps_pred = alpha_t.sqrt() * model_output + (1 - alpha_t).sqrt() * latents
    else:
        x0_pred, eps_pred = (latents - (1 - alpha_t).sqrt() * model_output) / alpha_t.sqrt(), model_output
    if scheduler.config.clip_sample:
        x0_pred = x0_pred.clamp(-scheduler.config.clip_sample_range, scheduler.config.clip_sample_range)
    std = eta * variance.sqrt()
    mean = alpha_prev.sqrt() * x0_pred + (1 - alpha_prev - std**2).sqrt() * eps_pred
    if prev_latents is None:
        prev_latents = mean + std * torch.randn_like(mean)
    # the sample is a constant: the gradient flows through the mean, i.e. through the UNet
    log_prob = gaussian_log_prob(prev_latents.detach().float(), mean, std)
    return prev_latents, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


class PerPromptStatTracker:
    """Advantages (r - mean) / (std + STD_EPS) over each prompt's last `buffer_size` rewards; while a prompt
    has fewer than `min_count`, over the whole batch passed to `update` (population std)."""

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size, self.min_count = buffer_size, min_count
        self.stats: dict[str, collections.deque] = {}

    def update(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        rewards, prompt_array = np.asarray(rewards, dtype=np.float64), np.array(prompts, dtype=object)
        advantages = np.empty_like(rewards)
        for prompt in dict.fromkeys(prompts):  # unique prompts, in order of first appearance
            mask = prompt_array == prompt
            buffer = self.stats.setdefault(prompt, collections.deque(maxlen=self.buffer_size))
            buffer.extend(rewards[mask].tolist())
            reference = np.array(buffer) if len(buffer) >= self.min_count else rewards
            advantages[mask] = (rewards[mask] - reference.mean()) / (reference.std() + STD_EPS)
        return advantages

    def state_dict(self) -> dict:
        return {prompt: list(buffer) for prompt, buffer in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {p: collections.deque(r, maxlen=self.buffer_size) for p, r in state.items()}


def batch_advantages(rewards: np.ndarray) -> np.ndarray:
    """Advantages normalised by the statistics of the whole batch: (r - mean) / (std + STD_EPS)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    return (rewards - rewards.mean()) / (rewards.std() + STD_EPS)


def ddpo_loss(log_probs, old_log_probs, advantages, clip_range: float, adv_clip_max: float):
    """PPO clipped surrogate for one denoising step of a batch (all (B,) tensors):

    A = clip(advantages, -adv_clip_max, adv_clip_max), ratio = exp(log_probs - old_log_probs),
    loss = mean(max(-A * ratio, -A * clip(ratio, 1 - clip_range, 1 + clip_range))),
    with approx_kl = mean((log_probs - old_log_probs)^2) / 2 and the fraction of clipped ratios.
    """
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_probs - old_log_probs)
    clipped_ratio = ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio).mean()
    approx_kl = 0.5 * ((log_probs - old_log_probs) ** 2).mean()
    clipfrac = ((ratio - 1.0).abs() > clip_range).float().mean()
    return loss, approx_kl, clipfrac


# ---- rewards -----------------------------------------------------------------------------------------------
# f(PIL images, prompts) -> one float per image


def jpeg_size_kb(image: Image.Image) -> float:
    """Size of the image saved as JPEG at quality 95, in kilobytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def jpeg_compressibility(images: list[Image.Image], prompts: list[str]) -> list[float]:
    """Minus the JPEG size in kB: smaller files, i.e. simpler images, are better."""
    return [-jpeg_size_kb(image) for image in images]


def jpeg_incompressibility(images: list[Image.Image], prompts: list[str]) -> list[float]:
    """The JPEG size in kB: more detailed images are better."""
    return [jpeg_size_kb(image) for image in images]


class AestheticScorer:
    """The LAION aesthetic score (about 1-10): an MLP on the L2-normalised CLIP image embedding."""

    def __init__(self, clip_model: str, head_path: str, device: torch.device, remote_code: bool = False):
        from transformers import AutoImageProcessor, CLIPModel

        try:
            self.clip = CLIPModel.from_pretrained(clip_model, trust_remote_code=remote_code).eval().to(device)
            self.processor = AutoImageProcessor.from_pretrained(clip_model, trust_remote_code=remote_code)
        except OSError as error:
            raise SystemExit(
                f"Could not load the CLIP model '{clip_model}' ({type(error).__name__}); pass "
                "--aesthetic_clip_model a local directory holding a CLIPModel and its image processor."
            ) from None
        linear, dropout = torch.nn.Linear, torch.nn.Dropout
        self.head = torch.nn.Sequential(
            linear(self.clip.config.projection_dim, 1024),
            dropout(0.2),
            linear(1024, 128),
            dropout(0.2),
            linear(128, 64),
            dropout(0.1),
            linear(64, 16),
            linear(16, 1),
        )
        state = torch.load(head_path, map_location="cpu", weights_only=True)  # keys layers.<i>.weight/bias
        self.head.load_state_dict({key.removeprefix("layers."): value for key, value in state.items()})
        self.head.eval().to(device)

    @torch.no_grad()
    def __call__(self, images: list[Image.Image], prompts: list[str]) -> list[float]:
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.clip.device)
        embeddings = self.clip.visual_projection(self.clip.vision_model(pixel_values=pixels).pooler_output)
        return self.head(embeddings / embeddings.norm(dim=-1, keepdim=True)).squeeze(-1).tolist()


def make_reward_fn(args: Args, device: torch.device):
    """The reward function named by --reward_fn."""
    if args.reward_fn in ("jpeg_compressibility", "jpeg_incompressibility"):
        return globals()[args.reward_fn]
    if args.reward_fn == "aesthetic":
        return AestheticScorer(
            args.aesthetic_clip_model, args.aesthetic_head_path, device, args.trust_remote_code
        )
    path, _, name = args.reward_fn.rpartition(":")
    spec = importlib.util.spec_from_file_location("ddpo_user_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise UsageError(f"--reward_fn: {path} defines no function named '{name}'.")
    return getattr(module, name)


# ---- rollout -----------------------------------------------------------------------------------------------


def encode_prompts(tokenizer, text_encoder, prompts: list[str]) -> torch.Tensor:
    """CLIP text embeddings (B, max_length, D) of prompts padded to the tokenizer's maximum length."""
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True)
    return text_encoder(torch.tensor(ids.input_ids, device=text_encoder.device))[0]


def predict_noise(unet, latents, timesteps, prompt_embeds, negative_embeds, guidance_scale: float, cfg: bool):
    """UNet output; with `cfg`, classifier-free guidance uncond + guidance_scale * (cond - uncond)."""
    if not cfg:
        return unet(latents, timesteps, encoder_hidden_states=prompt_embeds).sample
    embeds = torch.cat([negative_embeds.expand(len(latents), -1, -1), prompt_embeds])
    output = unet(latents.repeat(2, 1, 1, 1), timesteps.repeat(2), encoder_hidden_states=embeds).sample
    uncond, cond = output.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


@torch.no_grad()
def sample_trajectories(unet, vae, scheduler, prompt_embeds, negative_embeds, args: Args) -> dict:
    """DDIM samples keeping every step, the trajectories DDPO trains on: timesteps (B, T), latents x_t and
    next_latents x_{t-1} (B, T, C, H, W), log_probs (B, T), and images (B, 3, H', W') in [0, 1]."""
    config = (unet.module if hasattr(unet, "module") else unet).config
    shape = (len(prompt_embeds), config.in_channels, config.sample_size, config.sample_size)
    latents = torch.randn(shape, device=prompt_embeds.device)
    guidance, eta, steps = args.sample_guidance_scale, args.sample_eta, []
    cfg = guidance > 1.0
    for t in scheduler.timesteps:
        timesteps = t.repeat(len(latents))
        noise_pred = predict_noise(unet, latents, timesteps, prompt_embeds, negative_embeds, guidance, cfg)
        next_latents, log_prob = ddim_step_with_logprob(scheduler, noise_pred, timesteps, latents, eta)
        steps.append((timesteps, latents, next_latents, log_prob))
        latents = next_latents
    images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample
    trajectories = {key: torch.stack(values, dim=1) for key, values in zip(TRAJECTORY_KEYS, zip(*steps))}
    return trajectories | {"images": (images.float() / 2 + 0.5).clamp(0, 1)}


def step_log_prob(unet, scheduler, batch: dict, step: int, negative_embeds, args: Args) -> torch.Tensor:
    """Log-probability (B,) under the current UNet of each sample's step `step` of its trajectory."""
    latents, timesteps = batch["latents"][:, step], batch["timesteps"][:, step]
    guidance, prompt_embeds = args.sample_guidance_scale, batch["prompt_embeds"]
    cfg = args.train_cfg and guidance > 1.0
    noise_pred = predict_noise(unet, latents, timesteps, prompt_embeds, negative_embeds, guidance, cfg)
    next_latents = batch["next_latents"][:, step]
    return ddim_step_with_logprob(scheduler, noise_pred, timesteps, latents, args.sample_eta, next_latents)[1]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """(B, 3, H, W) floats in [0, 1] -> PIL RGB images."""
    array = (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in array]


def image_grid(images: list[Image.Image], captions: list[str], tile: int = 128, columns: int = 4):
    """A PIL grid of images (resized to `tile` pixels), each with a caption strip below it."""
    rows, caption_height = (len(images) + columns - 1) // columns, 14
    grid = Image.new("RGB", (columns * tile, rows * (tile + caption_height)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, caption) in enumerate(zip(images, captions)):
        x, y = (i % columns) * tile, (i // columns) * (tile + caption_height)
        grid.paste(image.resize((tile, tile), Image.NEAREST), (x, y))
        draw.text((x + 2, y + tile + 1), caption, fill="black")
    return grid


# ---- checks and sizes --------------------------------------------------------------------------------------


def read_prompts(args: Args) -> list[str]:
    if args.prompt_file is None:
        return list(ANIMALS)
    if not os.path.isfile(args.prompt_file):
        raise UsageError(f"--prompt_file {args.prompt_file} does not exist.")
    with open(args.prompt_file, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise UsageError(f"--prompt_file {args.prompt_file} has no prompts (expected one prompt per line).")
    return prompts


def find_checkpoint(path: str, output_dir: str) -> str | None:
    """`path` if it is a checkpoint, else the newest complete checkpoint_<epoch> inside it (`latest`: in
    <output_dir>/checkpoints, where none means starting from scratch: None); damaged ones skipped are named.
    A damaged checkpoint named by its path is refused in one sentence."""
    latest, notes = path == "latest", []
    path = os.path.join(output_dir, "checkpoints") if latest else path
    if os.path.isfile(os.path.join(path, "checkpoint.pt")):
        problem = checkpoint_problem(path)
        if problem:
            raise UsageError(
                f"--resume_from_checkpoint {path} is damaged: {problem}; pass an earlier checkpoint."
            )
        return path
    names = [n for n in os.listdir(path) if re.fullmatch(r"checkpoint_\d+", n)] if os.path.isdir(path) else []
    if not names and not latest:
        raise UsageError(
            f"--resume_from_checkpoint {path} is neither a checkpoint nor a folder of checkpoint_<epoch>."
        )
    found = None
    for name in sorted(names, key=lambda n: int(n.split("_")[-1]), reverse=True):
        problem = checkpoint_problem(os.path.join(path, name))
        if problem is None:
            found = os.path.join(path, name)
            break
        notes.append(f"skipped {os.path.join(path, name)}: {problem}")
    if found is None:
        notes.append(
            f"--resume_from_checkpoint latest: no complete checkpoint in {path}; starting from scratch"
        )
    if utils.run.main_process():
        for note in notes:
            print(note)
    return found


def checkpoint_problem(path: str) -> str | None:
    """Why a checkpoint_<epoch> folder is incomplete (by the sizes in its trainer_state.json; an older
    checkpoint without one: by the zip of checkpoint.pt), or None."""
    guards = utils.checkpoint.safeguards()  # a copy without utils/safeguards.py checks the zip alone
    if guards and os.path.isfile(os.path.join(path, utils.checkpoint.STATE_FILE)):
        return guards.checkpoint_problem(path)
    return None if zipfile.is_zipfile(os.path.join(path, "checkpoint.pt")) else "checkpoint.pt is cut short"


def check_resumable(args: Args) -> None:
    """A checkpoint of another run (other defining flags) is refused in one sentence naming them."""
    guards = utils.checkpoint.safeguards()
    if guards is None:  # a copy without utils/safeguards.py trusts the flags
        return
    with open(os.path.join(args.resume_from_checkpoint, utils.checkpoint.STATE_FILE)) as f:
        saved = json.load(f).get("run")
    mismatch = guards.definition_mismatch(saved, guards.run_definition(args))
    if mismatch:
        raise UsageError(
            f"--resume_from_checkpoint {args.resume_from_checkpoint} belongs to another run ({mismatch}); "
            "resume with its flags, or start over with --overwrite_output_dir or another --output_dir."
        )


def holds_something(output_dir: str) -> bool:
    """Whether --output_dir holds anything but unfinished checkpoint writes."""
    if not os.path.isdir(output_dir):
        return False
    names = set(os.listdir(output_dir))
    checkpoints = os.path.join(output_dir, "checkpoints")
    if names == {"checkpoints"} and os.path.isdir(checkpoints):
        return bool(set(os.listdir(checkpoints)) - set(utils.checkpoint.leftovers(checkpoints)))
    return bool(names)


def fill_sizes(args: Args, world_size: int | None = None) -> Args:
    """Check the flags and fill in the sizes (the per-epoch ones once the world size is known)."""
    if args.sample_eta <= 0:
        raise UsageError(f"--sample_eta must be > 0 (got {args.sample_eta}): an eta-0 step has no log-prob.")
    args.num_train_timesteps = int(args.sample_num_steps * args.train_timestep_fraction)
    if not (args.train_timestep_fraction <= 1 and args.num_train_timesteps >= 1):
        raise UsageError("--train_timestep_fraction must be <= 1 and keep at least one denoising step.")
    sizes = (
        "num_epochs",
        "sample_num_steps",
        "sample_batch_size",
        "sample_num_batches_per_epoch",
        "train_batch_size",
        "train_gradient_accumulation_steps",
        "train_num_inner_epochs",
    )
    for flag in sizes:
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    samples = args.sample_batch_size * args.sample_num_batches_per_epoch
    if samples % args.train_batch_size:
        raise UsageError(f"the {samples} samples per epoch must be divisible by --train_batch_size.")
    if (samples // args.train_batch_size) % args.train_gradient_accumulation_steps:
        msg = f"the {samples // args.train_batch_size} training batches per epoch must be divisible by"
        raise UsageError(f"{msg} --train_gradient_accumulation_steps.")
    if args.per_prompt_stat_tracking_min_count > args.per_prompt_stat_tracking_buffer_size:
        raise UsageError("--per_prompt_stat_tracking_min_count must not exceed its buffer size.")
    if min(args.save_steps, args.save_total_limit, args.max_workers, args.lora_rank) < 1:
        raise UsageError("--save_steps, --save_total_limit, --max_workers and --lora_rank must be >= 1.")
    if world_size is not None:
        args.world_size = world_size
        args.samples_per_epoch = samples * world_size
    return args


def check_args(args: Args) -> list[str]:
    """Reject impossible flag values and missing files before any model is loaded; returns the prompts."""
    fill_sizes(args)
    head = args.aesthetic_head_path
    if args.reward_fn == "aesthetic" and not (head and os.path.isfile(head)):
        raise UsageError(f"--reward_fn aesthetic needs --aesthetic_head_path, a .pth file (got {head}).")
    path, _, name = args.reward_fn.rpartition(":")
    builtin = args.reward_fn in ("jpeg_compressibility", "jpeg_incompressibility", "aesthetic")
    if not builtin and not (path.endswith(".py") and name and os.path.isfile(path)):
        raise UsageError(f"--reward_fn {args.reward_fn} is no built-in reward nor existing file.py:function.")
    if args.pretrained_model.startswith(("/", ".", "~")) and not os.path.isdir(args.pretrained_model):
        raise UsageError(f"--pretrained_model {args.pretrained_model} does not exist.")
    if args.train_use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError("--train_use_8bit_adam needs the bitsandbytes package (pip install bitsandbytes).")
    if args.resume_from_checkpoint is not None:
        args.resume_from_checkpoint = find_checkpoint(args.resume_from_checkpoint, args.output_dir)
    if args.resume_from_checkpoint is not None:
        check_resumable(args)
    elif holds_something(args.output_dir) and not args.overwrite_output_dir:
        raise UsageError(f"--output_dir {args.output_dir} is not empty: pass --overwrite_output_dir.")
    return read_prompts(args)


# ---- checkpoints and output --------------------------------------------------------------------------------


def rng_states(run) -> dict:
    """This process's random states, the prompt sampler's among them (JSON-safe)."""
    version, internal, gauss = run.prompt_rng.getstate()
    return utils.checkpoint.rng_state({}) | {"prompts": [version, list(internal), gauss]}


def save_checkpoint(run, args: Args, epoch: int, step: int, rng: dict | None = None) -> str:
    """Trained weights, optimizer, stat tracker, epoch and every process's RNG states (JSON, no pickle; `rng`:
    those at the epoch's end), for an exact restart; written to tmp_checkpoint_<epoch>, then renamed."""
    accelerator = run.accelerator
    checkpoints = os.path.join(args.output_dir, "checkpoints")
    directory = os.path.join(checkpoints, f"tmp_checkpoint_{epoch}")
    if accelerator.is_main_process:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        params = accelerator.unwrap_model(run.unet).named_parameters()
        state = {"trained": {n: p.detach().cpu() for n, p in params if p.requires_grad}, "epoch": epoch}
        tracker_state = run.stat_tracker.state_dict() if run.stat_tracker else None
        state.update(optimizer=run.optimizer.state_dict(), global_step=step, tracker=tracker_state)
        torch.save(state, os.path.join(directory, "checkpoint.pt"))
    accelerator.wait_for_everyone()
    with open(os.path.join(directory, f"rng_state_{accelerator.process_index}.json"), "w") as f:
        json.dump(rng or rng_states(run), f)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # what defines the run, and every file's size (a resume checks both)
        record = {"epoch": epoch, "run": run.definition}
        guards = utils.checkpoint.safeguards()
        record["files"] = guards.file_sizes(directory) if guards else {}
        with open(os.path.join(directory, utils.checkpoint.STATE_FILE), "w") as f:
            json.dump(record, f, indent=1)
        final = os.path.join(checkpoints, f"checkpoint_{epoch}")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(directory, final)
        names = [n for n in os.listdir(checkpoints) if re.fullmatch(r"checkpoint_\d+", n)]
        names.sort(key=lambda n: int(n.split("_")[-1]))
        for name in names[: -args.save_total_limit]:
            shutil.rmtree(os.path.join(checkpoints, name))
    accelerator.wait_for_everyone()
    return os.path.join(checkpoints, f"checkpoint_{epoch}")


def load_checkpoint(run, directory: str) -> tuple[int, int]:
    """Restore what save_checkpoint wrote; returns (first epoch to run, global step)."""
    accelerator = run.accelerator
    rng_path = os.path.join(directory, f"rng_state_{accelerator.process_index}.json")
    if not os.path.isfile(rng_path):
        raise UsageError(f"{directory} lacks {rng_path}: resume with as many processes.")
    state = torch.load(os.path.join(directory, "checkpoint.pt"), map_location="cpu", weights_only=True)
    params = dict(accelerator.unwrap_model(run.unet).named_parameters())
    if set(state["trained"]) != {n for n, p in params.items() if p.requires_grad}:
        raise UsageError(f"{directory} holds other weights than those trained here (see --use_lora).")
    with torch.no_grad():
        for name, value in state["trained"].items():
            params[name].copy_(value)
    run.optimizer.load_state_dict(state["optimizer"])
    if run.stat_tracker is not None:
        run.stat_tracker.load_state_dict(state["tracker"] or {})
    with open(rng_path) as f:
        rng = json.load(f)
    utils.checkpoint.set_rng_state(rng, {})
    version, internal, gauss = rng["prompts"]
    run.prompt_rng.setstate((version, tuple(internal), gauss))
    return state["epoch"] + 1, state["global_step"]


def write_model_card(args: Args, metrics: dict) -> None:
    load = "StableDiffusionPipeline.from_pretrained"
    load = "pipe.load_lora_weights(this_directory)" if args.use_lora else load
    trained = f"LoRA rank {args.lora_rank}" if args.use_lora else "the full UNet"
    from huggingface_hub import ModelCardData

    tags = ["ddpo", "rlhf-reference", "diffusers", "text-to-image"]
    metadata = ModelCardData(base_model=args.pretrained_model, library_name="diffusers", tags=tags)
    config = "".join(f"| {name} | `{value}` |\n" for name, value in vars(args).items())
    card = f"""---
{metadata.to_yaml()}
---

# DDPO fine-tuned `{args.pretrained_model}`

Trained by `ddpo.py` with Denoising Diffusion Policy Optimization (Black et al. 2023, arXiv:2305.13301):
reward `{args.reward_fn}`, prompts `{args.prompt_file or "built-in simple animals"}`, {args.num_epochs} epochs
of {args.samples_per_epoch} images, {trained}. Load with `{load}`.

Command: `python {" ".join(sys.argv)}`

Final metrics:
"""
    final = "".join(f"- {name}: {value:.4g}\n" for name, value in metrics.items())
    resolved = f"\n## Configuration\n\n| flag | value |\n|---|---|\n{config}"
    curves = None
    try:  # optional: a copy without utils/plots.py writes its card without curves, as utils/saving.py
        from utils.plots import plot_curves

        metrics_path = os.path.join("runs", args.run_name, "metrics.jsonl")
        curves = plot_curves(metrics_path, os.path.join(args.output_dir, "curves.png"))
    except ModuleNotFoundError:
        pass
    shown = "\n## Curves\n\n![training curves](curves.png)\n" if curves else ""
    with open(os.path.join(args.output_dir, "README.md"), "w") as f:
        f.write(card + final + shown + resolved)


def save(run, args: Args, metrics: dict) -> None:
    """The trained weights, loadable into the pipeline (LoRA or the whole pipeline), a model card, the hub."""
    unwrapped = run.accelerator.unwrap_model(run.unet)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.use_lora:
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        lora_layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unwrapped))
        StableDiffusionPipeline.save_lora_weights(args.output_dir, unet_lora_layers=lora_layers)
    else:
        run.pipeline.unet = unwrapped
        run.pipeline.save_pretrained(args.output_dir)
    write_model_card(args, metrics)
    if args.push_to_hub:
        from huggingface_hub import HfApi

        api, name = HfApi(), os.path.basename(os.path.abspath(args.output_dir))
        repo_id = api.create_repo(name, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo_id, folder_path=args.output_dir, ignore_patterns=["checkpoints/*"])


# ---- training ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What a run holds fixed, from setup() to the save."""

    accelerator: Any
    pipeline: Any  # its VAE, text encoder and tokenizer are frozen; its UNet is the unprepared one
    unet: Any
    scheduler: Any
    optimizer: Any
    negative_embeds: torch.Tensor
    reward_fn: Any
    prompts: list[str]
    prompt_rng: random.Random
    stat_tracker: PerPromptStatTracker | None
    writer: Any  # TensorBoard, on the main process only
    run_dir: str
    stop: Any
    executor: ThreadPoolExecutor | None
    definition: dict | None
    first_epoch: int = 0
    global_step: int = 0


def setup(args: Args) -> Run:
    """Everything before the first epoch; bad input fails before the heavy imports."""
    prompts = check_args(args)
    local = os.path.isdir(args.pretrained_model)
    if local and not os.path.exists(os.path.join(args.pretrained_model, "model_index.json")):
        raise UsageError(
            f"--pretrained_model {args.pretrained_model} holds no diffusers pipeline (no model_index.json); pass "
            "a local Stable-Diffusion directory (e.g. from benchmark/tiny/tiny_diffusion.py) or a hub id."
        )
    # what defines the run, as check_args compared it with a resumed checkpoint's
    guards = utils.checkpoint.safeguards()
    definition = guards.run_definition(args) if guards else None
    from accelerate.utils import broadcast_object_list, set_seed
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from torch.utils.tensorboard import SummaryWriter

    if args.mixed_precision == "fp16" and not torch.cuda.is_available():
        print("fp16 needs a GPU: running in float32 (--mixed_precision no).")
        args.mixed_precision = "no"
    # each training batch accumulates over all its trained timesteps
    accumulation = args.train_gradient_accumulation_steps * args.num_train_timesteps
    accelerator = utils.run.make_accelerator(args, accumulation, args.train_batch_size, args.mixed_precision)
    stop = utils.checkpoint.StopSignal(accelerator)
    device = accelerator.device
    fill_sizes(args, accelerator.num_processes)
    run_name = args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"
    args.run_name = broadcast_object_list([run_name])[0]  # the main process's clock names the run
    set_seed(args.seed, device_specific=True)  # each process draws its own noise
    prompt_rng = random.Random(args.seed + accelerator.process_index)
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    reward_fn = make_reward_fn(args, device)

    # the pipeline, in the dtype of the forward passes
    dtype = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.mixed_precision]
    if args.pretrained_revision != "main" and os.path.isdir(args.pretrained_model):
        accelerator.print(f"--pretrained_revision {args.pretrained_revision} is ignored: a local folder")
    try:
        pipeline = StableDiffusionPipeline.from_pretrained(
            args.pretrained_model,
            revision=args.pretrained_revision,
            dtype=dtype,
            safety_checker=None,
            trust_remote_code=args.trust_remote_code,
        )
    except OSError as error:
        raise UsageError(
            f"Could not load the pipeline {args.pretrained_model} ({type(error).__name__}): pass "
            "--pretrained_model a local Stable-Diffusion directory (e.g. from benchmark/tiny/tiny_diffusion.py)."
        ) from None
    scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
    scheduler.set_timesteps(args.sample_num_steps, device=device)
    config = scheduler.config
    if config.thresholding or config.prediction_type not in ("epsilon", "v_prediction"):
        raise UsageError("ddpo.py supports DDIM with epsilon or v prediction and without thresholding.")
    if (ddim_step_coefficients(scheduler, scheduler.timesteps)[2] <= 0).any():
        raise UsageError("a DDIM step of this scheduler has zero variance: set set_alpha_to_one to False.")

    run_dir = os.path.join("runs", args.run_name)  # TensorBoard, and a PNG grid of samples per epoch
    writer = None
    if accelerator.is_main_process:
        if args.track:
            import wandb

            wandb_run = dict(project=args.wandb_project_name, entity=args.wandb_entity, name=args.run_name)
            wandb.init(**wandb_run, config=vars(args), sync_tensorboard=True, save_code=True)
        writer = SummaryWriter(run_dir)
        table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        os.makedirs(os.path.join(run_dir, "images"), exist_ok=True)
        print(f"logs: {run_dir}/ (TensorBoard, images/); watch with: tensorboard --logdir runs; "
              f"model: {args.output_dir}/", flush=True)  # fmt: skip

    # frozen VAE and text encoder; LoRA adapters (float32) or the whole UNet are trained
    unet = pipeline.unet
    # eval: no dropout, so training recomputes the sampling logps
    for module in (pipeline.vae, pipeline.text_encoder, unet):
        module.requires_grad_(False).eval().to(device)
    if args.use_lora:
        from peft import LoraConfig

        # "gaussian" initialises B to zero: the adapted UNet starts equal to the base one
        lora = dict(r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=LORA_TARGETS)
        unet.add_adapter(LoraConfig(**lora, init_lora_weights="gaussian"))
        for param in unet.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    else:
        unet.requires_grad_(True).float()
    trainable = [p for p in unet.parameters() if p.requires_grad]
    optimizer_class = utils.run.adamw
    if args.train_use_8bit_adam:
        import bitsandbytes

        optimizer_class = bitsandbytes.optim.AdamW8bit
    adam = dict(lr=args.train_learning_rate, betas=(args.train_adam_beta1, args.train_adam_beta2))
    adam.update(weight_decay=args.train_adam_weight_decay, eps=args.train_adam_epsilon)
    optimizer = optimizer_class(trainable, **adam)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    with torch.no_grad():
        negative_embeds = encode_prompts(pipeline.tokenizer, pipeline.text_encoder, [args.negative_prompts])
    stat_tracker = None
    if args.per_prompt_stat_tracking:
        buffer_size = args.per_prompt_stat_tracking_buffer_size
        stat_tracker = PerPromptStatTracker(buffer_size, args.per_prompt_stat_tracking_min_count)
    run = Run(
        accelerator=accelerator,
        pipeline=pipeline,
        unet=unet,
        scheduler=scheduler,
        optimizer=optimizer,
        negative_embeds=negative_embeds,
        reward_fn=reward_fn,
        prompts=prompts,
        prompt_rng=prompt_rng,
        stat_tracker=stat_tracker,
        writer=writer,
        run_dir=run_dir,
        stop=stop,
        executor=None,
        definition=definition,
    )
    if args.resume_from_checkpoint is not None:
        run.first_epoch, run.global_step = load_checkpoint(run, args.resume_from_checkpoint)
    elif accelerator.is_main_process:  # a fresh run: --overwrite_output_dir moves the old contents aside now
        checkpoints = os.path.join(args.output_dir, "checkpoints")
        for name in utils.checkpoint.leftovers(checkpoints):
            shutil.rmtree(os.path.join(checkpoints, name), ignore_errors=True)
        if args.overwrite_output_dir and holds_something(args.output_dir):
            print(utils.checkpoint.move_aside(args.output_dir, "--overwrite_output_dir"))
    accelerator.wait_for_everyone()
    run.executor = ThreadPoolExecutor(args.max_workers) if args.async_reward_computation else None
    return run


def main(args: Args) -> dict:
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    run = setup(args)
    accelerator, unet, scheduler, writer = run.accelerator, run.unet, run.scheduler, run.writer
    vae, text_encoder, tokenizer = run.pipeline.vae, run.pipeline.text_encoder, run.pipeline.tokenizer
    device, is_main, global_step = accelerator.device, accelerator.is_main_process, run.global_step
    final_metrics, clipping = {}, (args.train_clip_range, args.train_adv_clip_max)
    train_names = ("loss/policy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "epoch", "inner_epoch")

    saved, finished_rng = args.resume_from_checkpoint, None  # the last finished epoch's checkpoint, RNG
    metrics_path = os.path.join(run.run_dir, "metrics.jsonl")
    if is_main:  # one line an epoch; a resume keeps the lines up to its checkpoint's step
        kept = utils.tracking.logged_until(metrics_path, global_step) if run.first_epoch else []
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    for epoch in tqdm(range(run.first_epoch, args.num_epochs), disable=not is_main):
        start_time = time.time()
        # 1. Sample: DDIM trajectories, every latent and step log-prob kept; async rewards meanwhile
        unet.eval()
        batches, pending_rewards = [], []
        for _ in range(args.sample_num_batches_per_epoch):
            if epoch > 0 and run.stop.requested():  # a signal while sampling: save the epoch before, stop
                path = saved or save_checkpoint(run, args, epoch - 1, global_step, finished_rng)
                raise run.stop.interrupt(path, epoch - 1, dropped=True)
            batch_prompts = [run.prompt_rng.choice(run.prompts) for _ in range(args.sample_batch_size)]
            with torch.no_grad(), accelerator.autocast():
                prompt_embeds = encode_prompts(tokenizer, text_encoder, batch_prompts)
                trajectories = sample_trajectories(
                    unet, vae, scheduler, prompt_embeds, run.negative_embeds, args
                )
            batches.append(trajectories | {"prompt_embeds": prompt_embeds, "prompts": batch_prompts})
            images = to_pil(trajectories["images"])
            if run.executor is not None:
                pending_rewards.append(run.executor.submit(run.reward_fn, images, batch_prompts))
            else:
                pending_rewards.append(run.reward_fn(images, batch_prompts))

        # 2. Score: the rewards of all processes, logged with an image grid at the sampling step
        local_rewards = np.concatenate(
            [
                np.asarray(r.result() if run.executor else r, dtype=np.float64).reshape(-1)
                for r in pending_rewards
            ]
        )
        local_prompts = [p for b in batches for p in b["prompts"]]
        if len(local_rewards) != len(local_prompts):
            raise UsageError(f"--reward_fn {args.reward_fn} must return one number per image.")
        all_rewards = accelerator.gather(torch.tensor(local_rewards, device=device)).cpu().numpy()
        utils.tracking.check_finite(global_step, rewards=torch.as_tensor(all_rewards))  # on every process
        metrics = {"objective/reward_mean": all_rewards.mean(), "objective/reward_std": all_rewards.std()}
        final_metrics.update(metrics)
        if is_main:
            for name, value in metrics.items():
                writer.add_scalar(name, value, global_step)
            shown = min(args.num_logged_images, len(local_prompts))
            shown_images = to_pil(torch.cat([b["images"] for b in batches])[:shown])
            captions = [f"{prompt[:12]} {reward:.3g}" for prompt, reward in zip(local_prompts, local_rewards)]
            grid = image_grid(shown_images, captions[:shown])
            grid.save(os.path.join(run.run_dir, "images", f"epoch_{epoch:04d}.png"))
            writer.add_image("images/samples", np.asarray(grid), global_step, dataformats="HWC")

        # 3. Advantages
        # ALGO LOGIC: rewards normalised per prompt by running statistics (or over the whole batch)
        all_prompts = gather_object(local_prompts)
        if run.stat_tracker is not None:
            all_advantages = run.stat_tracker.update(all_prompts, all_rewards)
        else:
            all_advantages = batch_advantages(all_rewards)
        local_advantages = all_advantages.reshape(args.world_size, -1)[accelerator.process_index]

        # 4. Update: PPO on the denoising steps, each sample's own random subset in random order
        samples = {key: torch.cat([b[key] for b in batches]) for key in TRAJECTORY_KEYS + ("prompt_embeds",)}
        samples["advantages"] = torch.tensor(local_advantages, dtype=torch.float32, device=device)
        num_samples = len(local_advantages)
        unet.train()
        for inner_epoch in range(args.train_num_inner_epochs):
            perm = torch.randperm(num_samples, device=device)
            samples = {key: value[perm] for key, value in samples.items()}
            order = torch.rand(num_samples, args.sample_num_steps, device=device).argsort(dim=1)
            rows = torch.arange(num_samples, device=device)[:, None]
            samples.update({key: samples[key][rows, order] for key in TRAJECTORY_KEYS})
            step_stats = []
            for mb_start in range(0, num_samples, args.train_batch_size):
                mb_samples = {
                    key: value[mb_start : mb_start + args.train_batch_size] for key, value in samples.items()
                }
                for denoising_step in range(args.num_train_timesteps):
                    with accelerator.accumulate(unet):
                        # ALGO LOGIC: the step's log-prob under the current UNet, PPO-clipped against the old
                        with accelerator.autocast():
                            log_prob = step_log_prob(
                                unet, scheduler, mb_samples, denoising_step, run.negative_embeds, args
                            )
                        old_log_prob = mb_samples["log_probs"][:, denoising_step]
                        loss, approx_kl, clipfrac = ddpo_loss(
                            log_prob, old_log_prob, mb_samples["advantages"], *clipping
                        )
                        accelerator.backward(loss)
                        utils.run.clip_grad_norm(accelerator, unet, args.train_max_grad_norm)
                        run.optimizer.step()
                        run.optimizer.zero_grad()
                    step_stats.append(torch.stack([loss, approx_kl, clipfrac]).detach())
                    if accelerator.sync_gradients:  # an optimizer step was taken: log its averages
                        means = accelerator.reduce(torch.stack(step_stats).mean(0), reduction="mean").tolist()
                        step_stats, global_step = [], global_step + 1
                        utils.tracking.check_finite(global_step, accelerator, loss=means[0])
                        final_metrics.update(zip(train_names, means + [epoch, inner_epoch]))
                        if is_main:
                            for name in train_names:
                                writer.add_scalar(name, final_metrics[name], global_step)

        # 5. Metrics
        if is_main:
            speed = args.samples_per_epoch / (time.time() - start_time)
            writer.add_scalar("time/samples_per_second", speed, global_step)
            tqdm.write(utils.tracking.console_line(final_metrics, global_step))
            with open(metrics_path, "a") as f:
                f.write(
                    json.dumps({"step": global_step, **{k: float(v) for k, v in final_metrics.items()}})
                    + "\n"
                )

        # 6. Checkpoint
        stopping = run.stop.requested()
        saved, finished_rng = None, rng_states(run)
        if (epoch + 1) % args.save_steps == 0 or stopping:
            saved = save_checkpoint(run, args, epoch, global_step)
            if stopping:
                raise run.stop.interrupt(saved, epoch)

    # 7. Save the trained weights, loadable into the pipeline, and a model card
    if run.executor is not None:
        run.executor.shutdown()
    accelerator.wait_for_everyone()
    final_metrics = {name: float(value) for name, value in final_metrics.items()}
    if is_main:
        save(run, args, final_metrics)
        writer.close()
        card = (
            "README.md, curves.png"
            if os.path.exists(os.path.join(args.output_dir, "curves.png"))
            else "README.md"
        )
        print(f"done: logs in {run.run_dir}/; model in {args.output_dir}/ (card: {card})", flush=True)
        if args.track:
            import wandb

            wandb.finish()
    utils.run.end_run(accelerator)
    return final_metrics


if __name__ == "__main__":
    utils.run.run_cli(Args, main)
