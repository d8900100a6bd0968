//! The task environment and `${NAME}` interpolation.

use std::collections::BTreeMap;

use berth_structs::{Allocation, Task};

use crate::alloc_dir::{AllocDir, TaskDir};

/// `PATH` for tasks when the agent has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The variables berth sets for every task, and `PATH` (the agent's,
/// after `extra_path`). `BERTH_NODE_DATA_DIR` is the task's node data dir
/// (see [`AllocDir::node_data_dir`]): the same for every alloc of the job,
/// group and task on this node.
pub fn base_env(
    alloc: &Allocation,
    task: &Task,
    node_id: &str,
    alloc_dir: &AllocDir,
    task_dir: &TaskDir,
    extra_path: Option<&str>,
) -> BTreeMap<String, String> {
    let agent_path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_string());
    let path = match extra_path {
        Some(extra) if !extra.is_empty() => format!("{extra}:{agent_path}"),
        _ => agent_path,
    };
    let job_name = if alloc.job.name.is_empty() {
        &alloc.job.id
    } else {
        &alloc.job.name
    };
    [
        ("BERTH_ALLOC_ID", alloc.id.clone()),
        (
            "BERTH_ALLOC_DIR",
            alloc_dir.shared_dir().display().to_string(),
        ),
        ("BERTH_TASK_DIR", task_dir.dir.display().to_string()),
        ("BERTH_SECRETS_DIR", task_dir.secrets.display().to_string()),
        ("BERTH_JOB_NAME", job_name.clone()),
        ("BERTH_GROUP_NAME", alloc.task_group.clone()),
        ("BERTH_TASK_NAME", task.name.clone()),
        ("BERTH_NODE_ID", node_id.to_string()),
        (
            "BERTH_NODE_DATA_DIR",
            alloc_dir
                .node_data_dir(&alloc.job_id, &alloc.task_group, &task.name)
                .display()
                .to_string(),
        ),
        ("PATH", path),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// `base` with the task's `env` block laid over it; the block's values are
/// interpolated from `base`.
pub fn with_task_env(
    mut base: BTreeMap<String, String>,
    task_env: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let values: Vec<(String, String)> = task_env
        .iter()
        .map(|(k, v)| (k.clone(), interpolate(v, &base)))
        .collect();
    base.extend(values);
    base
}

/// Replaces each `${NAME}` in `s` with its value in `env`; unknown names
/// and unterminated `${` are left as they are.
pub fn interpolate(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find('}') {
            Some(end) => {
                let name = &after[..end];
                match env.get(name) {
                    Some(v) => out.push_str(v),
                    None => out.push_str(&rest[start..start + 2 + end + 1]),
                }
                rest = &after[end + 1..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> BTreeMap<String, String> {
        [
            ("A".to_string(), "1".to_string()),
            ("B_C".into(), "two".into()),
        ]
        .into()
    }

    #[test]
    fn interpolates_known_names_and_keeps_the_rest() {
        let e = env();
        assert_eq!(interpolate("x${A}y${B_C}", &e), "x1ytwo");
        assert_eq!(interpolate("${UNKNOWN}/${A}", &e), "${UNKNOWN}/1");
        assert_eq!(interpolate("$A ${A", &e), "$A ${A");
        assert_eq!(interpolate("", &e), "");
        assert_eq!(interpolate("${}", &e), "${}");
    }

    fn alloc_of(id: &str, version: u64) -> Allocation {
        let mut a = Allocation {
            id: id.into(),
            job_id: "hostpath-plugin".into(),
            task_group: "plugin".into(),
            ..Allocation::default()
        };
        let job = std::sync::Arc::make_mut(&mut a.job);
        job.id = "hostpath-plugin".into();
        job.version = version;
        a
    }

    #[test]
    fn every_alloc_of_a_task_gets_the_same_node_data_dir() {
        let root = std::path::Path::new("/var/lib/berth/alloc");
        let task = Task {
            name: "plugin".into(),
            ..Task::default()
        };
        let env_of = |alloc: &Allocation| {
            let dir = AllocDir::new(root, &alloc.id);
            let td = dir.task_dir(&task.name);
            base_env(alloc, &task, "node-1", &dir, &td, None)
        };
        let old = env_of(&alloc_of("a1", 0));
        let new = env_of(&alloc_of("a2", 1));
        assert_eq!(
            old["BERTH_NODE_DATA_DIR"],
            "/var/lib/berth/node_data/hostpath-plugin/plugin/plugin"
        );
        assert_eq!(old["BERTH_NODE_DATA_DIR"], new["BERTH_NODE_DATA_DIR"]);
        assert_ne!(old["BERTH_ALLOC_DIR"], new["BERTH_ALLOC_DIR"]);
        // Interpolated in args like every other variable.
        assert_eq!(
            interpolate("--state-dir=${BERTH_NODE_DATA_DIR}", &new),
            "--state-dir=/var/lib/berth/node_data/hostpath-plugin/plugin/plugin"
        );
        // Another task of the group has its own.
        let other = Task {
            name: "other".into(),
            ..Task::default()
        };
        let alloc = alloc_of("a1", 0);
        let dir = AllocDir::new(root, &alloc.id);
        let e = base_env(&alloc, &other, "n", &dir, &dir.task_dir("other"), None);
        assert_eq!(
            e["BERTH_NODE_DATA_DIR"],
            "/var/lib/berth/node_data/hostpath-plugin/plugin/other"
        );
    }

    #[test]
    fn task_env_is_interpolated_from_the_base() {
        let merged = with_task_env(env(), &[("X".to_string(), "${A}-x".to_string())].into());
        assert_eq!(merged["X"], "1-x");
        assert_eq!(merged["A"], "1");
    }
}
