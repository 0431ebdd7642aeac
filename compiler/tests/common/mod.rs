//! Test harness: build small graphs, lower them, run them on the PJRT plugin (found through
//! `TPU_DYNAMO_PJRT_PLUGIN` or `VIRTUAL_ENV`), and compare with values computed here.
#![allow(dead_code)] // each test binary uses a different subset

use std::sync::{Arc, OnceLock};
use tpu_dynamo_compiler::ir::{Arg, DType, FloatBits, Graph, Input, InputKind, Node, TensorType};
use tpu_dynamo_compiler::lower;
use tpu_dynamo_runtime as rt;

pub fn t(dtype: DType, shape: &[i64]) -> TensorType {
    TensorType::new(dtype, shape.to_vec())
}
pub fn f(x: f64) -> Arg {
    Arg::Float(FloatBits(x.to_bits()))
}
pub fn i(x: i64) -> Arg {
    Arg::Int(x)
}
pub fn ints(xs: &[i64]) -> Arg {
    Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect())
}

/// A graph under construction.
#[derive(Default)]
pub struct G {
    pub graph: Graph,
    next: u32,
}

impl G {
    pub fn new() -> G {
        G::default()
    }
    pub fn input(&mut self, dtype: DType, shape: &[i64]) -> Arg {
        assert!(self.graph.nodes.is_empty(), "inputs come first");
        self.graph.inputs.push(Input {
            ty: t(dtype, shape),
            kind: InputKind::User,
        });
        self.next += 1;
        Arg::Value(self.next - 1)
    }
    pub fn node(
        &mut self,
        op: &str,
        args: Vec<Arg>,
        kwargs: Vec<(&str, Arg)>,
        outputs: Vec<TensorType>,
    ) -> Vec<Arg> {
        let n = outputs.len() as u32;
        self.graph.nodes.push(Node {
            op: op.into(),
            args,
            kwargs: kwargs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            outputs,
        });
        self.next += n;
        (self.next - n..self.next).map(Arg::Value).collect()
    }
    pub fn op(&mut self, op: &str, args: Vec<Arg>, out: TensorType) -> Arg {
        self.node(op, args, vec![], vec![out]).remove(0)
    }
    pub fn output(&mut self, values: &[&Arg]) {
        self.graph.outputs = values
            .iter()
            .map(|a| match a {
                Arg::Value(id) => *id,
                _ => panic!("output must be a value"),
            })
            .collect();
    }
}

/// xorshift64*.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1), never zero.
    pub fn uniform(&mut self) -> f64 {
        let v = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        if v == 0.0 {
            0.5
        } else {
            v
        }
    }
    /// Random values suited to `dtype`: floats in [-scale, scale), ints in [-9, 9] \ {0}, random bools.
    pub fn values(&mut self, dtype: DType, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| match dtype {
                DType::Bool => (self.next_u64() & 1) as f64,
                d if d.is_float() => quantize(d, self.uniform() * scale),
                DType::U8 => (1 + self.next_u64() % 9) as f64,
                _ => {
                    let v = 1 + (self.next_u64() % 9) as i64;
                    if self.next_u64() & 1 == 0 {
                        v as f64
                    } else {
                        -v as f64
                    }
                }
            })
            .collect()
    }
}

fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return 0x7FC0;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// The nearest value of `dtype` (round to nearest even for bf16).
pub fn quantize(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::Bf16 => f32::from_bits((bf16_bits(v as f32) as u32) << 16) as f64,
        DType::F64 => v,
        d if d.is_integer() => v.trunc(),
        DType::Bool => (v != 0.0) as i64 as f64,
        d => panic!("no host quantization for {d:?}"),
    }
}

fn encode(dtype: DType, data: &[f64]) -> Vec<u8> {
    data.iter()
        .flat_map(|&v| match dtype {
            DType::Bool | DType::U8 => vec![v as u8],
            DType::I8 => vec![v as i8 as u8],
            DType::I16 => (v as i16).to_le_bytes().to_vec(),
            DType::I32 => (v as i32).to_le_bytes().to_vec(),
            DType::I64 => (v as i64).to_le_bytes().to_vec(),
            DType::Bf16 => bf16_bits(v as f32).to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            DType::F64 => v.to_le_bytes().to_vec(),
            d => panic!("cannot encode {d:?}"),
        })
        .collect()
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks(dtype.size())
        .map(|c| match dtype {
            DType::Bool | DType::U8 => c[0] as f64,
            DType::I8 => c[0] as i8 as f64,
            DType::I16 => i16::from_le_bytes([c[0], c[1]]) as f64,
            DType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::Bf16 => f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64,
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            d => panic!("cannot decode {d:?}"),
        })
        .collect()
}

fn rt_dtype(d: DType) -> rt::DType {
    match d {
        DType::Bool => rt::DType::Bool,
        DType::U8 => rt::DType::U8,
        DType::I8 => rt::DType::I8,
        DType::I16 => rt::DType::I16,
        DType::I32 => rt::DType::I32,
        DType::I64 => rt::DType::I64,
        DType::F16 => rt::DType::F16,
        DType::Bf16 => rt::DType::Bf16,
        DType::F32 => rt::DType::F32,
        DType::F64 => rt::DType::F64,
        DType::C64 => rt::DType::C64,
    }
}

pub fn client() -> &'static rt::Client {
    static CLIENT: OnceLock<rt::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let plugin: Arc<rt::Plugin> =
            rt::Plugin::discover(None).unwrap_or_else(|e| panic!("set VIRTUAL_ENV: {e}"));
        rt::Client::new(plugin, &rt::ClientOptions::default().cpu_device_count(1)).unwrap()
    })
}

/// Which form of the lowered module to hand the plugin.
#[derive(Clone, Copy, PartialEq)]
pub enum Form {
    Text,
    Bytecode,
}

/// Lowers and runs `graph` on `inputs` (one flat row-major vector per input).
pub fn run_form(graph: &Graph, inputs: &[Vec<f64>], form: Form) -> Vec<Vec<f64>> {
    let lowered = lower(graph, &[]).unwrap_or_else(|e| panic!("{e}"));
    let specs: Vec<rt::TensorSpec> = lowered
        .inputs
        .iter()
        .map(|ty| rt::TensorSpec::new(rt_dtype(ty.dtype), ty.shape.clone()))
        .collect();
    let code = match form {
        Form::Text => rt::ProgramCode::MlirText(&lowered.text),
        Form::Bytecode => rt::ProgramCode::MlirBytecode(&lowered.bytecode),
    };
    let c = client();
    let exe = c
        .compile(
            &rt::Program {
                code,
                inputs: specs.clone(),
            },
            &rt::CompileOptions::default(),
        )
        .unwrap_or_else(|e| panic!("compile failed: {e}\n{}", lowered.text));
    let device = &c.devices()[0];
    let bufs: Vec<rt::Buffer> = inputs
        .iter()
        .zip(&lowered.inputs)
        .zip(&specs)
        .map(|((data, ty), spec)| {
            c.buffer_from_host(&encode(ty.dtype, data), spec, device)
                .unwrap()
        })
        .collect();
    let outs = exe.execute(&bufs.iter().collect::<Vec<_>>()).unwrap();
    outs.iter()
        .zip(&lowered.outputs)
        .map(|(b, ty)| {
            let mut bytes = vec![0u8; ty.numel() as usize * ty.dtype.size()];
            b.to_host(&mut bytes).unwrap();
            decode(ty.dtype, &bytes)
        })
        .collect()
}

pub fn run(graph: &Graph, inputs: &[Vec<f64>]) -> Vec<Vec<f64>> {
    run_form(graph, inputs, Form::Text)
}

/// Random inputs for every graph input (floats scaled by `scale`), and the outputs.
pub fn run_random(graph: &Graph, seed: u64, scale: f64) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut rng = Rng::new(seed);
    let inputs: Vec<Vec<f64>> = graph
        .inputs
        .iter()
        .map(|i| rng.values(i.ty.dtype, i.ty.numel() as usize, scale))
        .collect();
    let outputs = run(graph, &inputs);
    (inputs, outputs)
}

/// |got - want| <= atol + rtol * |want| elementwise; NaNs must match.
pub fn assert_close(got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "length");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || (g - w).abs() <= atol + rtol * w.abs() || g == w;
        assert!(ok, "element {k}: got {g}, want {w} (atol {atol}, rtol {rtol})\ngot  {got:?}\nwant {want:?}");
    }
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[i64]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1] as usize;
    }
    s
}

/// The multi-index of flat position `k` in `shape`.
pub fn unravel(k: usize, shape: &[i64]) -> Vec<usize> {
    strides(shape)
        .iter()
        .zip(shape)
        .map(|(s, &d)| (k / s) % d as usize)
        .collect()
}
