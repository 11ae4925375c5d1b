"""`mimir synth run` end to end against a stand-in OpenAI-compatible server (tests/helpers/synth_standin.py)
reached through the real `openai` client: verdicts and counts, each retryable fault, a kill -9 and
rerun, a server stopped and restarted mid-run, MLflow, and the four shipped pipelines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from polling import wait_for
from synth_standin import StandIn

from mimir_data_prep.records import to_conversation
from mimir_data_prep.synth_pipeline.client import ChatEndpoint, EndpointUnavailable
from mimir_data_prep.synth_pipeline.pipeline import load_pipeline
from mimir_data_prep.synth_pipeline.run_records import AcceptanceReport, MlflowPointer
from mimir_data_prep.synth_pipeline.runner import RunOptions, run_pipeline
from mimir_megatron.errors import UserError

REPO = Path(__file__).resolve().parents[2]
KINDS = ("accept", "discard", "regen", "garbage", "badgen", "notverbatim")
# What each kind of row must end as, worked out from the responder below by hand:
# (status, reasons, generator calls, auditor calls).
EXPECTED = {
    "accept": ("accepted", [], 1, 1),
    "discard": ("discarded", ["off_topic"], 1, 1),
    "regen": ("accepted", [], 2, 2),
    "garbage": ("discarded", ["auditor_unparseable"], 1, 1),
    "badgen": ("discarded", ["attempts_exhausted"], 3, 0),
    "notverbatim": ("discarded", ["attempts_exhausted"], 3, 0),
}


def responder(body: dict) -> str:
    msg = body["messages"][-1]["content"]
    if msg.startswith("GEN"):
        text = msg[4:].split(" FEEDBACK")[0]
        if "badgen" in text:
            return "I cannot produce JSON today."
        if "notverbatim" in text:
            return json.dumps({"answer": "zzz"})
        return "Here it is: " + json.dumps({"answer": text.split()[0]})
    attempt = int(re.search(r"attempt=(\d+)", msg).group(1))
    if "discard" in msg:
        return json.dumps({"verdict": "discard", "reasons": [{"code": "off_topic", "detail": "not a task"}]})
    if "regen" in msg and attempt == 0:
        return json.dumps({"verdict": "regenerate", "reasons": ["Too vague"]})
    if "garbage" in msg:
        return "Looks fine to me."
    return '```json\n{"verdict": "accept", "reasons": []}\n```'


def kind_of(i: int) -> str:
    return KINDS[i % len(KINDS)]


def write_pipeline(tmp: Path, base_url: str, rows: int, extra: str = "", name: str = "test") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    src = [{"id": f"r{i:03d}", "text": f"w{i} {kind_of(i)} some passage text {i}"} for i in range(rows)]
    (tmp / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in src))
    (tmp / "gen.j2").write_text("GEN {{ row.text }}{% if feedback %} FEEDBACK "
                                "{{ feedback | map(attribute='code') | join(',') }}{% endif %}")
    (tmp / "audit.j2").write_text("AUDIT attempt={{ attempt }} {{ row.text }} ANSWER {{ candidate.answer }}")
    (tmp / "p.yaml").write_text(f"""
name: {name}
source: {{path: src.jsonl, id_field: id}}
endpoints:
  generator: {{model: gen-model, base_url: "{base_url}", timeout_s: 5}}
  auditor: {{model: audit-model, base_url: "{base_url}", timeout_s: 5}}
generate: {{prompt: gen.j2, parse: json, required_fields: [answer]}}
audit: {{prompt: audit.j2}}
checks:
  - {{kind: verbatim, name: answer_in_source, needle: candidate.answer, haystack: row.text}}
output:
  messages:
    - {{role: user, content: "{{{{ row.text }}}}"}}
    - {{role: assistant, content: "{{{{ candidate.answer }}}}"}}
tracking: {{enabled: false}}
retry: {{max_retries: 6, initial_backoff_s: 0.05, max_backoff_s: 0.5}}
concurrency: 4
{extra}""")
    return tmp / "p.yaml"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_complete(out: Path, rows: int, superseded: int = 0) -> None:
    """Every source row exactly once, with the verdict the responder implies; the state file
    holds one record per row plus ``superseded`` older ones (rows deliberately redone)."""
    verdicts = read_jsonl(out / "verdicts.jsonl")
    assert [v["row_id"] for v in verdicts] == [f"r{i:03d}" for i in range(rows)]
    for i, v in enumerate(verdicts):
        status, reasons, gens, _ = EXPECTED[kind_of(i)]
        assert (v["status"], v["reasons"], v["generations"]) == (status, reasons, gens), (i, v)
    accepted = read_jsonl(out / "accepted.jsonl")
    want = [f"r{i:03d}" for i in range(rows) if EXPECTED[kind_of(i)][0] == "accepted"]
    assert [a["synth"]["row_id"] for a in accepted] == want
    state_ids = [r["row_id"] for r in read_jsonl(out / "evidence.jsonl")]
    assert set(state_ids) == {f"r{i:03d}" for i in range(rows)} and len(state_ids) == rows + superseded


@pytest.fixture(scope="module")
def server():
    with StandIn(responder) as s:
        yield s


@pytest.fixture
def fresh(server):
    server.fault, server.delay_s = None, 0.0
    yield server
    server.fault, server.delay_s = None, 0.0


def run(path: Path, out: Path, *overrides: str, **options) -> dict:
    return run_pipeline(load_pipeline(path, overrides), RunOptions(out, progress=False, **options))


def test_counts_verdicts_evidence_and_output(fresh, tmp_path):
    rows = 12
    path = write_pipeline(tmp_path, fresh.base_url, rows)
    before = fresh.requests
    report = run(path, tmp_path / "out")
    assert_complete(tmp_path / "out", rows)
    s = report.status
    assert report.source_rows == report.decided == sum(s.values()) == rows
    assert s == {"kept": 0, "accepted": 4, "discarded": 8, "error": 0}
    assert report.discard_reasons == {"attempts_exhausted": 4, "off_topic": 2, "auditor_unparseable": 2}
    assert report.regenerate_reasons == {"generator_unparseable": 6, "answer_in_source": 6, "too_vague": 2}
    calls = {k: 2 * sum(EXPECTED[kind][i] for kind in KINDS) for k, i in (("generator", 2), ("auditor", 3))}
    assert report.calls == calls | {"retries": 0}
    assert fresh.requests - before == calls["generator"] + calls["auditor"]
    for line in (tmp_path / "out" / "accepted.jsonl").read_text().splitlines():
        to_conversation(json.loads(line))  # what `mimir prepare` will do
    evidence = {r["row_id"]: r for r in read_jsonl(tmp_path / "out" / "evidence.jsonl")}
    regen = evidence["r002"]
    assert len(regen["input_sha256"]) == 64
    first, second = regen["attempts"]
    assert first["verdict"]["reasons"][0]["code"] == "too_vague"
    assert first["generator"]["model"] == "gen-model" and first["auditor"]["response_model"] == "audit-model"
    assert first["generator"]["base_url"] == fresh.base_url and first["auditor"]["endpoint"] == "auditor"
    assert first["auditor"]["raw"] == json.dumps({"verdict": "regenerate", "reasons": ["Too vague"]})
    assert second["generator"]["raw"].startswith("Here it is: ")
    assert regen["output"]["messages"][1] == {"role": "assistant", "content": "w2"}


@pytest.mark.parametrize("fault", ["429", "500", "503", "timeout", "drop"])
def test_each_retryable_fault_is_retried_without_loss(tmp_path, fault):
    rows = 6
    server = StandIn(responder).start()
    server.fault = lambda body, seen: fault if seen == 0 else None  # each distinct request fails once
    server.slow_s = 2.0
    path = write_pipeline(tmp_path, server.base_url, rows)
    if fault == "timeout":
        path.write_text(path.read_text().replace("timeout_s: 5", "timeout_s: 0.6"))
    try:
        report = run(path, tmp_path / "out")
    finally:
        server.stop()
    assert_complete(tmp_path / "out", rows)
    assert server.faults_served[fault] == len(server.seen) > rows
    if fault == "timeout":  # on a loaded machine a served reply may also miss the 0.6 s deadline
        assert report.calls["retries"] >= server.faults_served[fault]
    else:
        assert report.calls["retries"] == server.faults_served[fault]
    retries = [r for rec in read_jsonl(tmp_path / "out" / "evidence.jsonl") for a in rec["attempts"]
               for stage in ("generator", "auditor") if a.get(stage) for r in a[stage]["retries"]]
    names = {"429": "RateLimitError 429", "500": "InternalServerError 500", "503": "InternalServerError 503",
             "timeout": "APITimeoutError", "drop": "APIConnectionError"}
    assert {r["error"] for r in retries} == {names[fault]}
    if fault == "429":  # Retry-After: 0.05 is honoured as a lower bound
        assert all(r["wait_s"] >= 0.05 for r in retries)


def test_refused_requests_are_row_errors_and_can_be_retried(fresh, tmp_path):
    rows = 6
    fresh.fault = lambda body, seen: "400" if "w0 accept" in body["messages"][-1]["content"] else None
    path = write_pipeline(tmp_path, fresh.base_url, rows)
    report = run(path, tmp_path / "out")
    assert report.status["error"] == 1 and report.error_reasons == {"api_error_400": 1}
    assert report.decided == rows
    fresh.fault = None
    before = fresh.requests
    assert run(path, tmp_path / "out").status["error"] == 1  # errors stay unless asked
    assert fresh.requests == before
    report = run(path, tmp_path / "out", retry_errors=True)
    assert report.status["error"] == 0 and fresh.requests == before + 2
    assert_complete(tmp_path / "out", rows, superseded=1)


def test_unreachable_server_stops_the_run_and_a_rerun_resumes(fresh, tmp_path):
    rows = 12
    fresh.fault = lambda body, seen: "503" if "w5 " in body["messages"][-1]["content"] else None
    path = write_pipeline(tmp_path, fresh.base_url, rows)
    with pytest.raises(EndpointUnavailable, match="rerun the same command to resume"):
        run(path, tmp_path / "out", "concurrency=1", "retry.max_retries=2")
    report = AcceptanceReport.read(tmp_path / "out")
    assert report.decided == 5 and report.pending == 7 and "503" in report.stopped
    assert len(read_jsonl(tmp_path / "out" / "verdicts.jsonl")) == 5
    fresh.fault = None
    run(path, tmp_path / "out")
    assert_complete(tmp_path / "out", rows)


def test_wrong_model_name_stops_the_run_instead_of_failing_every_row(fresh, tmp_path):
    from mimir_data_prep.synth_pipeline.client import EndpointMisconfigured

    fresh.fault = lambda body, seen: "404" if body["model"] == "audit-model" else None
    path = write_pipeline(tmp_path, fresh.base_url, 6)
    with pytest.raises(EndpointMisconfigured, match="endpoints.auditor"):
        run(path, tmp_path / "out")
    # Only rows that never reached the auditor (failed checks) are decided; none as an error.
    decided = read_jsonl(tmp_path / "out" / "verdicts.jsonl")
    assert all(v["status"] == "discarded" and v["reasons"] == ["attempts_exhausted"] for v in decided)
    fresh.fault = None
    run(path, tmp_path / "out")
    assert_complete(tmp_path / "out", 6)


def test_changed_rows_are_redone_and_changed_prompts_refused(fresh, tmp_path):
    rows = 6
    path = write_pipeline(tmp_path, fresh.base_url, rows)
    out = tmp_path / "out"
    run(path, out)
    src = read_jsonl(tmp_path / "src.jsonl")
    src[0]["text"] = "v0 accept an edited passage"
    (tmp_path / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in src))
    before = fresh.requests
    run(path, out, "concurrency=2")  # operational change: allowed
    assert fresh.requests == before + 2  # only the edited row: one generation, one audit
    accepted = read_jsonl(out / "accepted.jsonl")
    assert accepted[0]["messages"][1]["content"] == "v0"
    (tmp_path / "audit.j2").write_text("AUDIT attempt={{ attempt }} {{ row.text }} NEW")
    with pytest.raises(UserError, match="pipeline changed"):
        run(path, out)


def test_acceptance_report_in_mlflow(fresh, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    rows = 6
    path = write_pipeline(tmp_path, fresh.base_url, rows, "", name="mlflow_test")
    out = tmp_path / "out"
    report = run(path, out, "tracking.enabled=true", "source.limit=3")
    report = run(path, out, "tracking.enabled=true")  # resumed: the same MLflow run, a later step
    run_id = MlflowPointer.read(out).run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run_ = client.get_run(run_id)
    m = run_.data.metrics
    assert m["status.accepted"] == report.status["accepted"] == 2
    assert m["status.discarded"] == 4 and m["decided"] == rows
    assert m["discard_reason.off_topic"] == 1 and m["regenerate_reason.too_vague"] == 1
    assert [x.step for x in client.get_metric_history(run_id, "decided")] == [3, 6]
    assert run_.data.params["model.generator"] == "gen-model"
    assert "report.json" in {a.path for a in client.list_artifacts(run_id)}


def _runner_cmd(path: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "mimir_data_prep.synth_pipeline", str(path), "--output", str(out),
            "--no-progress"]


@pytest.mark.slow
def test_kill_and_rerun_neither_loses_nor_duplicates(fresh, tmp_path, caplog):
    rows = 48
    fresh.delay_s = 0.05
    path = write_pipeline(tmp_path, fresh.base_url, rows)
    out = tmp_path / "out"
    proc = subprocess.Popen(_runner_cmd(path, out), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    state = out / "evidence.jsonl"

    def decided() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()
        return state.exists() and len(state.read_bytes().splitlines()) >= 10

    wait_for(decided, "10 rows decided", timeout=120, interval=0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_at_kill = len(state.read_bytes().splitlines())
    assert 10 <= done_at_kill < rows, done_at_kill
    assert not (out / "verdicts.jsonl").exists()  # killed before it could write any output
    fresh.delay_s = 0.0
    with caplog.at_level("INFO", logger="mimir_data_prep.synth_pipeline.runner"):
        run(path, out)  # the rerun (in this process: one interpreter start less)
    assert f"{rows - done_at_kill} to do ({done_at_kill} decided before)" in caplog.text
    assert_complete(out, rows)
    # The same rows, decided the same way, as an uninterrupted run.
    run(path, tmp_path / "uninterrupted")
    for name in ("verdicts.jsonl", "accepted.jsonl"):
        assert (out / name).read_text() == (tmp_path / "uninterrupted" / name).read_text()


def test_server_stopped_and_restarted_mid_run(tmp_path, monkeypatch):
    rows = 30
    failed_calls: list[int] = []  # one entry per call that failed and will be retried
    backoff = ChatEndpoint.backoff
    monkeypatch.setattr(ChatEndpoint, "backoff",
                        lambda self, failures, exc: failed_calls.append(failures) or backoff(self, failures, exc))
    server = StandIn(responder, delay_s=0.02).start()
    port = server.port
    path = write_pipeline(tmp_path, server.base_url, rows)
    path.write_text(path.read_text().replace("max_retries: 6", "max_retries: 30"))
    out = tmp_path / "out"
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("report", run(path, out)))
    thread.start()
    state = out / "evidence.jsonl"
    decided = lambda: len(state.read_bytes().splitlines()) if state.exists() else 0  # noqa: E731
    wait_for(lambda: decided() >= 6, "6 rows decided", timeout=60)
    server.stop()
    # Replies already being written when the server stopped still arrive: count once every one
    # of the 4 concurrent callers has failed, then check that nothing is decided while failures go on.
    wait_for(lambda: len(failed_calls) >= 4, "4 failed calls")
    decided_while_down = decided()
    wait_for(lambda: len(failed_calls) >= 12, "12 failed calls")
    assert decided() == decided_while_down < rows  # nothing answered
    server = StandIn(responder, port=port).start()
    thread.join(timeout=120)
    server.stop()
    assert not thread.is_alive()
    report = result["report"]
    assert report.decided == rows and report.calls["retries"] >= 1
    assert_complete(out, rows)


# --- the four shipped pipelines, with replies a good model would give -------------------------

def _between(text: str, start: str = "<<<\n", end: str = "\n>>>") -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def _json_block(text: str, after: str) -> list:
    from mimir_data_prep.synth_pipeline.verdict import json_objects

    return json_objects(text.split(after, 1)[1])[0]


def shipped_responder(body: dict) -> str:
    msg = body["messages"][-1]["content"]
    model = body["model"]
    retry = "rejected" in msg
    if model == "auditor":
        if "[answer under review]\nB) Jupiter" in msg:
            return json.dumps({"verdict": "discard", "reasons": [{"code": "broken_prompt", "detail": "quiz"}]})
        if "[answer under review]\nBy the power rule" in msg and "lower it by one" not in msg:
            return json.dumps({"verdict": "regenerate", "reasons": [{"code": "incomplete", "detail": "say why"}]})
        return json.dumps({"verdict": "accept", "reasons": []})
    if "Translate this conversation" in msg:
        conv = _json_block(msg, "placeholders, JSON content and tool calls.")
        out = []
        for m in conv:
            if m["content"].lstrip().startswith("{"):  # structured output: keys "translated" at first
                out.append(dict(m) if retry else dict(m, content=m["content"].replace("city", "by")))
            elif retry:
                out.append(dict(m, content=m["content"] + " [da]"))
            else:  # a naive first try: a prefix breaks line-start labels, JSON is "translated"
                out.append(dict(m, content="Oversat: " + m["content"]))
        return json.dumps({"messages": out}, ensure_ascii=False)
    if "Rewrite the final assistant answer" in msg:
        return "By the power rule, $\\frac{d}{dx} x^3 = 3x^2$: bring the exponent down and lower it by one."
    if "exam-style question" in msg:
        doc = _between(msg)
        first = doc.split(". ")[0] + "."
        return json.dumps({"question": "What does the document on this topic state first?",
                           "answer": first, "evidence": first.replace(" ", "  ", 1)})
    passage = _between(msg)
    first = passage.split(". ")[0].rstrip(".")
    if not retry and passage.startswith("Sourdough"):  # a paraphrase: not verbatim
        return json.dumps({"instruction": "Why does sourdough rise?", "answer": "Because yeast ferments."})
    return json.dumps({"instruction": "Quote the first sentence of the passage.", "answer": first})


SHIPPED_EXPECTED = {
    "text_to_instruction": ({"kept": 0, "accepted": 4, "discarded": 0, "error": 0},
                            {"answer_not_in_source": 1}),
    "repair": ({"kept": 2, "accepted": 1, "discarded": 1, "error": 0}, {"incomplete": 1}),
    "translate_da": ({"kept": 0, "accepted": 4, "discarded": 0, "error": 0}, {"structure_changed": 2}),
    "domain_tasks": ({"kept": 0, "accepted": 3, "discarded": 0, "error": 0}, {}),
}


@pytest.mark.parametrize("name", sorted(SHIPPED_EXPECTED))
def test_shipped_pipeline(name, tmp_path):
    with StandIn(shipped_responder) as server:
        overrides = [f"endpoints.{e}.base_url={server.base_url}" for e in ("generator", "auditor")]
        report = run(REPO / "configs" / "synth" / f"{name}.yaml", tmp_path / "out", *overrides,
                     "tracking.enabled=false")
    status, regenerated = SHIPPED_EXPECTED[name]
    assert report.status == status
    assert report.regenerate_reasons == regenerated
    accepted = read_jsonl(tmp_path / "out" / "accepted.jsonl")
    for rec in accepted:
        to_conversation(rec)
    if name == "translate_da":
        source = {r["id"]: r for r in read_jsonl(REPO / "configs/synth/data/conversations.jsonl")}
        for rec in accepted:
            src = source[rec["synth"]["row_id"]]["messages"]
            assert [m["role"] for m in rec["messages"]] == [m["role"] for m in src]
    if name == "repair":
        by_id = {r["synth"]["row_id"]: r for r in accepted}
        assert by_id["c2"]["synth"]["status"] == "accepted"
        assert by_id["c2"]["messages"][-1]["content"].endswith("lower it by one.")
        assert by_id["c1"]["synth"]["status"] == "kept"


def test_bad_source_rows_are_counted_as_errors(fresh, tmp_path):
    path = write_pipeline(tmp_path, fresh.base_url, 2)
    with (tmp_path / "src.jsonl").open("a") as f:
        f.write('{"id": "r002", "text": \n')  # malformed JSON
        f.write('{"id": "r003", "body": "no text field"}\n')  # the prompt's row.text is missing
    report = run(path, tmp_path / "out")
    assert report.source_rows == report.decided == 4
    assert report.status == {"kept": 0, "accepted": 1, "discarded": 1, "error": 2}
    assert report.error_reasons == {"invalid_source_row": 1, "prompt_template_error": 1}


def test_parquet_source_with_line_numbers_as_ids(fresh, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = 6
    path = write_pipeline(tmp_path, fresh.base_url, rows)
    texts = [r["text"] for r in read_jsonl(tmp_path / "src.jsonl")]
    pq.write_table(pa.table({"text": texts}), tmp_path / "src.parquet", row_group_size=4)
    path.write_text(path.read_text().replace("{path: src.jsonl, id_field: id}", "{path: src.parquet}"))
    run(path, tmp_path / "out")
    verdicts = read_jsonl(tmp_path / "out" / "verdicts.jsonl")
    assert [v["row_id"] for v in verdicts] == [str(i) for i in range(1, rows + 1)]
    assert [v["status"] for v in verdicts] == [EXPECTED[kind_of(i)][0] for i in range(rows)]
