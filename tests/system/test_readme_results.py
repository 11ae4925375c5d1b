"""Numbers the README presents as a shipped command's output are what that command gives now.

The schedule sweep on the demo checkpoint (README "Demo results"): trains the demo first when
runs/demo has none (launchers/demo_cpu.sh, ~6 min on 2 cores), then ~2.5 min of `mimir sweep`.
On a difference, re-measure and rewrite the table: .venv/bin/python tests/helpers/readme_sweep.py --update
"""

from __future__ import annotations

import pytest
from readme_sweep import README, ensure_demo, readme_block, run_sweep, table_rows


def test_readme_names_the_commit_its_sweep_table_was_measured_at():
    assert "Measured at commit `" in readme_block(README.read_text())


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_sweep_table_is_what_mimir_sweep_gives(tmp_path):
    ensure_demo()
    measured = table_rows(run_sweep(tmp_path / "sweep"))
    documented = table_rows(readme_block(README.read_text()))
    assert documented == measured, (
        "README.md's schedule-sweep table is not what `mimir sweep` gives on the demo checkpoint; "
        "re-measure and rewrite it: .venv/bin/python tests/helpers/readme_sweep.py --update")
