"""Optional: grpo.py's rarer losses and masks, TRL's flags and meanings. Imported only under their flag:
--loss_type cispo / sapo / vespo, --off_policy_mask_threshold, --top_entropy_quantile.

    check_flags(args, first_check)                      # before any model loads
    loss = token_loss(args, logprobs, old_logprobs, advantages, mask, vllm_weights)    # [B, R]
    weights = masked_weights(args, weights, advantages, logprobs, entropy, sampling_logprobs, mask, accelerator)
"""

from __future__ import annotations

import math
import warnings

import torch

from utils.run import UsageError

LOSSES = ("cispo", "sapo", "vespo")  # the --loss_type values this file writes


def cispo_token_loss(logprobs, old_logprobs, advantages, epsilon_high):
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): -sg(min(r, epsilon_high)) A logprob per token
    [B, R]; advantages [B]. The cap bounds a token's weight, never removes its gradient."""
    weight = (logprobs - old_logprobs).exp().clamp(max=epsilon_high).detach()
    return -weight * advantages[:, None] * logprobs


def sapo_token_loss(logprobs, old_logprobs, advantages, temperature_pos, temperature_neg):
    """SAPO (https://arxiv.org/abs/2511.20347), a soft clip: -(4 / tau) sigmoid(tau (r - 1)) A per token
    [B, R]; tau = temperature_pos where A > 0, else temperature_neg. advantages [B]."""
    advantages = advantages[:, None]
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)
    ratio = (logprobs - old_logprobs).exp()
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


VESPO_LOG_W_MIN = math.log(1e-8)  # the VESPO paper's floor of w, as TRL's


@torch.no_grad()
def vespo_weights(log_ratio, advantages, mask, k_pos, lambda_pos, k_neg, lambda_neg, importance_weights=None):
    """VESPO's weight of each completion (https://arxiv.org/abs/2602.10693) [B, 1], no gradient; its per-token
    loss is -phi(w_i) A_i logprob_it, a policy gradient whose soft, asymmetric weight replaces the clip:

    phi(w_i) = w_i^k exp(lambda (1 - w_i))     phi(1) = 1, largest at w = k / lambda
    log w_i  = sum_t m_it (clamp(log r_it, -20, 20) + clamp(log iw_it, log 1e-8, 20)), clamped to [log 1e-8, 20]

    log_ratio = logp - logp_old, mask [B, R]; (k, lambda) = (k_pos, lambda_pos) where A_i >= 0, else the _neg pair;
    advantages [B]; importance_weights: vLLM's per-token weights iw [B, R] (None: 1). An overflow gives 0."""
    log_w = log_ratio.clamp(-20, 20)
    if importance_weights is not None:
        log_w = log_w + importance_weights.log().clamp(VESPO_LOG_W_MIN, 20)
    log_w = (log_w * mask).sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, 20)
    positive = advantages[:, None] >= 0
    k, lam = torch.where(positive, k_pos, k_neg), torch.where(positive, lambda_pos, lambda_neg)
    return (k * log_w + lam * (1 - log_w.exp())).exp().nan_to_num(0.0, 0.0, 0.0)


def vespo_flags(args) -> tuple[float, float, float, float]:
    """(k_pos, lambda_pos, k_neg, lambda_neg) of --loss_type vespo."""
    return args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg


def off_policy_mask(advantages, logprobs, sampling_logprobs, mask, threshold) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (https://arxiv.org/abs/2512.02556, eq. 9) [B, 1]: 0 where A_i < 0
    and (1/|o_i|) sum_t (sampling_it - logp_it) > threshold, else 1. logprobs, sampling_logprobs (NaN: no
    evidence), mask [B, R]; advantages [B]."""
    kl = (sampling_logprobs - logprobs.detach()).nan_to_num(0.0) * mask
    mean_kl = kl.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return ((advantages[:, None] >= 0) | (mean_kl <= threshold)).to(logprobs.dtype)


def high_entropy_mask(entropy, mask, quantile, accelerator) -> torch.Tensor:
    """The tokens kept by --top_entropy_quantile rho (Wang et al. 2025, https://arxiv.org/abs/2506.01939) [B, R]
    bool: masked tokens whose entropy is at least the (1 - rho) quantile (linear interpolation) of the masked
    entropies of this micro-batch on every process. entropy, mask [B, R]."""
    padding = -1e9  # below every entropy
    local = accelerator.pad_across_processes(entropy[mask.bool()].float(), dim=0, pad_index=padding)
    everyone = accelerator.gather(local)
    everyone = everyone[everyone != padding]
    if not everyone.numel():
        return torch.zeros_like(mask, dtype=torch.bool)
    return (entropy * mask >= torch.quantile(everyone, 1 - quantile)) & mask.bool()


def masked_weights(args, weights, advantages, logprobs, entropy, sampling_logprobs, mask, accelerator):
    """`weights` times the masks whose flag is given: off_policy_mask (--off_policy_mask_threshold, against
    sampling_logprobs [B, R]) and high_entropy_mask (--top_entropy_quantile)."""
    if args.off_policy_mask_threshold is not None:
        threshold = args.off_policy_mask_threshold
        weights = weights * off_policy_mask(advantages, logprobs, sampling_logprobs, mask, threshold)
    if args.top_entropy_quantile < 1:
        weights = weights * high_entropy_mask(entropy, mask, args.top_entropy_quantile, accelerator)
    return weights


def token_loss(args, logprobs, old_logprobs, advantages, mask, vllm_weights=None) -> torch.Tensor:
    """Per-token loss [B, R] of --loss_type cispo, sapo or vespo; vespo reads the loss mask and vLLM's token
    weights into its sequence weight (TRL 1.16: not into the product)."""
    if args.loss_type == "vespo":
        phi = vespo_weights(logprobs - old_logprobs, advantages, mask, *vespo_flags(args), vllm_weights)
        return -phi * advantages[:, None] * logprobs
    if args.loss_type == "cispo":
        return cispo_token_loss(logprobs, old_logprobs, advantages, args.epsilon_high)
    return sapo_token_loss(
        logprobs, old_logprobs, advantages, args.sapo_temperature_pos, args.sapo_temperature_neg
    )


def clip_stat(args, ratio, ratio_mask, log_ratio, advantages, mask, vllm_weights=None):
    """What cispo and vespo log instead of the clip fractions (low, high, region); None for sapo (no clip).
    cispo: the share of tokens whose weight the cap lowered, of `ratio` and `ratio_mask` as the clip fractions
    count them ([B, R], or [B, 1] at sequence level); vespo: the mean weight phi of a completion, of
    log_ratio = logp - logp_old and the loss mask [B, R]. advantages [B]."""
    if args.loss_type == "cispo":
        capped = ((ratio > args.epsilon_high) & (advantages[:, None] > 0)).float()
        ratio_mask = ratio_mask.to(capped.dtype)
        return (capped * ratio_mask).sum() / ratio_mask.sum().clamp(min=1), 0.0, 0.0
    if args.loss_type == "vespo":
        return vespo_weights(log_ratio, advantages, mask, *vespo_flags(args), vllm_weights).mean(), 0.0, 0.0
    return None


def clip_metrics(loss_type: str, stats: torch.Tensor) -> dict[str, float]:
    """The logged names of clip_stat's mean (stats[3]); sapo logs none."""
    names = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}
    return {names[loss_type]: stats[3].item()} if loss_type in names else {}


def check_flags(args, first_check: bool) -> None:
    """TRL's constraints of the sapo and vespo flags (vespo's once: `first_check`), and a phi that has its peak
    and decay (TRL clamps lambda >= 1e-4)."""
    if args.loss_type == "sapo" and min(args.sapo_temperature_pos, args.sapo_temperature_neg) <= 0:
        raise UsageError("--sapo_temperature_pos and --sapo_temperature_neg must be positive.")
    if args.loss_type != "vespo" or not first_check:
        return
    if min(args.vespo_k_pos, args.vespo_k_neg) < 0 or min(args.vespo_lambda_pos, args.vespo_lambda_neg) <= 0:
        raise UsageError("--vespo_k_pos and --vespo_k_neg must be at least 0, the --vespo_lambda_* positive.")
    mode = args.vllm_importance_sampling_mode
    if args.use_vllm and args.vllm_importance_sampling_correction and not mode.startswith("token_"):
        raise UsageError(
            f"--loss_type vespo takes vLLM's weights token by token into its own sequence weight: pass "
            f"--vllm_importance_sampling_mode token_truncate or token_mask (got {mode}), as TRL 1.16 requires."
        )
    if args.importance_sampling_level != "token":
        warnings.warn(
            "--loss_type vespo weighs whole completions itself; --importance_sampling_level sequence changes only "
            "the KL's bias correction (TRL 1.16 warns the same).",
            UserWarning,
            stacklevel=3,
        )
