"""Multi-turn rollouts with tools (utils/tools.py, grpo.py --tools): the ids and the tool mask equal TRL 1.16's
`_tool_call_loop` on the same scripted turns; failures become tool messages; a grpo.py run calls its tools."""

import asyncio
import json
import shutil
import time
import types

import pytest
import torch

import utils.environments
import utils.reward_funcs
import utils.tools
from conftest import read_metrics, run_script

CALL = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'


def lookup(name: str) -> str:
    """Look up the code of a name.

    Args:
        name: the name whose code is wanted
    """
    return {"abcd": "dog", "wxyz": "cat"}.get(name, "none")


def broken(name: str) -> str:
    """A tool that raises.

    Args:
        name: anything
    """
    raise RuntimeError(f"no code for {name}")


ASYNC_LOOKUP = '''
import asyncio


async def lookup(name: str) -> str:
    """Look up the code of a name, after a while.

    Args:
        name: the name whose code is wanted
    """
    await asyncio.sleep(0.01)
    return {"abcd": "dog", "wxyz": "cat"}.get(name, "none")
'''


@pytest.fixture(scope="module")
def tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "tokenizer_tools")


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# The turns each row samples, in order (its first turn first); <E> is the EOS.
SCRIPTS = [
    [CALL % ("lookup", '{"name": "abcd"}') + "<E>", "dog<E>"],  # one call, then the answer
    ["dog<E>"],  # no call
    [CALL % ("nope", "{}") + "<E>", CALL % ("lookup", '{"name": "wxyz"}') + "<E>", "cat<E>"],  # unknown tool
    ['<tool_call>{"name": "lookup", "argu</tool_call><E>', "never sampled<E>"],  # malformed: plain text
    [CALL % ("lookup", '{"key": 1}') + "<E>", "none<E>"],  # bad arguments
    [
        CALL % ("lookup", '{"name": "abcd"}') + CALL % ("broken", '{"name": "x"}') + "<E>",
        "dog<E>",
    ],  # two calls
    [CALL % ("lookup", '{"name": "abcd"}') + "<E>"] * 12,  # calls until the length limit
    [
        CALL % ("lookup", '{"name": "abcd"}') + "<E>",
        "dog " * 200 + "<E>",
    ],  # the last turn runs past the budget
]


def scripted(tokenizer):
    """(first turns, a stand-in sampler of later turns, the inputs it saw): each row's next scripted turn, the
    row told apart by its prompt."""
    turns = [[encode(tokenizer, t.replace("<E>", tokenizer.eos_token)) for t in script] for script in SCRIPTS]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is the code of row {i}?"}],
            tools=[lookup, broken],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(len(SCRIPTS))
    ]
    taken, seen = [1] * len(SCRIPTS), []

    def next_turn(ids):
        row = next(i for i, p in enumerate(prompts) if ids[: len(p)] == p)
        seen.append((row, list(ids)))
        turn = turns[row][min(taken[row], len(turns[row]) - 1)]
        taken[row] += 1
        return turn

    return prompts, [t[0] for t in turns], next_turn, seen


def ours(tokenizer, max_completion_length=200, max_iterations=None, tools=(lookup, broken), max_length=256):
    prompts, first, next_turn, seen = scripted(tokenizer)

    def sample_turn(inputs, max_new_tokens):
        ids = [next_turn(x)[:max_new_tokens] for x in inputs]
        return ids, [[-0.5] * len(row) for row in ids]

    box = utils.tools.Tools(list(tools), tokenizer, timeout=5, max_iterations=max_iterations)
    logprobs = [[-0.5] * len(ids) for ids in first]
    rollout = box.continue_rollouts(prompts, first, logprobs, sample_turn, max_completion_length, max_length)
    return prompts, first, rollout, seen


def trl_loop(
    tokenizer, max_completion_length=200, max_iterations=None, tools=(lookup, broken), max_length=256
):
    """TRL 1.16's GRPOTrainer._tool_call_loop on the same scripted turns, on a stand-in trainer."""
    from fixed_completions import trl_without_vllm

    trl_without_vllm()
    from trl.chat_template_utils import parse_response
    from trl.trainer.grpo_trainer import GRPOTrainer

    prompts, first, next_turn, _ = scripted(tokenizer)
    fake = types.SimpleNamespace(
        processing_class=tokenizer, _tokenizer=tokenizer, _is_vlm=False, chat_template=None, chat_template_kwargs={},
        max_tool_calling_iterations=max_iterations if max_iterations is not None else 10**9,
        max_completion_length=max_completion_length, use_vllm=False, tools=list(tools), environment_factories=None,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=max_length)),
        _sync_tool_dicts=[{t.__name__: t for t in tools}] * len(prompts), _async_tool_dicts=[{}] * len(prompts),
    )  # fmt: skip
    fake._get_tool_suffix_ids = types.MethodType(GRPOTrainer._get_tool_suffix_ids, fake)
    fake._generate_single_turn = lambda ids, *a, **k: ([next_turn(x) for x in ids], None)
    messages = [[{"role": "user", "content": f"What is the code of row {i}?"}] for i in range(len(prompts))]
    completions = [
        [parse_response(tokenizer, ids, prefix=p, tools=list(tools))] for p, ids in zip(prompts, first)
    ]
    out = GRPOTrainer._tool_call_loop(
        fake, messages, prompts, [list(c) for c in first], completions, None, None, {}
    )
    tool_mask, completions, completion_ids, _, calls, failures, _ = out
    return completion_ids, tool_mask, completions, calls, failures


@pytest.mark.parametrize("budget,max_iterations", [(200, None), (200, 1), (120, None)])
def test_ids_mask_and_counts_equal_trls_tool_call_loop(tokenizer, budget, max_iterations):
    # positions to spare: TRL samples past the model's positions in a last turn (row 7), this does not
    _, _, rollout, _ = ours(tokenizer, budget, max_iterations, max_length=512)
    completion_ids, tool_mask, messages, calls, failures = trl_loop(
        tokenizer, budget, max_iterations, max_length=512
    )
    assert rollout.completion_ids == completion_ids
    assert rollout.tool_mask == tool_mask
    assert (rollout.calls, rollout.failures) == (calls, failures)
    assert rollout.messages == messages
    assert rollout.calls >= 5 and rollout.failures >= 2  # unknown tool, bad arguments (and a raise)
    assert all(len(ids) <= budget for ids in rollout.completion_ids)


def test_prefix_stability_every_turn_samples_after_the_ids_kept(tokenizer):
    """The input of each later turn is the prompt and the completion so far, unchanged; the completion is
    the turns sampled and the tool answers inserted, and the tool mask tells them apart."""
    prompts, first, rollout, seen = ours(tokenizer)
    for row, ids in seen:
        assert ids[: len(prompts[row])] == prompts[row]
        assert rollout.completion_ids[row][: len(ids) - len(prompts[row])] == ids[len(prompts[row]) :]
    for row, ids in enumerate(rollout.completion_ids):
        mask = rollout.tool_mask[row]
        assert ids[: len(first[row])] == first[row] and all(mask[: len(first[row])])
        assert len(mask) == len(ids) == len(rollout.logprobs[row])
        inserted = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        assert ("<|im_start|>tool" in inserted) == (0 in mask) and "<tool_call>" not in inserted
        assert all((lp != lp) == (not m) for lp, m in zip(rollout.logprobs[row], mask))  # NaN off the sampled
    responses, response_mask, tool_mask, logprobs = rollout.tensors(200, tokenizer.pad_token_id)
    assert (tool_mask <= response_mask).all() and tool_mask.sum() < response_mask.sum()
    assert responses[response_mask].tolist() == [t for ids in rollout.completion_ids for t in ids]
    assert rollout.turns == [2, 1, 3, 1, 2, 2, 3, 2]
    assert len(prompts[7]) + len(rollout.completion_ids[7]) == 256  # the model's positions, all used


def test_failures_are_tool_messages_and_counted(tokenizer):
    _, _, rollout, _ = ours(tokenizer)
    tool_messages = {i: [m for m in msgs if m["role"] == "tool"] for i, msgs in enumerate(rollout.messages)}
    assert tool_messages[2][0]["content"] == str({"error": "Tool nope not found."})
    assert "unexpected keyword argument 'key'" in tool_messages[4][0]["content"]
    assert tool_messages[5][1] == {
        "role": "tool",
        "name": "broken",
        "content": str({"error": "no code for x"}),
    }
    assert tool_messages[0] == [{"role": "tool", "name": "lookup", "content": "dog"}]
    assert rollout.messages[3] == [{"role": "assistant", "content": 'lookup", "argu'}] or not tool_messages[3]


def test_a_hanging_tool_times_out_and_the_rollout_goes_on(tokenizer):
    def hang(name: str) -> str:
        """Never answers in time.

        Args:
            name: anything
        """
        time.sleep(3)
        return "late"

    async def hang_async(name: str) -> str:
        """Never answers in time, asynchronously.

        Args:
            name: anything
        """
        await asyncio.sleep(3)
        return "late"

    calls = [
        [{"type": "function", "function": {"name": n, "arguments": {"name": "a"}}}]
        for n in ("hang", "hang_async")
    ]
    start = time.time()
    results = utils.tools.call_tools(calls, {"hang": hang, "hang_async": hang_async}, timeout=0.2)
    assert time.time() - start < 1.5
    assert [r[0].failed for r in results] == [True, True]
    assert "did not answer within 0.2 s" in results[0][0].content and "within 0.2 s" in results[1][0].content


def test_async_tools_answer_as_plain_ones(tokenizer):
    namespace = {}
    exec(ASYNC_LOOKUP, namespace)
    slow = namespace["lookup"]
    _, _, plain, _ = ours(tokenizer)
    _, _, awaited, _ = ours(tokenizer, tools=(slow, broken))
    assert awaited.completion_ids == plain.completion_ids and awaited.tool_mask == plain.tool_mask
    assert (awaited.calls, awaited.failures) == (plain.calls, plain.failures)


def test_loss_over_model_tokens_only(tokenizer):
    """grpo.py's loss with the tool mask equals the loss summed by hand over the sampled tokens: the tool
    answer's logprobs can be anything."""
    import grpo

    _, _, rollout, _ = ours(tokenizer)
    responses, response_mask, tool_mask, _ = rollout.tensors(200, tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(responses.shape, generator=g) * 3
    old = logprobs - 0.1 * torch.randn(responses.shape, generator=g)
    advantages = torch.randn(len(responses), generator=g)
    args = grpo.Args(loss_type="dapo")
    args.epsilon_high = args.epsilon
    loss = grpo.aggregate_loss(
        grpo.policy_token_loss(args, logprobs, old, advantages), tool_mask, "dapo", 120
    )
    changed = logprobs.masked_fill(~tool_mask, -50.0)
    loss_changed = grpo.aggregate_loss(
        grpo.policy_token_loss(args, changed, old, advantages), tool_mask, "dapo", 120
    )
    total, count = 0.0, 0
    for i in range(len(responses)):
        for t in range(responses.size(1)):
            if rollout.tool_mask[i][t : t + 1] == [1]:
                ratio = (logprobs[i, t] - old[i, t]).exp()
                a = advantages[i]
                total += -min(ratio * a, ratio.clamp(1 - args.epsilon, 1 + args.epsilon) * a)
                count += 1
    assert loss.item() == pytest.approx(total.item() / count, rel=1e-5)
    assert loss_changed.item() == pytest.approx(loss.item(), rel=1e-6)


def test_utils_tools_is_optional_for_grpo():
    import readability

    from conftest import ROOT

    assert "utils/tools.py" not in readability.footprint(ROOT, ROOT / "grpo.py")
    assert "utils/tools.py" in readability.optional(ROOT, ROOT / "grpo.py")


def test_a_tool_without_a_docstring_or_a_tokenizer_without_a_parser_is_refused(tmp_path, world):
    from transformers import AutoTokenizer

    (tmp_path / "t.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(ValueError, match="no JSON schema"):
        utils.tools.load_tools([f"{tmp_path}/t.py:f"])
    with pytest.raises(ValueError, match="does not render tool calls"):
        utils.tools.check_tokenizer(AutoTokenizer.from_pretrained(world / "tokenizer_chat"))
    no_parser = AutoTokenizer.from_pretrained(world / "tokenizer_tools")
    no_parser.response_template = None
    with pytest.raises(ValueError, match="no response_template"):
        utils.tools.check_tokenizer(no_parser)


# ------------------------------------------------------------------------------------------------ grpo.py --tools
TOOL_FILE = '''
import os, sys, time
sys.path.insert(0, os.environ["TINY_WORLD_CODE"])
from tiny_world import tool_code


def lookup(name: str) -> str:
    """Look up the code of a name.

    Args:
        name: the name whose code is wanted
    """
    if name == "boom":
        raise RuntimeError("boom")
    return tool_code(name)


def code_reward(completions, answer, **kwargs):
    said = [[m.get("content") or "" for m in c if m["role"] == "assistant"] for c in completions]
    turns = [len(c) for c in completions]
    return [float(code in s[-1].split()) + 0.01 * n for s, code, n in zip(said, answer, turns)]


class Book:
    """lookup as an environment: reset keeps the row's answer (and asks qrst to hurry), lookup counts its calls,
    get_reward pays 0.1 for a rollout that looked something up."""

    def reset(self, prompt, answer, **kwargs):
        self.answer, self.calls = answer, 0
        return " Quick!" if "qrst" in prompt[-1]["content"] else None

    def lookup(self, name: str) -> str:
        """Look up the code of a name.

        Args:
            name: the name whose code is wanted
        """
        self.calls += 1
        return globals()["lookup"](name)

    def get_reward(self):
        return 0.1 * min(self.calls, 1)


def book_reward(prompts, completions, environments, **kwargs):
    said = [[m.get("content") or "" for m in c if m["role"] == "assistant"] for c in completions]
    hurried = [float("Quick!" in p[-1]["content"]) for p in prompts]
    return [float(e.answer in s[-1].split()) + 0.01 * h for s, e, h in zip(said, environments, hurried)]
'''


@pytest.fixture(scope="module")
def tool_lab(world, tmp_path_factory):
    """policy/: the tiny world's tool policy taught (a few hundred steps here) to answer a question with a call
    of lookup, then a word; tools.py: lookup (raising on the name boom) and a reward on the last turn."""
    from transformers import AutoModelForCausalLM

    from utils.generation import pad

    out = tmp_path_factory.mktemp("tool_lab")
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(world / "tokenizer_tools")
    model = AutoModelForCausalLM.from_pretrained(world / "policy_tools")
    rows, starts = [], []
    for name in ["abcd", "boom", "wxyz", "qrst"]:
        conversation = [
            {"role": "user", "content": f"What is the code of {name}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"name": name}}}]},
            {"role": "tool", "name": "lookup", "content": "dog"},
            {"role": "assistant", "content": "dog"},
        ]  # fmt: skip
        rows.append(
            tokenizer.apply_chat_template(conversation, tools=[lookup], tokenize=True, return_dict=False)
        )
        prompt = tokenizer.apply_chat_template(
            conversation[:1], tools=[lookup], tokenize=True, return_dict=False, add_generation_prompt=True
        )
        starts.append(len(prompt))
    ids = pad(rows, tokenizer.pad_token_id)
    labels = ids.clone()
    for i, (row, start) in enumerate(zip(rows, starts)):
        labels[i, :start], labels[i, len(row) :] = -100, -100
    attention_mask = torch.arange(ids.size(1))[None] < torch.tensor([len(row) for row in rows])[:, None]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(150):  # the calls learnt by heart (loss about 0.01)
        model(ids, attention_mask=attention_mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    names = ["abcd", "boom", "wxyz", "qrst"] * 4
    with open(out / "prompts.jsonl", "w") as f:
        for name in names:
            prompt = [{"role": "user", "content": f"What is the code of {name}?"}]
            f.write(json.dumps({"prompt": prompt, "answer": "dog"}) + "\n")
    (out / "splits").mkdir()
    for split in ("train", "test"):  # the same rows, held out too
        shutil.copy(out / "prompts.jsonl", out / "splits" / f"{split}.jsonl")
    (out / "tools.py").write_text(TOOL_FILE)
    return out


def tool_run(lab, out, *extra, environment=False, script="grpo.py", check=True):
    """`script` (grpo.py, rloo.py) on the lab: --tools lookup and code_reward, or with `environment` Book and
    book_reward; a flag in `extra` overrides the one here (the last given counts)."""
    from conftest import ROOT

    tools = ["--tools", f"{lab}/tools.py:lookup", "--reward_funcs", f"{lab}/tools.py:code_reward"]
    data = ["--dataset_name", str(lab / "prompts.jsonl")]
    if environment:
        book = f"{lab}/tools.py"
        tools = ["--environment_factory", f"{book}:Book", "--reward_funcs", f"{book}:book_reward"]
        data = ["--dataset_name", str(lab / "splits"), "--dataset_test_split", "test", "--eval_steps", "2"]
    flags = [
        script, "--model_name_or_path", str(lab / "policy"), *data,
        *tools, "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "100",
        "--temperature", "0.5", "--learning_rate", "1e-4", "--max_steps", "4", "--num_sample_generations", "0",
        "--output_dir", str(out / "model"), "--logging_dir", str(out / "runs"), "--run_name", "r", "--seed", "3",
        "--max_tool_calling_iterations", "2", *extra,
    ]  # fmt: skip
    return run_script(
        flags, env={"TINY_WORLD_CODE": str(ROOT / "benchmark" / "tiny")}, timeout=600, check=check
    )


def test_grpo_with_tools_logs_tool_metrics_and_resumes_exactly(tool_lab, tmp_path):
    from conftest import weights

    tool_run(tool_lab, tmp_path / "whole", "--save_steps", "2", "--save_total_limit", "10")
    metrics = read_metrics(tmp_path / "whole" / "runs" / "r")
    assert all(
        {"tools/call_frequency", "tools/failure_frequency", "tools/turns_mean"} <= set(m) for m in metrics
    )
    assert max(m["tools/call_frequency"] for m in metrics) > 0.3  # the taught policy calls
    assert max(m["tools/failure_frequency"] for m in metrics) > 0  # the name boom raises
    assert max(m["tools/turns_mean"] for m in metrics) > 1
    checkpoint = str(tmp_path / "whole" / "model" / "checkpoint-2")
    tool_run(tool_lab, tmp_path / "again", "--save_steps", "2", "--resume_from_checkpoint", checkpoint)
    whole, resumed = weights(tmp_path / "whole" / "model"), weights(tmp_path / "again" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


# ------------------------------------------------------------------------------------- environments (TRL's contract)
class Vault:
    """An environment of the tests: `serial` counts the instances its factory made (the pool's order shows in the
    prompt, so that the scripted sampler tells every rollout apart); reset keeps the row's name, lookup answers
    for that name only and counts its calls; get_reward owns a reward."""

    def __init__(self, serial: int):
        self.serial, self.name, self.calls = serial, None, 0

    def reset(self, name, **kwargs):
        self.name, self.calls = name, 0
        return None if name == "qrst" else f" [vault {self.serial} keeps {name}]"

    def lookup(self, name: str) -> str:
        """Look up the code of a name.

        Args:
            name: the name whose code is wanted
        """
        self.calls += 1
        if name != self.name:
            raise ValueError(f"vault {self.serial} keeps no {name}")
        return {"abcd": "dog", "wxyz": "cat"}.get(name, "none")

    def get_reward(self) -> float:
        return 0.5 * self.calls

    @property
    def broken_property(self):
        raise RuntimeError("a property is never evaluated")


def vault_factory():
    """Vault(0), Vault(1), ...: each call a new instance, as a pool grows."""
    vault_factory.made = getattr(vault_factory, "made", -1) + 1
    return Vault(vault_factory.made)


def vault_reward(prompts, completions, environments, **kwargs):
    """Reads the environment (its name, its calls), the prompt after reset and the last turn."""
    return [
        float(e.name in p[-1]["content"]) + float({"abcd": "dog", "wxyz": "cat"}.get(e.name, "none") in str(c[-1]))
        + 0.25 * e.calls + 0.01 * len(p[-1]["content"])
        for p, c, e in zip(prompts, completions, environments)
    ]  # fmt: skip


ENV_NAMES = ["abcd", "wxyz", "qrst"]
# each rollout's turns by its vault's serial (rows 0, 1, 2, then again: serials 0-5, the probe first; qrst's two
# rollouts, whose reset adds nothing, share a script); {n}: the row's name
ENV_SCRIPTS = {
    0: [CALL % ("lookup", '{"name": "{n}"}') + "<E>", "dog<E>"],  # one call, the answer
    1: ["cat<E>"],  # no call
    3: [
        CALL % ("lookup", '{"name": "wxyz"}') + "<E>",
        CALL % ("lookup", '{"name": "{n}"}') + "<E>",
        "dog<E>",
    ],
    4: [CALL % ("lookup", '{"name": "{n}"}') + CALL % ("lookup", '{"name": "abcd"}') + "<E>", "cat<E>"],
    "qrst": [CALL % ("lookup", '{"name": "{n}"}') + "<E>"] * 3 + ['<tool_call>{"name": "lookup", "ar<E>'],
}


def env_next_turn(tokenizer):
    """next_turn(ids): the next scripted turn of the rollout whose ids these are, read from them alone (its
    vault's serial in the prompt, the turns it holds), so that TRL's loop and ours get the same turns."""
    import re

    def next_turn(ids):
        text = tokenizer.decode(ids)
        found = re.search(r"\[vault (\d+) keeps (\w+)\]", text)
        script, name = (
            (ENV_SCRIPTS[int(found.group(1))], found.group(2)) if found else (ENV_SCRIPTS["qrst"], "qrst")
        )
        turn = script[min(text.count("<|im_start|>assistant") - 1, len(script) - 1)]
        return encode(tokenizer, turn.replace("{n}", name).replace("<E>", tokenizer.eos_token))

    return next_turn


def env_dataset():
    from datasets import Dataset

    rows = [
        {"prompt": [{"role": "user", "content": f"What is the code of {n}?"}], "name": n} for n in ENV_NAMES
    ]
    return Dataset.from_list(rows)


ENV_ROWS = [0, 1, 2] * 2  # completion-major: two rollouts of each row


def positions(world):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(world / "policy_tools").max_position_embeddings


def ours_with_environments(world, tokenizer, max_iterations=2, budget=200):
    """utils.tools with Vault environments on the scripted turns, as grpo.py drives it: (prompt ids, rollout,
    rewards per function, environments)."""
    import utils.data
    import utils.scoring

    vault_factory.made = -1
    dataset = env_dataset()
    environments = utils.environments.Environments(
        {None: ("tests:vault_factory", vault_factory)}, [], utils.data.columns(dataset)
    )
    box = utils.tools.Tools(
        [], tokenizer, timeout=5, max_iterations=max_iterations, environments=environments
    )
    prompt_ids = box.reset(ENV_ROWS)
    next_turn = env_next_turn(tokenizer)
    first = [next_turn(p) for p in prompt_ids]

    def sample_turn(inputs, max_new_tokens):
        ids = [next_turn(x)[:max_new_tokens] for x in inputs]
        return ids, [[-0.5] * len(row) for row in ids]

    logprobs = [[-0.5] * len(ids) for ids in first]
    rollout = box.continue_rollouts(prompt_ids, first, logprobs, sample_turn, budget, positions(world))
    columns = utils.data.columns_of_rows(utils.data.columns(dataset), ENV_ROWS, torch.arange(len(ENV_ROWS)))
    columns.update(box.reward_columns(list(range(len(ENV_ROWS)))))
    rewards = [
        utils.reward_funcs.call_reward_fn(fn, None, None, columns)
        for fn in (vault_reward, *environments.rewards)
    ]
    return prompt_ids, rollout, torch.stack(rewards, 1), environments


def trl_with_environments(world, tokenizer, tmp_path, max_iterations=2, budget=200):
    """TRL 1.16's GRPOTrainer(environment_factory=vault_factory) on the same rows and scripted turns, through its
    own _generate_and_score_completions: (its output, what reached its rewards, its trainer)."""
    from fixed_completions import trl_without_vllm

    trl_without_vllm()
    import trl

    vault_factory.made = -1
    dataset = env_dataset()
    config = trl.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=len(ENV_ROWS),
        num_generations=2, max_completion_length=budget, max_tool_calling_iterations=max_iterations,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=str(world / "policy_tools"), processing_class=tokenizer, reward_funcs=vault_reward, args=config,
        train_dataset=dataset, environment_factory=vault_factory,
    )  # fmt: skip
    next_turn = env_next_turn(tokenizer)
    trainer._generate_single_turn = lambda ids, *args, **kwargs: ([next_turn(x) for x in ids], None)
    seen, calculate = {}, trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids):
        seen.update(prompts=prompts, completions=completions)
        seen["rewards"] = calculate(inputs, prompts, completions, completion_ids)
        return seen["rewards"]

    trainer._calculate_rewards = spy
    trainer.model.train()
    out = trainer._generate_and_score_completions([dataset[r] for r in ENV_ROWS])
    return out, seen, trainer


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")
@pytest.mark.parametrize("max_iterations,budget", [(2, 200), (None, 200), (None, 90)])
def test_environments_equal_trls_environment_factory(world, tokenizer, tmp_path, max_iterations, budget):
    """The prompts after reset and their ids, the completion ids, the tool mask, the messages, the rewards of a
    function reading the environments and of get_reward, and every environment's state after its rollout equal
    TRL's GRPOTrainer(environment_factory=...) on the same rows and scripted turns."""
    prompt_ids, rollout, rewards, environments = ours_with_environments(
        world, tokenizer, max_iterations, budget
    )
    out, seen, trainer = trl_with_environments(world, tokenizer, tmp_path, max_iterations, budget)
    assert environments.prompts == seen["prompts"]
    assert prompt_ids == [ids[m.bool()].tolist() for ids, m in zip(out["prompt_ids"], out["prompt_mask"])]
    lengths = out["completion_mask"].sum(1).tolist()
    assert rollout.completion_ids == [ids[:n].tolist() for ids, n in zip(out["completion_ids"], lengths)]
    assert rollout.tool_mask == [mask[:n].tolist() for mask, n in zip(out["tool_mask"], lengths)]
    assert rollout.messages == seen["completions"]
    assert torch.equal(rewards, seen["rewards"])
    states = lambda envs: [(e.serial, e.name, e.calls) for e in envs]  # noqa: E731
    assert states(environments.current) == states(trainer.environments)
    assert [e.serial for e in environments.current] == list(range(len(ENV_ROWS)))  # one instance a rollout
    metrics = trainer._metrics["train"]
    assert metrics["tools/call_frequency"] == [pytest.approx(rollout.calls / len(ENV_ROWS))]
    assert metrics["tools/failure_frequency"] == [pytest.approx(rollout.failures / rollout.calls)]
    assert rollout.failures >= 2  # another vault's name: the environments are apart
    assert "[vault 0 keeps abcd]" in environments.prompts[0][-1]["content"]
    assert environments.prompts[2] == env_dataset()[2]["prompt"]  # reset returned None: the row's prompt


def test_grpo_with_an_environment_factory_logs_its_rewards_and_resumes_exactly(tool_lab, tmp_path):
    """grpo.py --environment_factory: the environment's lookup is the tool, its get_reward a reward of its own
    (rewards/Book/mean), a reward function reads the environments and the prompt after reset; one environment
    per rollout, reset on its row, so a resume from a checkpoint is bit-exact with nothing more saved."""
    from conftest import weights

    tool_run(tool_lab, tmp_path / "whole", "--save_steps", "2", environment=True)
    metrics = read_metrics(tmp_path / "whole" / "runs" / "r")
    assert all(
        {"tools/call_frequency", "rewards/Book/mean", "rewards/book_reward/mean"} <= set(m) for m in metrics
    )
    assert max(m["tools/call_frequency"] for m in metrics) > 0.3
    assert max(m["rewards/Book/mean"] for m in metrics) > 0  # get_reward saw the calls
    assert max(m["rewards/book_reward/mean"] for m in metrics) > 0.5  # the answer, read from the environment
    held_out = [
        m for m in metrics if "eval/reward" in m
    ]  # the test split's rollouts, environments of their own
    assert len(held_out) == 2 and all(m["eval/rewards/Book/mean"] > 0 for m in held_out)
    checkpoint = str(tmp_path / "whole" / "model" / "checkpoint-2")
    resume = ["--save_steps", "2", "--resume_from_checkpoint", checkpoint]
    tool_run(tool_lab, tmp_path / "again", *resume, environment=True)
    whole, resumed = weights(tmp_path / "whole" / "model"), weights(tmp_path / "again" / "model")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


ENVIRONMENT_FILE = """
class NoReset:
    def lookup(self, name: str) -> str:
        '''Look up.

        Args:
            name: a name
        '''
        return name


class Raising:
    def reset(self, **kwargs):
        raise KeyError("no such row")


class Narrow:
    def reset(self, name):  # refuses the prompt column
        return None


class Undocumented:
    def reset(self, **kwargs):
        return None

    def lookup(self, name):
        return name


class Listing:
    def reset(self, **kwargs):
        return ["an image"]


class Broken:
    def __init__(self):
        raise OSError("no sandbox")


class Plain:
    def reset(self, **kwargs):
        return None


class Shelf(Plain):
    async def lookup(self, name: str) -> str:
        '''Look up, after a while.

        Args:
            name: a name
        '''
        return name

    def get_reward(self):
        return 1.0
"""


@pytest.mark.parametrize(
    "spec, says",
    [
        ("missing.py:Vault", "file missing.py does not exist"),
        ("{d}/envs.py:Absent", "defines no function named 'Absent'"),
        ("{d}/envs.py:NoReset", "NoReset has no reset method"),
        ("{d}/envs.py:Raising", "reset raised KeyError('no such row') on row 0 of --dataset_name"),
        ("{d}/envs.py:Narrow", "reset raised TypeError"),
        ("{d}/envs.py:Undocumented", "method lookup: no JSON schema"),
        (
            "{d}/envs.py:Listing",
            "reset returned list on row 0 of --dataset_name; it must return None or a string",
        ),
        ("{d}/envs.py:Broken", "making an instance raised OSError('no sandbox')"),
        ("{d}/envs.py:Plain", "pass a reward: --reward_funcs"),
        ("a={d}/envs.py:Plain {d}/envs.py:Plain", "several name=path/to/file.py:Class"),
        ("a={d}/envs.py:Plain b={d}/envs.py:Plain", "--dataset_name has no environment column"),
    ],
)
def test_bad_environments_are_one_sentence_before_any_model(tmp_path, spec, says):
    (tmp_path / "envs.py").write_text(ENVIRONMENT_FILE)
    args = types.SimpleNamespace(
        environment_factory=spec.format(d=tmp_path).split(), reward_funcs=None, reward_model_path=None,
        max_prompt_length=None, context_overflow="refuse", max_completion_length=8, model_name_or_path=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(ValueError, match="^[^\n]*$") as caught:  # one line
        utils.environments.load_environments(args, [], env_dataset())
    assert says in str(caught.value)


def test_environments_routed_by_row_and_checked_against_the_tools(tmp_path):
    """TRL's dict of factories: each row's environment column picks one (an unknown name is refused); a method
    named as a --tools function is refused (a call names its tool); each row's prompt has its own tools."""
    from datasets import Dataset

    (tmp_path / "envs.py").write_text(ENVIRONMENT_FILE)
    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "environment": e} for i, e in enumerate("abba")
    ]
    args = types.SimpleNamespace(
        environment_factory=[f"a={tmp_path}/envs.py:Plain", f"b={tmp_path}/envs.py:Shelf"], reward_funcs=["f"],
        reward_model_path=None, max_prompt_length=None, context_overflow="refuse", max_completion_length=8,
        model_name_or_path=str(tmp_path),
    )  # fmt: skip
    environments = utils.environments.load_environments(args, [], Dataset.from_list(rows))
    assert [t.__name__ for t in environments.tools["a"]] == [] and [
        t.__name__ for t in environments.tools["b"]
    ] == ["lookup"]
    prompts, names = environments.reset([0, 1, 2, 3, 1])
    assert names == list("abbab") and [type(e).__name__ for e in environments.current] == [
        "Plain",
        "Shelf",
        "Shelf",
        "Plain",
        "Shelf",
    ]
    assert len({id(e) for e in environments.current}) == 5  # one instance a rollout, each of its row's class
    with pytest.raises(ValueError, match="environment='c', which is none of --environment_factory's a, b"):
        utils.environments.load_environments(
            args, [], Dataset.from_list(rows + [{**rows[0], "environment": "c"}])
        )
    assert environments.rewards[0](environments=environments.current) == [None, 1.0, 1.0, None, 1.0]
    with pytest.raises(ValueError, match="two tools have the same name"):
        utils.environments.load_environments(args, [lookup], Dataset.from_list(rows))
    args.environment_factory.append(f"c={tmp_path}/envs.py:Shelf")  # two names of one class: one reward
    assert [
        r.__name__ for r in utils.environments.load_environments(args, [], Dataset.from_list(rows)).rewards
    ] == ["Shelf"]


def test_grpo_refuses_a_bad_environment_in_one_line_and_a_copy_without_utils_tools_names_it(world, tmp_path):
    """grpo.py --environment_factory with a reset that raises exits 2 with one line and no traceback, before
    any model is loaded; a copy of grpo.py with its core alone says which file to copy."""
    import readability

    from conftest import ROOT

    (tmp_path / "envs.py").write_text(ENVIRONMENT_FILE)
    env_dataset().to_json(tmp_path / "rows.jsonl")
    flags = [
        "--model_name_or_path", str(world / "policy_tools"), "--dataset_name", str(tmp_path / "rows.jsonl"),
        "--reward_funcs", f"{ROOT}/benchmark/tiny/tiny_tools.py:code_reward", "--output_dir", str(tmp_path / "out"),
        "--environment_factory", f"{tmp_path}/envs.py:Raising",
    ]  # fmt: skip
    proc = run_script(["grpo.py", *flags], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"grpo.py: error: --environment_factory {tmp_path}/envs.py:Raising: reset raised KeyError('no such row') "
        "on row 0 of --dataset_name."
    )
    copy = tmp_path / "copy"
    (copy / "utils").mkdir(parents=True)
    for module in ["grpo.py", *readability.footprint(ROOT, ROOT / "grpo.py")]:
        shutil.copy(ROOT / module, copy / module)
    proc = run_script(["grpo.py", *flags], cwd=copy, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("grpo.py: error: --environment_factory needs utils/tools.py, which this copy lacks")
    )


def test_tiny_tools_environment_and_demonstrations_are_what_grpo_samples_from(world, tmp_path):
    """benchmark/tiny/tiny_tools.py: CodeDesk, reset on its row, answers the row's code with a tool of no
    argument; the benchmark's demonstrations start from the prompts grpo.py renders (lookup's or CodeDesk's
    schema), a share --call_rate of first turns call, and each skill demonstration continues the conversation
    a call makes."""
    import datasets
    import tiny_tools

    from conftest import ROOT

    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(world / "tokenizer_tools")
    every = datasets.load_from_disk(world / "dataset_tools")["train"]
    args = types.SimpleNamespace(
        environment_factory=[f"{ROOT}/benchmark/tiny/tiny_tools.py:CodeDesk"], reward_funcs=["code_reward"],
        reward_model_path=None, max_prompt_length=None, context_overflow="refuse", max_completion_length=80,
        model_name_or_path=str(world / "policy_tools"),
    )  # fmt: skip
    desk = utils.tools.Tools(
        [], tokenizer, environments=utils.environments.load_environments(args, [], every)
    )
    desk_ids = desk.reset([0, 1])
    assert [e.code() for e in desk.environments.current] == every["answer"][:2]
    assert "Tools: code()" in tokenizer.decode(desk_ids[0])
    (tmp_path / "world").symlink_to(world)
    for tool, rendered in (
        ("lookup", utils.tools.Tools([tiny_tools.lookup], tokenizer)),
        ("environment", desk),
    ):
        tiny_tools.demonstrations(tiny_tools.Args(work_dir=str(tmp_path), call_rate=0.5, tool=tool))
        demos = [json.loads(line) for line in open(tmp_path / "demos" / "train.jsonl")]
        assert [d["prompt"] for d in demos[::3]] == rendered.prompt_texts(every, tokenizer, "train")
        calls = [d["completion"].startswith("<tool_call>") for d in demos[::3]]
        assert 0.4 < sum(calls) / len(calls) < 0.6  # --call_rate
        arguments = {"lookup": '{{"name": "{}"}}', "environment": "{{}}"}[tool]
        for first, call, answer, name in zip(demos[::3], demos[1::3], demos[2::3], every["name"]):
            assert call["prompt"] == first["prompt"] + "<tool_call>" and call["completion"].endswith(
                "<|im_end|>"
            )
            assert f'"arguments": {arguments.format(name)}' in call["completion"]
            assert answer["prompt"].startswith(call["prompt"] + call["completion"])
            assert answer["completion"] == tiny_tools.lookup(name) + "<|im_end|>"
