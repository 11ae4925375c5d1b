"""The integrity primitives every stored record uses (mimir_megatron/integrity.py), against
hashlib and json computed here independently."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from mimir_megatron import integrity


def test_sha256_file_is_hashlibs_digest_of_the_bytes(tmp_path):
    data = os.urandom(3 << 20) + b"tail"
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert integrity.sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_json_digest_is_over_sorted_utf8_json_without_the_digest_entry():
    record = {"b": 1, "a": "Ærø", "digest": "ignored"}
    expected = hashlib.sha256('{"a": "Ærø", "b": 1}'.encode()).hexdigest()
    assert integrity.json_digest(record) == expected
    stored = integrity.with_digest(record)
    assert stored["digest"] == expected and integrity.digest_matches(stored)
    assert not integrity.digest_matches({**stored, "b": 2})


def test_records_digested_ascii_escaped_before_the_module_still_match():
    body = {"name": "Ærø"}
    legacy = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    assert legacy != integrity.json_digest(body)
    assert integrity.digest_matches({**body, "digest": legacy})


def test_write_json_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    integrity.write_json_atomic(path, {"x": "é"})
    integrity.write_json_atomic(path, {"x": 2})
    assert json.loads(path.read_text(encoding="utf-8")) == {"x": 2}
    assert path.read_text().endswith("}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "r.json"
    integrity.write_json_atomic(path, {"x": 1})
    with pytest.raises(TypeError):
        integrity.write_json_atomic(path, {"x": object()})
    assert json.loads(path.read_text()) == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_atomic_files_appear_together_or_not_at_all(tmp_path):
    """The streaming writers' one helper: both files appear once the block ends; a block that
    raises leaves the old files as they were and no temporary behind."""
    out, rejects = tmp_path / "out.jsonl", tmp_path / "out.rejects.jsonl"
    with integrity.atomic_files(out, rejects) as (out_tmp, rejects_tmp):
        out_tmp.write_text("a\n")
        rejects_tmp.write_text("b\n")
        assert not out.exists() and not rejects.exists()  # nothing under the real names mid-write
    assert (out.read_text(), rejects.read_text()) == ("a\n", "b\n")
    with pytest.raises(RuntimeError), integrity.atomic_files(out, rejects) as (out_tmp, rejects_tmp):
        out_tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert (out.read_text(), rejects.read_text()) == ("a\n", "b\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.rejects.jsonl"]
    # A writer that appends its own extension (numpy) keeps it last; leftovers of a killed writer go.
    with integrity.atomic_files(tmp_path / "x.npy", suffix=".npy", fsync=False) as (staged,):
        assert staged.name.endswith(".npy") and staged.parent == tmp_path
        staged.write_bytes(b"x")
    leftover = integrity.temporary_path(tmp_path / "big.bin")
    leftover.write_bytes(b"partial")
    integrity.remove_temporaries(tmp_path / "big.bin")
    assert not leftover.exists() and (tmp_path / "x.npy").read_bytes() == b"x"


def test_directory_sha256_keeps_both_recorded_rules(tmp_path):
    """The tokenizer's digest (top-level files, each name and bytes ended by NUL) and a benchmark's
    data digest (every file below, by path order, NUL after the name only): both are recorded by
    files written before, so each must come out as its first version computed it (here by hand)."""
    (tmp_path / "tok").mkdir()
    for name, data in (("vocab.json", b"{}"), ("merges.txt", b"a b"), ("tokenizer.json", "ø".encode())):
        (tmp_path / "tok" / name).write_bytes(data)
    expected = hashlib.sha256()
    for name in sorted(["vocab.json", "merges.txt", "tokenizer.json"]):
        expected.update(name.encode() + b"\0" + (tmp_path / "tok" / name).read_bytes() + b"\0")
    assert integrity.directory_sha256(tmp_path / "tok", recursive=False, end_each_file=True) == expected.hexdigest()
    from mimir_megatron.chat import tokenizer_sha256

    assert tokenizer_sha256(tmp_path / "tok") == expected.hexdigest()
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    (data / "a" / "b").write_bytes(b"1")
    (data / "a-c").write_bytes(b"2")  # sorts after a/b by path parts, before it as a string
    expected = hashlib.sha256(b"a/b\x001" + b"a-c\x002").hexdigest()
    from mimir_megatron.evaluation.contamination import data_sha256

    assert integrity.directory_sha256(data) == data_sha256(data) == expected
    assert data_sha256(data / "a-c") == hashlib.sha256(b"2").hexdigest() and data_sha256(tmp_path / "no") is None


def test_a_fingerprint_is_the_canonical_digest_and_knows_the_one_recorded_before():
    """Fingerprints (a shard's key, a mixture, a pipeline, a source row) go through the canonical
    encoding; one recorded by an earlier version, over ASCII-escaped JSON, still matches."""
    import copy
    import pickle

    value = {"name": "Grøn", "seq_len": 64, "path": Path("/d")}
    found = integrity.fingerprint(value)
    canonical = hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode())
    earlier = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
    assert found == canonical.hexdigest() != earlier and isinstance(found, str)
    assert found.matches(found) and found.matches(earlier) and not found.matches("0" * 64)
    for again in (pickle.loads(pickle.dumps(found)), copy.deepcopy(found)):  # across processes
        assert again == found and again.matches(earlier)
    assert json.loads(json.dumps({"f": found})) == {"f": str(found)}


def test_no_module_stages_its_own_files():
    """Temporary names, fsync and renames live in integrity.py: a module that renames a file into
    place itself is a writer outside the one helper. Directory renames (a checkpoint, an export),
    the run lock, the append-only evidence file and MLflow's template database are the exceptions."""
    import re

    from conftest import REPO

    allowed = {"mimir_megatron/integrity.py", "mimir_megatron/checkpoint/write.py", "mimir_megatron/checkpoint/prune.py",
               "mimir_megatron/interop.py", "mimir_megatron/mlflow_store.py",
               "data_prep/mimir_data_prep/synth_pipeline/evidence_file.py"}
    pattern = re.compile(r"os\.replace\(|os\.fsync\(|\.tmp\b|\.rename\(")
    found = [f"{path.relative_to(REPO)}:{n}" for root in ("mimir_megatron", "data_prep", "kernels")
             for path in sorted((REPO / root).rglob("*.py")) if str(path.relative_to(REPO)) not in allowed
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
