//! ACL policies in HCL, in Nomad's shape:
//!
//! ```hcl
//! namespace "default" {
//!   policy       = "read"
//!   capabilities = ["submit-job", "read-logs"]
//! }
//! node     { policy = "read" }
//! agent    { policy = "read" }
//! operator { policy = "deny" }
//! plugin   { policy = "read" }
//! ```

use crate::acl::{Capability, Level, NamespaceRule, PolicyRules};

use super::hcl::{BodyReader, Source};
use super::SpecError;

/// Reads a policy's rules; an unknown block, level or capability is an
/// error naming it and its line.
pub fn parse_acl_policy(text: &str) -> Result<PolicyRules, SpecError> {
    let src = Source::new(text);
    let body = src.parse_body()?;
    let r = BodyReader::new(
        &src,
        &body,
        "the ACL policy".into(),
        1,
        &[],
        &["namespace", "node", "agent", "operator", "plugin"],
    )?;
    let mut rules = PolicyRules::default();
    for b in r.blocks("namespace") {
        let (name, ns) = BodyReader::labeled(
            &src,
            b,
            r.ctx(),
            "the namespace's name",
            &["policy", "capabilities"],
            &[],
        )?;
        if rules.namespaces.contains_key(&name) {
            return Err(ns.invalid("policy", format!("namespace {name:?} is given twice")));
        }
        let policy = ns.parsed::<Level>("policy")?.unwrap_or_default();
        let mut capabilities = std::collections::BTreeSet::new();
        for c in ns.strings("capabilities")?.unwrap_or_default() {
            let cap = c
                .parse::<Capability>()
                .map_err(|e| ns.invalid("capabilities", e))?;
            capabilities.insert(cap);
        }
        if policy == Level::None && capabilities.is_empty() {
            return Err(ns.missing("policy"));
        }
        rules.namespaces.insert(
            name,
            NamespaceRule {
                policy,
                capabilities,
            },
        );
    }
    for (key, slot) in [
        ("node", &mut rules.node),
        ("agent", &mut rules.agent),
        ("operator", &mut rules.operator),
        ("plugin", &mut rules.plugin),
    ] {
        if let Some(b) = r.optional_block(key)? {
            let part = BodyReader::unlabeled(&src, b, r.ctx(), &["policy"], &[])?;
            *slot = part
                .parsed::<Level>("policy")?
                .ok_or_else(|| part.missing("policy"))?;
        }
    }
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_policy_is_read() {
        let p = parse_acl_policy(
            r#"
namespace "default" {
  policy       = "read"
  capabilities = ["submit-job", "read-logs"]
}
namespace "*" {
  policy = "deny"
}
node     { policy = "write" }
agent    { policy = "read" }
operator { policy = "deny" }
plugin   { policy = "read" }
"#,
        )
        .expect("a policy");
        let d = &p.namespaces["default"];
        assert_eq!(d.policy, Level::Read);
        assert!(d.capabilities.contains(&Capability::SubmitJob));
        assert_eq!(p.namespaces["*"].policy, Level::Deny);
        assert_eq!(
            (p.node, p.agent, p.operator, p.plugin),
            (Level::Write, Level::Read, Level::Deny, Level::Read)
        );
    }

    #[test]
    fn mistakes_name_their_line_and_problem() {
        for (text, line, wanted) in [
            (
                "namespace \"default\" {\n policy = \"admin\"\n}",
                2,
                "unknown policy \"admin\"",
            ),
            (
                "namespace \"default\" {\n capabilities = [\"fly\"]\n}",
                2,
                "unknown capability \"fly\"",
            ),
            (
                "node {\n policy = \"read\"\n}\nhost {}",
                4,
                "unsupported block \"host\"",
            ),
            ("namespace {\n policy = \"read\"\n}", 1, "exactly one label"),
            ("agent {}", 1, "missing required attribute \"policy\""),
            (
                "namespace \"default\" {}",
                1,
                "missing required attribute \"policy\"",
            ),
        ] {
            let e = parse_acl_policy(text).expect_err(text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.message.contains(wanted), "{text}: {e}");
        }
    }
}
