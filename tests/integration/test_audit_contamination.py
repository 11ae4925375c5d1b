"""Decontamination end to end: benchmark items planted in a training set among clean documents,
verbatim and re-spaced, are found item for item by `mimir audit contamination` and nothing else
is; its denylist makes `mimir prepare` drop exactly the planted documents, and the re-indexed data
reports clean. Bad input is one line (exit 2) with nothing written.

One index per module: a user suite of made-up items (random sequences of the demo text's words,
so that no two texts share a 13-token run by chance), prepared with the demo tokenizer."""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import unicodedata
from pathlib import Path

import pytest
from conftest import REPO

from mimir_megatron.audits import AuditSource, build_index
from mimir_megatron.audits.contamination import check_item
from mimir_megatron.cli import main
from mimir_megatron.errors import UserError
from mimir_megatron.evaluation.suite import load_suite

TOKENIZER = REPO / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer"
NGRAM = 13
# benchmark -> {item id: how its text was planted}
PLANTED = {"gen": {"2": "prompt verbatim", "5": "prompt re-spaced", "7": "reference verbatim"},
           "mc": {"1": "question and options re-spaced", "3": "every space doubled"}}
RESPACED = {("gen", "5"), ("mc", "1"), ("mc", "3")}
TEMPLATE = "Read the following passage carefully and answer the question at the end of it."


def respace(text: str, every: int = 3) -> str:
    """Light re-spacing: every ``every``-th gap between words becomes two spaces, a newline, a
    space and a newline, or a tab (the rest stay single spaces)."""
    seps = ["  ", "\n", " \n", "\t"]
    words = text.split()
    out = [words[0]]
    for k, word in enumerate(words[1:]):
        out += [seps[k % 4] if k % every == every - 1 else " ", word]
    return "".join(out)


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def write_data(root: Path) -> tuple[Path, Path, dict[int, tuple[str, str]], dict]:
    """The suite (two benchmarks), its rows and a training JSONL: returns (suite, training file,
    {document index: (benchmark, item)} of the planted documents, the rows)."""
    demo = REPO / "data_prep" / "mimir_data_prep" / "demo"
    vocabulary = sorted(set(re.findall(r"[A-Za-z]+", (demo / "text_en.txt").read_text())))
    paragraphs = [p.strip() for name in ("text_en.txt", "text_da.txt")
                  for p in (demo / name).read_text().split("\n\n") if p.strip()]
    r = random.Random(0)

    def words(k: int) -> str:
        return " ".join(r.choice(vocabulary) for _ in range(k))

    gen = [{"passage": words(18) + ".", "question": words(8) + "?", "answer": words(10) + "."} for _ in range(10)]
    mc = [{"question": words(14) + "?", "choices": [words(2) for _ in range(4)], "answer": r.randrange(4)}
          for _ in range(6)]
    for name, rows in (("gen", gen), ("mc", mc)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    suite = root / "suite.yaml"
    suite.write_text(
        f"name: planted\ndata_dir: {root}\ntasks:\n"
        f"  - {{name: gen, format: generate, data: gen.jsonl, columns: {{target: answer}},\n"
        f"     prompt: \"{TEMPLATE}\\n\\n{{passage}}\\n\\nQuestion: {{question}}\"}}\n"
        "  - {name: mc, format: multiple_choice, data: mc.jsonl, prompt: '{question}',\n"
        "     columns: {choices: choices, answer: answer}}\n")
    docs = [chat(p.split(".")[0] + "?", p) for p in paragraphs]
    docs += [chat("Tell me something.", words(25)) for _ in range(40)]
    planted: dict[int, tuple[str, str]] = {}

    def plant(doc: dict, benchmark: str, item: str) -> None:
        planted[len(docs)] = (benchmark, item)
        docs.append(doc)

    mc_text = lambda row: row["question"] + "\n" + "\n".join(row["choices"])  # noqa: E731
    plant(chat("Can you help with this? " + gen[2]["passage"] + "\n\n" + gen[2]["question"], "No idea."), "gen", "2")
    plant(chat("Summarise.", "Here: " + respace(gen[5]["passage"] + " " + gen[5]["question"], every=2)), "gen", "5")
    plant(chat(words(6) + "?", gen[7]["answer"]), "gen", "7")
    plant(chat(respace(mc_text(mc[1]), every=3), "B"), "mc", "1")
    plant(chat("Which one?", "  ".join(mc_text(mc[3]).split())), "mc", "3")
    # near misses: the suite's own wording with fresh text; the most words of an item under 13 tokens
    docs.append(chat(f"{TEMPLATE}\n\n{words(18)}\n\nQuestion: {words(8)}?", "ok"))
    head = gen[0]["passage"].split()
    short = max((" ".join(head[:k]) for k in range(1, len(head))), key=lambda t: (_tokens(t) < NGRAM, len(t)))
    docs.append(chat(short + " and more", "fine"))
    docs += [chat("And another thing.", words(25)) for _ in range(20)]
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return suite, train, planted, {"gen": gen, "mc": mc}


def documents(path: Path) -> list[tuple[int, ...]]:
    from mimir_megatron.data.prepared import PreparedDataset

    ds = PreparedDataset(path)
    return [tuple(p.tolist() + r.tolist()) for p, r in (ds.document(i) for i in range(ds.num_documents))]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from mimir_data_prep.prepare import prepare

    root = tmp_path_factory.mktemp("contamination")
    suite, train, planted_docs, rows = write_data(root)
    prepare([train], TOKENIZER, root / "train", workers=1, progress=False)
    build_index([AuditSource("train", root / "train", "A")], root / "idx", progress=False)
    out = root / "report"
    rc = main(["audit", "contamination", "--suite", str(suite), "--index", str(root / "idx"), "--output", str(out),
               "--ngram", str(NGRAM), "--denylist", str(root / "denylist.json"), "--workers", "1",
               "--no-progress", "--tracking-uri", f"sqlite:///{out}/mlflow.db"])
    report = json.loads((out / "planted.json").read_text())
    items = {(i["benchmark"], i["item"]): i for i in map(json.loads, (out / "planted_items.jsonl").open())}
    return {"root": root, "rc": rc, "suite": suite, "train": train, "planted": planted_docs, "rows": rows,
            "report": report, "items": items, "out": out}


def _tokens(text: str) -> int:
    """Tokens of a text, counted with the tokenizers library directly (not through the audit)."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def test_planted_items_are_found_item_for_item_and_nothing_else(planted):
    report, items, rows = planted["report"], planted["items"], planted["rows"]
    assert planted["rc"] == 0
    # what `mimir eval` needs to split scores into clean and contaminated items
    assert report["seed"] == load_suite(planted["suite"]).seed and report["limit"] is None
    for benchmark, expected in PLANTED.items():
        summary = report["benchmarks"][benchmark]
        assert sorted(summary["contaminated_items"]) == sorted(expected)
        assert summary["contaminated"] == len(expected)
        assert summary["fraction"] == pytest.approx(len(expected) / len(rows[benchmark]))
        hit_docs = sorted(d for d, (b, _) in planted["planted"].items() if b == benchmark)
        assert summary["documents"] == [["train", d] for d in hit_docs]
    assert set(items) == {(b, i) for b, expected in PLANTED.items() for i in expected}
    for (benchmark, item), found in items.items():
        # each planted item hits its own document and no other
        assert [d["document"] for d in found["documents"]] == [
            d for d, key in planted["planted"].items() if key == (benchmark, item)]
        row = rows[benchmark][int(item)]
        whole = (row["answer"] if PLANTED[benchmark][item].startswith("reference") else
                 row["passage"] + "\n" + row["question"] if benchmark == "gen" else
                 row["question"] + "\n" + "\n".join(row["choices"]))
        # the whole copied text is one run, counted in the item's own tokens whatever the spacing
        assert found["tokens"] == _tokens(whole), (benchmark, item)
        assert found["text"] == whole
        assert " ".join(found["training_text"].split()) == " ".join(whole.split())
        if (benchmark, item) in RESPACED:  # no exact 13-gram survives re-spacing
            assert not found["exact"] and found["exact_tokens"] < NGRAM
        else:  # found with the item's own ids (gen 2's passage and question are apart in the copy)
            assert found["exact_tokens"] >= NGRAM
    table = (planted["out"] / "planted.md").read_text()
    assert "| gen‡ | gen | 10 | 3 | 30.0 | 2 |" in table and "| mc‡ | mc | 6 | 2 | 33.3 | 0 |" in table


def test_report_is_logged_to_mlflow(planted):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{planted['out']}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("mimir-audit").experiment_id])[0]
    assert run.info.run_name == "contamination-audit"
    assert run.data.metrics["gen/contaminated items"] == 3 and run.data.metrics["mc/documents hit"] == 2
    assert run.data.params["tokenizer_sha256"] == planted["report"]["tokenizer"]["sha256"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"planted.json", "planted.md",
                                                                         "denylist.json"}



def test_the_contamination_audit_is_a_function_of_typed_arguments(planted, tmp_path):
    """`mimir audit contamination`'s workflow without the CLI writes what the command wrote; a
    task that cannot be checked is named in the result's errors (the command's exit 1)."""
    from dataclasses import asdict

    from audit_support import RecordingTracking

    from mimir_megatron.audits.contamination import ContaminationSettings
    from mimir_megatron.audits.contamination_audit import contamination_audit

    settings = ContaminationSettings(ngram=NGRAM, workers=1)
    tracking = RecordingTracking()
    result = contamination_audit(load_suite(str(planted["suite"])), planted["root"] / "idx", tmp_path / "out",
                                 settings, denylist=tmp_path / "denylist.json", tracking=tracking, progress=False)
    assert result.errors == () and result.table == tmp_path / "out" / "planted.md"
    for name in ("planted.md", "planted.csv", "planted_items.jsonl"):
        assert (tmp_path / "out" / name).read_text() == (planted["out"] / name).read_text(), name
    report = json.loads((tmp_path / "out" / "planted.json").read_text())
    # the same report but for its time, and so its digest
    assert {**report, "created": None, "digest": None} == {**planted["report"], "created": None, "digest": None}
    denylist, by_command = (json.loads(p.read_text()) for p in (tmp_path / "denylist.json",
                                                                 planted["root"] / "denylist.json"))
    assert denylist["entries"] == by_command["entries"] and len(denylist["entries"]) > 0
    ((name, params, metrics, artifacts),) = tracking.runs
    assert name == "contamination-audit" and artifacts == result.files and metrics == result.metrics
    assert params == {**asdict(settings), "suite_name": "planted", "index_documents": report["index"]["documents"],
                      "index_tokens": report["index"]["tokens"], "tokenizer_sha256": report["tokenizer"]["sha256"]}
    failed = contamination_audit(planted["suite"], planted["root"] / "idx", tmp_path / "failed", settings,
                                 tasks=["gen"], data_dir=tmp_path / "nowhere", progress=False)
    assert len(failed.errors) == 1 and failed.errors[0].startswith("gen: ") and failed.run_id is None

def test_denylist_drops_exactly_the_planted_documents_and_the_reindexed_data_is_clean(planted):
    """The workflow in place: the same prepare again, now with the denylist (finished shards of the
    run without it must not be reused), then index -> contamination again."""
    root = planted["root"]
    before = documents(root / "train")
    config = root / "prepare.yaml"
    config.write_text(f"tokenizer: {TOKENIZER}\ndenylist: denylist.json\nworkers: 1\n"
                      f"datasets:\n  - {{input: [{planted['train']}], output: train}}\n")
    assert main(["prepare", "--config", str(config), "--no-progress"]) == 0
    after = documents(root / "train")
    assert set(after) <= set(before) and len(after) == len(before) - len(planted["planted"])
    assert set(before) - set(after) == {before[d] for d in planted["planted"]}
    manifest = json.loads((root / "train" / "manifest.json").read_text())
    assert manifest["rejects"]["benchmark_overlap"] == len(planted["planted"]) == manifest["rejected"]
    assert manifest["settings"]["denylist"]["path"] == str((root / "denylist.json").resolve())
    rejects = [json.loads(line) for line in (root / "train" / "rejects.jsonl").open()]
    assert sorted(r["line"] for r in rejects) == [d + 1 for d in planted["planted"]]
    for r in rejects:
        benchmark, item = planted["planted"][r["line"] - 1]
        assert f"benchmark {benchmark} item {item} " in r["detail"]
    build_index([AuditSource("train", root / "train", "A")], root / "idx-clean", progress=False)
    assert main(["audit", "contamination", "--suite", str(planted["suite"]), "--index", str(root / "idx-clean"),
                 "--output", str(root / "report-clean"), "--workers", "1", "--no-progress",
                 "--tracking-uri", f"sqlite:///{planted['out']}/mlflow.db"]) == 0
    clean = json.loads((root / "report-clean" / "planted.json").read_text())
    assert {b: s["contaminated"] for b, s in clean["benchmarks"].items()} == {"gen": 0, "mc": 0}
    assert all(s["longest_span"]["tokens"] < NGRAM for s in clean["benchmarks"].values())


def _one_line_error(caplog, argv: list[str], expected: str, unwritten: Path) -> None:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="mimir"):
        assert main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0] and expected in errors[0], errors
    assert not unwritten.exists()


def test_bad_input_is_one_line_and_writes_nothing(planted, caplog, tmp_path):
    root, suite, idx = planted["root"], str(planted["suite"]), str(planted["root"] / "idx")
    out = tmp_path / "out"
    audit = ["audit", "contamination", "--index", idx, "--output", str(out), "--no-progress"]
    _one_line_error(caplog, [*audit, "--suite", str(tmp_path / "nowhere.yaml")], "suite file not found", out)
    for n, expected in ((0, "--ngram must be >= 1"), (100_000, "longer than the index's longest document")):
        _one_line_error(caplog, [*audit, "--suite", suite, "--ngram", str(n)], expected, out)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(TOKENIZER, other)
    (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text().replace("256", "512"))
    _one_line_error(caplog, [*audit, "--suite", suite, "--tokenizer", str(other)],
                    "is not the tokenizer the index's datasets were prepared with", out)
    # a denylist written for another tokenizer: the flag and the YAML field
    foreign = tmp_path / "foreign.json"
    body = json.loads((root / "denylist.json").read_text())
    foreign.write_text(json.dumps({**body, "tokenizer": {"sha256": "0" * 64}}))
    _one_line_error(caplog, ["prepare", "-i", str(planted["train"]), "-t", str(TOKENIZER), "-o", str(out),
                             "--denylist", str(foreign)], f"{foreign}: tokenizer.sha256 is 000000000000", out)
    config = tmp_path / "prepare.yaml"
    config.write_text(f"tokenizer: {TOKENIZER}\ndenylist: {foreign}\ndatasets:\n"
                      f"  - {{input: [{planted['train']}], output: {out}}}\n")
    _one_line_error(caplog, ["prepare", "--config", str(config)], "tokenizer.sha256", out)


def test_an_index_without_a_word_stream_is_refused_for_contamination_and_read_for_the_rest(planted, caplog,
                                                                                          tmp_path):
    """An index an older mimir built (its record has no ``words``, its directory no word stream):
    the contamination check asks for a rebuild in one line and writes nothing; the memorisation
    audits' queries still answer; building into its directory is refused, naming why."""
    from mimir_megatron.audits import AuditIndex
    from mimir_megatron.audits.index_format import META_NAME
    from mimir_megatron.integrity import json_digest

    old = tmp_path / "old-idx"
    shutil.copytree(planted["root"] / "idx", old, ignore=shutil.ignore_patterns("words"))
    record = json.loads((old / META_NAME).read_text())
    assert record.pop("words") is not None
    record.pop("fingerprint")
    (old / META_NAME).write_text(json.dumps({**record, "fingerprint": json_digest(record)}))
    out = tmp_path / "out"
    _one_line_error(caplog, ["audit", "contamination", "--suite", str(planted["suite"]), "--index", str(old),
                             "--output", str(out), "--no-progress"],
                    "was built before indexes had a word stream; rebuild it with `mimir audit index`", out)
    index = AuditIndex(old)
    first = next(iter(planted["planted"]))
    ids = index.document_tokens("train", first)[:20].tolist()
    assert index.locate(ids, limit=1)[0].document == first
    with pytest.raises(UserError, match="built before indexes had a word stream; choose a new --output"):
        build_index([AuditSource("train", planted["root"] / "train", "A")], old, progress=False)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Items planted in variants that change no word (re-cased, NFKC forms, punctuation dropped),
    short items planted whole, the n-gram boundary (an item of exactly n tokens planted whole and
    with its last token cut), and 16 clean items planted nowhere; one index, checked with
    check_item directly (the checks the command runs per item)."""
    from mimir_megatron.audits.contamination import _Encoder
    from mimir_megatron.chat import encoding, load_tokenizer
    from mimir_data_prep.prepare import prepare

    root = tmp_path_factory.mktemp("variants")
    tokenizer = load_tokenizer(str(TOKENIZER))
    vocabulary = sorted(set(re.findall(r"[a-z]{3,}", (REPO / "data_prep" / "mimir_data_prep" / "demo"
                                                      / "text_en.txt").read_text())))
    r = random.Random(1)

    def tokens(text: str) -> list[int]:
        return list(encoding(tokenizer, text).ids)

    def sentence(k: int) -> str:
        return " ".join(r.choice(vocabulary) for _ in range(k)).capitalize() + "."

    def of_length(n: int) -> str:  # a text of exactly n tokens
        while True:
            words = sentence(40).split()
            for k in range(1, len(words)):
                text = " ".join(words[:k])
                if len(tokens(text)) == n:
                    return text
                if len(tokens(text)) > n:
                    break

    def punctuated(k: int) -> str:  # a comma or semicolon after every second word
        words = sentence(k).split()
        return " ".join(w + (",;"[i % 2] if i % 2 else "") for i, w in enumerate(words))

    def full_width(text: str) -> str:  # what NFKC folds back: full-width letters, ideographic spaces
        return "".join("\u3000" if c == " " else chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)

    def phrase() -> str:  # five words under n tokens as written, over n in capitals
        while True:
            text = " ".join(r.choice(vocabulary) for _ in range(5))
            if len(tokens(" " + text)) < NGRAM - 1 and len(tokens(" " + text.upper())) > NGRAM + 2:
                return text

    cyrillic = str.maketrans("aeopcxy", "аеорсху")  # Cyrillic look-alikes of Latin letters
    greek = str.maketrans("ABEHIKMNOPTXYZ", "ΑΒΕΗΙΚΜΝΟΡΤΧΥΖ")
    shared = phrase()
    # Each changed throughout, so that no 13-token run of the item as written survives in its copy.
    items = {"caps": sentence(16), "lower": sentence(16).title(), "nfkc": full_width(sentence(16)),
             "bare": punctuated(16), "short": of_length(NGRAM - 4),
             "exact_n": of_length(NGRAM), "cut_n": of_length(NGRAM),
             "title": sentence(16), "mixed": sentence(16), "nbsp": sentence(16), "zero_width": sentence(16),
             "cyrillic": sentence(16), "greek": sentence(16), "punctuation": punctuated(16),
             "host": sentence(4)[:-1] + " " + shared + " " + sentence(4).lower()}
    clean = {f"clean{i}": sentence(r.choice([5, 10, 16])) for i in range(16)}
    # shares the host's five words, under n of its own tokens: clean, however the host was copied
    clean["shares"] = sentence(4)[:-1] + " " + shared + " " + sentence(4).lower()
    cut = tokenizer.decode(tokens(items["cut_n"])[:NGRAM - 1])
    planted = {"caps": items["caps"].upper(), "lower": items["lower"].lower(),
               "nfkc": unicodedata.normalize("NFKC", items["nfkc"]),
               "bare": re.sub(r"[^\w\s]", "", items["bare"]), "short": items["short"],
               "exact_n": items["exact_n"], "cut_n": cut,
               "title": items["title"].title(),
               "mixed": " ".join(w.upper() if i % 2 else w.lower() for i, w in enumerate(items["mixed"].split())),
               "nbsp": items["nbsp"].replace(" ", "\u00a0"),
               "zero_width": " ".join(w[:2] + "\u200b" + w[2:] + "\u200d" for w in items["zero_width"].split()),
               "cyrillic": items["cyrillic"].translate(cyrillic),
               "greek": items["greek"].upper().translate(greek),
               "punctuation": items["punctuation"].replace(",", ";").replace(";", " -"),
               "host": items["host"].upper()}
    docs = [chat("Context follows.", text) for text in planted.values()]
    docs += [chat("Tell me something.", sentence(25)) for _ in range(30)]
    (root / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    prepare([root / "train.jsonl"], TOKENIZER, root / "train", workers=1, progress=False)
    from mimir_megatron.audits import AuditIndex

    index = AuditIndex(build_index([AuditSource("train", root / "train", "A")], root / "idx", progress=False))
    encoder = _Encoder(tokenizer)
    results = {name: check_item(index, encoder, "b", name, [("prompt", text)], NGRAM, 100)
               for name, text in {**items, **clean}.items()}
    return {"results": results, "items": items, "tokens": tokens, "shared": shared, "planted": planted,
            "clean": clean}


FOLDED = ("caps", "lower", "nfkc", "bare", "title", "mixed", "nbsp", "zero_width", "cyrillic", "greek",
          "punctuation", "host")


def test_normalised_variants_short_items_and_the_ngram_boundary(variants):
    results, items, tokens = variants["results"], variants["items"], variants["tokens"]
    assert len(tokens(items["exact_n"])) == len(tokens(items["cut_n"])) == NGRAM
    assert 6 <= len(tokens(items["short"])) < NGRAM
    flagged = {name for name, result in results.items() if result.contaminated(NGRAM)}
    assert flagged == {*FOLDED, "short", "exact_n"}, {
        name: (r.longest.tokens if r.longest else 0) for name, r in results.items()}
    for name in FOLDED:  # the whole item, counted in its own tokens (NFKC form), and where the copy is
        result, item = results[name], unicodedata.normalize("NFKC", items[name])
        assert result.longest.tokens == len(tokens(item)) and result.longest.text == item, name
        assert [h.document for h in result.hits] == [list(variants["planted"]).index(name)], name
        assert result.training_text == variants["planted"][name].rstrip(" -"), name  # "-" folds to nothing
    # the boundary: exactly n shared tokens flag an item, n - 1 do not
    assert results["exact_n"].longest.tokens == NGRAM and results["exact_n"].exact_tokens == NGRAM
    assert results["cut_n"].longest.tokens == NGRAM - 1 and not results["cut_n"].whole_item
    assert results["short"].whole_item and results["caps"].longest.exact is False
    # without folding, the changed copies keep no 13-token run of the item as written
    assert all(results[name].exact_tokens < NGRAM for name in FOLDED)


def test_a_clean_items_verdict_does_not_depend_on_how_other_items_were_copied(variants):
    """The clean item shares five words with the host item, whose copy is in capitals: the run is
    counted in the clean item's own tokens (under n), not in the capitals' (over n), so it is clean,
    as it would be had the host been copied verbatim."""
    results, tokens, shared = variants["results"], variants["tokens"], variants["shared"]
    shares = results["shares"]
    assert len(tokens(" " + shared.upper())) > NGRAM > len(tokens(" " + shared))
    assert not shares.contaminated(NGRAM) and shares.longest.text == shared
    assert shares.longest.tokens == len(tokens(" " + shared)) and shares.hits == []
