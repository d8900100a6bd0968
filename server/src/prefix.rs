//! IDs as people give them: the exact ID, or a unique prefix of one. An
//! exact ID always wins over a longer ID it is a prefix of; a prefix that
//! several IDs start with is an error that lists them.

use std::collections::BTreeMap;

use berth_structs::Node;

use crate::error::ServerError;
use crate::state::Tables;

/// How many matches an ambiguous prefix's error lists before "and N more".
pub(crate) const SHOWN_MATCHES: usize = 10;

/// What is looked up, for the messages: `job`/`jobs`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kind {
    pub singular: &'static str,
    pub plural: &'static str,
}

pub(crate) const JOB: Kind = Kind {
    singular: "job",
    plural: "jobs",
};
pub(crate) const ALLOC: Kind = Kind {
    singular: "alloc",
    plural: "allocs",
};
pub(crate) const NODE: Kind = Kind {
    singular: "node",
    plural: "nodes",
};
pub(crate) const VOLUME: Kind = Kind {
    singular: "volume",
    plural: "volumes",
};
pub(crate) const PLUGIN: Kind = Kind {
    singular: "CSI plugin",
    plural: "plugins",
};

/// The entry of `map` that `given` names: the one with that key, else the
/// only one whose key starts with it. `None` when none does (the caller
/// says what "not found" means for its kind); an empty `given` names
/// nothing. Several: `BadRequest` listing them, each as `label` shows it
/// (its quoted key first, see [`key`]; by key range, so the cost is the
/// matches', not the map's).
pub(crate) fn resolve<'a, V>(
    map: &'a BTreeMap<String, V>,
    given: &str,
    kind: Kind,
    label: impl Fn(&str, &V) -> String,
) -> Result<Option<(&'a String, &'a V)>, ServerError> {
    if let Some(entry) = map.get_key_value(given) {
        return Ok(Some(entry));
    }
    if given.is_empty() {
        return Ok(None);
    }
    let mut matches = map
        .range::<str, _>((std::ops::Bound::Included(given), std::ops::Bound::Unbounded))
        .take_while(|(k, _)| k.starts_with(given));
    let Some(first) = matches.next() else {
        return Ok(None);
    };
    let Some(second) = matches.next() else {
        return Ok(Some(first));
    };
    // The first few are shown; the rest are only counted.
    let mut shown: Vec<String> = [first, second]
        .into_iter()
        .chain(matches.by_ref().take(SHOWN_MATCHES - 2))
        .map(|(k, v)| label(k, v))
        .collect();
    let total = shown.len() + matches.count();
    if total > SHOWN_MATCHES {
        shown.push(format!("and {} more", total - SHOWN_MATCHES));
    }
    Err(ServerError::BadRequest(format!(
        "{} ID prefix {given:?} matches {total} {}: {}",
        kind.singular,
        kind.plural,
        shown.join(", ")
    )))
}

/// The key alone, quoted, as a label: every kind's matches are listed in
/// one form (`job ID prefix "we" matches 2 jobs: "web", "worker"`).
pub(crate) fn key<V>(k: &str, _: &V) -> String {
    format!("{k:?}")
}

/// The node `given` names: its ID, its name, or a unique prefix of its ID
/// (what `node status` and `volume detach` accept), in that order.
pub(crate) fn resolve_node<'a>(t: &'a Tables, given: &str) -> Result<&'a Node, ServerError> {
    if let Some(n) = t.nodes.get(given) {
        return Ok(n);
    }
    let named: Vec<&Node> = t.nodes_named(given).collect();
    match named.as_slice() {
        [one] => return Ok(one),
        [] => {}
        many => {
            let ids: Vec<&str> = many.iter().map(|n| n.id.as_str()).collect();
            return Err(ServerError::BadRequest(format!(
                "node name {given:?} matches {} nodes ({}); give the node ID",
                many.len(),
                ids.join(", ")
            )));
        }
    }
    resolve(&t.nodes, given, NODE, |k, n| {
        format!("{k:?} ({})", n.name)
    })?
    .map(|(_, n)| n)
    .ok_or_else(|| {
        ServerError::not_found(format!(
            "node {given:?} not found: give a node ID, a unique ID prefix or a node name (see `berth node status`)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(keys: &[&str]) -> BTreeMap<String, ()> {
        keys.iter().map(|k| (k.to_string(), ())).collect()
    }

    #[test]
    fn exact_ids_win_unique_prefixes_resolve_and_ambiguous_ones_list_the_matches() {
        let m = map(&["web", "web-2", "worker", "api"]);
        let found = |given: &str| resolve(&m, given, JOB, key).map(|e| e.map(|(k, _)| k.clone()));
        assert_eq!(found("web").unwrap().as_deref(), Some("web"));
        assert_eq!(found("wo").unwrap().as_deref(), Some("worker"));
        assert_eq!(found("web-").unwrap().as_deref(), Some("web-2"));
        assert_eq!(found("x").unwrap(), None);
        assert_eq!(found("").unwrap(), None);
        let e = found("w").unwrap_err().to_string();
        assert!(
            e.contains("job ID prefix \"w\" matches 3 jobs: \"web\", \"web-2\", \"worker\""),
            "{e}"
        );
    }

    #[test]
    fn an_ambiguous_prefix_lists_ten_matches_and_counts_the_rest() {
        let keys: Vec<String> = (0..25).map(|i| format!("a{i:02}")).collect();
        let m = map(&keys.iter().map(String::as_str).collect::<Vec<_>>());
        let e = resolve(&m, "a", ALLOC, key).unwrap_err().to_string();
        assert!(e.contains("matches 25 allocs: \"a00\", \"a01\","), "{e}");
        assert!(e.contains("\"a09\", and 15 more"), "{e}");
        assert!(!e.contains("a10"), "{e}");
    }
}
