"""What a training checkpoint holds, read with megatron's plain reader (none of our loading code),
and comparisons of two checkpoints: bit-exact (resume) or within a tolerance (other layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

# Trainer-state entries that name the run (or the bytes on disk) rather than describe the training
# state: torch's .metadata names its own write, so the files' digests differ between two runs.
_RUN_BOUND = ("mlflow_run_id", "written_at", "config", "files", "digest")
# Every checkpoint must hold these (a comparison that found none of them would prove nothing).
_KINDS = ("ema.", "optimizer.exp_avg.", "optimizer.exp_avg_sq.")


def checkpoint_state(path: Path) -> dict:
    """Weights, Adam moments, EMA, rank 0's RNG, and the trainer state (steps, samples, Adam step
    counts) of the checkpoint at ``path``."""
    from megatron.core import dist_checkpointing

    tensors = dist_checkpointing.load_plain_tensors(str(path))
    state = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    state |= {f"rng.{k}": v for k, v in load_file(path / "rng_rank0.safetensors").items()}
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    state["trainer_state"] = {k: v for k, v in trainer_state.items() if k not in _RUN_BOUND}
    return state


def assert_same_state(path: Path, expected: Path, ignore: tuple[str, ...] = ()) -> None:
    """Everything equal with ``torch.equal`` (a resumed run against an uninterrupted one)."""
    got, want = checkpoint_state(path), checkpoint_state(expected)
    for name in ignore:
        got.pop(name), want.pop(name)
    assert got.keys() == want.keys()
    assert got.pop("trainer_state") == want.pop("trainer_state")
    for kind in (*_KINDS, "rng.torch"):
        assert any(name.startswith(kind) for name in got), kind
    differ = [name for name in got if not torch.equal(got[name], want[name])]
    assert differ == [], f"{path} differs from {expected} in {differ}"


def assert_close_states(path: Path, expected: Path, rtol: float) -> None:
    """Weights, EMA and Adam moments within ``rtol`` of each tensor's largest magnitude (another
    parallel layout: only the order of reductions differs, and elementwise tolerances would be
    either vacuous for the tiny second moments or too tight for weights near zero). The RNG and the
    trainer state, which name the layout, are not compared; the Adam moments are what a gradient
    off by a constant factor changes."""
    got, want = checkpoint_state(path), checkpoint_state(expected)
    got = {k: v for k, v in got.items() if k != "trainer_state" and not k.startswith("rng.")}
    want = {k: v for k, v in want.items() if k != "trainer_state" and not k.startswith("rng.")}
    assert got.keys() == want.keys()
    for kind in _KINDS:
        assert any(name.startswith(kind) for name in got), kind
    errors = {}
    for name in got:
        a, b = got[name].double(), want[name].double()
        errors[name] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0
    differ = {name: error for name, error in errors.items() if not error <= rtol}
    assert differ == {}, f"{path} differs from {expected} (relative to the largest value): {differ}"
