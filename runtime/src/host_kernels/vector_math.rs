//! Elementwise functions on sixteen f32 lanes (AVX-512) that our kernels share: e^x (and a
//! cheaper one for attention's softmax), ln x (its log-sum-exp), tanh x (the GELU after a
//! product), rounding to bf16 (bf16 results), and the mask of a row's last, partial vector.

use std::arch::x86_64::*;

/// The lanes of a 16-wide step at `at` that lie before `len`: a row's last, partial vector is
/// loaded and stored under it.
pub(super) fn lanes(len: usize, at: usize) -> __mmask16 {
    ((1u32 << len.saturating_sub(at).min(16)) - 1) as __mmask16
}

/// Each f32 rounded to the nearest even bf16, its bits in the low half of its lane (a NaN
/// stays NaN, quieted, as `f32_to_bf16`).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rounded_bf16(v: __m512) -> __m512i {
    let (one, half_ulp, quiet) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7fff), _mm512_set1_epi32(0x0040_0000));
    let bits = _mm512_castps_si512(v);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), one);
    let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(half_ulp, odd));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_srli_epi32::<16>(_mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, quiet)))
}

/// `v` as a bf16 result keeps it (`rounded_bf16`), as f32s again.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn through_bf16(v: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(rounded_bf16(v)))
}

/// Sixteen bf16 values as f32s.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn widened_bf16(halves: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
}

/// The 16 × 16 transpose of `r` (row `i` of the result is lane `i` of every input).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose(r: [__m512; 16]) -> [__m512; 16] {
    // Pairs of rows interleaved, then quads: `u[4i + j]`'s 128-bit lane `l` holds column
    // `4l + j` of rows `4i..4i + 4`.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        u[4 * i] = _mm512_shuffle_ps::<0x44>(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_shuffle_ps::<0x44>(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(t[4 * i + 1], t[4 * i + 3]);
    }
    // Then the four lanes of column `4l + j` gathered from `u[j]`, `u[4 + j]`, `u[8 + j]`, `u[12 + j]`.
    let mut out = [_mm512_setzero_ps(); 16];
    for j in 0..4 {
        let v0 = _mm512_shuffle_f32x4::<0x88>(u[j], u[4 + j]);
        let v1 = _mm512_shuffle_f32x4::<0xDD>(u[j], u[4 + j]);
        let v2 = _mm512_shuffle_f32x4::<0x88>(u[8 + j], u[12 + j]);
        let v3 = _mm512_shuffle_f32x4::<0xDD>(u[8 + j], u[12 + j]);
        out[j] = _mm512_shuffle_f32x4::<0x88>(v0, v2);
        out[8 + j] = _mm512_shuffle_f32x4::<0xDD>(v0, v2);
        out[4 + j] = _mm512_shuffle_f32x4::<0x88>(v1, v3);
        out[12 + j] = _mm512_shuffle_f32x4::<0xDD>(v1, v3);
    }
    out
}

/// `ln(x)` to about 1 ulp for positive `x` (NaN stays NaN): `x = m 2^e` with `m` in `[√½,
/// √2)`, `ln(m)` by Cephes' `logf` polynomial in `m - 1`.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn ln(x: __m512) -> __m512 {
    let m = _mm512_getmant_ps::<_MM_MANT_NORM_1_2, _MM_MANT_SIGN_SRC>(x);
    let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, _mm512_set1_ps(std::f32::consts::SQRT_2));
    let m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5));
    let e = _mm512_getexp_ps(x);
    let e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0));
    let f = _mm512_sub_ps(m, _mm512_set1_ps(1.0));
    let z = _mm512_mul_ps(f, f);
    let [highest, lower @ ..] = LN;
    let mut p = _mm512_set1_ps(highest);
    for c in lower {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    let y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
    let y = _mm512_fmadd_ps(e, _mm512_set1_ps(EXP_LN2[1]), y);
    let y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5), z, y);
    _mm512_fmadd_ps(e, _mm512_set1_ps(EXP_LN2[0]), _mm512_add_ps(f, y))
}

/// Cephes' `logf` polynomial for `(ln(1 + f) - f + f²/2) / f³`, the highest order first.
pub(super) const LN: [f32; 9] = [7.037_683_6e-2, -1.151_461e-1, 1.167_699_9e-1, -1.242_014_1e-1, 1.424_932_3e-1, -1.666_805_8e-1, 2.000_071_4e-1, -2.499_999_4e-1, 3.333_333e-1];

/// `ln 2` in two parts, the first exact in few bits, so that `x - n ln 2` loses nothing.
pub(super) const EXP_LN2: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
/// Cephes' `expf` polynomial for `(e^r - 1 - r) / r²`, the highest order first.
pub(super) const EXP: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// `e^x` to about 1 ulp: `x = n ln 2 + r` with `|r| ≤ ln 2 / 2`, `e^r` by Cephes' `expf`
/// polynomial, scaled by `2^n` (`scalef` gives 0 below f32's range, inf above it, and keeps
/// NaN). `x` is raised to -120 first, so that -inf (a hidden key) gives 0, not NaN (`max`
/// returns its second operand where one is NaN).
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn exp(x: __m512) -> __m512 {
    let x = _mm512_max_ps(_mm512_set1_ps(-120.0), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2[0]), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2[1]), r);
    let [highest, lower @ ..] = EXP;
    let mut p = _mm512_set1_ps(highest);
    for c in lower {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_scalef_ps(e, n)
}

/// `e^r` on `|r| ≤ ln 2 / 2` as a polynomial of degree 5 (a relative minimax fit in f64 with
/// `e^0 = 1`, rounded to f32), the highest order first.
pub(super) const SOFTMAX_EXP: [f32; 6] = [0.008_290_315, 0.041_897_93, 0.166_676_36, 0.499_991_5, 0.999_999_7, 1.0];
/// Added to `x log₂e`, it leaves that rounded to an integer (f32's 24th bit is 1 unit).
pub(super) const ROUNDER: f32 = 12_582_912.0;

/// `e^x` for a softmax's `x ≤ 0` (a score less its row's maximum, -inf for a hidden key) in 10
/// instructions to `exp`'s 14: within 2 ulp from 1 down to 2^-24 (half an ulp of the row's
/// largest), within 5 ulp below that, 0 below f32's range. Against `exp`: `n` rounded by adding
/// `ROUNDER`, not by `roundscale`; one part of `ln 2`, not two (its error grows with `|n|`, so
/// only where results are too small to matter to a sum that holds a 1); degree 5, not 7. The
/// exponentials are most of a narrow head's attention (`[1, 8, 1024, 4]`: 40 %).
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn softmax_exp(x: __m512) -> __m512 {
    let x = _mm512_max_ps(_mm512_set1_ps(-120.0), x);
    let rounder = _mm512_set1_ps(ROUNDER);
    let n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), rounder), rounder);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(std::f32::consts::LN_2), x);
    let [highest, lower @ ..] = SOFTMAX_EXP;
    let mut p = _mm512_set1_ps(highest);
    for c in lower {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_ln_is_within_f32_epsilon() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
            // The sums it takes (1 to a few thousand, one exp per key), and well beyond.
        let xs: Vec<f32> = (0..64_000).map(|i| 1e-6 * 1.0004f32.powi(i)).collect();
        for chunk in xs.chunks_exact(16) {
            let got: [f32; 16] = unsafe { std::mem::transmute(ln(_mm512_loadu_ps(chunk.as_ptr()))) };
            for (&x, &g) in chunk.iter().zip(&got) {
                let want = f64::from(x).ln();
                assert!((f64::from(g) - want).abs() <= f64::from(f32::EPSILON) * want.abs().max(1e-3), "ln({x}) = {g}, want {want}");
            }
        }
        let nan: [f32; 16] = unsafe { std::mem::transmute(ln(_mm512_set1_ps(f32::NAN))) };
        assert!(nan[0].is_nan());
    }

    #[test]
    fn softmax_exp_is_within_two_ulp_where_a_sum_sees_it() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let xs: Vec<f32> = (0..1_600_000).map(|i| -100.0 + i as f32 * 0.0000625).chain([0.0]).collect();
        for chunk in xs.chunks(16) {
            let mut lanes = [0f32; 16];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let got: [f32; 16] = unsafe { std::mem::transmute(softmax_exp(_mm512_loadu_ps(lanes.as_ptr()))) };
            for (&x, &g) in chunk.iter().zip(&got) {
                let want = (f64::from(x)).exp() as f32;
                let ulps = (g.to_bits() as i64 - want.to_bits() as i64).abs();
                let allowed = if want >= f32::EPSILON / 2.0 { 2 } else { 5 };
                assert!(ulps <= allowed || (want < 1e-37 && (g - want).abs() < 1e-44), "softmax_exp({x}) = {g}, want {want}");
            }
        }
        let special: [f32; 16] = unsafe { std::mem::transmute(softmax_exp(_mm512_setr_ps(f32::NAN, -200.0, f32::NEG_INFINITY, 0.0, -0.0, 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0.))) };
        assert!(special[0].is_nan());
        assert_eq!((special[1], special[2], special[3], special[4]), (0.0, 0.0, 1.0, 1.0));
    }

    #[test]
    fn vector_exp_is_within_two_ulp() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
            let xs: Vec<f32> = (0..16_000).map(|i| -100.0 + i as f32 * 0.00625).collect();
        for chunk in xs.chunks(16) {
            let got: [f32; 16] = unsafe { std::mem::transmute(exp(_mm512_loadu_ps(chunk.as_ptr()))) };
            for (&x, &g) in chunk.iter().zip(&got) {
                let want = (f64::from(x)).exp() as f32;
                let ulps = (g.to_bits() as i64 - want.to_bits() as i64).abs();
                assert!(ulps <= 2 || (want < 1e-37 && (g - want).abs() < 1e-44), "exp({x}) = {g}, want {want}");
            }
        }
        let special: [f32; 16] = unsafe { std::mem::transmute(exp(_mm512_setr_ps(f32::NAN, -200.0, 100.0, 0.0, f32::NEG_INFINITY, 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0.))) };
        assert!(special[0].is_nan());
        assert_eq!((special[1], special[2], special[3], special[4]), (0.0, f32::INFINITY, 1.0, 0.0));
    }
}
