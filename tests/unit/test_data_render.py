"""`mimir prepare`'s fast paths. The render stage renders a conversation's chat template once
(mimir_data_prep.render): on every template it proves, the (prefix, response) texts equal
ChatRenderer's two renders exactly, on adversarial conversations; a template it cannot prove is
rendered twice; a prepared dataset is the same bytes either way. The control-character screen
skips lines that cannot hold one; a shard leaves nothing frozen from the garbage collector."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from mimir_data_prep.demo_tokenizer import CHAT_TEMPLATE, DEMO_TOKENIZER_DIR
from mimir_data_prep.render import SingleRender, single_render_plan

from mimir_megatron.chat import ChatRenderer, ChatTemplateError

# The shape of google/gemma-3's template: `| trim` rewrites content, a newline follows each turn.
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Turns end with <eos> and two newlines, no end-of-turn token at all.
EOS = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '<eos>\n\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
# Qwen/ChatML-like: a system turn read before the loop at messages[0], tools as JSON, tool calls,
# reasoning written when present, a namespace carried across turns, roles checked with an error.
CHATML = (
    "{%- set ns = namespace(turns=0) %}"
    "{%- if tools %}<start_of_turn>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}<end_of_turn>\n"
    "{%- elif messages[0]['role'] == 'system' %}<start_of_turn>system\n{{ messages[0]['content'] }}<end_of_turn>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'wizard' %}{{ raise_exception('no wizards') }}{% endif %}"
    "{%- if not (loop.first and message.role == 'system' ) %}{% set ns.turns = ns.turns + 1 %}"
    "<start_of_turn>{{ message.role }}\n{{ ns.turns }}{{ ' after ' + loop.previtem.role if loop.previtem }}: "
    "{%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{% if not loop.first %},{% endif %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% if loop.last %}.{% endif %}{% endfor %}"
    "<end_of_turn>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}"
)
PROVEN = {"demo": CHAT_TEMPLATE, "gemma": GEMMA, "eos": EOS, "chatml": CHATML}

# Templates whose output before the final turn depends on it, or that the proof does not read.
UNPROVEN = {
    "loop.last": "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if not loop.last %}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}\nassistant:{% endif %}",
    "length": "{% for m in messages %}[{{ messages|length }}]{{ m.content }}{% endfor %}"
              "{% if add_generation_prompt %}A:{% endif %}",
    "messages[-1]": "{{ messages[-1].role }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "slice": "{% for m in messages[1:] %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}A{% endif %}",
    "generation prompt in the loop": "{% for m in messages %}{{ m.content }}{% if add_generation_prompt %}"
                                     "+{% endif %}{% endfor %}{% if add_generation_prompt %}A{% endif %}",
    "not constant after the loop": "{% for m in messages %}{{ m.content }}{% endfor %}"
                                   "{% if add_generation_prompt %}{{ bos_token }}{% endif %}",
    "filtered loop": "{% for m in messages if m.role != 'system' %}{{ m.content }}|{% endfor %}",
    "transformers' generation tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                                    "{% endfor %}",
}

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Vejret <i> byen — ☀",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"name": "clock", "parameters": {}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Århus"}}}
WORDS = ["hej", "æøå", "日本語", "😀", "  spaced  ", "\n\nnl\n", "</think>", "<end_of_turn>", "<start_of_turn>model",
         "{{ x }}", "{% if %}", "a@b.dk", "tab\there", ""]


def adversarial_conversations(count: int, seed: int = 0) -> list[tuple[list[dict], list | None]]:
    """Hand-picked edge cases, then random ones: system prompts (empty too), empty turns, many
    turns, tool calls with and without content, tool results, reasoning, None values, non-ASCII."""
    rng = random.Random(seed)
    convs: list[tuple[list[dict], list | None]] = [
        ([{"role": "assistant", "content": "alone"}], None),
        ([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}], None),
        ([{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "ok"}], None),
        ([{"role": "system", "content": ""}, {"role": "user", "content": "Weather?"},
          {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
          {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "c1"},
          {"role": "assistant", "content": "3 °C.", "reasoning_content": "the tool said 3"}], TOOLS),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "thinking": "hmm"}], []),
        ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"},
          {"role": "assistant", "content": "z"}], None),
        ([{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": " y \n"}], TOOLS),
    ]
    for _ in range(count):
        messages = [{"role": "system", "content": rng.choice(WORDS)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(0, 4)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(0, 5)))})
            if rng.random() < 0.3:
                messages.append({"role": "assistant", "content": rng.choice([None, "", "calling"]), "tool_calls": [CALL]})
                messages.append({"role": "tool", "content": "3", "tool_call_id": "c1"})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(0, 5)))})
        final = {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))}
        if rng.random() < 0.2:
            final["tool_calls"] = [CALL]
        if rng.random() < 0.1:
            final["reasoning_content"] = "tænker"
        messages += [{"role": "user", "content": rng.choice(WORDS)}, final]
        convs.append((messages, rng.choice([None, TOOLS, [TOOLS[0]]])))
    return convs


CONVERSATIONS = adversarial_conversations(60)


def _tokenizer(root: Path, name: str, template: str) -> Path:
    out = root / name
    if not out.exists():
        shutil.copytree(DEMO_TOKENIZER_DIR, out)
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def renderers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: ChatRenderer(_tokenizer(root, name, t)) for name, t in {**PROVEN, **UNPROVEN}.items()}


def _outcome(render, messages, tools):
    try:
        return render(messages, tools)
    except ChatTemplateError as exc:
        return f"ChatTemplateError: {exc}"


@pytest.mark.parametrize("name", sorted(PROVEN))
def test_one_render_equals_two_on_every_proven_template(renderers, name):
    renderer = renderers[name]
    single = SingleRender(renderer)
    assert single.plan is not None, single.reason
    once = 0
    for messages, tools in CONVERSATIONS:
        want = _outcome(renderer.render, messages, tools)
        assert _outcome(single.render, messages, tools) == want, (messages, tools)
        try:
            once += single._render_once(single.plan, messages, tools) is not None
        except ChatTemplateError:
            once += 1  # the single render's own error, equal to the two renders' (above)
    # all but the single-message conversation (its prefix is empty: transformers refuses it)
    # and, for the template that reads messages[0] before the loop, none fall back
    assert once == len(CONVERSATIONS) - 1, once


@pytest.mark.parametrize("name", sorted(UNPROVEN))
def test_a_template_the_proof_cannot_read_is_rendered_twice(renderers, name):
    renderer = renderers[name]
    single = SingleRender(renderer)
    assert single.plan is None and single.reason
    for messages, tools in CONVERSATIONS[:20]:
        assert _outcome(single.render, messages, tools) == _outcome(renderer.render, messages, tools)


def test_the_plan_names_what_it_cannot_prove():
    assert "looks ahead" in single_render_plan(UNPROVEN["loop.last"])
    assert "constant index" in single_render_plan(UNPROVEN["length"])
    # a nested loop's own loop.last is fine; the messages loop's after a nested loop is not
    nested = "{% for m in messages %}{% for c in m.calls %}{{ loop.last }}{% endfor %}{% endfor %}"
    assert not isinstance(single_render_plan(nested), str)
    outer = "{% for m in messages %}{% for c in m.calls %}{% endfor %}{{ loop.last }}{% endfor %}"
    assert "looks ahead" in single_render_plan(outer)
    assert single_render_plan(CHATML).max_index == 0


def test_content_holding_the_marker_falls_back_to_two_renders(renderers):
    renderer = renderers["demo"]
    single = SingleRender(renderer)
    messages = [{"role": "user", "content": f"say {single.plan.marker}"}, {"role": "assistant", "content": "no"}]
    assert single._render_once(single.plan, messages, None) is None
    assert single.render(messages) == renderer.render(messages)


def test_a_template_whose_single_render_differs_on_a_probe_is_rendered_twice(renderers, monkeypatch):
    """The once-per-process probe: an environment that renders differently from transformers'
    (here: jinja's own tojson, which escapes HTML and non-ASCII) is caught before any document."""
    import mimir_data_prep.render as render

    make = render.template_environment

    def jinja_tojson():
        import jinja2.filters

        env = make()
        env.filters["tojson"] = jinja2.filters.do_tojson
        return env

    monkeypatch.setattr(render, "template_environment", jinja_tojson)
    single = SingleRender(renderers["demo"])
    assert single.plan is None and "probe" in single.reason


def test_prepared_bytes_are_the_same_with_one_render_or_two(tmp_path, monkeypatch):
    """A dataset of tool-use, multi-turn and rejected lines prepared with the single render and
    with it turned off: every output file is the same bytes (the manifest too)."""
    import mimir_data_prep.shard_writer as shard_writer
    from mimir_data_prep.prepare import prepare

    tokenizer = _tokenizer(tmp_path, "chatml", CHATML)
    lines = [json.dumps({"messages": m, **({"tools": t} if t else {})}, ensure_ascii=False)
             for m, t in CONVERSATIONS]
    lines += ["", "{bad", json.dumps({"messages": [{"role": "user", "content": "x"}]}),
              json.dumps({"messages": [{"role": "user", "content": "long " * 200}, {"role": "assistant", "content": "ok"}]})]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = {}
    for name, single in (("once", True), ("twice", False)):
        shard_writer._single_renders.clear()
        if not single:
            monkeypatch.setattr(shard_writer, "SingleRender", _TwoRenders)
        prepare([src], tokenizer, tmp_path / name, seq_len=256, workers=1, progress=False,
                personal_data="report")
        assert (shard_writer._single_renders[str(tokenizer)].plan is not None) == single
        files = {p.relative_to(tmp_path / name): p.read_bytes()
                 for p in sorted((tmp_path / name).rglob("*")) if p.is_file()}
        files[Path("manifest.json")] = files[Path("manifest.json")].replace(str(tmp_path / name).encode(), b"OUT")
        out[name] = files
    shard_writer._single_renders.clear()
    assert out["once"] == out["twice"]
    manifest = json.loads(out["once"][Path("manifest.json")])
    assert manifest["accepted"] > 15 and manifest["rejected"] >= 4


class _TwoRenders(SingleRender):
    def __init__(self, renderer):
        super().__init__(renderer)
        self.plan = None


def test_a_line_the_control_character_screen_skips_holds_none():
    """The screen skips the search of a line whose bytes cannot hold a control character: for
    every code point below U+00A0 and beside it, raw or escaped, at one or two depths of JSON
    in a JSON string, a line whose decoded strings hold a control character is never skipped."""
    from mimir_data_prep.records import _CONTROL
    from mimir_data_prep.screen import may_hold_control

    skipped = 0
    for code in [*range(0xA1), 0x2028, 0xFFFD, 0x1F600]:
        text = f"a{chr(code)}b"
        inner = json.dumps({"arguments": text}, ensure_ascii=code % 2 == 0)
        for value in (text, inner, json.dumps(inner)):
            for ascii_only in (True, False):
                raw = json.dumps({"messages": [{"role": "user", "content": value}]},
                                 ensure_ascii=ascii_only).encode()
                holds = _CONTROL.search(text) is not None
                if not may_hold_control(raw):
                    skipped += 1
                    assert not holds, (code, raw)
    assert skipped > 500  # most lines are skipped


def test_the_control_byte_test_agrees_with_the_regex_on_every_code_point():
    """decode_json_line looks for raw control characters in the line's bytes: for every code
    point, alone and beside ASCII and wider text, the bytes hold one exactly where the regex finds
    one in the text (the regex then names it)."""
    from mimir_data_prep.records import _CONTROL, holds_control_bytes

    for code in range(0x110000):
        if 0xD800 <= code < 0xE000:
            continue  # surrogates: not encodable, no line holds one
        texts = [chr(code)] + ([f"a{chr(code)}b", f"æ{chr(code)}日😀"] if code < 0x800 else [])
        for text in texts:
            assert holds_control_bytes(text.encode()) == (_CONTROL.search(text) is not None), hex(code)


def test_the_screens_fast_path_gives_the_same_conversation(tmp_path):
    """Lines with escaped and raw control characters under both policies: the same conversation
    and count with the raw line given (the fast path) as without it."""
    from mimir_data_prep.records import decode_json_line, to_conversation
    from mimir_data_prep.screen import screen_text
    from mimir_data_prep.settings import prepare_settings

    texts = ["plain", "nul \u0000", "bell \u0007", "del \u007f", "c1 \u0085", "ok \u00e6\u00f8", "bs \b ff \f",
             "tab\tnl\n", "\\u0000 written out"]
    for policy in ("reject", "strip"):
        settings = prepare_settings(str(DEMO_TOKENIZER_DIR), control_chars=policy, personal_data="report")
        for text in texts:
            for ascii_only in (True, False):
                raw = json.dumps({"messages": [{"role": "user", "content": text},
                                               {"role": "assistant", "content": "ok"}]}, ensure_ascii=ascii_only)
                raw = raw.encode()
                results = []
                for given in (raw, None):
                    try:
                        conv = to_conversation(decode_json_line(raw, policy))
                        results.append(screen_text(conv, settings, {}, given))
                    except Exception as exc:  # noqa: BLE001 (compared below)
                        results.append(repr(exc))
                assert results[0] == results[1], (policy, text, results)


def test_a_shard_leaves_no_object_frozen_from_the_collector(tmp_path):
    """process_shard freezes the objects that exist before it (the collector's full passes skip
    them) and unfreezes them after, also when it fails: nothing stays out of collection."""
    import gc

    from mimir_data_prep.prepare import prepare

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello there"}]}) + "\n")
    prepare([src], str(DEMO_TOKENIZER_DIR), tmp_path / "out", workers=1, progress=False)
    assert gc.get_freeze_count() == 0
    src.write_text("{bad\n")
    with pytest.raises(Exception):
        prepare([src], str(DEMO_TOKENIZER_DIR), tmp_path / "strict", workers=1, progress=False, strict=True)
    assert gc.get_freeze_count() == 0


def test_encode_batch_gives_the_ids_of_the_tokenizers_encode_batch(monkeypatch):
    """ChatRenderer.encode_batch encodes without character offsets (encode_batch_fast): the ids
    equal the offset-tracking encode_batch's on rendered adversarial conversations (special
    tokens, markup, non-ASCII, empty texts) and on the demo data, and the fast call is the one made."""
    from mimir_data_prep.demo_data import generate

    renderer = ChatRenderer(DEMO_TOKENIZER_DIR)
    backend = renderer.tokenizer.backend_tokenizer
    texts = ["", " ", "\n\n", "<eos><eos>x", *WORDS]
    for messages, tools in CONVERSATIONS:
        texts += list(_outcome(renderer.render, messages, tools))
    train, held_out = generate(seed=1, train_per_group=40, eval_per_group=5)
    for samples in (*train.values(), *held_out.values()):
        for s in samples:
            texts += list(renderer.render([{"role": "user", "content": s.prompt},
                                           {"role": "assistant", "content": s.completion}]))
    want = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    calls: list[str] = []
    monkeypatch.setattr(renderer.tokenizer, "_tokenizer", _Spy(backend, calls), raising=False)
    assert renderer.tokenizer.backend_tokenizer is not backend, "the spy is not the renderer's tokenizer"
    assert renderer.encode_batch(texts) == want
    assert calls == ["encode_batch_fast"]
    assert sum(map(len, want)) > 10_000


class _Spy:
    """A Rust tokenizer that records which of its batch calls is made."""

    def __init__(self, backend, calls: list[str]) -> None:
        self.backend, self.calls = backend, calls

    def __getattr__(self, name: str):
        if name.startswith("encode_batch"):
            self.calls.append(name)
        return getattr(self.backend, name)


SANDBOX_PROBES = [  # what a template may try on the values it is given
    "{{ message.update({'role': 'x'}) }}", "{{ messages.append(1) }}", "{{ message.pop('role') }}",
    "{{ message.__class__ }}", "{{ message.items.__self__ }}", "{{ messages.__class__.__mro__ }}",
    "{{ message.role }}|{{ message.missing }}|{{ message.get('content') }}|{{ messages.index(message) }}",
    "{{ message.get('missing', 'd') }}|{{ message.items() | list }}|{{ loop_vars }}",
    "{{ '{0.__class__}'.format(message) }}", "{{ message.content.format(message) }}",
    "{% for m in messages %}{{ m.get('role') }}{{ loop.index }}{{ m.keys() | list }}{% endfor %}",
    "{{ message.clear() }}", "{{ messages.sort() }}", "{{ message.setdefault('a', 1) }}",
    "{{ message.get.__self__ }}", "{{ message.get is defined }}{{ message.pop is defined }}", "{{ ns.x }}{% set ns.y = message.get('role') %}{{ ns.y }}",
    "{% for m in messages %}{{ loop.first }}{{ loop.index }}{{ loop.index0 }}{{ loop.depth }}{{ loop.length }}"
    "{{ loop.revindex }}{{ loop.last }}{{ loop.cycle('a', 'b') }}{{ loop.changed(m.role) }}{{ loop.previtem }}"
    "{{ loop.missing }}{{ loop.first.__class__ }}{% endfor %}",
    "{% for m in messages %}{{ loop.length }}{{ loop._length }}{% endfor %}",  # a private int: refused
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}", "{% for m in messages %}{{ loop._iterator }}{% endfor %}",
]


@pytest.mark.parametrize("source", SANDBOX_PROBES)
def test_the_template_environment_refuses_what_jinjas_sandbox_refuses(source):
    """The render environment's fast paths for JSON values (remembered attribute verdicts,
    getattr without the str.format check, built-in methods called directly) give what jinja's
    own ImmutableSandboxedEnvironment gives: the same output or the same error, unsafe access
    refused alike."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from mimir_data_prep.render import template_environment

    ours = template_environment()
    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])
    reference.filters["tojson"] = ours.filters["tojson"]
    reference.globals.update(ours.globals)
    outcomes = []
    for env in (ours, reference):
        message = {"role": "user", "content": "hi {0}"}
        variables = {"message": message, "messages": [message, {"role": "assistant", "content": "ok"}]}
        try:
            template = env.from_string("{% set ns = namespace(x=1) %}" + source)
            outcomes.append(template.render(**variables))
        except Exception as exc:  # noqa: BLE001 (compared below)
            outcomes.append(f"{type(exc).__name__}: {exc}")
        assert message == {"role": "user", "content": "hi {0}"}
    assert outcomes[0] == outcomes[1]
