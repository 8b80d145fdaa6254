"""Defaults against TRL 1.16: for each script with a TRL 1.16 config class, every flag both share by name is
compared, and docs/trl_defaults.md must list exactly the ones whose defaults differ, each with its reason.
Regenerate the page with `python benchmark/speed/trl_defaults.py` (it keeps the hand-written reasons by
flag)."""

import sys
import types
from dataclasses import dataclass

import pytest

trl = pytest.importorskip("trl")
if trl.__version__ != "1.16.0":
    pytest.skip(f"the page compares with TRL 1.16.0; found trl {trl.__version__}", allow_module_level=True)

import trl_defaults as td  # noqa: E402  (benchmark/speed/, on the path through conftest)

REGENERATE = f"regenerate the page with `{td.COMMAND}` and write the reason of any new row"


@pytest.fixture(scope="module")
def page() -> dict[str, list[list[str]]]:
    assert td.PAGE.exists(), f"docs/trl_defaults.md is missing: {REGENERATE}"
    return td.read_tables(td.PAGE.read_text())


@pytest.mark.parametrize("script", [*td.SCRIPTS, *td.RECORDED])
def test_page_lists_every_shared_flag_whose_default_differs(page, script):
    """The page's (flag, ours, TRL) cells are recomputed from the script's Args and TRL's config class (TRL 1.12's
    PPOConfig from its record) and must match exactly, in order; every row carries a reason."""
    rows, shared, _ = td.differences(script)
    assert shared >= 15, f"{script}.py shares only {shared} flags with TRL: the comparison lost its fields"
    assert script in page, f"docs/trl_defaults.md has no `## {script}.py` section: {REGENERATE}"
    table = [tuple(row[:3]) for row in page[script]]
    assert table == rows, (
        f"docs/trl_defaults.md's table for {script}.py is out of date ({REGENERATE}):\n"
        f"page only: {sorted(set(table) - set(rows))}\ncode only: {sorted(set(rows) - set(table))}"
    )
    missing = [row[0] for row in page[script] if len(row) < 4 or not row[3]]
    assert not missing, f"{script}.py: rows without a reason in docs/trl_defaults.md: {missing}"


def test_ppo_is_compared_with_trl_1_12s_config_from_its_record(page):
    """TRL 1.16 has no PPO, so ppo.py's table reads TRL 1.12's PPOConfig from
    benchmark/speed/trl_ppo_record.py's record, made in TRL 1.12's environment; the defaults TRL's PPOTrainer
    never applies are listed, and the page says so."""
    import json

    assert not hasattr(trl, "PPOConfig") and not hasattr(trl, "PPOTrainer")
    record = json.loads(td.RECORDED["ppo"][3].read_text())
    assert record["made_by"]["versions"]["trl"] == "1.12.0"
    defaults = td.trl_defaults("ppo")
    assert defaults["bf16"] is True and defaults["max_grad_norm"] == 1.0 and defaults["kl_coef"] == 0.05
    listed = {row[0] for row in page["ppo"]}
    named = "seed bf16 gradient_checkpointing eval_strategy save_steps max_grad_norm".split()  # issue 48's
    assert set(named) <= listed
    text = td.PAGE.read_text()
    assert "| flag | ours | TRL 1.12 | why |" in text and "PPO never clips gradients" in text


def test_trl_defaults_are_read_as_a_user_gets_them():
    """Declared defaults, a one-element list as its element, and a None that TRL fills in with a constant read
    after __post_init__ (bf16 -> True); one derived from the batch sizes stays None."""
    dpo = td.trl_defaults("dpo")
    assert dpo["bf16"] is True and dpo["beta"] == 0.1 and dpo["loss_type"] == ["sigmoid"]
    assert td.same("sigmoid", dpo["loss_type"]) and not td.same("ipo", dpo["loss_type"])
    assert td.same(1, 1.0) and not td.same(None, -1) and not td.same(False, None)
    assert td.trl_defaults("grpo")["generation_batch_size"] is None


def test_a_script_with_a_trl_1_16_dialect_is_read_in_it(monkeypatch):
    """A script that takes TRL 1.16's flags with their own defaults (rloo.py: --trl_defaults 1.16) is compared
    through them, as its read_trl_flags fills them in."""

    @dataclass
    class Args:
        seed: int | None = None
        temperature: float = 0.7
        trl_defaults: str = "auto"

    def read_trl_flags(args):
        args.seed = {"1.16": 42}.get(args.trl_defaults, 1) if args.seed is None else args.seed
        return args

    monkeypatch.setitem(
        sys.modules, "two_dialects", types.SimpleNamespace(Args=Args, read_trl_flags=read_trl_flags)
    )
    monkeypatch.setitem(sys.modules, "one_dialect", types.SimpleNamespace(Args=Args))
    defaults, source = td.our_defaults("two_dialects")
    assert defaults == {"seed": 42, "temperature": 0.7, "trl_defaults": "1.16"} and "read_trl_flags" in source
    assert td.our_defaults("one_dialect") == (
        {"seed": None, "temperature": 0.7, "trl_defaults": "auto"},
        None,
    )


def test_reasons_survive_regeneration(tmp_path, monkeypatch):
    """The why column is read back by (script, flag), an escaped pipe included."""
    text = "## dpo.py (x)\n\n| flag | ours | TRL 1.16 | why |\n|---|---|---|---|\n| `beta` | `1` | `2` | a \\| b |\n"
    assert td.read_tables(text) == {"dpo": [["beta", "`1`", "`2`", "a \\| b"]]}
