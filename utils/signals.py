"""Ctrl-C (SIGINT) and SIGTERM outside the training loop: one line and exit 130 / 143, never a traceback.

A script installs `stop_before_training` before its heavy imports, and run_cli again; the checkpointer then
takes the signals over (utils/checkpoint.py: save at the end of the step, stop); after the last step a signal
still ends the run with its exit code. Imports nothing heavy: it runs before torch is imported."""

import os
import signal
import sys

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
_RECEIVED: list[str] = []  # every stop signal this process got, by name, in any phase: note(), received()


def note(name: str) -> None:
    """Remember that this process got the stop signal `name` (run_cli asks after the last step)."""
    _RECEIVED.append(name)


def received(clear: bool = False) -> str | None:
    """The first stop signal this process got, by name (None: none); `clear` forgets them (a run's start)."""
    first = _RECEIVED[0] if _RECEIVED else None
    if clear:
        _RECEIVED.clear()
    return first


def exit_code(name: str) -> int:
    """The shell's code for a run stopped by the signal `name`: 128 + its number."""
    return EXIT_CODES.get(name, 143)


def stop_before_training(imports: bool = True) -> None:
    """Until the checkpointer takes over, SIGINT or SIGTERM prints `script.py: interrupted before training
    started; nothing was saved.` and exits (at once during the script's imports, `imports`; through SystemExit
    from run_cli on); a second one exits at once."""
    install(_during_imports if imports else _before_training)


def stop_after_training() -> None:
    """After the last step: a signal ends the run with its exit code and says the output is saved."""
    install(_after_training)


def install(handler) -> None:
    try:
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: no handlers
        pass


def say(line: str) -> None:
    """`script.py: <line>` on stderr, from the run's first process only."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(f"{os.path.basename(sys.argv[0]) or 'script'}: {line}", file=sys.stderr, flush=True)


def exit_now(name: str) -> None:
    """A second signal while the first is being handled: exit at once, as the user insists."""
    say(f"interrupted again ({name}): stopping now, without saving.")
    os._exit(exit_code(name))


def _say_and_exit(signum: int, what: str) -> None:
    name = signal.Signals(signum).name
    note(name)
    if len(_RECEIVED) > 1:
        exit_now(name)
    say(f"interrupted {what}")
    raise SystemExit(exit_code(name))  # passes through `except Exception`, exits without a traceback


def _before_training(signum, frame) -> None:
    _say_and_exit(signum, "before training started; nothing was saved.")


def _during_imports(signum, frame) -> None:
    """Before run_cli: the heavy imports hold nothing to save or close, and a SystemExit raised inside one (numpy's,
    under torch's) leaves it half-imported, so the process exits at once."""
    name = signal.Signals(signum).name
    say("interrupted before training started; nothing was saved.")
    os._exit(exit_code(name))


def _after_training(signum, frame) -> None:
    _say_and_exit(signum, "after the last step; the run finished and its output is saved.")
