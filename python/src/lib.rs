//! The `tpu_dynamo._native` extension: the Python face of the compiler and runtime.
mod compiled;
mod counters;
mod device;
mod errors;
mod host_view;
mod on_device;
mod padded;
mod persist;
mod resident;
mod symbolic;
mod warm_up;
mod weak_map;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tpu_dynamo_compiler::ir::GraphWithSources;

use crate::errors::runtime_err;
use crate::counters::STATS;

fn parse(graph_json: &str) -> PyResult<GraphWithSources> {
    GraphWithSources::from_json(graph_json)
        .map_err(|e| PyValueError::new_err(format!("tpu_dynamo: malformed graph IR JSON: {e}")))
}

/// The graph's canonical bytes (bincode): identical for identical graphs in every process.
#[pyfunction]
fn canonical_bytes<'py>(py: Python<'py>, graph_json: &str) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(py, &parse(graph_json)?.graph.canonical_bytes()))
}

/// blake3 of the canonical bytes, as hex.
#[pyfunction]
fn graph_hash(graph_json: &str) -> PyResult<String> {
    Ok(parse(graph_json)?.graph.hash().to_hex().to_string())
}

/// ATen ops (overload names) the compiler has a lowering rule for, sorted.
#[pyfunction]
fn supported_ops() -> Vec<&'static str> {
    tpu_dynamo_compiler::lower::supported_ops()
}

/// Counters since the last `reset_stats()`; `*_seconds` are floats, the rest ints.
#[pyfunction]
fn stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, v) in STATS.snapshot() {
        if name.ends_with("_seconds") {
            d.set_item(name, v as f64 * 1e-9)?;
        } else {
            d.set_item(name, v)?;
        }
    }
    d.set_item("cached_executables", compiled::cached_executables())?;
    d.set_item("packed_weight_bytes", tpu_dynamo_runtime::host_kernels::unchanging::kept_bytes())?;
    Ok(d)
}

/// Zeroes the counters and empties the in-memory executable cache (the disk cache stays).
#[pyfunction]
fn reset_stats() {
    STATS.reset();
    compiled::clear_cache();
}

/// The PJRT plugin and device this process runs on (loads the plugin on first use).
#[pyfunction]
fn device_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let t = device::target().map_err(runtime_err)?;
    let plugin = t.client.plugin();
    let d = PyDict::new(py);
    d.set_item("plugin", plugin.path().to_string_lossy().into_owned())?;
    d.set_item("identity", plugin.identity())?;
    d.set_item("platform", t.client.platform_name().map_err(runtime_err)?)?;
    d.set_item("platform_version", t.client.platform_version().map_err(runtime_err)?)?;
    let devices: Vec<String> = t.client.devices().iter().map(|dev| format!("{dev:?}")).collect();
    d.set_item("devices", devices)?;
    d.set_item("host_kernels", t.host_kernels.clone())?;
    let f32_products = t.host_kernels.contains(&tpu_dynamo_runtime::host_kernels::F32_MATMUL_NT_TARGET);
    d.set_item("amx", f32_products && tpu_dynamo_runtime::host_kernels::products_on_tiles())?;
    d.set_item("bf16_products", t.host_kernels.contains(&tpu_dynamo_runtime::host_kernels::BF16_MATMUL_NT_TARGET))?;
    Ok(d)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::add_to(m)?;
    m.add_class::<compiled::CompiledGraph>()?;
    m.add_class::<padded::CallShape>()?;
    m.add_class::<symbolic::SymbolicGraph>()?;
    m.add_function(wrap_pyfunction!(compiled::compile, m)?)?;
    m.add_class::<compiled::Loading>()?;
    m.add_function(wrap_pyfunction!(compiled::compile_in_background, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(graph_hash, m)?)?;
    m.add_function(wrap_pyfunction!(stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_stats, m)?)?;
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    m.add_function(wrap_pyfunction!(warm_up::finish_background_work, m)?)?;
    m.add_function(wrap_pyfunction!(supported_ops, m)?)?;
    m.add("MLIR_VERSION", tpu_dynamo_compiler::MLIR_VERSION)?;
    m.add("COMPILER_SOURCE_HASH", tpu_dynamo_compiler::SOURCE_HASH)?;
    m.add_function(wrap_pyfunction!(persist::cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(persist::cache_list, m)?)?;
    m.add_function(wrap_pyfunction!(persist::cache_clear, m)?)?;
    m.add_function(wrap_pyfunction!(persist::plugin_identity, m)?)?;
    m.add_function(wrap_pyfunction!(persist::graph_get, m)?)?;
    m.add_function(wrap_pyfunction!(persist::graph_put, m)?)?;
    Ok(())
}
