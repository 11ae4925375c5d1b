"""Decoding benchmark: the engine's KV-cached generation next to transformers `generate`.

    .venv/bin/python bench/bench_generate.py [--config configs/model/tiny.yaml] [--batches 1,8,32]
        [--prompt-len 64] [--new-tokens 64] [--threads 2] [--json out.json]

Same random weights for both (ours exported to a transformers ``hrm_text`` directory), greedy,
prompts of one length (no padding, so both do the same work). Each (implementation, batch) runs
in a fresh process so that its peak resident memory is its own. Prefill is timed as generating
one token; decode tokens/s is ``batch x (new - 1) / (t(new) - t(1))``, the same formula for both.
The greedy tokens of both are compared.
"""

from __future__ import annotations

import argparse
import json
import resource
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


def _measure(impl: str, weights: Path, hf_dir: Path, batch: int, prompt_len: int, new: int) -> dict:
    """Run in a child process: time generation of 1 and of ``new`` tokens; report tokens."""
    import torch

    cache_bytes = None
    if impl == "ours":
        from mimir_megatron.inference import GenerationRequest, SamplingParams, load_engine

        engine = load_engine(weights=weights, max_batch_size=batch)
        prompts = _prompts(batch, prompt_len, engine.vocab_size)

        def run(n: int) -> list[list[int]]:
            reqs = [
                GenerationRequest(p, SamplingParams(max_new_tokens=n, use_default_stops=False))
                for p in prompts
            ]
            return [r.token_ids for r in engine.generate(reqs)]

    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        prompts = _prompts(batch, prompt_len, model.config.vocab_size)
        ids = torch.tensor(prompts)

        @torch.no_grad()
        def run(n: int) -> list[list[int]]:
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

    run(2)  # warm-up (allocator, first-call overheads)
    start = time.perf_counter()
    run(1)
    t1 = time.perf_counter() - start
    start = time.perf_counter()
    tokens = run(new)
    tn = time.perf_counter() - start
    if impl == "ours":
        cfg = engine.cfg  # one slot per (application, layer), keys + values, fp32
        slots = cfg.h_cycles * (cfg.l_cycles * cfg.num_layers_L + cfg.num_layers_H)
        cache_bytes = slots * 2 * cfg.hidden_size * 4 * batch * (prompt_len + new)
    return {
        "impl": impl,
        "batch": batch,
        "prefill_tokens_per_s": batch * prompt_len / t1,
        "decode_tokens_per_s": batch * (new - 1) / max(tn - t1, 1e-9),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "kv_cache_gb": None if cache_bytes is None else cache_bytes / 2**30,
        "tokens": tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs/model/tiny.yaml"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    from mimir_megatron import backend

    backend.setup()  # this script is an entry point: the CPU backend, once, before any model
    torch.set_num_threads(args.threads)
    if args.child:
        impl, weights, hf_dir, batch, _ = args.child
        print(
            json.dumps(
                _measure(impl, Path(weights), Path(hf_dir), int(batch), args.prompt_len, args.new_tokens)
            )
        )
        return 0

    from mimir_megatron.config import load_config
    from mimir_megatron.interop import export_hf, save_weights
    from mimir_megatron.model import build_model

    work = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    model = build_model(load_config(args.config))
    save_weights(model, work / "weights")
    export_hf(model, work / "hf")
    rows = []
    print(
        "| batch | ours prefill tok/s | ours decode tok/s | transformers prefill | transformers decode "
        "| decode ratio | ours peak RSS GB | transformers peak RSS GB | same tokens |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for batch in [int(b) for b in args.batches.split(",")]:
        got = {}
        for impl in ("ours", "transformers"):
            cmd = [
                sys.executable,
                __file__,
                "--prompt-len",
                str(args.prompt_len),
                "--new-tokens",
                str(args.new_tokens),
                "--threads",
                str(args.threads),
                "--child",
                impl,
                str(work / "weights"),
                str(work / "hf"),
                str(batch),
                "x",
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[impl] = json.loads(out.strip().splitlines()[-1])
        ours, peer = got["ours"], got["transformers"]
        same = ours.pop("tokens") == peer.pop("tokens")
        ratio = ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
        rows.append(
            {"batch": batch, "ours": ours, "transformers": peer, "decode_ratio": ratio, "same_tokens": same}
        )
        print(
            f"| {batch} | {ours['prefill_tokens_per_s']:,.0f} | {ours['decode_tokens_per_s']:,.0f} | "
            f"{peer['prefill_tokens_per_s']:,.0f} | {peer['decode_tokens_per_s']:,.0f} | {ratio:.2f} | "
            f"{ours['peak_rss_gb']:.2f} | {peer['peak_rss_gb']:.2f} | {'yes' if same else 'NO'} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
