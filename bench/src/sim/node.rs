//! One simulated node's side of the agent protocol: registering,
//! heartbeats, the call stream and the alloc watch with its volume claims
//! and releases.

use berth_sync::MutexExt;
use berth_sync::Shutdown;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berth_proto::berth::v1 as pb;
use berth_structs::{AllocClientStatus, Allocation, Job, Node, NodeResources};
use tokio::sync::mpsc;

use super::{interval, random_fraction, retry_delay, with_secret, SimNode, PLUGIN};

impl SimNode {
    fn node_struct(&self, cpu: u64) -> Node {
        Node {
            id: self.id.clone(),
            name: format!("sim-{}", self.index),
            datacenter: "dc1".into(),
            resources: NodeResources {
                cpu,
                memory_mb: 64 * 1024,
                disk_mb: 0,
            },
            drivers: vec!["raw_exec".into()],
            ..Default::default()
        }
    }

    /// Register; report the node plugin when `plugin`. Returns the TTL.
    pub(super) async fn register(&self, cpu: u64, plugin: bool) -> Result<Duration> {
        let node_json = serde_json::to_vec(&self.node_struct(cpu))?;
        let what = format!("register of node {}", self.index);
        let ttl = self
            .with_retries(&what, || {
                let mut node = self.node.clone();
                let req = with_secret(
                    pb::RegisterRequest {
                        node_json: node_json.clone(),
                        ..Default::default()
                    },
                    &self.secret,
                );
                async move { node.register(req).await }
            })
            .await
            .context(what)?
            .into_inner()
            .heartbeat_ttl_ms;
        if plugin {
            let fingerprint = pb::PluginFingerprint {
                plugin_id: PLUGIN.into(),
                kind: "node".into(),
                provider: "sim.csi.berth.dev".into(),
                version: "1.0.0".into(),
                healthy: true,
                health_description: "healthy".into(),
                alloc_id: format!("sim-plugin-{}", self.index),
                external_node_id: format!("sim-{}", self.index),
                supports_stage_unstage: true,
                ..Default::default()
            };
            self.node
                .clone()
                .update_plugins(with_secret(
                    pb::UpdatePluginsRequest {
                        node_id: self.id.clone(),
                        plugins: vec![fingerprint],
                    },
                    &self.secret,
                ))
                .await
                .with_context(|| format!("plugins of node {}", self.index))?;
        }
        Ok(Duration::from_millis(ttl))
    }

    pub(super) async fn heartbeat_loop(self, ttl: Duration, mut stop: Shutdown) {
        let mut client = self.node.clone();
        let mut next = interval(ttl).mul_f64(random_fraction());
        loop {
            tokio::select! {
                _ = stop.wait() => return,
                _ = tokio::time::sleep(next) => {}
            }
            let started = Instant::now();
            let r = client
                .heartbeat(with_secret(
                    pb::HeartbeatRequest {
                        node_id: self.id.clone(),
                    },
                    &self.secret,
                ))
                .await;
            let took = started.elapsed();
            match r {
                Ok(r) => {
                    self.stats.heartbeats.locked().push((started, took));
                    next = interval(Duration::from_millis(r.into_inner().heartbeat_ttl_ms));
                }
                Err(e) => {
                    if stop.is_shutdown() {
                        return;
                    }
                    let what = format!("heartbeat of node {}: {e}", self.index);
                    if super::retryable(&e) {
                        self.stats.retried.note(what);
                    } else {
                        self.stats.fail(what);
                    }
                    next = Duration::from_secs(1);
                }
            }
        }
    }

    /// Answer the servers' calls: node and controller detaches succeed.
    /// A stream that fails to open, breaks or ends is reopened after the
    /// client's backoff, as a client does.
    pub(super) async fn call_stream(self, mut stop: Shutdown) {
        let mut failures = 0u32;
        loop {
            let Some(why) = self.call_stream_once(&mut stop, &mut failures).await else {
                return;
            };
            if !self.back_off_to_reopen(&mut stop, &mut failures, why).await {
                return;
            }
        }
    }

    /// After a stream of this node broke (`why`): counts the reopen and
    /// waits out the client's backoff. False when told to stop meanwhile.
    async fn back_off_to_reopen(
        &self,
        stop: &mut Shutdown,
        failures: &mut u32,
        why: String,
    ) -> bool {
        if stop.is_shutdown() {
            return false;
        }
        self.stats.reopened.note(why);
        *failures += 1;
        tokio::select! {
            _ = stop.wait() => false,
            _ = tokio::time::sleep(retry_delay(*failures)) => true,
        }
    }

    /// One call stream, until told to stop (None) or it breaks (why).
    async fn call_stream_once(&self, stop: &mut Shutdown, failures: &mut u32) -> Option<String> {
        let (tx, rx) = mpsc::channel::<pb::ClientMessage>(16);
        let hello = pb::ClientMessage {
            msg: Some(pb::client_message::Msg::Hello(pb::ClientHello {
                node_id: self.id.clone(),
            })),
        };
        if tx.send(hello).await.is_err() {
            return Some("the call stream's outbound queue closed".into());
        }
        let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
        let mut calls = match self
            .node
            .clone()
            .open_call_stream(with_secret(outbound, &self.secret))
            .await
        {
            Ok(s) => s.into_inner(),
            Err(e) => {
                return Some(format!(
                    "opening the call stream of node {}: {e}",
                    self.index
                ))
            }
        };
        loop {
            let call = tokio::select! {
                _ = stop.wait() => return None,
                c = calls.message() => c,
            };
            let call = match call {
                Ok(Some(c)) => c,
                Ok(None) => return Some(format!("the call stream of node {} ended", self.index)),
                Err(e) => {
                    return Some(format!("the call stream of node {} broke: {e}", self.index))
                }
            };
            *failures = 0;
            use pb::server_call::Call;
            let result = match call.call {
                Some(Call::NodeDetach(_)) | Some(Call::ControllerUnpublish(_)) => {
                    pb::call_reply::Result::Empty(pb::Empty {})
                }
                _ => pb::call_reply::Result::Error(pb::CallError {
                    code: tonic::Code::Unimplemented as i32,
                    message: "a simulated node answers detaches only".into(),
                }),
            };
            let reply = pb::ClientMessage {
                msg: Some(pb::client_message::Msg::Reply(pb::CallReply {
                    call_id: call.call_id,
                    result: Some(result),
                })),
            };
            if tx.send(reply).await.is_err() {
                return Some("the call stream's outbound queue closed".into());
            }
        }
    }

    /// Follow the node's allocs: claim and report new ones running;
    /// release and report stopped ones complete. A watch that fails to
    /// open, breaks or ends is reopened after the client's backoff, as a
    /// client does; the first update on the new watch lists every alloc
    /// again and only what changed is reported.
    pub(super) async fn watch_allocs(self, mut stop: Shutdown) {
        // What this node reported of each alloc.
        let mut reported: HashMap<String, AllocClientStatus> = HashMap::new();
        let mut failures = 0u32;
        loop {
            let Some(why) = self
                .watch_allocs_once(&mut stop, &mut reported, &mut failures)
                .await
            else {
                return;
            };
            if !self.back_off_to_reopen(&mut stop, &mut failures, why).await {
                return;
            }
        }
    }

    /// Sends `updates`, and again after a broken connection, as a client
    /// does (counted).
    async fn update_allocations(
        &self,
        updates: &[pb::AllocStatusUpdate],
    ) -> Result<tonic::Response<pb::UpdateAllocationsResponse>, tonic::Status> {
        let what = format!("alloc updates of node {}", self.index);
        self.with_retries(&what, || {
            let mut node = self.node.clone();
            let req = with_secret(
                pb::UpdateAllocationsRequest {
                    node_id: self.id.clone(),
                    updates: updates.to_vec(),
                },
                &self.secret,
            );
            async move { node.update_allocations(req).await }
        })
        .await
    }

    /// `call`, made again after a broken connection as a client does: up
    /// to 10 more times, each counted as retried under `what`.
    async fn with_retries<T, F, Fut>(&self, what: &str, mut call: F) -> Result<T, tonic::Status>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let mut tries = 0;
        loop {
            match call().await {
                Err(e) if super::retryable(&e) && tries < 10 => {
                    self.stats.retried.note(format!("{what}: {e}"));
                    tries += 1;
                    tokio::time::sleep(retry_delay(tries)).await;
                }
                r => return r,
            }
        }
    }

    /// One alloc watch, until told to stop (None) or it breaks (why).
    async fn watch_allocs_once(
        &self,
        stop: &mut Shutdown,
        reported: &mut HashMap<String, AllocClientStatus>,
        failures: &mut u32,
    ) -> Option<String> {
        let mut stream = match self
            .node
            .clone()
            .watch_allocations(with_secret(
                pb::WatchAllocationsRequest {
                    node_id: self.id.clone(),
                    deltas: true,
                },
                &self.secret,
            ))
            .await
        {
            Ok(s) => s.into_inner(),
            Err(e) => {
                return Some(format!(
                    "opening the alloc watch of node {}: {e}",
                    self.index
                ))
            }
        };
        // The jobs of this stream's allocs that have volumes to release:
        // a delta leaves out a job sent before.
        let mut jobs: HashMap<String, Arc<Job>> = HashMap::new();
        loop {
            let update = tokio::select! {
                _ = stop.wait() => return None,
                u = stream.message() => u,
            };
            let update = match update {
                Ok(Some(u)) => u,
                Ok(None) => return Some(format!("the alloc watch of node {} ended", self.index)),
                Err(e) => {
                    return Some(format!("the alloc watch of node {} broke: {e}", self.index))
                }
            };
            *failures = 0;
            let mut allocs = Vec::with_capacity(update.allocs_json.len());
            for raw in &update.allocs_json {
                match serde_json::from_slice::<Allocation>(raw) {
                    Ok(a) => allocs.push(a),
                    Err(e) => self.stats.fail(format!(
                        "node {}: an alloc that does not decode: {e}",
                        self.index
                    )),
                }
            }
            keep_jobs(&mut jobs, &mut allocs, &update);
            let mut updates = Vec::new();
            let mut releases = Vec::new();
            for a in &allocs {
                let was = reported.get(&a.id).copied();
                if a.server_terminal() {
                    if was == Some(AllocClientStatus::Running) {
                        releases.push(a.clone());
                        updates.push(status(a, AllocClientStatus::Complete, "Tasks stopped"));
                    }
                } else if was.is_none() && !a.client_status.is_terminal() {
                    match self.claim_volumes(a).await {
                        Ok(()) => {
                            updates.push(status(a, AllocClientStatus::Running, "Tasks are running"))
                        }
                        Err(e) => {
                            self.stats.fail(format!("{e:#}"));
                            updates.push(status(a, AllocClientStatus::Failed, "claim failed"));
                        }
                    }
                }
            }
            // The CSI hook's postrun (unpublish) runs before the alloc is
            // reported terminal.
            if self.unpublish {
                let releasing = releases.iter().map(|a| self.unpublish_volumes(a));
                for r in futures_util::future::join_all(releasing).await {
                    if let Err(e) = r {
                        self.stats.fail(format!("{e:#}"));
                    }
                }
            }
            if updates.is_empty() {
                continue;
            }
            let r = self.update_allocations(&updates).await;
            match r {
                Ok(_) => {
                    for u in updates {
                        let s: AllocClientStatus = match u.client_status.parse() {
                            Ok(s) => s,
                            Err(_) => continue,
                        };
                        let counter = match s {
                            AllocClientStatus::Running => &self.stats.running,
                            _ => &self.stats.complete,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        reported.insert(u.alloc_id, s);
                    }
                }
                Err(e) => self
                    .stats
                    .fail(format!("alloc updates of node {}: {e}", self.index)),
            }
        }
    }

    /// `CSIVolume.Claim` for each CSI volume of the alloc's group.
    async fn claim_volumes(&self, a: &Allocation) -> Result<()> {
        let Some(group) = a.group() else {
            return Ok(());
        };
        for req in group.volumes.values().filter(|v| v.volume_type == "csi") {
            let access = req
                .access_mode
                .unwrap_or(berth_structs::AccessMode::SingleNodeWriter);
            let claim = pb::ClaimRequest {
                volume_id: req.source_for(a.index),
                alloc_id: a.id.clone(),
                node_id: self.id.clone(),
                mode: access.claim_mode().as_str().into(),
                capability: Some(pb::VolumeCapability {
                    access_mode: access.as_str().into(),
                    attachment_mode: "file-system".into(),
                    fs_type: String::new(),
                    mount_flags: vec![],
                }),
            };
            self.csi
                .clone()
                .claim(with_secret(claim, &self.secret))
                .await
                .with_context(|| {
                    format!(
                        "claim of volume {} for alloc {} on node {}",
                        req.source_for(a.index),
                        a.id,
                        self.index
                    )
                })?;
            self.stats.claimed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// `CSIVolume.Unpublish` for each CSI volume of the alloc's group.
    async fn unpublish_volumes(&self, a: &Allocation) -> Result<()> {
        let Some(group) = a.group() else {
            return Ok(());
        };
        for req in group.volumes.values().filter(|v| v.volume_type == "csi") {
            let volume_id = req.source_for(a.index);
            let started = Instant::now();
            self.csi
                .clone()
                .unpublish(with_secret(
                    pb::UnpublishRequest {
                        volume_id: volume_id.clone(),
                        alloc_id: a.id.clone(),
                        node_id: self.id.clone(),
                    },
                    &self.secret,
                ))
                .await
                .with_context(|| {
                    format!(
                        "unpublish of volume {volume_id} for alloc {} on node {}",
                        a.id, self.index
                    )
                })?;
            self.stats
                .unpublishes
                .locked()
                .push((Instant::now(), started.elapsed()));
            self.stats.unpublished.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

fn status(a: &Allocation, s: AllocClientStatus, description: &str) -> pb::AllocStatusUpdate {
    pb::AllocStatusUpdate {
        alloc_id: a.id.clone(),
        client_status: s.as_str().into(),
        client_description: description.into(),
        ..Default::default()
    }
}

/// Gives the allocs of `update` sent without their job the one kept for
/// them, and keeps the jobs of allocs with CSI volumes (what releasing
/// them needs), as a client keeps its allocs.
fn keep_jobs(
    jobs: &mut HashMap<String, Arc<Job>>,
    allocs: &mut [Allocation],
    update: &pb::AllocationsUpdate,
) {
    if !update.delta {
        jobs.clear();
    }
    for id in &update.removed_ids {
        jobs.remove(id);
    }
    for a in allocs.iter_mut() {
        if update.same_job_ids.contains(&a.id) {
            if let Some(job) = jobs.get(&a.id) {
                a.job = job.clone();
            }
        } else if a
            .group()
            .is_some_and(|g| g.volumes.values().any(|v| v.volume_type == "csi"))
        {
            jobs.insert(a.id.clone(), a.job.clone());
        }
    }
}
