//! Calls at sizes below their executable's: a bucket's executable runs on inputs zero-padded to
//! its sizes, and its results are cut back to the call's true sizes (`tpu_dynamo.symbolic`).
//! Both copies happen here, inside `run`, rather than as torch ops in Python: a decode step
//! pads and cuts every layer's K and V.
use std::borrow::Cow;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tpu_dynamo_runtime::{Buffer, Error as RtError, TensorSpec};

use crate::device::Target;
use crate::host_view::Memory;

/// Tensors of a call at sizes other than the executable's: `(index, dims)`.
pub type Sizes = [(usize, Vec<i64>)];

/// The types of the tensors a call passes or receives in place of `specs` (`sizes`: each at
/// most the executable's along every dimension).
pub fn call_specs<'a>(what: &str, specs: &'a [TensorSpec], sizes: &Sizes) -> PyResult<Cow<'a, [TensorSpec]>> {
    if sizes.is_empty() {
        return Ok(Cow::Borrowed(specs));
    }
    let mut out = specs.to_vec();
    for (i, dims) in sizes {
        let Some(spec) = out.get_mut(*i) else {
            return Err(PyValueError::new_err(format!("tpu_dynamo: there is no {what} {i} to size")));
        };
        let given = TensorSpec::new(spec.dtype, dims.clone());
        given.corner_runs(spec, |_, _, _| {}).map_err(|e| PyValueError::new_err(format!("tpu_dynamo: {what} {i}: {e}")))?;
        *spec = given;
    }
    Ok(Cow::Owned(out))
}

/// An input zero-padded to the executable's sizes, on the device. On a CPU plugin the buffer is
/// the host copy itself, so it is declared (and dropped) first.
pub struct PaddedInput {
    pub buffer: Buffer,
    _host: Memory,
}

impl PaddedInput {
    /// `data`, a dense array of type `given`, zero-padded to `spec` and uploaded.
    pub fn upload(target: &Target, data: &[u8], given: &TensorSpec, spec: &TensorSpec) -> Result<PaddedInput, RtError> {
        let nbytes = spec.byte_size()?;
        let mut host = Memory::from_runs(nbytes, data, |copy| given.corner_runs(spec, copy))?;
        let padded = host.bytes_mut(nbytes).expect("host memory");
        let buffer = if target.host_memory {
            // SAFETY: `host` outlives `buffer` (dropped after it) and is not written again.
            unsafe { target.client.buffer_over_host(padded, spec, &target.device)? }
        } else {
            target.client.buffer_from_host(padded, spec, &target.device)?
        };
        Ok(PaddedInput { buffer, _host: host })
    }
}

/// `result` (of type `spec`) cut to its leading corner of type `cut`, in new host memory.
/// `address`: where `result`'s dense bytes lie in host memory, if they do (`Buffer::host_address`).
pub fn cut_output(result: &Buffer, address: Option<usize>, spec: &TensorSpec, cut: &TensorSpec) -> Result<Memory, RtError> {
    let full_bytes = spec.byte_size()?;
    let downloaded;
    let full: &[u8] = match address {
        // SAFETY: the plugin computes in host memory: `result`'s dense bytes are at `address`.
        Some(address) => unsafe { std::slice::from_raw_parts(address as *const u8, full_bytes) },
        None => {
            let mut host = vec![0; full_bytes];
            result.to_host(&mut host)?;
            downloaded = host;
            &downloaded
        }
    };
    // Each run of the cut array is a copy from the full one, in the cut array's order.
    Memory::from_runs(cut.byte_size()?, full, |copy| cut.corner_runs(spec, |small, big, len| copy(big, small, len)))
}
