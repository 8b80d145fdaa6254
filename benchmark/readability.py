"""Readability figures of the scripts: what a copy carries, how much prose, what breaks the line limit.

For each script: the utils modules a copy needs (its imports, followed through utils/ transitively) and their
lines; words of comment and docstring per line of code; lines over the project's 110-character limit;
`# fmt: skip` markers; and the size of the diff between sibling scripts (`diff a b`, changed lines).

    python benchmark/readability.py              # a table of the current tree
    python benchmark/readability.py --root DIR   # the same for another checkout
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


def utils_imports(path: Path) -> set[str]:
    """The utils modules a file imports, by module name ('utils' is the package's __init__)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name == "utils" or name.startswith("utils."):
                found.add("utils")  # importing utils.x runs utils/__init__.py first
                parts = name.split(".")
                if len(parts) >= 2:
                    found.add(".".join(parts[:2]))
    return found


def module_path(root: Path, module: str) -> Path | None:
    """utils -> utils/__init__.py, utils.x -> utils/x.py (None when it is a name, not a module)."""
    path = root / "utils" / "__init__.py" if module == "utils" else root / (module.replace(".", "/") + ".py")
    return path if path.exists() else None


def footprint(root: Path, script: Path) -> dict[str, int]:
    """{utils module file: lines} of every utils module `script` needs, transitively."""
    todo, seen = list(utils_imports(script)), {}
    while todo:
        path = module_path(root, todo.pop())
        if path is None or str(path) in seen:
            continue
        seen[str(path)] = len(path.read_text().splitlines())
        todo.extend(utils_imports(path))
    return {str(Path(p).relative_to(root)): n for p, n in sorted(seen.items())}


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
    """{script: {lines, utils_lines, utils_modules, words_per_code_line, long_lines, fmt_skip}}."""
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
            "words_per_code_line": round(words / max(code, 1), 2),
            "long_lines": sum(len(line) > LINE_LIMIT for line in text.splitlines()),
            "fmt_skip": text.count("# fmt: skip"),
        }
    return out


def diff_size(root: Path, a: str, b: str) -> int:
    """Changed lines in `diff a.py b.py` (lines starting with < or >)."""
    result = subprocess.run(["diff", f"{a}.py", f"{b}.py"], cwd=root, capture_output=True, text=True)
    return sum(line[:1] in "<>" for line in result.stdout.splitlines() if line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="a checkout")
    root = Path(parser.parse_args().root)
    rows = figures(root)
    print(f"{'script':<11} {'lines':>5} {'utils lines':>11} {'words/line':>10} {'>110':>5} {'fmt:skip':>8}")
    for name, row in rows.items():
        print(
            f"{name:<11} {row['lines']:>5} {row['utils_lines']:>11} {row['words_per_code_line']:>10} "
            f"{row['long_lines']:>5} {row['fmt_skip']:>8}"
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
