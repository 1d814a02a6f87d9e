//! Partial rotary position embedding, NeoX "rotate-half" layout on the first `rotary_dim` dims of
//! each head: for i < r/2 (r = rotary_dim), θ = pos · theta^(−2i/r),
//! x'ᵢ = xᵢ cos θ − x_{i+r/2} sin θ, x'_{i+r/2} = x_{i+r/2} cos θ + xᵢ sin θ; other dims pass through.
//! Angles are formed in f32 as HF does (`inv_freq` in f32, `pos · inv_freq` in f32).
//! Qwen3.5's interleaved mRoPE reduces to this for text, where all three position streams are equal.

/// x: [t, heads, head_dim]; token i is at position `pos0 + i`.
pub fn apply_partial_rope(x: &mut [f32], heads: usize, head_dim: usize, rotary_dim: usize, theta: f64, pos0: usize) {
    let half = rotary_dim / 2;
    let inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32)).collect();
    for (ti, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let pos = (pos0 + ti) as f32;
        let cos_sin: Vec<(f32, f32)> = inv_freq.iter().map(|f| ((pos * f).cos(), (pos * f).sin())).collect();
        for head in token.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cos_sin.iter().enumerate() {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    }
}
