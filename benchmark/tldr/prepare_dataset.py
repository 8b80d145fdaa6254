"""Build the TL;DR datasets used by sft.py, reward.py, ppo.py, rloo.py and dpo.py.

Reads Reddit TL;DR rows in their published column layouts and writes them in the standard formats:

    <output_dir>/sft/          prompt-completion  (reference summaries)        train / validation / test
    <output_dir>/prompts/      prompt-only        (for PPO and RLOO rollouts)  train / validation / test
    <output_dir>/preference/   prompt/chosen/rejected (human comparisons)      train / validation

The processing follows OpenAI's summarize-from-feedback code, as re-implemented in the
"N+ implementation details of RLHF with PPO" study (vwxyzjn/summarize_from_feedback_details):

- query = "SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:";
- a query longer than --max_query_length (512) tokens is shortened by cutting the *post* at its last
  newline, again and again, until it fits (one character at a time once no newline is left); a row
  that does not fit even with an empty post is dropped;
- a summary becomes " " + summary + EOS (one leading space, the tokenizer's EOS text at the end); a
  reference longer than --max_response_length (53) tokens, EOS included, is dropped rather than cut,
  because a cut reference would lose its EOS and teach the model never to stop.

Accepted inputs (a hub id, a `save_to_disk` directory, a folder of {split}.jsonl/.json/.parquet files,
or one such file, which becomes the train split):

- SFT rows `subreddit, title, post, summary` (vwxyzjn/summarize_from_feedback_tldr_3_filtered, or
  OpenAI's tldr_3_filtered jsonl files);
- comparison rows `info{subreddit,title,post}, summaries[{text}], choice` (openai/summarize_from_feedback,
  config "comparisons"); CNN/DM rows (no post) are skipped;
- flat preference rows `subreddit, title, post, chosen, rejected`;
- already formatted rows `prompt, completion` or `prompt, chosen, rejected` (trl-lib/tldr,
  trl-lib/tldr-preference): the prompt is parsed back into its fields and re-truncated.

Example (Pythia tokenizer; every Pythia size shares it):

    python benchmark/tldr/prepare_dataset.py \\
        --tokenizer_name_or_path EleutherAI/pythia-1b-deduped \\
        --sft_dataset_name vwxyzjn/summarize_from_feedback_tldr_3_filtered \\
        --preference_dataset_name openai/summarize_from_feedback --preference_dataset_config comparisons \\
        --output_dir data/tldr
"""

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, Optional

import tyro

QUERY_FORMAT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
# Inverse of QUERY_FORMAT, for inputs that only carry the formatted prompt.
QUERY_PATTERN = re.compile(
    r"SUBREDDIT: r/(?P<subreddit>.*?)\n\nTITLE: (?P<title>.*?)\n\nPOST: (?P<post>.*)\n\nTL;DR:", re.S
)
SPLIT_ALIASES = {"valid": "validation", "val": "validation", "dev": "validation"}
DATA_FILE_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PREFERENCE_LAYOUTS = ("comparisons", "flat_preference", "formatted_preference")


@dataclass
class Args:
    tokenizer_name_or_path: str = "EleutherAI/pythia-1b-deduped"
    """tokenizer that measures the lengths and supplies the EOS text (hub id or local path)"""
    sft_dataset_name: Optional[str] = None
    """source of reference summaries (subreddit/title/post/summary rows); gives sft/ and prompts/"""
    sft_dataset_config: Optional[str] = None
    """configuration name of the SFT source on the hub, if it has several"""
    preference_dataset_name: Optional[str] = None
    """source of human comparisons (openai/summarize_from_feedback layout or flat chosen/rejected); gives preference/"""
    preference_dataset_config: Optional[str] = None
    """configuration name of the preference source on the hub (\"comparisons\" for openai/summarize_from_feedback)"""
    output_dir: str = "data/tldr"
    """where the sft/, prompts/ and preference/ datasets and prepare_summary.json are written"""
    output_format: Literal["disk", "jsonl"] = "disk"
    """`disk`: DatasetDict.save_to_disk per dataset; `jsonl`: one {split}.jsonl file per split"""
    overwrite_output_dir: bool = False
    """replace a non-empty --output_dir (only after the new data is complete)"""
    max_query_length: int = 512
    """most tokens a formatted query may have; longer posts are cut at a newline"""
    max_response_length: int = 53
    """most tokens of a reference summary, EOS included; longer references are dropped"""
    max_preference_response_length: int = 169
    """most tokens of a chosen/rejected summary, EOS included (169 in the N+ details code); longer pairs are dropped"""
    append_eos: bool = True
    """end every summary with the tokenizer's EOS text"""
    keep_columns: tuple[str, ...] = ("id", "facts")
    """input columns copied to the output when present (`id` is also read from comparison rows' `info`)"""
    max_rows_per_split: Optional[int] = None
    """use only the first N rows of each split (quick trials)"""
    num_proc: Optional[int] = None
    """processes for datasets.map"""


# ----------------------------------------------------------------------------------------------------------
# Pure text functions (unit-tested)
# ----------------------------------------------------------------------------------------------------------


def format_query(subreddit: str, title: str, post: str) -> str:
    """The TL;DR query of summarize-from-feedback."""
    return QUERY_FORMAT.format(subreddit=subreddit, title=title, post=post)


def parse_query(prompt: str) -> Optional[dict]:
    """Fields of a prompt written with QUERY_FORMAT, or None if it does not have that shape."""
    match = QUERY_PATTERN.fullmatch(prompt)
    return match.groupdict() if match else None


def truncate_post(
    subreddit: str, title: str, post: str, count_tokens: Callable[[str], int], max_query_length: int
) -> Optional[str]:
    """Shorten `post` from the end until the formatted query has at most `max_query_length` tokens.

    As in summarize-from-feedback: while the query is too long, drop everything from the post's last
    newline on; once no newline is left, drop one character at a time. Returns None when even an empty
    post is too long. In the newline-free phase we drop `excess` characters at once (excess = tokens over
    the limit) instead of one: when removing a character removes at most one token, as it does in every
    case the tests try, no shorter cut could have fit and the result equals the one-character loop;
    otherwise it may cut a few characters more than that loop would.
    """
    n_tokens = count_tokens(format_query(subreddit, title, post))
    while n_tokens > max_query_length:
        if not post:
            return None
        cut = post.rfind("\n")
        post = post[:cut] if cut >= 0 else post[: -(n_tokens - max_query_length)]
        n_tokens = count_tokens(format_query(subreddit, title, post))
    return post


def format_completion(summary: str, eos_text: str) -> str:
    """A summary as the model must write it: one leading space (the query ends in "TL;DR:"), then EOS."""
    return " " + summary.strip() + eos_text


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


def _split_name(name: str) -> str:
    return SPLIT_ALIASES.get(name, name)


def load_source(name: str, config: Optional[str]):
    """A DatasetDict from a hub id, a save_to_disk directory, a folder of split files, or one file."""
    import datasets

    if os.path.isfile(name):
        ext = os.path.splitext(name)[1]
        if ext not in DATA_FILE_EXTENSIONS:
            raise SystemExit(f"Dataset file {name!r} must end in one of {sorted(DATA_FILE_EXTENSIONS)}.")
        data = datasets.load_dataset(DATA_FILE_EXTENSIONS[ext], data_files={"train": name})
    elif os.path.isdir(name):
        try:
            data = datasets.load_from_disk(name)
        except FileNotFoundError:
            files = {}
            for entry in sorted(os.listdir(name)):
                stem, ext = os.path.splitext(entry)
                if ext in DATA_FILE_EXTENSIONS:
                    files.setdefault(DATA_FILE_EXTENSIONS[ext], {})[_split_name(stem)] = os.path.join(
                        name, entry
                    )
            if len(files) != 1:
                raise SystemExit(
                    f"Directory {name!r} is neither a save_to_disk dataset nor a folder of {{split}}.jsonl, "
                    f"{{split}}.json or {{split}}.parquet files (of one kind)."
                ) from None
            ((builder, data_files),) = files.items()
            data = datasets.load_dataset(builder, data_files=data_files)
        if isinstance(data, datasets.Dataset):
            data = datasets.DatasetDict({"train": data})
    else:
        try:
            data = datasets.load_dataset(name, config)
        except Exception as error:  # the hub raises many different types when it cannot be reached
            raise SystemExit(
                f"Could not load dataset {name!r} from the hub ({type(error).__name__}: {error}); offline, pass a "
                "local path instead: a save_to_disk directory, a folder of {split}.jsonl files, or one .jsonl file."
            ) from error
    return datasets.DatasetDict({_split_name(split): ds for split, ds in data.items()})


def detect_layout(columns: list[str]) -> str:
    """Which of the accepted column layouts a split has."""
    have = set(columns)
    if {"info", "summaries", "choice"} <= have:
        return "comparisons"
    if {"subreddit", "title", "post", "chosen", "rejected"} <= have:
        return "flat_preference"
    if {"subreddit", "title", "post", "summary"} <= have:
        return "sft"
    if {"prompt", "chosen", "rejected"} <= have:
        return "formatted_preference"
    if {"prompt", "completion"} <= have:
        return "formatted_sft"
    raise SystemExit(
        "Unrecognised TL;DR columns: expected subreddit/title/post/summary, info/summaries/choice, "
        f"subreddit/title/post/chosen/rejected, prompt/completion or prompt/chosen/rejected; found {sorted(have)}."
    )


# ----------------------------------------------------------------------------------------------------------
# Row processing
# ----------------------------------------------------------------------------------------------------------


def _fields_of(row: dict, layout: str) -> Optional[dict]:
    """subreddit/title/post of a row, or None when the row is not a Reddit post (CNN/DM, unparseable)."""
    if layout == "comparisons":
        source = row["info"]
    elif layout in ("formatted_sft", "formatted_preference"):
        source = parse_query(row["prompt"])
        if source is None:
            return None
    else:
        source = row
    if not source.get("post"):
        return None
    return {
        "subreddit": source.get("subreddit") or "",
        "title": source.get("title") or "",
        "post": source["post"],
    }


def _summaries_of(row: dict, layout: str) -> dict:
    if layout == "comparisons":
        choice = int(row["choice"])
        return {"chosen": row["summaries"][choice]["text"], "rejected": row["summaries"][1 - choice]["text"]}
    if layout == "sft":
        return {"completion": row["summary"]}
    if layout == "formatted_sft":
        return {"completion": row["completion"]}
    return {"chosen": row["chosen"], "rejected": row["rejected"]}


def process_row(row: dict, *, layout: str, kind: str, args: Args, count_tokens, eos_text: str) -> dict:
    """One output row plus `_status` (ok / not_tldr / query_too_long / response_too_long) and `_truncated`."""
    response_keys = {"sft": ["completion"], "prompts": [], "preference": ["chosen", "rejected"]}[kind]
    out = {"prompt": "", **{key: "" for key in response_keys}, "_status": "ok", "_truncated": False}
    for column in args.keep_columns:
        if column in row:
            out[column] = row[column]
        elif column == "id" and layout == "comparisons":
            out[column] = row["info"].get("id")
    fields = _fields_of(row, layout)
    if fields is None:
        out["_status"] = "not_tldr"
        return out
    post = truncate_post(
        fields["subreddit"], fields["title"], fields["post"], count_tokens, args.max_query_length
    )
    if post is None:
        out["_status"] = "query_too_long"
        return out
    out["_truncated"] = post != fields["post"]
    out["prompt"] = format_query(fields["subreddit"], fields["title"], post)
    limit = args.max_response_length if kind == "sft" else args.max_preference_response_length
    summaries = _summaries_of(row, layout)
    for key in response_keys:
        text = format_completion(summaries[key], eos_text)
        if count_tokens(text) > limit:
            out["_status"] = "response_too_long"
        out[key] = text
    return out


def build(source, kind: str, args: Args, count_tokens, eos_text: str):
    """Process every split of `source` into dataset `kind` (sft / prompts / preference); returns (data, stats)."""
    import datasets

    result, stats = {}, {}
    for split, ds in source.items():
        if args.max_rows_per_split is not None:
            ds = ds.select(range(min(args.max_rows_per_split, len(ds))))
        layout = detect_layout(ds.column_names)
        if (layout in PREFERENCE_LAYOUTS) != (kind == "preference"):
            raise SystemExit(
                f"Split {split!r} has the {layout} layout, which cannot make the {kind} dataset."
            )
        processed = ds.map(
            process_row,
            fn_kwargs=dict(layout=layout, kind=kind, args=args, count_tokens=count_tokens, eos_text=eos_text),
            remove_columns=ds.column_names,
            num_proc=args.num_proc,
            desc=f"{kind}/{split}",
        )
        statuses = Counter(processed["_status"])
        kept = processed.filter(
            lambda status: status == "ok", input_columns="_status", num_proc=args.num_proc
        )
        stats[split] = {
            "layout": layout,
            "rows_in": len(ds),
            "rows_out": len(kept),
            "posts_truncated_at_newline_or_char": int(sum(kept["_truncated"])),
            "dropped": {status: count for status, count in sorted(statuses.items()) if status != "ok"},
        }
        result[split] = kept.remove_columns(["_status", "_truncated"])
    return datasets.DatasetDict(result), stats


# ----------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------


def write(data, path: str, output_format: str) -> None:
    if output_format == "disk":
        data.save_to_disk(path)
        return
    os.makedirs(path)
    for split, ds in data.items():
        with open(os.path.join(path, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for row in ds:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def check_args(args: Args) -> None:
    if args.sft_dataset_name is None and args.preference_dataset_name is None:
        raise SystemExit("Nothing to do: pass --sft_dataset_name and/or --preference_dataset_name.")
    for name in ("max_query_length", "max_response_length", "max_preference_response_length"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if os.path.isdir(args.output_dir) and os.listdir(args.output_dir) and not args.overwrite_output_dir:
        raise SystemExit(
            f"--output_dir {args.output_dir!r} is not empty; choose another one or pass --overwrite_output_dir."
        )
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise SystemExit(f"--output_dir {args.output_dir!r} exists and is not a directory.")


def main(args: Args) -> dict:
    check_args(args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path)
    if args.append_eos and tokenizer.eos_token is None:
        raise SystemExit(f"Tokenizer {args.tokenizer_name_or_path!r} has no EOS token; pass --no_append_eos.")
    eos_text = tokenizer.eos_token if args.append_eos else ""

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    outputs, stats = {}, {}
    if args.sft_dataset_name is not None:
        source = load_source(args.sft_dataset_name, args.sft_dataset_config)
        outputs["sft"], stats["sft"] = build(source, "sft", args, count_tokens, eos_text)
        outputs["prompts"], stats["prompts"] = build(source, "prompts", args, count_tokens, eos_text)
    if args.preference_dataset_name is not None:
        source = load_source(args.preference_dataset_name, args.preference_dataset_config)
        outputs["preference"], stats["preference"] = build(source, "preference", args, count_tokens, eos_text)

    # Everything is written to a fresh directory beside --output_dir and swapped in at the end, so a
    # failed run leaves an existing --output_dir untouched.
    parent = os.path.dirname(os.path.abspath(args.output_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".prepare_tldr_", dir=parent)
    try:
        for kind, data in outputs.items():
            write(data, os.path.join(staging, kind), args.output_format)
        summary = {"args": asdict(args), "eos_text": eos_text, "stats": stats}
        with open(os.path.join(staging, "prepare_summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        if os.path.isdir(args.output_dir):
            shutil.rmtree(args.output_dir)
        os.replace(staging, args.output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for kind, per_split in stats.items():
        for split, s in per_split.items():
            print(
                f"{kind}/{split}: {s['rows_out']}/{s['rows_in']} rows kept ({s['layout']} layout), "
                f"{s['posts_truncated_at_newline_or_char']} posts shortened, dropped {s['dropped']}"
            )
    print(f"wrote {sorted(outputs)} to {args.output_dir}")
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True))
