"""`mimir generate`: batched generation from a JSONL file of prompts
(:mod:`mimir_megatron.inference.jsonl`: the line format, bad lines).

    mimir generate --checkpoint runs/demo/checkpoints --input prompts.jsonl --output out.jsonl
"""

from __future__ import annotations

import argparse

from mimir_megatron.checkpoint import add_model_arguments


def add_generate_source(p: argparse.ArgumentParser) -> None:
    """The model flags of every command (:func:`mimir_megatron.checkpoint.add_model_arguments`) and
    the engine's."""
    add_model_arguments(p)
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's own)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="TP size (run under torchrun)")
    p.add_argument("--compile-decode", action="store_true",
                   help="decoding-only steps through torch.compile: CUDA graphs on a GPU; on CPU "
                        "Inductor with dynamic shapes, one compile per schedule (1-5 min on 2 cores), "
                        "0.45-0.9x eager's speed there (docs/performance.md)")


def engine_from_args(args: argparse.Namespace, **kwargs):
    from mimir_megatron.inference import load_engine

    return load_engine(
        model=args.model,
        checkpoint=args.checkpoint,
        ema=args.ema,
        weights=args.weights,
        hf=args.hf,
        tokenizer=args.tokenizer,
        tensor_parallel_size=args.tensor_parallel_size,
        compile_decode=args.compile_decode,
        **kwargs,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for a JSONL file of prompts")
    add_generate_source(p)
    p.add_argument("--input", required=True, help="JSONL: prompt | messages | prompt_ids per line")
    p.add_argument("--output", required=True, help="JSONL to write (one line per input line)")
    p.add_argument("--h-cycles", type=int, help="schedule: H cycles (default: as trained)")
    p.add_argument("--l-cycles", type=int, help="schedule: L cycles per H cycle (default: as trained)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens generated per row, at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: all)")
    p.add_argument("--seed", type=int, help="sampling seed; line i uses seed + i")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--batch-size", type=int, default=32, help="rows decoded together")
    p.add_argument("--logprobs", action="store_true", help="write per-token log-probs")
    p.set_defaults(handler=cmd_generate, setup="megatron")


def cmd_generate(args: argparse.Namespace) -> int:
    from mimir_megatron.inference import SamplingParams
    from mimir_megatron.inference.jsonl import generate_jsonl

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              stop_strings=tuple(args.stop))
    done = generate_jsonl(lambda: engine_from_args(args, max_batch_size=args.batch_size), args.input,
                          args.output, sampling, h_cycles=args.h_cycles, l_cycles=args.l_cycles,
                          logprobs=args.logprobs)
    return 1 if done.bad and not done.generated else 0
