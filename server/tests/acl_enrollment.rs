//! ACL tokens and node enrollment on a real server over real gRPC: a
//! token is found by its secret only, bootstrap happens once, policies
//! grant what they say; a node the servers do not know registers only
//! with an introduction token (spent per use), a purged node's ID stays
//! its own, and a node that runs no plugin alloc is no plugin instance.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod support;

use berth_proto::berth::v1 as pb;
use berth_server::TokenRequest;
use berth_structs::acl::{Capability, Level, Need, TokenType};
use berth_structs::CsiInfo;
use support::{node, TestServer};

fn register_request(n: &berth_structs::Node) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node_json: serde_json::to_vec(n).unwrap(),
        node_id: n.id.clone(),
    }
}

/// Registers `n` presenting `secret` and, when given, an introduction
/// token.
async fn register(
    ts: &TestServer,
    secret: &str,
    intro: Option<&str>,
    n: &berth_structs::Node,
) -> Result<(), tonic::Status> {
    let mut req = tonic::Request::new(register_request(n));
    if let Some(t) = intro {
        req.metadata_mut()
            .insert(pb::INTRO_TOKEN_METADATA, t.parse().unwrap());
    }
    ts.node_client_with(Some(secret))
        .await
        .register(req)
        .await
        .map(|_| ())
}

const A: &str = "node-secret-a-0123456789abcdef0123";
const B: &str = "node-secret-b-0123456789abcdef0123";

#[tokio::test]
async fn bootstrap_happens_once_and_tokens_are_found_by_their_secret_only() {
    let ts = TestServer::start(|c| c.acl_enabled = true).await;
    let s = ts.server.clone();
    let boot = s.acl_bootstrap().await.expect("bootstrap");
    assert!(
        s.acl_bootstrap().await.is_err(),
        "a second bootstrap is refused"
    );
    let mgmt = s.resolve_token(Some(&boot.secret_id)).unwrap();
    assert!(mgmt.allows(Need::Management));
    assert!(s.resolve_token(Some("not-a-token")).is_err());
    assert!(!s
        .resolve_token(None)
        .unwrap()
        .allows(Need::Node(Level::Read)));

    s.upsert_acl_policy(
        "readonly",
        "",
        "namespace \"default\" { policy = \"read\" }\nnode { policy = \"read\" }",
    )
    .await
    .expect("policy");
    let ro = s
        .create_acl_token(TokenRequest {
            name: "ro".into(),
            token_type: TokenType::Client,
            policies: vec!["readonly".into()],
            ttl: None,
        })
        .await
        .expect("token");
    let acl = s.resolve_token(Some(&ro.secret_id)).unwrap();
    assert!(acl.allows(Need::Namespace(Capability::ReadJob)));
    assert!(acl.allows(Need::Node(Level::Read)));
    assert!(!acl.allows(Need::Namespace(Capability::SubmitJob)));
    assert!(!acl.allows(Need::Node(Level::Write)));

    // What the servers keep and answer never holds a secret.
    for t in s.acl_tokens() {
        assert!(t.secret_hash.is_empty(), "{t:?}");
    }
    let raw = std::fs::read(ts.dir.path().join("server/state.redb")).unwrap();
    for secret in [&boot.secret_id, &ro.secret_id] {
        assert!(
            !raw.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "a token secret is in the state database"
        );
    }

    // Deleting the policy takes its grants from the token at once.
    s.delete_acl_policy("readonly").await.unwrap();
    let acl = s.resolve_token(Some(&ro.secret_id)).unwrap();
    assert!(!acl.allows(Need::Namespace(Capability::ReadJob)));
    // A deleted token no longer resolves.
    s.delete_acl_token(&ro.token.accessor_id).await.unwrap();
    assert!(s.resolve_token(Some(&ro.secret_id)).is_err());
}

#[tokio::test]
async fn an_expired_token_is_refused() {
    let ts = TestServer::start(|c| c.acl_enabled = true).await;
    let s = ts.server.clone();
    let t = s
        .create_acl_token(TokenRequest {
            token_type: TokenType::Management,
            ttl: Some("200ms".into()),
            ..TokenRequest::default()
        })
        .await
        .unwrap();
    assert!(s.resolve_token(Some(&t.secret_id)).is_ok());
    support::wait_until(
        "the token to expire",
        std::time::Duration::from_secs(5),
        || s.resolve_token(Some(&t.secret_id)).is_err(),
    )
    .await;
    let e = s.resolve_token(Some(&t.secret_id)).unwrap_err();
    assert!(e.to_string().contains("expired"), "{e}");
}

#[tokio::test]
async fn a_new_node_needs_an_introduction_token_and_each_use_is_spent() {
    let ts = TestServer::start(|c| c.node_enrollment = true).await;
    let s = ts.server.clone();
    let err = register(&ts, A, None, &node("n1")).await.unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::PermissionDenied,
        "{}",
        err.message()
    );
    assert!(
        err.message().contains("introduction token"),
        "{}",
        err.message()
    );
    assert!(s.nodes().is_empty());

    let intro = s.create_intro_token(Some("1h"), Some(1)).await.unwrap();
    register(&ts, A, Some(&intro.secret_id), &node("n1"))
        .await
        .expect("registers with the token");
    // Its own secret lets it register again without a token.
    register(&ts, A, None, &node("n1"))
        .await
        .expect("re-register");
    // The token was for one node.
    let err = register(&ts, B, Some(&intro.secret_id), &node("n2"))
        .await
        .unwrap_err();
    assert!(
        err.message().contains("spent or expired"),
        "{}",
        err.message()
    );
    let err = register(&ts, B, Some("made-up-token"), &node("n2"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    assert_eq!(s.nodes().len(), 1);
}

#[tokio::test]
async fn a_purged_node_id_stays_with_its_old_secret() {
    let ts = TestServer::start(|c| c.node_enrollment = true).await;
    let s = ts.server.clone();
    let intro = s.create_intro_token(None, Some(5)).await.unwrap();
    register(&ts, A, Some(&intro.secret_id), &node("n1"))
        .await
        .unwrap();
    s.purge_node("n1", true).await.expect("purge");
    // A stranger with another secret does not get the ID...
    let err = register(&ts, B, None, &node("n1")).await.unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::PermissionDenied,
        "{}",
        err.message()
    );
    assert!(s.nodes().is_empty());
    // ...the node that had it does.
    register(&ts, A, None, &node("n1"))
        .await
        .expect("old secret");
    assert_eq!(s.nodes().len(), 1);
}

#[tokio::test]
async fn a_register_too_large_is_refused_before_it_is_decoded() {
    let ts = TestServer::start(|c| c.node_enrollment = true).await;
    let mut req = register_request(&node("n1"));
    // Two MiB of bytes that are not JSON: decoding would fail on them
    // anyway, so the answer shows which check came first.
    req.node_json = vec![b'x'; 2 * 1024 * 1024];
    let err = ts
        .node_client_with(Some(A))
        .await
        .register(req)
        .await
        .unwrap_err();
    // Refused by the method's message limit as its header arrives.
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().contains("over the method's limit"),
        "{}",
        err.message()
    );
    // Within the message limit but over the node JSON's: refused before
    // it is decoded.
    let mut req = register_request(&node("n1"));
    req.node_json = vec![b'x'; berth_proto::berth::v1::MAX_REGISTER_NODE_JSON + 1];
    let err = ts
        .node_client_with(Some(A))
        .await
        .register(req)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("the limit is"), "{}", err.message());

    // An unknown node without a token is refused before its node is
    // decoded: the garbage after the ID is never looked at.
    let mut req = register_request(&node("n1"));
    req.node_json = b"not json at all".to_vec();
    let err = ts
        .node_client_with(Some(A))
        .await
        .register(req)
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::PermissionDenied,
        "{}",
        err.message()
    );
}

#[tokio::test]
async fn a_node_without_a_plugin_alloc_is_no_plugin_instance() {
    let ts = TestServer::start(|c| c.node_enrollment = true).await;
    let s = ts.server.clone();
    let intro = s.create_intro_token(None, Some(1)).await.unwrap();
    register(&ts, A, Some(&intro.secret_id), &node("n1"))
        .await
        .unwrap();
    let info = CsiInfo {
        plugin_id: "hostpath".into(),
        healthy: true,
        requires_controller_publish: true,
        ..CsiInfo::default()
    };
    s.update_node_plugins(
        "n1",
        [("hostpath".to_string(), info.clone())].into(),
        [("hostpath".to_string(), info)].into(),
    )
    .await
    .unwrap();
    let plugins = s.plugins();
    let p = plugins.iter().find(|p| p.id == "hostpath");
    assert!(
        p.is_none_or(|p| p.controllers.is_empty() && p.nodes.is_empty()),
        "{p:?}"
    );
}

/// A token past its expiry is refused, and the garbage collector removes
/// it (and says so); a token without a TTL stays.
#[tokio::test]
async fn expired_tokens_are_garbage_collected() {
    let ts = TestServer::start(|c| c.acl_enabled = true).await;
    let s = ts.server.clone();
    s.acl_bootstrap().await.expect("bootstrap");
    let token = |name: &str, ttl: Option<&str>| TokenRequest {
        name: name.into(),
        token_type: TokenType::Management,
        policies: vec![],
        ttl: ttl.map(str::to_string),
    };
    let short = s
        .create_acl_token(token("short", Some("200ms")))
        .await
        .expect("a short-lived token");
    let lasting = s
        .create_acl_token(token("lasting", None))
        .await
        .expect("a token without a TTL");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while s.resolve_token(Some(&short.secret_id)).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "the token never expired"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let report = s.garbage_collect(false).await.expect("gc");
    assert_eq!(report.acl_tokens, vec![short.token.accessor_id.clone()]);
    let left: Vec<String> = s.acl_tokens().into_iter().map(|t| t.accessor_id).collect();
    assert!(!left.contains(&short.token.accessor_id), "{left:?}");
    assert!(left.contains(&lasting.token.accessor_id), "{left:?}");
    assert!(s.resolve_token(Some(&lasting.secret_id)).is_ok());
}
