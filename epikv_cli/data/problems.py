"""Prompts and problems for ``fidelity``, ``eval`` and ``calibrate``: files, datasets, the paper's protocol.

A FILE is plain text (one prompt per line), JSONL with ``prompt`` or ``messages``, or a dataset such
as a MATH-500 export (``math500.jsonl``) whose question is in a field (``--field problem``; by default the
first of ``problem``, ``question``) and whose reference answer is in ``--answer-field`` (default
``answer``). Prompts follow the EpiKV paper's protocol: the chat template with the system message
:data:`PROTOCOL_SYSTEM` (a model without a chat template gets the instruction before the problem).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epikv_cli.config import PromptSettings
from epikv_cli.data.jsonl import valid_id
from epikv_cli.data.prompts import (
    build_input_ids,
    decode_text,
    has_chat_template,
    no_prompts,
    prompt_file_missing,
    valid_messages,
)
from epikv_cli.errors import UsageError

if TYPE_CHECKING:
    import torch

PROTOCOL_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
QUESTION_FIELDS = ("problem", "question")
#: Dataset names and where the Hub keeps them: (repository, configuration, split, question field).
HUB_DATASETS = {
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", "problem"),
    "aime25": ("math-ai/aime25", None, "test", "problem"),
    "amc23": ("math-ai/amc23", None, "test", "question"),
    "gsm8k": ("openai/gsm8k", "main", "test", "question"),
}


@dataclass
class Problem:
    """One prompt: ``prompt`` text (or ``messages``), and the reference ``answer`` when the file has one."""

    id: Any
    line: int
    prompt: str | None = None
    messages: list | None = None
    answer: str | None = None


def _answer(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _problem(number: int, data: dict, field: str | None, answer_field: str, source: Path) -> Problem:
    key = "id" if "id" in data else "unique_id" if "unique_id" in data else None
    problem_id = data[key] if key else number
    if not valid_id(problem_id):
        raise UsageError(
            f"{source}:{number}: {key!r} must be a string or a whole number, got {json.dumps(problem_id)}; "
            "ids decide what --resume skips"
        )
    answer = _answer(data.get(answer_field))
    if "messages" in data and field is None:
        messages = data["messages"]
        if not messages or not valid_messages(messages):
            raise UsageError(
                f"{source}:{number}: 'messages' must be a non-empty list of {{'role', 'content'}} objects with "
                "string values"
            )
        return Problem(problem_id, number, messages=messages, answer=answer)
    fields = (field,) if field else ("prompt", *QUESTION_FIELDS)
    for name in fields:
        if isinstance(data.get(name), str):
            return Problem(problem_id, number, prompt=decode_text(data[name])[0], answer=answer)
    wanted = f"'{field}'" if field else "'prompt', 'problem' or 'question'"
    raise UsageError(f"{source}:{number}: no {wanted} text field; name the question's field with --field")


def load_problems(
    source: Path,
    field: str | None = None,
    answer_field: str = "answer",
    limit: int | None = None,
    offset: int = 0,
    option: str = "--prompts",
) -> list[Problem]:
    """Problems ``offset .. offset + limit`` of ``source`` (plain text or JSONL), blank lines skipped;
    ``option`` is the flag that named the file, for messages."""
    check_range(limit, offset)
    if not source.is_file():
        raise prompt_file_missing(option, source)
    try:
        lines = source.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise UsageError(f"{source} is not UTF-8 text; save it as UTF-8") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    jsonl = source.suffix == ".jsonl" or all(line.lstrip().startswith("{") for _, line in numbered)
    numbered = numbered[offset:]
    if limit is not None:
        numbered = numbered[:limit]
    if not numbered:
        if offset:
            raise UsageError(f"{source} holds no prompts from --offset {offset} on; give a smaller --offset")
        raise no_prompts(source)
    if not jsonl:
        return [Problem(n, n, prompt=line) for n, line in numbered]
    problems: list[Problem] = []
    for number, line in numbered:
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{source}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(data, dict):
            raise UsageError(f"{source}:{number}: a JSONL line must be an object")
        problems.append(_problem(number, data, field, answer_field, source))
    refuse_duplicate_ids(str(source), problems)
    return problems


def check_range(limit: int | None, offset: int) -> None:
    """:class:`UsageError` for a ``--limit`` under 1 or a negative ``--offset``."""
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, got {limit}")
    if offset < 0:
        raise UsageError(f"--offset must be 0 or more, got {offset}")


def refuse_duplicate_ids(source: str, problems: list[Problem]) -> None:
    """:class:`UsageError` when two problems share an id (``--resume`` skips by id: one would never run)."""
    first: dict[str, int] = {}
    for problem in problems:
        key = json.dumps(problem.id, sort_keys=True)
        if key in first:
            raise UsageError(
                f"{source}: lines {first[key]} and {problem.line} have the same id {json.dumps(problem.id)}; "
                "give every prompt its own id (ids decide what --resume skips)"
            )
        first[key] = problem.line


def load_hub_dataset(
    name: str, limit: int | None = None, offset: int = 0, field: str | None = None, answer_field: str = "answer"
) -> list[Problem]:
    """A benchmark by name through the ``datasets`` library (needs the Hugging Face Hub): rows ``offset .. offset +
    limit``, numbered from 1 as the lines of its JSONL export are (a row without an id has that number as its id)."""
    repository, config, split, question = HUB_DATASETS[name]
    question = field or question
    check_range(limit, offset)
    try:
        import datasets  # noqa: PLC0415 (datasets: an optional extra (epikv[hub]), needed only for dataset names)
    except ImportError:
        raise UsageError(
            f"--dataset {name} needs the 'datasets' package (pip install 'epikv[hub]') and the Hugging Face Hub; or "
            f"give a local copy: --dataset {name}.jsonl (JSONL, a question and an 'answer' per line)"
        ) from None
    try:
        rows = datasets.load_dataset(repository, config, split=split)
    except Exception as error:  # noqa: BLE001 - offline, missing, renamed: one line either way
        raise UsageError(
            f"cannot load {repository} from the Hugging Face Hub ({str(error).splitlines()[0][:120]}); "
            "give a local file with --dataset PATH"
        ) from None
    stop = None if limit is None else offset + limit
    problems = [
        Problem(
            row.get("id", row.get("unique_id", i + 1)),
            i + 1,
            prompt=row.get(question),
            answer=_answer(row.get(answer_field)),
        )
        for i, row in enumerate(rows)
        if i >= offset and (stop is None or i < stop)
    ]
    if not problems:
        raise UsageError(f"{repository} holds no problems from --offset {offset} on; give a smaller --offset")
    missing = next((p for p in problems if not isinstance(p.prompt, str)), None)
    if missing is not None:
        raise UsageError(
            f"{repository} row {missing.line}: no '{question}' text field; name the question's field with --field"
        )
    refuse_duplicate_ids(repository, problems)
    return problems


def protocol_ids(tokenizer, problem: Problem, system: str | None = PROTOCOL_SYSTEM) -> torch.Tensor:
    """``[1, n]`` ids in the paper's protocol: chat template with the system message (or the
    instruction written before the problem when the tokenizer has no template)."""
    if problem.messages is not None:
        return build_input_ids(tokenizer, settings=PromptSettings(), messages=problem.messages)
    if system and not has_chat_template(tokenizer):
        return build_input_ids(tokenizer, f"{system}\n\n{problem.prompt}", PromptSettings(chat_template=False))
    return build_input_ids(tokenizer, problem.prompt, PromptSettings(system=system))
