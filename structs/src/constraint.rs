//! Placement rules: `constraint { attribute operator value }` blocks of a
//! job, a group or a task (Nomad's names and operators), the `affinity`
//! and `spread` preferences, the node values they read (`${node.unique.name}`, `${attr.kernel.name}`,
//! `${meta.rack}`) and the versions the `version` operator compares. The
//! scheduler matches them against nodes; this module holds their shape
//! and the checks a job's rules pass before it is accepted.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The largest compiled size of a constraint's regular expression: a
/// pattern is a user's input and matched on every node.
pub const MAX_REGEX_SIZE: usize = 1 << 20;

/// One `constraint` block. For `distinct_hosts` the attribute and value
/// are unused; for `distinct_property` the value is the number of allocs
/// allowed per value of the attribute (1 when empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Constraint {
    #[serde(default)]
    pub attribute: String,
    #[serde(default)]
    pub operator: Operator,
    #[serde(default)]
    pub value: String,
}

/// A constraint's operator (Nomad's, with its aliases on input).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Operator {
    #[default]
    #[serde(rename = "=", alias = "==", alias = "is")]
    Equal,
    #[serde(rename = "!=", alias = "not")]
    NotEqual,
    #[serde(rename = ">")]
    Greater,
    #[serde(rename = ">=")]
    GreaterEqual,
    #[serde(rename = "<")]
    Less,
    #[serde(rename = "<=")]
    LessEqual,
    #[serde(rename = "regexp")]
    Regexp,
    #[serde(rename = "set_contains", alias = "set_contains_all")]
    SetContains,
    #[serde(rename = "set_contains_any")]
    SetContainsAny,
    #[serde(rename = "is_set")]
    IsSet,
    #[serde(rename = "is_not_set")]
    IsNotSet,
    #[serde(rename = "version")]
    Version,
    #[serde(rename = "semver")]
    Semver,
    #[serde(rename = "distinct_hosts")]
    DistinctHosts,
    #[serde(rename = "distinct_property")]
    DistinctProperty,
}

impl Operator {
    const ALL: [Operator; 15] = [
        Operator::Equal,
        Operator::NotEqual,
        Operator::Greater,
        Operator::GreaterEqual,
        Operator::Less,
        Operator::LessEqual,
        Operator::Regexp,
        Operator::SetContains,
        Operator::SetContainsAny,
        Operator::IsSet,
        Operator::IsNotSet,
        Operator::Version,
        Operator::Semver,
        Operator::DistinctHosts,
        Operator::DistinctProperty,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Operator::Equal => "=",
            Operator::NotEqual => "!=",
            Operator::Greater => ">",
            Operator::GreaterEqual => ">=",
            Operator::Less => "<",
            Operator::LessEqual => "<=",
            Operator::Regexp => "regexp",
            Operator::SetContains => "set_contains",
            Operator::SetContainsAny => "set_contains_any",
            Operator::IsSet => "is_set",
            Operator::IsNotSet => "is_not_set",
            Operator::Version => "version",
            Operator::Semver => "semver",
            Operator::DistinctHosts => "distinct_hosts",
            Operator::DistinctProperty => "distinct_property",
        }
    }

    /// Whether the rule depends on the other allocs placed, not on the
    /// node alone.
    pub fn is_distinct(self) -> bool {
        matches!(self, Operator::DistinctHosts | Operator::DistinctProperty)
    }

    /// Whether the operator reads no value.
    fn takes_no_value(self) -> bool {
        matches!(
            self,
            Operator::IsSet | Operator::IsNotSet | Operator::DistinctHosts
        )
    }
}

impl FromStr for Operator {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let alias = match s {
            "==" | "is" => Some(Operator::Equal),
            "not" => Some(Operator::NotEqual),
            "set_contains_all" => Some(Operator::SetContains),
            _ => None,
        };
        alias
            .or_else(|| Operator::ALL.into_iter().find(|o| o.as_str() == s))
            .ok_or_else(|| {
                let known: Vec<&str> = Operator::ALL.iter().map(|o| o.as_str()).collect();
                format!("unknown operator {s:?} (want one of {})", known.join(", "))
            })
    }
}

impl fmt::Display for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.operator {
            Operator::DistinctHosts => f.write_str("distinct_hosts"),
            Operator::DistinctProperty => write!(
                f,
                "distinct_property {} (at most {} per value)",
                self.attribute,
                self.distinct_limit().unwrap_or(1)
            ),
            Operator::IsSet | Operator::IsNotSet => {
                write!(f, "{} {}", self.attribute, self.operator.as_str())
            }
            op => write!(f, "{} {} {}", self.attribute, op.as_str(), self.value),
        }
    }
}

impl Constraint {
    /// How many allocs a `distinct_property` allows per value.
    pub fn distinct_limit(&self) -> Result<u64, String> {
        if self.value.trim().is_empty() {
            return Ok(1);
        }
        match self.value.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "distinct_property takes a positive whole number as its value, not {:?}",
                self.value
            )),
        }
    }

    /// The problems of this constraint, as `{at}: constraint ...: why`.
    pub fn validate(&self, at: &str, errs: &mut Vec<String>) {
        let mut problem = |why: String| errs.push(format!("{at}: constraint {self}: {why}"));
        if self.operator != Operator::DistinctHosts {
            if self.attribute.trim().is_empty() {
                problem("attribute is empty".into());
            }
            for side in [&self.attribute, &self.value] {
                if let Err(e) = Target::parse(side) {
                    problem(e);
                }
            }
        }
        if self.value.trim().is_empty()
            && !self.operator.takes_no_value()
            && self.operator != Operator::DistinctProperty
        {
            problem(format!("operator {} needs a value", self.operator.as_str()));
        }
        // A value read from the node is checked when it is matched.
        let literal = !self.value.contains("${");
        match self.operator {
            Operator::Regexp if literal => {
                if let Err(e) = compile_regex(&self.value) {
                    problem(e);
                }
            }
            Operator::Version | Operator::Semver if literal => {
                if let Err(e) = VersionReq::parse(&self.value) {
                    problem(e);
                }
            }
            Operator::DistinctProperty => {
                if let Err(e) = self.distinct_limit() {
                    problem(e);
                }
            }
            _ => {}
        }
    }
}

/// One `affinity` block: nodes that meet it are preferred (a positive
/// weight) or avoided (a negative one), by its weight among the group's
/// affinities. The operators are a constraint's but the distinct ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Affinity {
    #[serde(default)]
    pub attribute: String,
    #[serde(default)]
    pub operator: Operator,
    #[serde(default)]
    pub value: String,
    /// -100 to 100, not 0.
    #[serde(default = "Affinity::default_weight")]
    pub weight: i8,
}

impl Affinity {
    pub const DEFAULT_WEIGHT: i8 = 50;

    fn default_weight() -> i8 {
        Affinity::DEFAULT_WEIGHT
    }

    /// The affinity as the constraint it matches like.
    pub fn as_constraint(&self) -> Constraint {
        Constraint {
            attribute: self.attribute.clone(),
            operator: self.operator,
            value: self.value.clone(),
        }
    }

    pub fn validate(&self, at: &str, errs: &mut Vec<String>) {
        let c = self.as_constraint();
        if self.operator.is_distinct() {
            errs.push(format!(
                "{at}: affinity {c}: {} is a constraint, not an affinity",
                self.operator.as_str()
            ));
            return;
        }
        let mut found = Vec::new();
        c.validate(at, &mut found);
        errs.extend(
            found
                .into_iter()
                .map(|e| e.replacen(": constraint ", ": affinity ", 1)),
        );
        if self.weight == 0 || !(-100..=100).contains(&self.weight) {
            errs.push(format!(
                "{at}: affinity {c}: weight must be between -100 and 100 and not 0, not {}",
                self.weight
            ));
        }
    }
}

/// One `spread` block: the group's allocs spread over the values of
/// `attribute`, evenly or by the targets' percentages (values not named
/// share what the targets leave of 100).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Spread {
    pub attribute: String,
    /// 1 to 100: this spread's part among the group's spreads.
    #[serde(default = "Spread::default_weight")]
    pub weight: u8,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<SpreadTarget>,
}

/// A `target "VALUE" { percent }` of a spread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct SpreadTarget {
    pub value: String,
    pub percent: u8,
}

impl Spread {
    pub const DEFAULT_WEIGHT: u8 = 50;

    fn default_weight() -> u8 {
        Spread::DEFAULT_WEIGHT
    }

    pub fn validate(&self, at: &str, errs: &mut Vec<String>) {
        let mut problem =
            |why: String| errs.push(format!("{at}: spread {}: {why}", self.attribute));
        match Target::parse(&self.attribute) {
            Ok(Target::Literal(_)) => {
                problem("attribute must name a node value, such as ${meta.rack}".into())
            }
            Ok(_) => {}
            Err(e) => problem(e),
        }
        if !(1..=100).contains(&self.weight) {
            problem(format!(
                "weight must be between 1 and 100, not {}",
                self.weight
            ));
        }
        let mut sum = 0u32;
        let mut seen = std::collections::BTreeSet::new();
        for t in &self.targets {
            if !seen.insert(t.value.as_str()) {
                problem(format!("target {:?} is named twice", t.value));
            }
            sum += u32::from(t.percent);
        }
        if sum > 100 {
            problem(format!(
                "the targets' percents add up to {sum}, more than 100"
            ));
        }
    }
}

/// Whether the datacenter `dc` is one `pattern` (an entry of a job's
/// `datacenters`) names: the name itself, or a glob where `*` stands for
/// any run of characters and `?` for one (`"us-*"`, `"*"`).
pub fn datacenter_matches(pattern: &str, dc: &str) -> bool {
    let (p, d): (Vec<char>, Vec<char>) = (pattern.chars().collect(), dc.chars().collect());
    // The classic two-pointer glob match, with backtracking to the last
    // `*`.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < d.len() {
        match p.get(i) {
            Some('*') => {
                star = Some((i, j));
                i += 1;
            }
            Some(c) if *c == '?' || *c == d[j] => {
                i += 1;
                j += 1;
            }
            _ => match star {
                Some((si, sj)) => {
                    i = si + 1;
                    j = sj + 1;
                    star = Some((si, sj + 1));
                }
                None => return false,
            },
        }
    }
    p[i..].iter().all(|c| *c == '*')
}

/// A regular expression of a `regexp` constraint, bounded in size.
pub fn compile_regex(pattern: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(pattern)
        .size_limit(MAX_REGEX_SIZE)
        .build()
        .map_err(|e| format!("invalid regular expression {pattern:?}: {e}"))
}

/// What one side of a constraint names: a literal, or a value of the
/// node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Literal(String),
    /// `${node.unique.id}`
    NodeId,
    /// `${node.unique.name}`
    NodeName,
    /// `${node.datacenter}`
    Datacenter,
    /// `${node.region}`
    Region,
    /// `${node.class}`
    NodeClass,
    /// `${attr.NAME}`: a fingerprinted attribute.
    Attr(String),
    /// `${meta.NAME}`: the operator's node meta.
    Meta(String),
}

impl Target {
    /// The target `text` names; a `${...}` that is not one of the node's
    /// values is an error naming those that are.
    pub fn parse(text: &str) -> Result<Target, String> {
        let t = text.trim();
        let Some(inner) = t.strip_prefix("${").and_then(|r| r.strip_suffix('}')) else {
            if t.contains("${") {
                return Err(format!(
                    "{text:?} mixes text and an interpolation; write one ${{...}} alone"
                ));
            }
            return Ok(Target::Literal(text.to_string()));
        };
        let named = |prefix: &str| {
            inner
                .strip_prefix(prefix)
                .filter(|n| !n.is_empty())
                .map(str::to_string)
        };
        Ok(match inner {
            "node.unique.id" => Target::NodeId,
            "node.unique.name" => Target::NodeName,
            "node.datacenter" => Target::Datacenter,
            "node.region" => Target::Region,
            "node.class" => Target::NodeClass,
            _ => {
                if let Some(n) = named("attr.") {
                    Target::Attr(n)
                } else if let Some(n) = named("meta.") {
                    Target::Meta(n)
                } else {
                    return Err(format!(
                        "unknown target {t}: use ${{node.unique.id}}, ${{node.unique.name}}, \
                         ${{node.datacenter}}, ${{node.region}}, ${{node.class}}, ${{attr.NAME}} \
                         or ${{meta.NAME}}"
                    ));
                }
            }
        })
    }

    /// The value this target has on `node`, if it has one.
    pub fn value_on<'n>(&'n self, node: &'n crate::Node) -> Option<&'n str> {
        match self {
            Target::Literal(s) => Some(s),
            Target::NodeId => Some(&node.id),
            Target::NodeName => Some(&node.name),
            Target::Datacenter => Some(&node.datacenter),
            Target::Region => Some(node.region()),
            Target::NodeClass => Some(&node.node_class),
            Target::Attr(n) => node.attributes.get(n).map(String::as_str),
            Target::Meta(n) => node.meta.get(n).map(String::as_str),
        }
    }
}

/// A version as the `version` and `semver` operators read it:
/// `v1.2.3-beta.1+build`: numeric segments, an optional pre-release (which
/// sorts before the release), build metadata ignored. Missing segments
/// are zeros: `1.2` is `1.2.0`.
#[derive(Debug, Clone)]
pub struct Version {
    segments: Vec<u64>,
    pre: Option<String>,
}

impl Version {
    pub fn parse(text: &str) -> Result<Version, String> {
        let t = text.trim();
        let t = t.strip_prefix('v').unwrap_or(t);
        let t = t.split_once('+').map_or(t, |(v, _)| v);
        let (core, pre) = match t.split_once('-') {
            Some((c, p)) if !p.is_empty() => (c, Some(p.to_string())),
            Some(_) => return Err(format!("version {text:?} has an empty pre-release")),
            None => (t, None),
        };
        let segments = core
            .split('.')
            .map(|s| s.parse::<u64>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| format!("{text:?} is not a version (want numbers like 1.2.3)"))?;
        Ok(Version { segments, pre })
    }

    fn segment(&self, i: usize) -> u64 {
        self.segments.get(i).copied().unwrap_or(0)
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        let n = self.segments.len().max(other.segments.len());
        (0..n)
            .map(|i| self.segment(i).cmp(&other.segment(i)))
            .find(|o| o.is_ne())
            .unwrap_or_else(|| match (&self.pre, &other.pre) {
                (None, None) => Ordering::Equal,
                (None, Some(_)) => Ordering::Greater,
                (Some(_), None) => Ordering::Less,
                (Some(a), Some(b)) => compare_pre_release(a, b),
            })
    }
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Version {}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Semver's order of pre-releases: dot-separated identifiers, numeric
/// ones by value and before the others.
fn compare_pre_release(a: &str, b: &str) -> Ordering {
    let mut x = a.split('.');
    let mut y = b.split('.');
    loop {
        match (x.next(), y.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(p), Some(q)) => {
                let o = match (p.parse::<u64>(), q.parse::<u64>()) {
                    (Ok(m), Ok(n)) => m.cmp(&n),
                    (Ok(_), Err(_)) => Ordering::Less,
                    (Err(_), Ok(_)) => Ordering::Greater,
                    (Err(_), Err(_)) => p.cmp(q),
                };
                if o.is_ne() {
                    return o;
                }
            }
        }
    }
}

/// A version requirement: clauses joined by commas, each an operator
/// (`=`, `!=`, `>`, `>=`, `<`, `<=`, `~>`; `=` when none) and a version.
/// `~> 1.2` means at least 1.2 and below 2.0; `~> 1.2.3`, below 1.3.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionReq {
    clauses: Vec<(&'static str, Version)>,
}

impl VersionReq {
    pub fn parse(text: &str) -> Result<VersionReq, String> {
        let mut clauses = Vec::new();
        for clause in text.split(',') {
            let c = clause.trim();
            let op = ["~>", ">=", "<=", "!=", ">", "<", "="]
                .into_iter()
                .find(|op| c.starts_with(op));
            let version = Version::parse(op.map_or(c, |op| &c[op.len()..]))
                .map_err(|e| format!("version requirement {text:?}: {e}"))?;
            clauses.push((op.unwrap_or("="), version));
        }
        Ok(VersionReq { clauses })
    }

    pub fn matches(&self, v: &Version) -> bool {
        self.clauses.iter().all(|(op, want)| match *op {
            "~>" => v >= want && *v < pessimistic_bound(want),
            ">=" => v >= want,
            "<=" => v <= want,
            "!=" => v != want,
            ">" => v > want,
            "<" => v < want,
            _ => v == want,
        })
    }
}

/// The exclusive upper bound of `~> want`: its next-to-last segment
/// raised by one (the only segment, when there is one).
fn pessimistic_bound(want: &Version) -> Version {
    let keep = want.segments.len().saturating_sub(1).max(1);
    let mut segments: Vec<u64> = want.segments.iter().copied().take(keep).collect();
    if let Some(last) = segments.last_mut() {
        *last = last.saturating_add(1);
    }
    Version {
        segments,
        pre: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Version {
        Version::parse(s).unwrap()
    }

    #[test]
    fn datacenters_match_by_name_or_glob() {
        for (pattern, dc, want) in [
            ("dc1", "dc1", true),
            ("dc1", "dc2", false),
            ("*", "anything", true),
            ("us-*", "us-east-1", true),
            ("us-*", "eu-west-1", false),
            ("us-?ast-*", "us-east-1", true),
            ("*-1", "us-east-1", true),
            ("*east*", "us-east-1", true),
            ("us-*-2", "us-east-1", false),
            ("", "dc1", false),
            ("dc1*", "dc1", true),
        ] {
            assert_eq!(
                datacenter_matches(pattern, dc),
                want,
                "{pattern:?} ~ {dc:?}"
            );
        }
    }

    #[test]
    fn versions_order_numerically_with_pre_releases_first() {
        assert!(v("1.10") > v("1.9.9"));
        assert!(v("1.2.0") == v("v1.2"));
        assert!(v("1.2.0-beta.2") < v("1.2.0"));
        assert!(v("1.2.0-beta.2") < v("1.2.0-beta.10"));
        assert!(v("1.2.0-alpha") < v("1.2.0-beta"));
        assert!(Version::parse("one").is_err());
    }

    #[test]
    fn requirements_take_every_clause_and_the_pessimistic_operator() {
        let r = VersionReq::parse(">= 1.2, < 2.0").unwrap();
        assert!(r.matches(&v("1.9.3")));
        assert!(!r.matches(&v("2.0.0")));
        assert!(!r.matches(&v("1.1")));
        let r = VersionReq::parse("~> 1.2").unwrap();
        assert!(r.matches(&v("1.9")) && !r.matches(&v("2.0")));
        let r = VersionReq::parse("~> 1.2.3").unwrap();
        assert!(r.matches(&v("1.2.9")) && !r.matches(&v("1.3.0")));
        assert!(VersionReq::parse(">= x").is_err());
    }

    #[test]
    fn operators_read_nomads_names_and_aliases() {
        assert_eq!("==".parse::<Operator>(), Ok(Operator::Equal));
        assert_eq!("not".parse::<Operator>(), Ok(Operator::NotEqual));
        assert_eq!(
            "set_contains_all".parse::<Operator>(),
            Ok(Operator::SetContains)
        );
        let e = "~=".parse::<Operator>().unwrap_err();
        assert!(
            e.contains("unknown operator \"~=\"") && e.contains("regexp"),
            "{e}"
        );
    }

    #[test]
    fn validation_names_the_bad_part() {
        let mut errs = Vec::new();
        let bad = [
            ("${node.name}", Operator::Equal, "c1"),
            ("${attr.kernel.name}", Operator::Regexp, "("),
            ("${attr.kernel.version}", Operator::Version, ">= five"),
            ("${meta.rack}", Operator::DistinctProperty, "0"),
            ("${meta.rack}", Operator::Equal, ""),
        ];
        for (attribute, operator, value) in bad {
            Constraint {
                attribute: attribute.into(),
                operator,
                value: value.into(),
            }
            .validate("group \"g\"", &mut errs);
        }
        assert_eq!(errs.len(), 5, "{errs:?}");
        assert!(
            errs[0].contains("unknown target ${node.name}"),
            "{}",
            errs[0]
        );
        assert!(
            errs[1].contains("invalid regular expression"),
            "{}",
            errs[1]
        );
        assert!(errs[2].contains("not a version"), "{}", errs[2]);
        assert!(errs[3].contains("positive whole number"), "{}", errs[3]);
        assert!(errs[4].contains("needs a value"), "{}", errs[4]);
        let mut ok = Vec::new();
        Constraint {
            operator: Operator::DistinctHosts,
            ..Constraint::default()
        }
        .validate("job", &mut ok);
        assert!(ok.is_empty(), "{ok:?}");
    }
}
