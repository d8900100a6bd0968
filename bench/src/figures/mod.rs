//! One module per figure. Each has `Args` (its flags), `run` and `smoke`
//! (the figure at a tiny size, for CI).

pub mod claims_release;
pub mod cli_start;
pub mod client_rss;
pub mod concurrent_writers;
pub mod executor_rss;
pub mod job_run;
pub mod job_run_csi;
pub mod reattach;
pub mod scheduler;
pub mod server_scale;
pub mod stop_claim_free;
pub mod stores;
