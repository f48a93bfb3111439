"""Prefill, then decode token by token under the budget cache; yield one event per generated token.

Every consumer (plain printer, JSON, the panel, benchmarks) reads the same :class:`StepEvent` stream.
Sampling goes through transformers' logits processors and stopping criteria.
"""

from __future__ import annotations

import gc
import inspect
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Iterator

import torch
from transformers import (
    LogitsProcessorList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.core.cache import HEADROOM
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.memory import peak_memory, reset_peak
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import make_policy
from epikv_cli.runtime.session import EpiKVSession
from epikv_cli.runtime.stream import forward_step, input_device, warn_beyond_context
from epikv_cli.runtime.textstream import IncrementalDetokenizer


@dataclass
class StepEvent:
    """One generated token and the cache state after the forward that produced its logits.

    Attributes:
        index: 0-based index among generated tokens.
        token_id: the token chosen.
        text: newly printable text (may be empty while a multi-byte character is incomplete).
        position: logical position this token will occupy.
        stored: live entries per evicting layer.
        seen: logical length of the cached sequence.
        evicted: logical positions evicted by that forward.
        scored: ``(position, score)`` of tokens scored by that forward (EpiKV).
        logits: ``[vocab]`` raw logits that produced this token, only when the generation was made with
            ``keep_logits=True`` (otherwise None: a consumer keeping events should not keep vocab-sized tensors).
        elapsed: seconds since generation started (prefill included).
        evicted_total: entries each evicting layer (each KV head, with per-head keep-sets) has dropped
            so far, the count the summary reports; with per-head keep-sets ``evicted`` names only the
            positions no head holds any more, so the two differ.
    """

    index: int
    token_id: int
    text: str
    position: int
    stored: int
    seen: int
    evicted: list[int]
    scored: list[tuple[int, float]]
    logits: torch.Tensor | None = field(repr=False)
    elapsed: float
    evicted_total: int = 0


@dataclass
class GenerationResult:
    """Summary of one generation; ``to_dict()`` is what ``--json`` prints.

    ``policy_report`` is what the policy says of its run (:meth:`~epikv_cli.policies.base.Policy.report`: EpiKV's
    bands and where they came from, the tokens whose score signal was not finite). ``to_dict()`` also repeats its
    ``bands``, ``bands_source`` and ``nonfinite_scores`` under the top-level keys of earlier releases, for scripts
    that read them; those copies go in the next release.
    """

    text: str
    prompt_tokens: int
    generated_tokens: int
    evicted: int
    peak_stored: int
    budget: int | None
    policy: str
    stop_reason: str  # "eos", "stop", "length" or "interrupted"
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_s: float | None
    peak_memory_bytes: int
    peak_memory_kind: str
    kv_cache_bytes: int
    #: each phase's own peak; None for a row of a batch, whose phases overlap other rows' (its
    #: ``peak_memory_bytes`` is then the batch's peak while it ran)
    prefill_peak_memory_bytes: int | None = None
    decode_peak_memory_bytes: int | None = None
    token_ids: list[int] = field(repr=False, default_factory=list)
    policy_report: dict = field(default_factory=dict)

    #: Top-level keys of earlier releases that repeat ``policy_report`` entries, with their value when it has none.
    LEGACY_KEYS: ClassVar[dict[str, object]] = {"bands": None, "bands_source": None, "nonfinite_scores": 0}

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("token_ids")
        report = data.pop("policy_report")
        data.update({key: report.get(key, default) for key, default in self.LEGACY_KEYS.items()})
        data["policy_report"] = report
        return data

    @classmethod
    def nothing(cls, policy: str, budget: int | None) -> GenerationResult:
        """The result of a run interrupted before generation began: zero tokens, same fields."""
        memory, kind = peak_memory(torch.device("cpu"))
        return cls(
            text="",
            prompt_tokens=0,
            generated_tokens=0,
            evicted=0,
            peak_stored=0,
            budget=budget,
            policy=policy,
            stop_reason="interrupted",
            prefill_seconds=0.0,
            decode_seconds=0.0,
            decode_tokens_per_s=None,
            peak_memory_bytes=memory,
            peak_memory_kind=kind,
            kv_cache_bytes=0,
        )


def build_logits_processors(sampling: SamplingSettings) -> LogitsProcessorList:
    """transformers' warpers for temperature, top-k and top-p (empty when greedy)."""
    processors = LogitsProcessorList()
    if sampling.greedy:
        return processors
    processors.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        processors.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


def eos_token_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    return end_of_sequence_ids(getattr(model, "generation_config", None), model.config, tokenizer)


def end_of_sequence_ids(*sources) -> set[int]:
    """Every ``eos_token_id`` of ``sources`` (a generation config, a model config, a tokenizer, or None): an id, a
    list of ids, or None each."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


class Sampler:
    """One sequence's next token from its logits: transformers' warpers, then argmax or a seeded draw."""

    def __init__(self, sampling: SamplingSettings) -> None:
        self.sampling = sampling
        self.processors = build_logits_processors(sampling)
        self.generator: torch.Generator | None = None  # made on the logits' device at the first draw

    def choose(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``[1]`` token (on the logits' device, no host sync) for ``ids`` ``[1, n]`` and ``logits`` ``[vocab]``."""
        scores = self.processors(ids, logits.float().unsqueeze(0))
        if self.sampling.greedy:
            return scores.argmax(dim=-1)
        if self.generator is None:
            self.generator = torch.Generator(device=scores.device)
            seed = self.sampling.seed if self.sampling.seed is not None else secrets.randbits(63)
            self.generator.manual_seed(seed)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)[:, 0]


class Stopper:
    """Why a sequence ends after its latest token: ``eos``, ``stop`` (a stop string), ``length``, or None."""

    def __init__(self, model, tokenizer, sampling: SamplingSettings) -> None:
        self.limit = sampling.max_new_tokens
        self.eos = set() if sampling.ignore_eos else eos_token_ids(model, tokenizer)
        self.strings = StopStringCriteria(tokenizer, list(sampling.stop)) if sampling.stop else None

    def reason(self, token_id: int, ids: torch.Tensor, generated: int) -> str | None:
        if token_id in self.eos:
            return "eos"
        if self.strings is not None and bool(self.strings(ids, None)[0]):
            return "stop"
        if generated == self.limit:
            return "length"
        return None


class TokenBuffer:
    """The ``[1, n]`` token ids of one sequence on one device, grown by doubling as tokens arrive.

    Nothing is sized by max-new-tokens up front, so ``-n 100000000`` costs only what is generated.
    """

    def __init__(self, prompt: torch.Tensor, room: int) -> None:
        self.length = prompt.shape[1]
        self._buffer = torch.empty((1, self.length + max(room, 1)), dtype=torch.long, device=prompt.device)
        self._buffer[:, : self.length] = prompt

    def append(self, token: torch.Tensor) -> None:
        """Add one token (a one-element tensor on this buffer's device)."""
        if self.length == self._buffer.shape[1]:
            grown = self._buffer.new_empty((1, 2 * self.length))
            grown[:, : self.length] = self._buffer
            self._buffer = grown
        self._buffer[:, self.length] = token
        self.length += 1

    @property
    def ids(self) -> torch.Tensor:
        """``[1, n]``: every token so far, prompt included (a view)."""
        return self._buffer[:, : self.length]


class Generation:
    """One prompt's generation. Iterate for :class:`StepEvent`s; read :attr:`result` afterwards.

    Args:
        model: a loaded causal LM (batch size 1).
        tokenizer: its tokenizer (for text and stop strings).
        input_ids: ``[1, prompt_len]`` prompt ids.
        cache: budget, policy, recent window, bands, positions.
        sampling: decoding settings.
        keep_logits: put each step's logits on its event.

    If iteration stops early (Ctrl-C, ``close()``), :attr:`result` still describes the tokens produced,
    with ``stop_reason="interrupted"``.
    """

    def __init__(
        self,
        model,
        tokenizer,
        input_ids: torch.Tensor,
        cache: CacheSettings,
        sampling: SamplingSettings,
        keep_logits: bool = False,
    ):
        self.model = model
        self.keep_logits = keep_logits
        self.tokenizer = tokenizer
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise UsageError(
                f"Generation decodes one sequence: input_ids must be [1, prompt_len], got {list(input_ids.shape)}; "
                "for a batch, use epikv_cli.attach(model, ..., batch_size=N) with model.generate"
            )
        self.input_ids = input_ids
        warn_beyond_context(model, input_ids.shape[1])
        self.cache_settings = cache
        self.sampling = sampling
        self.result: GenerationResult | None = None
        self.tail_text = ""  # text the detokenizer still held when generation ended
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        #: the policy of this generation (its options may pick the variant: lagkv:chunks=positions scores, lagkv
        #: does not), set up and run by the session when iteration starts
        self.policy = make_policy(cache)
        self._policy_used = False
        #: whether the policy gives each token a frozen score (the panel's sparkline)
        self.policy_has_scores = self.policy.spikes
        #: whether each KV head keeps its own set (a position leaves the model only when every head dropped it)
        self.policy_per_head = self.policy.granular
        #: EpiKV's bands and where they came from, e.g. "9:+1, 20:-1 (default ...)"; set when generation starts
        self.bands_description: str | None = None

    def _forward(self, session: EpiKVSession, ids: torch.Tensor) -> torch.Tensor:
        return forward_step(self.model, session, ids, self._logits_to_keep)

    def __iter__(self) -> Iterator[StepEvent]:
        model, sampling = self.model, self.sampling
        device = input_device(model)
        prompt = self.input_ids.to(device)
        prompt_len = prompt.shape[1]
        total = prompt_len + sampling.max_new_tokens

        sampler = Sampler(sampling)
        stopper = Stopper(model, self.tokenizer, sampling)

        sequence = TokenBuffer(prompt, room=min(sampling.max_new_tokens, HEADROOM))
        detok = IncrementalDetokenizer(self.tokenizer)
        stop_reason = "interrupted"
        generated = 0
        gc.collect()  # an earlier generation's cache sits in a reference cycle until collected: not this one's memory
        start = time.perf_counter()
        prefill_seconds = 0.0
        prefill_memory = None
        reset_peak(device)

        fresh, self._policy_used = not self._policy_used, True  # a second iteration starts from a new policy
        policy = self.policy if fresh else None
        with EpiKVSession(model, self.cache_settings, max_tokens=total, policy=policy) as session:
            session.defer_reads = True  # the policy's host values come with the sampled token: one sync per step
            session.policy.check_budget(prompt_len, session.cache.budget)
            report = session.policy.report()
            if report.get("bands"):
                pairs = ", ".join(f"{layer}:{sign:+.0f}" for layer, sign in report["bands"])
                self.bands_description = f"{pairs} ({report['bands_source']})"
            try:
                logits = self._forward(session, prompt)
                prefill_memory = peak_memory(device)[0]
                reset_peak(device)  # the decode peak is measured on its own
                for index in range(sampling.max_new_tokens):
                    token = sampler.choose(sequence.ids, logits)
                    values = host_copies([token] + session.pending_reads)  # the step's one read from the device
                    session.settle(values[1:])  # the policy scores, the cache evicts
                    token_id = int(values[0][0])
                    if index == 0:
                        prefill_seconds = time.perf_counter() - start
                    sequence.append(token.to(device))
                    generated = index + 1
                    last = session.last
                    yield StepEvent(
                        index=index,
                        token_id=token_id,
                        text=detok.push(token_id),
                        position=prompt_len + index,
                        stored=session.cache.stored,
                        seen=session.cache.seen,
                        evicted=last.evicted,
                        scored=[(p, s) for p in last.appended if (s := session.policy.score_of(p)) is not None],
                        logits=logits if self.keep_logits else None,
                        elapsed=time.perf_counter() - start,
                        evicted_total=session.cache.evicted_total,
                    )
                    ended = stopper.reason(token_id, sequence.ids, generated)
                    if ended:
                        stop_reason = ended
                        break
                    logits = self._forward(session, token.view(1, 1).to(device))
            finally:
                self._finish(
                    session,
                    detok,
                    sequence,
                    prompt_len,
                    generated,
                    stop_reason,
                    start,
                    prefill_seconds,
                    device,
                    prefill_memory,
                )

    def _finish(
        self,
        session,
        detok,
        sequence,
        prompt_len,
        generated,
        stop_reason,
        start,
        prefill_seconds,
        device,
        prefill_memory,
    ):
        if sys.is_finalizing():
            # a generation left unfinished and collected as the interpreter exits: nobody can read its result, and
            # making tensors then (the token ids below) aborts the process inside PyTorch
            return
        elapsed = time.perf_counter() - start
        decode_seconds = max(elapsed - prefill_seconds, 0.0) if generated else 0.0
        token_ids = sequence.ids[0, prompt_len:].tolist()
        memory, kind = peak_memory(device)
        if prefill_memory is None:  # stopped inside the prefill: all of it was prefill
            prefill_memory, memory = memory, 0
        self.tail_text = detok.flush()
        self.result = GenerationResult(
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
            prompt_tokens=prompt_len,
            generated_tokens=generated,
            evicted=session.cache.evicted_total,
            peak_stored=session.cache.peak_stored,
            budget=session.cache.budget,
            policy=self.cache_settings.policy,
            stop_reason=stop_reason,
            prefill_seconds=round(prefill_seconds, 6),
            decode_seconds=round(decode_seconds, 6),
            decode_tokens_per_s=round((generated - 1) / decode_seconds, 3)
            if generated > 1 and decode_seconds
            else None,
            peak_memory_bytes=max(prefill_memory, memory),
            peak_memory_kind=kind,
            kv_cache_bytes=session.cache.kv_bytes(),
            prefill_peak_memory_bytes=prefill_memory,
            decode_peak_memory_bytes=memory,
            token_ids=token_ids,
            policy_report=session.policy.report(),
        )
