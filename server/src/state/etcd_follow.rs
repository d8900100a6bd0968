//! Every server on etcd keeps its tables current from one etcd watch of
//! the prefix, from the revision of its last load: each transaction the
//! leader committed arrives as the events of one revision, which become
//! one write applied with the index the leader gave it
//! ([`StateStore::apply_replicated`]). The leader's own writes are already
//! applied and are left. A watch that broke (etcd out of reach) starts
//! again from the last revision it saw; one whose revisions etcd compacted
//! away loads the whole state again and goes on from there.
//!
//! The watch runs on the etcd client's runtime and hands the writes to a
//! thread of its own, since applying one waits for the store's writer,
//! which may be waiting on etcd.
//!
//! A server that does not lead answers from these tables only while they
//! are known to be current ([`Freshness`]): every second it reads the
//! index of the leader's last write from etcd (a linearizable read) and
//! waits until it has applied it. A server cut off from etcd stops being
//! current within [`FRESH_FOR`], and what it served from its tables ends.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use super::etcd_backend::{StoredKey, META_INDEX};
use super::record::usable_node_secret;
use super::{Change, StateStore};
use crate::etcd::{EtcdClient, Event, EventType, WatchResponse};
use crate::keyring::Keyring;

/// What the watch hands the applying thread.
enum Feed {
    /// One write of the leader's.
    Write { index: u64, changes: Vec<Change> },
    /// Load everything again (the watch's revisions were compacted away);
    /// answer the revision of the load.
    Reload(oneshot::Sender<Option<i64>>),
}

/// How long a confirmation that a server's tables hold every write
/// etcd had keeps them current.
pub const FRESH_FOR: Duration = Duration::from_secs(5);

/// How often a server confirms that its tables are current.
const CONFIRM_EVERY: Duration = Duration::from_secs(1);

/// Whether a server's tables hold every write the leader made: confirmed
/// against etcd (see the module).
pub struct Freshness {
    client: EtcdClient,
    /// When the tables last held every write etcd had, if ever.
    confirmed: std::sync::Mutex<Option<Instant>>,
    /// Whether that was within [`FRESH_FOR`].
    current: watch::Sender<bool>,
}

impl Freshness {
    fn new(client: EtcdClient) -> Freshness {
        Freshness {
            client,
            confirmed: std::sync::Mutex::new(None),
            current: watch::channel(false).0,
        }
    }

    /// Whether the tables are current: they held every write etcd had
    /// within [`FRESH_FOR`]. Changes as confirmations come and lapse.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.current.subscribe()
    }

    pub fn is_current(&self) -> bool {
        *self.current.borrow()
    }

    /// Waits until `store` holds every write etcd had when this was
    /// called, at most `within`; why not, if it does not.
    pub async fn confirm(&self, store: &StateStore, within: Duration) -> Result<(), String> {
        let asked = Instant::now();
        let (tx, rx) = oneshot::channel();
        let client = self.client.clone();
        self.client.spawn(async move {
            let read = tokio::time::timeout(within, client.get(client.key(META_INDEX))).await;
            let _ = tx.send(read);
        });
        let index = match rx.await {
            Ok(Ok(Ok(kv))) => kv.map_or(Some(0), |kv| {
                String::from_utf8_lossy(&kv.value).parse::<u64>().ok()
            }),
            Ok(Ok(Err(e))) => return Err(format!("reading the leader's last index: {e}")),
            Ok(Err(_)) | Err(_) => {
                return Err(format!(
                    "etcd gave no answer within {}",
                    humantime::format_duration(within)
                ))
            }
        }
        .ok_or_else(|| format!("etcd's {META_INDEX} is not a number"))?;
        let left = within.saturating_sub(asked.elapsed());
        let applied = match store.index() {
            i if i >= index => i,
            _ => store.wait_for_index(index - 1, left).await,
        };
        if applied < index {
            return Err(format!(
                "this server has applied the leader's writes up to index {applied}, not yet \
                 {index}"
            ));
        }
        let mut confirmed = self.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        if confirmed.is_none_or(|c| c < asked) {
            *confirmed = Some(asked);
        }
        drop(confirmed);
        self.current
            .send_if_modified(|c| !std::mem::replace(c, true));
        Ok(())
    }

    /// Marks the tables not current once the last confirmation is older
    /// than [`FRESH_FOR`].
    fn lapse(&self) {
        let confirmed = *self.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        if confirmed.is_none_or(|c| c.elapsed() > FRESH_FOR) {
            self.current
                .send_if_modified(|c| std::mem::replace(c, false));
        }
    }

    /// Confirms every [`CONFIRM_EVERY`] until `stop` turns true.
    async fn keep(self: Arc<Self>, store: Arc<StateStore>, mut stop: watch::Receiver<bool>) {
        let mut failures = 0u32;
        loop {
            match self.confirm(&store, FRESH_FOR).await {
                Ok(()) => failures = 0,
                Err(why) => {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(60) {
                        tracing::warn!(error = %why, "this server could not confirm that its state is current");
                    }
                }
            }
            self.lapse();
            tokio::select! {
                _ = tokio::time::sleep(CONFIRM_EVERY) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

/// Keeps a store current with the writes the leader makes in etcd.
pub struct Follower {
    client: EtcdClient,
    keyring: Arc<Keyring>,
    /// The revision of the backend's last load.
    loaded_revision: Arc<AtomicI64>,
    freshness: Arc<Freshness>,
}

impl Follower {
    pub(super) fn new(
        client: EtcdClient,
        keyring: Arc<Keyring>,
        loaded_revision: Arc<AtomicI64>,
    ) -> Follower {
        Follower {
            freshness: Arc::new(Freshness::new(client.clone())),
            client,
            keyring,
            loaded_revision,
        }
    }

    /// Whether the store this follows into is current (see the module).
    pub fn freshness(&self) -> Arc<Freshness> {
        self.freshness.clone()
    }

    /// Follows the leader's writes into `store` until `stop` turns true.
    pub fn start(self, store: Arc<StateStore>, stop: watch::Receiver<bool>) {
        let (feed, fed) = std::sync::mpsc::channel::<Feed>();
        let loaded = self.loaded_revision.clone();
        let applying = store.clone();
        let applier = std::thread::Builder::new()
            .name("berth-etcd-apply".into())
            .spawn(move || apply_all(&applying, &loaded, &fed));
        if let Err(e) = applier {
            tracing::error!(error = %e, "starting the thread that follows etcd failed");
            return;
        }
        let client = self.client.clone();
        client.spawn(self.freshness.clone().keep(store, stop.clone()));
        client.spawn(async move { self.watch(feed, stop).await });
    }

    async fn watch(self, feed: std::sync::mpsc::Sender<Feed>, mut stop: watch::Receiver<bool>) {
        let mut from = self.loaded_revision.load(Ordering::SeqCst) + 1;
        let mut quiet_errors = 0u32;
        while !*stop.borrow() {
            let outcome = tokio::select! {
                outcome = self.follow_from(from, &feed) => outcome,
                _ = stop.wait_for(|s| *s) => return,
            };
            match outcome {
                Followed::Compacted => {
                    tracing::warn!(
                        from,
                        "the etcd watch fell behind a compaction; loading the state again"
                    );
                    let (answer, reloaded) = oneshot::channel();
                    if feed.send(Feed::Reload(answer)).is_err() {
                        return;
                    }
                    match reloaded.await {
                        Ok(Some(revision)) => from = revision + 1,
                        Ok(None) => tokio::time::sleep(Duration::from_secs(1)).await,
                        Err(_) => return,
                    }
                }
                Followed::Broke { next, error } => {
                    from = next;
                    quiet_errors += 1;
                    if quiet_errors == 1 || quiet_errors.is_multiple_of(20) {
                        tracing::warn!(from, error = %error, "the etcd watch broke; starting it again");
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Followed::Stopped => return,
            }
        }
    }

    /// Follows from revision `from` until the watch breaks.
    async fn follow_from(&self, from: i64, feed: &std::sync::mpsc::Sender<Feed>) -> Followed {
        let mut answers = match self.client.watch_prefix(&self.client.prefix(), from).await {
            Ok(a) => a,
            Err(e) => {
                return Followed::Broke {
                    next: from,
                    error: e.to_string(),
                }
            }
        };
        let mut next = from;
        loop {
            let answer: WatchResponse = match answers.message().await {
                Ok(Some(a)) => a,
                Ok(None) => {
                    return Followed::Broke {
                        next,
                        error: "the watch ended".into(),
                    }
                }
                Err(status) => {
                    return Followed::Broke {
                        next,
                        error: self.client.watch_error(status).to_string(),
                    }
                }
            };
            if answer.compact_revision > 0 {
                return Followed::Compacted;
            }
            if answer.canceled {
                return Followed::Broke {
                    next,
                    error: format!("etcd canceled the watch: {}", answer.cancel_reason),
                };
            }
            for (revision, events) in by_revision(&answer.events) {
                if let Some(write) = self.write_of(events) {
                    if feed.send(write).is_err() {
                        return Followed::Stopped;
                    }
                }
                next = revision + 1;
            }
            if let (true, false, Some(h)) =
                (answer.events.is_empty(), answer.created, &answer.header)
            {
                // A progress notice: every revision up to this one was
                // delivered.
                next = next.max(h.revision + 1);
            }
            if let Some(h) = &answer.header {
                let behind = h.revision.saturating_sub(next - 1).max(0);
                berth_metrics::metrics().etcd_watch_lag.set(behind);
            }
        }
    }

    /// The write one revision's events make, if they are one of berth's
    /// (the leader key's and the lease's come and go unseen).
    fn write_of(&self, events: &[Event]) -> Option<Feed> {
        let prefix = self.client.prefix();
        let mut index = None;
        let mut changes = Vec::new();
        for event in events {
            let kv = event.kv.as_ref()?;
            let put = event.r#type == EventType::Put as i32;
            match StoredKey::of(&prefix, &kv.key) {
                StoredKey::Meta(path) if path == META_INDEX => {
                    index = String::from_utf8_lossy(&kv.value).parse::<u64>().ok();
                }
                StoredKey::NodeSecret(node_id) if put => {
                    if let Some(secret) = usable_node_secret(&node_id, &kv.value, &self.keyring) {
                        changes.push(Change::PutNodeSecret { node_id, secret });
                    }
                }
                // One that does not decode is reported, and left out.
                StoredKey::Record(table, key) if put => {
                    changes.extend(Change::decoded(table, &key, &kv.value, &self.keyring));
                }
                StoredKey::Record(table, key) => changes.push(Change::deletion(table, key)),
                _ => {}
            }
        }
        Some(Feed::Write {
            index: index?,
            changes,
        })
    }
}

/// How following ended.
enum Followed {
    /// The revisions from where it started are gone.
    Compacted,
    /// The watch broke; go on from `next`.
    Broke { next: i64, error: String },
    /// The store is gone.
    Stopped,
}

/// The events of one answer by revision: one transaction each.
fn by_revision(events: &[Event]) -> Vec<(i64, &[Event])> {
    let revision = |e: &Event| e.kv.as_ref().map_or(0, |kv| kv.mod_revision);
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=events.len() {
        if i == events.len() || revision(&events[i]) != revision(&events[start]) {
            out.push((revision(&events[start]), &events[start..i]));
            start = i;
        }
    }
    out
}

/// Applies what the watch hands over, until it stops.
fn apply_all(store: &StateStore, loaded: &AtomicI64, fed: &std::sync::mpsc::Receiver<Feed>) {
    while let Ok(feed) = fed.recv() {
        match feed {
            Feed::Write { index, changes } => {
                store.apply_replicated(index, changes);
            }
            Feed::Reload(answer) => {
                let reloaded = match store.reload() {
                    Ok(index) => {
                        tracing::info!(index, "loaded the state from etcd again");
                        Some(loaded.load(Ordering::SeqCst))
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "loading the state from etcd again failed");
                        None
                    }
                };
                let _ = answer.send(reloaded);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Two stores on one etcd prefix, the second following the first's
    //! writes (`berth_testutil::etcd`).

    use std::time::Instant;

    use berth_structs::{Job, Node, NodeSecret};
    use berth_testutil::etcd::Etcd;

    use super::*;
    use crate::etcd::EtcdConfig;
    use crate::state::{EtcdBackend, StoreError, Table};

    fn store(etcd: &Etcd, keyring: &std::path::Path) -> (Arc<StateStore>, Follower, EtcdClient) {
        let client = EtcdClient::new(EtcdConfig {
            prefix: "/f".into(),
            request_timeout: Duration::from_secs(2),
            ..EtcdConfig::new(vec![etcd.endpoint()])
        })
        .unwrap();
        let backend = EtcdBackend::open(client.clone(), &keyring.join("keyring")).unwrap();
        let follower = backend.follower();
        (
            Arc::new(StateStore::open(Box::new(backend)).unwrap()),
            follower,
            client,
        )
    }

    fn put(store: &StateStore, changes: Vec<Change>) -> u64 {
        store
            .write(|_, c| {
                c.extend(changes);
                Ok::<_, StoreError>(())
            })
            .unwrap()
            .1
    }

    fn job(id: &str) -> Change {
        Change::PutJob(Job {
            id: id.into(),
            ..Job::default()
        })
    }

    fn wait_index(store: &StateStore, index: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.index() < index {
            assert!(Instant::now() < deadline, "stuck at {}", store.index());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_applies_the_leaders_writes_with_their_indexes_and_wakes_its_readers() {
        let etcd = Etcd::start();
        let keyring = tempfile::tempdir().unwrap();
        let (leader, _, _) = store(&etcd, keyring.path());
        let (follower, following, _) = store(&etcd, keyring.path());
        let (stop, stopped) = watch::channel(false);
        following.start(follower.clone(), stopped);

        let waiter = {
            let follower = follower.clone();
            tokio::spawn(async move {
                follower
                    .wait_for_tables(&[Table::Jobs], 0, Duration::from_secs(30))
                    .await
            })
        };
        let secret = NodeSecret::parse("node-secret-abcdefghijklmnop").unwrap();
        let first = tokio::task::block_in_place(|| {
            put(
                &leader,
                vec![
                    job("web"),
                    Change::PutNode(Node {
                        id: "n1".into(),
                        ..Node::default()
                    }),
                    Change::PutNodeSecret {
                        node_id: "n1".into(),
                        secret: secret.clone(),
                    },
                ],
            )
        });
        let woken = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the follower's blocking query woke")
            .unwrap();
        assert_eq!(woken, first);
        let second = tokio::task::block_in_place(|| {
            put(&leader, vec![Change::DeleteJob("web".into()), job("db")])
        });
        tokio::task::block_in_place(|| wait_index(&follower, second));
        let (l, f) = (
            leader.read(|t| (t.jobs.clone(), t.table_index.clone())),
            follower.read(|t| (t.jobs.clone(), t.table_index.clone())),
        );
        assert_eq!(
            f.0.keys().collect::<Vec<_>>(),
            l.0.keys().collect::<Vec<_>>()
        );
        assert_eq!(f.0["db"].modify_index, second);
        assert_eq!(f.1[&Table::Jobs], l.1[&Table::Jobs]);
        follower.read(|t| {
            assert_eq!(t.node_secrets["n1"].expose(), secret.expose());
            assert!(t.nodes.contains_key("n1"));
        });
        let _ = stop.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_behind_a_compaction_loads_again_and_goes_on() {
        let etcd = Etcd::start();
        let keyring = tempfile::tempdir().unwrap();
        let (leader, _, client) = store(&etcd, keyring.path());
        // Loaded before the leader's writes, following only after etcd
        // compacted them away.
        let (follower, following, _) = store(&etcd, keyring.path());
        let last = tokio::task::block_in_place(|| {
            for i in 0..5 {
                put(&leader, vec![job(&format!("j{i}"))]);
            }
            put(&leader, vec![Change::DeleteJob("j0".into())])
        });
        let c = client.clone();
        let revision = client
            .block_on(async move {
                let (_, revision) = c.range_prefix(&c.prefix()).await?;
                c.compact(revision).await?;
                Ok(revision)
            })
            .unwrap();
        assert!(revision > 0);
        let (stop, stopped) = watch::channel(false);
        following.start(follower.clone(), stopped);
        tokio::task::block_in_place(|| wait_index(&follower, last));
        follower.read(|t| assert_eq!(t.jobs.len(), 4));
        // And it follows what comes after.
        let next = tokio::task::block_in_place(|| put(&leader, vec![job("after")]));
        tokio::task::block_in_place(|| wait_index(&follower, next));
        follower.read(|t| assert!(t.jobs.contains_key("after")));
        let _ = stop.send(true);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_is_current_only_while_it_confirms_with_etcd() {
        let etcd = Etcd::start();
        let keyring = tempfile::tempdir().unwrap();
        let (leader, _, _) = store(&etcd, keyring.path());
        let (follower, following, _) = store(&etcd, keyring.path());
        let freshness = following.freshness();
        assert!(!freshness.is_current());

        // Not following yet: the leader's write is not applied, and the
        // barrier says so.
        let written = tokio::task::block_in_place(|| put(&leader, vec![job("web")]));
        let e = freshness
            .confirm(&follower, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.contains(&format!("not yet {written}")), "{e}");

        let (stop, stopped) = watch::channel(false);
        following.start(follower.clone(), stopped);
        freshness
            .confirm(&follower, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(follower.index() >= written);
        follower.read(|t| assert!(t.jobs.contains_key("web")));
        let mut current = freshness.subscribe();
        tokio::time::timeout(Duration::from_secs(10), current.wait_for(|c| *c))
            .await
            .expect("current while etcd answers")
            .unwrap();

        // Cut off from etcd: no longer current once the last confirmation
        // is FRESH_FOR old, and current again once etcd answers.
        etcd.pause();
        let cut = Instant::now();
        let lapsed = tokio::time::timeout(FRESH_FOR * 3, current.wait_for(|c| !*c)).await;
        let after = cut.elapsed();
        etcd.resume();
        lapsed.expect("no longer current without etcd").unwrap();
        assert!(
            after + CONFIRM_EVERY * 2 >= FRESH_FOR,
            "lapsed after {after:?}"
        );
        tokio::time::timeout(Duration::from_secs(20), current.wait_for(|c| *c))
            .await
            .expect("current again")
            .unwrap();
        let _ = stop.send(true);
    }
}
