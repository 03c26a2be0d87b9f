//! Decode steps over fixed buffers, replayed as CUDA graphs
//! ([`InferenceModel::set_decode_graphs`]).
//!
//! A decode-only step (one new token per sequence, the last rows' logits wanted) over a paged
//! cache that attends itself runs at a padded batch size, the smallest of
//! [`DECODE_GRAPH_BUCKETS`] that holds it. It reads its token ids, positions and row tables from
//! one device buffer per bucket (one upload a step) and leaves its logits in another. On a GPU
//! a bucket's first step runs eagerly once (loading the kernels, filling candle's cache of the
//! small uploads its ops make) and is captured into a CUDA graph; later steps upload their
//! words and replay it: one launch for the whole model, where the eager step issues about
//! eight per layer. A graph is captured again when what it read changed: the weights (a swap),
//! the pools (grown) or the rotary tables. On the CPU the same step runs eagerly: the tests'
//! reference for what a graph replays, with nothing to gain there.

use std::sync::Mutex;

use candle_core::{DType, Tensor};

use super::{InferenceModel, LogitsWanted, StepInput};
use crate::cache::{KvCache, NewHeads, SeqId};
use crate::error::{ModelError, Result, TensorContext};
use crate::paged::PagedKvCache;

/// The padded batch sizes of a graphed decode step; larger batches run eagerly.
pub const DECODE_GRAPH_BUCKETS: [usize; 13] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256];

/// What the graphed decode steps did ([`InferenceModel::decode_graph_stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodeGraphStats {
    /// Decode steps run over the fixed buffers.
    pub steps: u64,
    /// Graphs captured: each bucket's first step, and again after a weight swap or a pool
    /// growth.
    pub captures: u64,
    /// Steps that replayed a captured graph.
    pub replays: u64,
    /// Why a capture failed, once one did: the steps run eagerly from then on.
    pub failed: Option<String>,
}

/// The buckets' buffers and graphs.
#[derive(Debug, Default)]
pub(super) struct DecodeGraphs {
    slots: Vec<Slot>,
    stats: DecodeGraphStats,
}

/// One bucket: its fixed buffers and, once captured, its graph.
#[derive(Debug)]
struct Slot {
    rows: usize,
    /// u32: the rows' token ids, their positions, then the paged attention's row tables
    /// ([`PagedKvCache::decode_meta`]) in the rest ([`Slot::capacity`] words).
    inputs: Tensor,
    /// `(rows, vocab)` f32, what the step leaves.
    logits: Tensor,
    captured: Option<(Fingerprint, Graph)>,
}

impl Slot {
    /// Words the slot holds for the row tables.
    fn capacity(&self) -> usize {
        self.inputs.elem_count() - 2 * self.rows
    }
}

/// What a graph read besides its slot's buffers: it is replayed only while they are the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    /// The model's weights epoch (bumped by every swap and rebuild of the products).
    weights: u64,
    /// The pools' generation ([`PagedKvCache::pool_generation`]).
    pools: usize,
    /// The rotary tables' length (they are replaced only as they grow).
    rope: usize,
    /// The stretches the attention scores each row's keys in ([`PagedKvCache::key_parts`]),
    /// which grow with the longest row.
    key_parts: u32,
}

impl InferenceModel {
    /// Decode-only steps over a paged cache over fixed buffers, as CUDA graphs on a GPU (see
    /// [`crate::infer`]'s `graphs` module docs): each bucket's first step is captured, later
    /// ones replay it. On the CPU the same padded steps run eagerly (for tests: nothing to gain
    /// there). Off by default; [`Self::step_paged`] takes them.
    pub fn set_decode_graphs(&mut self, on: bool) {
        self.graphs = on.then(|| Mutex::new(DecodeGraphs::default()));
    }

    /// What the graphed decode steps did so far (`None`: they are off).
    pub fn decode_graph_stats(&self) -> Option<DecodeGraphStats> {
        let graphs = self.graphs.as_ref()?;
        let graphs = graphs.lock().unwrap_or_else(|e| e.into_inner());
        Some(graphs.stats.clone())
    }

    /// [`Self::step`] over a paged cache, a decode-only step taking the fixed buffers (and on
    /// a GPU the graphs) when [`Self::set_decode_graphs`] turned them on and the batch fits
    /// a bucket. The logits are the step's own tensor either way.
    pub fn step_paged(
        &self,
        cache: &mut PagedKvCache,
        inputs: &[StepInput<'_>],
        wanted: LogitsWanted,
    ) -> Result<Tensor> {
        let fits = self.graphs.is_some()
            && wanted == LogitsWanted::Last
            && cache.attends_itself()
            && inputs.iter().all(|i| i.tokens.len() == 1)
            && inputs.len() <= DECODE_GRAPH_BUCKETS[DECODE_GRAPH_BUCKETS.len() - 1];
        if !fits {
            return self.step(cache, inputs, wanted);
        }
        let dtype = self.weights.embed.dtype();
        let device = self.weights.embed.device().clone();
        let context = self.config.max_position_embeddings;
        let Some((cos, sin, rope)) = (self.rope)
            .whole_tables(context, dtype, &device)
            .ctx("rotary tables")?
        else {
            return self.step(cache, inputs, wanted);
        };
        let b = inputs.len();
        let rows = *DECODE_GRAPH_BUCKETS
            .iter()
            .find(|&&r| r >= b)
            .expect("checked against the largest bucket");
        // Padding rows need their block: with the pool full the step runs as it is.
        if rows > b && !cache.take_scratch_block() {
            return self.step(cache, inputs, wanted);
        }
        let past = self.check_inputs(cache, inputs)?;
        for input in inputs {
            cache.begin_step(input.seq, input.tokens, self.version())?;
        }
        let seqs: Vec<SeqId> = inputs.iter().map(|i| i.seq).collect();
        let mut words: Vec<u32> = inputs.iter().map(|i| i.tokens[0]).collect();
        words.resize(rows, 0);
        words.extend(past.iter().map(|&p| p as u32));
        words.resize(2 * rows, 0);
        words.extend(cache.decode_meta(&seqs, rows)?);
        let longest = past.iter().max().map_or(0, |&p| p + 1);
        let key_parts = cache.key_parts(rows, self.config.num_heads, longest);
        let fingerprint = Fingerprint {
            weights: self.epoch,
            pools: cache.pool_generation(),
            rope,
            key_parts,
        };
        let graphs = self.graphs.as_ref().expect("checked above");
        let mut graphs = graphs.lock().unwrap_or_else(|e| e.into_inner());
        let graphs = &mut *graphs;
        let at = match graphs.slots.iter().position(|s| s.rows == rows) {
            Some(at) => at,
            None => {
                let capacity = cache.decode_meta_capacity(rows, context);
                let slot = Slot {
                    rows,
                    inputs: Tensor::zeros(2 * rows + capacity, DType::U32, &device)
                        .ctx("decode step buffers")?,
                    logits: Tensor::zeros((rows, self.config.vocab_size), DType::F32, &device)
                        .ctx("decode step buffers")?,
                    captured: None,
                };
                graphs.slots.push(slot);
                graphs.slots.len() - 1
            }
        };
        let slot = &mut graphs.slots[at];
        if words.len() > slot.inputs.elem_count() {
            return Err(ModelError::input(format!(
                "decode step: {} words of row tables for a buffer of {}",
                words.len() - 2 * rows,
                slot.capacity()
            )));
        }
        let len = words.len();
        let host = Tensor::from_vec(words, len, &device).ctx("decode step words")?;
        slot.inputs
            .slice_set(&host, 0, 0)
            .ctx("decode step words")?;
        let tables = (&cos, &sin);
        let stats = &mut graphs.stats;
        stats.steps += 1;
        match &slot.captured {
            Some((f, graph)) if *f == fingerprint => {
                graph.replay()?;
                stats.replays += 1;
            }
            _ => {
                slot.captured = None;
                self.forward_fixed(cache, slot, tables, key_parts)?;
                if stats.failed.is_none() {
                    match capture(&device, || {
                        self.forward_fixed(cache, slot, tables, key_parts)
                    }) {
                        Ok(Some(graph)) => {
                            slot.captured = Some((fingerprint, graph));
                            stats.captures += 1;
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "capturing a decode step failed; decode steps run eagerly from now on");
                            stats.failed = Some(e.to_string());
                        }
                    }
                }
            }
        }
        cache.commit_decode(&seqs);
        // A copy: the slot's buffer is the next step's.
        (slot.logits.narrow(0, 0, b))
            .and_then(|l| l.copy())
            .ctx("decode step logits")
    }

    /// The model over a slot's buffers, leaving the logits in its `logits`. On a GPU candle's
    /// small uploads go through its cache for graph capture, in the run before a capture as in
    /// the capture.
    fn forward_fixed(
        &self,
        cache: &PagedKvCache,
        slot: &Slot,
        (cos, sin): (&Tensor, &Tensor),
        key_parts: u32,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        let _cached = match self.weights.embed.device() {
            candle_core::Device::Cuda(d) => Some(d.enable_cuda_graph_htod_cache()),
            _ => None,
        };
        let rows = slot.rows;
        let context = "decode step over fixed buffers";
        let words = |at: usize, len: usize| slot.inputs.narrow(0, at, len).ctx(context);
        let (ids, positions, meta) = (
            words(0, rows)?,
            words(rows, rows)?,
            words(2 * rows, slot.capacity())?,
        );
        let x = self.weights.embed.index_select(&ids, 0).ctx(context)?;
        let cos = cos.index_select(&positions, 0).ctx(context)?;
        let sin = sin.index_select(&positions, 0).ctx(context)?;
        let scale = self.attention_scale();
        let mut attend = |layer: usize, heads: NewHeads<'_>| {
            cache.attend_meta(heads, layer, &meta, scale, key_parts)
        };
        let x = self.layers(x, (&cos, &sin), &mut attend)?;
        let logits = self.logits(&x)?;
        slot.logits.slice_set(&logits, 0, 0).ctx(context)
    }
}

/// A captured decode step.
#[cfg(feature = "cuda")]
struct Graph(candle_core::cuda_backend::cudarc::driver::CudaGraph);

/// No graphs without CUDA.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
enum Graph {}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

// SAFETY: a CUDA graph and its executable may be used from any thread as long as the calls on
// one graph are serialised (the driver's rule for graph objects); a `Graph` is only reached
// through the model's `Mutex<DecodeGraphs>`, which serialises them.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
unsafe impl Send for Graph {}

impl Graph {
    /// Launches the graph on the stream it was captured on: the per-thread stream of the
    /// calling thread, as every candle op of the step would be.
    fn replay(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        return self.0.launch().map_err(|e| ModelError::Device {
            device: "cuda".into(),
            reason: format!("replaying a decode step's CUDA graph: {e}"),
        });
        #[cfg(not(feature = "cuda"))]
        match *self {}
    }
}

/// Captures `run` into a graph on a GPU (`None` on the CPU, which runs nothing here). The
/// capture is local to this thread, so another thread's work on the device (a trainer
/// sharing it) goes on meanwhile.
fn capture(
    device: &candle_core::Device,
    run: impl FnOnce() -> Result<()>,
) -> Result<Option<Graph>> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let fail = |what: &str, e: &dyn std::fmt::Display| ModelError::Device {
            device: "cuda".into(),
            reason: format!("{what}: {e}"),
        };
        let stream = d.cuda_stream();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        stream
            .begin_capture(mode)
            .map_err(|e| fail("beginning a capture", &e))?;
        let ran = run();
        // Ended whatever happened: the stream leaves capture mode either way. Memory the
        // graph allocates and does not free is freed before each replay.
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let ended = stream.end_capture(flags);
        ran?;
        let graph = ended.map_err(|e| fail("ending a capture", &e))?;
        return match graph {
            Some(g) => Ok(Some(Graph(g))),
            None => Err(fail("ending a capture", &"no graph was captured")),
        };
    }
    let _ = (device, run);
    Ok(None)
}
