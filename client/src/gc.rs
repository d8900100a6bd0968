//! Which terminal allocs the client garbage collects. A terminal alloc's
//! runner, alloc dir (its logs) and records stay on the node until either
//! more than `gc_max_allocs` allocs are terminal, when the oldest go first
//! (by the time they became terminal), or it has been terminal for longer
//! than `gc_alloc_threshold`. The client decides which allocs are
//! candidates at all (postrun done, no volume left mounted, the servers
//! know the alloc ended); this module only picks among them.

use std::time::Duration;

use berth_allocrunner::AllocRunnerError;
use berth_structs::NodeEvent;

/// The node event message of an alloc dir kept because something is still
/// mounted below it.
pub const EVENT_ALLOC_DIR_KEPT: &str = "Alloc dir kept";

/// The garbage collection knobs of the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcPolicy {
    /// Terminal allocs kept; beyond it the oldest candidates go.
    pub max_allocs: usize,
    /// Candidates terminal for this long go, however few there are.
    pub alloc_threshold: Duration,
}

/// A terminal alloc that may be destroyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcCandidate {
    pub alloc_id: String,
    /// When it became terminal (unix ms).
    pub terminal_at_ms: i64,
}

impl GcPolicy {
    /// The candidates to destroy, oldest first: as many of the oldest as
    /// `terminal` (every terminal alloc on the node, candidate or not)
    /// exceeds `max_allocs` by, and every one older than the threshold at
    /// `now_ms`.
    pub fn allocs_to_destroy(
        &self,
        mut candidates: Vec<GcCandidate>,
        terminal: usize,
        now_ms: i64,
    ) -> Vec<String> {
        candidates.sort_by(|a, b| {
            a.terminal_at_ms
                .cmp(&b.terminal_at_ms)
                .then_with(|| a.alloc_id.cmp(&b.alloc_id))
        });
        let excess = terminal.saturating_sub(self.max_allocs);
        let threshold_ms = i64::try_from(self.alloc_threshold.as_millis()).unwrap_or(i64::MAX);
        candidates
            .into_iter()
            .enumerate()
            .filter(|(i, c)| *i < excess || now_ms.saturating_sub(c.terminal_at_ms) >= threshold_ms)
            .map(|(_, c)| c.alloc_id)
            .collect()
    }
}

/// The `Storage` node event for an alloc dir that destroying kept because
/// something is still mounted below it (it is tried again later); `None`
/// for other failures.
pub fn alloc_dir_kept_event(alloc_id: &str, error: &AllocRunnerError) -> Option<NodeEvent> {
    let AllocRunnerError::StillMounted { path, mounts } = error else {
        return None;
    };
    Some(
        NodeEvent::new(NodeEvent::SUBSYSTEM_STORAGE, EVENT_ALLOC_DIR_KEPT)
            .with_detail("alloc_id", alloc_id)
            .with_detail("path", path.display().to_string())
            .with_detail("mounts", mounts.join(", "))
            .with_detail("error", error.to_string()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alloc_dir_kept_for_its_mounts_is_a_storage_event() {
        let still = AllocRunnerError::StillMounted {
            path: "/d/alloc/a1".into(),
            mounts: vec!["/d/alloc/a1/web/data".into()],
        };
        let e = alloc_dir_kept_event("a1", &still).expect("an event");
        assert_eq!(e.subsystem, NodeEvent::SUBSYSTEM_STORAGE);
        assert_eq!(e.message, EVENT_ALLOC_DIR_KEPT);
        assert_eq!(e.details["alloc_id"], "a1");
        assert_eq!(e.details["path"], "/d/alloc/a1");
        assert_eq!(e.details["mounts"], "/d/alloc/a1/web/data");
        assert!(e.details["error"].contains("still has mounts"));
        let other = AllocRunnerError::VolumeStillRecorded {
            volume_id: "v".into(),
        };
        assert!(alloc_dir_kept_event("a1", &other).is_none());
    }

    const HOUR_MS: i64 = 60 * 60 * 1000;

    fn policy(max_allocs: usize) -> GcPolicy {
        GcPolicy {
            max_allocs,
            alloc_threshold: Duration::from_secs(60 * 60),
        }
    }

    fn candidate(id: &str, terminal_at_ms: i64) -> GcCandidate {
        GcCandidate {
            alloc_id: id.into(),
            terminal_at_ms,
        }
    }

    #[test]
    fn beyond_max_allocs_the_oldest_go_first() {
        let now = 10 * HOUR_MS;
        // Given out of order: the order is by the time they ended.
        let candidates = vec![
            candidate("c", now - 3),
            candidate("a", now - 5),
            candidate("d", now - 2),
            candidate("b", now - 4),
        ];
        assert_eq!(
            policy(2).allocs_to_destroy(candidates.clone(), 4, now),
            vec!["a", "b"]
        );
        assert!(policy(4)
            .allocs_to_destroy(candidates.clone(), 4, now)
            .is_empty());
        assert_eq!(
            policy(0).allocs_to_destroy(candidates, 4, now),
            vec!["a", "b", "c", "d"]
        );
    }

    #[test]
    fn terminal_allocs_that_are_not_candidates_count_towards_the_limit() {
        let now = 10 * HOUR_MS;
        // Five terminal allocs, two of them still holding a volume (not
        // candidates): two must go, the oldest candidates.
        let candidates = vec![
            candidate("x", now - 1),
            candidate("y", now - 2),
            candidate("z", now - 3),
        ];
        assert_eq!(
            policy(3).allocs_to_destroy(candidates, 5, now),
            vec!["z", "y"]
        );
    }

    #[test]
    fn allocs_terminal_longer_than_the_threshold_go_however_few() {
        let now = 10 * HOUR_MS;
        let candidates = vec![
            candidate("old", now - HOUR_MS - 1),
            candidate("exactly", now - HOUR_MS),
            candidate("young", now - HOUR_MS + 1),
        ];
        assert_eq!(
            policy(50).allocs_to_destroy(candidates, 3, now),
            vec!["old", "exactly"]
        );
    }

    #[test]
    fn extreme_values_do_not_wrap() {
        let p = GcPolicy {
            max_allocs: usize::MAX,
            alloc_threshold: Duration::MAX,
        };
        let candidates = vec![candidate("a", i64::MIN), candidate("b", i64::MAX)];
        // The age of "a" saturates at the longest threshold there is.
        assert_eq!(
            p.allocs_to_destroy(candidates.clone(), usize::MAX, i64::MAX),
            vec!["a"]
        );
        assert_eq!(
            policy(0).allocs_to_destroy(candidates, 0, i64::MIN),
            Vec::<String>::new()
        );
    }
}
