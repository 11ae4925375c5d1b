"""Decoding benchmark: the engine's KV-cached generation next to transformers `generate`.

    .venv/bin/python bench/bench_generate.py [--shape tiny|mid] [--config MODEL.yaml]
        [--batches 1,8,32] [--prompt-len 64] [--new-tokens 64] [--threads 2] [--repeats 1]
        [--impls ours,transformers] [--json out.json]

Same random weights for both (ours exported to a transformers ``hrm_text`` directory), greedy,
prompts of one length (no padding, so both do the same work). Each (implementation, batch) runs
in a fresh process so that its peak resident memory is its own; with ``--repeats N`` the
implementations' processes alternate (ours first in even rounds, last in odd ones), so that on a
shared machine each sees the same load, and the table shows medians. ``--same-process`` runs all
implementations in one process per batch instead, alternating round by round (``--repeats``
rounds): robust ratios on a loaded machine, but one shared peak RSS. Prefill is timed as
generating one token; decode tokens/s is ``batch x (new - 1) / (t(new) - t(1))``, each time the
fastest of its rounds (2 per process in the separate-process mode), the same formula for all.
The greedy tokens of all are compared. Implementations: ``ours`` (the engine as it runs),
``megatron`` (the engine on megatron's layer modules, ``InferenceEngine(megatron_layers=True)``),
``compiled`` (``InferenceEngine(compile_decode=True)``: static-shape decoding steps through
``torch.compile``; its warm-up generates all ``new`` tokens once and is reported as the compile
cost, apart from the steady-state rate), ``transformers``. ``--shape`` names a shape of
``mimir bench`` (``mimir_megatron.bench.shapes``: tiny D=256 2+2 layers vocab 1k; mid D=768
4+4 layers vocab 32k); ``--config`` a model YAML instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def _runners(impls: list[str], weights: Path, hf_dir: Path, batch: int, prompt_len: int) -> dict:
    """``impl -> run(n)``: generate ``n`` tokens for the batch, return the new tokens per row.
    The engines share one loaded model."""
    import torch

    runners = {}
    base = None
    for impl in impls:
        if impl != "transformers":
            from mimir_megatron.inference import (
                GenerationRequest, InferenceEngine, SamplingParams, load_engine,
            )

            if base is None:
                base = load_engine(weights=weights, max_batch_size=batch)
            engine = base
            if impl == "megatron":  # the same model, the engine on megatron's layer modules
                engine = InferenceEngine(base.model, None, max_batch_size=batch, megatron_layers=True)
            if impl == "compiled":  # static-shape decoding steps through torch.compile
                engine = InferenceEngine(base.model, None, max_batch_size=batch, compile_decode=True)
            prompts = _prompts(batch, prompt_len, engine.limits.vocab_size)

            def run(n: int, engine=engine, prompts=prompts) -> list[list[int]]:
                reqs = [
                    GenerationRequest(p, SamplingParams(max_new_tokens=n, use_default_stops=False))
                    for p in prompts
                ]
                return [r.token_ids for r in engine.generate(reqs)]

        else:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
            ids = torch.tensor(_prompts(batch, prompt_len, model.config.vocab_size))

            @torch.no_grad()
            def run(n: int, model=model, ids=ids) -> list[list[int]]:
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    token_type_ids=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                return out[:, prompt_len:].tolist()

        runners[impl] = run
    return runners


def _measure(impls: list[str], weights: Path, hf_dir: Path, batch: int, prompt_len: int, new: int,
             rounds: int) -> list[dict]:
    """Run in a child process: per implementation, time generating 1 and ``new`` tokens in each
    of ``rounds`` rounds (the implementations alternate within a round, reversed every other
    round) and keep the fastest (on a shared machine, other jobs only ever add time)."""
    runners = _runners(impls, weights, hf_dir, batch, prompt_len)
    warmup = {}
    for impl, run in runners.items():
        start = time.perf_counter()
        run(new if impl == "compiled" else 2)  # warm-up (allocator, first calls; the compile)
        warmup[impl] = time.perf_counter() - start
    t1 = dict.fromkeys(impls, float("inf"))
    tn = dict.fromkeys(impls, float("inf"))
    tokens = {}
    for r in range(rounds):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            start = time.perf_counter()
            runners[impl](1)
            t1[impl] = min(t1[impl], time.perf_counter() - start)
            start = time.perf_counter()
            tokens[impl] = runners[impl](new)
            tn[impl] = min(tn[impl], time.perf_counter() - start)
    return [
        {
            "impl": impl,
            "batch": batch,
            "prefill_tokens_per_s": batch * prompt_len / t1[impl],
            "decode_tokens_per_s": batch * (new - 1) / max(tn[impl] - t1[impl], 1e-9),
            # the process's peak: one implementation's own only when it ran alone
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "warmup_s": warmup[impl],
            "tokens": tokens[impl],
        }
        for impl in impls
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=("tiny", "mid"),
                        help="a mimir bench shape (ignored with --config)")
    parser.add_argument("--config", help="a model YAML instead of --shape")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternating rounds per implementation (processes, or rounds in one)")
    parser.add_argument("--same-process", action="store_true",
                        help="all implementations in one process per batch, alternating round by "
                             "round (robust ratios on a loaded machine; peak RSS is then shared)")
    parser.add_argument("--impls", default="ours,transformers",
                        help="comma-separated: ours, megatron (ours on megatron's layers), "
                        "compiled (ours with compile_decode), transformers")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    from mimir_megatron.process import setup_process

    setup_process(megatron=True)  # this script is an entry point: the CPU backend, once, before any model
    torch.set_num_threads(args.threads)
    if args.child:
        impls, weights, hf_dir, batch, rounds = args.child
        results = _measure(impls.split(","), Path(weights), Path(hf_dir), int(batch), args.prompt_len,
                           args.new_tokens, int(rounds))
        print(json.dumps(results))
        return 0

    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.interop import export_hf, save_weights
    from mimir_megatron.model import build_model

    impls = args.impls.split(",")
    unknown = set(impls) - {"ours", "megatron", "compiled", "transformers"}
    if unknown or "ours" not in impls or "transformers" not in impls:
        parser.error(f"--impls must hold ours and transformers (and may hold megatron, compiled), "
                     f"got {args.impls!r}")
    work = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    model = build_model(model_config(args.shape, args.config))
    save_weights(model, work / "weights")
    export_hf(model, work / "hf")
    del model
    rows = []
    extra = " | megatron-layers decode tok/s" if "megatron" in impls else ""
    if "compiled" in impls:
        extra += " | compiled decode tok/s | compiled ratio | compile + first run s"
    print(
        "| batch | ours prefill tok/s | ours decode tok/s | transformers prefill | transformers decode "
        f"| prefill ratio | decode ratio{extra} | ours peak RSS GB | transformers peak RSS GB | same tokens |"
    )
    print("| ---: " * (10 + extra.count("|")) + "|")
    for batch in [int(b) for b in args.batches.split(",")]:
        runs: dict[str, list[dict]] = {impl: [] for impl in impls}

        def child(names: list[str], rounds: int) -> None:
            cmd = [
                sys.executable, __file__, "--prompt-len", str(args.prompt_len),
                "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
                "--child", ",".join(names), str(work / "weights"), str(work / "hf"), str(batch), str(rounds),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            for result in json.loads(out.strip().splitlines()[-1]):
                runs[result["impl"]].append(result)

        if args.same_process:
            child(impls, args.repeats)
        else:
            for rep in range(args.repeats):
                for impl in impls if rep % 2 == 0 else impls[::-1]:
                    child([impl], 2)
        tokens = [r.pop("tokens") for impl_runs in runs.values() for r in impl_runs]
        same = all(t == tokens[0] for t in tokens)

        def median(impl: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[impl])

        ours = {k: median("ours", k) for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_gb")}
        peer = {k: median("transformers", k) for k in ours}
        ratio = ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
        prefill_ratio = ours["prefill_tokens_per_s"] / peer["prefill_tokens_per_s"]
        row = {"batch": batch, "runs": runs, "ours": ours, "transformers": peer, "decode_ratio": ratio,
               "prefill_ratio": prefill_ratio, "same_tokens": same}
        cell = ""
        if "megatron" in impls:
            row["megatron_decode_tokens_per_s"] = median("megatron", "decode_tokens_per_s")
            cell = f" | {row['megatron_decode_tokens_per_s']:,.0f}"
        if "compiled" in impls:
            row["compiled_decode_tokens_per_s"] = median("compiled", "decode_tokens_per_s")
            row["compiled_decode_ratio"] = row["compiled_decode_tokens_per_s"] / peer["decode_tokens_per_s"]
            row["compile_and_first_run_s"] = median("compiled", "warmup_s")
            cell += (f" | {row['compiled_decode_tokens_per_s']:,.0f} | {row['compiled_decode_ratio']:.2f}"
                     f" | {row['compile_and_first_run_s']:.0f}")
        rows.append(row)
        print(
            f"| {batch} | {ours['prefill_tokens_per_s']:,.0f} | {ours['decode_tokens_per_s']:,.0f} | "
            f"{peer['prefill_tokens_per_s']:,.0f} | {peer['decode_tokens_per_s']:,.0f} | "
            f"{prefill_ratio:.2f} | {ratio:.2f}{cell} | {ours['peak_rss_gb']:.2f} | "
            f"{peer['peak_rss_gb']:.2f} | {'yes' if same else 'NO'} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
