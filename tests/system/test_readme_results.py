"""Numbers the docs present as a shipped command's output are what that command gives now.

The demo command's exact match (README.md's expected output and docs/results.md) and the schedule
sweep on its checkpoint (docs/results.md), and what README.md and docs/results.md show of the demo's
exported model card and training-data summary: runs launchers/demo_cpu.sh in a temporary run
directory (~4 min on 2 cores alone, ~8 min beside the suite's other worker), then ~1 min of `mimir sweep`.
On a difference, re-measure and rewrite the table: .venv/bin/python tests/helpers/readme_sweep.py --update

The numbers are bit for bit on the kind of CPU docs/results.md names (torch's kernels round by the
CPU's capability); on another kind the check allows what rounding moves (readme_sweep's slacks).
"""

from __future__ import annotations

import pytest
from readme_sweep import (
    RESULTS,
    cpu_kind,
    exact_matches_agree,
    KindResults,
    exported_blocks,
    mean_score,
    other_kinds,
    quoted_exact_matches,
    readme_block,
    recorded_cpu_kind,
    run_demo,
    run_sweep,
    shown_blocks,
    table_differences,
    table_rows,
    with_other_kind,
)


def test_the_docs_name_the_commit_and_cpu_kind_the_sweep_table_was_measured_at():
    assert "Measured at commit `" in readme_block(RESULTS.read_text())
    # torch's capability, then the vendor (readme_sweep.cpu_kind)
    assert recorded_cpu_kind().split()[0] in ("DEFAULT", "VSX", "Z", "NO", "AVX2", "AVX512", "SVE256")
    assert len(set(quoted_exact_matches().values())) == 1, (
        f"README.md and docs/results.md quote different exact matches: {quoted_exact_matches()}")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_demo_results_are_what_the_demo_and_mimir_sweep_give(tmp_path):
    """The demo runs in a run directory of its own, never the user's runs/demo."""
    run_dir = tmp_path / "demo"
    same_kind = cpu_kind() == recorded_cpu_kind()
    known = None if same_kind else other_kinds().get(cpu_kind())  # a kind docs/results.md lists besides
    printed = run_demo(run_dir=run_dir)
    for name, quoted in quoted_exact_matches().items():
        assert exact_matches_agree(printed, quoted, same_kind, known), (
            f"the demo command prints exact match {printed}, {name} quotes {quoted} (this CPU: {cpu_kind()}, "
            f"documented: {recorded_cpu_kind()}; recorded for this kind: {known and known.exact_match}): "
            "re-measure the demo results")
    assert shown_blocks() == exported_blocks(run_dir), (
        "README.md's demo model card or docs/results.md's training-data summary is not what the demo "
        "exports: .venv/bin/python tests/helpers/readme_sweep.py --update")
    measured = table_rows(run_sweep(tmp_path / "sweep", run_dir=run_dir))
    documented = table_rows(readme_block(RESULTS.read_text()))
    differences = table_differences(documented, measured, same_kind, known)
    assert not differences, (
        "docs/results.md's schedule-sweep table is not what `mimir sweep` gives on the demo checkpoint; "
        "re-measure and rewrite it: .venv/bin/python tests/helpers/readme_sweep.py --update\n"
        + "\n".join(differences))


def test_another_cpu_kind_allows_rounding_and_nothing_more():
    """Hand-made rows: on the documented kind every cell counts; on another, the layout and the
    mean score (other weights: any one cell of 20 samples may move)."""
    documented = ["D | H | L | schedule | Arith EN | Text DA", "8 | 2 | 3 | LLLHLLLH (trained) | 15.00 | 75.00",
                  "task | A | B | n | right only under A | right only under B | p (exact McNemar)",
                  "algo_da | 2x3 | 1x3 | 20 | 2 | 0 | 0.5"]
    rounding = ["D | H | L | schedule | Arith EN | Text DA", "8 | 2 | 3 | LLLHLLLH (trained) | 0.00† | 80.00",
                "task | A | B | n | right only under A | right only under B | p (exact McNemar)",
                "algo_da | 2x3 | 1x3 | 20 | 0 | 1 | 1"]
    assert table_differences(documented, documented, same_kind=True) == []
    assert table_differences(documented, rounding, same_kind=True)
    assert table_differences(documented, rounding, same_kind=False) == []
    relabelled = [row.replace("LLLHLLLH", "LHLH").replace("| 20 |", "| 19 |") for row in rounding]
    assert len(table_differences(documented, relabelled, same_kind=False)) == 2
    collapsed = [row.replace("80.00", "50.00") for row in rounding]  # mean 45 -> 25
    assert table_differences(documented, collapsed, same_kind=False) == [
        "mean score 25.0 measured, 45.0 documented (another CPU kind may move it by 5 points)"]
    assert table_differences(documented, rounding[:3], same_kind=False) == [
        "docs/results.md's tables have 4 rows, `mimir sweep` gives 3"]
    assert exact_matches_agree("0.287", "0.287", same_kind=True)
    assert not exact_matches_agree("0.280", "0.287", same_kind=True)
    assert exact_matches_agree("0.280", "0.287", same_kind=False)
    assert not exact_matches_agree("0.220", "0.287", same_kind=False)
    # A kind docs/results.md lists besides the documented one: its own row, every digit.
    known = KindResults("AVX2 AuthenticAMD", "abc1234", "0.213", mean_score(rounding))
    assert exact_matches_agree("0.213", "0.263", same_kind=False, known=known)
    assert not exact_matches_agree("0.214", "0.263", same_kind=False, known=known)
    assert table_differences(documented, rounding, same_kind=False, known=known) == []
    nudged = [row.replace("80.00", "85.00") for row in rounding]  # within the slack, not the row
    assert table_differences(documented, nudged, same_kind=False) == []
    assert table_differences(documented, nudged, same_kind=False, known=known) == [
        f"mean score 42.50 measured, {known.mean_score} recorded for `AVX2 AuthenticAMD` in docs/results.md"]
    assert len(table_differences(documented, relabelled, same_kind=False, known=known)) == 2


def test_other_kinds_rows_read_back_as_written():
    text = RESULTS.read_text()
    row = KindResults("SVE256 ARM", "0123abc", "0.250", "17.50")
    assert other_kinds(with_other_kind(text, row))["SVE256 ARM"] == row
    assert other_kinds(with_other_kind(with_other_kind(text, row), row)) == {**other_kinds(text), row.kind: row}
