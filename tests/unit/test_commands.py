"""Every `mimir` command in one layer: the same `--help` shape, and for the data-preparation
commands (registered through the `mimir.commands` entry point) the same error rule as the rest:
a bad input is one line and exit code 2, no traceback. All in-process (`main(argv)`)."""

from __future__ import annotations

import argparse
import logging
import re

import pytest
from chat_lines import chat, write_lines
from mixtures import make_mixture

from mimir_megatron.cli import build_parser, command_groups, main

TOK = "data_prep/mimir_data_prep/demo/tokenizer"
# The commands data_prep adds; a new one needs a bad-input case below.
DATA_PREP_COMMANDS = ("prepare", "data", "synth")


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of every command and command group below ``parser``."""
    for group in command_groups(parser):
        for name, command in group.choices.items():
            yield (*path, name), command
            yield from _commands(command, (*path, name))


COMMANDS = dict(_commands(build_parser()))
LEAVES = sorted(path for path, parser in COMMANDS.items() if not command_groups(parser))


def _help(path: tuple[str, ...], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main([*path, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command_with_one_line(capsys):
    text = _help((), capsys)
    assert text.startswith("usage: mimir [-h] [-v] [--version] COMMAND ...")
    (top,) = command_groups(build_parser())
    assert {"prepare", "data", "synth", "train", "eval", "audit"} <= set(top.choices)
    for choice in top._choices_actions:
        assert choice.help, f"mimir {choice.dest} has no help line"
        assert re.search(rf"^    {re.escape(choice.dest)}\b", text, re.M), choice.dest


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_command_answers_help_in_the_same_shape(path, capsys):
    """usage line, a description sentence, the arguments each with a help line, `options:`."""
    text = _help(path, capsys)
    parser = COMMANDS[path]
    assert text.startswith(f"usage: mimir {' '.join(path)} ")
    paragraphs = text.split("\n\n")
    description = paragraphs[1]
    assert description[0].isupper() and description.rstrip().endswith((".", ")")), description
    assert "options:\n  -h, --help" in text
    undocumented = [a.option_strings or a.dest for a in parser._actions
                    if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert undocumented == [], f"mimir {' '.join(path)}: arguments without a help line"
    groups = command_groups(parser)
    if groups:  # a group: a required ACTION-like choice, each listed with its help line
        (group,) = groups
        assert group.required and group.metavar and group.metavar.isupper()
        assert all(choice.help for choice in group._choices_actions)


def _bad_inputs(tmp_path):
    """One bad input per data-preparation command, with the words its one line must hold."""
    afile = write_lines(tmp_path / "in.jsonl", [chat("q", "an answer")])
    missing = tmp_path / "missing"
    return {
        ("prepare",): (["-i", str(missing), "-t", TOK, "-o", str(tmp_path / "o"), "--workers", "1"],
                       "input file not found"),
        ("data", "report"): (["-m", str(missing)], "mixture file not found"),
        ("data", "demo"): (["-o", str(tmp_path / "demo"), "--tokenizer", str(missing), "--train-per-group",
                            "1", "--eval-per-group", "1"], "not a tokenizer directory"),
        ("data", "demo-tokenizer"): (["--output", str(afile / "tok")], "Not a directory"),
        ("data", "declare"): ([str(missing), "--source", "s"], "input file not found"),
        ("data", "keygen"): (["--output", str(afile / "key")], "Not a directory"),
        ("data", "sign"): ([str(tmp_path), "--key", str(missing)], "not a prepared dataset"),
        ("data", "pack"): (["-m", str(missing)], "mixture file not found"),
        ("synth", "tools"): (["-i", str(missing), "-o", str(tmp_path / "t.jsonl")], "input file not found"),
        ("synth", "run"): ([str(missing)], "pipeline file not found"),
    }


def test_every_data_preparation_command_has_a_bad_input_case(tmp_path):
    ours = {path for path in LEAVES if path[0] in DATA_PREP_COMMANDS}
    assert ours == set(_bad_inputs(tmp_path))


@pytest.mark.parametrize("path", sorted(p for p in LEAVES if p[0] in DATA_PREP_COMMANDS), ids=" ".join)
def test_a_bad_input_is_one_line_and_exit_code_2(path, tmp_path, caplog, capsys):
    argv, words = _bad_inputs(tmp_path)[path]
    with caplog.at_level(logging.INFO):
        assert main([*path, *argv]) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["mimir"], caplog.text
    (error,) = errors
    assert words in error.getMessage() and "\n" not in error.getMessage()
    assert error.exc_info is None and "Traceback" not in capsys.readouterr().err


def test_a_missing_tokenizer_is_a_user_error_for_library_callers(tmp_path):
    from mimir_data_prep.prepare import prepare

    from mimir_megatron.errors import UserError

    src = write_lines(tmp_path / "in.jsonl", [chat("q", "an answer")])
    with pytest.raises(UserError, match="not a tokenizer directory"):
        prepare([src], tmp_path / "no-tokenizer", tmp_path / "o", workers=1, progress=False)


def test_data_pack_builds_the_index_the_trainer_reads(tmp_path, capsys):
    from mimir_data_prep.pack_index import build_packing_index

    from mimir_megatron.data import DataConfig, PackedMixture

    mixture = make_mixture(tmp_path)
    assert main(["data", "pack", "-m", str(mixture), "--seq-len", "64", "--epochs", "2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    # The trainer's stream, built independently, finds the cached index and packs the same epochs.
    stream = PackedMixture(DataConfig(mixture=str(mixture), seq_len=64))
    cached = sorted(stream.index_dir.iterdir())
    for epoch in (0, 1):
        assert f"epoch {epoch}: {stream.epoch(epoch, 1).num_contexts:,} contexts" in out
    assert sorted(stream.index_dir.iterdir()) == cached  # nothing packed anew
    assert f"index cached in {stream.index_dir}" in out
    again = build_packing_index(mixture, seq_len=64, epochs=1, workers=1)
    assert again.index_dir == stream.index_dir and again.epochs[0].contexts == stream.epoch(0, 1).num_contexts
    assert 0 <= again.epochs[0].padding < 1
