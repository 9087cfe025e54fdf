"""TLS files named by environment variables, checked once where settings are read.

    context = tls_context(ca_cert=TlsFile("CONSUL_CACERT", path), ...)

Each failure is a `SettingsError` whose message names the variable and the
file: a CA file that does not exist or holds no certificate, a client
certificate that is not one, a key that is not a key, is encrypted, or does
not belong to the certificate. Python's ssl module would otherwise raise
`FileNotFoundError` or a bare `[SSL] PEM lib` from deep inside a connection.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from caravan_llm.common.errors import SettingsError


@dataclass(frozen=True, slots=True)
class TlsFile:
    """A path and the variable it came from (for the error message)."""

    variable: str
    path: str

    def __str__(self) -> str:
        return f"{self.variable}: file {self.path}"


class _EncryptedKeyError(Exception):
    """The key file asks for a password; caravan has none to give."""


def _no_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal.
    raise _EncryptedKeyError


def _check_readable(file: TlsFile) -> None:
    path = Path(file.path)
    if not path.exists():
        raise SettingsError(f"{file}: does not exist")
    if not path.is_file():
        raise SettingsError(f"{file}: is not a regular file")
    try:
        with path.open("rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise SettingsError(f"{file}: cannot be read: {exc.strerror or exc}") from None


def _check_directory(folder: TlsFile) -> None:
    if not Path(folder.path).is_dir():
        raise SettingsError(f"{folder.variable}: directory {folder.path} does not exist")


def _is_certificate(file: TlsFile) -> bool:
    try:
        ssl.create_default_context(cafile=file.path)
    except ssl.SSLError:
        return False
    return True


def tls_context(
    *,
    ca_cert: TlsFile | None = None,
    ca_path: TlsFile | None = None,
    client_cert: TlsFile | None = None,
    client_key: TlsFile | None = None,
) -> ssl.SSLContext:
    """A verifying client context from the given files (system CAs when none is given)."""
    for file in (ca_cert, client_cert, client_key):
        if file is not None:
            _check_readable(file)
    if ca_path is not None:
        _check_directory(ca_path)
    try:
        context = ssl.create_default_context(
            cafile=ca_cert.path if ca_cert else None, capath=ca_path.path if ca_path else None
        )
    except ssl.SSLError:
        # Only a CA file is read now (a directory's certificates are read when needed).
        raise SettingsError(f"{ca_cert}: holds no PEM certificate") from None
    if client_cert is None or client_key is None:
        return context
    try:
        context.load_cert_chain(client_cert.path, client_key.path, password=_no_password)
    except _EncryptedKeyError:
        raise SettingsError(f"{client_key}: is encrypted; give an unencrypted PEM key") from None
    except ssl.SSLError as exc:
        if not _is_certificate(client_cert):
            raise SettingsError(f"{client_cert}: is not a PEM certificate") from None
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise SettingsError(
                f"{client_key}: is not the private key of {client_cert.variable}"
            ) from None
        raise SettingsError(f"{client_key}: is not a PEM private key") from None
    return context


class TlsClientSettings(BaseModel):
    """The TLS files of a HashiCorp API client, read from the variables its CLI reads.

    `ConsulSettings` and `NomadSettings` extend it; `TLS_ENV_PREFIX` names their
    variables (`CONSUL_CACERT`, `NOMAD_CLIENT_KEY`, ...), and errors name them too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    TLS_ENV_PREFIX: ClassVar[str]

    ca_cert: str | None = None
    ca_path: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    @classmethod
    def tls_fields_from_env(cls, environ: Mapping[str, str]) -> dict[str, Any]:
        """The four file fields from `<PREFIX>_CACERT`, `_CAPATH`, `_CLIENT_CERT`, `_CLIENT_KEY`."""
        prefix = cls.TLS_ENV_PREFIX
        client_cert = environ.get(f"{prefix}_CLIENT_CERT") or None
        client_key = environ.get(f"{prefix}_CLIENT_KEY") or None
        if bool(client_cert) != bool(client_key):
            raise SettingsError(
                f"{prefix}_CLIENT_CERT and {prefix}_CLIENT_KEY must be set together"
            )
        return {
            "ca_cert": environ.get(f"{prefix}_CACERT") or None,
            "ca_path": environ.get(f"{prefix}_CAPATH") or None,
            "client_cert": client_cert,
            "client_key": client_key,
        }

    def check_tls_files(self) -> None:
        """Raise `SettingsError` for a named TLS file that cannot be used.

        Checked even for plain http: a TLS file that was named but cannot be used
        is a mistake to report when settings are read, by its variable, not at
        first connect.
        """
        if self.ca_cert or self.ca_path or self.client_cert:
            self._verifying_context()

    def _verifying_context(self) -> ssl.SSLContext:
        prefix = self.TLS_ENV_PREFIX

        def file(suffix: str, path: str | None) -> TlsFile | None:
            return TlsFile(f"{prefix}_{suffix}", path) if path else None

        return tls_context(
            ca_cert=file("CACERT", self.ca_cert),
            ca_path=file("CAPATH", self.ca_path),
            client_cert=file("CLIENT_CERT", self.client_cert),
            client_key=file("CLIENT_KEY", self.client_key),
        )

    def client_context(self, *, verify: bool) -> ssl.SSLContext:
        """The TLS context of an https client; `verify=False` skips the server's certificate."""
        context = self._verifying_context()
        if not verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context
