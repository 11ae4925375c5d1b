"""Beyond epoch 0: a loader or a training run resumed across an epoch boundary continues exactly,
and the packer's index is today's (each epoch shuffled and packed anew, fractional repeats
redrawn: tests/unit/test_data_loader.py)."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
from conftest import REPO, train_overrides
from mixtures import make_mixture

from mimir_megatron.data import DataConfig, PackedMixture, build_train_loader

N_DOCS = 60  # per dataset in make_mixture: "a" is global docs 0..59 (repeat 1), "b" 60..119


def test_loader_resumes_on_both_sides_of_an_epoch_boundary(tmp_path):
    cfg = DataConfig(mixture=str(make_mixture(tmp_path, n_docs=N_DOCS)), seq_len=32, seed=5,
                     pack_window=64, index_dir=str(tmp_path / "index"))
    first = PackedMixture(cfg).epoch(0).num_contexts
    step = 2 * 2  # micro-batch 2 x DP 2
    full = [next(it) for it in [build_train_loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2)]
            for _ in range(first // step + 6)]
    # The last batch wholly inside epoch 0 (the next one straddles or starts epoch 1), and one in epoch 1.
    for consumed in (first // step * step - step, (first // step + 2) * step):
        for cached in tmp_path.joinpath("index").glob("*.npy"):
            cached.unlink()  # a fresh job rebuilds the epochs it needs
        resumed = build_train_loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2,
                                     consumed_samples=consumed)
        for expected in full[consumed // step:]:
            got = next(resumed)
            assert torch.equal(got.input_ids, expected.input_ids), consumed
            assert torch.equal(got.segment_ids, expected.segment_ids), consumed
    assert len(full) * step > first + 2 * step  # the comparison really reached epoch 1


@pytest.fixture(scope="module")
def small_epochs(demo_data):
    """The demo mixture at 2 % per epoch: 10 contexts of 64 tokens, 2.5 global batches of 4."""
    text = (demo_data / "mixture.yaml").read_text()
    path = demo_data / "mixture_2pct.yaml"
    path.write_text(text.replace("repeat: 1}", "repeat: 0.02}").replace("name: test-demo", "name: demo-2pct"))
    return path


def test_training_resumed_across_epoch_boundaries_is_bit_exact(demo_data, small_epochs, tmp_path):
    from mimir_megatron.model import build_model
    from mimir_megatron.model.state import gather_full_state
    from mimir_megatron.checkpoint import load_checkpoint
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    def run(run_dir, stop_at_step=None):
        cfg = load_train_config(REPO / "configs/train/demo.yaml", train_overrides(
            demo_data, run_dir, f"data.mixture={small_epochs}", "checkpoint.interval=100"))
        return cfg, train(cfg, stop_at_step=stop_at_step)

    cfg, whole = run(tmp_path / "whole")
    sizes = [PackedMixture(cfg.data).epoch(e).num_contexts for e in range(2)]
    # 6 steps x 4 samples = 24: the run crosses into epochs 1 and 2. The stop after 16 samples
    # resumes inside epoch 1 (a fresh process locates it past epoch 0) and crosses into epoch 2.
    assert 8 < sizes[0] < 16 < sizes[0] + sizes[1] < 24, sizes
    losses = []
    for stop in (4, None):
        losses += run(tmp_path / "pieces", stop_at_step=stop)[1].losses
    assert losses == whole.losses  # exactly
    finals = []
    for run_dir in ("whole", "pieces"):
        model = build_model(cfg.model)
        load_checkpoint(tmp_path / run_dir / "checkpoints" / "step_0000006", model, None, None)
        finals.append(gather_full_state(model))
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    assert np.isfinite(losses).all()


def test_dp2_crosses_epoch_boundaries_without_packing_in_the_step_loop(demo_data, small_epochs, tmp_path):
    """Two ranks train 6 steps of 4 samples over epochs of about 10 contexts: rank 0 packs every
    epoch the run reaches before step 1, rank 1 packs none, nobody packs inside the step loop, and
    every sample a rank read holds the documents that today's packing puts there (an epoch
    packed afresh in this process, one window after another)."""
    import json

    from distributed import run_ranks

    out = tmp_path / "out"
    out.mkdir()
    index_dir = tmp_path / "index"
    run_ranks("data_epochs_worker.py", 2, str(demo_data), str(tmp_path / "run"), str(out),
              f"data.mixture={small_epochs}", f"data.index_dir={index_dir}", "checkpoint.interval=100")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [b for r in ranks for b in r["builds"] if b["in_step_loop"]] == []
    assert ranks[1]["builds"] == []
    built = [b["epoch"] for b in ranks[0]["builds"]]
    assert built == list(range(len(built))) and len(built) >= 3, built  # epochs 0, 1, 2 at least

    stream = PackedMixture(DataConfig(mixture=str(small_epochs), seq_len=64, seed=1234,
                                      index_dir=str(tmp_path / "fresh")))
    read = {int(s): docs for r in ranks for s, docs in r["samples"].items()}
    assert set(range(24)) <= set(read)  # 6 steps x 4 samples: both ranks' shares
    assert stream.locate(23)[0] == 2  # the run reached epoch 2
    for sample, docs in read.items():
        assert docs == stream.context_documents(sample).tolist(), sample
    assert stream.built_epochs == built[: len(stream.built_epochs)]


# sha256 of two epochs' index (docs, offsets as int64) of the mixture below, computed by the
# packer as it was before epochs were packed ahead in processes (commit e2c4ee7): the same
# packing means the same samples, so this digest changes only with PACKING_VERSION.
PACKED_DIGEST = "7adfa38816ffbdfc30c5a66254d956402a892d4670e87b7facef5bace25e661b"


def test_packing_in_processes_gives_todays_index_exactly():
    import hashlib

    from mimir_megatron.data.packing import build_epoch_index

    rng = np.random.default_rng(11)
    lengths = np.clip(rng.lognormal(5, 1.0, 40_000), 2, 1024).astype(np.int32)
    for workers in (1, 3):
        digest = hashlib.sha256()
        for epoch in (0, 1):
            index = build_epoch_index(lengths, [10_000, 20_000, 10_000], [1, 2.5, 0.5], seq_len=1024, seed=3,
                                      epoch=epoch, window=2048, workers=workers)
            digest.update(np.ascontiguousarray(index.docs, dtype=np.int64).tobytes())
            digest.update(np.asarray(index.offsets, np.int64).tobytes())
        assert digest.hexdigest() == PACKED_DIGEST, workers


def _reference_best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The packer before it was compiled (packing._best_fit at 4ae7378), kept as the reference."""
    from bisect import bisect_left

    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    smallest = min(lengths)
    caps: list[int] = []
    owners: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        j = bisect_left(caps, n)
        if j == len(caps):
            b = len(bins)
            bins.append([i])
            free = seq_len - n
        else:
            free = caps.pop(j) - n
            b = owners.pop(j)
            bins[b].append(i)
        if free >= smallest:
            k = bisect_left(caps, free)
            caps.insert(k, free)
            owners.insert(k, b)
    return bins


def _reference_windows(lengths: np.ndarray, seq_len: int, window: int) -> tuple[list[int], list[int]]:
    items, sizes = [], []
    for w0 in range(0, len(lengths), window):
        for b in _reference_best_fit(lengths[w0 : w0 + window].tolist(), seq_len):
            items += [w0 + i for i in b]
            sizes.append(len(b))
    return items, sizes


def test_the_c_packer_packs_what_the_python_one_did(monkeypatch):
    """Random lengths (uniform, long-tailed, many equal, all full, all one token) and windows:
    the best fit in C (built by the test environment's install, into mimir_kernels) and the
    Python fallback both give the reference's contexts, and whole epochs packed either way, in 1
    or 3 processes, are equal. The C loop is seen to run (no silent fall back)."""
    from mimir_megatron.data import bestfit
    from mimir_megatron.data import packing
    from mimir_megatron.data.packing import _pack_windows, pack

    if os.environ.get("MIMIR_PACKING", "").lower() == "python":
        pytest.skip("MIMIR_PACKING=python")
    assert bestfit.library() is not None
    calls = collections.Counter()
    native = bestfit.pack_windows_native
    monkeypatch.setattr(bestfit, "pack_windows_native", lambda *a: calls.update(["C"]) or native(*a))
    rng = np.random.default_rng(7)
    for trial in range(60):
        n, seq_len = int(rng.integers(1, 6000)), int(rng.choice([8, 100, 4096]))
        window = int(rng.choice([1, 5, 256, 2048, 16384]))
        lengths = [rng.integers(1, seq_len + 1, n), np.clip(rng.lognormal(np.log(seq_len / 5), 1, n), 1, seq_len),
                   rng.choice([1, seq_len // 3 + 1, seq_len // 2, seq_len], n), np.full(n, seq_len),
                   np.ones(n)][trial % 5].astype(np.int32)
        items, sizes = _reference_windows(lengths, seq_len, window)
        for native_loop in (True, False):
            got_items, got_sizes = _pack_windows(lengths, seq_len, window, native_loop)
            assert got_items.tolist() == items and got_sizes.tolist() == sizes, (trial, native_loop)
        assert calls["C"] == trial + 1  # the native run above went through C
    lengths = np.clip(rng.lognormal(6, 0.9, 300_000), 3, 4096).astype(np.int32)
    python = pack(lengths, 4096, 16384, seed=1, epoch=2, native=False)
    assert calls["C"] == 60
    monkeypatch.setattr(packing, "NATIVE_PER_WORKER", 50_000)  # so that 3 processes pack it
    for workers in (1, 3):
        in_c = pack(lengths, 4096, 16384, seed=1, epoch=2, workers=workers)  # in C by default
        assert np.array_equal(in_c.docs, python.docs) and np.array_equal(in_c.offsets, python.offsets)
    assert calls["C"] == 61  # workers=1 here; the 3 processes' calls are theirs (spawned)
