//! Small safe wrappers over the driver for gscomm's GPU tests, examples and gsc-bench: pick a
//! device, make streams, page-locked buffers and device buffers, compile and launch kernels,
//! build, capture and replay graphs. Not a general CUDA binding: just what those programs need,
//! so they do not each carry their own unsafe driver calls.

use super::{check, cu, init, raw};
use crate::error::Result;

/// Make device `ordinal`'s primary context current on the calling thread.
pub fn set_device(ordinal: i32) -> Result<()> {
    init()?;
    let mut dev: cu::CUdevice = 0;
    // SAFETY: valid out-pointers throughout.
    check(unsafe { cu::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet")?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    check(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain")?;
    check(unsafe { cu::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")
}

/// The device of the calling thread's current context (what the CUDA runtime calls the
/// current device); device 0's primary context is made current when there is none, as the
/// runtime does.
pub fn current_device() -> Result<i32> {
    init()?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check(unsafe { cu::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
    if ctx.is_null() {
        set_device(0)?;
        return Ok(0);
    }
    let mut dev: cu::CUdevice = 0;
    // SAFETY: a valid out-pointer; a context is current.
    check(unsafe { cu::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    Ok(dev)
}

/// (free, total) bytes of device memory on the current device, as the driver counts them (for
/// all processes: memory a peer still maps after its owner freed it counts as used).
pub fn mem_get_info() -> Result<(usize, usize)> {
    current_device()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; a context is current (`current_device` made sure).
    check(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
    Ok((free, total))
}

/// At least `len` bytes of device memory on the current device, from gscomm's allocator
/// (`cuda::alloc`): CUDA VMM memory shareable as a POSIX file descriptor, accessible from every
/// GPU of this process that can reach it, or `cuMemAlloc` where the device cannot do that (the
/// reason is logged). What `ncclMemAlloc` returns; carve one allocation into several buffers
/// (at the same offsets on every rank) and a peer process maps it once. Free with `mem_free`.
pub fn mem_alloc(len: usize) -> Result<u64> {
    super::alloc::alloc(len)
}

/// Free memory from `mem_alloc`. 0 is a no-op. An address `mem_alloc` did not return, one inside
/// an allocation, or one already freed, is refused with `InvalidParam` and nothing changes.
///
/// # Safety
/// No work (kernels, copies, a peer's pending read) still uses the memory.
pub unsafe fn mem_free(ptr: u64) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { super::alloc::free(ptr) }
}

pub use super::alloc::MemAllocInfo;

/// The live `mem_alloc` allocation `addr` lies in (its base, the offset of `addr`, whether it is
/// VMM memory), or `None` for memory `mem_alloc` did not make.
pub fn mem_alloc_info(addr: u64) -> Option<MemAllocInfo> {
    super::alloc::info(addr)
}

/// How many `mem_alloc` allocations are live in this process.
pub fn mem_alloc_live() -> usize {
    super::alloc::live()
}

/// Copy `data` to device memory at `ptr` (synchronous; for tests and tools that hold raw
/// pointers, e.g. from `mem_alloc`).
///
/// # Safety
/// `ptr..ptr + data.len()` is device memory this process may write, unused by other work.
pub unsafe fn copy_to_device(ptr: u64, data: &[u8]) -> Result<()> {
    current_device()?;
    // SAFETY: the caller's contract; `data` is readable for the whole call.
    check(unsafe { cu::cuMemcpyHtoD_v2(ptr, data.as_ptr() as *const _, data.len()) }, "cuMemcpyHtoD")?;
    // From pageable memory the copy may return before the DMA is done (see `DeviceBuf::upload`).
    // SAFETY: no arguments.
    check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// `len` bytes of device memory at `ptr` (synchronous).
///
/// # Safety
/// `ptr..ptr + len` is device memory this process may read.
pub unsafe fn copy_from_device(ptr: u64, len: usize) -> Result<Vec<u8>> {
    current_device()?;
    let mut v = vec![0u8; len];
    // SAFETY: `v` holds `len` writable bytes; the source is the caller's.
    check(unsafe { cu::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut _, ptr, len) }, "cuMemcpyDtoH")?;
    Ok(v)
}

/// Number of GPUs (0 when the driver is missing).
pub fn device_count() -> i32 {
    if init().is_err() {
        return 0;
    }
    let mut n = 0;
    // SAFETY: a valid out-pointer.
    unsafe { cu::cuDeviceGetCount(&mut n) };
    n
}

/// A non-blocking stream of the current context.
pub struct Stream(usize);

impl Stream {
    pub fn new() -> Result<Stream> {
        let mut s: cu::CUstream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flag 1 = CU_STREAM_NON_BLOCKING.
        check(unsafe { cu::cuStreamCreate(&mut s, 1) }, "cuStreamCreate")?;
        Ok(Stream(s as usize))
    }
    /// The CUstream, as gscomm conditions take it.
    pub fn raw(&self) -> usize {
        self.0
    }
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: our live stream.
        check(unsafe { cu::cuStreamSynchronize(raw(self.0)) }, "cuStreamSynchronize")
    }
    /// Whether everything enqueued on the stream so far has finished (`cuStreamQuery`; never
    /// waits).
    pub fn query(&self) -> Result<bool> {
        // SAFETY: our live stream.
        match unsafe { cu::cuStreamQuery(raw(self.0)) } {
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, "cuStreamQuery").map(|()| true),
        }
    }
    pub fn begin_capture(&self) -> Result<()> {
        // SAFETY: our live stream; mode 2 = CU_STREAM_CAPTURE_MODE_RELAXED.
        check(
            unsafe { cu::cuStreamBeginCapture_v2(raw(self.0), cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) },
            "cuStreamBeginCapture",
        )
    }
    pub fn end_capture(&self) -> Result<Graph> {
        let mut g: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: our stream, being captured; a valid out-pointer.
        check(unsafe { cu::cuStreamEndCapture(raw(self.0), &mut g) }, "cuStreamEndCapture")?;
        Ok(Graph(g as usize))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: our stream, destroyed once.
        unsafe { cu::cuStreamDestroy_v2(raw(self.0)) };
    }
}

/// Page-locked host memory mapped into the device: kernels and the host both use it.
pub struct PinnedBuf {
    host: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: plain memory owned by this value.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    pub fn new(len: usize) -> Result<PinnedBuf> {
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: valid out-pointers; freed in Drop.
        check(unsafe { cu::cuMemHostAlloc(&mut host, len.max(1), flags) }, "cuMemHostAlloc")?;
        let mut dev: cu::CUdeviceptr = 0;
        check(unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }, "cuMemHostGetDevicePointer")?;
        // SAFETY: fresh allocation of at least `len` bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, len) };
        Ok(PinnedBuf { host: host as *mut u8, dev, len })
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }
    /// A copy of the contents (read with volatile loads: a kernel may have written them).
    pub fn to_vec(&self) -> Vec<u8> {
        // SAFETY: `len` readable bytes; the caller has synchronized with any writer.
        (0..self.len).map(|i| unsafe { std::ptr::read_volatile(self.host.add(i)) }).collect()
    }
    pub fn write(&self, data: &[u8]) {
        assert!(data.len() <= self.len);
        // SAFETY: in bounds; the caller has synchronized with any reader.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.host, data.len()) };
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
        unsafe { cu::cuMemFreeHost(self.host as *mut _) };
    }
}

/// Device memory of the current context, freed on drop: `cuMemAlloc` (`new`) or a VMM allocation
/// (`new_vmm`).
pub struct DeviceBuf {
    ptr: u64,
    len: usize,
    /// `Some` for a VMM allocation (unmapped, released and its range freed on drop).
    vmm: Option<super::vmm::Owned>,
}

// SAFETY: a device allocation owned by this value; usable from any thread.
unsafe impl Send for DeviceBuf {}

impl DeviceBuf {
    pub fn new(len: usize) -> Result<DeviceBuf> {
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: a valid out-pointer; freed in Drop.
        check(unsafe { cu::cuMemAlloc_v2(&mut ptr, len.max(1)) }, "cuMemAlloc")?;
        Ok(DeviceBuf { ptr, len, vmm: None })
    }
    /// `len` bytes of a VMM allocation on the current context's device, made the way PyTorch's
    /// expandable segments and NCCL's cuMem allocator make theirs: `cuMemCreate` (with
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested, so it can be shared with another
    /// process), `cuMemAddressReserve`, `cuMemMap` and `cuMemSetAccess` (read/write for this
    /// device). The allocation is rounded up to the granularity; `len()` is what was asked.
    pub fn new_vmm(len: usize) -> Result<DeviceBuf> {
        DeviceBuf::new_vmm_at(len, 0)
    }
    /// `new_vmm`, mapped at `at` if that address range is free (the driver takes it as a hint:
    /// `ptr()` says where it landed). New memory in a range that held a freed allocation, as
    /// PyTorch's expandable segments map it: a peer that had mapped the old one must notice.
    pub fn new_vmm_at(len: usize, at: u64) -> Result<DeviceBuf> {
        let owned = super::vmm::Owned::new(len, at)?;
        Ok(DeviceBuf { ptr: owned.ptr, len, vmm: Some(owned) })
    }
    /// Whether this is a VMM allocation (`new_vmm`).
    pub fn is_vmm(&self) -> bool {
        self.vmm.is_some()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address (what kernels and gscomm operations take).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Copy `data` to the start of the buffer (synchronous).
    pub fn upload(&self, data: &[u8]) -> Result<()> {
        assert!(data.len() <= self.len);
        // SAFETY: in bounds of our allocation; `data` is readable for the whole call.
        check(unsafe { cu::cuMemcpyHtoD_v2(self.ptr, data.as_ptr() as *const _, data.len()) }, "cuMemcpyHtoD")?;
        // From pageable memory the copy returns once the bytes are staged, before the DMA has
        // written the buffer; a non-blocking stream does not wait for it. Found on the device:
        // a kernel launched right after read the previous contents.
        // SAFETY: no arguments.
        check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
    /// Set every byte to `value` (synchronous).
    pub fn fill(&self, value: u8) -> Result<()> {
        // SAFETY: exactly our allocation.
        check(unsafe { cu::cuMemsetD8_v2(self.ptr, value, self.len) }, "cuMemsetD8")?;
        // SAFETY: no arguments; waits for the memset (which runs on the legacy stream).
        check(unsafe { cu::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
    /// The contents (synchronous).
    pub fn download(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        // SAFETY: `v` holds `len` writable bytes; the source is our allocation.
        check(unsafe { cu::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut _, self.ptr, self.len) }, "cuMemcpyDtoH")?;
        Ok(v)
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if let Some(vmm) = self.vmm.take() {
            // Unmaps, releases the physical memory, then frees the address range.
            drop(vmm);
            return;
        }
        // SAFETY: allocated in `new`, freed once.
        unsafe { cu::cuMemFree_v2(self.ptr) };
    }
}

/// Process-wide counts of GPU memory shared as VMM file descriptors (for tests and tools: they
/// tell a read through CUDA IPC from a push through host memory).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct VmmCounters {
    /// VMM allocations this process exported (a descriptor made and served), counted once each.
    pub exported: u64,
    /// Peer VMM allocations this process imported and mapped, once per allocation and GPU.
    pub imported: u64,
    /// Reads of peer memory that went through such a mapping (one per rendezvous read).
    pub reads: u64,
    /// Mappings unmapped (2 s later) because the peer freed their allocation and made a new one at
    /// the same address (legacy mappings are retired instead: `release_retired_peer_mappings`).
    pub replaced: u64,
    /// Mappings unmapped because the peer freed their allocation (the peer tells, through its
    /// liveness table; legacy mappings are retired instead: `release_retired_peer_mappings`).
    pub freed: u64,
}

pub fn vmm_counters() -> VmmCounters {
    use super::vmm;
    VmmCounters { exported: vmm::exports(), imported: vmm::imports(), reads: vmm::reads(), replaced: vmm::replaced(), freed: vmm::freed() }
}

/// How a GPU buffer at `ptr` would be described to a peer process when sent: `"legacy"` (a CUDA
/// IPC handle) or `"vmm"` (a VMM allocation shared as a file descriptor), or the error that
/// makes the data go through host memory instead. Exports it as a send would (cached).
pub fn ipc_export_kind(ptr: u64) -> Result<&'static str> {
    let p = super::memory::device_ptr(ptr as usize)?
        .ok_or_else(|| crate::Error::invalid_param("not device memory (or the driver is not loaded in this process)"))?;
    Ok(match super::ipc::export(ptr as usize, p)?.kind {
        super::ipc::KeyKind::Legacy(_) => "legacy",
        super::ipc::KeyKind::Vmm(_) => "vmm",
        super::ipc::KeyKind::SameProcess => "same-process",
    })
}

/// Close the legacy (`cuIpcOpenMemHandle`) mappings of peer GPU allocations that the peers have
/// since freed (and told, or replaced), kept until now because closing one synchronizes the
/// device (VMM mappings are unmapped then: `VmmCounters::replaced`, `VmmCounters::freed`).
/// Call it only where no stream waits on a gscomm operation and no thread of the process is
/// inside a group of calls, e.g. after synchronizing every stream that has conditions on it.
/// Returns how many were closed.
pub fn release_retired_peer_mappings() -> Result<usize> {
    super::ipc::release_retired()
}

/// Kernels compiled from CUDA C source (NVRTC, disk-cached) for the current context.
pub struct Module(cu::CUmodule);

impl Module {
    pub fn compile(source: &str) -> Result<Module> {
        let ctx = super::current_context()?;
        let arch = super::context_arch(ctx)?;
        let cubin = super::kernels::compile_cached(source, arch, None)?;
        Ok(Module(super::kernels::load_module(&cubin)?))
    }
    pub fn function(&self, name: &str) -> Result<Function> {
        Ok(Function(super::kernels::function(self.0, name)? as usize))
    }
}

#[derive(Copy, Clone)]
pub struct Function(usize);

impl Function {
    /// Launch with 8-byte arguments (pointers, 64-bit integers).
    pub fn launch(&self, grid: u32, block: u32, stream: &Stream, args: &[u64]) -> Result<()> {
        let mut vals = args.to_vec();
        let mut ptrs: Vec<*mut std::ffi::c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut _).collect();
        // SAFETY: the kernel's parameters are `args.len()` 8-byte values (the caller's promise);
        // the driver copies them during the call.
        check(
            unsafe { cu::cuLaunchKernel(raw(self.0), grid, 1, 1, block, 1, 1, 0, raw(stream.0), ptrs.as_mut_ptr(), std::ptr::null_mut()) },
            "cuLaunchKernel",
        )
    }
}

/// A CUDA graph (destroyed on drop; gscomm's nodes in it stay valid for its instances).
pub struct Graph(usize);

impl Graph {
    pub fn new() -> Result<Graph> {
        let mut g: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check(unsafe { cu::cuGraphCreate(&mut g, 0) }, "cuGraphCreate")?;
        Ok(Graph(g as usize))
    }
    /// The CUgraph, as a graph condition takes it.
    pub fn raw(&self) -> usize {
        self.0
    }
    /// Add a kernel node after `deps` (CUgraphNode addresses).
    pub fn add_kernel(&self, f: Function, grid: u32, block: u32, args: &[u64], deps: &[usize]) -> Result<usize> {
        let mut vals = args.to_vec();
        let mut ptrs: Vec<*mut std::ffi::c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut _).collect();
        // SAFETY: zero is valid for every field.
        let mut p: cu::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        p.func = raw(f.0);
        (p.gridDimX, p.gridDimY, p.gridDimZ) = (grid, 1, 1);
        (p.blockDimX, p.blockDimY, p.blockDimZ) = (block, 1, 1);
        p.kernelParams = ptrs.as_mut_ptr();
        let deps: Vec<cu::CUgraphNode> = deps.iter().map(|&d| raw(d)).collect();
        let mut node: cu::CUgraphNode = std::ptr::null_mut();
        // SAFETY: our graph, nodes of it, parameters copied by the driver.
        check(unsafe { cu::cuGraphAddKernelNode_v2(&mut node, raw(self.0), deps.as_ptr(), deps.len(), &p) }, "cuGraphAddKernelNode")?;
        Ok(node as usize)
    }
    /// Make `to` depend on `from` (both nodes of this graph).
    pub fn add_dependency(&self, from: usize, to: usize) -> Result<()> {
        let (f, t): (cu::CUgraphNode, cu::CUgraphNode) = (raw(from), raw(to));
        // SAFETY: two nodes of our graph; no edge data.
        check(unsafe { cu::cuGraphAddDependencies_v2(raw(self.0), &f, &t, std::ptr::null(), 1) }, "cuGraphAddDependencies")
    }
    pub fn instantiate(&self) -> Result<GraphExec> {
        let mut e: cu::CUgraphExec = std::ptr::null_mut();
        // SAFETY: our graph; a valid out-pointer.
        check(unsafe { cu::cuGraphInstantiateWithFlags(&mut e, raw(self.0), 0) }, "cuGraphInstantiate")?;
        Ok(GraphExec(e as usize))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: our graph, destroyed once.
        unsafe { cu::cuGraphDestroy(raw(self.0)) };
    }
}

pub struct GraphExec(usize);

impl GraphExec {
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        // SAFETY: our executable graph and a live stream.
        check(unsafe { cu::cuGraphLaunch(raw(self.0), raw(stream.0)) }, "cuGraphLaunch")
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: ours, destroyed once.
        unsafe { cu::cuGraphExecDestroy(raw(self.0)) };
    }
}

/// Why GPU tests cannot run here, or `None` when they can (`GSC_TEST_GPU=1` and a GPU).
pub fn gpu_test_skip_reason() -> Option<String> {
    if std::env::var("GSC_TEST_GPU").ok().as_deref() != Some("1") {
        return Some("GSC_TEST_GPU is not 1 (GPU tests run on the device machines)".into());
    }
    match init() {
        Ok(()) => None,
        Err(e) => Some(format!("no usable GPU: {e}")),
    }
}
