//! Partial eviction on the GPU (`CudaProgram::evict_keeping`,
//! docs/switching.md): a program evicted with its first units kept mapped
//! switches back bit-identical to its resident run, copying only the rest,
//! with the kept block the only device memory it holds while evicted; in
//! the program's own memory, in a lane's shared block and in a device
//! reservation's chunks (the service's arrangement).

use super::*;
use lanes::residency::Strategy;

fn bits(t: &Tensor) -> Vec<u32> {
    t.f32s().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// A ResNet-50 at batch 2 (98 MiB of weights: many pieces of any mapping
/// granularity), prepared as the service prepares an inference model, then
/// switched back after evictions keeping `auto`'s bytes, half of P, one
/// byte and all of P, with every strategy, each output bit-identical to
/// the resident run; a whole eviction afterwards gives the kept block up.
fn keep_is_bit_identical(lane: Option<u64>) {
    let built = models::resnet(&[3, 4, 6, 3], 2, 224).unwrap();
    let vg = validate(built.graph, &large_limits()).unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    let (name, ty) = &built.inputs[0];
    let feeds: BTreeMap<String, Tensor> =
        [(name.clone(), rnd(&mut rng, &ty.shape.0, -1.0, 1.0))].into();
    let fetch = vec![built.output.clone()];
    let mut p = CudaProgram::new(vg, built.vars).unwrap();
    p.bind_lane(lane).unwrap();
    p.prepare_standby().unwrap();
    let want = bits(&p.run(&feeds, &fetch).unwrap()[0]);
    let total = p.persistent_bytes();
    p.evict().unwrap();
    assert_eq!(p.own_device_bytes(), 0);
    let auto = p.auto_keep_bytes().expect("prepared: the costs are known");
    println!(
        "auto keeps {auto} of {total} bytes ({:.1} %)",
        100.0 * auto as f64 / total as f64
    );
    // Resident again: a program already evicted is left as it is.
    assert_eq!(bits(&p.run(&feeds, &fetch).unwrap()[0]), want);
    for keep in [auto, total / 2, 1, u64::MAX] {
        for s in Strategy::ALL {
            p.evict_keeping(keep).unwrap();
            assert!(!p.is_resident());
            let kept = p.kept_bytes();
            assert_eq!(kept > 0, keep > 0, "keep {keep}");
            assert!(kept >= keep.min(total), "kept {kept} for {keep}");
            assert_eq!(
                p.own_device_bytes() as u64,
                kept,
                "only the kept block is held"
            );
            let plan = p.plan(s);
            assert_eq!(plan.kept, p.kept_units());
            let (out, rep) = p.run_switching(&feeds, &fetch, s).unwrap();
            let rep = rep.unwrap();
            assert_eq!(rep.kept_bytes + rep.bytes, total, "{s} keep {keep}");
            assert!(p.is_resident() && p.kept_bytes() == 0);
            assert_eq!(bits(&out[0]), want, "{s} keeping {keep} bytes");
            // And resident again afterwards.
            assert_eq!(bits(&p.run(&feeds, &fetch).unwrap()[0]), want);
        }
    }
    // Partially, then whole: nothing held, every unit copied back.
    p.evict_keeping(total / 2).unwrap();
    assert!(p.own_device_bytes() > 0);
    p.evict().unwrap();
    assert_eq!((p.own_device_bytes(), p.kept_bytes()), (0, 0));
    let (out, rep) = p
        .run_switching(&feeds, &fetch, Strategy::Pipelined)
        .unwrap();
    assert_eq!(rep.unwrap().bytes, total);
    assert_eq!(bits(&out[0]), want);
}

#[test]
#[ignore = "needs a GPU"]
fn partial_eviction_is_bit_identical_in_own_memory() {
    keep_is_bit_identical(None);
}

#[test]
#[ignore = "needs a GPU"]
fn partial_eviction_is_bit_identical_in_a_lane() {
    keep_is_bit_identical(Some(0x6b65_6570));
}

/// The same in a device reservation's 16 MiB chunks (`lanes serve`'s
/// default): the kept block is whole chunks, the chunks given up return
/// to the reservation.
#[test]
#[ignore = "needs a GPU"]
fn partial_eviction_is_bit_identical_in_a_reservation() {
    let r = lanes::exec::cuda::DeviceReservation::new(2 << 30).unwrap();
    let free = r.free_bytes();
    keep_is_bit_identical(Some(0x6b65_6571));
    // Every program is gone: the chunks are back.
    assert_eq!(r.free_bytes(), free);
}

/// A CUDA program of zoo model `m`, bound to `lane`, with seeded feeds
/// and its resident output's bits.
fn lane_program(
    m: lanes_adaptor::zoo::ModelGraph,
    lane: u64,
) -> (CudaProgram, BTreeMap<String, Tensor>, Vec<String>, Vec<u32>) {
    let feeds = lanes_adaptor::zoo::seeded_feeds(&m.inputs, 5, 7).unwrap();
    let fetch = vec![m.output.clone()];
    let vg = validate(m.graph, &large_limits()).unwrap();
    let mut p = CudaProgram::new(vg, m.vars).unwrap();
    p.bind_lane(Some(lane)).unwrap();
    let want = bits(&p.run(&feeds, &fetch).unwrap()[0]);
    (p, feeds, fetch, want)
}

/// Inside a reservation, blocks are made of the largest allocations that
/// fit (256, 64 and 16 MiB): a lane's block made for a program with a
/// large ephemeral part (an MLP at batch 8192: about 100 MiB) is mapped by
/// a lane-mate whose part is one 16 MiB chunk through its first, larger
/// allocation, which runs past that part into the address space reserved
/// for it. Both switch back bit-identical in either order, round after
/// round, and every byte returns to the reservation at the end (splitting
/// the 256 MiB allocations into smaller ones on the way).
#[test]
#[ignore = "needs a GPU"]
fn a_lane_of_different_sizes_shares_its_block_in_a_reservation() {
    use lanes_adaptor::zoo::Arch;
    let r = lanes::exec::cuda::DeviceReservation::new(2 << 30).unwrap();
    let free = r.free_bytes();
    const LANE: u64 = 0x6c61_6e65;
    let big = Arch::Mlp {
        inputs: 512,
        hidden: vec![2048],
        classes: 10,
    }
    .inference(8192, 3)
    .unwrap();
    let small = Arch::LeNet {
        channels: 1,
        image: 28,
        classes: 10,
    }
    .inference(4, 4)
    .unwrap();
    let (mut b, b_feeds, b_fetch, b_want) = lane_program(big, LANE);
    let (mut s, s_feeds, s_fetch, s_want) = lane_program(small, LANE);
    assert!(
        b.device_bytes() >= (64 << 20),
        "the big program's arena holds more than one 64 MiB allocation"
    );
    for round in 0..4 {
        b.evict().unwrap();
        s.evict().unwrap();
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for big_first in order {
            let (p, feeds, fetch, want) = match big_first {
                true => (&mut b, &b_feeds, &b_fetch, &b_want),
                false => (&mut s, &s_feeds, &s_fetch, &s_want),
            };
            let (out, rep) = p.run_switching(feeds, fetch, Strategy::Pipelined).unwrap();
            assert!(rep.is_some(), "round {round}: evicted, so it switched");
            assert_eq!(&bits(&out[0]), want, "round {round}, big {big_first}");
        }
        // Resident, each again on the lane's block.
        assert_eq!(bits(&s.run(&s_feeds, &s_fetch).unwrap()[0]), s_want);
        assert_eq!(bits(&b.run(&b_feeds, &b_fetch).unwrap()[0]), b_want);
    }
    drop(b);
    drop(s);
    assert_eq!(r.free_bytes(), free, "every allocation is back");
}
