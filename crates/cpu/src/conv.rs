//! Causal depthwise conv1d over time with a carried state, followed by SiLU (the DeltaNet's
//! short convolution): `y[t, c] = silu(Σ_j w[c, j] · x[t − K + 1 + j, c])`, where rows before the
//! first token of this call come from `state` (the previous call's last K−1 inputs, zeros at start).

use crate::activation::silu;

/// x: [t, channels]; w: [channels, kernel]; state: [kernel − 1, channels], updated to the last
/// kernel − 1 rows of (state ++ x). Returns [t, channels].
pub fn causal_conv1d_silu(x: &[f32], channels: usize, w: &[f32], kernel: usize, state: &mut [f32]) -> Vec<f32> {
    let t = x.len() / channels;
    let hist = kernel - 1;
    assert_eq!(state.len(), hist * channels, "conv state has the wrong size");
    // xpad = [state; x]: row r of xpad is state row r for r < hist, else x row r − hist.
    let row = |r: usize| -> &[f32] {
        if r < hist {
            &state[r * channels..(r + 1) * channels]
        } else {
            &x[(r - hist) * channels..(r - hist + 1) * channels]
        }
    };
    let mut y = vec![0.0f32; t * channels];
    for ti in 0..t {
        let out = &mut y[ti * channels..(ti + 1) * channels];
        for j in 0..kernel {
            let src = row(ti + j);
            for c in 0..channels {
                out[c] += w[c * kernel + j] * src[c];
            }
        }
        out.iter_mut().for_each(|v| *v = silu(*v));
    }
    let mut new_state = vec![0.0f32; hist * channels];
    for r in 0..hist {
        new_state[r * channels..(r + 1) * channels].copy_from_slice(row(t + r));
    }
    state.copy_from_slice(&new_state);
    y
}
