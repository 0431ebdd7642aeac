//! Device buffers: upload from host memory or view memory another library holds on the device,
//! inspect, download into a caller's slice.

use crate::client::{Client, ClientInner, Device};
use crate::compat::Grown;
use crate::error::{Error, Result};
use crate::event;
use crate::host_kernels::unchanging::{self, Declared};
use crate::plugin::call;
use crate::tensor::{DType, TensorSpec};
use pjrt_sys::*;
use std::fmt;
use std::sync::{Arc, OnceLock};

/// An array on a device. Destroyed (device memory freed) on drop.
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: *mut PJRT_Buffer,
    /// For a buffer made over host memory: the event the plugin fires when it lets go of that
    /// memory, awaited on drop so the memory's owner may free it once the buffer is gone.
    host_done: *mut PJRT_Event,
    /// Its type, fixed for its lifetime: asked of the plugin at most once (an execute checks
    /// every argument's, and a resident weight is an argument of every call).
    spec: OnceLock<TensorSpec>,
    /// Set where the buffer's host memory is declared unchanging while it lives.
    declared: Option<Declared>,
}

// SAFETY: PJRT buffers and events may be used from any thread.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        // Undeclared before the memory may be freed and reused.
        self.declared = None;
        let plugin = &*self.client.plugin;
        let mut args = PJRT_Buffer_Destroy_Args::new();
        args.buffer = self.raw;
        let _ = call!(plugin, PJRT_Buffer_Destroy, &mut args);
        // Nothing useful can be done with an error here.
        let _ = event::wait(plugin, self.host_done);
    }
}

/// A buffer's PJRT handle: what an execute is given of it, copied without touching the buffer.
/// It names the buffer only while the buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct Handle(pub(crate) *mut PJRT_Buffer);

// SAFETY: a plain PJRT handle; PJRT buffers may be used from any thread.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.spec() {
            Ok(spec) => write!(f, "Buffer({spec})"),
            Err(_) => write!(f, "Buffer(?)"),
        }
    }
}

impl Buffer {
    /// Takes ownership of a buffer the plugin created for `client`.
    pub(crate) fn adopt(client: &Arc<ClientInner>, raw: *mut PJRT_Buffer) -> Buffer {
        Buffer {
            client: client.clone(),
            raw,
            host_done: std::ptr::null_mut(),
            spec: OnceLock::new(),
            declared: None,
        }
    }

    /// `adopt`, for a buffer the plugin made to the caller's `spec` (an upload).
    pub(crate) fn adopt_typed(client: &Arc<ClientInner>, raw: *mut PJRT_Buffer, spec: TensorSpec) -> Buffer {
        let buffer = Buffer::adopt(client, raw);
        let _ = buffer.spec.set(spec);
        buffer
    }

    /// The buffer's PJRT handle, for `Executable::execute_handles`.
    pub fn handle(&self) -> Handle {
        Handle(self.raw)
    }

    pub(crate) fn belongs_to(&self, client: &Arc<ClientInner>) -> bool {
        Arc::ptr_eq(&self.client, client)
    }

    /// Element type and dimensions, as the plugin reports them.
    pub fn spec(&self) -> Result<&TensorSpec> {
        if let Some(spec) = self.spec.get() {
            return Ok(spec);
        }
        let spec = self.query_spec()?;
        Ok(self.spec.get_or_init(|| spec))
    }

    fn query_spec(&self) -> Result<TensorSpec> {
        let plugin = &*self.client.plugin;
        let mut ty = PJRT_Buffer_ElementType_Args::new();
        ty.buffer = self.raw;
        call!(plugin, PJRT_Buffer_ElementType, &mut ty)?;
        let mut dims = PJRT_Buffer_Dimensions_Args::new();
        dims.buffer = self.raw;
        call!(plugin, PJRT_Buffer_Dimensions, &mut dims)?;
        let dims = if dims.num_dims == 0 {
            vec![]
        } else {
            // SAFETY: the plugin owns `num_dims` values for the buffer's lifetime.
            unsafe { std::slice::from_raw_parts(dims.dims, dims.num_dims) }.to_vec()
        };
        Ok(TensorSpec {
            dtype: DType::from_pjrt(ty.type_)?,
            dims,
        })
    }

    /// Bytes the buffer occupies on the device (may exceed the host size through padding).
    pub fn on_device_size(&self) -> Result<usize> {
        let mut args = PJRT_Buffer_OnDeviceSizeInBytes_Args::new();
        args.buffer = self.raw;
        call!(
            &self.client.plugin,
            PJRT_Buffer_OnDeviceSizeInBytes,
            &mut args
        )?;
        Ok(args.on_device_size_in_bytes)
    }

    /// The device holding the buffer.
    pub fn device(&self) -> Result<Device> {
        let mut args = PJRT_Buffer_Device_Args::new();
        args.buffer = self.raw;
        call!(&self.client.plugin, PJRT_Buffer_Device, &mut args)?;
        Client::device_from_raw(&self.client, args.device)
    }

    /// Copies the buffer, dense row-major, into `dst`, which must be exactly its host size.
    /// Waits for any pending computation producing the buffer and surfaces its error.
    pub fn to_host(&self, dst: &mut [u8]) -> Result<()> {
        Buffer::to_host_all([(self, dst)])
    }

    /// [`Buffer::to_host`] for many buffers: every copy starts before any is awaited, so their
    /// latencies overlap (on the XLA CPU plugin each awaited copy is a thread handoff, ~30 µs).
    /// Every started copy is awaited before this returns, even after an error.
    /// A ready buffer in dense host memory (CPU plugins) is read directly, with no copy event.
    pub fn to_host_all<'a>(copies: impl IntoIterator<Item = (&'a Buffer, &'a mut [u8])>) -> Result<()> {
        let mut events = Vec::new();
        let mut started = Ok(());
        for (buffer, dst) in copies {
            if let Some(src) = buffer.dense_host_bytes(dst.len()) {
                dst.copy_from_slice(src);
                continue;
            }
            match buffer.start_to_host(dst) {
                Ok(event) => events.extend(event),
                Err(e) => {
                    started = Err(e);
                    break;
                }
            }
        }
        let awaited = events.into_iter().map(event::Event::wait).fold(Ok(()), Result::and);
        started.and(awaited)
    }

    /// Where the buffer's dense row-major bytes live when the host can address them (a computed
    /// CPU buffer in the default layout, not empty): a host tensor may then use that memory as
    /// its own storage, for as long as it keeps this buffer (or the buffer it is donated to) alive.
    /// `spec` is the type the caller knows the buffer to have (asking the plugin costs a few calls
    /// per buffer on every execute); a wrong one gives `None`, as the plugin's size must match.
    pub fn host_address(&self, spec: &TensorSpec) -> Option<usize> {
        let len = spec.byte_size().ok()?;
        self.dense_host_bytes(len).map(|bytes| bytes.as_ptr() as usize)
    }

    /// Declares the buffer's host memory (`spec`'s bytes) unchanging for as long as the buffer
    /// lives, so our kernels may keep what they derive from it (`host_kernels::unchanging`); for
    /// a buffer nothing writes while it lives (a resident weight's, taken in place or copied).
    /// False where the host cannot address the memory.
    pub fn declare_unchanging(&mut self, spec: &TensorSpec) -> bool {
        let (Some(address), Ok(len)) = (self.host_address(spec), spec.byte_size()) else { return false };
        self.declared = Some(unchanging::declare(address, len));
        true
    }

    /// The buffer's own memory when it can be read like the dense row-major host copy of
    /// `len` bytes: on the CPU, computed (no pending writer) and in the default layout. A
    /// `PJRT_Buffer_ToHostBuffer` on the XLA CPU plugin runs on its thread pool, so awaiting it
    /// costs a thread handoff (20-30 µs) even for a few bytes; reading in place does not.
    fn dense_host_bytes(&self, len: usize) -> Option<&[u8]> {
        if !self.laid_out_on_host(len) {
            return None;
        }
        let address = self.ready_address()?;
        // SAFETY: a computed CPU buffer of `len` dense bytes at this address, alive (and, being
        // ready, not written) while `self` is borrowed.
        Some(unsafe { std::slice::from_raw_parts(address as *const u8, len) })
    }

    /// Whether the buffer's memory is on the host, `len` (> 0) bytes in the dense row-major
    /// layout: fixed for all results an executable returns in one position.
    pub fn laid_out_on_host(&self, len: usize) -> bool {
        let plugin = &*self.client.plugin;
        let mut on_cpu = PJRT_Buffer_IsOnCpu_Args::new();
        on_cpu.buffer = self.raw;
        call!(plugin, PJRT_Buffer_IsOnCpu, &mut on_cpu).is_ok() && on_cpu.is_on_cpu && self.dense_row_major(len)
    }

    /// Whether the buffer's memory, wherever it is, holds exactly `len` (> 0) bytes in the dense
    /// row-major layout, so that another library may read it as its own array.
    pub fn dense_row_major(&self, len: usize) -> bool {
        if len == 0 {
            return false;
        }
        let plugin = &*self.client.plugin;
        let mut layout = PJRT_Buffer_GetMemoryLayout_Args::new();
        layout.buffer = self.raw;
        if call!(plugin, PJRT_Buffer_GetMemoryLayout, &mut layout).is_err()
            || layout.layout.type_ != PJRT_Buffer_MemoryLayout_Type_PJRT_Buffer_MemoryLayout_Type_Tiled
        {
            return false;
        }
        // SAFETY: the type says which union member the plugin filled in.
        let tiled = unsafe { layout.layout.__bindgen_anon_1.tiled };
        let minor_to_major = match tiled.minor_to_major_size {
            0 => &[][..],
            // SAFETY: the plugin owns `minor_to_major_size` values for the buffer's lifetime.
            n => unsafe { std::slice::from_raw_parts(tiled.minor_to_major, n) },
        };
        let row_major = minor_to_major.iter().rev().copied().eq(0..minor_to_major.len() as i64);
        row_major && tiled.num_tiles == 0 && self.on_device_size().ok() == Some(len)
    }

    /// The address of the buffer's memory once it is computed (no pending writer), for a buffer
    /// whose memory is `laid_out_on_host`: only then may the host read it as the dense array.
    pub fn ready_address(&self) -> Option<usize> {
        let plugin = &*self.client.plugin;
        let mut ready = PJRT_Buffer_ReadyEvent_Args::new();
        ready.buffer = self.raw;
        call!(plugin, PJRT_Buffer_ReadyEvent, &mut ready).ok()?;
        if !event::Event::adopt(plugin, ready.event)?.is_ready() {
            return None;
        }
        let mut pointer = PJRT_Buffer_UnsafePointer_Args::new();
        pointer.buffer = self.raw;
        call!(plugin, PJRT_Buffer_UnsafePointer, &mut pointer).ok()?;
        (pointer.buffer_pointer != 0).then_some(pointer.buffer_pointer)
    }

    /// The address of the buffer's memory on its device (a CUDA device pointer on a GPU), for
    /// handing that memory to another library; valid while the buffer lives.
    pub fn device_address(&self) -> Result<usize> {
        let mut args = PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args::new();
        args.buffer = self.raw;
        call!(&self.client.plugin, PJRT_Buffer_OpaqueDeviceMemoryDataPointer, &mut args)?;
        Ok(args.device_memory_ptr as usize)
    }

    /// Starts the copy into `dst`; the caller must await the event before `dst` is touched.
    fn start_to_host(&self, dst: &mut [u8]) -> Result<Option<event::Event<'_>>> {
        let spec = self.spec()?;
        let expected = spec.byte_size()?;
        if dst.len() != expected {
            return Err(Error::invalid(format!(
                "to_host: destination has {} bytes, buffer {spec} needs {expected}",
                dst.len()
            )));
        }
        let plugin = &*self.client.plugin;
        let mut args = PJRT_Buffer_ToHostBuffer_Args::new();
        args.src = self.raw;
        args.dst = dst.as_mut_ptr().cast();
        args.dst_size = dst.len();
        call!(plugin, PJRT_Buffer_ToHostBuffer, &mut args)?;
        Ok(event::Event::adopt(plugin, args.event))
    }
}

extern "C" fn memory_stays_with_its_owner(_memory: *mut std::ffi::c_void, _user: *mut std::ffi::c_void) {}

impl Client {
    /// Copies `data` (dense row-major, exactly `spec`'s size) to `device`. The copy is finished
    /// when this returns, so `data` may be reused at once.
    pub fn buffer_from_host(
        &self,
        data: &[u8],
        spec: &TensorSpec,
        device: &Device,
    ) -> Result<Buffer> {
        let semantics = PJRT_HostBufferSemantics_PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
        let (buffer, done) = self.buffer_of_host(data, spec, device, semantics)?;
        // Even with copy-during-call semantics the done event must be awaited and destroyed.
        event::wait(&self.inner.plugin, done)?;
        Ok(buffer)
    }

    /// A buffer over `data` itself where the plugin computes in host memory and `data` is
    /// aligned as it needs (see [`Buffer::host_address`]), else a copy as
    /// [`Client::buffer_from_host`] makes. In place, a resident weight exists once instead of
    /// twice (host tensor and device copy) and nothing is copied.
    ///
    /// # Safety
    /// `data` must stay allocated until the returned buffer is dropped (dropping it waits until
    /// the plugin has let go of `data`, e.g. finished a copy), and must not change while an
    /// execute that takes the buffer runs.
    pub unsafe fn buffer_over_host(
        &self,
        data: &[u8],
        spec: &TensorSpec,
        device: &Device,
    ) -> Result<Buffer> {
        let semantics = PJRT_HostBufferSemantics_PJRT_HostBufferSemantics_kImmutableZeroCopy;
        let (mut buffer, done) = self.buffer_of_host(data, spec, device, semantics)?;
        buffer.host_done = done;
        Ok(buffer)
    }

    /// A buffer over `address`, memory another library allocated on `device` (a CUDA tensor's),
    /// holding `spec` dense row-major: no copy. The plugin reads it as it is when an execute
    /// runs, so the memory's producer must have finished writing it by then.
    ///
    /// # Safety
    /// The memory must stay allocated until the returned buffer is dropped, and must not change
    /// while an execute that takes the buffer runs; an execute that donates the buffer may write
    /// into it.
    pub unsafe fn view_of_device_memory(&self, address: usize, spec: &TensorSpec, device: &Device) -> Result<Buffer> {
        if !device.belongs_to(&self.inner) {
            return Err(Error::invalid("view_of_device_memory: device belongs to another client"));
        }
        let plugin = &*self.inner.plugin;
        let mut args = Grown::<PJRT_Client_CreateViewOfDeviceBuffer_Args>::new();
        args.args.client = self.inner.raw;
        args.args.device_buffer_ptr = address as *mut std::ffi::c_void;
        args.args.dims = spec.dims.as_ptr();
        args.args.num_dims = spec.dims.len();
        args.args.element_type = spec.dtype.to_pjrt();
        args.args.device = device.raw();
        // Plugins call it unconditionally (XLA:CPU aborts on a null one); the memory's owner frees it.
        args.args.on_delete_callback = Some(memory_stays_with_its_owner);
        call!(plugin, PJRT_Client_CreateViewOfDeviceBuffer, args.as_mut_ptr())?;
        Ok(Buffer::adopt_typed(&self.inner, args.args.buffer, spec.clone()))
    }

    fn buffer_of_host(
        &self,
        data: &[u8],
        spec: &TensorSpec,
        device: &Device,
        semantics: PJRT_HostBufferSemantics,
    ) -> Result<(Buffer, *mut PJRT_Event)> {
        let expected = spec.byte_size()?;
        if data.len() != expected {
            return Err(Error::invalid(format!(
                "buffer_from_host: {spec} needs {expected} bytes, got {}",
                data.len()
            )));
        }
        if !device.belongs_to(&self.inner) {
            return Err(Error::invalid(
                "buffer_from_host: device belongs to another client",
            ));
        }
        let plugin = &*self.inner.plugin;
        let mut args = PJRT_Client_BufferFromHostBuffer_Args::new();
        args.client = self.inner.raw;
        args.data = data.as_ptr().cast();
        args.type_ = spec.dtype.to_pjrt();
        args.dims = spec.dims.as_ptr();
        args.num_dims = spec.dims.len();
        args.host_buffer_semantics = semantics;
        args.device = device.raw();
        call!(plugin, PJRT_Client_BufferFromHostBuffer, &mut args)?;
        Ok((Buffer::adopt_typed(&self.inner, args.buffer, spec.clone()), args.done_with_host_buffer))
    }
}
