//! Collectives on kernel-triggered conditions, between processes, one GPU each: a user kernel
//! fills its input, starts the collective with `gsc_trigger`, waits with `gsc_wait` and checks
//! the result, round after round with new data, for every collective, at sizes that take each
//! path (one-shot, the 64 KiB rounds, the large kernels, the direct kernel; then the copy
//! engines and the copy-engine ring on communicators split off with them on). And a rank
//! killed while a survivor's kernel waits for a triggered all-reduce: the wait returns -1
//! within the timeout, and the condition and the communicator report it.
//!
//! Skips with a printed reason unless `GSC_TEST_GPU=1` and enough GPUs are there (four ranks:
//! or `GSC_TEST_SHARE_GPUS=1`); the device machines run it through `.gpu/run.sh`.
mod common;

use common::*;
use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::collectives::types::reduce_reference;
use gscomm::collectives::{Communicator, DataType, RedOp};
use gscomm::condition::{Category, Condition};
use gscomm::cuda::api::{DeviceBuf, Function, Module, PinnedBuf, Stream, device_count, gpu_test_skip_reason, set_device};
use gscomm::{Context, Status};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(240);

/// The user's kernel: one block, `rounds` rounds of fill, trigger, wait, check. Floats that are
/// small integers, so sums are exact in any order. `result[0]`: wrong elements, `result[1]`:
/// waits that returned -1 (the kernel then stops).
const KERNELS: &str = r#"
enum { K_ALL_REDUCE = 0, K_ALL_GATHER = 1, K_REDUCE_SCATTER = 2, K_BROADCAST = 3, K_REDUCE = 4 };

static __device__ float value(unsigned long long q, unsigned long long r, unsigned long long i)
{
    return (float)((long long)((i * 7 + q * 13 + r * 5) % 11) - 5);
}

static __device__ float sum_over_ranks(unsigned long long n, unsigned long long r, unsigned long long i)
{
    float s = 0;
    for (unsigned long long q = 0; q < n; q++) s += value(q, r, i);
    return s;
}

extern "C" __global__ void triggered_rounds(gsc_device_handle_t *h, float *send, const float *recv, unsigned long long count,
                                            unsigned long long kind, unsigned long long root, unsigned long long rank,
                                            unsigned long long n, unsigned long long first, unsigned long long rounds,
                                            unsigned long long *result)
{
    __shared__ int failed;
    const unsigned long long send_len = kind == K_REDUCE_SCATTER ? n * count : count;
    const unsigned long long recv_len = kind == K_ALL_GATHER ? n * count : count;
    for (unsigned long long r = first; r < first + rounds; r++) {
        for (unsigned long long i = threadIdx.x; i < send_len; i += blockDim.x) send[i] = value(rank, r, i);
        __syncthreads();
        if (threadIdx.x == 0) {
            gsc_trigger(h);
            failed = gsc_wait(h) != 0;
        }
        __syncthreads();
        if (failed) {
            if (threadIdx.x == 0) atomicAdd(&result[1], 1ull);
            return;
        }
        if (kind == K_REDUCE && rank != root) continue;
        for (unsigned long long i = threadIdx.x; i < recv_len; i += blockDim.x) {
            float want;
            switch (kind) {
            case K_ALL_REDUCE: case K_REDUCE: want = sum_over_ranks(n, r, i); break;
            case K_ALL_GATHER: want = value(i / count, r, i % count); break;
            case K_REDUCE_SCATTER: want = sum_over_ranks(n, r, rank * count + i); break;
            default: want = value(root, r, i); break;
            }
            if (recv[i] != want) atomicAdd(&result[0], 1ull);
        }
        __syncthreads();
    }
}

/* One thread: trigger the collective once and wait for it (the host wrote the input and checks
 * the result). result[1] counts failed waits. */
extern "C" __global__ void trigger_once(gsc_device_handle_t *h, unsigned long long *result)
{
    gsc_trigger(h);
    if (gsc_wait(h) != 0) atomicAdd(&result[1], 1ull);
}
"#;

#[derive(Copy, Clone, Debug)]
enum Kind {
    AllReduce = 0,
    AllGather = 1,
    ReduceScatter = 2,
    Broadcast = 3,
    Reduce = 4,
}

const KINDS: [Kind; 5] = [Kind::AllReduce, Kind::AllGather, Kind::ReduceScatter, Kind::Broadcast, Kind::Reduce];

struct UserKernel {
    rounds: Function,
    once: Function,
    _m: Module,
}

fn user_kernel() -> UserKernel {
    let src = format!("{}\n{KERNELS}", include_str!("../include/gsc_device.cuh"));
    let m = Module::compile(&src).expect("compile the triggering kernel");
    UserKernel { rounds: m.function("triggered_rounds").unwrap(), once: m.function("trigger_once").unwrap(), _m: m }
}

/// Arm `kind` of `count` floats on `cond` (root: the last rank); returns the device handle.
fn arm(comm: &Communicator, kind: Kind, send: &DeviceBuf, recv: &DeviceBuf, count: usize, cond: &Condition) -> gscomm::Result<u64> {
    let root = comm.nranks() - 1;
    let (s, r, f) = (send.ptr(), recv.ptr(), DataType::Float32);
    // SAFETY: both buffers are this rank's device memory of the sizes `kind` needs, alive until
    // the kernels that trigger the collective have finished (the caller synchronizes first).
    let out = unsafe {
        match kind {
            Kind::AllReduce => comm.all_reduce(s, r, count, f, RedOp::Sum, cond),
            Kind::AllGather => comm.all_gather(s, r, count, f, cond),
            Kind::ReduceScatter => comm.reduce_scatter(s, r, count, f, RedOp::Sum, cond),
            Kind::Broadcast => comm.broadcast(s, r, count, f, root, cond),
            Kind::Reduce => comm.reduce(s, r, count, f, RedOp::Sum, root, cond),
        }
    }?;
    Ok(out.device_handle)
}

/// Run the user's kernel for `rounds` rounds from round `first` on `stream`, as rank `rank` of
/// `n`; (wrong elements, failed waits). Fails the test if the kernel has not finished within `limit`.
#[allow(clippy::too_many_arguments)]
fn run_rounds(
    k: &UserKernel,
    stream: &Arc<Stream>,
    (n, rank): (usize, usize),
    handle: u64,
    kind: Kind,
    bufs: (&DeviceBuf, &DeviceBuf),
    count: usize,
    (first, rounds): (u64, u64),
    limit: Duration,
) -> (u64, u64) {
    let result = PinnedBuf::new(16).unwrap();
    let args = [
        handle,
        bufs.0.ptr(),
        bufs.1.ptr(),
        count as u64,
        kind as u64,
        (n - 1) as u64,
        rank as u64,
        n as u64,
        first,
        rounds,
        result.device_ptr(),
    ];
    k.rounds.launch(1, 512, stream, &args).unwrap();
    let s = stream.clone();
    let (synced, _) = bounded(&format!("the kernel triggering {kind:?} of {count} floats"), limit, move || s.synchronize());
    synced.unwrap();
    let v = result.to_vec();
    (u64::from_le_bytes(v[..8].try_into().unwrap()), u64::from_le_bytes(v[8..].try_into().unwrap()))
}

/// Every collective at every count, armed once and triggered `rounds` times by the kernel;
/// problems found, one per line. `label` names the communicator's configuration.
fn triggered_cases(comm: &Communicator, k: &UserKernel, counts: &[usize], label: &str) -> Vec<String> {
    let (n, me) = (comm.nranks(), comm.rank());
    let stream = Arc::new(Stream::new().unwrap());
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let mut bad = Vec::new();
    for &count in counts {
        for kind in KINDS {
            let (send_len, recv_len) = match kind {
                Kind::AllGather => (count, n * count),
                Kind::ReduceScatter => (n * count, count),
                _ => (count, count),
            };
            let send = DeviceBuf::new(send_len.max(1) * 4).unwrap();
            let recv = DeviceBuf::new(recv_len.max(1) * 4).unwrap();
            let handle = match arm(comm, kind, &send, &recv, count, &cond) {
                Ok(h) => h,
                Err(e) => {
                    bad.push(format!("rank {me} {label}: arming {kind:?} of {count}: {e}"));
                    continue;
                }
            };
            let rounds = if count >= 1 << 20 { 3 } else { 20 };
            let (wrong, failed) = run_rounds(k, &stream, (n, me), handle, kind, (&send, &recv), count, (1, rounds), T);
            if wrong != 0 || failed != 0 {
                bad.push(format!("rank {me} {label}: {kind:?} of {count} floats: {wrong} wrong elements, {failed} failed waits"));
            }
            // The same handle again later: the operation continues from its last trigger.
            let (wrong, failed) = run_rounds(k, &stream, (n, me), handle, kind, (&send, &recv), count, (100, 2), T);
            if wrong != 0 || failed != 0 {
                bad.push(format!("rank {me} {label}: {kind:?} of {count} floats, a second kernel: {wrong} wrong, {failed} failed"));
            }
        }
    }
    if let Err(e) = cond.query() {
        bad.push(format!("rank {me} {label}: the condition reports {e}"));
    }
    if let Err(e) = comm.async_error() {
        bad.push(format!("rank {me} {label}: the communicator reports {e}"));
    }
    bad
}

/// The all-reduces the triggering thread runs itself (`GSC_COLL_TRIGGER_MAX`: 256 bytes on
/// this test's communicator): every datatype it takes and every operator, 1, 3 and as many
/// elements as fit, in place and not, each armed once and triggered three times with new
/// inputs that the host wrote; each result compared with the host reference
/// (`reduce_reference`, the kernels' arithmetic in rank order). Problems, one per line.
fn device_path_cases(comm: &Communicator, k: &UserKernel) -> Vec<String> {
    let (n, me) = (comm.nranks(), comm.rank());
    let stream = Arc::new(Stream::new().unwrap());
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let result = PinnedBuf::new(16).unwrap();
    let before = comm.triggered_on_device();
    let (mut bad, mut armed) = (Vec::new(), 0);
    // Every type but the 16- and 8-bit floats (they are launched: the device header has no half
    // arithmetic).
    for dtype in DataType::ALL.into_iter().filter(|d| !d.is_narrow_float()) {
        for op in RedOp::ALL {
            for count in [1, 3, 256 / dtype.size()] {
                for in_place in [false, true] {
                    let bytes = count * dtype.size();
                    let send = DeviceBuf::new(bytes).unwrap();
                    let recv = if in_place { None } else { Some(DeviceBuf::new(bytes).unwrap()) };
                    let out = recv.as_ref().unwrap_or(&send);
                    // SAFETY: our device buffers of `bytes`, alive until the kernels below ended.
                    let handle = unsafe { comm.all_reduce(send.ptr(), out.ptr(), count, dtype, op, &cond) }.unwrap().device_handle;
                    armed += 1;
                    for round in 0..3u64 {
                        let ins: Vec<Vec<u8>> = (0..n).map(|q| coll_input(dtype, q, 900 + round, count)).collect();
                        send.upload(&ins[me]).unwrap();
                        k.once.launch(1, 1, &stream, &[handle, result.device_ptr()]).unwrap();
                        let s = stream.clone();
                        bounded("a triggered small all-reduce", T, move || s.synchronize()).0.unwrap();
                        let refs: Vec<&[u8]> = ins.iter().map(Vec::as_slice).collect();
                        let what = format!("rank {me}: {dtype:?} {op:?} of {count} (in place {in_place}), round {round}");
                        if result.to_vec()[8..] != [0; 8] {
                            bad.push(format!("{what}: the wait failed"));
                            return bad;
                        }
                        if out.download().unwrap() != reduce_reference(dtype, op, &refs) {
                            bad.push(format!("{what}: wrong"));
                        }
                    }
                }
            }
        }
    }
    if comm.triggered_on_device() != before + armed {
        bad.push(format!("rank {me}: {} of {armed} small all-reduces ran in the triggering thread", comm.triggered_on_device() - before));
    }
    if let Err(e) = cond.query() {
        bad.push(format!("rank {me}: the condition reports {e}"));
    }
    bad
}

/// Counts: 0, 1, odd, several 64 KiB rounds, and 1 / 16 MiB of floats (the large kernels;
/// the direct kernel under `auto`).
const COUNTS: &[usize] = &[0, 1, 1001, 70_001, 1 << 18, 1 << 22];

fn run_rank(rank: usize, n: usize, uid: &[u8]) -> String {
    set_device(gpu_of(rank)).unwrap();
    let k = user_kernel();
    let uid = UniqueId::from_bytes(uid).unwrap();
    let boot = Bootstrap::init(&uid, rank as u32, n as u32, T).unwrap();
    let base = [("GSC_TIMEOUT", "30s"), ("GSC_COLL_CHECK", "on"), ("GSC_COLL_TRIGGER_MAX", "256")];
    let comm = Communicator::new(boot, gpu_of(rank), &config_with(&base)).unwrap();
    let t0 = Instant::now();
    let mut bad = triggered_cases(&comm, &k, COUNTS, "auto");
    eprintln!(
        "rank {rank}: auto in {:?} (in the triggering thread {}, direct-kernel calls {}, copy-engine {}, ring {})",
        t0.elapsed(),
        comm.triggered_on_device(),
        comm.direct_calls(),
        comm.copy_engine_calls(),
        comm.ring_calls()
    );
    let t0 = Instant::now();
    bad.extend(device_path_cases(&comm, &k));
    eprintln!("rank {rank}: the small all-reduces in the triggering thread in {:?}", t0.elapsed());
    // The paths on the peers' buffers that `auto` leaves out here, on communicators split off.
    for (label, knobs, calls) in [
        ("copy engines", [("GSC_COLL_CE", "on"), ("GSC_COLL_CE_MIN", "64K"), ("GSC_COLL_SM", "off"), ("GSC_COLL_RING", "off")], 0),
        ("ring", [("GSC_COLL_RING", "on"), ("GSC_COLL_RING_MIN", "64K"), ("GSC_COLL_SM", "off"), ("GSC_COLL_CE", "off")], 1),
    ] {
        let split = comm.split(Some(0), 0, &config_with(&[&base[..], &knobs[..]].concat())).unwrap().expect("every rank has color 0");
        let t0 = Instant::now();
        bad.extend(triggered_cases(&split, &k, &[1 << 18, 1 << 22], label));
        let taken = [split.copy_engine_calls(), split.ring_calls()][calls];
        if taken == 0 {
            bad.push(format!("rank {rank} {label}: no collective took the path"));
        }
        eprintln!("rank {rank}: {label} in {:?} ({taken} calls on the path)", t0.elapsed());
    }
    bad.extend(triggered_after_destroy(&comm, &k));
    bad.join("\n")
}

/// Collectives armed on a communicator that is then destroyed — one launched per trigger
/// (1024 floats) and one the triggering thread runs (2) —: a kernel that triggers them later
/// gets -1 from its wait at once, and the condition says why.
fn triggered_after_destroy(comm: &Communicator, k: &UserKernel) -> Vec<String> {
    let me = comm.rank();
    let split = comm.split(Some(0), 0, &config_with(&[("GSC_TIMEOUT", "30s")])).unwrap().expect("color 0");
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let (send, recv) = (DeviceBuf::new(4096).unwrap(), DeviceBuf::new(4096).unwrap());
    let stream = Arc::new(Stream::new().unwrap());
    let who = (split.nranks(), split.rank());
    let handles: Vec<(usize, u64)> =
        [1024, 2].iter().map(|&count| (count, arm(&split, Kind::AllReduce, &send, &recv, count, &cond).unwrap())).collect();
    let mut bad = Vec::new();
    for &(count, handle) in &handles {
        let before = run_rounds(k, &stream, who, handle, Kind::AllReduce, (&send, &recv), count, (1, 3), T);
        if before != (0, 0) {
            bad.push(format!("rank {me}: {count} floats, the rounds before the communicator was destroyed: {before:?} (wrong, failed)"));
        }
    }
    drop(split);
    for &(count, handle) in &handles {
        let after = run_rounds(k, &stream, who, handle, Kind::AllReduce, (&send, &recv), count, (4, 1), Duration::from_secs(10));
        if after != (0, 1) {
            bad.push(format!(
                "rank {me}: {count} floats, a trigger after the communicator was destroyed: {after:?} (wrong, failed), want (0, 1)"
            ));
        }
    }
    match cond.query() {
        Err(e) if e.status() == Status::Canceled => {}
        other => bad.push(format!("rank {me}: the condition after the communicator was destroyed: {other:?}")),
    }
    bad
}

fn roles(role: &str, chan: &dyn Chan, _ctx: Context) {
    let (rank, n) = role.strip_prefix("rank").unwrap().split_once("of").unwrap();
    let v = run_rank(rank.parse().unwrap(), n.parse().unwrap(), &chan.get("uid"));
    chan.put("result", v.as_bytes());
}

fn run_job(test: &str, n: usize) {
    run_rank_job(test, n, T, roles, run_rank)
}

#[test]
fn kernel_triggered_collectives_exact_on_two_gpus() {
    if run_child_role(roles) {
        return;
    }
    run_job("kernel_triggered_collectives_exact_on_two_gpus", 2);
}

#[test]
fn kernel_triggered_collectives_exact_on_four_gpus() {
    if run_child_role(roles) {
        return;
    }
    run_job("kernel_triggered_collectives_exact_on_four_gpus", 4);
}

// ---------------------------------------------------------------------------------------------
// A rank killed while a survivor's kernel waits for a triggered all-reduce

/// The survivor's GSC_TIMEOUT: how long its collective waits for the dead peer.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// The all-reduce of the kill tests, by victim role: floats launched by gscomm's thread on each
/// trigger (4 KiB, above GSC_COLL_TRIGGER_MAX), or run by the triggering thread (8 bytes).
fn kill_count(role: &str) -> usize {
    match role {
        "victim" => 1024,
        "small_victim" => 2,
        other => panic!("unknown role {other}"),
    }
}

/// Rank 1: arms the triggered all-reduce, performs one round with rank 0, says so, then waits
/// to be killed (the children's watchdog ends it otherwise).
fn victim_role(role: &str, chan: &dyn Chan, _ctx: Context) {
    let count = kill_count(role);
    set_device(1).unwrap();
    let k = user_kernel();
    let uid = UniqueId::from_bytes(&chan.get("uid")).unwrap();
    let boot = Bootstrap::init(&uid, 1, 2, T).unwrap();
    let mut o = child_overrides();
    o.push(("GSC_TIMEOUT".into(), "60s".into()));
    let config = config_with(&o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<Vec<_>>());
    let comm = Communicator::new(boot, 1, &config).unwrap();
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let (send, recv) = (DeviceBuf::new(count * 4).unwrap(), DeviceBuf::new(count * 4).unwrap());
    let handle = arm(&comm, Kind::AllReduce, &send, &recv, count, &cond).unwrap();
    let stream = Arc::new(Stream::new().unwrap());
    let who = (comm.nranks(), comm.rank());
    assert_eq!(run_rounds(&k, &stream, who, handle, Kind::AllReduce, (&send, &recv), count, (1, 1), T), (0, 0));
    chan.put("joined", &[]);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Two ranks arm a triggered all-reduce and perform one round together (checked by the
/// kernels); then rank 0's kernel triggers another and rank 1 is SIGKILLed. Rank 0's
/// `gsc_wait` must return -1 within GSC_TIMEOUT (5 s) plus slack, its kernel end, and the
/// condition and the communicator report the failure.
#[test]
fn a_killed_rank_fails_a_kernel_triggered_all_reduce_within_the_timeout() {
    killed_rank_fails_a_triggered_all_reduce("a_killed_rank_fails_a_kernel_triggered_all_reduce_within_the_timeout", "victim");
}

/// The same with an all-reduce the triggering thread runs itself (GSC_COLL_TRIGGER_MAX): its
/// wait for the dead rank's words gives up, and the communicator reports it (the condition
/// does not: no host takes part in such a round).
#[test]
fn a_killed_rank_fails_a_small_all_reduce_run_by_the_triggering_thread() {
    killed_rank_fails_a_triggered_all_reduce("a_killed_rank_fails_a_small_all_reduce_run_by_the_triggering_thread", "small_victim");
}

fn killed_rank_fails_a_triggered_all_reduce(test: &str, role: &str) {
    if run_child_role(victim_role) {
        return;
    }
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    if device_count() < 2 {
        eprintln!("skipped: needs 2 GPUs, found {}", device_count());
        return;
    }
    let count = kill_count(role);
    set_device(0).unwrap();
    gscomm::collectives::prepare_kernels(0, &config_with(&[])).unwrap();
    let k = user_kernel();
    let uid = UniqueId::create(None).unwrap();
    let dir = ShmDir::new(role);
    let mut victim = spawn_child(test, role, &[("GSC_SHM_DIR", dir.as_str())]);
    victim.put("uid", &uid.to_bytes());
    let boot = Bootstrap::init(&uid, 0, 2, T).unwrap();
    let config = config_with(&[("GSC_TIMEOUT", "5s"), ("GSC_SHM_DIR", dir.as_str())]);
    let comm = Communicator::new(boot, 0, &config).unwrap();
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let (send, recv) = (DeviceBuf::new(count * 4).unwrap(), DeviceBuf::new(count * 4).unwrap());
    let handle = arm(&comm, Kind::AllReduce, &send, &recv, count, &cond).unwrap();
    let on_device = comm.triggered_on_device() == 1;
    assert_eq!(on_device, role == "small_victim", "which path the all-reduce took");
    let stream = Arc::new(Stream::new().unwrap());
    let (bufs, who) = ((&send, &recv), (comm.nranks(), comm.rank()));
    assert_eq!(run_rounds(&k, &stream, who, handle, Kind::AllReduce, bufs, count, (1, 1), T), (0, 0), "the round before the kill");
    victim.get("joined", T);
    let killed_at = Instant::now();
    victim.sigkill_proven();
    let limit = KILL_TIMEOUT + Duration::from_secs(30);
    let (wrong, failed) = run_rounds(&k, &stream, who, handle, Kind::AllReduce, bufs, count, (2, 1), limit);
    let released = killed_at.elapsed();
    assert_eq!((wrong, failed), (0, 1), "the survivor's kernel: (wrong elements, failed waits)");
    assert!(released < slowed(KILL_TIMEOUT + Duration::from_secs(5)), "the wait returned {released:?} after the kill");
    // Launched per trigger: the watcher takes the failure into the condition within
    // microseconds of the kernel seeing it; a second is far more than it needs. Run by the
    // triggering thread: no host sees the round, so only the communicator's error word says it.
    let deadline = Instant::now() + Duration::from_secs(1);
    while !on_device {
        match cond.query() {
            Err(e) => {
                assert_eq!(e.status(), Status::TimedOut, "the condition after a peer died: {e}");
                break;
            }
            Ok(()) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(()) => panic!("the condition reports no failure after its wait returned -1"),
        }
    }
    let e = comm.async_error().unwrap_err();
    assert_eq!(e.status(), Status::TimedOut, "async_error after a peer died: {e}");
    let path = if on_device { "run by the triggering thread" } else { "launched per trigger" };
    eprintln!("rank 1 killed: the triggered all-reduce ({path}) released its wait with -1 after {released:?}");
}
