//! What an f32 product's kernel does to its rows before leaving them: add the bias, then GPT-2's
//! and diffusers' tanh-approximated GELU, while the rows are still in cache. XLA:CPU ran them
//! as a loop of its own over the whole result, read back from memory: on GPT-2's `[128, 256]`
//! hidden rows 26-36 µs a layer.
//!
//! The GELU is computed op by op as eager computes it (each step rounded to f32, no fused
//! multiply-adds), with a tanh within one ulp of the exact one.

/// The function after the bias.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Activation {
    Identity,
    /// `0.5 · v · (1 + tanh(√(2/π) · (v + 0.044715 · v³)))`.
    GeluTanh,
}

/// `y[r, j] = activation(y[r, j] + bias[j])` over rows of `n` columns.
#[derive(Clone, Copy, Debug)]
pub(super) struct Epilogue {
    pub bias: *const f32,
    pub activation: Activation,
}

const KAPPA: f32 = 0.044715;
const BETA: f32 = 0.797_884_6; // √(2/π), as f32

impl Epilogue {
    /// Applies itself to `rows` rows of `y`, each `n` long, in place.
    ///
    /// # Safety
    /// `y` must cover `[rows, n]` and `bias` `[n]`.
    pub unsafe fn apply(&self, y: *mut f32, n: usize, rows: usize) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return x86::apply(self, y, n, rows);
        }
        let bias = std::slice::from_raw_parts(self.bias, n);
        for row in std::slice::from_raw_parts_mut(y, rows * n).chunks_exact_mut(n.max(1)) {
            for (v, &b) in row.iter_mut().zip(bias) {
                *v = match self.activation {
                    Activation::Identity => *v + b,
                    Activation::GeluTanh => gelu_tanh(*v + b),
                };
            }
        }
    }
}

/// The tanh GELU of one value, rounded as eager's ops round it.
fn gelu_tanh(v: f32) -> f32 {
    let inner = (v + v * v * v * KAPPA) * BETA;
    v * 0.5 * (inner.tanh() + 1.0)
}

/// `(tanh(u) - u) / u³` as a polynomial in `u²` on `|u| < SMALL` (a least-squares fit in f64 at
/// Chebyshev nodes; within 0.75 ulp of tanh there once rounded to f32), lowest order first.
#[cfg(target_arch = "x86_64")]
const TANH_SMALL: [f32; 6] = [-0.333_333_13, 0.133_326_66, -0.053_890_612, 0.021_444_825, -0.007_645_958_6, 0.001_730_296_8];
/// Below it tanh is the polynomial, above it `1 − 2 / (e^{2|u|} + 1)`, which loses no more
/// than a bit to cancellation from here on.
#[cfg(target_arch = "x86_64")]
const SMALL: f32 = 0.75;
/// From here on tanh rounds to ±1.
#[cfg(target_arch = "x86_64")]
const SATURATED: f32 = 10.0;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Activation, Epilogue, BETA, KAPPA, SATURATED, SMALL, TANH_SMALL};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn apply(e: &Epilogue, y: *mut f32, n: usize, rows: usize) {
        for r in 0..rows {
            let row = y.add(r * n);
            for j in (0..n).step_by(16) {
                let mask = ((1u32 << (n - j).min(16)) - 1) as __mmask16;
                let v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, row.add(j)), _mm512_maskz_loadu_ps(mask, e.bias.add(j)));
                let v = match e.activation {
                    Activation::Identity => v,
                    Activation::GeluTanh => gelu_tanh(v),
                };
                _mm512_mask_storeu_ps(row.add(j), mask, v);
            }
        }
    }

    /// `super::gelu_tanh` on 16 lanes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gelu_tanh(v: __m512) -> __m512 {
        let cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
        let inner = _mm512_mul_ps(_mm512_add_ps(v, _mm512_mul_ps(cube, _mm512_set1_ps(KAPPA))), _mm512_set1_ps(BETA));
        let half = _mm512_mul_ps(v, _mm512_set1_ps(0.5));
        _mm512_mul_ps(half, _mm512_add_ps(tanh(inner), _mm512_set1_ps(1.0)))
    }

    /// tanh on 16 lanes, within an ulp; NaN stays NaN.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tanh(u: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        let magnitude = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(u)));
        // Near 0: u + u³ · P(u²).
        let s = _mm512_mul_ps(u, u);
        let mut p = _mm512_set1_ps(TANH_SMALL[5]);
        for &c in TANH_SMALL[..5].iter().rev() {
            p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(c));
        }
        let small = _mm512_fmadd_ps(_mm512_mul_ps(u, s), p, u);
        // Elsewhere: 1 − 2 / (e^{2|u|} + 1), its sign then u's. `min` keeps a NaN (its second operand).
        let twice = _mm512_add_ps(_mm512_min_ps(_mm512_set1_ps(SATURATED), magnitude), _mm512_min_ps(_mm512_set1_ps(SATURATED), magnitude));
        let one = _mm512_set1_ps(1.0);
        let large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0), _mm512_add_ps(exp(twice), one)));
        let large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(large), _mm512_and_si512(sign, _mm512_castps_si512(u))));
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(magnitude, _mm512_set1_ps(SMALL));
        _mm512_mask_blend_ps(is_small, large, small)
    }

    /// e^x on 16 lanes for `x` in [0, 20] (or NaN): `2^k · e^r`, `r = x − k·ln 2` in ±ln 2 / 2
    /// (ln 2 in two parts, so `r` is exact), e^r by its series to r⁷ (a relative error below
    /// 3·10⁻⁹ there).
    #[target_feature(enable = "avx512f")]
    unsafe fn exp(x: __m512) -> __m512 {
        const LN2_HI: f32 = 0.693_145_75; // ln 2's leading bits: k · LN2_HI is exact for k ≤ 2^9
        const LN2_LO: f32 = 1.428_606_8e-6;
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
        let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, k)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn ulps(got: f32, want: f64) -> f64 {
        let rounded = want as f32;
        ((got as f64 - want) / (rounded.abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64)).abs()
    }

    #[test]
    fn tanh_is_within_an_ulp() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut worst = (0f64, 0f32);
        // Every 97th f32 from 1e-30 to past saturation, both signs.
        let (from, to) = (1e-30f32.to_bits(), 12f32.to_bits());
        let inputs: Vec<f32> = (from..to).step_by(97).flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)]).collect();
        for chunk in inputs.chunks(16) {
            let mut lanes = [0f32; 16];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut out = [0f32; 16];
            unsafe { std::arch::x86_64::_mm512_storeu_ps(out.as_mut_ptr(), x86::tanh(std::arch::x86_64::_mm512_loadu_ps(lanes.as_ptr()))) };
            for (&u, &t) in chunk.iter().zip(&out) {
                let e = ulps(t, (u as f64).tanh());
                if e > worst.0 {
                    worst = (e, u);
                }
            }
        }
        assert!(worst.0 <= 1.0, "{} ulps at {}", worst.0, worst.1);
    }

    #[test]
    fn special_values_go_as_tanh_does() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let inputs = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40, 88.0, -88.0, 9.5, -9.5, 0.75, -0.75, 0.7499999, f32::MAX, f32::MIN, 3.0];
        let mut out = [0f32; 16];
        unsafe { std::arch::x86_64::_mm512_storeu_ps(out.as_mut_ptr(), x86::tanh(std::arch::x86_64::_mm512_loadu_ps(inputs.as_ptr()))) };
        for (&u, &t) in inputs.iter().zip(&out) {
            let want = u.tanh();
            assert!(t.to_bits() == want.to_bits() || (t.is_nan() && want.is_nan()) || ulps(t, (u as f64).tanh()) <= 1.5, "tanh({u}) = {t}, want {want}");
        }
    }

    #[test]
    fn bias_and_gelu_agree_with_the_scalar_ops() {
        let (rows, n) = (5, 37);
        let mut next = crate::host_kernels::uniform(7);
        let y0: Vec<f32> = (0..rows * n).map(|_| 8.0 * next()).collect();
        let bias: Vec<f32> = (0..n).map(|_| next()).collect();
        for activation in [Activation::Identity, Activation::GeluTanh] {
            let mut y = y0.clone();
            unsafe { Epilogue { bias: bias.as_ptr(), activation }.apply(y.as_mut_ptr(), n, rows) };
            for (i, (&got, &v)) in y.iter().zip(&y0).enumerate() {
                let v = v + bias[i % n];
                let want = if activation == Activation::Identity { v } else { gelu_tanh(v) };
                // An ulp of tanh next to 1 is an ulp of `0.5 · v` in the result.
                let ulp = f32::EPSILON * (want.abs() + 0.5 * v.abs());
                assert!((got - want).abs() <= 2.0 * ulp, "{activation:?} at {i}: {got} against {want}");
            }
        }
    }
}
