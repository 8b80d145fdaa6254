"""Command lines in TRL 0.x's and 1.x's flags (`rloo_k` -> `num_generations`, `kl_coef` -> `beta`, ...).

A script lists renamed pairs, 1.x-only flags and differing defaults, every field None when not given. A
command line speaks 1.x when it sets a 1.x name, else 0.x; the script reads the 0.x names. Optional: rloo.py
imports it only for a command line with a 1.x flag (TRL 0.x's flags alone need nothing translated)."""

import math
from collections.abc import Iterable

from utils.run import UsageError


def given(value) -> bool:
    """Whether a flag was set: not None, nor False for a switch."""
    return value is not None and value is not False


def shown(value) -> str:
    """A value as written on the command line."""
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def speaks(
    args, renamed: dict[str, str], new_only: Iterable[str], choice: str, versions: tuple[str, str]
) -> str:
    """`choice`, or with "auto" the newer version when any 1.x name is set, else the older."""
    if choice != "auto":
        return choice
    return versions[1] if newer_flags(args, renamed, new_only) else versions[0]


def newer_flags(args, renamed: dict[str, str], new_only: Iterable[str]) -> list[str]:
    """The 1.x names set on the command line."""
    return [name for name in (*renamed.values(), *new_only) if given(getattr(args, name))]


def resolve(
    args, renamed: dict[str, str], defaults: dict[str, tuple], version: str, versions: tuple[str, str]
):
    """Merge each `renamed` pair into its 0.x name (UsageError on two values), fill `defaults` still None from
    (0.x default, 1.x default), and copy back to the 1.x names so the logged flags agree. Returns the
    (name, 0.x default, 1.x default) filled in with the 1.x one where the two differ."""
    for old, new in renamed.items():
        a, b = getattr(args, old), getattr(args, new)
        if given(a) and given(b) and a != b:
            raise UsageError(
                f"--{old} {shown(a)} and --{new} {shown(b)} are one setting under TRL 0.x's and TRL 1.x's names, "
                "given two values; pass one of them."
            )
        if given(b):
            setattr(args, old, b)
    changed = []
    for name, (old_default, new_default) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, new_default if version == versions[1] else old_default)
            if version == versions[1] and old_default != new_default:
                changed.append((name, old_default, new_default))
    for old, new in renamed.items():
        setattr(args, new, getattr(args, old))
    return changed


def say_changed_defaults(
    changed: list[tuple], reason: str, renamed: dict[str, str], versions: tuple[str, str]
):
    """One line naming each default the newer version changed (flag=old->new), on the first process."""
    from utils.loading import say_once

    if changed:
        values = ", ".join(f"--{renamed.get(n, n)}={shown(a)}->{shown(b)}" for n, a, b in changed)
        say_once(f"{reason}, so TRL {versions[1]}'s defaults apply: {values}")


# ----------------------------------------------------------------------------------------------------------------
# A run's length and an update's size in either version's flags
# ----------------------------------------------------------------------------------------------------------------
def read_sizes(args) -> None:
    """Refuse two flags for one size (0.x: --total_episodes, --num_mini_batches; 1.x: --max_steps,
    --num_train_epochs, --steps_per_generation, --generation_batch_size); set --num_mini_batches."""
    if args.total_episodes is not None and (args.max_steps is not None or args.num_train_epochs is not None):
        raise UsageError(
            "--total_episodes (TRL 0.x) and --max_steps / --num_train_epochs (TRL 1.x) both set the length of the "
            "run; pass one."
        )
    if (
        args.generation_batch_size is not None
        and (args.steps_per_generation, args.num_mini_batches) != (None,) * 2
    ):
        raise UsageError(
            "--generation_batch_size, --steps_per_generation and --num_mini_batches all set the size of an update; "
            "pass one."
        )
    spg, ga = args.steps_per_generation, args.gradient_accumulation_steps
    if spg is not None and (spg < 1 or spg % ga):
        raise UsageError(
            f"--steps_per_generation {spg} must be a positive multiple of --gradient_accumulation_steps {ga}."
        )
    if spg is not None and args.num_mini_batches not in (None, spg // ga):
        raise UsageError(
            f"--steps_per_generation {spg} with --gradient_accumulation_steps {ga} means --num_mini_batches "
            f"{spg // ga}, not {args.num_mini_batches}; pass one."
        )
    if spg is not None:
        args.num_mini_batches = spg // ga
    if args.max_steps is not None and (args.max_steps == 0 or args.max_steps < -1):
        raise UsageError(
            f"--max_steps must be positive, or -1 to use --num_train_epochs, got {args.max_steps}."
        )
    if args.num_train_epochs is not None and args.num_train_epochs <= 0:
        raise UsageError(f"--num_train_epochs must be positive, got {args.num_train_epochs}.")


def mini_batches(args, world_size: int) -> int:
    """--num_mini_batches, or generation_batch_size / (per_device_train_batch_size * accumulation * world)."""
    if args.generation_batch_size is None:
        return args.num_mini_batches
    micro_batches, rest = divmod(args.generation_batch_size, args.per_device_train_batch_size * world_size)
    if rest or micro_batches < 1 or micro_batches % args.gradient_accumulation_steps:
        raise UsageError(
            f"--generation_batch_size {args.generation_batch_size} must be a positive multiple of "
            "per_device_train_batch_size * gradient_accumulation_steps * processes."
        )
    return micro_batches // args.gradient_accumulation_steps


def num_updates(
    max_steps: int, num_train_epochs: float, updates_per_epoch: int, steps_per_update: int
) -> int:
    """Rollouts in `max_steps` optimizer steps (-1: ceil(num_train_epochs * steps per epoch)), rounded up."""
    steps = max_steps if max_steps > 0 else math.ceil(num_train_epochs * updates_per_epoch * steps_per_update)
    return math.ceil(steps / steps_per_update)


def read_rloo_flags(args, newer: list[str], choice: str, two_values: bool, renamed: dict[str, str],
                    new_only: Iterable[str], defaults: dict[str, tuple], versions: tuple[str, str]):  # fmt: skip
    """rloo.py's command line that speaks TRL 1.16 (`newer`: its 1.16 flags; `choice`: --trl_defaults): its
    version's defaults filled in (each that changes said in one line), its sizes read, its contradictions refused."""
    version = speaks(args, renamed, new_only, choice, versions)
    read_sizes(args)
    if args.normalize_advantage and args.normalize_advantages:
        raise UsageError(
            "--normalize_advantage (TRL 0.19) and --normalize_advantages (TRL 1.16) normalize the "
            "advantages two ways (sqrt(var + 1e-8) against std + 1e-4); pass one."
        )
    if two_values and args.normalize_reward:
        raise UsageError(
            "--reward_clip_range with two values clamps the reward (TRL 1.16); with --normalize_reward "
            "it takes one, the clip range of the normalized scores."
        )
    if args.mask_truncated_completions and args.token_level_kl:
        raise UsageError(
            "--mask_truncated_completions (TRL 1.16, a loss per completion) does not go with "
            "--token_level_kl."
        )
    if args.reward_fn is not None and args.reward_funcs not in (None, [args.reward_fn]):
        raise UsageError(
            "--reward_fn (TRL 0.19, one function) and --reward_funcs (TRL 1.16) both name reward "
            "functions; put them all in --reward_funcs."
        )
    changed = resolve(args, renamed, defaults, version, versions)
    if args.reward_fn is not None:
        args.reward_funcs = [args.reward_fn]
    if version == "1.16" and args.stop_token is None and args.stop_token_id is None:
        args.stop_token = "eos"  # TRL 1.16 always stops at EOS
        changed.append(("stop_token", None, "eos"))
    if version == "1.16" and args.total_episodes is None:
        args.max_steps = -1 if args.max_steps is None else args.max_steps
        if args.num_train_epochs is None and args.max_steps == -1:
            changed.append(("num_train_epochs", 1, 3.0))  # TRL 0.19's --total_episodes default: one epoch
        args.num_train_epochs = 3.0 if args.num_train_epochs is None else args.num_train_epochs
    if args.reward_clip_range is None and (version == "0.19" or args.normalize_reward):
        args.reward_clip_range = (10.0,)
    elif version == "1.16" and args.reward_clip_range is None:
        changed.append(("reward_clip_range", 10.0, None))
    if version == "1.16":  # a single TRL 1.16 flag changes every default: say which
        names = " ".join(f"--{name}" for name in newer)
        reason = f"{names} {'is a TRL 1.16 flag' if len(newer) == 1 else 'are TRL 1.16 flags'}"
        if args.trl_defaults == "1.16" or not newer:
            reason = (
                "--trl_defaults 1.16" if args.trl_defaults == "1.16" else "--reward_clip_range has two values"
            )
        say_changed_defaults(changed, reason, renamed, versions)
    args.dialect = version
    return args
