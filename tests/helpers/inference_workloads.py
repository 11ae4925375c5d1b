"""Prompts and the generation workload that the one-rank and TP=2 inference tests both run, and
the engine the server tests serve."""

from __future__ import annotations

import torch

from mimir_megatron.inference import GenerationRequest, SamplingParams

VOCAB = 250


def served_engine(*overrides: str):
    """The server tests' engine: the tiny model (seed 0, the demo tokenizer's 1,024-token
    vocabulary; ``overrides`` of its config) with the demo tokenizer, served as model "tiny"."""
    from conftest import REPO, tiny_config

    from mimir_megatron.chat import load_tokenizer
    from mimir_megatron.inference import InferenceEngine
    from mimir_megatron.model import build_model

    torch.manual_seed(0)
    model = build_model(tiny_config("vocab_size=1024", *overrides))
    return InferenceEngine(model, load_tokenizer(REPO / "data_prep/mimir_data_prep/demo/tokenizer"), model_name="tiny")


def random_prompts(lengths, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def tp_workload(engine) -> dict:
    """What the TP=2 worker (tests/workers/tp_generate.py) and the one-rank test both run."""
    prompts = random_prompts([2, 7, 15], seed=21)
    greedy = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=6), 2, 2) for p in prompts])
    sampled = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9,
                                                                   seed=i)) for i, p in enumerate(prompts)])
    scores = engine.score([(prompts[0], prompts[1]), (prompts[2], prompts[0])])
    return {"greedy": [r.token_ids for r in greedy], "sampled": [r.token_ids for r in sampled],
            "greedy_logprobs": [r.logprobs for r in greedy], "scores": [s.token_logprobs for s in scores]}
