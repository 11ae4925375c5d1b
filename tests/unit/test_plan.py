"""`mimir plan`: each memory term against hand arithmetic, the paper's v1 run, bad input.

The memory terms are checked against numbers worked out by hand in the comments (not by calling
the planner's own helpers); tests/integration/test_plan_memory.py checks the model against the
memory a real training step allocates.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, TINY

from mimir_megatron.cli import main
from mimir_megatron.config import load_config
from mimir_megatron.errors import UserError
from mimir_megatron.gpus import gpu_spec, shipped_gpus, spec_for_device
from mimir_megatron.train.plan.layouts import RunSettings, plan_run, plan_stages, window_phases
from mimir_megatron.train.plan.memory import StepShape, plan_memory
from mimir_megatron.train.config import load_train_config

pytestmark = pytest.mark.timeout(30)

V1 = REPO / "configs" / "train" / "mimir_v1.yaml"
V1_5 = REPO / "configs" / "train" / "mimir_v1_5.yaml"

# The tiny shape (configs/model/tiny.yaml): D=256, F=768, 4 heads, 2 + 2 layers, vocab 1024.
# One layer: q, k, v and gate 4 * 256^2 = 262,144; proj 65,536; fc1 2 * 768 * 256 = 393,216;
# fc2 196,608; together 917,504. Four layers 3,670,016; embedding = head = 1024 * 256 = 262,144;
# all 4,194,304 weights.
TINY_WEIGHTS = 4_194_304


def tiny_shape(**changes) -> StepShape:
    # 2 contexts of 64 tokens, window k=5 (HLLLH: 3 L + 2 H applications), fp32 on CPU.
    values = dict(micro_batch=2, seq_len=64, tp=1, dp=1, k_L=3, k_H=2, recompute="none",
                  compute_bytes=4, on_gpu=False, shard_optimizer=True, ema=True,
                  loss_chunk_tokens=0, sequence_parallel=True, attention="flex")
    return StepShape(**{**values, **changes})


@pytest.fixture(scope="module")
def tiny():
    return load_config(TINY, [])


def test_static_terms_by_hand(tiny):
    m = plan_memory(tiny, tiny_shape())
    assert m.weights == 4 * TINY_WEIGHTS + 4 * 256  # fp32, plus the z_L_init buffer
    assert m.gradients == 4 * TINY_WEIGHTS  # DDP's fp32 buffer
    assert m.optimizer == 8 * TINY_WEIGHTS  # two fp32 moments, one DP rank: nothing sharded
    assert m.master_weights == 0  # the fp32 weights are the master copy
    assert m.ema == 4 * TINY_WEIGHTS
    # After backward: the norm's scratch (the largest tensor, fc1's 393,216, fp32), then Adam
    # tensor by tensor on a CPU (two fp32 temporaries of the largest): one after the other.
    assert m.optimizer_phase == {"grad_norm": 393_216 * 4, "adam": 2 * 393_216 * 4}


def test_zero_shards_whole_tensors_greedily(tiny):
    # DP=3, groups embedding, head, L, H; tensors largest first to the least-loaded rank:
    # emb -> r0 262,144; head -> r1 262,144; L: 393,216 -> r2; 393,216 -> r0 (655,360);
    # 262,144 -> r1 (524,288); 262,144 -> r2 (655,360); 196,608 -> r1 (720,896);
    # 196,608 -> r0 (851,968); 65,536 -> r2 (720,896); 65,536 -> r1 (786,432). H: 393,216 -> r2
    # (1,114,112); 393,216 -> r1 (1,179,648); 262,144 -> r0 (1,114,112); 262,144 -> r0
    # (1,376,256); 196,608 -> r2 (1,310,720); 196,608 -> r1 (1,376,256); 65,536 -> r2
    # (1,376,256); 65,536 -> r0 (1,441,792). Largest rank: 1,441,792 weights, not 4,194,304 / 3.
    assert plan_memory(tiny, tiny_shape(dp=3)).optimizer == 8 * 1_441_792
    assert plan_memory(tiny, tiny_shape(dp=3, shard_optimizer=False)).optimizer == 8 * TINY_WEIGHTS


def test_distributed_optimizer_keeps_rows_evenly_by_hand(tiny):
    """bf16 weights, fp32 gradients, and per data-parallel rank its rows of every tensor: fp32 main
    weights, Adam's two moments, the EMA (Megatron's 2 + 4 + 16 / DP bytes a weight)."""
    m = plan_memory(tiny, tiny_shape(dp=2, params_bytes=2, distributed_optimizer=True))
    assert m.weights == 2 * (TINY_WEIGHTS + 256)  # bf16, and the bf16 z_L_init buffer
    assert m.gradients == 4 * TINY_WEIGHTS
    # Every tensor's rows (1,024, 256, 1,536, 256) split in two: 2,097,152 weights a rank.
    assert (m.master_weights, m.optimizer, m.ema) == (4 * 2_097_152, 8 * 2_097_152, 4 * 2_097_152)
    # DP=3: rows 1,024 -> 341, 341, 342; 256 -> 85, 85, 86; 1,536 -> 512 each. Rank 2 keeps the
    # most: embedding and head 342 x 256 = 87,552 each; a layer: qkv 87,552 + proj 86 x 256 =
    # 22,016 + fc1 512 x 256 = 131,072 + fc2 86 x 768 = 66,048 = 306,688; four 1,226,752;
    # 1,401,856 in all (4,194,304 / 3 = 1,398,101; ZeRO-1 by whole tensors: 1,441,792).
    three = plan_memory(tiny, tiny_shape(dp=3, params_bytes=2, distributed_optimizer=True))
    assert three.optimizer == 8 * 1_401_856 and three.master_weights == 4 * 1_401_856
    # CPU: the norm over rank 2's reduce-scattered rows and Adam tensor by tensor over them (the
    # largest: fc1's 131,072, fp32), then the all-gather's bf16 copy of them.
    assert three.optimizer_phase == {"grad_norm": 4 * 131_072, "adam": 8 * 131_072, "gather": 2 * 131_072}
    # fp32 weights: the main weights are views of them (no copy); the EMA is by rows still.
    fp32 = plan_memory(tiny, tiny_shape(dp=2, distributed_optimizer=True))
    assert (fp32.weights, fp32.master_weights, fp32.ema) == (4 * (TINY_WEIGHTS + 256), 0, 4 * 2_097_152)
    # On a GPU, bf16 weights need no autocast copies, and the head's gradient comes in bf16.
    gpu = plan_memory(tiny, tiny_shape(dp=2, params_bytes=2, distributed_optimizer=True, on_gpu=True,
                                       compute_bytes=2)).temporaries
    assert "autocast_weights" not in gpu and gpu["head_grad"] == 2 * 262_144


def test_distributed_optimizer_gathers_bf16_rows_by_hand():
    """The step's DP bytes: the fp32 gradients reduce-scattered (not all-reduced), then an
    all-gather of the updated bf16 rows instead of ZeRO-1's fp32 broadcast:
    (7/8 x 4 + 7/8 x 2) x 1,786,773,504 a GPU."""
    cfg = load_train_config(V1, ["optim.distributed_optimizer=true", "model.params_dtype=bfloat16"])
    final = plan_run(cfg, RunSettings(gpu=gpu_spec("b200"), gpus=8)).configured.last_step
    assert final.dp_bytes == 9_380_560_896


def test_activation_terms_by_hand(tiny):
    # Per token of one layer application, fp32 (4 bytes): layer input + mid residual (2 * 256)
    # + two rsqrt = 514 -> 2,056 B; both norm outputs 512 -> 2,048 B; q and k after RoPE (512),
    # v (256; copied out of the fused projection, which is then freed), the attention output,
    # the gate's sigmoid, the gated product (768), fc1 (1,536), SwiGLU's output (768; its silu is
    # recomputed in backward) = 3,840 -> 15,360 B; log-sum-exp 4 heads -> 16 B. 19,480 B x 128
    # tokens = 2,493,440 per layer application; 10 of them (3 L + 2 H applications x 2 layers) =
    # 24,934,400; exit norms 5 x 128 x 257 x 4 = 657,920.
    m = plan_memory(tiny, tiny_shape())
    assert m.activations == 24_934_400 + 657_920
    # Full recompute keeps each layer's input: 10 x 128 x 256 x 4 = 1,310,720, + exit norms.
    assert plan_memory(tiny, tiny_shape(recompute="full")).activations == 1_310_720 + 657_920
    # Selective: the checkpoint keeps q, k, v and the gate before RoPE (views of the fused
    # projection, 1,024), then the attention output, the sigmoid and the gated product (768),
    # fc1 and SwiGLU's output (2,304): 4,096 -> 16,384 B, no log-sum-exp; 20,488 B a token, and
    # megatron's checkpoint keeps the mask type as a 4-byte tensor per layer application.
    assert plan_memory(tiny, tiny_shape(recompute="selective")).activations == \
        10 * (128 * 20_488 + 4) + 657_920
    # Dense attention: SDPA keeps an additive copy of the 2 x 64 x 64 mask per layer application
    # in the query's dtype (fp32 here, bf16 with bf16 weights).
    assert plan_memory(tiny, tiny_shape(attention="dense")).activations == \
        24_934_400 + 657_920 + 10 * 2 * 64 * 64 * 4
    bf16_dense = tiny_shape(compute_bytes=2, params_bytes=2, attention="dense")
    assert plan_memory(tiny, bf16_dense).activations == 10 * (1_248_256 + 2 * 64 * 64 * 2) + 330_240
    # k=2 (L H): 2 applications x 2 layers.
    assert plan_memory(tiny, tiny_shape(k_L=1, k_H=1)).activations == 4 * 2_493_440 + 2 * 128 * 257 * 4
    # bf16 weights: the residual stream is bf16 and the norms keep it as it is (not an fp32
    # copy): 2 x 256 x 2 + two fp32 rsqrt 8 = 1,032 B; matmul inputs 1,024; TP region with the
    # gate in place of its sigmoid (recomputed in backward, model/gate.py) 3,840 x 2 = 7,680,
    # log-sum-exp 16: 9,752 B x 128 = 1,248,256 a layer application; exit norms
    # 5 x 128 x (256 x 2 + 4) = 330,240. Full recompute keeps the bf16 layer input.
    bf16 = tiny_shape(compute_bytes=2, params_bytes=2)
    assert plan_memory(tiny, bf16).activations == 10 * 1_248_256 + 330_240
    assert plan_memory(tiny, tiny_shape(compute_bytes=2, params_bytes=2, recompute="full")).activations == \
        10 * 128 * 256 * 2 + 330_240
    # varlen: q once, k and v twice a token (the most: the plan's default), the passes' outputs
    # and their gather into token order, the gate and the gated product: 9 x 256 in place of
    # 6 x 256 (bf16: + 1,536 B a token); 1.5 keys a token: 8 x 256 (+ 1,024 B).
    assert plan_memory(tiny, tiny_shape(compute_bytes=2, params_bytes=2, attention="varlen")).activations \
        == 10 * 128 * (9_752 + 1_536) + 330_240
    assert plan_memory(tiny, tiny_shape(compute_bytes=2, params_bytes=2, attention="varlen",
                                        varlen_keys=1.5)).activations == 10 * 128 * (9_752 + 1_024) + 330_240


def test_the_mimir_layer_keeps_what_megatron_would():
    """The paper's layer (D 1,536, F 4,096, 12 heads) in bf16 with flex attention keeps per token
    what Megatron keeps of such a layer with flash attention: its input and mid-layer residual,
    both norm outputs (2 x 2 x 1,536 each), q, k, v, the gate, the attention output, the gated
    product (6 x 1,536 x 2), fc1's output and SwiGLU's (3 x 4,096 x 2), two fp32 rsqrt, the
    log-sum-exp (12 x 4): 2 x (10 x 1,536 + 3 x 4,096) + 8 + 48 = 55,352 B (was 61,496: the q and
    k before RoPE were held twice, as views of the fused projection)."""
    from mimir_megatron.train.plan.memory import layer_activation_bytes

    cfg = load_train_config(V1_5).model
    shape = StepShape(micro_batch=1, seq_len=1, tp=1, dp=8, k_L=6, k_H=2, compute_bytes=2, params_bytes=2)
    assert layer_activation_bytes(cfg, shape) == 2 * (10 * 1536 + 3 * 4096) + 8 + 48 == 55_352


def test_temporaries_by_hand(tiny):
    t = plan_memory(tiny, tiny_shape()).temporaries
    assert t["loss"] == 128 * 1024 * 4  # fp32 logits (cross-entropy and its gradient in place)
    assert t["backward"] == 2_493_440  # one layer application's working set
    assert t["head_grad"] == 262_144 * 4  # the head's fp32 weight gradient before DDP takes it
    assert "attention_mask" not in t
    assert plan_memory(tiny, tiny_shape(attention="dense")).temporaries["attention_mask"] == 2 * 64 * 64
    gpu = plan_memory(tiny, tiny_shape(compute_bytes=2, on_gpu=True)).temporaries
    assert gpu["loss"] == 128 * 1024 * (2 + 4)  # bf16 logits and their fp32 copy
    assert gpu["autocast_weights"] == 2 * (3_670_016 + 262_144)  # bf16 stacks and head
    # Chunked loss, 32 tokens a chunk: fp32 logits + bf16 matmul output of one chunk, the head's
    # fp32 gradient, the hidden-state gradient (bf16).
    chunked = plan_memory(tiny, tiny_shape(compute_bytes=2, on_gpu=True, loss_chunk_tokens=32))
    assert chunked.temporaries["loss"] == 32 * 1024 * 6 + 262_144 * 4 + 128 * 256 * 2


def test_tensor_parallel_splits_every_term(tiny):
    one, two = plan_memory(tiny, tiny_shape()), plan_memory(tiny, tiny_shape(tp=2))
    # Vocab 1024 is already a multiple of 128 x 2: every weight halves.
    assert two.gradients == one.gradients / 2
    # Sequence parallel: every activation term halves too.
    assert two.activations == one.activations / 2


def test_gpu_table_ships_sources_and_matches_device_names():
    table = shipped_gpus()
    assert {"b200", "h200", "h100", "gb200"} <= set(table)
    assert all(spec.source for spec in table.values())
    assert table["b200"].memory_gb == 180 and table["b200"].bf16_tflops == 2250
    assert spec_for_device("NVIDIA H200").key == "h200"
    assert spec_for_device("NVIDIA GB200").key == "gb200"  # not B200: the longest match
    assert spec_for_device("Tesla T4") is None


@pytest.fixture(scope="module")
def v1_plan():
    cfg = load_train_config(V1)
    return plan_run(cfg, RunSettings(gpu=gpu_spec("b200"), gpus=8, mean_step_time_s=1.1))


def test_paper_v1_fits_and_costs_three_weeks(v1_plan):
    plan = v1_plan
    c = plan.configured
    assert (c.layout.tp, c.layout.dp, c.layout.micro_batch, c.layout.accumulation) == (1, 8, 4, 2)
    assert c.fits and c.memory.peak < 180e9
    final = c.last_step
    # 262,144 tokens x 20.1 GFLOP (k=5, matmuls) = 5.27 PFLOP a step.
    assert final.matmul_flops == pytest.approx(262_144 * 20.1e9, rel=0.005)
    # The paper's "just under 1.1 s a step" is the run's average (1.65M steps in just under 3
    # weeks), not the final window's: the whole schedule is 1.65M x 1.1 s = 21.0 days, and the
    # k=5 step is slower than the average (the first 20 % run k = 2, 3, 4).
    assert c.seconds == pytest.approx(1.65e6 * 1.1, rel=1e-9)
    assert c.seconds / 86_400 == pytest.approx(21.007, abs=0.001)
    assert final.seconds > 1.1
    assert plan.implied_mfu == pytest.approx(final.model_flops / final.seconds / 8 / 2250e12)
    # ~4,000 GPU-hours (1.65M x 1.1 s x 8 GPUs / 3,600 = 4,033), not the paper's 8,000.
    assert c.seconds * 8 / 3600 == pytest.approx(4033.3, abs=0.1)
    assert [(p.k, p.steps) for p in plan.phases] == [(2, 110_000), (3, 110_000), (4, 110_000),
                                                      (5, 1_320_000)]


def test_a_measured_step_is_the_final_windows():
    plan = plan_run(load_train_config(V1), RunSettings(gpu=gpu_spec("b200"), gpus=8, step_time_s=1.1))
    final = plan.configured.last_step
    assert final.seconds == pytest.approx(1.1, rel=1e-9)
    assert plan.implied_mfu == pytest.approx(final.model_flops / 1.1 / 8 / 2250e12)
    assert plan.configured.seconds < 1.65e6 * 1.1  # the smaller windows are faster


def test_nvlink_is_timed_one_way():
    """Datasheets give NVLink's bidirectional total (B200 1,800 GB/s, H100 900 GB/s); a ring
    all-reduce sends its bytes while it receives as many: 900 and 450 GB/s each way."""
    assert gpu_spec("b200").nvlink_gbps == 1800 and gpu_spec("b200").nvlink_one_way_gbps == 900
    assert gpu_spec("h100").nvlink_one_way_gbps == 450
    zero1 = ["model.params_dtype=float32", "optim.distributed_optimizer=false"]
    plan = plan_run(load_train_config(V1, zero1), RunSettings(gpu=gpu_spec("b200"), gpus=8))
    # DP=8, ZeRO-1: all-reduce 2 x 7/8 + broadcast 7/8 = 21/8 x 4 bytes x 1,786,773,504 weights
    # = 18,761,121,792 bytes a GPU sends, at 900 GB/s: 20.8 ms (not 10.4).
    final = plan.configured.last_step
    assert final.dp_bytes == 18_761_121_792
    assert final.dp_comm_s == pytest.approx(18_761_121_792 / 900e9, rel=1e-12)
    h100 = plan_run(load_train_config(V1, zero1), RunSettings(gpu=gpu_spec("h100"), gpus=8, margin=0.0,
                                                       tp=2, micro_batch=1))
    assert h100.configured.last_step.dp_comm_s == pytest.approx(
        h100.configured.last_step.dp_bytes / 450e9, rel=1e-12)


def test_the_efficiency_model_is_stated(capsys, tmp_path):
    assert main(["plan", "--config", str(V1), "--gpus", "8", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "dependence on the micro-batch (smaller matmuls run further from peak) is not modelled" in out
    assert "not modelled" in json.loads((tmp_path / "p.json").read_text())["efficiency_model"]


@pytest.mark.parametrize("config", [V1, V1_5], ids=["v1", "v1_5"])
def test_the_papers_shipped_configs_fit_8_b200_at_the_fastest_planned_speed(config):
    """Both at the paper's 4 x 4,096 per GPU, accumulation 2: v1.5's window reaches k=8, where
    fp32 weights with ZeRO-1 were planned at 201.5 GB; bf16 weights with the distributed
    optimizer, the recomputed silu and gate sigmoid and the norms' bf16 inputs bring it to ~150 GB."""
    plan = plan_run(load_train_config(config), RunSettings(gpu=gpu_spec("b200"), gpus=8, efficiency=0.3062))
    configured = plan.configured
    assert (configured.layout.micro_batch, configured.layout.accumulation) == (4, 2)
    assert configured.fits and configured.memory.peak < 0.9 * 180e9
    assert configured.tokens_per_s == pytest.approx(plan.ranked[0].tokens_per_s)


def test_a_layout_that_cannot_fit_is_reported_with_its_numbers(tmp_path, capsys):
    # 16 x 4,096 tokens per GPU at k=8 without recompute.
    argv = ["plan", "--config", str(V1), "--gpus", "8", "--gpu", "b200", "--json", str(tmp_path / "p.json"),
            "train.micro_batch_size=16", "train.global_batch_size=128", "window.schedule=constant",
            "window.k=8"]
    assert main(argv) == 1  # a job script gates on it: `mimir plan ... && sbatch ...`
    plan = json.loads((tmp_path / "p.json").read_text())
    configured = plan["configured"]
    assert (configured["micro_batch"], configured["accumulation"], configured["fits"]) == (16, 1, False)
    assert configured["memory_gb"]["peak"] > 180
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert plan["layouts"] and all(layout["fits"] for layout in plan["layouts"])


def test_v1_5_grows_the_window_to_8():
    phases = window_phases(load_train_config(V1_5))
    assert [(p.k, p.k_L, p.k_H) for p in phases] == [(5, 3, 2), (6, 4, 2), (7, 5, 2), (8, 6, 2)]
    assert sum(p.steps for p in phases) == 1_200_000


@pytest.mark.parametrize("args,words", [
    (["--gpu", "b300"], "unknown GPU 'b300'"),
    (["--micro-batch", "3"], "is not a multiple of micro-batch 3 x DP 8; closest layout that fits: TP=1 DP=8 micro 4"),
    (["--tp", "16"], "TP=16 is not possible for 12 heads"),
    (["--gpus", "1", "--gpu", "a100", "data.seq_len=131072"], "fits no layout on 1 x A100"),
    (["--margin", "1.5"], "--margin is the share of GPU memory kept free, in [0, 0.5]; got 1.5"),
    (["--margin", "-0.1"], "in [0, 0.5]; got -0.1"),
    (["--gpus", "3"], "train.global_batch_size (64) does not split over 3 GPUs: it must be a multiple "
     "of DP = GPUs / TP (DP 3 for TP 1)"),
    (["--gpus", "6"], "does not split over 6 GPUs: it must be a multiple of DP = GPUs / TP (DP 6, 3 for TP 1, 2)"),
    (["--step-time", "1.1", "--mean-step-time", "1.1"], "not both"),
    (["--mean-step-time", "0"], "--mean-step-time must be > 0"),
])
def test_bad_input_is_one_line(args, words, caplog):
    argv = ["plan", "--config", str(V1), "--gpus", "8", *args]
    argv = argv if "--gpus" not in args else ["plan", "--config", str(V1), *args]
    assert main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0] and words in errors[0], errors


def test_tp_too_large_names_the_closest_layout_that_fits():
    cfg = load_train_config(V1)
    with pytest.raises(UserError, match=r"allowed: 1, 2, 4\); closest layout that fits: TP=4 DP=2"):
        plan_run(cfg, RunSettings(gpu=gpu_spec("b200"), gpus=8, tp=16))


@pytest.mark.parametrize("args,status", [
    ([], 0),
    (["--margin", "0.5"], 1),  # 90 GB usable: v1.5's 4 x 4,096 at k=8 does not fit
    (["--gpu", "h100"], 1),  # 72 GB usable
    (["--config", str(V1), "--margin", "0.4"], 1),  # 108 GB: v1 fits, v1.5 (the first stage) not
    (["--gpu", "b300"], 2),  # bad input
])
def test_exit_status_says_whether_the_configured_layout_fits(args, status, capsys, caplog):
    assert main(["plan", "--config", str(V1_5), "--gpus", "8", *args]) == status
    if status == 1:
        assert "DOES NOT FIT" in capsys.readouterr().out
        assert "the configured layout does not fit (exit status 1)" in caplog.text


def test_stages_are_planned_one_after_the_other_and_summed(tmp_path, capsys):
    """v1 then v1.5 on 8 B200, the efficiency from v1's 1.1 s average: v1 is 1.65M x 1.1 s x 8
    GPUs / 3,600 = 4,033.3 GPU-hours; v1.5 runs at the efficiency v1 implies, so its k=5 steps
    (its first 40,000) take v1's k=5 step; the sum is the two stages' (the paper's ~8,000)."""
    argv = ["plan", "--config", str(V1), "--config", str(V1_5), "--gpus", "8", "--mean-step-time", "1.1",
            "--json", str(tmp_path / "p.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "p.json").read_text())
    v1, v1_5 = record["stages"]
    assert v1["gpu_hours"] == round(1.65e6 * 1.1 * 8 / 3600) == 4033
    assert v1_5["efficiency"] == v1["efficiency"] == record["efficiency"]
    cfgs = [load_train_config(V1), load_train_config(V1_5)]
    settings = RunSettings(gpu=gpu_spec("b200"), gpus=8, mean_step_time_s=1.1)
    first, second = plan_stages(cfgs, settings)
    k5_v1 = next(t for ph, t in first.configured.phases if ph.k == 5)
    k5_v1_5 = next(t for ph, t in second.configured.phases if ph.k == 5)
    assert k5_v1_5.seconds == pytest.approx(k5_v1.seconds, rel=1e-12)
    hours = [p.configured.seconds * 8 / 3600 for p in (first, second)]
    assert record["stages_total"]["gpu_hours"] == round(hours[0] + hours[1])
    assert 7_800 < record["stages_total"]["gpu_hours"] < 8_000  # the paper's "approx. 8,000"
    assert record["stages_total"]["days"] == round((first.configured.seconds + second.configured.seconds)
                                                   / 86_400, 2)
    assert f"total {'':<34} {2_850_000:>10,}" in out and f"{round(hours[0] + hours[1]):>8,}" in out
    # The shape of a single plan's record stays: the first stage's plan, with the stages added.
    assert record["config"] == str(V1) and record["configured"]["gpu_hours"] == 4033


def test_the_efficiency_is_printed_as_given_and_tokens_per_gpu_beside_the_clusters(capsys, tmp_path):
    argv = ["plan", "--config", str(V1), "--gpus", "8", "--efficiency", "0.3042", "--margin", "0.125",
            "--json", str(tmp_path / "p.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "efficiency assumed 30.42% of peak" in out and "at a 12.5% margin" in out
    configured = json.loads((tmp_path / "p.json").read_text())["configured"]
    per_gpu = configured["tokens_per_s"] / 8
    assert configured["tokens_per_s_per_gpu"] == pytest.approx(per_gpu, abs=0.1)
    assert f"{configured['tokens_per_s']:,.0f} tokens/s ({per_gpu:,.0f} a GPU)" in out


def test_train_start_up_plan_of_its_own_config(caplog):
    """One unit everywhere: the table's GB (1e9 bytes) are the params' and the metrics'."""
    from mimir_megatron.train.plan.memory import GB
    from mimir_megatron.train.plan.startup import plan_at_start

    cfg = load_train_config(V1, ["train.plan_gpu=b200"])
    with caplog.at_level("INFO", logger="mimir.plan"):
        startup = plan_at_start(cfg, world_size=8)
    assert "configured layout: TP=1 DP=8 micro 4x4096 accum 2" in caplog.text
    params = startup.params()
    assert params["plan.gpu"] == "b200" and params["plan.fits"] is True
    assert json.loads(startup.json())["configured"]["fits"] is True
    peak = startup.plan.configured.memory.peak
    assert f"peak {params['plan.peak_memory_gb']} of 162.0 usable" in caplog.text
    assert params["plan.peak_memory_gb"] == round(peak / 1e9, 1)
    assert json.loads(startup.json())["configured"]["memory_gb"]["peak"] == round(peak / 1e9, 3)
    # On a CPU the plan is logged, its figures not set beside the measured ones.
    assert not startup.compared and startup.metrics(5) == {}
    startup.compared = True
    metrics = startup.metrics(5)
    assert metrics["plan/peak_memory_gb"] == peak / GB == peak / 1e9
    assert metrics["plan/step_time_s"] > startup.metrics(2)["plan/step_time_s"]


def test_plan_gpu_auto_plans_for_the_gpu_found(monkeypatch, caplog):
    """``train.plan_gpu: auto`` (the paper's configs): the GPU table's row of the device's name,
    its figures beside the measured ones, one warning line naming both where a measured one is
    more than 10 % above the plan; nothing at all on a CPU."""
    from mimir_megatron import backend
    from mimir_megatron.train.plan.startup import plan_at_start

    cfg = load_train_config(V1_5)
    assert cfg.train.plan_gpu == "auto"
    monkeypatch.setattr(backend, "gpu_name", lambda: None)  # a CPU
    with caplog.at_level("INFO", logger="mimir.plan"):
        assert plan_at_start(cfg, world_size=8) is None
    assert caplog.text == ""

    monkeypatch.setattr(backend, "gpu_name", lambda: "NVIDIA B200")
    with caplog.at_level("INFO", logger="mimir.plan"):
        startup = plan_at_start(cfg, world_size=8)
    assert startup.plan.settings.gpu.key == "b200" and startup.compared
    assert "train.plan_gpu=auto: b200" in caplog.text
    peak, step = startup.planned(8)
    caplog.clear()
    with caplog.at_level("INFO", logger="mimir.plan"):
        startup.compare(1, 5, peak * 1.05, 100.0, first=True)  # warm-up: its time is not judged
        startup.compare(2, 8, peak * 1.05, step * 1.05, first=False)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert f"peak memory {peak * 1.05:.1f} GB measured, {peak:.1f} GB planned" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="mimir.plan"):
        startup.compare(3, 8, peak * 1.2, step * 1.3, first=False)
        startup.compare(4, 8, peak * 1.3, step * 1.4, first=False)  # said once
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert f"{peak * 1.2:.1f} GB measured is 20% above the plan's {peak:.1f} GB" in warnings[0]
    assert f"{step * 1.3:.3f} s measured is 30% above the plan's {step:.3f} s" in warnings[1]

    monkeypatch.setattr(backend, "gpu_name", lambda: "Tesla T4")
    caplog.clear()
    assert plan_at_start(cfg, world_size=8) is None
    assert "train.plan_gpu=auto: no plan: Tesla T4 is not in the GPU table" in caplog.text


def test_train_start_up_plan_that_cannot_be_made_is_a_warning(caplog):
    from mimir_megatron.train.plan.startup import plan_at_start

    cfg = load_train_config(V1, ["train.plan_gpu=h100"])
    assert plan_at_start(cfg, world_size=7) is None  # 64 contexts do not split over 7 ranks
    assert "no plan: train.global_batch_size (64) does not split over 7 GPUs" in caplog.text


def test_train_plan_gpu_is_checked_with_the_config():
    with pytest.raises(UserError, match="train.plan_gpu: unknown GPU 'x100'"):
        load_train_config(V1, ["train.plan_gpu=x100"])
