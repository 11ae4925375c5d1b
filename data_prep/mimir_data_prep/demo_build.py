"""`mimir data demo`: the demo's build, above its data and its tokenizer.

The demo data (:mod:`.demo_data`: seeded samples and their provenance) and the demo tokenizer
(:mod:`.demo_tokenizer`: trained on that data, committed) are built here into prepared datasets;
neither of them imports the other's user.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .demo_data import demo_provenance, write_demo
from .demo_tokenizer import DEMO_TOKENIZER_DIR

log = logging.getLogger(__name__)


def build_demo(
    output: str | Path, *, seed: int = 0, train_per_group: int = 3000, eval_per_group: int = 100,
    tokenizer: str | Path | None = None, seq_len: int = 256, workers: int | None = None,
    prepare: bool = True,
) -> list[Path]:
    """`mimir data demo`: write the raw demo files under ``output/raw`` and, with ``prepare``,
    prepare each into ``output/<name>`` with ``tokenizer`` (default: the bundled demo tokenizer)
    and its demo provenance. Returns the prepared dataset directories (the raw files without
    ``prepare``)."""
    output = Path(output)
    train_paths, eval_path = write_demo(output, seed, train_per_group, eval_per_group)
    log.info("wrote %d train files and %s", len(train_paths), eval_path)
    raw = train_paths + [eval_path]
    if not prepare:
        return raw
    from .prepare import prepare as prepare_dataset

    for path in raw:
        prepare_dataset([path], tokenizer or DEMO_TOKENIZER_DIR, output / path.stem, seq_len=seq_len,
                        workers=workers or 1, progress=False, provenance=demo_provenance(path.stem))
    return [output / path.stem for path in raw]
