"""The format-neutral form every tool-use reader produces: declared tools and a list of turns."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Why a line is rejected; each is counted (zeros included) in the conversion report.
REJECT_REASONS = (
    "empty_line",
    "invalid_utf8",
    "malformed_json",
    "unknown_format",
    "bad_schema",
    "bad_tools",
    "bad_call",
    "bad_arguments",
    "undeclared_function",
    "call_without_result",  # under --dangling drop-sample
    "result_without_call",  # under --dangling drop-sample
    "no_final_answer",
    "corrupt_row_group",  # Parquet input: every unread row of the group
)
# What was cut out of a line that is kept (under --dangling drop-part).
REPAIR_REASONS = ("call_without_result", "result_without_call")


class ConversionError(Exception):
    """A line that cannot be converted; ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass
class Result:
    content: str
    name: str | None = None  # the function it answers, when the format says


@dataclass
class Turn:
    role: str  # system, user, assistant, tool
    content: str = ""
    calls: list[Call] = field(default_factory=list)  # assistant
    results: list[Result] = field(default_factory=list)  # tool


@dataclass
class Trace:
    tools: list[dict[str, Any]]  # {"type": "function", "function": {name, description, parameters}}
    turns: list[Turn]
    notes: Counter[str] = field(default_factory=Counter)  # normalisations that keep the meaning
