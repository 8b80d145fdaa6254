"""Pairwise judge of TL;DR summaries: how often is a model's summary preferred to the reference?

Input: a jsonl file of rows {"prompt", "completion" (the model's summary), "reference"} (plus optional
"id" and, for --judge gold, "facts"), as written by the generation step. For every row the judge sees
the post and the two summaries in an order drawn from --seed and the row's index (so the order does
not depend on thread scheduling), answers which is better, and the order is undone to score the model:
1 if its summary wins, 0 if it loses, 1/2 for a tie. Identical summaries are a tie without a call.

Judges:
- `openai` (default): any OpenAI-compatible chat-completions endpoint (--base_url, --model), key read
  from the environment variable named by --api_key_env. The answer must end with a line
  `Preferred: A` or `Preferred: B`; anything else is counted as unparseable, reported, and left out of
  the win rate (never guessed). Requests run on --num_threads threads and are retried with exponential
  backoff on rate limits, server errors and timeouts; a 4xx error that retrying cannot fix stops the run.
- `gold`: the programmatic judge of the offline tiny TL;DR world (`benchmark/tiny/tiny_world.py`,
  `gold_judge(facts, summary_a, summary_b)`), reading each row's `facts`.

Output: the per-row results (--output_jsonl) and a summary (same path, `.summary.json`) with the win
rate, its 95% confidence interval (normal approximation over the per-row scores, ties included),
the tie rate, the win rate by position, and the counts of unparseable answers and failed requests.

    python benchmark/tldr/judge_tldr.py --input_jsonl runs/ppo_summaries.jsonl --model gpt-4o-mini
"""

import http.client
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import tyro

JUDGE_TEMPLATE = """You will compare two summaries of the same Reddit post.

Post:
{post}

Summary A:
{summary_a}

Summary B:
{summary_b}

Which summary does a better job of telling a reader the most important points of the post, \
accurately and concisely, without unimportant or irrelevant details? Answer in exactly two lines:
Comparison: <one sentence comparing the two summaries>
Preferred: <A or B>"""
VERDICT_LINE = re.compile(r'Preferred:\s*"?([AB])"?\.?')
RETRYABLE_HTTP_CODES = {408, 409, 425, 429}
Z_95 = 1.959963984540054


@dataclass
class Args:
    input_jsonl: str
    """rows {prompt, completion, reference} (optional id, facts) from the generation step"""
    output_jsonl: str = ""
    """per-row results; default: the input path with `.judged.jsonl` (the summary goes to `.summary.json`)"""
    judge: Literal["openai", "gold"] = "openai"
    """`openai`: a chat-completions endpoint; `gold`: the tiny world's programmatic judge"""
    base_url: str = "https://api.openai.com/v1"
    """OpenAI-compatible API root; requests go to {base_url}/chat/completions"""
    model: str = "gpt-4o-mini"
    """judge model name sent to the endpoint"""
    api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the API key (left unset: no Authorization header, e.g. a local server)"""
    seed: int = 0
    """seed of the per-row A/B order"""
    num_threads: int = 8
    """most requests in flight at once"""
    max_retries: int = 5
    """retries of one request after a rate limit, server error, timeout or malformed reply"""
    initial_backoff: float = 1.0
    """seconds before the first retry; doubled after each further one"""
    max_backoff: float = 60.0
    """longest wait between two retries, in seconds"""
    timeout: float = 60.0
    """seconds to wait for one reply"""
    temperature: float = 0.0
    """judge sampling temperature"""
    max_tokens: int = 256
    """most tokens the judge may write (0: do not send the field)"""
    num_examples: Optional[int] = None
    """judge only the first N rows"""
    strip_suffixes: tuple[str, ...] = ("<|endoftext|>",)
    """texts removed from the end of both summaries before judging (e.g. a literal EOS)"""


class RetryableError(Exception):
    """A failure that may go away on retry (rate limit, server error, timeout, malformed reply)."""

    def __init__(self, message: str, retry_after: Optional[float] = None):
        super().__init__(message)
        self.retry_after = retry_after


class FatalRequestError(Exception):
    """A failure that retrying will not fix (bad key, unknown model, malformed request)."""


# ----------------------------------------------------------------------------------------------------------
# Pure functions (unit-tested)
# ----------------------------------------------------------------------------------------------------------


def model_goes_first(seed: int, index: int) -> bool:
    """Whether row `index` shows the model's summary as A; a function of (seed, index) only."""
    return random.Random(f"{seed}:{index}").random() < 0.5


def parse_verdict(text: Optional[str]) -> Optional[str]:
    """ "A" or "B" from a judge answer whose last non-empty line is `Preferred: A|B`; None otherwise.

    Strict on purpose: exactly one `Preferred:` line, and it must be the last line; only optional
    double quotes around the letter and a final period are tolerated.
    """
    if not text:
        return None
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    verdict_lines = [line for line in lines if line.startswith("Preferred:")]
    if len(verdict_lines) != 1 or lines[-1] != verdict_lines[0]:
        return None
    match = VERDICT_LINE.fullmatch(verdict_lines[0])
    return match.group(1) if match else None


def model_score(verdict: str, model_is_a: bool) -> float:
    """Undo the A/B order: 1 if the model's summary won, 0 if the reference won, 0.5 for a tie."""
    if verdict == "tie":
        return 0.5
    return 1.0 if (verdict == "A") == model_is_a else 0.0


def win_rate_with_ci(scores: list[float], z: float = Z_95) -> tuple[float, float, float]:
    """Mean score and its normal-approximation confidence interval, clipped to [0, 1].

    Uses the sample standard deviation of the per-row scores (0, 1/2 or 1), so ties narrow the interval
    as they should. With fewer than two scores the interval is undefined (NaN).
    """
    n = len(scores)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(scores) / n
    if n < 2:
        return mean, math.nan, math.nan
    variance = sum((s - mean) ** 2 for s in scores) / (n - 1)
    half_width = z * math.sqrt(variance / n)
    return mean, max(0.0, mean - half_width), min(1.0, mean + half_width)


def post_text(prompt: str) -> str:
    """The post as shown to the judge: the prompt without its trailing "TL;DR:" cue."""
    text = prompt.rstrip()
    if text.endswith("TL;DR:"):
        text = text[: -len("TL;DR:")]
    return text.rstrip()


def clean_summary(text: str, suffixes: tuple[str, ...]) -> str:
    text = text.strip()
    stripped = True
    while stripped:
        stripped = False
        for suffix in suffixes:
            if suffix and text.endswith(suffix):
                text = text[: -len(suffix)].rstrip()
                stripped = True
    return text


def judge_prompt(prompt: str, summary_a: str, summary_b: str) -> str:
    return JUDGE_TEMPLATE.format(post=post_text(prompt), summary_a=summary_a, summary_b=summary_b)


# ----------------------------------------------------------------------------------------------------------
# HTTP (standard library only)
# ----------------------------------------------------------------------------------------------------------


def chat_completion(args: Args, api_key: Optional[str], content: str) -> Optional[str]:
    """One chat-completions request; returns the message text (None if the reply has no text)."""
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": content}],
        "temperature": args.temperature,
    }
    if args.max_tokens > 0:
        body["max_tokens"] = args.max_tokens
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        args.base_url.rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode("utf-8"),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read()[:300].decode("utf-8", "replace")
        if error.code in RETRYABLE_HTTP_CODES or error.code >= 500:
            retry_after = error.headers.get("Retry-After") if error.headers else None
            try:
                retry_after = float(retry_after) if retry_after is not None else None
            except ValueError:
                retry_after = None
            raise RetryableError(f"HTTP {error.code}: {detail}", retry_after) from error
        hint = f" (is ${args.api_key_env} set to a valid key?)" if error.code in (401, 403) else ""
        raise FatalRequestError(f"HTTP {error.code} from {args.base_url}{hint}: {detail}") from error
    except (OSError, http.client.HTTPException) as error:  # URLError, timeouts, dropped connections
        raise RetryableError(f"{type(error).__name__}: {error}") from error
    try:
        return json.loads(raw)["choices"][0]["message"].get("content")
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise RetryableError(f"malformed reply: {raw[:200]!r}") from error


def call_with_retries(
    call: Callable[[], Optional[str]],
    max_retries: int,
    initial_backoff: float,
    max_backoff: float,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[Optional[str], int]:
    """Run `call`, retrying RetryableError with exponential backoff; returns (result, retries used).

    Waits initial_backoff * 2**attempt (at most max_backoff, at least the server's Retry-After),
    with up to 10% jitter so that threads do not retry in lockstep. Re-raises after max_retries.
    """
    jitter = random.Random()
    for attempt in range(max_retries + 1):
        try:
            return call(), attempt
        except RetryableError as error:
            if attempt == max_retries:
                raise
            wait = min(max_backoff, initial_backoff * 2**attempt)
            if error.retry_after is not None:
                wait = max(wait, min(max_backoff, error.retry_after))
            sleep(wait * (1 + 0.1 * jitter.random()))
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------------------
# Judging
# ----------------------------------------------------------------------------------------------------------


def read_rows(path: str, num_examples: Optional[int], need_facts: bool) -> list[dict]:
    if not os.path.isfile(path):
        raise SystemExit(f"--input_jsonl {path!r} does not exist.")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise SystemExit(f"{path}:{line_number} is not valid JSON ({error}).") from error
            required = ["prompt", "completion", "reference"] + (["facts"] if need_facts else [])
            missing = [key for key in required if key not in row]
            if missing:
                raise SystemExit(
                    f"{path}:{line_number} lacks {missing}; expected keys {required}, found {sorted(row)}."
                )
            rows.append(row)
            if num_examples is not None and len(rows) == num_examples:
                break
    if not rows:
        raise SystemExit(f"--input_jsonl {path!r} has no rows.")
    return rows


def load_gold_judge() -> Callable:
    """gold_judge(facts, summary_a, summary_b) -> P(A better) from benchmark/tiny/tiny_world.py, imported
    lazily."""
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiny")
    if tiny not in sys.path:
        sys.path.insert(0, tiny)
    import tiny_world

    return tiny_world.gold_judge


def judge_row(index: int, row: dict, args: Args, ask: Callable[[str], tuple[Optional[str], int]]) -> dict:
    """Judge one row with `ask(prompt_text) -> (answer_text, retries)`; never raises RetryableError."""
    model_is_a = model_goes_first(args.seed, index)
    model_summary = clean_summary(row["completion"], args.strip_suffixes)
    reference = clean_summary(row["reference"], args.strip_suffixes)
    result = {"index": index, "model_is_a": model_is_a, "verdict": None, "model_score": None, "retries": 0}
    if "id" in row:
        result["id"] = row["id"]
    if model_summary == reference:
        result.update(status="identical", verdict="tie", model_score=0.5, judge_answer=None)
        return result
    summary_a, summary_b = (model_summary, reference) if model_is_a else (reference, model_summary)
    try:
        answer, retries = ask(judge_prompt(row["prompt"], summary_a, summary_b))
    except RetryableError as error:
        result.update(status="error", error=str(error), judge_answer=None, retries=args.max_retries)
        return result
    verdict = parse_verdict(answer)
    result.update(judge_answer=answer, retries=retries)
    if verdict is None:
        result["status"] = "unparseable"
    else:
        result.update(status="ok", verdict=verdict, model_score=model_score(verdict, model_is_a))
    return result


def judge_row_gold(index: int, row: dict, args: Args, gold_judge: Callable) -> dict:
    model_is_a = model_goes_first(args.seed, index)
    model_summary = clean_summary(row["completion"], args.strip_suffixes)
    reference = clean_summary(row["reference"], args.strip_suffixes)
    result = {"index": index, "model_is_a": model_is_a, "retries": 0, "judge_answer": None}
    if "id" in row:
        result["id"] = row["id"]
    if model_summary == reference:
        result.update(status="identical", verdict="tie", model_score=0.5)
        return result
    summary_a, summary_b = (model_summary, reference) if model_is_a else (reference, model_summary)
    p_a = float(gold_judge(row["facts"], summary_a, summary_b))
    if not 0.0 <= p_a <= 1.0:
        raise SystemExit(f"gold_judge returned {p_a} for row {index}; expected a value in [0, 1].")
    verdict = "tie" if p_a == 0.5 else ("A" if p_a > 0.5 else "B")
    result.update(status="ok", verdict=verdict, model_score=p_a if model_is_a else 1.0 - p_a)
    return result


def summarize(results: list[dict], args: Args) -> dict:
    scores = [r["model_score"] for r in results if r["model_score"] is not None]
    win_rate, ci_low, ci_high = win_rate_with_ci(scores)
    by_position = {}
    for name, first in (("model_first", True), ("model_second", False)):
        subset = [
            r["model_score"] for r in results if r["model_score"] is not None and r["model_is_a"] == first
        ]
        by_position[name] = {"n": len(subset), "win_rate": sum(subset) / len(subset) if subset else math.nan}
    n_judged = len(scores)
    return {
        "win_rate": win_rate,
        "ci95_low": ci_low,
        "ci95_high": ci_high,
        "n_total": len(results),
        "n_judged": n_judged,
        "n_wins": sum(1 for s in scores if s > 0.5),
        "n_losses": sum(1 for s in scores if s < 0.5),
        "n_ties": sum(1 for s in scores if s == 0.5),
        "tie_rate": sum(1 for s in scores if s == 0.5) / n_judged if n_judged else math.nan,
        "n_identical": sum(1 for r in results if r["status"] == "identical"),
        "n_unparseable": sum(1 for r in results if r["status"] == "unparseable"),
        "n_errors": sum(1 for r in results if r["status"] == "error"),
        "n_retries": sum(r["retries"] for r in results),
        "by_position": by_position,
        "judge": args.judge,
        "judge_model": args.model if args.judge == "openai" else "gold",
        "base_url": args.base_url if args.judge == "openai" else None,
        "seed": args.seed,
        "input_jsonl": args.input_jsonl,
    }


def json_safe(value):
    """NaN (an undefined rate) as null, so the summary is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def write_jsonl_atomically(path: str, rows: list[dict]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".judge_", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def check_args(args: Args) -> None:
    if args.num_threads < 1:
        raise SystemExit(f"--num_threads must be at least 1, got {args.num_threads}.")
    if args.max_retries < 0 or args.initial_backoff < 0 or args.max_backoff < 0 or args.timeout <= 0:
        raise SystemExit("--max_retries, --initial_backoff and --max_backoff must be >= 0 and --timeout > 0.")
    if args.num_examples is not None and args.num_examples < 1:
        raise SystemExit(f"--num_examples must be at least 1, got {args.num_examples}.")


def main(args: Args) -> dict:
    check_args(args)
    if not args.output_jsonl:
        stem = args.input_jsonl[: -len(".jsonl")] if args.input_jsonl.endswith(".jsonl") else args.input_jsonl
        args.output_jsonl = stem + ".judged.jsonl"
    rows = read_rows(args.input_jsonl, args.num_examples, need_facts=args.judge == "gold")
    start = time.time()
    if args.judge == "gold":
        gold_judge = load_gold_judge()
        results = [judge_row_gold(i, row, args, gold_judge) for i, row in enumerate(rows)]
    else:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            print(f"${args.api_key_env} is not set: sending requests without an Authorization header.")

        def ask(content: str) -> tuple[Optional[str], int]:
            return call_with_retries(
                lambda: chat_completion(args, api_key, content),
                args.max_retries,
                args.initial_backoff,
                args.max_backoff,
            )

        results, done = [None] * len(rows), 0
        with ThreadPoolExecutor(max_workers=args.num_threads) as pool:
            futures = {pool.submit(judge_row, i, row, args, ask): i for i, row in enumerate(rows)}
            try:
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    done += 1
                    if done % 100 == 0 or done == len(rows):
                        print(f"judged {done}/{len(rows)} ({time.time() - start:.0f} s)")
            except FatalRequestError as error:
                pool.shutdown(wait=True, cancel_futures=True)
                raise SystemExit(f"Stopping: {error}") from error

    for result, row in zip(results, rows):
        result.update(prompt=row["prompt"], completion=row["completion"], reference=row["reference"])
    summary = summarize(results, args)
    summary["seconds"] = time.time() - start
    summary["args"] = asdict(args)
    write_jsonl_atomically(args.output_jsonl, results)
    summary_path = (
        args.output_jsonl[: -len(".jsonl")] if args.output_jsonl.endswith(".jsonl") else args.output_jsonl
    )
    summary_path += ".summary.json"
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(json_safe(summary), f, indent=2)
    print(
        f"model win rate {100 * summary['win_rate']:.1f}% "
        f"(95% CI {100 * summary['ci95_low']:.1f}-{100 * summary['ci95_high']:.1f}%, "
        f"ties {100 * summary['tie_rate']:.1f}%) over {summary['n_judged']}/{summary['n_total']} rows; "
        f"{summary['n_unparseable']} unparseable, {summary['n_errors']} failed requests"
    )
    print(f"results: {args.output_jsonl}  summary: {summary_path}")
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
