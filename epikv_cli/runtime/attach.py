"""``epikv_cli.attach``: the budget cache on a model for plain ``model.generate``, one sequence or a left-padded batch.

After every forward that used the cache, the policy sees the appended tokens (and scores them), then the cache is
brought back within the budget::

    with epikv_cli.attach(model, budget=4096) as cache:
        model.generate(**inputs, past_key_values=cache, max_new_tokens=2048)
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from epikv_cli.config import DEFAULT_POLICY, CacheSettings
from epikv_cli.core.cache import BudgetCache
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.rows import RowsCache
from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import check_settings, parse_policy_spec
from epikv_cli.runtime.batched import BatchDecoder
from epikv_cli.runtime.session import ENDED, ROW_POLICIES, EpiKVSession


class BatchSession:
    """``model.generate`` over a left-padded batch, each row under its own policy and budget.

    The first forward (the batched prefill) is written as it comes; afterwards every row's prompt is
    moved to the front of its slots, its policy observes it and evicts. Each decode forward gets the
    rows' own ``position_ids`` and an attention mask over their own slots (the 2D mask ``generate``
    passes counts padding and evicted tokens, so it is replaced). The cache is a
    :class:`~epikv_cli.rows.RowsCache`: ``cache.row(b)`` says what row ``b`` holds.
    """

    def __init__(self, model: nn.Module, settings: CacheSettings, batch_size: int) -> None:

        if batch_size < 1:
            raise UsageError(f"batch_size must be at least 1, got {batch_size}")
        self.model = model
        self.settings = settings
        self.batch_size = batch_size
        self.decoder = BatchDecoder(model, [settings])
        self.cache = self.decoder.cache
        self._prefilling = False
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def _uses_cache(self, kwargs: dict) -> bool:
        return kwargs.get("cache") is self.cache or kwargs.get("past_key_values") is self.cache

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self._uses_cache(kwargs):
            return None
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        batch, count = ids.shape[0], ids.shape[1]
        if batch != self.batch_size and not self.cache.rows:
            raise UsageError(
                f"this cache was attached for batch_size={self.batch_size}, but the batch holds {batch} prompts"
            )
        if not self.cache.rows:
            mask = kwargs.get("attention_mask")
            padding = (
                mask == 0
                if isinstance(mask, torch.Tensor) and mask.dim() == 2
                else torch.zeros(batch, count, dtype=torch.bool)
            )
            self.decoder.begin_prefill(padding)
            self._prefilling = True
            return None
        if count != 1:
            raise UsageError(
                "EpiKV needs the whole prompt in the first forward and one token per step after it; "
                "drop prefill_chunk_size, and start a new cache for each batch"
            )
        kwargs.update(self.decoder.begin_step())
        return args, kwargs

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not self._uses_cache(kwargs):
            return
        if self._prefilling:
            self._prefilling = False
            self.decoder.finish_prefill([self.settings] * self.batch_size)
            ROW_POLICIES[self.cache] = self.decoder.policies  # for epikv_cli.policy_of(cache.row(b))
        else:
            self.decoder.finish_step()
            self.decoder.settle(host_copies(self.decoder.pending_reads))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.cache.ended = ENDED
        self.decoder.close()

    def __enter__(self) -> BatchSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def attach(
    model: nn.Module,
    budget: int | None = 4096,
    policy: str = DEFAULT_POLICY,
    recent: int | None = None,
    bands: tuple[tuple[int, float], ...] | None = None,
    positions: str = "logical",
    seed: int = 0,
    batch_size: int = 1,
    options: dict[str, object] | None = None,
) -> Iterator[BudgetCache | RowsCache]:
    """Run ``model`` under an EpiKV-managed cache of at most ``budget`` entries per evicting layer.

    Yields the cache to pass as ``past_key_values=`` (or ``cache=``) to ``model.generate`` or to the
    forward; no beam search. With ``batch_size=1`` it is a :class:`BudgetCache`, which exposes
    ``stored``, ``seen``, ``evicted_total``, ``peak_stored`` and ``live_positions()``; the policy evicting
    from it is ``epikv_cli.policy_of(cache)`` (``.score_of(position)`` for EpiKV, ``.report()``). With
    ``batch_size=B`` the inputs are B left-padded
    prompts (``tokenizer.padding_side = "left"``) and the cache a :class:`RowsCache`, each row with its
    own keep-set; ``cache.row(b)`` exposes the same attributes for row ``b``.

    Args:
        budget: K, prompt included; ``None`` only with ``policy="full"``.
        policy: a name from ``epikv_cli.policies.POLICIES``.
        recent: R, the most recent tokens always kept; default: the policy's own (``min(128, K // 4)`` for
            epikv, 75% of K for epikv2, ``min(128, K - 4)`` for h2o).
        bands: EpiKV ``(layer, sign)`` pairs; default the paper's depth fractions.
        positions: ``"logical"`` (default) or ``"compressed"`` (paper-time harness).
        seed: for ``policy="random"``.
        batch_size: prompts per ``generate`` call (one cache per call: attach again for the next batch).
        options: the policy's options, as ``--policy-option`` takes them, e.g. ``{"keep": "head"}`` for epikv2.
    """
    if isinstance(policy, str) and ":" in policy:  # the spelling of --policies: point to options= instead
        name, pairs = parse_policy_spec(policy)
        given = ", ".join(f"{key!r}: {value!r}" for key, value in pairs)
        raise UsageError(
            f"policy= takes a policy name, and its options go in options=: "
            f"attach(model, policy={name!r}, options={{{given}}})"
        )
    settings = check_settings(
        CacheSettings(
            budget=budget,
            policy=policy,
            recent=recent,
            bands=bands,
            positions=positions,
            seed=seed,
            options=tuple((key, str(value)) for key, value in (options or {}).items()),
        )
    )
    if batch_size == 1:
        with EpiKVSession(model, settings) as session, guarded_generate(model, session.cache):
            yield session.cache
        return
    with BatchSession(model, settings, batch_size) as session, guarded_generate(model, session.cache):
        yield session.cache


def holds_tokens(cache: BudgetCache | RowsCache) -> bool:
    """Whether ``cache`` already holds a sequence (a batch cache: any row)."""
    rows = getattr(cache, "rows", None)
    return bool(rows) if rows is not None else cache.seen > 0


def continues(cache: BudgetCache | RowsCache, args: tuple, kwargs: dict, previous: torch.Tensor | None = None) -> bool:
    """Whether generate's inputs are the cached sequence plus the one token sampled last (the previous call's
    output, passed back to go on): generate then feeds only that token, which the cache can take.
    ``previous``: the sequences the latest call on the cache returned, if any."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    expected = cache.get_seq_length() + 1
    if not (isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and inputs.shape[1] == expected):
        return False
    if (
        previous is None or previous.shape[1] != expected
    ):  # the cache no longer holds what that call left: length decides
        return True
    # a new prompt may have just that length: only the output itself continues
    return inputs.shape == previous.shape and torch.equal(inputs, previous.to(inputs.device))


@contextmanager
def guarded_generate(model: nn.Module, cache: BudgetCache | RowsCache) -> Iterator[None]:
    """While attached, ``model.generate`` on ``cache`` refuses, with a :class:`UsageError` naming the cause,
    what the cache cannot serve: a new prompt while it still holds an earlier call's sequence (generate
    would feed it only the part of the prompt beyond the cached length), ``use_cache=False``, and beam
    search. Passing the previous call's output back, to go on generating, is a continuation and runs."""
    outer = model.__dict__.get("generate")  # an enclosing attach's guard, if any
    inner = model.generate
    previous: torch.Tensor | None = None  # the sequences the latest call on this cache returned

    @functools.wraps(inner)
    def generate(*args, **kwargs):
        nonlocal previous
        if not (kwargs.get("cache") is cache or kwargs.get("past_key_values") is cache):
            return inner(*args, **kwargs)
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        beams = kwargs.get("num_beams") or getattr(config, "num_beams", None) or 1
        if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
            raise UsageError("EpiKV works through the cache it attached; drop use_cache=False")
        if beams > 1:
            raise UsageError(
                f"EpiKV keeps one keep-set per sequence and does no beam search; use num_beams=1, not {beams}"
            )
        if holds_tokens(cache) and not continues(cache, args, kwargs, previous):
            raise UsageError(
                "this EpiKV cache still holds the sequence of an earlier generate call, and these inputs do not "
                "continue it; attach a new cache for each new prompt, or call cache.reset() first"
            )
        output = inner(*args, **kwargs)
        previous = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        return output

    model.generate = generate
    try:
        yield
    finally:
        if outer is None:
            del model.generate
        else:
            model.generate = outer
