"""Generate for a queue of prompts, up to ``batch_size`` at a time, refilling the batch as sequences end.

Each request keeps its own cache settings, sampling settings, stop condition and result; rows of
the batch never see each other (see :mod:`epikv_cli.batched`). With greedy decoding every result is
the one the request gets alone. Finished requests come out as soon as they end, in finishing order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from epikv_cli.config import CacheSettings, SamplingSettings
from epikv_cli.core.cache import HEADROOM
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.memory import peak_memory, reset_peak
from epikv_cli.errors import UsageError
from epikv_cli.runtime.batched import BatchDecoder
from epikv_cli.runtime.generation import GenerationResult, Sampler, Stopper, TokenBuffer
from epikv_cli.runtime.stream import input_device


@dataclass
class Request:
    """One prompt to generate for: ``key`` comes back with its result."""

    key: Any
    input_ids: torch.Tensor  # [1, prompt_len]
    cache: CacheSettings
    sampling: SamplingSettings


@dataclass
class _Running:
    request: Request
    sampler: Sampler
    stopper: Stopper
    sequence: TokenBuffer
    started: float
    prefill_seconds: float
    generated: int = 0


class BatchedGeneration:
    """Iterate for ``(key, GenerationResult or UsageError)`` pairs as requests finish.

    Args:
        model, tokenizer: the loaded model.
        requests: the queue (consumed lazily).
        batch_size: most sequences decoded together.
        settings: every cache setting the requests may use (so the batch taps what their policies read).
    """

    def __init__(
        self, model, tokenizer, requests: Iterable[Request], batch_size: int, settings: list[CacheSettings]
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.requests = iter(requests)
        self.batch_size = batch_size
        self.settings = settings
        self.device = input_device(model)

    def _join(
        self, decoder: BatchDecoder, running: list[_Running], logits: list[torch.Tensor]
    ) -> Iterator[tuple[Any, Any]]:
        """Fill the batch from the queue; yield requests that cannot run."""
        while len(running) < self.batch_size:
            request = next(self.requests, None)
            if request is None:
                return
            started = time.perf_counter()
            try:
                first = decoder.add(
                    request.input_ids.to(self.device),
                    request.cache,
                    request.input_ids.shape[1] + request.sampling.max_new_tokens,
                )
            except UsageError as error:
                yield request.key, error
                continue
            sequence = TokenBuffer(
                request.input_ids.to(self.device), room=min(request.sampling.max_new_tokens, HEADROOM)
            )
            running.append(
                _Running(
                    request,
                    Sampler(request.sampling),
                    Stopper(self.model, self.tokenizer, request.sampling),
                    sequence,
                    started,
                    time.perf_counter() - started,
                )
            )
            logits.append(first)

    def _result(self, decoder: BatchDecoder, row: int, state: _Running, stop_reason: str) -> GenerationResult:
        view = decoder.row(row)
        elapsed = time.perf_counter() - state.started
        decode_seconds = max(elapsed - state.prefill_seconds, 0.0)
        prompt_len = state.request.input_ids.shape[1]
        token_ids = state.sequence.ids[0, prompt_len:].tolist()
        memory, kind = peak_memory(self.device)
        return GenerationResult(
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
            prompt_tokens=prompt_len,
            generated_tokens=state.generated,
            evicted=view.evicted_total,
            peak_stored=view.row.peak_stored,
            budget=view.budget,
            policy=state.request.cache.policy,
            stop_reason=stop_reason,
            prefill_seconds=round(state.prefill_seconds, 6),
            decode_seconds=round(decode_seconds, 6),
            decode_tokens_per_s=round((state.generated - 1) / decode_seconds, 3)
            if state.generated > 1 and decode_seconds
            else None,
            peak_memory_bytes=memory,
            peak_memory_kind=kind,
            kv_cache_bytes=decoder.cache.kv_bytes(row),
            token_ids=token_ids,
            policy_report=decoder.policies[row].report(),
        )

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        reset_peak(self.device)
        with BatchDecoder(self.model, self.settings) as decoder:
            running: list[_Running] = []
            logits: list[torch.Tensor] = []
            yield from self._join(decoder, running, logits)
            while running:
                scores = torch.stack(logits)
                tokens = torch.cat(
                    [state.sampler.choose(state.sequence.ids, scores[row]) for row, state in enumerate(running)]
                )
                values = host_copies([tokens] + decoder.pending_reads)  # the step's one host synchronisation
                decoder.settle(values[1:])  # the rows' policies score, the rows evict
                chosen = values[0].long().tolist()
                finished = []
                for row, (state, token_id) in enumerate(zip(running, chosen)):
                    state.sequence.append(tokens[row : row + 1])
                    state.generated += 1
                    reason = state.stopper.reason(token_id, state.sequence.ids, state.generated)
                    if reason:
                        finished.append((row, reason))
                for row, reason in finished:
                    yield running[row].request.key, self._result(decoder, row, running[row], reason)
                if finished:
                    done = {row for row, _ in finished}
                    keep = [row for row in range(len(running)) if row not in done]
                    decoder.keep(keep)
                    running = [running[row] for row in keep]
                    tokens = tokens[keep]
                logits = list(decoder.forward(tokens)) if running else []
                yield from self._join(decoder, running, logits)
