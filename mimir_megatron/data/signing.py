"""Signed manifests: an Ed25519 signature over a prepared dataset's manifest digest.

Digests catch damage, not intent: whoever can edit a manifest can recompute its digests. A
signature made with a private key the editor does not hold cannot be recomputed. ``mimir data
keygen`` makes a key pair, ``mimir data sign --key KEY DATASET...`` writes ``manifest.sig`` beside
each manifest, and a mixture whose ``data_policy.public_key`` names the public key trains only on
datasets whose manifest carries a valid signature by it (:func:`signature_problem`, checked
with the policy before step 1). ``cryptography`` (the ``sign`` extra) does the Ed25519; nothing
imports it unless signing is used. ``manifest.sig`` is a record (:class:`ManifestSignature`): one
writer, one reader, which checks its format and fields (a signature is its own integrity check:
it carries no digest).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mimir_megatron.errors import UserError, write_error
from mimir_megatron.integrity import RecordFields, read_json_object, write_json_atomic

if TYPE_CHECKING:
    from .manifest import Manifest

SIGNATURE_NAME = "manifest.sig"
FORMAT = "mimir-manifest-signature-v1"
ALGORITHM = "ed25519"


@dataclass(frozen=True)
class ManifestSignature:
    """``manifest.sig``: the signature of a manifest's digest, and the key that made it."""

    key_id: str
    """The first 16 hex digits of the sha256 of the raw public key."""
    digest: str
    """The manifest digest signed."""
    signature: bytes

    def write(self, dataset: str | Path) -> Path:
        return write_json_atomic(Path(dataset) / SIGNATURE_NAME, {
            "format": FORMAT, "algorithm": ALGORITHM, "key_id": self.key_id, "digest": self.digest,
            "signature": base64.b64encode(self.signature).decode()}, indent=1)

    @classmethod
    def read(cls, dataset: str | Path) -> ManifestSignature:
        """The signature beside the manifest of ``dataset``; a one-line :class:`UserError` naming
        the file when it is missing, of another format or algorithm, or a field is wrong."""
        path = Path(dataset) / SIGNATURE_NAME
        missing = f"{path}: missing (data_policy.public_key requires signed manifests: mimir data sign)"
        body = read_json_object(path, "manifest signature", missing=missing)
        found = body.get("format")
        if found != FORMAT:
            raise UserError(f"{path}: format {found!r} is not one this version of mimir reads (it reads "
                            f"{FORMAT!r}); sign the dataset again (mimir data sign)")
        f = RecordFields(body, path)
        f.get("algorithm", lambda v: v == ALGORITHM, repr(ALGORITHM))
        try:
            signature = base64.b64decode(f.str("signature"), validate=True)
        except (binascii.Error, ValueError):
            raise UserError(f"{path}: signature: base64 expected") from None
        return cls(key_id=f.str("key_id"), digest=f.str("digest"), signature=signature)


def generate_key(private_path: str | Path) -> tuple[Path, Path]:
    """A new Ed25519 key pair: ``private_path`` (PEM, mode 0600) and ``private_path.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private_path = Path(private_path)
    if private_path.exists():
        raise UserError(f"{private_path}: exists; keygen never overwrites a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:  # a missing or read-only directory, a file where a directory should be
        raise write_error(exc, private_path, "choose a KEY in a writable directory") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path = private_path.with_name(private_path.name + ".pub")
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def _load(path: str | Path, private: bool):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    try:
        data = Path(path).read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, TypeError):
        raise UserError(f"{path}: not a PEM {'private' if private else 'public'} key") from None
    if not isinstance(key, Ed25519PrivateKey if private else Ed25519PublicKey):
        raise UserError(f"{path}: not an Ed25519 key")
    return key


def public_key_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a usable public key, or None."""
    try:
        _load(path, private=False)
    except UserError as exc:
        return str(exc)
    return None


def _key_id(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_manifest(dataset: str | Path, private_key: str | Path) -> Path:
    """Sign the manifest of the prepared dataset ``dataset`` (its digest must be intact)."""
    from .manifest import MANIFEST_NAME, Manifest

    manifest = Manifest.read(dataset, verify_digest=False)
    if manifest.digest_problem or manifest.digest is None:
        raise UserError(f"{Path(dataset) / MANIFEST_NAME}: {manifest.digest_problem}; not signed")
    key = _load(private_key, private=True)
    return ManifestSignature(key_id=_key_id(key.public_key()), digest=manifest.digest,
                             signature=key.sign(manifest.digest.encode())).write(dataset)


def signature_problem(dataset: str | Path, manifest: Manifest, public_key: str | Path) -> str | None:
    """Why the manifest of ``dataset`` is not signed by ``public_key``, or None."""
    from cryptography.exceptions import InvalidSignature

    path = Path(dataset) / SIGNATURE_NAME
    try:
        signed = ManifestSignature.read(dataset)
    except UserError as exc:
        return str(exc)
    if signed.digest != manifest.digest:
        return (f"{path}: signs another manifest (digest {signed.digest[:12]}, the manifest's "
                f"{str(manifest.digest)[:12]})")
    try:
        _load(public_key, private=False).verify(signed.signature, signed.digest.encode())
    except InvalidSignature:
        return f"{path}: not signed by the key {public_key} (forged, or signed with another key)"
    return None
