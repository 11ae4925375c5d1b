"""Tiny prepared datasets with provenance, mixtures over them, and the one-line refusals of
`mimir` commands: what the data-rule tests (test_provenance, test_lineage_rule) share."""

from __future__ import annotations

import json
from pathlib import Path

from mimir_megatron.cli import main

TOK = str(Path(__file__).resolve().parents[2] / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer")
OPEN = ["--source", "Open set", "--license", "CC-BY-4.0", "--basis", "open-licence", "--form", "reformatted",
        "--language", "en", "--audit-group", "C"]


def write_raw(path: Path, n: int = 4, say: str = "Say") -> Path:
    """A JSONL file of ``n`` prompt/completion lines (``say`` words them)."""
    path.write_text("".join(json.dumps({"prompt": f"{say} {i}.", "completion": f"Number {i} said."}) + "\n"
                            for i in range(n)))
    return path


def prepare(tmp_path: Path, name: str, *flags: str, raw: Path | None = None) -> Path:
    """`mimir prepare` of ``raw`` (default: a new tiny file of its own wording) into ``tmp_path/name``."""
    raw = raw or write_raw(tmp_path / f"{name}.jsonl", say=f"Say ({name})")
    out = tmp_path / name
    assert main(["prepare", "-i", str(raw), "-t", TOK, "-o", str(out), "--seq-len", "64", "--workers", "1",
                 "--no-progress", *flags]) == 0
    return out


def mixture(tmp_path: Path, *names: str, policy: str = "") -> Path:
    """A mixture YAML over the datasets ``tmp_path/<name>`` (``policy``: its data_policy lines)."""
    lines = ["name: gov", "datasets:"] + [f"  - {{name: {n}, path: {tmp_path / n}, category: c}}" for n in names]
    path = tmp_path / "mix.yaml"
    path.write_text("\n".join(lines) + "\n" + policy)
    return path


def problems(mixture_path: Path, **kw) -> list[str]:
    """What `mimir train` would refuse of the mixture (the data gate's lines)."""
    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.data.policy import training_data_problems

    return training_data_problems(load_mixture(mixture_path), **kw)


def cli_error(caplog, *argv: str) -> str:
    """What `mimir` logs for a refused command (exit 2): its error, no traceback."""
    caplog.clear()
    assert main(list(argv)) == 2
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert text and "Traceback" not in caplog.text, caplog.text
    return text


def declared(**fields) -> dict:
    """The stored record (with its digest) of a declaration that validates (``source``, basis
    open-licence and form reformatted unless given)."""
    from mimir_megatron.data.provenance import ProvenanceDeclaration, resolve_declaration, stored_record

    values = {"source": "s", "basis": "open-licence", "form": "reformatted", **fields}
    errors: list[str] = []
    found = resolve_declaration(ProvenanceDeclaration(**values), "ds", default_id=fields.get("id", "ds"),
                                base=Path("."), errors=errors)
    assert found is not None, errors
    return stored_record(found)
