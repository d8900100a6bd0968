//! What kind of update a changed job is for the allocs of one group: one
//! they take in place (the alloc's job moves to the new version, its tasks
//! run on untouched), or a destructive one (the alloc is stopped and a new
//! one placed at its index).
//!
//! In place: the group's `count` (the difference is placed or stopped,
//! the rest kept), its `meta`, its `restart`, `reschedule` and `update`
//! blocks (the job's too) and its disconnect
//! settings, the tasks' `kill_timeout`, the job's `meta` and `priority`,
//! the `affinity` and `spread` preferences (they steer new placements and
//! move nothing that runs), and what the servers manage (version, status,
//! indexes). In place if
//! the alloc's node still meets them: the job's datacenters and the
//! constraints on the node (of the job, the group and its tasks), as
//! Nomad does. Anything else (a task's driver, config, env, resources,
//! mounts, logs or meta, the group's volumes, the job's type, a
//! `distinct_hosts` or `distinct_property` rule) needs new tasks. The
//! fields are named one by one below, so that a field added to a job is a
//! decision here, not a silent in-place change.

use berth_structs::{Constraint, Job, Task, TaskGroup};

/// How the allocs of a group running an older version take a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum UpdateKind {
    InPlace,
    /// In place where the alloc's node meets the new placement rules.
    InPlaceIfNodeFits,
    Destructive,
}

/// How allocs of group `group` running `old` take `new`: destructive
/// when either job has no such group.
pub(super) fn update_kind(old: &Job, new: &Job, group: &str) -> UpdateKind {
    let (Some((tasks_a, rules_a)), Some((tasks_b, rules_b))) =
        (what_tasks_run(old, group), what_tasks_run(new, group))
    else {
        return UpdateKind::Destructive;
    };
    if tasks_a != tasks_b || rules_a.distinct != rules_b.distinct {
        UpdateKind::Destructive
    } else if rules_a != rules_b {
        UpdateKind::InPlaceIfNodeFits
    } else {
        UpdateKind::InPlace
    }
}

/// A group's placement rules: what the node must be, and how the allocs
/// must spread.
#[derive(PartialEq)]
struct Rules<'a> {
    datacenters: &'a [String],
    on_node: Vec<&'a Constraint>,
    distinct: Vec<&'a Constraint>,
}

impl<'a> Rules<'a> {
    fn new(datacenters: &'a [String], all: impl Iterator<Item = &'a Constraint>) -> Rules<'a> {
        let (distinct, on_node) = all.partition(|c| c.operator.is_distinct());
        Rules {
            datacenters,
            on_node,
            distinct,
        }
    }
}

/// What of `job` shapes the tasks of `group` (every field but those an
/// alloc takes in place, see the module), and the group's placement
/// rules.
fn what_tasks_run<'a>(job: &'a Job, group: &str) -> Option<(impl PartialEq + 'a, Rules<'a>)> {
    let Job {
        id,
        name,
        job_type,
        region,
        datacenters,
        constraints: job_constraints,
        affinities: _,
        spreads: _,
        priority: _,
        reschedule: _,
        update: _,
        task_groups,
        meta: _,
        stop: _,
        status: _,
        version: _,
        create_index: _,
        modify_index: _,
        modify_time_ms: _,
        job_modify_index: _,
        purge: _,
    } = job;
    let TaskGroup {
        name: group_name,
        count: _,
        volumes,
        tasks,
        restart: _,
        reschedule: _,
        update: _,
        stop_after_client_disconnect: _,
        max_client_disconnect: _,
        disconnect: _,
        meta: _,
        constraints: group_constraints,
        affinities: _,
        spreads: _,
    } = task_groups.iter().find(|g| g.name == group)?;
    let rules = Rules::new(
        datacenters,
        job_constraints
            .iter()
            .chain(group_constraints)
            .chain(tasks.iter().flat_map(|t| &t.constraints)),
    );
    let tasks: Vec<_> = tasks.iter().map(task_shape).collect();
    Some((
        ((id, name, job_type, region), (group_name, volumes), tasks),
        rules,
    ))
}

/// What of a task a change of needs a new task (its constraints are the
/// group's placement rules).
fn task_shape(task: &Task) -> impl PartialEq + '_ {
    let Task {
        name,
        driver,
        config,
        env,
        resources,
        volume_mounts,
        csi_plugin,
        kill_timeout: _,
        meta,
        logs,
        constraints: _,
        affinities: _,
        user,
    } = task;
    (
        name,
        driver,
        config,
        env,
        resources,
        volume_mounts,
        csi_plugin,
        meta,
        logs,
        user,
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use berth_structs::{JobType, Task, TaskGroup};

    use super::*;

    fn job() -> Job {
        Job {
            id: "web".into(),
            name: "web".into(),
            job_type: JobType::Service,
            task_groups: vec![TaskGroup {
                name: "g".into(),
                count: 3,
                tasks: vec![Task {
                    name: "t".into(),
                    driver: "raw_exec".into(),
                    ..Task::default()
                }],
                ..TaskGroup::default()
            }],
            ..Job::default()
        }
    }

    #[test]
    fn counts_meta_policies_and_kill_timeouts_are_taken_in_place() {
        let old = job();
        let mut new = job();
        new.version = 4;
        new.priority = 70;
        new.meta.insert("owner".into(), "ops".into());
        let g = &mut new.task_groups[0];
        g.count = 5;
        g.meta.insert("tier".into(), "gold".into());
        g.restart.attempts = 9;
        g.stop_after_client_disconnect = Some(Duration::from_secs(60));
        g.tasks[0].kill_timeout = Some(Duration::from_secs(30));
        assert_eq!(update_kind(&old, &new, "g"), UpdateKind::InPlace);
    }

    #[test]
    fn placement_rules_are_taken_in_place_where_the_node_still_fits() {
        let old = job();
        let mut new = job();
        new.datacenters = vec!["east".into()];
        assert_eq!(update_kind(&old, &new, "g"), UpdateKind::InPlaceIfNodeFits);
        let mut new = job();
        new.task_groups[0].tasks[0].constraints.push(Constraint {
            attribute: "${meta.rack}".into(),
            value: "r1".into(),
            ..Constraint::default()
        });
        assert_eq!(update_kind(&old, &new, "g"), UpdateKind::InPlaceIfNodeFits);
        // A rule over the other allocs is not a node's to meet.
        let mut new = job();
        new.task_groups[0].constraints.push(Constraint {
            operator: berth_structs::Operator::DistinctHosts,
            ..Constraint::default()
        });
        assert_eq!(update_kind(&old, &new, "g"), UpdateKind::Destructive);
    }

    #[test]
    fn task_and_volume_changes_need_new_allocs() {
        let old = job();
        type Change = (&'static str, fn(&mut Job));
        let changes: [Change; 5] = [
            ("env", |j| {
                j.task_groups[0].tasks[0].env.insert("A".into(), "1".into());
            }),
            ("resources", |j| {
                j.task_groups[0].tasks[0].resources.cpu = 900
            }),
            ("driver", |j| {
                j.task_groups[0].tasks[0].driver = "exec".into()
            }),
            ("a task more", |j| {
                let t = j.task_groups[0].tasks[0].clone();
                j.task_groups[0].tasks.push(Task {
                    name: "u".into(),
                    ..t
                });
            }),
            ("a volume", |j| {
                j.task_groups[0]
                    .volumes
                    .insert("data".into(), Default::default());
            }),
        ];
        for (what, change) in changes {
            let mut new = job();
            change(&mut new);
            assert_eq!(
                update_kind(&old, &new, "g"),
                UpdateKind::Destructive,
                "{what}"
            );
        }
        // A group the job no longer has, or one it did not have.
        assert_eq!(update_kind(&old, &job(), "other"), UpdateKind::Destructive);
    }
}
