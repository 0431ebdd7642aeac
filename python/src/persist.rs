//! The process's handle on the persistent executable cache, and its Python face
//! (`cache_info`, `cache_list`, `cache_clear`, `plugin_identity`, used by `python -m tpu_dynamo`).
use std::sync::{Arc, Mutex};
use std::time::UNIX_EPOCH;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tpu_dynamo_cache::{DiskCache, DiskConfig, Mode};

use crate::device::target;
use crate::errors::runtime_err;

/// The open cache and the configuration it was opened from.
type Slot = Option<(Result<DiskConfig, String>, Arc<DiskCache>)>;

static DISK: Mutex<Slot> = Mutex::new(None);

/// The disk cache the environment configures now. Reopened when the `TPU_DYNAMO_CACHE*`
/// variables change (tests and notebooks switch directories in-process); opening is where an
/// unusable directory is found, so its warning goes to `warnings` once per opening.
pub fn disk_cache(warnings: &mut Vec<String>) -> Arc<DiskCache> {
    let config = DiskConfig::from_env();
    let mut slot = DISK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((opened_with, cache)) = slot.as_ref() {
        if *opened_with == config {
            return cache.clone();
        }
    }
    let cache = Arc::new(match &config {
        Ok(c) => DiskCache::open(c.clone()),
        Err(_) => DiskCache::from_env(),
    });
    warnings.extend(cache.warning().map(str::to_owned));
    *slot = Some((config, cache.clone()));
    cache
}

/// Logs through Python's `tpu_dynamo` logger, where users configure what they see.
pub fn log_warnings(py: Python<'_>, warnings: &[String]) -> PyResult<()> {
    if warnings.is_empty() {
        return Ok(());
    }
    let log = py.import("logging")?.call_method1("getLogger", ("tpu_dynamo",))?;
    for w in warnings {
        log.call_method1("warning", ("%s", w))?;
    }
    Ok(())
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Off => "off",
        Mode::ReadOnly => "readonly",
        Mode::ReadWrite => "readwrite",
    }
}

/// The disk cache as configured now: `dir`, `mode` (effective), `max_bytes`, `entries`,
/// `bytes`, `warning` (why the mode is below the configured one, or None). Loads no plugin.
#[pyfunction]
pub fn cache_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = disk_cache(&mut vec![]).info();
    let d = PyDict::new(py);
    d.set_item("dir", info.dir.to_string_lossy().into_owned())?;
    d.set_item("mode", mode_name(info.mode))?;
    d.set_item("max_bytes", info.max_bytes)?;
    d.set_item("entries", info.entries)?;
    d.set_item("bytes", info.bytes)?;
    d.set_item("warning", info.warning)?;
    Ok(d)
}

/// Stored entries, most recently used first: `(key hex, path, bytes, last used as Unix seconds)`.
#[pyfunction]
pub fn cache_list() -> Vec<(String, String, u64, f64)> {
    disk_cache(&mut vec![])
        .list()
        .into_iter()
        .map(|e| {
            let used = e.last_used.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            (e.key_hex, e.path.to_string_lossy().into_owned(), e.bytes, used)
        })
        .collect()
}

/// Removes every entry; returns how many. Raises `OSError` when the cache is read-only.
#[pyfunction]
pub fn cache_clear() -> PyResult<usize> {
    Ok(disk_cache(&mut vec![]).clear()?)
}

/// What disk cache entries made by this process are bound to (loads the plugin and hashes it).
#[pyfunction]
pub fn plugin_identity(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let t = target().map_err(runtime_err)?;
    let id = t.identity(&disk_cache(&mut vec![]), |_| {}).map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
    let d = PyDict::new(py);
    d.set_item("library_hash", &id.library_hash)?;
    d.set_item("pjrt_api_version", &id.pjrt_api_version)?;
    d.set_item("xla_version", &id.xla_version)?;
    d.set_item("platform", &id.platform)?;
    d.set_item("platform_version", &id.platform_version)?;
    d.set_item("cpu_features", &id.cpu_features)?;
    Ok(d)
}
