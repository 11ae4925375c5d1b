"""JSONL input lines in the chat layout `mimir prepare` reads."""

from __future__ import annotations

import json
from pathlib import Path


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    with path.open("wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


def chat(user: str, answer: str, **extra) -> str:
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": msgs, **extra})
