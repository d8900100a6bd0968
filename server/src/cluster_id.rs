//! The cluster ID: made at a server's first start and kept in its data
//! dir, it names the cluster every answer of the agent protocol comes from
//! (the [`CLUSTER_ID_HEADER`] of each response). A client records the ID
//! it registered with and never takes answers from a server of another
//! one, and a server refuses a request that names another cluster, so that
//! two unrelated servers listed in one client's `servers` never share a
//! node (one would tell it its allocs are gone while the other marks it
//! down).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{Context, Poll};

use berth_proto::berth::v1::CLUSTER_ID_HEADER;
use tonic::body::Body;
use tonic::codegen::http::{HeaderValue, Request, Response};

use crate::error::ServerError;
use crate::leader::{Role, ServerIdentity};
use crate::leader_link::LeaderLink;

/// The alloc watch's gRPC path.
const WATCH_ALLOCATIONS: &str = "/berth.v1.Node/WatchAllocations";

/// The file under the server's data dir that holds the cluster ID.
const FILE: &str = "cluster-id";

fn path_in(data_dir: &Path) -> PathBuf {
    data_dir.join(FILE)
}

/// The cluster ID kept in `data_dir`, made (a UUID, written durably) when
/// there is none. A file that holds anything but a UUID is an error that
/// names it: making a new ID would split the cluster silently.
pub(crate) fn load_or_create(data_dir: &Path) -> Result<String, ServerError> {
    let path = path_in(data_dir);
    let io = |what: &str, e: std::io::Error| {
        ServerError::Internal(format!("{what} the cluster ID {}: {e}", path.display()))
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim();
            uuid::Uuid::parse_str(id).map_err(|e| {
                ServerError::Internal(format!(
                    "the cluster ID file {} does not hold a cluster ID ({e}); restore it from a \
                     backup of this server's data dir (a new ID would make this server a new \
                     cluster, which no client of the old one would follow)",
                    path.display()
                ))
            })?;
            Ok(id.to_string())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = uuid::Uuid::new_v4().to_string();
            let tmp = data_dir.join(format!("{FILE}.tmp"));
            let mut f =
                crate::file_modes::create_private_file(&tmp).map_err(|e| io("writing", e))?;
            f.write_all(format!("{id}\n").as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(|e| io("writing", e))?;
            std::fs::rename(&tmp, &path).map_err(|e| io("writing", e))?;
            std::fs::File::open(data_dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io("writing", e))?;
            tracing::info!(cluster_id = %id, path = %path.display(), "made the cluster ID");
            Ok(id)
        }
        Err(e) => Err(io("reading", e)),
    }
}

/// A layer for the agent protocol's server: it names the cluster on every
/// response, answers a request that names another cluster with
/// `FAILED_PRECONDITION` before any service sees it, and, on a server
/// that does not lead (only the leader takes heartbeats and writes; see
/// `crate::leader`), sends each request on to the leader when it has a
/// way there ([`ClusterIdLayer::sending_on`], see `crate::leader_link`),
/// or else sends the node on with `UNAVAILABLE`.
#[derive(Clone)]
pub struct ClusterIdLayer {
    id: HeaderValue,
    role: Option<tokio::sync::watch::Receiver<Role>>,
    /// The way to the leader, and this server's name for it.
    link: Option<(Arc<dyn LeaderLink>, HeaderValue)>,
    /// While true, a standby's tables are current and it serves alloc
    /// watches itself.
    tables_current: Option<tokio::sync::watch::Receiver<bool>>,
}

impl std::fmt::Debug for ClusterIdLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterIdLayer")
            .field("id", &self.id)
            .field("sends_on", &self.link.is_some())
            .finish()
    }
}

impl ClusterIdLayer {
    pub fn new(cluster_id: &str) -> Result<ClusterIdLayer, ServerError> {
        let id = HeaderValue::from_str(cluster_id)
            .map_err(|e| ServerError::Internal(format!("cluster ID {cluster_id:?}: {e}")))?;
        Ok(ClusterIdLayer {
            id,
            role: None,
            link: None,
            tables_current: None,
        })
    }

    /// Refuses every request while `role` is not the leader's.
    pub fn leader_only(mut self, role: tokio::sync::watch::Receiver<Role>) -> ClusterIdLayer {
        self.role = Some(role);
        self
    }

    /// While this server does not lead but `current` says its tables are
    /// current, it serves the nodes' alloc watches from them (as Nomad's
    /// followers answer a client's allocs) rather than send them on: the
    /// leader then carries one stream a node, its call stream.
    pub fn watching_locally_while(
        mut self,
        current: tokio::sync::watch::Receiver<bool>,
    ) -> ClusterIdLayer {
        self.tables_current = Some(current);
        self
    }

    /// While this server does not lead, sends requests on to the leader
    /// over `link`, naming itself `name`; without it they are refused.
    pub fn sending_on(mut self, link: Arc<dyn LeaderLink>, name: &str) -> ClusterIdLayer {
        let name = HeaderValue::from_str(name)
            .unwrap_or_else(|_| HeaderValue::from_static("a-berth-server"));
        self.link = Some((link, name));
        self
    }
}

impl<S> tower::Layer<S> for ClusterIdLayer {
    type Service = ClusterIdService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClusterIdService {
            inner,
            layer: self.clone(),
        }
    }
}

/// See [`ClusterIdLayer`].
#[derive(Clone)]
pub struct ClusterIdService<S> {
    inner: S,
    /// What the service does, as the layer was set up.
    layer: ClusterIdLayer,
}

impl<S> ClusterIdService<S> {
    /// Whether a standby answers `req` itself: an alloc watch, while its
    /// tables are current.
    fn served_here<B>(&self, req: &Request<B>) -> bool {
        req.uri().path() == WATCH_ALLOCATIONS
            && self
                .layer
                .tables_current
                .as_ref()
                .is_some_and(|c| *c.borrow())
    }
}

impl<S> tower::Service<Request<Body>> for ClusterIdService<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let id = self.layer.id.clone();
        if let Some(theirs) = req.headers().get(CLUSTER_ID_HEADER) {
            if theirs != id {
                let message = format!(
                    "this server is of cluster {}, not of cluster {} that the node registered with",
                    id.to_str().unwrap_or_default(),
                    theirs.to_str().unwrap_or("(not text)")
                );
                let refused = tonic::Status::failed_precondition(message);
                return Box::pin(async move { Ok(refusal(&id, refused)) });
            }
        }
        let standby = match self.layer.role.as_ref().map(|r| r.borrow().clone()) {
            Some(Role::Standby { leader }) if !self.served_here(&req) => Some(leader),
            _ => None,
        };
        if let Some(leader) = standby {
            return match (leader, &self.layer.link) {
                (Some(leader), Some((link, by))) if !crate::leader_link::was_sent_on(&req) => {
                    let (link, by) = (link.clone(), by.clone());
                    Box::pin(async move {
                        let mut resp = crate::leader_link::send_on(&*link, &by, &leader, req).await;
                        resp.headers_mut().insert(CLUSTER_ID_HEADER, id);
                        Ok(resp)
                    })
                }
                (leader, _) => {
                    let refused = tonic::Status::unavailable(not_the_leader(leader.as_ref()));
                    Box::pin(async move { Ok(refusal(&id, refused)) })
                }
            };
        }
        let answer = self.inner.call(req);
        Box::pin(async move {
            let mut resp = answer.await?;
            resp.headers_mut().insert(CLUSTER_ID_HEADER, id);
            Ok(resp)
        })
    }
}

/// Why a server that does not lead refuses a request, naming the leader
/// when it knows it.
pub fn not_the_leader(leader: Option<&ServerIdentity>) -> String {
    match leader {
        Some(l) => format!(
            "this server does not lead: the leader is {} (agent protocol {}, HTTP API {})",
            l.name, l.rpc_addr, l.http_addr
        ),
        None => "no server leads right now: the servers are electing one, or cannot reach \
                 etcd (out of reach, or no quorum); try again"
            .into(),
    }
}

/// A gRPC answer of only headers: `status`, naming this server's cluster.
fn refusal(id: &HeaderValue, status: tonic::Status) -> Response<Body> {
    let mut resp = status.into_http::<Body>();
    resp.headers_mut().insert(CLUSTER_ID_HEADER, id.clone());
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cluster_id_is_made_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path()).unwrap();
        assert!(uuid::Uuid::parse_str(&first).is_ok());
        assert_eq!(load_or_create(dir.path()).unwrap(), first);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(path_in(dir.path()))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_damaged_cluster_id_file_is_an_error_naming_it_not_a_new_cluster() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(path_in(dir.path()), "garbage\n").unwrap();
        let e = load_or_create(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("cluster-id") && e.contains("does not hold"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(path_in(dir.path())).unwrap(),
            "garbage\n",
            "the file is left for the operator"
        );
    }
}
