"""`mimir prepare --config FILE.yaml`: several datasets in one file, each with its own input layout.

tokenizer: ../../data_prep/mimir_data_prep/demo/tokenizer   # paths are relative to this file
seq_len: 4096
denylist: contamination/denylist.json   # optional: drop documents holding benchmark text
personal_data: reject                   # reject | redact | report (personal_data.py); per dataset too
datasets:
  - name: openmath
    input: [raw/openmath.jsonl]
    output: prepared/openmath
    input_format: columns                   # auto | messages | sharegpt | alpaca | columns
    columns: {prompt: problem, completion: generated_solution}
    provenance:                             # mimir_megatron.data.provenance (docs/data-governance.md)
      source: OpenMathInstruct-2
      location: nvidia/OpenMathInstruct-2   # a Hub repo id or a URL
      revision: main
      retrieved: 2026-10-01
      license: CC-BY-4.0
      basis: open-licence
      form: reformatted
      audit_group: C
      languages: [en]
  - name: hermes-chat
    input: [raw/hermes.parquet]
    output: prepared/hermes-chat            # input_format defaults to auto
    provenance: {source: ..., derived_from: [openmath], ...}   # names a dataset above, or a path

Every mistake in the file is listed, one line each, before anything is prepared.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mimir_megatron.data.manifest import Manifest
from mimir_megatron.data.provenance import (
    Provenance,
    declaration_from_mapping,
    resolve_declaration,
)
from mimir_megatron.yaml_config import raise_errors, read_yaml, typed_section

from .layouts import INPUT_FORMATS, parse_columns
from .personal_data import POLICIES as PERSONAL_DATA_POLICIES
from .records import CONTROL_CHAR_POLICIES
from .settings import TOO_LONG_POLICIES, PrepareOptions
from .shards import DEFAULT_SHARD_BYTES

log = logging.getLogger(__name__)


@dataclass
class DatasetJob:
    """One prepared dataset: its input files and how to read them."""

    name: str = ""
    input: list[str] = field(default_factory=list)  # JSONL/Parquet files
    output: str = ""  # prepared dataset directory
    input_format: str = PrepareOptions.input_format
    columns: dict[str, str] = field(default_factory=dict)  # target -> column, for `columns`
    control_chars: str | None = None  # default: the file-level setting
    personal_data: str | None = None  # default: the file-level setting
    provenance: Any = None  # a mapping: mimir_megatron.data.provenance.ProvenanceDeclaration


@dataclass
class PrepareJob:
    """Settings shared by every dataset of the file, and the datasets."""

    tokenizer: str = ""
    seq_len: int = PrepareOptions.seq_len  # the defaults are prepare()'s (settings.PrepareOptions)
    too_long: str = PrepareOptions.too_long
    min_response_tokens: int = PrepareOptions.min_response_tokens
    control_chars: str = PrepareOptions.control_chars
    workers: int | None = None
    denylist: str = ""  # `mimir audit contamination --denylist` output, applied to every dataset
    personal_data: str = PrepareOptions.personal_data  # mimir_data_prep.personal_data.POLICIES
    datasets: list[DatasetJob] = field(default_factory=list)


def load_prepare_config(path: str | Path) -> PrepareJob:
    """The typed job with paths resolved against the file's directory; ConfigError listing every
    mistake otherwise."""
    source = Path(path)
    raw = read_yaml(source, "prepare settings", kind="prepare config")
    datasets = raw.pop("datasets", None) or []
    errors: list[str] = []
    if not isinstance(datasets, list):
        errors.append(f"datasets must be a list of datasets, got {datasets!r}")
        datasets = []
    # Every key of the file and of every dataset typed in one pass: each mistake one line.
    job = typed_section(PrepareJob, raw, "prepare", errors)
    for i, entry in enumerate(datasets):
        job.datasets.append(typed_section(DatasetJob, entry, f"datasets[{i}]", errors))
    errors += _errors(job)
    errors += _provenance_errors(job, source.parent)
    raise_errors(errors, f"invalid prepare config {source}")
    base = source.parent
    job.tokenizer = str(_resolve(base, job.tokenizer))
    job.denylist = str(_resolve(base, job.denylist)) if job.denylist else ""
    for d in job.datasets:
        d.input = [str(_resolve(base, p)) for p in d.input]
        d.output = str(_resolve(base, d.output))
    return job


def _resolve(base: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def _errors(job: PrepareJob) -> list[str]:
    errs = []
    if not job.tokenizer:
        errs.append("tokenizer: required (a Hugging Face tokenizer directory)")
    if job.seq_len < 2:
        errs.append(f"seq_len: must be >= 2, got {job.seq_len}")
    if job.too_long not in TOO_LONG_POLICIES:
        errs.append(f"too_long: one of {TOO_LONG_POLICIES}, got {job.too_long!r}")
    if job.control_chars not in CONTROL_CHAR_POLICIES:
        errs.append(f"control_chars: one of {CONTROL_CHAR_POLICIES}, got {job.control_chars!r}")
    if job.personal_data not in PERSONAL_DATA_POLICIES:
        errs.append(f"personal_data: one of {PERSONAL_DATA_POLICIES}, got {job.personal_data!r}")
    for i, d in enumerate(job.datasets):
        if d.personal_data is not None and d.personal_data not in PERSONAL_DATA_POLICIES:
            errs.append(f"datasets[{i}].personal_data: one of {PERSONAL_DATA_POLICIES}, "
                        f"got {d.personal_data!r}")
    if not job.datasets:
        errs.append("datasets: at least one dataset is required")
    outputs: dict[str, int] = {}
    for i, d in enumerate(job.datasets):
        where = f"datasets[{i}]" + (f" ({d.name})" if d.name else "")
        if not d.input:
            errs.append(f"{where}.input: at least one input file")
        if not d.output:
            errs.append(f"{where}.output: required")
        elif d.output in outputs:
            errs.append(f"{where}.output: {d.output} is also datasets[{outputs[d.output]}]'s output")
        outputs.setdefault(d.output, i)
        if d.input_format not in INPUT_FORMATS:
            errs.append(f"{where}.input_format: one of {INPUT_FORMATS}, got {d.input_format!r}")
        if d.control_chars is not None and d.control_chars not in CONTROL_CHAR_POLICIES:
            errs.append(f"{where}.control_chars: one of {CONTROL_CHAR_POLICIES}, got {d.control_chars!r}")
        if d.columns or d.input_format == "columns":
            try:
                parse_columns(d.columns or None)
                if not d.columns:
                    raise ValueError("input_format columns needs a 'columns' mapping")
            except Exception as exc:  # UserError from parse_columns, or the check above
                errs.append(f"{where}.columns: {exc}")
    return errs


def _provenance_errors(job: PrepareJob, base: Path) -> list[str]:
    """Every provenance mistake of the file; a derived_from may name a dataset listed above."""
    errors: list[str] = []
    for i, d in enumerate(job.datasets):
        if d.provenance is not None:
            dataset_provenance(d, f"datasets[{i}]", base, job, i, errors)
    return errors


def dataset_provenance(d: DatasetJob, where: str, base: Path, job: PrepareJob, index: int,
                       errors: list[str], prepared: bool = False) -> Provenance | None:
    """The resolved provenance of dataset ``index`` (None when it declares none). Before
    anything is prepared (``prepared`` False), the datasets above it are accepted by name."""
    if d.provenance is None:
        return None
    where = f"{where} ({d.name})" if d.name else where
    earlier = {e.name: Path(e.output) for e in job.datasets[:index] if e.name}
    decl = declaration_from_mapping(d.provenance, f"{where}.provenance", errors)
    return resolve_declaration(decl, f"{where}.provenance", default_id=d.name or Path(d.output).name,
                               base=base, siblings=earlier if prepared else None,
                               pending=() if prepared else earlier, output=_resolve(base, d.output),
                               errors=errors)


def run_prepare_config(
    path: str | Path, *, progress: bool = True, workers: int | None = None, denylist: str | None = None,
    personal_data: str | None = None, shard_bytes: int | None = None,
) -> list[Manifest]:
    """Prepare every dataset of the file; returns their manifests, in the file's order.
    ``denylist`` and ``personal_data`` (the command line's) replace the file's settings.

    The datasets are prepared side by side: their shards share ``workers`` processes (default:
    the file's ``workers``, else the CPUs), and each manifest is written as soon as its own shards
    are, after those of the datasets its provenance derives from. The output is the same as
    preparing the datasets one after another. A dataset that fails (a bad input, ``--strict``)
    stops only itself and what derives from it; each failure is logged as it happens, and the
    run ends with an error naming them once the others are finished. ``shard_bytes``: as
    :func:`~mimir_data_prep.prepare.prepare`'s."""
    from mimir_megatron.chat import ChatRenderer
    from mimir_megatron.errors import UserError

    from .prepare import plan_dataset, pool_size, prepare_planned
    from .settings import check_denylist, prepare_settings

    job = load_prepare_config(path)
    job.denylist = denylist or job.denylist
    base = Path(path).parent
    check_denylist(job.denylist, job.tokenizer)  # before anything is written: it fails every dataset
    renderer = ChatRenderer(job.tokenizer)  # so would a bad tokenizer
    plans, planned, failures = [], [], {}
    for i, d in enumerate(job.datasets):
        try:
            settings = prepare_settings(
                job.tokenizer, seq_len=job.seq_len, too_long=job.too_long,
                min_response_tokens=job.min_response_tokens, input_format=d.input_format,
                columns=dict(d.columns) or None, control_chars=d.control_chars or job.control_chars,
                denylist=job.denylist or None,
                personal_data=personal_data or d.personal_data or job.personal_data,
            )
            plans.append(plan_dataset(d.input, d.output, settings, renderer=renderer, name=_name(d, i),
                                      sidecar=d.provenance is None,
                                      shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES))
            planned.append(i)
        except UserError as exc:  # this dataset's inputs: the others go on
            log.error("%s: %s", _name(d, i), exc)
            failures[i] = exc
    index = {i: n for n, i in enumerate(planned)}

    def provenance(n: int) -> Provenance | None:
        i = planned[n]
        d = job.datasets[i]
        if d.provenance is None:
            return plans[n].provenance  # the inputs' sidecars, if they agree
        errors: list[str] = []
        record = dataset_provenance(d, f"datasets[{i}]", base, job, i, errors, prepared=True)
        raise_errors(errors, f"invalid provenance in {path}")
        return record

    after = {index[i]: [index[j] for j in _derives_from(job, i, base) if j in index] for i in planned}
    broken = {i: j for i in planned for j in _derives_from(job, i, base) if j in failures}
    shards = sum(len(p.todo) for p in plans)
    results = prepare_planned(plans, pool_size(workers or job.workers, shards), show=progress,
                              provenance=provenance, after=after)
    for n, result in enumerate(results):
        if isinstance(result, BaseException):
            failures[planned[n]] = result
    for i, j in broken.items():
        failures.setdefault(i, UserError(f"{_name(job.datasets[i], i)}: not prepared: it derives from "
                                         f"{_name(job.datasets[j], j)}, which failed"))
    if len(failures) == 1:
        raise next(iter(failures.values()))
    if failures:
        names = ", ".join(_name(job.datasets[i], i) for i in sorted(failures))
        raise UserError(f"{path}: {len(failures)} of {len(job.datasets)} datasets failed: {names} "
                        "(each error is logged above); the others are prepared")
    return [r for r in results if not isinstance(r, BaseException)]


def _name(d: DatasetJob, index: int) -> str:
    return f"datasets[{index}] ({d.name})" if d.name else f"datasets[{index}] ({d.output})"


def _derives_from(job: PrepareJob, index: int, base: Path) -> list[int]:
    """The datasets above ``index`` that its provenance derives from (by name or by output path):
    its manifest is written after theirs, which it reads."""
    refs = (job.datasets[index].provenance or {}).get("derived_from") or []
    found = []
    for j, earlier in enumerate(job.datasets[:index]):
        output = Path(earlier.output).resolve()
        if any(ref == earlier.name or _resolve(base, str(ref)).resolve() == output
               for ref in refs if isinstance(ref, str) and ref):
            found.append(j)
    return found
