//! The process's own numbers, under their standard Prometheus names, read
//! from `/proc/self` when scraped (Linux; elsewhere they are left out).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

#[derive(Debug)]
pub(crate) struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(seconds) = cpu_seconds() {
            let c = ConstCounter::new(seconds);
            let m = encoder.encode_descriptor(
                "process_cpu",
                "User and system CPU time this process used",
                Some(&Unit::Seconds),
                c.metric_type(),
            )?;
            c.encode(m)?;
        }
        if let Some(bytes) = resident_memory_bytes() {
            let g = ConstGauge::new(i64::try_from(bytes).unwrap_or(i64::MAX));
            let m = encoder.encode_descriptor(
                "process_resident_memory",
                "Resident memory of this process",
                Some(&Unit::Bytes),
                g.metric_type(),
            )?;
            g.encode(m)?;
        }
        if let Some(fds) = open_fds() {
            let g = ConstGauge::new(i64::try_from(fds).unwrap_or(i64::MAX));
            let m = encoder.encode_descriptor(
                "process_open_fds",
                "File descriptors this process holds open",
                None,
                g.metric_type(),
            )?;
            g.encode(m)?;
        }
        Ok(())
    }
}

/// `sysconf(name)`, when positive.
fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf reads a system constant; it has no preconditions.
    let v = unsafe { libc::sysconf(name) };
    u64::try_from(v).ok().filter(|v| *v > 0)
}

/// User plus system time, from `/proc/self/stat` (fields 14 and 15, in
/// clock ticks). The command name (field 2) may hold spaces, so fields
/// are counted from its closing parenthesis.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let ticks = sysconf(libc::_SC_CLK_TCK)?;
    Some((utime + stime) as f64 / ticks as f64)
}

/// Resident set size, from `/proc/self/statm` (its second field, in
/// pages).
fn resident_memory_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * sysconf(libc::_SC_PAGESIZE)?)
}

fn open_fds() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count())
}
