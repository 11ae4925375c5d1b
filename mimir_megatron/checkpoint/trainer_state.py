"""The trainer state of a checkpoint (``trainer_state.json``): one typed record, one reader, one writer.

Everything a checkpoint says about the run beside its tensors: where training stands, what the
weights' shape is, which data went in (the lineage), the MLflow run. The trainer fills it
(:mod:`mimir_megatron.train.loop`); resume, ``init_from``, export, evaluation and audits read it
through :func:`read_trainer_state`. ``config`` is the run's whole configuration as the trainer
recorded it: the trainer's business (resume compares it); this package never interprets it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import digest_matches, with_digest, write_json_atomic

STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class DatasetLineage:
    """One dataset of the mixture a checkpoint was trained on, and how much of it went in."""

    name: str
    """The dataset's name in the mixture."""
    path: str
    """Its prepared directory when the checkpoint was written."""
    category: str
    language: str
    audit_group: str
    provenance: dict[str, Any]
    """The dataset's provenance record as its manifest declared it (``{"status": "unknown"}``
    where it declared none); see :mod:`mimir_megatron.data.provenance`."""
    provenance_digest: str | None
    """sha256 of the declared record; None where it is unknown."""
    documents: int = 0
    """Documents of this dataset in the samples consumed so far (a repeated document counts
    each time it is trained on)."""
    tokens: int = 0
    """Their tokens (prefix + response, as the manifest counts them)."""
    response_tokens: int = 0
    """The supervised part of ``tokens``."""
    manifest_digest: str | None = None
    """The digest the dataset's manifest carried when the run trained on it: export and reports
    name a dataset whose manifest changed since (None in checkpoints written before it was)."""
    personal_data: dict[str, Any] | None = None
    """The manifest's personal-data screen (policy, identifiers found by kind, documents
    rejected); None where the dataset was not screened or the checkpoint predates the record."""


@dataclass(frozen=True)
class BaseModel:
    """The weights a run started from (``checkpoint.init_from``), and what they were trained on."""

    source: str
    """The checkpoint or project-weights directory."""
    step: int | None = None
    mlflow_run_id: str | None = None
    lineage: tuple[DatasetLineage, ...] | None = None
    """The source checkpoint's lineage; None where the weights carry none (imported weights)."""
    base_model: "BaseModel | None" = None
    """What those weights started from in turn."""


@dataclass(frozen=True)
class FileDigest:
    """A file of a checkpoint as its writer wrote it (see :mod:`.digests`)."""

    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainerState:
    step: int
    """Optimizer steps done."""
    consumed_samples: int = 0
    """Global packed samples consumed by those steps (all ranks)."""
    window_k: int | None = None
    """Backprop window of the last step done (None before the first)."""
    optimizer_group_steps: dict[str, int] = field(default_factory=dict)
    """Adam's step per optimizer group (equal within a group)."""
    data_fingerprint: str = ""
    """Digest of what decides the sample stream (see ``mimir_megatron.data.mixture_fingerprint``)."""
    model: dict[str, Any] = field(default_factory=dict)
    """The model's shape record (``ModelConfig.shape_dict``)."""
    padded_vocab_size: int | None = None
    has_ema: bool = False
    """Whether the checkpoint holds EMA weights."""
    mlflow_run_id: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    """The run's configuration as the trainer recorded it."""
    lineage: tuple[DatasetLineage, ...] = ()
    """Per dataset of the mixture: provenance and what was consumed up to ``step``."""
    base_model: BaseModel | None = None
    """Where the weights came from when the run started from others (``init_from``)."""
    data_policy: dict[str, Any] | None = None
    """The data policy the mixture was checked against before training."""
    format: int | None = None
    """Layout version of the sharded state (set by the writer; see ``layout.FORMAT``)."""
    written_at: float = 0.0
    """When the checkpoint became complete (set by the writer)."""
    files: dict[str, FileDigest] = field(default_factory=dict)
    """Size and sha256 of every other file of the checkpoint (set by the writer; empty in
    checkpoints written before digests were recorded). ``trainer_state.json`` itself carries the
    digest of its own content (``digest``, checked by :func:`read_trainer_state`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def recorded_run(self) -> RecordedRun:
        """What the run's recorded configuration says about where the run lives (typed; a
        missing or mistyped entry reads as unset)."""
        def section(name: str) -> dict[str, Any]:
            value = self.config.get(name) if isinstance(self.config, dict) else None
            return value if isinstance(value, dict) else {}

        def text(values: dict[str, Any], key: str) -> str | None:
            value = values.get(key)
            return value if isinstance(value, str) and value else None

        run, tracking = section("run"), section("tracking")
        return RecordedRun(dir=text(run, "dir"), name=text(run, "name") or "",
                           tracking_uri=text(tracking, "uri"), experiment=text(tracking, "experiment"))


@dataclass(frozen=True)
class RecordedRun:
    """The run's directory and MLflow settings as its trainer state's configuration records them."""

    dir: str | None
    """``run.dir`` (None: the default ``runs/<name>``)."""
    name: str
    tracking_uri: str | None
    """``tracking.uri`` (None: the run directory's sqlite store)."""
    experiment: str | None


_REQUIRED = {"step"}


def trainer_state_from_dict(data: Any, source: str | Path) -> TrainerState:
    """The typed state of a decoded ``trainer_state.json``; a :class:`UserError` naming ``source``
    and the fields at fault otherwise. Fields this version does not know are ignored (a newer
    writer's additions); missing optional fields take their defaults (an older writer)."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: not a trainer state (expected a JSON object)")
    missing = sorted(_REQUIRED - set(data))
    if missing:
        raise UserError(f"{source}: trainer state lacks {', '.join(missing)}")
    known = {f.name for f in fields(TrainerState)}
    values = {k: v for k, v in data.items() if k in known}
    if "has_ema" not in data:  # written before has_ema was recorded: the run's config says
        values["has_ema"] = data.get("config", {}).get("optim", {}).get("ema_decay", 0) != 0
    try:
        lineage = _lineage(values.pop("lineage", ()))
        base = _base_model(values.pop("base_model", None))
        files = {name: FileDigest(**entry) for name, entry in values.pop("files", {}).items()}
        state = TrainerState(**values, lineage=lineage or (), base_model=base, files=files)
    except (TypeError, AttributeError) as exc:
        raise UserError(f"{source}: invalid trainer state ({exc})") from None
    if not isinstance(state.step, int) or state.step < 0:
        raise UserError(f"{source}: step must be a non-negative integer, got {state.step!r}")
    return state


def _lineage(entries: Any) -> tuple[DatasetLineage, ...] | None:
    return None if entries is None else tuple(DatasetLineage(**entry) for entry in entries)


def _base_model(data: Any) -> BaseModel | None:
    if data is None:
        return None
    return BaseModel(**{**data, "lineage": _lineage(data.get("lineage")),
                        "base_model": _base_model(data.get("base_model"))})


def read_trainer_state(path: str | Path) -> TrainerState:
    """The trainer state of the checkpoint ``path`` (a ``step_N`` directory); one-line
    :class:`UserError` naming the file when it is missing, unreadable, damaged (its content no
    longer matches its digest) or not a trainer state."""
    state_file = Path(path) / STATE_FILE
    if not state_file.is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    try:
        data = json.loads(state_file.read_text())
    except OSError as exc:
        raise UserError(f"{state_file}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{state_file}: damaged trainer state ({exc})") from None
    # Digests written before the canonical encoding (ASCII-escaped) still match
    # (integrity.digest_matches).
    if isinstance(data, dict) and "digest" in data and not digest_matches(data):
        raise UserError(f"{state_file}: damaged trainer state (its content does not match its digest)")
    if isinstance(data, dict) and "digest" not in data and _written_with_digests(data):
        raise UserError(f"{state_file}: damaged trainer state (its digest was deleted: the version of mimir "
                        "that wrote it records one); its lineage cannot be trusted")
    return trainer_state_from_dict(data, state_file)


def _written_with_digests(data: dict[str, Any]) -> bool:
    """Whether a state was written by a version that records its digest: those also record its
    files' digests (``files``) and the manifests' digests in its lineage. Only a state with none
    of them was written before digests, and reads as it is (there is nothing to verify)."""
    lineages = [data.get("lineage")]
    base = data.get("base_model")
    while isinstance(base, dict):
        lineages.append(base.get("lineage"))
        base = base.get("base_model")
    pinned = any(isinstance(e, dict) and "manifest_digest" in e
                 for lineage in lineages if isinstance(lineage, list) for e in lineage)
    return "files" in data or pinned


def write_trainer_state(path: str | Path, state: TrainerState) -> None:
    """Write ``trainer_state.json`` with the digest of its content."""
    write_json_atomic(Path(path) / STATE_FILE, with_digest(state.to_dict()), sort_keys=True)
