//! f32 convolutions of 3×3 windows, stride 1, padding 1 (NCHW input, OIHW weight): a small UNet's,
//! a ResNet's first stages', a VAE's or UNet's ends', narrower than Winograd's. XLA:CPU ran those
//! at a quarter to all of eager's rate (calls, µs: `[1, 4, 32, 32] → 32` 187 against 48, `[1, 96,
//! 32, 32] → 32` 545 against 320, `[1, 64, 16, 16]` 205 against 198); this kernel, 1.15-3× faster
//! than XLA's, at about 90 % of a core's peak.
//!
//! Computed where the values lie, as our product's tile computes rows times a panel: twelve
//! output channels by two vectors of sixteen output positions stay in registers while each
//! input channel's nine taps add the weight (broadcast) times the input shifted by the tap (a
//! vector load). The padding is the loads' masks: a tap's lanes whose inputs lie past the
//! image's edges load zeros.
//!
//! bf16 convolutions go the same way on AVX-512 BF16's `vdpbf16ps`, two input channels at once
//! (its pairs of K): the input's channels come in pairs (`[N, C/2, H, W, 2]`) and the weight's
//! are paired once per weight version (`paired_weight`), a tap's load is sixteen positions'
//! pairs, and each output's f32 sums, its bias added, are rounded once to bf16 (eager's order).
//! XLA:CPU convolves bf16 in f32.

use super::gemm::{Line, ROWS};
use super::pool::{Chunked, UNITS_PER_THREAD};

/// Output positions per vector.
const LANES: usize = 16;
/// Convolutions up to this many flops run on the calling thread alone (the products' bound is a
/// fourth of it): split, the tiny UNet's first and last (2.4 MFLOP, ~37 µs alone) took 75 and
/// 24-40 µs in its call, XLA's worker waking late, and its whole call ran 0.86-0.95× with them
/// alone (in turns, four runs); convolutions up to 32 MFLOP alone gained less (0.94×), all of them
/// alone nothing (0.99×).
const ALONE_MAX_FLOPS: usize = 8 << 20;

#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub batch: usize,
    pub channels: usize,
    pub outputs: usize,
    pub height: usize,
    pub width: usize,
}

impl Shape {
    /// An image's pairs of output vectors (the last one alone where they are odd).
    fn tiles(&self) -> usize {
        self.plane().div_ceil(LANES).div_ceil(2)
    }

    pub(super) fn plane(&self) -> usize {
        self.height * self.width
    }
}

/// A convolution's operands: f32 `x` `[batch, channels, height, width]`, `w` `[outputs,
/// channels, 3, 3]` and `y` `[batch, outputs, height, width]`; or bf16 ones whose `channels` are
/// pairs of channels (`x` `[batch, channels, height, width, 2]`, `w` `[outputs, channels, 9]`
/// from `paired_weight`, each pair one u32), `y` bf16, and an f32 `bias` `[outputs]` (null: none).
#[derive(Clone, Copy)]
pub(super) enum Operands {
    F32 { x: *const f32, w: *const f32, y: *mut f32 },
    Bf16Pairs { x: *const u32, w: *const u32, y: *mut u16, bias: *const f32 },
}

/// One convolution.
pub(super) struct Conv {
    operands: Operands,
    shape: Shape,
    /// Units per image, and an image's tiles per unit.
    parts: usize,
    tiles_per_part: usize,
}

// SAFETY: the pointers are read (and `y` written in disjoint units) only while the handler's
// call runs, which outlives every unit.
unsafe impl Send for Conv {}
unsafe impl Sync for Conv {}

/// Where a tap's vector of inputs starts (in its channel's plane; before the plane for the top
/// row's taps, so only masked lanes reach there) and which of its lanes lie in the image.
#[derive(Clone, Copy, Default)]
pub(super) struct Tap {
    pub offset: isize,
    pub mask: u16,
}

/// An output vector: sixteen positions on from `at` in an output plane (a row's end and the next
/// row's start alike, so that images narrower than a vector fill it), the lanes that lie in the
/// plane, and its nine taps (`3 * ky + kx`).
#[derive(Clone, Copy, Default)]
pub(super) struct Positions {
    pub at: usize,
    pub mask: u16,
    pub taps: [Tap; 9],
}

impl Positions {
    /// Vector `v` of an image of `shape`.
    fn new(shape: &Shape, v: usize) -> Self {
        let at = v * LANES;
        let (height, width) = (shape.height as isize, shape.width as isize);
        // Each lane's row and column, `None` past the plane.
        let mut lanes = [None; LANES];
        for (i, lane) in lanes.iter_mut().enumerate().take(shape.plane().saturating_sub(at)) {
            *lane = Some((((at + i) / shape.width) as isize, ((at + i) % shape.width) as isize));
        }
        let mask_of = |inside: &dyn Fn(isize, isize) -> bool| lanes.iter().enumerate().fold(0u16, |m, (i, lane)| match lane {
            Some((row, col)) if inside(*row, *col) => m | 1 << i,
            _ => m,
        });
        let mut taps = [Tap::default(); 9];
        for (t, tap) in taps.iter_mut().enumerate() {
            let (dy, dx) = ((t / 3) as isize - 1, (t % 3) as isize - 1);
            let mask = mask_of(&|row, col| (0..height).contains(&(row + dy)) && (0..width).contains(&(col + dx)));
            *tap = Tap { offset: at as isize + dy * width + dx, mask };
        }
        Positions { at, mask: mask_of(&|_, _| true), taps }
    }
}

impl Conv {
    /// The convolution and its units of work: each image's output positions in `UNITS_PER_THREAD`
    /// runs a thread (one below `ALONE_MAX_FLOPS`, where waking a worker costs what it saves).
    /// A bf16 one's pairs count as one f32 channel each (one `vdpbf16ps` an `fma`).
    pub fn new(operands: Operands, shape: Shape, threads: usize) -> (Self, usize) {
        let tiles = shape.tiles();
        let flops = 2 * 9 * shape.batch * shape.outputs * shape.channels * shape.plane();
        let wanted = if flops <= ALONE_MAX_FLOPS { 1 } else { UNITS_PER_THREAD * threads.max(1) };
        let tiles_per_part = tiles.div_ceil(wanted).max(1);
        let parts = tiles.div_ceil(tiles_per_part).max(1);
        (Conv { operands, shape, parts, tiles_per_part }, shape.batch * parts)
    }
}

impl Chunked for Conv {
    /// Unit `chunk`: a run of one image's tiles, for every output channel (twelve at a time, so
    /// that their weights stay in cache over the run).
    unsafe fn chunk(&self, chunk: usize) {
        let s = &self.shape;
        let (image, part) = (chunk / self.parts, chunk % self.parts);
        let first = part * self.tiles_per_part;
        let tiles = first..(first + self.tiles_per_part).min(s.tiles());
        let vectors = s.plane().div_ceil(LANES);
        let (image_in, image_out) = (image * s.channels * s.plane(), image * s.outputs * s.plane());
        let positions: Vec<[Positions; 2]> = tiles
            .map(|t| {
                let second = if 2 * t + 1 < vectors { Positions::new(s, 2 * t + 1) } else { Positions::default() };
                [Positions::new(s, 2 * t), second]
            })
            .collect();
        for first_output in (0..s.outputs).step_by(ROWS) {
            let rows = ROWS.min(s.outputs - first_output);
            let (weights, outputs) = (first_output * s.channels * 9, image_out + first_output * s.plane());
            for pair in &positions {
                match self.operands {
                    Operands::F32 { x, w, y } => tile(s, x.add(image_in), w.add(weights), y.add(outputs), pair, rows),
                    Operands::Bf16Pairs { x, w, y, bias } => {
                        let bias = if bias.is_null() { bias } else { bias.add(first_output) };
                        bf16_tile(s, (x.add(image_in), w.add(weights), y.add(outputs), bias), pair, rows)
                    }
                }
            }
        }
    }
}

/// A bf16 weight `[outputs, channels, 3, 3]` (OIHW) as `Operands::Bf16Pairs` reads it, `[outputs,
/// channels / 2, 9]` u32s each holding a pair of channels' values (the low half the even
/// channel's; a zero past an odd count), in cache lines.
///
/// # Safety
/// `w` must cover `outputs · channels · 9` bf16 values.
pub(super) unsafe fn paired_weight(w: *const u16, outputs: usize, channels: usize) -> Vec<Line> {
    let pairs = channels.div_ceil(2);
    let w = std::slice::from_raw_parts(w, outputs * channels * 9);
    let mut lines = vec![Line([0.0; 16]); paired_weight_u32s(outputs, pairs).div_ceil(16)];
    let paired = std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut u32, lines.len() * 16);
    for (o, c, t) in (0..outputs).flat_map(|o| (0..channels).flat_map(move |c| (0..9).map(move |t| (o, c, t)))) {
        let (group, row) = (o / ROWS, o % ROWS);
        paired[((group * pairs + c / 2) * 9 + t) * ROWS + row] |= u32::from(w[(o * channels + c) * 9 + t]) << (16 * (c % 2));
    }
    lines
}

/// The u32s of `paired_weight`'s result.
pub(super) fn paired_weight_u32s(outputs: usize, pairs: usize) -> usize {
    outputs.div_ceil(ROWS) * ROWS * pairs * 9
}

/// Whether this CPU runs bf16 convolutions (`Operands::Bf16Pairs`).
pub(super) fn bf16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::bf16_dots::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `tile` for bf16 pairs (`Operands::Bf16Pairs`); the CPU must be `bf16_available()`.
unsafe fn bf16_tile(s: &Shape, operands: (*const u32, *const u32, *mut u16, *const f32), pair: &[Positions; 2], rows: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let wide = pair[1].mask != 0;
        macro_rules! rows {
            ($($n:literal)*) => {
                match (rows, wide) {
                    $(
                        ($n, true) => x86::bf16_tile::<$n, true>(s, operands, pair),
                        ($n, false) => x86::bf16_tile::<$n, false>(s, operands, pair),
                    )*
                    _ => unreachable!(),
                }
            };
        }
        rows!(1 2 3 4 5 6 7 8 9 10 11 12);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (s, operands, pair, rows);
        unreachable!("bf16 convolutions run on AVX-512 BF16 only")
    }
}

/// `rows` ≤ `ROWS` output channels (weights `w`, outputs `y`) at the tile's positions.
unsafe fn tile(s: &Shape, x: *const f32, w: *const f32, y: *mut f32, pair: &[Positions; 2], rows: usize) {
    #[cfg(target_arch = "x86_64")]
    if super::gemm::avx512() {
        let wide = pair[1].mask != 0;
        macro_rules! rows {
            ($($n:literal)*) => {
                match (rows, wide) {
                    $(
                        ($n, true) => x86::tile::<$n, true>(s, x, w, y, pair),
                        ($n, false) => x86::tile::<$n, false>(s, x, w, y, pair),
                    )*
                    _ => unreachable!(),
                }
            };
        }
        rows!(1 2 3 4 5 6 7 8 9 10 11 12);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        return super::avx2::conv_tile(s, (x, w, y), pair, rows);
    }
    for p in pair.iter().filter(|p| p.mask != 0) {
        for r in 0..rows {
            for i in (0..LANES).filter(|i| p.mask >> i & 1 == 1) {
                let mut sum = 0f32;
                for c in 0..s.channels {
                    for (t, tap) in p.taps.iter().enumerate().filter(|(_, tap)| tap.mask >> i & 1 == 1) {
                        let input = *x.add(c * s.plane()).offset(tap.offset + i as isize);
                        sum = input.mul_add(*w.add((r * s.channels + c) * 9 + t), sum);
                    }
                }
                *y.add(r * s.plane() + p.at + i) = sum;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Positions, Shape, ROWS};
    use std::arch::x86_64::*;
    use std::mem::transmute;

    /// The sums both tiles keep, `M` outputs by the pair's two vectors (the second `WIDE` only):
    /// each channel's (or pair's) nine taps, a tap's inputs `load`ed once (a mask and an address)
    /// and multiplied by each output's weight (`broadcast`), added by `add(sums, weight, inputs)`.
    macro_rules! tap_sums {
        ($s:expr, ($x:expr, $w:expr, $per_channel:expr, $per_tap:expr, $per_output:expr), $pair:expr, $load:expr, $broadcast:expr, $add:expr) => {{
            let plane = $s.plane();
            let mut lo = [_mm512_setzero_ps(); M];
            let mut hi = [_mm512_setzero_ps(); M];
            for c in 0..$s.channels {
                let (xc, wc) = ($x.add(c * plane), $w.add(c * $per_channel));
                for t in 0..9 {
                    let load = |p: &Positions| $load(p.taps[t].mask, xc.wrapping_offset(p.taps[t].offset));
                    let b0 = load(&$pair[0]);
                    // The second vector's load is skipped (its sums unused) where it is not `WIDE`.
                    let b1 = if WIDE { load(&$pair[1]) } else { b0 };
                    for r in 0..M {
                        let a = $broadcast(*wc.add(r * $per_output + t * $per_tap));
                        lo[r] = $add(lo[r], a, b0);
                        if WIDE {
                            hi[r] = $add(hi[r], a, b1);
                        }
                    }
                }
            }
            (lo, hi)
        }};
    }

    /// `M` output channels at the pair's first vector of positions, and its second when `WIDE`.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn tile<const M: usize, const WIDE: bool>(s: &Shape, x: *const f32, w: *const f32, y: *mut f32, pair: &[Positions; 2]) {
        let plane = s.plane();
        let (lo, hi) = tap_sums!(s, (x, w, 9, 1, s.channels * 9), pair, _mm512_maskz_loadu_ps, _mm512_set1_ps, |sums, a, b| _mm512_fmadd_ps(a, b, sums));
        for r in 0..M {
            _mm512_mask_storeu_ps(y.add(r * plane + pair[0].at), pair[0].mask, lo[r]);
            if WIDE {
                _mm512_mask_storeu_ps(y.add(r * plane + pair[1].at), pair[1].mask, hi[r]);
            }
        }
    }

    /// `tile` on bf16 pairs: each tap's load is sixteen positions' pairs of channels, each
    /// weight broadcast a pair, one `vdpbf16ps` adding both; the sums plus the bias rounded to
    /// bf16 (to nearest even, as eager rounds).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn bf16_tile<const M: usize, const WIDE: bool>(
        s: &Shape,
        (x, w, y, bias): (*const u32, *const u32, *mut u16, *const f32),
        pair: &[Positions; 2],
    ) {
        let plane = s.plane();
        let load = |mask, at: *const u32| transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi32(mask, at as *const i32));
        let broadcast = |pair: u32| transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32));
        let (lo, hi) = tap_sums!(s, (x, w, 9 * ROWS, ROWS, 1), pair, load, broadcast, |sums, a, b| _mm512_dpbf16_ps(sums, a, b));
        for r in 0..M {
            let b = if bias.is_null() { _mm512_setzero_ps() } else { _mm512_set1_ps(*bias.add(r)) };
            let rounded = transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(lo[r], b)));
            _mm256_mask_storeu_epi16(y.add(r * plane + pair[0].at) as *mut i16, pair[0].mask, rounded);
            if WIDE {
                let rounded = transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(hi[r], b)));
                _mm256_mask_storeu_epi16(y.add(r * plane + pair[1].at) as *mut i16, pair[1].mask, rounded);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Images narrower and wider than a vector, on and off its sixteen positions (one position,
    /// 5 × 7, 4 × 24, 3 × 32, 9 × 40, 8 × 8, 40 × 40), output channels on and off the tile's
    /// twelve, a batch, against sums in f64.
    #[test]
    fn agrees_with_f64_sums() {
        let mut next = super::super::uniform(5);
        for (batch, channels, outputs, height, width) in [(1, 3, 5, 1, 1), (2, 4, 13, 5, 7), (1, 6, 24, 4, 24), (1, 2, 12, 3, 32), (2, 5, 30, 9, 40), (1, 40, 8, 16, 16), (2, 7, 14, 8, 8), (1, 2, 13, 40, 40)] {
            let shape = Shape { batch, channels, outputs, height, width };
            let x: Vec<f32> = (0..batch * channels * height * width).map(|_| next()).collect();
            let w: Vec<f32> = (0..outputs * channels * 9).map(|_| next()).collect();
            for threads in [1, 3] {
                let mut y = vec![f32::NAN; batch * outputs * height * width];
                let (conv, units) = Conv::new(Operands::F32 { x: x.as_ptr(), w: w.as_ptr(), y: y.as_mut_ptr() }, shape, threads);
                (0..units).for_each(|u| unsafe { conv.chunk(u) });
                for (at, &got) in y.iter().enumerate() {
                    let (n, o, row, col) = (at / (outputs * height * width), at / (height * width) % outputs, at / width % height, at % width);
                    let mut want = 0f64;
                    for c in 0..channels {
                        for (ky, kx) in (0..3).flat_map(|ky| (0..3).map(move |kx| (ky, kx))) {
                            let (r, q) = (row as isize + ky - 1, col as isize + kx - 1);
                            if (0..height as isize).contains(&r) && (0..width as isize).contains(&q) {
                                let input = x[((n * channels + c) * height + r as usize) * width + q as usize];
                                want += f64::from(input) * f64::from(w[(o * channels + c) * 9 + (ky * 3 + kx) as usize]);
                            }
                        }
                    }
                    let tolerance = 1e-5 * ((channels * 9) as f64).sqrt();
                    assert!((f64::from(got) - want).abs() <= tolerance, "{shape:?} at {at}: {got} against {want}");
                }
            }
        }
    }

    /// bf16 pairs of channels (the weight paired from OIHW by `paired_weight`) with a bias and
    /// without, the same shapes: the f64 sums of the bf16 products plus the bias, rounded once to
    /// bf16 (within a step of it, and f32's sums).
    #[test]
    fn bf16_pairs_agree_with_f64_sums_rounded_once() {
        if !bf16_available() {
            return;
        }
        let mut next = super::super::uniform(9);
        let (bf16, value) = (super::super::f32_to_bf16, |b: u16| f64::from(super::super::bf16_to_f32(b)));
        for (batch, pairs, outputs, height, width) in [(1, 3, 5, 1, 1), (2, 4, 13, 5, 7), (1, 6, 24, 4, 24), (2, 5, 30, 9, 40), (1, 20, 8, 16, 16), (1, 2, 13, 40, 40)] {
            let shape = Shape { batch, channels: pairs, outputs, height, width };
            let plane = height * width;
            let x: Vec<u16> = (0..batch * pairs * plane * 2).map(|_| bf16(next() * 2.0)).collect();
            // OIHW, as the model holds it.
            let w: Vec<u16> = (0..outputs * pairs * 18).map(|_| bf16(next())).collect();
            let paired = unsafe { paired_weight(w.as_ptr(), outputs, 2 * pairs) };
            let bias: Vec<f32> = (0..outputs).map(|_| next()).collect();
            for (threads, biased) in [(1, false), (3, true)] {
                let mut y = vec![0u16; batch * outputs * plane];
                let operands = Operands::Bf16Pairs {
                    x: x.as_ptr() as *const u32,
                    w: paired.as_ptr() as *const u32,
                    y: y.as_mut_ptr(),
                    bias: if biased { bias.as_ptr() } else { std::ptr::null() },
                };
                let (conv, units) = Conv::new(operands, shape, threads);
                (0..units).for_each(|u| unsafe { conv.chunk(u) });
                for (at, &got) in y.iter().enumerate() {
                    let (n, o, row, col) = (at / (outputs * plane), at / plane % outputs, at / width % height, at % width);
                    let mut want = if biased { f64::from(bias[o]) } else { 0.0 };
                    for (p, half) in (0..pairs).flat_map(|p| [(p, 0), (p, 1)]) {
                        for (ky, kx) in (0..3).flat_map(|ky| (0..3).map(move |kx| (ky, kx))) {
                            let (r, q) = (row as isize + ky - 1, col as isize + kx - 1);
                            if (0..height as isize).contains(&r) && (0..width as isize).contains(&q) {
                                let input = x[(((n * pairs + p) * height + r as usize) * width + q as usize) * 2 + half];
                                want += value(input) * value(w[((o * pairs + p) * 2 + half) * 9 + (ky * 3 + kx) as usize]);
                            }
                        }
                    }
                    let step = 2f64.powi(want.abs().max(1e-30).log2().floor() as i32 - 7);
                    let tolerance = step + 1e-6 * ((pairs * 18) as f64).sqrt();
                    assert!((value(got) - want).abs() <= tolerance, "{shape:?} at {at}: {} against {want}", value(got));
                }
            }
        }
    }
}
