"""The two halves of a whole-update test: the same completions on our side and TRL's, and the weights after
every optimizer step on both.

Sampling is the one thing both sides must not do themselves: each side's sampler draws other random numbers.
`completion(prompt, j)` is the j-th completion of a prompt (its token ids, a stable hash of both as the seed),
and `next_index` counts the completions each prompt got so far, in files shared by every process of the run, so
a group holds the same completions whichever process samples which of its rows. Our scripts get them through
`utils.generation.generate` (tests/fixed_run.py swaps it), TRL's trainers through their `_generate_single_turn`.
`StepRecorder` writes the trained parameters after each optimizer step (a global optimizer hook), so the
comparison is of what each training loop did, not of a loss the test rebuilds."""

import fcntl
import hashlib
import os
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

TOKENS = (2, 600)  # the tiny world's ids below 2 are <|endoftext|> and <|pad|>


def completion(prompt_ids: list[int], j: int, length: int, eos_id: int) -> list[int]:
    """The j-th completion of a prompt: `length` token ids, of which about 2 in 3 hold an EOS at a varied place
    (everything after it pad-like noise that the scripts cut), the others run to the length limit."""
    digest = hashlib.sha256(f"{list(map(int, prompt_ids))}|{j}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    ids = torch.randint(*TOKENS, (length,), generator=g).tolist()
    if torch.rand((), generator=g).item() < 0.67:
        ids[int(torch.randint(1, length, (), generator=g))] = eos_id
    return ids


def cut_at_eos(ids: list[int], eos_ids) -> list[int]:
    """The ids up to and including the first EOS (as a sampler that stops there returns them)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids


def next_index(counter_dir: str | os.PathLike, prompt_ids: list[int]) -> int:
    """How many completions this prompt got before (then one more), counted across processes."""
    key = hashlib.sha256(str(list(map(int, prompt_ids))).encode()).hexdigest()[:20]
    path = Path(counter_dir) / key
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        count = int(f.read() or 0)
        f.seek(0)
        f.truncate()
        f.write(str(count + 1))
    return count


def trl_generate(trainer, counter_dir, length: int):
    """A stand-in for a TRL 1.16 trainer's `_generate_single_turn`: fixed completions, cut after the first of
    the trainer's EOS ids, as TRL's own sampler returns them (no logprobs: TRL computes its own)."""
    eos_ids = list(trainer.eos_token_ids)

    def generate_single_turn(prompt_ids, *args, **kwargs):
        out = [
            cut_at_eos(completion(p, next_index(counter_dir, p), length, eos_ids[0]), eos_ids)
            for p in prompt_ids
        ]
        return out, None

    return generate_single_turn


def trl_generate_ids(trainer, counter_dir, length: int):
    """`trl_generate` for a trainer whose `_generate_single_turn(prompt_ids, images, multimodal_fields)` returns
    the completion ids alone (RLOOTrainer 1.16: it recomputes every logprob itself)."""
    with_logprobs = trl_generate(trainer, counter_dir, length)
    return lambda prompt_ids, *args, **kwargs: with_logprobs(prompt_ids)[0]


def trl_without_vllm() -> None:
    """Make TRL, imported after this, take vLLM for absent: the trainers here sample the fixed completions, and
    TRL's modules import an installed vLLM (with torch's compiler) whether it is used or not, about 6 s of CPU
    per process. A TRL already imported keeps its vLLM."""
    import trl.import_utils as trl_imports  # `as`: trl is a lazy module

    trl_imports.is_vllm_available = lambda *args, **kwargs: False


def trl_train(build_trainer, target: str, spec: dict, nproc: int = 1):
    """TRL's train() of `build_trainer(spec)` (`target`: its "module:function" for tests/trl_fixed_run.py) in this
    process or on `nproc` processes -> (weights after each step, the log history's training lines)."""
    import json

    out = spec["out"]
    if nproc == 1:
        torch.manual_seed(0)
        trainer = build_trainer(spec)
        recorder = StepRecorder(f"{out}/trl_steps", model=trainer.model)
        try:
            trainer.train()
        finally:
            recorder.remove()
        history = trainer.state.log_history
    else:
        from conftest import run_torchrun

        with open(f"{out}/spec.json", "w") as f:
            json.dump(spec, f)
        run_torchrun(["tests/trl_fixed_run.py", target, f"{out}/spec.json"], nproc=nproc)
        history = json.load(open(f"{out}/trl_history.json"))
    return recorded_steps(f"{out}/trl_steps"), [h for h in history if "loss" in h]


class StepRecorder:
    """Writes {name: parameter} of the trainable parameters of `model` (or the module that owns the optimizer's
    parameters, found among `candidates()`) to out_dir/step{k}.safetensors after the k-th optimizer step, on the
    first process only. A global hook: it sees the real steps only (accelerate skips the accumulating ones)."""

    def __init__(self, out_dir, model=None, candidates=None):
        self.out_dir, self.model, self.candidates, self.steps = Path(out_dir), model, candidates, 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.handle = register_optimizer_step_post_hook(self)

    def owner(self, optimizer):
        if self.model is not None:
            return self.model
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self.candidates():
            if any(id(p) in params for p in module.parameters()):
                return module
        raise RuntimeError("StepRecorder: no module owns the optimizer's parameters")

    def __call__(self, optimizer, args, kwargs):
        from safetensors.torch import save_file

        self.steps += 1
        if int(os.environ.get("RANK", "0")) != 0:
            return
        module = self.owner(optimizer)
        module = getattr(module, "module", module)  # DDP
        tensors = {
            name.removeprefix("module."): p.detach().float().cpu().clone().contiguous()
            for name, p in module.named_parameters()
            if p.requires_grad
        }
        save_file(tensors, str(self.out_dir / f"step{self.steps}.safetensors"))

    def remove(self):
        self.handle.remove()


def recorded_steps(out_dir) -> list[dict]:
    """The recorded parameters, one dict a step, in step order."""
    from safetensors.torch import load_file

    paths = sorted(Path(out_dir).glob("step*.safetensors"), key=lambda p: int(p.stem[4:]))
    return [load_file(str(p)) for p in paths]


def assert_same_steps(ours: list[dict], theirs: list[dict], start: dict, rel=2e-3, min_steps=2):
    """Equal numbers of optimizer steps (at least `min_steps`) and, after each, the same parameters: for every
    tensor, the two sides' updates since `start` differ by at most `rel` of TRL's update (in norm). AdamW makes
    rounding noise in a gradient near 0 into a full step of a few elements (about 1e-4 of the norm here), while
    a sign, a mask or a scale changes the update of most elements."""
    assert len(ours) == len(theirs) >= min_steps, (len(ours), len(theirs))
    for step, (mine, trl) in enumerate(zip(ours, theirs), 1):
        assert set(mine) == set(trl), (step, sorted(set(mine) ^ set(trl))[:5])
        for name in mine:
            update = (trl[name] - start[name].float()).norm()
            gap = (mine[name] - trl[name]).norm()
            assert gap <= rel * update + 1e-7, (
                f"step {step}: {name}: |ours - TRL's| {gap:.3g}, TRL's update {update:.3g}"
            )


LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_target_modules=["q_proj", "v_proj", "up_proj"])


def trl_lora(trainer_module, flags: dict, seed: int, task_type: str = "CAUSAL_LM"):
    """TRL's peft_config of `task_type` for the LoRA flags popped from `flags` (None without them); the trainer
    module's next get_peft_model call seeded with `seed`, as utils.lora.add_adapter does, so both sides start from
    the same adapter (then the module's own function is back)."""
    import torch
    from peft import LoraConfig

    lora = {key: flags.pop(key) for key in list(flags) if key.startswith("lora_")}
    if not lora:
        return None
    original = trainer_module.get_peft_model

    def seeded(*args, **kwargs):
        trainer_module.get_peft_model = original
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return original(*args, **kwargs)

    trainer_module.get_peft_model = seeded
    return LoraConfig(task_type=task_type, r=lora["lora_r"], lora_alpha=lora["lora_alpha"],
                      lora_dropout=lora["lora_dropout"], target_modules=lora["lora_target_modules"])  # fmt: skip


def lora_flags(**overrides):
    """The LoRA flags utils.lora.add_adapter reads: LORA's, with `overrides`."""
    import types

    return types.SimpleNamespace(**{**LORA, "lora_modules_to_save": None, "use_rslora": False, "use_dora": False,
                                    "gradient_checkpointing": False, **overrides})  # fmt: skip


def lora_start(model_path, seed: int, task_type: str = "CAUSAL_LM") -> dict:
    """The trained parameters of `model_path` with LORA's adapter as utils.lora.add_adapter starts it (SEQ_CLS:
    a one-label classifier, its score head among them)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import utils.lora

    if task_type == "SEQ_CLS":
        base = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    else:
        base = AutoModelForCausalLM.from_pretrained(model_path)
    model = utils.lora.add_adapter(base, lora_flags(), seed, task_type)
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
