//! `lanes trace import`'s library side on the small tables in
//! `tests/data/import/`: column mappings from TOML and from `field=column`,
//! units, GPU filtering, durations turned into iterations through the
//! model profiles, and one typed error per kind of bad line.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use lanes::sim::{
    import_jobs, read_profiles, read_trace, write_trace, ImportError, Mapping, Profile, TraceJob,
};
use lanes_policies::JobKind;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/import")
        .join(name)
}

fn text(name: &str) -> String {
    std::fs::read_to_string(data(name)).unwrap()
}

fn profiles() -> HashMap<String, Profile> {
    read_profiles(text("profiles.csv").as_bytes()).unwrap()
}

fn mapping() -> Mapping {
    Mapping::from_toml(&text("mapping.toml")).unwrap()
}

fn import(
    table: &str,
    m: &Mapping,
) -> Result<(Vec<TraceJob>, lanes::sim::ImportStats), ImportError> {
    import_jobs(table.as_bytes(), m, &profiles())
}

#[test]
fn a_mapped_table_becomes_a_trace_of_single_gpu_jobs() {
    let (jobs, stats) = import(&text("jobs_numeric.csv"), &mapping()).unwrap();
    assert_eq!(
        (stats.read, stats.kept, stats.multi_gpu, stats.no_gpu),
        (6, 4, 1, 1)
    );
    let ids: Vec<u64> = jobs.iter().map(|j| j.id).collect();
    assert_eq!(ids, vec![17, 22, 99, 63]);
    // Submission times shifted so the first is 0.
    let submits: Vec<Duration> = jobs.iter().map(|j| j.submit).collect();
    let s = Duration::from_secs;
    assert_eq!(submits, vec![s(0), s(30), s(90), s(150)]);
    // 10 min of resnet50 at 100 ms: 6000 iterations, with its P and T.
    assert_eq!(jobs[0].iterations, 6000);
    assert_eq!(jobs[0].iteration, Duration::from_millis(100));
    assert_eq!(
        (jobs[0].persistent_bytes, jobs[0].ephemeral_bytes),
        (204_800_000, 3_000_000_000)
    );
    assert_eq!(jobs[0].kind, JobKind::Training);
    // 0.5 min of bert_infer at 8 ms: 3750 iterations, an inference job of
    // priority 2 (the [kinds] table maps "serve").
    assert_eq!(
        (jobs[1].iterations, jobs[1].kind, jobs[1].priority),
        (3750, JobKind::Inference, 2)
    );
    // An empty model cell takes the default model: 1 min at 20 ms.
    assert_eq!(
        (jobs[3].iterations, jobs[3].iteration),
        (3000, Duration::from_millis(20))
    );
    // The result reads back as a Lanes trace.
    let mut buf = Vec::new();
    write_trace(&mut buf, &jobs).unwrap();
    assert_eq!(read_trace(buf.as_slice()).unwrap(), jobs);
}

#[test]
fn command_line_assignments_override_and_memory_splits_in_the_profile_ratio() {
    let mut m = mapping();
    m.set("memory=gpu_mem_mib").unwrap();
    m.set("id=job").unwrap();
    let (jobs, _) = import(&text("jobs_numeric.csv"), &m).unwrap();
    let d99 = jobs.iter().find(|j| j.id == 99).unwrap();
    // 2048 MiB split 90 : 300 (resnet18_cifar's P : T).
    let total = 2048u64 << 20;
    assert_eq!(d99.persistent_bytes + d99.ephemeral_bytes, total);
    let expect_p = (total as f64 * 90.0 / 390.0).round() as u64;
    assert_eq!(d99.persistent_bytes, expect_p);
    // An empty memory cell keeps the profile's P and T.
    let j17 = jobs.iter().find(|j| j.id == 17).unwrap();
    assert_eq!(j17.persistent_bytes, 204_800_000);

    // Without an id column, jobs are numbered in table order (counting the
    // ones left out) and string ids are not needed.
    let mut m = Mapping::default();
    for a in [
        "submit=submitted",
        "duration=runtime_min",
        "gpus=num_gpu",
        "kind=task",
        "model=model",
    ] {
        m.set(a).unwrap();
    }
    m.units.duration = "min".parse().unwrap();
    m.kinds.insert("train".into(), "training".into());
    m.kinds.insert("serve".into(), "inference".into());
    m.model = Some("resnet50".into());
    let (jobs, _) = import(&text("jobs.csv"), &m).unwrap();
    assert_eq!(
        jobs.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![1, 2, 4, 6]
    );
    // f63 has no model: the default resnet50, 1 min at 100 ms.
    assert_eq!(jobs[3].iterations, 600);
}

fn field_error(err: ImportError) -> (u64, String, String) {
    match err {
        ImportError::Field {
            line,
            column,
            reason,
            ..
        } => (line, column, reason),
        other => panic!("expected a field error, got {other}"),
    }
}

#[test]
fn every_bad_line_is_refused_with_its_line_and_column() {
    let (line, column, reason) =
        field_error(import(&text("bad_jobs.csv"), &mapping()).unwrap_err());
    assert_eq!((line, column.as_str()), (3, "submitted"));
    assert!(reason.contains("soon"), "{reason}");

    let header = "job,submitted,runtime_min,num_gpu,gpu_mem_mib,task,prio,model";
    let good = "1,0,1,1,,train,0,resnet50";
    let cases = [
        ("2,0,-3,1,,train,0,resnet50", "runtime_min", "non-negative"),
        ("2,0,1,1.5,,train,0,resnet50", "num_gpu", "whole"),
        ("2,0,1,1,,gaming,0,resnet50", "task", "gaming"),
        ("2,0,1,1,,train,high,resnet50", "prio", "high"),
        ("2,0,1,1,,train,0,vgg19", "model", "vgg19"),
        ("1,0,1,1,,train,0,resnet50", "job", "twice"),
        ("x,0,1,1,,train,0,resnet50", "job", "\"x\""),
        ("2,0,NaN,1,,train,0,resnet50", "runtime_min", "NaN"),
        ("2,0,1,1,lots,train,0,resnet50", "gpu_mem_mib", "lots"),
        ("2,0,1e12,1,,train,0,resnet50", "runtime_min", "too long"),
    ];
    let mut m = mapping();
    m.set("memory=gpu_mem_mib").unwrap();
    for (bad, col, why) in cases {
        let table = format!("{header}\n{good}\n{bad}\n");
        let (line, column, reason) = field_error(import(&table, &m).unwrap_err());
        assert_eq!((line, column.as_str()), (3, col), "{bad}: {reason}");
        assert!(reason.contains(why), "{bad}: {reason}");
    }
    // A line with the wrong number of fields.
    let table = format!("{header}\n{good}\n2,0,1\n");
    assert!(matches!(
        import(&table, &m),
        Err(ImportError::Syntax { line: 3, .. })
    ));
    // A mapped column the table does not have.
    let mut m2 = mapping();
    m2.set("gpus=gpu_count").unwrap();
    assert!(matches!(
        import(&text("jobs_numeric.csv"), &m2),
        Err(ImportError::MissingColumn { field: "gpus", .. })
    ));
    // Every job filtered out.
    let table = format!("{header}\n1,0,1,4,,train,0,resnet50\n");
    assert!(matches!(
        import(&table, &m),
        Err(ImportError::Empty { read: 1 })
    ));
}

#[test]
fn bad_mappings_and_profiles_are_refused() {
    assert!(Mapping::from_toml("[columns]\nsubmitt = \"x\"\n").is_err());
    assert!(Mapping::from_toml("[units]\nsubmit = \"fortnight\"\n").is_err());
    assert!(Mapping::default().set("colour=red").is_err());
    assert!(Mapping::default().set("no equals sign").is_err());
    let mut both = mapping();
    both.set("iterations=prio").unwrap();
    assert!(matches!(
        import(&text("jobs_numeric.csv"), &both),
        Err(ImportError::Mapping { .. })
    ));
    let mut bad_kind = mapping();
    bad_kind.kinds.insert("x".into(), "gaming".into());
    assert!(matches!(
        import(&text("jobs_numeric.csv"), &bad_kind),
        Err(ImportError::Mapping { .. })
    ));

    let h = "model,iter_ms,persistent_bytes,ephemeral_bytes";
    for (bad, col) in [
        ("m,0,1,1", "iter_ms"),
        ("m,fast,1,1", "iter_ms"),
        ("m,1,-1,1", "persistent_bytes"),
        (",1,1,1", "model"),
    ] {
        match read_profiles(format!("{h}\n{bad}\n").as_bytes()) {
            Err(ImportError::Field {
                line: 2, column, ..
            }) => assert_eq!(column, col, "{bad}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    assert!(matches!(
        read_profiles(format!("{h}\nm,1,1,1\nm,2,1,1\n").as_bytes()),
        Err(ImportError::Field { line: 3, .. })
    ));
    assert!(matches!(
        read_profiles("a,b\n".as_bytes()),
        Err(ImportError::Mapping { .. })
    ));
}
