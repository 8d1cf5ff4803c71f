//! Every rank's collective issued together from one thread (`collectives::issue_group`): two
//! ranks of one communicator in this process, on GPUs 0 and 1, the way nccl-tests' `-g 2` and
//! ncclCommInitAll drive them. Issued together, the calls take the paths on the peers' buffers
//! (direct kernel, copy engines, copy-engine ring) with exact results; issued alone, or with a
//! buffer another GPU cannot reach, they take the workspace kernels, exact too. Rooted calls of
//! many rounds, issued rank after rank from the same thread, complete. Skips without
//! `GSC_TEST_GPU=1` and two GPUs.

mod common;

use common::config_with;
use gscomm::bootstrap::{Bootstrap, UniqueId};
use gscomm::collectives::{Coll, Communicator, DataType, RankCall, RedOp, issue_group};
use gscomm::condition::{Category, Condition};
use gscomm::cuda::api::{DeviceBuf, Stream, device_count, gpu_test_skip_reason, set_device};
use std::time::Duration;

fn two_gpus_or_skip() -> bool {
    if let Some(why) = gpu_test_skip_reason() {
        eprintln!("skipped: {why}");
        return false;
    }
    if device_count() < 2 {
        eprintln!("skipped: needs 2 GPUs, found {}", device_count());
        return false;
    }
    true
}

/// A communicator of two ranks in this process, rank r on GPU r, made on two threads.
fn pair(overrides: &[(&str, &str)]) -> Vec<Communicator> {
    let uid = UniqueId::create(None).unwrap();
    let config = config_with(overrides);
    std::thread::scope(|s| {
        let made: Vec<_> = (0..2)
            .map(|r| {
                let (uid, config) = (&uid, &config);
                s.spawn(move || {
                    set_device(r).unwrap();
                    let b = Bootstrap::init(uid, r as u32, 2, Duration::from_secs(30)).unwrap();
                    Communicator::new(b, r, config).unwrap()
                })
            })
            .collect();
        made.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

#[derive(Copy, Clone, Debug, PartialEq)]
enum Kind {
    AllReduce,
    AllReduceInPlace,
    AllGather,
    ReduceScatter,
}

/// One rank's buffers and stream.
struct Rank {
    send: DeviceBuf,
    recv: DeviceBuf,
    stream: Stream,
    on: Condition,
}

fn val(r: usize, i: usize) -> i32 {
    ((i * 2_654_435_761 + r * 97) as u32 as i32) >> 2
}

fn bytes(v: impl Iterator<Item = i32>) -> Vec<u8> {
    v.flat_map(i32::to_le_bytes).collect()
}

/// The call of `kind` on rank `r` with `count` int32 (a reduce-scatter's: per rank).
fn call(kind: Kind, rank: &Rank, count: usize) -> Coll {
    let (send, recv) = (rank.send.ptr(), rank.recv.ptr());
    let (dtype, op) = (DataType::Int32, RedOp::Sum);
    match kind {
        Kind::AllReduce => Coll::AllReduce { send, recv, count, dtype, op },
        Kind::AllReduceInPlace => Coll::AllReduce { send: recv, recv, count, dtype, op },
        Kind::AllGather => Coll::AllGather { send, recv, count, dtype },
        Kind::ReduceScatter => Coll::ReduceScatter { send, recv, recv_count: count, dtype, op },
    }
}

/// Fill every rank's input for `kind` (`salt` varies it from case to case) and poison its output.
fn fill(kind: Kind, ranks: &[Rank], count: usize, salt: usize) {
    let n = ranks.len();
    for (r, rank) in ranks.iter().enumerate() {
        set_device(r as i32).unwrap();
        let in_len = if kind == Kind::ReduceScatter { n * count } else { count };
        rank.recv.fill(0xEE).unwrap();
        let input = if kind == Kind::AllReduceInPlace { &rank.recv } else { &rank.send };
        input.upload(&bytes((0..in_len).map(|i| val(r, i + salt)))).unwrap();
    }
}

/// Every rank's output for `kind`, exact, or a line naming the rank that is wrong.
fn check(kind: Kind, ranks: &[Rank], count: usize, salt: usize, what: &str) -> Result<(), String> {
    let n = ranks.len();
    for (r, rank) in ranks.iter().enumerate() {
        set_device(r as i32).unwrap();
        rank.stream.synchronize().unwrap();
        let out_len = if kind == Kind::AllGather { n * count } else { count };
        let sum = |i: usize| (0..n).fold(0i32, |a, q| a.wrapping_add(val(q, i + salt)));
        let want = bytes((0..out_len).map(|i| match kind {
            Kind::AllGather => val(i / count, i % count + salt),
            Kind::ReduceScatter => sum(r * count + i),
            _ => sum(i),
        }));
        let got = rank.recv.download().unwrap();
        if got[..want.len()] != want[..] {
            return Err(format!("{what}: GPU {r}'s {kind:?} of {count} int32 is wrong"));
        }
    }
    Ok(())
}

fn ranks(len: usize, vmm_recv_on: Option<usize>) -> Vec<Rank> {
    (0..2)
        .map(|r| {
            set_device(r as i32).unwrap();
            let stream = Stream::new().unwrap();
            let on = Condition::cuda(Category::Stream, stream.raw(), None).unwrap();
            let recv = if vmm_recv_on == Some(r) { DeviceBuf::new_vmm(len) } else { DeviceBuf::new(len) }.unwrap();
            Rank { send: DeviceBuf::new(len).unwrap(), recv, stream, on }
        })
        .collect()
}

fn issue(comms: &[Communicator], ranks: &[Rank], kind: Kind, count: usize) {
    let calls: Vec<RankCall> =
        comms.iter().zip(ranks).map(|(comm, rank)| RankCall { comm, call: call(kind, rank, count), on: &rank.on }).collect();
    // SAFETY: every buffer is this rank's GPU memory of the sizes the calls name, kept until
    // the streams are synchronized in `check`.
    for r in unsafe { issue_group(&calls) } {
        r.unwrap();
    }
}

/// Per path: the communicator's counter of calls it ran, and which kinds it takes.
type Counter = fn(&Communicator) -> u64;

#[test]
fn group_calls_take_the_peer_buffer_paths_from_one_thread_on_two_gpus() {
    if !two_gpus_or_skip() {
        return;
    }
    const LEN: usize = 32 << 20;
    // At auto's stream floors for the direct kernel: all-reduces of 16 MiB, all-gather parts of
    // 8 MiB, reduce-scatter parts of 16 MiB.
    let cases = [(Kind::AllReduce, 4 << 20), (Kind::AllReduceInPlace, 4 << 20), (Kind::AllGather, 2 << 20), (Kind::ReduceScatter, 4 << 20)];
    let paths: [(&str, &[(&str, &str)], Counter, &[Kind]); 3] = [
        (
            "direct kernel (auto)",
            &[],
            Communicator::direct_calls,
            &[Kind::AllReduce, Kind::AllReduceInPlace, Kind::AllGather, Kind::ReduceScatter],
        ),
        (
            "copy engines",
            &[("GSC_COLL_SM", "off"), ("GSC_COLL_CE", "on")],
            Communicator::copy_engine_calls,
            &[Kind::AllReduce, Kind::AllReduceInPlace, Kind::AllGather, Kind::ReduceScatter],
        ),
        (
            "copy-engine ring",
            &[("GSC_COLL_SM", "off"), ("GSC_COLL_CE", "off"), ("GSC_COLL_RING", "on")],
            Communicator::ring_calls,
            &[Kind::AllReduce, Kind::AllReduceInPlace, Kind::ReduceScatter],
        ),
    ];
    let mut salt = 0;
    for (path, overrides, counter, takes) in paths {
        let comms = pair(overrides);
        let rs = ranks(LEN, None);
        for &(kind, count) in &cases {
            salt += 1;
            let before: Vec<u64> = comms.iter().map(counter).collect();
            fill(kind, &rs, count, salt);
            issue(&comms, &rs, kind, count);
            check(kind, &rs, count, salt, path).unwrap();
            let took: Vec<u64> = comms.iter().zip(&before).map(|(c, b)| counter(c) - b).collect();
            let want = u64::from(takes.contains(&kind));
            assert_eq!(took, vec![want; 2], "{path}: {kind:?} issued together");
            // Alone, one rank after the other (no group): the workspace kernels.
            salt += 1;
            fill(kind, &rs, count, salt);
            issue_alone(&comms, &rs, kind, count);
            check(kind, &rs, count, salt, path).unwrap();
            assert_eq!(comms.iter().zip(&before).map(|(c, b)| counter(c) - b).collect::<Vec<_>>(), took, "{path}: {kind:?} alone");
            eprintln!("{path}: {kind:?} of {count} int32 exact on both GPUs, together ({want} call each) and alone");
        }
    }
}

/// A receive buffer GPU 0 cannot reach by address (VMM memory granted to GPU 1 only, as
/// PyTorch's expandable segments are): the group's calls take the workspace kernels, exact.
/// And calls captured together into one graph per GPU take the direct kernel once and replay.
#[test]
fn unreachable_buffers_fall_back_and_captured_groups_replay_on_two_gpus() {
    if !two_gpus_or_skip() {
        return;
    }
    let comms = pair(&[]);
    let count = 4 << 20;
    let rs = ranks(32 << 20, Some(1));
    let before: Vec<u64> = comms.iter().map(Communicator::direct_calls).collect();
    fill(Kind::AllReduce, &rs, count, 1);
    issue(&comms, &rs, Kind::AllReduce, count);
    check(Kind::AllReduce, &rs, count, 1, "VMM buffer without access").unwrap();
    assert_eq!(comms.iter().map(Communicator::direct_calls).collect::<Vec<_>>(), before, "no direct kernel on an unreachable buffer");

    let rs = ranks(32 << 20, None);
    // At auto's graph floors: all-reduces of 1 MiB, all-gather parts of 8 MiB.
    for (kind, count) in [(Kind::AllReduce, 1 << 18), (Kind::AllGather, 2 << 20)] {
        let before: Vec<u64> = comms.iter().map(Communicator::direct_calls).collect();
        for (r, rank) in rs.iter().enumerate() {
            set_device(r as i32).unwrap();
            rank.stream.begin_capture().unwrap();
        }
        issue(&comms, &rs, kind, count);
        let graphs: Vec<_> = rs
            .iter()
            .enumerate()
            .map(|(r, rank)| {
                set_device(r as i32).unwrap();
                rank.stream.end_capture().unwrap().instantiate().unwrap()
            })
            .collect();
        assert_eq!(
            comms.iter().zip(&before).map(|(c, b)| c.direct_calls() - b).collect::<Vec<_>>(),
            vec![1, 1],
            "{kind:?}: captured together, the direct kernel (graph floors)"
        );
        for replay in 0..3 {
            let salt = 10 + replay;
            fill(kind, &rs, count, salt);
            for (r, (g, rank)) in graphs.iter().zip(&rs).enumerate() {
                set_device(r as i32).unwrap();
                g.launch(&rank.stream).unwrap();
            }
            check(kind, &rs, count, salt, "replayed").unwrap();
        }
        eprintln!("{kind:?} of {count} int32 captured together: exact over 3 replays");
    }
}

/// Broadcasts and reduces of many rounds from one thread, each rank's call issued after the
/// other's with no group: one launch per call (large: the all-reduce's pattern; one-shot: the
/// readers acknowledging rounds inside it).
/// (Until session 31 these took a launch per round, and a 128 MiB call's 2048 launches on GPU 0
/// filled CUDA's launch queue before GPU 1's first was issued: a deadlock.) Small all-reduces
/// between them check that each leaves the workspace as the next call expects; one size is
/// also captured and replayed.
#[test]
fn rooted_calls_of_many_rounds_from_one_thread_on_two_gpus() {
    if !two_gpus_or_skip() {
        return;
    }
    let rs = ranks(ROOTED_LEN, None);
    // The large kernel from 256 KiB (aligned), and the one-shot kernel at every size.
    for (how, large_min) in [("large from 256K", "256K"), ("one-shot", "1G")] {
        let comms = pair(&[("GSC_TIMEOUT", "20s"), ("GSC_COLL_LARGE_MIN", large_min)]);
        rooted_cases(&comms, &rs, how);
    }
}

/// The largest rooted call, and the ranks' buffers for them.
const ROOTED_LEN: usize = 128 << 20;

fn rooted_cases(comms: &[Communicator], rs: &[Rank], how: &str) {
    let ints = |b: usize| b / 4;
    // (bytes, root): one round plus one element, odd rounds, 2^k - 1 elements, 128 MiB.
    let cases = [((64 << 10) + 4, 0), (3 * (64 << 10) + 12, 1), ((1 << 20) - 4, 1), (ROOTED_LEN, 0)];
    let rooted = |reduce: bool, rank: &Rank, count: usize, root: usize| {
        let (send, recv, dtype) = (rank.send.ptr(), rank.recv.ptr(), DataType::Int32);
        match reduce {
            false => Coll::Broadcast { send, recv, count, dtype, root },
            true => Coll::Reduce { send, recv, count, dtype, op: RedOp::Sum, root },
        }
    };
    let mut salt = 100;
    for reduce in [false, true] {
        for &(bytes, root) in &cases {
            let count = ints(bytes);
            salt += 1;
            fill(Kind::AllReduce, rs, count, salt);
            for (comm, rank) in comms.iter().zip(rs) {
                // SAFETY: as in `issue`.
                unsafe { comm.collective(&rooted(reduce, rank, count, root), &rank.on) }.unwrap();
            }
            let name = if reduce { "reduce" } else { "broadcast" };
            for (r, rank) in rs.iter().enumerate() {
                set_device(r as i32).unwrap();
                rank.stream.synchronize().unwrap_or_else(|e| panic!("{how}: {name} of {bytes} bytes, root {root}: GPU {r}: {e}"));
                if reduce && r != root {
                    continue;
                }
                let want = bytes_of(count, |i| match reduce {
                    false => val(root, i + salt),
                    true => (0..2).fold(0i32, |a, q| a.wrapping_add(val(q, i + salt))),
                });
                assert!(
                    rank.recv.download().unwrap()[..bytes] == want[..],
                    "{how}: {name} of {bytes} bytes, root {root}: GPU {r} is wrong"
                );
            }
            // A small all-reduce after it: the workspace as the next call expects.
            salt += 1;
            fill(Kind::AllReduce, rs, 1000, salt);
            issue_alone(comms, rs, Kind::AllReduce, 1000);
            check(Kind::AllReduce, rs, 1000, salt, "all-reduce after a rooted call").unwrap();
            eprintln!("{how}: {name} of {bytes} bytes, root {root}: exact, and the all-reduce after it");
        }
    }
    // Captured once per GPU, replayed: a broadcast of 40 rounds from root 1.
    let count = ints(40 << 16);
    let graphs: Vec<_> = comms
        .iter()
        .zip(rs)
        .enumerate()
        .map(|(r, (comm, rank))| {
            set_device(r as i32).unwrap();
            rank.stream.begin_capture().unwrap();
            // SAFETY: as in `issue`; the buffers outlive the replays.
            unsafe { comm.collective(&rooted(false, rank, count, 1), &rank.on) }.unwrap();
            rank.stream.end_capture().unwrap().instantiate().unwrap()
        })
        .collect();
    for replay in 0..3 {
        salt += 1;
        fill(Kind::AllReduce, rs, count, salt);
        for (r, (g, rank)) in graphs.iter().zip(rs).enumerate() {
            set_device(r as i32).unwrap();
            g.launch(&rank.stream).unwrap();
        }
        for (r, rank) in rs.iter().enumerate() {
            set_device(r as i32).unwrap();
            rank.stream.synchronize().unwrap();
            let want = bytes_of(count, |i| val(1, i + salt));
            assert!(rank.recv.download().unwrap()[..4 * count] == want[..], "replay {replay}: GPU {r}'s broadcast is wrong");
        }
    }
    eprintln!("{how}: broadcast of 40 rounds captured on each GPU: exact over 3 replays");
}

fn bytes_of(count: usize, f: impl Fn(usize) -> i32) -> Vec<u8> {
    bytes((0..count).map(f))
}

/// Each rank's call of `kind` issued alone, one after the other from this thread.
fn issue_alone(comms: &[Communicator], ranks: &[Rank], kind: Kind, count: usize) {
    for (comm, rank) in comms.iter().zip(ranks) {
        // SAFETY: as in `issue`.
        unsafe { comm.collective(&call(kind, rank, count), &rank.on) }.unwrap();
    }
}
