//! The gated DeltaNet mixer of a layer: its in-projections, the short conv (prefill rows, fused decode
//! rows), the gates, the chunked / recurrent core (verify rows leave the state as it was), the gated
//! norm and the out projection.

use crate::error::CudaError;
use crate::ops::w4a16::Fold;
use crate::ops::{conv, gdn_chunk, gdn_decode, gdn_gate, gdn_overlap, norm};

use super::CudaBackend;
use super::cache_ops::Place;
use super::forward::b2;
use super::layout::Ws;
use super::linear::{OutNorm, ProjOut, po};
use super::step::StepShape;
use super::weights::GdnLayer;

/// A DeltaNet layer's state tensors: byte offsets of its recurrent and conv tensors in `state_slots`
/// and in `snapshots`.
#[derive(Clone, Copy, Debug)]
pub(super) struct GdnOffsets {
    pub(super) rec: usize,
    pub(super) conv: usize,
    pub(super) snap_rec: usize,
    pub(super) snap_conv: usize,
}

impl CudaBackend {
    /// A DeltaNet layer's mixer over the step `sh`: its input `x` (the input norm's output, or folded:
    /// [`Fold::Norm`]) into `mixer_out` (or with `out_fold` the post-attention norm too: [`OutNorm`]).
    /// `st`: its state tensors; `gdn_index`: its index among the DeltaNet layers (its verify
    /// trace).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn deltanet(
        &self,
        ws: &Ws,
        gw: &GdnLayer,
        st: GdnOffsets,
        sh: &StepShape,
        gdn_index: Option<usize>,
        (x_in, in_fold): (u64, Fold),
        out_fold: Option<OutNorm>,
    ) -> Result<(), CudaError> {
        let (s, d) = (self.rt.stream().as_ref(), &self.d);
        let StepShape { t, tp, .. } = *sh;
        let h = d.hidden;
        let vw = d.gdn_value_width;
        let rec_state = self.states.ptr + st.rec as u64;
        let conv_state = self.states.ptr + st.conv as u64;
        self.proj_fold(s, x_in, t, h, &self.gdn_in_outs(ws, gw), in_fold)?;
        self.tick("gdn in-proj GEMMs")?;
        let (fused_dec, fused_pre) = self.gdn_conv(ws, gw, (conv_state, st.snap_conv), sh, gdn_index)?;
        let (q, kk) = if fused_pre {
            (ws.gdn_qk, ws.gdn_qk + b2(t * d.gdn_key_width))
        } else {
            self.gdn_gates(gw, ws.gdn_ba, t, if fused_dec { tp } else { t })?
        };
        self.tick("gdn gates + l2norm")?;
        if !self.gdn_core(ws, gw, (rec_state, conv_state, st.snap_rec), sh, (q, kk), gdn_index)? {
            // The gated norm of the other rows (the chunked and verify rows).
            self.gdn_gated_norm(ws, gw, t, tp)?;
        }
        self.mixer_out_proj(s, ws, ws.gdn_normed, t, vw, &gw.out, out_fold)?;
        self.tick("gdn gated norm + out GEMM")?;
        Ok(())
    }

    /// The in-projections, each into its workspace buffer: qkv, z, then b and a.
    pub(super) fn gdn_in_outs<'a>(&self, ws: &Ws, gw: &'a GdnLayer) -> [ProjOut<'a>; 3] {
        let d = &self.d;
        let (cc, vw, hv) = (d.conv_channels, d.gdn_value_width, d.gdn_v_heads);
        [po(&gw.qkv, ws.gdn_qkv, cc), po(&gw.z, ws.gdn_z, vw), po(&gw.ba, ws.gdn_ba, 2 * hv)]
    }

    /// The gated norm of the step's first `tp` rows (the chunked and verify rows) into `gdn_normed`. In a step
    /// of those rows only whose out projection takes FP8 codes ([`Self::fp8_fused_target`]), heads of 128 write
    /// them instead ([`norm::gated_rms_norm_fp8`]) and `gdn_normed` only the rows the GEMV takes.
    fn gdn_gated_norm(&self, ws: &Ws, gw: &GdnLayer, t: usize, tp: usize) -> Result<(), CudaError> {
        let (k, s, d, eps) = (&self.k, self.rt.stream().as_ref(), &self.d, self.eps);
        let (vw, hv, dv) = (d.gdn_value_width, d.gdn_v_heads, d.gdn_v_dim);
        let (o, z, out) = (ws.gdn_core_out, ws.gdn_z, ws.gdn_normed);
        if tp == t
            && norm::gated_rms_norm128_supported(o, z, vw, gw.norm, out, dv)
            && let Some((tq, at)) = self.fp8_fused_target(&gw.out, t, vw, ws.mixer_out, d.hidden)
        {
            norm::gated_rms_norm_fp8(k, s, (o, z, vw, hv), gw.norm, out, t, eps, tq, at)?;
            self.fp8_x_written(out, tq, vw);
            return Ok(());
        }
        norm::gated_rms_norm(k, s, o, z, vw, hv, gw.norm, out, tp, dv, eps)
    }

    /// The conv of the step's rows (prefill rows: conv, the conv state of the snapshots inside them
    /// (`snap_conv`: the layer's conv tensor in `snapshots`) and the state update of the chunked rows;
    /// decode rows: conv and gates in one launch where supported; a step of verify chunks and decode
    /// rows only: the verify rows' conv and gates in one launch too) and the verify trace. Returns
    /// whether the decode rows' gates, and the other rows' gates, were fused into their conv.
    fn gdn_conv(
        &self,
        ws: &Ws,
        gw: &GdnLayer,
        (conv_state, snap_conv): (u64, usize),
        sh: &StepShape,
        gdn_index: Option<usize>,
    ) -> Result<(bool, bool), CudaError> {
        let (k, s, d) = (&self.k, self.rt.stream().as_ref(), &self.d);
        let StepShape { t, n, n_pre, tp, tv, .. } = *sh;
        let n_dec = n - n_pre;
        let n_real = n_pre - sh.n_ver;
        let (cc, kw, hv, hk) = (d.conv_channels, d.gdn_key_width, d.gdn_v_heads, d.gdn_k_heads);
        let fusable = gdn_gate::conv_gate_decode_supported(&k.dims, cc, hk, hv);
        // Verify chunks only (with decode rows or none): their conv and gates in one launch.
        let fused_pre = n_pre > 0 && n_real == 0 && fusable;
        if fused_pre && self.verify_rows_fused(sh) {
            // The verify rows' conv and gates run with their recurrence (gdn_core).
        } else if fused_pre {
            let (q0, k0) = (ws.gdn_qk, ws.gdn_qk + b2(t * kw));
            let f = gdn_gate::GdnConvGateRows {
                x: ws.gdn_qkv,
                x_stride: cc,
                w: gw.conv,
                state: conv_state,
                cu_seqlens: ws.cu_seqlens,
                slots: ws.slots,
                n_seqs: n_pre,
                gate: self.gate_args(gw, ws.gdn_conv_out, ws.gdn_ba, (q0, k0), tp),
            };
            gdn_gate::gdn_conv_gate_rows(k, s, &f)?;
        } else if n_pre > 0 {
            // Verify rows (the last n_ver sequences of the group) read the state, never write it.
            let cp = conv::ConvPrefill {
                x: ws.gdn_qkv,
                x_stride: cc,
                w: gw.conv,
                y: ws.gdn_conv_out,
                state: conv_state,
                cu_seqlens: ws.cu_seqlens,
                slots: ws.slots,
                n_seqs: n_pre,
                t: tp,
                channels: cc,
            };
            conv::conv_prefill_only(k, s, &cp)?;
            self.conv_saves(&cp, snap_conv)?;
            conv::conv_state_update(k, s, &cp, n_real, 0)?;
        }
        // Decode rows: the conv and the gates in one launch (the gates of the other rows below).
        let fused_dec = n_dec > 0 && fusable;
        if fused_dec {
            let (q0, k0) = (ws.gdn_qk, ws.gdn_qk + b2(t * kw));
            let ba_dec = ws.gdn_ba + b2(tp * 2 * hv);
            let f = gdn_gate::GdnConvGateDecode {
                x: ws.gdn_qkv + b2(tp * cc),
                x_stride: cc,
                w: gw.conv,
                state: conv_state,
                slots: ws.slots + 4 * n_pre as u64,
                gate: gdn_gate::GdnGate {
                    qk: ws.gdn_conv_out + b2(tp * cc),
                    qk_stride: cc,
                    b: ba_dec,
                    b_stride: 2 * hv,
                    a: ba_dec + b2(hv),
                    a_stride: 2 * hv,
                    a_log: gw.a_log,
                    dt_bias: gw.dt_bias,
                    q_out: q0 + b2(tp * kw),
                    k_out: k0 + b2(tp * kw),
                    g: ws.gdn_g + (4 * tp * hv) as u64,
                    beta: ws.gdn_beta + (4 * tp * hv) as u64,
                    t: n_dec,
                    hk,
                    hv,
                },
            };
            gdn_gate::gdn_conv_gate_decode(k, s, &f)?;
        } else if n_dec > 0 {
            conv::conv_decode(
                k,
                s,
                ws.gdn_qkv + b2(tp * cc),
                cc,
                gw.conv,
                ws.gdn_conv_out + b2(tp * cc),
                conv_state,
                ws.slots + 4 * n_pre as u64,
                n_dec,
                cc,
            )?;
        }
        if let (true, false, Some(sp), Some(gi)) = (sh.n_ver > 0, self.verify_rows_fused(sh), &self.spec, gdn_index) {
            // The verify trace: this layer's in-projection rows of the verify group (qkv is dead
            // after the conv and ba after the gates: the plan lets later buffers reuse them). Fused
            // verify rows write it from the kernel that reads them (gdn_core).
            let r0 = tp - tv;
            let x_at = sp.trace_x + b2(gi * sp.rows * cc);
            let ba_at = sp.trace_ba + b2(gi * sp.rows * 2 * hv);
            self.copy(Place::Dev(x_at), Place::Dev(ws.gdn_qkv + b2(r0 * cc)), 2 * tv * cc)?;
            self.copy(Place::Dev(ba_at), Place::Dev(ws.gdn_ba + b2(r0 * 2 * hv)), 2 * tv * 2 * hv)?;
        }
        self.tick("gdn conv")?;
        Ok((fused_dec, fused_pre && (n_dec == 0 || fused_dec)))
    }

    /// The DeltaNet core: chunked rows (cut at the snapshots inside them: `snap_rec`, the layer's
    /// recurrent tensor in `snapshots`), verify rows (outputs from the committed state, which stays as
    /// it was) and decode rows (recurrence and gated norm in one launch). Returns whether the rows
    /// before the decode rows were gated-normed too (a step of verify chunks and decode rows only: the
    /// verify rows' recurrence and gated norm in one launch).
    fn gdn_core(
        &self,
        ws: &Ws,
        gw: &GdnLayer,
        (rec_state, conv_state, snap_rec): (u64, u64, usize),
        sh: &StepShape,
        (q, kk): (u64, u64),
        gdn_index: Option<usize>,
    ) -> Result<bool, CudaError> {
        let (k, s, d) = (&self.k, self.rt.stream().as_ref(), &self.d);
        let StepShape { n, n_pre, tp, tv, .. } = *sh;
        let n_dec = n - n_pre;
        let n_real = n_pre - sh.n_ver;
        let eps = self.eps;
        let (cc, vw, kw, hv, hk) = (d.conv_channels, d.gdn_value_width, d.gdn_key_width, d.gdn_v_heads, d.gdn_k_heads);
        let v = ws.gdn_conv_out + b2(2 * kw);
        if n_real > 0 {
            self.gdn_chunk_saving(
                &gdn_chunk::GdnChunk {
                    q,
                    k: kk,
                    v,
                    v_stride: cc,
                    g: ws.gdn_g,
                    beta: ws.gdn_beta,
                    state: rec_state,
                    cu_seqlens: ws.cu_seqlens,
                    slots: ws.slots,
                    chunk_table: ws.chunk_table.ptr,
                    n_chunks: sh.n_chunks,
                    o: ws.gdn_core_out,
                    workspace: ws.gdn_ws.ptr,
                    workspace_bytes: ws.gdn_ws.bytes,
                    n_seqs: n_real,
                    t: tp - tv,
                    hk,
                    hv,
                },
                snap_rec,
            )?;
        }
        if sh.n_ver > 0 {
            // Verify rows: outputs from the committed state, which stays as it was.
            let dec = gdn_decode::GdnDecode {
                q,
                k: kk,
                v,
                v_stride: cc,
                g: ws.gdn_g,
                beta: ws.gdn_beta,
                state: rec_state,
                slots: ws.slots + 4 * n_real as u64,
                o: ws.gdn_core_out,
                n_seqs: sh.n_ver,
                hk,
                hv,
            };
            let starts = ws.cu_seqlens + 4 * n_real as u64;
            if self.verify_rows_fused(sh) {
                // The verify trace (this layer's rows of x and ba, replayed by the commit), written as read.
                let (trace_x, trace_ba) = match (&self.spec, gdn_index) {
                    (Some(sp), Some(gi)) => {
                        (sp.trace_x + b2(gi * sp.rows * cc), sp.trace_ba + b2(gi * sp.rows * 2 * hv))
                    }
                    _ => (0, 0),
                };
                let rows = gdn_decode::GdnRows {
                    x: ws.gdn_qkv,
                    x_stride: cc,
                    ba: ws.gdn_ba,
                    ba_stride: 2 * hv,
                    conv_w: gw.conv,
                    conv_state,
                    a_log: gw.a_log,
                    dt_bias: gw.dt_bias,
                    state: rec_state,
                    slots: ws.slots,
                    starts,
                    lens: 0,
                    z: ws.gdn_z,
                    z_tok_stride: vw,
                    norm_w: gw.norm,
                    out: ws.gdn_normed,
                    trace_x,
                    trace_ba,
                    eps,
                    n_seqs: sh.n_ver,
                    hk,
                    hv,
                    commit: false,
                };
                gdn_decode::gdn_rows(k, s, &rows)?;
            } else if n_real == 0 {
                let gated = gdn_decode::GdnRecurrentGated {
                    d: dec,
                    starts,
                    z: ws.gdn_z,
                    z_tok_stride: vw,
                    norm_w: gw.norm,
                    out: ws.gdn_normed,
                    eps,
                };
                gdn_decode::gdn_recurrent_gated(k, s, &gated)?;
            } else {
                let r = gdn_decode::GdnRecurrent { d: dec, starts, lens: 0, write_state: false };
                gdn_decode::gdn_recurrent(k, s, &r)?;
            }
        }
        if n_dec > 0 {
            let dec = gdn_decode::GdnDecode {
                q: q + b2(tp * kw),
                k: kk + b2(tp * kw),
                v: v + b2(tp * cc),
                v_stride: cc,
                g: ws.gdn_g + (4 * tp * hv) as u64,
                beta: ws.gdn_beta + (4 * tp * hv) as u64,
                state: rec_state,
                slots: ws.slots + 4 * n_pre as u64,
                o: ws.gdn_core_out + b2(tp * vw),
                n_seqs: n_dec,
                hk,
                hv,
            };
            // Decode rows: the recurrence and the gated norm in one launch.
            let gated = gdn_decode::GdnDecodeGated {
                d: dec,
                z: ws.gdn_z + b2(tp * vw),
                z_tok_stride: vw,
                norm_w: gw.norm,
                out: ws.gdn_normed + b2(tp * vw),
                eps,
            };
            gdn_decode::gdn_decode_gated(k, s, &gated)?;
        }
        self.tick("gdn core (chunked / decode)")?;
        Ok(n_real == 0 && sh.n_ver > 0)
    }

    /// The step's prefill chunks (`cu`, `slots`: the first `n` entries of its varlen arrays) cut into pieces whose
    /// walks run beside the next pieces' prep ([`gdn_overlap::piece_for`]), where the step has no snapshots inside
    /// its chunks (`plain`), the options allow it, the backend has an overlap stream and the rounds' tables fit the
    /// chunk table's scratch.
    pub(super) fn gdn_rounds(&self, plain: bool, cu: &[i32], slots: &[i32]) -> Option<gdn_overlap::Rounds> {
        let rows = *cu.last()? as usize - *cu.first()? as usize;
        let piece = gdn_overlap::piece_for(&self.k, rows, slots.len(), self.d.gdn_v_heads);
        if !plain || !self.opts.deltanet_overlap || self.overlap.is_none() || piece == 0 {
            return None;
        }
        let r = gdn_overlap::Rounds::new(cu, slots, piece);
        (4 * r.image_len() <= self.ws.chunk_table.bytes).then_some(r)
    }

    /// Whether the step's rows before its decode rows are all verify rows and their conv, gates,
    /// recurrence and gated norm run in one launch per layer (`gdn_rows`).
    pub(super) fn verify_rows_fused(&self, sh: &StepShape) -> bool {
        let d = &self.d;
        sh.n_pre > 0
            && sh.n_pre == sh.n_ver
            && gdn_decode::rows_supported(&self.k.dims, d.conv_channels, d.gdn_k_heads, d.gdn_v_heads)
    }

    /// A DeltaNet layer's gates and normalised q, k of the first `rows` of the step's `t` rows: from the
    /// conv output (`gdn_conv_out`) and the in-projection rows `ba` (`[t, 2·Hv]`: b then a); returns the
    /// (q, k) buffers (`[t, Hk, Dk]` each). g and beta land in `gdn_g` / `gdn_beta`.
    pub(super) fn gdn_gates(&self, gw: &GdnLayer, ba: u64, t: usize, rows: usize) -> Result<(u64, u64), CudaError> {
        let ws = &self.ws;
        let (q, kk) = (ws.gdn_qk, ws.gdn_qk + (2 * t * self.d.gdn_key_width) as u64);
        let gate = self.gate_args(gw, ws.gdn_conv_out, ba, (q, kk), rows);
        gdn_gate::gdn_gate(&self.k, self.rt.stream().as_ref(), &gate)?;
        Ok((q, kk))
    }

    /// The gate arguments of `rows` rows of a DeltaNet layer: the conv output at `qk` (`[rows,
    /// channels]`), the in-projection rows `ba` (`[rows, 2·Hv]`: b then a), q and k out at `q_k`, g and
    /// beta in `gdn_g` / `gdn_beta`.
    pub(super) fn gate_args(
        &self,
        gw: &GdnLayer,
        qk: u64,
        ba: u64,
        (q, kk): (u64, u64),
        rows: usize,
    ) -> gdn_gate::GdnGate {
        let (ws, d) = (&self.ws, &self.d);
        let hv = d.gdn_v_heads;
        gdn_gate::GdnGate {
            qk,
            qk_stride: d.conv_channels,
            b: ba,
            b_stride: 2 * hv,
            a: ba + (2 * hv) as u64,
            a_stride: 2 * hv,
            a_log: gw.a_log,
            dt_bias: gw.dt_bias,
            q_out: q,
            k_out: kk,
            g: ws.gdn_g,
            beta: ws.gdn_beta,
            t: rows,
            hk: d.gdn_k_heads,
            hv,
        }
    }
}
