"""Free loopback ports and progress lines."""

import socket
import time


def free_ports(n):
    """n free TCP ports on 127.0.0.1, all distinct: each bound to port 0 (all
    held at once) and released, so another process could take one in between;
    whoever starts a server on one checks that it really listens."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def log(msg):
    """A progress line: the time of day, then msg."""
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def warn(msg):
    log(f"WARNING: {msg}")
