//! `berth volume snapshot create|list|delete`, and what `volume create`
//! says when the volume existed (unchanged or expanded).

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::output::OutputArgs;
use super::{enc, Ctx};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Snapshot a CSI volume through its plugin
    Create(CreateArgs),
    /// List the snapshots of a plugin (of all plugins)
    List(ListArgs),
    /// Delete a snapshot through its plugin
    Delete(DeleteArgs),
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    #[command(flatten)]
    pub output: OutputArgs,
    /// The volume's ID
    #[arg(value_name = "VOLUME")]
    pub volume: String,
    /// The snapshot's name (default: VOLUME-<unix ms>)
    #[arg(value_name = "NAME")]
    pub name: Option<String>,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// Only this plugin's snapshots
    #[arg(long, value_name = "PLUGIN")]
    pub plugin: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Args, Debug)]
pub struct DeleteArgs {
    /// The plugin's ID
    #[arg(value_name = "PLUGIN")]
    pub plugin: String,
    /// The snapshot's ID
    #[arg(value_name = "SNAPSHOT")]
    pub snapshot: String,
}

pub fn run(cmd: SnapshotCommand, ctx: &Ctx) -> Result<i32> {
    let api = ctx.api();
    match cmd {
        SnapshotCommand::Create(a) => snapshot_create(a, api),
        SnapshotCommand::List(a) => snapshot_list(a, api),
        SnapshotCommand::Delete(a) => snapshot_delete(a, api),
    }
}

/// `volume snapshot create VOLUME [NAME]`.
fn snapshot_create(a: CreateArgs, api: &ApiClient) -> Result<i32> {
    let volume = a.volume;
    let name = a
        .name
        .unwrap_or_else(|| format!("{volume}-{}", berth_structs::now_ms()));
    let s = api.put(
        "/v1/volumes/snapshot",
        &json!({ "volume_id": volume, "name": name }),
    )?;
    a.output.emit(&s, |s| {
        println!(
            "Snapshot {:?} of volume {volume:?} created (ID {}, {}, ready: {})",
            s["name"].as_str().unwrap_or(&name),
            s["id"].as_str().unwrap_or_default(),
            berth_api::describe_size(s["size_bytes"].as_u64().unwrap_or(0)),
            s["ready_to_use"].as_bool().unwrap_or(false)
        );
        Ok(())
    })
}

/// `volume snapshot list [-plugin P] [-json]`.
fn snapshot_list(a: ListArgs, api: &ApiClient) -> Result<i32> {
    let url = match &a.plugin {
        Some(p) => format!("/v1/volumes/snapshot?plugin_id={}", enc(p)),
        None => "/v1/volumes/snapshot".to_string(),
    };
    let v = api.get(&url)?;
    a.output.emit(&v, |v| {
        if v.as_array().is_some_and(Vec::is_empty) {
            println!("No snapshots");
            return Ok(());
        }
        super::output::print_lines(snapshot_table(v));
        Ok(())
    })
}

/// The rows `snapshot list` prints, header first, in columns as wide as
/// their widest cell.
pub fn snapshot_table(snapshots: &Value) -> Vec<String> {
    let mut rows = vec![
        ["ID", "Plugin", "Source Volume", "Size", "Created", "Ready"]
            .map(String::from)
            .to_vec(),
    ];
    for s in snapshots.as_array().into_iter().flatten() {
        let source = match s["source_volume_id"].as_str().filter(|v| !v.is_empty()) {
            Some(v) => v.to_string(),
            None => s["external_source_volume_id"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        };
        rows.push(vec![
            s["id"].as_str().unwrap_or_default().to_string(),
            s["plugin_id"].as_str().unwrap_or_default().to_string(),
            source,
            berth_api::describe_size(s["size_bytes"].as_u64().unwrap_or(0)),
            created_text(s["create_time_ms"].as_i64().unwrap_or(0)),
            s["ready_to_use"].as_bool().unwrap_or(false).to_string(),
        ]);
    }
    super::output::table(&rows)
}

/// A creation time in UTC, `2026-12-01T10:20:00Z`; `-` when unknown.
fn created_text(ms: i64) -> String {
    if ms <= 0 {
        return "-".to_string();
    }
    let secs = ms / 1000;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `volume snapshot delete PLUGIN SNAPSHOT`.
fn snapshot_delete(a: DeleteArgs, api: &ApiClient) -> Result<i32> {
    let (plugin, snapshot) = (&a.plugin, &a.snapshot);
    api.delete(&format!(
        "/v1/volumes/snapshot?plugin_id={}&snapshot_id={}",
        enc(plugin),
        enc(snapshot)
    ))?;
    println!("Deleted snapshot {snapshot:?} of plugin {plugin:?}");
    Ok(0)
}

/// The volume `id` as the API shows it, `None` when there is none.
pub fn existing_volume(api: &ApiClient, id: &str) -> Result<Option<Value>> {
    match api.get(&format!("/v1/volume/csi/{}", enc(id))) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.api().is_some_and(|e| e.status == 404) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// What `volume create` did, given the volume before the request (when it
/// existed) and the answer.
pub fn create_outcome(id: &str, before: Option<&Value>, after: &Value) -> String {
    let ext = after["external_id"].as_str().unwrap_or_default();
    let Some(before) = before else {
        return format!("Created volume {id:?} (external ID {ext:?})");
    };
    let (was, now) = (
        before["capacity"].as_u64().unwrap_or(0),
        after["capacity"].as_u64().unwrap_or(0),
    );
    let requests = |v: &Value| (v["capacity_min"].clone(), v["capacity_max"].clone());
    if now > was {
        format!(
            "Expanded volume {id:?} from {} to {}",
            berth_api::describe_size(was),
            berth_api::describe_size(now)
        )
    } else if requests(before) != requests(after) {
        format!(
            "Volume {id:?} has {}; its capacity requests are updated",
            berth_api::describe_size(now)
        )
    } else {
        format!("Volume {id:?} exists and is unchanged (external ID {ext:?})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creation_times_are_utc() {
        assert_eq!(created_text(0), "-");
        assert_eq!(created_text(1_000), "1970-01-01T00:00:01Z");
        assert_eq!(created_text(1_796_120_000_000), "2026-12-01T10:13:20Z");
        assert_eq!(created_text(951_782_400_000), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn the_snapshot_table_is_aligned_whatever_the_id_lengths() {
        let rows = snapshot_table(&json!([
            {"id": "snap-0123456789abcdef0123456789abcdef0123456789", "plugin_id": "hostpath.csi.example.com",
             "source_volume_id": "data", "size_bytes": 1u64 << 20, "create_time_ms": 1_000, "ready_to_use": true},
            {"id": "s2", "plugin_id": "hp", "source_volume_id": "",
             "external_source_volume_id": "ext-1", "size_bytes": 0, "ready_to_use": false},
        ]));
        assert_eq!(rows.len(), 3, "{rows:#?}");
        // Every column starts at the same place on every row.
        for column in ["Plugin", "Source Volume", "Size", "Created", "Ready"] {
            let at = rows[0].find(column).unwrap();
            assert!(
                rows[1..]
                    .iter()
                    .all(|r| r.len() > at && &r[at - 2..at] == "  " && !r[at..].starts_with(' ')),
                "{column}: {rows:#?}"
            );
        }
        assert!(rows[2].contains("ext-1"), "{rows:#?}");
        assert!(rows.iter().all(|r| !r.ends_with(' ')), "{rows:#?}");
    }

    #[test]
    fn create_outcome_says_created_expanded_or_unchanged() {
        let after = json!({"external_id": "e1", "capacity": 40u64 << 20});
        assert!(create_outcome("v", None, &after).starts_with("Created volume"));
        let before = json!({"capacity": 20u64 << 20});
        assert_eq!(
            create_outcome("v", Some(&before), &after),
            "Expanded volume \"v\" from 20 MiB to 40 MiB"
        );
        assert!(create_outcome("v", Some(&after), &after).contains("unchanged"));
        let asked_more = json!({"capacity": 40u64 << 20, "capacity_min": 40u64 << 20});
        assert!(create_outcome("v", Some(&after), &asked_more).contains("requests are updated"));
    }
}
