"""Mixture YAML parsing and the Table 1 / Table 8 report, with numbers checked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from mimir_data_prep.mixture_report import dataset_rows, format_report, group_rows

from mimir_megatron.data import load_mixture
from mimir_megatron.errors import UserError


def _manifest(path: Path, tokens: int, personal_data: dict | None = None) -> None:
    """A manifest with the fields every one has (no shards: only its counts are read here)."""
    from mimir_megatron.data.manifest import write_manifest

    path.mkdir(parents=True)
    write_manifest(path, {"documents": 0, "tokens": {"total": tokens}, "tokenizer": {"sha256": "0" * 64},
                          "shards": [], "outputs": {},
                          **({"personal_data": personal_data} if personal_data else {})})


@pytest.fixture
def mixture(tmp_path):
    _manifest(tmp_path / "da1", 1000, {"policy": "reject", "found": {"email": 3, "iban": 0, "phone_number": 1200},
                                       "documents_rejected": 1203})
    _manifest(tmp_path / "da2", 3000, {"policy": "redact", "found": {}, "documents_rejected": 0})
    _manifest(tmp_path / "en1", 500)
    path = tmp_path / "mix.yaml"
    path.write_text(
        "name: small\n"
        "datasets:\n"
        "  - {path: da1, category: Danish, language: da, repeat: 4}\n"  # 4000
        "  - {path: da2, category: Danish, language: da}\n"  # 3000
        "  - {path: en1, category: Math, language: en, repeat: 0.5}\n"  # 250
        "  - {name: planned, path: nowhere, category: Math, language: da, tokens: 2750}\n"
    )
    return load_mixture(path)


def test_report_numbers(mixture):
    rows = dataset_rows(mixture)
    assert [(r.name, r.tokens_per_epoch, r.declared) for r in rows] == [
        ("da1", 4000, False),
        ("da2", 3000, False),
        ("en1", 250, False),
        ("planned", 2750, True),
    ]
    cats = group_rows(rows, "category")  # total 10,000 tokens per epoch
    assert [
        (g.key, g.tokens_per_epoch, g.share, g.datasets, g.avg_tokens_per_dataset) for g in cats
    ] == [("Danish", 7000, 70.0, 2, 3500.0), ("Math", 3000, 30.0, 2, 1500.0)]
    langs = group_rows(rows, "language")
    assert [(g.key, g.tokens_per_epoch, g.share, g.datasets) for g in langs] == [
        ("da", 9750, 97.5, 3),
        ("en", 250, 2.5, 1),
    ]
    text = format_report(mixture, top=2)
    assert "4 datasets, 10,000 tokens per epoch" in text
    danish = next(line for line in text.splitlines() if line.startswith("Danish "))
    assert danish.split() == ["Danish", "7,000", "70.00%", "2", "3,500"]
    top = text.split("Top 2 datasets by tokens per epoch")[1].splitlines()
    assert top[2].split()[:2] == ["1", "da1"] and top[3].split()[:2] == ["2", "da2"]
    assert "* size declared" in text
    screen = text.split("Personal data (")[1].split("\n\n")[0].splitlines()
    assert [line.split() for line in screen[2:]] == [
        ["da1", "reject", "1,203", "3", "email,", "1,200", "phone_number"],
        ["da2", "redact", "0", "none"],
        ["en1", "not", "screened", "-", "(prepared", "before", "the", "screen)"],
    ]  # the planned dataset (not prepared) has no line


@pytest.mark.parametrize(
    "body, message",
    [
        ("datasets: []", "'datasets' is empty"),
        ("datasets:\n  - {category: x}", r"datasets\[0\]: 'path' is required"),
        ("datasets:\n  - {path: a, repeat: -1}", "'repeat' must be a number >= 0"),
        ("datasets:\n  - {path: a, wieght: 2}", r"unknown key\(s\) \['wieght'\]"),
        ("datasets:\n  - {path: a}\n  - {path: a}", "duplicate dataset name 'a'"),
        ("datasets: [\n", r"mix.yaml:\d+: invalid YAML"),
    ],
)
def test_mixture_errors_name_file_and_entry(tmp_path, body, message):
    path = tmp_path / "mix.yaml"
    path.write_text(body)
    with pytest.raises(UserError, match=message):
        load_mixture(path)


def test_unprepared_dataset_without_declared_size_is_a_user_error(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text("datasets:\n  - {path: missing}\n")
    with pytest.raises(UserError, match="not prepared"):
        format_report(load_mixture(path))


def test_shipped_mixtures_load():
    root = Path(__file__).resolve().parents[2] / "configs" / "data"
    names = sorted(p.name for p in root.glob("*.yaml"))
    assert names == ["demo.yaml", "mimir_v1_example.yaml"]
    example = load_mixture(root / "mimir_v1_example.yaml")
    assert {e.repeat for e in example.entries} >= {1.0, 4.0, 10.0, 20.0}
    text = format_report(example)
    assert "70,479,308,60" in text and "Danish instruction & knowledge" in text
    assert len(load_mixture(root / "demo.yaml").entries) == 6


def test_a_mistyped_personal_data_record_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match=r"personal_data\.found\.email: an integer expected"):
        _manifest(tmp_path / "a", 10, {"policy": "reject", "found": {"email": "3"}, "documents_rejected": 0})
    with pytest.raises(UserError, match=r"personal_data\.documents_rejected: missing"):
        _manifest(tmp_path / "b", 10, {"policy": "reject", "found": {}})
