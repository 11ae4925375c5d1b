"""Signed manifests: an Ed25519 signature over a prepared dataset's manifest digest.

Digests catch damage, not intent: whoever can edit a manifest can recompute its digests. A
signature made with a private key the editor does not hold cannot be recomputed. ``mimir data
keygen`` makes a key pair, ``mimir data sign --key KEY DATASET...`` writes ``manifest.sig`` beside
each manifest, and a mixture whose ``data_policy.public_key`` names the public key trains only on
datasets whose manifest carries a valid signature by it (:func:`signature_problem`, checked
with the policy before step 1). ``cryptography`` (the ``sign`` extra) does the Ed25519; nothing
imports it unless signing is used.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mimir_megatron.errors import UserError, write_error

if TYPE_CHECKING:
    from .manifest import Manifest

SIGNATURE_NAME = "manifest.sig"
FORMAT = "mimir-manifest-signature-v1"


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
    from mimir_megatron.integrity import write_json_atomic

    from .manifest import MANIFEST_NAME, Manifest

    manifest = Manifest.read(dataset, verify_digest=False)
    if manifest.digest_problem or manifest.digest is None:
        raise UserError(f"{Path(dataset) / MANIFEST_NAME}: {manifest.digest_problem}; not signed")
    key = _load(private_key, private=True)
    signature = key.sign(manifest.digest.encode())
    return write_json_atomic(Path(dataset) / SIGNATURE_NAME, {
        "format": FORMAT, "algorithm": "ed25519", "key_id": _key_id(key.public_key()),
        "digest": manifest.digest, "signature": base64.b64encode(signature).decode()}, indent=1)


def signature_problem(dataset: str | Path, manifest: Manifest, public_key: str | Path) -> str | None:
    """Why the manifest of ``dataset`` is not signed by ``public_key``, or None."""
    from cryptography.exceptions import InvalidSignature

    path = Path(dataset) / SIGNATURE_NAME
    if not path.is_file():
        return f"{path}: missing (data_policy.public_key requires signed manifests: mimir data sign)"
    try:
        body = json.loads(path.read_text())
        signature = base64.b64decode(body["signature"], validate=True)
        signed = body["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path}: not a manifest signature"
    if signed != manifest.digest:
        return (f"{path}: signs another manifest (digest {str(signed)[:12]}, the manifest's "
                f"{str(manifest.digest)[:12]})")
    try:
        _load(public_key, private=False).verify(signature, str(signed).encode())
    except InvalidSignature:
        return f"{path}: not signed by the key {public_key} (forged, or signed with another key)"
    return None
