//! The job operations of the OpenAPI document (see `openapi.rs`): the
//! registration, reads, plan, scale, versions, revert and summary of a
//! job.

use serde_json::{json, Value};

use super::openapi::{object, op, schema_ref, Op};

/// The answer to a job registration (a run, a scale).
fn registered() -> Value {
    object(
        json!({
            "index": { "type": "integer" },
            "job_modify_index": { "type": "integer" },
            "version": { "type": "integer" },
            "changed": { "type": "boolean" },
        }),
        &["index", "job_modify_index", "version", "changed"],
    )
}

/// A deployment (one rollout of a job version).
fn deployment() -> Value {
    object(
        json!({
            "id": { "type": "string" },
            "job_id": { "type": "string" },
            "job_version": { "type": "integer" },
            "status": { "enum": ["running", "successful", "failed", "cancelled"] },
            "status_description": { "type": "string" },
            "groups": { "type": "object", "additionalProperties": object(json!({
                "desired_total": { "type": "integer" },
                "desired_canaries": { "type": "integer" },
                "placed_canaries": { "type": "array", "items": { "type": "string" } },
                "promoted": { "type": "boolean" },
                "auto_revert": { "type": "boolean" },
                "auto_promote": { "type": "boolean" },
                "placed_allocs": { "type": "integer" },
                "healthy_allocs": { "type": "integer" },
                "unhealthy_allocs": { "type": "integer" },
                "require_progress_by_ms": { "type": "integer" },
            }), &["desired_total", "placed_allocs", "healthy_allocs", "unhealthy_allocs"]) },
            "reverted_to": { "type": "integer", "description": "the version a failed deployment reverted the job to" },
            "create_index": { "type": "integer" },
            "modify_index": { "type": "integer" },
            "create_time_ms": { "type": "integer" },
            "modify_time_ms": { "type": "integer" },
        }),
        &["id", "job_id", "job_version", "status", "groups"],
    )
}

/// The deployment routes' operations.
pub(super) fn deployment_operations() -> Vec<Op> {
    vec![
        op("get", "/v1/deployments", "The deployments, by ID").list_items(deployment()),
        op("get", "/v1/deployment/{id}", "A deployment (by ID or unique ID prefix)")
            .one(deployment()),
        op(
            "post",
            "/v1/deployment/fail/{id}",
            "Fail a running deployment; a group with auto_revert reverts the job to its last stable version",
        )
        .answers(deployment()),
        op(
            "post",
            "/v1/deployment/promote/{id}",
            "Promote a deployment whose canaries are all healthy: the rest of the roll goes on",
        )
        .answers(deployment()),
        op("get", "/v1/job/{id}/deployments", "A job's deployments, newest first")
            .one(json!({ "type": "array", "items": deployment() })),
        op("get", "/v1/job/{id}/deployment", "A job's newest deployment (null when none)")
            .one(json!({ "oneOf": [deployment(), { "type": "null" }] })),
    ]
}

/// The job routes' operations.
pub(super) fn job_operations() -> Vec<Op> {
    vec![
        op("get", "/v1/jobs", "The jobs").list_of("Job"),
        op("put", "/v1/jobs", "Register (submit or update) a job and place its allocs")
            .body(object(
                json!({
                    "job": schema_ref("Job"),
                    "enforce_index": {
                        "type": "boolean",
                        "description": "register only while the stored job's job_modify_index is job_modify_index (0: only a new job)",
                    },
                    "job_modify_index": { "type": "integer", "minimum": 0 },
                }),
                &["job"],
            ))
            .answers(registered()),
        op("get", "/v1/job/{id}", "A job (by ID or unique ID prefix), with its placement failures")
            .one(schema_ref("Job")),
        op("delete", "/v1/job/{id}", "Stop a job (by ID or unique ID prefix)")
            .query("purge", "boolean", false, "also remove the job once its allocs are done"),
        op("get", "/v1/job/{id}/allocations", "A job's allocs").list_of("Allocation"),
        op(
            "put",
            "/v1/job/{id}/plan",
            "What registering the job would change, place and stop; writes nothing",
        )
        .body(object(json!({ "job": schema_ref("Job") }), &["job"]))
        .answers(object(
            json!({
                "job_id": { "type": "string" },
                "job_modify_index": { "type": "integer" },
                "diff": { "type": "object" },
            }),
            &["job_id", "job_modify_index", "diff"],
        )),
        op(
            "post",
            "/v1/job/{id}/scale",
            "Set a group's count (the job's only group when none is named): a new version the running allocs take in place",
        )
        .body(object(
            json!({
                "count": { "type": "integer", "minimum": 0 },
                "group": { "type": "string" },
            }),
            &["count"],
        ))
        .answers(registered()),
        op(
            "get",
            "/v1/job/{id}/versions",
            "A job's kept versions, newest first, each with the field diff against the one before",
        )
        .one(json!({ "type": "array", "items": object(
            json!({
                "version": { "type": "integer" },
                "submit_time_ms": { "type": "integer" },
                "stable": { "type": "boolean" },
                "job": schema_ref("Job"),
                "diff": { "type": "array", "items": { "type": "object" } },
            }),
            &["version", "job", "diff"],
        ) })),
        op(
            "post",
            "/v1/job/{id}/revert",
            "Submit a kept version of the job again, as a new version",
        )
        .body(object(
            json!({
                "version": { "type": "integer", "minimum": 0 },
                "enforce_prior_version": { "type": "integer", "minimum": 0 },
            }),
            &["version"],
        ))
        .answers(registered()),
        op("get", "/v1/job/{id}/summary", "A job's allocs per group, counted by state").one(object(
            json!({
                "job_id": { "type": "string" },
                "index": { "type": "integer" },
                "groups": { "type": "object", "additionalProperties": { "type": "object" } },
            }),
            &["job_id", "groups"],
        )),
    ]
}
