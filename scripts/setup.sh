#!/usr/bin/env bash
# Installs what the gateway needs to build and test, if missing: cmake (Pingora
# builds zlib-ng with it), redis-server and redis-tools (the limiter's shared
# backend, used by the tests), python3-venv (load tests, manifest checks),
# curl and openssl (the TLS tests make their certificates and connect with them).
# Debian/Ubuntu packages via apt-get; Rust itself is assumed (rustup).
set -euo pipefail

# --for-tests: also what only the tests need (Chromium, grpcio); the run
# command (scripts/demo.sh) installs just what running needs.
for_tests=0
case "${1:-}" in
  --for-tests) for_tests=1 ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--for-tests]" >&2; exit 2 ;;
esac

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v c++ >/dev/null 2>&1 || missing+=(g++)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
# The holdout matrix's load generator (loadtest/bench/fixedrate.c) links OpenSSL.
if ((for_tests)); then
  [[ -e /usr/include/openssl/ssl.h ]] || missing+=(libssl-dev)
fi
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]} (apt-get)"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The browser CORS test (tests/integration/browser_cors.rs) drives a real headless
# Chromium: Debian's chromium package (about 10 s to install from a mirror).
if ((for_tests)) && ! command -v chromium >/dev/null 2>&1; then
  echo "setup: installing chromium (apt-get)"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
# A redis-server installed by the package may start as a system service on
# :6379; nothing here uses that one: tests and demos start their own.
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust with rustup (https://rustup.rs) first" >&2
  exit 1
fi
# The gRPC end-to-end test (tests/integration/grpc.rs) drives the gateway with a real
# gRPC client and server in Python; grpcio comes from PyPI into the repo's
# .venv, the same virtualenv scripts/check_deploy.sh uses (created the same way).
venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv"
if [[ ! -x $venv/bin/python || ! -x $venv/bin/pip ]]; then
  echo "setup: creating the Python virtualenv $venv"
  python3 -m venv --clear "$venv"
fi
if ((for_tests)) && ! "$venv/bin/python" -c 'import grpc' >/dev/null 2>&1; then
  echo "setup: installing grpcio into $venv (pip)"
  "$venv/bin/pip" install -q --disable-pip-version-check "grpcio==1.85.1"
fi
# The load-test smokes run side by side in the test command: their packages
# are installed here, once, not by each of them at the same time.
if ((for_tests)) && ! "$venv/bin/python" -c 'import locust, matplotlib' >/dev/null 2>&1; then
  echo "setup: installing loadtest/requirements.txt into $venv (pip)"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$(dirname "$venv")/loadtest/requirements.txt"
fi
