//! f32 LayerNorm and RMSNorm over the last dim, each as one kernel: XLA:CPU runs LayerNorm as
//! five ops, each a thunk of its own (a YNNPACK reduction for the mean, `x − mean`, another
//! reduction for the variance, `rsqrt`, the affine), which on a small model's rows cost more
//! than their arithmetic: over `[1024, 64]` they took 78 µs beyond the add before them, this
//! kernel 25. An RMSNorm was four (the squares, their sum, `rsqrt`, the scaling).
//!
//! A LayerNorm reads each row three times from L1 (for its mean, its variance about it: the
//! two-pass form XLA's was, and the output), an RMSNorm twice; each writes it once.

use super::pool::Chunked;

/// Values per unit of work: fewer run on one thread (a `[1024, 64]` norm is 64 Ki).
const VALUES_PER_CHUNK: usize = 1 << 17;
/// The same on AVX2, whose rows take twice the instructions: there a `[1024, 64]` norm split
/// over both threads of an AMD EPYC Zen 3 took tiny GPT-2's and Llama's batch-8 bare executes
/// (five norms each, in turns, 400 rounds) 3.70 → 3.45 and 3.43 → 3.21 ms.
const AVX2_VALUES_PER_CHUNK: usize = 1 << 15;

/// `y = (x − mean) · rstd · weight + bias` for each row of `x` `[rows, n]`, with the row's mean
/// and `rstd = 1 / sqrt(var + eps)` (biased variance) into `mean` and `rstd` `[rows]`; then, with
/// a `modulation`, `y · factor + shift`.
pub(super) struct LayerNorm {
    pub x: *const u8,
    pub weight: *const f32,
    pub bias: *const f32,
    pub y: *mut u8,
    /// `x` and `y` bf16 (computed in f32, `y` rounded once), not f32.
    pub half: bool,
    pub mean: *mut f32,
    pub rstd: *mut f32,
    pub rows: usize,
    pub n: usize,
    pub eps: f32,
    pub modulation: Option<Modulation>,
}

/// A diffusion transformer's modulation of its norm (`norm(x) · (1 + scale) + shift`, the
/// `1 + scale` computed before): `factor` and `shift` `[batches, n]`, a batch's rows `per_batch`
/// consecutive rows of `y`. Each step rounds as eager's ops do (to bf16 for bf16 rows: the norm,
/// its product by the factor, the sum).
#[derive(Clone, Copy)]
pub(super) struct Modulation {
    pub factor: *const f32,
    pub shift: *const f32,
    pub per_batch: usize,
}

/// `y = x · rstd · weight`, `rstd = 1 / sqrt(mean(x²) + eps)` for each row of `x` `[rows, n]`
/// (transformers' and diffusers' RMSNorm, rounded where theirs is: after `rstd`, after `x ·
/// rstd`, after the weight; for bf16 rows, computed in f32, `x · rstd` rounded to bf16 before
/// the weight and the result after it).
pub(super) struct RmsNorm {
    pub x: *const u8,
    pub weight: *const f32,
    pub y: *mut u8,
    /// `x` and `y` bf16, not f32.
    pub half: bool,
    pub rows: usize,
    pub n: usize,
    pub eps: f32,
}

/// A norm of rows, which units of work split.
pub(super) trait Rows {
    /// `(rows, n)`.
    fn shape(&self) -> (usize, usize);

    /// Rows `first..first + count`.
    ///
    /// # Safety
    /// The pointers must cover the shapes, and the CPU run the tile (`gemm::available()`); bf16
    /// rows (`half`) need AVX-512 (`gemm::avx512()`).
    unsafe fn rows(&self, first: usize, count: usize);

    /// Units of work for up to `threads`: runs of whole rows.
    fn units(&self, threads: usize) -> usize {
        let (rows, n) = self.shape();
        let per_chunk = if super::gemm::avx512() { VALUES_PER_CHUNK } else { AVX2_VALUES_PER_CHUNK };
        (rows * n / per_chunk).clamp(1, threads.max(1)).min(rows.max(1))
    }
}

impl Rows for RmsNorm {
    fn shape(&self) -> (usize, usize) {
        (self.rows, self.n)
    }

    unsafe fn rows(&self, first: usize, count: usize) {
        let weight = std::slice::from_raw_parts(self.weight, self.n);
        let bytes = if self.half { 2 } else { 4 };
        let avx512 = super::gemm::avx512();
        debug_assert!(avx512 || !self.half, "bf16 rows need AVX-512");
        for r in first..first + count {
            let (x, y) = (self.x.add(r * self.n * bytes), self.y.add(r * self.n * bytes));
            if avx512 {
                x86::rms_row((x, y, self.half), self.n, weight, self.eps);
            } else {
                super::avx2::rms_row((x as *const f32, y as *mut f32), self.n, weight, self.eps);
            }
        }
    }
}

impl Rows for LayerNorm {
    fn shape(&self) -> (usize, usize) {
        (self.rows, self.n)
    }

    unsafe fn rows(&self, first: usize, count: usize) {
        let weight = std::slice::from_raw_parts(self.weight, self.n);
        let bias = std::slice::from_raw_parts(self.bias, self.n);
        let bytes = if self.half { 2 } else { 4 };
        let avx512 = super::gemm::avx512();
        debug_assert!(avx512 || !self.half, "bf16 rows need AVX-512");
        let row = |r: usize| (self.x.add(r * self.n * bytes), self.y.add(r * self.n * bytes));
        let modulation = |r: usize| {
            self.modulation.map(|m| {
                let batch = r / m.per_batch.max(1);
                (std::slice::from_raw_parts(m.factor.add(batch * self.n), self.n), std::slice::from_raw_parts(m.shift.add(batch * self.n), self.n))
            })
        };
        let keep = |r: usize, (mean, rstd): (f32, f32)| {
            *self.mean.add(r) = mean;
            *self.rstd.add(r) = rstd;
        };
        if !avx512 {
            // Four rows at a time (`avx2::layer_norm_rows`), those left one by one.
            let f32_row = |r: usize| {
                let (x, y) = row(r);
                (x as *const f32, y as *mut f32)
            };
            let mut r = first;
            while r + 4 <= first + count {
                let stats = super::avx2::layer_norm_rows::<4>(std::array::from_fn(|i| f32_row(r + i)), self.n, (weight, bias), std::array::from_fn(|i| modulation(r + i)), self.eps);
                stats.into_iter().enumerate().for_each(|(i, stats)| keep(r + i, stats));
                r += 4;
            }
            for r in r..first + count {
                let [stats] = super::avx2::layer_norm_rows([f32_row(r)], self.n, (weight, bias), [modulation(r)], self.eps);
                keep(r, stats);
            }
            return;
        }
        for r in first..first + count {
            let (x, y) = row(r);
            keep(r, x86::row((x, y, self.half), self.n, (weight, bias), modulation(r), self.eps));
        }
    }
}

/// A norm cut into `units` runs of rows.
pub(super) struct RowRuns<T>(pub T, pub usize);

impl<T: Rows> Chunked for RowRuns<T> {
    /// # Safety
    /// The pointers must cover the shapes; units write disjoint rows.
    unsafe fn chunk(&self, unit: usize) {
        let rows = self.0.shape().0;
        let per = rows.div_ceil(self.1);
        let first = unit * per;
        self.0.rows(first, per.min(rows.saturating_sub(first)));
    }
}

mod x86 {
    use super::super::vector_math::{lanes, rounded_bf16, through_bf16, widened_bf16};
    use std::arch::x86_64::*;

    /// One row: its mean and rstd, and `y` normalized. The lanes are summed as a tree (one by one,
    /// sixteen dependent adds a row made a `[264, 32]` norm slower than XLA's five ops), about
    /// the row's first value: a residual stream's rows share a large offset, whose sum would
    /// round away the mean's last bits (3x eager's error over rows of 35 about 50).
    ///
    /// `x` and `y` (`n` values) are f32, or bf16 with `half`: widened as loaded, `y` rounded to
    /// the nearest even as stored (NaN kept NaN). A `modulation`'s factor and shift (this row's)
    /// follow the norm, a rounding after each (`Modulation`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn row(
        (x, y, half): (*const u8, *mut u8, bool),
        n: usize,
        (weight, bias): (&[f32], &[f32]),
        modulation: Option<(&[f32], &[f32])>,
        eps: f32,
    ) -> (f32, f32) {
        let mask = |at: usize| lanes(n, at);
        let load = |p: &[f32], at: usize| _mm512_maskz_loadu_ps(mask(at), p.as_ptr().add(at));
        let load_x = |at: usize| load_row(x, half, n, at);
        let shift = _mm512_set1_ps(if n == 0 { 0.0 } else { _mm_cvtss_f32(_mm512_castps512_ps128(load_x(0))) });
        let mut sum = _mm512_setzero_ps();
        for at in (0..n).step_by(16) {
            sum = _mm512_add_ps(sum, _mm512_maskz_sub_ps(mask(at), load_x(at), shift));
        }
        let mean = _mm512_add_ps(shift, _mm512_set1_ps(_mm512_reduce_add_ps(sum) / n as f32));
        let mut squares = _mm512_setzero_ps();
        for at in (0..n).step_by(16) {
            let d = _mm512_maskz_sub_ps(mask(at), load_x(at), mean);
            squares = _mm512_fmadd_ps(d, d, squares);
        }
        let rstd = 1.0 / (_mm512_reduce_add_ps(squares) / n as f32 + eps).sqrt();
        let scale = _mm512_set1_ps(rstd);
        for at in (0..n).step_by(16) {
            let normalized = _mm512_mul_ps(_mm512_sub_ps(load_x(at), mean), scale);
            let mut out = _mm512_fmadd_ps(normalized, load(weight, at), load(bias, at));
            if let Some((factor, shift)) = modulation {
                out = _mm512_add_ps(kept(half, _mm512_mul_ps(kept(half, out), load(factor, at))), load(shift, at));
            }
            store_row(y, half, n, at, out);
        }
        (_mm_cvtss_f32(_mm512_castps512_ps128(mean)), rstd)
    }

    /// One row of an RMSNorm into `y` (f32, or bf16 with `half` as `row`'s). The squares are
    /// summed unrounded, in four sums (a 576-wide row is 36 vectors: one sum would wait on each
    /// add before it).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn rms_row((x, y, half): (*const u8, *mut u8, bool), n: usize, weight: &[f32], eps: f32) {
        let mask = |at: usize| lanes(n, at);
        let mut sums = [_mm512_setzero_ps(); 4];
        for (i, at) in (0..n).step_by(16).enumerate() {
            let v = load_row(x, half, n, at);
            sums[i % 4] = _mm512_fmadd_ps(v, v, sums[i % 4]);
        }
        let squares = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
        let scale = _mm512_set1_ps(1.0 / (_mm512_reduce_add_ps(squares) / n as f32 + eps).sqrt());
        for at in (0..n).step_by(16) {
            let normalized = kept(half, _mm512_mul_ps(load_row(x, half, n, at), scale));
            let out = _mm512_mul_ps(normalized, _mm512_maskz_loadu_ps(mask(at), weight.as_ptr().add(at)));
            store_row(y, half, n, at, out);
        }
    }

    /// `v` as a row of f32s keeps it, or of bf16s (`half`): rounded to the nearest even.
    #[target_feature(enable = "avx512f")]
    unsafe fn kept(half: bool, v: __m512) -> __m512 {
        if half {
            through_bf16(v)
        } else {
            v
        }
    }

    /// Values `at..at + 16` (within `n`) of a row of f32s, or of bf16s widened (`half`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_row(x: *const u8, half: bool, n: usize, at: usize) -> __m512 {
        if half {
            widened_bf16(_mm256_maskz_loadu_epi16(lanes(n, at), x.add(2 * at) as *const i16))
        } else {
            _mm512_maskz_loadu_ps(lanes(n, at), x.add(4 * at) as *const f32)
        }
    }

    /// `out` into values `at..at + 16` (within `n`) of a row of f32s, or of bf16s rounded to
    /// the nearest even (NaN kept NaN).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn store_row(y: *mut u8, half: bool, n: usize, at: usize, out: __m512) {
        if half {
            _mm512_mask_cvtepi32_storeu_epi16(y.add(2 * at) as *mut i16, lanes(n, at), rounded_bf16(out));
        } else {
            _mm512_mask_storeu_ps(y.add(4 * at) as *mut f32, lanes(n, at), out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of `norm`, in `runs` runs one after another.
    fn run_all<T: Rows>(norm: T, runs: usize) {
        let units = RowRuns(norm, runs);
        (0..units.1).for_each(|u| unsafe { units.chunk(u) });
    }

    /// A LayerNorm of `x` into `y` (`[rows, n]`, bf16 with `half`) in `runs` runs: each row's
    /// mean and rstd.
    fn layer_norm((x, y, half): (*const u8, *mut u8, bool), (weight, bias): (&[f32], &[f32]), (rows, n, eps): (usize, usize, f32), modulation: Option<Modulation>, runs: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut mean, mut rstd) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
        run_all(LayerNorm { x, weight: weight.as_ptr(), bias: bias.as_ptr(), y, half, mean: mean.as_mut_ptr(), rstd: rstd.as_mut_ptr(), rows, n, eps, modulation }, runs);
        (mean, rstd)
    }

    /// Rows of several widths (off the 16 lanes too) with a large common offset, against f64.
    #[test]
    fn agrees_with_f64() {
        if !super::super::gemm::available() {
            return;
        }
        let mut next = super::super::uniform(5);
        for (rows, n) in [(7, 64), (3, 33), (2, 1), (300, 48)] {
            let x: Vec<f32> = (0..rows * n).map(|_| 100.0 + next()).collect();
            let (weight, bias): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (1.0 + next(), next())).unzip();
            let mut y = vec![f32::NAN; rows * n];
            let (mean, rstd) = layer_norm((x.as_ptr() as *const u8, y.as_mut_ptr() as *mut u8, false), (&weight, &bias), (rows, n, 1e-5), None, 3.min(rows));
            for r in 0..rows {
                let row: Vec<f64> = x[r * n..(r + 1) * n].iter().map(|&v| f64::from(v)).collect();
                let m = row.iter().sum::<f64>() / n as f64;
                let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n as f64;
                let s = 1.0 / (var + 1e-5).sqrt();
                assert!((f64::from(mean[r]) - m).abs() < 1e-5 * m.abs(), "mean {} vs {m}", mean[r]);
                assert!((f64::from(rstd[r]) - s).abs() < 1e-4 * s, "rstd {} vs {s}", rstd[r]);
                for j in 0..n {
                    let want = (row[j] - m) * s * f64::from(weight[j]) + f64::from(bias[j]);
                    assert!((f64::from(y[r * n + j]) - want).abs() < 3e-4, "{rows}x{n} at {r},{j}: {} vs {want}", y[r * n + j]);
                }
            }
        }
    }

    /// bf16 rows (a common offset too) into bf16: the f32 result of the widened values, rounded
    /// once, within half a bf16 step and f32's rounding of the f64 value.
    #[test]
    fn bf16_rows_round_once() {
        if !super::super::gemm::avx512() {
            return;
        }
        let mut next = super::super::uniform(3);
        let (bf16, value) = (super::super::f32_to_bf16, super::super::bf16_to_f32);
        for (rows, n) in [(5, 64), (3, 33), (2, 1), (40, 1536)] {
            let x: Vec<u16> = (0..rows * n).map(|_| bf16(8.0 + 2.0 * next())).collect();
            let (weight, bias): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (1.0 + next(), next())).unzip();
            let mut y = vec![0u16; rows * n];
            let (mean, rstd) = layer_norm((x.as_ptr() as *const u8, y.as_mut_ptr() as *mut u8, true), (&weight, &bias), (rows, n, 1e-6), None, 2.min(rows));
            for r in 0..rows {
                let row: Vec<f64> = x[r * n..(r + 1) * n].iter().map(|&v| f64::from(value(v))).collect();
                let m = row.iter().sum::<f64>() / n as f64;
                let s = 1.0 / (row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n as f64 + 1e-6).sqrt();
                assert!((f64::from(mean[r]) - m).abs() < 1e-5 * m.abs() && (f64::from(rstd[r]) - s).abs() < 1e-4 * s);
                for j in 0..n {
                    let want = (row[j] - m) * s * f64::from(weight[j]) + f64::from(bias[j]);
                    let got = f64::from(value(y[r * n + j]));
                    assert!((got - want).abs() <= want.abs() / 256.0 + 1e-4 * (1.0 + s), "{rows}x{n} at {r},{j}: {got} vs {want}");
                }
            }
        }
    }

    /// A modulated norm (two batches of three rows) is the plain norm's rows, times the batch's
    /// factor, plus its shift, each step rounded as the row's type: bit for bit, f32 and (on
    /// AVX-512) bf16.
    #[test]
    fn modulated_rows_are_the_norm_then_each_rounded_step() {
        if !super::super::gemm::available() {
            return;
        }
        let mut next = super::super::uniform(17);
        let (bf16, value) = (super::super::f32_to_bf16, super::super::bf16_to_f32);
        let (rows, n, batches) = (6, 40, 2);
        let (weight, bias): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (1.0 + next(), next())).unzip();
        let (factor, shift): (Vec<f32>, Vec<f32>) = (0..batches * n).map(|_| (value(bf16(1.0 + next())), value(bf16(next())))).unzip();
        for half in [false, true].into_iter().filter(|&half| !half || super::super::gemm::avx512()) {
            let bytes = if half { 2 } else { 4 };
            let x: Vec<u16> = (0..rows * n * bytes / 2).map(|_| bf16(3.0 * next())).collect();
            let run = |modulation| {
                let mut y = vec![0u16; rows * n * bytes / 2];
                layer_norm((x.as_ptr() as *const u8, y.as_mut_ptr() as *mut u8, half), (&weight, &bias), (rows, n, 1e-6), modulation, 2);
                y
            };
            let (plain, modulated) = (run(None), run(Some(Modulation { factor: factor.as_ptr(), shift: shift.as_ptr(), per_batch: rows / batches })));
            for r in 0..rows {
                for j in 0..n {
                    let (f, s) = (factor[r / 3 * n + j], shift[r / 3 * n + j]);
                    if half {
                        let want = bf16(value(bf16(value(plain[r * n + j]) * f)) + s);
                        assert_eq!(modulated[r * n + j], want, "bf16 at {r},{j}");
                    } else {
                        let at = |y: &[u16], i: usize| f32::from_bits(u32::from(y[2 * i]) | u32::from(y[2 * i + 1]) << 16);
                        assert_eq!(at(&modulated, r * n + j), at(&plain, r * n + j) * f + s, "f32 at {r},{j}");
                    }
                }
            }
        }
    }

    /// Eleven rows in one run (on AVX2 two groups of four rows at once, then three alone) are
    /// bit for bit the rows each in a run of its own, modulated or not.
    #[test]
    fn layer_norm_rows_taken_together_are_each_row_alone() {
        if !super::super::gemm::available() {
            return;
        }
        let mut next = super::super::uniform(23);
        let (rows, n) = (11, 72);
        let x: Vec<f32> = (0..rows * n).map(|_| 50.0 + 4.0 * next()).collect();
        let (weight, bias): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (1.0 + next(), next())).unzip();
        let (factor, shift): (Vec<f32>, Vec<f32>) = (0..4 * n).map(|_| (1.0 + next(), next())).unzip();
        let bits = |y: &[f32]| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for modulation in [None, Some(Modulation { factor: factor.as_ptr(), shift: shift.as_ptr(), per_batch: 3 })] {
            let run = |runs| {
                let mut y = vec![f32::NAN; rows * n];
                let stats = layer_norm((x.as_ptr() as *const u8, y.as_mut_ptr() as *mut u8, false), (&weight, &bias), (rows, n, 1e-5), modulation, runs);
                (bits(&y), bits(&stats.0), bits(&stats.1))
            };
            assert!(run(1) == run(rows), "modulated: {}", modulation.is_some());
        }
    }

    /// RMSNorm rows of several widths (off the 16 lanes and the four sums too), against f64;
    /// a row with a NaN is NaN, one with an infinity NaN there and 0 elsewhere (`x · rsqrt(∞)`).
    #[test]
    fn rms_agrees_with_f64() {
        if !super::super::gemm::available() {
            return;
        }
        let mut next = super::super::uniform(7);
        for (rows, n) in [(5, 64), (3, 33), (2, 1), (4, 8), (9, 576), (300, 48)] {
            let x: Vec<f32> = (0..rows * n).map(|_| 4.0 * next()).collect();
            let weight: Vec<f32> = (0..n).map(|_| 1.0 + next()).collect();
            let mut y = vec![f32::NAN; rows * n];
            let norm = RmsNorm { x: x.as_ptr() as *const u8, weight: weight.as_ptr(), y: y.as_mut_ptr() as *mut u8, half: false, rows, n, eps: 1e-6 };
            run_all(norm, 3.min(rows));
            for r in 0..rows {
                let row: Vec<f64> = x[r * n..(r + 1) * n].iter().map(|&v| f64::from(v)).collect();
                let s = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / n as f64 + 1e-6).sqrt();
                for j in 0..n {
                    let want = row[j] * s * f64::from(weight[j]);
                    assert!((f64::from(y[r * n + j]) - want).abs() < 1e-6 * (1.0 + want.abs()), "{rows}x{n} at {r},{j}: {} vs {want}", y[r * n + j]);
                }
            }
        }
    }

    /// bf16 RMSNorm rows (a bf16 weight, widened): `x · rstd` rounded to bf16, times the weight
    /// rounded again, as transformers' bf16 RMSNorm; within a bf16 step of that computed with
    /// f64's rstd (a rounding tie may fall the other way).
    #[test]
    fn bf16_rms_rounds_before_and_after_the_weight() {
        if !super::super::gemm::avx512() {
            return;
        }
        let mut next = super::super::uniform(11);
        let (bf16, value) = (super::super::f32_to_bf16, super::super::bf16_to_f32);
        for (rows, n) in [(5, 576), (3, 33), (2, 1), (40, 64)] {
            let x: Vec<u16> = (0..rows * n).map(|_| bf16(4.0 * next())).collect();
            let weight: Vec<f32> = (0..n).map(|_| value(bf16(1.0 + next()))).collect();
            let mut y = vec![0u16; rows * n];
            let norm = RmsNorm { x: x.as_ptr() as *const u8, weight: weight.as_ptr(), y: y.as_mut_ptr() as *mut u8, half: true, rows, n, eps: 1e-6 };
            run_all(norm, 2.min(rows));
            for r in 0..rows {
                let row: Vec<f64> = x[r * n..(r + 1) * n].iter().map(|&v| f64::from(value(v))).collect();
                let s = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / n as f64 + 1e-6).sqrt();
                for j in 0..n {
                    let want = value(bf16(value(bf16((row[j] * s) as f32)) * weight[j]));
                    let got = value(y[r * n + j]);
                    assert!((got - want).abs() <= want.abs() / 128.0, "{rows}x{n} at {r},{j}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn rms_of_a_row_with_nan_or_infinity() {
        if !super::super::gemm::available() {
            return;
        }
        let mut x: Vec<f32> = (0..3 * 20).map(|i| i as f32 - 7.0).collect();
        (x[3], x[20 + 5]) = (f32::NAN, f32::INFINITY);
        let weight = [2.0f32; 20];
        let mut y = vec![0.5f32; 60];
        let norm = RowRuns(RmsNorm { x: x.as_ptr() as *const u8, weight: weight.as_ptr(), y: y.as_mut_ptr() as *mut u8, half: false, rows: 3, n: 20, eps: 1e-6 }, 1);
        unsafe { norm.chunk(0) };
        assert!(y[..20].iter().all(|v| v.is_nan()));
        assert!(y[25].is_nan() && y[20..40].iter().enumerate().all(|(j, &v)| j == 5 || v == 0.0));
        assert!(y[40..].iter().all(|v| v.is_finite()));
    }
}
