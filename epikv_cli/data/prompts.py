"""Prompt text (or chat messages) -> token ids, through the tokenizer's chat template when it has one."""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

from epikv_cli.config import PromptSettings
from epikv_cli.errors import UsageError

if TYPE_CHECKING:
    import torch

_SURROGATE = re.compile("[\ud800-\udfff]")


def stdin_bytes() -> bytes | str:
    """All of stdin (bytes, or text where the stream has no byte buffer); empty when the process started with stdin
    closed (``<&-``: ``sys.stdin`` is None)."""
    stream = sys.stdin
    if stream is None:
        return b""
    return stream.buffer.read() if hasattr(stream, "buffer") else stream.read()


def decode_text(data: bytes | str) -> tuple[str, bool]:
    """Text fit for a tokenizer, and whether anything had to be replaced.

    Bytes are decoded as UTF-8, invalid sequences becoming U+FFFD. In strings, lone surrogates
    (what Python makes of undecodable bytes in ``argv``, or a JSON ``"\\ud800"``) become U+FFFD too.
    """
    if isinstance(data, bytes):
        try:
            return data.decode("utf-8"), False
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace"), True
    cleaned, count = _SURROGATE.subn("\ufffd", data)
    return cleaned, count > 0


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer brings a chat template."""
    return getattr(tokenizer, "chat_template", None) is not None


def prompt_file_missing(option: str, source) -> UsageError:
    """The error for a prompt file (named by ``option``) that does not exist; ``--dataset`` takes JSONL with answers
    only (or a dataset name), other options plain text too."""
    if option == "--dataset":
        return UsageError(
            f"--dataset {source}: file not found; give a JSONL file with a question and an 'answer' per line, or a "
            "dataset name (math500, gsm8k, aime24, aime25, amc23; needs the Hugging Face Hub)"
        )
    return UsageError(
        f"{option} {source}: file not found; give a plain-text file (one prompt per line) or a JSONL file"
    )


def no_prompts(source) -> UsageError:
    """The error for a prompt file that holds nothing but blank lines."""
    return UsageError(f"{source} holds no prompts; write one per line (or one JSON object per line)")


def require_text(prompt: str | None) -> str:
    """``prompt`` itself, or :class:`UsageError` when it is missing or blank."""
    if prompt is None or not prompt.strip():
        raise UsageError("the prompt is empty; pass the text as an argument or pipe it in with '-'")
    return prompt


def valid_messages(messages: Any) -> bool:
    """Whether ``messages`` is a chat as JSONL gives it: a list of objects with a ``role`` and a ``content`` string."""
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )


def build_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """``[{"role": "system", ...}, {"role": "user", ...}]`` for one prompt."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": "user", "content": prompt}]


def build_input_ids(
    tokenizer, prompt: str | None = None, settings: PromptSettings | None = None, messages: list | None = None
) -> torch.Tensor:
    """Token ids ``[1, prompt_len]`` for a prompt string or a list of chat messages (``settings.system`` first,
    unless the messages hold a system message of their own).

    With a chat template (and ``settings.chat_template``), the template is applied with the
    generation prompt added; otherwise the text is tokenized as is, with the tokenizer's special tokens.
    """
    settings = settings or PromptSettings()
    if messages is None:
        messages = build_messages(require_text(prompt), settings.system)
    elif not messages:
        raise UsageError("the message list is empty; give at least one {'role': 'user', 'content': ...}")
    elif settings.system is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": settings.system}, *messages]  # --system, as for a prompt
    has_template = has_chat_template(tokenizer)
    if settings.chat_template and has_template:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"]
    if any(m.get("role") == "system" for m in messages):
        why = "--no-chat-template was given" if has_template else "this tokenizer has no chat template"
        raise UsageError(f"--system needs a chat template but {why}; put the instructions in the prompt instead")
    text = "\n\n".join(str(m.get("content", "")) for m in messages)
    return tokenizer(text, return_tensors="pt")["input_ids"]
