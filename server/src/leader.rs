//! Leadership among the servers that share one etcd (`store = "etcd"`):
//! one of them is the leader, which alone writes and runs the leader work
//! (the scheduler's retries, node liveness, the volume watcher, the
//! drainer, GC); the others stand by.
//!
//! The leader holds `<prefix>/leader`, a key bound to an etcd lease that it
//! keeps alive; the key's create revision is its term. Every write of the
//! store compares that revision ([`Fence`]), so a server that lost the
//! key cannot write, whatever it believes. A server that cannot keep its
//! lease alive gives leadership up by itself once `lease_ttl` minus a
//! margin passed since the last keep-alive it sent that etcd answered,
//! which is before etcd could let the lease expire and grant the key to
//! another server. A server that stops hands the key back at once.
//!
//! With the embedded store there is one server, and it always leads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_sync::MutexExt;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::etcd::{self, EtcdClient, EtcdError};

/// The key the leader holds, under the prefix.
pub const LEADER_KEY: &str = "leader";

/// Where each running server says it is there, under the prefix: a key
/// per agent protocol address (names may repeat), bound to a lease of its
/// own.
const MEMBERS: &str = "members";

/// A server as `berth server members` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    #[serde(flatten)]
    pub identity: ServerIdentity,
    /// Whether it leads now.
    #[serde(default)]
    pub leader: bool,
    /// When it last said it was there (unix ms).
    pub last_contact_ms: i64,
}

/// How a server names itself to the others and to clients.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerIdentity {
    pub name: String,
    /// `HOST:PORT` of its agent protocol.
    pub rpc_addr: String,
    /// `HOST:PORT` of its HTTP API.
    pub http_addr: String,
}

/// What a server is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// It leads, in the term that is the leader key's create revision (0
    /// with the embedded store).
    Leader { term: i64 },
    /// Another server leads (`None`: no leader is known now).
    Standby { leader: Option<ServerIdentity> },
}

impl Role {
    pub fn is_leader(&self) -> bool {
        matches!(self, Role::Leader { .. })
    }
}

/// The term the store's writes are fenced with: `None` while this server
/// does not lead. A write that finds another term in etcd ends it here,
/// and the election gives the term up.
#[derive(Debug, Default)]
pub struct Fence {
    term: std::sync::Mutex<Option<i64>>,
    /// The last term found over, and the wake-up of the election.
    lost_term: std::sync::atomic::AtomicI64,
    lost: tokio::sync::Notify,
}

impl Fence {
    pub fn term(&self) -> Option<i64> {
        *self.term.locked()
    }

    /// `term` is over (a write found another in etcd).
    pub fn lost(&self, term: i64) {
        let mut t = self.term.locked();
        if *t == Some(term) {
            *t = None;
        }
        self.lost_term
            .store(term, std::sync::atomic::Ordering::SeqCst);
        // A permit is kept when the election is not waiting right now.
        self.lost.notify_one();
    }

    /// Waits until `term` is found over.
    async fn wait_lost(&self, term: i64) {
        loop {
            self.lost.notified().await;
            if self.lost_term.load(std::sync::atomic::Ordering::SeqCst) == term {
                return;
            }
        }
    }
}

/// The election of one server: [`Election::run`] campaigns, keeps the
/// lease while it leads and stands by while another does.
pub struct Election {
    client: EtcdClient,
    identity: ServerIdentity,
    fence: Arc<Fence>,
    role: watch::Sender<Role>,
}

/// How often a standby looks whether the key is free.
const CAMPAIGN_INTERVAL: Duration = Duration::from_millis(500);

impl Election {
    pub fn new(client: EtcdClient, identity: ServerIdentity, fence: Arc<Fence>) -> Election {
        Election {
            client,
            identity,
            fence,
            role: watch::channel(Role::Standby { leader: None }).0,
        }
    }

    /// Runs `task` where the lease is kept (the etcd client's runtime).
    pub fn spawn(self: Arc<Self>, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.client.spawn(task);
    }

    /// What this server is, as it changes.
    pub fn subscribe(&self) -> watch::Receiver<Role> {
        self.role.subscribe()
    }

    /// The lease TTL, and how long after the last answered keep-alive a
    /// leader gives up: a margin before the lease could expire.
    fn timing(&self) -> (Duration, Duration, Duration) {
        let ttl = self.client.config().lease_ttl.max(Duration::from_secs(2));
        let margin = (ttl / 5).max(Duration::from_millis(1000));
        let keep_alive_every = ttl / 4;
        (ttl, ttl.saturating_sub(margin), keep_alive_every)
    }

    /// Each etcd member's health.
    pub async fn member_health(&self) -> Vec<crate::etcd::MemberHealth> {
        self.client.member_health().await
    }

    /// The servers that said they are there within their lease, by
    /// name, the leader marked.
    pub async fn members(&self) -> Result<Vec<Member>, EtcdError> {
        let (kvs, _) = self
            .client
            .range_prefix(&self.client.key(&format!("{MEMBERS}/")))
            .await?;
        let leader: Option<ServerIdentity> = self
            .client
            .get(self.client.key(LEADER_KEY))
            .await?
            .and_then(|kv| serde_json::from_slice(&kv.value).ok());
        Ok(kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice::<Member>(&kv.value).ok())
            .map(|mut m| {
                m.leader = leader.as_ref() == Some(&m.identity);
                m
            })
            .collect())
    }

    /// Says this server is there (`<prefix>/members/<rpc addr>`, bound to a
    /// lease of its own, its last contact written every third of the
    /// lease) until `stop` turns true; then takes the key away.
    pub async fn announce(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let (ttl, _, _) = self.timing();
        let key = self
            .client
            .key(&format!("{MEMBERS}/{}", self.identity.rpc_addr));
        let mut lease = None;
        while !*stop.borrow() {
            let announced = async {
                let id = match lease {
                    Some(id) if self.client.lease_keep_alive(id).await? > 0 => id,
                    _ => self.client.lease_grant(ttl).await?,
                };
                lease = Some(id);
                let me = Member {
                    identity: self.identity.clone(),
                    leader: false,
                    last_contact_ms: berth_structs::now_ms(),
                };
                let value = serde_json::to_vec(&me).unwrap_or_default();
                self.client
                    .txn(etcd::TxnRequest {
                        compare: vec![],
                        success: vec![etcd::put_leased(key.clone(), value, id)],
                        failure: vec![],
                    })
                    .await
            };
            if let Err(e) = announced.await {
                lease = None;
                tracing::debug!(error = %e, "announcing this server in etcd failed");
            }
            tokio::select! {
                _ = tokio::time::sleep(ttl / 3) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        if let Some(id) = lease {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), self.client.lease_revoke(id)).await;
        }
    }

    /// Campaigns, leads and stands by until `stop` turns true; then gives
    /// the key back if it holds it.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        while !*stop.borrow() {
            let outcome = tokio::select! {
                outcome = self.term() => outcome,
                _ = stop.wait_for(|s| *s) => break,
            };
            if let Err(e) = outcome {
                self.step_down(None);
                tracing::warn!(error = %e, "leader election: etcd did not answer; trying again");
            }
            tokio::select! {
                _ = tokio::time::sleep(CAMPAIGN_INTERVAL) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        self.resign().await;
    }

    /// One try: campaign, and lead until the lease is lost.
    async fn term(&self) -> Result<(), EtcdError> {
        let (ttl, give_up_after, keep_alive_every) = self.timing();
        let granted_at = Instant::now();
        let lease = self.client.lease_grant(ttl).await?;
        let key = self.client.key(LEADER_KEY);
        let me = serde_json::to_vec(&self.identity).unwrap_or_default();
        let answer = self
            .client
            .txn(etcd::TxnRequest {
                compare: vec![etcd::absent(key.clone())],
                success: vec![etcd::put_leased(key.clone(), me, lease)],
                failure: vec![etcd::get(key.clone())],
            })
            .await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                let _ = self.client.lease_revoke(lease).await;
                return Err(e);
            }
        };
        if !answer.succeeded {
            let leader = etcd::got(&answer).and_then(|kv| serde_json::from_slice(&kv.value).ok());
            self.step_down(leader);
            let _ = self.client.lease_revoke(lease).await;
            return Ok(());
        }
        let term = answer.header.map_or(0, |h| h.revision);
        tracing::info!(term, "this server is the leader");
        self.role.send_replace(Role::Leader { term });
        let mut last_kept = granted_at;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(keep_alive_every) => {}
                _ = self.fence.wait_lost(term) => {
                    tracing::warn!(term, "a write found another leader's term; giving up leadership");
                    break;
                }
            }
            let sent = Instant::now();
            let deadline = (last_kept + give_up_after).saturating_duration_since(sent);
            match tokio::time::timeout(deadline, self.client.lease_keep_alive(lease)).await {
                Ok(Ok(left)) if left > 0 => last_kept = sent,
                Ok(Ok(_)) => {
                    tracing::warn!(term, "the leadership lease expired; giving up leadership");
                    break;
                }
                Ok(Err(e)) if last_kept.elapsed() < give_up_after => {
                    tracing::warn!(term, error = %e, "keeping the leadership lease alive failed; trying again");
                }
                Ok(Err(_)) | Err(_) => {
                    tracing::warn!(term, after = ?last_kept.elapsed(),
                        "the leadership lease was not kept alive in time; giving up leadership");
                    break;
                }
            }
        }
        self.step_down(None);
        // Hand the key back, in case etcd still holds it for us.
        let _ = tokio::time::timeout(ttl, self.client.lease_revoke(lease)).await;
        Ok(())
    }

    /// Arms the fence with `term` if this server still leads in it (the
    /// server calls it once it caught up with the state, before it starts
    /// the leader work); false when the term is already over.
    pub fn confirm(&self, term: i64) -> bool {
        let mut fenced = self.fence.term.locked();
        if *self.role.borrow() == (Role::Leader { term }) {
            *fenced = Some(term);
            true
        } else {
            false
        }
    }

    /// Gives the term up now (the server could not catch up with the
    /// state, say); the election campaigns again.
    pub fn give_up(&self, term: i64) {
        self.fence.lost(term);
    }

    fn step_down(&self, leader: Option<ServerIdentity>) {
        // Under the fence's lock, so that no `confirm` of the term that
        // ends arms it again.
        let mut fenced = self.fence.term.locked();
        *fenced = None;
        let standby = Role::Standby { leader };
        self.role.send_if_modified(|role| {
            if *role == standby {
                return false;
            }
            if role.is_leader() {
                tracing::warn!("this server no longer leads");
            }
            *role = standby;
            true
        });
    }

    /// Gives the key back when this server holds it, so that another
    /// takes over at once.
    async fn resign(&self) {
        let Role::Leader { term } = *self.role.borrow() else {
            return;
        };
        self.step_down(None);
        let key = self.client.key(LEADER_KEY);
        let delete = self.client.txn(etcd::TxnRequest {
            compare: vec![etcd::created_at(key.clone(), term)],
            success: vec![etcd::delete(key)],
            failure: vec![],
        });
        match tokio::time::timeout(Duration::from_secs(2), delete).await {
            Ok(Ok(_)) => tracing::info!(term, "handed leadership back"),
            Ok(Err(e)) => tracing::warn!(term, error = %e, "handing leadership back failed"),
            Err(_) => tracing::warn!(term, "handing leadership back timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against a real etcd member (`berth_testutil::etcd`).

    use berth_testutil::etcd::Etcd;

    use super::*;
    use crate::etcd::EtcdConfig;

    fn client(etcd: &Etcd, prefix: &str, lease_ttl: Duration) -> EtcdClient {
        EtcdClient::new(EtcdConfig {
            prefix: prefix.into(),
            lease_ttl,
            request_timeout: Duration::from_secs(1),
            dial_timeout: Duration::from_millis(500),
            ..EtcdConfig::new(vec![etcd.endpoint()])
        })
        .unwrap()
    }

    struct Running {
        election: Arc<Election>,
        role: watch::Receiver<Role>,
        stop: watch::Sender<bool>,
        task: tokio::task::JoinHandle<()>,
    }

    fn start(c: EtcdClient, name: &str) -> Running {
        let identity = ServerIdentity {
            name: name.into(),
            rpc_addr: format!("{name}:4647"),
            http_addr: format!("{name}:4646"),
        };
        let election = Arc::new(Election::new(c, identity, Arc::new(Fence::default())));
        let (stop, stopped) = watch::channel(false);
        let role = election.subscribe();
        let task = tokio::spawn(election.clone().run(stopped));
        Running {
            election,
            role,
            stop,
            task,
        }
    }

    async fn until(role: &mut watch::Receiver<Role>, within: Duration, f: impl Fn(&Role) -> bool) {
        let reached = tokio::time::timeout(within, role.wait_for(|r| f(r)))
            .await
            .is_ok();
        assert!(reached, "role still {:?} after {within:?}", *role.borrow());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_server_leads_and_another_takes_over_when_it_hands_back() {
        let etcd = Etcd::start();
        let ttl = Duration::from_secs(5);
        let mut a = start(client(&etcd, "/e1", ttl), "a");
        until(&mut a.role, Duration::from_secs(5), Role::is_leader).await;
        let mut b = start(client(&etcd, "/e1", ttl), "b");
        // b stands by, and knows who leads.
        until(
            &mut b.role,
            Duration::from_secs(5),
            |r| matches!(r, Role::Standby { leader: Some(l) } if l.name == "a"),
        )
        .await;
        let Role::Leader { term } = *a.role.borrow() else {
            panic!("a does not lead")
        };
        assert!(a.election.confirm(term));
        assert_eq!(a.election.fence.term(), Some(term));
        assert_eq!(b.election.fence.term(), None);

        // a stops: it hands the key back, and b leads well before a lease
        // could have run out.
        let handed_back = Instant::now();
        a.stop.send(true).unwrap();
        a.task.await.unwrap();
        until(&mut b.role, Duration::from_secs(3), Role::is_leader).await;
        assert!(handed_back.elapsed() < ttl, "{:?}", handed_back.elapsed());
        assert_eq!(a.election.fence.term(), None);
        let Role::Leader { term: next } = *b.role.borrow() else {
            panic!("b does not lead")
        };
        assert!(next > term, "terms grow: {term} then {next}");
        b.stop.send(true).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leader_cut_off_from_etcd_stops_before_its_lease_could_expire() {
        let mut etcd = Etcd::start();
        let ttl = Duration::from_secs(3);
        let mut a = start(client(&etcd, "/e2", ttl), "a");
        until(&mut a.role, Duration::from_secs(5), Role::is_leader).await;
        let Role::Leader { term } = *a.role.borrow() else {
            panic!("a does not lead")
        };
        assert!(a.election.confirm(term));
        let cut = Instant::now();
        etcd.kill();
        until(&mut a.role, ttl, |r| !r.is_leader()).await;
        // The last keep-alive etcd answered was before the cut: the lease
        // lives at least `ttl` from then, and a gave up sooner.
        assert!(cut.elapsed() < ttl, "gave up after {:?}", cut.elapsed());
        assert_eq!(a.election.fence.term(), None);
        // Back with etcd, it campaigns again (and wins, once the old
        // lease is gone).
        etcd.restart();
        until(&mut a.role, Duration::from_secs(15), Role::is_leader).await;
        a.stop.send(true).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_after_the_term_ended_in_etcd_is_refused_and_ends_it_here() {
        use crate::state::{Change, EtcdBackend, StateStore, StoreError};
        let etcd = Etcd::start();
        // A long lease, so that a does not notice by itself.
        let ttl = Duration::from_secs(60);
        let c = client(&etcd, "/e3", ttl);
        let fence = Arc::new(Fence::default());
        let dir = tempfile::tempdir().unwrap();
        let backend = EtcdBackend::open(c.clone(), &dir.path().join("keyring"))
            .unwrap()
            .fenced(fence.clone());
        let store = StateStore::open(Box::new(backend)).unwrap();
        let election = Arc::new(Election::new(c.clone(), ServerIdentity::default(), fence));
        let (stop, stopped) = watch::channel(false);
        let mut role = election.subscribe();
        tokio::spawn(election.clone().run(stopped));
        until(&mut role, Duration::from_secs(5), Role::is_leader).await;
        let Role::Leader { term } = *role.borrow() else {
            panic!("not leading")
        };
        let job = |id: &str| {
            Change::PutJob(berth_structs::Job {
                id: id.into(),
                ..Default::default()
            })
        };
        let write = |id: &'static str| {
            store.write(|_, changes| {
                changes.push(job(id));
                Ok::<_, StoreError>(())
            })
        };
        // Not armed yet: refused without asking etcd.
        let refused = write("early").unwrap_err();
        assert!(matches!(refused, StoreError::NotLeader(_)), "{refused}");
        assert!(election.confirm(term));
        write("mine").expect("the leader writes");

        // The key goes behind a's back (its lease revoked, as if it
        // expired) and another server takes it.
        let key = c.key(LEADER_KEY);
        let other = c.clone();
        let taken = c.block_on(async move {
            let kv = other.get(key.clone()).await?.expect("the leader key");
            other.lease_revoke(kv.lease).await?;
            let lease = other.lease_grant(Duration::from_secs(60)).await?;
            other
                .txn(etcd::TxnRequest {
                    compare: vec![etcd::absent(key.clone())],
                    success: vec![etcd::put_leased(key, b"{}".to_vec(), lease)],
                    failure: vec![],
                })
                .await
        });
        assert!(taken.unwrap().succeeded);
        let refused = write("stale").unwrap_err();
        assert!(matches!(refused, StoreError::NotLeader(_)), "{refused}");
        assert!(refused.is_unavailable());
        until(&mut role, Duration::from_secs(5), |r| !r.is_leader()).await;
        store.read(|t| {
            assert!(t.jobs.contains_key("mine") && !t.jobs.contains_key("stale"));
        });
        let _ = stop.send(true);
    }
}
