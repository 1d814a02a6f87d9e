//! What the prefix cache's bookkeeping costs the engine thread on a long agent conversation: a 160K-token
//! token stream with an entry at the end of each of its 40 turns (what a session leaves in the cache),
//! then a lookup of a 152K-token prompt, the check that it is not cached and the insert of its snapshot
//! (every request does these on the engine's thread, before and after its step).
//!
//! `cargo run --release -p deltaserve-sched --example bench_prefix_lookup [TOKENS] [TURNS]`

use std::time::Instant;

use deltaserve_backend::SnapshotLoc;
use deltaserve_sched::{PrefixCache, PrefixCacheConfig};

/// A free device snapshot slot (the cache has one per entry the benchmark makes).
fn slot(cache: &mut PrefixCache) -> SnapshotLoc {
    let (mut ops, mut released) = (Vec::new(), Vec::new());
    cache.alloc_device(&mut ops, &mut released).expect("a free slot")
}

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (total, turns) = (arg(1, 160_000), arg(2, 40).max(1));
    let cfg = PrefixCacheConfig {
        device_slots: turns + 1,
        host_slots: 0,
        page_size: 32,
        snapshot_bytes: 1 << 20,
        page_bytes: 1 << 15,
    };
    let mut cache = PrefixCache::new(cfg);
    let mut x: u64 = 1;
    let tokens: Vec<u32> = (0..total)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (x >> 40) as u32 % 150_000
        })
        .collect();
    let turn = total * 95 / 100 / turns;
    for t in 1..=turns {
        let len = t * turn;
        let loc = slot(&mut cache);
        cache.insert(tokens[..len].to_vec(), vec![0; len.div_ceil(32)], loc);
    }
    let n = turns * turn + 100;
    let reps = 20;
    let time = |f: &mut dyn FnMut()| {
        let t0 = Instant::now();
        for _ in 0..reps {
            f();
        }
        t0.elapsed().as_secs_f64() * 1e3 / reps as f64
    };
    let lookup = time(&mut || {
        std::hint::black_box(cache.lookup(&tokens[..n], n - 1));
    });
    let contains = time(&mut || {
        std::hint::black_box(cache.contains(&tokens[..n]));
    });
    let loc = slot(&mut cache);
    let t0 = Instant::now();
    cache.insert(tokens[..n].to_vec(), vec![0; n.div_ceil(32)], loc);
    let insert = t0.elapsed().as_secs_f64() * 1e3;
    cache.assert_consistent();
    println!(
        "{n}-token prompt, {turns} cached ancestors: lookup {lookup:.3} ms, contains {contains:.3} ms, insert {insert:.3} ms"
    );
}
