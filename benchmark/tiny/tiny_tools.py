"""The tiny world's tool task (benchmark/tiny/tiny_world.py writes dataset_tools/): its tool, its reward, the task
as an environment, and a benchmark in which grpo.py teaches a policy that seldom uses its tool to use it.

    python grpo.py --model_name_or_path tiny_world/policy_tools --dataset_name tiny_world/dataset_tools \
        --tools benchmark/tiny/tiny_tools.py:lookup --reward_funcs benchmark/tiny/tiny_tools.py:code_reward ...
    python grpo.py ... --environment_factory benchmark/tiny/tiny_tools.py:CodeDesk \
        --reward_funcs benchmark/tiny/tiny_tools.py:code_reward

The benchmark (`python benchmark/tiny/tiny_tools.py`): the world; demonstrations from its train split, a share
`--call_rate` of which call the tool and then say its answer, the others answering at once with a key word (a guess:
the code is a hash of the name, which only the tool knows), and, for every question, the skills of a call without
the choice to make one (the call after its opening, the answer after the tool's); sft.py on them, so that the start
policy knows how to use the tool but seldom does and is rarely right; grpo.py from there, evaluated on the held-out
names (no test name is in train) before the first step and every `--eval_steps`. `--tool environment` (the default)
trains with CodeDesk, `--tool lookup` with lookup(name), whose calls must copy the name; `--trainer rloo` trains
with rloo.py instead (TRL 1.16's flags, the same sizes). Writes benchmark/results/{grpo,rloo}_tools.json: the
commands, each stage's wall and CPU seconds, the held-out and training rewards and call frequencies over the steps.
"""

import functools
import json
import os
import random
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_world import KEY_WORDS, tool_code  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------------------------------------------
# The task (loaded by grpo.py as benchmark/tiny/tiny_tools.py:...; the file must stay loadable as a bare
# module)
# ----------------------------------------------------------------------------------------------------------------
def lookup(name: str) -> str:
    """Look up the code of a name.

    Args:
        name: the name whose code is wanted
    """
    return tool_code(name.strip())


def code_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the last assistant turn names the name's code (which only the tool knows) and no other key word,
    else 0."""
    rewards = []
    for messages, code in zip(completions, answer):
        turns = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
        named = set(turns[-1].split()) & set(KEY_WORDS) if turns else set()
        rewards.append(float(named == {code}))
    return rewards


class CodeDesk:
    """The task as an environment (--environment_factory benchmark/tiny/tiny_tools.py:CodeDesk): one per rollout,
    reset on its row, so it knows the name asked and its tool takes no argument: the name need not be copied into
    a call."""

    def reset(self, name, **kwargs):
        self.name = name

    def code(self) -> str:
        """The code of the name asked."""
        return tool_code(self.name)


# ----------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Args:
    work_dir: str = "benchmark/work_tools"
    """world, demonstrations, models, logs and TensorBoard runs go here"""
    seed: int = 1
    """seed of the demonstrations, SFT and GRPO (the world's is 0)"""
    num_train: int = 2000
    """questions in the world's tool train split (tiny_world.py --num_sft)"""
    num_test: int = 200
    """held-out questions, names never seen in train (tiny_world.py --num_test)"""
    call_rate: float = 0.1
    """share of the questions whose first turn calls the tool; the others guess a key word at once"""
    sft_steps: int = 2000
    """SFT optimizer steps of batch 32 (at 1000 the policy copied the tool's code about half the time)"""
    trainer: Literal["grpo", "rloo"] = "grpo"
    """the RL script trained from the SFT policy (rloo.py with TRL 1.16's flags: --num_generations, --beta...)"""
    grpo_steps: int = 100
    """RL optimizer steps, one generation (an RLOO update) each"""
    prompts_per_step: int = 8
    """prompts per generation"""
    group_size: int = 8
    """completions per prompt (--num_generations)"""
    max_completion_length: int = 80
    """tokens of a completion: a call (about 45 with lookup's name), the tool's answer, the answer"""
    learning_rate: float = 3e-4
    """GRPO learning rate (1e-3 rose faster, then collapsed)"""
    temperature: float = 0.7
    """sampling temperature, in training and in the held-out evaluation"""
    eval_steps: int = 10
    """held-out evaluation every this many steps (and before the first)"""
    threads: int = 1
    """OMP threads per stage (1: a stage sharing its cores slows less)"""
    tool: Literal["environment", "lookup"] = "environment"
    """environment: --environment_factory CodeDesk (code(), no argument); lookup: --tools lookup(name)"""
    results: str | None = None
    """prefix of the .json written; None: benchmark/results/{trainer}_tools"""


def demonstrations(args: Args) -> None:
    """{work_dir}/demos/{train,test}.jsonl: prompt-completion texts, each prompt rendered with the tool's schema as
    grpo.py renders it. Per question: its first turn, which a share `call_rate` of the questions answer with a call
    and then the code, the rest with a key word drawn at random (a guess); and the skills of a call without the
    choice to make one, from prompts that already hold the call's opening (lookup's name to copy) or the tool's
    answer (the code to copy)."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.work_dir, "world", "tokenizer_tools"))
    rng = random.Random(args.seed)
    out = os.path.join(args.work_dir, "demos")
    os.makedirs(out, exist_ok=True)
    tool = lookup if args.tool == "lookup" else CodeDesk().code
    render = functools.partial(tokenizer.apply_chat_template, tools=[tool], tokenize=False)
    for split in ("train", "test"):
        rows = datasets.load_from_disk(os.path.join(args.work_dir, "world", "dataset_tools"))[split]
        demos = []
        for prompt, name in zip(rows["prompt"], rows["name"]):
            arguments = {"name": name} if args.tool == "lookup" else {}
            call = {"type": "function", "function": {"name": tool.__name__, "arguments": arguments}}
            called = [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "name": tool.__name__, "content": tool_code(name)}]  # fmt: skip
            text = render(prompt, add_generation_prompt=True)
            answered = prompt + called + [{"role": "assistant", "content": tool_code(name)}]
            whole = render(answered).rstrip()  # no newline after the last EOS
            answer_at = len(render(prompt + called, add_generation_prompt=True))
            guess = render(prompt + [{"role": "assistant", "content": rng.choice(KEY_WORDS)}]).rstrip()
            first = whole if rng.random() < args.call_rate else guess
            call_at = whole.index("<tool_call>") + len("<tool_call>")
            call_end = whole.index(tokenizer.eos_token, call_at) + len(tokenizer.eos_token)
            demos += [(text, first[len(text) :]), (whole[:call_at], whole[call_at:call_end]),
                      (whole[:answer_at], whole[answer_at:])]  # fmt: skip
        with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in demos)


def commands(args: Args) -> dict[str, list[str]]:
    """Each stage's arguments to python."""
    w, logs = args.work_dir, ["--logging_dir", f"{args.work_dir}/runs"]
    tool = {
        "lookup": ["--tools", "benchmark/tiny/tiny_tools.py:lookup"],
        "environment": ["--environment_factory", "benchmark/tiny/tiny_tools.py:CodeDesk"],
    }[args.tool]
    return {
        "world": ["benchmark/tiny/tiny_world.py", "--output_dir", f"{w}/world", "--seed", "0", "--num_sft",
                  str(args.num_train), "--num_test", str(args.num_test)],
        "sft": ["sft.py", "--model_name_or_path", f"{w}/world/policy_tools", "--dataset_name", f"{w}/demos",
                "--dataset_test_split", "test", "--output_dir", f"{w}/sft", "--max_length", "160",
                "--learning_rate", "3e-3", "--lr_scheduler_type", "cosine", "--warmup_ratio", "0.05",
                "--per_device_train_batch_size", "32", "--total_steps", str(args.sft_steps), "--eval_steps",
                str(args.sft_steps), "--seed", str(args.seed), "--run_name", "sft", "--overwrite_output_dir", *logs],
        args.trainer: [f"{args.trainer}.py", "--model_name_or_path", f"{w}/sft", "--dataset_name", f"{w}/world/dataset_tools",
                 "--dataset_test_split", "test", *tool, "--reward_funcs", "benchmark/tiny/tiny_tools.py:code_reward",
                 "--max_tool_calling_iterations", "1", "--num_generations", str(args.group_size),
                 "--per_device_train_batch_size", str(args.group_size * args.prompts_per_step),
                 "--max_completion_length", str(args.max_completion_length), "--temperature", str(args.temperature),
                 "--learning_rate", str(args.learning_rate), "--lr_scheduler_type", "constant", "--max_steps",
                 str(args.grpo_steps), "--eval_on_start", "--eval_steps", str(args.eval_steps),
                 "--num_generations_eval", "1", "--per_device_eval_batch_size", "100", "--num_sample_generations",
                 "0", "--seed", str(args.seed), "--output_dir", f"{w}/{args.trainer}", "--run_name", args.trainer,
                 "--overwrite_output_dir", *logs],
    }  # fmt: skip


def run(name: str, command: list[str], args: Args, output: str | None = None) -> dict:
    """Run `python command` with its log in {work_dir}/logs: {command, wall seconds, CPU seconds (user + system
    of the stage's processes)}; with `output`, a stage whose output exists and whose stamp names the same command
    is not run again (its record is the stamp's)."""
    logs = os.path.join(args.work_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    stamp = os.path.join(logs, f"{name}.done.json")
    if output is not None and os.path.exists(output) and os.path.exists(stamp):
        with open(stamp) as f:
            record = json.load(f)
        if record["command"] == shlex.join(["python", *command]):
            return record
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    with open(os.path.join(logs, f"{name}.log"), "w") as log:
        proc = subprocess.run(
            [sys.executable, *command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {logs}/{name}.log")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    record = {"command": shlex.join(["python", *command]), "seconds": round(time.time() - start, 1),
              "cpu_seconds": round(cpu, 1)}  # fmt: skip
    with open(stamp, "w") as f:
        json.dump(record, f)
    return record


def main(args: Args) -> None:
    stages, records, w = commands(args), {}, args.work_dir
    records["world"] = run("world", stages["world"], args, f"{w}/world/dataset_tools")
    start = time.time()
    demonstrations(args)
    records["demonstrations"] = {"seconds": round(time.time() - start, 1)}
    for name in ("sft", args.trainer):  # run again every time: the demonstrations are not in the command
        records[name] = run(name, stages[name], args)
        print(name, records[name], flush=True)
    with open(os.path.join(args.work_dir, "runs", args.trainer, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    reward = "reward" if args.trainer == "grpo" else "objective/scores"  # rloo.py logs TRL 0.19's names
    held_out = [
        {"step": m["step"], "reward": m[f"eval/{reward}"], "length": m["eval/completions/mean_length"]}
        for m in metrics
        if f"eval/{reward}" in m
    ]
    training = [
        {"step": m["step"], "reward": m[reward], "call_frequency": m["tools/call_frequency"]}
        for m in metrics
        if reward in m
    ]
    result = {
        "args": vars(args),
        "stages": records,
        "cpu_seconds": round(sum(r.get("cpu_seconds", 0.0) for r in records.values()), 1),
        "held_out_reward_start": held_out[0]["reward"],
        "held_out_reward_end": held_out[-1]["reward"],
        "held_out": held_out,
        "training": training,
        "machine": f"{os.cpu_count()} CPU cores, OMP_NUM_THREADS={args.threads}",
    }
    results = args.results or f"benchmark/results/{args.trainer}_tools"
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("cpu_seconds", "held_out_reward_start", "held_out_reward_end")}))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args, use_underscores=True))
