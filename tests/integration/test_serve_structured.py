"""`mimir serve` beyond plain text: top log-probs, structured output, tool calls, refused fields.

One tiny random model (the demo tokenizer's vocabulary) and one server for the module. Random
weights: only a grammar makes the output well-formed, which is what these tests need to see.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch
from chat_stream import streamed_tool_calls
from inference_workloads import served_engine
from polling import wait_for

from mimir_megatron.batch import single_sample_batch

pytest.importorskip("llguidance")


def wait_queued(server, depth: int, futures=()) -> None:
    """Until ``depth`` requests wait in the paused scheduler's queue (sleeping between looks: a
    busy loop would hold the GIL the server's threads need); a request that ended instead (an
    error before it queued) raises at once."""
    wait_for(lambda: server.scheduler.queue_depth >= depth or any(f.done() for f in futures),
             f"{depth} queued requests")
    for f in futures:
        if f.done():
            f.result()
            raise AssertionError("a request finished while the scheduler was paused")
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
BROKEN = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "properties": {
    "x": {"type": "strin"}}}}}  # parameters that cannot be compiled


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
            wait_queued(server, 23, structured + mixed)
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


def test_concurrent_first_grammars_all_get_the_vocabulary(engine, served, client, monkeypatch):
    """The server's first grammars compile on several worker threads at once: every one must get
    the tokenizer's vocabulary (a thread that saw the tokenizer built but not yet its vocabulary
    answered 500, ``'NoneType' object has no attribute 'bytes'``). The vocabulary build is slowed
    down (as a 262,144-token one is) so that the requests overlap it."""
    import time

    from mimir_megatron.inference import grammar

    _, server = served
    built = grammar.Vocabulary.__init__

    def slow(self, *args, **kwargs):
        time.sleep(0.5)
        built(self, *args, **kwargs)

    monkeypatch.setattr(grammar.Vocabulary, "__init__", slow)
    monkeypatch.setattr(server.translate, "grammars",
                        grammar.Grammars(engine.tokenizer, engine.limits.vocab_size, engine.default_stop_ids))
    response_format = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}

    def first(i):
        return client.chat.completions.create(model="tiny", messages=ASK, max_tokens=160, temperature=1.0, seed=i,
                                              response_format=response_format).choices[0]

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(first, range(6)))
    for reply in replies:
        assert reply.finish_reason == "stop"
        __import__("jsonschema").validate(json.loads(reply.message.content), SCHEMA)


@pytest.mark.parametrize(("change", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [WEATHER, CLOCK, WEATHER]}, "tools[2]"),  # a call could not say which one it means
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strin"}}}}, "response_format"),  # the union's answer cannot be compiled
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ({"tools": [BROKEN], "response_format": {"type": "json_object"}}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, BROKEN]}, "tools[1].function.parameters"),  # whatever the tool_choice
    ({"tools": [BROKEN], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, BROKEN], "tool_choice": {"type": "function", "function": {"name": "weather"}}},
     "tools[1].function.parameters"),
    ({"tools": [BROKEN], "tool_choice": "none"}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 160}, "messages"),  # > the context
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
     "max_tokens"),  # neither branch of the union finishes within 2 tokens
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),  # changes the output: refused
    ({"modalities": ["audio"]}, "modalities"),
    ({"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
    ({"logit_bias": {"1024": 5}}, "logit_bias"),  # outside the vocabulary
    ({"logit_bias": {"five": 5}}, "logit_bias"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"temperature": "warm"}, "temperature"),
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
        for incremental in (False, True) if text != malformed else (False,):  # a grammar's calls: streamed
            stream, released, deltas = ToolCallStream(incremental), "", []
            for i in range(0, len(text), 3):
                content, more = stream.feed(text[i:i + 3])
                released, deltas = released + content, deltas + more
            rest, more = stream.finish()
            whole_content, whole_calls = parse_tool_calls(text)
            assert (released + rest).strip() == (whole_content or "")
            assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in whole_calls]
            arguments = ["".join(d.arguments for d in deltas + more if d.index == k) for k in range(len(whole_calls))]
            assert arguments == [c.arguments for c in whole_calls]
            if incremental and whole_calls:  # the arguments came as they were written, not at the end
                assert not more and sum(bool(d.arguments) for d in deltas) > len(whole_calls)


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
        (streamed,), (pieces,) = streamed_tool_calls(chunks)
        assert streamed[1:] == (call.function.name, call.function.arguments) and streamed[0]
        assert pieces > 1 and chunks[-1].choices[0].finish_reason == "tool_calls"  # as generated, not whole
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == (reply.message.content or "")


def _a_call_or_the_answer(choice, kind: str) -> None:
    """A chat choice is well-formed calls of the tools (``call``) or the schema's answer."""
    import jsonschema

    if kind == "call":
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            tool = {"weather": WEATHER, "clock": CLOCK}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    else:
        assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice.message
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_tools_and_a_response_format_together_give_a_call_or_the_typed_answer(engine, client):
    """OpenAI's rule: with tools offered and a response format, the model either calls a tool or
    answers in the schema. The model is pushed to either branch with a bias on its first token
    (``<`` starts a call, ``{`` the answer); a required or named call is a call now."""
    start_call, start_answer = engine.encode("<")[0], engine.encode("{")[0]
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=160, temperature=1.0, seed=1,
              response_format={"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}})
    calls = client.chat.completions.create(**kw, n=3, logit_bias={str(start_call): 100}).choices
    for choice in calls:
        _a_call_or_the_answer(choice, "call")
    assert max(len(c.message.tool_calls) for c in calls) > 1  # parallel calls by default
    for choice in client.chat.completions.create(**kw, n=3, logit_bias={str(start_answer): 100}).choices:
        _a_call_or_the_answer(choice, "answer")
    one = client.chat.completions.create(**kw, n=3, parallel_tool_calls=False,
                                         logit_bias={str(start_call): 100}).choices
    for choice in one:
        _a_call_or_the_answer(choice, "call")
        assert len(choice.message.tool_calls) == 1

    chunks = list(client.chat.completions.create(**kw, parallel_tool_calls=False, stream=True,
                                                 logit_bias={str(start_call): 100}))
    first = one[0].message.tool_calls[0]
    assert [c[1:] for c in streamed_tool_calls(chunks)[0]] == [(first.function.name, first.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # required (was a 400) or named, with a format: a call now; the format is for a later turn
    biased = {**kw, "logit_bias": {str(start_answer): 100}}
    _a_call_or_the_answer(client.chat.completions.create(**biased, tool_choice="required").choices[0], "call")
    named = client.chat.completions.create(**biased, tool_choice={"type": "function", "function": {"name": "clock"}})
    _a_call_or_the_answer(named.choices[0], "call")
    assert named.choices[0].message.tool_calls[0].function.name == "clock"


def test_responses_text_format_with_tools_gives_a_call_or_the_typed_answer(engine, client):
    import jsonschema

    start_call, start_answer = engine.encode("<")[0], engine.encode("{")[0]
    tool = {"type": "function", **WEATHER["function"]}
    kw = dict(model="tiny", input=ASK, tools=[tool], max_output_tokens=160, temperature=1.0,
              text={"format": {"type": "json_schema", "name": "review", "schema": SCHEMA}})
    called = client.responses.create(**kw, extra_body={"logit_bias": {str(start_call): 100}})
    assert called.output and all(item.type == "function_call" for item in called.output)
    jsonschema.validate(json.loads(called.output[0].arguments), WEATHER["function"]["parameters"])
    answered = client.responses.create(**kw, extra_body={"logit_bias": {str(start_answer): 100}})
    assert [item.type for item in answered.output] == ["message"]
    jsonschema.validate(json.loads(answered.output_text), SCHEMA)
    forced = client.responses.create(**kw, tool_choice="required", extra_body={"logit_bias": {str(start_answer): 100}})
    assert forced.output and {item.type for item in forced.output} == {"function_call"}
    for bias, kind in ((start_call, "function_call"), (start_answer, "message")):  # streamed: the same
        greedy = {**kw, "temperature": 0, "extra_body": {"logit_bias": {str(bias): 100}}}
        whole = client.responses.create(**greedy)
        events = list(client.responses.create(**greedy, stream=True))
        done = events[-1].response
        assert events[-1].type == "response.completed" and {item.type for item in done.output} == {kind}
        assert [item.model_dump(exclude={"id", "call_id"}) for item in done.output] == [
            item.model_dump(exclude={"id", "call_id"}) for item in whole.output]
        if kind == "function_call":  # each call's arguments streamed as they were generated
            finished = [e for e in events if e.type == "response.function_call_arguments.done"]
            for done_event, item in zip(finished, whole.output, strict=True):
                deltas = [e.delta for e in events
                          if e.type == "response.function_call_arguments.delta" and e.item_id == done_event.item_id]
                assert "".join(deltas) == done_event.arguments == item.arguments and len(deltas) > 1
                assert done_event.model_extra["name"] == item.name  # in OpenAI's spec, not yet in the SDK's type


def test_stop_strings_never_cut_a_grammars_reply(client):
    """A forced call with ``stop=["a"]`` came back as ``<tool_c``, finish ``stop``, no call; a
    schema's reply with ``stop=["e"]`` as ``{"answ``. Stop strings apply to free text only."""
    import jsonschema

    for kw in ({}, {"stream": True}):
        called = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                                max_tokens=100, temperature=0, stop=["a"], **kw)
        if kw:
            chunks = list(called)
            finish = chunks[-1].choices[0].finish_reason
            calls = [SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))
                     for _, name, arguments in streamed_tool_calls(chunks)[0]]
        else:
            finish, calls = called.choices[0].finish_reason, called.choices[0].message.tool_calls
        assert finish == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    replied = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, temperature=1.0, seed=1, stop=["e", "}"],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}).choices[0]
    assert replied.finish_reason == "stop"
    jsonschema.validate(json.loads(replied.message.content), answer)
    free = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0, stop=["e"])
    assert "e" not in free.choices[0].message.content  # free text is still cut


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


def test_parallel_tool_calls_false_is_one_call_in_the_grammar_itself(engine, served):
    """With ``parallel_tool_calls: false`` the request's grammar refuses a second call's first
    token after one whole call (the model cannot write one, whatever it samples); by default a
    second call is allowed. For a forced call and for tools with a response format (the union)."""
    from mimir_megatron.inference.server.protocol import ChatBody

    _, server = served
    one_call = engine.encode('<tool_call>{"name": "clock", "arguments": {"zone": "UTC"}}</tool_call>')
    second_call = engine.encode("<tool_call>")[0]
    stop = engine.default_stop_ids[0]
    answer = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}
    for kw in ({"tool_choice": "required"}, {"response_format": answer}):
        for parallel in (None, False):
            body = ChatBody.model_validate({"model": "tiny", "messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 160,
                                            "parallel_tool_calls": parallel, **kw})
            (request,) = server.translate.chat(body).requests
            row = request.constraint.start(160)
            assert all(row.accept(token) for token in one_call)
            allowed = torch.zeros(engine.limits.vocab_size, dtype=torch.bool)
            row.allowed(allowed)
            assert bool(allowed[stop]) and bool(allowed[second_call]) == (parallel is None), (kw, parallel)


WEATHER_STRING = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FINAL_RESULT = {"type": "function", "function": {"name": "final_result", "parameters": {  # Pydantic AI's output tool
    "type": "object", "required": ["city", "rain_mm", "summary"], "properties": {
        "city": {"type": "string"}, "rain_mm": {"type": "number"}, "summary": {"type": "string"}}}}}


def _smallest(url: str, tools: list[dict], messages=ASK, **kw) -> dict:
    """The 400 for a budget of one token (its ``allows: N`` is the grammar's shortest reply)."""
    response = httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "tools": tools, "tool_choice": "required", **kw})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return {**error, "needs": int(error["message"].rsplit("allows: ", 1)[1].split(" ")[0])}


def test_the_budget_of_several_tools_is_the_cheapest_call_and_exact_for_an_enum(engine, served, client):
    """``[get_weather, final_result]`` with ``tool_choice: required`` needs what the cheaper call needs
    (the longer was taken), and at that budget the call is the cheaper tool's; where the replies
    are few texts (an enum) the shortest is exact: the fewest tokens of any of them, computed here
    by hand from the tokenizer's own token texts (the greedy search found a longer one)."""
    import jsonschema
    from llguidance import LLMatcher

    from mimir_megatron.inference.grammar import _JsonLexState, completion

    url, server = served
    weather = _smallest(url, [WEATHER_STRING], max_tokens=1)
    final = _smallest(url, [FINAL_RESULT], max_tokens=1)
    both = _smallest(url, [WEATHER_STRING, FINAL_RESULT], max_tokens=1)
    assert weather["needs"] == both["needs"] < final["needs"]
    assert both["param"] == "max_tokens" and both["code"] == "integer_below_min_value" and "\n" not in both["message"]
    for seed in (1, 2):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[FINAL_RESULT, WEATHER_STRING],
                                               tool_choice="required", max_completion_tokens=both["needs"],
                                               temperature=1.0, seed=seed).choices[0]
        (call,) = reply.message.tool_calls
        assert reply.finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_STRING["function"]["parameters"])
    assert _smallest(url, [FINAL_RESULT, WEATHER_STRING], max_completion_tokens=both["needs"] - 1)[
        "param"] == "max_completion_tokens"

    # exact for an enum: every text of the call, each in its fewest tokens, then the end of the turn
    texts = [f'<tool_call>{{"name": "weather", "arguments": {{"city": "{city}"}}}}</tool_call>'
             for city in ("Oslo", "Aarhus", "Lund")]
    pieces = {}
    for token in range(engine.limits.vocab_size):
        if token not in engine.tokenizer.all_special_ids:
            pieces.setdefault(engine.tokenizer.decode([token]), token)

    def fewest(text: str) -> int:
        cost = [0] + [None] * len(text)
        for i in range(len(text)):
            for j in range(i + 1, len(text) + 1):
                if cost[i] is not None and text[i:j] in pieces and (cost[j] is None or cost[i] + 1 < cost[j]):
                    cost[j] = cost[i] + 1
        return cost[-1]

    exact = _smallest(url, [WEATHER], max_tokens=1)["needs"]
    assert exact == min(fewest(t) for t in texts) + 1
    forced = server.translate.grammars.tool_call(WEATHER)
    greedy = completion(LLMatcher(forced._tokenizer, forced.text), _JsonLexState(), forced._vocab, 512)
    assert exact < len(greedy)


def test_openais_refusals_name_the_field_with_its_code(engine, served):
    """What OpenAI refuses, refused the same way, each a one-line 400 naming the field: a prompt and
    a budget beyond the context (``context_length_exceeded``, on each route), a grammar's shortest
    reply beyond what the prompt leaves of the context when no budget was sent, a ``json_schema``
    without a name, a tool whose parameters cannot be compiled (whatever the tool_choice, naming
    it), a ``function_call_output`` for a call the conversation does not hold."""
    url, _ = served
    long = "word " * 180  # 360-480 tokens: less than the context (512), more with a budget of 160

    def refused(path: str, body: dict) -> dict:
        response = httpx.post(f"{url}/{path}", json={"model": "tiny", **body}, timeout=120)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "\n" not in error["message"] and error["type"] == "invalid_request_error", error
        return error

    for path, body, param in (
            ("chat/completions", {"messages": [{"role": "user", "content": long}], "max_tokens": 160}, "messages"),
            ("responses", {"input": long, "max_output_tokens": 160}, "input"),
            ("completions", {"prompt": long, "max_tokens": 160}, "prompt")):
        error = refused(path, body)
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
    # no budget sent: the context is what is short (the prompt leaves fewer tokens than a call needs)
    needs = _smallest(url, [WEATHER_STRING], max_tokens=1)["needs"]
    words = next(n for n in range(1, 256) if 0 < engine.max_context - len(engine.render_chat(
        [{"role": "user", "content": "word " * n}], [WEATHER_STRING])) < needs)
    error = _smallest(url, [WEATHER_STRING], messages=[{"role": "user", "content": "word " * words}])
    assert (error["param"], error["code"], error["needs"]) == ("messages", "context_length_exceeded", needs)
    error = refused("responses", {"input": "x", "tools": [{"type": "function", **WEATHER_STRING["function"]}],
                                  "tool_choice": "required", "max_output_tokens": needs - 1})
    assert (error["param"], error["code"]) == ("max_output_tokens", "integer_below_min_value")

    error = refused("chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "schema": SCHEMA}}})
    assert (error["param"], error["code"]) == ("response_format.json_schema.name", "missing_required_parameter")
    error = refused("responses", {"input": "x", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert error["param"] == "text.format.name"
    broken = {"type": "function", **BROKEN["function"]}
    for choice in ("auto", "none", "required"):
        error = refused("responses", {"input": "x", "tools": [{"type": "function", **WEATHER["function"]}, broken],
                                      "tool_choice": choice})
        assert error["param"] == "tools[1].parameters" and "'broken'" in error["message"], error
    error = refused("responses", {"input": [{"type": "function_call_output", "call_id": "call_none", "output": "4"}]})
    assert error["param"] == "input[0].call_id"


# -- a forced call or a schema always finishes within max_tokens ------------------------------------------

PARAMETERS = {  # what users send: plain types, not enums (no additionalProperties: strict by default)
    "string": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "number": {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["tags"]},
    "nested": {"type": "object", "required": ["where"], "properties": {"where": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}}}}},
}


def _tool(kind: str) -> dict:
    return {"type": "function", "function": {"name": f"get_{kind}", "parameters": PARAMETERS[kind]}}


def _strict(schema: dict) -> dict:
    from mimir_megatron.inference.grammar import strict_schema

    return strict_schema(schema)


def test_forced_calls_and_schemas_finish_within_max_tokens_as_valid_json(engine, served, client):
    """Random weights, sampled: without the budget a plain string runs on until max_tokens cuts
    it (the reply then has no tool call). Every reply here parses and validates, at the smallest
    budget the server accepts and at a few tokens more; one token less is a 400 naming the field."""
    import jsonschema

    _, server = served
    smallest = {}
    for kind in PARAMETERS:
        response = httpx.post(f"{served[0]}/chat/completions", timeout=120, json={
            "model": "tiny", "messages": ASK, "tools": [_tool(kind)], "tool_choice": "required", "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        smallest[kind] = int(response.json()["error"]["message"].rsplit("allows: ", 1)[1].split(" ")[0])
        below = httpx.post(f"{served[0]}/chat/completions", timeout=120, json={
            "model": "tiny", "messages": ASK, "tools": [_tool(kind)], "tool_choice": "required",
            "max_completion_tokens": smallest[kind] - 1})
        assert below.status_code == 400 and below.json()["error"]["param"] == "max_completion_tokens"

    def forced(kind, seed, extra):
        return kind, client.chat.completions.create(
            model="tiny", messages=ASK, tools=[_tool(kind)], tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=smallest[kind] + extra).choices[0]

    def schema_reply(kind, seed):
        format_ = {"type": "json_schema", "json_schema": {"name": kind, "schema": PARAMETERS[kind]}}
        return kind, client.chat.completions.create(
            model="tiny", messages=ASK, temperature=1.0, seed=seed, max_tokens=smallest[kind] - 30,
            response_format=format_).choices[0]

    jobs = [(forced, (kind, seed, extra)) for kind in PARAMETERS for seed, extra in ((1, 0), (2, 9), (3, 25))]
    jobs += [(schema_reply, (kind, seed)) for kind in PARAMETERS for seed in (4, 5)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        with server.scheduler.paused():  # one shared batch
            futures = [pool.submit(fn, *args) for fn, args in jobs]
            wait_queued(server, len(jobs), futures)
        replies = [f.result() for f in futures]
    for (fn, _), (kind, reply) in zip(jobs, replies):
        if fn is forced:
            assert reply.finish_reason == "tool_calls", reply.message
            (call,) = reply.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), _strict(PARAMETERS[kind]))
        else:
            assert reply.finish_reason == "stop", reply.message.content
            jsonschema.validate(json.loads(reply.message.content), _strict(PARAMETERS[kind]))
    lengths = {len(json.loads(r.message.tool_calls[0].function.arguments)["city"])
               for (fn, _), (kind, r) in zip(jobs, replies) if fn is forced and kind == "string"}
    assert len(lengths) > 1 and max(lengths) > 0  # the string ran as long as the budget let it


def test_strict_by_default_and_strict_false_as_written(engine):
    """No additionalProperties: strict (no other keys), as OpenAI compiles strict tools;
    ``strict: false`` compiles the schema as written (JSON Schema: other keys allowed)."""
    from mimir_megatron.inference.grammar import Grammars

    grammars = Grammars(engine.tokenizer, engine.limits.vocab_size, engine.default_stop_ids)
    text = '<tool_call>{"name": "get_string", "arguments": {"city": "Oslo", "extra": 1}}</tool_call>'

    def accepts(tool) -> bool:
        matcher = grammars.tool_calls([tool], False).start(100)._matcher
        return matcher.consume_tokens(engine.encode(text)) and matcher.is_stopped()

    assert not accepts(_tool("string"))
    loose = _tool("string")
    loose["function"]["strict"] = False
    assert accepts(loose)
    both = {**_tool("string")["function"]["parameters"], "additionalProperties": True}
    assert accepts({"type": "function", "function": {"name": "get_string", "parameters": both}})


def test_grammars_write_only_finite_numbers_and_bounded_integers(engine):
    """A JSON number's exponent is at most 308 and its value a finite double; an ``integer``
    without bounds stays within +-(2**53 - 1). Token by token, as a row takes them (a refused
    token leaves the row unchanged)."""
    from mimir_megatron.inference.grammar import Grammars

    grammars = Grammars(engine.tokenizer, engine.limits.vocab_size, engine.default_stop_ids)

    def writes(schema: dict, text: str) -> bool:
        row = grammars.json(schema).start(1000)
        return all(row.accept(t) for t in engine.encode(text)) and row.done and not row._matcher.is_error()

    number = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    for value, finite in (("1.5", True), ("-1e308", True), ("1.7976931348623157e308", True), ("1e-308", True),
                          ("1e999", False), ("-2e308", False), ("1e-309", False), ("1" + "0" * 308, True),
                          ("1" + "0" * 309, False)):
        assert writes(number, f'{{"x": {value}}}') == finite, value
    integer = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for value, kept in ((2**53 - 1, True), (-(2**53 - 1), True), (2**53, False), (-(2**53), False),
                        (10**30, False)):
        assert writes(integer, f'{{"x": {value}}}') == kept, value
    own = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 2**60}}}
    assert writes(own, f'{{"x": {2**60}}}')  # a schema's own bound is kept


def test_a_schemas_numbers_come_back_finite_when_the_model_pushes_exponents(engine, client):
    """The model pushed towards ``9`` and ``e`` (logit_bias): without the bound, a number runs to
    ``9e999...`` (``inf`` when parsed) and an integer past 64 bits."""
    import math

    bias = {next(i for i in range(engine.limits.vocab_size) if engine.tokenizer.decode([i]) == text): value
            for text, value in (("9", 50), ("e", 100))}  # "e" wherever the grammar allows it, else "9"
    schema = {"type": "object", "required": ["x", "n"],
              "properties": {"x": {"type": "number"}, "n": {"type": "array", "items": {"type": "integer"}}}}
    for temperature in (0, 1.0):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=150, temperature=temperature, seed=3,
            logit_bias={str(i): value for i, value in bias.items()},
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).choices[0]
        value = json.loads(reply.message.content)
        assert math.isfinite(value["x"]) and "e" in reply.message.content.lower(), reply.message.content
        assert all(abs(n) <= 2**53 - 1 for n in value["n"]), reply.message.content


# -- sampling fields, null values, platform fields ----------------------------------------------------------


def _penalized_greedy(model, prompt: list[int], steps: int, params) -> list[int]:
    """Greedy tokens from the PrefixLM forward, each step's logits processed by hand (vLLM's
    formulas, written out here independently of sampling.py)."""
    generated: list[int] = []
    for _ in range(steps):
        batch = single_sample_batch([prompt], [[*generated, 0]])
        with torch.no_grad():
            logits = model(batch).logits[0, len(prompt) - 1 + len(generated)].float()
        for token, bias in params["logit_bias"].items():
            logits[int(token)] += bias
        for token in set(prompt) | set(generated):
            value = logits[token]
            logits[token] = value / params["repetition_penalty"] if value > 0 else value * params["repetition_penalty"]
        for token in set(generated):
            logits[token] -= params["frequency_penalty"] * generated.count(token) + params["presence_penalty"]
        generated.append(int(logits.argmax()))
    return generated


def test_penalties_apply_per_row_and_other_rows_decode_exactly_as_alone(engine, served, client):
    _, server = served
    prompt = engine.encode("The cat sat on")
    fields = {"frequency_penalty": 0.9, "presence_penalty": 0.6, "repetition_penalty": 1.7,
              "logit_bias": {str(engine.encode(" the")[0]): 4.0}}

    def complete(text_or_ids, **kw):
        choice = client.completions.create(model="tiny", prompt=text_or_ids, max_tokens=8, temperature=0,
                                           logprobs=1, **kw).choices[0]
        return choice.logprobs.tokens, choice.logprobs.token_logprobs

    plain_prompts = ["Once upon", "Data", "Hello there"]
    alone = [complete(p) for p in plain_prompts]

    def batch(**busy_fields):
        with ThreadPoolExecutor(4) as pool:
            with server.scheduler.paused():  # one shared batch of four rows, in this order
                busy = pool.submit(complete, prompt, **busy_fields)
                wait_queued(server, 1, [busy])  # requests are translated in worker threads: one by one
                plain = []
                for depth, p in enumerate(plain_prompts, start=2):
                    plain.append(pool.submit(complete, p))
                    wait_queued(server, depth, [busy, *plain])
            return busy.result(), [f.result() for f in plain]

    (tokens, _), together = batch(frequency_penalty=fields["frequency_penalty"],
                                  presence_penalty=fields["presence_penalty"], logit_bias=fields["logit_bias"],
                                  extra_body={"repetition_penalty": fields["repetition_penalty"]})
    _, without = batch()
    assert together == without  # bit for bit: the penalised row changes nothing in the others
    for (t_tokens, t_lp), (a_tokens, a_lp) in zip(together, alone):  # and they decode as alone
        assert t_tokens == a_tokens and t_lp == pytest.approx(a_lp, abs=1e-4)
    expected = _penalized_greedy(engine.model, prompt, 8, {**fields, "logit_bias": {
        int(k): v for k, v in fields["logit_bias"].items()}})
    assert [engine.tokenizer.decode([t]) for t in expected] == tokens
    assert expected != _greedy_forward(engine.model, prompt, 8)[0]  # the fields changed the reply


def test_min_tokens_holds_the_stop_tokens_back(engine, client, monkeypatch):
    first = engine.encode(client.completions.create(model="tiny", prompt="Stop", max_tokens=1,
                                                    temperature=0).choices[0].text)[0]
    monkeypatch.setattr(engine, "default_stop_ids", (first,))
    held = client.completions.create(model="tiny", prompt="Stop", max_tokens=6, temperature=0,
                                     extra_body={"min_tokens": 3}).choices[0]
    assert held.finish_reason in ("stop", "length") and len(engine.encode(held.text)) >= 3


def test_null_means_the_default_and_platform_fields_are_accepted_and_logged_once(served, caplog):
    url, _ = served
    base = {"model": "tiny", "messages": ASK, "max_tokens": 4, "temperature": 0}
    nulls = {name: None for name in ("top_p", "n", "logprobs", "top_logprobs", "stop", "seed", "stream",
                                     "frequency_penalty", "presence_penalty", "logit_bias", "response_format",
                                     "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                                     "stream_options", "user", "min_p", "top_k", "min_tokens",
                                     "repetition_penalty", "skip_special_tokens", "chat_template_kwargs")}
    plain = httpx.post(f"{url}/chat/completions", json=base, timeout=120).json()
    nulled = httpx.post(f"{url}/chat/completions", json={**base, **nulls}, timeout=120)
    assert nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    assert httpx.post(f"{url}/chat/completions", json={**base, "temperature": None}, timeout=120).status_code == 200

    platform = {"store": True, "metadata": {"run": "a"}, "service_tier": "auto", "prompt_cache_key": "k",
                "safety_identifier": "u1", "verbosity": "low", "user": "u1"}
    with caplog.at_level("WARNING", logger="mimir_megatron.inference.server.translation"):
        for _ in range(2):
            response = httpx.post(f"{url}/chat/completions", json={**base, **platform}, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    logged = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    for name in platform:
        assert sum(f"'{name}'" in m for m in logged) <= 1  # at most once per field and process


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(engine, client, monkeypatch):
    template = engine.tokenizer.chat_template
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        "{{ 'effort ' ~ reasoning_effort if reasoning_effort is defined }}"
                        "{{ 'depth ' ~ depth if depth is defined }}" + template)
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    both = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, reasoning_effort="high",
                                          extra_body={"chat_template_kwargs": {"depth": 3}})
    expected = engine.render_chat(ASK, None, {"depth": 3, "reasoning_effort": "high"})
    assert both.usage.prompt_tokens == len(expected) > plain.usage.prompt_tokens


def test_skip_special_tokens_false_keeps_them_in_the_text(engine, client):
    special = engine.tokenizer.convert_tokens_to_ids("<start_of_turn>")
    kw = dict(model="tiny", prompt="Hi", max_tokens=2, temperature=0, logit_bias={str(special): 100})
    skipped = client.completions.create(**kw).choices[0].text
    kept = client.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0].text
    assert "<start_of_turn>" not in skipped and kept.count("<start_of_turn>") == 2


def test_logprobs_mode_processed_reports_the_masked_distribution(engine, client, monkeypatch):
    """EuroEval reads a label from top_logprobs: raw ones come from before the grammar's mask,
    processed ones only hold tokens the schema allows (the label's first tokens)."""
    format_ = {"type": "json_schema", "json_schema": {"name": "l", "schema": SCHEMA}}
    kw = dict(model="tiny", messages=ASK, max_tokens=160, temperature=0, logprobs=True, top_logprobs=5,
              response_format=format_)
    raw = client.chat.completions.create(**kw).choices[0]
    monkeypatch.setattr(engine, "logprobs_mode", "processed")
    processed = client.chat.completions.create(**kw).choices[0]
    assert processed.message.content == raw.message.content
    first = processed.logprobs.content[0]  # '{' is forced: probability 1 after the mask
    assert first.logprob == pytest.approx(0.0, abs=1e-6) and raw.logprobs.content[0].logprob < -0.01
    label_step = next(i for i, t in enumerate(processed.logprobs.content) if t.token in ("p", "n", "po", "ne"))
    alternatives = [a.token for a in processed.logprobs.content[label_step].top_logprobs if a.logprob > -9999]
    assert all(any(label.startswith(a) or a.startswith(label[:1]) for label in ("positiv", "neutral", "negativ"))
               for a in alternatives)
