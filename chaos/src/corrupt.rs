//! A corrupt record in a client's state database, written while its agent
//! is down: one record of one table, chosen by the run's generator,
//! overwritten with bytes that decode as nothing berth writes.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::rng::Rng;

/// The client's tables of records (see `client/src/state.rs`).
const TABLES: [&str; 5] = [
    "allocs",
    "alloc_states",
    "task_handles",
    "csi_volumes",
    "csi_plugins",
];

/// Opens the database, waiting (a few seconds at most) for a lock its
/// agent's processes may still hold; an error names who holds it.
fn open(path: &Path) -> Result<Database> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Database::open(path) {
            Ok(db) => return Ok(db),
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("opening {} (locked by {})", path.display(), lockers(path))
                })
            }
        }
    }
}

/// The processes holding a lock on `path`, from /proc/locks.
fn lockers(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let Ok(inode) = std::fs::metadata(path).map(|m| m.ino()) else {
        return "?".into();
    };
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let holders: Vec<String> = locks
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (pid, dev) = (f.get(4)?, f.get(5)?);
            (dev.rsplit(':').next()? == inode.to_string()).then(|| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                format!("{pid} {}", String::from_utf8_lossy(&cmd).replace('\0', " "))
            })
        })
        .collect();
    if holders.is_empty() {
        "no process in /proc/locks".into()
    } else {
        holders.join(", ")
    }
}

/// What a corrupt record holds.
const GARBAGE: &[u8] = b"\xff\x00{\"not\": a record";

/// Overwrites one record of the database at `path` (its agent is down);
/// says which, or that there was none.
pub fn corrupt_one(path: &Path, rng: &mut Rng) -> Result<String> {
    let db = open(path)?;
    let mut records = Vec::new();
    {
        let tx = db.begin_read()?;
        for name in TABLES {
            let def: TableDefinition<&str, &[u8]> = TableDefinition::new(name);
            let Ok(table) = tx.open_table(def) else {
                continue;
            };
            for row in table.iter()? {
                let (key, _) = row?;
                records.push((name, key.value().to_string()));
            }
        }
    }
    if records.is_empty() {
        return Ok("no record to corrupt".into());
    }
    let (name, key) = rng.pick(&records).clone();
    let tx = db.begin_write()?;
    {
        let def: TableDefinition<&str, &[u8]> = TableDefinition::new(name);
        let mut table = tx.open_table(def)?;
        table.insert(key.as_str(), GARBAGE)?;
    }
    tx.commit()?;
    Ok(format!("record {name}/{key} corrupted"))
}
