"""Multi-turn rollouts with tools (optional: imported only with --tools or --environment_factory), TRL 1.16's contract
(`GRPOTrainer(tools=..., environment_factory=...)`).

A tool is a plain or `async def` Python function with type hints and a Google-style docstring; the chat template
renders its JSON schema (transformers' `get_json_schema`) into the prompt. After the first turn is sampled:

    1. parse each completion's last turn with the tokenizer's `response_template` (transformers' `parse_response`);
    2. call the tools it names: an exception, bad arguments, an unknown name or a timeout becomes a tool message
       `{'error': ...}` and a counted failure, never a crash;
    3. append the tool messages' tokens, as the chat template renders them after an assistant turn with tool calls
       (with the next generation prompt), to the sampled tokens, and sample the next turn after them;
    4. repeat while a turn calls a tool, up to --max_tool_calling_iterations; a row whose tool answer would not fit
       --max_completion_length (or the model's positions) stops before it, its answer dropped.

The completion is every token after the prompt, the sampled and the inserted; `tool_mask` is 1 on sampled tokens
and 0 on inserted ones, and the loss, the KL and the entropy see only the 1s. Sampled ids are never re-tokenized,
so the ids trained on are the ids sampled, turn by turn.

    tools = utils.tools.Tools(utils.tools.load_tools(["tools.py:lookup"]), tokenizer, timeout=10)
    texts = tools.render_prompts(conversations)                        # with the tools' schemas
    rollout = tools.continue_rollouts(prompt_ids, completion_ids, logprobs, sample_turn, R, positions)

With --environment_factory, every rollout gets its own environment (an instance of the user's class, from a pool,
as TRL's): `reset(**row)` before sampling may add text to the prompt's last message, the instance's public methods
are the rollout's tools beside --tools, reward functions read the instances (`environments=`), and a class with
`get_reward()` is a reward of its own:

    environments = utils.tools.load_environments(args, tool_fns, dataset, eval_dataset)
    tools = utils.tools.Tools(tool_fns, tokenizer, environments=environments)
    prompt_ids = tools.reset(rows)                                     # one prompt per rollout, after reset
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from utils.chat import tokenize_prompts
from utils.context import config_positions, model_positions
from utils.data import column, columns, is_conversation
from utils.generation import left_pad, pad, truncate_response
from utils.reward_funcs import COMPLETION_MESSAGES, event_loop, is_async, load_function
from utils.run import UsageError, inner_model


# ----------------------------------------------------------------------------------------------------------------
# Loading and checking
# ----------------------------------------------------------------------------------------------------------------
def check_args(args) -> None:
    """Refuse impossible tool flags before any model is loaded."""
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 0:
        raise UsageError(
            f"--max_tool_calling_iterations must be at least 0, got {args.max_tool_calling_iterations}."
        )
    if args.tool_timeout is not None and args.tool_timeout <= 0:
        raise UsageError(f"--tool_timeout must be positive (or None: no limit), got {args.tool_timeout}.")
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_tensor_parallel_size", 1) > 1:
        raise UsageError(
            "--tools samples each process's later turns on its own, which a tensor-parallel vLLM engine shared by "
            "several processes cannot; use --vllm_tensor_parallel_size 1."
        )
    if getattr(args, "environment_factory", None) and getattr(args, "filter_groups", False):
        raise UsageError(
            "--filter_groups would keep the groups of several sampling rounds, each round's environments reset "
            "over the last's; leave it out with --environment_factory."
        )


def check_schema(tool: Callable, where: str) -> None:
    """Refuse a tool transformers' get_json_schema cannot describe (the chat template renders its schema)."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(tool)
    except Exception as error:  # noqa: BLE001 - transformers' reason, in one sentence
        raise UsageError(
            f"{where}: no JSON schema for it ({error}); a tool needs type hints and a docstring with an "
            "Args: section naming every argument."
        ) from None


def check_names(tools: Sequence[Callable], where: str) -> None:
    """Refuse two tools of one name: a call names its tool."""
    names = [tool.__name__ for tool in tools]
    if len(set(names)) != len(names):
        raise UsageError(
            f"{where}: two tools have the same name ({', '.join(names)}); a call names its tool."
        )


def load_tools(specs: Sequence[str], flag: str = "--tools") -> list[Callable]:
    """The tools of `specs`, each with a schema the chat template can render (type hints and a docstring that
    documents every argument); names must differ."""
    tools = [load_function(spec, flag) for spec in specs]  # a file also named by --reward_funcs runs once
    for spec, tool in zip(specs, tools):
        check_schema(tool, f"{flag} {spec}")
    check_names(tools, flag)
    return tools


def check_tokenizer(tokenizer, flag: str = "--tools") -> None:
    """Refuse a tokenizer whose chat template cannot render a tool call and its answer, that has no
    `response_template` to parse calls with, or whose rendering of a conversation changes as turns are added
    (the tool answer's tokens are cut from a rendering; TRL swaps such a template, this refuses it)."""
    call = {"type": "function", "function": {"name": "tool_name_x1", "arguments": {"key_x2": "value_x3"}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "tool_name_x1", "content": "answer_x4"},
    ]
    fix = "pass --chat_template_path with a tokenizer folder (or Jinja file) that does"
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(f"{flag} needs conversational prompts and a chat template; {fix}.")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the tool role
        text = ""
    if not all(s in text for s in ("tool_name_x1", "key_x2", "value_x3", "answer_x4")):
        raise UsageError(f"{flag}: the chat template does not render tool calls and tool answers; {fix}.")
    if getattr(tokenizer, "response_template", None) is None:
        raise UsageError(
            f"{flag}: the tokenizer has no response_template, so tool calls cannot be parsed from samples; set one "
            "(transformers' response parsing: tokenizer.response_template = {...}; save_pretrained keeps it) or "
            "use a tokenizer that has one."
        )
    before = tokenizer.apply_chat_template(messages[:2], tokenize=True, return_dict=False)
    after = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    if after[: len(before)] != before:
        raise UsageError(
            f"{flag}: the chat template renders an assistant turn differently once a tool answer follows it, so "
            f"sampled tokens would change between turns; {fix} not."
        )


# ----------------------------------------------------------------------------------------------------------------
# Parsing and calling
# ----------------------------------------------------------------------------------------------------------------
def parse_turn(tokenizer, ids: list[int], prefix: list[int], tools: list[Callable]) -> dict:
    """The assistant message of sampled `ids` after `prefix` (the prompt so far), through the tokenizer's
    `response_template`: {"role", "content", "tool_calls"?}. A turn the template cannot parse (a malformed call)
    is plain text: its decoded ids, no call."""
    try:
        message = tokenizer.parse_response(ids, prefix=prefix, tools=tools)
        if message is None:
            raise UsageError("nothing parsed")
        content = message.get("content")
        message["content"] = content.removesuffix(tokenizer.eos_token) if isinstance(content, str) else ""
        for call in message.get("tool_calls") or []:  # a call without arguments gets {}
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise UsageError("a tool call without a name")
            if function.get("arguments") is None:
                function["arguments"] = {}
    except (ValueError, TypeError):
        message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return message


@dataclass
class CallResult:
    name: str
    content: str
    failed: bool


def error_content(error: BaseException | str) -> str:
    """A failed call's tool message, as TRL writes it: str({'error': message})."""
    return str({"error": str(error)})


def run_sync(tool: Callable, arguments: dict, timeout: float | None):
    """tool(**arguments) in a daemon thread, waited for at most `timeout` seconds (None: no limit); raises
    what it raised, or TimeoutError (the thread is left to finish on its own: Python cannot stop it)."""
    if timeout is None:
        return tool(**arguments)
    box = {}

    def target():
        try:
            box["value"] = tool(**arguments)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=f"tool-{tool.__name__}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"tool {tool.__name__} did not answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


async def run_async(coroutine, name: str, timeout: float | None):
    """await `coroutine` (a tool's call), cancelled after `timeout` seconds (None: no limit)."""
    try:
        return await asyncio.wait_for(coroutine, timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"tool {name} did not answer within {timeout:g} s") from None


def call_tools(
    calls: list[list[dict]], tools: dict[str, Callable] | list[dict[str, Callable]], timeout: float | None
) -> list[list[CallResult]]:
    """The results of every row's tool calls, in call order: plain tools one after another, `async def` ones
    together on one event loop. `tools`: by name, for every row or one dict per row (an environment's methods are
    its rollout's). A failure (an unknown tool, arguments that are not a dict or that the function refuses, an
    exception, a timeout) is the result's content `{'error': ...}`."""
    results: list[list[CallResult | None]] = [[None] * len(row) for row in calls]
    waiting = []  # (row, position, name, coroutine)
    per_row = tools if isinstance(tools, list) else [tools] * len(calls)
    for r, (row, row_tools) in enumerate(zip(calls, per_row)):
        for c, call in enumerate(row):
            function = call.get("function", {}) if call.get("type", "function") == "function" else None
            name = function.get("name", "unknown") if function is not None else call.get("name", "unknown")
            try:
                if function is None:
                    raise UsageError(f"Unsupported tool call type: {call.get('type')}")
                if name not in row_tools:
                    raise UsageError(f"Tool {name} not found.")
                arguments = function.get("arguments", {})  # bad ones: the call's TypeError, as TRL
                if is_async(row_tools[name]):
                    waiting.append((r, c, name, run_async(row_tools[name](**arguments), name, timeout)))
                else:
                    results[r][c] = CallResult(
                        name, str(run_sync(row_tools[name], arguments, timeout)), False
                    )
            except Exception as error:  # noqa: BLE001 - every failure is the model's to see, not a crash
                results[r][c] = CallResult(name, error_content(error), True)
    if waiting:

        async def gather():
            return await asyncio.gather(*(coro for *_, coro in waiting), return_exceptions=True)

        answers = asyncio.run_coroutine_threadsafe(gather(), event_loop()).result()
        for (r, c, name, _), answer in zip(waiting, answers):
            failed = isinstance(answer, BaseException)
            results[r][c] = CallResult(name, error_content(answer) if failed else str(answer), failed)
    return results


# ----------------------------------------------------------------------------------------------------------------
# Token ids between turns
# ----------------------------------------------------------------------------------------------------------------
def tool_answer_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens the chat template puts after an assistant turn with tool calls (up to and including its EOS):
    the tool messages, then the opening of the next assistant turn. Cut from the rendering of a stand-in
    conversation, so the sampled turn before them is never re-tokenized."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    turn = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = tokenizer.apply_chat_template(turn, tokenize=True, return_dict=False)
    after = tokenizer.apply_chat_template(
        turn + tool_messages, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    eos = [i for i, token in enumerate(before) if token == tokenizer.eos_token_id]
    if eos:  # a template's whitespace after its end of turn belongs to what follows
        before = before[: eos[-1] + 1]
    if after[: len(before)] != before:
        raise UsageError(
            "the chat template renders an assistant turn differently once a tool answer follows it."
        )
    return after[len(before) :]


# ----------------------------------------------------------------------------------------------------------------
# The rollout
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """Every row's completion after its prompt: ids (sampled and inserted), tool_mask (1 sampled, 0 inserted),
    logprobs (the sampler's on sampled tokens, NaN on inserted ones), messages (the parsed turns and tool
    messages), turns (assistant turns sampled); calls and failures over all rows."""

    completion_ids: list[list[int]]
    tool_mask: list[list[int]]
    logprobs: list[list[float]]
    messages: list[list[dict]]
    turns: list[int]
    calls: int = 0
    failures: int = 0

    def tensors(self, width: int, pad_id: int, device=None):
        """(responses, response_mask, tool_mask, logprobs) [B, width], right-padded: response_mask covers every
        token of the completion, tool_mask only the sampled ones."""
        lengths = [len(ids) for ids in self.completion_ids]
        if max(lengths, default=0) > width:
            raise UsageError(f"a completion of {max(lengths)} tokens is longer than {width}.")
        responses = pad(self.completion_ids, pad_id, width=width)
        response_mask = pad([[True] * n for n in lengths], False, width=width, dtype=torch.bool)
        tool_mask = pad(self.tool_mask, False, width=width, dtype=torch.bool)
        logprobs = pad(self.logprobs, math.nan, width=width, dtype=torch.float)
        return tuple(t.to(device) for t in (responses, response_mask, tool_mask, logprobs))


class Tools:
    """The tools of a run and how they meet the tokenizer: rendering prompts, parsing turns, running calls; with
    `environments` (--environment_factory), each rollout's tools are also its environment's methods."""

    def __init__(
        self,
        tools: list[Callable],
        tokenizer,
        timeout: float | None = None,
        max_iterations: int | None = None,
        environments: Environments | None = None,
    ):
        check_tokenizer(tokenizer, "--tools" if tools or environments is None else "--environment_factory")
        self.tools, self.tokenizer, self.timeout = list(tools), tokenizer, timeout
        self.by_name = {tool.__name__: tool for tool in self.tools}
        self.environments = environments
        self.max_iterations = math.inf if max_iterations is None else max_iterations
        self.last = Rollout([], [], [], [], [])
        # TRL runs no tool loop when there is no tool at all (an environment of reset alone)
        self.calls_tools = bool(self.tools) or environments is not None and any(environments.tools.values())

    def tools_of(self, environment: str | None) -> list[Callable]:
        """The tools a prompt is rendered with: --tools, and those of the row's environment."""
        return self.tools if self.environments is None else self.environments.tools[environment]

    def render(self, conversation: list[dict], tools: list[Callable]) -> str:
        """A prompt's text with the tools' schemas (TRL: `apply_chat_template(..., tools=tools or None)`)."""
        return self.tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=conversation[-1]["role"] != "assistant",
        )

    def prompt_texts(self, dataset, tokenizer, where: str) -> list[str]:
        """The `prompt` column's conversations rendered with the generation prompt and the tools' schemas (TRL:
        `apply_chat_template(..., tools=tools)`), as utils.data.prompt_texts renders them without; with
        environments, before their reset (what reset adds is rendered at rollout time, `reset`)."""
        prompts = column(dataset, "prompt")
        if prompts and not is_conversation(prompts[0]):
            flag = "--tools" if self.environments is None else "--environment_factory"
            raise UsageError(
                f"{where}: {flag} needs conversational prompts (lists of messages), as TRL's tools."
            )
        names = [None] * len(prompts)
        if self.environments is not None:
            routes = column(dataset, "environment") if "environment" in dataset.column_names else None
            names = self.environments.route(routes, len(prompts), where)
        return [self.render(p, self.tools_of(name)) for p, name in zip(prompts, names)]

    def reset(self, rows: list[int], held_out: bool = False) -> list[list[int]]:
        """The prompt ids of one rollout per entry of `rows` (dataset rows of the training split, or with
        `held_out` the test split): each rollout's environment reset on its row, what reset returned joined to
        the prompt's last message (TRL's), rendered with the environment's tools."""
        prompts, names = self.environments.reset(rows, held_out)
        texts = [self.render(p, self.tools_of(name)) for p, name in zip(prompts, names)]
        return self.environments.fit(tokenize_prompts(self.tokenizer, texts))

    def longest(self, longest: int) -> int:
        """The longest sequence a sampler must take: `longest`, or with environments (whose reset lengthens the
        prompts) the model's positions."""
        if self.environments is None or self.environments.positions is None:
            return longest
        return max(longest, self.environments.positions)

    def continue_rollouts(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        logprobs: list[list[float]],
        sample_turn: Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]]]],
        max_completion_length: int,
        max_length: int | None = None,
    ) -> Rollout:
        """From each row's first sampled turn (ids cut after EOS, their logprobs) on: the tool calls, their
        answers and the next turns, until no call, --max_tool_calling_iterations rounds or the length limits
        (a completion of at most `max_completion_length` tokens; prompt + completion below `max_length`).
        `sample_turn(inputs, max_new_tokens)` samples one turn after each input: (ids cut after EOS, logprobs).
        With environments, row i is the rollout of the last `reset`'s environment i."""
        n = len(completion_ids)
        schemas, callables = [self.tools] * n, [self.by_name] * n
        if self.environments is not None:
            schemas, callables = self.environments.rollout_tools(self.tools)
        out = Rollout(
            completion_ids=[list(ids) for ids in completion_ids],
            tool_mask=[[1] * len(ids) for ids in completion_ids],
            logprobs=[list(map(float, lp)) for lp in logprobs],
            messages=[[] for _ in range(n)],
            turns=[1] * n,
        )
        last = [
            parse_turn(self.tokenizer, out.completion_ids[i], prompt_ids[i], schemas[i]) for i in range(n)
        ]
        for i in range(n):
            out.messages[i].append(last[i])
        active = [i for i in range(n) if last[i].get("tool_calls")] if self.calls_tools else []
        iteration = 0
        while active and iteration < self.max_iterations:
            calls = [last[i]["tool_calls"] for i in active]
            results = call_tools(calls, [callables[i] for i in active], self.timeout)
            out.calls += sum(map(len, results))
            out.failures += sum(r.failed for row in results for r in row)
            inputs, continuing = [], []
            for i, row in zip(active, results):
                answers = [{"role": "tool", "name": r.name, "content": r.content} for r in row]
                inserted = tool_answer_ids(self.tokenizer, answers)
                total = len(out.completion_ids[i]) + len(inserted)
                if total > max_completion_length or (
                    max_length is not None and len(prompt_ids[i]) + total >= max_length
                ):
                    continue  # the answer does not fit: the row ends with its call unanswered
                out.messages[i] += answers
                out.completion_ids[i] += inserted
                out.tool_mask[i] += [0] * len(inserted)
                out.logprobs[i] += [math.nan] * len(inserted)
                inputs.append(prompt_ids[i] + out.completion_ids[i])
                continuing.append(i)
            if not continuing:
                break
            room = [max_completion_length - len(out.completion_ids[i]) for i in continuing]
            if max_length is not None:
                room = [min(r, max_length - len(x)) for r, x in zip(room, inputs)]
            new_ids, new_logprobs = sample_turn(inputs, max(room))
            active = []
            for i, x, r, ids, lp in zip(continuing, inputs, room, new_ids, new_logprobs):
                ids, lp = list(ids)[:r], list(lp)[:r]
                out.completion_ids[i] += ids
                out.tool_mask[i] += [1] * len(ids)
                out.logprobs[i] += [float(v) for v in lp]
                out.turns[i] += bool(ids)
                message = parse_turn(self.tokenizer, ids, x, schemas[i]) if ids else {}
                if message:
                    out.messages[i].append(message)
                if message.get("tool_calls"):
                    active.append(i)
                    last[i] = message
            iteration += 1
        self.last = out
        return out

    @property
    def messages(self) -> list[list[dict]]:
        """The last rollout's messages per row: the completions TRL gives reward functions with tools."""
        return self.last.messages

    def reward_columns(self, rows: list[int]) -> dict[str, list]:
        """What reward functions get of the last rollout's `rows` beside the dataset's columns: the completions
        (turns and tool messages); with environments, the prompts after reset and the environments (TRL's
        `environments=`)."""
        out = {COMPLETION_MESSAGES: [self.last.messages[i] for i in rows]}
        if self.environments is not None:
            out["prompt"] = [self.environments.prompts[i] for i in rows]
            out["environments"] = [self.environments.current[i] for i in rows]
        return out

    def metrics(self, accelerator) -> dict[str, float]:
        """The last rollout's tools/ metrics over every process (see `metrics`); none without a tool (TRL's)."""
        return metrics(self.last, accelerator) if self.calls_tools else {}

    def continue_batch(
        self, generate, model, first_turn, width, temperature, chunk, generator, eos_ids, **knobs
    ):
        """A script's first turns, `first_turn` = (queries [P, Q] left-padded, query_mask, responses, lengths,
        logprobs [B, R]; row i of prompt i % P), continued with `generate` (utils.generation.generate's signature)
        on `model` -> (responses, lengths, response_mask, logprobs, tool_mask) [B, width] as the scripts' sample()
        returns them: the completion holds every turn and tool answer, lengths count its sampled tokens."""
        queries, query_mask, responses, lengths, logprobs = first_turn
        P, pad_id = queries.size(0), self.tokenizer.pad_token_id
        prompts = [queries[i % P][query_mask[i % P]].tolist() for i in range(responses.size(0))]
        sample_turn = turn_sampler(generate, model, eos_ids, pad_id, temperature, chunk, generator, **knobs)
        rollout = self.continue_rollouts(
            prompts,
            [row[:n] for row, n in zip(responses.tolist(), lengths.tolist())],
            [row[:n] for row, n in zip(logprobs.float().tolist(), lengths.tolist())],
            sample_turn,
            width,
            config_positions(getattr(inner_model(model), "config", None)),
        )
        responses, response_mask, tool_mask, logprobs = rollout.tensors(width, pad_id, queries.device)
        return responses, tool_mask.sum(1), response_mask, logprobs, tool_mask


def turn_sampler(
    generate: Callable, model, eos_ids, pad_id: int, temperature: float, chunk: int, generator, **knobs
):
    """`sample_turn` for continue_rollouts from a sampler of utils.generation.generate's signature (ours or the
    vLLM engine's): inputs left-padded, `max_new_tokens` sampled, each row cut after its first EOS."""

    def sample_turn(inputs: list[list[int]], max_new_tokens: int):
        device = eos_ids.device if isinstance(eos_ids, torch.Tensor) else None
        queries, query_mask = left_pad(inputs, pad_id, device)
        query_responses, logprobs = generate(
            model, queries, query_mask, max_new_tokens, temperature, chunk, generator, **knobs
        )
        responses, lengths = truncate_response(query_responses[:, queries.size(1) :], eos_ids, pad_id)
        lengths = lengths.tolist()
        return (
            [row[:n] for row, n in zip(responses.tolist(), lengths)],
            [row[:n] for row, n in zip(logprobs.float().tolist(), lengths)],
        )

    return sample_turn


def metrics(rollout: Rollout, accelerator) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failures per call), and
    tools/turns_mean (assistant turns per completion), over every process."""
    device = accelerator.device
    counts = torch.tensor(
        [rollout.calls, rollout.failures, sum(rollout.turns), len(rollout.turns)],
        device=device,
        dtype=torch.float,
    )
    calls, failures, turns, rows = accelerator.reduce(counts, "sum").tolist()
    return {
        "tools/call_frequency": calls / max(rows, 1),
        "tools/failure_frequency": failures / calls if calls else 0.0,
        "tools/turns_mean": turns / max(rows, 1),
    }


# ----------------------------------------------------------------------------------------------------------------
# Environments (--environment_factory)
# ----------------------------------------------------------------------------------------------------------------
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
