//! The sample order: permutations, rank splits as PyTorch's DistributedSampler, page grouping,
//! determinism and resume.

use std::collections::HashSet;

use proptest::prelude::*;
use redline_loader::{Mode, Order, Position, Uneven};

fn ranks(len: usize, world: usize, mode: Mode, uneven: Uneven, epoch: u64) -> Vec<Vec<u64>> {
    (0..world)
        .map(|r| {
            Order::new(len, 7, mode)
                .and_then(|o| o.sharded(r, world, uneven))
                .map(|o| o.epoch(epoch))
                .unwrap()
        })
        .collect()
}

fn mode() -> impl Strategy<Value = Mode> {
    prop_oneof![
        Just(Mode::Random),
        Just(Mode::Sequential),
        (1usize..=9, 1usize..=4).prop_map(|(group, window)| Mode::PageGrouped { group, window }),
    ]
}

proptest! {
    #[test]
    fn every_sample_once_per_epoch_across_ranks(len in 1usize..300, world in 1usize..5, mode in mode(), epoch in 0u64..4) {
        prop_assume!(len >= world);
        let all = ranks(len, world, mode, Uneven::Pad, epoch);
        let per_rank = len.div_ceil(world);
        prop_assert!(all.iter().all(|r| r.len() == per_rank));
        let seen: HashSet<u64> = all.iter().flatten().copied().collect();
        // Padding repeats samples; it never loses one, and never invents one.
        prop_assert_eq!(seen.len(), len);
        prop_assert!(seen.iter().all(|&i| (i as usize) < len));
        if len % world == 0 && !matches!(mode, Mode::PageGrouped { .. }) {
            prop_assert_eq!(all.iter().map(Vec::len).sum::<usize>(), len);
        }
    }

    #[test]
    fn drop_gives_every_rank_the_floor_and_no_repeats(len in 1usize..300, world in 1usize..5, epoch in 0u64..4) {
        prop_assume!(len >= world);
        let all = ranks(len, world, Mode::Random, Uneven::Drop, epoch);
        prop_assert!(all.iter().all(|r| r.len() == len / world));
        let flat: Vec<u64> = all.iter().flatten().copied().collect();
        let unique: HashSet<u64> = flat.iter().copied().collect();
        prop_assert_eq!(unique.len(), flat.len());
    }

    #[test]
    fn the_order_is_a_pure_function_and_resume_skips_to_the_position(len in 1usize..200, mode in mode(), epoch in 0u64..5, index in 0usize..250) {
        let order = Order::new(len, 99, mode).unwrap();
        prop_assert_eq!(order.epoch(epoch), Order::new(len, 99, mode).unwrap().epoch(epoch));
        let full = order.epoch(epoch);
        let rest = order.remaining(Position { epoch, index });
        prop_assert_eq!(&rest[..], &full[index.min(full.len())..]);
    }
}

#[test]
fn matches_distributed_samplers_padding_and_striding() {
    // Sequential order makes PyTorch's rule visible: 10 samples on 4 ranks pad to 12 with
    // samples 0 and 1 again, and rank r takes positions r, r + 4, r + 8.
    let all = ranks(10, 4, Mode::Sequential, Uneven::Pad, 0);
    assert_eq!(all[0], [0, 4, 8]);
    assert_eq!(all[1], [1, 5, 9]);
    assert_eq!(all[2], [2, 6, 0]);
    assert_eq!(all[3], [3, 7, 1]);
    let dropped = ranks(10, 4, Mode::Sequential, Uneven::Drop, 0);
    assert_eq!(dropped[3], [3, 7]);
}

#[test]
fn epochs_and_seeds_change_the_permutation() {
    let order = Order::new(1000, 1, Mode::Random).unwrap();
    assert_ne!(order.epoch(0), order.epoch(1));
    assert_ne!(
        order.epoch(0),
        Order::new(1000, 2, Mode::Random).unwrap().epoch(0)
    );
    let mut sorted = order.epoch(3);
    sorted.sort_unstable();
    assert_eq!(sorted, (0..1000).collect::<Vec<u64>>());
}

#[test]
fn page_grouped_ranks_read_disjoint_groups_and_stay_local() {
    let (group, window) = (16, 4);
    let mode = Mode::PageGrouped { group, window };
    let all = ranks(16 * 40, 2, mode, Uneven::Pad, 3);
    let groups_of = |r: &Vec<u64>| {
        r.iter()
            .map(|&i| i / group as u64)
            .collect::<HashSet<u64>>()
    };
    assert!(groups_of(&all[0]).is_disjoint(&groups_of(&all[1])));
    // Within each window of samples, at most `window` groups: reads stay page-local.
    for r in &all {
        for chunk in r.chunks(group * window) {
            let groups: HashSet<u64> = chunk.iter().map(|&i| i / group as u64).collect();
            assert!(groups.len() <= window, "{groups:?}");
        }
    }
    // And it is not simply sequential.
    assert_ne!(all[0][..32], (0..32).collect::<Vec<u64>>()[..]);
}

#[test]
fn bad_configurations_are_refused_with_a_reason() {
    let err = Order::new(10, 0, Mode::Random)
        .unwrap()
        .sharded(4, 4, Uneven::Pad)
        .unwrap_err();
    assert!(err.to_string().contains("rank 4 of a world of 4"), "{err}");
    let err = Order::new(3, 0, Mode::Random)
        .unwrap()
        .sharded(0, 4, Uneven::Drop)
        .unwrap_err();
    assert!(err.to_string().contains("leaves nothing"), "{err}");
    let err = Order::new(
        3,
        0,
        Mode::PageGrouped {
            group: 0,
            window: 1,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("group and window"), "{err}");
}

/// The samples a job of `world` ranks consumes in steps of `per_rank` samples each, in the
/// order a single process would see them (rank 0's, rank 1's, … interleaved by position).
fn consumed(order_len: usize, world: usize, from: Position, per_rank: usize) -> Vec<u64> {
    let ranks = ranks(order_len, world, Mode::Random, Uneven::Drop, from.epoch);
    let mut out = Vec::new();
    for i in from.index..from.index + per_rank {
        for rank in &ranks {
            out.push(rank[i]);
        }
    }
    out
}

#[test]
fn a_position_resumes_the_same_global_sequence_on_another_world_size() {
    // 2 ranks take 6 samples each, then the job resumes on 4 ranks (3 each), or on 3 (4 each):
    // together, the samples in order are those of one process reading the permutation.
    let single = consumed(48, 1, Position::default(), 24);
    let before = consumed(48, 2, Position::default(), 6);
    assert_eq!(before, single[..12]);
    for world in [4, 3, 1] {
        let at = Position { epoch: 0, index: 6 }
            .reshard(Mode::Random, 2, world)
            .unwrap();
        assert_eq!(at.index * world, 12);
        let after = consumed(48, world, at, 12 / world);
        assert_eq!(after, single[12..24], "resumed on {world} ranks");
    }
    let same = Position { epoch: 3, index: 5 };
    assert_eq!(same.reshard(Mode::Random, 4, 4).unwrap(), same);
}

#[test]
fn a_position_that_cannot_be_split_evenly_or_a_page_grouped_one_is_refused() {
    let at = Position { epoch: 1, index: 5 };
    let err = at.reshard(Mode::Random, 2, 4).unwrap_err().to_string();
    assert!(
        err.contains("10 samples") && err.contains("4 ranks"),
        "{err}"
    );
    let grouped = Mode::PageGrouped {
        group: 4,
        window: 2,
    };
    let err = at.reshard(grouped, 2, 1).unwrap_err().to_string();
    assert!(err.contains("resumes only on 2"), "{err}");
    assert!(at.reshard(Mode::Random, 0, 1).is_err());
}

#[test]
fn exact_sharding_gives_every_sample_to_one_rank_once() {
    for (len, world) in [(10, 4), (3, 4), (12, 3), (1, 1)] {
        let all = ranks(len, world, Mode::Random, Uneven::Exact, 2);
        let mut seen: Vec<u64> = all.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(
            seen,
            (0..len as u64).collect::<Vec<_>>(),
            "{len} over {world}"
        );
        let sizes: Vec<usize> = all.iter().map(Vec::len).collect();
        assert!(
            sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
            "{sizes:?}"
        );
        for (r, rank) in all.iter().enumerate() {
            let order = Order::new(len, 7, Mode::Random).unwrap();
            let per = order.sharded(r, world, Uneven::Exact).unwrap().per_rank();
            assert_eq!(per, rank.len());
        }
    }
    let grouped = Mode::PageGrouped {
        group: 2,
        window: 1,
    };
    let err = Order::new(8, 1, grouped)
        .unwrap()
        .sharded(0, 2, Uneven::Exact)
        .unwrap_err()
        .to_string();
    assert!(err.contains("page-grouped"), "{err}");
}
