"""Training-run configuration: one typed section per concern, validated once before any compute.

A train YAML names its model YAML (``model.config``) and may override model fields next to it,
the model's ``execution`` and ``parallel`` sections included:

    model:
      config: configs/model/tiny.yaml
      bp_window: 5
      parallel: {tensor_parallel_size: 2}
    data: {mixture: configs/data/demo.yaml, seq_len: 256}
    train: {steps: 300, global_batch_size: 16, micro_batch_size: 8}

:func:`load_train_config` reads every section, then checks every value, and reports all the
mistakes it found, in every section, together: one line each, before anything is computed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
import typing
from enum import StrEnum
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf

from mimir_megatron.checkpoint.run_directory import RunDirectory
from mimir_megatron.config import ModelConfig, ParamsDtype, model_section, model_yaml
from mimir_megatron.data.config import DataConfig
from mimir_megatron.errors import ConfigError, UserError
from mimir_megatron.yaml_config import plain, raise_errors, read_yaml, typed_section


class Precision(StrEnum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"


class OnNonfinite(StrEnum):
    skip = "skip"
    stop = "stop"


class WindowSchedule(StrEnum):
    constant = "constant"
    linear = "linear"


class Optimizer(StrEnum):
    adamw = "adamw"
    adam_atan2 = "adam_atan2"


class Cooldown(StrEnum):
    none = "none"
    linear = "linear"
    cosine = "cosine"


@dataclass
class RunSection:
    name: str = "run"
    """Run name; also the default run directory `runs/<name>`."""
    dir: str | None = None
    """Run directory (checkpoints, resolved config, local MLflow store)."""
    private: bool = False
    """Make the run directory 0700 (yours alone on a shared filesystem, whatever the umask);
    false: it is made with the umask, as every file in it (docs/operations.md, "Shared nodes")."""
    seed: int = 1234
    """Seed of everything random in the run that is not the model init or the data plan."""


@dataclass
class TrainSection:
    steps: int = 1000
    """Optimizer steps of this run (the schedules' 100 %)."""
    global_batch_size: int = 16
    """Packed contexts per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 4
    """Contexts per forward/backward on one rank; accumulation = global / (micro * DP)."""
    log_interval: int = 10
    """Steps between log lines (metrics go to MLflow every step)."""
    precision: Precision = Precision.auto
    """auto (bf16 compute with fp32 master weights on GPU, fp32 on CPU), fp32 or bf16."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device, for MFU; 0: a GPU's bf16 peak from mimir_megatron/gpus.yaml,
    on CPU this process's fp32 matmul peak measured at start-up (the run's description says which)."""
    on_nonfinite: OnNonfinite = OnNonfinite.skip
    """What a step whose loss or gradient norm is not finite does. skip: no optimizer step, no
    EMA update (its batch is consumed, the step counts), MLflow metric `5-step/nonfinite_skip` = 1; more
    than `max_nonfinite_skips` in a row stop as `stop` does. stop: save the last good state (the
    weights before that step) and exit non-zero naming the step."""
    max_nonfinite_skips: int = 5
    """Consecutive non-finite steps `skip` tolerates before stopping."""
    collective_timeout_s: int = 1800
    """Seconds a collective (rendezvous, all-reduce, barrier) may wait for the other ranks before
    this rank fails with an error: a hung or unreachable peer ends the job instead of holding the
    allocation until its time limit. Must exceed the longest phase in which ranks wait for rank 0
    alone: building the packing index at start (minutes at 100B tokens), an `eval.suite`."""
    plan_gpu: str = "auto"
    """GPU of `mimir plan` (auto, b200, h200, h100, gb200, a100, or a specs YAML): rank 0 then logs
    the plan of this run's own config and layout at start-up, sends it to MLflow (plan.json,
    plan.* params) and, on a GPU, logs the plan's peak memory and step time next to the measured
    ones (plan/peak_memory_gb, plan/step_time_s; GB = 1e9 bytes), warning where a measured one is
    more than 10 % above. auto: the GPU this process runs on (the GPU table's row of its name),
    and no plan on a CPU. Empty: no plan."""
    plan_efficiency: float = 0.30
    """Fraction of the GPU's peak the plan assumes the step's FLOPs achieve; calibrate it from
    a run's measured step time (docs/planning.md)."""

    def errors(self) -> list[str]:
        errs = [f"train.{name} must be >= 1, got {getattr(self, name)}"
                for name in ("steps", "global_batch_size", "micro_batch_size", "log_interval")
                if getattr(self, name) < 1]
        if self.max_nonfinite_skips < 0:
            errs.append(f"train.max_nonfinite_skips must be >= 0, got {self.max_nonfinite_skips}")
        if self.plan_gpu and self.plan_gpu != "auto":
            from mimir_megatron.gpus import gpu_spec

            try:
                gpu_spec(self.plan_gpu)
            except UserError as exc:
                errs.append(f"train.plan_gpu: {exc}")
        if not 0 < self.plan_efficiency <= 1:
            errs.append(f"train.plan_efficiency must be in (0, 1], got {self.plan_efficiency}")
        if self.collective_timeout_s < 1:
            errs.append(f"train.collective_timeout_s must be >= 1, got {self.collective_timeout_s}")
        return errs


@dataclass
class WindowSection:
    schedule: WindowSchedule = WindowSchedule.constant
    """constant k, or linear: k0 -> k1 over the first `ramp_fraction` of the steps (step function
    k = k0 + int(progress * (k1 - k0)), as in the reference trainer)."""
    k: int = 5
    """Window for `constant`."""
    k0: int = 2
    """First window of `linear`."""
    k1: int = 5
    """Last window of `linear`, held after the ramp."""
    ramp_fraction: float = 0.2
    """Fraction of `train.steps` over which `linear` grows."""

    def errors(self, depth: int | None) -> list[str]:
        """``depth``: the model's schedule depth (None when the model's own errors make it unknown)."""
        errs = []
        for name in {"constant": ("k",), "linear": ("k0", "k1")}.get(self.schedule, ()):
            if depth and not 1 <= getattr(self, name) <= depth:
                errs.append(f"window.{name} must be in 1..{depth} (the model's schedule depth), "
                            f"got {getattr(self, name)}")
        if self.schedule == "linear" and not 0 < self.ramp_fraction <= 1:
            errs.append(f"window.ramp_fraction must be in (0, 1], got {self.ramp_fraction}")
        return errs


@dataclass
class OptimSection:
    optimizer: Optimizer = Optimizer.adamw
    """adamw, or adam_atan2 (the reference trainer's: no epsilon, bounded update)."""
    lr: float = 3e-4
    """Peak learning rate (embedding and head; L and H get lr / k_L and lr / k_H)."""
    min_lr: float = 0.0
    """Floor reached by the cool-down."""
    warmup_steps: int = 2000
    """Linear warm-up from 0."""
    cooldown: Cooldown = Cooldown.none
    """none, linear or cosine decay to `min_lr` over the last `cooldown_steps`."""
    cooldown_steps: int = 0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 0.0
    """Global gradient-norm clip; 0 disables it."""
    ema_decay: float = 0.9999
    """EMA of the weights (fp32); 0 disables it."""
    shard_state: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1 by whole tensors, torch's
    ZeroRedundancyOptimizer); no effect with one DP rank. See `distributed_optimizer`."""
    distributed_optimizer: bool = False
    """Megatron's distributed-optimizer layout (train/dist_optim.py): fp32 main weights, Adam's
    moments and the EMA kept for each data-parallel rank's rows of every weight (even: 16 / DP
    bytes a weight), gradients reduced in fp32, updated rows all-gathered. Needed for
    `model.params_dtype: bfloat16` (Megatron's mixed precision: bf16 weights, fp32 main copy);
    with fp32 weights it is an even ZeRO-1. Needs `shard_state` (left true)."""
    fully_shard: bool = False
    """Full sharding with torch FSDP2 (train/fsdp.py): parameters, gradients, Adam's moments and
    the EMA each kept for one data-parallel rank's rows of every weight (fp32: 20 / DP bytes a
    weight), weights all-gathered in `model.params_dtype` one layer at a time for each use,
    gradients reduce-scattered in fp32. Saves the weights' and gradients' copies the distributed
    optimizer keeps whole, for more communication. Needs `shard_state` (left true) and
    `model.parallel.tensor_parallel_size: 1`; exclusive with `distributed_optimizer`."""
    divide_lr_by_window: bool = True
    """Divide the L and H learning rates by their applications in the window (paper, section 3)."""

    def errors(self) -> list[str]:
        errs = []
        for mode in ("distributed_optimizer", "fully_shard"):
            if getattr(self, mode) and not self.shard_state:
                errs.append(f"optim.{mode}=true shards the optimizer state: it contradicts "
                            "optim.shard_state=false")
        if self.distributed_optimizer and self.fully_shard:
            errs.append("optim.distributed_optimizer and optim.fully_shard are two sharding layouts: "
                        "set one of them")
        if self.lr <= 0:
            errs.append(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            errs.append(f"optim.min_lr must be in [0, optim.lr], got {self.min_lr}")
        if self.warmup_steps < 0 or self.cooldown_steps < 0:
            errs.append("optim.warmup_steps and optim.cooldown_steps must be >= 0")
        if self.cooldown != "none" and self.cooldown_steps < 1:
            errs.append(f"optim.cooldown={self.cooldown} needs optim.cooldown_steps >= 1")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                errs.append(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.ema_decay < 1:
            errs.append(f"optim.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            errs.append("optim.weight_decay and optim.clip_grad must be >= 0")
        return errs


@dataclass
class CheckpointSection:
    dir: str | None = None
    """Default `<run.dir>/checkpoints`."""
    interval: int = 500
    """Steps between checkpoints (and one at the end)."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    resume: str = "auto"
    """auto: continue from `<dir>/latest` (none there: start at step 0; `latest` naming a missing
    checkpoint: an error); never; or a checkpoint directory. Resuming from an older checkpoint
    (a rollback) moves the newer ones to `<dir>/abandoned/`."""
    async_save: bool = False
    """Write checkpoints in a background process while training goes on (megatron-core's
    asynchronous dist_checkpointing save); `latest` moves once the write finished on every rank.
    Costs host memory for one copy of each rank's state. (`async` is a Python keyword.)"""
    init_from: str | None = None
    """Start weights (continued training): a checkpoint directory, or project weights from
    `mimir import`. Optimizer and schedules start fresh unless `keep_optimizer`. A checkpoint is
    read through torch's checkpoint reader, which unpickles its metadata: it can run code, so
    only pass your own checkpoints; third-party weights go through `mimir import` (safetensors)."""
    keep_optimizer: bool = False
    """With `init_from` a checkpoint: also take its optimizer state."""
    allow_data_change: bool = False
    """Resume even though the data mixture differs from the checkpoint's."""
    allow_config_change: bool = False
    """Resume even though `train`, `window`, `optim` settings or model.h_cycles, l_cycles,
    window_policy differ from the checkpoint's (micro-batch size, logging and ZeRO sharding may
    change freely); the accepted changes are logged and tagged in MLflow."""

    def errors(self) -> list[str]:
        errs = []
        if self.interval < 1:
            errs.append(f"checkpoint.interval must be >= 1, got {self.interval}")
        if self.keep < 1:
            errs.append(f"checkpoint.keep must be >= 1, got {self.keep}")
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            errs.append(f"checkpoint.resume must be auto, never or an existing checkpoint directory, "
                        f"got {self.resume!r}")
        if self.init_from and not Path(self.init_from).is_dir():
            errs.append(f"checkpoint.init_from: no directory {self.init_from}")
        return errs


@dataclass
class TrackingSection:
    uri: str | None = None
    """MLflow tracking URI; default a sqlite store in the run directory."""
    experiment: str = "mimir"
    """MLflow experiment name."""
    run_name: str = ""
    """MLflow run name; empty: `<run.name>-k<window>-s<steps>-<config hash>` (e.g.
    `demo-k2to5-s300-3fa1c2`), which tells runs of one recipe apart."""
    enabled: bool = True
    retry_seconds: float = 10.0
    """While the server is unreachable, metrics are buffered and delivery is retried this often."""
    final_flush_seconds: float = 120.0
    """At the end of a run, how long to keep trying to deliver buffered metrics."""
    system_metrics: bool = True
    """CPU, memory, disk, network and, on a GPU, GPU utilisation and memory, logged by MLflow's
    system-metrics monitor from local rank 0 of every node into the run (`system/...`; with
    several nodes `system/<host>/...`)."""
    system_metrics_interval: float = 10.0
    """Seconds between system-metric samples."""

    def errors(self) -> list[str]:
        if self.system_metrics_interval <= 0:
            return [f"tracking.system_metrics_interval must be > 0, got {self.system_metrics_interval}"]
        return []


@dataclass
class EvalSection:
    interval: int = 0
    """Steps between exact-match evaluations on `data.eval_path` (0: only at the end)."""
    max_samples: int = 200
    """Held-out samples per evaluation."""
    max_new_tokens: int = 48
    """Greedy decoding budget per sample."""
    suite: str = ""
    """Benchmark suite YAML (``configs/eval/*.yaml``) run with InspectAI on rank 0's inference
    engine at every evaluation, next to the exact match; its scores go to MLflow as
    ``eval/<task>`` and ``eval/avg/<category>``. Empty: none."""
    limit: int = 20
    """Items per task of ``suite`` (a small, fixed subset: evaluation must not stall training)."""
    data_dir: str = ""
    """Where the suite's benchmark files are (default: the suite's own ``data_dir``)."""

    def errors(self) -> list[str]:
        errs = []
        if self.suite and not Path(self.suite).is_file():
            errs.append(f"eval.suite: {self.suite} is not a file (a suite YAML, e.g. configs/eval/demo.yaml)")
        if self.limit < 1:
            errs.append(f"eval.limit must be >= 1, got {self.limit}")
        return errs


@dataclass
class RunSections:
    """The sections typed directly from the train YAML (model and data load on their own)."""

    run: RunSection = field(default_factory=RunSection)
    train: TrainSection = field(default_factory=TrainSection)
    window: WindowSection = field(default_factory=WindowSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    eval: EvalSection = field(default_factory=EvalSection)


@dataclass
class TrainConfig(RunSections):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    source: str = ""
    """The YAML this config was loaded from."""

    @property
    def run_directory(self) -> RunDirectory:
        """The run's directory (``run.dir``, else ``runs/<run.name>``) and every path in it."""
        return RunDirectory.configured(self.run.dir, self.run.name)

    @property
    def run_dir(self) -> Path:
        return self.run_directory.root

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_directory.checkpoints

    def to_dict(self) -> dict[str, Any]:
        return plain(asdict(self))

    def errors(self, world_size: int | None = None) -> list[str]:
        return self.model.errors() + self.data.errors() + self.run_errors(world_size)

    def run_errors(self, world_size: int | None = None) -> list[str]:
        """The value checks of every section but the model's and the data's own: each section's
        own (:meth:`TrainSection.errors`, ...), then those that read two sections."""
        tp = self.model.parallel.tensor_parallel_size
        depth = self.model.depth if self.model.h_cycles >= 1 and self.model.l_cycles >= 1 else None
        return (self.train.errors() + self.eval.errors() + self._layout_errors(tp, world_size)
                + self.window.errors(depth) + self.optim.errors() + self.tracking.errors()
                + self.checkpoint.errors() + self._mixture_errors())

    def _layout_errors(self, tp: int, world_size: int | None) -> list[str]:
        """How the model, the optimizer, the suite and the batch are laid out over the ranks."""
        errs: list[str] = []
        t, o = self.train, self.optim
        if self.eval.suite and tp > 1:
            errs.append("eval.suite runs on rank 0's engine alone, which needs the whole model: "
                        "use model.parallel.tensor_parallel_size=1, or evaluate checkpoints with "
                        "`mimir eval`")
        if self.model.params_dtype != ParamsDtype.float32 and not (o.distributed_optimizer or o.fully_shard):
            # The plain and ZeRO-1 optimizers update the weights in place from fp32 gradients:
            # bf16 weights need the distributed optimizer's fp32 main copy.
            errs.append(f"model.params_dtype={self.model.params_dtype} needs "
                        "optim.distributed_optimizer=true (fp32 main weights sharded over data-parallel "
                        "ranks) or optim.fully_shard=true; or use "
                        "model.params_dtype=float32 (fp32 weights, bf16 autocast on GPU)")
        if o.fully_shard and tp != 1:
            errs.append(f"optim.fully_shard=true shards over data-parallel ranks only: it needs "
                        f"model.parallel.tensor_parallel_size=1, got {tp}")
        if world_size is not None and t.micro_batch_size >= 1 and tp >= 1:
            dp = world_size // tp
            if world_size % tp:
                errs.append(f"model.parallel.tensor_parallel_size ({tp}) "
                            f"does not divide the world size ({world_size})")
            elif t.global_batch_size % (t.micro_batch_size * dp):
                errs.append(f"train.global_batch_size ({t.global_batch_size}) is not a multiple of "
                            f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp})")
        return errs

    def _mixture_errors(self) -> list[str]:
        """A run needs its mixture file (the data section alone checks values, not files)."""
        if not self.data.mixture:
            return ["data.mixture is required (a mixture YAML, e.g. configs/data/demo.yaml)"]
        if not Path(self.data.mixture).is_file():
            return [f"data.mixture: no file {self.data.mixture}"]
        return []

    def validate(self, world_size: int | None = None) -> "TrainConfig":
        raise_errors(self.errors(world_size),
                     f"invalid training configuration ({self.source or 'overrides'})")
        return self


def load_train_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a train YAML plus `section.key=value` overrides; validates values (not world size).

    Every section is read and checked even when another one is wrong: the ConfigError lists
    every mistake of every section, one line each."""
    path = Path(path)
    raw = read_yaml(path, "sections", overrides)
    errors: list[str] = []
    known = [f.name for f in fields(TrainConfig) if f.name != "source"]
    for section in sorted(set(raw) - set(known)):
        errors.append(f"{section} is not a section (known: {', '.join(known)})")

    model_tree = raw.get("model") or {}
    if not isinstance(model_tree, dict):
        errors.append(f"model must be a mapping of settings, got {model_tree!r}")
        model_tree = {}
    model_tree = dict(model_tree)
    model_path = model_tree.pop("config", None)
    base: dict[str, Any] = {}
    if not model_path:
        errors.append("model.config must name a model YAML (configs/model/*.yaml)")
    else:
        try:
            base = model_yaml(_relative_to_repo(str(model_path), path))
        except ConfigError as exc:
            errors.append(f"model.config: {exc}")
    # The train YAML's model keys override the model YAML's, sections (execution, parallel) merged.
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(model_tree)))
    except Exception as exc:
        errors.append(f"model: {str(exc).splitlines()[0]}")
        merged = base
    model = model_section(merged, (), errors)
    data = typed_section(DataConfig, raw.get("data"), "data", errors)
    sections = typing.get_type_hints(RunSections)
    rest = {name: typed_section(schema, raw.get(name), name, errors) for name, schema in sections.items()}
    cfg = TrainConfig(model=model, data=data, source=str(path), **rest)
    errors += data.errors() + cfg.run_errors()
    raise_errors(errors, f"invalid training configuration ({path})")
    return cfg


def _relative_to_repo(model_path: str, config_path: Path) -> Path:
    """Model YAML paths are relative to the working directory, else to the train YAML's repo."""
    candidate = Path(model_path)
    if candidate.is_absolute() or candidate.is_file():
        return candidate
    for parent in config_path.resolve().parents:
        if (parent / model_path).is_file():
            return parent / model_path
    return candidate


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (for MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
