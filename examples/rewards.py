"""Reward functions for `examples/prompts.jsonl`, with TRL's contract: one float (or None) per completion.

A function that takes `**kwargs` also gets every other column of each completion's dataset row by its name,
so the `answer` column arrives as `answer`, one entry per completion."""


def contains_answer(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion names the row's answer, else 0.0."""
    return [float(expected.lower() in text.lower()) for text, expected in zip(completions, answer)]


def brevity(completions: list[str], **kwargs) -> list[float]:
    """A small penalty per word beyond ten: short answers are preferred."""
    return [-0.05 * max(0, len(text.split()) - 10) for text in completions]
