//! Launches that repeat with the same arguments, replayed as one-node graphs.
//!
//! A prepared transfer's GPU round on a live stream launches the same kernel with the same
//! argument block every time: what changes from round to round (the round number) lives in
//! its control block in GPU memory. On our machines the host pays 4.39 µs for a kernel launch
//! and 1.98 µs for launching a one-node graph (../shared/DEVICE.md floors; the round-trip gain is
//! in docs/PERF.md, 2026-11-22), so such a launch is instantiated once as a graph and replayed.
//! A stream being captured gets the kernel itself: it becomes a node of the user's graph (with
//! a programmatic edge from the node before it, `GSC_CUDA_PDL`).
//!
//! The cache maps (kernel, grid, argument bytes) to an executable graph. An instantiation
//! costs ~25 µs of host time against a launch's 4.4 and a replay's 2, so a graph pays off
//! only for a launch that comes back about ten times. A launch is therefore cached only once
//! it keeps coming: it is launched as it is until its `ADMIT_AT`-th miss in a row with at most
//! `MISSED_AGAIN_WITHIN` launches between them, and instantiated then. A launch that comes
//! back a few times at most (nccl-tests moves its buffers on every call, through up to
//! `maxbytes / size` offsets; an eager program's allocator hands out new addresses) costs
//! launches, not instantiations that are hardly replayed. The cache is bounded (`CACHE_MAX`);
//! a full one replaces its least recently used graph for such a launch (it belongs to a set
//! that fits), and on every `REPLACE_EVERY`-th other miss.
//!
//! History (docs/PERF.md): the cache used to empty itself when full, so a program cycling
//! through more argument blocks than it holds paid an instantiation per launch (an eager
//! 8-byte all-reduce in nccl-tests: 31 µs; 11 once a full cache launched its misses, session
//! 28). Then every launch was instantiated at its first miss while the cache had room: an
//! eager 1 MiB all-reduce of two GPUs driven from one thread took 47–65 µs in nccl-tests
//! against 12 on buffers that stay put; instantiating at the second miss fixed that (14–23)
//! but slowed the 4 MiB calls, whose 32 offsets come back once in 50 calls, from 23 to 36
//! (session 29, 2 × H200). A cycle through more launches than the cache holds costs a launch
//! plus at most 1/`REPLACE_EVERY` of an instantiation; a program whose set of launches moves
//! on gets the new one cached within `ADMIT_AT` passes. (An executable graph destroyed while a
//! launch of it is in flight is freed by the driver when that launch completes.)
//!
//! A miss is instantiated only while no proxy of this process holds a stream-ordered operation
//! and none is being issued (`proxy::outstanding::quiet`); otherwise the kernel is launched as
//! it is. `cuGraphInstantiate` can hold the driver's lock while it waits for work on the
//! device, and that work may be waiting for a proxy that needs the lock for its staging copies:
//! on the device a collective across hosts stalled that way until `GSC_TIMEOUT` (issue #7,
//! session 20). A hit only launches. While a graph or kernel-triggered condition with gscomm
//! operations exists, nothing is quiet (its next trigger may come at any moment), so a launch
//! that misses then costs a plain kernel launch each time.

use super::{CtxScope, Grid, check, cu, raw};
use crate::error::Result;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

/// Graphs kept at most (each is one kernel node: a few KiB of driver memory).
const CACHE_MAX: usize = 256;

/// With the cache full, one miss in this many replaces the least recently used graph; the
/// others launch the kernel itself.
const REPLACE_EVERY: u64 = 64;

/// Misses of one launch at most this many launches apart are one run of misses; the
/// `ADMIT_AT`-th of a run is instantiated (with the cache full: in place of the least recently
/// used graph). So a program that moves on to another set of launches gets it cached within
/// `ADMIT_AT` passes, while a cycle through more launches than the cache holds (each missing
/// again only a cycle later) replaces at the budget above.
const MISSED_AGAIN_WITHIN: u64 = CACHE_MAX as u64;

/// The miss of a run (above) that is instantiated: the third, so a launch seen twice and
/// never again costs no instantiation.
const ADMIT_AT: u32 = 3;

/// A kernel's by-value argument block whose bytes can key the cache: a `repr(C)` struct of
/// `u64` fields only (no padding), which its implementations below are.
pub(crate) trait ArgBlock: Copy {}
impl ArgBlock for super::PrepArgs {}
impl ArgBlock for super::PrepGroup {}

fn bytes_of<T: ArgBlock>(args: &T) -> &[u8] {
    // SAFETY: `ArgBlock` types are repr(C) structs of u64 fields: every byte is initialized.
    unsafe { std::slice::from_raw_parts(args as *const T as *const u8, std::mem::size_of::<T>()) }
}

/// A cached graph (its handle kept as an integer: the driver's handles are thread-safe).
struct Entry {
    func: usize,
    grid: Grid,
    args: Box<[u8]>,
    exec: usize,
}

/// What to do about a launch the cache does not hold.
#[derive(Debug, PartialEq, Eq)]
enum Miss {
    /// Instantiate it and keep it.
    Insert,
    /// Instantiate it and keep it in place of the entry with this key.
    Replace(u64),
    /// Launch the kernel itself.
    Launch,
}

/// The cache's bookkeeping, apart from what it holds (so the policy is testable without a
/// GPU): entries by key, with the tick (launch count) of their last use, and the recent
/// misses, with their ticks (at most `4 * CACHE_MAX`, then those too old to count forgotten).
struct Slots<V> {
    map: HashMap<u64, (V, u64)>,
    tick: u64,
    misses_when_full: u64,
    /// Key -> (tick of its last miss, misses in its run).
    recent_misses: HashMap<u64, (u64, u32)>,
}

impl<V: Clone> Slots<V> {
    fn new() -> Slots<V> {
        Slots { map: HashMap::new(), tick: 0, misses_when_full: 0, recent_misses: HashMap::new() }
    }

    /// The entry for `key`, if `same` says it is the one (keys are hashes), marked used.
    fn hit(&mut self, key: u64, same: impl Fn(&V) -> bool) -> Option<V> {
        self.tick += 1;
        let tick = self.tick;
        match self.map.get_mut(&key) {
            Some((v, used)) if same(v) => {
                *used = tick;
                Some(v.clone())
            }
            _ => None,
        }
    }

    /// The policy for a miss of `key` (see the module's comment).
    fn on_miss(&mut self, key: u64) -> Miss {
        let tick = self.tick;
        let run = self.recent_misses.entry(key).or_insert((tick, 0));
        if tick - run.0 > MISSED_AGAIN_WITHIN {
            run.1 = 0;
        }
        *run = (tick, run.1 + 1);
        let again = run.1 >= ADMIT_AT;
        if again {
            self.recent_misses.remove(&key);
        }
        if self.recent_misses.len() > 4 * CACHE_MAX {
            // Only runs within the window count: at most MISSED_AGAIN_WITHIN of them stay.
            self.recent_misses.retain(|_, (t, _)| tick - *t <= MISSED_AGAIN_WITHIN);
        }
        if self.map.len() < CACHE_MAX {
            return if again { Miss::Insert } else { Miss::Launch };
        }
        self.misses_when_full += 1;
        if !again && !self.misses_when_full.is_multiple_of(REPLACE_EVERY) {
            return Miss::Launch;
        }
        self.map.iter().min_by_key(|(_, (_, used))| *used).map_or(Miss::Insert, |(&oldest, _)| Miss::Replace(oldest))
    }

    /// Keep `value` under `key`, in place of `replaced` (from `on_miss`) if given; returns what
    /// was dropped from the cache, for the caller to release.
    fn keep(&mut self, key: u64, value: V, replaced: Option<u64>) -> Vec<V> {
        let mut gone: Vec<V> = replaced.and_then(|k| self.map.remove(&k)).map(|(v, _)| v).into_iter().collect();
        gone.extend(self.map.insert(key, (value, self.tick)).map(|(v, _)| v));
        gone
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        // SAFETY: our executable graph, destroyed once (in flight: freed when it completes).
        unsafe { cu::cuGraphExecDestroy(raw(self.exec)) };
    }
}

static CACHE: std::sync::LazyLock<Mutex<Slots<Arc<Entry>>>> = std::sync::LazyLock::new(|| Mutex::new(Slots::new()));

/// Launch `f` (one of our kernels in context `ctx`, one parameter: `args`) as `grid` on
/// `stream`: a replay of a cached one-node graph, or the kernel itself when the stream is being
/// captured.
pub(crate) fn launch<T: ArgBlock>(ctx: usize, f: cu::CUfunction, stream: usize, grid: Grid, args: &T) -> Result<()> {
    if capturing(stream)? {
        return launch_direct(f, stream, grid, args);
    }
    let bytes = bytes_of(args);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (f as usize, grid, bytes).hash(&mut h);
    let key = h.finish();
    let entry = {
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        match cache.hit(key, |e| e.func == f as usize && e.grid == grid && *e.args == *bytes) {
            Some(e) => e,
            None => {
                let replaced = match cache.on_miss(key) {
                    Miss::Insert => None,
                    Miss::Replace(k) => Some(k),
                    Miss::Launch => {
                        drop(cache);
                        return super::launch_struct_grid(f, stream, grid, args);
                    }
                };
                let Some(_quiet) = crate::proxy::outstanding::quiet() else {
                    drop(cache);
                    return super::launch_struct_grid(f, stream, grid, args);
                };
                let exec = instantiate(ctx, f, grid, args)?;
                let e = Arc::new(Entry { func: f as usize, grid, args: bytes.into(), exec });
                // Dropped here, under the lock, as the cache's clear did: each is destroyed once.
                drop(cache.keep(key, e.clone(), replaced));
                e
            }
        }
    };
    // SAFETY: our executable graph (kept alive by `entry`) and the user's live stream.
    check(unsafe { cu::cuGraphLaunch(raw(entry.exec), raw(stream)) }, "cuGraphLaunch")
}

/// Launch `f` as `launch` does, without the cache: for launches whose arguments change from
/// one to the next (a replay of each would cost an instantiation, and evict the others).
pub(crate) fn launch_uncached<T: ArgBlock>(f: cu::CUfunction, stream: usize, grid: Grid, args: &T) -> Result<()> {
    match capturing(stream)? {
        true => launch_direct(f, stream, grid, args),
        false => super::launch_struct_grid(f, stream, grid, args),
    }
}

/// Under capture: the kernel itself, with a programmatic edge from the node before it when
/// `GSC_CUDA_PDL` is on.
fn launch_direct<T: ArgBlock>(f: cu::CUfunction, stream: usize, grid: Grid, args: &T) -> Result<()> {
    match super::pdl_enabled() {
        true => super::launch_struct_grid_pdl(f, stream, grid, args),
        false => super::launch_struct_grid(f, stream, grid, args),
    }
}

fn capturing(stream: usize) -> Result<bool> {
    let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a valid out-pointer; `stream` is the user's CUstream.
    check(unsafe { cu::cuStreamIsCapturing(raw(stream), &mut status) }, "cuStreamIsCapturing")?;
    Ok(status != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// A one-node graph launching `f(args)`, instantiated in `ctx` (the kernel's context).
fn instantiate<T: ArgBlock>(ctx: usize, f: cu::CUfunction, grid: Grid, args: &T) -> Result<usize> {
    let _scope = CtxScope::enter(raw(ctx))?;
    let mut graph: cu::CUgraph = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check(unsafe { cu::cuGraphCreate(&mut graph, 0) }, "cuGraphCreate")?;
    let result = (|| {
        // SAFETY: our live graph, no dependencies.
        unsafe { add_kernel_node(graph, f, grid, args, &[]) }?;
        let mut exec: cu::CUgraphExec = std::ptr::null_mut();
        // SAFETY: our graph; a valid out-pointer.
        check(unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "cuGraphInstantiate")?;
        Ok(exec as usize)
    })();
    // SAFETY: our graph, destroyed once; the executable graph does not need it.
    unsafe { cu::cuGraphDestroy(graph) };
    result
}

/// Add `f(args)` as a kernel node to `graph`, after `deps`; returns the node. The context
/// `graph`'s nodes are built in must be current.
///
/// # Safety
/// `graph` is a live graph and `deps` are nodes of it; `args` matches the kernel's one
/// by-value parameter (the driver copies it during the call).
pub(crate) unsafe fn add_kernel_node<T: ArgBlock>(
    graph: cu::CUgraph,
    f: cu::CUfunction,
    grid: Grid,
    args: &T,
    deps: &[cu::CUgraphNode],
) -> Result<cu::CUgraphNode> {
    let mut params = [args as *const T as *mut std::ffi::c_void];
    // SAFETY: zero is valid for every field (null pointers, no extra).
    let mut p: cu::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    p.func = f;
    (p.gridDimX, p.gridDimY, p.gridDimZ) = (grid.blocks, 1, 1);
    (p.blockDimX, p.blockDimY, p.blockDimZ) = (grid.threads, 1, 1);
    p.kernelParams = params.as_mut_ptr();
    let mut node: cu::CUgraphNode = std::ptr::null_mut();
    // SAFETY: the caller's promises on the graph and dependencies; `p` and `params` outlive
    // the call.
    check(unsafe { cu::cuGraphAddKernelNode_v2(&mut node, graph, deps.as_ptr(), deps.len(), &p) }, "cuGraphAddKernelNode")?;
    Ok(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Launches of `keys`, in order, through the policy; how many instantiations they cost.
    fn instantiations(slots: &mut Slots<u64>, keys: impl Iterator<Item = u64>) -> usize {
        let mut made = 0;
        for k in keys {
            if slots.hit(k, |v| *v == k).is_some() {
                continue;
            }
            match slots.on_miss(k) {
                Miss::Launch => {}
                Miss::Insert => {
                    made += 1;
                    slots.keep(k, k, None);
                }
                Miss::Replace(old) => {
                    made += 1;
                    assert_eq!(slots.keep(k, k, Some(old)), vec![old]);
                }
            }
        }
        made
    }

    #[test]
    fn a_working_set_that_fits_is_instantiated_once() {
        let mut slots = Slots::new();
        let keys = (0..100u64).cycle().take(100 * 50);
        assert_eq!(instantiations(&mut slots, keys), 100);
        assert_eq!(slots.map.len(), 100);
    }

    /// A launch is instantiated at its third miss in a run: a prepared round (one argument
    /// block launched over and over) is cached from its third launch on, and launches that come
    /// back once at most cost no instantiation.
    #[test]
    fn only_launches_that_keep_coming_are_instantiated() {
        let mut slots = Slots::new();
        assert_eq!(instantiations(&mut slots, std::iter::repeat_n(7, 2)), 0, "first and second launch: the kernel itself");
        assert_eq!(instantiations(&mut slots, std::iter::once(7)), 1, "third: instantiated");
        assert_eq!(instantiations(&mut slots, std::iter::repeat_n(7, 1000)), 0, "then replayed");
        // Buffers that move on every call (every key new): no instantiation at all.
        assert_eq!(instantiations(&mut slots, 1000..11_000u64), 0);
        assert_eq!(slots.map.len(), 1);
        // nccl-tests' 4 MiB calls: 32 offsets, 50 calls (each offset back once at most).
        assert_eq!(instantiations(&mut slots, (40_000..40_032u64).cycle().take(50)), 0);
        // A key that comes back only after more than MISSED_AGAIN_WITHIN launches starts a new run.
        let gap = || 30_000..30_000 + MISSED_AGAIN_WITHIN;
        let far = [20_000, 20_000].into_iter().chain(gap()).chain(std::iter::once(20_000));
        assert_eq!(instantiations(&mut slots, far), 0);
    }

    /// nccl-tests' moving buffers: 2 ranks × 1024 offsets, in a cycle. Emptying the cache when
    /// full instantiated on every launch. Now such a cycle (each launch back only 2048 launches
    /// later) instantiates nothing; with the cache full of another set, one miss in
    /// REPLACE_EVERY replaces.
    #[test]
    fn a_cycle_longer_than_the_cache_instantiates_a_bounded_share() {
        let mut slots = Slots::new();
        let launches = 2048 * 20;
        let cycle = || (0..2048u64).cycle().take(launches);
        assert_eq!(instantiations(&mut slots, cycle()), 0);
        assert!(slots.map.is_empty());
        let hot = || 100_000..100_000 + CACHE_MAX as u64;
        assert_eq!((0..ADMIT_AT).map(|_| instantiations(&mut slots, hot())).sum::<usize>(), CACHE_MAX);
        let made = instantiations(&mut slots, cycle());
        let bound = launches / REPLACE_EVERY as usize + 1;
        assert!(made <= bound, "{made} instantiations for {launches} launches (bound {bound})");
        assert_eq!(slots.map.len(), CACHE_MAX);
    }

    /// A program whose launches move on to a new set that fits gets it cached in ADMIT_AT passes,
    /// and the entries still in use are not the ones replaced (nccl-tests' next size: as many
    /// launches as the cache holds, in a cycle).
    #[test]
    fn a_new_working_set_replaces_the_old_one_and_keeps_the_hot_entries() {
        let mut slots = Slots::new();
        let first = || 0..CACHE_MAX as u64;
        assert_eq!((0..ADMIT_AT).map(|_| instantiations(&mut slots, first())).sum::<usize>(), CACHE_MAX);
        // From now on: key 0 stays hot, and 100 new keys take over.
        let round = || std::iter::once(0).chain(1000..1100u64);
        // (An early pass may replace one at the budget.)
        assert_eq!((0..ADMIT_AT).map(|_| instantiations(&mut slots, round())).sum::<usize>(), 100);
        assert!(slots.map.contains_key(&0), "the hot entry was replaced");
        assert_eq!(instantiations(&mut slots, round()), 0);
        // A whole new set as large as the cache, likewise.
        let full = || 5000..5000 + CACHE_MAX as u64;
        let made: usize = (0..ADMIT_AT).map(|_| instantiations(&mut slots, full())).sum();
        assert_eq!(made, CACHE_MAX);
        assert_eq!(instantiations(&mut slots, full()), 0);
    }
}
