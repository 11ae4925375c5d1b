"""`mimir prepare` input: public layouts (ShareGPT, Alpaca, columns, auto), control characters,
corrupt Parquet row groups, and templates that write text after the end-of-turn token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
from mimir_data_prep.layouts import normalise, parse_columns
from mimir_data_prep.prepare import prepare
from mimir_data_prep.records import RecordError, to_conversation

from mimir_megatron.chat import ChatRenderer, end_of_turn_ids
from mimir_megatron.data import PreparedDataset, load_eval_samples
from mimir_megatron.data.manifest import Manifest
from mimir_megatron.errors import UserError

TOK = str(DEMO_TOKENIZER_DIR)
EOT = 4  # <end_of_turn> in the demo tokenizer
EOS = 2  # <eos>

# A real Gemma chat template (shape of google/gemma-3's): a newline follows every <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Turns end with <eos> followed by two newlines and no <end_of_turn> at all.
EOS_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '<eos>\n\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def _write(path: Path, objs: list) -> Path:
    with path.open("wb") as f:
        for obj in objs:
            f.write((obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n")
    return path


def _tokenizer_with_template(tmp_path: Path, template: str) -> Path:
    out = tmp_path / "tok"
    shutil.copytree(DEMO_TOKENIZER_DIR, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _run(tmp_path: Path, name: str, inputs: list[Path], **kwargs) -> Manifest:
    kwargs.setdefault("seq_len", 256)
    return prepare(inputs, kwargs.pop("tokenizer", TOK), tmp_path / name, workers=1, progress=False, **kwargs)


# --- layouts -----------------------------------------------------------------------------------

SHAREGPT = {
    "system": "Be brief.",
    "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'},
        {"from": "observation", "value": '{"temp": 3}'},
        {"from": "gpt", "value": "3 degrees."},
    ],
    "tools": '[{"type": "function", "function": {"name": "weather"}}]',
}
ALPACA = {
    "instruction": "Add the numbers.",
    "input": "2 and 3",
    "output": "Answer: 5",
    "history": [["Hi", "Hello"]],
}
COLUMNS = {"problem": "What is 2 + 2?", "generated_solution": "Answer: 4", "id": 7}


def test_sharegpt_alpaca_and_columns_become_messages_exactly():
    assert normalise(SHAREGPT, "sharegpt") == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": {"city": "Oslo"}},
                    }
                ],
            },
            {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"},
            {"role": "assistant", "content": "3 degrees."},
        ],
        "tools": SHAREGPT["tools"],
    }
    parallel = {
        "conversations": [
            {"from": "human", "value": "Oslo and Bergen?"},
            {
                "from": "function_call",
                "value": '[{"name": "w", "arguments": {"c": "Oslo"}}, {"name": "w", "arguments": "{}"}]',
            },
            {"from": "gpt", "value": "Both cold."},
        ]
    }
    assert normalise(parallel, "sharegpt")["messages"][1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"c": "Oslo"}}},
        {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": {}}},
    ]
    assert normalise(ALPACA, "alpaca") == {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Add the numbers.\n\n2 and 3"},
            {"role": "assistant", "content": "Answer: 5"},
        ]
    }
    assert normalise({"instruction": "Say hi", "input": "", "output": "hi"}, "alpaca")["messages"][0] == {
        "role": "user",
        "content": "Say hi",
    }
    columns = parse_columns("prompt=problem,completion=generated_solution")
    assert to_conversation(normalise(COLUMNS, "columns", columns)).messages == [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Answer: 4"},
    ]
    with pytest.raises(RecordError, match="unknown_role|from='narrator'") as info:
        normalise({"conversations": [{"from": "narrator", "value": "x"}]}, "sharegpt")
    assert info.value.reason == "unknown_role"
    with pytest.raises(RecordError) as info:
        normalise({"problem": "only a prompt"}, "columns", columns)
    assert info.value.reason == "bad_schema"
    with pytest.raises(UserError, match="unknown target"):
        parse_columns("question=q,completion=a")


def test_auto_decides_per_file_and_records_the_decision(tmp_path):
    files = {
        "chat": _write(
            tmp_path / "chat.jsonl", [{"prompt": "Copy exactly: sky", "completion": "sky sky"}] * 3
        ),
        "share": _write(tmp_path / "share.jsonl", [SHAREGPT] * 2 + [{"messages": "not a list"}]),
        "alpaca": _write(tmp_path / "alpaca.jsonl", [ALPACA] * 4),
    }
    manifest = _run(tmp_path, "out", list(files.values()))
    formats = {Path(k).stem: v for k, v in manifest.input_formats.items()}
    assert formats == {
        "chat": {"requested": "auto", "format": "messages", "sampled": 3, "matches": {"messages": 3}},
        "share": {
            "requested": "auto",
            "format": "sharegpt",
            "sampled": 3,
            "matches": {"none": 1, "sharegpt": 2},
        },
        "alpaca": {"requested": "auto", "format": "alpaca", "sampled": 4, "matches": {"alpaca": 4}},
    }
    # The odd line out of the ShareGPT file is rejected under the file's layout, not guessed at.
    assert (manifest.accepted, manifest.rejects["bad_schema"]) == (9, 1)
    response = PreparedDataset(tmp_path / "out").document(3)[1]  # the first ShareGPT sample
    assert response[-1] == EOT

    cols = _write(tmp_path / "math.jsonl", [COLUMNS] * 2)
    with pytest.raises(
        UserError, match=r"math.jsonl: unknown input layout .*columns seen: problem, generated_solution, id"
    ):
        _run(tmp_path, "bad", [cols])
    manifest = _run(tmp_path, "cols", [cols], columns="prompt=problem,completion=generated_solution")
    assert manifest.accepted == 2
    assert list(manifest.input_formats.values()) == [{"requested": "columns", "format": "columns"}]
    assert manifest.content["settings"]["columns"] == {"completion": "generated_solution", "prompt": "problem"}


# --- control characters ------------------------------------------------------------------------

CONTROL_LINES = [
    {"prompt": "Copy exactly: sky", "completion": "sky sky"},
    {"prompt": "Copy exactly: s\u0000ky", "completion": "sky sky"},  # escaped NUL: valid JSON
    {"prompt": "Copy exactly: sky", "completion": "sky\u001b[31m sky"},  # ANSI escape
    b'{"prompt": "Copy exactly: sky\x01", "completion": "sky sky"}',  # raw control byte
    {"prompt": "Tabs\tand\nnewlines stay", "completion": "sky sky"},
]


def test_control_characters_rejected_with_their_own_reason_or_stripped(tmp_path):
    src = _write(tmp_path / "ctl.jsonl", CONTROL_LINES)
    manifest = _run(tmp_path, "reject", [src])
    assert manifest.rejects["control_characters"] == 3 and manifest.accepted == 2
    assert manifest.control_chars_stripped == 0
    rejects = [json.loads(x) for x in (tmp_path / "reject" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(i, "control_characters") for i in (2, 3, 4)]
    assert "U+0000" in rejects[0]["detail"] and "U+001B" in rejects[1]["detail"]

    stripped = _run(tmp_path, "strip", [src], control_chars="strip")
    assert stripped.rejected == 0 and stripped.accepted == 5
    assert stripped.control_chars_stripped == 3
    ds = PreparedDataset(tmp_path / "strip")
    clean = ds.document(0)
    for i in (1, 3):  # NUL and \x01 removed: the same tokens as the clean line
        assert [a.tolist() for a in ds.document(i)] == [a.tolist() for a in clean]


# --- corrupt Parquet ---------------------------------------------------------------------------


def test_corrupt_parquet_row_group_is_counted_and_the_rest_prepared(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"Copy exactly: {i}", "completion": f"{i} {i}"} for i in range(6)]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + column.total_compressed_size] = b"\xab" * column.total_compressed_size
    path.write_bytes(bytes(data))

    manifest = _run(tmp_path, "out", [path])  # the same process_shard a worker process runs
    assert manifest.lines_read == 6 and manifest.accepted == 4
    assert manifest.rejects["corrupt_row_group"] == 2
    (reject,) = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert (reject["file"], reject["line"], reject["row_group"], reject["rows"]) == (str(path), 3, 1, 2)
    assert PreparedDataset(tmp_path / "out").num_documents == 4


# --- end of turn -------------------------------------------------------------------------------


def test_end_of_turn_ids_come_from_the_template(tmp_path):
    from transformers import AutoTokenizer

    assert end_of_turn_ids(AutoTokenizer.from_pretrained(TOK)) == [EOT]
    gemma = AutoTokenizer.from_pretrained(str(_tokenizer_with_template(tmp_path / "g", GEMMA_TEMPLATE)))
    assert end_of_turn_ids(gemma) == [EOT]
    other = AutoTokenizer.from_pretrained(str(_tokenizer_with_template(tmp_path / "e", EOS_TEMPLATE)))
    assert end_of_turn_ids(other) == [EOS]


def test_gemma_style_template_response_ends_at_end_of_turn(tmp_path):
    tok = _tokenizer_with_template(tmp_path, GEMMA_TEMPLATE)
    answer = "line one\nline two"
    src = _write(tmp_path / "in.jsonl", [{"prompt": "Write two lines", "completion": answer}])
    _run(tmp_path, "out", [src], tokenizer=tok)
    renderer = ChatRenderer(tok)
    (sample,) = load_eval_samples(tmp_path / "out")
    text = renderer.tokenizer.decode(sample.completion_ids, skip_special_tokens=False)
    assert text == answer + "<end_of_turn>"  # not "...<end_of_turn>\n"
    assert sample.completion_ids[-1] in renderer.end_of_turn_ids
    assert PreparedDataset(tmp_path / "out").record.tokenizer.end_of_turn_ids == (EOT,)
    # The stop token is not the newline, which occurs inside the multi-line answer.
    newline = renderer.encode("\n")
    assert newline[0] in sample.completion_ids[:-1] and newline[0] not in renderer.end_of_turn_ids
    prompt = renderer.tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)
    assert prompt == "<bos><start_of_turn>user\nWrite two lines<end_of_turn>\n<start_of_turn>model\n"


def test_a_conversation_the_template_cannot_render_is_a_template_error_reject(tmp_path):
    # The template refuses one content; a prefix that the full rendering does not start with is
    # the other failure (a template that writes the generation prompt differently from a turn).
    refusing = GEMMA_TEMPLATE.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['content'] == 'boom' %}"
        "{{ raise_exception('no boom here') }}{% endif %}",
    )
    src = _write(tmp_path / "in.jsonl", [{"prompt": "boom", "completion": "a b c"},
                                         {"prompt": "fine", "completion": "a b c"}])
    manifest = _run(tmp_path, "out", [src], tokenizer=_tokenizer_with_template(tmp_path / "r", refusing))
    assert (manifest.accepted, manifest.rejects["template_error"]) == (1, 1)
    (reject,) = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert (reject["line"], reject["reason"]) == (1, "template_error") and "no boom here" in reject["detail"]
    mismatched = GEMMA_TEMPLATE.replace("'<start_of_turn>model\n'", "'<start_of_turn>assistant\n'")
    manifest = _run(tmp_path, "out2", [src], tokenizer=_tokenizer_with_template(tmp_path / "m", mismatched))
    assert (manifest.accepted, manifest.rejects["template_error"]) == (0, 2)


def test_yaml_config_sets_the_layout_per_dataset(tmp_path):
    from mimir_data_prep.prepare_config import load_prepare_config

    from mimir_megatron.cli import main
    from mimir_megatron.errors import ConfigError

    (tmp_path / "raw").mkdir()
    _write(tmp_path / "raw" / "math.jsonl", [COLUMNS] * 2)
    _write(tmp_path / "raw" / "share.jsonl", [SHAREGPT] * 3)
    config = tmp_path / "prep.yaml"
    config.write_text(
        f"tokenizer: {TOK}\nseq_len: 256\ndatasets:\n"
        "  - {name: math, input: [raw/math.jsonl], output: out/math, input_format: columns,\n"
        "     columns: {prompt: problem, completion: generated_solution}}\n"
        "  - {name: share, input: [raw/share.jsonl], output: out/share}\n"
    )
    assert main(["prepare", "--config", str(config), "--workers", "1", "--no-progress"]) == 0
    math, share = PreparedDataset(tmp_path / "out" / "math"), PreparedDataset(tmp_path / "out" / "share")
    assert (math.num_documents, share.num_documents) == (2, 3)
    assert list(math.record.input_formats.values())[0]["format"] == "columns"
    assert list(share.record.input_formats.values())[0] == {
        "requested": "auto",
        "format": "sharegpt",
        "sampled": 3,
        "matches": {"sharegpt": 3},
    }

    config.write_text(
        "seq_len: 1\ndatasets:\n"
        "  - {input: [a.jsonl], output: o, input_format: csv}\n"
        "  - {name: b, input: [], output: o, input_format: columns}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_prepare_config(config)
    assert str(info.value).splitlines()[1:] == [
        "  - tokenizer: required (a Hugging Face tokenizer directory)",
        "  - seq_len: must be >= 2, got 1",
        "  - datasets[0].input_format: one of ('auto', 'messages', 'sharegpt', 'alpaca', 'columns'), got 'csv'",
        "  - datasets[1] (b).input: at least one input file",
        "  - datasets[1] (b).output: o is also datasets[0]'s output",
        "  - datasets[1] (b).columns: input_format columns needs a 'columns' mapping",
    ]


def test_shipped_prepare_example_validates():
    from mimir_data_prep.prepare_config import load_prepare_config

    root = Path(__file__).resolve().parents[2]
    job = load_prepare_config(root / "configs" / "prepare" / "example.yaml")
    assert Path(job.tokenizer).resolve() == DEMO_TOKENIZER_DIR.resolve()
    assert [(d.name, d.input_format) for d in job.datasets] == [
        ("openmath", "columns"),
        ("openhermes", "sharegpt"),
        ("tool-use", "auto"),
    ]
    assert job.datasets[0].columns == {"prompt": "problem", "completion": "generated_solution"}


def test_deeply_nested_lines_are_rejected_not_crashed():
    from mimir_data_prep.records import decode_json_line
    from mimir_data_prep.tool_use import convert_line
    from mimir_data_prep.tool_use.trace import ConversionError

    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "completion": "x"}'
    with pytest.raises(RecordError, match="nested too deeply"):
        decode_json_line(deep)
    with pytest.raises(ConversionError, match="nested too deeply"):
        convert_line(deep)


def test_prepare_config_lists_type_mistakes_of_every_dataset(tmp_path):
    from mimir_data_prep.prepare_config import load_prepare_config

    from mimir_megatron.errors import ConfigError

    config = tmp_path / "prep.yaml"
    config.write_text("tokenizer: tok\nseq_len: long\ndatasets:\n"
                      "  - {name: a, input: [a.jsonl], output: out/a, columns: 3}\n"
                      "  - {name: b, input: [b.jsonl], output: out/b, colour: red}\n")
    with pytest.raises(ConfigError) as err:
        load_prepare_config(config)
    text = str(err.value)
    assert text.startswith(f"invalid prepare config {config}:")
    for fragment in ("prepare.seq_len", "datasets[0].columns", "datasets[1].colour is not a setting"):
        assert fragment in text, (fragment, text)
