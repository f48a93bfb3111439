"""Evicted positions merge into contiguous spans, listed newest first."""

from epikv_cli.cli.spans import EvictedSpans


def test_merging_and_order():
    spans = EvictedSpans()
    for position in [5, 7, 6, 10, 3, 4, 12, 11]:
        spans.add(position)
    assert spans.ranges() == [(3, 7), (10, 12)]
    assert [(s.start, s.end) for s in spans.newest(5)] == [(10, 12), (3, 7)]
    assert spans.total == 8 and len(spans) == 2


def test_bridging_two_spans():
    spans = EvictedSpans()
    for position in [1, 2, 4, 5, 3]:
        spans.add(position)
    assert spans.ranges() == [(1, 5)]
