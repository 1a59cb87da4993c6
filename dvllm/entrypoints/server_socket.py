"""The server's listening socket, bound before the model loads: a taken port fails in a second."""
from __future__ import annotations

import errno
import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening; uvicorn does that), as uvicorn would bind it;
    ValueError with a one-line reason when the address is taken, unknown or not ours to bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn: a restart may reuse a port whose old connections sit in TIME_WAIT. A port another
    # socket listens on still fails to bind.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {_address(host, port)}: {_reason(e)}") from None
    return sock


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "the address is already in use (another server on that port? pick another with --port)"
    if e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    if e.errno == errno.EADDRNOTAVAIL:
        return "this machine has no such address (check --host)"
    return e.strerror or str(e)  # e.g. socket.gaierror for an unknown host name
