"""Run a suite with InspectAI against an OpenAI-compatible server; collect per-item outcomes.

One ``inspect_ai.eval`` call runs every task of the suite (concurrently, against one server).
A task whose data is missing or malformed is reported with one clear message and left out; the
other tasks still run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mimir_megatron.errors import UserError
from mimir_megatron.inference.api_keys import ENV_VAR, Endpoint

from .metrics import ItemOutcome, aggregate
from .prompts import Item, build_items
from .scoring_client import ScoreClient
from .suite import SuiteSpec, TaskSpec

log = logging.getLogger(__name__)


@dataclass
class TaskResult:
    spec: TaskSpec
    outcomes: list[ItemOutcome] = field(default_factory=list)
    error: str | None = None
    chance: float = 0.0
    """Expected score of random answers (1 / options for multiple choice, else 0)."""
    skipped: bool = False
    """Left out on purpose (HumanEval without --allow-code-execution), not a failure."""

    @property
    def score(self) -> float | None:
        """In [0, 1]; None when the task did not run."""
        if self.error is not None or not self.outcomes:
            return None
        return aggregate(self.spec.metric, self.outcomes)


@dataclass
class SuiteResult:
    suite: SuiteSpec
    tasks: list[TaskResult]
    schedule: tuple[int, int] | None = None
    log_dir: Path | None = None

    def scores(self) -> dict[str, float]:
        return {t.spec.name: t.score for t in self.tasks if t.score is not None}

    def category_averages(self) -> dict[str, float]:
        by_category: dict[str, list[float]] = {}
        for t in self.tasks:
            if t.score is not None:
                by_category.setdefault(t.spec.category, []).append(t.score)
        return {c: sum(v) / len(v) for c, v in by_category.items()}

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat metrics for MLflow: ``eval/<task>`` and ``eval/avg/<category>`` (in [0, 1])."""
        out = {f"{prefix}{name}": value for name, value in self.scores().items()}
        out.update({f"{prefix}avg/{_key(c)}": v for c, v in self.category_averages().items()})
        return out


def _key(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text.lower()).strip("_")


def offline_environment() -> None:
    """InspectAI settings for machines without internet: no display, no update checks."""
    os.environ.setdefault("INSPECT_DISPLAY", "none")
    os.environ.setdefault("INSPECT_LOG_LEVEL", "warning")
    os.environ.setdefault("INSPECT_EVAL_LOG_FORMAT", "eval")


@contextlib.contextmanager
def _host_logging_kept():
    """InspectAI sets the root logger's level and adds its handler to it on first use; the host
    process (the trainer, the CLI) keeps its own logging configuration."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def server_model_name(endpoint: Endpoint | str) -> str:
    """The first model id the server lists under ``GET /models`` (a refused key: one line that says
    where the key comes from)."""
    endpoint = Endpoint.of(endpoint)
    try:
        response = httpx.get(endpoint.base_url + "/models", headers=endpoint.headers, timeout=30)
        if response.status_code == 401:
            raise UserError(f"the server at {endpoint.base_url} refused the API key"
                            + (" sent" if endpoint.api_key else ": it needs one")
                            + f" (give --api-key-file PATH or {ENV_VAR})")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise UserError(f"no model listed by the server at {endpoint.base_url} ({exc})") from exc


def prepare_items(suite: SuiteSpec, data_dir: Path, limit: int | None, allow_code_execution: bool,
                  ) -> tuple[dict[str, list[Item]], dict[str, str], set[str]]:
    """(items per runnable task, message per task that cannot run, tasks skipped on purpose)."""
    items: dict[str, list[Item]] = {}
    errors: dict[str, str] = {}
    skipped: set[str] = set()
    for spec in suite.tasks:
        if spec.format == "humaneval" and not allow_code_execution:
            errors[spec.name] = (f"task {spec.name}: skipped, it executes generated code "
                                 "(pass --allow-code-execution to run it)")
            skipped.add(spec.name)
            continue
        try:
            items[spec.name] = build_items(spec, data_dir, suite.seed, limit)
        except UserError as exc:
            errors[spec.name] = str(exc)
        if spec.format == "ifeval" and spec.name in items:
            from .ifeval import unsupported

            missing = unsupported([i for it in items[spec.name] for i in it.extra["instructions"]])
            if missing:
                errors[spec.name] = f"task {spec.name}: unsupported IFEval instructions {', '.join(missing)}"
                del items[spec.name]
    for name, message in errors.items():
        (log.warning if name in skipped else log.error)("%s", message)
    return items, errors, skipped


def run_suite(suite: SuiteSpec, endpoint: Endpoint | str, *, data_dir: str | Path | None = None,
              limit: int | None = None, h_cycles: int | None = None, l_cycles: int | None = None,
              log_dir: str | Path = "logs/eval", model_name: str | None = None,
              score_client: ScoreClient | None = None, allow_code_execution: bool = False,
              mc_scoring: str | None = None, max_connections: int = 32) -> SuiteResult:
    """Evaluate every task of ``suite`` on the server at ``endpoint`` (".../v1", with its key).

    ``h_cycles``/``l_cycles`` are sent as extra body fields of every request (the server's
    default is the trained schedule). Logs go to ``log_dir`` (InspectAI's .eval files).
    """
    offline_environment()
    from inspect_ai import eval as inspect_eval
    from inspect_ai.model import GenerateConfig, get_model

    from .inspect_tasks import SCORER_NAME, build_task

    endpoint = Endpoint.of(endpoint)
    data_dir = Path(data_dir or suite.data_dir)
    model_name = model_name or server_model_name(endpoint)
    schedule = {k: v for k, v in (("h_cycles", h_cycles), ("l_cycles", l_cycles)) if v is not None}
    if score_client is None:
        score_client = ScoreClient(endpoint, model_name)
    items, errors, skipped = prepare_items(suite, data_dir, limit, allow_code_execution)
    results = {s.name: TaskResult(s, error=errors.get(s.name), chance=_chance(s, items.get(s.name)),
                                  skipped=s.name in skipped)
               for s in suite.tasks}
    tasks = [build_task(s, items[s.name], scoring=mc_scoring or suite.scoring_of(s),
                        schedule=schedule or None, score_client=score_client,
                        allow_code_execution=allow_code_execution)
             for s in suite.tasks if s.name in items]
    if tasks:
        model = get_model(f"openai-api/mimir/{model_name}", base_url=endpoint.base_url,
                          api_key=endpoint.sdk_key,
                          config=GenerateConfig(max_connections=max_connections, temperature=0.0,
                                                max_retries=2, timeout=600))
        with _host_logging_kept():
            logs = inspect_eval(tasks, model=model, log_dir=str(log_dir), display="none",
                                max_tasks=len(tasks), score_display=False)
        for eval_log in logs:
            result = results[eval_log.eval.task]
            if eval_log.status != "success":
                result.error = f"task {result.spec.name}: {eval_log.status}: " + (
                    eval_log.error.message if eval_log.error else "no error message")
                log.error("%s", result.error)
                continue
            for sample in eval_log.samples or []:
                if sample.scores is None or SCORER_NAME not in sample.scores:
                    continue
                score = sample.scores[SCORER_NAME]
                meta = score.metadata or {}
                result.outcomes.append(ItemOutcome(
                    str(sample.id), str(score.answer or ""), tuple(meta.get("references", ())),
                    float(score.value), meta.get("correct"),
                    tuple(meta["choice_logprobs"]) if meta.get("choice_logprobs") else None))
    return SuiteResult(suite, list(results.values()),
                       (h_cycles, l_cycles) if h_cycles is not None or l_cycles is not None else None,
                       Path(log_dir))


def _chance(spec: TaskSpec, items: list[Item] | None) -> float:
    if spec.format != "multiple_choice" or not items:
        return 0.0
    return sum(1.0 / i.num_choices for i in items) / len(items)


def run_suite_on_engine(engine, suite: SuiteSpec | str | Path, *, limit: int | None = None,  # noqa: ANN001
                        data_dir: str | Path | None = None, h_cycles: int | None = None,
                        l_cycles: int | None = None, log_dir: str | Path = "logs/eval",
                        prefix: str = "eval/") -> dict[str, float]:
    """In-process evaluation for training: serve ``engine`` on a 127.0.0.1 thread and run the
    suite through InspectAI exactly as ``mimir eval`` does. Returns MLflow-ready metrics
    (``eval/<task>``, ``eval/avg/<category>``); tasks that cannot run are logged and left out.
    The thread's server asks for a fresh API key: other users of the machine cannot use it, and
    decodes beside a trainer's thread at full speed (``serve_in_thread`` frees the caller's
    OpenMP workers)."""
    from mimir_megatron.inference.api_keys import ApiKeys, new_key
    from mimir_megatron.inference.server import serve_in_thread

    from .scoring_client import chat_renderer
    from .suite import load_suite

    if not isinstance(suite, SuiteSpec):
        suite = load_suite(suite)
    tokenizer = getattr(engine, "tokenizer", None)
    key = new_key()
    with serve_in_thread(engine, port=0, api_keys=ApiKeys([key])) as base_url:
        endpoint = Endpoint(base_url, key)
        model_name = getattr(engine, "model_name", None) or server_model_name(endpoint)
        client = ScoreClient(endpoint, model_name,
                             chat_renderer(tokenizer) if tokenizer is not None else None,
                             (lambda t: tokenizer.encode(t, add_special_tokens=False)) if tokenizer else None)
        result = run_suite(suite, endpoint, data_dir=data_dir, limit=limit, h_cycles=h_cycles,
                           l_cycles=l_cycles, log_dir=log_dir, model_name=model_name,
                           score_client=client)
    return {k: v for k, v in result.metrics(prefix).items() if not math.isnan(v)}
