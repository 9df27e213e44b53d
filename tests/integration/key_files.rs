//! `clients.api_keys_file` through the real binary: keys from a file of
//! their own beside `[[api_keys]]`, the file watched and swapped in while
//! serving, a bad line refusing the new file (named by its line) while the
//! last good one stays in force, and `check` naming what is wrong.

use crate::support;

use std::path::Path;
use std::time::Duration;

use support::{GatewayGuard, UpstreamGuard};

fn config(up: &UpstreamGuard, keys_file: &Path) -> String {
    let head = format!(
        "[limiter]\nbackend = \"local\"\n\n[clients]\napi_keys_file = \"{}\"",
        keys_file.display()
    );
    support::key_test_config(&head, up)
}

/// Replaces the file the way a deployment does: write aside, rename over.
fn swap(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write keys");
    std::fs::rename(&tmp, path).expect("rename keys");
}

fn status(g: &GatewayGuard, secret: &str) -> u16 {
    support::key_status(g, secret)
}

fn line(id: &str, secret: &str, plan: &str) -> String {
    format!("{{\"id\":\"{id}\",\"key\":\"{secret}\",\"plan\":\"{plan}\"}}\n")
}

#[test]
fn keys_from_a_watched_file_are_swapped_in_and_a_bad_file_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let keys = dir.path().join("keys.jsonl");
    let sha = hex_sha256("b-secret");
    swap(
        &keys,
        &format!(
            "{}{{\"id\":\"b\",\"sha256\":\"{sha}\",\"plan\":\"tiny\"}}\n",
            line("a", "a-secret", "free")
        ),
    );
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up, &keys));
    assert_eq!(g.metric("gateway_api_keys"), 3.0);
    assert_eq!(status(&g, "inline-secret"), 200);
    assert_eq!(status(&g, "a-secret"), 200);
    assert_eq!(status(&g, "nobody"), 401);
    // The file's key keeps its plan: tiny is 2 requests.
    let b: Vec<u16> = (0..3).map(|_| status(&g, "b-secret")).collect();
    assert_eq!(b, [200, 200, 429]);

    // a revoked, c issued: the watcher swaps the new file in.
    swap(
        &keys,
        &format!(
            "{}{}",
            line("b", "b-secret", "tiny"),
            line("c", "c-secret", "free")
        ),
    );
    support::wait_for("c accepted", Duration::from_secs(10), || {
        (status(&g, "c-secret") == 200).then_some(())
    });
    assert_eq!(status(&g, "a-secret"), 401);
    // b's bucket is its own still: a reload keeps what it spent.
    assert_eq!(status(&g, "b-secret"), 429);
    assert_eq!(g.metric("gateway_api_keys"), 3.0);

    // A bad line (a plan that is not defined) refuses the whole new file:
    // d is not accepted, c stays, and the error names the line.
    let errors = g.metric("gateway_config_reloads_total{result=\"error\"}");
    swap(
        &keys,
        &format!(
            "{}{}",
            line("c", "c-secret", "free"),
            line("d", "d-secret", "gold")
        ),
    );
    support::wait_for("the reload refused", Duration::from_secs(10), || {
        (g.metric("gateway_config_reloads_total{result=\"error\"}") > errors).then_some(())
    });
    assert_eq!(status(&g, "d-secret"), 401);
    assert_eq!(status(&g, "c-secret"), 200);
    let log = g.log();
    assert!(
        log.contains("line 2: plan \\\"gold\\\" is not defined")
            || log.contains("line 2: plan \"gold\" is not defined"),
        "{log}"
    );
    assert!(
        !log.contains("d-secret") && !log.contains("c-secret"),
        "no secret in the log"
    );

    // Fixed, it is taken.
    swap(
        &keys,
        &format!(
            "{}{}",
            line("c", "c-secret", "free"),
            line("d", "d-secret", "free")
        ),
    );
    support::wait_for("d accepted", Duration::from_secs(10), || {
        (status(&g, "d-secret") == 200).then_some(())
    });
}

#[test]
fn a_csv_file_of_keys_is_read_too() {
    let dir = tempfile::tempdir().expect("temp dir");
    let keys = dir.path().join("keys.csv");
    swap(
        &keys,
        "id,key,plan,capacity,refill_per_sec,quotas\nx,x-secret,free,1,0.001,\ny,y-secret,free,,,1/day\n",
    );
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up, &keys));
    // x: a burst bucket of its own (1); y: a day quota of its own (1).
    for secret in ["x-secret", "y-secret"] {
        let s: Vec<u16> = (0..2).map(|_| status(&g, secret)).collect();
        assert_eq!(s, [200, 429], "{secret}");
    }
}

fn check(config: &str) -> (bool, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gateway.toml");
    let config = config
        .replace("{listen}", "127.0.0.1:18080")
        .replace("{admin}", "127.0.0.1:18081");
    std::fs::write(&path, config).expect("write");
    let (code, out, err) = support::gateway_cli(&["check"], &path);
    (code == Some(0), format!("{out}{err}"))
}

#[test]
fn check_names_the_keys_file_and_its_bad_lines() {
    let dir = tempfile::tempdir().expect("temp dir");
    let keys = dir.path().join("keys.jsonl");
    let up = UpstreamGuard::start();
    // Good: counted per plan, the secrets never printed.
    swap(
        &keys,
        &format!(
            "{}{}",
            line("a", "a-secret", "free"),
            line("b", "b-secret", "tiny")
        ),
    );
    let (ok, out) = check(&config(&up, &keys));
    assert!(ok, "{out}");
    assert!(
        out.contains("api keys: 3 (1 in the config, 2 in the keys file)"),
        "{out}"
    );
    assert!(
        out.contains("key plan tiny: token_bucket capacity=2"),
        "{out}"
    );
    assert!(out.contains("(1 key(s)"), "{out}");
    assert!(!out.contains("a-secret"), "{out}");
    // The same secret as an inline key, and an id given twice.
    swap(
        &keys,
        &format!(
            "{}{}",
            line("a", "inline-secret", "free"),
            line("inline", "z", "free")
        ),
    );
    let (ok, out) = check(&config(&up, &keys));
    assert!(!ok, "{out}");
    assert!(out.contains("clients.api_keys_file (line"), "{out}");
    assert!(
        out.contains("line 1: the same key as api_keys[0] in the config (id \"inline\")"),
        "{out}"
    );
    assert!(!out.contains("inline-secret"), "{out}");
    // A file that cannot be read here: `check` may run on another machine
    // than the gateway (a warning, as for a certificate); `run` refuses.
    std::fs::remove_file(&keys).expect("rm");
    let (ok, out) = check(&config(&up, &keys));
    assert!(ok, "{out}");
    assert!(
        out.contains("warning: clients.api_keys_file (line")
            && out.contains(&format!("cannot read {}", keys.display()))
            && out.contains("`gateway run` refuses to start until it can be read"),
        "{out}"
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        config(&up, &keys)
            .replace("{listen}", "127.0.0.1:18080")
            .replace("{admin}", "127.0.0.1:18081"),
    )
    .expect("write");
    let (code, _, err) = support::gateway_cli(&["run"], &path);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("clients.api_keys_file (line") && err.contains("cannot read it"),
        "{err}"
    );
}

fn hex_sha256(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}
