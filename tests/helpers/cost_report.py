"""What each test module costs: wall-clock seconds and CPU seconds (the test process and the
subprocesses it waited for), summed over its tests with their fixtures' set-up and tear-down.

The suite's budget (15 minutes on 2 cores, README.md) is spent by a few modules; a worker's
``--durations`` shows wall time, which on a shared machine mixes a test's own cost with its
neighbours'. CPU seconds do not: they say which modules to make cheaper. Every worker writes its
modules' costs to ``$MIMIR_TEST_ARTIFACTS/cost/<worker>.json``; the controller prints the modules
by CPU at the end of the run. Daemons a test starts but does not wait for (Slurm, dockerd,
containers) are not counted.
"""

from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

_SHOWN = 25


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CostReport:
    def __init__(self, folder: Path, worker: str | None) -> None:
        self.folder = folder
        self.worker = worker
        self.costs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        wall, cpu = time.monotonic(), _cpu_seconds()
        yield
        cost = self.costs[item.nodeid.split("::")[0]]
        cost[0] += time.monotonic() - wall
        cost[1] += _cpu_seconds() - cpu

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.worker is None and not self.costs:
            return  # the controller of a parallel run: the workers wrote theirs
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{self.worker or 'main'}.json").write_text(json.dumps(self.costs, indent=1))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.worker is not None:
            return
        modules: dict[str, list[float]] = {}
        workers: dict[str, float] = {}
        for path in sorted(self.folder.glob("*.json")):
            costs = json.loads(path.read_text())
            workers[path.stem] = sum(wall for wall, _ in costs.values())
            modules.update(costs)
        if not modules:
            return
        terminalreporter.section("cost per test module (wall s, CPU s incl. waited-for subprocesses)")
        total_cpu = sum(cpu for _, cpu in modules.values())
        for name, (wall, cpu) in sorted(modules.items(), key=lambda kv: -kv[1][1])[:_SHOWN]:
            terminalreporter.write_line(f"{cpu:8.0f} CPU s {wall:8.0f} s  {name}")
        busy = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items()))
        terminalreporter.write_line(f"{total_cpu:8.0f} CPU s in all; workers busy: {busy}")


def install(config: pytest.Config, folder: Path) -> None:
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is None and folder.is_dir():  # the controller, before any worker starts
        for old in folder.glob("*.json"):
            old.unlink()  # only this run's costs are reported
    config.pluginmanager.register(CostReport(folder, worker), "mimir-cost-report")
