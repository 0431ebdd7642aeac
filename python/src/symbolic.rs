//! `SymbolicGraph`: a graph with symbolic sizes, parsed once; `specialize` makes and compiles
//! (or finds cached) the concrete graph for one call's input shapes, with no Python conversion.
use std::sync::atomic::Ordering::Relaxed;
use std::sync::OnceLock;
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tpu_dynamo_compiler::ir;
use tpu_dynamo_compiler::padding::PaddingPlan;

use crate::compiled::{compile_graph, CompiledGraph};
use crate::counters::{add_time, STATS};

fn value_err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

#[pyclass(frozen, module = "tpu_dynamo._native")]
pub struct SymbolicGraph {
    ir: ir::SymbolicGraph,
    /// blake3 of the symbolic IR without source lines: equal across processes for one model.
    #[pyo3(get)]
    graph_hash: String,
    /// The padding analysis, made once: Python asks for it, and each bucket's `specialize`
    /// follows it.
    plan: OnceLock<Result<PaddingPlan, String>>,
    /// The scalar inputs (positions among the scalars) the executable reads at run time
    /// (`numbers_at`), so that their values do not key the executable.
    #[pyo3(get)]
    number_scalars: Vec<u32>,
}

#[pymethods]
impl SymbolicGraph {
    /// Parses `SymbolicGraph` JSON; ValueError if it is malformed or a symbol could never be
    /// bound from a call's inputs (the caller then specializes in Python instead).
    #[new]
    fn new(graph_json: &str) -> PyResult<Self> {
        let ir = ir::SymbolicGraph::from_json(graph_json)
            .map_err(|e| value_err(format!("tpu_dynamo: malformed symbolic graph IR JSON: {e}")))?;
        ir.check().map_err(value_err)?;
        STATS.symbolic_graphs.fetch_add(1, Relaxed);
        Ok(SymbolicGraph::of(ir))
    }

    /// Per graph input, its `(dimension, symbol)` pairs: the sizes a call binds.
    #[getter]
    fn input_symbols(&self) -> Vec<Vec<(u32, u32)>> {
        let mut out = vec![vec![]; self.ir.graph.graph.inputs.len()];
        for s in &self.ir.sizes {
            if let (ir::SymSlot::Dim { value, dim }, ir::SymExpr::Sym(k)) = (&s.at, &s.expr) {
                if let Some(pairs) = out.get_mut(*value as usize) {
                    pairs.push((*dim, *k));
                }
            }
        }
        out
    }

    /// This graph with the symbols of `values` (`(symbol, value)`) fixed, as static sizes: its
    /// own padding plan pads only the others.
    fn fix(&self, values: Vec<(u32, i64)>) -> PyResult<SymbolicGraph> {
        Ok(SymbolicGraph::of(self.ir.fix(&values).map_err(value_err)?))
    }

    /// How to run on inputs padded along the symbolic dimensions (buckets): per input its
    /// `(dimension, symbol)` pairs, per output its `(dimension, symbol, plus)` cuts (to the true
    /// size + plus), per scalar its symbol, `(symbol, limit)` caps on the padded size, and the
    /// symbols whose true sizes the executable reads as extra inputs, the symbol pairs it
    /// assumes equal, the `(a, b, plus)` it assumes `a >= b + plus` of and the `(symbol, limit)`
    /// it assumes at most `limit` (a call where they do not hold runs exact shapes), and the
    /// inputs and outputs passed packed. ValueError saying which op makes padding unsafe otherwise.
    #[allow(clippy::type_complexity)]
    fn padding_plan(
        &self,
    ) -> PyResult<(Vec<Vec<(u32, u32)>>, Vec<Vec<(u32, u32, i64)>>, Vec<Option<u32>>, Vec<(u32, i64)>, Vec<u32>, Vec<(u32, u32)>, Vec<(u32, u32, i64)>, Vec<(u32, i64)>, Vec<usize>, Vec<usize>)> {
        let p = self.plan()?.clone();
        let (packed_inputs, packed_outputs) = (p.packed_inputs().collect(), p.packed_outputs().collect());
        Ok((p.inputs, p.outputs, p.scalars, p.limits, p.runtime, p.equal, p.at_least, p.at_most, packed_inputs, packed_outputs))
    }

    /// The graph for inputs of these shapes (one per graph input) and these integer scalars,
    /// compiled or found in the memory or disk cache (keyed by the concrete graph's bytes). With
    /// `lengths_at`, the shapes are padded per `padding_plan`, whose true sizes become 0-d i64
    /// inputs inserted before input `lengths_at`. With `numbers_at`, the `number_scalars` are
    /// 0-d i64 inputs inserted before input `numbers_at` (after any lengths), not constants.
    #[pyo3(signature = (shapes, scalars, lengths_at = None, numbers_at = None, need_stablehlo = false))]
    fn specialize(
        &self,
        py: Python<'_>,
        shapes: Vec<Vec<i64>>,
        scalars: Vec<i64>,
        lengths_at: Option<u32>,
        numbers_at: Option<u32>,
        need_stablehlo: bool,
    ) -> PyResult<CompiledGraph> {
        let start = Instant::now();
        let mut graph = match lengths_at {
            None => self.ir.specialize(&shapes, &scalars).map_err(value_err)?,
            Some(at) => self.ir.specialize_padded(self.plan()?, &shapes, &scalars, at).map_err(value_err)?,
        };
        if let Some(at) = numbers_at {
            let symbols = self.ir.bind(&shapes, &scalars).map_err(value_err)?;
            self.ir.read_numbers(&mut graph, &self.number_scalars, &symbols, at).map_err(value_err)?;
        }
        if let Some(at) = lengths_at {
            self.ir.pack_padded(self.plan()?, &mut graph, at);
        }
        STATS.specializations.fetch_add(1, Relaxed);
        add_time(&STATS.specialize_nanos, start.elapsed());
        compile_graph(py, &graph, need_stablehlo)
    }
}

impl SymbolicGraph {
    fn of(ir: ir::SymbolicGraph) -> SymbolicGraph {
        let graph_hash = ir.hash().to_hex().to_string();
        let number_scalars = ir.number_scalars();
        SymbolicGraph { ir, graph_hash, plan: OnceLock::new(), number_scalars }
    }

    fn plan(&self) -> PyResult<&PaddingPlan> {
        self.plan.get_or_init(|| self.ir.padding_plan()).as_ref().map_err(|e| PyValueError::new_err(e.clone()))
    }
}
