//! Every decoder of bytes that cross a process boundary, as a fuzz target (issue #8): on any
//! input it must return a value or an error, never panic or read outside the input.
//!
//! `fuzz/` (cargo-fuzz, needs a nightly toolchain) runs the targets under libFuzzer;
//! tests/fuzz_corpus.rs runs each on valid encodings (`seeds`) and on thousands of mutations of
//! them in every CI run, so a decoder that starts panicking fails the build even where no
//! fuzzer runs.

use crate::bootstrap::UniqueId;
use crate::collectives::types::{DataType, RedOp};
use crate::core::address::WorkerAddress;
use crate::cuda::coll::CollKind;
use crate::protocols::wire::{self, Header};
use crate::transport::shm::address::ShmAddress;
use crate::transport::{LaneKind, ProcessIdentity};
use std::net::SocketAddr;
use std::path::PathBuf;

/// A decoder under test: takes any bytes.
pub type Target = fn(&[u8]);

/// The targets, by name (the names of fuzz/fuzz_targets/*.rs).
pub const TARGETS: &[(&str, Target)] = &[
    ("worker_address", |b| drop(WorkerAddress::unpack(b))),
    ("shm_address", |b| drop(ShmAddress::decode(b))),
    ("rkey", |b| drop(crate::core::memory::rkey_unpack(b))),
    ("wire_frame", wire_frame),
    ("device_key", |b| drop(crate::cuda::ipc::DeviceKey::decode(b))),
    ("unique_id", unique_id),
    ("bootstrap_addr", |b| drop(crate::bootstrap::wire::decode_addr(b))),
    ("bootstrap_error", |b| drop(crate::bootstrap::wire::decode_error(b, "fuzz"))),
    ("bootstrap_table", |b| {
        let n = b.first().map_or(0, |&x| u32::from(x % 9));
        drop(crate::bootstrap::comm::decode_table(b.get(1..).unwrap_or(&[]), n, "fuzz"))
    }),
    ("coll_signature", |b| drop(crate::collectives::agreement::Signature::decode(b))),
    ("peer_buffer_entry", |b| drop(crate::collectives::peer_buffers::decode_shared(b))),
    ("workspace_entry", workspace_entry),
    ("ucx_address", |b| drop(crate::transport::ucx::address::UcxAddress::decode(b))),
    ("ucx_frame", ucx_frame),
    ("ucx_rkey", ucx_rkey),
];

/// Run target `name` on `data` (what each fuzz/fuzz_targets/*.rs does).
pub fn run(name: &str, data: &[u8]) {
    match TARGETS.iter().find(|(n, _)| *n == name) {
        Some((_, target)) => target(data),
        None => panic!("no fuzz target named {name}"),
    }
}

/// A frame as a link delivers it: the header, the eager-only shortcut (which must agree with it
/// on what it accepts), and the payload split.
fn wire_frame(b: &[u8]) {
    let full = Header::decode(b);
    if let Some((tag, payload)) = wire::eager_only(b) {
        match full {
            Ok((Header::EagerOnly { tag: t }, p)) => assert!(t == tag && p == payload, "eager_only disagrees with decode"),
            other => panic!("eager_only accepted a frame decode reads as {other:?}"),
        }
    }
    let _ = wire::payload_of(b);
}

/// A UCX lane frame as it arrives in an active message: the header, then the body its kind
/// says (a hello, or a close notice); every decoder on any split of the bytes.
fn ucx_frame(b: &[u8]) {
    use crate::transport::ucx::wire;
    let (head, body) = b.split_at(b.len().min(wire::HEADER_LEN));
    drop(wire::Header::decode(head));
    drop(wire::Hello::decode(body));
    drop(wire::decode_close(body));
}

/// A UCX lane remote key as an RTS payload brings it: the decoder, then the range check the
/// link applies before any get (it must not overflow on any key and address).
fn ucx_rkey(b: &[u8]) {
    use crate::transport::ucx::rkey::RemoteKey;
    if let Ok(k) = RemoteKey::decode(b) {
        assert!(!k.ucx.is_empty() && k.ucx.len() <= crate::transport::ucx::rkey::MAX_UCX_RKEY);
        let _ = k.covers(k.base, usize::try_from(k.len).unwrap_or(usize::MAX));
        let _ = k.covers(u64::MAX, usize::MAX);
        assert_eq!(RemoteKey { base: k.base, len: k.len, ucx: k.ucx }.encode().ok().as_deref(), Some(b), "re-encoding differs");
    }
}

/// A communicator's workspace entry as the bootstrap delivers it: the entry, then the settings
/// comparison with a rank 0 that sent the same settings and with one that sent the defaults.
fn workspace_entry(b: &[u8]) {
    use crate::collectives::settings;
    if let Ok((_, theirs, _)) = settings::decode_workspace_entry(1, b) {
        settings::agree(&[theirs, theirs]).expect("equal settings agree");
        let ours = settings::encode(&crate::Config::default(), 8 << 20);
        let _ = settings::agree(&[&ours, theirs]);
    }
}

/// The unique id's binary form and its string form (what a launcher passes in the environment).
fn unique_id(b: &[u8]) {
    drop(UniqueId::from_bytes(b));
    if let Ok(s) = std::str::from_utf8(b) {
        drop(s.parse::<UniqueId>());
    }
}

/// Valid encodings for `target`, to start mutations from.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let me = ProcessIdentity { pid: 4242, start_time: 99 };
    match target {
        "worker_address" => vec![
            WorkerAddress { uuid: 7, host_id: 1, process: me, lanes: vec![] }.pack(),
            WorkerAddress {
                uuid: u128::MAX,
                host_id: 2,
                process: me,
                lanes: vec![(LaneKind::Shm, shm_address()), (LaneKind::Loopback, vec![1; 16])],
            }
            .pack(),
        ],
        "shm_address" => vec![shm_address()],
        "rkey" => {
            let mem = crate::core::memory::MemHandle { id: 3, base: 0x1000, len: 4096, context_uuid: 5 };
            vec![crate::core::memory::rkey_pack(&mem, me)]
        }
        "wire_frame" => {
            let headers = [
                Header::EagerOnly { tag: 5 },
                Header::EagerFirst { tag: 1, msg_id: 2, total: 3 },
                Header::EagerNext { msg_id: 2, offset: 9 },
                Header::Rts { tag: 1, sreq: 2, total: 1 << 20, remote_addr: 0x1000, flags: 1 },
                Header::Rtr { sreq: 2, rreq: 3, len: 4 },
                Header::RndvData { rreq: 3, offset: 0 },
                Header::Ats { sreq: 2, status: -3 },
                Header::Close,
            ];
            headers
                .iter()
                .map(|h| {
                    let mut f = h.encode().as_bytes().to_vec();
                    f.extend_from_slice(b"payload!");
                    f
                })
                .collect()
        }
        "device_key" => {
            use crate::cuda::export_life::Life;
            use crate::cuda::ipc::{DeviceKey, KeyKind, VmmRef};
            use crate::transport::fd_pass::TOKEN_LEN;
            vec![
                DeviceKey { pid: 1, base: 0x7000_0000, size: 1 << 20, kind: KeyKind::SameProcess, life: None }.encode(),
                DeviceKey {
                    pid: 1,
                    base: 0x7000_0000,
                    size: 1 << 20,
                    kind: KeyKind::Legacy([7; crate::cuda::ipc::HANDLE_LEN]),
                    life: None,
                }
                .encode(),
                DeviceKey {
                    pid: 1,
                    base: 0x7000_0000,
                    size: 2 << 20,
                    kind: KeyKind::Vmm(VmmRef { token: [3; TOKEN_LEN], export_id: 2, phys_offset: 0 }),
                    life: Some(Life { token: [3; TOKEN_LEN], table_id: 1, slot: 5, serial: 9 }),
                }
                .encode(),
            ]
        }
        "unique_id" => {
            let uid = UniqueId::from_parts(addr(), [9; crate::bootstrap::wire::SECRET_BYTES]);
            vec![uid.to_bytes().to_vec(), uid.to_string().into_bytes()]
        }
        "bootstrap_addr" => {
            let mut v = Vec::new();
            crate::bootstrap::wire::encode_addr(&addr(), &mut v);
            vec![v]
        }
        "bootstrap_error" => vec![crate::bootstrap::wire::encode_error(&crate::Error::invalid_param("x"))],
        "bootstrap_table" => {
            let mut t = vec![2u8, 2, 0, 0, 0];
            for _ in 0..2 {
                crate::bootstrap::wire::encode_addr(&addr(), &mut t);
            }
            vec![t]
        }
        "coll_signature" => {
            vec![crate::collectives::agreement::Signature::new(CollKind::Reduce, DataType::Float32, RedOp::Max, 77, 1).encode()]
        }
        "peer_buffer_entry" => {
            use crate::collectives::peer_buffers::{Shared, encode_shared};
            vec![
                encode_shared(None),
                encode_shared(Some(&Shared { send: 0x7000, send_key: vec![1; 88], recv: 0x9000, recv_key: vec![2; 120] })),
            ]
        }
        "workspace_entry" => {
            use crate::collectives::settings;
            vec![settings::encode_workspace_entry(0x7000_0000, &settings::encode(&crate::Config::default(), 8 << 20), &[7; 88])]
        }
        "ucx_address" => vec![ucx_address()],
        "ucx_frame" => {
            use crate::transport::ucx::wire::{self, Header, Hello, Kind, LinkName, Side};
            let link = LinkName { connector: 0x1234, number: 7 };
            let hello = Header { kind: Kind::Hello, from: Side::Connector, link, seq: 0 };
            let data = Header { kind: Kind::Data, from: Side::Acceptor, link, seq: 42 };
            let close = Header { kind: Kind::Close, from: Side::Connector, link, seq: 43 };
            let body = Hello { listener: 9, connector_address: ucx_address() }.encode();
            vec![
                [hello.encode().as_slice(), &body].concat(),
                [data.encode().as_slice(), b"payload"].concat(),
                [close.encode().as_slice(), &wire::encode_close(wire::CloseReason::Closed, "bye")].concat(),
            ]
        }
        "ucx_rkey" => {
            use crate::transport::ucx::rkey::{MAX_UCX_RKEY, RemoteKey};
            [(0x7f00_0000_1000u64, 1u64 << 20, vec![0x5a; 18]), (0, 0, vec![1]), (1 << 40, 64 << 20, vec![0xc3; MAX_UCX_RKEY])]
                .iter()
                .map(|(base, len, ucx)| RemoteKey { base: *base, len: *len, ucx }.encode().expect("a valid key"))
                .collect()
        }
        other => panic!("no fuzz target named {other}"),
    }
}

fn ucx_address() -> Vec<u8> {
    crate::transport::ucx::address::UcxAddress { uuid: 77, ucx_version: (1, 13), worker_address: vec![0xab; 60] }
        .encode()
        .expect("a valid address")
}

fn addr() -> SocketAddr {
    "127.0.0.1:4000".parse().expect("literal address")
}

fn shm_address() -> Vec<u8> {
    ShmAddress {
        host_id: 1,
        pid_ns: 2,
        listener: ProcessIdentity { pid: 3, start_time: 4 },
        listener_uuid: 5,
        cookie_addr: 6,
        cookie_value: 7,
        segment: PathBuf::from("/dev/shm/gsc-fuzz"),
    }
    .encode()
    .expect("a valid address")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed is a valid encoding for its decoder: mutations start from inputs that reach
    /// past the first check.
    #[test]
    fn seeds_decode() {
        for (name, _) in TARGETS {
            for seed in seeds(name) {
                let ok = match *name {
                    "worker_address" => WorkerAddress::unpack(&seed).is_ok(),
                    "shm_address" => ShmAddress::decode(&seed).is_ok(),
                    "rkey" => crate::core::memory::rkey_unpack(&seed).is_ok(),
                    "wire_frame" => Header::decode(&seed).is_ok(),
                    "device_key" => crate::cuda::ipc::DeviceKey::decode(&seed).is_ok(),
                    "unique_id" => {
                        UniqueId::from_bytes(&seed).is_ok() || std::str::from_utf8(&seed).is_ok_and(|s| s.parse::<UniqueId>().is_ok())
                    }
                    "bootstrap_addr" => crate::bootstrap::wire::decode_addr(&seed).is_ok(),
                    "bootstrap_error" => true, // decode_error always yields an error value
                    "bootstrap_table" => crate::bootstrap::comm::decode_table(&seed[1..], u32::from(seed[0]), "seed").is_ok(),
                    "coll_signature" => crate::collectives::agreement::Signature::decode(&seed).is_ok(),
                    "ucx_address" => crate::transport::ucx::address::UcxAddress::decode(&seed).is_ok(),
                    "ucx_frame" => {
                        use crate::transport::ucx::wire;
                        let (head, body) = seed.split_at(wire::HEADER_LEN);
                        match wire::Header::decode(head).map(|h| h.kind) {
                            Ok(wire::Kind::Hello) => wire::Hello::decode(body).is_ok(),
                            Ok(wire::Kind::Close) => wire::decode_close(body).is_ok(),
                            Ok(wire::Kind::Data) => true,
                            Err(_) => false,
                        }
                    }
                    "ucx_rkey" => crate::transport::ucx::rkey::RemoteKey::decode(&seed).is_ok(),
                    "peer_buffer_entry" => crate::collectives::peer_buffers::decode_shared(&seed).is_ok(),
                    "workspace_entry" => crate::collectives::settings::decode_workspace_entry(0, &seed).is_ok(),
                    other => panic!("no seed check for {other}"),
                };
                assert!(ok, "{name}: a seed its decoder refuses");
            }
        }
    }
}
