"""lm-eval's ``mimir`` model on the client side: how pairs and rolling windows are fitted to the
context window. Its /v1 is an in-process stand-in (httpx's MockTransport) that scores with the
real engine on a tiny model, so what the engine refuses is refused here too. lm-eval and a real
`mimir serve` end to end: tests/integration/test_eval_lm_eval.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import REPO, tiny_config

pytest.importorskip("lm_eval")

TOKENIZER = REPO / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer"
MAX_LEN = 8  # the served max_model_len: a pair may hold MAX_LEN + 1 tokens (the last is no input)


@pytest.fixture(scope="module")
def engine():
    from mimir_megatron.inference import InferenceEngine
    from mimir_megatron.model import build_model

    torch.manual_seed(0)
    return InferenceEngine(build_model(tiny_config("vocab_size=1024")), max_context=MAX_LEN)


@pytest.fixture
def client(engine, monkeypatch):
    """``(MimirLM, sent)``: the model over a stand-in /v1; ``sent`` collects every scored pair
    and every generation's (prompt ids, tokens the engine lets it generate)."""
    from mimir_megatron.evaluation.lm_eval_model import MimirLM
    from mimir_megatron.inference.requests import RequestError
    from mimir_megatron.inference.types import GenerationRequest, SamplingParams

    sent: list[tuple[list[int], list[int]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": MAX_LEN}]})
        if request.url.path.endswith("/completions"):  # what the engine would let each generate
            body = json.loads(request.content)
            asked = [GenerationRequest(p, SamplingParams(max_new_tokens=body["max_tokens"]))
                     for p in body["prompt"]]
            for r in asked:
                engine.limits.check_request(r)
            sent.extend((r.prompt_ids, engine.limits.budget(r)) for r in asked)
            return httpx.Response(200, json={"choices": [{"index": i, "text": "x"} for i in range(len(asked))]})
        pairs = [(item["context"], item["continuation"]) for item in json.loads(request.content)["items"]]
        sent.extend(pairs)
        try:
            results = engine.score(pairs)
        except RequestError as exc:
            return httpx.Response(400, json={"error": {"message": str(exc)}})
        return httpx.Response(200, json={"results": [{"logprob": r.logprob, "is_greedy": r.is_greedy}
                                                     for r in results]})

    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    return MimirLM(base_url="http://127.0.0.1:9/v1", tokenizer=str(TOKENIZER), retries=1), sent


def test_a_pair_that_just_fits_is_scored_whole_and_one_token_more_cuts_the_context(client, engine):
    """The boundary is the engine's: context + continuation - 1 positions <= max_model_len."""
    from mimir_megatron.errors import UserError

    lm, sent = client
    assert lm.max_length == MAX_LEN
    context, continuation = list(range(10, 16)), [20, 21, 22, 23]  # 6 + 4 = MAX_LEN + 2 tokens
    fits = (context[1:], continuation)  # MAX_LEN + 1 tokens: the longest context that fits
    results = lm.score_pairs([fits, (context, continuation)])
    assert sent == [fits, fits], "only the pair one token over the window may be cut"
    assert results[0] == results[1] and results[0][0] == engine.score([fits])[0].logprob
    whole_window = ([5], list(range(30, 30 + MAX_LEN)))  # a continuation of the whole window
    assert lm.score_pairs([whole_window])[0][0] == engine.score([whole_window])[0].logprob
    with pytest.raises(UserError, match="continuation of 9 tokens does not fit the context window of 8"):
        lm.score_pairs([([5], list(range(30, 39)))])


def test_rolling_windows_fill_the_context_window(client):
    """A perplexity text longer than the window: lm-eval's rolling windows of MAX_LEN predicted
    tokens each, after a one-token context, reach the engine whole and cover the text once."""
    from mimir_megatron.chat import encode

    lm, sent = client
    text = "the quick brown fox jumps over the lazy dog and runs far away into the woods"
    ids = encode(lm.tokenizer, text)
    assert len(ids) > 2 * MAX_LEN
    (total,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert [c for _, cont in sent for c in cont] == ids  # every token predicted exactly once
    assert sent[0][0] == [lm.prefix_token_id]
    assert [len(c) + len(x) for c, x in sent[:-1]] == [MAX_LEN + 1] * (len(sent) - 1)
    assert isinstance(total, float)


def test_a_prompt_that_leaves_room_for_max_gen_toks_is_sent_whole(client):
    """Generation: prompt + max_gen_toks <= max_model_len, so the engine lets every request
    generate all of max_gen_toks; one prompt token more cuts the prompt's start, never the budget."""
    lm, sent = client
    gen = {"until": ["\n"], "max_gen_toks": 3}
    keep = MAX_LEN - gen["max_gen_toks"]
    fits = " ".join(["the"] * (keep - 1))  # the first "the" is two tokens in the demo tokenizer
    over = fits + " the"
    assert [len(lm.tok_encode(t)) for t in (fits, over)] == [keep, keep + 1]
    assert lm.generate_until([SimpleNamespace(args=(t, gen)) for t in (fits, over)]) == ["x", "x"]
    assert sent == [(lm.tok_encode(fits), 3), (lm.tok_encode(over)[1:], 3)]
