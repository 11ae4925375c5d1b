"""Faults injected into dist_checkpointing's data writes (tests of checkpoint reliability).

megatron's writer calls torch's ``_write_item`` once per tensor with the open data file; the
wrapper runs ``action(stream)`` first when the file lies in a directory named ``directory``
(any checkpoint's when None; an action may raise, as a full disk does, or block). A forked
asynchronous writer inherits it.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Callable


def patch_data_writes(directory: str | None, action: Callable[[io.IOBase], None], monkeypatch=None) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._write_item

    @functools.wraps(original)  # megatron inspects its signature
    def write_item(*args, **kwargs):
        stream = next(a for a in args if isinstance(a, io.IOBase))
        if directory is None or Path(stream.name).parent.name == directory:
            action(stream)
        return original(*args, **kwargs)

    if monkeypatch is not None:
        monkeypatch.setattr(filesystem_async, "_write_item", write_item)
    else:
        filesystem_async._write_item = write_item
