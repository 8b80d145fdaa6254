"""The bare work of each algorithm: the same generation and forward/backward passes as the scripts, as a minimal
loop with no checks, metrics, logging, sample tables or checkpoints. benchmark/speed/speed.py times it beside
the scripts and TRL (same workload description, same optimizer-step timing), so `ours / bare` says how much a
script costs on top of the work it cannot avoid.

    python benchmark/speed/speed.py --algorithms rloo   # runs this for rloo beside rloo.py and TRL's RLOOTrainer

What each loop does per optimizer step or update (B = batch_size, R = response_length, k completions a prompt):
    sft      forward with labels (prompt tokens masked) on B padded sequences, backward, AdamW step
    reward   classifier forward on B chosen + B rejected sequences, -logsigmoid(r_c - r_r), backward, step
    dpo      policy forward on B chosen + B rejected, reference forward (no grad), sigmoid loss, backward, step
    rloo     sample 2B completions of 2B/k prompts (key-value cache, R steps), reference and reward forward,
             leave-one-out advantages, then epochs x 2 mini-batches of policy forward, backward, step
    grpo     the same without the reference model (beta 0), group-normalized advantages, token-level loss
    ppo      the same rollout plus the critic's values, GAE, then epochs x 2 mini-batches of policy and critic
             forward, backward, step
    online_dpo  sample 2 completions of each of B prompts (key-value cache, R steps), reward forward, the better
             one chosen, then policy forward (grad) and reference forward (no grad) on the 2B rows, sigmoid
             DPO loss, backward, step
"""

from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F


def right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [n, L] and attention mask [n, L]."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [n, L] and attention mask [n, L]."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return ids, mask


def token_logprobs(model, ids, mask, start, temperature=1.0):
    """Logprobs [n, L - start] of ids[:, start:] under the model (position ids from the mask)."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, start - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(2, ids[:, start:, None]).squeeze(2)


def token_scores(model, ids, mask):
    """Per-token outputs [n, L] of a one-label classifier's head (backbone, then the score layer)."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    return model.score(hidden)[..., 0]


def last_token_score(model, ids, mask):
    """Score [n] of a one-label classifier at each row's last real token (any padding side)."""
    last = mask.size(1) - 1 - mask.flip(1).argmax(1)
    return token_scores(model, ids, mask)[torch.arange(ids.size(0)), last]


@torch.no_grad()
def sample(model, queries, query_mask, length, temperature, generator):
    """Exactly `length` sampled tokens after left-padded queries, with a key-value cache and the attention mask
    allocated once. Returns (responses [n, length], their logprobs [n, length])."""
    n, q = queries.shape
    mask = torch.cat([query_mask, query_mask.new_ones(n, length)], 1)
    positions = (query_mask.cumsum(1) - 1).clamp(min=0)
    step_ids, past, tokens, logprobs = queries, None, [], []
    for t in range(length):
        out = model(input_ids=step_ids, attention_mask=mask[:, : q + t], position_ids=positions,
                    past_key_values=past, use_cache=True)  # fmt: skip
        past = out.past_key_values
        logp = torch.log_softmax(out.logits[:, -1].float() / temperature, -1)
        # inverse transform, as utils.generation samples (torch.multinomial is up to ~30x slower on a CPU)
        cdf = logp.exp().double().cumsum(-1)
        u = torch.rand(n, 1, dtype=torch.float64, generator=generator) * cdf[:, -1:]
        step_ids = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.size(1) - 1)
        tokens.append(step_ids)
        logprobs.append(logp.gather(1, step_ids))
        positions = positions[:, -1:] + 1
    return torch.cat(tokens, 1), torch.cat(logprobs, 1)


def load(spec: dict):
    """Tokenizer, dataset splits (from the world's jsonl files) and the model classes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    world = spec["world"]
    tokenizer = AutoTokenizer.from_pretrained(f"{world}/policy")

    def split(name):
        with open(f"{world}/dataset/{name}.jsonl") as f:
            return [json.loads(line) for line in f]

    return tokenizer, split, AutoModelForCausalLM, AutoModelForSequenceClassification


def run(spec: dict) -> None:
    """The bare loop of spec['algorithm'], then the trained model saved to spec['output_dir']."""
    torch.manual_seed(1)
    rng = random.Random(1)
    tokenizer, split, CausalLM, Classifier = load(spec)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    algorithm, B, lr = spec["algorithm"], spec["batch_size"], float(spec["learning_rate"])
    world, steps = spec["world"], spec["updates"] * spec["steps_per_update"]

    def encode(texts):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    if algorithm in ("sft", "reward", "dpo"):
        rows = split("sft" if algorithm == "sft" else "preference")
        rng.shuffle(rows)
        prompts = encode([r["prompt"] for r in rows])
        if algorithm == "sft":
            completions = [c + [eos] for c in encode([r["completion"] for r in rows])]
        else:
            chosen = [c + [eos] for c in encode([r["chosen"] for r in rows])]
            rejected = [c + [eos] for c in encode([r["rejected"] for r in rows])]
        model = (Classifier.from_pretrained(f"{world}/policy", num_labels=1) if algorithm == "reward"
                 else CausalLM.from_pretrained(f"{world}/policy"))  # fmt: skip
        model.config.pad_token_id = pad
        ref = (
            CausalLM.from_pretrained(f"{world}/policy").eval().requires_grad_(False)
            if algorithm == "dpo"
            else None
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model.train()
        for step in range(steps):
            idx = range(step * B, (step + 1) * B)
            if algorithm == "sft":
                ids, mask = right_pad([prompts[i] + completions[i] for i in idx], pad)
                labels = ids.masked_fill(mask == 0, -100)
                for row, i in enumerate(idx):
                    labels[row, : len(prompts[i])] = -100
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            elif algorithm == "reward":
                ids, mask = right_pad(
                    [prompts[i] + chosen[i] for i in idx] + [prompts[i] + rejected[i] for i in idx], pad
                )
                scores = last_token_score(model, ids, mask)
                loss = -F.logsigmoid(scores[:B] - scores[B:]).mean()
            else:
                pairs = [(prompts[i], chosen[i]) for i in idx] + [(prompts[i], rejected[i]) for i in idx]
                ids, mask = right_pad([p + c for p, c in pairs], pad)
                completion = torch.zeros_like(mask)
                for row, (p, c) in enumerate(pairs):
                    completion[row, len(p) : len(p) + len(c)] = 1
                logps = (token_logprobs(model, ids, mask, 1) * completion[:, 1:]).sum(1)
                with torch.no_grad():
                    ref_logps = (token_logprobs(ref, ids, mask, 1) * completion[:, 1:]).sum(1)
                h = (logps[:B] - ref_logps[:B]) - (logps[B:] - ref_logps[B:])
                loss = -F.logsigmoid(spec["beta"] * h).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.save_pretrained(spec["output_dir"])
        return

    if algorithm == "online_dpo":
        R, T = spec["response_length"], spec["temperature"]
        prompts = encode([r["prompt"] for r in split("sft")])
        rng.shuffle(prompts)
        policy = CausalLM.from_pretrained(f"{world}/policy")
        ref = CausalLM.from_pretrained(f"{world}/policy").eval().requires_grad_(False)
        reward = Classifier.from_pretrained(f"{world}/reward", num_labels=1).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
        generator = torch.Generator().manual_seed(1)
        for step in range(steps):
            queries, query_mask = left_pad(prompts[step * B : (step + 1) * B], pad)
            queries, query_mask = queries.repeat(2, 1), query_mask.repeat(2, 1)  # rows c * B + p
            responses, _ = sample(policy.eval(), queries, query_mask, R, T, generator)
            ids, Q = torch.cat([queries, responses], 1), queries.size(1)
            after_eos = (responses == eos).long().cumsum(1) - (responses == eos).long()
            response_mask = (after_eos == 0).long()
            mask = torch.cat([query_mask, response_mask], 1)
            with torch.no_grad():
                scores = last_token_score(reward, ids, mask).view(2, B)
                ref_logps = (token_logprobs(ref, ids, mask, Q, T) * response_mask).sum(1).view(2, B)
            policy.train()
            logps = (token_logprobs(policy, ids, mask, Q, T) * response_mask).sum(1).view(2, B)
            first_wins = scores[0] > scores[1]
            h = (logps[0] - ref_logps[0]) - (logps[1] - ref_logps[1])
            h = torch.where(first_wins, h, -h)
            loss = -F.logsigmoid(spec["beta"] * h).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        policy.save_pretrained(spec["output_dir"])
        return

    # Online algorithms: rollout of 2B completions, then epochs x 2 mini-batches of B.
    k, R, T, epochs = spec["k"], spec["response_length"], spec["temperature"], spec["epochs"]
    prompts = encode([r["prompt"] for r in split("sft")])
    rng.shuffle(prompts)
    policy = CausalLM.from_pretrained(f"{world}/policy")
    ref = (
        CausalLM.from_pretrained(f"{world}/policy").eval().requires_grad_(False)
        if algorithm != "grpo"
        else None
    )
    reward = Classifier.from_pretrained(f"{world}/reward", num_labels=1).eval().requires_grad_(False)
    critic = Classifier.from_pretrained(f"{world}/reward", num_labels=1) if algorithm == "ppo" else None
    params = list(policy.parameters()) + (list(critic.parameters()) if critic is not None else [])
    optimizer = torch.optim.AdamW(params, lr=lr)
    generator = torch.Generator().manual_seed(1)
    per_update, num_prompts = spec["per_update"], spec["per_update"] // (k if algorithm != "ppo" else 1)
    for update in range(spec["updates"]):
        batch = prompts[update * num_prompts : (update + 1) * num_prompts]
        queries, query_mask = left_pad(batch, pad)
        if algorithm != "ppo":
            queries, query_mask = queries.repeat(k, 1), query_mask.repeat(k, 1)
        responses, old_logps = sample(policy.eval(), queries, query_mask, R, T, generator)
        ids, Q = torch.cat([queries, responses], 1), queries.size(1)
        after_eos = (responses == eos).long().cumsum(1) - (responses == eos).long()
        response_mask = (after_eos == 0).long()
        mask = torch.cat([query_mask, response_mask], 1)
        with torch.no_grad():
            scores = last_token_score(reward, ids, mask)
            kl = (
                (old_logps - token_logprobs(ref, ids, mask, Q, T)) * response_mask
                if ref is not None
                else None
            )
            if algorithm == "rloo":
                rewards = (scores - spec["kl_coef"] * kl.sum(1)).view(k, -1)
                advantages = (rewards - (rewards.sum(0) - rewards) / (k - 1)).flatten()
            elif algorithm == "grpo":
                grouped = scores.view(k, -1)
                advantages = ((grouped - grouped.mean(0)) / (grouped.std(0) + 1e-4)).flatten()
            else:
                values = token_scores(critic, ids, mask)[:, Q - 1 : -1]
                token_rewards = -spec["kl_coef"] * kl
                last = (response_mask.sum(1) - 1).clamp(min=0)
                token_rewards[torch.arange(per_update), last] += scores
                advantages, running = torch.zeros_like(values), torch.zeros(per_update)
                for t in reversed(range(R)):
                    next_value = values[:, t + 1] if t + 1 < R else torch.zeros(per_update)
                    delta = token_rewards[:, t] + next_value - values[:, t]
                    running = delta + 0.95 * running
                    advantages[:, t] = running
                returns = advantages + values
                advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        policy.train()
        for _ in range(epochs):
            for idx in torch.randperm(per_update, generator=generator).split(B):
                logps = token_logprobs(policy, ids[idx], mask[idx], Q, T)
                m = response_mask[idx].float()
                log_ratio = (logps - old_logps[idx]) * m
                if algorithm == "rloo":  # the whole completion is one action
                    ratio, adv = log_ratio.sum(1).exp(), advantages[idx]
                    loss = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
                else:
                    ratio = log_ratio.exp()
                    adv = advantages[idx] if algorithm == "ppo" else advantages[idx, None]
                    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
                    loss = (per_token * m).sum() / m.sum()
                if critic is not None:
                    v = token_scores(critic, ids[idx], mask[idx])[:, Q - 1 : -1]
                    loss = loss + 0.1 * 0.5 * (((v - returns[idx]) ** 2) * m).sum() / m.sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    policy.save_pretrained(spec["output_dir"])
