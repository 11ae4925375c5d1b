"""Skips are listed in every run (``-rs``); under CI a skip nobody expected fails the run.

A test that skips because something is missing (transformers, Slurm, shellcheck) passes silently
otherwise, so a CI machine that lost a dependency would go green while testing less. With the
environment variable ``CI`` set (``true``/``1``/``yes``), every skipped test or module whose
reason matches none of the regular expressions in ``tests/expected_skips.txt`` (or the file named
by ``MIMIR_EXPECTED_SKIPS``) is listed at the end and the run exits with status 1. Outside CI
the same list is printed as a warning section only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

DEFAULT_ALLOW_LIST = Path(__file__).resolve().parent.parent / "expected_skips.txt"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def read_allow_list(path: Path) -> list[re.Pattern]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [re.compile(line) for line in lines if line and not line.startswith("#")]


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


class SkipPolicy:
    def __init__(self, allowed: list[re.Pattern], enforce: bool) -> None:
        self.allowed = allowed
        self.enforce = enforce
        self.unexpected: list[tuple[str, str]] = []

    def _check(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = skip_reason(report)
            if not any(p.search(reason) for p in self.allowed):
                self.unexpected.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.unexpected:
            return
        title = "unexpected skips (fail under CI)" if self.enforce else "unexpected skips"
        terminalreporter.section(title, sep="=", red=self.enforce, yellow=not self.enforce)
        for nodeid, reason in self.unexpected:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line("expected reasons are listed in tests/expected_skips.txt")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.enforce and self.unexpected and exitstatus in (pytest.ExitCode.OK,
                                                               pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def install(config: pytest.Config) -> None:
    """Register the policy (from ``pytest_configure`` of the tests' conftest)."""
    path = Path(os.environ.get("MIMIR_EXPECTED_SKIPS", DEFAULT_ALLOW_LIST))
    config.pluginmanager.register(SkipPolicy(read_allow_list(path), enforce=in_ci()), "mimir-skip-policy")
