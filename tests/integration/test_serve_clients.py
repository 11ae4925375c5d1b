"""Real OpenAI clients and agent frameworks against `mimir serve`, as their users call them.

One server for the module (the tiny random model, the demo tokenizer); every client runs
against it: the openai SDK (chat, a forced tool call with a plain string parameter, ``parse``
with a Pydantic model, the Responses API), langchain-openai (``bind_tools``,
``with_structured_output`` with each method), litellm, the OpenAI Agents SDK running a tool
loop to its end, and a Pydantic AI agent with a tool and a structured output; then each
framework's agent with a tool and a typed output in one run (tools and a response format on the
same request). Random weights: only the grammar makes a call well-formed, which is the point.
The server asks for an API key, as on a shared node: every client sends it, and with a wrong or
missing key each gets its framework's authentication error and the engine generates nothing.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from inference_workloads import served_engine
from pydantic import BaseModel

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(600)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Current weather in a city",
                                            "parameters": CITY}}
WEATHER_CHAT = {"type": "function", "function": {"name": "weather", "parameters": CITY}}  # as Responses sends it
ASK = [{"role": "user", "content": "Do I need an umbrella in Aarhus?"}]
MAX = 90  # above the shortest forced call (~60 tokens of the demo tokenizer), small enough to be quick
KEY = "sk-mimir-test-4f1c2a9e7b3d5f60"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Forecast(BaseModel):
    city: str
    rain_mm: float


@pytest.fixture(scope="module")
def app():
    from mimir_megatron.inference.api_keys import ApiKeys
    from mimir_megatron.inference.server import build_app

    # Agent frameworks send long tool schemas (Pydantic AI: ~600 tokens of the demo tokenizer)
    return build_app(served_engine("max_position_embeddings=2048"), api_keys=ApiKeys([KEY, "sk-other-key-0000000000"]),
                     max_queue=32, max_tokens_limit=128, max_stored_responses=4)


@pytest.fixture(scope="module")
def served(app):
    from mimir_megatron.inference.server import app_server, serve_app_in_thread

    with serve_app_in_thread(app) as url:
        yield url, app_server(app)


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[0], api_key=KEY, max_retries=0, timeout=300)


# -- the openai SDK ----------------------------------------------------------------------------------------


def test_openai_chat_forced_call_with_a_plain_string_and_parse(client):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    assert plain.choices[0].message.content and plain.usage.completion_tokens == 4

    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                               max_tokens=MAX, temperature=1.0, seed=seed).choices[0]
        assert reply.finish_reason == "tool_calls", reply.message
        assert isinstance(json.loads(reply.message.tool_calls[0].function.arguments)["city"], str)

    parsed = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Forecast, max_tokens=MAX,
                                           temperature=1.0, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Forecast)


def test_openai_responses_text_messages_tools_and_streaming(client, served, monkeypatch):
    from openai import BadRequestError

    _, server = served
    engine, rendered = server.engine, []
    render = engine.render_chat

    def recording(messages, tools=None, template_kwargs=None):
        rendered.append(render(messages, tools, template_kwargs))
        return rendered[-1]

    monkeypatch.setattr(engine, "render_chat", recording)
    first = client.responses.create(model="tiny", input="Hello", instructions="Answer briefly.",
                                    max_output_tokens=4, temperature=None)
    assert first.output_text and first.status == "incomplete" and first.usage.output_tokens == 4
    assert first.incomplete_details.reason == "max_output_tokens"
    follow = client.responses.create(model="tiny", input=[{"role": "user", "content": "And then?"}],
                                     previous_response_id=first.id, max_output_tokens=4)
    # exactly the earlier turn (without its instructions), its reply, then the new turn
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert rendered[-1] == render(history) and follow.usage.input_tokens == len(rendered[-1])

    tool = {"type": "function", "name": "weather", "parameters": CITY}
    called = client.responses.create(model="tiny", input=ASK, tools=[tool], tool_choice="required",
                                     max_output_tokens=MAX, temperature=1.0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert isinstance(json.loads(call.arguments)["city"], str) and call.call_id
    answered = client.responses.create(
        model="tiny", previous_response_id=called.id, tools=[tool], max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"rain_mm": 4}'}])
    assert answered.output[0].type == "message"
    # exactly: the question, the model's call as an assistant turn, the tool's output
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{
        "id": call.call_id, "type": "function", "function": {"name": "weather", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": '{"rain_mm": 4}'}]
    assert rendered[-1] == render(history, [WEATHER_CHAT]) and answered.usage.input_tokens == len(rendered[-1])

    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text

    schema = {"type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema(), "strict": True}
    structured = client.responses.create(model="tiny", input="Forecast?", text={"format": schema},
                                         max_output_tokens=MAX, temperature=1.0)
    Forecast.model_validate_json(structured.output_text)

    for _ in range(4):  # the store keeps the newest 4: the first response is gone
        client.responses.create(model="tiny", input="x", max_output_tokens=1)
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model="tiny", input="y", previous_response_id=first.id, max_output_tokens=1)
    assert caught.value.body["param"] == "previous_response_id" and len(server.stored_responses) == 4


def test_openai_responses_logprobs_are_served_as_in_chat_or_refused_by_name(client):
    """``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` give the output text's
    log-probs, the same as chat's for the same conversation (never an empty list); an ``include``
    this server cannot serve is a 400 naming it."""
    from openai import BadRequestError

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    expected = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                for t in chat.choices[0].logprobs.content]
    kw = dict(model="tiny", input="Hello", max_output_tokens=4, temperature=0)
    whole = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=3)
    got = whole.output[0].content[0].logprobs
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in got] == expected
    only_top = client.responses.create(**kw, top_logprobs=3).output[0].content[0].logprobs
    assert [t.logprob for t in only_top] == [e[1] for e in expected]
    streamed = [e for e in client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=3,
                                                   stream=True)]
    deltas = [t for e in streamed if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in deltas] == [e[:2] for e in expected]
    assert [t.logprob for t in streamed[-1].response.output[0].content[0].logprobs] == [e[1] for e in expected]
    assert client.responses.create(**kw).output[0].content[0].logprobs == []  # not asked for

    with pytest.raises(BadRequestError) as caught:
        client.responses.create(**kw, include=["file_search_call.results"])
    assert caught.value.body["param"] == "include"


def test_openai_responses_retrieve_list_input_items_and_delete(client, served):
    """What an app built on stored responses calls: retrieve, the input items page by page, delete."""
    from openai import BadRequestError, NotFoundError

    url, _ = served
    turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
             {"role": "user", "content": [{"type": "input_text", "text": "Rain in Aarhus?"}]}]
    created = client.responses.create(model="tiny", input=turns, instructions="Be brief.", max_output_tokens=2)
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()

    newest_first = client.responses.input_items.list(created.id)
    assert [item.role for item in newest_first.data] == ["user", "assistant", "user"]
    assert newest_first.data[0].content[0].text == "Rain in Aarhus?" and not newest_first.has_more
    first_page = client.responses.input_items.list(created.id, order="asc", limit=2)
    assert [item.role for item in first_page.data] == ["user", "assistant"] and first_page.has_more
    assert first_page.data[1].content[0].text == "Hi" and first_page.data[1].content[0].type == "output_text"
    every = [item.id for item in client.responses.input_items.list(created.id, order="asc", limit=1)]
    assert every == [item.id for item in newest_first.data][::-1] and len(set(every)) == 3  # the SDK's paging

    with pytest.raises(BadRequestError) as caught:
        client.responses.retrieve(created.id, stream=True)
    assert caught.value.body["param"] == "stream"
    with pytest.raises(BadRequestError) as caught:
        client.responses.input_items.list(created.id, limit=101)
    assert caught.value.body["param"] == "limit"
    word = httpx.get(f"{url}/responses/{created.id}/input_items", params={"limit": "many"}, headers=AUTH,
                     timeout=60)
    assert word.status_code == 400 and word.json()["error"]["param"] == "limit"

    streamed = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=2, stream=True))[-1].response
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=False)
    assert client.responses.delete(created.id) is None
    for gone in (created.id, unstored.id):
        with pytest.raises(NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(NotFoundError):
            client.responses.delete(gone)
    with pytest.raises(BadRequestError):
        client.responses.create(model="tiny", input="y", previous_response_id=created.id, max_output_tokens=1)


def test_every_error_is_openais_error_object(served, client):
    from openai import BadRequestError, NotFoundError

    url, _ = served
    with pytest.raises(NotFoundError) as caught:  # OpenAI's and vLLM's answer to an unknown model
        client.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(BadRequestError) as caught:  # OpenAI's range: 0-2
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, temperature=3)
    assert caught.value.body["param"] == "temperature"
    root = url.removesuffix("/v1")
    for method, path, status in (("GET", "/v1/nothing", 404), ("POST", "/v2/chat", 404),
                                 ("GET", "/v1/chat/completions", 405), ("DELETE", "/v1/responses", 405)):
        response = httpx.request(method, root + path, headers=AUTH, timeout=60)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["message"] and "detail" not in response.json() and set(error) == {"message", "type", "param",
                                                                                        "code"}
    bad = httpx.post(url + "/responses", json={"model": "tiny", "input": "x", "max_output_tokens": 2,
                                               "text": {"format": {"type": "yaml"}}}, headers=AUTH, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format"


# -- OpenAI's published spec ------------------------------------------------------------------------------


def _sse(response: httpx.Response) -> list[dict]:
    """The JSON payloads of a server-sent event stream (without ``[DONE]``)."""
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_every_body_chunk_and_event_is_valid_under_openais_openapi_spec(served):
    """What every route answers — whole bodies, stream chunks, Responses events, stored responses,
    input items, models, errors — validated against the components of OpenAI's own OpenAPI spec
    (tests/data/openai_openapi_components.json, openai/openai-openapi as of its ``_source``); a
    stored response also with the openai SDK's own ``Response`` type."""
    from openai.types.responses import Response
    from openai_spec import errors

    url, _ = served
    checked: list[tuple[str, dict]] = []

    def post(path: str, body: dict, schema: str, stream_schema: str | None = None) -> list[dict]:
        response = httpx.post(f"{url}/{path}", json={"model": "tiny", **body}, headers=AUTH, timeout=300)
        assert response.status_code == 200, response.text
        found = _sse(response) if body.get("stream") else [response.json()]
        checked.extend((stream_schema or schema, item) for item in found)
        return found

    tool = {"type": "function", "function": WEATHER["function"]}
    post("completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2}, "CreateCompletionResponse")
    post("completions", {"prompt": "Hi", "max_tokens": 3, "stream": True, "logprobs": 1,
                         "stream_options": {"include_usage": True}}, "CreateCompletionResponse")
    chat = {"messages": ASK, "max_tokens": MAX, "temperature": 1.0, "seed": 1}
    for extra in ({"max_tokens": 3, "logprobs": True, "top_logprobs": 2}, {"tools": [tool], "tool_choice": "required"},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "forecast",
                                                                              "schema": Forecast.model_json_schema()}}}):
        post("chat/completions", {**chat, **extra}, "CreateChatCompletionResponse")
        post("chat/completions", {**chat, **extra, "stream": True, "stream_options": {"include_usage": True}},
             "CreateChatCompletionStreamResponse")
    text = {"input": ASK, "max_output_tokens": 3, "instructions": "Be brief.", "top_logprobs": 2}
    called = {"input": ASK, "max_output_tokens": MAX, "tools": [{"type": "function", **WEATHER["function"]}],
              "tool_choice": "required", "temperature": 1.0}
    def read_back(response: dict) -> None:  # as a client reads a stored response (the store keeps 4 here)
        body = httpx.get(f"{url}/responses/{response['id']}", headers=AUTH).json()
        assert body == response
        usage = Response.model_validate(body).usage  # the SDK's own type: every required field there
        assert usage.input_tokens_details.cache_write_tokens == 0 and usage.input_tokens > 0
        checked.append(("ResponseItemList", httpx.get(f"{url}/responses/{response['id']}/input_items",
                                                      headers=AUTH).json()))

    for body in (text, called):
        read_back(post("responses", body, "Response")[0])
        events = post("responses", {**body, "stream": True}, "Response", "ResponseStreamEvent")
        assert [e["response"]["usage"] for e in events[:2]] == [None, None]  # OpenAI's: null until done
        read_back(events[-1]["response"])
    call = events[-1]["response"]["output"][0]
    answered = {"previous_response_id": events[-1]["response"]["id"], "max_output_tokens": 2, "input": [{
        "type": "function_call_output", "call_id": call["call_id"], "output": "4 mm"}]}
    read_back(post("responses", answered, "Response")[0])
    checked.append(("ListModelsResponse", httpx.get(f"{url}/models", headers=AUTH).json()))
    checked.append(("Model", httpx.get(f"{url}/models/tiny", headers=AUTH).json()))
    for method, path, body in (("POST", "chat/completions", {"messages": ASK, "temperature": 3}),
                               ("GET", "responses/resp_unknown", None), ("POST", "nothing", {})):
        checked.append(("ErrorResponse", httpx.request(method, f"{url}/{path}", json=body, headers=AUTH,
                                                       timeout=60).json()))

    # Two quirks of the spec that OpenAI's own examples in it share: a streamed completion's chunks
    # have a null finish_reason (the spec reuses the whole body's schema), and a Response's usage is
    # null on response.created and response.in_progress (OpenAI's, asserted above; the schema
    # says an object).
    for name, body in checked:
        if name == "CreateCompletionResponse" and body["choices"]:
            body["choices"] = [{**c, "finish_reason": c["finish_reason"] or "length"} for c in body["choices"]]
        if body.get("type") in ("response.created", "response.in_progress") and body["response"]["usage"] is None:
            body["response"]["usage"] = events[-1]["response"]["usage"]
    problems = [e for name, body in checked for e in errors(name, body)[:1]]
    assert not problems, "\n".join(problems[:10])
    kinds = {item["type"] for name, item in checked if name == "ResponseStreamEvent"}
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_text.delta", "response.incomplete", "response.completed"} <= kinds


# -- langchain-openai, litellm -------------------------------------------------------------------------------


def test_langchain_bind_tools_and_structured_output_with_each_method(served):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=served[0], api_key=KEY, max_tokens=MAX, temperature=1.0, seed=3,
                     max_retries=0)
    message = llm.bind_tools([WEATHER], tool_choice="required").invoke("Umbrella in Aarhus?")
    assert message.tool_calls and isinstance(message.tool_calls[0]["args"]["city"], str)

    # function_calling sends no additionalProperties: the strict default keeps other keys out
    for method in ("function_calling", "json_schema"):
        forecast = llm.with_structured_output(Forecast, method=method).invoke("Forecast for Oslo?")
        assert isinstance(forecast, Forecast), method
    loose = {"title": "anything", "type": "object", "properties": {}}
    assert isinstance(llm.with_structured_output(loose, method="json_mode").invoke("JSON please"), dict)


def test_litellm_chat_and_forced_tool_call(served):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list
    litellm = pytest.importorskip("litellm")

    kw = dict(model="openai/tiny", api_base=served[0], api_key=KEY, max_tokens=MAX)
    text = litellm.completion(messages=ASK, **{**kw, "max_tokens": 4})
    assert text.choices[0].message.content and text.usage.completion_tokens == 4
    called = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=2,
                                **kw)
    assert called.choices[0].finish_reason == "tool_calls"
    assert isinstance(json.loads(called.choices[0].message.tool_calls[0].function.arguments)["city"], str)


# -- the OpenAI Agents SDK --------------------------------------------------------------------------------


def test_agents_sdk_runs_a_tool_loop_to_its_final_message(served):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "rain_mm": 4})

    model = agents.OpenAIResponsesModel(model="tiny", openai_client=AsyncOpenAI(base_url=served[0], api_key=KEY,
                                                                                max_retries=0))
    # Random weights never end a free reply by themselves: the end-of-turn token gets a bias (the
    # forced call's grammar forbids it until the call is complete, so the call is unchanged).
    end_of_turn = served[1].engine.default_stop_ids[0]
    settings = agents.ModelSettings(tool_choice="required", max_tokens=MAX, temperature=1.0,
                                    extra_body={"logit_bias": {str(end_of_turn): 12}})
    agent = agents.Agent(name="forecaster", instructions="Use the weather tool, then answer.", tools=[weather],
                         model=model, model_settings=settings)
    result = agents.Runner.run_sync(agent, "Do I need an umbrella in Aarhus?", max_turns=4)
    kinds = [item.type for item in result.new_items]
    assert calls and isinstance(calls[0], str)  # the tool ran with the model's argument
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str)  # the model's final message after the tool's output


# -- Pydantic AI --------------------------------------------------------------------------------------------


def _offer_weather_until_called(agent) -> list[str]:
    """Give a Pydantic AI ``agent`` a weather tool that is offered until it has run once (random
    weights would call it forever); returns the list of the cities it was called with."""
    calls: list[str] = []

    async def until_called(ctx, tool):  # Pydantic AI's prepare hook: None hides the tool this step
        return None if calls else tool

    @agent.tool_plain(prepare=until_called)
    def weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "rain_mm": 4})

    return calls


def test_pydantic_ai_agent_runs_a_tool_then_its_structured_output(served):
    """An agent whose output is a Pydantic model (its ``final_result`` tool, which Pydantic AI forces
    with ``tool_choice: required``) and one function tool, offered until it has run once (random
    weights would call it forever): the weather tool runs with the model's argument, then the forced
    output call ends the run with a validated Forecast. The same output through ``response_format``
    (``NativeOutput``)."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=served[0], api_key=KEY))
    # seed 2 calls the weather tool first (seeds 0 and 1 go straight to the output)
    settings = {"max_tokens": MAX + 30, "temperature": 1.0, "seed": 2}
    agent = Agent(model, output_type=Forecast, model_settings=settings)
    calls = _offer_weather_until_called(agent)

    result = agent.run_sync("Forecast for Aarhus?", usage_limits=UsageLimits(request_limit=3))
    assert isinstance(result.output, Forecast)
    called = [part.tool_name for message in result.all_messages() for part in message.parts
              if isinstance(part, ToolCallPart)]
    assert called == ["weather", "final_result"] and isinstance(calls[0], str)

    native = Agent(model, output_type=NativeOutput(Forecast), model_settings=settings)
    assert isinstance(native.run_sync("Forecast for Oslo?").output, Forecast)


def test_pydantic_ai_counts_the_same_usage_streamed_and_not(served):
    """Pydantic AI's Responses model adds up the usage of the events it reads: a usage on
    ``response.created`` / ``response.in_progress`` (OpenAI sends null there) counted the input
    twice more when streamed."""
    import asyncio

    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel("tiny", provider=OpenAIProvider(base_url=served[0], api_key=KEY))
    agent = Agent(model, model_settings={"max_tokens": 6, "temperature": 0})
    whole = agent.run_sync("Hello")

    async def streamed():
        async with agent.run_stream("Hello") as run:
            return await run.get_output(), run.usage

    output, usage = asyncio.run(streamed())
    assert output == whole.output and whole.usage.input_tokens > 0
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens) == (
        len(served[1].engine.render_chat([{"role": "user", "content": "Hello"}])), 6)


# -- a tool and a typed output in one run (tools and a response format together) ---------------------------


def _first_token(served, text: str) -> str:
    return str(served[1].engine.encode(text)[0])


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_runs_a_tool_then_its_typed_output(served, api):
    """``output_type`` and a tool on one agent: the Agents SDK sends the output's schema with the
    tools, ``tool_choice`` auto. The model may call the tool or answer typed; a bias on ``<`` (the
    first token of a call) pushes it to the call, and the tool is offered until it has run once
    (random weights would call it forever): then the typed answer ends the run."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "rain_mm": 4})

    client = AsyncOpenAI(base_url=served[0], api_key=KEY, max_retries=0)
    model = (agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client) if api == "chat"
             else agents.OpenAIResponsesModel(model="tiny", openai_client=client))
    settings = agents.ModelSettings(max_tokens=MAX, temperature=1.0,
                                    extra_body={"logit_bias": {_first_token(served, "<"): 100}})
    agent = agents.Agent(name="forecaster", instructions="Use the weather tool, then answer.", tools=[weather],
                         model=model, model_settings=settings, output_type=Forecast)
    result = agents.Runner.run_sync(agent, "Do I need an umbrella in Aarhus?", max_turns=4)
    kinds = [item.type for item in result.new_items]
    assert calls and isinstance(calls[0], str)  # the tool ran with the model's argument
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Forecast)


def test_pydantic_ai_native_output_and_a_tool_in_one_run(served):
    """``NativeOutput`` (the schema as ``response_format``) and a tool offered on the same request:
    the first turn calls the tool (pushed there by a bias on ``<``, the first token of a call),
    which is then hidden (random weights would call it forever); the next turn's answer validates."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=served[0], api_key=KEY))
    settings = {"max_tokens": MAX, "temperature": 1.0, "seed": 1, "logit_bias": {_first_token(served, "<"): 100}}
    agent = Agent(model, output_type=NativeOutput(Forecast), model_settings=settings)
    calls = _offer_weather_until_called(agent)

    result = agent.run_sync("Forecast for Aarhus?", usage_limits=UsageLimits(request_limit=3))
    assert calls and isinstance(calls[0], str) and isinstance(result.output, Forecast)


def test_langchain_bind_tools_and_with_structured_output_in_one_agent(served):
    """The loop a LangChain user writes: the tool-calling model (``bind_tools`` with the output's
    ``response_format``; the first call required), the tool's result as a ToolMessage, then
    ``with_structured_output(..., tools=[...])``, which may call again or answer typed (pushed
    to the answer by a bias on ``{``)."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    def weather(city: str) -> str:
        """Current weather in a city."""
        return json.dumps({"city": city, "rain_mm": 4})

    llm = ChatOpenAI(model="tiny", base_url=served[0], api_key=KEY, max_tokens=MAX, temperature=1.0, seed=3,
                     max_retries=0, logit_bias={int(_first_token(served, "{")): 100})
    messages = [HumanMessage("Do I need an umbrella in Aarhus?")]
    called = llm.bind_tools([weather], tool_choice="required", response_format=Forecast, strict=True).invoke(messages)
    (call,) = called.tool_calls[:1]
    assert call["name"] == "weather" and isinstance(call["args"]["city"], str)
    messages += [called, ToolMessage(weather(**call["args"]), tool_call_id=call["id"])]
    typed = llm.with_structured_output(Forecast, method="json_schema", tools=[weather], strict=True,
                                       include_raw=True).invoke(messages)
    assert not typed["raw"].tool_calls and isinstance(typed["parsed"], Forecast), typed


def test_the_serve_extra_brings_what_serving_a_chat_model_imports():
    """`pip install 'mimir-megatron[serve]'` must serve a chat model: the HTTP server, the grammar
    library and the chat templates' renderer (transformers), nothing from another extra."""
    import tomllib

    from conftest import REPO
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    serve = {Requirement(r).name for r in extras["serve"]}
    assert {"fastapi", "uvicorn", "llguidance", "transformers"} <= serve


# -- the API key --------------------------------------------------------------------------------------------

WRONG = "sk-mimir-test-wrong-00000000000"
BODIES = {  # a request each route would generate (or score) for, had it the key
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "stream": True},
    "/v1/chat/completions": {"model": "tiny", "messages": ASK, "max_tokens": 4, "stream": True},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 4, "stream": True},
    "/v1/score": {"model": "tiny", "context": "Hi", "continuation": " there"},
}


def _work_done(server) -> tuple:
    """The engine's and the scheduler's counters of work: unchanged while requests are refused."""
    stats = server.scheduler.stats
    return (server.engine.stats.prefill_tokens, server.engine.stats.decode_tokens, stats.sessions,
            stats.score_requests, stats.requests_finished, stats.requests_failed)


def _refused(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.url, response.status_code, response.text[:300])
    assert response.json()["error"]["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
    assert KEY not in response.text and WRONG not in response.text


def test_every_route_but_health_refuses_a_missing_or_wrong_key(app, served):
    url, server = served
    root = url.removesuffix("/v1")
    routes = sorted((method, route.path) for route in app.routes for method in (getattr(route, "methods", None) or ())
                    if method != "HEAD")
    assert {("POST", p) for p in BODIES} <= set(routes) and ("GET", "/v1/responses/{response_id}") in routes
    before = _work_done(server)
    for method, path in [*routes, ("GET", "/v1/nothing"), ("POST", "/v2/chat"), ("GET", "/health/")]:
        concrete = path.replace("{response_id}", "resp_0").replace("{model}", "tiny")
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}, {"Authorization": "Bearer"}, {"X-Api-Key": KEY}):
            response = httpx.request(method, root + concrete, headers=headers, json=BODIES.get(path), timeout=60)
            if path == "/health":
                assert response.status_code == 200
            else:
                _refused(response)
    assert _work_done(server) == before
    # the right key (any of the server's keys) opens every route; /health needs none
    assert httpx.get(url + "/models", headers=AUTH, timeout=60).status_code == 200
    assert httpx.get(url + "/models", headers={"Authorization": "bearer  sk-other-key-0000000000"},
                     timeout=60).status_code == 200
    assert httpx.post(url + "/score", json=BODIES["/v1/score"], headers=AUTH, timeout=60).status_code == 200
    assert _work_done(server) != before


def _without_authorization(asynchronous: bool = False):
    """An httpx client for a framework that drops the Authorization header its SDK adds: the request
    of a user who gave no key (the SDKs themselves refuse to start without one)."""
    def drop(request: httpx.Request) -> None:
        request.headers.pop("Authorization", None)

    async def drop_async(request: httpx.Request) -> None:
        drop(request)

    if asynchronous:
        return httpx.AsyncClient(event_hooks={"request": [drop_async]}, timeout=60)
    return httpx.Client(event_hooks={"request": [drop]}, timeout=60)


@pytest.mark.parametrize("missing", [False, True], ids=["wrong key", "no key"])
def test_each_framework_gets_its_authentication_error_and_nothing_is_generated(served, missing):
    import openai
    from openai import AsyncOpenAI, OpenAI

    agents = pytest.importorskip("agents")
    langchain_openai = pytest.importorskip("langchain_openai")
    url, server = served
    key = "sk-not-sent-0000000000000" if missing else WRONG
    before = _work_done(server)
    sdk = OpenAI(base_url=url, api_key=key, max_retries=0, http_client=_without_authorization() if missing else None)
    attempts = [
        lambda: sdk.models.list(),
        lambda: sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=4),
        lambda: list(sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, stream=True)),
        lambda: list(sdk.completions.create(model="tiny", prompt="Hi", max_tokens=4, stream=True)),
        lambda: sdk.responses.create(model="tiny", input="Hi", max_output_tokens=4),
        lambda: list(sdk.responses.create(model="tiny", input="Hi", max_output_tokens=4, stream=True)),
    ]
    for attempt in attempts:
        with pytest.raises(openai.AuthenticationError) as caught:
            attempt()
        assert caught.value.code == "invalid_api_key"

    llm = langchain_openai.ChatOpenAI(model="tiny", base_url=url, api_key=key, max_tokens=4, max_retries=0,
                                      http_client=_without_authorization() if missing else None)
    with pytest.raises(openai.AuthenticationError):
        llm.invoke("Umbrella in Aarhus?")
    with pytest.raises(openai.AuthenticationError):
        list(llm.stream("Umbrella in Aarhus?"))

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url, api_key=key, max_retries=0,
                         http_client=_without_authorization(asynchronous=True) if missing else None)
    agent = agents.Agent(name="forecaster", instructions="Answer.",
                         model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
                         model_settings=agents.ModelSettings(max_tokens=4))
    with pytest.raises(openai.AuthenticationError):
        agents.Runner.run_sync(agent, "Do I need an umbrella in Aarhus?", max_turns=2)
    assert _work_done(server) == before
