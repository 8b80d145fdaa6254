"""Run a script with SIGTERM sent to its first process right after the Nth call of a function, so a test can
preempt it at a chosen point: python tests/sigterm_at.py accelerate.Accelerator.backward 5 sft.py --flags ..."""

import importlib
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve(target: str):
    """(owner, attribute name) of a dotted `module[.Class].function`."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise SystemExit(f"sigterm_at.py: cannot import {target}")


def main() -> None:
    target, count, script, *argv = sys.argv[1:]
    sys.path.insert(0, ROOT)
    owner, name = resolve(target)
    original, calls = getattr(owner, name), [0]

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == int(count) and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    setattr(owner, name, counted)
    sys.argv = [script, *argv]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


if __name__ == "__main__":
    main()
