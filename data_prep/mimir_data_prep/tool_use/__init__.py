"""Public function-calling data (xLAM, Glaive, Hermes, ToolACE) converted into native tool use:
declared JSON-schema tools, structured calls with ids, matching results, final answers."""

from .assemble import DANGLING_POLICIES, assemble
from .convert import convert_files, convert_line, convert_record
from .formats import FORMATS, detect_format, read
from .literals import parse_arguments, parse_call_list, parse_literal

__all__ = [
    "DANGLING_POLICIES",
    "FORMATS",
    "assemble",
    "convert_files",
    "convert_line",
    "convert_record",
    "detect_format",
    "parse_arguments",
    "parse_call_list",
    "parse_literal",
    "read",
]
