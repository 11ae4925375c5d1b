"""May training go on from this checkpoint with this configuration? Where to resume from (falling
back past damaged checkpoints), and the resume checks. Training policy: the checkpoint package
only reads, writes and verifies."""

from __future__ import annotations

import logging
from pathlib import Path

from mimir_megatron import checkpoint as ckpt
from mimir_megatron.checkpoint.compat import check_compatible
from mimir_megatron.checkpoint.digests import CheckpointDamaged, Verification
from mimir_megatron.checkpoint.layout import complete_checkpoints
from mimir_megatron.checkpoint.trainer_state import TrainerState
from mimir_megatron.errors import UserError
from mimir_megatron.integrity import Fingerprint
from mimir_megatron.train.config import TrainConfig

log = logging.getLogger("mimir.train")

# What may change between save and resume without --allow-config-change: the layout of the same
# computation (how the global batch is split, whether Adam state is sharded) and reporting.
_LAYOUT_SETTINGS = {"train.micro_batch_size", "train.log_interval", "train.peak_tflops", "optim.shard_state",
                    "optim.distributed_optimizer", "optim.fully_shard", "train.collective_timeout_s"}
_COMPARED_SECTIONS = ("train", "window", "optim")
_COMPARED_MODEL_FIELDS = ("h_cycles", "l_cycles", "window_policy")


def resume_path(cfg: TrainConfig) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for: none (``never``), the run's own latest
    (``auto``; None when there is none yet), or a given checkpoint in any of its forms."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        return ckpt.latest_checkpoint(cfg.checkpoint_dir)
    return ckpt.resolve(mode)  # a step_N directory, or a checkpoints (or run) directory's latest


def verified_resume(cfg: TrainConfig, asked: Path, verification: Verification | None = None
                    ) -> tuple[Path, TrainerState]:
    """(checkpoint, its state) to resume from: ``asked`` if its files verify; else, when the run
    resumes from a directory (``auto``, a checkpoints or run directory), the newest written
    checkpoint of that directory that verifies, said in a warning. A damaged checkpoint is
    never deleted (the trainer then sets it aside with the abandoned timeline). A damaged
    ``step_N`` asked for by name is an error. Collective."""
    from mimir_megatron.checkpoint.load import verify_collectively

    try:
        return asked, verify_collectively(asked, verification)
    except CheckpointDamaged as exc:
        if cfg.checkpoint.resume != "auto" and ckpt.is_checkpoint(Path(cfg.checkpoint.resume)):
            raise
        damaged = str(exc)
    log.warning("%s; looking for the newest checkpoint that verifies", damaged)
    others = [p for p in reversed(complete_checkpoints(asked.parent)) if p.resolve() != asked.resolve()]
    for candidate in others:
        try:
            state = verify_collectively(candidate)
        except CheckpointDamaged as exc:
            log.warning("%s", exc)
            continue
        log.warning("resuming from %s, the newest checkpoint that verifies, instead of the damaged %s "
                    "(kept: nothing is deleted)", candidate, asked.name)
        return candidate, state
    raise UserError(f"{damaged}; no other checkpoint in {asked.parent} verifies "
                    f"({len(others)} tried; nothing was deleted)")


def config_changes(saved: TrainerState, cfg: TrainConfig) -> list[str]:
    """One line per training setting that differs from the checkpoint's: the trajectory changes."""
    before, now = saved.config, cfg.to_dict()
    pairs = [(f"{section}.{key}", before.get(section, {}), key, value)
             for section in _COMPARED_SECTIONS for key, value in now[section].items()]
    pairs += [(f"model.{key}", saved.model, key, now["model"][key])
              for key in _COMPARED_MODEL_FIELDS]
    return [
        f"{name}: checkpoint {old[key]!r}, config {value!r}"
        for name, old, key, value in pairs
        # A setting added since the checkpoint was written has no recorded value to compare.
        if name not in _LAYOUT_SETTINGS and key in old and old[key] != value
    ]


def data_changed(saved: TrainerState, fingerprint: Fingerprint) -> bool:
    """Whether the data mixture differs from the one ``saved`` was trained on (a fingerprint
    recorded by an earlier version's encoding of the same mixture matches)."""
    return not fingerprint.matches(saved.data_fingerprint)


def check_resumable(saved: TrainerState, cfg: TrainConfig, path: Path, fingerprint: Fingerprint) -> list[str]:
    """Refuse a changed data mixture or training configuration unless allowed; returns the
    accepted configuration changes (to be recorded)."""
    check_compatible(saved, cfg.model, path)
    if data_changed(saved, fingerprint) and not cfg.checkpoint.allow_data_change:
        raise UserError(
            f"the data mixture changed since {path} was written "
            f"(fingerprint {saved.data_fingerprint[:12]} -> {fingerprint[:12]}); "
            "pass checkpoint.allow_data_change=true to resume anyway"
        )
    changes = config_changes(saved, cfg)
    if changes and not cfg.checkpoint.allow_config_change:
        raise UserError(
            f"the training configuration changed since {path} was written:\n  - "
            + "\n  - ".join(changes)
            + "\npass --allow-config-change (checkpoint.allow_config_change=true) to resume anyway"
        )
    return changes
