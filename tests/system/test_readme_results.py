"""Numbers the README presents as a shipped command's output are what that command gives now.

The demo command's exact match and the schedule sweep on its checkpoint (README "Demo results"):
runs launchers/demo_cpu.sh (~6 min on 2 cores to train when runs/demo has no finished run, else
~20 s to re-evaluate it), then ~1.5 min of `mimir sweep`.
On a difference, re-measure and rewrite the table: .venv/bin/python tests/helpers/readme_sweep.py --update
"""

from __future__ import annotations

import pytest
from readme_sweep import README, readme_block, readme_exact_match, run_demo, run_sweep, table_rows


def test_readme_names_the_commit_its_sweep_table_was_measured_at():
    assert "Measured at commit `" in readme_block(README.read_text())


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_demo_results_are_what_the_demo_and_mimir_sweep_give(tmp_path):
    assert run_demo() == readme_exact_match(README.read_text()), (
        "the demo command no longer prints the exact match README.md quotes: re-measure the demo results")
    measured = table_rows(run_sweep(tmp_path / "sweep"))
    documented = table_rows(readme_block(README.read_text()))
    assert documented == measured, (
        "README.md's schedule-sweep table is not what `mimir sweep` gives on the demo checkpoint; "
        "re-measure and rewrite it: .venv/bin/python tests/helpers/readme_sweep.py --update")
