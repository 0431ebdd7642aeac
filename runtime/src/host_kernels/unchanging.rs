//! Host memory declared to hold one value for as long as a buffer over it lives (a resident
//! weight's: the runtime makes a new buffer, declared anew, when the weight's version moves), and
//! what the products derive from it: their `[K, 32]` panels of a weight (or, on AMX, its bf16
//! pieces as tiles), packed once instead of on every call (7 % of a tiny Llama's execute).
//!
//! A kernel sees only an operand's address. Memory counts as unchanging only while a range
//! declared over it is in the registry: a declaration displaces any range it overlaps, and the
//! runtime forgets every range an input it reads as it is (a user input, a view of a buffer an
//! execute writes) overlaps, so a panel is never taken from memory that may since have changed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock};

use super::amx::Values;
use super::gemm::Line;

/// The bytes of panels kept at most: an eighth of the host's memory (256 MiB where it cannot be
/// read). Past it the products pack on every call. The panels of a small model's weights (K ≤
/// 256) take their f32 bytes; a weight the compiler gives the product kernel for a longer
/// contraction takes 1.5 times its bytes as AMX pieces, within this budget (its check:
/// `weights_kept_on_tiles`): GPT-2 small's ~0.8 GB, SmolLM-135M's ~0.8 GB.
pub fn budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        // SAFETY: sysconf only reads system constants.
        let (pages, page_size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        if pages > 0 && page_size > 0 {
            (pages as usize).saturating_mul(page_size as usize) / 8
        } else {
            256 << 20
        }
    })
}

/// What a kernel keeps of one weight: its address, `n`, `k`, whether it is stored `[N, K]`, the
/// kernel offsets of a convolution's weight whose K it reorders (`gemm::tap_major`; 1 for a
/// matrix), and how it is packed.
pub(super) type PanelKey = (usize, usize, usize, bool, usize, Packed);

/// How a kept weight is packed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Packed {
    /// A product's f32 panels (`gemm::pack_all`).
    Panels,
    /// The AMX pieces of these values (`amx::pack`).
    Pieces(Values),
    /// A bf16 3×3 convolution's weight with its channels in pairs (`conv::paired_weight`).
    ChannelPairs,
}

struct Range {
    end: usize,
    generation: u64,
    panels: Vec<(PanelKey, Arc<[Line]>)>,
}

#[derive(Default)]
struct Registry {
    ranges: BTreeMap<usize, Range>,
    kept_bytes: usize,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Default::default);
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

impl Registry {
    /// Removes every range overlapping `[start, end)` with what was derived from it.
    fn remove_overlapping(&mut self, start: usize, end: usize) {
        // Ranges never overlap each other, so the ones overlapping are the last few starting
        // before `end`.
        let overlapping: Vec<usize> =
            self.ranges.range(..end).rev().take_while(|(_, r)| r.end > start).map(|(&s, _)| s).collect();
        for s in overlapping {
            self.remove(s);
        }
    }

    fn remove(&mut self, start: usize) {
        if let Some(range) = self.ranges.remove(&start) {
            self.kept_bytes -= range.panels.iter().map(|(_, p)| std::mem::size_of_val(&**p)).sum::<usize>();
        }
    }

    /// The declared range holding all of `[start, end)`.
    fn holding(&mut self, start: usize, end: usize) -> Option<&mut Range> {
        let (_, range) = self.ranges.range_mut(..=start).next_back()?;
        (range.end >= end).then_some(range)
    }
}

/// A declaration that `[start, start + len)` holds one value; undone on drop.
#[derive(Debug)]
pub struct Declared {
    start: usize,
    generation: u64,
}

/// Declares `[start, start + len)` unchanging until the returned guard drops. The caller must
/// guarantee it: the memory is neither written nor freed meanwhile.
pub fn declare(start: usize, len: usize) -> Declared {
    let generation = GENERATIONS.fetch_add(1, Ordering::Relaxed);
    let mut registry = registry();
    registry.remove_overlapping(start, start + len);
    registry.ranges.insert(start, Range { end: start + len, generation, panels: Vec::new() });
    Declared { start, generation }
}

impl Drop for Declared {
    fn drop(&mut self) {
        let mut registry = registry();
        // A newer declaration may have displaced this one (the same memory, a new version).
        if registry.ranges.get(&self.start).is_some_and(|r| r.generation == self.generation) {
            registry.remove(self.start);
        }
    }
}

/// Forgets every declared range `[start, start + len)` overlaps: the memory is read as it is
/// from now on (a user input's, or a view of memory an execute writes).
pub fn forget(start: usize, len: usize) {
    let mut registry = registry();
    if !registry.ranges.is_empty() {
        registry.remove_overlapping(start, start + len.max(1));
    }
}

/// Bytes of weights kept packed now.
pub fn kept_bytes() -> usize {
    registry().kept_bytes
}

/// The panels `key` names, made by `pack` the first time, where the weight's `read` bytes at
/// `key`'s address lie in a declared range and the budget allows `packed` more f32s; `None`
/// otherwise (pack per call).
pub(super) fn panels(key: PanelKey, (read, packed): (usize, usize), pack: impl FnOnce() -> Vec<Line>) -> Option<Arc<[Line]>> {
    let mut registry = registry();
    let kept_bytes = registry.kept_bytes;
    let range = registry.holding(key.0, key.0 + read)?;
    if let Some((_, panels)) = range.panels.iter().find(|(k, _)| *k == key) {
        return Some(panels.clone());
    }
    let size = packed * size_of::<f32>();
    if kept_bytes + size > budget() {
        return None;
    }
    // Packed under the lock: once per weight, and no declaration may change meanwhile.
    let panels: Arc<[Line]> = pack().into();
    range.panels.push((key, panels.clone()));
    registry.kept_bytes += std::mem::size_of_val(&*panels);
    Some(panels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A distinct fake address range per test: the registry is process-wide.
    fn base(test: usize) -> usize {
        0x7000_0000_0000 + test * 0x1_0000_0000
    }

    fn kept(start: usize) -> bool {
        panels((start, 32, 1, true, 1, Packed::Panels), (128, 32), || vec![Line([0.0; 16]); 2]).is_some()
    }

    #[test]
    fn panels_are_kept_only_inside_a_declared_range() {
        let b = base(1);
        assert!(!kept(b));
        let declared = declare(b, 4096);
        let mut packs = 0;
        for _ in 0..3 {
            panels((b + 1024, 32, 1, true, 1, Packed::Panels), (128, 32), || {
                packs += 1;
                vec![Line([1.0; 16]); 2]
            })
            .unwrap();
        }
        assert_eq!(packs, 1);
        assert!(!kept(b + 4000), "runs past the range's end");
        drop(declared);
        assert!(!kept(b + 1024));
    }

    #[test]
    fn forgetting_any_overlap_undoes_a_declaration() {
        let b = base(2);
        let _declared = declare(b, 4096);
        assert!(kept(b));
        forget(b + 4095, 1);
        assert!(!kept(b));
        forget(b, 4096); // nothing left to forget
    }

    #[test]
    fn a_newer_declaration_displaces_and_survives_the_older_one() {
        let b = base(3);
        let old = declare(b, 4096);
        let first = panels((b, 32, 1, true, 1, Packed::Panels), (128, 32), || vec![Line([1.0; 16]); 2]).unwrap();
        let new = declare(b, 4096);
        let second = panels((b, 32, 1, true, 1, Packed::Panels), (128, 32), || vec![Line([2.0; 16]); 2]).unwrap();
        assert_eq!((first[0].0[0], second[0].0[0]), (1.0, 2.0), "the new value is packed anew");
        drop(old);
        assert!(kept(b), "dropping the displaced declaration leaves the newer one");
        drop(new);
        assert!(!kept(b));
    }
}
