"""Put the budget cache, its policy and its taps on a loaded model.

After every forward that used the cache, the policy sees the appended tokens (and scores them), then
the cache is brought back within the budget. The same hooks serve ``epikv generate`` and plain
``model.generate``::

    with epikv_cli.attach(model, budget=4096) as cache:
        model.generate(**inputs, past_key_values=cache, max_new_tokens=2048)

The step itself (observe, choose, evict, follow) is :mod:`epikv_cli.runtime.step`, shared with batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch
import transformers
from torch import nn

from epikv_cli.config import CacheSettings
from epikv_cli.core.attention import AttentionTaps
from epikv_cli.core.cache import BudgetCache
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.scratch import ScratchHold
from epikv_cli.core.taps import HiddenStateTaps, decoder_blocks
from epikv_cli.core.view import Moves
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Policy, Signals
from epikv_cli.policies.registry import make_policy
from epikv_cli.runtime.step import Observed, choose, follow, observe

#: The policy evicting from each attached cache (the cache itself holds none): see :func:`policy_of`.
_POLICIES: WeakKeyDictionary = WeakKeyDictionary()
#: A batch cache (``attach(..., batch_size=B)``) -> its rows' policies, in row order (registered by ``attach``).
ROW_POLICIES: WeakKeyDictionary = WeakKeyDictionary()


#: Why a cache whose session has closed takes no more tokens (nothing would evict from it).
ENDED = (
    "this cache's attach() block has ended, so no policy evicts from it any more: generate inside "
    "`with epikv_cli.attach(model, ...) as cache:`, or attach again"
)


def policy_of(cache) -> Policy:
    """The policy that evicts from ``cache``, a cache made by :class:`EpiKVSession` (``epikv_cli.attach``), or, for a
    batch, ``cache.row(b)``'s: e.g. ``policy_of(cache).score_of(position)``."""
    batch = getattr(cache, "cache", None)  # cache.row(b) of a batch cache: its row's policy
    if batch is not None and hasattr(cache, "index") and batch in ROW_POLICIES:
        return ROW_POLICIES[batch][cache.index]
    if cache in ROW_POLICIES:
        raise UsageError("a batch cache has one policy per row: use epikv_cli.policy_of(cache.row(b))")
    if cache not in _POLICIES:
        raise UsageError(f"no EpiKV policy evicts from this {type(cache).__name__}: give a cache epikv_cli.attach made")
    return _POLICIES[cache]


@dataclass
class ForwardRecord:
    """What happened to the cache in the latest forward."""

    appended: range = range(0)
    evicted: list[int] = field(default_factory=list)  # logical positions


def set_up(model: nn.Module, policy: Policy) -> Policy:
    """``policy`` set up for ``model``: its number of decoder blocks and its saved calibration, if any."""
    policy.setup(len(decoder_blocks(model)), getattr(model, "epikv_calibration", None))
    return policy


#: The oldest transformers this engine runs on: its forward takes ``cache=`` and has no ``cache_position``.
TRANSFORMERS_ENGINE_MIN = (5, 24)


def require_transformers_engine() -> None:
    """:class:`UsageError` when the installed transformers is older than the transformers engine needs (vLLM's venv
    has 5.19: vLLM 0.32 pins it below 5.20)."""
    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if version < TRANSFORMERS_ENGINE_MIN:
        needed = ".".join(map(str, TRANSFORMERS_ENGINE_MIN))
        raise UsageError(
            f"the transformers engine needs transformers {needed} or newer and this environment has "
            f"{transformers.__version__} (vLLM 0.32 pins it below 5.20): use --engine vllm here, or the transformers "
            "engine from a venv of its own (docs/vllm.md)"
        )


class EpiKVSession:
    """Owns a :class:`BudgetCache`, the policy that evicts from it and the hooks that feed the policy.

    Use it as a context manager; on exit every hook is removed and the model is as it was.
    """

    def __init__(
        self, model: nn.Module, settings: CacheSettings, max_tokens: int | None = None, policy: Policy | None = None
    ) -> None:
        require_transformers_engine()
        self.model = model
        self.settings = settings
        self.policy: Policy = set_up(model, policy or make_policy(settings))
        budget = settings.budget if self.policy.evicts else None
        self.cache = BudgetCache(
            model.config,
            budget,
            max_tokens=max_tokens,
            compressed_positions=settings.positions == "compressed",
            slack=self.policy.slack,
            granular=self.policy.granular,
        )
        _POLICIES[self.cache] = self.policy
        self._fresh = True  # the policy has seen no forward yet (a cache reset since then needs a new one)
        self.last = ForwardRecord()
        #: False (``model.generate``): each forward settles at once, reading its own host values. True
        #: (the engine): the forward leaves :attr:`pending_reads`, and the engine reads them together
        #: with the sampled token and calls :meth:`settle` before the next forward.
        self.defer_reads = False
        self.pending: Observed | None = None
        self.taps = HiddenStateTaps(model, self.policy.tap_layers())
        needs = self.policy.attention_needs
        self.attention = AttentionTaps(model, self.cache.evicting_layers, needs) if needs else None
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]
        self._scratch = ScratchHold()

    def _reset(self) -> None:
        """The cache was reset for a new sequence: start the policy and the records afresh."""
        self.policy = _POLICIES[self.cache] = set_up(self.model, make_policy(self.settings))
        self._fresh = True
        self.last = ForwardRecord()
        self.pending = None
        self.taps.clear()
        if self.attention is not None:
            self.attention.record = type(self.attention.record)()

    # -- hooks ----------------------------------------------------------------------------------
    # Several sessions may share one model (fidelity replays many caches in lockstep): each acts only
    # on the forwards that use its own cache, and its taps record only during those.
    def _uses_cache(self, kwargs: dict) -> bool:
        return kwargs.get("cache") is self.cache or kwargs.get("past_key_values") is self.cache

    def _set_taps(self, active: bool) -> None:
        self.taps.active = active
        if self.attention is not None:
            self.attention.set_active(active)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self._uses_cache(kwargs):
            return None
        if self.cache.seen == 0 and not self._fresh:  # the cache was reset (cache.reset()) for a new sequence
            self._reset()
        inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        if self.cache.seen == 0 and inputs is not None:  # refuse a prompt over the budget before the cache takes it
            self.policy.check_budget(inputs.shape[1], self.cache.budget)
        self._set_taps(True)
        if not self.cache.compressed_positions:
            return None
        kwargs["position_ids"] = self.cache.position_ids(inputs.shape[1], inputs.device)
        return args, kwargs

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not self._uses_cache(kwargs):
            return
        self._set_taps(False)
        appended = self.cache.commit()
        if not len(appended):
            self.taps.clear()
            return
        prompt = appended.start == 0  # its budget was checked before the forward
        if not prompt and len(appended) > 1:
            raise UsageError(
                "EpiKV needs the whole prompt in the first forward and one token per step after it; "
                "drop prefill_chunk_size, and start a new cache for each conversation turn"
            )
        self._fresh = False
        for victims, last in self.cache.closed_vacancies:  # moves the forward made before writing
            follow(self.policy, Moves(head_victims=victims, head_last=last))
        self.cache.closed_vacancies.clear()
        record = self.attention.record if self.attention is not None else None
        row = record.row(0, self.cache.stored) if record is not None else None
        self.pending = observe(self.policy, Signals(appended, prompt, dict(self.taps.outputs), row, self.cache))
        self.taps.clear()
        if record is not None:
            record.clear_forward()
        if not self.defer_reads:
            self.settle(host_copies(self.pending.reads))

    @property
    def pending_reads(self) -> list[torch.Tensor]:
        """What the latest forward's policy needs on the host (device tensors), before :meth:`settle`."""
        return self.pending.reads if self.pending is not None else []

    def settle(self, values: list[torch.Tensor]) -> None:
        """Finish the latest forward: the policy gets its host values, then the cache is brought back
        within the budget. With :attr:`defer_reads` the engine calls it once it has read ``values``
        (host copies of :attr:`pending_reads`) together with the sampled token."""
        if self.pending is None:
            return
        observed, self.pending = self.pending, None
        self.cache.peak_stored = max(self.cache.peak_stored, self.cache.stored)  # the in-step peak: K + 1
        victims = choose(self.policy, observed, values, self.cache)
        evicted = self.cache.evict(victims)
        follow(self.policy, Moves(evicted.holes, evicted.movers))
        self.last = ForwardRecord(observed.signals.appended, evicted.positions)

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.cache.ended = ENDED
        self.taps.remove()
        if self.attention is not None:
            self.attention.remove()
            self.attention = None
        self._scratch.release()  # work buffers kept between refreshes go with the last open session

    def __enter__(self) -> EpiKVSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
