"""systemd's notify protocol (sd_notify(3)), spoken directly: one datagram per message to $NOTIFY_SOCKET.

READY=1 once the engine has loaded and fitted, STATUS= while loading and parked, WATCHDOG=1 at half the
WatchdogSec interval, STOPPING=1 on the way out, EXTEND_TIMEOUT_USEC= while the model is fetched (a download
that takes longer than the unit's TimeoutStartSec is progress, not a hang). Outside systemd (no NOTIFY_SOCKET)
every call is a no-op.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading


class Notifier:
    def __init__(self, address: str | None = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        if address and address.startswith("@"):
            address = "\0" + address[1:]          # an abstract socket
        self.address = address or None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str | int) -> bool:
        """notify(READY=1, STATUS="...") sends "READY=1\\nSTATUS=..."; returns whether it was sent."""
        if not self.address:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(self.address)
            sock.sendall(message)
        return True

    @contextlib.contextmanager
    def extending_start(self, status: str, every: float = 30.0):
        """While the block runs, tell systemd every `every` seconds to wait 3 x `every` more for READY=1."""
        if not self.address:
            yield
            return
        done = threading.Event()

        def extend() -> None:
            while True:
                self.notify(EXTEND_TIMEOUT_USEC=int(3 * every * 1e6), STATUS=status)
                if done.wait(every):
                    return

        thread = threading.Thread(target=extend, name="qwen4exp-extend-start", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), if systemd asked for them."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and int(pid) != os.getpid()):
            return None
        return int(usec) / 2e6
