"""Command lines in two versions of TRL's flags. TRL renamed some flags between 0.x and 1.x (`rloo_k` became
`num_generations`, `kl_coef` became `beta`, ...) and changed some defaults. A script that takes both lists its
flags in three tables: pairs of names for one setting (0.x name -> 1.x name), the flags only TRL 1.x has, and the
defaults that differ between the versions. Every such field defaults to None ("not given"); `resolve` reads
which version a command line speaks from the flags it sets, refuses a pair given two different values, copies a
1.x name's value to its 0.x name (the one the script reads) and fills every flag not given with that version's
default. A command line that sets no 1.x-only flag keeps the 0.x meaning it always had."""

import math
from collections.abc import Iterable


def given(value) -> bool:
    """Whether a flag was set on the command line: its field is not None, nor False for a switch."""
    return value is not None and value is not False


def shown(value) -> str:
    """A value as it is written on the command line."""
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def speaks(
    args, renamed: dict[str, str], new_only: Iterable[str], choice: str, versions: tuple[str, str]
) -> str:
    """The version a command line speaks: `choice` unless it is "auto"; else the newer one when any of its
    names (the 1.x names of `renamed`, or `new_only`) is set, the older one otherwise."""
    if choice != "auto":
        return choice
    newer = [name for name in (*renamed.values(), *new_only) if given(getattr(args, name))]
    return versions[1] if newer else versions[0]


def resolve(
    args, renamed: dict[str, str], defaults: dict[str, tuple], version: str, versions: tuple[str, str]
):
    """Merge each pair of `renamed` into its 0.x name (ValueError when both are set to different values), fill
    every field of `defaults` still None with its (0.x default, 1.x default) for `version`, and give each 1.x
    name the value the run uses, so the logged flags agree."""
    for old, new in renamed.items():
        a, b = getattr(args, old), getattr(args, new)
        if given(a) and given(b) and a != b:
            raise ValueError(
                f"--{old} {shown(a)} and --{new} {shown(b)} are one setting under TRL 0.x's and TRL 1.x's names, "
                "given two values; pass one of them."
            )
        if given(b):
            setattr(args, old, b)
    for name, (old_default, new_default) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, new_default if version == versions[1] else old_default)
    for old, new in renamed.items():
        setattr(args, new, getattr(args, old))


def flag_name(name: str, renamed: dict[str, str], version: str, versions: tuple[str, str]) -> str:
    """`--name` as the command line's version calls it (the 1.x name of a renamed flag under 1.x)."""
    return f"--{renamed.get(name, name) if version == versions[1] else name}"


# ----------------------------------------------------------------------------------------------------------------
# A run's length and an update's size: completions and mini-batches (TRL 0.x), optimizer steps, epochs and
# rollouts of micro-batches (TRL 1.x)
# ----------------------------------------------------------------------------------------------------------------
def read_sizes(args) -> None:
    """TRL 0.x gives a run's length in completions (--total_episodes) and an update's optimizer steps per epoch
    (--num_mini_batches); TRL 1.x in optimizer steps or passes over the prompts (--max_steps, --num_train_epochs)
    and in micro-batches or completions per rollout (--steps_per_generation, --generation_batch_size). Refuse two
    of them given for one thing; turn --steps_per_generation into --num_mini_batches."""
    if args.total_episodes is not None and (args.max_steps is not None or args.num_train_epochs is not None):
        raise ValueError(
            "--total_episodes (TRL 0.x) and --max_steps / --num_train_epochs (TRL 1.x) both set the length of the "
            "run; pass one."
        )
    if (
        args.generation_batch_size is not None
        and (args.steps_per_generation, args.num_mini_batches) != (None,) * 2
    ):
        raise ValueError(
            "--generation_batch_size, --steps_per_generation and --num_mini_batches all set the size of an update; "
            "pass one."
        )
    spg, ga = args.steps_per_generation, args.gradient_accumulation_steps
    if spg is not None and (spg < 1 or spg % ga):
        raise ValueError(
            f"--steps_per_generation {spg} must be a positive multiple of --gradient_accumulation_steps {ga}."
        )
    if spg is not None and args.num_mini_batches not in (None, spg // ga):
        raise ValueError(
            f"--steps_per_generation {spg} with --gradient_accumulation_steps {ga} means --num_mini_batches "
            f"{spg // ga}, not {args.num_mini_batches}; pass one."
        )
    if spg is not None:
        args.num_mini_batches = spg // ga
    if args.max_steps is not None and (args.max_steps == 0 or args.max_steps < -1):
        raise ValueError(
            f"--max_steps must be positive, or -1 to use --num_train_epochs, got {args.max_steps}."
        )
    if args.num_train_epochs is not None and args.num_train_epochs <= 0:
        raise ValueError(f"--num_train_epochs must be positive, got {args.num_train_epochs}.")


def mini_batches(args, world_size: int) -> int:
    """--num_mini_batches, or TRL 1.x's --generation_batch_size (completions per rollout over all processes) in
    optimizer steps per epoch: generation_batch_size / (per_device_train_batch_size * accumulation * processes)."""
    if args.generation_batch_size is None:
        return args.num_mini_batches
    micro_batches, rest = divmod(args.generation_batch_size, args.per_device_train_batch_size * world_size)
    if rest or micro_batches % args.gradient_accumulation_steps:
        raise ValueError(
            f"--generation_batch_size {args.generation_batch_size} must be a multiple of per_device_train_batch_size "
            "* gradient_accumulation_steps * processes."
        )
    return micro_batches // args.gradient_accumulation_steps


def num_updates(
    max_steps: int, num_train_epochs: float, updates_per_epoch: int, steps_per_update: int
) -> int:
    """Updates (rollouts) of a run given as TRL 1.x does: `max_steps` optimizer steps, or (max_steps -1) as
    transformers counts epochs, ceil(num_train_epochs * optimizer steps per epoch); rounded up to whole updates."""
    steps = max_steps if max_steps > 0 else math.ceil(num_train_epochs * updates_per_epoch * steps_per_update)
    return math.ceil(steps / steps_per_update)
