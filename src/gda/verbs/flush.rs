//! The GPUDirect RDMA flush: what a receiver does after a NIC wrote into its GPU memory and
//! before it tells anyone (its stream, a kernel, the host) that the data is there.
//!
//! A NIC's writes into GPU memory are posted PCIe writes. The completion that says "the write
//! arrived" (a CQE, an immediate, a flag written by the same NIC) can be observed before the
//! data is visible to the GPU's own loads. A read by the NIC from the same GPU cannot pass
//! those writes, so when an RDMA read from GPU memory completes, everything the NIC wrote there
//! before it is visible. That read is the flush (NCCL's `ncclIbIflush` does the same on a
//! loopback QP). Some platforms also need a write to go first (the seed PR's
//! `..._FLUSH_RDMA_WRITE` knob): `GSC_FLUSH_RDMA_WRITE=1` posts an RDMA write into GPU memory
//! before the read.
//!
//! Both are posted on the connection's flush QP, a QP connected to itself:
//! - write (only with `GSC_FLUSH_RDMA_WRITE=1`): host flush buffer -> GPU flush buffer,
//!   *unsignalled*. Its success is never surfaced: a good write has no CQE, and should a CQE
//!   come anyway it is dropped. A failing write still writes an error CQE; that fails the
//!   operation.
//! - read: GPU flush buffer (or a GPU address the caller names, such as the received buffer
//!   itself) -> host flush buffer, *signalled*. Its CQE completes the operation.
//!
//! The buffers (`FlushBuffers`) are allocated and registered when the connection is created,
//! and deregistered and freed when it closes; a failure there is logged as a warning and the
//! rest is still released. Memory comes through the `FlushMemory` trait so the sequence is
//! tested here with a fake; the verbs implementation is `super::loader::VerbsFlushMemory`.
//!
//! Like src/protocols/, the `Flush` machine does no I/O: `start` and `on_completion` take
//! events and push `FlushAction`s, which the engine executes (posting on its `SendQueue`, or
//! writing the WQEs at prepare time for a stream to ring).

use std::collections::VecDeque;
use std::fmt;

use super::mlx5::CqeError;
use super::queue::{LocalSge, RemoteRef, WorkOp, WorkRequest};
use crate::config::Config;
use crate::error::{Error, Result, Status};

/// The knob that adds the RDMA-write flush (a row of `crate::config`'s table).
pub const FLUSH_RDMA_WRITE_VAR: &str = "GSC_FLUSH_RDMA_WRITE";

/// Bytes the flush reads and writes.
pub const FLUSH_LEN: u32 = 4;

/// Bytes allocated for each flush buffer (one cache line: room for `FLUSH_LEN`, aligned).
pub const FLUSH_BUFFER_LEN: usize = 64;

/// Which flush a receiver performs.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum FlushMode {
    /// An RDMA read from GPU memory (the default).
    #[default]
    Read,
    /// An unsignalled RDMA write into GPU memory, then the RDMA read (`GSC_FLUSH_RDMA_WRITE=1`).
    WriteThenRead,
}

impl FlushMode {
    pub fn name(self) -> &'static str {
        match self {
            FlushMode::Read => "rdma-read",
            FlushMode::WriteThenRead => "rdma-write+rdma-read",
        }
    }
}

/// Flush settings of a connection.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlushConfig {
    pub mode: FlushMode,
}

impl FlushConfig {
    /// The flush `config` asks for (`GSC_FLUSH_RDMA_WRITE`, parsed by the knob table).
    pub fn from_config(config: &Config) -> FlushConfig {
        FlushConfig { mode: if config.flush_rdma_write { FlushMode::WriteThenRead } else { FlushMode::Read } }
    }

    /// Parse a value of `GSC_FLUSH_RDMA_WRITE` (`None`: unset) with the knob table's parser,
    /// for callers that hold the text rather than a `Config`.
    pub fn parse(value: Option<&str>) -> Result<FlushConfig> {
        let mut config = Config::default();
        if let Some(text) = value {
            config.set(FLUSH_RDMA_WRITE_VAR, text)?;
        }
        Ok(FlushConfig::from_config(&config))
    }
}

/// Where a flush buffer lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    /// Host memory: the destination of the flush read.
    Host,
    /// GPU memory, registered through a dmabuf: the destination of the flush write and the
    /// default source of the flush read.
    Gpu,
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Place::Host => "host",
            Place::Gpu => "GPU",
        })
    }
}

/// An allocated flush buffer. `handle` is the allocator's own.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub place: Place,
    pub addr: u64,
    pub len: usize,
    pub handle: u64,
}

/// A buffer's registration with the NIC. `handle` is the allocator's own.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub lkey: u32,
    pub rkey: u32,
    pub handle: u64,
}

/// Allocation and registration of flush buffers: `ibv_reg_mr` on host memory and
/// `ibv_reg_dmabuf_mr` on GPU memory in the verbs engine, a recording fake in tests.
pub trait FlushMemory {
    fn alloc(&mut self, place: Place, len: usize) -> Result<Buffer>;
    /// Register for local write and remote read/write (the flush QP reads and writes both).
    fn register(&mut self, buf: &Buffer) -> Result<Registration>;
    fn deregister(&mut self, buf: &Buffer, reg: &Registration) -> Result<()>;
    fn free(&mut self, buf: &Buffer) -> Result<()>;
}

/// What the flush WQEs point at, taken from `FlushBuffers::targets`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FlushTargets {
    /// The host flush buffer as a local scatter/gather entry (read destination, write source).
    pub host: LocalSge,
    /// The GPU flush buffer as a remote reference (write destination, default read source).
    pub gpu: RemoteRef,
}

/// Failures met while releasing flush buffers (each already logged as a warning).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReleaseReport {
    pub failures: Vec<Error>,
}

impl ReleaseReport {
    pub fn is_clean(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The two flush buffers of a connection, allocated and registered at creation, deregistered
/// and freed by `close` (or on drop).
pub struct FlushBuffers<M: FlushMemory> {
    /// `None` only after `close` moved it out.
    mem: Option<M>,
    /// `None` once released.
    held: Option<Held>,
}

#[derive(Copy, Clone, Debug)]
struct Held {
    host: (Buffer, Registration),
    gpu: (Buffer, Registration),
}

impl<M: FlushMemory> FlushBuffers<M> {
    /// Allocate and register the host and the GPU flush buffer. On failure everything done so
    /// far is undone (failures while undoing are logged) and the first error is returned.
    pub fn allocate(mut mem: M) -> Result<FlushBuffers<M>> {
        let host = alloc_registered(&mut mem, Place::Host)?;
        let gpu = match alloc_registered(&mut mem, Place::Gpu) {
            Ok(g) => g,
            Err(e) => {
                let mut report = ReleaseReport::default();
                release_one(&mut mem, &host, true, &mut report);
                release_one(&mut mem, &host, false, &mut report);
                return Err(e);
            }
        };
        Ok(FlushBuffers { mem: Some(mem), held: Some(Held { host, gpu }) })
    }

    pub fn targets(&self) -> FlushTargets {
        let held = self.held.as_ref().expect("flush buffers used after release");
        FlushTargets {
            host: LocalSge { addr: held.host.0.addr, len: FLUSH_LEN, lkey: held.host.1.lkey },
            gpu: RemoteRef { addr: held.gpu.0.addr, rkey: held.gpu.1.rkey },
        }
    }

    pub fn host(&self) -> Option<(Buffer, Registration)> {
        self.held.map(|h| h.host)
    }

    pub fn gpu(&self) -> Option<(Buffer, Registration)> {
        self.held.map(|h| h.gpu)
    }

    pub fn memory(&self) -> &M {
        self.mem.as_ref().expect("present until close")
    }

    /// Deregister both buffers, then free both. Every step is tried whatever happened before
    /// it; each failure is logged (`gsc::gda`, warning) and returned in the report. Dropping
    /// the buffers does the same, without the report.
    pub fn close(mut self) -> (M, ReleaseReport) {
        let report = self.release();
        let mem = self.mem.take().expect("present until close");
        (mem, report)
    }

    fn release(&mut self) -> ReleaseReport {
        let mut report = ReleaseReport::default();
        if let (Some(held), Some(mem)) = (self.held.take(), self.mem.as_mut()) {
            release_one(mem, &held.host, true, &mut report);
            release_one(mem, &held.gpu, true, &mut report);
            release_one(mem, &held.host, false, &mut report);
            release_one(mem, &held.gpu, false, &mut report);
        }
        report
    }
}

impl<M: FlushMemory> Drop for FlushBuffers<M> {
    fn drop(&mut self) {
        // Failures are logged by `release`; Drop never panics.
        let _ = self.release();
    }
}

fn alloc_registered<M: FlushMemory>(mem: &mut M, place: Place) -> Result<(Buffer, Registration)> {
    let buf = mem.alloc(place, FLUSH_BUFFER_LEN).map_err(|e| e.context(format!("allocating the {place} flush buffer")))?;
    match mem.register(&buf) {
        Ok(reg) => Ok((buf, reg)),
        Err(e) => {
            if let Err(free_err) = mem.free(&buf) {
                tracing::warn!(target: "gsc::gda", error = %free_err, "freeing the unregistered {place} flush buffer failed");
            }
            Err(e.context(format!("registering the {place} flush buffer")))
        }
    }
}

/// Deregister (`dereg`) or free one buffer, logging and recording a failure.
fn release_one<M: FlushMemory>(mem: &mut M, (buf, reg): &(Buffer, Registration), dereg: bool, report: &mut ReleaseReport) {
    let place = buf.place;
    let (what, result) = if dereg { ("deregistering", mem.deregister(buf, reg)) } else { ("freeing", mem.free(buf)) };
    if let Err(e) = result {
        tracing::warn!(target: "gsc::gda", error = %e, addr = buf.addr, "{what} the {place} flush buffer failed; releasing the rest");
        report.failures.push(e.context(format!("{what} the {place} flush buffer")));
    }
}

/// Identifies a flush operation to the caller (its request, say).
pub type FlushOpId = u64;

/// What the engine must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlushAction {
    /// Post this WQE on the flush QP (and ring the doorbell after the last `Post` of a batch).
    Post(WorkRequest),
    /// The data the NIC wrote before this operation started is visible in GPU memory.
    Complete { op: FlushOpId },
    /// The flush failed; the data may not be visible. The operation fails with `error`.
    Fail { op: FlushOpId, error: Error },
}

/// Which of an operation's WQEs a `wr_id` names (its low bit).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Leg {
    Write = 0,
    Read = 1,
}

impl Leg {
    fn name(self) -> &'static str {
        match self {
            Leg::Write => "RDMA-write flush",
            Leg::Read => "RDMA-read flush",
        }
    }
}

fn wr_id(seq: u64, leg: Leg) -> u64 {
    seq << 1 | leg as u64
}

#[derive(Copy, Clone, Debug)]
struct Pending {
    seq: u64,
    op: FlushOpId,
    /// Already reported failed (by its write's error CQE); its read's CQE is only retired.
    failed: bool,
}

/// Map a CQE error to the crate's error, naming which flush WQE failed.
fn flush_error(leg: Leg, e: &CqeError) -> Error {
    e.to_error().context(leg.name())
}

/// The flush sequence of one connection.
#[derive(Debug)]
pub struct Flush {
    mode: FlushMode,
    targets: FlushTargets,
    next_seq: u64,
    pending: VecDeque<Pending>,
    /// The first error CQE on the flush QP: the QP is in the error state from then on, so later
    /// operations fail at once with it instead of posting WQEs that would be flushed.
    broken: Option<Error>,
}

impl Flush {
    pub fn new(config: FlushConfig, targets: FlushTargets) -> Flush {
        Flush { mode: config.mode, targets, next_seq: 0, pending: VecDeque::new(), broken: None }
    }

    pub fn mode(&self) -> FlushMode {
        self.mode
    }

    /// Operations started and not yet completed or failed.
    pub fn pending(&self) -> usize {
        self.pending.iter().filter(|p| !p.failed).count()
    }

    /// WQEs each operation posts (basic blocks on the flush QP's send queue: one each).
    pub fn wqes_per_op(&self) -> usize {
        match self.mode {
            FlushMode::Read => 1,
            FlushMode::WriteThenRead => 2,
        }
    }

    /// Flush GPU memory for `op`, reading back from the GPU flush buffer.
    pub fn start(&mut self, out: &mut Vec<FlushAction>, op: FlushOpId) {
        let source = self.targets.gpu;
        self.start_reading(out, op, source)
    }

    /// Flush GPU memory for `op`, reading back from `source` (registered GPU memory, e.g. the
    /// buffer that just received the data, as NCCL does).
    pub fn start_reading(&mut self, out: &mut Vec<FlushAction>, op: FlushOpId, source: RemoteRef) {
        if let Some(e) = &self.broken {
            out.push(FlushAction::Fail { op, error: e.clone().context("flush QP in error state") });
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.mode == FlushMode::WriteThenRead {
            out.push(FlushAction::Post(WorkRequest {
                wr_id: wr_id(seq, Leg::Write),
                op: WorkOp::Write { local: self.targets.host, remote: self.targets.gpu },
                signalled: false,
                fence: false,
            }));
        }
        out.push(FlushAction::Post(WorkRequest {
            wr_id: wr_id(seq, Leg::Read),
            op: WorkOp::Read { local: self.targets.host, remote: source },
            signalled: true,
            fence: false,
        }));
        self.pending.push_back(Pending { seq, op, failed: false });
    }

    /// A CQE of the flush QP arrived for the WQE `wr_id` (from `SendQueue::complete`), good or
    /// bad. `Err` means the CQE names nothing this machine posted: an engine bug.
    pub fn on_completion(&mut self, out: &mut Vec<FlushAction>, wr_id: u64, result: Result<(), CqeError>) -> Result<()> {
        let seq = wr_id >> 1;
        let leg = if wr_id & 1 == 0 { Leg::Write } else { Leg::Read };
        let Some(pos) = self.pending.iter().position(|p| p.seq == seq) else {
            if leg == Leg::Write && result.is_ok() {
                // A write flush that completed after its operation did: dropped like any other.
                return Ok(());
            }
            return Err(Error::new(Status::Internal, format!("flush CQE for unknown WQE (wr_id {wr_id:#x}, {})", leg.name())));
        };
        match (leg, result) {
            (Leg::Write, Ok(())) => {
                // Never surfaced: only the read completes an operation.
                tracing::trace!(target: "gsc::gda", seq, "write-flush completion dropped");
            }
            (Leg::Write, Err(e)) => {
                let error = flush_error(Leg::Write, &e);
                self.break_qp(&error);
                let p = &mut self.pending[pos];
                p.failed = true;
                out.push(FlushAction::Fail { op: p.op, error });
            }
            (Leg::Read, result) => {
                if pos != 0 && result.is_ok() {
                    return Err(Error::new(
                        Status::Internal,
                        format!("RDMA-read flush {seq} completed before {pos} earlier ones: CQEs out of order"),
                    ));
                }
                let p = self.pending.remove(pos).expect("position found above");
                match result {
                    _ if p.failed => {} // failed by its write already; this is the flushed read
                    Ok(()) => out.push(FlushAction::Complete { op: p.op }),
                    Err(e) => {
                        let error = flush_error(Leg::Read, &e);
                        self.break_qp(&error);
                        out.push(FlushAction::Fail { op: p.op, error });
                    }
                }
            }
        }
        Ok(())
    }

    fn break_qp(&mut self, error: &Error) {
        if self.broken.is_none() {
            self.broken = Some(error.clone());
        }
    }

    /// The first error the flush QP reported, if any.
    pub fn error(&self) -> Option<&Error> {
        self.broken.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gda::verbs::mlx5::Syndrome;
    use crate::gda::verbs::queue::{CompletionQueue, SendQueue, SendQueueShape};
    use crate::log::capture_warnings;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        Alloc(Place),
        Register(Place),
        Deregister(Place),
        Free(Place),
    }

    /// A `FlushMemory` that records calls and fails the ones it is told to.
    #[derive(Default)]
    struct FakeMemory {
        calls: Vec<Call>,
        fail: Vec<Call>,
        next: u64,
    }

    impl FakeMemory {
        fn failing(fail: &[Call]) -> FakeMemory {
            FakeMemory { fail: fail.to_vec(), ..FakeMemory::default() }
        }

        fn call(&mut self, c: Call) -> Result<()> {
            self.calls.push(c.clone());
            if self.fail.contains(&c) { Err(Error::new(Status::DeviceError, format!("{c:?} refused"))) } else { Ok(()) }
        }
    }

    impl FlushMemory for FakeMemory {
        fn alloc(&mut self, place: Place, len: usize) -> Result<Buffer> {
            self.call(Call::Alloc(place))?;
            self.next += 1;
            let addr = match place {
                Place::Host => 0x7f00_0000_0000,
                Place::Gpu => 0x0000_7000_0000_0000,
            };
            Ok(Buffer { place, addr, len, handle: self.next })
        }
        fn register(&mut self, buf: &Buffer) -> Result<Registration> {
            self.call(Call::Register(buf.place))?;
            let key = if buf.place == Place::Host { 0x100 } else { 0x200 };
            Ok(Registration { lkey: key, rkey: key + 1, handle: buf.handle })
        }
        fn deregister(&mut self, buf: &Buffer, _reg: &Registration) -> Result<()> {
            self.call(Call::Deregister(buf.place))
        }
        fn free(&mut self, buf: &Buffer) -> Result<()> {
            self.call(Call::Free(buf.place))
        }
    }

    /// A `FakeMemory` the test can still look at after the buffers took it.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<FakeMemory>>);

    impl Shared {
        fn failing(fail: &[Call]) -> Shared {
            Shared(Arc::new(Mutex::new(FakeMemory::failing(fail))))
        }

        fn calls(&self) -> Vec<Call> {
            self.0.lock().unwrap().calls.clone()
        }
    }

    impl FlushMemory for Shared {
        fn alloc(&mut self, place: Place, len: usize) -> Result<Buffer> {
            self.0.lock().unwrap().alloc(place, len)
        }
        fn register(&mut self, buf: &Buffer) -> Result<Registration> {
            self.0.lock().unwrap().register(buf)
        }
        fn deregister(&mut self, buf: &Buffer, reg: &Registration) -> Result<()> {
            self.0.lock().unwrap().deregister(buf, reg)
        }
        fn free(&mut self, buf: &Buffer) -> Result<()> {
            self.0.lock().unwrap().free(buf)
        }
    }

    fn targets() -> FlushTargets {
        FlushTargets { host: LocalSge { addr: 0x1000, len: FLUSH_LEN, lkey: 0x11 }, gpu: RemoteRef { addr: 0x9000, rkey: 0x22 } }
    }

    fn posts(out: &[FlushAction]) -> Vec<WorkRequest> {
        out.iter()
            .filter_map(|a| match a {
                FlushAction::Post(wr) => Some(*wr),
                _ => None,
            })
            .collect()
    }

    fn cqe_error(syndrome: u8, wqe_counter: u16) -> CqeError {
        CqeError {
            requester: true,
            syndrome: Syndrome::from_byte(syndrome),
            vendor_syndrome: 0x42,
            wqe_counter,
            wqe_opcode: 0x10,
            qpn: 0x77,
        }
    }

    #[test]
    fn config_defaults_to_read_only() {
        assert_eq!(FlushConfig::parse(None).unwrap().mode, FlushMode::Read);
        assert_eq!(FlushConfig::parse(Some("")).unwrap().mode, FlushMode::Read);
        assert_eq!(FlushConfig::default().mode, FlushMode::Read);
        for v in ["1", "on", "yes", "Y", "TRUE", " 1 "] {
            assert_eq!(FlushConfig::parse(Some(v)).unwrap().mode, FlushMode::WriteThenRead, "{v}");
        }
        for v in ["0", "off", "no", "n", "False"] {
            assert_eq!(FlushConfig::parse(Some(v)).unwrap().mode, FlushMode::Read, "{v}");
        }
    }

    #[test]
    fn config_rejects_bad_values_naming_the_variable() {
        let err = FlushConfig::parse(Some("2")).unwrap_err();
        assert_eq!(err.status(), Status::InvalidConfig);
        assert_eq!(err.message(), "GSC_FLUSH_RDMA_WRITE=\"2\": expected on/yes/y/true/1 or off/no/n/false/0");
        assert!(FlushConfig::parse(Some("auto")).is_err());
    }

    #[test]
    fn config_comes_from_the_knob() {
        assert_eq!(FlushConfig::from_config(&Config::default()).mode, FlushMode::Read);
        let config = Config::from_pairs([(FLUSH_RDMA_WRITE_VAR, "1")]).unwrap().config;
        assert_eq!(FlushConfig::from_config(&config).mode, FlushMode::WriteThenRead);
        let config = Config { flush_rdma_write: false, ..config };
        assert_eq!(FlushConfig::from_config(&config).mode, FlushMode::Read);
    }

    #[test]
    fn read_only_sequence() {
        let mut f = Flush::new(FlushConfig::default(), targets());
        let mut out = Vec::new();
        f.start(&mut out, 7);
        assert_eq!(
            out,
            vec![FlushAction::Post(WorkRequest {
                wr_id: 1,
                op: WorkOp::Read { local: targets().host, remote: targets().gpu },
                signalled: true,
                fence: false,
            })]
        );
        assert_eq!(f.pending(), 1);
        out.clear();
        f.on_completion(&mut out, 1, Ok(())).unwrap();
        assert_eq!(out, vec![FlushAction::Complete { op: 7 }]);
        assert_eq!(f.pending(), 0);
    }

    #[test]
    fn write_then_read_sequence() {
        let mut f = Flush::new(FlushConfig::parse(Some("1")).unwrap(), targets());
        assert_eq!(f.wqes_per_op(), 2);
        let mut out = Vec::new();
        f.start(&mut out, 3);
        let wrs = posts(&out);
        assert_eq!(wrs.len(), 2);
        // First an unsignalled write from the host buffer into the GPU buffer ...
        assert_eq!(wrs[0].op, WorkOp::Write { local: targets().host, remote: targets().gpu });
        assert!(!wrs[0].signalled);
        // ... then the signalled read back into the host buffer.
        assert_eq!(wrs[1].op, WorkOp::Read { local: targets().host, remote: targets().gpu });
        assert!(wrs[1].signalled);
        out.clear();
        f.on_completion(&mut out, wrs[1].wr_id, Ok(())).unwrap();
        assert_eq!(out, vec![FlushAction::Complete { op: 3 }]);
    }

    #[test]
    fn write_completion_is_never_surfaced() {
        let mut f = Flush::new(FlushConfig { mode: FlushMode::WriteThenRead }, targets());
        let mut out = Vec::new();
        f.start(&mut out, 1);
        let wrs = posts(&out);
        out.clear();
        // A write CQE (should one come) before the read's, and one after the operation ended.
        f.on_completion(&mut out, wrs[0].wr_id, Ok(())).unwrap();
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(f.pending(), 1);
        f.on_completion(&mut out, wrs[1].wr_id, Ok(())).unwrap();
        f.on_completion(&mut out, wrs[0].wr_id, Ok(())).unwrap();
        assert_eq!(out, vec![FlushAction::Complete { op: 1 }]);
    }

    #[test]
    fn read_from_a_named_source() {
        let mut f = Flush::new(FlushConfig::default(), targets());
        let mut out = Vec::new();
        let recv = RemoteRef { addr: 0xabc0, rkey: 0x55 };
        f.start_reading(&mut out, 1, recv);
        assert_eq!(posts(&out)[0].op, WorkOp::Read { local: targets().host, remote: recv });
    }

    #[test]
    fn read_error_fails_the_operation_with_the_cqe_named() {
        let mut f = Flush::new(FlushConfig::default(), targets());
        let mut out = Vec::new();
        f.start(&mut out, 9);
        let wr = posts(&out)[0];
        out.clear();
        f.on_completion(&mut out, wr.wr_id, Err(cqe_error(0x13, 0))).unwrap();
        let [FlushAction::Fail { op: 9, error }] = &out[..] else { panic!("{out:?}") };
        assert_eq!(error.status(), Status::DeviceError);
        assert!(error.message().starts_with("RDMA-read flush: requester error CQE: remote access error (syndrome 0x13"), "{error:?}");
        // The QP is in error: the next operation fails at once, posting nothing.
        out.clear();
        f.start(&mut out, 10);
        let [FlushAction::Fail { op: 10, error }] = &out[..] else { panic!("{out:?}") };
        assert!(error.message().contains("flush QP in error state"), "{error:?}");
        assert_eq!(f.pending(), 0);
    }

    #[test]
    fn write_error_fails_once_and_absorbs_the_flushed_read() {
        let mut f = Flush::new(FlushConfig { mode: FlushMode::WriteThenRead }, targets());
        let mut out = Vec::new();
        f.start(&mut out, 1);
        f.start(&mut out, 2);
        let wrs = posts(&out);
        out.clear();
        f.on_completion(&mut out, wrs[0].wr_id, Err(cqe_error(0x04, 0))).unwrap();
        let [FlushAction::Fail { op: 1, error }] = &out[..] else { panic!("{out:?}") };
        assert!(error.message().starts_with("RDMA-write flush: "), "{error:?}");
        assert!(error.message().contains("local protection error"), "{error:?}");
        out.clear();
        // Everything after it is flushed by the hardware (WR_FLUSH_ERR).
        f.on_completion(&mut out, wrs[1].wr_id, Err(cqe_error(0x05, 1))).unwrap();
        assert!(out.is_empty(), "the first operation failed already: {out:?}");
        f.on_completion(&mut out, wrs[2].wr_id, Err(cqe_error(0x05, 2))).unwrap();
        f.on_completion(&mut out, wrs[3].wr_id, Err(cqe_error(0x05, 3))).unwrap();
        let [FlushAction::Fail { op: 2, error }] = &out[..] else { panic!("{out:?}") };
        assert_eq!(error.status(), Status::Canceled);
        assert!(error.message().contains("work request flushed"), "{error:?}");
        assert_eq!(f.pending(), 0);
        // The first error is the one kept.
        assert!(f.error().unwrap().message().contains("local protection error"));
    }

    #[test]
    fn unknown_completion_is_an_engine_error() {
        let mut f = Flush::new(FlushConfig::default(), targets());
        let mut out = Vec::new();
        let err = f.on_completion(&mut out, 99, Ok(())).unwrap_err();
        assert_eq!(err.status(), Status::Internal);
        f.start(&mut out, 1);
        f.start(&mut out, 2);
        let wrs = posts(&out);
        // The second read completing before the first is out of order.
        assert_eq!(f.on_completion(&mut out, wrs[1].wr_id, Ok(())).unwrap_err().status(), Status::Internal);
    }

    #[test]
    fn operations_complete_in_order() {
        let mut f = Flush::new(FlushConfig::default(), targets());
        let mut out = Vec::new();
        for op in 0..5 {
            f.start(&mut out, 100 + op);
        }
        let wrs = posts(&out);
        out.clear();
        for wr in &wrs {
            f.on_completion(&mut out, wr.wr_id, Ok(())).unwrap();
        }
        let done: Vec<_> = out
            .iter()
            .map(|a| match a {
                FlushAction::Complete { op } => *op,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(done, vec![100, 101, 102, 103, 104]);
    }

    /// The whole path without a NIC: actions posted on a `SendQueue`, a fake NIC writing the
    /// CQE of each signalled WQE, the `CompletionQueue` reading it back.
    #[test]
    fn flush_through_the_send_and_completion_queues() {
        for mode in [FlushMode::Read, FlushMode::WriteThenRead] {
            let mut f = Flush::new(FlushConfig { mode }, targets());
            let mut sq = SendQueue::new(SendQueueShape { qpn: 0x77, wqe_cnt: 8, bf_size: 256 }).unwrap();
            let mut ring = vec![0u8; sq.ring_len()];
            let mut cq = CompletionQueue::new(4, 64).unwrap();
            let mut cqbuf = vec![0u8; cq.ring_len()];
            cq.prepare_buffer(&mut cqbuf).unwrap();
            let mut written = 0u32;
            let mut completed = Vec::new();
            for op in 0..20u64 {
                let mut out = Vec::new();
                f.start(&mut out, op);
                for a in &out {
                    let FlushAction::Post(wr) = a else { panic!("{a:?}") };
                    let posted = sq.post(&mut ring, wr).unwrap();
                    if wr.signalled {
                        // The NIC: a requester CQE naming the signalled WQE.
                        let at = cq.cqe_offset(written);
                        cqbuf[at..at + 64].fill(0);
                        cqbuf[at + 60..at + 62].copy_from_slice(&posted.wqe_index.to_be_bytes());
                        cqbuf[at + 63] = u8::from(crate::gda::verbs::mlx5::cqe_owner_for(written, cq.log_size()));
                        written += 1;
                    }
                }
                assert!(sq.doorbell().is_some());
                while let Some(cqe) = cq.poll(&cqbuf).unwrap() {
                    let cqe = cqe.unwrap();
                    let retired = sq.complete(cqe.wqe_counter).unwrap();
                    let mut out = Vec::new();
                    f.on_completion(&mut out, retired.wr_id, Ok(())).unwrap();
                    for a in out {
                        match a {
                            FlushAction::Complete { op } => completed.push(op),
                            other => panic!("{other:?}"),
                        }
                    }
                }
            }
            assert_eq!(completed, (0..20).collect::<Vec<_>>(), "{mode:?}");
            assert_eq!(sq.in_flight(), 0);
        }
    }

    #[test]
    fn buffers_are_allocated_registered_then_released_in_order() {
        let bufs = FlushBuffers::allocate(FakeMemory::default()).unwrap();
        let t = bufs.targets();
        assert_eq!(t.host, LocalSge { addr: 0x7f00_0000_0000, len: FLUSH_LEN, lkey: 0x100 });
        assert_eq!(t.gpu, RemoteRef { addr: 0x0000_7000_0000_0000, rkey: 0x201 });
        let (mem, report) = bufs.close();
        assert!(report.is_clean());
        use Call::*;
        assert_eq!(
            mem.calls,
            vec![
                Alloc(Place::Host),
                Register(Place::Host),
                Alloc(Place::Gpu),
                Register(Place::Gpu),
                Deregister(Place::Host),
                Deregister(Place::Gpu),
                Free(Place::Host),
                Free(Place::Gpu),
            ]
        );
    }

    #[test]
    fn failing_deregistration_warns_and_still_frees_the_rest() {
        let bufs = FlushBuffers::allocate(FakeMemory::failing(&[Call::Deregister(Place::Host)])).unwrap();
        let mut result = None;
        let logged = capture_warnings(|| result = Some(bufs.close()));
        let (mem, report) = result.unwrap();
        assert!(logged.contains("WARN"), "{logged}");
        assert!(logged.contains("gsc::gda"), "{logged}");
        assert!(logged.contains("deregistering the host flush buffer failed"), "{logged}");
        assert_eq!(report.failures.len(), 1);
        assert!(report.failures[0].message().starts_with("deregistering the host flush buffer: Deregister(Host) refused"));
        // Every other step still ran.
        let tail = &mem.calls[4..];
        assert_eq!(tail, &[Call::Deregister(Place::Host), Call::Deregister(Place::Gpu), Call::Free(Place::Host), Call::Free(Place::Gpu)]);
    }

    #[test]
    fn failing_free_warns_and_every_failure_is_reported() {
        let fail = [Call::Deregister(Place::Gpu), Call::Free(Place::Host), Call::Free(Place::Gpu)];
        let bufs = FlushBuffers::allocate(FakeMemory::failing(&fail)).unwrap();
        let mut result = None;
        let logged = capture_warnings(|| result = Some(bufs.close()));
        let (mem, report) = result.unwrap();
        assert_eq!(report.failures.len(), 3);
        assert_eq!(logged.matches("WARN").count(), 3, "{logged}");
        assert!(logged.contains("freeing the GPU flush buffer failed"), "{logged}");
        assert_eq!(mem.calls.len(), 8);
    }

    #[test]
    fn dropping_the_buffers_releases_them() {
        let fake = Shared::default();
        let bufs = FlushBuffers::allocate(fake.clone()).unwrap();
        assert_eq!(fake.calls().len(), 4);
        drop(bufs);
        assert_eq!(
            fake.calls()[4..],
            [Call::Deregister(Place::Host), Call::Deregister(Place::Gpu), Call::Free(Place::Host), Call::Free(Place::Gpu)]
        );

        let bufs = FlushBuffers::allocate(Shared::failing(&[Call::Free(Place::Gpu)])).unwrap();
        let logged = capture_warnings(|| drop(bufs));
        assert!(logged.contains("freeing the GPU flush buffer failed"), "{logged}");
    }

    #[test]
    fn allocation_failure_undoes_what_was_done() {
        let fake = Shared::failing(&[Call::Register(Place::Gpu)]);
        let Err(err) = FlushBuffers::allocate(fake.clone()) else { panic!("should fail") };
        assert_eq!(err.status(), Status::DeviceError);
        assert!(err.message().starts_with("registering the GPU flush buffer"), "{err:?}");
        use Call::*;
        assert_eq!(
            fake.calls(),
            vec![
                Alloc(Place::Host),
                Register(Place::Host),
                Alloc(Place::Gpu),
                Register(Place::Gpu),
                Free(Place::Gpu),
                Deregister(Place::Host),
                Free(Place::Host)
            ]
        );
        let Err(err) = FlushBuffers::allocate(FakeMemory::failing(&[Alloc(Place::Host)])) else { panic!("should fail") };
        assert!(err.message().starts_with("allocating the host flush buffer"), "{err:?}");
    }
}
