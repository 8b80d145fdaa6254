"""What the RL scripts share around a rollout: their prompts and reward functions, the queries of a batch, the
inputs its reward functions get, and the means of what they logged."""

from __future__ import annotations

from utils import data
from utils.chat import tokenize_prompts
from utils.generation import left_pad
from utils.loading import cut_prompts, fit_prompts
from utils.run import optional_module


def prompt_ids(args, tokenizer, dataset, eval_dataset, tools, completion, model, flag, completion_flag=""):
    """(train, test or None) prompt ids: each split's prompts rendered (with tools, their schemas too), tokenized,
    cut to --max_prompt_length and fit with `args.<completion>` tokens into the positions of `model`."""
    texts = data.prompt_texts if tools is None else tools.prompt_texts
    splits = [
        tokenize_prompts(tokenizer, texts(dataset, tokenizer, f"--dataset_name {args.dataset_name}")),
        None,
    ]
    if eval_dataset is not None:
        splits[1] = tokenize_prompts(tokenizer, texts(eval_dataset, tokenizer, "--dataset_test_split"))
    splits = cut_prompts(splits, args.max_prompt_length)
    return fit_prompts(splits, args, completion, model, flag, completion_flag)


def reward_fns(args, dataset, environments=None, rollout_func=None, flag="--reward_funcs") -> list:
    """The --reward_funcs (utils/reward_funcs.py, optional), checked against the columns they may read, then the
    environments' get_reward()s."""
    offered = [*dataset.column_names, *(["environments"] if environments else [])]  # TRL's environments=
    offered = None if rollout_func else offered  # its extra keys are known once it has run
    fns = []
    if args.reward_funcs:
        reward_funcs = optional_module("utils.reward_funcs", flag)
        fns = [reward_funcs.load_reward_fn(spec, offered) for spec in args.reward_funcs]
    return fns + (environments.rewards if environments else [])


def reward_rows(dataset, with_columns: bool) -> tuple[list | None, dict]:
    """A split's prompts as reward functions get them (the text or the messages) and, `with_columns`, its every
    column, e.g. a `solution`; (None, {}) without the split."""
    if dataset is None:
        return None, {}
    return data.column(dataset, "prompt"), data.columns(dataset) if with_columns else {}


def rollout_queries(run, prompt_ids, examples, k, held_out=False, state=None):
    """(queries, query_mask, rows, completions per query) to sample k completions of each of `examples`: their
    prompts [P, Q], k each; with --environment_factory one query per rollout [k * P, Q], completion-major, its
    environment reset on its row (utils/tools.py), one completion each; with --rollout_func the function's
    prompts, one per rollout, its completions kept for sampling. rows: each query's dataset row."""
    device = run.accelerator.device
    if run.rollout_func is not None:
        return *run.rollout_func.queries(run, examples, k, held_out, state), list(examples) * k, 1
    if run.tools is None or run.tools.environments is None:
        return *left_pad([prompt_ids[i] for i in examples], run.pad_id, device), examples, k
    rows = list(examples) * k
    return *left_pad(run.tools.reset(rows, held_out), run.pad_id, device), rows, 1


def reward_inputs(run, raw_prompts, columns, examples, idx) -> tuple[list | None, dict]:
    """(prompts, columns) the reward functions get for rows `idx` of a batch whose row i is dataset row
    examples[i % len(examples)]: with tools also the turns and tool messages (prompts after reset), with a
    rollout_func the keys it returned beside the ids (TRL's extra fields)."""
    P = len(examples)
    prompts = [raw_prompts[examples[i % P]] for i in idx.tolist()] if len(raw_prompts) else None
    columns = data.columns_of_rows(columns or {}, examples, idx)
    if run.tools is not None:
        columns.update(run.tools.reward_columns(idx.tolist()))
        prompts = columns.get("prompt", prompts)
    if run.rollout_func is not None:
        columns.update(run.rollout_func.reward_columns(idx.tolist()))
    return prompts, columns


def mean_over_processes(accelerator, logged: dict[str, float]) -> dict[str, float]:
    """The mean of each value reward functions logged (log_metric), over the processes that logged it."""
    from accelerate.utils import gather_object

    every = gather_object([logged]) if accelerator.num_processes > 1 else [logged]
    names = sorted({name for one in every for name in one})
    return {
        name: sum(one[name] for one in every if name in one) / sum(name in one for one in every)
        for name in names
    }


def logged_means(accelerator, scorers, prefix: str = "") -> dict[str, float]:
    """What the scorers' reward functions logged since the last call, each name's mean over the processes."""
    logged = mean_over_processes(accelerator, {k: v for s in scorers for k, v in s.take_logged().items()})
    return {prefix + name: value for name, value in logged.items()}
