"""`mimir prepare --part I/N` and `--merge`: one dataset prepared by several jobs (a Slurm array)
equals the dataset prepared by one run, byte for byte."""

from __future__ import annotations

import json

import pytest
from chat_lines import chat, write_lines
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
from mimir_data_prep.prepare import prepare, select_shards

from mimir_megatron.errors import UserError

TOK = str(DEMO_TOKENIZER_DIR)


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_three_parts_merged_equal_the_whole_byte_for_byte(tmp_path):
    lines = [chat(f"What is {i} + {i % 7}?", f"Answer: {i + i % 7}") for i in range(60)]
    lines[17] = "{not json"  # a reject: rejects.jsonl is merged too
    lines[41] = json.dumps({"prompt": "Copy exactly: stone", "completion": "stone"})
    src = write_lines(tmp_path / "in.jsonl", lines)
    common = dict(seq_len=256, workers=1, progress=False, shard_bytes=400)
    whole = prepare([src], TOK, tmp_path / "whole", **common)
    shards = len(whole.shards)
    assert shards >= 6, shards  # so that each of the three parts holds several shards

    parts = tmp_path / "parts"
    with pytest.raises(UserError, match=rf"cannot merge: shards 0-{shards - 1} of {shards} shards are not finished"):
        prepare([src], TOK, parts, merge=True, **common)
    for i in (2, 0, 1):  # array jobs finish in any order
        assert prepare([src], TOK, parts, part=f"{i}/3", **common) is None
        assert not (parts / "manifest.json").exists()
    merged = prepare([src], TOK, parts, merge=True, **common)
    assert merged.content == whole.content  # the records of two directories: their stored content
    assert tree(parts) == tree(tmp_path / "whole")


def test_a_merge_with_a_part_missing_names_the_shards(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [chat(f"q{i}", f"a{i} answer") for i in range(40)])
    common = dict(seq_len=256, workers=1, progress=False, shard_bytes=300)
    prepare([src], TOK, tmp_path / "out", part="0/2", **common)
    with pytest.raises(UserError, match=r"cannot merge: shards \d+-\d+ of \d+ shards are not finished \(run their "
                                        r"--part first"):
        prepare([src], TOK, tmp_path / "out", merge=True, **common)


def test_parts_cover_every_shard_once():
    for shards in (1, 7, 100):
        for n in (1, 3, 8):
            ids = [s for i in range(n) for s in select_shards(f"{i}/{n}", shards)]
            assert ids == list(range(shards))
    assert list(select_shards("3:6", 5)) == [3, 4]
    for bad in ("3/3", "a/b", "5:2", "-1/4"):
        with pytest.raises(UserError, match="expected I/N"):
            select_shards(bad, 10)


def test_the_command_line_refuses_part_with_merge_or_config(tmp_path, caplog):
    from mimir_megatron.cli import main

    src = write_lines(tmp_path / "in.jsonl", [chat("q", "an answer")])
    assert main(["prepare", "-i", str(src), "-t", TOK, "-o", str(tmp_path / "o"), "--part", "0/2", "--merge"]) == 2
    assert "--part prepares a range of shards, --merge assembles them afterwards: give one" in caplog.text
    assert main(["prepare", "--config", str(tmp_path / "x.yaml"), "--merge"]) == 2
    assert "--part/--merge prepare one dataset over several jobs" in caplog.text
    assert main(["prepare", "-i", str(src), "-t", TOK, "-o", str(tmp_path / "o"), "--part", "0/2",
                 "--workers", "1", "--no-progress"]) == 0
    assert not (tmp_path / "o" / "manifest.json").exists()
    assert main(["prepare", "-i", str(src), "-t", TOK, "-o", str(tmp_path / "o"), "--merge", "--workers", "1",
                 "--no-progress"]) == 2
    # One shard: part 0 of 2 holds none of it, so the merge names it.
    assert "cannot merge: shard 0 of 1 shards are not finished" in caplog.text
