"""The copy footprint: what a copy of each script carries from utils/, printed, and stated in the README."""

import readability

from conftest import ROOT


def test_readme_states_each_scripts_copy_footprint():
    """The README's table equals what benchmark/readability.py computes from the imports (regenerate it with
    `python benchmark/readability.py --readme`); the figures are printed for the log."""
    table = readability.footprint_table(ROOT)
    print("\n" + table)
    readme = (ROOT / "README.md").read_text()
    stated = readme[
        readme.index(readability.README_START) + len(readability.README_START) : readme.index(
            readability.README_END
        )
    ]
    assert stated.strip() == table, (
        "README's footprint table is stale: run python benchmark/readability.py --readme"
    )


def test_footprint_follows_imports_through_utils(tmp_path):
    """A script importing utils.b, whose module imports utils.c inside a function, needs __init__, b and c."""
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text('"""doc"""\n')
    (tmp_path / "utils" / "b.py").write_text("def f():\n    from utils import c\n")
    (tmp_path / "utils" / "c.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "utils" / "d.py").write_text("unused = 1\n")
    (tmp_path / "s.py").write_text("import torch\nimport utils.b\n")
    assert readability.footprint(tmp_path, tmp_path / "s.py") == {
        "utils/__init__.py": 1,
        "utils/b.py": 2,
        "utils/c.py": 2,
    }
