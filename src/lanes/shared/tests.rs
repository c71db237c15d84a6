use super::*;
use std::thread;

fn cfg(capacity: u64) -> LanesConfig {
    LanesConfig {
        capacity,
        alignment: 256,
        max_lanes: 4,
    }
}

/// Jobs of one lane take turns; jobs of different lanes do not wait
/// for each other; a job that is not admitted gets no turn.
#[test]
fn a_lane_runs_one_iteration_at_a_time() {
    use std::sync::mpsc;
    // One lane: max_lanes 1 puts both jobs in it.
    let one = SharedLanes::accounting_only(LanesConfig {
        max_lanes: 1,
        ..cfg(1 << 20)
    })
    .unwrap();
    let (_a, _) = one.admit(JobId(1), 1024, 1024).unwrap();
    let (b, _) = one.admit(JobId(2), 1024, 1024).unwrap();
    assert_eq!(
        one.placement(JobId(1)).unwrap().lane,
        one.placement(JobId(2)).unwrap().lane
    );
    let mut first = one.turn(JobId(1)).unwrap();
    // Accounting-only lanes own no memory.
    assert!(first.memory().is_none());
    assert_eq!(first.placement(), one.placement(JobId(1)).unwrap());
    let (tx, rx) = mpsc::channel();
    let waiter = thread::spawn(move || {
        let t = b.turn().expect("admitted");
        tx.send(t.lane()).unwrap();
    });
    // The second job waits while the first holds the lane.
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
    drop(first);
    assert!(rx.recv_timeout(Duration::from_secs(20)).is_ok());
    waiter.join().unwrap();

    // Two lanes: each job gets its turn at once.
    let two = SharedLanes::accounting_only(cfg(1 << 20)).unwrap();
    let (_c, _) = two.admit(JobId(3), 1024, 1024).unwrap();
    let (_d, _) = two.admit(JobId(4), 1024, 1024).unwrap();
    let (l3, l4) = (
        two.placement(JobId(3)).unwrap().lane,
        two.placement(JobId(4)).unwrap().lane,
    );
    assert_ne!(l3, l4);
    let t3 = two.turn(JobId(3)).unwrap();
    let t4 = two.turn(JobId(4)).unwrap();
    assert_ne!(t3.key(), t4.key());
    // Keys differ between two sets of lanes too.
    assert_ne!(one.turn(JobId(1)).unwrap().key(), t3.key());
    assert!(two.turn(JobId(99)).is_none());
}

#[test]
fn dropping_a_lease_admits_the_waiter() {
    // 3 KiB for the first job; the second would need 1 KiB more, 512 B are free.
    let lanes = SharedLanes::new(cfg(3584)).unwrap();
    let (a, adm) = lanes.admit(JobId(1), 1024, 2048).unwrap();
    assert!(matches!(adm, Admission::Admitted { .. }));
    let (b, adm) = lanes.admit(JobId(2), 1024, 2048).unwrap();
    assert!(matches!(adm, Admission::Queued { position: 0, .. }));
    assert_eq!(lanes.snapshot().queue.len(), 1);
    let waiter = {
        let lanes = lanes.clone();
        thread::spawn(move || lanes.wait_admitted(JobId(2), Duration::from_secs(20)))
    };
    drop(a);
    let placed = waiter.join().unwrap().expect("admitted after the drop");
    assert_eq!(placed.job, JobId(2));
    assert_eq!(b.placement(), Some(placed));
    drop(b);
    let s = lanes.snapshot();
    assert!(s.lanes.is_empty() && s.queue.is_empty());
    assert_eq!(s.free, 3584);
}

#[test]
fn persistent_bytes_survive_repartitioning() {
    // Three 1 KiB lanes; free the middle one, then a 2 KiB job forces a compaction.
    let lanes = SharedLanes::new(cfg(3 * 1024 + 1024)).unwrap();
    let mut leases = Vec::new();
    for j in 0..4u64 {
        let (l, _) = lanes.admit(JobId(j), 512, 512).unwrap();
        lanes
            .with_persistent(JobId(j), |b| b.fill(j as u8 + 1))
            .unwrap();
        leases.push(l);
    }
    let gone = leases.remove(1);
    gone.release().unwrap();
    let gone = leases.remove(2);
    gone.release().unwrap();
    let (big, adm) = lanes.admit(JobId(9), 1024, 1024).unwrap();
    let Admission::Admitted { moves, .. } = adm else {
        panic!("should fit after re-partitioning: {adm:?}")
    };
    assert!(!moves.is_empty());
    for j in [0u64, 2] {
        let ok = lanes
            .with_persistent(JobId(j), |b| b.iter().all(|&x| x == j as u8 + 1))
            .unwrap();
        assert!(ok, "job {j} lost its bytes");
    }
    assert!(big.placement().is_some());
    assert!(lanes.wait_admitted(JobId(77), Duration::ZERO).is_none());
}

/// Fills `words` with `v`.
fn fill(words: &mut [u64], v: u64) {
    words.iter_mut().for_each(|w| *w = v);
}

fn pattern(job: u64, iteration: u64) -> u64 {
    0xA5A5_0000_0000_0000 | (job << 32) | iteration
}

#[test]
fn a_turn_lends_its_jobs_regions_as_words() {
    let lanes = SharedLanes::new(cfg(1 << 16)).unwrap();
    let (_a, _) = lanes.admit(JobId(1), 1024, 512).unwrap();
    let (_b, _) = lanes.admit(JobId(2), 256, 2048).unwrap();
    let mut t = lanes.turn(JobId(1)).unwrap();
    let mem = t.memory().unwrap();
    let pl = mem.placement;
    assert_eq!(pl, lanes.placement(JobId(1)).unwrap());
    assert_eq!(mem.persistent.len() as u64 * 8, pl.p_bytes);
    assert_eq!(mem.arena.len() as u64 * 8, pl.arena_bytes);
    // Fresh memory reads as zero.
    assert!(mem
        .persistent
        .iter()
        .chain(mem.arena.iter())
        .all(|&w| w == 0));
    fill(mem.persistent, 7);
    fill(mem.arena, 9);
    // Another lane's turn gets its own, disjoint memory at the same time.
    let mut u = lanes.turn(JobId(2)).unwrap();
    let other = u.memory().unwrap();
    assert_ne!(other.placement.lane, pl.lane);
    assert!(other.persistent.iter().all(|&w| w == 0));
    fill(other.persistent, 3);
    drop((t, u));
    let bytes = lanes
        .with_memory(JobId(1), |pl, mem| {
            let p = mem.region(pl.p_offset, pl.p_bytes).unwrap().to_vec();
            let a = mem
                .region(pl.arena_offset, pl.arena_bytes)
                .unwrap()
                .to_vec();
            (p, a)
        })
        .unwrap();
    assert!(bytes.0.chunks(8).all(|w| w == 7u64.to_ne_bytes()));
    assert!(bytes.1.chunks(8).all(|w| w == 9u64.to_ne_bytes()));
}

#[test]
fn ranges_that_are_not_word_aligned_give_no_memory() {
    let lanes = SharedLanes::new(LanesConfig {
        alignment: 4,
        ..cfg(1 << 12)
    })
    .unwrap();
    let (_b, _) = lanes.admit(JobId(2), 16, 16).unwrap();
    assert!(lanes.turn(JobId(2)).unwrap().memory().is_some());
    let (_a, _) = lanes.admit(JobId(1), 12, 16).unwrap();
    assert_eq!(lanes.placement(JobId(1)).unwrap().p_bytes, 12);
    assert!(lanes.turn(JobId(1)).unwrap().memory().is_none());
}

/// After a layout change, a turn of the old layout holds back new turns
/// of every lane until it ends; admit and release never wait for it.
#[test]
fn an_older_turn_holds_back_new_turns_of_other_lanes() {
    use std::sync::mpsc;
    let lanes = SharedLanes::new(cfg(1 << 20)).unwrap();
    let (_a, _) = lanes.admit(JobId(1), 1024, 1024).unwrap();
    let (b, _) = lanes.admit(JobId(2), 1024, 1024).unwrap();
    assert_ne!(
        lanes.placement(JobId(1)).unwrap().lane,
        lanes.placement(JobId(2)).unwrap().lane
    );
    let old = lanes.turn(JobId(1)).unwrap();
    let (tx, rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let taker = {
        let lanes = lanes.clone();
        thread::spawn(move || {
            for _ in 0..2 {
                let t = lanes.turn(JobId(2)).expect("admitted");
                tx.send(t.lane()).unwrap();
                drop(t);
                go_rx.recv().unwrap();
            }
        })
    };
    // Same layout: the other lane runs at once.
    assert!(rx.recv_timeout(Duration::from_secs(20)).is_ok());
    // A layout change (and a release) while the old turn is held,
    // from the very thread that holds it: neither waits.
    let (c, adm) = lanes.admit(JobId(3), 1024, 1024).unwrap();
    assert!(matches!(adm, Admission::Admitted { .. }));
    c.release().unwrap();
    go_tx.send(()).unwrap();
    // The other lane's next turn now waits for the old turn to end.
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    drop(old);
    assert!(rx.recv_timeout(Duration::from_secs(20)).is_ok());
    go_tx.send(()).unwrap();
    taker.join().unwrap();
    drop(b);
}

/// Lending the reservation waits for the active turns to end.
#[test]
fn with_memory_waits_for_active_turns() {
    use std::sync::mpsc;
    let lanes = SharedLanes::new(cfg(1 << 20)).unwrap();
    let (_a, _) = lanes.admit(JobId(1), 1024, 1024).unwrap();
    let (_b, _) = lanes.admit(JobId(2), 1024, 1024).unwrap();
    let mut t = lanes.turn(JobId(1)).unwrap();
    fill(t.memory().unwrap().persistent, 5);
    let (tx, rx) = mpsc::channel();
    let lender = {
        let lanes = lanes.clone();
        thread::spawn(move || {
            let ok = lanes
                .with_persistent(JobId(1), |b| b.chunks(8).all(|w| w == 5u64.to_ne_bytes()))
                .unwrap();
            tx.send(ok).unwrap();
        })
    };
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    drop(t);
    assert!(rx.recv_timeout(Duration::from_secs(20)).unwrap());
    lender.join().unwrap();
    // Accounting-only lanes lend nothing, at once.
    let acct = SharedLanes::accounting_only(cfg(1 << 20)).unwrap();
    let (_c, _) = acct.admit(JobId(1), 1024, 1024).unwrap();
    let _held = acct.turn(JobId(1)).unwrap();
    assert!(acct.with_persistent(JobId(1), |_| ()).is_none());
}

/// Moves reported while a turn is active wait for it; the next turn
/// applies them before reading its placement, and the bytes follow.
#[test]
fn moves_queued_during_a_turn_follow_the_job() {
    // One lane: B's region sits after A's and slides down when A goes.
    let lanes = SharedLanes::new(LanesConfig {
        max_lanes: 1,
        ..cfg(1 << 16)
    })
    .unwrap();
    let (a, _) = lanes.admit(JobId(1), 512, 256).unwrap();
    let (_b, _) = lanes.admit(JobId(2), 1024, 256).unwrap();
    let before = lanes.placement(JobId(2)).unwrap();
    lanes.with_persistent(JobId(1), |b| b.fill(0x11)).unwrap();
    let mut t = lanes.turn(JobId(2)).unwrap();
    fill(t.memory().unwrap().persistent, pattern(2, 1));
    let r = a.release().unwrap();
    assert!(r.moves.iter().any(|m| m.job == JobId(2)), "{r:?}");
    let after = lanes.placement(JobId(2)).unwrap();
    assert_eq!(after.p_offset, before.p_offset - 512);
    // The active turn still sees its bytes where they were.
    let mem = t.memory().unwrap();
    assert_eq!(mem.placement, before);
    assert!(mem.persistent.iter().all(|&w| w == pattern(2, 1)));
    fill(mem.persistent, pattern(2, 2));
    drop(t);
    // The next turn finds them moved.
    let mut t = lanes.turn(JobId(2)).unwrap();
    let mem = t.memory().unwrap();
    assert_eq!(mem.placement, after);
    assert!(mem.persistent.iter().all(|&w| w == pattern(2, 2)));
    drop(t);
    let ok = lanes
        .with_persistent(JobId(2), |b| {
            b.chunks(8).all(|w| w == pattern(2, 2).to_ne_bytes())
        })
        .unwrap();
    assert!(ok);
}

/// Worker threads take their jobs' turns over and over, each checking
/// at the start of a turn that its persistent words are as it left
/// them, then writing new ones and scribbling over its lane's arena;
/// meanwhile another thread admits and releases other jobs (whose own
/// bytes it writes and checks through `with_persistent`), so lanes are
/// re-partitioned and regions slide under the workers, with moves
/// queued behind their turns.
#[test]
fn turns_keep_their_bytes_while_the_layout_changes() {
    use std::sync::atomic::AtomicBool;
    const WORKERS: u64 = 3;
    const MIN_TURNS: u64 = 200;
    let lanes = SharedLanes::new(LanesConfig {
        capacity: 16 * 1024,
        alignment: 256,
        max_lanes: 3,
    })
    .unwrap();
    let workers_moved = |moves: &[Move]| moves.iter().any(|m| m.job.0 < WORKERS);
    // Lane 0 keeps an anchor job; churn jobs join and leave it and lane
    // 1, so re-partitioning moves the workers' lane 2 back and forth.
    // Job 102, admitted before the workers in their lane, slides them
    // when it leaves.
    let (_anchor, _) = lanes.admit(JobId(99), 256, 256).unwrap();
    let mut churn = Vec::new();
    for j in [101u64, 102] {
        let (l, _) = lanes.admit(JobId(j), 1024, 512).unwrap();
        churn.push(l);
    }
    let mut leases = Vec::new();
    for w in 0..WORKERS {
        let (l, adm) = lanes.admit(JobId(w), 512 * (w + 1), 256).unwrap();
        assert!(matches!(adm, Admission::Admitted { .. }));
        lanes.with_persistent(JobId(w), |b| b.fill(0)).unwrap();
        leases.push(l);
    }
    let stop = Arc::new(AtomicBool::new(false));
    // Turns each worker has taken: the churn keeps pace with them, so
    // the layout changes while they run.
    let progress: Arc<Vec<AtomicU64>> = Arc::new((0..WORKERS).map(|_| AtomicU64::new(0)).collect());
    let handles: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (lanes, stop, progress) = (lanes.clone(), stop.clone(), progress.clone());
            thread::spawn(move || {
                // Turns taken, and turns that found the region moved.
                let (mut i, mut moved) = (0u64, 0u64);
                let mut last = None;
                while !stop.load(Ordering::Relaxed) || i < MIN_TURNS {
                    let mut t = lanes.turn(JobId(w)).expect("admitted");
                    let mem = t.memory().expect("memory lanes");
                    assert_eq!(mem.placement.job, JobId(w));
                    let want = if i == 0 { 0 } else { pattern(w, i) };
                    if let Some(bad) = mem.persistent.iter().position(|&x| x != want) {
                        panic!("job {w} turn {i}: word {bad} is {:#x}", mem.persistent[bad]);
                    }
                    if last.is_some_and(|p| p != mem.placement.p_offset) {
                        moved += 1;
                    }
                    last = Some(mem.placement.p_offset);
                    fill(mem.persistent, pattern(w, i + 1));
                    fill(mem.arena, 0xDEAD_0000 + w);
                    // Nothing moves or overwrites them mid-turn.
                    thread::yield_now();
                    assert!(mem.persistent.iter().all(|&x| x == pattern(w, i + 1)));
                    assert!(mem.arena.iter().all(|&x| x == 0xDEAD_0000 + w));
                    drop(t);
                    i += 1;
                    progress[w as usize].store(i, Ordering::Relaxed);
                    thread::yield_now();
                }
                (i, moved)
            })
        })
        .collect();
    // The churn: a deterministic sequence of arrivals and departures.
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let stamp = |j: u64| (j as u8).wrapping_mul(37) | 1;
    let write = |j: JobId| lanes.with_persistent(j, |b| b.fill(stamp(j.0)));
    for j in [101, 102] {
        write(JobId(j)).unwrap();
    }
    // Layout changes that moved a worker: all of them, and those whose
    // moves were queued behind active turns.
    let (mut changes, mut queued) = (0, 0);
    let mut note = |moves: &[Move]| {
        if workers_moved(moves) {
            changes += 1;
            queued += usize::from(!lanes.lock().pending.is_empty());
        }
    };
    let mut next_job = 103u64;
    assert_eq!(lanes.snapshot().lanes.len(), 3);
    'churn: for step in 0..3000u64 {
        while progress.iter().map(|p| p.load(Ordering::Relaxed)).min() < Some(step / 4) {
            if handles.iter().any(|h| h.is_finished()) {
                break 'churn; // a worker failed: its join reports it
            }
            thread::yield_now();
        }
        let leave = churn.len() >= 6 || (!churn.is_empty() && next() % 2 == 0);
        if leave {
            let k = (next() % churn.len() as u64) as usize;
            let lease = churn.remove(k);
            let job = lease.job();
            let intact = lanes.with_persistent(job, |b| b.iter().all(|&x| x == stamp(job.0)));
            assert_ne!(intact, Some(false), "churn {job} lost its bytes");
            let r = lease.release().unwrap();
            note(&r.moves);
            for p in &r.admitted {
                write(p.job).unwrap();
            }
        } else {
            let job = JobId(next_job);
            next_job += 1;
            let p = 256 * (1 + next() % 12);
            let t = 256 * (1 + next() % 8);
            let (l, adm) = lanes.admit(job, p, t).unwrap();
            if let Admission::Admitted { moves, .. } = adm {
                note(&moves);
                write(job).unwrap();
            }
            churn.push(l);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let done: Vec<(u64, u64)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let moved: u64 = done.iter().map(|d| d.1).sum();
    eprintln!("turns and moves seen per worker {done:?}; changes moving workers {changes}, {queued} queued");
    assert!(changes > 0 && moved > 0, "no worker was moved");
    for (w, &(i, _)) in done.iter().enumerate() {
        let w = w as u64;
        let ok = lanes
            .with_persistent(JobId(w), |b| {
                b.chunks(8).all(|x| x == pattern(w, i).to_ne_bytes())
            })
            .unwrap();
        assert!(ok, "job {w} lost its bytes after {i} turns");
    }
    drop((leases, churn, _anchor));
    let s = lanes.snapshot();
    assert!(s.lanes.is_empty() && s.queue.is_empty());
}
