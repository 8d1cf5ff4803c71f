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
    _m: Module,
}

fn user_kernel() -> UserKernel {
    let src = format!("{}\n{KERNELS}", include_str!("../include/gsc_device.cuh"));
    let m = Module::compile(&src).expect("compile the triggering kernel");
    UserKernel { rounds: m.function("triggered_rounds").unwrap(), _m: m }
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

/// Counts: 0, 1, odd, several 64 KiB rounds, and 1 / 16 MiB of floats (the large kernels;
/// the direct kernel under `auto`).
const COUNTS: &[usize] = &[0, 1, 1001, 70_001, 1 << 18, 1 << 22];

fn run_rank(rank: usize, n: usize, uid: &[u8]) -> String {
    set_device(gpu_of(rank)).unwrap();
    let k = user_kernel();
    let uid = UniqueId::from_bytes(uid).unwrap();
    let boot = Bootstrap::init(&uid, rank as u32, n as u32, T).unwrap();
    let base = [("GSC_TIMEOUT", "30s"), ("GSC_COLL_CHECK", "on")];
    let comm = Communicator::new(boot, gpu_of(rank), &config_with(&base)).unwrap();
    let t0 = Instant::now();
    let mut bad = triggered_cases(&comm, &k, COUNTS, "auto");
    eprintln!(
        "rank {rank}: auto in {:?} (direct-kernel calls {}, copy-engine {}, ring {})",
        t0.elapsed(),
        comm.direct_calls(),
        comm.copy_engine_calls(),
        comm.ring_calls()
    );
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

/// A collective armed on a communicator that is then destroyed: a kernel that triggers it
/// later gets -1 from its wait at once, and the condition says why.
fn triggered_after_destroy(comm: &Communicator, k: &UserKernel) -> Vec<String> {
    let me = comm.rank();
    let split = comm.split(Some(0), 0, &config_with(&[("GSC_TIMEOUT", "30s")])).unwrap().expect("color 0");
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let (send, recv) = (DeviceBuf::new(4096).unwrap(), DeviceBuf::new(4096).unwrap());
    let handle = arm(&split, Kind::AllReduce, &send, &recv, 1024, &cond).unwrap();
    let stream = Arc::new(Stream::new().unwrap());
    let before = run_rounds(k, &stream, (split.nranks(), split.rank()), handle, Kind::AllReduce, (&send, &recv), 1024, (1, 3), T);
    let who = (split.nranks(), split.rank());
    drop(split);
    let after = run_rounds(k, &stream, who, handle, Kind::AllReduce, (&send, &recv), 1024, (4, 1), Duration::from_secs(10));
    let mut bad = Vec::new();
    if before != (0, 0) {
        bad.push(format!("rank {me}: the rounds before the communicator was destroyed: {before:?} (wrong, failed)"));
    }
    if after != (0, 1) {
        bad.push(format!("rank {me}: a trigger after the communicator was destroyed: {after:?} (wrong, failed), want (0, 1)"));
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
const KILL_COUNT: usize = 1024;

/// Rank 1: arms the triggered all-reduce, performs one round with rank 0, says so, then waits
/// to be killed (the children's watchdog ends it otherwise).
fn victim_role(role: &str, chan: &dyn Chan, _ctx: Context) {
    assert_eq!(role, "victim");
    set_device(1).unwrap();
    let k = user_kernel();
    let uid = UniqueId::from_bytes(&chan.get("uid")).unwrap();
    let boot = Bootstrap::init(&uid, 1, 2, T).unwrap();
    let mut o = child_overrides();
    o.push(("GSC_TIMEOUT".into(), "60s".into()));
    let config = config_with(&o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<Vec<_>>());
    let comm = Communicator::new(boot, 1, &config).unwrap();
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let (send, recv) = (DeviceBuf::new(KILL_COUNT * 4).unwrap(), DeviceBuf::new(KILL_COUNT * 4).unwrap());
    let handle = arm(&comm, Kind::AllReduce, &send, &recv, KILL_COUNT, &cond).unwrap();
    let stream = Arc::new(Stream::new().unwrap());
    assert_eq!(
        run_rounds(&k, &stream, (comm.nranks(), comm.rank()), handle, Kind::AllReduce, (&send, &recv), KILL_COUNT, (1, 1), T),
        (0, 0)
    );
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
    set_device(0).unwrap();
    gscomm::collectives::prepare_kernels(0, &config_with(&[])).unwrap();
    let k = user_kernel();
    let uid = UniqueId::create(None).unwrap();
    let dir = ShmDir::new("victim");
    let test = "a_killed_rank_fails_a_kernel_triggered_all_reduce_within_the_timeout";
    let mut victim = spawn_child(test, "victim", &[("GSC_SHM_DIR", dir.as_str())]);
    victim.put("uid", &uid.to_bytes());
    let boot = Bootstrap::init(&uid, 0, 2, T).unwrap();
    let config = config_with(&[("GSC_TIMEOUT", "5s"), ("GSC_SHM_DIR", dir.as_str())]);
    let comm = Communicator::new(boot, 0, &config).unwrap();
    let cond = Condition::cuda(Category::KernelTriggered, 0, None).unwrap();
    let (send, recv) = (DeviceBuf::new(KILL_COUNT * 4).unwrap(), DeviceBuf::new(KILL_COUNT * 4).unwrap());
    let handle = arm(&comm, Kind::AllReduce, &send, &recv, KILL_COUNT, &cond).unwrap();
    let stream = Arc::new(Stream::new().unwrap());
    let bufs = (&send, &recv);
    assert_eq!(
        run_rounds(&k, &stream, (comm.nranks(), comm.rank()), handle, Kind::AllReduce, bufs, KILL_COUNT, (1, 1), T),
        (0, 0),
        "the round before the kill"
    );
    victim.get("joined", T);
    let killed_at = Instant::now();
    victim.sigkill_proven();
    let limit = KILL_TIMEOUT + Duration::from_secs(30);
    let (wrong, failed) = run_rounds(&k, &stream, (comm.nranks(), comm.rank()), handle, Kind::AllReduce, bufs, KILL_COUNT, (2, 1), limit);
    let released = killed_at.elapsed();
    assert_eq!((wrong, failed), (0, 1), "the survivor's kernel: (wrong elements, failed waits)");
    assert!(released < slowed(KILL_TIMEOUT + Duration::from_secs(5)), "the wait returned {released:?} after the kill");
    // The watcher takes the failure into the condition within microseconds of the kernel
    // seeing it; a second is far more than it needs.
    let deadline = Instant::now() + Duration::from_secs(1);
    let e = loop {
        match cond.query() {
            Err(e) => break e,
            Ok(()) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(()) => panic!("the condition reports no failure after its wait returned -1"),
        }
    };
    assert_eq!(e.status(), Status::TimedOut, "the condition after a peer died: {e}");
    let e = comm.async_error().unwrap_err();
    assert_eq!(e.status(), Status::TimedOut, "async_error after a peer died: {e}");
    eprintln!("rank 1 killed: the triggered all-reduce's wait returned -1 after {released:?}");
}
