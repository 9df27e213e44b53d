"""A real gRPC client for tests/integration/grpc.rs, without protoc or generated code.

Makes `--times` calls of one method over one channel (plaintext HTTP/2, h2c,
unless --ca is given: then TLS with that CA, ALPN h2) and prints one JSON line
per call:
  {"ok": true, "reply": ...}                 Say: the reply as text;
                                             Count: the list of streamed messages;
                                             Stats: the server's JSON object
  {"ok": false, "code": "RESOURCE_EXHAUSTED", "details": ..., "trailing": {...}}
                                             from grpc.RpcError
Every call has a deadline (--timeout), so the client never hangs.
"""

import argparse
import json
import sys

import grpc


def identity(b):
    return b


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, help="host:port")
    parser.add_argument("--call", choices=["say", "count", "stats"], required=True)
    parser.add_argument("--n", type=int, default=3, help="messages Count streams")
    parser.add_argument("--times", type=int, default=1, help="calls to make")
    parser.add_argument("--data", default="hello", help="what Say sends")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    parser.add_argument("--ca", help="CA file: use TLS, trusting it")
    parser.add_argument("--server-name", help="name the TLS certificate must hold")
    args = parser.parse_args()

    if args.ca:
        with open(args.ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        options = []
        if args.server_name:
            options.append(("grpc.ssl_target_name_override", args.server_name))
        channel = grpc.secure_channel(args.target, creds, options=options)
    else:
        channel = grpc.insecure_channel(args.target)

    with channel:
        say = channel.unary_unary(
            "/echo.Echo/Say", request_serializer=identity, response_deserializer=identity
        )
        count = channel.unary_stream(
            "/echo.Echo/Count", request_serializer=identity, response_deserializer=identity
        )
        stats = channel.unary_unary(
            "/echo.Echo/Stats", request_serializer=identity, response_deserializer=identity
        )
        for _ in range(args.times):
            try:
                if args.call == "say":
                    reply = say(args.data.encode(), timeout=args.timeout).decode()
                elif args.call == "count":
                    stream = count(str(args.n).encode("ascii"), timeout=args.timeout)
                    reply = [m.decode() for m in stream]
                else:
                    reply = json.loads(stats(b"", timeout=args.timeout))
                out = {"ok": True, "reply": reply}
            except grpc.RpcError as e:
                trailing = {}
                for key, value in e.trailing_metadata() or ():
                    if isinstance(value, bytes):
                        value = value.decode("latin-1")
                    trailing[key] = value
                out = {
                    "ok": False,
                    "code": e.code().name,
                    "details": e.details(),
                    "trailing": trailing,
                }
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
