//! Calls at sizes below their executable's: a bucket's executable runs on inputs zero-padded to
//! its sizes, and its results are cut back to the call's true sizes (`tpu_dynamo.symbolic`).
//! Both copies happen here, inside `run`, rather than as torch ops in Python: a decode step
//! pads and cuts every layer's K and V.
use std::any::Any;
use std::borrow::Cow;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tpu_dynamo_runtime::{Buffer, Error as RtError, TensorSpec};

use crate::device::Target;
use crate::host_view::Memory;

/// Tensors of a call at sizes other than the executable's: `(index, dims, packed)`.
pub type Sizes = [(usize, Vec<i64>, bool)];

/// The types of a call's tensors, each at most the executable's along every dimension, and
/// which of them are *packed*: their dense bytes lie first in the executable's buffer, the rest
/// of it after them (`tpu_dynamo_compiler::padding::packed_layout`), rather than zero-padded
/// to its sizes, dimension by dimension.
pub struct CallTypes<'a> {
    pub specs: Cow<'a, [TensorSpec]>,
    pub packed: Vec<bool>,
}

/// A call's sizes against one executable, read once for every call at them (a bucket's:
/// `tpu_dynamo.symbolic`), where each call had converted its `given` and `cut` lists and
/// copied every input's and output's type (a decode step: 36 and 5).
#[pyclass(frozen, module = "tpu_dynamo._native")]
pub struct CallShape {
    /// What it was read against (an executable's entry), kept alive so that its address
    /// names no other.
    graph: Arc<dyn Any + Send + Sync>,
    pub given: CallTypes<'static>,
    pub cut: CallTypes<'static>,
}

impl CallShape {
    pub fn new(graph: Arc<dyn Any + Send + Sync>, (inputs, outputs): (&[TensorSpec], &[TensorSpec]), given: &Sizes, cut: &Sizes) -> PyResult<Self> {
        let owned = |t: CallTypes<'_>| CallTypes { specs: Cow::Owned(t.specs.into_owned()), packed: t.packed };
        Ok(CallShape { given: owned(call_specs("input", inputs, given)?), cut: owned(call_specs("output", outputs, cut)?), graph })
    }

    /// Whether it was read against `graph`.
    pub fn of<T>(&self, graph: &Arc<T>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.graph), Arc::as_ptr(graph))
    }
}

/// The types of the tensors a call passes or receives in place of `specs`.
pub fn call_specs<'a>(what: &str, specs: &'a [TensorSpec], sizes: &Sizes) -> PyResult<CallTypes<'a>> {
    let mut packed = vec![false; specs.len()];
    if sizes.is_empty() {
        return Ok(CallTypes { specs: Cow::Borrowed(specs), packed });
    }
    let mut out = specs.to_vec();
    for (i, dims, pack) in sizes {
        let Some(spec) = out.get_mut(*i) else {
            return Err(PyValueError::new_err(format!("tpu_dynamo: there is no {what} {i} to size")));
        };
        let given = TensorSpec::new(spec.dtype, dims.clone());
        given.corner_runs(spec, |_, _, _| {}).map_err(|e| PyValueError::new_err(format!("tpu_dynamo: {what} {i}: {e}")))?;
        *spec = given;
        packed[*i] = *pack;
    }
    Ok(CallTypes { specs: Cow::Owned(out), packed })
}

/// Copies from an array of type `small` into one of type `big` or back, as runs `(small
/// offset, big offset, len)`: one run when packed, else the corner's.
fn runs(small: &TensorSpec, big: &TensorSpec, packed: bool, copy: &mut dyn FnMut(usize, usize, usize)) -> Result<(), RtError> {
    if packed {
        copy(0, 0, small.byte_size()?);
        return Ok(());
    }
    small.corner_runs(big, copy)
}

/// An input zero-padded to the executable's sizes, on the device. On a CPU plugin the buffer is
/// the host copy itself, so it is declared (and dropped) first.
pub struct PaddedInput {
    pub buffer: Buffer,
    _host: Memory,
}

impl PaddedInput {
    /// `data`, a dense array of type `given`, zero-padded to `spec` (or packed) and uploaded.
    pub fn upload(target: &Target, data: &[u8], given: &TensorSpec, spec: &TensorSpec, packed: bool) -> Result<PaddedInput, RtError> {
        let nbytes = spec.byte_size()?;
        let mut host = Memory::from_runs(nbytes, data, |copy| runs(given, spec, packed, copy))?;
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

/// `result` (of type `spec`) cut to its leading corner of type `cut` (or its packed prefix), in
/// new host memory. `address`: where `result`'s dense bytes lie in host memory, if they do
/// (`Buffer::host_address`).
pub fn cut_output(result: &Buffer, address: Option<usize>, spec: &TensorSpec, cut: &TensorSpec, packed: bool) -> Result<Memory, RtError> {
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
    Memory::from_runs(cut.byte_size()?, full, |copy| runs(cut, spec, packed, &mut |small, big, len| copy(big, small, len)))
}
