"""Run a TRL trainer built by a test's `build_trainer(spec)` on this process (under torchrun: each of them),
recording its weights after every optimizer step in <out>/trl_steps and its log history in
<out>/trl_history.json: python tests/trl_fixed_run.py test_update_parity_grpo:build_trainer spec.json"""

import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main() -> None:
    import torch

    from fixed_completions import StepRecorder

    target, spec_path = sys.argv[1:]
    module, name = target.split(":")
    spec = json.load(open(spec_path))
    torch.manual_seed(0)
    trainer = getattr(importlib.import_module(module), name)(spec)
    StepRecorder(f"{spec['out']}/trl_steps", model=trainer.model)
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(f"{spec['out']}/trl_history.json", "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
