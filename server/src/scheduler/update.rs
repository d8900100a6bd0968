//! What kind of update a changed job is for the allocs of one group: one
//! they take in place (the alloc's job moves to the new version, its tasks
//! run on untouched), or a destructive one (the alloc is stopped and a new
//! one placed at its index).
//!
//! In place: the group's `count` (the difference is placed or stopped,
//! the rest kept), its `meta`, its `restart` policy and its disconnect
//! settings, the tasks' `kill_timeout`, the job's `meta` and `priority`,
//! and what the servers manage (version, status, indexes). Anything else
//! (a task's driver, config, env, resources, mounts, logs or meta, the
//! group's volumes, the job's type or datacenters) needs new tasks. The
//! fields are named one by one below, so that a field added to a job is
//! a decision here, not a silent in-place change.

use berth_structs::{Job, Task, TaskGroup};

/// Whether allocs of group `group` running `old` take `new` in place.
/// False when either job has no such group.
pub(super) fn updatable_in_place(old: &Job, new: &Job, group: &str) -> bool {
    match (what_tasks_run(old, group), what_tasks_run(new, group)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// What of `job` shapes the tasks of `group`: every field but those an
/// alloc takes in place (see the module).
fn what_tasks_run<'a>(job: &'a Job, group: &str) -> Option<impl PartialEq + 'a> {
    let Job {
        id,
        name,
        job_type,
        datacenters,
        priority: _,
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
        stop_after_client_disconnect: _,
        max_client_disconnect: _,
        disconnect: _,
        meta: _,
    } = task_groups.iter().find(|g| g.name == group)?;
    let tasks: Vec<_> = tasks.iter().map(task_shape).collect();
    Some((
        (id, name, job_type, datacenters),
        (group_name, volumes),
        tasks,
    ))
}

/// What of a task a change of needs a new task.
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
        assert!(updatable_in_place(&old, &new, "g"));
    }

    #[test]
    fn task_groups_volume_and_placement_changes_need_new_allocs() {
        let old = job();
        type Change = (&'static str, fn(&mut Job));
        let changes: [Change; 6] = [
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
            ("datacenters", |j| j.datacenters = vec!["east".into()]),
            ("a volume", |j| {
                j.task_groups[0]
                    .volumes
                    .insert("data".into(), Default::default());
            }),
        ];
        for (what, change) in changes {
            let mut new = job();
            change(&mut new);
            assert!(!updatable_in_place(&old, &new, "g"), "{what}");
        }
        // A group the job no longer has, or one it did not have.
        assert!(!updatable_in_place(&old, &job(), "other"));
    }
}
