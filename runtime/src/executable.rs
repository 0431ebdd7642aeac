//! Compiling StableHLO into executables, running them, and (de)serializing them.

use crate::buffer::{Buffer, Handle};
use crate::client::{Client, ClientInner, Device};
use crate::compat::Grown;
use crate::error::{Error, Result};
use crate::event;
use crate::plugin::call;
use crate::tensor::{DType, TensorSpec};
use pjrt_sys::protos::xla;
use pjrt_sys::*;
use prost::Message;
use std::ffi::c_char;
use std::fmt;
use std::ptr::null_mut;
use std::sync::Arc;

/// A StableHLO module to compile, with the argument types its `main` takes. The plugin cannot
/// report parameter types through the C API, so they are declared here and checked on execute.
#[derive(Debug, Clone)]
pub struct Program<'a> {
    pub code: ProgramCode<'a>,
    pub inputs: Vec<TensorSpec>,
}

/// MLIR text or bytecode; PJRT's format name for both is `mlir`.
#[derive(Debug, Clone, Copy)]
pub enum ProgramCode<'a> {
    MlirText(&'a str),
    MlirBytecode(&'a [u8]),
}

impl ProgramCode<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            ProgramCode::MlirText(text) => text.as_bytes(),
            ProgramCode::MlirBytecode(bytes) => bytes,
        }
    }
}

/// Device memory of one execute, as the plugin compiled it (`PJRT_Executable_GetCompiledMemoryStats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    pub argument_bytes: i64,
    pub output_bytes: i64,
    /// Scratch for intermediates, beyond arguments and outputs.
    pub temp_bytes: i64,
}

/// How many devices an executable spans.
///
/// `device_ids`, when given, assigns device ids replica-major: `device_ids[r * num_partitions + p]`
/// runs replica `r`, partition `p`. Without it, a 1×1 program is compiled portable (it runs on
/// whichever device its arguments live on) and larger ones take the plugin's default assignment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    pub num_replicas: i64,
    pub num_partitions: i64,
    pub device_ids: Option<Vec<i64>>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            device_ids: None,
        }
    }
}

impl CompileOptions {
    /// `n` replicas of one partition each, on the plugin's default devices.
    pub fn replicated(n: i64) -> Self {
        CompileOptions {
            num_replicas: n,
            ..Default::default()
        }
    }

    /// Checks the options against the client's devices and encodes `xla.CompileOptionsProto`.
    /// Invalid options must never reach the plugin: some make XLA abort the process.
    fn encode(&self, devices: &[Device]) -> Result<Vec<u8>> {
        let (replicas, partitions) = (self.num_replicas, self.num_partitions);
        if replicas < 1 || partitions < 1 {
            return Err(Error::invalid(format!(
                "compile options: num_replicas ({replicas}) and num_partitions ({partitions}) must be >= 1"
            )));
        }
        let needed = replicas.checked_mul(partitions).unwrap_or(i64::MAX);
        if needed > devices.len() as i64 {
            return Err(Error::invalid(format!(
                "compile options: {replicas} replicas x {partitions} partitions need {needed} \
                 devices, the client has {}",
                devices.len()
            )));
        }
        let device_assignment = match &self.device_ids {
            None => None,
            Some(ids) => Some(assignment(
                ids,
                replicas as usize,
                partitions as usize,
                devices,
            )?),
        };
        let portable = needed == 1 && device_assignment.is_none();
        let proto = xla::CompileOptionsProto {
            executable_build_options: Some(xla::ExecutableBuildOptionsProto {
                num_replicas: replicas,
                num_partitions: partitions,
                use_spmd_partitioning: partitions > 1,
                device_assignment,
                ..Default::default()
            }),
            compile_portable_executable: portable,
            ..Default::default()
        };
        Ok(proto.encode_to_vec())
    }
}

/// The device assignment proto for replica-major `ids`, each a distinct device of the client.
fn assignment(
    ids: &[i64],
    replicas: usize,
    partitions: usize,
    devices: &[Device],
) -> Result<xla::DeviceAssignmentProto> {
    if ids.len() != replicas * partitions {
        return Err(Error::invalid(format!(
            "compile options: device_ids has {} entries, {replicas} replicas x {partitions} \
             partitions need {}",
            ids.len(),
            replicas * partitions
        )));
    }
    for (i, id) in ids.iter().enumerate() {
        if !devices.iter().any(|d| i64::from(d.id()) == *id) {
            return Err(Error::invalid(format!(
                "compile options: device id {id} is not a device of this client"
            )));
        }
        if ids[..i].contains(id) {
            return Err(Error::invalid(format!(
                "compile options: device id {id} appears twice"
            )));
        }
    }
    Ok(xla::DeviceAssignmentProto {
        replica_count: replicas as i32,
        computation_count: partitions as i32,
        computation_devices: (0..partitions)
            .map(|p| xla::device_assignment_proto::ComputationDevice {
                replica_device_ids: (0..replicas).map(|r| ids[r * partitions + p]).collect(),
            })
            .collect(),
    })
}

/// A compiled program loaded on its devices. `Send + Sync`; execute from any thread.
pub struct Executable {
    client: Arc<ClientInner>,
    loaded: *mut PJRT_LoadedExecutable,
    executable: *mut PJRT_Executable,
    inputs: Vec<TensorSpec>,
    num_outputs: usize,
    /// The devices replicas run on, in order; empty for a portable (any one device) executable.
    devices: Vec<*mut PJRT_Device>,
}

// SAFETY: PJRT executables may be executed concurrently from any thread.
unsafe impl Send for Executable {}
unsafe impl Sync for Executable {}

impl Drop for Executable {
    fn drop(&mut self) {
        let plugin = &*self.client.plugin;
        if !self.executable.is_null() {
            let mut args = PJRT_Executable_Destroy_Args::new();
            args.executable = self.executable;
            let _ = call!(plugin, PJRT_Executable_Destroy, &mut args);
        }
        let mut args = PJRT_LoadedExecutable_Destroy_Args::new();
        args.executable = self.loaded;
        let _ = call!(plugin, PJRT_LoadedExecutable_Destroy, &mut args);
    }
}

impl fmt::Debug for Executable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executable")
            .field("inputs", &self.inputs)
            .field("num_outputs", &self.num_outputs)
            .field("num_devices", &self.devices.len())
            .finish()
    }
}

impl Client {
    /// Compiles `program`; a malformed or ill-typed module comes back as `Error::Pjrt`.
    pub fn compile(&self, program: &Program, options: &CompileOptions) -> Result<Executable> {
        for spec in &program.inputs {
            spec.byte_size()?;
        }
        let options = options.encode(&self.devices())?;
        let code = program.code.bytes();
        let format = "mlir";
        let mut raw_program = PJRT_Program::new();
        // The plugin only reads `code` when compiling; the field is `char*` because other calls write it.
        raw_program.code = code.as_ptr().cast::<c_char>().cast_mut();
        raw_program.code_size = code.len();
        raw_program.format = format.as_ptr().cast();
        raw_program.format_size = format.len();
        let mut args = PJRT_Client_Compile_Args::new();
        args.client = self.inner.raw;
        args.program = &raw_program;
        args.compile_options = options.as_ptr().cast();
        args.compile_options_size = options.len();
        call!(&self.inner.plugin, PJRT_Client_Compile, &mut args)?;
        Executable::adopt(&self.inner, args.executable, program.inputs.clone())
    }

    /// Loads bytes from [`Executable::serialize`] made by the same plugin build; `inputs` are the
    /// argument types the program was compiled for.
    pub fn deserialize_executable(
        &self,
        bytes: &[u8],
        inputs: Vec<TensorSpec>,
    ) -> Result<Executable> {
        for spec in &inputs {
            spec.byte_size()?;
        }
        let mut args = Grown::<PJRT_Executable_DeserializeAndLoad_Args>::new();
        args.args.client = self.inner.raw;
        args.args.serialized_executable = bytes.as_ptr().cast();
        args.args.serialized_executable_size = bytes.len();
        call!(
            &self.inner.plugin,
            PJRT_Executable_DeserializeAndLoad,
            args.as_mut_ptr()
        )?;
        Executable::adopt(&self.inner, args.args.loaded_executable, inputs)
    }
}

/// Owns the plugin memory behind serialized bytes and frees it with the plugin's deleter.
struct Serialized {
    raw: *mut PJRT_SerializedExecutable,
    deleter: Option<unsafe extern "C" fn(*mut PJRT_SerializedExecutable)>,
}

impl Drop for Serialized {
    fn drop(&mut self) {
        if let (Some(deleter), false) = (self.deleter, self.raw.is_null()) {
            // SAFETY: the plugin handed out this deleter for this object.
            unsafe { deleter(self.raw) };
        }
    }
}

impl Executable {
    /// Takes ownership of `loaded` and reads what execution needs to know about it.
    fn adopt(
        client: &Arc<ClientInner>,
        loaded: *mut PJRT_LoadedExecutable,
        inputs: Vec<TensorSpec>,
    ) -> Result<Executable> {
        let mut exe = Executable {
            client: client.clone(),
            loaded,
            executable: null_mut(),
            inputs,
            num_outputs: 0,
            devices: vec![],
        };
        let plugin = &*client.plugin;
        let mut get = PJRT_LoadedExecutable_GetExecutable_Args::new();
        get.loaded_executable = loaded;
        call!(plugin, PJRT_LoadedExecutable_GetExecutable, &mut get)?;
        exe.executable = get.executable;
        let mut outputs = PJRT_Executable_NumOutputs_Args::new();
        outputs.executable = exe.executable;
        call!(plugin, PJRT_Executable_NumOutputs, &mut outputs)?;
        exe.num_outputs = outputs.num_outputs;
        let mut devices = PJRT_LoadedExecutable_AddressableDevices_Args::new();
        devices.executable = loaded;
        call!(
            plugin,
            PJRT_LoadedExecutable_AddressableDevices,
            &mut devices
        )?;
        if devices.num_addressable_devices > 0 {
            // SAFETY: the plugin owns the array for the executable's lifetime.
            exe.devices = unsafe {
                std::slice::from_raw_parts(
                    devices.addressable_devices,
                    devices.num_addressable_devices,
                )
            }
            .to_vec();
        }
        Ok(exe)
    }

    /// The argument types every execution is checked against.
    pub fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// The devices of a replicated executable, one per argument list of `execute_replicated`;
    /// empty for a single-device executable, which runs wherever its arguments are.
    pub fn devices(&self) -> Result<Vec<Device>> {
        self.devices
            .iter()
            .map(|&raw| Client::device_from_raw(&self.client, raw))
            .collect()
    }

    /// Output types and dimensions, as compiled.
    pub fn output_specs(&self) -> Result<Vec<TensorSpec>> {
        let plugin = &*self.client.plugin;
        let mut types = PJRT_Executable_OutputElementTypes_Args::new();
        types.executable = self.executable;
        call!(plugin, PJRT_Executable_OutputElementTypes, &mut types)?;
        let mut dims = PJRT_Executable_OutputDimensions_Args::new();
        dims.executable = self.executable;
        call!(plugin, PJRT_Executable_OutputDimensions, &mut dims)?;
        if types.num_output_types != dims.num_outputs {
            return Err(Error::invalid("plugin reported inconsistent output counts"));
        }
        let n = dims.num_outputs;
        if n == 0 {
            return Ok(vec![]);
        }
        // SAFETY: the plugin owns these arrays for the executable's lifetime: `n` types, `n` ranks,
        // and the concatenated dimensions.
        let (types, ranks) = unsafe {
            (
                std::slice::from_raw_parts(types.output_types, n),
                std::slice::from_raw_parts(dims.dim_sizes, n),
            )
        };
        let total: usize = ranks.iter().sum();
        let all_dims: &[i64] = if total == 0 {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(dims.dims, total) }
        };
        let mut offset = 0;
        types
            .iter()
            .zip(ranks)
            .map(|(&ty, &rank)| {
                let spec = TensorSpec::new(DType::from_pjrt(ty)?, &all_dims[offset..offset + rank]);
                offset += rank;
                Ok(spec)
            })
            .collect()
    }

    /// The plugin's own account of the memory one execute takes on the device.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        let mut grown = Grown::<PJRT_Executable_GetCompiledMemoryStats_Args>::new();
        grown.args.executable = self.executable;
        call!(
            &self.client.plugin,
            PJRT_Executable_GetCompiledMemoryStats,
            grown.as_mut_ptr()
        )?;
        let args = &grown.args;
        Ok(MemoryStats {
            argument_bytes: args.argument_size_in_bytes,
            output_bytes: args.output_size_in_bytes,
            temp_bytes: args.temp_size_in_bytes,
        })
    }

    /// Bytes that [`Client::deserialize_executable`] turns back into this executable (same plugin
    /// build only).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let mut args = PJRT_Executable_Serialize_Args::new();
        args.executable = self.executable;
        call!(&self.client.plugin, PJRT_Executable_Serialize, &mut args)?;
        let _owner = Serialized {
            raw: args.serialized_executable,
            deleter: args.serialized_executable_deleter,
        };
        if args.serialized_bytes_size == 0 {
            return Ok(vec![]);
        }
        // SAFETY: the bytes live until `_owner` drops.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                args.serialized_bytes.cast::<u8>(),
                args.serialized_bytes_size,
            )
        };
        Ok(bytes.to_vec())
    }

    /// Runs on one device — where the arguments are (the client's first device if there are
    /// none) — and waits for completion. Returns the outputs.
    pub fn execute(&self, args: &[&Buffer]) -> Result<Vec<Buffer>> {
        self.check_args(args, None)?;
        let device = self.device_for(|| match args.first() {
            Some(first) => Ok(first.device()?.raw()),
            None => self.client.first_device().ok_or_else(|| Error::invalid("client has no devices")),
        })?;
        let handles: Vec<Handle> = args.iter().map(|b| b.handle()).collect();
        self.execute_on(&handles, device)
    }

    /// `execute` on `device` with each argument given by its handle, for a caller that keeps
    /// the arguments (and has checked them, `check_arg`) from one call to the next: it reads
    /// no buffer.
    ///
    /// # Safety
    /// Every handle's buffer is alive until this returns, belongs to this executable's client
    /// and passed `check_arg` at its position; `device` is the client's.
    pub unsafe fn execute_handles(&self, args: &[Handle], device: &Device) -> Result<Vec<Buffer>> {
        if args.len() != self.inputs.len() {
            return Err(Error::invalid(format!("expected {} arguments, got {}", self.inputs.len(), args.len())));
        }
        let device = self.device_for(|| Ok(device.raw()))?;
        self.execute_on(args, device)
    }

    /// The device an execute on one device names: `portable`'s for a portable executable, none
    /// (its own) for one compiled for a device.
    fn device_for(&self, portable: impl FnOnce() -> Result<*mut PJRT_Device>) -> Result<*mut PJRT_Device> {
        match self.devices.len() {
            0 => portable(),
            1 => Ok(null_mut()),
            many => Err(Error::invalid(format!("executable spans {many} devices: use execute_replicated"))),
        }
    }

    fn execute_on(&self, args: &[Handle], device: *mut PJRT_Device) -> Result<Vec<Buffer>> {
        let mut outputs = self.run(&[args], device)?;
        Ok(outputs.pop().unwrap_or_default())
    }

    /// Whether `arg` may be argument `position` of this executable: its client's, of the
    /// input's dtype and dims.
    pub fn check_arg(&self, position: usize, arg: &Buffer) -> Result<()> {
        self.check_arg_in(position, arg, "")
    }

    /// Runs one replica per argument list (list `i` on `devices()[i]`), waits for all, and returns
    /// each replica's outputs.
    pub fn execute_replicated(&self, arg_lists: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        if self.devices.is_empty() && arg_lists.len() == 1 {
            return Ok(vec![self.execute(&arg_lists[0])?]);
        }
        if arg_lists.len() != self.devices.len() {
            return Err(Error::invalid(format!(
                "executable runs on {} devices, got {} argument lists",
                self.devices.len().max(1),
                arg_lists.len()
            )));
        }
        for (i, list) in arg_lists.iter().enumerate() {
            self.check_args(list, Some(i))?;
        }
        let handles: Vec<Vec<Handle>> = arg_lists.iter().map(|list| list.iter().map(|b| b.handle()).collect()).collect();
        let lists: Vec<&[Handle]> = handles.iter().map(Vec::as_slice).collect();
        self.run(&lists, null_mut())
    }

    /// Count, client, dtype and dims of every argument against the declared inputs, so a wrong
    /// argument never reaches the plugin.
    fn check_args(&self, args: &[&Buffer], list: Option<usize>) -> Result<()> {
        let context = list
            .map(|i| format!(" (argument list {i})"))
            .unwrap_or_default();
        if args.len() != self.inputs.len() {
            return Err(Error::invalid(format!(
                "expected {} arguments, got {}{context}",
                self.inputs.len(),
                args.len()
            )));
        }
        for (position, arg) in args.iter().enumerate() {
            self.check_arg_in(position, arg, &context)?;
        }
        Ok(())
    }

    fn check_arg_in(&self, position: usize, arg: &Buffer, context: &str) -> Result<()> {
        let expected = self.inputs.get(position).ok_or_else(|| Error::invalid(format!("there is no argument {position}")))?;
        if !arg.belongs_to(&self.client) {
            return Err(Error::invalid(format!("argument {position}{context} belongs to another client")));
        }
        let got = arg.spec()?;
        if got != expected {
            return Err(Error::invalid(format!("argument {position}{context}: expected {expected}, got {got}")));
        }
        Ok(())
    }

    /// One `PJRT_LoadedExecutable_Execute` over `lists` (one per device), awaiting completion.
    fn run(&self, lists: &[&[Handle]], device: *mut PJRT_Device) -> Result<Vec<Vec<Buffer>>> {
        let plugin = &*self.client.plugin;
        // `Handle` is one `*mut PJRT_Buffer`, so a list of them is the plugin's argument list.
        let argument_lists: Vec<*const *mut PJRT_Buffer> =
            lists.iter().map(|l| l.as_ptr().cast()).collect();
        let mut outputs: Vec<Vec<*mut PJRT_Buffer>> =
            vec![vec![null_mut(); self.num_outputs]; lists.len()];
        let output_lists: Vec<*mut *mut PJRT_Buffer> =
            outputs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut events: Vec<*mut PJRT_Event> = vec![null_mut(); lists.len()];
        let mut options = Grown::<PJRT_ExecuteOptions>::new();
        let mut args = PJRT_LoadedExecutable_Execute_Args::new();
        args.executable = self.loaded;
        args.options = options.as_mut_ptr();
        args.argument_lists = argument_lists.as_ptr();
        args.num_devices = lists.len();
        args.num_args = self.inputs.len();
        args.output_lists = output_lists.as_ptr();
        args.device_complete_events = events.as_mut_ptr();
        args.execute_device = device;
        let status = call!(plugin, PJRT_LoadedExecutable_Execute, &mut args);
        // Own whatever the plugin produced before looking at errors, so nothing leaks.
        let results: Vec<Vec<Buffer>> = outputs
            .iter()
            .map(|list| {
                list.iter()
                    .filter(|b| !b.is_null())
                    .map(|&b| Buffer::adopt(&self.client, b))
                    .collect()
            })
            .collect();
        let completions: Vec<Result<()>> = events.iter().map(|&e| event::wait(plugin, e)).collect();
        status?;
        completions.into_iter().collect::<Result<()>>()?;
        if results.iter().any(|list| list.len() != self.num_outputs) {
            return Err(Error::invalid(
                "plugin returned fewer outputs than the executable declares",
            ));
        }
        Ok(results)
    }
}
