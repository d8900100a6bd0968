//! Volume stats: one loop that asks node plugins, every interval, for the
//! usage and condition of each volume published for an alloc on this node
//! (`NodeGetVolumeStats`), and hands what changed noticeably to a
//! [`VolumeStatsSink`].
//!
//! One round at a time, its calls concurrent but bounded, each with the
//! CSI call deadline. Only plugins whose fingerprint advertises
//! `GET_VOLUME_STATS` are asked; the condition is read when they advertise
//! `VOLUME_CONDITION` too. A volume whose condition turns abnormal (or
//! normal again) becomes a `Storage` node event, once per transition. A
//! failing call is logged when its error changes and reported as the
//! volume's stats error; it never stops the loop.
//!
//! Reports are sparse on purpose: an alloc's stats are handed on only when
//! a condition or an error changed, a volume came or went, or a byte or
//! inode figure moved by at least 1% of its total. A fleet of idle volumes
//! costs the servers nothing.

use berth_sync::Shutdown;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use berth_proto::csi::v1 as csi;
use berth_structs::{CsiVolumeCondition, CsiVolumeStats, NodeEvent};
use csi::volume_usage::Unit;
use tokio::task::JoinSet;

use crate::error::CsiError;
use crate::manager::CsiManager;

/// How often stats are collected unless configured.
pub const DEFAULT_VOLUME_STATS_INTERVAL: Duration = Duration::from_secs(60);
/// The shortest interval allowed.
pub const MIN_VOLUME_STATS_INTERVAL: Duration = Duration::from_secs(1);
/// How many volumes of a round are asked at the same time.
pub const VOLUME_STATS_CONCURRENCY: usize = 8;

/// Node event messages of condition transitions (subsystem `Storage`).
pub const CONDITION_ABNORMAL: &str = "Volume condition abnormal";
pub const CONDITION_NORMAL: &str = "Volume condition normal";

/// Receives the stats of an alloc's volumes.
#[async_trait::async_trait]
pub trait VolumeStatsSink: Send + Sync + 'static {
    /// The stats of every volume of `alloc_id` that this node collects
    /// stats for, keyed by volume ID; called when one of them changed
    /// noticeably (see the module docs), not every round.
    async fn volume_stats_changed(&self, alloc_id: &str, stats: BTreeMap<String, CsiVolumeStats>);
}

/// One volume published for one alloc, whose plugin reports stats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StatsTarget {
    pub alloc_id: String,
    pub volume_id: String,
    pub external_id: String,
    pub plugin_id: String,
    /// The alloc's publish target.
    pub volume_path: PathBuf,
    /// The staging path, when the volume is staged.
    pub staging_path: Option<PathBuf>,
    /// Whether the plugin reports the volume's condition.
    pub condition: bool,
}

impl StatsTarget {
    fn key(&self) -> (String, String) {
        (self.alloc_id.clone(), self.volume_id.clone())
    }
}

/// Whether `new` differs enough from `old` (what was last reported) to be
/// reported: another condition, error, volume or plugin, a figure that
/// appeared or went, or one that moved by at least 1% of its total (any
/// move when the total is unknown or 0).
pub fn significant_change(old: &CsiVolumeStats, new: &CsiVolumeStats) -> bool {
    if old.condition != new.condition
        || old.error != new.error
        || old.volume_id != new.volume_id
        || old.plugin_id != new.plugin_id
    {
        return true;
    }
    let bytes_total = new.bytes_total.or(old.bytes_total);
    let inodes_total = new.inodes_total.or(old.inodes_total);
    [
        (old.bytes_total, new.bytes_total, bytes_total),
        (old.bytes_used, new.bytes_used, bytes_total),
        (old.bytes_available, new.bytes_available, bytes_total),
        (old.inodes_total, new.inodes_total, inodes_total),
        (old.inodes_used, new.inodes_used, inodes_total),
        (old.inodes_available, new.inodes_available, inodes_total),
    ]
    .into_iter()
    .any(|(o, n, total)| moved(o, n, total))
}

fn moved(old: Option<u64>, new: Option<u64>, total: Option<u64>) -> bool {
    match (old, new) {
        (None, None) => false,
        (Some(o), Some(n)) => {
            let delta = u128::from(o.abs_diff(n));
            match total {
                Some(t) if t > 0 => delta * 100 >= u128::from(t),
                _ => delta > 0,
            }
        }
        _ => true,
    }
}

/// The stats of a successful `NodeGetVolumeStats` answer.
pub(crate) fn stats_of(
    target: &StatsTarget,
    resp: &csi::NodeGetVolumeStatsResponse,
    now_ms: i64,
) -> CsiVolumeStats {
    let mut s = CsiVolumeStats {
        volume_id: target.volume_id.clone(),
        plugin_id: target.plugin_id.clone(),
        collected_at_ms: now_ms,
        ..CsiVolumeStats::default()
    };
    // The client refused negative figures.
    let fig = |v: i64| u64::try_from(v).ok();
    for u in &resp.usage {
        match Unit::try_from(u.unit) {
            Ok(Unit::Bytes) => {
                s.bytes_total = fig(u.total);
                s.bytes_used = fig(u.used);
                s.bytes_available = fig(u.available);
            }
            Ok(Unit::Inodes) => {
                s.inodes_total = fig(u.total);
                s.inodes_used = fig(u.used);
                s.inodes_available = fig(u.available);
            }
            _ => {}
        }
    }
    if target.condition {
        s.condition = resp.volume_condition.as_ref().map(|c| CsiVolumeCondition {
            abnormal: c.abnormal,
            message: c.message.clone(),
        });
    }
    s
}

/// The stats of a volume whose stats could not be collected.
pub(crate) fn failed_stats(target: &StatsTarget, error: &CsiError, now_ms: i64) -> CsiVolumeStats {
    CsiVolumeStats {
        volume_id: target.volume_id.clone(),
        plugin_id: target.plugin_id.clone(),
        error: Some(error.to_string()),
        collected_at_ms: now_ms,
        ..CsiVolumeStats::default()
    }
}

/// What is remembered of one volume of one alloc between rounds.
#[derive(Debug, Default)]
struct Tracked {
    /// What was last handed to the sink.
    sent: Option<CsiVolumeStats>,
    /// What the last round collected.
    latest: CsiVolumeStats,
    /// Whether the condition was last seen abnormal; `None` before any
    /// condition was seen.
    abnormal: Option<bool>,
}

/// What one round leads to.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct RoundOutcome {
    /// The full stats of each alloc to report, by volume ID.
    pub reports: BTreeMap<String, BTreeMap<String, CsiVolumeStats>>,
    /// Condition transitions.
    pub events: Vec<NodeEvent>,
}

/// Decides, round after round, what to report and which condition
/// transitions to announce. Knows nothing of plugins or time.
#[derive(Debug, Default)]
pub(crate) struct StatsTracker {
    /// By (alloc ID, volume ID).
    volumes: BTreeMap<(String, String), Tracked>,
}

impl StatsTracker {
    /// Whether no volume is tracked.
    pub(crate) fn is_empty(&self) -> bool {
        self.volumes.is_empty()
    }

    /// Takes one round's results: every volume asked, with what came back.
    /// Volumes not in it are no longer mounted (or no longer asked) and
    /// are forgotten.
    pub(crate) fn observe(&mut self, results: Vec<(StatsTarget, CsiVolumeStats)>) -> RoundOutcome {
        let mut outcome = RoundOutcome::default();
        let mut changed_allocs = BTreeSet::new();
        let now: BTreeSet<(String, String)> = results.iter().map(|(t, _)| t.key()).collect();
        self.volumes.retain(|key, _| {
            let keep = now.contains(key);
            if !keep {
                // An alloc that still has volumes reports the smaller set.
                changed_allocs.insert(key.0.clone());
            }
            keep
        });
        for (target, stats) in results {
            let key = target.key();
            let fresh = !self.volumes.contains_key(&key);
            let tracked = self.volumes.entry(key).or_default();
            let previous_error = if fresh {
                None
            } else {
                tracked.latest.error.clone()
            };
            if stats.error != previous_error {
                match &stats.error {
                    Some(e) => tracing::warn!(
                        alloc_id = %target.alloc_id,
                        volume_id = %target.volume_id,
                        plugin_id = %target.plugin_id,
                        error = %e,
                        "volume stats unavailable"
                    ),
                    None => tracing::info!(
                        alloc_id = %target.alloc_id,
                        volume_id = %target.volume_id,
                        plugin_id = %target.plugin_id,
                        "volume stats available again"
                    ),
                }
            }
            if let Some(c) = &stats.condition {
                let was = tracked.abnormal.replace(c.abnormal);
                let transition = match was {
                    None => c.abnormal,
                    Some(was) => was != c.abnormal,
                };
                if transition {
                    outcome.events.push(condition_event(&target, c));
                }
            }
            if tracked
                .sent
                .as_ref()
                .is_none_or(|sent| significant_change(sent, &stats))
            {
                changed_allocs.insert(target.alloc_id.clone());
            }
            tracked.latest = stats;
        }
        for alloc_id in changed_allocs {
            let mut report = BTreeMap::new();
            for ((a, volume_id), tracked) in
                self.volumes.range_mut((alloc_id.clone(), String::new())..)
            {
                if *a != alloc_id {
                    break;
                }
                tracked.sent = Some(tracked.latest.clone());
                report.insert(volume_id.clone(), tracked.latest.clone());
            }
            // An alloc with no volume left has nothing to say: its stats
            // stay as last reported.
            if !report.is_empty() {
                outcome.reports.insert(alloc_id, report);
            }
        }
        outcome
    }
}

fn condition_event(target: &StatsTarget, c: &CsiVolumeCondition) -> NodeEvent {
    let message = if c.abnormal {
        tracing::warn!(alloc_id = %target.alloc_id, volume_id = %target.volume_id,
            plugin_id = %target.plugin_id, condition = %c.message, "volume condition abnormal");
        CONDITION_ABNORMAL
    } else {
        tracing::info!(alloc_id = %target.alloc_id, volume_id = %target.volume_id,
            plugin_id = %target.plugin_id, condition = %c.message, "volume condition normal");
        CONDITION_NORMAL
    };
    NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, message)
        .with_detail("volume_id", target.volume_id.clone())
        .with_detail("alloc_id", target.alloc_id.clone())
        .with_detail("message", c.message.clone())
}

impl CsiManager {
    /// Collects volume stats every `interval` (see the module docs) and
    /// hands what changed to `sink`, until `shutdown` flips to true. A
    /// round cut short by shutdown is dropped.
    pub async fn run_volume_stats(
        self: Arc<Self>,
        sink: Arc<dyn VolumeStatsSink>,
        interval: Duration,
        mut shutdown: Shutdown,
    ) {
        let interval = interval.max(MIN_VOLUME_STATS_INTERVAL);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tracker = StatsTracker::default();
        loop {
            if shutdown.is_shutdown() {
                break;
            }
            tokio::select! {
                _ = shutdown.wait() => break,
                _ = tick.tick() => {}
            }
            let targets = self.volume_stats_targets();
            if targets.is_empty() && tracker.is_empty() {
                continue;
            }
            let started = tokio::time::Instant::now();
            let volumes = targets.len();
            let results = tokio::select! {
                r = self.collect_volume_stats(targets) => r,
                _ = shutdown.wait() => break,
            };
            let outcome = tracker.observe(results);
            tracing::debug!(
                volumes,
                reported_allocs = outcome.reports.len(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "volume stats round"
            );
            for e in outcome.events {
                self.emit_event(e);
            }
            for (alloc_id, stats) in outcome.reports {
                sink.volume_stats_changed(&alloc_id, stats).await;
            }
        }
        tracing::debug!("CSI volume stats loop stopped");
    }

    /// Every volume published for an alloc on this node whose plugin's last
    /// fingerprint advertises `GET_VOLUME_STATS`.
    pub(crate) fn volume_stats_targets(&self) -> Vec<StatsTarget> {
        let mut targets = Vec::new();
        let mut seen = BTreeSet::new();
        for stub in self.volume_stubs() {
            let Some(node) = self
                .plugin_fingerprint(&stub.plugin_id)
                .and_then(|fp| fp.node)
                .filter(|n| n.supports_volume_stats)
            else {
                continue;
            };
            for (alloc_id, target) in &stub.allocs {
                // An alloc using one volume in two ways is asked once.
                if !seen.insert((alloc_id.clone(), stub.volume_id.clone())) {
                    continue;
                }
                targets.push(StatsTarget {
                    alloc_id: alloc_id.clone(),
                    volume_id: stub.volume_id.clone(),
                    external_id: stub.external_id.clone(),
                    plugin_id: stub.plugin_id.clone(),
                    volume_path: target.clone(),
                    staging_path: stub.staged.then(|| stub.staging_path.clone()),
                    condition: node.supports_volume_condition,
                });
            }
        }
        targets
    }

    /// Asks for the stats of `targets`, at most
    /// [`VOLUME_STATS_CONCURRENCY`] at a time; every target gets a result.
    pub(crate) async fn collect_volume_stats(
        &self,
        targets: Vec<StatsTarget>,
    ) -> Vec<(StatsTarget, CsiVolumeStats)> {
        let mut results = Vec::with_capacity(targets.len());
        let mut pending = targets.into_iter();
        let mut running = JoinSet::new();
        loop {
            while running.len() < VOLUME_STATS_CONCURRENCY {
                let Some(target) = pending.next() else {
                    break;
                };
                let client = match self.client(&target.plugin_id).await {
                    Ok(c) => c,
                    Err(e) => {
                        let failed = failed_stats(&target, &e, berth_structs::now_ms());
                        results.push((target, failed));
                        continue;
                    }
                };
                running.spawn(async move {
                    let req = csi::NodeGetVolumeStatsRequest {
                        volume_id: target.external_id.clone(),
                        volume_path: target.volume_path.to_string_lossy().into_owned(),
                        staging_target_path: target
                            .staging_path
                            .as_ref()
                            .map(|p| p.to_string_lossy().into_owned())
                            .unwrap_or_default(),
                    };
                    let stats = match client.node_get_volume_stats(req).await {
                        Ok(resp) => stats_of(&target, &resp, berth_structs::now_ms()),
                        Err(e) => failed_stats(&target, &e, berth_structs::now_ms()),
                    };
                    (target, stats)
                });
            }
            match running.join_next().await {
                Some(Ok(r)) => results.push(r),
                Some(Err(e)) => tracing::error!(error = %e, "a volume stats call failed to run"),
                None => break,
            }
        }
        results
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(alloc: &str, volume: &str) -> StatsTarget {
        StatsTarget {
            alloc_id: alloc.into(),
            volume_id: volume.into(),
            external_id: format!("ext-{volume}"),
            plugin_id: "hostpath".into(),
            volume_path: PathBuf::from(format!("/csi/{alloc}/{volume}")),
            staging_path: None,
            condition: true,
        }
    }

    fn stats(used: u64, abnormal: Option<bool>) -> CsiVolumeStats {
        CsiVolumeStats {
            volume_id: "data".into(),
            plugin_id: "hostpath".into(),
            bytes_total: Some(1000),
            bytes_used: Some(used),
            bytes_available: Some(1000 - used),
            inodes_total: Some(100),
            inodes_used: Some(10),
            inodes_available: Some(90),
            condition: abnormal.map(|abnormal| CsiVolumeCondition {
                abnormal,
                message: if abnormal { "gone" } else { "ok" }.into(),
            }),
            error: None,
            collected_at_ms: used as i64,
        }
    }

    #[test]
    fn a_figure_must_move_by_one_percent_of_its_total() {
        let old = stats(100, None);
        assert!(!significant_change(&old, &stats(109, None)));
        assert!(significant_change(&old, &stats(110, None)));
        assert!(significant_change(&old, &stats(90, None)));
        // A new collection time alone is no change.
        let mut later = old.clone();
        later.collected_at_ms += 60_000;
        assert!(!significant_change(&old, &later));
        // A figure that appears or goes is.
        let mut gone = old.clone();
        gone.inodes_used = None;
        assert!(significant_change(&old, &gone));
        // Without a total, any move is.
        let mut a = old.clone();
        a.bytes_total = None;
        let mut b = a.clone();
        b.bytes_used = Some(101);
        assert!(significant_change(&a, &b));
    }

    #[test]
    fn a_condition_or_error_change_is_significant() {
        let old = stats(100, Some(false));
        assert!(significant_change(&old, &stats(100, Some(true))));
        assert!(significant_change(&old, &stats(100, None)));
        let mut failed = old.clone();
        failed.error = Some("boom".into());
        assert!(significant_change(&old, &failed));
        let mut failed_again = failed.clone();
        failed_again.collected_at_ms += 1;
        assert!(!significant_change(&failed, &failed_again));
    }

    #[test]
    fn huge_figures_do_not_overflow() {
        let mut old = stats(0, None);
        old.bytes_total = Some(u64::MAX);
        old.bytes_used = Some(0);
        let mut new = old.clone();
        new.bytes_used = Some(u64::MAX);
        assert!(significant_change(&old, &new));
    }

    #[test]
    fn only_noticeable_changes_are_reported_with_all_of_the_allocs_volumes() {
        let mut t = StatsTracker::default();
        let first = t.observe(vec![
            (target("a1", "data"), stats(100, None)),
            (target("a1", "logs"), stats(100, None)),
            (target("a2", "data"), stats(100, None)),
        ]);
        assert_eq!(first.reports.len(), 2, "everything is new: {first:?}");
        assert_eq!(first.reports["a1"].len(), 2);

        // Small moves: nothing to say.
        let quiet = t.observe(vec![
            (target("a1", "data"), stats(105, None)),
            (target("a1", "logs"), stats(100, None)),
            (target("a2", "data"), stats(101, None)),
        ]);
        assert!(quiet.reports.is_empty(), "{quiet:?}");

        // One volume of a1 moves: a1 reports both its volumes, a2 nothing.
        let moved = t.observe(vec![
            (target("a1", "data"), stats(300, None)),
            (target("a1", "logs"), stats(100, None)),
            (target("a2", "data"), stats(101, None)),
        ]);
        assert_eq!(moved.reports.keys().collect::<Vec<_>>(), vec!["a1"]);
        assert_eq!(moved.reports["a1"]["data"].bytes_used, Some(300));
        assert_eq!(moved.reports["a1"]["logs"].bytes_used, Some(100));

        // Moves are measured from what was reported, not from the last
        // round: creeping up 0.6% a round is reported once it adds up.
        let mut used = 300;
        let mut reported = 0;
        for _ in 0..3 {
            used += 6;
            let r = t.observe(vec![
                (target("a1", "data"), stats(used, None)),
                (target("a1", "logs"), stats(100, None)),
                (target("a2", "data"), stats(101, None)),
            ]);
            reported += r.reports.len();
        }
        assert_eq!(reported, 1);

        // A volume that goes: the alloc reports what is left; an alloc
        // with nothing left reports nothing.
        let gone = t.observe(vec![(target("a1", "data"), stats(used, None))]);
        assert_eq!(gone.reports.keys().collect::<Vec<_>>(), vec!["a1"]);
        assert_eq!(gone.reports["a1"].keys().collect::<Vec<_>>(), vec!["data"]);
    }

    #[test]
    fn a_condition_transition_is_one_event_each_way() {
        let mut t = StatsTracker::default();
        let quiet = t.observe(vec![(target("a1", "data"), stats(100, Some(false)))]);
        assert!(quiet.events.is_empty(), "a normal volume is no news");

        let bad = t.observe(vec![(target("a1", "data"), stats(100, Some(true)))]);
        assert_eq!(bad.events.len(), 1);
        let e = &bad.events[0];
        assert_eq!(e.subsystem, NodeEvent::SUBSYSTEM_STORAGE);
        assert_eq!(e.message, CONDITION_ABNORMAL);
        assert_eq!(e.details["volume_id"], "data");
        assert_eq!(e.details["alloc_id"], "a1");
        assert_eq!(e.details["message"], "gone");
        assert_eq!(bad.reports.len(), 1);

        let still = t.observe(vec![(target("a1", "data"), stats(100, Some(true)))]);
        assert!(still.events.is_empty() && still.reports.is_empty());
        // A failed round in between is not a transition.
        let mut failed = stats(100, None);
        failed.error = Some("deadline".into());
        let f = t.observe(vec![(target("a1", "data"), failed)]);
        assert!(f.events.is_empty());
        assert_eq!(f.reports.len(), 1, "the error is reported");

        let good = t.observe(vec![(target("a1", "data"), stats(100, Some(false)))]);
        assert_eq!(good.events.len(), 1);
        assert_eq!(good.events[0].message, CONDITION_NORMAL);

        // A volume abnormal from the start is announced.
        let mut t = StatsTracker::default();
        let r = t.observe(vec![(target("a2", "data"), stats(1, Some(true)))]);
        assert_eq!(r.events.len(), 1);
        assert_eq!(r.events[0].message, CONDITION_ABNORMAL);
    }

    #[test]
    fn a_response_becomes_stats() {
        let resp = csi::NodeGetVolumeStatsResponse {
            usage: vec![
                csi::VolumeUsage {
                    available: 700,
                    total: 1000,
                    used: 300,
                    unit: Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    available: 90,
                    total: 100,
                    used: 10,
                    unit: Unit::Inodes as i32,
                },
            ],
            volume_condition: Some(csi::VolumeCondition {
                abnormal: true,
                message: "data dir missing".into(),
            }),
        };
        let t = target("a1", "data");
        let s = stats_of(&t, &resp, 42);
        assert_eq!(
            (s.bytes_total, s.bytes_used, s.bytes_available),
            (Some(1000), Some(300), Some(700))
        );
        assert_eq!(
            (s.inodes_total, s.inodes_used, s.inodes_available),
            (Some(100), Some(10), Some(90))
        );
        assert!(s.condition.as_ref().unwrap().abnormal);
        assert_eq!(s.collected_at_ms, 42);
        assert_eq!(
            (s.volume_id.as_str(), s.plugin_id.as_str()),
            ("data", "hostpath")
        );
        // Without VOLUME_CONDITION the condition is not read.
        let mut no_cond = t.clone();
        no_cond.condition = false;
        assert_eq!(stats_of(&no_cond, &resp, 42).condition, None);
    }
}
