//! The load cache: what loading a graph computes that depends only on the
//! graph's structure, kept for the next load of the same architecture.
//!
//! A graph's *structure* is the graph exactly as the job sent it (nodes,
//! names, ops with their attributes, shapes and dtypes, and the values of
//! its constants) without the variables' values, which come beside it in
//! LoadGraph: its key is the SHA-256 of its bincode form ([`structure`]).
//! Two jobs loading one architecture with different weights share entries;
//! a graph that differs in any op, name, shape or dtype does not. What is
//! kept:
//!
//! - the validated graph ([`validate`]), keyed by structure and the
//!   service's graph limits: a second load skips validation and shape
//!   inference, and gets the very `ValidGraph` the first one made;
//! - memory plans ([`plan_outlets`], [`plan`]), keyed by structure, the
//!   fetched outlets and the planner's options: the service's admission
//!   plan and each executor's own plan.
//!
//! One cache per process, bounded in bytes (an estimate of each entry's
//! heap size) and entries, least recently used dropped first
//! ([`configure`]; `lanes serve --load-cache`). A graph whose entry alone
//! would pass the bound is not kept. Hits and misses are counted
//! ([`stats`]; the metrics' `lanes_load_cache_*`). Everything kept is a
//! pure function of its key, so a hit gives what the computation would
//! have given: outputs never depend on whether a load hit.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use lanes_adaptor::{Graph, GraphError, GraphLimits, Outlet, ValidGraph};
use sha2::{Digest, Sha256};

use super::{MemoryPlan, PlanError, PlanOptions};

/// Default bound on the cache's bytes: room for the graphs and plans of a
/// few hundred ResNet-sized architectures.
pub const DEFAULT_CACHE_BYTES: u64 = 256 << 20;

/// Most entries kept, whatever their size.
pub const MAX_ENTRIES: usize = 4096;

/// A graph's structure: the SHA-256 of its bincode form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Structure([u8; 32]);

/// Hits, misses and size of the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups of validated graphs that hit, and that missed.
    pub graph_hits: u64,
    pub graph_misses: u64,
    /// Lookups of memory plans that hit, and that missed.
    pub plan_hits: u64,
    pub plan_misses: u64,
    pub entries: u64,
    pub bytes: u64,
    /// Entries dropped to stay within the bounds.
    pub evictions: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Valid {
        graph: Structure,
        limits: [usize; 4],
    },
    Plan {
        graph: Structure,
        fetched: Vec<Outlet>,
        alignment: u64,
        views: bool,
    },
}

#[derive(Debug, Clone)]
enum Value {
    Valid(Arc<ValidGraph>),
    Plan(Arc<MemoryPlan>),
}

#[derive(Debug)]
struct Slot {
    value: Value,
    bytes: u64,
    used: u64,
}

#[derive(Debug)]
struct Lru {
    map: HashMap<Key, Slot>,
    tick: u64,
    bytes: u64,
    max_bytes: u64,
    evictions: u64,
}

impl Lru {
    fn get(&mut self, key: &Key) -> Option<Value> {
        self.tick += 1;
        let tick = self.tick;
        self.map.get_mut(key).map(|s| {
            s.used = tick;
            s.value.clone()
        })
    }

    fn put(&mut self, key: Key, value: Value, bytes: u64) {
        if bytes > self.max_bytes {
            return;
        }
        self.tick += 1;
        if let Some(old) = self.map.insert(
            key,
            Slot {
                value,
                bytes,
                used: self.tick,
            },
        ) {
            self.bytes -= old.bytes;
        }
        self.bytes += bytes;
        self.shrink();
    }

    /// Drops the least recently used entries until within the bounds.
    fn shrink(&mut self) {
        while self.bytes > self.max_bytes || self.map.len() > MAX_ENTRIES {
            let Some(oldest) = self
                .map
                .iter()
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(s) = self.map.remove(&oldest) {
                self.bytes -= s.bytes;
                self.evictions += 1;
            }
        }
    }
}

/// (hits, misses) of one kind of entry.
struct Counts {
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Counts {
    const fn new() -> Self {
        Counts {
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }
    fn get(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }
}

struct Cache {
    lru: Mutex<Lru>,
    graphs: Counts,
    plans: Counts,
}

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Cache {
        lru: Mutex::new(Lru {
            map: HashMap::new(),
            tick: 0,
            bytes: 0,
            max_bytes: DEFAULT_CACHE_BYTES,
            evictions: 0,
        }),
        graphs: Counts::new(),
        plans: Counts::new(),
    })
}

fn lru() -> std::sync::MutexGuard<'static, Lru> {
    cache().lru.lock().unwrap_or_else(PoisonError::into_inner)
}

fn lookup(key: &Key) -> Option<Value> {
    let found = lru().get(key);
    let counts = match key {
        Key::Valid { .. } => &cache().graphs,
        Key::Plan { .. } => &cache().plans,
    };
    let counter = match found {
        Some(_) => &counts.hits,
        None => &counts.misses,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    found
}

/// Bounds the cache at `max_bytes` (0 turns it off), dropping entries
/// beyond at once.
pub fn configure(max_bytes: u64) {
    let mut l = lru();
    l.max_bytes = max_bytes;
    l.shrink();
}

/// Empties the cache (the counters stay): the next load of every graph is
/// cold (`lanes bench load`).
pub fn clear() {
    let mut l = lru();
    l.map.clear();
    l.bytes = 0;
}

impl CacheStats {
    /// Lookups that hit, of either kind.
    pub fn hits(&self) -> u64 {
        self.graph_hits + self.plan_hits
    }
    /// Lookups that missed, of either kind.
    pub fn misses(&self) -> u64 {
        self.graph_misses + self.plan_misses
    }
}

/// Hits and misses so far, and what is kept now.
pub fn stats() -> CacheStats {
    let c = cache();
    let (entries, bytes, evictions) = {
        let l = lru();
        (l.map.len() as u64, l.bytes, l.evictions)
    };
    let (graph_hits, graph_misses) = c.graphs.get();
    let (plan_hits, plan_misses) = c.plans.get();
    CacheStats {
        graph_hits,
        graph_misses,
        plan_hits,
        plan_misses,
        entries,
        bytes,
        evictions,
    }
}

/// Bytes written through it, hashed.
struct Hashing {
    hasher: Sha256,
    bytes: u64,
}

impl std::io::Write for Hashing {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.hasher.update(buf);
        self.bytes += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The structure of `g` and the size of its bincode form, or `None` when
/// it cannot be serialized (it is then never cached).
pub fn structure(g: &Graph) -> Option<(Structure, u64)> {
    let mut w = Hashing {
        hasher: Sha256::new(),
        bytes: 0,
    };
    bincode::serialize_into(&mut w, g).ok()?;
    Some((Structure(w.hasher.finalize().into()), w.bytes))
}

/// Estimated heap bytes of a validated graph whose bincode form takes
/// `serialized` bytes: its nodes as Rust values (up to 4 times their
/// bincode bytes, as docs/protocol.md counts a decoded graph), its order
/// and its consumers.
fn valid_bytes(g: &ValidGraph, serialized: u64) -> u64 {
    let n = g.graph().nodes.len() as u64;
    serialized.saturating_mul(4).saturating_add(n * 64)
}

fn plan_bytes(p: &MemoryPlan) -> u64 {
    let slots = p.tensors.len() + p.persistent_slots.len() + p.fetched.len();
    // Each slot, and its place in the plan's index.
    slots as u64 * 96
}

/// [`lanes_adaptor::validate`] through the cache: `(graph, hit)`. A hit
/// is the validated graph of an earlier load of the same structure under
/// the same limits.
pub fn validate(graph: Graph, limits: &GraphLimits) -> Result<(ValidGraph, bool), GraphError> {
    let Some((structure, serialized)) = self::structure(&graph) else {
        return lanes_adaptor::validate(graph, limits).map(|v| (v, false));
    };
    let key = Key::Valid {
        graph: structure,
        limits: [
            limits.max_nodes,
            limits.max_inputs_per_node,
            limits.max_tensor_bytes,
            limits.max_constant_bytes,
        ],
    };
    if let Some(Value::Valid(v)) = lookup(&key) {
        return Ok((ValidGraph::clone(&v), true));
    }
    let valid = lanes_adaptor::validate(graph, limits)?;
    let bytes = valid_bytes(&valid, serialized);
    lru().put(key, Value::Valid(Arc::new(valid.clone())), bytes);
    Ok((valid, false))
}

/// [`super::plan_outlets`] through the cache.
pub fn plan_outlets(
    g: &ValidGraph,
    fetched: HashSet<Outlet>,
    options: PlanOptions,
) -> Result<MemoryPlan, PlanError> {
    let Some((structure, _)) = structure(g.graph()) else {
        return super::plan_outlets(g, fetched, options);
    };
    let mut sorted: Vec<Outlet> = fetched.iter().copied().collect();
    sorted.sort();
    let key = Key::Plan {
        graph: structure,
        fetched: sorted,
        alignment: options.alignment,
        views: options.views,
    };
    if let Some(Value::Plan(p)) = lookup(&key) {
        return Ok(MemoryPlan::clone(&p));
    }
    let plan = super::plan_outlets(g, fetched, options)?;
    let bytes = plan_bytes(&plan);
    lru().put(key, Value::Plan(Arc::new(plan.clone())), bytes);
    Ok(plan)
}

/// [`super::plan`] (the graph's sinks fetched, default options) through
/// the cache.
pub fn plan(g: &ValidGraph) -> Result<MemoryPlan, PlanError> {
    plan_outlets(g, super::sinks(g), PlanOptions::default())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn lru(max_bytes: u64) -> Lru {
        Lru {
            map: HashMap::new(),
            tick: 0,
            bytes: 0,
            max_bytes,
            evictions: 0,
        }
    }

    fn key(i: u8) -> Key {
        Key::Plan {
            graph: Structure([i; 32]),
            fetched: vec![],
            alignment: 256,
            views: true,
        }
    }

    fn value() -> Value {
        Value::Plan(Arc::new(MemoryPlan {
            alignment: 256,
            persistent: 0,
            ephemeral: 0,
            lower_bound: 0,
            no_reuse: 0,
            steps: 0,
            strategy: crate::compile::Strategy::GreedyBySize,
            fetched: vec![],
            tensors: vec![],
            persistent_slots: vec![],
            index: HashMap::new(),
        }))
    }

    #[test]
    fn the_least_recently_used_goes_first_and_bytes_stay_bounded() {
        let mut l = lru(300);
        l.put(key(1), value(), 100);
        l.put(key(2), value(), 100);
        l.put(key(3), value(), 100);
        assert!(l.get(&key(1)).is_some()); // 2 is now the oldest
        l.put(key(4), value(), 100);
        assert!(l.get(&key(2)).is_none());
        assert!(l.get(&key(1)).is_some() && l.get(&key(3)).is_some());
        assert_eq!((l.map.len(), l.bytes, l.evictions), (3, 300, 1));
        // Replacing an entry counts its bytes once.
        l.put(key(4), value(), 50);
        assert_eq!(l.bytes, 250);
        // An entry larger than the whole bound is not kept.
        l.put(key(5), value(), 301);
        assert!(l.get(&key(5)).is_none());
        assert_eq!(l.bytes, 250);
        // A smaller bound drops the oldest at once.
        l.max_bytes = 100;
        l.shrink();
        assert_eq!(l.map.len(), 1);
        assert!(l.bytes <= 100);
    }

    #[test]
    fn structure_ignores_nothing_but_the_weights() {
        use lanes_adaptor::{GraphBuilder, Tensor, TensorType};
        let g = |shape: usize, w: f32| {
            let mut b = GraphBuilder::new();
            let x = b.placeholder("x", TensorType::f32([2, shape]));
            let v = b.variable("w", Tensor::full([shape, 2], w));
            let y = b.matmul(x, v);
            b.set_name(y, "y");
            b.finish().unwrap().0
        };
        let s = |g: &Graph| structure(g).unwrap().0;
        assert_eq!(s(&g(3, 1.0)), s(&g(3, 2.0)), "weights are not structure");
        assert_ne!(s(&g(3, 1.0)), s(&g(4, 1.0)), "shapes are");
    }
}
