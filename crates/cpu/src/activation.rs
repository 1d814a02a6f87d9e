//! Scalar activations shared by the ops.

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `ln(1 + eˣ)`, identity above 20 (PyTorch `F.softplus` with threshold 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// GELU with the tanh approximation (PyTorch `gelu(approximate="tanh")`, `gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// GELU with the exact error function (PyTorch `nn.GELU()`).
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelus_match_reference_values() {
        // torch.nn.functional.gelu(torch.tensor([-1.5, 0.5, 2.0]), approximate=...) in f32.
        let cases =
            [(-1.5f32, -0.100_210_86, -0.100_428_43), (0.5, 0.345_731_23, 0.345_714), (2.0, 1.954_499_7, 1.954_597_7)];
        for (x, exact, tanh) in cases {
            assert!((gelu(x) - exact).abs() < 1e-6, "gelu({x}) = {}", gelu(x));
            assert!((gelu_tanh(x) - tanh).abs() < 1e-6, "gelu_tanh({x}) = {}", gelu_tanh(x));
        }
    }
}
