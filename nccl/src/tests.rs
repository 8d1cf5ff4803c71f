//! The library's tests: its functions called as a C program would, with a GPU where they need one
//! (they skip with the reason where there is none).

use super::*;
use std::ffi::CStr;

/// Whether the GPU tests may run here with `n` GPUs; says why not when they may not.
fn gpus_or_skip(n: i32) -> bool {
    use gscomm::cuda::api::{device_count, gpu_test_skip_reason};
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return false;
    }
    if device_count() < n {
        eprintln!("skipped: needs {n} GPUs, found {}", device_count());
        return false;
    }
    true
}

/// A communicator of two ranks on GPUs 0 and 1, both made from this thread in one group.
fn two_comms_from_one_thread() -> [ncclComm_t; 2] {
    use gscomm::cuda::api::set_device;
    let mut id = ncclUniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
    let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, c) in comms.iter_mut().enumerate() {
        set_device(r as i32).unwrap();
        assert_eq!(unsafe { ncclCommInitRank(c, 2, id, r as c_int) }, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
    comms
}

fn last() -> String {
    // SAFETY: a NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) }.to_string_lossy().into_owned()
}

#[test]
fn version_and_error_strings() {
    let mut v = 0;
    assert_eq!(unsafe { ncclGetVersion(&mut v) }, NCCL_SUCCESS);
    assert_eq!(v, 22809);
    assert_eq!(unsafe { ncclGetVersion(std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("version is NULL"), "{}", last());
    for code in 0..8 {
        // SAFETY: static NUL-terminated strings.
        let s = unsafe { CStr::from_ptr(ncclGetErrorString(code)) };
        assert!(!s.to_bytes().is_empty());
    }
}

/// NCCL_COMM_ID's id: the same from every call (so every process makes it alone), at the
/// address given; GSC_BOOTSTRAP_SECRET, where set, is its secret; bad values are named.
#[test]
fn nccl_comm_id_names_one_id_at_its_address() {
    let config = Config::default();
    let a = comm_id_uid("127.0.0.1:29511", &config).unwrap();
    assert_eq!(a.to_bytes(), comm_id_uid(" 127.0.0.1:29511 ", &config).unwrap().to_bytes());
    assert_eq!(a.root_addr(), "127.0.0.1:29511".parse().unwrap());
    assert_eq!(comm_id_uid("[::1]:29511", &config).unwrap().root_addr(), "[::1]:29511".parse().unwrap());
    assert_ne!(a.to_bytes(), comm_id_uid("127.0.0.1:29512", &config).unwrap().to_bytes());
    let mut secret = Config::default();
    secret.set("GSC_BOOTSTRAP_SECRET", "s3cret").unwrap();
    assert_ne!(a.to_bytes(), comm_id_uid("127.0.0.1:29511", &secret).unwrap().to_bytes());
    for bad in ["127.0.0.1", "127.0.0.1:port", "[::1]"] {
        let e = comm_id_uid(bad, &config).unwrap_err();
        assert_eq!(e.0, NCCL_INVALID_ARGUMENT, "{bad}");
        assert!(e.1.contains("NCCL_COMM_ID") && e.1.contains("<hostname>:<port>"), "{bad}: {}", e.1);
    }
}

/// Two communicators in a row made under one NCCL_COMM_ID address, as NVIDIA's library makes
/// them: both ranks take the same id, rank 0's init starts its root, and the second job finds
/// the address free again.
#[test]
fn nccl_comm_id_jobs_one_after_another_on_two_gpus() {
    if !gpus_or_skip(2) {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let value = format!("127.0.0.1:{port}");
    for job in 0..3 {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let value = value.clone();
                std::thread::spawn(move || {
                    let uid = comm_id_uid(&value, &Config::default()).map_err(|f| f.1)?;
                    let mut id = ncclUniqueId { internal: [0; 128] };
                    for (d, s) in id.internal.iter_mut().zip(uid.to_bytes()) {
                        *d = s as c_char;
                    }
                    let job = InitJob::Rank { nranks: 2, id, rank, device: rank, serve_root: rank == 0 };
                    let c = run_job(&job).map_err(|f| f.1)?.expect("a communicator");
                    Ok::<_, String>((c.rank(), c.nranks()))
                })
            })
            .collect();
        let got: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(got, vec![Ok((0, 2)), Ok((1, 2))], "job {job}");
    }
}

#[test]
fn unique_ids_are_gscomm_ids() {
    let mut id = ncclUniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
    let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
    assert!(UniqueId::from_bytes(&bytes).is_ok());
}

#[test]
fn bad_arguments_change_nothing_and_say_why() {
    let mut n = -1;
    assert_eq!(unsafe { ncclCommCount(std::ptr::null_mut(), &mut n) }, NCCL_INVALID_ARGUMENT);
    assert_eq!(n, -1);
    assert!(last().contains("comm is NULL"));
    let id = ncclUniqueId { internal: [0; 128] };
    let mut comm: ncclComm_t = std::ptr::null_mut();
    // Rank out of range: refused before anything is started (no GPU needed to say so).
    let r = unsafe { ncclCommInitRank(&mut comm, 2, id, 5) };
    assert_ne!(r, NCCL_SUCCESS);
    assert!(comm.is_null());
    assert_eq!(unsafe { ncclSend(std::ptr::null(), 1, 7, 0, std::ptr::null_mut(), std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("ncclSend: comm is NULL"), "{}", last());
    let mut op = 0;
    let r = unsafe { ncclRedOpCreatePreMulSum(&mut op, std::ptr::null_mut(), 7, 1, std::ptr::null_mut()) };
    assert_eq!(r, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("ncclRedOpCreatePreMulSum: comm is NULL"), "{}", last());
}

#[test]
fn configs_say_blocking_or_not_and_bad_ones_are_named() {
    let mut c = ConfigHead { size: 64, magic: 0xcafebeef, version: NCCL_VERSION_CODE as u32, blocking: CONFIG_UNDEF_INT };
    let p = |c: &mut ConfigHead| c as *mut ConfigHead as *const c_void;
    assert!(blocking(std::ptr::null()).unwrap(), "no config: blocking");
    assert!(blocking(p(&mut c)).unwrap(), "undefined: blocking");
    c.blocking = 0;
    assert!(!blocking(p(&mut c)).unwrap());
    c.blocking = 7;
    assert!(blocking(p(&mut c)).unwrap_err().1.contains("config.blocking = 7"));
    c.size = 4;
    assert!(blocking(p(&mut c)).unwrap_err().1.contains("size 4"));
}

#[test]
fn split_and_registration_refuse_bad_arguments() {
    let mut newcomm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(unsafe { ncclCommSplit(std::ptr::null_mut(), 0, 0, &mut newcomm, std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("comm is NULL"), "{}", last());
    let mut h = std::ptr::null_mut();
    assert_eq!(unsafe { ncclCommRegister(std::ptr::null_mut(), std::ptr::null_mut(), 8, &mut h) }, NCCL_INVALID_ARGUMENT);
    assert!(h.is_null());
    // A communicator still initializing answers ncclInProgress, and a handle it never gave
    // out is refused without touching it.
    let (comm, c) = new_handle(Comm::new());
    let mut n = -1;
    assert_eq!(unsafe { ncclCommCount(comm, &mut n) }, NCCL_IN_PROGRESS);
    let mut err = 0;
    assert_eq!(unsafe { ncclCommGetAsyncError(comm, &mut err) }, NCCL_SUCCESS);
    assert_eq!(err, NCCL_IN_PROGRESS);
    let mut bogus = 5u64;
    assert_eq!(unsafe { ncclCommDeregister(comm, &mut bogus as *mut u64 as *mut c_void) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("not a live registration"), "{}", last());
    assert_eq!(bogus, 5);
    // Windows: bad flags and a NULL out-pointer are named; a window never given out is
    // refused untouched; a NULL one is a no-op; a communicator still initializing answers
    // ncclInProgress and leaves the slot NULL.
    let mut win = &mut bogus as *mut u64 as *mut c_void;
    let buf = 0x1000 as *mut c_void;
    assert_eq!(unsafe { ncclCommWindowRegister(comm, buf, 64, &mut win, 2) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("winFlags 0x2"), "{}", last());
    assert_eq!(unsafe { ncclCommWindowRegister(comm, buf, 64, std::ptr::null_mut(), 1) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("win is NULL"), "{}", last());
    assert_eq!(unsafe { ncclCommWindowRegister(comm, buf, 64, &mut win, NCCL_WIN_COLL_SYMMETRIC) }, NCCL_IN_PROGRESS);
    assert_eq!(unsafe { ncclCommWindowDeregister(comm, &mut bogus as *mut u64 as *mut c_void) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("not a live window"), "{}", last());
    assert_eq!(bogus, 5);
    assert_eq!(unsafe { ncclCommWindowDeregister(comm, std::ptr::null_mut()) }, NCCL_SUCCESS);
    let _ = c.state.set(Err(Fail(NCCL_REMOTE_ERROR, "rank 1 went away".into())));
    assert_eq!(unsafe { ncclCommCount(comm, &mut n) }, NCCL_REMOTE_ERROR);
    assert!(last().contains("init failed: rank 1 went away"), "{}", last());
    assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_SUCCESS);
}

/// On two GPUs from one thread, as a program would: non-blocking inits in a group (polled
/// to success), send/recv between them in a group with data checked, a split into two
/// one-rank communicators that then all-reduce, and registration. Skips without GPUs.
#[test]
fn non_blocking_init_send_recv_split_and_registration_on_gpus() {
    use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
    if !gpus_or_skip(2) {
        return;
    }
    let mut id = ncclUniqueId { internal: [0; 128] };
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
    let mut config = ConfigHead { size: 64, magic: 0xcafebeef, version: NCCL_VERSION_CODE as u32, blocking: 0 };
    let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, c) in comms.iter_mut().enumerate() {
        set_device(r as i32).unwrap();
        let cfg = &mut config as *mut ConfigHead as *mut c_void;
        assert_eq!(unsafe { ncclCommInitRankConfig(c, 2, id, r as c_int, cfg) }, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_IN_PROGRESS, "{}", last());
    let t0 = std::time::Instant::now();
    for c in comms {
        assert!(!c.is_null());
        loop {
            let mut e = -1;
            assert_eq!(unsafe { ncclCommGetAsyncError(c, &mut e) }, NCCL_SUCCESS);
            if e == NCCL_SUCCESS {
                break;
            }
            assert_eq!(e, NCCL_IN_PROGRESS, "{}", last());
            assert!(t0.elapsed() < Duration::from_secs(60), "non-blocking init did not finish");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Send/recv both ways in one group: 3 MiB, so the copy-engine path.
    let len = 3 << 20;
    let mut bufs = Vec::new();
    for r in 0..2 {
        set_device(r).unwrap();
        let send = DeviceBuf::new(len).unwrap();
        send.upload(&(0..len).map(|i| (i * 13 + r as usize * 7) as u8).collect::<Vec<_>>()).unwrap();
        let recv = DeviceBuf::new(len).unwrap();
        recv.fill(0).unwrap();
        bufs.push((send, recv, Stream::new().unwrap()));
    }
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, (send, recv, stream)) in bufs.iter().enumerate() {
        let (c, peer, s) = (comms[r], 1 - r as c_int, stream.raw() as *mut c_void);
        assert_eq!(unsafe { ncclSend(send.ptr() as *const c_void, len, 1, peer, c, s) }, NCCL_SUCCESS, "{}", last());
        assert_eq!(unsafe { ncclRecv(recv.ptr() as *mut c_void, len, 1, peer, c, s) }, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
    for (r, (_, recv, stream)) in bufs.iter().enumerate() {
        stream.synchronize().unwrap();
        let want: Vec<u8> = (0..len).map(|i| (i * 13 + (1 - r) * 7) as u8).collect();
        assert!(recv.download().unwrap() == want, "GPU {r} received wrong data");
    }
    // Registration: a real buffer is taken, a host address is not, a handle only once.
    let mut h = std::ptr::null_mut();
    let (send, _, stream) = &bufs[0];
    assert_eq!(unsafe { ncclCommRegister(comms[0], send.ptr() as *mut c_void, len, &mut h) }, NCCL_SUCCESS, "{}", last());
    let host = vec![0u8; 64];
    let mut h2 = std::ptr::null_mut();
    assert_eq!(unsafe { ncclCommRegister(comms[0], host.as_ptr() as *mut c_void, 64, &mut h2) }, NCCL_INVALID_ARGUMENT);
    assert!(h2.is_null() && last().contains("not GPU memory"), "{}", last());
    assert_eq!(unsafe { ncclCommDeregister(comms[0], h) }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclCommDeregister(comms[0], h) }, NCCL_INVALID_ARGUMENT);
    // A pre-multiplied sum through the ABI: rank r scales by r + 2 (host scalar), uint8.
    let mut ops = [0 as c_int; 2];
    for (r, op) in ops.iter_mut().enumerate() {
        let mut k = (r + 2) as u8;
        let scalar = &mut k as *mut u8 as *mut c_void;
        assert_eq!(unsafe { ncclRedOpCreatePreMulSum(op, scalar, 1, NCCL_SCALAR_HOST_IMMEDIATE, comms[r]) }, NCCL_SUCCESS, "{}", last());
    }
    let outs: Vec<DeviceBuf> = (0..2)
        .map(|r| {
            set_device(r).unwrap();
            DeviceBuf::new(len).unwrap()
        })
        .collect();
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, (send, _, stream)) in bufs.iter().enumerate() {
        let (c, s) = (comms[r], stream.raw() as *mut c_void);
        let rc = unsafe { ncclAllReduce(send.ptr() as *const c_void, outs[r].ptr() as *mut c_void, len, 1, ops[r], c, s) };
        assert_eq!(rc, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
    let want: Vec<u8> = (0..len).map(|i| ((i * 13) as u8).wrapping_mul(2).wrapping_add(((i * 13 + 7) as u8).wrapping_mul(3))).collect();
    for (r, (_, _, stream)) in bufs.iter().enumerate() {
        stream.synchronize().unwrap();
        assert!(outs[r].download().unwrap() == want, "GPU {r}: pre-multiplied sum wrong");
        assert_eq!(unsafe { ncclRedOpDestroy(ops[r], comms[r]) }, NCCL_SUCCESS);
    }
    // Split into two one-rank communicators (both splits from this thread: a group).
    let mut subs: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, sub) in subs.iter_mut().enumerate() {
        assert_eq!(unsafe { ncclCommSplit(comms[r], r as c_int, 0, sub, std::ptr::null_mut()) }, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
    for sub in subs {
        let (mut n, mut rank) = (0, -1);
        assert_eq!(unsafe { ncclCommCount(sub, &mut n) }, NCCL_SUCCESS);
        assert_eq!(unsafe { ncclCommUserRank(sub, &mut rank) }, NCCL_SUCCESS);
        assert_eq!((n, rank), (1, 0));
    }
    set_device(0).unwrap();
    let out = DeviceBuf::new(len).unwrap();
    let s = stream.raw() as *mut c_void;
    let r = unsafe { ncclAllReduce(send.ptr() as *const c_void, out.ptr() as *mut c_void, len, 1, 0, subs[0], s) };
    assert_eq!(r, NCCL_SUCCESS, "{}", last());
    stream.synchronize().unwrap();
    assert!(out.download().unwrap() == send.download().unwrap(), "a one-rank all-reduce is a copy");
    for c in subs.into_iter().chain(comms) {
        assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
    }
}

/// Without a GPU: NULL frees are no-ops, anything ncclMemAlloc did not return is refused
/// (before any driver call) with the reason, and an allocation reports its failure.
#[test]
fn mem_free_refuses_what_mem_alloc_did_not_return() {
    assert_eq!(unsafe { ncclMemFree(std::ptr::null_mut()) }, NCCL_SUCCESS);
    let mut local = 0u64;
    assert_eq!(unsafe { ncclMemFree(&mut local as *mut u64 as *mut c_void) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("ncclMemFree") && last().contains("not allocated by mem_alloc"), "{}", last());
    assert_eq!(unsafe { ncclMemAlloc(std::ptr::null_mut(), 64) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("ptr is NULL"), "{}", last());
}

/// Symmetric windows on two GPUs from one thread, as nccl-tests' `-R 2` runs: both ranks
/// register a send and a receive window (ncclMemAlloc memory) in one group, so each
/// communicator's two registrations pair in order. Eager all-reduce (out of place and in
/// place, at an offset), all-gather and reduce-scatter on them then take the direct kernel
/// with no exchange — which ranks sharing a thread could not do before (their exchange would
/// wait for the other rank's call) — and are exact; an unaligned offset, and a call below
/// `auto`'s stream floor, run the workspace kernels on both ranks, still exact; after
/// deregistration the direct kernel is
/// off again. A bad buffer on one rank and disagreeing flags fail on both ranks, naming the
/// rank, and leave no window. Skips without `GSC_TEST_GPU=1` and 2 GPUs.
#[test]
fn symmetric_windows_take_the_direct_kernel_from_one_thread_on_two_gpus() {
    use gscomm::cuda::api::{Stream, copy_from_device, copy_to_device, set_device};
    if !gpus_or_skip(2) {
        return;
    }
    let comms = two_comms_from_one_thread();
    const WIN: usize = 48 << 20;
    // Per rank: (send window, recv window, stream).
    let mut ranks = Vec::new();
    for r in 0..2 {
        set_device(r).unwrap();
        let (mut a, mut b): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(unsafe { ncclMemAlloc(&mut a, WIN) }, NCCL_SUCCESS, "{}", last());
        assert_eq!(unsafe { ncclMemAlloc(&mut b, WIN) }, NCCL_SUCCESS, "{}", last());
        ranks.push((a as u64, b as u64, Stream::new().unwrap()));
    }
    let communicator = |r: usize| comm_ref(comms[r]).unwrap();
    let calls = |r: usize| {
        let c = communicator(r);
        let c = c.ready().unwrap();
        (c.direct_calls(), c.window_calls())
    };
    let mut wins = [[std::ptr::null_mut::<c_void>(); 2]; 2];
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, (a, b, _)) in ranks.iter().enumerate() {
        for (i, at) in [*a, *b].into_iter().enumerate() {
            let rc = unsafe { ncclCommWindowRegister(comms[r], at as *mut c_void, WIN, &mut wins[r][i], NCCL_WIN_COLL_SYMMETRIC) };
            assert_eq!(rc, NCCL_SUCCESS, "{}", last());
        }
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
    assert!(wins.iter().flatten().all(|w| !w.is_null()));
    let val = |r: usize, i: usize| ((i * 2_654_435_761 + r * 97) as u32 as i32) >> 2;
    let bytes = |v: Vec<i32>| v.into_iter().flat_map(i32::to_le_bytes).collect::<Vec<u8>>();
    // (what, send offset in A or, in place, in B, recv offset in B, count, kind, direct expected)
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Kind {
        AllReduce,
        AllReduceInPlace,
        AllGather,
        ReduceScatter,
    }
    // At `auto`'s stream floors (16 MiB all-reduces, 8 MiB all-gather parts, 16 MiB
    // reduce-scatter parts), and one below them.
    let cases = [
        (Kind::AllReduce, 0u64, 0u64, 4usize << 20, true),
        (Kind::AllReduceInPlace, 0, 16 << 20, 4 << 20, true),
        (Kind::AllGather, 16 << 20, 0, 2 << 20, true),
        (Kind::ReduceScatter, 0, 32 << 20, 4 << 20, true),
        // 4 bytes off 16 on both ranks alike: still the direct kernel (`direct::common_offset`).
        (Kind::AllReduce, 4, 4, 4 << 20, true),
        // Send and receive buffers at different offsets from 16 bytes: the workspace kernels.
        (Kind::AllReduce, 4, 8, 4 << 20, false),
        // Below the floor: the workspace kernels.
        (Kind::AllReduce, 0, 0, 1 << 20, false),
    ];
    // `expect`: (direct kernel, window) calls each rank makes.
    let run = |kind: Kind, send_off: u64, recv_off: u64, count: usize, expect: (u64, u64), salt: usize| {
        let before = [calls(0), calls(1)];
        let in_len = match kind {
            Kind::ReduceScatter => 2 * count,
            _ => count,
        };
        for (r, (a, b, _)) in ranks.iter().enumerate() {
            set_device(r as i32).unwrap();
            let src = if kind == Kind::AllReduceInPlace { b + recv_off } else { a + send_off };
            unsafe {
                if kind != Kind::AllReduceInPlace {
                    copy_to_device(b + recv_off, &vec![0xEE; 4 * if kind == Kind::AllGather { 2 * count } else { count }]).unwrap();
                }
                copy_to_device(src, &bytes((0..in_len).map(|i| val(r, i + salt)).collect())).unwrap();
            }
        }
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (a, b, s)) in ranks.iter().enumerate() {
            let recv = (b + recv_off) as *mut c_void;
            let send = if kind == Kind::AllReduceInPlace { recv as *const c_void } else { (a + send_off) as *const c_void };
            let (c, st) = (comms[r], s.raw() as *mut c_void);
            let rc = unsafe {
                match kind {
                    Kind::AllReduce | Kind::AllReduceInPlace => ncclAllReduce(send, recv, count, 2, 0, c, st),
                    Kind::AllGather => ncclAllGather(send, recv, count, 2, c, st),
                    Kind::ReduceScatter => ncclReduceScatter(send, recv, count, 2, 0, c, st),
                }
            };
            assert_eq!(rc, NCCL_SUCCESS, "{kind:?}: {}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        let out_len = if kind == Kind::AllGather { 2 * count } else { count };
        for (r, (_, b, s)) in ranks.iter().enumerate() {
            set_device(r as i32).unwrap();
            s.synchronize().unwrap();
            let want: Vec<i32> = (0..out_len)
                .map(|i| match kind {
                    Kind::AllGather => val(i / count, i % count + salt),
                    Kind::ReduceScatter => val(0, r * count + i + salt).wrapping_add(val(1, r * count + i + salt)),
                    _ => val(0, i + salt).wrapping_add(val(1, i + salt)),
                })
                .collect();
            let got = unsafe { copy_from_device(b + recv_off, out_len * 4) }.unwrap();
            assert!(got == bytes(want), "GPU {r}: {kind:?} of {count} int32 at +{send_off}/+{recv_off} wrong");
            let (d0, w0) = before[r];
            let (d1, w1) = calls(r);
            let took = (d1 - d0, w1 - w0);
            assert_eq!(took, expect, "GPU {r}: {kind:?} +{send_off}: (direct, window) calls");
        }
        eprintln!("{kind:?} of {count} int32 at +{send_off}/+{recv_off}: exact on both GPUs, (direct, window) calls: {expect:?}");
    };
    for (salt, &(kind, so, ro, count, direct)) in cases.iter().enumerate() {
        run(kind, so, ro, count, if direct { (1, 1) } else { (0, 0) }, salt);
    }
    // Bad input on one rank: host memory on rank 1. Both ranks fail naming rank 1, and no
    // window is kept on either.
    let host = vec![0u8; 4096];
    let mut bad = [std::ptr::null_mut::<c_void>(); 2];
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, (a, _, _)) in ranks.iter().enumerate() {
        let at = if r == 1 { host.as_ptr() as u64 } else { *a };
        let rc = unsafe { ncclCommWindowRegister(comms[r], at as *mut c_void, 4096, &mut bad[r], NCCL_WIN_COLL_SYMMETRIC) };
        assert_eq!(rc, NCCL_SUCCESS, "deferred to the group's end");
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("rank 1 could not register its window") && last().contains("not GPU memory"), "{}", last());
    assert!(bad.iter().all(|w| w.is_null()));
    // Disagreeing flags.
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, (a, _, _)) in ranks.iter().enumerate() {
        let flags = if r == 0 { NCCL_WIN_COLL_SYMMETRIC } else { NCCL_WIN_DEFAULT };
        assert_eq!(unsafe { ncclCommWindowRegister(comms[r], *a as *mut c_void, 4096, &mut bad[r], flags) }, NCCL_SUCCESS);
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("rank 1 registered its window as not symmetric, rank 0 as symmetric"), "{}", last());
    for r in 0..2 {
        assert_eq!(communicator(r).ready().unwrap().windows(), 2, "rank {r}: only the two good windows");
    }
    // Deregistered: the group's calls still take the direct kernel, every rank's buffers
    // known at the group's end (`issue_group`), but no window.
    for (r, w) in wins.iter().enumerate() {
        for &w in w {
            assert_eq!(unsafe { ncclCommWindowDeregister(comms[r], w) }, NCCL_SUCCESS, "{}", last());
            assert_eq!(unsafe { ncclCommWindowDeregister(comms[r], w) }, NCCL_INVALID_ARGUMENT, "twice");
        }
    }
    run(Kind::AllReduce, 0, 0, 4 << 20, (1, 0), 9);
    for (r, (a, b, _)) in ranks.into_iter().enumerate() {
        set_device(r as i32).unwrap();
        assert_eq!(unsafe { ncclMemFree(a as *mut c_void) }, NCCL_SUCCESS, "{}", last());
        assert_eq!(unsafe { ncclMemFree(b as *mut c_void) }, NCCL_SUCCESS, "{}", last());
    }
    for c in comms {
        assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
    }
}

/// Issue #6's registration rule on two GPUs from one thread: each rank makes one
/// ncclMemAlloc allocation (CUDA VMM with a POSIX-fd handle) and carves it into buffers at the
/// same offsets on both ranks — all-reduce send and receive (one-shot and large sizes), and
/// send/recv source and destination — then the results are checked exactly, the
/// allocations are registered, deregistered and freed, and a double free, an interior
/// pointer and foreign memory are refused. Skips without `GSC_TEST_GPU=1` and 2 GPUs.
#[test]
fn mem_alloc_carved_buffers_all_reduce_and_send_recv_on_two_gpus() {
    use gscomm::cuda::api::{DeviceBuf, Stream, copy_from_device, copy_to_device, ipc_export_kind, set_device};
    if !gpus_or_skip(2) {
        return;
    }
    let comms = two_comms_from_one_thread();
    // int32 elements: 1001 (one-shot LL) and 2^20 + 3 (the large kernel, with a tail).
    const COUNTS: [usize; 2] = [1001, (1 << 20) + 3];
    let part = ((COUNTS[1] * 4) as u64).next_multiple_of(4096);
    // Offsets of the four buffers, the same on both ranks: all-reduce in/out, p2p out/in.
    let offs = [0, part, 2 * part, 3 * part];
    let total = (4 * part) as usize;
    let mut ranks = Vec::new();
    for r in 0..2 {
        set_device(r).unwrap();
        let mut p: *mut c_void = std::ptr::null_mut();
        assert_eq!(unsafe { ncclMemAlloc(&mut p, total) }, NCCL_SUCCESS, "{}", last());
        let base = p as u64;
        let info = gscomm::mem_alloc_info(base + offs[3]).expect("the allocation is booked");
        assert_eq!((info.base, info.offset, info.bytes, info.device), (base, offs[3], total, r));
        assert!(info.vmm, "GPU {r}: ncclMemAlloc fell back to cuMemAlloc (the log says why)");
        assert_eq!(info.mapped % (2 << 20), 0, "GPU {r}: {} B mapped", info.mapped);
        // Every carved buffer is recognised as VMM memory by the IPC key path.
        for off in offs {
            assert_eq!(ipc_export_kind(base + off).unwrap(), "vmm", "GPU {r}, buffer at +{off}");
        }
        ranks.push((base, Stream::new().unwrap()));
    }
    let val = |r: usize, i: usize, salt: usize| ((i * 2_654_435_761 + r * 97 + salt) as u32 as i32).wrapping_mul(3);
    let bytes = |v: Vec<i32>| v.into_iter().flat_map(i32::to_le_bytes).collect::<Vec<u8>>();
    for (salt, n) in COUNTS.into_iter().enumerate() {
        for (r, (base, _)) in ranks.iter().enumerate() {
            set_device(r as i32).unwrap();
            unsafe {
                copy_to_device(base + offs[0], &bytes((0..n).map(|i| val(r, i, salt)).collect())).unwrap();
                copy_to_device(base + offs[1], &vec![0xEE; n * 4]).unwrap();
                copy_to_device(base + offs[2], &bytes((0..n).map(|i| val(r, i, salt + 10)).collect())).unwrap();
                copy_to_device(base + offs[3], &vec![0xEE; n * 4]).unwrap();
            }
        }
        // All-reduce (int32 = 2, sum = 0) from one thread: a group, as NCCL requires.
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (base, s)) in ranks.iter().enumerate() {
            let (send, recv) = ((base + offs[0]) as *const c_void, (base + offs[1]) as *mut c_void);
            let rc = unsafe { ncclAllReduce(send, recv, n, 2, 0, comms[r], s.raw() as *mut c_void) };
            assert_eq!(rc, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        // Send/recv both ways between the carved p2p buffers.
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (base, s)) in ranks.iter().enumerate() {
            let (c, peer, s) = (comms[r], 1 - r as c_int, s.raw() as *mut c_void);
            let rc = unsafe { ncclSend((base + offs[2]) as *const c_void, n, 2, peer, c, s) };
            assert_eq!(rc, NCCL_SUCCESS, "{}", last());
            let rc = unsafe { ncclRecv((base + offs[3]) as *mut c_void, n, 2, peer, c, s) };
            assert_eq!(rc, NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        let sum = bytes((0..n).map(|i| val(0, i, salt).wrapping_add(val(1, i, salt))).collect());
        for (r, (base, s)) in ranks.iter().enumerate() {
            set_device(r as i32).unwrap();
            s.synchronize().unwrap();
            let got = unsafe { copy_from_device(base + offs[1], n * 4) }.unwrap();
            assert!(got == sum, "GPU {r}: all-reduce of {n} int32 wrong");
            let from_peer = bytes((0..n).map(|i| val(1 - r, i, salt + 10)).collect());
            let got = unsafe { copy_from_device(base + offs[3], n * 4) }.unwrap();
            assert!(got == from_peer, "GPU {r}: received {n} int32 wrong");
            eprintln!("GPU {r}: {n} int32 all-reduced and exchanged through carved ncclMemAlloc buffers");
        }
    }
    // Registration records the allocation and the offset (the same on both ranks).
    for (r, (base, _)) in ranks.iter().enumerate() {
        let mut h = std::ptr::null_mut();
        let buf = (base + offs[2]) as *mut c_void;
        assert_eq!(unsafe { ncclCommRegister(comms[r], buf, part as usize, &mut h) }, NCCL_SUCCESS, "{}", last());
        // SAFETY: a live handle from ncclCommRegister.
        let reg = unsafe { *(h as *const Registration) };
        assert_eq!(reg.mem_alloc.map(|m| (m.base, m.offset)), Some((*base, offs[2])));
        assert_eq!(unsafe { ncclCommDeregister(comms[r], h) }, NCCL_SUCCESS);
    }
    for c in comms {
        assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
    }
    set_device(0).unwrap();
    let foreign = DeviceBuf::new(64).unwrap();
    assert_eq!(unsafe { ncclMemFree(foreign.ptr() as *mut c_void) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("not allocated by mem_alloc"), "{}", last());
    for (r, (base, s)) in ranks.into_iter().enumerate() {
        set_device(r as i32).unwrap();
        drop(s);
        let interior = (base + 256) as *mut c_void;
        assert_eq!(unsafe { ncclMemFree(interior) }, NCCL_INVALID_ARGUMENT);
        assert!(last().contains("lies 256 bytes into the allocation"), "{}", last());
        assert_eq!(unsafe { ncclMemFree(base as *mut c_void) }, NCCL_SUCCESS, "GPU {r}: {}", last());
        assert_eq!(unsafe { ncclMemFree(base as *mut c_void) }, NCCL_INVALID_ARGUMENT, "GPU {r}: a double free");
        assert!(last().contains("double free"), "{}", last());
        assert!(gscomm::mem_alloc_info(base).is_none());
    }
}

/// nccl.h 2.28's all-to-all, gather and scatter on two GPUs from one thread, each call of
/// the two ranks in one group as NCCL requires (and nccl-tests does): the kernel's sizes
/// and one past GSC_COLL_P2P_MAX's default (the engine), gather and scatter out of place
/// and in place, results checked exactly. The communicators come from
/// ncclCommInitRankScalable with two ids. Skips without `GSC_TEST_GPU=1` and 2 GPUs.
#[test]
fn alltoall_gather_and_scatter_on_two_gpus() {
    use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
    if !gpus_or_skip(2) {
        return;
    }
    let mut ids = [ncclUniqueId { internal: [0; 128] }; 2];
    for id in ids.iter_mut() {
        assert_eq!(unsafe { ncclGetUniqueId(id) }, NCCL_SUCCESS);
    }
    let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, c) in comms.iter_mut().enumerate() {
        set_device(r as i32).unwrap();
        let rc = unsafe { ncclCommInitRankScalable(c, 2, r as c_int, 2, ids.as_mut_ptr(), std::ptr::null_mut()) };
        assert_eq!(rc, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
    // int32 elements per part: 1, odd, 2^20 + 3, and 9 Mi (36 MiB: the engine's path).
    const UINT32: c_int = 3; // ncclUint32
    let counts = [1usize, 1001, (1 << 20) + 3, 9 << 20];
    let max = counts[3] * 4;
    let val = |r: usize, i: usize, salt: usize| (i as u32).wrapping_mul(2_654_435_761).wrapping_add((r * 97 + salt) as u32);
    let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let gpus: Vec<(DeviceBuf, DeviceBuf, Stream)> = (0..2)
        .map(|r| {
            set_device(r).unwrap();
            (DeviceBuf::new(2 * max).unwrap(), DeviceBuf::new(2 * max).unwrap(), Stream::new().unwrap())
        })
        .collect();
    let group = |call: &dyn Fn(usize, u64, u64, *mut c_void) -> ncclResult_t| {
        assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
        for (r, (send, recv, stream)) in gpus.iter().enumerate() {
            assert_eq!(call(r, send.ptr(), recv.ptr(), stream.raw() as *mut c_void), NCCL_SUCCESS, "{}", last());
        }
        assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
        for (r, (_, _, stream)) in gpus.iter().enumerate() {
            set_device(r as i32).unwrap();
            stream.synchronize().unwrap();
        }
    };
    let fill = |salt: usize, n: usize| {
        for (r, (send, recv, _)) in gpus.iter().enumerate() {
            set_device(r as i32).unwrap();
            send.upload(&le(&(0..2 * n).map(|i| val(r, i, salt)).collect::<Vec<_>>())).unwrap();
            recv.fill(0xEE).unwrap();
        }
    };
    let got = |r: usize, which: usize, n: usize| -> Vec<u8> {
        set_device(r as i32).unwrap();
        let b = if which == 0 { &gpus[r].0 } else { &gpus[r].1 };
        b.download().unwrap()[..2 * n * 4].to_vec()
    };
    for (salt, n) in counts.into_iter().enumerate() {
        // All-to-all: rank r's part j goes to part r of rank j.
        fill(salt, n);
        group(&|r, send, recv, s| unsafe { ncclAlltoAll(send as *const c_void, recv as *mut c_void, n, UINT32, comms[r], s) });
        for r in 0..2 {
            let want: Vec<u32> = (0..2).flat_map(|j| (0..n).map(move |i| val(j, r * n + i, salt))).collect();
            assert!(got(r, 1, n) == le(&want), "GPU {r}: all-to-all of {n} int32 per part wrong");
        }
        // Gather to rank 1, out of place: part j of its receive buffer is rank j's input.
        fill(salt + 10, n);
        group(&|r, send, recv, s| unsafe { ncclGather(send as *const c_void, recv as *mut c_void, n, UINT32, 1, comms[r], s) });
        let want: Vec<u32> = (0..2).flat_map(|j| (0..n).map(move |i| val(j, i, salt + 10))).collect();
        assert!(got(1, 1, n) == le(&want), "gather of {n} int32 to rank 1 wrong");
        // Gather to rank 0, in place: its input is already part 0 of its send buffer,
        // which is also the receive buffer.
        fill(salt + 20, n);
        group(&|r, send, _, s| {
            let recv = if r == 0 { send } else { 0 };
            unsafe { ncclGather(send as *const c_void, recv as *mut c_void, n, UINT32, 0, comms[r], s) }
        });
        let want: Vec<u32> = (0..n).map(|i| val(0, i, salt + 20)).chain((0..n).map(|i| val(1, i, salt + 20))).collect();
        assert!(got(0, 0, n) == le(&want), "in-place gather of {n} int32 to rank 0 wrong");
        // Scatter from rank 0, out of place: rank j gets part j of rank 0's input.
        fill(salt + 30, n);
        group(&|r, send, recv, s| unsafe { ncclScatter(send as *const c_void, recv as *mut c_void, n, UINT32, 0, comms[r], s) });
        for r in 0..2 {
            let want: Vec<u32> = (0..n).map(|i| val(0, r * n + i, salt + 30)).collect();
            assert!(got(r, 1, n)[..n * 4] == le(&want), "GPU {r}: scatter of {n} int32 from rank 0 wrong");
        }
        // Scatter from rank 1, in place: its receive buffer is its own part of its input.
        fill(salt + 40, n);
        group(&|r, send, recv, s| {
            let recv = if r == 1 { send + (n * 4) as u64 } else { recv };
            unsafe { ncclScatter(send as *const c_void, recv as *mut c_void, n, UINT32, 1, comms[r], s) }
        });
        let want: Vec<u32> = (0..n).map(|i| val(1, i, salt + 40)).collect();
        assert!(got(0, 1, n)[..n * 4] == le(&want), "in-place scatter of {n} int32 to rank 0 wrong");
        let want: Vec<u32> = (0..2 * n).map(|i| val(1, i, salt + 40)).collect();
        assert!(got(1, 0, n) == le(&want), "in-place scatter from rank 1 changed its own part");
        eprintln!("{n} int32 per part: all-to-all, gather and scatter (in place and not) exact on both GPUs");
    }
    // A root out of range is refused before anything is issued.
    let (send, recv, stream) = &gpus[0];
    let rc =
        unsafe { ncclGather(send.ptr() as *const c_void, recv.ptr() as *mut c_void, 1, UINT32, 2, comms[0], stream.raw() as *mut c_void) };
    assert_eq!(rc, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("root 2 of a communicator of 2 ranks"), "{}", last());
    for c in comms {
        assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
    }
}

/// Fault tolerance on two GPUs, as PyTorch's shrink_group uses it. Rank 1 is gone (aborted)
/// while rank 0 has an all-reduce waiting for it: rank 0's shrink with NCCL_SHRINK_ABORT
/// stops that all-reduce (its stream completes, well inside the 1 h timeout) and makes a
/// one-rank communicator that works, while the parent refuses collectives as revoked. Then
/// two fresh ranks revoke: a second revoke is an error, their async errors read success,
/// and a split of the revoked pair (ranks reversed) all-reduces right. Skips without GPUs.
#[test]
fn shrink_after_a_rank_dies_and_revoke_on_two_gpus() {
    use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
    if !gpus_or_skip(2) {
        return;
    }
    const FLOAT: c_int = 7;
    let count = 1024;
    let init_two = || {
        let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
        assert_eq!(unsafe { ncclCommInitAll(comms.as_mut_ptr(), 2, [0, 1].as_ptr()) }, NCCL_SUCCESS, "{}", last());
        comms
    };
    let floats = |v: f32| (0..count).flat_map(|_| v.to_le_bytes()).collect::<Vec<u8>>();
    let buffers = |r: i32, v: f32| {
        set_device(r).unwrap();
        let send = DeviceBuf::new(count * 4).unwrap();
        send.upload(&floats(v)).unwrap();
        let recv = DeviceBuf::new(count * 4).unwrap();
        recv.fill(0).unwrap();
        (send, recv, Stream::new().unwrap())
    };
    let all_reduce = |comm, (send, recv, stream): &(DeviceBuf, DeviceBuf, Stream)| unsafe {
        ncclAllReduce(send.ptr() as *const c_void, recv.ptr() as *mut c_void, count, FLOAT, 0, comm, stream.raw() as *mut c_void)
    };
    let comms = init_two();
    let b0 = buffers(0, 1.5);
    assert_eq!(unsafe { ncclCommAbort(comms[1]) }, NCCL_SUCCESS);
    assert_eq!(all_reduce(comms[0], &b0), NCCL_SUCCESS, "{}", last());
    std::thread::sleep(Duration::from_millis(300));
    assert!(!b0.2.query().unwrap(), "the all-reduce did not wait for the aborted rank");
    let mut small: ncclComm_t = std::ptr::null_mut();
    let mut exclude = [1 as c_int];
    let rc = unsafe { ncclCommShrink(comms[0], exclude.as_mut_ptr(), 1, &mut small, std::ptr::null_mut(), NCCL_SHRINK_ABORT) };
    assert_eq!(rc, NCCL_SUCCESS, "{}", last());
    let t0 = std::time::Instant::now();
    while !b0.2.query().unwrap() {
        assert!(t0.elapsed() < Duration::from_secs(20), "the shrink did not stop the all-reduce waiting for rank 1");
        std::thread::sleep(Duration::from_millis(1));
    }
    let (mut n, mut rank) = (0, -1);
    assert_eq!(unsafe { ncclCommCount(small, &mut n) }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclCommUserRank(small, &mut rank) }, NCCL_SUCCESS);
    assert_eq!((n, rank), (1, 0));
    assert_eq!(all_reduce(small, &b0), NCCL_SUCCESS, "{}", last());
    b0.2.synchronize().unwrap();
    assert!(b0.1.download().unwrap() == floats(1.5), "a one-rank all-reduce is a copy");
    assert_eq!(all_reduce(comms[0], &b0), NCCL_INVALID_USAGE);
    assert!(last().contains("revoked"), "{}", last());
    let mut e = -1;
    assert_eq!(unsafe { ncclCommGetAsyncError(comms[0], &mut e) }, NCCL_SUCCESS);
    assert_eq!(e, NCCL_SUCCESS, "a revoked communicator's async error");
    for c in [small, comms[0]] {
        assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
    }

    let comms = init_two();
    for c in comms {
        assert_eq!(unsafe { ncclCommRevoke(c, 0) }, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclCommRevoke(comms[0], 0) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("revoke: the communicator was revoked"), "{}", last());
    let bufs = [buffers(0, 1.0), buffers(1, 2.0)];
    assert_eq!(all_reduce(comms[1], &bufs[1]), NCCL_INVALID_USAGE);
    let mut subs: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, sub) in subs.iter_mut().enumerate() {
        let rc = unsafe { ncclCommSplit(comms[r], 0, 1 - r as c_int, sub, std::ptr::null_mut()) };
        assert_eq!(rc, NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS, "{}", last());
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    for (r, sub) in subs.iter().enumerate() {
        let mut rank = -1;
        assert_eq!(unsafe { ncclCommUserRank(*sub, &mut rank) }, NCCL_SUCCESS);
        assert_eq!(rank, 1 - r as c_int, "split by reversed keys");
        assert_eq!(all_reduce(*sub, &bufs[r]), NCCL_SUCCESS, "{}", last());
    }
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
    for (_, recv, stream) in &bufs {
        stream.synchronize().unwrap();
        assert!(recv.download().unwrap() == floats(3.0), "all-reduce on the split of revoked communicators");
    }
    for c in subs.into_iter().chain(comms) {
        assert_eq!(unsafe { ncclCommDestroy(c) }, NCCL_SUCCESS);
    }
}

#[test]
fn premul_operators_are_looked_up_by_type_and_destroyed_once() {
    let (comm, c) = new_handle(Comm::new());
    c.premul_ops.lock().unwrap().push(Some((DataType::Float32, PreMulScalar::Value(7))));
    assert_eq!(c.premul(NCCL_NUM_OPS, DataType::Float32).unwrap(), Some(PreMulScalar::Value(7)));
    assert_eq!(c.premul(0, DataType::Float32).unwrap(), None, "a built-in operator");
    assert!(c.premul(NCCL_NUM_OPS, DataType::Int32).unwrap_err().1.contains("made for float data, not int32"));
    assert!(c.premul(NCCL_NUM_OPS + 1, DataType::Float32).is_err());
    assert_eq!(unsafe { ncclRedOpDestroy(NCCL_NUM_OPS, comm) }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclRedOpDestroy(NCCL_NUM_OPS, comm) }, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("not a live ncclRedOpCreatePreMulSum operator"), "{}", last());
    assert!(c.premul(NCCL_NUM_OPS, DataType::Float32).is_err(), "destroyed");
    assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_SUCCESS);
}

/// Issue #8: ncclCommAbort from one thread while others are inside calls on the same
/// communicator (a watchdog polling ncclCommGetAsyncError, a thread enqueueing collectives),
/// at random moments. Every call returns a result code (no crash, no read of freed memory),
/// every call after the abort is refused as a stale handle, a second abort and a destroy
/// after it are refused too, and the communicator is freed once the last call returned.
/// Here the communicator is still initializing or its init failed (no GPU needed); the GPU
/// test below does the same with collectives running.
#[test]
fn abort_while_other_threads_are_inside_calls_on_the_communicator() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..200 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let (comm, c) = new_handle(Comm::new());
        if round % 2 == 1 {
            let _ = c.state.set(Err(Fail(NCCL_REMOTE_ERROR, "rank 1 went away".into())));
        }
        let freed = Arc::downgrade(&c);
        drop(c);
        let addr = comm as usize;
        let callers: Vec<_> = (0..3)
            .map(|who| {
                std::thread::spawn(move || {
                    let comm = addr as ncclComm_t;
                    let t0 = std::time::Instant::now();
                    let mut calls = 0u32;
                    loop {
                        let mut err = -1;
                        let mut n = -1;
                        let r = match who {
                            0 => unsafe { ncclCommGetAsyncError(comm, &mut err) },
                            1 => unsafe { ncclCommCount(comm, &mut n) },
                            // No GPU: the stream's condition cannot be made, or the init
                            // is not done; either way a result code, never a crash.
                            _ => unsafe { ncclAllReduce(std::ptr::null(), std::ptr::null_mut(), 1, 7, 0, comm, std::ptr::null_mut()) },
                        };
                        calls += 1;
                        if r == NCCL_INVALID_ARGUMENT {
                            assert!(last().contains("not a live communicator"), "caller {who}: {}", last());
                            return calls;
                        }
                        match who {
                            0 => assert!(r == NCCL_SUCCESS && (err == NCCL_IN_PROGRESS || err == NCCL_REMOTE_ERROR), "r {r} err {err}"),
                            1 => assert!(r == NCCL_IN_PROGRESS || r == NCCL_REMOTE_ERROR, "count: {r}"),
                            _ => assert_ne!(r, NCCL_SUCCESS, "an all-reduce on a communicator without a GPU"),
                        }
                        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "caller {who} never saw the abort");
                    }
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_micros(seed % 2000));
        assert_eq!(unsafe { ncclCommAbort(comm) }, NCCL_SUCCESS, "round {round}: {}", last());
        assert_eq!(unsafe { ncclCommAbort(comm) }, NCCL_INVALID_ARGUMENT, "round {round}: a second abort");
        assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_INVALID_ARGUMENT, "round {round}: destroy after abort");
        for t in callers {
            assert!(t.join().unwrap() > 0);
        }
        assert!(freed.upgrade().is_none(), "round {round}: the communicator outlived every call");
    }
    // Handles that were never made, and NULL, are refused the same way.
    let mut err = 0;
    assert_eq!(unsafe { ncclCommGetAsyncError((HANDLE_BASE + 8) as ncclComm_t, &mut err) }, NCCL_INVALID_ARGUMENT);
    assert_eq!(unsafe { ncclCommAbort(std::ptr::null_mut()) }, NCCL_INVALID_ARGUMENT);
    let mut local = 0u64;
    assert_eq!(unsafe { ncclCommDestroy(&mut local as *mut u64 as ncclComm_t) }, NCCL_INVALID_ARGUMENT);
}

/// The same on a GPU: a one-rank communicator, one thread enqueueing all-reduces on a
/// stream and another polling ncclCommGetAsyncError, aborted from the test's thread at a
/// random moment, 20 rounds. Calls after the abort are refused, the stream drains within
/// seconds, and the communicator is freed. Skips without `GSC_TEST_GPU=1` and a GPU.
#[test]
fn abort_while_collectives_are_enqueued_on_a_gpu() {
    use gscomm::cuda::api::{DeviceBuf, Stream, set_device};
    if !gpus_or_skip(1) {
        return;
    }
    set_device(0).unwrap();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for round in 0..20 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut id = ncclUniqueId { internal: [0; 128] };
        assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, NCCL_SUCCESS);
        let mut comm: ncclComm_t = std::ptr::null_mut();
        assert_eq!(unsafe { ncclCommInitRank(&mut comm, 1, id, 0) }, NCCL_SUCCESS, "{}", last());
        let freed = Arc::downgrade(&comm_ref(comm).unwrap());
        let addr = comm as usize;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let enqueuer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                set_device(0).unwrap();
                let stream = Stream::new().unwrap();
                let (send, recv) = (DeviceBuf::new(1 << 20).unwrap(), DeviceBuf::new(1 << 20).unwrap());
                let mut launched = 0u32;
                let r = loop {
                    let r = unsafe {
                        ncclAllReduce(
                            send.ptr() as *const c_void,
                            recv.ptr() as *mut c_void,
                            1 << 18,
                            7,
                            0,
                            addr as ncclComm_t,
                            stream.raw() as *mut c_void,
                        )
                    };
                    if r != NCCL_SUCCESS || stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break r;
                    }
                    launched += 1;
                };
                // A call that took the communicator just before the abort fails with the
                // abort's error; one after it is refused as a stale handle.
                let why = if r == NCCL_SUCCESS { String::new() } else { last() };
                // Whatever was queued before the abort drains: nothing waits forever.
                let t0 = std::time::Instant::now();
                stream.synchronize().unwrap();
                (r, why, launched, t0.elapsed())
            })
        };
        let watchdog = std::thread::spawn(move || {
            loop {
                let mut err = -1;
                let r = unsafe { ncclCommGetAsyncError(addr as ncclComm_t, &mut err) };
                if r != NCCL_SUCCESS {
                    return r;
                }
                // The abort's own error (Aborted, which maps to ncclInternalError), seen by
                // a call that raced it, is the only one.
                assert!(err == NCCL_SUCCESS || err == NCCL_INTERNAL_ERROR, "async error {err}");
            }
        });
        std::thread::sleep(std::time::Duration::from_micros(500 + seed % 20_000));
        assert_eq!(unsafe { ncclCommAbort(comm) }, NCCL_SUCCESS, "round {round}: {}", last());
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let (r, why, launched, drained) = enqueuer.join().unwrap();
        assert!(
            r == NCCL_SUCCESS || why.contains("not a live communicator") || why.contains("aborted"),
            "round {round}: the enqueuing thread's last call gave {r}: {why}"
        );
        assert!(drained < std::time::Duration::from_secs(10), "round {round}: the stream drained in {drained:?}");
        assert_eq!(watchdog.join().unwrap(), NCCL_INVALID_ARGUMENT, "round {round}: the watchdog after the abort");
        assert_eq!(unsafe { ncclCommDestroy(comm) }, NCCL_INVALID_ARGUMENT);
        assert!(freed.upgrade().is_none(), "round {round}: the communicator outlived every call");
        eprintln!("round {round}: {launched} all-reduces enqueued before the abort; the stream drained in {drained:?}");
    }
}

/// The sends and receives each rank of an all-to-all, gather and scatter makes: parts at
/// their offsets, the root's own part skipped in place, and bad roots and parts past the
/// end of the address space named.
#[test]
fn all_to_all_gather_and_scatter_parts() {
    let list = |g: Vec<PeerTransfer>| -> Vec<(char, u64, usize, usize)> {
        g.into_iter().map(|t| (if t.op == PeerOp::Send { 's' } else { 'r' }, t.buf, t.bytes, t.peer)).collect()
    };
    // As ncclGather and ncclScatter call it (send and receive buffers, root, rank, ranks, bytes).
    let gather = |send, recv, root, rank, n, b| rooted_parts(send, recv, true, root, rank, n, b);
    let scatter = |send, recv, root, rank, n, b| rooted_parts(recv, send, false, root, rank, n, b);
    let (send, recv) = (0x1000u64, 0x9000u64);
    assert_eq!(
        list(alltoall_parts(send, recv, 3, 16).unwrap()),
        [
            ('s', 0x1000, 16, 0),
            ('r', 0x9000, 16, 0),
            ('s', 0x1010, 16, 1),
            ('r', 0x9010, 16, 1),
            ('s', 0x1020, 16, 2),
            ('r', 0x9020, 16, 2)
        ]
    );
    // Gather to root 1 of 3: everyone sends; the root receives part i from rank i.
    assert_eq!(list(gather(send, recv, 1, 0, 3, 16).unwrap()), [('s', 0x1000, 16, 1)]);
    assert_eq!(
        list(gather(send, recv, 1, 1, 3, 16).unwrap()),
        [('s', 0x1000, 16, 1), ('r', 0x9000, 16, 0), ('r', 0x9010, 16, 1), ('r', 0x9020, 16, 2)]
    );
    // In place at the root (its input is its own part): nothing to itself.
    let own = 0x9010u64;
    assert_eq!(list(gather(own, recv, 1, 1, 3, 16).unwrap()), [('r', 0x9000, 16, 0), ('r', 0x9020, 16, 2)]);
    // Scatter from root 2 of 3, out of place and in place.
    assert_eq!(list(scatter(send, recv, 2, 0, 3, 16).unwrap()), [('r', 0x9000, 16, 2)]);
    assert_eq!(
        list(scatter(send, recv, 2, 2, 3, 16).unwrap()),
        [('s', 0x1000, 16, 0), ('s', 0x1010, 16, 1), ('s', 0x1020, 16, 2), ('r', 0x9000, 16, 2)]
    );
    let own = 0x1020u64;
    assert_eq!(list(scatter(send, own, 2, 2, 3, 16).unwrap()), [('s', 0x1000, 16, 0), ('s', 0x1010, 16, 1)]);
    assert!(root_rank(3, 3).unwrap_err().1.contains("root 3 of a communicator of 3 ranks"));
    assert!(root_rank(-1, 3).is_err());
    let high = u64::MAX - 8;
    assert!(alltoall_parts(high, recv, 2, 16).unwrap_err().1.contains("past the end of the address space"));
}

#[test]
fn new_entry_points_refuse_bad_arguments_and_say_what_is_not_supported() {
    assert_eq!(
        unsafe { ncclAlltoAll(std::ptr::null(), std::ptr::null_mut(), 1, 7, std::ptr::null_mut(), std::ptr::null_mut()) },
        NCCL_INVALID_ARGUMENT
    );
    assert!(last().contains("ncclAlltoAll: comm is NULL"), "{}", last());
    assert_eq!(
        unsafe { ncclGather(std::ptr::null(), std::ptr::null_mut(), 1, 7, 0, std::ptr::null_mut(), std::ptr::null_mut()) },
        NCCL_INVALID_ARGUMENT
    );
    assert!(last().contains("ncclGather: comm is NULL"), "{}", last());
    let mut ids = [ncclUniqueId { internal: [0; 128] }; 2];
    let mut comm: ncclComm_t = std::ptr::null_mut();
    let r = unsafe { ncclCommInitRankScalable(&mut comm, 2, 0, 0, ids.as_mut_ptr(), std::ptr::null_mut()) };
    assert_eq!(r, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("nId 0 (from 1 to nranks, 2)"), "{}", last());
    let r = unsafe { ncclCommInitRankScalable(&mut comm, 2, 0, 3, ids.as_mut_ptr(), std::ptr::null_mut()) };
    assert_eq!(r, NCCL_INVALID_ARGUMENT);
    let r = unsafe { ncclCommInitRankScalable(&mut comm, 2, 0, 1, std::ptr::null_mut(), std::ptr::null_mut()) };
    assert_eq!(r, NCCL_INVALID_ARGUMENT);
    assert!(last().contains("commIds is NULL"), "{}", last());
    assert!(comm.is_null());
    // Shrink and revoke name each bad argument before they look at the communicator (here
    // one whose init failed), and change nothing.
    let (failed, c) = new_handle(Comm::new());
    let _ = c.state.set(Err(Fail(NCCL_REMOTE_ERROR, "rank 1 went away".into())));
    let mut newcomm: ncclComm_t = std::ptr::null_mut();
    let list = [1 as c_int, -2];
    let null = std::ptr::null_mut();
    let shrink = |list: *mut c_int, n, newcomm, flags| unsafe { ncclCommShrink(failed, list, n, newcomm, null, flags) };
    let nc: *mut ncclComm_t = &mut newcomm;
    let calls: [(&dyn Fn() -> ncclResult_t, &str); 7] = [
        (&|| unsafe { ncclCommShrink(null as ncclComm_t, list.as_ptr() as *mut c_int, 1, nc, null, 0) }, "comm is NULL"),
        (&|| shrink(list.as_ptr() as *mut c_int, 1, null as *mut ncclComm_t, 0), "newcomm is NULL"),
        (&|| shrink(list.as_ptr() as *mut c_int, 1, nc, 4), "shrinkFlags 0x4"),
        (&|| shrink(list.as_ptr() as *mut c_int, 0, nc, 0), "excludeRanksCount 0"),
        (&|| shrink(null as *mut c_int, 1, nc, 0), "excludeRanksList is NULL"),
        (&|| shrink(list.as_ptr() as *mut c_int, 2, nc, 1), "rank -2 in excludeRanksList"),
        (&|| unsafe { ncclCommRevoke(failed, 1) }, "revokeFlags 1"),
    ];
    for (call, says) in calls {
        assert_eq!(call(), NCCL_INVALID_ARGUMENT, "{says}: {}", last());
        assert!(last().contains(says), "{says}: {}", last());
    }
    assert_eq!(shrink(list.as_ptr() as *mut c_int, 1, nc, 1), NCCL_REMOTE_ERROR);
    assert!(last().contains("ncclCommShrink: the communicator's init failed"), "{}", last());
    assert_eq!(unsafe { ncclCommRevoke(failed, 0) }, NCCL_REMOTE_ERROR);
    assert!(newcomm.is_null());
    assert_eq!(unsafe { ncclCommDestroy(failed) }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclGroupSimulateEnd(std::ptr::null_mut()) }, NCCL_INVALID_USAGE);
    assert_eq!(unsafe { ncclDevCommCreate(std::ptr::null_mut(), std::ptr::null(), std::ptr::null_mut()) }, NCCL_INVALID_USAGE);
}

#[test]
fn groups_nest_and_unbalanced_end_is_an_error() {
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclGroupStart() }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_SUCCESS);
    assert_eq!(unsafe { ncclGroupEnd() }, NCCL_INVALID_USAGE);
    assert!(last().contains("without ncclGroupStart"));
}

#[test]
fn datatypes_and_ops_follow_nccl_h() {
    assert!(matches!(types(7, Some(0)), Ok((DataType::Float32, RedOp::Sum))));
    assert!(matches!(types(9, Some(4)), Ok((DataType::Bfloat16, RedOp::Avg))));
    assert!(matches!(types(10, Some(4)), Ok((DataType::Float8E4M3, RedOp::Avg))));
    assert!(matches!(types(11, None), Ok((DataType::Float8E5M2, RedOp::Sum))));
    assert!(types(12, Some(0)).is_err(), "ncclNumTypes is not a type");
    assert!(types(7, Some(5)).is_err(), "pre-multiplied sum ops are not created");
}
