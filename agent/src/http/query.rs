//! What every read of the server API shares: blocking queries
//! (`?index=N&wait=D`, answered with `X-Berth-Index`) and, for lists,
//! pages (`?per_page=N&next_token=T&prefix=P`, answered with
//! `X-Berth-NextToken` while more remain). Nomad's rules.
//!
//! A read names the tables its answer comes from; its blocking query waits
//! for a write to one of those, so that a job list does not wake for a
//! node's heartbeat write, and its index is the last write to one of them.

use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_server::{Page, Server, Table};
use serde::Deserialize;
use serde_json::Value;

use super::ApiError;

/// The header of the index an answer reflects.
pub const INDEX_HEADER: &str = "x-berth-index";
/// The header of the ID the next page starts at.
pub const NEXT_TOKEN_HEADER: &str = "x-berth-nexttoken";

/// The longest a blocking query waits (also its default).
pub const MAX_BLOCKING_WAIT: Duration = Duration::from_secs(300);

/// The tables each read answers from.
pub const JOBS: &[Table] = &[Table::Jobs];
/// A job's allocs (the job must exist).
pub const JOB_ALLOCS: &[Table] = &[Table::Jobs, Table::Allocs];
pub const ALLOCS: &[Table] = &[Table::Allocs];
pub const DEPLOYMENTS: &[Table] = &[Table::Deployments];
/// A job's deployments (the job must exist).
pub const JOB_DEPLOYMENTS: &[Table] = &[Table::Jobs, Table::Deployments];
/// The node list (its `allocs_running` counts are read as it answers;
/// an alloc write does not wake it).
pub const NODES: &[Table] = &[Table::Nodes];
/// A node's answer carries what its allocs use and the CSI volumes
/// claimed on it.
pub const NODE: &[Table] = &[Table::Nodes, Table::Allocs, Table::Volumes];
pub const NODE_ALLOCS: &[Table] = &[Table::Nodes, Table::Allocs];
/// A volume's answer carries its plugin's health (from nodes and plugin
/// allocs) and its claims joined with their allocs and nodes.
pub const VOLUMES: &[Table] = &[Table::Volumes, Table::Nodes, Table::Allocs];
/// Plugins are derived from node fingerprints and plugin allocs; a
/// plugin's answer counts its volumes.
pub const PLUGINS: &[Table] = &[Table::Nodes, Table::Allocs, Table::Volumes];

/// The wait of a blocking query: `wait` (a duration such as `10s` or
/// `2m`), at most [`MAX_BLOCKING_WAIT`], which is also the default.
pub fn blocking_wait(wait: Option<&str>) -> Result<Duration, ApiError> {
    match wait {
        None => Ok(MAX_BLOCKING_WAIT),
        Some(w) => humantime::parse_duration(w)
            .map(|d| d.min(MAX_BLOCKING_WAIT))
            .map_err(|e| {
                ApiError::bad_request(format!(
                    "wait={w:?}: {e} (give a duration such as 10s or 5m)"
                ))
            }),
    }
}

/// Waits as `?index=N&wait=D` asks: with `index` above 0, until one of
/// `tables` is written at an index above it, or `wait` passes. Returns the
/// index the answer reflects, read before the answer is, so that a write
/// between the two is seen by the next query rather than lost. Never 0, so
/// that a client that sends it back blocks.
async fn block_on(
    s: &Server,
    tables: &[Table],
    index: Option<u64>,
    wait: Option<&str>,
) -> Result<u64, ApiError> {
    let wait = blocking_wait(wait)?;
    if let Some(min) = index.filter(|i| *i > 0) {
        s.wait_for_tables(tables, min, wait).await;
    }
    Ok(s.tables_index(tables).max(1))
}

/// The query of a read of one object: a blocking query.
#[derive(Deserialize)]
pub struct BlockingQuery {
    index: Option<u64>,
    wait: Option<String>,
}

impl BlockingQuery {
    /// The index the query waits to pass, if any.
    pub fn index(&self) -> Option<u64> {
        self.index
    }

    /// How long the query waits at most (see [`blocking_wait`]).
    pub fn wait(&self) -> Result<Duration, ApiError> {
        blocking_wait(self.wait.as_deref())
    }

    /// Blocks as the query asks; returns the index to answer with.
    pub async fn block(&self, s: &Server, tables: &[Table]) -> Result<u64, ApiError> {
        block_on(s, tables, self.index, self.wait.as_deref()).await
    }
}

/// The query of a list: a blocking query and a page. A list is in ID
/// order; `prefix` keeps the IDs that start with it, `next_token` starts at
/// that ID (the `X-Berth-NextToken` of the page before), `per_page` caps
/// the page.
#[derive(Deserialize)]
pub struct ListQuery {
    index: Option<u64>,
    wait: Option<String>,
    per_page: Option<usize>,
    next_token: Option<String>,
    prefix: Option<String>,
}

impl ListQuery {
    /// Checks the page parameters, then blocks as the query asks; returns
    /// the index to answer with.
    pub async fn block(&self, s: &Server, tables: &[Table]) -> Result<u64, ApiError> {
        if self.per_page == Some(0) {
            return Err(ApiError::bad_request(
                "per_page=0: a page holds at least one item",
            ));
        }
        block_on(s, tables, self.index, self.wait.as_deref()).await
    }

    /// The page the query asks for, which the servers take from an
    /// ID-keyed table by key range (copying only its items).
    pub fn table_page(&self) -> Page<'_> {
        Page {
            prefix: self.prefix.as_deref().unwrap_or_default(),
            start: self.next_token.as_deref().unwrap_or_default(),
            limit: self.per_page,
        }
    }

    /// The page of `items` the query asks for, and the ID the next page
    /// starts at when more remain: for a list made in memory; a table is
    /// paged by [`Self::table_page`].
    pub fn page<T>(&self, mut items: Vec<T>, id: impl Fn(&T) -> &str) -> (Vec<T>, Option<String>) {
        items.sort_by(|a, b| id(a).cmp(id(b)));
        let prefix = self.prefix.as_deref().unwrap_or_default();
        let start = self.next_token.as_deref().unwrap_or_default();
        let mut rest = items
            .into_iter()
            .filter(|x| id(x).starts_with(prefix) && id(x) >= start)
            .peekable();
        let page: Vec<T> = match self.per_page {
            Some(n) => rest.by_ref().take(n).collect(),
            None => rest.by_ref().collect(),
        };
        let next = rest.peek().map(|x| id(x).to_string());
        (page, next)
    }
}

/// The answer, with the index it reflects in `X-Berth-Index` and, for a
/// page with more after it, where the next starts in `X-Berth-NextToken`.
pub fn indexed(index: u64, body: Value, next_token: Option<String>) -> Response {
    let mut resp = Json(body).into_response();
    let headers = resp.headers_mut();
    headers.insert(INDEX_HEADER, HeaderValue::from(index));
    if let Some(token) = next_token.and_then(|t| HeaderValue::from_str(&t).ok()) {
        headers.insert(NEXT_TOKEN_HEADER, token);
    }
    resp
}

/// `v` as the JSON of an answer.
pub fn encode<T: serde::Serialize>(v: &T) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(format!("encoding the answer: {e}")))
}
