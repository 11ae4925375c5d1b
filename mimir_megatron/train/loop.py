"""The training loop, top to bottom: set-up, the step, logging, checkpoints, pre-emption.

Composed of megatron-core pieces: parallel state, DDP (gradient buffers and the data-parallel
reduction), dist_checkpointing; the schedules, optimizer groups and tracking are ours.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mimir_megatron import backend, parallel
from mimir_megatron import checkpoint as ckpt
from mimir_megatron.errors import NonFiniteTraining
from mimir_megatron.stop_signals import STOP_SIGNALS, take_early
from mimir_megatron.train.config import TrainConfig, flatten
from mimir_megatron.train.flops import attended_keys_per_token, flops_per_token
from mimir_megatron.train.optim import EMA, build_optimizer, clip_, grad_norm, optimizer_step
from mimir_megatron.train.schedules import plan_step
from mimir_megatron.train.tracking import SystemMetrics, Tracker, host_tags

log = logging.getLogger("mimir.train")

FAULT_ENV = "MIMIR_TEST_FAULTS"
"""Test-only fault injection: ``"3:grad,5:loss"`` makes step 3's gradient norm and step 5's loss
(1-based steps) non-finite on every rank, to test ``train.on_nonfinite``."""


@dataclass
class TrainResult:
    final_step: int
    losses: list[float] = field(default_factory=list)
    """Loss of every step this process ran (global mean over the batch)."""
    preempted: bool = False
    exact_match: float | None = None
    run_id: str | None = None
    checkpoint: str | None = None


class _StopFlag:
    """Set by SIGTERM/SIGUSR1; checked (and agreed on by all ranks) after each step."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        for signum in take_early():  # arrived while the CLI was still importing
            self._handle(signum, None)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.raised = True
        log.warning("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.raised else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def train(cfg: TrainConfig, stop_at_step: int | None = None) -> TrainResult:
    """Run (or resume) a training run described by ``cfg``; collective over all ranks.

    ``stop_at_step`` ends this invocation early, with a checkpoint, as a pre-emption would
    (the schedules still span ``cfg.train.steps``): how resume is tested.
    """
    # Handlers first: a pre-emption signal during start-up must not kill a rank.
    stop = _StopFlag()
    stop.install()
    try:
        return _train(cfg, stop, stop_at_step)
    finally:
        stop.uninstall()


def _train(cfg: TrainConfig, stop: _StopFlag, stop_at_step: int | None) -> TrainResult:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mimir_megatron.data import (
        PackedMixture,
        build_train_loader,
        load_eval_samples,
        mixture_fingerprint,
    )
    from mimir_megatron.data.prefetch import DevicePrefetcher
    from mimir_megatron.model import build_model

    env = parallel.init_distributed()
    cfg.validate(world_size=env.world_size)
    parallel.init_model_parallel(cfg.model.tensor_parallel_size)
    rank, device = env.rank, backend.device()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    accumulation = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
    run_dir, ckpt_dir = cfg.run_dir, cfg.checkpoint_dir

    if rank == 0:
        ckpt.check_writable(ckpt_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(cfg.to_dict()), run_dir / "config.yaml")
    dist.barrier()

    # -- model, optimizer, state ---------------------------------------------------------------
    model = build_model(cfg.model)
    ddp = DistributedDataParallel(
        model.config,
        # No overlap: L and H run several times per step, so a parameter's gradient is complete
        # only after the whole backward pass.
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=False),
        model,
    )
    optimizer = build_optimizer(model, cfg.optim, dp_group=dp_group,
                                shard=cfg.optim.shard_state and dp_size > 1)
    ema = EMA(model, cfg.optim.ema_decay) if cfg.optim.ema_decay > 0 else None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fingerprint = mixture_fingerprint(cfg.data)

    step, consumed, run_id, parent_run_id, config_changes = 0, 0, None, None, []
    resume_from = _resume_path(cfg, ckpt_dir)
    if resume_from is not None:
        config_changes = ckpt.check_resumable(ckpt.read_trainer_state(resume_from), cfg, resume_from,
                                              fingerprint)
        state = ckpt.load_checkpoint(resume_from, model, optimizer, ema)
        step, consumed, run_id = state["step"], state["consumed_samples"], state.get("mlflow_run_id")
        log.info("resumed from %s at step %d", resume_from, step)
        if config_changes:
            log.warning("resuming with a changed configuration (allowed): %s", "; ".join(config_changes))
    elif cfg.checkpoint.init_from:
        parent_run_id = _init_weights(cfg, model, optimizer, ema)
    if rank == 0:  # checkpoints after the start step belong to an abandoned timeline
        ckpt.set_aside_newer(ckpt_dir, step, resume_from)
    dist.barrier()

    # -- data, tracking, signals ---------------------------------------------------------------
    # The packing index is built once, by rank 0, up to the epoch being resumed; the other
    # ranks then read it from its cache instead of each building it (minutes at 100B tokens).
    if rank == 0:
        PackedMixture(cfg.data).locate(consumed)
    dist.barrier()
    loader = build_train_loader(cfg.data, micro_batch_size=cfg.train.micro_batch_size,
                                dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed)
    if cfg.data.prefetch:
        loader = DevicePrefetcher(loader, device, cfg.data.prefetch)
    eval_samples = []
    if cfg.data.eval_path:
        eval_samples = _eval_subset(load_eval_samples(cfg.data.eval_path), cfg.eval.max_samples)
    tracker = Tracker(cfg.tracking.uri, run_dir, cfg.tracking.experiment,
                      enabled=cfg.tracking.enabled and rank == 0,
                      retry_seconds=cfg.tracking.retry_seconds)
    layout = f"TP={cfg.model.tensor_parallel_size} DP={dp_size} SP={cfg.model.uses_sequence_parallel}"
    tags = host_tags(env.world_size, layout) | {"data_fingerprint": fingerprint, "config": cfg.source}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    if config_changes:
        tags[f"config_changed_at_step_{step}"] = "; ".join(config_changes)[:5000]
    tracker.start(cfg.run.name, flatten(cfg.to_dict()), tags, resume_run_id=run_id)
    system = _start_system_metrics(cfg, tracker, env.local_rank)

    result = TrainResult(final_step=step, run_id=tracker.run_id)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                if backend.has_gpu() and cfg.train.precision in ("auto", "bf16") else nullcontext())
    log.info("training %s: %d steps, global batch %d x %d tokens, %s, accumulation %d",
             cfg.run.name, cfg.train.steps, cfg.train.global_batch_size, cfg.data.seq_len, layout,
             accumulation)

    def on_saved(path: Path) -> None:  # once the checkpoint is complete on every rank
        tracker.set_tags({"checkpoint.latest": str(path.resolve())})
        result.checkpoint = str(path)
        log.info("checkpoint saved: %s", path)

    writer = ckpt.CheckpointWriter(ckpt_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, on_saved)

    def save(at_step: int) -> None:
        trainer_state = {
            "step": at_step,
            "consumed_samples": consumed,
            "window_k": plan.window.k if at_step else None,
            "optimizer_group_steps": ckpt.optimizer_group_steps(optimizer, dp_group),
            "data_fingerprint": fingerprint,
            "model": asdict(cfg.model),
            "padded_vocab_size": cfg.model.padded_vocab_size,
            "mlflow_run_id": tracker.run_id,
            "config": cfg.to_dict(),
        }
        writer.save(at_step, model, optimizer, ema, trainer_state)

    # -- the loop ------------------------------------------------------------------------------
    first_step = step
    faults = _injected_faults()
    nonfinite_in_a_row = 0
    try:
        while step < cfg.train.steps:
            started = time.perf_counter()
            plan = plan_step(step, cfg)
            micro_batches = [next(loader).to(device) for _ in range(accumulation)]
            supervised = torch.stack([mb.num_supervised() for mb in micro_batches]).sum().to(device)
            attended = torch.stack([attended_keys_per_token(mb.segment_ids, mb.prefix_mask)
                                    for mb in micro_batches]).mean()  # for TFLOP/s
            dist.all_reduce(supervised, group=dp_group)

            ddp.zero_grad_buffer()
            loss_sum = torch.zeros((), device=device)
            for mb in micro_batches:
                with autocast:
                    # The loader's batches are checked on this process's first step only: the
                    # checks (token ranges) cost host syncs that a GPU step should not pay.
                    out = ddp(mb, window=plan.window.k, num_supervised=supervised,
                              return_logits=False, validate=step == first_step)
                out.loss.backward()
                loss_sum += out.loss.detach().float()
            ddp.finish_grad_sync()
            dist.all_reduce(loss_sum, group=dp_group)
            _inject_fault(faults.get(step + 1), loss_sum, params)

            norm = grad_norm(params)
            # Loss and norm are the same on every rank (all-reduced), so all ranks decide alike.
            finite = math.isfinite(loss_sum.item()) and math.isfinite(norm.item())
            nonfinite_in_a_row = 0 if finite else nonfinite_in_a_row + 1
            if not finite:
                what = f"step {step + 1}: loss {loss_sum.item()}, gradient norm {norm.item()}"
                if cfg.train.on_nonfinite == "stop" or nonfinite_in_a_row > cfg.train.max_nonfinite_skips:
                    if step > first_step and step % cfg.checkpoint.interval:
                        save(step)  # the weights are still those before the bad step
                    writer.wait()  # the last good state is on disk before the job ends
                    raise NonFiniteTraining(
                        f"non-finite {what} ({nonfinite_in_a_row} in a row, train.on_nonfinite="
                        f"{cfg.train.on_nonfinite}); training stopped; last good state: step {step}"
                        + (f" ({ckpt_dir})" if step > first_step else ""))
                log.warning("non-finite %s: step skipped (no update), %d in a row", what,
                            nonfinite_in_a_row)
            else:
                clip_(params, norm, cfg.optim.clip_grad)
                optimizer_step(optimizer, plan)
                if ema is not None:
                    ema.update(model)
            step += 1
            consumed += cfg.train.global_batch_size
            elapsed = time.perf_counter() - started

            loss = loss_sum.item()
            result.losses.append(loss)
            result.final_step = step
            _log_step(tracker, cfg, step, plan, loss, norm.item(), supervised.item(),
                      tokens_per_step, elapsed, dp_size * cfg.model.tensor_parallel_size,
                      attended.item(), skipped=not finite)

            writer.poll()
            if step % cfg.checkpoint.interval == 0 or step == cfg.train.steps:
                save(step)
            periodic_eval = cfg.eval.interval and step % cfg.eval.interval == 0
            if (eval_samples or cfg.eval.suite) and periodic_eval and step < cfg.train.steps:
                _evaluate(model, eval_samples, cfg, device, dp_rank, dp_size, dp_group, tracker, step)
            if stop.agreed(device) or step == stop_at_step:
                if step % cfg.checkpoint.interval and step != cfg.train.steps:
                    save(step)
                writer.wait()
                log.warning("pre-empted: checkpoint saved at step %d", step)
                result.preempted = True
                break
        writer.wait()
        if not result.preempted:
            log.info("training done at step %d", step)
        if not result.preempted and (eval_samples or cfg.eval.suite):
            result.exact_match = _evaluate(model, eval_samples, cfg, device, dp_rank, dp_size,
                                           dp_group, tracker, step)
    except BaseException:
        writer.abort()
        if system is not None:
            system.close()
        tracker.close(status="FAILED", wait_seconds=5)
        raise
    finally:
        if isinstance(loader, DevicePrefetcher):
            loader.close()
    if system is not None:
        system.close()
    tracker.close(status="KILLED" if result.preempted else "FINISHED",
                  wait_seconds=cfg.tracking.final_flush_seconds)
    result.run_id = tracker.run_id
    return result


def _start_system_metrics(cfg: TrainConfig, tracker: Tracker, local_rank: int) -> SystemMetrics | None:
    """MLflow system metrics from local rank 0 of each node, into rank 0's run; collective."""
    if not (cfg.tracking.enabled and cfg.tracking.system_metrics):
        return None
    shared = [tracker.run_id, tracker.uri]
    dist.broadcast_object_list(shared, src=0)  # the run exists on rank 0 only
    run_id, uri = shared
    first_on_node = torch.tensor([float(local_rank == 0)], device=backend.device())
    dist.all_reduce(first_on_node)
    nodes = int(first_on_node.item())
    if local_rank != 0 or run_id is None:  # None: MLflow was unreachable at the start
        return None
    import socket

    return SystemMetrics(uri, run_id, cfg.tracking.system_metrics_interval,
                         node_id=socket.gethostname() if nodes > 1 else None)


def _resume_path(cfg: TrainConfig, ckpt_dir: Path) -> Path | None:
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        return ckpt.latest_checkpoint(ckpt_dir)
    return ckpt.resolve(mode)  # a step_N directory, or a checkpoints directory's latest


def _init_weights(cfg: TrainConfig, model, optimizer, ema) -> str | None:
    """Continued training: weights from a checkpoint or from project weights (`mimir import`)."""
    from mimir_megatron.interop import CONFIG_FILE, read_safetensors_dir
    from mimir_megatron.model.state import load_full_state

    source = Path(cfg.checkpoint.init_from)
    if (source / CONFIG_FILE).is_file():
        load_full_state(model, read_safetensors_dir(source), source=str(source))
        parent = None
    else:  # a new run: its own seed decides the RNG, not the source run's
        state = ckpt.load_checkpoint(ckpt.resolve(source), model,
                                     optimizer if cfg.checkpoint.keep_optimizer else None, ema,
                                     restore_rng=False)
        parent = state.get("mlflow_run_id")
    if ema is not None and not (cfg.checkpoint.keep_optimizer and parent is not None):
        ema.shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    log.info("initialised weights from %s (optimizer %s)", source,
             "kept" if cfg.checkpoint.keep_optimizer else "reset")
    return parent


def _log_step(tracker: Tracker, cfg: TrainConfig, step: int, plan, loss: float, norm: float,
              supervised: float, tokens: int, seconds: float, devices: int,
              attended_keys: float, skipped: bool = False) -> None:
    flops = flops_per_token(cfg.model, plan.window.k_L, plan.window.k_H, cfg.data.seq_len,
                            attended_keys=attended_keys) * tokens
    tflops_per_device = flops / seconds / devices / 1e12
    metrics = {
        "loss": loss,
        "grad_norm": norm,
        "window_k": plan.window.k,
        "k_L": plan.window.k_L,
        "k_H": plan.window.k_H,
        "supervised_tokens": supervised,
        "tokens_per_s": tokens / seconds,
        "tflops_per_device": tflops_per_device,
        "step_time_s": seconds,
        "peak_memory_gb": backend.peak_memory_gb(),
        "nonfinite_skip": float(skipped),  # its sum over a run is the number of skipped steps
        **{f"lr/{g}": lr for g, lr in plan.group_lr.items()},
    }
    if cfg.train.peak_tflops:
        metrics["mfu"] = tflops_per_device / cfg.train.peak_tflops
    tracker.log_metrics(step, metrics)
    if step % cfg.train.log_interval == 0 or step == 1:
        log.info("step %d/%d loss %.4f k=%d (L%d H%d) lr %.2e gnorm %.3f %.0f tok/s %.3f TFLOP/s/dev",
                 step, cfg.train.steps, loss, plan.window.k, plan.window.k_L, plan.window.k_H,
                 plan.lr, norm, tokens / seconds, tflops_per_device)


def _injected_faults() -> dict[int, str]:
    """``{step: "loss" | "grad"}`` from :data:`FAULT_ENV` (tests only; empty otherwise)."""
    faults = {}
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        at, kind = item.split(":")
        if kind not in ("loss", "grad"):
            raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r} (loss or grad)")
        faults[int(at)] = kind
    return faults


def _inject_fault(kind: str | None, loss_sum: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    if kind == "loss":
        loss_sum.fill_(float("nan"))
    elif kind == "grad":
        params[0].main_grad.view(-1)[0] = float("inf")


def _eval_subset(samples: list, limit: int) -> list:
    """Evenly spaced samples: held-out files are often grouped by task, so a prefix would not do."""
    if limit <= 0:
        return []
    stride = max(1, len(samples) // limit)
    return samples[::stride][:limit]


def _evaluate(model, samples, cfg: TrainConfig, device, dp_rank, dp_size, dp_group,
              tracker: Tracker, step: int) -> float | None:
    """Held-out exact match (every rank shares the samples) and the benchmark suite (rank 0)."""
    from mimir_megatron.train.evaluate import eval_stop_ids, exact_match, suite_scores

    score = None
    if samples:
        score, count = exact_match(model, samples, max_new_tokens=cfg.eval.max_new_tokens,
                                   device=device, dp_rank=dp_rank, dp_size=dp_size, dp_group=dp_group,
                                   stop_token_ids=eval_stop_ids(cfg.data.eval_path))
        tracker.log_metrics(step, {"eval/exact_match": score})
        log.info("step %d: exact match %.3f on %d held-out samples", step, score, count)
    if cfg.eval.suite:
        if dist.get_rank() == 0:
            metrics = suite_scores(model, cfg, Path(cfg.run.dir) / "eval_logs" / f"step_{step:07d}")
            tracker.log_metrics(step, metrics)
            log.info("step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())))
        dist.barrier()  # the other ranks wait for rank 0's suite
    return score
