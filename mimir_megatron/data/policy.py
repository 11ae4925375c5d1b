"""The data policy: which datasets a mixture may train on directly, checked before step 1.

A mixture YAML may carry a ``data_policy`` section; without one the paper's definition of
permissible data applies (§7, Appendix A)::

    data_policy:
      allow_bases: [open-licence, public-domain, tdm-research, synthetic]
                                  # agreement data only through a dataset derived from it
      allow_licenses: [open]      # `open`: every licence the ScanCode licence database files as
                                  # Permissive, Copyleft, Copyleft Limited or Public Domain
                                  # (mimir_megatron.data.licences); NC, ND, LicenseRef-* and
                                  # other ids only when listed here by name
      deny_licenses: []           # licence ids never trained on (e.g. CC-BY-SA-4.0)
      allow_agreement_derived: true   # synthetic data under the proprietary-agreement licence
                                      # (derived from agreement data, the paper's route)
      allow_groups: null          # null: any audit group; else e.g. [A, C, D]
      allow_unknown: false        # datasets (or parents) with no declared provenance
      public_key: null            # an Ed25519 public key: only manifests it signed (signing.py)

The licence judged is the dataset's effective terms: its record's licence, which keeps every
ancestor's terms (:mod:`mimir_megatron.data.provenance` refuses a record that drops one). Data
under the TDM research exception (basis ``tdm-research``) is judged by its basis, not its licence.

:func:`training_data_problems` lists every dataset that breaks the policy, whose manifest or
provenance record was edited or does not validate, whose input files changed since it was
prepared (when they are still on disk), or whose prepared files are damaged (structure every
time; sha256 against the manifest unless ``data.verify`` is off): one line each, the dataset and
the field or file named. ``mimir train`` trains nothing while the list is not empty.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError

from .licences import AGREEMENT, is_open, licence_category, license_keys, satisfiable
from mimir_megatron.integrity import sha256_file

from .manifest import Manifest
from .prepared import ByteShares, DigestCache, hash_outputs, output_problems, shard_problems
from .provenance import BASES, UNKNOWN, Provenance, normalise_license, provenance_from_record, record_problem

log = logging.getLogger(__name__)

PAPER_BASES = ["open-licence", "public-domain", "tdm-research", "synthetic"]
OPEN = "open"
"""In allow_licenses: every open licence (mimir_megatron.data.licences.is_open)."""


@dataclass
class DataPolicy:
    allow_bases: list[str] = field(default_factory=lambda: list(PAPER_BASES))
    """Permission bases that may be trained on directly."""
    allow_licenses: list[str] = field(default_factory=lambda: [OPEN])
    """Licence ids that may be trained on (an OR needs one allowed branch, an AND all its
    operands); ``open`` stands for every open licence."""
    deny_licenses: list[str] = field(default_factory=list)
    """Licence ids that may never be trained on."""
    allow_agreement_derived: bool = True
    """Train on synthetic data whose terms are the proprietary-agreement licence (derived from
    agreement data whose agreement states no other terms for it)."""
    allow_groups: list[str] | None = None
    """Audit groups that may be trained on; None: any."""
    allow_unknown: bool = False
    """Train on datasets (or datasets derived from data) whose provenance nobody declared."""
    public_key: str | None = None
    """An Ed25519 public key (PEM): train only on datasets whose manifest it signed
    (:mod:`mimir_megatron.data.signing`)."""

    def errors(self, where: str) -> list[str]:
        errors = [f"{where}.allow_bases: unknown basis {b!r} (one of {', '.join(BASES)})"
                  for b in self.allow_bases if b not in BASES]
        if self.allow_licenses is None:
            errors.append(f"{where}.allow_licenses: a list of licence ids ([{OPEN}] is every open licence)")
        if self.public_key:
            from .signing import public_key_problem

            problem = public_key_problem(self.public_key)
            if problem:
                errors.append(f"{where}.public_key: {problem}")
        for name in ("allow_licenses", "deny_licenses"):
            for i, key in enumerate(getattr(self, name) or []):
                if name == "allow_licenses" and key == OPEN:
                    continue
                _, problem = normalise_license(str(key))
                if problem:
                    errors.append(f"{where}.{name}[{i}]: {problem}")
        return errors

    @property
    def is_default(self) -> bool:
        return self == DataPolicy()

    def describe(self) -> str:
        """One line for the log and the release documents."""
        if self.is_default:
            return "the paper's default (open licences, public domain, TDM research, synthetic; agreement " \
                   "data only through data derived from it)"
        return f"custom: {asdict(self)}"


def parse_policy(values: Any, where: str, errors: list[str]) -> DataPolicy:
    """The typed policy of a mixture's ``data_policy`` section (the paper's rule when absent)."""
    from mimir_megatron.yaml_config import typed_section

    policy = typed_section(DataPolicy, values, where, errors)
    errors += policy.errors(where)
    return policy


def policy_problems(name: str, record: dict[str, Any] | None, policy: DataPolicy,
                    audit_group: str | None) -> list[str]:
    """Why the policy forbids training on dataset ``name`` with provenance ``record``."""
    where = f"dataset {name}"
    try:
        provenance = provenance_from_record(record, f"{where}: provenance")
    except UserError as exc:
        return [str(exc)]
    if provenance is None:
        if policy.allow_unknown:
            return []
        return [f"{where}: provenance unknown (prepared without a declaration): declare it "
                "(mimir prepare --source/--license/--basis/--form) or set data_policy.allow_unknown"]
    problems = []
    if provenance.basis not in policy.allow_bases:
        hint = " (agreement data is trained on only through a dataset derived from it)" \
            if provenance.basis == "agreement" else ""
        problems.append(f"{where}: basis {provenance.basis} is not in data_policy.allow_bases "
                        f"{policy.allow_bases}{hint}")
    if provenance.license == UNKNOWN:
        if not policy.allow_unknown:
            parents = ", ".join(provenance.unknown_ancestors())
            problems.append(f"{where}: license unknown (inherited from {parents}, which declared none)")
    else:
        problems += _licence_problems(where, provenance, policy)
    unknown_parents = provenance.unknown_ancestors()
    if unknown_parents and not policy.allow_unknown and provenance.license != UNKNOWN:
        problems.append(f"{where}: derived_from {', '.join(unknown_parents)}, whose provenance is unknown")
    if policy.allow_groups is not None and audit_group not in policy.allow_groups:
        problems.append(f"{where}: audit group {audit_group} is not in data_policy.allow_groups "
                        f"{policy.allow_groups}")
    return problems


def _licence_problems(where: str, provenance: Provenance, policy: DataPolicy) -> list[str]:
    """The dataset's effective terms against the policy's licence rules (one line, or none)."""
    denied = {_key(k).lower() for k in policy.deny_licenses}
    listed = {_key(k).lower() for k in policy.allow_licenses or [] if k != OPEN}
    # The TDM exception does not depend on the licence; agreement data is judged by its basis.
    judge_terms = provenance.basis not in ("tdm-research", "agreement")

    def ok(key: str) -> bool:
        if key.lower() in denied:
            return False
        if not judge_terms or key.lower() in listed:
            return True
        if key == AGREEMENT:
            return provenance.basis == "synthetic" and policy.allow_agreement_derived
        return OPEN in (policy.allow_licenses or []) and is_open(key)

    if satisfiable(provenance.license, ok):
        return []
    refused = [k for k in dict.fromkeys(license_keys(provenance.license)) if not ok(k)]
    reasons = []
    for key in refused:
        if key.lower() in denied:
            reasons.append(f"{key} is in data_policy.deny_licenses")
        elif key == AGREEMENT:
            reasons.append(f"{key} is trained on only as synthetic data derived from agreement data "
                           "(data_policy.allow_agreement_derived)")
        elif key.startswith("LicenseRef-"):
            reasons.append(f"{key} is not a standard licence: list it in data_policy.allow_licenses to "
                           "train on it")
        else:
            reasons.append(f"{key} is not an open licence (ScanCode category {licence_category(key)}): "
                           "list it in data_policy.allow_licenses to train on it")
    return [f"{where}: license {provenance.license}: {'; '.join(reasons)}"]


def _key(license_id: str) -> str:
    normalised, _ = normalise_license(license_id)
    return normalised or license_id


def changed_inputs(manifest: Manifest) -> list[str]:
    """Input files of a prepared dataset that are on disk but no longer what was prepared.

    A file whose size and modification time are as recorded is taken as unchanged (reading
    100s of GB at every start would cost minutes); otherwise its sha256 decides. Files that are
    gone are not reported (inputs are often deleted once prepared)."""
    changed = []
    for source in manifest.sources:
        path = Path(source.path)
        if source.sha256 is None or not path.is_file():
            continue
        stat = path.stat()
        if stat.st_size == source.bytes and stat.st_mtime_ns == source.mtime_ns:
            continue
        if stat.st_size != source.bytes or sha256_file(path) != source.sha256:
            changed.append(str(path))
    return changed


def training_data_problems(mixture, *, verify: bool = True, rank: int = 0, world: int = 1,
                           digest_cache: Path | None = None) -> list[str]:
    """Every reason not to train on ``mixture`` (a :class:`~mimir_megatron.data.mixture.Mixture`):
    unreadable or edited manifests, changed inputs, damaged prepared files, policy violations;
    one line each.

    ``verify``: hash every prepared file against its manifest (threads, all datasets at once);
    off, only the structural checks run. ``rank``/``world``: a job's ranks hash a share each
    (split by bytes, :class:`~.prepared.ByteShares`) and the caller gathers their lines; every
    other check is cheap and made by every rank. ``digest_cache``: a directory where the digests
    of files hashed before are kept (:class:`~.prepared.DigestCache`); unchanged files are not
    read again. None: every file is hashed."""
    problems: list[str] = []
    files: list[tuple[str, list[str], list]] = []  # (dataset, structural lines, files being hashed)
    threads = max(1, min(8, os.cpu_count() or 1))
    started, hashed, shares = time.perf_counter(), [0, 0], ByteShares(world)
    cache = DigestCache(digest_cache, rank) if verify and digest_cache is not None else None
    with ThreadPoolExecutor(threads, thread_name_prefix="verify-data") as pool:
        def submit(path: Path, shared: bool = True) -> Future:
            hashed[0] += 1
            size = path.stat().st_size if path.is_file() else 0
            if shared and shares.owner(size) != rank:
                skipped: Future = Future()
                skipped.set_result(None)  # another rank's share
                return skipped
            hashed[1] += size
            return pool.submit(cache.sha256 if cache is not None else sha256_file, path)

        for entry in mixture.entries:
            if entry.repeat == 0:
                continue  # listed, never trained on
            try:
                # Unverified here: an edit is listed with the dataset's other problems.
                manifest = Manifest.read(entry.path, verify_digest=False)
            except UserError as exc:
                problems.append(f"dataset {entry.name}: {exc}")
                continue
            edited = False
            for problem in (manifest.digest_problem, record_problem(manifest.provenance)):
                if problem:
                    edited = True
                    problems.append(f"dataset {entry.name}: {entry.path / 'manifest.json'}: {problem}")
            for path in changed_inputs(manifest):
                problems.append(f"dataset {entry.name}: input {path} changed since it was prepared "
                                "(its sha256 differs from the manifest's); prepare it again")
            record = manifest.provenance
            try:
                provenance = provenance_from_record(record, f"dataset {entry.name}: "
                                                            f"{entry.path / 'manifest.json'}: provenance")
            except UserError as exc:
                problems.append(str(exc))
            else:
                if not edited:  # an edited record's verdict means nothing
                    problems += policy_problems(entry.name, record, mixture.policy,
                                                entry.audit_group_of(provenance))
            if mixture.policy.public_key:
                from .signing import signature_problem

                problem = signature_problem(entry.path, manifest, mixture.policy.public_key)
                if problem:
                    problems.append(f"dataset {entry.name}: {problem}")
            structural = shard_problems(entry.path, manifest)
            # A dataset with a structural problem is hashed whole by every rank: its digests then
            # name the damaged or swapped file itself, the same line on every rank.
            pending = hash_outputs(entry.path, manifest, lambda p, s=not structural: submit(p, s)) \
                if verify else []
            files.append((entry.name, structural, pending))
        for name, structural, pending in files:
            lines = _file_lines(structural, output_problems(pending))
            problems += [f"dataset {name}: {line}" for line in lines]
    if verify:
        seconds = time.perf_counter() - started
        reused = ""
        if cache is not None:
            cache.save()
            reused = f", {cache.reused} unchanged since an earlier start and not read again"
        log.info("prepared data: %d files (%.2f GB on this rank%s) verified against their manifests' sha256 "
                 "in %.1f s", hashed[0], hashed[1] / 1e9, reused, seconds)
    else:
        log.warning("prepared data: structure checked, sha256 not verified (data.verify=false: for "
                    "trusted corpora only)")
    return problems


def _file_lines(structural: list[str], digests: list[str]) -> list[str]:
    """One line per damaged file: its digest line, or the structural line naming the same file
    (which says more: truncated, another shard's index); structural lines alone without digests."""
    if not digests:
        return structural
    said = {line.split(": ", 1)[0]: line for line in structural}
    return [said.get(line.split(": ", 1)[0], line) for line in digests]


def stat_signature(path: Path) -> dict[str, int]:
    """What :func:`changed_inputs` compares first: size and modification time."""
    stat = os.stat(path)
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
