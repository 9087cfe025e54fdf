"""The Nomad CLI's general options, for the commands that talk to Nomad.

`nomad` reads NOMAD_ADDR, NOMAD_NAMESPACE, NOMAD_REGION, NOMAD_CACERT,
NOMAD_CAPATH, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY, NOMAD_TLS_SERVER_NAME and
NOMAD_SKIP_VERIFY, and takes `-address`, `-namespace`, `-region`, `-ca-cert`,
`-ca-path`, `-client-cert`, `-client-key`, `-tls-server-name` and
`-tls-skip-verify` to override them. caravan takes the same flags (with one
dash, as Nomad spells them, or two). The token is read from NOMAD_TOKEN
only: a flag would show it in `ps`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

# flag name -> the variable it overrides
NOMAD_FLAGS: Mapping[str, str] = {
    "address": "NOMAD_ADDR",
    "namespace": "NOMAD_NAMESPACE",
    "region": "NOMAD_REGION",
    "ca-cert": "NOMAD_CACERT",
    "ca-path": "NOMAD_CAPATH",
    "client-cert": "NOMAD_CLIENT_CERT",
    "client-key": "NOMAD_CLIENT_KEY",
    "tls-server-name": "NOMAD_TLS_SERVER_NAME",
}


def add_nomad_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Nomad options (as the nomad CLI's; the token comes from NOMAD_TOKEN)"
    )
    for flag, variable in NOMAD_FLAGS.items():
        group.add_argument(
            f"-{flag}",
            f"--{flag}",
            dest=f"nomad_{flag.replace('-', '_')}",
            metavar=flag.split("-")[-1].upper(),
            help=f"overrides {variable}",
        )
    group.add_argument(
        "-tls-skip-verify",
        "--tls-skip-verify",
        dest="nomad_tls_skip_verify",
        action="store_true",
        help="do not verify Nomad's certificate (overrides NOMAD_SKIP_VERIFY)",
    )


def nomad_environ(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment with the Nomad flags given on the command line applied."""
    merged = dict(os.environ if environ is None else environ)
    for flag, variable in NOMAD_FLAGS.items():
        value = getattr(args, f"nomad_{flag.replace('-', '_')}", None)
        if value is not None:
            merged[variable] = value
    if getattr(args, "nomad_tls_skip_verify", False):
        merged["NOMAD_SKIP_VERIFY"] = "true"
    return merged
