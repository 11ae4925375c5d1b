"""The read stage of `mimir prepare`: one shard's lines (JSONL) or rows (Parquet), each turned
into a conversation in the common ``messages`` form, or into the reason it cannot be one.

Nothing is raised for bad data: every line read comes out once, so that it is counted as either
accepted or rejected.
"""

from __future__ import annotations

from typing import Iterator, Union

from .layouts import normalise
from .records import Conversation, RecordError, decode_json_line, to_conversation
from .settings import PrepareSettings
from .shards import CorruptRowGroup, ShardTask, iter_jsonl, iter_parquet

Record = Union[Conversation, RecordError, CorruptRowGroup]


def read_records(task: ShardTask, settings: PrepareSettings) -> Iterator[tuple[int, Record, bytes | None]]:
    """(line, conversation | RecordError | CorruptRowGroup, raw bytes | None) for each line of
    ``task``, in the file's layout (``task.layout``) normalised to ``messages``."""
    columns = dict(settings.columns)

    def convert(obj) -> Conversation:
        try:
            return to_conversation(normalise(obj, task.layout, columns))
        except RecursionError:
            raise RecordError("bad_schema", "nested too deeply") from None

    if task.kind == "jsonl":
        for line, raw in iter_jsonl(task):
            try:
                yield line, convert(decode_json_line(raw, settings.control_chars)), raw
            except RecordError as exc:
                yield line, exc, raw
    else:
        for row, record in iter_parquet(task):
            if isinstance(record, CorruptRowGroup):
                yield row, record, None
                continue
            try:
                yield row, convert(record), None
            except RecordError as exc:
                yield row, exc, None
