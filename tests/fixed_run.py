"""Run a script with fixed completions and its weights recorded after every optimizer step, for the whole-update
tests: FIXED_COMPLETIONS=<counter dir> STEPS_OUT=<dir> python tests/fixed_run.py grpo.py --flags ...

`utils.generation.generate` returns tests/fixed_completions.py's completions (with their true logprobs under the
sampling temperature) instead of sampling; everything else is the script's own code, run as `__main__`."""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

import fixed_completions  # noqa: E402
import utils.generation  # noqa: E402
import utils.logprobs  # noqa: E402


@torch.no_grad()
def fixed_generate(model, queries, query_mask, response_length, temperature, chunk_size, generator=None):
    """utils.generation.generate's contract -> (query_responses [B, Q+R], logprobs [B, R]), no stop at EOS."""
    eos_id = model.config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    rows = []
    for ids, mask in zip(queries.tolist(), query_mask.bool().tolist()):
        prompt = [t for t, m in zip(ids, mask) if m]
        j = fixed_completions.next_index(os.environ["FIXED_COMPLETIONS"], prompt)
        rows.append(fixed_completions.completion(prompt, j, response_length, eos_id))
    responses = torch.tensor(rows, dtype=queries.dtype, device=queries.device).view(-1, response_length)
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask.long(), torch.ones_like(responses)], 1)
    logprobs = utils.logprobs.response_logprobs(
        model, query_responses, attention_mask, queries.size(1), temperature or 1.0
    )
    return query_responses, logprobs.float()


def main() -> None:
    import accelerate

    prepared = []
    original_prepare = accelerate.Accelerator.prepare

    def prepare(self, *objects, **kwargs):
        prepared.extend(o for o in objects if isinstance(o, torch.nn.Module))
        out = original_prepare(self, *objects, **kwargs)
        prepared.extend(
            o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.nn.Module)
        )
        return out

    accelerate.Accelerator.prepare = prepare
    utils.generation.generate = fixed_generate
    if os.environ.get("STEPS_OUT"):
        fixed_completions.StepRecorder(os.environ["STEPS_OUT"], candidates=lambda: prepared[::-1])
    script, *argv = sys.argv[1:]
    sys.argv = [script, *argv]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


if __name__ == "__main__":
    main()
