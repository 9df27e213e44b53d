//! Every integration test in one binary: real `redis-server`s, the real
//! gateway binary and mock upstreams over loopback. One binary links once
//! (27 did, each linking Pingora), and its harness keeps both cores busy
//! across what used to be separate runs. One module a concern.

mod support;

mod adaptive;
mod browser_cors;
mod charged;
mod cluster_conformance;
mod config_validation;
mod cors;
mod edges;
mod fallback;
mod grpc;
mod hostile;
mod inflight;
mod jwt;
mod jwt_edges;
mod key_files;
mod keys;
mod leases;
mod limiter_conformance;
mod limits;
mod operations;
mod partition;
mod proxy;
mod quota_leases;
mod quotas;
mod redis_tls;
mod routing;
mod runtime_keys;
mod saturation;
mod shards;
mod spread_client;
mod standing_shares;
mod tiers;
mod tls;
mod top;
mod topology;
mod traces;
mod ui;
mod usage;
