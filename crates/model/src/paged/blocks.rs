//! The block allocator of the paged KV cache: which blocks are free, who references each, and
//! which full blocks are cached by content for prefix sharing. Pure bookkeeping (no tensors), so
//! its invariants are tested on their own.
//!
//! A block is in exactly one of three states:
//! - **free**: no reference, no content key; handed out first;
//! - **referenced**: in one or more sequences' block tables (`refs > 0`), with or without a key;
//! - **cached**: no reference, but its content key is registered; it can be taken back by a
//!   request with the same prefix, or evicted (least recently released first) when no free block
//!   is left.
//!
//! A content key is the hash chain of the token ids up to the block's end plus the weight
//! version that computed them, and the key keeps the block's own tokens and its parent's hash so
//! a lookup compares contents (a hash collision cannot hand out wrong keys and values).

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use sluice_core::PolicyVersion;

/// Index of a block in the pool.
pub type BlockId = u32;

/// What a full block holds: its tokens, what came before them and the weights that computed
/// its keys and values.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// Hash of the previous block's key (0 for the first block of a sequence).
    pub parent: u64,
    /// The weight version whose keys and values fill the block.
    pub version: PolicyVersion,
    /// The block's token ids.
    pub tokens: Vec<u32>,
}

impl BlockKey {
    /// The hash that chains to the next block. SipHash with fixed keys: stable within a process,
    /// which is all a per-replica cache needs.
    pub fn chain_hash(&self) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        self.hash(&mut h);
        // 0 marks "no parent"; keep it out of the chain.
        h.finish().max(1)
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct BlockAllocator {
    /// References per block.
    refs: Vec<u32>,
    /// The content key of each cached-or-referenced block that has one.
    keys: Vec<Option<BlockKey>>,
    /// Release tick of each unreferenced cached block (its place in `lru`).
    released_at: Vec<u64>,
    /// Free blocks; popped from the end (low ids first, so a CPU pool touches few pages).
    free: Vec<BlockId>,
    /// Registered contents.
    by_key: HashMap<BlockKey, BlockId>,
    /// Unreferenced cached blocks by release tick: the first is evicted first.
    lru: BTreeMap<u64, BlockId>,
    tick: u64,
}

impl BlockAllocator {
    /// `blocks` free blocks.
    pub fn new(blocks: usize) -> Self {
        Self {
            refs: vec![0; blocks],
            keys: vec![None; blocks],
            released_at: vec![0; blocks],
            free: (0..blocks as BlockId).rev().collect(),
            by_key: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks an allocation can get: free plus evictable cached ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks in at least one sequence's table.
    pub fn in_use(&self) -> usize {
        self.total() - self.available()
    }

    /// Unreferenced blocks kept for their contents.
    pub fn cached(&self) -> usize {
        self.lru.len()
    }

    /// References to `block`.
    pub fn refs(&self, block: BlockId) -> u32 {
        self.refs[block as usize]
    }

    /// The content key of `block`, if registered.
    pub fn key(&self, block: BlockId) -> Option<&BlockKey> {
        self.keys[block as usize].as_ref()
    }

    /// A block for one reference: a free one, else the least recently released cached one
    /// (its key forgotten). `None` when every block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first()?;
                if let Some(key) = self.keys[b as usize].take() {
                    self.by_key.remove(&key);
                }
                b
            }
        };
        self.refs[block as usize] = 1;
        Some(block)
    }

    /// Takes one more reference to the block registered under `key`, if any.
    pub fn acquire(&mut self, key: &BlockKey) -> Option<BlockId> {
        let block = *self.by_key.get(key)?;
        let i = block as usize;
        if self.refs[i] == 0 {
            self.lru.remove(&self.released_at[i]);
        }
        self.refs[i] += 1;
        Some(block)
    }

    /// Whether `key` is registered.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.by_key.contains_key(key)
    }

    /// Drops one reference; the last one makes the block cached (when it has a key) or free.
    ///
    /// # Panics
    /// On a block with no reference: a double release is a bookkeeping bug that would hand one
    /// block to two sequences.
    pub fn release(&mut self, block: BlockId) {
        let i = block as usize;
        assert!(self.refs[i] > 0, "block {block} released with no reference");
        self.refs[i] -= 1;
        if self.refs[i] > 0 {
            return;
        }
        if self.keys[i].is_some() {
            self.tick += 1;
            self.released_at[i] = self.tick;
            self.lru.insert(self.tick, block);
        } else {
            self.free.push(block);
        }
    }

    /// Registers the contents of a referenced, full `block` under `key`. False (and nothing
    /// changes) when the key is already registered by another block or the block has a key:
    /// the duplicate stays private to its sequence and is freed with it.
    pub fn register(&mut self, block: BlockId, key: BlockKey) -> bool {
        let i = block as usize;
        if self.refs[i] == 0 || self.keys[i].is_some() || self.by_key.contains_key(&key) {
            return false;
        }
        self.by_key.insert(key.clone(), block);
        self.keys[i] = Some(key);
        true
    }

    /// Forgets every key computed by weights older than `version`: such blocks are never handed
    /// to a new request again. Unreferenced ones become free; referenced ones stay with their
    /// sequences (under `in_flight` those keep their older keys and values) and are freed on
    /// release. Returns how many keys were dropped.
    pub fn forget_before(&mut self, version: PolicyVersion) -> usize {
        let old: Vec<(BlockKey, BlockId)> = self
            .by_key
            .iter()
            .filter(|(k, _)| k.version < version)
            .map(|(k, &b)| (k.clone(), b))
            .collect();
        for (key, block) in &old {
            self.by_key.remove(key);
            let i = *block as usize;
            self.keys[i] = None;
            if self.refs[i] == 0 {
                self.lru.remove(&self.released_at[i]);
                self.free.push(*block);
            }
        }
        old.len()
    }

    /// Checks the invariants (tests): every block in exactly one state, keys and index agree.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.total()];
        for &b in &self.free {
            seen[b as usize] += 1;
            if self.refs[b as usize] != 0 || self.keys[b as usize].is_some() {
                return Err(format!("free block {b} is referenced or keyed"));
            }
        }
        for (&t, &b) in &self.lru {
            seen[b as usize] += 1;
            if self.refs[b as usize] != 0 || self.keys[b as usize].is_none() {
                return Err(format!("cached block {b} is referenced or has no key"));
            }
            if self.released_at[b as usize] != t {
                return Err(format!("cached block {b} has a stale release tick"));
            }
        }
        for (i, &r) in self.refs.iter().enumerate() {
            if r > 0 {
                seen[i] += 1;
            }
            if seen[i] != 1 {
                return Err(format!("block {i} is in {} states", seen[i]));
            }
        }
        for (key, &b) in &self.by_key {
            if self.keys[b as usize].as_ref() != Some(key) {
                return Err(format!("index and block {b} disagree on its key"));
            }
        }
        let keyed = self.keys.iter().filter(|k| k.is_some()).count();
        if keyed != self.by_key.len() {
            return Err(format!(
                "{keyed} keyed blocks, {} indexed",
                self.by_key.len()
            ));
        }
        Ok(())
    }
}
