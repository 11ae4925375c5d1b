"""lm-evaluation-harness model ``mimir``: any lm-eval task against a running `mimir serve`.

lm-eval's own clients score a multiple-choice option by sending context + continuation as ONE
prompt with ``echo``; a PrefixLM cannot answer that, because the split decides the mask. Here
lm-eval's own split (``TemplateLM._encode_pair``, with the model's tokenizer on this side) reaches
the server's ``POST /v1/score``: the context is the bidirectional prefix, the continuation causal
(the training mask); pairs go ``batch_size`` at a time as ``items``. Generation is greedy (unless
the task samples) through ``POST /v1/completions`` with token-id prompts, ``batch_size`` prompts
per request. ``loglikelihood_rolling`` (perplexity tasks) scores the whole text causally: lm-eval's
rolling windows with a one-token context (the tokenizer's beginning-of-text token, then the last
token of the previous window), and a one-token prefix attends only to itself, so no token of the
text is bidirectional.

Importing this module registers the model with lm-eval's registry (``--model mimir``);
``mimir lm-eval`` does that before it runs lm-eval's CLI. Transport errors are retried.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from mimir_megatron.errors import UserError

from .http_retry import RetryPolicy, post_json

log = logging.getLogger(__name__)

Pair = tuple[list[int], list[int]]


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UserError(f"model_args {name}={value!r}: expected an integer") from None


@register_model("mimir")
class MimirLM(TemplateLM):
    """lm-eval model over `mimir serve`'s HTTP API.

    model_args: ``base_url`` (".../v1", required), ``tokenizer`` (the model's tokenizer directory,
    required: lm-eval splits context and continuation into token ids here), ``model`` (default:
    the served one), ``max_length`` (default: the server's ``max_model_len``), ``max_gen_toks``
    (default 256), ``h_cycles`` / ``l_cycles`` (the schedule; default the trained one),
    ``timeout`` (seconds per request, default 600), ``retries`` (tries per request, default 4).
    The server's API key, if it asks for one, comes from ``MIMIR_API_KEY`` (never from
    ``model_args``, which lm-eval writes into its results).
    """

    def __init__(self, base_url: str | None = None, tokenizer: str | None = None, model: str | None = None,
                 batch_size: int | str = 16, max_length: int | str | None = None,
                 max_gen_toks: int | str = 256, h_cycles: int | str | None = None,
                 l_cycles: int | str | None = None, timeout: float | str = 600.0, retries: int | str = 4,
                 max_batch_size: int | str | None = None, device: str | None = None) -> None:
        super().__init__()
        if not base_url:
            raise UserError("model_args needs base_url=http://HOST:PORT/v1 (a running `mimir serve`)")
        if not tokenizer:
            raise UserError("model_args needs tokenizer=DIR, the model's tokenizer directory: lm-eval "
                            "splits context and continuation into token ids on this side")
        # lm-eval always passes device (default cuda:0) and max_batch_size: the server places the
        # model and batches, so neither applies here.
        del device, max_batch_size
        from mimir_megatron.chat import load_tokenizer

        self.base_url = str(base_url).rstrip("/")
        self.tokenizer = load_tokenizer(tokenizer)
        self._tokenizer_dir = str(tokenizer)
        self._batch_size = 16 if str(batch_size).startswith("auto") else max(1, int(batch_size))
        self.max_gen_toks = int(max_gen_toks)
        schedule = {"h_cycles": _int_or_none(h_cycles, "h_cycles"),
                    "l_cycles": _int_or_none(l_cycles, "l_cycles")}
        self.schedule = {k: v for k, v in schedule.items() if v is not None}
        self.retry = RetryPolicy(attempts=max(1, int(retries)))
        from mimir_megatron.inference.api_keys import Endpoint, client_key

        self.client = httpx.Client(timeout=float(timeout),
                                   headers=Endpoint(self.base_url, client_key(None)).headers)
        served = self._served_model()
        self.model = model or served["id"]
        self._max_length = _int_or_none(max_length, "max_length") or int(served.get("max_model_len") or 2048)

    # -- what lm-eval asks of a TemplateLM ---------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # the first token of every rendered document (the chat template starts with it)
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self._tokenizer_dir.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # exactly as the server tokenises text (special tokens only where the text spells them)
        from mimir_megatron.chat import encode

        return encode(self.tokenizer, string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    # -- log-likelihood ------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        results = self.score_pairs([(ctx, cont) for _, ctx, cont in requests], disable_tqdm=disable_tqdm)
        for (key, _, _), answer in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[Pair] = []
        owner: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for window in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id,
                                                    self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score_pairs(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def score_pairs(self, pairs: list[Pair], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-prob sum, greedy?) of each (context ids, continuation ids) from /v1/score; a pair
        longer than the context window keeps its continuation and the end of its context."""
        items = [{"context": ctx, "continuation": cont} for ctx, cont in map(self._fit, pairs)]
        out: list[tuple[float, bool]] = []
        for first in tqdm(range(0, len(items), self._batch_size), desc="mimir /v1/score",
                          disable=disable_tqdm or not items):
            body = {"model": self.model, "items": items[first:first + self._batch_size], **self.schedule}
            answer = self._post("/score", body)
            out += [(float(r["logprob"]), bool(r["is_greedy"])) for r in answer["results"]]
        return out

    def _fit(self, pair: Pair) -> Pair:
        context, continuation = pair
        room = self.max_length + 1  # the last continuation token is never an input
        if len(context) + len(continuation) <= room:
            return pair
        if len(continuation) >= room:
            raise UserError(f"a continuation of {len(continuation)} tokens does not fit the context "
                            f"window of {self.max_length} tokens")
        log.warning("context of %d tokens cut to its last %d (max_length %d)", len(context),
                    room - len(continuation), self.max_length)
        return context[-(room - len(continuation)):], continuation

    # -- generation ----------------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings go ``batch_size`` prompts per request."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        bar = tqdm(total=len(requests), desc="mimir /v1/completions", disable=disable_tqdm)
        for members in groups.values():
            settings = self._generation_settings(requests[members[0]].args[1])
            for first in range(0, len(members), self._batch_size):
                chunk = members[first:first + self._batch_size]
                prompts = [self._prompt(requests[i].args[0], settings["max_tokens"]) for i in chunk]
                answer = self._post("/completions", {"model": self.model, "prompt": prompts, **settings,
                                                     **self.schedule})
                for choice in answer["choices"]:
                    i = chunk[choice["index"]]
                    results[i] = choice["text"]
                    self.cache_hook.add_partial("generate_until", requests[i].args, choice["text"])
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def _generation_settings(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None)
        stops = [until] if isinstance(until, str) else list(until or [])
        max_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        # as transformers' generate: greedy unless sampling is asked for (do_sample, temperature > 0)
        do_sample, temperature = kwargs.pop("do_sample", None), kwargs.pop("temperature", None)
        greedy = do_sample is False or (do_sample is None and not temperature)
        settings: dict[str, Any] = {"max_tokens": max_tokens,
                                    "temperature": 0.0 if greedy else float(temperature or 1.0)}
        if any(stops):  # the server also stops at the end-of-turn and end-of-text tokens
            settings["stop"] = [s for s in stops if s]
        for name in ("top_p", "top_k", "seed"):
            if name in kwargs:
                settings[name] = kwargs.pop(name)
        if kwargs:
            raise UserError("generation settings the mimir model does not implement: "
                            + ", ".join(sorted(kwargs)))
        return settings

    def _prompt(self, context: str, max_tokens: int) -> list[int]:
        ids = self.tok_encode(context)
        keep = self.max_length - max_tokens
        if len(ids) > keep > 0:
            log.warning("prompt of %d tokens cut to its last %d (max_length %d - max_gen_toks %d)",
                        len(ids), keep, self.max_length, max_tokens)
            ids = ids[-keep:]
        return ids

    # -- HTTP ----------------------------------------------------------------------------------------

    def _served_model(self) -> dict[str, Any]:
        try:
            response = self.client.get(self.base_url + "/models")
            if response.status_code == 401:
                from mimir_megatron.inference.api_keys import ENV_VAR

                raise UserError(f"{self.base_url}/models: the server refused the API key (set {ENV_VAR})")
            response.raise_for_status()
            return response.json()["data"][0]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise UserError(f"{self.base_url}/models: not a running `mimir serve` ({exc})") from exc

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return post_json(self.client, self.base_url + path, body, self.retry).json()
        except httpx.HTTPStatusError as exc:
            raise UserError(f"POST {self.base_url}{path}: {exc.response.status_code} "
                            f"{exc.response.text[:500]}") from exc
