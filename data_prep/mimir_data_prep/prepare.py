"""`mimir prepare`: tokenize chat data into a prepared dataset (see mimir_megatron.data.prepared).

The pipeline, one stage a module, called here top to bottom:

1. settings: the options checked once (:mod:`.settings`);
2. plan: the inputs split into shards (:mod:`.shards`), each file's layout detected
   (:func:`.layouts.decide_layouts`), the shards a previous run finished found by their key;
3. write shards, in worker processes (:mod:`.shard_pool`), each shard
   read (:mod:`.read`) -> screened (:func:`.screen.screen_text`: control characters, personal
   data) -> rendered and tokenized (:mod:`.render`) -> screened (:func:`.screen.screen_tokens`:
   the denylist) -> written (:mod:`.shard_writer`);
4. write the manifest (:mod:`.manifest`) from the shards' statistics.

Several datasets (``mimir prepare --config``, :func:`prepare_planned`) share the worker processes:
their shards are prepared side by side and each manifest is written as soon as its shards are.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mimir_megatron.chat import ChatRenderer
from mimir_megatron.data.manifest import Manifest
from mimir_megatron.data.prepared import SHARDS_DIR
from mimir_megatron.data.provenance import Provenance, read_provenance
from mimir_megatron.errors import UserError
from mimir_megatron.integrity import sha256_file

from .derivation import check_declaration, sidecar_conflicts
from .layouts import decide_layouts
from .manifest import source_record, write_dataset_manifest
from .settings import PrepareOptions, PrepareSettings, prepare_settings
from .shard_pool import ShardJob, run_shards
from .shard_writer import ShardStats, finished_shard
from .shards import DEFAULT_SHARD_BYTES, ShardTask, plan_shards

log = logging.getLogger(__name__)


def prepare(
    inputs: list[str | Path],
    tokenizer_dir: str | Path,
    output_dir: str | Path,
    options: PrepareOptions | None = None,
    *,
    workers: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
    provenance: Provenance | None = None,
    part: str | None = None,
    merge: bool = False,
    **keywords: Any,
) -> Manifest | None:
    """Prepare ``inputs`` into ``output_dir`` and return its manifest (the typed record written).

    What decides the output (``seq_len``, ``too_long``, ``columns``, ``denylist``, ...) is
    ``options`` and/or ``keywords`` of :class:`~.settings.PrepareOptions`'s field names (the one
    list of them and their defaults): ``prepare(inputs, tok, out, seq_len=256, workers=1)``.

    Spread over machines (a Slurm array, ``launchers/prepare_array.sh``): each job runs with
    ``part`` (``I/N``: the I-th of N contiguous ranges of the shards, from 0; or ``START:END``,
    shard ids) and writes only those shards, returning None; then one run with ``merge`` checks
    that every shard is finished and writes the manifest. The result equals a run over everything,
    byte for byte. Every job must see the same inputs and options (the shards' keys check it).

    ``provenance`` is the dataset's declared record (:mod:`mimir_megatron.data.provenance`);
    without one, the record the inputs' sidecars agree on, else ``unknown``. ``denylist``: a file
    from ``mimir audit contamination --denylist``; documents holding one of its sequences (token
    ids, or folded words of the text) are rejected as ``benchmark_overlap``."""
    if not inputs:
        raise UserError("no input files given")
    settings = prepare_settings(tokenizer_dir, options, **keywords)
    plan = plan_dataset(inputs, output_dir, settings, shard_bytes=shard_bytes, provenance=provenance,
                        part=part, merge=merge)
    workers = pool_size(workers, len(plan.todo))
    log.info("%d input file(s), %d shard(s): %d already finished, %d to do with %d worker(s)",
             len(plan.paths), len(plan.tasks), len(plan.done), len(plan.todo), workers)
    if part:
        started = time.perf_counter()
        jobs = [ShardJob(0, t, settings, str(plan.out)) for t in plan.todo]
        with closing(run_shards(jobs, workers, show=progress)) as shards:  # closing stops the workers
            for _, result in shards:
                if isinstance(result, BaseException):
                    raise result
        log.info("%s: shards %s of %d finished (%.1f s); when every part is, run once more with --merge",
                 plan.out, _id_list(list(select_shards(part, len(plan.tasks)))), len(plan.tasks),
                 time.perf_counter() - started)
        return None
    (result,) = prepare_planned([plan], workers, show=progress)
    if isinstance(result, BaseException):
        raise result
    return result


@dataclass
class DatasetPlan:
    """One dataset ready to prepare: its shards, those a previous run finished, those to do."""

    out: Path
    paths: list[Path]
    settings: PrepareSettings
    renderer: ChatRenderer
    tasks: list[ShardTask]
    formats: dict[str, dict]  # per input file: its layout (the manifest's input_formats)
    provenance: Provenance | None
    done: dict[int, ShardStats] = field(default_factory=dict)
    todo: list[ShardTask] = field(default_factory=list)
    name: str = ""  # for logs and errors: the dataset's name in a prepare config


def plan_dataset(
    inputs: list[str | Path],
    output_dir: str | Path,
    settings: PrepareSettings,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    provenance: Provenance | None = None,
    part: str | None = None,
    merge: bool = False,
    renderer: ChatRenderer | None = None,
    name: str = "",
    sidecar: bool = True,
) -> DatasetPlan:
    """The plan stage: the tokenizer loaded (a bad one fails here, before anything is written),
    the provenance, the shards and their layouts, the shards already finished and those to do
    (only ``part``'s; none under ``merge``, which refuses when any is left). Without a
    ``provenance``, the record the inputs' sidecars agree on (unless ``sidecar`` is False: the
    caller resolves a declared one later)."""
    paths = [Path(p) for p in inputs]
    out = Path(output_dir)
    renderer = renderer or ChatRenderer(settings.tokenizer_dir)
    if provenance is None and sidecar:
        provenance = _sidecar_provenance(paths, out)
    elif provenance is not None:  # a declaration beside inputs with their own: refused before writing
        conflicts = sidecar_conflicts(paths, provenance)
        if conflicts:
            raise UserError("; ".join(conflicts))
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    tasks = plan_shards(paths, shard_bytes)
    formats = decide_layouts(tasks, settings.input_format, dict(settings.columns))
    tasks = [replace(t, layout=formats[t.path]["format"]) for t in tasks]
    selected = select_shards(part, len(tasks)) if part else range(len(tasks))
    done = {t.shard_id: s for t in tasks if (s := finished_shard(t, settings, out)) is not None}
    todo = [t for t in tasks if t.shard_id not in done and t.shard_id in selected]
    if merge and todo:
        raise UserError(f"{out}: cannot merge: {_id_list([t.shard_id for t in todo])} of {len(tasks)} "
                        "shards are not finished (run their --part first, with the same inputs and options)")
    return DatasetPlan(out, paths, settings, renderer, tasks, formats, provenance, done, todo, name)


def pool_size(workers: int | None, shards: int) -> int:
    """Worker processes for ``shards`` shards: ``workers`` (default: the CPUs), at most one a shard."""
    return max(1, min(workers or os.cpu_count() or 1, shards or 1))


def prepare_planned(
    plans: list[DatasetPlan],
    workers: int,
    *,
    show: bool = True,
    provenance: Callable[[int], Provenance | None] | None = None,
    after: Mapping[int, Iterable[int]] | None = None,
) -> list[Manifest | BaseException]:
    """Prepare the planned datasets together; per dataset, its manifest or the exception that
    stopped it (the others go on). Their shards share ``workers`` processes, and each manifest
    is written (the write-manifest stage) as soon as its shards are finished and so are the
    datasets ``after[i]`` names; ``provenance(i)``, when given, is then asked for dataset i's
    record (a provenance that names an earlier dataset reads its manifest)."""
    after = {i: set(after.get(i, ())) if after else set() for i in range(len(plans))}
    results: dict[int, Manifest | BaseException] = {}
    stats = {i: dict(plan.done) for i, plan in enumerate(plans)}
    left = {i: len(plan.todo) for i, plan in enumerate(plans)}
    failed: set[int] = set()
    started = time.perf_counter()

    def finish_ready(hashes: dict[int, list[Future]]) -> None:
        for i, plan in enumerate(plans):
            if i in results or (left[i] and i not in failed):
                continue
            if i in failed:
                continue  # its error is in results already
            broken = [j for j in after[i] if isinstance(results.get(j), BaseException)]
            if broken:
                results[i] = UserError(f"{_label(plans[i])}: not prepared: it derives from "
                                       f"{_label(plans[broken[0]])}, which failed")
                failed.add(i)
                continue
            if any(j not in results for j in after[i]):
                continue
            try:
                record = provenance(i) if provenance else plan.provenance
                sources = [source_record(p, h.result()) for p, h in zip(plan.paths, hashes[i])]
                results[i] = finish_dataset(plan, stats[i], sources, record, started)
            except Exception as exc:
                results[i] = exc
                failed.add(i)

    jobs = [ShardJob(i, t, plan.settings, str(plan.out)) for i, plan in enumerate(plans) for t in plan.todo]
    # The inputs' sha256 (recorded for the data policy's check) is read beside the workers.
    paths = [p for plan in plans for p in plan.paths]
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(paths)))) as hashing:
        hashes = {i: [hashing.submit(sha256_file, p) for p in plan.paths] for i, plan in enumerate(plans)}
        finish_ready(hashes)
        with closing(run_shards(jobs, workers, show=show, skip=failed)) as shards:  # closed: workers stop
            for job, result in shards:
                i = job.dataset
                if isinstance(result, BaseException):
                    if len(plans) == 1:
                        raise result
                    if i not in failed:
                        log.error("%s: %s", _label(plans[i]), result)
                        results[i], left[i] = result, 0
                        failed.add(i)
                else:
                    stats[i][result.shard_id] = result
                    left[i] -= 1
                finish_ready(hashes)
        finish_ready(hashes)
    return [results[i] for i in range(len(plans))]


def finish_dataset(plan: DatasetPlan, stats: dict[int, ShardStats], sources: list[dict],
                   provenance: Provenance | None, started: float) -> Manifest:
    """The write-manifest stage of one dataset whose shards are all finished; its manifest. Its
    declaration is checked against its inputs first (:mod:`.derivation`)."""
    check_declaration(plan.tasks, plan.paths, plan.settings, provenance, sum(s.lines for s in stats.values()))
    manifest = write_dataset_manifest(plan.tasks, stats, plan.settings, plan.renderer, sources, plan.out,
                                      plan.formats, provenance)
    log.info("%s: %d documents, %d tokens, %d rejected of %d lines (%.1f s)", plan.out,
             manifest.documents, manifest.tokens_total, manifest.rejected, manifest.lines_read,
             time.perf_counter() - started)
    return manifest


def _label(plan: DatasetPlan) -> str:
    return plan.name or str(plan.out)


def select_shards(part: str, shards: int) -> range:
    """The shard ids of ``part``: ``I/N`` (the I-th of N contiguous, near-equal ranges, I from 0;
    a Slurm array's ``$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``) or ``START:END``."""
    try:
        if "/" in part:
            i, n = (int(x) for x in part.split("/"))
            if not 0 <= i < n:
                raise ValueError
            return range(i * shards // n, (i + 1) * shards // n)
        start, end = (int(x) for x in part.split(":"))
        if not 0 <= start < end:
            raise ValueError
        return range(start, min(end, shards))
    except ValueError:
        raise UserError(f"--part {part!r}: expected I/N (0 <= I < N) or START:END shard ids") from None


def _id_list(ids: list[int]) -> str:
    """``3``, ``3-7`` or ``3-7 (and 2 more ranges)``: shard ids for a log or an error."""
    if not ids:
        return "none"
    runs, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    more = f" (and {len(runs) - 3} more ranges)" if len(runs) > 3 else ""
    return "shard " + ", ".join(runs[:3]) + more if len(ids) == 1 else "shards " + ", ".join(runs[:3]) + more


def _sidecar_provenance(paths: list[Path], out: Path) -> Provenance | None:
    """The record the inputs' provenance sidecars agree on (a pipeline's output), else None."""
    records = [read_provenance(p) for p in paths]
    if None in records:
        return None  # a missing input: planning the shards names it
    digests = {r.digest for r in records}
    if len(digests) == 1 and None not in digests:
        provenance = records[0].provenance
        log.info("%s: provenance from the inputs' sidecar (%s)", out, provenance.id)
        return provenance
    log.warning("%s: no provenance declared (--source/--license/--basis/--form, or a provenance "
                "section in the prepare YAML): the dataset's provenance is unknown, and the default "
                "data policy refuses to train on it", out)
    return None
