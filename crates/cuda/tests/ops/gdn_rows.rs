//! A speculative step's DeltaNet rows in one launch per layer (`gdn_rows`) bit for bit against the
//! kernels it replaces: the verify against gdn_conv_gate_rows + gdn_recurrent_gated, the commit
//! against gdn_conv_gate_rows + gdn_recurrent with write-back + conv_state_update.

use deltaserve_cuda::ops::{conv, gdn_decode, gdn_gate};
use rand::RngExt;
use rand::rngs::StdRng;

use crate::deltanet::gate_args;
use crate::harness::{Dev, Outcome, R, cu_of, randv, same_bits};
use crate::{Env, Op};

/// [`Op::GdnRows`].
pub fn rows(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::GdnRows { ref lens, ref slots, ref accept, hk, hv } = *op else { unreachable!() };
    let (dk, dv, kw) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim, k.dims.conv_kernel);
    let c = (2 * hk + hv) * dk;
    let (b, n, xs) = (lens.iter().sum::<usize>(), lens.len(), c + 8);
    let n_slots = slots.iter().copied().max().unwrap_or(0).max(0) as usize + 1;
    let x = randv(rng, b * xs, 1.0);
    let w = randv(rng, c * kw, 0.6);
    let conv0 = randv(rng, n_slots * (kw - 1) * c, 1.0);
    let rec0 = randv(rng, n_slots * hv * dk * dv, 0.5);
    let ba = randv(rng, b * 2 * hv, 4.0);
    let a_log: Vec<f32> = (0..hv).map(|_| rng.random_range(-2.0..1.5)).collect();
    let dt_bias: Vec<f32> = (0..hv).map(|_| rng.random_range(-1.0..1.0)).collect();
    let z = randv(rng, b * hv * dv, 2.0);
    let nw = randv(rng, dv, 1.0);
    let (xp, wp, bap, alp, dtp) = (d.bf16(&x)?, d.bf16(&w)?, d.bf16(&ba)?, d.f32s(&a_log)?, d.f32s(&dt_bias)?);
    let (zp, nwp, sp, cup) = (d.bf16(&z)?, d.f32s(&nw)?, d.i32s(slots)?, d.i32s(&cu_of(lens))?);
    let acc: Vec<i32> = accept.as_ref().map_or(Vec::new(), |a| a.iter().map(|&v| v as i32).collect());
    let accp = if accept.is_some() { d.i32s(&acc)? } else { 0 };
    let commit = accept.is_some();
    // The verify's trace, written by the fused kernel as it reads the rows (the commit writes none).
    let (trace_x, trace_ba) = if commit { (0, 0) } else { (d.poison(2 * b * xs)?, d.poison(2 * b * 2 * hv)?) };
    let mut got = Vec::new();
    for fused in [false, true] {
        let (conv_st, rec_st) = (d.bf16(&conv0)?, d.state(&rec0, k.dims.state_bf16)?);
        let out = d.poison(2 * b * hv * dv)?;
        if fused {
            let a = gdn_decode::GdnRows {
                x: xp,
                x_stride: xs,
                ba: bap,
                ba_stride: 2 * hv,
                conv_w: wp,
                conv_state: conv_st,
                a_log: alp,
                dt_bias: dtp,
                state: rec_st,
                slots: sp,
                starts: cup,
                lens: accp,
                z: zp,
                z_tok_stride: hv * dv,
                norm_w: nwp,
                out,
                trace_x,
                trace_ba,
                eps: 1e-6,
                n_seqs: n,
                hk,
                hv,
                commit,
            };
            gdn_decode::gdn_rows(k, s, &a)?;
        } else {
            let y = d.poison(2 * b * c)?;
            let (qo, ko, go, bo) =
                (d.poison(2 * b * hk * dk)?, d.poison(2 * b * hk * dk)?, d.poison(4 * b * hv)?, d.poison(4 * b * hv)?);
            let gate = gate_args(y, c, bap, alp, dtp, [qo, ko, go, bo], b, hk, hv);
            let cp = conv::ConvPrefill {
                x: xp,
                x_stride: xs,
                w: wp,
                y,
                state: conv_st,
                cu_seqlens: cup,
                slots: sp,
                n_seqs: n,
                t: b,
                channels: c,
            };
            gdn_gate::gdn_conv_gate_rows(k, s, &gdn_gate::GdnConvGateRows::of_conv(&cp, gate))?;
            let dec = gdn_decode::GdnDecode {
                q: qo,
                k: ko,
                v: y + (4 * hk * dk) as u64,
                v_stride: c,
                g: go,
                beta: bo,
                state: rec_st,
                slots: sp,
                o: d.poison(2 * b * hv * dv)?,
                n_seqs: n,
                hk,
                hv,
            };
            if commit {
                let r = gdn_decode::GdnRecurrent { d: dec, starts: cup, lens: accp, write_state: true };
                gdn_decode::gdn_recurrent(k, s, &r)?;
                conv::conv_state_update(k, s, &cp, n, accp)?;
            } else {
                let a = gdn_decode::GdnRecurrentGated {
                    d: dec,
                    starts: cup,
                    z: zp,
                    z_tok_stride: hv * dv,
                    norm_w: nwp,
                    out,
                    eps: 1e-6,
                };
                gdn_decode::gdn_recurrent_gated(k, s, &a)?;
            }
        }
        let mut ob = vec![0u16; if commit { 0 } else { b * hv * dv }];
        d.rt.download(&mut ob, out)?;
        let rb = d.state_words(rec_st, rec0.len(), k.dims.state_bf16)?;
        let mut cb = vec![0u16; conv0.len()];
        d.rt.download(&mut cb, conv_st)?;
        got.push([ob, rb, cb]);
    }
    let what = if commit { "the commit's kernels" } else { "the verify's kernels" };
    let mut v: Vec<Outcome> = ["recurrent state", "conv state"]
        .iter()
        .enumerate()
        .map(|(i, name)| same_bits(&format!("{name} vs {what}"), &got[0][i + 1], &got[1][i + 1]))
        .collect();
    if !commit {
        v.push(same_bits(&format!("out vs {what}"), &got[0][0], &got[1][0]));
        // The trace holds the rows of the sequences with a slot, x's channels and both of ba's halves, as stored.
        let (mut tx, mut tb) = (vec![0u16; b * xs], vec![0u16; b * 2 * hv]);
        d.rt.download(&mut tx, trace_x)?;
        d.rt.download(&mut tb, trace_ba)?;
        let (xb, bab) = (bf16_bits(&x), bf16_bits(&ba));
        let cu = cu_of(lens);
        let rows: Vec<usize> =
            (0..n).filter(|&i| slots[i] >= 0).flat_map(|i| cu[i] as usize..cu[i + 1] as usize).collect();
        let pick = |v: &[u16], stride: usize, width: usize| -> Vec<u16> {
            rows.iter().flat_map(|&r| v[r * stride..r * stride + width].to_vec()).collect()
        };
        v.push(same_bits("the trace's x rows vs x", &pick(&xb, xs, c), &pick(&tx, xs, c)));
        v.push(same_bits("the trace's ba rows vs ba", &pick(&bab, 2 * hv, 2 * hv), &pick(&tb, 2 * hv, 2 * hv)));
    }
    Ok(v)
}

/// bf16 bits of `v` as [`Dev::bf16`] stores them (round to nearest even).
fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&f| half::bf16::from_f32(f).to_bits()).collect()
}

/// [`Op::GdnCommitLayers`]: every layer's states after one `gdn_commit_layers` call, bit for bit as
/// after that layer's own `gdn_rows` commit. The layers' trace rows share one buffer at a layer stride,
/// as the speculative trace's do; more layers than a launch's table take several launches.
pub fn commit_layers(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::GdnCommitLayers { ref lens, ref slots, ref accept, hk, hv, layers } = *op else { unreachable!() };
    let (dk, dv, kw) = (k.dims.gdn_k_dim, k.dims.gdn_v_dim, k.dims.conv_kernel);
    let c = (2 * hk + hv) * dk;
    let (b, n, xs) = (lens.iter().sum::<usize>(), lens.len(), c + 8);
    let n_slots = slots.iter().copied().max().unwrap_or(0).max(0) as usize + 1;
    // The layers' trace blocks: rows b .. b + 2 of each block are padding no commit reads.
    let (x_layer, ba_layer) = ((b + 2) * xs, (b + 2) * 2 * hv);
    let x = randv(rng, layers * x_layer, 1.0);
    let ba = randv(rng, layers * ba_layer, 4.0);
    let (xp, bap) = (d.bf16(&x)?, d.bf16(&ba)?);
    let (sp, cup) = (d.i32s(slots)?, d.i32s(&cu_of(lens))?);
    let accp = d.i32s(&accept.iter().map(|&v| v as i32).collect::<Vec<_>>())?;
    let (mut ptrs, mut inits) = (Vec::new(), Vec::new());
    for _ in 0..layers {
        let w = d.bf16(&randv(rng, c * kw, 0.6))?;
        let a_log: Vec<f32> = (0..hv).map(|_| rng.random_range(-2.0..1.5)).collect();
        let dt_bias: Vec<f32> = (0..hv).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (conv0, rec0) = (randv(rng, n_slots * (kw - 1) * c, 1.0), randv(rng, n_slots * hv * dk * dv, 0.5));
        let l = gdn_decode::GdnLayerPtrs {
            conv_w: w,
            a_log: d.f32s(&a_log)?,
            dt_bias: d.f32s(&dt_bias)?,
            ..Default::default()
        };
        ptrs.push(l);
        inits.push((conv0, rec0));
    }
    let bf16_state = k.dims.state_bf16;
    let states = |d: &mut Dev, ptrs: &mut [gdn_decode::GdnLayerPtrs]| -> R<()> {
        for (l, (conv0, rec0)) in ptrs.iter_mut().zip(&inits) {
            (l.conv_state, l.state) = (d.bf16(conv0)?, d.state(rec0, bf16_state)?);
        }
        Ok(())
    };
    let mut got = Vec::new();
    for together in [false, true] {
        states(d, &mut ptrs)?;
        if together {
            let a = gdn_decode::GdnCommitLayers {
                layers: &ptrs,
                x: xp,
                x_layer,
                x_stride: xs,
                ba: bap,
                ba_layer,
                ba_stride: 2 * hv,
                slots: sp,
                starts: cup,
                lens: accp,
                n_seqs: n,
                hk,
                hv,
            };
            gdn_decode::gdn_commit_layers(k, s, &a)?;
        } else {
            for (li, l) in ptrs.iter().enumerate() {
                let a = gdn_decode::GdnRows {
                    x: xp + (2 * li * x_layer) as u64,
                    x_stride: xs,
                    ba: bap + (2 * li * ba_layer) as u64,
                    ba_stride: 2 * hv,
                    conv_w: l.conv_w,
                    conv_state: l.conv_state,
                    a_log: l.a_log,
                    dt_bias: l.dt_bias,
                    state: l.state,
                    slots: sp,
                    starts: cup,
                    lens: accp,
                    z: 0,
                    z_tok_stride: 0,
                    norm_w: 0,
                    out: 0,
                    trace_x: 0,
                    trace_ba: 0,
                    eps: 1e-6,
                    n_seqs: n,
                    hk,
                    hv,
                    commit: true,
                };
                gdn_decode::gdn_rows(k, s, &a)?;
            }
        }
        let (mut rb, mut cb) = (Vec::new(), Vec::new());
        for (l, (conv0, rec0)) in ptrs.iter().zip(&inits) {
            let r = d.state_words(l.state, rec0.len(), k.dims.state_bf16)?;
            let mut cv = vec![0u16; conv0.len()];
            d.rt.download(&mut cv, l.conv_state)?;
            rb.extend(r);
            cb.extend(cv);
        }
        got.push([rb, cb]);
    }
    Ok(vec![
        same_bits(&format!("recurrent states of {layers} layers vs gdn_rows per layer"), &got[0][0], &got[1][0]),
        same_bits(&format!("conv states of {layers} layers vs gdn_rows per layer"), &got[0][1], &got[1][1]),
    ])
}
