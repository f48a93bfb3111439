"""Incremental detokenisation streams exactly the decoded text."""

from __future__ import annotations

from epikv_cli.textstream import IncrementalDetokenizer


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
