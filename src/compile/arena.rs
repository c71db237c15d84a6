//! Offset assignment in one arena for blocks with known lifetimes, the
//! largest-live lower bound, and an independent overlap check.
//!
//! A [`Block`] needs `size` bytes from step `first` to step `last`
//! (inclusive). Two blocks whose step ranges intersect must not share
//! bytes. The assignment is the greedy best-fit of TFLite's arena planner
//! and of Pisarchyk & Lee ("Efficient memory management for deep neural
//! net inference", 2020): take blocks in a chosen order, and put each in
//! the smallest gap, among the blocks already placed that are live at the
//! same time, that holds it (or after the highest of them). Two orders are
//! tried — largest first, and longest-lived first — and the smaller arena
//! wins.
//!
//! That placement compares each block with every block placed before it
//! (quadratic: 100,000 blocks took half a minute). Above [`EXACT_MAX`]
//! blocks the arena is assigned [`Strategy::Online`] instead: the blocks in
//! execution order, each freed after its last step and each placed in the
//! smallest free hole that holds it (an allocator replayed over the
//! iteration; `O(n log n)`), so loading a graph stays near-linear in its
//! size. Every real model of the zoo is far below the threshold.

use std::fmt;

/// A request for `size` bytes over the inclusive step range `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub size: u64,
    pub first: usize,
    pub last: usize,
}

impl Block {
    /// True when both blocks are live at some common step.
    pub fn overlaps_in_time(&self, other: &Block) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// The order in which blocks are offered to the best-fit placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Strategy {
    /// Largest block first (ties: earliest first).
    GreedyBySize,
    /// Longest lifetime first (ties: largest first).
    GreedyByLifetime,
    /// In execution order, best-fit into the holes freed so far (large
    /// graphs, see the module docs).
    Online,
}

/// Most blocks placed by the quadratic greedy strategies; larger sets are
/// placed [`Strategy::Online`].
pub const EXACT_MAX: usize = 8192;

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::GreedyBySize => "greedy-by-size",
            Strategy::GreedyByLifetime => "greedy-by-lifetime",
            Strategy::Online => "online-best-fit",
        })
    }
}

/// Offsets for a set of blocks: `offsets[i]` belongs to block `i`; `size`
/// is the arena's extent (the highest block end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub offsets: Vec<u64>,
    pub size: u64,
    pub strategy: Strategy,
}

/// Places `blocks` with every strategy and keeps the smallest arena.
/// Offsets are multiples of `alignment` when every size is (the caller
/// rounds sizes up). Sizes must already be checked to sum without
/// overflowing `u64`.
pub fn assign(blocks: &[Block]) -> Assignment {
    assign_preferring(blocks, &[])
}

/// [`assign`], where each pair `(i, j)` of `same` asks for blocks `i` and
/// `j` (live at different steps) to start at the same offset: when the
/// second of them is placed and the first one's offset is free for it
/// over its whole lifetime, it goes there instead of into the best-fit
/// gap (the executor's fused kernels need an output exactly over an
/// input or apart from it; see the module docs). The preference never
/// costs memory: the arena is also placed without it, and the preferred
/// placement is kept only when it is no larger.
pub fn assign_preferring(blocks: &[Block], same: &[(usize, usize)]) -> Assignment {
    if blocks.len() > EXACT_MAX {
        return assign_with(blocks, Strategy::Online);
    }
    let smaller = |a: Assignment, b: Assignment| if b.size < a.size { b } else { a };
    let plain = || {
        smaller(
            assign_with(blocks, Strategy::GreedyBySize),
            assign_with(blocks, Strategy::GreedyByLifetime),
        )
    };
    let mut partners: Vec<Vec<usize>> = vec![Vec::new(); blocks.len()];
    for &(i, j) in same {
        if i < blocks.len() && j < blocks.len() && i != j {
            partners[i].push(j);
            partners[j].push(i);
        }
    }
    if partners.iter().all(Vec::is_empty) {
        return plain();
    }
    let preferred = smaller(
        place_greedy(blocks, Strategy::GreedyBySize, &partners),
        place_greedy(blocks, Strategy::GreedyByLifetime, &partners),
    );
    let plain = plain();
    if preferred.size <= plain.size {
        preferred
    } else {
        plain
    }
}

/// Places `blocks` in the order `strategy` gives.
pub fn assign_with(blocks: &[Block], strategy: Strategy) -> Assignment {
    if strategy == Strategy::Online {
        return assign_online(blocks);
    }
    place_greedy(blocks, strategy, &[])
}

/// The greedy best-fit placement in `strategy`'s order. A block with
/// `partners` takes the offset of the first one already placed whose
/// bytes are free over its lifetime; failing that, with a partner of its
/// size not yet placed, it goes into the best gap free over both
/// lifetimes and the partner goes there with it.
fn place_greedy(blocks: &[Block], strategy: Strategy, partners: &[Vec<usize>]) -> Assignment {
    let mut order: Vec<usize> = (0..blocks.len()).filter(|&i| blocks[i].size > 0).collect();
    match strategy {
        Strategy::GreedyBySize => order.sort_by(|&x, &y| {
            let (a, b) = (&blocks[x], &blocks[y]);
            b.size
                .cmp(&a.size)
                .then(a.first.cmp(&b.first))
                .then(x.cmp(&y))
        }),
        Strategy::GreedyByLifetime => order.sort_by(|&x, &y| {
            let (a, b) = (&blocks[x], &blocks[y]);
            (b.last - b.first)
                .cmp(&(a.last - a.first))
                .then(b.size.cmp(&a.size))
                .then(x.cmp(&y))
        }),
        Strategy::Online => {}
    }
    let mut offsets = vec![0u64; blocks.len()];
    // Blocks placed so far, kept sorted by offset: (offset, index).
    let mut placed: Vec<(u64, usize)> = Vec::with_capacity(order.len());
    let mut placed_set = vec![false; blocks.len()];
    let mut extent = 0u64;
    for &i in &order {
        if placed_set[i] {
            continue;
        }
        let blk = &blocks[i];
        let own = partners.get(i).map_or(&[][..], Vec::as_slice);
        // A partner already placed whose offset is free for this block.
        let free_at = |at: u64, placed: &[(u64, usize)]| {
            placed.iter().all(|&(o, k)| {
                let other = &blocks[k];
                !blk.overlaps_in_time(other) || o + other.size <= at || at + blk.size <= o
            })
        };
        let taken = own
            .iter()
            .filter(|&&j| placed_set[j] && blocks[j].size >= blk.size)
            .map(|&j| offsets[j])
            .find(|&at| free_at(at, &placed));
        // Else a partner not yet placed, of the same size: both go into
        // one gap free over both lifetimes.
        let twin = own.iter().copied().find(|&j| {
            !placed_set[j] && blocks[j].size == blk.size && !blk.overlaps_in_time(&blocks[j])
        });
        let off = match taken {
            Some(at) => at,
            None => {
                let conflicts = |other: &Block| {
                    blk.overlaps_in_time(other)
                        || twin.is_some_and(|j| blocks[j].overlaps_in_time(other))
                };
                let mut best: Option<(u64, u64)> = None; // (gap size, offset)
                let mut prev_end = 0u64;
                for &(off, j) in &placed {
                    let other = &blocks[j];
                    if !conflicts(other) {
                        continue;
                    }
                    if off > prev_end {
                        let gap = off - prev_end;
                        if gap >= blk.size && best.is_none_or(|(g, _)| gap < g) {
                            best = Some((gap, prev_end));
                        }
                    }
                    prev_end = prev_end.max(off + other.size);
                }
                best.map_or(prev_end, |(_, o)| o)
            }
        };
        let mut put = |k: usize, placed: &mut Vec<(u64, usize)>| {
            offsets[k] = off;
            placed_set[k] = true;
            extent = extent.max(off + blocks[k].size);
            let pos = placed.partition_point(|&(o, _)| o <= off);
            placed.insert(pos, (off, k));
        };
        put(i, &mut placed);
        if taken.is_none() {
            if let Some(j) = twin {
                put(j, &mut placed);
            }
        }
    }
    Assignment {
        offsets,
        size: extent,
        strategy,
    }
}

/// [`Strategy::Online`]: blocks taken by first step; before a block is
/// placed every block whose last step is earlier is freed; a block goes
/// into the smallest free hole that holds it (ties: the lowest), else at
/// the end of the arena (growing a free hole that ends there).
fn assign_online(blocks: &[Block]) -> Assignment {
    use std::cmp::Reverse;
    use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
    let mut order: Vec<usize> = (0..blocks.len()).filter(|&i| blocks[i].size > 0).collect();
    order.sort_by_key(|&i| (blocks[i].first, i));
    let mut offsets = vec![0u64; blocks.len()];
    // Free holes by offset (→ size) and by (size, offset).
    let mut holes: BTreeMap<u64, u64> = BTreeMap::new();
    let mut by_size: BTreeSet<(u64, u64)> = BTreeSet::new();
    // Placed blocks by last step, to free them in time.
    let mut live: BinaryHeap<Reverse<(usize, usize)>> = BinaryHeap::new();
    let mut top = 0u64;
    let mut extent = 0u64;
    for &i in &order {
        let b = &blocks[i];
        while let Some(&Reverse((last, j))) = live.peek() {
            if last >= b.first {
                break;
            }
            live.pop();
            // Free j's bytes, merged with the holes beside them.
            let (mut at, mut size) = (offsets[j], blocks[j].size);
            if let Some((&o, &s)) = holes.range(..at).next_back() {
                if o + s == at {
                    holes.remove(&o);
                    by_size.remove(&(s, o));
                    at = o;
                    size += s;
                }
            }
            if let Some(&s) = holes.get(&(at + size)) {
                holes.remove(&(at + size));
                by_size.remove(&(s, at + size));
                size += s;
            }
            if at + size == top {
                top = at; // the arena's free tail is not a hole
            } else {
                holes.insert(at, size);
                by_size.insert((size, at));
            }
        }
        let off = match by_size.range((b.size, 0)..).next().copied() {
            Some((s, o)) => {
                by_size.remove(&(s, o));
                holes.remove(&o);
                if s > b.size {
                    holes.insert(o + b.size, s - b.size);
                    by_size.insert((s - b.size, o + b.size));
                }
                o
            }
            None => {
                let o = top;
                top += b.size;
                o
            }
        };
        offsets[i] = off;
        extent = extent.max(off + b.size);
        live.push(Reverse((b.last, i)));
    }
    Assignment {
        offsets,
        size: extent,
        strategy: Strategy::Online,
    }
}

/// The largest total size of blocks live at one step: no arena holding
/// these blocks can be smaller.
pub fn lower_bound(blocks: &[Block]) -> u64 {
    let steps = blocks.iter().map(|b| b.last + 2).max().unwrap_or(0);
    let mut delta = vec![0i128; steps];
    for b in blocks {
        delta[b.first] += i128::from(b.size);
        delta[b.last + 1] -= i128::from(b.size);
    }
    let mut live = 0i128;
    let mut peak = 0i128;
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    u64::try_from(peak).unwrap_or(u64::MAX)
}

/// Two blocks that share bytes while both are live, or a block outside the arena.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArenaViolation {
    #[error("blocks {a} and {b} are live together at step {step} and overlap in bytes")]
    Overlap { a: usize, b: usize, step: usize },
    #[error(
        "block {block} at offset {offset} of {size} bytes ends past the arena of {arena} bytes"
    )]
    OutOfArena {
        block: usize,
        offset: u64,
        size: u64,
        arena: u64,
    },
    #[error("block {block} at offset {offset} is not a multiple of {alignment}")]
    Misaligned {
        block: usize,
        offset: u64,
        alignment: u64,
    },
}

/// Checks an assignment without trusting how it was made: every block
/// inside `arena`, aligned, and no two blocks live at the same step share
/// a byte. Sweeps blocks by first step, keeping the set still live.
pub fn check(
    blocks: &[Block],
    offsets: &[u64],
    arena: u64,
    alignment: u64,
) -> Result<(), ArenaViolation> {
    for (i, (b, &off)) in blocks.iter().zip(offsets).enumerate() {
        if alignment > 0 && off % alignment != 0 {
            return Err(ArenaViolation::Misaligned {
                block: i,
                offset: off,
                alignment,
            });
        }
        if off.checked_add(b.size).is_none_or(|end| end > arena) {
            return Err(ArenaViolation::OutOfArena {
                block: i,
                offset: off,
                size: b.size,
                arena,
            });
        }
    }
    let mut by_first: Vec<usize> = (0..blocks.len()).filter(|&i| blocks[i].size > 0).collect();
    by_first.sort_by_key(|&i| (blocks[i].first, i));
    let mut live: Vec<usize> = Vec::new();
    for &i in &by_first {
        let b = &blocks[i];
        live.retain(|&j| blocks[j].last >= b.first);
        for &j in &live {
            let (oi, oj) = (offsets[i], offsets[j]);
            if oi < oj + blocks[j].size && oj < oi + b.size {
                return Err(ArenaViolation::Overlap {
                    a: j,
                    b: i,
                    step: b.first,
                });
            }
        }
        live.push(i);
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::Strategy;
    use super::*;
    use proptest::prelude::*;

    fn blk(size: u64, first: usize, last: usize) -> Block {
        Block { size, first, last }
    }

    #[test]
    fn chain_reuses_memory() {
        // a -> b -> c -> d, each consumed by the next only: two buffers suffice.
        let blocks = [
            blk(100, 0, 1),
            blk(100, 1, 2),
            blk(100, 2, 3),
            blk(100, 3, 3),
        ];
        let a = assign(&blocks);
        assert_eq!(a.size, 200);
        assert_eq!(lower_bound(&blocks), 200);
        check(&blocks, &a.offsets, a.size, 1).unwrap();
    }

    /// Above the threshold a chain and a fan-out are placed online, in
    /// near-linear time, and the chain still reuses two buffers.
    #[test]
    fn large_sets_are_placed_online() {
        let n = EXACT_MAX * 4;
        let chain: Vec<Block> = (0..n).map(|i| blk(64, i, i + 1)).collect();
        let a = assign(&chain);
        assert_eq!(a.strategy, Strategy::Online);
        assert_eq!(a.size, 128);
        check(&chain, &a.offsets, a.size, 64).unwrap();
        // One input read by every step; every output lives to the end.
        let mut fan = vec![blk(64, 0, n)];
        fan.extend((1..n).map(|i| blk(64, i, n)));
        let a = assign(&fan);
        assert_eq!(a.size, 64 * n as u64);
        assert_eq!(lower_bound(&fan), a.size);
    }

    #[test]
    fn disjoint_lifetimes_share_one_slot() {
        let blocks = [blk(64, 0, 0), blk(32, 1, 1), blk(48, 2, 2)];
        let a = assign(&blocks);
        assert_eq!(a.size, 64);
        assert!(a.offsets.iter().all(|&o| o == 0));
    }

    #[test]
    fn best_fit_takes_the_smallest_gap() {
        // Long-lived 100 @0, 50 hole, long-lived 100; a 40 must go in the hole.
        let blocks = [blk(100, 0, 9), blk(100, 0, 9), blk(50, 0, 0), blk(40, 5, 6)];
        let a = assign_with(&blocks, Strategy::GreedyBySize);
        assert_eq!(a.size, 250);
        check(&blocks, &a.offsets, a.size, 1).unwrap();
    }

    #[test]
    fn check_finds_overlap_and_bounds() {
        let blocks = [blk(10, 0, 2), blk(10, 2, 3)];
        assert!(matches!(
            check(&blocks, &[0, 5], 20, 1),
            Err(ArenaViolation::Overlap {
                a: 0,
                b: 1,
                step: 2
            })
        ));
        assert!(check(&blocks, &[0, 10], 20, 1).is_ok());
        assert!(matches!(
            check(&blocks, &[0, 11], 20, 1),
            Err(ArenaViolation::OutOfArena { block: 1, .. })
        ));
        assert!(matches!(check(&blocks, &[0, 12], 30, 4), Ok(())));
        assert!(matches!(
            check(&blocks, &[0, 11], 30, 4),
            Err(ArenaViolation::Misaligned { block: 1, .. })
        ));
    }

    /// A distractor live beside the chain's last output takes the
    /// convolution's bytes under plain best-fit; with the pair the last
    /// output goes exactly over the convolution's output, in no more bytes.
    #[test]
    fn preferred_pairs_share_an_offset() {
        // conv out, batch norm out, distractor, relu out.
        let blocks = [
            blk(100, 0, 1),
            blk(100, 1, 2),
            blk(100, 2, 3),
            blk(100, 2, 3),
        ];
        let plain = assign(&blocks);
        assert_ne!(plain.offsets[3], plain.offsets[0]);
        let a = assign_preferring(&blocks, &[(3, 0)]);
        check(&blocks, &a.offsets, a.size, 1).unwrap();
        assert_eq!(a.offsets[3], a.offsets[0]);
        assert_eq!(a.size, lower_bound(&blocks));
        assert!(a.size <= plain.size);
        // Blocks live together are never put on one offset.
        let a = assign_preferring(&blocks, &[(1, 0), (2, 3)]);
        check(&blocks, &a.offsets, a.size, 1).unwrap();
    }

    proptest! {
        /// Any preferences: a sound arena, never larger than without them.
        #[test]
        fn preferences_never_cost_memory(
            raw in prop::collection::vec((1u64..64, 0usize..40, 0usize..12), 1..60),
            pairs in prop::collection::vec((0usize..60, 0usize..60), 0..30)
        ) {
            let blocks: Vec<Block> = raw
                .iter()
                .map(|&(s, f, len)| blk(s * 256, f, f + len))
                .collect();
            let a = assign_preferring(&blocks, &pairs);
            check(&blocks, &a.offsets, a.size, 256).unwrap();
            prop_assert!(a.size <= assign(&blocks).size);
            prop_assert!(lower_bound(&blocks) <= a.size);
        }

        #[test]
        fn random_blocks_never_overlap(
            raw in prop::collection::vec((1u64..64, 0usize..40, 0usize..12), 0..80)
        ) {
            let blocks: Vec<Block> = raw
                .iter()
                .map(|&(s, f, len)| blk(s * 256, f, f + len))
                .collect();
            let total: u64 = blocks.iter().map(|b| b.size).sum();
            let lb = lower_bound(&blocks);
            for a in [assign(&blocks), assign_with(&blocks, Strategy::Online)] {
                check(&blocks, &a.offsets, a.size, 256).unwrap();
                prop_assert!(lb <= a.size);
                prop_assert!(a.size <= total);
            }
        }
    }
}
