//! Helper threads that share a host kernel's work with the thread XLA calls it on: a decode
//! step's products are bound by reading their weights, which one core does at a fraction of
//! the memory's rate.
//!
//! The caller publishes a job and takes chunks of it as the helpers do, so a helper slow to
//! wake (a halted vCPU of a VM takes ~100 µs) costs nothing but the share it did not take.
//! After a job a helper spins for the next one a while, as a step's products follow each
//! other within microseconds, then sleeps until a job comes.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper looks for the next job before it sleeps.
const SPIN: Duration = Duration::from_micros(100);
/// Helpers beyond the calling thread, at most (more cores than this do not read memory faster).
const MAX_HELPERS: usize = 7;

/// Units of work per thread where a kernel splits: a worker that starts late, or runs on a
/// slower core, leaves the others its share.
pub(super) const UNITS_PER_THREAD: usize = 4;

/// A host kernel's work, in units that threads may run at once.
pub(super) trait Chunked {
    /// Runs unit `chunk`.
    ///
    /// # Safety
    /// Units must touch disjoint outputs; each is run once.
    unsafe fn chunk(&self, chunk: usize);
}

/// A job's chunks `0..chunks`, each taken by whichever thread asks next.
struct Units {
    chunks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
}

impl Units {
    fn new(chunks: usize) -> Self {
        Units { chunks, next: AtomicUsize::new(0), done: AtomicUsize::new(0) }
    }

    /// Runs chunks until none is left; a panic (none is expected) still counts its chunk done,
    /// so that the caller never waits for it forever.
    fn work(&self, run: impl Fn(usize)) {
        loop {
            let chunk = self.next.fetch_add(1, SeqCst);
            if chunk >= self.chunks {
                return;
            }
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(chunk)));
            self.done.fetch_add(1, SeqCst);
        }
    }

    /// Waits for the chunks other threads took.
    fn wait(&self) {
        while self.done.load(SeqCst) < self.chunks {
            std::hint::spin_loop();
        }
    }
}

struct Job {
    task: *const (),
    run_chunk: unsafe fn(*const (), usize),
    id: u64,
    units: Units,
}

impl Job {
    fn work(&self) {
        // SAFETY: the caller keeps `task` alive until every taken chunk is done.
        self.units.work(|chunk| unsafe { (self.run_chunk)(self.task, chunk) });
    }
}

struct Pool {
    published: AtomicPtr<Job>,
    /// Per helper: inside a published job (the caller waits for none before its job ends).
    in_job: Vec<AtomicBool>,
    busy: Mutex<()>,
    sleepers: AtomicUsize,
    asleep: Mutex<()>,
    wake: Condvar,
    ids: AtomicU64,
    /// The process the helpers run in: a forked child has none of them.
    pid: u32,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let helpers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, MAX_HELPERS + 1) - 1;
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            published: AtomicPtr::new(std::ptr::null_mut()),
            in_job: (0..helpers).map(|_| AtomicBool::new(false)).collect(),
            busy: Mutex::new(()),
            sleepers: AtomicUsize::new(0),
            asleep: Mutex::new(()),
            wake: Condvar::new(),
            ids: AtomicU64::new(1),
            pid: std::process::id(),
        }));
        for i in 0..helpers {
            // A helper that cannot start only leaves its share to the others.
            let _ = std::thread::Builder::new().name("tpu_dynamo-host".into()).spawn(move || help(pool, i));
        }
        pool
    })
}

fn help(pool: &'static Pool, me: usize) {
    let mut last = 0;
    loop {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        // The clock is read every 256 spins: reading it each time took a tenth of the helpers' time.
        while !spins.is_multiple_of(256) || idle_since.elapsed() < SPIN {
            spins = spins.wrapping_add(1);
            let job = pool.published.load(SeqCst);
            if !job.is_null() {
                pool.in_job[me].store(true, SeqCst);
                if pool.published.load(SeqCst) == job {
                    // SAFETY: published and `in_job` set: the caller keeps the job alive until
                    // it sees `in_job` false after unpublishing it.
                    let job = unsafe { &*job };
                    if job.id != last {
                        last = job.id;
                        job.work();
                        idle_since = Instant::now();
                    }
                }
                pool.in_job[me].store(false, SeqCst);
            }
            // Spinning gives way to any thread that wants this core (XLA's own workers run the
            // step's other parallel work between our products).
            if spins.is_multiple_of(16) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let mut guard = pool.asleep.lock().unwrap_or_else(|p| p.into_inner());
        pool.sleepers.fetch_add(1, SeqCst);
        while pool.published.load(SeqCst).is_null() {
            guard = pool.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
        pool.sleepers.fetch_sub(1, SeqCst);
    }
}

/// The threads `run` shares a job among: this one and the helpers.
pub(super) fn threads() -> usize {
    pool().in_job.len() + 1
}

/// Runs `task`'s chunks `0..chunks` on this thread and the helpers, returning when all are done.
/// Alone when there is one chunk, no helper (a forked child has none), or another job is
/// running.
pub(super) fn run<T: Chunked>(task: &T, chunks: usize) {
    unsafe fn run_chunk<T: Chunked>(task: *const (), chunk: usize) {
        (*task.cast::<T>()).chunk(chunk)
    }
    let pool = pool();
    let shared = chunks > 1 && !pool.in_job.is_empty() && std::process::id() == pool.pid;
    let guard = shared.then(|| pool.busy.try_lock().ok()).flatten();
    let job = Job {
        task: (task as *const T).cast(),
        run_chunk: run_chunk::<T>,
        id: pool.ids.fetch_add(1, SeqCst),
        units: Units::new(chunks),
    };
    if guard.is_none() {
        job.work();
        return;
    }
    pool.published.store(&job as *const Job as *mut Job, SeqCst);
    // A helper holding the lock has yet to check for a job (or has just woken to check again):
    // it finds this one without a notification. Not blocking also keeps a child process forked
    // while a helper held the lock from waiting forever.
    if pool.sleepers.load(SeqCst) > 0 && pool.asleep.try_lock().is_ok() {
        pool.wake.notify_all();
    }
    job.work();
    job.units.wait();
    pool.published.store(std::ptr::null_mut(), SeqCst);
    while pool.in_job.iter().any(|h| h.load(SeqCst)) {
        std::hint::spin_loop();
    }
}

/// A job whose units are shared with tasks on another pool (XLA's), which may start after the
/// job is done: each task holds a reference, so a late one finds no unit left and returns.
struct Shared<T> {
    task: T,
    units: Units,
}

impl<T: Chunked> Shared<T> {
    fn work(&self) {
        // SAFETY: units are disjoint and each is taken once; the caller keeps the buffers alive
        // until every taken unit is done.
        self.units.work(|chunk| unsafe { self.task.chunk(chunk) });
    }
}

/// Runs `task`'s units `0..chunks` on this thread and on up to `helpers` tasks handed to
/// `schedule` (which returns false where it could not take one), returning when all are done.
/// Never waits for a task to start: one queued behind this thread's own work would never run.
pub(super) fn run_scheduled<T: Chunked + 'static>(
    task: T,
    chunks: usize,
    helpers: usize,
    schedule: impl Fn(unsafe extern "C" fn(*mut c_void), *mut c_void) -> bool,
) {
    unsafe extern "C" fn run<T: Chunked>(data: *mut c_void) {
        // SAFETY: `data` is a reference `run_scheduled` handed over with `Arc::into_raw`.
        let job = unsafe { Arc::from_raw(data as *const Shared<T>) };
        job.work();
    }
    let job = Arc::new(Shared { task, units: Units::new(chunks) });
    for _ in 0..helpers.min(chunks.saturating_sub(1)) {
        let data = Arc::into_raw(job.clone()) as *mut c_void;
        if !schedule(run::<T>, data) {
            // SAFETY: not handed over; take the reference back.
            drop(unsafe { Arc::from_raw(data as *const Shared<T>) });
            break;
        }
    }
    job.work();
    job.units.wait();
}
