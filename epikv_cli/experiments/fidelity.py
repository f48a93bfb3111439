"""How far each policy and budget keeps the model from its full-cache self (``epikv fidelity``).

For each prompt, a full-cache stream generates the greedy reference (EOS ignored) and, in lockstep,
every policy x budget replays exactly those tokens teacher-forced under its own cache. At each
position the next-token distributions are compared: KL(full || policy), top-1 agreement, and the
policy's negative log-likelihood of the reference token. Nothing per token is kept beyond running
sums, and the prompt is prefilled once per stream.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from epikv_cli.config import CacheSettings, list_items
from epikv_cli.data.problems import Problem, protocol_ids
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import check_settings, evicts, make_policy, parse_policy_spec
from epikv_cli.runtime.batched import BatchDecoder

_BUDGET = re.compile(r"^(\+?)([1-9]\d*)$")


@dataclass(frozen=True)
class BudgetSpec:
    """A budget as given: absolute (``128``) or relative to each prompt (``+96`` = prompt length + 96)."""

    text: str
    relative: bool
    tokens: int

    @classmethod
    def parse(cls, text: str) -> BudgetSpec:
        match = _BUDGET.match(text.strip())
        if match is None:
            raise UsageError(
                f"--budgets: {text.strip()!r} is not a budget; give a positive number (128) or +N (prompt + N)"
            )
        return cls(text.strip(), bool(match.group(1)), int(match.group(2)))

    @classmethod
    def parse_list(cls, text: str) -> tuple[BudgetSpec, ...]:
        specs = tuple(cls.parse(part) for part in list_items(text, "--budgets"))
        if not specs:
            raise UsageError("--budgets is empty; give budgets such as +64,+128,256")
        texts = [spec.text for spec in specs]
        twice = next((t for t in texts if texts.count(t) > 1), None)
        if twice is not None:
            raise UsageError(f"--budgets lists {twice} twice: {','.join(texts)}; give each budget once")
        return specs

    def resolve(self, prompt_len: int) -> int:
        return prompt_len + self.tokens if self.relative else self.tokens


#: The budget column of the full cache, which has none (it runs once, whatever --budgets says).
NO_BUDGET = BudgetSpec("none", False, 0)


@dataclass
class Agreement:
    """Running sums for one policy x budget on one prompt; ``after_full`` counts positions whose logits
    were computed after the cache first evicted."""

    positions: int = 0
    kl: float = 0.0
    top1: int = 0
    nll: float = 0.0
    after_full: int = 0
    kl_after_full: float = 0.0
    top1_after_full: int = 0
    #: with ``--trace``: every position's KL, in order (None: not kept)
    trace: list[float] | None = None

    def add(self, kl: float, agree: bool, nll: float, after_full: bool) -> None:
        """One position: KL(full || policy), whether the top-1 tokens agree, the policy's NLL of the reference token."""
        if self.trace is not None:
            self.trace.append(round(kl, TRACE_DIGITS))
        self.positions += 1
        self.kl += kl
        self.top1 += agree
        self.nll += nll
        if after_full:
            self.after_full += 1
            self.kl_after_full += kl
            self.top1_after_full += agree

    def summary(self) -> dict:
        after = self.after_full or None
        summary = {
            "kl_after_full": self.kl_after_full / after if after else None,
            "kl_all": self.kl / self.positions,
            "top1_after_full": self.top1_after_full / after if after else None,
            "top1_all": self.top1 / self.positions,
            "perplexity": math.exp(self.nll / self.positions),
            "positions_after_full": self.after_full,
        }
        if self.trace is not None:
            summary["kl_by_position"] = self.trace
        return summary


@dataclass
class Config:
    """One policy x budget of the comparison; ``policy`` is the spec as given (``epikv2:period=32``)."""

    policy: str
    budget: BudgetSpec

    @property
    def label(self) -> str:
        return f"{self.policy} {self.budget.text}"

    def settings(self, prompt_len: int) -> CacheSettings:
        name, options = parse_policy_spec(self.policy)
        return check_settings(
            CacheSettings(
                budget=self.budget.resolve(prompt_len) if evicts(name) else None, policy=name, options=options
            )
        )


#: decimals kept of each position's KL in a ``--trace`` record
TRACE_DIGITS = 6

#: n-gram length of :func:`repeated_ngram_share`
REPEAT_NGRAM = 8


def repeated_ngram_share(prompt: list[int], generated: list[int], n: int = REPEAT_NGRAM) -> float | None:
    """Share of the generated tokens that close an ``n``-gram seen earlier in prompt + generation.

    Near 1 the reference is a copy loop (it repeats itself or the prompt), and fidelity then measures
    how well a policy keeps the loop going; a reasoning text is far lower. ``None`` when nothing is generated.
    """
    if not generated:
        return None
    sequence = prompt + generated
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for end in range(n, len(sequence) + 1):
        gram = tuple(sequence[end - n : end])
        if end > len(prompt) and gram in seen:
            repeated += 1
        seen.add(gram)
    return repeated / len(generated)


def kept_age(cache, prompt_len: int) -> float | None:
    """Mean age (logical length minus position) of the generated tokens still cached (over every layer and
    KV head for a granular policy)."""
    if getattr(cache, "head_slots", None) is not None:
        return cache.head_slots.kept_age(cache.stored, cache.seen, prompt_len)
    positions = cache.live_positions()
    generated = positions[positions >= prompt_len]
    return float((cache.seen - generated).float().mean()) if generated.numel() else None


def replay(
    model,
    ids: torch.Tensor,
    configs: list[Config],
    new_tokens: int,
    advance=lambda: None,
    trace: bool = False,
) -> tuple[list[int], list[dict]]:
    """Reference tokens of one prompt and, per config, its agreement with the full cache.

    The full-cache reference and every config are rows of one batch, fed the same token each step
    (one forward per step for all of them). A config whose budget cannot hold this prompt gets
    ``{"error": ...}`` instead of numbers. ``trace``: each config's result also lists every position's
    KL (``kl_by_position``, ``new_tokens`` floats).
    """
    prompt_len = ids.shape[1]
    total = prompt_len + new_tokens
    results: list[dict] = []
    runnable: list[tuple[int, CacheSettings]] = []
    for index, config in enumerate(configs):
        row = {"policy": config.policy, "budget": config.budget.text}
        results.append(row)
        try:
            settings = config.settings(prompt_len)
            row["budget_tokens"] = settings.budget
            make_policy(settings).check_budget(prompt_len, settings.budget)
        except UsageError as error:
            row["error"] = str(error)
            continue
        runnable.append((index, settings))
    reference_settings = CacheSettings(budget=None, policy="full")
    with BatchDecoder(model, [reference_settings] + [s for _, s in runnable]) as decoder:
        logits = torch.stack(
            [decoder.add(ids, reference_settings, total)] + [decoder.add(ids, s, total) for _, s in runnable]
        )
        agreements = [Agreement(trace=[] if trace else None) for _ in runnable]
        # per config: what it had evicted before the forward that computed these logits (the prefill's: nothing).
        # Not evicted_total less last_evicted: a per-head policy counts slots per head but lists only the positions
        # no head holds any more, so its first eviction would count the logits computed before it.
        evicted_before = [0] * len(runnable)
        tokens: list[int] = []
        for step in range(new_tokens):
            log_probs = torch.log_softmax(logits[0].float(), dim=-1)
            token = int(log_probs.argmax())
            tokens.append(token)
            if agreements:  # every config at once: [configs, vocab]
                policy_log_probs = torch.log_softmax(logits[1:].float(), dim=-1)
                kl = (log_probs.exp() * (log_probs - policy_log_probs)).sum(dim=-1).tolist()
                agree = (policy_log_probs.argmax(dim=-1) == token).tolist()
                nll = (-policy_log_probs[:, token]).tolist()
            for index, agreement in enumerate(agreements):
                agreement.add(kl[index], agree[index], nll[index], evicted_before[index] > 0)
            advance()
            if step == new_tokens - 1:
                break
            evicted_before = [decoder.cache.rows[row].evicted_total for row in range(1, len(runnable) + 1)]
            logits = decoder.step(torch.full((decoder.batch,), token))
        for row, ((index, _), agreement) in enumerate(zip(runnable, agreements), start=1):
            view = decoder.row(row)
            results[index].update(agreement.summary(), evicted=view.evicted_total, kept_age=kept_age(view, prompt_len))
    return tokens, results


METRICS = ("kl_after_full", "kl_all", "top1_after_full", "top1_all", "perplexity", "kept_age")


@dataclass
class SummaryRow:
    """Means over prompts for one policy x budget (prompts where it could not run are left out)."""

    policy: str
    budget: str
    prompts: int = 0
    values: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "budget": self.budget, **self.values, "prompts_counted": self.prompts}


def summarise(records: list[dict], configs: list[Config]) -> list[SummaryRow]:
    """Means over the prompt records of each config's metrics."""
    rows = []
    for config in configs:
        found = [
            r
            for record in records
            for r in record["results"]
            if r["policy"] == config.policy and r["budget"] == config.budget.text and "error" not in r
        ]
        values = {}
        for metric in METRICS:
            present = [r[metric] for r in found if r.get(metric) is not None]
            values[metric] = statistics.fmean(present) if present else None  # JSON keeps every digit
        rows.append(SummaryRow(config.policy, config.budget.text, len(found), values))
    return rows


def unfinished(
    problems: list[Problem], configs: list[Config], previous: list[dict]
) -> list[tuple[Problem, list[Config]]]:
    """Each problem with the configs no earlier record (of an ``--output`` being resumed) holds for its id: all of
    them for a new problem, the policies and budgets added since for a finished one; problems with none left out."""
    done: dict[str, set[tuple[str, str]]] = {}
    for record in previous:
        done.setdefault(json.dumps(record["id"]), set()).update(
            (result["policy"], result["budget"]) for result in record.get("results", [])
        )
    work = []
    for problem in problems:
        have = done.get(json.dumps(problem.id), set())
        missing = [c for c in configs if (c.policy, c.budget.text) not in have]
        if missing:
            work.append((problem, missing))
    return work


def fidelity_records(
    loaded,
    work: list[tuple[Problem, list[Config]]],
    new_tokens: int,
    trace: bool = False,
    advance=lambda: None,
    status=lambda text: None,
) -> Iterator[dict]:
    """One record per problem of ``work``, as it finishes: the reference's length and repetition, and the results
    of the configs ``work`` pairs it with.

    ``status(text)`` names the problem about to run, ``advance()`` follows every reference token. ``trace``:
    each record also holds the reference token ids and every position's KL per config.
    """
    for problem, configs in work:
        ids = protocol_ids(loaded.tokenizer, problem)
        status(f"prompt {problem.id} ({ids.shape[1]} tokens)")
        tokens, results = replay(loaded.model, ids, configs, new_tokens, advance, trace=trace)
        record = {
            "id": problem.id,
            "line": problem.line,
            "prompt_tokens": ids.shape[1],
            "new_tokens": new_tokens,
            "reference_repeats": repeated_ngram_share(ids[0].tolist(), tokens),
            "results": results,
        }
        if trace:
            record["reference_tokens"] = tokens
        yield record


def check_configs(policies: str, budgets: str) -> list[Config]:
    """Every policy x budget, policies validated against the registry."""
    names = list_items(policies, "--policies")
    if not names:
        raise UsageError("--policies is empty; give names such as streaming,epikv,h2o")
    for name in names:  # a spec is NAME[:key=value...]; its settings are checked here, before any model loads
        policy, options = parse_policy_spec(name)
        check_settings(CacheSettings(budget=4096 if evicts(policy) else None, policy=policy, options=options))
    if len(set(names)) != len(names):
        raise UsageError(f"--policies lists a policy twice: {','.join(names)}")
    specs = BudgetSpec.parse_list(budgets)
    return [
        config
        for name in names
        for config in ([Config(name, s) for s in specs] if evicts(name) else [Config(name, NO_BUDGET)])
    ]
