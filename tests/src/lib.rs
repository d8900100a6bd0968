//! Shared harness for the end-to-end tests: a real `berth agent -dev`
//! process on a temp data dir, the real CLI, and a guard that, whatever the
//! test's outcome, kills every process the test started (tasks outlive the
//! agent by design), unmounts every mount under the data dir and detaches
//! the loop devices of images there.

mod acl;
mod agent;
pub mod browser;
mod cli;
pub mod cli_text;
pub mod cluster;
mod dev_agent;
mod host;
mod http;
mod inspect;
mod jobs;
pub mod pki;
mod process;
pub mod readme;
pub mod sampler;
pub mod sandbox;
pub mod snapshot;

pub use acl::*;
pub use agent::*;
pub use cli::*;
pub use dev_agent::*;
pub use host::*;
pub use http::*;
pub use inspect::*;
pub use jobs::*;

pub use berth_testutil::relay;

pub use berth_testutil::loops::{loop_devices_unusable, loops_backed_under};
pub use berth_testutil::mounts_under;

pub use berth_testutil::{bin_dir, binary};
