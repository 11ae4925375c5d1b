"""`mimir serve` beyond plain text: top log-probs, structured output, tool calls, refused fields.

One tiny random model (the demo tokenizer's vocabulary) and one server for the module. Random
weights: only a grammar makes the output well-formed, which is what these tests need to see.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from inference_workloads import served_engine

from mimir_megatron.batch import single_sample_batch

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(900)

SCHEMA = {  # an enum, a number and a nested object (strict: no other keys)
    "type": "object", "additionalProperties": False, "required": ["label", "score", "detail"],
    "properties": {
        "label": {"enum": ["positiv", "neutral", "negativ"]},
        "score": {"type": "number"},
        "detail": {"type": "object", "additionalProperties": False, "required": ["count", "ok"],
                   "properties": {"count": {"type": "integer"}, "ok": {"type": "boolean"}}},
    },
}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Oslo", "Aarhus", "Lund"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def engine():
    return served_engine()


@pytest.fixture(scope="module")
def served(engine):
    from mimir_megatron.inference.server import app_server, build_app, serve_app_in_thread

    app = build_app(engine, max_queue=64, max_tokens_limit=160, max_batch_size=32)
    with serve_app_in_thread(app) as url:
        yield url, app_server(app)


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[0], api_key="x", max_retries=0, timeout=300)


def _greedy_forward(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from the PrefixLM forward itself (prompt bidirectional, generated tokens
    causal), and the ``[steps, vocab]`` log-softmax at the positions that chose them."""
    generated: list[int] = []
    for _ in range(steps + 1):
        batch = single_sample_batch([prompt], [[*generated, 0]])
        with torch.no_grad():
            logits = model(batch).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(generated)], dim=-1)
        if len(generated) == steps:
            return generated, logprobs[:steps]
        generated.append(int(logprobs[-1].argmax()))
    raise AssertionError("unreachable")


# -- top log-probs ---------------------------------------------------------------------------------


def test_top_logprobs_are_the_k_largest_of_the_forward(engine, client):
    k = 5
    prompt = engine.encode("The weather today")
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=k).choices[0]
    _, reference = _greedy_forward(engine.model, prompt, 4)
    values, _ = torch.topk(reference, k, dim=-1)
    assert len(got.logprobs.top_logprobs) == 4
    for step, top in enumerate(got.logprobs.top_logprobs):
        assert list(top.values()) == pytest.approx(values[step].tolist(), abs=1e-4)  # in order
        # greedy: the chosen token is the most likely one, with the same log-prob
        assert got.logprobs.token_logprobs[step] == pytest.approx(values[step, 0].item(), abs=1e-4)
        assert next(iter(top)) == got.logprobs.tokens[step]

    chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    tokens = chat.choices[0].logprobs.content
    _, reference = _greedy_forward(engine.model, engine.render_chat(ASK), len(tokens))
    values, indices = torch.topk(reference, 3, dim=-1)
    for step, token in enumerate(tokens):
        assert [a.token for a in token.top_logprobs] == [engine.tokenizer.decode([int(i)]) for i in indices[step]]
        assert [a.logprob for a in token.top_logprobs] == pytest.approx(values[step].tolist(), abs=1e-4)
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-6)

    streamed = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    alternatives = [[a.logprob for a in t.top_logprobs]
                    for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert alternatives == [[a.logprob for a in t.top_logprobs] for t in tokens]


# -- structured output ----------------------------------------------------------------------------------


def test_json_schema_rows_validate_and_free_rows_are_unaffected(served, client):
    import jsonschema

    _, server = served
    response_format = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}
    free_prompts = ["Once upon", "The cat", "Data"]

    def constrained(i):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Review {i}"}], max_tokens=160,
            temperature=1.0, seed=i, response_format=response_format).choices[0]

    def free(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    alone = [free(p) for p in free_prompts]
    with ThreadPoolExecutor(23) as pool:
        with server.scheduler.paused():  # all 23 wait, then decode in one batch
            structured = [pool.submit(constrained, i) for i in range(20)]
            mixed = [pool.submit(free, p) for p in free_prompts]
            deadline = __import__("time").monotonic() + 120
            while server.scheduler.queue_depth < 23:
                assert __import__("time").monotonic() < deadline
        replies = [f.result() for f in structured]
        together = [f.result() for f in mixed]
    assert together == alone  # rows without a grammar in the same batch: as alone
    labels = set()
    for reply in replies:
        assert reply.finish_reason == "stop", reply.message.content
        value = json.loads(reply.message.content)
        jsonschema.validate(value, SCHEMA)
        labels.add(value["label"])
    assert len(labels) > 1  # sampled, not one fixed answer

    anything = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=160, temperature=0,
                                              response_format={"type": "json_object"}).choices[0]
    assert isinstance(json.loads(anything.message.content), dict)


@pytest.mark.parametrize(("change", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"store": True}, "store"),
    ({"min_tokens": 3}, "min_tokens"),
])
def test_unimplemented_or_invalid_fields_are_400_naming_them(served, change, param):
    url, _ = served
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **change}
    response = httpx.post(f"{url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_fields_are_refused_on_every_endpoint(served):
    url, _ = served
    for endpoint, body in (("completions", {"prompt": "Hi", "max_tokens": 1}),
                           ("score", {"context": "Hi", "continuation": " there"})):
        response = httpx.post(f"{url}/{endpoint}", json={**body, "mirostat": 2}, timeout=120)
        assert response.status_code == 400 and response.json()["error"]["param"] == "mirostat"


def test_ignore_eos_generates_past_the_stop_tokens(engine, client, monkeypatch):
    first = engine.encode(client.completions.create(model="tiny", prompt="Stop", max_tokens=1,
                                                    temperature=0).choices[0].text)[0]
    monkeypatch.setattr(engine, "default_stop_ids", (first,))  # greedy's first token now ends the turn
    stopped = client.completions.create(model="tiny", prompt="Stop", max_tokens=5, temperature=0).choices[0]
    kept = client.completions.create(model="tiny", prompt="Stop", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert stopped.finish_reason == "stop" and stopped.text == ""
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 5


# -- tool calls --------------------------------------------------------------------------------------


def _assistant_text(engine, calls: list[dict], content: str = "") -> str:
    """What the demo template writes for an assistant turn with these calls (the text a trained
    model generates after the generation prompt)."""
    messages = [*ASK, {"role": "assistant", "content": content, "tool_calls": calls}]
    whole = engine.tokenizer.apply_chat_template(messages, tools=[WEATHER, CLOCK], tokenize=False)
    start = whole.rindex("<start_of_turn>model\n") + len("<start_of_turn>model\n")
    return whole[start: whole.rindex("<end_of_turn>")]


def _call(name: str, arguments: dict) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_call_parser_on_the_demo_templates_output(engine):
    from mimir_megatron.inference.tool_calls import ToolCallStream, parse_tool_calls

    one = _assistant_text(engine, [_call("weather", {"city": "Oslo"})])
    content, calls = parse_tool_calls(one)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]

    two = _assistant_text(engine, [_call("weather", {"city": "Lund"}), _call("clock", {"zone": "CET"})],
                          content="Let me look.")
    content, calls = parse_tool_calls(two)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Lund"}),
                                                                  ("clock", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2

    malformed = two.replace('{"zone": "CET"}', '{"zone": CET}')
    content, calls = parse_tool_calls(malformed)  # the broken call stays in the content
    assert [c.name for c in calls] == ["weather"] and '<tool_call>{"name": "clock"' in content

    for text in (one, two, malformed, "no call at all <tool"):
        stream = ToolCallStream()
        released = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
        rest, calls = stream.finish()
        whole_content, whole_calls = parse_tool_calls(text)
        assert (released + rest).strip() == (whole_content or "")
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_tool_choice_required_and_named_give_well_formed_calls(engine, client):
    for kw in ({"tool_choice": "required", "parallel_tool_calls": False},
               {"tool_choice": {"type": "function", "function": {"name": "clock"}}}):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=100,
                                               temperature=0, **kw).choices[0]
        assert reply.finish_reason == "tool_calls", reply.message
        (call,) = reply.message.tool_calls
        tool = {"weather": WEATHER, "clock": CLOCK}[call.function.name]
        __import__("jsonschema").validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if "function" in kw["tool_choice"]:
            assert call.function.name == "clock"

        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK],
                                                     max_tokens=100, temperature=0, stream=True, **kw))
        deltas = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (0, call.function.name, call.function.arguments)]
        assert deltas[0].id and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == (reply.message.content or "")


def test_tool_choice_none_offers_no_tools_and_a_template_without_tools_refuses_them(engine, served, client,
                                                                                      monkeypatch):
    url, _ = served
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens

    template = engine.tokenizer.chat_template
    monkeypatch.setattr(engine.tokenizer, "chat_template", template.replace("tools", "extras"))
    response = httpx.post(f"{url}/chat/completions", json={"model": "tiny", "messages": ASK, "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_score_passes_bidirectional_tokens_per_item_to_the_engine(engine, served, monkeypatch):
    """The server's part: the per-item field reaches ``engine.score`` (only when one is set, so an
    engine without partial-prefix scoring serves every other request); the engine scores it."""
    url, _ = served
    real, seen = engine.score, []

    def recording(pairs, h_cycles=None, l_cycles=None, **kw):
        seen.append(kw.get("bidirectional_tokens"))
        return real(pairs, h_cycles, l_cycles)

    monkeypatch.setattr(engine, "score", recording)
    pair = {"context": "A context of words", "continuation": " and more"}
    for items in ([pair, {**pair, "bidirectional_tokens": 2}, pair], [pair, pair]):
        assert httpx.post(f"{url}/score", json={"items": items}, timeout=120).status_code == 200
    single = httpx.post(f"{url}/score", json={**pair, "bidirectional_tokens": 0}, timeout=120)
    assert single.status_code == 200
    assert seen == [[None, 2, None], None, [0]]
