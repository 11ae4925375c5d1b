"""TP=2 (with and without sequence parallel) against TP=1: same weights, logits, loss, grads."""

import pytest
import torch
from batches import OVERRIDES, make_batch
from conftest import tiny_config
from distributed import run_ranks
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    run_ranks("tp_model.py", 2, str(out))
    return out


@pytest.fixture(scope="module")
def tp1():
    from mimir_megatron.model import build_model
    from mimir_megatron.model.state import gather_full_state

    model = build_model(tiny_config(*OVERRIDES))
    result = model(make_batch(), window=8)
    result.loss.backward()
    return {
        "weights": gather_full_state(model),
        "grads": gather_full_state(model, lambda p: p.grad),
        "logits": result.logits.detach(),
        "loss": result.loss.detach(),
        "model": model,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [1, 0], ids=["sequence_parallel", "no_sequence_parallel"])
def test_tp2_equals_tp1(tp2_results, tp1, sp):
    got = load_file(str(tp2_results / f"tp2_sp{sp}.safetensors"))
    # One seed gives the same full weights for every TP size.
    for name, weight in tp1["weights"].items():
        assert torch.equal(got[f"weight/{name}"], weight), name
    torch.testing.assert_close(got["logits"], tp1["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["loss"][0], tp1["loss"], rtol=1e-6, atol=1e-6)
    for name, grad in tp1["grads"].items():
        torch.testing.assert_close(got[f"grad/{name}"], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_tp2_chunked_vocab_loss_equals_tp1_plain(tp2_results, tp1):
    """The fused, chunked head + loss, vocab-parallel over 2 ranks with sequence parallel."""
    got = load_file(str(tp2_results / "tp2_chunked.safetensors"))
    torch.testing.assert_close(got["loss"][0], tp1["loss"], rtol=1e-6, atol=1e-6)
    for name, grad in tp1["grads"].items():
        assert ((got[f"grad/{name}"] - grad).norm() / grad.norm()).item() <= 1e-5, name


@pytest.mark.multiprocess
def test_tp2_export_equals_tp1_export(tp2_results, tp1, tmp_path):
    from mimir_megatron.interop import export_hf, read_safetensors_dir

    export_hf(tp1["model"], tmp_path / "hf_tp1")
    ours, theirs = read_safetensors_dir(tmp_path / "hf_tp1"), read_safetensors_dir(tp2_results / "hf_tp2")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert (tmp_path / "hf_tp1" / "config.json").read_text() == (tp2_results / "hf_tp2" / "config.json").read_text()
