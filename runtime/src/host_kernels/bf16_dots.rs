//! bf16 products in the tiles' layouts on AVX-512 BF16's `vdpbf16ps`, where a CPU has no AMX
//! (AMD since Zen 4, Intel's Cooper Lake): every bf16 kernel built on `amx::x86::products` (the
//! products with their bias, GELU or SiLU on the way out, attention) runs there too.
//!
//! A weight tile's row (`amx::pack`: one pair of K for 16 columns) is one vector; a pair of x's
//! K (`amx::x86::split`'s rows), broadcast, multiplies it into 16 f32 sums. Summed in f32 from
//! exact products, with subnormals flushed, as the tiles sum.

use super::amx::TILE;
use std::arch::x86_64::*;
use std::mem::transmute;

/// Rows whose sums one pass keeps in registers: 8 rows by a block's 32 columns are 16 of
/// AVX-512's 32 vectors, enough independent sums to keep one `vdpbf16ps` starting each cycle.
pub(super) const ROWS: usize = 8;
/// Bytes of one tile: 16 rows of 64.
const TILE_BYTES: usize = TILE * 64;

/// Whether this CPU has the instructions (and those `amx::x86`'s packing and rows use).
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// The f32 sums of `rows` (at most 32) split rows of x by one column block of the weight, into
/// `partial` (`[32, 32]`, row-major), what the tiles' four sums hold after a block's steps.
///
/// `x` is the first row's tile at step 0 (a row tile's steps `TILE_BYTES` apart, the second
/// row tile `second_tile` bytes after the first); `w` is the block's first step (its two
/// halves `TILE_BYTES` apart, steps `step_bytes` apart).
///
/// # Safety
/// Both operands must cover `steps` steps, rows up to the next multiple of `ROWS` included (the
/// split rows are zero past the last), and the CPU must be `available()`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn block_sums(x: *const u8, second_tile: usize, (w, step_bytes): (*const u8, usize), steps: usize, rows: usize, partial: *mut f32) {
    for first in (0..rows).step_by(ROWS) {
        let x = x.add((first / TILE) * second_tile + (first % TILE) * 64);
        let mut sums = [[_mm512_setzero_ps(); 2]; ROWS];
        for step in 0..steps {
            let (w, x) = (w.add(step * step_bytes), x.add(step * TILE_BYTES));
            // A step's 16 pairs of K unrolled: every address a constant offset from `w` and `x`.
            for pair in 0..TILE {
                let halves: [__m512bh; 2] = [0, 1].map(|h| transmute(_mm512_loadu_si512(w.add(h * TILE_BYTES + pair * 64) as *const __m512i)));
                for (r, row) in sums.iter_mut().enumerate() {
                    let pair: __m512bh = transmute(_mm512_set1_epi32((x.add(r * 64 + pair * 4) as *const i32).read_unaligned()));
                    for (sum, &half) in row.iter_mut().zip(&halves) {
                        *sum = _mm512_dpbf16_ps(*sum, half, pair);
                    }
                }
            }
        }
        for (r, row) in sums.iter().enumerate() {
            for (h, &sum) in row.iter().enumerate() {
                _mm512_storeu_ps(partial.add((first + r) * 2 * TILE + h * TILE), sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::amx::{self, x86::split, Values};
    use super::super::{bf16_to_f32, f32_to_bf16, uniform, Layout};
    use super::*;

    /// One column block's sums against f64 for row counts on and off `ROWS` and K off the
    /// steps (also where AMX would take them: this engine is what a CPU without it runs).
    #[test]
    fn block_sums_are_the_f32_sums_of_the_bf16_products() {
        if !available() {
            return;
        }
        let mut next = uniform(5);
        let value = |b: u16| f64::from(bf16_to_f32(b));
        for (rows, k) in [(32, 64), (27, 70), (8, 33), (3, 1usize)] {
            let (n, steps) = (2 * TILE, k.div_ceil(amx::STEP));
            let x: Vec<u16> = (0..rows * k).map(|_| f32_to_bf16(next() * 3.0)).collect();
            let w: Vec<u16> = (0..n * k).map(|_| f32_to_bf16(next())).collect();
            let pieces = unsafe { amx::pack(w.as_ptr() as *const u8, (n, k), Layout::RowPerOutput, Values::Bf16) }.unwrap();
            let lda = steps * amx::STEP;
            let mut a = vec![0u16; 2 * TILE * lda];
            let mut partial = vec![f32::NAN; 2 * TILE * 2 * TILE];
            unsafe {
                assert!(split(x.as_ptr() as *const u8, Values::Bf16, k, rows, &mut a, 2 * TILE * lda, lda));
                block_sums(a.as_ptr() as *const u8, 2 * TILE * lda, (pieces.as_ptr() as *const u8, 2 * TILE_BYTES), steps, rows, partial.as_mut_ptr());
            }
            for i in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k).map(|kk| value(x[i * k + kk]) * value(w[j * k + kk])).sum();
                    let got = f64::from(partial[i * n + j]);
                    assert!((got - want).abs() <= 1e-6 * (k as f64).sqrt() * 3.0, "{rows}x{k} at {i},{j}: {got} vs {want}");
                }
            }
        }
    }
}
