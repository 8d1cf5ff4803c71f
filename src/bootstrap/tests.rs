//! Bootstrap tests: every job runs as threads of this process over loopback TCP, and every test
//! runs under a hard wall-clock limit so a hang fails instead of stalling the suite.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::wire::{self, ROOT_TARGET, Role};
use super::*;
use crate::error::{Error, Result, Status};

const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Run `f` on its own thread and fail the test if it has not finished within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("test exceeded its hard limit of {limit:?}"),
    }
}

/// Start one thread per (rank, nranks, uid) and collect each one's result, in input order.
fn run_ranks<T: Send + 'static>(
    members: Vec<(UniqueId, u32, u32)>,
    timeout: Duration,
    body: impl Fn(Bootstrap) -> Result<T> + Send + Sync + 'static,
) -> Vec<Result<T>> {
    let body = Arc::new(body);
    let handles: Vec<_> = members
        .into_iter()
        .map(|(uid, rank, nranks)| {
            let body = Arc::clone(&body);
            std::thread::spawn(move || body(Bootstrap::init(&uid, rank, nranks, timeout)?))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

fn job(uid: &UniqueId, n: u32) -> Vec<(UniqueId, u32, u32)> {
    (0..n).map(|r| (uid.clone(), r, n)).collect()
}

fn contribution(rank: u32) -> Vec<u8> {
    // Varied sizes, including empty (rank 0) and one above typical socket buffers (rank 3).
    let len = match rank {
        0 => 0,
        3 => 3 << 20,
        r => (r as usize) * 37 + 5,
    };
    (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(rank) as u8).collect()
}

fn exercise(b: Bootstrap) -> Result<()> {
    let (r, n) = (b.rank(), b.nranks());
    for _ in 0..2 {
        // Twice in a row: consecutive collectives must not mix their messages.
        let all = b.allgather(&contribution(r))?;
        assert_eq!(all.len(), n as usize);
        for (i, got) in all.iter().enumerate() {
            assert_eq!(got, &contribution(i as u32), "rank {r}: block {i}");
        }
    }
    b.barrier()?;
    for root in [0, n - 1, n / 2] {
        let data = format!("from root {root}").into_bytes();
        let got = b.broadcast(root, if r == root { &data } else { b"ignored" })?;
        assert_eq!(got, data, "rank {r}: broadcast from {root}");
    }
    // Point to point around the ring, two tags sent in one order and received in the other.
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    b.send(next, 7, format!("a{r}").as_bytes())?;
    b.send(next, 9, format!("b{r}").as_bytes())?;
    b.send(next, 7, format!("c{r}").as_bytes())?;
    assert_eq!(b.recv(prev, 9)?, format!("b{prev}").into_bytes());
    assert_eq!(b.recv(prev, 7)?, format!("a{prev}").into_bytes());
    assert_eq!(b.recv(prev, 7)?, format!("c{prev}").into_bytes());
    b.barrier()?;
    Ok(())
}

#[test]
fn collectives_and_p2p_on_1_to_8_ranks() {
    within(Duration::from_secs(20), || {
        for n in [1u32, 2, 3, 4, 5, 8] {
            let uid = UniqueId::create(Some(LO)).unwrap();
            let t0 = Instant::now();
            for (r, res) in run_ranks(job(&uid, n), Duration::from_secs(10), exercise).into_iter().enumerate() {
                res.unwrap_or_else(|e| panic!("{n} ranks: rank {r}: {e}"));
            }
            eprintln!("{n} ranks: {:?}", t0.elapsed());
        }
    });
}

#[test]
fn default_bind_address_is_reachable() {
    within(Duration::from_secs(10), || {
        // No bind address: the first non-loopback IPv4 of the host, else loopback.
        let uid = UniqueId::create(None).unwrap();
        assert!(!uid.root_addr().ip().is_unspecified());
        for res in run_ranks(job(&uid, 3), Duration::from_secs(5), |b| b.allgather(&[b.rank() as u8])) {
            assert_eq!(res.unwrap(), vec![vec![0], vec![1], vec![2]]);
        }
    });
}

#[test]
fn shared_between_threads() {
    within(Duration::from_secs(10), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let res = run_ranks(job(&uid, 2), Duration::from_secs(5), |b| {
            let b = Arc::new(b);
            let other = 1 - b.rank();
            // Two threads use the same Bootstrap at once with distinct tags.
            let hs: Vec<_> = (0..2u32)
                .map(|t| {
                    let b = Arc::clone(&b);
                    std::thread::spawn(move || -> Result<()> {
                        for i in 0..50u32 {
                            b.send(other, t, &i.to_le_bytes())?;
                            assert_eq!(b.recv(other, t)?, i.to_le_bytes());
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in hs {
                h.join().expect("thread panicked")?;
            }
            // Then collectives from another thread, in sequence.
            let b2 = Arc::clone(&b);
            std::thread::spawn(move || b2.barrier()).join().expect("thread panicked")?;
            // Sending to oneself is allowed and does not touch the network.
            b.send(b.rank(), 1, b"me")?;
            assert_eq!(b.recv(b.rank(), 1)?, b"me");
            Ok(())
        });
        for r in res {
            r.unwrap();
        }
    });
}

#[test]
fn argument_errors_are_named() {
    within(Duration::from_secs(10), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let e = Bootstrap::init(&uid, 2, 2, Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
        assert!(e.message().contains("rank 2"), "{e}");
        let e = Bootstrap::init(&uid, 0, 1, Duration::ZERO).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
        let b = Bootstrap::init(&uid, 0, 1, Duration::from_secs(2)).unwrap();
        assert_eq!(b.send(1, 0, b"x").unwrap_err().status(), Status::InvalidParam);
        assert_eq!(b.recv(5, 0).unwrap_err().status(), Status::InvalidParam);
        assert_eq!(b.broadcast(1, b"x").unwrap_err().status(), Status::InvalidParam);
        assert_eq!(b.allgather(b"solo").unwrap(), vec![b"solo".to_vec()]);
        b.barrier().unwrap();
        // "No practical limit" must not overflow deadline arithmetic.
        let uid = UniqueId::create(Some(LO)).unwrap();
        let b = Bootstrap::init(&uid, 0, 1, Duration::MAX).unwrap();
        assert_eq!(b.broadcast(0, b"x").unwrap(), b"x");
    });
}

#[test]
fn wrong_secret_is_rejected_and_does_not_stall_the_job() {
    within(Duration::from_secs(15), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let imposter = UniqueId::with_root(uid.root_addr(), b"not the secret").unwrap();
        let t0 = Instant::now();
        let mut members = job(&uid, 3);
        members.insert(1, (imposter, 0, 3));
        let res = run_ranks(members, Duration::from_secs(5), |b| {
            let all = b.allgather(&[b.rank() as u8])?;
            if b.rank() != 1 {
                // Rank-to-rank connections authenticate too: a wrong secret is refused.
                let peer = b.peer_addr(1).ok_or_else(|| Error::from(Status::Internal))?;
                let s = TcpStream::connect(peer).map_err(|e| Error::io("connect", e))?;
                let deadline = Instant::now() + Duration::from_secs(2);
                let e = wire::client_handshake(&s, &[0x55; 32], Role::Peer, b.rank(), 1, deadline, "imposter").unwrap_err();
                assert_eq!(e.status(), Status::Rejected, "{e}");
            }
            b.barrier()?;
            // The job still works after the refused connections.
            let again = b.allgather(&[b.rank() as u8 + 10])?;
            Ok((all, again))
        });
        let elapsed = t0.elapsed();
        let e = res[1].as_ref().unwrap_err();
        assert_eq!(e.status(), Status::Rejected, "{e}");
        assert!(e.message().contains("authentication failed"), "{e}");
        for i in [0usize, 2, 3] {
            let (all, again) = res[i].as_ref().unwrap();
            assert_eq!(all, &vec![vec![0u8], vec![1], vec![2]]);
            assert_eq!(again, &vec![vec![10u8], vec![11], vec![12]]);
        }
        assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    });
}

#[test]
fn garbage_and_silent_connections_do_not_stall_the_root() {
    within(Duration::from_secs(15), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let root = uid.root_addr();
        let silent = TcpStream::connect(root).unwrap();
        let mut garbage = TcpStream::connect(root).unwrap();
        garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut huge = TcpStream::connect(root).unwrap();
        huge.write_all(&[0xff; 5]).unwrap();
        let t0 = Instant::now();
        for res in run_ranks(job(&uid, 4), Duration::from_secs(5), |b| b.allgather(&[b.rank() as u8])) {
            assert_eq!(res.unwrap().len(), 4);
        }
        // The default handshake timeout is 5 s: finishing well before it shows nobody waited on
        // the silent connection.
        assert!(t0.elapsed() < Duration::from_secs(3), "took {:?}", t0.elapsed());
        // Garbage is dropped at once (EOF or reset, not a timeout).
        for s in [&mut garbage, &mut huge] {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut buf = [0u8; 64];
            match s.read(&mut buf) {
                Ok(0) => {}
                Ok(n) => panic!("root answered garbage with {n} bytes"),
                Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
            }
        }
        drop(silent);

        // A silent client is cut off after the handshake timeout.
        let opts = RootOptions { handshake_timeout: Duration::from_millis(300), ..RootOptions::default() };
        let uid = UniqueId::create_with(Some(LO), &opts).unwrap();
        let mut silent = TcpStream::connect(uid.root_addr()).unwrap();
        silent.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let t0 = Instant::now();
        let mut buf = [0u8; 8];
        match silent.read(&mut buf) {
            Ok(0) => {}
            Ok(n) => panic!("root sent {n} bytes to a client that never said hello"),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(2), "silent client kept {:?}", t0.elapsed());
        // And that root still serves the job afterwards.
        for res in run_ranks(job(&uid, 2), Duration::from_secs(5), |b| b.barrier()) {
            res.unwrap();
        }
    });
}

#[test]
fn nranks_mismatch_reaches_every_rank() {
    within(Duration::from_secs(10), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        // Ranks 0-2 say 4, rank 3 says 5: neither job can complete, whatever the arrival order.
        let members = vec![(uid.clone(), 0, 4), (uid.clone(), 1, 4), (uid.clone(), 2, 4), (uid.clone(), 3, 5)];
        let t0 = Instant::now();
        for (i, res) in run_ranks(members, Duration::from_secs(5), |_| Ok(())).into_iter().enumerate() {
            let e = res.unwrap_err();
            assert_eq!(e.status(), Status::InvalidParam, "member {i}: {e}");
            assert!(e.message().contains("announced nranks="), "member {i}: {e}");
        }
        assert!(t0.elapsed() < Duration::from_secs(3), "took {:?}", t0.elapsed());

        // A rank claimed twice is named too.
        let uid = UniqueId::create(Some(LO)).unwrap();
        let members = vec![(uid.clone(), 0, 2), (uid.clone(), 0, 2)];
        for res in run_ranks(members, Duration::from_secs(5), |_| Ok(())) {
            let e = res.unwrap_err();
            assert_eq!(e.status(), Status::InvalidParam, "{e}");
            assert!(e.message().contains("rank 0 registered twice"), "{e}");
        }
    });
}

#[test]
fn missing_rank_times_out_everyone_within_the_timeout() {
    within(Duration::from_secs(10), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let timeout = Duration::from_millis(800);
        let members: Vec<_> = job(&uid, 4).into_iter().filter(|m| m.1 != 2).collect();
        let t0 = Instant::now();
        for res in run_ranks(members, timeout, |_| Ok(())) {
            let e = res.unwrap_err();
            assert_eq!(e.status(), Status::TimedOut, "{e}");
        }
        let elapsed = t0.elapsed();
        assert!(elapsed >= timeout && elapsed < timeout + Duration::from_secs(1), "{elapsed:?}");

        // The root's own timeout names the missing ranks.
        let opts = RootOptions { timeout: Duration::from_millis(300), ..RootOptions::default() };
        let uid = UniqueId::create_with(Some(LO), &opts).unwrap();
        let e = Bootstrap::init(&uid, 0, 3, Duration::from_secs(3)).unwrap_err();
        assert_eq!(e.status(), Status::TimedOut, "{e}");
        assert!(e.message().contains("missing ranks: 1, 2"), "{e}");
    });
}

#[test]
fn operation_timeouts_and_peer_failure_name_the_rank() {
    within(Duration::from_secs(10), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let timeout = Duration::from_millis(700);
        let res = run_ranks(job(&uid, 2), timeout, move |b| {
            // Nobody sends tag 5: TimedOut naming the rank waited on, within the timeout.
            let other = 1 - b.rank();
            let t0 = Instant::now();
            let e = b.recv(other, 5).unwrap_err();
            assert_eq!(e.status(), Status::TimedOut, "{e}");
            assert!(e.message().contains(&format!("waiting for rank {other}")), "{e}");
            assert!(t0.elapsed() < timeout + Duration::from_millis(300));
            if b.rank() == 1 {
                b.send(0, 1, b"last words")?;
                // Wait for rank 0 to see the message, then go away.
                b.recv(0, 99)?;
                return Ok(None);
            }
            assert_eq!(b.recv(1, 1)?, b"last words");
            b.send(1, 99, b"bye")?;
            // Rank 1 drops its Bootstrap: well before the timeout we learn it is gone.
            let t0 = Instant::now();
            let e = b.recv(1, 2).unwrap_err();
            let waited = t0.elapsed();
            Ok(Some((e, waited)))
        });
        assert!(res[1].as_ref().unwrap().is_none());
        let (e, waited) = res[0].as_ref().unwrap().clone().unwrap();
        assert_eq!(e.status(), Status::PeerFailed, "{e}");
        assert!(e.message().contains("rank 1"), "{e}");
        assert!(waited < timeout, "{waited:?}");
    });
}

#[test]
fn shrink_leaves_out_the_excluded_ranks_which_take_no_part() {
    within(Duration::from_secs(20), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        // Ranks 0 and 3 of five leave at once (as dead ones would); the other three shrink
        // without them (the list in any order), then shrink again without their new rank 1.
        let res = run_ranks(job(&uid, 5), Duration::from_secs(5), |b| {
            if [0, 3].contains(&b.rank()) {
                return Ok(None);
            }
            let small = b.shrink(&[3, 0])?;
            assert_eq!(small.nranks(), 3);
            let want = [(1, 0), (2, 1), (4, 2)].into_iter().find(|p| p.0 == b.rank()).unwrap().1;
            assert_eq!(small.rank(), want, "old rank {} renumbered", b.rank());
            assert_eq!(small.allgather(&[b.rank() as u8])?, vec![vec![1], vec![2], vec![4]]);
            if small.rank() == 1 {
                return Ok(Some(small.rank()));
            }
            let smaller = small.shrink(&[1])?;
            assert_eq!((smaller.rank(), smaller.nranks()), (small.rank() / 2, 2));
            exercise(smaller)?;
            Ok(Some(small.rank()))
        });
        let ranks: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(ranks, [None, Some(0), Some(1), None, Some(2)]);
    });
}

#[test]
fn shrink_names_bad_lists_and_a_rank_whose_list_differs() {
    within(Duration::from_secs(20), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let res = run_ranks(job(&uid, 2), Duration::from_secs(5), |b| {
            let me = b.rank();
            for (list, says) in [
                (vec![], "is empty".to_string()),
                (vec![2], "rank 2 to exclude is not below nranks 2".to_string()),
                (vec![1 - me, 1 - me], format!("rank {} is listed twice", 1 - me)),
                (vec![me], format!("this rank ({me}) is in the list to exclude")),
            ] {
                let e = b.shrink(&list).unwrap_err();
                assert_eq!(e.status(), Status::InvalidParam, "{e}");
                assert!(e.message().contains(&says), "{list:?}: {e}");
            }
            // Nothing was sent: the group still works.
            b.barrier()
        });
        for r in res {
            r.unwrap();
        }
        // Rank 3 is gone; rank 2 also leaves out rank 1, which the others keep. Rank 2 learns
        // it from the lead's list; ranks 0 and 1 wait for it in the rendezvous until the timeout.
        let uid = UniqueId::create(Some(LO)).unwrap();
        let timeout = Duration::from_millis(800);
        let res = run_ranks(job(&uid, 4), timeout, |b| match b.rank() {
            3 => Ok(None),
            2 => Ok(Some(b.shrink(&[3, 1]).unwrap_err())),
            _ => Ok(Some(b.shrink(&[3]).unwrap_err())),
        });
        let errors: Vec<Error> = res.into_iter().filter_map(|r| r.unwrap()).collect();
        assert!(errors[2].message().contains("rank 0 excludes ranks [3], rank 2 excludes [1, 3]"), "{}", errors[2]);
        for e in &errors[..2] {
            assert_eq!(e.status(), Status::TimedOut, "{e}");
        }
    });
}

/// Jobs one after the other at one fixed address, as launcher mode (and NCCL_COMM_ID) make
/// them: rank 0 starts each job's root as soon as the last one answered. The root closes its
/// listening socket before it sends the table; when it closed it only up to ACCEPT_POLL later,
/// every second job failed (rank 0: "Address already in use"; the others: connection closed by
/// the finished root).
#[test]
fn jobs_one_after_another_at_one_address() {
    within(Duration::from_secs(60), || {
        let addr = std::net::SocketAddr::new(LO, free_port());
        for job in 0..20 {
            // Launcher mode's way (create_at), and NCCL_COMM_ID's (an id made from the address,
            // served by rank 0), in turn.
            let root = std::thread::spawn(move || -> Result<()> {
                let uid = match job % 2 {
                    0 => UniqueId::create_at(addr, b"one address", &RootOptions::default())?,
                    _ => {
                        let uid = UniqueId::with_root_at(&addr.to_string(), b"one address", "the test's address")?;
                        uid.serve(&RootOptions::default())?;
                        uid
                    }
                };
                Bootstrap::init(&uid, 0, 3, Duration::from_secs(10))?.barrier()
            });
            let others: Vec<_> = (1..3)
                .map(|rank| {
                    std::thread::spawn(move || -> Result<()> {
                        Bootstrap::init(&UniqueId::with_root(addr, b"one address")?, rank, 3, Duration::from_secs(10))?.barrier()
                    })
                })
                .collect();
            let mut results = vec![root.join().unwrap()];
            results.extend(others.into_iter().map(|h| h.join().unwrap()));
            assert!(results.iter().all(|r| r.is_ok()), "job {job}: {results:?}");
        }
    });
}

#[test]
fn unique_id_round_trips_and_rejects_corruption() {
    let uid = UniqueId::with_root("10.0.0.7:29500".parse().unwrap(), b"s3cret").unwrap();
    let bytes = uid.to_bytes();
    assert_eq!(bytes.len(), UNIQUE_ID_BYTES);
    assert_eq!(UniqueId::from_bytes(&bytes).unwrap(), uid);
    let s = uid.to_string();
    assert_eq!(s.len(), 2 * UNIQUE_ID_BYTES);
    assert_eq!(s.parse::<UniqueId>().unwrap(), uid);
    assert_eq!(format!("  {}\n", s.to_uppercase()).parse::<UniqueId>().unwrap(), uid);
    let v6 = UniqueId::with_root("[fd00::1]:1234".parse().unwrap(), b"x").unwrap();
    assert_eq!(UniqueId::from_bytes(&v6.to_bytes()).unwrap(), v6);
    // The secret is derived, deterministic and never printed by Debug.
    assert_eq!(UniqueId::with_root(uid.root_addr(), b"s3cret").unwrap(), uid);
    assert_ne!(UniqueId::with_root(uid.root_addr(), b"s3cres").unwrap(), uid);
    assert!(format!("{uid:?}").contains("redacted"));
    assert_eq!(UniqueId::with_root(uid.root_addr(), b"").unwrap_err().status(), Status::InvalidParam);

    // Any single corrupted byte is caught.
    for i in 0..UNIQUE_ID_BYTES {
        let mut b = bytes;
        b[i] ^= 0x01;
        let e = UniqueId::from_bytes(&b).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam, "byte {i}");
    }
    let e = UniqueId::from_bytes(&bytes[..100]).unwrap_err();
    assert!(e.message().contains("100 bytes"), "{e}");
    let mut b = bytes;
    b[0] = b'X';
    assert!(UniqueId::from_bytes(&b).unwrap_err().message().contains("magic"));
    let mut b = bytes;
    b[4] = 9;
    assert!(UniqueId::from_bytes(&b).unwrap_err().message().contains("version 9"));
    let mut b = bytes;
    b[40] ^= 0x80;
    assert!(UniqueId::from_bytes(&b).unwrap_err().message().contains("checksum"));

    let e = s[..200].parse::<UniqueId>().unwrap_err();
    assert!(e.message().contains("200 characters"), "{e}");
    let mut bad = s.clone();
    bad.replace_range(10..11, "g");
    let e = bad.parse::<UniqueId>().unwrap_err();
    assert_eq!(e.status(), Status::InvalidParam);
    assert!(e.message().contains("character 10"), "{e}");
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k: &str| m.get(k).cloned()
}

fn detect_in(pairs: &[(&str, &str)]) -> Result<Option<LaunchInfo>> {
    detect_with(&env(pairs))
}

#[test]
fn launcher_detection() {
    let info = |rank, size, lr, ls, launcher| LaunchInfo { rank, size, local_rank: lr, local_size: ls, launcher };
    assert_eq!(detect_in(&[]).unwrap(), None);
    assert_eq!(
        detect_in(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
        ])
        .unwrap(),
        Some(info(3, 8, Some(1), Some(2), Launcher::OpenMpi))
    );
    assert_eq!(
        detect_in(&[("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "0")]).unwrap(),
        Some(info(2, 4, Some(0), None, Launcher::Mpich))
    );
    assert_eq!(
        detect_in(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "6"), ("SLURM_LOCALID", "1")]).unwrap(),
        Some(info(5, 6, Some(1), None, Launcher::Slurm))
    );
    assert_eq!(detect_in(&[("SLURM_PROCID", "1"), ("SLURM_NPROCS", "2")]).unwrap(), Some(info(1, 2, None, None, Launcher::Slurm)));
    assert_eq!(
        detect_in(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")]).unwrap(),
        Some(info(1, 4, Some(1), Some(2), Launcher::Torchrun))
    );
    assert_eq!(detect_in(&[("GSC_RANK", "0"), ("GSC_NRANKS", "1")]).unwrap(), Some(info(0, 1, None, None, Launcher::Gscomm)));
    // Precedence: GSC_* over everything, MPI over Slurm, torchrun workers over the srun agent.
    assert_eq!(
        detect_in(&[("GSC_RANK", "1"), ("GSC_NRANKS", "2"), ("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "4")])
            .unwrap()
            .map(|i| (i.launcher, i.rank, i.size)),
        Some((Launcher::Gscomm, 1, 2))
    );
    assert_eq!(
        detect_in(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])
            .unwrap()
            .map(|i| i.launcher),
        Some(Launcher::OpenMpi)
    );
    assert_eq!(
        detect_in(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])
            .unwrap()
            .map(|i| (i.launcher, i.rank)),
        Some((Launcher::Torchrun, 3))
    );
    // A lone generic RANK is someone else's variable, not a launcher.
    assert_eq!(detect_in(&[("RANK", "3")]).unwrap(), None);

    // Malformed values name the variable.
    let err = |pairs: &[(&str, &str)]| detect_in(pairs).unwrap_err();
    let e = err(&[("OMPI_COMM_WORLD_RANK", "x1"), ("OMPI_COMM_WORLD_SIZE", "4")]);
    assert_eq!(e.status(), Status::InvalidParam);
    assert!(e.message().contains("OMPI_COMM_WORLD_RANK=\"x1\""), "{e}");
    let e = err(&[("GSC_RANK", "4"), ("GSC_NRANKS", "4")]);
    assert!(e.message().contains("GSC_RANK=4 is not below GSC_NRANKS=4"), "{e}");
    let e = err(&[("GSC_RANK", "0")]);
    assert!(e.message().contains("GSC_RANK is set but GSC_NRANKS is not"), "{e}");
    let e = err(&[("PMI_SIZE", "2")]);
    assert!(e.message().contains("PMI_SIZE is set but PMI_RANK is not"), "{e}");
    let e = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "0")]);
    assert!(e.message().contains("SLURM_NTASKS=0"), "{e}");
    let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "-1")]);
    assert!(e.message().contains("LOCAL_RANK=\"-1\""), "{e}");
    let e = err(&[("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("MPI_LOCALRANKID", "2"), ("MPI_LOCALNRANKS", "2")]);
    assert!(e.message().contains("MPI_LOCALRANKID=2 is not below MPI_LOCALNRANKS=2"), "{e}");
    let e = err(&[("SLURM_PROCID", "99999999999"), ("SLURM_NTASKS", "2")]);
    assert!(e.message().contains("SLURM_PROCID"), "{e}");
}

#[test]
fn options_from_environment() {
    let o = BootstrapOptions::from_env_with(&env(&[])).unwrap();
    assert_eq!(o, BootstrapOptions::default());
    let o = BootstrapOptions::from_env_with(&env(&[
        ("GSC_BOOTSTRAP_ADDR", " node1:4000 "),
        ("GSC_BOOTSTRAP_SECRET", "pw"),
        ("GSC_BOOTSTRAP_TIMEOUT", "500ms"),
    ]))
    .unwrap();
    assert_eq!(o.addr.as_deref(), Some("node1:4000"));
    assert_eq!(o.secret.as_deref(), Some("pw"));
    assert_eq!(o.timeout, Duration::from_millis(500));
    assert!(!format!("{o:?}").contains("pw"));
    for (t, want) in [("30", 30_000u64), ("2.5s", 2_500)] {
        let o = BootstrapOptions::from_env_with(&env(&[("GSC_BOOTSTRAP_TIMEOUT", t)])).unwrap();
        assert_eq!(o.timeout, Duration::from_millis(want));
    }
    for bad in ["0", "-1", "soon", "1e99", "NaN"] {
        let e = BootstrapOptions::from_env_with(&env(&[("GSC_BOOTSTRAP_TIMEOUT", bad)])).unwrap_err();
        assert!(e.message().contains("GSC_BOOTSTRAP_TIMEOUT"), "{bad}: {e}");
    }
}

fn free_port() -> u16 {
    TcpListener::bind((LO, 0)).unwrap().local_addr().unwrap().port()
}

fn launch_job(
    n: u32,
    launcher: Launcher,
    opts: BootstrapOptions,
    vars: &'static [(&'static str, &'static str)],
    extra: Vec<(&'static str, String)>,
) -> Vec<Result<Vec<Vec<u8>>>> {
    let handles: Vec<_> = (0..n)
        .rev() // rank 0 last: the others must wait for its root service to appear
        .map(|rank| {
            let opts = opts.clone();
            let extra = extra.clone();
            std::thread::spawn(move || {
                if rank == 0 {
                    std::thread::sleep(Duration::from_millis(150));
                }
                let mut m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
                m.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
                let lookup = move |k: &str| m.get(k).cloned();
                let info = LaunchInfo { rank, size: n, local_rank: None, local_size: None, launcher };
                let b = Bootstrap::from_launcher_with(&opts, &info, &lookup)?;
                b.allgather(&[rank as u8])
            })
        })
        .collect();
    let mut res: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank panicked")).collect();
    res.reverse();
    res
}

#[test]
fn from_launcher_modes() {
    within(Duration::from_secs(15), || {
        let want: Vec<Vec<u8>> = (0..3u8).map(|r| vec![r]).collect();
        // Explicit address and secret.
        let opts = BootstrapOptions {
            addr: Some(format!("127.0.0.1:{}", free_port())),
            secret: Some("correct horse".into()),
            timeout: Duration::from_secs(5),
            ..BootstrapOptions::default()
        };
        for r in launch_job(3, Launcher::Gscomm, opts, &[], vec![]) {
            assert_eq!(r.unwrap(), want);
        }
        // torchrun: MASTER_ADDR / MASTER_PORT+1, secret derived from the run id.
        let port = free_port();
        let opts = BootstrapOptions { timeout: Duration::from_secs(5), ..BootstrapOptions::default() };
        let extra = vec![("MASTER_PORT", (port - 1).to_string())];
        let vars = &[("MASTER_ADDR", "127.0.0.1"), ("TORCHELASTIC_RUN_ID", "run-42")];
        for r in launch_job(3, Launcher::Torchrun, opts, vars, extra) {
            assert_eq!(r.unwrap(), want);
        }
        // A unique id passed as a string.
        let uid = UniqueId::create(Some(LO)).unwrap();
        let opts = BootstrapOptions { unique_id: Some(uid.to_string()), timeout: Duration::from_secs(5), ..BootstrapOptions::default() };
        for r in launch_job(3, Launcher::Slurm, opts, &[], vec![]) {
            assert_eq!(r.unwrap(), want);
        }

        // No secret anywhere: a clear error, before any socket is opened.
        let info = LaunchInfo { rank: 1, size: 2, local_rank: None, local_size: None, launcher: Launcher::Slurm };
        let opts = BootstrapOptions { addr: Some("127.0.0.1:1".into()), ..BootstrapOptions::default() };
        let e = Bootstrap::from_launcher_with(&opts, &info, &env(&[])).unwrap_err();
        assert_eq!(e.status(), Status::InvalidParam);
        assert!(e.message().contains("GSC_BOOTSTRAP_SECRET"), "{e}");
        // No address either.
        let e = Bootstrap::from_launcher_with(&BootstrapOptions::default(), &info, &env(&[])).unwrap_err();
        assert!(e.message().contains("GSC_BOOTSTRAP_ADDR"), "{e}");
        // A corrupt unique id string names the variable.
        let opts = BootstrapOptions { unique_id: Some("abc".into()), ..BootstrapOptions::default() };
        let e = Bootstrap::from_launcher_with(&opts, &info, &env(&[])).unwrap_err();
        assert!(e.message().starts_with("GSC_UNIQUE_ID"), "{e}");
        // torchrun with a malformed MASTER_PORT.
        let info = LaunchInfo { launcher: Launcher::Torchrun, ..info };
        let e = Bootstrap::from_launcher_with(
            &BootstrapOptions::default(),
            &info,
            &env(&[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "http")]),
        )
        .unwrap_err();
        assert!(e.message().contains("MASTER_PORT=\"http\""), "{e}");
    });
}

#[test]
fn root_refuses_wrong_role_and_misaddressed_clients() {
    within(Duration::from_secs(10), || {
        let uid = UniqueId::create(Some(LO)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(3);
        // Right secret, but claiming to be a peer connection: refused by name.
        let s = TcpStream::connect(uid.root_addr()).unwrap();
        let e = wire::client_handshake(&s, uid.secret(), Role::Peer, 0, ROOT_TARGET, deadline, "t").unwrap_err();
        assert_eq!(e.status(), Status::Rejected);
        assert!(e.message().contains("role"), "{e}");
        let s = TcpStream::connect(uid.root_addr()).unwrap();
        let e = wire::client_handshake(&s, uid.secret(), Role::Rank, 0, 3, deadline, "t").unwrap_err();
        assert!(e.message().contains("stale address"), "{e}");
        // The service is unaffected.
        for r in run_ranks(job(&uid, 2), Duration::from_secs(5), |b| b.barrier()) {
            r.unwrap();
        }
    });
}
