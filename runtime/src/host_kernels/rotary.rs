//! Rotary position embeddings as transformers apply them to queries and keys: `x · cos +
//! rotate_half(x) · sin`, with `rotate_half(x) = cat(-x[D/2:], x[:D/2])`, read from the
//! projection's rows as they lie (`[B, L, H, D]`) and written heads first (`[B, H, L, D]`),
//! as attention reads them.
//!
//! XLA:CPU ran each as one loop of scalar gathers through the transpose, the slices and the
//! concatenation: a batch-8 tiny Llama's query and key of a layer, 98 K values, took it 123-156
//! µs. Here a half row is one stretch of vector lanes, multiplied and added as eager does
//! (`a·c − b·s` is eager's `a·c + (−b)·s` exactly), so the results are eager's to the bit.

use super::pool::Chunked;

/// Values per unit of work: a batch-8 tiny Llama's query and key (64 Ki and 32 Ki values) split
/// over two threads took its bare execute 5.78 → 5.67 ms (in a slow phase of an AMD EPYC Zen 3,
/// in turns against 2^16 a unit); 2^12 took the batch-1 one's 0.68 → 0.69.
const VALUES_PER_UNIT: usize = 1 << 14;

/// `out[b, h, l] = x[b, h, l] · cos[b, l] + rotate_half(x[b, h, l]) · sin[b, l]` for every
/// `D`-wide row, with `x` `[B, L, H, D]` (`rows_first`) or `[B, H, L, D]`, `cos` and `sin`
/// `[B or 1, L, D]` and `out` `[B, H, L, D]`, cut into `units` runs of `(b, h)` pairs.
pub(super) struct Rotary {
    pub x: *const f32,
    pub cos: *const f32,
    pub sin: *const f32,
    pub out: *mut f32,
    /// `[B, H, L, D]`.
    pub dims: [usize; 4],
    /// `cos` and `sin` hold a row per batch, not one for all.
    pub per_batch: bool,
    pub rows_first: bool,
    pub units: usize,
}

impl Rotary {
    /// The units for up to `threads` threads.
    pub fn units(dims: [usize; 4], threads: usize) -> usize {
        let [b, h, ..] = dims;
        (dims.iter().product::<usize>() / VALUES_PER_UNIT).clamp(1, threads.max(1)).min((b * h).max(1))
    }

    /// Rotates the `L` rows of head `h` of batch `b`.
    ///
    /// # Safety
    /// The pointers must cover `dims`, and the CPU must have AVX2 (the handler is registered
    /// only where the products' kernels run, which need it).
    unsafe fn head(&self, b: usize, h: usize) {
        let [_, heads, tokens, width] = self.dims;
        let table = if self.per_batch { b * tokens * width } else { 0 };
        let (cos, sin) = (std::slice::from_raw_parts(self.cos.add(table), tokens * width), std::slice::from_raw_parts(self.sin.add(table), tokens * width));
        // Between one token's row and the next.
        let (first, stride) = match self.rows_first {
            true => ((b * tokens * heads + h) * width, heads * width),
            false => ((b * heads + h) * tokens * width, width),
        };
        let out = std::slice::from_raw_parts_mut(self.out.add((b * heads + h) * tokens * width), tokens * width);
        let x = |l: usize| std::slice::from_raw_parts(self.x.add(first + l * stride), width);
        rows(&x, (cos, sin), out, width)
    }
}

impl Chunked for Rotary {
    /// # Safety
    /// As `head`; units write disjoint heads.
    unsafe fn chunk(&self, unit: usize) {
        let [batches, heads, ..] = self.dims;
        let pairs = batches * heads;
        let per = pairs.div_ceil(self.units.max(1));
        for pair in unit * per..((unit + 1) * per).min(pairs) {
            self.head(pair / heads, pair % heads);
        }
    }
}

/// Each token's row `x(l)` rotated into `out`'s row `l` by its row of the `tables`, on AVX2's
/// eight lanes, a half row's first multiple of eight at a time.
#[target_feature(enable = "avx2")]
unsafe fn rows<'x>(x: &impl Fn(usize) -> &'x [f32], (cos, sin): (&[f32], &[f32]), out: &mut [f32], width: usize) {
    use std::arch::x86_64::*;
    let half = width / 2;
    let lanes = half / 8 * 8;
    for (l, ((out, cos), sin)) in out.chunks_exact_mut(width).zip(cos.chunks_exact(width)).zip(sin.chunks_exact(width)).enumerate() {
        let x = x(l);
        let (x, c, s, o) = (x.as_ptr(), cos.as_ptr(), sin.as_ptr(), out.as_mut_ptr());
        for i in (0..lanes).step_by(8) {
            let (x1, x2) = (_mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(x.add(half + i)));
            let first = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c.add(i))), _mm256_mul_ps(x2, _mm256_loadu_ps(s.add(i))));
            let second = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c.add(half + i))), _mm256_mul_ps(x1, _mm256_loadu_ps(s.add(half + i))));
            _mm256_storeu_ps(o.add(i), first);
            _mm256_storeu_ps(o.add(half + i), second);
        }
        for i in lanes..half {
            rotate_pair((x, c, s, o), half, i);
        }
    }
}

/// Values `i` and `half + i` of a row rotated.
///
/// # Safety
/// The pointers must cover `2 · half` values.
#[inline(always)]
unsafe fn rotate_pair((x, c, s, o): (*const f32, *const f32, *const f32, *mut f32), half: usize, i: usize) {
    let (x1, x2) = (*x.add(i), *x.add(half + i));
    *o.add(i) = x1 * *c.add(i) - x2 * *s.add(i);
    *o.add(half + i) = x2 * *c.add(half + i) + x1 * *s.add(half + i);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout, one table or one per batch, in one unit or several, half rows of whole
    /// vectors, of none and of both with a tail, against the formula as eager evaluates it.
    #[test]
    fn matches_eager_formula() {
        if !super::super::avx2::available() {
            return;
        }
        let mut next = super::super::uniform(11);
        for (dims, per_batch, rows_first, units) in [
            ([2, 3, 5, 16], false, true, 1),
            ([2, 3, 5, 16], true, true, 4),
            ([3, 2, 4, 6], true, false, 2),
            ([1, 4, 7, 2], false, false, 3),
            ([2, 2, 3, 36], true, true, 2),
        ] {
            let [b, h, l, d] = dims;
            let x: Vec<f32> = (0..b * h * l * d).map(|_| next() * 4.0).collect();
            let tables = if per_batch { b } else { 1 };
            let (cos, sin): (Vec<f32>, Vec<f32>) = (0..tables * l * d).map(|_| (next(), next())).unzip();
            let mut out = vec![f32::NAN; x.len()];
            let job = Rotary { x: x.as_ptr(), cos: cos.as_ptr(), sin: sin.as_ptr(), out: out.as_mut_ptr(), dims, per_batch, rows_first, units };
            (0..units).for_each(|u| unsafe { job.chunk(u) });
            for (bi, hi, li, i) in (0..b).flat_map(|bi| (0..h).flat_map(move |hi| (0..l).flat_map(move |li| (0..d).map(move |i| (bi, hi, li, i))))) {
                let at = |i: usize| if rows_first { x[((bi * l + li) * h + hi) * d + i] } else { x[((bi * h + hi) * l + li) * d + i] };
                let t = (if per_batch { bi } else { 0 } * l + li) * d + i;
                let rotated = if i < d / 2 { -at(i + d / 2) } else { at(i - d / 2) };
                let expected = at(i) * cos[t] + rotated * sin[t];
                assert_eq!(out[((bi * h + hi) * l + li) * d + i].to_bits(), expected.to_bits(), "{dims:?} at {bi} {hi} {li} {i}");
            }
        }
    }
}
