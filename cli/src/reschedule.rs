//! What `alloc status`, `job status` and `job run` say of replacements:
//! the replacement a failed alloc is due (and when), or that its policy
//! allows no more attempts; the attempts a replacement carries; and the
//! allocs placed that wait for the volume claims of those they replace.

use berth_structs::text::count;
use berth_structs::{AllocClientStatus, Allocation, JobType};
use serde_json::Value;

use crate::output::{ago_at, format_time, short_id};

/// The reschedule of a failed alloc not replaced yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// A replacement is due at this unix ms.
    At(i64),
    /// The policy allows no more attempts: the index stays failed.
    NoMore,
}

impl Next {
    /// `in 28s`, `due now`, or `no more attempts`, as seen at `now_ms`.
    pub fn describe(self, now_ms: i64) -> String {
        match self {
            Next::At(at) if at > now_ms => {
                let left = ago_at(now_ms, at);
                format!("in {}", left.trim_end_matches(" ago"))
            }
            Next::At(_) => "due now".into(),
            Next::NoMore => "no more attempts (the group's reschedule policy)".into(),
        }
    }
}

/// For a failed alloc of a service or batch job that was not replaced:
/// when its replacement is due, or that none is; None for any other.
pub fn next_reschedule(alloc: &Value) -> Option<Next> {
    // Only a failed alloc not replaced is worth reading whole (`job
    // status` asks this of every alloc of the job).
    let replaced = alloc["next_allocation"]
        .as_str()
        .is_some_and(|s| !s.is_empty());
    if alloc["client_status"] != "failed" || replaced {
        return None;
    }
    let a: Allocation = serde_json::from_value(alloc.clone()).ok()?;
    if a.client_status != AllocClientStatus::Failed
        || !a.next_allocation.is_empty()
        || a.server_terminal()
        || a.job.job_type == JobType::System
    {
        return None;
    }
    let policy = a.job.reschedule_policy(a.group()?);
    Some(policy.next_attempt_ms(&a).map_or(Next::NoMore, Next::At))
}

/// The header lines of `alloc status` about rescheduling.
pub fn header_lines(alloc: &Value, verbose: bool, now_ms: i64) -> Vec<(&'static str, String)> {
    let id = |k: &str| {
        let id = alloc[k].as_str().unwrap_or_default();
        if verbose { id } else { short_id(id) }.to_string()
    };
    let mut out = Vec::new();
    if alloc["previous_allocation"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
    {
        out.push(("Previous Allocation", id("previous_allocation")));
    }
    if alloc["next_allocation"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
    {
        out.push(("Replacement Alloc ID", id("next_allocation")));
    }
    let attempts = alloc["reschedule_events"].as_array().map_or(0, Vec::len);
    if attempts > 0 {
        out.push(("Reschedule Attempts", attempts.to_string()));
    }
    if let Some(next) = next_reschedule(alloc) {
        out.push(("Reschedule Eligibility", next.describe(now_ms)));
    }
    let waits: Vec<String> = alloc["waiting_for_claims_of"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|id| if verbose { id } else { short_id(id) }.to_string())
        .collect();
    if !waits.is_empty() && alloc["desired_status"] == "run" {
        out.push(("Waiting For Claims Of", waits.join(", ")));
    }
    out
}

/// The `Reschedule Attempts` table of `alloc status`: one row per
/// attempt before this alloc, oldest first.
pub fn attempts_rows(alloc: &Value, verbose: bool) -> Vec<Vec<String>> {
    let cut = |s: &str| if verbose { s } else { short_id(s) }.to_string();
    alloc["reschedule_events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            vec![
                format_time(e["time_ms"].as_i64().unwrap_or(0)),
                cut(e["prev_alloc_id"].as_str().unwrap_or_default()),
                cut(e["prev_node_id"].as_str().unwrap_or_default()),
                format!("{}s", e["delay_ms"].as_u64().unwrap_or(0) / 1000),
            ]
        })
        .collect()
}

/// The `Rescheduling` section of `job status` (`v` the job with its
/// alloc stubs): each failed alloc not replaced yet, with when its
/// replacement is due or that none will be; empty when there is none.
pub fn job_section(v: &Value, now_ms: i64) -> String {
    let lines: Vec<String> = v["allocations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| {
            let next = match &a["next_reschedule_ms"] {
                Value::Number(at) => Next::At(at.as_i64()?),
                Value::String(_) => Next::NoMore,
                _ => return None,
            };
            let what = match next {
                Next::At(_) => format!("next attempt {}", next.describe(now_ms)),
                Next::NoMore => next.describe(now_ms),
            };
            Some(format!(
                "  {} failed after {}: {what}\n",
                a["name"].as_str().unwrap_or_default(),
                count(
                    a["reschedule_attempts"].as_u64().unwrap_or(0),
                    "reschedule",
                    "reschedules"
                ),
            ))
        })
        .collect();
    if lines.is_empty() {
        return String::new();
    }
    format!("\nRescheduling\n{}", lines.concat())
}

/// One line per alloc of `allocs` placed that waits for the volume
/// claims of the allocs it replaces.
pub fn waiting_lines(allocs: &[Value]) -> Vec<String> {
    allocs
        .iter()
        .filter(|a| a["desired_status"] == "run")
        .filter_map(|a| {
            let waits: Vec<&str> = a["waiting_for_claims_of"]
                .as_array()?
                .iter()
                .filter_map(Value::as_str)
                .map(short_id)
                .collect();
            (!waits.is_empty()).then(|| {
                format!(
                    "{} waits for the claims of alloc {} to be released",
                    a["name"].as_str().unwrap_or_default(),
                    waits.join(", ")
                )
            })
        })
        .collect()
}

/// The `Waiting` section of `job status` (see [`waiting_lines`]).
pub fn waiting_section(v: &Value) -> String {
    let allocs = v["allocations"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let lines = waiting_lines(allocs);
    if lines.is_empty() {
        return String::new();
    }
    let body: String = lines.iter().map(|l| format!("  {l}\n")).collect();
    format!("\nWaiting\n{body}")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn failed_web(events: Value, policy: Value) -> Value {
        json!({
            "id": "a1", "name": "web.g[0]", "job_id": "web", "task_group": "g",
            "node_id": "n1", "client_status": "failed", "modify_time_ms": 100_000,
            "reschedule_events": events,
            "job": { "id": "web", "name": "web", "type": "service", "reschedule": policy,
                     "task_groups": [{ "name": "g", "count": 1, "tasks": [] }] },
        })
    }

    #[test]
    fn a_failed_alloc_says_when_its_replacement_is_due() {
        let unlimited = Value::Null;
        let a = failed_web(
            json!([{"time_ms": 1, "prev_alloc_id": "a0", "prev_node_id": "n1", "delay_ms": 30_000}]),
            unlimited,
        );
        // The service default: twice the last delay, 60 s after 100 s.
        assert_eq!(next_reschedule(&a), Some(Next::At(160_000)));
        assert_eq!(Next::At(160_000).describe(130_000), "in 30s");
        let lines = header_lines(&a, false, 130_000);
        assert_eq!(
            lines.last(),
            Some(&("Reschedule Eligibility", "in 30s".to_string()))
        );
        assert!(lines.contains(&("Reschedule Attempts", "1".to_string())));

        let limited = json!({"attempts": 1, "interval": "1h", "delay": "5s",
                             "delay_function": "constant", "max_delay": "1h", "unlimited": false});
        let a = failed_web(
            json!([{"time_ms": 90_000, "prev_alloc_id": "a0", "prev_node_id": "n1", "delay_ms": 5000}]),
            limited,
        );
        assert_eq!(next_reschedule(&a), Some(Next::NoMore));

        let mut replaced = a.clone();
        replaced["next_allocation"] = json!("a2");
        assert_eq!(next_reschedule(&replaced), None);
    }
}
