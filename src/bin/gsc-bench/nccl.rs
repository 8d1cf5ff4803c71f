//! NCCL, loaded at run time, for the side-by-side columns of `gpu-sendrecv` and of the
//! collectives (`coll.rs`): just the calls nccl-tests makes for those (unique id, communicator,
//! grouped send + receive, and the five collectives, on a stream).
//!
//! The library is found as `libnccl.so.2` on the loader's path, or at `GSC_BENCH_NCCL_LIB`.
//! Everything unsafe about NCCL is in this file.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub(crate) internal: [u8; 128],
}

type NcclComm = *mut c_void;
type Res = c_int;
const NCCL_INT8: c_int = 0;

// The collectives' C signatures (nccl.h 2.28); datatype and operator are the C enums
// `ncclDataType_t` / `ncclRedOp_t`, passed as ints.
/// ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
type AllReduceFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> Res;
/// ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
type AllGatherFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, *mut c_void) -> Res;
/// ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
type ReduceScatterFn = AllReduceFn;
/// ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
type BroadcastFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> Res;
/// ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream)
type ReduceFn = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, NcclComm, *mut c_void) -> Res;
/// ncclCommWindowRegister(comm, buff, size, win, winFlags) (nccl.h 2.27 on)
type WindowRegisterFn = unsafe extern "C" fn(NcclComm, *mut c_void, usize, *mut *mut c_void, c_int) -> Res;
/// ncclCommWindowDeregister(comm, win)
type WindowDeregisterFn = unsafe extern "C" fn(NcclComm, *mut c_void) -> Res;
/// `NCCL_WIN_COLL_SYMMETRIC`.
const NCCL_WIN_COLL_SYMMETRIC: c_int = 1;

struct Api {
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Res,
    comm_init_rank: unsafe extern "C" fn(*mut NcclComm, c_int, UniqueId, c_int) -> Res,
    comm_destroy: unsafe extern "C" fn(NcclComm) -> Res,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> Res,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> Res,
    group_start: unsafe extern "C" fn() -> Res,
    group_end: unsafe extern "C" fn() -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    version: unsafe extern "C" fn(*mut c_int) -> Res,
    all_reduce: AllReduceFn,
    all_gather: AllGatherFn,
    reduce_scatter: ReduceScatterFn,
    broadcast: BroadcastFn,
    reduce: ReduceFn,
    /// Absent before NCCL 2.27.
    windows: Option<(WindowRegisterFn, WindowDeregisterFn)>,
}

/// A loaded NCCL.
pub(crate) struct Nccl {
    api: Api,
}

/// A communicator (of 2 ranks for `gpu-sendrecv`, of `-g` for the collectives).
pub(crate) struct Comm<'a> {
    nccl: &'a Nccl,
    comm: NcclComm,
    /// Windows registered on it (`register_windows`), deregistered before it is destroyed.
    windows: Vec<*mut c_void>,
}

impl Nccl {
    pub(crate) fn load() -> Result<Nccl, String> {
        let name = std::env::var("GSC_BENCH_NCCL_LIB").unwrap_or_else(|_| "libnccl.so.2".into());
        let cname = CString::new(name.clone()).map_err(|_| "bad library name".to_string())?;
        // SAFETY: a NUL-terminated name; the handle is kept for the process (never closed).
        let lib = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            // SAFETY: dlerror returns a NUL-terminated string or null.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() { String::new() } else { unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned() };
            return Err(format!("cannot load {name}: {why}"));
        }
        let sym = |s: &str| -> Result<*mut c_void, String> {
            let c = CString::new(s).expect("symbol name");
            // SAFETY: a live handle and a NUL-terminated name.
            let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
            if p.is_null() { Err(format!("{name} has no {s}")) } else { Ok(p) }
        };
        // SAFETY: each symbol is NCCL's public function of that name, whose C signature
        // (nccl.h, stable since NCCL 2.7) is the one it is transmuted to.
        let api = unsafe {
            Api {
                get_unique_id: std::mem::transmute::<*mut c_void, _>(sym("ncclGetUniqueId")?),
                comm_init_rank: std::mem::transmute::<*mut c_void, _>(sym("ncclCommInitRank")?),
                comm_destroy: std::mem::transmute::<*mut c_void, _>(sym("ncclCommDestroy")?),
                send: std::mem::transmute::<*mut c_void, _>(sym("ncclSend")?),
                recv: std::mem::transmute::<*mut c_void, _>(sym("ncclRecv")?),
                group_start: std::mem::transmute::<*mut c_void, _>(sym("ncclGroupStart")?),
                group_end: std::mem::transmute::<*mut c_void, _>(sym("ncclGroupEnd")?),
                error_string: std::mem::transmute::<*mut c_void, _>(sym("ncclGetErrorString")?),
                version: std::mem::transmute::<*mut c_void, _>(sym("ncclGetVersion")?),
                all_reduce: std::mem::transmute::<*mut c_void, AllReduceFn>(sym("ncclAllReduce")?),
                all_gather: std::mem::transmute::<*mut c_void, AllGatherFn>(sym("ncclAllGather")?),
                reduce_scatter: std::mem::transmute::<*mut c_void, ReduceScatterFn>(sym("ncclReduceScatter")?),
                broadcast: std::mem::transmute::<*mut c_void, BroadcastFn>(sym("ncclBroadcast")?),
                reduce: std::mem::transmute::<*mut c_void, ReduceFn>(sym("ncclReduce")?),
                windows: match (sym("ncclCommWindowRegister"), sym("ncclCommWindowDeregister")) {
                    (Ok(r), Ok(d)) => Some((
                        std::mem::transmute::<*mut c_void, WindowRegisterFn>(r),
                        std::mem::transmute::<*mut c_void, WindowDeregisterFn>(d),
                    )),
                    _ => None,
                },
            }
        };
        Ok(Nccl { api })
    }

    fn check(&self, r: Res, what: &str) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static NUL-terminated string for any result code.
        let s = unsafe { CStr::from_ptr((self.api.error_string)(r)) };
        Err(format!("{what}: {}", s.to_string_lossy()))
    }

    /// "2.28.9".
    pub(crate) fn version(&self) -> String {
        let mut v = 0;
        // SAFETY: a valid out-pointer.
        unsafe { (self.api.version)(&mut v) };
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    }

    pub(crate) fn unique_id(&self) -> Result<UniqueId, String> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer.
        self.check(unsafe { (self.api.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id)
    }

    /// Join the communicator of `id` as `rank` of `nranks` (blocks until every rank joins), on
    /// the calling thread's current GPU.
    pub(crate) fn comm(&self, id: UniqueId, rank: i32, nranks: i32) -> Result<Comm<'_>, String> {
        let mut comm: NcclComm = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; `id` came from ncclGetUniqueId (on one of the ranks).
        self.check(unsafe { (self.api.comm_init_rank)(&mut comm, nranks, id, rank) }, "ncclCommInitRank")?;
        Ok(Comm { nccl: self, comm, windows: Vec::new() })
    }
}

impl Comm<'_> {
    /// Register each (address, bytes) as a symmetric window (collective: every rank, the same
    /// order), as nccl-tests' `-R 2` does; they stay until the communicator goes.
    pub(crate) fn register_windows(&mut self, bufs: &[(u64, usize)]) -> Result<(), String> {
        let (register, _) = self.nccl.api.windows.ok_or("this NCCL has no ncclCommWindowRegister (NCCL 2.27 on)")?;
        let mut wins = vec![std::ptr::null_mut(); bufs.len()];
        // SAFETY: a group of registrations (NCCL's pattern) of live device buffers of this
        // rank's GPU, with valid out-pointers.
        let r = unsafe {
            (self.nccl.api.group_start)();
            let rs: Vec<Res> = bufs
                .iter()
                .zip(wins.iter_mut())
                .map(|(&(at, len), w)| register(self.comm, at as *mut c_void, len, w, NCCL_WIN_COLL_SYMMETRIC))
                .collect();
            let end = (self.nccl.api.group_end)();
            rs.into_iter().find(|&r| r != 0).unwrap_or(end)
        };
        self.nccl.check(r, "ncclCommWindowRegister")?;
        self.windows.extend(wins.into_iter().filter(|w| !w.is_null()));
        Ok(())
    }

    /// Enqueue on `stream` one grouped send of `n` bytes from `send` to `peer` and receive of
    /// `n` bytes from `peer` into `recv` (nccl-tests' sendrecv step).
    ///
    /// # Safety
    /// `send` and `recv` are device buffers of at least `n` bytes on this rank's GPU, live until
    /// the stream has run the operation; `stream` is a live stream of that GPU.
    pub(crate) unsafe fn sendrecv(&self, send: u64, recv: u64, n: usize, peer: i32, stream: usize) -> Result<(), String> {
        let a = &self.nccl.api;
        let s = stream as *mut c_void;
        // SAFETY: the caller's promise; group calls bracket the two operations.
        unsafe {
            self.nccl.check((a.group_start)(), "ncclGroupStart")?;
            let r1 = (a.send)(send as *const c_void, n, NCCL_INT8, peer, self.comm, s);
            let r2 = (a.recv)(recv as *mut c_void, n, NCCL_INT8, peer, self.comm, s);
            let r3 = (a.group_end)();
            self.nccl.check(r1, "ncclSend")?;
            self.nccl.check(r2, "ncclRecv")?;
            self.nccl.check(r3, "ncclGroupEnd")
        }
    }

    /// One group of sends and receives, as nccl-tests' sendrecv and alltoall issue them:
    /// `sends` and `recvs` are (buffer, bytes, peer).
    ///
    /// # Safety
    /// Every buffer is a device buffer of its bytes on this rank's GPU, live until the stream
    /// has run the group; `stream` is a live stream of that GPU.
    pub(crate) unsafe fn group(&self, sends: &[(u64, usize, i32)], recvs: &[(u64, usize, i32)], stream: usize) -> Result<(), String> {
        let a = &self.nccl.api;
        let s = stream as *mut c_void;
        // SAFETY: the caller's promise; group calls bracket the operations.
        unsafe {
            self.nccl.check((a.group_start)(), "ncclGroupStart")?;
            let mut first = Ok(());
            for &(buf, n, peer) in sends {
                first = first.and(self.nccl.check((a.send)(buf as *const c_void, n, NCCL_INT8, peer, self.comm, s), "ncclSend"));
            }
            for &(buf, n, peer) in recvs {
                first = first.and(self.nccl.check((a.recv)(buf as *mut c_void, n, NCCL_INT8, peer, self.comm, s), "ncclRecv"));
            }
            let end = self.nccl.check((a.group_end)(), "ncclGroupEnd");
            first.and(end)
        }
    }

    // The collectives, enqueued on `stream`. `dtype` and `op` are `ncclDataType_t` /
    // `ncclRedOp_t` values (`DataType::nccl()`, `RedOp::nccl()`); counts are elements, as
    // NCCL takes them.
    //
    // # Safety (all five)
    // `send` and `recv` are device buffers on this rank's GPU, large enough for the call as
    // nccl.h defines it (all-gather: `recv` holds nranks × `sendcount`; reduce-scatter: `send`
    // holds nranks × `recvcount`), live until the stream has run it; `stream` is a live stream
    // of that GPU.

    /// ncclAllReduce.
    pub(crate) unsafe fn all_reduce(&self, send: u64, recv: u64, count: usize, dtype: i32, op: i32, stream: usize) -> Result<(), String> {
        // SAFETY: the caller's promise.
        let r = unsafe {
            (self.nccl.api.all_reduce)(send as *const c_void, recv as *mut c_void, count, dtype, op, self.comm, stream as *mut c_void)
        };
        self.nccl.check(r, "ncclAllReduce")
    }

    /// ncclAllGather: `sendcount` elements from every rank.
    pub(crate) unsafe fn all_gather(&self, send: u64, recv: u64, sendcount: usize, dtype: i32, stream: usize) -> Result<(), String> {
        // SAFETY: the caller's promise.
        let r = unsafe {
            (self.nccl.api.all_gather)(send as *const c_void, recv as *mut c_void, sendcount, dtype, self.comm, stream as *mut c_void)
        };
        self.nccl.check(r, "ncclAllGather")
    }

    /// ncclReduceScatter: `recvcount` elements to every rank.
    pub(crate) unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        recvcount: usize,
        dtype: i32,
        op: i32,
        stream: usize,
    ) -> Result<(), String> {
        // SAFETY: the caller's promise.
        let r = unsafe {
            (self.nccl.api.reduce_scatter)(
                send as *const c_void,
                recv as *mut c_void,
                recvcount,
                dtype,
                op,
                self.comm,
                stream as *mut c_void,
            )
        };
        self.nccl.check(r, "ncclReduceScatter")
    }

    /// ncclBroadcast from `root`.
    pub(crate) unsafe fn broadcast(&self, send: u64, recv: u64, count: usize, dtype: i32, root: i32, stream: usize) -> Result<(), String> {
        // SAFETY: the caller's promise.
        let r = unsafe {
            (self.nccl.api.broadcast)(send as *const c_void, recv as *mut c_void, count, dtype, root, self.comm, stream as *mut c_void)
        };
        self.nccl.check(r, "ncclBroadcast")
    }

    /// ncclReduce to `root`.
    #[allow(clippy::too_many_arguments)] // NCCL's own argument list, plus `self`
    pub(crate) unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: i32,
        op: i32,
        root: i32,
        stream: usize,
    ) -> Result<(), String> {
        // SAFETY: the caller's promise.
        let r = unsafe {
            (self.nccl.api.reduce)(send as *const c_void, recv as *mut c_void, count, dtype, op, root, self.comm, stream as *mut c_void)
        };
        self.nccl.check(r, "ncclReduce")
    }
}

impl Drop for Comm<'_> {
    fn drop(&mut self) {
        if let Some((_, deregister)) = self.nccl.api.windows {
            for w in self.windows.drain(..) {
                // SAFETY: a window of this communicator, deregistered once.
                unsafe { deregister(self.comm, w) };
            }
        }
        // SAFETY: our communicator, destroyed once.
        unsafe { (self.nccl.api.comm_destroy)(self.comm) };
    }
}
