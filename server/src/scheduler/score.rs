//! Where a group prefers to go among the nodes that fit: its affinities
//! (fixed per node) and its spreads (which move as allocs are placed),
//! each scored in [-1, 1] and summed, as Nomad ranks them. Without either
//! every node scores 0 and the placer's other preferences decide.

use std::collections::HashMap;

use berth_structs::constraint::Target;
use berth_structs::{Allocation, Job, Node, TaskGroup};

use super::rules::OnNode;

/// A score in millionths: higher is better.
pub(super) type Score = i64;

const ONE: f64 = 1_000_000.0;

/// The values of one spread's attribute and how many of the group's
/// allocs each holds.
struct SpreadState {
    weight: f64,
    /// Each node's value (an index into `values`), by the node's position.
    value_of: Vec<Option<usize>>,
    values: Vec<ValueState>,
    /// Whether the spread has targets (else it is even).
    targeted: bool,
    count: f64,
}

struct ValueState {
    /// The allocs the targets ask on this value.
    desired: f64,
    placed: u64,
}

impl SpreadState {
    /// How much the spread wants one more alloc on a node of value `v`
    /// (or on one without the attribute): in [-1, 1].
    fn boost(&self, v: Option<usize>) -> f64 {
        let Some(v) = v.and_then(|v| self.values.get(v)) else {
            return -1.0;
        };
        let placed = v.placed as f64;
        if !self.targeted {
            // Even: the fewer there already, the better.
            return -(placed / self.count.max(1.0)).min(1.0);
        }
        if v.desired <= 0.0 {
            return -1.0;
        }
        ((v.desired - (placed + 1.0)) / v.desired).clamp(-1.0, 1.0)
    }
}

/// One group's scoring of the ready nodes, updated as it places. The
/// nodes fall into buckets, one per combination of the spreads' values
/// (one bucket without spreads): a spread moves the score of a bucket as
/// a whole, so the order within a bucket (by affinity, then the placer's
/// preferences) never changes with it.
pub(super) struct Scoring {
    /// The affinities' score, by node position (empty without any).
    affinity: Vec<Score>,
    spreads: Vec<SpreadState>,
    spread_weight: f64,
    /// Each node's bucket, by position.
    bucket_of: Vec<usize>,
    /// Each bucket's value of each spread.
    buckets: Vec<Vec<Option<usize>>>,
}

impl Scoring {
    /// `nodes` are the ready nodes in the placer's order, `live` the
    /// group's allocs that are not terminal (wherever they run).
    pub(super) fn new<'n>(
        job: &Job,
        group: &TaskGroup,
        nodes: &[&Node],
        live: impl Iterator<Item = &'n Allocation>,
        node_of: impl Fn(&str) -> Option<&'n Node>,
    ) -> Scoring {
        let affinities: Vec<_> = job
            .affinities
            .iter()
            .chain(&group.affinities)
            .chain(group.tasks.iter().flat_map(|t| &t.affinities))
            .collect();
        let affinity = if affinities.is_empty() {
            Vec::new()
        } else {
            let total: f64 = affinities.iter().map(|a| f64::from(a.weight).abs()).sum();
            let compiled: Vec<(f64, OnNode)> = affinities
                .iter()
                .map(|a| (f64::from(a.weight), OnNode::compile(&a.as_constraint())))
                .collect();
            nodes
                .iter()
                .map(|n| {
                    let met: f64 = compiled
                        .iter()
                        .filter(|(_, c)| c.met_by(n))
                        .map(|(w, _)| w)
                        .sum();
                    (met / total * ONE) as Score
                })
                .collect()
        };
        let all: Vec<_> = job.spreads.iter().chain(&group.spreads).collect();
        let running_on: Vec<&Node> = if all.is_empty() {
            Vec::new()
        } else {
            live.filter_map(|a| node_of(&a.node_id)).collect()
        };
        let spreads: Vec<SpreadState> = all
            .into_iter()
            .map(|s| spread_state(s, group.count, nodes, &running_on))
            .collect();
        let mut index: HashMap<Vec<Option<usize>>, usize> = HashMap::new();
        let mut buckets = Vec::new();
        let bucket_of = (0..nodes.len())
            .map(|pos| {
                let combo: Vec<Option<usize>> = spreads.iter().map(|s| s.value_of[pos]).collect();
                *index.entry(combo).or_insert_with_key(|combo| {
                    buckets.push(combo.clone());
                    buckets.len() - 1
                })
            })
            .collect();
        let spread_weight = spreads.iter().map(|s| s.weight).sum();
        Scoring {
            affinity,
            spreads,
            spread_weight,
            bucket_of,
            buckets,
        }
    }

    /// The affinities' score of the node at `pos`.
    pub(super) fn affinity(&self, pos: usize) -> Score {
        self.affinity.get(pos).copied().unwrap_or_default()
    }

    pub(super) fn bucket_of(&self, pos: usize) -> usize {
        self.bucket_of[pos]
    }

    pub(super) fn bucket_count(&self) -> usize {
        self.buckets.len().max(1)
    }

    /// The spreads' score of the nodes of bucket `b` now.
    pub(super) fn bucket_score(&self, b: usize) -> Score {
        let Some(combo) = self.buckets.get(b) else {
            return 0;
        };
        if self.spreads.is_empty() {
            return 0;
        }
        let spread: f64 = self
            .spreads
            .iter()
            .zip(combo)
            .map(|(s, v)| s.weight * s.boost(*v))
            .sum::<f64>()
            / self.spread_weight;
        (spread * ONE) as Score
    }

    /// Count an alloc placed on the node at `pos`.
    pub(super) fn placed(&mut self, pos: usize) {
        for s in &mut self.spreads {
            if let Some(v) = s.value_of[pos] {
                s.values[v].placed += 1;
            }
        }
    }
}

/// The state of spread `s` of a group of `count` allocs over `nodes`,
/// with `live` (the group's allocs that run) counted.
fn spread_state(
    s: &berth_structs::Spread,
    count: u32,
    nodes: &[&Node],
    live: &[&Node],
) -> SpreadState {
    let attribute = Target::parse(&s.attribute).unwrap_or(Target::Literal(String::new()));
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut values: Vec<ValueState> = Vec::new();
    let mut value_index = |v: &str, values: &mut Vec<ValueState>| -> usize {
        if let Some(&i) = index.get(v) {
            return i;
        }
        values.push(ValueState {
            desired: 0.0,
            placed: 0,
        });
        index.insert(v.to_string(), values.len() - 1);
        values.len() - 1
    };
    let value_of = nodes
        .iter()
        .map(|n| Some(value_index(attribute.value_on(n)?, &mut values)))
        .collect();
    for n in live {
        if let Some(v) = attribute.value_on(n) {
            let i = value_index(v, &mut values);
            values[i].placed += 1;
        }
    }
    let count = f64::from(count);
    let named: u32 = s.targets.iter().map(|t| u32::from(t.percent)).sum();
    let unnamed = index
        .keys()
        .filter(|v| !s.targets.iter().any(|t| t.value == **v))
        .count();
    // Values the targets do not name share what they leave of 100.
    let rest = f64::from(100u32.saturating_sub(named)) / 100.0 * count / unnamed.max(1) as f64;
    for (v, &i) in &index {
        values[i].desired = s
            .targets
            .iter()
            .find(|t| t.value == *v)
            .map_or(rest, |t| f64::from(t.percent) / 100.0 * count);
    }
    SpreadState {
        weight: f64::from(s.weight.max(1)),
        value_of,
        values,
        targeted: !s.targets.is_empty(),
        count,
    }
}
