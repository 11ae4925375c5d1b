"""Generate-and-audit pipeline YAML: a typed schema, loading with overrides, one validation pass.

A pipeline names a source (JSONL/Parquet), the generator and auditor endpoints (any
OpenAI-compatible server), Jinja prompt templates, deterministic checks, a verdict parser and the
shape of the output conversation. Prompt files and ``output.messages[].content`` are Jinja
*templates*; every other templated value (check arguments, ``generate.initial_candidate``,
``output.messages_expr``) is a Jinja *expression* evaluated to a Python object over ``row``
(the source record), ``candidate`` (the parsed proposal) and friends.

Every mistake is reported in one :class:`ConfigError`, one line each, before any request is sent.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jinja2
from jinja2.sandbox import SandboxedEnvironment
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mimir_megatron.integrity import Fingerprint, fingerprint
from mimir_megatron.yaml_config import raise_errors, read_yaml

from .checks import CHECK_KINDS, check_errors
from .verdict import VERDICTS

PARSE_MODES = ("text", "json")
SOURCE_FORMATS = ("auto", "jsonl", "parquet")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class EndpointConfig:
    """One OpenAI-compatible chat endpoint (vLLM in production, `mimir serve` here)."""

    model: str = MISSING
    """Model name sent in each request (and recorded as evidence)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """Server root including `/v1`."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key; `EMPTY` is sent when it is unset."""
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    """Sampling seed sent to servers that honour it."""
    timeout_s: float = 120.0
    """Per-request timeout; a timeout is retried like a connection loss."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Extra request fields, e.g. `h_cycles` for `mimir serve`."""
    license: str | None = None
    """The model's terms (an SPDX expression). The generator's bind the accepted rows (their
    provenance sidecar's generator_license); unset, they are `unknown`, which the default data
    policy refuses to train on."""


@dataclass
class SourceConfig:
    path: str = MISSING
    """JSONL or Parquet file, relative to the pipeline YAML."""
    format: str = "auto"
    """`auto` (by extension), `jsonl` or `parquet`."""
    id_field: str | None = None
    """Field holding a stable row id; default: the 1-based line (row) number."""
    limit: int | None = None
    """Process only the first N rows."""


@dataclass
class GenerateConfig:
    prompt: str = MISSING
    """Jinja template file for the user turn (relative to the YAML)."""
    system: str | None = None
    """Optional Jinja template file for a system turn."""
    endpoint: str = "generator"
    """Name of an entry in `endpoints`."""
    parse: str = "text"
    """`text`: the candidate is {"text": reply}; `json`: the first JSON object in the reply."""
    required_fields: list[str] = field(default_factory=list)
    """Fields a parsed candidate must carry (non-empty)."""
    initial_candidate: dict[str, str] = field(default_factory=dict)
    """Field -> expression over `row`. When set, the source's own candidate is audited first and
    the generator is asked only when the auditor says `regenerate` (repair instead of filter)."""


@dataclass
class AuditConfig:
    prompt: str = MISSING
    system: str | None = None
    endpoint: str = "auditor"


@dataclass
class CheckConfig:
    """A deterministic check, run on every candidate before the auditor is asked."""

    kind: str = MISSING
    """One of checks.CHECK_KINDS: verbatim, not_contains, length, structure, json_equal."""
    name: str | None = None
    """Reason code recorded when it fails (default: the kind)."""
    on_fail: str = "regenerate"
    """`regenerate` (ask the generator again, the failure as feedback) or `discard`."""
    needle: str | None = None
    """verbatim / not_contains: expression for the text that must (not) occur."""
    haystack: str | None = None
    """verbatim / not_contains: expression for the text searched."""
    value: str | None = None
    """length: expression for the text measured."""
    min_chars: int = 0
    max_chars: int | None = None
    source: str | None = None
    """structure / json_equal: expression for the original (messages list or value)."""
    target: str | None = None
    """structure / json_equal: expression for the candidate's version."""
    preserve: list[str] = field(default_factory=lambda: ["roles", "code_blocks", "inline_code",
                                                           "math", "structured", "labels"])
    """structure: which parts must come back unchanged (see checks.STRUCTURE_PARTS)."""
    patterns: list[str] = field(default_factory=list)
    """structure: extra regular expressions whose matches must come back unchanged, in order."""
    normalize_whitespace: bool = False
    """verbatim / not_contains: compare with runs of whitespace collapsed."""
    case_sensitive: bool = True


@dataclass
class VerdictConfig:
    """How the auditor's reply becomes accept / regenerate / discard with reasons."""

    verdict_key: str = "verdict"
    """JSON field holding the verdict."""
    reasons_key: str = "reasons"
    """JSON field holding a reason string or a list of strings / {"code", "detail"} objects."""
    aliases: dict[str, str] = field(default_factory=lambda: {
        "keep": "accept", "accepted": "accept", "pass": "accept",
        "repair": "regenerate", "retry": "regenerate", "reject": "discard", "drop": "discard"})
    """Other words an auditor may use, mapped onto the three verdicts."""
    on_unparseable: str = "discard"
    """Verdict when the reply holds no usable verdict: `discard` or `regenerate`."""
    reason_codes: list[str] = field(default_factory=list)
    """When set, reasons outside this list are counted as `other` in the report."""


@dataclass
class MessageTemplate:
    role: str = MISSING
    content: str = MISSING
    """Jinja template over row, candidate."""


@dataclass
class OutputConfig:
    """The accepted row as a chat record that `mimir prepare` reads."""

    messages: list[MessageTemplate] = field(default_factory=list)
    """Messages built from templates (use this or `messages_expr`)."""
    messages_expr: str | None = None
    """Expression evaluating to the whole message list."""
    tools_expr: str | None = None
    """Expression for the `tools` list, if any."""
    dir: str | None = None
    """Output/state directory (relative to the YAML); `--output` overrides it."""
    form: str = "synthetic-audited"
    """How the accepted data enters the corpus (Table 6; recorded in its provenance sidecar):
    synthetic-audited, translated-audited, derived-task, ..."""


@dataclass
class RetryConfig:
    """Backoff for 429, 5xx, timeouts and connection loss (other errors are not retried)."""

    max_retries: int = 12
    """Retries of one request before the run stops (rerun to resume); ~3.5 min with the defaults."""
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str | None = None
    """MLflow tracking URI; default: sqlite in the output directory."""
    experiment: str = "mimir-synth"


@dataclass
class PipelineConfig:
    name: str = MISSING
    description: str = ""
    source: SourceConfig = field(default_factory=SourceConfig)
    endpoints: dict[str, EndpointConfig] = field(default_factory=dict)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    checks: list[CheckConfig] = field(default_factory=list)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    max_generations: int = 3
    """Generator calls per row before it is discarded as `attempts_exhausted`."""
    concurrency: int = 8
    """Rows in flight at once."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Fields that change how a run talks to its servers, not what it produces: free to change on resume.
OPERATIONAL_FIELDS = {"concurrency", "retry", "tracking", "description"}
OPERATIONAL_ENDPOINT_FIELDS = {"base_url", "api_key_env", "timeout_s"}


@dataclass
class Pipeline:
    """A validated pipeline with its templates and expressions compiled."""

    config: PipelineConfig
    path: Path
    templates: dict[str, jinja2.Template]
    expressions: dict[str, Callable[..., Any]]
    template_texts: dict[str, str]

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    @property
    def source_path(self) -> Path:
        return resolve(self.base_dir, self.config.source.path)

    def render(self, name: str, **context: Any) -> str:
        return self.templates[name].render(**context)

    def evaluate(self, name: str, **context: Any) -> Any:
        return self.expressions[name](**context)

    def fingerprint(self) -> Fingerprint:
        """sha256 over everything that decides a row's result (prompts included)."""
        tree = self.config.to_dict()
        for key in OPERATIONAL_FIELDS:
            tree.pop(key, None)
        for ep in tree["endpoints"].values():
            for key in OPERATIONAL_ENDPOINT_FIELDS:
                ep.pop(key, None)
        tree["output"].pop("dir", None)
        tree["source"].pop("path", None)
        tree["source"].pop("limit", None)
        tree["template_texts"] = self.template_texts
        return fingerprint(tree)


def resolve(base: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def _environment(base: Path) -> SandboxedEnvironment:
    # Sandboxed: a pipeline YAML is data; its templates must not reach Python internals.
    return SandboxedEnvironment(
        loader=jinja2.FileSystemLoader(str(base)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=False,
        autoescape=False,
    )


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=None)


def _unknown_keys(tree: Any, schema: type, where: str) -> list[str]:
    """Every key of ``tree`` that ``schema`` (a dataclass, recursively) does not know; each is
    removed from ``tree`` so that the remaining settings can still be checked."""
    if not isinstance(tree, dict):
        return []
    known = {f.name: f for f in fields(schema)}
    errs = []
    for key, value in list(tree.items()):
        if key not in known:
            errs.append(f"{where}{key}: unknown setting; known: {', '.join(sorted(known))}")
            del tree[key]
            continue
        sub = _nested_schema(schema, key)
        if sub is None:
            continue
        if key == "endpoints" and isinstance(value, dict):
            for name, ep in value.items():
                errs += _unknown_keys(ep, EndpointConfig, f"{where}endpoints.{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                errs += _unknown_keys(item, sub, f"{where}{key}[{i}].")
        else:
            errs += _unknown_keys(value, sub, f"{where}{key}.")
    return errs


_NESTED = {
    (PipelineConfig, "source"): SourceConfig, (PipelineConfig, "generate"): GenerateConfig,
    (PipelineConfig, "audit"): AuditConfig, (PipelineConfig, "checks"): CheckConfig,
    (PipelineConfig, "verdict"): VerdictConfig, (PipelineConfig, "output"): OutputConfig,
    (PipelineConfig, "retry"): RetryConfig, (PipelineConfig, "tracking"): TrackingConfig,
    (PipelineConfig, "endpoints"): EndpointConfig, (OutputConfig, "messages"): MessageTemplate,
}


def _nested_schema(schema: type, key: str) -> type | None:
    return _NESTED.get((schema, key))


def _typed(tree: dict[str, Any]) -> tuple[PipelineConfig | None, list[str]]:
    """Merge onto the schema section by section so that each section's type error is reported."""
    errs: list[str] = []
    base = OmegaConf.structured(PipelineConfig)
    for key, value in tree.items():
        try:
            base = OmegaConf.merge(base, OmegaConf.create({key: value}))
        except OmegaConfBaseException as exc:
            full = getattr(exc, "full_key", None) or key
            errs.append(f"{full}: {str(exc).splitlines()[0]}")
    if errs:
        return None, errs
    try:
        return OmegaConf.to_object(base), []
    except OmegaConfBaseException as exc:  # a required (???) value left unset
        full = getattr(exc, "full_key", None)
        return None, [f"{full or '?'}: {str(exc).splitlines()[0]}"]


def _missing(tree: dict[str, Any]) -> list[str]:
    """Required values (MISSING in the schema) that the YAML does not give, all of them."""
    errs = []
    if not tree.get("name"):
        errs.append("name: required (the pipeline's name, used in reports and MLflow)")
    src = tree.get("source") or {}
    if not isinstance(src, dict) or not src.get("path"):
        errs.append("source.path: required (a JSONL or Parquet file)")
    for section in ("generate", "audit"):
        sec = tree.get(section) or {}
        if not isinstance(sec, dict) or not sec.get("prompt"):
            errs.append(f"{section}.prompt: required (a Jinja template file)")
    for name, ep in (tree.get("endpoints") or {}).items():
        if isinstance(ep, dict) and not ep.get("model"):
            errs.append(f"endpoints.{name}.model: required")
    for i, check in enumerate(tree.get("checks") or []):
        if isinstance(check, dict) and not check.get("kind"):
            errs.append(f"checks[{i}].kind: required, one of {', '.join(CHECK_KINDS)}")
    for i, msg in enumerate((tree.get("output") or {}).get("messages") or []):
        for key in ("role", "content"):
            if isinstance(msg, dict) and msg.get(key) in (None, ""):
                errs.append(f"output.messages[{i}].{key}: required")
    return errs


def _value_errors(cfg: PipelineConfig) -> list[str]:
    errs: list[str] = []
    if cfg.source.format not in SOURCE_FORMATS:
        errs.append(f"source.format must be one of {', '.join(SOURCE_FORMATS)}, got {cfg.source.format!r}")
    if cfg.source.limit is not None and cfg.source.limit < 1:
        errs.append(f"source.limit must be >= 1, got {cfg.source.limit}")
    for section, stage in (("generate", cfg.generate), ("audit", cfg.audit)):
        if stage.endpoint not in cfg.endpoints:
            errs.append(f"{section}.endpoint: {stage.endpoint!r} is not in endpoints "
                        f"({', '.join(cfg.endpoints) or 'none defined'})")
    for name, ep in cfg.endpoints.items():
        if not ep.base_url.startswith(("http://", "https://")):
            errs.append(f"endpoints.{name}.base_url must start with http:// or https://, got {ep.base_url!r}")
        if ep.max_tokens < 1:
            errs.append(f"endpoints.{name}.max_tokens must be >= 1, got {ep.max_tokens}")
        if ep.temperature < 0:
            errs.append(f"endpoints.{name}.temperature must be >= 0, got {ep.temperature}")
        if not 0 < ep.top_p <= 1:
            errs.append(f"endpoints.{name}.top_p must be in (0, 1], got {ep.top_p}")
        if ep.timeout_s <= 0:
            errs.append(f"endpoints.{name}.timeout_s must be > 0, got {ep.timeout_s}")
        if ep.license:
            from mimir_megatron.data.licences import normalise_license

            problem = normalise_license(ep.license)[1]
            if problem:
                errs.append(f"endpoints.{name}.license: {problem}")
    if cfg.generate.parse not in PARSE_MODES:
        errs.append(f"generate.parse must be one of {', '.join(PARSE_MODES)}, got {cfg.generate.parse!r}")
    if cfg.generate.parse == "text" and set(cfg.generate.required_fields) - {"text"}:
        errs.append("generate.required_fields other than 'text' need generate.parse: json")
    for i, check in enumerate(cfg.checks):
        errs += [f"checks[{i}]{msg}" for msg in check_errors(check)]
    v = cfg.verdict
    if v.on_unparseable not in ("discard", "regenerate"):
        errs.append(f"verdict.on_unparseable must be discard or regenerate, got {v.on_unparseable!r}")
    for word, target in v.aliases.items():
        if target not in VERDICTS:
            errs.append(f"verdict.aliases.{word} must map to one of {', '.join(VERDICTS)}, got {target!r}")
    out = cfg.output
    if bool(out.messages) == bool(out.messages_expr):
        errs.append("output: give exactly one of output.messages (templates) or output.messages_expr")
    for i, msg in enumerate(out.messages):
        if msg.role not in ROLES:
            errs.append(f"output.messages[{i}].role must be one of {', '.join(ROLES)}, got {msg.role!r}")
    from mimir_megatron.data.provenance import FORMS

    if out.form not in FORMS:
        errs.append(f"output.form must be one of {', '.join(FORMS)}, got {out.form!r}")
    if out.messages and out.messages[-1].role != "assistant":
        errs.append("output.messages: the last message must have role assistant (it is trained on)")
    if cfg.max_generations < 1:
        errs.append(f"max_generations must be >= 1, got {cfg.max_generations}")
    if cfg.concurrency < 1:
        errs.append(f"concurrency must be >= 1, got {cfg.concurrency}")
    r = cfg.retry
    if r.max_retries < 0:
        errs.append(f"retry.max_retries must be >= 0, got {r.max_retries}")
    if r.initial_backoff_s <= 0 or r.max_backoff_s < r.initial_backoff_s:
        errs.append(f"retry: need 0 < initial_backoff_s <= max_backoff_s, got {r.initial_backoff_s} "
                    f"and {r.max_backoff_s}")
    return errs


def _compile(cfg: PipelineConfig, base: Path) -> tuple[dict, dict, dict, list[str]]:
    """Compile every template and expression; each syntax error or missing file is one line."""
    env = _environment(base)
    env.filters["tojson"] = _tojson
    templates: dict[str, jinja2.Template] = {}
    texts: dict[str, str] = {}
    expressions: dict[str, Callable[..., Any]] = {}
    errs: list[str] = []
    files = {"generate.prompt": cfg.generate.prompt, "generate.system": cfg.generate.system,
             "audit.prompt": cfg.audit.prompt, "audit.system": cfg.audit.system}
    for key, rel in files.items():
        if rel is None:
            continue
        path = resolve(base, rel)
        if not path.is_file():
            errs.append(f"{key}: template file not found: {path}")
            continue
        text = path.read_text(encoding="utf-8")
        try:
            templates[key] = env.from_string(text)
            texts[key] = text
        except jinja2.TemplateSyntaxError as exc:
            errs.append(f"{key}: {path}:{exc.lineno}: {exc.message}")
    for i, msg in enumerate(cfg.output.messages):
        key = f"output.messages[{i}].content"
        try:
            templates[key] = env.from_string(msg.content)
        except jinja2.TemplateSyntaxError as exc:
            errs.append(f"{key}: {exc.message}")
    exprs: dict[str, str | None] = {"output.messages_expr": cfg.output.messages_expr,
                                    "output.tools_expr": cfg.output.tools_expr}
    exprs |= {f"generate.initial_candidate.{k}": v for k, v in cfg.generate.initial_candidate.items()}
    for i, check in enumerate(cfg.checks):
        for arg in ("needle", "haystack", "value", "source", "target"):
            exprs[f"checks[{i}].{arg}"] = getattr(check, arg)
    for key, text in exprs.items():
        if text is None:
            continue
        if "{{" in text or "{%" in text:
            errs.append(f"{key}: an expression, not a template: write `row.text`, not `{{{{ row.text }}}}`")
            continue
        try:
            expressions[key] = env.compile_expression(text, undefined_to_none=False)
        except jinja2.TemplateSyntaxError as exc:
            errs.append(f"{key}: {text!r}: {exc.message}")
    return templates, expressions, texts, errs


def load_pipeline(path: str | Path, overrides: Sequence[str] = ()) -> Pipeline:
    """Load a pipeline YAML plus ``key=value`` overrides, validate everything, compile templates."""
    path = Path(path)
    tree = read_yaml(path, "settings (name, source, endpoints, generate, audit, ...)", overrides,
                     kind="pipeline file")
    errs = _unknown_keys(tree, PipelineConfig, "")
    missing = _missing(tree)
    errs += missing
    cfg = None
    if not missing:
        cfg, type_errs = _typed(tree)
        errs += type_errs
    if cfg is not None:
        errs += _value_errors(cfg)
        templates, expressions, texts, compile_errs = _compile(cfg, path.parent)
        errs += compile_errs
        src = resolve(path.parent, cfg.source.path)
        if not src.is_file():
            errs.append(f"source.path: file not found: {src}")
    raise_errors(errs, f"invalid pipeline {path}")
    assert cfg is not None and is_dataclass(cfg)
    return Pipeline(cfg, path.resolve(), templates, expressions, texts)
