//! Who a task may run as: the user a task names (`user`), resolved on
//! the node, against the uids and gids the node's config denies to each
//! driver (`denied_host_uids`, `denied_host_gids`, Nomad's names and
//! range syntax: `"0,10-20"`). `exec` denies uid 0 unless told otherwise:
//! an isolated task must not be root.

use std::fmt;
use std::str::FromStr;

/// Ids as inclusive ranges, written `"0,10-20"`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdRanges(Vec<(u32, u32)>);

impl IdRanges {
    pub fn contains(&self, id: u32) -> bool {
        self.0.iter().any(|(lo, hi)| (*lo..=*hi).contains(&id))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromStr for IdRanges {
    type Err = String;

    fn from_str(s: &str) -> Result<IdRanges, String> {
        let id = |v: &str| {
            v.trim()
                .parse::<u32>()
                .map_err(|_| format!("{v:?} in {s:?} is not a uid or gid"))
        };
        let mut ranges = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (lo, hi) = match part.split_once('-') {
                Some((lo, hi)) => (id(lo)?, id(hi)?),
                None => (id(part)?, id(part)?),
            };
            if lo > hi {
                return Err(format!("range {part:?} in {s:?} ends before it starts"));
            }
            ranges.push((lo, hi));
        }
        Ok(IdRanges(ranges))
    }
}

impl fmt::Display for IdRanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(lo, hi)| {
                if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}-{hi}")
                }
            })
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// The uids and gids a driver's tasks may not run as.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeniedIds {
    pub uids: IdRanges,
    pub gids: IdRanges,
}

impl DeniedIds {
    /// `exec`'s default: not root.
    pub fn not_root() -> DeniedIds {
        DeniedIds {
            uids: IdRanges(vec![(0, 0)]),
            gids: IdRanges::default(),
        }
    }

    /// Why `user` (uid `uid`, primary gid `gid`) may not run a task of
    /// `driver`, if it may not.
    pub fn check(&self, driver: &str, user: &str, uid: u32, gid: u32) -> Result<(), String> {
        if self.uids.contains(uid) {
            return Err(format!(
                "{driver} tasks may not run as user {user:?} (uid {uid}): this node denies uids {}",
                self.uids
            ));
        }
        if self.gids.contains(gid) {
            return Err(format!(
                "{driver} tasks may not run as user {user:?} (gid {gid}): this node denies gids {}",
                self.gids
            ));
        }
        Ok(())
    }
}

/// The uid and gid of `user`, whom a `driver` task of `command` may run
/// as: refused when the node has no such user or denies it.
pub(crate) fn allowed(
    driver: &str,
    user: &str,
    denied: &DeniedIds,
    command: &str,
) -> Result<(u32, u32), crate::error::DriverError> {
    let refused = |why: String| crate::error::DriverError::refused(command, why);
    let (uid, gid) = crate::isolation::resolve_user(user).map_err(refused)?;
    denied.check(driver, user, uid, gid).map_err(refused)?;
    Ok((uid, gid))
}

/// The uid and gid the task runs as: its `user`'s (whose own dirs
/// become its), or None for the agent's; refused when the node denies
/// them. A task the `exec` driver isolates was checked there.
pub(crate) fn run_as(
    spec: &crate::driver::TaskSpec,
    denied: &DeniedIds,
) -> Result<Option<(u32, u32)>, crate::error::DriverError> {
    if spec.isolation.is_some() {
        return Ok(None);
    }
    let refused = |why: String| crate::error::DriverError::refused(&spec.command, why);
    let Some(user) = &spec.user else {
        let (uid, gid) = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        let name = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .ok()
            .flatten()
            .map_or_else(|| uid.to_string(), |u| u.name);
        denied
            .check("raw_exec", &name, uid, gid)
            .map_err(|why| refused(format!("{why}; set the task's user")))?;
        return Ok(None);
    };
    let (uid, gid) = allowed("raw_exec", user, denied, &spec.command)?;
    let alloc_dir = spec.alloc_shared_dir();
    crate::isolation::open_task_dirs_to(&spec.task_dir, &alloc_dir, uid, gid).map_err(refused)?;
    Ok(Some((uid, gid)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_print_and_hold_their_ids() {
        let r: IdRanges = "0, 10-20,65534".parse().expect("ranges");
        assert!(r.contains(0) && r.contains(10) && r.contains(20) && r.contains(65534));
        assert!(!r.contains(1) && !r.contains(21));
        assert_eq!(r.to_string(), "0,10-20,65534");
        assert!("".parse::<IdRanges>().expect("none").is_empty());
        let e = "5-1".parse::<IdRanges>().expect_err("backwards");
        assert!(e.contains("ends before it starts"), "{e}");
        let e = "root".parse::<IdRanges>().expect_err("a name");
        assert!(
            e.contains("\"root\" in \"root\" is not a uid or gid"),
            "{e}"
        );
    }

    #[test]
    fn a_denied_uid_or_gid_is_refused_naming_the_user_and_the_ranges() {
        let denied = DeniedIds::not_root();
        let e = denied.check("exec", "root", 0, 0).expect_err("root");
        assert_eq!(
            e,
            "exec tasks may not run as user \"root\" (uid 0): this node denies uids 0"
        );
        assert_eq!(denied.check("exec", "nobody", 65534, 65534), Ok(()));
        let gids = DeniedIds {
            uids: IdRanges::default(),
            gids: "100-200".parse().expect("gids"),
        };
        let e = gids.check("raw_exec", "web", 1000, 150).expect_err("gid");
        assert!(
            e.contains("(gid 150): this node denies gids 100-200"),
            "{e}"
        );
    }
}
