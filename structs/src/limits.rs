//! The largest values berth accepts for the numbers of a job or a volume.
//!
//! A spec is checked against these when it is parsed, and the job or volume
//! again in [`Job::validate`](crate::Job::validate) and
//! [`CsiVolume::validate`](crate::CsiVolume::validate), because the HTTP API
//! takes JSON directly. They are generous (far beyond any real machine or
//! cluster) but finite, so that no sum of them over a cluster can wrap and no
//! timer overflows: 10,000 allocs of a group asking for the maximum of
//! everything still fit in a `u64`.

use std::time::Duration;

/// Allocs of one group (`count`).
pub const MAX_COUNT: u32 = 10_000;

/// CPU of one task, in MHz (`resources { cpu }`): ten thousand 1 GHz cores.
pub const MAX_CPU_MHZ: u64 = 10_000_000;

/// Memory of one task, in MiB (`resources { memory }`): 64 TiB.
pub const MAX_MEMORY_MB: u64 = 64 << 20;

/// Restarts within one interval (`restart { attempts }`).
pub const MAX_RESTART_ATTEMPTS: u32 = 10_000;

/// Any duration of a job: restart `interval` and `delay`, `kill_timeout`,
/// `csi_plugin { health_timeout }`, `stop_after_client_disconnect`. One year
/// (365.25 days, humantime's "1year").
pub const MAX_DURATION: Duration = Duration::from_secs(31_557_600);

/// Log files kept per task and stream (`logs { max_files }`).
pub const MAX_LOG_FILES: u32 = 1_000;

/// The size of one log file in MiB (`logs { max_file_size }`): 16 GiB.
pub const MAX_LOG_FILE_SIZE_MB: u64 = 16 << 10;

/// A job's priority (Nomad's range is 1 to 100).
pub const MAX_PRIORITY: u32 = 100;

/// The capacity of one volume in bytes (`capacity_min`, `capacity_max`):
/// 1 EiB.
pub const MAX_VOLUME_CAPACITY_BYTES: u64 = 1 << 60;

/// The message for a number above its limit: `5000000 is too large (at
/// most 10000)`. `value` is shown as the operator wrote it where possible.
pub fn too_large(value: impl std::fmt::Display, limit: impl std::fmt::Display) -> String {
    format!("{value} is too large (at most {limit})")
}

/// A duration as messages show it: `"1year"`, `"30s"`.
pub fn duration_text(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// The limit of a volume capacity as messages show it.
pub fn capacity_limit_text() -> String {
    format!("{MAX_VOLUME_CAPACITY_BYTES} bytes, 1 EiB")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_duration_reads_as_one_year() {
        assert_eq!(duration_text(MAX_DURATION), "1year");
    }

    #[test]
    fn a_full_cluster_of_maximal_allocs_cannot_wrap() {
        let allocs = u64::from(MAX_COUNT);
        assert!(allocs.checked_mul(MAX_CPU_MHZ).is_some());
        assert!(allocs.checked_mul(MAX_MEMORY_MB).is_some());
        assert!(MAX_MEMORY_MB.checked_mul(1 << 20).is_some());
    }
}
