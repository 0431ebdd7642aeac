//! The process's handles on the persistent caches, and their Python face (`cache_info`,
//! `cache_list`, `cache_clear`, `plugin_identity`, used by `python -m tpu_dynamo`; `graph_get`,
//! `graph_put`, used by `graph_cache.py`).
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::UNIX_EPOCH;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tpu_dynamo_cache::{DiskCache, DiskConfig, Entry, Key, Lookup, Mode, PluginIdentity, PutError};

use crate::counters::STATS;
use crate::device::target;
use crate::errors::runtime_err;

/// The open caches: executables in the configured directory, converted graphs (`graph_get`) in
/// its `graphs/` subdirectory, under the same mode and size bound.
struct Opened {
    config: Result<DiskConfig, String>,
    executables: Arc<DiskCache>,
    graphs: Arc<DiskCache>,
}

static DISK: Mutex<Option<Opened>> = Mutex::new(None);

/// The caches the environment configures now. Reopened when the `TPU_DYNAMO_CACHE*` variables
/// change (tests and notebooks switch directories in-process); opening is where an unusable
/// directory is found, so its warning goes to `warnings` once per opening.
fn opened(warnings: &mut Vec<String>) -> (Arc<DiskCache>, Arc<DiskCache>) {
    let config = DiskConfig::from_env();
    let mut slot = DISK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(o) = slot.as_ref().filter(|o| o.config == config) {
        return (o.executables.clone(), o.graphs.clone());
    }
    let executables = Arc::new(match &config {
        Ok(c) => DiskCache::open(c.clone()),
        Err(_) => DiskCache::from_env(),
    });
    warnings.extend(executables.warning().map(str::to_owned));
    // Under a directory that is off (or read-only) for a reason already warned about, the
    // subdirectory is too, without a second warning; so is a read-only one never written.
    let graphs = Arc::new(match &config {
        Ok(c) if executables.mode() == c.mode && (c.mode == Mode::ReadWrite || c.dir.join("graphs").is_dir()) => {
            let graphs = DiskCache::open(DiskConfig { dir: c.dir.join("graphs"), ..c.clone() });
            warnings.extend(graphs.warning().map(str::to_owned));
            graphs
        }
        _ => DiskCache::open(DiskConfig { mode: Mode::Off, ..DiskConfig::new("") }),
    });
    *slot = Some(Opened { config, executables: executables.clone(), graphs: graphs.clone() });
    (executables, graphs)
}

/// The executable cache the environment configures now.
pub fn disk_cache(warnings: &mut Vec<String>) -> Arc<DiskCache> {
    opened(warnings).0
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

/// The disk cache as configured now: `dir`, `mode` (effective), `max_bytes`, `entries` and
/// `bytes` (executables), `graphs` and `graph_bytes` (converted graphs), `warning` (why the
/// mode is below the configured one, or None). Loads no plugin.
#[pyfunction]
pub fn cache_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let (executables, graphs) = opened(&mut vec![]);
    let (info, graphs) = (executables.info(), graphs.info());
    let d = PyDict::new(py);
    d.set_item("dir", info.dir.to_string_lossy().into_owned())?;
    d.set_item("mode", mode_name(info.mode))?;
    d.set_item("max_bytes", info.max_bytes)?;
    d.set_item("entries", info.entries)?;
    d.set_item("bytes", info.bytes)?;
    d.set_item("graphs", graphs.entries)?;
    d.set_item("graph_bytes", graphs.bytes)?;
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

/// Removes every entry, executables and converted graphs; returns how many. Raises `OSError`
/// when the cache is read-only.
#[pyfunction]
pub fn cache_clear() -> PyResult<usize> {
    let (executables, graphs) = opened(&mut vec![]);
    Ok(executables.clear()? + graphs.clear()?)
}

/// The converted graph stored under `key`, a digest of a Dynamo graph and of everything its
/// conversion depends on (`graph_cache.py`), or None. A damaged entry is logged, removed and
/// missed. Entries are opaque bytes bound to no plugin: a converted graph is plugin-free.
#[pyfunction]
pub fn graph_get<'py>(py: Python<'py>, key: &[u8]) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let key = graph_key(key)?;
    let mut warnings = vec![];
    let graphs = opened(&mut warnings).1;
    let found = match py.detach(|| graphs.get(&key, &PluginIdentity::default())) {
        Lookup::Hit(entry) => {
            STATS.graph_hits.fetch_add(1, Relaxed);
            Some(PyBytes::new(py, &entry.executable))
        }
        Lookup::Miss => {
            STATS.graph_misses.fetch_add(1, Relaxed);
            None
        }
        Lookup::Rejected(why) => {
            STATS.graph_misses.fetch_add(1, Relaxed);
            STATS.graph_rejects.fetch_add(1, Relaxed);
            warnings.push(format!(
                "disk cache entry {} rejected: {why}; converting its graph again",
                graphs.path(&key).display()
            ));
            None
        }
    };
    log_warnings(py, &warnings)?;
    Ok(found)
}

/// Stores `payload` under `key` (see `graph_get`); a failed write is logged, never raised.
#[pyfunction]
pub fn graph_put(py: Python<'_>, key: &[u8], payload: &[u8]) -> PyResult<()> {
    let key = graph_key(key)?;
    let mut warnings = vec![];
    let graphs = opened(&mut warnings).1;
    let entry = Entry { plugin: PluginIdentity::default(), inputs: vec![], outputs: vec![], executable: payload.to_vec() };
    match py.detach(|| graphs.put(&key, &entry)) {
        Ok(()) => {
            STATS.graph_writes.fetch_add(1, Relaxed);
        }
        Err(PutError::NotWritable) => {}
        Err(e) => warnings.push(format!("disk cache: converted graph not stored: {e}")),
    }
    log_warnings(py, &warnings)
}

fn graph_key(key: &[u8]) -> PyResult<Key> {
    let bytes = key.try_into().map_err(|_| PyValueError::new_err(format!("a graph key is 32 bytes, got {}", key.len())))?;
    Ok(Key(bytes))
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
