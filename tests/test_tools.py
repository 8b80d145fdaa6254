"""Multi-turn rollouts with tools (utils/tools.py, grpo.py --tools): the ids and the tool mask equal TRL 1.16's
`_tool_call_loop` on the same scripted turns; failures become tool messages; a grpo.py run calls its tools."""

import asyncio
import json
import time
import types

import pytest
import torch

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
    (out / "tools.py").write_text(TOOL_FILE)
    return out


def tool_run(lab, out, *extra):
    from conftest import ROOT

    flags = [
        "grpo.py", "--model_name_or_path", str(lab / "policy"), "--dataset_name", str(lab / "prompts.jsonl"),
        "--tools", f"{lab}/tools.py:lookup", "--reward_funcs", f"{lab}/tools.py:code_reward",
        "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "100",
        "--temperature", "0.5", "--learning_rate", "1e-4", "--max_steps", "4", "--num_sample_generations", "0",
        "--output_dir", str(out / "model"), "--logging_dir", str(out / "runs"), "--run_name", "r", "--seed", "3",
        "--max_tool_calling_iterations", "2", *extra,
    ]  # fmt: skip
    return run_script(flags, env={"TINY_WORLD_CODE": str(ROOT / "benchmark")}, timeout=600)


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
