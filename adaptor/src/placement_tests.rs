#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

const MIB: u64 = 1 << 20;

/// A report with lanes of `capacity` bytes each holding jobs `(P, T)`,
/// `waiting` jobs in the admission queue, at most `max_lanes` lanes, and
/// `largest_free` bytes in no lane.
fn report(
    lanes: &[(u64, &[(u64, u64)])],
    waiting: usize,
    max_lanes: usize,
    free: u64,
) -> StatusReport {
    let lanes_json = serde_json::json!({
        "capacity": lanes.iter().map(|l| l.0).sum::<u64>() + free,
        "alignment": MIB,
        "max_lanes": max_lanes,
        "lanes": lanes.iter().map(|(c, jobs)| {
            let sum_p: u64 = jobs.iter().map(|j| j.0).sum();
            let max_t = jobs.iter().map(|j| j.1).max().unwrap_or(0);
            serde_json::json!({
                "id": 0, "start": 0, "capacity": c, "used": sum_p + max_t,
                "arena_offset": 0, "arena_bytes": max_t,
                "jobs": jobs.iter().map(|j| serde_json::json!({"job": 1, "p": j.0, "t": j.1, "p_offset": 0})).collect::<Vec<_>>(),
            })
        }).collect::<Vec<_>>(),
        "queue": (0..waiting).map(|_| serde_json::json!({"job": 9, "p": 1, "t": 1, "reason": "Memory"})).collect::<Vec<_>>(),
        "free": free,
        "largest_free": free,
        "slack": 0,
        "fragmentation": 0.0,
    });
    StatusReport {
        server: "lanes/test".into(),
        version: 1,
        device: "cpu".into(),
        policy: "fifo".into(),
        memory_bytes: None,
        lanes: None,
        lanes_json: Some(Box::new(lanes_json.to_string())),
        max_lanes: max_lanes as u32,
        workers: 1,
        uptime_ms: 0,
        queued: 0,
        sessions: Vec::new(),
    }
}

fn seen(reports: Vec<Result<StatusReport, String>>) -> Vec<(String, Result<StatusReport, String>)> {
    reports
        .into_iter()
        .enumerate()
        .map(|(i, r)| (format!("tcp://127.0.0.1:{}", 5555 + i), r))
        .collect()
}

fn need(p_mib: u64, t_mib: u64) -> Option<JobSize> {
    Some(JobSize {
        persistent: p_mib * MIB,
        ephemeral: t_mib * MIB,
    })
}

#[test]
fn a_job_goes_where_it_fits() {
    // Service 0: one full lane of 100 MiB, no room for a new lane.
    // Service 1: a lane of 100 MiB with 60 MiB used and a free range of 20.
    let full = report(&[(100 * MIB, &[(60 * MIB, 40 * MIB)])], 0, 1, 0);
    let roomy = report(&[(100 * MIB, &[(40 * MIB, 20 * MIB)])], 0, 4, 20 * MIB);
    let s = seen(vec![Ok(full), Ok(roomy)]);
    // 30 + max(20, 10): 40 + 30 + 20 = 90 <= 100 in service 1's lane.
    let p = choose(&s, need(30, 10)).unwrap();
    assert_eq!(p.index, 1);
    assert!(p.fits_now);
    assert_eq!(p.endpoint, "tcp://127.0.0.1:5556");
}

#[test]
fn the_least_loaded_of_those_where_it_fits_wins() {
    let busy = report(&[(100 * MIB, &[(50 * MIB, 10 * MIB)])], 0, 4, 100 * MIB);
    let idle = report(&[], 0, 4, 200 * MIB);
    let p = choose(&seen(vec![Ok(busy), Ok(idle)]), need(10, 10)).unwrap();
    assert_eq!(p.index, 1);
    assert_eq!(p.load, 0.0);
}

#[test]
fn a_new_lane_needs_a_free_range_and_a_lane_to_spare() {
    // No lane open, 64 MiB free: a 40 + 30 MiB job fits in no new lane.
    let small = report(&[], 0, 4, 64 * MIB);
    // Room, but every lane it may open is open (and full).
    let no_lane_left = report(&[(10 * MIB, &[(5 * MIB, 5 * MIB)])], 0, 1, 500 * MIB);
    let s = seen(vec![Ok(small.clone()), Ok(no_lane_left)]);
    let p = choose(&s, need(40, 30)).unwrap();
    assert!(!p.fits_now, "{p:?}");
    // 40 + 20 = 60 MiB fits the 64 MiB range.
    let p = choose(&seen(vec![Ok(small)]), need(40, 20)).unwrap();
    assert!(p.fits_now);
}

#[test]
fn where_it_fits_nowhere_the_shortest_queue_wins() {
    let long = report(&[(100 * MIB, &[(90 * MIB, 10 * MIB)])], 3, 1, 0);
    let short = report(&[(100 * MIB, &[(90 * MIB, 10 * MIB)])], 1, 1, 0);
    let p = choose(&seen(vec![Ok(long), Ok(short)]), need(50, 50)).unwrap();
    assert_eq!(p.index, 1);
    assert!(!p.fits_now);
    assert_eq!(p.queue, 1);
}

#[test]
fn a_service_with_jobs_waiting_has_no_room() {
    // Room in memory, but a job waits there: the other one wins even busier.
    let waiting = report(&[], 1, 4, 1000 * MIB);
    let busier = report(&[(100 * MIB, &[(50 * MIB, 10 * MIB)])], 0, 4, 100 * MIB);
    let p = choose(&seen(vec![Ok(waiting), Ok(busier)]), need(1, 1)).unwrap();
    assert_eq!(p.index, 1);
}

#[test]
fn ties_go_to_the_earlier_endpoint() {
    let a = report(&[], 0, 4, 100 * MIB);
    let p = choose(&seen(vec![Ok(a.clone()), Ok(a.clone()), Ok(a)]), need(1, 1)).unwrap();
    assert_eq!(p.index, 0);
    // Without a size too.
    let b = report(&[], 0, 4, 100 * MIB);
    assert_eq!(
        choose(&seen(vec![Ok(b.clone()), Ok(b)]), None)
            .unwrap()
            .index,
        0
    );
}

#[test]
fn unreachable_services_are_skipped() {
    let s = seen(vec![
        Err("timed out".into()),
        Ok(report(&[], 0, 4, 100 * MIB)),
    ]);
    let p = choose(&s, need(1, 1)).unwrap();
    assert_eq!(p.index, 1);
}

#[test]
fn when_none_answers_the_error_names_each_endpoint_and_why() {
    let s = seen(vec![
        Err("connection refused".into()),
        Err("timed out".into()),
    ]);
    match choose(&s, None) {
        Err(PlacementError::NoneReachable(why)) => {
            assert_eq!(
                why,
                vec![
                    (
                        "tcp://127.0.0.1:5555".to_string(),
                        "connection refused".to_string()
                    ),
                    ("tcp://127.0.0.1:5556".to_string(), "timed out".to_string()),
                ]
            );
            let text = PlacementError::NoneReachable(why).to_string();
            assert!(text.contains("tcp://127.0.0.1:5556 (timed out)"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(choose(&[], None), Err(PlacementError::NoEndpoints));
}

#[test]
fn a_service_without_lanes_takes_any_job() {
    let mut none = report(&[], 0, 4, 0);
    none.lanes_json = None;
    let full = report(&[(100 * MIB, &[(90 * MIB, 10 * MIB)])], 0, 1, 0);
    let p = choose(&seen(vec![Ok(full), Ok(none)]), need(10, 10)).unwrap();
    assert_eq!(p.index, 1);
    assert!(p.fits_now);
}

#[test]
fn a_directory_round_trips_and_lists_running_services() {
    let d = Directory {
        services: vec![
            ServiceEntry {
                index: 0,
                device: "cpu".into(),
                endpoint: "tcp://127.0.0.1:6000".into(),
                metrics: None,
                pid: Some(1),
                running: false,
            },
            ServiceEntry {
                index: 1,
                device: "cpu".into(),
                endpoint: "tcp://127.0.0.1:6001".into(),
                metrics: Some("127.0.0.1:9101".into()),
                pid: Some(2),
                running: true,
            },
        ],
    };
    let dir = std::env::temp_dir().join(format!("lanes-dir-{}.json", std::process::id()));
    std::fs::write(&dir, serde_json::to_string(&d).unwrap()).unwrap();
    let back = Directory::read(&dir).unwrap();
    std::fs::remove_file(&dir).ok();
    assert_eq!(back, d);
    assert_eq!(back.endpoints(), vec!["tcp://127.0.0.1:6001".to_string()]);
    match Directory::read(Path::new("/nonexistent/lanes-dir.json")) {
        Err(PlacementError::Directory { path, .. }) => assert!(path.contains("nonexistent")),
        other => panic!("{other:?}"),
    }
}
