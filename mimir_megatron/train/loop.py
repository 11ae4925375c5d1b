"""The training loop, top to bottom: set-up, the step, logging, checkpoints, pre-emption.

Composed of megatron-core pieces: parallel state, DDP (gradient buffers and the data-parallel
reduction), dist_checkpointing; the schedules, optimizer groups and tracking are ours.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mimir_megatron import backend, parallel
from mimir_megatron import checkpoint as ckpt
from mimir_megatron.errors import NonFiniteTraining, UserError, write_error
from mimir_megatron.train.plan.startup import StartupPlan, plan_at_start
from mimir_megatron.stop_signals import STOP_SIGNALS, take_early
from mimir_megatron.train.config import TrainConfig, flatten
from mimir_megatron.train.flops import flops_per_token
from mimir_megatron.train.lineage import LineageCounter, earlier_training_problems
from mimir_megatron.train.resume import check_resumable, data_changed, resume_path, verified_resume
from mimir_megatron.train.run_lock import RunLock
from mimir_megatron.train.schedules import StepPlan, plan_step
from mimir_megatron.train.step import StepHooks, StepOutcome, Trainer, build_trainer, train_step
from mimir_megatron.train.tracking import (
    SystemMetrics,
    Tracker,
    host_tags,
    run_description,
    run_name,
    run_params,
)

log = logging.getLogger("mimir.train")


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
    """Set by SIGTERM/SIGUSR1; agreed on by all ranks in the next step's reduction, which then
    ends the run with a checkpoint."""

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



def train(cfg: TrainConfig, stop_at_step: int | None = None, hooks: StepHooks | None = None
          ) -> TrainResult:
    """Run (or resume) a training run described by ``cfg``; collective over all ranks.

    ``stop_at_step`` ends this invocation early, with a checkpoint, as a pre-emption would
    (the schedules still span ``cfg.train.steps``): how resume is tested. ``hooks`` reach into
    each step (tests inject faults there).
    """
    # Handlers first: a pre-emption signal during start-up must not kill a rank.
    stop = _StopFlag()
    stop.install()
    lock = RunLock(cfg.run_dir, private=cfg.run.private)
    try:
        run = _set_up(cfg, lock)
        return _loop(run, stop, stop_at_step, hooks)
    finally:
        lock.release()
        stop.uninstall()


@dataclass
class _Run:
    """Everything the loop works with, built by :func:`_set_up`."""

    cfg: TrainConfig
    trainer: Trainer
    loader: Any
    eval_samples: list
    tracker: Tracker
    system: SystemMetrics | None
    writer: ckpt.CheckpointWriter
    result: TrainResult
    fingerprint: str
    dp_rank: int
    dp_size: int
    accumulation: int
    step: int
    """Optimizer steps done (0 at the start of a run, the checkpoint's step on resume)."""
    consumed: int
    """Samples consumed by the steps done."""
    lineage: LineageCounter
    """What of each dataset the steps done consumed."""
    base_model: ckpt.BaseModel | None
    """The weights the run started from (``checkpoint.init_from``), kept across resumes."""
    resumed_from: Path | None
    """The checkpoint this invocation resumed from (None: a fresh start)."""
    plan: StartupPlan | None = None
    """`mimir plan`'s plan of this run (``train.plan_gpu``, rank 0)."""
    peak_tflops: float = 0.0
    """One device's peak for MFU (rank 0, which logs it; 0: no MFU)."""

    def save(self, at_step: int) -> None:
        """Checkpoint the current state as that after ``at_step`` steps (collective)."""
        cfg, t = self.cfg, self.trainer
        trainer_state = ckpt.TrainerState(
            step=at_step,
            consumed_samples=self.consumed,
            window_k=plan_step(at_step - 1, cfg).window.k if at_step else None,
            optimizer_group_steps=ckpt.optimizer_group_steps(t.optimizer, t.dp_group),
            data_fingerprint=self.fingerprint,
            model=cfg.model.shape_dict(),
            padded_vocab_size=cfg.model.padded_vocab_size,
            has_ema=t.ema is not None,
            mlflow_run_id=self.tracker.run_id,
            config=cfg.to_dict(),
            lineage=self.lineage.snapshot(t.dp_group),
            base_model=self.base_model,
            data_policy=self.lineage.policy,
        )
        self.writer.save(at_step, t.model, t.optimizer, t.ema, trainer_state)
        self.tracker.log_json([asdict(e) for e in trainer_state.lineage], "data/lineage.json")

    def evaluate(self) -> float | None:
        t = self.trainer
        with t.gathered():  # FSDP2's weights whole for decoding
            return _evaluate(t.model, self.eval_samples, self.cfg, t.device, self.dp_rank, self.dp_size,
                             t.dp_group, self.tracker, self.step)


@dataclass
class _Place:
    """Where this process sits: its launch ranks, its device and its data-parallel group."""

    env: parallel.LaunchEnv
    device: torch.device
    dp_rank: int
    dp_size: int
    dp_group: Any

    @property
    def rank(self) -> int:
        return self.env.rank


@dataclass
class _StartPoint:
    """Where this invocation starts: a fresh run, weights continued from ``checkpoint.init_from``,
    or a resumed checkpoint."""

    step: int = 0
    consumed: int = 0
    run_id: str | None = None
    """The MLflow run a resumed run continues."""
    parent_run_id: str | None = None
    """The MLflow run of the weights a continued training started from."""
    config_changes: list[str] = field(default_factory=list)
    data_changed: bool = False
    lineage: tuple = ()
    base_model: ckpt.BaseModel | None = None
    resumed_from: Path | None = None


def _set_up(cfg: TrainConfig, lock: RunLock) -> _Run:
    """The steps before the first training step, in order; collective over all ranks."""
    from mimir_megatron.checkpoint.load import start_collective_verification
    from mimir_megatron.data import PackedMixture

    env = _start_process_group(cfg)
    _lock_run_directory(lock, env.rank)
    mixture = _admit_training_data(cfg, env)
    stream = PackedMixture(cfg.data, mixture)
    place = _init_model_parallel(cfg, env)
    _save_run_config(cfg, place.rank)
    # The checkpoint's files are hashed (each rank a share) while the model is built.
    resume_from = resume_path(cfg)
    verification = start_collective_verification(resume_from) if resume_from is not None else None
    trainer = _build_trainer(cfg, place)
    start = _restore_state(cfg, trainer, resume_from, verification, stream.fingerprint, place.rank)
    loader = _train_loader(cfg, stream, place, start.consumed)
    eval_samples = _held_out_samples(cfg)
    lineage = LineageCounter(mixture, start.lineage)
    tracker = _open_tracker(cfg, place.rank)
    plan = _plan_this_run(cfg, env)
    peak, peak_source = _peak_tflops(cfg, tracker)
    _start_tracking(tracker, cfg, place, mixture, lineage, start, stream.fingerprint, plan, peak, peak_source)
    system = _start_system_metrics(cfg, tracker, env.local_rank)
    result = TrainResult(final_step=start.step, run_id=tracker.run_id)
    accumulation = cfg.train.global_batch_size // (cfg.train.micro_batch_size * place.dp_size)
    log.info("training %s: %d steps, global batch %d x %d tokens, %s, accumulation %d",
             cfg.run.name, cfg.train.steps, cfg.train.global_batch_size, cfg.data.seq_len,
             _layout_tag(cfg, place), accumulation)
    writer = _checkpoint_writer(cfg, tracker, result)
    return _Run(cfg=cfg, trainer=trainer, loader=loader, eval_samples=eval_samples, tracker=tracker,
                system=system, writer=writer, result=result, fingerprint=stream.fingerprint,
                dp_rank=place.dp_rank, dp_size=place.dp_size, accumulation=accumulation, step=start.step,
                consumed=start.consumed, lineage=lineage, base_model=start.base_model,
                resumed_from=start.resumed_from, plan=plan, peak_tflops=peak)


def _start_process_group(cfg: TrainConfig) -> parallel.LaunchEnv:
    """The process group; the configuration checked against its size; enough open files for
    the data checks (which open thousands of shard files)."""
    from mimir_megatron.data.files import raise_open_file_limit

    env = parallel.init_distributed(timeout_s=cfg.train.collective_timeout_s)
    cfg.validate(world_size=env.world_size)
    raise_open_file_limit()
    return env


def _lock_run_directory(lock: RunLock, rank: int) -> None:
    """Rank 0 takes the run directory's lock; every rank ends with its one-line refusal."""
    refusal = [None]
    if rank == 0:
        try:
            lock.acquire()
        except UserError as exc:
            refusal = [exc]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise refusal[0]


def _admit_training_data(cfg: TrainConfig, env: parallel.LaunchEnv):
    """The data policy and the prepared data's integrity, before anything is built: every
    offending dataset at once. Each rank hashes a share of the files; all see every verdict.
    The mixture is read here once; the stream, its fingerprint and the lineage use it."""
    from mimir_megatron.data import load_mixture, training_data_problems

    mixture = load_mixture(cfg.data.mixture)
    digest_cache = cfg.data.index_directory(mixture.entries[0].path) if cfg.data.verify_cache else None
    problems = training_data_problems(mixture, verify=cfg.data.verify, rank=env.rank, world=env.world_size,
                                      digest_cache=digest_cache)
    # The weights this run starts from carry their own training data: judged by the same policy.
    problems += earlier_training_problems(resume_path(cfg), cfg.checkpoint.init_from, mixture.policy)
    problems = parallel.gather_lines(problems)
    if problems:
        raise UserError(f"refusing to train on {mixture.source}:\n  - " + "\n  - ".join(problems))
    if env.rank == 0:
        log.info("data policy: %s", mixture.policy.describe())
    return mixture


def _init_model_parallel(cfg: TrainConfig, env: parallel.LaunchEnv) -> _Place:
    """Megatron's tensor- and data-parallel groups; this process's place in them."""
    from megatron.core import parallel_state

    parallel.init_model_parallel(cfg.model.parallel.tensor_parallel_size)
    return _Place(env=env, device=backend.device(), dp_rank=parallel_state.get_data_parallel_rank(),
                  dp_size=parallel_state.get_data_parallel_world_size(),
                  dp_group=parallel_state.get_data_parallel_group())


def _layout_tag(cfg: TrainConfig, place: _Place) -> str:
    tp = cfg.model.parallel.tensor_parallel_size
    return f"TP={tp} DP={place.dp_size} SP={cfg.model.uses_sequence_parallel}"


def _save_run_config(cfg: TrainConfig, rank: int) -> None:
    """Rank 0 (which holds the run directory's lock) checks the checkpoint directory is writable
    and saves the configuration there; every rank ends with rank 0's one-line refusal."""
    config_file = cfg.run_directory.config_file
    refusal: list[UserError | None] = [None]
    if rank == 0:
        try:
            ckpt.check_writable(cfg.checkpoint_dir)
            OmegaConf.save(OmegaConf.create(cfg.to_dict()), config_file)
        except UserError as exc:
            refusal = [exc]
        except OSError as exc:
            refusal = [write_error(exc, config_file, "set run.dir to a writable directory")]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise refusal[0]


def _build_trainer(cfg: TrainConfig, place: _Place) -> Trainer:
    """The model, its optimizer and EMA, on this process's device and data-parallel group."""
    from mimir_megatron.model import build_model

    return build_trainer(build_model(cfg.model), cfg.optim, device=place.device, dp_group=place.dp_group,
                         dp_size=place.dp_size, precision=cfg.train.precision)


def _restore_state(cfg: TrainConfig, trainer: Trainer, resume_from: Path | None, verification,
                   fingerprint: str, rank: int) -> _StartPoint:
    """The resumed checkpoint's state (verified, checked resumable), or the weights of
    ``checkpoint.init_from``, or nothing (a fresh run); checkpoints newer than the start step
    set aside (collective)."""
    model, optimizer, ema = trainer.model, trainer.optimizer, trainer.ema
    start = _StartPoint()
    if resume_from is not None:
        resume_from, saved = verified_resume(cfg, resume_from, verification)
        start.config_changes = check_resumable(saved, cfg, resume_from, fingerprint)
        start.data_changed = data_changed(saved, fingerprint)
        state = ckpt.load_checkpoint(resume_from, model, optimizer, ema, verified=saved)
        start.step, start.consumed, start.run_id = state.step, state.consumed_samples, state.mlflow_run_id
        start.lineage, start.base_model = state.lineage, state.base_model
        start.resumed_from = resume_from
        log.info("resumed from %s at step %d", resume_from, start.step)
        if start.config_changes:
            log.warning("resuming with a changed configuration (allowed): %s",
                        "; ".join(start.config_changes))
    elif cfg.checkpoint.init_from:
        start.base_model = _init_weights(cfg, model, optimizer, ema)
        start.parent_run_id = start.base_model.mlflow_run_id
    if rank == 0:  # checkpoints after the start step belong to an abandoned timeline
        ckpt.set_aside_newer(cfg.checkpoint_dir, start.step, start.resumed_from)
    dist.barrier()
    return start


def _train_loader(cfg: TrainConfig, stream, place: _Place, consumed: int):
    """The training batches from ``consumed`` samples on, prefetched to the device if asked.

    The packing index of every epoch the run will reach is built once, by rank 0, before the
    first step (its windows over the node's cores); the other ranks read it from the cache, so
    no rank packs an epoch at a boundary inside the step loop. The prefetcher runs up to
    prefetch + 1 micro-batches past the last step."""
    from mimir_megatron.data import build_train_loader
    from mimir_megatron.data.prefetch import DevicePrefetcher

    if place.rank == 0:
        last = cfg.train.steps * cfg.train.global_batch_size
        last += (cfg.data.prefetch + 1) * cfg.train.micro_batch_size * place.dp_size
        epochs = stream.build_ahead(max(last, consumed + 1))
        log.info("packing index: %d epoch(s) ready in %s", epochs, stream.index_dir)
    dist.barrier()
    loader = build_train_loader(cfg.data, micro_batch_size=cfg.train.micro_batch_size, dp_rank=place.dp_rank,
                                dp_size=place.dp_size, consumed_samples=consumed, stream=stream)
    if cfg.data.prefetch:
        loader = DevicePrefetcher(loader, place.device, cfg.data.prefetch)
    return loader


def _held_out_samples(cfg: TrainConfig) -> list:
    """The held-out samples the run's exact match is measured on (``eval.max_samples`` of them)."""
    from mimir_megatron.data import load_eval_samples

    if not cfg.data.eval_path:
        return []
    return _eval_subset(load_eval_samples(cfg.data.eval_path), cfg.eval.max_samples)


def _open_tracker(cfg: TrainConfig, rank: int) -> Tracker:
    """The MLflow tracker (rank 0 logs; the others hold a disabled one)."""
    return Tracker(cfg.tracking.uri, cfg.run_dir, cfg.tracking.experiment,
                   enabled=cfg.tracking.enabled and rank == 0,
                   retry_seconds=cfg.tracking.retry_seconds, checkpoints=cfg.checkpoint_dir)


def _plan_this_run(cfg: TrainConfig, env: parallel.LaunchEnv) -> StartupPlan | None:
    """`mimir plan`'s plan of this very run, before its first step (``train.plan_gpu``, rank 0;
    ``auto``: none on a CPU; a warning if it cannot be made)."""
    return plan_at_start(cfg, env.world_size) if cfg.train.plan_gpu and env.rank == 0 else None


def _peak_tflops(cfg: TrainConfig, tracker: Tracker) -> tuple[float, str]:
    """One device's peak for MFU and where it comes from: ``train.peak_tflops``, else the
    backend's (measured only where the tracker logs it)."""
    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops, "train.peak_tflops"
    return backend.peak_tflops() if tracker.enabled else (0.0, "")


def _start_tracking(tracker: Tracker, cfg: TrainConfig, place: _Place, mixture, lineage: LineageCounter,
                    start: _StartPoint, fingerprint: str, plan: StartupPlan | None, peak: float,
                    peak_source: str) -> None:
    """Start (or continue) the MLflow run: its tags, parameters, description, configuration, the
    data policy's decision and the plan."""
    tags = host_tags(place.env.world_size, _layout_tag(cfg, place)) | {
        "data_fingerprint": fingerprint, "config": cfg.source,
        "data_policy": mixture.policy.describe()[:5000]}
    if start.parent_run_id:
        tags["mlflow.parentRunId"] = start.parent_run_id
    if start.config_changes:
        tags[f"config_changed_at_step_{start.step}"] = "; ".join(start.config_changes)[:5000]
    effective = {"model.parallel.sequence_parallel": cfg.model.uses_sequence_parallel}  # as in the layout tag
    params = run_params(flatten(cfg.to_dict()), effective)
    params |= plan.params() if plan is not None else {}
    tags["mlflow.note.content"] = run_description(cfg, peak, peak_source, plan)
    tracker.start(run_name(cfg), params, tags, resume_run_id=start.run_id, resume_step=start.step,
                  new_trajectory=bool(start.config_changes) or start.data_changed)
    tracker.log_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())), "config.yaml")
    tracker.log_json({"decision": "allowed", "mixture": str(mixture.source), "policy": lineage.policy,
                      "datasets": [asdict(e) for e in lineage.entries]}, "data/policy_decision.json")
    if plan is not None:
        tracker.log_text(plan.json(), "plan.json")


def _checkpoint_writer(cfg: TrainConfig, tracker: Tracker, result: TrainResult) -> ckpt.CheckpointWriter:
    """The checkpoint writer; each complete checkpoint is tagged in MLflow and kept in ``result``."""

    def on_saved(path: Path) -> None:  # once the checkpoint is complete on every rank
        tracker.set_tags({"checkpoint.latest": str(path.resolve())})
        result.checkpoint = str(path)
        log.info("checkpoint saved: %s", path)

    return ckpt.CheckpointWriter(cfg.checkpoint_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, on_saved)


def _loop(run: _Run, stop: _StopFlag, stop_at_step: int | None, hooks: StepHooks | None) -> TrainResult:
    """Steps until the end, a pre-emption or a non-finite stop; then the final evaluation."""
    from mimir_megatron.data.prefetch import DevicePrefetcher

    cfg, result, device = run.cfg, run.result, run.trainer.device
    first_step, nonfinite_in_a_row = run.step, 0
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    devices = run.dp_size * cfg.model.parallel.tensor_parallel_size
    evaluates = bool(run.eval_samples or cfg.eval.suite)
    try:
        while run.step < cfg.train.steps:
            started = time.perf_counter()
            plan = plan_step(run.step, cfg)
            micro_batches = [next(run.loader).to(device) for _ in range(run.accumulation)]
            for batch in micro_batches:
                run.lineage.add(batch.sources)
            # The loader's batches are checked on this process's first step only: the checks
            # (token ranges) cost host syncs that a GPU step should not pay.
            outcome = train_step(run.trainer, micro_batches, plan, step=run.step,
                                 validate=run.step == first_step, stop_requested=lambda: stop.raised,
                                 hooks=hooks)
            if outcome.finite:
                nonfinite_in_a_row = 0
            else:
                nonfinite_in_a_row += 1
                _on_nonfinite(run, outcome, nonfinite_in_a_row, first_step)
            run.step += 1
            run.consumed += cfg.train.global_batch_size
            elapsed = time.perf_counter() - started

            result.losses.append(outcome.loss)
            result.final_step = run.step
            _log_step(run.tracker, cfg, run.step, plan, outcome, tokens_per_step, elapsed, devices,
                      planned=run.plan, first=run.step == first_step + 1,
                      tokens_seen=run.consumed * cfg.data.seq_len, peak_tflops=run.peak_tflops)

            # -- what follows a step: checkpoint, evaluation, pre-emption -----------------------
            run.writer.poll()
            last = run.step == cfg.train.steps
            if run.step % cfg.checkpoint.interval == 0 or last:
                run.save(run.step)
            if evaluates and cfg.eval.interval and run.step % cfg.eval.interval == 0 and not last:
                run.evaluate()
            if outcome.stop_requested or run.step == stop_at_step:
                if run.step % cfg.checkpoint.interval and not last:
                    run.save(run.step)
                run.writer.wait()
                log.warning("pre-empted: checkpoint saved at step %d", run.step)
                result.preempted = True
                break
        run.writer.wait()
        if not result.preempted:
            log.info("training done at step %d", run.step)
            if evaluates:
                result.exact_match = run.evaluate()
    except BaseException:
        run.writer.abort()
        if run.system is not None:
            run.system.close()
        run.tracker.close(status="FAILED", wait_seconds=5)
        raise
    finally:
        if isinstance(run.loader, DevicePrefetcher):
            run.loader.close()
    if run.system is not None:
        run.system.close()
    run.tracker.close(status="KILLED" if result.preempted else "FINISHED",
                      wait_seconds=cfg.tracking.final_flush_seconds)
    result.run_id = run.tracker.run_id
    return result


def _on_nonfinite(run: _Run, outcome: StepOutcome, in_a_row: int, first_step: int) -> None:
    """``train.on_nonfinite``: warn and go on (the step changed nothing), or save the last good
    state and raise."""
    cfg, step = run.cfg, run.step
    what = f"step {step + 1}: loss {outcome.loss}, gradient norm {outcome.grad_norm}"
    if step == first_step and run.resumed_from is not None:
        # Verified files and a non-finite first step: the saved state itself holds non-finite
        # values (written before weights were checked), or the data differ from the saved run's.
        what += (f", the first step after resuming from {run.resumed_from} (its weights or optimizer "
                 "state may not be finite)")
    if cfg.train.on_nonfinite == "stop" or in_a_row > cfg.train.max_nonfinite_skips:
        if step > first_step and step % cfg.checkpoint.interval:
            run.save(step)  # the weights are still those before the bad step
        run.writer.wait()  # the last good state is on disk before the job ends
        raise NonFiniteTraining(
            f"non-finite {what} ({in_a_row} in a row, train.on_nonfinite={cfg.train.on_nonfinite}); "
            f"training stopped; last good state: step {step}"
            + (f" ({cfg.checkpoint_dir})" if step > first_step else ""))
    log.warning("non-finite %s: step skipped (no update), %d in a row", what, in_a_row)


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


def _init_weights(cfg: TrainConfig, model, optimizer, ema) -> ckpt.BaseModel:
    """Continued training: weights from a checkpoint or from project weights (`mimir import`)."""
    from mimir_megatron.interop import CONFIG_FILE, read_safetensors_dir
    from mimir_megatron.model.state import load_full_state
    from mimir_megatron.train.optim import weights_loaded

    source = Path(cfg.checkpoint.init_from)
    if (source / CONFIG_FILE).is_file():
        load_full_state(model, read_safetensors_dir(source), source=str(source))
        weights_loaded(model, optimizer, None)  # a distributed optimizer's fp32 main copy follows
        base = ckpt.BaseModel(source=str(source.resolve()))
    else:  # a new run: its own seed decides the RNG, not the source run's
        path = ckpt.resolve(source)
        state = ckpt.load_checkpoint(path, model, optimizer, ema, restore_rng=False,
                                     optimizer_state=cfg.checkpoint.keep_optimizer)
        base = ckpt.BaseModel(source=str(path.resolve()), step=state.step, mlflow_run_id=state.mlflow_run_id,
                              lineage=state.lineage, base_model=state.base_model)
    if ema is not None and not (cfg.checkpoint.keep_optimizer and base.mlflow_run_id is not None):
        ema.reset(model)
    log.info("initialised weights from %s (optimizer %s)", source,
             "kept" if cfg.checkpoint.keep_optimizer else "reset")
    return base


def _log_step(tracker: Tracker, cfg: TrainConfig, step: int, plan: StepPlan, outcome: StepOutcome,
              tokens: int, seconds: float, devices: int, planned: StartupPlan | None = None,
              first: bool = False, tokens_seen: int = 0, peak_tflops: float = 0.0) -> None:
    """Metrics of every step to MLflow (host values the step already read: no synchronisation;
    names: tracking.METRIC_NAMES); with ``planned`` (the run's own plan), the plan's memory and
    step time next to the measured ones where it runs on a GPU, a warning where they exceed it
    (``first``: this process's first step, whose time is warm-up); MFU against ``peak_tflops``
    (0: none)."""
    flops = flops_per_token(cfg.model, plan.window.k_L, plan.window.k_H, cfg.data.seq_len,
                            attended_keys=outcome.attended_keys) * tokens
    tflops_per_device = flops / seconds / devices / 1e12
    metrics = {
        "loss": outcome.loss,
        "grad_norm": outcome.grad_norm,
        "window_k": plan.window.k,
        "k_L": plan.window.k_L,
        "k_H": plan.window.k_H,
        "supervised_tokens": outcome.supervised,
        "tokens_seen": tokens_seen,
        "tokens_per_s": tokens / seconds,
        "tflops_per_device": tflops_per_device,
        "step_time_s": seconds,
        "peak_memory_gb": backend.peak_memory_gb(),
        "nonfinite_skip": float(not outcome.finite),  # its sum over a run: the skipped steps
        **{f"lr/{g}": lr for g, lr in plan.group_lr.items()},
    }
    if peak_tflops:
        metrics["mfu"] = tflops_per_device / peak_tflops
    if planned is not None:
        metrics |= planned.metrics(plan.window.k)
        planned.compare(step, plan.window.k, metrics["peak_memory_gb"], seconds, first)
    tracker.log_metrics(step, metrics)
    if step % cfg.train.log_interval == 0 or step == 1:
        log.info("step %d/%d loss %.4f k=%d (L%d H%d) lr %.2e gnorm %.3f %.0f tok/s %.3f TFLOP/s/dev",
                 step, cfg.train.steps, outcome.loss, plan.window.k, plan.window.k_L, plan.window.k_H,
                 plan.lr, outcome.grad_norm, tokens / seconds, tflops_per_device)


def _eval_subset(samples: list, limit: int) -> list:
    """Evenly spaced samples: held-out files are often grouped by task, so a prefix would not do."""
    if limit <= 0:
        return []
    stride = max(1, len(samples) // limit)
    return samples[::stride][:limit]


def _evaluate(model, samples, cfg: TrainConfig, device, dp_rank, dp_size, dp_group,
              tracker: Tracker, step: int) -> float | None:
    """Held-out exact match (every rank shares the samples) and the benchmark suite (rank 0)."""
    from mimir_megatron.train.evaluate import eval_stop_ids, exact_match

    score = None
    if samples:
        score, count = exact_match(model, samples, max_new_tokens=cfg.eval.max_new_tokens,
                                   device=device, dp_rank=dp_rank, dp_size=dp_size, dp_group=dp_group,
                                   stop_token_ids=eval_stop_ids(cfg.data.eval_path))
        tracker.log_metrics(step, {"eval/exact_match": score})
        result = {"step": step, "exact_match": score, "samples": count, "eval_path": cfg.data.eval_path,
                  "max_new_tokens": cfg.eval.max_new_tokens}
        tracker.log_json(result, f"eval/step_{step:07d}/exact_match.json")
        log.info("step %d: exact match %.3f on %d held-out samples", step, score, count)
    if cfg.eval.suite:
        if dist.get_rank() == 0:
            _evaluate_suite(model, cfg, tracker, step)
        dist.barrier()  # the other ranks wait for rank 0's suite
    return score


def _evaluate_suite(model, cfg: TrainConfig, tracker: Tracker, step: int) -> dict[str, float]:
    """Rank 0: the benchmark suite ``eval.suite`` at ``step``, its scores logged and its InspectAI
    logs kept in the run directory (``eval_logs/step_N``) and in MLflow."""
    from mimir_megatron.train.evaluate import suite_scores

    log_dir = cfg.run_directory.eval_logs(step)
    metrics = suite_scores(model, cfg, log_dir)
    tracker.log_metrics(step, metrics)
    tracker.log_json({"step": step, **metrics}, f"eval/step_{step:07d}/suite.json")
    if log_dir.is_dir():
        tracker.log_path(log_dir, f"eval/step_{step:07d}/inspect_logs")
    log.info("step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())))
    return metrics
