"""`mimir bench` runs on CPU and reports both implementations; the peer's window is ours.
Also bench/gpu_check.sh's own guarantees (its limits clamp, a stuck process is killed)."""

import json
import re
import os
import shutil
import sys
import subprocess
from pathlib import Path

import pytest
from kernel_marks import needs_kernel
from mimir_kernels import cpu_step
from polling import hang_limit

from mimir_megatron.bench.peer import peer_l_bp_cycles
from mimir_megatron.bench.run import PEER, BenchRequest, Variant, run_order
from mimir_megatron.entrypoints.bench import parse_windows
from mimir_megatron.model.window import plan_window

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("k,expected", [(5, [0, 3]), (6, [1, 3]), (7, [2, 3]), (8, [3, 3])])
def test_peer_window_matches_last_k(k, expected):
    assert peer_l_bp_cycles(2, 3, k) == expected
    plan = plan_window(2, 3, k, "last_k")
    assert (sum(expected), 2) == (plan.k_L, plan.k_H)


def test_run_order_puts_the_peer_second_and_compiled_variants_last():
    dense = Variant("dense", ["execution.attention_backend=dense"])
    compiled = Variant("flex+compile", ["execution.attention_backend=flex", "execution.compile=true"])
    varlen = Variant("varlen", ["execution.attention_backend=varlen", "execution.compile=false"])
    flex = Variant("flex", ["execution.attention_backend=flex"])
    assert run_order([compiled, dense, varlen, flex], peer=True) == [dense, PEER, varlen, flex, compiled]
    assert run_order([compiled, dense], peer=False) == [dense, compiled]
    assert run_order([dense], peer=True) == [dense, PEER]
    # A shared compile=true compiles every variant but one that turns it off: that one goes first.
    assert run_order([flex, varlen], peer=True, shared=["execution.compile=true"]) == [varlen, PEER, flex]


def test_run_bench_is_a_function_a_notebook_can_call(tmp_path, capsys):
    """The run without the CLI: typed settings in, the report (results, ratios, JSON) out."""
    from mimir_megatron.bench.run import run_bench

    request = BenchRequest(windows=(2, 5), seq_len=16, micro_batch=1, steps=1, warmup=0, peer=False,
                           variants=(Variant("small", ["hidden_size=64", "ffn_hidden_size=128"]),),
                           overrides=("vocab_size=256",), json_path=tmp_path / "bench.json")
    report = run_bench(request)
    assert [(r.name, r.k, r.error) for r in report.results] == [("small", 2, None), ("small", 5, None)]
    written = json.loads((tmp_path / "bench.json").read_text())
    assert (written["windows"], written["seq_len"], written["step"]["lr"]) == ([2, 5], 16, 1e-4)
    assert "small" in capsys.readouterr().out


def test_windows_parse():
    import argparse

    assert parse_windows("5") == [5] and parse_windows("5,8") == [5, 8]
    for bad in ("", "5,x", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_windows(bad)


def test_shapes_are_code_equal_to_the_model_yamls():
    """A wheel has no configs/: the shapes ship as code, and stay what the YAMLs say."""
    from mimir_megatron.bench.shapes import model_config
    from mimir_megatron.config import load_config

    configs = Path(__file__).resolve().parents[2] / "configs" / "model"
    for shape in ("tiny", "mimir"):
        assert model_config(shape, None) == load_config(configs / f"{shape}.yaml"), shape
    mid = model_config("mid", None)
    assert (mid.hidden_size, mid.num_layers_L, mid.num_layers_H, mid.vocab_size) == (768, 4, 4, 32768)
    assert model_config("mid", None, ["hidden_size=384"]).hidden_size == 384


OUTSIDE_A_CHECKOUT = """
import argparse, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
import mimir_megatron
assert mimir_megatron.__file__.startswith(sys.argv[1]), mimir_megatron.__file__
from mimir_megatron.entrypoints.bench import register
parser = argparse.ArgumentParser()
register(parser.add_subparsers())
args = parser.parse_args(["bench", "--shape", "mid", "--no-peer", "--steps", "1", "--warmup", "0",
                          "--seq-len", "16", "--micro-batch", "1", "hidden_size=64",
                          "ffn_hidden_size=128", "num_attention_heads=4", "vocab_size=256"])
sys.exit(args.handler(args))
"""


def test_bench_runs_from_an_installed_copy_outside_a_checkout(tmp_path):
    """The packages copied as a wheel installs them (no configs/, no editable finder), run from
    an empty directory."""
    import importlib.util
    import sys

    site = tmp_path / "site"
    for name in ("mimir_megatron", "mimir_kernels"):
        source = importlib.util.find_spec(name).submodule_search_locations[0]
        shutil.copytree(source, site / name, ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", OUTSIDE_A_CHECKOUT, str(site)], cwd=work,
                          env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "mimir-megatron                5" in proc.stdout


def test_bench_serve_checks_which_checkout_each_server_imports(tmp_path, monkeypatch):
    """bench_serve's baseline is another checkout through PYTHONPATH; run from this checkout's
    root, ``python -c`` would import this one instead (the working directory comes first) and
    compare it with itself. The servers start with ``-P`` and the bench refuses a mismatch."""
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_serve", repo / "bench" / "bench_serve.py")
    bench_serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_serve)
    other = tmp_path / "other"
    (other / "mimir_megatron").mkdir(parents=True)
    (other / "mimir_megatron" / "__init__.py").write_text("")
    monkeypatch.chdir(repo)  # where users run it from
    assert bench_serve._checkout_of({"PYTHONPATH": bench_serve._code_path(other)}, other) == "unknown commit"
    bench_serve._checkout_of({"PYTHONPATH": bench_serve._code_path(repo)}, repo)  # no mismatch
    with pytest.raises(RuntimeError, match="would import mimir_megatron from"):
        bench_serve._checkout_of({"PYTHONPATH": ""}, other)


def test_bench_tiny_on_cpu(tmp_path, capsys, monkeypatch):
    """Two windows on the same models, the peer with gradient checkpointing right after ours;
    ours is timed through the trainer's own train_step."""
    from mimir_megatron.cli import main
    from mimir_megatron.train import step as step_module

    calls = []
    real_step = step_module.train_step

    def counted(trainer, *args, **kwargs):
        calls.append(type(trainer.optimizer).__name__)
        return real_step(trainer, *args, **kwargs)

    monkeypatch.setattr(step_module, "train_step", counted)
    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "tiny", "--steps", "1", "--warmup", "0", "--seq-len", "32",
                 "--micro-batch", "2", "--window", "5,8", "--peer-checkpointing", "--json", str(out),
                 "hidden_size=64", "ffn_hidden_size=128"]) == 0
    report = json.loads(out.read_text())
    assert report["windows"] == [5, 8]
    rows = [(r["name"], r["k"]) for r in report["results"]]
    assert rows == [("mimir-megatron", 5), ("mimir-megatron", 8),
                    ("transformers hrm_text", 5), ("transformers hrm_text", 8)]
    for r in report["results"]:
        assert r["tokens_per_s"] > 0 and r["tflops_per_s"] > 0 and r["step_median_s"] > 0
    by_row = {(r["name"], r["k"]): r for r in report["results"]}
    assert by_row["mimir-megatron", 5]["window"] == "lllHLLLH"
    assert by_row["mimir-megatron", 8]["window"] == "LLLHLLLH"
    assert by_row["transformers hrm_text", 8]["window"].startswith("L_bp=[3, 3]")
    assert by_row["transformers hrm_text", 5]["settings"]["gradient_checkpointing"] is True
    assert set(report["ratio_vs_transformers"]) == {"k=5", "k=8"}
    out = capsys.readouterr().out
    assert "ratio mimir-megatron / transformers at k=8" in out and "plan GB" in out
    # The plan's peak of the same step beside the measured one (ours; the peer has none).
    planned = {key: r["planned_peak_memory_gb"] for key, r in by_row.items()}
    assert planned["mimir-megatron", 8] > planned["mimir-megatron", 5] > 0
    assert planned["transformers hrm_text", 5] is None
    assert calls == ["AdamW", "AdamW"]  # one timed step per window, no warm-up
    for r in report["results"]:
        assert (r["settings"]["clip_grad"], r["settings"]["ema_decay"]) == (1.0, 0.9999)


def test_bench_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = sorted(BENCH.glob("*.sh"))
    assert {p.name for p in scripts} >= {"gpu_check.sh", "fetch_wheels.sh"}
    proc = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


STUCK_PYTHON = """#!/usr/bin/env bash
# Stands in for python: `python -` (the environment report) answers; the tests and the bench
# hang and ignore the interrupt, as a process stuck in a CUDA teardown does.
if [[ ${1:-} == - ]]; then cat >/dev/null; echo "torch 0 cuda none gpu False"; exit 0; fi
echo "$*" >>"$STUCK_LOG"
trap '' INT
sleep 600
"""


def test_gpu_check_limits_clamp_and_kill_a_stuck_process(tmp_path):
    """24 s of budget, 2 s of kill delay, a 3 s minimum part: the tests get 30 % of the 17 s left
    (the budget less kill delay and summary), ~5 s, and are killed after ignoring the interrupt,
    the first bench (60 % of the rest) too; the second has under 3 s left and is skipped, not
    started without a limit (`timeout 0` is none); the summary is written, within the budget."""
    stub = tmp_path / "python"
    stub.write_text(STUCK_PYTHON)
    stub.chmod(0o755)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHON": str(stub), "STUCK_LOG": str(tmp_path / "calls.log"), "BUDGET_S": "24",
           "KILL_AFTER_S": "2", "MIN_PART_S": "3", "SHAPE": "tiny"}
    proc = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), str(results)], env=env,
                          capture_output=True, text=True, timeout=hang_limit(300))
    assert proc.returncode == 0, proc.stderr
    summary = (results / "summary.md").read_text()
    # The budget is kept by construction, not by luck: every part that started had a limit, and
    # the limits plus a kill delay each fit inside BUDGET_S less the summary's 5 s.
    limits = [int(s) for s in re.findall(r"^- .*: killed 2 s after the interrupt \(limit (\d+) s", summary, re.M)]
    assert len(limits) == 2 and all(s >= 3 for s in limits), summary
    assert sum(s + 2 for s in limits) <= 24 - 5, limits
    assert "GPU tests: killed 2 s after the interrupt" in summary
    assert "bench bench_k5_k8: killed 2 s after the interrupt" in summary
    assert "bench bench_k5_packed: skipped (budget)" in summary
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split()[1] for c in calls] == ["pytest", "mimir_megatron.cli"]
    assert "--durations=0" in calls[0] and "--window 5,8" in calls[1] and "--warmup 1" in calls[1]
    assert {p.name for p in results.iterdir()} == {"env.txt", "tests.log", "bench.log", "summary.md"}


@needs_kernel
@pytest.mark.timeout(300)
def test_bench_step_ops_times_torchs_operations_against_the_kernels_in_the_engine():
    """bench/bench_step_ops.py on the tiny model: one table row per row count, every way timed
    (the script swaps the engine step's operations and products, so all three ran)."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_step_ops.py"), "--shape", "tiny",
                           "--rows", "1,3", "--rounds", "1", "--steps", "2"],
                          capture_output=True, text=True, timeout=hang_limit(240))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "3"], proc.stdout
    for row in rows:
        *steps, prefills = row.strip().strip("|").split("|")[1:]
        cells = [float(c) for c in steps] + [float(c) for c in prefills.split("/")]
        assert len(cells) == 8 and all(c > 0 for c in cells), row
    assert re.search(r"^all: (MklProducts|NativeProducts|NativeGemmProducts) \(products_for", proc.stdout, re.MULTILINE), proc.stdout


@needs_kernel
def test_bench_prompt_attention_times_the_prompts_kernel_against_sdpa():
    """bench/bench_prompt_attention.py: a row per case, both ways timed, their results within
    float rounding, and the way the step takes on either side of NativeOps.PROMPT_KERNEL_MAX."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_prompt_attention.py"), "--heads", "2",
                           "--head-dim", "32", "--prompts", "2x20,1x300", "--rounds", "1"],
                          capture_output=True, text=True, timeout=hang_limit(120))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.strip().strip("|").split("|") for line in proc.stdout.splitlines()
            if re.match(r"\| \d+x\d+ \|", line)]
    assert [r[0].strip() for r in rows] == ["2x20", "1x300"], proc.stdout
    for case, kernel, sdpa, ratio, difference, takes in rows:
        assert float(kernel.replace(",", "")) > 0 and float(sdpa.replace(",", "")) > 0, case
        assert float(difference) < 1e-5, case
    assert [r[5].strip() for r in rows] == ["kernel", "sdpa"], proc.stdout


@needs_kernel
def test_bench_step_ops_compares_the_few_rows_product_kernels():
    """--products: oneDNN, the C loop, MKL and (with AVX-512) the packed GEMM in the engine, each timed."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_step_ops.py"), "--shape", "tiny", "--products",
                           "--rows", "2", "--rounds", "1", "--steps", "2"],
                          capture_output=True, text=True, timeout=hang_limit(240))
    assert proc.returncode == 0, proc.stderr[-2000:]
    packed = cpu_step.packed_gemm_available(cpu_step.library())
    header = "| rows | onednn ms/step | c_loop ms/step | mkl ms/step |" + (" packed ms/step |" if packed else "")
    assert header in proc.stdout, proc.stdout
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 1 and rows[0].startswith("| 2 |"), proc.stdout
    *steps, prefills = rows[0].strip().strip("|").split("|")[1:]
    cells = [float(c) for c in steps] + [float(c) for c in prefills.split("/")]
    assert len(cells) == (11 if packed else 8) and all(c > 0 for c in cells), rows[0]
