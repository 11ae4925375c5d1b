"""Evaluation suites, local benchmark files and the rows-to-items step (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mimir_megatron.checkpoint.trainer_state import TrainerState, write_trainer_state
from mimir_megatron.errors import ConfigError, UserError
from mimir_megatron.evaluation.fixtures import write_fixtures
from mimir_megatron.evaluation.prompts import build_items
from mimir_megatron.evaluation.benchmark_rows import MissingData, load_rows
from mimir_megatron.evaluation.suite import TaskSpec, load_suite
from mimir_megatron.evaluation.sweep import SweepResult, markdown, parse_schedules, schedule_string

REPO = Path(__file__).resolve().parents[2]
SUITES = ("mimir_en", "mimir_math_code", "mimir_da", "table5", "demo")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    return write_fixtures(tmp_path_factory.mktemp("eval-data"), rows_per_split=6)


@pytest.mark.parametrize("name", SUITES)
def test_shipped_suites_validate(name):
    suite = load_suite(REPO / "configs" / "eval" / f"{name}.yaml")
    assert suite.seed == 4242 and suite.tasks


def test_paper_suites_cover_the_twenty_benchmarks():
    names = [t.name for n in ("mimir_en", "mimir_math_code", "mimir_da")
             for t in load_suite(REPO / "configs" / "eval" / f"{n}.yaml").tasks]
    assert len(names) == 20
    danish = load_suite(REPO / "configs" / "eval" / "mimir_da.yaml")
    assert all(t.shots == 0 for t in danish.tasks)
    table5 = load_suite(REPO / "configs" / "eval" / "table5.yaml")
    assert [t.header for t in table5.tasks] == ["ARC-C", "MMLU", "GSM8K", "HellaSwag", "GEC-DaLA"]


def test_every_fixture_task_builds_items(fixtures):
    for name in ("mimir_en", "mimir_math_code", "mimir_da"):
        for task in load_suite(REPO / "configs" / "eval" / f"{name}.yaml").tasks:
            items = build_items(task, fixtures, 4242, limit=3)
            assert len(items) == 3, task.name
            assert items[0].messages[-1]["role"] == "user"
            assert len(items[0].messages) == 1 + 2 * min(task.shots, 6)


def test_bad_suite_lists_every_mistake(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tasks:\n  - {name: a, format: multiple_choice, data: x.jsonl, metric: chrf}\n"
                    "  - {name: b, format: nope, data: y.jsonl}\n  - {name: a, format: generate, shots: 2}\n")
    with pytest.raises(ConfigError) as err:
        load_suite(path)
    text = str(err.value)
    for fragment in ("metric 'chrf' does not fit", "columns.answer is required", "format 'nope'",
                     "appears twice", "`data`", "need `fewshot_data`", "columns.target is required"):
        assert fragment in text


def test_missing_data_names_task_and_path(tmp_path):
    with pytest.raises(MissingData, match=r"task boolq: data not found at .*boolq/validation.jsonl"):
        load_rows(tmp_path / "boolq" / "validation.jsonl", "boolq")


def test_three_file_formats_read_the_same_layout(fixtures):
    parquet = load_rows(fixtures / "mmlu" / "test.parquet", "mmlu")
    assert set(parquet[0]) == {"question", "subject", "choices", "answer"} and len(parquet) == 6
    saved = load_rows(fixtures / "arc_challenge" / "dataset", "arc", split="test")
    assert set(saved[0]["choices"]) == {"text", "label"}
    with pytest.raises(UserError, match="set the task's `split`"):
        load_rows(fixtures / "arc_challenge" / "dataset", "arc")


def _mc(**kw) -> TaskSpec:
    base = dict(name="t", format="multiple_choice", data="rows.jsonl", prompt="{q}")
    return TaskSpec(**{**base, **kw})


@pytest.mark.parametrize("spec,row,letter", [
    (_mc(columns={"choices": "opts", "answer": "a"}, answer_kind="index"), {"q": "?", "opts": ["x", "y"], "a": 1}, "B"),
    (_mc(columns={"choices": ["o1", "o2"], "answer": "a"}, answer_kind="index1"),
     {"q": "?", "o1": "x", "o2": "y", "a": "1"}, "A"),
    (_mc(columns={"choices": "c.text", "labels": "c.label", "answer": "k"}, answer_kind="label"),
     {"q": "?", "c": {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}, "k": "3"}, "C"),
    (_mc(choice_values=["yes", "no"], columns={"answer": "a"}, answer_kind="bool"), {"q": "?", "a": False}, "B"),
    (_mc(choice_values=["pos", "neg"], columns={"answer": "a"}, answer_kind="value"), {"q": "?", "a": "pos"}, "A"),
])
def test_multiple_choice_answer_kinds(tmp_path, spec, row, letter):
    import json

    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    [item] = build_items(spec, tmp_path, 4242)
    assert item.references == [letter]
    assert "\nA. " in item.messages[-1]["content"]


def test_seeded_shuffle_limit_and_shots(fixtures):
    task = load_suite(REPO / "configs" / "eval" / "mimir_math_code.yaml").tasks[0]  # gsm8k, 8 shots
    first = build_items(task, fixtures, 4242, limit=4)
    again = build_items(task, fixtures, 4242, limit=6)
    other = build_items(task, fixtures, 7, limit=6)
    assert [i.id for i in first] == [i.id for i in again[:4]]
    assert [i.id for i in again] != [i.id for i in other]
    assert sorted(int(i.id) for i in again) == list(range(6))
    assert first[0].messages[1]["role"] == "assistant" and "####" in first[0].messages[1]["content"]
    assert first[0].references[0].isdigit()


def test_row_missing_a_column_is_named(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"q": "?", "a": 1}\n')
    with pytest.raises(UserError, match="row 0 has no column 'opts'"):
        build_items(_mc(columns={"choices": "opts", "answer": "a"}), tmp_path, 4242)


def test_sweep_table_marks_trained_and_collapsed():
    from mimir_megatron.evaluation.metrics import ItemOutcome
    from mimir_megatron.evaluation.runner import SuiteResult, TaskResult
    from mimir_megatron.evaluation.suite import SuiteSpec

    mc = _mc(name="arc", title="ARC-C", columns={"choices": "o", "answer": "a"})
    gen = TaskSpec(name="gec", format="generate", data="x", columns={"target": "t"}, metric="exact_match")
    suite = SuiteSpec(name="s", tasks=[mc, gen], mcnemar=[["2x3", "1x3"]])

    def result(mc_right: list[int], gen_right: list[int]) -> SuiteResult:
        return SuiteResult(suite, [
            TaskResult(mc, [ItemOutcome(str(i), "", ("A",), float(v), bool(v)) for i, v in enumerate(mc_right)],
                       chance=0.25),
            TaskResult(gen, [ItemOutcome(str(i), "", ("x",), float(v), bool(v)) for i, v in enumerate(gen_right)])])

    sweep = SweepResult(suite, {(1, 3): result([0, 0, 0, 0, 0, 0, 0, 1], [0] * 8),
                                (2, 3): result([1, 1, 1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0, 0, 0])}, trained=(2, 3))
    rows = sweep.rows()
    assert [(r["D"], r["schedule"], r["trained"]) for r in rows] == [(4, "LLLH", False), (8, "LLLHLLLH", True)]
    assert rows[0]["arc"] == 12.5 and rows[0]["arc_collapsed"] and rows[0]["gec_collapsed"]
    assert rows[1]["arc"] == 62.5 and not rows[1]["arc_collapsed"] and not rows[1]["gec_collapsed"]
    tests = {t["task"]: t for t in sweep.mcnemar()}
    assert (tests["arc"]["only_a"], tests["arc"]["only_b"]) == (4, 0)
    assert tests["arc"]["p_value"] == pytest.approx(2 / 16)
    assert (tests["gec"]["only_a"], tests["gec"]["p_value"]) == (3, pytest.approx(0.25))
    text = markdown(sweep)
    assert "| 8 | 2 | 3 | LLLHLLLH (trained) | 62.50 | 37.50 |" in text and "12.50†" in text


def test_schedules_parse():
    assert parse_schedules("1x3, 2x1,3X3") == [(1, 3), (2, 1), (3, 3)]
    assert schedule_string((2, 3)) == "LLLHLLLH"
    with pytest.raises(UserError, match="not HxL"):
        parse_schedules("2-3")


def test_training_checkpoint_evaluations_go_under_the_training_run(tmp_path):
    from mimir_megatron.checkpoint import resolve_model_dir
    from mimir_megatron.evaluation.tracking import tracking_target

    ckpts = tmp_path / "runs" / "demo" / "checkpoints"
    (ckpts / "step_0000400").mkdir(parents=True)
    (ckpts / "latest").write_text("step_0000400\n")
    state = TrainerState(step=400, mlflow_run_id="abc123", model={"h_cycles": 2, "l_cycles": 3},
                         config={"run": {"name": "demo", "dir": ""},
                                 "tracking": {"uri": None, "experiment": "mimir-demo"}})
    write_trainer_state(ckpts / "step_0000400", state)
    model = resolve_model_dir(checkpoint=ckpts)
    target = tracking_target(tmp_path / "out", record=model.record)
    assert target.uri == f"sqlite:///{(tmp_path / 'runs' / 'demo' / 'mlflow.db').resolve()}"
    assert (target.experiment, target.parent_run_id, target.checkpoint_step) == ("mimir-demo", "abc123", 400)
    assert model.trained_schedule == (2, 3)
    other = tracking_target(tmp_path / "out", uri="sqlite:///x.db", record=model.record)
    assert other.parent_run_id is None and other.experiment == "mimir-eval"


def test_contamination_report_is_found_in_the_training_run(tmp_path):
    """`mimir eval --checkpoint` of a run finds RUN/contamination/<suite>.json; --contamination wins."""
    from mimir_megatron.checkpoint.model_dir import resolve_model_dir
    from mimir_megatron.evaluation.contamination import find_report

    ckpts = tmp_path / "runs" / "demo" / "checkpoints"
    (ckpts / "step_0000002").mkdir(parents=True)
    write_trainer_state(ckpts / "step_0000002", TrainerState(step=2, config={"run": {"name": "demo", "dir": ""}}))
    run_dir = resolve_model_dir(checkpoint=ckpts).run_directory
    assert find_report(None, "demo", run_dir) is None  # no report: nothing marked
    report = tmp_path / "runs" / "demo" / "contamination" / "demo.json"
    report.parent.mkdir()
    report.write_text('{"format": "mimir-contamination-v1", "suite": "demo", "benchmarks": {}}')
    assert find_report(None, "demo", run_dir).path == report
    assert find_report(None, "other", run_dir) is None
    assert find_report(str(report.parent), "demo").path == report
    with pytest.raises(UserError, match="contamination report not found"):
        find_report(str(tmp_path / "nowhere.json"), "demo", run_dir)


def test_type_mistakes_of_every_task_and_of_the_suite_are_each_one_line(tmp_path):
    """One rule for every configuration (yaml_config.read_yaml + typed_section + raise_errors): a wrong
    type in two tasks and in the suite are three lines, not the first one OmegaConf meets."""
    path = tmp_path / "types.yaml"
    path.write_text("seed: many\ntasks:\n"
                    "  - {name: a, format: generate, data: a.jsonl, shots: lots}\n"
                    "  - {name: b, format: generate, data: b.jsonl, shots: few, colour: red}\n")
    with pytest.raises(ConfigError) as err:
        load_suite(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"invalid suite {path}:"
    for fragment in ("suite.seed", "tasks[0] (a).shots", "tasks[1] (b).shots", "tasks[1] (b).colour is not a setting"):
        assert sum(fragment in line for line in lines) == 1, (fragment, lines)


def test_scores_split_into_clean_and_contaminated_items_only_where_the_report_checked_them(tmp_path):
    """Hand-counted: 4 items, right at ids 0 and 2, id 0 contaminated -> clean 1/3, contaminated
    1/1. A report limited to fewer items, or shuffled with another seed, cannot say which scored
    items are clean: no split."""
    import json

    from mimir_megatron.evaluation.contamination import FORMAT, ContaminationReport, data_sha256
    from mimir_megatron.evaluation.metrics import ItemOutcome
    from mimir_megatron.evaluation.tables import ScoreSplit, score_split
    from mimir_megatron.evaluation.runner import TaskResult
    from mimir_megatron.integrity import with_digest

    data = tmp_path / "bench.jsonl"
    data.write_text('{"q": 1}\n')
    spec = TaskSpec(name="bench", format="generate", data="bench.jsonl", metric="exact_match")
    task = TaskResult(spec, [ItemOutcome(str(i), "", ("x",), float(i in (0, 2))) for i in range(4)])

    def mark(limit, seed, items=4, listed=("0",)):
        path = tmp_path / f"report-{limit}-{seed}-{items}.json"
        bench = {"items": items, "contaminated": len(listed or ()), "longest_span": {"tokens": 20},
                 "data_sha256": data_sha256(data), "error": None}
        if listed is not None:
            bench["contaminated_items"] = list(listed)
        path.write_text(json.dumps(with_digest({"format": FORMAT, "suite": "s", "seed": seed, "limit": limit,
                                                "ngram": 13, "benchmarks": {"bench": bench}})))
        return ContaminationReport.read(path).mark("bench", data, seed=4242)

    assert score_split(task, mark(None, 1)) == ScoreSplit(pytest.approx(1 / 3), 3, 1.0, 1)
    assert score_split(task, mark(4, 4242)) == ScoreSplit(pytest.approx(1 / 3), 3, 1.0, 1)
    assert score_split(task, mark(None, 1, listed=())) == ScoreSplit(0.5, 4, None, 0)
    assert score_split(task, mark(3, 4242, items=3)) is None  # the fourth item was never checked
    assert score_split(task, mark(4, 7)) is None  # its first four are other items
    assert score_split(task, mark(None, 1, listed=None)) is None  # an older report: ids not listed
    assert score_split(task, None) is None


def test_a_sweep_marks_the_trained_schedule_of_every_model_form(tmp_path):
    """The schedule the weights were trained with comes from the model's directory whatever its
    form (a sweep over --weights marked none before); --trained-schedule wins; a server has none."""
    import argparse
    import json

    from mimir_megatron.entrypoints.evaluate import _model, _tokenizer_dir, _trained_schedule

    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.yaml").write_text(f"h_cycles: 3\nl_cycles: 4\ntokenizer: {tmp_path / 'tok'}\n")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "hrm_text", "H_cycles": 1, "L_cycles": 2}))
    (hf / "tokenizer.json").write_text("{}")

    def ask(fact, **given):  # a command's flags, its model resolved once, one fact asked of it
        base = dict(model=None, checkpoint=None, weights=None, hf=None, base_url=None, tokenizer=None, ema=False,
                    trained_schedule=None, api_key_file=None)
        args = argparse.Namespace(**{**base, **given})
        return fact(args, _model(args))

    assert ask(_trained_schedule, weights=str(weights)) == (3, 4)
    assert ask(_tokenizer_dir, weights=str(weights)) == str(tmp_path / "tok")  # what the server loads
    assert ask(_trained_schedule, hf=str(hf)) == (1, 2)
    assert ask(_tokenizer_dir, hf=str(hf)) == str(hf)
    assert ask(_trained_schedule, weights=str(weights), trained_schedule="2x3") == (2, 3)
    assert ask(_trained_schedule, base_url="http://127.0.0.1:1", tokenizer="t") is None
    assert ask(_tokenizer_dir, base_url="http://127.0.0.1:1", tokenizer="t") == "t"
