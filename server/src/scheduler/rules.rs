//! A group's placement rules as the scheduler matches them: the
//! constraints of the job, the group and its tasks, compiled once per
//! evaluation (a pattern or a version requirement is parsed once, not on
//! every node), and the `distinct_hosts` and `distinct_property` rules,
//! which depend on where the job's other allocs are.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use berth_structs::constraint::{compile_regex, Target, Version, VersionReq};
use berth_structs::{Allocation, Constraint, Job, Node, Operator, TaskGroup};

/// One constraint on the node alone (or an affinity), ready to match.
pub(super) struct OnNode {
    shown: String,
    left: Target,
    right: Target,
    check: Check,
}

enum Check {
    /// Matched as written; a pattern or version requirement read from the
    /// node is parsed when matched.
    Plain(Operator),
    Regex(regex::Regex),
    Version(VersionReq),
}

impl OnNode {
    pub(super) fn compile(c: &Constraint) -> OnNode {
        let right = Target::parse(&c.value).unwrap_or(Target::Literal(c.value.clone()));
        let literal = matches!(right, Target::Literal(_));
        // Registration refused what does not compile; a rule stored
        // before that check matches no node rather than every node.
        let check = match c.operator {
            Operator::Regexp if literal => {
                compile_regex(&c.value).map_or(Check::Plain(Operator::Regexp), Check::Regex)
            }
            Operator::Version | Operator::Semver if literal => {
                VersionReq::parse(&c.value).map_or(Check::Plain(c.operator), Check::Version)
            }
            op => Check::Plain(op),
        };
        OnNode {
            shown: c.to_string(),
            left: Target::parse(&c.attribute).unwrap_or(Target::Literal(c.attribute.clone())),
            right,
            check,
        }
    }

    /// Nomad's rules: a comparison needs both sides; `!=` holds when the
    /// attribute is missing.
    pub(super) fn met_by(&self, node: &Node) -> bool {
        let l = self.left.value_on(node);
        let r = self.right.value_on(node);
        match &self.check {
            Check::Regex(re) => l.is_some_and(|l| re.is_match(l)),
            Check::Version(req) => l.is_some_and(|l| version_matches(req, l)),
            Check::Plain(op) => match (op, l, r) {
                (Operator::IsSet, l, _) => l.is_some(),
                (Operator::IsNotSet, l, _) => l.is_none(),
                (Operator::NotEqual, l, r) => l != r,
                (_, Some(l), Some(r)) => matches_values(*op, l, r),
                _ => false,
            },
        }
    }
}

fn version_matches(req: &VersionReq, value: &str) -> bool {
    Version::parse(value).is_ok_and(|v| req.matches(&v))
}

fn matches_values(op: Operator, l: &str, r: &str) -> bool {
    match op {
        Operator::Equal => l == r,
        Operator::Greater => order(l, r).is_gt(),
        Operator::GreaterEqual => order(l, r).is_ge(),
        Operator::Less => order(l, r).is_lt(),
        Operator::LessEqual => order(l, r).is_le(),
        Operator::Regexp => compile_regex(r).is_ok_and(|re| re.is_match(l)),
        Operator::Version | Operator::Semver => {
            VersionReq::parse(r).is_ok_and(|req| version_matches(&req, l))
        }
        Operator::SetContains => {
            let have = set(l);
            set(r).all(|x| have.clone().any(|y| y == x))
        }
        Operator::SetContainsAny => {
            let have = set(l);
            set(r).any(|x| have.clone().any(|y| y == x))
        }
        // Handled by the caller, or not a rule on the node.
        Operator::NotEqual
        | Operator::IsSet
        | Operator::IsNotSet
        | Operator::DistinctHosts
        | Operator::DistinctProperty => true,
    }
}

/// Numbers compare as numbers, anything else as text.
fn order(l: &str, r: &str) -> Ordering {
    if let (Ok(a), Ok(b)) = (l.trim().parse::<i64>(), r.trim().parse::<i64>()) {
        return a.cmp(&b);
    }
    if let (Ok(a), Ok(b)) = (l.trim().parse::<f64>(), r.trim().parse::<f64>()) {
        return a.partial_cmp(&b).unwrap_or(Ordering::Equal);
    }
    l.cmp(r)
}

fn set(s: &str) -> impl Iterator<Item = &str> + Clone {
    s.split(',').map(str::trim).filter(|x| !x.is_empty())
}

/// Whether a rule over the other allocs counts the job's or the group's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    Job,
    Group,
}

/// A `distinct_property`: at most `limit` allocs per value of `property`.
pub(super) struct DistinctProperty {
    shown: String,
    scope: Scope,
    property: Target,
    limit: u64,
}

/// The compiled rules of one group.
#[derive(Default)]
pub(super) struct GroupRules {
    on_node: Vec<OnNode>,
    pub(super) distinct_hosts: Option<Scope>,
    pub(super) distinct_properties: Vec<DistinctProperty>,
}

impl GroupRules {
    pub(super) fn compile(job: &Job, group: &TaskGroup) -> GroupRules {
        let mut rules = GroupRules::default();
        let scoped = job
            .constraints
            .iter()
            .map(|c| (Scope::Job, c))
            .chain(group.constraints.iter().map(|c| (Scope::Group, c)))
            .chain(
                group
                    .tasks
                    .iter()
                    .flat_map(|t| &t.constraints)
                    .map(|c| (Scope::Group, c)),
            );
        for (scope, c) in scoped {
            match c.operator {
                Operator::DistinctHosts => {
                    // The job's rule is the wider one.
                    if rules.distinct_hosts != Some(Scope::Job) {
                        rules.distinct_hosts = Some(scope);
                    }
                }
                Operator::DistinctProperty => rules.distinct_properties.push(DistinctProperty {
                    shown: c.to_string(),
                    scope,
                    property: Target::parse(&c.attribute)
                        .unwrap_or(Target::Literal(c.attribute.clone())),
                    limit: c.distinct_limit().unwrap_or(1),
                }),
                _ => rules.on_node.push(OnNode::compile(c)),
            }
        }
        rules
    }

    /// The first constraint `node` does not meet, as a failure reason.
    pub(super) fn unmet_on(&self, node: &Node) -> Option<String> {
        self.on_node
            .iter()
            .find(|c| !c.met_by(node))
            .map(|c| format!("constraint {:?} not met", c.shown))
    }

    pub(super) fn has_distinct(&self) -> bool {
        self.distinct_hosts.is_some() || !self.distinct_properties.is_empty()
    }
}

/// Where the job's live allocs are, for the distinct rules of one group
/// being placed: per node, and per value of each distinct property.
pub(super) struct Distinct {
    rules: Arc<GroupRules>,
    group: String,
    on_node: HashMap<String, (u64, u64)>,
    per_value: Vec<HashMap<String, u64>>,
}

impl Distinct {
    /// `live` are the job's allocs that are not terminal, `node_of` finds
    /// their nodes.
    pub(super) fn new<'n>(
        rules: Arc<GroupRules>,
        group: &str,
        live: impl Iterator<Item = &'n Allocation>,
        node_of: impl Fn(&str) -> Option<&'n Node>,
    ) -> Distinct {
        let mut d = Distinct {
            per_value: vec![HashMap::new(); rules.distinct_properties.len()],
            rules,
            group: group.to_string(),
            on_node: HashMap::new(),
        };
        if d.rules.has_distinct() {
            for a in live {
                if let Some(node) = node_of(&a.node_id) {
                    d.add(a.task_group == group, node);
                }
            }
        }
        d
    }

    /// Count an alloc (of this group, or another of the job) on `node`.
    pub(super) fn add(&mut self, of_group: bool, node: &Node) {
        if !self.rules.has_distinct() {
            return;
        }
        let n = self.on_node.entry(node.id.clone()).or_default();
        n.0 = n.0.saturating_add(1);
        if of_group {
            n.1 = n.1.saturating_add(1);
        }
        for (p, counts) in self
            .rules
            .distinct_properties
            .iter()
            .zip(&mut self.per_value)
        {
            if p.scope == Scope::Job || of_group {
                if let Some(v) = p.property.value_on(node) {
                    let c = counts.entry(v.to_string()).or_default();
                    *c = c.saturating_add(1);
                }
            }
        }
    }

    /// Why one more alloc of the group may not go to `node`, if it may
    /// not.
    pub(super) fn refuses(&self, node: &Node) -> Option<String> {
        if !self.rules.has_distinct() {
            return None;
        }
        let (job_here, group_here) = self.on_node.get(&node.id).copied().unwrap_or_default();
        match self.rules.distinct_hosts {
            Some(Scope::Job) if job_here > 0 => {
                return Some("distinct_hosts: the node runs an alloc of the job".into())
            }
            Some(Scope::Group) if group_here > 0 => {
                return Some(format!(
                    "distinct_hosts: the node runs an alloc of group {:?}",
                    self.group
                ))
            }
            _ => {}
        }
        for (p, counts) in self.rules.distinct_properties.iter().zip(&self.per_value) {
            let Some(v) = p.property.value_on(node) else {
                return Some(format!("constraint {:?}: the node has no value", p.shown));
            };
            if counts.get(v).copied().unwrap_or_default() >= p.limit {
                return Some(format!("constraint {:?}: value {v:?} is taken", p.shown));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn node(name: &str, attrs: &[(&str, &str)], meta: &[(&str, &str)]) -> Node {
        Node {
            id: format!("id-{name}"),
            name: name.into(),
            datacenter: "dc1".into(),
            attributes: attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            meta: meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Node::default()
        }
    }

    fn met(attribute: &str, op: &str, value: &str, n: &Node) -> bool {
        OnNode::compile(&Constraint {
            attribute: attribute.into(),
            operator: op.parse().unwrap(),
            value: value.into(),
        })
        .met_by(n)
    }

    #[test]
    fn each_operator_matches_as_nomads_does() {
        let n = node(
            "c2",
            &[
                ("kernel.name", "linux"),
                ("kernel.version", "6.1.0"),
                ("cpu.numcores", "16"),
                ("features", "sse4, avx2 ,aes"),
            ],
            &[("rack", "r1")],
        );
        let cases = [
            ("${node.unique.name}", "=", "c2", true),
            ("${node.unique.name}", "==", "c1", false),
            ("${node.datacenter}", "!=", "dc2", true),
            ("${meta.zone}", "!=", "a", true),
            ("${meta.zone}", "=", "a", false),
            ("${attr.cpu.numcores}", ">", "8", true),
            ("${attr.cpu.numcores}", "<=", "9", false),
            ("${attr.kernel.name}", "regexp", "^lin", true),
            ("${attr.kernel.version}", "version", ">= 5.10, < 7", true),
            ("${attr.kernel.version}", "semver", "~> 5.15", false),
            ("${attr.features}", "set_contains", "avx2,aes", true),
            ("${attr.features}", "set_contains", "avx2,neon", false),
            ("${attr.features}", "set_contains_any", "neon,aes", true),
            ("${meta.rack}", "is_set", "", true),
            ("${meta.zone}", "is_not_set", "", true),
            ("${meta.zone}", "is_set", "", false),
            ("r1", "=", "${meta.rack}", true),
        ];
        for (attribute, op, value, want) in cases {
            assert_eq!(
                met(attribute, op, value, &n),
                want,
                "{attribute} {op} {value}"
            );
        }
    }

    #[test]
    fn unmet_names_the_first_constraint_the_node_fails() {
        let mut g = TaskGroup::default();
        g.constraints.push(Constraint {
            attribute: "${node.unique.name}".into(),
            operator: Operator::Equal,
            value: "c2".into(),
        });
        let rules = GroupRules::compile(&Job::default(), &g);
        assert_eq!(rules.unmet_on(&node("c2", &[], &[])), None);
        assert_eq!(
            rules.unmet_on(&node("c1", &[], &[])).as_deref(),
            Some("constraint \"${node.unique.name} = c2\" not met")
        );
    }

    #[test]
    fn distinct_rules_count_the_allocs_placed() {
        let mut g = TaskGroup {
            name: "g".into(),
            ..TaskGroup::default()
        };
        g.constraints.push(Constraint {
            operator: Operator::DistinctHosts,
            ..Constraint::default()
        });
        g.constraints.push(Constraint {
            attribute: "${meta.rack}".into(),
            operator: Operator::DistinctProperty,
            value: "2".into(),
        });
        let rules = Arc::new(GroupRules::compile(&Job::default(), &g));
        let (a, b, c) = (
            node("a", &[], &[("rack", "r1")]),
            node("b", &[], &[("rack", "r1")]),
            node("c", &[], &[("rack", "r1")]),
        );
        let mut d = Distinct::new(rules, "g", std::iter::empty(), |_| None);
        assert_eq!(d.refuses(&a), None);
        d.add(true, &a);
        assert!(d.refuses(&a).unwrap().contains("distinct_hosts"));
        d.add(true, &b);
        let why = d.refuses(&c).unwrap();
        assert!(why.contains("value \"r1\" is taken"), "{why}");
        assert!(d
            .refuses(&node("d", &[], &[]))
            .unwrap()
            .contains("no value"));
    }
}
