//! Rotary position embeddings, NeoX "rotate-half" layout: a head's first `r` dims (r = rotary dim) are
//! rotated by per-pair angles θᵢ (i < r/2), x'ᵢ = xᵢ cos θᵢ − x_{i+r/2} sin θᵢ,
//! x'_{i+r/2} = x_{i+r/2} cos θᵢ + xᵢ sin θᵢ; other dims pass through. Angles are formed in f32 as HF
//! does (`inv_freq` in f32, `pos · inv_freq` in f32).
//!
//! - [`apply_partial_rope`]: text, θᵢ = pos · theta^(−2i/r);
//! - [`apply_mrope`]: Qwen3.5's interleaved M-RoPE, where pair i takes its position from the t, h or w
//!   stream (i mod 3 = 1 → h while i < 3·section[1], i mod 3 = 2 → w while i < 3·section[2], else t);
//!   it equals [`apply_partial_rope`] when the three streams are equal (text);
//! - [`apply_axial_rope`]: the vision tower's 2-D rotary, the whole head rotated, the first half of the
//!   pairs at the patch's row and the second half at its column, sharing one set of frequencies.

/// `1 / theta^(2i/dim)` for i < dim/2, in f32.
fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / dim as f32)).collect()
}

/// Rotates every head of one token by the per-pair angles `angles` (the first `2·angles.len()` dims).
fn rotate_token(token: &mut [f32], head_dim: usize, angles: &[f32]) {
    let half = angles.len();
    let cos_sin: Vec<(f32, f32)> = angles.iter().map(|a| (a.cos(), a.sin())).collect();
    for head in token.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in cos_sin.iter().enumerate() {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * c - b * s;
            head[i + half] = b * c + a * s;
        }
    }
}

/// x: [t, heads, head_dim]; token i is at position `pos0 + i`.
pub fn apply_partial_rope(x: &mut [f32], heads: usize, head_dim: usize, rotary_dim: usize, theta: f64, pos0: usize) {
    let inv = inv_freq(theta, rotary_dim);
    for (ti, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let pos = (pos0 + ti) as f32;
        let angles: Vec<f32> = inv.iter().map(|f| pos * f).collect();
        rotate_token(token, head_dim, &angles);
    }
}

/// x: [t, heads, head_dim]; token i is at the (t, h, w) position `positions[i]`.
pub fn apply_mrope(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f64,
    section: [usize; 3],
    positions: &[[usize; 3]],
) {
    let inv = inv_freq(theta, rotary_dim);
    let stream = |i: usize| match i % 3 {
        1 if i < 3 * section[1] => 1,
        2 if i < 3 * section[2] => 2,
        _ => 0,
    };
    for (token, pos) in x.chunks_exact_mut(heads * head_dim).zip(positions) {
        let angles: Vec<f32> = inv.iter().enumerate().map(|(i, f)| pos[stream(i)] as f32 * f).collect();
        rotate_token(token, head_dim, &angles);
    }
}

/// x: [t, heads, head_dim]; token i is the patch at (row, column) `positions[i]`.
pub fn apply_axial_rope(x: &mut [f32], heads: usize, head_dim: usize, theta: f64, positions: &[[usize; 2]]) {
    let inv = inv_freq(theta, head_dim / 2);
    for (token, &[row, col]) in x.chunks_exact_mut(heads * head_dim).zip(positions) {
        let angles: Vec<f32> = inv.iter().map(|f| row as f32 * f).chain(inv.iter().map(|f| col as f32 * f)).collect();
        rotate_token(token, head_dim, &angles);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect()
    }

    #[test]
    fn mrope_with_equal_streams_is_text_rope() {
        let (t, heads, hd, rot) = (5, 2, 16, 8);
        let mut a = sample(t * heads * hd);
        let mut b = a.clone();
        apply_partial_rope(&mut a, heads, hd, rot, 1e7, 3);
        let pos: Vec<[usize; 3]> = (3..3 + t).map(|p| [p; 3]).collect();
        apply_mrope(&mut b, heads, hd, rot, 1e7, [2, 1, 1], &pos);
        assert_eq!(a, b);
    }

    #[test]
    fn mrope_pairs_take_their_stream() {
        // 4 pairs, section [2, 1, 1]: pairs 0 and 3 follow t, pair 1 h, pair 2 w.
        let (hd, rot) = (8, 8);
        let x = sample(hd);
        let rotated = |pos: [usize; 3]| {
            let mut y = x.clone();
            apply_mrope(&mut y, 1, hd, rot, 100.0, [2, 1, 1], &[pos]);
            y
        };
        let base = rotated([0, 0, 0]);
        let moved = |a: &[f32], pair: usize| a[pair] != base[pair] || a[pair + 4] != base[pair + 4];
        let h = rotated([0, 5, 0]);
        assert!((0..4).all(|p| moved(&h, p) == (p == 1)));
        let w = rotated([0, 0, 5]);
        assert!((0..4).all(|p| moved(&w, p) == (p == 2)));
        let t = rotated([5, 0, 0]);
        assert!((0..4).all(|p| moved(&t, p) == (p == 0 || p == 3)));
    }

    #[test]
    fn axial_rope_rows_move_the_first_half_of_the_pairs() {
        let hd = 16;
        let x = sample(hd);
        let mut r = x.clone();
        apply_axial_rope(&mut r, 1, hd, 1e4, &[[3, 0]]);
        let mut c = x.clone();
        apply_axial_rope(&mut c, 1, hd, 1e4, &[[0, 3]]);
        for pair in 0..8 {
            let moved = |y: &[f32]| y[pair] != x[pair] || y[pair + 8] != x[pair + 8];
            assert_eq!(moved(&r), pair < 4, "pair {pair}");
            assert_eq!(moved(&c), pair >= 4, "pair {pair}");
        }
    }
}
