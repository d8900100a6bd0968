//! Damaged JSON, for the property tests of whatever decodes it (records in
//! a state file, API bodies, the data model): values of every JSON type
//! that break decoders and checks, edits at every node of a valid document
//! (replaced, replaced in kind, removed, a member added), and JSON text
//! with bytes cut out and others spliced in.
//!
//! A test builds its valid document; what it does with the damaged one,
//! and which answer it expects, stays with the test.

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};

/// Numbers that break checks: the extremes of every integer width and
/// one past them, negative, fractional, beyond `u64`, and any at all.
pub fn number() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => prop::sample::select(vec![
            json!(u64::MAX),
            json!(u64::MAX - 1),
            json!(u32::MAX),
            json!(u64::from(u32::MAX) + 1),
            json!(i64::MAX),
            json!(i64::MIN),
            json!(-1),
            json!(0),
            json!(0.5),
            json!(1e26),
            json!(1e300),
        ]),
        1 => (0u64..20_000).prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<f64>().prop_map(Value::from),
    ]
    .boxed()
}

/// Text that breaks checks: any text, short or not, and names that climb
/// out of a directory, hold a separator or an index, are empty, or are a
/// duration too long to hold.
pub fn string() -> BoxedStrategy<String> {
    prop_oneof![
        2 => ".{0,24}",
        2 => "\\PC{0,6}",
        1 => prop::sample::select(vec![
            "", ".", "..", "../x", "../../etc", "/", "a/b", "x[0]", "\n", "\u{0}",
            "999999999999999999999999h",
        ])
        .prop_map(str::to_string),
    ]
    .boxed()
}

/// Object keys: mostly field-like names, sometimes any text.
pub fn key() -> BoxedStrategy<String> {
    prop_oneof![3 => "[a-z_]{1,12}", 1 => string()].boxed()
}

/// A value of each type that holds no other, and the empty array and
/// object: null, a bool, a [`number`], a string of `strings`.
pub fn leaf_of(strings: BoxedStrategy<String>) -> BoxedStrategy<Value> {
    prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        2 => number(),
        2 => strings.prop_map(Value::String),
        1 => Just(json!([])),
        1 => Just(json!({})),
    ]
    .boxed()
}

/// [`leaf_of`] with the strings of [`string`].
pub fn leaf() -> BoxedStrategy<Value> {
    leaf_of(string())
}

/// Values of any shape: `leaves`, and arrays and objects of them nested up
/// to three levels deep.
pub fn value_of(leaves: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
    leaves
        .prop_recursive(3, 24, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map(key(), inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
        .boxed()
}

/// [`value_of`] the leaves of [`leaf`].
pub fn value() -> BoxedStrategy<Value> {
    value_of(leaf())
}

/// Which nodes of a document are candidates for an edit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nodes {
    /// Every node: the root, and every object member and array element
    /// below it.
    All,
    /// The numbers only.
    Numbers,
}

/// JSON pointers (RFC 6901) to the `nodes` of `doc`, depth first, the root
/// ("") before what it holds: object members by their (escaped) key,
/// array elements by their index.
pub fn pointers(doc: &Value, nodes: Nodes) -> Vec<String> {
    fn walk(v: &Value, at: String, nodes: Nodes, out: &mut Vec<String>) {
        if nodes == Nodes::All || v.is_number() {
            out.push(at.clone());
        }
        match v {
            Value::Object(m) => {
                for (k, child) in m {
                    let k = k.replace('~', "~0").replace('/', "~1");
                    walk(child, format!("{at}/{k}"), nodes, out);
                }
            }
            Value::Array(a) => {
                for (i, child) in a.iter().enumerate() {
                    walk(child, format!("{at}/{i}"), nodes, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(doc, String::new(), nodes, &mut out);
    out
}

/// The pointer `at` picks among the `nodes` of `doc`, if it has any.
fn pick(doc: &Value, at: &Index, nodes: Nodes) -> Option<String> {
    let all = pointers(doc, nodes);
    (!all.is_empty()).then(|| all[at.index(all.len())].clone())
}

/// Replaces the node `at` picks among the `nodes` of `doc` with `with`;
/// false when `doc` has no such node.
pub fn replace_at(doc: &mut Value, at: &Index, nodes: Nodes, with: Value) -> bool {
    let Some(p) = pick(doc, at, nodes) else {
        return false;
    };
    match doc.pointer_mut(&p) {
        Some(slot) => {
            *slot = with;
            true
        }
        None => false,
    }
}

/// One change to a document, at the node `at` picks among all of its
/// nodes (see [`pointers`]).
#[derive(Debug, Clone)]
pub enum Edit {
    /// The node becomes `with`.
    Replace { at: Index, with: Value },
    /// A string node becomes `string`, a number node `number`, any other
    /// node `otherwise`: a value of the node's own type gets past decoding
    /// far more often, to the checks behind it.
    ReplaceInKind {
        at: Index,
        string: String,
        number: Value,
        otherwise: Value,
    },
    /// The node leaves its object or array (the root stays).
    Remove { at: Index },
    /// An object node gains the member `key` (or has it replaced), an
    /// array node the element `value` at its end; other nodes stay.
    Insert {
        at: Index,
        key: String,
        value: Value,
    },
}

impl Edit {
    pub fn apply(&self, doc: &mut Value) {
        let at = match self {
            Edit::Replace { at, .. }
            | Edit::ReplaceInKind { at, .. }
            | Edit::Remove { at }
            | Edit::Insert { at, .. } => at,
        };
        let Some(p) = pick(doc, at, Nodes::All) else {
            return;
        };
        match self {
            Edit::Replace { with, .. } => {
                if let Some(slot) = doc.pointer_mut(&p) {
                    *slot = with.clone();
                }
            }
            Edit::ReplaceInKind {
                string,
                number,
                otherwise,
                ..
            } => {
                if let Some(slot) = doc.pointer_mut(&p) {
                    *slot = match slot {
                        Value::String(_) => Value::String(string.clone()),
                        Value::Number(_) => number.clone(),
                        _ => otherwise.clone(),
                    };
                }
            }
            Edit::Remove { .. } => {
                let Some((parent, last)) = p.rsplit_once('/') else {
                    return;
                };
                let last = last.replace("~1", "/").replace("~0", "~");
                match doc.pointer_mut(parent) {
                    Some(Value::Object(o)) => {
                        o.remove(&last);
                    }
                    Some(Value::Array(a)) => {
                        if let Some(i) = last.parse::<usize>().ok().filter(|i| *i < a.len()) {
                            a.remove(i);
                        }
                    }
                    _ => {}
                }
            }
            Edit::Insert { key, value, .. } => match doc.pointer_mut(&p) {
                Some(Value::Object(o)) => {
                    o.insert(key.clone(), value.clone());
                }
                Some(Value::Array(a)) => a.push(value.clone()),
                _ => {}
            },
        }
    }
}

/// `doc` with `edits` applied in order.
pub fn edited(mut doc: Value, edits: &[Edit]) -> Value {
    for e in edits {
        e.apply(&mut doc);
    }
    doc
}

/// A node replaced by one of `values`.
pub fn replace(values: BoxedStrategy<Value>) -> BoxedStrategy<Edit> {
    (any::<Index>(), values)
        .prop_map(|(at, with)| Edit::Replace { at, with })
        .boxed()
}

/// A node replaced by a value of its own type: one of `strings`, a
/// [`number`], or else one of `values`.
pub fn replace_in_kind(
    strings: BoxedStrategy<String>,
    values: BoxedStrategy<Value>,
) -> BoxedStrategy<Edit> {
    (any::<Index>(), strings, number(), values)
        .prop_map(|(at, string, number, otherwise)| Edit::ReplaceInKind {
            at,
            string,
            number,
            otherwise,
        })
        .boxed()
}

/// A node removed.
pub fn remove() -> BoxedStrategy<Edit> {
    any::<Index>().prop_map(|at| Edit::Remove { at }).boxed()
}

/// A member (a [`key`]) or element of `values` added.
pub fn insert(values: BoxedStrategy<Value>) -> BoxedStrategy<Edit> {
    (any::<Index>(), key(), values)
        .prop_map(|(at, key, value)| Edit::Insert { at, key, value })
        .boxed()
}

/// Every kind of edit: 4 in 7 replace a node (half of them in kind), 2 in
/// 7 remove one, 1 in 7 adds one.
pub fn edit_of(
    strings: BoxedStrategy<String>,
    values: BoxedStrategy<Value>,
) -> BoxedStrategy<Edit> {
    prop_oneof![
        2 => replace(values.clone()),
        2 => replace_in_kind(strings, values.clone()),
        2 => remove(),
        1 => insert(values),
    ]
    .boxed()
}

/// [`edit_of`] with the strings of [`string`] and the values of [`value`].
pub fn edit() -> BoxedStrategy<Edit> {
    edit_of(string(), value())
}

/// Damage to a text: from the position `at` picks in it (its end
/// included), `cut` bytes (or as many as there are) cut out and `insert`
/// spliced in. Valid JSON damaged this way is often still JSON, of another
/// meaning.
#[derive(Debug, Clone)]
pub struct Damage {
    pub at: Index,
    pub cut: usize,
    pub insert: Vec<u8>,
}

impl Damage {
    pub fn apply(&self, text: &[u8]) -> Vec<u8> {
        let from = self.at.index(text.len().saturating_add(1));
        let to = from.saturating_add(self.cut).min(text.len());
        [&text[..from], &self.insert[..], &text[to..]].concat()
    }
}

/// Up to 15 bytes cut and up to 7 spliced in, anywhere.
pub fn damage() -> BoxedStrategy<Damage> {
    (
        any::<Index>(),
        0usize..16,
        prop::collection::vec(any::<u8>(), 0..8),
    )
        .prop_map(|(at, cut, insert)| Damage { at, cut, insert })
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    fn index(n: usize, of: usize) -> Index {
        // An Index picks `n` of `of` when drawn at the right fraction.
        let mut runner = TestRunner::deterministic();
        loop {
            let i = any::<Index>().new_tree(&mut runner).unwrap().current();
            if i.index(of) == n {
                return i;
            }
        }
    }

    #[test]
    fn pointers_reach_every_node_and_escape_keys() {
        let doc = json!({"a/b": [1, {"c~": "x"}], "n": 2});
        assert_eq!(
            pointers(&doc, Nodes::All),
            ["", "/a~1b", "/a~1b/0", "/a~1b/1", "/a~1b/1/c~0", "/n"]
        );
        assert_eq!(pointers(&doc, Nodes::Numbers), ["/a~1b/0", "/n"]);
        assert!(pointers(&json!({"s": "x"}), Nodes::Numbers).is_empty());
    }

    #[test]
    fn edits_land_on_the_node_they_pick() {
        let doc = json!({"a/b": [1, {"c~": "x"}], "n": 2});
        let at = |n| index(n, 6);
        let remove = edited(doc.clone(), &[Edit::Remove { at: at(4) }]);
        assert_eq!(remove, json!({"a/b": [1, {}], "n": 2}));
        let remove = edited(doc.clone(), &[Edit::Remove { at: at(2) }]);
        assert_eq!(remove, json!({"a/b": [{"c~": "x"}], "n": 2}));
        let in_kind = |n| Edit::ReplaceInKind {
            at: at(n),
            string: "s".into(),
            number: json!(-1),
            otherwise: Value::Null,
        };
        assert_eq!(
            edited(doc.clone(), &[in_kind(4), in_kind(5)]),
            json!({"a/b": [1, {"c~": "s"}], "n": -1})
        );
        assert_eq!(
            edited(doc.clone(), &[in_kind(3)]),
            json!({"a/b": [1, null], "n": 2})
        );
        let insert = Edit::Insert {
            at: at(1),
            key: "k".into(),
            value: json!(true),
        };
        assert_eq!(
            edited(doc.clone(), &[insert]),
            json!({"a/b": [1, {"c~": "x"}, true], "n": 2})
        );
        let mut d = doc.clone();
        assert!(replace_at(&mut d, &index(1, 2), Nodes::Numbers, json!(7)));
        assert_eq!(d, json!({"a/b": [1, {"c~": "x"}], "n": 7}));
        assert!(!replace_at(
            &mut json!("s"),
            &index(0, 1),
            Nodes::Numbers,
            json!(7)
        ));
    }

    #[test]
    fn damage_cuts_and_splices_within_the_text() {
        let d = |at, cut, insert: &[u8]| Damage {
            at: index(at, 4),
            cut,
            insert: insert.to_vec(),
        };
        assert_eq!(d(1, 1, b"xy").apply(b"abc"), b"axyc");
        assert_eq!(d(3, 9, b"!").apply(b"abc"), b"abc!");
        assert_eq!(d(0, usize::MAX, b"").apply(b"abc"), b"");
    }
}
