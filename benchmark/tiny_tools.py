"""The tiny world's tool task: its tool and its reward (benchmark/tiny_world.py writes dataset_tools/).

    python grpo.py --model_name_or_path tiny_world/policy_tools --dataset_name tiny_world/dataset_tools \
        --tools benchmark/tiny_tools.py:lookup --reward_funcs benchmark/tiny_tools.py:code_reward ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_world import tool_code  # noqa: E402


def lookup(name: str) -> str:
    """Look up the code of a name.

    Args:
        name: the name whose code is wanted
    """
    return tool_code(name.strip())


def code_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the last assistant turn says the name's code (which only the tool knows), else 0."""
    rewards = []
    for messages, code in zip(completions, answer):
        said = [m.get("content") or "" for m in messages if m["role"] == "assistant"]
        rewards.append(float(bool(said) and code in said[-1].split()))
    return rewards
