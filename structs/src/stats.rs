//! What a client's running tasks use, as `GET
//! /v1/client/allocation/{id}/stats` answers it: Nomad's shape (the alloc's
//! sum and each task's `resource_usage`, with `memory_stats`, `cpu_stats`
//! and what was `measured`) in berth's names and units.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::TaskUsage;

/// An alloc's usage: the sum of its measured tasks, and each of them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocStats {
    pub resource_usage: ResourceUsage,
    /// By task name; a task its driver does not measure (`raw_exec`) or
    /// that does not run is absent.
    pub tasks: BTreeMap<String, TaskStats>,
    /// Unix ms of the newest sample.
    pub timestamp_ms: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskStats {
    pub resource_usage: ResourceUsage,
    /// Unix ms of the sample.
    pub timestamp_ms: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResourceUsage {
    pub memory_stats: MemoryStats,
    pub cpu_stats: CpuStats,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Bytes in use now.
    pub usage: u64,
    /// The most bytes held at once (0 where the kernel does not say).
    pub max_usage: u64,
    /// The hard limit, in bytes.
    pub limit: u64,
    pub measured: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuStats {
    /// CPU time since the task started, in nanoseconds.
    pub total_ns: u64,
    /// Over the last sample interval, in thousandths of a core.
    pub millicores: u64,
    /// The same in percent of one core (Nomad's `Percent`).
    pub percent: f64,
    /// Periods the kernel held the task back for its CPU share.
    pub throttled_periods: u64,
    pub measured: Vec<String>,
}

const MEMORY_MEASURED: [&str; 3] = ["Usage", "Max Usage", "Limit"];
const CPU_MEASURED: [&str; 3] = ["Total Time", "Percent", "Throttled Periods"];

impl From<&TaskUsage> for ResourceUsage {
    fn from(u: &TaskUsage) -> ResourceUsage {
        ResourceUsage {
            memory_stats: MemoryStats {
                usage: u.memory_bytes,
                max_usage: u.memory_peak_bytes,
                limit: u.memory_limit_bytes,
                measured: MEMORY_MEASURED.map(String::from).to_vec(),
            },
            cpu_stats: CpuStats {
                total_ns: u.cpu_total_ns,
                millicores: u.cpu_millicores,
                percent: u.cpu_millicores as f64 / 10.0,
                throttled_periods: u.throttled_periods,
                measured: CPU_MEASURED.map(String::from).to_vec(),
            },
        }
    }
}

impl AllocStats {
    /// The stats of an alloc whose tasks' latest samples are `samples`.
    pub fn of(samples: &BTreeMap<String, TaskUsage>) -> AllocStats {
        let tasks: BTreeMap<String, TaskStats> = samples
            .iter()
            .map(|(name, u)| {
                let stats = TaskStats {
                    resource_usage: ResourceUsage::from(u),
                    timestamp_ms: u.at_ms,
                };
                (name.clone(), stats)
            })
            .collect();
        let mut sum = ResourceUsage::default();
        for t in tasks.values() {
            let (m, c) = (&t.resource_usage.memory_stats, &t.resource_usage.cpu_stats);
            sum.memory_stats.usage += m.usage;
            sum.memory_stats.max_usage += m.max_usage;
            sum.memory_stats.limit += m.limit;
            sum.cpu_stats.total_ns += c.total_ns;
            sum.cpu_stats.millicores += c.millicores;
            sum.cpu_stats.throttled_periods += c.throttled_periods;
        }
        if !tasks.is_empty() {
            sum.memory_stats.measured = MEMORY_MEASURED.map(String::from).to_vec();
            sum.cpu_stats.measured = CPU_MEASURED.map(String::from).to_vec();
        }
        sum.cpu_stats.percent = sum.cpu_stats.millicores as f64 / 10.0;
        AllocStats {
            resource_usage: sum,
            timestamp_ms: tasks.values().map(|t| t.timestamp_ms).max().unwrap_or(0),
            tasks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocs_stats_are_its_tasks_and_their_sum() {
        let sample = |mib: u64, millicores: u64, at_ms: i64| TaskUsage {
            memory_bytes: mib << 20,
            memory_peak_bytes: (mib + 1) << 20,
            memory_limit_bytes: 256 << 20,
            cpu_total_ns: 5_000_000,
            cpu_millicores: millicores,
            throttled_periods: 2,
            at_ms,
        };
        let samples = BTreeMap::from([
            ("web".to_string(), sample(100, 950, 1_000)),
            ("side".to_string(), sample(10, 50, 1_200)),
        ]);
        let stats = AllocStats::of(&samples);
        let web = &stats.tasks["web"].resource_usage;
        assert_eq!(web.memory_stats.usage, 100 << 20);
        assert_eq!(web.cpu_stats.percent, 95.0);
        let sum = &stats.resource_usage;
        assert_eq!(sum.memory_stats.usage, 110 << 20);
        assert_eq!(sum.memory_stats.limit, 512 << 20);
        assert_eq!(sum.cpu_stats.millicores, 1_000);
        assert_eq!(sum.cpu_stats.percent, 100.0);
        assert_eq!(stats.timestamp_ms, 1_200);
        let empty = AllocStats::of(&BTreeMap::new());
        assert!(empty.tasks.is_empty() && empty.resource_usage.memory_stats.measured.is_empty());
    }
}
