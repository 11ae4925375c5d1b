"""The plan of a run's own config, made by `mimir train` at start-up (``train.plan_gpu``).

Rank 0 logs the plan's table, sends it to MLflow (``plan.json`` and a few ``plan.*`` params)
and, on a GPU run, logs the plan's peak memory and step time for each step's window next to
the measured ones (``plan/peak_memory_gb`` by ``peak_memory_gb``, ``plan/step_time_s`` by
``step_time_s``): the data to calibrate the efficiency factor from (docs/planning.md).
A plan that cannot be made (a layout the planner rejects) is a warning, never a failed run.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from mimir_megatron.errors import UserError
from mimir_megatron.train.plan.gpus import gpu_spec
from mimir_megatron.train.plan.layouts import RunPlan, RunSettings, plan_run
from mimir_megatron.train.plan.record import PlanRecord
from mimir_megatron.train.plan.report import table

log = logging.getLogger("mimir.plan")

GIB = 2**30  # the unit of the trainer's peak_memory_gb metric


@dataclass
class StartupPlan:
    plan: RunPlan

    def params(self) -> dict[str, object]:
        c, s = self.plan.configured, self.plan.settings
        return {"plan.gpu": s.gpu.key, "plan.precision": s.precision, "plan.fits": c.fits,
                "plan.efficiency": round(self.plan.efficiency, 4),
                "plan.peak_memory_gb": round(c.memory.peak / GIB, 3),
                "plan.step_time_s": round(c.last_step.seconds, 4),
                "plan.days": round(c.seconds / 86_400, 2),
                "plan.gpu_hours": round(c.seconds * s.gpus / 3600)}

    def json(self) -> str:
        return PlanRecord.of(self.plan, top=5).json()

    def metrics(self, k: int) -> dict[str, float]:
        """The plan's figures for a step at window ``k``, in the units of the measured ones."""
        times = {phase.k: t.seconds for phase, t in self.plan.configured.phases}
        metrics = {"plan/peak_memory_gb": self.plan.configured.memory.peak / GIB}
        if k in times:
            metrics["plan/step_time_s"] = times[k]
        return metrics


def nodes_of(world_size: int) -> int:
    """Nodes of this launch (torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NNODES; else one)."""
    if os.environ.get("SLURM_NNODES"):
        return int(os.environ["SLURM_NNODES"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // per_node)


def plan_at_start(cfg, world_size: int) -> StartupPlan | None:
    """The plan of ``cfg`` as launched (its TP, micro-batch and recompute on ``world_size``
    GPUs of ``cfg.train.plan_gpu``), logged as a table; None (with a warning) when it cannot
    be made."""
    try:
        settings = RunSettings(gpu=gpu_spec(cfg.train.plan_gpu), gpus=world_size, nodes=nodes_of(world_size),
                               efficiency=cfg.train.plan_efficiency)
        plan = plan_run(cfg, settings)
    except UserError as exc:
        log.warning("train.plan_gpu=%s: no plan: %s", cfg.train.plan_gpu, exc)
        return None
    log.info("plan of this run (train.plan_gpu=%s):\n%s", cfg.train.plan_gpu, table(plan, top=5))
    if not plan.configured.fits:
        log.warning("the plan says this layout does not fit in %s GB per GPU", plan.settings.gpu.memory_gb)
    return StartupPlan(plan)
