"""`mimir bench` runs on CPU and reports both implementations; the peer's window is ours."""

import json

import pytest

from mimir_megatron.bench import peer_l_bp_cycles
from mimir_megatron.model.window import plan_window


@pytest.mark.parametrize("k,expected", [(5, [0, 3]), (6, [1, 3]), (7, [2, 3]), (8, [3, 3])])
def test_peer_window_matches_last_k(k, expected):
    assert peer_l_bp_cycles(2, 3, k) == expected
    plan = plan_window(2, 3, k, "last_k")
    assert (sum(expected), 2) == (plan.k_L, plan.k_H)


def test_bench_tiny_on_cpu(tmp_path, capsys):
    from mimir_megatron.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--steps", "1", "--warmup", "0", "--seq-len", "32",
                 "--micro-batch", "2", "--json", str(out), "hidden_size=64", "ffn_hidden_size=128"]) == 0
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["results"]]
    assert names == ["mimir-megatron", "transformers hrm_text"]
    for r in report["results"]:
        assert r["tokens_per_s"] > 0 and r["tflops_per_s"] > 0 and r["step_median_s"] > 0
    assert "ratio mimir-megatron / transformers" in capsys.readouterr().out
