"""`mimir synth tools`: xLAM, Glaive, Hermes and ToolACE lines converted to native tool use, compared
exactly with hand-written expected messages; argument parsing; dangling calls and results; the
converted file through `mimir prepare`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
from mimir_data_prep.tool_use import (
    convert_files,
    convert_line,
    parse_arguments,
    parse_call_list,
    parse_literal,
)
from mimir_data_prep.tool_use.trace import ConversionError

from mimir_megatron.cli import main

# --- fixture lines, one per format, and the messages each converts to (tests/data) -------------

RECORDS = json.loads((Path(__file__).resolve().parents[1] / "data" / "tool_use_records.json").read_text())
XLAM, GLAIVE, HERMES, TOOLACE = (RECORDS[fmt]["line"] for fmt in ("xlam", "glaive", "hermes", "toolace"))
XLAM_EXPECTED, GLAIVE_EXPECTED, HERMES_EXPECTED, TOOLACE_EXPECTED = (
    RECORDS[fmt]["expected"] for fmt in ("xlam", "glaive", "hermes", "toolace"))
CASES = {fmt: (record["line"], record["expected"]) for fmt, record in RECORDS.items()}


def _line(obj) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_each_format_converts_to_the_expected_messages(fmt):
    obj, expected = CASES[fmt]
    for requested in ("auto", fmt):
        sample, found, repairs, _ = convert_line(_line(obj), requested)
        assert (found, dict(repairs)) == (fmt, {})
        assert sample == expected


def test_glaive_notes_and_single_text_field():
    _, _, _, notes = convert_line(_line(GLAIVE))
    assert notes == {"system_prompt_replaced": 1, "endoftext_stripped": 3, "arguments_json_string": 1}
    one_field = {"sample": GLAIVE["system"] + GLAIVE["chat"]}
    assert convert_line(_line(one_field))[0] == GLAIVE_EXPECTED
    # An apostrophe inside the single-quoted argument string breaks JSON and Python alike.
    broken = dict(GLAIVE, chat=GLAIVE["chat"].replace('"USD", "target"', '"it\'s USD", "target"'))
    sample = convert_line(_line(broken))[0]
    assert sample["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "base": "it's USD",
        "target": "EUR",
    }
    no_tools = {
        "system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
        "chat": "USER: Hi\nASSISTANT: Hello <|endoftext|>",
    }
    assert convert_line(_line(no_tools))[0] == {
        "messages": [
            {
                "role": "system",
                "content": "You are a helpful assistant, with no access to external functions.",
            },
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ]
    }


# --- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected, how",
    [
        ({"a": 1}, {"a": 1}, None),
        ('{"a": 1, "b": [true, null]}', {"a": 1, "b": [True, None]}, "arguments_json_string"),
        (
            "{'a': 'x', 'b': None, 'c': False}",
            {"a": "x", "b": None, "c": False},
            "arguments_python_literal_string",
        ),
        (
            "{'a': true, 'b': null}",
            {"a": True, "b": None},
            "arguments_python_literal_string",
        ),  # single-quoted JSON
        ('"{\\"a\\": -1.5}"', {"a": -1.5}, "arguments_json_string"),  # JSON string holding JSON
        ("{'t': (1, 2), 1: 'one'}", {"t": [1, 2], "1": "one"}, "arguments_python_literal_string"),
        ("{'path': 'C:\\\\dir\\d'}", {"path": "C:\\dir\\d"}, "arguments_python_literal_string"),
        ("", {}, "arguments_missing"),
        (None, {}, "arguments_missing"),
    ],
)
def test_arguments_parse(value, expected, how):
    assert parse_arguments(value) == (expected, how)


@pytest.mark.parametrize(
    "value",
    [
        "[1, 2]",
        "{'a': 1",
        "__import__('os').system('touch /tmp/mimir_pwned')",
        "{'a': open('/etc/passwd').read()}",
        "{**{'a': 1}}",
        "{'a': f'{1}'}",
        "{'a': 1 + 2}",
        42,
        "(" * 500 + ")" * 500,
    ],
)
def test_arguments_that_are_not_literal_objects_are_rejected(value):
    with pytest.raises(ConversionError) as info:
        parse_arguments(value)
    assert info.value.reason == "bad_arguments"
    assert not Path("/tmp/mimir_pwned").exists()


def _typed(value):
    """``value`` with every scalar paired with its type: -1 == -1.0, but not once typed."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return type(value).__name__, value


@pytest.mark.parametrize(
    "text",
    [
        "{'n': -1, 'x': -2.5, 'p': +3, 'l': [-1, (-2,)], 'b': True}",  # Python literal
        '{"n": -1, "x": -2.5, "p": 3, "l": [-1, [-2]], "b": true}',  # JSON
    ],
)
def test_negative_integers_stay_integers(text):
    """A negative integer argument is an int (written -1 into the training JSON, not -1.0)."""
    want = {"n": -1, "x": -2.5, "p": 3, "l": [-1, [-2]], "b": True}
    arguments, _ = parse_arguments(text)
    assert _typed(arguments) == _typed(want)
    assert json.dumps(arguments) == '{"n": -1, "x": -2.5, "p": 3, "l": [-1, [-2]], "b": true}'
    value, _ = parse_literal(text)
    assert _typed(value) == _typed(want)
    (call,) = parse_call_list("[f(n=-1, x=-2.5, p=+3, l=[-1, (-2,)], b=True)]")
    assert _typed(call.arguments) == _typed(want)


def test_literals_and_call_lists():
    assert parse_literal('{"a": 1}') == ({"a": 1}, "json")
    assert parse_literal("[-1, +2.5, 'x' 'y']") == ([-1, 2.5, "xy"], "python")
    calls = parse_call_list("[f(a=1), mod.g(b='x', c=[true, None])]")
    assert [(c.name, c.arguments) for c in calls] == [
        ("f", {"a": 1}),
        ("mod.g", {"b": "x", "c": [True, None]}),
    ]
    assert [c.name for c in parse_call_list("single(x=1)")] == ["single"]
    spaced = parse_call_list(
        '[Get Live Games(sport="x"), Get-Odds v2(id=3)]', ["Get Live Games", "Get-Odds v2"]
    )
    assert [(c.name, c.arguments) for c in spaced] == [
        ("Get Live Games", {"sport": "x"}),
        ("Get-Odds v2", {"id": 3}),
    ]
    for text, reason in [
        ("[f(1)]", "bad_call"),
        ("[f(**kw)]", "bad_call"),
        ("[f(a=g())]", "bad_arguments"),
        ("[f(a=__import__('os'))]", "bad_arguments"),
        ("[f(a=1), 3]", "bad_call"),
        ("[]", "bad_call"),
        ("[Get Live Games(sport='x')]", "bad_call"),  # not declared: not a Python call
    ]:
        with pytest.raises(ConversionError) as info:
            parse_call_list(text)
        assert info.value.reason == reason, text


# --- dangling calls and results ----------------------------------------------------------------

CALL = 'ASSISTANT: <functioncall> {"name": "get_exchange_rate", "arguments": {"base": "USD", "target": "EUR"}} <|endoftext|>\n'
CALL_NO_RESULT = dict(GLAIVE, chat="USER: Rate?\n" + CALL + "ASSISTANT: I could not get it. <|endoftext|>\n")
RESULT_NO_CALL = {
    "conversations": [
        HERMES["conversations"][0],
        HERMES["conversations"][1],
        HERMES["conversations"][3],
        HERMES["conversations"][4],
    ]
}
PARTLY_ANSWERED = {
    "conversations": HERMES["conversations"][:3]
    + [
        {"from": "tool", "value": HERMES["conversations"][3]["value"].split("\n<tool_response>")[0]},
        HERMES["conversations"][4],
    ]
}


def test_dangling_parts_are_cut_out_or_reject_the_sample():
    sample, _, repairs, _ = convert_line(_line(CALL_NO_RESULT))
    assert dict(repairs) == {"call_without_result": 1}
    assert sample["messages"] == [
        {"role": "user", "content": "Rate?"},
        {"role": "assistant", "content": "I could not get it."},
    ]
    sample, _, repairs, _ = convert_line(_line(RESULT_NO_CALL))
    assert dict(repairs) == {"result_without_call": 2}
    assert sample["messages"] == [HERMES_EXPECTED["messages"][0], HERMES_EXPECTED["messages"][-1]]
    sample, _, repairs, _ = convert_line(_line(PARTLY_ANSWERED))
    assert dict(repairs) == {"call_without_result": 1}
    assert sample["messages"][1]["tool_calls"] == HERMES_EXPECTED["messages"][1]["tool_calls"][:1]
    assert sample["messages"][2:] == [HERMES_EXPECTED["messages"][2], HERMES_EXPECTED["messages"][4]]
    for obj, reason in [
        (CALL_NO_RESULT, "call_without_result"),
        (RESULT_NO_CALL, "result_without_call"),
        (PARTLY_ANSWERED, "call_without_result"),
    ]:
        with pytest.raises(ConversionError) as info:
            convert_line(_line(obj), dangling="drop-sample")
        assert info.value.reason == reason
    # Calls in the final turn need no result (xLAM samples are nothing else).
    final_call = dict(GLAIVE, chat="USER: Rate?\n" + CALL)
    sample, _, repairs, _ = convert_line(_line(final_call), dangling="drop-sample")
    assert not repairs and sample["messages"][-1]["tool_calls"][0]["id"] == "call_1"


# --- whole files: counts, rejects, and `mimir prepare` -----------------------------------------

BAD = [
    (b"", "empty_line"),
    (b"{not json", "malformed_json"),
    (_line({"question": "x", "answer": "y"}), "unknown_format"),
    (_line(dict(XLAM, answers='[{"name": "delete_everything", "arguments": {}}]')), "undeclared_function"),
    (
        _line(dict(XLAM, answers="[{'name': 'live_giveaways_by_type', 'arguments': {'type': beta}}]")),
        "bad_call",
    ),
    (_line(dict(HERMES, conversations=HERMES["conversations"][:4])), "no_final_answer"),
    (
        _line(
            dict(
                TOOLACE,
                conversations=[
                    TOOLACE["conversations"][0],
                    {"from": "assistant", "value": "[newAddress(1)]"},
                ],
            )
        ),
        "bad_call",
    ),
    (_line(dict(GLAIVE, system="SYSTEM: functions -\n{broken")), "bad_tools"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    lines = [_line(XLAM), _line(GLAIVE), BAD[0][0], _line(HERMES), _line(TOOLACE), _line(CALL_NO_RESULT)]
    lines += [line for line, _ in BAD[1:]] + [_line(RESULT_NO_CALL)]
    src = tmp / "mixed.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp / "converted.jsonl"
    assert main(["synth", "tools", "-i", str(src), "-o", str(out), "--no-progress"]) == 0
    return src, out


def test_file_counts_every_line_and_writes_rejects_with_line_numbers(converted):
    src, out = converted
    report = json.loads(out.with_name("converted.report.json").read_text())
    assert (report["lines_read"], report["accepted"], report["repaired"], report["rejected"]) == (14, 4, 2, 8)
    assert report["formats"] == {"glaive": 2, "hermes": 2, "toolace": 1, "xlam": 1}
    expected = {reason: 0 for reason in report["rejects"]}
    for _, reason in BAD:
        expected[reason] += 1
    assert report["rejects"] == expected
    assert report["repairs"] == {"call_without_result": 1, "result_without_call": 1}
    rejects = [json.loads(x) for x in out.with_name("converted.rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(3, "empty_line")] + [
        (6 + i, reason) for i, (_, reason) in enumerate(BAD[1:], 1)
    ]
    assert all(r["file"] == str(src) for r in rejects)
    samples = [json.loads(x) for x in out.read_text().splitlines()]
    assert [s["meta"]["line"] for s in samples] == [1, 2, 4, 5, 6, 14]
    assert [{k: v for k, v in s.items() if k != "meta"} for s in samples[:4]] == [
        XLAM_EXPECTED,
        GLAIVE_EXPECTED,
        HERMES_EXPECTED,
        TOOLACE_EXPECTED,
    ]
    assert samples[4]["meta"]["repairs"] == {"call_without_result": 1}


def test_converted_file_prepares_with_loss_on_the_final_turn(converted, tmp_path):
    from mimir_megatron.chat import ChatRenderer

    from mimir_megatron.data import PreparedDataset

    _, out = converted
    assert (
        main(
            [
                "prepare",
                "-i",
                str(out),
                "-t",
                str(DEMO_TOKENIZER_DIR),
                "-o",
                str(tmp_path / "ds"),
                "--workers",
                "1",
                "--no-progress",
                "--seq-len",
                "1024",
            ]
        )
        == 0
    )
    ds = PreparedDataset(tmp_path / "ds")
    assert ds.record.accepted == 6 and ds.record.rejected == 0
    assert list(ds.record.input_formats.values())[0]["format"] == "messages"
    decode = ChatRenderer(DEMO_TOKENIZER_DIR).tokenizer.decode

    def texts(i):
        return [decode(part.tolist(), skip_special_tokens=False) for part in ds.document(i)]

    prefix, response = texts(0)  # xLAM: the final turn is the calls themselves
    assert response == (
        '<tool_call>{"name": "live_giveaways_by_type", "arguments": {"type": "beta"}}</tool_call>'
        '<tool_call>{"name": "live_giveaways_by_type", "arguments": {"type": "game", "ids": [1, 2]}}</tool_call>'
        "<end_of_turn>"
    )
    assert prefix.startswith('<bos><start_of_turn>tools\n{"name": "live_giveaways_by_type", "description": ')
    prefix, response = texts(2)  # Hermes: calls and results in the prefix, the answer is trained
    assert response == "AAPL trades at $150.75 and TSLA at $200.50.<end_of_turn>"
    assert (
        '<start_of_turn>model\n<tool_call>{"name": "get_stock_price", "arguments": {"symbol": "AAPL"}}</tool_call>'
        '<tool_call>{"name": "get_stock_price", "arguments": {"symbol": "TSLA"}}</tool_call><end_of_turn>\n'
        '<start_of_turn>tool\n{"symbol": "AAPL", "price": 150.75}<end_of_turn>\n' in prefix
    )
    assert prefix.endswith("<end_of_turn>\n<start_of_turn>model\n")


def test_results_are_matched_to_calls_by_function_name():
    turns = TOOLACE["conversations"]
    swapped = turns[2]["value"].split(", {")
    reordered = "[{" + swapped[1][:-1] + ", " + swapped[0][1:] + "]"
    obj = dict(TOOLACE, conversations=[turns[0], turns[1], {"from": "tool", "value": reordered}, turns[3]])
    sample, _, repairs, _ = convert_line(_line(obj), dangling="drop-sample")
    tools = [m for m in sample["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["name"]) for m in tools] == [
        ("call_2", "newAddress"),
        ("call_1", "Market Trends API"),
    ]
    assert tools[0]["content"] == '{"status": "ok"}' and not repairs


def test_parquet_rows_convert_like_lines(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = sorted({k for row in (XLAM, HERMES, TOOLACE) for k in row})
    rows = [{k: row.get(k) for k in columns} for row in (XLAM, HERMES, TOOLACE)]  # absent: null
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=2)
    report = convert_files([tmp_path / "in.parquet"], tmp_path / "out.jsonl", progress=False)
    assert (report["lines_read"], report["accepted"], report["rejected"]) == (3, 3, 0)
    samples = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in s.items() if k != "meta"} for s in samples] == [
        XLAM_EXPECTED,
        HERMES_EXPECTED,
        TOOLACE_EXPECTED,
    ]
    assert [s["meta"]["line"] for s in samples] == [1, 2, 3]
