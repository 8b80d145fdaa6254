"""Offline tests of the full-TL;DR tooling: shell scripts, accelerate configs, dataset preparation, judge."""

import glob
import importlib.util
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"


def load_module(relative_path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses of modules with `from __future__ import annotations` need it
    spec.loader.exec_module(module)
    return module


prep = load_module("benchmark/tldr/prepare_dataset.py", "tldr_prepare_dataset")
judge = load_module("benchmark/tldr/judge_tldr.py", "tldr_judge")


# ----------------------------------------------------------------------------------------------------------
# Shell scripts and accelerate configs
# ----------------------------------------------------------------------------------------------------------

SHELL_SCRIPTS = sorted(glob.glob(str(ROOT / "benchmark" / "tldr" / "*.sh")))


def test_there_are_shell_scripts():
    names = {Path(p).name for p in SHELL_SCRIPTS}
    assert {"pythia_1b.sh", "pythia_2.8b.sh", "pythia_6.9b.sh", "common.sh", "prepare_data.sh"} <= names


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: Path(p).name)
def test_shell_script_parses(script):
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: Path(p).name)
def test_shell_script_uses_existing_configs_and_files(script):
    text = Path(script).read_text()
    for config in re.findall(r"accelerate_configs/([\w.]+\.yaml)", text):
        assert (ROOT / "accelerate_configs" / config).is_file(), config
    for sourced in re.findall(r'source "[^"]*/([\w.]+\.sh)"', text):
        assert (ROOT / "benchmark" / "tldr" / sourced).is_file(), sourced


def test_grad_accum_helper_checks_exact_division():
    common = ROOT / "benchmark" / "tldr" / "common.sh"
    ok = subprocess.run(
        ["bash", "-c", f'source "{common}"; grad_accum 512 16 8'], capture_output=True, text=True
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "4"
    bad = subprocess.run(
        ["bash", "-c", f'source "{common}"; grad_accum 512 3 8'], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "divide" in bad.stderr


FAKE_ACCELERATE = """#!/usr/bin/env bash
echo "accelerate $*" >> "$DRY_LOG"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--output_dir" ] && out="$a"; prev="$a"; done
mkdir -p "$out" && echo '{}' > "$out/config.json"
"""
FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$DRY_LOG"
"""


def dry_run(tmp_path, script, **env):
    """Run a pipeline script with `accelerate` and `python` replaced by recorders; returns (proc, lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("accelerate", FAKE_ACCELERATE), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for kind in ("sft", "preference", "prompts"):
        (tmp_path / "data" / kind).mkdir(parents=True, exist_ok=True)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    full_env = {
        **{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DRY_LOG": str(log),
        "DATA_DIR": str(tmp_path / "data"),
        "OUTPUT_ROOT": str(tmp_path / "models"),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmark/tldr" / script)], env=full_env, capture_output=True, text=True
    )
    return proc, log.read_text().splitlines() if log.exists() else []


def flag(line, name):
    words = line.split()
    return words[words.index(name) + 1]


def test_pipeline_dry_run(tmp_path):
    proc, calls = dry_run(tmp_path, "pythia_1b.sh", SEEDS="7 8", OPENAI_API_KEY="x")
    assert proc.returncode == 0, proc.stderr
    launches = [line for line in calls if line.startswith("accelerate")]
    scripts = [Path(line.split()[6]).name for line in launches]
    assert scripts == ["sft.py", "reward.py", "ppo.py", "rloo.py", "dpo.py"] * 2
    expected_accum = {"sft.py": "1", "reward.py": "1", "ppo.py": "4", "rloo.py": "8", "dpo.py": "2"}
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    for line, script in zip(launches, scripts):
        assert "accelerate_configs/deepspeed_zero2.yaml" in line and flag(line, "--num_processes") == "8"
        assert flag(line, "--gradient_accumulation_steps") == expected_accum[script]
        assert flag(line, "--learning_rate") == "3e-6" and "--track" in line.split()
        run_name = flag(line, "--run_name")
        assert re.fullmatch(rf"tldr__pythia-1b-deduped__{script[:-3]}__s[78]__[\w-]+", run_name)
        if rev.returncode == 0:
            assert rev.stdout.strip() in run_name
    ppo = launches[2]
    for name, value in (("--kl_coef", "0.05"), ("--response_length", "53"), ("--num_ppo_epochs", "4"),
                        ("--temperature", "0.7"), ("--total_episodes", "1000000"), ("--stop_token", "eos")):  # fmt: skip
        assert flag(ppo, name) == value
    assert flag(launches[3], "--rloo_k") == "2" and flag(launches[3], "--kl_coef") == "0.03"
    assert flag(launches[4], "--beta") == "0.05" and flag(launches[4], "--loss_type") == "sigmoid"
    judged = [line for line in calls if "judge_tldr.py" in line]
    assert len(judged) == 8 and all(flag(line, "--model") == "gpt-4o-mini" for line in judged)

    # Finished stages are not run again; the eval stage alone is repeated.
    proc, calls = dry_run(tmp_path, "pythia_1b.sh", SEEDS="7", OPENAI_API_KEY="x")
    assert proc.returncode == 0 and not [line for line in calls if line.startswith("accelerate")]


def test_pipeline_command_lines_parse_with_the_scripts_args(tmp_path):
    """Every command the pipeline runs is accepted by that script's own Args (catches renamed flags)."""
    import shlex

    import tyro

    proc, calls = dry_run(tmp_path, "pythia_2.8b.sh", SEEDS="3", OPENAI_API_KEY="x")
    assert proc.returncode == 0, proc.stderr
    checked = set()
    for line in calls:
        words = shlex.split(line)
        script, argv = (words[6], words[7:]) if words[0] == "accelerate" else (words[1], words[2:])
        name = Path(script).stem
        if name in checked:
            continue
        if not Path(script).is_file():
            pytest.skip(f"{name}.py is not written yet")
        module = load_module(str(Path(script).relative_to(ROOT)), f"pipeline_{name}")
        tyro.cli(module.Args, args=argv, use_underscores=True)  # SystemExit on an unknown flag
        checked.add(name)
    assert checked == {"sft", "reward", "ppo", "rloo", "dpo", "evaluate_tldr", "judge_tldr"}


def test_pipeline_6_9b_uses_zero3_and_offload_for_rl(tmp_path):
    proc, calls = dry_run(tmp_path, "pythia_6.9b.sh", SEEDS="1", STAGES="sft ppo rloo")
    assert proc.returncode == 0, proc.stderr
    configs = [Path(flag(line, "--config_file")).name for line in calls]
    assert configs == ["deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml", "deepspeed_zero3_offload.yaml"]


def test_pipeline_checks_batches_and_key_before_training(tmp_path):
    proc, calls = dry_run(tmp_path, "pythia_1b.sh", SEEDS="1", NUM_GPUS="3")
    assert proc.returncode != 0 and "does not divide" in proc.stderr and calls == []
    proc, calls = dry_run(tmp_path, "pythia_1b.sh", SEEDS="1", STAGES="eval")
    assert proc.returncode != 0 and "OPENAI_API_KEY" in proc.stderr and calls == []


@pytest.mark.parametrize(
    "name", ["multi_gpu.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml"]
)
def test_accelerate_config_is_valid(name):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    config = ClusterConfig.from_yaml_file(str(ROOT / "accelerate_configs" / name))  # rejects unknown keys
    launch_options = {action.dest for action in launch_command_parser()._actions}
    for key in config.deepspeed_config or {}:
        assert key in launch_options, (
            f"{name}: deepspeed_config key {key!r} is not an accelerate launch option"
        )
    expected = {"multi_gpu.yaml": "MULTI_GPU"}.get(name, "DEEPSPEED")
    assert str(config.distributed_type).endswith(expected)
    if name != "multi_gpu.yaml":
        assert config.deepspeed_config["zero_stage"] == (2 if "zero2" in name else 3)
        offload = "offload" in name
        assert (config.deepspeed_config["offload_optimizer_device"] == "cpu") == offload
        assert (config.deepspeed_config["offload_param_device"] == "cpu") == offload


# ----------------------------------------------------------------------------------------------------------
# Dataset preparation
# ----------------------------------------------------------------------------------------------------------

CORPUS = [
    "SUBREDDIT: r/relationships TITLE: POST: TL;DR: my boyfriend forgot my birthday again",
    "I moved to a new city and I do not know anyone here, what should I do",
    "my landlord will not return the deposit even though the flat was clean",
    "we adopted a dog last week and the cat is not happy about it at all",
    "the quick brown fox jumps over the lazy dog 0123456789 .,;:!?'\"()-",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained on a few strings, with the Pythia EOS text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def count_tokens(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def slow_truncate_post(subreddit, title, post, count_tokens, max_len):
    """summarize-from-feedback's loop, literally: cut at the last newline, else drop one character."""
    while count_tokens(prep.QUERY_FORMAT.format(subreddit=subreddit, title=title, post=post)) > max_len:
        if not post:
            return None
        i = post.rfind("\n")
        post = post[:i] if i >= 0 else post[:-1]
    return post


def test_format_and_parse_query():
    query = prep.format_query("tifu", "My title", "line one\n\nline two")
    assert query == "SUBREDDIT: r/tifu\n\nTITLE: My title\n\nPOST: line one\n\nline two\n\nTL;DR:"
    assert prep.parse_query(query) == {
        "subreddit": "tifu",
        "title": "My title",
        "post": "line one\n\nline two",
    }
    assert prep.parse_query("Article:\nsomething\n\nTL;DR:") is None


def test_format_completion():
    assert prep.format_completion("  forgot my birthday \n", EOS) == " forgot my birthday" + EOS
    assert prep.format_completion("x", "") == " x"


def test_truncation_cuts_the_post_at_its_last_newlines(count_tokens):
    paragraphs = ["my landlord will not return the deposit", "the flat was clean", "what should I do now"]
    post = "\n".join(paragraphs)
    fits_two = count_tokens(prep.format_query("legaladvice", "Deposit", "\n".join(paragraphs[:2])))
    assert fits_two < count_tokens(prep.format_query("legaladvice", "Deposit", post))
    # A limit that the first two paragraphs meet exactly: the third is cut at the newline, nothing more.
    cut = prep.truncate_post("legaladvice", "Deposit", post, count_tokens, fits_two)
    assert cut == "\n".join(paragraphs[:2])
    # One token less: the second paragraph goes too.
    assert prep.truncate_post("legaladvice", "Deposit", post, count_tokens, fits_two - 1) == paragraphs[0]
    # A query that already fits is untouched.
    assert prep.truncate_post("legaladvice", "Deposit", post, count_tokens, 10_000) == post
    # Nothing fits: None.
    assert prep.truncate_post("legaladvice", "Deposit", post, count_tokens, 3) is None


def test_truncation_matches_the_one_character_loop(count_tokens):
    rng = random.Random(0)
    words = " ".join(CORPUS).split()
    for trial in range(30):
        post = " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
        if trial % 3 == 0:  # some posts with newlines, most without
            post = post.replace(" the ", "\nthe ", 2)
        full = count_tokens(prep.format_query("sub", "a title", post))
        limit = rng.randint(max(1, full - 40), full + 2)
        fast = prep.truncate_post("sub", "a title", post, count_tokens, limit)
        assert fast == slow_truncate_post("sub", "a title", post, count_tokens, limit), (post, limit)
        if fast is not None:
            assert count_tokens(prep.format_query("sub", "a title", fast)) <= limit
            assert post.startswith(fast)


def sft_rows():
    long_post = "\n".join(["my landlord will not return the deposit even though the flat was clean"] * 6)
    return [
        {
            "id": "a",
            "subreddit": "relationships",
            "title": "Birthday",
            "post": "he forgot again",
            "summary": "he forgot",
        },
        {
            "id": "b",
            "subreddit": "legaladvice",
            "title": "Deposit",
            "post": long_post,
            "summary": "no deposit back",
        },
        {
            "id": "c",
            "subreddit": "dogs",
            "title": "New dog",
            "post": "the cat is upset",
            "summary": "cat " * 40,
        },
        {
            "id": "d",
            "subreddit": "x",
            "title": "the title alone is far too long " * 10,
            "post": "p",
            "summary": "s",
        },
    ]


def comparison_rows():
    info = {"id": "t1", "subreddit": "dogs", "title": "New dog", "post": "we adopted a dog\nthe cat is upset"}
    return [
        {"info": info, "summaries": [{"text": " cat upset"}, {"text": " we got a dog"}], "choice": 1},
        {"info": info, "summaries": [{"text": " dog"}, {"text": " cat"}], "choice": 0},
        {  # a CNN/DM comparison: no post, skipped
            "info": {"id": "c1", "subreddit": None, "title": None, "post": None, "article": "news"},
            "summaries": [{"text": " a"}, {"text": " b"}],
            "choice": 0,
        },
    ]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_prepare_dataset_end_to_end(tmp_path, tokenizer_dir, count_tokens):
    write_jsonl(tmp_path / "sft_src" / "train.jsonl", sft_rows())
    write_jsonl(tmp_path / "sft_src" / "valid.jsonl", sft_rows()[:1])
    write_jsonl(tmp_path / "pref_src" / "train.jsonl", comparison_rows())
    out = tmp_path / "out"
    args = prep.Args(
        tokenizer_name_or_path=str(tokenizer_dir),
        sft_dataset_name=str(tmp_path / "sft_src"),
        preference_dataset_name=str(tmp_path / "pref_src"),
        output_dir=str(out),
        output_format="jsonl",
        max_query_length=150,
        max_response_length=16,
        max_preference_response_length=16,
    )
    summary = prep.main(args)

    sft = read_jsonl(out / "sft" / "train.jsonl")
    assert [r["id"] for r in sft] == ["a", "b"]  # c: reference too long, d: title alone too long
    assert summary["stats"]["sft"]["train"]["dropped"] == {"query_too_long": 1, "response_too_long": 1}
    assert summary["stats"]["sft"]["train"]["posts_truncated_at_newline_or_char"] == 1
    assert (out / "sft" / "validation.jsonl").is_file()  # "valid" is renamed
    assert (
        sft[0]["prompt"] == "SUBREDDIT: r/relationships\n\nTITLE: Birthday\n\nPOST: he forgot again\n\nTL;DR:"
    )
    for row in sft:
        assert row["completion"].startswith(" ") and not row["completion"].startswith("  ")
        assert row["completion"].endswith(EOS)
        assert count_tokens(row["completion"]) <= 16
        assert count_tokens(row["prompt"]) <= 150
    # The long post was cut at a newline: whole lines of the original, and one more would not fit.
    fields = prep.parse_query(sft[1]["prompt"])
    original = sft_rows()[1]["post"]
    assert original.startswith(fields["post"]) and original[len(fields["post"])] == "\n"
    longer = original[: original.index("\n", len(fields["post"]) + 1)]
    assert count_tokens(prep.format_query("legaladvice", "Deposit", longer)) > 150

    prompts = read_jsonl(out / "prompts" / "train.jsonl")
    assert [r["id"] for r in prompts] == ["a", "b", "c"]  # prompt-only keeps c: its query fits
    assert set(prompts[0]) == {"prompt", "id"}

    pref = read_jsonl(out / "preference" / "train.jsonl")
    assert len(pref) == 2 and summary["stats"]["preference"]["train"]["dropped"] == {"not_tldr": 1}
    assert pref[0]["chosen"] == " we got a dog" + EOS and pref[0]["rejected"] == " cat upset" + EOS
    assert pref[1]["chosen"] == " dog" + EOS and pref[0]["id"] == "t1"
    assert json.loads((out / "prepare_summary.json").read_text())["eos_text"] == EOS

    # A second run refuses the non-empty output directory and leaves it intact.
    with pytest.raises(SystemExit, match="not empty"):
        prep.main(args)
    assert read_jsonl(out / "sft" / "train.jsonl") == sft


def test_prepare_dataset_reformats_formatted_prompts(tmp_path, tokenizer_dir):
    post = "first line of the post\nsecond line of the post\nthird line of the post"
    rows = [{"prompt": prep.format_query("sub", "t", post), "completion": " the summary"}]
    write_jsonl(tmp_path / "src.jsonl", rows)
    out = tmp_path / "out"
    args = prep.Args(
        tokenizer_name_or_path=str(tokenizer_dir),
        sft_dataset_name=str(tmp_path / "src.jsonl"),
        output_dir=str(out),
        output_format="disk",
        max_query_length=70,
    )
    summary = prep.main(args)
    assert summary["stats"]["sft"]["train"]["layout"] == "formatted_sft"
    from datasets import load_from_disk

    row = load_from_disk(str(out / "sft"))["train"][0]
    assert row["completion"] == " the summary" + EOS
    assert post.startswith(prep.parse_query(row["prompt"])["post"])
    assert len(prep.parse_query(row["prompt"])["post"]) < len(post)


def test_prepare_dataset_rejects_bad_input(tmp_path, tokenizer_dir):
    with pytest.raises(SystemExit, match="Nothing to do"):
        prep.check_args(prep.Args(output_dir=str(tmp_path / "o")))
    write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(SystemExit, match=r"expected subreddit/title/post/summary.*found \['text'\]"):
        prep.main(
            prep.Args(
                tokenizer_name_or_path=str(tokenizer_dir),
                sft_dataset_name=str(tmp_path / "bad.jsonl"),
                output_dir=str(tmp_path / "o"),
            )
        )
    assert not (tmp_path / "o").exists()


def test_prepare_dataset_cli_help():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark/tldr/prepare_dataset.py"), "--help"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--max_query_length",
        "--max_response_length",
        "--tokenizer_name_or_path",
        "--no_append_eos",
    ):
        assert flag in proc.stdout


# ----------------------------------------------------------------------------------------------------------
# Judge: pure functions
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, verdict",
    [
        ("Comparison: A is shorter.\nPreferred: A", "A"),
        ("Comparison: B keeps the key point.\n\nPreferred: B\n", "B"),
        ('Preferred: "B".', "B"),
        ("Preferred: A or B", None),
        ("Comparison: both fine", None),
        ("A", None),
        ("preferred: a", None),
        ("Preferred: A\nPreferred: B", None),
        ("Preferred: A\nComparison: afterthought", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_verdict_is_strict(answer, verdict):
    assert judge.parse_verdict(answer) == verdict


def test_model_score_undoes_the_order():
    assert judge.model_score("A", model_is_a=True) == 1.0
    assert judge.model_score("A", model_is_a=False) == 0.0
    assert judge.model_score("B", model_is_a=False) == 1.0
    assert judge.model_score("B", model_is_a=True) == 0.0
    assert judge.model_score("tie", model_is_a=True) == 0.5


def test_win_rate_ci_hand_computed():
    # scores 1, 0, 0.5, 1: mean 0.625, sample variance ((.375)^2 + (.625)^2 + (.125)^2 + (.375)^2) / 3
    mean, low, high = judge.win_rate_with_ci([1.0, 0.0, 0.5, 1.0])
    variance = (0.375**2 + 0.625**2 + 0.125**2 + 0.375**2) / 3
    half = 1.959963984540054 * math.sqrt(variance / 4)
    assert mean == pytest.approx(0.625)
    assert low == pytest.approx(max(0.0, 0.625 - half)) and high == pytest.approx(min(1.0, 0.625 + half))
    assert judge.win_rate_with_ci([1.0] * 10) == (1.0, 1.0, 1.0)
    assert math.isnan(judge.win_rate_with_ci([1.0])[1]) and math.isnan(judge.win_rate_with_ci([])[0])


def test_order_is_a_function_of_seed_and_index():
    first = [judge.model_goes_first(0, i) for i in range(200)]
    assert first == [judge.model_goes_first(0, i) for i in range(200)]
    assert 70 < sum(first) < 130
    assert first != [judge.model_goes_first(1, i) for i in range(200)]


def test_retries_back_off_exponentially():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise judge.RetryableError("HTTP 500")
        return "ok"

    assert judge.call_with_retries(flaky, 5, 1.0, 60.0, sleep=sleeps.append) == ("ok", 2)
    assert 1.0 <= sleeps[0] <= 1.1 and 2.0 <= sleeps[1] <= 2.2
    with pytest.raises(judge.RetryableError):
        judge.call_with_retries(
            lambda: (_ for _ in ()).throw(judge.RetryableError("x")), 2, 0.0, 0.0, sleeps.append
        )


# ----------------------------------------------------------------------------------------------------------
# Judge against a local chat-completions server
# ----------------------------------------------------------------------------------------------------------


class FakeJudgeServer:
    """Speaks POST /v1/chat/completions; prefers the summary containing GOOD.

    Summaries with GARBLE get an answer without a verdict; FLAKY gets one HTTP 500 first, RATELIMIT one
    429 with Retry-After: 0; the model name `deny` gets HTTP 401.
    """

    def __init__(self):
        self.requests, self.failed_once, self.lock = [], set(), threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, payload, headers=None):
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = body["messages"][0]["content"]
                with server.lock:
                    server.requests.append((self.path, dict(self.headers), body))
                if body["model"] == "deny":
                    return self.reply(401, {"error": {"message": "invalid key"}})
                a, b = re.search(r"Summary A:\n(.*?)\n\nSummary B:\n(.*?)\n\n", content, re.S).groups()
                for trigger, code, headers in (("FLAKY", 500, {}), ("RATELIMIT", 429, {"Retry-After": "0"})):
                    if trigger in content:
                        with server.lock:
                            first = (trigger, content) not in server.failed_once
                            server.failed_once.add((trigger, content))
                        if first:
                            return self.reply(code, {"error": {"message": trigger}}, headers)
                if "GARBLE" in content:
                    text = "Both summaries are fine."
                else:
                    text = f"Comparison: one is better.\nPreferred: {'A' if 'GOOD' in a else 'B'}"
                self.reply(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


# (model summary, reference, expected model score or None when left out)
JUDGE_CASES = [
    ("GOOD zero", "plain zero", 1.0),
    ("bad one", "GOOD one", 0.0),
    ("GOOD two FLAKY", "ref two", 1.0),
    ("same text", "same text" + EOS, 0.5),  # identical once the EOS text is stripped: a tie, no request
    ("GARBLE four", "GOOD four", None),
    ("GOOD five RATELIMIT", "ref five", 1.0),
    ("meh six", "GOOD six", 0.0),
    ("GOOD seven", "ref seven", 1.0),
    ("eight", "GOOD eight", 0.0),
    ("GOOD nine", "ref nine", 1.0),
    ("ten", "GOOD ten", 0.0),
    ("GOOD eleven", "ref eleven", 1.0),
]


def judge_input(tmp_path):
    rows = [
        {
            "id": f"r{i}",
            "prompt": prep.format_query("sub", f"title {i}", f"post {i}"),
            "completion": c,
            "reference": r,
        }
        for i, (c, r, _) in enumerate(JUDGE_CASES)
    ]
    write_jsonl(tmp_path / "summaries.jsonl", rows)
    return str(tmp_path / "summaries.jsonl")


@pytest.mark.parametrize("seed", [0, 1])
def test_judge_against_local_server(tmp_path, monkeypatch, seed):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sekret")
    path = judge_input(tmp_path)
    with FakeJudgeServer() as server:
        args = judge.Args(
            input_jsonl=path,
            base_url=server.url,
            model="fake-judge",
            api_key_env="TEST_JUDGE_KEY",
            seed=seed,
            num_threads=4,
            initial_backoff=0.01,
            max_backoff=0.05,
            timeout=10,
        )
        summary = judge.main(args)

    results = read_jsonl(tmp_path / "summaries.judged.jsonl")
    assert [r["id"] for r in results] == [f"r{i}" for i in range(len(JUDGE_CASES))]
    for result, (_, _, expected) in zip(results, JUDGE_CASES):
        assert result["model_score"] == expected, result
        assert result["model_is_a"] == judge.model_goes_first(seed, result["index"])
    assert {r["model_is_a"] for r in results if r["status"] == "ok"} == {True, False}
    statuses = [r["status"] for r in results]
    assert statuses.count("identical") == 1 and statuses.count("unparseable") == 1
    assert results[4]["judge_answer"] == "Both summaries are fine."

    # 11 rows needed the judge (not the identical one); FLAKY and RATELIMIT each cost one extra request.
    assert len(server.requests) == 13 and summary["n_retries"] == 2
    assert all(p == "/v1/chat/completions" for p, _, _ in server.requests)
    assert all(h.get("Authorization") == "Bearer sekret" for _, h, _ in server.requests)
    assert all(b["model"] == "fake-judge" and b["temperature"] == 0.0 for _, _, b in server.requests)
    assert all("same text" not in b["messages"][0]["content"] for _, _, b in server.requests)
    assert all("TL;DR:" not in b["messages"][0]["content"] for _, _, b in server.requests)

    expected_scores = [e for _, _, e in JUDGE_CASES if e is not None]
    mean = sum(expected_scores) / len(expected_scores)
    half = 1.959963984540054 * statistics.stdev(expected_scores) / math.sqrt(len(expected_scores))
    assert summary["win_rate"] == pytest.approx(mean)
    assert summary["ci95_low"] == pytest.approx(mean - half) and summary["ci95_high"] == pytest.approx(
        mean + half
    )
    assert summary["n_judged"] == 11 and summary["n_total"] == 12
    assert (summary["n_wins"], summary["n_losses"], summary["n_ties"]) == (6, 4, 1)
    assert summary["tie_rate"] == pytest.approx(1 / 11)
    assert summary["n_unparseable"] == 1 and summary["n_errors"] == 0
    on_disk = json.loads((tmp_path / "summaries.judged.summary.json").read_text())
    assert on_disk["win_rate"] == pytest.approx(mean) and on_disk["n_unparseable"] == 1


def test_judge_counts_requests_that_keep_failing(tmp_path):
    rows = [
        {"prompt": "p", "completion": "GOOD FLAKY", "reference": "r"},
        {"prompt": "p", "completion": "GOOD", "reference": "r"},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    with FakeJudgeServer() as server:
        summary = judge.main(
            judge.Args(
                input_jsonl=str(tmp_path / "in.jsonl"), base_url=server.url, api_key_env="UNSET_KEY_FOR_TEST",
                max_retries=0, initial_backoff=0.0, timeout=10,
            )
        )  # fmt: skip
    assert summary["n_errors"] == 1 and summary["n_judged"] == 1 and summary["win_rate"] == 1.0
    assert all("Authorization" not in h for _, h, _ in server.requests)


def test_judge_stops_on_an_auth_error(tmp_path):
    path = judge_input(tmp_path)
    with FakeJudgeServer() as server:
        with pytest.raises(SystemExit, match=r"HTTP 401.*\$NO_SUCH_KEY"):
            judge.main(
                judge.Args(input_jsonl=path, base_url=server.url, model="deny", api_key_env="NO_SUCH_KEY")
            )
    assert not (tmp_path / "summaries.judged.jsonl").exists()


def test_judge_rejects_rows_without_the_expected_keys(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(SystemExit, match=r"lacks \['reference'\]"):
        judge.main(judge.Args(input_jsonl=str(tmp_path / "in.jsonl")))


def test_gold_judge_path(tmp_path, monkeypatch):
    import types

    def gold_judge(facts, summary_a, summary_b):  # counts facts mentioned: more is better
        score_a, score_b = (sum(f in s.split() for f in facts) for s in (summary_a, summary_b))
        return 0.5 if score_a == score_b else float(score_a > score_b)

    monkeypatch.setitem(sys.modules, "tiny_world", types.SimpleNamespace(gold_judge=gold_judge))
    rows = [
        {"prompt": "p", "completion": "apple pear", "reference": "apple", "facts": ["apple", "pear"]},
        {"prompt": "p", "completion": "apple", "reference": "apple pear", "facts": ["apple", "pear"]},
        {"prompt": "p", "completion": "pear", "reference": "apple", "facts": ["apple", "pear"]},
        {"prompt": "p", "completion": "apple pear", "reference": "pear apple", "facts": ["apple", "pear"]},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    summary = judge.main(judge.Args(input_jsonl=str(tmp_path / "in.jsonl"), judge="gold", seed=3))
    scores = [r["model_score"] for r in read_jsonl(tmp_path / "in.judged.jsonl")]
    assert scores == [1.0, 0.0, 0.5, 0.5]
    assert summary["win_rate"] == 0.5 and summary["n_ties"] == 2 and summary["judge_model"] == "gold"
    with pytest.raises(SystemExit, match="facts"):
        write_jsonl(tmp_path / "nofacts.jsonl", [{"prompt": "p", "completion": "a", "reference": "b"}])
        judge.main(judge.Args(input_jsonl=str(tmp_path / "nofacts.jsonl"), judge="gold"))


def test_judge_cli_help():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark/tldr/judge_tldr.py"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--base_url", "--model", "--api_key_env", "--num_threads", "--max_retries", "--judge"):
        assert flag in proc.stdout
