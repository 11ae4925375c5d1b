"""`mimir serve` through the official `openai` client: batching, streaming, errors, scoring.

One tiny random model (the demo tokenizer's 1024-token vocabulary) and one server per module.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from inference_workloads import served_engine
from polling import wait_for

from mimir_megatron.batch import single_sample_batch

pytestmark = pytest.mark.timeout(900)  # a deadlocked server fails the module instead of hanging

MAX_QUEUE = 16
MAX_TOKENS_LIMIT = 64
PROMPTS = [f"{word} number {i}" for i, word in enumerate(["Hello", "The cat", "Once", "A", "Data", "Why"] * 3)][:16]


@pytest.fixture(scope="module")
def engine():
    return served_engine()


@pytest.fixture(scope="module")
def served(engine):
    """(base URL, the app's Server object) of one server for the module."""
    from mimir_megatron.inference.server import app_server, build_app, serve_app_in_thread

    app = build_app(engine, max_queue=MAX_QUEUE, max_tokens_limit=MAX_TOKENS_LIMIT, max_batch_size=16)
    with serve_app_in_thread(app) as url:
        yield url, app_server(app)


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[0], api_key="x", max_retries=0, timeout=300)


def _complete(client, prompt, **kw):
    kw = {"model": "tiny", "max_tokens": 3, "temperature": 0.0, "logprobs": 1, **kw}
    choice = client.completions.create(prompt=prompt, **kw).choices[0]
    return choice.text, choice.finish_reason, choice.logprobs.tokens, choice.logprobs.token_logprobs


def _sampling(i: int) -> dict:
    # Half greedy, half seeded sampling: a seeded request samples the same whatever its batch.
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.9, "seed": 100 + i}


def _wait_for(predicate, timeout: float = 120.0) -> None:
    wait_for(predicate, "the server", timeout=timeout, interval=0.01)


def test_models_and_health(served, client):
    url, _ = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").max_model_len == 512
    assert httpx.get(url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def test_concurrent_requests_batch_and_match_sequential(served, client):
    """16 requests waiting when a step starts decode together (one batch, 3 steps) and return
    what 16 sequential requests return; a 17th is refused with 503 while the queue is full."""
    url, server = served
    scheduler = server.scheduler
    sequential = [_complete(client, p, **_sampling(i)) for i, p in enumerate(PROMPTS)]

    before = scheduler.stats.as_dict()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        with scheduler.paused():
            futures = [pool.submit(_complete, client, p, **_sampling(i)) for i, p in enumerate(PROMPTS)]
            _wait_for(lambda: scheduler.queue_depth == len(PROMPTS))
            full = httpx.post(url + "/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        concurrent = [f.result() for f in futures]
    after = scheduler.stats.as_dict()

    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    for (s_text, s_reason, s_tokens, s_lp), (c_text, c_reason, c_tokens, c_lp) in zip(sequential, concurrent):
        assert (c_text, c_reason, c_tokens) == (s_text, s_reason, s_tokens)
        assert c_lp == pytest.approx(s_lp, abs=1e-4)
    assert after["max_rows_per_step"] == len(PROMPTS)
    assert after["steps"] - before["steps"] <= 3  # one step per token for the whole batch
    assert after["requests_finished"] - before["requests_finished"] == len(PROMPTS)


def test_requests_arriving_during_decoding_join_the_running_batch(served, client, monkeypatch):
    """A request queued while another decodes joins its session: the scheduler is held after the
    first request's first step until the second is queued (events, not timing)."""
    _, server = served
    scheduler = server.scheduler
    before = scheduler.stats.as_dict()
    first_stepped, second_queued = threading.Event(), threading.Event()
    step = scheduler._step

    def step_then_hold() -> None:
        step()
        if not first_stepped.is_set():
            first_stepped.set()
            assert second_queued.wait(120), "the second request was never queued"

    monkeypatch.setattr(scheduler, "_step", step_then_hold)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.completions.create, model="tiny", prompt="Long", max_tokens=12, temperature=0)
        assert first_stepped.wait(120), "the first request never started decoding"
        second = pool.submit(_complete, client, "Short", max_tokens=2)
        _wait_for(lambda: scheduler.queue_depth == 1)
        second_queued.set()
        assert first.result().choices[0].finish_reason == "length"
        second.result()
    after = scheduler.stats.as_dict()
    assert after["sessions"] - before["sessions"] == 1
    assert after["steps"] - before["steps"] < 12 + 2


def test_other_schedules_wait_first_come_first_served(served, client):
    """A (trained schedule), B (another), C (trained) waiting together: C must not overtake B, so
    three batches run one after another, each giving what it gives alone."""
    _, server = served
    scheduler = server.scheduler
    kinds = [("A", {}), ("B", {"extra_body": {"h_cycles": 1, "l_cycles": 1}}), ("C", {})]
    alone = [_complete(client, prompt, **kw) for prompt, kw in kinds]
    before = scheduler.stats.as_dict()
    with ThreadPoolExecutor(3) as pool, scheduler.paused():
        futures = []
        for prompt, kw in kinds:  # in this order
            futures.append(pool.submit(_complete, client, prompt, **kw))
            _wait_for(lambda n=len(futures): scheduler.queue_depth == n)
    together = [f.result() for f in futures]
    assert scheduler.stats.sessions - before["sessions"] == 3
    for a, t in zip(alone, together):
        assert t[:3] == a[:3] and t[3] == pytest.approx(a[3], abs=1e-4)


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(engine, client, monkeypatch):
    import openai

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    forward = engine.forward

    def broken_decoding(cache, tokens, prompts, plan):
        if tokens:
            raise RuntimeError("injected failure")
        return forward(cache, tokens, prompts, plan)

    monkeypatch.setattr(engine, "forward", broken_decoding)  # the prefill works, the next step fails
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    with pytest.raises(openai.APIError, match="injected failure"):
        list(client.completions.create(model="tiny", prompt="Hi", max_tokens=3, stream=True))
    monkeypatch.setattr(engine, "hidden_states", broken)  # the forward pass of scoring
    with pytest.raises(openai.InternalServerError):
        client.post("/score", body={"context": "a", "continuation": "b"}, cast_to=object)
    monkeypatch.undo()
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=3).usage.completion_tokens == 3
    assert client.post("/score", body={"context": "a", "continuation": "b"}, cast_to=object)["results"]


def test_a_client_that_leaves_frees_its_row(served, client):
    """A stream closed after its first chunk leaves the batch at the next step; the request that
    shares the batch decodes as it would alone."""
    _, server = served
    stats = server.scheduler.stats
    alone = _complete(client, "Staying", max_tokens=20)
    before = stats.as_dict()
    with ThreadPoolExecutor(1) as pool:
        with server.scheduler.paused():
            stream = client.completions.create(model="tiny", prompt="Leaving", max_tokens=MAX_TOKENS_LIMIT,
                                               temperature=0, logprobs=1, stream=True)
            staying = pool.submit(_complete, client, "Staying", max_tokens=20)
            _wait_for(lambda: server.scheduler.queue_depth == 2)
        next(iter(stream))
        stream.close()
        together = staying.result()
    _wait_for(lambda: stats.requests_cancelled > before["requests_cancelled"])
    _wait_for(lambda: not server.scheduler.busy)
    assert stats.steps - before["steps"] < MAX_TOKENS_LIMIT
    assert together[:3] == alone[:3] and together[3] == pytest.approx(alone[3], abs=1e-4)


def test_a_client_that_times_out_cancels_each_attempt_and_its_retries(served, monkeypatch):
    """The openai SDK's timeout with its two default retries, on a request that is still decoding:
    each abandoned attempt (a whole reply, not a stream) leaves its batch within a step of its
    client going, so the retries cost a step each, not a whole reply each. Each attempt's batch is
    held after its step until its client has gone (events, not timing: a loaded machine cannot
    finish a reply within the timeout, a quiet one cannot either)."""
    from openai import APITimeoutError, OpenAI

    url, server = served
    scheduler, stats = server.scheduler, server.scheduler.stats
    step, held = scheduler._step, set()

    def step_then_wait_for_the_client() -> None:
        step()
        waiting = [w for w in scheduler._session_work.values() if id(w) not in held]
        held.update(id(w) for w in waiting)
        if waiting:  # once per attempt: a server that never notices decodes the reply to its end
            try:
                wait_for(lambda: all(w.cancelled for w in waiting), "the client to go", timeout=20)
            except AssertionError:
                pass

    monkeypatch.setattr(scheduler, "_step", step_then_wait_for_the_client)
    before, decoded = stats.as_dict(), server.engine.stats.decode_tokens
    impatient = OpenAI(base_url=url, api_key="x", timeout=1.0, max_retries=2)
    with pytest.raises(APITimeoutError):
        impatient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell a long story"}],
                                          max_tokens=MAX_TOKENS_LIMIT, temperature=0)
    _wait_for(lambda: stats.requests_cancelled + stats.requests_finished - before["requests_cancelled"]
              - before["requests_finished"] >= 3 and not scheduler.busy)
    after = stats.as_dict()
    assert after["requests_cancelled"] - before["requests_cancelled"] == 3
    assert after["requests_finished"] == before["requests_finished"]  # no attempt decoded to its end
    assert after["steps"] - before["steps"] <= 3 and server.engine.stats.decode_tokens == decoded  # a step each
    monkeypatch.undo()
    assert httpx.get(f"{url}/stats").json()["scheduler"]["requests_cancelled"] == after["requests_cancelled"]


def test_stop_strings_cut_the_text(client):
    whole = client.completions.create(model="tiny", prompt="Stop here", max_tokens=8, temperature=0).choices[0]
    stop = next(whole.text[i:i + 2] for i in range(1, len(whole.text) - 1)
                if "\ufffd" not in whole.text[i:i + 2] and whole.text[i:i + 2].strip())
    cut = client.completions.create(model="tiny", prompt="Stop here", max_tokens=8, temperature=0,
                                    stop=[stop, "never appears"]).choices[0]
    assert cut.text == whole.text[: whole.text.find(stop)] and cut.finish_reason == "stop"


def test_streaming_gives_the_same_text(client):
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        whole = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, **kw)
        chunks = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_a_completion_streams_a_chunk_for_every_token(client):
    """A token whose text is held back (here: it could start a stop string) still streams, as an
    empty text, as vLLM's do: the client hears of every token when it is made."""
    whole = client.completions.create(model="tiny", prompt="Hold", max_tokens=6, temperature=0, logprobs=0)
    tokens = whole.choices[0].logprobs.tokens
    held = next(i for i, t in enumerate(tokens[:-1]) if i and t.strip() and "\ufffd" not in t)
    stop = tokens[held] + "\x00never"  # starts with that token's text, never completes
    chunks = list(client.completions.create(model="tiny", prompt="Hold", max_tokens=6, temperature=0,
                                            stop=[stop], stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert len(texts) == len(tokens) == whole.usage.completion_tokens
    assert texts[held] == "" and "".join(texts) == whole.choices[0].text


def test_n_choices_use_consecutive_seeds(client):
    both = client.completions.create(model="tiny", prompt="Seeds", max_tokens=4, temperature=1.0, seed=5, n=2)
    single = [client.completions.create(model="tiny", prompt="Seeds", max_tokens=4, temperature=1.0, seed=s)
              for s in (5, 6)]
    assert [c.text for c in both.choices] == [r.choices[0].text for r in single]
    assert both.usage.completion_tokens == sum(r.usage.completion_tokens for r in single)


def test_token_id_prompts_and_chat_tools(engine, client):
    ids = engine.encode("Hello there")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)

    messages = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    with_tools = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=1)
    assert with_tools.usage.prompt_tokens == len(engine.render_chat(messages, tools))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens


BAD = [  # (endpoint, body changes, the field the error must name)
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"top_p": -0.1}, "top_p"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": MAX_QUEUE + 1}, "n"),
    ("completions", {"prompt": [1, 2, 1024]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [-1]]}, "prompt[1]"),
    ("completions", {"prompt": "word " * 600}, "prompt"),
    ("completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("completions", {"h_cycles": 0}, "h_cycles"),
    ("completions", {"stop": ["ok", ""]}, "stop"),
    ("completions", {"echo": True}, "echo"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("chat/completions", {"max_completion_tokens": -3}, "max_completion_tokens"),
    ("score", {"context": [1], "continuation": [5000]}, "continuation"),
    ("score", {"items": [{"context": "a", "continuation": []}]}, "items[0].continuation"),
    ("score", {"context": "only a context"}, "continuation"),
]
GOOD = {"completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 1},
        "chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        "score": {"model": "tiny", "context": "Hi", "continuation": " there"}}


@pytest.mark.parametrize(("endpoint", "change", "param"), BAD, ids=[f"{e}-{p}" for e, _, p in BAD])
def test_bad_request_is_400_naming_the_field_and_the_server_keeps_serving(served, endpoint, change, param):
    url, _ = served
    body = {"model": "tiny", **change} if endpoint == "score" else {**GOOD[endpoint], **change}
    response = httpx.post(f"{url}/{endpoint}", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert httpx.post(f"{url}/{endpoint}", json=GOOD[endpoint], timeout=120).status_code == 200


def test_malformed_json_is_400_and_the_openai_client_sees_bad_request(served, client):
    from openai import BadRequestError

    url, _ = served
    response = httpx.post(url + "/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=1).choices[0].finish_reason


def _reference_token_logprobs(model, context, continuation, **schedule):
    """By hand from the model's forward with the PrefixLM mask: position len(context) - 1 + j
    predicts continuation[j]."""
    batch = single_sample_batch([context], [continuation])
    with torch.no_grad():
        logits = model(batch, **schedule).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = range(len(context) - 1, len(context) - 1 + len(continuation))
    return [float(logprobs[p, t]) for p, t in zip(positions, continuation)], logits


def test_score_equals_the_forward_by_hand(engine, served):
    url, _ = served
    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randint(0, 1024, (n,), generator=g).tolist(), torch.randint(0, 1024, (m,), generator=g).tolist())
             for n, m in ((5, 3), (1, 6), (9, 1))]
    body = {"items": [{"context": c, "continuation": x} for c, x in pairs]}
    results = httpx.post(url + "/score", json=body, timeout=120).json()["results"]
    for (context, continuation), got in zip(pairs, results):
        expected, _ = _reference_token_logprobs(engine.model, context, continuation)
        assert got["token_logprobs"] == pytest.approx(expected, abs=1e-4)
        assert got["logprob"] == pytest.approx(sum(expected), abs=1e-3)
        assert got["num_tokens"] == len(continuation) and got["is_greedy"] is False

    # Another schedule per request; the greedy continuation is recognised as greedy.
    context = pairs[0][0]
    greedy: list[int] = []
    for _ in range(3):
        _, logits = _reference_token_logprobs(engine.model, context, [*greedy, 0], h_cycles=1, l_cycles=2)
        greedy.append(int(logits[len(context) - 1 + len(greedy)].argmax()))
    expected, _ = _reference_token_logprobs(engine.model, context, greedy, h_cycles=1, l_cycles=2)
    got = httpx.post(url + "/score", json={"context": context, "continuation": greedy, "h_cycles": 1,
                                           "l_cycles": 2}).json()["results"][0]
    assert got["is_greedy"] is True
    assert got["token_logprobs"] == pytest.approx(expected, abs=1e-4)

    text = httpx.post(url + "/score", json={"context": "Hello", "continuation": " world"}).json()["results"][0]
    expected, _ = _reference_token_logprobs(engine.model, engine.encode("Hello"), engine.encode(" world"))
    assert text["token_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_schedule_per_request_changes_the_output(client):
    kw = {"model": "tiny", "prompt": "Depth", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    trained = client.completions.create(**kw).choices[0].logprobs.token_logprobs
    shallow = client.completions.create(**kw, extra_body={"h_cycles": 1, "l_cycles": 1}).choices[0]
    assert shallow.logprobs.token_logprobs != pytest.approx(trained, abs=1e-3)


def test_serve_cli_parses(tmp_path):
    from mimir_megatron.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--weights", str(tmp_path), "--port", "0"])
    assert (args.host, args.port, args.max_queue) == ("127.0.0.1", 0, 256)
    assert main(["serve", "--weights", str(tmp_path / "missing")]) != 0


@pytest.mark.parametrize("flags,compile_decode", [([], False), (["--compile-decode"], True)])
def test_serve_cli_hands_its_engine_options_to_the_engine(tmp_path, monkeypatch, flags, compile_decode):
    """`mimir serve`'s engine flags reach load_engine (which builds InferenceEngine with them), and
    the engine it built is the one served: no flag parsed and dropped on the way."""
    import types

    from mimir_megatron.cli import main
    from mimir_megatron.inference import loading, server

    built, served = {}, {}
    engine = types.SimpleNamespace(logprobs_mode="raw")
    monkeypatch.setattr(loading, "load_engine", lambda **kw: built.update(kw) or engine)
    monkeypatch.setattr(server, "serve", lambda e, **kw: served.update(kw, engine=e))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no key given: the user's own is made
    monkeypatch.delenv("MIMIR_API_KEY", raising=False)
    argv = ["serve", "--weights", str(tmp_path), "--port", "0", "--max-batch-size", "3", "--max-context", "99",
            "--logprobs-mode", "processed", *flags]
    assert main(argv) == 0
    assert (built["compile_decode"], built["max_batch_size"], built["max_context"]) == (compile_decode, 3, 99)
    assert served["engine"] is engine and engine.logprobs_mode == "processed"
    assert served["api_keys"] is not None and (tmp_path / "config" / "mimir" / "api-key").is_file()


@pytest.mark.slow
def test_mimir_serve_command_end_to_end(tmp_path, repo):
    """The real entry point: `mimir serve --hf DIR` in its own process, on 127.0.0.1, with an API
    key from its environment: the key's owner is served, another Unix user of the machine is
    refused (and cannot read the key from the process), and the key is in neither the server's log
    nor its `ps` line. Ctrl-C lets a stream in flight go on; a second Ctrl-C ends the process at
    once (exit 130)."""
    import signal
    import subprocess
    import sys

    from openai import OpenAI

    from mimir_megatron.cli import main

    assert main(["export", "--config", str(repo / "configs/model/tiny.yaml"), "--seed", "0",
                 "--output", str(tmp_path / "hf")]) == 0
    log_path = tmp_path / "serve.log"
    key = "sk-served-by-env-8c1d7e2f90ab4c3d"
    with open(log_path, "w") as log:  # port 0: the OS picks a free one, uvicorn logs which
        proc = subprocess.Popen([sys.executable, "-m", "mimir_megatron.cli", "serve", "--hf", str(tmp_path / "hf"),
                                 "--tokenizer", str(repo / "data_prep/mimir_data_prep/demo/tokenizer"),
                                 "--port", "0"], stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "MIMIR_API_KEY": key})
    try:
        def listening() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return re.search(r"running on http://127\.0\.0\.1:(\d+)", log_path.read_text()) is not None

        _wait_for(listening, timeout=300)
        port = int(re.search(r"running on http://127\.0\.0\.1:(\d+)", log_path.read_text()).group(1))
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        _another_user_is_refused(port, proc.pid)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        assert client.models.list().data[0].id == "hf"
        out = client.completions.create(model="hf", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3

        received: list[str] = []
        first = threading.Event()

        def long_stream() -> None:
            try:
                for chunk in client.completions.create(model="hf", prompt="Hello", max_tokens=500, stream=True,
                                                       extra_body={"ignore_eos": True}):
                    received.append(chunk.choices[0].text)
                    first.set()
            except Exception:  # noqa: BLE001 - the forced exit cuts the stream
                pass

        streaming = threading.Thread(target=long_stream, daemon=True)
        streaming.start()
        assert first.wait(120), "the stream never started"
        proc.send_signal(signal.SIGINT)
        _wait_for(lambda: "finishing the requests in flight" in log_path.read_text(), timeout=60)
        assert proc.poll() is None  # the stream goes on
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, log_path.read_text()[-2000:]
        assert "second Ctrl-C: exiting now" in log_path.read_text()
        assert len(received) < 500  # cut, not finished
        assert "requests need an API key (1 accepted)" in log_path.read_text()
        assert key not in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)


def _another_user_is_refused(port: int, pid: int) -> None:
    """A second Unix user (tests/helpers/other_user.py) with curl: /health answers, the API does
    not; the server's command line (what `ps` shows) has no key, its environment is unreadable."""
    from other_user import curl_as_other, run_as_other

    assert curl_as_other("GET", f"http://127.0.0.1:{port}/health")[0] == 200
    status, body = curl_as_other("GET", f"http://127.0.0.1:{port}/v1/models")
    assert status == 401 and '"invalid_api_key"' in body
    status, _ = curl_as_other("POST", f"http://127.0.0.1:{port}/v1/completions", "-H",
                              "Content-Type: application/json", "-d", '{"model": "hf", "prompt": "Hi"}')
    assert status == 401
    listed = run_as_other(["cat", f"/proc/{pid}/cmdline"])
    assert listed.returncode == 0 and "MIMIR_API_KEY" not in listed.stdout and "sk-" not in listed.stdout
    assert run_as_other(["cat", f"/proc/{pid}/environ"]).returncode != 0  # Permission denied
