"""An OTLP/HTTP sink for the traced bench targets: reads each POSTed batch
whole, counts its bytes and answers 200 with an empty protobuf body (an
ExportTraceServiceResponse with nothing in it), as a collector that keeps
up. It never decodes: its CPU is not what the bench measures."""

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    batches = 0
    received = 0

    def do_POST(self):  # noqa: N802 (the stdlib's name)
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        Sink.batches += 1
        Sink.received += n
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink)
    try:
        server.serve_forever()
    finally:
        print(f"otlp sink: {Sink.batches} batches, {Sink.received} bytes", flush=True)
