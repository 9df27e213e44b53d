"""A real gRPC server for tests/integration/grpc.rs, without protoc or generated code.

Methods (raw bytes in and out, identity serializers):
  /echo.Echo/Say    unary: returns the request bytes.
  /echo.Echo/Count  server-streaming: the request is an ASCII integer N; streams
                    the N messages b"0" .. b"N-1".
  /echo.Echo/Stats  unary: a JSON object of how many Say and Count calls this
                    server has handled, so a test can tell which calls reached
                    it (Stats calls are not counted).

Listens on 127.0.0.1 only (plaintext HTTP/2, h2c), prints READY once it
does, and stops on SIGTERM or SIGINT.
"""

import argparse
import json
import signal
import sys
import threading
from concurrent import futures

import grpc


def identity(b):
    return b


class Counts:
    """Calls handled per method; handlers run on a thread pool."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = {"Say": 0, "Count": 0}

    def add(self, method):
        with self._lock:
            self._counts[method] += 1

    def snapshot(self):
        with self._lock:
            return dict(self._counts)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    counts = Counts()

    def say(request, context):
        counts.add("Say")
        return request

    def count(request, context):
        counts.add("Count")
        try:
            n = int(request.decode("ascii"))
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request must be an ASCII integer")
        for i in range(n):
            yield str(i).encode("ascii")

    def stats(request, context):
        return json.dumps(counts.snapshot()).encode()

    handler = grpc.method_handlers_generic_handler(
        "echo.Echo",
        {
            "Say": grpc.unary_unary_rpc_method_handler(
                say, request_deserializer=identity, response_serializer=identity
            ),
            "Count": grpc.unary_stream_rpc_method_handler(
                count, request_deserializer=identity, response_serializer=identity
            ),
            "Stats": grpc.unary_unary_rpc_method_handler(
                stats, request_deserializer=identity, response_serializer=identity
            ),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((handler,))
    # add_insecure_port returns 0 when it cannot bind; fail loudly then.
    if server.add_insecure_port(f"127.0.0.1:{args.port}") == 0:
        print(f"cannot bind 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
        sys.exit(1)
    server.start()

    stopping = threading.Event()

    def on_signal(signum, frame):
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("READY", flush=True)
    # Wake up now and then so the signal handler (main thread only) runs.
    while not stopping.wait(0.2):
        pass
    server.stop(grace=1).wait(2)


if __name__ == "__main__":
    main()
