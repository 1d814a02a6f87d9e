//! Dense projections: `y[T, out] = x[T, in] · W[out, in]ᵀ (+ b)` (PyTorch `Linear`), f32.

/// `y = x · wᵀ`; x: [t, inp], w: [out, inp], returns [t, out].
pub fn linear(x: &[f32], t: usize, w: &[f32], out: usize, inp: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * inp, "linear: x has {} values, expected {t}×{inp}", x.len());
    assert_eq!(w.len(), out * inp, "linear: w has {} values, expected {out}×{inp}", w.len());
    let mut y = vec![0.0f32; t * out];
    if t == 0 || out == 0 {
        return y;
    }
    // SAFETY: the pointers cover exactly the row-major matrices described by the dims and strides
    // (lengths asserted above); y does not alias x or w.
    unsafe {
        matrixmultiply::sgemm(
            t,
            inp,
            out,
            1.0,
            x.as_ptr(),
            inp as isize,
            1,
            w.as_ptr(),
            1,
            inp as isize, // wᵀ: element (k, n) is w[n*inp + k]
            0.0,
            y.as_mut_ptr(),
            out as isize,
            1,
        );
    }
    y
}

/// `y = x · wᵀ + b` (b: [out], or none); x: [t, inp], w: [out, inp], returns [t, out].
pub fn linear_bias(x: &[f32], t: usize, w: &[f32], b: Option<&[f32]>, out: usize, inp: usize) -> Vec<f32> {
    let mut y = linear(x, t, w, out, inp);
    if let Some(b) = b {
        for row in y.chunks_exact_mut(out) {
            row.iter_mut().zip(b).for_each(|(v, c)| *v += c);
        }
    }
    y
}
