use super::*;
use crate::lanes::Reservation;

fn mgr(capacity: u64, max_lanes: usize) -> LaneManager {
    LaneManager::new(LanesConfig {
        capacity,
        alignment: 1,
        max_lanes,
    })
    .unwrap()
}

fn admitted(a: Admission) -> (Placement, Vec<Move>) {
    match a {
        Admission::Admitted { placement, moves } => (placement, moves),
        Admission::Queued { reason, .. } => panic!("queued: {reason}"),
    }
}

#[test]
fn first_job_opens_an_exact_lane() {
    let mut m = mgr(100, 4);
    let (p, moves) = admitted(m.admit(JobId(1), 10, 20).unwrap());
    assert!(moves.is_empty());
    assert_eq!(
        (p.p_offset, p.p_bytes, p.arena_offset, p.arena_bytes),
        (0, 10, 10, 20)
    );
    let s = m.snapshot();
    assert_eq!(s.lanes.len(), 1);
    assert_eq!((s.lanes[0].capacity, s.lanes[0].used), (30, 30));
    assert_eq!((s.free, s.largest_free, s.slack), (70, 70, 0));
}

#[test]
fn sizes_are_aligned() {
    let mut m = LaneManager::new(LanesConfig::new(1 << 20)).unwrap();
    let (p, _) = admitted(m.admit(JobId(1), 1, 257).unwrap());
    assert_eq!((p.p_bytes, p.arena_bytes), (256, 512));
    admitted(m.admit(JobId(2), 0, 0).unwrap());
    let s = m.snapshot();
    let j2 = s
        .lanes
        .iter()
        .flat_map(|l| &l.jobs)
        .find(|j| j.job == JobId(2))
        .unwrap();
    assert_eq!((j2.p, j2.t), (0, 256), "a job takes at least one granule");
}

#[test]
fn too_large_names_needed_and_available() {
    let mut m = mgr(100, 4);
    let e = m.admit(JobId(5), 60, 41).unwrap_err();
    assert_eq!(
        e,
        AdmitError::TooLarge {
            job: JobId(5),
            needed: 101,
            available: 100
        }
    );
    assert!(e.to_string().contains("101") && e.to_string().contains("100"));
    assert_eq!(e.kind(), "too_large");
    assert!(m.admit(JobId(6), u64::MAX, 1).is_err());
    assert!(m.snapshot().queue.is_empty());
}

#[test]
fn duplicate_and_unknown_jobs() {
    let mut m = mgr(100, 4);
    m.admit(JobId(1), 10, 10).unwrap();
    assert_eq!(
        m.admit(JobId(1), 1, 1).unwrap_err(),
        AdmitError::Duplicate { job: JobId(1) }
    );
    assert_eq!(
        m.release(JobId(2)).unwrap_err(),
        AdmitError::Unknown { job: JobId(2) }
    );
    assert!(LaneManager::new(LanesConfig {
        capacity: 1,
        alignment: 3,
        max_lanes: 1
    })
    .is_err());
    assert!(LaneManager::new(LanesConfig::new(u64::MAX)).is_err());
}

#[test]
fn release_admits_the_waiting_job_into_the_best_fitting_range() {
    let mut m = mgr(1000, 8);
    admitted(m.admit(JobId(1), 100, 100).unwrap()); // [0,200)
    admitted(m.admit(JobId(2), 100, 300).unwrap()); // [200,600)
    admitted(m.admit(JobId(3), 100, 300).unwrap()); // [600,1000)
                                                    // No free byte at all: the next job waits.
    let a = m.admit(JobId(4), 10, 10).unwrap();
    assert!(matches!(a, Admission::Queued { position: 0, .. }));
    let r = m.release(JobId(1)).unwrap();
    assert_eq!(r.closed.len(), 1);
    assert_eq!(r.admitted.len(), 1);
    assert_eq!(r.admitted[0].job, JobId(4));
    assert_eq!(r.admitted[0].p_offset, 0);
    assert!(m.snapshot().queue.is_empty());
    // Two free ranges, [20,200) and [600,1000) after job 3 leaves: a
    // 150-byte lane goes in the smaller one that holds it.
    m.release(JobId(3)).unwrap();
    let (p, _) = admitted(m.admit(JobId(5), 50, 100).unwrap());
    assert_eq!(p.p_offset, 20);
}

#[test]
fn joins_the_best_fitting_lane_with_room() {
    let mut m = mgr(1000, 8);
    admitted(m.admit(JobId(1), 100, 300).unwrap()); // A [0,400)
    admitted(m.admit(JobId(2), 100, 100).unwrap()); // B [400,600)
    admitted(m.admit(JobId(5), 300, 100).unwrap()); // C [600,1000)
    m.release(JobId(5)).unwrap(); // C closes: [600,1000) free
                                  // 500 bytes: no free range holds it; B grows into [600,1000).
    let (p3, moves) = admitted(m.admit(JobId(3), 100, 400).unwrap());
    assert!(moves.is_empty());
    let b = m.placement(JobId(2)).unwrap().lane;
    assert_eq!(p3.lane, b);
    m.release(JobId(3)).unwrap(); // B keeps capacity 600 for job 2's 200: slack 400
    let s = m.snapshot();
    assert_eq!((s.slack, s.free, s.largest_free), (400, 0, 0));
    // P=50, T=250 fits in B as it is (leftover 100), not in A (needs 450 > 400).
    let (p4, moves) = admitted(m.admit(JobId(4), 50, 250).unwrap());
    assert!(moves.is_empty());
    assert_eq!(p4.lane, b);
    assert_eq!(
        (p4.p_offset, p4.arena_offset, p4.arena_bytes),
        (500, 550, 250)
    );
    let lane = m.snapshot().lanes.into_iter().find(|l| l.id == b).unwrap();
    assert_eq!((lane.used, lane.capacity, lane.jobs.len()), (400, 600, 2));
}

#[test]
fn grows_a_lane_into_free_space_when_lanes_are_capped() {
    let mut m = mgr(1000, 1);
    let (a, _) = admitted(m.admit(JobId(1), 100, 200).unwrap());
    let (b, moves) = admitted(m.admit(JobId(2), 100, 100).unwrap());
    assert!(moves.is_empty());
    assert_eq!(a.lane, b.lane);
    assert_eq!(b.p_offset, 100);
    assert_eq!((b.arena_offset, b.arena_bytes), (200, 200));
    let s = m.snapshot();
    assert_eq!((s.lanes.len(), s.lanes[0].capacity), (1, 400));
    // A job that needs more growth than is free waits, with the reason.
    let q = m.admit(JobId(3), 500, 400).unwrap();
    let Admission::Queued { reason, .. } = q else {
        panic!("{q:?}")
    };
    assert!(reason.lanes_full);
    assert_eq!(reason.free_after_repartition, 600);
    assert_eq!(reason.cheapest, 700); // 500 + (400 - 200)
    assert!(m.snapshot().to_string().contains("queue: 1 waiting"));
    // Job 1 leaves: job 2's P slides down; job 3 then fits by growth.
    let r = m.release(JobId(1)).unwrap();
    assert_eq!(
        r.moves[0],
        Move {
            job: JobId(2),
            lane: a.lane,
            from: 100,
            to: 0,
            bytes: 100
        }
    );
    assert_eq!(r.admitted.len(), 1);
    assert_eq!(m.placement(JobId(3)).unwrap().lane, a.lane);
}

#[test]
fn repartitioning_defragments_and_keeps_data() {
    // Ten lanes of 100; free every other one: 500 free in five pieces.
    let mut m = mgr(1000, 16);
    let mut mem = Reservation::new(1000).unwrap();
    for j in 0..10u64 {
        let (p, _) = admitted(m.admit(JobId(j), 40, 60).unwrap());
        mem.region_mut(p.p_offset, p.p_bytes)
            .unwrap()
            .fill(j as u8 + 1);
    }
    for j in [1u64, 3, 5, 7, 9] {
        let r = m.release(JobId(j)).unwrap();
        assert!(r.moves.is_empty());
    }
    let s = m.snapshot();
    assert_eq!((s.free, s.largest_free), (500, 100));
    assert!(s.fragmentation > 0.7);
    // 300 bytes in one lane only fit after re-partitioning.
    let (p, moves) = admitted(m.admit(JobId(20), 100, 200).unwrap());
    assert!(!moves.is_empty());
    mem.apply_moves(&moves).unwrap();
    for j in [0u64, 2, 4, 6, 8] {
        let pl = m.placement(JobId(j)).unwrap();
        assert!(
            mem.region(pl.p_offset, pl.p_bytes)
                .unwrap()
                .iter()
                .all(|&b| b == j as u8 + 1),
            "job {j} lost its persistent bytes"
        );
    }
    assert_eq!(p.p_offset, 500);
    let s = m.snapshot();
    assert_eq!((s.free, s.largest_free), (200, 200));
    assert_eq!(s.fragmentation, 0.0);
}

#[test]
fn rightward_moves_are_ordered_safely() {
    // Capped at 2 lanes: growing the first lane pushes the second right.
    let mut m = mgr(1200, 2);
    let mut mem = Reservation::new(1200).unwrap();
    admitted(m.admit(JobId(1), 100, 300).unwrap()); // A [0,400)
    admitted(m.admit(JobId(2), 100, 100).unwrap()); // B [400,600)
    admitted(m.admit(JobId(3), 300, 100).unwrap()); // B grows to [400,900)
    assert_eq!(m.snapshot().lanes[1].capacity, 500);
    for j in 1..=3u64 {
        let p = m.placement(JobId(j)).unwrap();
        mem.region_mut(p.p_offset, p.p_bytes).unwrap().fill(j as u8);
    }
    // Job 4 costs 250 more in A, 450 in B; only 300 are free, after B:
    // re-partitioning grows A and moves both of B's jobs right.
    let (p4, moves) = admitted(m.admit(JobId(4), 250, 300).unwrap());
    assert_eq!(p4.lane, m.placement(JobId(1)).unwrap().lane);
    assert_eq!(moves.len(), 2);
    assert!(moves.iter().all(|mv| mv.to == mv.from + 250));
    assert!(
        moves[0].from > moves[1].from,
        "rightward moves go highest first"
    );
    mem.apply_moves(&moves).unwrap();
    for j in 1..=3u64 {
        let p = m.placement(JobId(j)).unwrap();
        assert!(mem
            .region(p.p_offset, p.p_bytes)
            .unwrap()
            .iter()
            .all(|&b| b == j as u8));
    }
}

#[test]
fn releasing_a_waiting_job_cancels_it() {
    let mut m = mgr(100, 2);
    m.admit(JobId(1), 50, 50).unwrap();
    assert!(matches!(
        m.admit(JobId(2), 10, 10).unwrap(),
        Admission::Queued { .. }
    ));
    assert!(m.is_queued(JobId(2)));
    let r = m.release(JobId(2)).unwrap();
    assert!(r.was_queued && r.admitted.is_empty());
    assert!(!m.is_queued(JobId(2)));
    let text = m.snapshot().to_string();
    assert!(
        text.contains("L0") && text.contains("queue: empty"),
        "{text}"
    );
}

/// Freed memory goes to the waiting jobs in rank order, not arrival order:
/// the job that arrived last but ranks first is admitted, the others wait.
#[test]
fn waiting_jobs_are_admitted_in_rank_order() {
    let mut m = mgr(100, 1);
    admitted(m.admit(JobId(1), 60, 40).unwrap());
    // Each needs 70 (P + T), two 110: only one fits once job 1 leaves.
    for (job, rank) in [(2, (5, 0)), (3, (9, 0)), (4, (1, 0))] {
        match m.admit_ranked(JobId(job), 40, 30, rank).unwrap() {
            Admission::Queued { .. } => {}
            other => panic!("job {job} admitted: {other:?}"),
        }
    }
    // Queue order is the rank's: 4, 2, 3.
    assert_eq!(m.waiting_jobs(), vec![JobId(4), JobId(2), JobId(3)]);
    let r = m.release(JobId(1)).unwrap();
    assert_eq!(
        r.admitted.iter().map(|p| p.job).collect::<Vec<_>>(),
        vec![JobId(4)]
    );
    assert_eq!(m.waiting_jobs(), vec![JobId(2), JobId(3)]);
    // Equal ranks keep arrival order.
    match m.admit_ranked(JobId(5), 40, 30, (5, 0)).unwrap() {
        Admission::Queued { position, .. } => assert_eq!(position, 1),
        other => panic!("job 5 admitted: {other:?}"),
    }
    assert_eq!(m.waiting_jobs(), vec![JobId(2), JobId(5), JobId(3)]);
}

#[test]
fn classes_never_share_a_lane_and_max_lanes_bounds_each_class() {
    let train = Ask {
        rank: (1, 0),
        class: 0,
    };
    let infer = Ask {
        rank: (0, 0),
        class: 1,
    };
    let mut m = mgr(1000, 2);
    // Two training jobs fill the two lanes of their class, with slack
    // after a third grows the first lane.
    let (a, _) = admitted(m.admit_asking(JobId(1), 100, 100, train).unwrap());
    let (b, _) = admitted(m.admit_asking(JobId(2), 100, 100, train).unwrap());
    assert_ne!(a.lane, b.lane);
    let (c, _) = admitted(m.admit_asking(JobId(3), 10, 10, train).unwrap());
    assert!(c.lane == a.lane || c.lane == b.lane, "lanes full: shares");
    // Room in a training lane does not take an inference job: it opens a
    // lane of its own past max_lanes' count of training lanes.
    let (i, _) = admitted(m.admit_asking(JobId(4), 10, 10, infer).unwrap());
    assert!(i.lane != a.lane && i.lane != b.lane);
    assert_eq!(m.snapshot().lanes.len(), 3);
    // A second inference job opens a second lane of its class...
    let (j, _) = admitted(m.admit_asking(JobId(5), 10, 10, infer).unwrap());
    assert!(j.lane != i.lane && j.lane != a.lane && j.lane != b.lane);
    // ...a third shares one of them, never a training lane.
    let (k, _) = admitted(m.admit_asking(JobId(6), 10, 10, infer).unwrap());
    assert!(k.lane == i.lane || k.lane == j.lane);
    // A training job never joins an inference lane, and with its lanes
    // capped it grows one of its own (here after re-partitioning).
    let (d, _) = admitted(m.admit_asking(JobId(7), 50, 50, train).unwrap());
    assert!(d.lane == a.lane || d.lane == b.lane);
    let s = m.snapshot();
    for l in &s.lanes {
        let ids: Vec<u64> = l.jobs.iter().map(|j| j.job.0).collect();
        let inference = ids.iter().filter(|&&id| (4..=6).contains(&id)).count();
        assert!(
            inference == 0 || inference == ids.len(),
            "mixed lane {ids:?}"
        );
    }
    // Waiting: the reason counts the lanes of the job's class.
    let q = m.admit_asking(JobId(8), 300, 300, infer).unwrap();
    let Admission::Queued { reason, .. } = q else {
        panic!("{q:?}")
    };
    assert!(reason.lanes_full);
    // When memory is freed a waiting job is placed by its class too.
    for id in [1, 2, 3, 7] {
        m.release(JobId(id)).unwrap();
    }
    let l8 = m.placement(JobId(8)).expect("admitted on release");
    let l4 = m.placement(JobId(4)).unwrap().lane;
    let l5 = m.placement(JobId(5)).unwrap().lane;
    assert!(
        l8.lane == l4 || l8.lane == l5,
        "inference lanes still capped at 2"
    );
}

#[test]
fn one_class_keeps_the_old_placement() {
    // admit_ranked is class 0: a job shares the best-fitting lane.
    let mut m = mgr(1000, 1);
    let (a, _) = admitted(m.admit_ranked(JobId(1), 100, 200, (1, 0)).unwrap());
    let (b, _) = admitted(m.admit_ranked(JobId(2), 100, 100, (0, 0)).unwrap());
    assert_eq!(a.lane, b.lane);
}
