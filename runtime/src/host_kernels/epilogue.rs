//! What an f32 product's kernel does to its rows before leaving them: add the bias, then GPT-2's
//! and diffusers' tanh-approximated GELU, or Llama's SiLU times the other product of its gated
//! MLP, and last a residual, while the rows are still in cache. XLA:CPU ran them as a loop of its
//! own over the whole result, read back from memory: on GPT-2's `[128, 256]` hidden rows 26-36 µs
//! a layer; a residual added to a `[1024, 64]` product 16-30 µs.
//!
//! SiLU is computed op by op as the graph's ops round them (each step rounded to f32, no fused
//! multiply-adds), with an e^x within about an ulp of the exact one. The GELU is computed as
//! `v · σ(2u)` (`x86::gelu_tanh_as_sigmoid`, for f32 and bf16 results alike), within a few f32
//! ulps of the exact function; eager's op-by-op `1 + tanh(u)` itself loses up to an ulp of
//! `0.5 · v` to cancellation. The tanh form's polynomial, e^x and division were ~7 % of tiny
//! GPT-2's bare execute at batch 8; the σ form's e^x and reciprocal took 1.5-2 % off it.

use std::ops::Range;

/// The function after the bias.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Activation {
    Identity,
    /// `0.5 · v · (1 + tanh(√(2/π) · (v + 0.044715 · v³)))`.
    GeluTanh,
    /// `v · sigmoid(v)` (SiLU as it reaches a backend: `sigmoid`, then `mul`).
    Silu,
}

/// `y[r, j] = activation(y[r, j] + bias[j]) · times[r, j] + plus[r, j]` over rows of `n`
/// columns, without the bias or the residual `plus` where null, or the factor where there is
/// none. The residual is an f32 product's only (a bf16 one's tiles never get one).
#[derive(Clone, Copy, Debug)]
pub(super) struct Epilogue {
    pub bias: *const f32,
    pub activation: Activation,
    pub times: Factor,
    pub plus: *const f32,
}

/// The factor a result is multiplied by last, shaped as the result: f32, or bf16 for a bf16
/// product's bf16 result.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Factor {
    None,
    F32(*const f32),
    Bf16(*const u16),
}

impl Epilogue {
    /// Nothing: the product as it is.
    pub const NONE: Epilogue = Epilogue { bias: std::ptr::null(), activation: Activation::Identity, times: Factor::None, plus: std::ptr::null() };

    pub fn is_none(&self) -> bool {
        self.bias.is_null() && self.activation == Activation::Identity && self.times == Factor::None && self.plus.is_null()
    }

    /// Itself for the result from its element `offset` on, in column `col` (the bias read from
    /// that column, the factor and the residual from that element).
    pub fn at(&self, offset: usize, col: usize) -> Epilogue {
        let bias = if self.bias.is_null() { self.bias } else { self.bias.wrapping_add(col) };
        let times = match self.times {
            Factor::None => Factor::None,
            Factor::F32(t) => Factor::F32(t.wrapping_add(offset)),
            Factor::Bf16(t) => Factor::Bf16(t.wrapping_add(offset)),
        };
        let plus = if self.plus.is_null() { self.plus } else { self.plus.wrapping_add(offset) };
        Epilogue { bias, times, plus, ..*self }
    }
}

pub(super) const KAPPA: f32 = 0.044715;
/// `-2u` past which `1 + tanh(u)` is 0 in f32 (`2e^{2u}` below half an ulp of 1).
#[cfg(target_arch = "x86_64")]
pub(super) const SATURATED_2U: f32 = 18.0;
pub(super) const BETA: f32 = 0.797_884_6; // √(2/π), as f32

impl Epilogue {
    /// Applies itself to columns `cols` of rows `rows` of `y` (and of `times`), each `n` long,
    /// in place.
    ///
    /// # Safety
    /// `y`, `times` and `plus` (where not null) must cover those rows of `[.., n]`, and `bias`
    /// `[n]`.
    pub unsafe fn apply(&self, y: *mut f32, n: usize, rows: Range<usize>, cols: Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        if super::gemm::avx512() {
            return x86::apply(self, y, n, rows, cols);
        } else if super::avx2::available() {
            return super::avx2::apply(self, y, n, rows, cols);
        }
        for r in rows {
            for j in cols.clone() {
                let at = r * n + j;
                let v = if self.bias.is_null() { *y.add(at) } else { *y.add(at) + *self.bias.add(j) };
                let v = match self.activation {
                    Activation::Identity => v,
                    Activation::GeluTanh => gelu_tanh(v),
                    Activation::Silu => silu(v),
                };
                let v = match self.times {
                    Factor::F32(times) => v * *times.add(at),
                    _ => v,
                };
                *y.add(at) = if self.plus.is_null() { v } else { v + *self.plus.add(at) };
            }
        }
    }
}

/// The tanh GELU of one value, rounded as eager's ops round it.
pub(super) fn gelu_tanh(v: f32) -> f32 {
    let inner = (v + v * v * v * KAPPA) * BETA;
    v * 0.5 * (inner.tanh() + 1.0)
}

/// `v · sigmoid(v)`, each rounded, as the graph's two ops round them.
fn silu(v: f32) -> f32 {
    v * (1.0 / (1.0 + (-v).exp()))
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::vector_math::{exp, lanes};
    use super::{Activation, Epilogue, Factor, Range, BETA, KAPPA, SATURATED_2U};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn apply(e: &Epilogue, y: *mut f32, n: usize, rows: Range<usize>, cols: Range<usize>) {
        for r in rows {
            let row = y.add(r * n);
            for j in cols.clone().step_by(16) {
                let mask = lanes(cols.end, j);
                let mut v = _mm512_maskz_loadu_ps(mask, row.add(j));
                if !e.bias.is_null() {
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, e.bias.add(j)));
                }
                let mut v = match e.activation {
                    Activation::Identity => v,
                    Activation::GeluTanh => gelu_tanh_as_sigmoid(v),
                    Activation::Silu => silu(v),
                };
                if let Factor::F32(times) = e.times {
                    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, times.add(r * n + j)));
                }
                if !e.plus.is_null() {
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, e.plus.add(r * n + j)));
                }
                _mm512_mask_storeu_ps(row.add(j), mask, v);
            }
        }
    }

    /// `super::silu` on 16 lanes (`exp` takes -∞ to 0: SiLU(-∞) is -∞ · 0, NaN, as eager's).
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn silu(v: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        let negated = _mm512_sub_ps(_mm512_setzero_ps(), v);
        _mm512_mul_ps(v, _mm512_div_ps(one, _mm512_add_ps(one, exp(negated))))
    }

    /// The tanh GELU as `v · σ(2u)` (the same function as `0.5 · v · (1 + tanh(u))`): one
    /// exponential and a reciprocal, where a tanh takes a polynomial, an exponential and a
    /// division (on SD3.5's `[1178, 6144]` bf16 rows 3.2 ms against 5.6 on one core). Its
    /// error, a few f32 ulps, is far below half a bf16 step. Where `2u < -18`, `tanh(u)` rounds
    /// to -1 in f32 and eager's GELU is `v · 0` (±0, NaN for -∞): so is this one.
    #[target_feature(enable = "avx512f,fma")]
    pub(in crate::host_kernels) unsafe fn gelu_tanh_as_sigmoid(v: __m512) -> __m512 {
        let cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
        let minus_2u = _mm512_mul_ps(_mm512_add_ps(v, _mm512_mul_ps(cube, _mm512_set1_ps(KAPPA))), _mm512_set1_ps(-2.0 * BETA));
        let d = _mm512_add_ps(exp(minus_2u), _mm512_set1_ps(1.0));
        let r = _mm512_rcp14_ps(d);
        let sigmoid = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0)));
        let saturated = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(minus_2u, _mm512_set1_ps(SATURATED_2U));
        _mm512_mask_mov_ps(_mm512_mul_ps(v, sigmoid), saturated, _mm512_mul_ps(v, _mm512_setzero_ps()))
    }

    /// SiLU of a bf16 product's rounded values for a bf16 result, `v · σ(v)`, with σ from one
    /// exponential and a reciprocal (eager's divides): within a few f32 ulps. Where `v < -80`,
    /// σ(v) < 2e-35 and the result is `v · 0` (±0, NaN for -∞ as eager's), at most 1e-33 from
    /// eager's.
    #[target_feature(enable = "avx512f,fma")]
    pub(in crate::host_kernels) unsafe fn silu_of_bf16(v: __m512) -> __m512 {
        let d = _mm512_add_ps(exp(_mm512_sub_ps(_mm512_setzero_ps(), v)), _mm512_set1_ps(1.0));
        let r = _mm512_rcp14_ps(d);
        let sigmoid = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0)));
        let saturated = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(v, _mm512_set1_ps(-80.0));
        _mm512_mask_mov_ps(_mm512_mul_ps(v, sigmoid), saturated, _mm512_mul_ps(v, _mm512_setzero_ps()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_gelu_silu_and_residual_agree_with_the_scalar_ops() {
        let (rows, n) = (5, 37);
        let mut next = crate::host_kernels::uniform(7);
        let y0: Vec<f32> = (0..rows * n).map(|_| 8.0 * next()).collect();
        let bias: Vec<f32> = (0..n).map(|_| next()).collect();
        let times: Vec<f32> = (0..rows * n).map(|_| next()).collect();
        let residual: Vec<f32> = (0..rows * n).map(|_| 4.0 * next()).collect();
        let cases = [
            (Activation::Identity, true, false),
            (Activation::GeluTanh, true, false),
            (Activation::Silu, false, false),
            (Activation::Identity, false, true),
            (Activation::Identity, true, true),
        ];
        for (activation, biased, plussed) in cases {
            let mut y = y0.clone();
            let bias_ptr = if biased { bias.as_ptr() } else { std::ptr::null() };
            let times_ptr = if biased || plussed { Factor::None } else { Factor::F32(times.as_ptr()) };
            let plus = if plussed { residual.as_ptr() } else { std::ptr::null() };
            // Rows 1.. only (row 0 stays as it was), in two runs of columns.
            let epilogue = Epilogue { bias: bias_ptr, activation, times: times_ptr, plus };
            unsafe { epilogue.apply(y.as_mut_ptr(), n, 1..rows, 5..n) };
            assert_eq!(y[n..n + 5], y0[n..n + 5]);
            unsafe { epilogue.apply(y.as_mut_ptr(), n, 1..rows, 0..5) };
            assert_eq!(y[..n], y0[..n]);
            // In one run of columns, whose vectors fall otherwise into a row's groups of four
            // and single ones (AVX2's `columns`): the same bits.
            let mut at_once = y0.clone();
            unsafe { epilogue.apply(at_once.as_mut_ptr(), n, 1..rows, 0..n) };
            assert!(at_once.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()), "{activation:?}: one run against two");
            for (i, (&got, &v)) in y.iter().zip(&y0).enumerate().skip(n) {
                let v = if biased { v + bias[i % n] } else { v };
                let want = match activation {
                    Activation::Identity if plussed => {
                        // Rounded once after each of the graph's two adds, as eager's.
                        assert_eq!(got.to_bits(), (v + residual[i]).to_bits(), "residual at {i}");
                        continue;
                    }
                    Activation::Identity => v,
                    Activation::GeluTanh => gelu_tanh(v),
                    Activation::Silu => silu(v) * times[i],
                };
                // An ulp of tanh next to 1 is an ulp of `0.5 · v` in the result (of `v` for SiLU's sigmoid).
                let ulp = f32::EPSILON * (want.abs() + v.abs() * if biased { 0.5 } else { times[i].abs() });
                assert!((got - want).abs() <= 2.0 * ulp, "{activation:?} at {i}: {got} against {want}");
            }
        }
    }

    /// Each of `-range..range` in steps of 0.01, and the special values, with `f`'s value of it.
    #[cfg(target_arch = "x86_64")]
    fn on_lanes(f: unsafe fn(std::arch::x86_64::__m512) -> std::arch::x86_64::__m512, range: f32) -> Vec<(f32, f32)> {
        let steps = (range * 100.0) as i32;
        let mut values: Vec<f32> = (-steps..steps).map(|i| i as f32 / 100.0).collect();
        values.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, -f32::MAX, 1e-30, -1e-30, 0.0, -0.0]);
        let mut out = vec![];
        for chunk in values.chunks(16) {
            let mut lanes = [0f32; 16];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let got: [f32; 16] = unsafe { std::mem::transmute(f(std::mem::transmute::<[f32; 16], std::arch::x86_64::__m512>(lanes))) };
            out.extend(chunk.iter().copied().zip(got));
        }
        out
    }

    /// The σ form of the GELU (f32 and bf16 results) against f64's (in that form, which does not
    /// cancel): within a few f32 ulps and its argument's rounding, ±0 where eager's is, and on
    /// the special values as eager.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn gelu_is_the_exact_gelu_within_a_few_ulps() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let two_u = |v: f64| 2.0 * 0.797_884_560_802_865_4 * v * (1.0 + 0.044715 * v * v);
        let exact = |v: f64| v / (1.0 + (-two_u(v)).exp());
        for (v, g) in on_lanes(x86::gelu_tanh_as_sigmoid, 20.0) {
            let (want, two_u) = (exact(f64::from(v)), two_u(f64::from(v)));
            if v.is_nan() || v == f32::NEG_INFINITY {
                assert!(g.is_nan(), "{v} gave {g}");
            } else if v > 0.0 && v.is_infinite() {
                assert_eq!(g, v);
            } else if two_u < -f64::from(SATURATED_2U) - 1e-3 {
                assert_eq!(g.to_bits(), (-0.0f32).to_bits(), "at {v}");
            } else if two_u < -f64::from(SATURATED_2U) + 1e-3 {
                assert!(g == 0.0 || (f64::from(g) - want).abs() <= 1e-3 * want.abs(), "at {v}");
            } else {
                // Computing `2u` in f32 (four roundings) costs up to a few |2u| ulps of
                // e^{-2u}, as in eager's tanh(u).
                let error = (f64::from(g) - want).abs();
                assert!(error <= 4.0 * (1.0 + two_u.abs()) * f64::from(f32::EPSILON) * want.abs(), "at {v}: {g} against {want}");
            }
        }
    }

    /// The σ form of SiLU for bf16 results against f64's: within a few f32 ulps (and its
    /// argument's rounding), ±0 below -80, and on the special values as eager.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn silu_of_bf16_is_the_exact_silu_within_a_few_ulps() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        for (v, g) in on_lanes(x86::silu_of_bf16, 90.0) {
            let want = f64::from(v) / (1.0 + (-f64::from(v)).exp());
            if v.is_nan() || v == f32::NEG_INFINITY {
                assert!(g.is_nan(), "{v} gave {g}");
            } else if v.is_infinite() || v == f32::MAX {
                assert_eq!(g, v);
            } else if v < -80.0 {
                assert_eq!(g.to_bits(), (-0.0f32).to_bits(), "at {v}");
            } else {
                let error = (f64::from(g) - want).abs();
                assert!(error <= 4.0 * (1.0 + f64::from(v.abs())) * f64::from(f32::EPSILON) * want.abs(), "at {v}: {g} against {want}");
            }
        }
    }
}
