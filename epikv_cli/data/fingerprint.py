"""What ``--resume`` checks before it continues a results file.

Every result line carries a fingerprint: ``prompt_sha256``, a hash of the prompt it answers (its text or
messages), and ``run``, the settings that shape its numbers (model, dtype, policy and options, budget, tokens to
generate, sampling, the prompt's system message and template). ``--resume`` continues a file only when every
finished line whose id the input still holds has that id's prompt and this run's settings; otherwise it refuses,
naming the first difference, so that no results file ever mixes two runs without a word.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epikv_cli.config import CacheSettings, ModelSettings, PromptSettings, SamplingSettings
from epikv_cli.data.jsonl import id_key, read_results
from epikv_cli.errors import UsageError

#: What to do about a refused resume.
REFUSED = "rerun with the same prompts and settings, or use --overwrite or another --output"


def prompt_digest(prompt: str | None, messages: list | None = None) -> str:
    """A short SHA-256 of a prompt's text or messages (16 hex digits: collisions are not a practical concern)."""
    value = messages if messages is not None else prompt
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def model_run(settings: ModelSettings) -> dict[str, Any]:
    """The model settings that change results: which model, how many of its layers, its dtype, and the engine and
    attention kernel when they are not the default ones (their float sums differ; results written before a key
    existed read as its default)."""
    run = {"model": settings.shape or settings.model or "demo", "layers": settings.layers, "dtype": settings.dtype}
    if settings.engine != "transformers":
        run["engine"] = settings.engine
    if settings.attn != "auto":
        run["attn"] = settings.attn
    return run


def cache_run(settings: CacheSettings) -> dict[str, Any]:
    """The cache settings that change results: policy, options, budget, recent window, bands, positions, seed."""
    return {
        "policy": settings.policy,
        "options": [list(pair) for pair in settings.options],
        "budget": settings.budget,
        "recent": settings.recent,
        "bands": [list(band) for band in settings.bands] if settings.bands is not None else None,
        "positions": settings.positions,
        "policy_seed": settings.seed,
    }


def sampling_run(settings: SamplingSettings) -> dict[str, Any]:
    """Every sampling setting (``-n``, temperature, top-p, top-k, seed, stop strings, ignore-eos)."""
    values = dataclasses.asdict(settings)
    return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}


def prompt_run(settings: PromptSettings) -> dict[str, Any]:
    """How prompts become tokens: the system message and whether the chat template applies."""
    return {"system": settings.system, "chat_template": settings.chat_template}


@dataclass(frozen=True)
class Fingerprint:
    """What one prompt's result lines carry: its prompt's digest and the run's settings; ``where`` the prompt comes
    from (``six.txt line 3``), for messages."""

    prompt_sha256: str
    run: dict
    where: str

    def stamp(self, record: dict) -> dict:
        """``record`` with ``prompt_sha256`` and ``run`` added."""
        record.update(prompt_sha256=self.prompt_sha256, run=self.run)
        return record


def problem_fingerprints(problems, run: dict, source: str) -> dict[str, Fingerprint]:
    """Id key -> :class:`Fingerprint` of every problem (``.id``, ``.line``, ``.prompt``, ``.messages``) of
    ``source``, all under ``run``."""
    return {
        id_key(p.id): Fingerprint(prompt_digest(p.prompt, p.messages), run, f"{source} line {p.line}") for p in problems
    }


def check_resume(path: Path, records: list[dict], expected: dict[str, Fingerprint]) -> None:
    """Refuse (:class:`UsageError`, one line) to continue ``path`` when one of its finished ``records`` answers
    an id of this run differently.

    ``expected``: id key (:func:`~epikv_cli.data.jsonl.id_key`) -> its :class:`Fingerprint`. Lines with an error are
    retried anyway and not checked; lines whose id this run does not hold are kept as they are.
    """
    for record in records:
        if record.get("error") is not None or id_key(record["id"]) not in expected:
            continue
        fingerprint = expected[id_key(record["id"])]
        digest, run, where = fingerprint.prompt_sha256, fingerprint.run, fingerprint.where
        if "run" not in record or "prompt_sha256" not in record:
            raise UsageError(
                f"--resume: {path} holds results without the prompts and settings they came from (an older epikv "
                f"wrote them), so they cannot be checked; use --overwrite or another --output"
            )
        if record["prompt_sha256"] != digest:
            raise UsageError(
                f"--resume: id {json.dumps(record['id'])} in {path} answers a different prompt than {where}; {REFUSED}"
            )
        difference = first_difference(record["run"], run)
        if difference is not None:
            key, before, now = difference
            raise UsageError(
                f"--resume: {path} was written with {key} = {json.dumps(before)}, this run has {key} = "
                f"{json.dumps(now)} (id {json.dumps(record['id'])}); {REFUSED}"
            )


def resumable(output: Path | None, resume: bool, fingerprints: dict[str, Fingerprint]) -> list[dict]:
    """The records of ``output`` that ``--resume`` continues (none without it), checked against this run's
    ``fingerprints`` (:func:`~epikv_cli.data.fingerprint.check_resume`), before any model loads. Shared by fidelity
    and eval."""
    previous = read_results(output) if resume and output is not None else []
    check_resume(output, previous, fingerprints)
    return previous


def first_difference(before: dict, now: dict) -> tuple[str, Any, Any] | None:
    """The first setting (in ``now``'s order, then ``before``'s) whose value differs, or None."""
    for key in [*now, *(k for k in before if k not in now)]:
        if before.get(key) != now.get(key):
            return key, before.get(key), now.get(key)
    return None
