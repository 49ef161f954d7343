"""Where a server may listen. Loopback by default; anything else is an explicit choice.

tritonserver has no authentication of its own: a `--host` that is not a loopback address exposes
every model (and the model-control API) to the network, so it needs `--allow-remote` and prints a
warning. In Kubernetes the pod must listen on all interfaces (the Service forwards to the pod IP);
the manifests of `dspark deploy` pass `--allow-remote` for that reason and rely on the cluster's
network policy.
"""

from __future__ import annotations

import ipaddress


class ExposureError(ValueError):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: could resolve anywhere


def check_host(host: str, allow_remote: bool) -> str | None:
    """None for loopback; a warning to print when remote binding is allowed; else ExposureError."""
    if is_loopback(host):
        return None
    if not allow_remote:
        raise ExposureError(
            f"--host {host} is not a loopback address: the server has no authentication, so binding "
            "it beyond this machine needs --allow-remote (and a firewall or network policy in front)"
        )
    return (
        f"listening on {host}: every model and the model-control API are reachable from the network "
        "without authentication"
    )
