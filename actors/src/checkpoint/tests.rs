use super::*;

fn manifest(version: u64) -> Manifest {
    Manifest {
        format: FORMAT,
        version,
        steps: version,
        trained_groups: 4 * version,
        replay: ReplayMark {
            admitted_total: 5 * version,
            consumed_total: 4 * version,
            policy_version: version,
        },
        sampler: None,
        knobs: None,
        reason: "request".into(),
        written_unix_seconds: unix_now(),
        files: BTreeMap::new(),
    }
}

#[test]
fn a_commit_replaces_the_previous_checkpoint_atomically() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
    assert!(dir.load().unwrap().is_none());
    let staging = dir.begin().unwrap();
    std::fs::create_dir_all(staging.join(TRAINER_DIR)).unwrap();
    std::fs::write(staging.join(TRAINER_DIR).join("w"), "1").unwrap();
    dir.commit(&manifest(1)).unwrap();
    let (root, m) = dir.load().unwrap().unwrap();
    assert_eq!(m.version, 1);
    assert_eq!(
        std::fs::read_to_string(root.join(TRAINER_DIR).join("w")).unwrap(),
        "1"
    );

    // A cut write (staging left behind) does not disturb the committed checkpoint.
    let staging = dir.begin().unwrap();
    std::fs::write(staging.join("junk"), "x").unwrap();
    assert_eq!(dir.load().unwrap().unwrap().1.version, 1);
    dir.begin().unwrap();
    dir.commit(&manifest(2)).unwrap();
    let (root, m) = dir.load().unwrap().unwrap();
    assert_eq!(m.version, 2);
    assert!(!root.join(TRAINER_DIR).exists(), "the old files are gone");
    assert!(!tmp.path().join("checkpoint.old").exists());
    assert!(!tmp.path().join("checkpoint.partial").exists());
}

/// Each file is summed as the write commits; one that changed after (a flipped byte, a
/// cut copy, a removal) is refused by name, and a manifest without sums (an older
/// checkpoint) loads unchecked.
#[test]
fn a_file_changed_since_the_write_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
    let staging = dir.begin().unwrap();
    std::fs::create_dir_all(staging.join("trainer/model")).unwrap();
    std::fs::write(staging.join("trainer/model/w.safetensors"), [7u8; 3000]).unwrap();
    std::fs::write(staging.join("trainer/state.json"), "{}").unwrap();
    let written = dir.commit(&manifest(1)).unwrap();
    assert_eq!(
        written.files.keys().collect::<Vec<_>>(),
        ["trainer/model/w.safetensors", "trainer/state.json"]
    );
    assert_eq!(written.files["trainer/model/w.safetensors"].bytes, 3000);
    let (root, m) = dir.load().unwrap().unwrap();
    // (Not the whole manifest: its f64 time need not survive JSON to the last bit.)
    assert_eq!(m.files, written.files);

    let weights = root.join("trainer/model/w.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    bytes[1500] ^= 0x10;
    std::fs::write(&weights, &bytes).unwrap();
    let err = dir.load().unwrap_err();
    assert_eq!(err.kind(), "checkpoint_changed");
    let text = err.to_string();
    assert!(
        text.contains("w.safetensors: 3000 bytes with CRC-32")
            && text.contains("where the manifest recorded 3000 bytes"),
        "{text}"
    );
    bytes[1500] ^= 0x10;
    std::fs::write(&weights, &bytes[..2000]).unwrap();
    let text = dir.load().unwrap_err().to_string();
    assert!(text.contains("2000 bytes with CRC-32"), "{text}");
    std::fs::remove_file(&weights).unwrap();
    let text = dir.load().unwrap_err().to_string();
    assert!(text.contains("w.safetensors: missing"), "{text}");

    // A manifest from before the sums: nothing to check.
    let mut old: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join(MANIFEST)).unwrap()).unwrap();
    old.as_object_mut().unwrap().remove("files");
    std::fs::write(root.join(MANIFEST), old.to_string()).unwrap();
    assert!(dir.load().unwrap().is_some());
}

#[test]
fn a_rename_cut_in_between_falls_back_to_the_previous_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
    dir.begin().unwrap();
    dir.commit(&manifest(3)).unwrap();
    // As if the process died after moving the old one aside.
    std::fs::rename(
        tmp.path().join("checkpoint"),
        tmp.path().join("checkpoint.old"),
    )
    .unwrap();
    assert_eq!(dir.load().unwrap().unwrap().1.version, 3);
}

#[test]
fn a_corrupt_manifest_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("checkpoint");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join(MANIFEST), "{").unwrap();
    let err = CheckpointDir::new(&root).load().unwrap_err();
    assert_eq!(err.kind(), "checkpoint_corrupt");
    assert!(err.to_string().contains("manifest.json"), "{err}");
}

#[test]
fn a_trainer_checkpoint_without_its_manifest_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
    dir.begin().unwrap();
    dir.commit(&manifest(2)).unwrap();
    std::fs::create_dir_all(dir.root().join(TRAINER_DIR)).unwrap();
    std::fs::remove_file(dir.root().join(MANIFEST)).unwrap();
    let err = dir.load().unwrap_err();
    assert_eq!(err.kind(), "checkpoint_incomplete");
    let text = err.to_string();
    for expected in [
        "checkpoint/manifest.json: missing",
        "checkpoint/trainer",
        "remove",
    ] {
        assert!(text.contains(expected), "`{expected}` in {text}");
    }
    // A leftover staging directory beside nothing is no checkpoint at all.
    std::fs::remove_dir_all(dir.root()).unwrap();
    let staging = dir.begin().unwrap();
    std::fs::create_dir_all(staging.join(TRAINER_DIR)).unwrap();
    assert!(dir.load().unwrap().is_none());
}

#[test]
fn manifest_counters_no_run_writes_are_refused_naming_the_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path().join("checkpoint"));
    type Edit = fn(&mut Manifest);
    let cases: [(Edit, &str); 3] = [
        (
            |m| m.steps = 500,
            "`steps` = 500 is more than `trained_groups` = 40",
        ),
        (
            |m| m.trained_groups = u64::MAX,
            "`trained_groups` = 18446744073709551615 is more than `replay.consumed_total` = 40",
        ),
        (
            |m| m.replay.admitted_total = 3,
            "`replay.consumed_total` = 40 is more than `replay.admitted_total` = 3",
        ),
    ];
    for (edit, expected) in cases {
        let mut m = manifest(10);
        dir.begin().unwrap();
        dir.commit(&m).unwrap();
        assert_eq!(dir.load().unwrap().unwrap().1.steps, m.steps);
        edit(&mut m);
        dir.begin().unwrap();
        dir.commit(&m).unwrap();
        let err = dir.load().unwrap_err();
        assert_eq!(err.kind(), "checkpoint_corrupt");
        let text = err.to_string();
        assert!(
            text.contains("manifest.json") && text.contains(expected),
            "{text}"
        );
    }
}
