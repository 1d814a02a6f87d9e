//! A sparse layer's routed experts for a step's rows, computed by the host CPU on int4 experts in the
//! device format ([`crate::w4_host`]): `out[r] = Σ_(r, e, p) p · down_e(SwiGLU(gate_up_e(x[r])))` over the
//! step's (row, expert, weight) pairs. The shared expert and the un-permute stay the GPU's. Work is spread
//! over the rayon pool in row ranges of each pair's linears: gate/up of every pair, then down of every
//! pair, then the weighted sums in pair order (deterministic for any thread count).

use rayon::prelude::*;

use crate::error::CudaError;
use crate::w4_host::{PackedX, W4HostView, gemv};

/// Rows of a linear one task computes (whole 32-row pairs).
const TASK_ROWS: usize = 256;

/// One routed expert's linears: gate and up stacked (`[2 · width, hidden]`, the gate's rows first) and
/// down (`[hidden, width]`).
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    pub gate_up: W4HostView<'a>,
    pub down: W4HostView<'a>,
}

/// One (row, expert, weight) pair of the step's routing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Route {
    pub row: usize,
    pub expert: usize,
    pub weight: f32,
}

/// `out [rows, hidden]` (f32, overwritten) = the routed experts' weighted sum for each of the step's
/// rows `x [rows, hidden]`; rows no pair names get zeros. Errors (nothing written) on an expert index
/// outside `experts`, a row outside `x`, or experts whose shapes disagree with `hidden`.
pub fn routed_experts(
    experts: &[ExpertView<'_>],
    x: &[f32],
    hidden: usize,
    routes: &[Route],
    out: &mut [f32],
) -> Result<(), CudaError> {
    let bad = |m: String| Err(CudaError::Weights(format!("host experts: {m}")));
    if hidden == 0 || !x.len().is_multiple_of(hidden) || out.len() != x.len() {
        return bad(format!("x of {} and out of {} values for rows of {hidden}", x.len(), out.len()));
    }
    let rows = x.len() / hidden;
    let Some(width) = experts.first().map(|e| e.down.inp) else {
        if !routes.is_empty() {
            return bad("no experts".into());
        }
        out.fill(0.0);
        return Ok(());
    };
    for (i, e) in experts.iter().enumerate() {
        if e.gate_up.inp != hidden || e.gate_up.out != 2 * width || e.down.out != hidden || e.down.inp != width {
            return bad(format!(
                "expert {i}: gate/up [{}, {}], down [{}, {}] for hidden {hidden}, width {width}",
                e.gate_up.out, e.gate_up.inp, e.down.out, e.down.inp
            ));
        }
    }
    if let Some(r) = routes.iter().find(|r| r.expert >= experts.len() || r.row >= rows) {
        return bad(format!(
            "a route to expert {} for row {} ({} experts, {rows} rows)",
            r.expert,
            r.row,
            experts.len()
        ));
    }
    let xs: Vec<PackedX> = x.chunks_exact(hidden).map(PackedX::new).collect();
    let n = routes.len();
    let mut gu = vec![0f32; n * 2 * width];
    gu.par_chunks_mut(TASK_ROWS).enumerate().for_each(|(c, y)| {
        let (p, r0) = (c * TASK_ROWS / (2 * width), c * TASK_ROWS % (2 * width));
        let r = routes[p];
        gemv(&experts[r.expert].gate_up, &xs[r.row], r0..r0 + y.len(), y);
    });
    let acts: Vec<PackedX> = gu
        .par_chunks(2 * width)
        .map(|g| PackedX::new(&(0..width).map(|j| silu(g[j]) * g[width + j]).collect::<Vec<_>>()))
        .collect();
    let mut dn = vec![0f32; n * hidden];
    dn.par_chunks_mut(TASK_ROWS).enumerate().for_each(|(c, y)| {
        let (p, r0) = (c * TASK_ROWS / hidden, c * TASK_ROWS % hidden);
        gemv(&experts[routes[p].expert].down, &acts[p], r0..r0 + y.len(), y);
    });
    out.fill(0.0);
    for (r, y) in routes.iter().zip(dn.chunks_exact(hidden)) {
        for (o, v) in out[r.row * hidden..][..hidden].iter_mut().zip(y) {
            *o += r.weight * v;
        }
    }
    Ok(())
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::w4::W4Linear;

    fn linear(out: usize, inp: usize, seed: u64) -> W4Linear {
        crate::w4_host::tests::random(out, inp, true, false, seed)
    }

    /// Three rows, four experts, uneven routing (a row with none): against the same math on the
    /// dequantised weights in f64 with x and the SwiGLU rows rounded to int8 as the host rounds them
    /// (1e-4 of the output's norm), and without that rounding (5%); shape and index errors refused with
    /// nothing written.
    #[test]
    fn routed_experts_match_the_dequantised_experts() {
        let (h, w) = (256, 128);
        let lin: Vec<(W4Linear, W4Linear)> = (0..4).map(|e| (linear(2 * w, h, 10 + e), linear(h, w, 20 + e))).collect();
        let experts: Vec<ExpertView<'_>> = lin
            .iter()
            .map(|(gu, d)| ExpertView { gate_up: W4HostView::of(gu).unwrap(), down: W4HostView::of(d).unwrap() })
            .collect();
        let x: Vec<f32> = (0..3 * h).map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0).collect();
        let routes = [
            Route { row: 0, expert: 2, weight: 0.7 },
            Route { row: 0, expert: 0, weight: 0.3 },
            Route { row: 2, expert: 3, weight: 0.6 },
            Route { row: 2, expert: 2, weight: 0.4 },
        ];
        let mut out = vec![f32::NAN; 3 * h];
        routed_experts(&experts, &x, h, &routes, &mut out).unwrap();
        let dq: Vec<(Vec<f32>, Vec<f32>)> = lin.iter().map(|(gu, d)| (gu.dequantize(), d.dequantize())).collect();
        // The reference in f64, with x and the SwiGLU rows rounded to int8 per 128 as `PackedX` rounds
        // them (`int8`), or not.
        let reference = |int8: bool| {
            let round = |v: &[f64]| -> Vec<f64> {
                v.chunks(128)
                    .flat_map(|c| {
                        let d = c.iter().fold(0f64, |m, x| m.max(x.abs())) as f32 / 127.0;
                        c.iter().map(move |&x| if d > 0.0 { ((x as f32 / d).round() * d) as f64 } else { 0.0 })
                    })
                    .collect()
            };
            let mut want = vec![0f64; 3 * h];
            for r in &routes {
                let (gu, d) = &dq[r.expert];
                let xr: Vec<f64> = x[r.row * h..][..h].iter().map(|&v| v as f64).collect();
                let xr = if int8 { round(&xr) } else { xr };
                let g: Vec<f64> = (0..2 * w).map(|o| (0..h).map(|j| gu[o * h + j] as f64 * xr[j]).sum()).collect();
                let act: Vec<f64> = (0..w).map(|j| g[j] / (1.0 + (-g[j]).exp()) * g[w + j]).collect();
                let act = if int8 { round(&act) } else { act };
                for o in 0..h {
                    let y: f64 = (0..w).map(|j| d[o * w + j] as f64 * act[j]).sum();
                    want[r.row * h + o] += r.weight as f64 * y;
                }
            }
            want
        };
        // Against the int8-rounded inputs: f32 sums' rounding only; against the exact ones: the int8
        // rounding's cost (a few percent of the output's norm at these random weights).
        for (want, tol) in [(reference(true), 1e-4), (reference(false), 5e-2)] {
            for row in [0, 2] {
                let (a, b) = (&out[row * h..][..h], &want[row * h..][..h]);
                let err: f64 = a.iter().zip(b).map(|(&p, &q)| (p as f64 - q).powi(2)).sum::<f64>().sqrt();
                let norm: f64 = b.iter().map(|q| q * q).sum::<f64>().sqrt();
                assert!(
                    err <= tol * norm,
                    "row {row}: L2 error {err:.3e} against a norm of {norm:.3e} (tolerance {tol})"
                );
            }
        }
        assert!(out[h..2 * h].iter().all(|&v| v == 0.0), "a row without routes is zero");
        let mut untouched = vec![1f32; 3 * h];
        let bad_expert = [Route { row: 0, expert: 4, weight: 1.0 }];
        assert!(routed_experts(&experts, &x, h, &bad_expert, &mut untouched).is_err());
        let bad_row = [Route { row: 3, expert: 0, weight: 1.0 }];
        assert!(routed_experts(&experts, &x, h, &bad_row, &mut untouched).is_err());
        assert!(routed_experts(&experts, &x, 128, &routes, &mut untouched).is_err());
        assert!(untouched.iter().all(|&v| v == 1.0), "a refused call wrote");
    }
}
