//! Calls whose tensors live in a GPU's memory (CUDA tensors, on the XLA CUDA plugin): inputs are
//! viewed where torch keeps them and results are handed to torch where the plugin put them, so
//! nothing crosses the host. On a CPU plugin the same path runs on host tensors (its tests).
//!
//! Streams: the plugin computes on streams of its own, which know nothing of torch's. The Python
//! caller synchronizes torch's stream before each such call (inputs are then written), and the
//! execute is awaited before results are handed over (results are then written). What remains is
//! the results' release: torch may drop a result while kernels it queued still read it, and if
//! the buffer were destroyed then, the plugin could hand its memory to the next execute. So a
//! released result is only retired here, and destroyed at the start of the next call, after that
//! call's synchronization has drained torch's stream.

use std::sync::Mutex;

use tpu_dynamo_runtime::{Buffer, Error as RtError, TensorSpec};

use crate::host_view::Memory;

static RETIRED: Mutex<Vec<Buffer>> = Mutex::new(Vec::new());

/// A result buffer torch uses as a tensor's storage; dropping it retires the buffer.
pub struct Lent(Option<Buffer>);

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(buffer) = self.0.take() {
            RETIRED.lock().unwrap_or_else(|p| p.into_inner()).push(buffer);
        }
    }
}

/// Destroys the results torch released before the caller's stream was synchronized.
pub fn destroy_retired() {
    let retired = std::mem::take(&mut *RETIRED.lock().unwrap_or_else(|p| p.into_inner()));
    drop(retired);
}

/// The memory torch gets for `result` (of type `spec`): the plugin's own where it is dense
/// row-major (on CUDA device `cuda_device`, or the host's for `None`), else (a layout of the
/// plugin's own) a host copy the caller moves to the device. `None` for an empty result, which
/// the caller allocates.
pub fn result_memory(result: Buffer, spec: &TensorSpec, cuda_device: Option<i32>) -> Result<Option<Memory>, RtError> {
    let nbytes = spec.byte_size()?;
    if nbytes == 0 {
        return Ok(None);
    }
    if result.dense_row_major(nbytes) {
        let address = result.device_address()?;
        return Ok(Some(Memory::Lent { address, cuda_device, _buffer: Lent(Some(result)) }));
    }
    let mut memory = Memory::copied(nbytes);
    if let Some(bytes) = memory.bytes_mut(nbytes) {
        result.to_host(bytes)?;
    }
    Ok(Some(memory))
}
