"""`mimir synth run` building blocks: pipeline validation, deterministic checks, verdicts, state file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mimir_data_prep.synth_pipeline.checks import run_checks, structure_differences
from mimir_data_prep.synth_pipeline.pipeline import CheckConfig, VerdictConfig, load_pipeline
from mimir_data_prep.synth_pipeline.evidence_file import StateFile
from mimir_data_prep.synth_pipeline.verdict import UNPARSEABLE, first_json_object, parse_verdict
from mimir_megatron.errors import ConfigError, UserError
from synth_records import evidence_row

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs" / "synth").glob("*.yaml"))


def test_four_shipped_pipelines_validate():
    names = {load_pipeline(p).config.name for p in SHIPPED}
    assert names == {"text_to_instruction", "repair", "translate_da", "domain_tasks"}


def _write(tmp: Path, yaml: str) -> Path:
    (tmp / "s.jsonl").write_text('{"text": "a"}\n')
    (tmp / "g.j2").write_text("GEN {{ row.text")  # unclosed tag
    (tmp / "a.j2").write_text("AUDIT {{ row.text }}")
    (tmp / "p.yaml").write_text(yaml)
    return tmp / "p.yaml"


def test_every_mistake_is_listed_once(tmp_path):
    path = _write(tmp_path, """
name: bad
source: {path: s.jsonl, formatt: jsonl}
endpoints:
  generator: {model: g, base_url: "localhost:8000", max_tokens: 0}
  auditor: {model: a}
generate: {prompt: g.j2, parse: yaml}
audit: {prompt: missing.j2, endpoint: judge}
checks:
  - {kind: verbatim, needle: candidate.answer}
  - {kind: regex}
  - {kind: length, value: "{{ candidate.x }}", haystack: row.text}
  - {kind: structure, source: row.messages, target: candidate.messages, preserve: [colours]}
output:
  messages: [{role: user, content: "{{ row.text }}"}]
concurrency: 0
""")
    with pytest.raises(ConfigError) as info:
        load_pipeline(path)
    lines = str(info.value).splitlines()[1:]
    expected = [
        "source.formatt: unknown setting",
        "audit.endpoint: 'judge' is not in endpoints",
        "endpoints.generator.base_url must start with http",
        "endpoints.generator.max_tokens must be >= 1",
        "generate.parse must be one of text, json",
        "checks[0].haystack: required for kind verbatim",
        "checks[1].kind must be one of",
        "checks[2].haystack: not used by kind length",
        "checks[3].preserve: unknown part(s) colours",
        "output.messages: the last message must have role assistant",
        "concurrency must be >= 1",
        "generate.prompt: ",  # the template syntax error, with file and line
        "audit.prompt: template file not found",
        "checks[2].value: an expression, not a template",
    ]
    assert len(lines) == len(expected), "\n".join(lines)
    for want in expected:
        assert sum(want in line for line in lines) == 1, (want, lines)
    assert any("g.j2:1:" in line for line in lines)


def test_missing_required_values_and_wrong_types(tmp_path):
    path = _write(tmp_path, "source: {}\nendpoints: {generator: {base_url: 'http://x'}}\n")
    with pytest.raises(ConfigError) as info:
        load_pipeline(path)
    msg = str(info.value)
    for want in ("name: required", "source.path: required", "generate.prompt: required",
                 "audit.prompt: required", "endpoints.generator.model: required"):
        assert want in msg
    (tmp_path / "g.j2").write_text("GEN {{ row.text }}")
    path = _write(tmp_path, "name: x\nsource: {path: s.jsonl}\nconcurrency: many\n"
                  "endpoints: {generator: {model: g}, auditor: {model: a}}\n"
                  "generate: {prompt: a.j2}\naudit: {prompt: a.j2}\n"
                  "output: {messages_expr: row.text}\n")
    with pytest.raises(ConfigError, match="concurrency"):
        load_pipeline(path)


def test_fingerprint_covers_prompts_not_operations(tmp_path):
    src = REPO / "configs" / "synth" / "text_to_instruction.yaml"
    base = load_pipeline(src).fingerprint()
    assert load_pipeline(src, ["concurrency=2", "endpoints.generator.base_url=http://h:1/v1",
                               "retry.max_retries=1"]).fingerprint() == base
    assert load_pipeline(src, ["endpoints.generator.model=other"]).fingerprint() != base
    assert load_pipeline(src, ["checks.0.normalize_whitespace=true"]).fingerprint() != base


# --- deterministic checks ---------------------------------------------------------------------

def _check(**kw) -> CheckConfig:
    return CheckConfig(**kw)


def _run(check: CheckConfig, **values):
    return run_checks([check], lambda i, arg: values[arg])[0]


def test_verbatim_and_not_contains():
    c = _check(kind="verbatim", needle="x", haystack="y")
    assert _run(c, needle="built in 1858", haystack="It was built in 1858.").passed
    assert not _run(c, needle="built in  1858", haystack="It was built in 1858.").passed
    assert not _run(c, needle="  ", haystack="anything").passed
    assert not _run(c, needle=None, haystack="text").passed
    loose = _check(kind="verbatim", needle="x", haystack="y", normalize_whitespace=True)
    assert _run(loose, needle="built in  1858", haystack="It was built\nin 1858.").passed
    nc = _check(kind="not_contains", needle="x", haystack="y")
    assert not _run(nc, needle="1858", haystack="When? 1858?").passed
    assert _run(nc, needle="1858", haystack="When was it built?").passed


def test_a_check_on_a_missing_candidate_field_fails_instead_of_passing(tmp_path):
    pipeline = load_pipeline(REPO / "configs" / "synth" / "text_to_instruction.yaml")
    ctx = {"row": {"text": "abc def"}, "candidate": {"instruction": "q"}}  # no "answer"
    results = run_checks(pipeline.config.checks,
                         lambda i, arg: pipeline.evaluate(f"checks[{i}].{arg}", **ctx))
    assert [r.passed for r in results] == [False, False, False]
    assert "cannot evaluate" in results[0].detail


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Which is right?\nA) $x^2$\n(b) `f(x)`\nAnswer <final>."},
    {"role": "assistant", "content": "Here:\n```python\nprint(1)\n```\nSo \\(a+b\\) holds; A) wins."},
    {"role": "assistant", "content": '{"city": "Aarhus", "year": 1909}',
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
]


def _translated(changes: dict | None = None) -> list[dict]:
    out = [dict(m, content="Oversat. " + m["content"] if i < 3 else m["content"]) for i, m in enumerate(CONV)]
    out[1]["content"] = "Hvilken er rigtig?\nA) $x^2$\n(b) `f(x)`\nSvar <final>."
    for (i, key), value in (changes or {}).items():
        out[i][key] = value
    return out


PARTS = ["roles", "code_blocks", "inline_code", "math", "structured", "labels"]


def test_structure_preserving_translation_passes():
    assert structure_differences(CONV, _translated(), PARTS) == []


@pytest.mark.parametrize("change, problem", [
    ({(2, "content"): "Her:\n```python\nprint(2)\n```\nSå \\(a+b\\) gælder; A) vinder."}, "code block 1 changed"),
    ({(2, "content"): "Her:\n```python\nprint(1)\n```\nSå \\(a-b\\) gælder; A) vinder."}, "formula 1 changed"),
    ({(1, "content"): "Hvilken?\nA) $x^2$\n(b) `g(x)`\nSvar <final>."}, "inline code 1 changed"),
    ({(1, "content"): "Hvilken?\nA: $x^2$\n(b) `f(x)`\nSvar <final>."}, "label"),
    ({(1, "content"): "Hvilken?\nA) $x^2$\n(b) `f(x)`\nSvar <endelig>."}, "label"),
    ({(3, "content"): '{"by": "Aarhus", "år": 1909}'}, "structured (JSON) content changed"),
    ({(3, "tool_calls"): []}, "tool_calls changed"),
    ({(0, "role"): "user"}, "role 'system' became 'user'"),
])
def test_structure_changes_are_caught(change, problem):
    found = structure_differences(CONV, _translated(change), PARTS)
    assert any(problem in p for p in found), found


def test_structure_message_count_and_check_wrapper():
    c = _check(kind="structure", source="s", target="t")
    assert "3 messages, the source has 4" in _run(c, source=CONV, target=_translated()[:3]).detail
    assert not _run(c, source=CONV, target="not a list").passed
    assert _run(c, source=CONV, target=_translated()).passed


# --- verdicts ---------------------------------------------------------------------------------

V = VerdictConfig()


def test_verdict_parsing():
    v = parse_verdict('Sure.\n```json\n{"verdict": "Keep", "reasons": []}\n```', V)
    assert (v.verdict, v.parsed) == ("accept", True)
    v = parse_verdict('{"note": {"a": 1}} then {"verdict": "regenerate", "reasons": ["Wrong answer!"]}', V)
    assert v.verdict == "regenerate" and v.codes == ["wrong_answer"]
    v = parse_verdict('{"verdict": "discard", "reasons": [{"code": "off_topic", "detail": "about cats"}]}', V)
    assert v.reasons == [{"code": "off_topic", "detail": "about cats"}]
    assert parse_verdict('{"verdict": "discard"}', V).codes == ["unspecified"]
    for reply in ("looks fine", '{"verdict": "maybe"}', "", None, '{"verdict": "accept"'):
        v = parse_verdict(reply, V)
        assert (v.verdict, v.parsed, v.codes) == ("discard", False, [UNPARSEABLE]), reply
    lenient = VerdictConfig(on_unparseable="regenerate", reason_codes=["wrong"])
    assert parse_verdict("??", lenient).verdict == "regenerate"
    assert parse_verdict('{"verdict": "retry", "reasons": ["wrong", "odd"]}', lenient).codes == ["wrong", "other"]


def test_first_json_object_needs_the_required_keys():
    text = 'x {"a": 1} y {"instruction": "q", "answer": "{not json}"} z'
    assert first_json_object(text, ("instruction", "answer"))["answer"] == "{not json}"
    assert first_json_object("[1, 2]") is None


# --- state file -------------------------------------------------------------------------------

def test_state_file_cuts_a_partial_line_and_the_latest_record_wins(tmp_path):
    with StateFile(tmp_path) as state:
        state.append(evidence_row("r1"))
        state.append(evidence_row("r2"))
        state.append(evidence_row("r1", "discarded", "h2"))
        with pytest.raises(UserError, match="in use"):
            StateFile(tmp_path).open()
    with (tmp_path / "evidence.jsonl").open("ab") as f:
        f.write(b'{"row_id": "r3", "input_sha')  # a kill in the middle of a write
    with StateFile(tmp_path) as state:
        assert set(state.index) == {"r1", "r2"}
        latest = state.read(state.index["r1"])
        assert (latest.status, latest.input_sha256, latest.reasons) == ("discarded", "h2", ("off_topic",))
        state.append(evidence_row("r3"))
    lines = (tmp_path / "evidence.jsonl").read_text().splitlines()
    assert [json.loads(x)["row_id"] for x in lines] == ["r1", "r2", "r1", "r3"]


def test_pipeline_change_is_refused_unless_allowed(tmp_path):
    from mimir_megatron.integrity import Fingerprint

    with StateFile(tmp_path) as state:
        state.check_pipeline(Fingerprint("a" * 64), "p", allow_change=False)
        state.check_pipeline(Fingerprint("a" * 64), "p", allow_change=False)
        with pytest.raises(UserError, match="pipeline changed"):
            state.check_pipeline(Fingerprint("b" * 64), "p", allow_change=False)
        state.check_pipeline(Fingerprint("b" * 64), "p", allow_change=True)


def test_a_pipeline_stamped_by_the_earlier_encoding_resumes(tmp_path):
    """A Danish prompt: the stamp an earlier version wrote (ASCII-escaped JSON, no format) is the
    same pipeline, and the run resumes; writing the stamp again gives it today's format."""
    import hashlib

    from mimir_data_prep.synth_pipeline.run_records import PIPELINE_FORMAT, PipelineStamp
    from mimir_megatron.integrity import fingerprint

    tree = {"prompt": "Oversæt til dansk"}
    earlier = hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()
    (tmp_path / "pipeline.json").write_text(json.dumps({"name": "p", "fingerprint": earlier}))
    with StateFile(tmp_path) as state:
        state.check_pipeline(fingerprint(tree), "p", allow_change=False)
    stamp = json.loads((tmp_path / "pipeline.json").read_text())
    assert stamp["format"] == PIPELINE_FORMAT and PipelineStamp.read(tmp_path).fingerprint == fingerprint(tree)


def test_evidence_written_before_formats_reads_as_it_is(tmp_path):
    """A state file of an earlier version (rows without format and digest) resumes: its rows are
    read as they are; a row of today's format is checked against its digest."""
    row = evidence_row("r1").to_dict()
    old = {k: v for k, v in row.items() if k not in ("format", "digest")}
    (tmp_path / "evidence.jsonl").write_text(json.dumps(old) + "\n" + json.dumps({**row, "status": "error"}) + "\n")
    with pytest.raises(UserError, match=r"evidence.jsonl: line 2: edited after `mimir synth run` wrote it"):
        StateFile(tmp_path).open()
    (tmp_path / "evidence.jsonl").write_text(json.dumps(old) + "\n")
    with StateFile(tmp_path) as state:
        assert state.read(state.index["r1"]).attempts[0].verdict == "accept"


def test_cli_check_flag(capsys):
    # `python -m mimir_data_prep.synth_pipeline`: `mimir synth run` under its older name, options
    # and KEY=VALUE overrides intermixed, and the same error rule (one line, exit code 2).
    from mimir_data_prep.synth_pipeline.__main__ import main

    assert main([str(SHIPPED[0]), "--check"]) == 0
    assert "valid" in capsys.readouterr().out
    assert main([str(SHIPPED[0]), "no_such_key=1", "--check"]) == 2
    assert main([str(SHIPPED[0]), "--check", "no_such_key=1"]) == 2
    assert main(["-v", str(SHIPPED[0]), "--check"]) == 0


def test_registers_into_the_synth_group():
    from mimir_data_prep.entrypoints.synth import cmd_run

    from mimir_megatron.cli import build_parser

    args = build_parser().parse_args(["synth", "run", "p.yaml", "a.b=1", "c=2", "--output", "o", "-n", "3",
                                      "--retry-errors"])
    assert (args.pipeline, args.overrides, args.output, args.concurrency) == ("p.yaml", ["a.b=1", "c=2"], "o", 3)
    assert args.retry_errors and args.handler is cmd_run and args.extra == "synth"
