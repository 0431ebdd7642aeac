//! `compile()`: IR JSON -> lowered StableHLO -> PJRT executable, shared through a process-wide
//! cache; and `CompiledGraph.run()`, the per-call path (upload, execute, download).
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tpu_dynamo_cache::{KeyBuilder, MemoryStore};
use tpu_dynamo_compiler::ir::{DType as IrDType, TensorType};
use tpu_dynamo_compiler::{lower, LowerError as CompilerLowerError};
use tpu_dynamo_runtime::{Buffer, CompileOptions, DType, Error as RtError, Executable, Program, ProgramCode, TensorSpec};

use crate::device::{target, Target};
use crate::errors::{lower_err, runtime_err, LowerError};
use crate::counters::{add_time, STATS};

/// Bumped when anything that shapes an executable changes without changing the IR bytes.
const CACHE_VERSION: &str = concat!("tpu_dynamo ", env!("CARGO_PKG_VERSION"), " cache v1");

/// One compiled graph, shared by every `CompiledGraph` with the same key.
struct Entry {
    exe: Executable,
    stablehlo: String,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
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
    let dtype = match t.dtype {
        IrDType::Bool => DType::Bool,
        IrDType::U8 => DType::U8,
        IrDType::I8 => DType::I8,
        IrDType::I16 => DType::I16,
        IrDType::I32 => DType::I32,
        IrDType::I64 => DType::I64,
        IrDType::F16 => DType::F16,
        IrDType::Bf16 => DType::Bf16,
        IrDType::F32 => DType::F32,
        IrDType::F64 => DType::F64,
        IrDType::C64 => DType::C64,
    };
    TensorSpec::new(dtype, t.shape.clone())
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::Bool => "bool",
        DType::U8 => "u8",
        DType::I8 => "i8",
        DType::I16 => "i16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::F16 => "f16",
        DType::Bf16 => "bf16",
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::C64 => "c64",
    }
}

fn build(target: &Target, json: &tpu_dynamo_compiler::ir::GraphWithSources) -> Result<Entry, Failure> {
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
    let inputs: Vec<TensorSpec> = lowered.inputs.iter().map(spec).collect();
    let program = Program { code: ProgramCode::MlirBytecode(&lowered.bytecode), inputs: inputs.clone() };
    let exe = target.client.compile(&program, &CompileOptions::default()).map_err(Failure::Runtime)?;
    if exe.num_outputs() != lowered.outputs.len() {
        return Err(Failure::Runtime(RtError::InvalidArgument(format!(
            "the executable has {} outputs, the lowering declared {}",
            exe.num_outputs(),
            lowered.outputs.len()
        ))));
    }
    Ok(Entry { exe, stablehlo: lowered.text, inputs, outputs: lowered.outputs.iter().map(spec).collect() })
}

/// A resident input's device copy and the host `(data_ptr, version)` it was uploaded from.
type Resident = Option<(usize, i64, Arc<Buffer>)>;

/// A graph compiled for one concrete input signature.
#[pyclass(frozen, module = "tpu_dynamo._native")]
pub struct CompiledGraph {
    entry: Arc<Entry>,
    target: Arc<Target>,
    /// Per input slot; stays `None` for user inputs.
    resident: Vec<Mutex<Resident>>,
    #[pyo3(get)]
    graph_hash: String,
    #[pyo3(get)]
    memory_hit: bool,
}

/// Lowers and compiles `graph_json` (a `GraphWithSources`), or reuses the executable of an
/// identical graph. Key: canonical graph bytes (which include every input's shape and dtype),
/// plugin identity, compile options and this crate's version.
#[pyfunction]
pub fn compile(py: Python<'_>, graph_json: &str) -> PyResult<CompiledGraph> {
    let json = crate::parse(graph_json)?;
    let canonical = json.graph.canonical_bytes();
    let graph_hash = blake3::hash(&canonical).to_hex().to_string();
    let target = target().map_err(runtime_err)?;
    let options = CompileOptions::default();
    let key = KeyBuilder::new()
        .field(&canonical)
        .field(target.client.plugin().identity().as_bytes())
        .field(format!("{options:?}").as_bytes())
        .field(CACHE_VERSION.as_bytes())
        .finish();
    let start = Instant::now();
    let (entry, memory_hit) = py
        .detach(|| EXECUTABLES.get_or_try_insert(key, || build(&target, &json).map(Arc::new)))
        .map_err(|f| match f {
            Failure::Lower(e) => lower_err(e),
            Failure::Panic(msg) => LowerError::new_err(format!("tpu_dynamo: internal compiler error (panic): {msg}")),
            Failure::Runtime(e) => runtime_err(e),
        })?;
    if memory_hit {
        STATS.memory_hits.fetch_add(1, Relaxed);
    } else {
        STATS.compiles.fetch_add(1, Relaxed);
        add_time(&STATS.compile_nanos, start.elapsed());
    }
    let resident = entry.inputs.iter().map(|_| Mutex::new(None)).collect();
    Ok(CompiledGraph { entry, target, resident, graph_hash, memory_hit })
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

impl CompiledGraph {
    /// The device buffer for input `i`: the resident one if `(ptr, version)` still matches,
    /// else a fresh upload (kept when `version >= 0`).
    fn input_buffer(&self, i: usize, (ptr, nbytes, version): (usize, usize, i64)) -> Result<Arc<Buffer>, RtError> {
        let upload = || {
            STATS.uploads.fetch_add(1, Relaxed);
            // SAFETY: see `run`: the Python caller keeps the tensor alive during the call.
            let bytes = unsafe { host_slice(ptr, nbytes) };
            let t = &self.target;
            t.client.buffer_from_host(bytes, &self.entry.inputs[i], &t.device).map(Arc::new)
        };
        if version < 0 {
            return upload();
        }
        let mut slot = self.resident[i].lock().unwrap_or_else(|p| p.into_inner());
        if let Some((p, v, buf)) = slot.as_ref() {
            if (*p, *v) == (ptr, version) {
                STATS.resident_hits.fetch_add(1, Relaxed);
                return Ok(buf.clone());
            }
        }
        let buf = upload()?;
        *slot = Some((ptr, version, buf.clone()));
        Ok(buf)
    }

    fn input_buffers(&self, inputs: &[(usize, usize, i64)]) -> Result<Vec<Arc<Buffer>>, RtError> {
        inputs.iter().enumerate().map(|(i, &input)| self.input_buffer(i, input)).collect()
    }
}

#[pymethods]
impl CompiledGraph {
    /// StableHLO text of the compiled module.
    #[getter]
    fn stablehlo(&self) -> &str {
        &self.entry.stablehlo
    }

    /// `(dtype name, shape)` of every output, in order.
    #[getter]
    fn output_types(&self) -> Vec<(&'static str, Vec<i64>)> {
        self.entry.outputs.iter().map(|s| (dtype_name(s.dtype), s.dims.clone())).collect()
    }

    /// `(dtype name, shape)` of every input, in order.
    #[getter]
    fn input_types(&self) -> Vec<(&'static str, Vec<i64>)> {
        self.entry.inputs.iter().map(|s| (dtype_name(s.dtype), s.dims.clone())).collect()
    }

    /// Runs once. `inputs`: `(data_ptr, nbytes, version)` of dense host tensors, version -1 for
    /// inputs that change every call; `outputs`: `(data_ptr, nbytes)` of dense host tensors to
    /// fill. The caller must keep every tensor alive and unshared until this returns; the GIL is
    /// released meanwhile. Use it through `tpu_dynamo.executable.Executable`, which does.
    fn run(&self, py: Python<'_>, inputs: Vec<(usize, usize, i64)>, outputs: Vec<(usize, usize)>) -> PyResult<()> {
        check_sizes("inputs", &self.entry.inputs, &inputs, |i| i.1)?;
        check_sizes("outputs", &self.entry.outputs, &outputs, |o| o.1)?;
        py.detach(|| -> Result<(), RtError> {
            let start = Instant::now();
            let buffers = self.input_buffers(&inputs)?;
            let args: Vec<&Buffer> = buffers.iter().map(|b| &**b).collect();
            let results = self.entry.exe.execute(&args)?;
            // SAFETY: the caller allocated `nbytes` writable bytes at `ptr` for each output.
            let dsts = outputs.iter().map(|&(ptr, nbytes)| unsafe { host_slice_mut(ptr, nbytes) });
            Buffer::to_host_all(results.iter().zip(dsts))?;
            STATS.executions.fetch_add(1, Relaxed);
            add_time(&STATS.execute_nanos, start.elapsed());
            Ok(())
        })
        .map_err(runtime_err)
    }

    /// Times the bare PJRT execute, `n` times, with every input uploaded once beforehand
    /// (`inputs` as for `run`); returns seconds per execute. It is the baseline the benchmark
    /// divides `run`'s time by to get the backend's per-call overhead.
    fn bench_execute(&self, py: Python<'_>, inputs: Vec<(usize, usize, i64)>, n: usize) -> PyResult<Vec<f64>> {
        check_sizes("inputs", &self.entry.inputs, &inputs, |i| i.1)?;
        py.detach(|| -> Result<Vec<f64>, RtError> {
            let buffers = self.input_buffers(&inputs)?;
            let args: Vec<&Buffer> = buffers.iter().map(|b| &**b).collect();
            (0..n)
                .map(|_| {
                    let start = Instant::now();
                    let outputs = self.entry.exe.execute(&args)?;
                    let seconds = start.elapsed().as_secs_f64();
                    drop(outputs);
                    Ok(seconds)
                })
                .collect()
        })
        .map_err(runtime_err)
    }
}
