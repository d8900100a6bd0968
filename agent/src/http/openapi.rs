//! The API described as an OpenAPI 3.1 document, served by every agent at
//! `GET /v1/openapi.json`. Each route of [`super::routes::all_routes`] has
//! one entry in [`operations`]; the tests hold the two to each other, so a
//! route added without a description (or a description of a route that is
//! gone) fails them, naming it.

use std::sync::OnceLock;

use axum::Json;
use serde_json::{json, Map, Value};

/// How an operation reads: a list (a blocking query and pages), one object
/// (a blocking query), or neither.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    List,
    One,
    Plain,
}

/// One operation: a method on a path.
pub(super) struct Op {
    method: &'static str,
    path: &'static str,
    summary: &'static str,
    read: Read,
    /// Its own query parameters: name, JSON type, required, description.
    query: Vec<(&'static str, &'static str, bool, &'static str)>,
    /// The request body's schema.
    body: Option<Value>,
    /// Whether the body may be left out.
    body_optional: bool,
    /// The 200 answer's media type and schema.
    media: &'static str,
    answer: Value,
    /// Headers of the 200 answer beyond the index and the next token.
    headers: Vec<(&'static str, &'static str)>,
}

pub(super) fn op(method: &'static str, path: &'static str, summary: &'static str) -> Op {
    Op {
        method,
        path,
        summary,
        read: Read::Plain,
        query: Vec::new(),
        body: None,
        body_optional: false,
        media: "application/json",
        answer: json!({ "type": "object" }),
        headers: Vec::new(),
    }
}

impl Op {
    /// A list of `schema`s: blocking, paged.
    pub(super) fn list_of(self, schema: &str) -> Op {
        self.list_items(schema_ref(schema))
    }

    /// A paged list of `items`.
    pub(super) fn list_items(mut self, items: Value) -> Op {
        self.read = Read::List;
        self.answer = json!({ "type": "array", "items": items });
        self
    }

    /// One object: blocking.
    pub(super) fn one(mut self, answer: Value) -> Op {
        self.read = Read::One;
        self.answer = answer;
        self
    }

    pub(super) fn answers(mut self, answer: Value) -> Op {
        self.answer = answer;
        self
    }

    /// An answer that is not JSON.
    pub(super) fn answers_raw(mut self, media: &'static str) -> Op {
        self.media = media;
        self.answer = json!({ "type": "string" });
        self
    }

    pub(super) fn header(mut self, name: &'static str, description: &'static str) -> Op {
        self.headers.push((name, description));
        self
    }

    pub(super) fn query(
        mut self,
        name: &'static str,
        kind: &'static str,
        required: bool,
        description: &'static str,
    ) -> Op {
        self.query.push((name, kind, required, description));
        self
    }

    pub(super) fn body(mut self, schema: Value) -> Op {
        self.body = Some(schema);
        self
    }

    pub(super) fn optional_body(mut self, schema: Value) -> Op {
        self.body_optional = true;
        self.body(schema)
    }
}

pub(super) fn schema_ref(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

/// An object schema: its properties, the required ones named.
pub(super) fn object(properties: Value, required: &[&str]) -> Value {
    json!({ "type": "object", "properties": properties, "required": required })
}

/// Every operation of the API: the agent's own routes, then the server
/// API's.
fn operations() -> Vec<Op> {
    let id_list = json!({ "type": "array", "items": { "type": "string" } });
    let tasks_answer = |extra: Value| {
        let mut props = json!({
            "alloc_id": { "type": "string" },
            "tasks": { "type": "array", "items": { "type": "string" } },
        });
        if let (Some(p), Some(e)) = (props.as_object_mut(), extra.as_object()) {
            p.extend(e.clone());
        }
        object(props, &["alloc_id", "tasks"])
    };
    let volume_body = object(json!({ "volume": schema_ref("CsiVolume") }), &["volume"]);
    let mut ops = vec![
        // The agent's own routes.
        op(
            "get",
            "/v1/agent/self",
            "This agent: its roles, addresses, data dir, servers, its limits of waiting requests and what is in flight, and, with the client role, its node",
        )
        .answers(object(
            json!({
                "roles": { "type": "array", "items": { "enum": ["server", "client"] } },
                "data_dir": { "type": "string" },
                "http_addr": { "type": ["string", "null"] },
                "rpc_addr": { "type": ["string", "null"] },
                "servers": { "type": "array", "items": { "type": "string" } },
                "limits": object(json!({
                    "max_blocking_queries": { "type": "integer" },
                    "blocking_queries": { "type": "integer" },
                    "max_log_follows": { "type": "integer" },
                    "log_follows": { "type": "integer" },
                }), &["max_blocking_queries", "blocking_queries", "max_log_follows", "log_follows"]),
                "client": object(json!({
                    "node_id": { "type": "string" },
                    "node_name": { "type": "string" },
                    "registered": { "type": "boolean" },
                    "last_heartbeat_ms": { "type": ["integer", "null"] },
                    "current_server": { "type": ["string", "null"] },
                }), &["node_id", "node_name", "registered"]),
            }),
            &["roles", "data_dir", "servers"],
        )),
        op(
            "get",
            "/v1/openapi.json",
            "This document: the API as OpenAPI 3.1",
        ),
        op(
            "get",
            "/v1/metrics",
            "This agent's metrics in the Prometheus text format (never forwarded)",
        )
        .answers_raw("text/plain"),
        op(
            "get",
            "/v1/client/fs/logs/{id}",
            "A task's stdout or stderr, as raw bytes, from a cursor; sent to the alloc's node",
        )
        .query("task", "string", false, "the task (optional when the alloc has one)")
        .query("type", "string", false, "stdout (the default) or stderr")
        .query("origin", "string", false, "start (the default) or end: where offset counts from")
        .query("offset", "integer", false, "the byte to start at")
        .query("file", "integer", false, "with offset: the file of a cursor from an earlier answer")
        .query("lines", "integer", false, "the last this many lines")
        .query("limit", "integer", false, "at most this many bytes (default 1 MiB, at most 8 MiB)")
        .query("wait", "string", false, "when there is nothing new, wait this long for it (30s)")
        .answers_raw("application/octet-stream")
        .header("X-Berth-Log-Alloc", "the alloc's full ID")
        .header("X-Berth-Log-Task", "the task read")
        .header("X-Berth-Log-File", "the cursor after the answer: its file")
        .header("X-Berth-Log-Offset", "the cursor after the answer: its offset in the file")
        .header("X-Berth-Log-Task-State", "the task's state: pending, running or dead")
        .header("X-Berth-Log-Lost", "present (true) when bytes before the cursor were rotated away unread"),
        op(
            "get",
            "/v1/client/allocations",
            "The allocs this agent's client runs, as it sees them (no server needed); a blocking query waits for a change of any of them",
        )
        .one(json!({ "type": "array", "items": schema_ref("ClientAllocation") })),
        op(
            "get",
            "/v1/client/allocation/{id}",
            "One alloc this agent's client runs (by ID), as it sees it; a blocking query waits for a change of the client's allocs",
        )
        .one(schema_ref("ClientAllocation")),
        op(
            "get",
            "/v1/client/allocation/{id}/stats",
            "What the alloc's running tasks use now (memory, CPU), each and summed, from their latest samples; tasks their driver does not measure (raw_exec) are absent",
        )
        .one(object(
            json!({
                "resource_usage": { "type": "object" },
                "tasks": { "type": "object", "additionalProperties": { "type": "object" } },
                "timestamp_ms": { "type": "integer" },
            }),
            &["resource_usage", "tasks", "timestamp_ms"],
        )),
        op(
            "post",
            "/v1/client/allocation/{id}/restart",
            "Restart a task of the alloc (or every running task) in place; not counted by the restart policy",
        )
        .optional_body(object(json!({ "task": { "type": "string" } }), &[]))
        .answers(tasks_answer(json!({}))),
        op(
            "post",
            "/v1/client/allocation/{id}/signal",
            "Send a signal to a task of the alloc (or every running task)",
        )
        .body(object(
            json!({
                "signal": { "type": "string", "description": "SIGHUP, HUP, 1, ..." },
                "task": { "type": "string" },
            }),
            &["signal"],
        ))
        .answers(tasks_answer(json!({ "signal": { "type": "string" } }))),
        // The server API.
        op("get", "/v1/agent/health", "Whether the server answers")
            .answers(object(json!({ "ok": { "type": "boolean" } }), &["ok"])),
        op(
            "get",
            "/v1/status/leader",
            "The leader's agent protocol address (HOST:PORT), empty while none is elected",
        )
        .answers(json!({ "type": "string" })),
        op(
            "get",
            "/v1/status/peers",
            "The agent protocol address (HOST:PORT) of every server that is there",
        )
        .answers(json!({ "type": "array", "items": { "type": "string" } })),
        op(
            "get",
            "/v1/operator/servers",
            "The servers: name, addresses, whether each leads, its last contact",
        )
        .answers(json!({ "type": "array", "items": object(json!({
            "name": { "type": "string" },
            "rpc_addr": { "type": "string" },
            "http_addr": { "type": "string" },
            "leader": { "type": "boolean" },
            "last_contact_ms": { "type": "integer" },
        }), &["name", "rpc_addr", "http_addr", "leader", "last_contact_ms"]) })),
        op(
            "get",
            "/v1/operator/store",
            "Where the state is kept and, on etcd, each member's health",
        )
        .answers(object(
            json!({
                "store": { "enum": ["embedded", "etcd"] },
                "prefix": { "type": ["string", "null"] },
                "members": { "type": "array", "items": object(json!({
                    "endpoint": { "type": "string" },
                    "healthy": { "type": "boolean" },
                    "version": { "type": "string" },
                    "is_leader": { "type": "boolean" },
                    "db_size_bytes": { "type": "integer" },
                    "raft_index": { "type": "integer" },
                    "errors": { "type": "array", "items": { "type": "string" } },
                }), &["endpoint", "healthy", "errors"]) },
            }),
            &["store", "members"],
        )),
        op("get", "/v1/allocations", "The allocs").list_of("Allocation"),
        op("get", "/v1/allocation/{id}", "An alloc (by ID or unique ID prefix)")
            .one(schema_ref("Allocation")),
        op(
            "post",
            "/v1/allocation/{id}/stop",
            "Stop an alloc through its client; the job's scheduler replaces it where the job still wants it",
        )
        .answers(object(
            json!({
                "index": { "type": "integer" },
                "alloc_id": { "type": "string" },
                "replacement": { "type": ["string", "null"] },
                "already_stopped": { "type": "boolean" },
            }),
            &["index", "alloc_id", "already_stopped"],
        )),
        op("get", "/v1/nodes", "The client nodes").list_of("Node"),
        op(
            "get",
            "/v1/node/{id}",
            "A node (by ID, unique ID prefix or name), with what its allocs use and the CSI volumes they claim",
        )
        .one(schema_ref("Node")),
        op("get", "/v1/node/{id}/allocations", "The allocs placed on a node").list_of("Allocation"),
        op("post", "/v1/node/{id}/drain", "Start, update or disable a node's drain")
            .body(object(
                json!({
                    "enable": { "type": "boolean" },
                    "deadline": { "type": "string", "description": "how long the drain waits for migrations (default 1h)" },
                    "force": { "type": "boolean", "description": "a deadline of now" },
                }),
                &["enable"],
            ))
            .answers(schema_ref("Node")),
        op("post", "/v1/node/{id}/eligibility", "Whether new allocs may be placed on a node")
            .body(object(json!({ "eligible": { "type": "boolean" } }), &["eligible"]))
            .answers(schema_ref("Node")),
        op("put", "/v1/node/{id}/purge", "Remove a node the operator says is gone; its allocs are lost")
            .body(object(
                json!({ "force": {
                    "type": "boolean",
                    "description": "the node's tasks are gone too: free its write claims (kept otherwise)",
                } }),
                &[],
            ))
            .answers(object(
                json!({
                    "node_id": { "type": "string" },
                    "node_name": { "type": "string" },
                    "lost_allocs": id_list.clone(),
                    "released": { "type": "array", "items": { "type": "object" } },
                    "kept": { "type": "array", "items": { "type": "object" } },
                }),
                &["node_id", "lost_allocs", "released"],
            )),
        op("get", "/v1/volumes", "The CSI volumes").list_of("CsiVolume"),
        op(
            "get",
            "/v1/volume/csi/{id}",
            "A CSI volume (by ID or unique ID prefix), its claims joined with their allocs",
        )
        .one(schema_ref("CsiVolume")),
        op("put", "/v1/volume/csi/{id}", "Register an existing volume")
            .body(volume_body.clone())
            .answers(schema_ref("CsiVolume")),
        op("delete", "/v1/volume/csi/{id}", "Deregister a volume")
            .query("force", "boolean", false, "deregister although the volume is claimed"),
        op("put", "/v1/volume/csi/{id}/create", "Create a volume through its controller plugin and register it")
            .body(volume_body)
            .answers(schema_ref("CsiVolume")),
        op("delete", "/v1/volume/csi/{id}/delete", "Delete a volume through its controller plugin and deregister it"),
        op("delete", "/v1/volume/csi/{id}/detach", "Detach a volume from a node, freeing the node's claims")
            .query("node", "string", true, "the node (ID, prefix or name)"),
        op("get", "/v1/volumes/snapshot", "The snapshots a controller plugin lists")
            .query("plugin_id", "string", false, "the plugin to ask (default: every plugin that lists snapshots)")
            .answers(json!({ "type": "array", "items": schema_ref("CsiSnapshot") })),
        op("put", "/v1/volumes/snapshot", "Snapshot a volume")
            .body(object(
                json!({
                    "volume_id": { "type": "string" },
                    "name": { "type": "string" },
                    "parameters": { "type": "object", "additionalProperties": { "type": "string" } },
                    "secrets": {
                        "type": "object",
                        "additionalProperties": { "type": "string" },
                        "description": "default: the volume's; never answered",
                    },
                }),
                &["volume_id"],
            ))
            .answers(schema_ref("CsiSnapshot")),
        op("delete", "/v1/volumes/snapshot", "Delete a snapshot")
            .query("plugin_id", "string", true, "the plugin that holds the snapshot")
            .query("snapshot_id", "string", true, "the snapshot"),
        op("get", "/v1/plugins", "The CSI plugins, derived from node fingerprints and plugin allocs")
            .list_of("CsiPlugin"),
        op(
            "get",
            "/v1/plugin/csi/{id}",
            "A CSI plugin (by ID or unique ID prefix) with its instances, capabilities and allocs",
        )
        .one(schema_ref("CsiPlugin")),
        op("put", "/v1/system/gc", "Garbage-collect everything that is done, now").answers(object(
            json!({
                "allocs": id_list.clone(),
                "jobs": id_list.clone(),
                "nodes": id_list.clone(),
                "acl_tokens": id_list
            }),
            &["allocs", "jobs", "nodes", "acl_tokens"],
        )),
        op(
            "put",
            "/v1/node/intro",
            "Make an introduction token new nodes register with (its secret is shown once)",
        )
        .body(object(
            json!({ "ttl": { "type": "string" }, "uses": { "type": "integer" } }),
            &[],
        ))
        .answers(schema_ref("NewIntroToken")),
        op("get", "/v1/node/intros", "The introduction tokens, never their secrets")
            .list_of("IntroToken"),
        op(
            "delete",
            "/v1/node/intro/{accessor}",
            "Revoke an introduction token (by accessor or unique prefix): it enrolls no node from then on",
        )
        .answers(schema_ref("IntroToken")),
        op(
            "post",
            "/v1/acl/bootstrap",
            "Make the first management token (once; its secret is shown once)",
        )
        .answers(schema_ref("NewAclToken")),
        op("get", "/v1/acl/policies", "The ACL policies, without their rules")
            .answers(json!({ "type": "array", "items": { "type": "object" } })),
        op("get", "/v1/acl/policy/{name}", "An ACL policy with its rules")
            .answers(schema_ref("AclPolicy")),
        op("put", "/v1/acl/policy/{name}", "Make or replace an ACL policy from its HCL rules")
            .body(object(
                json!({ "description": { "type": "string" }, "rules": { "type": "string" } }),
                &["rules"],
            ))
            .answers(schema_ref("AclPolicy")),
        op("delete", "/v1/acl/policy/{name}", "Delete an ACL policy"),
        op("get", "/v1/acl/tokens", "The ACL tokens, by accessor ID (no secrets)")
            .answers(json!({ "type": "array", "items": schema_ref("AclToken") })),
        op("put", "/v1/acl/token", "Make an ACL token (its secret is shown once)")
            .body(object(
                json!({
                    "name": { "type": "string" },
                    "type": { "type": "string", "enum": ["client", "management"] },
                    "policies": { "type": "array", "items": { "type": "string" } },
                    "ttl": { "type": "string" },
                }),
                &[],
            ))
            .answers(schema_ref("NewAclToken")),
        op(
            "get",
            "/v1/acl/token/self",
            "The token the request carries, its policies and what it may do",
        )
        .answers(schema_ref("AclToken")),
        op("get", "/v1/acl/token/{accessor}", "An ACL token by accessor ID or unique prefix")
            .answers(schema_ref("AclToken")),
        op("delete", "/v1/acl/token/{accessor}", "Delete an ACL token"),
        op(
            "put",
            "/v1/operator/keyring/rotate",
            "Make a new root keyring key, seal every stored secret again with it and retire the old keys",
        )
        .answers(object(
            json!({
                "key_id": { "type": "string" },
                "retired": { "type": "array", "items": { "type": "string" } },
                "volumes": { "type": "integer" },
                "node_secrets": { "type": "integer" },
            }),
            &["key_id", "retired", "volumes", "node_secrets"],
        )),
    ];
    ops.extend(super::openapi_jobs::job_operations());
    ops.extend(super::openapi_jobs::deployment_operations());
    ops
}

/// The `{name}`s of a path, in order.
fn path_params(path: &str) -> Vec<&str> {
    path.split('/')
        .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .collect()
}

fn param_ref(name: &str) -> Value {
    json!({ "$ref": format!("#/components/parameters/{name}") })
}

fn operation(o: &Op) -> Value {
    let mut params: Vec<Value> = path_params(o.path)
        .into_iter()
        .map(|name| {
            json!({
                "name": name, "in": "path", "required": true,
                "schema": { "type": "string" },
            })
        })
        .collect();
    if o.read != Read::Plain {
        params.extend([param_ref("index"), param_ref("wait")]);
    }
    if o.read == Read::List {
        params.extend([
            param_ref("per_page"),
            param_ref("next_token"),
            param_ref("prefix"),
        ]);
    }
    for (name, kind, required, description) in &o.query {
        params.push(json!({
            "name": name, "in": "query", "required": required,
            "description": description, "schema": { "type": kind },
        }));
    }
    let mut headers = Map::new();
    if o.read != Read::Plain {
        headers.insert(
            "X-Berth-Index".into(),
            json!({ "$ref": "#/components/headers/X-Berth-Index" }),
        );
    }
    if o.read == Read::List {
        headers.insert(
            "X-Berth-NextToken".into(),
            json!({ "$ref": "#/components/headers/X-Berth-NextToken" }),
        );
    }
    for (name, description) in &o.headers {
        headers.insert(
            (*name).into(),
            json!({ "description": description, "schema": { "type": "string" } }),
        );
    }
    let mut ok = json!({
        "description": "OK",
        "content": { o.media: { "schema": o.answer } },
    });
    if !headers.is_empty() {
        ok["headers"] = Value::Object(headers);
    }
    let mut out = json!({
        "operationId": operation_id(o),
        "summary": o.summary,
        "parameters": params,
        "responses": {
            "200": ok,
            "4XX": { "$ref": "#/components/responses/Error" },
            "5XX": { "$ref": "#/components/responses/Error" },
        },
    });
    if let Some(body) = &o.body {
        out["requestBody"] = json!({
            "required": !o.body_optional,
            "content": { "application/json": { "schema": body } },
        });
    }
    out
}

/// `get /v1/job/{id}/allocations` → `get_job_id_allocations`.
fn operation_id(o: &Op) -> String {
    let mut id = o.method.to_string();
    for part in o
        .path
        .trim_start_matches("/v1/")
        .split(|c: char| !c.is_ascii_alphanumeric())
    {
        if !part.is_empty() {
            id.push('_');
            id.push_str(part);
        }
    }
    id
}

fn components() -> Value {
    let string_map = json!({ "type": "object", "additionalProperties": { "type": "string" } });
    let constraints = json!({ "type": "array", "items": schema_ref("Constraint") });
    let affinities = json!({ "type": "array", "items": schema_ref("Affinity") });
    let spreads = json!({ "type": "array", "items": schema_ref("Spread") });
    let node_volume = object(
        json!({
            "volume_id": { "type": "string" }, "plugin_id": { "type": "string" },
            "alloc_id": { "type": "string" }, "mode": { "enum": ["read", "write"] },
            "state": { "type": "string" },
        }),
        &["volume_id", "alloc_id", "mode"],
    );
    json!({
        "schemas": {
            "Error": object(json!({ "error": { "type": "string", "minLength": 1 } }), &["error"]),
            "Job": object(json!({
                "id": { "type": "string" },
                "name": { "type": "string" },
                "type": { "enum": ["service", "batch", "system"] },
                "datacenters": { "type": "array", "items": { "type": "string" } },
                "constraints": constraints,
                "affinities": affinities,
                "spreads": spreads,
                "priority": { "type": "integer" },
                "task_groups": { "type": "array", "items": object(json!({
                    "name": { "type": "string" },
                    "count": { "type": "integer", "minimum": 0 },
                    "volumes": { "type": "object", "additionalProperties": { "type": "object" } },
                    "tasks": { "type": "array", "items": object(json!({
                        "name": { "type": "string" },
                        "driver": { "type": "string" },
                        "config": { "type": "object" },
                        "constraints": constraints,
                        "affinities": affinities,
                    }), &["name", "driver"]) },
                    "constraints": constraints,
                    "affinities": affinities,
                    "spreads": spreads,
                    "stop_after_client_disconnect": {
                        "type": ["string", "null"],
                        "description": "the old name of disconnect.stop_on_client_after",
                    },
                    "max_client_disconnect": {
                        "type": ["string", "null"],
                        "description": "the old name of disconnect.lost_after",
                    },
                    "disconnect": {
                        "type": ["object", "null"],
                        "properties": {
                            "lost_after": { "type": ["string", "null"] },
                            "replace": { "type": "boolean" },
                            "reconcile": { "enum": ["best_score", "keep_original", "keep_replacement", "longest_running"] },
                            "stop_on_client_after": { "type": ["string", "null"] },
                        },
                    },
                }), &["name", "count", "tasks"]) },
                "meta": string_map,
                "stop": { "type": "boolean" },
                "status": { "enum": ["pending", "running", "failed", "dead"] },
                "version": { "type": "integer" },
                "create_index": { "type": "integer" },
                "modify_index": { "type": "integer" },
                "job_modify_index": { "type": "integer" },
                "placement_failures": {
                    "type": "array", "items": { "type": "string" },
                    "description": "answers only: why allocs could not be placed",
                },
                "summary": {
                    "type": "object",
                    "additionalProperties": object(json!({
                        "queued": { "type": "integer" }, "starting": { "type": "integer" },
                        "running": { "type": "integer" }, "failed": { "type": "integer" },
                        "complete": { "type": "integer" }, "lost": { "type": "integer" },
                        "unknown": { "type": "integer" },
                    }), &["running"]),
                    "description": "answers of GET /v1/jobs only: each group's allocs by state (queued: see the job's summary)",
                },
            }), &["id", "name", "type", "task_groups"]),
            "Constraint": object(json!({
                "attribute": { "type": "string", "description": "a literal, ${node.unique.id}, ${node.unique.name}, ${node.datacenter}, ${node.class}, ${attr.NAME} or ${meta.NAME}" },
                "operator": { "enum": ["=", "!=", ">", ">=", "<", "<=", "regexp", "set_contains", "set_contains_any", "is_set", "is_not_set", "version", "semver", "distinct_hosts", "distinct_property"] },
                "value": { "type": "string" },
            }), &[]),
            "Affinity": object(json!({
                "attribute": { "type": "string" },
                "operator": { "type": "string", "description": "a constraint's operator but distinct_hosts and distinct_property" },
                "value": { "type": "string" },
                "weight": { "type": "integer", "minimum": -100, "maximum": 100 },
            }), &[]),
            "Spread": object(json!({
                "attribute": { "type": "string" },
                "weight": { "type": "integer", "minimum": 1, "maximum": 100 },
                "targets": { "type": "array", "items": object(json!({
                    "value": { "type": "string" },
                    "percent": { "type": "integer", "minimum": 0, "maximum": 100 },
                }), &["value", "percent"]) },
            }), &["attribute"]),
            "Allocation": object(json!({
                "id": { "type": "string" },
                "name": { "type": "string" },
                "job_id": { "type": "string" },
                "job": schema_ref("Job"),
                "task_group": { "type": "string" },
                "node_id": { "type": "string" },
                "desired_status": { "enum": ["run", "stop", "evict"] },
                "desired_description": { "type": "string" },
                "client_status": { "enum": ["pending", "running", "complete", "failed", "lost", "unknown"] },
                "client_description": { "type": "string" },
                "disconnected": {
                    "type": ["object", "null"],
                    "description": "while unknown: since_ms, lost_at_ms, previous_status, previous_description",
                },
                "task_states": { "type": "object", "additionalProperties": { "type": "object" } },
                "csi_volume_stats": { "type": "object", "additionalProperties": { "type": "object" } },
                "deployment": { "type": "object", "description": "the deployment that placed it: id, canary, healthy, health_at_ms" },
                "create_index": { "type": "integer" },
                "modify_index": { "type": "integer" },
                "create_time_ms": { "type": "integer" },
                "modify_time_ms": { "type": "integer" },
            }), &["id", "name", "job_id", "task_group", "node_id", "desired_status", "client_status"]),
            "ClientAllocation": object(json!({
                "id": { "type": "string" },
                "task_states": { "type": "object", "additionalProperties": { "type": "object" } },
            }), &["id"]),
            "Node": object(json!({
                "id": { "type": "string" },
                "name": { "type": "string" },
                "datacenter": { "type": "string" },
                "node_class": { "type": "string" },
                "status": { "enum": ["initializing", "ready", "down"] },
                "scheduling_eligibility": { "enum": ["eligible", "ineligible"] },
                "drain": { "type": "boolean" },
                "drain_strategy": { "type": ["object", "null"] },
                "resources": { "type": "object" },
                "reserved": { "type": "object" },
                "drivers": { "type": "array", "items": { "type": "string" } },
                "driver_info": { "type": "object", "additionalProperties": { "type": "object" } },
                "attributes": string_map,
                "meta": string_map,
                "csi_node_plugins": { "type": "object", "additionalProperties": { "type": "object" } },
                "csi_controller_plugins": { "type": "object", "additionalProperties": { "type": "object" } },
                "events": { "type": "array", "items": { "type": "object" } },
                "last_heartbeat_ms": { "type": "integer" },
                "create_index": { "type": "integer" },
                "modify_index": { "type": "integer" },
                "total_resources": { "type": "object", "description": "one node's answer only" },
                "allocated_resources": { "type": "object", "description": "one node's answer only" },
                "csi_volumes": { "type": "array", "items": node_volume, "description": "one node's answer only: the CSI volumes its allocs claim" },
                "allocs_running": { "type": "integer", "description": "the list's answer only: allocs its client reports running" },
            }), &["id", "name", "status"]),
            "CsiVolume": object(json!({
                "id": { "type": "string" },
                "name": { "type": "string" },
                "external_id": { "type": "string" },
                "plugin_id": { "type": "string" },
                "provider": { "type": "string" },
                "capabilities": { "type": "array", "items": object(json!({
                    "access_mode": { "type": "string" },
                    "attachment_mode": { "enum": ["file-system", "block-device"] },
                }), &["access_mode", "attachment_mode"]) },
                "capacity_min": { "type": ["integer", "null"] },
                "capacity_max": { "type": ["integer", "null"] },
                "capacity": { "type": "integer" },
                "mount_options": { "type": "object" },
                "secrets": {
                    "type": "object", "additionalProperties": { "type": "string" },
                    "description": "requests only: never answered",
                },
                "parameters": string_map,
                "context": string_map,
                "read_claims": { "type": "object", "additionalProperties": { "type": "object" } },
                "write_claims": { "type": "object", "additionalProperties": { "type": "object" } },
                "read_allocs": { "type": "array", "items": { "type": "string" } },
                "write_allocs": { "type": "array", "items": { "type": "string" } },
                "claim_allocs": { "type": "array", "items": { "type": "object" }, "description": "one volume's answer only" },
                "plugin": { "type": ["object", "null"], "description": "its plugin's health" },
                "schedulable": { "type": "boolean" },
                "create_index": { "type": "integer" },
                "modify_index": { "type": "integer" },
            }), &["id", "plugin_id"]),
            "AclToken": object(json!({
                "accessor_id": { "type": "string" },
                "name": { "type": "string" },
                "type": { "type": "string", "enum": ["client", "management"] },
                "policies": { "type": "array", "items": { "type": "string" } },
                "create_time_ms": { "type": "integer" },
                "expiration_time_ms": { "type": ["integer", "null"] },
            }), &["accessor_id", "type"]),
            "NewAclToken": object(json!({
                "accessor_id": { "type": "string" },
                "secret_id": { "type": "string", "description": "Shown this once; berth keeps only its hash" },
                "type": { "type": "string" },
                "policies": { "type": "array", "items": { "type": "string" } },
            }), &["accessor_id", "secret_id"]),
            "NewIntroToken": object(json!({
                "accessor_id": { "type": "string" },
                "secret_id": { "type": "string", "description": "Shown this once: set it as client { intro_token }" },
                "uses_left": { "type": "integer" },
                "expiration_time_ms": { "type": "integer" },
            }), &["accessor_id", "secret_id"]),
            "IntroToken": object(json!({
                "accessor_id": { "type": "string" },
                "uses_left": { "type": "integer", "description": "Registrations it still allows" },
                "create_time_ms": { "type": "integer" },
                "expiration_time_ms": { "type": "integer" },
            }), &["accessor_id", "uses_left"]),
            "AclPolicy": object(json!({
                "name": { "type": "string" },
                "description": { "type": "string" },
                "rules": { "type": "string" },
            }), &["name", "rules"]),
            "CsiPlugin": object(json!({
                "id": { "type": "string" },
                "provider": { "type": "string" },
                "version": { "type": "string" },
                "controller_required": {
                    "type": "boolean",
                    "description": "a controller must publish a volume to a node before the node mounts it (PUBLISH_UNPUBLISH_VOLUME), as in Nomad",
                },
                "controllers_healthy": { "type": "integer" },
                "controllers_expected": { "type": "integer" },
                "nodes_healthy": { "type": "integer" },
                "nodes_expected": { "type": "integer" },
                "controllers": { "type": "object", "additionalProperties": { "type": "object" } },
                "nodes": { "type": "object", "additionalProperties": { "type": "object" } },
                "create_index": { "type": "integer" },
                "modify_index": { "type": "integer" },
            }), &["id", "provider", "version", "controller_required", "nodes_healthy", "nodes_expected"]),
            "CsiSnapshot": object(json!({
                "id": { "type": "string" },
                "name": { "type": "string" },
                "plugin_id": { "type": "string" },
                "source_volume_id": { "type": "string" },
            }), &["id", "plugin_id"]),
        },
        "parameters": {
            "index": {
                "name": "index", "in": "query", "required": false,
                "description": "a blocking query: answer once the data changed past this index (an X-Berth-Index of an earlier answer), or after wait",
                "schema": { "type": "integer", "minimum": 0 },
            },
            "wait": {
                "name": "wait", "in": "query", "required": false,
                "description": "how long a blocking query waits at most, such as 10s or 2m (default and cap: 5m)",
                "schema": { "type": "string" },
            },
            "per_page": {
                "name": "per_page", "in": "query", "required": false,
                "description": "the most items on a page",
                "schema": { "type": "integer", "minimum": 1 },
            },
            "next_token": {
                "name": "next_token", "in": "query", "required": false,
                "description": "the ID the page starts at: the X-Berth-NextToken of the page before",
                "schema": { "type": "string" },
            },
            "prefix": {
                "name": "prefix", "in": "query", "required": false,
                "description": "only the items whose ID starts with it",
                "schema": { "type": "string" },
            },
        },
        "headers": {
            "X-Berth-Index": {
                "description": "the index the answer reflects: the last write to the tables it is read from",
                "schema": { "type": "integer" },
            },
            "X-Berth-NextToken": {
                "description": "present when more items remain: the next_token of the next page",
                "schema": { "type": "string" },
            },
        },
        "responses": {
            "Error": {
                "description": "the request failed; the message names the problem",
                "content": { "application/json": { "schema": schema_ref("Error") } },
            },
        },
    })
}

/// The whole document.
pub fn document() -> Value {
    let mut paths = Map::new();
    let routes = super::routes::all_routes();
    for o in operations() {
        let item = paths
            .entry(o.path)
            .or_insert_with(|| Value::Object(Map::new()));
        item[o.method] = operation(&o);
        let need = routes
            .iter()
            .find(|r| r.path == o.path && r.method.as_str().eq_ignore_ascii_case(o.method))
            .map(|r| r.need.to_string());
        if let Some(need) = need {
            item[o.method]["x-berth-acl"] = Value::String(need);
        }
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "berth HTTP API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The JSON API of a berth agent. Every agent serves it: the agent's own routes itself, the rest through its server role or forwarded to a server. Errors are {\"error\": \"<message>\"}.",
        },
        "paths": paths,
        "components": components(),
    })
}

/// `GET /v1/openapi.json`.
pub async fn openapi_json() -> Json<Value> {
    static DOCUMENT: OnceLock<Value> = OnceLock::new();
    Json(DOCUMENT.get_or_init(document).clone())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::http::routes::all_routes;

    fn described(doc: &Value) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("path item").keys() {
                out.insert((method.to_ascii_uppercase(), path.clone()));
            }
        }
        out
    }

    #[test]
    fn the_document_describes_exactly_the_routes_the_agents_serve() {
        let doc = document();
        let documented = described(&doc);
        let served: BTreeSet<(String, String)> = all_routes()
            .into_iter()
            .map(|r| (r.method.to_string(), r.path.to_string()))
            .collect();
        let undescribed: Vec<String> = served
            .difference(&documented)
            .map(|(m, p)| format!("{m} {p}"))
            .collect();
        let gone: Vec<String> = documented
            .difference(&served)
            .map(|(m, p)| format!("{m} {p}"))
            .collect();
        assert!(
            undescribed.is_empty(),
            "routes served but not described in agent/src/http/openapi.rs: {undescribed:?}"
        );
        assert!(
            gone.is_empty(),
            "routes described in agent/src/http/openapi.rs that no agent serves: {gone:?}"
        );
    }

    #[test]
    fn the_document_is_openapi_3_1_json_whose_path_params_match_the_paths() {
        let text = serde_json::to_string(&document()).expect("encode");
        let doc: Value = serde_json::from_str(&text).expect("valid JSON");
        assert_eq!(doc["openapi"], "3.1.0");
        assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
        let mut operation_ids = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            let expected: Vec<&str> = path_params(path);
            for (method, op) in item.as_object().expect("path item") {
                let params = op["parameters"].as_array().expect("parameters");
                let in_path: Vec<&str> = params
                    .iter()
                    .filter(|p| p["in"] == "path")
                    .map(|p| p["name"].as_str().expect("name"))
                    .collect();
                assert_eq!(in_path, expected, "{method} {path}: path parameters");
                assert!(
                    params
                        .iter()
                        .filter(|p| p["in"] == "path")
                        .all(|p| p["required"] == true),
                    "{method} {path}: path parameters are required"
                );
                assert!(
                    op["summary"].as_str().is_some_and(|s| !s.is_empty()),
                    "{method} {path}: a summary"
                );
                assert!(op["responses"]["200"].is_object(), "{method} {path}: 200");
                assert_eq!(
                    op["responses"]["4XX"]["$ref"], "#/components/responses/Error",
                    "{method} {path}: the error shape"
                );
                assert!(
                    operation_ids
                        .insert(op["operationId"].as_str().expect("operationId").to_string()),
                    "{method} {path}: a unique operationId"
                );
            }
        }
        for name in [
            "Job",
            "Allocation",
            "Node",
            "CsiVolume",
            "CsiPlugin",
            "Error",
        ] {
            let schema = &doc["components"]["schemas"][name];
            assert!(
                schema["required"].as_array().is_some_and(|r| !r.is_empty()),
                "{name}: required fields named"
            );
        }
    }

    /// Every `$ref` points at something the document defines.
    #[test]
    fn every_reference_resolves() {
        fn walk(doc: &Value, v: &Value, bad: &mut Vec<String>) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        let pointer = r.trim_start_matches('#');
                        if doc.pointer(pointer).is_none() {
                            bad.push(r.clone());
                        }
                    }
                    o.values().for_each(|x| walk(doc, x, bad));
                }
                Value::Array(a) => a.iter().for_each(|x| walk(doc, x, bad)),
                _ => {}
            }
        }
        let doc = document();
        let mut bad = Vec::new();
        walk(&doc, &doc, &mut bad);
        assert!(bad.is_empty(), "unresolved references: {bad:?}");
    }

    /// Reads say how they block and page: every list takes the page
    /// parameters and answers `X-Berth-NextToken`; every blocking read
    /// answers `X-Berth-Index`.
    #[test]
    fn lists_and_blocking_reads_carry_their_parameters_and_headers() {
        let doc = document();
        let get_of = |path: &str| doc["paths"][path]["get"].clone();
        for path in [
            "/v1/jobs",
            "/v1/allocations",
            "/v1/nodes",
            "/v1/volumes",
            "/v1/plugins",
        ] {
            let op = get_of(path);
            let refs: Vec<&str> = op["parameters"]
                .as_array()
                .expect("parameters")
                .iter()
                .filter_map(|p| p["$ref"].as_str())
                .collect();
            for p in ["index", "wait", "per_page", "next_token", "prefix"] {
                assert!(
                    refs.contains(&format!("#/components/parameters/{p}").as_str()),
                    "{path} takes {p}"
                );
            }
            assert!(
                op["responses"]["200"]["headers"]["X-Berth-NextToken"].is_object(),
                "{path}"
            );
        }
        for path in [
            "/v1/job/{id}",
            "/v1/node/{id}",
            "/v1/volume/csi/{id}",
            "/v1/plugin/csi/{id}",
            "/v1/client/allocations",
            "/v1/client/allocation/{id}",
        ] {
            assert!(
                get_of(path)["responses"]["200"]["headers"]["X-Berth-Index"].is_object(),
                "{path}"
            );
        }
    }

    /// Where an internal reference (`#/components/...`) points, if there.
    fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
        let path = reference.strip_prefix("#/")?;
        path.split('/').try_fold(doc, |v, part| v.get(part))
    }

    /// What a client generator needs of every schema, collected under
    /// `at`: an array says what it holds, a reference resolves.
    fn incomplete(doc: &Value, v: &Value, at: &str, problems: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                if let Some(r) = o.get("$ref").and_then(Value::as_str) {
                    if resolve(doc, r).is_none() {
                        problems.push(format!("{at}: $ref {r} resolves to nothing"));
                    }
                }
                let array = match o.get("type") {
                    Some(Value::String(t)) => t == "array",
                    Some(Value::Array(ts)) => ts.iter().any(|t| t == "array"),
                    _ => false,
                };
                if array && !o.contains_key("items") {
                    problems.push(format!("{at}: an array without items"));
                }
                for (k, x) in o {
                    incomplete(doc, x, &format!("{at}/{k}"), problems);
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    incomplete(doc, x, &format!("{at}/{i}"), problems);
                }
            }
            _ => {}
        }
    }

    /// A generated client has a typed model for every answer only if every
    /// schema is complete: no array without its items (a generator drops
    /// the model that holds one, and every answer that uses it), no
    /// reference to nothing.
    #[test]
    fn every_schema_is_complete_enough_for_a_client_generator() {
        let doc = document();
        let mut problems = Vec::new();
        incomplete(&doc, &doc, "#", &mut problems);
        assert!(problems.is_empty(), "{problems:#?}");
    }
}
