//! Job plans (`job plan`) and job summaries (`job status`).
//!
//! A plan runs the scheduler's placement computation ([`crate::scheduler`])
//! for the job as a registration would store it, against the current
//! tables, and commits nothing: it answers what would change (a field-level
//! diff against the stored job), where each new alloc would go, which allocs
//! would stop, and the placements that could not be made. A summary counts
//! a job's allocs per group by state; `queued` is what the scheduler could
//! not place yet, from the same computation.

use std::collections::BTreeMap;

use berth_structs::{AllocClientStatus, Allocation, Job};
use serde::Serialize;
use serde_json::Value;

use crate::error::ServerError;
use crate::scheduler::{place, PlanOutcome};
use crate::server::Server;
use crate::state::{Change, Tables};

use super::jobs::{registration, spec_index};

/// The answer to a job plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobPlan {
    pub job_id: String,
    /// The stored job's job modify index (0: no such job): a registration
    /// with `enforce_index` naming it goes through only if nothing changed
    /// the job in between.
    pub job_modify_index: u64,
    /// What a registration would change of the stored job.
    pub diff: JobDiff,
    /// Per group of the job (and per group the job no longer has but that
    /// still has allocs): the allocs placed, stopped and kept.
    pub groups: Vec<GroupPlan>,
    /// Placements that could not be made, one line per group and reason,
    /// each naming every node's reason.
    pub placement_failures: Vec<String>,
    /// Allocs placed that would wait for the claims of the allocs they
    /// replace, one line each.
    pub waiting: Vec<String>,
    /// The allocs the job would want.
    pub desired_allocs: u64,
    /// How many of them could not be placed now.
    pub unplaced_allocs: u64,
    /// Whether a registration would create, stop or update any alloc.
    pub allocs_change: bool,
}

/// How the submitted job differs from the stored one, leaving out the
/// fields the servers manage (version, status, indexes).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobDiff {
    pub kind: DiffKind,
    /// One entry per field that differs, in document order.
    pub fields: Vec<FieldDiff>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiffKind {
    /// No such job yet.
    Added,
    /// The same spec, and the job runs.
    Unchanged,
    /// The same spec, but the job is stopped: a run starts it again.
    Restarted,
    /// The spec differs.
    Edited,
}

/// One field that differs. `path` names it as `task_groups[web].count`:
/// list items that have a name are addressed by it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FieldDiff {
    pub path: String,
    pub op: DiffOp,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new: Option<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum DiffOp {
    #[serde(rename = "+")]
    Added,
    #[serde(rename = "-")]
    Deleted,
    #[serde(rename = "~")]
    Edited,
}

/// What a registration would do to one group's allocs.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct GroupPlan {
    pub name: String,
    /// New allocs.
    pub place: u64,
    /// Allocs stopped, `update` of them because the job changed (they are
    /// placed anew: a destructive update).
    pub stop: u64,
    pub update: u64,
    /// Live allocs that take the changed job in place: same ID, same
    /// tasks.
    pub in_place: u64,
    /// Live allocs of the current version left as they are.
    pub keep: u64,
    /// Allocs that could not be placed.
    pub unplaced: u64,
    pub placements: Vec<PlannedAlloc>,
    pub stops: Vec<StoppedAlloc>,
}

/// A new alloc and the node it would go to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedAlloc {
    pub name: String,
    pub index: u32,
    pub node_id: String,
    pub node_name: String,
}

/// An alloc that would be stopped, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoppedAlloc {
    pub id: String,
    pub name: String,
    pub node_id: String,
    pub reason: String,
}

/// A job's allocs per group by state (Nomad's job summary).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobSummary {
    pub job_id: String,
    /// The index the summary reflects.
    pub index: u64,
    pub groups: BTreeMap<String, GroupSummary>,
}

/// One group's allocs by state: `queued` are placements the scheduler
/// could not make yet, `starting` allocs placed that their client has not
/// reported running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct GroupSummary {
    pub queued: u64,
    pub starting: u64,
    pub running: u64,
    pub failed: u64,
    pub complete: u64,
    pub lost: u64,
    /// Allocs on a disconnected node, held for its return.
    pub unknown: u64,
}

impl Server {
    /// Plan a registration of `job`: what it would change, place and stop,
    /// without writing anything.
    pub fn plan_job(&self, job: Job) -> Result<JobPlan, ServerError> {
        self.check_job(&job)?;
        let now = berth_structs::now_ms();
        Ok(self.store.read(|t| {
            let old = t.jobs.get(&job.id);
            let (candidate, changed) = registration(old, job.clone(), t.index.saturating_add(1));
            let mut changes = Vec::new();
            let outcome = place(t, &candidate, &self.config, now, &mut changes);
            let diff = match old {
                None => JobDiff {
                    kind: DiffKind::Added,
                    fields: Vec::new(),
                },
                Some(old) => {
                    let fields = diff_values(&spec_value(old), &spec_value(&job));
                    let kind = match (fields.is_empty(), changed) {
                        (false, _) => DiffKind::Edited,
                        (true, true) => DiffKind::Restarted,
                        (true, false) => DiffKind::Unchanged,
                    };
                    JobDiff { kind, fields }
                }
            };
            let groups = group_plans(t, &candidate, &changes, &outcome);
            let allocs_change = groups
                .iter()
                .any(|g| g.place > 0 || g.stop > 0 || g.in_place > 0);
            JobPlan {
                job_id: job.id.clone(),
                job_modify_index: spec_index(old),
                diff,
                groups,
                placement_failures: outcome.failures,
                waiting: outcome.waiting,
                desired_allocs: outcome.counts.desired,
                unplaced_allocs: outcome.counts.unplaced,
                allocs_change,
            }
        }))
    }

    /// The allocs of each of `jobs` per group by state, in one read: a
    /// job list's summaries. `queued` is left at 0: it takes a plan per
    /// job, which [`Server::job_summary`] makes.
    pub fn jobs_group_counts(&self, jobs: &[Job]) -> Vec<BTreeMap<String, GroupSummary>> {
        self.store
            .read(|t| jobs.iter().map(|job| group_counts(t, job)).collect())
    }

    /// A job's allocs per group by state, and what waits to be placed.
    pub fn job_summary(&self, id: &str) -> Result<JobSummary, ServerError> {
        let now = berth_structs::now_ms();
        self.store.read(|t| {
            let job = t
                .jobs
                .get(id)
                .ok_or_else(|| ServerError::not_found(format!("job {id:?} not found")))?;
            let mut groups = group_counts(t, job);
            // What the scheduler cannot place now (computed, not written).
            let outcome = place(t, job, &self.config, now, &mut Vec::new());
            for (group, n) in outcome.unplaced_by_group {
                groups.entry(group).or_default().queued = n;
            }
            Ok(JobSummary {
                job_id: job.id.clone(),
                index: t.index,
                groups,
            })
        })
    }

    /// The ID of the job `id` names: itself, or the one job whose ID starts
    /// with it. An ambiguous prefix is an error that lists the matches.
    pub fn resolve_job_id(&self, id: &str) -> Result<String, ServerError> {
        self.store
            .read(|t| Ok(crate::server::job_in(t, id)?.id.clone()))
    }
}

/// The allocs of `job` per group by client state (`queued` left at 0).
fn group_counts(t: &Tables, job: &Job) -> BTreeMap<String, GroupSummary> {
    let mut groups: BTreeMap<String, GroupSummary> = job
        .task_groups
        .iter()
        .map(|g| (g.name.clone(), GroupSummary::default()))
        .collect();
    for a in t.allocs_of_job(&job.id) {
        let g = groups.entry(a.task_group.clone()).or_default();
        match a.client_status {
            // Stopped before its client started it: it never runs.
            AllocClientStatus::Pending if a.server_terminal() => {}
            AllocClientStatus::Pending => g.starting += 1,
            AllocClientStatus::Running => g.running += 1,
            AllocClientStatus::Failed => g.failed += 1,
            AllocClientStatus::Complete => g.complete += 1,
            AllocClientStatus::Lost => g.lost += 1,
            AllocClientStatus::Unknown => g.unknown += 1,
        }
    }
    groups
}

/// The job as JSON without the fields the servers manage.
pub(crate) fn spec_value(job: &Job) -> Value {
    let mut v = serde_json::to_value(job).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        for k in [
            "stop",
            "status",
            "version",
            "create_index",
            "modify_index",
            "modify_time_ms",
            "job_modify_index",
            "purge",
        ] {
            m.remove(k);
        }
    }
    v
}

/// The fields that differ between `old` and `new`.
pub(crate) fn diff_values(old: &Value, new: &Value) -> Vec<FieldDiff> {
    let mut out = Vec::new();
    diff_at("", old, new, &mut out);
    out
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// The name of a list item that has one (groups, tasks).
fn item_name(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

/// Whether every item of both lists has a name, each once: such lists are
/// compared item by item.
fn named_items<'a>(old: &'a [Value], new: &'a [Value]) -> bool {
    let unique = |items: &[Value]| {
        let mut seen = std::collections::BTreeSet::new();
        items
            .iter()
            .all(|i| item_name(i).is_some_and(|n| seen.insert(n)))
    };
    !(old.is_empty() && new.is_empty()) && unique(old) && unique(new)
}

fn diff_at(path: &str, old: &Value, new: &Value, out: &mut Vec<FieldDiff>) {
    if old == new {
        return;
    }
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            for (k, ov) in o {
                match n.get(k) {
                    Some(nv) => diff_at(&join(path, k), ov, nv, out),
                    None => out.push(FieldDiff {
                        path: join(path, k),
                        op: DiffOp::Deleted,
                        old: Some(ov.clone()),
                        new: None,
                    }),
                }
            }
            for (k, nv) in n {
                if !o.contains_key(k) {
                    out.push(FieldDiff {
                        path: join(path, k),
                        op: DiffOp::Added,
                        old: None,
                        new: Some(nv.clone()),
                    });
                }
            }
        }
        (Value::Array(o), Value::Array(n)) if named_items(o, n) => {
            let at = |name: &str| format!("{path}[{name}]");
            for ov in o {
                let name = item_name(ov).unwrap_or_default();
                match n.iter().find(|nv| item_name(nv) == Some(name)) {
                    Some(nv) => diff_at(&at(name), ov, nv, out),
                    None => out.push(FieldDiff {
                        path: at(name),
                        op: DiffOp::Deleted,
                        old: Some(ov.clone()),
                        new: None,
                    }),
                }
            }
            for nv in n {
                let name = item_name(nv).unwrap_or_default();
                if !o.iter().any(|ov| item_name(ov) == Some(name)) {
                    out.push(FieldDiff {
                        path: at(name),
                        op: DiffOp::Added,
                        old: None,
                        new: Some(nv.clone()),
                    });
                }
            }
        }
        _ => out.push(FieldDiff {
            path: path.to_string(),
            op: DiffOp::Edited,
            old: Some(old.clone()),
            new: Some(new.clone()),
        }),
    }
}

/// Per group: the placements and stops among `changes`, the allocs kept,
/// and what could not be placed.
fn group_plans(t: &Tables, job: &Job, changes: &[Change], outcome: &PlanOutcome) -> Vec<GroupPlan> {
    let mut groups: Vec<GroupPlan> = job
        .task_groups
        .iter()
        .map(|g| GroupPlan {
            name: g.name.clone(),
            unplaced: outcome.unplaced_by_group.get(&g.name).copied().unwrap_or(0),
            ..GroupPlan::default()
        })
        .collect();
    let entry = |groups: &mut Vec<GroupPlan>, name: &str| -> usize {
        match groups.iter().position(|g| g.name == name) {
            Some(i) => i,
            None => {
                groups.push(GroupPlan {
                    name: name.to_string(),
                    ..GroupPlan::default()
                });
                groups.len() - 1
            }
        }
    };
    let mut stopped = std::collections::BTreeSet::new();
    for c in changes {
        let Change::PutAlloc(a) = c else { continue };
        let i = entry(&mut groups, &a.task_group);
        let g = &mut groups[i];
        match t.allocs.get(&a.id) {
            None => {
                g.place += 1;
                g.placements.push(PlannedAlloc {
                    name: a.name.clone(),
                    index: a.index,
                    node_id: a.node_id.clone(),
                    node_name: t
                        .nodes
                        .get(&a.node_id)
                        .map(|n| n.name.clone())
                        .filter(|n| !n.is_empty())
                        .unwrap_or_else(|| a.node_id.clone()),
                });
            }
            Some(before) if a.server_terminal() && !before.server_terminal() => {
                stopped.insert(a.id.as_str());
                g.stop += 1;
                if a.desired_description == "job updated" {
                    g.update += 1;
                }
                g.stops.push(StoppedAlloc {
                    id: a.id.clone(),
                    name: a.name.clone(),
                    node_id: a.node_id.clone(),
                    reason: a.desired_description.clone(),
                });
            }
            Some(before) if !a.server_terminal() && before.job.version != a.job.version => {
                stopped.insert(a.id.as_str());
                g.in_place += 1;
            }
            Some(_) => {}
        }
    }
    // Allocs stopped or updated in place are counted already.
    let live = |a: &Allocation| !a.is_terminal() && !stopped.contains(a.id.as_str());
    for a in t.allocs_of_job(&job.id).filter(|a| live(a)) {
        if a.job.version == job.version {
            let i = entry(&mut groups, &a.task_group);
            groups[i].keep += 1;
        }
    }
    for g in &mut groups {
        g.placements.sort_by_key(|p| p.index);
        g.stops
            .sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.id.cmp(&b.id)));
    }
    groups
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn diffs_address_named_items_by_name() {
        let old = json!({
            "name": "web",
            "task_groups": [
                {"name": "a", "count": 1, "tasks": [{"name": "t", "config": {"args": ["1"]}}]},
                {"name": "b", "count": 1},
            ],
            "meta": {"owner": "x"},
        });
        let new = json!({
            "name": "web",
            "task_groups": [
                {"name": "a", "count": 3, "tasks": [{"name": "t", "config": {"args": ["2"]}}]},
                {"name": "c", "count": 1},
            ],
            "meta": {},
        });
        let d: Vec<(String, DiffOp)> = diff_values(&old, &new)
            .into_iter()
            .map(|f| (f.path, f.op))
            .collect();
        assert_eq!(
            d,
            vec![
                ("meta.owner".to_string(), DiffOp::Deleted),
                ("task_groups[a].count".to_string(), DiffOp::Edited),
                (
                    "task_groups[a].tasks[t].config.args".to_string(),
                    DiffOp::Edited
                ),
                ("task_groups[b]".to_string(), DiffOp::Deleted),
                ("task_groups[c]".to_string(), DiffOp::Added),
            ]
        );
        assert!(diff_values(&old, &old).is_empty());
    }
}
