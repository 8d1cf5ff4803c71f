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
//! The cache maps (kernel, grid, argument bytes) to an executable graph. It is bounded: when
//! full it is emptied (an executable graph destroyed while a launch of it is in flight is freed
//! by the driver when that launch completes).
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

impl Drop for Entry {
    fn drop(&mut self) {
        // SAFETY: our executable graph, destroyed once (in flight: freed when it completes).
        unsafe { cu::cuGraphExecDestroy(raw(self.exec)) };
    }
}

static CACHE: Mutex<Option<HashMap<u64, Arc<Entry>>>> = Mutex::new(None);

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
        let map = cache.get_or_insert_with(HashMap::new);
        match map.get(&key) {
            Some(e) if e.func == f as usize && e.grid == grid && *e.args == *bytes => e.clone(),
            _ => {
                let Some(_quiet) = crate::proxy::outstanding::quiet() else {
                    drop(cache);
                    return super::launch_struct_grid(f, stream, grid, args);
                };
                let exec = instantiate(ctx, f, grid, args)?;
                if map.len() >= CACHE_MAX {
                    map.clear();
                }
                let e = Arc::new(Entry { func: f as usize, grid, args: bytes.into(), exec });
                map.insert(key, e.clone());
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
