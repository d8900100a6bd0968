//! The scheduler: job registration and stop, and the evaluation that
//! turns a job into allocations.
//!
//! An evaluation plans on a snapshot of the tables, outside the store's
//! writer, and commits the plan only if no write moved the job or a table
//! it read since (else it plans again; see `evaluate`), so it never races
//! another write. Rules:
//!
//! - `service`: keep `count` allocs per group that are not terminal. Failed,
//!   complete and lost allocs are replaced (a failed one as the group's
//!   reschedule policy says: after its delay, which grows from attempt to
//!   attempt, and not once the policy allows no more, when the index stays
//!   failed; a lost one whose group sets `stop_after_client_disconnect`
//!   only after that window, so two copies of a single-writer workload
//!   never run at once). A replacement of a failed alloc records it and the
//!   attempts before (`reschedule_events`), and the failed alloc its
//!   replacement (`next_allocation`).
//! - `batch`: like service, but an alloc that completed is done and not
//!   replaced; a failed one is rescheduled by the policy (Nomad's batch
//!   default: once a day), lost ones are replaced. The job is dead once
//!   nothing runs or waits to be placed or rescheduled (so is a service
//!   job whose policy gave up on every alloc).
//! - `system`: one alloc per ready, eligible node that passes feasibility
//!   (a failed one is replaced after `reschedule_delay` too).
//! - Allocs the servers stopped (desired stop: job stopped, updated, or a
//!   node drain) count as gone: their index is placed again.
//! - An ineligible node (an operator's choice, or a drain) gets no new
//!   allocs; what runs there is left alone by the scheduler (the drainer
//!   moves it).
//! - A changed job (anything but server-managed fields differs) gets a new
//!   version. The allocs of an older version take it in place when the
//!   change leaves their tasks as they are (a count, meta, a restart or
//!   disconnect policy, a kill timeout: see [`update`]): they keep their
//!   ID, name and tasks, and a count change places or stops only the
//!   difference. Otherwise they are stopped and new ones placed at their
//!   index (a destructive update): all at once, or with an `update`
//!   block `max_parallel` at a time: a service group's once the new
//!   allocs are healthy, as the version's deployment tracks it (see
//!   [`deploy`]: canaries, promotion, failure and `auto_revert`); a
//!   system group's `stagger` apart.
//!
//! Feasibility on a node: status ready, eligible, the job's datacenter,
//! the constraints of the job, the group and its tasks (see [`rules`];
//! `distinct_hosts` and `distinct_property` also count where the job's
//! allocs are), every task's driver, cpu and memory left after the allocs that are not
//! terminal there, and for each CSI volume of the group: the volume exists
//! and has the requested capability, a healthy node plugin for it runs on
//! the node, and `CsiVolume::claim_conflict` finds no conflict. Claims
//! counted are the volume's real claims (freed only after unpublish,
//! whatever the alloc's state) plus an expected claim for every alloc that
//! is not terminal and asks for the volume but has not claimed it yet.
//! Last, once every other check passed: each volume with an accessible
//! topology is reachable from the node, i.e. the topology of the node's
//! plugin for it (NodeGetInfo) holds every segment of one of the volume's
//! topologies (a node plugin without a topology holds none).
//!
//! A job with placements that could not be made is blocked; blocked jobs are
//! evaluated again whenever nodes, plugins, volumes or allocs change, and
//! every `scheduler_retry_interval`.//!
//! The parts: [`register`] (the job endpoints), [`evaluate`] (an
//! evaluation's store write and the passes over blocked jobs),
//! [`reconcile`] (what a job keeps, stops and replaces), [`update`]
//! (which changes allocs take in place), [`deploy`] (the deployment of
//! the job's version), [`place`] (the
//! placements per job type), [`feasible`] (what fits on a node),
//! [`rules`] (the constraints, compiled), [`score`] (the affinities and
//! spreads),
//! [`explain`] (the failure lines) and [`retry`] (the retry timer).

mod deploy;
mod explain;
mod feasible;
mod place;
mod reconcile;
mod rules;
mod score;
mod update;

pub(crate) use crate::coalesced::Coalesced;
pub(crate) use deploy::canaries_healthy;
pub(crate) use feasible::plan_still_fits;
pub(crate) use place::place;
pub(crate) use reconcile::{
    disconnect_window_end_ms, given_up, log_plan, plan_job, plan_stored_job, status_of_allocs,
    tables_read, PlacementCounts, PlanOutcome,
};
