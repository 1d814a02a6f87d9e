//! Normalisations: zero-centred RMSNorm `x·rsqrt(mean x²+eps)·(1+w)`, the DeltaNet output's gated
//! RMSNorm `w·norm(o)·silu(z)` (plain weight), and the L2 normalisation of DeltaNet q/k.

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

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}
