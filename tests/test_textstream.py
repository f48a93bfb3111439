"""Incremental detokenisation streams exactly the decoded text."""

from __future__ import annotations

from epikv_cli.runtime.textstream import IncrementalDetokenizer


def test_multibyte_characters_wait_until_complete(tokenizer):
    ids = tokenizer("héllo wörld ✓", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == "héllo wörld ✓"
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces  # the first byte of a two-byte character prints nothing yet


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("ab", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "ab"


class CountingTokenizer:
    """Wraps a tokenizer, counting how many ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_long_run_of_silent_tokens_costs_constant_work_per_token(tokenizer):
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    ids = tokenizer("a", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * 5000
    ids += tokenizer("b", add_special_tokens=False)["input_ids"]
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "ab"
    assert counting.decoded < 2 * 70 * len(ids)  # at most two windows of WINDOW + a few tokens per push (was quadratic)
