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
        if super::gemm::available() {
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::vector_math::tanh;
    use super::{Activation, Epilogue, BETA, KAPPA};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,fma")]
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
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn gelu_tanh(v: __m512) -> __m512 {
        let cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
        let inner = _mm512_mul_ps(_mm512_add_ps(v, _mm512_mul_ps(cube, _mm512_set1_ps(KAPPA))), _mm512_set1_ps(BETA));
        let half = _mm512_mul_ps(v, _mm512_set1_ps(0.5));
        _mm512_mul_ps(half, _mm512_add_ps(tanh(inner), _mm512_set1_ps(1.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
