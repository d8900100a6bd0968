//! Feasibility: what an evaluation sees of the cluster as it plans (the
//! resources in use per node, the expected volume claims), and why a group
//! cannot run on a node.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use berth_structs::{
    AllocClientStatus, Allocation, ClaimMode, ClaimState, CsiVolume, CsiVolumeClaim, Job, Node,
    NodeStatus, TaskGroup,
};

use super::rules::GroupRules;
use crate::state::{Change, Tables};

/// Resources in use on a node or asked for by a group. Sums of the u64
/// asks of tasks and allocs are kept in u128, where they cannot wrap, and
/// compared with a node's u64 totals there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Usage {
    /// MHz.
    pub(super) cpu: u128,
    /// MiB.
    pub(super) memory_mb: u128,
}

impl Usage {
    /// What a group asks for: the sums over its tasks.
    pub(super) fn of_group(g: &TaskGroup) -> Usage {
        g.tasks.iter().fold(Usage::default(), |u, t| {
            u.plus(Usage {
                cpu: u128::from(t.resources.cpu),
                memory_mb: u128::from(t.resources.memory_mb),
            })
        })
    }

    pub(super) fn plus(self, o: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_add(o.cpu),
            memory_mb: self.memory_mb.saturating_add(o.memory_mb),
        }
    }

    fn minus(self, o: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(o.cpu),
            memory_mb: self.memory_mb.saturating_sub(o.memory_mb),
        }
    }
}

/// Why `asked` more of a resource does not fit beside `used` within
/// `total`, if it does not.
fn exhausted(what: &str, unit: &str, used: u128, asked: u128, total: u64) -> Option<String> {
    if used.saturating_add(asked) <= u128::from(total) {
        return None;
    }
    if asked > u128::from(u64::MAX) {
        return Some(format!(
            "the group asks for {asked} {unit} of {what} in total, more than any node can have"
        ));
    }
    Some(format!(
        "{what} exhausted ({used} of {total} {unit} in use, {asked} {unit} asked)"
    ))
}

/// What an evaluation sees of the cluster, updated as it plans.
pub(super) struct PlanContext<'a> {
    tables: &'a Tables,
    /// Resources in use on the nodes this evaluation placed on or stopped
    /// allocs of; every other node's are the state's (its index of what
    /// the allocs that are not terminal use per node).
    used: HashMap<String, Usage>,
    /// The volumes the job being planned asks for, with expected claims
    /// added (no other volume is looked at, so no other is copied).
    volumes: BTreeMap<String, CsiVolume>,
    /// Each group's placement rules, compiled once.
    rules: HashMap<String, Arc<GroupRules>>,
    /// The allocs this plan stops: their claims are on their way out.
    stopped: HashSet<String>,
}

fn expected_claim(a: &Allocation, req: &berth_structs::VolumeRequest) -> Option<CsiVolumeClaim> {
    let access = req.access_mode?;
    let attach = req.attachment_mode?;
    Some(CsiVolumeClaim {
        alloc_id: a.id.clone(),
        node_id: a.node_id.clone(),
        external_node_id: String::new(),
        mode: if req.read_only {
            ClaimMode::Read
        } else {
            ClaimMode::Write
        },
        access_mode: access,
        attachment_mode: attach,
        state: ClaimState::Taken,
        publish_context: BTreeMap::new(),
        releasing: false,
        controller_published: false,
        kept_after_purge: false,
    })
}

impl<'a> PlanContext<'a> {
    pub(super) fn new(tables: &'a Tables, job: &Job) -> PlanContext<'a> {
        let mut volumes = BTreeMap::new();
        for g in &job.task_groups {
            for req in g.volumes.values() {
                let ids: Box<dyn Iterator<Item = String>> = if req.per_alloc {
                    Box::new((0..g.count).map(|i| req.source_for(i)))
                } else {
                    Box::new(std::iter::once(req.source.clone()))
                };
                for id in ids {
                    if let Some(v) = tables.volumes.get(&id) {
                        volumes.insert(id, v.clone());
                    }
                }
            }
        }
        let rules = job
            .task_groups
            .iter()
            .map(|g| (g.name.clone(), Arc::new(GroupRules::compile(job, g))))
            .collect();
        let mut ctx = PlanContext {
            tables,
            used: HashMap::new(),
            volumes,
            rules,
            stopped: HashSet::new(),
        };
        // Only a job that asks for volumes needs the expected claims of
        // the allocs that ask for them too. An alloc held unknown claims
        // nothing while its node is down: what it holds it holds as a real
        // claim, which the volume watcher keeps or frees.
        if !ctx.volumes.is_empty() {
            for a in tables
                .allocs
                .values()
                .filter(|a| !a.is_terminal() && a.client_status != AllocClientStatus::Unknown)
            {
                ctx.expect_claims(a);
            }
        }
        ctx
    }

    pub(super) fn tables(&self) -> &'a Tables {
        self.tables
    }

    /// The compiled placement rules of `group`.
    pub(super) fn rules(&self, group: &str) -> Arc<GroupRules> {
        self.rules.get(group).cloned().unwrap_or_default()
    }

    /// The resources in use on `node_id`.
    pub(super) fn used(&self, node_id: &str) -> Usage {
        self.used.get(node_id).copied().unwrap_or_else(|| {
            let u = self.tables.node_use(node_id);
            Usage {
                cpu: u.cpu,
                memory_mb: u.memory_mb,
            }
        })
    }

    fn used_mut(&mut self, node_id: &str) -> &mut Usage {
        let base = self.used(node_id);
        self.used.entry(node_id.to_string()).or_insert(base)
    }

    pub(super) fn add(&mut self, a: &Allocation) {
        let Some(g) = a.group() else { return };
        let u = self.used_mut(&a.node_id);
        *u = u.plus(Usage::of_group(g));
        self.expect_claims(a);
    }

    /// An expected claim of `a` on each volume of the job's it asks for
    /// and has not claimed yet.
    fn expect_claims(&mut self, a: &Allocation) {
        let Some(g) = a.group() else { return };
        for req in g.volumes.values() {
            let vid = req.source_for(a.index);
            let Some(v) = self.volumes.get_mut(&vid) else {
                continue;
            };
            if v.claim_for(&a.id).is_some() {
                continue;
            }
            if let Some(claim) = expected_claim(a, req) {
                match claim.mode {
                    ClaimMode::Read => v.read_claims.insert(a.id.clone(), claim),
                    ClaimMode::Write => v.write_claims.insert(a.id.clone(), claim),
                };
            }
        }
    }

    pub(super) fn remove(&mut self, a: &Allocation) {
        self.stopped.insert(a.id.clone());
        let Some(g) = a.group() else { return };
        let u = self.used_mut(&a.node_id);
        *u = u.minus(Usage::of_group(g));
        // Expected claims go; real claims stay until they are freed.
        for req in g.volumes.values() {
            let vid = req.source_for(a.index);
            let (Some(v), Some(real)) = (self.volumes.get_mut(&vid), self.tables.volumes.get(&vid))
            else {
                continue;
            };
            if real.claim_for(&a.id).is_none() {
                v.read_claims.remove(&a.id);
                v.write_claims.remove(&a.id);
            }
        }
    }

    /// Why `group` of `job` (alloc `index`) cannot run on `node`, if it
    /// cannot. Reasons name a per_alloc volume as `source[<index>]`, so
    /// that allocs held back by the same cause give the same reason.
    pub(super) fn infeasible(
        &self,
        job: &Job,
        group: &TaskGroup,
        index: u32,
        alloc_id: &str,
        node: &Node,
    ) -> Option<String> {
        self.node_infeasible(job, group, node)
            .or_else(|| self.volumes_infeasible(group, index, alloc_id, node))
    }

    /// The checks of [`Self::infeasible`] that do not depend on the alloc's
    /// index: the node's status, eligibility, datacenter, constraints and
    /// drivers, and
    /// the cpu and memory left on it. Within one group's placements these
    /// only ever turn from fit to no fit (placements only add usage).
    pub(super) fn node_infeasible(
        &self,
        job: &Job,
        group: &TaskGroup,
        node: &Node,
    ) -> Option<String> {
        if node.status != NodeStatus::Ready {
            return Some(format!("node is {}", node.status.as_str()));
        }
        if !node.is_eligible() {
            return Some(if node.drain_strategy.is_some() {
                "node ineligible (draining)".to_string()
            } else {
                "node ineligible".to_string()
            });
        }
        if let Some(why) = self.rules_unmet(job, group, node) {
            return Some(why);
        }
        for t in &group.tasks {
            if !node.drivers.contains(&t.driver) {
                // What the node says of it (raw_exec not enabled, exec
                // without cgroups), when it says something.
                return Some(match node.driver_info.get(&t.driver) {
                    Some(info) if !info.health_description.is_empty() => format!(
                        "driver {:?} (task {:?}): {}",
                        t.driver, t.name, info.health_description
                    ),
                    _ => format!("missing driver {:?} (task {:?})", t.driver, t.name),
                });
            }
        }
        let asked = Usage::of_group(group);
        let used = self.used(&node.id);
        if let Some(why) = exhausted("cpu", "MHz", used.cpu, asked.cpu, node.resources.cpu) {
            return Some(why);
        }
        if let Some(why) = exhausted(
            "memory",
            "MiB",
            used.memory_mb,
            asked.memory_mb,
            node.resources.memory_mb,
        ) {
            return Some(why);
        }
        None
    }

    /// For a placement of `job`'s `group` that the volume checks refuse
    /// only because allocs it replaces still hold claims it conflicts
    /// with: those allocs, whose release it can wait for. An alloc it
    /// replaces is one of the same job and group that this plan or an
    /// earlier one stopped, on a ready node whose client still reports it
    /// (it stops the task and frees the claim soon); a lost one holds its
    /// claim until an operator or its node frees it, and another job's
    /// writer is not this one's to wait for. None when anything else
    /// refuses the placement, or nothing does.
    pub(super) fn volumes_wait(
        &self,
        job: &Job,
        group: &TaskGroup,
        index: u32,
        alloc_id: &str,
        node: &Node,
    ) -> Option<Vec<String>> {
        let outgoing = |id: &str| {
            self.tables.allocs.get(id).is_some_and(|a| {
                a.job_id == job.id
                    && a.task_group == group.name
                    && (self.stopped.contains(id) || a.server_terminal())
                    && !matches!(
                        a.client_status,
                        AllocClientStatus::Lost | AllocClientStatus::Unknown
                    )
                    && self
                        .tables
                        .nodes
                        .get(&a.node_id)
                        .is_some_and(|n| n.status == NodeStatus::Ready)
            })
        };
        let mut waits: Vec<String> = Vec::new();
        let mut patched = BTreeMap::new();
        for req in group.volumes.values() {
            let vid = req.source_for(index);
            let Some(v) = self.volumes.get(&vid) else {
                continue;
            };
            let mut freed = v.clone();
            for claims in [&mut freed.read_claims, &mut freed.write_claims] {
                claims.retain(|id, _| {
                    let out = id != alloc_id && outgoing(id);
                    if out && !waits.contains(id) {
                        waits.push(id.clone());
                    }
                    !out
                });
            }
            patched.insert(vid, freed);
        }
        if waits.is_empty() {
            return None;
        }
        let freed = PlanContext {
            tables: self.tables,
            used: HashMap::new(),
            volumes: patched,
            rules: HashMap::new(),
            stopped: HashSet::new(),
        };
        freed
            .volumes_infeasible(group, index, alloc_id, node)
            .is_none()
            .then_some(waits)
    }

    /// The placement rules `node` fails for `group`, if it fails one: the
    /// job's datacenters, then the constraints on the node.
    pub(super) fn rules_unmet(&self, job: &Job, group: &TaskGroup, node: &Node) -> Option<String> {
        if !job.datacenters.is_empty()
            && !job
                .datacenters
                .iter()
                .any(|d| berth_structs::datacenter_matches(d, &node.datacenter))
        {
            return Some(format!(
                "datacenter {:?} not in the job's datacenters",
                node.datacenter
            ));
        }
        self.rules.get(&group.name)?.unmet_on(node)
    }

    /// The volume checks of [`Self::infeasible`]: a per_alloc volume's
    /// depend on the alloc's index; every other one's only ever turn from
    /// fit to no fit within one group's placements (claims are only added).
    pub(super) fn volumes_infeasible(
        &self,
        group: &TaskGroup,
        index: u32,
        alloc_id: &str,
        node: &Node,
    ) -> Option<String> {
        for (name, req) in &group.volumes {
            let vid = req.source_for(index);
            let shown = if req.per_alloc {
                format!("{}[<index>]", req.source)
            } else {
                vid.clone()
            };
            let Some(v) = self.volumes.get(&vid) else {
                return Some(format!(
                    "volume {shown:?} (group volume {name:?}) does not exist"
                ));
            };
            if !node.has_healthy_node_plugin(&v.plugin_id)
                || !self
                    .tables
                    .plugin_instance_allowed(&node.id, &v.plugin_id, false)
            {
                return Some(format!(
                    "no healthy node plugin {:?} for volume {shown:?}",
                    v.plugin_id
                ));
            }
            let (Some(access), Some(attach)) = (req.access_mode, req.attachment_mode) else {
                return Some(format!(
                    "volume {name:?} lacks access_mode or attachment_mode"
                ));
            };
            if !v.has_capability(access, attach) {
                return Some(format!(
                    "volume {shown:?} does not have capability {access}/{attach}"
                ));
            }
            let mode = if req.read_only {
                ClaimMode::Read
            } else {
                ClaimMode::Write
            };
            if let Some(conflict) = v.claim_conflict(alloc_id, &node.id, access, mode) {
                return Some(conflict);
            }
        }
        // Topology last: a node that fails only here is one that passes
        // every other check.
        for req in group.volumes.values() {
            let vid = req.source_for(index);
            let Some(v) = self.volumes.get(&vid) else {
                continue;
            };
            let here = node
                .csi_node_plugins
                .get(&v.plugin_id)
                .and_then(|p| p.accessible_topology.as_ref());
            if !v.reachable_from(here) {
                let shown = if req.per_alloc {
                    format!("{}[<index>]", req.source)
                } else {
                    vid.clone()
                };
                let node_at = match here {
                    Some(t) => format!("is in topology {t}"),
                    None => "has no topology".to_string(),
                };
                return Some(format!(
                    "volume {shown:?} is reachable only from topology {}; node plugin {:?} here {node_at}",
                    berth_structs::topologies_text(&v.accessible_topology),
                    v.plugin_id
                ));
            }
        }
        None
    }
}

/// Whether `changes`, a plan of `job` made on an earlier read of the
/// tables, can be committed on `t` as it is now, where tables the plan
/// read have moved since: each alloc it places is checked again on `t` as
/// the placer checks it (the node's status, eligibility, datacenter and
/// drivers, the cpu and memory left, the volumes' plugins, capabilities,
/// claims and topology), with the plan's stops and placements counted in
/// the order the placer made them. The caller checks that the job and its
/// allocs are as the plan read them; a plan that writes anything but the
/// job and its allocs is not checked again (false).
pub(crate) fn plan_still_fits(t: &Tables, job: &Job, changes: &[Change]) -> bool {
    let mut ctx = PlanContext::new(t, job);
    for c in changes {
        match c {
            Change::PutJob(j) if j.id == job.id => {}
            Change::PutAlloc(a) if a.job_id == job.id => match t.allocs.get(&a.id) {
                // A stop of one of the job's allocs frees what it used.
                Some(old) => {
                    if a.server_terminal() && !old.server_terminal() {
                        ctx.remove(old);
                    }
                }
                None => {
                    let (Some(node), Some(group)) = (t.nodes.get(&a.node_id), a.group()) else {
                        return false;
                    };
                    if ctx.infeasible(job, group, a.index, &a.id, node).is_some() {
                        return false;
                    }
                    ctx.add(a);
                }
            },
            _ => return false,
        }
    }
    true
}
