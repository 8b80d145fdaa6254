"""Rollout functions of tests/test_rollout_func.py, written to TRL 1.16's `rollout_func(prompts, trainer)` contract,
for `grpo.py --rollout_func tests/rollout_funcs.py:NAME` and `trl.GRPOTrainer(rollout_func=...)` alike."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fixed_completions  # noqa: E402

AGAIN = " Again:"  # what the two-turn loop inserts between the turns (not the model's: env_mask 0)


def fixed(prompts, trainer):
    """The j-th copy of a prompt in the batch gets tests/fixed_completions.py's completion j, cut after its EOS,
    so both trainers train on the same rows whatever their prompt order; made-up sampling logprobs (far from the
    policy's, so whoever reads them shows); env_mask 0 on every third token; `bonus`, an extra field."""
    tokenizer, length = trainer.processing_class, trainer.args.max_completion_length
    eos = tokenizer.eos_token_id
    out = {key: [] for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "bonus")}
    copies = {}
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        j = copies[prompt] = copies.get(prompt, -1) + 1
        completion = fixed_completions.cut_at_eos(fixed_completions.completion(ids, j, length, eos), [eos])
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(completion)
        out["logprobs"].append([-0.5 - 0.1 * (t % 5) for t in range(len(completion))])
        out["env_mask"].append([int(t % 3 != 2) for t in range(len(completion))])
        out["bonus"].append(0.25 * j)
    return out


def shape(completions, **kwargs):
    """Varies within a group: the completion's distinct characters and length."""
    return [len(set(c)) / 5 + len(c) / 40 for c in completions]


def with_bonus(completions, bonus, **kwargs):
    """Reads the rollout_func's extra field by name (a required parameter no dataset column fills)."""
    return [len(c) / 40 + b for c, b in zip(completions, bonus)]


def sample_turn(model, ids, max_new_tokens, temperature, eos):
    """One sampled turn after `ids` with transformers' generate: (its ids up to an EOS, their logprobs at
    `temperature`)."""
    import torch

    x = torch.tensor([ids], device=model.device)
    out = model.generate(
        x, attention_mask=torch.ones_like(x), do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True,
        output_scores=True,
    )  # fmt: skip
    new = out.sequences[0, x.size(1) :].tolist()
    scores = torch.stack(out.scores)[:, 0].float().log_softmax(-1)
    logprobs = scores.gather(1, torch.tensor(new, device=scores.device)[:, None])[:, 0].tolist()
    if eos in new:
        n = new.index(eos) + 1
        new, logprobs = new[:n], logprobs[:n]
    return new, logprobs


def two_turns(prompts, trainer):
    """A multi-turn loop of one's own: a sampled turn, AGAIN inserted (env_mask 0), a second sampled turn;
    `turns` (an extra field) counts the sampled turns. Sampling draws from torch's global generator."""
    tokenizer, model, args = trainer.processing_class, trainer.model, trainer.args
    again = tokenizer(AGAIN, add_special_tokens=False)["input_ids"]
    first_budget = args.max_completion_length // 2
    out = {key: [] for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "turns")}
    for prompt in prompts:
        prompt_ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ids, logprobs = sample_turn(model, prompt_ids, first_budget, args.temperature, tokenizer.eos_token_id)
        mask = [1] * len(ids)
        left = args.max_completion_length - len(ids) - len(again)
        turns = 1
        if left > 0:
            ids, logprobs, mask = ids + again, logprobs + [None] * len(again), mask + [0] * len(again)
            second, second_logprobs = sample_turn(
                model, prompt_ids + ids, left, args.temperature, tokenizer.eos_token_id
            )
            ids, logprobs, mask, turns = ids + second, logprobs + second_logprobs, mask + [1] * len(second), 2
        for key, value in zip(out, (prompt_ids, ids, logprobs, mask, turns)):
            out[key].append(value)
    return out


def said_again(completions, turns, **kwargs):
    """The loop's turns and what the completions say (the reward functions see the whole completion)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [0.5 * t + 0.1 * ("Again" in text) + len(text) / 100 for t, text in zip(turns, texts)]


def no_logprobs(prompts, trainer):
    out = fixed(prompts, trainer)
    del out["logprobs"]
    return out


def unknown_logprobs(prompts, trainer):
    """fixed's rollouts with `logprobs: None` as a whole (TRL's contract allows it)."""
    return {**fixed(prompts, trainer), "logprobs": None}


def one_short(prompts, trainer):
    out = fixed(prompts, trainer)
    out["completion_ids"] = out["completion_ids"][:-1]
    return out


def ragged_mask(prompts, trainer):
    out = fixed(prompts, trainer)
    out["env_mask"][1] = out["env_mask"][1] + [1]
    return out
