"""The audit index answers like a brute-force search over the documents (never across one)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from audit_support import write_prepared
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mimir_megatron.audits import AuditIndex, AuditSource, Hit, build_index
from mimir_megatron.errors import UserError


def brute_match_lengths(query: list[int], docs: list[list[int]]) -> list[int]:
    out = []
    for i in range(len(query)):
        best = 0
        for doc in docs:
            for s in range(len(doc)):
                k = 0
                while i + k < len(query) and s + k < len(doc) and query[i + k] == doc[s + k]:
                    k += 1
                best = max(best, k)
        out.append(best)
    return out


def brute_hits(span: list[int], named_docs: list[tuple[str, int, list[int]]]) -> set[tuple[str, int, int]]:
    n = len(span)
    return {(name, d, s) for name, d, doc in named_docs for s in range(len(doc) - n + 1) if doc[s:s + n] == span}


def build(root: Path, datasets: dict[str, list[tuple[list[int], list[int]]]], dtype=np.uint16, **kw):
    sources, per_file = [], kw.pop("docs_per_file", None)
    for name, docs in datasets.items():
        write_prepared(root / name, docs, dtype=dtype, docs_per_file=per_file)
        sources.append(AuditSource(name, root / name, f"cat-{name}"))
    return AuditIndex(build_index(sources, root / "idx", progress=False, **kw))


documents = st.lists(
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
    min_size=1, max_size=8,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=documents, b=documents, queries=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=4),
       shard_tokens=st.sampled_from([10, 1 << 30]), wide=st.booleans(), data=st.data())
def test_longest_match_and_hits_equal_brute_force(a, b, queries, shard_tokens, wide, data):
    """Small alphabet: many repeats; queries include spans across document boundaries."""
    offset = 200_000 if wide else 0  # ids beyond uint16: the two-symbol encoding
    shift = lambda docs: [([t + offset for t in p], [t + offset for t in r]) for p, r in docs]  # noqa: E731
    named = [("a", i, p + r) for i, (p, r) in enumerate(a)] + [("b", i, p + r) for i, (p, r) in enumerate(b)]
    flat = [doc for _, _, doc in named]
    # a query glued from the end of one document and the start of the next must not match whole
    glued = flat[0][-3:] + flat[-1][:3]
    queries = [*queries, glued, data.draw(st.sampled_from(flat))]
    with tempfile.TemporaryDirectory() as tmp:
        index = build(Path(tmp), {"a": shift(a), "b": shift(b)}, dtype=np.int32 if wide else np.uint16,
                      shard_tokens=shard_tokens, docs_per_file=3)
        assert index.encoding == ("u16x2" if wide else "u16")
        assert index.num_documents == len(named)
        assert index.longest_document == max(len(doc) for doc in flat)
        for name, d, doc in named:  # documents read back from the index's own files
            assert index.document_tokens(name, d).tolist() == [t + offset for t in doc]
        for q in queries:
            expected = brute_match_lengths(q, flat)
            got = index.match_lengths([t + offset for t in q]).tolist()
            assert got == expected, (q, flat)
            if q:
                start, length = index.longest_match([t + offset for t in q])
                assert length == max(expected) and expected[start] == length
                span = q[start:start + length]
                hits = index.locate([t + offset for t in span], limit=10_000) if span else []
                assert {(h.source, h.document, h.offset) for h in hits} == brute_hits(span, named)
                assert index.count([t + offset for t in span]) == len(brute_hits(span, named))


def test_hits_name_dataset_category_document_and_offset(tmp_path):
    docs = [([7, 8], [9, 10, 11]), ([1, 2], [3, 4, 5, 6])]
    index = build(tmp_path, {"x": docs})
    assert index.locate([4, 5, 6]) == [Hit("x", "cat-x", 1, 3)]
    assert index.longest_match([0, 10, 11, 1, 2, 3]) == (3, 3)  # 10 11 ends doc 0; 1 2 3 starts doc 1
    assert index.documents_per_category() == {"cat-x": 2}


def test_without_its_tokenizer_an_index_has_no_word_stream_and_says_so(tmp_path, caplog):
    """The tokenizer a dataset's manifest names is not here: the token stream is built (the
    memorisation audits need nothing else), a warning says the word stream is missing, and the
    contamination check's entry point refuses the index in one line."""
    import logging

    write_prepared(tmp_path / "a", [([1, 2], [3, 4])], tokenizer={"sha256": "f" * 64, "path": str(tmp_path / "gone")})
    with caplog.at_level(logging.WARNING, logger="mimir.audit"):
        index = AuditIndex(build_index([AuditSource("a", tmp_path / "a", "A")], tmp_path / "idx", progress=False))
    assert "gets no word stream" in caplog.text and index.metadata.words is None
    assert index.locate([2, 3]) == [Hit("a", "A", 0, 1)] and not (tmp_path / "idx" / "words").exists()
    with pytest.raises(UserError, match=r"has no word stream \(the datasets' tokenizer was not there"):
        index.words()


def test_datasets_of_two_tokenizers_are_not_indexed_together(tmp_path):
    write_prepared(tmp_path / "a", [([1], [2])])
    write_prepared(tmp_path / "b", [([1], [2])], tokenizer={"sha256": "f" * 64, "path": "other"})
    sources = [AuditSource("a", tmp_path / "a", "A"), AuditSource("b", tmp_path / "b", "B")]
    with pytest.raises(UserError, match=r"different tokenizers: a \(\w{12}\), b \(ffffffffffff\)"):
        build_index(sources, tmp_path / "idx", progress=False)
    assert not (tmp_path / "idx").exists()


def test_suffix_array_parts_merge_to_the_single_part_table(tmp_path):
    """Memory-bounded builds sort parts and merge them: same table as one part."""
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 50, 40).tolist(), rng.integers(0, 50, 160).tolist()) for _ in range(1000)]
    one = build(tmp_path / "one", {"x": docs}, cpus=1)
    parts = build(tmp_path / "parts", {"x": docs}, cpus=2, mem_bytes=1 << 19)
    assert (one.path / "table.0").read_bytes() == (parts.path / "table.0").read_bytes()
    assert one.match_lengths(docs[5][1][:30]).tolist()[0] == 30


def test_interrupted_build_resumes_at_the_unfinished_shard(tmp_path, monkeypatch):
    import mimir_megatron.audits.index_build as index_module

    docs = [([i % 5, 1], [2, 3, i % 7]) for i in range(12)]
    write_prepared(tmp_path / "x", docs, docs_per_file=4)
    sources = [AuditSource("x", tmp_path / "x", "c")]
    build_index(sources, tmp_path / "ref", shard_tokens=20, progress=False)
    real = index_module._build_suffix_array
    calls = []

    def flaky(data_file, *args):
        calls.append(f"{data_file.parent.name}/{data_file.name}")
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while sorting shard 1's tokens (shard 0 and its words done)
        return real(data_file, *args)

    monkeypatch.setattr(index_module, "_build_suffix_array", flaky)
    with pytest.raises(KeyboardInterrupt):
        build_index(sources, tmp_path / "idx", shard_tokens=20, progress=False)
    with pytest.raises(UserError, match="unfinished"):
        AuditIndex(tmp_path / "idx")
    build_index(sources, tmp_path / "idx", shard_tokens=20, progress=False)
    from mimir_megatron.integrity import temporary_path

    def staged(stream: str, shard: int) -> str:  # the writers' one temporary name
        return f"{stream}/{temporary_path(tmp_path / stream / f'tokenized.{shard}').name}"

    assert calls == [staged("idx", 0), staged("words", 0), staged("idx", 1), staged("idx", 1), staged("words", 1),
                     staged("idx", 2), staged("words", 2)]  # shard 1 again after the kill
    for stream in ("", "words/"):
        for name in ("tokenized", "offset", "table"):
            for shard in range(3):
                built, ref = (tmp_path / d / f"{stream}{name}.{shard}" for d in ("idx", "ref"))
                assert built.read_bytes() == ref.read_bytes(), built
    assert not list((tmp_path / "idx").glob("**/.*.tmp*"))


def test_index_of_other_data_is_refused(tmp_path):
    write_prepared(tmp_path / "x", [([1], [2, 3])])
    write_prepared(tmp_path / "y", [([1], [2, 4])])
    build_index([AuditSource("x", tmp_path / "x", "c")], tmp_path / "idx", progress=False)
    with pytest.raises(UserError, match="other data"):
        build_index([AuditSource("y", tmp_path / "y", "c")], tmp_path / "idx", progress=False)
    with pytest.raises(UserError, match="outside the index"):
        AuditIndex(tmp_path / "idx").match_lengths([70_000])
