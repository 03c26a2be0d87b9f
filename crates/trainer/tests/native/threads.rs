//! Thread counts: data-parallel micro-batches and the split inside each product take the
//! serial steps bit for bit (part of the `native` test binary).

use sluice_trainer::SupervisedExample;
use sluice_trainer::config::LossKind;

use super::{NativeTrainer, config, fixed_batch, params, tiny};

#[test]
fn data_parallel_micro_batches_take_the_serial_steps_bit_for_bit() {
    // Four one-row micro-batches over 1, 2 and 3 compute threads: worker w trains micro-batches
    // w, w + k, … and their gradients are added in micro-batch order, so every thread count
    // takes the serial steps exactly (a warm-up or an RL run follows one trajectory whatever
    // `trainer.threads` is).
    let run = |threads: usize| {
        let mut c = config(0.01, 1);
        c.threads = threads;
        c.batcher.share_prompts = false;
        c.loss.kind = LossKind::DecoupledPpo;
        c.minibatches = 2;
        let mut t = NativeTrainer::new(tiny(8), c, None).unwrap();
        let mut norms = Vec::new();
        for _ in 0..2 {
            let (s, _) = t.rl_step(&fixed_batch()).unwrap();
            assert_eq!(
                s.micro_batches, 4,
                "two minibatches of two one-row micro-batches"
            );
            norms.push(s.optim.unwrap().grad_norm);
        }
        let examples = [SupervisedExample {
            prompt: &[10, 11, 12],
            completion: &[20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
        }; 3];
        let (s, _) = t.supervised_step(&examples).unwrap();
        assert!(s.micro_batches >= 3, "{}", s.micro_batches);
        norms.push(s.optim.unwrap().grad_norm);
        (norms, params(&t))
    };
    let serial = run(1);
    for threads in [2, 3] {
        assert!(run(threads) == serial, "{threads} threads");
    }
}

#[test]
fn the_thread_count_does_not_change_a_step() {
    // One large micro-batch (the split inside each product and each fused kernel) and several
    // (data-parallel micro-batches): every thread count takes the same step, bit for bit.
    let prompt: Vec<u32> = (10..30).collect();
    let completion: Vec<u32> = (0..120).map(|i| 30 + i % 70).collect();
    let run = |threads: usize, rows: usize| {
        let mut c = config(0.01, rows);
        c.batcher.row_len = 256;
        c.threads = threads;
        let mut t = NativeTrainer::new(tiny(8), c, None).unwrap();
        let ex = vec![
            SupervisedExample {
                prompt: &prompt,
                completion: &completion,
            };
            48
        ];
        let (s, _) = t.supervised_step(&ex).unwrap();
        (s.optim.unwrap().grad_norm, params(&t))
    };
    for rows in [32, 8] {
        let serial = run(1, rows);
        for threads in [2, 3] {
            let other = run(threads, rows);
            let differ: Vec<usize> = (0..serial.1.len())
                .filter(|&i| serial.1[i] != other.1[i])
                .collect();
            assert!(
                differ.is_empty() && serial.0 == other.0,
                "{rows} rows, {threads} threads: parameters {differ:?} differ"
            );
        }
    }
}
