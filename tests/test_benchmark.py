"""The tiny TL;DR pipeline's plumbing (quick mode) and the evaluation's arithmetic."""

import json

import pytest

from conftest import ROOT, run_script


def test_win_rate_counts_ties_half():
    from evaluate_tldr import win_rate

    result = win_rate([1.0, 0.0, 0.5, 0.5])
    assert result["win_rate"] == 0.5 and result["tie_rate"] == 0.5 and result["n"] == 4
    assert result["ci95_low"] < 0.5 < result["ci95_high"]
    assert win_rate([1.0, 1.0])["ci95_low"] == 1.0


def test_evaluate_judges_references_against_themselves_as_ties(world, tmp_path):
    """Sanity of the judge wiring: a summary identical to the reference ties with it."""
    from evaluate_tldr import judge_with_gold

    rows = [
        {"facts": ["dog", "vet", "loan"], "completion": " dog vet", "reference": " dog vet", "ends_with_eos": True},
        {"facts": ["dog", "vet", "loan"], "completion": " dog vet loan", "reference": " dog vet", "ends_with_eos": True},
    ]  # fmt: skip
    result = judge_with_gold(rows)
    assert [r["judgement"] for r in rows] == [0.5, 1.0] and result["win_rate"] == 0.75


@pytest.mark.skipif(
    not all((ROOT / s).exists() for s in ("sft.py", "reward.py", "ppo.py", "rloo.py", "dpo.py")),
    reason="the pipeline needs every language-model script",
)
def test_quick_pipeline_produces_every_model_and_win_rate(tmp_path):
    run_script(
        ["benchmark/tiny/tiny_tldr.py", "--quick", "--first_seed", "1", "--work_dir", str(tmp_path / "work"),
         "--results_dir", str(tmp_path / "results")],
        timeout=600,
    )  # fmt: skip
    result = json.loads((tmp_path / "results" / "tiny_tldr_quick.json").read_text())
    seed = result["per_seed"][0]
    assert seed["seed"] == 1 and len(result["per_seed"]) == 1
    for method in ("sft", "reward", "ppo", "rloo", "dpo", "ilql"):
        assert (tmp_path / "work" / "seed1" / method / "config.json").exists()
    for method in ("sft", "ppo", "rloo", "dpo"):
        assert 0.0 <= seed["win_rates"][method]["win_rate"] <= 1.0 and seed["win_rates"][method]["n"] > 0
    assert seed["reward_model_accuracy"] is not None and seed["sft_eval_loss"] > 0
    assert set(seed["against_sft"]) == {"ppo", "rloo", "dpo", "online_dpo", "ilql"}
    assert "win_rate_minus_sft" in result["summary"]["ppo"]
    from datasets import load_from_disk

    ilql_rows = load_from_disk(str(tmp_path / "work" / "seed1" / "ilql_data"))["train"]
    by_prompt = {}  # ILQL's rewards are relative to each prompt's samples: they sum to zero per prompt
    for prompt, reward, score in zip(ilql_rows["prompt"], ilql_rows["reward"], ilql_rows["score_rm"]):
        by_prompt.setdefault(prompt, []).append((reward, score))
    assert all(len(pairs) == 2 for pairs in by_prompt.values())
    for (r1, s1), (r2, s2) in by_prompt.values():
        assert r1 + r2 == pytest.approx(0, abs=1e-6) and r1 - r2 == pytest.approx(s1 - s2, abs=1e-5)


def test_resume_reuses_a_stage_only_when_its_command_is_unchanged(tmp_path):
    from tiny_tldr import run_stage

    command = ["-c", "print('ran')"]
    first = run_stage("s", command, str(tmp_path), threads=1, reuse=True)  # no stamp yet: runs
    assert "reused" not in first and (tmp_path / "s.log").read_text().strip() == "ran"
    assert run_stage("s", command, str(tmp_path), threads=1, reuse=True)["reused"] is True
    assert "reused" not in run_stage("s", command, str(tmp_path), threads=1, reuse=False)
    assert "reused" not in run_stage("s", ["-c", "print(2)"], str(tmp_path), threads=1, reuse=True)


def test_summary_traits_hand_cases():
    from tiny_tldr_breakdown import summary_traits

    facts = ["dog", "vet", "loan"]
    assert summary_traits(facts, " dog vet tbh") == {"hedge": True, "all_facts": False, "bad_key": False}
    assert summary_traits(facts, " dog vet loan") == {"hedge": False, "all_facts": True, "bad_key": False}
    assert summary_traits(facts, " dog dog") == {"hedge": False, "all_facts": False, "bad_key": True}
    assert summary_traits(facts, " dog cat") == {"hedge": False, "all_facts": False, "bad_key": True}


def student_t_cdf(x: float, df: int, steps: int = 20000) -> float:
    """P(T <= x) for Student's t, by Simpson's rule over its density from 0 (independent of any table)."""
    import math

    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    h = x / steps
    f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


def test_one_seed_interval_uses_students_t_quantiles():
    from tiny_tldr import T_975, across_seeds

    for df, t in enumerate(T_975, 1):
        assert student_t_cdf(t, df) == pytest.approx(0.975, abs=2e-4), df
    result = across_seeds([0.4, 0.5, 0.6])  # mean 0.5, std 0.1, 2 degrees of freedom
    half = 4.303 * 0.1 * (1 + 1 / 3) ** 0.5
    assert result["mean"] == pytest.approx(0.5) and result["std"] == pytest.approx(0.1)
    assert result["one_seed_interval95"] == pytest.approx([0.5 - half, 0.5 + half])


def test_paired_against_sft_bootstraps_the_difference_on_the_same_posts(tmp_path):
    import random
    import statistics

    from tiny_tldr import paired_against_sft

    rng = random.Random(0)
    posts = [f"post {i}" for i in range(800)]
    sft = [
        {"prompt": p, "judgement": rng.choice([0.0, 0.5, 1.0]), "gold_score": rng.gauss(1.6, 0.5)}
        for p in posts
    ]
    better = [
        {**r, "judgement": min(1.0, r["judgement"] + 0.5), "gold_score": r["gold_score"] + 0.25} for r in sft
    ]
    noisy = [{**r, "judgement": rng.choice([0.0, 0.5, 1.0]), "gold_score": rng.gauss(1.7, 0.5)} for r in sft]
    for name, rows in (("sft", sft), ("better", better), ("noisy", noisy)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shifted = paired_against_sft(tmp_path / "sft.jsonl", tmp_path / "better.jsonl", seed=0)
    assert shifted["gold_score_minus_sft"] == pytest.approx(0.25)  # every post +0.25: no spread to resample
    assert shifted["gold_score_minus_sft_ci95"] == pytest.approx([0.25, 0.25])
    wins = [b["judgement"] - a["judgement"] for a, b in zip(sft, better)]
    assert shifted["win_rate_minus_sft"] == pytest.approx(statistics.mean(wins))
    # independent draws: the bootstrap interval is close to the normal one, mean +- 1.96 standard errors
    result = paired_against_sft(tmp_path / "sft.jsonl", tmp_path / "noisy.jsonl", seed=0)
    diffs = [b["gold_score"] - a["gold_score"] for a, b in zip(sft, noisy)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    low, high = result["gold_score_minus_sft_ci95"]
    assert low == pytest.approx(statistics.mean(diffs) - 1.96 * se, abs=0.3 * se)
    assert high == pytest.approx(statistics.mean(diffs) + 1.96 * se, abs=0.3 * se)
    (tmp_path / "other.jsonl").write_text(json.dumps({**sft[0], "prompt": "another post"}) + "\n")
    with pytest.raises(AssertionError):
        paired_against_sft(tmp_path / "sft.jsonl", tmp_path / "other.jsonl", seed=0)


def test_stages_start_once_what_they_need_is_done_and_failures_stop_the_run():
    import threading
    import time

    from tiny_tldr import NEEDS, run_in_order_of_need

    log, lock, live = [], threading.Lock(), [0]

    def job(name, seconds=0.02, fail=False):
        def run():
            with lock:
                log.append(("start", name))
                live[0] += 1
                assert live[0] <= 2, "more jobs at once than workers"
            time.sleep(seconds)
            with lock:
                live[0] -= 1
                log.append(("end", name))
            if fail:
                raise RuntimeError(f"{name} failed")

        return run

    jobs = {name: (needs, job(name)) for name, needs in NEEDS.items()}
    run_in_order_of_need(jobs, 2)
    position = {event: i for i, event in enumerate(log)}
    assert len(position) == 2 * len(NEEDS)
    for name, needs in NEEDS.items():
        assert all(position[("end", need)] < position[("start", name)] for need in needs), name
    # DPO needs only the SFT model: it trains beside the reward model, not after it
    assert position[("start", "dpo")] < position[("end", "reward")]

    log.clear()
    jobs = {"a": ([], job("a", fail=True)), "b": ([], job("b", seconds=0.2)), "c": ([], job("c"))}
    with pytest.raises(RuntimeError, match="a failed"):
        run_in_order_of_need(jobs, 2)
    assert ("start", "c") not in log  # c waited for a worker: nothing new starts after the failure
    assert ("end", "b") in log  # and the job already running ends before the error is raised
    with pytest.raises(ValueError, match="not there"):
        run_in_order_of_need({"a": (["missing"], job("a"))}, 2)


def test_rank_correlation_is_spearmans_with_tied_ranks_shared():
    import random

    from tiny_tldr import rank_correlation

    def slow_spearman(x, y):  # midranks by counting, then Pearson's formula
        def ranks(v):
            return [sum(b < a for b in v) + (sum(b == a for b in v) - 1) / 2 for a in v]

        rx, ry = ranks(x), ranks(y)
        mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
        cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
        return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5

    assert rank_correlation([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    assert rank_correlation([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    rng = random.Random(0)
    gold = [rng.choice([1.0, 1.9, 2.0, 3.0]) for _ in range(200)]  # many ties, as the gold scores have
    scores = [g + rng.gauss(0, 1) for g in gold]
    assert rank_correlation(scores, gold) == pytest.approx(slow_spearman(scores, gold), abs=1e-12)
    assert rank_correlation(gold, gold) == pytest.approx(1.0)


def test_speed_runs_set_glibcs_mmap_threshold_only_from_the_flag(monkeypatch):
    """Every side of speed.py runs in the same environment; the allocator setting that changes peak RSS comes
    from the recorded flag, never from the caller's shell."""
    from speed import Args, child_env

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert "MALLOC_MMAP_THRESHOLD_" not in child_env(Args())
    env = child_env(Args(malloc_mmap_threshold=131072, threads=2))
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072" and env["OMP_NUM_THREADS"] == "2"


def test_speed_device_defaults_to_cuda_only_where_torch_sees_a_gpu(monkeypatch):
    """--device left out means cuda exactly when torch.cuda.is_available(); on cuda the runs go one at a time and
    the live-heap shim (host memory) is off, on cpu the defaults are today's; the children see no GPU on cpu."""
    import torch
    from speed import Args, child_env, measures_live_heap, resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = resolve(Args())
    assert (args.device, args.parallel, measures_live_heap(args)) == ("cpu", 6, True)
    assert child_env(args)["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = resolve(Args())
    assert (args.device, args.parallel, measures_live_heap(args)) == ("cuda", 1, False)
    assert child_env(args).get("CUDA_VISIBLE_DEVICES") != ""
    assert resolve(Args(device="cpu")).device == "cpu"  # asked for: the CPU even where a GPU is
    with pytest.raises(ValueError, match="--parallel must be 1"):
        resolve(Args(parallel=3))


def test_speed_refuses_cuda_without_a_gpu_in_one_sentence():
    """`--device cuda` on a machine without a GPU stops before building anything, with one line naming the flag."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_script(
        ["benchmark/speed/speed.py", "--device", "cuda", "--work_dir", "/nonexistent/speed"], check=False
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "speed.py: error: --device cuda needs a GPU, and torch sees none here; run with --device cpu."
    ]


def test_speed_presets_at_qwen_size_and_rows_per_micro_batch():
    """The GPU presets are Qwen2.5-0.5B's body at the harness's shapes with 8 rows a micro-batch; --micro_batch_rows
    sets the rows of any preset (a pair is two rows) and refuses what cannot be split into pairs."""
    from speed import Args, resolve

    args = resolve(Args(preset="tldr_qwen05b", device="cpu"))
    assert (args.hidden_size, args.num_layers, args.intermediate_size, args.num_heads) == (896, 24, 4864, 14)
    assert (args.vocab_size, args.prompt_length, args.response_length) == (151936, 512, 53)
    assert (args.batch_size, args.pair_batch_size, args.steps, args.updates) == (8, 4, 3, 3)
    args = resolve(Args(preset="grpo_qwen05b", device="cpu"))
    assert (args.hidden_size, args.prompt_length, args.response_length) == (896, 128, 256)
    args = resolve(Args(preset="tldr", device="cpu", micro_batch_rows=6))
    assert (args.batch_size, args.pair_batch_size, args.hidden_size) == (6, 3, 256)
    with pytest.raises(ValueError, match="--micro_batch_rows must be even"):
        resolve(Args(device="cpu", micro_batch_rows=5))
    with pytest.raises(ValueError, match="give one or the others"):
        resolve(Args(device="cpu", micro_batch_rows=4, batch_size=4))
    with pytest.raises(ValueError, match="--sides must include ours"):
        resolve(Args(device="cpu", sides=["trl"]))


def test_speed_precision_and_device_reach_every_side():
    """bf16 is --bf16 on our command line and bf16=True in TRL's config; cuda turns TRL's use_cpu off. The CPU
    defaults stay fp32 with use_cpu on."""
    from speed import Args, resolve, trl_common_args, workload

    for device, precision in [("cpu", "fp32"), ("cpu", "bf16"), ("cuda", "bf16"), ("cuda", "fp32")]:
        args = resolve(Args(preset="tldr", device="cpu", precision=precision))
        args.device = device  # resolve() refuses cuda here; the workload only records it
        for algorithm in ("sft", "dpo", "rloo", "online_dpo"):
            spec = workload(algorithm, args, "/w", "/out")
            assert ("--bf16" in spec["ours_command"]) == (precision == "bf16")
            assert (spec["device"], spec["precision"]) == (device, precision)
            config = trl_common_args(spec)
            assert (config["use_cpu"], config["bf16"]) == (device == "cpu", precision == "bf16")
            assert config["max_steps"] == spec["updates"] * spec["steps_per_update"]


def test_speed_result_names_the_device_model_and_precision(tmp_path, monkeypatch):
    """The result file says what it measured: the device (on a CPU without asking torch.cuda anything), the
    precision, and the policy's size, whose parameter count matches the model's own at the tiny size and at
    Qwen2.5-0.5B's (built on the meta device: nothing allocated)."""
    import torch
    from speed import Args, describe, model_record, resolve, run_record
    from transformers import LlamaConfig, LlamaForCausalLM

    def no_cuda(*args, **kwargs):
        raise AssertionError("torch.cuda was asked on a CPU run")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    sizes = [dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True),
             dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                  num_key_value_heads=14, vocab_size=151936, tie_word_embeddings=False)]  # fmt: skip
    for i, size in enumerate(sizes):
        config = LlamaConfig(**size)
        world = tmp_path / f"world{i}"
        config.save_pretrained(world / "policy")
        with torch.device("meta"):
            parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
        assert model_record(str(world))["parameters"] == parameters
    assert parameters == 663_169_920  # the GPU presets' policy
    record = run_record(resolve(Args(device="cpu", precision="bf16")), str(world))
    assert record["device"]["type"] == "cpu" and record["precision"] == "bf16 autocast on fp32 weights"
    assert record["model"]["hidden_size"] == 896 and record["model"]["num_layers"] == 24
    assert describe(record).startswith("CPU, ") and "663M parameters" in describe(record)
    gpu = {**record, "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "cuda": "13.0"}}
    assert describe(gpu).startswith("NVIDIA H100 80GB HBM3 (cuda 13.0); policy 663M parameters")


def test_speed_summarizes_cuda_memory_per_side():
    """Peak CUDA memory and wall time per update get medians and ours / TRL ratios like every other figure, and
    the GPU table shows them; a run without them (CPU) leaves them out."""
    from speed import gpu_table, summarize

    def run(allocated, reserved, seconds):
        base = {"throughput": 1.0, "wall_per_update_s": seconds, "cuda_max_allocated_mib": allocated,
                "cuda_max_reserved_mib": reserved}  # fmt: skip
        return base

    summary = summarize({"sft": {"ours": [run(900, 1000, 0.2), run(1100, 1200, 0.4)],
                                 "trl": [run(1000, 1000, 0.1), run(1000, 1000, 0.2)]}})  # fmt: skip
    allocated = summary["sft"]["cuda_max_allocated_mib"]
    assert allocated["ours"] == 1000 and allocated["ours/trl"] == pytest.approx(
        {"median": 1.0, "min": 0.9, "max": 1.1}
    )
    assert summary["sft"]["wall_per_update_s"]["ours/trl"]["median"] == pytest.approx(2.0)
    assert "| sft | 1000 / 1000 | 1.00 | 1100 / 1000 | 1.10 | 0.300 / 0.150 | 2.00 |" in gpu_table(summary)
    cpu = summarize({"sft": {"ours": [{"throughput": 1.0}], "trl": [{"throughput": 2.0}]}})
    assert "cuda_max_allocated_mib" not in cpu["sft"]


def test_speed_compare_gpu_table_names_the_gpu_and_gives_ratios(tmp_path, capsys):
    """speed_compare.py --gpu: one row per algorithm of each result file, with the GPU's name, the model's size,
    the precision, and ours / TRL of peak CUDA memory and wall seconds per update."""
    from speed import summarize
    from speed_compare import gpu_table

    def run(allocated, seconds):
        return {"throughput": 1.0, "wall_per_update_s": seconds, "cuda_max_allocated_mib": allocated,
                "cuda_max_reserved_mib": allocated + 100}  # fmt: skip

    result = {"args": {"preset": "tldr_qwen05b", "prompt_length": 512, "response_length": 53, "vocab_size": 151936},
              "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}, "model": {"parameters": 663_169_920},
              "precision": "bf16 autocast on fp32 weights",
              "summary": summarize({"sft": {"ours": [run(16293, 0.145)], "trl": [run(16376, 0.123)]},
                                    "ppo": {"ours": [run(34364, 1.79)]}})}  # fmt: skip
    path = tmp_path / "speed_tldr_qwen05b.json"
    path.write_text(json.dumps(result))
    gpu_table([str(path)])
    rows = [line for line in capsys.readouterr().out.splitlines() if "NVIDIA" in line]
    assert len(rows) == 2 and "663M parameters, bf16 autocast on fp32 weights" in rows[0]
    assert "| sft | 0.99 (16293 / 16376 MiB) | 0.99 (16393 / 16476 MiB) | 1.18 (0.145 / 0.123 s) |" in rows[0]
    assert rows[1].endswith("| ppo | - | - | - (1.790 s / -) |")


def test_speed_profile_counts_host_syncs_per_update():
    """--profile's summary counts the ops that wait for the device (.item(), boolean indexing) per timed update,
    from torch.profiler's averages."""
    import torch
    from speed import profile_summary
    from torch.profiler import ProfilerActivity, profile

    x = torch.arange(12.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):  # three "updates": one .item() and one boolean index each
            x.sum().item()
            x[x > 5].sum()
    summary = profile_summary(prof.key_averages(), 3, cuda=False)
    assert summary["host_syncs_per_update"]["aten::_local_scalar_dense"] == 1
    assert summary["host_syncs_per_update"]["aten::nonzero"] >= 1
    assert summary["aten_ops_per_update"] >= 4 and "aten::sum" in summary["top_ops"]
    assert "kernel_launches_per_update" not in summary


def test_ilql_reward_baseline_is_the_mean_of_the_prompts_completions():
    import random

    import torch
    from ilql_data import subtract_prompt_baseline

    rng = random.Random(0)
    k, b = 3, 5
    # rewards[c][i]: completion c of prompt i
    rewards = [[rng.gauss(0, 1) for _ in range(b)] for _ in range(k)]
    centred = subtract_prompt_baseline(torch.tensor(rewards, dtype=torch.float64), "prompt_mean")
    for i in range(b):
        for c in range(k):
            others = [rewards[j][i] for j in range(k) if j != c]
            assert centred[c, i].item() == pytest.approx(rewards[c][i] - (rewards[c][i] + sum(others)) / k)
            leave_one_out = rewards[c][i] - sum(others) / (k - 1)  # the same up to the factor (k-1)/k
            assert centred[c, i].item() == pytest.approx((k - 1) / k * leave_one_out)
    two = torch.tensor([[1.0, 5.0], [3.0, 2.0]])  # two completions: +-half the gap
    assert subtract_prompt_baseline(two, "prompt_mean").tolist() == [[-1.0, 1.5], [1.0, -1.5]]
    assert subtract_prompt_baseline(two, "none").tolist() == two.tolist()


def test_ilql_data_refuses_a_baseline_with_one_completion_per_prompt(world, tmp_path):
    result = run_script(
        ["benchmark/tiny/ilql_data.py", "--model_path", str(world / "policy"), "--reward_model_path", str(world / "reward"),
         "--dataset_name", str(world / "dataset"), "--num_completions", "1", "--reward_baseline", "prompt_mean",
         "--output_dir", str(tmp_path / "data")],
        check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "needs --num_completions 2 or more" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "data").exists()


LIVE_HEAP_CHECK = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.calloc.restype = libc.realloc.restype = ctypes.c_void_p
libc.realloc.argtypes, libc.free.argtypes = [ctypes.c_void_p, ctypes.c_size_t], [ctypes.c_void_p]
live, peak = libc.live_heap_bytes, libc.live_heap_peak_bytes
tensors, tensor_peak = libc.live_tensor_bytes, libc.live_tensor_peak_bytes
live.restype = peak.restype = tensors.restype = tensor_peak.restype = ctypes.c_long
import torch
MB = 2**20
start, tensor_start = live(), tensors()
block = torch.empty(50 * MB, dtype=torch.uint8)  # torch's CPU allocator: posix_memalign
heap = [live() - start, peak() - start]
tensor = [tensors() - tensor_start, tensor_peak() - tensor_start]
del block
heap.append(live() - start)
tensor.append(tensors() - tensor_start)
for _ in range(10):  # freed at once: the peak must not add them up
    torch.empty(20 * MB, dtype=torch.uint8)
heap.append(peak() - start)
tensor.append(tensor_peak() - tensor_start)
p = libc.calloc(1, 10 * MB)  # heap, not tensors
heap.append(live() - start)
p = libc.realloc(p, 30 * MB)
heap.append(live() - start)
tensor.append(tensors() - tensor_start)
libc.free(p)
heap += [live() - start, peak()]
tensor.append(tensor_peak())
print(*heap, *tensor)
"""


def test_live_heap_shim_counts_what_is_held_not_what_was_freed(tmp_path):
    """benchmark/memory/live_heap.c against allocations of known sizes: torch's tensors (posix_memalign),
    calloc, realloc and free through the C library; a freed block leaves the count, the peak is the most held
    at once, and only torch's blocks count as tensors.
    """
    import os
    import shutil
    import subprocess
    import sys

    from speed import live_heap_library

    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the shim")
    library = live_heap_library(str(tmp_path))
    output = tmp_path / "peak.txt"
    env = {**os.environ, "LD_PRELOAD": str(library), "LIVE_HEAP_OUTPUT": str(output), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", LIVE_HEAP_CHECK], env=env, capture_output=True, text=True,
                            check=True)  # fmt: skip
    alloc, peak_50, freed, peak_loop, calloc, realloc, end, peak, *tensor = map(int, result.stdout.split())
    MB, slack = 2**20, 2**18  # glibc rounds each block up by at most a page; Python's own objects come and go
    assert 50 * MB <= alloc < 50 * MB + slack and 50 * MB <= peak_50 < 50 * MB + slack
    assert abs(freed) < slack
    assert peak_loop < 50 * MB + slack  # ten 20 MB blocks, one at a time, stay under the 50 MB one
    assert 10 * MB <= calloc - freed < 10 * MB + slack and 30 * MB <= realloc - freed < 30 * MB + slack
    assert abs(end - freed) < slack
    t_alloc, t_peak_50, t_freed, t_peak_loop, t_after_realloc, t_peak = tensor
    assert 50 * MB <= t_alloc < 50 * MB + 2**12 and 50 * MB <= t_peak_50 < 50 * MB + slack
    assert t_freed == 0 and 50 * MB <= t_peak_loop < 50 * MB + slack
    assert t_after_realloc == 0  # calloc and realloc are not tensors
    heap_peak, tensor_peak, overflow = map(int, output.read_text().split())  # written at exit
    assert heap_peak >= peak and tensor_peak >= t_peak and overflow == 0


def test_speed_counts_the_checkpoint_files_a_process_maps(tmp_path):
    """The weights of a loaded model stay in its safetensors file's mapping (on every side), outside the heap:
    speed.py adds the mapped size to the held memory, once per mapping, and nothing for other files."""
    import gc
    import mmap

    from speed import checkpoints_mapped_kib

    gc.collect()  # a model left by an earlier test in this worker must not be unmapped halfway through
    gc.disable()
    try:
        before = checkpoints_mapped_kib()
        paths = {"model.safetensors": 3 * 2**20, "reward.safetensors": 2**20, "tokenizer.json": 2**20}
        files, maps = [], []
        for name, size in paths.items():
            (tmp_path / name).write_bytes(b"\0" * size)
            files.append(open(tmp_path / name, "rb"))
            maps.append(mmap.mmap(files[-1].fileno(), 0, access=mmap.ACCESS_READ))
        assert checkpoints_mapped_kib() - before == 4 * 1024
        for m, f in zip(maps, files):
            m.close()
            f.close()
        assert checkpoints_mapped_kib() == before
    finally:
        gc.enable()


def test_every_mutation_names_one_place_of_its_file():
    """benchmark/reliability/mutations.py's bugs follow the code: each mutation's text is found exactly once in
    its file, so that a reshaping cannot leave a mutation stale (never run) or ambiguous."""
    from mutations import MUTATIONS

    counts = {(m.file, m.what): (ROOT / m.file).read_text().count(m.old) for m in MUTATIONS}
    assert all(count == 1 for count in counts.values()), {k: c for k, c in counts.items() if c != 1}
