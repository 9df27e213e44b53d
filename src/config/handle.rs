//! The live configuration: one `arc-swap` pointer, replaced whole on reload.
//!
//! A reload that fails validation leaves the current snapshot in place, so a
//! typo in the file can never take the gateway down. Readers take one snapshot
//! per request and never hold the guard across an `.await`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::{load, Config, LoadError};

pub struct ConfigHandle {
    path: PathBuf,
    current: ArcSwap<Config>,
}

impl ConfigHandle {
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let config = load(path)?;
        Ok(ConfigHandle {
            path: path.to_path_buf(),
            current: ArcSwap::from_pointee(config),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn snapshot(&self) -> Arc<Config> {
        self.current.load_full()
    }

    /// Re-reads the file; on success swaps it in and returns (old, new).
    pub fn reload(&self) -> Result<(Arc<Config>, Arc<Config>), LoadError> {
        let new = Arc::new(load(&self.path)?);
        let old = self.current.swap(new.clone());
        Ok((old, new))
    }
}
