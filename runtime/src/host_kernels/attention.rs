//! f32 attention, `softmax(q kᵀ) v` per head with its logsumexp, as one kernel: XLA:CPU runs
//! it as two products and a softmax between them, each on its own and each writing the whole
//! `[H, L, S]` scores out (a tiny Llama's causal `[1, 4, 128, 16]` took 126 µs, eager's flash
//! kernel 46).
//!
//! A head's queries go through in blocks of `ROWS`: their scores against the keys as one
//! product tile by tile (the keys copied once per head into `[E, 32]` panels), the softmax of
//! each row in place, and the product of the exponentials by `v`, divided by the row's sum
//! only at the end. A block's scores stay in L1 from the first product to the second.

use super::gemm::{alone_max_flops, pack_transposed, Lines, Tile, COLUMNS, ROWS};
use super::pool::{Chunked, UNITS_PER_THREAD};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Queries `[batch, heads, len_q, dim]` over keys and values `[batch, kv_heads, len_kv, dim]`
/// (query head `h` reads key/value head `h / (heads / kv_heads)`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub len_q: usize,
    pub len_kv: usize,
    pub dim: usize,
}

/// What a mask adds to the scores: `[mb, mh, len_q, len_kv]` f32 (-inf hides a key), `mb` 1 or
/// the batch, `mh` 1 or the heads, given as the strides of its batch and head dims (0 where
/// broadcast).
#[derive(Clone, Copy)]
pub(super) struct Bias {
    pub data: *const f32,
    pub batch_stride: usize,
    pub head_stride: usize,
}

impl Bias {
    /// What it adds to the scores of `query` of head `h` of batch entry `b` (`len_kv` keys).
    ///
    /// # Safety
    /// As `pointer::add`: the mask covers that row.
    pub unsafe fn row(&self, (b, h): (usize, usize), query: usize, len_kv: usize) -> *const f32 {
        self.data.add(b * self.batch_stride + h * self.head_stride + query * len_kv)
    }
}

/// Where an operand of `[batch, heads, rows, dim]` keeps row `r` of head `h` of batch entry `b`:
/// at `offset + b·batch + h·head + r·row` (its `dim` values next to each other). Queries, keys
/// and values are then read where the projections leave them (`[B, S, H, E]`, or a fused
/// projection's columns), and the output written as `[B, L, H, E]` (what reads it next), where
/// XLA:CPU copied each into `[B, H, S, E]` and the output back: four to eight loops a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Strides {
    pub offset: usize,
    pub batch: usize,
    pub head: usize,
    pub row: usize,
}

impl Strides {
    /// Row-major `[batch, heads, rows, dim]`.
    pub fn packed(heads: usize, rows: usize, dim: usize) -> Strides {
        Strides { offset: 0, batch: heads * rows * dim, head: rows * dim, row: dim }
    }

    /// Row-major `[batch, rows, heads, dim]`.
    pub fn interleaved(heads: usize, rows: usize, dim: usize) -> Strides {
        Strides { offset: 0, batch: rows * heads * dim, head: dim, row: heads * dim }
    }

    /// How many elements from the first an operand `[batch, heads, rows, dim]` laid out so
    /// spans (0 where it is empty; None past `usize`).
    pub fn extent(&self, [batch, heads, rows, dim]: [usize; 4]) -> Option<usize> {
        if batch * heads * rows * dim == 0 {
            return Some(0);
        }
        let last = [(batch, self.batch), (heads, self.head), (rows, self.row)]
            .iter()
            .try_fold(self.offset, |at, &(n, stride)| at.checked_add((n - 1).checked_mul(stride)?))?;
        last.checked_add(dim)
    }

    /// Row `row` of head `h` of batch entry `b` of `data`.
    ///
    /// # Safety
    /// As `pointer::add`: the operand covers that row.
    pub unsafe fn row<T>(&self, data: *mut T, (b, h): (usize, usize), row: usize) -> *mut T {
        data.add(self.offset + b * self.batch + h * self.head + row * self.row)
    }
}

/// The kernels' tests' operands: `q`, `k` and `v` (row-major) packed, or each placed as the
/// middle third of a fused projection's rows (`[B, S, 3, H, E]`) in memory that is `fill` (NaN:
/// a stray read turns a result NaN) elsewhere; and where the four operands' rows are, the
/// output `[B, L, H, E]` where placed.
#[cfg(test)]
pub(super) fn test_operands<T: Copy>(in_place: bool, s: Shape, [q, k, v]: [&[T]; 3], fill: T) -> ([Vec<T>; 3], [Strides; 4]) {
    let dims = [[s.batch, s.heads, s.len_q, s.dim], [s.batch, s.kv_heads, s.len_kv, s.dim], [s.batch, s.kv_heads, s.len_kv, s.dim]];
    let strides = dims.map(|[_, heads, rows, dim]| match in_place {
        true => Strides { offset: heads * dim, batch: rows * 3 * heads * dim, head: dim, row: 3 * heads * dim },
        false => Strides::packed(heads, rows, dim),
    });
    let mut laid = [q, k, v].map(|data| vec![fill; if in_place { 3 * data.len() } else { data.len() }]);
    for ((out, data), (&[_, heads, rows, dim], strides)) in laid.iter_mut().zip([q, k, v]).zip(dims.iter().zip(strides)) {
        for (at, row) in data.chunks_exact(dim).enumerate() {
            let first = strides.offset + at / (heads * rows) * strides.batch + at / rows % heads * strides.head + at % rows * strides.row;
            out[first..first + dim].copy_from_slice(row);
        }
    }
    let out = if in_place { Strides::interleaved(s.heads, s.len_q, s.dim) } else { Strides::packed(s.heads, s.len_q, s.dim) };
    (laid, [strides[0], strides[1], strides[2], out])
}

/// The kernels' tests' reference: checks `lse` and the output (`out(at)` its element `at`, its
/// rows where `out_strides` place them) of an attention of `s` over `q` (already scaled), `k`
/// and `v` (row-major, element `at` read as f64), with the mask's bias and the count of keys
/// not padding as the kernels take them, against f64: the logsumexp within 1e-4, each output
/// as `close(got, want)` says.
#[cfg(test)]
pub(super) fn check_against_f64(
    s: Shape,
    (causal, mask, valid): (bool, Option<&[f32]>, usize),
    [q, k, v]: [&dyn Fn(usize) -> f64; 3],
    (out, out_strides, lse): (&dyn Fn(usize) -> f64, Strides, &[f32]),
    close: &dyn Fn(f64, f64) -> bool,
    case: &str,
) {
    let Shape { batch, heads, kv_heads, len_q, len_kv, dim } = s;
    for head in 0..batch * heads {
        let kv = head / heads * kv_heads + head % heads / (heads / kv_heads);
        for i in 0..len_q {
            let visible = if causal { (i + 1).min(valid) } else { valid };
            let added = |j: usize| mask.map_or(0.0, |m| f64::from(m[(head / heads * len_q + i) * len_kv + j]));
            let score = |j: usize| added(j) + (0..dim).map(|e| q((head * len_q + i) * dim + e) * k((kv * len_kv + j) * dim + e)).sum::<f64>();
            let scores: Vec<f64> = (0..visible).map(score).collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            let at = head * len_q + i;
            let want_lse = if max == f64::NEG_INFINITY { 0.0 } else { max + sum.ln() };
            assert!((f64::from(lse[at]) - want_lse).abs() < 1e-4, "{case}: lse {} vs {want_lse}", lse[at]);
            let row = out_strides.offset + head / heads * out_strides.batch + head % heads * out_strides.head + i * out_strides.row;
            for e in 0..dim {
                let weighted = scores.iter().enumerate().map(|(j, s)| (s - max).exp() / sum * v((kv * len_kv + j) * dim + e));
                let want: f64 = if max == f64::NEG_INFINITY { 0.0 } else { weighted.sum() };
                let got = out(row + e);
                assert!(close(got, want), "{case} at {at},{e}: {got} vs {want}");
            }
        }
    }
}

/// An operand where `strides` says its rows are.
#[derive(Clone, Copy, Debug)]
pub(super) struct Placed<T> {
    pub data: *mut T,
    pub strides: Strides,
}

/// Where the kernel writes copies of the keys and of the values as `[B, Hkv, S, E]`, if it
/// does: where it reads them in place and the graph returns them too (a cache's update from
/// nothing, GPT-2's presents), XLA:CPU made each in two loops of its own, 0.2 ms of GPT-2's
/// 2.7 at batch 8.
pub(super) type Presents<T> = [Option<*mut T>; 2];

/// Writes unit `unit`'s share of `presents`: its key/value head, all `len_kv` rows, where it is
/// the unit of the first query head of that head's group and of its first queries (one unit
/// each).
///
/// # Safety
/// `k`, `v` and `presents` must cover the shape.
pub(super) unsafe fn write_presents<T: Copy>(presents: Presents<T>, [k, v]: [&Placed<T>; 2], s: Shape, unit: &Unit) {
    if presents == [None, None] || unit.queries.start != 0 || !unit.h.is_multiple_of(s.heads / s.kv_heads) {
        return;
    }
    let kv_head = unit.kv - unit.b * s.kv_heads;
    for (from, to) in [k, v].into_iter().zip(presents).filter_map(|(from, to)| Some((from, to?))) {
        let to = to.add(unit.kv * s.len_kv * s.dim);
        for r in 0..s.len_kv {
            std::ptr::copy_nonoverlapping(from.strides.row(from.data, (unit.b, kv_head), r), to.add(r * s.dim), s.dim);
        }
    }
}

/// A cache's keys and values grown by a step's, written where the step returns them: per
/// key/value head, the cache's `before` rows (`past`, packed as a padded graph's packed input
/// keeps them: head `j`'s rows from row `j · before`) and the step's `rows` new ones (where
/// their strides place them), into `to` packed with `before + rows` rows per head. The
/// attention then reads its keys and values there: one pass over the cache, where XLA:CPU
/// unpacked it to the bucket's size, appended the new rows and packed it again, three loops
/// over the bucket's capacity for each of a layer's keys and values.
pub(super) struct Appended<T> {
    pub past: [*const T; 2],
    pub new: [Placed<T>; 2],
    pub to: [*mut T; 2],
    pub kv_heads: usize,
    pub before: usize,
    pub rows: usize,
    pub dim: usize,
}

impl<T> Appended<T> {
    /// Where the attention reads the grown keys and values.
    pub fn grown(&self) -> [Placed<T>; 2] {
        let strides = Strides::packed(self.kv_heads, self.before + self.rows, self.dim);
        self.to.map(|data| Placed { data, strides })
    }
}

impl<T: Copy> Chunked for Appended<T> {
    /// Unit `unit`: the keys (even units) or the values (odd) of one key/value head.
    ///
    /// # Safety
    /// `past` must hold `before` rows per head, `new` the rows its strides place, `to` the
    /// grown rows.
    unsafe fn chunk(&self, unit: usize) {
        let (which, head) = (unit % 2, unit / 2);
        let (before, grown, dim) = (self.before, self.before + self.rows, self.dim);
        let to = self.to[which].add(head * grown * dim);
        std::ptr::copy_nonoverlapping(self.past[which].add(head * before * dim), to, before * dim);
        let new = &self.new[which];
        for r in 0..self.rows {
            let from = new.strides.row(new.data, (head / self.kv_heads, head % self.kv_heads), r);
            std::ptr::copy_nonoverlapping(from, to.add((before + r) * dim), dim);
        }
    }
}

/// The keys `query` sees: those before `valid` (a padded graph's count), and with the causal
/// mask only up to itself.
pub(super) fn visible_keys(causal: bool, valid: usize, query: usize) -> usize {
    if causal { (query + 1).min(valid) } else { valid }
}

/// A query's output row, `(max, sum)` its softmax's: divided by the sum, or 0 where every key
/// is hidden (`max` -inf; not 0 times the values, which may hold inf where hidden).
pub(super) fn normalize(row: &mut [f32], (max, sum): (f32, f32)) {
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
    } else {
        let inverse = 1.0 / sum;
        row.iter_mut().for_each(|o| *o *= inverse);
    }
}

/// One attention: `q` (scaled by `scale` as its rows are read), `k`, `v` and `out` as their
/// strides place them, `lse` `[batch, heads, len_q]`. Causal: query `i` sees keys `0..=i`; keys from `valid` on are
/// hidden and never read (a padded graph's). A query whose keys are all hidden gets 0, output
/// and logsumexp (as PyTorch's CPU flash kernel gives).
pub(super) struct Attention {
    q: Placed<f32>,
    k: Placed<f32>,
    v: Placed<f32>,
    scale: f32,
    bias: Option<Bias>,
    valid: usize,
    out: Placed<f32>,
    lse: *mut f32,
    presents: Presents<f32>,
    shape: Shape,
    causal: bool,
    plan: Plan,
}

static ATTENTIONS: AtomicU64 = AtomicU64::new(1);

impl Attention {
    /// The attention, how many units it splits into for `parts` threads and on how many
    /// threads (`Plan`).
    pub fn new(
        (q, k, v, scale): (Placed<f32>, Placed<f32>, Placed<f32>, f32),
        (bias, valid): (Option<Bias>, usize),
        (out, lse, presents): (Placed<f32>, *mut f32, Presents<f32>),
        shape: Shape,
        causal: bool,
        parts: usize,
    ) -> (Self, usize, usize) {
        let plan = Plan::new(shape, causal, parts, ROWS);
        let (units, parts) = (plan.units, plan.parts);
        (Attention { q, k, v, scale, bias, valid: valid.min(shape.len_kv), out, lse, presents, shape, causal, plan }, units, parts)
    }
}

/// How an attention splits into units of work for `parts` threads (one thread up to
/// `alone_max_flops()`, as for products): each head in enough runs of queries (blocks of `block`
/// but for the last) that every thread gets several units, so a causal head's costlier late
/// queries even out.
pub(super) struct Plan {
    pub runs: usize,
    pub rows_per_run: usize,
    pub units: usize,
    pub parts: usize,
    /// This attention among all the process runs, so that a thread keeps a head's keys across
    /// the runs of it that it takes.
    pub id: u64,
}

impl Plan {
    pub fn new(shape: Shape, causal: bool, parts: usize, block: usize) -> Plan {
        let heads = shape.batch * shape.heads;
        let flops = 4 * heads * shape.len_q * shape.len_kv * shape.dim / if causal { 2 } else { 1 };
        let parts = if flops <= alone_max_flops() { 1 } else { parts.max(1) };
        let blocks = shape.len_q.div_ceil(block).max(1);
        let runs = if parts == 1 { 1 } else { (UNITS_PER_THREAD * parts).div_ceil(heads.max(1)).clamp(1, blocks) };
        let rows_per_run = blocks.div_ceil(runs) * block;
        let runs = shape.len_q.div_ceil(rows_per_run).max(1);
        Plan { runs, rows_per_run, units: heads * runs, parts, id: ATTENTIONS.fetch_add(1, Ordering::Relaxed) }
    }

    /// Unit `unit`'s head (batch entry and query head), key/value head and queries. Within a
    /// head the runs are taken last first, so that a causal head's costliest run does not come
    /// last.
    pub fn unit(&self, shape: Shape, unit: usize) -> Unit {
        let (head, run) = (unit / self.runs, self.runs - 1 - unit % self.runs);
        let (b, h) = (head / shape.heads, head % shape.heads);
        let first = run * self.rows_per_run;
        Unit { head, b, h, kv: b * shape.kv_heads + h / (shape.heads / shape.kv_heads), queries: first..(first + self.rows_per_run).min(shape.len_q) }
    }
}

/// One unit of an attention's work: query head `head` (`h` of batch entry `b`) over key/value
/// head `kv` (counted over the batch), its queries `queries`.
pub(super) struct Unit {
    pub head: usize,
    pub b: usize,
    pub h: usize,
    pub kv: usize,
    pub queries: std::ops::Range<usize>,
}

thread_local! {
    /// Which head's keys and values (attention id, batch entry, key/value head) `panels` and
    /// `groups` hold, how many 32-key panels and 4-key groups of them are copied, the panels,
    /// the groups, a block's scaled queries and its scores.
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch { holds: (0, 0, 0), packed: 0, grouped: 0, panels: Lines::new(), groups: Lines::new(), queries: Lines::new(), scores: Lines::new() })
    };
}

struct Scratch {
    holds: (u64, usize, usize),
    packed: usize,
    grouped: usize,
    panels: Lines,
    groups: Lines,
    queries: Lines,
    scores: Lines,
}

impl Chunked for Attention {
    /// Unit `unit`: one run of one head's queries (`Plan::unit`).
    ///
    /// # Safety
    /// The pointers must cover the shapes; units write disjoint rows of `out` and `lse`.
    unsafe fn chunk(&self, unit: usize) {
        let s = self.shape;
        let unit = self.plan.unit(s, unit);
        write_presents(self.presents, [&self.k, &self.v], s, &unit);
        let Unit { head, b, h, kv, queries } = unit;
        let kv_head = kv - b * s.kv_heads;
        let (keys, values) = (self.k.strides.row(self.k.data, (b, kv_head), 0), self.v.strides.row(self.v.data, (b, kv_head), 0));
        let (ldk, ldv) = (self.k.strides.row, self.v.strides.row);
        let (first, last) = (queries.start, queries.end);
        let stride = scores_stride(s.len_kv);
        SCRATCH.with(|scratch| {
            let scratch = &mut *scratch.borrow_mut();
            if scratch.holds != (self.plan.id, b, kv) {
                scratch.holds = (self.plan.id, b, kv);
                scratch.packed = 0;
                scratch.grouped = 0;
            }
            let narrow = grouped_values(s);
            // A head's values in groups of keys (`pack_groups`), where they are read so.
            let value_groups = if narrow { scratch.groups.floats(self.valid.div_ceil(GROUP) * s.dim.div_ceil(GROUP) * 16).as_mut_ptr() } else { std::ptr::null_mut() };
            let key_panels = scratch.panels.floats(s.len_kv.div_ceil(COLUMNS) * s.dim * COLUMNS);
            let q = scratch.queries.floats(ROWS * s.dim);
            let scores = scratch.scores.floats(ROWS * stride).as_mut_ptr();
            let mut r0 = first;
            while r0 < last {
                let rows = ROWS.min(last - r0);
                let seen = visible_keys(self.causal, self.valid, r0 + rows - 1);
                let panels = seen.div_ceil(COLUMNS);
                for p in scratch.packed..panels {
                    let cols = COLUMNS.min(self.valid - p * COLUMNS);
                    let panel = &mut key_panels[p * s.dim * COLUMNS..(p + 1) * s.dim * COLUMNS];
                    pack_transposed((keys.add(p * COLUMNS * ldk), ldk), s.dim, cols, panel);
                }
                scratch.packed = scratch.packed.max(panels);
                for (i, row) in q.chunks_exact_mut(s.dim).take(rows).enumerate() {
                    let from = std::slice::from_raw_parts(self.q.strides.row(self.q.data, (b, h), r0 + i), s.dim);
                    row.iter_mut().zip(from).for_each(|(x, &y)| *x = y * self.scale);
                }
                let q = q.as_ptr();
                for p in 0..panels {
                    let cols = COLUMNS.min(seen - p * COLUMNS);
                    let tile = Tile { b: key_panels.as_ptr().add(p * s.dim * COLUMNS), ldb: COLUMNS, k: s.dim, ldx: s.dim, ldy: stride, cols };
                    tile.run(q, scores.add(p * COLUMNS), rows);
                }
                if let Some(bias) = self.bias {
                    for i in 0..rows {
                        let added = bias.row((b, h), r0 + i, s.len_kv);
                        let row = std::slice::from_raw_parts_mut(scores.add(i * stride), seen);
                        row.iter_mut().zip(std::slice::from_raw_parts(added, seen)).for_each(|(x, a)| *x += a);
                    }
                }
                let mut softmaxes = [(0f32, 0f32); ROWS];
                for (i, softmax) in softmaxes.iter_mut().enumerate().take(rows) {
                    *softmax = exponentials(scores.add(i * stride), visible_keys(self.causal, self.valid, r0 + i), seen);
                }
                logsumexps(&softmaxes[..rows], std::slice::from_raw_parts_mut(self.lse.add(head * s.len_q + r0), rows));
                let (out, ldo) = (self.out.strides.row(self.out.data, (b, h), r0), self.out.strides.row);
                if narrow {
                    #[cfg(target_arch = "x86_64")]
                    {
                        let groups = seen.div_ceil(GROUP);
                        x86::pack_groups((values, ldv), s.dim, (scratch.grouped..groups, self.valid), value_groups);
                        scratch.grouped = scratch.grouped.max(groups);
                        x86::grouped_product((scores, stride), value_groups, seen, (out, ldo), s.dim, rows);
                    }
                } else {
                    for c in (0..s.dim).step_by(COLUMNS) {
                        let tile = Tile { b: values.add(c), ldb: ldv, k: seen, ldx: stride, ldy: ldo, cols: COLUMNS.min(s.dim - c) };
                        tile.run(scores, out.add(c), rows);
                    }
                }
                for (i, &softmax) in softmaxes.iter().enumerate().take(rows) {
                    normalize(std::slice::from_raw_parts_mut(out.add(i * ldo), s.dim), softmax);
                }
                r0 += rows;
            }
        });
    }
}

/// Keys whose values one vector holds, for heads of up to 12 values (`grouped_values`).
const GROUP: usize = 4;

/// Whether the product of a block's exponentials by the values runs on groups of four keys: a
/// vector of 16 then holds four keys' values (four of each), where one key's would fill only
/// 4-12 of its lanes, and a query's four exponentials are one broadcast, so a head of 4, 8 or
/// 12 values takes a quarter, half or three quarters of the multiply-adds (tiny models' and
/// diffusers' test configurations). `[1, 8, 1024, 4]` 3.28 → 2.48 ms, `[.., 8]` 3.55 → 3.05,
/// causal 2.07 → 1.72; the tiny UNet's call 21.8-22.6 → 20.0-20.2 ms, the tiny SD3's 0.85-0.92
/// → 0.84-0.87 (in turns in one process, AMD EPYC). At 16 values the multiply-adds are as
/// many, and the copy into groups costs more than the broadcasts it saves.
fn grouped_values(shape: Shape) -> bool {
    #[cfg(target_arch = "x86_64")]
    if super::gemm::avx512() && std::arch::is_x86_feature_detected!("avx512vl") {
        return shape.dim <= 3 * GROUP && shape.len_q >= GROUPED_MIN_QUERIES;
    }
    let _ = shape;
    false
}

/// Queries from which the values' copy into groups (`x86::pack_groups`, ~24 instructions per
/// four keys, once per head) costs less than the groups save: a decode step's one query keeps
/// the values as they are.
const GROUPED_MIN_QUERIES: usize = 16;

/// The distance between a block's rows of `len` f32 scores: whole cache lines, an odd number
/// of them. Rows a multiple of 4 KiB apart (1024 keys) fall in one set of L1's eight ways, and
/// the twelve rows a tile writes and the values' product reads then evict each other: `[1, 8,
/// 1024, 8]` (a tiny UNet's heads) 3.9-4.1 → 3.5-3.7 ms, the tiny UNet's call 25.9-27.3 →
/// 23.3-25.8 ms; `[1, 8, 1024, 64]` 12.4-12.9 → 12.1-12.8 (AMD EPYC, Zen 4).
pub(super) fn scores_stride(len: usize) -> usize {
    (len.div_ceil(16) | 1) * 16
}

/// `max + ln(sum)` of each row's `(max, sum)` into `lse`, 0 where every key is hidden (`max` is
/// -inf), sixteen rows at once where AVX-512 is there (a `logf` call per row was 2 % of a tiny
/// GPT-2's execute).
pub(super) fn logsumexps(softmaxes: &[(f32, f32)], lse: &mut [f32]) {
    for (rows, out) in softmaxes.chunks(16).zip(lse.chunks_mut(16)) {
        let mut sums = [1f32; 16];
        rows.iter().zip(&mut sums).for_each(|(&(_, sum), s)| *s = sum);
        let logs = lns(sums);
        for ((&(max, _), log), o) in rows.iter().zip(logs).zip(out) {
            *o = if max == f32::NEG_INFINITY { 0.0 } else { max + log };
        }
    }
}

/// The natural log of each of `sums`: at least 1, or 0 where every key of a row is hidden (whose
/// log `logsumexps` does not use).
fn lns(sums: [f32; 16]) -> [f32; 16] {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm256_loadu_ps, _mm512_loadu_ps, __m256, __m512};
        if super::gemm::avx512() {
            // SAFETY: AVX-512 is available; the array is 16 f32s.
            return unsafe { std::mem::transmute::<__m512, [f32; 16]>(super::vector_math::ln(_mm512_loadu_ps(sums.as_ptr()))) };
        } else if super::avx2::available() {
            // SAFETY: AVX2 and FMA are available; each half is 8 f32s.
            return unsafe { std::mem::transmute::<[__m256; 2], [f32; 16]>([0, 8].map(|at| super::avx2::ln(_mm256_loadu_ps(sums.as_ptr().add(at))))) };
        }
    }
    sums.map(f32::ln)
}

/// Replaces the scores `row[..visible]` by `exp(score - max)` and `row[visible..len]` by 0;
/// returns the max (NaN where a score is) and the exponentials' sum (0 where every score is
/// -inf).
unsafe fn exponentials(row: *mut f32, visible: usize, len: usize) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if super::gemm::avx512() {
        return x86::exponentials(row, visible, len);
    } else if super::avx2::available() {
        return super::avx2::exponentials(row, visible, len);
    }
    let row = std::slice::from_raw_parts_mut(row, len);
    let max = row[..visible].iter().copied().fold(f32::NEG_INFINITY, |m, x| if x.is_nan() || m.is_nan() { f32::NAN } else { m.max(x) });
    let mut sum = 0.0;
    for x in &mut row[..visible] {
        *x = if *x == f32::NEG_INFINITY { 0.0 } else { (*x - max).exp() };
        sum += *x;
    }
    row[visible..].fill(0.0);
    (max, sum)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::vector_math::{lanes, softmax_exp};
    use super::GROUP;
    use std::arch::x86_64::*;

    /// Copies the values (`[keys, dim]`, rows `ldv` apart, `dim` ≤ 16) of key groups `groups` into `out` as
    /// vectors, `dim.div_ceil(4)` a group: lane `4i + j` of the group's vector `c` is key `4g +
    /// j`'s value `4c + i`, zero past `valid` keys (a padded graph's, which may hold anything)
    /// and past `dim`. Four keys' rows are transposed within each 128-bit lane, then by lanes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_groups((values, ldv): (*const f32, usize), dim: usize, (groups, valid): (std::ops::Range<usize>, usize), out: *mut f32) {
        let quads = dim.div_ceil(GROUP);
        let row = |key: usize| if key < valid { _mm512_maskz_loadu_ps(lanes(dim, 0), values.add(key * ldv)) } else { _mm512_setzero_ps() };
        let pairs = |a: __m512, b: __m512, high: bool| {
            let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
            _mm512_castpd_ps(if high { _mm512_unpackhi_pd(a, b) } else { _mm512_unpacklo_pd(a, b) })
        };
        for g in groups {
            let [r0, r1, r2, r3] = [0, 1, 2, 3].map(|j| row(GROUP * g + j));
            let (low01, high01) = (_mm512_unpacklo_ps(r0, r1), _mm512_unpackhi_ps(r0, r1));
            let (low23, high23) = (_mm512_unpacklo_ps(r2, r3), _mm512_unpackhi_ps(r2, r3));
            // Lane c of `t[i]`: the four keys' value 4c + i.
            let t = [pairs(low01, low23, false), pairs(low01, low23, true), pairs(high01, high23, false), pairs(high01, high23, true)];
            let u = [
                _mm512_shuffle_f32x4::<0x44>(t[0], t[1]),
                _mm512_shuffle_f32x4::<0xee>(t[0], t[1]),
                _mm512_shuffle_f32x4::<0x44>(t[2], t[3]),
                _mm512_shuffle_f32x4::<0xee>(t[2], t[3]),
            ];
            let groups = [
                _mm512_shuffle_f32x4::<0x88>(u[0], u[2]),
                _mm512_shuffle_f32x4::<0xdd>(u[0], u[2]),
                _mm512_shuffle_f32x4::<0x88>(u[1], u[3]),
                _mm512_shuffle_f32x4::<0xdd>(u[1], u[3]),
            ];
            for (c, v) in groups.iter().enumerate().take(quads) {
                _mm512_storeu_ps(out.add((g * quads + c) * 16), *v);
            }
        }
    }

    /// `rows` ≤ 12 queries' exponentials (`scores`, rows `ldx` apart, `keys` of them, zero past
    /// each query's visible keys) times the values packed by `pack_groups`, into `out` (`dim` ≤
    /// 12 values a row, rows `ldy` apart): per query and value, four sums of every fourth key,
    /// added at the end.
    pub(super) unsafe fn grouped_product((scores, ldx): (*const f32, usize), groups: *const f32, keys: usize, (out, ldy): (*mut f32, usize), dim: usize, rows: usize) {
        let quads = dim.div_ceil(GROUP);
        // Rows per pass: 24 of AVX-512's 32 registers for sums.
        let per_pass = [12, 12, 8][quads - 1];
        let mut r = 0;
        while r < rows {
            let (x, y, m) = (scores.add(r * ldx), out.add(r * ldy), per_pass.min(rows - r));
            macro_rules! pass {
                ($q:literal: $($m:literal)*) => {
                    match m {
                        $($m => products::<$m, $q>((x, ldx), groups, keys, (y, ldy), dim),)*
                        _ => unreachable!(),
                    }
                };
            }
            match quads {
                1 => pass!(1: 1 2 3 4 5 6 7 8 9 10 11 12),
                2 => pass!(2: 1 2 3 4 5 6 7 8 9 10 11 12),
                _ => pass!(3: 1 2 3 4 5 6 7 8),
            }
            r += m;
        }
    }

    #[target_feature(enable = "avx512f,avx512vl,fma")]
    unsafe fn products<const M: usize, const Q: usize>((x, ldx): (*const f32, usize), groups: *const f32, keys: usize, (y, ldy): (*mut f32, usize), dim: usize) {
        let mut sums = [[_mm512_setzero_ps(); Q]; M];
        macro_rules! group {
            ($g:expr, $load:expr) => {
                let values: [__m512; Q] = std::array::from_fn(|c| _mm512_loadu_ps(groups.add(($g * Q + c) * 16)));
                for (r, row) in sums.iter_mut().enumerate() {
                    let e = _mm512_broadcast_f32x4($load(x.add(r * ldx + GROUP * $g)));
                    for (sum, v) in row.iter_mut().zip(values) {
                        *sum = _mm512_fmadd_ps(e, v, *sum);
                    }
                }
            };
        }
        let full = keys / GROUP;
        for g in 0..full {
            group!(g, _mm_loadu_ps);
        }
        if keys > GROUP * full {
            // The keys past `keys` may hold an earlier block's scores.
            let mask = lanes(keys, GROUP * full) as __mmask8;
            group!(full, |p| _mm_maskz_loadu_ps(mask, p));
        }
        for (r, row) in sums.iter().enumerate() {
            for (c, &sum) in row.iter().enumerate() {
                // Each lane 4i the sum of lanes 4i..4i + 4, those four lanes then packed first.
                let pairs = _mm512_add_ps(sum, _mm512_permute_ps::<0b10_11_00_01>(sum));
                let quads = _mm512_add_ps(pairs, _mm512_permute_ps::<0b01_00_11_10>(pairs));
                let values = _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, quads));
                // Unmasked where whole (as `Tile::run`'s): `normalize` reads the row next.
                let at = y.add(r * ldy + GROUP * c);
                if dim >= GROUP * (c + 1) {
                    _mm_storeu_ps(at, values);
                } else {
                    let values = std::mem::transmute::<__m128, [f32; GROUP]>(values);
                    std::ptr::copy_nonoverlapping(values.as_ptr(), at, dim - GROUP * c);
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn exponentials(row: *mut f32, visible: usize, len: usize) -> (f32, f32) {
        // Whole vectors unmasked, the last part masked (see `Tile::run`): `[1, 8, 1024, 8]`
        // 2.95-3.02 → 2.69-2.74 ms, `[1, 8, 1024, 64]` 12.27 → 12.01 (in turns, one process).
        let whole = visible - visible % 16;
        let tail = lanes(visible, whole);
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut nan: __mmask16 = 0;
        macro_rules! scan {
            ($x:expr, $mask:expr) => {
                let x = $x;
                max = _mm512_mask_max_ps(max, $mask, x, max);
                nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            };
        }
        for at in (0..whole).step_by(16) {
            scan!(_mm512_loadu_ps(row.add(at)), !0);
        }
        if tail != 0 {
            scan!(_mm512_maskz_loadu_ps(tail, row.add(whole)), tail);
        }
        // A NaN score makes its row NaN, as in eager (`max` drops NaN).
        let max = if nan != 0 { f32::NAN } else { _mm512_reduce_max_ps(max) };
        let shift = _mm512_set1_ps(max);
        let mut sum = _mm512_setzero_ps();
        for at in (0..whole).step_by(16) {
            let e = softmax_exp(_mm512_sub_ps(_mm512_loadu_ps(row.add(at)), shift));
            _mm512_storeu_ps(row.add(at), e);
            sum = _mm512_add_ps(sum, e);
        }
        if tail != 0 {
            let e = softmax_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row.add(whole)), shift));
            _mm512_mask_storeu_ps(row.add(whole), tail, e);
            sum = _mm512_mask_add_ps(sum, tail, sum, e);
        }
        std::ptr::write_bytes(row.add(visible), 0, len - visible);
        (max, _mm512_reduce_add_ps(sum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache grown by new rows: each key/value head's cache rows (packed, `before` a head)
    /// then its new ones (here placed as `[B, L, Hkv, E]`), packed `before + rows` a head, and
    /// nothing written past them; the grown rows are where `grown` says.
    #[test]
    fn appended_rows_grow_each_head_packed() {
        let (batch, kv_heads, before, rows, dim) = (2, 3, 5, 2, 4);
        let heads = batch * kv_heads;
        let value = |which: usize, head: usize, r: usize, e: usize| (1000 * which + 100 * head + 10 * r + e) as f32;
        let past: [Vec<f32>; 2] = [0, 1].map(|w| (0..heads * before * dim).map(|i| value(w, i / (before * dim), i / dim % before, i % dim)).collect());
        let interleaved = Strides::interleaved(kv_heads, rows, dim);
        let new: [Vec<f32>; 2] = [0, 1].map(|w| {
            let mut laid = vec![f32::NAN; heads * rows * dim];
            for head in 0..heads {
                for r in 0..rows {
                    let at = interleaved.offset + head / kv_heads * interleaved.batch + head % kv_heads * interleaved.head + r * interleaved.row;
                    (0..dim).for_each(|e| laid[at + e] = value(w, head, before + r, e));
                }
            }
            laid
        });
        let mut to = [vec![-1.0; heads * (before + rows + 3) * dim], vec![-1.0; heads * (before + rows + 3) * dim]];
        let [to_k, to_v] = &mut to;
        let grow = Appended {
            past: [past[0].as_ptr(), past[1].as_ptr()],
            new: [0, 1].map(|w| Placed { data: new[w].as_ptr() as *mut f32, strides: interleaved }),
            to: [to_k.as_mut_ptr(), to_v.as_mut_ptr()],
            kv_heads,
            before,
            rows,
            dim,
        };
        (0..2 * heads).for_each(|unit| unsafe { grow.chunk(unit) });
        let grown = grow.grown();
        for (w, written) in to.iter().enumerate() {
            let exact = heads * (before + rows) * dim;
            let want: Vec<f32> = (0..exact).map(|i| value(w, i / ((before + rows) * dim), i / dim % (before + rows), i % dim)).collect();
            assert_eq!(written[..exact], want[..], "packed, {} rows a head", before + rows);
            assert!(written[exact..].iter().all(|&x| x == -1.0), "nothing past the grown rows");
            let row = unsafe { grown[w].strides.row(grown[w].data, (1, 2), before + 1) };
            assert_eq!(unsafe { *row }, value(w, kv_heads + 2, before + 1, 0));
        }
    }

    /// Every shape class (grouped heads, causal with more keys than queries and fewer, query
    /// and key counts off the blocks, head sizes off the vectors, heads of 4-12 values in groups
    /// of keys), with and without a mask's bias (per batch entry, shared by the heads; about a
    /// third of the keys hidden, and all of them from query 1 of the first entry) and the last
    /// keys past a padded graph's count, against f64 on the same inputs; each with its operands
    /// packed, and placed as a fused projection leaves them (`[B, S, 3, H, E]`, the query, key or
    /// value the middle third) with the output written as `[B, L, H, E]` and the keys and values
    /// copied out (a cache's update).
    #[test]
    fn agrees_with_f64() {
        let mut uniform = super::super::uniform(11);
        let mut next = || 2.0 * uniform();
        let shapes = [(1, 4, 2, 128, 128, 16), (2, 3, 3, 13, 45, 8), (1, 2, 1, 50, 20, 40), (1, 1, 1, 1, 70, 72), (2, 2, 2, 37, 37, 33), (1, 2, 1, 19, 23, 12), (2, 8, 8, 30, 66, 4), (1, 3, 3, 40, 45, 8)];
        for (batch, heads, kv_heads, len_q, len_kv, dim) in shapes {
            let shape = Shape { batch, heads, kv_heads, len_q, len_kv, dim };
            let scale = 0.75f32;
            let q: Vec<f32> = (0..batch * heads * len_q * dim).map(|_| next()).collect();
            let k: Vec<f32> = (0..batch * kv_heads * len_kv * dim).map(|_| next()).collect();
            let v: Vec<f32> = (0..batch * kv_heads * len_kv * dim).map(|_| next()).collect();
            let mask: Vec<f32> = (0..batch * len_q * len_kv)
                .map(|at| if next() < -0.33 || (len_q > 1 && at / len_kv == 1) { f32::NEG_INFINITY } else { next() })
                .collect();
            for in_place in [false, true] {
                let (laid, strides) = test_operands(in_place, shape, [&q, &k, &v], f32::NAN);
                let out_strides = strides[3];
                for (causal, masked) in [(false, false), (true, false), (false, true), (true, true)] {
                    let bias = masked.then(|| Bias { data: mask.as_ptr(), batch_stride: len_q * len_kv, head_stride: 0 });
                    // With the mask, the last 3 keys are a padded graph's too.
                    let valid = if masked { len_kv.saturating_sub(3).max(1) } else { len_kv };
                    let mut out = vec![f32::NAN; q.len()];
                    let mut lse = vec![f32::NAN; batch * heads * len_q];
                    let mut presents = [vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]];
                    for parts in [1, 3] {
                        let at = |i: usize| Placed { data: laid[i].as_ptr().cast_mut(), strides: strides[i] };
                        let operands = (at(0), at(1), at(2), scale);
                        let written = presents.each_mut().map(|p| in_place.then_some(p.as_mut_ptr()));
                        let results = (Placed { data: out.as_mut_ptr(), strides: out_strides }, lse.as_mut_ptr(), written);
                        let (attention, units, _) = Attention::new(operands, (bias, valid), results, shape, causal, parts);
                        (0..units).for_each(|u| unsafe { attention.chunk(u) });
                        if in_place {
                            assert!(presents[0] == k && presents[1] == v, "{shape:?}: the presents are the keys and values");
                        }
                        let case = format!("{shape:?} causal {causal} masked {masked} in place {in_place} parts {parts}");
                        let (q, k, v) = (|at: usize| f64::from(q[at] * scale), |at: usize| f64::from(k[at]), |at: usize| f64::from(v[at]));
                        let got = |at: usize| f64::from(out[at]);
                        let close = |got: f64, want: f64| (got - want).abs() < 5e-5;
                        check_against_f64(shape, (causal, masked.then_some(&mask[..]), valid), [&q, &k, &v], (&got, out_strides, &lse), &close, &case);
                    }
                }
            }
        }
    }
}
