//! What the client's running tasks use, per alloc and task, set at scrape
//! time from their latest samples: the gauges go with the task.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabels {
    pub alloc_id: String,
    pub job: String,
    pub task: String,
}

/// One task's latest sample.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskUsageRow {
    pub labels: TaskLabels,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    pub cpu_millicores: u64,
    pub cpu_seconds: f64,
    pub throttled_periods: u64,
}

#[derive(Default)]
pub struct TaskFamilies {
    memory: Family<TaskLabels, Gauge>,
    memory_limit: Family<TaskLabels, Gauge>,
    cpu_millicores: Family<TaskLabels, Gauge>,
    cpu: Family<TaskLabels, Gauge<f64, AtomicU64>>,
    throttled: Family<TaskLabels, Gauge>,
}

impl TaskFamilies {
    pub(crate) fn register(&self, r: &mut Registry) {
        r.register_with_unit(
            "client_task_memory",
            "Memory a running task uses now",
            Unit::Bytes,
            self.memory.clone(),
        );
        r.register_with_unit(
            "client_task_memory_limit",
            "A running task's hard memory limit",
            Unit::Bytes,
            self.memory_limit.clone(),
        );
        r.register(
            "client_task_cpu_millicores",
            "CPU a running task used over the last sample, in thousandths of a core",
            self.cpu_millicores.clone(),
        );
        r.register_with_unit(
            "client_task_cpu",
            "CPU time a running task used since it started",
            Unit::Seconds,
            self.cpu.clone(),
        );
        r.register(
            "client_task_throttled_periods",
            "Periods the kernel held a running task back for its CPU share",
            self.throttled.clone(),
        );
    }

    /// The gauges of exactly the tasks in `rows` (those of tasks that
    /// ended go).
    pub fn set(&self, rows: &[TaskUsageRow]) {
        self.memory.clear();
        self.memory_limit.clear();
        self.cpu_millicores.clear();
        self.cpu.clear();
        self.throttled.clear();
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for row in rows {
            let l = &row.labels;
            self.memory.get_or_create(l).set(as_i64(row.memory_bytes));
            self.memory_limit
                .get_or_create(l)
                .set(as_i64(row.memory_limit_bytes));
            self.cpu_millicores
                .get_or_create(l)
                .set(as_i64(row.cpu_millicores));
            self.cpu.get_or_create(l).set(row.cpu_seconds);
            self.throttled
                .get_or_create(l)
                .set(as_i64(row.throttled_periods));
        }
    }
}
