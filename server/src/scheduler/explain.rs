//! Placement failures as people read them: reasons collapsed with a count,
//! alloc indices as ranges, the first few nodes' reasons.

use std::collections::HashMap;

use berth_structs::text::count_of as plural;
use berth_structs::{Node, TaskGroup};

/// At most this many nodes' reasons are spelled out in one failure line.
const MAX_NODES_SHOWN: usize = 8;
/// At most this many index ranges or node names are listed in one line.
const MAX_ITEMS_SHOWN: usize = 5;

/// Items (alloc indices, node names) held back, collapsed by reason in the
/// order the reasons were first seen.
pub(super) struct Tally<T> {
    reasons: Vec<(String, Vec<T>)>,
    position: HashMap<String, usize>,
    pub(super) total: u64,
}

impl<T> Tally<T> {
    pub(super) fn new() -> Tally<T> {
        Tally {
            reasons: Vec::new(),
            position: HashMap::new(),
            total: 0,
        }
    }

    pub(super) fn add(&mut self, reason: &str, item: T) {
        self.total = self.total.saturating_add(1);
        match self.position.get(reason) {
            Some(&i) => self.reasons[i].1.push(item),
            None => {
                self.position.insert(reason.to_string(), self.reasons.len());
                self.reasons.push((reason.to_string(), vec![item]));
            }
        }
    }
}

/// Ascending alloc indices as ranges: `0-2, 5, 7-9`, the first few only.
pub(super) fn index_ranges(indices: &[u32]) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &i in indices {
        match ranges.last_mut() {
            Some((_, end)) if end.checked_add(1) == Some(i) => *end = i,
            _ => ranges.push((i, i)),
        }
    }
    let mut shown: Vec<String> = ranges
        .iter()
        .take(MAX_ITEMS_SHOWN)
        .map(|(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    if ranges.len() > MAX_ITEMS_SHOWN {
        shown.push("...".into());
    }
    shown.join(", ")
}

/// Why an alloc fits no node: each reason with the nodes it held back
/// (`node a: why`, `3 nodes (a, b, c): why`, names sorted), the first
/// few only.
pub(super) fn per_node_reasons(reasons: &[(&str, String)], ready_nodes: usize) -> String {
    if ready_nodes == 0 {
        return "no ready nodes".into();
    }
    let mut tally: Tally<&str> = Tally::new();
    for (node, why) in reasons {
        tally.add(why, node);
    }
    let mut shown = 0usize;
    let mut parts = Vec::new();
    for (why, nodes) in tally.reasons.iter().take(MAX_NODES_SHOWN) {
        shown += nodes.len();
        parts.push(match nodes.as_slice() {
            [one] => format!("node {one}: {why}"),
            _ => {
                let mut sorted = nodes.clone();
                sorted.sort_unstable();
                let mut names = sorted
                    .iter()
                    .take(MAX_ITEMS_SHOWN)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ");
                if nodes.len() > MAX_ITEMS_SHOWN {
                    names.push_str(", ...");
                }
                format!("{} ({names}): {why}", plural(nodes.len(), "node", "nodes"))
            }
        });
    }
    let mut out = parts.join("; ");
    if reasons.len() > shown {
        out.push_str(&format!(
            "; and {} more",
            plural(reasons.len() - shown, "node", "nodes")
        ));
    }
    out
}

/// One line per distinct reason of a service or batch group.
pub(super) fn service_failure_lines(group: &TaskGroup, tally: &Tally<u32>) -> Vec<String> {
    tally
        .reasons
        .iter()
        .map(|(reason, indices)| {
            format!(
                "group {:?}: {} of {} not placed: {reason} ({}: index {})",
                group.name,
                tally.total,
                plural(group.count as usize, "alloc", "allocs"),
                plural(indices.len(), "alloc", "allocs"),
                index_ranges(indices)
            )
        })
        .collect()
}

/// One line per distinct reason of a system group.
pub(super) fn system_failure_lines(
    group: &TaskGroup,
    tally: &Tally<String>,
    ready: usize,
) -> Vec<String> {
    tally
        .reasons
        .iter()
        .map(|(reason, nodes)| {
            let mut names = nodes
                .iter()
                .take(MAX_ITEMS_SHOWN)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ");
            if nodes.len() > MAX_ITEMS_SHOWN {
                names.push_str(&format!(" and {} more", nodes.len() - MAX_ITEMS_SHOWN));
            }
            format!(
                "group {:?}: not placed on {} of {} ready nodes: {reason} ({}: {names})",
                group.name,
                tally.total,
                ready,
                plural(nodes.len(), "node", "nodes"),
            )
        })
        .collect()
}

pub(super) trait NodeName {
    fn name_or_id(&self) -> &str;
}

impl NodeName for Node {
    fn name_or_id(&self) -> &str {
        if self.name.is_empty() {
            &self.id
        } else {
            &self.name
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_held_back_for_one_reason_are_counted_on_one_line() {
        let why = "constraint \"${node.unique.name} = c2\" not met";
        let reasons = [
            ("c3", why.to_string()),
            ("c2", "memory exhausted".to_string()),
            ("c1", why.to_string()),
        ];
        assert_eq!(
            per_node_reasons(&reasons, 3),
            format!("2 nodes (c1, c3): {why}; node c2: memory exhausted")
        );
        assert_eq!(per_node_reasons(&[], 0), "no ready nodes");
    }

    #[test]
    fn index_ranges_are_compact() {
        assert_eq!(index_ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(index_ranges(&[1, 3, 5, 7, 9, 11, 13]), "1, 3, 5, 7, 9, ...");
        assert_eq!(
            index_ranges(&[u32::MAX - 1, u32::MAX]),
            "4294967294-4294967295"
        );
    }
}
