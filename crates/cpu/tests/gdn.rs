//! Tests of the Gated DeltaNet core: chunked form vs recurrence, splitting invariance,
//! hand-computed cases, head grouping, shape errors.

use deltaserve_cpu::gdn::{GdnDims, GdnError, GdnInputs, gdn_chunked, gdn_recurrent};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Owned inputs for one sequence plus an initial state.
#[derive(Clone)]
struct Case {
    d: GdnDims,
    t: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state0: Vec<f32>,
}

impl Case {
    fn inputs(&self) -> GdnInputs<'_> {
        self.slice(0, self.t)
    }

    /// Inputs of tokens `a..b`.
    fn slice(&self, a: usize, b: usize) -> GdnInputs<'_> {
        let GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv } = self.d;
        GdnInputs {
            q: &self.q[a * hk * dk..b * hk * dk],
            k: &self.k[a * hk * dk..b * hk * dk],
            v: &self.v[a * hv * dv..b * hv * dv],
            g: &self.g[a * hv..b * hv],
            beta: &self.beta[a * hv..b * hv],
        }
    }

    fn out_len(&self) -> usize {
        self.t * self.d.num_v_heads * self.d.head_v_dim
    }
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// L2-normalises each `dim`-long row in place (eps inside the sqrt, as in the model).
fn l2norm_rows(x: &mut [f32], dim: usize, scale: f32) {
    for row in x.chunks_mut(dim) {
        let inv = 1.0 / (row.iter().map(|e| e * e).sum::<f32>() + 1e-6).sqrt();
        row.iter_mut().for_each(|e| *e *= inv * scale);
    }
}

/// Realistic random inputs: q, k L2-normalised, q scaled by Dk^-0.5, g mostly in
/// [-5, 0] with occasional -30 and exact 0, beta in (0, 1), nonzero initial state.
fn random_case(d: GdnDims, t: usize, seed: u64) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv } = d;
    let mut uniform = |n: usize, lo: f32, hi: f32| -> Vec<f32> { (0..n).map(|_| rng.random_range(lo..hi)).collect() };
    let mut q = uniform(t * hk * dk, -1.0, 1.0);
    let mut k = uniform(t * hk * dk, -1.0, 1.0);
    let v = uniform(t * hv * dv, -1.0, 1.0);
    let state0 = uniform(hv * dk * dv, -1.0, 1.0);
    let beta = uniform(t * hv, -4.0, 4.0).into_iter().map(|b| 1.0 / (1.0 + (-b).exp())).collect();
    let g = uniform(t * hv, 0.0, 1.0)
        .into_iter()
        .map(|r| {
            if r < 0.03 {
                -30.0
            } else if r < 0.05 {
                0.0
            } else {
                // Map to x in [-6, 5): g = -softplus(x) in about [-5, -0.0025].
                -softplus(-6.0 + 11.0 * (r - 0.05) / 0.95).min(5.0)
            }
        })
        .collect();
    l2norm_rows(&mut q, dk, (dk as f32).powf(-0.5));
    l2norm_rows(&mut k, dk, 1.0);
    Case { d, t, q, k, v, g, beta, state0 }
}

/// Max |a - b| relative to max(max |b|, 1e-6).
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|x| x.is_finite()), "non-finite value");
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// Runs the recurrence on the whole case; returns (out, final state).
fn run_recurrent(c: &Case) -> (Vec<f32>, Vec<f32>) {
    let mut state = c.state0.clone();
    let mut out = vec![f32::NAN; c.out_len()];
    gdn_recurrent(c.d, &c.inputs(), &mut state, &mut out).unwrap();
    (out, state)
}

fn run_chunked(c: &Case, chunk: usize) -> (Vec<f32>, Vec<f32>) {
    let mut state = c.state0.clone();
    let mut out = vec![f32::NAN; c.out_len()];
    gdn_chunked(c.d, chunk, &c.inputs(), &mut state, &mut out).unwrap();
    (out, state)
}

fn dims_strategy() -> impl Strategy<Value = GdnDims> {
    let dim = prop::sample::select(vec![3usize, 8, 16, 32]);
    (1usize..=3, 1usize..=3, dim.clone(), dim).prop_map(|(hk, ratio, dk, dv)| GdnDims {
        num_k_heads: hk,
        num_v_heads: hk * ratio,
        head_k_dim: dk,
        head_v_dim: dv,
    })
}

const TOL: f32 = 1e-4;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn chunked_matches_recurrent(
        d in dims_strategy(),
        t in 1usize..200,
        chunk in prop::sample::select(vec![1usize, 2, 7, 16, 64]),
        seed in any::<u64>(),
    ) {
        let c = random_case(d, t, seed);
        let (out_r, state_r) = run_recurrent(&c);
        let (out_c, state_c) = run_chunked(&c, chunk);
        let e_out = rel_err(&out_c, &out_r);
        let e_state = rel_err(&state_c, &state_r);
        prop_assert!(e_out < TOL, "out rel err {e_out}");
        prop_assert!(e_state < TOL, "state rel err {e_state}");
    }

    #[test]
    fn splitting_is_invariant(
        d in dims_strategy(),
        t in 1usize..200,
        seed in any::<u64>(),
    ) {
        let c = random_case(d, t, seed);
        let (out_ref, state_ref) = run_recurrent(&c);

        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        let hv_dv = d.num_v_heads * d.head_v_dim;
        let mut state = c.state0.clone();
        let mut out = vec![f32::NAN; c.out_len()];
        let mut a = 0;
        while a < t {
            let b = (a + rng.random_range(1..=70usize)).min(t);
            let x = c.slice(a, b);
            let piece_out = &mut out[a * hv_dv..b * hv_dv];
            if rng.random_bool(0.5) {
                gdn_recurrent(d, &x, &mut state, piece_out).unwrap();
            } else {
                let chunk = [1usize, 2, 7, 16, 64][rng.random_range(0..5usize)];
                gdn_chunked(d, chunk, &x, &mut state, piece_out).unwrap();
            }
            a = b;
        }
        let e_out = rel_err(&out, &out_ref);
        let e_state = rel_err(&state, &state_ref);
        prop_assert!(e_out < TOL, "out rel err {e_out}");
        prop_assert!(e_state < TOL, "state rel err {e_state}");
    }
}

/// Runs both functions (and every chunk size that matters for T = 2) on one case.
fn check_all_forms(c: &Case, want_out: &[f32], want_state: &[f32]) {
    let mut results = vec![("recurrent", run_recurrent(c))];
    for chunk in [1, 2, 3] {
        results.push(("chunked", run_chunked(c, chunk)));
    }
    for (name, (out, state)) in results {
        for (got, want) in out.iter().zip(want_out) {
            assert!((got - want).abs() < 1e-6, "{name}: out {out:?} != {want_out:?}");
        }
        for (got, want) in state.iter().zip(want_state) {
            assert!((got - want).abs() < 1e-6, "{name}: state {state:?} != {want_state:?}");
        }
    }
}

#[test]
fn hand_checked_scalar() {
    // Dk = Dv = 1, one head, T = 2, initial state 0.5.
    // t0: g = ln 0.5, beta = 0.5, k = 1, q = 1, v = 2
    //     S = 0.5*0.5 = 0.25; kv = 0.25; delta = 0.5*(2 - 0.25) = 0.875
    //     S = 0.25 + 0.875 = 1.125; o = 1.125
    // t1: g = 0, beta = 0.25, k = -1, q = 1, v = -1
    //     S = 1.125; kv = -1.125; delta = 0.25*(-1 + 1.125) = 0.03125
    //     S = 1.125 + (-1)(0.03125) = 1.09375; o = 1.09375
    let c = Case {
        d: GdnDims { num_k_heads: 1, num_v_heads: 1, head_k_dim: 1, head_v_dim: 1 },
        t: 2,
        q: vec![1.0, 1.0],
        k: vec![1.0, -1.0],
        v: vec![2.0, -1.0],
        g: vec![0.5f32.ln(), 0.0],
        beta: vec![0.5, 0.25],
        state0: vec![0.5],
    };
    check_all_forms(&c, &[1.125, 1.09375], &[1.09375]);
}

#[test]
fn hand_checked_2x2() {
    // Dk = Dv = 2, one head, T = 2, zero initial state; q scaled by 2^-0.5.
    // t0: k = (1,0), q = (1,0)/√2, v = (1,2), g = 0, beta = 0.5
    //     delta = 0.5*(1,2) = (0.5,1); S = [[0.5,1],[0,0]]; o = Sᵀq = (0.5,1)/√2
    // t1: k = (0,1), q = (1,1)/√2/√2 = (0.5,0.5), v = (3,-1), g = ln 0.5, beta = 0.5
    //     S = [[0.25,0.5],[0,0]]; kv = Sᵀk = (0,0); delta = (1.5,-0.5)
    //     S = [[0.25,0.5],[1.5,-0.5]]; o = Sᵀq = 0.5*(1.75, 0) = (0.875, 0)
    let r = std::f32::consts::FRAC_1_SQRT_2;
    let c = Case {
        d: GdnDims { num_k_heads: 1, num_v_heads: 1, head_k_dim: 2, head_v_dim: 2 },
        t: 2,
        q: vec![r, 0.0, 0.5, 0.5],
        k: vec![1.0, 0.0, 0.0, 1.0],
        v: vec![1.0, 2.0, 3.0, -1.0],
        g: vec![0.0, 0.5f32.ln()],
        beta: vec![0.5, 0.5],
        state0: vec![0.0; 4],
    };
    check_all_forms(&c, &[0.5 * r, r, 0.875, 0.0], &[0.25, 0.5, 1.5, -0.5]);
}

/// Value head h must use key head h / (Hv / Hk): compare each head of a grouped run
/// with a single-head run fed that key head.
#[test]
fn head_grouping_is_consecutive() {
    let d = GdnDims { num_k_heads: 2, num_v_heads: 6, head_k_dim: 8, head_v_dim: 4 };
    let c = random_case(d, 20, 7);
    let (out, state) = run_recurrent(&c);
    let (out_c, state_c) = run_chunked(&c, 7);
    assert!(rel_err(&out_c, &out) < TOL);
    assert!(rel_err(&state_c, &state) < TOL);

    let (dk, dv, hk, hv) = (8, 4, 2, 6);
    let one = GdnDims { num_k_heads: 1, num_v_heads: 1, head_k_dim: dk, head_v_dim: dv };
    for h in 0..hv {
        let kh = h / 3;
        let pick = |x: &[f32], heads: usize, head: usize, dim: usize| -> Vec<f32> {
            (0..c.t).flat_map(|t| x[(t * heads + head) * dim..(t * heads + head + 1) * dim].to_vec()).collect()
        };
        let single = Case {
            d: one,
            t: c.t,
            q: pick(&c.q, hk, kh, dk),
            k: pick(&c.k, hk, kh, dk),
            v: pick(&c.v, hv, h, dv),
            g: pick(&c.g, hv, h, 1),
            beta: pick(&c.beta, hv, h, 1),
            state0: c.state0[h * dk * dv..(h + 1) * dk * dv].to_vec(),
        };
        let (o1, s1) = run_recurrent(&single);
        assert_eq!(o1, pick(&out, hv, h, dv), "head {h} output");
        assert_eq!(s1, state[h * dk * dv..(h + 1) * dk * dv], "head {h} state");
    }
}

/// Very strong decays must not overflow or produce NaN in the chunked form.
#[test]
fn strong_decay_stays_finite() {
    let d = GdnDims { num_k_heads: 1, num_v_heads: 2, head_k_dim: 16, head_v_dim: 16 };
    let mut c = random_case(d, 150, 11);
    for (i, g) in c.g.iter_mut().enumerate() {
        *g = if i % 5 == 0 { -1.0 } else { -100.0 };
    }
    let (out_r, state_r) = run_recurrent(&c);
    for chunk in [7, 64] {
        let (out_c, state_c) = run_chunked(&c, chunk);
        assert!(rel_err(&out_c, &out_r) < TOL);
        assert!(rel_err(&state_c, &state_r) < TOL);
    }
}

#[test]
fn empty_input_is_a_no_op() {
    let d = GdnDims { num_k_heads: 1, num_v_heads: 2, head_k_dim: 3, head_v_dim: 4 };
    let state0: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let x = GdnInputs { q: &[], k: &[], v: &[], g: &[], beta: &[] };
    let mut state = state0.clone();
    gdn_recurrent(d, &x, &mut state, &mut []).unwrap();
    gdn_chunked(d, 64, &x, &mut state, &mut []).unwrap();
    assert_eq!(state, state0);
}

#[test]
fn shape_errors_are_reported() {
    let d = GdnDims { num_k_heads: 2, num_v_heads: 4, head_k_dim: 3, head_v_dim: 5 };
    let c = random_case(d, 6, 3);
    let good_out = c.out_len();
    let good_state = c.state0.len();

    let call = |d: GdnDims, x: &GdnInputs, state_len: usize, out_len: usize| {
        let mut state = vec![0.0; state_len];
        let mut out = vec![0.0; out_len];
        let r = gdn_recurrent(d, x, &mut state, &mut out);
        let ch = gdn_chunked(d, 4, x, &mut state, &mut out);
        assert_eq!(r, ch, "both functions must report the same error");
        r
    };
    let len_err = |arg: &'static str, expected: usize, actual: usize| Err(GdnError::Length { arg, expected, actual });

    assert_eq!(call(d, &c.inputs(), good_state, good_out), Ok(()));

    let short = |s: &[f32]| s[..s.len() - 1].to_vec();
    let q = short(&c.q);
    let x = GdnInputs { q: &q, ..c.inputs() };
    assert_eq!(call(d, &x, good_state, good_out), len_err("q", 36, 35));
    let k = short(&c.k);
    let x = GdnInputs { k: &k, ..c.inputs() };
    assert_eq!(call(d, &x, good_state, good_out), len_err("k", 36, 35));
    let v = short(&c.v);
    let x = GdnInputs { v: &v, ..c.inputs() };
    assert_eq!(call(d, &x, good_state, good_out), len_err("v", 120, 119));
    let g = short(&c.g);
    let x = GdnInputs { g: &g, ..c.inputs() };
    assert_eq!(call(d, &x, good_state, good_out), len_err("g", 24, 23));
    assert_eq!(call(d, &c.inputs(), good_state + 1, good_out), len_err("state", 60, 61));
    assert_eq!(call(d, &c.inputs(), good_state, good_out - 1), len_err("out", 120, 119));

    // beta decides T; a ragged beta is its own error.
    let beta = short(&c.beta);
    let x = GdnInputs { beta: &beta, ..c.inputs() };
    assert_eq!(call(d, &x, good_state, good_out), Err(GdnError::TokenCount { len: 23, num_v_heads: 4 }));
    // A shorter, consistent beta makes every other slice too long.
    let x = GdnInputs { beta: &c.beta[..20], ..c.inputs() };
    assert_eq!(call(d, &x, good_state, good_out), len_err("q", 30, 36));

    // Bad dims: Hv not a multiple of Hk, zero dims.
    for bad in [
        GdnDims { num_v_heads: 3, ..d },
        GdnDims { num_k_heads: 0, ..d },
        GdnDims { num_v_heads: 0, ..d },
        GdnDims { head_k_dim: 0, ..d },
        GdnDims { head_v_dim: 0, ..d },
    ] {
        let r = call(bad, &c.inputs(), good_state, good_out);
        assert!(matches!(r, Err(GdnError::Dims { .. })), "{bad:?}: {r:?}");
    }

    // chunk = 0.
    let mut state = c.state0.clone();
    let mut out = vec![0.0; good_out];
    assert_eq!(gdn_chunked(d, 0, &c.inputs(), &mut state, &mut out), Err(GdnError::ZeroChunk));
    // Errors leave the state untouched.
    assert_eq!(state, c.state0);
    // Error messages name the argument and both lengths.
    let msg = len_err("q", 36, 35).unwrap_err().to_string();
    assert!(msg.contains("`q`") && msg.contains("36") && msg.contains("35"), "{msg}");
}
