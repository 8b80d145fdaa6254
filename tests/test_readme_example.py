"""The README's "your data, your reward" command runs as printed, on the tiny world and the files in examples/."""

import json
import re
import shlex

from conftest import ROOT, run_script


def readme_commands(section: str) -> list[list[str]]:
    """The commands of the first bash block under the README heading `section`, one argv each."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_your_data_your_reward_runs_as_printed(world, tmp_path):
    build, train = readme_commands("Your data, your reward")
    assert build[:2] == ["python", "benchmark/tiny/tiny_world.py"]
    (tmp_path / "tiny_world").symlink_to(world)  # the session's world stands in for the build
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    assert train[0] == "python"
    run_script([str(ROOT / train[1]), *train[2:]], cwd=tmp_path)
    output = tmp_path / "models" / "grpo_example"
    assert (output / "model.safetensors").exists() and (output / "README.md").exists()
    metrics = list((tmp_path / "runs").rglob("metrics.jsonl"))
    lines = metrics[0].read_text().splitlines()
    assert len(metrics) == 1 and len(lines) == 4  # --max_steps 4, --logging_steps 1
    assert {"rewards/contains_answer/mean", "rewards/brevity/mean"} <= set(json.loads(lines[-1]))
