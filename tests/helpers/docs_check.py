"""What the README and docs/ say, checked against the repository (tests/unit/test_docs.py).

- every relative link resolves: the file or folder exists, and an anchor (`file.md#heading`)
  names a heading of that file, spelled as GitHub spells it;
- every `mimir` command line in a fenced block parses with the CLI's own parser
  (`mimir_megatron.cli.build_parser`): a real subcommand, real flags, valid choices; no handler runs;
- every config file named (`configs/.../*.yaml`) exists and loads with the project's loader for its
  kind (model, train, mixture, suite, prepare job, synth pipeline);
- every repository path written in code (`mimir_megatron/train/step.py`, `bench/gpu_check.sh`,
  `tests/unit/test_x.py::test_y`) exists.

    .venv/bin/python tests/helpers/docs_check.py      # print every problem, exit 1 if any
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]

# Top-level folders whose paths, written in a doc, must exist.
SOURCE_ROOTS = ("mimir_megatron", "kernels", "data_prep", "launchers", "configs", "tests", "bench",
                "docker", "docs", ".ci")

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_CONFIG = re.compile(r"(?<![\w/.])configs/[\w./-]+?\.ya?ml\b")
_ROOT_PATH = re.compile(rf"^(?:{'|'.join(re.escape(r) for r in SOURCE_ROOTS)})/[\w./-]*$")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Doc:
    path: Path
    headings: list[str] = field(default_factory=list)
    links: list[tuple[int, str]] = field(default_factory=list)  # (line, target)
    commands: list[tuple[int, str]] = field(default_factory=list)  # (line, joined command line)
    code_paths: list[tuple[int, str]] = field(default_factory=list)
    configs: list[tuple[int, str]] = field(default_factory=list)
    anchors: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.path.relative_to(REPO).as_posix() if self.path.is_relative_to(REPO) else str(self.path)


def documents(repo: Path = REPO) -> list[Path]:
    """README.md, docs/*.md, the folders' READMEs and tests/TIERS.md."""
    folders = [p for p in sorted(repo.glob("*/README.md")) if not p.parent.name.startswith(".")]  # not .pytest_cache
    found = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), *folders, repo / "tests" / "TIERS.md"]
    return [p for p in found if p.is_file()]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (links and code marks dropped), lower case,
    punctuation removed, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def parse(path: Path) -> Doc:
    doc = Doc(path)
    fence: str | None = None
    pending: tuple[int, str] | None = None  # a command continued with a trailing backslash
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip()[len(fence):].strip():
                fence, pending = None, None
                continue
            if pending is not None:
                pending = (pending[0], pending[1] + " " + line.strip())
            else:
                pending = (number, line.strip())
            if pending[1].endswith("\\"):
                pending = (pending[0], pending[1][:-1].rstrip())
                continue
            _fenced_line(doc, *pending)
            pending = None
            continue
        doc.configs += [(number, m.group(0)) for m in _CONFIG.finditer(line)]
        heading = _HEADING.match(line)
        if heading:
            doc.headings.append(heading.group(2))
        doc.anchors.update(_HTML_ANCHOR.findall(line))
        for span in _CODE_SPAN.finditer(line):
            doc.code_paths += [(number, p) for p in _paths_in(span.group(2).split())]
        prose = _CODE_SPAN.sub("", line)
        doc.links += [(number, m.group(1)) for m in _LINK.finditer(prose)]
    seen: dict[str, int] = {}
    for heading in doc.headings:  # GitHub numbers repeated headings: x, x-1, x-2
        base = slug(heading)
        doc.anchors.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return doc


def _fenced_line(doc: Doc, number: int, text: str) -> None:
    doc.configs += [(number, m.group(0)) for m in _CONFIG.finditer(text)]
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        words = text.split()
    doc.code_paths += [(number, p) for p in _paths_in(words)]
    command = text[2:] if text.startswith("$ ") else text
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        if command.split()[:1] and command.split()[0].endswith("mimir"):
            doc.commands.append((number, command))  # reported as unparseable
        return
    while words and _ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words and (words[0] == "mimir" or words[0].endswith("/bin/mimir")):
        doc.commands.append((number, shlex.join(["mimir", *words[1:]])))


def _paths_in(words: list[str]) -> list[str]:
    paths = []
    for word in words:
        word = word.strip("\"'(),;:").split("::")[0].rstrip(".")
        if _ROOT_PATH.match(word) and not any(c in word for c in "*{}<>|"):
            paths.append(word)
    return paths


# -- the checks ---------------------------------------------------------------------------------


def check_links(docs: list[Doc], repo: Path = REPO) -> list[str]:
    by_path = {d.path.resolve(): d for d in docs}
    problems = []
    for doc in docs:
        for number, target in doc.links:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.path.parent / file_part).resolve() if file_part else doc.path.resolve()
            where = f"{doc.name}:{number}: link {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor:
                if dest.suffix != ".md":
                    problems.append(f"{where}: an anchor into a file that is not Markdown")
                    continue
                target_doc = by_path.get(dest) or parse(dest)
                if anchor not in target_doc.anchors:
                    problems.append(f"{where}: no heading #{anchor} in {target_doc.name}")
    return problems


def check_commands(docs: list[Doc]) -> list[str]:
    from mimir_megatron.cli import build_parser

    parser = build_parser()
    problems = []
    for doc in docs:
        for number, command in doc.commands:
            error = parse_error(parser, command)
            if error:
                problems.append(f"{doc.name}:{number}: `{command}`: {error}")
    return problems


def parse_error(parser: argparse.ArgumentParser, command: str) -> str | None:
    """Why ``command`` (``mimir ...``) does not parse, or None; --help and --version count as parsed."""
    try:
        argv = shlex.split(command, comments=True)[1:]
    except ValueError as exc:
        return f"not a shell command line ({exc})"
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as exit:
        if exit.code not in (0, None):
            return (err.getvalue().strip().splitlines() or ["argparse error"])[-1]
    return None


def config_loaders() -> dict[str, Callable[[Path], object]]:
    """The project's loader for each kind of config folder."""
    from mimir_data_prep.prepare_config import load_prepare_config
    from mimir_data_prep.synth_pipeline.pipeline import load_pipeline
    from mimir_megatron.config import load_config
    from mimir_megatron.data.mixture import load_mixture
    from mimir_megatron.evaluation.suite import load_suite
    from mimir_megatron.train.config import load_train_config

    return {"model": load_config, "train": load_train_config, "data": load_mixture, "eval": load_suite,
            "prepare": load_prepare_config, "synth": load_pipeline}


def check_configs(docs: list[Doc], repo: Path = REPO) -> list[str]:
    loaders = config_loaders()
    problems, loaded = [], {}
    for doc in docs:
        for number, name in doc.configs:
            where = f"{doc.name}:{number}: {name}"
            path = repo / name
            if not path.is_file():
                problems.append(f"{where}: no such file")
                continue
            kind = Path(name).parts[1]
            if kind not in loaders:
                problems.append(f"{where}: no loader for configs/{kind}/")
                continue
            if name not in loaded:
                try:
                    loaders[kind](path)
                    loaded[name] = None
                except Exception as exc:  # noqa: BLE001 - the loader's own message is the finding
                    loaded[name] = f"{type(exc).__name__}: {'; '.join(str(exc).split(chr(10)))}"
            if loaded[name]:
                problems.append(f"{where}: does not load ({loaded[name]})")
    return problems


def check_paths(docs: list[Doc], repo: Path = REPO) -> list[str]:
    problems = []
    for doc in docs:
        for number, name in doc.code_paths:
            if _CONFIG.fullmatch(name):
                continue  # check_configs reports it
            if not (repo / name).exists():
                problems.append(f"{doc.name}:{number}: `{name}`: no such file or folder")
    return problems


def all_problems(repo: Path = REPO) -> list[str]:
    docs = [parse(p) for p in documents(repo)]
    return check_links(docs, repo) + check_commands(docs) + check_configs(docs, repo) + check_paths(docs, repo)


if __name__ == "__main__":
    import os

    os.chdir(REPO)  # train configs name their mixture relative to the repository root
    found = all_problems()
    print("\n".join(found) or "the docs agree with the repository")
    sys.exit(1 if found else 0)
