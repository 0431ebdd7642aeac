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
    /// The plugin computes in host memory (XLA:CPU): results can become host tensors as they are.
    pub host_memory: bool,
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

/// XLA:CPU by default runs each execute on its thread pool and signals completion through an
/// event. For the graphs a backend sees that hand-off dominates: the caller sleeps, a worker wakes,
/// and afterwards the pool's workers spin looking for work, on a small machine competing with the
/// Python thread that runs the model (micro graph, 2 cores: 30 µs per execute, 150 µs per call;
/// inline: 11 µs and 47 µs; UNet 75 ms → 49 ms). `asynchronous=false` executes on the calling
/// thread (the pool still runs the parallel parts of an execute). Plugins that do not know the
/// option ignore it (PJRT API 0.81) or reject it: then the first client stays.
fn inline_cpu_client(plugin: Arc<Plugin>) -> Option<Client> {
    // The plugin logs the option through absl ("asynchronous set via create_options: false",
    // preceded by absl's "log messages before InitializeLog" banner): noise for every user.
    with_stderr_silenced(|| Client::new(plugin, &ClientOptions::default().cpu_device_count(1).bool("asynchronous", false))).ok()
}

/// Runs `f` with file descriptor 2 on /dev/null, restoring it afterwards (even if `f` panics).
fn with_stderr_silenced<T>(f: impl FnOnce() -> T) -> T {
    use std::ffi::c_int;
    use std::os::fd::AsRawFd;
    extern "C" {
        fn dup(fd: c_int) -> c_int;
        fn dup2(from: c_int, to: c_int) -> c_int;
        fn close(fd: c_int) -> c_int;
    }
    struct Restore(c_int);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: `self.0` is the duplicate of fd 2 made below, closed exactly once here.
            unsafe {
                dup2(self.0, 2);
                close(self.0);
            }
        }
    }
    let Ok(null) = std::fs::File::options().write(true).open("/dev/null") else { return f() };
    // SAFETY: plain descriptor calls on fds this function owns or fd 2, which it restores.
    let saved = unsafe { dup(2) };
    if saved < 0 || unsafe { dup2(null.as_raw_fd(), 2) } < 0 {
        if saved >= 0 {
            unsafe { close(saved) };
        }
        return f();
    }
    let _restore = Restore(saved);
    f()
}

static TARGET: Mutex<Option<Arc<Target>>> = Mutex::new(None);

pub fn target() -> Result<Arc<Target>, Error> {
    let mut slot = TARGET.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(t) = slot.as_ref() {
        return Ok(t.clone());
    }
    let plugin = Plugin::discover(None)?;
    let client = Client::new(plugin.clone(), &ClientOptions::default())?;
    let host_memory = client.platform_name().is_ok_and(|p| p == "cpu");
    let client = if host_memory { inline_cpu_client(plugin).unwrap_or(client) } else { client };
    let device = client
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidArgument("the PJRT plugin reports no devices".into()))?;
    let t = Arc::new(Target { client, device, host_memory, identity: OnceLock::new() });
    *slot = Some(t.clone());
    Ok(t)
}
