"""One sequence fed under its own cache and policy, token by token: the forward and the replay primitive."""

from __future__ import annotations

import inspect
import warnings

import torch

from epikv_cli.config import CacheSettings
from epikv_cli.errors import EpikvWarning
from epikv_cli.runtime.session import EpiKVSession


def context_length(model) -> int | None:
    """The most positions the model was trained for (``max_position_embeddings``), if its config says."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def warn_beyond_context(model, prompt_tokens: int) -> None:
    """An :class:`~epikv_cli.errors.EpikvWarning` when a prompt is longer than the model's context: it runs (a
    budget bounds the cache, not the positions), but the model never saw such positions in training."""
    limit = context_length(model)
    if limit is not None and prompt_tokens > limit:
        warnings.warn(
            f"the prompt has {prompt_tokens} tokens, more than the model's context of {limit} "
            "(max_position_embeddings): it runs, but the model was not trained on positions beyond it",
            EpikvWarning,
            stacklevel=3,
        )


def forward_step(model, session: EpiKVSession, ids: torch.Tensor, logits_to_keep: bool = True) -> torch.Tensor:
    """One forward of ``ids`` ``[1, q]`` under ``session``'s cache; the ``[vocab]`` logits of the last position."""
    cache = session.cache
    kwargs = {"logits_to_keep": 1} if logits_to_keep else {}
    if session.attention is not None and session.attention.returns_weights:
        kwargs["output_attentions"] = True  # the authors' set-up: every layer's weights come back
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            cache=cache,
            position_ids=cache.position_ids(ids.shape[1], ids.device),
            use_cache=True,
            **kwargs,
        )
    return out.logits[0, -1]


class CacheStream:
    """One sequence fed token by token under its own cache and policy, without sampling: the replay primitive.

    ``feed(ids)`` runs the prompt (``[1, prompt_len]``) or one token (``[1, 1]``) and returns the
    ``[vocab]`` logits of the last position; eviction happens after each forward, as in generation.
    Close it (or use it as a context manager) to remove its hooks.
    """

    def __init__(self, model, settings: CacheSettings, max_tokens: int | None = None, policy=None) -> None:
        self.model = model
        self.session = EpiKVSession(model, settings, max_tokens=max_tokens, policy=policy)
        self.device = input_device(model)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def cache(self):
        return self.session.cache

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cache.seen == 0:  # refuse a prompt over the budget before computing anything
            self.session.policy.check_budget(ids.shape[1], self.cache.budget)
        return forward_step(self.model, self.session, ids.to(self.device), self._logits_to_keep)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> CacheStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def input_device(model) -> torch.device:
    """Where input ids go: the input embeddings' device (the first device under a device map)."""
    return model.get_input_embeddings().weight.device
