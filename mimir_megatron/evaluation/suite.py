"""Evaluation suites: a YAML list of tasks, typed and validated once, every mistake on its own line.

A task names its format, its local data file(s) in the benchmark's original column layout, which
columns play which role, the number of shots and the metric. See ``configs/eval/*.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mimir_megatron.yaml_config import raise_errors, read_yaml, typed_section
from mimir_megatron.errors import ConfigError

FORMATS = ("multiple_choice", "generate", "ifeval", "humaneval")
METRICS = {
    "multiple_choice": ("accuracy", "macro_f1"),
    "generate": ("accuracy", "exact_match", "f1", "macro_f1", "rouge1", "chrf"),
    "ifeval": ("ifeval",),
    "humaneval": ("pass_at_1",),
}
ANSWER_KINDS = ("index", "index1", "letter", "label", "value", "bool")
EXTRACTORS = ("none", "gsm8k", "boxed", "first_line", "letter")
MC_SCORING = ("generate", "loglik")
ROLES = {
    "multiple_choice": {"required": ("answer",), "optional": ("choices", "labels")},
    "generate": {"required": ("target",), "optional": ()},
    "ifeval": {"required": ("instructions", "kwargs"), "optional": ()},
    "humaneval": {"required": ("test", "entry_point"), "optional": ()},
}
BINARY_METRICS = ("accuracy", "exact_match", "macro_f1", "ifeval", "pass_at_1")
"""Metrics whose per-item outcome is right/wrong (usable in a McNemar test)."""


@dataclass
class TaskSpec:
    """One benchmark: where its rows are, how a row becomes a prompt, how an answer is scored."""

    name: str = ""
    """Short name used in tables and as the MLflow metric key (e.g. `arc_challenge`)."""
    title: str = ""
    """Column header in tables (default: the name)."""
    category: str = "Other"
    """Table group whose average is reported (`English`, `Math & Code`, `Danish`, ...)."""
    format: str = "generate"
    """`multiple_choice` (single letter), `generate` (free answer), `ifeval`, `humaneval`."""
    data: str = ""
    """Test rows: a JSONL or Parquet file or a `datasets` save_to_disk directory, under the data dir."""
    split: str = ""
    """Split to read when `data` is a save_to_disk DatasetDict."""
    fewshot_split: str = ""
    """Split of `fewshot_data` to read when it is a save_to_disk DatasetDict."""
    fewshot_data: str = ""
    """Rows the shots are drawn from (a train/dev split), same layout as `data`."""
    shots: int = 0
    """Few-shot examples, given as earlier user/assistant turns (0 for every Danish task)."""
    prompt: str = "{question}"
    """The user message: a Python format string over the row (`{passage}`, `{choices.text}`, ...)."""
    instruction: str = ""
    """Line appended after the prompt (multiple choice default: answer with the letter only)."""
    columns: dict[str, Any] = field(default_factory=dict)
    """Role -> column path (dotted for nested fields). multiple_choice: `choices` (a list column or
    a list of columns), `answer`, optional `labels` (ARC's choices.label); generate: `target` (one
    reference or a list); ifeval: `instructions`, `kwargs`; humaneval: `test`, `entry_point`."""
    choice_values: list[str] = field(default_factory=list)
    """Fixed options when the row holds none (BoolQ's yes/no, Angry Tweets' labels)."""
    answer_kind: str = "index"
    """How the answer column names the right option: `index` (0-based), `index1`, `letter`,
    `label` (matches `labels`), `value` (equals the option text), `bool` (True -> first option)."""
    metric: str = "accuracy"
    """See METRICS per format."""
    answer_extract: str = "none"
    """How the final answer is read from a generation: none, gsm8k (last number), boxed, first_line."""
    target_extract: str = "none"
    """How the reference is read from its column (GSM8K `#### 42`, MATH `\\boxed{}`)."""
    max_tokens: int = 0
    """Generation budget (0: 8 for multiple choice, 256 otherwise)."""
    mc_scoring: str = ""
    """`generate` (read the letter from greedy output) or `loglik` (highest log-prob of the
    letter via /v1/score); empty: the suite's default."""
    filter: dict[str, Any] = field(default_factory=dict)
    """Keep only rows whose columns equal these values (e.g. the demo's `group: arith`)."""
    collapse_below: float = -1.0
    """Score under which a Table 5 cell is marked collapsed (default: chance for multiple choice,
    0.02 otherwise)."""

    @property
    def header(self) -> str:
        return self.title or self.name

    @property
    def generation_tokens(self) -> int:
        return self.max_tokens or (8 if self.format == "multiple_choice" else 256)

    @property
    def binary(self) -> bool:
        return self.metric in BINARY_METRICS

    def errors(self) -> list[str]:
        where = f"task {self.name or '?'}"
        errs = []
        if not self.name:
            errs.append("a task has no name")
        if self.format not in FORMATS:
            errs.append(f"{where}: format {self.format!r} is not one of {', '.join(FORMATS)}")
            return errs
        if self.metric not in METRICS[self.format]:
            errs.append(f"{where}: metric {self.metric!r} does not fit format {self.format} "
                        f"(one of {', '.join(METRICS[self.format])})")
        if not self.data:
            errs.append(f"{where}: `data` (the test rows' file) is missing")
        if self.shots < 0:
            errs.append(f"{where}: shots must be >= 0")
        if self.shots and not self.fewshot_data:
            errs.append(f"{where}: {self.shots} shots need `fewshot_data`")
        roles = ROLES[self.format]
        for role in roles["required"]:
            if role not in self.columns:
                errs.append(f"{where}: columns.{role} is required for format {self.format}")
        for role in self.columns:
            if role not in roles["required"] + roles["optional"]:
                errs.append(f"{where}: columns.{role} is not a role of format {self.format}")
        if self.format == "multiple_choice":
            if ("choices" in self.columns) == bool(self.choice_values):
                errs.append(f"{where}: give either columns.choices or choice_values")
            if self.answer_kind not in ANSWER_KINDS:
                errs.append(f"{where}: answer_kind {self.answer_kind!r} is not one of "
                            f"{', '.join(ANSWER_KINDS)}")
            if self.answer_kind == "label" and "labels" not in self.columns:
                errs.append(f"{where}: answer_kind label needs columns.labels")
        if self.mc_scoring and self.mc_scoring not in MC_SCORING:
            errs.append(f"{where}: mc_scoring {self.mc_scoring!r} is not one of {', '.join(MC_SCORING)}")
        for key in ("answer_extract", "target_extract"):
            if getattr(self, key) not in EXTRACTORS:
                errs.append(f"{where}: {key} {getattr(self, key)!r} is not one of {', '.join(EXTRACTORS)}")
        if self.max_tokens < 0:
            errs.append(f"{where}: max_tokens must be >= 0")
        return errs


@dataclass
class SuiteSpec:
    name: str = ""
    """Suite name (MLflow run name, table title)."""
    seed: int = 4242
    """Shuffle seed of every task's rows and shots (the paper's 4242)."""
    data_dir: str = "data/eval"
    """Default directory the tasks' files are relative to (`--data-dir` overrides it)."""
    mc_scoring: str = "generate"
    """Default scoring of multiple-choice tasks: `generate` or `loglik`."""
    mcnemar: list[list[str]] = field(default_factory=list)
    """Pairs of schedules (e.g. [2x3, 1x3]) compared by `mimir sweep` with McNemar's test."""
    tasks: list[TaskSpec] = field(default_factory=list)
    source: str = ""

    def errors(self) -> list[str]:
        errs = [] if self.tasks else [f"suite {self.name or self.source}: no tasks"]
        if self.mc_scoring not in MC_SCORING:
            errs.append(f"mc_scoring {self.mc_scoring!r} is not one of {', '.join(MC_SCORING)}")
        names = [t.name for t in self.tasks]
        errs += [f"task name {n!r} appears twice" for n in sorted({n for n in names if names.count(n) > 1})]
        for pair in self.mcnemar:
            if len(pair) != 2:
                errs.append(f"mcnemar entry {pair} must name two schedules")
        for task in self.tasks:
            errs += task.errors()
        return errs

    def scoring_of(self, task: TaskSpec) -> str:
        return task.mc_scoring or self.mc_scoring

    def select(self, names: list[str]) -> SuiteSpec:
        """The suite restricted to the named tasks (in the suite's order)."""
        unknown = sorted(set(names) - {t.name for t in self.tasks})
        if unknown:
            raise ConfigError(f"suite {self.name}: no task named {', '.join(unknown)}")
        return SuiteSpec(self.name, self.seed, self.data_dir, self.mc_scoring, self.mcnemar,
                         [t for t in self.tasks if t.name in names], self.source)


def _raw_task(entry: Any, defaults: Any, base: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """A task entry with the suite's `defaults` below it and, for `from: other.yaml`, the named
    task of that suite below both."""
    entry = OmegaConf.create(entry)
    source = entry.pop("from", None)
    if source is None:
        return OmegaConf.to_container(OmegaConf.merge(defaults, entry))
    path = (base / source).resolve()
    if path in seen or not path.is_file():
        raise ConfigError(f"task {entry.get('name')}: cannot take it from {path}"
                          + (" (circular)" if path in seen else " (no such file)"))
    other = read_yaml(path, "suite settings", kind="suite file")
    other_defaults = other.get("defaults") or {}
    for task in other.get("tasks") or []:
        if isinstance(task, dict) and task.get("name") == entry.get("name"):
            below = _raw_task(task, other_defaults, path.parent, (*seen, path))
            return OmegaConf.to_container(OmegaConf.merge(below, entry))
    raise ConfigError(f"task {entry.get('name')}: {path} has no task of that name")


def load_suite(path: str | Path, overrides: list[str] | None = None) -> SuiteSpec:
    """Read and validate a suite YAML; raises ConfigError listing every mistake of the suite and
    of every task, one line each."""
    path = Path(path)
    raw = read_yaml(path, "suite settings", overrides or (), kind="suite file")
    tasks, defaults = raw.pop("tasks", None) or [], raw.pop("defaults", None) or {}
    errors: list[str] = []
    if not isinstance(tasks, list):
        errors.append(f"tasks must be a list of tasks, got {tasks!r}")
        tasks = []
    if not isinstance(defaults, dict):
        errors.append(f"defaults must be a mapping of task settings, got {defaults!r}")
        defaults = {}
    suite = typed_section(SuiteSpec, raw, "suite", errors)
    for i, entry in enumerate(tasks):
        if not isinstance(entry, dict):
            errors.append(f"tasks[{i}] must be a mapping of task settings, got {entry!r}")
            continue
        try:
            merged = _raw_task(entry, defaults, path.parent, (path.resolve(),))
        except ConfigError as exc:
            errors.append(str(exc))
            continue
        except OmegaConfBaseException as exc:
            errors.append(f"tasks[{i}]: {str(exc).splitlines()[0]}")
            continue
        suite.tasks.append(typed_section(TaskSpec, merged, f"tasks[{i}] ({entry.get('name', '?')})", errors))
    suite.source = str(path)
    suite.name = suite.name or path.stem
    errors += suite.errors()
    raise_errors(errors, f"invalid suite {path}")
    return suite
