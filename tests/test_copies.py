"""Copy lookahead: the n-gram index and the range counts, against hand-made sequences and brute force."""

import pytest
import torch

from epikv_cli.copies import NgramIndex, lookahead_hits


def test_each_token_closing_a_seen_ngram_names_where_it_last_ended():
    index = NgramIndex(2)
    #          positions: 0  1  2  3  4  5  6  7
    assert index.feed([5, 6, 7, 5, 6], first=0) == [None, None, None, None, 1]  # (5, 6) at 3-4 ended at 1 before
    assert index.feed([7, 9, 5, 6], first=5) == [2, None, None, 4]  # (6, 7) at 4-5 ended at 2; (5, 6) at 7-8 last at 4
    assert index.feed([7], first=9, match=False) == []  # indexed without matching (a prompt)
    assert index.feed([9, 5], first=10) == [6, 7]  # (7, 9) last ended at 6, (9, 5) at 7
    with pytest.raises(ValueError):
        NgramIndex(0)


def test_the_ngram_spans_separate_feeds_and_the_prompt():
    index = NgramIndex(3)
    assert index.feed([1, 2, 3, 4], first=0, match=False) == []
    assert index.feed([1, 2], first=4) == [None, None]  # (3, 4, 1) and (4, 1, 2) are new
    assert index.feed([3], first=6) == [2]  # (1, 2, 3) ended at 2 in the prompt


def test_lookahead_hits_counts_the_ranges_holding_each_position():
    generator = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 200, (2, 3, 50), generator=generator)
    starts = torch.randint(0, 180, (17,), generator=generator)
    horizon = 24
    brute = ((positions[..., None] > starts) & (positions[..., None] <= starts + horizon)).sum(-1).float()
    assert torch.equal(lookahead_hits(positions, starts, horizon), brute)
    # by hand: ranges (3, 5] and (4, 6]
    assert lookahead_hits(torch.tensor([3, 4, 5, 6, 7]), torch.tensor([4, 3]), 2).tolist() == [0, 1, 2, 1, 0]
