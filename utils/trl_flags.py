"""Command lines in two versions of TRL's flags. TRL renamed some flags between 0.x and 1.x (`rloo_k` became
`num_generations`, `kl_coef` became `beta`, ...) and changed some defaults. A script that takes both lists its
flags in three tables: pairs of names for one setting (0.x name -> 1.x name), the flags only TRL 1.x has, and the
defaults that differ between the versions. Every such field defaults to None ("not given"); `resolve` reads
which version a command line speaks from the flags it sets, refuses a pair given two different values, copies a
1.x name's value to its 0.x name (the one the script reads) and fills every flag not given with that version's
default. A command line that sets no 1.x-only flag keeps the 0.x meaning it always had."""

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
