"""The README's schedule-sweep table, measured: re-run `mimir sweep` on the demo checkpoint,
compare with README.md, or rewrite README.md's table (with the commit it was measured at).

    .venv/bin/python tests/helpers/readme_sweep.py            # re-measure; print the differences, exit 1 if any
    .venv/bin/python tests/helpers/readme_sweep.py --update   # re-measure and rewrite the table in README.md

The demo is trained first (bash launchers/demo_cpu.sh, ~6 min on 2 cores) when runs/demo has no
checkpoint; the sweep itself takes ~2.5 min. The check in tests/system/test_readme_results.py uses
the same functions, so the README and what the code produces cannot drift apart unnoticed.
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BEGIN = "<!-- sweep-table: begin (python tests/helpers/readme_sweep.py --update rewrites this block) -->"
END = "<!-- sweep-table: end -->"
CHECKPOINT = "runs/demo/checkpoints"
SWEEP = ["sweep", "--checkpoint", CHECKPOINT, "--suite", "configs/eval/demo.yaml", "--limit", "20"]


def readme_block(text: str) -> str:
    """The generated block of README.md (between the markers)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no sweep-table block ({BEGIN} ... {END})")
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


def table_rows(markdown: str) -> list[str]:
    """The table lines of a sweep's markdown (schedule table and McNemar table), cells trimmed."""
    return [" | ".join(cell.strip() for cell in line.strip().strip("|").split("|"))
            for line in markdown.splitlines() if line.strip().startswith("|")]


def ensure_demo(repo: Path = REPO) -> None:
    """Train the demo (launchers/demo_cpu.sh) unless its checkpoint is there already."""
    if not (repo / CHECKPOINT / "latest").is_file():
        subprocess.run(["bash", str(repo / "launchers" / "demo_cpu.sh")], cwd=repo, check=True)


def run_sweep(output: Path, repo: Path = REPO) -> str:
    """`mimir sweep` on the demo checkpoint into ``output`` (MLflow there too, so the check does
    not add runs to the demo's store); its table5.md."""
    cmd = [sys.executable, "-m", "mimir_megatron.cli", *SWEEP, "--output", str(output),
           "--tracking-uri", f"sqlite:///{output.resolve()}/mlflow.db"]
    subprocess.run(cmd, cwd=repo, check=True)
    return (output / "table5.md").read_text()


def commit(repo: Path = REPO) -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!README.md"],
                           cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    return head + ("+uncommitted changes" if dirty else "")


def rewritten(text: str, table: str, measured_at: str) -> str:
    block = (f"\nMeasured at commit `{measured_at}` with `mimir {' '.join(SWEEP)}`"
             f" (regenerate: `.venv/bin/python tests/helpers/readme_sweep.py --update`):\n\n{table.strip()}\n")
    return text[:text.index(BEGIN) + len(BEGIN)] + block + text[text.index(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite README.md's table")
    args = parser.parse_args(argv)
    ensure_demo()
    with tempfile.TemporaryDirectory() as tmp:
        table = run_sweep(Path(tmp) / "sweep")
    text = README.read_text()
    if args.update:
        README.write_text(rewritten(text, table, commit()))
        print(f"README.md: sweep table rewritten (commit {commit()})")
        return 0
    diff = list(difflib.unified_diff(table_rows(readme_block(text)), table_rows(table), "README.md",
                                     "mimir sweep", lineterm=""))
    print("\n".join(diff) or "README.md's sweep table is what `mimir sweep` gives")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
