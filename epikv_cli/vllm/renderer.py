"""vLLM's Hugging Face renderer, refusing before scheduling a prompt that epikv's ring cannot take.

A request's whole prompt is one forward into its ring (no chunked prefill), so a prompt longer than the ring, or
below its policy's budget floor, cannot run. Found inside the model's forward, that would end vLLM's engine core
and every request with it (`epikv serve` would stop answering); found here, where vLLM validates every prompt
(``InputProcessor``), it is that request's own error: HTTP 400 on the server, a ``ValueError`` from ``LLM.generate``.

vLLM picks a renderer by the model's tokenizer mode: :func:`register` adds the mode :data:`TOKENIZER_MODE` (the
Hugging Face tokenizer, with this renderer), and :func:`epikv_cli.vllm.engine.engine_arguments` selects it.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.exceptions import VLLMValidationError
from vllm.renderers.hf import HfRenderer
from vllm.renderers.registry import RENDERER_REGISTRY
from vllm.tokenizers.registry import TokenizerRegistry

from epikv_cli.errors import UsageError
from epikv_cli.policies.registry import make_policy
from epikv_cli.vllm.ring import check_prompt
from epikv_cli.vllm.settings import CONFIG_KEY, TOKENIZER_MODE, settings_from_config


class RingRenderer(HfRenderer):
    """:class:`HfRenderer` whose prompt validation also asks whether the prompt fits the ring of the engine's
    policy and budget (``additional_config``)."""

    def __init__(self, config, tokenizer) -> None:
        super().__init__(config, tokenizer)
        extra = config.additional_config or {}
        self.cache = settings_from_config(extra) if CONFIG_KEY in extra else None
        self.policy = make_policy(self.cache) if self.cache is not None else None  # its budget floor, read per prompt

    def validate_token_ids(self, token_ids: Sequence[int], *, parameter: str | None = None) -> None:
        if parameter is None and self.cache is not None and token_ids:  # a prompt's ids
            try:
                check_prompt(self.policy, self.cache, len(token_ids))
            except UsageError as error:
                raise VLLMValidationError(str(error)) from None
        super().validate_token_ids(token_ids, parameter=parameter)


def register() -> None:
    """The tokenizer mode :data:`TOKENIZER_MODE`: vLLM's cached Hugging Face tokenizer, rendered by
    :class:`RingRenderer` (in every process that validates prompts; registering again replaces the same names)."""
    if TOKENIZER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(TOKENIZER_MODE, "vllm.tokenizers.hf", "CachedHfTokenizer")
    if TOKENIZER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(TOKENIZER_MODE, __name__, RingRenderer.__name__)
