"""Identity at scale: what a keys file of N keys costs the gateway.

For each size (and an empty config as the baseline), in one run:
  * `gateway check`'s time (the median of --repeat runs);
  * start to `/readyz` (the median of --repeat starts), and the gateway's
    RSS once ready, above the empty config's;
  * a reload: SIGHUP to `gateway_config_reloads_total{result="ok"}` moving
    (the median of --repeat);
  * with --p99 (the largest size only): p99 of admitted requests at a fixed
    rate while the keys are reloaded back to back, against the same rate
    with no reload, in alternating windows (A, B, A, B, ...) of the same run;
    both kinds read /metrics every 100 ms (B to see each reload land).

The keys are JSON lines in sha256 form over three plans, as an operator's
export would be. Everything runs on 127.0.0.1; every process is stopped by
its PID. Writes --out/summary.md (a table), summary.json and keys.png.
"""

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lt.files import git_commit, write_json  # noqa: E402
from lt.plots import pyplot, save_png  # noqa: E402
from lt.procs import free_ports, log  # noqa: E402
from lt.tables import table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLANS = ["free", "pro", "enterprise"]


def write_keys(path, n):
    """n keys, one JSON object a line; key i's secret is "secret-i"."""
    with open(path, "w") as f:
        for i in range(n):
            digest = hashlib.sha256(f"secret-{i}".encode()).hexdigest()
            f.write(json.dumps({"id": f"key-{i:07d}", "sha256": digest, "plan": PLANS[i % 3]}) + "\n")


def config(keys_file, port, admin, upstream):
    keys = f'api_keys_file = "{keys_file}"' if keys_file else ""
    return f"""
[server]
listen = ["127.0.0.1:{port}"]
admin_listen = "127.0.0.1:{admin}"
threads = 2
grace_period_secs = 0

[limiter]
backend = "local"

[clients]
{keys}

[plans.free]
capacity = 1000000
refill_per_sec = 1000000

[plans.pro]
capacity = 1000000
refill_per_sec = 1000000

[plans.enterprise]
capacity = 1000000
refill_per_sec = 1000000

[[api_keys]]
id = "inline"
key = "inline-secret"
plan = "pro"

[[upstreams]]
name = "up"
servers = ["127.0.0.1:{upstream}"]

[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"
"""


def get(url, timeout=2):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def metric(admin, name):
    try:
        _, text = get(f"http://127.0.0.1:{admin}/metrics")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Gateway:
    def __init__(self, gw, cfg_path, log_path):
        self.log = open(log_path, "ab")
        self.p = subprocess.Popen([gw, "run", "--config", str(cfg_path)], stdout=self.log, stderr=self.log)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def wait_ready(admin, proc, limit=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited ({proc.returncode}) before it was ready")
        try:
            if get(f"http://127.0.0.1:{admin}/readyz", timeout=1)[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.005)
    raise SystemExit("the gateway was not ready in time")


def reload_once(admin, pid, poll=0.005, hup=True):
    """SIGHUP, then the time until the ok-reload counter moves (read every
    `poll` seconds). With hup=False, the same reads and no signal: the
    windows without a reload load /metrics as those with one do."""
    name = 'gateway_config_reloads_total{result="ok"}'
    before = metric(admin, name)
    t0 = time.monotonic()
    if hup:
        os.kill(pid, signal.SIGHUP)
    while time.monotonic() - t0 < 120:
        if metric(admin, name) != before:
            return time.monotonic() - t0
        if not hup and time.monotonic() - t0 > 1.3:
            return None
        time.sleep(poll)
    raise SystemExit("the reload did not land in time")


def measure(a, n, keys_file, ports, out):
    gw = str(ROOT / "target/release/gateway")
    port, admin, upstream = ports
    cfg = out / f"gateway-{n}.toml"
    cfg.write_text(config(keys_file, port, admin, upstream))
    checks = []
    for _ in range(a.repeat):
        t0 = time.monotonic()
        r = subprocess.run([gw, "check", "--config", str(cfg)], capture_output=True, text=True)
        checks.append(time.monotonic() - t0)
        if r.returncode != 0:
            raise SystemExit(f"gateway check failed for {n} keys:\n{r.stderr}")
    starts, rss, rss_reloaded, reloads = [], [], [], []
    for i in range(a.repeat):
        g = Gateway(gw, cfg, out / "logs" / f"gateway-{n}.log")
        try:
            starts.append(wait_ready(admin, g.p))
            time.sleep(0.3)
            rss.append(rss_kib(g.p.pid))
            if i == 0:
                for _ in range(a.repeat):
                    reloads.append(reload_once(admin, g.p.pid))
                time.sleep(1)
                rss_reloaded.append(rss_kib(g.p.pid))
                keys = metric(admin, "gateway_api_keys")
                if keys != n + 1:
                    raise SystemExit(f"gateway_api_keys is {keys}, expected {n + 1}")
        finally:
            g.stop()
    return {
        "keys": n,
        "file_mb": round(keys_file.stat().st_size / 1e6, 1) if keys_file else 0,
        "check_s": statistics.median(checks),
        "start_s": statistics.median(starts),
        "reload_s": statistics.median(reloads),
        "rss_mib": max(rss) / 1024,
        "rss_reloaded_mib": max(rss_reloaded) / 1024,
    }


def fixedrate(a, port, secret, out_json):
    argv = [a.fixedrate, "--url", f"http://127.0.0.1:{port}/r", "--rate", str(a.rate),
            "--duration", str(a.window), "--warmup", "1", "--connections", "16",
            "--timeout", "5", "--out", str(out_json), "--header", f"x-api-key: {secret}"]
    subprocess.run(argv, check=True, capture_output=True)
    return json.loads(Path(out_json).read_text())


def p99_during_reload(a, n, keys_file, ports, out):
    """Alternating windows at a fixed rate: A with no reload, B with the
    keys reloaded back to back for the whole window."""
    gw = str(ROOT / "target/release/gateway")
    port, admin, _ = ports
    cfg = out / f"gateway-{n}.toml"
    g = Gateway(gw, cfg, out / "logs" / f"gateway-{n}-p99.log")
    rows = []
    try:
        wait_ready(admin, g.p)
        for w in range(a.pairs * 2):
            kind = "A" if w % 2 == 0 else "B"
            stop = [False]
            reloads = [0]
            import threading

            # Both kinds read /metrics every 100 ms; B also sends SIGHUP
            # each time the last reload has landed.
            def hup(send):
                while not stop[0]:
                    if reload_once(admin, g.p.pid, poll=0.1, hup=send) is not None:
                        reloads[0] += 1

            t = threading.Thread(target=hup, args=(kind == "B",))
            t.start()
            f = fixedrate(a, port, "secret-1", out / "raw" / f"window-{w}-{kind}.json")
            stop[0] = True
            t.join()
            lat = f["ok_latency_ms"]
            rows.append({"window": w, "kind": kind, "p50_ms": lat["p50"], "p99_ms": lat["p99"],
                         "ok": lat["n"], "reloads": reloads[0]})
            log(f"  window {w} ({kind}): p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms, {lat['n']} ok, {reloads[0]} reload(s)")
    finally:
        g.stop()
    return rows


def mock(out, port):
    log_f = open(out / "logs" / "mock.log", "ab")
    p = subprocess.Popen([str(ROOT / "target/release/mock-upstream"), "--listen", f"127.0.0.1:{port}"],
                         stdout=log_f, stderr=log_f)
    return p, log_f


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--p99", action="store_true", help="p99 during back-to-back reloads of the largest size")
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--window", type=float, default=8)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--fixedrate", default=str(ROOT / "loadtest/results/.tools/fixedrate"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    for d in ("logs", "raw", "keys"):
        (out / d).mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in a.sizes.split(",")]
    ports = free_ports(3)
    up, up_log = mock(out, ports[2])
    results = []
    try:
        log("baseline: an empty keys file")
        empty = out / "keys" / "keys-0.jsonl"
        write_keys(empty, 0)
        results.append(measure(a, 0, empty, ports, out))
        for n in sizes:
            f = out / "keys" / f"keys-{n}.jsonl"
            log(f"{n} keys: writing {f.name}")
            write_keys(f, n)
            log(f"{n} keys: check, start and reload, {a.repeat} times each")
            r = measure(a, n, f, ports, out)
            results.append(r)
            log(f"  check {r['check_s']:.2f} s, start {r['start_s']:.2f} s, reload {r['reload_s']:.2f} s, RSS {r['rss_mib']:.0f} MiB")
        windows = []
        if a.p99:
            n = sizes[-1]
            log(f"p99 at {a.rate}/s: {a.pairs} windows without a reload, {a.pairs} with {n} keys reloaded back to back")
            windows = p99_during_reload(a, n, out / "keys" / f"keys-{n}.jsonl", ports, out)
    finally:
        up.terminate()
        up.wait()
        up_log.close()
        for f in (out / "keys").glob("*.jsonl"):
            f.unlink()
    base = results[0]["rss_mib"]
    rows = []
    for r in results:
        above = r["rss_mib"] - base
        per_key = above * 1024 * 1024 / r["keys"] if r["keys"] else None
        r["rss_above_empty_mib"] = above
        r["bytes_per_key"] = per_key
        r["rss_reloaded_above_empty_mib"] = r["rss_reloaded_mib"] - results[0]["rss_reloaded_mib"]
        rows.append([f"{r['keys']:,}", f"{r['file_mb']:.1f}", f"{r['check_s']:.2f}", f"{r['start_s']:.2f}",
                     f"{r['reload_s']:.2f}", f"{r['rss_mib']:.0f}", f"{above:.0f}",
                     f"{per_key:.0f}" if per_key else "", f"{r['rss_reloaded_above_empty_mib']:.0f}"])
    lines = [f"# Identity at scale: a keys file of N keys", "",
             f"commit {git_commit(ROOT, 'unknown')}, {os.cpu_count()} CPUs; medians of {a.repeat} runs "
             "(check: `gateway check`; start: exec to `/readyz` 200; reload: SIGHUP to the ok-reload counter moving). "
             "Keys: JSON lines, sha256 form, three plans.", ""]
    lines += table(["keys", "file MB", "check s", "start s", "reload s", "RSS MiB", "above empty MiB", "bytes/key",
                    f"above empty after {a.repeat} reloads MiB"], "rrrrrrrrr", rows)
    summary = {"sizes": results}
    if windows:
        a_p99 = [w["p99_ms"] for w in windows if w["kind"] == "A"]
        b_p99 = [w["p99_ms"] for w in windows if w["kind"] == "B"]
        ratio = statistics.median(b_p99) / statistics.median(a_p99)
        summary["p99"] = {"windows": windows, "rate": a.rate, "median_p99_without_ms": statistics.median(a_p99),
                          "median_p99_reloading_ms": statistics.median(b_p99), "ratio": ratio}
        lines += ["", f"## p99 of admitted requests at {a.rate}/s while {sizes[-1]:,} keys reload back to back", ""]
        lines += table(["window", "reloading", "reloads", "ok", "p50 ms", "p99 ms"], "rlrrrr",
                       [[w["window"], "yes" if w["kind"] == "B" else "no", w["reloads"], w["ok"],
                         f"{w['p50_ms']:.2f}", f"{w['p99_ms']:.2f}"] for w in windows])
        lines += ["", f"Median p99: {statistics.median(a_p99):.2f} ms without a reload, "
                  f"{statistics.median(b_p99):.2f} ms reloading: **{ratio:.2f}x**."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    write_json(out / "summary.json", summary)
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ks = [r["keys"] for r in results[1:]]
    for k, label in (("check_s", "check"), ("start_s", "start to /readyz"), ("reload_s", "reload")):
        ax1.plot(ks, [r[k] for r in results[1:]], marker="o", label=label)
    ax1.set_xscale("log")
    ax1.set_xlabel("keys")
    ax1.set_ylabel("seconds")
    ax1.set_title("time")
    ax1.legend()
    ax2.plot(ks, [r["rss_above_empty_mib"] for r in results[1:]], marker="o", color="tab:red")
    ax2.set_xscale("log")
    ax2.set_xlabel("keys")
    ax2.set_ylabel("MiB above an empty config")
    ax2.set_title("memory")
    fig.tight_layout()
    save_png(fig, out / "keys.png", 110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
