"""The audit index's metadata record (audit_index.json): one validating read, one write. A
hand-damaged record is refused with one line naming the file; older records still load."""

from __future__ import annotations

import hashlib
import json

import pytest
from record_damage import assert_refused, damage, drop, put, reseal

from mimir_megatron.audits.index_format import (
    META_NAME,
    IndexedSource,
    IndexMetadata,
    IndexShard,
    ShardUnit,
)
from mimir_megatron.audits.index_query import AuditIndex
from mimir_megatron.errors import UserError
from mimir_megatron.integrity import json_digest

TOKENIZER = {"sha256": "a" * 64, "path": "tokenizers/demo"}


def record() -> IndexMetadata:
    sources = [IndexedSource("x", "/data/x", "A", 3, 14, {"files": 2}, TOKENIZER),
               IndexedSource("y", "/data/y", "B", 1, 4, {"files": 1}, TOKENIZER)]
    shards = [IndexShard(0, 3, 14, (ShardUnit(0, 0, 0, 2, 9), ShardUnit(0, 1, 2, 1, 5))),
              IndexShard(1, 1, 4, (ShardUnit(1, 0, 0, 1, 4),))]
    return IndexMetadata.new("u16", sources, shards, TOKENIZER)


def old_rule(body: dict) -> str:
    """The fingerprint rule of the indexes written before mimir_megatron.integrity."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def test_a_written_record_reads_back_equal(tmp_path):
    meta = record()
    meta.write(tmp_path)
    back = IndexMetadata.read(tmp_path)
    assert back == meta and back.fingerprint == meta.fingerprint
    assert back.same_plan(meta) and back.total_tokens == 18


def test_the_fingerprint_is_the_old_rule_on_ascii_records():
    """Contamination reports record the index's fingerprint: the rule must not have moved."""
    meta = record()
    assert meta.fingerprint == old_rule(meta.body()) == json_digest(meta.body())


def test_an_index_from_before_the_tokenizer_was_recorded_with_a_non_ascii_path_loads(tmp_path):
    """Written by the older code: no tokenizer keys, fingerprint by its ASCII-escaped rule."""
    body = {"format": "mimir-audit-index-v1", "encoding": "u16x2",
            "sources": [{"name": "café", "path": "/données/café", "category": "A", "documents": 1,
                         "tokens": 4, "outputs": {}}],
            "shards": [{"id": 0, "documents": 1, "tokens": 4, "units": [[0, 0, 0, 1, 4]]}]}
    body["fingerprint"] = old_rule(body)
    (tmp_path / META_NAME).write_text(json.dumps(body, indent=1))
    meta = IndexMetadata.read(tmp_path)
    assert not meta.tokenizer_recorded and meta.tokenizer is None
    assert meta.fingerprint == body["fingerprint"]  # kept as stored
    assert meta.sources[0].path == "/données/café" and meta.shards[0].units[0].tokens == 4
    assert meta.to_json() == body


# (change, the fingerprint re-sealed so that only the check under test can catch it, the line's words)
DAMAGED = {
    "missing encoding": (drop("encoding"), True, "encoding is missing"),
    "missing source field": (drop("sources", 0, "category"), True, "sources[0].category is missing"),
    "missing shard units": (drop("shards", 1, "units"), True, "shards[1].units is missing"),
    "missing fingerprint": (drop("fingerprint"), False, "fingerprint is missing"),
    "sources not a list": (put({"x": 1}, "sources"), True, "sources must be a list"),
    "tokens a string": (put("14", "shards", 0, "tokens"), True, "shards[0].tokens must be an integer, got '14'"),
    "documents a boolean": (put(True, "sources", 1, "documents"), True,
                            "sources[1].documents must be an integer, got True"),
    "a unit of four counts": (put([0, 0, 0, 2], "shards", 0, "units", 0), True,
                              "shards[0].units[0] must be five counts"),
    "a unit of an unknown source": (put([2, 0, 0, 1, 4], "shards", 1, "units", 0), True,
                                    "shards[1].units[0] names source 2, but there are 2"),
    "tokenizer a string": (put("demo", "tokenizer"), True, "tokenizer must be null or"),
    "shard ids out of order": (put(5, "shards", 1, "id"), True, "shard ids [0, 5] are not 0..1 in order"),
    "unknown version": (put("mimir-audit-index-v2", "format"), True,
                        "format 'mimir-audit-index-v2', expected 'mimir-audit-index-v1'"),
    "unknown encoding": (put("u32", "encoding"), True, "encoding 'u32' is not one of u16, u16x2"),
    "edited, fingerprint kept": (put(15, "shards", 0, "tokens"), False, "does not match the content"),
}


@pytest.mark.parametrize("change,resealed,words", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_record_is_refused_in_one_line_naming_the_file(tmp_path, change, resealed, words):
    record().write(tmp_path)
    path = tmp_path / META_NAME
    damage(path, change, *([reseal("fingerprint")] if resealed else []))
    for open_it in (IndexMetadata.read, AuditIndex):  # the record's reader, and opening the index
        assert_refused(lambda: open_it(tmp_path), path, words)


@pytest.mark.parametrize("text,words", [("{", "not a readable index record"), ("[]", "holds list")],
                         ids=["not JSON", "not a mapping"])
def test_a_record_that_is_not_one_is_refused_naming_the_file(tmp_path, text, words):
    (tmp_path / META_NAME).write_text(text)
    with pytest.raises(UserError, match=f"^{tmp_path / META_NAME}: {words}"):
        IndexMetadata.read(tmp_path)


def test_a_directory_without_a_record_is_not_an_index(tmp_path):
    with pytest.raises(UserError, match="not an audit index"):
        AuditIndex(tmp_path)
