"""Check a real model: with a budget that evicts nothing, epikv must reproduce ``model.generate``;
with a small budget it must evict and stay within it.

    .venv/bin/python benchmarks/check_equivalence.py --model PATH_OR_GGUF [--tokens 30] [--budget 96]

Prints whether the greedy tokens match, the largest logit difference, and the small-budget run's
evictions, peak stored length and decode speed.
"""

from __future__ import annotations

import argparse

import torch

from epikv_cli.config import CacheSettings, ModelSettings, SamplingSettings
from epikv_cli.data.prompts import build_input_ids
from epikv_cli.models.loading import load
from epikv_cli.runtime.generation import Generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", default="Explain why the sky is blue.")
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--budget", type=int, default=96)
    args = parser.parse_args()
    loaded = load(ModelSettings(model=args.model))
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = build_input_ids(tokenizer, args.prompt).to(model.device)
    # an explicit mask: without it generate masks every token equal to the pad id (often <|im_end|>)
    reference = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=args.tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    run = Generation(
        model,
        tokenizer,
        ids,
        CacheSettings(budget=ids.shape[1] + args.tokens + 128, policy="epikv"),
        SamplingSettings(max_new_tokens=args.tokens, ignore_eos=True),
        keep_logits=True,
    )
    events = list(run)
    same = [e.token_id for e in events] == reference.sequences[0, ids.shape[1] :].tolist()
    gap = max(float((e.logits.float() - row[0].float()).abs().max()) for e, row in zip(events, reference.logits))
    print(
        f"{model.config.model_type}, {model.config.num_hidden_layers} layers, attn {loaded.attn}: "
        f"same greedy tokens as model.generate: {same}; largest logit difference {gap:.2e}"
    )
    small = Generation(
        model,
        tokenizer,
        ids,
        CacheSettings(budget=args.budget, policy="epikv"),
        SamplingSettings(max_new_tokens=200, ignore_eos=True),
    )
    for _ in small:
        pass
    r = small.result
    print(
        f"budget {args.budget}: 200 tokens, evicted {r.evicted}, peak stored {r.peak_stored}, "
        f"{r.decode_tokens_per_s} tok/s decode"
    )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
