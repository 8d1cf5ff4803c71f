//! The context: configuration, identity and the memory registry shared by a process's workers.

use super::memory::{self, MapRequest, MemHandle, RegionTable};
use super::request_area::RequestAreaSpec;
use super::worker::Worker;
use crate::config::Config;
use crate::error::{Error, Result, Status};
use crate::transport::{ProcessIdentity, proc_identity};
use std::sync::Arc;

#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub(crate) config: Config,
    pub(crate) uuid: u128,
    pub(crate) process: ProcessIdentity,
    pub(crate) host_id: u64,
    pub(crate) regions: RegionTable,
    /// Space every request of this context's workers carries for the caller (`with_request_area`).
    pub(crate) request_area: Option<RequestAreaSpec>,
}

/// 128 random bits, for worker and context identities.
pub(crate) fn random_u128() -> Result<u128> {
    let mut b = [0u8; 16];
    getrandom::getrandom(&mut b).map_err(|e| Error::new(Status::NoResource, format!("no randomness from the OS: {e}")))?;
    Ok(u128::from_le_bytes(b))
}

impl Context {
    /// A context with the given configuration (see `Config::from_env`).
    pub fn new(config: Config) -> Result<Context> {
        Context::build(config, None)
    }

    /// A context whose requests each carry `spec.size` bytes for the caller
    /// (`Worker::request_area`), as UCP's `request_size` / `request_init` give MPI libraries.
    pub fn with_request_area(config: Config, spec: RequestAreaSpec) -> Result<Context> {
        spec.validate()?;
        Context::build(config, Some(spec))
    }

    fn build(config: Config, request_area: Option<RequestAreaSpec>) -> Result<Context> {
        if let Some(pattern) = &config.timeline {
            crate::log::timeline::enable(crate::log::file_path(pattern, "GSC_TIMELINE")?);
        }
        // GSC_FAKE_HOST makes processes of one machine count as other hosts.
        let host_id = proc_identity::host_id_labelled(config.fake_host.as_deref());
        Ok(Context {
            inner: Arc::new(ContextInner {
                config,
                uuid: random_u128()?,
                process: proc_identity::current(),
                host_id,
                regions: RegionTable::default(),
                request_area,
            }),
        })
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    pub fn create_worker(&self) -> Result<Worker> {
        Worker::new(self.clone())
    }

    /// Register memory for one-sided access by peers (or allocate it).
    pub fn mem_map(&self, req: MapRequest) -> Result<MemHandle> {
        let (base, len, owned) = match req {
            MapRequest::Existing { addr, len } => {
                if addr.is_null() && len > 0 {
                    return Err(Error::invalid_param("mem_map: address is NULL but length is not zero"));
                }
                (addr as usize, len, None)
            }
            MapRequest::Allocate { len } => {
                if len == 0 {
                    return Err(Error::invalid_param("mem_map: cannot allocate zero bytes"));
                }
                let mut v = Vec::new();
                v.try_reserve_exact(len).map_err(|_| Error::new(Status::NoMemory, format!("mem_map: cannot allocate {len} bytes")))?;
                v.resize(len, 0u8);
                let mut b = v.into_boxed_slice();
                (b.as_mut_ptr() as usize, len, Some(b))
            }
        };
        if (base as u64).checked_add(len as u64).is_none() {
            return Err(Error::invalid_param("mem_map: range wraps the address space"));
        }
        let id = self.inner.regions.insert(base, len, owned);
        Ok(MemHandle { id, base, len, context_uuid: self.inner.uuid })
    }

    /// Unregister (and, if the library allocated it, free) a region. Peers' later accesses fail.
    pub fn mem_unmap(&self, mem: MemHandle) -> Result<()> {
        if mem.context_uuid != self.inner.uuid {
            return Err(Error::new(Status::InvalidHandle, "mem_unmap: the memory handle belongs to another context"));
        }
        if !self.inner.regions.remove(mem.id) {
            return Err(Error::new(Status::InvalidHandle, "mem_unmap: region already unmapped"));
        }
        Ok(())
    }

    /// The remote key peers need for put/get on `mem`.
    pub fn rkey_pack(&self, mem: &MemHandle) -> Result<Vec<u8>> {
        if mem.context_uuid != self.inner.uuid {
            return Err(Error::new(Status::InvalidHandle, "rkey_pack: the memory handle belongs to another context"));
        }
        Ok(memory::rkey_pack(mem, self.inner.process))
    }

    /// Number of registered regions (for diagnostics and leak tests).
    pub fn mapped_regions(&self) -> usize {
        self.inner.regions.len()
    }
}
