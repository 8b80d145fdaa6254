"""TRL 1.16's `rollout_func` for grpo.py (optional: imported only with --rollout_func): a loop of the user's own
samples every rollout, and grpo.py trains on what it returns.

    def my_rollout(prompts: list, trainer) -> dict:
        ...
        return {"prompt_ids": [...], "completion_ids": [...], "logprobs": [...], "env_mask": [...], "hint": [...]}

- `prompts`: this process's batch of dataset prompts (text or messages, as in the dataset), each repeated
  num_generations times in a row (num_generations_eval on held-out prompts): TRL's sampler repeats them before its
  call. Every list returned holds one entry per prompt, in that order; row p * G + g of a call is rollout
  g * P + p of grpo.py's completion-major batch.
- `prompt_ids`, `completion_ids`: the ids trained on, as returned (no cut after an EOS: multi-turn completions
  keep theirs); `logprobs`: the sampling logprobs of the completion's ids (None: unknown, NaN), which TRL reads
  in --off_policy_mask_threshold's KL, never as the old logprobs of the ratio (those are the policy's);
- `env_mask` (optional): 1 on the model's tokens, 0 on inserted ones (an environment's answers), multiplied into
  the loss mask as the tool mask is; the other keys reach the reward functions by name, a list one value per
  rollout, or one value for all.
- `trainer`: a RolloutContext (TRL passes its GRPOTrainer, which grpo.py does not have).

Each call runs with torch's, NumPy's and Python's global random generators seeded by (--seed, the optimizer step,
the process) (held out: by its first prompt, as the evaluation's noise is) and restored after, as our sampler's
noise is keyed: a resume replays it, and neither evaluating nor anything else that draws moves it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from utils.evaluation import EVAL_KEY
from utils.generation import left_pad, pad, sampling_generator
from utils.reward_funcs import NOT_PASSED_COLUMNS, load_function
from utils.run import UsageError, bare
from utils.scoring import TrainerState

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
MASK = "env_mask"


@dataclass
class RolloutContext:
    """What a rollout_func gets for TRL's `trainer`: the attributes of GRPOTrainer it reads most, by TRL's names."""

    args: object  # grpo.py's Args, whose flags are GRPOConfig's names
    processing_class: object  # the policy's tokenizer
    model: torch.nn.Module  # the policy being trained (outside DDP / DeepSpeed's wrapper)
    accelerator: object
    state: TrainerState  # global_step, max_steps, epoch
    num_generations: int
    num_generations_eval: int
    max_completion_length: int
    temperature: float


def check_args(args) -> None:
    """Refuse the flags --rollout_func cannot take, in one sentence, before any model is loaded."""
    clash = [
        flag
        for flag in ("tools", "environment_factory", "use_vllm", "filter_groups")
        if getattr(args, flag, None)
    ]
    if clash:
        raise UsageError(
            f"--rollout_func samples every rollout in your own loop, so leave out --{clash[0]} (do tool calls "
            "or a vLLM engine inside the function; --filter_groups would rebuild its prompts from the dataset)."
        )


class RolloutFunc:
    """grpo.py's hook: `queries` calls the function on a batch and keeps its rollouts, `tensors` gives them as
    sample() does, `reward_columns` the extra keys of the rows the reward functions score."""

    def __init__(self, args):
        check_args(args)
        self.args, self.spec = args, args.rollout_func
        self.fn = load_function(args.rollout_func, "--rollout_func")
        self.last: dict = {}

    def queries(self, run, examples, k: int, held_out: bool, state: TrainerState | None):
        """(queries, query_mask) [k * P, Q], one per rollout, completion-major: the function's prompt ids for
        `examples` (dataset rows; held out: of the test split), each asked k times."""
        raw = run.eval_raw_prompts if held_out else run.raw_prompts
        P, model = len(examples), bare(run.policy)
        prompts = [copy.deepcopy(raw[i]) for i in examples for _ in range(k)]  # TRL's order: prompt-major
        context = RolloutContext(
            self.args, run.tokenizer, model, run.accelerator, state or TrainerState(), self.args.num_generations,
            self.args.num_generations_eval, self.args.max_completion_length, self.args.temperature,
        )  # fmt: skip
        rank = run.accelerator.process_index
        key = (EVAL_KEY, examples[0]) if held_out else (1 + context.state.global_step, rank)  # updates from 1
        training = model.training
        model.train(not held_out)  # TRL's model is in training mode but in its evaluation
        try:
            with seeded(sampling_generator(self.args.seed, *key).initial_seed(), context):
                output = self.fn(prompts, context)
        finally:
            model.train(training)
        output = self.check(output, len(prompts))
        order = [p * k + g for g in range(k) for p in range(P)]  # grpo.py's row g * P + p
        self.last = {name: None if v is None else [v[i] for i in order] for name, v in output.items()}
        return left_pad(self.last["prompt_ids"], run.pad_id, run.accelerator.device)

    def check(self, output, n: int) -> dict[str, list]:
        """The function's output as lists of n entries (a value that is not a list: the same for every rollout);
        anything TRL's contract does not allow is one sentence naming what is wrong."""
        where = f"--rollout_func {self.spec}"
        if not isinstance(output, Mapping):
            raise UsageError(
                f"{where} returned a {type(output).__name__}, not a dict of {', '.join(REQUIRED)}."
            )
        missing = [key for key in REQUIRED if key not in output]
        if missing:
            raise UsageError(
                f"{where} returned no {', '.join(missing)}; a rollout_func returns {', '.join(REQUIRED)}."
            )
        out = {}
        for name, values in output.items():
            if name == "logprobs" and values is None:  # TRL's: unknown, the old logprobs stand in
                out[name] = None
            elif name in REQUIRED or name == MASK or isinstance(values, list):
                if not isinstance(values, (list, tuple)) or len(values) != n:
                    size = (
                        f"{len(values)} entries"
                        if isinstance(values, (list, tuple))
                        else type(values).__name__
                    )
                    raise UsageError(
                        f"{where}: {name} has {size} for the {n} prompts it was given (each of the batch's prompts "
                        "repeated num_generations times: one entry each)."
                    )
                out[name] = [list(v) if name in (*REQUIRED, MASK) else v for v in values]
            else:
                out[name] = [values] * n
        for i, ids in enumerate(out["completion_ids"]):
            if not ids or len(ids) > self.args.max_completion_length:
                raise UsageError(
                    f"{where}: completion_ids[{i}] has {len(ids)} ids; each must have 1 to --max_completion_length "
                    f"{self.args.max_completion_length}."
                )
            for name in ("logprobs", MASK):
                if out.get(name) is not None and len(out[name][i]) != len(ids):
                    raise UsageError(
                        f"{where}: {name}[{i}] has {len(out[name][i])} values for the {len(ids)} ids of "
                        f"completion_ids[{i}]."
                    )
        return out

    def tensors(self, width: int, pad_id: int, device):
        """The last call's (responses, lengths, response_mask, logprobs, tool_mask) [B, width], as sample()
        returns them: tool_mask is env_mask (all 1 without it); lengths count its 1s (TRL's with env_mask);
        logprobs None where the function returned None."""
        completions = self.last["completion_ids"]
        responses = pad(completions, pad_id, width=width)
        response_mask = pad([[True] * len(ids) for ids in completions], False, width=width, dtype=torch.bool)
        tool_mask = (
            pad(self.last[MASK], False, width=width, dtype=torch.bool)
            if MASK in self.last
            else response_mask.clone()
        )
        logprobs = None
        if self.last["logprobs"] is not None:
            sampled = [[math.nan if x is None else x for x in row] for row in self.last["logprobs"]]
            logprobs = pad(sampled, 0.0, width=width, dtype=torch.float)  # TRL pads with 0; None is NaN
        out = responses, tool_mask.sum(1), response_mask, logprobs, tool_mask
        return tuple(t if t is None else t.to(device) for t in out)

    def reward_columns(self, rows: list[int]) -> dict[str, list]:
        """The extra keys of the last call at `rows`, by name, for the reward functions (TRL's extra fields)."""
        extra = [name for name in self.last if name not in (*REQUIRED, MASK, *NOT_PASSED_COLUMNS)]
        return {name: [self.last[name][i] for i in rows] for name in extra}


@contextlib.contextmanager
def seeded(seed: int, context: RolloutContext):
    """torch's (the accelerator's too), NumPy's and Python's global random generators seeded by `seed`, their
    states restored after."""
    state, numpy_state = random.getstate(), np.random.get_state()
    device = context.accelerator.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(state)
            np.random.set_state(numpy_state)
