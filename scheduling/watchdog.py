"""systemd's watchdog (`WatchdogSec=`): each worker's pulse says "WATCHDOG=1" once a tick while its
pool is not stuck (scheduling.stuck), so systemd restarts a pool whose pulses all fell silent:
frozen, hung in a way the pool cannot see, or stuck.

`sd_notify` is one datagram to the socket systemd names in $NOTIFY_SOCKET (an abstract socket when
it starts with "@"): no library needed. The workers are not the unit's main process, so the unit
needs `NotifyAccess=all` (docs/deploy.md). Without $NOTIFY_SOCKET this does nothing.
"""
import os
import socket

NOTIFY_SOCKET = "NOTIFY_SOCKET"


def notify(state: bytes = b"WATCHDOG=1") -> bool:
    """Send `state` to systemd; False when not under systemd's notify socket or it cannot be reached."""
    address = os.environ.get(NOTIFY_SOCKET, "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state, address)
    except OSError:
        return False
    return True
