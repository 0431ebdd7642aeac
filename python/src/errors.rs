//! Python exception classes, and the conversion of every Rust error into one of them.
//! Nothing here panics: errors cross the FFI boundary only as Python exceptions.
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tpu_dynamo_runtime::Error as RtError;

create_exception!(tpu_dynamo, LowerError, PyRuntimeError, "An ATen graph could not be lowered to StableHLO.");
create_exception!(tpu_dynamo, PjrtError, PyRuntimeError, "The PJRT plugin failed (compile, transfer or execute).");
create_exception!(tpu_dynamo, PluginNotFoundError, PjrtError, "No PJRT plugin could be found or loaded.");

pub fn runtime_err(e: RtError) -> PyErr {
    match e {
        RtError::PluginNotFound { .. } | RtError::Load { .. } => PluginNotFoundError::new_err(e.to_string()),
        RtError::InvalidArgument(_) => PyValueError::new_err(format!("tpu_dynamo: {e}")),
        RtError::Pjrt { .. } => PjrtError::new_err(e.to_string()),
    }
}

pub fn lower_err(e: tpu_dynamo_compiler::LowerError) -> PyErr {
    LowerError::new_err(e.to_string())
}

pub fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LowerError", py.get_type::<LowerError>())?;
    m.add("PjrtError", py.get_type::<PjrtError>())?;
    m.add("PluginNotFoundError", py.get_type::<PluginNotFoundError>())?;
    Ok(())
}
