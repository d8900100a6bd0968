//! berth-heartbeat: the client's heartbeat loop, and the disconnect tracker
//! that stops `disconnect { stop_on_client_after }` allocs.
//!
//! The [`Heartbeater`] heartbeats at a fraction of the TTL the servers
//! return, backs off when a heartbeat fails, re-registers the node when the
//! servers no longer know it, and records the time of the last successful
//! round trip in memory (a `watch` channel that the disconnect tracker reads)
//! and on disk (through [`LastHeartbeatStore`], which the agent implements on
//! its state DB).
//!
//! This crate knows nothing of the wire protocol, the state DB or allocs: the
//! agent plugs those in through the small traits in [`heartbeater`].

pub mod disconnect;
pub mod heartbeater;

pub use disconnect::{DisconnectConfig, DisconnectTarget, DisconnectTracker};

pub use heartbeater::{
    HeartbeatConfig, HeartbeatError, HeartbeatRpc, Heartbeater, LastHeartbeatStore, NodeRegistrar,
};
