//! The process-wide PJRT client: one per process, created on first use. A failed discovery is
//! not remembered, so installing a plugin and retrying works without a restart.
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use tpu_dynamo_cache::{host_cpu_features, DiskCache, PluginIdentity};
use tpu_dynamo_compiler::lower::{HostProduct, KeptF32, LoweringTarget, LOWERING_TARGET};
use tpu_dynamo_runtime::{host_kernels, Client, ClientOptions, Device, Error, Plugin};

use crate::counters::{add_time, STATS};

pub struct Target {
    pub client: Client,
    pub device: Device,
    /// The plugin computes in host memory (XLA:CPU): results can become host tensors as they are.
    pub host_memory: bool,
    /// The environment variables through which plugins take compiler flags, as the plugin read
    /// them (once, when it started): they change the code an executable holds.
    pub compiler_env: String,
    /// The custom call targets of our own kernels the plugin runs (`host_kernels`), which the
    /// lowering calls (part of the cache key).
    pub host_kernels: Vec<&'static str>,
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
/// `TPU_DYNAMO_CPU_INLINE=0` keeps the plugin's default.
fn inline_cpu_client(plugin: Arc<Plugin>) -> Option<Client> {
    // The plugin logs the option through absl ("asynchronous set via create_options: false",
    // preceded by absl's "log messages before InitializeLog" banner): noise for every user.
    let options = ClientOptions::default().cpu_device_count(1).bool("asynchronous", false);
    with_stderr_silenced(|| Client::new(plugin, &options)).ok()
}

/// XLA:CPU allocates each execute's temporaries and results with malloc. Under glibc's defaults
/// blocks above the (dynamic) mmap threshold are mapped and unmapped on every call and a freed
/// heap top is trimmed, so every call page-faults its working set in again, which on a VM is dear
/// (UNet, 2-core VM: 90-96 ms per call, 56-66 ms with freed memory kept; GPT-2 1.5-2.1 → 1.1-1.6 ms).
/// Serves every block from the heap (no per-block mmap; XLA packs an executable's temporaries
/// into one block, often above the 32 MiB that `M_MMAP_THRESHOLD` may be raised to) and trims the
/// heap only above 1 GiB of free top, or twice what the largest executable so far takes per call
/// (`keep_for_reuse`): the process keeps its working set instead of returning it to the system
/// between calls.
/// `TPU_DYNAMO_MALLOC_TUNING=0` leaves glibc's defaults.
fn keep_freed_memory_for_reuse() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
        unsafe { malloc::mallopt(malloc::M_MMAP_MAX, 0) };
        TUNED.store(true, Relaxed);
        keep_for_reuse(0);
    }
}

/// Free heap top glibc keeps at least, once tuned (`keep_freed_memory_for_reuse`).
const MIN_KEPT: u64 = 1 << 30;
static TUNED: AtomicBool = AtomicBool::new(false);
/// The trim threshold set so far (bytes), held while it is raised so that concurrent compiles
/// cannot leave a lower one set last.
static KEPT: Mutex<u64> = Mutex::new(0);

/// Raises the heap's trim threshold to twice `per_call` bytes (an executable's temporaries and
/// results), when the allocator is tuned and it is not that high already. With a lower one, each
/// call of an executable whose temporaries outgrow it hands them back to the system on return
/// and faults them in again on the next call: SD1.5's UNet up-block at 16x16 with 1.26 GB of
/// temporaries took 1.57-2.26 s that way, 1.23-1.31 s with them kept (eager 1.56-1.77 s).
/// Beyond what `mallopt`'s int can say, trimming stops altogether.
pub fn keep_for_reuse(per_call: u64) {
    if !TUNED.load(Relaxed) {
        return;
    }
    let wanted = per_call.saturating_mul(2).max(MIN_KEPT);
    let mut kept = KEPT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if *kept >= wanted {
        return;
    }
    *kept = wanted;
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // -1 (as glibc reads it: the largest size) never trims.
        let value = std::ffi::c_int::try_from(wanted).unwrap_or(-1);
        // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
        unsafe { malloc::mallopt(malloc::M_TRIM_THRESHOLD, value) };
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod malloc {
    use std::ffi::c_int;
    extern "C" {
        pub fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    pub const M_TRIM_THRESHOLD: c_int = -1;
    pub const M_MMAP_MAX: c_int = -4;
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

/// A setting on by default, off when the variable is `0`.
fn not_off(variable: &str) -> bool {
    std::env::var_os(variable).is_none_or(|v| v != "0")
}

fn compiler_env() -> String {
    ["XLA_FLAGS", "LIBTPU_INIT_ARGS"]
        .map(|name| format!("{name}={}", std::env::var(name).unwrap_or_default()))
        .join("\n")
}

static TARGET: Mutex<Option<Arc<Target>>> = Mutex::new(None);

/// A GPU plugin would otherwise take 75 % of the GPU's memory at start for its own allocator,
/// leaving torch (the model's weights, eager code around the compiled graphs) a quarter: it
/// allocates as it needs instead, unless `XLA_PYTHON_CLIENT_PREALLOCATE` (JAX's name) says
/// otherwise.
fn client_options(plugin: &Plugin) -> ClientOptions {
    let gpu = plugin
        .attributes()
        .is_ok_and(|attributes| attributes.iter().any(|(name, _)| name == "cuda_version" || name == "rocm_version"));
    if !gpu {
        return ClientOptions::default();
    }
    let preallocate = std::env::var("XLA_PYTHON_CLIENT_PREALLOCATE").is_ok_and(|v| matches!(v.as_str(), "1" | "true"));
    ClientOptions::default().bool("preallocate", preallocate)
}

pub fn target() -> Result<Arc<Target>, Error> {
    let mut slot = TARGET.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(t) = slot.as_ref() {
        return Ok(t.clone());
    }
    let plugin = Plugin::discover(None)?;
    let client = Client::new(plugin.clone(), &client_options(&plugin))?;
    let host_memory = client.platform_name().is_ok_and(|p| p == "cpu");
    let client = if host_memory && not_off("TPU_DYNAMO_CPU_INLINE") {
        inline_cpu_client(plugin).unwrap_or(client)
    } else {
        client
    };
    if host_memory && not_off("TPU_DYNAMO_MALLOC_TUNING") {
        keep_freed_memory_for_reuse();
    }
    let device = client
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| Error::InvalidArgument("the PJRT plugin reports no devices".into()))?;
    // Our kernels run where the plugin computes on the host and lets us register them; the
    // lowering then calls them, so which it calls is part of every executable's cache key.
    let host_kernels = if host_memory && not_off("TPU_DYNAMO_HOST_KERNELS") { host_kernels::register(client.plugin()) } else { vec![] };
    let one = |a: &'static str| host_kernels.contains(&a).then_some(a);
    let both = |a: &'static str, b: &'static str| (host_kernels.contains(&a) && host_kernels.contains(&b)).then_some((a, b));
    let pair = |a, b| both(a, b).map(|(row_per_output, row_per_input)| HostProduct { row_per_output, row_per_input });
    let f32_kept = match host_kernels.contains(&host_kernels::F32_MATMUL_NT_TARGET) {
        true if host_kernels::products_on_tiles() => Some(KeptF32::Tiles),
        true if host_kernels::kept_panels_beat_xla() => Some(KeptF32::Panels),
        _ => None,
    };
    *LOWERING_TARGET.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = LoweringTarget {
        cpu: host_memory,
        host_matvec: pair(host_kernels::BF16_MATVEC_TARGET, host_kernels::BF16_VECMAT_TARGET),
        host_gemm: pair(host_kernels::F32_MATMUL_NT_TARGET, host_kernels::F32_MATMUL_NN_TARGET),
        host_bf16_gemm: pair(host_kernels::BF16_MATMUL_NT_TARGET, host_kernels::BF16_MATMUL_NN_TARGET),
        host_bf16_gemm_bias: pair(host_kernels::BF16_MATMUL_NT_BIAS_TARGET, host_kernels::BF16_MATMUL_NN_BIAS_TARGET),
        host_bf16_gemm_bias_gelu_tanh: pair(host_kernels::BF16_MATMUL_NT_BIAS_GELU_TANH_TARGET, host_kernels::BF16_MATMUL_NN_BIAS_GELU_TANH_TARGET),
        host_bf16_gemm_silu_times: pair(host_kernels::BF16_MATMUL_NT_SILU_TIMES_TARGET, host_kernels::BF16_MATMUL_NN_SILU_TIMES_TARGET),
        host_gemm_bias: pair(host_kernels::F32_MATMUL_NT_BIAS_TARGET, host_kernels::F32_MATMUL_NN_BIAS_TARGET),
        host_gemm_bias_gelu_tanh: pair(host_kernels::F32_MATMUL_NT_BIAS_GELU_TANH_TARGET, host_kernels::F32_MATMUL_NN_BIAS_GELU_TANH_TARGET),
        host_gemm_silu_times: pair(host_kernels::F32_MATMUL_NT_SILU_TIMES_TARGET, host_kernels::F32_MATMUL_NN_SILU_TIMES_TARGET),
        host_gemm_plus: pair(host_kernels::F32_MATMUL_NT_PLUS_TARGET, host_kernels::F32_MATMUL_NN_PLUS_TARGET),
        host_gemm_bias_plus: pair(host_kernels::F32_MATMUL_NT_BIAS_PLUS_TARGET, host_kernels::F32_MATMUL_NN_BIAS_PLUS_TARGET),
        host_attention: both(host_kernels::F32_ATTENTION_TARGET, host_kernels::F32_CAUSAL_ATTENTION_TARGET),
        host_bf16_attention: both(host_kernels::BF16_ATTENTION_TARGET, host_kernels::BF16_CAUSAL_ATTENTION_TARGET),
        host_conv3x3: one(host_kernels::F32_CONV3X3_TARGET),
        host_bf16_conv: both(host_kernels::BF16_CONV_WINDOWS_TARGET, host_kernels::BF16_CONV_WINDOWS_BIAS_TARGET),
        host_bf16_conv3x3: one(host_kernels::BF16_CONV3X3_TARGET),
        host_layer_norm: one(host_kernels::F32_LAYER_NORM_TARGET),
        host_bf16_layer_norm: one(host_kernels::BF16_LAYER_NORM_TARGET),
        host_rms_norm: one(host_kernels::F32_RMS_NORM_TARGET),
        host_bf16_rms_norm: one(host_kernels::BF16_RMS_NORM_TARGET),
        host_rotary: one(host_kernels::F32_ROTARY_TARGET),
        host_gemm_tiles_budget: (f32_kept.is_some() || host_kernels.contains(&host_kernels::BF16_MATMUL_NT_TARGET)).then(|| host_kernels::unchanging::budget() as u64),
        host_f32_gemm_kept: f32_kept,
    };
    let t = Arc::new(Target { client, device, host_memory, compiler_env: compiler_env(), host_kernels, identity: OnceLock::new() });
    *slot = Some(t.clone());
    Ok(t)
}
