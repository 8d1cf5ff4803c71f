//! nccl.h's profiling names: each `pncclX` is `ncclX`, as in NVIDIA's library, so a tool that
//! interposes `ncclX` (loaded before this library, in the manner of MPI's PMPI) reaches the
//! implementation through `pncclX`.
//!
//! NVIDIA's library makes `ncclX` a weak alias of `pncclX`. rustc's version script exports only
//! the functions it compiled, so aliases made in the linker would stay local; these are small
//! functions instead. Each calls `ncclX` directly, and build.rs links with
//! `-Bsymbolic-functions`, so the call binds inside this library: a tool's `ncclX` is never
//! reached from `pncclX`, which would loop (tests/c_abi.rs checks that, with a tool in C).

use crate::*;
use std::ffi::{c_char, c_int, c_void};

macro_rules! profiling_names {
    ($($alias:ident => $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?;)*) => {$(
        #[unsafe(no_mangle)]
        #[allow(unused_unsafe)] // a few of the functions named are safe to call
        pub unsafe extern "C" fn $alias($($arg: $ty),*) $(-> $ret)? {
            // SAFETY: the caller keeps the contract of the function named, which is the same.
            unsafe { $name($($arg),*) }
        }
    )*};
}

profiling_names! {
    pncclAllGather => ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclAllReduce => ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclAlltoAll => ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclBcast => ncclBcast(buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclBroadcast => ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclCommAbort => ncclCommAbort(comm: ncclComm_t) -> ncclResult_t;
    pncclCommCount => ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t;
    pncclCommCuDevice => ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t;
    pncclCommDeregister => ncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t;
    pncclCommDestroy => ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t;
    pncclCommFinalize => ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t;
    pncclCommGetAsyncError => ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t;
    pncclCommInitAll => ncclCommInitAll(comms: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t;
    pncclCommInitRank => ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int) -> ncclResult_t;
    pncclCommInitRankConfig => ncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int, config: *mut c_void) -> ncclResult_t;
    pncclCommInitRankScalable => ncclCommInitRankScalable(comm: *mut ncclComm_t, nranks: c_int, rank: c_int, n_ids: c_int, ids: *mut ncclUniqueId, config: *mut c_void) -> ncclResult_t;
    pncclCommRegister => ncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> ncclResult_t;
    pncclCommRevoke => ncclCommRevoke(comm: ncclComm_t, revoke_flags: c_int) -> ncclResult_t;
    pncclCommShrink => ncclCommShrink(comm: ncclComm_t, exclude_ranks: *mut c_int, exclude_count: c_int, newcomm: *mut ncclComm_t, config: *mut c_void, shrink_flags: c_int) -> ncclResult_t;
    pncclCommSplit => ncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t, config: *mut c_void) -> ncclResult_t;
    pncclCommUserRank => ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t;
    pncclCommWindowDeregister => ncclCommWindowDeregister(comm: ncclComm_t, win: *mut c_void) -> ncclResult_t;
    pncclCommWindowRegister => ncclCommWindowRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, win: *mut *mut c_void, flags: c_int) -> ncclResult_t;
    pncclGather => ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclGetErrorString => ncclGetErrorString(result: ncclResult_t) -> *const c_char;
    pncclGetLastError => ncclGetLastError(comm: ncclComm_t) -> *const c_char;
    pncclGetUniqueId => ncclGetUniqueId(unique_id: *mut ncclUniqueId) -> ncclResult_t;
    pncclGetVersion => ncclGetVersion(version: *mut c_int) -> ncclResult_t;
    pncclGroupEnd => ncclGroupEnd() -> ncclResult_t;
    pncclGroupSimulateEnd => ncclGroupSimulateEnd(sim_info: *mut c_void) -> ncclResult_t;
    pncclGroupStart => ncclGroupStart() -> ncclResult_t;
    pncclMemAlloc => ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t;
    pncclMemFree => ncclMemFree(ptr: *mut c_void) -> ncclResult_t;
    pncclRecv => ncclRecv(recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclRedOpCreatePreMulSum => ncclRedOpCreatePreMulSum(op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: ncclComm_t) -> ncclResult_t;
    pncclRedOpDestroy => ncclRedOpDestroy(op: c_int, comm: ncclComm_t) -> ncclResult_t;
    pncclReduce => ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclReduceScatter => ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclResetDebugInit => ncclResetDebugInit();
    pncclScatter => ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
    pncclSend => ncclSend(sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: *mut c_void) -> ncclResult_t;
}
