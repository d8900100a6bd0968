//! `berth system gc`.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;

use super::{print_json, Ctx};
use berth_api::ApiClient;
use berth_structs::text::count_of;

#[derive(Subcommand, Debug)]
pub enum SystemCommand {
    /// Garbage collect what is done (allocs, jobs, nodes, expired ACL tokens), now
    Gc(GcArgs),
}

#[derive(Args, Debug)]
pub struct GcArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: SystemCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        SystemCommand::Gc(a) => system_gc(a, ctx.api()),
    }
}

fn system_gc(a: GcArgs, api: &ApiClient) -> Result<i32> {
    let v = api.put("/v1/system/gc", &json!({}))?;
    if a.json {
        return print_json(&v);
    }
    let n = |k: &str| v[k].as_array().map_or(0, Vec::len);
    println!(
        "Garbage collected {}, {}, {}, {}",
        count_of(n("allocs"), "alloc", "allocs"),
        count_of(n("jobs"), "job", "jobs"),
        count_of(n("nodes"), "node", "nodes"),
        count_of(n("acl_tokens"), "expired ACL token", "expired ACL tokens")
    );
    Ok(0)
}
