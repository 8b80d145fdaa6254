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

With --environment_factory (utils/environments.py, which builds on this file), every rollout also gets its own
environment, whose methods are its tools:

    tools = utils.tools.Tools(tool_fns, tokenizer, environments=environments)
    prompt_ids = tools.reset(rows)                                     # one prompt per rollout, after reset
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from utils.chat import tokenize_prompts
from utils.context import config_positions
from utils.data import column, is_conversation
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
        environments=None,  # utils/environments.py's Environments (--environment_factory)
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
