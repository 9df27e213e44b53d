# Container image for the rate-limiting gateway.
#
#   docker build -t ratelimit-gateway:0.1.0 .
#   docker run --rm --read-only --tmpfs /tmp -p 8080:8080 -p 9901:9901 \
#     -v "$PWD/gateway.toml:/etc/gateway/gateway.toml:ro" ratelimit-gateway:0.1.0
#
# The image ships no config: mount one at /etc/gateway/gateway.toml (in
# Kubernetes the ConfigMap in k8s/gateway-configmap.yaml does it). Its
# server.listen and server.admin_listen must bind 0.0.0.0, not 127.0.0.1, to be
# reachable from outside the container.
#
# The base release is Debian 13 "trixie", the current stable: bookworm is
# oldstable since August 2025 and gets security fixes for a shorter while,
# while trixie has years of them ahead. Build stage and runtime stage must use
# the same release, so the binary links against the glibc it runs with: change
# DEBIAN_RELEASE only, never one FROM alone.
#
# Packages are installed unpinned, deliberately: within one stable release
# Debian ships only security and important fixes, so the release is the pin,
# while a version pin (cmake=3.25.1-1) breaks the build at the next point or
# security release, which removes the pinned version from the mirror. Hence the
# hadolint ignore=DL3008 lines below. To freeze a build instead, pin the bases
# by digest (FROM debian:trixie-slim@sha256:...) and take packages from
# snapshot.debian.org.
#
# The binary is stripped here (the CARGO_PROFILE_RELEASE_* env below), not in
# Cargo.toml, whose release profile keeps line tables for local profiling.
#
# Without Docker: scripts/image.sh builds this file with buildah and runs the
# image (the test command does).
ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=trixie

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS build

# Pingora's zlib-ng (libz-ng-sys) is built with cmake, which needs make; the
# rust slim image has only gcc and libc6-dev. Unpinned: see the header.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        cmake \
        g++ \
        make \
        pkg-config \
    && rm -rf /var/lib/apt/lists/*

# A stripped binary without debug info: about half the size, and a faster
# build. Panics still name the panicking location; backtraces lose symbols.
ENV CARGO_PROFILE_RELEASE_DEBUG=0 \
    CARGO_PROFILE_RELEASE_STRIP=symbols

WORKDIR /src

# Dependency layer: build every dependency against stub sources, so that a
# change under src/ rebuilds only this crate. Every target Cargo.toml declares
# must exist here, benches included, or cargo refuses to read the manifest;
# so must the workspace's other member, the test tools (tools/), whose
# manifest is all the build reads of them: stubs stand for their binaries.
# `-p ratelimit-gateway`: the gateway's dependencies with its features alone,
# not the test tools' (a hyper server) unified in.
COPY Cargo.toml Cargo.lock ./
COPY tools/Cargo.toml ./tools/
RUN mkdir -p src benches tools/src/bin \
    && echo 'fn main() {}' > src/main.rs \
    && echo 'fn main() {}' > benches/algorithms.rs \
    && echo 'fn main() {}' > tools/src/bin/mock_upstream.rs \
    && echo 'fn main() {}' > tools/src/bin/tcp_forwarder.rs \
    && touch src/lib.rs \
    && cargo build --release --locked -p ratelimit-gateway --bin gateway \
    && cargo clean --release --package ratelimit-gateway \
    && rm -rf src benches

# Cleaning this crate's artifacts above matters: COPY keeps the sources' own
# mtimes, which may be older than the stubs', and cargo would then keep the
# stub binary.
COPY src ./src
COPY benches ./benches
# The stub binary prints nothing: a version string proves the real one was built.
RUN cargo build --release --locked -p ratelimit-gateway --bin gateway \
    && test -n "$(./target/release/gateway --version)"

FROM debian:${DEBIAN_RELEASE}-slim AS runtime

# The system roots: an upstream with tls = true and no ca_file is verified
# against them (TLS itself is rustls, compiled into the binary). Unpinned: see
# the header.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /src/target/release/gateway /usr/local/bin/gateway

# A numeric user that exists in no passwd file: Kubernetes' runAsNonRoot can
# only verify a numeric UID. The Deployment's preStop hook runs /bin/sleep,
# which this base image has (distroless would not).
USER 65532:65532

# 8080: proxy (server.listen); 9901: admin (server.admin_listen: /healthz,
# /readyz, /metrics).
EXPOSE 8080 9901

# SIGTERM (the default stop signal) drains in-flight requests for
# server.grace_period_secs, then exits.
ENTRYPOINT ["/usr/local/bin/gateway"]
CMD ["run", "--config", "/etc/gateway/gateway.toml"]
