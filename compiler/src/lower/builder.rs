//! The one place that emits StableHLO: every op is built here with a result type we computed.
//!
//! StableHLO is not a registered dialect in our MLIR, so nothing checks these ops before the
//! plugin compiles them; each helper therefore derives its result type from its operands the
//! way the StableHLO spec does, and rules only combine helpers.

use crate::ir::{DType, Input, InputKind, TensorType};
use std::sync::RwLock;
use melior::{
    ir::operation::{OperationBuilder, OperationLike, OperationResult},
    ir::block::BlockArgument,
    ir::{
        block::BlockLike, Attribute, Block, Identifier, Location, OperationRef, Region, RegionLike,
        Type, Value,
    },
    Context,
};

pub type R<T> = Result<T, String>;

/// An SSA value together with the tensor type we gave it.
#[derive(Clone)]
pub struct Val<'a> {
    pub v: Value<'a, 'a>,
    pub ty: TensorType,
}

impl<'a> Val<'a> {
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }
    pub fn shape(&self) -> &[i64] {
        &self.ty.shape
    }
    pub fn rank(&self) -> usize {
        self.ty.rank()
    }
}

/// A Python number as ATen passes it (`Scalar` in schemas).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl Scalar {
    pub fn as_f64(self) -> f64 {
        match self {
            Scalar::Bool(b) => b as i64 as f64,
            Scalar::Int(i) => i as f64,
            Scalar::Float(f) => f,
        }
    }
    /// The dtype PyTorch gives a wrapped Python number (default float dtype is f32).
    pub fn dtype(self) -> DType {
        match self {
            Scalar::Bool(_) => DType::Bool,
            Scalar::Int(_) => DType::I64,
            Scalar::Float(_) => DType::F32,
        }
    }
}

/// Body of a reduction: the combiner and its identity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Combiner {
    Add,
    Mul,
    Max,
    Min,
    Or,
    And,
}

impl Combiner {
    fn op(self) -> &'static str {
        match self {
            Combiner::Add => "add",
            Combiner::Mul => "multiply",
            Combiner::Max => "maximum",
            Combiner::Min => "minimum",
            Combiner::Or => "or",
            Combiner::And => "and",
        }
    }
    pub fn identity(self, dtype: DType) -> Scalar {
        let inf = f64::INFINITY;
        match (self, dtype.is_float()) {
            (Combiner::Add, _) => Scalar::Int(0),
            (Combiner::Mul, _) => Scalar::Int(1),
            (Combiner::Or, _) => Scalar::Bool(false),
            (Combiner::And, _) => Scalar::Bool(true),
            (Combiner::Max, true) => Scalar::Float(-inf),
            (Combiner::Min, true) => Scalar::Float(inf),
            (Combiner::Max, false) => Scalar::Int(int_range(dtype).0),
            (Combiner::Min, false) => Scalar::Int(int_range(dtype).1),
        }
    }
}

fn int_range(dtype: DType) -> (i64, i64) {
    match dtype {
        DType::Bool => (0, 1),
        DType::U8 => (0, 255),
        DType::I8 => (i8::MIN as i64, i8::MAX as i64),
        DType::I16 => (i16::MIN as i64, i16::MAX as i64),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        _ => (i64::MIN, i64::MAX),
    }
}

pub fn element_str(dtype: DType) -> &'static str {
    match dtype {
        DType::Bool => "i1",
        DType::U8 => "ui8",
        DType::I8 => "i8",
        DType::I16 => "i16",
        DType::I32 => "i32",
        DType::I64 => "i64",
        DType::F16 => "f16",
        DType::Bf16 => "bf16",
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::C64 => "complex<f32>",
    }
}

/// MLIR spelling, e.g. `tensor<2x3xf32>`.
pub fn tensor_str(ty: &TensorType) -> String {
    let mut s = String::from("tensor<");
    for d in &ty.shape {
        s += &format!("{d}x");
    }
    s + element_str(ty.dtype) + ">"
}

pub fn mlir_type<'c>(ctx: &'c Context, ty: &TensorType) -> R<Type<'c>> {
    let s = tensor_str(ty);
    Type::parse(ctx, &s).ok_or_else(|| format!("cannot parse type {s}"))
}

/// Short spelling for messages, e.g. `f32[2, 3]`.
pub fn type_str(ty: &TensorType) -> String {
    let dims: Vec<String> = ty.shape.iter().map(|d| d.to_string()).collect();
    format!("{}[{}]", ty.dtype.name(), dims.join(", "))
}

/// `array<i64: 1, 2>` (empty: `array<i64>`).
pub fn i64_array(values: &[i64]) -> String {
    if values.is_empty() {
        return "array<i64>".into();
    }
    let v: Vec<String> = values.iter().map(|x| x.to_string()).collect();
    format!("array<i64: {}>", v.join(", "))
}

/// `[1, 2]`, as the dot/gather/scatter attributes spell dimension lists.
pub fn list(values: &[i64]) -> String {
    let v: Vec<String> = values.iter().map(|x| x.to_string()).collect();
    format!("[{}]", v.join(", "))
}

/// `dense<[[lo, hi], ...]> : tensor<Nx2xi64>`, the padding form of convolution/reduce_window.
pub fn padding_attr(pads: &[(i64, i64)]) -> String {
    let rows: Vec<String> = pads.iter().map(|(l, h)| format!("[{l}, {h}]")).collect();
    format!(
        "dense<[{}]> : tensor<{}x2xi64>",
        rows.join(", "),
        pads.len()
    )
}

/// Compute type PyTorch's CPU kernels use for a storage type ("opmath"): half types widen to f32.
pub fn opmath(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::Bf16 => DType::F32,
        d => d,
    }
}

fn category(dtype: DType) -> u8 {
    if dtype == DType::Bool {
        0
    } else if dtype.is_integer() {
        1
    } else if dtype.is_float() {
        2
    } else {
        3
    }
}

/// `torch.promote_types`.
pub fn promote_types(a: DType, b: DType) -> DType {
    use DType::*;
    if a == b {
        return a;
    }
    let (ca, cb) = (category(a), category(b));
    if ca != cb {
        return if ca > cb { a } else { b };
    }
    match (a, b) {
        (Bf16, F16) | (F16, Bf16) => F32,
        (U8, I8) | (I8, U8) => I16,
        _ if a.size() >= b.size() => a,
        _ => b,
    }
}

/// An operand of an elementwise op before promotion: a tensor or a Python number.
#[derive(Clone)]
pub enum Operand<'a> {
    Tensor(Val<'a>),
    Scalar(Scalar),
}

/// `torch.result_type` over tensors and numbers: dimensioned tensors win over 0-d tensors, which
/// win over numbers, unless a lower-priority group has a higher category (bool < int < float).
pub fn result_type(operands: &[&Operand]) -> DType {
    let mut groups: [Option<DType>; 3] = [None, None, None];
    for o in operands {
        let (g, d) = match o {
            Operand::Tensor(t) if t.rank() > 0 => (0, t.dtype()),
            Operand::Tensor(t) => (1, t.dtype()),
            Operand::Scalar(s) => (2, s.dtype()),
        };
        groups[g] = Some(groups[g].map_or(d, |p| promote_types(p, d)));
    }
    let mut result: Option<DType> = None;
    for d in groups.into_iter().flatten() {
        result = Some(match result {
            None => d,
            Some(r) if category(d) > category(r) => promote_types(r, d),
            Some(r) => r,
        });
    }
    result.unwrap_or(DType::F32)
}

/// numpy broadcasting of two shapes.
pub fn broadcast_shapes(a: &[i64], b: &[i64]) -> R<Vec<i64>> {
    let n = a.len().max(b.len());
    let get = |s: &[i64], i: usize| {
        if i + s.len() >= n {
            s[i + s.len() - n]
        } else {
            1
        }
    };
    (0..n)
        .map(|i| match (get(a, i), get(b, i)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            (x, y) => Err(format!(
                "shapes {a:?} and {b:?} do not broadcast ({x} vs {y})"
            )),
        })
        .collect()
}

/// A possibly negative dim index into a rank-`rank` tensor, checked.
pub fn norm_dim(dim: i64, rank: usize) -> R<usize> {
    let r = rank.max(1) as i64;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(format!("dim {dim} out of range for rank {rank}"));
    }
    Ok(d as usize)
}

/// Several dims normalized and sorted; an empty list means every dim (ATen's reduction rule).
pub fn norm_dims(dims: &[i64], rank: usize) -> R<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..rank).collect());
    }
    if rank == 0 {
        // A 0-d tensor accepts dim 0 / -1 and has nothing to reduce.
        for &d in dims {
            norm_dim(d, rank)?;
        }
        return Ok(vec![]);
    }
    let mut out = dims
        .iter()
        .map(|&d| norm_dim(d, rank))
        .collect::<R<Vec<_>>>()?;
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn float_bits_text(dtype: DType, v: f64) -> String {
    match dtype {
        DType::F64 => format!("0x{:016X}", v.to_bits()),
        _ => format!("0x{:08X}", (v as f32).to_bits()),
    }
}

/// Emits StableHLO ops into one block at one location.
#[derive(Clone, Copy)]
pub struct Builder<'a> {
    pub ctx: &'a Context,
    block: &'a Block<'a>,
    loc: Location<'a>,
    /// Per argument of `block`, whether it is a weight our product kernel keeps in AMX tiles'
    /// layout (`weights_kept_on_tiles`).
    kept_on_tiles: &'a [bool],
}

impl<'a> Builder<'a> {
    pub fn new(ctx: &'a Context, block: &'a Block<'a>, loc: Location<'a>, kept_on_tiles: &'a [bool]) -> Self {
        Builder { ctx, block, loc, kept_on_tiles }
    }

    pub fn with_location(self, loc: Location<'a>) -> Self {
        Builder { loc, ..self }
    }

    pub fn mlir_type(&self, ty: &TensorType) -> R<Type<'a>> {
        mlir_type(self.ctx, ty)
    }

    fn attr(&self, text: &str) -> R<Attribute<'a>> {
        Attribute::parse(self.ctx, text).ok_or_else(|| format!("cannot parse attribute {text}"))
    }

    /// The general op emitter: operands, attributes (as MLIR text), regions and result types.
    pub fn op_regions(
        &self,
        name: &str,
        operands: &[&Val<'a>],
        attrs: &[(&str, String)],
        regions: Vec<Region<'a>>,
        results: Vec<TensorType>,
    ) -> R<Vec<Val<'a>>> {
        let values: Vec<Value> = operands.iter().map(|v| v.v).collect();
        let types = results
            .iter()
            .map(|t| self.mlir_type(t))
            .collect::<R<Vec<_>>>()?;
        let attributes = attrs
            .iter()
            .map(|(k, v)| Ok((Identifier::new(self.ctx, k), self.attr(v)?)))
            .collect::<R<Vec<_>>>()?;
        let op = OperationBuilder::new(name, self.loc)
            .add_operands(&values)
            .add_attributes(&attributes)
            .add_regions_vec(regions)
            .add_results(&types)
            .build()
            .map_err(|e| format!("building {name}: {e}"))?;
        let op: OperationRef<'a, 'a> = self.block.append_operation(op);
        results
            .into_iter()
            .enumerate()
            .map(|(i, ty)| {
                let v = op.result(i).map_err(|e| e.to_string())?;
                Ok(Val { v: v.into(), ty })
            })
            .collect()
    }

    pub fn op(
        &self,
        name: &str,
        operands: &[&Val<'a>],
        attrs: &[(&str, String)],
        result: TensorType,
    ) -> R<Val<'a>> {
        Ok(self
            .op_regions(name, operands, attrs, vec![], vec![result])?
            .remove(0))
    }

    /// A one-block region whose arguments are 0-d tensors of `dtypes`; `body` returns the values
    /// to `stablehlo.return`.
    pub fn region<F>(&self, dtypes: &[DType], body: F) -> R<Region<'a>>
    where
        F: for<'x> FnOnce(Builder<'x>, Vec<Val<'x>>) -> R<Vec<Val<'x>>>,
    {
        let types: Vec<TensorType> = dtypes.iter().map(|&d| TensorType::new(d, vec![])).collect();
        self.region_of(&types, body)
    }

    /// A one-block region whose arguments have `types`; `body` returns the values to
    /// `stablehlo.return`.
    pub fn region_of<F>(&self, types: &[TensorType], body: F) -> R<Region<'a>>
    where
        F: for<'x> FnOnce(Builder<'x>, Vec<Val<'x>>) -> R<Vec<Val<'x>>>,
    {
        let args = types
            .iter()
            .map(|t| Ok((self.mlir_type(t)?, self.loc)))
            .collect::<R<Vec<_>>>()?;
        let block = Block::new(&args);
        {
            let inner = Builder {
                ctx: self.ctx,
                block: &block,
                loc: self.loc,
                kept_on_tiles: &[],
            };
            let vals = types
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    Ok(Val {
                        v: block.argument(i).map_err(|e| e.to_string())?.into(),
                        ty: t.clone(),
                    })
                })
                .collect::<R<Vec<_>>>()?;
            let ret = body(inner, vals)?;
            let ret: Vec<Value> = ret.iter().map(|v| v.v).collect();
            let op = OperationBuilder::new("stablehlo.return", self.loc)
                .add_operands(&ret)
                .build()
                .map_err(|e| e.to_string())?;
            block.append_operation(op);
        }
        let region = Region::new();
        region.append_block(block);
        Ok(region)
    }

    /// `stablehlo.while` over the loop state `init`: `cond` maps the state to a 0-d bool,
    /// `body` to the next state (same types). Every value a region uses is carried in the state.
    pub fn while_loop<C, F>(&self, init: &[&Val<'a>], cond: C, body: F) -> R<Vec<Val<'a>>>
    where
        C: for<'x> FnOnce(Builder<'x>, Vec<Val<'x>>) -> R<Val<'x>>,
        F: for<'x> FnOnce(Builder<'x>, Vec<Val<'x>>) -> R<Vec<Val<'x>>>,
    {
        let types: Vec<TensorType> = init.iter().map(|v| v.ty.clone()).collect();
        let c = self.region_of(&types, |b, s| Ok(vec![cond(b, s)?]))?;
        let f = self.region_of(&types, |b, s| {
            let next = body(b, s)?;
            if next.iter().map(|v| &v.ty).ne(types.iter()) {
                return Err("while: the body changes the loop state's types".into());
            }
            Ok(next)
        })?;
        self.op_regions("stablehlo.while", init, &[], vec![c, f], types)
    }

    /// `for i in 0..n { state = body(i, state) }` as a `while_loop`; `i` is a 0-d i64. The body
    /// sees only its loop state, so whatever it needs from outside is carried in `init`
    /// (returned unchanged).
    pub fn fori_loop<F>(&self, n: i64, init: &[&Val<'a>], body: F) -> R<Vec<Val<'a>>>
    where
        F: for<'x> FnOnce(Builder<'x>, Val<'x>, Vec<Val<'x>>) -> R<Vec<Val<'x>>>,
    {
        let counter = self.scalar(Scalar::Int(0), DType::I64)?;
        let mut state = vec![&counter];
        state.extend_from_slice(init);
        let mut out = self.while_loop(
            &state,
            |b, s| b.compare(&s[0], &b.scalar(Scalar::Int(n), DType::I64)?, "LT"),
            |b, mut s| {
                let i = s.remove(0);
                let next = b.add(&i, &b.scalar(Scalar::Int(1), DType::I64)?)?;
                let out = body(b, i, s)?;
                Ok(std::iter::once(next).chain(out).collect())
            },
        )?;
        out.remove(0);
        Ok(out)
    }

    // ---- constants ----

    /// A constant of type `ty` filled with `value` (converted as a cast in PyTorch would).
    pub fn splat(&self, value: Scalar, ty: &TensorType) -> R<Val<'a>> {
        let d = ty.dtype;
        if matches!(d, DType::F16 | DType::Bf16) {
            // MLIR parses half literals only as bit patterns; let XLA round an f32 constant.
            let wide = self.splat(value, &TensorType::new(DType::F32, ty.shape.clone()))?;
            return self.convert(&wide, d);
        }
        let text = match d {
            DType::Bool => (value.as_f64() != 0.0).to_string(),
            DType::F32 | DType::F64 => float_bits_text(d, value.as_f64()),
            DType::C64 => {
                // A Scalar is real: the constant is (value, 0).
                let part = TensorType::new(DType::F32, ty.shape.clone());
                let (re, im) = (
                    self.splat(value, &part)?,
                    self.splat(Scalar::Int(0), &part)?,
                );
                return self.complex(&re, &im);
            }
            _ => match value {
                Scalar::Float(f) => (f as i64).to_string(),
                Scalar::Int(i) => i.to_string(),
                Scalar::Bool(b) => (b as i64).to_string(),
            },
        };
        let attr = format!("dense<{text}> : {}", tensor_str(ty));
        self.op("stablehlo.constant", &[], &[("value", attr)], ty.clone())
    }

    /// An f32 constant of `shape` holding `values` (row-major), as the raw little-endian
    /// bytes MLIR's hex form takes, so every bit survives.
    pub fn constant_f32(&self, values: &[f32], shape: &[i64]) -> R<Val<'a>> {
        let ty = TensorType::new(DType::F32, shape.to_vec());
        if values.len() as i64 != ty.numel() {
            return Err(format!("{} values for a {} constant", values.len(), type_str(&ty)));
        }
        let hex: String = values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .map(|byte| format!("{byte:02X}"))
            .collect();
        let attr = format!("dense<\"0x{hex}\"> : {}", tensor_str(&ty));
        self.op("stablehlo.constant", &[], &[("value", attr)], ty)
    }

    /// A 1-D constant table of floats (f32 or f64, each value rounded to it).
    pub fn table(&self, values: &[f64], dtype: DType) -> R<Val<'a>> {
        if !matches!(dtype, DType::F32 | DType::F64) {
            return Err(format!("float table of {} is not supported", dtype.name()));
        }
        let ty = TensorType::new(dtype, vec![values.len() as i64]);
        let items: Vec<String> = values.iter().map(|&v| float_bits_text(dtype, v)).collect();
        let attr = format!("dense<[{}]> : {}", items.join(", "), tensor_str(&ty));
        self.op("stablehlo.constant", &[], &[("value", attr)], ty)
    }

    /// A 1-D i64 constant holding `values`.
    pub fn constant_i64(&self, values: &[i64]) -> R<Val<'a>> {
        let ty = TensorType::new(DType::I64, vec![values.len() as i64]);
        let items: Vec<String> = values.iter().map(i64::to_string).collect();
        let attr = format!("dense<[{}]> : {}", items.join(", "), tensor_str(&ty));
        self.op("stablehlo.constant", &[], &[("value", attr)], ty)
    }

    pub fn scalar(&self, value: Scalar, dtype: DType) -> R<Val<'a>> {
        self.splat(value, &TensorType::new(dtype, vec![]))
    }

    /// `value` as a tensor shaped like `like` (same dtype).
    pub fn full_like(&self, value: Scalar, like: &Val<'a>) -> R<Val<'a>> {
        self.splat(value, &like.ty)
    }

    /// Tensor operand as-is, number as a 0-d constant of `dtype`; then converted to `dtype`.
    pub fn materialize(&self, o: &Operand<'a>, dtype: DType) -> R<Val<'a>> {
        match o {
            Operand::Tensor(t) => self.convert(t, dtype),
            Operand::Scalar(s) => self.scalar(*s, dtype),
        }
    }

    pub fn iota(&self, ty: &TensorType, dim: usize) -> R<Val<'a>> {
        self.op(
            "stablehlo.iota",
            &[],
            &[("iota_dimension", format!("{dim} : i64"))],
            ty.clone(),
        )
    }

    // ---- type and shape changes ----

    /// Element type conversion with PyTorch cast semantics (to bool means `!= 0`).
    pub fn convert(&self, x: &Val<'a>, dtype: DType) -> R<Val<'a>> {
        if x.dtype() == dtype {
            return Ok(x.clone());
        }
        if dtype == DType::Bool {
            let zero = self.full_like(Scalar::Int(0), x)?;
            return self.compare(x, &zero, "NE");
        }
        self.op(
            "stablehlo.convert",
            &[x],
            &[],
            TensorType::new(dtype, x.ty.shape.clone()),
        )
    }

    /// `re + i*im` from two f32 tensors of one shape.
    pub fn complex(&self, re: &Val<'a>, im: &Val<'a>) -> R<Val<'a>> {
        if re.ty != im.ty || re.dtype() != DType::F32 {
            return Err(format!(
                "complex: parts must be f32 of one shape, got {} and {}",
                type_str(&re.ty),
                type_str(&im.ty)
            ));
        }
        let ty = TensorType::new(DType::C64, re.shape().to_vec());
        self.op("stablehlo.complex", &[re, im], &[], ty)
    }

    /// The real (`"real"`) or imaginary (`"imag"`) part of a complex tensor, as f32.
    pub fn complex_part(&self, part: &str, z: &Val<'a>) -> R<Val<'a>> {
        let ty = TensorType::new(DType::F32, z.shape().to_vec());
        self.op(&format!("stablehlo.{part}"), &[z], &[], ty)
    }

    /// Reinterprets the bits of each element as `dtype` (same width).
    pub fn bitcast(&self, x: &Val<'a>, dtype: DType) -> R<Val<'a>> {
        self.op(
            "stablehlo.bitcast_convert",
            &[x],
            &[],
            TensorType::new(dtype, x.ty.shape.clone()),
        )
    }

    pub fn reshape(&self, x: &Val<'a>, shape: &[i64]) -> R<Val<'a>> {
        if x.shape() == shape {
            return Ok(x.clone());
        }
        let n: i64 = shape.iter().product();
        if n != x.ty.numel() {
            return Err(format!("cannot reshape {} to {shape:?}", type_str(&x.ty)));
        }
        self.op(
            "stablehlo.reshape",
            &[x],
            &[],
            TensorType::new(x.dtype(), shape.to_vec()),
        )
    }

    pub fn transpose(&self, x: &Val<'a>, perm: &[usize]) -> R<Val<'a>> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x.clone());
        }
        let shape = perm.iter().map(|&p| x.shape()[p]).collect();
        let perm: Vec<i64> = perm.iter().map(|&p| p as i64).collect();
        self.op(
            "stablehlo.transpose",
            &[x],
            &[("permutation", i64_array(&perm))],
            TensorType::new(x.dtype(), shape),
        )
    }

    /// `broadcast_in_dim`: operand dim i becomes result dim `dims[i]`.
    pub fn broadcast_in_dim(&self, x: &Val<'a>, shape: &[i64], dims: &[usize]) -> R<Val<'a>> {
        self.broadcast_dims(x, shape, dims, &[])
    }

    fn broadcast_dims(&self, x: &Val<'a>, shape: &[i64], dims: &[usize], extra: &[(&str, String)]) -> R<Val<'a>> {
        for (i, &d) in dims.iter().enumerate() {
            if x.shape()[i] != 1 && x.shape()[i] != shape[d] {
                return Err(format!("cannot broadcast {} to {shape:?}", type_str(&x.ty)));
            }
        }
        let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let ty = TensorType::new(x.dtype(), shape.to_vec());
        let mut attrs = vec![("broadcast_dimensions", i64_array(&dims))];
        attrs.extend(extra.iter().cloned());
        self.op("stablehlo.broadcast_in_dim", &[x], &attrs, ty)
    }

    /// numpy-style broadcast to `shape` (trailing dims aligned).
    pub fn broadcast_to(&self, x: &Val<'a>, shape: &[i64]) -> R<Val<'a>> {
        self.broadcast_trailing(x, shape, &[])
    }

    /// `broadcast_to` that XLA keeps apart from identical broadcasts elsewhere in the module, for
    /// a value many layers share (a causal mask). XLA's CSE merges such broadcasts into one with
    /// a user per layer, and XLA:CPU's library fusions only take in an operand no one else uses,
    /// so the merged broadcast was materialized at full size every call (a `[B, H, L, S]` f32
    /// mask: 36 MiB at 1024 tokens and 9 heads) where each fusion can broadcast the small value
    /// itself. CSE skips an op carrying the `MUST_FUSE` frontend attribute, which asks for what
    /// we want anyway: the broadcast fused into its consumer.
    pub fn broadcast_to_each_use(&self, x: &Val<'a>, shape: &[i64]) -> R<Val<'a>> {
        let must_fuse = ("mhlo.frontend_attributes", r#"{MUST_FUSE = "true"}"#.to_string());
        self.broadcast_trailing(x, shape, &[must_fuse])
    }

    fn broadcast_trailing(&self, x: &Val<'a>, shape: &[i64], extra: &[(&str, String)]) -> R<Val<'a>> {
        if x.shape() == shape {
            return Ok(x.clone());
        }
        if x.rank() > shape.len() {
            return Err(format!("cannot broadcast {} to {shape:?}", type_str(&x.ty)));
        }
        let off = shape.len() - x.rank();
        self.broadcast_dims(x, shape, &(off..shape.len()).collect::<Vec<_>>(), extra)
    }

    /// Converts every operand to `dtype` and broadcasts them to their common shape.
    pub fn coerce(&self, operands: &[&Operand<'a>], dtype: DType) -> R<Vec<Val<'a>>> {
        let vals = operands
            .iter()
            .map(|o| self.materialize(o, dtype))
            .collect::<R<Vec<_>>>()?;
        let mut shape = vec![];
        for v in &vals {
            shape = broadcast_shapes(&shape, v.shape())?;
        }
        vals.iter().map(|v| self.broadcast_to(v, &shape)).collect()
    }

    /// Static strided slice; `limit` is exclusive and already clamped.
    pub fn slice(&self, x: &Val<'a>, start: &[i64], limit: &[i64], strides: &[i64]) -> R<Val<'a>> {
        let shape = (0..x.rank())
            .map(|i| ((limit[i] - start[i]).max(0) + strides[i] - 1) / strides[i])
            .collect();
        let attrs = [
            ("start_indices", i64_array(start)),
            ("limit_indices", i64_array(limit)),
            ("strides", i64_array(strides)),
        ];
        self.op(
            "stablehlo.slice",
            &[x],
            &attrs,
            TensorType::new(x.dtype(), shape),
        )
    }

    /// Slice `[start, limit)` with `step` along one dim; `x` itself when that is all of it.
    pub fn slice_dim(
        &self,
        x: &Val<'a>,
        dim: usize,
        start: i64,
        limit: i64,
        step: i64,
    ) -> R<Val<'a>> {
        if (start, limit, step) == (0, x.shape()[dim], 1) {
            return Ok(x.clone());
        }
        let mut starts = vec![0; x.rank()];
        let mut limits = x.shape().to_vec();
        let mut strides = vec![1; x.rank()];
        starts[dim] = start;
        limits[dim] = limit;
        strides[dim] = step;
        self.slice(x, &starts, &limits, &strides)
    }

    /// Pads each dim with `low`/`high` copies of the 0-d `fill` (negative amounts crop) and
    /// `interior` copies between elements.
    pub fn pad(
        &self,
        x: &Val<'a>,
        fill: &Val<'a>,
        low: &[i64],
        high: &[i64],
        interior: &[i64],
    ) -> R<Val<'a>> {
        let shape = (0..x.rank())
            .map(|i| low[i] + high[i] + x.shape()[i] + (x.shape()[i] - 1).max(0) * interior[i])
            .collect();
        let attrs = [
            ("edge_padding_low", i64_array(low)),
            ("edge_padding_high", i64_array(high)),
            ("interior_padding", i64_array(interior)),
        ];
        self.op(
            "stablehlo.pad",
            &[x, fill],
            &attrs,
            TensorType::new(x.dtype(), shape),
        )
    }

    pub fn reverse(&self, x: &Val<'a>, dims: &[usize]) -> R<Val<'a>> {
        let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        self.op(
            "stablehlo.reverse",
            &[x],
            &[("dimensions", i64_array(&dims))],
            x.ty.clone(),
        )
    }

    /// `x` with `update` written at the run-time offsets `starts` (0-d integers, one per
    /// dimension; clamped so the update fits, as StableHLO defines it).
    pub fn dynamic_update_slice(&self, x: &Val<'a>, update: &Val<'a>, starts: &[&Val<'a>]) -> R<Val<'a>> {
        let operands: Vec<&Val<'a>> = [x, update].into_iter().chain(starts.iter().copied()).collect();
        self.op("stablehlo.dynamic_update_slice", &operands, &[], x.ty.clone())
    }

    pub fn concat(&self, xs: &[&Val<'a>], dim: usize) -> R<Val<'a>> {
        if xs.len() == 1 {
            return Ok(xs[0].clone());
        }
        let mut shape = xs[0].shape().to_vec();
        shape[dim] = xs.iter().map(|x| x.shape()[dim]).sum();
        let ty = TensorType::new(xs[0].dtype(), shape);
        self.op(
            "stablehlo.concatenate",
            xs,
            &[("dimension", format!("{dim} : i64"))],
            ty,
        )
    }

    // ---- elementwise ----

    pub fn unary(&self, name: &str, x: &Val<'a>) -> R<Val<'a>> {
        self.op(&format!("stablehlo.{name}"), &[x], &[], x.ty.clone())
    }

    /// Same-typed binary op (operands must already agree in shape and dtype).
    pub fn binary(&self, name: &str, a: &Val<'a>, b: &Val<'a>) -> R<Val<'a>> {
        if a.ty != b.ty {
            return Err(format!(
                "{name}: operand types differ: {} vs {}",
                type_str(&a.ty),
                type_str(&b.ty)
            ));
        }
        self.op(&format!("stablehlo.{name}"), &[a, b], &[], a.ty.clone())
    }

    /// Binary op on two operands of the same dtype, broadcasting shapes.
    pub fn binary_bcast(&self, name: &str, a: &Val<'a>, b: &Val<'a>) -> R<Val<'a>> {
        let shape = broadcast_shapes(a.shape(), b.shape())?;
        self.binary(
            name,
            &self.broadcast_to(a, &shape)?,
            &self.broadcast_to(b, &shape)?,
        )
    }

    pub fn add(&self, a: &Val<'a>, b: &Val<'a>) -> R<Val<'a>> {
        self.binary_bcast("add", a, b)
    }
    pub fn sub(&self, a: &Val<'a>, b: &Val<'a>) -> R<Val<'a>> {
        self.binary_bcast("subtract", a, b)
    }
    pub fn mul(&self, a: &Val<'a>, b: &Val<'a>) -> R<Val<'a>> {
        self.binary_bcast("multiply", a, b)
    }
    pub fn div(&self, a: &Val<'a>, b: &Val<'a>) -> R<Val<'a>> {
        self.binary_bcast("divide", a, b)
    }

    /// `x * value` with `value` a constant of x's dtype.
    pub fn mul_scalar(&self, x: &Val<'a>, value: f64) -> R<Val<'a>> {
        self.binary("multiply", x, &self.full_like(Scalar::Float(value), x)?)
    }
    pub fn add_scalar(&self, x: &Val<'a>, value: f64) -> R<Val<'a>> {
        self.binary("add", x, &self.full_like(Scalar::Float(value), x)?)
    }

    /// Comparison of same-dtype operands (broadcast), bool result.
    pub fn compare(&self, a: &Val<'a>, b: &Val<'a>, direction: &str) -> R<Val<'a>> {
        let shape = broadcast_shapes(a.shape(), b.shape())?;
        let (a, b) = (self.broadcast_to(a, &shape)?, self.broadcast_to(b, &shape)?);
        if a.dtype() != b.dtype() {
            return Err(format!(
                "compare: dtypes differ: {} vs {}",
                type_str(&a.ty),
                type_str(&b.ty)
            ));
        }
        let kind = match a.dtype() {
            d if d.is_float() => "FLOAT",
            d if d.is_signed_integer() => "SIGNED",
            _ => "UNSIGNED",
        };
        let attrs = [
            (
                "comparison_direction",
                format!("#stablehlo<comparison_direction {direction}>"),
            ),
            (
                "compare_type",
                format!("#stablehlo<comparison_type {kind}>"),
            ),
        ];
        self.op(
            "stablehlo.compare",
            &[&a, &b],
            &attrs,
            TensorType::new(DType::Bool, shape),
        )
    }

    /// `pred ? a : b`, broadcasting all three.
    pub fn select(&self, pred: &Val<'a>, a: &Val<'a>, b: &Val<'a>) -> R<Val<'a>> {
        let shape = broadcast_shapes(&broadcast_shapes(pred.shape(), a.shape())?, b.shape())?;
        let p = self.broadcast_to(pred, &shape)?;
        let (a, b) = (self.broadcast_to(a, &shape)?, self.broadcast_to(b, &shape)?);
        let ty = a.ty.clone();
        self.op("stablehlo.select", &[&p, &a, &b], &[], ty)
    }

    /// Rows `a` `[.., K]` times a matrix stored `[N, K]` or `[K, N]` through one of our host
    /// kernels (`tpu_dynamo_runtime::host_kernels`), where the process's plugin has them, with
    /// the `extra` operands the kernels take (a bias `[N]`, a factor or a residual shaped as the
    /// result): `None` otherwise or for another layout.
    fn host_product(&self, kernels: Option<HostProduct>, a: &Val<'a>, b: &Val<'a>, extra: &[&Val<'a>], contract: (&[i64], &[i64]), out: DType) -> R<Option<Val<'a>>> {
        let (b, _, b_contract) = fold_transpose(b, &[], contract.1);
        let lhs_last = a.rank() as i64 - 1;
        let (Some(kernels), 2, [lhs]) = (kernels, b.rank(), contract.0) else { return Ok(None) };
        let (target, n) = match (b_contract.as_slice(), *lhs == lhs_last) {
            ([1], true) => (kernels.row_per_output, b.shape()[0]),
            ([0], true) => (kernels.row_per_input, b.shape()[1]),
            _ => return Ok(None),
        };
        let mut shape = a.shape()[..a.rank() - 1].to_vec();
        shape.push(n);
        if extra.iter().any(|t| (t.shape() != [n] && t.shape() != shape) || t.dtype() != out) {
            return Ok(None);
        }
        let operands: Vec<&Val<'a>> = [a, &b].into_iter().chain(extra.iter().copied()).collect();
        Ok(Some(self.host_call(target, &operands, vec![TensorType::new(out, shape)])?.remove(0)))
    }

    /// `a @ b` (`a` `[M, K]`, `b` `[K, N]`) finished as `kernels` finish it with `extra` (a bias
    /// `[N]`, a factor `[M, N]`, a bias and a residual `[M, N]`), as one call of our product
    /// kernel (f32, or bf16 on the tiles), where `dot_general` would give this product to it:
    /// `None` otherwise.
    pub fn host_product_then(&self, kernels: Option<HostProduct>, a: &Val<'a>, b: &Val<'a>, extra: &[&Val<'a>]) -> R<Option<Val<'a>>> {
        let contract: (&[i64], &[i64]) = (&[1], &[0]);
        let out = a.dtype();
        let ours = match out {
            DType::F32 => self.f32_product_for_both_cores(a, b, (&[], &[]), contract, out),
            DType::Bf16 => self.bf16_product_on_tiles(a, b, (&[], &[]), contract, out),
            _ => false,
        };
        if a.rank() != 2 || !ours {
            return Ok(None);
        }
        self.host_product(kernels, a, b, extra, contract, out)
    }

    /// A typed-FFI custom call of one of our host kernels, registered under `target`.
    pub fn host_call(&self, target: &str, operands: &[&Val<'a>], results: Vec<TensorType>) -> R<Vec<Val<'a>>> {
        let attrs = [
            ("call_target_name", format!("\"{target}\"")),
            ("api_version", "4 : i32".to_string()),
            ("backend_config", "{}".to_string()),
        ];
        self.op_regions("stablehlo.custom_call", operands, &attrs, vec![], results)
    }

    // ---- reductions ----

    /// Reduces `dims` (sorted, unique) with `combiner`; `keepdim` keeps them as size 1. A 0-d
    /// tensor has no dims to reduce: ATen accepts dim 0 (or -1) there and reduces nothing.
    pub fn reduce(
        &self,
        x: &Val<'a>,
        dims: &[usize],
        combiner: Combiner,
        keepdim: bool,
    ) -> R<Val<'a>> {
        let out = self.reduce_as_backend(x, dims, combiner, keepdim)?;
        if !matches!(combiner, Combiner::Max | Combiner::Min)
            || !x.dtype().is_float()
            || x.rank() == 0
        {
            return Ok(out);
        }
        // XLA's CPU reductions drop NaN whatever the region says, so NaN is found apart.
        let nan = self.reduce(&self.compare(x, x, "NE")?, dims, Combiner::Or, keepdim)?;
        self.select(&nan, &self.full_like(Scalar::Float(f64::NAN), &out)?, &out)
    }

    /// `reduce` without its separate NaN pass for float max/min, whose NaN handling is then
    /// the backend's (XLA:CPU drops NaN): for callers whose result turns NaN anyway when an
    /// input is NaN, saving a compare and a reduction over the whole input.
    pub fn reduce_as_backend(
        &self,
        x: &Val<'a>,
        dims: &[usize],
        combiner: Combiner,
        keepdim: bool,
    ) -> R<Val<'a>> {
        if x.rank() == 0 {
            return Ok(x.clone());
        }
        let d = x.dtype();
        let init = self.scalar(combiner.identity(d), d)?;
        let region = self.region(&[d, d], |b, args| {
            Ok(vec![b.binary(combiner.op(), &args[0], &args[1])?])
        })?;
        let kept: Vec<i64> = (0..x.rank())
            .filter(|i| !dims.contains(i))
            .map(|i| x.shape()[i])
            .collect();
        let dims_i: Vec<i64> = dims.iter().map(|&i| i as i64).collect();
        let out = self
            .op_regions(
                "stablehlo.reduce",
                &[x, &init],
                &[("dimensions", i64_array(&dims_i))],
                vec![region],
                vec![TensorType::new(d, kept)],
            )?
            .remove(0);
        if keepdim {
            self.reshape(&out, &keep_dims_shape(x.shape(), dims))
        } else {
            Ok(out)
        }
    }

    /// `reduce_window` of `x` with `combiner`, per-dim window sizes, strides and (low, high)
    /// padding by the combiner's identity.
    pub fn reduce_window(
        &self,
        x: &Val<'a>,
        combiner: Combiner,
        window: &[i64],
        strides: &[i64],
        pads: &[(i64, i64)],
    ) -> R<Val<'a>> {
        let d = x.dtype();
        let init = self.scalar(combiner.identity(d), d)?;
        let region = self.region(&[d, d], |b, a| Ok(vec![b.combine(combiner, &a[0], &a[1])?]))?;
        let shape = (0..x.rank())
            .map(|i| (x.shape()[i] + pads[i].0 + pads[i].1 - window[i]) / strides[i] + 1)
            .collect();
        let attrs = [
            ("window_dimensions", i64_array(window)),
            ("window_strides", i64_array(strides)),
            ("padding", padding_attr(pads)),
        ];
        Ok(self
            .op_regions(
                "stablehlo.reduce_window",
                &[x, &init],
                &attrs,
                vec![region],
                vec![TensorType::new(d, shape)],
            )?
            .remove(0))
    }

    /// `dot_general` with explicit batch/contracting dims; result element type `out` (lets bf16
    /// inputs accumulate in f32 as PyTorch's CPU matmuls do).
    pub fn dot_general(
        &self,
        a: &Val<'a>,
        b: &Val<'a>,
        batch: (&[i64], &[i64]),
        contract: (&[i64], &[i64]),
        out: DType,
    ) -> R<Val<'a>> {
        let rows = bf16_rows_times_matrix(a, b, batch, contract, out);
        if rows.is_some_and(|rows| rows <= HOST_MATVEC_MAX_ROWS) {
            if let Some(product) = self.host_product(lowering_target().host_matvec, a, b, &[], contract, out)? {
                return Ok(product);
            }
        }
        if self.f32_product_for_both_cores(a, b, batch, contract, out) {
            if let Some(product) = self.host_product(lowering_target().host_gemm, a, b, &[], contract, out)? {
                return Ok(product);
            }
        }
        if self.bf16_product_on_tiles(a, b, batch, contract, out) {
            if let Some(product) = self.host_product(lowering_target().host_bf16_gemm, a, b, &[], contract, out)? {
                return Ok(product);
            }
        }
        self.xla_dot_general(a, b, batch, contract, out)
    }

    /// Whether `dot_general(a, b)` is bf16 rows times a bf16 weight kept as tiles, which our
    /// kernel multiplies on AMX or AVX-512 BF16 (from as few rows and flops as f32 ones),
    /// summing in f32 and rounding once to a bf16 result itself: then a bf16 product needs no
    /// f32 one converted.
    pub fn bf16_product_on_tiles(&self, a: &Val<'a>, b: &Val<'a>, batch: (&[i64], &[i64]), contract: (&[i64], &[i64]), out: DType) -> bool {
        bf16_rows_times_matrix(a, b, batch, contract, out).is_some_and(|rows| self.bf16_rows_on_tiles(rows, b, batch.1, contract.1))
    }

    /// Whether `rows` bf16 rows times the bf16 weight `w` (with its batch and contracting dims)
    /// is a product our kernel takes on the tiles: enough rows and flops, and `w` kept there.
    pub fn bf16_rows_on_tiles(&self, rows: i64, w: &Val<'a>, batch: &[i64], contract: &[i64]) -> bool {
        lowering_target().host_bf16_gemm.is_some()
            && rows >= HOST_GEMM_MIN_ROWS
            && 2 * rows * w.ty.numel() >= *HOST_GEMM_FLOPS.start()
            && self.kept_on_tiles(w, batch, contract)
    }

    /// `dot_general` as XLA's own product, never one of our host kernels.
    pub fn xla_dot_general(
        &self,
        a: &Val<'a>,
        b: &Val<'a>,
        batch: (&[i64], &[i64]),
        contract: (&[i64], &[i64]),
        out: DType,
    ) -> R<Val<'a>> {
        let rows = bf16_rows_times_matrix(a, b, batch, contract, out);
        if rows == Some(1) && b.ty.numel() >= 1 << 16 {
            // Without our kernel: XLA:CPU gives a bf16 product to its bf16 GEMM (YNNPACK) only
            // when neither side is a vector; a vector times a matrix it computes in f32 after
            // converting the whole matrix to f32, on every call. Two equal rows make it a GEMM:
            // a bf16 LM head of 49152 x 576 took 9.5-10.2 ms that way, 3.7-3.9 ms as two rows
            // (PyTorch's 2.8-3.2 ms). The first row is the product. Other plugins get the same
            // two rows: a product this size is bound by reading the matrix, which two rows read
            // once as one does.
            let rows: Vec<i64> = std::iter::once(2).chain(a.shape().iter().copied()).collect();
            let a2 = self.broadcast_in_dim(a, &rows, &(1..rows.len()).collect::<Vec<_>>())?;
            let contract2: Vec<i64> = contract.0.iter().map(|d| d + 1).collect();
            let both = self.dot_general(&a2, b, batch, (&contract2, contract.1), out)?;
            let first = self.slice_dim(&both, 0, 0, 1, 1)?;
            return self.reshape(&first, &both.shape()[1..]);
        }
        let (a, a_batch, a_contract) = fold_transpose(a, batch.0, contract.0);
        let (b, b_batch, b_contract) = fold_transpose(b, batch.1, contract.1);
        let (a, b) = (&a, &b);
        let batch = (a_batch.as_slice(), b_batch.as_slice());
        let contract = (a_contract.as_slice(), b_contract.as_slice());
        let mut shape: Vec<i64> = batch.0.iter().map(|&i| a.shape()[i as usize]).collect();
        shape.extend(free_sizes(a, batch.0, contract.0));
        shape.extend(free_sizes(b, batch.1, contract.1));
        for (&i, &j) in contract
            .0
            .iter()
            .zip(contract.1)
            .chain(batch.0.iter().zip(batch.1))
        {
            if a.shape()[i as usize] != b.shape()[j as usize] {
                return Err(format!(
                    "dot: {} and {} disagree on dims {i}/{j}",
                    type_str(&a.ty),
                    type_str(&b.ty)
                ));
            }
        }
        let dn = format!(
            "#stablehlo.dot<lhs_batching_dimensions = {}, rhs_batching_dimensions = {}, lhs_contracting_dimensions = {}, rhs_contracting_dimensions = {}>",
            list(batch.0),
            list(batch.1),
            list(contract.0),
            list(contract.1)
        );
        // PyTorch multiplies f32 matrices in f32 unless told otherwise
        // (`torch.get_float32_matmul_precision() == "highest"`); XLA:GPU's default precision
        // would use TF32 (10-bit mantissas) on an Ampere or later GPU: 2e-4 off on a small MLP.
        let precision = "[#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]".to_string();
        let f32_operands = a.dtype() == DType::F32 && b.dtype() == DType::F32;
        let attrs = [("dot_dimension_numbers", dn), ("precision_config", precision)];
        self.op(
            "stablehlo.dot_general",
            &[a, b],
            &attrs[..if f32_operands { 2 } else { 1 }],
            TensorType::new(out, shape),
        )
    }
}

/// Index-space layout shared by `gather` and `scatter`: how the index vector and the window
/// (slice) dims map onto the operand.
pub struct IndexMap {
    /// Result (gather) / update (scatter) dims that are window dims.
    pub window_dims: Vec<i64>,
    /// Operand dims of size 1 that the window drops.
    pub collapsed: Vec<i64>,
    pub index_to_operand: Vec<i64>,
    pub index_vector_dim: usize,
}

impl IndexMap {
    /// The dimension-numbers attribute; gather and scatter name the same fields differently.
    fn attr(&self, scatter: bool) -> String {
        let [kind, window, collapsed, to_operand] = if scatter {
            [
                "scatter",
                "update_window_dims",
                "inserted_window_dims",
                "scatter_dims_to_operand_dims",
            ]
        } else {
            [
                "gather",
                "offset_dims",
                "collapsed_slice_dims",
                "start_index_map",
            ]
        };
        format!(
            "#stablehlo.{kind}<{window} = {}, {collapsed} = {}, {to_operand} = {}, index_vector_dim = {}>",
            list(&self.window_dims),
            list(&self.collapsed),
            list(&self.index_to_operand),
            self.index_vector_dim
        )
    }
}

impl<'a> Builder<'a> {
    /// `stablehlo.gather` with `slice_sizes`, producing `shape`.
    pub fn gather(
        &self,
        x: &Val<'a>,
        idx: &Val<'a>,
        map: &IndexMap,
        slice_sizes: &[i64],
        shape: Vec<i64>,
    ) -> R<Val<'a>> {
        let attrs = [
            ("dimension_numbers", map.attr(false)),
            ("slice_sizes", i64_array(slice_sizes)),
            ("indices_are_sorted", "false".into()),
        ];
        self.op(
            "stablehlo.gather",
            &[x, idx],
            &attrs,
            TensorType::new(x.dtype(), shape),
        )
    }

    /// `c(p, q)`, float max/min propagating NaN as PyTorch's do (XLA's CPU backend may
    /// lower `maximum`/`minimum` to instructions that drop it).
    pub fn combine(&self, c: Combiner, p: &Val<'a>, q: &Val<'a>) -> R<Val<'a>> {
        let y = self.binary(c.op(), p, q)?;
        if !matches!(c, Combiner::Max | Combiner::Min) || !p.dtype().is_float() {
            return Ok(y);
        }
        let y = self.select(&self.compare(q, q, "NE")?, q, &y)?;
        self.select(&self.compare(p, p, "NE")?, p, &y)
    }

    /// Scatter `updates` into `x`: each update replaces its target, or is folded into it with
    /// `combine` (sums of bools are `or`, as PyTorch's accumulating bool scatters are).
    pub fn scatter(
        &self,
        x: &Val<'a>,
        idx: &Val<'a>,
        updates: &Val<'a>,
        map: &IndexMap,
        combine: Option<Combiner>,
    ) -> R<Val<'a>> {
        let d = x.dtype();
        let combine = match combine {
            Some(Combiner::Add) if d == DType::Bool => Some(Combiner::Or),
            c => c,
        };
        let region = self.region(&[d, d], |b, a| {
            Ok(vec![match combine {
                Some(c) => b.combine(c, &a[0], &a[1])?,
                None => a[1].clone(),
            }])
        })?;
        let attrs = [
            ("scatter_dimension_numbers", map.attr(true)),
            ("indices_are_sorted", "false".into()),
            ("unique_indices", "false".into()),
        ];
        let updates = self.convert(updates, d)?;
        Ok(self
            .op_regions(
                "stablehlo.scatter",
                &[x, idx, &updates],
                &attrs,
                vec![region],
                vec![x.ty.clone()],
            )?
            .remove(0))
    }
}

/// The permutation that undoes `perm` (as given to `transpose`).
pub fn inverse_perm(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

/// `shape` with the reduced `dims` set to 1.
pub fn keep_dims_shape(shape: &[i64], dims: &[usize]) -> Vec<i64> {
    shape
        .iter()
        .enumerate()
        .map(|(i, &s)| if dims.contains(&i) { 1 } else { s })
        .collect()
}

/// What the plugin that compiles the lowered graphs offers the lowering, set by whoever
/// creates the client (before that, for a graph lowered without one: neither).
#[derive(Clone, Copy, Debug)]
pub struct LoweringTarget {
    /// The plugin is XLA:CPU: some ops get a form its code generator vectorizes (`trig`).
    pub cpu: bool,
    /// The custom call targets of host kernels for a bf16 vector times a matrix, where the
    /// plugin has them registered.
    pub host_matvec: Option<HostProduct>,
    /// The same for f32 products of a few MFLOP, split over the host's cores.
    pub host_gemm: Option<HostProduct>,
    /// The same for bf16 rows times a weight kept as tiles (`weights_kept_on_tiles`), and
    /// adding a bf16 bias `[N]` to the f32 sums before rounding.
    pub host_bf16_gemm: Option<HostProduct>,
    pub host_bf16_gemm_bias: Option<HostProduct>,
    /// The same with the tanh GELU of the rounded sums after the bias (eager's `gelu(addmm)`).
    pub host_bf16_gemm_bias_gelu_tanh: Option<HostProduct>,
    /// The same with SiLU of the rounded sums, times a bf16 factor of the result's shape.
    pub host_bf16_gemm_silu_times: Option<HostProduct>,
    /// The f32 products adding a bias `[N]`, and then the tanh GELU.
    pub host_gemm_bias: Option<HostProduct>,
    pub host_gemm_bias_gelu_tanh: Option<HostProduct>,
    /// The same products with SiLU applied, times a factor of the result's shape.
    pub host_gemm_silu_times: Option<HostProduct>,
    /// The same products with a residual of the result's shape added last, without and with a
    /// bias `[N]` before it.
    pub host_gemm_plus: Option<HostProduct>,
    pub host_gemm_bias_plus: Option<HostProduct>,
    /// The custom call targets of a host kernel for f32 attention without a mask and with
    /// the causal one, where the plugin has them registered.
    pub host_attention: Option<(&'static str, &'static str)>,
    /// The same for bf16 attention in the tiles' layouts (AMX or AVX-512 BF16).
    pub host_bf16_attention: Option<(&'static str, &'static str)>,
    /// The custom call target of a host kernel for f32 convolutions of 3×3 windows, stride 1,
    /// padding 1.
    pub host_conv3x3: Option<&'static str>,
    /// The custom call targets of bf16 convolutions' windows times their weight kept on the
    /// tiles, without and with a bias.
    pub host_bf16_conv: Option<(&'static str, &'static str)>,
    /// The custom call target of a host kernel for bf16 convolutions of 3×3 windows, stride 1,
    /// padding 1, the channels in pairs.
    pub host_bf16_conv3x3: Option<&'static str>,
    /// The custom call targets of host kernels for f32 LayerNorm and RMSNorm over the last dim.
    pub host_layer_norm: Option<&'static str>,
    pub host_rms_norm: Option<&'static str>,
    /// The same over bf16 rows into bf16.
    pub host_bf16_layer_norm: Option<&'static str>,
    pub host_bf16_rms_norm: Option<&'static str>,
    /// The custom call target of a host kernel for f32 rotary position embeddings.
    pub host_rotary: Option<&'static str>,
    /// Where the product kernels run in the tiles' layouts (bf16 ones on AMX tiles or AVX-512
    /// BF16's vectors): the bytes of weights' pieces the runtime keeps for them
    /// (`weights_kept_on_tiles`).
    pub host_gemm_tiles_budget: Option<u64>,
    /// How f32 products of long contractions run on our kernel from a weight it keeps packed
    /// (`weights_kept_on_tiles`), where they do.
    pub host_f32_gemm_kept: Option<KeptF32>,
}

/// How our product kernel keeps an f32 weight for contractions longer than `HOST_GEMM_MAX_K`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeptF32 {
    /// As three bf16 pieces of each value, on AMX tiles (any K).
    Tiles,
    /// As f32 panels, on AVX-512's vectors (K up to `F32_PANELS_MAX_K`).
    Panels,
}

impl KeptF32 {
    /// The bytes the runtime keeps per value of the weight.
    fn bytes(self) -> i64 {
        match self {
            KeptF32::Tiles => 6,
            KeptF32::Panels => 4,
        }
    }
}

pub static LOWERING_TARGET: RwLock<LoweringTarget> = RwLock::new(LoweringTarget {
    cpu: false,
    host_matvec: None,
    host_gemm: None,
    host_bf16_gemm: None,
    host_bf16_gemm_bias: None,
    host_bf16_gemm_bias_gelu_tanh: None,
    host_bf16_gemm_silu_times: None,
    host_gemm_bias: None,
    host_gemm_bias_gelu_tanh: None,
    host_gemm_silu_times: None,
    host_gemm_plus: None,
    host_gemm_bias_plus: None,
    host_attention: None,
    host_bf16_attention: None,
    host_conv3x3: None,
    host_bf16_conv: None,
    host_bf16_conv3x3: None,
    host_layer_norm: None,
    host_bf16_layer_norm: None,
    host_rms_norm: None,
    host_bf16_rms_norm: None,
    host_rotary: None,
    host_gemm_tiles_budget: None,
    host_f32_gemm_kept: None,
});

pub fn lowering_target() -> LoweringTarget {
    *LOWERING_TARGET.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A host kernel's target per weight layout: `[N, K]` (a row per output, `x @ W.T`) and
/// `[K, N]` (a row per input, `x @ W`).
#[derive(Clone, Copy, Debug)]
pub struct HostProduct {
    pub row_per_output: &'static str,
    pub row_per_input: &'static str,
}

/// Rows of `a` up to which a bf16 product goes to the host kernel (a few prompts decoded
/// together), which reads each weight row once for all of them where YNNPACK's GEMM packs the
/// whole weight first: `[4, 576] x [576, 1536]` 48-60 against 47-77 µs, `[4, 576] x [576,
/// 49152]` 1543-2877 against 3169-3420. At eight rows the two are even (a step decoding eight
/// prompts: 40.6 against 39.2 ms), so XLA keeps them.
const HOST_MATVEC_MAX_ROWS: i64 = 4;

/// The f32 products our host kernel takes. XLA:CPU's YNNPACK runs those below ~16 MFLOP on one
/// core and splits larger ones its own way; ours, on XLA's threads, ran products of short
/// contractions faster (bare executes, µs: `[128, 64] x [64, 172]` 37-38 → 22, `[1024, 64] x
/// [64, 256]` 219-240 → 147-151, `[2048, 128] x [128, 128]` 356-359 → 262-272, `[1024, 64] x
/// [64, 1000]` 697-714 → 648-656) but longer ones slower with the weight packed on every call,
/// its `[K, 32]` panel no longer in L1 (`[128, 576] x [576, 576]` 429 → 505-531, `[4096, 320] x
/// [320, 320]` 3419-3477 → 3964-3987; a kept weight's panels: `F32_PANELS_MAX_K`). Few rows
/// do not pay for copying the weight into panels on every call (`[32, 256] x [256, 1024]`
/// 150-188 → 184-204, `[8, ..]` 80-89 → 100-112), nor does one row, bound by reading the
/// weight, which XLA's vector kernel does faster still.
const HOST_GEMM_FLOPS: std::ops::RangeInclusive<i64> = (1 << 18)..=(1 << 27);
const HOST_GEMM_MAX_K: i64 = 256;
const HOST_GEMM_MIN_ROWS: i64 = 64;

/// Columns below which a weight kept on tiles still keeps XLA's product for a long contraction:
/// one block of 32 columns is the runtime's vector kernel, whose panel no longer fits L1.
const TILES_MIN_COLUMNS: i64 = 64;

/// Contractions up to which an f32 weight kept as panels (`KeptF32::Panels`: AVX-512 without
/// AMX) runs on our vector kernel. On an AMD EPYC (Zen 4), against XLA's YNNPACK in one process,
/// taking turns (bare executes, µs): `[128, 576] x [576, 576]` 467 → 424, `[128, 1536] x [1536,
/// 576]` 1230 → 1103, `[1024, 1536] x [1536, 576]` 9257 → 7969, `[1024, 576] x [576, 576]` 3414
/// → 3176, `[128, 768] x [768, 2304]` 2262 → 2228; at K 3072 slower, `[128, 3072] x [3072,
/// 768]` 3106 → 3223 (its panel, 384 KiB, shares L2 with the rows).
const F32_PANELS_MAX_K: i64 = 2048;

/// Per graph input, whether our product kernels may take a product with it as the weight that
/// only the layouts they keep it in run faster than XLA: an f32 one of a long contraction (as
/// `KeptF32` says), or a bf16 one. On AMX they
/// run those from the weight's bf16 pieces, kept between calls, which only a parameter's
/// matrix is sure to be: a buffer may be one a compiled step updates in place, and a constant
/// may be a value computed from weights (`hoist.py`), both read as they are, not kept (under
/// autocast, SmolLM-135M's bf16 copies of its weights packed on every call: 72 → 263 ms). f32 products ran 1.4-2 times as fast as XLA's (bare
/// executes, ms: `[128, 768] x [768, 3072]` 2.41-2.46 → 1.21-1.26, `[128, 3072] x [3072, 768]`
/// 2.52 → 1.52-1.69, `[1024, 576] x [576, 576]` 2.79-2.88 → 1.36-1.46, GPT-2 small's LM head
/// `[128, 768] x [768, 50257]` 41.3-41.6 → 27.1-27.6; GPT-2 small's forward 157-160 → 112-116),
/// bf16 ones ~1.3 times (`[1024, 1536] x [1536, 6144]` 14.3 → 10.7). Where the pieces of all the
/// graph's resident matrices would not fit the runtime's budget for them
/// (`host_gemm_tiles_budget`), none is: an f32 product routed here whose pieces found the budget
/// spent would run on the vector kernel packing its panels on every call, a bf16 one its pieces.
pub fn weights_kept_on_tiles(inputs: &[Input], budget: Option<u64>, f32_kept: Option<KeptF32>) -> Vec<bool> {
    let kept_dtype = |dtype| dtype == DType::Bf16 || (f32_kept.is_some() && dtype == DType::F32);
    // A bf16 convolution's weight (`[O, C, *kernel]`) is read as the matrix `[O, C·K]`.
    let matrix = |i: &Input| {
        i.kind == InputKind::Parameter && kept_dtype(i.ty.dtype) && (i.ty.rank() == 2 || (i.ty.dtype == DType::Bf16 && i.ty.rank() > 2))
    };
    // A bf16 value is its own piece.
    let f32_bytes = f32_kept.map_or(0, KeptF32::bytes);
    let pieces_bytes: i64 = inputs.iter().filter(|i| matrix(i)).map(|i| if i.ty.dtype == DType::F32 { f32_bytes } else { 2 } * i.ty.numel()).sum();
    let fits = budget.is_some_and(|budget| pieces_bytes as u64 <= budget);
    inputs.iter().map(|i| fits && matrix(i)).collect()
}

impl<'a> Builder<'a> {
    /// Whether `dot_general(a, b)` is f32 rows (no batch dims) times an f32 matrix our product
    /// kernel takes: of a size `HOST_GEMM_FLOPS`, `HOST_GEMM_MAX_K` and `HOST_GEMM_MIN_ROWS`
    /// admit, or of any K (up to `F32_PANELS_MAX_K` as panels) where `b` is a weight kept
    /// packed (`weights_kept_on_tiles`).
    fn f32_product_for_both_cores(&self, a: &Val<'a>, b: &Val<'a>, batch: (&[i64], &[i64]), contract: (&[i64], &[i64]), out: DType) -> bool {
        if a.dtype() != DType::F32 || b.dtype() != DType::F32 || out != DType::F32 || !batch.0.is_empty() || b.rank() != 2 {
            return false;
        }
        let rows: i64 = free_sizes(a, batch.0, contract.0).iter().product();
        let k: i64 = contract.0.iter().map(|&d| a.shape()[d as usize]).product();
        let n: i64 = free_sizes(b, batch.1, contract.1).iter().product();
        let flops = 2 * a.ty.numel() * n;
        let sized = k <= HOST_GEMM_MAX_K && HOST_GEMM_FLOPS.contains(&flops);
        let contraction_kept = lowering_target().host_f32_gemm_kept != Some(KeptF32::Panels) || k <= F32_PANELS_MAX_K;
        let on_tiles = || flops >= *HOST_GEMM_FLOPS.start() && n >= TILES_MIN_COLUMNS && contraction_kept && self.kept_on_tiles(b, batch.1, contract.1);
        (rows >= HOST_GEMM_MIN_ROWS && sized) || ((rows >= HOST_GEMM_MIN_ROWS || any_rows_on_panels()) && on_tiles())
    }

    /// Whether the product weight `b` (with its batch and contracting dims), or the value it is
    /// a transpose of, is an argument of this builder's block that our product kernel keeps on
    /// tiles.
    fn kept_on_tiles(&self, b: &Val<'a>, batch: &[i64], contract: &[i64]) -> bool {
        let (w, _, _) = fold_transpose(b, batch, contract);
        BlockArgument::try_from(w.v).is_ok_and(|arg| {
            arg.owner().to_raw().ptr == self.block.to_raw().ptr && self.kept_on_tiles.get(arg.argument_number()).copied().unwrap_or(false)
        })
    }
}

/// Whether a product of a weight kept as f32 panels (AVX-512 without AMX here) runs on our
/// vector kernel however few its rows (`HOST_GEMM_MIN_ROWS` is for weights packed on every
/// call): a decode step's, or a short prompt's. XLA ran a matrix-vector product, or a GEMM below
/// ~16 MFLOP, on one thread; bound by reading the weight, the kernel reads the panels faster, and
/// splits a wide one's columns between both threads where its rows are one unit (the runtime's
/// `SPLIT_COLUMNS_MAX_ROWS`). SmolLM-135M without its head (bare executes in turns, AMD EPYC): a
/// decode step of one prompt 22.9-25.7 ms on XLA's, 20.0-21.4 on ours alone, 15.2-20.5 split, of
/// eight prompts 51.2-60.7 → 24.3-29.1; a 16-token prompt 48.2-52.4 → 27.3-31.6, a 40-token one
/// 76.2-82.1 → 52.3-53.9. A product below `HOST_GEMM_FLOPS` (a tiny model's) keeps XLA's: ours ran
/// a tiny Llama's step no faster (bench/RESULTS.md, "Forty-ninth session").
fn any_rows_on_panels() -> bool {
    lowering_target().host_f32_gemm_kept == Some(KeptF32::Panels)
}

/// The rows of `a` when `dot_general(a, b)` multiplies bf16 rows (no batch dims; the product of
/// `a`'s free dims, 1 for a vector) by a bf16 matrix (accumulated in f32 either way, a bf16
/// product as well).
fn bf16_rows_times_matrix(
    a: &Val<'_>,
    b: &Val<'_>,
    batch: (&[i64], &[i64]),
    contract: (&[i64], &[i64]),
    out: DType,
) -> Option<i64> {
    let matrix = a.dtype() == DType::Bf16
        && b.dtype() == DType::Bf16
        && matches!(out, DType::F32 | DType::Bf16)
        && batch.0.is_empty()
        && free_sizes(b, batch.1, contract.1).iter().product::<i64>() > 1;
    matrix.then(|| free_sizes(a, batch.0, contract.0).iter().product())
}

/// The sizes of a dot operand's free dims (neither batch nor contracting), in order: the
/// product's dims after the batch dims.
fn free_sizes(x: &Val<'_>, batch: &[i64], contract: &[i64]) -> Vec<i64> {
    (0..x.rank() as i64)
        .filter(|d| !batch.contains(d) && !contract.contains(d))
        .map(|d| x.shape()[d as usize])
        .collect()
}

/// A dot operand `x` as the value it was transposed from, with `x`'s batch and contracting dims
/// renamed to that value's dims, when `x = transpose(m, perm)` keeps `x`'s free dims in `m`'s
/// order (so the result is unchanged). XLA:CPU otherwise materializes the transpose: for
/// `x @ W.T`, every Linear layer, that was a copy of the weight on every call.
fn fold_transpose<'a>(x: &Val<'a>, batch: &[i64], contract: &[i64]) -> (Val<'a>, Vec<i64>, Vec<i64>) {
    let unchanged = || (x.clone(), batch.to_vec(), contract.to_vec());
    let Some((m, perm)) = transpose_source(x) else { return unchanged() };
    let rename = |dims: &[i64]| dims.iter().map(|&d| perm[d as usize]).collect::<Vec<_>>();
    let free = (0..x.rank() as i64)
        .filter(|d| !batch.contains(d) && !contract.contains(d))
        .map(|d| perm[d as usize])
        .collect::<Vec<_>>();
    if free.windows(2).any(|w| w[0] > w[1]) {
        return unchanged();
    }
    (m, rename(batch), rename(contract))
}

/// `(m, perm)` when `x` was built as `stablehlo.transpose(m)` with `permutation = perm`.
fn transpose_source<'a>(x: &Val<'a>) -> Option<(Val<'a>, Vec<i64>)> {
    let op = OperationResult::try_from(x.v).ok()?.owner();
    if op.name().as_string_ref().as_str().ok()? != "stablehlo.transpose" {
        return None;
    }
    // Printed as `array<i64: 1, 0>`.
    let text = op.attribute("permutation").ok()?.to_string();
    let perm = text
        .split_once(':')?
        .1
        .trim_end_matches('>')
        .split(',')
        .map(|p| p.trim().parse::<i64>().ok().filter(|&p| (p as usize) < x.rank()))
        .collect::<Option<Vec<_>>>()?;
    if perm.len() != x.rank() {
        return None;
    }
    let mut shape = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        shape[p as usize] = x.shape()[i];
    }
    Some((Val { v: op.operand(0).ok()?, ty: TensorType::new(x.dtype(), shape) }, perm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use DType::*;

    /// Only parameters' f32 and bf16 matrices (f32 ones only where our kernel keeps them) and
    /// bf16 convolutions' weights, and none where their pieces (6 bytes an f32 value on AMX, 4
    /// as panels, 2 a bf16 one) pass the budget.
    #[test]
    fn weights_kept_on_tiles_are_parameters_matrices_within_the_budget() {
        let input = |dtype, shape: Vec<i64>, kind| Input { ty: TensorType::new(dtype, shape), kind };
        let inputs = [
            input(F32, vec![128, 768], InputKind::User),
            input(F32, vec![768, 3072], InputKind::Parameter),
            input(F32, vec![3072], InputKind::Parameter),
            input(Bf16, vec![768, 768], InputKind::Parameter),
            input(F32, vec![64, 64], InputKind::Buffer),
            input(Bf16, vec![64, 64], InputKind::Constant),
            input(Bf16, vec![32, 16, 3, 3], InputKind::Parameter),
            input(F32, vec![32, 16, 3, 3], InputKind::Parameter),
        ];
        let kept = [false, true, false, true, false, false, true, false];
        for (f32_kept, bytes) in [(KeptF32::Tiles, 6), (KeptF32::Panels, 4)] {
            let pieces = bytes * 768 * 3072 + 2 * 768 * 768 + 2 * 32 * 16 * 9;
            assert_eq!(weights_kept_on_tiles(&inputs, Some(pieces), Some(f32_kept)), kept);
            assert_eq!(weights_kept_on_tiles(&inputs, Some(pieces - 1), Some(f32_kept)), [false; 8]);
            assert_eq!(weights_kept_on_tiles(&inputs, None, Some(f32_kept)), [false; 8]);
        }
        let bf16_only = [false, false, false, true, false, false, true, false];
        assert_eq!(weights_kept_on_tiles(&inputs, Some(2 * 768 * 768 + 2 * 32 * 16 * 9), None), bf16_only);
    }

    #[test]
    fn promotion_follows_torch() {
        assert_eq!(promote_types(Bf16, F16), F32);
        assert_eq!(promote_types(U8, I8), I16);
        assert_eq!(promote_types(I32, F16), F16);
        assert_eq!(promote_types(Bool, I8), I8);
        let t = |d, shape: Vec<i64>| TensorType::new(d, shape);
        let ctx = Context::new();
        ctx.set_allow_unregistered_dialects(true);
        let block = Block::new(&[(
            mlir_type(&ctx, &t(Bf16, vec![2])).unwrap(),
            Location::unknown(&ctx),
        )]);
        let arg = |ty: TensorType| {
            Operand::Tensor(Val {
                v: block.argument(0).unwrap().into(),
                ty,
            })
        };
        // A 0-d f32 tensor does not widen a bf16 tensor; a Python float makes i32 f32, not f64.
        assert_eq!(
            result_type(&[&arg(t(Bf16, vec![2])), &arg(t(F32, vec![]))]),
            Bf16
        );
        assert_eq!(
            result_type(&[&arg(t(I32, vec![2])), &Operand::Scalar(Scalar::Float(0.5))]),
            F32
        );
        assert_eq!(
            result_type(&[&arg(t(I32, vec![2])), &Operand::Scalar(Scalar::Int(3))]),
            I32
        );
    }

    #[test]
    fn shapes_and_dims() {
        assert_eq!(
            broadcast_shapes(&[2, 1, 3], &[4, 1]).unwrap(),
            vec![2, 4, 3]
        );
        assert!(broadcast_shapes(&[2], &[3]).is_err());
        assert_eq!(norm_dims(&[-1, 0, -1], 3).unwrap(), vec![0, 2]);
        assert!(norm_dim(3, 3).is_err());
        assert_eq!(tensor_str(&TensorType::new(Bool, vec![])), "tensor<i1>");
        assert_eq!(i64_array(&[]), "array<i64>");
    }
}
