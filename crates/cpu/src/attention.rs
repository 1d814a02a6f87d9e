//! Causal grouped-query softmax attention of new tokens over a sequence's KV cache (f32):
//! query head h reads kv head h / (q_heads / kv_heads); token i of the call (absolute position
//! `past + i`) attends to cache rows 0..=past + i; scores scaled by head_dim^-½.

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
    let past = total - t;
    let group = q_heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; t * q_heads * hd];
    let mut scores = vec![0.0f32; total];
    for ti in 0..t {
        let visible = past + ti + 1;
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
