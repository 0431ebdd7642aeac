//! Lowering of an ATen [`Graph`](crate::ir::Graph) to a StableHLO module.
//!
//! The driver walks the nodes in order, resolves their arguments into [`NodeCtx`], dispatches by
//! op name to a rule from the registry (one module per op family, each with a `register`), and
//! checks that every rule produced exactly the types FX recorded in `Node::outputs`.

mod attention;
mod builder;
pub use builder::{lowering_target, HostProduct, KeptF32, LoweringTarget, LOWERING_TARGET};
mod compare;
mod convert;
mod convolution;
mod creation;
mod elementwise;
mod epilogue;
mod fft;
mod indexing;
mod lapack;
mod linalg;
mod normalization;
mod packing;
mod patterns;
mod pooling;
mod reduction;
mod rotary;
mod sampling;
mod sorting;
mod special;
mod trig;
mod view;
mod window;

use crate::ir::{self, Arg, DType, Graph, TensorType, ValueId};
use builder::{mlir_type, type_str, Builder, Operand, Scalar, Val, R};
use melior::{
    dialect::{func, DialectHandle},
    ir::{
        attribute::{Attribute, StringAttribute, TypeAttribute},
        block::BlockLike,
        operation::OperationLike,
        r#type::FunctionType,
        Block, Identifier, Location, Module, Region, RegionLike,
    },
    Context,
};
use std::{collections::HashMap, fmt, sync::OnceLock};

/// The lowered module: MLIR text, its bytecode, and the signature of `@main`.
#[derive(Clone, Debug)]
pub struct Lowered {
    pub text: String,
    pub bytecode: Vec<u8>,
    pub inputs: Vec<ir::TensorType>,
    pub outputs: Vec<ir::TensorType>,
}

/// Whether no rule exists for an op, or a rule rejected or mis-typed a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LowerErrorKind {
    Unsupported,
    Failed,
}

/// A lowering failure, naming the op, its argument types and the user's source line.
#[derive(Clone, Debug)]
pub struct LowerError {
    pub kind: LowerErrorKind,
    pub op: String,
    pub node: Option<usize>,
    pub arg_types: Vec<String>,
    pub source: Option<String>,
    pub message: String,
}

impl fmt::Display for LowerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let args = self.arg_types.join(", ");
        match self.kind {
            LowerErrorKind::Unsupported => write!(f, "unsupported op {}({args})", self.op)?,
            LowerErrorKind::Failed => write!(f, "{} lowering failed for ({args})", self.op)?,
        }
        if let Some(n) = self.node {
            write!(f, " [node {n}]")?;
        }
        if let Some(s) = &self.source {
            write!(f, " at {s}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for LowerError {}

/// An argument with value ids resolved to typed SSA values.
#[derive(Clone)]
pub enum A<'a> {
    None,
    T(Val<'a>),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    DType(DType),
    List(Vec<A<'a>>),
}

impl A<'_> {
    fn describe(&self) -> String {
        match self {
            A::None => "None".into(),
            A::T(v) => type_str(&v.ty),
            A::Int(i) => format!("int {i}"),
            A::Float(x) => format!("float {x}"),
            A::Bool(b) => format!("bool {b}"),
            A::Str(s) => format!("str {s:?}"),
            A::DType(d) => format!("dtype {}", d.name()),
            A::List(l) => format!(
                "[{}]",
                l.iter().map(A::describe).collect::<Vec<_>>().join(", ")
            ),
        }
    }
}

/// What a rule sees: the builder, the resolved arguments, and the recorded output types.
pub struct NodeCtx<'a> {
    pub b: Builder<'a>,
    /// The op name, for rules shared by several ops.
    pub op: String,
    args: Vec<A<'a>>,
    kwargs: Vec<(String, A<'a>)>,
    pub outputs: Vec<TensorType>,
}

/// The outcome of a rule: one value per node output.
pub type Res<'a> = R<Vec<Val<'a>>>;
type Rule = for<'a> fn(NodeCtx<'a>) -> Res<'a>;

/// Per-family rule tables, merged once.
pub struct Registry(HashMap<&'static str, Rule>);

impl Registry {
    fn add(&mut self, names: &[&'static str], rule: Rule) {
        for n in names {
            self.0.insert(n, rule);
        }
    }
}

fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| {
        let mut r = Registry(HashMap::new());
        attention::register(&mut r);
        elementwise::register(&mut r);
        fft::register(&mut r);
        compare::register(&mut r);
        convert::register(&mut r);
        convolution::register(&mut r);
        creation::register(&mut r);
        indexing::register(&mut r);
        lapack::register(&mut r);
        linalg::register(&mut r);
        normalization::register(&mut r);
        packing::register(&mut r);
        pooling::register(&mut r);
        reduction::register(&mut r);
        sampling::register(&mut r);
        sorting::register(&mut r);
        special::register(&mut r);
        view::register(&mut r);
        window::register(&mut r);
        r
    })
}

/// Whether `op`'s rule computes each output element from the same-position elements of its
/// (broadcast) operands: the elementwise, comparison and conversion families, minus dropout
/// (random, so never "the same" on a padded input).
pub fn is_pointwise(op: &str) -> bool {
    static OPS: OnceLock<Registry> = OnceLock::new();
    let ops = OPS.get_or_init(|| {
        let mut r = Registry(HashMap::new());
        elementwise::register(&mut r);
        compare::register(&mut r);
        convert::register(&mut r);
        r.0.remove("aten.native_dropout.default");
        r
    });
    ops.0.contains_key(op)
}

/// The ops that have a lowering rule, sorted.
pub fn supported_ops() -> Vec<&'static str> {
    // The padding rewrite's own nodes are no ATen ops.
    let mut v: Vec<_> = registry().0.keys().copied().filter(|op| !op.starts_with("tpu.")).collect();
    v.sort_unstable();
    v
}

impl<'a> NodeCtx<'a> {
    /// Positional argument `pos`, else keyword `name`; `None` when absent or passed as None.
    pub fn arg(&self, pos: usize, name: &str) -> Option<&A<'a>> {
        let a = self
            .args
            .get(pos)
            .or_else(|| self.kwargs.iter().find(|(k, _)| k == name).map(|(_, v)| v));
        a.filter(|a| !matches!(a, A::None))
    }

    fn missing(name: &str) -> String {
        format!("missing or ill-typed argument `{name}`")
    }

    pub fn tensor(&self, pos: usize, name: &str) -> R<Val<'a>> {
        self.opt_tensor(pos, name)?
            .ok_or_else(|| Self::missing(name))
    }

    pub fn opt_tensor(&self, pos: usize, name: &str) -> R<Option<Val<'a>>> {
        match self.arg(pos, name) {
            None => Ok(None),
            Some(A::T(v)) => Ok(Some(v.clone())),
            Some(_) => Err(Self::missing(name)),
        }
    }

    /// A tensor or a Python number.
    pub fn operand(&self, pos: usize, name: &str) -> R<Operand<'a>> {
        match self.arg(pos, name) {
            Some(A::T(v)) => Ok(Operand::Tensor(v.clone())),
            _ => Ok(Operand::Scalar(self.scalar(pos, name)?)),
        }
    }

    pub fn opt_operand(&self, pos: usize, name: &str) -> R<Option<Operand<'a>>> {
        self.arg(pos, name)
            .map(|_| self.operand(pos, name))
            .transpose()
    }

    pub fn opt_scalar(&self, pos: usize, name: &str) -> R<Option<Scalar>> {
        match self.arg(pos, name) {
            None => Ok(None),
            Some(A::Int(i)) => Ok(Some(Scalar::Int(*i))),
            Some(A::Float(f)) => Ok(Some(Scalar::Float(*f))),
            Some(A::Bool(b)) => Ok(Some(Scalar::Bool(*b))),
            Some(_) => Err(Self::missing(name)),
        }
    }

    pub fn scalar(&self, pos: usize, name: &str) -> R<Scalar> {
        self.opt_scalar(pos, name)?
            .ok_or_else(|| Self::missing(name))
    }

    pub fn scalar_or(&self, pos: usize, name: &str, default: Scalar) -> R<Scalar> {
        Ok(self.opt_scalar(pos, name)?.unwrap_or(default))
    }

    pub fn opt_dtype(&self, pos: usize, name: &str) -> R<Option<DType>> {
        match self.arg(pos, name) {
            None => Ok(None),
            Some(A::DType(d)) => Ok(Some(*d)),
            Some(_) => Err(Self::missing(name)),
        }
    }

    pub fn int(&self, pos: usize, name: &str) -> R<i64> {
        match self.arg(pos, name) {
            Some(A::Int(i)) => Ok(*i),
            Some(A::Bool(b)) => Ok(*b as i64),
            _ => Err(Self::missing(name)),
        }
    }

    pub fn int_or(&self, pos: usize, name: &str, default: i64) -> R<i64> {
        self.arg(pos, name)
            .map_or(Ok(default), |_| self.int(pos, name))
    }

    pub fn float_or(&self, pos: usize, name: &str, default: f64) -> R<f64> {
        Ok(self.opt_scalar(pos, name)?.map_or(default, Scalar::as_f64))
    }

    pub fn bool_or(&self, pos: usize, name: &str, default: bool) -> R<bool> {
        match self.arg(pos, name) {
            None => Ok(default),
            Some(A::Bool(b)) => Ok(*b),
            Some(A::Int(i)) => Ok(*i != 0),
            Some(_) => Err(Self::missing(name)),
        }
    }

    pub fn str_or(&self, pos: usize, name: &str, default: &str) -> R<String> {
        match self.arg(pos, name) {
            None => Ok(default.to_string()),
            Some(A::Str(s)) => Ok(s.clone()),
            Some(_) => Err(Self::missing(name)),
        }
    }

    /// An int list (an int alone counts as a one-element list); absent means empty.
    pub fn ints(&self, pos: usize, name: &str) -> R<Vec<i64>> {
        match self.arg(pos, name) {
            None => Ok(vec![]),
            Some(A::Int(i)) => Ok(vec![*i]),
            Some(A::List(l)) => l
                .iter()
                .map(|a| match a {
                    A::Int(i) => Ok(*i),
                    _ => Err(Self::missing(name)),
                })
                .collect(),
            Some(_) => Err(Self::missing(name)),
        }
    }

    /// A list of numbers (`float[]?`); `None` when absent.
    pub fn opt_floats(&self, pos: usize, name: &str) -> R<Option<Vec<f64>>> {
        match self.arg(pos, name) {
            None => Ok(None),
            Some(A::List(l)) => l
                .iter()
                .map(|a| match a {
                    A::Float(f) => Ok(*f),
                    A::Int(i) => Ok(*i as f64),
                    _ => Err(Self::missing(name)),
                })
                .collect::<R<Vec<_>>>()
                .map(Some),
            Some(_) => Err(Self::missing(name)),
        }
    }

    /// A list of optional tensors (`Tensor?[]`).
    pub fn opt_tensors(&self, pos: usize, name: &str) -> R<Vec<Option<Val<'a>>>> {
        match self.arg(pos, name) {
            Some(A::List(l)) => l
                .iter()
                .map(|a| match a {
                    A::T(v) => Ok(Some(v.clone())),
                    A::None => Ok(None),
                    _ => Err(Self::missing(name)),
                })
                .collect(),
            _ => Err(Self::missing(name)),
        }
    }

    pub fn tensors(&self, pos: usize, name: &str) -> R<Vec<Val<'a>>> {
        self.opt_tensors(pos, name)?
            .into_iter()
            .map(|t| t.ok_or_else(|| Self::missing(name)))
            .collect()
    }

    /// The recorded type of output `i`.
    pub fn out(&self, i: usize) -> R<&TensorType> {
        self.outputs
            .get(i)
            .ok_or_else(|| format!("node has no output {i}"))
    }

    /// The recorded dtype of output 0.
    pub fn out_dtype(&self) -> R<DType> {
        Ok(self.out(0)?.dtype)
    }
}

fn resolve<'a>(arg: &Arg, values: &[Option<Val<'a>>]) -> R<A<'a>> {
    Ok(match arg {
        Arg::None => A::None,
        Arg::Value(id) => A::T(
            values
                .get(*id as usize)
                .cloned()
                .flatten()
                .ok_or_else(|| format!("value %{id} is not defined yet"))?,
        ),
        Arg::Int(i) => A::Int(*i),
        Arg::Float(f) => A::Float(f.value()),
        Arg::Bool(b) => A::Bool(*b),
        Arg::Str(s) => A::Str(s.clone()),
        Arg::DType(d) => A::DType(*d),
        Arg::List(l) => A::List(l.iter().map(|a| resolve(a, values)).collect::<R<_>>()?),
    })
}

/// Lowers `graph` to a module whose `@main` takes the graph inputs and returns its outputs.
/// `sources[i]` is node i's user source line, used only in error messages.
pub fn lower(graph: &Graph, sources: &[Option<String>]) -> Result<Lowered, LowerError> {
    let target = lowering_target();
    let kept_on_tiles = builder::weights_kept_on_tiles(&graph.inputs, target.host_gemm_tiles_budget, target.host_f32_gemm_kept);
    let ctx = Context::new();
    ctx.set_allow_unregistered_dialects(true);
    DialectHandle::func().register_dialect(&ctx);
    DialectHandle::func().load_dialect(&ctx);
    let loc = Location::unknown(&ctx);
    let whole = |message: String| LowerError {
        kind: LowerErrorKind::Failed,
        op: "graph".into(),
        node: None,
        arg_types: vec![],
        source: None,
        message,
    };

    let inputs: Vec<TensorType> = graph.inputs.iter().map(|i| i.ty.clone()).collect();
    let types = graph.value_types();
    let outputs = graph
        .outputs
        .iter()
        .map(|&id| {
            types
                .get(id as usize)
                .map(|t| (*t).clone())
                .ok_or_else(|| whole(format!("output %{id} is not a value")))
        })
        .collect::<Result<Vec<_>, _>>()?;

    let sig = |ts: &[TensorType]| {
        ts.iter()
            .map(|t| mlir_type(&ctx, t))
            .collect::<R<Vec<_>>>()
            .map_err(whole)
    };
    let (in_types, out_types) = (sig(&inputs)?, sig(&outputs)?);
    let block = Block::new(&in_types.iter().map(|&t| (t, loc)).collect::<Vec<_>>());
    emit_body(&ctx, &block, loc, graph, sources, &kept_on_tiles)?;

    let fn_type = FunctionType::new(&ctx, &in_types, &out_types);
    let region = Region::new();
    region.append_block(block);
    let arg_attrs = aliasing_attrs(&ctx, graph, &inputs, &outputs).map_err(whole)?;
    let function = func::func(
        &ctx,
        StringAttribute::new(&ctx, "main"),
        TypeAttribute::new(fn_type.into()),
        region,
        &arg_attrs,
        loc,
    );
    let module = Module::new(loc);
    module.body().append_operation(function);
    if !module.as_operation().verify() {
        return Err(whole("the emitted module does not verify".into()));
    }
    let text = module.as_operation().to_string();
    let bytecode = module.as_operation().write_bytecode();
    Ok(Lowered {
        text,
        bytecode,
        inputs,
        outputs,
    })
}

/// `arg_attrs` marking each aliased input with `tf.aliasing_output` (as JAX does for donated
/// arguments): XLA then builds the input/output alias config, and PJRT donates the input buffer
/// at execute time, writing that output in place. Empty when nothing is aliased.
fn aliasing_attrs<'c>(
    ctx: &'c Context,
    graph: &Graph,
    inputs: &[TensorType],
    outputs: &[TensorType],
) -> Result<Vec<(Identifier<'c>, Attribute<'c>)>, String> {
    if graph.aliases.is_empty() {
        return Ok(vec![]);
    }
    let mut per_input = vec![String::from("{}"); inputs.len()];
    for a in &graph.aliases {
        let (i, o) = (a.input as usize, a.output as usize);
        match (inputs.get(i), outputs.get(o)) {
            (Some(it), Some(ot)) if it == ot => {}
            _ => return Err(format!("alias of input {i} to output {o}: missing or of another type")),
        }
        if per_input[i] != "{}" {
            return Err(format!("input {i} is aliased twice"));
        }
        per_input[i] = format!("{{tf.aliasing_output = {o} : i32}}");
    }
    let text = format!("[{}]", per_input.join(", "));
    let attr = Attribute::parse(ctx, &text).ok_or_else(|| format!("cannot parse {text}"))?;
    Ok(vec![(Identifier::new(ctx, "arg_attrs"), attr)])
}

/// Emits every node and the `func.return` into `block`.
fn emit_body<'a>(
    ctx: &'a Context,
    block: &'a Block<'a>,
    loc: Location<'a>,
    graph: &Graph,
    sources: &[Option<String>],
    kept_on_tiles: &'a [bool],
) -> Result<(), LowerError> {
    let mut values: Vec<Option<Val<'a>>> = graph
        .inputs
        .iter()
        .enumerate()
        .map(|(i, inp)| {
            Some(Val {
                v: block
                    .argument(i)
                    .expect("block has one argument per input")
                    .into(),
                ty: inp.ty.clone(),
            })
        })
        .collect();
    let reg = registry();
    // Composites found among the graph's ops, lowered as one kernel each.
    let uses = patterns::Uses::new(graph);
    let rms_norms = normalization::RmsNorms::of(&uses);
    let rotaries = rotary::Rotaries::of(&uses);
    let modulated_norms = normalization::ModulatedNorms::of(&uses);
    let finished_products = epilogue::FinishedProducts::of(&uses);
    let attentions = attention::Placements::of(&uses);
    // Values a kernel wrote for nodes not lowered yet, which then take them as theirs.
    let mut ahead: HashMap<ValueId, Val> = HashMap::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        if let Some(written) = ahead.remove(&(values.len() as ValueId)).filter(|w| check_types(std::slice::from_ref(w), &node.outputs).is_ok()) {
            values.push(Some(written));
            continue;
        }
        let source = sources.get(i).cloned().flatten();
        let resolved = node
            .args
            .iter()
            .map(|a| resolve(a, &values))
            .collect::<R<Vec<_>>>()
            .and_then(|args| {
                let kwargs = node
                    .kwargs
                    .iter()
                    .map(|(k, a)| Ok((k.clone(), resolve(a, &values)?)))
                    .collect::<R<Vec<_>>>()?;
                Ok((args, kwargs))
            });
        let describe = |args: &[A]| args.iter().map(A::describe).collect::<Vec<_>>();
        let error = |kind, arg_types: Vec<String>, message: String| LowerError {
            kind,
            op: node.op.clone(),
            node: Some(i),
            arg_types,
            source: source.clone(),
            message,
        };
        let (args, kwargs) = resolved.map_err(|m| error(LowerErrorKind::Failed, vec![], m))?;
        let mut arg_types = describe(&args);
        arg_types.extend(kwargs.iter().map(|(k, a)| format!("{k}={}", a.describe())));
        let Some(rule) = reg.0.get(node.op.as_str()) else {
            return Err(error(
                LowerErrorKind::Unsupported,
                arg_types,
                "no lowering rule for this op".into(),
            ));
        };
        let b = Builder::new(
            ctx,
            block,
            source
                .as_deref()
                .map_or(loc, |s| Location::name(ctx, s, loc)),
            kept_on_tiles,
        );
        let n = NodeCtx {
            b,
            op: node.op.clone(),
            args,
            kwargs,
            outputs: node.outputs.clone(),
        };
        let out = node.outputs.first();
        let composite = rms_norms
            .lower(i, &n.b, &values)
            .or_else(|| modulated_norms.lower(i, &n.b, &values, out?))
            .or_else(|| rotaries.lower(i, &n.b, &values, out?))
            .or_else(|| finished_products.lower(i, &n.b, &values, out?));
        // Values an attention kernel wrote for other nodes (the keys and values it read in place).
        let mut written = vec![];
        let produced = match composite {
            Some(lowered) => lowered,
            None => match attentions.lower(i, &n, &values) {
                Some(lowered) => lowered.map(|(outs, others)| {
                    written = others;
                    outs
                }),
                None => rule(n),
            },
        }
        .map_err(|m| error(LowerErrorKind::Failed, arg_types.clone(), m))?;
        check_types(&produced, &node.outputs)
            .map_err(|m| error(LowerErrorKind::Failed, arg_types.clone(), m))?;
        values.extend(produced.into_iter().map(Some));
        for (v, written) in written {
            match values.get_mut(v as usize) {
                Some(value) => *value = Some(written),
                None => drop(ahead.insert(v, written)),
            }
        }
    }
    let outs = graph
        .outputs
        .iter()
        .map(|&id| values.get(id as usize).cloned().flatten().map(|v| v.v))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| LowerError {
            kind: LowerErrorKind::Failed,
            op: "graph".into(),
            node: None,
            arg_types: vec![],
            source: None,
            message: "a graph output is not a value".into(),
        })?;
    block.append_operation(func::r#return(&outs, loc));
    Ok(())
}

/// A rule must reproduce PyTorch's own shape/dtype inference exactly.
fn check_types(produced: &[Val], expected: &[TensorType]) -> R<()> {
    if produced.len() != expected.len() {
        return Err(format!(
            "rule produced {} outputs, the graph records {}",
            produced.len(),
            expected.len()
        ));
    }
    for (i, (p, e)) in produced.iter().zip(expected).enumerate() {
        if &p.ty != e {
            return Err(format!(
                "rule produced {} for output {i}, the graph records {}",
                type_str(&p.ty),
                type_str(e)
            ));
        }
    }
    Ok(())
}
