//! The routed experts of a sparse layer: routing (top-k and weights against `deltaserve_cpu::moe::route`,
//! the shared expert's gate), the grouping (rows per expert, every pair placed once), and the whole
//! expert MLP + un-permute through both paths — per-pair GEMVs and grouped GEMMs — against the CPU
//! with the GPU's bf16 roundings (after gate/up, SwiGLU and down), under routings where every token
//! picks at random, where one expert gets every token, and where most experts get none; at widths the
//! int4 format takes, the same with int4 experts (symmetric with fp16 scales, zero points with bf16
//! scales) against their host dequantisation; and the per-pair path with the shared expert run as one more
//! pair per token (bf16, and int4 with its gate/up stacked or as two linears).

use deltaserve_cpu as cpu;
use deltaserve_cuda::ops::elementwise;
use deltaserve_cuda::ops::moe::{self, ExpertWeights, SharedPairs};
use deltaserve_cuda::ops::moe_w4::{self, W4Experts, W4Shared};
use deltaserve_cuda::ops::w4a16::W4Weights;
use deltaserve_cuda::w4::{ScaleDtype, W4Bytes, W4Linear};
use half::bf16;
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
            let y = expert_mlp(xr, &w[e * 3 * i * h..(e + 1) * 3 * i * h], h, i);
            for (o, v) in out[r * h..(r + 1) * h].iter_mut().zip(y) {
                *o += p * v;
            }
        }
        for c in 0..h {
            out[r * h + c] += gate[r] * shared[r * h + c];
        }
    }
    out
}

/// One expert's SwiGLU MLP over the row `xr` (`blk`: its gate, up and down, `[2i, h]` then `[h, i]`),
/// rounded to bf16 where the GPU stores (after gate/up, SwiGLU and down).
fn expert_mlp(xr: &[f32], blk: &[f32], h: usize, i: usize) -> Vec<f32> {
    let act = expert_act(xr, blk, h, i);
    cpu::linear::linear(&act, 1, &blk[2 * i * h..], h, i).into_iter().map(rb).collect()
}

/// [`expert_mlp`]'s SwiGLU output (the down projection's input), as the GPU stores it.
fn expert_act(xr: &[f32], blk: &[f32], h: usize, i: usize) -> Vec<f32> {
    let gu: Vec<f32> = cpu::linear::linear(xr, 1, &blk[..2 * i * h], 2 * i, h).into_iter().map(rb).collect();
    (0..i).map(|c| rb(cpu::activation::silu(gu[c]) * gu[i + c])).collect()
}

/// How far one rounding of the shared expert's SwiGLU output to the other neighbouring bf16 moves an output:
/// one bf16 step (2^-7 relative) of its largest value, through the down projection's largest weight, times
/// the largest gate. The GPU's f32 sums differ from the reference's in their last bits, so now and then an
/// intermediate stored as bf16 (after gate/up and the SwiGLU) lands on the other side of a rounding boundary;
/// the int4 kernels form each group's dot product as `s · (T − (128 + z) · X)` with T ≈ (128 + z) · X (a
/// cancellation the plain f32 dot product of the reference does not have), so their sums sit ~30× further
/// off and flip far more often: at 64 tokens several values a case (the bf16 GEMVs: at a few hundred
/// tokens), each moving the outputs it feeds by up to this much (twice it covers a flip of the gate/up
/// output, which SwiGLU passes on at about the same size). The shared expert's gate (~0.5) passes a flip on
/// larger than a routed expert's weight (~1 / top-k) does.
fn flip_bound(x: &[f32], t: usize, h: usize, i: usize, blk: &[f32], gate: &[f32]) -> f32 {
    let a_max = (0..t).flat_map(|r| expert_act(&x[r * h..(r + 1) * h], blk, h, i)).fold(0.0f32, |m, a| m.max(a.abs()));
    let w_max = blk[2 * i * h..].iter().fold(0.0f32, |m, w| m.max(w.abs()));
    let g_max = gate.iter().fold(0.0f32, |m, g| m.max(g.abs()));
    let step = if a_max > 0.0 { 2f32.powi(a_max.log2().floor() as i32 - 7) } else { 0.0 };
    2.0 * step * w_max * g_max
}

/// The shared expert of weights `blk` (an expert's layout) over every row of `x`, as the GPU stores it.
fn shared_mlp(x: &[f32], t: usize, h: usize, i: usize, blk: &[f32]) -> Vec<f32> {
    (0..t).flat_map(|r| expert_mlp(&x[r * h..(r + 1) * h], blk, h, i)).collect()
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
    moe::offsets(k, s, topk, pairs, ne, moe::TILE_ROWS, offs, rows)?;
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
    let path = Path { xp, rows, topk, sg, t, top_k, h, i, shared: &shared };
    for grouped in [false, true] {
        let out = path.run(e, d, grouped, &|down, x, y| {
            let (w, x_div) = if down { (&dn, 1) } else { (&gu, top_k) };
            if grouped {
                moe::gemm(k, s, x, offs, ne, pairs, w, y)
            } else {
                moe::gemv(k, s, x, x_div, topk, pairs, None, w, y)
            }
        })?;
        let what = if grouped { "grouped GEMM out" } else { "per-pair GEMV out" };
        v.push(compare(what, &want, &out, tol));
    }
    // The shared expert as one more pair per token of the per-pair GEMVs (its own weights, an expert's
    // shape): the output onto poison (the un-permute must not read it).
    let wsh = randv(rng, 3 * i * h, 0.08);
    let want = reference(&x, t, h, i, &w, &routes, &gate, &shared_mlp(&x, t, h, i, &wsh));
    let shp = d.bf16(&wsh)?;
    let out = path.run_shared(e, d, &|down, x, y| {
        let (w, x_div, sh) = if down {
            (&dn, 1, SharedPairs { w: shp + (2 * 2 * i * h) as u64, tokens: t, x_row: pairs })
        } else {
            (&gu, top_k, SharedPairs { w: shp, tokens: t, x_row: 0 })
        };
        moe::gemv(k, s, x, x_div, topk, pairs, Some(sh), w, y)
    })?;
    let flip = flip_bound(&x, t, h, i, &wsh, &gate);
    let what = format!("per-pair GEMV with the shared expert's pairs (a rounding flip {flip:.1e}) out");
    v.push(compare(&what, &want, &out, crate::Tol { atol_abs: tol.atol_abs + flip, ..tol }));
    if h.is_multiple_of(128) && i.is_multiple_of(128) {
        let offs32 = d.poison(moe::offsets_bytes(ne))?;
        moe::offsets(k, s, topk, pairs, ne, moe_w4::TILE_ROWS, offs32, rows)?;
        let mut o32 = vec![0i32; 2 * (ne + 1)];
        d.rt.download(&mut o32, offs32)?;
        let tiles = (0..ne).all(|e| o32[ne + 2 + e] - o32[ne + 1 + e] == (count[e] as usize).div_ceil(32) as i32);
        v.push(Outcome { ok: tiles && o32[..=ne] == o[..=ne], detail: format!("tiles of 32 rows: {tiles}") });
        for asym in [false, true] {
            let (wq, gu, dn) = w4_experts(d, &w, ne, h, i, asym)?;
            let want = reference(&x, t, h, i, &wq, &routes, &gate, &shared);
            for grouped in [false, true] {
                let out = path.run(e, d, grouped, &|down, x, y| {
                    let (w, x_div, ldx) = if down { (&dn, 1, i) } else { (&gu, top_k, h) };
                    if grouped {
                        moe_w4::gemm(k, s, x, offs32, pairs, w, y)
                    } else {
                        moe_w4::gemv(k, s, x, ldx, x_div, topk, pairs, None, w, y)
                    }
                })?;
                let fmt = if asym { "zero points, bf16 scales" } else { "symmetric, fp16 scales" };
                let what = if grouped { "grouped GEMM" } else { "per-pair GEMV" };
                v.push(compare(&format!("int4 ({fmt}) {what} out"), &want, &out, tol));
            }
            // The shared expert's pairs: its gate/up as one stacked linear, and (where each half is whole
            // GEMV blocks) as the separate gate and up linears the backend loads.
            let (wsq, sgu, sgate, sup, sdn) = w4_shared(d, &wsh, h, i, asym)?;
            let want = reference(&x, t, h, i, &wq, &routes, &gate, &shared_mlp(&x, t, h, i, &wsq));
            let flip = flip_bound(&x, t, h, i, &wsq, &gate);
            let tol_sh = crate::Tol { atol_abs: tol.atol_abs + flip, ..tol };
            let split = W4Shared { top: sgate, bottom: Some(sup) };
            let stacked = W4Shared { top: sgu, bottom: None };
            for (what, g) in [("stacked", stacked), ("gate and up", split)] {
                if !g.fits(&gu.first) {
                    continue;
                }
                let out = path.run_shared(e, d, &|down, x, y| {
                    let (w, x_div, ldx, sh) = if down {
                        (&dn, 1, i, SharedPairs { w: W4Shared { top: sdn, bottom: None }, tokens: t, x_row: pairs })
                    } else {
                        (&gu, top_k, h, SharedPairs { w: g, tokens: t, x_row: 0 })
                    };
                    moe_w4::gemv(k, s, x, ldx, x_div, topk, pairs, Some(sh), w, y)
                })?;
                let fmt = if asym { "zero points" } else { "symmetric" };
                let what =
                    format!("int4 ({fmt}) with the shared expert's pairs ({what}, a rounding flip {flip:.1e}) out");
                v.push(compare(&what, &want, &out, tol_sh));
            }
        }
    }
    Ok(v)
}

/// A case's routed step: its x, grouping, routing and shared expert's gate and output on the device.
struct Path<'a> {
    xp: u64,
    rows: u64,
    topk: u64,
    sg: u64,
    t: usize,
    top_k: usize,
    h: usize,
    i: usize,
    shared: &'a [f32],
}

impl Path<'_> {
    /// One expert path onto a copy of the shared expert's output, returned: `proj(down, x, y)` runs the
    /// gate/up (`down` false: over x, or its copy grouped by expert) or the down projection (over the
    /// SwiGLU output) into `y`; grouped, the rows go through `rows`' order and back.
    fn run(&self, e: Env, d: &mut Dev, grouped: bool, proj: &dyn Fn(bool, u64, u64) -> R<()>) -> R<Vec<f32>> {
        let Env { k, s, .. } = e;
        let Path { xp, rows, topk, sg, t, top_k, h, i, shared } = *self;
        let pairs = t * top_k;
        let (g, a, y) = (d.poison(4 * pairs * i)?, d.poison(2 * pairs * i)?, d.poison(2 * pairs * h)?);
        let out = d.bf16(shared)?;
        let x = if grouped {
            let xin = d.poison(2 * pairs * h)?;
            moe::permute(k, s, xp, rows, t, top_k, h, xin)?;
            xin
        } else {
            xp
        };
        proj(false, x, g)?;
        elementwise::swiglu(k, s, g, 2 * i, g + (2 * i) as u64, 2 * i, a, pairs, i)?;
        proj(true, a, y)?;
        moe::unpermute(k, s, y, grouped.then_some(rows), topk, t, top_k, sg, None, h, out)?;
        d.get_bf16(out, t * h)
    }
}

impl Path<'_> {
    /// The per-pair path with the shared expert's pairs after the routed ones (`proj(down, x, y)` launches
    /// both): its output from the shared pairs' rows, onto poison.
    fn run_shared(&self, e: Env, d: &mut Dev, proj: &dyn Fn(bool, u64, u64) -> R<()>) -> R<Vec<f32>> {
        let Env { k, s, .. } = e;
        let Path { xp, topk, sg, t, top_k, h, i, .. } = *self;
        let (pairs, rows) = (t * top_k, t * top_k + t);
        let (g, a, y) = (d.poison(4 * rows * i)?, d.poison(2 * rows * i)?, d.poison(2 * rows * h)?);
        let out = d.poison(2 * t * h)?;
        proj(false, xp, g)?;
        elementwise::swiglu(k, s, g, 2 * i, g + (2 * i) as u64, 2 * i, a, rows, i)?;
        proj(true, a, y)?;
        let shared_rows = y + (2 * pairs * h) as u64;
        moe::unpermute(k, s, y, None, topk, t, top_k, sg, Some(shared_rows), h, out)?;
        d.get_bf16(out, t * h)
    }
}

/// The shared expert `w` (an expert's layout) quantised to int4 as the experts of [`w4_experts`] are:
/// its dequantised weights (per row: the same whether gate and up are one linear or two), its gate/up as
/// one stacked linear, its gate and up as two, and its down.
fn w4_shared(
    d: &mut Dev,
    w: &[f32],
    h: usize,
    i: usize,
    asym: bool,
) -> R<(Vec<f32>, W4Weights, W4Weights, W4Weights, W4Weights)> {
    let (deq, gu, dn) = w4_experts(d, w, 1, h, i, asym)?;
    let (gate, _) = place_w4(d, &w[..i * h], i, h, asym)?;
    let (up, _) = place_w4(d, &w[i * h..2 * i * h], i, h, asym)?;
    Ok((deq, gu.first, gate, up, dn.first))
}

/// `[out, inp]` weights quantised to int4 (`asym`: zero points and bf16 scales, else symmetric with fp16
/// scales) and uploaded into a fresh allocation as the backend places one linear: the linear and its
/// dequantised values.
fn place_w4(d: &mut Dev, w: &[f32], out: usize, inp: usize, asym: bool) -> R<(W4Weights, Vec<f32>)> {
    let base = d.alloc(W4Bytes::new(out, inp, asym, false).aligned())?;
    place_w4_at(d, w, out, inp, asym, base)
}

/// [`place_w4`] at `base` (256-byte aligned, room for the linear).
fn place_w4_at(d: &mut Dev, w: &[f32], out: usize, inp: usize, asym: bool, base: u64) -> R<(W4Weights, Vec<f32>)> {
    let l = W4Linear::quantize(w, out, inp, asym)?;
    let l = if asym {
        let scales = l.scales.iter().map(|&b| bf16::from_f32(half::f16::from_bits(b).to_f32()).to_bits()).collect();
        W4Linear { scales, scale_dtype: ScaleDtype::Bf16, ..l }
    } else {
        l
    };
    let sd = if asym { ScaleDtype::Bf16 } else { ScaleDtype::F16 };
    let p = W4Weights::at(base, out, inp, asym, false, sd);
    d.rt.upload(p.qweight, &l.qweight)?;
    d.rt.upload(p.scales, &l.scales)?;
    if let (Some(zp), Some(z)) = (p.zeros, &l.zeros) {
        d.rt.upload(zp, z)?;
    }
    Ok((p, l.dequantize()))
}

/// The experts of `w` (the bf16 block's layout) quantised to int4 and placed as the backend places
/// them (per expert its `[2i, h]` gate/up then its `[h, i]` down linear, each 256-byte aligned, every
/// expert alike): the dequantised block (the reference's weights) and the two projections. `asym`:
/// zero points and bf16 scales; else symmetric with fp16 scales.
fn w4_experts(
    d: &mut Dev,
    w: &[f32],
    ne: usize,
    h: usize,
    i: usize,
    asym: bool,
) -> R<(Vec<f32>, W4Experts, W4Experts)> {
    let al = |b: W4Bytes| b.aligned();
    let (gu_bytes, dn_bytes) = (al(W4Bytes::new(2 * i, h, asym, false)), al(W4Bytes::new(h, i, asym, false)));
    let stride = gu_bytes + dn_bytes;
    let base = d.alloc(ne * stride)?;
    let mut deq = Vec::with_capacity(w.len());
    let mut first = None;
    for e in 0..ne {
        let blk = &w[e * 3 * i * h..(e + 1) * 3 * i * h];
        let at = base + (e * stride) as u64;
        let (g, gq) = place_w4_at(d, &blk[..2 * i * h], 2 * i, h, asym, at)?;
        let (dn, dq) = place_w4_at(d, &blk[2 * i * h..], h, i, asym, at + gu_bytes as u64)?;
        deq.extend(gq);
        deq.extend(dq);
        first.get_or_insert((g, dn));
    }
    let (g, dn) = first.expect("at least one expert");
    let ex = |f| W4Experts { first: f, stride: stride as u64, count: ne };
    Ok((deq, ex(g), ex(dn)))
}
