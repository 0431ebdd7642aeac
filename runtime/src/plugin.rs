//! Loading a PJRT plugin (`dlopen` + `GetPjrtApi` + `PJRT_Plugin_Initialize`) once per process,
//! and the one checked path through which every PJRT function is called.

use crate::compat::PLUGIN_ATTRIBUTES_ARGS_SIZE;
use crate::error::{Error, ErrorCode, Result};
use pjrt_sys::{
    PJRT_Api, PJRT_Error, PJRT_Error_Destroy_Args, PJRT_Error_GetCode_Args,
    PJRT_Error_Message_Args, PJRT_NamedValue, PJRT_Plugin_Attributes_Args,
    PJRT_Plugin_Initialize_Args,
};
use std::collections::HashMap;
use std::fmt;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Calls the PJRT function `$name` with the argument pointer `$args`, giving `Result<()>`.
///
/// The plugin's table may be shorter than pjrt-sys's (older plugin): a function whose slot lies
/// beyond `PJRT_Api.struct_size`, or is null, yields `Err` instead of a wild call. `$args` must
/// point to a struct made by pjrt-sys's `new()` (or `compat::Grown`) with its inputs filled in.
macro_rules! call {
    ($plugin:expr, $name:ident, $args:expr) => {{
        let plugin: &$crate::plugin::Plugin = $plugin;
        match plugin.table(
            ::std::mem::offset_of!(::pjrt_sys::PJRT_Api, $name),
            stringify!($name),
        ) {
            Ok(api) => match api.$name {
                // SAFETY: the slot is inside the plugin's table and non-null; `$args` is a valid
                // argument struct per this macro's contract.
                Some(function) => plugin.status(unsafe { function($args) }),
                None => Err(plugin.missing(stringify!($name))),
            },
            Err(error) => Err(error),
        }
    }};
}
pub(crate) use call;

/// A value of a plugin attribute (`PJRT_NamedValue`).
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    Str(String),
    Int64(i64),
    Int64List(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl fmt::Display for AttrValue {
    /// Lists print dotted (`1.13.3`) because plugins use them for version numbers.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::Str(s) => f.write_str(s),
            AttrValue::Int64(v) => write!(f, "{v}"),
            AttrValue::Int64List(vs) => {
                let parts: Vec<String> = vs.iter().map(i64::to_string).collect();
                f.write_str(&parts.join("."))
            }
            AttrValue::Float(v) => write!(f, "{v}"),
            AttrValue::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// A loaded and initialized PJRT plugin. Lives for the rest of the process: XLA plugins must
/// never be unloaded, so the library handle is leaked on purpose.
pub struct Plugin {
    path: PathBuf,
    api: &'static PJRT_Api,
    version: (i32, i32),
    attributes: Result<Vec<(String, AttrValue)>>,
}

// SAFETY: PJRT's C API is thread-safe; the table is immutable after `GetPjrtApi`.
unsafe impl Send for Plugin {}
unsafe impl Sync for Plugin {}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("api_version", &self.version)
            .finish()
    }
}

/// Plugins loaded so far, by canonical path: initializing a plugin twice is not allowed.
fn registry() -> &'static Mutex<HashMap<PathBuf, Arc<Plugin>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<PathBuf, Arc<Plugin>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

impl Plugin {
    /// Loads and initializes the plugin at `path`, or returns the one already loaded from the same
    /// file. Refuses libtpu on a machine without TPU hardware, where its initialization would
    /// query a cloud metadata server for minutes.
    pub fn load(path: &Path) -> Result<Arc<Plugin>> {
        let load_error = |message: String| Error::Load {
            path: path.to_path_buf(),
            message,
        };
        let canonical = path.canonicalize().map_err(|e| load_error(e.to_string()))?;
        let mut plugins = registry()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(plugin) = plugins.get(&canonical) {
            return Ok(plugin.clone());
        }
        let is_libtpu = canonical
            .file_name()
            .is_some_and(|name| name.to_string_lossy().starts_with("libtpu"));
        if is_libtpu && !crate::discover::tpu_hardware_present() {
            return Err(load_error(
                "this is libtpu but no TPU hardware was found; initializing it would contact the \
                 cloud metadata server"
                    .into(),
            ));
        }
        let plugin = Arc::new(Self::open(&canonical).map_err(|message| Error::Load {
            path: canonical.clone(),
            message,
        })?);
        plugins.insert(canonical, plugin.clone());
        Ok(plugin)
    }

    /// Finds a plugin (see [`crate::discover`] for the order) and loads it.
    pub fn discover(explicit: Option<&Path>) -> Result<Arc<Plugin>> {
        crate::discover::discover(explicit)
    }

    fn open(path: &Path) -> std::result::Result<Plugin, String> {
        // SAFETY: loading a PJRT plugin runs its initializers; that is what the caller asked for.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        let library: &'static libloading::Library = Box::leak(Box::new(library));
        // SAFETY: `GetPjrtApi` has this signature in every PJRT plugin.
        let get_api =
            unsafe { library.get::<unsafe extern "C" fn() -> *const PJRT_Api>(b"GetPjrtApi\0") }
                .map_err(|e| format!("not a PJRT plugin (no GetPjrtApi): {e}"))?;
        // SAFETY: the plugin returns a pointer to a static table (or null).
        let api = unsafe { get_api().as_ref() }.ok_or("GetPjrtApi returned null")?;
        // The error functions are needed to report anything at all; they sit right after the version.
        let needed = offset_of!(PJRT_Api, PJRT_Error_GetCode) + size_of::<usize>();
        if api.struct_size < needed {
            return Err(format!(
                "PJRT_Api table too small ({} bytes)",
                api.struct_size
            ));
        }
        let version = (
            api.pjrt_api_version.major_version,
            api.pjrt_api_version.minor_version,
        );
        if version.0 != pjrt_sys::PJRT_API_MAJOR as i32 {
            return Err(format!(
                "unsupported PJRT API major version {}.{}",
                version.0, version.1
            ));
        }
        let mut plugin = Plugin {
            path: path.to_path_buf(),
            api,
            version,
            attributes: Ok(vec![]),
        };
        let mut args = PJRT_Plugin_Initialize_Args::new();
        call!(&plugin, PJRT_Plugin_Initialize, &mut args).map_err(|e| e.to_string())?;
        plugin.attributes = plugin.read_attributes();
        Ok(plugin)
    }

    /// The canonical path the plugin was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The PJRT C API version the plugin implements, `(major, minor)`.
    pub fn api_version(&self) -> (i32, i32) {
        self.version
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, ...), read once at load.
    pub fn attributes(&self) -> Result<Vec<(String, AttrValue)>> {
        self.attributes.clone()
    }

    /// One attribute rendered as text (lists dotted), if the plugin reports it.
    pub fn attribute_str(&self, name: &str) -> Option<String> {
        let attributes = self.attributes.as_ref().ok()?;
        attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.to_string())
    }

    /// Stable text naming this exact plugin build: path, PJRT API version and every attribute
    /// (which include the XLA and StableHLO versions). Caches hash it into their keys.
    pub fn identity(&self) -> String {
        let mut text = format!(
            "path={};pjrt_api={}.{}",
            self.path.display(),
            self.version.0,
            self.version.1
        );
        for (name, value) in self.attributes.as_deref().unwrap_or_default() {
            text.push_str(&format!(";{name}={value}"));
        }
        text
    }

    fn read_attributes(&self) -> Result<Vec<(String, AttrValue)>> {
        let mut args = PJRT_Plugin_Attributes_Args::new();
        args.struct_size = PLUGIN_ATTRIBUTES_ARGS_SIZE;
        call!(self, PJRT_Plugin_Attributes, &mut args)?;
        if args.num_attributes == 0 {
            return Ok(vec![]);
        }
        // SAFETY: the plugin owns `num_attributes` values at `attributes` for its lifetime.
        let values = unsafe { std::slice::from_raw_parts(args.attributes, args.num_attributes) };
        Ok(values
            .iter()
            .map(|value| unsafe { named_value(value) })
            .collect())
    }

    /// The API table, provided the function slot at `offset` lies inside it.
    pub(crate) fn table(&self, offset: usize, name: &str) -> Result<&'static PJRT_Api> {
        if offset + size_of::<usize>() <= self.api.struct_size {
            Ok(self.api)
        } else {
            Err(self.missing(name))
        }
    }

    /// The head of the plugin's extension chain (null when it has none).
    pub(crate) fn extension_start(&self) -> *mut pjrt_sys::PJRT_Extension_Base {
        self.api.extension_start
    }

    pub(crate) fn missing(&self, name: &str) -> Error {
        Error::unimplemented(name, self.version)
    }

    /// Converts a returned `PJRT_Error*` into `Result`, destroying the error.
    pub(crate) fn status(&self, error: *mut PJRT_Error) -> Result<()> {
        if error.is_null() {
            return Ok(());
        }
        let api = self.api;
        let mut message_args = PJRT_Error_Message_Args::new();
        message_args.error = error;
        let mut code_args = PJRT_Error_GetCode_Args::new();
        code_args.error = error;
        let mut destroy_args = PJRT_Error_Destroy_Args::new();
        destroy_args.error = error;
        // SAFETY: `open` checked that the table reaches the three error functions; `error` is live
        // until the destroy call, and the message is copied before it.
        unsafe {
            let message = match api.PJRT_Error_Message {
                Some(f) => {
                    f(&mut message_args);
                    lossy(message_args.message, message_args.message_size)
                }
                None => "(plugin gave no message)".to_string(),
            };
            let code = match api.PJRT_Error_GetCode {
                Some(f) if f(&mut code_args).is_null() => ErrorCode::from_raw(code_args.code),
                _ => ErrorCode::Unknown,
            };
            if let Some(f) = api.PJRT_Error_Destroy {
                f(&mut destroy_args);
            }
            Err(Error::Pjrt { code, message })
        }
    }
}

/// Copies `len` bytes at `ptr` (not NUL-terminated) into a `String`.
///
/// # Safety
/// `ptr` must be valid for `len` bytes, or null.
pub(crate) unsafe fn lossy(ptr: *const std::os::raw::c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    String::from_utf8_lossy(std::slice::from_raw_parts(ptr.cast::<u8>(), len)).into_owned()
}

/// # Safety
/// `value` must be a `PJRT_NamedValue` filled in by the plugin.
unsafe fn named_value(value: &PJRT_NamedValue) -> (String, AttrValue) {
    let name = lossy(value.name, value.name_size);
    let union = &value.__bindgen_anon_1;
    let parsed = match value.type_ {
        pjrt_sys::PJRT_NamedValue_Type_PJRT_NamedValue_kString => {
            AttrValue::Str(lossy(union.string_value, value.value_size))
        }
        pjrt_sys::PJRT_NamedValue_Type_PJRT_NamedValue_kInt64 => {
            AttrValue::Int64(union.int64_value)
        }
        pjrt_sys::PJRT_NamedValue_Type_PJRT_NamedValue_kInt64List => {
            let ptr = union.int64_array_value;
            AttrValue::Int64List(if ptr.is_null() || value.value_size == 0 {
                vec![]
            } else {
                std::slice::from_raw_parts(ptr, value.value_size).to_vec()
            })
        }
        pjrt_sys::PJRT_NamedValue_Type_PJRT_NamedValue_kFloat => {
            AttrValue::Float(union.float_value)
        }
        pjrt_sys::PJRT_NamedValue_Type_PJRT_NamedValue_kBool => AttrValue::Bool(union.bool_value),
        other => AttrValue::Str(format!("<unknown attribute type {other}>")),
    };
    (name, parsed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pjrt_sys::PJRT_Client_Create_Args;

    unsafe extern "C" fn must_not_run(_: *mut PJRT_Client_Create_Args) -> *mut PJRT_Error {
        std::process::abort()
    }

    fn fake_plugin(api: PJRT_Api) -> Plugin {
        let api = Box::leak(Box::new(api));
        Plugin {
            path: "fake.so".into(),
            api,
            version: (0, 1),
            attributes: Ok(vec![]),
        }
    }

    #[test]
    fn functions_outside_the_table_are_never_called() {
        let mut api = PJRT_Api {
            PJRT_Client_Create: Some(must_not_run),
            ..Default::default()
        };
        // An older plugin whose table ends right before PJRT_Client_Create.
        api.struct_size = offset_of!(PJRT_Api, PJRT_Client_Create);
        let mut args = PJRT_Client_Create_Args::new();
        let err = call!(&fake_plugin(api), PJRT_Client_Create, &mut args).unwrap_err();
        assert!(
            matches!(&err, Error::Pjrt { code: ErrorCode::Unimplemented, message }
            if message.contains("PJRT_Client_Create")),
            "{err}"
        );
        // Inside the table but null.
        let api = PJRT_Api {
            struct_size: size_of::<PJRT_Api>(),
            ..Default::default()
        };
        let err = call!(&fake_plugin(api), PJRT_Client_Create, &mut args).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Pjrt {
                    code: ErrorCode::Unimplemented,
                    ..
                }
            ),
            "{err}"
        );
    }
}
