//! A client of etcd's v3 API, for the servers that keep their state there
//! (`server { store = "etcd" }`): the calls the etcd store makes (ranges
//! over a prefix, transactions), on the generated stubs of
//! `berth_proto::etcd` over the same tonic as the agent protocol.
//!
//! The store calls it from a blocking write ([`crate::state::StateStore::write`]
//! blocks its thread), so the client runs on a small runtime of its own and
//! [`EtcdClient::block_on`] hands it a call and waits: that works from a
//! runtime's worker (inside `block_in_place`), from a current-thread
//! runtime's test and from a plain thread alike.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use berth_proto::etcd::etcdserverpb::WatchResponse;
use berth_proto::etcd::etcdserverpb::{
    compare, kv_client::KvClient, lease_client::LeaseClient, maintenance_client::MaintenanceClient,
    request_op, response_op, watch_client::WatchClient, watch_request, Compare, DeleteRangeRequest,
    LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest, PutRequest, RangeRequest,
    StatusRequest, TxnResponse, WatchCreateRequest, WatchRequest,
};
pub use berth_proto::etcd::etcdserverpb::{RequestOp, TxnRequest};
use berth_proto::etcd::mvccpb::KeyValue;
pub use berth_proto::etcd::mvccpb::{event::EventType, Event};
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

/// How the servers reach etcd (`etcd { ... }` of the agent config).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `http://HOST:PORT` (`https://` with `tls`) of each member; calls go
    /// to any that answers.
    pub endpoints: Vec<String>,
    /// The key prefix all of berth's keys live under (`/berth`): one etcd
    /// can hold several berth clusters under different prefixes.
    pub prefix: String,
    /// How long connecting to a member may take.
    pub dial_timeout: Duration,
    /// How long one call may take before it counts as etcd unavailable.
    pub request_timeout: Duration,
    /// The TTL of the leadership lease.
    pub lease_ttl: Duration,
    /// Where the keyring that seals the secrets stored in etcd is (`None`:
    /// `<data_dir>/server/keyring`). Every server on one prefix must hold
    /// the same keys.
    pub keyring_dir: Option<std::path::PathBuf>,
    /// TLS to the members (`https://` endpoints); `None`: plain HTTP/2.
    pub tls: Option<crate::etcd_tls::EtcdTls>,
}

impl EtcdConfig {
    pub const DEFAULT_PREFIX: &'static str = "/berth";

    /// The defaults with these endpoints.
    pub fn new(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            prefix: Self::DEFAULT_PREFIX.into(),
            dial_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            lease_ttl: Duration::from_secs(10),
            keyring_dir: None,
            tls: None,
        }
    }
}

/// What went wrong talking to etcd.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EtcdError {
    /// No member answered in time, or the cluster has no quorum: the call
    /// may be tried again later.
    #[error("etcd is unavailable ({endpoints}): {detail}")]
    Unavailable { endpoints: String, detail: String },
    /// etcd answered and refused the call.
    #[error("etcd refused the call: {0}")]
    Refused(String),
    /// An endpoint that is no URL etcd could be reached at.
    #[error("etcd endpoint {endpoint:?}: {detail}")]
    BadEndpoint { endpoint: String, detail: String },
}

impl EtcdError {
    /// Whether trying again later may succeed.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, EtcdError::Unavailable { .. })
    }
}

/// One etcd member as `berth operator store` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemberHealth {
    pub endpoint: String,
    /// It answered, has a leader and reports no error.
    pub healthy: bool,
    pub version: String,
    /// It is etcd's own leader.
    pub is_leader: bool,
    pub db_size_bytes: i64,
    pub raft_index: u64,
    /// What it reported wrong, or why it did not answer.
    pub errors: Vec<String>,
}

/// What the etcd servers say when a transaction exceeds their limits, and
/// the flag that raises each.
const LIMITS: [(&str, &str); 2] = [
    ("too many operations in txn request", "--max-txn-ops"),
    ("request is too large", "--max-request-bytes"),
];

/// The largest answer taken from etcd (a page of a range).
const MAX_ANSWER_BYTES: usize = 256 * 1024 * 1024;

/// The pause after a round of the members that all failed a call.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Keys a range answers at most at once.
const RANGE_PAGE: i64 = 500;

/// A client of one etcd cluster.
#[derive(Clone)]
pub struct EtcdClient {
    /// A channel to each member, in the order of the endpoints.
    channels: std::sync::Arc<[Channel]>,
    /// The member calls go to; a member that fails a call is left for the
    /// next.
    current: std::sync::Arc<AtomicUsize>,
    config: EtcdConfig,
    /// The runtime the calls run on (see the module's doc).
    rt: std::sync::Arc<ClientRuntime>,
}

/// A runtime that is shut down in the background when dropped, so that the
/// client may be dropped inside another runtime.
struct ClientRuntime(Option<tokio::runtime::Runtime>);

impl Drop for ClientRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl EtcdClient {
    /// A client of the members in `config.endpoints`. Connects lazily:
    /// nothing is dialed until the first call.
    pub fn new(config: EtcdConfig) -> Result<EtcdClient, EtcdError> {
        if config.endpoints.is_empty() {
            return Err(EtcdError::BadEndpoint {
                endpoint: String::new(),
                detail: "no endpoints: set etcd { endpoints = [\"http://HOST:2379\"] }".into(),
            });
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("berth-etcd")
            .enable_all()
            .build()
            .map_err(|e| EtcdError::Refused(format!("starting the etcd client: {e}")))?;
        let channels: Vec<Channel> = {
            let _in = rt.enter();
            config
                .endpoints
                .iter()
                .map(|e| channel(e, &config))
                .collect::<Result<_, _>>()?
        };
        Ok(EtcdClient {
            channels: channels.into(),
            current: Default::default(),
            config,
            rt: std::sync::Arc::new(ClientRuntime(Some(rt))),
        })
    }

    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// `key` under the configured prefix.
    pub fn key(&self, key: &str) -> Vec<u8> {
        format!("{}/{key}", self.config.prefix.trim_end_matches('/')).into_bytes()
    }

    /// The prefix every key of berth's starts with (`<prefix>/`).
    pub fn prefix(&self) -> Vec<u8> {
        self.key("")
    }

    /// Run `call` on the client's runtime and wait for it, from any
    /// thread (see the module's doc). A call that takes longer than the
    /// request timeout is etcd unavailable.
    pub fn block_on<T: Send + 'static>(
        &self,
        call: impl Future<Output = Result<T, EtcdError>> + Send + 'static,
    ) -> Result<T, EtcdError> {
        let timeout = self.config.request_timeout;
        let unavailable = self.unavailable(format!(
            "no answer within the request timeout of {}",
            humantime::format_duration(timeout)
        ));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let Some(rt) = self.rt.0.as_ref() else {
            return Err(unavailable);
        };
        rt.spawn(async move {
            let answer = tokio::time::timeout(timeout, call).await;
            let _ = tx.send(answer);
        });
        match rx.recv() {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) | Err(_) => Err(unavailable),
        }
    }

    /// Runs `task` on the client's runtime, which no blocking write of
    /// the store can hold up (the leadership lease is kept alive there).
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        if let Some(rt) = self.rt.0.as_ref() {
            rt.spawn(task);
        }
    }

    fn unavailable(&self, detail: String) -> EtcdError {
        EtcdError::Unavailable {
            endpoints: self.config.endpoints.join(", "),
            detail,
        }
    }

    /// The error a failed call stands for.
    fn status_error(&self, status: tonic::Status) -> EtcdError {
        use tonic::Code;
        let message = status.message().to_string();
        if let Some((_, flag)) = LIMITS.iter().find(|(m, _)| message.contains(m)) {
            return EtcdError::Refused(format!(
                "{message}: berth writes a change of many records in one transaction; \
                 start the etcd members with a larger {flag}"
            ));
        }
        match status.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
                let detail = if message.is_empty() {
                    format!("{:?}", status.code())
                } else {
                    message
                };
                self.unavailable(detail)
            }
            _ => EtcdError::Refused(message),
        }
    }

    /// Runs `call` on the member in use. A member that does not answer in
    /// time, or answers that it cannot serve, is left for the next one;
    /// a call that may be repeated (`again`) is then tried there, and on
    /// round the members (a pause after each round: an election among
    /// them takes a moment) until the request timeout, and one that may
    /// not (a transaction, which may have been applied) fails.
    async fn on_member<T, F, Fut>(&self, again: bool, call: F) -> Result<T, EtcdError>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let members = self.channels.len();
        let timeout = self.config.request_timeout;
        let per_try = if again {
            timeout / u32::try_from(members).unwrap_or(1)
        } else {
            timeout
        };
        let started = tokio::time::Instant::now();
        let mut tries = 0usize;
        loop {
            let i = self.current.load(Ordering::Relaxed) % members;
            let left = timeout.saturating_sub(started.elapsed());
            let last = match tokio::time::timeout(per_try.min(left), call(self.channels[i].clone()))
                .await
            {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(status)) => {
                    let e = self.status_error(status);
                    if !e.is_unavailable() {
                        return Err(e);
                    }
                    e
                }
                Err(_) => self.unavailable(format!(
                    "{} did not answer within {}",
                    self.config.endpoints[i],
                    humantime::format_duration(per_try.min(left))
                )),
            };
            // The next member, unless another call moved on already.
            let _ = self.current.compare_exchange(
                i,
                (i + 1) % members,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            tries += 1;
            if !again || started.elapsed() + RETRY_PAUSE >= timeout {
                return Err(last);
            }
            if tries.is_multiple_of(members) {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }

    /// Every key under `prefix` (a byte prefix), read at one revision, in
    /// key order; and that revision. Read in pages, so that a large store
    /// is no single huge answer.
    pub async fn range_prefix(&self, prefix: &[u8]) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        let end = prefix_end(prefix);
        let mut out = Vec::new();
        let mut from = prefix.to_vec();
        let mut revision = 0;
        loop {
            let request = RangeRequest {
                key: from.clone(),
                range_end: end.clone(),
                limit: RANGE_PAGE,
                revision,
                ..Default::default()
            };
            let answer = self
                .on_member(true, |channel| {
                    let request = request.clone();
                    async move {
                        let mut kv =
                            KvClient::new(channel).max_decoding_message_size(MAX_ANSWER_BYTES);
                        Ok(kv.range(request).await?.into_inner())
                    }
                })
                .await?;
            if revision == 0 {
                revision = answer.header.map_or(0, |h| h.revision);
            }
            let more = answer.more;
            let Some(last) = answer.kvs.last().map(|kv| kv.key.clone()) else {
                break;
            };
            out.extend(answer.kvs);
            if !more {
                break;
            }
            // The next page starts just after the last key.
            from = last;
            from.push(0);
        }
        Ok((out, revision))
    }

    /// The value of one key and its modify revision, if it is there.
    pub async fn get(&self, key: Vec<u8>) -> Result<Option<KeyValue>, EtcdError> {
        let request = RangeRequest {
            key,
            ..Default::default()
        };
        let answer = self
            .on_member(true, |channel| {
                let request = request.clone();
                async move { Ok(KvClient::new(channel).range(request).await?.into_inner()) }
            })
            .await?;
        Ok(answer.kvs.into_iter().next())
    }

    /// One transaction (tried on one member: it may have been applied
    /// when its answer is lost).
    pub async fn txn(&self, txn: TxnRequest) -> Result<TxnResponse, EtcdError> {
        self.on_member(false, |channel| {
            let txn = txn.clone();
            async move {
                let mut kv = KvClient::new(channel).max_decoding_message_size(MAX_ANSWER_BYTES);
                Ok(kv.txn(txn).await?.into_inner())
            }
        })
        .await
    }

    /// Watches every key under `prefix` from `start_revision` on: the
    /// answers as etcd sends them (the first says the watch was created;
    /// one with `compact_revision` set says the revisions from
    /// `start_revision` are gone). With progress notices, so that a quiet
    /// watch still answers now and then.
    pub async fn watch_prefix(
        &self,
        prefix: &[u8],
        start_revision: i64,
    ) -> Result<tonic::Streaming<WatchResponse>, EtcdError> {
        let create = WatchRequest {
            request_union: Some(watch_request::RequestUnion::CreateRequest(
                WatchCreateRequest {
                    key: prefix.to_vec(),
                    range_end: prefix_end(prefix),
                    start_revision,
                    progress_notify: true,
                    ..Default::default()
                },
            )),
        };
        self.on_member(true, |channel| {
            let create = create.clone();
            async move {
                // The request stream stays open (the watch lives as long
                // as it); nothing more is sent on it.
                let requests = tokio_stream::once(create).chain(tokio_stream::pending());
                let mut watch =
                    WatchClient::new(channel).max_decoding_message_size(MAX_ANSWER_BYTES);
                Ok(watch.watch(requests).await?.into_inner())
            }
        })
        .await
    }

    /// The error a failed watch answer stands for; the watch is started
    /// again on the next member.
    pub fn watch_error(&self, status: tonic::Status) -> EtcdError {
        self.leave_member();
        self.status_error(status)
    }

    /// Moves calls on to the next member (one that holds a watch stream
    /// open without answering, say).
    pub fn leave_member(&self) {
        let members = self.channels.len();
        let _ = self
            .current
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |i| {
                Some((i + 1) % members)
            });
    }

    /// A lease of `ttl` (whole seconds, at least one).
    pub async fn lease_grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let seconds = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let answer = self
            .on_member(true, |channel| async move {
                let request = LeaseGrantRequest {
                    ttl: seconds,
                    id: 0,
                };
                Ok(LeaseClient::new(channel)
                    .lease_grant(request)
                    .await?
                    .into_inner())
            })
            .await?;
        if !answer.error.is_empty() {
            return Err(EtcdError::Refused(answer.error));
        }
        Ok(answer.id)
    }

    /// Keeps lease `id` alive once; the TTL it has left (0: it expired).
    pub async fn lease_keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        self.on_member(true, |channel| async move {
            let request = tokio_stream::once(LeaseKeepAliveRequest { id });
            let mut answers = LeaseClient::new(channel)
                .lease_keep_alive(request)
                .await?
                .into_inner();
            match answers.message().await? {
                Some(answer) => Ok(answer.ttl),
                None => Err(tonic::Status::unavailable("the keep-alive stream ended")),
            }
        })
        .await
    }

    /// Revokes lease `id`: the keys bound to it go at once.
    pub async fn lease_revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.on_member(true, |channel| async move {
            LeaseClient::new(channel)
                .lease_revoke(LeaseRevokeRequest { id })
                .await?;
            Ok(())
        })
        .await
    }

    /// Compacts away every revision before `revision` (what an operator,
    /// or etcd's auto-compaction, does to keep its history small).
    pub async fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        self.on_member(true, |channel| async move {
            let request = berth_proto::etcd::etcdserverpb::CompactionRequest {
                revision,
                physical: true,
            };
            KvClient::new(channel).compact(request).await?;
            Ok(())
        })
        .await
    }

    /// Each member's health, asked of each at once (within the dial
    /// timeout).
    pub async fn member_health(&self) -> Vec<MemberHealth> {
        let asks = self
            .channels
            .iter()
            .zip(&self.config.endpoints)
            .map(|(channel, endpoint)| {
                let channel = channel.clone();
                let wait = self.config.dial_timeout;
                async move {
                    let mut client = MaintenanceClient::new(channel);
                    let answer = tokio::time::timeout(wait, client.status(StatusRequest {})).await;
                    let mut health = MemberHealth {
                        endpoint: endpoint.clone(),
                        ..MemberHealth::default()
                    };
                    match answer {
                        Ok(Ok(status)) => {
                            let status = status.into_inner();
                            let member = status.header.as_ref().map_or(0, |h| h.member_id);
                            health.healthy = status.errors.is_empty() && status.leader != 0;
                            health.version = status.version;
                            health.is_leader = member != 0 && member == status.leader;
                            health.db_size_bytes = status.db_size;
                            health.raft_index = status.raft_index;
                            health.errors = status.errors;
                            if status.leader == 0 {
                                health
                                    .errors
                                    .push("no leader: the member has no quorum".into());
                            }
                        }
                        Ok(Err(e)) => health.errors.push(e.message().to_string()),
                        Err(_) => health.errors.push(format!(
                            "no answer within {}",
                            humantime::format_duration(wait)
                        )),
                    }
                    health
                }
            });
        futures_util::future::join_all(asks).await
    }

    /// The version of the member that answers (a check that etcd is
    /// there).
    pub async fn version(&self) -> Result<String, EtcdError> {
        self.on_member(true, |channel| async move {
            Ok(MaintenanceClient::new(channel)
                .status(StatusRequest {})
                .await?
                .into_inner()
                .version)
        })
        .await
    }
}

/// A channel to the member at `url`, not dialled yet: `http://HOST:PORT`,
/// or `https://HOST:PORT` with `config.tls`. Must run inside a runtime.
fn channel(url: &str, config: &EtcdConfig) -> Result<Channel, EtcdError> {
    let bad = |detail: String| EtcdError::BadEndpoint {
        endpoint: url.to_string(),
        detail,
    };
    let endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(config.dial_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(config.dial_timeout)
        .keep_alive_while_idle(true);
    match (url.split_once("://").map(|(s, _)| s), &config.tls) {
        (Some("http"), None) => Ok(endpoint.connect_lazy()),
        (Some("https"), Some(tls)) => {
            let dialer = tls.dialer(endpoint.uri()).map_err(bad)?;
            Ok(endpoint.connect_with_connector_lazy(dialer))
        }
        (Some("http"), Some(_)) => Err(bad(
            "etcd { tls } is set, so the members are dialled over TLS: want https://HOST:PORT"
                .into(),
        )),
        (Some("https"), None) => Err(bad(
            "an https:// endpoint needs etcd { tls { ca_file = ... } }, the CA that signed \
             the members' certificates"
                .into(),
        )),
        _ => Err(bad(
            "want http://HOST:PORT, or https://HOST:PORT with etcd { tls }".into(),
        )),
    }
}

/// The end of the range of keys that start with `prefix` (etcd's
/// `range_end`): the prefix with its last byte that is not 0xff bumped.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from the prefix on.
    vec![0]
}

/// A put of `value` under `key`.
pub fn put(key: Vec<u8>, value: Vec<u8>) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key,
            value,
            ..Default::default()
        })),
    }
}

/// A put of `value` under `key`, bound to lease `lease`.
pub fn put_leased(key: Vec<u8>, value: Vec<u8>, lease: i64) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key,
            value,
            lease,
            ..Default::default()
        })),
    }
}

/// A read of `key`.
pub fn get(key: Vec<u8>) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestRange(RangeRequest {
            key,
            ..Default::default()
        })),
    }
}

/// The key a transaction's `get` op read, from its answer.
pub fn got(answer: &TxnResponse) -> Option<&KeyValue> {
    answer.responses.iter().find_map(|r| match &r.response {
        Some(response_op::Response::ResponseRange(range)) => range.kvs.first(),
        _ => None,
    })
}

/// A delete of `key`.
pub fn delete(key: Vec<u8>) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestDeleteRange(
            DeleteRangeRequest {
                key,
                ..Default::default()
            },
        )),
    }
}

/// The compare that holds while `key` was last modified at `revision` (0:
/// while it is not there).
pub fn mod_revision_is(key: Vec<u8>, revision: i64) -> Compare {
    Compare {
        result: compare::CompareResult::Equal as i32,
        target: compare::CompareTarget::Mod as i32,
        key,
        target_union: Some(compare::TargetUnion::ModRevision(revision)),
        range_end: Vec::new(),
    }
}

/// The compare that holds while `key` is the one created at `revision`.
pub fn created_at(key: Vec<u8>, revision: i64) -> Compare {
    Compare {
        result: compare::CompareResult::Equal as i32,
        target: compare::CompareTarget::Create as i32,
        key,
        target_union: Some(compare::TargetUnion::CreateRevision(revision)),
        range_end: Vec::new(),
    }
}

/// The compare that holds while `key` is not there.
pub fn absent(key: Vec<u8>) -> Compare {
    created_at(key, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_at_its_last_byte_bumped() {
        assert_eq!(prefix_end(b"/berth/"), b"/berth0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn an_endpoint_that_is_no_http_url_is_refused_by_name() {
        let e = EtcdClient::new(EtcdConfig::new(vec!["10.0.0.1:2379".into()]))
            .err()
            .unwrap();
        assert!(e.to_string().contains("\"10.0.0.1:2379\""), "{e}");
        assert!(EtcdClient::new(EtcdConfig::new(vec![])).is_err());
    }

    #[test]
    fn calls_go_on_to_the_next_member_when_one_is_down_or_stopped() {
        let mut cluster = berth_testutil::etcd::EtcdCluster::start(3);
        // Room for an election when the member stopped below led: a
        // linearizable read waits for the next leader. A call stuck on the
        // stopped member would use it all (a third of it a member).
        let timeout = Duration::from_secs(6);
        let client = EtcdClient::new(EtcdConfig {
            request_timeout: timeout,
            ..EtcdConfig::new(cluster.endpoints())
        })
        .unwrap();
        let write = |value: &'static str| {
            let c = client.clone();
            client.block_on(async move {
                c.txn(TxnRequest {
                    compare: vec![],
                    success: vec![put(c.key("k"), value.as_bytes().to_vec())],
                    failure: vec![],
                })
                .await
            })
        };
        let read = || {
            let c = client.clone();
            client.block_on(async move { c.get(c.key("k")).await })
        };
        write("one").expect("all members up");
        // The member in use dies: a read goes on to the next at once; a
        // transaction fails once (it is not repeated) and goes on after.
        cluster.members[0].kill();
        let value = read().expect("a read with the first member down");
        assert_eq!(value.map(|kv| kv.value), Some(b"one".to_vec()));
        let _ = write("two");
        write("two").expect("a write with the first member down");
        // The first comes back, and the one in use now stops answering
        // (SIGSTOP): reads still answer, from another.
        cluster.members[0].restart();
        cluster.members[1].pause();
        let started = std::time::Instant::now();
        let value = read().expect("a read with a member stopped");
        assert_eq!(value.map(|kv| kv.value), Some(b"two".to_vec()));
        assert!(started.elapsed() < timeout);
        cluster.members[1].resume();
    }
}
