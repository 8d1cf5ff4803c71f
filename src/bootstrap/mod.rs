//! Out-of-band bootstrap: how the processes of a job find each other before any fast lane exists.
//!
//! The library never *requires* this module — a program that already has a launcher channel
//! (MPI, a key-value store) can exchange packed worker addresses itself. We ship one anyway, in
//! the style of NCCL's:
//!
//! 1. One process calls [`UniqueId::create`], which starts a **root rendezvous service** on a
//!    background thread and returns an id: the service's socket address plus a 256-bit random
//!    secret. The id has a fixed 128-byte binary form and a hex string form, to be handed to the
//!    other ranks (MPI broadcast, environment variable `GSC_UNIQUE_ID`, file, …).
//! 2. Every rank calls [`Bootstrap::init`] with the id, its rank and the rank count. It opens a
//!    listening socket on the interface that reaches the root, registers (rank, nranks, listening
//!    address) with the root, and waits. When all ranks have registered the root checks they agree
//!    (same nranks, ranks unique and in range) and sends every rank the address table, then exits.
//!    If they disagree it sends *every* rank — those already connected and any that come later
//!    until its timeout — one error naming the conflict, e.g. `rank 3 announced nranks=4 but
//!    rank 0 announced nranks=2`.
//! 3. From then on ranks talk directly: [`Bootstrap::allgather`] (ring), [`Bootstrap::barrier`]
//!    (dissemination), [`Bootstrap::broadcast`] (binomial tree) and tagged
//!    [`Bootstrap::send`]/[`Bootstrap::recv`], over one-way TCP connections opened lazily on the
//!    first send and drained eagerly by a receive thread on the other side.
//!
//! Launcher mode ([`Bootstrap::from_launcher`], with [`detect`]): no id is passed around; rank 0
//! starts the root service at a known `host:port` (`GSC_BOOTSTRAP_ADDR`, or torchrun's
//! `MASTER_ADDR:MASTER_PORT+1`) and every rank derives the same secret from
//! `GSC_BOOTSTRAP_SECRET` (or, weakly, from the launcher's job id).
//!
//! # Time bounds
//!
//! Every operation is bounded by the timeout given to `init`: a rank that never shows up, a
//! missing peer or a peer that stops answering produce `Status::TimedOut` naming the operation
//! and the rank waited on; a peer whose connection closes produces `Status::PeerFailed` (or
//! `ConnectionReset`) naming it. The root service drops any connection that has not
//! authenticated and registered within its handshake timeout (5 s by default), and handles each
//! connection on its own thread, so silent or garbage-speaking clients never delay the others.
//!
//! # Security model
//!
//! Defended: every connection — to the root and between ranks — must prove knowledge of the
//! job's secret with an HMAC-SHA256 challenge–response over fresh nonces from both sides before
//! anything is served, and the server proves it back. So a process that does not know the secret
//! (another job, a port scanner, a user on the network who cannot read the id) can neither join,
//! nor read the address table, nor inject messages, nor impersonate the root; recorded handshakes
//! cannot be replayed. The secret never crosses the wire. Frame sizes are capped before any
//! allocation (256 bytes before authentication, 1 MiB for root registrations, 1 GiB per message
//! between authenticated ranks).
//!
//! Not defended:
//! * Anyone who can read the unique id, `GSC_BOOTSTRAP_SECRET` or the process environment is a
//!   member: the secret is the only credential, and a member can claim any rank.
//! * A secret *derived from a launcher job id* is guessable by any local user; it only keeps
//!   concurrent jobs from connecting to each other by accident.
//! * After the handshake, traffic is neither encrypted nor integrity-protected: an attacker on
//!   the network path can read the addresses exchanged or hijack a TCP connection. Run the
//!   bootstrap on a trusted cluster network.
//! * Denial of service: a flood of connections can delay rendezvous by up to the handshake
//!   timeout (at most 256 unauthenticated connections are serviced at once; extra ones are
//!   closed at once), and an authenticated member can make its peers buffer large messages.

pub(crate) mod comm;
mod launcher;
mod root;
pub(crate) mod uid;
pub(crate) mod wire;

#[cfg(test)]
mod tests;

pub use comm::{Bootstrap, MAX_MESSAGE_BYTES};
pub use launcher::{BootstrapOptions, LaunchInfo, Launcher, detect, detect_with, env_lookup};
pub use root::RootOptions;
pub use uid::{UNIQUE_ID_BYTES, UniqueId};
