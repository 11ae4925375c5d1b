"""Runtime data: prepared datasets, mixtures, packing, and the loader that yields ``Batch``es.

Offline preparation (``mimir prepare``, ``mimir data ...``) lives in ``data_prep/``, which builds on
this package; nothing here imports it.
"""

from mimir_megatron.lazy import lazy_exports

# Imported on first use: reading a training config (``data.config``) must not import torch (the
# loader), so that `mimir train` can report a config mistake before torch and megatron load.
_EXPORTS = {
    "DataConfig": ".config",
    "EvalSample": ".eval", "load_eval_samples": ".eval",
    "PackedMixture": ".loader", "build_train_loader": ".loader", "collate": ".loader",
    "mixture_fingerprint": ".loader",
    "Mixture": ".mixture", "MixtureEntry": ".mixture", "load_mixture": ".mixture",
    "DataPolicy": ".policy", "training_data_problems": ".policy",
    "Provenance": ".provenance",
    "EpochIndex": ".packing", "build_epoch_index": ".packing", "epoch_plan": ".packing", "pack": ".packing",
    "padding_fraction": ".packing",
    "Manifest": ".manifest", "write_manifest": ".manifest",
    "PreparedDataset": ".prepared",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
