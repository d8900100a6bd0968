//! Placement: the stops and placements a job needs against the tables,
//! for each job type, with nodes tried in the order a group prefers them.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::sync::Arc;

use berth_structs::{
    AllocClientStatus, AllocDesiredStatus, Allocation, Job, JobType, Node, NodeStatus, TaskGroup,
};

use crate::config::ServerConfig;
use crate::state::{Change, Tables};

use super::deploy::Rollout;
use super::explain::{
    per_node_reasons, service_failure_lines, system_failure_lines, NodeName, Tally,
};
use super::feasible::PlanContext;
use super::reconcile::{job_status, keeper, occupancy, Occupancy, PlanOutcome};
use super::rules::Distinct;
use super::score::{Score, Scoring};
use super::update::{update_kind, UpdateKind};

pub(super) fn new_alloc(
    job: &Arc<Job>,
    group: &TaskGroup,
    index: u32,
    node_id: &str,
) -> Allocation {
    Allocation {
        id: berth_structs::generate_id(),
        name: format!("{}.{}[{}]", job.id, group.name, index),
        job_id: job.id.clone(),
        job: Arc::clone(job),
        task_group: group.name.clone(),
        index,
        node_id: node_id.to_string(),
        desired_status: AllocDesiredStatus::Run,
        ..Default::default()
    }
}

pub(super) fn stop(a: &Allocation, why: &str) -> Allocation {
    let mut a = a.clone();
    a.desired_status = AllocDesiredStatus::Stop;
    a.desired_description = why.to_string();
    a
}

/// The placement computation of one job against the tables: the stops and
/// placements `job` needs (as changes), and its status. `job` is the
/// stored job, or (for a plan) the job as a registration would store it;
/// nothing here writes or logs, so that a plan runs exactly what a
/// registration's evaluation runs.
pub(crate) fn place(
    t: &Tables,
    job: &Job,
    cfg: &ServerConfig,
    now_ms: i64,
    changes: &mut Vec<Change>,
) -> PlanOutcome {
    let stored: Vec<&Allocation> = t.allocs_of_job(&job.id).collect();
    let rollout = Rollout::open(t, job, changes);
    let mut placer = Placer {
        job,
        shared_job: crate::state::shared_copy(job, &stored),
        cfg,
        now_ms,
        nodes: Vec::new(),
        ctx: PlanContext::new(t, job),
        // The allocs of the job as they will be after this plan.
        after: stored
            .iter()
            .map(|a| (a.id.clone(), (*a).clone()))
            .collect(),
        changes,
        outcome: PlanOutcome::default(),
        rollout,
        canary_indexes: BTreeMap::new(),
        placing_canary: None,
    };
    placer.expire_unknown(&stored);
    let allocs: Vec<Allocation> = placer.after.values().cloned().collect();
    let allocs: Vec<&Allocation> = allocs.iter().collect();
    if job.stop {
        placer.stop_all(&allocs);
    } else {
        placer.stop_outdated(&allocs);
        placer.nodes = t
            .nodes
            .values()
            .filter(|n| n.status == NodeStatus::Ready)
            .collect();
        for group in &job.task_groups {
            // This version's allocs, and the live ones of older versions a
            // rolling update has not replaced yet (they hold their index).
            let current: Vec<Allocation> = placer
                .after
                .values()
                .filter(|a| {
                    a.task_group == group.name && (a.job.version == job.version || !a.is_terminal())
                })
                .cloned()
                .collect();
            match job.job_type {
                JobType::System => placer.place_system_group(group, &current),
                JobType::Service | JobType::Batch => placer.place_indexed_group(group, &current),
            }
        }
    }
    let Placer {
        after,
        mut outcome,
        rollout,
        changes,
        ..
    } = placer;
    rollout.finish(t, job, now_ms, &after, changes, &mut outcome);
    let status = job_status(job, &after, &outcome);
    if status != job.status {
        let mut j = job.clone();
        j.status = status;
        changes.push(Change::PutJob(j));
    }
    outcome
}

/// One placement computation under way: what it sees and what it has
/// decided so far.
struct Placer<'a, 'c> {
    job: &'a Job,
    /// The copy of the job its new and updated allocs hold.
    shared_job: Arc<Job>,
    cfg: &'a ServerConfig,
    now_ms: i64,
    /// The ready nodes (set once the job's stops are decided).
    nodes: Vec<&'a Node>,
    ctx: PlanContext<'a>,
    /// The allocs of the job as they will be after this plan.
    after: BTreeMap<String, Allocation>,
    changes: &'c mut Vec<Change>,
    outcome: PlanOutcome,
    /// The deployment of the job's version.
    rollout: Rollout,
    /// The indexes each group places canaries at.
    canary_indexes: BTreeMap<String, Vec<u32>>,
    /// The deployment the allocs being placed are canaries of.
    placing_canary: Option<String>,
}

impl Placer<'_, '_> {
    /// Write `a` (a stop or a placement).
    fn put(&mut self, a: Allocation) {
        self.after.insert(a.id.clone(), a.clone());
        self.changes.push(Change::PutAlloc(a));
    }

    /// The `unknown` allocs whose `lost_after` has passed are lost.
    fn expire_unknown(&mut self, allocs: &[&Allocation]) {
        for a in allocs {
            let due = a.disconnected.as_ref().map_or(0, |d| d.lost_at_ms);
            if a.client_status == AllocClientStatus::Unknown && due <= self.now_ms {
                let mut a = (*a).clone();
                a.mark_lost("alloc is lost: its node was down longer than disconnect lost_after");
                self.put(a);
            }
        }
    }

    /// Allocs of one index of `group` that run at once (an original whose
    /// node came back beside its replacement): the group's `disconnect {
    /// reconcile }` keeps one and the others are stopped. The stopped
    /// allocs' IDs.
    fn reconcile_reconnected(
        &mut self,
        group: &TaskGroup,
        current: &[Allocation],
    ) -> BTreeSet<String> {
        let mut by_index: BTreeMap<u32, Vec<&Allocation>> = BTreeMap::new();
        for a in current {
            // A canary runs beside the old alloc of its index on purpose.
            let canary = a.deployment.as_ref().is_some_and(|d| d.canary);
            if !a.is_terminal() && a.client_status != AllocClientStatus::Unknown && !canary {
                by_index.entry(a.index).or_default().push(a);
            }
        }
        let strategy = group
            .on_disconnect(self.job.job_type, self.cfg.default_lost_after)
            .reconcile;
        let mut stopped = BTreeSet::new();
        for live in by_index.values().filter(|l| l.len() > 1) {
            let keep = keeper(live, strategy, |a| self.node_rank(&a.node_id));
            for a in live.iter().filter(|a| a.id != keep.id) {
                let why = format!(
                    "alloc {} of the same index runs (disconnect reconcile = {})",
                    keep.id.get(..8).unwrap_or(&keep.id),
                    strategy.as_str()
                );
                tracing::info!(alloc_id = %a.id, kept = %keep.id, "stopping a duplicate after a reconnect");
                self.ctx.remove(a);
                self.put(stop(a, &why));
                stopped.insert(a.id.clone());
            }
        }
        stopped
    }

    /// How the scheduler ranks a node for a group now (smaller is better):
    /// a node not ready last.
    fn node_rank(&self, node_id: &str) -> (usize, Reverse<u64>, usize) {
        let job_on_node = HashMap::new();
        match self.nodes.iter().position(|n| n.id == node_id) {
            Some(pos) => preference(&self.ctx, &job_on_node, self.nodes[pos], pos),
            None => (usize::MAX, Reverse(0), usize::MAX),
        }
    }

    /// A stopped job: every alloc not stopped yet is stopped.
    fn stop_all(&mut self, allocs: &[&Allocation]) {
        for a in allocs {
            if !a.server_terminal() {
                self.put(stop(a, "job stopped"));
            }
        }
    }

    /// Move the allocs of an older version of the job to this one: in
    /// place where the change leaves their tasks as they are (see
    /// `update`), else stop them (a destructive update: their index is
    /// placed anew); and stop those of a group the job no longer has.
    fn stop_outdated(&mut self, allocs: &[&Allocation]) {
        let mut destructive: BTreeMap<&str, Vec<&Allocation>> = BTreeMap::new();
        for a in allocs {
            if a.server_terminal() {
                continue;
            }
            let outdated = a.job.version != self.job.version;
            let group = self.job.lookup_group(&a.task_group);
            let gone = group.is_none();
            if let (true, Some(group)) = (outdated, group) {
                let in_place = match update_kind(&a.job, self.job, &a.task_group) {
                    UpdateKind::InPlace => true,
                    UpdateKind::InPlaceIfNodeFits => {
                        self.ctx.tables().nodes.get(&a.node_id).is_some_and(|node| {
                            self.ctx.rules_unmet(self.job, group, node).is_none()
                        })
                    }
                    UpdateKind::Destructive => false,
                };
                if in_place {
                    let mut updated = (*a).clone();
                    updated.job = Arc::clone(&self.shared_job);
                    self.put(updated);
                    continue;
                }
                destructive.entry(&group.name).or_default().push(a);
                continue;
            }
            if gone {
                let why = if gone {
                    "group removed from the job"
                } else {
                    "job updated"
                };
                self.ctx.remove(a);
                self.put(stop(a, why));
            }
        }
        for g in &self.job.task_groups {
            let live = destructive
                .get(g.name.as_str())
                .map_or(0, |olds| olds.iter().filter(|a| !a.is_terminal()).count());
            self.rollout.settle_canaries(&g.name, live);
        }
        for (group, mut olds) in destructive {
            let Some(group) = self.job.lookup_group(group) else {
                continue;
            };
            olds.sort_by_key(|a| a.index);
            if let Some(want) = self.rollout.canary_phase(&group.name) {
                // Canaries first, beside the old allocs, which all stay
                // until the deployment is promoted.
                let indexes = self.rollout.canary_indexes(group, &olds, &self.after, want);
                self.canary_indexes.insert(group.name.clone(), indexes);
                continue;
            }
            // Promoted: an old alloc whose index a canary holds is
            // replaced by it.
            let held = self.rollout.canaries_held(&group.name, &self.after);
            let (replaced, olds): (Vec<&Allocation>, Vec<&Allocation>) =
                olds.into_iter().partition(|a| held.contains(&a.index));
            for a in replaced {
                self.ctx.remove(a);
                self.put(stop(a, "replaced by a promoted canary"));
            }
            let mut replace_now = self.rolling_budget(group, &olds);
            for a in olds {
                // A finished alloc is replaced without counting.
                let now = a.is_terminal() || replace_now > 0;
                if !a.is_terminal() && now {
                    replace_now -= 1;
                }
                if now {
                    self.ctx.remove(a);
                    self.put(stop(a, "job updated"));
                }
            }
        }
    }

    /// How many of a group's live allocs of older versions (`olds`, by
    /// index) a destructive update replaces now: all of them without a
    /// rolling `update` block (or for a batch or system job); else
    /// `max_parallel` less the allocs of this version not healthy yet,
    /// noting when the next of those turns healthy (the job is evaluated
    /// again then, and whenever allocs change).
    fn rolling_budget(&mut self, group: &TaskGroup, olds: &[&Allocation]) -> usize {
        let strategy = match self.job.update_strategy(group) {
            Some(s) if s.rolls() && self.job.job_type != JobType::Batch => s,
            _ => return olds.len(),
        };
        if self.job.job_type == JobType::System {
            return self.staggered_budget(group, strategy, olds);
        }
        if self.rollout.halted() {
            // The version's deployment failed: the rest keep running.
            return 0;
        }
        let mut unhealthy = 0usize;
        let mut next_healthy: Option<i64> = None;
        // A failed alloc of this version counts until it is replaced: a
        // roll does not go on past it.
        let counts = |a: &Allocation| {
            !a.is_terminal()
                || (a.client_status == AllocClientStatus::Failed
                    && !a.server_terminal()
                    && a.next_allocation.is_empty())
        };
        for a in self.after.values().filter(|a| {
            a.task_group == group.name && a.job.version == self.job.version && counts(a)
        }) {
            match strategy.healthy_at_ms(a) {
                Some(at) if at <= self.now_ms => {}
                at => {
                    unhealthy += 1;
                    if let Some(at) = at {
                        next_healthy = Some(next_healthy.map_or(at, |n| n.min(at)));
                    }
                }
            }
        }
        let live = olds.iter().filter(|a| !a.is_terminal()).count();
        let budget = (strategy.max_parallel as usize).saturating_sub(unhealthy);
        if live > budget {
            self.outcome.delayed = true;
            if let Some(at) = next_healthy {
                self.outcome.delay_until(at);
            }
        }
        budget
    }

    /// How many old allocs of a system group (`olds`) a destructive
    /// update replaces now: `max_parallel`, and the next ones `stagger`
    /// after the last of those were stopped (system jobs have no
    /// deployments: a roll waits on the clock, as Nomad's does).
    fn staggered_budget(
        &mut self,
        group: &TaskGroup,
        strategy: &berth_structs::UpdateStrategy,
        olds: &[&Allocation],
    ) -> usize {
        let stagger = i64::try_from(strategy.stagger.as_millis()).unwrap_or(i64::MAX);
        let live = olds.iter().filter(|a| !a.is_terminal()).count();
        let last_stop = self
            .after
            .values()
            .filter(|a| {
                a.task_group == group.name
                    && a.job.version < self.job.version
                    && a.server_terminal()
                    && a.desired_description == "job updated"
            })
            .map(|a| a.modify_time_ms)
            .max();
        if let Some(next) = last_stop
            .map(|at| at.saturating_add(stagger))
            .filter(|next| *next > self.now_ms)
        {
            if live > 0 {
                self.outcome.delay_until(next);
            }
            return 0;
        }
        let budget = strategy.max_parallel as usize;
        if live > budget {
            self.outcome
                .delay_until(self.now_ms.saturating_add(stagger));
        }
        budget
    }

    /// A system group: one alloc per eligible ready node that fits.
    fn place_system_group(&mut self, group: &TaskGroup, current: &[Allocation]) {
        let job = self.job;
        if group.count == 0 {
            for a in current.iter().filter(|a| !a.is_terminal()) {
                self.ctx.remove(a);
                self.put(stop(a, "count is 0"));
            }
            return;
        }
        // A system job runs on every eligible ready node; an ineligible
        // one is no target (its allocs there stay until a drain stops
        // them).
        let targets: Vec<&Node> = self
            .nodes
            .iter()
            .copied()
            .filter(|n| n.is_eligible())
            .collect();
        let ready = targets.len();
        self.outcome.counts.desired = self.outcome.counts.desired.saturating_add(ready as u64);
        let mut tally = Tally::new();
        let mut current_on: HashMap<&str, Vec<&Allocation>> = HashMap::new();
        for a in current {
            current_on.entry(a.node_id.as_str()).or_default().push(a);
        }
        for node in &targets {
            let here = current_on
                .get(node.id.as_str())
                .map_or(&[][..], Vec::as_slice);
            if self.held_on_node(here, group) {
                continue;
            }
            let alloc = new_alloc(&self.shared_job, group, 0, &node.id);
            match self.ctx.infeasible(job, group, 0, &alloc.id, node) {
                Some(why) => tally.add(&why, node.name_or_id().to_string()),
                None => {
                    self.ctx.add(&alloc);
                    self.put(alloc);
                }
            }
        }
        self.outcome.note_unplaced(group, tally.total);
        self.outcome
            .failures
            .extend(system_failure_lines(group, &tally, ready));
    }

    /// Whether one of a system group's allocs `here` (on one node) holds
    /// the node, noting a delay one of them waits for.
    fn held_on_node(&mut self, here: &[&Allocation], group: &TaskGroup) -> bool {
        let mut held = false;
        for a in here {
            match occupancy(a, self.job, group, self.cfg, self.now_ms) {
                Occupancy::Free => {}
                Occupancy::Held => held = true,
                Occupancy::Delayed(until) => {
                    self.outcome.delay_until(until);
                    held = true;
                }
                Occupancy::FreeUntil(until) => self.outcome.delay_until(until),
            }
        }
        held
    }

    /// A service or batch group: `count` allocs, one per index.
    fn place_indexed_group(&mut self, group: &TaskGroup, current: &[Allocation]) {
        self.outcome.counts.desired = self
            .outcome
            .counts
            .desired
            .saturating_add(u64::from(group.count));
        let stopped = self.reconcile_reconnected(group, current);
        let current: Vec<Allocation> = current
            .iter()
            .filter(|a| !stopped.contains(&a.id))
            .cloned()
            .collect();
        let current = current.as_slice();
        self.release_waiting(group, current);
        let occupied = self.occupied_indices(group, current);
        // Count lowered: stop the live allocs above it.
        for a in current
            .iter()
            .filter(|a| !a.is_terminal() && a.index >= group.count)
        {
            self.ctx.remove(a);
            self.put(stop(a, "count reduced"));
        }
        let mut indexed = IndexedPlacement::new(self, group);
        let failed = last_failed_by_index(current);
        for index in 0..group.count {
            if !occupied.contains(&index) {
                self.place_index(&mut indexed, group, index, failed.get(&index).copied());
            }
        }
        // The canaries of a deployment, at the indexes of old allocs.
        self.placing_canary = self.rollout.id();
        for index in self.canary_indexes.remove(&group.name).unwrap_or_default() {
            self.place_index(&mut indexed, group, index, None);
        }
        self.placing_canary = None;
        self.outcome.note_unplaced(group, indexed.tally.total);
        self.outcome
            .failures
            .extend(service_failure_lines(group, &indexed.tally));
    }

    /// The allocs of `current` that wait for the claims of the allocs
    /// they replace go to their nodes once those claims are released;
    /// until then the job is evaluated again whenever claims are freed.
    fn release_waiting(&mut self, group: &TaskGroup, current: &[Allocation]) {
        for a in current.iter().filter(|a| a.waits_for_claims()) {
            let Some(node) = self.ctx.tables().nodes.get(&a.node_id) else {
                continue;
            };
            if self
                .ctx
                .volumes_infeasible(group, a.index, &a.id, node)
                .is_none()
            {
                let mut ready = a.clone();
                ready.waiting_for_claims_of.clear();
                self.put(ready);
            } else {
                self.outcome
                    .waiting
                    .push(waiting_line(group, &a.name, &a.waiting_for_claims_of));
                self.outcome.delayed = true;
            }
        }
    }

    /// The indices of a service or batch group that its `current` allocs
    /// hold, noting the delays some of them wait for.
    fn occupied_indices(&mut self, group: &TaskGroup, current: &[Allocation]) -> BTreeSet<u32> {
        let mut occupied = BTreeSet::new();
        for a in current {
            let occupies = match occupancy(a, self.job, group, self.cfg, self.now_ms) {
                Occupancy::Free => false,
                Occupancy::Held => true,
                Occupancy::Delayed(until) => {
                    self.outcome.delay_until(until);
                    true
                }
                Occupancy::FreeUntil(until) => {
                    self.outcome.delay_until(until);
                    false
                }
            };
            if occupies {
                occupied.insert(a.index);
            }
        }
        occupied
    }

    /// Place alloc `index` of a service or batch group on the best node
    /// that fits (or that fits once the allocs it replaces release their
    /// claims), or tally why none does. `failed` is the failed alloc it
    /// replaces, if any.
    fn place_index(
        &mut self,
        indexed: &mut IndexedPlacement,
        group: &TaskGroup,
        index: u32,
        failed: Option<&Allocation>,
    ) {
        let job = self.job;
        if let Some(reason) = &indexed.group_blocked {
            indexed.tally.add(reason, index);
            return;
        }
        let mut alloc = new_alloc(&self.shared_job, group, index, "");
        if let Some(id) = &self.placing_canary {
            alloc.deployment = Some(berth_structs::AllocDeployment {
                id: id.clone(),
                canary: true,
                ..Default::default()
            });
        }
        let mut best = None;
        let mut gone = Vec::new();
        for pos in indexed.in_order() {
            let node = self.nodes[pos];
            if self.ctx.node_infeasible(job, group, node).is_some()
                || indexed.distinct.refuses(node).is_some()
            {
                gone.push(pos);
            } else if self
                .ctx
                .volumes_infeasible(group, index, &alloc.id, node)
                .is_some()
            {
                // A per_alloc volume's check is this index's: the node
                // may fit the next one.
                if indexed.same_for_every_index {
                    gone.push(pos);
                }
            } else {
                best = Some(pos);
                break;
            }
        }
        for pos in gone {
            indexed.remove(pos);
        }
        if let Some(pos) = best {
            self.commit(indexed, group, pos, alloc, failed);
            return;
        }
        // A node that fits but for the claims of allocs on their way out
        // (the allocs this one replaces): placed, it waits for them.
        if let Some((pos, waits)) = self.waiting_placement(indexed, group, index, &alloc.id) {
            self.outcome
                .waiting
                .push(waiting_line(group, &alloc.name, &waits));
            self.outcome.delayed = true;
            alloc.waiting_for_claims_of = waits;
            self.commit(indexed, group, pos, alloc, failed);
            return;
        }
        // Nothing fits: every node's reason, as the failure shows them.
        let reasons: Vec<(&str, String)> = self
            .nodes
            .iter()
            .filter_map(|node| {
                let why = self
                    .ctx
                    .infeasible(job, group, index, &alloc.id, node)
                    .or_else(|| indexed.distinct.refuses(node))?;
                Some((node.name_or_id(), why))
            })
            .collect();
        let reason = per_node_reasons(&reasons, self.nodes.len());
        indexed.tally.add(&reason, index);
        if indexed.same_for_every_index {
            indexed.group_blocked = Some(reason);
        }
    }

    /// The best node for alloc `index` of `group` that fits but for the
    /// volume claims of allocs on their way out, and those allocs.
    fn waiting_placement(
        &self,
        indexed: &IndexedPlacement,
        group: &TaskGroup,
        index: u32,
        alloc_id: &str,
    ) -> Option<(usize, Vec<String>)> {
        if group.volumes.is_empty() {
            return None;
        }
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, node)| {
                self.ctx.node_infeasible(self.job, group, node).is_none()
                    && indexed.distinct.refuses(node).is_none()
            })
            .filter_map(|(pos, node)| {
                let waits = self
                    .ctx
                    .volumes_wait(self.job, group, index, alloc_id, node)?;
                Some((
                    preference(&self.ctx, &indexed.job_on_node, node, pos),
                    pos,
                    waits,
                ))
            })
            .min_by_key(|(key, _, _)| *key)
            .map(|(_, pos, waits)| (pos, waits))
    }

    /// Place `alloc` on the node at `pos`: count it where the group's
    /// placements are counted; a placement that replaces the failed alloc
    /// `failed` is a reschedule (it carries the attempts before it and
    /// one more, and `failed` records its successor).
    fn commit(
        &mut self,
        indexed: &mut IndexedPlacement,
        group: &TaskGroup,
        pos: usize,
        mut alloc: Allocation,
        failed: Option<&Allocation>,
    ) {
        let node = self.nodes[pos];
        alloc.node_id = node.id.clone();
        self.ctx.add(&alloc);
        indexed.distinct.add(true, node);
        let n = indexed.job_on_node.entry(node.id.clone()).or_default();
        *n = n.saturating_add(1);
        indexed.scoring.placed(pos);
        indexed.rekey(&self.ctx, &self.nodes, pos);
        if let Some(prev) = failed {
            let policy = self.job.reschedule_policy(group);
            let delay = policy.next_delay(&prev.reschedule_events, prev.failed_at_ms());
            alloc.previous_allocation = prev.id.clone();
            alloc.reschedule_events = prev.reschedule_events.clone();
            alloc
                .reschedule_events
                .push(berth_structs::RescheduleEvent {
                    time_ms: self.now_ms,
                    prev_alloc_id: prev.id.clone(),
                    prev_node_id: prev.node_id.clone(),
                    delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                });
            let mut replaced = prev.clone();
            replaced.next_allocation = alloc.id.clone();
            self.put(replaced);
        }
        self.put(alloc);
    }
}

/// What a plan says of alloc `name` placed to wait for the claims of
/// `waits`.
fn waiting_line(group: &TaskGroup, name: &str, waits: &[String]) -> String {
    let shown: Vec<&str> = waits.iter().map(|id| id.get(..8).unwrap_or(id)).collect();
    format!(
        "group {:?}: {name} waits for the claims of alloc {} to be released",
        group.name,
        shown.join(", ")
    )
}

/// Per index, the newest failed alloc not replaced yet (the one a new
/// alloc at that index reschedules).
fn last_failed_by_index(current: &[Allocation]) -> BTreeMap<u32, &Allocation> {
    let mut out: BTreeMap<u32, &Allocation> = BTreeMap::new();
    for a in current.iter().filter(|a| {
        a.client_status == AllocClientStatus::Failed
            && a.next_allocation.is_empty()
            && !a.server_terminal()
    }) {
        let newer = out
            .get(&a.index)
            .is_none_or(|b| (a.create_index, &a.id) > (b.create_index, &b.id));
        if newer {
            out.insert(a.index, a);
        }
    }
    out
}

/// The placements of one service or batch group under way.
struct IndexedPlacement {
    /// The job's live allocs per node, for spreading.
    job_on_node: HashMap<String, usize>,
    /// The same for the group's `distinct_hosts` and `distinct_property`.
    distinct: Distinct,
    /// Without per_alloc volumes every index of the group asks the same:
    /// once one fits no node (and nothing was placed since), the rest fit
    /// none, for the same reason.
    same_for_every_index: bool,
    group_blocked: Option<String>,
    tally: Tally<u32>,
    /// The candidate nodes of each bucket of `scoring`, in the order the
    /// group prefers them (its affinities, then the job's allocs spread,
    /// then free memory, then the nodes' order); the buckets merged by
    /// their spread score are the group's order of all nodes
    /// ([`IndexedPlacement::in_order`]). The first node that fits is the
    /// best, and one that fails a check no later placement of the group
    /// can undo leaves, so that a placement costs what it looks at, not
    /// every node.
    buckets: Vec<BTreeSet<Key>>,
    /// Each node's key in its bucket, by position; None once it left.
    keys: Vec<Option<Key>>,
    scoring: Scoring,
}

/// A node's place among the candidates: smaller is better.
type Key = (Reverse<Score>, (usize, Reverse<u64>, usize));

impl IndexedPlacement {
    fn new(placer: &Placer<'_, '_>, group: &TaskGroup) -> IndexedPlacement {
        let mut job_on_node: HashMap<String, usize> = HashMap::new();
        for a in placer.after.values().filter(|a| !a.is_terminal()) {
            let n = job_on_node.entry(a.node_id.clone()).or_default();
            *n = n.saturating_add(1);
        }
        let live = || placer.after.values().filter(|a| !a.is_terminal());
        let node_of = |id: &str| placer.ctx.tables().nodes.get(id);
        let scoring = Scoring::new(
            placer.job,
            group,
            &placer.nodes,
            live().filter(|a| a.task_group == group.name),
            node_of,
        );
        let mut buckets = vec![BTreeSet::new(); scoring.bucket_count()];
        let keys: Vec<Option<Key>> = placer
            .nodes
            .iter()
            .enumerate()
            .map(|(pos, node)| {
                let key = (
                    Reverse(scoring.affinity(pos)),
                    preference(&placer.ctx, &job_on_node, node, pos),
                );
                buckets[scoring.bucket_of(pos)].insert(key);
                Some(key)
            })
            .collect();
        let distinct = Distinct::new(placer.ctx.rules(&group.name), &group.name, live(), node_of);
        IndexedPlacement {
            job_on_node,
            distinct,
            same_for_every_index: !group.volumes.values().any(|r| r.per_alloc),
            group_blocked: None,
            tally: Tally::new(),
            buckets,
            keys,
            scoring,
        }
    }

    /// The candidate nodes' positions, best first.
    fn in_order(&self) -> InOrder<'_> {
        let mut iters: Vec<_> = self.buckets.iter().map(BTreeSet::iter).collect();
        let bonus: Vec<Score> = (0..iters.len())
            .map(|b| self.scoring.bucket_score(b))
            .collect();
        let heap = iters
            .iter_mut()
            .enumerate()
            .filter_map(|(b, it)| Some(Reverse((shifted(*it.next()?, bonus[b]), b))))
            .collect();
        InOrder { heap, iters, bonus }
    }

    /// The node at `pos` is no candidate any more.
    fn remove(&mut self, pos: usize) {
        if let Some(old) = self.keys[pos].take() {
            self.buckets[self.scoring.bucket_of(pos)].remove(&old);
        }
    }

    /// Move the node at `pos` to its place now, if it is a candidate.
    fn rekey(&mut self, ctx: &PlanContext<'_>, nodes: &[&Node], pos: usize) {
        let Some(old) = self.keys[pos] else { return };
        let bucket = &mut self.buckets[self.scoring.bucket_of(pos)];
        bucket.remove(&old);
        let new = (
            Reverse(self.scoring.affinity(pos)),
            preference(ctx, &self.job_on_node, nodes[pos], pos),
        );
        bucket.insert(new);
        self.keys[pos] = Some(new);
    }
}

/// `key` with a bucket's spread score added to its score.
fn shifted(key: Key, bonus: Score) -> Key {
    (Reverse(key.0 .0.saturating_add(bonus)), key.1)
}

/// The buckets' candidates merged by their keys with the buckets' spread
/// scores added: positions, best first.
struct InOrder<'a> {
    heap: BinaryHeap<Reverse<(Key, usize)>>,
    iters: Vec<std::collections::btree_set::Iter<'a, Key>>,
    bonus: Vec<Score>,
}

impl Iterator for InOrder<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let Reverse((key, b)) = self.heap.pop()?;
        if let Some(next) = self.iters[b].next() {
            self.heap.push(Reverse((shifted(*next, self.bonus[b]), b)));
        }
        Some(key.1 .2)
    }
}

/// Where `node` (at `pos` in the ready nodes) stands for the next
/// placement of a group: fewer of the job's allocs first (spread), then
/// more free memory, then the nodes' order. Smaller is better.
fn preference(
    ctx: &PlanContext<'_>,
    job_on_node: &HashMap<String, usize>,
    node: &Node,
    pos: usize,
) -> (usize, Reverse<u64>, usize) {
    let same_job = job_on_node.get(&node.id).copied().unwrap_or_default();
    let used = ctx.used(&node.id).memory_mb;
    let free = u128::from(node.resources.memory_mb).saturating_sub(used);
    (
        same_job,
        Reverse(u64::try_from(free).unwrap_or(u64::MAX)),
        pos,
    )
}

#[cfg(test)]
mod tests {
    use berth_structs::{AllocClientStatus, CsiVolume};
    use berth_structs::{NodeResources, Resources, Task};
    use proptest::prelude::*;

    use super::*;
    use crate::scheduler::feasible::plan_still_fits;
    use crate::scheduler::feasible::Usage;
    use crate::scheduler::reconcile::{plan_job, PlacementCounts};

    fn node(id: &str, cpu: u64, memory_mb: u64) -> Node {
        Node {
            id: id.into(),
            name: id.into(),
            status: NodeStatus::Ready,
            resources: NodeResources {
                cpu,
                memory_mb,
                disk_mb: 0,
            },
            drivers: vec!["raw_exec".into()],
            ..Default::default()
        }
    }

    fn task(name: &str, cpu: u64, memory_mb: u64) -> Task {
        Task {
            name: name.into(),
            driver: "raw_exec".into(),
            resources: Resources {
                cpu,
                memory_mb,
                ..Resources::default()
            },
            ..Default::default()
        }
    }

    fn job(id: &str, count: u32, tasks: Vec<Task>) -> Job {
        Job {
            id: id.into(),
            name: id.into(),
            job_type: JobType::Service,
            task_groups: vec![TaskGroup {
                name: "g".into(),
                count,
                tasks,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// A live alloc of `job` on `node_id`.
    fn running(job: &Job, index: u32, node_id: &str) -> Allocation {
        Allocation {
            client_status: AllocClientStatus::Running,
            ..new_alloc(&Arc::new(job.clone()), &job.task_groups[0], index, node_id)
        }
    }

    fn tables(nodes: Vec<Node>, jobs: Vec<Job>, allocs: Vec<Allocation>) -> Tables {
        Tables {
            nodes: nodes.into_iter().map(|n| (n.id.clone(), n)).collect(),
            jobs: jobs.into_iter().map(|j| (j.id.clone(), j)).collect(),
            allocs: allocs.into_iter().map(|a| (a.id.clone(), a)).collect(),
            ..Default::default()
        }
        .with_indexes()
    }

    /// Plan `job_id` and return the outcome and the allocs it placed.
    fn plan(t: &Tables, job_id: &str) -> (PlanOutcome, Vec<Allocation>) {
        let cfg = ServerConfig::new("/nonexistent");
        let mut changes = Vec::new();
        let outcome = plan_job(t, job_id, &cfg, berth_structs::now_ms(), &mut changes);
        let placed = changes
            .into_iter()
            .filter_map(|c| match c {
                Change::PutAlloc(a) if !t.allocs.contains_key(&a.id) => Some(a),
                _ => None,
            })
            .collect();
        (outcome, placed)
    }

    #[test]
    fn asks_that_would_wrap_the_node_sums_place_nothing() {
        // The dev node runs a 100 MHz plugin alloc; an ask of u64::MAX
        // used to wrap the node's sum around to 99 MHz and fit, twice.
        let plugin = job("plugin", 1, vec![task("p", 100, 64)]);
        let plugin_alloc = running(&plugin, 0, "n1");
        for (cpu, memory_mb, what) in [(u64::MAX, 64, "cpu"), (100, u64::MAX, "memory")] {
            let big = job("big", 2, vec![task("t", cpu, memory_mb)]);
            let t = tables(
                vec![node("n1", 2000, 4096)],
                vec![plugin.clone(), big],
                vec![plugin_alloc.clone()],
            );
            let (outcome, placed) = plan(&t, "big");
            assert!(placed.is_empty(), "{what}: placed {placed:?}");
            assert_eq!(
                outcome.counts,
                PlacementCounts {
                    desired: 2,
                    unplaced: 2
                }
            );
            assert_eq!(outcome.failures.len(), 1, "{:?}", outcome.failures);
            assert!(
                outcome.failures[0].contains(&format!("{what} exhausted")),
                "{:?}",
                outcome.failures
            );
        }
    }

    #[test]
    fn a_group_whose_tasks_sum_past_u64_is_refused_with_a_clear_reason() {
        let half = u64::MAX / 2 + 1;
        let big = job("big", 1, vec![task("a", half, 1), task("b", half, 1)]);
        let t = tables(vec![node("n1", u64::MAX, u64::MAX)], vec![big], vec![]);
        let (outcome, placed) = plan(&t, "big");
        assert!(placed.is_empty(), "{placed:?}");
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 1 of 1 alloc not placed: node n1: the group asks for \
                 18446744073709551616 MHz of cpu in total, more than any node can have \
                 (1 alloc: index 0)"
                    .to_string()
            ]
        );
    }

    #[test]
    fn identical_failures_collapse_into_one_line_with_a_count() {
        let web = job("web", 100_000, vec![task("t", 100, 10)]);
        let t = tables(vec![node("n1", 2000, 1 << 20)], vec![web], vec![]);
        let (outcome, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 20);
        assert_eq!(
            outcome.counts,
            PlacementCounts {
                desired: 100_000,
                unplaced: 99_980
            }
        );
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 99980 of 100000 allocs not placed: node n1: cpu exhausted \
                 (2000 of 2000 MHz in use, 100 MHz asked) (99980 allocs: index 20-99999)"
                    .to_string()
            ]
        );
    }

    #[test]
    fn per_alloc_volume_reasons_do_not_vary_with_the_index() {
        let mut j = job("db", 4, vec![task("t", 1, 1)]);
        j.task_groups[0].volumes.insert(
            "data".into(),
            berth_structs::VolumeRequest {
                name: "data".into(),
                volume_type: "csi".into(),
                source: "data".into(),
                per_alloc: true,
                access_mode: Some(berth_structs::AccessMode::SingleNodeWriter),
                attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
                ..Default::default()
            },
        );
        let t = tables(vec![node("n1", 2000, 2000)], vec![j], vec![]);
        let (outcome, placed) = plan(&t, "db");
        assert!(placed.is_empty());
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 4 of 4 allocs not placed: node n1: volume \"data[<index>]\" \
                 (group volume \"data\") does not exist (4 allocs: index 0-3)"
                    .to_string()
            ]
        );
    }

    fn ineligible(mut n: Node) -> Node {
        n.scheduling_eligibility = berth_structs::SchedulingEligibility::Ineligible;
        n
    }

    fn topology(k: &str, v: &str) -> berth_structs::CsiTopology {
        berth_structs::CsiTopology::new([(k.to_string(), v.to_string())].into())
    }

    /// A node running a healthy node plugin "hp" at `at` (none: the plugin
    /// answers no topology).
    fn node_at(id: &str, at: Option<berth_structs::CsiTopology>) -> Node {
        let mut n = node(id, 4000, 4096);
        n.csi_node_plugins.insert(
            "hp".into(),
            berth_structs::CsiInfo {
                plugin_id: "hp".into(),
                healthy: true,
                accessible_topology: at,
                ..Default::default()
            },
        );
        n
    }

    /// A multi-node-multi-writer volume of plugin "hp" reachable from
    /// `accessible` (empty: everywhere).
    fn volume_in(id: &str, accessible: Vec<berth_structs::CsiTopology>) -> CsiVolume {
        CsiVolume {
            id: id.into(),
            plugin_id: "hp".into(),
            capabilities: vec![berth_structs::VolumeCapability {
                access_mode: berth_structs::AccessMode::MultiNodeMultiWriter,
                attachment_mode: berth_structs::AttachmentMode::FileSystem,
            }],
            accessible_topology: accessible,
            ..Default::default()
        }
    }

    /// Job `id` whose group of `count` uses each of `volumes`.
    fn job_using(id: &str, count: u32, volumes: &[&str]) -> Job {
        let mut j = job(id, count, vec![task("t", 1, 1)]);
        for v in volumes {
            j.task_groups[0].volumes.insert(
                v.to_string(),
                berth_structs::VolumeRequest {
                    name: v.to_string(),
                    volume_type: "csi".into(),
                    source: v.to_string(),
                    access_mode: Some(berth_structs::AccessMode::MultiNodeMultiWriter),
                    attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
                    ..Default::default()
                },
            );
        }
        j
    }

    fn with_volumes(mut t: Tables, volumes: Vec<CsiVolume>) -> Tables {
        t.volumes = volumes.into_iter().map(|v| (v.id.clone(), v)).collect();
        t.with_indexes()
    }

    #[test]
    fn a_replacement_waits_for_the_claim_of_the_alloc_it_replaces() {
        let mut old = job_using("db", 1, &[]);
        old.task_groups[0]
            .volumes
            .insert("data".into(), single_writer_request());
        let running_old = running(&old, 0, "a");
        let mut new = old.clone();
        new.version = 1;
        new.task_groups[0].tasks[0]
            .env
            .insert("A".into(), "1".into());
        let mut volume = volume_in("data", vec![]);
        volume.capabilities[0].access_mode = berth_structs::AccessMode::SingleNodeWriter;
        let mut claimed = volume.clone();
        claimed.write_claims.insert(
            running_old.id.clone(),
            berth_structs::CsiVolumeClaim {
                alloc_id: running_old.id.clone(),
                node_id: "a".into(),
                external_node_id: String::new(),
                mode: berth_structs::ClaimMode::Write,
                access_mode: berth_structs::AccessMode::SingleNodeWriter,
                attachment_mode: berth_structs::AttachmentMode::FileSystem,
                state: berth_structs::ClaimState::Taken,
                publish_context: Default::default(),
                releasing: false,
                controller_published: false,
                kept_after_purge: false,
            },
        );
        let nodes = vec![node_at("a", None)];
        let t = with_volumes(
            tables(nodes.clone(), vec![new.clone()], vec![running_old.clone()]),
            vec![claimed.clone()],
        );
        // The destructive update: the old alloc stops, the new one is
        // placed and waits for its claim; no failure.
        let (outcome, changes) = plan_at(&t, "db", 1);
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
        assert_eq!(
            outcome.waiting,
            vec![format!(
                "group \"g\": db.g[0] waits for the claims of alloc {} to be released",
                &running_old.id[..8]
            )]
        );
        let puts = puts(&changes);
        let stopped = puts.iter().find(|a| a.id == running_old.id).unwrap();
        assert!(stopped.server_terminal());
        let waiting = puts.iter().find(|a| a.id != running_old.id).unwrap();
        assert_eq!(waiting.waiting_for_claims_of, vec![running_old.id.clone()]);
        assert!(waiting.waits_for_claims());

        // Still claimed: it keeps waiting. Freed: it goes to its node.
        let after: Vec<Allocation> = puts.iter().map(|a| (*a).clone()).collect();
        let t = with_volumes(
            tables(nodes.clone(), vec![new.clone()], after.clone()),
            vec![claimed],
        );
        let (outcome, changes) = plan_at(&t, "db", 2);
        assert!(outcome.delayed && changes.iter().all(|c| !matches!(c, Change::PutAlloc(_))));
        let t = with_volumes(tables(nodes, vec![new], after), vec![volume]);
        let (outcome, changes) = plan_at(&t, "db", 3);
        assert!(outcome.waiting.is_empty() && !outcome.delayed);
        assert!(
            changes.iter().any(
                |c| matches!(c, Change::PutAlloc(a) if a.id == waiting.id && !a.waits_for_claims())
            ),
            "{changes:?}"
        );
    }

    #[test]
    fn a_volume_with_a_topology_is_placed_only_on_nodes_in_it() {
        let nodes = vec![
            node_at("a", Some(topology("zone", "a"))),
            node_at("b", Some(topology("zone", "b"))),
            node_at("none", None),
        ];
        let t = with_volumes(
            tables(nodes.clone(), vec![job_using("web", 6, &["data"])], vec![]),
            vec![volume_in("data", vec![topology("zone", "a")])],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
        assert_eq!(placed.len(), 6);
        assert!(placed.iter().all(|a| a.node_id == "a"), "{placed:?}");

        // A node with more segments than the volume names is in it too; one
        // of several topologies is enough.
        let mut wide = node_at("wide", None);
        wide.csi_node_plugins
            .get_mut("hp")
            .unwrap()
            .accessible_topology = Some(berth_structs::CsiTopology::new(
            [
                ("zone".to_string(), "c".to_string()),
                ("rack".to_string(), "r1".to_string()),
            ]
            .into(),
        ));
        let t = with_volumes(
            tables(
                vec![wide, node_at("b", Some(topology("zone", "b")))],
                vec![job_using("web", 1, &["data"])],
                vec![],
            ),
            vec![volume_in(
                "data",
                vec![topology("zone", "a"), topology("zone", "c")],
            )],
        );
        let (_, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 1);
        assert_eq!(placed[0].node_id, "wide");

        // A volume without a topology is reachable from every node.
        let t = with_volumes(
            tables(
                vec![node_at("none", None)],
                vec![job_using("web", 1, &["data"])],
                vec![],
            ),
            vec![volume_in("data", vec![])],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
        assert_eq!(placed.len(), 1);
    }

    #[test]
    fn volumes_in_disjoint_topologies_place_nothing_and_the_failure_names_them() {
        let t = with_volumes(
            tables(
                vec![
                    node_at("a", Some(topology("zone", "a"))),
                    node_at("b", Some(topology("zone", "b"))),
                    node_at("none", None),
                ],
                vec![job_using("web", 1, &["va", "vb"])],
                vec![],
            ),
            vec![
                volume_in("va", vec![topology("zone", "a")]),
                volume_in("vb", vec![topology("zone", "b")]),
            ],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(placed.is_empty(), "{placed:?}");
        assert_eq!(
            outcome.failures,
            vec!["group \"g\": 1 of 1 alloc not placed: \
                 node a: volume \"vb\" is reachable only from topology {zone=b}; \
                 node plugin \"hp\" here is in topology {zone=a}; \
                 node b: volume \"va\" is reachable only from topology {zone=a}; \
                 node plugin \"hp\" here is in topology {zone=b}; \
                 node none: volume \"va\" is reachable only from topology {zone=a}; \
                 node plugin \"hp\" here has no topology (1 alloc: index 0)"
                .to_string()]
        );
    }

    #[test]
    fn topology_is_checked_after_the_other_checks() {
        // Node "a" is in the volume's topology but out of memory; "b" is
        // not in it: each node says its own reason.
        let mut a = node_at("a", Some(topology("zone", "a")));
        a.resources.memory_mb = 0;
        let t = with_volumes(
            tables(
                vec![a, node_at("b", Some(topology("zone", "b")))],
                vec![job_using("web", 1, &["data"])],
                vec![],
            ),
            vec![volume_in("data", vec![topology("zone", "a")])],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(placed.is_empty());
        assert_eq!(outcome.failures.len(), 1);
        let f = &outcome.failures[0];
        assert!(f.contains("node a: memory exhausted"), "{f}");
        assert!(
            f.contains("node b: volume \"data\" is reachable only from topology {zone=a}"),
            "{f}"
        );
    }

    #[test]
    fn an_ineligible_node_gets_no_new_allocs_and_the_failure_says_why() {
        let web = job("web", 2, vec![task("t", 100, 64)]);
        let t = tables(
            vec![ineligible(node("n1", 4000, 4096)), node("n2", 4000, 4096)],
            vec![web.clone()],
            vec![],
        );
        let (outcome, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 2);
        assert!(placed.iter().all(|a| a.node_id == "n2"), "{placed:?}");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);

        let mut draining = node("n2", 4000, 4096);
        draining.set_drain(Some(berth_structs::DrainStrategy::new(
            std::time::Duration::from_secs(60),
            0,
        )));
        let t = tables(
            vec![ineligible(node("n1", 4000, 4096)), draining],
            vec![web],
            vec![],
        );
        let (outcome, placed) = plan(&t, "web");
        assert!(placed.is_empty(), "{placed:?}");
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 2 of 2 allocs not placed: node n1: node ineligible; \
                 node n2: node ineligible (draining) (2 allocs: index 0-1)"
                    .to_string()
            ]
        );
    }

    #[test]
    fn a_system_job_skips_an_ineligible_node_and_leaves_its_alloc_there() {
        let mut sys = job("sys", 1, vec![task("t", 100, 64)]);
        sys.job_type = JobType::System;
        let on_n1 = running(&sys, 0, "n1");
        let t = tables(
            vec![
                ineligible(node("n1", 4000, 4096)),
                node("n2", 4000, 4096),
                ineligible(node("n3", 4000, 4096)),
            ],
            vec![sys.clone()],
            vec![on_n1.clone()],
        );
        let cfg = ServerConfig::new("/nonexistent");
        let mut changes = Vec::new();
        let outcome = plan_job(&t, "sys", &cfg, berth_structs::now_ms(), &mut changes);
        let put: Vec<&Allocation> = changes
            .iter()
            .filter_map(|c| match c {
                Change::PutAlloc(a) => Some(a),
                _ => None,
            })
            .collect();
        assert_eq!(put.len(), 1, "only a placement on n2: {put:?}");
        assert_eq!(put[0].node_id, "n2");
        assert_ne!(put[0].id, on_n1.id, "the alloc on n1 is not touched");
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
        assert_eq!(
            outcome.counts,
            PlacementCounts {
                desired: 1,
                unplaced: 0
            }
        );
    }

    #[test]
    fn an_alloc_stopped_by_a_drain_is_replaced_on_another_node() {
        let web = job("web", 1, vec![task("t", 100, 64)]);
        let stopping = stop(&running(&web, 0, "n1"), "node is draining");
        let mut n1 = node("n1", 4000, 4096);
        n1.set_drain(Some(berth_structs::DrainStrategy::new(
            std::time::Duration::from_secs(60),
            0,
        )));
        let t = tables(vec![n1, node("n2", 4000, 4096)], vec![web], vec![stopping]);
        let (outcome, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 1, "{placed:?}");
        assert_eq!(placed[0].node_id, "n2");
        assert_eq!(placed[0].index, 0);
        assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    }

    /// The allocs a plan's changes write.
    fn puts(changes: &[Change]) -> Vec<&Allocation> {
        changes
            .iter()
            .filter_map(|c| match c {
                Change::PutAlloc(a) => Some(a),
                _ => None,
            })
            .collect()
    }

    fn in_rack(id: &str, rack: &str) -> Node {
        let mut n = node(id, 4000, 4096);
        n.meta.insert("rack".into(), rack.into());
        n
    }

    fn constrained(count: u32, attribute: &str, operator: &str, value: &str) -> Job {
        let mut j = job("web", count, vec![task("t", 100, 64)]);
        j.task_groups[0]
            .constraints
            .push(berth_structs::Constraint {
                attribute: attribute.into(),
                operator: operator.parse().unwrap(),
                value: value.into(),
            });
        j
    }

    fn racks() -> Vec<Node> {
        vec![
            in_rack("n1", "r1"),
            in_rack("n2", "r1"),
            in_rack("n3", "r2"),
        ]
    }

    #[test]
    fn a_constraint_pins_placements_and_a_failure_counts_the_nodes_it_filtered() {
        let web = constrained(2, "${node.unique.name}", "=", "n2");
        let t = tables(racks(), vec![web], vec![]);
        let (outcome, placed) = plan(&t, "web");
        assert_eq!(placed.len(), 2, "{:?}", outcome.failures);
        assert!(placed.iter().all(|a| a.node_id == "n2"), "{placed:?}");

        let web = constrained(2, "${meta.rack}", "=", "r9");
        let t = tables(racks(), vec![web], vec![]);
        let (outcome, placed) = plan(&t, "web");
        assert!(placed.is_empty(), "{placed:?}");
        assert_eq!(
            outcome.failures,
            vec![
                "group \"g\": 2 of 2 allocs not placed: 3 nodes (n1, n2, n3): \
                  constraint \"${meta.rack} = r9\" not met (2 allocs: index 0-1)"
                    .to_string()
            ]
        );
    }

    #[test]
    fn distinct_hosts_and_distinct_property_hold_with_what_runs() {
        // One alloc runs on n1 already: distinct_hosts leaves two nodes.
        let web = constrained(3, "", "distinct_hosts", "");
        let t = tables(racks(), vec![web.clone()], vec![running(&web, 0, "n1")]);
        let (outcome, placed) = plan(&t, "web");
        let mut nodes: Vec<&str> = placed.iter().map(|a| a.node_id.as_str()).collect();
        nodes.sort_unstable();
        assert_eq!(nodes, ["n2", "n3"], "{:?}", outcome.failures);

        let web = constrained(3, "${meta.rack}", "distinct_property", "");
        let t = tables(racks(), vec![web], vec![]);
        let (outcome, placed) = plan(&t, "web");
        let mut racks: Vec<&str> = placed
            .iter()
            .map(|a| if a.node_id == "n3" { "r2" } else { "r1" })
            .collect();
        racks.sort_unstable();
        assert_eq!(racks, ["r1", "r2"]);
        assert_eq!(outcome.failures.len(), 1, "{:?}", outcome.failures);
        assert!(
            outcome.failures[0].contains("value \"r1\" is taken")
                && outcome.failures[0].contains("value \"r2\" is taken"),
            "{}",
            outcome.failures[0]
        );
    }

    #[test]
    fn a_new_constraint_keeps_allocs_whose_node_meets_it_and_moves_the_rest() {
        let old = job("web", 2, vec![task("t", 100, 64)]);
        let on_n1 = running(&old, 0, "n1");
        let on_n3 = running(&old, 1, "n3");
        let mut new = constrained(2, "${meta.rack}", "=", "r1");
        new.version = old.version + 1;
        let t = tables(racks(), vec![new], vec![on_n1.clone(), on_n3.clone()]);
        let cfg = ServerConfig::new("/nonexistent");
        let mut changes = Vec::new();
        plan_job(&t, "web", &cfg, berth_structs::now_ms(), &mut changes);
        let puts = puts(&changes);
        let kept = puts.iter().find(|a| a.id == on_n1.id).unwrap();
        assert!(!kept.server_terminal() && kept.job.version == old.version + 1);
        let moved = puts.iter().find(|a| a.id == on_n3.id).unwrap();
        assert!(moved.server_terminal(), "{moved:?}");
        let placed = puts.iter().find(|a| !t.allocs.contains_key(&a.id)).unwrap();
        assert_eq!((placed.index, placed.node_id.as_str()), (1, "n2"));
    }

    fn per_rack(placed: &[Allocation], nodes: &[Node]) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for a in placed {
            let n = nodes.iter().find(|n| n.id == a.node_id).unwrap();
            *out.entry(n.meta["rack"].clone()).or_default() += 1;
        }
        out
    }

    #[test]
    fn a_spread_splits_allocs_over_the_values_not_the_nodes() {
        // Three nodes in r1, one in r2: by nodes 3/1, by racks 2/2.
        let mut nodes = racks();
        nodes.push(in_rack("n0", "r1"));
        let mut web = job("web", 4, vec![task("t", 100, 64)]);
        web.task_groups[0].spreads.push(berth_structs::Spread {
            attribute: "${meta.rack}".into(),
            weight: 50,
            targets: vec![],
        });
        let t = tables(nodes.clone(), vec![web.clone()], vec![]);
        let (_, placed) = plan(&t, "web");
        assert_eq!(
            per_rack(&placed, &nodes),
            BTreeMap::from([("r1".into(), 2), ("r2".into(), 2)])
        );

        // Targets: 75% in r1.
        web.task_groups[0].spreads[0].targets = vec![berth_structs::SpreadTarget {
            value: "r1".into(),
            percent: 75,
        }];
        let t = tables(nodes.clone(), vec![web.clone()], vec![]);
        let (_, placed) = plan(&t, "web");
        assert_eq!(
            per_rack(&placed, &nodes),
            BTreeMap::from([("r1".into(), 3), ("r2".into(), 1)])
        );

        // What runs counts: two already in r2, so the next two go to r1.
        web.task_groups[0].spreads[0].targets.clear();
        let t = tables(
            nodes.clone(),
            vec![web.clone()],
            vec![running(&web, 0, "n3"), running(&web, 1, "n3")],
        );
        let (_, placed) = plan(&t, "web");
        assert_eq!(
            per_rack(&placed, &nodes),
            BTreeMap::from([("r1".into(), 2)])
        );
    }

    #[test]
    fn an_affinity_prefers_the_nodes_it_names_and_a_negative_one_avoids_them() {
        let nodes = racks();
        let mut web = job("web", 2, vec![task("t", 100, 64)]);
        web.task_groups[0].affinities.push(berth_structs::Affinity {
            attribute: "${meta.rack}".into(),
            value: "r2".into(),
            weight: 100,
            ..Default::default()
        });
        let t = tables(nodes.clone(), vec![web.clone()], vec![]);
        let (_, placed) = plan(&t, "web");
        assert_eq!(
            per_rack(&placed, &nodes),
            BTreeMap::from([("r2".into(), 2)])
        );
        web.task_groups[0].affinities[0].weight = -100;
        let t = tables(nodes.clone(), vec![web], vec![]);
        let (_, placed) = plan(&t, "web");
        assert_eq!(
            per_rack(&placed, &nodes),
            BTreeMap::from([("r1".into(), 2)])
        );
    }

    /// A failed alloc of `job` at `index` on n1, failed at `failed_at`
    /// after the reschedule delays `history` (seconds).
    fn failed(job: &Job, index: u32, failed_at: i64, history: &[u64]) -> Allocation {
        Allocation {
            client_status: AllocClientStatus::Failed,
            modify_time_ms: failed_at,
            reschedule_events: history
                .iter()
                .map(|d| berth_structs::RescheduleEvent {
                    time_ms: failed_at - 1,
                    delay_ms: d * 1000,
                    ..Default::default()
                })
                .collect(),
            ..running(job, index, "n1")
        }
    }

    fn plan_at(t: &Tables, job_id: &str, now: i64) -> (PlanOutcome, Vec<Change>) {
        let cfg = ServerConfig::new("/nonexistent");
        let mut changes = Vec::new();
        let outcome = plan_job(t, job_id, &cfg, now, &mut changes);
        (outcome, changes)
    }

    #[test]
    fn a_failed_alloc_is_rescheduled_after_its_growing_delay() {
        // Nomad's service default: 30 s, then twice as long each time.
        let web = job("web", 1, vec![task("t", 100, 64)]);
        let gone = failed(&web, 0, 1_000_000, &[30, 60]);
        let t = tables(vec![node("n1", 4000, 4096)], vec![web], vec![gone.clone()]);
        let (outcome, changes) = plan_at(&t, "web", 1_000_000 + 119_000);
        assert!(
            changes.iter().all(|c| !matches!(c, Change::PutAlloc(_))),
            "{changes:?}"
        );
        assert_eq!(outcome.due_ms, Some(1_000_000 + 120_000));
        let (_, changes) = plan_at(&t, "web", 1_000_000 + 120_000);
        let placed: Vec<&Allocation> = changes
            .iter()
            .filter_map(|c| match c {
                Change::PutAlloc(a) if a.id != gone.id => Some(a),
                _ => None,
            })
            .collect();
        assert_eq!(placed.len(), 1);
        assert_eq!(placed[0].previous_allocation, gone.id);
        let delays: Vec<u64> = placed[0]
            .reschedule_events
            .iter()
            .map(|e| e.delay_ms / 1000)
            .collect();
        assert_eq!(delays, [30, 60, 120]);
    }

    #[test]
    fn a_batch_alloc_is_rescheduled_once_a_day_by_default() {
        let mut once = job("once", 1, vec![task("t", 100, 64)]);
        once.job_type = JobType::Batch;
        let first = failed(&once, 0, 1_000_000, &[]);
        let t = tables(
            vec![node("n1", 4000, 4096)],
            vec![once.clone()],
            vec![first],
        );
        let (_, changes) = plan_at(&t, "once", 1_000_000 + 5_000);
        assert_eq!(
            changes
                .iter()
                .filter(|c| matches!(c, Change::PutAlloc(a) if !a.previous_allocation.is_empty()))
                .count(),
            1,
            "{changes:?}"
        );
        // The replacement failed too: no second attempt within the day.
        let second = failed(&once, 0, 2_000_000, &[5]);
        let t = tables(vec![node("n1", 4000, 4096)], vec![once], vec![second]);
        let (outcome, changes) = plan_at(&t, "once", 3_000_000);
        assert!(
            changes.iter().all(|c| !matches!(c, Change::PutAlloc(_))),
            "{changes:?}"
        );
        assert!(!outcome.delayed);
        assert!(
            changes.iter().any(
                |c| matches!(c, Change::PutJob(j) if j.status == berth_structs::JobStatus::Failed)
            ),
            "{changes:?}"
        );
    }

    /// `a` running since `started` (its one task "t").
    fn running_since(mut a: Allocation, started: i64) -> Allocation {
        a.client_status = AllocClientStatus::Running;
        a.task_states.insert(
            "t".into(),
            berth_structs::TaskState {
                state: berth_structs::TaskStateKind::Running,
                failed: false,
                restarts: 0,
                started_at_ms: Some(started),
                finished_at_ms: None,
                events: Vec::new(),
                usage: None,
            },
        );
        a
    }

    #[test]
    fn a_rolling_update_replaces_max_parallel_at_a_time_once_healthy() {
        let old = job("web", 3, vec![task("t", 100, 64)]);
        let olds: Vec<Allocation> = (0..3).map(|i| running(&old, i, "n1")).collect();
        let mut new = old.clone();
        new.version = 1;
        new.task_groups[0].tasks[0]
            .env
            .insert("A".into(), "1".into());
        new.task_groups[0].update = Some(berth_structs::UpdateStrategy {
            max_parallel: 1,
            min_healthy_time: std::time::Duration::from_secs(2),
            ..Default::default()
        });
        let stops_and_places = |changes: &[Change], t: &Tables| {
            let mut stopped = Vec::new();
            let mut placed = Vec::new();
            for c in changes {
                if let Change::PutAlloc(a) = c {
                    if !t.allocs.contains_key(&a.id) {
                        placed.push(a.index);
                    } else if a.server_terminal() {
                        stopped.push(a.index);
                    }
                }
            }
            (stopped, placed)
        };
        let nodes = vec![node("n1", 8000, 8192)];
        let t = tables(nodes.clone(), vec![new.clone()], olds.clone());
        let (outcome, changes) = plan_at(&t, "web", 10_000);
        assert_eq!(stops_and_places(&changes, &t), (vec![0], vec![0]));
        assert!(outcome.delayed);

        // The new index 0 runs, not yet for 2 s: nothing more, and the
        // job is evaluated again when it turns healthy.
        let mut stopped_0 = stop(&olds[0], "job updated");
        stopped_0.client_status = AllocClientStatus::Complete;
        let new_0 = running_since(
            new_alloc(&Arc::new(new.clone()), &new.task_groups[0], 0, "n1"),
            9_000,
        );
        let allocs = vec![stopped_0, new_0, olds[1].clone(), olds[2].clone()];
        let t = tables(nodes.clone(), vec![new.clone()], allocs.clone());
        let (outcome, changes) = plan_at(&t, "web", 10_000);
        assert_eq!(stops_and_places(&changes, &t), (vec![], vec![]));
        assert_eq!(outcome.due_ms, Some(11_000));
        // Healthy: the next one goes.
        let (_, changes) = plan_at(&t, "web", 11_000);
        assert_eq!(stops_and_places(&changes, &t), (vec![1], vec![1]));
    }

    #[test]
    fn a_system_job_rolls_max_parallel_nodes_at_a_time_stagger_apart() {
        let mut old = job("agent", 1, vec![task("t", 100, 64)]);
        old.job_type = JobType::System;
        let nodes: Vec<Node> = ["n1", "n2", "n3"]
            .iter()
            .map(|n| node(n, 4000, 4096))
            .collect();
        let mut allocs: Vec<Allocation> = nodes.iter().map(|n| running(&old, 0, &n.id)).collect();
        let mut new = old.clone();
        new.version = 1;
        new.task_groups[0].tasks[0]
            .env
            .insert("A".into(), "1".into());
        new.update = Some(berth_structs::UpdateStrategy {
            max_parallel: 1,
            stagger: std::time::Duration::from_secs(10),
            ..Default::default()
        });
        let mut now = 100_000;
        for round in 0..3 {
            let t = tables(nodes.clone(), vec![new.clone()], allocs.clone());
            let (outcome, changes) = plan_at(&t, "agent", now);
            let (mut stopped, mut placed) = (0, 0);
            for c in changes {
                if let Change::PutAlloc(mut a) = c {
                    if a.server_terminal() {
                        stopped += 1;
                        a.modify_time_ms = now;
                    } else {
                        placed += 1;
                    }
                    allocs.retain(|o| o.id != a.id);
                    allocs.push(a);
                }
            }
            assert_eq!((stopped, placed), (1, 1), "round {round}");
            // Nothing more until the stagger has passed.
            let t = tables(nodes.clone(), vec![new.clone()], allocs.clone());
            let (outcome_then, changes) = plan_at(&t, "agent", now + 9_000);
            assert!(changes.iter().all(|c| !matches!(c, Change::PutAlloc(_))));
            if round < 2 {
                assert_eq!(outcome.due_ms, Some(now + 10_000), "round {round}");
                assert_eq!(outcome_then.due_ms, Some(now + 10_000), "round {round}");
            }
            now += 10_000;
        }
        let live_new = allocs
            .iter()
            .filter(|a| a.job.version == 1 && !a.server_terminal())
            .count();
        assert_eq!(live_new, 3);
    }

    /// Resource amounts that hit the edges: zero, small, near and at u64::MAX.
    fn amount() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0),
            1..5000u64,
            (0..5000u64).prop_map(|d| u64::MAX - d),
            Just(u64::MAX / 2 + 1),
            any::<u64>(),
        ]
    }

    fn tasks() -> impl Strategy<Value = Vec<Task>> {
        prop::collection::vec((amount(), amount()), 1..4).prop_map(|rs| {
            rs.into_iter()
                .enumerate()
                .map(|(i, (c, m))| task(&format!("t{i}"), c, m))
                .collect()
        })
    }

    /// Number of cases of the property below (bounded: it runs in CI).
    const PLAN_CASES: u32 = 1024;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: PLAN_CASES,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// With any resources, nodes and allocs already placed, planning
        /// never panics, never puts more on a node than it has (sums in
        /// u128), accounts for every index, and says each distinct reason
        /// once.
        #[test]
        fn plan_never_places_more_than_fits(
            node_res in prop::collection::vec((amount(), amount()), 1..4),
            existing in prop::collection::vec((tasks(), 0..4usize), 0..4),
            group_tasks in tasks(),
            count in 1..30u32,
        ) {
            let nodes: Vec<Node> = node_res
                .iter()
                .enumerate()
                .map(|(i, (c, m))| node(&format!("n{i}"), *c, *m))
                .collect();
            let mut jobs = Vec::new();
            let mut allocs = Vec::new();
            for (i, (ts, on)) in existing.into_iter().enumerate() {
                let other = job(&format!("other{i}"), 1, ts);
                allocs.push(running(&other, 0, &nodes[on % nodes.len()].id));
                jobs.push(other);
            }
            let under_test = job("j", count, group_tasks);
            jobs.push(under_test.clone());
            let t = tables(nodes.clone(), jobs, allocs.clone());

            let (outcome, placed) = plan(&t, "j");

            let demand = Usage::of_group(&under_test.task_groups[0]);
            for n in &nodes {
                let before = allocs
                    .iter()
                    .filter(|a| a.node_id == n.id)
                    .fold(Usage::default(), |u, a| u.plus(Usage::of_group(a.group().unwrap())));
                let new = placed.iter().filter(|a| a.node_id == n.id).count() as u128;
                if new == 0 {
                    continue;
                }
                prop_assert!(before.cpu + demand.cpu * new <= u128::from(n.resources.cpu),
                    "cpu over on {}: {before:?} + {new} x {demand:?} > {:?}", n.id, n.resources);
                prop_assert!(before.memory_mb + demand.memory_mb * new <= u128::from(n.resources.memory_mb),
                    "memory over on {}: {before:?} + {new} x {demand:?} > {:?}", n.id, n.resources);
            }
            prop_assert_eq!(outcome.counts.desired, u64::from(count));
            prop_assert_eq!(outcome.counts.unplaced + placed.len() as u64, u64::from(count));
            // One group, no per_alloc volumes: one reason at most.
            prop_assert_eq!(outcome.failures.len(), usize::from(outcome.counts.unplaced > 0));
        }
    }

    /// Where the placement of every index of group 0 goes when each one
    /// looks at every ready node and takes the best fit (fewest allocs of
    /// the job, then most free memory, then the first in ID order): the
    /// rule the ordered candidates of [`place`] must give, without them.
    fn every_node_placement(t: &Tables, job: &Job) -> Vec<Option<String>> {
        let mut ctx = PlanContext::new(t, job);
        let group = &job.task_groups[0];
        let nodes: Vec<&Node> = t
            .nodes
            .values()
            .filter(|n| n.status == NodeStatus::Ready)
            .collect();
        let mut job_on_node: HashMap<String, usize> = HashMap::new();
        let mut out = Vec::new();
        for index in 0..group.count {
            let mut alloc = new_alloc(&Arc::new(job.clone()), group, index, "");
            let mut best: Option<(&Node, (usize, Reverse<u64>))> = None;
            for node in &nodes {
                if ctx.infeasible(job, group, index, &alloc.id, node).is_none() {
                    let (same, free, _) = preference(&ctx, &job_on_node, node, 0);
                    if best.as_ref().is_none_or(|(_, s)| (same, free) < *s) {
                        best = Some((node, (same, free)));
                    }
                }
            }
            match best {
                Some((node, _)) => {
                    alloc.node_id = node.id.clone();
                    ctx.add(&alloc);
                    *job_on_node.entry(node.id.clone()).or_default() += 1;
                    out.push(Some(node.id.clone()));
                }
                None => out.push(None),
            }
        }
        out
    }

    /// A node of the placement property: its capacity, whether it is
    /// ready and eligible, and whether it runs plugin "hp".
    fn varied_node() -> impl Strategy<Value = (u64, u64, bool, bool, bool)> {
        (
            prop_oneof![Just(0u64), 1..400u64, Just(4000)],
            prop_oneof![Just(0u64), 1..400u64, Just(4096)],
            prop::bool::weighted(0.85),
            prop::bool::weighted(0.85),
            any::<bool>(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// The ordered candidates place every index where a look at every
        /// node would: nodes that do not fit, fill up, or lose a volume
        /// to a claim, per_alloc volumes (some missing) or none.
        #[test]
        fn placement_by_ordered_candidates_is_placement_by_every_node(
            specs in prop::collection::vec(varied_node(), 1..12),
            existing in prop::collection::vec((1..300u64, 1..300u64, 0..12usize), 0..8),
            ask in (1..200u64, 1..200u64),
            count in 1..24u32,
            volume in prop::option::of((any::<bool>(), any::<bool>(), 0..3u8)),
            missing in prop::collection::vec(prop::bool::weighted(0.2), 24),
        ) {
            let nodes: Vec<Node> = specs
                .iter()
                .enumerate()
                .map(|(i, &(cpu, mem, ready, eligible, plugin))| {
                    let mut n = if plugin {
                        node_at(&format!("n{i:02}"), None)
                    } else {
                        node(&format!("n{i:02}"), 0, 0)
                    };
                    n.resources.cpu = cpu;
                    n.resources.memory_mb = mem;
                    if !ready {
                        n.status = NodeStatus::Down;
                    }
                    if eligible { n } else { ineligible(n) }
                })
                .collect();
            let mut jobs = Vec::new();
            let mut allocs = Vec::new();
            for (i, (cpu, mem, on)) in existing.into_iter().enumerate() {
                let other = job(&format!("other{i}"), 1, vec![task("t", cpu, mem)]);
                allocs.push(running(&other, 0, &nodes[on % nodes.len()].id));
                jobs.push(other);
            }
            let mut under_test = job("j", count, vec![task("t", ask.0, ask.1)]);
            let mut volumes = Vec::new();
            if let Some((per_alloc, read_only, access)) = volume {
                let access = [
                    berth_structs::AccessMode::SingleNodeWriter,
                    berth_structs::AccessMode::MultiNodeReader,
                    berth_structs::AccessMode::MultiNodeMultiWriter,
                ][usize::from(access)];
                let mut ids = vec!["data".to_string()];
                if per_alloc {
                    // Some indices' volumes do not exist: those fit no
                    // node, the others may.
                    ids = (0..count)
                        .filter(|&i| !missing[i as usize])
                        .map(|i| format!("data[{i}]"))
                        .collect();
                }
                for id in ids {
                    let mut v = volume_in(&id, vec![]);
                    v.capabilities[0].access_mode = access;
                    volumes.push(v);
                }
                under_test.task_groups[0].volumes.insert(
                    "data".into(),
                    berth_structs::VolumeRequest {
                        name: "data".into(),
                        volume_type: "csi".into(),
                        source: "data".into(),
                        per_alloc,
                        read_only,
                        access_mode: Some(access),
                        attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
                        ..Default::default()
                    },
                );
            }
            jobs.push(under_test.clone());
            let t = with_volumes(tables(nodes, jobs, allocs), volumes);

            let want = every_node_placement(&t, &under_test);
            let (outcome, placed) = plan(&t, "j");
            let mut got: Vec<Option<String>> = vec![None; count as usize];
            for a in &placed {
                got[a.index as usize] = Some(a.node_id.clone());
            }
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(
                outcome.counts.unplaced,
                want.iter().filter(|w| w.is_none()).count() as u64
            );
        }
    }

    /// A single-node-writer version of `data` for [`plan_on_old_tables`].
    fn single_writer_request() -> berth_structs::VolumeRequest {
        berth_structs::VolumeRequest {
            name: "data".into(),
            volume_type: "csi".into(),
            source: "data".into(),
            access_mode: Some(berth_structs::AccessMode::SingleNodeWriter),
            attachment_mode: Some(berth_structs::AttachmentMode::FileSystem),
            ..Default::default()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 512,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// A plan made on older tables that [`plan_still_fits`] lets commit
        /// on newer ones (other jobs placed meanwhile, a writer of the
        /// volume among them) leaves no node over its cpu and no
        /// single-writer volume with two writers; and a plan on unchanged
        /// tables always still fits.
        #[test]
        fn a_plan_that_still_fits_overcommits_no_node_and_no_volume(
            caps in prop::collection::vec(100..2000u64, 1..6),
            ask in 50..700u64,
            count in 1..6u32,
            later in prop::collection::vec((0..6usize, 50..900u64, any::<bool>()), 0..8),
            uses_volume in any::<bool>(),
        ) {
            let nodes: Vec<Node> = caps
                .iter()
                .enumerate()
                .map(|(i, &cpu)| {
                    let mut n = node_at(&format!("n{i}"), None);
                    n.resources.cpu = cpu;
                    n
                })
                .collect();
            let mut volume = volume_in("data", vec![]);
            volume.capabilities[0].access_mode = berth_structs::AccessMode::SingleNodeWriter;
            let mut a = job("a", count, vec![task("t", ask, 1)]);
            if uses_volume {
                a.task_groups[0].volumes.insert("data".into(), single_writer_request());
            }
            let before = with_volumes(tables(nodes.clone(), vec![a.clone()], Vec::new()), vec![volume.clone()]);
            let cfg = ServerConfig::new("/nonexistent");
            let mut changes = Vec::new();
            plan_job(&before, "a", &cfg, berth_structs::now_ms(), &mut changes);
            prop_assert!(plan_still_fits(&before, &a, &changes), "unchanged tables");

            // Other jobs placed meanwhile, some writing to the volume.
            let mut jobs = vec![a.clone()];
            let mut allocs = Vec::new();
            for (i, (on, cpu, writes)) in later.into_iter().enumerate() {
                let mut other = job(&format!("o{i}"), 1, vec![task("t", cpu, 1)]);
                if writes {
                    other.task_groups[0].volumes.insert("data".into(), single_writer_request());
                }
                allocs.push(running(&other, 0, &nodes[on % nodes.len()].id));
                jobs.push(other);
            }
            let now = with_volumes(tables(nodes.clone(), jobs, allocs), vec![volume]);
            if plan_still_fits(&now, &a, &changes) {
                let mut after = now.clone();
                for c in &changes {
                    if let Change::PutAlloc(x) = c {
                        after.allocs.insert(x.id.clone(), x.clone());
                    }
                }
                // Where the plan placed, the node holds what runs there.
                let placed_on: Vec<&str> = changes
                    .iter()
                    .filter_map(|c| match c {
                        Change::PutAlloc(x) => Some(x.node_id.as_str()),
                        _ => None,
                    })
                    .collect();
                for n in nodes.iter().filter(|n| placed_on.contains(&n.id.as_str())) {
                    let used: u64 = after
                        .allocs
                        .values()
                        .filter(|x| !x.is_terminal() && x.node_id == n.id)
                        .filter_map(|x| x.group())
                        .flat_map(|g| g.tasks.iter().map(|t| t.resources.cpu))
                        .sum();
                    prop_assert!(used <= n.resources.cpu, "{} over: {used}", n.id);
                }
                // The plan adds a writer only to a volume that had none.
                let writers = |t: &Tables| {
                    t.allocs
                        .values()
                        .filter(|x| !x.is_terminal())
                        .filter(|x| x.group().is_some_and(|g| g.volumes.contains_key("data")))
                        .count()
                };
                let (was, is) = (writers(&now), writers(&after));
                prop_assert!(is == was || (was == 0 && is == 1), "{was} writers, then {is}");
            }
        }
    }
}
