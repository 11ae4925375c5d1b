"""`mimir prepare`: round trip through megatron's IndexedDataset, rejects, strict mode, reruns."""

from __future__ import annotations

import dataclasses
import json

import pytest
from chat_lines import chat as _chat
from chat_lines import write_lines as _write_lines
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
from mimir_data_prep.prepare import prepare
from mimir_data_prep.settings import StrictModeError

from mimir_megatron.data import PreparedDataset

TOK = str(DEMO_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOK)


def test_round_trip_through_megatron_indexed_dataset(tmp_path, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tools = [{"type": "function", "function": {"name": "add"}}]
    src = _write_lines(
        tmp_path / "in.jsonl",
        [
            _chat("What is 2 + 3?", "Answer: 5"),
            json.dumps({"prompt": "Copy exactly: stone", "completion": "stone"}),
            _chat("Add 1 and 2", "Svar: 3", tools=tools),
        ],
    )
    manifest = prepare([src], TOK, tmp_path / "out", seq_len=256, workers=1, progress=False)
    assert (manifest.lines_read, manifest.accepted, manifest.rejected) == (3, 3, 0)

    ds = IndexedDataset(str(tmp_path / "out" / "shards" / "00000"))
    assert len(ds) == 6  # two sequences per document
    assert ds.document_indices.tolist() == [0, 2, 4, 6]

    def text(i: int) -> str:
        return tokenizer.decode(ds[i].tolist(), skip_special_tokens=False)

    assert (
        text(0) == "<bos><start_of_turn>user\nWhat is 2 + 3?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert text(1) == "Answer: 5<end_of_turn>"
    assert text(2).endswith("Copy exactly: stone<end_of_turn>\n<start_of_turn>model\n")
    assert text(3) == "stone<end_of_turn>"
    assert text(4).startswith('<bos><start_of_turn>tools\n{"name": "add"}\n<end_of_turn>\n<start_of_turn>user')
    assert ds[1][-1] == tokenizer.convert_tokens_to_ids("<end_of_turn>")

    lengths = ds.sequence_lengths.reshape(-1, 2)
    assert manifest.tokens_prefix == int(lengths[:, 0].sum())
    assert manifest.tokens_response == int(lengths[:, 1].sum())
    for rel, digest in manifest.outputs.items():
        import hashlib

        assert hashlib.sha256((tmp_path / "out" / rel).read_bytes()).hexdigest() == digest
    assert manifest.tokenizer.vocab_size == 1024 and manifest.dtype == "uint16"

    prepared = PreparedDataset(tmp_path / "out")
    prefix, response = prepared.document(1)
    assert prefix.tolist() == ds[2].tolist() and response.tolist() == ds[3].tolist()


BAD_LINES: list[tuple[str | bytes, str | None]] = [
    (_chat("What is 2 + 3?", "Answer: 5"), None),
    ("", "empty_line"),
    (b'{"prompt": "\xff\xfe", "completion": "x"}', "invalid_utf8"),
    ('{"prompt": "unterminated', "malformed_json"),
    ("[1, 2]", "bad_schema"),
    (
        json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        "missing_role",
    ),
    (
        json.dumps(
            {
                "messages": [
                    {"role": "wizard", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ]
            }
        ),
        "unknown_role",
    ),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no_final_assistant"),
    (json.dumps({"prompt": "hi", "completion": "a"}), "response_too_short"),
    (json.dumps({"prompt": "word " * 80, "completion": "Answer: 1"}), "too_long"),
    (_chat("Copy exactly: sky", "sky sky"), None),
]


def test_rejects_counted_by_reason_with_file_and_line(tmp_path):
    src = _write_lines(tmp_path / "bad.jsonl", [line for line, _ in BAD_LINES])
    manifest = prepare(
        [src], TOK, tmp_path / "out", seq_len=64, min_response_tokens=3, workers=1, progress=False
    )
    expected = {reason: 0 for reason in manifest.rejects}
    for _, reason in BAD_LINES:
        if reason:
            expected[reason] += 1
    assert manifest.rejects == expected
    assert manifest.lines_read == 11
    assert manifest.accepted == 2 and manifest.rejected == 9
    assert manifest.accepted + manifest.rejected == manifest.lines_read
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [
        (i + 1, reason) for i, (_, reason) in enumerate(BAD_LINES) if reason
    ]
    assert all(r["file"] == str(src.resolve()) for r in rejects)


def test_strict_stops_at_first_bad_line_with_location(tmp_path):
    src = _write_lines(tmp_path / "bad.jsonl", [line for line, _ in BAD_LINES])
    with pytest.raises(StrictModeError, match=rf"{src.resolve()}:2: empty_line"):
        prepare([src], TOK, tmp_path / "out", strict=True, workers=1, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out" / "shards").iterdir())  # temporary files removed


def test_truncate_prefix_keeps_the_end_of_the_prefix(tmp_path):
    src = _write_lines(
        tmp_path / "in.jsonl", [json.dumps({"prompt": "word " * 80, "completion": "Answer: 1"})]
    )
    manifest = prepare(
        [src],
        TOK,
        tmp_path / "out",
        seq_len=32,
        too_long="truncate-prefix",
        workers=1,
        progress=False,
    )
    assert manifest.accepted == 1 and manifest.truncated == 1
    ds = PreparedDataset(tmp_path / "out")
    prefix, response = ds.document(0)
    assert len(prefix) + len(response) - 1 == 32
    full = prepare([src], TOK, tmp_path / "full", seq_len=4096, workers=1, progress=False)
    assert full.truncated == 0
    full_prefix, _ = PreparedDataset(tmp_path / "full").document(0)
    assert prefix.tolist() == full_prefix[-len(prefix) :].tolist()


def test_rerun_skips_finished_shards_and_redoes_changed_inputs(tmp_path):
    a = _write_lines(
        tmp_path / "a.jsonl", [_chat(f"Copy exactly: {i}", f"{i} {i}") for i in range(5)]
    )
    b = _write_lines(
        tmp_path / "b.jsonl", [_chat(f"Write backwards: ab{i}", f"{i}ba") for i in range(4)]
    )
    out = tmp_path / "out"
    first = prepare([a, b], TOK, out, seq_len=256, workers=1, progress=False)
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.bin")}
    again = prepare([a, b], TOK, out, seq_len=256, workers=1, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.bin")} == mtimes
    assert again.outputs == first.outputs

    _write_lines(b, [_chat(f"Write backwards: ab{i}", f"{i}ba") for i in range(3)])
    third = prepare([a, b], TOK, out, seq_len=256, workers=1, progress=False)
    now = {p.name: p.stat().st_mtime_ns for p in (out / "shards").glob("*.bin")}
    assert now["00000.bin"] == mtimes["00000.bin"] and now["00001.bin"] != mtimes["00001.bin"]
    assert third.documents == 8


@pytest.mark.parametrize("policy", ["drop", "truncate-prefix"])
def test_a_sample_that_fills_seq_len_exactly_is_kept_whole(policy):
    """A sample occupies prefix + response - 1 positions (the loader's and packer's rule): one
    that fills seq_len exactly is kept as it is under either policy; one token more is dropped or
    loses exactly its first prefix token; a response that alone overflows is dropped."""
    from mimir_data_prep.render import fit_to_context
    from mimir_data_prep.settings import PrepareSettings
    from mimir_data_prep.records import RecordError

    settings = PrepareSettings(tokenizer_dir=TOK, tokenizer_sha256="", seq_len=8, too_long=policy)
    prefix, response = [1, 2, 3, 4, 5], [6, 7, 8, 9]  # 5 + 4 - 1 = 8 positions
    assert fit_to_context(prefix, response, settings) == (prefix, False)
    if policy == "drop":
        with pytest.raises(RecordError, match="6 prefix \\+ 4 response tokens exceed seq_len=8"):
            fit_to_context([0, *prefix], response, settings)
    else:
        assert fit_to_context([0, *prefix], response, settings) == (prefix, True)
    assert fit_to_context([1], list(range(8)), settings) == ([1], False)  # the whole window
    with pytest.raises(RecordError) as too_long:
        fit_to_context([1], list(range(9)), settings)  # no prefix token could stay
    assert too_long.value.reason == "too_long"


def test_a_config_prepares_its_datasets_as_one_after_another_would(tmp_path):
    """`--config` prepares its datasets side by side (tests/integration/test_data_prepare_workers.py
    runs them in worker processes); the result equals each prepared in turn, byte for byte, and
    the derived dataset records its parent's digest."""
    from mimir_data_prep.prepare_config import run_prepare_config
    from prepare_configs import one_after_another, tree, write_config

    config = write_config(tmp_path)
    reference = one_after_another(config, shard_bytes=700)
    expected = tree(tmp_path / "out")
    (tmp_path / "out").rename(tmp_path / "reference")
    manifests = run_prepare_config(config, workers=1, progress=False, shard_bytes=700)
    assert manifests == reference and tree(tmp_path / "out") == expected
    assert [len(m.shards) > 1 for m in manifests] == [True] * 4
    assert manifests[3].provenance["derived_from"][0]["digest"] == manifests[0].provenance["digest"]


def test_a_failing_dataset_of_a_config_stops_only_itself_and_what_derives_from_it(tmp_path, caplog):
    from mimir_data_prep.prepare_config import run_prepare_config
    from prepare_configs import write_config

    from mimir_megatron.errors import UserError

    config = write_config(tmp_path, missing=True)
    with pytest.raises(UserError, match=r"2 of 4 datasets failed: datasets\[1\] \(b\), datasets\[3\] \(d\)"):
        run_prepare_config(config, workers=1, progress=False)
    assert "datasets[1] (b): " in caplog.text and "raw/b.jsonl: input file not found" in caplog.text
    assert (tmp_path / "out" / "a" / "manifest.json").is_file() and (tmp_path / "out" / "c" / "manifest.json").is_file()
    assert not (tmp_path / "out" / "d" / "manifest.json").exists()


def test_the_stages_called_by_hand_give_the_document_prepare_writes(tmp_path):
    """read -> detect layout -> screen -> render -> encode -> fit -> screen tokens, each stage called
    directly, on one sharegpt line with a NUL under --control-chars strip and an e-mail address
    under --personal-data redact: the same tokens as the prepared shard holds."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from mimir_data_prep.layouts import decide_layouts
    from mimir_data_prep.read import read_records
    from mimir_data_prep.render import fit_document, render_texts
    from mimir_data_prep.screen import screen_text, screen_tokens
    from mimir_data_prep.settings import prepare_settings
    from mimir_data_prep.shard_writer import renderer_for
    from mimir_data_prep.shards import plan_shards

    turns = [{"from": "human", "value": "Write to ann@example.com\u0000 please"}, {"from": "gpt", "value": "Done."}]
    src = _write_lines(tmp_path / "in.jsonl", [json.dumps({"conversations": turns})])
    options = dict(seq_len=64, control_chars="strip", personal_data="redact")
    settings = prepare_settings(TOK, **options)
    (task,) = plan_shards([src])
    layouts = decide_layouts([task], settings.input_format, {})
    assert layouts[task.path]["format"] == "sharegpt"
    task = dataclasses.replace(task, layout="sharegpt")
    ((line, conversation, _),) = list(read_records(task, settings))
    found: dict[str, int] = {}
    conversation, stripped = screen_text(conversation, settings, found)
    assert (line, stripped, found) == (1, True, {"email": 1})
    assert conversation.messages[0]["content"] == "Write to [EMAIL] please"
    renderer = renderer_for(settings.tokenizer_dir)
    prefix, response = renderer.encode_batch(list(render_texts(conversation, renderer)))
    prefix, truncated = fit_document(prefix, response, settings)
    screen_tokens(prefix + response, None, settings)

    prepare([src], TOK, tmp_path / "out", workers=1, progress=False, **options)
    shard = IndexedDataset(str(tmp_path / "out" / "shards" / "00000"))
    assert (shard[0].tolist(), shard[1].tolist(), truncated) == (prefix, response, False)


def test_the_options_of_prepare_are_listed_once(tmp_path):
    """PrepareOptions is the one list of prepare()'s options and of their defaults: they are given
    as one or as keywords of its names, a keyword that is not one is refused by name before
    anything is written, and the checked settings and a prepare config default to its values."""
    from mimir_data_prep.prepare_config import DatasetJob, PrepareJob
    from mimir_data_prep.settings import PrepareOptions, PrepareSettings, prepare_settings

    given = prepare_settings(TOK, PrepareOptions(seq_len=64, control_chars="strip"), personal_data="redact")
    assert given == prepare_settings(TOK, seq_len=64, control_chars="strip", personal_data="redact")
    assert (given.seq_len, given.control_chars, given.personal_data, given.too_long) == (64, "strip", "redact",
                                                                                         "drop")
    with pytest.raises(TypeError, match="sequence_len"):
        prepare([tmp_path / "in.jsonl"], TOK, tmp_path / "out", sequence_len=64, progress=False)
    assert not (tmp_path / "out").exists()
    defaults = {f.name: f.default for f in dataclasses.fields(PrepareOptions)}
    compared = 0
    for record in (PrepareSettings, PrepareJob, DatasetJob):
        for f in dataclasses.fields(record):
            if f.name in defaults and f.default not in (None, "", dataclasses.MISSING) and f.name != "columns":
                assert f.default == defaults[f.name], (record.__name__, f.name, f.default)
                compared += 1
    assert compared == 13  # seven of PrepareSettings, five of PrepareJob, one of DatasetJob
