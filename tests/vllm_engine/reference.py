"""The transformers engine's record of greedy generations, for the vLLM tests (run by the transformers venv's python).

Reads JSON from stdin: ``{"model": dir, "dtype": "float32", "threads": T, "jobs": [{"policy": ..., "budget": ...,
"new": N, "prompts": [[ids...], ...]}, ...]}``; writes one JSON line to stdout per job, in order, as each finishes:
per prompt its generated ``tokens``, the logical positions each step ``evicted`` (the step whose logits chose that
token), and each step's top-2 logit ``gaps`` (the margin greedy decoding had). A job's prompts run together through
the batch decoder, whose rows never see each other (its own tests show each row equals the prompt alone).
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from epikv_cli.config import CacheSettings
from epikv_cli.core.hostread import host_copies
from epikv_cli.runtime.batched import BatchDecoder


def main() -> None:
    setup = json.load(sys.stdin)
    torch.set_num_threads(setup["threads"])
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=getattr(torch, setup["dtype"]))
    for job in setup["jobs"]:
        print(json.dumps(run(model, job)), flush=True)


def run(model, job: dict) -> list[dict]:
    settings = CacheSettings(budget=job["budget"], policy=job["policy"])
    records = [{"tokens": [], "evicted": [], "gaps": []} for _ in job["prompts"]]
    with torch.inference_mode(), BatchDecoder(model, [settings]) as decoder:
        logits = [decoder.add(torch.tensor([ids]), settings) for ids in job["prompts"]]
        for step in range(job["new"]):
            scores = torch.stack(logits).double()
            tokens = scores.argmax(dim=-1)
            top = torch.topk(scores, 2, dim=-1).values
            values = host_copies([tokens, top[:, 0] - top[:, 1], *decoder.pending_reads])
            if step:
                decoder.settle(values[2:])
            for row, record in enumerate(records):
                record["tokens"].append(int(values[0][row]))
                record["gaps"].append(float(values[1][row]))
                record["evicted"].append(sorted(decoder.cache.rows[row].last_evicted))
            if step + 1 < job["new"]:
                logits = list(decoder.forward(tokens))
    return records


if __name__ == "__main__":
    main()
