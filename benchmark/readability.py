"""Readability figures of the scripts: what a copy carries, how much prose, what breaks the line limit.

For each script: the utils modules a copy needs, its core (its module-level imports, followed through the
module-level imports of utils/ transitively), and their lines; its optional modules, imported only inside
functions, behind a flag (a copy without them runs, and the flag says which file to copy); words of comment and
docstring per line of code; lines over the project's 110-character limit; `# fmt: skip` markers; and the size of
the diff between sibling scripts (`diff a b`, changed lines).

    python benchmark/readability.py              # a table of the current tree
    python benchmark/readability.py --root DIR   # the same for another checkout
    python benchmark/readability.py --readme     # write the copy-footprint table into README.md
"""

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

SCRIPTS = ("sft", "reward", "dpo", "ppo", "rloo", "grpo", "online_dpo", "ilql", "ddpo")
LINE_LIMIT = 110
SIBLINGS = (("rloo", "grpo"), ("rloo", "ppo"), ("grpo", "online_dpo"))


def _utils_modules(name: str) -> set[str]:
    """'utils.x.y' -> {'utils', 'utils.x'}: importing utils.x runs utils/__init__.py first."""
    parts = name.split(".")
    return {"utils", ".".join(parts[:2])} if len(parts) >= 2 else {"utils"}


def utils_imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level, in-function) utils modules a file imports, by module name ('utils' is the package's
    __init__). Module level is anything not inside a function (an `if __name__ == "__main__":` block counts);
    in a function: an import statement there, or a call `optional_module("utils.x", ...)` or
    `extra_module("utils.x")` (utils/run.py's)."""
    top, inside = set(), set()

    def visit(node: ast.AST, in_function: bool) -> None:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("optional_module", "extra_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
            in_function = True  # imported when the call runs, which a flag decides
        for name in names:
            if name == "utils" or name.startswith("utils."):
                (inside if in_function else top).update(_utils_modules(name))
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(ast.parse(path.read_text()), False)
    return top, inside


def module_path(root: Path, module: str) -> Path | None:
    """utils -> utils/__init__.py, utils.x -> utils/x.py (None when it is a name, not a module)."""
    path = root / "utils" / "__init__.py" if module == "utils" else root / (module.replace(".", "/") + ".py")
    return path if path.exists() else None


def _closure(root: Path, modules: set[str]) -> dict[str, int]:
    """{utils module file: lines} of `modules` and what they import at module level, transitively."""
    todo, seen = list(modules), {}
    while todo:
        path = module_path(root, todo.pop())
        if path is None or str(path) in seen:
            continue
        seen[str(path)] = len(path.read_text().splitlines())
        todo.extend(utils_imports(path)[0])
    return {str(Path(p).relative_to(root)): n for p, n in sorted(seen.items())}


def footprint(root: Path, script: Path) -> dict[str, int]:
    """The core a copy of `script` needs: {utils module file: lines} of the utils modules it imports at module
    level, and theirs, transitively. A module imported only inside a function is optional (`optional`)."""
    return _closure(root, utils_imports(script)[0])


def optional(root: Path, script: Path) -> dict[str, int]:
    """The optional modules of `script`: {utils module file: lines} of the utils modules that it or its core
    imports only inside functions (behind a flag), with what they import at module level, less the core."""
    core = footprint(root, script)
    inside = set(utils_imports(script)[1])
    for module in core:
        inside |= utils_imports(root / module)[1]
    # an optional module's own in-function imports are optional too
    found, todo = {}, list(inside)
    while todo:
        module = todo.pop()
        for path, lines in _closure(root, {module}).items():
            if path not in found:
                found[path] = lines
                todo.extend(utils_imports(root / path)[1])
    return {path: lines for path, lines in sorted(found.items()) if path not in core}


def prose_and_code(path: Path) -> tuple[int, int]:
    """(words of comments and docstrings, lines of code) of a Python file.

    A docstring is a string that stands alone as a statement (module, class, function or dataclass field)."""
    source = path.read_text()
    doc_lines = set()
    words = 0
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            words += len(node.value.value.split())
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    code_lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            words += len(token.string.lstrip("#").split())
        elif token.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            for line in range(token.start[0], token.end[0] + 1):
                if line not in doc_lines:
                    code_lines.add(line)
    return words, len(code_lines)


def figures(root: Path) -> dict[str, dict]:
    """{script: {lines, utils_lines, utils_modules, optional_modules, words_per_code_line, long_lines,
    fmt_skip}}: utils_* is the core a copy needs; optional_modules, {file: lines} of those behind a flag."""
    out = {}
    for name in SCRIPTS:
        path = root / f"{name}.py"
        text = path.read_text()
        words, code = prose_and_code(path)
        modules = footprint(root, path)
        out[name] = {
            "lines": len(text.splitlines()),
            "utils_lines": sum(modules.values()),
            "utils_modules": modules,
            "optional_modules": optional(root, path),
            "words_per_code_line": round(words / max(code, 1), 2),
            "long_lines": sum(len(line) > LINE_LIMIT for line in text.splitlines()),
            "fmt_skip": text.count("# fmt: skip"),
        }
    return out


def diff_size(root: Path, a: str, b: str) -> int:
    """Changed lines in `diff a.py b.py` (lines starting with < or >)."""
    result = subprocess.run(["diff", f"{a}.py", f"{b}.py"], cwd=root, capture_output=True, text=True)
    return sum(line[:1] in "<>" for line in result.stdout.splitlines() if line)


README_START = "<!-- footprint: generated by `python benchmark/readability.py --readme`; tests/test_footprint.py checks it -->"
README_END = "<!-- /footprint -->"


def footprint_table(root: Path) -> str:
    """The README's table: each script, its lines, the utils modules (and their lines) a copy needs, and the
    optional ones (imported only behind a flag; a copy without them runs, and that flag says which to copy)."""
    rows = [
        "| script | lines | utils lines a copy needs | utils modules | optional modules |",
        "|---|---|---|---|---|",
    ]
    for name, row in figures(root).items():
        modules = ", ".join(Path(m).stem for m in row["utils_modules"] if not m.endswith("__init__.py"))
        extra = ", ".join(f"{Path(m).stem} ({n})" for m, n in row["optional_modules"].items()) or "-"
        rows.append(f"| `{name}.py` | {row['lines']} | {row['utils_lines']} | {modules} | {extra} |")
    return "\n".join(rows)


def write_readme_table(root: Path) -> None:
    """Replace the table between the README's footprint markers with the current one."""
    readme = root / "README.md"
    text = readme.read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    readme.write_text(text[:start] + "\n" + footprint_table(root) + "\n" + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="a checkout")
    parser.add_argument("--readme", action="store_true", help="write the copy-footprint table into README.md")
    parsed = parser.parse_args()
    root = Path(parsed.root)
    if parsed.readme:
        write_readme_table(root)
    rows = figures(root)
    print(
        f"{'script':<11} {'lines':>5} {'utils lines':>11} {'words/line':>10} {'>110':>5} {'fmt:skip':>8}  "
        "optional modules"
    )
    for name, row in rows.items():
        extra = ", ".join(f"{Path(m).stem} ({n})" for m, n in row["optional_modules"].items()) or "-"
        print(
            f"{name:<11} {row['lines']:>5} {row['utils_lines']:>11} {row['words_per_code_line']:>10} "
            f"{row['long_lines']:>5} {row['fmt_skip']:>8}  {extra}"
        )
    utils_words, utils_code = map(
        sum, zip(*(prose_and_code(p) for p in sorted((root / "utils").glob("*.py"))))
    )
    print(f"utils/ words of prose per line of code: {utils_words / max(utils_code, 1):.2f}")
    print(f"README.md lines: {len((root / 'README.md').read_text().splitlines())}")
    for a, b in SIBLINGS:
        print(f"diff {a}.py {b}.py: {diff_size(root, a, b)} changed lines")


if __name__ == "__main__":
    main()
