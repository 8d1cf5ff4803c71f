//! The one place that calls the CUDA driver and NVRTC. Both are loaded at run time (cudarc's
//! dynamic loading), so building the crate needs no CUDA and a machine without a GPU gets a
//! clear error (`LibraryMissing` / `NoDevice`) the first time a CUDA feature is used.
//!
//! What lives here: driver start-up and error mapping, contexts of streams, the stream memops
//! that arm a stream condition, kernel launches and graph nodes for replay-safe conditions,
//! page-locked mapped memory for trigger/done words (`pinned`), the NVRTC kernel cache
//! (`kernels`), and a few thin wrappers the tests and gsc-bench use (`api`).
//!
//! Also here: the device memory allocator behind `mem_alloc`/`ncclMemAlloc` (`alloc`), memory
//! type detection (`memory`), CUDA IPC keys and mappings (`ipc`), VMM
//! allocations shared as POSIX file descriptors (`vmm`) and the copy engine (`copy`).
//!
//! Rule kept everywhere: the proxy thread makes no CUDA call that can wait on a user stream.
//! It arms nothing and launches nothing; the calls it does make (enqueueing a copy on our own
//! non-blocking copy stream, querying its event, opening an IPC handle, and host-staged copies
//! that wait on that copy stream only) never wait behind a stream that waits on the proxy. It
//! also imports and maps a peer's VMM allocation (`vmm::import`) and unmaps one the peer
//! replaced (`vmm::release`): measured not to wait (docs/probes/vmm_block.py). Closing a legacy
//! mapping synchronizes the device, so that is left to `ipc::release_retired`. Nor does it
//! allocate page-locked memory (`bounce`).
//!
//! The other side of that rule, on users' threads: nothing that can wait for the device (a
//! kernel's lazy load, an allocation or free, a graph instantiation) may run after a call has
//! put a wait for the proxy on a stream, or the proxy's own copies can end up queued behind it
//! (every driver call takes the driver's lock, which such a call may hold while it waits).
//! Modules therefore load every kernel up front (`kernels::load_module`), communicators load
//! theirs at creation, and `replay` instantiates a graph only while no proxy holds a
//! stream-ordered operation (`proxy::outstanding`).

pub(crate) mod alloc;
pub mod api;
pub(crate) mod bounce;
pub(crate) mod coll;
pub(crate) mod coll_device;
pub(crate) mod coll_direct;
mod coll_modules;
pub(crate) mod coll_p2p;
mod coll_pipelined;
pub(crate) mod coll_ring;
pub(crate) mod copy;
mod device_handle;
pub(crate) mod export_life;
pub(crate) mod host_round;
pub(crate) mod ipc;
mod kernel_cache;
mod kernels;
pub(crate) mod lanes;
pub(crate) mod memory;
mod pinned;
pub(crate) mod prep_ctl;
mod replay;
mod stage;
pub(crate) mod vmm;
mod word_read;

pub(crate) use device_handle::DeviceHandleSlot;
pub(crate) use kernels::{
    GROUP_MAX, Kernels, OpDesc, OpList, OpsArgs, PREP_BEGIN, PREP_GROUP_MAX, PREP_READY, PREP_READY_WAIT, PREP_SEND, PREP_WAIT, PrepArgs,
    PrepGroup, SeqArgs, SyncArgs, THREADS,
};
pub(crate) use pinned::PinnedSlot;
pub(crate) use stage::{LL_MAX, StageSlot, ll_area, ll_flag};
pub(crate) use word_read::read_word;

use crate::error::{Error, Result, Status};
use cudarc::driver::sys as cu;
use std::ffi::CStr;
use std::sync::OnceLock;

/// Every driver symbol gscomm calls, checked once at start-up so a driver that lacks one gives
/// an error naming it instead of a panic in the middle of an operation.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuCtxEnablePeerAccess",
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuStreamGetCtx",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo_v3",
    "cuStreamBatchMemOp_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoH_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuGraphCreate",
    "cuGraphDestroy",
    "cuGraphAddKernelNode_v2",
    "cuGraphAddDependencies_v2",
    "cuGraphInstantiateWithFlags",
    "cuGraphExecDestroy",
    "cuGraphLaunch",
    "cuUserObjectCreate",
    "cuGraphRetainUserObject",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuPointerGetAttribute",
    "cuPointerGetAttributes",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemcpyAsync",
    "cuMemHostRegister_v2",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemFreeHost",
    "cuMemsetD8_v2",
    "cuMemGetInfo_v2",
    "cuThreadExchangeStreamCaptureMode",
    // VMM allocations shared as POSIX file descriptors (`vmm`).
    "cuMemRetainAllocationHandle",
    "cuMemRelease",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemGetAllocationGranularity",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemCreate",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAccess",
];

/// Load the driver, check its symbols and initialize it (once per process).
pub fn init() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: probing for the library has no preconditions.
        if !unsafe { cu::is_culib_present() } {
            return Err(Error::new(
                Status::LibraryMissing,
                "the CUDA driver (libcuda.so) cannot be loaded: no NVIDIA driver on this machine",
            ));
        }
        // SAFETY: the library is present (checked above); `get` only looks symbols up.
        let lib = unsafe { cu::culib() };
        // Loaded now, by us: memory-type detection need not find it among the loaded objects.
        memory::note_cuda_loaded();
        for name in DRIVER_SYMBOLS {
            // SAFETY: a lookup; the pointer is not called here.
            if unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err() {
                return Err(Error::new(Status::LibraryMissing, format!("the CUDA driver lacks {name} (driver too old?)")));
            }
        }
        // SAFETY: cuInit has no preconditions.
        check(unsafe { cu::cuInit(0) }, "cuInit")?;
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer.
        check(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        if n == 0 {
            return Err(Error::new(Status::NoDevice, "the CUDA driver sees no GPU"));
        }
        tracing::debug!(target: "gsc::cuda", devices = n, "CUDA driver initialized");
        Ok(())
    })
    .clone()
}

/// Whether every GPU this process sees can access every other one directly (NVLink or PCIe
/// P2P), asked once. A process cannot name the GPU a peer process uses (its visible devices
/// may differ), so GPU-initiated rounds are offered only where every pair here is reachable.
pub(crate) fn peer_access_everywhere() -> Result<bool> {
    static ANSWER: OnceLock<std::result::Result<bool, Error>> = OnceLock::new();
    ANSWER
        .get_or_init(|| {
            init()?;
            let mut n = 0;
            // SAFETY: a valid out-pointer.
            check(unsafe { cu::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
            for a in 0..n {
                for b in (0..n).filter(|&b| b != a) {
                    let mut yes = 0;
                    // SAFETY: valid out-pointer; ordinals below the device count are devices.
                    check(unsafe { cu::cuDeviceCanAccessPeer(&mut yes, a, b) }, "cuDeviceCanAccessPeer")?;
                    if yes == 0 {
                        return Ok(false);
                    }
                }
            }
            Ok(true)
        })
        .clone()
}

/// Let kernels on `from` (its primary context) reach memory of device `to` by address: what
/// one process needs to use another GPU's allocation directly (between processes, opening an
/// IPC handle does this). Idempotent.
pub(crate) fn enable_peer_access(from: i32, to: i32) -> Result<()> {
    if from == to {
        return Ok(());
    }
    let peer = copy::primary_context(to)?;
    let _scope = CtxScope::enter(copy::primary_context(from)?)?;
    // SAFETY: the peer's primary context (retained for the process); flags must be 0.
    match unsafe { cu::cuCtxEnablePeerAccess(peer, 0) } {
        cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        r => check(r, "cuCtxEnablePeerAccess"),
    }
}

/// `Ok` for CUDA_SUCCESS, else an error naming the call and the driver's error.
pub(crate) fn check(r: cu::CUresult, what: &str) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: a valid out-pointer; the driver returns a static string or leaves it null.
    unsafe { cu::cuGetErrorName(r, &mut name) };
    let name = if name.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null strings from cuGetErrorName are static and NUL-terminated.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    };
    let status = match r {
        cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Status::NoMemory,
        cu::CUresult::CUDA_ERROR_INVALID_VALUE | cu::CUresult::CUDA_ERROR_INVALID_HANDLE => Status::InvalidParam,
        cu::CUresult::CUDA_ERROR_NO_DEVICE => Status::NoDevice,
        cu::CUresult::CUDA_ERROR_NOT_SUPPORTED => Status::Unsupported,
        _ => Status::DeviceError,
    };
    Err(Error::new(status, format!("{what} failed: {name}")))
}

/// A raw CUDA handle passed through gscomm as an address (CUstream, CUgraph, CUcontext).
pub(crate) fn raw<T>(addr: usize) -> *mut T {
    addr as *mut T
}

/// The context a stream belongs to (the legacy/per-thread default streams: the current one).
pub(crate) fn stream_context(stream: usize) -> Result<cu::CUcontext> {
    init()?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: the user passed `stream` as a CUstream of a live context (gsc.h's contract);
    // `ctx` is a valid out-pointer.
    check(unsafe { cu::cuStreamGetCtx(raw(stream), &mut ctx) }, "cuStreamGetCtx")?;
    Ok(ctx)
}

/// The calling thread's current context; an error when it has none.
pub(crate) fn current_context() -> Result<cu::CUcontext> {
    init()?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check(unsafe { cu::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
    if ctx.is_null() {
        return Err(Error::new(
            Status::NoDevice,
            "no CUDA context is current on this thread (call cudaSetDevice and cudaFree(0), or cuCtxSetCurrent, first)",
        ));
    }
    Ok(ctx)
}

/// Makes `ctx` current for a scope and restores the previous one after.
pub(crate) struct CtxScope(());

impl CtxScope {
    pub(crate) fn enter(ctx: cu::CUcontext) -> Result<CtxScope> {
        // SAFETY: `ctx` is a live context (from the driver).
        check(unsafe { cu::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
        Ok(CtxScope(()))
    }
}

impl Drop for CtxScope {
    fn drop(&mut self) {
        let mut old: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread.
        unsafe { cu::cuCtxPopCurrent_v2(&mut old) };
    }
}

/// If `stream` is being captured, the graph it is captured into.
pub(crate) fn capture_graph(stream: usize) -> Result<Option<cu::CUgraph>> {
    let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: u64 = 0;
    let mut graph: cu::CUgraph = std::ptr::null_mut();
    let mut deps: *const cu::CUgraphNode = std::ptr::null();
    let mut edges: *const cu::CUgraphEdgeData = std::ptr::null();
    let mut ndeps: usize = 0;
    // SAFETY: every out-pointer is valid; `stream` is the user's CUstream.
    check(
        unsafe { cu::cuStreamGetCaptureInfo_v3(raw(stream), &mut status, &mut id, &mut graph, &mut deps, &mut edges, &mut ndeps) },
        "cuStreamGetCaptureInfo",
    )?;
    Ok(match status {
        cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Some(graph),
        cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => None,
        _ => return Err(Error::invalid_param("the stream's capture was invalidated; end it (cudaStreamEndCapture) before issuing on it")),
    })
}

/// Run `f` (an allocation of page-locked memory) with this thread's stream-capture mode relaxed:
/// under a capture in the default global mode, such "potentially unsafe" calls would invalidate
/// the capture, and operations issued on a capturing stream take their slots while it runs.
pub(crate) fn with_relaxed_capture<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let mut mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a valid in/out pointer; the previous mode comes back in `mode`.
    check(unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) }, "cuThreadExchangeStreamCaptureMode")?;
    let r = f();
    // SAFETY: as above; restores the thread's previous mode.
    unsafe { cu::cuThreadExchangeStreamCaptureMode(&mut mode) };
    r
}

/// Enqueue on `stream`, as one batch: write `value` to the trigger word, then (if given) wait
/// until the done word is `>=` its value. The write carries the default system-wide fence, so
/// whatever the stream wrote before is visible to the proxy and to peers first.
pub(crate) fn enqueue_trigger_wait(stream: usize, trigger: u64, value: u64, wait: Option<(u64, u64)>) -> Result<()> {
    // SAFETY: an all-zero memop descriptor is a valid starting point for every union member.
    let mut ops: [cu::CUstreamBatchMemOpParams; 2] = unsafe { std::mem::zeroed() };
    ops[0].writeValue.operation = cu::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64;
    ops[0].writeValue.address = trigger;
    ops[0].writeValue.__bindgen_anon_1.value64 = value;
    ops[0].writeValue.flags = 0;
    let mut count = 1;
    if let Some((done, at_least)) = wait {
        ops[1].waitValue.operation = cu::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_64;
        ops[1].waitValue.address = done;
        ops[1].waitValue.__bindgen_anon_1.value64 = at_least;
        ops[1].waitValue.flags = cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        count = 2;
    }
    // SAFETY: `ops` holds `count` initialized descriptors naming mapped page-locked words that
    // stay allocated while any stream may still use them (see `pinned`).
    check(unsafe { cu::cuStreamBatchMemOp_v2(raw(stream), count, ops.as_mut_ptr(), 0) }, "cuStreamBatchMemOp")
}

/// Enqueue on `stream` a write of `value` to the 64-bit word at device address `word`, with
/// the default system-wide memory barrier (what the stream did before is visible first).
pub(crate) fn enqueue_write_value(stream: usize, word: u64, value: u64) -> Result<()> {
    // SAFETY: as in `enqueue_trigger_wait`.
    let mut op: cu::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
    op.writeValue.operation = cu::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op.writeValue.address = word;
    op.writeValue.__bindgen_anon_1.value64 = value;
    op.writeValue.flags = 0;
    // SAFETY: one initialized descriptor naming a mapped host word its owner keeps mapped while
    // a stream may write it (`register_host`'s contract).
    check(unsafe { cu::cuStreamBatchMemOp_v2(raw(stream), 1, &mut op, 0) }, "cuStreamBatchMemOp")
}

/// Register `len` bytes of host memory at `host` (page aligned: a shared mapping) with
/// DEVICEMAP | PORTABLE, so every context's streams and kernels reach it; returns its device
/// address. Called on a user's thread (registration may wait for the device). Never undone: the
/// caller keeps the memory mapped until exit (unregistering could synchronize the device while
/// a stream waits on gscomm, and a stream may still write into it).
///
/// # Safety
/// `host..host + len` is a mapping the caller never unmaps.
pub(crate) unsafe fn register_host(device: i32, host: *mut u8, len: usize) -> Result<u64> {
    let ctx = copy::primary_context(device)?;
    let _scope = CtxScope::enter(ctx)?;
    let flags = cu::CU_MEMHOSTREGISTER_DEVICEMAP | cu::CU_MEMHOSTREGISTER_PORTABLE;
    with_relaxed_capture(|| {
        // SAFETY: the caller's promise on the range; flags are valid registration flags.
        check(unsafe { cu::cuMemHostRegister_v2(host.cast(), len, flags) }, "cuMemHostRegister")?;
        let mut dev: cu::CUdeviceptr = 0;
        // SAFETY: `host` was registered with DEVICEMAP just above.
        check(unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }, "cuMemHostGetDevicePointer")?;
        Ok(dev)
    })
}

/// Enqueue only a wait (`done >= value`) on `stream`.
pub(crate) fn enqueue_wait(stream: usize, done: u64, value: u64) -> Result<()> {
    // SAFETY: as in `enqueue_trigger_wait`.
    let mut op: cu::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
    op.waitValue.operation = cu::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_64;
    op.waitValue.address = done;
    op.waitValue.__bindgen_anon_1.value64 = value;
    op.waitValue.flags = cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: one initialized descriptor naming a live mapped word.
    check(unsafe { cu::cuStreamBatchMemOp_v2(raw(stream), 1, &mut op, 0) }, "cuStreamBatchMemOp")
}

/// Keep `value` alive as long as `graph` (and every graph instantiated from it): a CUDA user
/// object owned by the graph drops it when the last of them is destroyed.
pub(crate) fn tie_to_graph<T: Send + 'static>(graph: cu::CUgraph, value: T) -> Result<()> {
    unsafe extern "C" fn drop_boxed<T>(p: *mut std::ffi::c_void) {
        // SAFETY: `p` is the `Box<T>` leaked below, handed back exactly once by the driver.
        // Dropping it makes no CUDA call (the rule for user-object destructors).
        drop(unsafe { Box::from_raw(p as *mut T) });
    }
    let ptr = Box::into_raw(Box::new(value)) as *mut std::ffi::c_void;
    let mut obj: cu::CUuserObject = std::ptr::null_mut();
    let flags = cu::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32;
    // SAFETY: `ptr` stays valid until the destructor runs; the driver calls it once.
    let r = unsafe { cu::cuUserObjectCreate(&mut obj, ptr, Some(drop_boxed::<T>), 1, flags) };
    if let Err(e) = check(r, "cuUserObjectCreate") {
        // SAFETY: the driver did not take the pointer.
        drop(unsafe { Box::from_raw(ptr as *mut T) });
        return Err(e);
    }
    let mv = cu::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32;
    // SAFETY: `graph` is the user's live graph; the reference moves to it.
    check(unsafe { cu::cuGraphRetainUserObject(graph, obj, 1, mv) }, "cuGraphRetainUserObject")
}

/// Streaming multiprocessors of `device`.
pub(crate) fn sm_count(device: i32) -> Result<usize> {
    let mut v = 0;
    // SAFETY: a valid out-pointer; `device` is an ordinal of a device the caller uses.
    check(
        unsafe { cu::cuDeviceGetAttribute(&mut v, cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device) },
        "cuDeviceGetAttribute (multiprocessors)",
    )?;
    Ok(v.max(1) as usize)
}

/// Compute capability (major, minor) of `device`.
pub(crate) fn device_arch(device: i32) -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    use cu::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJ, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MIN,
    };
    // SAFETY: valid out-pointers; `device` is an ordinal of a device the caller uses.
    check(unsafe { cu::cuDeviceGetAttribute(&mut major, MAJ, device) }, "cuDeviceGetAttribute (compute capability)")?;
    // SAFETY: as above.
    check(unsafe { cu::cuDeviceGetAttribute(&mut minor, MIN, device) }, "cuDeviceGetAttribute (compute capability)")?;
    Ok((major, minor))
}

/// Compute capability (major, minor) of the context's device.
pub(crate) fn context_arch(ctx: cu::CUcontext) -> Result<(i32, i32)> {
    let _scope = CtxScope::enter(ctx)?;
    let mut dev: cu::CUdevice = 0;
    // SAFETY: a valid out-pointer, with `ctx` current.
    check(unsafe { cu::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    device_arch(dev)
}

/// Launch `gsc_ops_kernel` on `stream` (captured into graph nodes when the stream is being
/// captured): trigger `trig`, then wait for `wait`. Lists longer than `GROUP_MAX` take several
/// launches, every trigger before any wait. `fence`: a system fence before the triggers (one of
/// them sends data that carries no flags of its own, see `gsc_ops_args_t`).
pub(crate) fn launch_ops(k: &Kernels, stream: usize, trig: &[OpDesc], wait: &[OpDesc], fence: bool) -> Result<()> {
    for args in ops_chunks(trig, wait, fence) {
        launch_struct(k.ops, stream, &args)?;
    }
    Ok(())
}

/// Add `gsc_ops_kernel` nodes for (`trig`, `wait`) to `graph` after `deps`, in a chain; returns
/// the first and the last node. `fence` as for `launch_ops`.
pub(crate) fn add_ops_nodes(
    k: &Kernels,
    graph: cu::CUgraph,
    trig: &[OpDesc],
    wait: &[OpDesc],
    deps: &[cu::CUgraphNode],
    fence: bool,
) -> Result<(cu::CUgraphNode, cu::CUgraphNode)> {
    let mut first: Option<cu::CUgraphNode> = None;
    let mut last: Option<cu::CUgraphNode> = None;
    for mut args in ops_chunks(trig, wait, fence) {
        let mut params = [&mut args as *mut OpsArgs as *mut std::ffi::c_void];
        // SAFETY: zero is a valid value for every field (null pointers, no extra).
        let mut p: cu::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        p.func = k.ops;
        (p.gridDimX, p.gridDimY, p.gridDimZ) = (1, 1, 1);
        (p.blockDimX, p.blockDimY, p.blockDimZ) = (THREADS, 1, 1);
        p.kernelParams = params.as_mut_ptr();
        let after: Vec<cu::CUgraphNode> = last.map_or_else(|| deps.to_vec(), |n| vec![n]);
        let mut node: cu::CUgraphNode = std::ptr::null_mut();
        // SAFETY: the user's live graph, `after` nodes of it, and parameters the driver copies
        // (`args` matches the kernel's one by-value parameter).
        check(unsafe { cu::cuGraphAddKernelNode_v2(&mut node, graph, after.as_ptr(), after.len(), &p) }, "cuGraphAddKernelNode")?;
        first.get_or_insert(node);
        last = Some(node);
    }
    match (first, last) {
        (Some(f), Some(l)) => Ok((f, l)),
        _ => Err(Error::new(Status::Internal, "a graph node pair with nothing to trigger or wait for")),
    }
}

/// (`trig`, `wait`) cut into kernel arguments of at most `GROUP_MAX` each: all-in-one when both
/// fit, else the triggers' chunks first, then the waits'.
fn ops_chunks(trig: &[OpDesc], wait: &[OpDesc], fence: bool) -> Vec<OpsArgs> {
    let fence = u64::from(fence && !trig.is_empty());
    if trig.len() <= GROUP_MAX && wait.len() <= GROUP_MAX {
        return vec![OpsArgs { trig: OpList::of(trig), wait: OpList::of(wait), fence }];
    }
    let t = trig.chunks(GROUP_MAX).map(|c| OpsArgs { trig: OpList::of(c), fence, ..Default::default() });
    t.chain(wait.chunks(GROUP_MAX).map(|c| OpsArgs { wait: OpList::of(c), ..Default::default() })).collect()
}

/// Launch `gsc_seq_kernel` on `stream`: copy the staged sends `out` into their slots, write
/// `trigger` (word, value), wait for `wait` (word, value), copy the staged receives `inn` out of
/// their slots. Longer lists than `GROUP_MAX` take extra launches: copies before the trigger,
/// copies after the wait. `fence` as for `launch_ops`.
pub(crate) fn launch_seq(
    k: &Kernels,
    stream: usize,
    trigger: Option<(u64, u64)>,
    wait: Option<(u64, u64)>,
    out: &[OpDesc],
    inn: &[OpDesc],
    fence: bool,
) -> Result<()> {
    for args in seq_chunks(trigger, wait, out, inn, fence) {
        launch_stream_kernel(k, k.seq, stream, Grid::of(1), &args)?;
    }
    Ok(())
}

/// A plain trigger and/or wait on `stream` as one one-thread kernel (`gsc_sync_kernel`): see
/// `GSC_CUDA_WAIT_KERNEL` for why not memops.
pub(crate) fn launch_sync(k: &Kernels, stream: usize, trigger: Option<(u64, u64)>, wait: Option<(u64, u64)>, fence: bool) -> Result<()> {
    let (trigger, tval) = trigger.unwrap_or((0, 0));
    let (done, wval) = wait.unwrap_or((0, 0));
    let args = SyncArgs { trigger, tval, done, wval, fence: u64::from(fence && trigger != 0) };
    // The words are mapped page-locked memory that outlives any stream using it (`pinned`).
    launch_stream_kernel(k, k.sync, stream, Grid { blocks: 1, threads: 1 }, &args)
}

/// Launch one of the stream conditions' kernels (`gsc_seq_kernel`, `gsc_sync_kernel`): with
/// programmatic dependent launch where `GSC_CUDA_PDL` allows it and the GPU has it
/// (`Kernels::stream_pdl`). When the previous kernel on the stream is one of ours (a round's
/// wait, then the next round's trigger), it lets this one be scheduled as soon as its wait is
/// over, so this one starts as that one ends rather than a launch latency later. Both kernels
/// wait for the previous kernel first thing (`gsc_wait_previous_kernel`), so the stream's order
/// is kept; after a kernel of the user's, which does not let them start early, they start at
/// its end, as before.
fn launch_stream_kernel<T>(k: &Kernels, f: cu::CUfunction, stream: usize, grid: Grid, args: &T) -> Result<()> {
    match k.stream_pdl {
        true => launch_struct_grid_pdl(f, stream, grid, args),
        false => launch_struct_grid(f, stream, grid, args),
    }
}

fn seq_chunks(trigger: Option<(u64, u64)>, wait: Option<(u64, u64)>, out: &[OpDesc], inn: &[OpDesc], fence: bool) -> Vec<SeqArgs> {
    let (tail_out, head_out) = split_last_chunk(out);
    let (head_in, tail_in) = split_first_chunk(inn);
    let mut v: Vec<SeqArgs> = head_out.chunks(GROUP_MAX).map(|c| SeqArgs { out: OpList::of(c), ..Default::default() }).collect();
    let (trigger, tval) = trigger.unwrap_or((0, 0));
    let (done, wval) = wait.unwrap_or((0, 0));
    let fence = u64::from(fence && trigger != 0);
    v.push(SeqArgs { trigger, tval, done, wval, fence, out: OpList::of(tail_out), inn: OpList::of(head_in) });
    v.extend(tail_in.chunks(GROUP_MAX).map(|c| SeqArgs { inn: OpList::of(c), ..Default::default() }));
    v
}

/// (the last chunk of at most GROUP_MAX, what comes before it)
fn split_last_chunk(ops: &[OpDesc]) -> (&[OpDesc], &[OpDesc]) {
    let cut = ops.len().saturating_sub(GROUP_MAX);
    (&ops[cut..], &ops[..cut])
}

/// (the first chunk of at most GROUP_MAX, what comes after it)
fn split_first_chunk(ops: &[OpDesc]) -> (&[OpDesc], &[OpDesc]) {
    ops.split_at(ops.len().min(GROUP_MAX))
}

/// The grid of a prepared transfer's round: a send's copy takes up to 32 blocks, one per
/// 64 KiB; every other role is one block.
fn prep_blocks(args: &PrepArgs) -> u32 {
    if args.role == PREP_SEND { args.len.div_ceil(64 << 10).clamp(1, 32) as u32 } else { 1 }
}

/// Launch a prepared transfer's round (`gsc_prep_kernel`) on `stream` (a kernel node when it is
/// being captured, else a replayed one-node graph: `replay`), on a grid of `prep_blocks`.
pub(crate) fn launch_prep(k: &Kernels, stream: usize, args: &PrepArgs) -> Result<()> {
    replay::launch(k.ctx, k.prep, stream, Grid::of(prep_blocks(args)), args)
}

/// Add a prepared transfer's round (`gsc_prep_kernel`, grid as for `launch_prep`) to `graph` as
/// one kernel node without dependencies; the user wires it. A plain node, no programmatic
/// dependent launch: the kernel's `gsc_after_previous_kernel` is a no-op without a PDL edge.
pub(crate) fn add_prep_node(k: &Kernels, graph: cu::CUgraph, args: &PrepArgs) -> Result<cu::CUgraphNode> {
    // The driver only reads (and copies) the parameter.
    let mut params = [args as *const PrepArgs as *mut std::ffi::c_void];
    // SAFETY: zero is a valid value for every field (null pointers, no extra).
    let mut p: cu::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    p.func = k.prep;
    (p.gridDimX, p.gridDimY, p.gridDimZ) = (prep_blocks(args), 1, 1);
    (p.blockDimX, p.blockDimY, p.blockDimZ) = (THREADS, 1, 1);
    p.kernelParams = params.as_mut_ptr();
    let mut node: cu::CUgraphNode = std::ptr::null_mut();
    // SAFETY: the user's live graph, no dependencies, and parameters the driver copies (`args`
    // matches the kernel's one by-value parameter).
    check(unsafe { cu::cuGraphAddKernelNode_v2(&mut node, graph, std::ptr::null(), 0, &p) }, "cuGraphAddKernelNode")?;
    Ok(node)
}

/// Sends larger than this in a group get a launch (and a grid) of their own.
pub(crate) const PREP_FUSED_SEND_MAX: u64 = 64 << 10;

/// Launch the rounds of a group, in order: runs of single-block steps fused into one
/// `gsc_prep_group_kernel` each (up to PREP_GROUP_MAX), large sends on their own.
pub(crate) fn launch_prep_group(k: &Kernels, stream: usize, ops: &[PrepArgs]) -> Result<()> {
    let mut run: Vec<PrepArgs> = Vec::new();
    let flush = |run: &mut Vec<PrepArgs>| -> Result<()> {
        if run.is_empty() {
            return Ok(());
        }
        let mut g = PrepGroup { n: run.len() as u64, ..Default::default() };
        g.op[..run.len()].copy_from_slice(run);
        run.clear();
        replay::launch(k.ctx, k.prep_group, stream, Grid::of(1), &g)
    };
    for op in ops {
        if op.role == PREP_SEND && op.len > PREP_FUSED_SEND_MAX {
            flush(&mut run)?;
            launch_prep(k, stream, op)?;
            continue;
        }
        run.push(*op);
        if run.len() == PREP_GROUP_MAX {
            flush(&mut run)?;
        }
    }
    flush(&mut run)
}

/// A launch's shape: `blocks` blocks of `threads`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Grid {
    pub(crate) blocks: u32,
    pub(crate) threads: u32,
}

impl Grid {
    /// `blocks` blocks of our kernels' usual `THREADS`.
    pub(crate) fn of(blocks: u32) -> Grid {
        Grid { blocks, threads: THREADS }
    }
}

/// Launch one of our kernels, one block of `THREADS`, with `args` as its one by-value parameter.
fn launch_struct<T>(f: cu::CUfunction, stream: usize, args: &T) -> Result<()> {
    launch_struct_grid(f, stream, Grid::of(1), args)
}

pub(super) fn launch_struct_grid<T>(f: cu::CUfunction, stream: usize, grid: Grid, args: &T) -> Result<()> {
    let mut params = [args as *const T as *mut std::ffi::c_void];
    // SAFETY: `f` takes exactly one parameter laid out as `T` (repr(C) mirrors of the kernels'
    // structs); the driver copies it from `args` during the call.
    check(
        unsafe { cu::cuLaunchKernel(f, grid.blocks, 1, 1, grid.threads, 1, 1, 0, raw(stream), params.as_mut_ptr(), std::ptr::null_mut()) },
        "cuLaunchKernel",
    )
}

/// `GSC_CUDA_WAIT_KERNEL`, read once per process (conditions have no context configuration at
/// hand): whether a plain stream's trigger and wait are a kernel rather than stream memops.
pub(crate) fn wait_kernel_mode() -> crate::config::Tristate {
    static MODE: OnceLock<crate::config::Tristate> = OnceLock::new();
    *MODE.get_or_init(|| crate::config::Config::load_env().map_or(crate::config::Tristate::Auto, |l| l.config.cuda_wait_kernel))
}

/// Whether captured GPU rounds use programmatic dependent launch (`GSC_CUDA_PDL`, read once
/// per process: the launch layer has no context configuration at hand).
pub(super) fn pdl_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::config::Config::load_env().map_or(true, |l| l.config.cuda_pdl != crate::config::Tristate::Off))
}

/// `launch_struct_grid` with programmatic stream serialization: the kernel may be scheduled
/// before the previous one on the stream ends (once that one calls
/// `griddepcontrol.launch_dependents`, or ends); the kernel itself waits for it with
/// `griddepcontrol.wait` before it touches anything (our prep kernels do, first thing). Under
/// capture this makes a programmatic edge, so a replay overlaps a round's launch with the
/// previous round.
pub(super) fn launch_struct_grid_pdl<T>(f: cu::CUfunction, stream: usize, grid: Grid, args: &T) -> Result<()> {
    let mut params = [args as *const T as *mut std::ffi::c_void];
    // SAFETY: zero is a valid attribute (then set below).
    let mut attr: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = cu::CUlaunchConfig {
        gridDimX: grid.blocks,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: grid.threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: raw(stream),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: as `launch_struct_grid`; `config` and its one attribute outlive the call.
    check(unsafe { cu::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }, "cuLaunchKernelEx")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(n: usize) -> Vec<OpDesc> {
        (0..n).map(|i| OpDesc { handle: i as u64 + 1, ..Default::default() }).collect()
    }

    #[test]
    fn kernel_arguments_match_the_cuda_structs() {
        // gsc_op_t: 5 x 8 bytes; gsc_ops_t: n + 8 ops; the kernels take them by value.
        assert_eq!(std::mem::size_of::<OpDesc>(), 40);
        assert_eq!(std::mem::size_of::<OpList>(), 8 + 40 * GROUP_MAX);
        assert_eq!(std::mem::size_of::<OpsArgs>(), 2 * std::mem::size_of::<OpList>() + 8);
        assert_eq!(std::mem::size_of::<SeqArgs>(), 40 + 2 * std::mem::size_of::<OpList>());
        assert_eq!(std::mem::offset_of!(SeqArgs, out), 40, "fence follows wval");
        assert_eq!(std::mem::offset_of!(OpsArgs, fence), 2 * std::mem::size_of::<OpList>());
        assert!(std::mem::size_of::<SeqArgs>() < 4096, "kernel parameters are limited to 4 KiB");
    }

    #[test]
    fn ops_fit_one_launch_or_split_triggers_before_waits() {
        let one = ops_chunks(&ops(3), &ops(8), true);
        assert_eq!(one.len(), 1);
        assert_eq!((one[0].trig.n, one[0].wait.n, one[0].fence), (3, 8, 1));
        let many = ops_chunks(&ops(9), &ops(2), true);
        let shape: Vec<(u64, u64, u64)> = many.iter().map(|a| (a.trig.n, a.wait.n, a.fence)).collect();
        assert_eq!(shape, vec![(8, 0, 1), (1, 0, 1), (0, 2, 0)], "every triggering launch fences, waits do not");
        assert_eq!(ops_chunks(&[], &ops(1), true)[0].fence, 0, "nothing to trigger, nothing to order");
    }

    #[test]
    fn seq_copies_out_before_the_trigger_and_in_after_the_wait() {
        let one = seq_chunks(Some((100, 5)), Some((200, 5)), &ops(2), &ops(1), true);
        assert_eq!(one.len(), 1);
        assert_eq!((one[0].trigger, one[0].tval, one[0].done, one[0].wval, one[0].fence), (100, 5, 200, 5, 1));
        let many = seq_chunks(Some((100, 5)), Some((200, 7)), &ops(10), &ops(17), false);
        let shape: Vec<(u64, u64, u64, u64)> = many.iter().map(|a| (a.trigger, a.done, a.out.n, a.inn.n)).collect();
        // 10 sends: 2 copied by a first launch, 8 by the triggering one; 17 receives: 8 copied by
        // the waiting launch, then 8 and 1 after it.
        assert_eq!(shape, vec![(0, 0, 2, 0), (100, 200, 8, 8), (0, 0, 0, 8), (0, 0, 0, 1)]);
        assert_eq!(many[1].out.op[0].handle, 3, "the triggering launch copies the last sends");
        let none = seq_chunks(None, Some((200, 7)), &[], &ops(1), true);
        assert_eq!(none[0].fence, 0, "a wait alone orders nothing");
        assert_eq!((none[0].trigger, none[0].done, none[0].inn.n), (0, 200, 1));
    }
}
