//! f32 products on AMX's bf16 tiles (Intel Xeon since Sapphire Rapids) at f32's accuracy.
//!
//! An f32 value is the exact sum of three bf16 pieces (its mantissa's top 8 bits, the next 8,
//! the last 8), so `x · w` is the sum of nine piece products, each exact in f32; the six that
//! matter at f32's precision (`x1w1 + x1w2 + x2w1 + x1w3 + x2w2 + x3w1`; the dropped three are
//! below 2⁻²⁴ of `|x||w|`) are tile products, accumulated in f32 as the vector kernel does.
//! A tile product does 16 × 16 × 32 multiply-adds in 16 cycles: 512 a cycle where AVX-512 does
//! 32 in f32, so even six of them are 2.7 times its peak.
//!
//! Only finite operands take this form: an infinite `x` would meet `w`'s zero pieces (`∞ · 0`)
//! where the f32 product has none. The tiles flush subnormal pieces and products to zero, which
//! moves results only for operands below ~1e-33.
//!
//! bf16 products (one piece each) run in the same layouts on CPUs without the tiles too, on
//! AVX-512 BF16's vector dot products (`bf16_dots`).

use super::epilogue::Epilogue;
use super::gemm::{Line, Lines, COLUMNS};
use super::{Layout, Out};
#[cfg(target_arch = "x86_64")]
use std::arch::asm;
#[cfg(target_arch = "x86_64")]
use std::cell::RefCell;
#[cfg(target_arch = "x86_64")]
use std::ops::Range;
use std::sync::OnceLock;

/// Rows (and result columns) of a tile, and the bf16 values of K a tile row holds.
pub(super) const TILE: usize = 16;
pub(super) const STEP: usize = 32;
/// Lines in one tile (16 rows of 64 bytes).
const TILE_LINES: usize = 16;
/// Bytes of `x`'s pieces a group of rows may take (half of L1's 48 KiB).
const L1_ROWS_BYTES: usize = 24 << 10;
/// Bytes of pieces (half of L2's 2 MiB) that stay in L2 while the other operand's pass by.
pub(super) const L2_SHARE_BYTES: usize = 1 << 20;
/// The same for the vector dot products (`bf16_dots`), 16 times slower than the tiles: a group
/// of x's rows this large comes from L3 fast enough for them, and each group reads a large
/// weight once more (on Zen 4, L2 1 MiB: `[1178, 6144] x [6144, 1536]` in groups of 1 MiB 76-80
/// ms, of 2 MiB 61, XLA's 70-75; `[1178, 1536] x [1536, 6144]` 62-75 → 54-58, XLA's 56-58).
const VECTOR_GROUP_BYTES: usize = 2 << 20;

/// Whether products run on the tiles here: the CPU has AMX-BF16 and Linux granted this process
/// the tile registers' state (it must ask; `TPU_DYNAMO_AMX=0` keeps the vector kernel).
pub(super) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            if std::env::var("TPU_DYNAMO_AMX").is_ok_and(|v| v == "0") {
                return false;
            }
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
            // SAFETY: the request only changes which state the kernel saves for this process.
            amx_bf16 && amx_tile && unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } == 0
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// Rows that a thread's share of a product on the tiles' layouts is a multiple of: a pair of
/// row tiles on AMX, one pass of the vector engine's sums elsewhere (`[1178, ..]` rows then split
/// 592 / 586 between two threads, not 608 / 570; `[589, 1536] x [1536, 1536]` in bf16 7.6-8.0 →
/// 6.8-7.1 ms).
pub(super) fn rows_unit() -> usize {
    #[cfg(target_arch = "x86_64")]
    if !available() {
        return super::bf16_dots::ROWS;
    }
    2 * TILE
}

/// Whether bf16 products run in the tiles' layouts here: on the tiles, or else on AVX-512
/// BF16's vector dot products (`bf16_dots`), which `x86::products` takes where the tiles are not.
pub(super) fn bf16_products() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        available() || super::bf16_dots::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// What an operand holds: f32 values, each the sum of three bf16 pieces, or bf16 values, one
/// piece each (a bf16 model's products, which the tiles run as they are).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Values {
    F32,
    Bf16,
}

impl Values {
    pub(super) const fn pieces(self) -> usize {
        match self {
            Values::F32 => 3,
            Values::Bf16 => 1,
        }
    }

    pub(super) const fn bytes(self) -> usize {
        match self {
            Values::F32 => 4,
            Values::Bf16 => 2,
        }
    }

    /// Tiles per column block and step of K: two halves of 16 columns, each in every piece.
    const fn block_step_tiles(self) -> usize {
        2 * self.pieces()
    }
}

/// Lines of `pack`'s result for a `[n, k]` weight of `values`.
pub(super) fn packed_lines(n: usize, k: usize, values: Values) -> usize {
    n.div_ceil(COLUMNS) * k.div_ceil(STEP) * values.block_step_tiles() * TILE_LINES
}

/// The weight's pieces as tiles, `[n / 32, k / 32, half, piece]` (each tile 16 rows of 16
/// column pairs: row `r` holds K `2r` and `2r + 1` of each column, as the tile product reads
/// them), zero past `n` and `k`; `None` where an f32 weight is not all finite (or off x86-64,
/// where the tiles never run).
///
/// # Safety
/// `w` must cover `[n, k]` (`RowPerOutput`) or `[k, n]` (`RowPerInput`) of `values`, and
/// `bf16_products()` be true.
pub(super) unsafe fn pack(w: *const u8, (n, k): (usize, usize), layout: Layout, values: Values) -> Option<Vec<Line>> {
    #[cfg(target_arch = "x86_64")]
    {
        let mut packed = Lines::new();
        let out = packed.u16s(packed_lines(n, k, values) * 2 * TILE);
        x86::pack(w, values, (n, k), layout, out).then_some(packed.0)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// A thread's memory for its products on the tiles: rows of `x` split into pieces, `[piece,
    /// rows / 32 * 32, k / 32 * 32]`, and a partial tile's results, `[32, 32]`.
    static SCRATCH: RefCell<(Lines, Lines)> = const { RefCell::new((Lines::new(), Lines::new())) };
}

/// Rows `first_row..first_row + rows` of `y = x @ w`, in column blocks `blocks` (32 columns
/// each), on the tiles, from the weight's `pieces` (both operands of `values`), finished by
/// `finish` on their way out (`x86::write_row`); false, with nothing written, where those rows
/// of an f32 `x` are not all finite.
///
/// # Safety
/// `x` `[m, k]` and `y` `[m, n]` must cover these rows, `pieces` be `pack`'s result for `w`, and
/// `available()` be true (`bf16_products()` for bf16 `values`).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn rows((x, y, finish): (*const u8, Out, Epilogue), values: Values, (n, k): (usize, usize), pieces: &[Line], first_row: usize, rows: usize, blocks: Range<usize>) -> bool {
    SCRATCH.with(|scratch| {
        let (split, partial) = &mut *scratch.borrow_mut();
        let steps = k.div_ceil(STEP);
        let lda = steps * STEP;
        let tall = rows.div_ceil(2 * TILE) * 2 * TILE;
        let a = split.u16s(values.pieces() * tall * lda);
        if !x86::split(x.add(first_row * k * values.bytes()), values, k, rows, a, tall * lda, lda) {
            return false;
        }
        let partial = partial.floats(2 * TILE * COLUMNS);
        x86::products(a.as_ptr(), (tall, lda, steps), values, (pieces.as_ptr(), steps), (y.add(first_row * n), n, rows, finish.at(first_row * n, 0)), blocks, partial);
        true
    })
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::epilogue::x86::{gelu_tanh_as_sigmoid, silu_of_bf16};
    use super::super::epilogue::{Activation, Factor};
    use super::super::vector_math::{lanes, rounded_bf16, through_bf16, transpose, widened_bf16};
    use super::super::{bf16_dots, Out};
    use super::{asm, Epilogue, Layout, Line, Range, Values, COLUMNS, L1_ROWS_BYTES, L2_SHARE_BYTES, STEP, TILE, TILE_LINES, VECTOR_GROUP_BYTES};
    use std::arch::x86_64::*;
    use std::mem::transmute;

    /// The four tile products of a round: x's row tiles (tmm4, tmm5) by the weight's column
    /// halves (tmm6, tmm7), into the four sums.
    macro_rules! both_row_tiles_by_both_halves {
        () => {
            concat!(
                "tdpbf16ps tmm0, tmm4, tmm6\n",
                "tdpbf16ps tmm1, tmm4, tmm7\n",
                "tdpbf16ps tmm2, tmm5, tmm6\n",
                "tdpbf16ps tmm3, tmm5, tmm7"
            )
        };
    }

    /// Rows of `x` (`k` long) as their pieces, at `a[piece * piece_len + r * lda + kk]`, zero
    /// past `rows` (to `piece_len / lda`) and `k` (to `lda`); false where an f32 is not finite.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(in crate::host_kernels) unsafe fn split(x: *const u8, values: Values, k: usize, rows: usize, a: &mut [u16], piece_len: usize, lda: usize) -> bool {
        let mut infinite_or_nan: __mmask16 = 0;
        let out = a.as_mut_ptr();
        let tops = halves_index(|slot| 2 * slot + 1);
        for r in 0..rows {
            // 32 lanes at a time to `lda` (a multiple of 32): lanes past `k` load and store zeros.
            for kk in (0..lda).step_by(32) {
                let split = [0, 1].map(|half| load_pieces(x, values, r * k + kk + 16 * half, lanes(k, kk + 16 * half), &mut infinite_or_nan));
                for (piece, (&low, &high)) in split[0].iter().zip(&split[1]).enumerate().take(values.pieces()) {
                    let halves = _mm512_permutex2var_epi16(low, tops, high);
                    _mm512_storeu_si512(out.add(piece * piece_len + tiled(r, kk, lda)) as *mut __m512i, halves);
                }
            }
        }
        for piece in 0..values.pieces() {
            for r in rows..piece_len / lda {
                for kk in (0..lda).step_by(STEP) {
                    _mm512_storeu_si512(out.add(piece * piece_len + tiled(r, kk, lda)) as *mut __m512i, _mm512_setzero_si512());
                }
            }
        }
        infinite_or_nan == 0
    }

    /// Where row `r`'s values `kk..kk + STEP` of K go in a piece of `x` (`lda` long rows): each
    /// tile (16 rows by a step of K) is 1 KiB of its own, a row tile's steps one after another,
    /// so that a tile load reads consecutive lines rather than 16 rows `2 · lda` bytes apart,
    /// which land in a few of L1's sets.
    pub(in crate::host_kernels) fn tiled(r: usize, kk: usize, lda: usize) -> usize {
        (r / TILE) * TILE * lda + (kk / STEP) * TILE * STEP + (r % TILE) * STEP
    }

    /// Every pair of tile rows of `a` (`tall` rows, a multiple of 32) times the weight's
    /// `pieces` (`pieces_steps` steps of K to a column block) in column blocks `blocks`, into
    /// `y` (`rows` rows, `n` columns, finished by `finish`), through `partial`
    /// (`[32, 32]`) where a tile's rows are not written as they are.
    ///
    /// Four sums (tmm0-3: rows 0-15 and 16-31 by columns 0-15 and 16-31) take turns, so that no
    /// product waits for the one before it; tmm4-5 hold x's pieces of both row tiles, tmm6-7
    /// the weight's of both column halves. Per step of K the six piece pairs run as x1w3, x1w2,
    /// x2w2, x2w1, x1w1, x3w1, each changing one side only (14 loads for 24 products, against
    /// 16 in the order x1w1, x2w1, x3w1, x2w2, x1w2, x1w3: the LM head's `[1024, 64] x [64,
    /// 1000]` 222-224 → 210-212 µs); each load comes right after the last product reading the
    /// tile it replaces, and each round's products start with the operands loaded earliest.
    /// For bf16 operands (one piece each) a step is the four products of the two row tiles by
    /// the two column halves.
    pub(in crate::host_kernels) unsafe fn products(
        a: *const u16,
        (tall, lda, steps): (usize, usize, usize),
        values: Values,
        (pieces, pieces_steps): (*const Line, usize),
        (y, n, rows, finish): (Out, usize, usize, Epilogue),
        blocks: Range<usize>,
        partial: &mut [f32],
    ) {
        let tiles = super::available();
        debug_assert!(tiles || values == Values::Bf16, "f32 pieces are the tiles' only");
        if tiles {
            // Palette 1, all eight tiles 16 rows of 64 bytes.
            let mut config = Line([0.0; 16]);
            let bytes = config.0.as_mut_ptr() as *mut u8;
            *bytes = 1;
            for t in 0..8 {
                *(bytes.add(16 + 2 * t) as *mut u16) = 64;
                *bytes.add(48 + t) = TILE as u8;
            }
            asm!("ldtilecfg [{0}]", in(reg) bytes, options(nostack, readonly, preserves_flags));
        }
        let a_stride = 2 * lda;
        let piece_bytes = 2 * tall * lda;
        let tile_rows_bytes = TILE * a_stride;
        // Rows in groups whose pieces stay in L1 (24 KiB) while every column block passes over
        // them: streamed from L2 instead, a tile product's operands arrive slower than it runs
        // (a tiny Llama at batch 8, `[512, 64]` rows a thread: 2.8 ms against the vector
        // kernel's 2.2). A weight whose blocks do not stay in L2 meanwhile is read once per group
        // of rows whose pieces stay in L2 instead (`[512, 768] x [768, 3072]`: 5.8-6.0 ms in one group
        // a thread, 4.4-4.9 in groups).
        let block_step_lines = values.block_step_tiles() * TILE_LINES;
        let weight_bytes = blocks.len() * steps * block_step_lines * 64;
        let group_bytes = match (weight_bytes > L2_SHARE_BYTES, tiles) {
            (true, true) => L2_SHARE_BYTES,
            (true, false) => VECTOR_GROUP_BYTES,
            (false, _) => L1_ROWS_BYTES,
        };
        let group = (group_bytes / (2 * TILE * values.pieces() * a_stride)).max(1) * 2 * TILE;
        for group_first in (0..rows).step_by(group) {
            for block in blocks.clone() {
                let cols = (n - block * COLUMNS).min(COLUMNS);
                for first in (group_first..rows.min(group_first + group)).step_by(2 * TILE) {
                    let out = y.add(first * n + block * COLUMNS);
                    let valid = (rows - first).min(2 * TILE);
                    let finish = finish.at(first * n + block * COLUMNS, block * COLUMNS);
                    // The results' lines fetched for writing while the products run: a large `y`
                    // (a batch's logits) is not in cache, and the tiles' stores waited for it. So
                    // did reading a factor's rows, which no prefetcher follows (Llama's `[1024,
                    // 1536]` MLP, SiLU times the factor: 0.8 → 0.3 ms).
                    for r in 0..valid {
                        _mm_prefetch::<_MM_HINT_ET0>(out.address(r * n));
                        _mm_prefetch::<_MM_HINT_ET0>(out.address(r * n + cols - 1));
                        if let Factor::Bf16(times) = finish.times {
                            _mm_prefetch::<_MM_HINT_T0>(times.wrapping_add(r * n) as *const i8);
                            _mm_prefetch::<_MM_HINT_T0>(times.wrapping_add(r * n + cols - 1) as *const i8);
                        }
                    }
                    if !tiles {
                        let x = (a as *const u8).add(2 * tiled(first, 0, lda));
                        let w = pieces.add(block * pieces_steps * block_step_lines) as *const u8;
                        bf16_dots::block_sums(x, tile_rows_bytes, (w, block_step_lines * 64), steps, valid, partial.as_mut_ptr());
                        write_rows((out, n), partial.as_ptr(), (valid, cols), &finish);
                        continue;
                    }
                    asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem, preserves_flags));
                    for step in 0..steps {
                        let x1 = (a as *const u8).add(2 * tiled(first, step * STEP, lda));
                        // The weight's tiles for this block and step: half 0's pieces, then half 1's,
                        // 1 KiB each.
                        let w = pieces.add((block * pieces_steps + step) * block_step_lines);
                        if values == Values::Bf16 {
                            asm!(
                                "tileloadd tmm4, [{x} + {sa}*1]",
                                "tileloadd tmm6, [{w} + {sw}*1]",
                                "tileloadd tmm7, [{w} + {sw}*1 + 1024]",
                                "tileloadd tmm5, [{xb} + {sa}*1]",
                                both_row_tiles_by_both_halves!(),
                                x = in(reg) x1,
                                xb = in(reg) x1.add(tile_rows_bytes),
                                sa = in(reg) 64usize,
                                w = in(reg) w,
                                sw = in(reg) 64usize,
                                options(nostack, readonly, preserves_flags),
                            );
                            continue;
                        }
                        asm!(
                            "tileloadd tmm4, [{x1} + {sa}*1]",
                            "tileloadd tmm6, [{w} + {sw}*1 + 2048]",
                            "tileloadd tmm7, [{w} + {sw}*1 + 5120]",
                            "tileloadd tmm5, [{x1b} + {sa}*1]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tileloadd tmm6, [{w} + {sw}*1 + 1024]",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            "tileloadd tmm7, [{w} + {sw}*1 + 4096]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tileloadd tmm4, [{x2} + {sa}*1]",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            "tileloadd tmm5, [{x2b} + {sa}*1]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tileloadd tmm6, [{w} + {sw}*1]",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            "tileloadd tmm7, [{w} + {sw}*1 + 3072]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tileloadd tmm4, [{x1} + {sa}*1]",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            "tileloadd tmm5, [{x1b} + {sa}*1]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tileloadd tmm4, [{x3} + {sa}*1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            "tileloadd tmm5, [{x3b} + {sa}*1]",
                            both_row_tiles_by_both_halves!(),
                            x1 = in(reg) x1,
                            x2 = in(reg) x1.add(piece_bytes),
                            x3 = in(reg) x1.add(2 * piece_bytes),
                            x1b = in(reg) x1.add(tile_rows_bytes),
                            x2b = in(reg) x1.add(piece_bytes + tile_rows_bytes),
                            x3b = in(reg) x1.add(2 * piece_bytes + tile_rows_bytes),
                            sa = in(reg) 64usize,
                            w = in(reg) w,
                            sw = in(reg) 64usize,
                            options(nostack, readonly, preserves_flags),
                        );
                    }
                    match out {
                        Out::F32(out) if valid == 2 * TILE && cols == COLUMNS && finish.is_none() => store(out, 4 * n, TILE * n),
                        _ => {
                            store(partial.as_mut_ptr(), 4 * COLUMNS, TILE * COLUMNS);
                            write_rows((out, n), partial.as_ptr(), (valid, cols), &finish);
                        }
                    }
                }
            }
        }
        if tiles {
            asm!("tilerelease", options(nostack, nomem, preserves_flags));
        }
    }

    /// The index that `_mm512_permutex2var_epi16(a, index, b)` takes to put u16 `slot(i)` of
    /// `a` then `b` (32 each) at slot `i`.
    #[target_feature(enable = "avx512f")]
    unsafe fn halves_index(slot: impl Fn(u16) -> u16) -> __m512i {
        let index: [u16; 32] = std::array::from_fn(|i| slot(i as u16));
        _mm512_loadu_si512(index.as_ptr() as *const __m512i)
    }

    /// The 16 values of `values` under `mask` from element `at` of `x` as f32s whose top halves
    /// are their bf16 pieces (`pieces` on 16 lanes; a bf16 value is its only piece; zero outside
    /// `mask`), adding the f32 lanes that are infinite or NaN to `not_finite`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_pieces(x: *const u8, values: Values, at: usize, mask: __mmask16, not_finite: &mut __mmask16) -> [__m512i; 3] {
        if values == Values::Bf16 {
            let halves = _mm256_maskz_loadu_epi16(mask, x.wrapping_add(2 * at) as *const i16);
            return [_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)), _mm512_setzero_si512(), _mm512_setzero_si512()];
        }
        let (top, exponent) = (_mm512_set1_epi32(0xffff_0000u32 as i32), _mm512_set1_epi32(0x7f80_0000));
        let v = _mm512_maskz_loadu_ps(mask, x.wrapping_add(4 * at) as *const f32);
        let bits = _mm512_castps_si512(v);
        *not_finite |= _mm512_mask_cmpeq_epi32_mask(mask, _mm512_and_si512(bits, exponent), exponent);
        let first = _mm512_and_si512(bits, top);
        let rest = _mm512_sub_ps(v, _mm512_castsi512_ps(first));
        let second = _mm512_and_si512(_mm512_castps_si512(rest), top);
        let third = _mm512_castps_si512(_mm512_sub_ps(rest, _mm512_castsi512_ps(second)));
        [first, second, third]
    }

    /// `super::pack` into `out`: per tile (16 columns by 32 of K), each column's 32 values as
    /// 16 pairs, then the pairs transposed to the tile's rows (`[n, k]`), or each pair of K's
    /// rows interleaved into a tile row (`[k, n]`); false where a value is not finite. (The
    /// scalar loop took ~11 ns a value: 1.4 s for GPT-2 small's first call.)
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(in crate::host_kernels) unsafe fn pack(w: *const u8, values: Values, (n, k): (usize, usize), layout: Layout, out: &mut [u16]) -> bool {
        let steps = k.div_ceil(STEP);
        let mut not_finite: __mmask16 = 0;
        // A column's K `2r` and `2r + 1` in u32 `r`; a row's column `c` and the next row's in
        // u32 `c`.
        let (tops, pairs) = (halves_index(|slot| 2 * slot + 1), halves_index(|slot| if slot % 2 == 0 { slot + 1 } else { 32 + slot }));
        // Column `c` of two bf16 rows (the low halves of `a` and `b`) at u16 `2c` and `2c + 1`.
        let interleaved = halves_index(|slot| slot / 2 + if slot % 2 == 0 { 0 } else { 32 });
        let tile_u16s = TILE * 2 * TILE;
        for block in 0..n.div_ceil(COLUMNS) {
            for step in 0..steps {
                for half in 0..2 {
                    let first_col = block * COLUMNS + half * TILE;
                    let k0 = step * STEP;
                    let mut rows = [[_mm512_setzero_si512(); TILE]; 3];
                    match layout {
                        // A bf16 column's 32 values of K are already the 16 pairs a tile row
                        // takes: loaded as they are.
                        Layout::RowPerOutput if values == Values::Bf16 => {
                            let mask = (u64::MAX >> (64 - k.saturating_sub(k0).min(STEP))) as __mmask32;
                            for (c, row) in rows[0].iter_mut().enumerate().take(n.saturating_sub(first_col)) {
                                *row = _mm512_maskz_loadu_epi16(mask, w.add(2 * ((first_col + c) * k + k0)) as *const i16);
                            }
                            rows[0] = transposed(rows[0]);
                        }
                        Layout::RowPerInput if values == Values::Bf16 => {
                            let mask = lanes(n, first_col);
                            let row = |kk: usize| _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, w.add(2 * (kk * n + first_col)) as *const i16));
                            for (r, pairs) in rows[0].iter_mut().enumerate().take(k.saturating_sub(k0).div_ceil(2)) {
                                let kk = k0 + 2 * r;
                                let odd = if kk + 1 < k { row(kk + 1) } else { _mm512_setzero_si512() };
                                *pairs = _mm512_permutex2var_epi16(row(kk), interleaved, odd);
                            }
                        }
                        Layout::RowPerOutput => {
                            for c in 0..n.saturating_sub(first_col).min(TILE) {
                                let at = (first_col + c) * k + k0;
                                let halves = [0, 1].map(|h| load_pieces(w, values, at + 16 * h, lanes(k, k0 + 16 * h), &mut not_finite));
                                for (piece, row) in rows.iter_mut().enumerate().take(values.pieces()) {
                                    row[c] = _mm512_permutex2var_epi16(halves[0][piece], tops, halves[1][piece]);
                                }
                            }
                            for row in rows.iter_mut().take(values.pieces()) {
                                *row = transposed(*row);
                            }
                        }
                        Layout::RowPerInput => {
                            let mask = lanes(n, first_col);
                            for r in 0..TILE.min(k.saturating_sub(k0).div_ceil(2)) {
                                let kk = k0 + 2 * r;
                                let even = load_pieces(w, values, kk * n + first_col, mask, &mut not_finite);
                                let odd = if kk + 1 < k { load_pieces(w, values, (kk + 1) * n + first_col, mask, &mut not_finite) } else { [_mm512_setzero_si512(); 3] };
                                for (piece, row) in rows.iter_mut().enumerate().take(values.pieces()) {
                                    row[r] = _mm512_permutex2var_epi16(even[piece], pairs, odd[piece]);
                                }
                            }
                        }
                    }
                    let tiles = out.as_mut_ptr().add(((block * steps + step) * 2 + half) * values.pieces() * tile_u16s);
                    for (piece, row) in rows.iter().enumerate().take(values.pieces()) {
                        for (r, &v) in row.iter().enumerate() {
                            _mm512_storeu_si512(tiles.add(piece * tile_u16s + r * 2 * TILE) as *mut __m512i, v);
                        }
                    }
                }
            }
        }
        not_finite == 0
    }

    /// `transpose` of sixteen rows of 32-bit lanes, whatever they hold.
    #[target_feature(enable = "avx512f")]
    unsafe fn transposed(rows: [__m512i; TILE]) -> [__m512i; TILE] {
        transmute::<[__m512; TILE], [__m512i; TILE]>(transpose(transmute::<[__m512i; TILE], [__m512; TILE]>(rows)))
    }

    /// `cols` f32 sums from `sums` into `out`, with `finish`'s bias (where not null) added, then
    /// rounded to the nearest even bf16 for a bf16 result (NaN kept NaN, as `f32_to_bf16`). As
    /// eager's ops round each result they give, a GELU or SiLU reads the rounded value and is
    /// rounded again, and so is its product by a bf16 factor (`gelu(addmm(..))`, Llama's
    /// `silu(gate) * up`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(in crate::host_kernels) unsafe fn write_row(out: Out, sums: *const f32, cols: usize, finish: &Epilogue) {
        debug_assert!(!matches!(finish.times, Factor::F32(_)) && finish.plus.is_null(), "an f32 factor or a residual is `Epilogue::apply`'s");
        if let (Out::F32(y), true) = (out, finish.is_none()) {
            return std::ptr::copy_nonoverlapping(sums, y, cols);
        }
        for j in (0..cols).step_by(16) {
            let mask = lanes(cols, j);
            let mut v = _mm512_maskz_loadu_ps(mask, sums.add(j));
            if !finish.bias.is_null() {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, finish.bias.add(j)));
            }
            match finish.activation {
                Activation::Identity => {}
                Activation::GeluTanh => v = gelu_tanh_as_sigmoid(stored(out, v)),
                Activation::Silu => v = silu_of_bf16(stored(out, v)),
            }
            if let Factor::Bf16(times) = finish.times {
                v = _mm512_mul_ps(stored(out, v), widened_bf16(_mm256_maskz_loadu_epi16(mask, times.add(j) as *const i16)));
            }
            match out {
                Out::F32(y) => _mm512_mask_storeu_ps(y.add(j), mask, v),
                Out::Bf16(y) => _mm512_mask_cvtepi32_storeu_epi16(y.add(j) as *mut i16, mask, rounded_bf16(v)),
            }
        }
    }

    /// `v` as `out` keeps it: rounded to bf16 (and widened back) for a bf16 result.
    #[target_feature(enable = "avx512f")]
    unsafe fn stored(out: Out, v: __m512) -> __m512 {
        match out {
            Out::F32(_) => v,
            Out::Bf16(_) => through_bf16(v),
        }
    }

    /// `write_row` for `rows` rows of `partial` (`[rows, 32]`) into rows of `out` `n` apart: one
    /// call a tile block, where a call a row cost as much as the rows' rounding (2.6 % of SD3.5
    /// Medium's bf16 execute).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    unsafe fn write_rows((out, n): (Out, usize), partial: *const f32, (rows, cols): (usize, usize), finish: &Epilogue) {
        for r in 0..rows {
            write_row(out.add(r * n), partial.add(r * COLUMNS), cols, &finish.at(r * n, 0));
        }
    }


    /// The four sums (tmm0-3) as 32 rows of 32 f32s from `out`, rows `stride` bytes apart,
    /// the second row tile `lower` f32s after the first.
    unsafe fn store(out: *mut f32, stride: usize, lower: usize) {
        asm!(
            "tilestored [{o} + {s}*1], tmm0",
            "tilestored [{o1} + {s}*1], tmm1",
            "tilestored [{o2} + {s}*1], tmm2",
            "tilestored [{o3} + {s}*1], tmm3",
            o = in(reg) out,
            o1 = in(reg) out.add(TILE),
            o2 = in(reg) out.add(lower),
            o3 = in(reg) out.add(lower + TILE),
            s = in(reg) stride,
            options(nostack, preserves_flags),
        );
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use super::super::epilogue::{gelu_tanh, Activation, Factor};

    /// The three bf16 pieces of `v` (each the top half of an f32 whose sum is exactly `v`).
    fn pieces(v: f32) -> [u16; 3] {
        const TOP: u32 = 0xffff_0000;
        let first = f32::from_bits(v.to_bits() & TOP);
        let rest = v - first;
        let second = f32::from_bits(rest.to_bits() & TOP);
        let third = rest - second;
        [(v.to_bits() >> 16) as u16, (second.to_bits() >> 16) as u16, (third.to_bits() >> 16) as u16]
    }

    /// `pack` value by value, as a reference.
    fn pack_reference(w: &[f32], (n, k): (usize, usize), layout: Layout, values: Values) -> Vec<u16> {
        let steps = k.div_ceil(STEP);
        let mut out = vec![0u16; packed_lines(n, k, values) * 2 * TILE];
        for col in 0..n {
            let (block, half, lane) = (col / COLUMNS, col % COLUMNS / TILE, col % TILE);
            for kk in 0..k {
                let v = if layout == Layout::RowPerOutput { w[col * k + kk] } else { w[kk * n + col] };
                let (step, row, pair) = (kk / STEP, kk % STEP / 2, kk % 2);
                let first_tile = ((block * steps + step) * 2 + half) * values.pieces();
                for (piece, bits) in pieces(v).into_iter().enumerate().take(values.pieces()) {
                    out[((first_tile + piece) * TILE + row) * 2 * TILE + 2 * lane + pair] = bits;
                }
            }
        }
        out
    }

    /// bf16 operands on the tiles (or AVX-512 BF16's vectors), with f32 sums as the exact (f64) sums of the bf16 values
    /// allow, and rounded once to bf16 for a bf16 result (a bias added to the f32 sums first;
    /// a GELU after it reading the rounded value, rounded again; SiLU likewise, then times a
    /// bf16 factor and rounded again), on shapes off the tiles and a weight past L2's share.
    #[test]
    fn bf16_products_sum_in_f32_and_round_once() {
        if !bf16_products() {
            return;
        }
        let mut next = super::super::uniform(13);
        let bf16 = |v: f32| super::super::f32_to_bf16(v);
        let value = |b: u16| f64::from(f32::from_bits(u32::from(b) << 16));
        for (m, n, k) in [(16, 32, 32), (37, 200, 33), (70, 300, 600), (5, 45, 1)] {
            let x: Vec<u16> = (0..m * k).map(|_| bf16(next() * 3.0)).collect();
            let w: Vec<u16> = (0..n * k).map(|_| bf16(next())).collect();
            for layout in [Layout::RowPerOutput, Layout::RowPerInput] {
                let at = |j: usize, kk: usize| if layout == Layout::RowPerOutput { w[j * k + kk] } else { w[kk * n + j] };
                let pieces = unsafe { pack(w.as_ptr() as *const u8, (n, k), layout, Values::Bf16) }.unwrap();
                let (mut y32, mut y16) = (vec![f32::NAN; m * n], vec![0u16; m * n]);
                let bias: Vec<f32> = (0..n).map(|_| next()).collect();
                let (mut biased, mut gelus) = (vec![0u16; m * n], vec![0u16; m * n]);
                let with_bias = |activation| Epilogue { bias: bias.as_ptr(), activation, ..Epilogue::NONE };
                let outs = [
                    (Out::F32(y32.as_mut_ptr()), Epilogue::NONE),
                    (Out::Bf16(y16.as_mut_ptr()), Epilogue::NONE),
                    (Out::Bf16(biased.as_mut_ptr()), with_bias(Activation::Identity)),
                    (Out::Bf16(gelus.as_mut_ptr()), with_bias(Activation::GeluTanh)),
                ];
                for (out, finish) in outs {
                    assert!(unsafe { super::rows((x.as_ptr() as *const u8, out, finish), Values::Bf16, (n, k), &pieces, 0, m, 0..n.div_ceil(COLUMNS)) });
                }
                // In two calls of rows, each reading the factor from its first row on.
                let factor: Vec<u16> = (0..m * n).map(|_| bf16(next() * 2.0)).collect();
                let mut silus = vec![0u16; m * n];
                let times = Epilogue { activation: Activation::Silu, times: Factor::Bf16(factor.as_ptr()), ..Epilogue::NONE };
                for (first, rows) in [(0, m / 2), (m / 2, m - m / 2)] {
                    let out = (x.as_ptr() as *const u8, Out::Bf16(silus.as_mut_ptr()), times);
                    assert!(unsafe { super::rows(out, Values::Bf16, (n, k), &pieces, first, rows, 0..n.div_ceil(COLUMNS)) });
                }
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k).map(|kk| value(x[i * k + kk]) * value(at(j, kk))).sum();
                        let got = f64::from(y32[i * n + j]);
                        assert!((got - want).abs() <= 1e-6 * (k as f64).sqrt() * 3.0, "{m}x{n}x{k} at {i},{j}: {got} vs {want}");
                        assert_eq!(y16[i * n + j], bf16(y32[i * n + j]), "{m}x{n}x{k} at {i},{j}");
                        assert_eq!(biased[i * n + j], bf16(y32[i * n + j] + bias[j]), "{m}x{n}x{k} at {i},{j} with a bias");
                        // One bf16 step apart at most, or both next to 0 (where the f32 formula cancels).
                        let (got, gelu) = (value(gelus[i * n + j]), f64::from(gelu_tanh(value(biased[i * n + j]) as f32)));
                        assert!((got - gelu).abs() <= (gelu.abs() / 128.0).max(1e-6), "{m}x{n}x{k} at {i},{j} with a GELU: {got} vs {gelu}");
                        let v = value(y16[i * n + j]) as f32;
                        let silu = value(bf16(value(bf16(v / (1.0 + (-v).exp()))) as f32 * value(factor[i * n + j]) as f32));
                        let got = value(silus[i * n + j]);
                        assert!((got - silu).abs() <= (silu.abs() / 64.0).max(1e-6), "{m}x{n}x{k} at {i},{j} with SiLU: {got} vs {silu}");
                    }
                }
            }
        }
    }

    /// The vector packing, bit for bit the reference's, for K and N on and off the tiles.
    #[test]
    fn pack_places_every_piece_as_the_reference_does() {
        if !bf16_products() {
            return;
        }
        let mut next = super::super::uniform(5);
        for (n, k) in [(32, 32), (45, 70), (200, 33), (31, 1), (64, 256), (17, 95)] {
            let w: Vec<f32> = (0..n * k).map(|_| next() * 100.0).collect();
            // bf16 values: each f32's first piece.
            let halves: Vec<u16> = w.iter().map(|&v| pieces(v)[0]).collect();
            for layout in [Layout::RowPerOutput, Layout::RowPerInput] {
                for (values, data) in [(Values::F32, w.as_ptr() as *const u8), (Values::Bf16, halves.as_ptr() as *const u8)] {
                    let packed = unsafe { pack(data, (n, k), layout, values) }.unwrap();
                    let bits = unsafe { std::slice::from_raw_parts(packed.as_ptr() as *const u16, packed.len() * 32) };
                    assert!(bits == pack_reference(&w, (n, k), layout, values), "{n}x{k} {layout:?} {values:?}");
                }
            }
        }
    }

    #[test]
    fn three_pieces_sum_to_the_value_exactly() {
        let mut next = super::super::uniform(3);
        for scale in [1e-30f32, 1e-3, 1.0, 7.5e3, 3e38] {
            for _ in 0..1000 {
                let v = next() * scale;
                let [a, b, c] = pieces(v).map(|p| f32::from_bits(u32::from(p) << 16));
                assert_eq!(f64::from(a) + f64::from(b) + f64::from(c), f64::from(v), "{v:e}");
            }
        }
    }

    /// Every shape class (row and column tails, K past and short of a step, both layouts, a
    /// weight past L2's share read once for all rows) within f32 summation's rounding of a sum
    /// in f64, and non-finite operands refused.
    #[test]
    fn agrees_with_f64_sums_and_refuses_non_finite_operands() {
        if !available() {
            return;
        }
        let mut next = super::super::uniform(11);
        for (m, n, k) in [(16, 32, 32), (128, 1000, 64), (13, 45, 70), (37, 200, 33), (25, 31, 1), (64, 64, 256), (300, 40, 64), (70, 300, 600)] {
            let x: Vec<f32> = (0..m * k).map(|_| next() * 3.0).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            for layout in [Layout::RowPerOutput, Layout::RowPerInput] {
                let at = |j: usize, kk: usize| if layout == Layout::RowPerOutput { w[j * k + kk] } else { w[kk * n + j] };
                let pieces = unsafe { pack(w.as_ptr() as *const u8, (n, k), layout, Values::F32) }.unwrap();
                let mut y = vec![f32::NAN; m * n];
                // Two runs of rows, as two threads would take them, the first in two runs of
                // column blocks.
                let (half, blocks) = ((m.div_ceil(32) * 16).min(m), n.div_ceil(COLUMNS));
                for (first, rows, blocks) in [(0, half, 0..blocks / 2), (0, half, blocks / 2..blocks), (half, m - half, 0..blocks)] {
                    assert!(unsafe { super::rows((x.as_ptr() as *const u8, Out::F32(y.as_mut_ptr()), Epilogue::NONE), Values::F32, (n, k), &pieces, first, rows, blocks) });
                }
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k).map(|kk| f64::from(x[i * k + kk]) * f64::from(at(j, kk))).sum();
                        let got = f64::from(y[i * n + j]);
                        assert!((got - want).abs() <= 1e-6 * (k as f64).sqrt() * 3.0, "{m}x{n}x{k} at {i},{j}: {got} vs {want}");
                    }
                }
                let mut bad_x = x.clone();
                bad_x[m * k - 1] = f32::INFINITY;
                assert!(!unsafe { super::rows((bad_x.as_ptr() as *const u8, Out::F32(y.as_mut_ptr()), Epilogue::NONE), Values::F32, (n, k), &pieces, 0, m, 0..n.div_ceil(COLUMNS)) });
            }
            let mut bad_w = w.clone();
            bad_w[0] = f32::NAN;
            assert!(unsafe { pack(bad_w.as_ptr() as *const u8, (n, k), Layout::RowPerInput, Values::F32) }.is_none());
        }
    }
}
