"""The plan as a file (``mimir plan --json``, MLflow's ``plan.json``): one record, one reader, one
writer.

The record is :func:`.table.to_dict`'s layout with ``format`` and the digest of its content
(:mod:`mimir_megatron.integrity`); :class:`PlanRecord` names what a tool compares (the cluster,
the run's size, each layout's fit, step time, throughput and cost) and keeps the rest in
:attr:`PlanRecord.content`. A file whose content no longer matches its digest is refused as
edited. A file written before ``format`` or the digest was recorded holds the same fields and
reads as today's (:func:`_migrated`); another version is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import (
    DIGEST_KEY,
    RecordFields,
    read_json_object,
    refuse_if_edited,
    with_digest,
    write_json_atomic,
)

if TYPE_CHECKING:
    from .layouts import RunPlan

FORMAT = "mimir-plan-v2"
DIGESTLESS_FORMAT = "mimir-plan-v1"
"""The format before v2: its plans may lack a digest (written before plans carried one)."""


@dataclass(frozen=True)
class LayoutSummary:
    """One layout of the plan (TP, DP, micro-batch, recompute) and what it costs."""

    tp: int
    dp: int
    micro_batch: int
    recompute: str
    fits: bool
    step_time_s: float
    """At the final window."""
    tokens_per_s: float
    days: float
    gpu_hours: float


@dataclass(frozen=True)
class PlanRecord:
    config: str
    gpus: int
    nodes: int
    seq_len: int
    global_batch: int
    steps: int
    tokens: int
    efficiency: float
    configured: LayoutSummary
    layouts: tuple[LayoutSummary, ...]
    """The fitting layouts, fastest first (as many as were asked for)."""
    content: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    """The whole record as stored (memory terms, phases, the GPU's specification, ...), without its
    digest (checked when read, computed again when written)."""

    @classmethod
    def of(cls, plan: RunPlan, top: int = 10, stages: list[RunPlan] | None = None) -> PlanRecord:
        from .table import to_dict

        return cls.from_dict(to_dict(plan, top, stages))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], path: str | Path = "plan") -> PlanRecord:
        """The record of a plan's dict; a one-line :class:`UserError` naming ``path`` and the field,
        or saying that its content was edited after its digest was computed."""
        body = _migrated(dict(values), path)
        refuse_if_edited(body, path, required=values.get("format") == FORMAT)
        body.pop(DIGEST_KEY, None)
        f = RecordFields(body, path)
        return cls(config=f.str("config"), gpus=f.int("gpus"), nodes=f.int("nodes"),
                   seq_len=f.int("seq_len"), global_batch=f.int("global_batch"), steps=f.int("steps"),
                   tokens=f.int("tokens"), efficiency=f.number("efficiency"),
                   configured=_layout(f.mapping("configured"), path, "configured."),
                   layouts=tuple(_layout(layout, path, f"layouts[{i}].")
                                 for i, layout in enumerate(f.list("layouts"))),
                   content=MappingProxyType({**body, "format": FORMAT}))

    def to_dict(self) -> dict[str, Any]:
        """The record as stored: its content, with its format and digest."""
        return with_digest({"format": FORMAT, **{k: v for k, v in self.content.items() if k != "format"}})

    def json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    def write(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def read(cls, path: str | Path) -> PlanRecord:
        path = Path(path)
        return cls.from_dict(read_json_object(path, "plan"), path)


def _migrated(body: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """A plan of an older format brought to today's: one without ``format`` or of v1 (maybe written
    before digests were: a digest it has is checked) holds today's fields and reads as it is;
    another version is refused, naming it. A plan of today's format always carries its digest."""
    found = body.get("format", FORMAT)
    if found not in (FORMAT, DIGESTLESS_FORMAT):
        raise UserError(f"{path}: format {found!r} is not one this version of mimir reads (it reads "
                        f"{FORMAT!r}); run `mimir plan` again")
    return body


def _layout(values: Any, path: str | Path, where: str) -> LayoutSummary:
    if not isinstance(values, Mapping):
        raise UserError(f"{path}: {where.rstrip('.')}: a JSON object expected, got {values!r}")
    f = RecordFields(values, path, where)
    return LayoutSummary(tp=f.int("tp"), dp=f.int("dp"), micro_batch=f.int("micro_batch"),
                         recompute=f.str("recompute"),
                         fits=f.bool("fits"),
                         step_time_s=f.number("step_time_s"), tokens_per_s=f.number("tokens_per_s"),
                         days=f.number("days"), gpu_hours=f.number("gpu_hours"))
