"""The plan of a run's own config, made by `mimir train` at start-up (``train.plan_gpu``).

Rank 0 logs the plan's table, sends it to MLflow (``plan.json`` and a few ``plan.*`` params) and,
where it computes on a GPU, sets the plan's peak memory and step time for each step's window
beside the measured ones (``plan/peak_memory_gb`` by ``peak_memory_gb``, ``plan/step_time_s`` by
``step_time_s``, all memory in GB = 1e9 bytes, as the plan's table): the data to calibrate the
efficiency factor from (docs/planning.md). It says once, in the log, how the first step compares,
and warns (one line naming both figures) when a measured peak or step is more than
:data:`TOLERANCE` above the plan's. ``train.plan_gpu: auto`` plans for the GPU this process runs
on (the GPU table's row of its name, :func:`mimir_megatron.backend.gpu_row`) and for nothing on a
CPU. A plan that cannot be made (a layout the planner rejects, a GPU the table lacks) is a
warning, never a failed run.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from mimir_megatron.errors import UserError
from mimir_megatron.train.plan.layouts import RunPlan, RunSettings, plan_run
from mimir_megatron.train.plan.memory import GB
from mimir_megatron.train.plan.record import PlanRecord
from mimir_megatron.train.plan.table import percent, table

log = logging.getLogger("mimir.plan")

AUTO = "auto"
"""``train.plan_gpu: auto``: the GPU this process runs on (none on a CPU)."""
TOLERANCE = 0.10
"""How far above the plan a measured peak or step may be before a warning."""


@dataclass
class StartupPlan:
    plan: RunPlan
    compared: bool = False
    """Whether this process runs on a GPU, whose measured peak and step time sit beside the
    plan's (a CPU's resident memory and step say nothing about the planned GPU)."""
    _warned: set[str] = field(default_factory=set)
    _reported: bool = False

    def params(self) -> dict[str, object]:
        """MLflow params: the figures of the plan's table, in its units (GB = 1e9 bytes)."""
        c, s = self.plan.configured, self.plan.settings
        return {"plan.gpu": s.gpu.key, "plan.precision": s.precision, "plan.fits": c.fits,
                "plan.efficiency": round(self.plan.efficiency, 4),
                "plan.peak_memory_gb": round(c.memory.peak / GB, 1),
                "plan.step_time_s": round(c.last_step.seconds, 3),
                "plan.days": round(c.seconds / 86_400, 1),
                "plan.gpu_hours": round(c.seconds * s.gpus / 3600)}

    def json(self) -> str:
        return PlanRecord.of(self.plan, top=5).json()

    def planned(self, k: int) -> tuple[float, float | None]:
        """The plan's peak memory (GB) and its step time at window ``k`` (None: a window the
        schedule does not plan)."""
        times = {phase.k: t.seconds for phase, t in self.plan.configured.phases}
        return self.plan.configured.memory.peak / GB, times.get(k)

    def metrics(self, k: int) -> dict[str, float]:
        """The plan's figures for a step at window ``k``, in the units of the measured ones; none
        where this process runs on no GPU."""
        if not self.compared:
            return {}
        peak_gb, step_s = self.planned(k)
        return {"plan/peak_memory_gb": peak_gb} | ({} if step_s is None else {"plan/step_time_s": step_s})

    def compare(self, step: int, k: int, peak_gb: float, step_s: float, first: bool) -> None:
        """Set a measured step beside the plan: the first compared step in one info line, then a
        warning line (once for the peak, once per window for the step time) where a measured
        figure is more than :data:`TOLERANCE` above the plan's. The first step of a process
        (compilation, warm-up) is not judged on its time."""
        if not self.compared:
            return
        planned_peak, planned_step = self.planned(k)
        if not self._reported:
            self._reported = True
            log.info("step %d against the plan (%s): peak memory %.1f GB measured, %.1f GB planned; "
                     "step %.3f s measured, %s planned", step, self.plan.settings.gpu.key, peak_gb,
                     planned_peak, step_s, "-" if planned_step is None else f"{planned_step:.3f} s")
        if peak_gb > planned_peak * (1 + TOLERANCE) and "peak" not in self._warned:
            self._warned.add("peak")
            log.warning("step %d: peak memory %.1f GB measured is %.0f%% above the plan's %.1f GB "
                        "(a kernel keeps more than counted: docs/planning.md)", step, peak_gb,
                        100 * (peak_gb / planned_peak - 1), planned_peak)
        if (not first and planned_step is not None and step_s > planned_step * (1 + TOLERANCE)
                and f"time{k}" not in self._warned):
            self._warned.add(f"time{k}")
            log.warning("step %d (k=%d): step time %.3f s measured is %.0f%% above the plan's %.3f s "
                        "(at efficiency %s; calibrate it: docs/planning.md)", step, k, step_s,
                        100 * (step_s / planned_step - 1), planned_step, percent(self.plan.efficiency))


def nodes_of(world_size: int) -> int:
    """Nodes of this launch (torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NNODES; else one)."""
    if os.environ.get("SLURM_NNODES"):
        return int(os.environ["SLURM_NNODES"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // per_node)


def plan_at_start(cfg, world_size: int) -> StartupPlan | None:
    """The plan of ``cfg`` as launched (its TP, micro-batch and recompute on ``world_size``
    GPUs of ``cfg.train.plan_gpu``), logged as a table; None when there is none to make
    (``auto`` on a CPU) and, with a warning, when it cannot be made."""
    from mimir_megatron import backend
    from mimir_megatron.gpus import gpu_spec

    choice = cfg.train.plan_gpu
    try:
        if choice == AUTO:
            name = backend.gpu_name()
            if name is None:
                return None
            gpu = backend.gpu_row()
            if gpu is None:
                raise UserError(f"{name} is not in the GPU table (mimir_megatron/gpus.yaml): set "
                                "train.plan_gpu to a row of it or to a YAML of its specs")
        else:
            gpu = gpu_spec(choice)
        settings = RunSettings(gpu=gpu, gpus=world_size, nodes=nodes_of(world_size),
                               efficiency=cfg.train.plan_efficiency)
        plan = plan_run(cfg, settings)
    except UserError as exc:
        log.warning("train.plan_gpu=%s: no plan: %s", choice, exc)
        return None
    log.info("plan of this run (train.plan_gpu=%s: %s):\n%s", choice, gpu.key, table(plan, top=5))
    if not plan.configured.fits:
        log.warning("the plan says this layout does not fit in %s GB per GPU", plan.settings.gpu.memory_gb)
    return StartupPlan(plan, compared=backend.gpu_name() is not None)
