//! Builds the Pingora server from a config: listeners, worker threads, the
//! admin listener, upstream health checks, the Redis probe, graceful shutdown.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::apps::HttpServerOptions;
use pingora::listeners::tls::TlsSettings;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::{Server, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::listening::Service;

use super::admin::Admin;
use super::deadline::HeaderDeadline;
use super::reload::Reloader;
use super::upstreams::Pools;
use super::{Gateway, Live};
use crate::admission::Policy;
use crate::certs::Certificates;
use crate::clock::SystemClock;
use crate::config::{Backend, Config};
use crate::identity::apikeys::runtime::RuntimeKeys;
use crate::identity::Credentials;
use crate::limiter::standing::Standing;
use crate::limiter::{Fallback, LocalBackend, RedisBackend};

/// The start-up attempt to reach Redis, then the breaker's watchdog and
/// failback probe until shutdown, on a thread of their own: what they
/// measure is Redis's latency, not the proxy workers'.
/// At shutdown it gives back this replica's leases first thing in the
/// grace period, so a stop strands no token of a shared limit.
/// Follows the runtime API keys in Redis (`apikeys::runtime::sync`).
struct KeySync {
    limiter: Arc<Fallback>,
    store: Arc<RuntimeKeys>,
    prefix: String,
    snapshot: Option<crate::identity::apikeys::snapshot::Snapshot>,
}

#[async_trait]
impl BackgroundService for KeySync {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        if let Some(redis) = self.limiter.redis() {
            let stop = async move {
                let _ = shutdown.changed().await;
            };
            crate::identity::apikeys::runtime::sync(
                self.store.clone(),
                redis,
                self.prefix.clone(),
                self.snapshot.clone(),
                stop,
            )
            .await;
        }
    }
}

/// Keeps the JWKS of every `[[auth.jwt.issuers]]` endpoint fresh
/// (`jwt::source::keep_fresh`).
struct JwksRefresh;

#[async_trait]
impl BackgroundService for JwksRefresh {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        crate::identity::jwt::source::keep_fresh(async move {
            let _ = shutdown.changed().await;
        })
        .await;
    }
}

struct Prober {
    limiter: Arc<Fallback>,
    startup_wait: Duration,
    interval: Duration,
    grace: Duration,
}

#[async_trait]
impl BackgroundService for Prober {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        // Pingora drops this runtime's tasks when it stops it, and waits
        // (graceful_shutdown_timeout_seconds, at least 1 s) only for
        // blocking ones: the leases go back from a thread and a runtime of
        // their own, within that second. The thread is started now and
        // waits: with no grace period the runtime can stop before this
        // task is polled again, and then its dropped sender wakes the
        // thread (started only at shutdown, it was sometimes never
        // started, and a stop stranded the leases).
        let (stopping, stop) = std::sync::mpsc::channel::<()>();
        let limiter = self.limiter.clone();
        let within = self
            .grace
            .clamp(Duration::from_millis(200), Duration::from_millis(800));
        let release = tokio::task::spawn_blocking(move || {
            let _ = stop.recv();
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(limiter.release_leases(true, within)),
                Err(e) => {
                    tracing::warn!(error = %e, "limiter: cannot give leases back at shutdown")
                }
            }
        });
        let work = async {
            self.limiter.start(self.startup_wait).await;
            self.limiter.clone().watch(self.interval).await;
        };
        tokio::select! {
            _ = work => {}
            _ = shutdown.changed() => {}
        }
        let _ = stopping.send(());
        let _ = release.await;
    }
}

/// Every second: the health checks of whichever pools are current, and the
/// local limiter's size for `/metrics`.
struct HealthChecks {
    live: Arc<ArcSwap<Live>>,
    limiter: Arc<Fallback>,
}

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            let pools = self.live.load().pools.clone();
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = async {
                    crate::metrics::local_entries(self.limiter.local_entries());
                    pools.check_health().await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                } => {}
            }
        }
    }
}

/// Every second: re-reads the TLS certificate files; a change with every file
/// valid is swapped in, a bad one keeps the certificates in use (and says why).
struct CertificateReload {
    certs: Arc<Certificates>,
}

#[async_trait]
impl BackgroundService for CertificateReload {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut last_error = String::new();
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            match self.certs.reload() {
                Ok(false) => {}
                Ok(true) => {
                    last_error.clear();
                    crate::metrics::certificate_reload(true);
                    tracing::info!(names = ?self.certs.names(), "tls: certificates reloaded");
                }
                Err(e) => {
                    let text = e.to_string();
                    if text != last_error {
                        crate::metrics::certificate_reload(false);
                        tracing::error!(error = %text, "tls: certificate files changed but cannot be used; keeping the certificates in use");
                        last_error = text;
                    }
                }
            }
        }
    }
}

/// At a graceful stop, sends the spans still queued (`[tracing]`), within
/// the last second Pingora gives blocking tasks.
struct TraceFlush {
    traces: Arc<crate::traces::Traces>,
}

#[async_trait]
impl BackgroundService for TraceFlush {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let _ = shutdown.changed().await;
        let traces = self.traces.clone();
        let _ = tokio::task::spawn_blocking(move || traces.flush(Duration::from_millis(800))).await;
    }
}

/// Starts serving; returns only on a start-up error.
pub fn run(config: Config, credentials: Credentials, path: &Path) -> Result<(), String> {
    // Pingora's TLS connector reads these at start-up and panics when one
    // names a file that is not there: say so plainly instead.
    for var in ["SSL_CERT_FILE", "SSL_CERT_DIR"] {
        if let Some(p) = std::env::var_os(var) {
            if let Err(e) = std::fs::metadata(&p) {
                return Err(format!("{var}={}: {e}", Path::new(&p).display()));
            }
        }
    }
    let config = Arc::new(config);
    crate::metrics::api_keys(credentials.keys.len());
    let srv = &config.server;
    // Pingora retries a taken port every second, forever: say so and stop.
    let tls_listen = srv.tls.iter().flat_map(|t| t.listen.iter());
    for (key, addr) in srv
        .listen
        .iter()
        .map(|a| ("server.listen", a))
        .chain(srv.admin_listen.iter().map(|a| ("server.admin_listen", a)))
        .chain(tls_listen.map(|a| ("server.tls.listen", a)))
    {
        if let Err(e) = std::net::TcpListener::bind(addr.as_str()) {
            return Err(format!("{key}: cannot listen on {addr}: {e}"));
        }
    }

    let mut conf = ServerConf {
        threads: srv.threads,
        // Pingora waits the grace period, then gives runtimes a last second:
        // together they stay within grace_period_secs.
        grace_period_seconds: Some(srv.grace_period_secs.saturating_sub(1)),
        graceful_shutdown_timeout_seconds: Some(srv.grace_period_secs.min(1)),
        max_retries: 2,
        upstream_keepalive_pool_size: 1024,
        ..ServerConf::default()
    };
    conf.pid_file = std::env::temp_dir()
        .join(format!("gateway-{}.pid", std::process::id()))
        .display()
        .to_string();
    conf.upgrade_sock = std::env::temp_dir()
        .join(format!("gateway-upgrade-{}.sock", std::process::id()))
        .display()
        .to_string();
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();

    let limiter = build_limiter(&config)?;
    limiter.set_quotas(credentials.has_quotas(&config));
    let pools = Pools::build(&config.upstreams)?;
    let gates = crate::inflight::Gates::build(&config, None, limiter.replicas());
    let runtime_keys = Arc::new(RuntimeKeys::default());
    let live = Arc::new(ArcSwap::from_pointee(Live::new(
        Arc::new(Policy::new(config.clone(), &credentials).with_runtime_keys(runtime_keys.clone())),
        Arc::new(pools),
        Arc::new(gates),
    )));
    let top = Arc::new(crate::top::Top::new(config.admin.top));
    // The standard OTEL_* variables win over `[tracing]`'s keys.
    let traces = match &config.tracing {
        Some(t) => {
            let settings = t.from_env(|name| std::env::var(name).ok())?;
            let traces = crate::traces::Traces::start(settings)?;
            tracing::info!(
                endpoint = %traces.settings.traces_url,
                sample_ratio = traces.settings.sample_ratio,
                service_name = %traces.settings.service_name,
                "tracing: spans exported over OTLP/HTTP"
            );
            Some(Arc::new(traces))
        }
        None => None,
    };
    if let Some(traces) = &traces {
        server.add_service(background_service(
            "trace flush",
            TraceFlush {
                traces: traces.clone(),
            },
        ));
    }
    let gateway = Gateway {
        live: live.clone(),
        limiter: limiter.clone(),
        top: top.clone(),
        traces,
    };
    let mut proxy = pingora::proxy::HttpProxy::new(gateway, server.configuration.clone());
    proxy.handle_init_modules();
    if srv.h2c {
        // Plaintext HTTP/2 with prior knowledge; HTTP/1.1 still served.
        let mut options = HttpServerOptions::default();
        options.h2c = true;
        proxy.server_options = Some(options);
    }
    let app = HeaderDeadline {
        inner: Arc::new(proxy),
        deadline: Duration::from_millis(srv.header_read_timeout_ms),
    };
    let mut service = Service::new("gateway".to_string(), app);
    for addr in &srv.listen {
        service.add_tcp(addr);
    }
    if let Some(tls) = &srv.tls {
        let certs = Arc::new(Certificates::load(&tls.certificates).map_err(|e| e.to_string())?);
        for addr in &tls.listen {
            // The resolver picks the certificate; these paths are never read.
            let mut settings = TlsSettings::intermediate("", "").map_err(|e| e.to_string())?;
            settings.set_cert_resolver(certs.clone());
            settings.enable_h2();
            service.add_tls_with_settings(addr, None, settings);
        }
        tracing::info!(listen = ?tls.listen, names = ?certs.names(), "tls: listening");
        server.add_service(background_service(
            "certificate reload",
            CertificateReload { certs },
        ));
    }
    server.add_service(service);

    if let Some(admin_addr) = &srv.admin_listen {
        let mut admin = Service::new(
            "admin".to_string(),
            Admin {
                limiter: limiter.clone(),
                live: live.clone(),
                top,
            },
        );
        admin.add_tcp(admin_addr);
        server.add_service(admin);
    }
    server.add_service(background_service(
        "health checks",
        HealthChecks {
            live: live.clone(),
            limiter: limiter.clone(),
        },
    ));
    server.add_service(background_service(
        "config reload",
        Reloader {
            path: path.to_path_buf(),
            live,
            started_with: config.clone(),
            limiter: limiter.clone(),
            retired: Default::default(),
            loader: super::reload::Loader::start()
                .map_err(|e| format!("cannot start the config-load thread: {e}"))?,
        },
    ));
    // Always: a reload may add an issuer with a JWKS endpoint.
    server.add_service(background_service("jwks refresh", JwksRefresh));
    if limiter.has_redis() {
        server.add_service(background_service(
            "runtime api keys",
            KeySync {
                limiter: limiter.clone(),
                store: runtime_keys,
                prefix: config.key_prefix().to_string(),
                snapshot: crate::identity::apikeys::snapshot::Snapshot::of(&config),
            },
        ));
    }
    if let Some(redis) = &config.redis {
        if limiter.has_redis() {
            server.add_service(background_service(
                "redis probe",
                Prober {
                    limiter: limiter.clone(),
                    startup_wait: Duration::from_millis(srv.startup_redis_wait_ms),
                    interval: Duration::from_millis(redis.probe_interval_ms),
                    grace: Duration::from_secs(srv.grace_period_secs),
                },
            ));
        }
    }
    tracing::info!(listen = ?srv.listen, admin = ?srv.admin_listen, threads = srv.threads, keys = credentials.keys.len(), "gateway starting");
    // From here the live policy alone holds the start-up config (and its
    // keys, maybe a million): a reload frees them.
    drop(config);
    server.run_forever();
}

fn build_limiter(config: &Config) -> Result<Arc<Fallback>, String> {
    let clock = Arc::new(SystemClock);
    let local = LocalBackend::new(config.limiter.local_max_entries, clock);
    let redis = match (config.limiter.backend, &config.redis) {
        (Backend::Redis, Some(r)) => {
            let backend = RedisBackend::from_settings(r, None)
                .map_err(|e| format!("[redis]: {e}"))?
                .with_quota_retention(config.limiter.quota_retention_days)
                .with_call_marks(config.key_prefix());
            let leases = config.limiter.leases;
            Some(if leases.enabled {
                backend.with_leases(
                    Duration::from_millis(leases.period_ms),
                    config.limiter.local_max_entries,
                )
            } else {
                backend
            })
        }
        _ => None,
    };
    Ok(Fallback::new(
        redis,
        local,
        config.limiter.on_redis_failure,
        config.limiter.instances,
        config.key_prefix(),
        config.limiter.local_max_entries,
        Duration::from_millis(config.server.startup_redis_wait_ms),
        config.limiter.shares.used().then(|| {
            Standing::new(
                config.limiter.shares,
                config.limiter.instances,
                config.limiter.local_max_entries,
                Fallback::ANNOUNCEMENT_LIFE,
            )
        }),
    ))
}
