"""`mimir prepare` with parallel worker processes gives what one process gives (tests/unit/test_data_prepare.py has the rest)."""

from __future__ import annotations

import json

import numpy as np
from chat_lines import chat as _chat
from chat_lines import write_lines as _write_lines
from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR
from mimir_data_prep.prepare import prepare

TOK = str(DEMO_TOKENIZER_DIR)


def test_parquet_input_and_parallel_workers_match_serial(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Copy exactly: {i}"},
                {"role": "assistant", "content": f"{i} {i}"},
            ]
        }
        for i in range(6)
    ]
    rows[3] = {"messages": [{"role": "user", "content": "no answer"}]}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=2)
    lines = [_chat(f"Sort: {i}, 1", f"1, {i}") for i in range(40)]
    src = _write_lines(tmp_path / "in.jsonl", lines)
    inputs = [tmp_path / "in.parquet", src]

    serial = prepare(
        inputs, TOK, tmp_path / "s", seq_len=256, workers=1, shard_bytes=600, progress=False
    )
    parallel = prepare(
        inputs, TOK, tmp_path / "p", seq_len=256, workers=2, shard_bytes=600, progress=False
    )
    assert len(serial.shards) > 4  # 3 row groups + several JSONL byte ranges
    assert serial.outputs == parallel.outputs
    assert serial.rejects["no_final_assistant"] == 1 and serial.documents == 45
    reject = json.loads((tmp_path / "p" / "rejects.jsonl").read_text())
    assert reject["line"] == 4 and reject["file"].endswith("in.parquet")
    # JSONL shards start on line boundaries and number their lines correctly.
    shards = serial.content["shards"]  # where each shard came from: fields the record does not name
    firsts = [s["first_line"] for s in shards if s["source"].endswith(".jsonl")]
    counts = [s["lines"] for s in shards if s["source"].endswith(".jsonl")]
    assert firsts == list(np.cumsum([1] + counts[:-1])) and sum(counts) == 40


def test_a_config_in_worker_processes_equals_its_datasets_one_after_another(tmp_path):
    """Four datasets' shards interleaved over three worker processes, the derived dataset's manifest
    written after its parent's: the same bytes as the datasets prepared in turn."""
    from mimir_data_prep.prepare_config import run_prepare_config
    from prepare_configs import one_after_another, tree, write_config

    config = write_config(tmp_path)
    reference = one_after_another(config, shard_bytes=700)
    expected = tree(tmp_path / "out")
    (tmp_path / "out").rename(tmp_path / "reference")
    assert run_prepare_config(config, workers=3, progress=False, shard_bytes=700) == reference
    assert tree(tmp_path / "out") == expected
