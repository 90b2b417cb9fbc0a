"""A helper the systemd tests share: what a datagram socket (our stand-in for systemd's notify socket) received
until it has been quiet for a while."""

from __future__ import annotations

import socket


def until_quiet(server: socket.socket, quiet: float) -> list[bytes]:
    """Every datagram that arrives until none has for `quiet` seconds."""
    server.settimeout(quiet)
    got = []
    try:
        while True:
            got.append(server.recv(4096))
    except TimeoutError:
        return got
