//! A rate-limiting API gateway on Pingora.
//!
//! Data flows one way: `proxy` → `admission` → {`identity`, `routing`,
//! `attributes`, `cors`, `limiter`} → {`clock`, `config`}. Nothing imports `proxy`.

pub mod admission;
pub mod apikeys;
pub mod attributes;
pub mod calendar;
pub mod certs;
pub mod clock;
pub mod config;
pub mod cors;
pub mod identity;
pub mod inflight;
pub mod jwt;
pub mod limiter;
pub mod logging;
pub mod metrics;
pub mod operator;
pub mod path;
pub mod proxy;
pub mod routing;
pub mod shard_map;
pub mod usage;
