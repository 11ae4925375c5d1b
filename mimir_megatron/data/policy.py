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
      allow_personal_data: false  # datasets whose screen found direct identifiers and kept them
                                  # (prepared with --personal-data report)
      allow_unknown_base: false   # continue from weights whose training data is not recorded
      public_key: null            # an Ed25519 public key: only manifests it signed (signing.py)

The licence judged is the dataset's effective terms (:func:`~.provenance.effective_terms`): its
own licence AND every parent's terms AND its generator's; a record that drops an ancestor's term
is refused when it is read. Data under the TDM research exception (basis ``tdm-research``) is
judged by its basis, not its licence.

:func:`training_data_problems` lists every dataset that breaks the policy, whose manifest or
provenance record was edited or does not validate, whose parents changed since it was derived
from them (or whose lineage loops), whose input files changed since it was prepared (when they are
still on disk), or whose prepared files are damaged (structure every time; sha256 against the
manifest unless ``data.verify`` is off and the policy names no public key): one line each, the
dataset and the field or file named. ``mimir train`` trains nothing while the list is not empty.
:func:`lineage_policy_problems` judges what a checkpoint records a run trained on (a resumed run's
data, the base model of a continued one) by the same rules.
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

from .licences import AGREEMENT, base_licence, is_open, licence_category, license_keys, satisfiable
from mimir_megatron.integrity import sha256_file

from .manifest import Manifest, PersonalDataScreen
from .prepared import ByteShares, DigestCache, hash_outputs, output_problems, shard_problems
from .provenance import (
    BASES,
    UNKNOWN,
    Provenance,
    ancestry_problems,
    effective_terms,
    normalise_license,
    provenance_from_record,
    record_problem,
)

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
    allow_personal_data: bool = False
    """Train on datasets whose personal-data screen found direct identifiers and kept them
    (``mimir prepare --personal-data report``); the paper's rule excludes personal data."""
    allow_unknown_base: bool = False
    """Continue training (``checkpoint.init_from``) from weights whose training data is not
    recorded (``mimir import`` weights, a checkpoint without lineage)."""
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
                    audit_group: str | None, personal_data: PersonalDataScreen | None = None) -> list[str]:
    """Why the policy forbids training on dataset ``name`` with provenance ``record`` (and the
    personal-data screen ``personal_data`` of its manifest)."""
    where = f"dataset {name}"
    return _provenance_problems(where, record, policy, audit_group) + \
        personal_data_problems(where, personal_data, policy)


def personal_data_problems(where: str, screen: PersonalDataScreen | None, policy: DataPolicy) -> list[str]:
    """Direct identifiers the screen found and kept (``--personal-data report``), unless the
    policy allows them: one line naming the counts."""
    kept = screen.kept if screen is not None else {}
    if not kept or policy.allow_personal_data:
        return []
    counts = ", ".join(f"{n:,} {kind}" for kind, n in kept.items())
    return [f"{where}: personal data: its screen found {sum(kept.values()):,} direct identifier(s) "
            f"({counts}) and kept them (--personal-data {screen.policy}); prepare it again with "
            "--personal-data reject or redact, or set data_policy.allow_personal_data: true"]


def _provenance_problems(where: str, record: dict[str, Any] | None, policy: DataPolicy,
                         audit_group: str | None) -> list[str]:
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
    terms = effective_terms(provenance)
    if terms == UNKNOWN:
        if not policy.allow_unknown:
            problems.append(f"{where}: license unknown ({'; '.join(provenance.unknown_terms())}): "
                            "declare it, or set data_policy.allow_unknown")
    else:
        problems += _licence_problems(where, provenance, terms, policy)
    if policy.allow_groups is not None and audit_group not in policy.allow_groups:
        problems.append(f"{where}: audit group {audit_group} is not in data_policy.allow_groups "
                        f"{policy.allow_groups}")
    return problems


def _licence_problems(where: str, provenance: Provenance, terms: str, policy: DataPolicy) -> list[str]:
    """The dataset's effective terms against the policy's licence rules (one line, or none)."""
    denied = {_key(k).lower() for k in policy.deny_licenses}
    listed = {_key(k).lower() for k in policy.allow_licenses or [] if k != OPEN}
    # The TDM exception does not depend on the licence; agreement data is judged by its basis.
    judge_terms = provenance.basis not in ("tdm-research", "agreement")

    def named(key: str, names: set[str]) -> bool:  # "X WITH e" is named by itself or by X
        return key.lower() in names or base_licence(key).lower() in names

    def ok(key: str) -> bool:
        if named(key, denied):
            return False
        if not judge_terms or named(key, listed):
            return True
        if key == AGREEMENT:
            return provenance.basis == "synthetic" and policy.allow_agreement_derived
        return OPEN in (policy.allow_licenses or []) and is_open(key)

    if satisfiable(terms, ok):
        return []
    refused = [k for k in license_keys(terms) if not ok(k)]
    reasons = []
    for key in refused:
        if named(key, denied):
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
    return [f"{where}: license {terms}: {'; '.join(reasons)}"]


def lineage_policy_problems(entries, policy: DataPolicy, where: str) -> list[str]:
    """The datasets a checkpoint records a model trained on (``DatasetLineage`` entries: a resumed
    run's own, a base model's), judged by ``policy`` as the gate judges a mixture: provenance,
    licences, audit groups, personal data kept. Datasets of which nothing was trained on are not
    judged. One line each, prefixed ``where``."""
    problems: list[str] = []
    for entry in entries:
        if not (entry.tokens or entry.documents):
            continue
        screen = _screen(entry.personal_data)
        problems += [f"{where}: {line}" for line in policy_problems(
            entry.name, entry.provenance, policy, entry.audit_group, screen)]
    return problems


def model_lineage_problems(lineage, base, policy: DataPolicy, where: str) -> list[str]:
    """Why ``policy`` forbids a model trained on ``lineage`` (``DatasetLineage`` entries; None: not
    recorded) and continued from ``base`` (a checkpoint's ``BaseModel``, and what it started from
    in turn): every dataset anything in that chain trained on is judged; weights whose training
    data is not recorded are refused unless the policy allows them (``allow_unknown_base``)."""
    problems = [] if lineage is None else lineage_policy_problems(lineage, policy, where)
    while base is not None:
        origin = f"base model {base.source}" + (f" (step {base.step})" if base.step is not None else "")
        if base.lineage is None:
            if not policy.allow_unknown_base:
                problems.append(f"{origin}: its training data is not recorded (imported weights, or a "
                                "checkpoint without lineage), so the data policy cannot judge it; set "
                                "data_policy.allow_unknown_base: true to continue from it")
        else:
            problems += lineage_policy_problems(base.lineage, policy, origin)
        base = base.base_model
    return problems


def _screen(recorded: Any) -> PersonalDataScreen | None:
    """The personal-data screen a lineage entry recorded (None: none recorded)."""
    if not isinstance(recorded, dict):
        return None
    return PersonalDataScreen(policy=str(recorded.get("policy")), found=dict(recorded.get("found") or {}),
                              documents_rejected=int(recorded.get("documents_rejected") or 0))


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
    verify = _verification_needed(mixture.policy, verify)
    problems: list[str] = []
    datasets: list[tuple[str, list[str], list]] = []  # (dataset, structural lines, files being hashed)
    with _OutputHashing(verify, rank, world, digest_cache) as hashing:
        for entry in mixture.entries:
            if entry.repeat == 0:
                continue  # listed, never trained on
            try:
                # Unverified here: an edit is listed with the dataset's other problems.
                manifest = Manifest.read(entry.path, verify_digest=False)
            except UserError as exc:
                problems.append(f"dataset {entry.name}: {exc}")
                continue
            problems += declaration_problems(entry, manifest, mixture.policy)
            structural = shard_problems(entry.path, manifest)
            datasets.append((entry.name, structural, hashing.start(entry.path, manifest, structural)))
        for name, structural, pending in datasets:
            lines = _file_lines(structural, output_problems(pending))
            problems += [f"dataset {name}: {line}" for line in lines]
    return problems


def _verification_needed(policy: DataPolicy, verify: bool) -> bool:
    """``data.verify``, except that a policy asking for signed manifests always verifies: a
    signature vouches for the manifest, the files' hashes carry it to the shards."""
    if policy.public_key and not verify:
        log.warning("data.verify=false, but data_policy.public_key is set: signed datasets' files are "
                    "verified against their manifests all the same")
        return True
    return verify


class _OutputHashing:
    """The prepared files' sha256 against their manifests: hashed in threads across all datasets
    at once, a share per rank (split by bytes), unchanged files' digests taken from the cache;
    the files hashed and the time logged at the end. Off (``verify=False``): nothing is hashed."""

    def __init__(self, verify: bool, rank: int, world: int, digest_cache: Path | None) -> None:
        self.verify, self.rank, self.shares = verify, rank, ByteShares(world)
        self.cache = DigestCache(digest_cache, rank) if verify and digest_cache is not None else None
        self.files = self.bytes = 0

    def __enter__(self) -> _OutputHashing:
        self.started = time.perf_counter()
        self.pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="verify-data")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.shutdown()
        if exc[0] is None:
            self._log()

    def start(self, path: Path, manifest: Manifest, structural: list[str]) -> list:
        """Start hashing the files of the dataset at ``path`` (:func:`~.prepared.output_problems`
        reads the verdicts). A dataset with a structural problem is hashed whole by every rank:
        its digests then name the damaged or swapped file itself, the same line on every rank."""
        if not self.verify:
            return []
        return hash_outputs(path, manifest, lambda file: self._submit(file, shared=not structural))

    def _submit(self, path: Path, shared: bool) -> Future:
        self.files += 1
        size = path.stat().st_size if path.is_file() else 0
        if shared and self.shares.owner(size) != self.rank:
            skipped: Future = Future()
            skipped.set_result(None)  # another rank's share
            return skipped
        self.bytes += size
        return self.pool.submit(self.cache.sha256 if self.cache is not None else sha256_file, path)

    def _log(self) -> None:
        if not self.verify:
            log.warning("prepared data: structure checked, sha256 not verified (data.verify=false: for "
                        "trusted corpora only)")
            return
        reused = ""
        if self.cache is not None:
            self.cache.save()
            reused = f", {self.cache.reused} unchanged since an earlier start and not read again"
        log.info("prepared data: %d files (%.2f GB on this rank%s) verified against their manifests' sha256 "
                 "in %.1f s", self.files, self.bytes / 1e9, reused, time.perf_counter() - self.started)


def declaration_problems(entry, manifest: Manifest, policy: DataPolicy) -> list[str]:
    """The checks of one dataset of a mixture (``entry``) that read its records, not its data: its
    manifest and provenance record intact, its inputs unchanged, its provenance valid and allowed
    by ``policy`` (personal data included), its parents unchanged since it was derived from them,
    its manifest signed when the policy asks. One line each, naming the dataset."""
    where = f"dataset {entry.name}"
    problems, edited = [], False
    for problem in (manifest.digest_problem, record_problem(manifest.provenance)):
        if problem:
            edited = True
            problems.append(f"{where}: {entry.path / 'manifest.json'}: {problem}")
    for path in changed_inputs(manifest):
        problems.append(f"{where}: input {path} changed since it was prepared (its sha256 differs from the "
                        "manifest's); prepare it again")
    record = manifest.provenance
    try:
        provenance = provenance_from_record(record, f"{where}: {entry.path / 'manifest.json'}: provenance")
    except UserError as exc:
        problems.append(str(exc))
    else:
        if not edited:  # an edited record's verdict means nothing
            problems += policy_problems(entry.name, record, policy, entry.audit_group_of(provenance),
                                        manifest.personal_data)
            if provenance is not None:
                problems += ancestry_problems(provenance, entry.path, where)
    if policy.public_key:
        from .signing import signature_problem

        problem = signature_problem(entry.path, manifest, policy.public_key)
        if problem:
            problems.append(f"{where}: {problem}")
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
