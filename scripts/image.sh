#!/usr/bin/env bash
# Builds the Dockerfile into an image and runs that image, without a Docker
# engine: buildah builds it (chroot isolation, private storage), and the image's
# root filesystem is then run the way the Kubernetes Deployment runs it: as the
# image's USER (65532), read-only root, a tmpfs /tmp, config mounted at
# /etc/gateway. Checks, through the image's own binary:
#   - gateway --version, and gateway check on k8s/gateway-configmap.yaml's TOML
#     (with its password file mounted where the Deployment mounts the Secret);
#   - with backend = "local": a request proxied to an upstream on loopback (200),
#     a small limit (429), a denied client (403), /readyz;
#   - with backend = "redis" (a password-protected redis-server of its own):
#     200 then 429 on a small limit, counters in Redis, /readyz says redis;
#   - SIGTERM drains: a request in flight completes, then the gateway exits 0.
# Reports the image's size, the binary layer's size and the build time.
#
#   scripts/image.sh
#   scripts/image.sh --binary target/release/gateway
#       builds only the runtime stage, with that binary (stripped) in place
#       of the build stage's (buildah --build-context build=...): what the
#       test command does, so the project is compiled once per run, not again
#       inside the image; the build stage itself is then not built (run
#       without --binary for that, as a user's `docker build .` does).
#   IMAGE_ARCHIVE=/tmp/gateway.tar scripts/image.sh   # also saves the image
#       (docker-archive, tagged ratelimit-gateway:0.1.0: docker load -i, kind
#       load image-archive, skopeo copy docker-archive:... docker://...)
#
# Registries are not reachable here, so the two bases the Dockerfile's FROM
# lines name are made locally once and reused ("stand-ins"), under the same
# names, so that `--pull=never` finds them: debian:<release>-slim from
# debootstrap --variant=minbase, and rust:<version>-slim-<release> from it plus
# the host's Rust toolchain (and the host's extra CA certificates, so that cargo
# reaches crates.io through whatever intercepts TLS here). The Dockerfile is
# built as it is. Everything (storage, layer cache, stand-ins) lives under
#   ${XDG_CACHE_HOME:-$HOME/.cache}/ratelimit-gateway/image  (or $IMAGE_CACHE)
# and nothing touches the system's container storage; delete that directory to
# start cold. Needs root (debootstrap, mount, chroot); installs buildah,
# debootstrap, redis-server and curl with apt-get when they are missing. The
# upstream is target/release/mock-upstream (cargo build --release --workspace).
#
# Exits non-zero, saying what failed, on any failure.
set -Eeuo pipefail

binary=""
while (($#)); do
  case $1 in
    --binary)
      [[ $# -ge 2 ]] || { echo "image.sh: --binary needs a file" >&2; exit 2; }
      binary=$2
      shift 2
      ;;
    --binary=*) binary=${1#*=} && shift ;;
    -h | --help)
      sed -n '2,/^set -Eeuo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *) echo "image.sh: unknown option $1 (see --help)" >&2 && exit 2 ;;
  esac
done
if [[ -n $binary ]]; then
  [[ -x $binary ]] || { echo "image.sh: --binary $binary: no executable file there" >&2; exit 2; }
  binary=$(realpath -- "$binary")
fi

root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd -- "$root"

cache=${IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ratelimit-gateway/image}
runroot=$cache/run
tag=localhost/ratelimit-gateway:test
mirror=${IMAGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${IMAGE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# A stand-in older than this is made again (the real ones are rebuilt upstream
# for every point release).
standin_max_age_days=30

t0=$SECONDS
say() { printf '[image %4ds] %s\n' $((SECONDS - t0)) "$*"; }
die() {
  printf 'image.sh: FAILED: %s\n' "$*" >&2
  exit 1
}
on_err() {
  # Only the script itself: a failure inside $(...) shows where it lands.
  [[ $BASHPID == "$$" ]] || return 0
  printf 'image.sh: FAILED at line %s: %s (exit %s)\n' "$1" "${2%%$'\n'*}" "$3" >&2
}
trap 'on_err "$LINENO" "$BASH_COMMAND" "$?"' ERR

((EUID == 0)) || die "needs root (debootstrap, mount, chroot): run it as root, or build with Docker (docker build .)"
[[ $root != "$cache"* && $cache != "$root"* ]] || die "the cache $cache must be outside the repository"

# --- cleanup ------------------------------------------------------------------

work="" # made once this run holds the lock
pids=()       # processes this script started, stopped by PID
containers=() # buildah working containers this script made

# unmount_below: unmounts whatever is still mounted below a working
# container's root (debootstrap's /proc when it failed half-way).
# unmount_below all: every mount of the private storage too (the containers'
# roots, overlay/ bind-mounted on itself), as after a reboot.
unmount_below() {
  local dir
  [[ -d $cache/storage ]] || return 0
  { findmnt -rn -o TARGET | grep -F "$cache/storage/" || true; } | sort -r | while read -r dir; do
    if [[ ${1:-} == all || $dir == */merged/* || $dir == "$cache/storage/vfs/dir/"*/* ]]; then
      umount -l -- "$dir" 2>/dev/null || true
    fi
  done
}

cleanup() {
  local rc=$? pid
  trap - ERR
  set +e
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  unmount_below
  for c in "${containers[@]}"; do
    [[ -z $c ]] || bah rm "$c" >/dev/null 2>&1
  done
  unmount_below all
  [[ -z $work ]] || rm -rf -- "$work"
  if ((rc != 0)); then
    echo "image.sh: failed after $((SECONDS - t0)) s (logs: $cache/logs)" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Runs "$@" with its output in $cache/logs/NAME.log, shown (the tail) only
# when it fails.
quiet() {
  local name=$1 log=$cache/logs/$1.log
  shift
  if ! "$@" </dev/null >"$log" 2>&1; then
    echo "---- last lines of $log" >&2
    tail -n 40 "$log" >&2
    die "$name: $*"
  fi
}

# --- 1. tools -----------------------------------------------------------------

step=0
nsteps=5
stage() {
  step=$((step + 1))
  say "$step/$nsteps $*"
}

stage "tools"
missing=()
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v gpgv >/dev/null 2>&1 || missing+=(gpgv)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
[[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] || missing+=(debian-archive-keyring)
if ((${#missing[@]})); then
  say "  installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  mkdir -p "$cache/logs"
  quiet apt-update apt-get update -qq
  quiet apt-install apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
say "  $(buildah --version)"

# --- 2. private storage -------------------------------------------------------

mkdir -p "$cache/logs" "$cache/storage"
# One run at a time per cache (a second one waits).
exec 9>"$cache/lock"
if ! flock -n 9; then
  say "  another scripts/image.sh holds $cache/lock: waiting"
  flock -w 3600 9 || die "timed out waiting for $cache/lock"
fi
# Another run's scratch dir here was left by a run that was SIGKILLed.
rm -rf /tmp/ratelimit-image.*
work=$(mktemp -d /tmp/ratelimit-image.XXXXXX)
chmod 755 "$work"

# overlay when this filesystem supports it (much faster), vfs otherwise; kept
# once chosen, since a storage root cannot change its driver.
if [[ ! -s $cache/driver ]]; then
  p=$(mktemp -d "$cache/probe.XXXXXX")
  mkdir "$p/l" "$p/u" "$p/w" "$p/m"
  if mount -t overlay overlay -o "lowerdir=$p/l,upperdir=$p/u,workdir=$p/w" "$p/m" 2>/dev/null; then
    umount "$p/m"
    echo overlay >"$cache/driver"
  else
    echo vfs >"$cache/driver"
  fi
  rm -rf -- "$p"
fi
driver=$(cat "$cache/driver")
cat >"$cache/storage.conf" <<EOF
[storage]
driver = "$driver"
graphroot = "$cache/storage"
runroot = "$runroot"
EOF
cat >"$cache/registries.conf" <<'EOF'
unqualified-search-registries = ["docker.io"]
short-name-mode = "permissive"
EOF
cat >"$cache/policy.json" <<'EOF'
{"default": [{"type": "insecureAcceptAnything"}]}
EOF
printf '[engine]\n' >"$cache/containers.conf"
export CONTAINERS_STORAGE_CONF=$cache/storage.conf
export CONTAINERS_REGISTRIES_CONF=$cache/registries.conf
export CONTAINERS_CONF=$cache/containers.conf
export BUILDAH_ISOLATION=chroot
export STORAGE_DRIVER=$driver
bah() {
  buildah --root "$cache/storage" --runroot "$runroot" --storage-driver "$driver" \
    --registries-conf "$cache/registries.conf" "$@"
}
policy=(--signature-policy "$cache/policy.json")

# Leftovers of an earlier run that was killed: nothing of this storage stays
# mounted between runs, so its run state starts afresh (as after a reboot), and
# every working container in it is this script's.
unmount_below all
rm -rf -- "$runroot"
mkdir -p "$runroot"
bah rm --all >/dev/null 2>&1 || true
say "  storage: $cache/storage ($driver), runroot $runroot"

# --- 3. stand-in base images --------------------------------------------------

# The names the FROM lines use, with the Dockerfile's ARG defaults.
rust_version=$(sed -n 's/^ARG RUST_VERSION=//p' Dockerfile | head -n1)
release=$(sed -n 's/^ARG DEBIAN_RELEASE=//p' Dockerfile | head -n1)
[[ -n $rust_version && -n $release ]] || die "Dockerfile: no ARG RUST_VERSION= or ARG DEBIAN_RELEASE= default"
runtime_base=docker.io/library/debian:$release-slim
builder_base=docker.io/library/rust:$rust_version-slim-$release
while read -r from; do
  from=${from//\$\{RUST_VERSION\}/$rust_version}
  from=${from//\$\{DEBIAN_RELEASE\}/$release}
  case docker.io/library/$from in
    "$runtime_base" | "$builder_base") ;;
    *) die "Dockerfile: FROM $from has no stand-in here (only $runtime_base and $builder_base)" ;;
  esac
done < <(awk 'toupper($1) == "FROM" { print $2 }' Dockerfile)

stage "stand-in base images ($runtime_base, $builder_base)"

label() { bah inspect --type image --format "{{index .OCIv1.Config.Labels \"$2\"}}" "$1" 2>/dev/null; }
now=$(date +%s)
fresh() { # IMAGE KEY VALUE: the image exists, is young enough, and has KEY=VALUE
  local made
  made=$(label "$1" stand-in.made) || return 1
  [[ $made =~ ^[0-9]+$ ]] || return 1
  ((now - made < standin_max_age_days * 86400)) || return 1
  [[ -z ${2:-} || $(label "$1" "$2") == "$3" ]]
}

# A working container, mounted; sets $ctr and $mnt.
new_container() {
  ctr=$(bah from "${policy[@]}" --pull=never --name "$2" "$1")
  containers+=("$ctr")
  mnt=$(bah mount "$ctr")
}

# An apt proxy the host is configured with, for the stand-ins' apt (the build's
# RUN apt-get runs there).
apt_proxy=$(apt-config dump 2>/dev/null | grep -Ei '^Acquire::https?::Proxy ' || true)

if fresh "$runtime_base"; then
  say "  $runtime_base: reused"
else
  say "  $runtime_base: debootstrap --variant=minbase $release (about a minute)"
  ctr=$(bah from "${policy[@]}" --name standin-runtime scratch)
  containers+=("$ctr")
  mnt=$(bah mount "$ctr")
  quiet debootstrap debootstrap --variant=minbase \
    --keyring=/usr/share/keyrings/debian-archive-keyring.gpg "$release" "$mnt" "$mirror"
  unmount_below
  # What the official slim image does (debuerreotype): no docs, man pages or
  # translations, apt keeps no downloaded packages or lists, no services start.
  mkdir -p "$mnt/etc/dpkg/dpkg.cfg.d"
  cat >"$mnt/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  cat >"$mnt/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  echo 'Acquire::Languages "none";' >"$mnt/etc/apt/apt.conf.d/docker-no-languages"
  echo 'Acquire::GzipIndexes "true";' >"$mnt/etc/apt/apt.conf.d/docker-gzip-indexes"
  printf 'APT::AutoRemove::SuggestsImportant "false";\n' >"$mnt/etc/apt/apt.conf.d/docker-autoremove-suggests"
  if [[ -n $apt_proxy ]]; then
    printf '%s\n' "$apt_proxy" >"$mnt/etc/apt/apt.conf.d/99host-proxy"
  fi
  printf '#!/bin/sh\nexit 101\n' >"$mnt/usr/sbin/policy-rc.d"
  chmod 755 "$mnt/usr/sbin/policy-rc.d"
  find "$mnt/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$mnt/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$mnt/usr/share/man/"* "$mnt/usr/share/info/"* "$mnt/usr/share/groff/"* "$mnt/usr/share/lintian/"*
  find "$mnt/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  rm -rf "$mnt/var/cache/apt/"*.bin "$mnt/var/cache/apt/archives/"*.deb "$mnt/var/lib/apt/lists/"* \
    "$mnt/var/log/"*.log "$mnt/var/log/apt/"* "${mnt:?}/dev/"* "$mnt/tmp/"* "$mnt/run/"*
  # The official image's apt sources.
  keyring=/usr/share/keyrings/debian-archive-keyring.pgp
  [[ -e $mnt$keyring ]] || keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  rm -f "$mnt/etc/apt/sources.list"
  cat >"$mnt/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $release $release-updates
Components: main
Signed-By: $keyring

Types: deb
URIs: $security_mirror
Suites: $release-security
Components: main
Signed-By: $keyring
EOF
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd bash --label stand-in.made="$now" --label stand-in.of="$runtime_base" "$ctr"
  quiet commit-runtime bah commit "${policy[@]}" --rm "$ctr" "$runtime_base"
  containers=("${containers[@]/$ctr/}")
  say "  $runtime_base: made"
fi

if [[ -n $binary ]]; then
  say "  $builder_base: not needed (--binary: the build stage is not built)"
else
# The host's Rust toolchain for RUST_VERSION (rustup's toolchain dir), or the
# one on PATH when its version matches.
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
sysroot=""
for d in "$rustup_home/toolchains/$rust_version"*-x86_64-unknown-linux-gnu; do
  if [[ -x $d/bin/cargo && -x $d/bin/rustc ]]; then
    sysroot=$(realpath -- "$d")
    break
  fi
done
if [[ -z $sysroot ]] && command -v rustc >/dev/null 2>&1; then
  # The default toolchain: a stand-in with another version still builds the
  # Dockerfile as it is (the real image has exactly RUST_VERSION).
  d=$(rustc --print sysroot)
  [[ ! -x $d/bin/cargo ]] || sysroot=$d
fi
[[ -n $sysroot ]] || die "no Rust toolchain with cargo on this host for the stand-in $builder_base (rustup toolchain install $rust_version)"
rustc_v=$("$sysroot/bin/rustc" -V)
[[ $rustc_v == "rustc $rust_version"* ]] ||
  say "  warning: no Rust $rust_version toolchain here: the stand-in $builder_base gets $rustc_v"
toolchain=$(basename -- "$sysroot")
[[ $toolchain == *-x86_64-unknown-linux-gnu ]] || toolchain=$rust_version-x86_64-unknown-linux-gnu

# The CA certificates the host adds to the system roots, and the bundles its
# environment points cargo or OpenSSL at: the stand-in builder trusts them too.
ca_files=()
for f in /usr/local/share/ca-certificates/*.crt /usr/local/share/ca-certificates/*/*.crt; do
  [[ -f $f ]] && ca_files+=("$f")
done
for v in CARGO_HTTP_CAINFO SSL_CERT_FILE; do
  f=${!v:-}
  if [[ -n $f && -f $f && $f != /etc/ssl/certs/ca-certificates.crt ]]; then
    ca_files+=("$f")
  fi
done
ca_sum=$( ( printf '%s\n' "$rustc_v" "$apt_proxy"; cat -- "${ca_files[@]}" /dev/null) | sha256sum | cut -c1-16)

if fresh "$builder_base" stand-in.inputs "$ca_sum" && [[ $(label "$runtime_base" stand-in.made) == "$(label "$builder_base" stand-in.base-made)" ]]; then
  say "  $builder_base: reused ($rustc_v)"
else
  say "  $builder_base: $runtime_base + gcc libc6-dev ca-certificates + $rustc_v"
  new_container "$runtime_base" standin-builder
  quiet builder-apt bah run "$ctr" -- sh -c 'apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*'
  if ((${#ca_files[@]})); then
    mkdir -p "$mnt/usr/local/share/ca-certificates/host"
    n=0
    for f in "${ca_files[@]}"; do
      n=$((n + 1))
      cp -- "$f" "$mnt/usr/local/share/ca-certificates/host/$n-$(basename -- "${f%.crt}").crt"
    done
    quiet builder-ca bah run "$ctr" -- update-ca-certificates
  fi
  # The toolchain as the official image lays it out, without its HTML docs.
  mkdir -p "$mnt/usr/local/rustup/toolchains/$toolchain" "$mnt/usr/local/cargo/bin"
  tar -C "$sysroot" --exclude=./share/doc -cf - . | tar -C "$mnt/usr/local/rustup/toolchains/$toolchain" -xf -
  for b in "$mnt/usr/local/rustup/toolchains/$toolchain/bin/"*; do
    ln -s "../../rustup/toolchains/$toolchain/bin/$(basename -- "$b")" "$mnt/usr/local/cargo/bin/"
  done
  printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\n' "$toolchain" \
    >"$mnt/usr/local/rustup/settings.toml"
  chmod -R a+rwX "$mnt/usr/local/rustup" "$mnt/usr/local/cargo"
  bah config \
    --env RUSTUP_HOME=/usr/local/rustup --env CARGO_HOME=/usr/local/cargo \
    --env PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env RUST_VERSION="${rustc_v#rustc }" \
    --label stand-in.made="$now" --label stand-in.of="$builder_base" \
    --label stand-in.inputs="$ca_sum" \
    --label stand-in.base-made="$(label "$runtime_base" stand-in.made)" "$ctr"
  quiet builder-check bah run "$ctr" -- sh -c 'cargo --version && rustc --version'
  quiet commit-builder bah commit "${policy[@]}" --rm "$ctr" "$builder_base"
  containers=("${containers[@]/$ctr/}")
  say "  $builder_base: made"
fi
fi

# --- 4. build -----------------------------------------------------------------

if [[ -n $binary ]]; then
  stage "buildah bud --layers --target runtime (the Dockerfile's runtime stage; log: $cache/logs/build.log)"
else
  stage "buildah bud --layers (the Dockerfile as it is; log: $cache/logs/build.log)"
fi
build_log=$cache/logs/build.log
: >"$build_log"
# Shows each step that runs (a step taken from the layer cache is only
# counted), a heartbeat every 30 s, and how many steps came from the cache.
progress() {
  local line="" buf="" last=$SECONDS crates=0 steps=0 cached=0 pending="" rc words
  while true; do
    if IFS= read -r -t 30 line; then
      line=$buf$line
      buf=""
      printf '%s\n' "$line" >>"$build_log"
      case $line in
        STEP\ * | \[*\]\ STEP\ *)
          [[ -z $pending ]] || say "  $pending"
          pending=""
          read -ra words <<<"$line" # squeezes the continuation lines' blanks
          line="${words[*]}"
          if [[ $line != *" FROM "* ]]; then
            steps=$((steps + 1))
            pending=${line:0:100}
          fi
          ;;
        "--> Using cache "*)
          [[ -z $pending ]] || cached=$((cached + 1))
          pending=""
          ;;
        *)
          [[ -z $pending ]] || say "  $pending"
          pending=""
          [[ $line != *" Compiling "* ]] || crates=$((crates + 1))
          ;;
      esac
    else
      rc=$?
      if ((rc > 128)); then
        buf+=$line
      else
        [[ -z $buf$line ]] || printf '%s\n' "$buf$line" >>"$build_log"
        break
      fi
    fi
    if ((SECONDS - last >= 30)); then
      [[ -z $pending ]] || say "  $pending"
      pending=""
      say "    ... building ($crates crates compiled so far)"
      last=$SECONDS
    fi
  done
  say "  $cached of $steps steps from the layer cache"
}
build_start=$SECONDS
prebuilt=()
if [[ -n $binary ]]; then
  # The build stage's output, as COPY --from=build reads it.
  mkdir -p "$work/prebuilt/src/target/release"
  if command -v strip >/dev/null 2>&1; then
    strip -o "$work/prebuilt/src/target/release/gateway" "$binary"
  else
    cp -- "$binary" "$work/prebuilt/src/target/release/gateway"
  fi
  "$work/prebuilt/src/target/release/gateway" --version >/dev/null
  prebuilt=(--build-context "build=$work/prebuilt" --target runtime)
  say "  the build stage replaced by $binary (stripped: $(du -h "$work/prebuilt/src/target/release/gateway" | cut -f1))"
fi
if ! bah bud "${policy[@]}" --pull=never --layers --isolation chroot "${prebuilt[@]}" \
  -t "$tag" -f Dockerfile . 2>&1 </dev/null | progress; then
  echo "---- last lines of $build_log" >&2
  tail -n 40 "$build_log" >&2
  die "buildah bud (log: $build_log)"
fi
build_secs=$((SECONDS - build_start))
image_id=$(bah inspect --type image --format '{{.FromImageID}}' "$tag")
say "  built $tag in ${build_secs} s (image ${image_id:0:12})"

# Sizes: the image's layers as stored (uncompressed), the runtime base's, and
# the top layer, which is the binary's (COPY --from=build).
sizes=$(bah inspect --type image --format '{{.Manifest}}' "$tag" | python3 -c '
import json, sys
m = json.load(sys.stdin)
layers = [l["size"] for l in m["layers"]]
print(sum(layers), layers[-1], len(layers))
')
read -r image_bytes binary_layer_bytes nlayers <<<"$sizes"
base_bytes=$(bah inspect --type image --format '{{.Manifest}}' "$runtime_base" | python3 -c '
import json, sys
print(sum(l["size"] for l in json.load(sys.stdin)["layers"]))
')
mb() { awk -v b="$1" 'BEGIN { printf "%.1f MB", b / 1e6 }'; }

# --- 5. the image's layer cache: drop images no longer on this build's chain --

# With --layers every step leaves an image; those of earlier builds (an older
# src/ layer and its build) are never used again. Keep the stand-ins, this
# build's chain (the ids it printed) and the tagged image.
keep=$(
  { grep -oE '^--> (Using cache )?[0-9a-f]{11,64}' "$build_log" || true; } | grep -oE '[0-9a-f]{11,64}$' || true
  # (inspect prints no newline of its own)
  printf '%s\n' "$image_id" \
    "$(bah inspect --type image --format '{{.FromImageID}}' "$runtime_base")" \
    "$(bah inspect --type image --format '{{.FromImageID}}' "$builder_base" 2>/dev/null || true)"
)
stale=()
while read -r id; do
  used=""
  for k in $keep; do
    [[ $id == "$k"* ]] && used=1 && break
  done
  [[ -n $used ]] || stale+=("$id")
done < <(bah images --all --noheading --no-trunc --format '{{.ID}}' | sed 's/^sha256://' | sort -u)
if [[ -n $binary ]]; then
  : # a --binary build's chain is the runtime stage alone: a full build's cached layers stay
elif ! grep -qE '^--> ' "$build_log"; then
  say "  warning: no layer ids in $build_log: the layer cache is not pruned"
elif ((${#stale[@]})); then
  if bah rmi -f "${stale[@]}" >"$cache/logs/prune.log" 2>&1; then
    say "  dropped ${#stale[@]} stale cache images"
  else
    say "  warning: could not drop some stale cache images (see $cache/logs/prune.log)"
  fi
fi

# --- 6. run the image ---------------------------------------------------------

stage "run the image: uid from USER, read-only root, tmpfs /tmp"
user=$(bah inspect --type image --format '{{.OCIv1.Config.User}}' "$tag")
entrypoint=$(bah inspect --type image --format '{{range .OCIv1.Config.Entrypoint}}{{.}} {{end}}' "$tag")
mapfile -t image_env < <(bah inspect --type image --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$tag" | sed '/^$/d')
case ${user%%:*} in
  "" | 0 | root) die "the image's USER is '${user}': it must be a non-root numeric uid" ;;
esac
[[ $user == *:* ]] || user=$user:$user
[[ ${entrypoint% } == /usr/local/bin/gateway ]] || die "the image's ENTRYPOINT is '${entrypoint}', not /usr/local/bin/gateway"
new_container "$tag" ratelimit-gateway-image-run
rootfs=$mnt
mkdir -p "$rootfs/etc/gateway" # the mount point, as the pod's volume mount makes it

[[ -x target/release/mock-upstream ]] ||
  die "target/release/mock-upstream is missing: cargo build --release -p gateway-test-tools"

# jail CONFDIR [VAR=VALUE...] -- ARGS...: execs the image's gateway with ARGS in
# a private mount namespace: the root read-only, a tmpfs /tmp, /proc, a minimal
# /dev, CONFDIR read-only at /etc/gateway, only the image's env (and VARs), as
# USER. The network is the host's, so loopback works both ways. Exec all the
# way down: the PID of the caller's `jail ... &` is the gateway's.
jail() {
  local conf=$1 envs=("${image_env[@]}")
  shift
  while [[ $1 != -- ]]; do
    envs+=("$1")
    shift
  done
  shift
  # shellcheck disable=SC2016 # the script is bash -c's, its $s are its own
  exec unshare --mount --propagation private -- bash -c '
    set -e
    r=$1 conf=$2 user=$3 n=$4
    shift 4
    envs=("${@:1:n}")
    shift "$n"
    mount --bind "$r" "$r"
    mount -o remount,bind,ro "$r"
    mount -t tmpfs -o mode=1777,size=64m,nosuid,nodev tmpfs "$r/tmp"
    mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
    mount -t tmpfs -o mode=755,size=64k,nosuid tmpfs "$r/dev"
    for d in null zero full random urandom; do
      touch "$r/dev/$d"
      mount --bind "/dev/$d" "$r/dev/$d"
    done
    mount --bind "$conf" "$r/etc/gateway"
    mount -o remount,bind,ro "$r/etc/gateway"
    exec env -i "${envs[@]}" chroot --userspec="$user" "$r" /usr/local/bin/gateway "$@"
  ' jail "$rootfs" "$conf" "$user" "${#envs[@]}" "${envs[@]}" "$@"
}

# 5 free loopback ports: upstream, two proxies, two admins, redis.
mapfile -t ports < <(python3 scripts/free_port.py 6)
p_up=${ports[0]} p_proxy=${ports[1]} p_admin=${ports[2]}
p_proxy2=${ports[3]} p_admin2=${ports[4]} p_redis=${ports[5]}

out=$(jail "$work" -- --version 2>&1) || die "gateway --version in the image: $out"
[[ -n $out ]] || die "gateway --version in the image printed nothing"
say "  gateway --version: $out"

# --- each ConfigMap's gateway.toml, as the pod gets it: its password file
# mounted where the Deployment mounts the Secret, ${VAR}s in the environment.
mapfile -t configmaps < <(grep -rlE '^  gateway\.toml: *\|' k8s --include='*.yaml' | sort)
((${#configmaps[@]})) || die "no ConfigMap with a gateway.toml under k8s/"
n=0
for cm in "${configmaps[@]}"; do
  n=$((n + 1))
  k8s_conf=$work/k8s-$n
  mkdir -p "$k8s_conf"
  awk '
    /^  gateway\.toml: *\|/ { on = 1; next }
    on && /^    / { sub(/^    /, ""); print; next }
    on && /^ *$/ { print ""; next }
    on { exit }
  ' "$cm" >"$k8s_conf/gateway.toml"
  [[ -s $k8s_conf/gateway.toml ]] || die "no gateway.toml in $cm"
  pwfile=$(sed -n 's/^password_file *= *"\(.*\)".*/\1/p' "$k8s_conf/gateway.toml" | head -n1)
  if [[ -n $pwfile ]]; then
    [[ $pwfile == /etc/gateway/* ]] || die "$cm: redis.password_file $pwfile is not under /etc/gateway"
    mkdir -p "$(dirname -- "$k8s_conf/${pwfile#/etc/gateway/}")"
    echo "image-check-password" >"$k8s_conf/${pwfile#/etc/gateway/}"
  fi
  k8s_env=()
  while read -r v; do
    k8s_env+=("$v=image-check-placeholder-0123456789")
  done < <(grep -oE '[$][{][A-Za-z_][A-Za-z0-9_]*[}]' "$k8s_conf/gateway.toml" | tr -d '{}$' | sort -u)
  chmod -R a+rX "$k8s_conf"
  if ! out=$(jail "$k8s_conf" "${k8s_env[@]}" -- check --config /etc/gateway/gateway.toml 2>&1); then
    printf '%s\n' "$out" | tail -n 30 >&2
    die "gateway check on $cm's gateway.toml, in the image"
  fi
  say "  gateway check on $cm's gateway.toml${pwfile:+ (password file mounted)}: ok"
  if grep -q '^warning' <<<"$out"; then
    grep '^warning' <<<"$out" | sed 's/^/      /'
  fi
done

# --- an upstream on loopback
target/release/mock-upstream --listen "127.0.0.1:$p_up" >"$work/upstream.log" 2>&1 &
pids+=($!)

code() { # URL [curl args]: the status code
  local url=$1
  shift
  curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$@" "$url" || true
}
wait_http() { # URL PID LOG WHAT
  for _ in $(seq 200); do
    [[ $(code "$1") == 200 ]] && return 0
    if [[ -n $2 ]] && ! kill -0 "$2" 2>/dev/null; then
      tail -n 30 "$3" >&2
      die "$4 exited before it was ready"
    fi
    sleep 0.1
  done
  tail -n 30 "$3" >&2
  die "$4 not ready within 20 s ($1)"
}
wait_http "http://127.0.0.1:$p_up/healthz" "${pids[-1]}" "$work/upstream.log" "mock-upstream"

expect() { # WANT GOT WHAT
  [[ $2 == "$1" ]] || die "$3: expected $1, got $2"
}

# stop_gateway PID LOG WHAT PROXYPORT: SIGTERM with a request in flight; the
# request must complete and the gateway exit 0 within its grace period.
stop_gateway() {
  local pid=$1 log=$2 what=$3 port=$4 inflight rc
  curl -s -o /dev/null -w '%{http_code}' --max-time 10 -H 'x-mock-delay-ms: 1500' \
    "http://127.0.0.1:$port/slow" >"$work/inflight" &
  inflight=$!
  sleep 0.5
  kill -TERM "$pid"
  for _ in $(seq 150); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    tail -n 20 "$log" >&2
    die "$what: still running 15 s after SIGTERM"
  fi
  rc=0
  wait "$pid" || rc=$?
  wait "$inflight" || true
  if ((rc != 0)); then
    tail -n 20 "$log" >&2
    die "$what: exited $rc on SIGTERM"
  fi
  expect 200 "$(cat "$work/inflight")" "$what: the request in flight at SIGTERM"
  say "  $what: SIGTERM drained the request in flight (200) and exited 0"
}

limited_config() { # PROXYPORT ADMINPORT BACKEND-SECTION...
  cat <<EOF
[server]
listen = ["127.0.0.1:$1"]
admin_listen = "127.0.0.1:$2"
threads = 1
grace_period_secs = 5

$3

[clients]
deny = ["127.0.0.2/32"]

[[upstreams]]
name = "up"
servers = ["127.0.0.1:$p_up"]

[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "up"
limit = { algorithm = "fixed_window", limit = 2, window_secs = 60, scope = "client" }

[[routes]]
name = "rest"
path_prefix = "/"
upstream = "up"
EOF
}

# --- local backend
local_conf=$work/local
mkdir -p "$local_conf"
limited_config "$p_proxy" "$p_admin" '[limiter]
backend = "local"' >"$local_conf/gateway.toml"
chmod -R a+rX "$local_conf"
jail "$local_conf" -- run --config /etc/gateway/gateway.toml >"$work/gw-local.log" 2>&1 &
gw=$!
pids+=("$gw")
wait_http "http://127.0.0.1:$p_admin/readyz" "$gw" "$work/gw-local.log" "gateway (local backend)"
uid=$(awk '/^Uid:/ { print $2 }' "/proc/$gw/status")
[[ $uid == "${user%%:*}" ]] || die "the gateway runs as uid $uid, not ${user%%:*}"
expect 200 "$(code "http://127.0.0.1:$p_proxy/hello")" "local: GET /hello"
expect 200 "$(code "http://127.0.0.1:$p_proxy/limited")" "local: GET /limited (1 of 2)"
expect 200 "$(code "http://127.0.0.1:$p_proxy/limited")" "local: GET /limited (2 of 2)"
expect 429 "$(code "http://127.0.0.1:$p_proxy/limited")" "local: GET /limited (3, over the limit)"
expect 403 "$(code "http://127.0.0.1:$p_proxy/hello" --interface 127.0.0.2)" "local: GET /hello from a denied client"
ready=$(curl -s --max-time 5 "http://127.0.0.1:$p_admin/readyz")
grep -q '"backend":"local"' <<<"$ready" || die "local: /readyz says $ready"
say "  local backend: proxied 200, limit 429, denied 403, /readyz $ready"
stop_gateway "$gw" "$work/gw-local.log" "local backend" "$p_proxy"

# --- redis backend
redis_pw=image-check-$RANDOM$RANDOM
redis-server --port "$p_redis" --bind 127.0.0.1 --save "" --appendonly no \
  --requirepass "$redis_pw" >"$work/redis.log" 2>&1 &
pids+=($!)
redis_pid=$!
for _ in $(seq 100); do
  REDISCLI_AUTH=$redis_pw redis-cli -p "$p_redis" ping 2>/dev/null | grep -q PONG && break
  kill -0 "$redis_pid" 2>/dev/null || { tail "$work/redis.log" >&2; die "redis-server exited"; }
  sleep 0.1
done
redis_conf=$work/redis
mkdir -p "$redis_conf/secrets"
printf '%s\n' "$redis_pw" >"$redis_conf/secrets/redis-password"
limited_config "$p_proxy2" "$p_admin2" "[limiter]
backend = \"redis\"
on_redis_failure = \"deny\"

[redis]
urls = [\"redis://127.0.0.1:$p_redis\"]
password_file = \"/etc/gateway/secrets/redis-password\"
key_prefix = \"imgchk\"" >"$redis_conf/gateway.toml"
chmod -R a+rX "$redis_conf"
jail "$redis_conf" -- run --config /etc/gateway/gateway.toml >"$work/gw-redis.log" 2>&1 &
gw=$!
pids+=("$gw")
wait_http "http://127.0.0.1:$p_admin2/readyz" "$gw" "$work/gw-redis.log" "gateway (redis backend)"
ready=$(curl -s --max-time 5 "http://127.0.0.1:$p_admin2/readyz")
grep -q '"backend":"redis"' <<<"$ready" || die "redis: /readyz says $ready"
expect 200 "$(code "http://127.0.0.1:$p_proxy2/hello")" "redis: GET /hello"
expect 200 "$(code "http://127.0.0.1:$p_proxy2/limited")" "redis: GET /limited (1 of 2)"
expect 200 "$(code "http://127.0.0.1:$p_proxy2/limited")" "redis: GET /limited (2 of 2)"
expect 429 "$(code "http://127.0.0.1:$p_proxy2/limited")" "redis: GET /limited (3, over the limit)"
keys=$(REDISCLI_AUTH=$redis_pw redis-cli -p "$p_redis" --scan --pattern 'imgchk*' | wc -l)
((keys > 0)) || die "redis: the gateway left no imgchk* keys in Redis"
say "  redis backend: proxied 200, limit 429 ($keys keys in Redis), /readyz $ready"
stop_gateway "$gw" "$work/gw-redis.log" "redis backend" "$p_proxy2"

# --- 7. report ----------------------------------------------------------------

stage "report"
bin_bytes=$(stat -c %s "$rootfs/usr/local/bin/gateway")
say "  image $tag: $(mb "$image_bytes") in $nlayers layers (runtime base $(mb "$base_bytes"), binary layer $(mb "$binary_layer_bytes"), binary $(mb "$bin_bytes"), $(file -b "$rootfs/usr/local/bin/gateway" 2>/dev/null | grep -o 'not stripped\|stripped' || echo 'stripped?'))"
if [[ -n ${IMAGE_ARCHIVE:-} ]]; then
  rm -f -- "$IMAGE_ARCHIVE"
  quiet save bah push "${policy[@]}" "$tag" "docker-archive:$IMAGE_ARCHIVE:ratelimit-gateway:0.1.0"
  say "  saved to $IMAGE_ARCHIVE (docker-archive, ratelimit-gateway:0.1.0)"
fi
say "  build ${build_secs} s; whole script $((SECONDS - t0)) s"
echo "image checks: passed"
