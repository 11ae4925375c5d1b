"""The write-manifest stage of `mimir prepare`: the finished shards' statistics summed into the
manifest's content (:func:`manifest_content`), written by the manifest's one writer
(:func:`mimir_megatron.data.manifest.write_manifest`: its format, its digest, its checks), and
their rejects merged into ``rejects.jsonl``, in shard order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mimir_megatron.chat import ChatRenderer
from mimir_megatron.data.manifest import Manifest, write_manifest
from mimir_megatron.data.prepared import REJECTS_NAME, SEQUENCES_PER_DOCUMENT, SHARDS_DIR
from mimir_megatron.data.provenance import Provenance, stored_record
from mimir_megatron.integrity import atomic_files, sha256_file

from .records import REJECT_REASONS
from .settings import PrepareSettings
from .shard_writer import ShardStats
from .shards import ShardTask


def source_record(path: Path, sha256: str) -> dict:
    """An input file as the manifest records it (the data policy checks its sha256)."""
    stat = path.stat()
    return {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": sha256}


def merge_rejects(tasks: list[ShardTask], out: Path) -> str:
    """The shards' rejects concatenated into ``rejects.jsonl``; its sha256."""
    with atomic_files(out / REJECTS_NAME) as (tmp,), tmp.open("wb") as merged:
        for task in tasks:
            with (out / SHARDS_DIR / f"{task.shard_id:05d}.rejects.jsonl").open("rb") as part:
                while block := part.read(1 << 22):
                    merged.write(block)
    return sha256_file(out / REJECTS_NAME)


def write_dataset_manifest(
    tasks: list[ShardTask],
    stats: dict[int, ShardStats],
    settings: PrepareSettings,
    renderer: ChatRenderer,
    sources: list[dict],
    out: Path,
    formats: dict[str, dict],
    provenance: Provenance | None,
) -> Manifest:
    """Write ``rejects.jsonl`` and ``manifest.json`` for the finished shards; the manifest."""
    rejects_sha256 = merge_rejects(tasks, out)
    content = manifest_content(tasks, stats, settings, renderer, sources, formats, provenance, rejects_sha256)
    return write_manifest(out, content)


def manifest_content(
    tasks: list[ShardTask],
    stats: dict[int, ShardStats],
    settings: PrepareSettings,
    renderer: ChatRenderer,
    sources: list[dict],
    formats: dict[str, dict],
    provenance: Provenance | None,
    rejects_sha256: str,
) -> dict:
    """The manifest's content for the finished shards (what :func:`write_manifest` writes, which
    adds the format and the digest): the shards' statistics summed, in shard order."""
    rejects = {r: 0 for r in REJECT_REASONS}
    personal: dict[str, int] = {}
    totals = {"lines": 0, "documents": 0, "prefix": 0, "response": 0, "truncated": 0, "stripped": 0}
    outputs: dict[str, str] = {}
    shards = []
    for task in tasks:
        s = stats[task.shard_id]
        totals["lines"] += s.lines
        totals["documents"] += s.documents
        totals["prefix"] += s.prefix_tokens
        totals["response"] += s.response_tokens
        totals["truncated"] += s.truncated
        totals["stripped"] += s.control_chars_stripped
        for reason, n in s.rejects.items():
            rejects[reason] += n
        for kind, n in s.personal_data.items():
            personal[kind] = personal.get(kind, 0) + n
        outputs.update({k: v for k, v in s.files.items() if not k.endswith(".rejects.jsonl")})
        shards.append({"prefix": f"{SHARDS_DIR}/{task.shard_id:05d}", "documents": s.documents,
                       "source": task.path, "first_line": task.first_line, "lines": s.lines})
    outputs[REJECTS_NAME] = rejects_sha256
    rejected = sum(rejects.values())
    assert totals["documents"] + rejected == totals["lines"], "accepted + rejected != lines read"
    from megatron.core.datasets.indexed_dataset import DType

    return {
        "layout": f"{SEQUENCES_PER_DOCUMENT} sequences per document: prefix, then response",
        "sources": sources,
        "provenance": stored_record(provenance),
        "tokenizer": {
            "path": settings.tokenizer_dir,
            "sha256": settings.tokenizer_sha256,
            "vocab_size": renderer.vocab_size,
            "pad_token_id": renderer.tokenizer.pad_token_id,
            "eos_token_id": renderer.tokenizer.eos_token_id,
            # What generation stops on; every response ends with one of them when the template
            # writes one (mimir_megatron.chat.end_of_turn_ids).
            "end_of_turn_ids": renderer.end_of_turn_ids,
        },
        "dtype": np.dtype(DType.optimal_dtype(renderer.vocab_size)).name,
        "settings": {
            "seq_len": settings.seq_len,
            "too_long": settings.too_long,
            "min_response_tokens": settings.min_response_tokens,
            "input_format": settings.input_format,
            "columns": dict(settings.columns),
            "control_chars": settings.control_chars,
            "denylist": ({"path": settings.denylist, "sha256": settings.denylist_sha256}
                         if settings.denylist else None),
        },
        "input_formats": {path: formats[path] for path in dict.fromkeys(t.path for t in tasks)},
        "lines_read": totals["lines"],
        "accepted": totals["documents"],
        "rejected": rejected,
        "rejects": rejects,
        "truncated": totals["truncated"],
        "control_chars_stripped": totals["stripped"],
        "personal_data": {"policy": settings.personal_data, "found": dict(sorted(personal.items())),
                          "documents_rejected": rejects["personal_data"]},
        "documents": totals["documents"],
        "tokens": {
            "prefix": totals["prefix"],
            "response": totals["response"],
            "total": totals["prefix"] + totals["response"],
        },
        "shards": shards,
        "outputs": dict(sorted(outputs.items())),
    }
