"""What one `mimir bench` run measures: the request (`mimir bench`'s flags) and its variants.

Below the run (:mod:`.run`) and the report (:mod:`.report`), which both read it; the request says
what of it the bench's JSON records (:meth:`BenchRequest.to_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Variant:
    """One configuration of our model to measure: a name and model ``key=value`` overrides."""

    name: str
    overrides: list[str]


@dataclass(frozen=True)
class BenchRequest:
    """What one run measures (`mimir bench`'s flags; the defaults are the command's)."""

    shape: str = "tiny"
    config: str | None = None  # a model YAML instead of ``shape``
    windows: tuple[int, ...] = (5,)
    seq_len: int = 256
    micro_batch: int = 4
    samples_per_context: int = 1
    steps: int = 5
    warmup: int = 2
    precision: str = "auto"
    optimizer: str = "adamw"
    lr: float = 1e-4
    clip_grad: float = 1.0
    ema_decay: float = 0.9999
    variants: tuple[Variant, ...] = ()  # none: our model as configured, named "mimir-megatron"
    overrides: tuple[str, ...] = ()  # model key=value overrides for every variant
    peer: bool = True
    peer_checkpointing: bool = False
    peak_tflops: float | None = None  # None: the GPU table's, unknown on CPU (no MFU)
    json_path: Path | None = None

    @property
    def our_variants(self) -> tuple[Variant, ...]:
        """The variants measured: those given, else our model as configured."""
        return self.variants or (Variant("mimir-megatron", []),)

    def to_dict(self) -> dict[str, Any]:
        """What the bench's JSON records of the request: the model, the batch, the precision and
        the step's settings."""
        return {"shape": self.config or self.shape, "windows": list(self.windows), "seq_len": self.seq_len,
                "micro_batch": self.micro_batch, "samples_per_context": self.samples_per_context,
                "precision": self.precision,
                "step": {"optimizer": self.optimizer, "lr": self.lr, "clip_grad": self.clip_grad,
                         "ema_decay": self.ema_decay}}
