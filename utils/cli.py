"""The command line, for a researcher arriving with TRL's flags: TRL's harmless flags dropped with a note and the
meaningless ones refused in one sentence, an unknown flag or a value it cannot take named in one sentence, and a
--help grouped as the Args source is.

Optional: utils/run.py's parse_args uses it when it is there; a copy without it parses with tyro alone (booleans
written TRL's way, `--bf16 True`, are read either way)."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing

from utils.run import UsageError, normalize_bool_flags


def known_flags(args_class) -> set[str]:
    """Every flag name the script takes, without dashes: fields, `no_` forms, aliases."""
    hints = typing.get_type_hints(args_class, include_extras=True)
    names = {"help"}
    for field in dataclasses.fields(args_class):
        names |= {field.name, f"no_{field.name}"}
        for meta in getattr(hints.get(field.name), "__metadata__", ()):
            names |= {alias.lstrip("-").replace("-", "_") for alias in getattr(meta, "aliases", None) or ()}
    return names


def check_flags(args_class, argv: list[str]) -> None:
    """Refuse an unknown flag, naming the closest one (or why a TRL flag means nothing here)."""
    import difflib

    known = known_flags(args_class)
    for token in argv:
        name = _flag_name(token)
        if name and name not in known and name in TRL_REFUSED:
            raise UsageError(f"--{name} (a TRL flag) means nothing here: {TRL_REFUSED[name]}.")
        if name and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean --{close[0]}?" if close else "see --help for the flags it takes."
            raise UsageError(f"unknown flag --{name}; {hint}")


RUNTIME_GROUP = "Filled in at runtime"  # the Args group of derived sizes: shown in --help, not flags


def source_fields(args_class) -> list[tuple[str, str, str]]:
    """[(group, field name, docstring)] in source order, a group being the `# Title` comment above its fields."""
    import ast
    import inspect
    import textwrap

    try:
        lines = textwrap.dedent(inspect.getsource(args_class)).splitlines()
    except (OSError, TypeError):  # no source (a frozen or generated class): one group, no docs
        return [("options", f.name, "") for f in dataclasses.fields(args_class)]
    body = ast.parse("\n".join(lines)).body[0].body
    fields, group, previous_end = [], "options", 0
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            for line in lines[previous_end : node.lineno - 1]:
                if line.strip().startswith("# ") and line.startswith("    #"):
                    group = line.strip()[2:]
            is_doc = isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant)
            doc = after.value.value if is_doc and isinstance(after.value.value, str) else ""
            fields.append((group, node.target.id, " ".join(doc.split())))
        previous_end = node.end_lineno
    return fields


def flag_groups(args_class) -> list[tuple[str, list[str]]]:
    """[(group, field names)] in source order (see source_fields)."""
    groups: dict[str, list[str]] = {}
    for group, name, _ in source_fields(args_class):
        groups.setdefault(group, []).append(name)
    return list(groups.items())


def runtime_fields(args_class) -> set[str]:
    """The fields computed after parsing (the "Filled in at runtime" group), unless it says a given value is
    checked ("must match")."""
    return {
        name
        for title, names in flag_groups(args_class)
        if title.startswith(RUNTIME_GROUP) and "must match" not in title
        for name in names
    }


def _metavar(hint) -> str:
    """How a flag's value is written in --help: STR, INT, FLOAT, {a,b}, [true|false], X [X ...]."""
    origin, members = typing.get_origin(hint), [a for a in typing.get_args(hint) if a is not type(None)]
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(hint)) + "}"
    if origin in (typing.Union, types.UnionType) and len(members) == 1:
        return _metavar(members[0])
    if origin in (list, tuple):
        return f"{_metavar(members[0])} [{_metavar(members[0])} ...]" if members else "VALUE [VALUE ...]"
    if hint is bool:
        return "[true|false]"
    return {str: "STR", int: "INT", float: "FLOAT"}.get(hint, "VALUE")


def format_help(args_class, script: str) -> str:
    """--help: the docstring's first paragraph, then each group of the Args source with every flag's value,
    one-line doc and default; the runtime group listed as computed values, not flags."""
    import inspect
    import textwrap

    hints, extras = typing.get_type_hints(args_class), typing.get_type_hints(args_class, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(args_class)}
    module = sys.modules.get(args_class.__module__)
    about = (inspect.getdoc(module) or "").split("\n\n")[0].replace("\n", " ")
    out = [f"usage: {script} [--flag VALUE ...]", "", *textwrap.wrap(about, 100), "",
           "  -h, --help  show this message and exit"]  # fmt: skip
    docs = {name: doc for _, name, doc in source_fields(args_class)}
    for title, names in flag_groups(args_class):
        runtime = title.startswith(RUNTIME_GROUP) and "must match" not in title
        out += ["", f"{title}{' (computed from the flags above; not flags)' if runtime else ''}:"]
        for name in names:
            field, doc = fields[name], docs[name]
            if runtime:
                out += [
                    f"  {name}",
                    *textwrap.wrap(doc, 96, initial_indent="      ", subsequent_indent="      "),
                ]
                continue
            default = field.default if field.default is not dataclasses.MISSING else None
            if field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            metadata = getattr(extras[name], "__metadata__", ())
            aliases = [a for meta in metadata for a in (getattr(meta, "aliases", None) or ())]
            out.append(f"  {', '.join([f'--{name}', *aliases])} {_metavar(hints[name])}")
            lines = textwrap.wrap(doc, 96, initial_indent="      ", subsequent_indent="      ") or ["     "]
            tail = f" (default: {default})"
            lines[-1:] = [lines[-1] + tail] if len(lines[-1] + tail) <= 100 else [lines[-1], "     " + tail]
            out += lines
    return "\n".join(out) + "\n"


def _value_problem(name: str, hint, values: list[str]) -> str | None:
    """The sentence for values `hint` cannot take (tyro would print a box), else None."""
    origin, members = typing.get_origin(hint), [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if optional and values == ["None"]:
        return None
    if origin is not typing.Literal and origin not in (list, tuple) and len(members) == 1:
        hint, origin = members[0], typing.get_origin(members[0])
    if origin in (list, tuple):
        kind = [a for a in typing.get_args(hint) if a is not Ellipsis]
        if not values:
            return f"--{name} needs at least one value."
        problems = [_value_problem(name, kind[0], [v]) for v in values] if kind else []
        return next((p for p in problems if p), None)
    if len(values) != 1:
        return (
            f"--{name} takes one value, got {' '.join(values)!r}." if values else f"--{name} needs a value."
        )
    value = values[0]
    if origin is typing.Literal:
        choices = [str(a) for a in typing.get_args(hint)]
        if value not in choices:
            import difflib

            close = difflib.get_close_matches(value, choices, n=1)
            hint_text = f" (did you mean {close[0]}?)" if close else ""
            return f"--{name} must be one of {', '.join(choices)}; got {value!r}{hint_text}."
        return None
    for kind, word in ((int, "an integer"), (float, "a number")):
        if hint is kind:
            try:
                kind(value)
            except ValueError:
                return f"--{name} takes {word}, got {value!r}."
    return None


def flag_values(argv: list[str], i: int) -> tuple[list[str], int]:
    """The values of the flag at argv[i] (`--flag=v` or the tokens up to the next `--`) and the index after them."""
    end = i + 1
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return ([argv[i].partition("=")[2]] if "=" in argv[i] else argv[i + 1 : end]), end


def check_values(args_class, argv: list[str]) -> None:
    """A UsageError in one sentence for a value the flag cannot take, or a computed size given as a flag."""
    hints, runtime = typing.get_type_hints(args_class), runtime_fields(args_class)
    i = 0
    while i < len(argv):
        name = _flag_name(argv[i])
        values, end = flag_values(argv, i)
        if name in runtime:
            raise UsageError(f"--{name} is computed from the other flags at runtime, not set; see --help.")
        if name in hints and hints[name] is not bool:
            problem = _value_problem(name, hints[name], values)
            if problem:
                raise UsageError(problem)
        i = end


# TRL flags that mean nothing here: harmless ones dropped with a note, the others refused.
TRL_HARMLESS = {
    "remove_unused_columns": "a script reads only the columns of its data format and ignores the others anyway",
    "report_to": "metrics always go to TensorBoard (--logging_dir), and to W&B with --track",
    "bf16_full_eval": "evaluation runs in the training precision",
    "logging_first_step": "metrics are logged on the script's own schedule",
    "logging_strategy": "metrics are logged on the script's own schedule",
    "log_level": "the scripts print one line per event and a progress bar",
    "save_strategy": "checkpoints are written every --save_steps steps (0: only on SIGTERM), and at the end",
    "save_only_model": "a checkpoint holds what an exact resume needs",
    "dataset_num_proc": "data is prepared in one process",
    "dataloader_num_workers": "batches are built in the training process",
    "dataset_streaming": "the dataset is read whole",
    "use_liger_kernel": "the plain PyTorch forward is used",
    "gradient_checkpointing_kwargs": "--gradient_checkpointing always uses non-reentrant checkpointing",
    "ddp_find_unused_parameters": "every parameter gets a gradient",
    "log_completions": "tables of sample completions are printed --num_sample_generations times",
    "num_completions_to_print": "tables of sample completions show a few rows",
}
TRL_REFUSED = {
    "use_peft": "LoRA is in sft.py, dpo.py, reward.py, ppo.py, rloo.py, grpo.py and online_dpo.py",
    "lora_r": "LoRA is in sft.py, dpo.py, reward.py, ppo.py, rloo.py, grpo.py and online_dpo.py",
    "lora_alpha": "LoRA is in sft.py, dpo.py, reward.py, ppo.py, rloo.py, grpo.py and online_dpo.py",
    "lora_dropout": "LoRA is in sft.py, dpo.py, reward.py, ppo.py, rloo.py, grpo.py and online_dpo.py",
    "lora_task_type": "the task type follows the script: CAUSAL_LM for a policy, SEQ_CLS in reward.py",
    "lora_target_modules": "LoRA is in sft.py, dpo.py, reward.py, ppo.py, rloo.py, grpo.py and online_dpo.py",
    "load_in_4bit": "quantized training is not supported",
    "load_in_8bit": "quantized training is not supported",
    "fp16": "fp16 is not supported; use --bf16",
    "deepspeed": "give DeepSpeed to accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml (or zero3)",
    "optim": "the optimizer is AdamW, written in the script",
    "logging_steps": "rloo.py and ppo.py log every update (a rollout and its optimizer steps), ddpo.py every epoch",
    "torch_dtype": "weights are trained in float32 (DeepSpeed's bf16 or --bf16 autocast give bf16 compute)",
    "dtype": "weights are trained in float32 (DeepSpeed's bf16 or --bf16 autocast give bf16 compute)",
    "attn_implementation": "it picks a transformers model's attention; ddpo.py's UNet uses diffusers' own",
}


def _flag_name(token: str) -> str:
    return token[2:].partition("=")[0].replace("-", "_") if token.startswith("--") else ""


def translate_trl_flags(args_class, argv: list[str], notes: list[str] | None = None) -> list[str]:
    """argv without TRL's harmless flags and values (a note each); `--warmup_steps` < 1 -> --warmup_ratio."""
    known, out, i = known_flags(args_class), [], 0
    while i < len(argv):
        token, name = argv[i], _flag_name(argv[i])
        base = name[3:] if name.startswith("no_") and name[3:] in TRL_HARMLESS else name
        values, end = flag_values(argv, i)
        if name and name not in known and base in TRL_HARMLESS:
            if notes is not None:
                notes.append(f"--{name} (a TRL flag) is ignored: {TRL_HARMLESS[base]}.")
            i = end
            continue
        if name == "warmup_steps" and name not in known and "warmup_ratio" in known:
            value = " ".join(values)
            try:
                fraction = float(value)
            except ValueError:
                fraction = -1.0
            if not 0 <= fraction < 1:
                raise UsageError(
                    f"--warmup_steps {value}: give the warmup as a fraction of training, --warmup_ratio "
                    "(or --warmup_steps below 1, which is read as that fraction)."
                )
            out += ["--warmup_ratio", repr(fraction)]
            i = end
            continue
        out.append(token)
        i += 1
    return out


def parse_args(args_class, argv: list[str]):
    """The Args dataclass from `argv` (tyro), TRL's flags translated or refused, --help grouped."""
    import tyro

    notes: list[str] = []
    argv = translate_trl_flags(args_class, argv, notes)
    if int(os.environ.get("RANK", "0")) == 0:
        script = os.path.basename(sys.argv[0]) or "script"
        for note in notes:
            print(f"{script}: note: {note}", file=sys.stderr)
    check_flags(args_class, argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(args_class, os.path.basename(sys.argv[0]) or "script"), end="")
        raise SystemExit(0)
    check_values(args_class, argv)
    return tyro.cli(args_class, args=normalize_bool_flags(args_class, argv), use_underscores=True)
