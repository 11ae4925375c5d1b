"""The bench's table, ratios against the peer, and JSON."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from mimir_megatron import backend
from mimir_megatron.bench.measure import BenchResult
from mimir_megatron.bench.peer import PEER_NAME
from mimir_megatron.integrity import write_json_atomic

if TYPE_CHECKING:
    import torch

    from mimir_megatron.bench.request import BenchRequest


class Report:
    """Prints each result as it is measured and rewrites the JSON after each one, so a run cut
    short (a time limit, an out-of-memory kill) keeps what it measured."""

    def __init__(self, request: BenchRequest, device: torch.device, attended_keys: float) -> None:
        import torch

        self.request, self.results, self.attended_keys = request, [], attended_keys
        print(f"attention FLOPs counted for {attended_keys:,.1f} keys per position (this batch)")
        self.device_name = backend.gpu_name() or "cpu"
        self.torch_version = torch.__version__
        header = (f"{'implementation':<28}{'k':>3}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'step (s)':>10}"
                  f"{'spread':>9}{'peak GB':>9}{'plan GB':>9}  window / settings")
        print(header)
        print("-" * len(header), flush=True)

    def add(self, r: BenchResult) -> None:
        self.results.append(r)
        if r.error:
            print(f"{r.name:<28}{r.k:>3}  FAILED: {r.error.splitlines()[0]}", flush=True)
        else:
            mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
            planned = f"{r.planned_peak_memory_gb:.2f}" if r.planned_peak_memory_gb is not None else "-"
            settings = " ".join(f"{k}={v}" for k, v in r.settings.items())
            print(f"{r.name:<28}{r.k:>3}{r.tokens_per_s:>12,.0f}{r.tflops_per_s:>10.3f}{mfu:>8}"
                  f"{r.step_median_s:>10.3f}{r.step_spread_s:>9.3f}{r.peak_memory_gb:>9.2f}{planned:>9}  "
                  f"{r.window}  {settings}", flush=True)
        self._write()

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per window (``"k=5"``): tokens/s of each of our variants over the peer's, where the
        peer ran at that window."""
        ratios: dict[str, dict[str, float]] = {}
        for peer in (r for r in self.results if r.name == PEER_NAME and not r.error):
            ratios[f"k={peer.k}"] = {r.name: r.tokens_per_s / peer.tokens_per_s for r in self.results
                                     if r.k == peer.k and r.name != PEER_NAME and not r.error}
        return ratios

    def finish(self) -> None:
        for window, by_name in self.ratios().items():
            for name, ratio in by_name.items():
                print(f"ratio {name} / transformers at {window} (tokens/s): {ratio:.2f}")
        if self.device_name == "cpu" and len(self.results) > 1:
            print("peak GB on CPU is the process's largest resident set so far, not per row")
        print("GB = 1e9 bytes; plan GB: `mimir plan`'s peak for the same step (docs/planning.md): a "
              "peak more than 10 % above it is a kernel keeping what the plan does not count")
        self._write()

    def _write(self) -> None:
        if not self.request.json_path:
            return
        payload = {**self.request.to_dict(), "device": self.device_name, "torch": self.torch_version,
                   "attended_keys_per_token": self.attended_keys, "date": time.strftime("%Y-%m-%d"),
                   "results": [asdict(r) for r in self.results], "ratio_vs_transformers": self.ratios()}
        write_json_atomic(self.request.json_path, payload, fsync=False)  # a kill keeps the last whole one
