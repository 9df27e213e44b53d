//! The operator page (`/ui`) in a real browser: headless Chromium driven
//! over the DevTools protocol loads it from the admin listener, with no
//! console error; a flooding client is at the top of its table within 2 s;
//! clicking it shows its buckets, and its reset button resets them with
//! the admin token and is refused without it.
//!
//! `UI_SCREENSHOT=path.png` saves what the page looked like (the README's
//! picture is made so).

use std::time::Duration;

use crate::support::cdp::Browser;
use crate::support::*;

const TOKEN: &str = "ui-admin-token-1";
const FLOODER: &str = "192.0.2.9";

fn config(up: &UpstreamGuard) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[log]
access = false

[limiter]
backend = "local"
retry_after_jitter_ms = 0

[admin]
token = "{TOKEN}"

[clients]
trusted_proxies = ["127.0.0.1/32"]

[tiers.ip]
algorithm = "token_bucket"
capacity = 5
refill_per_sec = 0.01

[[upstreams]]
name = "up"
servers = ["{up}"]
max_in_flight = 64

[[routes]]
name = "rides"
path_prefix = "/api/rides"
upstream = "up"
"#,
        up = up.addr
    )
}

fn send(g: &GatewayGuard, from: &str, n: usize) -> (usize, usize) {
    let mut c = g.client();
    let mut answered = (0, 0);
    for _ in 0..n {
        match c
            .request(
                "GET",
                "/api/rides/request",
                &[("x-forwarded-for", from)],
                b"",
            )
            .expect("answer")
            .status
        {
            429 => answered.1 += 1,
            _ => answered.0 += 1,
        }
    }
    answered
}

fn remaining(g: &GatewayGuard) -> u64 {
    let v = g.admin_get(&format!("/limits?ip={FLOODER}")).json();
    v["buckets"][0]["remaining"]
        .as_u64()
        .unwrap_or_else(|| panic!("no bucket in {v}"))
}

#[test]
fn the_operator_page_shows_a_flood_and_resets_it_with_the_token_only() {
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up));
    for i in 0..20 {
        send(&g, &format!("198.51.100.{i}"), 2);
    }
    let mut page = Browser::open(&format!("http://{}/ui", g.admin));
    assert_eq!(send(&g, FLOODER, 40), (5, 35));
    let first = page.wait_until(
        "the flooding client first in the table",
        Duration::from_secs(2),
        &format!(
            "(() => {{ const td = document.querySelector('#top tbody tr td'); \
             return td && td.textContent === '{FLOODER}' ? td.parentElement.textContent : null; }})()"
        ),
    );
    println!("FIGURES ui: first row {first}");
    // The other panels drawn from the scrape.
    page.wait_until(
        "decisions and gates drawn",
        Duration::from_secs(5),
        "document.querySelector('#decisions tbody tr') !== null \
         && document.querySelector('#gates tbody tr') !== null \
         && document.getElementById('state').textContent === 'local'",
    );
    let errors = page.errors();
    assert!(
        errors.is_empty(),
        "the page reported errors as it loaded and drew: {errors:#?}"
    );
    // Its buckets, on a click.
    page.eval("document.querySelector('#top tbody tr').click()");
    let shown = page.wait_until(
        "its buckets shown",
        Duration::from_secs(5),
        "(() => { const r = document.querySelector('#buckets tbody tr'); \
         return !document.getElementById('client').hidden && r ? r.textContent : null; })()",
    );
    assert!(
        shown.as_str().is_some_and(|s| s.starts_with("ip")),
        "{shown}"
    );
    assert_eq!(remaining(&g), 0);
    // Reset without the token: refused, nothing reset.
    page.eval("document.getElementById('reset').click()");
    let status = page.wait_until(
        "the refusal shown",
        Duration::from_secs(5),
        "document.getElementById('reset-result').dataset.status || null",
    );
    assert_eq!(status, "401");
    assert_eq!(remaining(&g), 0, "refused: not reset");
    // With it: reset, and the client is admitted again.
    page.eval(&format!(
        "document.getElementById('token').value = '{TOKEN}'; \
         document.getElementById('reset-result').dataset.status = ''; \
         document.getElementById('reset').click()"
    ));
    let status = page.wait_until(
        "the reset shown",
        Duration::from_secs(5),
        "document.getElementById('reset-result').dataset.status || null",
    );
    assert_eq!(status, "200");
    assert_eq!(remaining(&g), 5, "made whole");
    assert_eq!(send(&g, FLOODER, 1), (1, 0));
    if let Ok(path) = std::env::var("UI_SCREENSHOT") {
        page.screenshot(std::path::Path::new(&path));
    }
    // Nothing else went wrong: the one refused reset is the browser's
    // report of a 401, and nothing more.
    let errors: Vec<_> = page
        .errors()
        .into_iter()
        .filter(|e| {
            let entry = &e["params"]["entry"];
            !(entry["url"]
                .as_str()
                .is_some_and(|u| u.ends_with("/limits?ip=192.0.2.9"))
                && entry["text"].as_str().is_some_and(|t| t.contains("401")))
        })
        .collect();
    assert!(errors.is_empty(), "the page reported errors: {errors:#?}");
    // The token is never in the page's address, storage or the DOM.
    let leaked = page.eval(&format!(
        "location.href.includes('{TOKEN}') || document.body.innerHTML.includes('{TOKEN}') \
         || JSON.stringify(sessionStorage).includes('{TOKEN}') \
         || JSON.stringify(localStorage).includes('{TOKEN}')"
    ));
    assert_eq!(leaked, false);
}

#[test]
fn the_page_is_served_with_its_own_files_only() {
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up));
    for (path, ctype) in [
        ("/ui", "text/html; charset=utf-8"),
        ("/ui/app.js", "text/javascript; charset=utf-8"),
        ("/ui/style.css", "text/css; charset=utf-8"),
    ] {
        let r = g.admin_get(path);
        assert_eq!(
            (r.status, r.header("content-type")),
            (200, Some(ctype)),
            "{path}"
        );
        assert!(
            r.header("content-security-policy")
                .is_some_and(|c| c.starts_with("default-src 'self'")),
            "{path}: {:?}",
            r.headers
        );
    }
    let html = g.admin_get("/ui").text();
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "nothing from elsewhere"
    );
}
