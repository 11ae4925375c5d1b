"""Personal-data screen benchmark: precision and recall per kind on a labelled sample, and speed.

    python bench/bench_personal_data.py                 # the checked-in sample
    python bench/bench_personal_data.py --show          # and every miss and false alarm
    python bench/bench_personal_data.py --sample F.jsonl --repeat 20

The sample (``tests/data/personal_data_sample.jsonl``) is hand-written prose in English and
Danish, one JSON object a line: ``text``, ``lang``, ``kinds`` (the kinds of personal data the
line holds, [] for a clean line) and ``form`` (how the identifier is written, or which look-alike
a clean line holds: ``cpr-space``, ``iban lower``, ``isbn10``, ``score``, ``cvr``, ``coord``,
``version``, ``arith``...). The identifiers are made up but valid for their validators (check
digits computed), written the ways people write them, some in forms the screen does not take
(an e-mail address spelled out); the clean lines hold the numbers that look like identifiers in
real text: ISBNs, set scores, CVR numbers, coordinates, four-part version numbers, arithmetic,
dates, order and case numbers, barcodes, amounts. The lines marked ``"split": "held-out"`` were
written after the screen's rules and measured once before any rule was changed (two general fixes
they showed followed: dates written 2024.03.12, networks and netmasks); the others were written
alongside the rules (their figures flatter the screen).

A line counts as found for a kind when the screen reports that kind in it; a kind reported in a
line not labelled with it is a false positive. ``clean rejected`` is the share of clean lines
that ``--personal-data reject`` would drop (a direct identifier reported). Not a test: speed
depends on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "personal_data_sample.jsonl"


def main() -> None:
    from mimir_data_prep.personal_data import DIRECT, KINDS, find

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=Path, default=SAMPLE, help="labelled JSONL (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=5, help="passes over the sample for the speed figure")
    parser.add_argument("--show", action="store_true", help="print every miss and false positive")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.sample.read_text(encoding="utf-8").splitlines() if line.strip()]
    found = [{k for k, _, _ in find(row["text"])} for row in rows]
    started = time.process_time()
    for _ in range(args.repeat):
        for row in rows:
            find(row["text"])
    seconds = time.process_time() - started
    total, hit, predicted, correct = Counter(), Counter(), Counter(), Counter()
    misses, alarms = [], []
    for row, kinds in zip(rows, found):
        labels = set(row["kinds"])
        for kind in labels:
            total[kind] += 1
            hit[kind] += kind in kinds
            if kind not in kinds:
                misses.append((kind, row))
        for kind in kinds:
            predicted[kind] += 1
            correct[kind] += kind in labels
            if kind not in labels:
                alarms.append((kind, row))
    personal = [kinds for row, kinds in zip(rows, found) if row["kinds"]]
    clean = [kinds for row, kinds in zip(rows, found) if not row["kinds"]]
    langs = Counter(row["lang"] for row in rows)
    print(f"{args.sample.name}: {len(personal)} lines with personal data, {len(clean)} clean "
          f"({', '.join(f'{n} {lang}' for lang, n in sorted(langs.items()))}); "
          f"{args.repeat * len(rows) / seconds:,.0f} lines a CPU-second")
    print("| kind | lines | recall | precision |\n| --- | ---: | ---: | ---: |")
    for kind in KINDS:
        recall = f"{hit[kind] / total[kind]:.2f}" if total[kind] else "-"
        precision = f"{correct[kind] / predicted[kind]:.2f}" if predicted[kind] else "-"
        print(f"| {kind} | {total[kind]} | {recall} | {precision} |")
    found_any = sum(1 for kinds in personal if kinds)
    rejected = sum(1 for kinds in clean if kinds & DIRECT)
    flagged = sum(1 for kinds in clean if kinds)
    print(f"lines with personal data found (any kind): {found_any} of {len(personal)} "
          f"(recall {found_any / len(personal):.3f})")
    print(f"clean lines rejected: {rejected} of {len(clean)} ({100 * rejected / len(clean):.1f} %); "
          f"flagged with any kind: {flagged}")
    for split in sorted({row.get("split", "development") for row in rows}):
        part = [(row, kinds) for row, kinds in zip(rows, found) if row.get("split", "development") == split]
        held = [kinds for row, kinds in part if row["kinds"]]
        free = [kinds for row, kinds in part if not row["kinds"]]
        print(f"  {split} lines: recall {sum(1 for k in held if k) / max(1, len(held)):.3f} of {len(held)}, "
              f"clean rejected {sum(1 for k in free if k & DIRECT)} of {len(free)}")
    for what, items in (("misses", misses), ("false positives", alarms)):
        print(f"{what} by form:", dict(Counter(f"{kind} {row['form']}" for kind, row in items).most_common()))
    if args.show:
        for what, items in (("missed", misses), ("false positive", alarms)):
            for kind, row in items:
                print(f"{what} {kind} [{row['form']}]: {row['text']}")


if __name__ == "__main__":
    main()
