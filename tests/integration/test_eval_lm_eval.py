"""`mimir lm-eval`: real lm-evaluation-harness against a real `mimir serve` (tiny random model,
demo tokenizer) on local task files (tests/data/lm_eval): every log-likelihood lm-eval computed
equals /v1/score for lm-eval's own (context, continuation) split, a perplexity equals the whole
text scored causally after the beginning-of-text token, and every generation equals a direct
greedy /v1/completions request."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from conftest import REPO, tiny_config

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.timeout(900)

TOKENIZER = REPO / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    from mimir_megatron.chat import load_tokenizer

    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def served(tokenizer):
    from mimir_megatron.inference import InferenceEngine
    from mimir_megatron.inference.server import build_app, serve_app_in_thread
    from mimir_megatron.model import build_model

    torch.manual_seed(0)
    engine = InferenceEngine(build_model(tiny_config("vocab_size=1024")), tokenizer, model_name="tiny")
    with serve_app_in_thread(build_app(engine, max_batch_size=16)) as url:
        yield url


def lm_eval_samples(url: str, out: Path, tasks: str, monkeypatch) -> dict[str, list[dict]]:
    """Runs `mimir lm-eval --base-url` and returns lm-eval's logged samples per task."""
    from mimir_megatron.cli import main

    monkeypatch.chdir(REPO)  # the task files name their data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rc = main(["lm-eval", "--base-url", url, "--tokenizer", str(TOKENIZER), "--tasks", tasks,
               "--batch-size", "3", "--output", str(out), "--",
               "--include_path", "tests/data/lm_eval", "--log_samples"])
    assert rc == 0
    samples = {}
    for task in tasks.split(","):
        (path,) = out.glob(f"**/samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def split(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split for a causal tokenizer: trailing spaces move to the continuation; the
    whole string is encoded and cut after the context's tokens."""
    from mimir_megatron.chat import encode

    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode(tokenizer, context + continuation), encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def score(url: str, context: list[int], continuation: list[int]) -> dict:
    r = httpx.post(f"{url}/score", json={"context": context, "continuation": continuation}, timeout=300)
    r.raise_for_status()
    return r.json()["results"][0]


def args_of(sample: dict) -> list:
    """The request arguments of one logged request (lm-eval writes {"gen_args_0": {"arg_0": ...}})."""
    return [sample["arguments"][key][f"arg_{i}"] for key in sorted(sample["arguments"])
            for i in range(len(sample["arguments"][key]))]


def test_loglikelihood_generation_and_perplexity_equal_direct_requests(served, tokenizer, tmp_path, monkeypatch):
    tasks = "mimir_arc_style,mimir_gsm8k_style,mimir_text_style"
    samples = lm_eval_samples(served, tmp_path, tasks, monkeypatch)

    # multiple choice: one log-likelihood per option, each the /v1/score of lm-eval's split
    arc = samples["mimir_arc_style"]
    assert len(arc) == 4 and sum(len(s["resps"]) for s in arc) == 4 + 3 + 4 + 2
    for sample in arc:
        for (context, continuation), [(logprob, greedy)] in zip(
                [args_of({"arguments": {k: v}}) for k, v in sample["arguments"].items()], sample["resps"]):
            assert context.startswith("Question: ") and context.endswith("Answer:")
            expected = score(served, *split(tokenizer, context, continuation))
            assert float(logprob) == pytest.approx(expected["logprob"], abs=1e-4)
            assert (greedy == "True") == expected["is_greedy"]

    # generation: what a direct greedy request for the same prompt and settings returns
    gsm = samples["mimir_gsm8k_style"]
    assert len(gsm) == 3
    for sample in gsm:
        context, settings = args_of(sample)
        body = {"prompt": context, "max_tokens": settings["max_gen_toks"], "temperature": 0.0,
                "stop": settings["until"]}
        direct = httpx.post(f"{served}/completions", json=body, timeout=300).json()["choices"][0]["text"]
        assert sample["resps"] == [[direct]]

    # perplexity: the whole text, causal, after the beginning-of-text token
    from mimir_megatron.chat import encode

    text = samples["mimir_text_style"]
    assert len(text) == 2
    for sample in text:
        (document,) = args_of(sample)
        expected = score(served, [tokenizer.bos_token_id], encode(tokenizer, document))
        assert float(sample["resps"][0][0]) == pytest.approx(expected["logprob"], abs=1e-4)


def test_passthrough_arguments_and_model_args():
    from mimir_megatron.errors import UserError
    from mimir_megatron.evaluation.lm_eval_run import lm_eval_argv

    argv = lm_eval_argv("http://127.0.0.1:9/v1", "tok", "arc_easy", ["--limit", "5", "--model_args", "max_length=64"],
                        output_path=Path("out"), batch_size=4, h_cycles=2)
    assert argv == ["run", "--model", "mimir", "--model_args",
                    "base_url=http://127.0.0.1:9/v1,tokenizer=tok,h_cycles=2,max_length=64", "--tasks", "arc_easy",
                    "--batch_size", "4", "--output_path", "out", "--limit", "5"]
    with pytest.raises(UserError, match="--model after `--`"):
        lm_eval_argv("u", "tok", "t", ["--model", "hf"])
    with pytest.raises(UserError, match="key=value"):
        lm_eval_argv("u", "tok", "t", ["--model_args", '{"max_length": 5}'])


def test_missing_extra_is_one_line_naming_it(monkeypatch):
    import sys

    from mimir_megatron.errors import UserError
    from mimir_megatron.evaluation.lm_eval_run import run_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval._cli", None)  # as if lm-eval were not installed
    with pytest.raises(UserError, match=r"pip install 'mimir-megatron\[lmeval\]'"):
        run_lm_eval("u", "tok", "t", [])


def test_score_client_retries_a_transport_error_then_gives_up(monkeypatch):
    """`mimir eval`'s /v1/score client: a dropped connection is retried, a 400 is not."""
    import asyncio

    from mimir_megatron.evaluation.http_retry import RetryPolicy
    from mimir_megatron.evaluation.scoring_client import ScoreClient

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            raise httpx.ConnectError("connection refused", request=request)
        if json.loads(request.content)["items"][0]["continuation"] == "bad":
            return httpx.Response(400, json={"error": {"message": "bad"}})
        return httpx.Response(200, json={"results": [{"logprob": -1.5}]})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    client = ScoreClient("http://127.0.0.1:9/v1", "tiny", retry=RetryPolicy(attempts=3, backoff_s=0.0))
    assert asyncio.run(client.logprobs([{"role": "user", "content": "q"}], ["a"])) == [-1.5]
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(httpx.ConnectError):  # a transport error on every try: the task fails
        asyncio.run(ScoreClient("http://127.0.0.1:9/v1", "tiny", retry=RetryPolicy(attempts=2, backoff_s=0.0))
                    .logprobs([{"role": "user", "content": "q"}], ["a"]))
    calls[:] = [None, None]  # the next request answers at once
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(client.logprobs([{"role": "user", "content": "q"}], ["bad"]))
    assert len(calls) == 3  # a 400 is the request's fault: not retried
