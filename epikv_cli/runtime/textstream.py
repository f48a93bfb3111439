"""Incremental detokenisation: text for each new token as soon as it is printable."""

from __future__ import annotations

#: Most tokens decoded at once while nothing printable arrives.
WINDOW = 64


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Decodes a short window of recent tokens twice (with and without the newest ones) and emits the
    difference, so tokenizers that merge or strip spaces across token boundaries still stream correctly;
    a delta ending in an incomplete UTF-8 sequence ("\\ufffd") waits for the next token.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty).

        Tokens that add no text at all (skipped special tokens) are consumed at once, and the window
        decoded twice never exceeds :data:`WINDOW` tokens, so a long run of them costs O(1) per token.
        """
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        if after == before:  # nothing new, not even half a character
            self._read = len(self.ids)
            if self._read - self._prefix > WINDOW:
                self._prefix = self._read
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]
