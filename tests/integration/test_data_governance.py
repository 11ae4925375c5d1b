"""The data lineage a checkpoint records, the training-data summary and model card `mimir export`
writes from it, and `mimir train` refusing data the policy forbids.

- The lineage equals a count made independently from the loader's batches (each packed segment
  matched back to its document by its tokens), at a checkpoint and the end. That it survives a
  kill -9 and resume is checked where those runs are (test_checkpoint_reliability compares the
  whole trainer state of resumed and uninterrupted runs), that it does not depend on the parallel
  layout in test_train_parallel.
- Trained for exactly one epoch, a run's summary and card hold the numbers `mimir data report`
  gives for the mixture (tokens per epoch with repeats, by dataset and form), and the card parses
  with huggingface_hub.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, train_overrides

from mimir_megatron.cli import main

TOK = str(REPO / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer")


def independent_counts(data_cfg, micro_batches: int, micro_batch_size: int) -> dict[str, Counter]:
    """Per dataset: documents, tokens and response tokens of the first micro-batches, from the
    batches' tensors alone."""
    from mimir_megatron.batch import IGNORE_INDEX
    from mimir_megatron.data import PreparedDataset, build_train_loader, load_mixture

    owner: dict[tuple[int, ...], str] = {}
    for entry in load_mixture(data_cfg.mixture).entries:
        ds = PreparedDataset(entry.path)
        for i in range(ds.num_documents):
            prefix, response = ds.document(i)
            key = tuple(prefix.tolist() + response.tolist())
            assert owner.setdefault(key, entry.name) == entry.name, "a document in two datasets"
    counts: dict[str, Counter] = {}
    loader = build_train_loader(data_cfg, micro_batch_size=micro_batch_size, dp_rank=0, dp_size=1)
    for _ in range(micro_batches):
        batch = next(loader)
        for row in range(batch.shape[0]):
            segments = batch.segment_ids[row]
            for seg in segments.unique().tolist():
                if seg == 0:
                    continue
                at = segments == seg
                labels = batch.labels[row][at]
                tokens = batch.input_ids[row][at].tolist() + [labels[-1].item()]
                tally = counts.setdefault(owner[tuple(tokens)], Counter())
                tally.update(documents=1, tokens=len(tokens),
                             response_tokens=int((labels != IGNORE_INDEX).sum()))
    return counts


def test_the_lineage_is_what_the_loader_fed(reference_run, demo_data):
    from mimir_megatron.checkpoint import read_trainer_state
    from mimir_megatron.train.config import load_train_config

    run_dir, _ = reference_run
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml", train_overrides(demo_data, run_dir))
    per_step = cfg.train.global_batch_size // cfg.train.micro_batch_size
    for step in (3, 6):
        lineage = read_trainer_state(run_dir / "checkpoints" / f"step_{step:07d}").lineage
        want = independent_counts(cfg.data, per_step * step, cfg.train.micro_batch_size)
        got = {e.name: Counter(documents=e.documents, tokens=e.tokens, response_tokens=e.response_tokens)
               for e in lineage if e.documents}
        assert got == want and len(got) > 2



def test_the_model_directory_names_the_run_and_the_lineage_the_trainer_wrote(reference_run, demo_data, tmp_path):
    """What `model_dir` says of a checkpoint in each of its forms (the latest is step 6) is what the
    trainer wrote: the run directory it was configured with (its config.yaml and MLflow store there)
    and the lineage of the latest checkpoint (step 3's differs: fewer documents seen).

    The lineage is compared with the step-6 trainer state, not with the run's MLflow
    ``data/lineage.json``: the session's reference run is copied and resumed by other tests, and a
    copied run directory's MLflow store still names the original's artifact folder (MLflow stores
    absolute artifact locations), so a resumed copy's checkpoint rewrites that file."""
    from dataclasses import asdict

    from mlflow.tracking import MlflowClient

    from mimir_megatron.checkpoint import detect_model_dir, read_trainer_state
    from mimir_megatron.train.config import load_train_config

    run_dir, result = reference_run
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml", train_overrides(demo_data, run_dir))
    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    states = {step: read_trainer_state(run_dir / "checkpoints" / f"step_{step:07d}") for step in (3, 6)}
    logged = json.loads(json.dumps([asdict(e) for e in states[6].lineage], default=str))
    assert logged != json.loads(json.dumps([asdict(e) for e in states[3].lineage], default=str))
    for form in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "step_0000006"):
        source = detect_model_dir(form)
        found = source.run_directory
        assert found is not None and found.root == cfg.run_dir and found.checkpoints == cfg.checkpoint_dir, form
        assert found.config_file.is_file() and client.get_run(result.run_id)  # the trainer's store is there
        assert found.mlflow_uri == client.tracking_uri
        assert json.loads(json.dumps([asdict(e) for e in source.lineage], default=str)) == logged, form
    assert sum(e["documents"] for e in logged) > 0

def _prepare(tmp_path: Path, name: str, lines: list[dict], *flags: str) -> None:
    raw = tmp_path / f"{name}.jsonl"
    raw.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["prepare", "-i", str(raw), "-t", TOK, "-o", str(tmp_path / name), "--seq-len", "64",
                 "--workers", "1", "--no-progress", *flags]) == 0


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """Two declared datasets (one repeated twice), trained for exactly one epoch and exported."""
    from mimir_megatron.data import PackedMixture
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    root = tmp_path_factory.mktemp("epoch")
    _prepare(root, "open-en", [{"prompt": f"Count to {i}.", "completion": " ".join(map(str, range(i)))}
                               for i in range(2, 12)],
             "--source", "Counting", "--source-location", "org/counting", "--license", "CC-BY-4.0",
             "--basis", "open-licence", "--form", "reformatted", "--language", "en", "--audit-group", "C")
    _prepare(root, "synth-da", [{"prompt": f"Gentag {i}.", "completion": f"{i} {i} {i}"} for i in range(8)],
             "--source", "Gentagelser", "--license", "Apache-2.0 AND CC-BY-4.0", "--basis", "synthetic",
             "--form", "synthetic-audited", "--language", "da", "--audit-group", "D",
             "--derived-from", str(root / "open-en"))
    mixture = root / "mix.yaml"
    mixture.write_text("name: epoch\ndatasets:\n"
                       f"  - {{name: open-en, path: {root / 'open-en'}, category: Counting, repeat: 1}}\n"
                       f"  - {{name: synth-da, path: {root / 'synth-da'}, category: Repetition, repeat: 2}}\n")
    overrides = [*train_overrides(root, root / "run"), f"data.mixture={mixture}", "data.eval_path=null",
                 "train.global_batch_size=1", "train.micro_batch_size=1", "tracking.enabled=false"]
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml", overrides)
    contexts = PackedMixture(cfg.data).epoch(0).num_contexts
    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml",
                            [*overrides, f"train.steps={contexts}", f"checkpoint.interval={contexts}"])
    train(cfg)
    out = root / "export"
    report = root / "contamination.json"  # the fields the summary reads, as `mimir audit contamination` writes
    datasets = [{"name": n, "manifest_digest": json.loads((root / n / "manifest.json").read_text())["digest"]}
                for n in ("open-en", "synth-da")]
    report.write_text(json.dumps({"format": "mimir-contamination-v1", "suite": "demo", "ngram": 13, "benchmarks": {
        "arith": {"items": 40, "contaminated": 2, "longest_span": {"tokens": 21}, "data_sha256": "x"}},
        "datasets": datasets}))
    assert main(["export", "--checkpoint", str(root / "run"), "--output", str(out), "--license", "Apache-2.0",
                 "--provider", "Test Lab", "--contamination", str(report)]) == 0
    return mixture, out, root, report


def test_export_refuses_an_unrelated_report_and_a_manifest_changed_since_training(one_epoch, caplog):
    """A contamination report built on other data, and a manifest whose licence was changed after
    training with both digests recomputed: each named, exit 2, nothing written."""
    from mimir_megatron.data.manifest import write_manifest
    from mimir_megatron.data.provenance import record_digest

    _, _, root, report = one_epoch
    export = ["export", "--checkpoint", str(root / "run"), "--output", str(root / "refused"), "--license",
              "Apache-2.0"]
    unrelated = root / "unrelated.json"
    body = json.loads(report.read_text())
    body["datasets"] = body["datasets"][:1]
    unrelated.write_text(json.dumps(body))
    assert main([*export, "--contamination", str(unrelated)]) == 2
    assert f"{unrelated}: built on other data than this checkpoint was trained on: its index does not hold " \
           "synth-da as trained" in caplog.text
    manifest_path = root / "open-en" / "manifest.json"
    original = manifest_path.read_text()
    manifest = json.loads(original)
    manifest["provenance"]["license"] = "CC0-1.0"
    manifest["provenance"]["digest"] = record_digest(manifest["provenance"])
    write_manifest(manifest_path.parent, manifest)  # its digest recomputed by the one writer
    try:
        caplog.clear()
        assert main([*export, "--contamination", str(report)]) == 2
        assert f"dataset open-en: its manifest {manifest_path} changed since this checkpoint was trained" in caplog.text
    finally:
        manifest_path.write_text(original)
    assert not (root / "refused").exists()


def test_one_epoch_summary_and_card_hold_the_data_reports_numbers(one_epoch):
    from huggingface_hub import ModelCard
    from mimir_data_prep.mixture_report import dataset_rows, group_rows

    from mimir_megatron.data import load_mixture

    mixture, out, _, _ = one_epoch
    summary = json.loads((out / "training_data_summary.json").read_text())
    rows = {r.name: r for r in dataset_rows(load_mixture(mixture))}
    trained = {r["dataset"]: r for r in summary["sources"]["public_datasets"] + summary["sources"]["synthetic_data"]}
    assert {n: r["tokens"] for n, r in trained.items()} == {n: r.tokens_per_epoch for n, r in rows.items()}
    assert rows["synth-da"].tokens_per_epoch == 2 * rows["synth-da"].tokens  # the repeat counted
    report_forms = {g.key: g.tokens_per_epoch for g in group_rows(list(rows.values()), "form")}
    assert {"Reformatted": summary["tables"]["by_form"]["reformatted"],
            "Synthetic + audited": summary["tables"]["by_form"]["synthetic-audited"]} == report_forms
    assert summary["general"]["languages"] == {"da": trained["synth-da"]["tokens"], "en": trained["open-en"]["tokens"]}
    assert trained["synth-da"]["license"] == "Apache-2.0 AND CC-BY-4.0" and trained["synth-da"]["derived_from"][0]["id"] == "open-en"

    card = ModelCard((out / "README.md").read_text())
    assert (card.data.license, sorted(card.data.language), card.data.datasets) == ("apache-2.0", ["da", "en"],
                                                                                    ["org/counting"])
    total = summary["general"]["training_tokens"]
    for license_, tokens in summary["tables"]["by_license"].items():
        assert f"| {license_} | {tokens:,} | {100 * tokens / total:.1f} % |" in card.text
    markdown = (out / "training_data_summary.md").read_text()
    assert "Provider: Test Lab" in markdown and f"Training data: {total:,} tokens" in markdown
    assert "demo / arith (13-token n-grams): 2 of 40 items (5.0 %), longest shared span 21 tokens" in markdown


def test_train_refuses_data_the_policy_forbids_before_training(tmp_path, demo_data, caplog):
    """An agreement-supplied dataset trained on directly and one with no declared provenance:
    both named, exit 2; nothing but the run directory's lock is written (the lock is taken first,
    so that a second trainer is refused before it reads the data)."""
    _prepare(tmp_path, "agreed", [{"prompt": "a", "completion": "b c"}], "--source", "Partner", "--license",
             "proprietary-agreement", "--basis", "agreement", "--form", "agreement-supplied")
    _prepare(tmp_path, "plain", [{"prompt": "a", "completion": "b c"}])
    mixture = tmp_path / "mix.yaml"
    mixture.write_text("name: bad\ndatasets:\n" + "".join(
        f"  - {{name: {n}, path: {tmp_path / n}, category: c}}\n" for n in ("agreed", "plain")))
    run_dir = tmp_path / "run"
    overrides = [*train_overrides(demo_data, run_dir), f"data.mixture={mixture}"]
    assert main(["train", "--config", str(REPO / "configs" / "train" / "demo.yaml"), *overrides]) == 2
    assert sorted(p.name for p in run_dir.iterdir()) == ["train.lock"]
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refusing to train")]
    assert len(refused) == 1, caplog.text
    lines = refused[0].splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == ["  - dataset agreed", "  - dataset plain"], lines
