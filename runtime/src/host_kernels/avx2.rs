//! The f32 product tile, the copy of a weight into panels, the products' epilogues,
//! attention's exponentials, f32 LayerNorm and RMSNorm rows and the 3×3 convolution's tile on
//! eight-lane AVX2 vectors with FMA, for CPUs without AVX-512 (AMD Zen 2 and 3, Intel before
//! Ice Lake): there XLA:CPU's own products, softmax, norms and convolutions ran every f32 model,
//! our kernels being AVX-512's alone. Same results as those, to the sums' order and the last
//! ulp of a GELU's reciprocal.

use super::conv::{Positions, Shape};
use super::epilogue::{Activation, Epilogue, Factor, BETA, KAPPA, SATURATED_2U};
use super::gemm::{Tile, COLUMNS, ROWS};
use super::vector_math::{EXP, EXP_LN2, LN, ROUNDER, SOFTMAX_EXP};
use std::arch::x86_64::*;
use std::ops::Range;

/// Whether this CPU runs these kernels.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// The lanes of an eight-wide step at `at` that lie before `len`, as a mask of whole lanes.
#[target_feature(enable = "avx2")]
unsafe fn lanes(len: usize, at: usize) -> __m256i {
    let left = len.saturating_sub(at).min(8) as i32;
    _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// `Tile::run` for `rows` ≤ `ROWS`: the panel's columns sixteen at a time, as two vectors of
/// eight, by up to six rows, so that the sums, two panel vectors and a broadcast value fit the
/// sixteen registers (three rows by four vectors spilled sums in the loop over K).
///
/// # Safety
/// As `Tile::run`'s; the CPU must be `available()`.
pub(super) unsafe fn tile(t: &Tile, x: *const f32, y: *mut f32, rows: usize) {
    debug_assert!(rows <= ROWS && t.cols <= COLUMNS);
    for first in (0..t.cols).step_by(16) {
        let half = Tile { b: t.b.add(first), cols: (t.cols - first).min(16), ..*t };
        let (vectors, whole) = (half.cols.div_ceil(8), half.cols.is_multiple_of(8));
        let per_pass = 12 / vectors;
        let mut r = 0;
        while r < rows {
            let m = per_pass.min(rows - r);
            let (x, y) = (x.add(r * t.ldx), y.add(r * t.ldy + first));
            macro_rules! pass {
                ($($v:literal: $($m:literal)*;)*) => {
                    match (vectors, m, whole) {
                        $($(
                            ($v, $m, true) => rows_by_vectors::<$m, $v, true>(&half, x, y),
                            ($v, $m, false) => rows_by_vectors::<$m, $v, false>(&half, x, y),
                        )*)*
                        _ => unreachable!(),
                    }
                };
            }
            pass!(1: 1 2 3 4 5 6 7 8 9 10 11 12; 2: 1 2 3 4 5 6;);
            r += m;
        }
    }
}

/// `Tile::run` for any number of rows: where the panel is a whole 32 columns (a product's
/// blocks but a last narrow one), six rows by both halves of it at a time, the tile's loop
/// inlined here rather than dispatched per twelve rows (`tile`'s share of a tiny GPT-2's
/// batch-8 execute was 3.5 %, its own instructions: a call, its frame, a jump table; the tiny
/// Llama's and GPT-2's batch-8 bare executes in turns: 0.95-0.96 and 0.96-0.97 of before).
///
/// # Safety
/// As `Tile::run`'s, for `rows` rows; the CPU must be `available()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tiles(t: &Tile, x: *const f32, y: *mut f32, rows: usize) {
    let mut r = 0;
    if t.cols == COLUMNS {
        let halves = [0, 16].map(|first| (first, Tile { b: t.b.add(first), cols: 16, ..*t }));
        while r + 6 <= rows {
            for (first, half) in &halves {
                rows_by_vectors::<6, 2, true>(half, x.add(r * t.ldx), y.add(r * t.ldy + first));
            }
            r += 6;
        }
    }
    while r < rows {
        let m = ROWS.min(rows - r);
        tile(t, x.add(r * t.ldx), y.add(r * t.ldy), m);
        r += m;
    }
}

/// `M` rows times the panel's first `8 V` columns, those past `cols` masked off (none when
/// `WHOLE`).
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_by_vectors<const M: usize, const V: usize, const WHOLE: bool>(t: &Tile, x: *const f32, y: *mut f32) {
    let masks: [__m256i; V] = std::array::from_fn(|c| lanes(t.cols, 8 * c));
    let mut sums = [[_mm256_setzero_ps(); V]; M];
    for kk in 0..t.k {
        let b = t.b.add(kk * t.ldb);
        let panel: [__m256; V] = std::array::from_fn(|c| if WHOLE { _mm256_loadu_ps(b.add(8 * c)) } else { _mm256_maskload_ps(b.add(8 * c), masks[c]) });
        for (r, row) in sums.iter_mut().enumerate() {
            let a = _mm256_broadcast_ss(&*x.add(r * t.ldx + kk));
            for (sum, &p) in row.iter_mut().zip(&panel) {
                *sum = _mm256_fmadd_ps(a, p, *sum);
            }
        }
    }
    for (r, row) in sums.iter().enumerate() {
        let out = y.add(r * t.ldy);
        for (c, &sum) in row.iter().enumerate() {
            if WHOLE {
                _mm256_storeu_ps(out.add(8 * c), sum);
            } else {
                _mm256_maskstore_ps(out.add(8 * c), masks[c], sum);
            }
        }
    }
}

/// `gemm::pack_transposed` in 8 × 8 blocks transposed in registers, the columns of a block past
/// `cols` written as zeros.
///
/// # Safety
/// As `gemm::pack_transposed`'s; the CPU must be `available()`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn pack_transposed((w, ldw): (*const f32, usize), k: usize, cols: usize, panel: &mut [f32]) {
    for k0 in (0..k).step_by(8) {
        let width = (k - k0).min(8);
        let k_mask = lanes(width, 0);
        for j0 in (0..cols).step_by(8) {
            let rows = (cols - j0).min(8);
            let r: [__m256; 8] = std::array::from_fn(|j| if j < rows { _mm256_maskload_ps(w.add((j0 + j) * ldw + k0), k_mask) } else { _mm256_setzero_ps() });
            for (i, column) in transpose(r).iter().enumerate().take(width) {
                _mm256_storeu_ps(panel.as_mut_ptr().add((k0 + i) * COLUMNS + j0), *column);
            }
        }
    }
}

/// The 8 × 8 transpose of `r` (row `i` of the result is lane `i` of every input).
#[target_feature(enable = "avx2")]
unsafe fn transpose(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then quads: `u[4h + j]`'s 128-bit lane `l` holds column
    // `4l + j` of rows `4h..4h + 4`; the lanes are then swapped into place.
    let t: [__m256; 8] = std::array::from_fn(|i| if i % 2 == 0 { _mm256_unpacklo_ps(r[i], r[i + 1]) } else { _mm256_unpackhi_ps(r[i - 1], r[i]) });
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (t[4 * (i / 4) + (i % 4) / 2], t[4 * (i / 4) + (i % 4) / 2 + 2]);
        if i % 2 == 0 { _mm256_shuffle_ps::<0x44>(a, b) } else { _mm256_shuffle_ps::<0xEE>(a, b) }
    });
    std::array::from_fn(|c| if c < 4 { _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]) } else { _mm256_permute2f128_ps::<0x31>(u[c - 4], u[c]) })
}

/// `epilogue::x86::apply` on eight lanes, a row's whole vectors four at a time (`columns`).
///
/// # Safety
/// As `Epilogue::apply`'s; the CPU must be `available()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn apply(e: &Epilogue, y: *mut f32, n: usize, rows: Range<usize>, cols: Range<usize>) {
    // Each of these rows (`y`'s, `times`', `plus`') and the bias read as a row ending at `cols.end`.
    let end = cols.end;
    for r in rows {
        let mut j = cols.start;
        while j + 32 <= end {
            columns::<4>(e, (y, r * n), end, j);
            j += 32;
        }
        for j in (j..end).step_by(8) {
            columns::<1>(e, (y, r * n), end, j);
        }
    }
}

/// `apply` to the `N` vectors of a row from column `j` (whole ones where `N` > 1), each step
/// taken for all `N` before the next: one vector's σ is a chain of dependent steps longer than
/// what a Zen 3 overlaps with the next vector's, and a GELU over `[1024, 256]` took 33 cycles a
/// vector one at a time, 18 four at a time (the same operations, so the same bits).
#[target_feature(enable = "avx2,fma")]
unsafe fn columns<const N: usize>(e: &Epilogue, (y, row): (*mut f32, usize), end: usize, j: usize) {
    debug_assert!(N == 1 || j + 8 * N <= end);
    let load = |x: *const f32, c: usize| if N > 1 { _mm256_loadu_ps(x.add(j + 8 * c)) } else { load_row(x, end, j).0 };
    let mut v: [__m256; N] = std::array::from_fn(|c| load(y.add(row), c));
    if !e.bias.is_null() {
        v = std::array::from_fn(|c| _mm256_add_ps(v[c], load(e.bias, c)));
    }
    v = match e.activation {
        Activation::Identity => v,
        Activation::GeluTanh => gelu_tanh_as_sigmoid(v),
        Activation::Silu => silu(v),
    };
    if let Factor::F32(times) = e.times {
        v = std::array::from_fn(|c| _mm256_mul_ps(v[c], load(times.add(row), c)));
    }
    if !e.plus.is_null() {
        v = std::array::from_fn(|c| _mm256_add_ps(v[c], load(e.plus.add(row), c)));
    }
    for (c, &out) in v.iter().enumerate() {
        if N > 1 {
            _mm256_storeu_ps(y.add(row + j + 8 * c), out);
        } else {
            store_row(y.add(row), end, j, out);
        }
    }
}

/// `epilogue::silu` on `N` vectors of eight lanes (see `columns`), each step rounded as the
/// graph's ops round it.
#[target_feature(enable = "avx2,fma")]
unsafe fn silu<const N: usize>(v: [__m256; N]) -> [__m256; N] {
    let one = _mm256_set1_ps(1.0);
    let e = exp_normal(v.map(|v| clamp_normal(_mm256_sub_ps(_mm256_setzero_ps(), v), 88.0)));
    std::array::from_fn(|c| _mm256_mul_ps(v[c], _mm256_div_ps(one, _mm256_add_ps(one, e[c]))))
}

/// `epilogue::x86::gelu_tanh_as_sigmoid` on `N` vectors of eight lanes, σ by a division
/// (AVX2's reciprocal has 12 bits to AVX-512's 14, one Newton step short of f32's).
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_tanh_as_sigmoid<const N: usize>(v: [__m256; N]) -> [__m256; N] {
    let minus_2u = v.map(|v| {
        let cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
        _mm256_mul_ps(_mm256_add_ps(v, _mm256_mul_ps(cube, _mm256_set1_ps(KAPPA))), _mm256_set1_ps(-2.0 * BETA))
    });
    let e = exp_normal(minus_2u.map(|m| clamp_normal(m, SATURATED_2U)));
    std::array::from_fn(|c| {
        let sigmoid = _mm256_div_ps(_mm256_set1_ps(1.0), _mm256_add_ps(e[c], _mm256_set1_ps(1.0)));
        let saturated = _mm256_cmp_ps::<_CMP_GT_OQ>(minus_2u[c], _mm256_set1_ps(SATURATED_2U));
        _mm256_blendv_ps(_mm256_mul_ps(v[c], sigmoid), _mm256_mul_ps(v[c], _mm256_setzero_ps()), saturated)
    })
}

/// `x` within `[-87, high]`, a NaN as -87: the range where `exp_normal` holds. Below it `e^x`
/// adds nothing to 1, and where `x` is NaN so is the value σ multiplies; a GELU's `-2u` above
/// `SATURATED_2U` is replaced after.
#[target_feature(enable = "avx2")]
unsafe fn clamp_normal(x: __m256, high: f32) -> __m256 {
    _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_set1_ps(high))
}

/// `vector_math::exp` on `N` vectors of eight lanes for `x` in `[-87, 88]`, where `2^n` is one
/// normal number put into the exponent's bits (AVX-512 has `scalef`), with no clamps or NaN of
/// its own to keep: σ's e^x in the products' epilogues, where two factors of `2^n` for f32's
/// whole range, the clamps and a NaN's blend took a GELU 30 cycles a vector on a Zen 3, against
/// 24.
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_normal<const N: usize>(x: [__m256; N]) -> [__m256; N] {
    let n = x.map(|x| _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E))));
    let r: [__m256; N] = std::array::from_fn(|c| _mm256_fnmadd_ps(n[c], _mm256_set1_ps(EXP_LN2[0]), x[c]));
    let r: [__m256; N] = std::array::from_fn(|c| _mm256_fnmadd_ps(n[c], _mm256_set1_ps(EXP_LN2[1]), r[c]));
    let [highest, lower @ ..] = EXP;
    let mut p = [_mm256_set1_ps(highest); N];
    for c in lower {
        p = std::array::from_fn(|i| _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(c)));
    }
    std::array::from_fn(|c| {
        let e = _mm256_fmadd_ps(p[c], _mm256_mul_ps(r[c], r[c]), _mm256_add_ps(r[c], _mm256_set1_ps(1.0)));
        let power = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n[c]), _mm256_set1_epi32(127)));
        _mm256_mul_ps(e, _mm256_castsi256_ps(power))
    })
}

/// Values `at..at + 8` of a row of `n` f32s (those past `n` zero), and the mask of those within.
#[target_feature(enable = "avx2")]
unsafe fn load_row(x: *const f32, n: usize, at: usize) -> (__m256, __m256) {
    let mask = lanes(n, at);
    let v = if at + 8 <= n { _mm256_loadu_ps(x.add(at)) } else { _mm256_maskload_ps(x.add(at), mask) };
    (v, _mm256_castsi256_ps(mask))
}

/// `out` into values `at..at + 8` (within `n`) of a row of f32s.
#[target_feature(enable = "avx2")]
unsafe fn store_row(y: *mut f32, n: usize, at: usize, out: __m256) {
    if at + 8 <= n {
        _mm256_storeu_ps(y.add(at), out);
    } else {
        _mm256_maskstore_ps(y.add(at), lanes(n, at), out);
    }
}

/// `layer_norm::x86::row` for `R` rows of f32s (each mean summed about its row's first value,
/// then the variance about the mean), on eight lanes, each step taken for all `R` rows before
/// the next: a row's sums are chains of dependent adds, and a 64-wide row's steps (two chains
/// of eight, two reductions, a square root) wait on each other where four rows' do not (the
/// tiny GPT-2's batch-8 and SD3's bare executes in turns: 0.92-0.94 and 0.90-0.95 of a row at
/// a time).
///
/// # Safety
/// Each row's `x` and `y` must hold `n` values; the CPU must be `available()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn layer_norm_rows<const R: usize>(
    rows: [(*const f32, *mut f32); R],
    n: usize,
    (weight, bias): (&[f32], &[f32]),
    modulations: [Option<(&[f32], &[f32])>; R],
    eps: f32,
) -> [(f32, f32); R] {
    let shift = rows.map(|(x, _)| _mm256_set1_ps(if n == 0 { 0.0 } else { *x }));
    let mut sum = [_mm256_setzero_ps(); R];
    for at in (0..n).step_by(8) {
        for (i, &(x, _)) in rows.iter().enumerate() {
            let (v, within) = load_row(x, n, at);
            sum[i] = _mm256_add_ps(sum[i], _mm256_and_ps(_mm256_sub_ps(v, shift[i]), within));
        }
    }
    // Loops, not closures: `reduce`'s operation passed in a closure was called, not inlined.
    let mut mean = shift;
    for (mean, &sum) in mean.iter_mut().zip(&sum) {
        *mean = _mm256_add_ps(*mean, _mm256_set1_ps(reduce(sum, _mm256_add_ps) / n as f32));
    }
    let mut squares = [_mm256_setzero_ps(); R];
    for at in (0..n).step_by(8) {
        for (i, &(x, _)) in rows.iter().enumerate() {
            let (v, within) = load_row(x, n, at);
            let d = _mm256_and_ps(_mm256_sub_ps(v, mean[i]), within);
            squares[i] = _mm256_fmadd_ps(d, d, squares[i]);
        }
    }
    let mut rstd = [0.0; R];
    for (rstd, &squares) in rstd.iter_mut().zip(&squares) {
        *rstd = 1.0 / (reduce(squares, _mm256_add_ps) / n as f32 + eps).sqrt();
    }
    let load = |p: &[f32], at: usize| load_row(p.as_ptr(), n, at).0;
    for at in (0..n).step_by(8) {
        for (i, &(x, y)) in rows.iter().enumerate() {
            let normalized = _mm256_mul_ps(_mm256_sub_ps(load_row(x, n, at).0, mean[i]), _mm256_set1_ps(rstd[i]));
            let mut out = _mm256_fmadd_ps(normalized, load(weight, at), load(bias, at));
            if let Some((factor, shift)) = modulations[i] {
                out = _mm256_add_ps(_mm256_mul_ps(out, load(factor, at)), load(shift, at));
            }
            store_row(y, n, at, out);
        }
    }
    std::array::from_fn(|i| (_mm256_cvtss_f32(mean[i]), rstd[i]))
}

/// `layer_norm::x86::rms_row` for a row of f32s, on eight lanes: the squares in four sums.
///
/// # Safety
/// `x` and `y` must hold `n` values; the CPU must be `available()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rms_row((x, y): (*const f32, *mut f32), n: usize, weight: &[f32], eps: f32) {
    let mut sums = [_mm256_setzero_ps(); 4];
    for (i, at) in (0..n).step_by(8).enumerate() {
        let v = load_row(x, n, at).0;
        sums[i % 4] = _mm256_fmadd_ps(v, v, sums[i % 4]);
    }
    let squares = _mm256_add_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_add_ps(sums[2], sums[3]));
    let scale = _mm256_set1_ps(1.0 / (reduce(squares, _mm256_add_ps) / n as f32 + eps).sqrt());
    for at in (0..n).step_by(8) {
        let normalized = _mm256_mul_ps(load_row(x, n, at).0, scale);
        store_row(y, n, at, _mm256_mul_ps(normalized, load_row(weight.as_ptr(), n, at).0));
    }
}

/// `conv::x86::tile` on eight lanes: `rows` ≤ `ROWS` output channels at each of the pair's
/// vectors of sixteen positions in turn (two of eight lanes), six channels at a time, so that
/// their sums, a tap's two input vectors and a weight take fifteen of the sixteen registers.
///
/// # Safety
/// As `conv::tile`'s; the CPU must be `available()`.
pub(super) unsafe fn conv_tile(s: &Shape, (x, w, y): (*const f32, *const f32, *mut f32), pair: &[Positions; 2], rows: usize) {
    for p in pair.iter().filter(|p| p.mask != 0) {
        let mut r = 0;
        while r < rows {
            let m = (rows - r).min(6);
            let (w, y) = (w.add(r * s.channels * 9), y.add(r * s.plane()));
            match m {
                1 => conv_rows::<1>(s, (x, w, y), p),
                2 => conv_rows::<2>(s, (x, w, y), p),
                3 => conv_rows::<3>(s, (x, w, y), p),
                4 => conv_rows::<4>(s, (x, w, y), p),
                5 => conv_rows::<5>(s, (x, w, y), p),
                _ => conv_rows::<6>(s, (x, w, y), p),
            }
            r += m;
        }
    }
}

/// The lanes of two vectors of eight whose bits `mask` sets.
#[target_feature(enable = "avx2")]
unsafe fn bit_lanes(mask: u16) -> [__m256i; 2] {
    let bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    [0, 8].map(|from| {
        let byte = _mm256_set1_epi32(i32::from(mask >> from & 0xff));
        _mm256_cmpeq_epi32(_mm256_and_si256(byte, bits), bits)
    })
}

/// `M` output channels at the sixteen positions `p`: each input channel's nine taps, a tap's
/// inputs loaded under its mask (zeros past the image's edges) times each channel's weight.
#[target_feature(enable = "avx2,fma")]
unsafe fn conv_rows<const M: usize>(s: &Shape, (x, w, y): (*const f32, *const f32, *mut f32), p: &Positions) {
    let plane = s.plane();
    let taps: [[__m256i; 2]; 9] = std::array::from_fn(|t| bit_lanes(p.taps[t].mask));
    let mut sums = [[_mm256_setzero_ps(); 2]; M];
    for c in 0..s.channels {
        let (xc, wc) = (x.add(c * plane), w.add(c * 9));
        for (t, lanes) in taps.iter().enumerate() {
            let at = xc.wrapping_offset(p.taps[t].offset);
            let inputs = [_mm256_maskload_ps(at, lanes[0]), _mm256_maskload_ps(at.wrapping_add(8), lanes[1])];
            for (r, row) in sums.iter_mut().enumerate() {
                let a = _mm256_broadcast_ss(&*wc.add(r * s.channels * 9 + t));
                row[0] = _mm256_fmadd_ps(a, inputs[0], row[0]);
                row[1] = _mm256_fmadd_ps(a, inputs[1], row[1]);
            }
        }
    }
    let out = bit_lanes(p.mask);
    for (r, row) in sums.iter().enumerate() {
        let at = y.add(r * plane + p.at);
        _mm256_maskstore_ps(at, out[0], row[0]);
        _mm256_maskstore_ps(at.add(8), out[1], row[1]);
    }
}

/// `vector_math::softmax_exp` on eight lanes: `2^n` put into the exponent's bits, where
/// AVX-512 has `scalef`, and 0 where `n < -125` (`e^x` below 2^-124, nothing to a sum that holds
/// a 1), which keeps `p 2^n` a normal number. A NaN stays NaN.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_exp(x: __m256) -> __m256 {
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    let clamped = _mm256_max_ps(_mm256_set1_ps(-120.0), x);
    let rounder = _mm256_set1_ps(ROUNDER);
    let n = _mm256_sub_ps(_mm256_fmadd_ps(clamped, _mm256_set1_ps(std::f32::consts::LOG2_E), rounder), rounder);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(std::f32::consts::LN_2), clamped);
    let [highest, lower @ ..] = SOFTMAX_EXP;
    let mut p = _mm256_set1_ps(highest);
    for c in lower {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let scaled = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(n))));
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(n, _mm256_set1_ps(-125.0));
    _mm256_blendv_ps(_mm256_andnot_ps(tiny, scaled), x, nan)
}

/// `attention::exponentials` on eight lanes.
///
/// # Safety
/// `row` must hold `len` ≥ `visible` floats; the CPU must be `available()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exponentials(row: *mut f32, visible: usize, len: usize) -> (f32, f32) {
    let whole = visible - visible % 8;
    let tail = lanes(visible, whole);
    let hidden = _mm256_set1_ps(f32::NEG_INFINITY);
    let (mut max, mut nan) = (hidden, _mm256_setzero_ps());
    let mut scan = |x: __m256| {
        max = _mm256_max_ps(max, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    };
    for at in (0..whole).step_by(8) {
        scan(_mm256_loadu_ps(row.add(at)));
    }
    if whole < visible {
        scan(_mm256_blendv_ps(hidden, _mm256_maskload_ps(row.add(whole), tail), _mm256_castsi256_ps(tail)));
    }
    // A NaN score makes its row NaN, as in eager (`max` drops NaN).
    let max = if _mm256_movemask_ps(nan) != 0 { f32::NAN } else { reduce(max, _mm256_max_ps) };
    let shift = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    for at in (0..whole).step_by(8) {
        let e = softmax_exp(_mm256_sub_ps(_mm256_loadu_ps(row.add(at)), shift));
        _mm256_storeu_ps(row.add(at), e);
        sum = _mm256_add_ps(sum, e);
    }
    if whole < visible {
        let e = softmax_exp(_mm256_sub_ps(_mm256_maskload_ps(row.add(whole), tail), shift));
        _mm256_maskstore_ps(row.add(whole), tail, e);
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(tail)));
    }
    std::ptr::write_bytes(row.add(visible), 0, len - visible);
    (max, reduce(sum, _mm256_add_ps))
}

/// `vector_math::ln` on eight lanes for normal positive `x` (logsumexp's sums, at least 1), its
/// `x = m 2^e` read from the bits where AVX-512 has `getmant` and `getexp`: the same results.
/// A `logf` call per row had been ~0.8 % of a tiny GPT-2's execute at batch 8 (AMD EPYC, Zen 3).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn ln(x: __m256) -> __m256 {
    let bits = _mm256_castps_si256(x);
    let m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007f_ffff)), _mm256_set1_epi32(0x3f80_0000)));
    let e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<23>(bits), _mm256_set1_epi32(127)));
    let big = _mm256_cmp_ps::<_CMP_GT_OQ>(m, _mm256_set1_ps(std::f32::consts::SQRT_2));
    let m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5)), big);
    let e = _mm256_blendv_ps(e, _mm256_add_ps(e, _mm256_set1_ps(1.0)), big);
    let f = _mm256_sub_ps(m, _mm256_set1_ps(1.0));
    let z = _mm256_mul_ps(f, f);
    let [highest, lower @ ..] = LN;
    let mut p = _mm256_set1_ps(highest);
    for c in lower {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
    }
    let y = _mm256_mul_ps(_mm256_mul_ps(p, f), z);
    let y = _mm256_fmadd_ps(e, _mm256_set1_ps(EXP_LN2[1]), y);
    let y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5), z, y);
    _mm256_fmadd_ps(e, _mm256_set1_ps(EXP_LN2[0]), _mm256_add_ps(f, y))
}

/// The eight lanes of `v` combined by `op`, pairwise.
#[target_feature(enable = "avx2")]
unsafe fn reduce(v: __m256, op: unsafe fn(__m256, __m256) -> __m256) -> f32 {
    let halves = op(v, _mm256_permute2f128_ps::<0x01>(v, v));
    let pairs = op(halves, _mm256_permute_ps::<0b01_00_11_10>(halves));
    _mm256_cvtss_f32(op(pairs, _mm256_permute_ps::<0b10_11_00_01>(pairs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile at every width of columns (whole vectors and not, one to four of them) and row
    /// count, against f64 sums; nothing written past the columns or the rows.
    #[test]
    fn tile_agrees_with_f64_sums() {
        if !available() {
            return;
        }
        let mut next = super::super::uniform(3);
        let k = 37;
        let (ldx, ldy) = (k + 3, COLUMNS + 5);
        let x: Vec<f32> = (0..ROWS * ldx).map(|_| next()).collect();
        let panel: Vec<f32> = (0..k * COLUMNS).map(|_| next()).collect();
        for cols in 1..=COLUMNS {
            for rows in 1..=ROWS {
                let mut y = vec![f32::NAN; (ROWS + 1) * ldy];
                let t = Tile { b: panel.as_ptr(), ldb: COLUMNS, k, ldx, ldy, cols };
                unsafe { tile(&t, x.as_ptr(), y.as_mut_ptr(), rows) };
                for i in 0..=ROWS {
                    for j in 0..ldy {
                        let got = y[i * ldy + j];
                        if i < rows && j < cols {
                            let want: f64 = (0..k).map(|kk| f64::from(x[i * ldx + kk]) * f64::from(panel[kk * COLUMNS + j])).sum();
                            assert!((f64::from(got) - want).abs() <= 1e-5 * (k as f64).sqrt(), "{rows} x {cols} at {i},{j}: {got} vs {want}");
                        } else {
                            assert!(got.is_nan(), "{rows} x {cols}: wrote {i},{j}");
                        }
                    }
                }
            }
        }
    }

    /// Rows of a `[N, K]` weight copied into a panel's columns, for every tail of rows and of K;
    /// the columns past `cols` in a block of eight are zeros, past the block untouched.
    #[test]
    fn panels_hold_the_transposed_rows() {
        if !available() {
            return;
        }
        for (k, cols) in [(16, 32), (13, 19), (8, 8), (3, 1), (70, 25)] {
            let ldw = k + 2;
            let w: Vec<f32> = (0..COLUMNS * ldw).map(|i| i as f32).collect();
            let mut panel = vec![-1.0; k * COLUMNS];
            unsafe { pack_transposed((w.as_ptr(), ldw), k, cols, &mut panel) };
            for kk in 0..k {
                for j in 0..COLUMNS {
                    let want = if j < cols { w[j * ldw + kk] } else if j < cols.next_multiple_of(8) { 0.0 } else { -1.0 };
                    assert_eq!(panel[kk * COLUMNS + j], want, "k {k} cols {cols} at {kk},{j}");
                }
            }
        }
    }

    /// `tiles` over any number of rows is `tile` twelve rows at a time, bit for bit: a whole
    /// panel's six rows by both halves, and a narrow panel's.
    #[test]
    fn tiles_are_tile_twelve_rows_at_a_time() {
        if !available() {
            return;
        }
        let mut next = super::super::uniform(13);
        let (k, rows) = (21, 29);
        let (ldx, ldy) = (k + 1, COLUMNS + 3);
        let x: Vec<f32> = (0..rows * ldx).map(|_| next()).collect();
        let panel: Vec<f32> = (0..k * COLUMNS).map(|_| next()).collect();
        for cols in [COLUMNS, 20] {
            let t = Tile { b: panel.as_ptr(), ldb: COLUMNS, k, ldx, ldy, cols };
            let (mut got, mut want) = (vec![f32::NAN; rows * ldy], vec![f32::NAN; rows * ldy]);
            unsafe {
                tiles(&t, x.as_ptr(), got.as_mut_ptr(), rows);
                for r in (0..rows).step_by(ROWS) {
                    tile(&t, x.as_ptr().add(r * ldx), want.as_mut_ptr().add(r * ldy), ROWS.min(rows - r));
                }
            }
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{cols} columns");
        }
    }

    /// `exp_normal` against f64's over `[-87, 88]`, within 2 ulp; `clamp_normal` puts the rest,
    /// infinities and NaN there.
    #[test]
    fn exp_is_within_two_ulp() {
        if !available() {
            return;
        }
        let on_lanes = |values: &[f32], f: unsafe fn(__m256) -> __m256| -> Vec<f32> {
            values.chunks(8).flat_map(|chunk| {
                let mut lanes = [0f32; 8];
                lanes[..chunk.len()].copy_from_slice(chunk);
                let got: [f32; 8] = unsafe { std::mem::transmute(f(std::mem::transmute::<[f32; 8], __m256>(lanes))) };
                got.into_iter().take(chunk.len()).collect::<Vec<_>>()
            }).collect()
        };
        let values: Vec<f32> = (-8700..=8800).map(|i| i as f32 * 0.01 + 0.003).filter(|v| *v <= 88.0).collect();
        for (&v, got) in values.iter().zip(on_lanes(&values, |x| unsafe { exp_normal([x])[0] })) {
            let want = f64::from(v).exp();
            assert!((f64::from(got) - want).abs() <= 2.0 * f64::from(f32::EPSILON) * want, "e^{v}: {got} against {want}");
        }
        let special = [f32::NEG_INFINITY, -200.0, f32::INFINITY, 89.0, f32::NAN, 0.0, -87.0, 88.0];
        assert_eq!(on_lanes(&special, |x| unsafe { clamp_normal(x, 88.0) }), [-87.0, -87.0, 88.0, 88.0, -87.0, 0.0, -87.0, 88.0]);
    }

    /// A row's exponentials and their sum against f64's, the scores past `visible` zeroed; -inf
    /// gives 0, a NaN makes the row's max NaN, a row all -inf has max -inf.
    #[test]
    fn exponentials_agree_with_f64() {
        if !available() {
            return;
        }
        let mut next = super::super::uniform(9);
        for (visible, len) in [(1, 8), (7, 9), (8, 8), (29, 40), (64, 64), (100, 130)] {
            let scores: Vec<f32> = (0..len).map(|i| if i % 5 == 3 { f32::NEG_INFINITY } else { 12.0 * next() }).collect();
            let mut row = scores.clone();
            let (max, sum) = unsafe { exponentials(row.as_mut_ptr(), visible, len) };
            let want_max = scores[..visible].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max, want_max);
            // Of the difference as f32 rounds it, which the kernel takes.
            let exact: Vec<f64> = scores[..visible].iter().map(|&s| f64::from(s - max).exp()).collect();
            for (i, (&got, want)) in row.iter().zip(&exact).enumerate() {
                // 2 ulp from 1 down to 2^-24, 5 below (`softmax_exp`'s bounds), with room for the f64 rounding.
                let ulps = if *want >= 2f64.powi(-24) { 2.5 } else { 5.5 };
                assert!((f64::from(got) - want).abs() <= ulps * f64::from(f32::EPSILON) * want, "{visible}/{len} at {i}: {got} vs {want}");
            }
            assert!(row[visible..].iter().all(|&e| e == 0.0), "{visible}/{len}: past the visible keys");
            let want_sum: f64 = exact.iter().sum();
            assert!((f64::from(sum) - want_sum).abs() <= 1e-6 * want_sum, "{visible}/{len}: sum {sum} vs {want_sum}");
        }
        let mut row = vec![0.5, f32::NAN, 1.0];
        assert!(unsafe { exponentials(row.as_mut_ptr(), 3, 3) }.0.is_nan());
        let mut row = vec![f32::NEG_INFINITY; 11];
        assert_eq!(unsafe { exponentials(row.as_mut_ptr(), 11, 11) }.0, f32::NEG_INFINITY);
    }

    /// Logs of sums from 1 to 2^17 (the most keys the attention kernel takes, and on both sides
    /// of √2 and of powers of two), within 2 ulp of f64's, and AVX-512's bits where it runs.
    #[test]
    fn ln_agrees_with_f64() {
        if !available() {
            return;
        }
        let mut next = super::super::uniform(3);
        let sqrt2 = std::f32::consts::SQRT_2;
        let mut xs: Vec<f32> = vec![1.0, 1.0 + f32::EPSILON, sqrt2.next_down(), sqrt2, sqrt2.next_up(), 2.0, 3.0, 1023.5, 65536.0, 131072.0];
        xs.extend((0..1000).map(|_| 2f32.powf(17.0 * (next() + 0.5))));
        for chunk in xs.chunks(8) {
            let mut lanes = [1f32; 8];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let got: [f32; 8] = unsafe { std::mem::transmute(ln(_mm256_loadu_ps(lanes.as_ptr()))) };
            for (&x, &g) in lanes.iter().zip(&got) {
                let want = f64::from(x).ln();
                assert!((f64::from(g) - want).abs() <= 2.0 * f64::from(f32::EPSILON) * want, "ln({x}) = {g}, not {want}");
            }
            if super::super::gemm::avx512() {
                let mut sixteen = [1f32; 16];
                sixteen[..8].copy_from_slice(&lanes);
                let wide: [f32; 16] = unsafe { std::mem::transmute(super::super::vector_math::ln(_mm512_loadu_ps(sixteen.as_ptr()))) };
                assert_eq!(wide[..8], got, "AVX-512's");
            }
        }
    }
}
