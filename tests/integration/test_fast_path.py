"""The GPU fast-path switches, checked on CPU: configuration, backend choice, the attention
backends inside the model, torch.compile, checkpoint portability and batch prefetching.

The CUDA-only halves (compiled FlexAttention gradients, Transformer Engine, bf16) are in
tests/unit/test_gpu.py and run under ``bench/gpu_check.sh``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from batches import packed_batch
from conftest import tiny_config

from mimir_megatron import backend
from mimir_megatron.errors import ConfigError
from mimir_megatron.model import build_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choices")


# -- configuration and backend choice --------------------------------------------------------


def test_new_settings_are_validated_with_one_message_each():
    with pytest.raises(ConfigError) as err:
        tiny_config("execution.attention_backend=flash", "execution.layer_backend=apex", "execution.fp8=e5m2")
    message = str(err.value)
    assert "model.execution.attention_backend must be one of auto, dense, flex, varlen, got 'flash'" in message
    assert "model.execution.layer_backend must be one of auto, local, te, got 'apex'" in message
    assert "model.execution.fp8 must be one of none, delayed, current, mxfp8, got 'e5m2'" in message


def test_fp8_needs_transformer_engine_layers():
    with pytest.raises(ConfigError, match="model.execution.fp8=current needs model.execution.layer_backend te"):
        tiny_config("execution.fp8=current", "execution.layer_backend=local")


@pytest.mark.parametrize("recipe,fp8,megatron_recipe,history", [
    ("delayed", "hybrid", "delayed", 1024), ("current", "hybrid", "tensorwise", 1),
    ("mxfp8", "e4m3", "mxfp8", 1),
])
def test_fp8_recipes_map_onto_megatrons_settings(recipe, fp8, megatron_recipe, history):
    from mimir_megatron.model.hrm import transformer_config

    config = transformer_config(tiny_config(f"execution.fp8={recipe}", "execution.layer_backend=te"), num_layers=2)
    assert (config.fp8, config.fp8_recipe, config.fp8_amax_history_len) == (fp8, megatron_recipe, history)
    assert transformer_config(tiny_config(), num_layers=2).fp8 is None


def test_auto_resolves_to_the_cpu_paths():
    assert backend.attention_backend("auto") == "dense"
    assert backend.layer_backend("auto") == "local"
    assert backend.attention_backend("varlen") == "varlen"
    model = build_model(tiny_config())
    assert (model.attention_backend, model.layer_backend) == ("dense", "local")


def test_transformer_engine_refused_on_cpu_with_the_reason():
    assert backend.transformer_engine_missing() == "no GPU in this process"
    with pytest.raises(ConfigError, match="execution.layer_backend=te needs Transformer Engine on a GPU: no GPU"):
        build_model(tiny_config("execution.layer_backend=te"))


# -- attention backends inside the model -------------------------------------------------------


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch, return_logits=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def test_varlen_two_pass_model_equals_dense():
    """The two-pass index math (CPU reference kernel) through 8 applications and backward."""
    batch = packed_batch()
    dense_out, dense_grads = _loss_and_grads(build_model(tiny_config("execution.attention_backend=dense")), batch)
    varlen_out, varlen_grads = _loss_and_grads(build_model(tiny_config("execution.attention_backend=varlen")), batch)
    real = batch.segment_ids > 0
    torch.testing.assert_close(varlen_out.logits[real], dense_out.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(varlen_out.loss, dense_out.loss, rtol=1e-6, atol=1e-6)
    assert varlen_grads.keys() == dense_grads.keys()
    for name, grad in dense_grads.items():
        torch.testing.assert_close(varlen_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_flex_model_forward_equals_dense():
    """FlexAttention has no CPU backward; its forward (mask semantics) is checked here."""
    batch = packed_batch()
    with torch.no_grad():
        dense = build_model(tiny_config("execution.attention_backend=dense"))(batch).logits
        flex = build_model(tiny_config("execution.attention_backend=flex"))(batch).logits
    real = batch.segment_ids > 0
    torch.testing.assert_close(flex[real], dense[real], rtol=1e-5, atol=1e-5)


def test_flex_takes_a_strided_value_as_megatrons_qkv_split_gives_it(monkeypatch):
    """megatron splits one fused ``[q, gate, k, v]`` row per head, so ``v`` would arrive as a
    strided view (RoPE gives ``q`` and ``k`` fresh; the model copies ``v`` out, model/gate.py).
    The kernel gets ``v`` in the layout of ``q`` and ``k`` either way (compiled FlexAttention
    was seen to go wrong on the strided view), and the result is the contiguous one's and dense
    attention's."""
    from mimir_kernels import flex_prefix_lm
    from mimir_kernels.prefix_lm import dense_prefix_lm_attention, prefix_lm_mask

    batch = packed_batch()
    seq, rows, heads, dim = batch.shape[1], batch.shape[0], 4, 16
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(seq, rows, heads, 4 * dim, generator=g)
    query, _gate, key, value = torch.split(fused, dim, dim=3)
    query, key = query.contiguous(), key.contiguous()
    assert not value.is_contiguous()
    seen = []
    kernel = flex_prefix_lm.flex_attention

    def spy(q, k, v, **kwargs):
        seen.append(v.stride() == q.stride())
        return kernel(q, k, v, **kwargs)

    monkeypatch.setattr(flex_prefix_lm, "flex_attention", spy)
    mask = flex_prefix_lm.build_block_mask(batch.segment_ids, batch.prefix_mask)
    with torch.no_grad():
        strided = flex_prefix_lm.flex_prefix_lm_attention(query, key, value, mask)
        packed = flex_prefix_lm.flex_prefix_lm_attention(query, key, value.contiguous(), mask)
        dense = dense_prefix_lm_attention(query, key, value, prefix_lm_mask(batch.segment_ids,
                                                                             batch.prefix_mask))
    assert seen == [True, True]
    torch.testing.assert_close(strided, packed, rtol=0, atol=0)
    real = (batch.segment_ids > 0).T  # [seq, batch], the output's layout
    torch.testing.assert_close(strided[real], dense[real], rtol=1e-5, atol=1e-5)


def test_gpu_tests_second_model_holds_the_reference_weights():
    """tests/unit/test_gpu.py builds a second model instead of deep-copying the reference (which
    raises for megatron modules): same weights and buffers, but its own tensors."""
    from models import SHAPE, like

    reference = build_model(tiny_config(*SHAPE, "execution.attention_backend=dense"))
    second = like(reference, "execution.attention_backend=dense", "seed=7")  # a seed the load must undo
    ref_state, state = reference.state_dict(), second.state_dict()
    tensors = [k for k, v in ref_state.items() if isinstance(v, torch.Tensor)]
    assert state.keys() == ref_state.keys() and len(tensors) > 10
    for name in tensors:
        assert torch.equal(state[name], ref_state[name]), name
        assert state[name].data_ptr() != ref_state[name].data_ptr(), f"{name} shares storage"


@pytest.mark.slow
def test_compiled_stacks_equal_eager_and_keep_parameter_names():
    """One layer a stack: inductor's C++ build grows with the graph, and the compiled path (each
    stack's ``Module.compile``, called every cycle) is the same at any depth."""
    batch = packed_batch()
    shallow = ("num_layers_L=1", "num_layers_H=1")
    eager = build_model(tiny_config(*shallow))
    eager_out, eager_grads = _loss_and_grads(eager, batch)
    compiled = build_model(tiny_config(*shallow, "execution.compile=true"))
    names = [n for n, _ in eager.named_parameters()]
    assert [n for n, _ in compiled.named_parameters()] == names
    out, grads = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(out.loss, eager_out.loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# -- checkpoints: execution settings may change between save and resume ------------------------


def test_checkpoint_accepts_changed_execution_settings_but_not_shape(tmp_path):
    from mimir_megatron.errors import UserError
    from mimir_megatron import checkpoint as ckpt

    saved_cfg = tiny_config("execution.attention_backend=varlen", "execution.recompute=full",
                            "execution.loss_chunk_tokens=7")
    from dataclasses import replace

    from mimir_megatron.checkpoint.trainer_state import TrainerState

    saved = TrainerState(step=1, format=ckpt.FORMAT, model=saved_cfg.shape_dict(),
                         padded_vocab_size=saved_cfg.padded_vocab_size)
    assert "attention_backend" not in saved.model and "tensor_parallel_size" not in saved.model
    ckpt.check_compatible(saved, tiny_config("execution.compile=true", "execution.layer_backend=local"), tmp_path)
    with pytest.raises(UserError, match="hidden_size"):
        ckpt.check_compatible(saved, tiny_config("hidden_size=128"), tmp_path)
    # A record written before the split holds execution and layout keys flat: still compatible.
    legacy = {**saved.model, "attention_backend": "varlen", "tensor_parallel_size": 2, "compile": True}
    ckpt.check_compatible(replace(saved, model=legacy), tiny_config(), tmp_path)


# -- prefetching ---------------------------------------------------------------------------------


def test_prefetcher_yields_the_same_batches_in_order_and_stops():
    from mimir_megatron.data.prefetch import DevicePrefetcher

    batches = [packed_batch(seed=i) for i in range(5)]
    got = list(DevicePrefetcher(iter(batches), torch.device("cpu"), depth=2))
    assert len(got) == 5
    for a, b in zip(got, batches):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_prefetcher_raises_the_loaders_error_and_closes_its_thread():
    from mimir_megatron.data.prefetch import DevicePrefetcher

    def failing():
        yield packed_batch()
        raise OSError("dataset shard unreadable")

    stream = DevicePrefetcher(failing(), torch.device("cpu"))
    next(stream)
    with pytest.raises(OSError, match="shard unreadable"):
        next(stream)

    endless = DevicePrefetcher(iter(lambda: packed_batch(), None), torch.device("cpu"), depth=1)
    next(endless)
    endless.close()
    assert not endless._thread.is_alive()


def test_data_prefetch_setting_is_validated():
    from mimir_megatron.data.config import DataConfig

    with pytest.raises(ConfigError, match="data.prefetch must be an integer >= 0"):
        DataConfig(mixture="x.yaml", prefetch=-1).validate()


# -- bench ---------------------------------------------------------------------------------------


def test_bench_variants_parse():
    from mimir_megatron.entrypoints.bench import parse_variant

    v = parse_variant("flex+compile:execution.attention_backend=flex, execution.compile=true")
    assert (v.name, v.overrides) == ("flex+compile", ["execution.attention_backend=flex", "execution.compile=true"])
    assert parse_variant("base").overrides == []
    with pytest.raises(ValueError, match="expected key=value"):
        parse_variant("x:compile")


def test_bench_batch_packs_samples():
    from mimir_megatron.bench.measure import bench_batch

    b = bench_batch(vocab=100, micro_batch=2, seq_len=32, samples_per_context=3)
    b.validate(100)
    assert b.segment_ids[0].unique().tolist() == [1, 2, 3]
    assert torch.equal(b.position_ids[0, :10], torch.arange(10))
    assert b.prefix_mask[0, :5].all() and not b.prefix_mask[0, 5:10].any()


def test_bench_reports_each_variant_and_a_failing_one(tmp_path: Path, capsys):
    import json

    from mimir_megatron.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "--shape", "tiny", "--steps", "1", "--warmup", "0", "--seq-len", "32",
                 "--micro-batch", "2", "--no-peer", "--samples-per-context", "3", "--json", str(out),
                 "--variant", "dense:execution.attention_backend=dense",
                 "--variant", "varlen:execution.attention_backend=varlen",
                 "--variant", "te:execution.layer_backend=te", "hidden_size=64", "ffn_hidden_size=128"])
    assert code == 1  # one variant failed
    report = json.loads(out.read_text())
    by_name = {r["name"]: r for r in report["results"]}
    assert by_name["dense"]["settings"]["attention"] == "dense" and by_name["dense"]["tokens_per_s"] > 0
    assert by_name["varlen"]["settings"]["attention"] == "varlen" and by_name["varlen"]["error"] is None
    assert "Transformer Engine" in by_name["te"]["error"]
    assert re.search(r"^te +5  FAILED: ConfigError", capsys.readouterr().out, re.MULTILINE)


def test_bench_variants_share_the_first_models_weights():
    from mimir_megatron.bench.measure import SharedWeights

    weights = SharedWeights()
    first = weights.model(tiny_config(), torch.device("cpu"))
    second = weights.model(tiny_config("execution.attention_backend=varlen", "seed=99"), torch.device("cpu"))
    assert second.attention_backend == "varlen"
    tensors = {k: v for k, v in first.state_dict().items() if isinstance(v, torch.Tensor)}
    assert len(tensors) > 10
    for name, value in second.state_dict().items():
        assert name not in tensors or torch.equal(value, tensors[name]), name


def test_flex_training_on_cpu_is_refused_with_the_alternatives():
    model = build_model(tiny_config("execution.attention_backend=flex"))
    with pytest.raises(NotImplementedError, match="attention_backend dense or varlen"):
        model(packed_batch(), return_logits=False)
