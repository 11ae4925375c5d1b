"""`mimir bench`'s request says what of it the bench's JSON records; the report writes that as it
is (no field copied by hand), whole after each result."""

from __future__ import annotations

import json
from dataclasses import fields

import torch

from mimir_megatron.bench.measure import BenchResult
from mimir_megatron.bench.report import Report
from mimir_megatron.bench.request import BenchRequest

# The request's settings that describe the measurement (the rest choose what runs, or where to).
NOT_RECORDED = {"steps", "warmup", "variants", "overrides", "peer", "peer_checkpointing", "peak_tflops",
                "json_path"}


def test_the_report_records_the_request_as_it_serialises_itself(tmp_path):
    request = BenchRequest(config="model.yaml", windows=(2, 5), seq_len=32, micro_batch=3, samples_per_context=2,
                           precision="fp32", optimizer="muon", lr=3e-4, clip_grad=0.5, ema_decay=0.99,
                           json_path=tmp_path / "bench.json")
    report = Report(request, torch.device("cpu"), attended_keys=7.0)
    report.add(BenchResult("small", k=2, tokens_per_s=10.0))
    written = json.loads((tmp_path / "bench.json").read_text())
    assert {k: written[k] for k in request.to_dict()} == request.to_dict()
    assert (written["shape"], written["windows"], written["step"]) == (
        "model.yaml", [2, 5], {"optimizer": "muon", "lr": 3e-4, "clip_grad": 0.5, "ema_decay": 0.99})
    assert written["results"][0]["name"] == "small" and written["device"] == "cpu"
    # Every setting of the request is recorded, or deliberately not: a new one is a decision here.
    recorded = set(request.to_dict()) - {"step"} | set(request.to_dict()["step"]) | {"config"}
    assert {f.name for f in fields(BenchRequest)} == recorded | NOT_RECORDED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # written whole, nothing staged left
