//! Host tensors that live in executable buffers (CPU plugins).
//!
//! A graph that updates an input in place donates the input's buffer; the plugin writes the new
//! value into that same memory. When the host can address it, the host tensor is re-pointed at
//! that memory (a DLPack capsule hands it to torch), so from then on the tensor *is* the device
//! buffer: every later step donates it again, nothing is uploaded or downloaded, and the user
//! reads the current value whenever they look. A registry finds the buffer behind a tensor's
//! address, so any graph taking that tensor reuses it instead of uploading a copy.

use std::ffi::{c_void, CStr};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use pyo3::ffi;
use pyo3::prelude::*;
use tpu_dynamo_runtime::{Buffer, DType, Error as RtError, TensorSpec};

use crate::on_device::Lent;
use crate::weak_map::WeakMap;

/// A device buffer whose memory a host tensor uses as storage. After each donating execute the
/// buffer is replaced by the output that took over the same memory.
pub struct Shared {
    buffer: Mutex<Buffer>,
    address: usize,
    spec: TensorSpec,
}

/// Address → buffer, for every `Shared` alive.
static REGISTRY: LazyLock<WeakMap<usize, Shared>> = LazyLock::new(WeakMap::new);

impl Shared {
    /// Registers `buffer` for host tensors to view; gives it back if the host cannot address it.
    pub fn new(buffer: Buffer, spec: TensorSpec) -> Result<Arc<Shared>, Buffer> {
        match buffer.host_address(&spec) {
            Some(address) => Ok(Shared::at(buffer, address, spec)),
            None => Err(buffer),
        }
    }

    /// Registers `buffer`, whose dense host bytes the caller found at `address`.
    pub fn at(buffer: Buffer, address: usize, spec: TensorSpec) -> Arc<Shared> {
        let shared = Arc::new(Shared { buffer: Mutex::new(buffer), address, spec });
        REGISTRY.insert(address, &shared);
        shared
    }

    /// The live buffer a host tensor at `address` views, if its type is `spec`.
    pub fn find(address: usize, spec: &TensorSpec) -> Option<Arc<Shared>> {
        let found = REGISTRY.get(&address)?;
        (found.spec == *spec).then_some(found)
    }

    /// The live buffer a host tensor at `address` lies at the start of, if it holds at least
    /// `spec`'s bytes of `spec`'s dtype (a packed tensor within its executable's buffer).
    pub fn covering(address: usize, spec: &TensorSpec) -> Option<Arc<Shared>> {
        let found = REGISTRY.get(&address)?;
        let (held, needed) = (found.spec.byte_size().ok()?, spec.byte_size().ok()?);
        (found.spec.dtype == spec.dtype && held >= needed).then_some(found)
    }

    pub fn address(&self) -> usize {
        self.address
    }

    pub fn lock(&self) -> MutexGuard<'_, Buffer> {
        self.buffer.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // A newer buffer may have been registered at the same address since this one died.
        REGISTRY.forget_if_gone(&self.address);
    }
}

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    /// Null: compact row-major.
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What a capsule keeps alive: the dims its `DLTensor` points at and the memory.
struct Owner {
    dims: Vec<i64>,
    _memory: Memory,
}

/// Memory a host tensor can take over.
pub enum Memory {
    /// An executable buffer (registered, so graphs taking the tensor find it).
    Shared(Arc<Shared>),
    /// A host copy; `u128` elements align it for every dtype.
    Copied(Vec<u128>),
    /// A result lent as it lies (`on_device`), at `address` in the memory of CUDA device
    /// `cuda_device`, or the host's where that is `None` (a CPU plugin).
    Lent { address: usize, cuda_device: Option<i32>, _buffer: Lent },
}

impl Memory {
    /// A zeroed host allocation for `nbytes`, for a result the host cannot address in place.
    pub fn copied(nbytes: usize) -> Memory {
        Memory::Copied(vec![0; nbytes.div_ceil(16)])
    }

    /// `nbytes` of new host memory laid out by `runs`, which reports copies `(from, to, len)`
    /// of `src[from..from + len]` to offset `to`, in increasing `to` order (a corner of a larger
    /// or smaller array: `TensorSpec::corner_runs`); the bytes no copy covers are zeroed. Every
    /// byte is written once: a decode step pads and cuts each layer's K and V, and zeroing the
    /// whole allocation before copying into it wrote half as much again.
    pub fn from_runs(
        nbytes: usize,
        src: &[u8],
        runs: impl FnOnce(&mut dyn FnMut(usize, usize, usize)) -> Result<(), RtError>,
    ) -> Result<Memory, RtError> {
        let mut v: Vec<u128> = Vec::with_capacity(nbytes.div_ceil(16));
        let capacity = v.capacity() * 16;
        let dst: *mut u8 = v.as_mut_ptr().cast();
        let (mut filled, mut in_order) = (0, true);
        runs(&mut |from, to, len| {
            in_order &= to >= filled && to + len <= nbytes && from + len <= src.len();
            if in_order {
                // SAFETY: `filled <= to`, `to + len <= nbytes <= capacity` and `from + len <=
                // src.len()` (checked above); `src` is not `v`.
                unsafe {
                    dst.add(filled).write_bytes(0, to - filled);
                    std::ptr::copy_nonoverlapping(src.as_ptr().add(from), dst.add(to), len);
                }
                filled = to + len;
            }
        })?;
        if !in_order {
            return Err(RtError::InvalidArgument("host copy: runs out of order or out of bounds".into()));
        }
        // SAFETY: bytes `..filled` are written above, the rest here, so all of `v` is initialized.
        unsafe {
            dst.add(filled).write_bytes(0, capacity - filled);
            v.set_len(v.capacity());
        }
        Ok(Memory::Copied(v))
    }

    pub fn bytes_mut(&mut self, nbytes: usize) -> Option<&mut [u8]> {
        match self {
            Memory::Shared(_) | Memory::Lent { .. } => None,
            // SAFETY: `v` holds at least `nbytes` initialized bytes (`copied` rounds up).
            Memory::Copied(v) => Some(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), nbytes) }),
        }
    }

    fn address(&self) -> *mut c_void {
        match self {
            Memory::Shared(s) => s.address as *mut c_void,
            Memory::Copied(v) => v.as_ptr() as *mut c_void,
            Memory::Lent { address, .. } => *address as *mut c_void,
        }
    }

    /// DLPack's device of the memory.
    fn dl_device(&self) -> DLDevice {
        match self {
            Memory::Lent { cuda_device: Some(id), .. } => DLDevice { device_type: K_DL_CUDA, device_id: *id },
            _ => DLDevice { device_type: K_DL_CPU, device_id: 0 },
        }
    }
}

const DLTENSOR: &CStr = c"dltensor";
const K_DL_CPU: i32 = 1;
const K_DL_CUDA: i32 = 2;

/// DLPack's `(type code, bits)` for a dtype.
fn dl_dtype(dtype: DType) -> DLDataType {
    let (code, bits) = match dtype {
        DType::Bool => (6, 8),
        DType::U8 => (1, 8),
        DType::I8 => (0, 8),
        DType::I16 => (0, 16),
        DType::I32 => (0, 32),
        DType::I64 => (0, 64),
        DType::F16 => (2, 16),
        DType::Bf16 => (4, 16),
        DType::F32 => (2, 32),
        DType::F64 => (2, 64),
        DType::C64 => (5, 64),
    };
    DLDataType { code, bits, lanes: 1 }
}

unsafe extern "C" fn delete_managed(managed: *mut DLManagedTensor) {
    // SAFETY: `managed` and its context were leaked from boxes by `capsule`, and DLPack calls
    // the deleter exactly once.
    unsafe {
        drop(Box::from_raw((*managed).manager_ctx.cast::<Owner>()));
        drop(Box::from_raw(managed));
    }
}

/// Frees a capsule nobody consumed (a consumer renames it and calls the deleter itself).
unsafe extern "C" fn delete_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython passes the capsule being destroyed; the name check tells whether it was consumed.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()).cast::<DLManagedTensor>();
            delete_managed(managed);
        }
    }
}

/// A DLPack capsule for a tensor of type `spec` over `memory` (on the host, or a GPU's for
/// `Memory::Lent`), for `torch.from_dlpack`.
pub fn capsule(py: Python<'_>, memory: Memory, spec: &TensorSpec) -> PyResult<Py<PyAny>> {
    let (data, device) = (memory.address(), memory.dl_device());
    let mut owner = Box::new(Owner { dims: spec.dims.clone(), _memory: memory });
    let managed = Box::into_raw(Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data,
            device,
            ndim: owner.dims.len() as i32,
            dtype: dl_dtype(spec.dtype),
            shape: owner.dims.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: Box::into_raw(owner).cast(),
        deleter: Some(delete_managed),
    }));
    // SAFETY: a valid pointer and a static name; on failure the capsule does not own `managed`.
    unsafe {
        let raw = ffi::PyCapsule_New(managed.cast(), DLTENSOR.as_ptr(), Some(delete_capsule));
        if raw.is_null() {
            delete_managed(managed);
            return Err(PyErr::fetch(py));
        }
        Ok(Py::from_owned_ptr(py, raw))
    }
}
