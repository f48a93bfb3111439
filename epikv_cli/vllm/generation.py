"""Generate on the vLLM engine: a queue of prompts in, one :class:`GenerationResult` per prompt out, as each ends.

The same results as the transformers engine's (``--json``, the JSONL lines of ``--prompts``), so that scripts read
either. vLLM schedules the requests (continuous batching); each request's ring reports its evictions and its
policy's report (:meth:`~epikv_cli.vllm.ring.RingCache.request_for`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.core.memory import peak_memory
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import evicts, make_policy
from epikv_cli.runtime.batchgen import Request
from epikv_cli.runtime.generation import GenerationResult
from epikv_cli.vllm.engine import ring_of
from epikv_cli.vllm.ring import check_prompt


def sampling_params(sampling: SamplingSettings, eos_ids: set[int]) -> SamplingParams:
    """vLLM's sampling for epikv's ``sampling`` (greedy below the greedy temperature; stop texts, kept in the text
    as the transformers engine keeps them; EOS ids). Sampling without ``--seed`` draws a fresh seed, as the
    transformers engine does (vLLM's own default would be the engine's seed: the same text at every run)."""
    seed = sampling.seed
    if seed is None and not sampling.greedy:
        seed = secrets.randbits(63)
    return SamplingParams(
        temperature=0.0 if sampling.greedy else sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k else -1,
        seed=seed,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        max_tokens=sampling.max_new_tokens,
        ignore_eos=sampling.ignore_eos,
        stop_token_ids=sorted(eos_ids) if not sampling.ignore_eos else None,
    )


@dataclass
class _Running:
    request: Request
    started: float
    first_token: float | None = None
    texts: list[str] = field(default_factory=list)
    latest: Any = None  # its latest RequestOutput


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during :class:`VllmGeneration`: ``results`` holds what each unfinished request had generated, by key
    (``stop_reason`` ``interrupted``)."""

    def __init__(self, results: dict) -> None:
        super().__init__()
        self.results = results


class VllmGeneration:
    """Iterate for ``(key, GenerationResult or UsageError)`` pairs as requests finish (like
    :class:`~epikv_cli.runtime.batchgen.BatchedGeneration`).

    Args:
        llm: an engine from :func:`~epikv_cli.vllm.engine.build_engine` (``report=True``) for ``cache``.
        requests: the queue; a request whose cache settings are not ``cache`` fails with a UsageError (one engine
            runs one policy and budget).
        cache: the engine's settings.
        eos_ids: the model's end-of-sequence tokens.
        on_text: called with ``(key, new text)`` as each request's text grows (streaming output), if given.
    """

    def __init__(
        self,
        llm,
        requests: Iterable[Request],
        cache: CacheSettings,
        eos_ids: set[int],
        on_text: Callable[[Any, str], None] | None = None,
    ) -> None:
        self.llm = llm
        self.requests = requests
        self.cache = cache
        self.eos_ids = eos_ids
        self.on_text = on_text
        self.ring = ring_of(llm) if evicts(cache.policy) else None

    def _refusal(self, request: Request) -> UsageError | None:
        """Why ``request`` cannot run on this engine, or None."""
        if request.cache != self.cache:
            return UsageError(
                "on --engine vllm every prompt runs under the command's --policy, --budget and policy options; "
                "drop this line's own cache settings"
            )
        try:
            if evicts(self.cache.policy):
                check_prompt(make_policy(self.cache), self.cache, request.input_ids.shape[1])
        except UsageError as error:
            return error
        return None

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        engine = self.llm.llm_engine
        running: dict[str, _Running] = {}
        for number, request in enumerate(self.requests):
            refusal = self._refusal(request)
            if refusal is not None:
                yield request.key, refusal
                continue
            request_id = str(number)
            running[request_id] = _Running(request, time.perf_counter())
            ids = request.input_ids[0].tolist()
            engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=ids), sampling_params(request.sampling, self.eos_ids)
            )
        try:
            while engine.has_unfinished_requests():
                step_started = time.perf_counter()
                for output in engine.step():
                    state = running.get(output.request_id)
                    if state is None:
                        continue
                    state.latest = output
                    completion = output.outputs[0]
                    if completion.token_ids and state.first_token is None:
                        # the prompt's forward ran in this step (no chunked prefill): its prefill time, not the time
                        # it waited for a free slot
                        state.started = max(state.started, step_started)
                        state.first_token = time.perf_counter()
                    if self.on_text is not None:
                        shown = sum(map(len, state.texts))
                        if len(completion.text) > shown:
                            state.texts.append(completion.text[shown:])
                            self.on_text(state.request.key, completion.text[shown:])
                    if output.finished:
                        del running[output.request_id]
                        yield state.request.key, self._result(state, output)
        except KeyboardInterrupt:
            partial = {
                state.request.key: self._result(state, state.latest, interrupted=True)
                for state in running.values()
                if state.latest is not None
            }
            raise GenerationInterrupted(partial) from None
        finally:
            if running:  # interrupted: the unfinished requests leave the engine
                engine.abort_request(list(running))

    def _result(self, state: _Running, output, interrupted: bool = False) -> GenerationResult:
        """``output``'s result; ``interrupted``: what it had when Ctrl-C came."""
        completion = output.outputs[0]
        now = time.perf_counter()
        first = state.first_token or now
        generated = len(completion.token_ids)
        decode_seconds = max(now - first, 0.0)
        ring = None
        if self.ring is not None:
            ring = self.ring.request_for(list(output.prompt_token_ids), list(completion.token_ids), interrupted)
        memory, kind = peak_memory(torch.device("cpu"))
        if interrupted:
            reason = "interrupted"
        elif completion.finish_reason == "length":
            reason = "length"
        elif completion.stop_reason is None or completion.stop_reason in self.eos_ids:
            reason = "eos"
        else:
            reason = "stop"
        return GenerationResult(
            text=completion.text,
            prompt_tokens=len(output.prompt_token_ids),
            generated_tokens=generated,
            evicted=ring.evicted_total if ring is not None else 0,
            peak_stored=ring.peak_stored if ring is not None else 0,
            budget=self.cache.budget if evicts(self.cache.policy) else None,
            policy=self.cache.policy,
            stop_reason=reason,
            prefill_seconds=round(first - state.started, 6),
            decode_seconds=round(decode_seconds, 6),
            decode_tokens_per_s=round((generated - 1) / decode_seconds, 3)
            if generated > 1 and decode_seconds
            else None,
            peak_memory_bytes=memory,
            peak_memory_kind=kind,
            kv_cache_bytes=self.ring.request_bytes() if self.ring is not None else 0,
            token_ids=list(completion.token_ids),
            policy_report=ring.policy.report() if ring is not None else {},
        )
