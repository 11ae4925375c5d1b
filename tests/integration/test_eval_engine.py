"""Evaluation on the real inference engine: the log-likelihood multiple-choice path against the
model's own forward pass with the PrefixLM mask (in-process server thread, the function the
trainer calls), and `mimir eval` end to end through a real `mimir serve` subprocess."""

from __future__ import annotations

import json
import math
import shutil
import socket
from pathlib import Path

import pytest
import torch

from mimir_megatron.evaluation.fixtures import write_fixtures
from mimir_megatron.evaluation.metrics import LETTERS
from mimir_megatron.evaluation.prompts import build_items
from mimir_megatron.evaluation.suite import load_suite

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer"
LIMIT = 3
SUITE = f"""
name: engine
tasks:
  - {{from: {REPO}/configs/eval/mimir_en.yaml, name: mmlu, shots: 0, mc_scoring: loglik}}
  - {{from: {REPO}/configs/eval/mimir_da.yaml, name: gec, max_tokens: 8}}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conftest import tiny_config
    from mimir_megatron.chat import load_tokenizer
    from mimir_megatron.inference import InferenceEngine
    from mimir_megatron.model import build_model

    root = tmp_path_factory.mktemp("eval-engine")
    torch.manual_seed(0)
    model = build_model(tiny_config("vocab_size=1024", "max_position_embeddings=1024"))
    engine = InferenceEngine(model, load_tokenizer(TOKENIZER), model_name="tiny-random")
    (root / "suite.yaml").write_text(SUITE)
    return {"root": root, "engine": engine, "model": model, "data": write_fixtures(root / "data", 4),
            "suite": load_suite(root / "suite.yaml")}


def _letter_logprobs(model, context: list[int], letters: list[list[int]], prefix: bool) -> list[float]:
    """Sum of continuation log-probs from the model's forward pass (the training path)."""
    from mimir_megatron.batch import single_sample_batch

    out = []
    with torch.no_grad():
        for continuation in letters:
            batch = single_sample_batch([context], [continuation])
            if not prefix:
                batch.prefix_mask.zero_()
            logits = model(batch, validate=False).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            out.append(sum(logp[len(context) - 1 + j, t].item() for j, t in enumerate(continuation)))
    return out


@pytest.fixture(scope="module")
def in_process(setup):
    from mimir_megatron.evaluation import run_suite_on_engine

    log_dir = setup["root"] / "logs"
    metrics = run_suite_on_engine(setup["engine"], setup["suite"], limit=LIMIT, data_dir=setup["data"],
                                  log_dir=log_dir)
    return metrics


def test_run_suite_on_engine_returns_mlflow_metrics(in_process):
    assert set(in_process) == {"eval/mmlu", "eval/gec", "eval/avg/english", "eval/avg/danish"}
    assert all(0.0 <= v <= 1.0 for v in in_process.values())


def test_loglik_choice_is_the_argmax_under_the_prefix_mask(setup, in_process):
    from inspect_ai.log import read_eval_log

    engine, model = setup["engine"], setup["model"]
    task = setup["suite"].tasks[0]
    items = {i.id: i for i in build_items(task, setup["data"], setup["suite"].seed, LIMIT)}
    [log_file] = (setup["root"] / "logs").glob("*mmlu*.eval")
    samples = read_eval_log(str(log_file)).samples
    assert len(samples) == LIMIT
    differs_from_causal = False
    for sample in samples:
        item = items[str(sample.id)]
        score = sample.scores["mimir_item"]
        context = engine.tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True)
        context = list(context["input_ids"] if hasattr(context, "keys") else context)
        letters = [engine.tokenizer.encode(x, add_special_tokens=False) for x in LETTERS[: item.num_choices]]
        expected = _letter_logprobs(model, context, letters, prefix=True)
        got = score.metadata["choice_logprobs"]
        assert got == pytest.approx(expected, abs=1e-4)
        assert score.answer == LETTERS[max(range(len(expected)), key=expected.__getitem__)]
        causal = _letter_logprobs(model, context, letters, prefix=False)
        differs_from_causal |= not all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(causal, expected))
    assert differs_from_causal  # the prefix mask matters for these contexts


@pytest.mark.slow
def test_mimir_eval_through_a_real_mimir_serve(setup, tmp_path, monkeypatch):
    """One command: export a model, `mimir eval --hf` starts `mimir serve` (asking for a fresh API
    key, which the evaluation sends), runs, stops it. The key is in none of the files the
    evaluation leaves: the server's log, the tables, InspectAI's logs, the MLflow store."""
    import time
    import zipfile

    from mimir_megatron.cli import main
    from mimir_megatron.evaluation import serve
    from mimir_megatron.interop import export_hf

    key = "sk-eval-launched-7d2c9a41e0b35f68"
    monkeypatch.setattr(serve, "new_key", lambda: key)

    hf_dir = export_hf(setup["model"], tmp_path / "hf", tokenizer_dir=TOKENIZER)
    output = tmp_path / "out"
    started = time.perf_counter()
    rc = main(["eval", "--hf", str(hf_dir), "--suite", str(setup["root"] / "suite.yaml"),
               "--data-dir", str(setup["data"]), "--limit", str(LIMIT), "--output", str(output)])
    seconds = time.perf_counter() - started
    assert rc == 0
    summary = json.loads((output / "results.json").read_text())
    assert {n: t["n"] for n, t in summary["tasks"].items()} == {"mmlu": LIMIT, "gec": LIMIT}
    assert summary["model"] and all(t["error"] is None for t in summary["tasks"].values())
    log = (output / "serve.log").read_text()
    port = int(log.split("127.0.0.1:")[1].split()[0].strip("/)")) if "127.0.0.1:" in log else None
    if port:
        with socket.socket() as s:  # the server was stopped
            assert s.connect_ex(("127.0.0.1", port)) != 0
    assert "requests need an API key (1 accepted)" in log
    for path in output.rglob("*"):
        if path.is_file():
            contents = [path.read_bytes()]
            if zipfile.is_zipfile(path):  # InspectAI's .eval logs
                with zipfile.ZipFile(path) as archive:
                    contents += [archive.read(name) for name in archive.namelist()]
            assert not any(key.encode() in c for c in contents), path
    print(f"mimir eval on the fixture suite: {seconds:.1f} s")
    shutil.rmtree(hf_dir)
