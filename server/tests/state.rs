//! The state store persists to redb and loads back; a corrupt record is
//! quarantined, never fatal.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_server::state::{RedbBackend, SCHEMA_VERSION};
use berth_server::{Server, Table};
use berth_structs::{AccessMode, JobType};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use support::*;

#[tokio::test]
async fn state_survives_a_restart_with_its_indexes() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let (jobs, allocs, nodes, volumes, index, alloc_index) = {
        let server = Server::open(test_config(dir.path())).unwrap();
        server.register_node(node("n1")).await.unwrap();
        give_plugin(&server, "n1", "hostpath", true, false, false).await;
        server
            .register_volume(volume("data", "hostpath", &[AccessMode::SingleNodeWriter]))
            .await
            .unwrap();
        server
            .register_job(job("web", JobType::Service, 2))
            .await
            .unwrap();
        assert_eq!(server.job_allocations("web").unwrap().len(), 2);
        (
            server.jobs(),
            server.allocations(),
            server.nodes(),
            server.volumes(),
            server.index(),
            server.table_index(Table::Allocs),
        )
    };
    assert!(index > 0);
    let server = Server::open(test_config(dir.path())).unwrap();
    assert_eq!(server.jobs(), jobs);
    assert_eq!(server.allocations(), allocs);
    assert_eq!(server.nodes(), nodes);
    assert_eq!(server.volumes(), volumes);
    assert_eq!(server.index(), index);
    assert_eq!(server.table_index(Table::Allocs), alloc_index);
    // Secrets survive on disk (the plugin needs them) but reads strip them.
    assert!(server.volume("data").unwrap().secrets.is_empty());
    // The index keeps growing from where it was.
    server
        .register_job(job("batch", JobType::Batch, 1))
        .await
        .unwrap();
    assert!(server.index() > index);
    assert!(server.quarantined_records().unwrap().is_empty());
}

#[tokio::test]
async fn corrupt_record_is_quarantined_not_fatal() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    {
        let server = Server::open(test_config(dir.path())).unwrap();
        server
            .register_job(job("good", JobType::Service, 1))
            .await
            .unwrap();
    }
    // Corrupt the store behind the server's back: one undecodable job and
    // one whose ID does not match its key.
    let path = RedbBackend::path_in(dir.path());
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn
                .open_table(TableDefinition::<&str, &[u8]>::new("jobs"))
                .unwrap();
            t.insert("broken", b"{not json".as_slice()).unwrap();
            let other = serde_json::to_vec(&job("someone-else", JobType::Service, 1)).unwrap();
            t.insert("liar", other.as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }
    let server = Server::open(test_config(dir.path())).unwrap();
    let ids: Vec<String> = server.jobs().into_iter().map(|j| j.id).collect();
    assert_eq!(ids, vec!["good".to_string()]);
    let q = server.quarantined_records().unwrap();
    let keys: Vec<&str> = q.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(q.len(), 2, "quarantined: {keys:?}");
    assert!(keys.iter().any(|k| k.starts_with("jobs/broken/")));
    assert!(keys.iter().any(|k| k.starts_with("jobs/liar/")));
    let broken = q
        .iter()
        .find(|r| r.key.starts_with("jobs/broken/"))
        .unwrap();
    assert_eq!(broken.value, b"{not json");
    drop(server);

    // The bad records left the jobs table: the next open is clean.
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_read().unwrap();
        let t = txn
            .open_table(TableDefinition::<&str, &[u8]>::new("jobs"))
            .unwrap();
        let keys: Vec<String> = t
            .iter()
            .unwrap()
            .map(|r| r.unwrap().0.value().to_string())
            .collect();
        assert_eq!(keys, vec!["good".to_string()]);
        let meta = txn
            .open_table(TableDefinition::<&str, u64>::new("meta"))
            .unwrap();
        assert_eq!(
            meta.get("schema_version").unwrap().unwrap().value(),
            SCHEMA_VERSION
        );
    }
    let server = Server::open(test_config(dir.path())).unwrap();
    assert_eq!(server.jobs().len(), 1);
}

#[tokio::test]
async fn newer_schema_is_refused_with_a_clear_error() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    drop(Server::open(test_config(dir.path())).unwrap());
    let path = RedbBackend::path_in(dir.path());
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn
                .open_table(TableDefinition::<&str, u64>::new("meta"))
                .unwrap();
            t.insert("schema_version", SCHEMA_VERSION + 1).unwrap();
        }
        txn.commit().unwrap();
    }
    let err = Server::open(test_config(dir.path()))
        .err()
        .expect("open must fail");
    assert!(
        err.to_string().contains("newer than this berth supports"),
        "{err}"
    );
}

#[tokio::test]
async fn a_full_disk_fails_writes_clearly_and_they_work_again_once_space_is_freed() {
    init_tracing();
    let disk = berth_testutil::SmallDisk::new("4m");
    let server = Server::open(test_config(disk.path())).unwrap();
    server.register_node(node("n1")).await.unwrap();
    let fill = disk.fill();

    let mut big = job("big", JobType::Batch, 1);
    big.meta.insert("blob".into(), "x".repeat(512 * 1024));
    let err = server
        .register_job(big)
        .await
        .expect_err("the disk is full");
    assert!(
        err.to_string().contains("No space left on device"),
        "the error names the cause: {err}"
    );
    // Later writes fail too, but the server stays up and consistent.
    assert!(server
        .register_job(job("during", JobType::Batch, 1))
        .await
        .is_err());
    assert!(server.job("big").is_err() && server.job("during").is_err());

    std::fs::remove_file(fill).unwrap();
    server
        .register_job(job("after", JobType::Batch, 1))
        .await
        .expect("writes work again once space is freed");
    drop(server);
    let server = Server::open(test_config(disk.path())).unwrap();
    assert!(server.job("after").is_ok());
    assert!(server.job("big").is_err());
}
