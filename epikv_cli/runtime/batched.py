"""Decode many sequences in one forward per step, each under its own policy and budget.

A sequence joins with :meth:`BatchDecoder.add`: its prompt is prefilled alone (a single-sequence
session, so prefill-time signals such as H2O's column sums are exactly those of a lone run), then
its cache, positions and policy state move into one row of a :class:`~epikv_cli.rows.RowsCache`.
:meth:`BatchDecoder.step` feeds one token per row in a single forward and lets each row's policy
observe and evict; :meth:`BatchDecoder.keep` drops finished rows so a queue can refill the batch.
Rows never see each other: each has its own mask over its own slots and its own logical positions.
"""

from __future__ import annotations

import torch

from epikv_cli.config import CacheSettings
from epikv_cli.core.attention import (
    AttentionNeeds,
    AttentionTaps,
    QueryRing,
    RowQueries,
)
from epikv_cli.core.hostread import host_copies
from epikv_cli.core.keepsets import HeadVictims
from epikv_cli.core.rows import FULL, SLIDING, RowsCache, RowView
from epikv_cli.core.scratch import ScratchHold
from epikv_cli.core.taps import HiddenStateTaps
from epikv_cli.core.view import Moves, Victims
from epikv_cli.errors import UsageError
from epikv_cli.policies.base import Policy, Signals
from epikv_cli.policies.registry import make_policy
from epikv_cli.runtime.session import set_up
from epikv_cli.runtime.step import Observed, choose, follow, observe
from epikv_cli.runtime.stream import CacheStream, input_device, warn_beyond_context


def union_needs(needs: list[AttentionNeeds | None]) -> AttentionNeeds | None:
    """What to compute for a batch whose rows need ``needs``."""
    present = [n for n in needs if n is not None]
    if not present:
        return None
    return AttentionNeeds(
        received=any(n.received for n in present),
        last_row=any(n.last_row for n in present),
        queries=max(n.queries for n in present),
    )


def evicted_positions(table, slots: list[int] | HeadVictims) -> list[int]:
    """The logical positions ``slots`` evict (a granular policy's: those no layer or head holds any more)."""
    if isinstance(slots, HeadVictims):
        return slots.gone
    return table.positions[slots].tolist() if slots else []


class BatchDecoder:
    """One model, many sequences, one forward per step.

    Args:
        model: a loaded causal LM.
        settings: the cache settings the rows will use (to tap what their policies read).
    """

    def __init__(self, model, settings: list[CacheSettings]) -> None:
        self.model = model
        self.cache = RowsCache(model.config)
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        #: the policies of the rows to come, one per settings given, built now to declare what they read (taps,
        #: attention); each goes to the first row with its settings (:meth:`_policy_for`)
        self._unused = [(setting, set_up(model, make_policy(setting))) for setting in settings]
        probes = [policy for _, policy in self._unused]
        self.taps = HiddenStateTaps(model, sorted({layer for p in probes for layer in p.tap_layers()}))
        self.taps.active = False
        self.needs = union_needs([p.attention_needs for p in probes])
        self.attention = AttentionTaps(model, self.cache.full_layer_indices, self.needs) if self.needs else None
        if self.attention is not None:
            self.attention.set_active(False)
        self.sliding = SLIDING in self.cache.groups
        #: per row (in the cache's row order): the policy that evicts from it (the cache holds none)
        self.policies: list[Policy] = []
        self._pending: list[Observed] = []  # per row: what its policy left to settle
        self._pads: list[int] = []  # per row: the padding before its prompt, during a batched prefill
        self._scratch = ScratchHold()

    def _policy_for(self, settings: CacheSettings) -> Policy:
        """A new row's policy: the unused one built for ``settings``, else a new one."""
        for index, (setting, policy) in enumerate(self._unused):
            if setting == settings:
                del self._unused[index]
                return policy
        return set_up(self.model, make_policy(settings))

    @property
    def batch(self) -> int:
        return self.cache.batch

    def row(self, index: int) -> RowView:
        return RowView(self.cache, index)

    def add(self, ids: torch.Tensor, settings: CacheSettings, max_tokens: int | None = None) -> torch.Tensor:
        """Prefill ``ids`` ``[1, n]`` alone under ``settings`` and join the batch; return the ``[vocab]`` logits."""
        warn_beyond_context(self.model, ids.shape[1])
        stream = CacheStream(self.model, settings, max_tokens=max_tokens, policy=self._policy_for(settings))
        try:
            logits = stream.feed(ids)
            policy = stream.session.policy
            needs = policy.attention_needs
            closed = stream.cache.close_vacant_heads()  # rows move entries at once: no slot may wait for a token
            if closed is not None:
                follow(policy, Moves(head_victims=closed[0], head_last=closed[1]))
            self.cache.adopt(stream.cache, settings.positions == "compressed", needs.queries if needs else 0)
            self.policies.append(policy)
            self.cache.rows[-1].last_evicted = list(stream.session.last.evicted)  # what the prefill itself evicted
            if self.attention is not None and self.needs.queries:
                self._join_queries(stream)
        finally:
            stream.close()  # its hooks go; its policy lives on in the row
        return logits

    def _join_queries(self, stream: CacheStream) -> None:
        """The new row's last queries (from its prefill) join the batch's query rings."""

        record = self.attention.record
        own = stream.session.attention.record.queries if stream.session.attention is not None else {}
        text = self.model.config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        for layer in self.cache.full_layer_indices:
            ring = record.queries.setdefault(layer, QueryRing(self.needs.queries))
            fresh = own[layer].ordered(0) if layer in own else None
            ring.add_row(fresh, heads, head_dim, self.dtype, self.device)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[B]`` (one per row); return the ``[B, vocab]`` logits; every row observes and evicts."""
        logits = self.forward(tokens)
        self.settle(host_copies(self.pending_reads))
        return logits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`step` but for the host half: the rows' policies leave :attr:`pending_reads`, which the
        caller reads together with the next tokens and hands to :meth:`settle` before the next forward."""
        kwargs = self.begin_step()
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=tokens.view(-1, 1).to(self.device),
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=1,
                    **kwargs,
                )
        finally:
            self._set_taps(False)
        self.finish_step()
        return out.logits[:, -1]

    def begin_step(self) -> dict:
        """Reserve every row's next slot and switch the taps on; return the forward's ``position_ids``,
        ``attention_mask`` (per layer kind when some layers slide) and, for eager weights, ``output_attentions``."""
        positions, masks = self.cache.begin_step(self.dtype, self.device)
        if self.attention is not None and self.needs.weights:  # weights only for the rows whose policies read them
            readers = [
                i for i, policy in enumerate(self.policies) if policy.attention_needs and policy.attention_needs.weights
            ]
            self.attention.weight_rows = None if len(readers) == self.batch else torch.tensor(readers, dtype=torch.long)
        mask = {"full_attention": masks[FULL], "sliding_attention": masks[SLIDING]} if self.sliding else masks[FULL]
        kwargs = {"position_ids": positions, "attention_mask": mask}
        if self.attention is not None and self.attention.returns_weights:
            kwargs["output_attentions"] = True
        self._set_taps(True)
        return kwargs

    def finish_step(self) -> None:
        """After the step's forward: record the new entries, then let every row's policy observe them
        (its device half; :meth:`settle` finishes)."""
        self._set_taps(False)
        self.cache.end_step()
        self._stage([range(row.full.seen - 1, row.full.seen) for row in self.cache.rows])

    # -- a left-padded batch prefilled at once (model.generate with a batch) ----------------------
    def begin_prefill(self, padding: torch.Tensor) -> None:
        """The next forward prefills a left-padded batch; ``padding`` ``[B, n]`` is True at padding tokens."""
        padding = padding.bool().cpu()
        if bool((padding[:, 1:] & ~padding[:, :-1]).any()):
            raise UsageError(
                "EpiKV batches must be padded on the left (padding after a prompt would be cached as its tokens); "
                "set tokenizer.padding_side = 'left'"
            )
        self._pads = padding.sum(dim=1).tolist()
        self.cache.begin_prefill()  # refuses a cache that still holds rows
        self.policies, self._pending = [], []  # a reset cache's rows took their policies with them
        if self.attention is not None:
            self.attention.record.queries.clear()  # and their query rings
            self.attention.weight_rows = None
            self.attention.query_valid = ~padding
        self._set_taps(True)

    def finish_prefill(self, settings: list[CacheSettings]) -> None:
        """After the prefill's forward: each row gets its own policy, checks its budget, observes its prompt and
        evicts.
        """
        self._set_taps(False)
        if self.attention is not None:
            self.attention.query_valid = None
        length = self.cache.prefill_length
        policies = []
        for setting, pad in zip(settings, self._pads):
            policy = self._policy_for(setting)
            policy.check_budget(length - pad, setting.budget if policy.evicts else None)
            policies.append(policy)
        queries = [p.attention_needs.queries if p.attention_needs else 0 for p in policies]
        rows = [
            (
                setting.budget if policy.evicts else None,
                setting.positions == "compressed",
                policy.granular,
                policy.slack,
            )
            for setting, policy in zip(settings, policies)
        ]
        self.cache.finish_prefill(self._pads, rows, queries)
        self.policies = policies
        if self.attention is not None:
            for ring in self.attention.record.queries.values():  # a short prompt's ring holds padding queries too
                ring.valid = [min(v, length - pad) for v, pad in zip(ring.valid, self._pads)]
        self._stage([range(0, length - pad) for pad in self._pads], offsets=self._pads)
        self.settle(host_copies(self.pending_reads))

    def _set_taps(self, active: bool) -> None:
        self.taps.active = active
        if self.attention is not None:
            self.attention.set_active(active)

    def _stage(self, appended: list[range], offsets: list[int] | None = None) -> None:
        """Every row's policy sees what its tokens ``appended[row]`` showed (a staged policy only its device
        half). ``offsets``: each row's padding at a batched prefill (its taps' slots start there)."""
        record = self.attention.record if self.attention is not None else None
        self._pending = []
        for index, (row, policy) in enumerate(zip(self.cache.rows, self.policies)):
            offset = offsets[index] if offsets else 0
            hidden = {layer: states[index : index + 1, offset:] for layer, states in self.taps.outputs.items()}
            attention = record.row(index, row.full.stored, offset) if record is not None else None
            if attention is not None and row.queries_needed:
                attention.queries = RowQueries(record.queries, index, row.queries_needed)
            signals = Signals(appended[index], offsets is not None, hidden, attention, RowView(self.cache, index))
            self._pending.append(observe(policy, signals))
        self.taps.clear()
        if record is not None:
            record.clear_forward()

    @property
    def pending_reads(self) -> list[torch.Tensor]:
        """Every row's pending host reads (device tensors), in row order."""
        return [tensor for observed in self._pending for tensor in observed.reads]

    def settle(self, values: list[torch.Tensor]) -> None:
        """Finish the latest forward: each row's policy gets its host values (``values``: CPU copies of
        :attr:`pending_reads`), then every row is brought back within its budget."""
        plans: dict[str, list[tuple[int, Victims]]] = {FULL: [], SLIDING: []}
        values = iter(values)
        for index, (row, policy, observed) in enumerate(zip(self.cache.rows, self.policies, self._pending)):
            row.peak_stored = max(row.peak_stored, row.full.stored)
            slots = choose(policy, observed, [next(values) for _ in observed.reads], observed.signals.cache)
            row.last_evicted = evicted_positions(row.full, slots)
            row.evicted_total += len(slots)
            if slots:
                plans[FULL].append((index, slots))
            if self.sliding and row.tables[SLIDING].stored > self.cache.window - 1:
                oldest = int(torch.argmin(row.tables[SLIDING].live_positions()))
                plans[SLIDING].append((index, [oldest]))
        self._pending = []
        for index, (holes, movers) in self.cache.evict(plans).items():
            follow(self.policies[index], Moves(holes, movers))

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), e.g. after sequences finished."""
        self.cache.keep_rows(rows)
        self.policies = [self.policies[i] for i in rows]
        if self.attention is not None:
            self.attention.record.select_rows(torch.tensor(rows, dtype=torch.long))

    def close(self) -> None:
        self.taps.remove()
        if self.attention is not None:
            self.attention.remove()
            self.attention = None
        self._scratch.release()  # the rows' refresh buffers go with the batch (kept while rows join)

    def __enter__(self) -> BatchDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
