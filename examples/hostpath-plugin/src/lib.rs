//! `hostpath-plugin`: a CSI plugin that backs each volume with a directory
//! under its state directory.
//!
//! It serves the Identity, Controller and Node services on one unix socket.
//! `NodeStageVolume` bind-mounts the volume directory at the staging path and
//! `NodePublishVolume` bind-mounts the staging path at the target (read-only
//! when asked). The plugin's own state (volumes, capacity, controller
//! publications, topology, snapshots, the nodes serving it) lives in
//! `<state-dir>/state.json`; snapshot copies under `<state-dir>/snapshots`.
//! Failures and delays can be injected per RPC for tests.
//!
//! Several instances (one per node) may share one state directory, as nodes
//! share network storage: every change is made under an exclusive file lock,
//! re-reading and atomically rewriting the state file, and every read loads
//! it under a shared lock (see [`state`]). Node-local facts (what is staged
//! or published on a node) are never written to the shared directory: each
//! node's mount table is their record. The per-volume guard that answers
//! `ABORTED` ([`locks`]) stays per process: it serialises the calls one CO
//! makes to one node's instance; calls for one volume through different
//! instances are made safe by the state lock instead, under which each
//! controller change is checked and applied as one step.

pub mod capability;
pub mod config;
pub mod controller;
pub mod copy;
pub mod error;
pub mod faults;
pub mod identity;
pub mod image;
pub mod locks;
pub mod mount;
pub mod node;
pub mod plugin;
pub mod server;
pub mod snapshot;
pub mod state;

pub use config::{parse_args, Command, Config};
pub use plugin::{Plugin, PLUGIN_NAME, PLUGIN_VERSION};
