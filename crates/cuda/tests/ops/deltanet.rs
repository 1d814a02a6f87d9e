//! The DeltaNet ops: the gate (q/k normalisation, g and beta), the fused conv + gate of decode, the
//! core recurrence (chunked prefill, decode, speculative verify and commit) and the fused decode +
//! gated norm.

use cudarc::driver::CudaStream;
use deltaserve_cpu as cpu;
use deltaserve_cuda::Kernels;
use deltaserve_cuda::ops::{self, conv, gdn_chunk, gdn_decode, gdn_gate};
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, compare, cu_of, randv, rb, same_bits};
use crate::{Env, Op};

/// Which DeltaNet core kernel [`gdn_case`] runs.
enum GdnMode {
    Chunked(gdn_chunk::Precision),
    /// Chunked, each sequence cut at these rows (its segments walked round by round; the states at
    /// the cuts checked too).
    ChunkedCut(Vec<Vec<usize>>),
    /// One token per sequence.
    Decode,
    /// gdn_recurrent: verify (None) or commit of the first `accept[b]` rows.
    Recurrent(Option<Vec<usize>>),
}

/// [`Op::GdnGate`]: q and k L2-normalised (q scaled), g and beta, against the CPU.
pub fn gate(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let Op::GdnGate { t, hk, hv } = *op else { unreachable!() };
    let dk = k.dims.gdn_k_dim;
    let conv_dim = 2 * hk * dk + hv * k.dims.gdn_v_dim;
    let qkv = randv(rng, t * conv_dim, 1.0);
    let ba = randv(rng, t * 2 * hv, 4.0); // [b | a] per token, like a fused projection
    let a_log: Vec<f32> = (0..hv).map(|_| rng.random_range(-2.0..1.5)).collect();
    let dt_bias: Vec<f32> = (0..hv).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (qp, bap, alp, dtp) = (d.bf16(&qkv)?, d.bf16(&ba)?, d.f32s(&a_log)?, d.f32s(&dt_bias)?);
    let (qo, ko, go, bo) =
        (d.poison(2 * t * hk * dk)?, d.poison(2 * t * hk * dk)?, d.poison(4 * t * hv)?, d.poison(4 * t * hv)?);
    let a = gate_args(qp, conv_dim, bap, alp, dtp, [qo, ko, go, bo], t, hk, hv);
    gdn_gate::gdn_gate(k, s, &a)?;
    let (mut rq, mut rk, mut rg, mut rbeta) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for tt in 0..t {
        let row = &qkv[tt * conv_dim..];
        let mut qq = row[..hk * dk].to_vec();
        let mut kk = row[hk * dk..2 * hk * dk].to_vec();
        cpu::norm::l2_norm(&mut qq, dk, 1e-6);
        cpu::norm::l2_norm(&mut kk, dk, 1e-6);
        rq.extend(qq.iter().map(|v| v / (dk as f32).sqrt()));
        rk.extend(kk);
        for h in 0..hv {
            let (bv, av) = (ba[tt * 2 * hv + h], ba[tt * 2 * hv + hv + h]);
            rbeta.push(cpu::activation::sigmoid(bv));
            rg.push(-a_log[h].exp() * cpu::activation::softplus(av + dt_bias[h]));
        }
    }
    Ok(vec![
        compare("q", &rq, &d.get_bf16(qo, rq.len())?, tol),
        compare("k", &rk, &d.get_bf16(ko, rk.len())?, tol),
        compare("g", &rg, &d.get_f32(go, rg.len())?, tol),
        compare("beta", &rbeta, &d.get_f32(bo, rbeta.len())?, tol),
    ])
}

/// [`Op::GdnConvGateDecode`]: the fused conv + gate bit for bit against conv_decode + gdn_gate;
/// [`Op::GdnConvGateRows`]: the fused rows kernel against conv_prefill + gdn_gate (the state untouched).
pub fn conv_gate_decode(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let (lens, slots, hk, hv, rows) = match op {
        Op::GdnConvGateDecode { slots, hk, hv } => (vec![1; slots.len()], slots.clone(), *hk, *hv, false),
        Op::GdnConvGateRows { lens, slots, hk, hv } => (lens.clone(), slots.clone(), *hk, *hv, true),
        _ => unreachable!(),
    };
    let (dk, kw) = (k.dims.gdn_k_dim, k.dims.conv_kernel);
    let c = (2 * hk + hv) * dk;
    let (b, xs) = (lens.iter().sum::<usize>(), c + 8);
    let n_slots = 4;
    let x = randv(rng, b * xs, 1.0);
    let w = randv(rng, c * kw, 0.6);
    let st0 = randv(rng, n_slots * (kw - 1) * c, 1.0);
    let ba = randv(rng, b * 2 * hv, 4.0);
    let a_log: Vec<f32> = (0..hv).map(|_| rng.random_range(-2.0..1.5)).collect();
    let dt_bias: Vec<f32> = (0..hv).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (xp, wp, bap, alp, dtp, sp) =
        (d.bf16(&x)?, d.bf16(&w)?, d.bf16(&ba)?, d.f32s(&a_log)?, d.f32s(&dt_bias)?, d.i32s(&slots)?);
    let cup = d.i32s(&cu_of(&lens))?;
    // Path A: the separate kernels; path B: the fused one; each with its own state copy.
    let mut outs = Vec::new();
    for fused in [false, true] {
        let st = d.bf16(&st0)?;
        let y = d.poison(2 * b * c)?;
        let (qo, ko, go, bo) =
            (d.poison(2 * b * hk * dk)?, d.poison(2 * b * hk * dk)?, d.poison(4 * b * hv)?, d.poison(4 * b * hv)?);
        let gate = gate_args(y, c, bap, alp, dtp, [qo, ko, go, bo], b, hk, hv);
        let cp = conv::ConvPrefill {
            x: xp,
            x_stride: xs,
            w: wp,
            y,
            state: st,
            cu_seqlens: cup,
            slots: sp,
            n_seqs: lens.len(),
            t: b,
            channels: c,
        };
        match (rows, fused) {
            (false, true) => {
                let f = gdn_gate::GdnConvGateDecode { x: xp, x_stride: xs, w: wp, state: st, slots: sp, gate };
                gdn_gate::gdn_conv_gate_decode(k, s, &f)?;
            }
            (false, false) => conv::conv_decode(k, s, xp, xs, wp, y, st, sp, b, c)?,
            (true, true) => gdn_gate::gdn_conv_gate_rows(k, s, &gdn_gate::GdnConvGateRows::of_conv(&cp, gate))?,
            (true, false) => conv::conv_prefill_only(k, s, &cp)?,
        }
        if !fused {
            gdn_gate::gdn_gate(k, s, &gate)?;
        }
        let bits16 = |p: u64, n: usize| -> R<Vec<u16>> {
            let mut v = vec![0u16; n];
            d.rt.download(&mut v, p)?;
            Ok(v)
        };
        let bits32 = |p: u64, n: usize| -> R<Vec<u16>> {
            let mut v = vec![0u16; 2 * n];
            d.rt.download(&mut v, p)?;
            Ok(v)
        };
        outs.push([
            bits16(y, b * c)?,
            bits16(st, st0.len())?,
            bits16(qo, b * hk * dk)?,
            bits16(ko, b * hk * dk)?,
            bits32(go, b * hv)?,
            bits32(bo, b * hv)?,
        ]);
    }
    let unfused = if rows { "conv_prefill + gdn_gate" } else { "conv_decode + gdn_gate" };
    Ok(["y", "conv state", "q", "k", "g", "beta"]
        .iter()
        .enumerate()
        .map(|(i, what)| same_bits(&format!("{what} vs {unfused}"), &outs[0][i], &outs[1][i]))
        .collect())
}

/// [`Op::GdnDecodeGated`]: the fused decode + gated norm bit for bit against gdn_decode +
/// gated_rms_norm; [`Op::GdnRecurrentGated`]: the fused verify rows against gdn_recurrent (no
/// write-back) + gated_rms_norm, the state untouched.
pub fn decode_gated(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let (lens, slots, hk, hv, rows) = match op {
        Op::GdnDecodeGated { slots, hk, hv } => (vec![1; slots.len()], slots.clone(), *hk, *hv, false),
        Op::GdnRecurrentGated { lens, slots, hk, hv } => (lens.clone(), slots.clone(), *hk, *hv, true),
        _ => unreachable!(),
    };
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let (b, n) = (lens.iter().sum::<usize>(), lens.len());
    let n_slots = slots.iter().copied().max().unwrap_or(0).max(0) as usize + 1;
    let (vs, zs) = (hv * dv + 8, hv * dv);
    let qv = randv(rng, b * hk * dk, 0.3);
    let kv = randv(rng, b * hk * dk, 0.3);
    let v = randv(rng, b * vs, 1.0);
    let g: Vec<f32> = (0..b * hv).map(|_| -rng.random_range(0.0..1.0f32)).collect();
    let beta: Vec<f32> = (0..b * hv).map(|_| rng.random_range(0.0..1.0f32)).collect();
    let st0 = randv(rng, n_slots * hv * dk * dv, 0.5);
    let z = randv(rng, b * zs, 2.0);
    let nw = randv(rng, dv, 1.0);
    let (qp, kp, vp, gp, bp) = (d.bf16(&qv)?, d.bf16(&kv)?, d.bf16(&v)?, d.f32s(&g)?, d.f32s(&beta)?);
    let (zp, nwp, sp, cup) = (d.bf16(&z)?, d.f32s(&nw)?, d.i32s(&slots)?, d.i32s(&cu_of(&lens))?);
    let mut got = Vec::new();
    for fused in [false, true] {
        let st = d.state(&st0, k.dims.state_bf16)?;
        let (o, out) = (d.poison(2 * b * hv * dv)?, d.poison(2 * b * hv * dv)?);
        let dec = gdn_decode::GdnDecode {
            q: qp,
            k: kp,
            v: vp,
            v_stride: vs,
            g: gp,
            beta: bp,
            state: st,
            slots: sp,
            o,
            n_seqs: n,
            hk,
            hv,
        };
        match (rows, fused) {
            (false, true) => {
                let a = gdn_decode::GdnDecodeGated { d: dec, z: zp, z_tok_stride: zs, norm_w: nwp, out, eps: 1e-6 };
                gdn_decode::gdn_decode_gated(k, s, &a)?;
            }
            (true, true) => {
                let a = gdn_decode::GdnRecurrentGated {
                    d: dec,
                    starts: cup,
                    z: zp,
                    z_tok_stride: zs,
                    norm_w: nwp,
                    out,
                    eps: 1e-6,
                };
                gdn_decode::gdn_recurrent_gated(k, s, &a)?;
            }
            (false, false) => gdn_decode::gdn_decode(k, s, &dec)?,
            (true, false) => {
                let r = gdn_decode::GdnRecurrent { d: dec, starts: cup, lens: 0, write_state: false };
                gdn_decode::gdn_recurrent(k, s, &r)?;
            }
        }
        if !fused {
            ops::norm::gated_rms_norm(k, s, o, zp, zs, hv, nwp, out, b, dv, 1e-6)?;
        }
        let mut ob = vec![0u16; b * hv * dv];
        d.rt.download(&mut ob, out)?;
        got.push((ob, d.state_words(st, st0.len(), k.dims.state_bf16)?));
    }
    let unfused = if rows { "gdn_recurrent" } else { "gdn_decode" };
    Ok(vec![
        same_bits(&format!("out vs {unfused} + gated_rms_norm"), &got[0].0, &got[1].0),
        same_bits(&format!("state vs {unfused}"), &got[0].1, &got[1].1),
    ])
}

/// [`Op::GdnChunk`]: the chunked prefill kernel at its precision.
pub fn chunk(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Op::GdnChunk { ref lens, hk, hv, prec, ref cuts } = *op else { unreachable!() };
    let mode = match cuts.is_empty() {
        true => GdnMode::Chunked(prec),
        false => GdnMode::ChunkedCut(cuts.clone()),
    };
    gdn_case(e, d, rng, lens, hk, hv, mode)
}

/// [`Op::GdnDecode`]: one token per sequence.
pub fn decode(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Op::GdnDecode { b, hk, hv } = *op else { unreachable!() };
    gdn_case(e, d, rng, &vec![1; b], hk, hv, GdnMode::Decode)
}

/// [`Op::GdnRecurrent`]: the speculative verify or commit.
pub fn recurrent(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Op::GdnRecurrent { ref lens, ref accept, hk, hv } = *op else { unreachable!() };
    gdn_case(e, d, rng, lens, hk, hv, GdnMode::Recurrent(accept.clone()))
}

/// DeltaNet core: random normalised q/k (as gdn_gate writes them), v, g, beta and a random
/// carried state in shuffled slots; the `mode`'s kernel vs cpu::gdn::gdn_recurrent.
fn gdn_case(
    e: Env,
    d: &mut Dev,
    rng: &mut StdRng,
    lens: &[usize],
    hk: usize,
    hv: usize,
    mode: GdnMode,
) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let t: usize = lens.iter().sum();
    let nb = lens.len();
    let mut q = randv(rng, t * hk * dk, 1.0);
    let mut kk = randv(rng, t * hk * dk, 1.0);
    cpu::norm::l2_norm(&mut q, dk, 1e-6);
    cpu::norm::l2_norm(&mut kk, dk, 1e-6);
    let q: Vec<f32> = q.iter().map(|v| rb(v / (dk as f32).sqrt())).collect();
    let kk: Vec<f32> = kk.iter().map(|&v| rb(v)).collect();
    // v lives inside a wider conv-output row, like the real layout.
    let v_stride = hv * dv + 64;
    let vrow = randv(rng, t * v_stride, 1.0);
    let g: Vec<f32> = (0..t * hv).map(|_| -rng.random_range(0.0f32..1.5).powi(2)).collect();
    let beta: Vec<f32> = (0..t * hv).map(|_| rng.random_range(0.05..0.95)).collect();
    let n_state = hv * dk * dv;
    // A bf16 state slot holds bf16 values: the reference starts from the same ones.
    let bf16_state = k.dims.state_bf16;
    let st0: Vec<f32> = (0..nb * n_state)
        .map(|_| rng.random_range(-0.5..0.5))
        .map(|x: f32| if bf16_state { rb(x) } else { x })
        .collect();
    let n_slots = nb + 2;
    // A permutation of 1..=nb (slot 0 and nb+1 unused), reversed against the batch order.
    let slots: Vec<i32> = (0..nb).map(|b| (nb - b) as i32).collect();
    let mut st_dev = vec![0f32; n_slots * n_state];
    for (b, &sl) in slots.iter().enumerate() {
        st_dev[sl as usize * n_state..][..n_state].copy_from_slice(&st0[b * n_state..][..n_state]);
    }
    let cu = cu_of(lens);
    let (qp, kp, vp, gp, bp) = (d.bf16(&q)?, d.bf16(&kk)?, d.bf16(&vrow)?, d.f32s(&g)?, d.f32s(&beta)?);
    let (sp, cup, slp, op) = (d.state(&st_dev, bf16_state)?, d.i32s(&cu)?, d.i32s(&slots)?, d.poison(2 * t * hv * dv)?);
    let dec = gdn_decode::GdnDecode {
        q: qp,
        k: kp,
        v: vp,
        v_stride,
        g: gp,
        beta: bp,
        state: sp,
        slots: slp,
        o: op,
        n_seqs: nb,
        hk,
        hv,
    };
    let mut extra = Vec::new();
    // Rows of each sequence the state advances by (and whose outputs are compared).
    let used: Vec<usize> = match &mode {
        GdnMode::Recurrent(Some(a)) => a.clone(),
        _ => lens.to_vec(),
    };
    // (the states at the cuts: sequence, rows, state)
    let mut at_cuts: Vec<(usize, usize, Vec<f32>)> = Vec::new();
    let chunked = match &mode {
        GdnMode::Chunked(prec) => Some((*prec, None)),
        GdnMode::ChunkedCut(cuts) => {
            Some((gdn_chunk::Precision::Split, Some(gdn_chunk::Segments::new(&cu, &slots, cuts))))
        }
        _ => None,
    };
    let is_chunked = chunked.is_some();
    if let Some((prec, segments)) = chunked {
        let table = gdn_chunk::chunk_table(segments.as_ref().map_or(&cu, |s| &s.cu));
        let ws_bytes = gdn_chunk::workspace_bytes(t, hv, &k.dims);
        let (tp, wsp) = (d.i32s(&table)?, d.poison(ws_bytes)?);
        let a = gdn_chunk::GdnChunk {
            q: qp,
            k: kp,
            v: vp,
            v_stride,
            g: gp,
            beta: bp,
            state: sp,
            cu_seqlens: cup,
            slots: slp,
            chunk_table: tp,
            n_chunks: table.len() / 2,
            o: op,
            workspace: wsp,
            workspace_bytes: ws_bytes,
            n_seqs: nb,
            t,
            hk,
            hv,
        };
        if let (Some(seg), GdnMode::ChunkedCut(cuts)) = (&segments, &mode) {
            let (n_segs, rounds) = (seg.n_segs(), seg.rounds());
            let on_dev =
                gdn_chunk::SegmentsOnDevice { cu: d.i32s(&seg.cu)?, slots: d.i32s(&seg.slots)?, n_segs, rounds };
            let dev = &*d;
            gdn_chunk::gdn_chunk_segments(k, s, &a, on_dev, |r| {
                let now = dev.get_state(sp, st_dev.len(), bf16_state)?;
                for (b, c) in cuts.iter().enumerate() {
                    if let Some(&row) = c.get(r) {
                        at_cuts.push((b, row, now[slots[b] as usize * n_state..][..n_state].to_vec()));
                    }
                }
                Ok(())
            })?;
        } else {
            gdn_chunk::gdn_chunk_with(k, s, &a, prec)?;
            if prec == gdn_chunk::Precision::Split && k.gdn_walk == gdn_chunk::Walk::OutputWarps {
                extra.extend(walks_agree(k, s, d, a, &st_dev, bf16_state)?);
            }
            if prec == gdn_chunk::Precision::Split && k.gdn_overlap {
                extra.extend(pieces_agree(k, s, d, a, (&cu, &slots), &st_dev)?);
            }
        }
    } else if let GdnMode::Recurrent(accept) = &mode {
        // A verify takes its rows from cu_seqlens (lens 0), a commit from starts + lens.
        let lens_i: Vec<i32> = used.iter().map(|&x| x as i32).collect();
        let r = gdn_decode::GdnRecurrent {
            d: dec,
            starts: d.i32s(&cu)?,
            lens: if accept.is_some() { d.i32s(&lens_i)? } else { 0 },
            write_state: accept.is_some(),
        };
        gdn_decode::gdn_recurrent(k, s, &r)?;
        if accept.is_some() {
            // The same rows through gdn_decode, one token per launch, on a copy of the state: the
            // commit must leave exactly (bit for bit) what decoding them one by one leaves.
            let b = decoded_token_by_token(k, s, d, dec, &cu, &used, &st_dev)?;
            let a = d.get_state(sp, st_dev.len(), bf16_state)?;
            if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                extra.push(Outcome::error("commit state differs from gdn_decode token by token".into()));
            }
        } else if d
            .get_state(sp, st_dev.len(), bf16_state)?
            .iter()
            .zip(&st_dev)
            .any(|(x, y)| x.to_bits() != y.to_bits())
        {
            extra.push(Outcome::error("verify (write_state = 0) changed the state".into()));
        }
    } else {
        gdn_decode::gdn_decode(k, s, &dec)?;
    }
    let dims = cpu::gdn::GdnDims { num_k_heads: hk, num_v_heads: hv, head_k_dim: dk, head_v_dim: dv };
    let mut ro = Vec::with_capacity(t * hv * dv);
    let mut rs = st_dev.clone();
    let mut got_o = Vec::with_capacity(t * hv * dv);
    let all_o = d.get_bf16(op, t * hv * dv)?;
    // The CPU recurrence over sequence b's first `len` rows from its carried state: (outputs, state).
    // A bf16 state: the recurrent kernels round it after every token, the chunked walk where it stores
    // (at the end of each segment of a cut sequence: the reference rounds at the same rows).
    let cuts_of = |b: usize| match &mode {
        GdnMode::ChunkedCut(c) if bf16_state => c[b].clone(),
        _ => Vec::new(),
    };
    let reference = |b: usize, len: usize| -> R<(Vec<f32>, Vec<f32>)> {
        let mut st = st0[b * n_state..][..n_state].to_vec();
        let mut o = vec![0f32; len * hv * dv];
        let ends: Vec<usize> = cuts_of(b).into_iter().filter(|&r| r < len).chain([len]).collect();
        let mut from = 0;
        for to in ends {
            let (t0, n) = (cu[b] as usize + from, to - from);
            let vseq: Vec<f32> = (0..n).flat_map(|i| vrow[(t0 + i) * v_stride..][..hv * dv].to_vec()).collect();
            let inp = cpu::gdn::GdnInputs {
                q: &q[t0 * hk * dk..][..n * hk * dk],
                k: &kk[t0 * hk * dk..][..n * hk * dk],
                v: &vseq,
                g: &g[t0 * hv..][..n * hv],
                beta: &beta[t0 * hv..][..n * hv],
            };
            let out = &mut o[from * hv * dv..][..n * hv * dv];
            let r = match (bf16_state, is_chunked) {
                (true, false) => cpu::gdn::gdn_recurrent_bf16_state(dims, &inp, &mut st, out),
                _ => cpu::gdn::gdn_recurrent(dims, &inp, &mut st, out),
            };
            r.map_err(|e| deltaserve_cuda::CudaError::InvalidArgs { kernel: "cpu reference", msg: e.to_string() })?;
            if bf16_state {
                cpu::kvquant::round_bf16_slice(&mut st);
            }
            from = to;
        }
        Ok((o, st))
    };
    for (b, &len) in used.iter().enumerate() {
        let t0 = cu[b] as usize;
        got_o.extend_from_slice(&all_o[t0 * hv * dv..][..len * hv * dv]);
        let (o, st) = reference(b, len)?;
        ro.extend(o);
        // A verify leaves the committed state as it was.
        if !matches!(mode, GdnMode::Recurrent(None)) {
            rs[slots[b] as usize * n_state..][..n_state].copy_from_slice(&st);
        }
    }
    let got_st = d.get_state(sp, rs.len(), bf16_state)?;
    let mut out = vec![compare("o", &ro, &got_o, tol), compare("state", &rs, &got_st, tol)];
    // Each state at a cut against the reference over the sequence's rows up to it.
    let (mut want_cut, mut got_cut) = (Vec::new(), Vec::new());
    for (b, row, got) in at_cuts {
        want_cut.extend(reference(b, row)?.1);
        got_cut.extend(got);
    }
    if !want_cut.is_empty() {
        out.push(compare("states at the cuts", &want_cut, &got_cut, tol));
    }
    out.extend(extra);
    Ok(out)
}

/// Where the warp-specialised walk ran (`a`, done): the one-stream walk over the same inputs from a copy of the
/// carried states `st0` gives the same outputs and states bit for bit.
fn walks_agree(
    k: &Kernels,
    s: &CudaStream,
    d: &mut Dev,
    a: gdn_chunk::GdnChunk,
    st0: &[f32],
    bf16: bool,
) -> R<Vec<Outcome>> {
    let n_o = a.t * a.hv * k.dims.gdn_v_dim;
    // The walk only reads the workspace: the prep of `a`'s run is still there.
    let b = gdn_chunk::GdnChunk { state: d.state(st0, bf16)?, o: d.poison(2 * n_o)?, ..a };
    gdn_chunk::gdn_chunk_state_walk(k, s, &b, gdn_chunk::Precision::Split, gdn_chunk::Walk::OneStream)?;
    runs_agree(d, (&a, &b), (n_o, st0.len()), bf16, "output warps' walk vs one-stream walk")
}

/// Whether two runs' outputs (`n_o` of them) and states (`n_st`) are the same bit for bit.
fn runs_agree(
    d: &mut Dev,
    (a, b): (&gdn_chunk::GdnChunk, &gdn_chunk::GdnChunk),
    (n_o, n_st): (usize, usize),
    bf16: bool,
    what: &str,
) -> R<Vec<Outcome>> {
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let differ = |x: Vec<u32>, y: Vec<u32>| x.iter().zip(&y).filter(|(p, q)| p != q).count();
    let o = differ(bits(d.get_bf16(a.o, n_o)?), bits(d.get_bf16(b.o, n_o)?));
    let st = differ(bits(d.get_state(a.state, n_st, bf16)?), bits(d.get_state(b.state, n_st, bf16)?));
    Ok(vec![Outcome {
        ok: o == 0 && st == 0,
        detail: format!("{what}: {o} of {n_o} o and {st} of {n_st} state values differ"),
    }])
}

/// Where pieces may overlap: the batch of `a` (done; `cu`, `slots` its varlen arrays) cut into pieces of one
/// chunk, each piece's walk beside the next piece's prep (fresh, poisoned workspace), from a copy of the carried
/// states `st0`, gives the same outputs and states bit for bit.
fn pieces_agree(
    k: &Kernels,
    s: &CudaStream,
    d: &mut Dev,
    a: gdn_chunk::GdnChunk,
    (cu, slots): (&[i32], &[i32]),
    st0: &[f32],
) -> R<Vec<Outcome>> {
    use deltaserve_cuda::ops::gdn_overlap::{Overlap, Rounds, gdn_chunk_overlapped};
    let n_o = a.t * a.hv * k.dims.gdn_v_dim;
    let rounds = Rounds::new(cu, slots, gdn_chunk::CHUNK);
    let on_dev = rounds.on_device(d.i32s(&rounds.image())?);
    let b = gdn_chunk::GdnChunk {
        state: d.state(st0, false)?,
        o: d.poison(2 * n_o)?,
        workspace: d.poison(a.workspace_bytes)?,
        ..a
    };
    gdn_chunk_overlapped(k, s, &Overlap::new(s.context())?, &b, &on_dev, gdn_chunk::Precision::Split)?;
    let what = format!("{} rounds of one-chunk pieces, walks beside preps, vs one walk", rounds.rounds.len());
    runs_agree(d, (&a, &b), (n_o, st0.len()), false, &what)
}

/// The state after each sequence's first `used[b]` rows (from row `cu[b]`) went through
/// gdn_decode one token per launch, from a copy of `st_dev`: what a commit must leave, bit for bit.
fn decoded_token_by_token(
    k: &Kernels,
    s: &CudaStream,
    d: &mut Dev,
    dec: gdn_decode::GdnDecode,
    cu: &[i32],
    used: &[usize],
    st_dev: &[f32],
) -> R<Vec<f32>> {
    let (dk, dv) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim);
    let (hk, hv, v_stride) = (dec.hk, dec.hv, dec.v_stride);
    let sp2 = d.state(st_dev, k.dims.state_bf16)?;
    let o2 = d.poison(2 * hv * dv)?;
    for (b, &n) in used.iter().enumerate() {
        for i in 0..n {
            let row = cu[b] as usize + i;
            let one = gdn_decode::GdnDecode {
                q: dec.q + (2 * row * hk * dk) as u64,
                k: dec.k + (2 * row * hk * dk) as u64,
                v: dec.v + (2 * row * v_stride) as u64,
                g: dec.g + (4 * row * hv) as u64,
                beta: dec.beta + (4 * row * hv) as u64,
                state: sp2,
                slots: dec.slots + 4 * b as u64,
                o: o2,
                n_seqs: 1,
                ..dec
            };
            gdn_decode::gdn_decode(k, s, &one)?;
        }
    }
    d.get_state(sp2, st_dev.len(), k.dims.state_bf16)
}

/// one `[t, 2·hv]` bf16 buffer `ba` ([b | a] per row, like the fused projection), outputs
/// `[q, k, g, beta]`.
#[allow(clippy::too_many_arguments)]
pub fn gate_args(
    qk: u64,
    qk_stride: usize,
    ba: u64,
    a_log: u64,
    dt_bias: u64,
    [q_out, k_out, g, beta]: [u64; 4],
    t: usize,
    hk: usize,
    hv: usize,
) -> gdn_gate::GdnGate {
    gdn_gate::GdnGate {
        qk,
        qk_stride,
        b: ba,
        b_stride: 2 * hv,
        a: ba + 2 * hv as u64,
        a_stride: 2 * hv,
        a_log,
        dt_bias,
        q_out,
        k_out,
        g,
        beta,
        t,
        hk,
        hv,
    }
}
