//! The routed experts of a sparse layer: routing (top-k and weights against `deltaserve_cpu::moe::route`,
//! the shared expert's gate), the grouping (rows per expert, every pair placed once), and the whole
//! expert MLP + un-permute through both paths — per-pair GEMVs and grouped GEMMs — against the CPU
//! with the GPU's bf16 roundings (after gate/up, SwiGLU and down), under routings where every token
//! picks at random, where one expert gets every token, and where most experts get none.

use deltaserve_cpu as cpu;
use deltaserve_cuda::ops::elementwise;
use deltaserve_cuda::ops::moe::{self, ExpertWeights};
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, compare, randv, rb};
use crate::{Env, Op};

/// How a [`Op::Moe`] case's tokens route.
#[derive(Clone, Copy, Debug)]
pub enum Routing {
    /// Random logits: the experts are spread.
    Spread,
    /// Expert 3 wins every token (the others still fill the rest of each top-k).
    OneHot,
    /// Only the first `top_k + 1` experts are ever chosen: the others get no rows.
    Few,
}

fn logits(rng: &mut StdRng, t: usize, e: usize, top_k: usize, routing: Routing) -> Vec<f32> {
    let mut l: Vec<f32> = (0..t * e).map(|_| rng.random_range(-4.0f32..4.0)).collect();
    for row in l.chunks_mut(e) {
        match routing {
            Routing::Spread => {}
            Routing::OneHot => row[3 % e] += 20.0,
            Routing::Few => row.iter_mut().skip(top_k + 1).for_each(|v| *v -= 40.0),
        }
    }
    l
}

/// The expert MLP + weighted sum on the CPU, rounding to bf16 where the GPU stores: `x` `[t, h]`,
/// `w` the block (expert e's gate, up, down at `e·3·i·h`), `shared` the shared expert's output.
#[allow(clippy::too_many_arguments)]
fn reference(
    x: &[f32],
    t: usize,
    h: usize,
    i: usize,
    w: &[f32],
    routes: &[Vec<(usize, f32)>],
    gate: &[f32],
    shared: &[f32],
) -> Vec<f32> {
    let mut out = vec![0.0f32; t * h];
    for (r, route) in routes.iter().enumerate() {
        let xr = &x[r * h..(r + 1) * h];
        for &(e, p) in route {
            let blk = &w[e * 3 * i * h..(e + 1) * 3 * i * h];
            let gu: Vec<f32> = cpu::linear::linear(xr, 1, &blk[..2 * i * h], 2 * i, h).into_iter().map(rb).collect();
            let act: Vec<f32> = (0..i).map(|c| rb(cpu::activation::silu(gu[c]) * gu[i + c])).collect();
            let y = cpu::linear::linear(&act, 1, &blk[2 * i * h..], h, i);
            for (o, v) in out[r * h..(r + 1) * h].iter_mut().zip(y) {
                *o += p * rb(v);
            }
        }
        for c in 0..h {
            out[r * h + c] += gate[r] * shared[r * h + c];
        }
    }
    out
}

/// [`Op::Moe`]: routing, grouping, and both expert paths against the CPU.
pub fn moe_case(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::Moe { t, experts: ne, top_k, h, i, norm, routing } = *op else { unreachable!() };
    let pairs = t * top_k;
    let l = logits(rng, t, ne, top_k, routing);
    let x = randv(rng, t * h, 1.0);
    let wg = randv(rng, h, 0.1);
    let w = randv(rng, ne * 3 * i * h, 0.08);
    let shared = randv(rng, t * h, 1.0);
    let (lp, xp, wgp, wp) = (d.f32s(&l)?, d.bf16(&x)?, d.bf16(&wg)?, d.bf16(&w)?);
    let (topk, sg) = (d.poison(moe::topk_bytes(t, top_k))?, d.poison(4 * t)?);
    moe::route(k, s, lp, t, ne, top_k, norm, xp, wgp, h, topk, sg)?;
    let mut v = Vec::new();

    // Routing: the CPU oracle's experts exactly, its weights to f32 rounding; the gate.
    let routes: Vec<Vec<(usize, f32)>> = l.chunks(ne).map(|r| cpu::moe::route(r, top_k, norm)).collect();
    let mut got = vec![0i32; 2 * pairs];
    d.rt.download(&mut got, topk)?;
    let want_e: Vec<i32> = routes.iter().flatten().map(|c| c.0 as i32).collect();
    let got_e: Vec<i32> = got.chunks(2).map(|c| c[0]).collect();
    let bad = want_e.iter().zip(&got_e).filter(|(a, b)| a != b).count();
    v.push(Outcome { ok: bad == 0, detail: format!("top-{top_k} experts of {t} tokens: {bad} differ") });
    let want_w: Vec<f32> = routes.iter().flatten().map(|c| c.1).collect();
    let got_w: Vec<f32> = got.chunks(2).map(|c| f32::from_bits(c[1] as u32)).collect();
    v.push(compare("weights", &want_w, &got_w, crate::Tol { atol_rms: 0.0, atol_abs: 1e-6, rtol: 1e-5 }));
    let gate: Vec<f32> = cpu::linear::linear(&x, t, &wg, 1, h).into_iter().map(cpu::activation::sigmoid).collect();
    v.push(compare("shared gate", &gate, &d.get_f32(sg, t)?, tol));

    // Grouping: rows per expert as prefix sums, every pair at its own row.
    let (offs, rows) = (d.poison(moe::offsets_bytes(ne))?, d.poison(4 * pairs)?);
    moe::offsets(k, s, topk, pairs, ne, offs, rows)?;
    let (mut o, mut r) = (vec![0i32; 2 * (ne + 1)], vec![0i32; pairs]);
    d.rt.download(&mut o, offs)?;
    d.rt.download(&mut r, rows)?;
    let mut count = vec![0i32; ne];
    want_e.iter().for_each(|&e| count[e as usize] += 1);
    let ok_offs = (0..ne).all(|e| o[e + 1] - o[e] == count[e])
        && o[0] == 0
        && (0..ne).all(|e| o[ne + 2 + e] - o[ne + 1 + e] == (count[e] as usize).div_ceil(moe::TILE_ROWS) as i32);
    let mut seen = vec![false; pairs];
    let ok_rows = r.iter().zip(&want_e).all(|(&row, &e)| {
        let fresh = (o[e as usize]..o[e as usize + 1]).contains(&row) && !seen[row as usize];
        if fresh {
            seen[row as usize] = true;
        }
        fresh
    });
    v.push(Outcome { ok: ok_offs && ok_rows, detail: format!("grouping: offsets {ok_offs}, rows {ok_rows}") });

    // Both expert paths, onto the shared expert's output.
    let want = reference(&x, t, h, i, &w, &routes, &gate, &shared);
    let gu = ExpertWeights { base: wp, stride: 3 * i * h, n: 2 * i, kdim: h };
    let dn = ExpertWeights { base: wp + (2 * 2 * i * h) as u64, stride: 3 * i * h, n: h, kdim: i };
    for grouped in [false, true] {
        let (g, a, y) = (d.poison(4 * pairs * i)?, d.poison(2 * pairs * i)?, d.poison(2 * pairs * h)?);
        let out = d.bf16(&shared)?;
        let up = g + (2 * i) as u64;
        if grouped {
            let xin = d.poison(2 * pairs * h)?;
            moe::permute(k, s, xp, rows, t, top_k, h, xin)?;
            moe::gemm(k, s, xin, offs, ne, pairs, &gu, g)?;
            elementwise::swiglu(k, s, g, 2 * i, up, 2 * i, a, pairs, i)?;
            moe::gemm(k, s, a, offs, ne, pairs, &dn, y)?;
            moe::unpermute(k, s, y, Some(rows), topk, t, top_k, sg, h, out)?;
        } else {
            moe::gemv(k, s, xp, top_k, topk, pairs, &gu, g)?;
            elementwise::swiglu(k, s, g, 2 * i, up, 2 * i, a, pairs, i)?;
            moe::gemv(k, s, a, 1, topk, pairs, &dn, y)?;
            moe::unpermute(k, s, y, None, topk, t, top_k, sg, h, out)?;
        }
        let what = if grouped { "grouped GEMM out" } else { "per-pair GEMV out" };
        v.push(compare(what, &want, &d.get_bf16(out, t * h)?, tol));
    }
    Ok(v)
}
