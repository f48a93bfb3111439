"""EpiKV-2: heavy hitters measured from a few recent queries, on any attention kernel.

The published EpiKV score freezes a hidden-state statistic at entry, and measured on real models it
keeps the cache further from the full one than keeping the most recent tokens. What does keep a
model close is what H2O measures: the attention each cached token receives. EpiKV-2 measures it
without the kernel's weights: each evicting layer keeps its last ``queries`` query vectors (after
RoPE; ``period`` by default), and every ``period`` steps their attention to the cached keys is
computed beside the kernel (one small matmul per layer) and added to each token's running score,
older contributions decayed.
Kept: the first ``sinks`` tokens, the most recent ``recent`` share of K, then the highest scores;
the prompt is scored like everything else. State: ``queries`` query vectors per layer, and one score per
cached entry: per token with ``keep=global`` (per-step work O(log K) heap operations on the host),
per (layer, KV head, slot) on the device with ``keep=head`` (each refresh decides every (layer, head)'s
victims until the next one from a short list of ``2 * period + 1`` candidates, so a step only reads its
own; the next token is written into each head's victim slot, so nothing moves). Every ``period``
steps: one ``[queries x K]`` product per layer (amortised, ``queries / period`` of an attention row per
step: one row by default), all layers' softmaxes and sums at once.

Options (``--policies epikv2:period=32:decay=0.9``): ``sinks``, ``recent`` (a share of K below 1, else tokens),
``period``, ``queries`` (how many of the newest queries a refresh reads, at most and by default ``period``: fewer
shrink the product, and rank the tokens less well), ``decay`` (per refresh, 1 keeps every contribution), ``prompt``
(``score`` or ``keep``), and, for ablations, ``signal``: ``attention`` (the default), ``epiphany`` (the published
EpiKV score under these keep rules) or ``none`` (recency alone); ``credit``: how refreshes add up, ``sum`` (the
default), ``mean`` (per refresh the token was scored in, so that long-kept tokens are not favoured for their age) or
``max`` (the largest single refresh); ``values=1`` weighs each attention weight by the L2 norm of the value it reads
(what the token adds to the output); ``pool=7`` gives each token the largest score within 3 positions of it
(neighbours of an attended token stay with it, as in SnapKV and R-KV); ``keep``: ``head`` (the default: each KV head
of each evicting layer keeps its own set, scored by its own attention and chosen on the device, see
:mod:`epikv_cli.keepsets`), ``layer`` (one set per layer) or ``global`` (one set for every layer, on the host;
``signal=epiphany``, ``credit`` and ``pool`` need it); ``adapt=1`` (``layer``/``head`` only) lets each layer move
its recent window within [K/2, K - sinks] (K - prompt with ``prompt=keep``); ``copy=S`` (``layer``/``head`` only;
``layer``: the layer's widest) stretches the recent window of a KV head that is copying a passage older than its
window (for at least the share S of its recent queries, each query's most-weighted key beyond the window is the one
after the previous query's) back to that passage until the next refresh, so that the rest of the passage stays
(default 0.3 where allowed, ``copy=0`` turns it off; ``copyweight``: the least weight such a key must get to count,
default 0.05; ``copymargin``: how many tokens before the key it reads now the window reaches, default 16;
``loop=G``: a head that copies from G or more tokens back inside its window, a loop, keeps the period before too:
its window reaches back twice as far as the key it reads, default 32, ``loop=0`` follows only copies from beyond the
window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from epikv_cli.core.view import HeadVictims
from epikv_cli.policies.base import (
    MAX_TOKENS,
    AttentionNeeds,
    BudgetFloor,
    Policy,
    PolicyOptions,
    Scratch,
    Signals,
    UsageError,
    setting,
)
from epikv_cli.policies.epikv import EpiKV
from epikv_cli.policies.keep_scored import CandidateHeap, ScoreBook
from epikv_cli.policies.shortlist import Shortlist, gone_positions

if TYPE_CHECKING:
    from epikv_cli.core.view import CacheView, Moves


def received_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[n]``: attention each key receives from the queries, summed over queries, mean over query heads.

    Args:
        queries: ``[heads, w, dim]`` (after RoPE); keys: ``[kv_heads, n, dim]`` in slot order.
        query_positions: ``[w]`` and key_positions: ``[n]`` logical positions (a query sees keys at or before it).
        scaling: the layer's softmax scale (default ``dim ** -0.5``).
        values: ``[kv_heads, n, dim]``: when given, each weight is multiplied by the L2 norm of the value it
            reads, i.e. what the token actually adds to the attention output.
    """
    shared = key_positions.expand(keys.shape[0], keys.shape[1])
    # every KV head serves the same number of query heads: the mean over heads is the mean of the groups' means
    return received_by_head(queries, keys, query_positions, shared, scaling, values).mean(dim=0)


def received_by_head(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[kv_heads, n]``: attention each key of each KV head receives from the queries, summed over
    queries, mean over the query heads that read that KV head (one layer of :func:`received_by_layers`).

    Args:
        queries: ``[heads, w, dim]`` (after RoPE); keys: ``[kv_heads, n, dim]`` in slot order.
        query_positions: ``[w]``; key_positions: ``[kv_heads, n]`` (each head holds its own tokens).
        scaling: the layer's softmax scale (default ``dim ** -0.5``).
        values: ``[kv_heads, n, dim]``: weigh each weight by the L2 norm of the value it reads.
    """
    return received_by_layers(
        [queries], [keys], query_positions, key_positions[None], [scaling], None if values is None else [values]
    )[0]


#: The most bytes of float32 logits a refresh holds at once, by device type: layers are computed together up
#: to it (fewer, larger operations), one at a time beyond it (a 64-layer model at K = 8192 needs 34 MB per
#: layer). On a CPU the logits should stay in a core's L2 cache: 30 layers at 4200 keys in one 64 MiB chunk
#: take 15% longer than in 2 MiB chunks (twice as long before the buffers were reused, docs/benchmarks.md);
#: a GPU gains from fewer, larger kernels.
REFRESH_CHUNK_BYTES = {"cpu": 2 << 20}
#: The chunk on device types not named in :data:`REFRESH_CHUNK_BYTES`.
DEFAULT_REFRESH_CHUNK_BYTES = 64 << 20
#: A refresh's logits, weights and keys on a CPU, reused from refresh to refresh, freed when a session closes.
REFRESH_SCRATCH = Scratch()


def refresh_chunk_bytes(device: torch.device) -> int:
    """The most bytes of float32 logits a refresh holds at once on ``device``."""
    return REFRESH_CHUNK_BYTES.get(torch.device(device).type, DEFAULT_REFRESH_CHUNK_BYTES)


def received_by_layers(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: list[float | None],
    values: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """See :func:`refresh_layers`: the attention received alone."""
    return refresh_layers(queries, keys, query_positions, key_positions, scaling, values)[0]


def refresh_layers(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: list[float | None],
    values: list[torch.Tensor] | None = None,
    far: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``[layers, kv_heads, n]`` float32 on the first layer's device: per layer, the attention each key of each
    KV head receives from that layer's queries, summed over queries, mean over the query heads that read
    that KV head. Layers are computed together (one product per layer, everything else once for a run of
    layers on one device, up to :func:`refresh_chunk_bytes` of logits).

    Args:
        queries: per layer ``[heads, w, dim]`` (after RoPE); keys: per layer ``[kv_heads, n, dim]`` in slot order.
        query_positions: ``[w]``; key_positions: ``[layers, kv_heads, n]`` (each head holds its own tokens).
        scaling: per layer, its softmax scale (None: ``dim ** -0.5``).
        values: per layer ``[kv_heads, n, dim]``: weigh each weight by the L2 norm of the value it reads.
        far: ``[layers, kv_heads, n]`` bool, a set of keys, or ``[2, layers, kv_heads, n]``, two disjoint sets:
            when given, also find where each query looks among each set's keys (after the attention received
            is summed, one pass over the weights in place: the other keys' zeroed, a second set's negated).

    Returns: the attention received, and with ``far``, per set, layer, KV head, query head of the group and
    query ``[..., layers, kv_heads, group, w]``, the position of the key of the set it gives the most weight
    (-1 where the set holds no key of that head) and that weight (before ``values``); else None and None.

    The queries must be the ``w`` newest tokens' (as a policy's recent queries are), so that no key is
    newer than the newest query and at most ``w - 1`` keys are newer than the oldest: the causal mask
    is applied to each head's ``w`` newest keys alone, not to all ``n``.
    """
    heads, w, dim = queries[0].shape
    kv_heads, n = keys[0].shape[0], keys[0].shape[1]
    group = heads // kv_heads
    per_layer = kv_heads * group * w * n * 4
    # the causal mask of every layer at once: each head's w newest keys, and which queries cannot see them
    newest = key_positions.topk(min(w, n), dim=-1)  # [layers, kv_heads, m] positions and slots
    hidden = newest.values[:, :, None, None, :] > query_positions.to(key_positions.device)[None, None, None, :, None]
    # -inf added where a query cannot see a key, 0 elsewhere (exact), shared by the group's query heads
    bias = torch.zeros(hidden.shape, dtype=keys[0].dtype, device=hidden.device).masked_fill_(hidden, -math.inf)
    parts, looks, start = [], [], 0
    while start < len(keys):
        device = keys[start].device
        limit = refresh_chunk_bytes(device)
        end = start + 1
        while end < len(keys) and keys[end].device == device and (end + 1 - start) * per_layer <= limit:
            end += 1
        chunk = slice(start, end)
        part, best = _received_chunk(
            queries[chunk],
            keys[chunk],
            newest.indices[chunk].to(device),
            bias[chunk].to(device),
            scaling[chunk],
            None if values is None else values[chunk],
            None if far is None else far[..., chunk, :, :].to(device),
        )
        parts.append(part.to(keys[0].device))
        if best is not None:
            looks.append(tuple(part.to(keys[0].device) for part in best))
        start = end
    received = parts[0] if len(parts) == 1 else torch.cat(parts)
    if far is None:
        return received, None, None
    weights, chosen = (
        torch.cat(part, dim=-4) for part in zip(*looks)
    )  # chosen: [..., layers, kv_heads, group, w] slots
    places = key_positions.to(chosen.device)[:, :, None, None, :].expand(*chosen.shape, n)
    sources = places.gather(-1, chosen[..., None])[..., 0]
    anywhere = far.any(dim=-1).to(chosen.device)[..., None, None]
    return received, torch.where(anywhere, sources, -1), weights


def _received_chunk(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    newest: torch.Tensor,
    bias: torch.Tensor,
    scaling: list[float | None],
    values: list[torch.Tensor] | None,
    far: torch.Tensor | None,
):
    """:func:`refresh_layers` for a run of layers on one device: ``[layers, kv_heads, n]`` received, and with
    ``far`` (``[layers, kv_heads, n]`` or ``[2, layers, kv_heads, n]``: whether each slot belongs to the set, or to
    each of two disjoint sets) the largest weight each query gives a key of each set and that key's slot
    (``[..., layers, kv_heads, group, w]`` values and indices), else None.

    Args:
        newest: ``[layers, kv_heads, m]`` the slots of each head's ``m`` newest keys; bias: ``[layers,
            kv_heads, 1, w, m]`` added to their logits: -inf where a query cannot see one of them, else 0.
    """
    layers = len(keys)
    heads, w, dim = queries[0].shape
    kv_heads, n = keys[0].shape[0], keys[0].shape[1]
    group = heads // kv_heads
    dtype, device = keys[0].dtype, keys[0].device
    scales = [s if s is not None else dim**-0.5 for s in scaling]
    stacked = torch.stack(queries).to(device=device, dtype=dtype)  # [layers, heads, w, dim]
    if len(set(scales)) == 1:  # on the queries, as SDPA scales
        stacked = stacked * scales[0]
    else:
        stacked = stacked * torch.tensor(scales, dtype=dtype, device=device)[:, None, None, None]
    stacked = stacked.view(layers, kv_heads, group * w, dim)
    # the products over all the KV heads' query rows, in the cache's dtype as eager attention computes it (no float32
    # copy of every key), the softmax in float32; on a CPU logits, weights and keys go to reused buffers, where fresh
    # ones this large page-fault at every refresh
    logits = REFRESH_SCRATCH.take("logits", (layers, kv_heads, group * w, n), dtype, device)
    if device.type == "cpu":
        # a cache's keys are views whose heads lie apart (the slots past the stored ones, a ring's values between),
        # on which a CPU bmm takes its slow path: copied into one block, the run's products are one matmul, with the
        # same numbers (benchmarks/refresh_parts.py, one refresh of 30 layers at K = 512 in bfloat16: 16.4 ms against
        # 20.0 with a bmm per layer, whose products alone took 6.0 ms against 2.1 for the copy and one matmul)
        gathered = REFRESH_SCRATCH.take("keys", (layers, kv_heads, n, dim), dtype, device)
        torch.stack(keys, out=gathered)
        torch.matmul(stacked, gathered.transpose(-1, -2), out=logits)
    else:  # one product per layer over a strided batch of heads, which the GPU's batched GEMM takes as it is
        for layer in range(layers):
            torch.bmm(stacked[layer], keys[layer].transpose(-1, -2), out=logits[layer])
    logits = logits.view(layers, kv_heads, group, w, n)
    shape = (layers, kv_heads, group, w, newest.shape[-1])
    logits.scatter_add_(-1, newest[:, :, None, None, :].expand(shape), bias.expand(shape))
    weights = REFRESH_SCRATCH.take("weights", (layers, kv_heads, group, w, n), torch.float32, device)
    torch.softmax(logits, dim=-1, dtype=torch.float32, out=weights)
    # summed over the queries, mean over the group's heads (a value's norm multiplies every weight it gets,
    # so it multiplies the sum)
    received = weights.view(layers, kv_heads, group * w, n).sum(dim=2).div_(group)
    if values is not None:
        received.mul_(torch.stack([v.to(device).float().norm(dim=-1) for v in values]))  # [layers, kv_heads, n]
    best = None
    if far is not None and far.dim() == 3:  # the other keys' weights zeroed in place (received is summed already)
        most = weights.mul_(far[:, :, None, None, :]).max(dim=-1)
        best = (most.values, most.indices)
    elif far is not None:  # two sets in one pass: the first's weights kept, the second's negated, the rest zeroed
        signs = far[0].to(weights.dtype) - far[1].to(weights.dtype)
        signed = weights.mul_(signs[:, :, None, None, :])
        most, least = signed.max(dim=-1), signed.min(dim=-1)
        best = (torch.stack([most.values, least.values.neg()]), torch.stack([most.indices, least.indices]))
    return received, best


def pooled_over_positions(scores: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[n]``: each slot's score replaced by the largest within ``kernel // 2`` positions of it, in logical
    order (SnapKV's and R-KV's pooling: the neighbours of an attended token stay with it).

    Args:
        scores: ``[n]`` slot-ordered; positions: ``[n]`` their logical positions.
    """
    order = torch.argsort(positions).to(scores.device)
    pooled = torch.nn.functional.max_pool1d(scores[order][None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
    out = torch.empty_like(scores)
    out[order] = pooled
    return out


#: The default ``copy`` share where the keep rule allows it (docs/quality.md, "Copies from beyond the window").
DEFAULT_COPY = 0.3
#: How many positions before the source it reads now a copying head's window reaches, by default (a copy loop
#: can return to the lines just behind the one it copies: docs/quality.md, "How far behind the copy", and
#: with ``loop``, "Loops inside the window").
DEFAULT_COPY_MARGIN = 16
#: The shortest loop a copying head's window follows by default, in tokens (``loop``, where ``copy`` is on): a
#: head that repeats what it read this far back or more keeps the period before it too (docs/quality.md,
#: "Loops inside the window").
DEFAULT_LOOP = 32


def copy_windows(
    sources: torch.Tensor,
    weights: torch.Tensor,
    last: int,
    share: float,
    min_weight: float,
    recent: int,
    longest: int,
    margin: int,
    near: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[layers, kv_heads]`` recent windows: ``recent``, or, for a KV head one of whose query heads copies,
    back to the source it reads now and ``margin`` tokens before it (at most ``longest``).

    A query head copies when, for at least ``share`` of its consecutive pairs of queries, the later one's
    source (its most-weighted key older than the window, weighing at least ``min_weight``) is the token
    right after the earlier one's: it reads an earlier passage token by token, and needs the rest of it next.
    ``near`` gives the sources inside the window (from ``loop`` tokens back): a query head copying from
    there, ``d`` tokens back, repeats a passage of its own window (a loop of period ``d``) and reaches back
    ``2 d + margin``: the repetition before the one it reads, which a loop's heads read too.

    Args:
        sources, weights: ``[layers, kv_heads, group, w]`` from :func:`refresh_layers`; last: the newest query's
            position; near: the same for the keys inside the window, or None.
    """
    reach = torch.where(_copies(sources, weights, share, min_weight), last - sources[..., -1] + margin, 0)
    if near is not None:
        looping = torch.where(_copies(*near, share, min_weight), 2 * (last - near[0][..., -1]) + margin, 0)
        reach = torch.maximum(reach, looping)
    return reach.amax(dim=-1).clamp(min=recent, max=longest)


def _copies(sources: torch.Tensor, weights: torch.Tensor, share: float, min_weight: float) -> torch.Tensor:
    """``[layers, kv_heads, group]``: whether each query head's sources advance one token at a time (see
    :func:`copy_windows`)."""
    steps = (sources[..., 1:] - sources[..., :-1] == 1) & (weights[..., 1:] >= min_weight) & (sources[..., :-1] >= 0)
    return steps.float().mean(dim=-1) >= share


#: The largest recent share of K: the smallest workable K grows as 1 / (1 - share), so a share a hair below
#: 1 would ask for billions of tokens (and min_budget would climb to them step by step).
MAX_SHARE = 0.99


@dataclass(frozen=True)
class EpiKV2Options(PolicyOptions):
    """EpiKV-2's options (the module's docstring says what each does); ``recent`` is also ``--recent``."""

    recent: float = setting("recent", 0.75, option=True)
    sinks: int = 4
    period: int = 16
    queries: int | None = None
    decay: float = 1.0
    prompt: str = "score"
    signal: str = "attention"
    credit: str = "sum"
    values: int = 0
    pool: int = 1
    keep: str = "head"
    adapt: int = 0
    copy: float | None = None
    copyweight: float = 0.05
    copymargin: int = DEFAULT_COPY_MARGIN
    loop: int | None = None

    def __post_init__(self) -> None:
        sinks, recent, period, queries, decay = self.sinks, self.recent, self.period, self.queries, self.decay
        prompt, signal, credit, values, pool, keep = (
            self.prompt,
            self.signal,
            self.credit,
            self.values,
            self.pool,
            self.keep,
        )
        adapt, copy, copyweight, copymargin, loop = self.adapt, self.copy, self.copyweight, self.copymargin, self.loop
        rules = (
            ("sinks", sinks, 0 <= sinks <= MAX_TOKENS, f"a number of tokens from 0 to {MAX_TOKENS}"),
            (
                "recent",
                recent,
                0 <= recent <= MAX_SHARE or (1 <= recent <= MAX_TOKENS and recent == int(recent)),
                f"a share of K from 0 to {MAX_SHARE}, or a whole number of tokens up to {MAX_TOKENS}",
            ),
            ("period", period, 1 <= period <= MAX_TOKENS, "a number of steps, 1 or more"),
            (
                "queries",
                queries,
                queries is None or 1 <= queries <= period,
                f"a number of queries from 1 to period ({period})",
            ),
            ("decay", decay, 0 < decay <= 1, "above 0 and at most 1 (1 keeps every refresh)"),
            ("prompt", prompt, prompt in ("score", "keep"), "score or keep"),
            ("signal", signal, signal in ("attention", "epiphany", "none"), "attention, epiphany or none"),
            ("credit", credit, credit in ("sum", "mean", "max"), "sum, mean or max"),
            ("values", values, values in (0, 1), "0 or 1"),
            ("pool", pool, 1 <= pool <= MAX_TOKENS and pool % 2 == 1, "an odd number, 1 or more"),
            ("keep", keep, keep in ("global", "layer", "head"), "global, layer or head"),
            ("adapt", adapt, adapt in (0, 1), "0 or 1"),
            ("copy", copy, copy is None or 0 <= copy <= 1, "a share from 0 (off) to 1"),
            ("copyweight", copyweight, 0 <= copyweight <= 1, "a weight from 0 to 1"),
            ("copymargin", copymargin, 0 <= copymargin <= MAX_TOKENS, f"a number of tokens from 0 to {MAX_TOKENS}"),
            ("loop", loop, loop is None or 0 <= loop <= MAX_TOKENS, f"a number of tokens from 0 (off) to {MAX_TOKENS}"),
        )
        for option, value, valid, allowed in rules:
            if not valid:
                raise UsageError(f"epikv2 option {option}={value!r} is out of range: it must be {allowed}")
        copies = keep != "global" and not adapt and signal == "attention"
        if copy and not copies:
            raise UsageError("epikv2 option copy needs keep=layer or keep=head, signal=attention and no adapt")
        if loop and (copy == 0 or not copies):
            raise UsageError(
                "epikv2 option loop follows copying heads: it needs copy on (keep=layer or keep=head, "
                "signal=attention, no adapt)"
            )
        if adapt and keep == "global":
            raise UsageError("epikv2 option adapt=1 needs keep=layer or keep=head")
        if keep != "global" and (signal == "epiphany" or credit != "sum" or pool != 1):
            raise UsageError(
                f"epikv2 keep={keep} scores by attention with credit=sum and pool=1 only; use keep=global for the "
                "others"
            )


class EpiKV2(Policy):
    """Sinks, a recent share of the budget, then the most attention received from recent queries."""

    name = "epikv2"
    protects_prompt = False
    takes_recent = True  # --recent R is its recent option, in tokens
    #: granular: each step's victims decided from a short list built at each refresh (False: search all K
    #: every step, the reference the list is tested against)
    shortlisted: ClassVar[bool] = True
    Options = EpiKV2Options

    def __init__(self, options: EpiKV2Options | None = None, **values: object) -> None:
        super().__init__(options, **values)
        o = self.options
        sinks, period, queries, decay, prompt, signal = o.sinks, o.period, o.queries, o.decay, o.prompt, o.signal
        credit, values, pool, keep, adapt, copy, loop = o.credit, o.values, o.pool, o.keep, o.adapt, o.copy, o.loop
        copyweight, copymargin, budget = o.copyweight, o.copymargin, o.budget or 0
        copies = keep != "global" and not adapt and signal == "attention"
        self.sinks = sinks
        self.recent_share = o.recent
        self.period = period
        self.decay = decay
        self.keep_prompt = prompt == "keep"
        self.signal = signal
        self.attention_needs = (
            AttentionNeeds(queries=period if queries is None else queries) if signal == "attention" else None
        )
        self.epiphany = EpiKV(recent=0) if signal == "epiphany" else None
        self.received = ScoreBook()  # attention received, summed over refreshes
        self.credit_rule = credit
        self.observed = ScoreBook()  # refreshes each token was scored in (credit=mean)
        self.derived = (
            ScoreBook()
        )  # the score select reads with credit=mean (received / observed) or max (the largest refresh)
        self.value_weighted = bool(values)
        self.pool = pool
        self._decode_steps = 0
        self.candidates = CandidateHeap(unscored=0.0)
        self._stale = True  # scores changed since the heap was built
        self.keep = keep
        self.granular = keep != "global"
        self._head_scores: int | None = None  # granular: the index of its score companion in cache.head_slots
        self._victims: HeadVictims | None = None  # granular: chosen on the device by stage, named to the host by settle
        self.adapt = bool(adapt)
        self._budget = budget
        self._recent_by_layer: torch.Tensor | None = None  # [layers] recent window of each layer, on the device
        self._shortlist: Shortlist | None = None  # granular: the possible victims until the next refresh
        self._shortlist_until = 0  # the last logical length the list covers
        self.copy = (DEFAULT_COPY if copies else 0.0) if copy is None else copy
        self.copy_weight = copyweight
        self.copy_margin = copymargin
        self.loop = (DEFAULT_LOOP if self.copy else 0) if loop is None else loop
        self._window: torch.Tensor | None = None  # copy: [layers, kv_heads, 1] each head's recent window

    def setup(self, num_layers: int, calibration=None) -> None:
        if self.epiphany is not None:
            self.epiphany.setup(num_layers, calibration)

    def tap_layers(self) -> list[int]:
        return self.epiphany.tap_layers() if self.epiphany is not None else []

    def stage(self, signals: Signals) -> list[torch.Tensor]:
        """At the prefill and every ``period`` steps: the stored queries' attention to each live slot,
        ``[stored]`` on the device, mean over evicting layers (nothing on the other steps)."""
        if self.granular:
            return self._stage_heads(signals)
        if self.signal != "attention":
            return self.epiphany.stage(signals) if self.epiphany is not None else []
        if not self._refreshes(signals):
            return []
        cache, record = signals.cache, signals.attention
        positions = cache.live_positions()
        seen = cache.seen
        total = None
        for j, index in enumerate(cache.evicting_layers):
            queries = record.queries[index]
            query_positions = torch.arange(seen - queries.shape[1], seen)
            keys, values = cache.layer_kv(j)
            part = received_attention(
                queries,
                keys[0],
                query_positions,
                positions,
                scaling=record.scaling.get(index),
                values=values[0] if self.value_weighted else None,
            )
            total = part if total is None else total + part.to(total.device)
        total = total / len(cache.evicting_layers)
        return [pooled_over_positions(total, positions, self.pool) if self.pool > 1 else total]

    def _refreshes(self, signals: Signals) -> bool:
        """Whether this forward refreshes the scores: the prefill, then every ``period`` decode steps."""
        if signals.prompt:
            return True
        self._decode_steps += 1
        return self._decode_steps % self.period == 0

    def _stage_heads(self, signals: Signals) -> list[torch.Tensor]:
        """Granular: refresh each (layer, KV head)'s scores from its own attention, then, over the budget,
        choose each one's victims on the device; return their positions and whether each is now held
        nowhere (for the step's one host read)."""
        cache = signals.cache
        slots, stored, seen = cache.head_slots, cache.stored, cache.seen
        if self._head_scores is None:
            self._head_scores = slots.companion()
        scores = slots.companions[self._head_scores]
        positions = slots.live(stored)
        floor = max(self.sinks, cache.prompt_len if self.keep_prompt else 0)
        if self._recent_by_layer is None:
            self._recent_by_layer = torch.full((slots.layers,), self.recent, dtype=torch.long, device=scores.device)
        refreshed = self._refreshes(signals)
        if refreshed and self.signal == "attention":
            indices = cache.evicting_layers
            live = [cache.layer_kv(j) for j in range(len(indices))]
            queries = [signals.attention.queries[index] for index in indices]
            width = queries[0].shape[1]
            far = None
            if self.copy:  # where the queries look among the tokens older than the default window (and inside it)
                scored, old = positions >= floor, positions < seen - self.recent
                far = scored & old
                if 0 < self.loop < self.recent:
                    far = torch.stack([far, scored & ~old & (positions < seen - self.loop)])
            received, sources, weights = refresh_layers(
                queries,
                [keys[0] for keys, _ in live],
                torch.arange(seen - width, seen, device=scores.device),
                positions,
                [signals.attention.scaling.get(index) for index in indices],
                [values[0] for _, values in live] if self.value_weighted else None,
                far,
            )
            received = received.to(scores.device)  # [layers, kv_heads, stored]
            if self.keep == "layer":
                received = received.mean(dim=1, keepdim=True).expand_as(received)
            if self.adapt:
                self._adapt_recent(received, positions, floor, seen)
            if self.copy:
                self._follow_copies(sources.to(scores.device), weights.to(scores.device), floor, seen)
            current = scores[:, :, :stored]  # a view: updated in place
            if self.decay < 1:
                current.mul_(self.decay)
            current.add_(received)
        over = stored - cache.budget if cache.budget is not None else 0
        self._victims = None
        if refreshed or over != 1 or not self.shortlisted or seen > self._shortlist_until:
            self._shortlist = None
        if over <= 0:
            return []
        known = None  # the victims' positions, when the short list knows them
        if self._shortlist is not None:  # between refreshes: the victim the list decided for this step
            victims, known = self._shortlist.pick(seen)
        else:  # after a refresh (or several at once): all of them, and a new list for the next steps
            window_start = seen - (self._window if self._window is not None else self._recent_by_layer[:, None, None])
            candidates = (positions >= floor) & (positions < window_start)
            if over == 1 and self.shortlisted:
                self._shortlist = Shortlist.build(
                    slots, scores[:, :, :stored], candidates, window_start, floor, stored, self.period, seen
                )
                # the list holds the lowest candidates, so its first pick is the full search's victim
                victims, known = self._shortlist.pick(seen)
                # it lists the tokens that leave the recent window within `period` steps, if they exist yet
                shortest_window = self._adapt_range(floor)[0] if self.adapt else self.recent
                self._shortlist_until = seen + min(self.period, shortest_window)
            else:
                victims = slots.lowest(scores[:, :, :stored], candidates, stored, over)
        self._victims = HeadVictims(victims, [])
        return list(slots.release(victims, stored, known))

    def follow(self, moves: Moves) -> None:
        """The listed slots follow the cache's moves (a single sequence's cache moves nothing in the steady state)."""
        if self._shortlist is not None and moves.head_victims is not None:
            self._shortlist.follow(moves.head_victims, moves.head_last)

    def _follow_copies(self, sources: torch.Tensor, weights: torch.Tensor, floor: int, seen: int) -> None:
        """copy=S: a (layer, KV head) whose recent queries read, one step after another, consecutive tokens
        older than its default recent window (a copy of an earlier passage, :func:`copy_windows`) stretches
        its window back to that source (and ``copymargin`` tokens before it) until the next refresh, so that
        the rest of the passage stays; with ``loop``, a head repeating what it wrote ``loop`` or more tokens
        back keeps twice that distance.

        Args:
            sources, weights: ``[layers, kv_heads, group, w]`` from :func:`refresh_layers`, or ``[2, ...]``: beyond
                the window, and inside it from ``loop`` tokens back.
        """
        near = (sources[1], weights[1]) if sources.dim() == 5 else None
        far = (sources[0], weights[0]) if near is not None else (sources, weights)
        window = copy_windows(
            *far,
            seen - 1,
            self.copy,
            self.copy_weight,
            self.recent,
            self._budget - floor,
            self.copy_margin,
            near,
        )[..., None]
        if self.keep == "layer":  # one set per layer: a copying head stretches its whole layer's window
            window = window.amax(dim=1, keepdim=True).expand_as(window)
        self._window = window

    def _adapt_recent(self, received: torch.Tensor, positions: torch.Tensor, floor: int, seen: int) -> None:
        """adapt=1: move each layer's recent window by K/16 towards whichever use of its heavy slots this
        refresh's queries attended more: the h heavy hitters it holds, or the h oldest tokens of its recent
        window (standing for the h more recent tokens that streaming would hold instead). Bounded by
        :meth:`_adapt_range`; computed on the device.

        Args:
            received: ``[layers, kv_heads, n]`` this refresh's attention; positions: ``[layers, kv_heads, n]``.
        """
        recent = self._recent_by_layer[:, None, None]
        heavy = (positions >= floor) & (positions < seen - recent)
        count = heavy.sum(dim=-1, keepdim=True)  # [layers, kv_heads, 1]
        band = (positions >= seen - recent) & (positions < seen - recent + count)
        lead = (received * band).sum(dim=-1) - (received * heavy).sum(dim=-1)  # [layers, kv_heads]: recency's lead
        voting = count[..., 0] > 0
        votes = voting.sum(dim=-1)
        direction = torch.sign((lead * voting).sum(dim=-1)) * (votes > 0)  # [layers]: +1 grow, -1 shrink, 0 no vote
        direction = torch.where((direction == 0) & (votes > 0), -1, direction)  # a tie favours the heavy hitters
        step = max(1, self._budget // 16)
        low, high = self._adapt_range(floor)
        self._recent_by_layer = (self._recent_by_layer + step * direction.long()).clamp(min=low, max=high)

    def _adapt_range(self, floor: int) -> tuple[int, int]:
        """adapt=1: the smallest and largest recent window, K/2 and K minus the tokens always kept (``floor``: the
        sinks, or the prompt with prompt=keep), so that one candidate is left whatever the window."""
        high = self._budget - floor
        return min(self._budget // 2, high), high

    def settle(self, signals: Signals, values: list[torch.Tensor]) -> None:
        """Credit a refresh's attention to the live tokens (granular: learn which victims left for good)."""
        if self.granular:
            if self._victims is not None and values:
                self._victims.gone = gone_positions(values[0], values[1])
            return
        if self.epiphany is not None:
            self.epiphany.settle(signals, values)
        elif values:
            self.credit(signals.cache.live_positions(), values[0])

    def credit(self, positions: torch.Tensor, received: torch.Tensor) -> None:
        """Decay the scores of ``positions`` ``[n]``, then add ``received`` ``[n]`` to them (a refresh)."""
        if self.decay < 1:
            current = self.received.gather(positions)
            self.received.add(positions, torch.nan_to_num(current, nan=0.0) * (self.decay - 1))
        if self.credit_rule == "max":
            self.derived.put(positions, torch.fmax(self.derived.gather(positions), received.double()))
        self.received.add(positions, received)
        if self.credit_rule == "mean":
            self.observed.add(positions, torch.ones(positions.shape))
            self.derived.put(positions, self.received.gather(positions) / self.observed.gather(positions))
        self._stale = True

    def budget_floor(self, prompt_len: int) -> BudgetFloor:
        """Smallest K that holds the sinks, the recent share of K (and the prompt with prompt=keep) and one more.

        K - recent(K) never decreases as K grows, so iterating from below reaches the smallest fixed point.
        """
        floor = max(self.sinks, prompt_len if self.keep_prompt else 0) + 1  # the sinks lie inside a kept prompt
        budget = floor
        while budget < (needed := floor + self.recent_for(budget)):
            budget = needed
        if self.recent_share < 1:
            window = (
                f"{self.recent_share:.0%} of K as its recent window ({self.recent_for(budget)} tokens at K = {budget})"
            )
        else:
            window = f"a {self.recent_for(budget)}-token recent window"
        keeps = f"{self.sinks} sink tokens and {window}"
        if self.keep_prompt:
            keeps += f" and the {prompt_len}-token prompt"
        return BudgetFloor(budget, keeps)

    def select(self, cache: CacheView, count: int) -> list[int] | HeadVictims:
        """The ``count`` lowest scores among the evictable tokens (unscored counts as 0; ties: the older).

        Between refreshes scores are frozen and one token leaves the recent window per step, so the
        candidates wait in a heap; a refresh rebuilds it from the live tokens' new scores. Granular: the
        victims :meth:`stage` chose on the device for every (layer, KV head).
        """
        if self.granular:
            victims, self._victims = self._victims, None
            if victims is None or len(victims) != count:
                raise RuntimeError(
                    f"epikv2 keep={self.keep}: asked to evict {count}, "
                    f"but the step chose {0 if victims is None else len(victims)}"
                )
            return victims
        if self.epiphany is not None:
            book = self.epiphany.book
        else:
            book = self.received if self.credit_rule == "sum" else self.derived
        floor = max(self.sinks, cache.prompt_len if self.keep_prompt else 0)
        end = cache.seen - self.recent
        if self._stale:
            self.candidates.rebuild(book, cache.live_positions(), floor, end)
            self._stale = False
        else:
            self.candidates.admit(book, floor, end)
        return cache.slots_of(self.candidates.pop(count))
