"""Full sharding (``optim.fully_shard``, FSDP2): its configuration checks, and `mimir plan`'s
memory and communication terms for it against hand arithmetic (the comments), its ranking.

tests/integration/test_train_fully_shard.py trains with it and checks the plan against the
memory the real step allocates.
"""

from __future__ import annotations

import pytest
from conftest import REPO, TINY

from mimir_megatron.config import load_config
from mimir_megatron.errors import ConfigError, UserError
from mimir_megatron.train.config import load_train_config
from mimir_megatron.gpus import gpu_spec
from mimir_megatron.train.plan.layouts import RunSettings, plan_run
from mimir_megatron.train.plan.memory import StepShape, plan_memory

pytestmark = pytest.mark.timeout(60)

V1_5 = REPO / "configs" / "train" / "mimir_v1_5.yaml"
FSDP = ["optim.fully_shard=true", "optim.distributed_optimizer=false"]


def test_every_contradiction_is_listed_at_once():
    with pytest.raises(ConfigError) as raised:
        load_train_config(V1_5, ["optim.fully_shard=true", "optim.shard_state=false",
                                 "model.parallel.tensor_parallel_size=2"])
    message = str(raised.value)
    assert "optim.distributed_optimizer and optim.fully_shard are two sharding layouts: set one" in message
    assert "optim.fully_shard=true shards the optimizer state: it contradicts optim.shard_state=false" in message
    assert "optim.fully_shard=true shards over data-parallel ranks only: it needs " \
           "model.parallel.tensor_parallel_size=1, got 2" in message


def test_bf16_weights_are_accepted_with_full_sharding():
    cfg = load_train_config(V1_5, FSDP)
    assert cfg.optim.fully_shard and cfg.model.params_dtype == "bfloat16"


def test_rows_of_every_weight_by_hand():
    """DP=3, bf16 compute, k=5 on the tiny shape (D=256, F=768, 2 + 2 layers, vocab 1,024).
    torch.chunk gives rank 0 ceil(rows / 3): 1,024 rows -> 342, 256 -> 86, 1,536 -> 512.
    Embedding and head 342 x 256 = 87,552 each; a layer: qkv 342 x 256 = 87,552, proj 86 x 256 =
    22,016, fc1 512 x 256 = 131,072, fc2 86 x 768 = 66,048: 306,688; four 1,226,752; 1,401,856."""
    tiny = load_config(TINY, [])
    shape = dict(micro_batch=2, seq_len=64, tp=1, dp=3, k_L=3, k_H=2, recompute="none", compute_bytes=2,
                 on_gpu=False, params_bytes=2, fully_shard=True)
    m = plan_memory(tiny, StepShape(**shape))
    rows = 1_401_856
    assert m.weights == 4 * rows + 2 * 256  # the fp32 rows, the bf16 z_L_init buffer whole
    assert (m.gradients, m.optimizer, m.master_weights, m.ema) == (4 * rows, 8 * rows, 0, 4 * rows)
    # The root (the head, 262,144) and a layer (917,504) gathered in bf16; the layer's gradient
    # in bf16 and in fp32 for its reduce-scatter; the head's unsharded bf16 gradient.
    assert m.temporaries["gathered"] == 2 * (262_144 + 917_504)
    assert m.temporaries["reduce_scatter"] == 6 * 917_504 and m.temporaries["head_grad"] == 2 * 262_144
    # After backward, every tensor's rows: the norm and Adam (CPU: tensor by tensor) over fc1's.
    assert m.optimizer_phase == {"grad_norm": 4 * 131_072, "adam": 8 * 131_072}
    # Full recompute with L three times in the window: all four layers gathered, their bf16
    # gradients unsharded until backward ends (measured).
    full = plan_memory(tiny, StepShape(**{**shape, "recompute": "full"})).temporaries
    assert full["gathered"] == 2 * (262_144 + 4 * 917_504) and full["unsharded_grads"] == 2 * 4 * 917_504


def test_gathers_and_reduce_scatters_by_hand():
    """v1.5's final window (k=8: 6 L + 2 H applications with grad) on 8 B200, accumulation 2.
    A layer 30,670,848 weights, the embedding and the head 402,653,184 each. Per micro-batch the
    16 + 16 layers are gathered for the 96 + 32 applications of the forward and the 96 + 32 of
    the backward, 256 x 30,670,848 = 7,851,737,088, plus the embedding twice, 805,306,368:
    8,657,043,456 bf16 weights; reduce-scattered in fp32: 128 x 30,670,848 + the embedding and
    the head 805,306,368 = 4,731,174,912. The root (the head) stays gathered for the step: one
    gather of 402,653,184 a step, not two a micro-batch. 2 x (2 x 8,657,043,456 + 402,653,184)
    + 2 x 4 x 4,731,174,912 = 73,282,879,488 bytes, x 7/8 = 64,122,519,552 bytes a GPU sends."""
    plan = plan_run(load_train_config(V1_5, FSDP), RunSettings(gpu=gpu_spec("b200"), gpus=8))
    assert plan.configured.layout.fully_shard
    assert plan.configured.last_step.dp_bytes == 64_122_519_552


def test_plan_ranks_full_sharding_with_the_other_layouts():
    """The paper's v1.5 layout, distributed optimizer against FSDP2: FSDP2 keeps less (its
    weights and gradients by rows too) and sends more (every use gathers)."""
    plan = plan_run(load_train_config(V1_5), RunSettings(gpu=gpu_spec("b200"), gpus=8))
    same = [p for p in plan.ranked if (p.layout.micro_batch, p.layout.recompute) == (4, "none")
            and p.layout.tp == 1]
    rows, fsdp = sorted(same, key=lambda p: p.layout.fully_shard)
    assert not rows.layout.fully_shard and fsdp.layout.fully_shard
    assert fsdp.memory.peak < rows.memory.peak and fsdp.last_step.seconds > rows.last_step.seconds
    assert plan.ranked.index(rows) < plan.ranked.index(fsdp)
    assert not any(p.layout.fully_shard and p.layout.tp > 1 for p in plan.ranked)


def test_a_tensor_parallel_plan_of_a_full_sharding_config_is_one_line():
    with pytest.raises(UserError, match="FSDP2.*TP=2 is not possible"):
        plan_run(load_train_config(V1_5, FSDP), RunSettings(gpu=gpu_spec("b200"), gpus=8, tp=2))


def test_imported_weights_land_in_the_rows_and_gather_whole():
    """`checkpoint.init_from` with `mimir import` weights into a fully sharded model (one rank),
    and the trainer's evaluation block: every weight whole (a plain tensor), sharded again after."""
    import torch
    import torch.distributed as dist
    from conftest import tiny_config
    from torch.distributed.tensor import DTensor

    from mimir_megatron.model import build_model
    from mimir_megatron.model.state import gather_full_state, load_full_state
    from mimir_megatron.train.fsdp import wrap_fully_sharded

    reference = build_model(tiny_config())
    model = build_model(tiny_config("seed=7"))
    fsdp = wrap_fully_sharded(model, dist.group.WORLD, torch.device("cpu"))
    assert not torch.equal(model.head.weight.to_local(), reference.head.weight.detach())  # another seed
    load_full_state(model, gather_full_state(reference))
    weights = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and torch.equal(param.to_local(), weights[name].detach()), name
    with fsdp.gathered():
        for name, param in model.named_parameters():
            assert not isinstance(param, DTensor) and torch.equal(param.detach(), weights[name].detach()), name
    assert all(isinstance(p, DTensor) for p in model.parameters())
