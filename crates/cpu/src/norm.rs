//! Normalisations: zero-centred RMSNorm `x·rsqrt(mean x²+eps)·(1+w)`, the DeltaNet output's gated
//! RMSNorm `w·norm(o)·silu(z)` (plain weight), the L2 normalisation of DeltaNet q/k, and the vision
//! tower's LayerNorm `(x − mean)·rsqrt(var + eps)·w + b`.

use crate::activation::silu;

/// In place over rows of `w.len()`: `x ← x · rsqrt(mean(x²) + eps) · (1 + w)`.
pub fn rms_norm_1p(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let inv = inv_rms(row, eps);
        for (v, &g) in row.iter_mut().zip(w) {
            *v *= inv * (1.0 + g);
        }
    }
}

/// Rows of `w.len()` of `o`, in place: `o ← w · (o · rsqrt(mean(o²) + eps)) · silu(z)`.
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    for (row, zr) in o.chunks_exact_mut(w.len()).zip(z.chunks_exact(w.len())) {
        let inv = inv_rms(row, eps);
        for ((v, &g), &zv) in row.iter_mut().zip(w).zip(zr) {
            *v = g * (*v * inv) * silu(zv);
        }
    }
}

/// Rows of `dim`, in place: `x ← x / sqrt(Σx² + eps)` (eps added to the sum, as HF and fla do).
pub fn l2_norm(x: &mut [f32], dim: usize, eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// In place over rows of `w.len()`: `x ← (x − mean) · rsqrt(var + eps) · w + b` (biased variance).
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = w.len() as f32;
    for row in x.chunks_exact_mut(w.len()) {
        let mean = row.iter().sum::<f32>() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &g), &c) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * g + c;
        }
    }
}

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_centres_scales_and_shifts() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        layer_norm(&mut x, &[1.0, 1.0, 2.0, 2.0], &[0.0, 0.0, 0.0, 1.0], 0.0);
        let s = 1.0 / 1.25f32.sqrt();
        let want = [-1.5 * s, -0.5 * s, 1.0 * s, 3.0 * s + 1.0];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{x:?}");
        }
    }
}
