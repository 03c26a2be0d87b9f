//! The paged KV cache: the same logits as the contiguous cache, prefix blocks shared by content
//! and weight version only, a clear refusal when the pool is full, and the block allocator's
//! invariants under random use; decode steps over fixed buffers (what a CUDA graph replays) as
//! the eager steps.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use common::{ALL_ARCHS, snapshot, tiny_config};
use sluice_core::PolicyVersion;
use sluice_model::paged::{BlockAllocator, BlockKey};
use sluice_model::{
    ContiguousKvCache, InferenceModel, KvCache, LogitsWanted, ModelError, ModelWeights,
    PagedKvCache, StepInput,
};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Per step, `(sequence, tokens it adds)`.
type Steps = Vec<Vec<(usize, usize)>>;

/// A ragged schedule: prefills of different lengths, multi-token extensions and batched
/// one-token decode steps, across block boundaries (blocks of 4 tokens).
fn schedule() -> (Vec<Vec<u32>>, Steps) {
    let lens = [13usize, 9, 22, 5, 17];
    let seqs: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(s, &n)| (0..n).map(|i| ((i * 7 + s * 5 + 3) % 23) as u32).collect())
        .collect();
    let mut steps = vec![
        vec![(0, 6), (1, 3)],
        vec![(0, 1), (1, 1), (2, 9)],
        vec![(3, 2), (4, 7), (2, 1)],
        // Chunks continuing a cached sequence beside a decoding one.
        vec![(0, 3), (1, 1), (3, 2)],
    ];
    let mut planned = [10usize, 5, 10, 4, 7];
    while planned.iter().zip(&lens).any(|(p, l)| p < l) {
        let step: Vec<(usize, usize)> = (0..lens.len())
            .filter(|&s| planned[s] < lens[s])
            .map(|s| (s, 1))
            .collect();
        for &(s, _) in &step {
            planned[s] += 1;
        }
        steps.push(step);
    }
    (seqs, steps)
}

fn run(model: &InferenceModel, cache: &mut dyn KvCache) -> Vec<Tensor> {
    let (seqs, steps) = schedule();
    let mut fed = vec![0usize; seqs.len()];
    let mut out = Vec::new();
    for step in steps {
        let inputs: Vec<StepInput<'_>> = step
            .iter()
            .map(|&(s, n)| {
                let input = StepInput {
                    seq: s as u64,
                    tokens: &seqs[s][fed[s]..fed[s] + n],
                };
                fed[s] += n;
                input
            })
            .collect();
        out.push(model.step(cache, &inputs, LogitsWanted::All).unwrap());
    }
    out
}

#[test]
fn paged_logits_equal_contiguous_logits() {
    for arch in ALL_ARCHS {
        let snap = Arc::new(snapshot(tiny_config(arch, false), 5, DType::F32));
        let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
        let mut contiguous = ContiguousKvCache::new(model.config(), DType::F32, snap.device());
        // 300 blocks: the pools start at 64 and grow (a copy) while sequences hold blocks.
        let mut paged =
            PagedKvCache::new(model.config(), DType::F32, snap.device(), 300, 4).unwrap();
        // Scatter the free list (so block tables are not runs of consecutive blocks) and fill
        // most of the first 64 blocks, so the pools grow mid-run with keys and values in them.
        let scratch: Vec<u64> = (100..160).collect();
        for &s in &scratch {
            paged.begin_step(s, &[1], PolicyVersion(0)).unwrap();
        }
        for &s in scratch.iter().step_by(6) {
            paged.remove(s);
        }
        assert_eq!(paged.allocated_blocks(), 64);
        let a = run(&model, &mut contiguous);
        let b = run(&model, &mut paged);
        for (step, (a, b)) in a.iter().zip(&b).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(d <= 1e-5, "{arch:?} step {step}: max |Δlogit| = {d}");
        }
        for s in 0..5 {
            assert_eq!(paged.seq_len(s), contiguous.seq_len(s));
        }
        let grown = paged.allocated_blocks();
        assert!(
            grown > 64 && grown < paged.total_blocks(),
            "memory grows with use (mid-run here), not to the budget at once: {grown}"
        );
        let table = paged.block_table(2);
        assert!(
            table.windows(2).any(|w| w[1] != w[0] + 1),
            "the test meant to exercise scattered tables: {table:?}"
        );
        paged.allocator().check().unwrap();
    }
}

/// Decode steps over fixed buffers (`set_decode_graphs`: on a GPU captured and replayed as CUDA
/// graphs; on the CPU run eagerly over the same buffers) give the eager steps' logits: batches of
/// 5 down to 1 sequences padded to buckets of 8, 4, 2 and 1 (padding rows storing into the
/// scratch block), stacked and unstacked products, the pools growing mid-run and the weights
/// swapped halfway; then the caches hold the same lengths, and one block more is in use: the
/// padding rows'.
#[test]
fn decode_steps_over_fixed_buffers_equal_the_eager_steps() {
    for (arch, stacked) in ALL_ARCHS.into_iter().flat_map(|a| [(a, false), (a, true)]) {
        let snap = Arc::new(snapshot(tiny_config(arch, false), 5, DType::F32));
        let swapped = versioned(&snapshot(tiny_config(arch, false), 6, DType::F32), 1);
        let model = |graphs: bool| {
            let mut m = InferenceModel::new(Arc::clone(&snap)).unwrap();
            m.set_stacked_products(stacked).unwrap();
            m.set_decode_graphs(graphs);
            m
        };
        let (mut eager, mut graphed) = (model(false), model(true));
        let cache = || {
            let mut c =
                PagedKvCache::new(eager.config(), DType::F32, snap.device(), 300, 4).unwrap();
            // Most of the first 64 blocks taken, so the pools grow mid-run.
            for s in 100..158 {
                c.begin_step(s, &[1], PolicyVersion(0)).unwrap();
            }
            c
        };
        let (mut a, mut b) = (cache(), cache());
        let (seqs, steps) = schedule();
        let mut fed = vec![0usize; seqs.len()];
        let half = steps.len() / 2;
        for (i, step) in steps.iter().enumerate() {
            if i == half {
                eager.swap_weights(Arc::clone(&swapped)).unwrap();
                graphed.swap_weights(Arc::clone(&swapped)).unwrap();
            }
            let inputs: Vec<StepInput<'_>> = step
                .iter()
                .map(|&(s, n)| StepInput {
                    seq: s as u64,
                    tokens: &seqs[s][fed[s]..fed[s] + n],
                })
                .collect();
            let want = eager
                .step_paged(&mut a, &inputs, LogitsWanted::Last)
                .unwrap();
            let got = graphed
                .step_paged(&mut b, &inputs, LogitsWanted::Last)
                .unwrap();
            assert_eq!(got.dims(), want.dims(), "{arch:?} step {i}");
            let d = max_abs_diff(&want, &got);
            assert!(
                d <= 1e-5,
                "{arch:?} (stacked {stacked}) step {i}: max |Δlogit| = {d}"
            );
            for &(s, n) in step {
                fed[s] += n;
            }
        }
        assert!(b.allocated_blocks() > 64, "the pools grew mid-run");
        for s in 0..seqs.len() as u64 {
            assert_eq!(a.seq_len(s), b.seq_len(s), "{arch:?} sequence {s}");
        }
        let stats = graphed.decode_graph_stats().unwrap();
        let decode_steps = steps
            .iter()
            .filter(|s| s.iter().all(|&(_, n)| n == 1))
            .count();
        assert_eq!(stats.steps as usize, decode_steps, "{stats:?}");
        assert_eq!((stats.captures, stats.replays, stats.failed), (0, 0, None));
        assert_eq!(eager.decode_graph_stats(), None);
        b.allocator().check().unwrap();
        assert_eq!(
            b.blocks_in_use(),
            a.blocks_in_use() + 1,
            "one scratch block"
        );
        let tables: Vec<u32> = (0..seqs.len() as u64)
            .flat_map(|s| b.block_table(s).to_vec())
            .collect();
        let in_a: Vec<u32> = (0..seqs.len() as u64)
            .flat_map(|s| a.block_table(s).to_vec())
            .collect();
        assert_eq!(tables.len(), in_a.len(), "the same tables' sizes");
        // The one block in use beyond the tables' (the prefill-only sequences' included) is the
        // padding rows': no sequence holds it.
        let held: std::collections::HashSet<u32> = (0..seqs.len() as u64)
            .chain(100..158)
            .flat_map(|s| b.block_table(s).to_vec())
            .collect();
        assert_eq!(
            held.len() + 1,
            b.blocks_in_use(),
            "the scratch block is in no table"
        );
    }
}

/// With every block of the pool in use, a padded decode step has no block for its padding
/// rows: it runs eagerly, unpadded, rather than failing.
#[test]
fn a_full_pool_runs_the_decode_step_unpadded() {
    let arch = ALL_ARCHS[0];
    let snap = Arc::new(snapshot(tiny_config(arch, false), 5, DType::F32));
    let mut model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    model.set_decode_graphs(true);
    // Three sequences of 7 tokens in two blocks of 4 each: the pool's six blocks, each with
    // room for one more token.
    let mut cache = PagedKvCache::new(model.config(), DType::F32, snap.device(), 6, 4).unwrap();
    let prompts: Vec<Vec<u32>> = (0..3).map(|s| (0..7).map(|t| s + t).collect()).collect();
    model
        .step_paged(
            &mut cache,
            &StepInput::numbered(&prompts),
            LogitsWanted::Last,
        )
        .unwrap();
    assert_eq!(cache.available_blocks(), 0);
    let next: Vec<Vec<u32>> = (0..3).map(|s| vec![s + 1]).collect();
    let logits = model
        .step_paged(&mut cache, &StepInput::numbered(&next), LogitsWanted::Last)
        .unwrap();
    assert_eq!(logits.dims()[0], 3);
    assert_eq!(model.decode_graph_stats().unwrap().steps, 0, "run eagerly");
    assert_eq!(cache.seq_len(2), 8);
}

/// bf16 takes the path a GPU takes: no CPU decode kernel, so RoPE through candle-nn on
/// transposed heads, every sequence's rows gathered from the pool per layer, and the decode
/// mask. Same logits as the contiguous cache in bf16, up to bf16's rounding of the same sums.
#[test]
fn paged_logits_equal_contiguous_logits_on_the_gathering_path() {
    for arch in ALL_ARCHS {
        let full = snapshot(tiny_config(arch, false), 5, DType::F32);
        let snap = Arc::new(full.to(&candle_core::Device::Cpu, DType::BF16).unwrap());
        let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
        let mut contiguous = ContiguousKvCache::new(model.config(), DType::BF16, snap.device());
        let mut paged =
            PagedKvCache::new(model.config(), DType::BF16, snap.device(), 300, 4).unwrap();
        let a = run(&model, &mut contiguous);
        let b = run(&model, &mut paged);
        for (step, (a, b)) in a.iter().zip(&b).enumerate() {
            let scale = a
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let d = max_abs_diff(a, b);
            assert!(
                d <= 1e-2 * scale,
                "{arch:?} step {step}: max |Δlogit| = {d} of {scale}"
            );
        }
    }
}

fn versioned(snap: &ModelWeights, version: u64) -> Arc<ModelWeights> {
    let map: HashMap<String, Tensor> = snap
        .iter()
        .map(|(n, t)| (n.to_owned(), t.clone()))
        .collect();
    Arc::new(ModelWeights::new(Arc::clone(snap.config()), PolicyVersion(version), map).unwrap())
}

#[test]
fn a_shared_prompt_is_computed_once_per_weight_version() {
    let cfg = tiny_config(sluice_model::Architecture::Qwen2, true);
    let snap = Arc::new(snapshot(cfg, 9, DType::F32));
    let mut model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let mut paged = PagedKvCache::new(model.config(), DType::F32, snap.device(), 32, 4).unwrap();
    let mut contiguous = ContiguousKvCache::new(model.config(), DType::F32, snap.device());
    let prompt: Vec<u32> = (0..14).map(|i| (i * 5 + 2) % 23).collect();
    let step = |m: &InferenceModel, c: &mut dyn KvCache, seq: u64, tokens: &[u32]| {
        m.step(c, &[StepInput { seq, tokens }], LogitsWanted::Last)
            .unwrap()
    };
    // The first rollout computes the whole prompt; its three full blocks get registered.
    assert_eq!(paged.attach_prefix(0, &prompt, model.version()), 0);
    let first = step(&model, &mut paged, 0, &prompt);
    let reference = step(&model, &mut contiguous, 0, &prompt);
    assert!(max_abs_diff(&first, &reference) <= 1e-5);
    // The group's other rollouts take those blocks and compute only the last two tokens.
    for seq in 1..4 {
        let matched = paged.attach_prefix(seq, &prompt, model.version());
        assert_eq!(matched, 12);
        assert_eq!(&paged.block_table(seq)[..3], &paged.block_table(0)[..3]);
        let logits = step(&model, &mut paged, seq, &prompt[matched..]);
        assert!(max_abs_diff(&logits, &reference) <= 1e-5);
    }
    let shared = paged.block_table(0)[0];
    assert_eq!(paged.allocator().refs(shared), 4);
    // A prompt whose length is a whole number of blocks leaves its last block to compute.
    assert_eq!(paged.attach_prefix(10, &prompt[..12], model.version()), 8);
    paged.remove(10);
    // Released, the blocks stay cached for a resume at the same version...
    for seq in 0..4 {
        assert!(paged.remove(seq));
    }
    assert_eq!(paged.blocks_in_use(), 0);
    assert_eq!(paged.cached_blocks(), 3);
    assert_eq!(paged.attach_prefix(20, &prompt, model.version()), 12);
    paged.remove(20);
    // ...but never for a request on newer weights: they are forgotten at the first step on them.
    model.swap_weights(versioned(&snap, 1)).unwrap();
    let other: Vec<u32> = vec![3, 4];
    step(&model, &mut paged, 30, &other);
    assert_eq!(paged.cached_blocks(), 0);
    assert_eq!(paged.attach_prefix(31, &prompt, model.version()), 0);
    paged.allocator().check().unwrap();
}

/// With a version lag, a request on newer weights may start on a prompt computed by older ones
/// (up to the lag; the newest version's blocks win when they match as far), shares nothing it
/// computes on top, and lowering the lag forgets the older keys at once.
#[test]
fn a_version_lag_hands_older_blocks_to_new_requests_up_to_the_lag() {
    let cfg = tiny_config(sluice_model::Architecture::Qwen2, true);
    let snap = Arc::new(snapshot(cfg, 4, DType::F32));
    let mut model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let mut paged = PagedKvCache::new(model.config(), DType::F32, snap.device(), 64, 4).unwrap();
    paged.set_version_lag(1);
    let prompt: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % 23).collect();
    let step = |m: &InferenceModel, c: &mut dyn KvCache, seq: u64, tokens: &[u32]| {
        m.step(c, &[StepInput { seq, tokens }], LogitsWanted::Last)
            .unwrap()
    };
    // Version 0 computes the prompt: three full blocks registered.
    assert_eq!(paged.attach_prefix(0, &prompt, model.version()), 0);
    let v0_logits = step(&model, &mut paged, 0, &prompt);
    let v0_blocks = paged.block_table(0)[..3].to_vec();
    paged.remove(0);
    // On version 1 a new request still starts on them (one version behind)...
    model.swap_weights(versioned(&snap, 1)).unwrap();
    assert_eq!(paged.attach_prefix(1, &prompt, model.version()), 12);
    assert_eq!(&paged.block_table(1)[..3], &v0_blocks[..]);
    // ...and its logits are those of version 0's keys and values with version 1's last rows:
    // the same weights here (versioned copies), so equal to the version 0 logits.
    let logits = step(&model, &mut paged, 1, &prompt[12..]);
    assert!(max_abs_diff(&logits, &v0_logits) <= 1e-5);
    // Mixed versions: what it computed on top is not registered.
    step(&model, &mut paged, 1, &[5, 6]);
    paged.remove(1);
    assert_eq!(paged.cached_blocks(), 3);
    // A version-1 computation of the same prompt is preferred once registered.
    let longer: Vec<u32> = prompt.iter().chain(&[1, 2, 3]).copied().collect();
    assert_eq!(paged.attach_prefix(2, &[99], model.version()), 0);
    step(&model, &mut paged, 2, &longer);
    paged.remove(2);
    assert_eq!(paged.attach_prefix(3, &longer, model.version()), 16);
    let v1_blocks = paged.block_table(3)[..3].to_vec();
    assert!(
        v1_blocks.iter().all(|b| !v0_blocks.contains(b)),
        "{v1_blocks:?}"
    );
    paged.remove(3);
    // Version 2: version 0 is two behind, forgotten; version 1 is still served.
    model.swap_weights(versioned(&snap, 2)).unwrap();
    step(&model, &mut paged, 4, &[7]);
    paged.remove(4);
    assert_eq!(paged.attach_prefix(5, &longer, model.version()), 16);
    paged.remove(5);
    // Lag 0 (a drain or abort_resume update): only version 2 blocks remain servable.
    paged.set_version_lag(0);
    assert_eq!(paged.attach_prefix(6, &longer, model.version()), 0);
    paged.remove(6);
    paged.allocator().check().unwrap();
}

#[test]
fn in_flight_sequences_keep_old_blocks_but_do_not_share_mixed_ones() {
    let cfg = tiny_config(sluice_model::Architecture::Llama, true);
    let snap = Arc::new(snapshot(cfg, 2, DType::F32));
    let mut model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let mut paged = PagedKvCache::new(model.config(), DType::F32, snap.device(), 32, 4).unwrap();
    let tokens: Vec<u32> = (0..16).map(|i| (i * 3 + 1) % 23).collect();
    model
        .step(
            &mut paged,
            &[StepInput {
                seq: 0,
                tokens: &tokens[..6],
            }],
            LogitsWanted::Last,
        )
        .unwrap();
    model.swap_weights(versioned(&snap, 1)).unwrap();
    // Version 1 continues the version-0 sequence: its keys and values mix versions from here.
    model
        .step(
            &mut paged,
            &[StepInput {
                seq: 0,
                tokens: &tokens[6..12],
            }],
            LogitsWanted::Last,
        )
        .unwrap();
    assert_eq!(paged.seq_len(0), 12);
    for v in [0, 1] {
        assert_eq!(
            paged.attach_prefix(100 + v, &tokens, PolicyVersion(v)),
            0,
            "v{v}"
        );
        paged.remove(100 + v);
    }
    paged.allocator().check().unwrap();
}

#[test]
fn a_full_pool_is_refused_with_the_numbers() {
    let cfg = tiny_config(sluice_model::Architecture::Qwen3, true);
    let snap = Arc::new(snapshot(cfg, 1, DType::F32));
    let model = InferenceModel::new(Arc::clone(&snap)).unwrap();
    let mut paged = PagedKvCache::new(model.config(), DType::F32, snap.device(), 3, 4).unwrap();
    let tokens: Vec<u32> = (0..13).map(|i| i % 23).collect();
    let err = model
        .step(
            &mut paged,
            &[StepInput {
                seq: 7,
                tokens: &tokens,
            }],
            LogitsWanted::Last,
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::KvCacheFull { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "kv cache full: sequence 7 needs 4 more blocks, 3 of 3 are available"
    );
    assert_eq!(paged.blocks_in_use(), 0, "a refused step takes no block");
    // Twelve tokens fit exactly.
    model
        .step(
            &mut paged,
            &[StepInput {
                seq: 8,
                tokens: &tokens[..12],
            }],
            LogitsWanted::Last,
        )
        .unwrap();
    assert_eq!(paged.available_blocks(), 0);
}

/// A small deterministic generator (splitmix64), enough for randomized invariants.
struct Rng(u64);

impl Rng {
    fn random_range(&mut self, range: std::ops::Range<u64>) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        range.start + (z ^ (z >> 31)) % (range.end - range.start)
    }
}

fn key(parent: u64, version: u64, tokens: &[u32]) -> BlockKey {
    BlockKey {
        parent,
        version: PolicyVersion(version),
        tokens: tokens.to_vec(),
    }
}

/// Random allocate / share / register / release / version bumps against a simple model of who
/// holds what: after every operation the allocator's states are consistent, every reference is
/// accounted for, a shared block's key is of the version asked for, and releasing everything
/// leaves no block behind.
#[test]
fn block_allocator_invariants_under_random_use() {
    for seed in 0..20u64 {
        let mut rng = Rng(seed);
        let total = rng.random_range(1..24) as usize;
        let mut alloc = BlockAllocator::new(total);
        let mut held: Vec<u32> = Vec::new();
        let mut version = 0u64;
        for _ in 0..400 {
            match rng.random_range(0..10) {
                0..=2 => match alloc.allocate() {
                    Some(b) => {
                        assert_eq!(alloc.refs(b), 1, "a fresh block has one reference");
                        assert!(alloc.key(b).is_none(), "a fresh block has no key");
                        held.push(b);
                    }
                    None => assert_eq!(alloc.available(), 0),
                },
                3 | 4 if !held.is_empty() => {
                    let b = held[rng.random_range(0..held.len() as u64) as usize];
                    let k = key(
                        rng.random_range(0..3),
                        version,
                        &[rng.random_range(0..4) as u32],
                    );
                    let had = alloc.contains(&k);
                    let registered = alloc.register(b, k.clone());
                    assert!(!(had && registered), "a key is registered once");
                }
                5 => {
                    let k = key(
                        rng.random_range(0..3),
                        rng.random_range(0..version + 1),
                        &[rng.random_range(0..4) as u32],
                    );
                    if let Some(b) = alloc.acquire(&k) {
                        assert_eq!(alloc.key(b), Some(&k), "a hit holds what was asked for");
                        assert!(
                            k.version.0 == version,
                            "no block of an older version is shared"
                        );
                        held.push(b);
                    }
                }
                6..=8 if !held.is_empty() => {
                    let b = held.swap_remove(rng.random_range(0..held.len() as u64) as usize);
                    alloc.release(b);
                }
                9 => {
                    version += 1;
                    alloc.forget_before(PolicyVersion(version));
                }
                _ => {}
            }
            alloc.check().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            let mut count: HashMap<u32, u32> = HashMap::new();
            for &b in &held {
                *count.entry(b).or_default() += 1;
            }
            for b in 0..total as u32 {
                assert_eq!(
                    alloc.refs(b),
                    count.get(&b).copied().unwrap_or(0),
                    "block {b}"
                );
            }
            assert_eq!(alloc.in_use(), count.len());
        }
        for b in held.drain(..) {
            alloc.release(b);
        }
        assert_eq!(alloc.available(), total, "seed {seed}: a block leaked");
        assert_eq!(alloc.in_use(), 0);
    }
}
