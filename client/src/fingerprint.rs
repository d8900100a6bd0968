//! What the node is, as it registers: its host name, resources (less the
//! operator's reservations), drivers and their health, class and meta.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use berth_allocrunner::AllocRunnerConfig;
use berth_structs::{DriverInfo, Node, NodeEvent, NodeResources, NodeStatus};

use crate::ClientConfig;

fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "berth-node".to_string())
}

/// MiB available to unprivileged writers on the filesystem holding `dir`
/// (0 when it cannot be read).
fn free_disk_mb(dir: &std::path::Path) -> u64 {
    match nix::sys::statvfs::statvfs(dir) {
        Ok(s) => s.blocks_available().saturating_mul(s.fragment_size()) / (1024 * 1024),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "reading the free disk space failed");
            0
        }
    }
}

/// What this machine offers; disk as free below `data_dir`.
fn fingerprint_resources(data_dir: &std::path::Path) -> NodeResources {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let memory_mb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(1024, |kb| kb / 1024);
    NodeResources {
        cpu: cpus * 1000,
        memory_mb,
        disk_mb: free_disk_mb(data_dir),
    }
}

/// The first line of `/proc/sys/kernel/osrelease` and the like.
fn read_line(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().next()?.trim();
    (!line.is_empty()).then(|| line.to_string())
}

/// A `KEY=value` of `/etc/os-release`, unquoted.
fn os_release(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let v = l.strip_prefix(key)?.strip_prefix('=')?;
        let v = v.trim().trim_matches('"').trim_matches('\'');
        (!v.is_empty()).then(|| v.to_string())
    })
}

/// The node's attributes, with Nomad's names (what `${attr.NAME}` reads
/// in a constraint): the kernel, the OS, the CPU and memory, the host
/// name and this berth's version. `driver.NAME` is added by
/// `Node::set_driver_info`.
fn host_attributes(found: &NodeResources) -> BTreeMap<String, String> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kernel = std::env::consts::OS.to_string();
    let mut attrs = BTreeMap::from([
        ("kernel.name".to_string(), kernel.clone()),
        ("cpu.arch".to_string(), std::env::consts::ARCH.to_string()),
        ("cpu.numcores".to_string(), cpus.to_string()),
        ("cpu.totalcompute".to_string(), found.cpu.to_string()),
        (
            "memory.totalbytes".to_string(),
            found.memory_mb.saturating_mul(1 << 20).to_string(),
        ),
        ("unique.hostname".to_string(), host_name()),
        (
            "berth.version".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        ),
    ]);
    if let Some(release) = read_line("/proc/sys/kernel/osrelease") {
        // `6.1.0-18-amd64`: the version is the numbers, the release all.
        let version: String = release
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        attrs.insert(
            "kernel.version".into(),
            version.trim_end_matches('.').into(),
        );
        attrs.insert("kernel.release".into(), release);
    }
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    attrs.insert("os.name".into(), os_release(&os, "ID").unwrap_or(kernel));
    if let Some(v) = os_release(&os, "VERSION_ID") {
        attrs.insert("os.version".into(), v);
    }
    attrs
}

/// How often the drivers are fingerprinted again after the start.
pub const DRIVER_FINGERPRINT_INTERVAL: Duration = Duration::from_secs(30);

/// Each driver's fingerprint, by name.
pub(crate) fn fingerprint_drivers(
    drivers: &BTreeMap<String, Arc<dyn berth_allocrunner::Driver>>,
) -> BTreeMap<String, DriverInfo> {
    drivers
        .iter()
        .map(|(name, d)| (name.clone(), d.fingerprint()))
        .collect()
}

/// The `Driver` node events of the drivers whose health changed from
/// `old` to `new` (a new driver is a change when unhealthy); none when
/// only the fingerprints' times moved.
pub(crate) fn driver_health_events(
    old: &BTreeMap<String, DriverInfo>,
    new: &BTreeMap<String, DriverInfo>,
) -> Vec<NodeEvent> {
    new.iter()
        .filter(|(name, info)| match old.get(*name) {
            Some(was) => {
                (was.detected, was.healthy, &was.health_description)
                    != (info.detected, info.healthy, &info.health_description)
            }
            None => !info.usable(),
        })
        .map(|(name, info)| {
            let message = if info.usable() {
                format!("Driver {name} is healthy")
            } else {
                format!("Driver {name} is unhealthy")
            };
            NodeEvent::new(NodeEvent::SUBSYSTEM_DRIVER, message)
                .with_detail("driver", name.as_str())
                .with_detail("description", info.health_description.as_str())
        })
        .collect()
}

/// The node as this client registers it: its fingerprint with the
/// operator's class, meta and reservations applied.
pub fn node_fingerprint(config: &ClientConfig, node_id: String) -> Node {
    let found = fingerprint_resources(&config.data_dir);
    let mut node = Node {
        id: node_id,
        name: config.node_name.clone().unwrap_or_else(host_name),
        datacenter: config.datacenter.clone(),
        region: config.region.clone(),
        status: NodeStatus::Initializing,
        resources: NodeResources {
            cpu: found.cpu.saturating_sub(config.reserved_cpu),
            memory_mb: found.memory_mb.saturating_sub(config.reserved_memory_mb),
            disk_mb: found.disk_mb.saturating_sub(config.reserved_disk_mb),
        },
        reserved: NodeResources {
            cpu: config.reserved_cpu.min(found.cpu),
            memory_mb: config.reserved_memory_mb.min(found.memory_mb),
            disk_mb: config.reserved_disk_mb.min(found.disk_mb),
        },
        attributes: host_attributes(&found),
        node_class: config.node_class.clone(),
        meta: config.meta.clone(),
        ..Node::default()
    };
    node.set_driver_info(fingerprint_drivers(&AllocRunnerConfig::drivers_for(
        &config.driver_settings(),
    )));
    node
}
