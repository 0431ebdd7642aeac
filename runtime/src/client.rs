//! A PJRT client (one per set of devices) and its addressable devices.

use crate::compat::Grown;
use crate::error::{Error, Result};
use crate::plugin::{call, lossy, Plugin};
use pjrt_sys::*;
use std::ffi::c_char;
use std::fmt;
use std::sync::Arc;

/// Options passed to `PJRT_Client_Create` as named values; which names a plugin understands is
/// plugin-specific (the XLA CPU plugin takes `cpu_device_count`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientOptions {
    values: Vec<(String, OptionValue)>,
}

#[derive(Debug, Clone, PartialEq)]
enum OptionValue {
    Int64(i64),
    Str(String),
    Bool(bool),
}

impl ClientOptions {
    /// Number of CPU devices the XLA CPU plugin should expose.
    pub fn cpu_device_count(self, n: i64) -> Self {
        self.int64("cpu_device_count", n)
    }

    pub fn int64(self, name: impl Into<String>, value: i64) -> Self {
        self.set(name.into(), OptionValue::Int64(value))
    }

    pub fn string(self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.set(name.into(), OptionValue::Str(value.into()))
    }

    pub fn bool(self, name: impl Into<String>, value: bool) -> Self {
        self.set(name.into(), OptionValue::Bool(value))
    }

    /// Setting a name again replaces its value.
    fn set(mut self, name: String, value: OptionValue) -> Self {
        self.values.retain(|(n, _)| *n != name);
        self.values.push((name, value));
        self
    }

    /// Named values pointing into `self`; valid while `self` is borrowed.
    fn named_values(&self) -> Vec<PJRT_NamedValue> {
        self.values
            .iter()
            .map(|(name, value)| {
                let mut nv = PJRT_NamedValue::new();
                nv.name = name.as_ptr().cast::<c_char>();
                nv.name_size = name.len();
                match value {
                    OptionValue::Int64(v) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kInt64;
                        nv.__bindgen_anon_1.int64_value = *v;
                        nv.value_size = 1;
                    }
                    OptionValue::Str(s) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kString;
                        nv.__bindgen_anon_1.string_value = s.as_ptr().cast::<c_char>();
                        nv.value_size = s.len();
                    }
                    OptionValue::Bool(b) => {
                        nv.type_ = PJRT_NamedValue_Type_PJRT_NamedValue_kBool;
                        nv.__bindgen_anon_1.bool_value = *b;
                        nv.value_size = 1;
                    }
                }
                nv
            })
            .collect()
    }
}

/// `PJRT_Client_Create` with `options`; the caller owns the client.
pub(crate) fn create_raw(plugin: &Plugin, options: &[PJRT_NamedValue]) -> Result<*mut PJRT_Client> {
    let mut args = Grown::<PJRT_Client_Create_Args>::new();
    args.args.create_options = options.as_ptr();
    args.args.num_options = options.len();
    call!(plugin, PJRT_Client_Create, args.as_mut_ptr())?;
    Ok(args.args.client)
}

/// Shared state of a client: everything created from it (devices, buffers, executables) holds
/// an `Arc` to it, so the `PJRT_Client` is destroyed only after all of them.
pub(crate) struct ClientInner {
    pub(crate) plugin: Arc<Plugin>,
    pub(crate) raw: *mut PJRT_Client,
    devices: Vec<DeviceInfo>,
}

// SAFETY: PJRT clients are thread-safe; the raw pointers are only passed back to the plugin.
unsafe impl Send for ClientInner {}
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut args = PJRT_Client_Destroy_Args::new();
        args.client = self.raw;
        let _ = call!(&self.plugin, PJRT_Client_Destroy, &mut args);
    }
}

struct DeviceInfo {
    raw: *mut PJRT_Device,
    id: i32,
    kind: String,
    local_hardware_id: i32,
}

/// A connection to the plugin's devices. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("devices", &self.devices())
            .finish()
    }
}

impl Client {
    /// Fails, instead of letting the plugin abort the process, on `XLA_FLAGS` it does not
    /// accept (see `env_flags`).
    pub fn new(plugin: Arc<Plugin>, options: &ClientOptions) -> Result<Client> {
        crate::env_flags::check(&plugin)?;
        let raw = create_raw(&plugin, &options.named_values())?;
        let mut inner = ClientInner {
            plugin,
            raw,
            devices: vec![],
        };
        inner.devices = inner.query_devices()?;
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.inner.plugin
    }

    /// E.g. `cpu`, `tpu`, `cuda`.
    pub fn platform_name(&self) -> Result<String> {
        let mut args = PJRT_Client_PlatformName_Args::new();
        args.client = self.inner.raw;
        call!(&self.inner.plugin, PJRT_Client_PlatformName, &mut args)?;
        // SAFETY: the plugin owns the name for the client's lifetime.
        Ok(unsafe { lossy(args.platform_name, args.platform_name_size) })
    }

    pub fn platform_version(&self) -> Result<String> {
        let mut args = PJRT_Client_PlatformVersion_Args::new();
        args.client = self.inner.raw;
        call!(&self.inner.plugin, PJRT_Client_PlatformVersion, &mut args)?;
        // SAFETY: as in `platform_name`.
        Ok(unsafe { lossy(args.platform_version, args.platform_version_size) })
    }

    /// The devices this process can use, in the plugin's order.
    pub fn devices(&self) -> Vec<Device> {
        (0..self.inner.devices.len())
            .map(|index| Device {
                client: self.inner.clone(),
                index,
            })
            .collect()
    }

    /// The `Device` for a raw device of this client.
    pub(crate) fn device_from_raw(
        inner: &Arc<ClientInner>,
        raw: *mut PJRT_Device,
    ) -> Result<Device> {
        inner
            .devices
            .iter()
            .position(|d| d.raw == raw)
            .map(|index| Device {
                client: inner.clone(),
                index,
            })
            .ok_or_else(|| Error::invalid("device is not addressable by this client"))
    }
}

impl ClientInner {
    pub(crate) fn first_device(&self) -> Option<*mut PJRT_Device> {
        self.devices.first().map(|d| d.raw)
    }

    fn query_devices(&self) -> Result<Vec<DeviceInfo>> {
        let plugin = &*self.plugin;
        let mut args = PJRT_Client_AddressableDevices_Args::new();
        args.client = self.raw;
        call!(plugin, PJRT_Client_AddressableDevices, &mut args)?;
        if args.num_addressable_devices == 0 {
            return Ok(vec![]);
        }
        // SAFETY: the plugin owns the device array for the client's lifetime.
        let raws = unsafe {
            std::slice::from_raw_parts(args.addressable_devices, args.num_addressable_devices)
        };
        raws.iter()
            .map(|&raw| {
                let mut desc = PJRT_Device_GetDescription_Args::new();
                desc.device = raw;
                call!(plugin, PJRT_Device_GetDescription, &mut desc)?;
                let mut id = PJRT_DeviceDescription_Id_Args::new();
                id.device_description = desc.device_description;
                call!(plugin, PJRT_DeviceDescription_Id, &mut id)?;
                let mut kind = PJRT_DeviceDescription_Kind_Args::new();
                kind.device_description = desc.device_description;
                call!(plugin, PJRT_DeviceDescription_Kind, &mut kind)?;
                let mut hw = PJRT_Device_LocalHardwareId_Args::new();
                hw.device = raw;
                call!(plugin, PJRT_Device_LocalHardwareId, &mut hw)?;
                Ok(DeviceInfo {
                    raw,
                    id: id.id,
                    // SAFETY: the plugin owns the kind string for the client's lifetime.
                    kind: unsafe { lossy(kind.device_kind, kind.device_kind_size) },
                    local_hardware_id: hw.local_hardware_id,
                })
            })
            .collect()
    }
}

/// One addressable device; valid as long as any handle keeps its client alive.
#[derive(Clone)]
pub struct Device {
    client: Arc<ClientInner>,
    index: usize,
}

impl Device {
    fn info(&self) -> &DeviceInfo {
        &self.client.devices[self.index]
    }

    /// Global device id (what device assignments refer to).
    pub fn id(&self) -> i32 {
        self.info().id
    }

    /// E.g. `cpu`, `TPU v5 lite`.
    pub fn kind(&self) -> String {
        self.info().kind.clone()
    }

    /// The device's id among this host's hardware (-1 if the plugin does not say).
    pub fn local_hardware_id(&self) -> i32 {
        self.info().local_hardware_id
    }

    pub(crate) fn raw(&self) -> *mut PJRT_Device {
        self.info().raw
    }

    pub(crate) fn belongs_to(&self, client: &Arc<ClientInner>) -> bool {
        Arc::ptr_eq(&self.client, client)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.raw() == other.raw()
    }
}

impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({} #{})", self.info().kind, self.info().id)
    }
}
