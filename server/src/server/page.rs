//! Pages of the ID-keyed tables: a list read takes its page by key range
//! under the read lock, so that it copies the items it answers with, not
//! the whole table.

use std::collections::BTreeMap;
use std::ops::Bound;

use berth_structs::{Allocation, Job, Node};

use crate::server::Server;

/// Which part of a list, in ID order, a read wants (Nomad's `prefix`,
/// `next_token` and `per_page`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Page<'a> {
    /// Only the IDs that start with this.
    pub prefix: &'a str,
    /// The first ID of the page (the next token of the page before).
    pub start: &'a str,
    /// At most this many (`None`: all).
    pub limit: Option<usize>,
}

/// A page of a list, and the ID the next page starts at when more remain.
pub type Paged<T> = (Vec<T>, Option<String>);

impl Page<'_> {
    /// The page of `map` (by key), each entry as `view` shows it.
    pub(crate) fn of<'m, V, T>(
        &self,
        map: &'m BTreeMap<String, V>,
        mut view: impl FnMut(&'m V) -> T,
    ) -> Paged<T> {
        // Every ID that starts with the prefix sorts at or after it.
        let from = self.start.max(self.prefix);
        let mut rest = map
            .range::<str, _>((Bound::Included(from), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(self.prefix));
        let page = rest
            .by_ref()
            .take(self.limit.unwrap_or(usize::MAX))
            .map(|(_, v)| view(v))
            .collect();
        let next = rest.next().map(|(k, _)| k.clone());
        (page, next)
    }
}

impl Server {
    /// A page of the jobs.
    pub fn jobs_page(&self, page: Page<'_>) -> Paged<Job> {
        self.store.read(|t| page.of(&t.jobs, Job::clone))
    }

    /// A page of the allocs.
    pub fn allocations_page(&self, page: Page<'_>) -> Paged<Allocation> {
        self.store.read(|t| page.of(&t.allocs, Allocation::clone))
    }

    /// A page of the nodes, each with its live heartbeat.
    pub fn nodes_page(&self, page: Page<'_>) -> Paged<Node> {
        let (nodes, next) = self.store.read(|t| page.of(&t.nodes, Node::clone));
        let nodes = nodes
            .into_iter()
            .map(|n| self.liveness.with_live_heartbeat(n))
            .collect();
        (nodes, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(keys: &[&str]) -> BTreeMap<String, String> {
        keys.iter()
            .map(|k| (k.to_string(), k.to_string()))
            .collect()
    }

    fn walk(m: &BTreeMap<String, String>, prefix: &str, per: usize) -> Vec<Vec<String>> {
        let mut pages = Vec::new();
        let mut start = String::new();
        loop {
            let page = Page {
                prefix,
                start: &start,
                limit: Some(per),
            };
            let (items, next) = page.of(m, String::clone);
            pages.push(items);
            match next {
                Some(n) => start = n,
                None => return pages,
            }
        }
    }

    #[test]
    fn pages_walk_the_ids_in_order_once_each() {
        let m = map(&["a1", "a2", "a3", "b1", "b2"]);
        assert_eq!(
            walk(&m, "", 2),
            [vec!["a1", "a2"], vec!["a3", "b1"], vec!["b2"]]
        );
        assert_eq!(walk(&m, "a", 2), [vec!["a1", "a2"], vec!["a3"]]);
        assert_eq!(walk(&m, "a", 3), [vec!["a1", "a2", "a3"]]);
        assert_eq!(walk(&m, "b", 5), [vec!["b1", "b2"]]);
        assert_eq!(walk(&m, "c", 5), [Vec::<String>::new()]);
        let all = Page::default().of(&m, String::clone);
        assert_eq!(
            all,
            (
                vec!["a1", "a2", "a3", "b1", "b2"]
                    .into_iter()
                    .map(String::from)
                    .collect(),
                None
            )
        );
    }

    /// An item added or removed between two pages does not make the walk
    /// skip or repeat any other: the next page starts at the ID the token
    /// names, whether that item is still there or not.
    #[test]
    fn items_added_and_removed_between_pages_skip_and_repeat_nothing_else() {
        let mut m = map(&["a", "c", "e", "g"]);
        let first = Page {
            limit: Some(2),
            ..Page::default()
        };
        let (p1, next) = first.of(&m, String::clone);
        assert_eq!(p1, ["a", "c"]);
        let next = next.expect("more");
        assert_eq!(next, "e");
        // The token's item goes, one is added before the cursor and one after.
        m.remove("e");
        m.insert("b".into(), "b".into());
        m.insert("f".into(), "f".into());
        let (p2, next) = Page {
            start: &next,
            limit: Some(2),
            ..Page::default()
        }
        .of(&m, String::clone);
        assert_eq!(p2, ["f", "g"]);
        assert_eq!(next, None);
    }

    /// A start before the prefix begins at the prefix; one after it ends
    /// within it.
    #[test]
    fn a_start_and_a_prefix_together() {
        let m = map(&["a1", "b1", "b2", "b3", "c1"]);
        let p = |start| {
            Page {
                prefix: "b",
                start,
                limit: None,
            }
            .of(&m, String::clone)
            .0
        };
        assert_eq!(p("a"), ["b1", "b2", "b3"]);
        assert_eq!(p("b2"), ["b2", "b3"]);
        assert!(p("c").is_empty());
    }
}
