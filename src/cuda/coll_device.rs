//! Small collectives run by the triggering thread itself (`collectives::triggered`): the
//! `gsc_coll_device_t` descriptor a handle points at, and the mailbox its peers write into,
//! both in GPU memory of the communicator's device (include/gsc_device.cuh has the protocol).

use super::coll::MAX_RANKS;
use super::copy::primary_context;
use super::{CtxScope, check, cu};
use crate::error::Result;

/// `gsc_coll_device_t`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct CollDevice {
    /// Every rank's mailbox, as this rank addresses it.
    pub(crate) boxes: [u64; MAX_RANKS],
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) bytes: u64,
    /// LL words per slot: `bytes` / 4, rounded up.
    pub(crate) words: u64,
    /// gsc_datatype_t and gsc_red_op_t values (NCCL's).
    pub(crate) dtype: u64,
    pub(crate) op: u64,
    pub(crate) nranks: u64,
    pub(crate) rank: u64,
    pub(crate) timeout_ns: u64,
    /// The last round begun: 0 on every rank when armed.
    pub(crate) round: u64,
    /// The communicator's abort word (page-locked, device address) and error word.
    pub(crate) abort: u64,
    pub(crate) error: u64,
}
// The header's GSC_DEVICE_MAX_RANKS boxes, then 12 words: no padding anywhere.
const _: () = assert!(MAX_RANKS == 8 && std::mem::size_of::<CollDevice>() == (MAX_RANKS + 12) * 8);

impl CollDevice {
    /// Mailbox bytes of a collective of `bytes` on `nranks`: two slots of LL words per sender.
    pub(crate) fn mailbox_bytes(nranks: usize, bytes: usize) -> usize {
        nranks * 2 * bytes.div_ceil(4) * 8
    }
}

/// GPU memory of one device, freed on drop (a collective's mailbox or descriptor).
pub(crate) struct DeviceMemory {
    device: i32,
    addr: u64,
}

impl DeviceMemory {
    /// `len` zeroed bytes on `device`.
    pub(crate) fn zeroed(device: i32, len: usize) -> Result<DeviceMemory> {
        let mem = DeviceMemory::alloc(device, len)?;
        // SAFETY: our fresh allocation of `len` bytes.
        mem.on_own_stream(|s| check(unsafe { cu::cuMemsetD8Async(mem.addr, 0, len, s) }, "cuMemsetD8Async (collective mailbox)"))?;
        Ok(mem)
    }

    /// `desc` in GPU memory of `device`.
    pub(crate) fn descriptor(device: i32, desc: &CollDevice) -> Result<DeviceMemory> {
        let len = std::mem::size_of::<CollDevice>();
        let mem = DeviceMemory::alloc(device, len)?;
        // SAFETY: our fresh allocation of `len` bytes; `desc` is read by the copy, which is
        // complete when `on_own_stream` returns.
        mem.on_own_stream(|s| {
            check(
                unsafe { cu::cuMemcpyHtoDAsync_v2(mem.addr, (desc as *const CollDevice).cast(), len, s) },
                "cuMemcpyHtoDAsync (collective descriptor)",
            )
        })?;
        Ok(mem)
    }

    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    fn alloc(device: i32, len: usize) -> Result<DeviceMemory> {
        let _scope = CtxScope::enter(primary_context(device)?)?;
        let mut addr: cu::CUdeviceptr = 0;
        // SAFETY: a valid out-pointer; the device's context is current; freed in Drop.
        check(unsafe { cu::cuMemAlloc_v2(&mut addr, len.max(1)) }, "cuMemAlloc (kernel-triggered collective)")?;
        Ok(DeviceMemory { device, addr })
    }

    /// Run `f` on a non-blocking stream of our own and wait for it there: never behind a
    /// user's stream, nor a `cuCtxSynchronize` that would wait for the kernels of the very
    /// collectives being armed.
    fn on_own_stream(&self, f: impl FnOnce(cu::CUstream) -> Result<()>) -> Result<()> {
        let _scope = CtxScope::enter(primary_context(self.device)?)?;
        let mut stream: cu::CUstream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flag 1 = CU_STREAM_NON_BLOCKING.
        check(unsafe { cu::cuStreamCreate(&mut stream, 1) }, "cuStreamCreate")?;
        // SAFETY: our live stream.
        let result = f(stream).and_then(|()| check(unsafe { cu::cuStreamSynchronize(stream) }, "cuStreamSynchronize"));
        // SAFETY: our stream, idle now (or failed), destroyed once.
        unsafe { cu::cuStreamDestroy_v2(stream) };
        result
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let Ok(ctx) = primary_context(self.device)
            && let Ok(_scope) = CtxScope::enter(ctx)
        {
            // SAFETY: our allocation, freed once; nothing uses it any more (its owner's rule).
            unsafe { cu::cuMemFree_v2(self.addr) };
        }
    }
}

#[cfg(test)]
mod tests {
    /// A user's kernel that triggers and waits, as include/gsc_device.cuh's users write it,
    /// compiles for the device machines' GPUs (sm_90) with every path of gsc_trigger and
    /// gsc_wait — the proxy's, a prepared transfer's, and the collective the triggering
    /// thread runs (its arithmetic for every type) — wherever NVRTC is, GPU or not.
    #[test]
    fn a_kernel_that_triggers_collectives_compiles_for_sm90() {
        if !super::super::kernels::nvrtc_present_or_say_why() {
            return;
        }
        let kernel = r#"
extern "C" __global__ void user(gsc_device_handle_t *h, unsigned long long rounds, int *failed)
{
    for (unsigned long long r = 0; r < rounds; r++) {
        __syncthreads();
        if (threadIdx.x == 0) { gsc_trigger(h); if (gsc_wait(h) != 0) *failed = 1; }
        __syncthreads();
    }
}
"#;
        let source = format!("{}\n{kernel}", super::super::kernels::DEVICE_HEADER);
        let cubin = super::super::kernels::compile_uncached(&source, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.starts_with(b"\x7fELF"));
    }
}
