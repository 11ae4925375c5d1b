"""`mimir data demo`: the demo's build, above its data and its tokenizer.

The demo data (:mod:`.demo_data`: seeded samples and their provenance) and the demo tokenizer
(:mod:`.demo_tokenizer`: trained on that data, committed) are built here into prepared datasets;
neither of them imports the other's user.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mimir_megatron.data.manifest import FORMAT as MANIFEST_FORMAT
from mimir_megatron.integrity import directory_sha256, fingerprint, write_json_atomic

from .demo_data import GROUPS, LANGS, demo_provenance, write_demo
from .demo_tokenizer import DEMO_TOKENIZER_DIR

log = logging.getLogger(__name__)

RECIPE_FILE = "demo_recipe.json"
"""In the output directory: the fingerprint of the recipe its prepared datasets were built by.
A cache key, not a record: when it is missing, unreadable or different, ``reuse`` rebuilds."""


def build_demo(
    output: str | Path, *, seed: int = 0, train_per_group: int = 3000, eval_per_group: int = 100,
    tokenizer: str | Path | None = None, seq_len: int = 256, workers: int | None = None,
    prepare: bool = True, reuse: bool = False,
) -> list[Path]:
    """`mimir data demo`: write the raw demo files under ``output/raw`` and, with ``prepare``,
    prepare each into ``output/<name>`` with ``tokenizer`` (default: the bundled demo tokenizer)
    and its demo provenance. Returns the prepared dataset directories (the raw files without
    ``prepare``).

    ``reuse``: keep what ``output`` holds when this recipe built it (the same seed, sizes, sequence
    length, tokenizer, declared provenance and manifest format), else build it again, so a demo
    from an older version (whose declarations today's data rule refuses, say) is replaced rather
    than refused at training."""
    output = Path(output)
    tokenizer = Path(tokenizer or DEMO_TOKENIZER_DIR)
    names = [f"{group}-{lang}" for group in GROUPS for lang in LANGS] + ["eval"]
    recipe = fingerprint(_recipe(names, seed, train_per_group, eval_per_group, tokenizer, seq_len))
    stamp = output / RECIPE_FILE
    if prepare and reuse and _built_by(stamp, recipe) and all(
            (output / name / "manifest.json").is_file() for name in names):
        log.info("the demo data in %s is current (built by this recipe); kept", output)
        return [output / name for name in names]
    stamp.unlink(missing_ok=True)  # a build stopped half way is not current
    train_paths, eval_path = write_demo(output, seed, train_per_group, eval_per_group)
    log.info("wrote %d train files and %s", len(train_paths), eval_path)
    raw = train_paths + [eval_path]
    if not prepare:
        return raw
    from .prepare import prepare as prepare_dataset

    for path in raw:
        prepare_dataset([path], tokenizer, output / path.stem, seq_len=seq_len,
                        workers=workers or 1, progress=False, provenance=demo_provenance(path.stem))
    write_json_atomic(stamp, {"recipe": recipe})
    return [output / path.stem for path in raw]


def _recipe(names: list[str], seed: int, train_per_group: int, eval_per_group: int, tokenizer: Path,
            seq_len: int) -> dict[str, Any]:
    return {"seed": seed, "train_per_group": train_per_group, "eval_per_group": eval_per_group,
            "seq_len": seq_len, "manifest_format": MANIFEST_FORMAT,
            "tokenizer": directory_sha256(tokenizer) if tokenizer.is_dir() else str(tokenizer),
            "provenance": {name: demo_provenance(name).to_dict() for name in names}}


def _built_by(stamp: Path, recipe: str) -> bool:
    try:
        return json.loads(stamp.read_text(encoding="utf-8")).get("recipe") == recipe
    except (OSError, ValueError, AttributeError):
        return False
