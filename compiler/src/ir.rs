//! The graph IR: the one contract between the Python shell and the Rust compiler.
//!
//! Python builds it from an ATen-level FX graph and sends it as JSON; Rust hashes its canonical
//! bincode encoding. Nothing process-specific (FX node names, object ids, dict order, source
//! locations) is part of [`Graph`], so the same model gives the same bytes in every process.
//! Source locations travel beside the graph in [`GraphWithSources`] and only feed error messages.

use serde::{Deserialize, Serialize};

/// Element types: the runtime's, so a graph's types reach PJRT without a translation table.
pub use tpu_dynamo_runtime::DType;

/// A tensor's static type: element type and dimensions (all static for now).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<i64>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Vec<i64>) -> Self {
        TensorType { dtype, shape }
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// Where a graph input comes from; parameters, buffers and constants can stay resident on device.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum InputKind {
    User,
    Parameter,
    Buffer,
    Constant,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Input {
    pub ty: TensorType,
    pub kind: InputKind,
}

/// An index into the graph's values: inputs first (in order), then every node's outputs
/// in node order.
pub type ValueId = u32;

/// A float argument, stored as its IEEE-754 bits so NaN/±inf survive JSON and hashing is exact.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FloatBits(pub u64);

impl FloatBits {
    pub fn value(self) -> f64 {
        f64::from_bits(self.0)
    }
}

/// One argument of an ATen call, positional or keyword.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Arg {
    None,
    Value(ValueId),
    Int(i64),
    Float(FloatBits),
    Bool(bool),
    Str(String),
    DType(DType),
    List(Vec<Arg>),
}

/// One ATen call. `op` is the overload's full name, e.g. `aten.add.Tensor`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    pub op: String,
    pub args: Vec<Arg>,
    /// Keyword arguments sorted by name.
    pub kwargs: Vec<(String, Arg)>,
    /// Types of the values this node defines (one per tensor output, as FX's meta recorded them).
    pub outputs: Vec<TensorType>,
}

/// An input the graph updates in place: `outputs[output]` is the input's new value, so the
/// executable may write it into the input's (donated) device buffer instead of a fresh one.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Alias {
    pub input: u32,
    pub output: u32,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Graph {
    pub inputs: Vec<Input>,
    pub nodes: Vec<Node>,
    pub outputs: Vec<ValueId>,
    /// Inputs mutated by the graph (e.g. a StaticCache's K/V), each tied to the output holding
    /// its new value; input and output types are equal.
    #[serde(default)]
    pub aliases: Vec<Alias>,
}

/// What Python sends: the canonical graph plus, per node, the user source line Dynamo recorded.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct GraphWithSources {
    pub graph: Graph,
    #[serde(default)]
    pub sources: Vec<Option<String>>,
}

impl Graph {
    /// Canonical bytes: the bincode encoding, identical for identical graphs in every process.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        bincode::serde::encode_to_vec(self, bincode::config::standard())
            .expect("encoding an in-memory graph into a Vec cannot fail")
    }

    /// blake3 of the canonical bytes.
    pub fn hash(&self) -> blake3::Hash {
        blake3::hash(&self.canonical_bytes())
    }

    /// The type of every value, inputs first, then node outputs.
    pub fn value_types(&self) -> Vec<&TensorType> {
        self.inputs
            .iter()
            .map(|i| &i.ty)
            .chain(self.nodes.iter().flat_map(|n| n.outputs.iter()))
            .collect()
    }
}

impl GraphWithSources {
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// An integer size expression over the symbols of a [`SymbolicGraph`]. `Sym(k)` is the k-th
/// symbol, numbered by first appearance in the graph (never the tracer's own names, which may
/// differ between processes). `FloorDiv` and `Mod` round toward -inf, like Python's `//` and
/// `%` (sympy's `FloorDiv`/`Mod` as Dynamo emits them).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum SymExpr {
    Sym(u32),
    Const(i64),
    Add(Vec<SymExpr>),
    Mul(Vec<SymExpr>),
    FloorDiv(Box<SymExpr>, Box<SymExpr>),
    Mod(Box<SymExpr>, Box<SymExpr>),
    Pow(Box<SymExpr>, u32),
    Max(Vec<SymExpr>),
    Min(Vec<SymExpr>),
}

/// Where a symbolic integer sits in a [`SymbolicGraph`]'s graph, which holds 0 there.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum SymSlot {
    /// Dimension `dim` of value `value`'s type (an input or a node output).
    Dim { value: ValueId, dim: u32 },
    /// An `Arg::Int` of node `node`: `arg` indexes its positional arguments, then its keyword
    /// arguments' values; `path` indexes into nested `Arg::List`s.
    Arg { node: u32, arg: u32, path: Vec<u32> },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct SymSize {
    pub at: SymSlot,
    pub expr: SymExpr,
}

/// A graph traced with symbolic sizes (Dynamo's `dynamic=True`, `mark_dynamic`, or the second
/// shape under `dynamic=None`), converted once. Per call signature, `specialize` binds the
/// symbols from the concrete input shapes and `scalars`, and writes every size into a concrete
/// [`Graph`], which is then hashed, cached and compiled like any static graph. Keeping symbols
/// out of [`Graph`] itself leaves static graphs' canonical bytes (and disk cache keys) as they were.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct SymbolicGraph {
    pub graph: GraphWithSources,
    /// Every symbolic size in `graph`; each slot appears once.
    pub sizes: Vec<SymSize>,
    /// The integer scalars passed beside the tensor inputs (Dynamo's SymInt placeholders), in
    /// order. A bare `Sym` here or in an input dimension binds that symbol.
    pub scalars: Vec<SymExpr>,
}

impl SymbolicGraph {
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// blake3 of the canonical (bincode) encoding of everything but the source lines.
    pub fn hash(&self) -> blake3::Hash {
        let canonical = (&self.graph.graph, &self.sizes, &self.scalars);
        let bytes = bincode::serde::encode_to_vec(canonical, bincode::config::standard())
            .expect("encoding an in-memory graph into a Vec cannot fail");
        blake3::hash(&bytes)
    }
}
