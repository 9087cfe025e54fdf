"""Real PEM files for the TLS settings tests, made with the `openssl` command."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """A self-signed certificate with its key, a key of another pair, and files that are not PEM."""

    cert: Path
    key: Path
    other_key: Path
    encrypted_key: Path
    junk: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _pair(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}-key.pem"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
    )  # fmt: skip
    return cert, key


def make_tls_material(folder: Path) -> TlsMaterial:
    cert, key = _pair(folder, "client")
    _, other_key = _pair(folder, "other")
    encrypted = folder / "encrypted-key.pem"
    _openssl("rsa", "-in", str(key), "-aes256", "-passout", "pass:secret", "-out", str(encrypted))
    junk = folder / "junk.pem"
    junk.write_text("not a certificate\n", encoding="utf-8")
    return TlsMaterial(cert=cert, key=key, other_key=other_key, encrypted_key=encrypted, junk=junk)
