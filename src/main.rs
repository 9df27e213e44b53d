//! `gateway`: CLI and wiring only.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

// Proxies allocate and free small buffers on every request; mimalloc's
// thread-local free lists make that cheaper than glibc's malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ratelimit_gateway::admission::Subject;
use ratelimit_gateway::identity;
use ratelimit_gateway::identity::credentials::{self, Files};
use ratelimit_gateway::{certs, config, logging, metrics, operator, proxy};

#[derive(Parser)]
#[command(
    name = "gateway",
    version,
    about = "A rate-limiting API gateway on Pingora"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start serving.
    #[command(after_help = "\
Signals:
  HUP   reload the config file (also reloaded when its content changes: polled every 500 ms)
  TERM  graceful shutdown: stop accepting, finish requests in flight (server.grace_period_secs)
  INT   fast shutdown

Watched while running: the config file, the certificate files server.tls names,
redis.password_file. A file that cannot be read is logged once; what was read
last stays in use. Keys that need a restart are logged when they change.

Environment:
  GATEWAY_LOG         log filter, like RUST_LOG (default: info,rustls=error)
  GATEWAY_LOG_FORMAT  json: one JSON object per line (default: text)
  ${VAR} in the config: any string value may name one (${VAR:-default})")]
    Run {
        #[arg(short, long, default_value = "gateway.toml")]
        config: PathBuf,
    },
    /// Validate a config and print what it sets, like `nginx -t`.
    Check {
        #[arg(short, long, default_value = "gateway.toml")]
        config: PathBuf,
    },
    /// See or reset a client's buckets (Redis directly, or the gateway's
    /// admin port for the local backend). Name a client with --key or --ip,
    /// or a header- or query-keyed route's bucket with --route and --value.
    Limits {
        #[command(subcommand)]
        action: LimitsAction,
    },
    /// Who is being refused right now: the clients refused most per route
    /// and tier over the last minute, from each replica's admin listener
    /// (`GET /top`), merged.
    Top {
        #[arg(short, long, default_value = "gateway.toml")]
        config: PathBuf,
        /// The replicas' admin listeners, HOST:PORT, comma-separated
        /// (default: the config's server.admin_listen).
        #[arg(long, value_delimiter = ',')]
        admin: Vec<String>,
        /// Only this route.
        #[arg(long)]
        route: Option<String>,
        /// Only this tier: ip, key, route, quota-day, ...
        #[arg(long)]
        tier: Option<String>,
        /// Over the last this many seconds (1 to 60).
        #[arg(long, default_value_t = 60)]
        window: u32,
        /// At most this many clients.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Print the JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Each API key's use of one quota period, for billing (CSV or JSON
    /// lines), read from Redis with SCAN. An ended period is there for
    /// limiter.quota_retention_days after its end.
    Usage {
        #[arg(short, long, default_value = "gateway.toml")]
        config: PathBuf,
        /// minute, hour, day, week or month.
        #[arg(long)]
        period: String,
        /// A day of the period (2026-10-15, in limiter.quota_time_zone) or
        /// an RFC 3339 time; default: now.
        #[arg(long)]
        at: Option<String>,
        /// csv or jsonl.
        #[arg(long, default_value = "csv")]
        format: String,
    },
    /// Issue, change, revoke and list API keys at runtime: kept in Redis,
    /// in force on every replica within a second (as `/keys` on the admin
    /// listener). A key's secret is printed once, when it is issued.
    Keys {
        #[arg(short, long, default_value = "gateway.toml", global = true)]
        config: PathBuf,
        #[command(subcommand)]
        action: KeysAction,
    },
}

#[derive(Subcommand)]
enum KeysAction {
    /// Issue a key; prints it with its secret (shown this once).
    Create {
        #[arg(long)]
        id: String,
        #[command(flatten)]
        limits: KeyLimits,
    },
    /// Change a key's plan or its own limits.
    Update {
        #[arg(long)]
        id: String,
        #[command(flatten)]
        limits: KeyLimits,
    },
    /// Revoke a key: refused (401) by every replica within a second.
    Revoke {
        #[arg(long)]
        id: String,
    },
    /// A page of at most --limit keys (never a secret): --cursor from the
    /// last page's `next`.
    List {
        #[arg(long, default_value = "0")]
        cursor: String,
        /// 1 to 10000.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
}

#[derive(clap::Args)]
struct KeyLimits {
    #[arg(long)]
    plan: Option<String>,
    /// The key's own burst bucket (with --refill-per-sec).
    #[arg(long)]
    capacity: Option<u64>,
    #[arg(long)]
    refill_per_sec: Option<f64>,
    /// The key's own quotas, e.g. 1000/day;30000/month ("" for none).
    #[arg(long)]
    quotas: Option<String>,
}

#[derive(Subcommand)]
enum LimitsAction {
    /// Print the buckets: limit, remaining, time until whole.
    Show(LimitsArgs),
    /// Make the buckets whole again.
    Reset(LimitsArgs),
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("who").args(["key", "sub", "ip"])))]
struct LimitsArgs {
    #[arg(short, long, default_value = "gateway.toml")]
    config: PathBuf,
    /// An API key, by its id (never its secret).
    #[arg(long)]
    key: Option<String>,
    /// A JWT's client, by its id claim's value (`sub` unless `id_claim`
    /// says otherwise), limited as a request carrying its token.
    #[arg(long)]
    sub: Option<String>,
    /// The JWT client's issuer (`iss`): needed when more than one is configured.
    #[arg(long, requires = "sub")]
    issuer: Option<String>,
    /// The plan the JWT client's token names in its plan claim (mapped
    /// through `plan_map`); without it, the issuer's `default_plan`.
    #[arg(long, requires = "sub")]
    plan: Option<String>,
    /// A client address.
    #[arg(long)]
    ip: Option<std::net::IpAddr>,
    /// Only this route's bucket.
    #[arg(long)]
    route: Option<String>,
    /// For a route keyed on a header or query parameter: the value's bucket.
    #[arg(long)]
    value: Option<String>,
    /// Only this quota of the key or JWT client: minute, hour, day, week or month.
    #[arg(long, conflicts_with_all = ["ip", "route"])]
    quota: Option<String>,
    /// Print the JSON `/limits` answers instead of a table.
    #[arg(long)]
    json: bool,
}

impl KeyLimits {
    /// The JSON fields given (`--quotas ""`: none of its own).
    fn body(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if let Some(p) = &self.plan {
            m.insert("plan".into(), p.clone().into());
        }
        if let Some(c) = self.capacity {
            m.insert("capacity".into(), c.into());
        }
        if let Some(r) = self.refill_per_sec {
            m.insert("refill_per_sec".into(), r.into());
        }
        if let Some(q) = &self.quotas {
            let list: Vec<serde_json::Value> = q
                .split(';')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| match p.split_once('/') {
                    Some((l, period)) => serde_json::json!({
                        "limit": l.trim().parse::<f64>().map_or(serde_json::Value::from(l.trim()), Into::into),
                        "period": period.trim(),
                    }),
                    None => serde_json::Value::from(p),
                })
                .collect();
            m.insert("quotas".into(), list.into());
        }
        m
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        // Certificate files belong to the machine that runs the gateway: one
        // that cannot be read here is a warning (run refuses to start
        // without it), one that is read and refused is a problem listed
        // with the file's own.
        Command::Check { config } => {
            let check = |tls: &config::TlsListeners| certs::problems(&tls.certificates, false);
            match credentials::load(&config, Some(&check), Files::MayBeElsewhere) {
                Ok((cfg, creds)) => {
                    let certs = cfg
                        .server
                        .tls
                        .as_ref()
                        .map(|t| certs::Certificates::load(&t.certificates));
                    // Written without println!, which panics when the reader has
                    // gone (`gateway check | head -1`).
                    let mut out = std::io::stdout().lock();
                    let _ = write!(out, "{}: ok\n{}", config.display(), cfg.summary(&creds));
                    for w in cfg.warnings(&creds) {
                        eprintln!("warning: {w}");
                    }
                    for unread in &creds.unread {
                        eprintln!("warning: {unread}");
                    }
                    match certs {
                        Some(Ok(c)) => {
                            let _ = writeln!(out, "tls: certificates serve {:?}", c.names());
                        }
                        Some(Err(e)) => eprintln!(
                            "warning: {e}; `gateway run` refuses to start until it can be read"
                        ),
                        None => {}
                    }
                    if let Some(path) = cfg.redis.as_ref().and_then(|r| r.password_file.as_ref()) {
                        if let Err(e) = std::fs::read(path) {
                            eprintln!(
                            "warning: redis.password_file: cannot read {}: {e}; `gateway run` refuses to start until it can be read",
                            path.display()
                        );
                        }
                    }
                    // The runtime keys live in Redis: read if it answers soon,
                    // so an id both they and this config hold is named.
                    match operator::runtime_key_check(&cfg, &creds, Duration::from_secs(2)) {
                        None => {}
                        Some(Ok((n, conflicts))) if conflicts.is_empty() => {
                            let _ = writeln!(
                                out,
                                "runtime api keys: {n} in Redis, none sharing an id or a secret with the config's"
                            );
                        }
                        Some(Ok((_, conflicts))) => {
                            for c in &conflicts {
                                eprintln!("error: {c}");
                            }
                            return ExitCode::from(2);
                        }
                        // With no key of its own the config has nothing
                        // a runtime key could clash with.
                        Some(Err(_)) if creds.keys.is_empty() => {}
                        Some(Err(e)) => eprintln!(
                            "warning: runtime api keys not checked against the config's (Redis: {e})"
                        ),
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Limits { action } => {
            let (args, reset) = match action {
                LimitsAction::Show(a) => (a, false),
                LimitsAction::Reset(a) => (a, true),
            };
            let (cfg, creds) = match credentials::load(&args.config, None, Files::Required) {
                Ok(loaded) => loaded,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            let subject = match (args.key, args.sub, args.ip) {
                (Some(k), _, _) => Subject::Key(k),
                (None, Some(id), _) => Subject::Jwt {
                    id,
                    issuer: args.issuer,
                    plan: args.plan,
                },
                (None, None, Some(ip)) => Subject::Ip(ip),
                (None, None, None) if args.route.is_some() && args.value.is_some() => {
                    Subject::Nobody
                }
                (None, None, None) => {
                    eprintln!("gateway limits: name a client: --key ID or --ip ADDRESS, or a JWT's --sub ID (or a keyed route's bucket: --route NAME --value V)");
                    return ExitCode::from(2);
                }
            };
            let ask = operator::Ask {
                subject,
                route: args.route,
                value: args.value,
                quota: args.quota,
                reset,
            };
            match operator::run(cfg, &creds, &ask) {
                Ok(answer) => {
                    let mut out = std::io::stdout().lock();
                    let _ = if args.json {
                        writeln!(out, "{answer}")
                    } else {
                        write!(out, "{}", operator::table(&answer))
                    };
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gateway limits: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Top {
            config,
            admin,
            route,
            tier,
            window,
            limit,
            json,
        } => {
            let cfg = match credentials::load(&config, None, Files::Required) {
                Ok((cfg, _)) => cfg,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            let mut query = format!("window={window}&limit={limit}");
            for (name, v) in [("route", route), ("tier", tier)] {
                if let Some(v) = v {
                    query.push_str(&format!("&{name}={}", operator::encode(&v)));
                }
            }
            match operator::top(&cfg, &admin, &query) {
                Ok(answer) => {
                    let mut out = std::io::stdout().lock();
                    let _ = if json {
                        writeln!(out, "{answer}")
                    } else {
                        write!(out, "{}", operator::top_table(&answer))
                    };
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gateway top: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Usage {
            config,
            period,
            at,
            format,
        } => {
            let (cfg, creds) = match credentials::load(&config, None, Files::Required) {
                Ok(loaded) => loaded,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            match operator::usage(&cfg, &creds, &period, at.as_deref(), &format) {
                Ok(text) => {
                    let _ = std::io::stdout().lock().write_all(text.as_bytes());
                    ExitCode::SUCCESS
                }
                Err((code, e)) => {
                    eprintln!("gateway usage: {e}");
                    ExitCode::from(code)
                }
            }
        }
        Command::Keys { config, action } => {
            // The audit lines (target `audit`) go to stderr.
            logging::init();
            let (cfg, creds) = match credentials::load(&config, None, Files::Required) {
                Ok(loaded) => loaded,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            let ask = match action {
                KeysAction::Create { id, limits } => operator::KeysAsk::Create {
                    id,
                    body: limits.body(),
                },
                KeysAction::Update { id, limits } => operator::KeysAsk::Update {
                    id,
                    body: limits.body(),
                },
                KeysAction::Revoke { id } => operator::KeysAsk::Revoke { id },
                KeysAction::List { cursor, limit } => operator::KeysAsk::List { cursor, limit },
            };
            match operator::keys(&cfg, &creds, ask) {
                Ok(answer) => {
                    let _ = writeln!(std::io::stdout().lock(), "{answer}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gateway keys: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Run { config } => {
            logging::init();
            let check = |tls: &config::TlsListeners| certs::problems(&tls.certificates, true);
            let (cfg, creds) = match credentials::load(&config, Some(&check), Files::Required) {
                Ok(loaded) => loaded,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            for w in cfg.warnings(&creds) {
                tracing::warn!("config: {w}");
            }
            metrics::install();
            metrics::jwt_refusal_reasons(identity::jwt::TokenError::LABELS);
            // Returns only if start-up failed; serving exits the process itself.
            if let Err(e) = proxy::server::run(cfg, creds, &config) {
                eprintln!("gateway: {e}");
            }
            ExitCode::FAILURE
        }
    }
}
