"""Accuracy of greedy reasoning under each policy and budget, the paper's protocol (``epikv eval``).

Each problem is prompted with the chat template and the system message "Please reason step by
step, and put your final answer within \\boxed{}.", decoded greedily, and judged by math-verify:
the model's answer is the last ``\\boxed{}`` of its output (or a GSM8K-style ``#### N`` when no box
is written), the reference is the dataset's answer (for GSM8K the number after ``####``).
One record per problem x policy x budget, yielded as it finishes (the CLI appends each to ``--output``;
``--resume`` continues).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from epikv_cli.config import SamplingSettings
from epikv_cli.data.jsonl import id_key
from epikv_cli.data.problems import (
    HUB_DATASETS,
    Problem,
    load_hub_dataset,
    load_problems,
    protocol_ids,
)
from epikv_cli.errors import UsageError, failure_line
from epikv_cli.experiments.fidelity import Config
from epikv_cli.runtime.batchgen import BatchedGeneration, Request
from epikv_cli.runtime.generation import Generation

Z95 = 1.959963984540054


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    index = brace
    while index < len(text):
        if text[index] == "\\":  # an escaped character (\{ \} of a set or a \left\{ ... \right.): no group brace
            index += 2
            continue
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[brace + 1 : index].strip()
        index += 1
    return None


def after_hashes(text: str) -> str | None:
    """What follows the last ``####`` (GSM8K's answer form), commas dropped."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().splitlines()
    return answer[0].replace(",", "").strip() if answer else None


#: A GSM8K-style answer line, ``#### N`` with N a number (not a markdown heading such as ``#### 2. Add them``).
HASHED_NUMBER = re.compile(r"####[^\S\n]*\$?[^\S\n]*(-?(?:\d[\d,]*(?:\.\d+)?|\.\d+))[^\S\n]*\.?[^\S\n]*$", re.MULTILINE)


def hashed_number(text: str) -> str | None:
    """The number of the last ``#### N`` line of ``text``, commas dropped."""
    numbers = HASHED_NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def model_answer(text: str) -> str | None:
    """The model's final answer: the last boxed expression, else the last ``#### N`` line's number."""
    return last_boxed(text) or hashed_number(text)


def reference_answer(answer: str) -> str:
    """The dataset's answer as an expression (GSM8K solutions end in ``#### N``)."""
    return after_hashes(answer) or answer.strip()


def is_correct(prediction: str | None, reference: str) -> bool:
    """Whether math-verify finds ``prediction`` equal to ``reference`` (both read as LaTeX)."""
    if not prediction:
        return False
    from math_verify import parse, verify  # noqa: PLC0415 (math-verify: imports sympy (seconds), needed only to judge answers)

    gold = parse(f"${reference}$")
    guess = parse(f"${prediction}$")
    return bool(gold and guess and verify(gold, guess))


def wilson(correct: int, total: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if total == 0:
        return (math.nan, math.nan)
    p = correct / total
    centre = (p + Z95**2 / (2 * total)) / (1 + Z95**2 / total)
    half = Z95 * math.sqrt(p * (1 - p) / total + Z95**2 / (4 * total**2)) / (1 + Z95**2 / total)
    # at 0 or all correct the bound is exactly 0 or 1 (the float sum leaves 5.55e-17 and 0.9999999999999999)
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == total else min(1.0, centre + half)
    return (low, high)


@dataclass
class EvalRow:
    """Accuracy of one policy x budget."""

    policy: str
    budget: str
    problems: int
    correct: int
    #: None when no problem was answered (every one errored)
    accuracy: float | None
    low: float | None
    high: float | None
    no_answer: int
    errors: int
    mean_generated_tokens: float | None
    mean_tokens_per_s: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def summarise(records: list[dict], configs: list[Config]) -> list[EvalRow]:
    """One :class:`EvalRow` per config over ``records``; accuracy and interval None where none was answered."""
    rows = []
    for config in configs:
        mine = [r for r in records if r["policy"] == config.policy and r["budget"] == config.budget.text]
        answered = [r for r in mine if r.get("error") is None]
        correct = sum(bool(r["correct"]) for r in answered)
        low, high = wilson(correct, len(answered)) if answered else (None, None)  # JSON has no NaN
        speeds = [r["decode_tokens_per_s"] for r in answered if r.get("decode_tokens_per_s")]
        lengths = [r["generated_tokens"] for r in answered]
        rows.append(
            EvalRow(
                config.policy,
                config.budget.text,
                len(answered),
                correct,
                correct / len(answered) if answered else None,
                low,
                high,
                sum(r["prediction"] is None for r in answered),
                len(mine) - len(answered),
                statistics.fmean(lengths) if lengths else None,
                statistics.fmean(speeds) if speeds else None,
            )
        )
    return rows


def evaluate_one(loaded, problem: Problem, config: Config, max_new_tokens: int) -> dict:
    """Generate greedily for one problem under one config and judge the answer."""
    ids = protocol_ids(loaded.tokenizer, problem)
    try:
        generation = Generation(
            loaded.model,
            loaded.tokenizer,
            ids,
            config.settings(ids.shape[1]),
            SamplingSettings(max_new_tokens=max_new_tokens),
        )
        for _ in generation:
            pass
    except Exception as error:  # noqa: BLE001 - a prompt too long for this budget, out of memory: this record's
        return judged(problem, config, error)
    return judged(problem, config, generation.result)


def evaluate_batched(loaded, work: list[tuple[Problem, Config]], max_new_tokens: int, batch_size: int):
    """``judged`` records of every (problem, config), decoded ``batch_size`` at a time, in finishing order."""

    sampling = SamplingSettings(max_new_tokens=max_new_tokens)
    requests = []
    for index, (problem, config) in enumerate(work):
        ids = protocol_ids(loaded.tokenizer, problem)
        requests.append(Request(index, ids, config.settings(ids.shape[1]), sampling))
    finished: set[int] = set()
    try:
        for index, outcome in BatchedGeneration(
            loaded.model, loaded.tokenizer, requests, batch_size, [r.cache for r in requests]
        ):
            finished.add(index)
            yield judged(*work[index], outcome)
    except Exception:  # noqa: BLE001 - out of memory in a batched step: the unfinished ones one at a time, as batch files
        for index, (problem, config) in enumerate(work):
            if index not in finished:
                yield evaluate_one(loaded, problem, config, max_new_tokens)


def judged(problem: Problem, config: Config, result) -> dict:
    """The JSONL record of one answer (or of the error that kept it from running), judged by math-verify."""
    record = {"id": problem.id, "line": problem.line, "policy": config.policy, "budget": config.budget.text}
    if isinstance(result, Exception):
        return {**record, "error": failure_line(result)}
    prediction = model_answer(result.text)
    reference = reference_answer(problem.answer)
    return {
        **record,
        "reference": reference,
        "prediction": prediction,
        "correct": is_correct(prediction, reference),
        "prompt_tokens": result.prompt_tokens,
        "generated_tokens": result.generated_tokens,
        "stop_reason": result.stop_reason,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "text": result.text,
        "error": None,
    }


def _key(record: dict) -> str:
    """``record``'s problem id, policy and budget as one comparable key."""
    return json.dumps([record["id"], record.get("policy"), record.get("budget")])


def load_eval_problems(
    dataset: str, field: str | None, answer_field: str, limit: int | None, offset: int
) -> list[Problem]:
    """The problems of ``dataset`` (a JSONL file, or a name loaded from the Hub), each with its reference answer."""
    if dataset in HUB_DATASETS and not Path(dataset).exists():
        problems = load_hub_dataset(dataset, limit, offset, field, answer_field)
    else:
        problems = load_problems(
            Path(dataset), field=field, answer_field=answer_field, limit=limit, offset=offset, option="--dataset"
        )
    missing = next((p for p in problems if p.answer is None), None)
    if missing is not None:
        raise UsageError(
            f"{dataset}:{missing.line}: no '{answer_field}' field; name the reference answer's field with "
            "--answer-field"
        )
    return problems


def check_references(path: Path | None, previous: list[dict], problems: list[Problem], dataset: str) -> None:
    """Refuse (:class:`UsageError`) to continue ``path`` when a finished record of one of ``problems`` was judged
    against another reference answer than ``dataset`` gives now (an answer corrected since, another
    ``--answer-field``): its ``correct`` would be counted beside ones judged against the new answer."""
    references = {id_key(p.id): p for p in problems}
    for record in previous:
        problem = references.get(id_key(record["id"]))
        if record.get("error") is not None or problem is None or "reference" not in record:
            continue
        reference = reference_answer(problem.answer)
        if record["reference"] != reference:
            raise UsageError(
                f"--resume: id {json.dumps(record['id'])} in {path} was judged against the answer "
                f"{json.dumps(record['reference'])}, {dataset} line {problem.line} gives {json.dumps(reference)}; "
                "rerun with the same answers, or use --overwrite or another --output"
            )


def remaining(problems: list[Problem], configs: list[Config], previous: list[dict]) -> list[tuple[Problem, Config]]:
    """Every (problem, config) that no earlier record (of an ``--output`` being resumed) answered without an error."""
    done = {_key(r) for r in previous if r.get("error") is None}
    return [
        (p, c)
        for p in problems
        for c in configs
        if _key({"id": p.id, "policy": c.policy, "budget": c.budget.text}) not in done
    ]


def without_retried(previous: list[dict], work: list[tuple[Problem, Config]]) -> list[dict]:
    """``previous`` less its error records of a (problem, config) in ``work``: the records that run replaces."""
    again = {_key({"id": p.id, "policy": c.policy, "budget": c.budget.text}) for p, c in work}
    return [r for r in previous if r.get("error") is None or _key(r) not in again]


def eval_records(
    loaded, work: list[tuple[Problem, Config]], max_new_tokens: int, batch_size: int = 1
) -> Iterator[dict]:
    """The judged record of every (problem, config) of ``work``: in order one at a time, or decoded ``batch_size``
    at a time (continuous batching, same greedy results) in finishing order."""
    if batch_size > 1:
        yield from evaluate_batched(loaded, work, max_new_tokens, batch_size)
    else:
        yield from (evaluate_one(loaded, problem, config, max_new_tokens) for problem, config in work)
