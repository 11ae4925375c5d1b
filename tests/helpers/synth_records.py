"""A decided row of a synthetic pipeline, as `mimir synth run`'s runner builds it (for the state
file's and the records' tests)."""

from __future__ import annotations

from mimir_data_prep.synth_pipeline.run_records import EvidenceRow


def evidence_row(row_id: str, status: str = "accepted", input_sha256: str = "h1") -> EvidenceRow:
    """A decided row as the runner builds it (the source's candidate, accepted, or discarded)."""
    verdict = {"verdict": "accept" if status == "accepted" else "discard",
               "reasons": [] if status == "accepted" else [{"code": "off_topic", "detail": "ø"}]}
    attempt = {"attempt": 0, "from_source": True, "generator": None, "auditor": None, "candidate": {"text": "a"},
               "checks": [{"name": "output_format", "kind": "output", "passed": True, "detail": ""}],
               "verdict": verdict}
    return EvidenceRow.decided({
        "row_id": row_id, "source_line": 1, "input_sha256": input_sha256, "pipeline": "p", "fingerprint": "f",
        "status": status, "reasons": verdict["reasons"], "attempts": [attempt],
        "output": {"messages": [{"role": "user", "content": "a"}]} if status == "accepted" else None,
        "decided_at": "2025-01-01T00:00:00+00:00"})
