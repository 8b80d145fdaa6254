"""The environments of --environment_factory (optional: imported only with that flag; it builds on utils/tools.py),
TRL 1.16's contract (`GRPOTrainer(environment_factory=...)`).

Every rollout gets its own environment (an instance of the user's class, from a pool, as TRL's): `reset(**row)`
before sampling may add text to the prompt's last message, the instance's public methods are the rollout's tools
beside --tools, reward functions read the instances (`environments=`), and a class with `get_reward()` is a reward
of its own:

    environments = utils.environments.load_environments(args, tool_fns, dataset, eval_dataset)
    tools = utils.tools.Tools(tool_fns, tokenizer, environments=environments)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from utils.context import model_positions
from utils.data import columns
from utils.reward_funcs import is_async, load_function
from utils.run import UsageError
from utils.tools import check_names, check_schema


def environment_methods(environment) -> list[Callable]:
    """An environment's tools: its class's public methods but reset and get_reward, bound to it (TRL's; listed on
    the class, so that no property is evaluated)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def environment_reward(kind: type) -> Callable:
    """TRL's reward of an environment class with `get_reward()`: each rollout's environment of exactly that class
    scores itself, the others get None (a plain or async function, as get_reward is)."""
    if is_async(kind.get_reward):

        async def reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is kind else None for e in environments]

    else:

        def reward(environments, **kwargs):
            return [e.get_reward() if type(e) is kind else None for e in environments]

    reward.__name__, reward.kind = kind.__name__, kind
    return reward


def load_factories(specs: Sequence[str]) -> dict[str | None, tuple[str, Callable]]:
    """--environment_factory's {name: (spec, factory)}: one `path.py:Class` is TRL's single factory (name None),
    several `name=path.py:Class` TRL's dict (each row's `environment` column names its factory)."""
    flag = "--environment_factory"
    parts = [spec.partition("=") if "=" in spec.split(":")[0] else ("", "", spec) for spec in specs]
    named = [bool(sep) for _, sep, _ in parts]
    if len(specs) > 1 and not all(named):
        raise UsageError(
            f"{flag} takes one path/to/file.py:Class, or several name=path/to/file.py:Class (each row's "
            f"environment column picks one); got {' '.join(specs)}."
        )
    names = [name if sep else None for name, sep, _ in parts]
    if any(name == "" for name in names) or len(set(names)) != len(names):
        raise UsageError(f"{flag}: each environment needs a name of its own (name=path/to/file.py:Class).")
    return {name: (spec, load_function(spec, flag)) for name, (_, _, spec) in zip(names, parts)}


class Environments:
    """One environment per rollout, from a pool per factory (TRL's: made once, reset before every rollout; the
    held-out rollouts draw from a pool of their own, so that evaluating changes nothing of training). `columns`
    and `eval_columns`: the splits' rows, every column of which reaches reset as a keyword (TRL's)."""

    def __init__(self, factories, tools: list[Callable], columns: dict, eval_columns: dict | None = None):
        self.factories, self.multi = factories, None not in factories
        self.columns = {False: columns, True: eval_columns or {}}
        self.routes = {  # each row's environment name
            held_out: self.route(split.get("environment"), len(split["prompt"]), split_flag(held_out))
            if split
            else []
            for held_out, split in self.columns.items()
        }
        self.pools: dict[bool, dict] = {False: {}, True: {}}
        self.tools: dict[str | None, list[Callable]] = {}  # per environment: --tools and the probe's methods
        self.rewards: list[Callable] = []  # of the classes with get_reward, each once
        for name, (spec, _) in factories.items():
            probe = self.make(name)
            self.pools[False][name] = [probe]
            if not callable(getattr(type(probe), "reset", None)):
                raise UsageError(
                    f"--environment_factory {spec}: {type(probe).__name__} has no reset method; an environment "
                    "needs reset(**row), returning None or a string to join to the prompt's last message."
                )
            for method in environment_methods(probe):
                check_schema(method, f"--environment_factory {spec}: method {method.__name__}")
            self.tools[name] = list(tools) + environment_methods(probe)
            check_names(self.tools[name], f"--environment_factory {spec} with --tools")
            owned = [reward.kind for reward in self.rewards]  # two names of one class: one reward
            if callable(getattr(type(probe), "get_reward", None)) and type(probe) not in owned:
                self.rewards.append(environment_reward(type(probe)))
        self.current: list = []  # the last reset's environments and prompts, one per rollout
        self.prompts: list[list[dict]] = []
        self.max_prompt_length, self.room, self.cut, self.positions = None, None, False, None

    def make(self, name: str | None):
        """A new instance of environment `name`; a factory that raises is one sentence."""
        spec, factory = self.factories[name]
        try:
            return factory()
        except Exception as error:  # noqa: BLE001 - the user's class, in one sentence
            raise UsageError(f"--environment_factory {spec}: making an instance raised {error!r}.") from None

    def route(self, routes: list | None, n: int, where: str) -> list[str | None]:
        """The environment of each of `n` rows: None with one factory, else the row's `environment` value."""
        if not self.multi:
            return [None] * n
        if routes is None:
            raise UsageError(
                f"{where} has no environment column, which several --environment_factory name=... need to pick "
                "each row's environment (TRL's dict of factories)."
            )
        unknown = sorted({str(r) for r in routes} - {str(name) for name in self.factories})
        if unknown:
            raise UsageError(
                f"{where}: a row has environment={unknown[0]!r}, which is none of --environment_factory's "
                f"{', '.join(map(str, self.factories))}."
            )
        return list(routes)

    def limit(self, args, model: str, flag: str = "--model_name_or_path") -> None:
        """Prompts after reset keep their last --max_prompt_length tokens and leave --max_completion_length of
        the model's positions (refused, or cut with --context_overflow cut), as the dataset's prompts."""
        self.max_prompt_length, self.cut = args.max_prompt_length, args.context_overflow == "cut"
        self.positions, self.model = model_positions(model), f"{flag} {model}"
        self.room = None if self.positions is None else self.positions - args.max_completion_length

    def fit(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """`prompt_ids` after reset, cut to the limits (`limit`)."""
        if self.max_prompt_length:
            prompt_ids = [ids[-self.max_prompt_length :] for ids in prompt_ids]
        longest = max(map(len, prompt_ids), default=0)
        if self.room is None or longest <= self.room:
            return prompt_ids
        if not self.cut:
            raise UsageError(
                f"an environment's reset made a prompt of {longest} tokens, more than the {self.room} that the "
                f"{self.positions} positions of {self.model} leave beside --max_completion_length; lower "
                "--max_prompt_length or --max_completion_length, or pass --context_overflow cut."
            )
        return [ids[-self.room :] for ids in prompt_ids]

    def reset(self, rows: list[int], held_out: bool = False) -> tuple[list[list[dict]], list[str | None]]:
        """(prompts, environment names), one per entry of `rows` (dataset rows): the i-th rollout of a name
        gets its pool's i-th environment (made when the pool is short), reset on its row."""
        names = [self.routes[held_out][r] for r in rows]
        pool, taken = self.pools[held_out], dict.fromkeys(self.factories, 0)
        self.current, self.prompts = [], []
        for r, name in zip(rows, names):
            instances = pool.setdefault(name, [])
            if taken[name] == len(instances):
                instances.append(self.make(name))
            self.current.append(instances[taken[name]])
            taken[name] += 1
            self.prompts.append(self.reset_one(self.current[-1], r, held_out))
        return self.prompts, names

    def reset_one(self, environment, r: int, held_out: bool) -> list[dict]:
        """Row r's prompt after `environment.reset(**row)` (every column; with several factories, all but
        `environment`), what it returned joined to the last message (TRL's); a reset that raises or returns
        neither a string nor None is one sentence."""
        spec, where = self.factories[self.routes[held_out][r]][0], f"row {r} of {split_flag(held_out)}"
        split = self.columns[held_out]
        row = {k: v[r] for k, v in split.items() if not (self.multi and k == "environment")}
        try:
            observation = environment.reset(**row)
        except Exception as error:  # noqa: BLE001 - the user's reset, in one sentence
            raise UsageError(f"--environment_factory {spec}: reset raised {error!r} on {where}.") from None
        prompt = list(row["prompt"])
        if observation is None:
            return prompt
        if not isinstance(observation, str) or not isinstance(prompt[-1].get("content"), str):
            raise UsageError(
                f"--environment_factory {spec}: reset returned {type(observation).__name__} on {where}; it must "
                "return None or a string (joined to the prompt's last message, whose content must be text)."
            )
        return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]

    def check_reset(self) -> None:
        """Reset each environment's probe on the first training row it serves, before any model is loaded: a
        reset that refuses the dataset's columns is one sentence at once."""
        for name in self.factories:
            if name in self.routes[False]:
                self.reset_one(self.pools[False][name][0], self.routes[False].index(name), False)

    def rollout_tools(self, tools: list[Callable]) -> tuple[list[list[Callable]], list[dict[str, Callable]]]:
        """Per rollout of the last reset: (its tools, for parsing; by name, to call): --tools and the methods of
        its own environment."""
        schemas = [list(tools) + environment_methods(e) for e in self.current]
        return schemas, [{tool.__name__: tool for tool in row} for row in schemas]


def split_flag(held_out: bool) -> str:
    """The flag that names a split's rows, for messages."""
    return "--dataset_test_split" if held_out else "--dataset_name"


def load_environments(
    args, tools: list[Callable], dataset, eval_dataset=None, model=None, flag="--model_name_or_path"
) -> Environments:
    """The environments of --environment_factory, checked before any model is loaded: each class makes an
    instance, has reset, and methods with schemas and names of their own; each row routes to one; the first row
    resets; and with no --reward_funcs or --reward_model_path, some class owns a reward (get_reward)."""
    eval_columns = columns(eval_dataset) if eval_dataset is not None else None
    environments = Environments(
        load_factories(args.environment_factory), tools, columns(dataset), eval_columns
    )
    environments.check_reset()
    if not (args.reward_funcs or args.reward_model_path or environments.rewards):
        raise UsageError(
            "pass a reward: --reward_funcs file.py:function, --reward_model_path, or an --environment_factory "
            "class with a get_reward() method."
        )
    environments.limit(args, model or args.model_name_or_path, flag)  # the policy's positions
    return environments
