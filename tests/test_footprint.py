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


def test_footprint_follows_module_level_imports_through_utils(tmp_path):
    """The core follows module-level imports through utils/ (an `if __name__` block counts); what a script or
    its core imports only inside a function, or by utils.run.optional_module, is optional, with its own imports."""
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text('"""doc"""\n')
    (tmp_path / "utils" / "b.py").write_text("from utils import e\ndef f():\n    from utils import c\n")
    (tmp_path / "utils" / "c.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "utils" / "d.py").write_text("unused = 1\n")
    (tmp_path / "utils" / "e.py").write_text("e = 1\n")
    (tmp_path / "utils" / "f.py").write_text("import utils.g\n")
    (tmp_path / "utils" / "g.py").write_text("g = 1\n")
    (tmp_path / "utils" / "h.py").write_text("h = 1\n")
    (tmp_path / "s.py").write_text(
        "import torch\nimport utils.b\nif __name__ == '__main__':\n    import utils.h\n"
        "def main(args):\n    if args.flag:\n        utils.run.optional_module('utils.f', '--flag')\n"
    )
    assert readability.footprint(tmp_path, tmp_path / "s.py") == {
        "utils/__init__.py": 1,
        "utils/b.py": 3,
        "utils/e.py": 1,
        "utils/h.py": 1,
    }
    assert readability.optional(tmp_path, tmp_path / "s.py") == {
        "utils/c.py": 2,
        "utils/f.py": 1,
        "utils/g.py": 1,
    }


def test_vllm_is_optional_for_the_scripts_that_sample_with_it():
    """rloo.py, ppo.py and grpo.py import utils/vllm.py only with --use_vllm; no core module imports it."""
    for script in ("rloo", "ppo", "grpo"):
        assert "utils/vllm.py" not in readability.footprint(ROOT, ROOT / f"{script}.py"), script
        assert "utils/vllm.py" in readability.optional(ROOT, ROOT / f"{script}.py"), script
