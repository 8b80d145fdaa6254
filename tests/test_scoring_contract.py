"""TRL 1.16's reward contract (utils/scoring.py): reward functions get TRL's keywords, TRL's own reward functions
give the same numbers through our scorer as through TRL's call, a None is NaN, log_metric / log_extra come back
through take_logged / take_extra, conversational prompts reach a reward model through its chat template exactly
as TRL renders them, and a broken reward-function file is one sentence.

"TRL's way" is built here independently of utils: the completion ids cut after the first EOS (as
GRPOTrainer._generate_single_turn does), decoded with batch_decode, the keywords of
GRPOTrainer._calculate_rewards, and for a reward model trl.data_utils.apply_chat_template + the reward tokenizer
with add_special_tokens=False and right padding.
"""

import asyncio
import re
import threading
from collections import defaultdict

import pytest
import torch
from test_reward_tokenizer import keyless_prompts, word_classifier, word_tokenizer

import utils.chat
import utils.generation
import utils.reward_funcs as reward_funcs
import utils.scoring as scoring

JUNK = 7  # a sampled token after the EOS, which truncation turns into padding


def sampled_rows(tokenizer, prompt_texts, completions, unfinished=()):
    """Rows as the RL scripts build them from `completions` sampled after `prompt_texts`: left-padded prompt ids,
    then each completion's ids, EOS and junk (no EOS for rows in `unfinished`, which fill the width), truncated
    after the EOS. Returns (query_responses, mask, context_length, sampled) with `sampled` the raw response ids
    before truncation, for TRL's own cut."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    queries, query_mask = utils.generation.left_pad(utils.chat.tokenize_prompts(tokenizer, prompt_texts), pad)
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    width = max(len(r) for r in ids) + 3
    sampled = [r + [JUNK] * (width - len(r)) if i in unfinished else r + [eos] for i, r in enumerate(ids)]
    sampled = [r + [JUNK] * (width - len(r)) for r in sampled]
    truncated, lengths = utils.generation.truncate_response(torch.tensor(sampled), eos, pad)
    mask = torch.cat([query_mask, utils.generation.lengths_to_mask(lengths, width)], 1)
    return torch.cat([queries, truncated], 1), mask, queries.size(1), sampled


def trl_completion_ids(sampled, eos):
    """TRL's completion_ids: each sampled row up to and including its first EOS, no padding."""
    return [row[: row.index(eos) + 1] if eos in row else list(row) for row in sampled]


def call_the_trl_way(fn, tokenizer, prompts, sampled, columns, trainer_state=None):
    """A reward function called as GRPOTrainer._calculate_rewards calls it. Returns (values with None as NaN,
    {metric: values}, {column: values})."""
    completion_ids = trl_completion_ids(sampled, tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    conversational = isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    metrics, extra = defaultdict(list), defaultdict(list)
    kwargs = {k: v for k, v in columns.items() if k not in ("prompt", "completion", "completion_ids")}
    kwargs.update(
        trainer_state=trainer_state,
        log_extra=lambda column, values: extra[column].extend(values),
        log_metric=lambda name, value: metrics[name].append(value),
    )
    values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    return [float("nan") if v is None else v for v in values], dict(metrics), dict(extra)


@pytest.fixture(scope="module")
def policy_tok(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "policy")


@pytest.fixture(scope="module")
def chat(world):
    """(tokenizer with a chat template and <|im_end|> as EOS, the reward model of its vocabulary)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(world / "reward_chat")
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    return tokenizer, AutoModelForSequenceClassification.from_pretrained(world / "reward_chat").eval()


COMPLETIONS = [" landlord rent", " dog dog dog dog dog", "", " boss salary promotion the a very", " cat"]


# ------------------------------------------------------------------------------------ TRL's own reward functions
@pytest.mark.parametrize(
    "factory, kwargs",
    [
        ("get_soft_overlong_punishment", {"max_completion_len": 5, "soft_punish_cache": 3}),
        ("get_repetition_penalty_reward", {"ngram_size": 2, "max_penalty": -1.0}),
    ],
)
def test_trls_token_id_rewards_give_trls_numbers(policy_tok, factory, kwargs):
    """Both read `completion_ids` only: their lengths (the EOS counted) and repeats must be TRL's."""
    import trl.rewards

    fn = getattr(trl.rewards, factory)(**kwargs)
    prompts = keyless_prompts(len(COMPLETIONS))
    rows, mask, context, sampled = sampled_rows(policy_tok, prompts, COMPLETIONS, unfinished={3})
    scorer = scoring.RewardScorer(None, None, policy_tok, reward_fn=fn)
    ours = scorer(rows, mask, context, 2, prompts=prompts, columns={"prompt": prompts})
    expected, _, _ = call_the_trl_way(fn, policy_tok, prompts, sampled, {"prompt": prompts})
    assert ours.dtype == torch.float32 and ours.tolist() == pytest.approx(expected)
    assert len(set(expected)) >= 3  # the rows really differ: lengths and repeats are read


def test_think_format_reward_on_conversational_completions(policy_tok):
    from trl.rewards import think_format_reward

    completions = [
        "<think>\nthe post is about rent\n</think>\nlandlord rent",
        "landlord <think> rent",
        " dog",
    ]
    messages = [[{"role": "user", "content": p}] for p in keyless_prompts(3, seed=1)]
    texts = [m[0]["content"] for m in messages]  # the policy's tokenizer has no template: the prompt's text
    rows, mask, context, sampled = sampled_rows(policy_tok, texts, completions)
    scorer = scoring.RewardScorer(None, None, policy_tok, reward_fn=think_format_reward)
    ours = scorer(rows, mask, context, 2, prompts=messages)
    expected, _, _ = call_the_trl_way(
        think_format_reward, policy_tok, messages, sampled, {"prompt": messages}
    )
    assert ours.tolist() == expected == [1.0, 0.0, 0.0]


def fake_math_verify(monkeypatch):
    """math_verify is not installed here (nor a dependency): TRL's accuracy_reward runs on stand-ins of its parse
    and verify, which read the numbers in a text (the gold \\boxed{n} or n; none: unparseable)."""
    import trl.rewards.accuracy_rewards as accuracy_rewards

    def parse(text, **_kwargs):
        return re.findall(r"-?\d+", text)

    monkeypatch.setattr(accuracy_rewards, "is_math_verify_available", lambda: True)
    monkeypatch.setattr(accuracy_rewards, "parse", parse, raising=False)
    monkeypatch.setattr(accuracy_rewards, "verify", lambda gold, answer, **_k: gold == answer, raising=False)
    monkeypatch.setattr(accuracy_rewards, "LatexExtractionConfig", lambda **_k: None, raising=False)
    monkeypatch.setattr(accuracy_rewards, "NormalizationConfig", lambda **_k: None, raising=False)
    return accuracy_rewards.accuracy_reward


def test_accuracy_reward_none_is_nan_and_its_extra_columns_come_back(policy_tok, monkeypatch):
    accuracy_reward = fake_math_verify(monkeypatch)
    completions = [" 12", " 7", " dog", " 3"]
    solutions = ["\\boxed{12}", "\\boxed{8}", "\\boxed{5}", "no number"]  # the last gold is unparseable: None
    messages = [[{"role": "user", "content": p}] for p in keyless_prompts(4, seed=2)]
    rows, mask, context, sampled = sampled_rows(policy_tok, [m[0]["content"] for m in messages], completions)
    columns = {"prompt": messages, "solution": solutions}
    scorer = scoring.RewardScorer(None, None, policy_tok, reward_fn=accuracy_reward)
    ours = scorer(rows, mask, context, 4, columns=columns)
    expected, _, extra = call_the_trl_way(accuracy_reward, policy_tok, messages, sampled, columns)
    assert ours[:3].tolist() == expected[:3] == [1.0, 0.0, 0.0]
    assert ours[3].isnan() and expected[3] != expected[3]
    assert scorer.take_extra() == extra and extra["solution"] == solutions
    assert scorer.take_extra() == {}


# ------------------------------------------------------------------------------------------------ the keywords
def test_trainer_state_columns_and_logs_reach_the_function(policy_tok):
    seen = []

    def shaped(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, "ids": completion_ids, **kwargs})
        log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
        log_extra("length", [len(c) for c in completions])
        return [trainer_state.epoch] * len(completions)

    prompts = keyless_prompts(3, seed=3)
    rows, mask, context, sampled = sampled_rows(policy_tok, prompts, [" dog", " cat vet", ""])
    columns = {"prompt": prompts, "facts": ["a", "b", "c"], "completion": ["x", "y", "z"]}
    scorer = scoring.RewardScorer(None, None, policy_tok, reward_fn=shaped)
    for step in (1, 3):
        state = scoring.TrainerState(global_step=step, max_steps=4, epoch=0.5 * step)
        assert (
            scorer(rows, mask, context, 2, columns=columns, trainer_state=state).tolist() == [0.5 * step] * 3
        )
    assert seen[0]["prompts"] == prompts and seen[0]["completions"] == [" dog", " cat vet", ""]
    assert seen[0]["ids"] == trl_completion_ids(sampled, policy_tok.eos_token_id)
    assert seen[0]["facts"] == ["a", "b", "c"] and "completion" not in seen[0]  # TRL drops it too
    assert scorer.take_logged() == {"progress": pytest.approx((0.25 + 0.75) / 2)}
    assert scorer.take_extra() == {"length": [4, 8, 0] * 2}
    assert scorer.take_logged() == {} and scorer.take_extra() == {}


def test_conversational_completion_is_one_assistant_message(policy_tok):
    seen = []

    def record(completions, **kwargs):
        seen.append(completions)
        return [0.0] * len(completions)

    messages = [[{"role": "user", "content": p}] for p in keyless_prompts(2, seed=4)]
    rows, mask, context, _ = sampled_rows(policy_tok, [m[0]["content"] for m in messages], [" dog", " cat"])
    scoring.RewardScorer(None, None, policy_tok, reward_fn=record)(rows, mask, context, 2, prompts=messages)
    assert seen == [[[{"role": "assistant", "content": " dog"}], [{"role": "assistant", "content": " cat"}]]]


def test_none_is_nan_and_a_wrong_length_is_an_error():
    assert utils.reward_funcs.call_reward_fn(
        lambda prompts, completions: [1.0, None], ["p", "q"], ["a", "b"]
    ).isnan().tolist() == [
        False,
        True,
    ]
    trl_style = utils.reward_funcs.call_reward_fn(lambda completions, **k: [None, 2], ["p", "q"], ["a", "b"])
    assert trl_style.isnan()[0] and trl_style[1] == 2.0 and trl_style.dtype == torch.float32
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        utils.reward_funcs.call_reward_fn(lambda completions, **k: [None], ["p", "q"], ["a", "b"])


# ------------------------------------------------------------------ bound by name, async, as TRL's own method
def by_answer(completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]


async def ids_length(completion_ids, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(ids)) for ids in completion_ids]


async def step_and_prompt(prompts, trainer_state, log_metric, **kwargs):
    log_metric("seen_step", trainer_state.global_step)
    return [len(p) / 100 + trainer_state.global_step for p in prompts]


def test_reward_functions_give_the_numbers_of_trls_calculate_rewards(world, policy_tok, tmp_path):
    """TRL's own GRPOTrainer._calculate_rewards and utils.scoring.score_rows on the same rows: a sync function
    reading a dataset column, two async ones (gathered on TRL's daemon loop and ours) reading ids and state."""
    import trl
    from datasets import Dataset

    prompts = keyless_prompts(4, seed=5)
    completions = [" 12 dog", " 7", "", " cat 3 vet"]
    answers = ["12", "8", "5", "3"]
    rows, mask, context, sampled = sampled_rows(policy_tok, prompts, completions, unfinished={2})
    funcs = [by_answer, ids_length, step_and_prompt]
    config = trl.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=2
    )
    dataset = Dataset.from_dict({"prompt": prompts, "answer": answers})
    trainer = trl.GRPOTrainer(str(world / "policy"), funcs, args=config, train_dataset=dataset)
    trainer.state.global_step = 3
    completion_ids = trl_completion_ids(sampled, policy_tok.eos_token_id)
    texts = policy_tok.batch_decode(completion_ids, skip_special_tokens=True)
    inputs = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)]
    expected = trainer._calculate_rewards(inputs, prompts, texts, completion_ids)

    scorers = [scoring.RewardScorer(None, None, policy_tok, reward_fn=fn) for fn in funcs]
    state = scoring.TrainerState(global_step=3, max_steps=10)
    columns = {"prompt": prompts, "answer": answers}
    ours = scoring.score_rows(scorers, rows, mask, context, 2, columns=columns, trainer_state=state)
    torch.testing.assert_close(ours, expected)
    assert ours[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0] and len(set(ours[:, 1].tolist())) > 2
    assert scorers[2].take_logged() == {"seen_step": 3.0}


def test_a_function_without_kwargs_gets_what_it_names(policy_tok):
    """`def correct(completions, answer)` gets the completions and its rows' answers by name (it used to get the
    prompts as completions); a required parameter that nothing passes is refused in one sentence, naming the
    columns."""
    seen = {}

    def correct(completions, answer):
        seen.update(completions=completions, answer=answer)
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    prompts = keyless_prompts(3, seed=6)
    rows, mask, context, _ = sampled_rows(policy_tok, prompts, [" 12", " 7", " dog"])
    columns = {"prompt": prompts, "answer": ["12", "8", "dog"]}
    scores = scoring.RewardScorer(None, None, policy_tok, reward_fn=correct)(
        rows, mask, context, 2, columns=columns
    )
    assert seen == {"completions": [" 12", " 7", " dog"], "answer": ["12", "8", "dog"]}
    assert scores.tolist() == [1.0, 0.0, 1.0]

    def needs_solution(completions, solution, scale=1.0):
        return [0.0] * len(completions)

    assert reward_funcs.check_reward_fn(correct, "f.py:correct", ["prompt", "answer"]) is correct
    with pytest.raises(ValueError, match=r"parameter 'solution' is none of .*here: prompt, answer\)\.$"):
        reward_funcs.check_reward_fn(needs_solution, "f.py:needs_solution", ["prompt", "answer"])
    with pytest.raises(ValueError, match="positional-only"):
        reward_funcs.check_reward_fn(lambda completions, /: [], "f.py:g", ["prompt"])
    with pytest.raises(ValueError, match="parameter 'solution' is none of"):  # at call time too (no columns)
        reward_funcs.call_reward_fn(needs_solution, ["p"], ["c"])


def test_an_async_function_runs_on_one_loop_kept_between_calls(policy_tok):
    """An `async def` reward function (TypeError before: a coroutine is not a list) is awaited on one event loop
    on a daemon thread, the same at every call, as TRL's; async ones of one batch wait together."""
    loops = []

    async def judge(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.2)
        return [float(len(c)) for c in completions]

    prompts = keyless_prompts(2, seed=7)
    rows, mask, context, _ = sampled_rows(policy_tok, prompts, [" dog", " cat vet"])
    scorers = [scoring.RewardScorer(None, None, policy_tok, reward_fn=judge) for _ in range(3)]
    assert reward_funcs.is_async(judge) and not reward_funcs.is_async(by_answer)
    start = __import__("time").perf_counter()
    scores = scoring.score_rows(scorers, rows, mask, context, 2, prompts=prompts)
    assert __import__("time").perf_counter() - start < 0.5  # 3 x 0.2 s one after the other would be 0.6 s
    assert scores.tolist() == [[4.0] * 3, [8.0] * 3]
    scorers[0](rows, mask, context, 2, prompts=prompts)
    assert len(loops) == 4 and len(set(map(id, loops))) == 1 and loops[0] is not None
    assert threading.current_thread() is threading.main_thread()


# -------------------------------------------------------------------------------- a reward model, TRL's rendering
def trl_reward_model_scores(model, tokenizer, prompts, completions):
    """GRPOTrainer._calculate_rewards for a reward model: render prompt + completion with the reward tokenizer's
    chat template, encode without special tokens, pad right, read logits[:, 0]. Returns (scores, ids)."""
    from trl.data_utils import apply_chat_template

    texts = [
        apply_chat_template({"messages": p + c}, tokenizer)["text"] for p, c in zip(prompts, completions)
    ]
    inputs = tokenizer(
        text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    with torch.no_grad():
        scores = model(**inputs).logits[:, 0]
    ids = [row[m.bool()].tolist() for row, m in zip(inputs["input_ids"], inputs["attention_mask"])]
    return scores, ids


def test_conversational_prompts_are_scored_on_trls_ids(chat):
    """The reward model shares the policy's tokenizer (the fast path before); with conversational prompts it now
    reads the conversation rendered by its template, as TRL does, not the policy's ids."""
    tokenizer, reward_model = chat
    messages = [
        [{"role": "system", "content": "Summarize."}, {"role": "user", "content": p}]
        for p in keyless_prompts(len(COMPLETIONS), seed=5)
    ]
    rendered = [
        tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages
    ]
    rows, mask, context, sampled = sampled_rows(tokenizer, rendered, COMPLETIONS, unfinished={3})
    scorer = scoring.RewardScorer(reward_model, tokenizer, tokenizer)
    assert scorer.same_tokenizer and "through its chat template" in scorer.describe()
    ours = scorer(rows, mask, context, 2, prompts=messages)

    texts = tokenizer.batch_decode(
        trl_completion_ids(sampled, tokenizer.eos_token_id), skip_special_tokens=True
    )
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    expected, trl_ids = trl_reward_model_scores(reward_model, tokenizer, messages, completions)
    assert ours.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    # each row alone, unpadded, through the model's own forward: the same numbers
    for score, ids in zip(ours.tolist(), trl_ids):
        with torch.no_grad():
            assert score == pytest.approx(
                reward_model(input_ids=torch.tensor([ids])).logits[0, 0].item(), abs=1e-5
            )
    assert scorer.encode(rows, mask, context, messages) == trl_ids
    # the raw prompts may also come as the dataset's prompt column
    assert torch.equal(scorer(rows, mask, context, 2, columns={"prompt": messages}), ours)
    # the policy's ids are not TRL's (the template's newline after <|im_end|>, the unfinished row's closed turn)
    policy_ids = [r[m.bool()].tolist() for r, m in zip(rows, mask)]
    assert all(p != t for p, t in zip(policy_ids, trl_ids))
    assert not torch.allclose(scorer(rows, mask, context, 2), ours)  # no prompts: the fast path, other scores


def test_text_prompts_differ_from_trl_by_the_eos_reward_py_trains_on(tokenizers_for_text):
    """On purpose: TRL scores the text prompt + completion without EOS; ours appends the reward tokenizer's EOS
    to a completion the policy finished (reward.py reads the score at that EOS), and to no other."""
    policy_tok, word_tok = tokenizers_for_text
    completions = [*COMPLETIONS, " car loan debt and so then but"]
    prompts = keyless_prompts(len(completions), seed=6)
    rows, mask, context, sampled = sampled_rows(policy_tok, prompts, completions, unfinished={5})
    scorer = scoring.RewardScorer(word_classifier(word_tok), word_tok, policy_tok)
    ours = scorer.encode(rows, mask, context, prompts)
    texts = policy_tok.batch_decode(
        trl_completion_ids(sampled, policy_tok.eos_token_id), skip_special_tokens=True
    )
    trl_ids = word_tok([p + c for p, c in zip(prompts, texts)], add_special_tokens=False)["input_ids"]
    eos = word_tok.eos_token_id
    assert ours[:5] == [ids + [eos] for ids in trl_ids[:5]] and ours[5] == trl_ids[5]


@pytest.fixture(scope="module")
def tokenizers_for_text(policy_tok):
    return policy_tok, word_tokenizer()


# -------------------------------------------------------------------------------------------- a broken file
def test_a_reward_file_that_fails_to_import_is_one_sentence(tmp_path, monkeypatch):
    (tmp_path / "broken_syntax.py").write_text("import os\n\ndef score(prompts, completions:\n    return 1\n")
    (tmp_path / "broken_body.py").write_text("X = 1\nraise RuntimeError('no GPU\\nhere')\n")
    monkeypatch.chdir(tmp_path)
    syntax = f"{tmp_path / 'broken_syntax.py'} line 3 has a SyntaxError ('(' was never closed)."
    body = f"{tmp_path / 'broken_body.py'} line 2 raised RuntimeError (no GPU) while being imported."
    for spec, sentence in [
        (f"{tmp_path / 'broken_syntax.py'}:score", syntax),
        ("broken_syntax.score", syntax),
        (f"{tmp_path / 'broken_body.py'}:score", body),
        ("broken_body.score", body),
    ]:
        with pytest.raises(ValueError) as error:
            utils.reward_funcs.load_reward_fn(spec)
        assert str(error.value) == f"--reward_fn {spec}: {sentence}"


def test_a_file_runs_once_whichever_flags_name_it(tmp_path):
    """Reward functions, a judge, a rollout_func and a tool of one file share its module (a tally kept in a dataclass
    under `from __future__ import annotations`, which a module missing from sys.modules cannot define), and
    the file runs once; an edited file at another path is another module."""
    import utils.rollout_func
    import utils.tools

    code = """from __future__ import annotations
from dataclasses import dataclass

@dataclass
class Tally:
    runs: int = 0
    calls: int = 0

TALLY = Tally(runs=1)

def first(completions, **kwargs):
    TALLY.calls += 1
    return [float(TALLY.calls)] * len(completions)

def second(completions, **kwargs):
    return [float(TALLY.calls + 10 * TALLY.runs)] * len(completions)

def judge(prompts, pairs):
    TALLY.calls += 1
    return [0] * len(pairs)

def rollout(prompts, trainer):
    TALLY.calls += 1
    return {}

def lookup(name: str) -> str:
    '''Look a name up.

    Args:
        name: the name
    '''
    TALLY.calls += 1
    return name
"""
    path = tmp_path / "shared.py"
    path.write_text(code)
    first = reward_funcs.load_reward_fn(f"{path}:first")
    second = reward_funcs.load_reward_fn(f"{path}:second")
    judge = reward_funcs.load_function(f"{path}:judge", "--judge")
    args = type("Args", (), dict(rollout_func=f"{path}:rollout", tools=None, environment_factory=None,
                                 use_vllm=False, filter_groups=False))()  # fmt: skip
    rollout = utils.rollout_func.RolloutFunc(args).fn
    (lookup,) = utils.tools.load_tools([f"{path}:lookup"])
    assert first(completions=["a"]) == [1.0] and judge([], [(1, 2)]) == [0] and rollout([], None) == {}
    assert lookup("x") == "x"
    assert second(completions=["a"]) == [14.0]  # four calls seen, the file run once
    other = tmp_path / "elsewhere" / "shared.py"
    other.parent.mkdir()
    other.write_text(code.replace("runs=1", "runs=2"))
    assert reward_funcs.load_reward_fn(f"{other}:second")(completions=["a"]) == [20.0]
