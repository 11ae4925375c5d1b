"""Packing, the Batch layout, data-parallel sharding and resumption of the training loader."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from audit_support import write_prepared
from mixtures import documents_by_epoch, make_mixture

from mimir_megatron.batch import IGNORE_INDEX
from mimir_megatron.data import (
    DataConfig,
    PackedMixture,
    build_train_loader,
    collate,
    epoch_plan,
    load_eval_samples,
    mixture_fingerprint,
    pack,
    padding_fraction,
)
from mimir_megatron.errors import ConfigError


def test_collate_matches_the_batch_contract_by_hand():
    rows = [
        [(np.array([11, 12]), np.array([13, 14, 15])), (np.array([21]), np.array([22, 23]))],
        [(np.array([31, 32, 33]), np.array([34, 35]))],
    ]
    b = collate(rows, seq_len=8, pad_token_id=0)
    b.validate(vocab_size=64)
    X = IGNORE_INDEX
    assert b.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 0, 0], [31, 32, 33, 34, 0, 0, 0, 0]]
    assert b.labels.tolist() == [[X, 13, 14, 15, 22, 23, X, X], [X, X, 34, 35, X, X, X, X]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert b.segment_ids.tolist() == [[1, 1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert b.prefix_mask.tolist() == [
        [True, True, False, False, True, False, False, False],
        [True, True, True, False, False, False, False, False],
    ]
    assert b.input_ids.dtype == torch.long and b.prefix_mask.dtype == torch.bool


def test_packing_never_splits_and_is_deterministic():
    lengths = np.random.default_rng(1).integers(1, 65, size=3000)
    a = pack(lengths, seq_len=64, window=512, seed=3, epoch=0)
    b = pack(lengths, seq_len=64, window=512, seed=3, epoch=0)
    assert np.array_equal(a.docs, b.docs) and np.array_equal(a.offsets, b.offsets)
    assert sorted(a.docs.tolist()) == list(range(3000))  # every sample exactly once, whole
    per_ctx = np.add.reduceat(lengths[a.docs], a.offsets[:-1])
    assert per_ctx.max() <= 64
    assert 1 - lengths.sum() / (a.num_contexts * 64) < 0.02  # best fit pads little
    c = pack(lengths, seq_len=64, window=512, seed=4, epoch=0)
    assert not np.array_equal(a.docs, c.docs)


@pytest.fixture
def bestfit_library():
    """mimir_megatron.data.bestfit, its loaded library forgotten before and after the test."""
    from mimir_megatron.data import bestfit

    bestfit.library.cache_clear()
    yield bestfit
    bestfit.library.cache_clear()


@pytest.mark.skipif(os.environ.get("MIMIR_PACKING", "").lower() == "python", reason="MIMIR_PACKING=python")
def test_the_packer_runs_the_c_loop_the_install_built(bestfit_library, monkeypatch):
    """The test environment installs the package with a C compiler (tests/run.sh): its best fit is
    the built library in mimir_kernels, never a silent fall back to Python."""
    path = bestfit_library.library_path()
    assert path is not None and path.parent.name == "mimir_kernels", \
        "the install built no mimir_kernels/_bestfit: install a C compiler (apt-get install gcc) and pip install -e . again"
    calls = []
    native = bestfit_library.pack_windows_native
    monkeypatch.setattr(bestfit_library, "pack_windows_native", lambda *a: calls.append(1) or native(*a))
    lengths = np.random.default_rng(2).integers(1, 65, size=1000)
    index = pack(lengths, seq_len=64, window=128, seed=3, epoch=0)
    assert calls == [1]
    python = pack(lengths, seq_len=64, window=128, seed=3, epoch=0, native=False)
    assert calls == [1] and np.array_equal(index.docs, python.docs) and np.array_equal(index.offsets, python.offsets)


def test_without_the_built_loop_packing_runs_in_python_and_says_so_once(bestfit_library, tmp_path,
                                                                       monkeypatch, caplog):
    """An install with no C compiler (no library) or a library that does not load: the same
    contexts, through Python, and one log line naming the cause and the cost; MIMIR_PACKING=python
    takes the Python loop without a word."""
    lengths = np.random.default_rng(2).integers(1, 65, size=1000)
    python = pack(lengths, seq_len=64, window=128, seed=3, epoch=0, native=False)
    broken = tmp_path / "_bestfit.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(bestfit_library, "pack_windows_native", lambda *a: pytest.fail("the C loop ran"))
    for where, cause in ((None, "was not built at install time"), (broken, "does not load")):
        monkeypatch.setattr(bestfit_library, "library_path", lambda where=where: where)
        bestfit_library.library.cache_clear()
        caplog.clear()
        with caplog.at_level("INFO", logger="mimir_megatron.data.bestfit"):
            for _ in range(2):
                index = pack(lengths, seq_len=64, window=128, seed=3, epoch=0)
                assert np.array_equal(index.docs, python.docs) and np.array_equal(index.offsets, python.offsets)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and cause in lines[0] and "runs in Python: an epoch's index ~5x slower" in lines[0], lines
    monkeypatch.undo()
    monkeypatch.setenv("MIMIR_PACKING", "python")
    bestfit_library.library.cache_clear()
    caplog.clear()
    with caplog.at_level("INFO", logger="mimir_megatron.data.bestfit"):
        assert bestfit_library.library() is None
    assert caplog.records == []


def test_epoch_plan_repeats_and_fractions():
    plan = epoch_plan([4, 10], [2, 0.5], seed=0, epoch=0)
    counts = np.bincount(plan, minlength=14)
    assert counts[:4].tolist() == [2, 2, 2, 2]
    assert counts[4:].sum() == 5 and set(counts[4:].tolist()) <= {0, 1}
    assert np.array_equal(plan, epoch_plan([4, 10], [2, 0.5], seed=0, epoch=0))
    assert not np.array_equal(plan, epoch_plan([4, 10], [2, 0.5], seed=0, epoch=1))


def test_loader_yields_every_planned_sample_once_per_epoch(tmp_path):
    cfg = DataConfig(mixture=str(make_mixture(tmp_path)), seq_len=32, seed=5, pack_window=64)
    stream = PackedMixture(cfg)
    n = stream.epoch(0).num_contexts
    seen = []
    for g in range(n):
        for prefix, response in stream.context(g):
            assert len(set(prefix.tolist() + response.tolist())) == 1
            seen.append(int(prefix[0]))
    assert sorted(seen) == sorted(list(range(100, 160)) + 2 * list(range(500, 560)))
    batch = next(build_train_loader(cfg, micro_batch_size=3, dp_rank=0, dp_size=1))
    assert batch.shape == (3, 32)
    batch.validate(vocab_size=1024)
    # Labels are the token that follows in the same sample: ids are constant within a sample.
    keep = batch.labels != IGNORE_INDEX
    assert torch.equal(batch.labels[keep], batch.input_ids[keep])
    assert (stream.index_dir / f"t-{stream.fingerprint[:16]}-e0000.docs.npy").is_file()


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_dp_ranks_split_the_same_global_batches(tmp_path):
    cfg = DataConfig(mixture=str(make_mixture(tmp_path)), seq_len=32, seed=5, pack_window=64)
    single = _take(build_train_loader(cfg, micro_batch_size=4, dp_rank=0, dp_size=1), 30)
    r0 = _take(build_train_loader(cfg, micro_batch_size=2, dp_rank=0, dp_size=2), 30)
    r1 = _take(build_train_loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2), 30)
    assert PackedMixture(cfg).epoch(0).num_contexts < 30 * 4  # so the batches cross epochs
    for k in range(30):
        union = torch.cat([r0[k].input_ids, r1[k].input_ids])
        assert torch.equal(union, single[k].input_ids)
        assert torch.equal(torch.cat([r0[k].labels, r1[k].labels]), single[k].labels)


def test_resume_from_consumed_samples_continues_exactly(tmp_path):
    cfg = DataConfig(mixture=str(make_mixture(tmp_path)), seq_len=32, seed=5, pack_window=64)
    full = _take(build_train_loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2), 12)
    resumed = _take(
        build_train_loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2, consumed_samples=28), 5
    )
    for a, b in zip(full[7:], resumed):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.segment_ids, b.segment_ids)
    with pytest.raises(ValueError, match="multiple of"):
        build_train_loader(cfg, micro_batch_size=2, dp_rank=0, dp_size=2, consumed_samples=6)


def test_fingerprint_changes_with_data_and_settings(tmp_path):
    mix = make_mixture(tmp_path)
    cfg = DataConfig(mixture=str(mix), seq_len=32, seed=5)
    base = mixture_fingerprint(cfg)
    assert base == mixture_fingerprint(DataConfig(mixture=str(mix), seq_len=32, seed=5))
    assert base != mixture_fingerprint(DataConfig(mixture=str(mix), seq_len=32, seed=6))
    mix.write_text(mix.read_text().replace("repeat: 2", "repeat: 3"))
    assert base != mixture_fingerprint(cfg)


def test_data_config_validation_lists_every_mistake():
    with pytest.raises(ConfigError, match=r"(?s)seq_len.*seed"):
        DataConfig(mixture="x.yaml", seq_len=1, seed=-1).validate()


def test_eval_samples_are_prefix_and_response(tmp_path):
    write_prepared(tmp_path / "ev", [([1, 2, 3], [7, 4]), ([1, 5], [8, 9, 4])])
    samples = load_eval_samples(tmp_path / "ev")
    assert samples == [([1, 2, 3], [7, 4]), ([1, 5], [8, 9, 4])]
    assert samples[1].completion_ids == [8, 9, 4]


def test_samples_that_fill_a_context_exactly_pack_without_padding(tmp_path, caplog):
    """A sample occupies prefix + response - 1 positions (its last token is only a label). Pairs
    of samples whose packed lengths add up to seq_len, one sample of exactly seq_len and one a
    token longer: best fit must fill every context to the last position and drop only the long
    one. Over-counting a sample by one token leaves every pair in two contexts, and drops the
    seq_len sample as too long."""
    seq_len = 32
    packed = [5, 27, 10, 22, 16, 16, 1, 31, seq_len, seq_len + 1]
    docs = []
    for i, n in enumerate(packed):
        p = max(1, n // 2)
        docs.append(([i + 1] * p, [i + 1] * (n - p + 1)))
    write_prepared(tmp_path / "a", docs)
    mix = tmp_path / "mix.yaml"
    mix.write_text("name: exact\ndatasets:\n  - {path: a, category: A, language: en, repeat: 1}\n")
    cfg = DataConfig(mixture=str(mix), seq_len=seq_len, seed=0, pack_window=64)
    stream = PackedMixture(cfg)
    assert stream.sample_lengths.tolist() == packed
    with caplog.at_level("WARNING", logger="mimir_megatron.data.packing"):
        index = stream.epoch(0)
    assert "skipping 1 sample(s) longer than seq_len=32" in caplog.text
    assert index.num_contexts == 5  # four exact pairs and the seq_len sample alone
    assert padding_fraction(index, stream.sample_lengths, seq_len) == 0.0
    # The collated rows, laid out from the token ids alone: no padding position anywhere.
    batch = next(build_train_loader(cfg, micro_batch_size=5, dp_rank=0, dp_size=1))
    assert bool((batch.segment_ids > 0).all()), batch.segment_ids
    supervised = sum(len(r) for (_, r), n in zip(docs, packed) if n <= seq_len)
    assert int((batch.labels != IGNORE_INDEX).sum()) == supervised
    assert batch.sources.tolist() == [[9, sum(packed) - (seq_len + 1) + 9, supervised]]


def test_a_manifest_is_read_once_until_it_is_rewritten(tmp_path, monkeypatch):
    """Start-up asks for every manifest several times (policy, fingerprint, stream, lineage): the
    file is parsed once, and parsed again only when it was rewritten."""
    import json as json_module

    from mimir_megatron.data import manifest as manifest_module
    from mimir_megatron.data.manifest import Manifest, write_manifest

    path = write_prepared(tmp_path / "ds", [([1, 2], [3, 4])])
    parsed = []
    real_loads = json_module.loads
    monkeypatch.setattr(manifest_module.json, "loads", lambda text: parsed.append(1) or real_loads(text))
    first = Manifest.read(path)
    assert Manifest.read(path) is first and len(parsed) == 1
    stream = PackedMixture(DataConfig(mixture=str(make_mixture(tmp_path / "mix"))))
    assert mixture_fingerprint(stream.cfg, stream.mixture) == stream.fingerprint
    before = len(parsed)
    PackedMixture(stream.cfg, stream.mixture)  # the same manifests again: none parsed anew
    assert len(parsed) == before
    write_manifest(path, {**first.content, "note": "rewritten"})
    assert Manifest.read(path).content["note"] == "rewritten"


def test_the_file_pool_keeps_at_most_its_capacity_open(tmp_path):
    """Ten files read through a pool of three: every read returns its file's bytes, never more
    than three descriptors stay open, and the least recently used one is the one closed."""
    from mimir_megatron.data.files import FilePool

    paths = []
    for i in range(10):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * 16)
    pool = FilePool(3)
    for _ in range(2):
        for i, path in enumerate(paths):
            assert pool.pread(str(path), 4, 8) == bytes([i]) * 4
            assert len(pool) <= 3
    assert pool.opened == 20  # a round of ten through three slots reopens every file
    pool.pread(str(paths[8]), 1, 0)  # 7, 8, 9 open: 8 used last, 7 least recently
    pool.pread(str(paths[0]), 1, 0)
    assert list(pool._open) == [str(paths[9]), str(paths[8]), str(paths[0])]
    pool.close()
    assert len(pool) == 0


def test_each_epoch_is_reshuffled_and_redraws_its_fractional_subset(tmp_path):
    """Three epochs of one mixture: every document of a repeat-1 dataset once per epoch, a
    repeat-1.5 one's documents once plus a half of them again, and each epoch packed and drawn
    anew (an epoch seed ignored would repeat epoch 0)."""
    n_docs = 60  # "a" is global docs 0..59 (repeat 1), "b" 60..119 (repeat 1.5)
    cfg = DataConfig(mixture=str(make_mixture(tmp_path, n_docs=n_docs, repeat_b=1.5)), seq_len=32,
                     seed=5, pack_window=64)
    epochs = documents_by_epoch(PackedMixture(cfg), 3)
    drawn = []
    for contexts in epochs:
        counts = collections.Counter(d for context in contexts for d in context)
        assert all(counts[d] == 1 for d in range(n_docs))                     # repeat 1: once
        b = [counts[d] for d in range(n_docs, 2 * n_docs)]
        assert sorted(b) == [1] * 30 + [2] * 30                              # 1.5: once + a half
        drawn.append({d for d in range(n_docs, 2 * n_docs) if counts[d] == 2})
    assert epochs[0] != epochs[1] != epochs[2], "an epoch repeats another's packing"
    assert drawn[0] != drawn[1] and drawn[1] != drawn[2], "the fractional subset is not redrawn"


def test_the_file_pool_closes_what_it_evicts(tmp_path):
    """The descriptors a pool evicts are closed, not only forgotten: reading 10 files through a
    pool of 3 leaves 3 more descriptors open in the process, and none once the pool is closed."""
    from mimir_megatron.data.files import FilePool

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    paths = []
    for i in range(10):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * 4)
    before = open_descriptors()
    pool = FilePool(3)
    for path in paths * 2:
        pool.pread(str(path), 1, 0)
    assert open_descriptors() - before == 3
    pool.close()
    assert open_descriptors() == before


def test_the_file_pool_reads_a_file_replaced_under_its_name_anew(tmp_path):
    """A dataset prepared again in place (shards written beside, renamed over) in a process that
    read it before: the pool's old descriptor must not serve the old file's bytes."""
    from mimir_megatron.data.files import FilePool

    path = tmp_path / "shard.bin"
    path.write_bytes(b"old-bytes")
    pool = FilePool(4)
    assert pool.pread(str(path), 3, 0) == b"old"
    replacement = tmp_path / "shard.bin.tmp"
    replacement.write_bytes(b"new-bytes")
    replacement.replace(path)
    assert pool.pread(str(path), 3, 0) == b"new"
    assert len(pool) == 1 and pool.opened == 2
    pool.close()


def test_the_open_file_limit_is_raised_or_named_in_one_line(monkeypatch):
    import resource

    from mimir_megatron.data import files
    from mimir_megatron.errors import UserError

    calls = []
    monkeypatch.setattr(files.resource, "setrlimit", lambda which, limits: calls.append(limits))
    monkeypatch.setattr(files.resource, "getrlimit", lambda which: (1024, 4096))
    assert files.raise_open_file_limit() == 4096 and calls == [(4096, 4096)]
    assert files.pool_capacity(4096) == 1024 and files.pool_capacity(256) == 64
    monkeypatch.setattr(files.resource, "getrlimit", lambda which: (32, 32))
    with pytest.raises(UserError) as low:
        files.raise_open_file_limit()
    assert str(low.value).startswith("the open-file limit is 32 (hard limit 32); mimir needs at least 64: "
                                     "raise the open-file limit (`ulimit -n 65536`")
    assert "prepare the dataset again" not in str(low.value)
    assert resource.RLIMIT_NOFILE is files.resource.RLIMIT_NOFILE


def test_documents_read_by_pread_equal_megatrons_reader(tmp_path):
    """The loader's own reader of the .idx/.bin layout against megatron-core's IndexedDataset,
    over several shards; and the lengths it scans from the .idx files."""
    rng = np.random.default_rng(3)
    docs = [(rng.integers(0, 1000, int(rng.integers(1, 9))).tolist(),
             rng.integers(0, 1000, int(rng.integers(2, 9))).tolist()) for _ in range(25)]
    from mimir_megatron.data import PreparedDataset

    ds = PreparedDataset(write_prepared(tmp_path / "ds", docs, docs_per_file=7))
    assert ds.shard_documents == [7, 7, 7, 4]
    for i, (p, r) in enumerate(docs):
        prefix, response = ds.document(i)
        assert prefix.tolist() == p and response.tolist() == r
        shard, local = divmod(i, 7)
        mega = ds.shard(shard)
        assert mega.get(2 * local).tolist() == p and mega.get(2 * local + 1).tolist() == r
    assert ds.prefix_lengths.tolist() == [len(p) for p, _ in docs]
    assert ds.response_lengths.tolist() == [len(r) for _, r in docs]


def test_sample_lengths_are_memory_mapped_from_the_index_dir(tmp_path):
    cfg = DataConfig(mixture=str(make_mixture(tmp_path)), seq_len=32, seed=5, pack_window=64)
    stream = PackedMixture(cfg)
    lengths = stream.sample_lengths
    assert isinstance(lengths, np.memmap)
    expected = np.concatenate([d.prefix_lengths + d.response_lengths - 1 for d in stream.datasets])
    assert np.array_equal(lengths, expected)
    again = PackedMixture(cfg)  # a second rank: maps the same file
    assert np.array_equal(again.sample_lengths, expected) and again.built_epochs == []
    assert stream.build_ahead(100, workers=1) >= 2 and again.build_ahead(100, workers=1) >= 2
    assert again.built_epochs == [] and stream.built_epochs == list(range(len(stream.built_epochs)))


def test_every_epoch_a_run_reaches_is_packed_ahead_beyond_64(tmp_path):
    # A tiny mixture trained long: all 100 epochs are packed at start-up (there was a limit of 64,
    # after which every rank packed at each boundary), cached, and read back memory-mapped.
    cfg = DataConfig(mixture=str(make_mixture(tmp_path, n_docs=6)), seq_len=32, seed=5, pack_window=64)
    stream = PackedMixture(cfg)
    per_epoch = stream.epoch(0).num_contexts
    assert stream.build_ahead(100 * per_epoch, workers=1) >= 100
    built = list(stream.built_epochs)
    assert built == list(range(len(built))) and len(built) >= 100
    stream.locate(100 * per_epoch - 1)  # the last sample planned: nothing left to pack
    assert stream.built_epochs == built
    assert all(isinstance(stream._epochs[e].docs, np.memmap) for e in (0, 99))


def _hashed_files(monkeypatch) -> list[str]:
    """Record every file the data checks read for its sha256 (through the digest cache or not)."""
    from mimir_megatron.data import policy, prepared

    hashed: list[str] = []
    real = prepared.sha256_file

    def recording(path):
        hashed.append(str(path))
        return real(path)

    monkeypatch.setattr(prepared, "sha256_file", recording)
    monkeypatch.setattr(policy, "sha256_file", recording)
    return hashed


def test_ranks_split_the_hashing_by_bytes(tmp_path, monkeypatch):
    """Shards whose .bin is 10-60x its .idx: every file is hashed by exactly one of two ranks, and
    the two shares differ by less than the largest file (by count, one rank read every .bin)."""
    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.data.policy import training_data_problems
    from mimir_megatron.data.prepared import ByteShares

    docs = [([7] * 3, [8] * int(n)) for n in np.random.default_rng(0).integers(50, 400, 12)]
    write_prepared(tmp_path / "a", docs, docs_per_file=1)
    mix = tmp_path / "mix.yaml"
    mix.write_text("name: bytes\ndatasets:\n  - {path: a, category: A, language: en}\n")
    hashed = _hashed_files(monkeypatch)
    shares = []
    for rank in (0, 1):
        before = len(hashed)
        assert training_data_problems(load_mixture(mix), rank=rank, world=2, digest_cache=tmp_path / f"c{rank}") == []
        shares.append(hashed[before:])
    files = sorted(str(p.resolve()) for p in (tmp_path / "a" / "shards").glob("*.*") if p.suffix in (".bin", ".idx"))
    assert sorted(shares[0] + shares[1]) == files
    sizes = [sum(Path(f).stat().st_size for f in share) for share in shares]
    assert abs(sizes[0] - sizes[1]) <= max(Path(f).stat().st_size for f in files), sizes
    by_count = ByteShares(2)
    assert [by_count.owner(s) for s in (100, 1, 100, 1, 50, 50)] == [0, 1, 1, 0, 0, 1]


def test_a_restart_does_not_hash_unchanged_files_again(tmp_path, monkeypatch):
    """The digest cache: the second start reads no file; a file changed in place (same size, new
    mtime) is read again and reported, one whose mtime alone changed is read again and passes;
    verify_cache off (None) reads everything."""
    import os

    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.data.policy import training_data_problems

    mix = make_mixture(tmp_path)
    cache = tmp_path / "index"
    hashed = _hashed_files(monkeypatch)
    assert training_data_problems(load_mixture(mix), digest_cache=cache) == []
    first = list(hashed)
    assert len(first) == 4 and list(cache.glob("verified-sha256.*.json"))  # 2 datasets x .bin/.idx
    hashed.clear()
    assert training_data_problems(load_mixture(mix), digest_cache=cache) == []
    assert hashed == []
    damaged, touched = tmp_path / "a" / "shards" / "00000.bin", tmp_path / "b" / "shards" / "00000.idx"
    data = bytearray(damaged.read_bytes())
    data[0] ^= 1
    damaged.write_bytes(bytes(data))
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    problems = training_data_problems(load_mixture(mix), digest_cache=cache)
    assert sorted(hashed) == sorted([str(damaged.resolve()), str(touched.resolve())])
    assert len(problems) == 1 and f"{damaged}: sha256 differs" in problems[0]
    hashed.clear()
    assert len(training_data_problems(load_mixture(mix), digest_cache=None)) == 1
    assert len(hashed) == 4
