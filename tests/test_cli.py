"""Every top-level script answers --help (so one that stops importing is caught) and imports without running."""

import importlib
from pathlib import Path

import pytest

from conftest import ROOT, run_script

SCRIPTS = sorted(p.name for p in ROOT.glob("*.py")) + ["benchmark/tiny/tiny_world.py"]


def test_there_are_scripts():
    assert "benchmark/tiny/tiny_world.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    out = run_script([script, "--help"], timeout=120).stdout
    assert "--help" in out and "--output_dir" in out


@pytest.mark.parametrize("script", sorted(p.stem for p in ROOT.glob("*.py")))
def test_import_has_no_side_effects(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    importlib.import_module(script)
    assert not any(Path(tmp_path).iterdir())


@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*.py")))
def test_script_copied_with_its_utils_modules_alone_runs(script, tmp_path):
    """The copy contract: a script and the utils modules benchmark/readability.py says it needs (its copy
    footprint, the core: module-level imports, the figure the README states; not the optional modules) in an
    empty folder import and answer --help there; a script that reaches for another utils module, benchmark/,
    tests/ or another script fails. Several test files also train from a copy of the whole of utils/."""
    import shutil

    import readability

    shutil.copy(ROOT / script, tmp_path / script)
    (tmp_path / "utils").mkdir()
    for module in readability.footprint(ROOT, ROOT / script):
        shutil.copy(ROOT / module, tmp_path / module)
    out = run_script([script, "--help"], cwd=tmp_path, timeout=120).stdout
    assert "--output_dir" in out
