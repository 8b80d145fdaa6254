"""Put realistic bugs into the scripts, one at a time, and see whether the test suite notices.

    python benchmark/reliability/mutations.py            # every mutation; writes benchmark/results/mutations.json
    python benchmark/reliability/mutations.py --only grpo --list_only   # what would run

Each mutation replaces one exact piece of a file (a sign, a mask, a reduction, a scale under accumulation or
across processes, a token count, an off-by-one position, a swapped pair, a metric that feeds a decision) in a
scratch copy of the working tree (tracked and untracked files, not the ignored ones), then runs the tests that
cover that script, the whole-update comparisons with TRL first, stopping at the first failure. A mutation is
caught when a test fails; the record names the first failing test. A mutation whose text is no longer in the
file is reported as stale (the list must follow the code). `held_out` marks mutations written after the tests,
to check that the tests were not fitted to the list."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Mutation:
    file: str
    old: str
    new: str
    what: str
    held_out: bool = False


# The tests each script's mutations run, whole-update comparisons first (they are the ones meant to catch).
TESTS = {
    "grpo.py": ["tests/test_update_parity_grpo.py", "tests/test_trl_parity_grpo.py", "tests/test_grpo.py"],
    "rloo.py": ["tests/test_update_parity_rloo.py", "tests/test_trl_parity_rloo.py", "tests/test_rloo.py"],
    "online_dpo.py": [
        "tests/test_update_parity_online_dpo.py",
        "tests/test_trl_parity_online_dpo.py",
        "tests/test_online_dpo.py",
    ],
    "ppo.py": ["tests/test_update_parity_ppo.py", "tests/test_ppo.py"],
    "dpo.py": [
        "tests/test_update_parity_offline.py",
        "tests/test_trl_parity_offline.py",
        "tests/test_dpo.py",
    ],
    "sft.py": [
        "tests/test_update_parity_offline.py",
        "tests/test_trl_parity_offline.py",
        "tests/test_sft.py",
    ],
    "reward.py": [
        "tests/test_update_parity_offline.py",
        "tests/test_trl_parity_offline.py",
        "tests/test_reward.py",
    ],
}
SCRIPT_OF = {"utils/generation.py": "grpo.py", "utils/logprobs.py": "grpo.py", "utils/scoring.py": "grpo.py"}
TEST_FILTER = {  # offline parity tests: only the cases of the mutated script
    "dpo.py": "dpo",
    "sft.py": "sft",
    "reward.py": "reward",
}

M = Mutation
MUTATIONS = [
    # ---- grpo.py
    M("grpo.py", "per_token_loss = per_token_loss + args.beta * kl", "per_token_loss = per_token_loss - args.beta * kl",
      "KL sign in main()'s loss"),
    M("grpo.py", "logprobs, mb_old_logprobs, ref_logprobs[idx], args.use_bias_correction_kl",
      "logprobs, mb_old_logprobs, ref_logprobs[idx], not args.use_bias_correction_kl",
      "bias-corrected KL flag inverted in main()"),
    M("grpo.py", "num_items = step_tokens.item() / (ga * args.world_size)", "num_items = step_tokens.item() / ga",
      "dapo normaliser forgets the processes"),
    M("grpo.py", "num_items = step_tokens.item() / (ga * args.world_size)",
      "num_items = step_tokens.item() / args.world_size", "dapo normaliser forgets the accumulation"),
    M("grpo.py", "loss_mask = tool_mask & has_eos[:, None] if args.mask_truncated_completions else tool_mask",
      "loss_mask = tool_mask", "mask_truncated_completions ignored"),
    M("grpo.py", "mb_mask = loss_mask[idx]", "mb_mask = response_mask[idx]",
      "loss mask of the micro-batch ignores truncation masking"),
    M("grpo.py", "batch_std = nanstd(all_rewards) if args.scale_rewards == \"batch\" else None",
      "batch_std = nanstd(rewards) if args.scale_rewards == \"batch\" else None",
      "batch std of this process's rewards, not all processes'"),
    M("grpo.py", "advantages = group_advantages(rewards, G, args.scale_rewards, batch_std)",
      "advantages = group_advantages(rewards, G, \"none\", batch_std)", "advantages never scaled"),
    M("grpo.py", "lr = schedule(step)", "lr = schedule(step + 1)", "learning-rate schedule off by one step"),
    M("grpo.py", "mb_old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs[idx]",
      "mb_old_logprobs = logprobs if old_logprobs is None else old_logprobs[idx]",
      "on-policy old logprobs not detached"),
    M("grpo.py", "return ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()",
      "return ((per_token_loss * mask).sum(1) / mask.size(1)).mean()", "grpo loss divides by R, not |o_i|"),
    M("grpo.py", "centered = grouped - grouped.nanmean(0, keepdim=True)",
      "centered = grouped - grouped.nanmean(1, keepdim=True)", "group mean over the wrong axis"),
    M("grpo.py", "rewards = all_rewards.view(args.world_size, B)[rank]", "rewards = all_rewards.view(args.world_size, B)[0]",
      "every process takes the first process's rewards"),
    M("grpo.py", "        return total / (per_token_loss.size(0) * max_completion_length)",
      "        return total / (mask.sum().clamp(min=1) * max_completion_length / per_token_loss.size(1))",
      "dr_grpo normaliser is the token count"),
    # ---- rloo.py
    M("rloo.py", "kl = (old_logprobs - ref_logprobs) * loss_mask", "kl = (ref_logprobs - old_logprobs) * loss_mask",
      "KL sign in main()"),
    M("rloo.py", "return ((grouped.sum(0, keepdim=True) - grouped) / (k - 1)).flatten()",
      "return (grouped.sum(0, keepdim=True) / k).flatten()", "baseline includes the sample itself"),
    M("rloo.py", "                    mb_old_logprobs, mb_advantages, mb_mask = (\n                        old_logprobs[idx],",
      "                    mb_old_logprobs, mb_advantages, mb_mask = (\n                        old_logprobs[idx].flip(0),",
      "old logprobs of other rows"),
    M("rloo.py", "            scores = scores - args.missing_eos_penalty * (~has_eos).float()",
      "            scores = scores - args.missing_eos_penalty * has_eos.float()",
      "EOS penalty on the finished completions"),
    M("rloo.py", "    return scores - kl_coef * (kl * mask).sum(1)", "    return scores + kl_coef * (kl * mask).sum(1)",
      "sequence-level KL added to the reward"),
    M("rloo.py", "    log_ratio = (new_logprobs - old_logprobs) * mask\n    weights = mask.float()",
      "    log_ratio = new_logprobs - old_logprobs\n    weights = mask.float()", "padding in the summed log-ratio"),
    M("rloo.py", "clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + (cliprange_high or cliprange))",
      "clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)", "epsilon_high ignored"),
    M("rloo.py", "    return (advantages - kept.mean()) / (kept.std() + 1e-4) * mask",
      "    return (advantages - kept.mean()) / (kept.std() + 1e-4)", "normalised advantages keep padding"),
    M("rloo.py", "    return schedule(update - 1)", "    return schedule(update)", "learning-rate decay off by one update"),
    # ---- online_dpo.py
    M("online_dpo.py", "    verdicts = (second > first).long()", "    verdicts = (second < first).long()",
      "the worse completion chosen"),
    M("online_dpo.py", "idx = torch.cat([chosen_rows[pair_idx], rejected_rows[pair_idx]])",
      "idx = torch.cat([rejected_rows[pair_idx], chosen_rows[pair_idx]])", "chosen and rejected swapped in main()"),
    M("online_dpo.py", "logps, ref_logps = (logprobs * response_mask).sum(1), (ref_logprobs * response_mask).sum(1)",
      "logps, ref_logps = logprobs.sum(1), (ref_logprobs * response_mask).sum(1)", "padding in the policy's log-probs"),
    M("online_dpo.py", "loss_scale = args.gradient_accumulation_steps * args.world_size / max(1, num_kept)",
      "loss_scale = args.gradient_accumulation_steps / max(1, num_kept)", "loss scale forgets the processes"),
    M("online_dpo.py", "                scores = scores - args.missing_eos_penalty * (~has_eos).float()",
      "                scores = scores - args.missing_eos_penalty * has_eos.float()",
      "EOS penalty on the finished completions"),
    # ---- ppo.py
    M("ppo.py", "    non_score_rewards = -kl_coef * kl * mask", "    non_score_rewards = kl_coef * kl * mask",
      "KL penalty sign"),
    M("ppo.py", "    last = mask.long().sum(1) - 1", "    last = mask.long().sum(1).clamp(max=mask.size(1) - 1)",
      "score on the token after EOS"),
    M("ppo.py", "        advantages = whiten(advantages, response_mask, accelerator=whitening)",
      "        advantages = advantages", "advantages not whitened"),
    M("ppo.py", "accelerator.backward(pg_loss + args.vf_coef * vf_loss)", "accelerator.backward(pg_loss + vf_loss)",
      "vf_coef ignored"),
    M("ppo.py", "    loss = 0.5 * utils.stats.masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)",
      "    loss = 0.5 * utils.stats.masked_mean(unclipped_loss, mask)", "value loss not clipped"),
    M("ppo.py", "        delta = rewards[:, t] + gamma * next_values - values[:, t]",
      "        delta = rewards[:, t] + gamma * values[:, t] - values[:, t]", "GAE bootstraps from V_t, not V_t+1"),
    M("ppo.py", "    return advantages, advantages + values", "    return advantages, advantages",
      "returns without the values"),
    # ---- dpo.py
    M("dpo.py", "args, logps[:n], logps[n:], ref[:n], ref[n:], lengths[:n], lengths[n:]",
      "args, logps[n:], logps[:n], ref[n:], ref[:n], lengths[n:], lengths[:n]", "chosen and rejected swapped"),
    M("dpo.py", "args, logps[:n], logps[n:], ref[:n], ref[n:], lengths[:n], lengths[n:]",
      "args, logps[:n], logps[n:], ref[n:], ref[:n], lengths[:n], lengths[n:]", "references of the other half"),
    M("dpo.py", "    ratio_c, ratio_r = (pi_c - ref_c).detach(), (pi_r - ref_r).detach()",
      "    ratio_c, ratio_r = (pi_c + ref_c).detach(), (pi_r - ref_r).detach()",
      "logged chosen reward adds the reference", held_out=False),
    # ---- sft.py
    M("sft.py", "per_micro_batch = max(global_loss_tokens, 1.0) / (ga * world)",
      "per_micro_batch = max(global_loss_tokens, 1.0) / ga", "loss tokens not split over processes"),
    M("sft.py", "per_micro_batch = max(global_loss_tokens, 1.0) / (ga * world)",
      "per_micro_batch = max(global_loss_tokens, 1.0) / world", "loss tokens not split over accumulation"),
    M("sft.py", "loss_tokens = [sum(map(bool, row[\"loss_mask\"][1:])) for row in run.train_rows]",
      "loss_tokens = [sum(map(bool, row[\"loss_mask\"])) for row in run.train_rows]",
      "loss-token count includes the first position"),
    M("sft.py", "    labels = torch.where(loss_mask, input_ids, torch.full_like(input_ids, IGNORE_INDEX))",
      "    labels = input_ids.clone()", "prompt tokens in the loss"),
    # ---- reward.py
    M("reward.py", "                chosen, rejected = scores.view(2, -1)", "                rejected, chosen = scores.view(2, -1)",
      "chosen and rejected swapped"),
    M("reward.py", "    diff = chosen - rejected if margin is None else chosen - rejected - margin",
      "    diff = chosen - rejected if margin is None else chosen - rejected + margin", "margin sign"),
    M("reward.py", "        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()",
      "        loss = loss + center_rewards_coefficient * ((chosen - rejected) ** 2).mean()",
      "centring term of the difference"),
    M("dpo.py", "return losses.mean(), torch.stack", "return losses.sum(), torch.stack", "pair losses summed, not averaged"),
    # ---- held out: written after the whole-update tests, then checked
    M("grpo.py", "ref_logprobs[idx], args.use_bias_correction_kl", "ref_logprobs[idx].roll(1, 0), args.use_bias_correction_kl",
      "reference logprobs of another row", held_out=True),
    M("grpo.py", "clip_grad_norm(accelerator, policy, args.max_grad_norm)",
      "clip_grad_norm(accelerator, policy, 2 * args.max_grad_norm)", "gradient clipped at twice the norm",
      held_out=True),
    M("grpo.py", "policy, query_responses, attention_mask, context_length, T, with_stats=True",
      "policy, query_responses, attention_mask, context_length, 1.0, with_stats=True",
      "training logprobs without the temperature", held_out=True),
    M("rloo.py", "policy, query_responses, attention_mask, context_length, T, with_stats=True",
      "policy, query_responses, attention_mask, context_length, 1.0, with_stats=True",
      "training logprobs without the temperature", held_out=True),
    M("rloo.py", "loss_mask = tool_mask & finished(responses, response_mask.sum(1), finished_ids)[:, None]",
      "loss_mask = tool_mask", "mask_truncated_completions ignored", held_out=True),
    M("online_dpo.py", "beta = beta_for_epoch(args.beta, (update - 1) // updates_per_epoch)",
      "beta = beta_for_epoch(args.beta, update // updates_per_epoch)", "beta of the next epoch", held_out=True),
    M("reward.py", "loss = reward_loss(chosen, rejected, batch[\"margin\"], args.center_rewards_coefficient)",
      "loss = reward_loss(chosen, rejected, batch[\"margin\"].flip(0), args.center_rewards_coefficient)",
      "margins of other pairs", held_out=True),
    M("ppo.py", "rewards = whiten(rewards, response_mask, shift_mean=False, accelerator=whitening)",
      "rewards = whiten(rewards, response_mask, shift_mean=True, accelerator=whitening)",
      "--whiten_rewards shifts the mean", held_out=True),
]  # fmt: skip


@dataclass
class Args:
    only: str | None = None
    """run the mutations of this file (e.g. grpo.py), or whose description contains this"""
    held_out: bool = False
    """run only the mutations written after the tests"""
    list_only: bool = False
    """print the mutations and their tests, run nothing"""
    output: str = "benchmark/results/mutations.json"
    """where the record goes (relative to the repository root)"""
    timeout: int = 900
    """seconds a mutation's tests may take"""
    keep: bool = False
    """keep the scratch copies (printed) for a look"""
    extra_tests: list[str] = field(default_factory=list)
    """more test files to run after a script's own"""


def scratch_copy() -> Path:
    """The working tree's tracked and untracked, not ignored, files in a new folder."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    out = Path(tempfile.mkdtemp(prefix="mutation-"))
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, out / name)
    return out


def tests_for(mutation: Mutation, args: Args) -> tuple[list[str], str | None]:
    script = SCRIPT_OF.get(mutation.file, mutation.file)
    return [t for t in TESTS[script] if (ROOT / t).exists()] + args.extra_tests, TEST_FILTER.get(script)


def run_one(mutation: Mutation, args: Args) -> dict:
    record = {**asdict(mutation), "tests": tests_for(mutation, args)[0]}
    text = (ROOT / mutation.file).read_text()
    if text.count(mutation.old) != 1:
        return {**record, "result": "stale", "detail": f"found {text.count(mutation.old)} times"}
    work = scratch_copy()
    try:
        (work / mutation.file).write_text(text.replace(mutation.old, mutation.new))
        tests, keyword = tests_for(mutation, args)
        start, caught_by = time.time(), None
        for test in tests:  # one file at a time, so the offline filter applies to the parity file only
            command = [
                sys.executable,
                "-m",
                "pytest",
                test,
                "-x",
                "-q",
                "-p",
                "no:xdist",
                "-p",
                "no:cacheprovider",
            ]
            if keyword and "update_parity_offline" in test or keyword and "trl_parity_offline" in test:
                command += ["-k", keyword]
            proc = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode not in (0, 5):
                failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
                caught_by = failed[0] if failed else f"{test}: exit {proc.returncode}"
                break
        record.update(
            result="caught" if caught_by else "missed",
            caught_by=caught_by,
            seconds=round(time.time() - start),
        )
    except subprocess.TimeoutExpired:
        record.update(result="timeout")
    finally:
        if args.keep:
            print("kept", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return record


def main(args: Args) -> None:
    def selected(m: Mutation) -> bool:
        if args.held_out and not m.held_out:
            return False
        if args.only and args.only.endswith(".py"):
            return m.file == args.only
        return not args.only or args.only in m.what

    chosen = [m for m in MUTATIONS if selected(m)]
    if args.list_only:
        for m in chosen:
            print(f"{m.file:14} {m.what:55} {' '.join(tests_for(m, args)[0])}")
        print(f"{len(chosen)} mutations")
        return
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    results = []
    for i, mutation in enumerate(chosen, 1):
        result = run_one(mutation, args)
        results.append(result)
        print(f"[{i}/{len(chosen)}] {result['result']:7} {mutation.file:14} {mutation.what}  {result.get('caught_by') or ''}",
              flush=True)  # fmt: skip
    summary = {r: sum(x["result"] == r for x in results) for r in ("caught", "missed", "stale", "timeout")}
    record = {
        "command": "python benchmark/reliability/mutations.py"
        + (f" --only {args.only}" if args.only else "")
        + (" --held_out" if args.held_out else ""),
        "commit": commit,
        "machine": f"{os.cpu_count()} CPUs",
        "summary": summary,
        "results": results,
    }
    path = ROOT / args.output
    if path.exists() and (args.only or args.held_out):  # a partial run updates the record's entries it ran
        old = json.loads(path.read_text())
        ran = {(r["file"], r["what"]) for r in results}
        record["results"] = [r for r in old["results"] if (r["file"], r["what"]) not in ran] + results
        record["summary"] = {
            k: sum(x["result"] == k for x in record["results"])
            for k in ("caught", "missed", "stale", "timeout")
        }
        record["command"] = (
            "python benchmark/reliability/mutations.py (several runs, see each result's commit)"
        )
    for r in results:
        r["commit"] = commit
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
