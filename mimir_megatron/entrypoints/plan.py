"""`mimir plan --config TRAIN.yaml --gpus N`: memory, layouts, step time and the schedule's cost
before a run is launched; several ``--config`` plan runs that follow one another, and their sum.

Exit status: 0 when every configured layout fits, 1 when one does not (the plan is printed and
written all the same: ``mimir plan ... && sbatch ...`` launches only what fits), 2 for bad input
and for a config that fits no layout (one line)."""

from __future__ import annotations

import argparse
import logging

from mimir_megatron.gpus import PRECISIONS

log = logging.getLogger("mimir.plan")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="memory per GPU, the layouts that fit, step time, days and GPU-hours of a run",
        description="Plans a train config on a cluster: memory per GPU term by term (at the largest "
        "window of the schedule), the layouts (TP, DP, micro-batch, recompute) that fit, ranked by "
        "tokens/s, and the whole schedule's wall-clock. Exit status 0 when the configured layout fits, "
        "1 when it does not, 2 for bad input. See docs/planning.md.")
    p.add_argument("--config", required=True, action="append",
                   help="train YAML, e.g. configs/train/mimir_v1.yaml; repeat it for runs that follow one "
                   "another (v1, then v1.5): each stage's days and GPU-hours and their sum")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the run")
    p.add_argument("--gpu", default="b200", help="b200, h200, h100, gb200, a100, or a YAML of specs")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="the peak to plan at")
    p.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over")
    p.add_argument("--efficiency", type=float, default=0.30,
                   help="fraction of peak the step's FLOPs achieve (default 0.30; calibrate from runs)")
    p.add_argument("--step-time", type=float, default=None, metavar="S",
                   help="a measured step (configured layout, final window, e.g. MLflow's step_time_s): "
                   "sets the efficiency (of the first --config's run; later stages plan at it)")
    p.add_argument("--mean-step-time", type=float, default=None, metavar="S",
                   help="a whole run's average step (wall-clock / steps, as papers report it): sets the "
                   "efficiency so that the planned schedule averages S (the first --config's run)")
    p.add_argument("--margin", type=float, default=0.10,
                   help="share of GPU memory kept free, 0 to 0.5 (default 0.10)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the config's)")
    p.add_argument("--micro-batch", type=int, help="contexts per micro-batch (default: the config's)")
    p.add_argument("--recompute", choices=("none", "selective", "full"),
                   help="activation recompute (default: the config's)")
    p.add_argument("--top", type=int, default=10, help="layouts listed")
    p.add_argument("--json", help="also write the plan here")
    p.add_argument("overrides", nargs="*", help="train config overrides (every stage's): section.key=value")
    p.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from mimir_megatron.gpus import gpu_spec
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.plan.layouts import RunSettings, plan_stages
    from mimir_megatron.train.plan.record import PlanRecord
    from mimir_megatron.train.plan.table import stages_table, table

    cfgs = [load_train_config(path, args.overrides) for path in args.config]
    settings = RunSettings(gpu=gpu_spec(args.gpu), gpus=args.gpus, nodes=args.nodes,
                           precision=args.precision, efficiency=args.efficiency, margin=args.margin,
                           step_time_s=args.step_time,
                           mean_step_time_s=args.mean_step_time, tp=args.tp, micro_batch=args.micro_batch,
                           recompute=args.recompute)
    stages = plan_stages(cfgs, settings)
    for n, plan in enumerate(stages, 1):
        if len(stages) > 1:
            print(f"== stage {n} of {len(stages)}: {plan.source}")
        print(table(plan, args.top))
        print()
    if len(stages) > 1:
        print(stages_table(stages))
    if args.json:
        PlanRecord.of(stages[0], args.top, stages).write(args.json)
    misfits = [plan.source for plan in stages if not plan.configured.fits]
    if misfits:
        log.error("the configured layout does not fit (exit status 1): %s", ", ".join(misfits))
        return 1
    return 0
