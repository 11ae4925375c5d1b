"""The data configuration of a training run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path



@dataclass
class DataConfig:
    mixture: str = ""
    """Mixture YAML (configs/data/*.yaml); dataset paths in it resolve against its directory."""

    seq_len: int = 4096
    """Context length that whole samples are packed into; a sample occupies
    len(prefix) + len(response) - 1 positions."""

    seed: int = 1234
    """Seeds the epoch plan (repeats, shuffle, packing); the plan does not depend on world size."""

    pack_window: int = 16384
    """Samples per best-fit packing window. Larger packs tighter but the window is processed in
    Python; 16k keeps padding near 1 % on typical length mixes."""

    index_dir: str | None = None
    """Where the per-epoch packing index (.npy) is cached; default ``<first dataset>/../_index``."""

    pad_token_id: int = 0
    """Filler id for padding positions (segment 0, label -100: never attended to or trained on)."""

    prefetch: int = 2
    """Micro-batches built ahead on a background thread (pinned, copied asynchronously on GPU);
    0 builds each one when the step asks for it."""

    eval_path: str | None = None
    """A prepared held-out dataset for exact-match evaluation (see load_eval_samples)."""

    verify: bool = True
    """Before step 1, hash every prepared file against its manifest's sha256 (in parallel, the
    ranks sharing the work; docs/operations.md gives the cost). false: only the structural checks
    (sizes, document counts, dtype), for trusted, very large corpora; logged as a warning.
    ``mimir train --skip-data-verify`` sets it false."""

    verify_cache: bool = True
    """Remember the sha256 of every verified file in ``index_dir`` with its size, mtime and inode,
    and do not read a file again on a later start while those are unchanged. false: hash every
    file every start (``mimir train --reverify-data``)."""

    def index_directory(self, first_dataset: Path) -> Path:
        """``index_dir``, or its default beside the mixture's first dataset."""
        return Path(self.index_dir) if self.index_dir else Path(first_dataset).parent / "_index"

    def errors(self) -> list[str]:
        """Every invalid value, one line each. Values only; files are checked when the loader
        opens them, so configs load (and can be tested) before any data has been prepared."""
        errors = []
        if not isinstance(self.mixture, str):
            errors.append(f"data.mixture must be a path string, got {self.mixture!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            errors.append(f"data.seq_len must be an integer >= 2, got {self.seq_len!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            errors.append(f"data.seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.pack_window, int) or self.pack_window < 1:
            errors.append(f"data.pack_window must be a positive integer, got {self.pack_window!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            errors.append(f"data.prefetch must be an integer >= 0, got {self.prefetch!r}")
        if not isinstance(self.verify, bool):
            errors.append(f"data.verify must be true or false, got {self.verify!r}")
        if not isinstance(self.verify_cache, bool):
            errors.append(f"data.verify_cache must be true or false, got {self.verify_cache!r}")
        if not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            errors.append(f"data.pad_token_id must be >= 0, got {self.pad_token_id!r}")
        return errors

    def validate(self) -> "DataConfig":
        """Raise one ConfigError naming every mistake, one line each (the loader calls this)."""
        from mimir_megatron.yaml_config import raise_errors

        raise_errors(self.errors(), "invalid data settings")
        return self
