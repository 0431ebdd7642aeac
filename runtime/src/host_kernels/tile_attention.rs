//! bf16 attention on AMX's tiles (elsewhere on AVX-512 BF16's vector dot products in the same
//! layouts, `bf16_dots`), computed as PyTorch's CPU flash kernel computes it for bf16:
//! the scores `q kᵀ` summed in f32 from bf16 products, scaled (and a mask added) in f32, their
//! exponentials summed in f32 and rounded to bf16 for the product by `v` (summed in f32), which
//! is divided by the row's sum at the end and rounded once. The f32 kernel (`attention`) took
//! bf16 widened to f32 and ran at f32's rate: SD3.5 Medium's joint attention, `[2, 24, 589,
//! 64]`, 21.4 ms against eager's 10.1.
//!
//! A unit of work is a run of one head's queries, in blocks of 32 (a pair of tile rows). A
//! thread packs a head's keys and values into tiles once (`amx::pack`, keys as a `[S, E]`
//! weight, values as an `[S, E]` one read the other way) and keeps them for the head's runs.

use super::amx::{self, x86::*, Values, STEP};
use super::epilogue::Epilogue;
use super::attention::{logsumexps, normalize, scores_stride, visible_keys, write_presents, Bias, Placed, Plan, Presents, Shape, Unit};
use super::gemm::{Lines, COLUMNS};
use super::pool::Chunked;
use super::{Layout, Out};
use std::cell::RefCell;

/// Queries per block: the two row tiles a tile product round takes.
const BLOCK: usize = 32;

/// Whether it runs here: bf16 products in the tiles' layouts (on AMX's tiles or AVX-512 BF16's
/// vectors), and AVX-512's bf16 conversions (every CPU with AMX has them, but each is asked).
pub(super) fn available() -> bool {
    amx::bf16_products() && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// One attention of bf16 `q`, `k`, `v` into bf16 `out` and f32 `lse`, as `Attention` (but for
/// `scale` multiplying the scores, as eager's bf16 kernel scales them).
pub(super) struct TileAttention {
    q: Placed<u16>,
    k: Placed<u16>,
    v: Placed<u16>,
    scale: f32,
    bias: Option<Bias>,
    valid: usize,
    out: Placed<u16>,
    lse: *mut f32,
    presents: Presents<u16>,
    shape: Shape,
    causal: bool,
    plan: Plan,
}

impl TileAttention {
    /// The attention, how many units it splits into for `parts` threads and on how many
    /// threads (its units run only where `available()`).
    pub fn new(
        (q, k, v, scale): (Placed<u16>, Placed<u16>, Placed<u16>, f32),
        (bias, valid): (Option<Bias>, usize),
        (out, lse, presents): (Placed<u16>, *mut f32, Presents<u16>),
        shape: Shape,
        causal: bool,
        parts: usize,
    ) -> (Self, usize, usize) {
        let plan = Plan::new(shape, causal, parts, BLOCK);
        let (units, parts) = (plan.units, plan.parts);
        (TileAttention { q, k, v, scale, bias, valid: valid.min(shape.len_kv), out, lse, presents, shape, causal, plan }, units, parts)
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch { holds: (0, 0, 0), keys: Lines::new(), values: Lines::new(), gathered: Lines::new(), rows: Lines::new(), scores: Lines::new(), sums: Lines::new(), partial: Lines::new() })
    };
}

/// A thread's memory: which head's keys and values (attention id, batch entry, key/value
/// head) `keys` and `values` hold as tiles, rows placed apart gathered next to each other for
/// the tiles' copies (`gathered`), a block's queries or exponentials as tile rows, its scores,
/// its products by the values and a partial tile's results.
struct Scratch {
    holds: (u64, usize, usize),
    keys: Lines,
    values: Lines,
    gathered: Lines,
    rows: Lines,
    scores: Lines,
    sums: Lines,
    partial: Lines,
}

impl Chunked for TileAttention {
    /// Unit `unit`: one run of one head's queries (`Plan::unit`).
    ///
    /// # Safety
    /// The pointers must cover the shapes, `available()` be true; units write disjoint
    /// rows of `out` and `lse`.
    unsafe fn chunk(&self, unit: usize) {
        let s = self.shape;
        let unit = self.plan.unit(s, unit);
        write_presents(self.presents, [&self.k, &self.v], s, &unit);
        let Unit { head, b, h, kv, queries } = unit;
        let (dim_steps, key_steps) = (s.dim.div_ceil(STEP), self.valid.div_ceil(STEP));
        // A block's scores, a row per query: every column block of keys the tiles write.
        let stride = scores_stride(key_steps * STEP);
        let kv_head = kv - b * s.kv_heads;
        SCRATCH.with(|scratch| {
            let Scratch { holds, keys, values, gathered, rows: tile_rows, scores, sums, partial } = &mut *scratch.borrow_mut();
            let keys = keys.u16s(amx::packed_lines(self.valid, s.dim, Values::Bf16) * 2 * COLUMNS);
            let values = values.u16s(amx::packed_lines(s.dim, self.valid, Values::Bf16) * 2 * COLUMNS);
            if *holds != (self.plan.id, b, kv) {
                // Only the keys and values before `valid` are read: padding may hold anything.
                let rows = |t: &Placed<u16>, gathered: &mut Lines| adjacent_rows(t, (b, kv_head), 0..self.valid, s.dim, gathered);
                pack(rows(&self.k, gathered), Values::Bf16, (self.valid, s.dim), Layout::RowPerOutput, keys);
                pack(rows(&self.v, gathered), Values::Bf16, (s.dim, self.valid), Layout::RowPerInput, values);
                *holds = (self.plan.id, b, kv);
            }
            let (keys, values) = (keys.as_ptr() as *const _, values.as_ptr() as *const _);
            let scores = scores.floats(BLOCK * stride).as_mut_ptr();
            let sums = sums.floats(BLOCK * s.dim).as_mut_ptr();
            let partial = partial.floats(BLOCK * COLUMNS);
            let last = queries.end;
            for r0 in queries.step_by(BLOCK) {
                let rows = BLOCK.min(last - r0);
                let seen = visible_keys(self.causal, self.valid, r0 + rows - 1);
                let q = adjacent_rows(&self.q, (b, h), r0..r0 + rows, s.dim, gathered);
                let lda = dim_steps * STEP;
                let a = tile_rows.u16s(BLOCK * lda);
                split(q, Values::Bf16, s.dim, rows, a, BLOCK * lda, lda);
                products(a.as_ptr(), (BLOCK, lda, dim_steps), Values::Bf16, (keys, dim_steps), (Out::F32(scores), stride, rows, Epilogue::NONE), 0..seen.div_ceil(COLUMNS), partial);
                // The exponentials, rounded, straight into the tiles' rows for their product by
                // the values (zero past a query's visible keys and past the block's queries).
                let lda = seen.div_ceil(STEP) * STEP;
                let a = tile_rows.u16s(BLOCK * lda);
                a[tiled(rows, 0, lda)..].fill(0);
                let mut softmaxes = [(0f32, 0f32); BLOCK];
                for (i, softmax) in softmaxes.iter_mut().enumerate().take(rows) {
                    let added = self.bias.map(|bias| bias.row((b, h), r0 + i, s.len_kv));
                    *softmax = exponentials_into_tiles(scores.add(i * stride), (self.scale, added), visible_keys(self.causal, self.valid, r0 + i), (a.as_mut_ptr(), i, lda));
                }
                logsumexps(&softmaxes[..rows], std::slice::from_raw_parts_mut(self.lse.add(head * s.len_q + r0), rows));
                let (out, ldo) = (self.out.strides.row(self.out.data, (b, h), r0), self.out.strides.row);
                if seen > 0 {
                    products(a.as_ptr(), (BLOCK, lda, seen.div_ceil(STEP)), Values::Bf16, (values, key_steps), (Out::F32(sums), s.dim, rows, Epilogue::NONE), 0..s.dim.div_ceil(COLUMNS), partial);
                }
                for (i, &softmax) in softmaxes.iter().enumerate().take(rows) {
                    let row = std::slice::from_raw_parts_mut(sums.add(i * s.dim), s.dim);
                    normalize(row, softmax);
                    write_row(Out::Bf16(out.add(i * ldo)), row.as_ptr(), s.dim, &Epilogue::NONE);
                }
            }
        });
    }
}

/// Rows `rows` of head `h` of batch entry `b` of `t` (`dim` values each) next to each other, as
/// the tiles' copies read them: where they are, if they are so, else copied into `gathered`.
///
/// # Safety
/// `t` must cover those rows.
unsafe fn adjacent_rows(t: &Placed<u16>, (b, h): (usize, usize), rows: std::ops::Range<usize>, dim: usize, gathered: &mut Lines) -> *const u8 {
    let first = t.strides.row(t.data, (b, h), rows.start);
    if t.strides.row == dim {
        return first as *const u8;
    }
    let out = gathered.u16s(rows.len() * dim);
    for (i, row) in out.chunks_exact_mut(dim).enumerate() {
        row.copy_from_slice(std::slice::from_raw_parts(first.add(i * t.strides.row), dim));
    }
    out.as_ptr() as *const u8
}

/// Row `r` of a block's exponentials `exp(x - max)` of its scores `x = row · scale + added`
/// (in f32, as eager scales and masks them) over its `visible` keys, rounded to bf16 into the
/// tiles' rows `tiles` (`lda` keys long, zero past `visible`); returns the max (NaN where a
/// score is) and the f32 exponentials' sum. One pass to find the max and one to write, where
/// scaling, the softmax and the rounding each passed over the block's scores.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn exponentials_into_tiles(row: *const f32, (scale, added): (f32, Option<*const f32>), visible: usize, (tiles, r, lda): (*mut u16, usize, usize)) -> (f32, f32) {
    use super::vector_math::{lanes, softmax_exp};
    use std::arch::x86_64::*;
    let factor = _mm512_set1_ps(scale);
    // A macro and loops, not closures: those were not inlined (a call a vector, half the time here).
    // Whole vectors (`mask` all ones, known where the macro is used) unmasked, the last part
    // masked, as the f32 kernel's exponentials (`Tile::run` says why): `[2, 24, 589, 64]`
    // 15.5-17.0 → 15.0-16.1 ms, `[1, 8, 1024, 64]` 8.1-8.5 → 7.7-8.0.
    macro_rules! scores {
        ($at:expr, $mask:expr) => {{
            let (at, mask): (usize, __mmask16) = ($at, $mask);
            macro_rules! load {
                ($p:expr) => {
                    if mask == !0 { _mm512_loadu_ps($p) } else { _mm512_maskz_loadu_ps(mask, $p) }
                };
            }
            let x = _mm512_mul_ps(load!(row.add(at)), factor);
            match added {
                Some(added) => _mm512_add_ps(x, load!(added.add(at))),
                None => x,
            }
        }};
    }
    let whole = visible - visible % 16;
    let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut nan: __mmask16 = 0;
    for at in (0..whole).step_by(16) {
        let x = scores!(at, !0);
        max = _mm512_max_ps(x, max);
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    }
    for at in (whole..visible).step_by(16) {
        let (mask, x) = (lanes(visible, at), scores!(at, lanes(visible, at)));
        max = _mm512_mask_max_ps(max, mask, x, max);
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    }
    // A NaN score makes its row NaN, as in eager (`max` drops NaN).
    let max = if nan != 0 { f32::NAN } else { _mm512_reduce_max_ps(max) };
    let shift = _mm512_set1_ps(max);
    let mut sum = _mm512_setzero_ps();
    // A step's 32 exponentials rounded to the nearest even by one instruction (which flushes
    // values below 2^-126 to zero, as the tiles' products would) into the tiles' row.
    macro_rules! into_tiles {
        ($kk:expr, $low:expr, $high:expr) => {
            _mm512_storeu_si512(tiles.add(tiled(r, $kk, lda)) as *mut __m512i, std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh($high, $low)))
        };
    }
    let whole_steps = visible - visible % STEP;
    for kk in (0..whole_steps).step_by(STEP) {
        let low = softmax_exp(_mm512_sub_ps(scores!(kk, !0), shift));
        let high = softmax_exp(_mm512_sub_ps(scores!(kk + 16, !0), shift));
        sum = _mm512_add_ps(_mm512_add_ps(sum, low), high);
        into_tiles!(kk, low, high);
    }
    for kk in (whole_steps..lda).step_by(STEP) {
        let mut halves = [_mm512_setzero_ps(); 2];
        for (half, e) in halves.iter_mut().enumerate() {
            let (at, mask) = (kk + 16 * half, lanes(visible, kk + 16 * half));
            *e = _mm512_maskz_mov_ps(mask, softmax_exp(_mm512_sub_ps(scores!(at, mask), shift)));
            sum = _mm512_add_ps(sum, *e);
        }
        into_tiles!(kk, halves[0], halves[1]);
    }
    (max, _mm512_reduce_add_ps(sum))
}

#[cfg(test)]
mod tests {
    use super::super::attention::{check_against_f64, test_operands};
    use super::super::{bf16_to_f32, f32_to_bf16};
    use super::*;

    /// As the f32 kernel's test (grouped heads, causal with more keys than queries and fewer,
    /// counts off the blocks, head sizes off the tiles, a mask's bias and padding, operands
    /// packed or placed as a fused projection leaves them, the output `[B, L, H, E]` and the
    /// keys and values copied out), on
    /// bf16 inputs against f64 sums of them: within what rounding the exponentials and the
    /// output to bf16 may take (2⁻⁹ of the values' size each).
    #[test]
    fn agrees_with_f64() {
        if !available() {
            return;
        }
        let mut uniform = super::super::uniform(5);
        let mut next = || 2.0 * uniform();
        let shapes = [(1, 4, 2, 128, 128, 64), (2, 3, 3, 13, 45, 8), (1, 2, 1, 50, 20, 40), (1, 1, 1, 1, 70, 72), (2, 2, 2, 37, 100, 33)];
        for (batch, heads, kv_heads, len_q, len_kv, dim) in shapes {
            let shape = Shape { batch, heads, kv_heads, len_q, len_kv, dim };
            let mut bf16s = |len: usize| -> Vec<u16> { (0..len).map(|_| f32_to_bf16(next())).collect() };
            let (q, k, v) = (bf16s(batch * heads * len_q * dim), bf16s(batch * kv_heads * len_kv * dim), bf16s(batch * kv_heads * len_kv * dim));
            let mask: Vec<f32> = (0..batch * len_q * len_kv)
                .map(|at| if next() < -0.33 || (len_q > 1 && at / len_kv == 1) { f32::NEG_INFINITY } else { next() })
                .collect();
            let scale = 1.0 / (dim as f32).sqrt();
            let value = |x: u16| f64::from(bf16_to_f32(x));
            let nan = f32_to_bf16(f32::NAN);
            for (in_place, (causal, masked)) in [false, true].into_iter().flat_map(|p| [(false, false), (true, false), (false, true), (true, true)].map(|c| (p, c))) {
                let (laid, strides) = test_operands(in_place, shape, [&q, &k, &v], nan);
                let out_strides = strides[3];
                let bias = masked.then(|| Bias { data: mask.as_ptr(), batch_stride: len_q * len_kv, head_stride: 0 });
                let valid = if masked { len_kv.saturating_sub(3).max(1) } else { len_kv };
                let mut out = vec![nan; q.len()];
                let mut lse = vec![f32::NAN; batch * heads * len_q];
                let mut presents = [vec![nan; k.len()], vec![nan; v.len()]];
                for parts in [1, 3] {
                    let at = |i: usize| Placed { data: laid[i].as_ptr().cast_mut(), strides: strides[i] };
                    let operands = (at(0), at(1), at(2), scale);
                    let written = presents.each_mut().map(|p| in_place.then_some(p.as_mut_ptr()));
                    let results = (Placed { data: out.as_mut_ptr(), strides: out_strides }, lse.as_mut_ptr(), written);
                    let (attention, units, _) = TileAttention::new(operands, (bias, valid), results, shape, causal, parts);
                    (0..units).for_each(|u| unsafe { attention.chunk(u) });
                    if in_place {
                        assert!(presents[0] == k && presents[1] == v, "{shape:?}: the presents are the keys and values");
                    }
                    let case = format!("{shape:?} causal {causal} masked {masked} in place {in_place} parts {parts}");
                    let (q, k, v) = (|at: usize| value(q[at]) * f64::from(scale), |at: usize| value(k[at]), |at: usize| value(v[at]));
                    let got = |at: usize| value(out[at]);
                    let close = |got: f64, want: f64| (got - want).abs() <= (2.0 + want.abs()) / 256.0;
                    check_against_f64(shape, (causal, masked.then_some(&mask[..]), valid), [&q, &k, &v], (&got, out_strides, &lse), &close, &case);
                }
            }
        }
    }
}
