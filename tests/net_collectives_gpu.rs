//! Collectives on GPU buffers across hosts (issue #7, `collectives::NetComm`), one process per
//! GPU, every rank a child of the test (the parent only relays the id and enforces the time
//! limit: a hang fails the test after `T`):
//! - `ucx_lane_four_ranks`: `GSC_TLS=ucx` (UCX_TLS=tcp unless the environment sets it): every
//!   rank is its own group, so the whole all-reduce is the point-to-point exchange of GPU
//!   buffers over UCX plus the reduction kernel;
//! - `fake_hosts_two_by_two`: `GSC_FAKE_HOST=host0|host1` makes GPUs 0-1 and 2-3 two "hosts": the
//!   groups run the NVLink kernels, the step between them goes over UCX (the lane is asserted).
//!
//! Each checks all-reduce on GPU buffers of 0, 1, odd, 1 MiB + 1 element and 64 MiB, several
//! datatypes and operators, out of place and in place, exactly against
//! `net::hierarchical_reference` (the documented order: each host in rank order, then the hosts
//! in order); all-gather, reduce-scatter (flat rank order) and broadcast; a ring of GPU
//! send/recv (1 B to 16 MiB); and bad input refused with the communicator still usable.
//!
//! Skips with a printed reason unless `GSC_TEST_GPU=1` and 4 GPUs are there. Device:
//! `.gpu/run.sh net_collectives_gpu -- --nocapture --test-threads=1`.
mod common;

use common::*;
use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::collectives::net::hierarchical_reference;
use gscomm::collectives::types::reduce_reference;
use gscomm::collectives::{DataType, NetComm, RedOp};
use gscomm::condition::{Category, Condition};
use gscomm::cuda::api::{DeviceBuf, Stream, device_count, gpu_test_skip_reason, set_device};
use gscomm::transport::LaneKind;
use gscomm::{Context, Status};
use std::time::{Duration, Instant};

/// The parent's limit for a whole job (every rank's result).
const T: Duration = Duration::from_secs(240);
const RANKS: usize = 4;

/// Rank `rank`'s input of `count` elements for `seed`: random bits for integers (sums and
/// products wrap), small integers for floats (exact in every float type).
fn input(dtype: DataType, rank: usize, seed: u64, count: usize) -> Vec<u8> {
    if !dtype.is_float() {
        return pattern(seed * 31 + rank as u64, count * dtype.size());
    }
    let mut out = Vec::with_capacity(count * dtype.size());
    for b in pattern(seed * 31 + rank as u64, count) {
        dtype.push_integer(i64::from(b % 5) - 2, &mut out);
    }
    out
}

fn device_with(data: &[u8], len: usize) -> DeviceBuf {
    let b = DeviceBuf::new(len.max(1)).unwrap();
    b.fill(0).unwrap();
    if !data.is_empty() {
        b.upload(data).unwrap();
    }
    b
}

struct Rank {
    comm: NetComm,
    stream: Stream,
    cond: Condition,
}

impl Rank {
    /// Wait for the stream, then require the condition (the point-to-point steps) and the
    /// group's kernels to be free of errors.
    fn sync(&self, what: &str) -> Result<(), String> {
        self.stream.synchronize().map_err(|e| format!("{what}: stream: {e}"))?;
        self.cond.query().map_err(|e| format!("{what}: condition: {e}"))?;
        self.comm.async_error().map_err(|e| format!("{what}: async error: {e}"))
    }
}

fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    if got.len() != want.len() {
        return Some(got.len().min(want.len()));
    }
    got.iter().zip(want).position(|(a, b)| a != b)
}

/// The all-reduce cases: (datatype, operator, element counts). 64 MiB only for two of them.
fn all_reduce_cases() -> Vec<(DataType, RedOp, Vec<usize>)> {
    let mib_plus_one = |d: DataType| (1 << 20) / d.size() + 1;
    let sizes = |d: DataType| vec![0, 1, 3, 1001, mib_plus_one(d)];
    let mut cases = vec![
        (DataType::Float32, RedOp::Sum, sizes(DataType::Float32)),
        (DataType::Int32, RedOp::Sum, sizes(DataType::Int32)),
        (DataType::Float16, RedOp::Max, sizes(DataType::Float16)),
        (DataType::Bfloat16, RedOp::Avg, sizes(DataType::Bfloat16)),
        (DataType::Uint8, RedOp::Prod, sizes(DataType::Uint8)),
        (DataType::Int64, RedOp::Min, sizes(DataType::Int64)),
        (DataType::Float64, RedOp::Avg, sizes(DataType::Float64)),
    ];
    cases[0].2.push((64 << 20) / 4);
    cases[1].2.push((64 << 20) / 4);
    cases
}

fn all_reduces(r: &Rank) -> Vec<String> {
    let (me, n) = (r.comm.rank(), r.comm.nranks());
    let groups = r.comm.plan().groups.clone();
    let mut bad = Vec::new();
    let mut seed = 1u64;
    for (dtype, op, counts) in all_reduce_cases() {
        for count in counts {
            seed += 1;
            let ins: Vec<Vec<u8>> = (0..n).map(|q| input(dtype, q, seed, count)).collect();
            let by_group: Vec<Vec<&[u8]>> = groups.iter().map(|g| g.iter().map(|&q| ins[q].as_slice()).collect()).collect();
            let want = if count == 0 { Vec::new() } else { hierarchical_reference(dtype, op, &by_group) };
            let len = count * dtype.size();
            for in_place in [false, true] {
                // The largest size once (out of place): its host reference and transfers dominate.
                if in_place && len > 2 << 20 {
                    continue;
                }
                let what = format!("rank {me}: all_reduce {count} x {} {} in_place={in_place}", dtype.name(), op.name());
                let send = device_with(&ins[me], len);
                let recv = if in_place { None } else { Some(device_with(&[], len)) };
                let rp = recv.as_ref().map_or(send.ptr(), DeviceBuf::ptr);
                let t0 = Instant::now();
                if let Err(e) = unsafe { r.comm.all_reduce(send.ptr(), rp, count, dtype, op, &r.cond) } {
                    bad.push(format!("{what}: {e}"));
                    return bad;
                }
                if let Err(e) = r.sync(&what) {
                    bad.push(e);
                    return bad;
                }
                if len >= 16 << 20 {
                    eprintln!("{what}: {:?}", t0.elapsed());
                }
                let got = recv.as_ref().unwrap_or(&send).download().unwrap();
                if count > 0
                    && let Some(at) = first_difference(&got[..len], &want)
                {
                    bad.push(format!("{what}: first difference at byte {at}"));
                }
            }
        }
    }
    bad
}

fn data_movement(r: &Rank) -> Vec<String> {
    let (me, n) = (r.comm.rank(), r.comm.nranks());
    let mut bad = Vec::new();
    let mut seed = 1000u64;
    for (dtype, count) in [(DataType::Int32, 1usize), (DataType::Float32, 1001), (DataType::Bfloat16, (1 << 20) / 2 + 1)] {
        let sz = dtype.size();
        seed += 1;
        // All-gather, out of place and in place.
        let ins: Vec<Vec<u8>> = (0..n).map(|q| input(dtype, q, seed, count)).collect();
        for in_place in [false, true] {
            let what = format!("rank {me}: all_gather {count} x {} in_place={in_place}", dtype.name());
            let recv = device_with(&[], count * n * sz);
            let send = if in_place {
                recv.upload(&[vec![0; me * count * sz], ins[me].clone()].concat()).unwrap();
                None
            } else {
                Some(device_with(&ins[me], count * sz))
            };
            let sp = send.as_ref().map_or(recv.ptr() + (me * count * sz) as u64, DeviceBuf::ptr);
            if let Err(e) = unsafe { r.comm.all_gather(sp, recv.ptr(), count, dtype, &r.cond) } {
                bad.push(format!("{what}: {e}"));
                return bad;
            }
            if let Err(e) = r.sync(&what) {
                bad.push(e);
                return bad;
            }
            if let Some(at) = first_difference(&recv.download().unwrap(), &ins.concat()) {
                bad.push(format!("{what}: first difference at byte {at}"));
            }
        }
        // Reduce-scatter: flat rank order.
        for op in [RedOp::Sum, RedOp::Max] {
            seed += 1;
            let what = format!("rank {me}: reduce_scatter {count} x {} {}", dtype.name(), op.name());
            let big: Vec<Vec<u8>> = (0..n).map(|q| input(dtype, q, seed, count * n)).collect();
            let slices: Vec<&[u8]> = big.iter().map(|b| &b[me * count * sz..(me + 1) * count * sz]).collect();
            let want = reduce_reference(dtype, op, &slices);
            let send = device_with(&big[me], count * n * sz);
            let recv = device_with(&[], count * sz);
            if let Err(e) = unsafe { r.comm.reduce_scatter(send.ptr(), recv.ptr(), count, dtype, op, &r.cond) } {
                bad.push(format!("{what}: {e}"));
                return bad;
            }
            if let Err(e) = r.sync(&what) {
                bad.push(e);
                return bad;
            }
            if let Some(at) = first_difference(&recv.download().unwrap(), &want) {
                bad.push(format!("{what}: first difference at byte {at}"));
            }
        }
        // Broadcast from a root that moves.
        let root = seed as usize % n;
        let what = format!("rank {me}: broadcast {count} x {} from {root}", dtype.name());
        let send = device_with(&ins[root], count * sz);
        let recv = device_with(&[], count * sz);
        if let Err(e) = unsafe { r.comm.broadcast(send.ptr(), recv.ptr(), count, dtype, root, &r.cond) } {
            bad.push(format!("{what}: {e}"));
            return bad;
        }
        if let Err(e) = r.sync(&what) {
            bad.push(e);
            return bad;
        }
        if let Some(at) = first_difference(&recv.download().unwrap(), &ins[root]) {
            bad.push(format!("{what}: first difference at byte {at}"));
        }
    }
    bad
}

/// A ring of GPU send/recv: every rank sends to the next and receives from the previous, in a
/// group on the stream, 1 B to 16 MiB.
fn ring(r: &Rank) -> Vec<String> {
    let (me, n) = (r.comm.rank(), r.comm.nranks());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let mut bad = Vec::new();
    for (k, len) in [1usize, 4097, (1 << 20) + 1, 16 << 20].into_iter().enumerate() {
        let what = format!("rank {me}: ring send/recv of {len} B");
        let msg = |from: usize| pattern(7000 + k as u64 * 10 + from as u64, len);
        let send = device_with(&msg(me), len);
        let recv = device_with(&[], len);
        let posted = (|| {
            r.cond.group_start()?;
            // The group is closed whatever happens, or every later call would be inside it.
            let posted = unsafe { r.comm.recv(recv.ptr(), len, DataType::Uint8, prev, &r.cond) }
                .and_then(|()| unsafe { r.comm.send(send.ptr(), len, DataType::Uint8, next, &r.cond) });
            let ended = r.cond.group_end();
            posted.and(ended)
        })();
        if let Err(e) = posted {
            bad.push(format!("{what}: {e}"));
            return bad;
        }
        if let Err(e) = r.sync(&what) {
            bad.push(e);
            return bad;
        }
        if let Some(at) = first_difference(&recv.download().unwrap(), &msg(prev)) {
            bad.push(format!("{what}: first difference at byte {at}"));
        }
    }
    bad
}

/// Bad calls are refused before anything is posted (every rank makes the same ones, so the
/// ranks stay in step), and the communicator works afterwards.
fn bad_input(r: &Rank) -> Vec<String> {
    let me = r.comm.rank();
    let mut bad = Vec::new();
    let host = [0u8; 64];
    let d = device_with(&[], 64);
    let e = unsafe { r.comm.all_reduce(host.as_ptr() as u64, d.ptr(), 4, DataType::Int32, RedOp::Sum, &r.cond) };
    if !matches!(&e, Err(e) if e.status() == Status::InvalidParam && e.to_string().contains("not GPU memory")) {
        bad.push(format!("rank {me}: a host send buffer: {e:?}"));
    }
    let e = unsafe { r.comm.broadcast(d.ptr(), d.ptr(), 4, DataType::Int32, 9, &r.cond) };
    if !matches!(&e, Err(e) if e.status() == Status::InvalidParam) {
        bad.push(format!("rank {me}: root 9: {e:?}"));
    }
    let e = unsafe { r.comm.all_reduce(d.ptr(), d.ptr(), usize::MAX / 2, DataType::Int32, RedOp::Sum, &r.cond) };
    if !matches!(&e, Err(e) if e.status() == Status::InvalidParam) {
        bad.push(format!("rank {me}: an overflowing count: {e:?}"));
    }
    r.cond.group_start().unwrap();
    let e = unsafe { r.comm.all_reduce(d.ptr(), d.ptr(), 4, DataType::Int32, RedOp::Sum, &r.cond) };
    r.cond.group_end().unwrap();
    if !matches!(&e, Err(e) if e.to_string().contains("group")) {
        bad.push(format!("rank {me}: inside a group: {e:?}"));
    }
    // Still usable: a sum of ones.
    let ones = device_with(&1i32.to_le_bytes().repeat(16), 64);
    if let Err(e) = unsafe { r.comm.all_reduce(ones.ptr(), ones.ptr(), 16, DataType::Int32, RedOp::Sum, &r.cond) } {
        bad.push(format!("rank {me}: after bad input: {e}"));
        return bad;
    }
    if let Err(e) = r.sync("after bad input") {
        bad.push(e);
        return bad;
    }
    let got = ones.download().unwrap();
    if got != (r.comm.nranks() as i32).to_le_bytes().repeat(16) {
        bad.push(format!("rank {me}: the sum of ones after bad input is {:?}", &got[..4]));
    }
    bad
}

fn run_rank(rank: usize, n: usize, uid: &[u8], groups_expected: usize) -> String {
    // With GSC_TEST_SHARE_GPUS, fewer GPUs than ranks: rank r takes GPU r mod count. With two
    // or more, the ranks of one (fake) host still land on different GPUs (ranks 2h and 2h+1),
    // and the ranks sharing a GPU talk only over UCX, through host staging; with one, the
    // ranks of a host share it too (CUDA IPC within one device).
    let device = rank as i32 % device_count();
    set_device(device).unwrap();
    let uid = UniqueId::from_bytes(uid).unwrap();
    let boot = Bootstrap::init(&uid, rank as u32, n as u32, T).unwrap();
    let o = child_overrides();
    let mut o: Vec<(&str, &str)> = o.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    o.push(("GSC_TIMEOUT", "30s"));
    let config = config_with(&o);
    // Warnings (a stream-ordered operation slow or timed out, with its state) reach the log.
    gscomm::log::init(&config).unwrap();
    let t0 = Instant::now();
    let comm = match NetComm::new(boot, device, &config) {
        Ok(c) => c,
        Err(e) => return format!("rank {rank}: NetComm::new: {e}"),
    };
    let plan = comm.plan().clone();
    eprintln!("rank {rank}: communicator in {:?}, groups {:?}", t0.elapsed(), plan.groups);
    let mut bad = Vec::new();
    if plan.ngroups() != groups_expected || plan.ungrouped_because.is_some() {
        bad.push(format!("rank {rank}: expected {groups_expected} groups, got {plan:?}"));
    }
    // The step between groups takes UCX to every rank of this rank's column.
    let (_, local) = plan.place(rank);
    for q in plan.column(local).into_iter().filter(|&q| q != rank) {
        match comm.lane_to(q) {
            Ok(LaneKind::Ucx) => {}
            other => bad.push(format!("rank {rank}: the lane to rank {q} (another host) is {other:?}, not UCX")),
        }
    }
    let stream = Stream::new().unwrap();
    let cond = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
    let r = Rank { comm, stream, cond };
    let t0 = Instant::now();
    bad.extend(bad_input(&r));
    bad.extend(all_reduces(&r));
    eprintln!("rank {rank}: all-reduce checks in {:?}", t0.elapsed());
    let t0 = Instant::now();
    bad.extend(ring(&r));
    eprintln!("rank {rank}: send/recv ring in {:?}", t0.elapsed());
    let t0 = Instant::now();
    bad.extend(data_movement(&r));
    eprintln!("rank {rank}: all-gather, reduce-scatter, broadcast in {:?}", t0.elapsed());
    bad.join("\n")
}

fn roles(role: &str, chan: &dyn Chan, _ctx: Context) {
    let (rank, rest) = role.strip_prefix("rank").unwrap().split_once("of").unwrap();
    let (n, groups) = rest.split_once('g').unwrap();
    let (rank, n, groups): (usize, usize, usize) = (rank.parse().unwrap(), n.parse().unwrap(), groups.parse().unwrap());
    let uid = chan.get("uid");
    let v = run_rank(rank, n, &uid, groups);
    chan.put("result", v.as_bytes());
}

/// Run `RANKS` ranks as children with `cfg(rank)` and require every one to report no problem
/// within `T` (a child that hangs fails the test: its `get` times out and it is killed).
fn run_job(test: &str, groups: usize, cfg: impl Fn(usize) -> Vec<(&'static str, String)>) {
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    let share = std::env::var_os("GSC_TEST_SHARE_GPUS").is_some();
    if device_count() < RANKS as i32 && !share {
        eprintln!("skipped: needs {RANKS} GPUs (or GSC_TEST_SHARE_GPUS=1), found {}", device_count());
        return;
    }
    let ucx_tls = std::env::var("UCX_TLS").unwrap_or_else(|_| "tcp".into());
    let uid = UniqueId::create(None).unwrap();
    let mut children: Vec<ChildProc> = (0..RANKS)
        .map(|r| {
            let c = cfg(r);
            let c: Vec<(&str, &str)> = c.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let life = (slowed(T).as_secs() + 40).to_string();
            let env = [("UCX_TLS", ucx_tls.as_str()), ("GSC_TEST_CHILD_LIFE", life.as_str())];
            spawn_child_with(test, &format!("rank{r}of{RANKS}g{groups}"), &c, &env, &[])
        })
        .collect();
    for c in children.iter_mut() {
        c.put("uid", &uid.to_bytes());
    }
    let deadline = Instant::now() + slowed(T);
    let mut problems = Vec::new();
    for c in children.iter_mut() {
        let left = deadline.saturating_duration_since(Instant::now());
        let v = String::from_utf8(c.get("result", left)).unwrap();
        if !v.is_empty() {
            problems.push(v);
        }
    }
    for c in children.iter_mut() {
        c.wait_success(slowed(Duration::from_secs(30)));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn ucx_lane_four_ranks() {
    if run_child_role(roles) {
        return;
    }
    run_job("ucx_lane_four_ranks", RANKS, |_| vec![("GSC_TLS", "ucx".to_string())]);
}

#[test]
fn fake_hosts_two_by_two() {
    if run_child_role(roles) {
        return;
    }
    run_job("fake_hosts_two_by_two", 2, |r| vec![("GSC_FAKE_HOST", format!("host{}", r / 2))]);
}
