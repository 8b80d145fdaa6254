"""TRL 1.12's PPOTrainer on the tiny world with fixed completions, written down for ppo.py's parity test.

TRL dropped PPO after 1.12, so tests/test_update_parity_ppo.py cannot run TRL's trainer beside ppo.py; this
script runs it once, in an environment of its own, and commits what it did: the weights of the policy and the
value model after every optimizer step (as digests) and the metrics of every update.

    python -m venv .venv-trl-ppo && .venv-trl-ppo/bin/pip install torch==2.13.0 -r requirements.txt
    .venv-trl-ppo/bin/pip install trl==1.12.0     # after requirements.txt: it replaces the tests' trl 1.16
    .venv-trl-ppo/bin/python benchmark/speed/trl_ppo_record.py  # writes benchmark/results/trl_ppo_1_12.json

What it runs: the tiny world built with `WORLD` (the tests' world; deterministic, rebuilt here), `NUM_PROMPTS`
prompts of different lengths (left padding), the world's policy, and its reward model as both reward model and
critic, as ppo.py does. Each case of `CASES` is one PPOTrainer.train() with one micro-batch per optimizer step
covering the whole batch (so the two sides' different shuffles cannot make them differ) and every prompt in
every update. Sampling is replaced by tests/fixed_completions.py's completions, returned the way TRL's
`batch_generation` returns them (every row `response_length` tokens; with a stop token, pad after it, as
`generate` pads a finished row) with the logits `generate` would have scored them with (the policy's, divided by
temperature + 1e-7). Everything else is TRL's own code.

The digest of a step: for every parameter, the update d = w_step - w_start (float64) as [|d|, <d, s_1>, ...,
<d, s_K>] with K fixed random sign vectors s_k (seeded by the parameter's name): two runs whose updates differ by
e differ in each projection by about |e|, so the digests compare updates at a tolerance relative to |d| as a
full comparison would, in a few numbers. `digest()` is shared with the test; parameters are named as in TRL's
PolicyAndValueWrapper (`policy.`, `value_model.`; ppo.py's critic is `critic.`).
"""

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "benchmark" / "results" / "trl_ppo_1_12.json"
COMMAND = ".venv-trl-ppo/bin/python benchmark/speed/trl_ppo_record.py"
# The tests' world (tests/conftest.py `world`): tiny_world.Args overrides; the build is deterministic.
WORLD = dict(num_sft=600, num_preference=600, num_preference_validation=200, num_validation=64, num_test=64)
NUM_PROMPTS = 8  # one update's batch: every prompt in every update (TRL's whitening of rewards needs >= 8)
NUM_PROJECTIONS = 4
# Flags both sides take under the same names (PPOConfig's are ppo.py's). Common to every case:
SHARED = dict(
    per_device_train_batch_size=NUM_PROMPTS, gradient_accumulation_steps=1, num_mini_batches=1,
    num_ppo_epochs=2, response_length=10, temperature=0.9, learning_rate=1e-3, vf_coef=0.5, gamma=1.0,
    cliprange=0.1, cliprange_value=0.02, local_rollout_forward_batch_size=4, missing_eos_penalty=1.0,
)  # fmt: skip
CASES = {
    # TRL's default stop_token None: no row is cut, so where the two differ after a stop token (below) plays no
    # part and the whole run, critic included, is compared: KL penalty, whitened rewards and advantages, GAE,
    # both clipped losses, the EOS penalty, 2 updates of 2 optimizer steps.
    "no_stop": dict(updates=2, flags=dict(kl_coef=0.2, lam=0.95, whiten_rewards=True)),
    # --stop_token eos: rows cut after their EOS. TRL scores the position after the EOS and trains the critic
    # there too (its `padding_mask_p1`); ppo.py scores the EOS itself. With lam = 1 the policy's advantages are
    # the same either way (the extra step telescopes away), so the policy is compared, not the critic, in one
    # update (the next one would read the critics' different values).
    "stop_at_eos": dict(updates=1, flags=dict(kl_coef=0.2, lam=1.0, whiten_rewards=False, stop_token="eos")),
}


def make_world(out: Path) -> Path:
    """The tiny world of `WORLD` in `out`."""
    sys.path.insert(0, str(ROOT / "benchmark" / "tiny"))
    import tiny_world

    tiny_world.build(tiny_world.Args(output_dir=str(out), **WORLD))
    return out


def make_prompts(world: Path, out: Path) -> Path:
    """out/prompts.jsonl: the first NUM_PROMPTS sft prompts, cut at four different places (left padding)."""
    rows = [json.loads(line) for line in open(world / "dataset" / "sft.jsonl")][:NUM_PROMPTS]
    path = out / "prompts.jsonl"
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"prompt": row["prompt"][(i % 4) * 9 :]}) + "\n" for i, row in enumerate(rows)
        )
    return path


def start_weights(world: Path) -> dict:
    """The trained parameters before the first step, named as in TRL's PolicyAndValueWrapper."""
    from safetensors.torch import load_file

    policy = load_file(str(world / "policy" / "model.safetensors"))
    critic = load_file(str(world / "reward" / "model.safetensors"))
    return {
        **{f"policy.{k}": v for k, v in policy.items()},
        **{f"value_model.{k}": v for k, v in critic.items()},
    }


@functools.cache
def signs(name: str, numel: int):
    """K vectors of random signs [K, numel], seeded by the parameter's name."""
    import torch

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (NUM_PROJECTIONS, numel), generator=g).double() * 2 - 1


def digest(weights: dict, start: dict) -> dict[str, list[float]]:
    """{name: [|d|, <d, s_1>, ..., <d, s_K>]} of the update d = weights - start of every parameter."""
    out = {}
    for name in sorted(weights):
        d = (weights[name].double() - start[name].double()).flatten()
        out[name] = [d.norm().item(), *(signs(name, d.numel()) @ d).tolist()]
    return out


def start_digest(start: dict) -> dict[str, list[float]]:
    """{name: [sum, sum of squares]} of the starting weights: the check that a world build is the recorded one."""
    return {k: [v.double().sum().item(), (v.double() ** 2).sum().item()] for k, v in sorted(start.items())}


def json_value(value):
    """A config default as JSON: itself when JSON holds it, else its repr."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def config_defaults() -> dict:
    """TRL 1.12's PPOConfig defaults, read as benchmark/speed/trl_defaults.py reads a TRL config's."""
    import trl_defaults

    return {k: json_value(v) for k, v in trl_defaults.trl_defaults("ppo").items()}


# ---- TRL's run -----------------------------------------------------------------------------------------------
def fixed_batch_generation(counter: Path, eos_id: int, stop_id: int | None, temperature: float):
    """A stand-in for trl.experimental.ppo's `batch_generation`: (query_responses [B, Q+R], logits [B, R, V])."""
    import torch
    from trl.experimental.ppo import ppo_trainer

    from fixed_completions import completion, cut_at_eos, next_index

    def batch_generation(model, queries, local_rollout_forward_batch_size, pad_token_id, generation_config):
        length = generation_config.max_new_tokens
        rows = []
        for row in queries.tolist():
            prompt = [t for t in row if t != pad_token_id]
            ids = completion(prompt, next_index(counter, prompt), length, eos_id)
            if stop_id is not None:  # generate() pads a row after its stop token
                ids = cut_at_eos(ids, [stop_id])
                ids += [pad_token_id] * (length - len(ids))
            rows.append(ids)
        query_responses = torch.cat([queries, torch.tensor(rows, dtype=queries.dtype)], 1)
        with torch.no_grad():
            logits = ppo_trainer.forward(model, query_responses, pad_token_id).logits
        return query_responses, logits[:, queries.size(1) - 1 : -1].float() / (temperature + 1e-7)

    return batch_generation


def run_case(world: Path, prompts: Path, work: Path, case: dict) -> dict:
    """One PPOTrainer.train(): {flags, trainer facts, grad norms, steps (digests), metrics}."""
    import torch
    from datasets import Dataset
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    from fixed_completions import StepRecorder, recorded_steps

    flags = {**SHARED, **case["flags"]}
    tokenizer = AutoTokenizer.from_pretrained(world / "policy", padding_side="left")
    texts = [json.loads(line)["prompt"] for line in open(prompts)]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert ids == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]  # ppo.py's encoding
    dataset = Dataset.from_dict({"input_ids": ids})
    config = PPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, report_to=[], save_strategy="no",
        num_sample_generations=0, total_episodes=case["updates"] * NUM_PROMPTS, logging_steps=1, **flags,
    )  # fmt: skip
    # TRL's defaults kept on purpose, as the record shows none of them acts in PPOTrainer: max_grad_norm 1.0 (its
    # loop never clips), gradient_checkpointing True (never enabled), bf16 True (its own Accelerator is built
    # without the config's mixed precision); seed 42 (no randomness is left but the shuffles).
    policy = AutoModelForCausalLM.from_pretrained(world / "policy")
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=AutoModelForCausalLM.from_pretrained(world / "policy"),
        reward_model=AutoModelForSequenceClassification.from_pretrained(world / "reward", num_labels=1),
        value_model=AutoModelForSequenceClassification.from_pretrained(world / "reward", num_labels=1),
        train_dataset=dataset,
        eval_dataset=dataset,
    )
    counter = work / "counter"
    counter.mkdir(parents=True)
    stop_id = trainer.stop_token_id
    ppo_trainer.batch_generation = fixed_batch_generation(
        counter, tokenizer.eos_token_id, stop_id, config.temperature
    )
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grad_norms = []

    def measure(optimizer, args, kwargs):
        grad_norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item())

    pre_hook = register_optimizer_step_pre_hook(measure)
    recorder = StepRecorder(work / "steps", model=trainer.model)
    try:
        trainer.train()
    finally:
        recorder.remove()
        pre_hook.remove()
    start = start_weights(world)
    steps = recorded_steps(work / "steps")
    assert all(set(step) == set(start) for step in steps), sorted(set(steps[0]) ^ set(start))
    optimizer = trainer.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return dict(
        flags=flags,
        updates=case["updates"],
        trainer=dict(
            optimizer=type(optimizer).__name__,
            optimizer_defaults={k: json_value(v) for k, v in optimizer.defaults.items()},
            weight_decays=sorted({group["weight_decay"] for group in optimizer.param_groups}),
            max_grad_norm=config.max_grad_norm,
            bf16=config.bf16,
            gradient_checkpointing=config.gradient_checkpointing,
            policy_is_gradient_checkpointing=bool(trainer.model.policy.is_gradient_checkpointing),
            seed=config.seed,
            stop_token_id=stop_id,
            mixed_precision=trainer.accelerator.mixed_precision,
        ),
        grad_norms_before_step=grad_norms,
        steps=[digest(step, start) for step in steps],
        metrics=[{k: v for k, v in h.items()} for h in trainer.state.log_history if "objective/kl" in h],
    )


def provenance(argv: list[str]) -> dict:
    import accelerate
    import torch
    import transformers
    import trl

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return dict(
        command=" ".join([COMMAND, *argv]),
        remake=(
            "python -m venv .venv-trl-ppo && .venv-trl-ppo/bin/pip install torch==2.13.0 -r requirements.txt && "
            f".venv-trl-ppo/bin/pip install trl==1.12.0 && {COMMAND}"
        ),
        commit=git("rev-parse", "HEAD"),
        uncommitted=git("status", "--porcelain", "--untracked-files=no").splitlines(),
        date=time.strftime("%Y-%m-%d %H:%M:%S %z"),
        versions=dict(
            python=sys.version.split()[0],
            trl=trl.__version__,
            torch=torch.__version__,
            transformers=transformers.__version__,
            accelerate=accelerate.__version__,
        ),  # fmt: skip
        threads=torch.get_num_threads(),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RECORD), help="where the record goes")
    parser.add_argument("--world", default=None, help="an existing build of WORLD (default: build one)")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmark" / "speed")]
    os.environ.update(TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)  # so that the record shows what the config alone does
    import torch
    import trl

    assert trl.__version__ == "1.12.0", f"run this in TRL 1.12.0's environment, not trl {trl.__version__}"
    torch.set_num_threads(1)  # as the tests' OMP_NUM_THREADS=1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        world = Path(args.world) if args.world else make_world(tmp / "world")
        world_args = json.loads((world / "world.json").read_text())
        prompts = make_prompts(world, tmp)
        record = dict(
            made_by=provenance(argv),
            about=__doc__,
            world=world_args,
            num_prompts=NUM_PROMPTS,
            start=start_digest(start_weights(world)),
            ppo_config_defaults=config_defaults(),
            cases={name: run_case(world, prompts, tmp / name, case) for name, case in CASES.items()},
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
