"""Prints N free loopback TCP ports (default 1), one per line."""
import socket
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
socks = []
for _ in range(n):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
for s in socks:
    print(s.getsockname()[1])
for s in socks:
    s.close()
