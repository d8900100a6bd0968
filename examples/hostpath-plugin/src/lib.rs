//! `hostpath-plugin`: a CSI plugin that backs each volume with a directory
//! under its state directory.
//!
//! It serves the Identity, Controller and Node services on one unix socket.
//! `NodeStageVolume` bind-mounts the volume directory at the staging path and
//! `NodePublishVolume` bind-mounts the staging path at the target (read-only
//! when asked). The plugin's own state (volumes, capacity, controller
//! publications) lives in `<state-dir>/state.json`, written atomically.
//! Failures and delays can be injected per RPC for tests.

pub mod capability;
pub mod config;
pub mod controller;
pub mod error;
pub mod faults;
pub mod identity;
pub mod locks;
pub mod mount;
pub mod node;
pub mod plugin;
pub mod server;
pub mod state;

pub use config::{parse_args, Command, Config};
pub use plugin::{Plugin, PLUGIN_NAME, PLUGIN_VERSION};
