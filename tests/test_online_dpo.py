"""online_dpo.py: pair construction and losses against loops written from the equations and hand cases, the
schedules and flag checks, the OpenAI-compatible judge against a local server, and runs through the command line
on the tiny world (sampling invariant, 2 processes, a rule reward learned, a judge function honoured)."""

import http.server
import json
import math
import shutil
import threading

import pytest
import torch

import online_dpo
import utils.generation
import utils.judges
from conftest import (
    ROOT,
    check_trl_style_calls,
    logged_every,
    make_rl_lab,
    read_metrics,
    run_deepspeed,
    run_script,
    run_torchrun,
    weights,
    write_trl_style_data,
)

METRICS = {
    "step", "eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/scores",
    "objective/scores_margin", "objective/rlhf_reward", "loss/dpo_avg", "rewards/chosen", "rewards/rejected",
    "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "val/contain_eos_token",
    "val/num_ties", "val/num_truncated_prompts", "val/logprob_gap", "grad_norm", "beta", "learning_rate", "episode",
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ pair construction
def loop_pairs(scores, num_prompts, drop_ties):
    """From the definition: completion c of prompt p is row c * P + p; the first is chosen when its score is at
    least the second's (TRL's rule), the second otherwise; with drop_ties a tie does not count."""
    chosen, rejected, kept = [], [], []
    for p in range(num_prompts):
        first, second = scores[p], scores[num_prompts + p]
        if first >= second:
            chosen.append(p), rejected.append(num_prompts + p), kept.append(first != second or not drop_ties)
        else:
            chosen.append(num_prompts + p), rejected.append(p), kept.append(True)
    return chosen, rejected, kept


@pytest.mark.parametrize("drop_ties", [False, True])
@pytest.mark.parametrize("num_prompts", [1, 5, 16])
def test_pairs_from_scores_match_loop(num_prompts, drop_ties):
    g = torch.Generator().manual_seed(num_prompts)
    scores = torch.randint(0, 3, (2 * num_prompts,), generator=g).float()  # few values: many ties
    verdicts = online_dpo.verdicts_from_scores(scores)
    chosen, rejected, kept = online_dpo.pairs_from_verdicts(verdicts, drop_ties)
    expected = loop_pairs(scores.tolist(), num_prompts, drop_ties)
    assert (chosen.tolist(), rejected.tolist(), kept.tolist()) == expected
    assert (scores[chosen][kept] >= scores[rejected][kept]).all()
    assert (verdicts == -1).tolist() == [a == b for a, b in zip(scores[:num_prompts], scores[num_prompts:])]


def test_pairs_hand_case():
    # prompt 0: 1.0 vs 3.0 -> the second (row 3) wins; prompt 1: 2.0 vs 2.0 tie; prompt 2: 5.0 vs -1.0
    scores = torch.tensor([1.0, 2.0, 5.0, 3.0, 2.0, -1.0])
    verdicts = online_dpo.verdicts_from_scores(scores)
    assert verdicts.tolist() == [1, -1, 0]
    for drop_ties, kept_tie in ((False, True), (True, False)):  # TRL: the tie trains toward its first (row 1)
        chosen, rejected, kept = online_dpo.pairs_from_verdicts(verdicts, drop_ties)
        assert chosen.tolist() == [3, 1, 2] and rejected.tolist() == [0, 4, 5]
        assert kept.tolist() == [True, kept_tie, True]


def test_a_none_reward_counts_as_zero_as_trls_nansum():
    scores = torch.tensor([float("nan"), 2.0, -float("inf"), float("inf")])
    assert online_dpo.nan_as_zero(scores).tolist() == [0.0, 2.0, -float("inf"), float("inf")]


def loop_prompt_mask(query_mask, lengths, max_length, micro_batch):
    """TRL's cut, literally: per micro-batch, drop left columns of [prompts | completions as wide as the longest]
    until max_length wide."""
    num_prompts, width = query_mask.shape
    out = torch.zeros_like(query_mask)
    for start in range(0, num_prompts, micro_batch):
        prompts = list(range(start, min(start + micro_batch, num_prompts)))
        widest = max(max(int(lengths[p]), int(lengths[num_prompts + p])) for p in prompts)
        dropped = max(width + widest - max_length, 0)
        for p in prompts:
            out[p, dropped:] = query_mask[p, dropped:]
    return out


@pytest.mark.parametrize("max_length,micro_batch", [(12, 2), (9, 3), (8, 6), (100, 2), (6, 1)])
def test_prompt_mask_within_max_length_matches_trls_cut(max_length, micro_batch):
    g = torch.Generator().manual_seed(max_length)
    query_mask = utils.generation.left_pad([[7] * n for n in (9, 3, 6, 1, 8, 5)], 0)[1]
    lengths = torch.randint(1, 6, (12,), generator=g)
    got = online_dpo.prompt_mask_within(query_mask, lengths, max_length, micro_batch)
    assert torch.equal(got, loop_prompt_mask(query_mask, lengths, max_length, micro_batch))
    assert online_dpo.prompt_mask_within(query_mask, lengths, None, micro_batch) is query_mask


def test_judge_answers_are_checked():
    pairs = [("a", "b"), ("c", "d")]
    assert utils.judges.call_judge(lambda p, c: [1, -1], ["x", "y"], pairs).tolist() == [1, -1]
    with pytest.raises(ValueError, match="returned 1 verdicts for 2 pairs"):
        utils.judges.call_judge(lambda p, c: [0], ["x", "y"], pairs)
    with pytest.raises(ValueError, match="must answer 0"):
        utils.judges.call_judge(lambda p, c: [0, 2], ["x", "y"], pairs)


# ----------------------------------------------------------------------------------------------------------- losses
def loop_losses(logp_c, logp_r, ref_c, ref_r, beta, loss_type):
    out = []
    for lc, lr, rc, rr in zip(logp_c, logp_r, ref_c, ref_r):
        if loss_type == "sigmoid":  # DPO, eq. 7: -log sigma(beta * ((lc - rc) - (lr - rr)))
            out.append(math.log(1 + math.exp(-beta * ((lc - rc) - (lr - rr)))))
        elif loss_type == "ipo":  # IPO on summed log-ratios (TRL's online DPO): (h - 1 / (2 tau))^2
            out.append(((lc - rc) - (lr - rr) - 1 / (2 * beta)) ** 2)
        else:  # SLiC hinge on reference-corrected log-ratios: max(0, 1 - beta * h)
            out.append(max(0.0, 1 - beta * ((lc - rc) - (lr - rr))))
    return out


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_losses_match_loops(loss_type, beta):
    g = torch.Generator().manual_seed(7)
    logp_c, logp_r, ref_c, ref_r = (-10 * torch.rand(6, generator=g, dtype=torch.float64) for _ in range(4))
    losses, reward_c, reward_r = online_dpo.online_dpo_loss(logp_c, logp_r, ref_c, ref_r, beta, loss_type)
    expected = loop_losses(*(t.tolist() for t in (logp_c, logp_r, ref_c, ref_r)), beta, loss_type)
    assert losses.tolist() == pytest.approx(expected, rel=1e-9)
    for reward, logp, ref in ((reward_c, logp_c, ref_c), (reward_r, logp_r, ref_r)):
        assert reward.tolist() == pytest.approx((beta * (logp - ref)).tolist())


def test_loss_hand_cases_and_gradient_direction():
    zero = torch.zeros(1)
    # policy equal to the reference: h = 0 -> log 2, (1/(2 beta))^2, 1
    assert online_dpo.online_dpo_loss(zero, zero, zero, zero, 0.5, "sigmoid")[0].item() == pytest.approx(
        math.log(2)
    )
    assert online_dpo.online_dpo_loss(zero, zero, zero, zero, 0.5, "ipo")[0].item() == pytest.approx(1.0)
    assert online_dpo.online_dpo_loss(zero, zero, zero, zero, 0.5, "hinge")[0].item() == pytest.approx(1.0)
    # beyond the margin 1/beta the hinge loss is 0
    two = torch.tensor([2.0])
    assert online_dpo.online_dpo_loss(two, zero, zero, zero, 0.5, "hinge")[0].item() == 0.0
    # every loss raises the chosen logprob and lowers the rejected one
    for loss_type in ("sigmoid", "ipo", "hinge"):
        logp_c, logp_r = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
        online_dpo.online_dpo_loss(logp_c, logp_r, zero, zero, 0.1, loss_type)[0].sum().backward()
        assert logp_c.grad.item() < 0 < logp_r.grad.item(), loss_type


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="unknown --loss_type"):
        online_dpo.online_dpo_loss(torch.zeros(1), torch.zeros(1), 0, 0, 0.1, "simpo")


# -------------------------------------------------------------------------------------------- schedules and sizes
def test_beta_per_epoch_keeps_the_last():
    assert [online_dpo.beta_for_epoch([0.3, 0.2, 0.1], e) for e in range(5)] == [0.3, 0.2, 0.1, 0.1, 0.1]
    assert online_dpo.beta_for_epoch([0.05], 9) == 0.05


def test_warmup_ratio_warms_up_as_trls_trainer():
    """--warmup_ratio 0.2 of 10 updates: the first update at rate 0 (TRL's Trainer steps its scheduler after the
    optimizer), then linear decay to 0 after the warmup."""
    from types import SimpleNamespace

    from utils.run import lr_schedule

    args = SimpleNamespace(learning_rate=1.0, lr_scheduler_type="linear", warmup_ratio=0.2, warmup_steps=0.0)
    lr = [lr_schedule(args, 10)(update - 1) for update in range(1, 11)]
    assert lr == pytest.approx([0.0, 0.5, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8])


def parse(flags):
    from utils.run import parse_args

    return parse_args(online_dpo.Args, flags)


def test_trl_command_parses_and_sizes_follow():
    args = parse(
        "--model_name_or_path trl-lib/pythia-1b-deduped-tldr-sft --reward_model_path trl-lib/pythia-1b-deduped-tldr-rm "
        "--dataset_name trl-lib/tldr --learning_rate 5.0e-7 --output_dir pythia-1b-tldr-online-dpo "
        "--per_device_train_batch_size 8 --gradient_accumulation_steps 16 --warmup_ratio 0.1 "
        "--missing_eos_penalty 1.0 --beta 0.1 0.05".split()
    )
    online_dpo.fill_sizes(args, world_size=8, num_prompts=116722)
    assert (args.local_batch_size, args.batch_size) == (128, 1024)
    assert args.num_total_batches == 116722 // 1024
    assert args.beta == [0.1, 0.05] and args.loss_type == "sigmoid" and args.temperature == 0.9
    # TRL's OnlineDPOConfig defaults: no flag of ours changes what the TRL command does
    assert (args.max_length, args.logprobs_at_temperature, args.drop_ties) == (512, False, False)


@pytest.mark.parametrize(
    "flags,message",
    [
        ([], "exactly one of --reward_model_path, --reward_fn and --judge"),
        (["--reward_model_path", "r", "--judge", "j.py:f"], "exactly one of"),
        (["--reward_model_path", "r", "--beta", "0.1", "0"], "--beta must be one or more positive"),
        (["--judge", "j.py:f", "--missing_eos_penalty", "1"], "a --judge gives none"),
        (["--reward_model_path", "r", "--temperature", "0"], "--temperature must be positive"),
        (["--reward_model_path", "r", "--max_steps", "0"], "--max_steps must be at least 1"),
        (
            ["--reward_model_path", "r", "--max_length", "64"],
            "--max_length 64 must exceed --max_new_tokens 64",
        ),
    ],
)
def test_bad_flags_are_refused_with_one_sentence(flags, message):
    args = parse(["--model_name_or_path", "m", *flags])
    with pytest.raises(ValueError, match=message):
        online_dpo.fill_sizes(args, world_size=1)


def test_too_few_prompts_for_one_update():
    args = parse(
        ["--model_name_or_path", "m", "--reward_model_path", "r", "--per_device_train_batch_size", "8"]
    )
    with pytest.raises(ValueError, match="has 15 prompts, fewer than the 16 of one update"):
        online_dpo.fill_sizes(args, world_size=2, num_prompts=15)


# ------------------------------------------------------------------------------- the OpenAI-compatible judge client
class FakeJudge(http.server.BaseHTTPRequestHandler):
    """A chat-completions endpoint preferring the summary that contains 'good' (neither: an unparseable answer)."""

    def do_POST(self):
        content = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][0]["content"]
        summary_a = content.split("Summary A:\n")[1].split("\n\nSummary B:")[0]
        summary_b = content.split("Summary B:\n")[1].split("\n\n")[0]
        verdict = "A" if "good" in summary_a else "B" if "good" in summary_b else "not sure"
        body = json.dumps({"choices": [{"message": {"content": f"Comparison: x\nPreferred: {verdict}"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_openai_judge_undoes_the_shown_order():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = parse(["--model_name_or_path", "m", "--judge", "openai",
                      "--judge_base_url", f"http://127.0.0.1:{server.server_port}/v1"])  # fmt: skip
        judge = utils.judges.openai_judge(args, seed=0)
        pairs = [("good one", "bad one"), ("bad one", "good one"), ("meh", "meh too")] * 4
        prompts = ["SUBREDDIT: r/x\n\nPOST: p\n\nTL;DR:"] * len(pairs)
        verdicts = utils.judges.call_judge(judge, prompts, pairs)
    finally:
        server.shutdown()
    assert verdicts.tolist() == [0, 1, -1] * 4  # whatever order each pair was shown in


# ------------------------------------------------------------------------------------------- runs on the tiny world
@pytest.fixture(scope="module")
def lab(world, tmp_path_factory):
    """The rule-reward lab (conftest.make_rl_lab): 64 prompts of different lengths, a policy that stops early
    about half of the time with dropout in its config, and the rule rewards in rules.py."""
    return make_rl_lab(world, tmp_path_factory.mktemp("online_dpo_lab"), num_prompts=64)


def common_flags(tmp_path, name):
    return ["--logging_dir", str(tmp_path / "runs"), "--run_name", name, "--output_dir", str(tmp_path / name),
            "--max_new_tokens", "8", "--num_sample_generations", "0"]  # fmt: skip


def test_trl_style_reward_function_gets_its_rows_columns(world, lab, tmp_path):
    """--reward_fn with **kwargs is called as TRL calls it: each completion with its own row's columns."""
    data = write_trl_style_data(lab, tmp_path / "data.jsonl", conversational=False)
    flags = common_flags(tmp_path, "trl_style") + [
        "--model_name_or_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:trl_style",
        "--dataset_name", str(data), "--per_device_train_batch_size", "4", "--max_steps", "2",
        "--local_rollout_forward_batch_size", "6",
    ]  # fmt: skip
    run_script(["online_dpo.py", *flags], env={"REWARD_LOG": str(tmp_path / "calls.jsonl")})
    assert check_trl_style_calls(tmp_path / "calls.jsonl", conversational=False) == 2 * 2 * 4


SHAPED_REWARD = """
import json, os

PROMPTS = {json.loads(line)["prompt"] for line in open(os.environ["PROMPTS"])}


def shaped(prompts, completions, trainer_state, log_metric, **kwargs):
    log_metric("custom/step", float(trainer_state.global_step))
    log_metric("custom/known_prompts", float(all(p in PROMPTS for p in prompts)))
    return [None if len(c) % 2 else 1.0 + len(c) for c in completions]
"""


def test_none_rewards_count_zero_and_the_reward_sees_the_run(world, lab, tmp_path):
    """A TRL-style reward function gets trainer_state (the update about to be made, of --max_steps) and its
    log_metric values reach the logs; its None rewards count 0 as in TRL (nansum), where a NaN score would stop
    the run."""
    (tmp_path / "shaped.py").write_text(SHAPED_REWARD)
    flags = common_flags(tmp_path, "shaped") + [
        "--model_name_or_path", str(lab / "policy"), "--reward_fn", f"{tmp_path / 'shaped.py'}:shaped",
        "--dataset_name", str(lab / "prompts.jsonl"), "--per_device_train_batch_size", "8", "--max_steps", "3",
        "--local_rollout_forward_batch_size", "16",
    ]  # fmt: skip
    run_script(["online_dpo.py", *flags], env={"PROMPTS": str(lab / "prompts.jsonl")})
    lines = read_metrics(tmp_path / "runs" / "shaped")
    assert [m["custom/step"] for m in lines] == [0.0, 1.0, 2.0]
    assert all(m["custom/known_prompts"] == 1.0 for m in lines)  # the dataset's prompts, as TRL passes them
    assert all(math.isfinite(m["objective/scores"]) and m["objective/scores"] >= 0 for m in lines)
    assert any(m["objective/scores"] > 0 for m in lines) and "grad_norm" in lines[0]


def test_logging_steps_logs_the_means_over_the_window_as_trl(lab, tmp_path):
    """--logging_steps 2 logs, at updates 2 and 4, the means of what --logging_steps 1 logs at each update of the
    window (the same run otherwise), learning rate and episode of its last update, as TRL's logger does."""
    flags = [
        "--model_name_or_path", str(lab / "policy"), "--reward_fn", f"{lab / 'rules.py'}:chars",
        "--dataset_name", str(lab / "prompts.jsonl"), "--per_device_train_batch_size", "4", "--max_steps", "4",
        "--local_rollout_forward_batch_size", "8", "--learning_rate", "1e-3", "--lr_scheduler_type", "linear",
    ]  # fmt: skip
    each, windows = logged_every("online_dpo.py", common_flags, flags, 2, tmp_path)
    assert [m["step"] for m in windows] == [2, 4]
    for window, updates in zip(windows, (each[:2], each[2:])):
        for key in ("loss/dpo_avg", "objective/kl", "objective/scores", "rewards/margins", "val/num_ties"):
            assert window[key] == pytest.approx(
                (updates[0][key] + updates[1][key]) / 2, rel=1e-5, abs=1e-9
            ), key
        assert (
            window["learning_rate"] == updates[1]["learning_rate"]
            and window["episode"] == updates[1]["episode"]
        )
    assert (
        each[0]["loss/dpo_avg"] != each[1]["loss/dpo_avg"]
        and each[0]["learning_rate"] != each[1]["learning_rate"]
    )


def test_training_forward_recomputes_the_sampling_logprobs(lab, world, tmp_path):
    """Learning rate 0, --logprobs_at_temperature: the training forward gives back the logprobs of sampling (gap
    0) and the reference's (KL 0, implicit rewards 0), under left padding, truncation after EOS, a temperature
    and dropout in the config."""
    flags = common_flags(tmp_path, "invariant") + [
        "--model_name_or_path", str(lab / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(lab / "prompts.jsonl"), "--learning_rate", "0", "--temperature", "0.7",
        "--logprobs_at_temperature",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "2",
        "--missing_eos_penalty", "1.0", "--local_rollout_forward_batch_size", "6", "--loss_type", "ipo",
        "--num_sample_generations", "1",
    ]  # fmt: skip
    proc = run_script(["online_dpo.py", *flags], timeout=300)
    assert "update 1" in proc.stdout  # the sample table
    lines = read_metrics(tmp_path / "runs" / "invariant")
    assert [m["step"] for m in lines] == [1, 2] and [m["episode"] for m in lines] == [16, 32]
    for metrics in lines:
        assert set(metrics) == METRICS
        assert metrics["val/logprob_gap"] < 1e-5  # measured: about 1e-6
        assert (
            metrics["val/num_truncated_prompts"] == 0
        )  # every prompt + completion is within --max_length 512
        assert abs(metrics["objective/kl"]) < 1e-4
        assert metrics["rewards/chosen"] == pytest.approx(0, abs=1e-6)
        assert metrics["loss/dpo_avg"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-4)  # IPO at h = 0
        assert 0 < metrics["val/contain_eos_token"] < 1  # some completions truncated, some not
        assert metrics["objective/scores_margin"] > 0 and metrics["learning_rate"] == 0.0
    out = tmp_path / "invariant"
    assert "online DPO" in (out / "README.md").read_text() and (out / "tokenizer.json").exists()
    before, after = weights(lab / "policy"), weights(out)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_two_processes_keep_each_pair_within_its_prompt(world, lab, tmp_path):
    """2 processes: the score depends on the prompt alone, so every pair is a tie exactly when both of its
    completions are of one prompt. With --drop_ties nothing is then learned and the policy does not move."""
    flags = common_flags(tmp_path, "ddp") + ["--drop_ties",
        "--model_name_or_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:prompt_only",
        "--dataset_name", str(lab / "prompts.jsonl"), "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2", "--max_steps", "2", "--learning_rate", "1e-2",
    ]  # fmt: skip
    run_torchrun(["online_dpo.py", *flags], nproc=2)
    lines = read_metrics(tmp_path / "runs" / "ddp")
    assert [m["episode"] for m in lines] == [16, 32]  # 8 prompts x 2 completions per update, logged once
    assert [m["val/num_ties"] for m in lines] == [8, 8]
    before, after = weights(world / "policy"), weights(tmp_path / "ddp")
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_rule_based_reward_is_learned_by_a_copy_of_the_script(world, lab, tmp_path):
    """online_dpo.py + utils/ alone in an empty folder (as researchers copy it): --help, and a run whose rule
    reward (key words in the completion) rises."""
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(ROOT / "online_dpo.py", copy)
    shutil.copytree(ROOT / "utils", copy / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    assert "--loss_type" in run_script(["online_dpo.py", "--help"], cwd=copy).stdout
    flags = common_flags(tmp_path, "learn") + [
        "--model_name_or_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:key_words",
        "--dataset_name", str(world / "dataset"), "--dataset_train_split", "sft", "--temperature", "1.0",
        "--per_device_train_batch_size", "16", "--max_steps", "20", "--learning_rate", "6e-3",
        "--lr_scheduler_type", "constant", "--beta", "0.1",
    ]  # fmt: skip
    run_script(["online_dpo.py", *flags], cwd=copy, timeout=300)
    lines = read_metrics(tmp_path / "runs" / "learn")
    scores = [m["objective/scores"] for m in lines]
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    # measured with seeds 0-7: 0.2-0.4 -> 2.1-7.2 key words (after 12 updates the gain was 0.2-2.1)
    assert first < 1.0 and last > first + 1.0, scores
    assert sum(m["rewards/accuracies"] for m in lines[-4:]) / 4 > 0.5


def test_judge_function_is_honoured(world, lab, tmp_path):
    """A judge preferring the shorter completion: it sees the two completions of one prompt, its ties are
    counted, and its choice is the one trained toward: at learning rate 0 the chosen (shorter) completions have
    the higher summed logprob (fewer tokens, each with a negative logprob)."""
    log = tmp_path / "judge.jsonl"
    flags = common_flags(tmp_path, "judged") + [
        "--model_name_or_path", str(lab / "policy"), "--judge", f"{lab / 'rules.py'}:fewer_characters",
        "--dataset_name", str(lab / "prompts.jsonl"), "--temperature", "1.0", "--per_device_train_batch_size",
        "16", "--max_steps", "2", "--learning_rate", "0",
    ]  # fmt: skip
    run_script(["online_dpo.py", *flags], timeout=300, env={"JUDGE_LOG": str(log)})
    calls = [json.loads(line) for line in open(log)]
    lines = read_metrics(tmp_path / "runs" / "judged")
    assert len(calls) == len(lines) == 2
    prompts = {json.loads(line)["prompt"] for line in open(lab / "prompts.jsonl")}
    for call, metrics in zip(calls, lines):
        assert len(call["prompts"]) == len(call["pairs"]) == 16 and set(call["prompts"]) <= prompts
        assert metrics["val/num_ties"] == sum(len(a) == len(b) for a, b in call["pairs"]) < 16
        assert "objective/scores" not in metrics
        assert metrics["logps/chosen"] > metrics["logps/rejected"] + 1.0, metrics  # measured: about 10 apart
        assert metrics["val/logprob_gap"] < 1e-5  # at temperature 1 the plain logits are those that sampled


@pytest.mark.slow
def test_resume_from_checkpoint_continues_exactly(world, lab, tmp_path):
    """4 updates straight (checkpoints at 2 and 4) against 2 + resume: the same final weights and metrics."""
    flags = [
        "--model_name_or_path", str(world / "policy"), "--reward_fn", f"{lab / 'rules.py'}:key_words",
        "--dataset_name", str(lab / "prompts.jsonl"), "--per_device_train_batch_size", "4", "--max_steps", "4",
        "--learning_rate", "1e-3", "--warmup_ratio", "0.25", "--logging_dir", str(tmp_path / "runs"),
        "--max_new_tokens", "8", "--num_sample_generations", "0",
    ]  # fmt: skip
    run_script(["online_dpo.py", *flags, "--run_name", "straight", "--output_dir", str(tmp_path / "a"),
                "--save_steps", "2"])  # fmt: skip
    straight = read_metrics(tmp_path / "runs" / "straight")
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    run_script(["online_dpo.py", *flags, "--output_dir", str(tmp_path / "b"),
                "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-2")])  # fmt: skip
    resumed = read_metrics(
        tmp_path / "runs" / "straight"
    )  # the checkpoint's run name: the same log continues
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        assert {k: v for k, v in a.items() if k != "eps"} == {k: v for k, v in b.items() if k != "eps"}
    first, second = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(first[n], second[n]) for n in first)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_keeps_the_sampling_invariant(world, lab, tmp_path, zero_stage):
    """2 processes under DeepSpeed ZeRO-2/3 (reference and reward model sharded under ZeRO-3, weights gathered
    for sampling): at learning rate 0 the training forward still gives back the sampling logprobs."""
    flags = common_flags(tmp_path, "ds") + [
        "--model_name_or_path", str(lab / "policy"), "--reward_model_path", str(world / "reward"),
        "--dataset_name", str(lab / "prompts.jsonl"), "--learning_rate", "0", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2", "--max_steps", "2", "--missing_eos_penalty", "1.0",
        "--logprobs_at_temperature",
    ]  # fmt: skip
    run_deepspeed(["online_dpo.py", *flags], tmp_path, zero_stage)
    lines = read_metrics(tmp_path / "runs" / "ds")
    assert [m["episode"] for m in lines] == [16, 32]
    for metrics in lines:
        assert metrics["val/logprob_gap"] < 1e-4 and abs(metrics["objective/kl"]) < 1e-3
    before, after = weights(lab / "policy"), weights(tmp_path / "ds")
    assert all(torch.equal(before[n], after[n].to(before[n].dtype)) for n in before)
