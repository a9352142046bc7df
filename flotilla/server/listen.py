"""The server's listening sockets, bound before the model loads.

`runtime serve` binds its address first: a port that is taken is one error line at once, not
after a minute of loading weights and reserving the KV cache, and no other process can take the
port while the model loads. The sockets are bound but not listening until the server starts
(asyncio calls listen()), so a client that comes early is refused rather than left hanging.
"""
from __future__ import annotations

import errno
import socket

from flotilla.errors import FlotillaError


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """One bound TCP socket per address `host` resolves to (as asyncio's create_server would bind);
    with port 0, the port the first one got is used for the rest."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise FlotillaError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            if sockets and port == 0:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sockets.append(_bind(family, kind, proto, address, host))
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


def _bind(family: int, kind: int, proto: int, address: tuple, host: str) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 address gets its own socket
        sock.bind(address)
    except OSError as e:
        sock.close()
        where = f"{host or address[0]}:{address[1]}"
        if e.errno == errno.EADDRINUSE:
            raise FlotillaError(f"cannot listen on {where}: the port is already in use (is another server "
                                f"running?); pick another --port") from None
        if e.errno == errno.EACCES:
            raise FlotillaError(f"cannot listen on {where}: permission denied (ports below 1024 need root); "
                                f"pick another --port") from None
        raise FlotillaError(f"cannot listen on {where}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock
