//! An executable's first execute in a process pays XLA's one-time setup of its kernels (the
//! bench's UNet: 160-200 ms against 30 ms in steady state), whatever the inputs. An executable
//! obtained before its first call (a Dynamo graph compiled or loaded from disk, a precompiled
//! frame's graph loaded) therefore runs once on zeros on a thread of its own, while Dynamo
//! finishes the frame (guards, bytecode) on the calling one; its first call waits for that run.
//!
//! Only where the plugin computes in host memory: there every input of the warm-up is a view of
//! one zeroed block. On a device the zeros would be a second copy of all the inputs (a model's
//! weights) in device memory. And only for an execute cheap enough to hide behind Dynamo's work
//! (`affordable`): a big model's would delay its first call by most of an execute.
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use pyo3::prelude::*;
use tpu_dynamo_runtime::{Buffer, Error as RtError, Executable, TensorSpec};

use crate::counters::{add_time, STATS};
use crate::device::Target;

/// Whether an executable has had its first execute, and the warm-up running it, if any.
#[derive(Default)]
pub struct FirstRun {
    done: AtomicBool,
    warming: Mutex<Option<JoinHandle<()>>>,
}

impl FirstRun {
    /// Before an execute: waits for a warm-up in flight. Once done, one atomic load.
    pub fn wait(&self) {
        if self.done.load(Ordering::Acquire) {
            return;
        }
        let warming = self.warming.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(handle) = warming {
            // A panic in the warm-up cost nothing but the warm-up: the call runs as if cold.
            let _ = handle.join();
        }
        self.done.store(true, Ordering::Release);
    }

    /// Starts `run` (the warm-up execute) on a thread of its own unless the executable has run
    /// or is warming up already. Without a thread to spare the first call pays the setup itself.
    pub fn start(&self, run: impl FnOnce() + Send + 'static) {
        let mut warming = self.warming.lock().unwrap_or_else(PoisonError::into_inner);
        if self.done.load(Ordering::Acquire) || warming.is_some() {
            return;
        }
        *warming = spawn("tpu_dynamo warm-up", run).ok();
    }

    /// `start` on the calling thread, for one that is a background thread already: runs `run`
    /// unless the executable has run or is warming up (then waits for that). A first call
    /// meanwhile waits for the lock, i.e. for the warm-up.
    pub fn run_here(&self, run: impl FnOnce()) {
        let warming = self.warming.lock().unwrap_or_else(PoisonError::into_inner);
        if !self.done.load(Ordering::Acquire) && warming.is_none() {
            run();
        }
        drop(warming);
        self.wait();
    }
}

/// Runs `work` on a thread of its own, counted until it ends, so that the process can wait for
/// it before the plugin is torn down (`finish_background_work`).
pub fn spawn<T: Send + 'static>(name: &str, work: impl FnOnce() -> T + Send + 'static) -> std::io::Result<JoinHandle<T>> {
    *IN_FLIGHT.0.lock().unwrap_or_else(PoisonError::into_inner) += 1;
    let spawned = std::thread::Builder::new().name(name.into()).spawn(move || {
        let _finished = Finished;
        work()
    });
    if spawned.is_err() {
        Finished::done();
    }
    spawned
}

/// Threads of `spawn` still running.
static IN_FLIGHT: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// Counts a thread of `spawn` out however it ends.
struct Finished;

impl Finished {
    fn done() {
        let (count, all_done) = &IN_FLIGHT;
        *count.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
        all_done.notify_all();
    }
}

impl Drop for Finished {
    fn drop(&mut self) {
        Finished::done();
    }
}

/// Waits until no warm-up or background load runs (registered with `atexit`: a process must not
/// exit, tearing the plugin down, under an execute or a load in flight).
#[pyfunction]
pub fn finish_background_work(py: Python<'_>) {
    py.detach(|| {
        let (count, all_done) = &IN_FLIGHT;
        let guard = count.lock().unwrap_or_else(PoisonError::into_inner);
        drop(all_done.wait_while(guard, |n| *n > 0).unwrap_or_else(PoisonError::into_inner));
    });
}

/// Whether one execute of a graph doing `flops` (`tpu_dynamo_compiler::cost`) on `inputs` is
/// likely to take less than Dynamo's work between the backend's return and the first call (a
/// few tenths of a second): at most ~10 GFLOP (0.2-0.3 s on the 2-vCPU bench machine, which
/// runs the bench's UNet, 1.1 GFLOP, in 30 ms) and at most 1 GiB of inputs to read.
pub fn affordable(flops: f64, inputs: &[TensorSpec]) -> bool {
    const MAX_FLOPS: f64 = 1e10;
    const MAX_INPUT_BYTES: usize = 1 << 30;
    let bytes: usize = inputs.iter().map(|s| s.byte_size().unwrap_or(usize::MAX)).fold(0, usize::saturating_add);
    flops <= MAX_FLOPS && bytes <= MAX_INPUT_BYTES
}

/// Zeroed host memory aligned as the CPU plugins need for taking it in place. From the
/// allocator's zeroing path (`calloc`), so that memory fresh from the system is not written:
/// reading it maps the kernel's zero page, and a model's largest weight costs no resident copy.
struct ZeroBlock {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl ZeroBlock {
    fn new(len: usize) -> Option<ZeroBlock> {
        let layout = Layout::from_size_align(len.max(1), 64).ok()?;
        // SAFETY: the layout's size is not zero.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(ZeroBlock { ptr, layout })
    }

    fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.layout.size());
        // SAFETY: `ptr` holds `layout.size()` zeroed bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }
}

impl Drop for ZeroBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// One execute of `exe` on zeros; `donated`: inputs the execute consumes (each gets a copy of
/// its own, the others view one shared block). Errors are the first call's to report.
pub fn run_on_zeros(target: &Target, exe: &Executable, inputs: &[TensorSpec], donated: &[usize]) -> Result<(), RtError> {
    let start = Instant::now();
    let sizes = inputs.iter().map(TensorSpec::byte_size).collect::<Result<Vec<_>, _>>()?;
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let block = ZeroBlock::new(largest)
        .ok_or_else(|| RtError::InvalidArgument(format!("cannot allocate {largest} zero bytes for a warm-up")))?;
    let buffers = inputs
        .iter()
        .zip(&sizes)
        .enumerate()
        .map(|(i, (spec, &size))| {
            let data = block.bytes(size);
            if donated.contains(&i) {
                target.client.buffer_from_host(data, spec, &target.device)
            } else {
                // SAFETY: `block` is neither freed nor written before `buffers` are dropped.
                unsafe { target.client.buffer_over_host(data, spec, &target.device) }
            }
        })
        .collect::<Result<Vec<Buffer>, _>>()?;
    let args: Vec<&Buffer> = buffers.iter().collect();
    let ran = exe.execute(&args).map(drop);
    drop(args);
    drop(buffers);
    drop(block);
    STATS.warm_ups.fetch_add(1, Ordering::Relaxed);
    add_time(&STATS.warm_up_nanos, start.elapsed());
    ran
}
