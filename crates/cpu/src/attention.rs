//! Softmax attention (f32), scores scaled by head_dim^-½: causal grouped-query attention of new tokens
//! over a sequence's KV cache (query head h reads kv head h / (q_heads / kv_heads); token i of the call,
//! at absolute position `past + i`, attends to cache rows 0..=past + i), and the vision tower's
//! non-causal attention, where every patch of an image attends to every patch of it.

/// q: [t, q_heads, hd]; k_cache, v_cache: [past + t, kv_heads, hd] (already holding the new tokens).
/// Returns [t, q_heads, hd].
pub fn causal_gqa_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    q_heads: usize,
    kv_heads: usize,
    hd: usize,
) -> Vec<f32> {
    let t = q.len() / (q_heads * hd);
    let total = k_cache.len() / (kv_heads * hd);
    gqa_attention([q, k_cache, v_cache], (q_heads, kv_heads), hd, |ti| total - t + ti + 1)
}

/// Non-causal multi-head attention: q, k, v: [n, heads, hd], every row attends to all n. Returns [n, heads, hd].
pub fn full_attention(q: &[f32], k: &[f32], v: &[f32], heads: usize, hd: usize) -> Vec<f32> {
    let n = k.len() / (heads * hd);
    gqa_attention([q, k, v], (heads, heads), hd, |_| n)
}

/// Query row `ti` attends to key rows `0..visible(ti)`; `heads` = (query heads, kv heads).
fn gqa_attention(
    [q, k_cache, v_cache]: [&[f32]; 3],
    (q_heads, kv_heads): (usize, usize),
    hd: usize,
    visible: impl Fn(usize) -> usize,
) -> Vec<f32> {
    let t = q.len() / (q_heads * hd);
    let total = k_cache.len() / (kv_heads * hd);
    let group = q_heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; t * q_heads * hd];
    let mut scores = vec![0.0f32; total];
    for ti in 0..t {
        let visible = visible(ti);
        for h in 0..q_heads {
            let kvh = h / group;
            let qv = &q[(ti * q_heads + h) * hd..][..hd];
            let mut max = f32::NEG_INFINITY;
            for (j, s) in scores[..visible].iter_mut().enumerate() {
                let kv = &k_cache[(j * kv_heads + kvh) * hd..][..hd];
                *s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(*s);
            }
            let mut denom = 0.0f32;
            for s in &mut scores[..visible] {
                *s = (*s - max).exp();
                denom += *s;
            }
            let o = &mut out[(ti * q_heads + h) * hd..][..hd];
            for (j, &p) in scores[..visible].iter().enumerate() {
                let vv = &v_cache[(j * kv_heads + kvh) * hd..][..hd];
                let w = p / denom;
                for (a, b) in o.iter_mut().zip(vv) {
                    *a += w * b;
                }
            }
        }
    }
    out
}
