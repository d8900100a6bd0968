//! `berth operator root keyring rotate`.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;

use super::{print_json, Ctx};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum OperatorCommand {
    /// Operate the servers' root keyring, which seals the secrets of the
    /// state database
    #[command(subcommand)]
    Root(RootCommand),
}

#[derive(Subcommand, Debug)]
pub enum RootCommand {
    /// The keys that seal CSI volume secrets and node secrets at rest
    #[command(subcommand)]
    Keyring(KeyringCommand),
}

#[derive(Subcommand, Debug)]
pub enum KeyringCommand {
    /// Make a new key, seal every stored secret again with it, and remove
    /// the old keys; prints the new key's ID
    Rotate(RotateArgs),
}

#[derive(Args, Debug)]
pub struct RotateArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: OperatorCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        OperatorCommand::Root(RootCommand::Keyring(KeyringCommand::Rotate(a))) => {
            keyring_rotate(a, ctx.api())
        }
    }
}

fn keyring_rotate(a: RotateArgs, api: &ApiClient) -> Result<i32> {
    let v = api.put("/v1/operator/keyring/rotate", &json!({}))?;
    if a.json {
        return print_json(&v);
    }
    println!("Key ID: {}", v["key_id"].as_str().unwrap_or_default());
    println!(
        "Sealed again: {} volumes, {} node secrets; retired {} keys",
        v["volumes"].as_u64().unwrap_or(0),
        v["node_secrets"].as_u64().unwrap_or(0),
        v["retired"].as_array().map_or(0, Vec::len)
    );
    Ok(0)
}
