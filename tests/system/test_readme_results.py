"""Numbers the docs present as a shipped command's output are what that command gives now.

The demo command's exact match (README.md's expected output and docs/results.md) and the schedule
sweep on its checkpoint (docs/results.md), and what README.md and docs/results.md show of the demo's
exported model card and training-data summary: runs launchers/demo_cpu.sh in a temporary run
directory (~6 min on 2 cores), then ~1.5 min of `mimir sweep`.
On a difference, re-measure and rewrite the table: .venv/bin/python tests/helpers/readme_sweep.py --update
"""

from __future__ import annotations

import pytest
from readme_sweep import (
    RESULTS,
    exported_blocks,
    quoted_exact_matches,
    readme_block,
    run_demo,
    run_sweep,
    shown_blocks,
    table_rows,
)


def test_the_docs_name_the_commit_the_sweep_table_was_measured_at():
    assert "Measured at commit `" in readme_block(RESULTS.read_text())
    assert len(set(quoted_exact_matches().values())) == 1, (
        f"README.md and docs/results.md quote different exact matches: {quoted_exact_matches()}")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_demo_results_are_what_the_demo_and_mimir_sweep_give(tmp_path):
    """The demo runs in a run directory of its own, never the user's runs/demo."""
    run_dir = tmp_path / "demo"
    printed = run_demo(run_dir=run_dir)
    for name, quoted in quoted_exact_matches().items():
        assert printed == quoted, (
            f"the demo command prints exact match {printed}, {name} quotes {quoted}: re-measure the demo results")
    assert shown_blocks() == exported_blocks(run_dir), (
        "README.md's demo model card or docs/results.md's training-data summary is not what the demo "
        "exports: .venv/bin/python tests/helpers/readme_sweep.py --update")
    measured = table_rows(run_sweep(tmp_path / "sweep", run_dir=run_dir))
    documented = table_rows(readme_block(RESULTS.read_text()))
    assert documented == measured, (
        "docs/results.md's schedule-sweep table is not what `mimir sweep` gives on the demo checkpoint; "
        "re-measure and rewrite it: .venv/bin/python tests/helpers/readme_sweep.py --update")
