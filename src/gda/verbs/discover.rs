//! RDMA device discovery, as a report a person reads (`gsc-info`) and a value code checks.
//!
//! Most machines gscomm runs on have no RDMA NIC, and many have no rdma-core. Both are normal
//! and must be reported as plainly as a working NIC: "no RDMA NIC: libibverbs.so.1 not found",
//! "no RDMA devices", or each device with its ports' state. Discovery never fails: whatever
//! went wrong is part of the report.

use std::fmt;

use super::loader::{self, Capabilities};

/// Logical state of a port (`ibv_port_state`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PortState {
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
    Other(u32),
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortState::Down => f.write_str("DOWN"),
            PortState::Init => f.write_str("INIT"),
            PortState::Armed => f.write_str("ARMED"),
            PortState::Active => f.write_str("ACTIVE"),
            PortState::ActiveDefer => f.write_str("ACTIVE_DEFER"),
            PortState::Other(v) => write!(f, "state {v}"),
        }
    }
}

/// A port's link layer.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    InfiniBand,
    /// RoCE.
    Ethernet,
    Unspecified,
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet (RoCE)",
            LinkLayer::Unspecified => "link layer unspecified",
        })
    }
}

/// One port of a device (`ibv_query_port`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    pub state: PortState,
    pub link_layer: LinkLayer,
    /// Active MTU in bytes (0 if unknown).
    pub active_mtu: u32,
    pub lid: u16,
    /// `ibv_port_attr.active_width` code.
    pub active_width: u8,
    /// `ibv_port_attr.active_speed` code.
    pub active_speed: u8,
}

/// Lanes of an `active_width` code.
fn width_lanes(code: u8) -> Option<u32> {
    match code {
        1 => Some(1),
        2 => Some(4),
        4 => Some(8),
        8 => Some(12),
        16 => Some(2),
        _ => None,
    }
}

/// Name and per-lane rate (Gb/s, as marketed) of an `active_speed` code.
fn lane_speed(code: u8) -> Option<(&'static str, f64)> {
    match code {
        1 => Some(("SDR", 2.5)),
        2 => Some(("DDR", 5.0)),
        4 => Some(("QDR", 10.0)),
        8 => Some(("FDR10", 10.0)),
        16 => Some(("FDR", 14.0)),
        32 => Some(("EDR", 25.0)),
        64 => Some(("HDR", 50.0)),
        128 => Some(("NDR", 100.0)),
        _ => None,
    }
}

impl PortInfo {
    /// "4x HDR (200 Gb/s)", or the raw codes when they are not known.
    pub fn rate(&self) -> String {
        match (width_lanes(self.active_width), lane_speed(self.active_speed)) {
            (Some(lanes), Some((name, gbps))) => format!("{lanes}x {name} ({} Gb/s)", f64::from(lanes) * gbps),
            _ => format!("width code {}, speed code {}", self.active_width, self.active_speed),
        }
    }
}

impl fmt::Display for PortInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "port {}: {}, {}", self.port, self.state, self.link_layer)?;
        if self.state == PortState::Active {
            write!(f, ", {}, MTU {}", self.rate(), self.active_mtu)?;
        }
        if self.link_layer == LinkLayer::InfiniBand {
            write!(f, ", LID {:#x}", self.lid)?;
        }
        Ok(())
    }
}

/// One RDMA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device name (`mlx5_0`).
    pub name: String,
    pub fw_ver: Option<String>,
    /// Whether libmlx5 drives it (`mlx5dv_is_supported`); `None` without libmlx5.
    pub mlx5: Option<bool>,
    pub ports: Vec<PortInfo>,
    /// Why the device could not be opened or queried, if it could not.
    pub error: Option<String>,
}

/// What discovery found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// rdma-core is not installed (or not loadable): `reason` says why.
    NoLibrary {
        reason: String,
    },
    /// rdma-core is there, but no device: `reason` is the error of `ibv_get_device_list`, if it
    /// failed rather than returning an empty list.
    NoDevices {
        reason: Option<String>,
    },
    Devices {
        devices: Vec<DeviceInfo>,
        capabilities: Capabilities,
        mlx5_missing: Option<String>,
    },
}

impl Discovery {
    /// Whether some device has an active port.
    pub fn has_active_port(&self) -> bool {
        match self {
            Discovery::Devices { devices, .. } => devices.iter().flat_map(|d| &d.ports).any(|p| p.state == PortState::Active),
            _ => false,
        }
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

impl fmt::Display for Discovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Discovery::NoLibrary { reason } => write!(f, "no RDMA NIC: {reason}"),
            Discovery::NoDevices { reason: None } => write!(f, "no RDMA devices ({} loaded, no device listed)", loader::LIBIBVERBS),
            Discovery::NoDevices { reason: Some(r) } => write!(f, "no RDMA devices ({r})"),
            Discovery::Devices { devices, capabilities, mlx5_missing } => {
                write!(
                    f,
                    "RDMA devices: {} (dmabuf registration: {}, mlx5 direct verbs: {}",
                    devices.len(),
                    yes_no(capabilities.dmabuf),
                    yes_no(capabilities.mlx5dv)
                )?;
                if let Some(why) = mlx5_missing {
                    write!(f, ": {why}")?;
                }
                f.write_str(")")?;
                for d in devices {
                    write!(f, "\n  {}", d.name)?;
                    match d.mlx5 {
                        Some(true) => f.write_str(": mlx5")?,
                        Some(false) => f.write_str(": not mlx5 (no GPU-initiated doorbells)")?,
                        None => {}
                    }
                    if let Some(fw) = &d.fw_ver {
                        write!(f, ", firmware {fw}")?;
                    }
                    if let Some(e) = &d.error {
                        write!(f, "; error: {e}")?;
                    }
                    for p in &d.ports {
                        write!(f, "\n    {p}")?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// Look for RDMA devices: load rdma-core, list devices, open each and query its ports.
pub fn discover() -> Discovery {
    let verbs = match loader::verbs() {
        Ok(v) => v,
        Err(e) => return Discovery::NoLibrary { reason: e.message().to_string() },
    };
    match verbs.devices() {
        Err(e) => Discovery::NoDevices { reason: Some(e.message().to_string()) },
        Ok(devices) if devices.is_empty() => Discovery::NoDevices { reason: None },
        Ok(devices) => Discovery::Devices { devices, capabilities: verbs.capabilities(), mlx5_missing: verbs.mlx5_missing() },
    }
}

/// The discovery report as text, for `gsc-info`.
pub fn report() -> String {
    discover().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(state: PortState, link_layer: LinkLayer) -> PortInfo {
        PortInfo { port: 1, state, link_layer, active_mtu: 4096, lid: 0x12, active_width: 2, active_speed: 64 }
    }

    #[test]
    fn no_library_is_reported_plainly() {
        let d = Discovery::NoLibrary { reason: "libibverbs.so.1 not found: libibverbs.so.1: cannot open shared object file".into() };
        assert_eq!(d.to_string(), "no RDMA NIC: libibverbs.so.1 not found: libibverbs.so.1: cannot open shared object file");
        assert!(!d.has_active_port());
    }

    #[test]
    fn no_devices_is_reported_plainly() {
        assert_eq!(Discovery::NoDevices { reason: None }.to_string(), "no RDMA devices (libibverbs.so.1 loaded, no device listed)");
        let d = Discovery::NoDevices { reason: Some("ibv_get_device_list: Function not implemented (os error 38)".into()) };
        assert_eq!(d.to_string(), "no RDMA devices (ibv_get_device_list: Function not implemented (os error 38))");
    }

    #[test]
    fn devices_are_listed_with_their_ports() {
        let d = Discovery::Devices {
            devices: vec![
                DeviceInfo {
                    name: "mlx5_0".into(),
                    fw_ver: Some("28.39.1002".into()),
                    mlx5: Some(true),
                    ports: vec![port(PortState::Active, LinkLayer::InfiniBand)],
                    error: None,
                },
                DeviceInfo {
                    name: "mlx5_1".into(),
                    fw_ver: None,
                    mlx5: Some(true),
                    ports: vec![],
                    error: Some("ibv_open_device(mlx5_1): Permission denied (os error 13)".into()),
                },
                DeviceInfo {
                    name: "rxe0".into(),
                    fw_ver: Some("".into()),
                    mlx5: Some(false),
                    ports: vec![port(PortState::Down, LinkLayer::Ethernet)],
                    error: None,
                },
            ],
            capabilities: Capabilities { dmabuf: true, relaxed_ordering: true, mlx5dv: true },
            mlx5_missing: None,
        };
        assert_eq!(
            d.to_string(),
            "RDMA devices: 3 (dmabuf registration: yes, mlx5 direct verbs: yes)\n  \
             mlx5_0: mlx5, firmware 28.39.1002\n    \
             port 1: ACTIVE, InfiniBand, 4x HDR (200 Gb/s), MTU 4096, LID 0x12\n  \
             mlx5_1: mlx5; error: ibv_open_device(mlx5_1): Permission denied (os error 13)\n  \
             rxe0: not mlx5 (no GPU-initiated doorbells), firmware \n    \
             port 1: DOWN, Ethernet (RoCE)"
        );
        assert!(d.has_active_port());
    }

    #[test]
    fn unknown_rate_codes_are_shown_raw() {
        let mut p = port(PortState::Active, LinkLayer::Ethernet);
        p.active_speed = 0;
        assert_eq!(p.rate(), "width code 2, speed code 0");
        p.active_speed = 128;
        p.active_width = 1;
        assert_eq!(p.rate(), "1x NDR (100 Gb/s)");
    }

    /// Runs wherever CI runs: with no rdma-core the report says the library is missing, with
    /// rdma-core but no NIC it says there are no devices; on a machine with NICs it lists them.
    #[test]
    fn discovery_on_this_machine_says_what_it_found() {
        let text = report();
        eprintln!("{text}");
        assert!(
            text.starts_with("no RDMA NIC: libibverbs.so.1 not found")
                || text.starts_with("no RDMA devices")
                || text.starts_with("RDMA devices: "),
            "{text}"
        );
    }
}
