//! Job registration and stop: the endpoints, the comparison of a new
//! submission with the stored job, and `enforce_index`.

use berth_structs::{Job, JobStatus};

use crate::error::ServerError;
use crate::server::Server;
use crate::state::job_versions::same_spec;
use crate::state::Change;

pub use berth_structs::api::JobRegisterResponse;

/// The index a submission with `enforce_index` must name: the stored job's
/// `job_modify_index` (its `modify_index` for a job stored before that
/// existed), 0 when there is no such job.
pub(crate) fn spec_index(job: Option<&Job>) -> u64 {
    job.map_or(0, |j| {
        if j.job_modify_index > 0 {
            j.job_modify_index
        } else {
            j.modify_index
        }
    })
}

/// A submission with `enforce_index`: refused unless the stored job's
/// index is `want` (0: the job must not exist yet).
fn check_enforced_index(id: &str, stored: Option<&Job>, want: u64) -> Result<(), ServerError> {
    let have = spec_index(stored);
    if have == want {
        return Ok(());
    }
    Err(ServerError::Conflict(if want == 0 {
        format!(
            "job {id:?} already exists (job modify index {have}); enforce_index with index 0 \
             registers only a new job"
        )
    } else if have == 0 {
        format!("job {id:?} does not exist; enforce_index gave job modify index {want}")
    } else {
        format!(
            "job {id:?} has job modify index {have}, not the {want} given with enforce_index: \
             it changed since"
        )
    }))
}

/// What registering `job` makes of it beside the stored `old`: the job to
/// store and whether it is a change (a new job, a changed spec, or a run
/// of a stopped job: a new version). `index` is the index the write will
/// have.
pub(crate) fn registration(old: Option<&Job>, mut job: Job, index: u64) -> (Job, bool) {
    job.purge = false;
    match old {
        Some(old) if same_spec(old, &job) && !old.stop => (old.clone(), false),
        Some(old) => {
            job.version = old.version.saturating_add(1);
            job.stop = false;
            job.status = old.status;
            job.job_modify_index = index;
            (job, true)
        }
        None => {
            job.version = 0;
            job.stop = false;
            job.status = JobStatus::Pending;
            job.job_modify_index = index;
            (job, true)
        }
    }
}

impl Server {
    /// Register (or update) a job and evaluate it.
    pub async fn register_job(&self, job: Job) -> Result<JobRegisterResponse, ServerError> {
        self.register_job_checked(job, None).await
    }

    /// The checks a submitted (or planned) job passes: its own
    /// (`Job::validate`), a region, when it names one, that is this
    /// cluster's, and modes of its volumes that they have.
    pub(crate) fn check_job(&self, job: &Job) -> Result<(), ServerError> {
        job.validate()?;
        let mine = &self.config.region;
        if !job.region.is_empty() && job.region != *mine {
            return Err(berth_structs::ValidationError(vec![format!(
                "job {:?}: region {:?} is not this cluster's region {mine:?}; submit it to \
                 the servers of {:?}",
                job.id, job.region, job.region
            )])
            .into());
        }
        self.check_volume_modes(job)
    }

    /// A group that asks a volume for an access or attachment mode the
    /// volume was not created with would wait for a claim forever:
    /// refused at the door, with the modes the volume has. A volume that
    /// does not exist yet, or lists no capabilities, is not judged.
    fn check_volume_modes(&self, job: &Job) -> Result<(), ServerError> {
        let errs = self.store.read(|t| {
            let mut errs = Vec::new();
            for g in &job.task_groups {
                for req in g.volumes.values().filter(|r| r.volume_type == "csi") {
                    let (Some(access), Some(attach)) = (req.access_mode, req.attachment_mode)
                    else {
                        continue;
                    };
                    let ids: Vec<String> = if req.per_alloc {
                        (0..g.count).map(|i| req.source_for(i)).collect()
                    } else {
                        vec![req.source.clone()]
                    };
                    for id in ids {
                        let Some(v) = t.volumes.get(&id) else {
                            continue;
                        };
                        if v.capabilities.is_empty() || v.has_capability(access, attach) {
                            continue;
                        }
                        let has: Vec<String> = v
                            .capabilities
                            .iter()
                            .map(|c| {
                                format!("{} {}", c.access_mode.as_str(), c.attachment_mode.as_str())
                            })
                            .collect();
                        errs.push(format!(
                            "group {:?} volume {:?}: volume {id:?} was not created for {} {} \
                             (its capabilities: {})",
                            g.name,
                            req.name,
                            access.as_str(),
                            attach.as_str(),
                            has.join(", ")
                        ));
                    }
                }
            }
            errs
        });
        if errs.is_empty() {
            Ok(())
        } else {
            Err(berth_structs::ValidationError(errs).into())
        }
    }

    /// Register a job; with `enforce_index`, only while the stored job's
    /// job modify index is that (0: only while no such job exists), so
    /// that a submission planned against one version does not overwrite a
    /// later one.
    pub async fn register_job_checked(
        &self,
        job: Job,
        enforce_index: Option<u64>,
    ) -> Result<JobRegisterResponse, ServerError> {
        self.check_job(&job)?;
        let job_id = job.id.clone();
        let ((changed, version), _) = self
            .store
            .write_async(|t, changes| {
                let old = t.jobs.get(&job.id);
                if let Some(want) = enforce_index {
                    check_enforced_index(&job.id, old, want)?;
                }
                let (next, changed) = registration(old, job, t.index.saturating_add(1));
                let version = next.version;
                if changed {
                    crate::state::job_versions::record_version(t, &next, changes);
                    changes.push(Change::PutJob(next));
                }
                Ok::<_, ServerError>((changed, version))
            })
            .await?;
        if changed {
            tracing::info!(job_id = %job_id, version, "job registered");
        }
        let placement = self.evaluate_job(&job_id).await;
        let job_modify_index = self.store.read(|t| spec_index(t.jobs.get(&job_id)));
        Ok(JobRegisterResponse {
            index: self.store.index(),
            job_modify_index,
            version,
            changed,
            placement_failures: self.job_placement_failures(&job_id),
            desired_allocs: placement.desired,
            unplaced_allocs: placement.unplaced,
        })
    }

    /// Set the count of group `group` (the job's only group when `None`)
    /// of job `id` to `count`: a new version, which the running allocs
    /// take in place while the difference is placed or stopped. Refused
    /// for a stopped job (a scale would run it again) and a system job
    /// (one alloc a node), and made only on top of the job as read.
    pub async fn scale_job(
        &self,
        id: &str,
        group: Option<&str>,
        count: u32,
    ) -> Result<JobRegisterResponse, ServerError> {
        let mut job = self.store.read(|t| crate::server::job_in(t, id).cloned())?;
        if job.stop {
            return Err(ServerError::Conflict(format!(
                "job {:?} is stopped: run it to scale it",
                job.id
            )));
        }
        if job.job_type == berth_structs::JobType::System {
            return Err(ServerError::BadRequest(format!(
                "job {:?} is a system job (one alloc on each node): it has no count to scale",
                job.id
            )));
        }
        let names: Vec<String> = job.task_groups.iter().map(|g| g.name.clone()).collect();
        let i = match group {
            Some(name) => names.iter().position(|n| n == name).ok_or_else(|| {
                ServerError::not_found(format!(
                    "job {:?} has no group {name:?} (its groups: {})",
                    job.id,
                    names.join(", ")
                ))
            })?,
            None if names.len() == 1 => 0,
            None => {
                return Err(ServerError::BadRequest(format!(
                    "job {:?} has {} groups ({}): name the one to scale",
                    job.id,
                    names.len(),
                    names.join(", ")
                )))
            }
        };
        job.task_groups[i].count = count;
        let index = spec_index(Some(&job));
        self.register_job_checked(job, Some(index)).await
    }

    /// Stop a job: every alloc of it is asked to stop. Returns the index.
    pub async fn stop_job(&self, id: &str) -> Result<u64, ServerError> {
        self.stop_job_with(id, false).await
    }

    /// Stop a job and, with `purge`, have it leave the state as soon as
    /// every alloc of it is done and holds no volume claim (garbage
    /// collection's rules, without its thresholds). Returns the index.
    pub async fn stop_job_with(&self, id: &str, purge: bool) -> Result<u64, ServerError> {
        self.store
            .write_async(|t, changes| {
                let job = t
                    .jobs
                    .get(id)
                    .ok_or_else(|| ServerError::not_found(format!("job {id:?} not found")))?;
                if !job.stop || (purge && !job.purge) {
                    let mut job = job.clone();
                    if !job.stop {
                        job.job_modify_index = t.index.saturating_add(1);
                    }
                    job.stop = true;
                    job.purge |= purge;
                    changes.push(Change::PutJob(job));
                }
                Ok::<_, ServerError>(())
            })
            .await?;
        tracing::info!(job_id = id, purge, "job stopped");
        self.evaluate_job(id).await;
        if purge {
            self.collect_purged_job(id)?;
        }
        Ok(self.store.index())
    }
}
