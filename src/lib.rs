//! A rate-limiting API gateway on Pingora.
//!
//! Data flows one way (`../shared/tools/rooms.py src` shows the arrows):
//!
//! - `proxy` (the only room that touches Pingora) → `admission`, `inflight`,
//!   `usage`, `certs`, `logging`; `operator` (the CLI's questions) →
//!   `admission`, `usage`. Nothing imports either.
//! - `admission` → `identity` (who the client is: address, API keys,
//!   verified JWTs, attributes), `routing`, `cors`, `limiter`.
//! - `identity` → `limiter` (only its Redis connection handle, for the
//!   runtime key store).
//! - `limiter`, `inflight`, `routing`, `cors`, `certs` → `config` (the
//!   settings as written, validated: it reads no other file).
//! - The floor, which imports nothing above it: `config` → `calendar`,
//!   `path`; `calendar` → `clock`; `metrics` (every room records there, with
//!   labels as `&'static str` or its own closed types).

pub mod admission;
pub mod calendar;
pub mod certs;
pub mod clock;
pub mod config;
pub mod cors;
pub mod identity;
pub mod inflight;
pub mod limiter;
pub mod logging;
pub mod metering;
pub mod metrics;
pub mod operator;
pub mod path;
pub mod proxy;
pub mod routing;
pub mod shard_map;
pub mod top;
pub mod traces;
pub mod usage;
