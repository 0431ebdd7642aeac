//! An f32 product `y = x @ w` or `x @ w.T` split over the host's cores: XLA:CPU's YNNPACK runs
//! products below ~16 MFLOP (every projection of a small model) on one core at its peak, so the
//! second core idles through most of such a model's call.
//!
//! The work is cut into tiles of 32 output columns by a group of rows; a tile reads its 32
//! columns of `w` as one `[K, 32]` panel (copied out first where `w` is stored `[N, K]`) and
//! keeps 12 rows × 32 columns of sums in registers, adding one rank-1 update per step of K.
//! A weight in memory declared unchanging (`unchanging`) is packed into panels once. Where the
//! CPU has AMX, the products run on its tiles instead (`amx`), at the same accuracy.

use super::amx::{self, Values};
use super::epilogue::Epilogue;
use super::pool::{Chunked, UNITS_PER_THREAD};
use super::unchanging::{self, Packed};
use super::{Layout, Out};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Output columns per tile: two 16-lane vectors.
pub(super) const COLUMNS: usize = 32;
/// Rows of sums kept in registers: 12 × 2 accumulators, two panel vectors and one broadcast
/// value take 27 of AVX-512's 32 registers.
pub(super) const ROWS: usize = 12;

/// One product: `x` `[m, k]`, `w` `[n, k]` (`RowPerOutput`) or `[k, n]` (`RowPerInput`), `y`
/// `[m, n]`, all row-major: f32 throughout, or bf16 `x` and `w` (on AMX tiles only) into an
/// f32 or bf16 `y`.
pub(super) struct Gemm {
    x: *const u8,
    w: *const u8,
    y: Out,
    values: Values,
    m: usize,
    n: usize,
    k: usize,
    layout: Layout,
    /// Rows per unit of work (a multiple of `ROWS` but for the last), and column blocks per unit
    /// (all of them, or a share of a weight the threads read a share each).
    rows_per_chunk: usize,
    blocks_per_chunk: usize,
    /// This product among all the process runs, so that a thread taking both units copies
    /// each panel once.
    id: u64,
    kept: Kept,
    /// Applied to each unit's rows once they are computed (while in cache).
    epilogue: Option<Epilogue>,
}

/// A weight kept packed: as f32 panels, `[N / 32, K, 32]`, or as AMX tiles of its bf16 pieces
/// (`amx::pack`; then the product runs on the tiles, where `x`'s rows are finite).
enum Kept {
    Nothing,
    Panels(Arc<[Line]>),
    Pieces(Arc<[Line]>),
}

static PRODUCTS: AtomicU64 = AtomicU64::new(1);

/// Products up to this many flops run on the calling thread alone: waking a worker costs about
/// what it saves on them (a tiny Llama's `[128, 64] x [64, 128]` projections, 2.1 MFLOP, split:
/// bare executes 0.97-1.04 ms against 0.88-0.92 alone; GPT-2's 3.1 MFLOP `[128, 64] x [64,
/// 192]` gains from the split).
const ALONE_MAX_FLOPS: usize = 1 << 21;
/// The same on AVX2, whose products take twice AVX-512's instructions, so that a worker pays
/// from 2^18 flops on (attention's too): bare executes in turns on an AMD EPYC Zen 3, products
/// split from 2^21 against 2^18, the tiny Llama at batch 1 0.561 → 0.492 ms, GPT-2 0.661 →
/// 0.629, Flux 0.937 → 0.817, SD3 0.793 → 0.687 (splitting all of them: as 2^18); its
/// attention too, the Llama 0.515 → 0.442, GPT-2 0.672 → 0.576.
const AVX2_ALONE_MAX_FLOPS: usize = 1 << 18;

/// `ALONE_MAX_FLOPS` for this CPU.
pub(super) fn alone_max_flops() -> usize {
    if avx512() {
        ALONE_MAX_FLOPS
    } else {
        AVX2_ALONE_MAX_FLOPS
    }
}

/// On AMX tiles, products of fewer rows than this stay alone up to 16 MFLOP: split by rows, each
/// thread would read all of a wide weight's pieces for a few rows. A tiny Llama's LM head, `[128,
/// 64] x [64, 1000]`, alone: calls 0.40-0.41 ms, split 0.47-0.50 (Inductor's 0.47-0.52); at
/// batch 8, its `[1024, 64] x [64, 128]` products alone 2.73-2.85, split 2.30-2.40.
const TILES_SPLIT_MIN_ROWS: usize = 256;
const TILES_FEW_ROWS_ALONE_MAX_FLOPS: usize = 1 << 24;

/// A product of at most this many rows (a decode step's, of up to eight prompts: by rows it
/// would be one unit of `ROWS`) from kept f32 panels of at least `SPLIT_COLUMNS_MIN_BYTES` splits by
/// columns between the threads, each reading its share of the weight once: bound by reading the
/// weight, one thread left the other core's bandwidth unused. SmolLM-135M's f32 decode step
/// (bare executes in turns, AMD EPYC): 20.0-21.4 ms on one thread, 15.2-20.5 split.
const SPLIT_COLUMNS_MAX_ROWS: usize = 8;
const SPLIT_COLUMNS_MIN_BYTES: usize = 1 << 20;

/// Whether a product runs on AMX tiles here, given its weight kept as their pieces: splitting `x`
/// into pieces costs about what the tiles save on one block of 32 columns (`[256, 32] x [32,
/// 128]`: 12.0 µs against 11.9, `[264, 160] x [160, 32]` 11.1 against 8.8), and a K of 16 fills
/// half a tile; from two blocks on the tiles gain (`[128, 64] x [64, 64]` 4.9 against 6.2, `[256,
/// 32] x [32, 128]` 11.2 against 13.6). A weight packed on every call (an input read as it is)
/// stays on the vector kernel, whose packing is a copy.
fn tiles_suit(n: usize, k: usize) -> bool {
    amx::available() && n > COLUMNS && k > 16
}

impl Gemm {
    /// The product and how many units of work it splits into for `parts` threads: runs of whole
    /// rows (one up to `ALONE_MAX_FLOPS`), or for a wide weight on the tiles (below) blocks of
    /// columns. Where the weight is packed once (kept, or a bf16 one's pieces) each thread gets
    /// `UNITS_PER_THREAD`, taken as threads come free: with one each, XLA's worker started 5-20
    /// µs after the caller, which then waited 5-35 µs for the worker's rows (AMD EPYC Zen 3,
    /// whose two vCPUs differ in speed by up to a fifth). Bare executes in turns: tiny Llama at
    /// batch 8 3.58 → 3.24 ms, GPT-2 4.73 → 4.14, both 0.45-0.57 at batch 1 either way. (Before
    /// the bias and activation ran inside the product's units, four parts for two threads had
    /// lost to two: a later XLA loop read lines another core had written.)
    ///
    /// A bf16 product runs on the tiles from its weight's pieces, kept or else packed for this
    /// call (bf16 values are their own pieces), so `amx::bf16_products()` must hold for one.
    pub fn new(
        (x, w, y): (*const u8, *const u8, Out),
        values: Values,
        (m, n, k): (usize, usize, usize),
        (layout, taps): (Layout, usize),
        parts: usize,
        epilogue: Option<Epilogue>,
    ) -> (Self, usize) {
        let key = |pieces| (w as usize, n, k, layout == Layout::RowPerOutput, taps, pieces);
        let floats = n.div_ceil(COLUMNS) * k * COLUMNS;
        let read = n * k * values.bytes();
        // SAFETY: `w` covers `[n, k]` (the caller's contract) for the packing to read.
        let panels = || unchanging::panels(key(Packed::Panels), (read, floats), || unsafe { pack_all(w as *const f32, (n, k), layout, floats) });
        let pieces = || unsafe {
            let reordered = (taps > 1).then(|| tap_major(w as *const u16, (n, k), taps));
            amx::pack(reordered.as_ref().map_or(w, |r| r.as_ptr() as *const u8), (n, k), layout, values)
        };
        let pieces = || pieces().unwrap_or_default();
        let kept_pieces = || unchanging::panels(key(Packed::Pieces(values)), (read, amx::packed_lines(n, k, values) * 16), pieces);
        let kept = if floats == 0 {
            None
        } else if values == Values::Bf16 {
            Some(Kept::Pieces(kept_pieces().unwrap_or_else(|| pieces().into())))
        } else if tiles_suit(n, k) {
            // An empty result: the weight is not all finite.
            match kept_pieces() {
                Some(pieces) if pieces.is_empty() => panels().map(Kept::Panels),
                pieces => pieces.map(Kept::Pieces),
            }
        } else {
            panels().map(Kept::Panels)
        };
        let kept = kept.unwrap_or(Kept::Nothing);
        let tiles = matches!(kept, Kept::Pieces(_));
        let flops = 2 * m * n * k;
        let few_rows_on_tiles = tiles && m < TILES_SPLIT_MIN_ROWS && flops <= TILES_FEW_ROWS_ALONE_MAX_FLOPS;
        let few_rows_wide = matches!(kept, Kept::Panels(_)) && m <= SPLIT_COLUMNS_MAX_ROWS && read >= SPLIT_COLUMNS_MIN_BYTES;
        let parts = if (flops <= alone_max_flops() && !few_rows_wide) || few_rows_on_tiles { 1 } else { parts };
        let unit = if tiles { amx::rows_unit() } else { ROWS };
        let blocks = n.div_ceil(COLUMNS).max(1);
        // Split by columns where the weight's pieces are past L2's share and all the rows' within
        // it, or a few rows read wide panels (`SPLIT_COLUMNS_MAX_ROWS`): each thread then reads
        // its share of the weight once, where by rows each would read all of it (GPT-2 small's
        // LM head, `[128, 768] x [768, 50257]`: 36 ms → 24-27), or one thread all of it.
        let rows_fit_l2 = 2 * values.pieces() * m * k <= amx::L2_SHARE_BYTES;
        let by_columns = few_rows_wide || matches!(&kept, Kept::Pieces(pieces) if n > m && size_of_val(&**pieces) > amx::L2_SHARE_BYTES && rows_fit_l2);
        // A weight not packed once is packed by each unit a thread takes (`PANEL`).
        let per_thread = if parts > 1 && !matches!(kept, Kept::Nothing) { UNITS_PER_THREAD } else { 1 };
        let wanted = parts.max(1) * per_thread;
        let (rows_per_chunk, blocks_per_chunk) =
            if by_columns { (m.max(1), blocks.div_ceil(wanted)) } else { (m.div_ceil(unit).div_ceil(wanted) * unit, blocks) };
        let id = PRODUCTS.fetch_add(1, Ordering::Relaxed);
        let units = m.div_ceil(rows_per_chunk) * blocks.div_ceil(blocks_per_chunk);
        (Gemm { x, w, y, values, m, n, k, layout, rows_per_chunk, blocks_per_chunk, id, kept, epilogue }, units)
    }

    /// Rows `first_row..first_row + rows` of column block `block`, whose panel is `panel`.
    unsafe fn block(&self, panel: *const f32, block: usize, first_row: usize, rows: usize) {
        let first_col = block * COLUMNS;
        let tile = Tile { b: panel, ldb: COLUMNS, k: self.k, ldx: self.k, ldy: self.n, cols: COLUMNS.min(self.n - first_col) };
        tile.run_rows((self.x as *const f32).add(first_row * self.k), self.y_f32().add(first_row * self.n + first_col), rows);
    }
}

/// Column block `block` of `w` packed into `panel` (`[k, 32]`).
unsafe fn pack_block(w: *const f32, (n, k): (usize, usize), layout: Layout, block: usize, panel: &mut [f32]) {
    let first_col = block * COLUMNS;
    let cols = COLUMNS.min(n - first_col);
    match layout {
        Layout::RowPerOutput => pack_transposed((w.add(first_col * k), k), k, cols, panel),
        Layout::RowPerInput => pack(w.add(first_col), n, k, cols, panel),
    }
}

/// Sixteen f32s on a cache line of their own: a panel row's two vectors then load one line
/// each, not two.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct Line(pub(super) [f32; 16]);

/// f32 scratch that starts on a cache line (a `Vec<f32>` starts on 16 bytes).
pub(super) struct Lines(pub(super) Vec<Line>);

impl Lines {
    pub const fn new() -> Lines {
        Lines(Vec::new())
    }

    /// The first `len` floats, grown (with zeros) to hold them.
    pub fn floats(&mut self, len: usize) -> &mut [f32] {
        let lines = len.div_ceil(16);
        if self.0.len() < lines {
            self.0.resize(lines, Line([0.0; 16]));
        }
        // SAFETY: `Line` is 16 f32s and nothing else; at least `len` of them are initialized.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr() as *mut f32, len) }
    }

    /// The first `len` halves of f32s (bf16 bits), grown (with zeros) to hold them.
    pub fn u16s(&mut self, len: usize) -> &mut [u16] {
        let floats = self.floats(len.div_ceil(2));
        // SAFETY: the memory of `len.div_ceil(2)` f32s, all initialized; a u16 needs less alignment.
        unsafe { std::slice::from_raw_parts_mut(floats.as_mut_ptr() as *mut u16, len) }
    }
}

/// Every column block of `w` packed, `[n / 32, k, 32]` (`floats` of them).
unsafe fn pack_all(w: *const f32, (n, k): (usize, usize), layout: Layout, floats: usize) -> Vec<Line> {
    let mut panels = Lines::new();
    for (block, panel) in panels.floats(floats).chunks_exact_mut(k * COLUMNS).enumerate() {
        pack_block(w, (n, k), layout, block, panel);
    }
    panels.0
}

impl Chunked for Gemm {
    /// Unit `chunk`: a run of rows by a run of column blocks.
    ///
    /// # Safety
    /// The pointers must cover the shapes; units write disjoint parts of `y`.
    unsafe fn chunk(&self, chunk: usize) {
        let column_runs = self.n.div_ceil(COLUMNS).div_ceil(self.blocks_per_chunk).max(1);
        let first_row = chunk / column_runs * self.rows_per_chunk;
        let first_block = chunk % column_runs * self.blocks_per_chunk;
        let rows = self.rows_per_chunk.min(self.m - first_row);
        let blocks = first_block..(first_block + self.blocks_per_chunk).min(self.n.div_ceil(COLUMNS));
        self.products(first_row, rows, blocks.clone());
        // A bf16 product's bias and GELU were applied on the tiles' way out (`amx::rows`).
        if let (Some(epilogue), Values::F32) = (&self.epilogue, self.values) {
            epilogue.apply(self.y_f32(), self.n, first_row..first_row + rows, blocks.start * COLUMNS..(blocks.end * COLUMNS).min(self.n));
        }
    }
}

impl Gemm {
    /// The f32 result, which every product but a bf16 one has (that runs on the tiles alone).
    fn y_f32(&self) -> *mut f32 {
        match self.y {
            Out::F32(y) => y,
            Out::Bf16(_) => unreachable!("a bf16 product runs on the tiles"),
        }
    }

    /// Rows `first_row..first_row + rows` of the product, in column blocks `blocks`.
    unsafe fn products(&self, first_row: usize, rows: usize, blocks: std::ops::Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        if let Kept::Pieces(pieces) = &self.kept {
            let finish = match (&self.epilogue, self.values) {
                (Some(epilogue), Values::Bf16) => *epilogue,
                _ => Epilogue::NONE,
            };
            if amx::rows((self.x, self.y, finish), self.values, (self.n, self.k), pieces, first_row, rows, blocks.clone()) {
                return;
            }
        }
        if let Kept::Panels(panels) = &self.kept {
            for block in blocks {
                self.block((panels.as_ptr() as *const f32).add(block * self.k * COLUMNS), block, first_row, rows);
            }
            return;
        }
        PANEL.with(|panel| {
            let (holds, panel) = &mut *panel.borrow_mut();
            for block in blocks {
                if *holds != (self.id, block) {
                    pack_block(self.w as *const f32, (self.n, self.k), self.layout, block, panel.floats(self.k * COLUMNS));
                    *holds = (self.id, block);
                }
                self.block(panel.floats(self.k * COLUMNS).as_ptr(), block, first_row, rows);
            }
        });
    }
}

/// Copies `cols` ≤ 32 columns of `w` (`k` rows `n` apart) into `panel` as `[k, 32]`: read in
/// place, a wide weight's rows lie a multiple of 4 KiB apart and evict each other from L1
/// (Winograd's `[128, 128] x [128, 1024]` products ran 20 % slower than XLA's).
unsafe fn pack(w: *const f32, n: usize, k: usize, cols: usize, panel: &mut [f32]) {
    for kk in 0..k {
        std::ptr::copy_nonoverlapping(w.add(kk * n), panel.as_mut_ptr().add(kk * COLUMNS), cols);
    }
}

/// Copies `cols` ≤ 32 rows of `w` (each `k` long, rows `ldw` apart) into `panel` as `[k, 32]`,
/// the columns past `cols` left as they are.
pub(super) unsafe fn pack_transposed((w, ldw): (*const f32, usize), k: usize, cols: usize, panel: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        return x86::pack_transposed((w, ldw), k, cols, panel);
    } else if super::avx2::available() {
        return super::avx2::pack_transposed((w, ldw), k, cols, panel);
    }
    for j in 0..cols {
        for kk in 0..k {
            panel[kk * COLUMNS + j] = *w.add(j * ldw + kk);
        }
    }
}

thread_local! {
    /// A column block of a `[N, K]` weight, copied as `[K, 32]`, and which product's block it is.
    static PANEL: RefCell<((u64, usize), Lines)> = const { RefCell::new(((0, 0), Lines::new())) };
}

/// A panel `b` (`[k, ldb]`, its first `cols` ≤ 32 columns used) against rows of `x`.
pub(super) struct Tile {
    pub b: *const f32,
    pub ldb: usize,
    pub k: usize,
    pub ldx: usize,
    pub ldy: usize,
    pub cols: usize,
}

impl Tile {
    /// All `rows` rows of `x` from `x` times the panel, into `y`.
    pub unsafe fn run_rows(&self, x: *const f32, y: *mut f32, rows: usize) {
        #[cfg(target_arch = "x86_64")]
        if !avx512() && super::avx2::available() {
            return super::avx2::tiles(self, x, y, rows);
        }
        let mut r = 0;
        while r < rows {
            r += self.run(x.add(r * self.ldx), y.add(r * self.ldy), rows - r);
        }
    }

    /// Up to `ROWS` of the `rows` rows of `x` from `x` times the panel, into `y`; returns how
    /// many it did.
    pub unsafe fn run(&self, x: *const f32, y: *mut f32, rows: usize) -> usize {
        let done = rows.min(ROWS);
        #[cfg(target_arch = "x86_64")]
        if avx512() {
            // One vector of columns where the second would hold none (attention's values of
            // heads up to 16 wide): half the multiply-adds.
            let wide = self.cols > 16;
            // Whole vectors of columns (every block but a last narrow one) loaded and stored
            // unmasked: on an AMD Zen 4 a masked load costs a few percent of a tile's
            // multiply-adds, and a load of what a masked store has just written is not forwarded
            // from it (a vector stored and one of its floats read back: 7.4 ns, unmasked 2.4),
            // where the exponentials and a bias's pass read the tile's results right after.
            let whole = self.cols == 32 || self.cols == 16;
            macro_rules! rows {
                ($($n:literal)*) => {
                    match (done, wide, whole) {
                        $(
                            ($n, true, false) => x86::tile::<$n, true, false>(self, x, y),
                            ($n, false, false) => x86::tile::<$n, false, false>(self, x, y),
                            ($n, true, true) => x86::tile::<$n, true, true>(self, x, y),
                            ($n, false, true) => x86::tile::<$n, false, true>(self, x, y),
                        )*
                        _ => unreachable!(),
                    }
                };
            }
            rows!(1 2 3 4 5 6 7 8 9 10 11 12);
            return done;
        }
        #[cfg(target_arch = "x86_64")]
        if super::avx2::available() {
            super::avx2::tile(self, x, y, done);
            return done;
        }
        for r in 0..done {
            for j in 0..self.cols {
                let mut sum = 0f32;
                for kk in 0..self.k {
                    sum = (*x.add(r * self.ldx + kk)).mul_add(*self.b.add(kk * self.ldb + j), sum);
                }
                *y.add(r * self.ldy + j) = sum;
            }
        }
        done
    }
}

/// Whether this CPU runs the vector tile (the kernel is registered only where it does): on
/// AVX-512, or on AVX2 with FMA (`avx2`).
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512() || super::avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU has AVX-512, which the tile's widest form and the kernels written for it
/// alone need.
pub(super) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::vector_math::transpose;
    use super::{Tile, COLUMNS};
    use std::arch::x86_64::*;

    /// `pack_transposed` in 16 × 16 blocks transposed in registers: a scalar copy took as long
    /// as the products of a 64-wide weight.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_transposed((w, ldw): (*const f32, usize), k: usize, cols: usize, panel: &mut [f32]) {
        let mut k0 = 0;
        while k0 < k {
            let width = (k - k0).min(16);
            let k_mask = ((1u32 << width) - 1) as __mmask16;
            for half in 0..cols.div_ceil(16) {
                let rows = (cols - 16 * half).min(16);
                let mut r = [_mm512_setzero_ps(); 16];
                for (j, row) in r.iter_mut().enumerate().take(rows) {
                    *row = _mm512_maskz_loadu_ps(k_mask, w.add((16 * half + j) * ldw + k0));
                }
                let r = transpose(r);
                for (i, row) in r.iter().enumerate().take(width) {
                    _mm512_storeu_ps(panel.as_mut_ptr().add((k0 + i) * COLUMNS + 16 * half), *row);
                }
            }
            k0 += 16;
        }
    }

    /// `M` rows times the panel's `cols` columns, the columns past `cols` masked off (none
    /// when `WHOLE`: 16 or 32 of them); the second 16 only when `WIDE`.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn tile<const M: usize, const WIDE: bool, const WHOLE: bool>(t: &Tile, x: *const f32, y: *mut f32) {
        let mask = |from: usize| -> __mmask16 {
            let n = t.cols.saturating_sub(from).min(16);
            ((1u32 << n) - 1) as __mmask16
        };
        let (m0, m1) = (mask(0), mask(16));
        let mut lo = [_mm512_setzero_ps(); M];
        let mut hi = [_mm512_setzero_ps(); M];
        for kk in 0..t.k {
            let b = t.b.add(kk * t.ldb);
            let (b0, b1) = if WHOLE {
                (_mm512_loadu_ps(b), if WIDE { _mm512_loadu_ps(b.add(16)) } else { _mm512_setzero_ps() })
            } else {
                (_mm512_maskz_loadu_ps(m0, b), _mm512_maskz_loadu_ps(m1, b.add(16)))
            };
            for r in 0..M {
                let a = _mm512_set1_ps(*x.add(r * t.ldx + kk));
                lo[r] = _mm512_fmadd_ps(a, b0, lo[r]);
                if WIDE {
                    hi[r] = _mm512_fmadd_ps(a, b1, hi[r]);
                }
            }
        }
        for r in 0..M {
            let out = y.add(r * t.ldy);
            if WHOLE {
                _mm512_storeu_ps(out, lo[r]);
                if WIDE {
                    _mm512_storeu_ps(out.add(16), hi[r]);
                }
            } else {
                _mm512_mask_storeu_ps(out, m0, lo[r]);
                if WIDE {
                    _mm512_mask_storeu_ps(out.add(16), m1, hi[r]);
                }
            }
        }
    }
}

/// A bf16 convolution's weight `[n, C, T]` (OIHW: the T kernel offsets of each channel) as `[n,
/// T, C]`, the order of its windows' values (each offset's channels together, read off an input
/// with its channels last): `k = C·T`.
///
/// # Safety
/// `w` must cover `[n, k]` bf16 values.
unsafe fn tap_major(w: *const u16, (n, k): (usize, usize), taps: usize) -> Vec<u16> {
    let channels = k / taps;
    let w = std::slice::from_raw_parts(w, n * k);
    let mut reordered = vec![0; n * k];
    for (row, into) in w.chunks_exact(k).zip(reordered.chunks_exact_mut(k)) {
        for (c, offsets) in row.chunks_exact(taps).enumerate() {
            for (t, &v) in offsets.iter().enumerate() {
                into[t * channels + c] = v;
            }
        }
    }
    reordered
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape class (column and row tails, both layouts, one row) against a sum in f64.
    #[test]
    fn agrees_with_f64_sums() {
        let mut next = super::super::uniform(7);
        for (m, n, k) in [(1, 64, 64), (128, 64, 64), (13, 45, 70), (37, 200, 33), (25, 31, 1)] {
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            for layout in [Layout::RowPerOutput, Layout::RowPerInput] {
                let mut y = vec![f32::NAN; m * n];
                let operands = (x.as_ptr() as *const u8, w.as_ptr() as *const u8, Out::F32(y.as_mut_ptr()));
                let (gemm, chunks) = Gemm::new(operands, Values::F32, (m, n, k), (layout, 1), 3, None);
                (0..chunks).for_each(|c| unsafe { gemm.chunk(c) });
                for i in 0..m {
                    for j in 0..n {
                        let at = |kk: usize| if layout == Layout::RowPerOutput { w[j * k + kk] } else { w[kk * n + j] };
                        let want: f64 = (0..k).map(|kk| f64::from(x[i * k + kk]) * f64::from(at(kk))).sum();
                        let got = f64::from(y[i * n + j]);
                        assert!((got - want).abs() <= 1e-5 * (k as f64).sqrt(), "{m}x{n}x{k} at {i},{j}: {got} vs {want}");
                    }
                }
            }
        }
    }

    /// A convolution's OIHW weight times its windows with each kernel offset's channels together
    /// (`tap_major`): the f32 sums of `x[i, t·C + c] · w[j, c, t]`, for 1, 3×3 and 2×2 offsets.
    #[test]
    fn convolution_weights_read_offset_major() {
        if !amx::bf16_products() {
            return;
        }
        let mut next = super::super::uniform(5);
        let bf16 = |v: f32| super::super::f32_to_bf16(v);
        let value = |b: u16| f64::from(f32::from_bits(u32::from(b) << 16));
        for (m, n, channels, taps) in [(70, 40, 16, 9), (33, 96, 5, 4), (64, 64, 48, 1)] {
            let k = channels * taps;
            let x: Vec<u16> = (0..m * k).map(|_| bf16(next())).collect();
            let w: Vec<u16> = (0..n * k).map(|_| bf16(next())).collect();
            let mut y = vec![f32::NAN; m * n];
            let operands = (x.as_ptr() as *const u8, w.as_ptr() as *const u8, Out::F32(y.as_mut_ptr()));
            let (gemm, chunks) = Gemm::new(operands, Values::Bf16, (m, n, k), (Layout::RowPerOutput, taps), 2, None);
            (0..chunks).for_each(|c| unsafe { gemm.chunk(c) });
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..channels)
                        .flat_map(|c| (0..taps).map(move |t| (c, t)))
                        .map(|(c, t)| value(x[i * k + t * channels + c]) * value(w[(j * channels + c) * taps + t]))
                        .sum();
                    let got = f64::from(y[i * n + j]);
                    assert!((got - want).abs() <= 1e-5 * (k as f64).sqrt(), "{m}x{n}, {channels}x{taps} at {i},{j}: {got} vs {want}");
                }
            }
        }
    }
}
