"""Chat templates and tokenizing: conversations to text, text to ids with the right EOS and BOS.

A completion is the whole rendering after the prompt's (with its generation prompt), cut at the EOS so the
model learns to stop where sampling stops. A BOS starts a sequence only if the tokenizer adds one, once."""

from __future__ import annotations

import os
from collections.abc import Sequence

from utils.run import UsageError


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer settings: chat template, EOS, BOS
# ----------------------------------------------------------------------------------------------------------------
def set_chat_template(tokenizer, path: str | None, trust_remote_code: bool = False) -> None:
    """Set the template from `path` (--chat_template_path): a Jinja file or a tokenizer folder (loaded with
    --trust_remote_code)."""
    if path is None:
        return
    if os.path.isfile(path):
        with open(path) as f:
            tokenizer.chat_template = f.read()
        return
    if os.path.isdir(path):
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code).chat_template
        if template is None:
            raise UsageError(f"--chat_template_path {path}: that tokenizer has no chat template.")
        tokenizer.chat_template = template
        return
    raise UsageError(
        f"--chat_template_path {path} does not exist; pass a Jinja file or a tokenizer directory."
    )


def require_chat_template(tokenizer, where: str) -> None:
    """Refuse conversational data with a tokenizer that has no chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(
            f"{where} is conversational but the tokenizer has no chat template; pass --chat_template_path "
            "(a Jinja file or a tokenizer directory) or a tokenizer that has one."
        )


def set_eos_token(tokenizer, token: str) -> None:
    """Make `token` (sft.py's --eos_token), one known token, the EOS."""
    ids = tokenizer.convert_tokens_to_ids([token])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id and token != tokenizer.unk_token:
        raise UsageError(f"--eos_token {token!r} is not a token of the tokenizer's vocabulary.")
    tokenizer.eos_token = token


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts what it encodes with a BOS."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return (
        len(with_special) > len(tokenizer("a", add_special_tokens=False)["input_ids"])
        and with_special[0] == bos
    )


def encode(tokenizer, texts: Sequence[str], leading: bool) -> list[list[int]]:
    """Ids of each text without special tokens, but a BOS before `leading` texts if the tokenizer adds one."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(texts) else []
    if leading and adds_bos(tokenizer):
        bos = tokenizer.bos_token_id
        ids = [row if row[:1] == [bos] else [bos] + row for row in ids]
    return ids


def tokenize_prompts(
    tokenizer, prompts: Sequence[str], max_prompt_length: int | None = None
) -> list[list[int]]:
    """Ids of rendered prompts, the last `max_prompt_length` tokens."""
    ids = encode(tokenizer, prompts, leading=True)
    return [row[-max_prompt_length:] if max_prompt_length else row for row in ids]


# ----------------------------------------------------------------------------------------------------------------
# Rendering conversations
# ----------------------------------------------------------------------------------------------------------------
ROLES = ("system", "user", "assistant", "tool", "developer")


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The template's text of `messages` (and the assistant's opening when `generation_prompt`)."""
    for message in messages:
        if message.get("role") not in ROLES:
            raise UsageError(
                f"a message has role {message.get('role')!r}; the roles are {', '.join(ROLES)}: fix the dataset."
            )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def end_at_eos(text: str, eos_token: str | None) -> str:
    """Drop whitespace after a final EOS (a template's newline after its end of turn)."""
    stripped = text.rstrip()
    return stripped if eos_token and stripped.endswith(eos_token) else text


def split_rendering(tokenizer, prompt: list[dict], completion: list[dict]) -> tuple[str, str]:
    """(prompt text, completion text): the prompt with the generation prompt when the assistant answers, the
    completion the rest of the whole rendering, ending at the EOS."""
    prompt_text = render(tokenizer, prompt, generation_prompt=completion[0]["role"] == "assistant")
    whole = render(tokenizer, prompt + completion)
    if not whole.startswith(prompt_text):
        raise UsageError(
            "the chat template does not render a conversation's prompt as the beginning of the whole "
            "conversation, so the completion cannot be told apart; use another --chat_template_path."
        )
    return prompt_text, end_at_eos(whole[len(prompt_text) :], tokenizer.eos_token)


def turn_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendering as (text, is_assistant) pieces: an assistant turn's content and end of turn are True;
    other turns, the assistant's opening and whitespace after an EOS are False."""
    pieces, done = [], ""
    for i, message in enumerate(messages):
        full = render(tokenizer, messages[: i + 1])
        head = (
            render(tokenizer, messages[:i], generation_prompt=True)
            if message["role"] == "assistant" and i
            else done
        )
        if not (head.startswith(done) and full.startswith(head)):
            raise UsageError(
                "the chat template does not render a conversation turn by turn (each part the beginning of the "
                "next), which --assistant_only_loss needs; use another --chat_template_path."
            )
        if head != done:
            pieces.append((head[len(done) :], False))
        text = full[len(head) :]
        if message["role"] == "assistant":
            # the separator after its EOS is not the assistant's to learn
            turn = end_at_eos(text, tokenizer.eos_token)
            pieces += [(turn, True), (text[len(turn) :], False)]
        else:
            pieces.append((text, False))
        done = full
    pieces = [p for p in pieces if p[0]]
    if len(pieces) > 1 and not pieces[-1][1] and not pieces[-1][0].strip():
        pieces.pop()  # whitespace after the final end of turn, as in end_at_eos
    pieces[-1] = (end_at_eos(pieces[-1][0], tokenizer.eos_token), pieces[-1][1])
    return pieces
