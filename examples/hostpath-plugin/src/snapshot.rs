//! Snapshots: CreateSnapshot, DeleteSnapshot, ListSnapshots, GetSnapshot.
//!
//! A snapshot is an independent copy of a volume's data, taken under the
//! state lock (so no instance changes or deletes the volume's record while
//! it is copied) into `<state-dir>/snapshots/<snapshot-id>`: a directory, or
//! a sparse image file for an image-backed volume. It is ready to use at
//! once. A volume with snapshots can be deleted, and a snapshot outlives
//! its volume. The snapshot ID is derived from the name, so a repeated
//! CreateSnapshot finds the snapshot it made before.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::time::{SystemTime, UNIX_EPOCH};

use berth_proto::csi::v1::list_snapshots_response::Entry;
use berth_proto::csi::v1::*;

use crate::copy;
use crate::error::{require, Error};
use crate::plugin::Plugin;
use crate::state::{self, Backing, SnapshotRecord};

/// The CSI form of a snapshot record.
pub fn snapshot_of(record: &SnapshotRecord) -> Snapshot {
    Snapshot {
        size_bytes: record.size_bytes,
        snapshot_id: record.snapshot_id.clone(),
        source_volume_id: record.source_volume_id.clone(),
        creation_time: Some(prost_types::Timestamp {
            seconds: record.created_secs,
            nanos: record.created_nanos,
        }),
        ready_to_use: true,
        group_snapshot_id: String::new(),
    }
}

/// Refuses names with control characters (they end up in logs and paths'
/// neighbours); every other non-empty name is fine.
pub fn check_name(name: &str) -> Result<(), Error> {
    if name
        .chars()
        .any(|c| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))
    {
        return Err(Error::invalid(
            "name",
            "must not contain control characters",
        ));
    }
    Ok(())
}

impl Plugin {
    pub(crate) async fn snapshot_volume(
        &self,
        req: CreateSnapshotRequest,
    ) -> Result<CreateSnapshotResponse, Error> {
        let name = require(&req.name, "name")?.to_owned();
        check_name(&name)?;
        let source = require(&req.source_volume_id, "source_volume_id")?.to_owned();
        let snapshot_id = state::snapshot_id_for(&name);
        let _guard = self.begin("CreateSnapshot", &snapshot_id).await?;
        if !state::is_volume_id(&source) {
            return Err(Error::NotFound(format!(
                "source volume {source} does not exist"
            )));
        }

        let state_dir = self.state_dir().to_owned();
        let parameters: BTreeMap<String, String> = req.parameters.into_iter().collect();
        let (id, wanted_name, wanted_source) = (snapshot_id.clone(), name.clone(), source.clone());
        // Checked and copied under the state lock: the source cannot be
        // deleted meanwhile, and two instances taking the same snapshot at
        // once agree on one.
        let (record, fresh) = self
            .store()
            .update(move |s| {
                if let Some(existing) = s.snapshots.get(&id) {
                    if existing.name != wanted_name {
                        return Err(Error::AlreadyExists(format!(
                            "snapshot ID {id} of name {wanted_name:?} is taken by snapshot {:?}",
                            existing.name
                        )));
                    }
                    if existing.source_volume_id != wanted_source {
                        return Err(Error::AlreadyExists(format!(
                            "snapshot {wanted_name:?} exists of volume {}, not of volume \
                             {wanted_source}",
                            existing.source_volume_id
                        )));
                    }
                    return Ok((existing.clone(), false));
                }
                let volume = s.volumes.get(&wanted_source).ok_or_else(|| {
                    Error::NotFound(format!("source volume {wanted_source} does not exist"))
                })?;
                let from = state::volume_data_path(&state_dir, volume);
                if volume.backing == Backing::Image {
                    // Push what a mounted image's filesystem holds in the
                    // page cache to the file before it is read.
                    nix::unistd::sync();
                }
                let to = state::snapshot_path(&state_dir, &id);
                // A copy with no record is left over from an attempt whose
                // state was never saved.
                copy::remove_data(&to)?;
                copy::copy_data(&from, &to)?;
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                let record = SnapshotRecord {
                    snapshot_id: id.clone(),
                    name: wanted_name,
                    source_volume_id: wanted_source,
                    size_bytes: volume.capacity_bytes,
                    created_secs: i64::try_from(now.as_secs()).unwrap_or(i64::MAX),
                    created_nanos: now.subsec_nanos() as i32,
                    backing: volume.backing,
                    parameters,
                };
                s.snapshots.insert(id, record.clone());
                Ok((record, true))
            })
            .await?;
        if fresh {
            tracing::info!(%name, %snapshot_id, volume_id = %source, size_bytes = record.size_bytes, "created snapshot");
        } else {
            tracing::info!(%name, %snapshot_id, volume_id = %source, "snapshot already exists");
        }
        Ok(CreateSnapshotResponse {
            snapshot: Some(snapshot_of(&record)),
        })
    }

    pub(crate) async fn remove_snapshot(
        &self,
        req: DeleteSnapshotRequest,
    ) -> Result<DeleteSnapshotResponse, Error> {
        let snapshot_id = require(&req.snapshot_id, "snapshot_id")?.to_owned();
        let _guard = self.begin("DeleteSnapshot", &snapshot_id).await?;
        if !state::is_volume_id(&snapshot_id) {
            tracing::info!(%snapshot_id, "snapshot does not exist; nothing to delete");
            return Ok(DeleteSnapshotResponse {});
        }
        let path = state::snapshot_path(self.state_dir(), &snapshot_id);
        let id = snapshot_id.clone();
        let removed = self
            .store()
            .update(move |s| {
                copy::remove_data(&path)?;
                Ok(s.snapshots.remove(&id))
            })
            .await?;
        match removed {
            Some(r) => tracing::info!(%snapshot_id, name = %r.name, "deleted snapshot"),
            None => tracing::info!(%snapshot_id, "snapshot does not exist; nothing to delete"),
        }
        Ok(DeleteSnapshotResponse {})
    }

    pub(crate) async fn list_snapshot_page(
        &self,
        req: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, Error> {
        self.inject("ListSnapshots").await?;
        let max = match req.max_entries {
            n if n < 0 => return Err(Error::invalid("max_entries", "must not be negative")),
            0 => usize::MAX,
            n => n as usize,
        };
        let start = req.starting_token;
        // Tokens are the ID of the first snapshot of the next page.
        if !start.is_empty() && !state::is_volume_id(&start) {
            return Err(Error::BadToken(start));
        }
        let (only_id, only_source) = (req.snapshot_id, req.source_volume_id);
        let (entries, next_token) = self
            .store()
            .read(move |s| {
                let mut matching = s
                    .snapshots
                    .range::<str, _>((Bound::Included(start.as_str()), Bound::Unbounded))
                    .map(|(_, r)| r)
                    .filter(|r| only_id.is_empty() || r.snapshot_id == only_id)
                    .filter(|r| only_source.is_empty() || r.source_volume_id == only_source);
                let entries: Vec<Entry> = matching
                    .by_ref()
                    .take(max)
                    .map(|r| Entry {
                        snapshot: Some(snapshot_of(r)),
                    })
                    .collect();
                let next = matching
                    .next()
                    .map(|r| r.snapshot_id.clone())
                    .unwrap_or_default();
                (entries, next)
            })
            .await?;
        Ok(ListSnapshotsResponse {
            entries,
            next_token,
        })
    }

    pub(crate) async fn find_snapshot(
        &self,
        req: GetSnapshotRequest,
    ) -> Result<GetSnapshotResponse, Error> {
        let snapshot_id = require(&req.snapshot_id, "snapshot_id")?.to_owned();
        self.inject("GetSnapshot").await?;
        let record = self.lookup_snapshot(&snapshot_id).await?;
        Ok(GetSnapshotResponse {
            snapshot: Some(snapshot_of(&record)),
        })
    }

    /// The record of a snapshot, as the shared state has it now.
    pub async fn lookup_snapshot(&self, snapshot_id: &str) -> Result<SnapshotRecord, Error> {
        let not_found = || Error::NotFound(format!("snapshot {snapshot_id} does not exist"));
        if !state::is_volume_id(snapshot_id) {
            return Err(not_found());
        }
        let id = snapshot_id.to_owned();
        self.store()
            .read(move |s| s.snapshots.get(&id).cloned())
            .await?
            .ok_or_else(not_found)
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use berth_proto::csi::v1::volume_capability::access_mode::Mode;
    use berth_proto::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
    use tonic::Code;

    use super::*;
    use crate::config::Config;

    fn plugin(dir: &std::path::Path) -> Plugin {
        Plugin::new(&Config {
            socket_path: dir.join("csi.sock"),
            state_dir: dir.join("state"),
            node_id: "node-1".into(),
            ..Default::default()
        })
        .unwrap()
    }

    async fn volume(p: &Plugin, name: &str) -> String {
        let id = state::volume_id_for(name);
        let req = CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 1 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(AccessMode {
                    mode: Mode::SingleNodeWriter as i32,
                }),
            }],
            ..Default::default()
        };
        let created = p.create(req).await.unwrap().volume.unwrap();
        assert_eq!(created.volume_id, id);
        id
    }

    fn snap(name: &str, source: &str) -> CreateSnapshotRequest {
        CreateSnapshotRequest {
            name: name.into(),
            source_volume_id: source.into(),
            ..Default::default()
        }
    }

    fn code<T>(r: Result<T, Error>) -> Code {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.code(),
        }
    }

    #[tokio::test]
    async fn a_snapshot_is_an_idempotent_independent_copy() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path());
        let vol = volume(&p, "v").await;
        let data = p.volume_dir(&vol);
        fs::write(data.join("f.txt"), b"before").unwrap();

        let s1 = p
            .snapshot_volume(snap("s1", &vol))
            .await
            .unwrap()
            .snapshot
            .unwrap();
        assert_eq!(s1.snapshot_id, state::snapshot_id_for("s1"));
        assert_eq!(s1.source_volume_id, vol);
        assert!(s1.ready_to_use);
        assert_eq!(s1.size_bytes, 1 << 20);
        assert!(s1.creation_time.as_ref().unwrap().seconds > 0);
        let copy = state::snapshot_path(p.state_dir(), &s1.snapshot_id);
        assert_eq!(fs::read(copy.join("f.txt")).unwrap(), b"before");

        // Later writes to the volume do not reach the snapshot, and a
        // repeated CreateSnapshot answers the snapshot taken before.
        fs::write(data.join("f.txt"), b"after").unwrap();
        let again = p
            .snapshot_volume(snap("s1", &vol))
            .await
            .unwrap()
            .snapshot
            .unwrap();
        assert_eq!(again, s1);
        assert_eq!(fs::read(copy.join("f.txt")).unwrap(), b"before");

        let other = volume(&p, "w").await;
        assert_eq!(
            code(p.snapshot_volume(snap("s1", &other)).await),
            Code::AlreadyExists
        );
        assert_eq!(
            code(
                p.snapshot_volume(snap("s2", &state::volume_id_for("nope")))
                    .await
            ),
            Code::NotFound
        );
        assert_eq!(
            code(p.snapshot_volume(snap("s2", "../../etc")).await),
            Code::NotFound
        );
        assert_eq!(
            code(p.snapshot_volume(snap("", &vol)).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(p.snapshot_volume(snap("s2", "")).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(p.snapshot_volume(snap("bad\u{1}", &vol)).await),
            Code::InvalidArgument
        );

        let got = p
            .find_snapshot(GetSnapshotRequest {
                snapshot_id: s1.snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(got.snapshot.unwrap(), s1);
    }

    #[tokio::test]
    async fn snapshots_outlive_their_volume_and_delete_idempotently() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path());
        let vol = volume(&p, "v").await;
        fs::write(p.volume_dir(&vol).join("f.txt"), b"kept").unwrap();
        let s = p
            .snapshot_volume(snap("s", &vol))
            .await
            .unwrap()
            .snapshot
            .unwrap();
        p.delete(DeleteVolumeRequest {
            volume_id: vol.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        let copy = state::snapshot_path(p.state_dir(), &s.snapshot_id);
        assert_eq!(fs::read(copy.join("f.txt")).unwrap(), b"kept");

        let del = |id: &str| DeleteSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        p.remove_snapshot(del(&s.snapshot_id)).await.unwrap();
        assert!(!copy.exists());
        p.remove_snapshot(del(&s.snapshot_id)).await.unwrap();
        p.remove_snapshot(del("not-a-snapshot")).await.unwrap();
        assert_eq!(
            code(p.remove_snapshot(del("")).await),
            Code::InvalidArgument
        );
        let get = |id: &str| GetSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        assert_eq!(
            code(p.find_snapshot(get(&s.snapshot_id)).await),
            Code::NotFound
        );
        assert_eq!(code(p.find_snapshot(get("")).await), Code::InvalidArgument);
    }

    #[tokio::test]
    async fn list_pages_and_filters() {
        let dir = tempfile::tempdir().unwrap();
        let p = plugin(dir.path());
        let (a, b) = (volume(&p, "a").await, volume(&p, "b").await);
        let mut of_a = Vec::new();
        for i in 0..4 {
            let s = p.snapshot_volume(snap(&format!("a{i}"), &a)).await.unwrap();
            of_a.push(s.snapshot.unwrap().snapshot_id);
        }
        let of_b = p
            .snapshot_volume(snap("b0", &b))
            .await
            .unwrap()
            .snapshot
            .unwrap()
            .snapshot_id;
        of_a.sort();

        let list = |max: i32, token: &str, source: &str, id: &str| ListSnapshotsRequest {
            max_entries: max,
            starting_token: token.into(),
            source_volume_id: source.into(),
            snapshot_id: id.into(),
            ..Default::default()
        };
        let ids = |r: &ListSnapshotsResponse| -> Vec<String> {
            r.entries
                .iter()
                .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
                .collect()
        };

        let all = p.list_snapshot_page(list(0, "", "", "")).await.unwrap();
        assert_eq!(all.entries.len(), 5);
        assert!(all.next_token.is_empty());

        let mut seen = Vec::new();
        let mut token = String::new();
        let mut pages = 0;
        loop {
            let page = p.list_snapshot_page(list(3, &token, &a, "")).await.unwrap();
            pages += 1;
            seen.extend(ids(&page));
            if page.next_token.is_empty() {
                break;
            }
            token = page.next_token;
        }
        assert_eq!((seen, pages), (of_a.clone(), 2));

        let one = p.list_snapshot_page(list(0, "", "", &of_b)).await.unwrap();
        assert_eq!(ids(&one), std::slice::from_ref(&of_b));
        let none = p.list_snapshot_page(list(0, "", &a, &of_b)).await.unwrap();
        assert!(none.entries.is_empty());
        let unknown = p
            .list_snapshot_page(list(0, "", "", &state::snapshot_id_for("zz")))
            .await
            .unwrap();
        assert!(unknown.entries.is_empty());

        assert_eq!(
            code(p.list_snapshot_page(list(0, "garbage", "", "")).await),
            Code::Aborted
        );
        assert_eq!(
            code(p.list_snapshot_page(list(-1, "", "", "")).await),
            Code::InvalidArgument
        );
    }
}
