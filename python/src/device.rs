//! The process-wide PJRT client: one per process, created on first use. A failed discovery is
//! not remembered, so installing a plugin and retrying works without a restart.
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use tpu_dynamo_cache::{host_cpu_features, DiskCache, PluginIdentity};
use tpu_dynamo_runtime::{Client, ClientOptions, Device, Error, Plugin};

use crate::counters::{add_time, STATS};

pub struct Target {
    pub client: Client,
    pub device: Device,
    /// Built on first use, and only by processes that compile or inspect the cache; the plugin
    /// file's hash (hundreds of MB to read) comes from the disk cache's memo when it can.
    identity: OnceLock<Result<PluginIdentity, String>>,
}

impl Target {
    /// What disk cache entries made here are bound to; `Err` (the plugin file is unreadable)
    /// means no disk cache. `on_first_error` sees that error once per process, to log it.
    /// `disk` remembers the plugin file's hash across processes.
    pub fn identity(&self, disk: &DiskCache, on_first_error: impl FnOnce(&str)) -> Result<&PluginIdentity, &str> {
        self.identity
            .get_or_init(|| {
                let start = Instant::now();
                let identity = plugin_identity(&self.client, disk);
                add_time(&STATS.identity_nanos, start.elapsed());
                if let Err(e) = &identity {
                    on_first_error(e);
                }
                identity
            })
            .as_ref()
            .map_err(String::as_str)
    }
}

fn plugin_identity(client: &Client, disk: &DiskCache) -> Result<PluginIdentity, String> {
    let plugin = client.plugin();
    let path = plugin.path().display();
    let library_hash = disk
        .file_hash(plugin.path()).map_err(|e| format!("cannot hash the PJRT plugin {path}: {e}; disk cache off"))?;
    let platform = client.platform_name().map_err(|e| e.to_string())?;
    let (major, minor) = plugin.api_version();
    Ok(PluginIdentity {
        library_hash,
        pjrt_api_version: format!("{major}.{minor}"),
        xla_version: plugin.attribute_str("xla_version").unwrap_or_default(),
        platform_version: client.platform_version().map_err(|e| e.to_string())?,
        // XLA:CPU code uses the compiling host's ISA extensions.
        cpu_features: if platform == "cpu" { host_cpu_features() } else { String::new() },
        platform,
    })
}

static TARGET: Mutex<Option<Arc<Target>>> = Mutex::new(None);

pub fn target() -> Result<Arc<Target>, Error> {
    let mut slot = TARGET.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(t) = slot.as_ref() {
        return Ok(t.clone());
    }
    let client = Client::new(Plugin::discover(None)?, &ClientOptions::default())?;
    let device = client
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidArgument("the PJRT plugin reports no devices".into()))?;
    let t = Arc::new(Target { client, device, identity: OnceLock::new() });
    *slot = Some(t.clone());
    Ok(t)
}
