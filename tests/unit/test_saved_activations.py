"""What autograd keeps of one stack application, kernel by kernel, against `mimir plan`'s term.

A stack (a layer and its exit norm) runs twice on a packed batch; what its second application
saves for backward (autograd's saved-tensor hooks, each storage once, so views of one tensor
count once) is one application's activations: the weights and what one forward pass shares
(RoPE's table, the block mask, the varlen index) were already seen in the first. The count must
equal the plan's (``train/plan/memory.py``, ``activation_bytes`` for one application) to the
byte, so a copy a kernel starts to keep fails here. The kernels differ: dense keeps SDPA's
additive mask, flex keeps its inputs and output, varlen its gathered copies of q, k and v. Flex
attention has no CPU backward; its forward is recorded here with torch's CPU check lifted (it
raises before the forward otherwise), in eager mode.
"""

from __future__ import annotations

import functools

import pytest
import torch
from batches import rows_of
from conftest import tiny_config
from mimir_kernels import build_layout

from mimir_megatron.model import build_model
from mimir_megatron.model.attention import RotaryLayout
from mimir_megatron.model.rope import RotaryTable, rotary_angles
from mimir_megatron.train.plan.memory import StepShape, activation_bytes

pytestmark = pytest.mark.timeout(60)

SHAPE = ("hidden_size=256", "num_attention_heads=4", "ffn_hidden_size=512", "num_layers_L=1",
         "num_layers_H=1")
D, HEADS, HEAD_DIM = 256, 4, 64
SEQ, ROWS = 128, 2
# Row 0: two samples (30 prefix + 40 response tokens; 20 + 38); row 1: one (64 + 64).
PIECES = [[(30, 40), (20, 38)], [(64, 64)]]


def _positions(segments: torch.Tensor) -> torch.Tensor:
    """Each sample's positions from 0."""
    positions = torch.zeros_like(segments)
    for row in range(segments.shape[0]):
        for sample in segments[row].unique():
            where = segments[row] == sample
            positions[row, where] = torch.arange(int(where.sum()))
    return positions


@functools.cache
def stack(recompute: str, dtype: str):
    """The L stack (one layer and the exit norm) of a model; the kernel is the layout's."""
    return build_model(tiny_config(*SHAPE, f"execution.recompute={recompute}", f"params_dtype={dtype}")).L


def kept_by_one_application(attention: str, recompute: str, dtype: str, monkeypatch,
                            device: str = "cpu") -> tuple[int, object]:
    """Bytes the second of two applications of the L stack saves for backward, and the layout."""
    if attention == "flex" and device == "cpu":  # record the forward: torch's check and ours raise first
        import mimir_kernels.flex_prefix_lm as flex
        import torch.nn.attention.flex_attention as torch_flex

        monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)
        monkeypatch.setattr(flex, "_refuse_cpu_backward", lambda *tensors: None)
    segments, prefix = rows_of(PIECES, SEQ)
    positions = _positions(segments).to(device)
    segments, prefix = segments.to(device), prefix.to(device)
    layout = build_layout(attention, segments, prefix)
    rotary = RotaryTable(rotary_angles(positions, HEAD_DIM, 10000.0))
    args = dict(attention_mask=None, rotary_pos_emb=None, packed_seq_params=RotaryLayout.of(layout, rotary))
    x = torch.randn(SEQ, ROWS, D, generator=torch.Generator().manual_seed(0)).to(device, getattr(torch, dtype))
    seen: set[int] = set()
    second: dict[int, int] = {}
    recording = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            if recording[0]:
                second[storage.data_ptr()] = storage.nbytes()
        return t

    run = stack(recompute, dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        first = run(x.requires_grad_(), **args)
        recording[0] = True
        run(first, **args)
    return sum(second.values()), layout


def planned(attention: str, recompute: str, dtype: str, **shape) -> float:
    bytes_ = 2 if dtype == "bfloat16" else 4
    cfg = tiny_config(*SHAPE)
    return activation_bytes(cfg, StepShape(
        micro_batch=ROWS, seq_len=SEQ, tp=1, dp=1, k_L=1, k_H=0, recompute=recompute,
        compute_bytes=bytes_, params_bytes=bytes_, on_gpu=False, attention=attention, **shape))


@pytest.mark.parametrize("attention,recompute,dtype", [
    ("dense", "none", "bfloat16"), ("dense", "none", "float32"), ("dense", "selective", "bfloat16"),
    ("dense", "full", "bfloat16"),
])
def test_dense_and_recompute_keep_what_the_plan_counts(attention, recompute, dtype, monkeypatch):
    kept, _ = kept_by_one_application(attention, recompute, dtype, monkeypatch)
    assert kept == planned(attention, recompute, dtype)


def test_flex_keeps_what_the_plan_counts(monkeypatch):
    """q and k after RoPE, v in their layout (no copy of it), the output (the gate's input: a view
    of it, not a second copy), the log-sum-exp. Eager flex also saves its row maxima (fp32, a head
    a token), which the compiled kernel's backward does not read: the GPU plan leaves them out."""
    kept, _ = kept_by_one_application("flex", "none", "bfloat16", monkeypatch)
    eager_row_maxima = ROWS * SEQ * HEADS * 4
    assert kept == planned("flex", "none", "bfloat16") + eager_row_maxima


def test_varlen_keeps_what_the_plan_counts(monkeypatch):
    """The two passes gather q once and k, v for every pass a token is a key of: prefix tokens
    (30 + 20 + 64 = 114) in both, response tokens (40 + 38 + 64 = 142) in the second, so
    (2 x 114 + 142) / 256 keys a token, where the plan assumes the most, 2. The reference kernel
    (one SDPA call per sequence) also keeps each causal sequence's additive mask, responses x
    (prefix + response) of them: 40 x 70 + 38 x 58 + 64 x 128."""
    kept, layout = kept_by_one_application("varlen", "none", "bfloat16", monkeypatch)
    keys = sum(p.keys.numel() for p in layout.varlen.passes) / (ROWS * SEQ)
    assert keys == (2 * 114 + 142) / 256
    reference_masks = 2 * (40 * 70 + 38 * 58 + 64 * 128)  # bf16
    assert kept == planned("varlen", "none", "bfloat16", varlen_keys=keys) + reference_masks
    assert planned("varlen", "none", "bfloat16") > planned("varlen", "none", "bfloat16", varlen_keys=keys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_on_a_gpu_keeps_what_the_plan_counts(monkeypatch):
    """The GPU path as it trains: compiled FlexAttention, bf16. Its backward reads q, k, v, the
    output and the log-sum-exp, so it keeps no row maxima: the plan's term to the byte."""
    kept, _ = kept_by_one_application("flex", "none", "bfloat16", monkeypatch, device="cuda")
    assert kept == planned("flex", "none", "bfloat16")
