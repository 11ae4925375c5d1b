"""The demo data set and tokenizer: deterministic, within the tiny model's vocab and context."""

from __future__ import annotations

import json
import re

import numpy as np
from mimir_data_prep.demo_data import generate
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR, VOCAB_SIZE, train_demo_tokenizer

from mimir_megatron.cli import main
from mimir_megatron.data import PreparedDataset, load_eval_samples


def test_generator_is_deterministic_and_held_out_is_disjoint():
    a_train, a_eval = generate(seed=0, train_per_group=200, eval_per_group=20)
    b_train, b_eval = generate(seed=0, train_per_group=200, eval_per_group=20)
    assert a_train == b_train and a_eval == b_eval
    c_train, _ = generate(seed=1, train_per_group=200, eval_per_group=20)
    assert c_train != a_train
    assert sorted(a_train) == ["algo-da", "algo-en", "arith-da", "arith-en", "text-da", "text-en"]
    for name, samples in a_eval.items():
        assert len(samples) == 20
        assert not {s.prompt for s in samples} & {s.prompt for s in a_train[name]}
    for s in a_train["arith-en"]:
        if s.task in ("add", "sub"):
            a, op, b = re.match(r"What is (\d+) ([+-]) (\d+)\?", s.prompt).groups()
            assert s.completion == f"Answer: {int(a) + int(b) if op == '+' else int(a) - int(b)}"
    assert {s.task for s in a_train["text-da"]} == {"repair", "spans", "continue", "reorder"}


def test_committed_tokenizer_regenerates_byte_for_byte(tmp_path):
    train_demo_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tok" / name).read_bytes() == (DEMO_TOKENIZER_DIR / name).read_bytes()
    vocab = json.loads((DEMO_TOKENIZER_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    assert max(vocab.values()) < VOCAB_SIZE == 1024


def test_demo_command_prepares_samples_that_fit_the_tiny_model(tmp_path):
    out = tmp_path / "demo"
    assert (
        main(
            [
                "data",
                "demo",
                "--output",
                str(out),
                "--train-per-group",
                "150",
                "--eval-per-group",
                "10",
            ]
        )
        == 0
    )
    for name in ("arith-en", "arith-da", "algo-en", "algo-da", "text-en", "text-da"):
        ds = PreparedDataset(out / name)
        assert ds.record.rejected == 0 and ds.num_documents == 150
        total = ds.prefix_lengths.astype(int) + ds.response_lengths
        assert total.max() < 200  # well under the 256-token context
        assert ds.response_lengths.min() >= 2
        for i in range(0, 150, 7):
            prefix, response = ds.document(i)
            assert np.concatenate([prefix, response]).max() < 1024
    samples = load_eval_samples(out / "eval")
    assert len(samples) == 60
    assert all(s.completion_ids[-1] == 4 for s in samples)  # <end_of_turn>
    assert all(s.prompt_ids[-3:] == samples[0].prompt_ids[-3:] for s in samples)  # gen. prompt


def test_reuse_keeps_data_this_recipe_built_and_rebuilds_an_older_versions(tmp_path, monkeypatch):
    """`mimir data demo --reuse` (launchers/demo_cpu.sh): a second run keeps what the same recipe
    built; data whose declarations differ from today's (an older version's demo) is built again."""
    import mimir_data_prep.demo_build as demo_build
    import mimir_data_prep.prepare as prepare_module

    out = tmp_path / "demo"
    sizes = ["--output", str(out), "--train-per-group", "4", "--eval-per-group", "2", "--workers", "1"]
    assert main(["data", "demo", *sizes, "--reuse"]) == 0
    prepared = []
    real_prepare = prepare_module.prepare
    monkeypatch.setattr(prepare_module, "prepare", lambda inputs, *a, **k: prepared.append(inputs) or
                        real_prepare(inputs, *a, **k))
    assert main(["data", "demo", *sizes, "--reuse"]) == 0
    assert prepared == []  # kept
    assert main(["data", "demo", *sizes, "--reuse", "--seed", "1"]) == 0
    assert len(prepared) == 7  # another seed: all six groups and the held-out split again
    prepared.clear()
    real_provenance = demo_build.demo_provenance
    monkeypatch.setattr(demo_build, "demo_provenance",  # as an older version declared it
                        lambda name: real_provenance(name).__class__(
                            **{**real_provenance(name).__dict__, "notes": "older declaration"}))
    assert main(["data", "demo", *sizes, "--reuse", "--seed", "1"]) == 0
    assert len(prepared) == 7
    assert (out / "arith-en" / "manifest.json").is_file()
