//! Who the client is: its address (behind trusted proxies), the credentials
//! it presents, and what they name.
//!
//! - `client`: the client's address and the bucket it falls in, and the API
//!   key or bearer token a request presents. Pure: strings and addresses in.
//! - `apikeys`: the API keys a secret is looked up in (`[[api_keys]]`, the
//!   keys file, and keys issued at runtime, kept in Redis by `store`).
//! - `jwt`: verified JWTs (issuers' keys from files or JWKS endpoints, a
//!   cache of tokens already verified).
//! - `attributes`: request attributes a route limit keys on (headers,
//!   query parameters, a verified token's claims); `value`: what such a
//!   value may be.
//! - `credentials`: the files a config names (the keys file, JWT key
//!   files), read into the sets above, at start, on `check` and on reload.
//!
//! `admission` asks this room who a request is from; nothing here decides a
//! limit.

pub mod apikeys;
pub mod attributes;
pub mod client;
pub mod credentials;
pub mod jwt;
pub mod value;

pub use client::{bearer_jwt, canonical, client_ip, presented_key, ClientAddr, KeyError};
pub use credentials::Credentials;
