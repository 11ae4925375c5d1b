"""`mimir synth run` throughput against the stand-in server of the tests (tests/helpers/synth_standin.py):
rows/s at several concurrencies with a fixed server latency per request (a stand-in for model
time), and the framework's own cost per row with no latency at all.

    python bench/bench_synth.py [--rows 96] [--latency 0.1] [--concurrency 1 4 16]

Not a test: numbers depend on the machine. Every row takes one generation and one audit, so the
ideal speed-up over concurrency 1 is the concurrency itself while the server keeps up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))

from synth_standin import StandIn  # noqa: E402

from mimir_data_prep.synth_pipeline.pipeline import load_pipeline  # noqa: E402
from mimir_data_prep.synth_pipeline.runner import RunOptions, run_pipeline  # noqa: E402


def responder(body: dict) -> str:
    msg = body["messages"][-1]["content"]
    if msg.startswith("GEN"):
        return json.dumps({"answer": msg.split()[1]})
    return json.dumps({"verdict": "accept", "reasons": []})


def write_pipeline(tmp: Path, base_url: str, rows: int) -> Path:
    lines = [json.dumps({"text": f"w{i} a passage"}) + "\n" for i in range(rows)]
    (tmp / "src.jsonl").write_text("".join(lines))
    (tmp / "gen.j2").write_text("GEN {{ row.text }}")
    (tmp / "audit.j2").write_text("AUDIT {{ candidate.answer }}")
    (tmp / "p.yaml").write_text(f"""
name: bench
source: {{path: src.jsonl}}
endpoints:
  generator: {{model: g, base_url: "{base_url}"}}
  auditor: {{model: a, base_url: "{base_url}"}}
generate: {{prompt: gen.j2, parse: json, required_fields: [answer]}}
audit: {{prompt: audit.j2}}
checks: [{{kind: verbatim, needle: candidate.answer, haystack: row.text}}]
output:
  messages:
    - {{role: user, content: "{{{{ row.text }}}}"}}
    - {{role: assistant, content: "{{{{ candidate.answer }}}}"}}
tracking: {{enabled: false}}
""")
    return tmp / "p.yaml"


def rows_per_second(server: StandIn, rows: int, concurrency: int) -> tuple[float, float]:
    """(rows/s wall, CPU seconds per row of this process: runner and stand-in server together)."""
    with tempfile.TemporaryDirectory() as d:
        path = write_pipeline(Path(d), server.base_url, rows)
        start, cpu = time.perf_counter(), time.process_time()
        report = run_pipeline(load_pipeline(path), RunOptions(Path(d) / "out", concurrency=concurrency,
                                                              progress=False))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert report["status"]["accepted"] == rows, report
    return rows / elapsed, cpu / rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--latency", type=float, default=0.1, help="seconds the server takes per request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    with StandIn(responder, delay_s=args.latency) as server:
        base = None
        for n in args.concurrency:
            rate, cpu = rows_per_second(server, args.rows, n)
            base = base or rate
            print(f"latency {args.latency:.3f} s  concurrency {n:3d}: {rate:7.2f} rows/s  "
                  f"x{rate / base:.2f} vs concurrency {args.concurrency[0]}  cpu {1000 * cpu:.1f} ms/row")
        server.delay_s = 0.0
        n = max(args.concurrency)
        rate, cpu = rows_per_second(server, args.rows, n)
        print(f"latency 0      concurrency {n:3d}: {rate:7.2f} rows/s  cpu {1000 * cpu:.1f} ms/row "
              "(client, checks, state file and the stand-in server together)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
