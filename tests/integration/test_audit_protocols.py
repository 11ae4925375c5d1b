"""The audit protocols against a fake model whose memorised documents are known exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from audit_support import RecordingTracking, write_prepared

from mimir_megatron.audits import AuditIndex, AuditSource, build_index
from mimir_megatron.audits.continuation import ContinuationSettings, run_continuation_audit
from mimir_megatron.audits.prefix import PrefixSettings, run_prefix_audit

JUNK = 900  # never in the corpus: an output of it matches nothing


class FakeModel:
    """Continues a prompt verbatim when it occurs in a memorised document, else emits junk."""

    name = "fake"

    def __init__(self, memorised: list[list[int]]) -> None:
        self.memorised = memorised
        self.calls = 0

    def _continue(self, prompt: list[int], n: int) -> list[int]:
        for doc in self.memorised:
            for o in range(len(doc) - len(prompt) + 1):
                if doc[o:o + len(prompt)] == prompt:
                    return doc[o + len(prompt):o + len(prompt) + n]
        return [JUNK] * n

    def greedy(self, prompts, max_new_tokens, stop=True):
        self.calls += 1
        return [self._continue(list(p), max_new_tokens) for p in prompts]

    def greedy_reproduces(self, pairs):
        return [self._continue(list(c), len(x)) == list(x) for c, x in pairs]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def prompt_ids(self, record):
        return record["prompt_ids"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    rng = np.random.default_rng(0)
    datasets = {}
    for name in ("a1", "a2", "b"):
        docs = []
        for _ in range(15):
            n = int(rng.integers(60, 100))
            ids = rng.integers(0, 50, n).tolist()
            docs.append((ids[:12], ids[12:]))
        datasets[name] = docs
        write_prepared(root / name, docs)
    sources = [AuditSource("a1", root / "a1", "A"), AuditSource("a2", root / "a2", "A"),
               AuditSource("b", root / "b", "B")]
    index = AuditIndex(build_index(sources, root / "idx", shard_tokens=1500, progress=False))
    full = {name: [p + r for p, r in docs] for name, docs in datasets.items()}
    memorised = full["a1"][:5] + full["a2"][:3] + full["b"][:1]
    return index, sources, full, memorised


def brute_longest(output: list[int], full: dict[str, list[list[int]]]) -> tuple[int, set]:
    """Longest span (first position on ties) and the documents that contain it."""
    docs = [(name, d, doc) for name, ds in full.items() for d, doc in enumerate(ds)]

    def common(i, doc, s):
        k = 0
        while i + k < len(output) and s + k < len(doc) and output[i + k] == doc[s + k]:
            k += 1
        return k

    lengths = [max(common(i, doc, s) for _, _, doc in docs for s in range(len(doc))) for i in range(len(output))]
    if not lengths or max(lengths) == 0:
        return 0, set()
    best = max(lengths)
    span = output[lengths.index(best):lengths.index(best) + best]
    return best, {(n, d) for n, d, doc in docs if any(doc[s:s + best] == span for s in range(len(doc)))}


def test_prefix_audit_table_matches_brute_force(corpus):
    index, _, full, memorised = corpus
    model = FakeModel(memorised)
    settings = PrefixSettings(categories=["A", "B"], per_category=12, prefix_tokens=20, max_new_tokens=40,
                              min_match=5, long_match=30, seed=3)
    generic = [{"prompt_ids": full["b"][0][:20]}, {"prompt_ids": [JUNK] * 5}]
    rows, outcomes, lengths = run_prefix_audit(model, index, settings, generic, progress=False)
    category_of = {"a1": "A", "a2": "A", "b": "B"}
    by_setting = {r["setting"]: r for r in rows}
    assert list(by_setting) == ["Prefix A", "Prefix B", "Generic"]
    assert by_setting["Prefix A"]["training documents"] == 30 and by_setting["Generic"]["training documents"] == 45
    for setting, key in (("Prefix A", "A"), ("Prefix B", "B"), ("Generic", "generic")):
        mine = [o for o in outcomes if o.setting == key]
        matched, long = set(), set()
        for o in mine:
            length, docs = brute_longest(o.output_ids, full)
            assert o.span_length == length
            docs = {d for d in docs if key == "generic" or category_of[d[0]] == key}
            if length >= 5:
                matched |= docs
            if length >= 30:
                long |= docs
            memorised_doc = o.source is not None and (full[o.source][o.document] in memorised)
            assert o.reproduces_source == memorised_doc
        row = by_setting[setting]
        assert row["prompts"] == len(mine)
        assert row["matched documents"] == len(matched)
        assert row["matches >= 30 tokens"] == len(long)
        assert row["average longest span"] == pytest.approx(np.mean([o.span_length for o in mine]))
        assert lengths[setting] == [o.span_length for o in mine]
    # the memorised documents sampled from A are exactly the ones reported with long matches
    sampled_memorised = {(o.source, o.document) for o in outcomes if o.setting == "A" and o.reproduces_source}
    assert sampled_memorised and by_setting["Prefix A"]["outputs with a >= 30-token span"] == len(sampled_memorised)


def test_prefix_audit_is_deterministic_for_a_seed(corpus):
    index, _, _, memorised = corpus
    settings = PrefixSettings(categories=["A"], per_category=8, prefix_tokens=20, max_new_tokens=20, seed=1)
    first = run_prefix_audit(FakeModel(memorised), index, settings, progress=False)
    again = run_prefix_audit(FakeModel(memorised), index, settings, progress=False)
    assert first[0] == again[0] and first[1] == again[1]
    settings.seed = 2
    other = run_prefix_audit(FakeModel(memorised), index, settings, progress=False)
    assert {(o.source, o.document) for o in other[1]} != {(o.source, o.document) for o in first[1]}


@pytest.mark.parametrize("method", ["score", "generate"])
def test_continuation_audit_counts_exactly_the_memorised_windows(corpus, method):
    _, sources, full, memorised = corpus
    settings = ContinuationSettings(samples=25, prefix_tokens=16, continuation_tokens=16, method=method, seed=0)
    rows, matches, _ = run_continuation_audit(FakeModel(memorised), sources, settings, progress=False)
    by_cat = {r["category"]: r for r in rows}
    assert by_cat["A"]["evaluations"] == 25 and by_cat["Total"]["evaluations"] == 50
    expected = set()
    for cat in ("A", "B"):
        hits = [m for m in matches if m.category == cat]
        assert by_cat[cat]["exact matches"] == len(hits)
    for m in matches:
        doc = full[m.source][m.document]
        assert doc in memorised
        assert doc[m.offset:m.offset + 16] == m.prompt_ids and doc[m.offset + 16:m.offset + 32] == m.continuation_ids
        expected.add((m.source, m.document, m.offset))
    assert len(expected) == len(matches) > 0
    assert by_cat["Total"]["exact matches"] == len(matches)


def test_continuation_windows_are_uniform_over_valid_offsets(corpus):
    """Every window lies inside its document, and they are distinct; seeds change the draw."""
    _, sources, full, _ = corpus
    model = FakeModel([])
    probes = {}
    for seed in (0, 1):
        from mimir_megatron.audits.sampling import CategoryDocuments, sample_windows

        docs = CategoryDocuments(sources, "A")
        probes[seed] = sample_windows(docs, 200, 16, 16, seed)
        assert len({(p.source, p.document, p.offset) for p in probes[seed]}) == 200
        for p in probes[seed]:
            assert 0 <= p.offset <= len(full[p.source][p.document]) - 32
    assert probes[0] != probes[1]
    del model


def test_cli_index_prefix_continuation_with_mlflow(corpus, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    import mimir_megatron.audits.model as model_module
    from mimir_megatron.cli import main

    index, sources, full, memorised = corpus
    mixture = tmp_path / "mix.yaml"
    mixture.write_text("name: m\ndatasets:\n" + "".join(
        f"  - {{name: {s.name}, path: {s.path}, category: cat, audit_category: {s.category}}}\n" for s in sources))
    assert main(["audit", "index", "--mixture", str(mixture), "--output", str(tmp_path / "idx")]) == 0
    assert AuditIndex(tmp_path / "idx").documents_per_category() == {"A": 30, "B": 15}
    monkeypatch.setattr(model_module, "load_audit_model", lambda *a, **k: FakeModel(memorised))
    (tmp_path / "hf").mkdir()  # a directory the model flags recognise (as a transformers one)
    (tmp_path / "hf" / "config.json").write_text("{}")
    generic = tmp_path / "generic.jsonl"
    generic.write_text(json.dumps({"prompt_ids": full["a1"][0][:20]}) + "\n")
    out = tmp_path / "prefix"
    assert main(["audit", "prefix", "--model", str(tmp_path / "hf"), "--index", str(tmp_path / "idx"), "--categories",
                 "A,B", "--per-category", "6", "--prefix-tokens", "20", "--generic", str(generic),
                 "--output", str(out)]) == 0
    for name in ("table11.md", "table11.csv", "table11.json", "prefix_outputs.jsonl", "match_lengths.png"):
        assert (out / name).is_file(), name
    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve()}/mlflow.db")
    assert client.get_experiment_by_name("mimir-audit").tags["mlflow.experimentKind"] == "custom_model_development"
    run = client.search_runs([client.get_experiment_by_name("mimir-audit").experiment_id])[0]
    assert run.data.metrics["Generic/outputs with a ge 50-token span"] == 1
    assert run.data.metrics["Prefix A/prompts"] == 6
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"table11.md", "match_lengths.png"}
    out2 = tmp_path / "cont"
    assert main(["audit", "continuation", "--model", str(tmp_path / "hf"), "--mixture", str(mixture), "--samples", "10",
                 "--prefix-tokens", "16", "--continuation-tokens", "16", "--output", str(out2),
                 "--tracking-uri", f"sqlite:///{out.resolve()}/mlflow.db"]) == 0
    rows = json.loads((out2 / "table12.json").read_text())
    lines = (out2 / "exact_matches.jsonl").read_text().splitlines()
    assert rows[-1]["exact matches"] == len(lines)
    run = client.search_runs([client.get_experiment_by_name("mimir-audit").experiment_id],
                             filter_string="attributes.run_name = 'continuation-audit'")[0]
    assert run.data.metrics["Total/exact matches"] == len(lines) > 0
    for line in lines:
        m = json.loads(line)
        assert set(m) >= {"dataset", "document", "offset", "prefix_text", "continuation_text"}


class MaskRecordingModel(FakeModel):
    """Under the training mask, reproduces only the windows that start inside the prompt (a
    made-up rule that makes the two protocols differ), and records the masks it was asked for."""

    def __init__(self, memorised):
        super().__init__(memorised)
        self.masks = []

    def greedy_reproduces(self, pairs, bidirectional_tokens=None):
        self.masks.append(bidirectional_tokens)
        known = super().greedy_reproduces(pairs)
        if bidirectional_tokens is None:
            return known
        return [ok and b > 0 for ok, b in zip(known, bidirectional_tokens)]


def test_training_mask_scores_each_window_with_its_prompt_part_and_reports_both(corpus):
    _, sources, full, memorised = corpus
    model = MaskRecordingModel(memorised)
    settings = ContinuationSettings(samples=25, prefix_tokens=16, continuation_tokens=16, mask="training", seed=0)
    rows, paper, training = run_continuation_audit(model, sources, settings, progress=False)
    assert model.masks[0] is None and model.masks[1] is not None  # the paper's protocol, then training
    masks = [b for m in model.masks if m is not None for b in m]
    from mimir_megatron.audits.sampling import CategoryDocuments, sample_windows

    probes = [p for cat in ("A", "B") for p in sample_windows(CategoryDocuments(sources, cat), 25, 16, 16, 0)]
    assert masks == [min(max(12 - p.offset, 0), 16) for p in probes]  # every document's prompt: 12 tokens
    assert ({(m.source, m.document, m.offset) for m in training}
            == {(m.source, m.document, m.offset) for m in paper if m.offset < 12})
    assert len(training) < len(paper)  # the made-up rule bites on this corpus
    total = rows[-1]
    assert list(total)[2:] == ["exact matches", "exact matches, training mask", "rate (%)",
                               "rate, training mask (%)", "unique pairs", "unique pairs, training mask"]
    assert total["exact matches"] == len(paper) and total["exact matches, training mask"] == len(training)
    with pytest.raises(Exception, match="--mask training needs --method score"):
        run_continuation_audit(model, sources, ContinuationSettings(mask="training", method="generate"),
                               progress=False)


def test_the_prefix_audit_is_a_function_of_typed_arguments(corpus, tmp_path):
    """`mimir audit prefix`'s workflow without the CLI: a loaded model, the index's directory, a
    generic-prompts file; what it writes is what the protocol computed, what it logs is its table."""
    from dataclasses import asdict

    from mimir_megatron.audits.prefix import prefix_audit

    index, _, full, memorised = corpus
    settings = PrefixSettings(categories=["A", "B"], per_category=6, prefix_tokens=20, max_new_tokens=40,
                              min_match=5, long_match=30, seed=3)
    generic = tmp_path / "generic.jsonl"
    generic.write_text(json.dumps({"prompt_ids": full["b"][0][:20]}) + "\n")
    tracking = RecordingTracking()
    result = prefix_audit(FakeModel(memorised), index.path, tmp_path / "out", settings, generic=generic,
                          tracking=tracking, progress=False)
    rows, outcomes, _ = run_prefix_audit(FakeModel(memorised), index, settings, [{"prompt_ids": full["b"][0][:20]}],
                                         progress=False)
    assert result.rows == rows and json.loads((tmp_path / "out" / "table11.json").read_text()) == rows
    assert result.table == tmp_path / "out" / "table11.md" and "| Generic | 1 |" in result.table.read_text()
    lines = [json.loads(line) for line in (tmp_path / "out" / "prefix_outputs.jsonl").read_text().splitlines()]
    assert [line["output_ids"] for line in lines] == [o.output_ids for o in outcomes]
    assert {p.name for p in result.files} == {"table11.md", "table11.csv", "table11.json", "prefix_outputs.jsonl",
                                              "match_lengths.png"}
    ((name, params, metrics, artifacts),) = tracking.runs
    assert (name, result.run_id, artifacts) == ("prefix-audit", "run-1", result.files)
    assert params == {**asdict(settings), "model_name": "fake"}  # no params given: the settings
    assert metrics == result.metrics and metrics["Prefix A/prompts"] == 6 and metrics["Generic/prompts"] == 1


def test_the_continuation_audit_is_a_function_of_typed_arguments(corpus, tmp_path):
    """`mimir audit continuation`'s workflow without the CLI, on an index's datasets, both masks."""
    from mimir_megatron.audits.continuation import continuation_audit

    index, sources, _, memorised = corpus
    settings = ContinuationSettings(samples=25, prefix_tokens=16, continuation_tokens=16, mask="training", seed=0)
    tracking = RecordingTracking()
    result = continuation_audit(MaskRecordingModel(memorised), index, tmp_path / "out", settings,
                                tracking=tracking, params={"asked": "by the caller"}, progress=False)
    rows, matches, training = run_continuation_audit(MaskRecordingModel(memorised), sources, settings,
                                                     progress=False)
    assert result.rows == rows and result.table.read_text().startswith("# 64+64 exact-continuation audit")
    written = (tmp_path / "out" / "exact_matches.jsonl").read_text().splitlines()
    written_training = (tmp_path / "out" / "exact_matches_training_mask.jsonl").read_text().splitlines()
    assert [json.loads(line)["offset"] for line in written] == [m.offset for m in matches]
    assert len(written_training) == len(training) < len(written)
    ((name, params, metrics, _),) = tracking.runs
    assert name == "continuation-audit" and params == {"asked": "by the caller", "model_name": "fake"}
    assert metrics["Total/exact matches"] == len(matches) > 0
    assert metrics["Total/exact matches, training mask"] == len(training)
