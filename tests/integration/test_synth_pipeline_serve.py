"""`mimir synth run` against a real `mimir serve` on a tiny random-weight model with the demo
tokenizer: its replies are nonsense, the mechanics are not. Greedy decoding makes every row's
verdict reproducible, so an interrupted run (kill -9, or the server stopped and restarted on the
same port) must end with exactly the rows and verdicts of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mimir_megatron.inference.server")

from polling import wait_for  # noqa: E402

from mimir_data_prep.synth_pipeline.client import ChatEndpoint  # noqa: E402
from mimir_data_prep.synth_pipeline.pipeline import load_pipeline  # noqa: E402
from mimir_data_prep.synth_pipeline.runner import RunOptions, run_pipeline  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROWS = 6


@pytest.fixture(scope="module")
def engine():
    from conftest import TINY

    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
    from mimir_megatron.chat import load_tokenizer
    from mimir_megatron.config import load_config
    from mimir_megatron.inference import InferenceEngine
    from mimir_megatron.model import build_model

    cfg = load_config(TINY, ["hidden_size=64", "num_attention_heads=4", "ffn_hidden_size=128", "seed=3"])
    return InferenceEngine(build_model(cfg).eval(), load_tokenizer(DEMO_TOKENIZER_DIR), model_name="tiny-random")


KEY_ENV = "MIMIR_SYNTH_TEST_KEY"  # the pipeline's api_key_env; the served fixture asks for its key


@pytest.fixture(scope="module")
def served(engine):
    """`mimir serve` in a thread, behind an API key that the pipelines read from ``KEY_ENV``
    (exported for the module: the `mimir synth` subprocesses inherit it)."""
    from mimir_megatron.inference.api_keys import ApiKeys, new_key
    from mimir_megatron.inference.server import serve_in_thread

    key = new_key()
    os.environ[KEY_ENV] = key
    try:
        with serve_in_thread(engine, port=0, api_keys=ApiKeys([key])) as base_url:
            yield base_url
    finally:
        os.environ.pop(KEY_ENV, None)


def write_pipeline(tmp: Path, base_url: str) -> Path:
    """Short prompts (the tiny model's context is 512); the generator's reply is taken as text,
    so the auditor is asked too; its nonsense reply is `auditor_unparseable`."""
    tmp.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"r{i:02d}", "text": f"Passage {i}: the ferry leaves at {i} o'clock."} for i in range(ROWS)]
    (tmp / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "gen.j2").write_text("Write a question about: {{ row.text }}")
    (tmp / "audit.j2").write_text('Judge "{{ candidate.text[:80] }}". Reply {"verdict": ...}')
    (tmp / "p.yaml").write_text(f"""
name: serve_e2e
source: {{path: src.jsonl, id_field: id}}
endpoints:
  generator: {{model: tiny-random, base_url: "{base_url}", max_tokens: 8, timeout_s: 60, api_key_env: {KEY_ENV}}}
  auditor: {{model: tiny-random, base_url: "{base_url}", max_tokens: 8, timeout_s: 60, api_key_env: {KEY_ENV}}}
generate: {{prompt: gen.j2, parse: text}}
audit: {{prompt: audit.j2}}
checks:
  - {{kind: length, name: empty, value: candidate.text, min_chars: 1}}
output:
  messages:
    - {{role: user, content: "{{{{ row.text }}}}"}}
    - {{role: assistant, content: "{{{{ candidate.text }}}}"}}
max_generations: 2
concurrency: 1
tracking: {{enabled: false}}
retry: {{max_retries: 40, initial_backoff_s: 0.1, max_backoff_s: 1.0}}
""")
    return tmp / "p.yaml"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(served, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    path = write_pipeline(tmp, served)
    report = run_pipeline(load_pipeline(path), RunOptions(tmp / "out", progress=False))
    return tmp / "out", report


def assert_same_as_uninterrupted(out: Path, reference: Path) -> None:
    verdicts = read_jsonl(out / "verdicts.jsonl")
    assert [v["row_id"] for v in verdicts] == [f"r{i:02d}" for i in range(ROWS)]
    ids = [r["row_id"] for r in read_jsonl(out / "evidence.jsonl")]
    assert len(ids) == len(set(ids)) == ROWS  # no row decided twice
    for name in ("verdicts.jsonl", "accepted.jsonl"):
        assert (out / name).read_text() == (reference / name).read_text()


def test_counts_add_up_against_mimir_serve(uninterrupted):
    out, report = uninterrupted
    s = report.status
    assert report.source_rows == report.decided == sum(s.values()) == ROWS
    assert report.pending == 0 and s["kept"] == 0 and s["error"] == 0
    records = read_jsonl(out / "evidence.jsonl")
    calls = [a[stage] for r in records for a in r["attempts"] for stage in ("generator", "auditor") if a.get(stage)]
    assert len(calls) == report.calls["generator"] + report.calls["auditor"] >= ROWS
    assert {c["response_model"] for c in calls} == {"tiny-random"}
    assert all(c["usage"]["completion_tokens"] >= 1 for c in calls)
    # A nonsense auditor reply holds no verdict: every audited row is discarded for it.
    assert s["accepted"] == 0
    assert report.discard_reasons.get("auditor_unparseable", 0) == report.calls["auditor"]


@pytest.mark.slow
def test_kill_and_rerun_against_mimir_serve(served, uninterrupted, tmp_path):
    path = write_pipeline(tmp_path, served)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mimir_data_prep.synth_pipeline", str(path), "--output", str(out),
           "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = out / "evidence.jsonl"

    def decided() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()
        return state.exists() and len(state.read_bytes().splitlines()) >= 2

    wait_for(decided, "2 rows decided", timeout=180, interval=0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(state.read_bytes().splitlines())
    assert 2 <= done < ROWS
    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert_same_as_uninterrupted(out, uninterrupted[0])


def test_mimir_serve_stopped_and_restarted_mid_run(engine, uninterrupted, tmp_path, monkeypatch):
    from mimir_megatron.inference.server import serve_in_thread

    failed_calls: list[int] = []  # one entry per call that failed and will be retried
    backoff = ChatEndpoint.backoff
    monkeypatch.setattr(ChatEndpoint, "backoff",
                        lambda self, failures, exc: failed_calls.append(failures) or backoff(self, failures, exc))
    server = serve_in_thread(engine, port=0)
    base_url = server.__enter__()
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    path = write_pipeline(tmp_path, base_url)
    out = tmp_path / "out"
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "report", run_pipeline(load_pipeline(path), RunOptions(out, progress=False))))
    thread.start()
    state = out / "evidence.jsonl"
    wait_for(lambda: state.exists() and len(state.read_bytes().splitlines()) >= 2, "2 rows decided")
    server.__exit__(None, None, None)
    assert len(state.read_bytes().splitlines()) < ROWS
    wait_for(lambda: failed_calls, "a call failing while the server is down")  # it noticed
    with serve_in_thread(engine, port=port):
        thread.join(timeout=240)
    assert not thread.is_alive()
    report = result["report"]
    assert report.decided == ROWS and report.calls["retries"] >= 1
    assert_same_as_uninterrupted(out, uninterrupted[0])
