//! The volume mounts hook alone, with real bind mounts of a temp dir.

// Test code: an unwrap that fails fails the test, with the value.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use berth_allocrunner::task_hooks::VolumeMountsHook;
use berth_csimanager::MountInfo;
use berth_structs::VolumeMount;
use common::{mounts_under, MountCleanup};

fn mount(volume: &str, destination: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        volume: volume.into(),
        destination: destination.into(),
        read_only,
        ..Default::default()
    }
}

#[test]
fn read_only_destination_prevents_writes_and_unmount_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let _cleanup = MountCleanup(root.clone());
    let source = root.join("volume");
    let task_dir = root.join("task");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::create_dir_all(&task_dir).unwrap();
    std::fs::write(source.join("existing"), "data").unwrap();
    let mounts = BTreeMap::from([(
        "vol".to_string(),
        MountInfo {
            source: source.clone(),
            read_only: false,
        },
    )]);

    let mut hook = VolumeMountsHook::default();
    hook.mount_all(
        &task_dir,
        &[mount("vol", "rw", false), mount("vol", "nested/ro", true)],
        &mounts,
    )
    .expect("mount");
    assert_eq!(
        hook.mounted(),
        &[task_dir.join("rw"), task_dir.join("nested/ro")]
    );

    // Writable through the read-write mount, visible in the source.
    std::fs::write(task_dir.join("rw/new"), "x").expect("write through rw mount");
    assert!(source.join("new").exists());
    // Readable but not writable through the read-only one.
    assert_eq!(
        std::fs::read_to_string(task_dir.join("nested/ro/existing")).unwrap(),
        "data"
    );
    let err = std::fs::write(task_dir.join("nested/ro/denied"), "x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    assert!(!source.join("denied").exists());

    // Mounting again (a task restart) is a no-op.
    hook.mount_all(&task_dir, &[mount("vol", "rw", false)], &mounts)
        .unwrap();
    assert_eq!(mounts_under(&task_dir).len(), 2);

    hook.unmount_all().expect("unmount");
    assert!(hook.mounted().is_empty());
    assert!(mounts_under(&task_dir).is_empty());
    assert!(source.join("existing").exists(), "the source is untouched");
}

#[test]
fn a_volume_the_alloc_did_not_mount_or_an_escaping_destination_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let _cleanup = MountCleanup(root.clone());
    let mut hook = VolumeMountsHook::default();
    let err = hook
        .mount_all(&root, &[mount("missing", "data", false)], &BTreeMap::new())
        .unwrap_err();
    assert!(
        err.to_string().contains("not mounted for this alloc"),
        "{err}"
    );
    let mounts = BTreeMap::from([(
        "vol".to_string(),
        MountInfo {
            source: root.clone(),
            read_only: false,
        },
    )]);
    let err = hook
        .mount_all(&root, &[mount("vol", "../outside", false)], &mounts)
        .unwrap_err();
    assert!(err.to_string().contains("escapes"), "{err}");
    assert!(mounts_under(&root).is_empty());
}
