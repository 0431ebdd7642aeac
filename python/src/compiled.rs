//! `compile()`: IR JSON -> lowered StableHLO -> PJRT executable, found in (or added to) the
//! process-wide and disk caches; and `CompiledGraph.run()`, the per-call path (upload, execute,
//! download).
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;
use tpu_dynamo_cache::{
    DiskCache, Entry as DiskEntry, Key, KeyBuilder, Lookup, MemoryStore, Mode, PluginIdentity, PutError, TensorSig,
};
use tpu_dynamo_compiler::ir::{GraphWithSources, TensorType};
use tpu_dynamo_compiler::{cost, lower, LowerError as CompilerLowerError, Lowered, MLIR_VERSION, SOURCE_HASH};
use tpu_dynamo_runtime::host_kernels::unchanging;
use tpu_dynamo_runtime::{Buffer, CompileOptions, DType, Error as RtError, Executable, Handle, Program, ProgramCode, TensorSpec};

use crate::device::{target, Target};
use crate::errors::{lower_err, runtime_err, LowerError};
use crate::host_view::{self, Memory, Shared};
use crate::on_device;
use crate::padded::{self, CallShape, CallTypes, PaddedInput};
use crate::counters::{add_time, STATS};
use crate::persist::{disk_cache, log_warnings};
use crate::resident;
use crate::warm_up::{self, FirstRun};

/// Bumped when anything that shapes an executable changes without changing the IR bytes.
const CACHE_VERSION: &str = concat!("tpu_dynamo ", env!("CARGO_PKG_VERSION"), " cache v1");

/// One compiled graph, shared by every `CompiledGraph` with the same key.
struct Entry {
    exe: Executable,
    /// `None` when loaded from disk: the text is only lowered again if someone asks for it.
    stablehlo: Option<Arc<str>>,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    /// Per output: whether the executable's results there lie dense in host memory (a CPU
    /// plugin), learned from its first result; proving it costs several PJRT queries per result.
    laid_out: Vec<OnceLock<bool>>,
    first_run: FirstRun,
}

impl Entry {
    /// Checks the executable against the signature it was compiled or stored with.
    fn new(
        exe: Executable,
        stablehlo: Option<Arc<str>>,
        inputs: Vec<TensorSpec>,
        outputs: Vec<TensorSpec>,
    ) -> Result<Entry, RtError> {
        if exe.num_outputs() != outputs.len() {
            return Err(RtError::InvalidArgument(format!(
                "the executable has {} outputs, its signature declares {}",
                exe.num_outputs(),
                outputs.len()
            )));
        }
        let laid_out = outputs.iter().map(|_| OnceLock::new()).collect();
        Ok(Entry { exe, stablehlo, inputs, outputs, laid_out, first_run: FirstRun::default() })
    }

    /// Where `result`, output `o` of an execute, lies in host memory, if the host can read it
    /// there: whether results in that position are dense on the host is asked once, then each
    /// result only says where it is.
    fn result_address(&self, o: usize, result: &Buffer) -> Option<usize> {
        let len = self.outputs[o].byte_size().ok()?;
        let laid_out = *self.laid_out[o].get_or_init(|| result.laid_out_on_host(len));
        laid_out.then(|| result.ready_address()).flatten()
    }
}

static EXECUTABLES: LazyLock<MemoryStore<Arc<Entry>>> = LazyLock::new(MemoryStore::new);

pub fn cached_executables() -> usize {
    EXECUTABLES.len()
}

pub fn clear_cache() {
    EXECUTABLES.clear();
}

enum Failure {
    Lower(CompilerLowerError),
    Panic(String),
    Runtime(RtError),
}

fn spec(t: &TensorType) -> TensorSpec {
    TensorSpec::new(t.dtype, t.shape.clone())
}

fn sig(s: &TensorSpec) -> TensorSig {
    TensorSig::new(s.dtype.name(), s.dims.clone())
}

fn spec_of_sig(s: &TensorSig) -> Result<TensorSpec, RtError> {
    let dtype = DType::ALL
        .into_iter()
        .find(|&d| d.name() == s.dtype)
        .ok_or_else(|| RtError::InvalidArgument(format!("unknown dtype {:?}", s.dtype)))?;
    Ok(TensorSpec::new(dtype, s.dims.clone()))
}

fn lower_graph(json: &GraphWithSources) -> Result<Lowered, Failure> {
    let start = Instant::now();
    // A panic in a lowering rule is a compiler bug; it must surface as an exception, not abort.
    let lowered = catch_unwind(AssertUnwindSafe(|| lower(&json.graph, &json.sources)))
        .map_err(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Failure::Panic(msg)
        })?
        .map_err(Failure::Lower)?;
    add_time(&STATS.lower_nanos, start.elapsed());
    Ok(lowered)
}

fn build(target: &Target, json: &GraphWithSources) -> Result<Entry, Failure> {
    let start = Instant::now();
    let lowered = lower_graph(json)?;
    let inputs: Vec<TensorSpec> = lowered.inputs.iter().map(spec).collect();
    let program = Program { code: ProgramCode::MlirBytecode(&lowered.bytecode), inputs: inputs.clone() };
    let exe = target.client.compile(&program, &CompileOptions::default()).map_err(Failure::Runtime)?;
    let outputs = lowered.outputs.iter().map(spec).collect();
    let entry = Entry::new(exe, Some(lowered.text.into()), inputs, outputs).map_err(Failure::Runtime)?;
    STATS.compiles.fetch_add(1, Relaxed);
    add_time(&STATS.compile_nanos, start.elapsed());
    Ok(entry)
}

/// The disk cache and the plugin identity its entries are checked against.
type Disk<'a> = (Arc<DiskCache>, &'a PluginIdentity);

/// `key`'s executable from disk, loaded onto the device without compiling; `None` on a miss or
/// an unusable entry (reported in `warnings`; the caller compiles and overwrites it).
fn load(target: &Target, (disk, plugin): &Disk, key: &Key, warnings: &mut Vec<String>) -> Option<Entry> {
    let start = Instant::now();
    let rejected = |why: String| {
        STATS.disk_rejects.fetch_add(1, Relaxed);
        format!("disk cache entry {} {why}; compiling it again", disk.path(key).display())
    };
    // Err(None): a plain miss; Err(Some(warning)): an unusable entry.
    let loaded = match disk.get(key, plugin) {
        Lookup::Hit(stored) => deserialize(target, &stored)
            .map(|entry| (entry, stored.executable.len()))
            .map_err(|e| Some(rejected(format!("could not be loaded ({e})")))),
        Lookup::Miss => Err(None),
        Lookup::Rejected(why) => Err(Some(rejected(format!("rejected: {why}")))),
    };
    add_time(&STATS.load_nanos, start.elapsed());
    match loaded {
        Ok((entry, bytes)) => {
            STATS.disk_hits.fetch_add(1, Relaxed);
            STATS.disk_bytes_read.fetch_add(bytes as u64, Relaxed);
            Some(entry)
        }
        Err(warning) => {
            STATS.disk_misses.fetch_add(1, Relaxed);
            warnings.extend(warning);
            None
        }
    }
}

fn deserialize(target: &Target, stored: &DiskEntry) -> Result<Entry, RtError> {
    let inputs = stored.inputs.iter().map(spec_of_sig).collect::<Result<Vec<_>, _>>()?;
    let outputs = stored.outputs.iter().map(spec_of_sig).collect::<Result<Vec<_>, _>>()?;
    let exe = target.client.deserialize_executable(&stored.executable, inputs.clone())?;
    Entry::new(exe, None, inputs, outputs)
}

/// Writes a freshly compiled executable to disk. Failures cost the disk copy only: expected
/// ones (read-only cache) pass silently, the rest go to `warnings`.
fn store((disk, plugin): &Disk, key: &Key, entry: &Entry, warnings: &mut Vec<String>) {
    if disk.mode() != Mode::ReadWrite {
        return;
    }
    let start = Instant::now();
    let serialized = entry.exe.serialize();
    let written = serialized.map_err(|e| format!("cannot serialize the executable for the disk cache: {e}"));
    let written = written.and_then(|executable| {
        let bytes = executable.len() as u64;
        let stored = DiskEntry {
            plugin: (*plugin).clone(),
            inputs: entry.inputs.iter().map(sig).collect(),
            outputs: entry.outputs.iter().map(sig).collect(),
            executable,
        };
        match disk.put(key, &stored) {
            Ok(()) => Ok(Some(bytes)),
            Err(PutError::NotWritable) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    });
    add_time(&STATS.store_nanos, start.elapsed());
    match written {
        Ok(Some(bytes)) => {
            STATS.disk_writes.fetch_add(1, Relaxed);
            STATS.disk_bytes_written.fetch_add(bytes, Relaxed);
        }
        Ok(None) => {}
        Err(warning) => warnings.push(warning),
    }
}

/// Where a `CompiledGraph`'s executable came from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Memory,
    Disk,
    Compiled,
}

/// Key: canonical graph bytes (which include every input's shape and dtype), plugin identity
/// (the plugin file's hash included, so another build never even opens this entry), the MLIR
/// release, the compiler's source hash (a changed lowering rule never reuses an old executable),
/// compile options, compiler flags from the environment (`XLA_FLAGS`, ...), the host kernels
/// the lowering calls (`Target::host_kernels`) and this crate's version. `plugin` is `None`
/// without a disk cache: a key that never leaves the process needs no file hash.
fn cache_key(canonical: &[u8], target: &Target, plugin: Option<&PluginIdentity>) -> Key {
    // The rest of the identity is in `Plugin::identity()`.
    let (file_hash, platform_version, cpu_features) =
        plugin.map_or(("", "", ""), |p| (&*p.library_hash, &*p.platform_version, &*p.cpu_features));
    let lowering = tpu_dynamo_compiler::lower::lowering_target();
    KeyBuilder::new()
        .field(canonical)
        .field(target.client.plugin().identity().as_bytes())
        .field(file_hash.as_bytes())
        .field(platform_version.as_bytes())
        .field(cpu_features.as_bytes())
        .field(MLIR_VERSION.as_bytes())
        .field(SOURCE_HASH.as_bytes())
        .field(format!("{:?}", CompileOptions::default()).as_bytes())
        .field(target.compiler_env.as_bytes())
        .field(target.host_kernels.join(",").as_bytes())
        .field(format!("{:?}", (lowering.host_gemm_tiles_budget, lowering.host_f32_gemm_kept)).as_bytes())
        .field(CACHE_VERSION.as_bytes())
        .finish()
}

/// Process-wide map, then disk, then compile (and write to disk).
fn find_or_build(
    target: &Target,
    json: &GraphWithSources,
    canonical: &[u8],
    warnings: &mut Vec<String>,
) -> Result<(Arc<Entry>, Source), Failure> {
    let disk = disk_cache(warnings);
    // Hashing the plugin file is only worth it when there is a disk cache to check against.
    let plugin = match disk.mode() {
        Mode::Off => None,
        _ => target.identity(&disk, |e| warnings.push(e.to_string())).ok(),
    };
    let disk = plugin.map(|p| (disk, p));
    let key = cache_key(canonical, target, plugin);
    let mut source = Source::Compiled;
    let (entry, memory_hit) = EXECUTABLES.get_or_try_insert(key, || {
        if let Some(disk) = &disk {
            if let Some(entry) = load(target, disk, &key, warnings) {
                source = Source::Disk;
                return Ok(Arc::new(entry));
            }
        }
        let entry = build(target, json)?;
        if let Some(disk) = &disk {
            store(disk, &key, &entry, warnings);
        }
        Ok(Arc::new(entry))
    })?;
    Ok((entry, if memory_hit { Source::Memory } else { source }))
}

/// A resident input's device copy and the host `(data_ptr, version)` whose value it holds.
/// The host storage at `data_ptr` is kept alive with the copy (`storage`, set once the call
/// that made the copy has the GIL again): memory that is never freed is never reused by another
/// tensor, so `(data_ptr, version)` keeps naming this value while the copy exists, here and in
/// the process-wide registry (`resident.rs`).
struct Resident {
    ptr: usize,
    version: i64,
    copy: Arc<Buffer>,
    storage: Option<Py<PyAny>>,
}

impl Resident {
    fn new(ptr: usize, version: i64, copy: Arc<Buffer>) -> Resident {
        Resident { ptr, version, copy, storage: None }
    }
}

/// `(input, data_ptr, version)` of the resident copies a call made, whose storage it keeps
/// alive once it has the GIL again (`CompiledGraph::pin`).
type Unpinned = Vec<(usize, usize, i64)>;

/// An input's resident slot, locked for one call; `None` for an input that is not kept.
type Slot<'a> = Option<MutexGuard<'a, Option<Resident>>>;

/// The buffer `slot` keeps, if it still holds the value at `(ptr, version)`.
fn kept(slot: &Slot<'_>, ptr: usize, version: i64) -> Option<Arc<Buffer>> {
    let r = slot.as_deref()?.as_ref().filter(|r| (r.ptr, r.version) == (ptr, version))?;
    STATS.resident_hits.fetch_add(1, Relaxed);
    Some(r.copy.clone())
}

/// Makes `buf` the buffer `slot` keeps for input `i`'s value at `(ptr, version)`; its host
/// storage is pinned once the call has the GIL again.
fn keep(slot: &mut Slot<'_>, (i, ptr, version): (usize, usize, i64), buf: &Arc<Buffer>, unpinned: &mut Unpinned) {
    if let Some(slot) = slot.as_deref_mut() {
        *slot = Some(Resident::new(ptr, version, buf.clone()));
        unpinned.push((i, ptr, version));
    }
}

/// A graph compiled for one concrete input signature.
#[pyclass(frozen, module = "tpu_dynamo._native")]
pub struct CompiledGraph {
    entry: Arc<Entry>,
    target: Arc<Target>,
    /// Per input slot; stays `None` for user inputs.
    resident: Vec<Mutex<Option<Resident>>>,
    /// Per input, the buffer a small user input is copied into (`STAGED_MAX_BYTES`).
    staged: Vec<Mutex<Option<Staged>>>,
    /// The resident slots as the last call that changed them left them.
    kept_args: Mutex<Option<Arc<KeptArgs>>>,
    /// `(input, output)` pairs the executable updates in place (donated input buffers); from the
    /// graph, so they hold for an executable loaded from disk too.
    aliases: Vec<(usize, usize)>,
    stablehlo: Option<Arc<str>>,
    #[pyo3(get)]
    graph_hash: String,
    /// One execute's arithmetic, roughly (`tpu_dynamo_compiler::cost`).
    #[pyo3(get)]
    flops: f64,
    #[pyo3(get)]
    memory_hit: bool,
    #[pyo3(get)]
    disk_hit: bool,
}

/// Lowers and compiles `graph_json` (a `GraphWithSources`), or reuses the executable of an
/// identical graph from this process or the disk cache. A disk hit skips lowering, so its
/// StableHLO text exists only if `need_stablehlo` asks for it (lowering again, no compile).
#[pyfunction]
#[pyo3(signature = (graph_json, need_stablehlo = false))]
pub fn compile(py: Python<'_>, graph_json: &str, need_stablehlo: bool) -> PyResult<CompiledGraph> {
    compile_graph(py, &crate::parse(graph_json)?, need_stablehlo)
}

/// `compile` for an already parsed graph (a symbolic graph's specialization skips the JSON).
pub fn compile_graph(py: Python<'_>, json: &GraphWithSources, need_stablehlo: bool) -> PyResult<CompiledGraph> {
    let mut warnings = vec![];
    let compiled = py.detach(|| obtain(json, need_stablehlo, &mut warnings));
    log_warnings(py, &warnings)?;
    compiled.map_err(raise)
}

fn raise(failure: Failure) -> PyErr {
    match failure {
        Failure::Lower(e) => lower_err(e),
        Failure::Panic(msg) => LowerError::new_err(format!("tpu_dynamo: internal compiler error (panic): {msg}")),
        Failure::Runtime(e) => runtime_err(e),
    }
}

/// `compile_graph` without the GIL; what the log should say goes to `warnings`.
fn obtain(json: &GraphWithSources, need_stablehlo: bool, warnings: &mut Vec<String>) -> Result<CompiledGraph, Failure> {
    let canonical = json.graph.canonical_bytes();
    let graph_hash = blake3::hash(&canonical).to_hex().to_string();
    let target = target().map_err(Failure::Runtime)?;
    let (entry, source) = find_or_build(&target, json, &canonical, warnings)?;
    if source != Source::Memory && target.host_memory {
        if let Ok(stats) = entry.exe.memory_stats() {
            let results: usize = entry.outputs.iter().filter_map(|o| o.byte_size().ok()).sum();
            crate::device::keep_for_reuse(stats.temp_bytes.max(0) as u64 + results as u64);
        }
    }
    let stablehlo = match &entry.stablehlo {
        None if need_stablehlo => Some(lower_graph(json)?.text.into()),
        text => text.clone(),
    };
    if source == Source::Memory {
        STATS.memory_hits.fetch_add(1, Relaxed);
    }
    let resident = entry.inputs.iter().map(|_| Mutex::new(None)).collect();
    let staged = entry.inputs.iter().map(|_| Mutex::new(None)).collect();
    let aliases = json.graph.aliases.iter().map(|a| (a.input as usize, a.output as usize)).collect();
    Ok(CompiledGraph {
        entry,
        target,
        resident,
        staged,
        kept_args: Mutex::new(None),
        aliases,
        stablehlo,
        graph_hash,
        flops: cost::flops(&json.graph),
        memory_hit: source == Source::Memory,
        disk_hit: source == Source::Disk,
    })
}

/// What the loading thread of `compile_in_background` ends with.
type Obtained = (Result<CompiledGraph, Failure>, Vec<String>);

/// `compile`, and the first execute on zeros (`warm_up`), on a thread of its own: for a graph
/// whose first call is preceded by other work, as a precompiled frame's by Dynamo building its
/// guards. The graph's JSON is checked now; anything else goes wrong at `result()`.
#[pyfunction]
pub fn compile_in_background(graph_json: &str) -> PyResult<Loading> {
    let json = crate::parse(graph_json)?;
    let thread = warm_up::spawn("tpu_dynamo load", move || {
        let mut warnings = vec![];
        let compiled = obtain(&json, false, &mut warnings);
        if let Ok(graph) = &compiled {
            // Already off the calling thread: the warm-up runs here.
            if let Some(job) = graph.warm_up_job() {
                graph.entry.first_run.run_here(job);
            }
        }
        (compiled, warnings)
    })
    .map_err(|e| PyRuntimeError::new_err(format!("tpu_dynamo: cannot start a thread to load a graph: {e}")))?;
    Ok(Loading { thread: Mutex::new(Some(thread)) })
}

/// A graph being obtained by `compile_in_background`.
#[pyclass(frozen, module = "tpu_dynamo._native")]
pub struct Loading {
    thread: Mutex<Option<std::thread::JoinHandle<Obtained>>>,
}

#[pymethods]
impl Loading {
    /// Waits for the graph; raises what `compile` would have raised. Once only: the graph is
    /// moved out.
    fn result(&self, py: Python<'_>) -> PyResult<CompiledGraph> {
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        let thread = thread.ok_or_else(|| PyValueError::new_err("tpu_dynamo: loading this graph failed before (see the first error)"))?;
        let (compiled, warnings) = py
            .detach(|| thread.join())
            .unwrap_or_else(|_| (Err(Failure::Panic("in the thread loading a graph".into())), vec![]));
        log_warnings(py, &warnings)?;
        compiled.map_err(raise)
    }
}

/// A byte slice over caller-owned memory; a null pointer is fine for zero bytes.
///
/// SAFETY: the caller guarantees `ptr` points at `len` readable bytes that stay alive and
/// unaliased by writers for the returned lifetime (the Python wrapper holds the tensors).
unsafe fn host_slice<'a>(ptr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    std::slice::from_raw_parts(ptr as *const u8, len)
}

/// SAFETY: as [`host_slice`], and writable.
unsafe fn host_slice_mut<'a>(ptr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return std::slice::from_raw_parts_mut(NonNull::dangling().as_ptr(), 0);
    }
    std::slice::from_raw_parts_mut(ptr as *mut u8, len)
}

fn check_sizes<T>(what: &str, specs: &[TensorSpec], got: &[T], nbytes: impl Fn(&T) -> usize) -> PyResult<()> {
    if specs.len() != got.len() {
        return Err(PyValueError::new_err(format!(
            "tpu_dynamo: expected {} {what}, got {}",
            specs.len(),
            got.len()
        )));
    }
    for (i, (s, g)) in specs.iter().zip(got).enumerate() {
        let want = s.byte_size().map_err(runtime_err)?;
        if want != nbytes(g) {
            return Err(PyValueError::new_err(format!(
                "tpu_dynamo: {what} {i} should be {s} ({want} bytes), got {} bytes",
                nbytes(g)
            )));
        }
    }
    Ok(())
}

/// `address`, if no result handed over so far lies there (then noted in `seen`): two results in
/// one memory cannot both take it over.
fn unseen(seen: &mut Vec<usize>, address: Option<usize>) -> Option<usize> {
    let address = address.filter(|a| !seen.contains(a))?;
    seen.push(address);
    Some(address)
}

/// An execute argument: a buffer this graph uploaded (or keeps resident), the buffer a host
/// tensor views (see `host_view`), an input padded to the executable's sizes, a packed input
/// read in place from the larger executable buffer its host tensor lies at the start of, or a
/// small input copied into the buffer this graph keeps for it.
enum Arg<'a> {
    Owned(Arc<Buffer>),
    Viewed(Arc<Shared>),
    Padded(PaddedInput),
    /// The buffer over the packed input's bytes, and the buffer whose memory they are.
    Within { buffer: Buffer, _owner: Arc<Shared> },
    Staged(Staging<'a>),
    /// A resident input's buffer, named by the call's `KeptArgs`.
    Kept(Handle),
}

/// The resident slots' values as a call left them: per input `(ptr, version, handle)` where a
/// copy is kept (checked against the executable's input once, here), so that a call whose
/// resident inputs are unchanged reads one array in place of locking every slot and touching
/// every buffer (cold after the caller's work between calls: ~0.4 µs an input in a decode's
/// loop). The buffers live as long as this does.
struct KeptArgs {
    keys: Vec<Option<(usize, i64, Handle)>>,
    _buffers: Vec<Arc<Buffer>>,
}

impl KeptArgs {
    fn handle(&self, i: usize, ptr: usize, version: i64) -> Option<Handle> {
        let &(p, v, handle) = self.keys.get(i)?.as_ref()?;
        ((p, v) == (ptr, version)).then_some(handle)
    }
}

/// A buffer of the plugin's own host memory, kept for one small input that changes every call,
/// and that memory's address.
struct Staged {
    buffer: Buffer,
    address: usize,
}

/// User inputs of at most this many bytes are copied into a buffer kept for them
/// (`CompiledGraph::staged`) rather than taken in place: the copy costs less than the
/// plugin's making a buffer over the tensor's memory (4 µs a call, in a decode's loop).
const STAGED_MAX_BYTES: usize = 16 << 10;

/// A staged input's buffer, taken from its slot for one call and put back when the call drops
/// it (a concurrent call of the graph finds the slot empty and makes a buffer of its own).
struct Staging<'a> {
    slot: &'a Mutex<Option<Staged>>,
    staged: ManuallyDrop<Staged>,
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never used after.
        let staged = unsafe { ManuallyDrop::take(&mut self.staged) };
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(staged);
    }
}

/// An argument held for one execute; a viewed buffer stays locked so that the output which takes
/// over its memory can replace it.
enum Held<'a> {
    Owned(&'a Buffer),
    Viewed(&'a Shared, MutexGuard<'a, Buffer>),
    Kept(Handle),
}

impl Arg<'_> {
    fn hold(&self) -> Held<'_> {
        match self {
            Arg::Owned(b) => Held::Owned(b),
            Arg::Viewed(s) => Held::Viewed(s, s.lock()),
            Arg::Padded(p) => Held::Owned(&p.buffer),
            Arg::Within { buffer, .. } => Held::Owned(buffer),
            Arg::Staged(s) => Held::Owned(&s.staged.buffer),
            Arg::Kept(handle) => Held::Kept(*handle),
        }
    }
}

impl Held<'_> {
    /// The argument's handle for an execute of `exe` at `position`, checked unless it is kept
    /// (checked when it was).
    fn handle(&self, exe: &Executable, position: usize) -> Result<Handle, RtError> {
        let buffer: &Buffer = match self {
            Held::Kept(handle) => return Ok(*handle),
            Held::Owned(b) => b,
            Held::Viewed(_, guard) => guard,
        };
        exe.check_arg(position, buffer)?;
        Ok(buffer.handle())
    }
}

impl CompiledGraph {
    /// The executable's first execute on zeros, where the plugin computes in host memory and
    /// an execute is cheap enough to hide (`warm_up::affordable`).
    fn warm_up_job(&self) -> Option<impl FnOnce() + Send + 'static> {
        if !self.target.host_memory || !warm_up::affordable(self.flops, &self.entry.inputs) {
            return None;
        }
        let (entry, target) = (self.entry.clone(), self.target.clone());
        let donated: Vec<usize> = self.aliases.iter().map(|&(i, _)| i).collect();
        Some(move || {
            let _ = warm_up::run_on_zeros(&target, &entry.exe, &entry.inputs, &donated);
        })
    }

    /// The device buffer for input `i`: the resident one if `(ptr, version)` still matches
    /// (checked first, in `kept_args` and then the slot: parameters are most inputs), the one
    /// the host tensor views, the copy another graph made of the same version, a small user
    /// input's staged copy, else a fresh upload (kept when `version >= 0`). An input this graph
    /// donates never shares a copy: the execute consumes it. On a CPU plugin any other upload is
    /// the host memory itself, taken in place. A copy newly kept adds
    /// `(i, ptr, version)` to `unpinned`. An input `given` at smaller sizes than the
    /// executable's is uploaded zero-padded, every call; a packed one is read where it lies if
    /// it starts an executable buffer large enough (a dynamic cache's K or V, the previous
    /// step's packed result), else copied.
    fn input_buffer(
        &self,
        i: usize,
        (ptr, nbytes, version): (usize, usize, i64),
        given: &TensorSpec,
        packed: bool,
        unpinned: &mut Unpinned,
        kept_args: Option<&KeptArgs>,
    ) -> Result<Arg<'_>, RtError> {
        let spec = &self.entry.inputs[i];
        // Unsized calls pass the executable's own specs: no need to read two alike.
        if !std::ptr::eq(given, spec) && given != spec {
            if self.donates(i) {
                return Err(RtError::InvalidArgument(format!("input {i} is updated in place, so it cannot be padded")));
            }
            let t = &self.target;
            if let Some(shared) = packed.then(|| Shared::covering(ptr, spec)).flatten().filter(|_| t.host_memory) {
                STATS.packed_in_place.fetch_add(1, Relaxed);
                // SAFETY: `shared`'s buffer holds at least `spec`'s bytes at `ptr` and is kept
                // alive with the new buffer (`Arg::Within`), which only reads them.
                let bytes = unsafe { host_slice(ptr, spec.byte_size()?) };
                let buffer = unsafe { t.client.buffer_over_host(bytes, spec, &t.device)? };
                unchanging::forget(ptr, bytes.len());
                return Ok(Arg::Within { buffer, _owner: shared });
            }
            STATS.uploads.fetch_add(1, Relaxed);
            // SAFETY: see `run`: the Python caller keeps the tensor alive during the call.
            let bytes = unsafe { host_slice(ptr, nbytes) };
            return Ok(Arg::Padded(PaddedInput::upload(t, bytes, given, spec, packed)?));
        }
        if let Some(handle) = kept_args.and_then(|k| k.handle(i, ptr, version)) {
            STATS.resident_hits.fetch_add(1, Relaxed);
            return Ok(Arg::Kept(handle));
        }
        let mut slot = self.slot(i, version >= 0);
        if let Some(buf) = kept(&slot, ptr, version) {
            return Ok(Arg::Owned(buf));
        }
        if let Some(shared) = Shared::find(ptr, spec) {
            STATS.view_hits.fetch_add(1, Relaxed);
            unchanging::forget(ptr, nbytes);
            return Ok(Arg::Viewed(shared));
        }
        let donated = self.donates(i);
        if slot.is_none() && !donated && nbytes <= STAGED_MAX_BYTES && self.target.host_memory {
            // SAFETY: see `run`: the Python caller keeps the tensor alive during the call.
            return self.staged_input(i, unsafe { host_slice(ptr, nbytes) });
        }
        let shared_key = (slot.is_some() && !donated).then(|| resident::Key {
            target: Arc::as_ptr(&self.target) as usize,
            ptr,
            version,
            spec: spec.clone(),
        });
        let found = shared_key.as_ref().and_then(|key| resident::COPIES.get(key));
        let buf = match found {
            Some(buf) => {
                STATS.resident_shared_hits.fetch_add(1, Relaxed);
                buf
            }
            None => {
                STATS.uploads.fetch_add(1, Relaxed);
                // SAFETY: see `run`: the Python caller keeps the tensor alive during the call.
                let bytes = unsafe { host_slice(ptr, nbytes) };
                let t = &self.target;
                let mut buf = if t.host_memory && !donated {
                    // SAFETY: the caller keeps the memory alive during the call, and after it
                    // the resident slot keeps the tensor's storage (`pin`) for as long as it
                    // keeps the buffer; the buffer is only taken while `(ptr, version)` still
                    // match, i.e. before any in-place change.
                    unsafe { t.client.buffer_over_host(bytes, spec, &t.device)? }
                } else {
                    t.client.buffer_from_host(bytes, spec, &t.device)?
                };
                if slot.is_some() && buf.host_address(spec) == Some(ptr) {
                    STATS.uploads_in_place.fetch_add(1, Relaxed);
                }
                // A kept copy holds one value while it lives: a weight's next version gets a
                // buffer (and declaration) of its own. Memory read as it is may change.
                if !(shared_key.is_some() && buf.declare_unchanging(spec)) {
                    unchanging::forget(ptr, nbytes);
                }
                let buf = Arc::new(buf);
                if let Some(key) = shared_key {
                    resident::COPIES.insert(key, &buf);
                }
                buf
            }
        };
        keep(&mut slot, (i, ptr, version), &buf, unpinned);
        Ok(Arg::Owned(buf))
    }

    /// The buffer for input `i` of a call on a GPU (`run_on_device`): a view of the device
    /// memory at `ptr` (`on_device`), else an upload of the host memory there; kept, as in
    /// `input_buffer`, while `(ptr, version)` match (`version >= 0`; the caller gives a view the
    /// same version whatever changes its memory), except for an input the execute donates (the
    /// Python caller passes a copy of its own of such an input).
    fn device_input(
        &self,
        i: usize,
        (ptr, nbytes, version, on_device): (usize, usize, i64, bool),
        unpinned: &mut Unpinned,
    ) -> Result<Arc<Buffer>, RtError> {
        let spec = &self.entry.inputs[i];
        let donated = self.donates(i);
        if on_device {
            // A view is read as its memory is at each execute (on a CPU plugin, host memory).
            unchanging::forget(ptr, nbytes);
        }
        let mut slot = self.slot(i, version >= 0 && !donated);
        if let Some(buf) = kept(&slot, ptr, version) {
            return Ok(buf);
        }
        let t = &self.target;
        let buffer = if on_device {
            STATS.device_views.fetch_add(1, Relaxed);
            // SAFETY: the Python caller keeps the tensor alive during the call, and after it the
            // resident slot keeps its storage (`pin`) for as long as it keeps the view; torch's
            // writes to it are finished (the caller synchronized its stream) and none are queued
            // until the execute, which is awaited, has read it.
            unsafe { t.client.view_of_device_memory(ptr, spec, &t.device)? }
        } else {
            STATS.uploads.fetch_add(1, Relaxed);
            // SAFETY: see `run`: the Python caller keeps the tensor alive during the call.
            t.client.buffer_from_host(unsafe { host_slice(ptr, nbytes) }, spec, &t.device)?
        };
        let buffer = Arc::new(buffer);
        keep(&mut slot, (i, ptr, version), &buffer, unpinned);
        Ok(buffer)
    }

    /// Input `i`'s value `bytes` copied into the buffer kept for it (made by the first call),
    /// where the host can address that buffer. Rewriting it between executes is safe: each
    /// execute is awaited, and XLA never returns an argument it was not given to update as a
    /// result (it copies one that is live out).
    fn staged_input(&self, i: usize, bytes: &[u8]) -> Result<Arg<'_>, RtError> {
        STATS.uploads.fetch_add(1, Relaxed);
        let slot = &self.staged[i];
        let taken = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        let staged = match taken {
            Some(staged) => {
                // SAFETY: the buffer's own `bytes.len()` bytes at `address`, which no execute is
                // reading (this call took the buffer from its slot).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), staged.address as *mut u8, bytes.len()) };
                staged
            }
            None => {
                let (t, spec) = (&self.target, &self.entry.inputs[i]);
                let buffer = t.client.buffer_from_host(bytes, spec, &t.device)?;
                let Some(address) = buffer.host_address(spec) else { return Ok(Arg::Owned(Arc::new(buffer))) };
                Staged { buffer, address }
            }
        };
        STATS.uploads_staged.fetch_add(1, Relaxed);
        Ok(Arg::Staged(Staging { slot, staged: ManuallyDrop::new(staged) }))
    }

    /// Whether the executable updates input `i` in place (consumes its buffer).
    fn donates(&self, i: usize) -> bool {
        self.aliases.iter().any(|&(a, _)| a == i)
    }

    /// Input `i`'s resident slot, locked, where the input may be kept (`keepable`).
    fn slot(&self, i: usize, keepable: bool) -> Slot<'_> {
        keepable.then(|| self.resident[i].lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Every input's buffer (`input_buffer`), and the `KeptArgs` that name some of them, to be
    /// kept until the execute is done. Afterwards `kept_args` holds the slots as this call left
    /// them, remade where it had none or this call kept a new copy.
    #[allow(clippy::type_complexity)]
    fn input_buffers(
        &self,
        inputs: &[(usize, usize, i64)],
        given: &CallTypes,
        unpinned: &mut Unpinned,
    ) -> Result<(Vec<Arg<'_>>, Option<Arc<KeptArgs>>), RtError> {
        let kept_args = self.kept_args.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // Sized up front: a collected `Result` grows its vector from empty, moving arguments of
        // over a hundred bytes at every doubling (a decode step's native run, in turns: 70.5 →
        // 68.6 µs).
        let mut args = Vec::with_capacity(inputs.len());
        for (i, (&input, (spec, &packed))) in inputs.iter().zip(given.specs.iter().zip(&given.packed)).enumerate() {
            args.push(self.input_buffer(i, input, spec, packed, unpinned, kept_args.as_deref())?);
        }
        if kept_args.is_none() || !unpinned.is_empty() {
            self.remember_kept_args();
        }
        Ok((args, kept_args))
    }

    /// The types of a call at the executable's own sizes.
    fn exact_types(&self) -> PyResult<(CallTypes<'_>, CallTypes<'_>)> {
        Ok((padded::call_specs("input", &self.entry.inputs, &[])?, padded::call_specs("output", &self.entry.outputs, &[])?))
    }

    /// The types of a call at `shape`'s sizes, which must have been read against this graph.
    fn shaped_types<'s>(&self, shape: &'s CallShape) -> PyResult<(&'s CallTypes<'static>, &'s CallTypes<'static>)> {
        if !shape.of(&self.entry) {
            return Err(PyValueError::new_err("tpu_dynamo: call sizes read against another executable"));
        }
        Ok((&shape.given, &shape.cut))
    }

    /// Makes `kept_args` the resident slots' values now (an input this graph donates is never
    /// read from there: the execute consumes its buffer).
    fn remember_kept_args(&self) {
        let mut buffers = vec![];
        let keys = self
            .resident
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let slot = slot.lock().unwrap_or_else(|p| p.into_inner());
                let r = slot.as_ref().filter(|_| !self.donates(i))?;
                self.entry.exe.check_arg(i, &r.copy).ok()?;
                buffers.push(r.copy.clone());
                Some((r.ptr, r.version, r.copy.handle()))
            })
            .collect();
        *self.kept_args.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(KeptArgs { keys, _buffers: buffers }));
    }

    /// The handles of `held` for an execute (see `Held::handle`).
    fn handles(&self, held: &[Held<'_>]) -> Result<Vec<Handle>, RtError> {
        held.iter().enumerate().map(|(i, h)| h.handle(&self.entry.exe, i)).collect()
    }

    /// Keeps the host storage of each `unpinned` input (`tensors`, the call's dense inputs) alive
    /// with the resident copy made of it, unless another call has replaced that copy since.
    fn pin(&self, tensors: &Bound<'_, PyList>, unpinned: &Unpinned) -> PyResult<()> {
        for &(i, ptr, version) in unpinned {
            let mut slot = self.resident[i].lock().unwrap_or_else(|p| p.into_inner());
            if let Some(r) = slot.as_mut().filter(|r| (r.ptr, r.version) == (ptr, version) && r.storage.is_none()) {
                r.storage = Some(tensors.get_item(i)?.call_method0("untyped_storage")?.unbind());
            }
        }
        Ok(())
    }

    /// Donation bookkeeping before an execute: an aliased input's buffer is consumed by the
    /// execute, so its resident slot must not hand it out again (even if the execute fails).
    fn forget_donated(&self) {
        for &(i, _) in &self.aliases {
            *self.resident[i].lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }

    /// Where each updated input's new value goes after an execute (`results[o]` is taken for
    /// the first two):
    /// - the input was a viewed buffer and the output took over its memory: the output replaces
    ///   it, and the host tensor already holds the value;
    /// - the output's memory is host-addressable and the host tensor may get a new storage
    ///   (`movable`): it becomes a viewed buffer, returned for the host tensor to be re-pointed
    ///   at (`(input, buffer)`); from then on the tensor is found by its address, whatever its
    ///   version (an inference tensor has none);
    /// - otherwise it is copied into the host tensor (`outputs[o]`) by the caller, and kept as
    ///   the resident copy tagged `version + 1`, the version the Python wrapper's single bump
    ///   gives the tensor, so the next call uploads nothing.
    fn place_updates(
        &self,
        movable: &[usize],
        held: &mut [Held<'_>],
        results: &mut [Option<Buffer>],
    ) -> Vec<(usize, Arc<Shared>)> {
        let mut repoint = vec![];
        for &(i, o) in &self.aliases {
            let Some(out) = results[o].take() else { continue };
            if let Held::Viewed(shared, guard) = &mut held[i] {
                if out.host_address(&self.entry.inputs[i]) == Some(shared.address()) {
                    **guard = out;
                    STATS.updates_in_place.fetch_add(1, Relaxed);
                    continue;
                }
            }
            if !movable.contains(&i) {
                results[o] = Some(out);
                continue;
            }
            match Shared::new(out, self.entry.inputs[i].clone()) {
                Ok(shared) => {
                    STATS.updates_in_place.fetch_add(1, Relaxed);
                    repoint.push((i, shared));
                }
                Err(out) => results[o] = Some(out),
            }
        }
        repoint
    }

    /// The memory of each result asked for by `(0, nbytes)`: the result buffer itself when the
    /// host can address it (it leaves `results`), else a host allocation the caller copies it
    /// into. Two results in one memory (an executable may return one value twice) share nothing:
    /// the second is copied. A result `cut` to smaller sizes is copied here, into memory of its
    /// own, unless it is packed and the host can address it: then the result buffer is handed
    /// over as the smaller tensor's storage, registered whole, so that the tensor fed back in
    /// (next step's cache) is read where it is.
    fn hand_over(
        &self,
        outputs: &[(usize, usize)],
        results: &mut [Option<Buffer>],
        cut: &CallTypes,
    ) -> Result<Vec<Option<Memory>>, RtError> {
        let mut seen = Vec::new();
        outputs
            .iter()
            .zip(results.iter_mut())
            .zip(self.entry.outputs.iter().zip(cut.specs.iter().zip(&cut.packed)))
            .enumerate()
            .map(|(o, ((&(ptr, nbytes), result), (spec, (cut, &packed))))| {
                if cut != spec {
                    let Some(result) = result.take().filter(|_| ptr == 0) else {
                        return Err(RtError::InvalidArgument("a result cut to smaller sizes must be handed over".into()));
                    };
                    let address = self.entry.result_address(o, &result);
                    if let Some(address) = unseen(&mut seen, address.filter(|_| packed)) {
                        return Ok(Some(Memory::Shared(Shared::at(result, address, spec.clone()))));
                    }
                    return padded::cut_output(&result, address, spec, cut, packed).map(Some);
                }
                if ptr != 0 || nbytes == 0 || result.is_none() {
                    return Ok(None);
                }
                let address = result.as_ref().and_then(|r| self.entry.result_address(o, r));
                if let Some(address) = unseen(&mut seen, address) {
                    return Ok(result.take().map(|r| Memory::Shared(Shared::at(r, address, spec.clone()))));
                }
                Ok(Some(Memory::copied(nbytes)))
            })
            .collect()
    }

    fn keep_copied(
        &self,
        inputs: &[(usize, usize, i64)],
        results: &mut [Option<Buffer>],
        unpinned: &mut Unpinned,
    ) {
        for &(i, o) in &self.aliases {
            let (ptr, _, version) = inputs[i];
            let Some(buf) = results[o].take() else { continue };
            STATS.updates_copied.fetch_add(1, Relaxed);
            if version >= 0 {
                *self.resident[i].lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(Resident::new(ptr, version + 1, Arc::new(buf)));
                unpinned.push((i, ptr, version + 1));
            }
        }
    }
}

#[pymethods]
impl CompiledGraph {
    /// StableHLO text of the compiled module; `None` after a disk hit unless `compile` was
    /// asked for it.
    #[getter]
    fn stablehlo(&self) -> Option<&str> {
        self.stablehlo.as_deref()
    }

    /// `(dtype name, shape)` of every output, in order.
    #[getter]
    fn output_types(&self) -> Vec<(&'static str, Vec<i64>)> {
        self.entry.outputs.iter().map(|s| (s.dtype.name(), s.dims.clone())).collect()
    }

    /// `(dtype name, shape)` of every input, in order.
    #[getter]
    fn input_types(&self) -> Vec<(&'static str, Vec<i64>)> {
        self.entry.inputs.iter().map(|s| (s.dtype.name(), s.dims.clone())).collect()
    }

    /// The sizes of calls that pass `given` `(input, dims, packed)` smaller than the executable's
    /// and receive `cut` `(output, dims, packed)` cut back, for `run` and `bench_execute`.
    fn shaped(&self, given: Vec<(usize, Vec<i64>, bool)>, cut: Vec<(usize, Vec<i64>, bool)>) -> PyResult<CallShape> {
        CallShape::new(self.entry.clone(), (&self.entry.inputs, &self.entry.outputs), &given, &cut)
    }

    /// Runs once. `inputs`: `(data_ptr, nbytes, version)` of dense host tensors, version -1 for
    /// inputs that change every call; `outputs`: `(data_ptr, nbytes)` of dense host tensors to
    /// fill (for an aliased output: the mutated input's own memory, whose version the caller
    /// then bumps once; see `Graph::aliases`), or `(0, nbytes)` for a result to hand over
    /// (`hands_over_outputs`); `movable`: updated inputs whose host tensor may get a new
    /// storage. Returns DLPack capsules: `(input, capsule)` for each movable input whose new
    /// value stays in the executable's memory (the caller re-points that host tensor at it),
    /// and `(output, capsule)` for each handed-over result. `shape` (from `shaped`): the call's
    /// inputs passed at smaller sizes than the executable's, which it zero-pads, and results
    /// handed over cut to smaller sizes (see `padded`); none at the executable's. The caller
    /// must keep every tensor alive and unshared until this returns; the GIL is released
    /// meanwhile. Use it through `tpu_dynamo.executable.Executable`, which does.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (tensors, inputs, outputs, movable, shape=None))]
    fn run(
        &self,
        py: Python<'_>,
        tensors: Bound<'_, PyList>,
        inputs: Vec<(usize, usize, i64)>,
        outputs: Vec<(usize, usize)>,
        movable: Vec<usize>,
        shape: Option<Bound<'_, CallShape>>,
    ) -> PyResult<(Vec<(usize, Py<PyAny>)>, Vec<(usize, Py<PyAny>)>)> {
        let exact;
        let (given, cut) = match &shape {
            Some(shape) => self.shaped_types(shape.get())?,
            None => {
                exact = self.exact_types()?;
                (&exact.0, &exact.1)
            }
        };
        check_sizes("inputs", &given.specs, &inputs, |i| i.1)?;
        check_sizes("outputs", &cut.specs, &outputs, |o| o.1)?;
        let mut unpinned = vec![];
        let ran = py.detach(|| -> Result<_, RtError> {
            let start = Instant::now();
            self.entry.first_run.wait();
            let (args, _kept) = self.input_buffers(&inputs, given, &mut unpinned)?;
            let mut held: Vec<Held> = args.iter().map(Arg::hold).collect();
            let handles = self.handles(&held)?;
            self.forget_donated();
            // SAFETY: the handles are `held`'s (checked) or `_kept`'s, all alive until the
            // execute returns, on the target's client and device.
            let results = unsafe { self.entry.exe.execute_handles(&handles, &self.target.device)? };
            let mut results: Vec<Option<Buffer>> = results.into_iter().map(Some).collect();
            let repoint = self.place_updates(&movable, &mut held, &mut results);
            drop(held);
            let mut handed = self.hand_over(&outputs, &mut results, cut)?;
            // SAFETY: the caller allocated `nbytes` writable bytes at `ptr` for each output.
            let copies = results.iter().zip(&outputs).zip(&mut handed).filter_map(|((r, &(ptr, nbytes)), h)| {
                let dst = match h {
                    Some(memory) => memory.bytes_mut(nbytes)?,
                    None => unsafe { host_slice_mut(ptr, nbytes) },
                };
                Some((r.as_ref()?, dst))
            });
            Buffer::to_host_all(copies)?;
            self.keep_copied(&inputs, &mut results, &mut unpinned);
            STATS.executions.fetch_add(1, Relaxed);
            add_time(&STATS.execute_nanos, start.elapsed());
            Ok((repoint, handed))
        });
        self.pin(&tensors, &unpinned)?;
        let (repoint, handed) = ran.map_err(runtime_err)?;
        let repoint = repoint
            .into_iter()
            .map(|(i, shared)| Ok((i, host_view::capsule(py, Memory::Shared(shared), &self.entry.inputs[i])?)))
            .collect::<PyResult<_>>()?;
        let handed = handed
            .into_iter()
            .enumerate()
            .filter_map(|(o, memory)| Some((o, memory?)))
            .map(|(o, memory)| Ok((o, host_view::capsule(py, memory, &cut.specs[o])?)))
            .collect::<PyResult<_>>()?;
        Ok((repoint, handed))
    }

    /// Runs once on a GPU plugin with `inputs` `(data_ptr, nbytes, version, on_device)`: tensors in
    /// the memory of CUDA device `device_id` (read where they are) or on the host (uploaded);
    /// versions as for `run`. Returns one DLPack capsule per output, over the plugin's result in
    /// the device's memory (a CPU capsule where the plugin keeps a result in a layout of its
    /// own), or `None` for an empty one. On a CPU plugin, "the device" is the host. The caller
    /// must have synchronized torch's stream (see `on_device`), keep every tensor alive until
    /// this returns, and pass an input the executable updates in place as a copy of its own,
    /// whose new value it then copies back from the result. Use it through
    /// `tpu_dynamo.executable.Executable`, which does.
    fn run_on_device(
        &self,
        py: Python<'_>,
        tensors: Bound<'_, PyList>,
        inputs: Vec<(usize, usize, i64, bool)>,
        device_id: i32,
    ) -> PyResult<Vec<Option<Py<PyAny>>>> {
        let cuda_device = (!self.target.host_memory).then_some(device_id);
        check_sizes("inputs", &self.entry.inputs, &inputs, |i| i.1)?;
        let mut unpinned = vec![];
        let ran = py.detach(|| -> Result<_, RtError> {
            let start = Instant::now();
            on_device::destroy_retired();
            let args = inputs
                .iter()
                .enumerate()
                .map(|(i, &input)| self.device_input(i, input, &mut unpinned))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&Buffer> = args.iter().map(|b| &**b).collect();
            self.forget_donated();
            let memories = self
                .entry
                .exe
                .execute(&refs)?
                .into_iter()
                .zip(&self.entry.outputs)
                .map(|(result, spec)| on_device::result_memory(result, spec, cuda_device))
                .collect::<Result<Vec<_>, _>>()?;
            STATS.executions.fetch_add(1, Relaxed);
            add_time(&STATS.execute_nanos, start.elapsed());
            Ok(memories)
        });
        self.pin(&tensors, &unpinned)?;
        ran.map_err(runtime_err)?
            .into_iter()
            .zip(&self.entry.outputs)
            .map(|(memory, spec)| memory.map(|m| host_view::capsule(py, m, spec)).transpose())
            .collect()
    }

    /// Starts the executable's first execute on zeros in the background (see `warm_up.rs`),
    /// unless it has run already, the plugin computes on a device or an execute costs too much
    /// to hide. For an executable obtained ahead of its first call, with other work to do in
    /// between.
    fn warm_up(&self) {
        if let Some(job) = self.warm_up_job() {
            self.entry.first_run.start(job);
        }
    }

    /// Whether results come back as memory handed over (`run`'s `(0, nbytes)` outputs) rather than
    /// copied into host tensors the caller allocates: when the plugin computes in host memory, the
    /// result buffer itself becomes the tensor's storage, with no copy and no allocation.
    #[getter]
    fn hands_over_outputs(&self) -> bool {
        self.target.host_memory
    }

    /// Bytes of scratch one execute takes beyond its inputs and outputs (the plugin's count).
    #[getter]
    fn temp_bytes(&self) -> PyResult<i64> {
        Ok(self.entry.exe.memory_stats().map_err(runtime_err)?.temp_bytes)
    }

    /// Times the bare PJRT execute, `n` times, with every input uploaded once beforehand
    /// (`inputs` and `shape` as for `run`: inputs given smaller are uploaded padded); returns
    /// seconds per execute. It is the baseline the benchmark divides `run`'s time by to get the
    /// backend's per-call overhead.
    #[pyo3(signature = (tensors, inputs, n, shape=None))]
    fn bench_execute(
        &self,
        py: Python<'_>,
        tensors: Bound<'_, PyList>,
        inputs: Vec<(usize, usize, i64)>,
        n: usize,
        shape: Option<Bound<'_, CallShape>>,
    ) -> PyResult<Vec<f64>> {
        let exact;
        let given = match &shape {
            Some(shape) => self.shaped_types(shape.get())?.0,
            None => {
                exact = self.exact_types()?;
                &exact.0
            }
        };
        check_sizes("inputs", &given.specs, &inputs, |i| i.1)?;
        if !self.aliases.is_empty() {
            // Each execute would consume (donate) the inputs it updates in place.
            return Err(PyValueError::new_err("tpu_dynamo: bench_execute cannot time a graph that mutates its inputs"));
        }
        let mut unpinned = vec![];
        let timed = py.detach(|| -> Result<Vec<f64>, RtError> {
            self.entry.first_run.wait();
            let (args, _kept) = self.input_buffers(&inputs, given, &mut unpinned)?;
            let held: Vec<Held> = args.iter().map(Arg::hold).collect();
            let handles = self.handles(&held)?;
            (0..n)
                .map(|_| {
                    let start = Instant::now();
                    // SAFETY: as in `run`.
                    let outputs = unsafe { self.entry.exe.execute_handles(&handles, &self.target.device)? };
                    let seconds = start.elapsed().as_secs_f64();
                    drop(outputs);
                    Ok(seconds)
                })
                .collect()
        });
        self.pin(&tensors, &unpinned)?;
        timed.map_err(runtime_err)
    }
}
