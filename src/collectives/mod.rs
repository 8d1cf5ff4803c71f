//! Communicators and NCCL-style collectives on the same machinery (issue #6). Not built yet.
