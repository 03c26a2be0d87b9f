//! Ids minted concurrently by several nodes (each with several threads) never collide.

use std::collections::HashSet;
use std::sync::Arc;

use proptest::prelude::*;
use sluice_core::{GroupId, GroupIdGenerator, NodeId, RunId};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn concurrent_ids_never_collide(
        nodes in 1u32..5,
        threads_per_node in 1usize..4,
        ids_per_thread in 1usize..300,
        start in 0u64..1_000_000,
        run_name in "[a-z]{1,8}",
    ) {
        let run = RunId::from_name(&run_name);
        let generators: Vec<Arc<GroupIdGenerator>> = (0..nodes)
            .map(|n| Arc::new(GroupIdGenerator::new(run, NodeId(n), start)))
            .collect();
        let handles: Vec<_> = generators
            .iter()
            .flat_map(|g| (0..threads_per_node).map(move |_| Arc::clone(g)))
            .map(|g| std::thread::spawn(move || {
                (0..ids_per_thread).map(|_| g.next_id()).collect::<Vec<GroupId>>()
            }))
            .collect();
        let mut seen = HashSet::new();
        let mut rollouts = HashSet::new();
        for h in handles {
            for id in h.join().unwrap() {
                prop_assert!(seen.insert(id), "duplicate {}", id);
                // Rollout ids and their string forms are unique too.
                prop_assert!(rollouts.insert(id.rollout(0).to_string()));
            }
        }
        let per_node = (threads_per_node * ids_per_thread) as u64;
        prop_assert_eq!(seen.len() as u64, u64::from(nodes) * per_node);
        for g in &generators {
            prop_assert_eq!(g.peek_next(), start + per_node);
        }
    }
}
