"""Runtime data: prepared datasets, mixtures, packing, and the loader that yields ``Batch``es.

Offline preparation (``mimir prepare``, ``mimir data ...``) lives in ``data_prep/``, which builds on
this package; nothing here imports it.
"""

from .config import DataConfig
from .eval import EvalSample, load_eval_samples
from .loader import PackedMixture, build_train_loader, collate, mixture_fingerprint
from .mixture import Mixture, MixtureEntry, load_mixture
from .packing import EpochIndex, build_epoch_index, epoch_plan, pack, padding_fraction
from .prepared import PreparedDataset, read_manifest

__all__ = [
    "DataConfig",
    "EpochIndex",
    "EvalSample",
    "Mixture",
    "MixtureEntry",
    "PackedMixture",
    "PreparedDataset",
    "build_epoch_index",
    "build_train_loader",
    "collate",
    "epoch_plan",
    "load_eval_samples",
    "load_mixture",
    "mixture_fingerprint",
    "pack",
    "padding_fraction",
    "read_manifest",
]
