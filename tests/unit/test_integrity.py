"""The integrity primitives every stored record uses (mimir_megatron/integrity.py), against
hashlib and json computed here independently."""

import hashlib
import json
import os

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
