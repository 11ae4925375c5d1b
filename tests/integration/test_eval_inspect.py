"""`mimir eval` and `mimir sweep` end to end through InspectAI against a scripted
OpenAI-compatible stand-in server: scores, per-item outcomes, request bodies, tables, McNemar,
contamination marks and MLflow. One evaluation and one two-schedule sweep are shared by all tests
(InspectAI start-up costs seconds)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from eval_stub import Script, serve_stub
from mimir_megatron.evaluation.fixtures import write_fixtures
from mimir_megatron.evaluation.metrics import LETTERS
from mimir_megatron.evaluation.prompts import build_items
from mimir_megatron.evaluation.suite import load_suite

REPO = Path(__file__).resolve().parents[2]
LIMIT = 4
SUITE = f"""
name: stubbed
seed: 4242
tasks:
  - {{from: {REPO}/configs/eval/mimir_en.yaml, name: mmlu}}
  - {{from: {REPO}/configs/eval/mimir_en.yaml, name: hellaswag, mc_scoring: loglik, shots: 0}}
  - {{from: {REPO}/configs/eval/mimir_math_code.yaml, name: gsm8k, shots: 2}}
  - {{from: {REPO}/configs/eval/mimir_da.yaml, name: gec}}
  - {{from: {REPO}/configs/eval/mimir_da.yaml, name: wmt}}
  - {{from: {REPO}/configs/eval/mimir_da.yaml, name: daisy, data: not_there/test.jsonl}}
mcnemar: [[2x3, 1x3]]
"""
RIGHT = {0, 1}  # positions (in evaluation order) the stub answers correctly


def _wrong(reference: str, task) -> str:
    if task.format == "multiple_choice":
        return "A" if reference != "A" else "B"
    return "wrong answer"


def _script(suite, data_dir: Path) -> tuple[Script, dict[str, list]]:
    """Right replies at positions RIGHT, wrong elsewhere; for the log-likelihood task the
    right (or a wrong) letter gets the highest log-prob. Under H=1 every reply is wrong."""
    script = Script(default="no idea", collapsed_h_cycles={1})
    items_by_task = {}
    for task in suite.tasks:
        if task.name == "daisy":
            continue
        items = build_items(task, data_dir, suite.seed, LIMIT)
        items_by_task[task.name] = items
        for position, item in enumerate(items):
            ref = item.references[0]
            reply = ref if position in RIGHT else _wrong(ref, task)
            if task.name == "gsm8k":
                reply = f"Let me add.\n#### {reply}"
            if task.name == "hellaswag":
                context = "\n\n".join(m["content"] for m in item.messages)
                for letter in LETTERS[: item.num_choices]:
                    script.logprobs[(context, letter)] = -1.0 if letter == reply else -5.0
            else:
                script.replies[item.messages[-1]["content"]] = reply
    return script, items_by_task


def _contamination_report(suite, data_dir: Path, path: Path) -> Path:
    """A `mimir audit contamination` report: MMLU 1 of 4 items contaminated (the first in evaluation
    order, which the stub answers right), GEC none, HellaSwag checked on other data (stale); the
    other tasks not checked."""
    from mimir_megatron.evaluation.contamination import FORMAT, data_sha256
    from mimir_megatron.integrity import with_digest

    tasks = {t.name: t for t in suite.tasks}
    first_mmlu = build_items(tasks["mmlu"], data_dir, suite.seed, LIMIT)[0].id

    def bench(name: str, dirty: list[str], sha: str | None = None) -> dict:
        return {"items": LIMIT, "contaminated": len(dirty), "contaminated_items": dirty,
                "longest_span": {"tokens": 20 if dirty else 5},
                "data_sha256": sha or data_sha256(data_dir / tasks[name].data), "error": None}

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(with_digest({"format": FORMAT, "suite": suite.name, "seed": suite.seed,
                                            "limit": LIMIT, "ngram": 13, "benchmarks": {
        "mmlu": bench("mmlu", [first_mmlu]), "gec": bench("gec", []),
        "hellaswag": bench("hellaswag", ["0", "1"], "0" * 64)}})))
    return path


@pytest.fixture(scope="module")
def stubbed(tmp_path_factory):
    from mimir_megatron.cli import main

    root = tmp_path_factory.mktemp("eval-stub")
    data_dir = write_fixtures(root / "data", rows_per_split=6)
    suite_path = root / "stubbed.yaml"
    suite_path.write_text(SUITE)
    suite = load_suite(suite_path)
    script, items = _script(suite, data_dir)
    report = _contamination_report(suite, data_dir, root / "contamination" / "stubbed.json")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    logger = logging.getLogger()
    logging_before = (logger.level, list(logger.handlers))
    with serve_stub(script) as url:
        rc = main(["eval", "--base-url", url, "--suite", str(suite_path), "--data-dir", str(data_dir),
                   "--limit", str(LIMIT), "--h-cycles", "2", "--l-cycles", "3", "--output",
                   str(root / "eval"), "--tracking-uri", uri, "--contamination", str(report)])
        eval_requests = list(script.requests)
        script.requests.clear()
        sweep_rc = main(["sweep", "--base-url", url, "--suite", str(suite_path), "--tasks", "mmlu,gec",
                         "--data-dir", str(data_dir), "--limit", str(LIMIT), "--schedules", "2x3,1x3",
                         "--trained-schedule", "2x3", "--output", str(root / "sweep"),
                         "--tracking-uri", uri, "--contamination", str(report.parent)])
    return {"root": root, "rc": rc, "sweep_rc": sweep_rc, "requests": eval_requests,
            "logging": (logging_before, (logger.level, list(logger.handlers))),
            "sweep_requests": script.requests, "items": items, "uri": uri}


def test_scores_per_task(stubbed):
    summary = json.loads((stubbed["root"] / "eval" / "results.json").read_text())
    scores = {name: task["score"] for name, task in summary["tasks"].items()}
    half = len(RIGHT) / LIMIT
    assert scores["mmlu"] == scores["hellaswag"] == scores["gsm8k"] == scores["gec"] == pytest.approx(half)
    # chrF is corpus-level: identical halves plus "wrong answer" for the rest, by sacrebleu
    import sacrebleu

    refs = [i.references[0] for i in stubbed["items"]["wmt"]]
    hyps = [r if p in RIGHT else "wrong answer" for p, r in enumerate(refs)]
    assert scores["wmt"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score / 100)
    assert summary["category_averages"]["English"] == pytest.approx(half)
    assert summary["schedule"] == [2, 3]


def test_missing_data_is_reported_and_the_rest_runs(stubbed):
    summary = json.loads((stubbed["root"] / "eval" / "results.json").read_text())
    assert summary["tasks"]["daisy"]["score"] is None
    assert "task daisy: data not found at" in summary["tasks"]["daisy"]["error"]
    assert "not_there/test.jsonl" in summary["tasks"]["daisy"]["error"]
    assert stubbed["rc"] == 1  # a task failed; everything else was still written
    table = (stubbed["root"] / "eval" / "results.md").read_text()
    # MMLU: right at positions 0 and 1, position 0 contaminated: clean 1 of 3, contaminated 1 of 1
    assert "| English | MMLU‡ | acc | 50.0 | 4 | 1/4 (25.0 %) | 33.3 (3) | 100.0 (1) |" in table
    assert "| Danish | Daisy | EM | n/a | 0 | not checked | n/a | n/a |" in table


def test_benchmarks_with_contaminated_items_are_marked(stubbed):
    root = stubbed["root"]
    table = (root / "eval" / "results.md").read_text()
    assert "| Danish | GEC | EM | 50.0 | 4 | 0/4 | 50.0 (4) | — |" in table  # checked, clean: no mark
    assert "| English | HellaSwag | acc | 50.0 | 4 | stale report | n/a | n/a |" in table  # other data
    assert f"‡ contaminated: items share 13 consecutive tokens with the training data (report {root}" in table
    tasks = json.loads((root / "eval" / "results.json").read_text())["tasks"]
    assert (tasks["mmlu"]["contamination"]["contaminated"], tasks["mmlu"]["contamination"]["fraction"]) == (1, 0.25)
    assert tasks["gsm8k"]["contamination"] is None and tasks["hellaswag"]["contamination"]["stale"]
    assert tasks["mmlu"]["score_split"] == {"clean": pytest.approx(1 / 3), "clean_n": 3, "contaminated": 1.0,
                                            "contaminated_n": 1}
    assert tasks["hellaswag"]["score_split"] is None and tasks["gsm8k"]["score_split"] is None
    sweep = (root / "sweep" / "table5.md").read_text()
    assert "| D | H | L | schedule | MMLU‡ | GEC |" in sweep and "‡ contaminated" in sweep
    assert json.loads((root / "sweep" / "table5.json").read_text())["contamination"]["mmlu"]["contaminated"] == 1


def test_requests_are_greedy_with_the_schedule(stubbed):
    chats = [r for r in stubbed["requests"] if "messages" in r]
    scores = [r for r in stubbed["requests"] if "items" in r]
    assert len(chats) == 4 * LIMIT and len(scores) == LIMIT
    assert all(r["temperature"] == 0.0 and r["h_cycles"] == 2 and r["l_cycles"] == 3 for r in chats)
    assert all(r["h_cycles"] == 2 and r["l_cycles"] == 3 for r in scores)
    gsm8k = [r for r in chats if len(r["messages"]) == 5]  # two shots: user/assistant x2, then the question
    assert len(gsm8k) == LIMIT and gsm8k[0]["messages"][1]["role"] == "assistant"


def test_per_item_outcomes_and_inspect_logs(stubbed):
    rows = [json.loads(line) for line in (stubbed["root"] / "eval" / "items.jsonl").read_text().splitlines()]
    by_task = {}
    for row in rows:
        by_task.setdefault(row["task"], []).append(row)
    order = [i.id for i in stubbed["items"]["mmlu"]]
    right = {order[p] for p in RIGHT}
    assert {r["id"] for r in by_task["mmlu"] if r["correct"]} == right
    assert all(r["correct"] is None for r in by_task["wmt"])
    logs = list((stubbed["root"] / "eval" / "logs").glob("*.eval"))
    assert len(logs) == 5


def test_host_logging_is_left_alone(stubbed):
    before, after = stubbed["logging"]
    assert before == after  # InspectAI would lower the root level and add its own handler


def test_sweep_table_and_mcnemar(stubbed):
    assert stubbed["sweep_rc"] == 0
    table = json.loads((stubbed["root"] / "sweep" / "table5.json").read_text())
    rows = {(r["H"], r["L"]): r for r in table["rows"]}
    assert rows[(2, 3)]["trained"] and not rows[(1, 3)]["trained"]
    # under H=1 the stub answers nothing right: below chance, collapsed; the two right items
    # under 2x3 are the only discordant pairs: p = 2 * 0.5^2
    assert rows[(2, 3)]["mmlu"] == 50.0 and rows[(1, 3)]["mmlu"] == 0.0 and rows[(1, 3)]["mmlu_collapsed"]
    assert {(t["task"], t["n"], t["only_a"], t["only_b"], t["p_value"]) for t in table["mcnemar"]} == \
        {("mmlu", LIMIT, 2, 0, 0.5), ("gec", LIMIT, 2, 0, 0.5)}
    assert {r["h_cycles"] for r in stubbed["sweep_requests"]} == {1, 2}
    assert (stubbed["root"] / "sweep" / "heatmap.png").stat().st_size > 1000


def test_mlflow_receives_the_metrics(stubbed):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=stubbed["uri"])
    exp = client.get_experiment_by_name("mimir-eval")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    evaluation = runs["eval stubbed"]
    assert evaluation.data.metrics["eval/mmlu"] == pytest.approx(0.5)
    assert evaluation.data.metrics["eval/avg/english"] == pytest.approx(0.5)
    assert evaluation.data.metrics["contamination/mmlu"] == 0.25 and "contamination/hellaswag" not in \
        evaluation.data.metrics
    assert evaluation.data.metrics["eval/clean/mmlu"] == pytest.approx(1 / 3)
    assert evaluation.data.metrics["eval/contaminated/mmlu"] == 1.0 and "eval/contaminated/gec" not in \
        evaluation.data.metrics
    assert "eval/daisy" not in evaluation.data.metrics
    artifacts = {a.path for a in client.list_artifacts(evaluation.info.run_id, "tables")}
    assert "tables/results.md" in artifacts
    parent = runs["sweep stubbed"]
    child = runs["sweep stubbed 1x3"]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.data.metrics["mcnemar/mmlu/2x3_vs_1x3/p_value"] == 0.5
    assert parent.data.metrics["2x3/gec"] == pytest.approx(0.5)


def test_the_sweep_is_a_function_of_typed_arguments(stubbed, tmp_path):
    """`mimir sweep`'s workflow without the CLI, around a server it is handed: the tables, items and
    MLflow runs of the command's sweep above (same suite, schedules and stub answers)."""
    import contextlib

    from mlflow.tracking import MlflowClient

    from mimir_megatron.evaluation.sweep import run_sweep
    from mimir_megatron.evaluation.tracking import TrackingTarget

    root = stubbed["root"]
    suite = load_suite(root / "stubbed.yaml").select(["mmlu", "gec"])
    script, _ = _script(suite, root / "data")
    target = TrackingTarget(stubbed["uri"], "sweep-direct", (tmp_path / "mlartifacts").as_uri())
    with serve_stub(script) as url:
        done = run_sweep(suite, [(2, 3), (1, 3)], tmp_path / "sweep", contextlib.nullcontext(url), target,
                         trained=(2, 3), params={"asked": "by the caller"}, data_dir=root / "data", limit=LIMIT,
                         metrics={"extra/metric": 1.0})
    by_command = json.loads((root / "sweep" / "table5.json").read_text())
    assert done.sweep.rows() == by_command["rows"]
    assert {(t["task"], t["p_value"]) for t in done.sweep.mcnemar()} == {("mmlu", 0.5), ("gec", 0.5)}
    for name in ("table5.csv", "items.jsonl"):
        assert (tmp_path / "sweep" / name).read_text() == (root / "sweep" / name).read_text(), name
    assert [p.name for p in done.files] == ["table5.md", "table5.csv", "table5.json", "heatmap.png", "items.jsonl"]
    client = MlflowClient(stubbed["uri"])
    parent = client.get_run(done.run_id)
    assert parent.data.params["model"] == "stub-model" and parent.data.params["asked"] == "by the caller"
    assert parent.data.metrics["extra/metric"] == 1.0 and parent.data.metrics["2x3/gec"] == pytest.approx(0.5)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{done.run_id}'")
    assert sorted(r.info.run_name for r in children) == ["sweep stubbed 1x3", "sweep stubbed 2x3"]


def test_an_evaluation_is_a_function_of_typed_arguments(stubbed, tmp_path):
    """`mimir eval`'s workflow without the CLI, around a server it is handed: the scores and items of
    the command's evaluation above, its contamination split from the marks, one MLflow run."""
    import contextlib

    from mlflow.tracking import MlflowClient

    from mimir_megatron.evaluation.contamination import ContaminationReport, benchmark_marks
    from mimir_megatron.evaluation.tracking import TrackingTarget
    from mimir_megatron.evaluation.workflow import run_eval

    root = stubbed["root"]
    suite = load_suite(root / "stubbed.yaml").select(["mmlu", "gec"])
    script, _ = _script(suite, root / "data")
    marks = benchmark_marks(ContaminationReport.read(root / "contamination" / "stubbed.json"), suite, root / "data")
    target = TrackingTarget(stubbed["uri"], "eval-direct", (tmp_path / "mlartifacts").as_uri(), checkpoint_step=7)
    with serve_stub(script) as url:
        done = run_eval(suite, tmp_path / "eval", contextlib.nullcontext(url), target, h_cycles=2, l_cycles=3,
                        marks=marks, params={"asked": "by the caller"}, data_dir=root / "data", limit=LIMIT)
    by_command = json.loads((root / "eval" / "results.json").read_text())["tasks"]
    mine = json.loads((tmp_path / "eval" / "results.json").read_text())["tasks"]
    assert mine == {name: by_command[name] for name in ("mmlu", "gec")}
    assert done.model_name == "stub-model" and done.result.metrics()["eval/mmlu"] == pytest.approx(0.5)
    assert [p.name for p in done.tables] == ["results.md", "results.csv", "results.json", "items.jsonl"]
    run = MlflowClient(stubbed["uri"]).get_run(done.run_id)
    assert run.info.run_name == "eval stubbed step 7"
    assert {k: run.data.params[k] for k in ("asked", "model", "h_cycles", "l_cycles")} == \
        {"asked": "by the caller", "model": "stub-model", "h_cycles": "2", "l_cycles": "3"}
    assert run.data.metrics["contamination/mmlu"] == 0.25
    assert run.data.metrics["eval/contaminated/mmlu"] == 1.0 and run.data.metrics["eval/clean/mmlu"] == pytest.approx(1 / 3)
