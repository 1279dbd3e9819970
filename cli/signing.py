"""Signatures of published models: `sluice publish --sign-key` signs the artifact's
sluice.json (which holds the sha256 of every other file it carries) with an Ed25519 private
key; a pull with SLUICE_ARTIFACT_PUBLIC_KEY set refuses an artifact without a valid signature
by that key. The keys are PEM files, as `openssl genpkey -algorithm ed25519` and
`openssl pkey -pubout` write them."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE = "io.sluice.signature"  # manifest annotation: base64 Ed25519 signature of sluice.json
SIGNER = "io.sluice.signature.key"  # manifest annotation: sha256 of the signer's public key (its id)


class SignatureError(ValueError):
    """A key that cannot be used, or an artifact whose signature does not verify."""


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def sign(data: bytes, private_key: Path) -> dict[str, str]:
    """The manifest annotations that sign `data` with the key in `private_key`."""
    try:
        key = serialization.load_pem_private_key(private_key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise SignatureError(f"signing key {private_key}: {err}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"signing key {private_key}: not an Ed25519 private key")
    return {SIGNATURE: base64.b64encode(key.sign(data)).decode(), SIGNER: key_id(key.public_key())}


def verify(data: bytes, annotations: dict[str, str], public_key: Path) -> None:
    """Nothing when `annotations` carry a signature of `data` by the key in `public_key`."""
    try:
        key = serialization.load_pem_public_key(public_key.read_bytes())
    except (OSError, ValueError, TypeError) as err:
        raise SignatureError(f"SLUICE_ARTIFACT_PUBLIC_KEY {public_key}: {err}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"SLUICE_ARTIFACT_PUBLIC_KEY {public_key}: not an Ed25519 public key")
    signature = annotations.get(SIGNATURE)
    if not signature:
        raise SignatureError("it is not signed, and SLUICE_ARTIFACT_PUBLIC_KEY asks for a signature by "
                             f"{key_id(key)}")
    try:
        key.verify(base64.b64decode(signature, validate=True), data)
    except (InvalidSignature, ValueError):
        signer = annotations.get(SIGNER, "an unknown key")
        raise SignatureError(f"its signature (by {signer}) does not verify "
                             f"with SLUICE_ARTIFACT_PUBLIC_KEY ({key_id(key)})") from None
