"""A prepare config of several datasets (one derived from another), and the reference it is
checked against: its datasets prepared one after another, as `mimir prepare --config` did
before it prepared them side by side."""

from __future__ import annotations

import json
from pathlib import Path

from chat_lines import chat, write_lines
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR

PROVENANCE = "{source: s, license: CC-BY-4.0, basis: open-licence, form: reformatted}"


def write_config(root: Path, *, missing: bool = False) -> Path:
    """Four datasets: ``a`` and ``c`` declared, ``b`` (sharegpt, a bad line) undeclared, ``d``
    derived from ``a`` by name. ``missing``: ``b``'s input does not exist, and ``d`` derives from ``b``."""
    raw = root / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_lines(raw / "a.jsonl", [chat(f"What is {i} + 2?", f"It is {i + 2}. " * (i % 9 + 1)) for i in range(40)])
    if not missing:
        turns = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there, how can I help?"}]
        write_lines(raw / "b.jsonl", [json.dumps({"conversations": turns})] * 25 + ["{broken"])
    write_lines(raw / "c.jsonl", [chat(f"Copy: {i}", f"{i} " * (i % 5 + 2)) for i in range(30)])
    write_lines(raw / "d.jsonl", [chat(f"Sort {i}, 1", f"1, {i}") for i in range(12)])
    parent = "b" if missing else "a"
    derived = f"{{source: s, basis: synthetic, form: synthetic-audited, derived_from: [{parent}]}}"
    config = root / "prepare.yaml"
    config.write_text(
        f"tokenizer: {DEMO_TOKENIZER_DIR}\nseq_len: 128\ndatasets:\n"
        f"  - {{name: a, input: [raw/a.jsonl], output: out/a, provenance: {PROVENANCE}}}\n"
        "  - {name: b, input: [raw/b.jsonl], output: out/b}\n"
        f"  - {{name: c, input: [raw/c.jsonl], output: out/c, personal_data: report,\n"
        f"     provenance: {PROVENANCE}}}\n"
        "  - {name: d, input: [raw/d.jsonl], output: out/d,\n"
        f"     provenance: {derived}}}\n"
    )
    return config


def one_after_another(config: Path, shard_bytes: int) -> list:  # of Manifest
    """The datasets of ``config`` prepared in order, each with prepare() (the reference)."""
    from mimir_data_prep.prepare import prepare
    from mimir_data_prep.prepare_config import dataset_provenance, load_prepare_config

    job = load_prepare_config(config)
    manifests = []
    for i, d in enumerate(job.datasets):
        errors: list[str] = []
        provenance = dataset_provenance(d, f"datasets[{i}]", config.parent, job, i, errors, prepared=True)
        assert errors == []
        manifests.append(prepare(d.input, job.tokenizer, d.output, seq_len=job.seq_len, workers=1,
                                 progress=False, shard_bytes=shard_bytes, input_format=d.input_format,
                                 provenance=provenance,
                                 personal_data=d.personal_data or job.personal_data))
    return manifests


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path: what byte-for-byte equality compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
