//! Gated DeltaNet core: the f32 CPU reference (numerical oracle).
//!
//! Two computations of the same function (docs/architecture.md §2.2 points 6–8 and §3.1):
//!
//! * [`gdn_recurrent`] — the token-by-token recurrence, per value head with state
//!   `S ∈ R^{Dk×Dv}`:
//!   ```text
//!   S     = exp(g_t) S
//!   kv    = Sᵀ k_t
//!   delta = β_t (v_t − kv)
//!   S     = S + k_t ⊗ delta
//!   o_t   = Sᵀ q_t            (read after the update)
//!   ```
//! * [`gdn_chunked`] — the chunked WY / UT-transform form used for prefill. Per chunk of
//!   `C` tokens, with `G` the chunk-local cumulative sum of `g` and `h` the state at the
//!   chunk start:
//!   ```text
//!   A_ij  = β_i (k_i·k_j) exp(G_i − G_j)     for i > j, else 0
//!   Tm    = (I + A)⁻¹                         (unit lower triangular)
//!   w     = Tm (β ⊙ exp(G) ⊙ K)
//!   u     = Tm (β ⊙ V)
//!   v_new = u − w h
//!   o_i   = exp(G_i) q_i h + Σ_{j≤i} (q_i·k_j) exp(G_i − G_j) v_new_j
//!   h'    = exp(G_last) h + Σ_j k_jᵀ (exp(G_last − G_j) v_new_j)
//!   ```
//!   Only non-positive exponents are ever formed (`G_i − G_j` with `i ≥ j`, and `G_i`
//!   itself), so strong decays underflow to zero instead of overflowing.
//!
//! Both functions work on `T` tokens of one sequence and carry the state across calls,
//! so a prompt may be processed in arbitrary pieces. The gate `g` must be finite.
//!
//! Layouts (row-major): `q, k: [T, Hk, Dk]`, `v: [T, Hv, Dv]`, `g, beta: [T, Hv]`,
//! `state: [Hv, Dk, Dv]`, `out: [T, Hv, Dv]`. Value head `h` reads key head
//! `h / (Hv / Hk)` (each key head serves `Hv / Hk` consecutive value heads).

use rayon::prelude::*;

use crate::kvquant::round_bf16_slice;

/// Shapes of one Gated DeltaNet layer's core.
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub head_k_dim: usize,
    pub head_v_dim: usize,
}

/// Inputs for T tokens of ONE sequence (row-major):
/// q, k: [T, Hk, Dk] — already L2-normalised; q already scaled by Dk^-0.5
/// v: [T, Hv, Dv]; g: [T, Hv] log-decay (<= 0); beta: [T, Hv] in (0,1)
pub struct GdnInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Invalid arguments to [`gdn_recurrent`] / [`gdn_chunked`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GdnError {
    /// A dimension is zero, or `num_v_heads` is not a multiple of `num_k_heads`.
    #[error(
        "invalid GDN dims: num_k_heads={num_k_heads}, num_v_heads={num_v_heads}, \
         head_k_dim={head_k_dim}, head_v_dim={head_v_dim} (all must be > 0 and \
         num_v_heads a multiple of num_k_heads)"
    )]
    Dims { num_k_heads: usize, num_v_heads: usize, head_k_dim: usize, head_v_dim: usize },
    /// `beta.len()` is not a multiple of `num_v_heads`, so `T` is undefined.
    #[error("`beta` has length {len}, which is not a multiple of num_v_heads={num_v_heads}")]
    TokenCount { len: usize, num_v_heads: usize },
    /// A slice has the wrong length for the dims and `T`.
    #[error("`{arg}` has length {actual}, expected {expected}")]
    Length { arg: &'static str, expected: usize, actual: usize },
    /// The chunk size passed to [`gdn_chunked`] is zero.
    #[error("chunk size must be at least 1")]
    ZeroChunk,
}

/// Runs the gated delta rule token by token.
///
/// `state: [Hv, Dk, Dv]` is read and updated in place; `out: [T, Hv, Dv]` is fully
/// overwritten. `T = beta.len() / Hv`.
pub fn gdn_recurrent(d: GdnDims, x: &GdnInputs, state: &mut [f32], out: &mut [f32]) -> Result<(), GdnError> {
    let t = validate(d, x, state, out)?;
    run_per_head(d, t, state, out, |h, s, o| recurrent_head(&HeadView::new(d, x, t, h), s, o, false));
    Ok(())
}

/// [`gdn_recurrent`] with the state stored bf16: token by token, each output read from the updated f32
/// state, then the state rounded to bf16 (what a bf16 state slot keeps after decoding that token), so
/// that any split of the tokens into calls leaves the same state.
pub fn gdn_recurrent_bf16_state(d: GdnDims, x: &GdnInputs, state: &mut [f32], out: &mut [f32]) -> Result<(), GdnError> {
    let t = validate(d, x, state, out)?;
    run_per_head(d, t, state, out, |h, s, o| recurrent_head(&HeadView::new(d, x, t, h), s, o, true));
    Ok(())
}

/// Same function as [`gdn_recurrent`], computed in the chunked WY/UT form with chunks of
/// `chunk` tokens (64 in production; the last chunk may be partial), chunks counted
/// from the first token of this call.
pub fn gdn_chunked(
    d: GdnDims,
    chunk: usize,
    x: &GdnInputs,
    state: &mut [f32],
    out: &mut [f32],
) -> Result<(), GdnError> {
    if chunk == 0 {
        return Err(GdnError::ZeroChunk);
    }
    let t = validate(d, x, state, out)?;
    run_per_head(d, t, state, out, |h, s, o| chunked_head(&HeadView::new(d, x, t, h), chunk, s, o));
    Ok(())
}

/// Checks all slice lengths against the dims; returns `T`.
fn validate(d: GdnDims, x: &GdnInputs, state: &[f32], out: &[f32]) -> Result<usize, GdnError> {
    let GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv } = d;
    if hk == 0 || hv == 0 || dk == 0 || dv == 0 || hv % hk != 0 {
        return Err(GdnError::Dims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv });
    }
    if !x.beta.len().is_multiple_of(hv) {
        return Err(GdnError::TokenCount { len: x.beta.len(), num_v_heads: hv });
    }
    let t = x.beta.len() / hv;
    let checks = [
        ("q", t * hk * dk, x.q.len()),
        ("k", t * hk * dk, x.k.len()),
        ("v", t * hv * dv, x.v.len()),
        ("g", t * hv, x.g.len()),
        ("state", hv * dk * dv, state.len()),
        ("out", t * hv * dv, out.len()),
    ];
    for (arg, expected, actual) in checks {
        if expected != actual {
            return Err(GdnError::Length { arg, expected, actual });
        }
    }
    Ok(t)
}

/// Runs `f(head, state_of_head [Dk*Dv], out_of_head [T*Dv])` for every value head in
/// parallel, then scatters the per-head outputs into `out: [T, Hv, Dv]`.
fn run_per_head<F>(d: GdnDims, t: usize, state: &mut [f32], out: &mut [f32], f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync,
{
    let (hv, dv) = (d.num_v_heads, d.head_v_dim);
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(d.head_k_dim * dv)
        .enumerate()
        .map(|(h, s)| {
            let mut o = vec![0.0f32; t * dv];
            f(h, s, &mut o);
            o
        })
        .collect();
    for (h, o) in per_head.iter().enumerate() {
        for tok in 0..t {
            let dst = (tok * hv + h) * dv;
            out[dst..dst + dv].copy_from_slice(&o[tok * dv..(tok + 1) * dv]);
        }
    }
}

/// The inputs of one value head, addressed by token.
struct HeadView<'a> {
    x: &'a GdnInputs<'a>,
    t: usize,
    hv: usize,
    hk: usize,
    dk: usize,
    dv: usize,
    /// Value head index.
    h: usize,
    /// Key head serving this value head.
    kh: usize,
}

impl<'a> HeadView<'a> {
    fn new(d: GdnDims, x: &'a GdnInputs<'a>, t: usize, h: usize) -> Self {
        let ratio = d.num_v_heads / d.num_k_heads;
        HeadView { x, t, hv: d.num_v_heads, hk: d.num_k_heads, dk: d.head_k_dim, dv: d.head_v_dim, h, kh: h / ratio }
    }
    fn q(&self, tok: usize) -> &'a [f32] {
        let o = (tok * self.hk + self.kh) * self.dk;
        &self.x.q[o..o + self.dk]
    }
    fn k(&self, tok: usize) -> &'a [f32] {
        let o = (tok * self.hk + self.kh) * self.dk;
        &self.x.k[o..o + self.dk]
    }
    fn v(&self, tok: usize) -> &'a [f32] {
        let o = (tok * self.hv + self.h) * self.dv;
        &self.x.v[o..o + self.dv]
    }
    fn g(&self, tok: usize) -> f32 {
        self.x.g[tok * self.hv + self.h]
    }
    fn beta(&self, tok: usize) -> f32 {
        self.x.beta[tok * self.hv + self.h]
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y[c] = Σ_r x[r] m[r, c]` for `m: [len(x), len(y)]` (i.e. `y = mᵀ x`).
fn vec_mat(x: &[f32], m: &[f32], y: &mut [f32]) {
    let n = y.len();
    y.fill(0.0);
    for (r, &xr) in x.iter().enumerate() {
        for (yc, &mrc) in y.iter_mut().zip(&m[r * n..(r + 1) * n]) {
            *yc += xr * mrc;
        }
    }
}

/// `m[r, c] += x[r] y[c]` for `m: [len(x), len(y)]`.
fn add_outer(m: &mut [f32], x: &[f32], y: &[f32]) {
    let n = y.len();
    for (r, &xr) in x.iter().enumerate() {
        for (mrc, &yc) in m[r * n..(r + 1) * n].iter_mut().zip(y) {
            *mrc += xr * yc;
        }
    }
}

/// One value head, token by token. `s: [Dk, Dv]`, `o: [T, Dv]`; `bf16`: `s` rounded to bf16 after each
/// token (after its output is read).
fn recurrent_head(x: &HeadView, s: &mut [f32], o: &mut [f32], bf16: bool) {
    let dv = x.dv;
    let mut kv = vec![0.0f32; dv];
    let mut delta = vec![0.0f32; dv];
    for tok in 0..x.t {
        let (q, k, v) = (x.q(tok), x.k(tok), x.v(tok));
        let decay = x.g(tok).exp();
        s.iter_mut().for_each(|e| *e *= decay);
        vec_mat(k, s, &mut kv);
        let beta = x.beta(tok);
        for ((dj, &vj), &kvj) in delta.iter_mut().zip(v).zip(&kv) {
            *dj = beta * (vj - kvj);
        }
        add_outer(s, k, &delta);
        vec_mat(q, s, &mut o[tok * dv..(tok + 1) * dv]);
        if bf16 {
            round_bf16_slice(s);
        }
    }
}

/// One value head in the chunked WY/UT form. `s: [Dk, Dv]`, `o: [T, Dv]`.
fn chunked_head(x: &HeadView, chunk: usize, s: &mut [f32], o: &mut [f32]) {
    let (dk, dv) = (x.dk, x.dv);
    let mut start = 0;
    while start < x.t {
        let n = chunk.min(x.t - start);
        let tok = |i: usize| start + i;
        let beta: Vec<f32> = (0..n).map(|i| x.beta(tok(i))).collect();

        // G: chunk-local cumulative sum of the log-decays (non-increasing, <= 0).
        let mut big_g = vec![0.0f32; n];
        let mut acc = 0.0f32;
        for (i, gi) in big_g.iter_mut().enumerate() {
            acc += x.g(tok(i));
            *gi = acc;
        }
        // Decay from token j to token i (i >= j): exp(G_i - G_j) <= 1.
        let decay = |i: usize, j: usize| (big_g[i] - big_g[j]).exp();

        // A: strictly lower triangular [n, n].
        let mut a = vec![0.0f32; n * n];
        for i in 0..n {
            for j in 0..i {
                a[i * n + j] = beta[i] * dot(x.k(tok(i)), x.k(tok(j))) * decay(i, j);
            }
        }

        // Tm = (I + A)^-1 by forward substitution on (I + A) Tm = I:
        // Tm_ij = δ_ij − Σ_{j<=m<i} A_im Tm_mj   (Tm is unit lower triangular).
        let mut tm = vec![0.0f32; n * n];
        for i in 0..n {
            tm[i * n + i] = 1.0;
            for j in 0..i {
                let sum: f32 = (j..i).map(|m| a[i * n + m] * tm[m * n + j]).sum();
                tm[i * n + j] = -sum;
            }
        }

        // w = Tm (β ⊙ exp(G) ⊙ K): [n, Dk];  u = Tm (β ⊙ V): [n, Dv].
        let mut w = vec![0.0f32; n * dk];
        let mut u = vec![0.0f32; n * dv];
        for i in 0..n {
            for m in 0..=i {
                let t_im = tm[i * n + m];
                let kw = t_im * beta[m] * big_g[m].exp();
                let vw = t_im * beta[m];
                for (wr, &kr) in w[i * dk..(i + 1) * dk].iter_mut().zip(x.k(tok(m))) {
                    *wr += kw * kr;
                }
                for (uc, &vc) in u[i * dv..(i + 1) * dv].iter_mut().zip(x.v(tok(m))) {
                    *uc += vw * vc;
                }
            }
        }

        // v_new = u − w h: [n, Dv].
        let mut v_new = u;
        let mut wh = vec![0.0f32; dv];
        for i in 0..n {
            vec_mat(&w[i * dk..(i + 1) * dk], s, &mut wh);
            for (vc, &whc) in v_new[i * dv..(i + 1) * dv].iter_mut().zip(&wh) {
                *vc -= whc;
            }
        }

        // o_i = exp(G_i) q_i h + Σ_{j<=i} (q_i·k_j) exp(G_i − G_j) v_new_j.
        let mut qh = vec![0.0f32; dv];
        for i in 0..n {
            let q = x.q(tok(i));
            vec_mat(q, s, &mut qh);
            let oi = &mut o[tok(i) * dv..(tok(i) + 1) * dv];
            let inter = big_g[i].exp();
            for (oc, &qhc) in oi.iter_mut().zip(&qh) {
                *oc = inter * qhc;
            }
            for j in 0..=i {
                let coef = dot(q, x.k(tok(j))) * decay(i, j);
                for (oc, &vc) in oi.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]) {
                    *oc += coef * vc;
                }
            }
        }

        // h' = exp(G_last) h + Σ_j k_jᵀ (exp(G_last − G_j) v_new_j).
        let last = n - 1;
        let chunk_decay = big_g[last].exp();
        s.iter_mut().for_each(|e| *e *= chunk_decay);
        let mut scaled = vec![0.0f32; dv];
        for j in 0..n {
            let dj = decay(last, j);
            for (sc, &vc) in scaled.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]) {
                *sc = dj * vc;
            }
            add_outer(s, x.k(tok(j)), &scaled);
        }

        start += n;
    }
}
