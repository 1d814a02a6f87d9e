//! The forward of a step: the embedding, the decoder layers (input norm, mixer, MLP), the final norm and
//! lm_head, and the MTP head's cache entries.

use cudarc::driver::CudaStream;

use crate::error::CudaError;
use crate::ops::fp8;
use crate::ops::w4a16::Fold;
use crate::ops::{elementwise, embed, mtp, norm};

use super::CudaBackend;
use super::cache_ops::Place;
use super::deltanet::GdnOffsets;
use super::inputs::HOST_EMBED_GPU_ROWS;
use super::layout::{LayerCache, Ws};
use super::linear::{LayerFold, OutNorm, ProjOut, po};
use super::step::StepShape;
use super::weights::{Layer, Mixer, Proj};

impl CudaBackend {
    /// The embedding table kernels gather rows from: on the device, or the pinned host table
    /// (`embed_on_host`; device-mapped, so a kernel reads its rows across the bus: the MTP head's
    /// few rows a draft step, the look-ahead feed's one row a sequence).
    pub(super) fn embed_table(&self) -> u64 {
        self.host_embed.as_ref().map_or(self.w.embed, |he| he.table.ptr() as u64)
    }

    pub(super) fn forward(&self, sh: &StepShape) -> Result<(), CudaError> {
        let (k, s, ws, d) = (&self.k, self.rt.stream().as_ref(), &self.ws, &self.d);
        let t = sh.t;
        let h = d.hidden;
        let eps = self.eps;
        self.tick("step inputs")?;
        // The embedding rows, gathered from the table where kernels read it (with the table on the host, a step
        // of many rows reads them across the bus: the host's copy of every row into the staging before the
        // upload took longer); a shorter step's upload gathered them on the host into `residual`.
        if self.host_embed.is_none() || t >= HOST_EMBED_GPU_ROWS {
            embed::embed_gather(k, s, self.embed_table(), ws.token_ids, ws.residual, t, h)?;
        }
        // Image rows in place of their placeholders' embeddings (the tower runs here for new images).
        self.put_image_rows()?;
        self.tick("embed")?;
        self.all_reduce(ws.residual, t * h)?;
        let mut gdn_index = 0;
        let fold = self.folds(t);
        let in_reduce = !fold && self.norms_in_reduce(t);
        let layers = &self.w.layers;
        for (li, layer) in layers.iter().enumerate() {
            let cache = self.caches[li];
            let gi = matches!(cache, LayerCache::Gdn { .. }).then_some(gdn_index);
            // The last layer's output stays in mlp_out: the final norm below adds it. Run after the
            // projections, a sparse layer's output does too (its experts add into mlp_out after `down`).
            let next_norm = layers.get(li + 1).map(|l| l.input_norm);
            let lf = if fold {
                Some(LayerFold { input: li > 0, next_norm, gemv: true })
            } else if in_reduce {
                let input = li > 0 && layers[li - 1].moe.is_none();
                Some(LayerFold { input, next_norm: next_norm.filter(|_| layer.moe.is_none()), gemv: false })
            } else {
                None
            };
            self.layer(ws, layer, cache, li == 0, sh, gi, false, lf)?;
            gdn_index += usize::from(gi.is_some());
        }
        if sh.n_logits > 0 || self.spec.is_some() {
            // Last residual add + final norm over every row (cheap), then gather the wanted rows.
            norm::add_rms_norm_1p(
                k,
                s,
                ws.mlp_out,
                Some(ws.residual),
                self.w.final_norm,
                Some(ws.residual),
                ws.final_normed,
                t,
                h,
                eps,
            )?;
        }
        if sh.n_logits > 0 {
            embed::embed_gather(k, s, ws.final_normed, ws.last_idx, ws.final_hidden, sh.n_logits, h)?;
            self.proj(s, ws.final_hidden, sh.n_logits, h, &[po(&self.w.lm_head, self.logits.ptr, d.vocab)], true)?;
            self.tick("final norm + lm_head")?;
        }
        if let Some(sp) = &self.spec {
            // The MTP head's cache entries of every row (row r: the hidden of row r − 1, or the slot's
            // pending hidden for a chunk's first row), the verify rows' hidden for their commit, and
            // each plain chunk's last hidden as its slot's new pending hidden.
            let (pending, fin) = (self.states.ptr + sp.pending as u64, ws.final_normed);
            mtp::shift_rows(k, s, fin, pending, ws.cu_seqlens, ws.slots, sh.n, sp.rows_in, t, h)?;
            if sh.n_ver > 0 {
                let r0 = sh.tp - sh.tv;
                self.copy(Place::Dev(sp.verify_hidden), Place::Dev(fin + (2 * r0 * h) as u64), 2 * sh.tv * h)?;
            }
            mtp::scatter_rows(k, s, fin, sp.idx_at(0), pending, sp.idx_at(1), sh.n_pend, h)?;
            self.pending_saves(fin, sp.snap_pending)?;
            self.mtp_forward(sh, sp.rows_in, true)?;
            self.tick("MTP head cache")?;
        }
        Ok(())
    }

    /// One decoder layer over the step `sh`. Its input is `residual` (`first`), `mlp_out + residual`,
    /// or with `fold.input` the previous layer's folded norm (`fold_x`, `fold_sums`, residual updated);
    /// its output is left in `mlp_out` (residual updated), or with `fold.next_norm` folded into the next
    /// norm. `fold`: the step folds its norms into the int4 projections ([`w4a16::Fold`]).
    /// `gdn_index`: the layer's index among the DeltaNet layers (its verify trace). `kv_only`
    /// (attention layers): stop once the K/V of the step's rows are in the cache (the MTP head's cache
    /// entries).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer(
        &self,
        ws: &Ws,
        layer: &Layer,
        cache: LayerCache,
        first: bool,
        sh: &StepShape,
        gdn_index: Option<usize>,
        kv_only: bool,
        fold: Option<LayerFold>,
    ) -> Result<(), CudaError> {
        let s = self.rt.stream().as_ref();
        let t = sh.t;
        let eps = self.eps;
        // The input norm: its own kernel, or the previous layer's down projection and this layer's
        // in-projection (folded), or the previous layer's down projection alone (run after it).
        let fold_in = fold.is_some_and(|f| f.input);
        let (x_in, in_fold) = if fold_in && fold.is_some_and(|f| f.gemv) {
            (ws.fold_x, Fold::Norm { sums: ws.fold_sums, eps })
        } else {
            (ws.x_norm, Fold::None)
        };
        if first || !fold_in {
            let x = if first { (ws.residual, None, None) } else { (ws.mlp_out, Some(ws.residual), Some(ws.residual)) };
            self.add_norm_into(s, x, layer.input_norm, ws.x_norm, t, &self.mixer_in_outs(ws, &layer.mixer))?;
        }
        self.tick("norms")?;
        let out_fold = fold.map(|f| {
            if f.gemv {
                OutNorm::Fold(fold_out(ws, layer.post_norm))
            } else {
                OutNorm::After { w: layer.post_norm, out: ws.mlp_in }
            }
        });
        match (&layer.mixer, cache) {
            (Mixer::Gdn(gw), LayerCache::Gdn { rec, conv, snap_rec, snap_conv }) => {
                let st = GdnOffsets { rec, conv, snap_rec, snap_conv };
                self.deltanet(ws, gw, st, sh, gdn_index, (x_in, in_fold), out_fold)?;
            }
            (Mixer::Attn(aw), LayerCache::Attn(l)) => {
                self.attention(ws, aw, l, sh, (x_in, in_fold), kv_only, out_fold)?;
                if kv_only {
                    return Ok(());
                }
            }
            _ => return Err(CudaError::Plan("a layer's weights and cache kinds differ".into())),
        }
        self.mlp(ws, layer, t, fold)
    }

    /// The projections of a mixer's input, each into its workspace buffer.
    pub(super) fn mixer_in_outs<'a>(&self, ws: &Ws, mixer: &'a Mixer) -> [ProjOut<'a>; 3] {
        match mixer {
            Mixer::Gdn(g) => self.gdn_in_outs(ws, g),
            Mixer::Attn(a) => self.attn_in_outs(ws, a),
        }
    }

    /// A layer's MLP after its mixer: the post-attention norm (or folded: its sums), gate/up, SwiGLU and
    /// down into `mlp_out`, or with `fold.next_norm` into the residual stream and the next norm's input.
    fn mlp(&self, ws: &Ws, layer: &Layer, t: usize, fold: Option<LayerFold>) -> Result<(), CudaError> {
        let (s, d) = (self.rt.stream().as_ref(), &self.d);
        let h = d.hidden;
        let eps = self.eps;
        let gemv_fold = fold.is_some_and(|f| f.gemv);
        let i = layer.moe.as_ref().map_or(d.intermediate, |m| m.shared_width);
        let (mlp_x, mlp_fold) = if gemv_fold {
            (ws.fold_x, Fold::Norm { sums: ws.fold_sums, eps })
        } else if fold.is_some() {
            // The mixer's out projection ran the post-attention norm.
            (ws.mlp_in, Fold::None)
        } else {
            self.all_reduce(ws.mixer_out, t * h)?;
            let x = (ws.mixer_out, Some(ws.residual), Some(ws.residual));
            // A sparse layer's router and experts read mlp_in too: stored whole.
            let gate_up = [po(&layer.gate_up, ws.mlp_gate_up, 2 * i)];
            let outs: &[ProjOut<'_>] = if layer.moe.is_none() { &gate_up } else { &[] };
            self.add_norm_into(s, x, layer.post_norm, ws.mlp_in, t, outs)?;
            self.tick("norms")?;
            (ws.mlp_in, Fold::None)
        };
        if layer.moe.is_some() && gemv_fold {
            return Err(CudaError::Plan("a sparse layer's norms do not fold into its projections".into()));
        }
        // A sparse layer whose shared expert runs with the routed experts' GEMVs.
        if let Some(m) = &layer.moe
            && let Some(shared) = self.shared_pairs(ws, m, &layer.gate_up, &layer.down, t)
        {
            self.moe(ws, m, t, Some(shared))?;
            self.all_reduce(ws.mlp_out, t * h)?;
            return Ok(());
        }
        self.proj_fold(s, mlp_x, t, h, &[po(&layer.gate_up, ws.mlp_gate_up, 2 * i)], mlp_fold)?;
        self.mlp_swiglu(s, ws, t, i, &layer.down)?;
        if let Some(f) = fold
            && let Some(next) = f.next_norm
        {
            if f.gemv {
                self.proj_fold(s, ws.mlp_act, t, i, &[po(&layer.down, ws.residual, h)], fold_out(ws, next))?;
            } else {
                self.proj_norm(s, ws.mlp_act, t, i, &layer.down, ws.mlp_out, next, ws.x_norm)?;
            }
            self.tick("MLP (GEMMs + SwiGLU)")?;
            return Ok(());
        }
        self.proj(s, ws.mlp_act, t, i, &[po(&layer.down, ws.mlp_out, h)], false)?;
        self.tick("MLP (GEMMs + SwiGLU)")?;
        if let Some(m) = &layer.moe {
            self.moe(ws, m, t, None)?;
        }
        self.all_reduce(ws.mlp_out, t * h)?;
        Ok(())
    }

    /// The MLP's SwiGLU of the gate/up rows (`i` wide) into `mlp_act`; where the down projection takes FP8
    /// codes ([`Self::fp8_fused_target`]) the same pass writes them ([`fp8::swiglu_quant`]) and `mlp_act` only
    /// the rows the GEMV takes.
    fn mlp_swiglu(&self, s: &CudaStream, ws: &Ws, t: usize, i: usize, down: &Proj) -> Result<(), CudaError> {
        let (gate, up) = ((ws.mlp_gate_up, 2 * i), (ws.mlp_gate_up + b2(i), 2 * i));
        if let Some((tq, at)) = self.fp8_fused_target(down, t, i, ws.mlp_out, self.d.hidden) {
            fp8::swiglu_quant(&self.k, s, gate, up, t, i, tq, at, ws.mlp_act)?;
            self.fp8_x_written(ws.mlp_act, tq, i);
            return Ok(());
        }
        elementwise::swiglu(&self.k, s, gate.0, gate.1, up.0, up.1, ws.mlp_act, t, i)
    }
}

/// `x` bf16 elements in bytes (a device address offset).
pub(super) fn b2(x: usize) -> u64 {
    (2 * x) as u64
}

/// Folded: the projection that ends the mixer / the MLP writes the residual stream and the input of the
/// norm of weight `norm_w`.
fn fold_out(ws: &Ws, norm_w: u64) -> Fold {
    Fold::Residual { x_out: ws.fold_x, norm_w, sums: ws.fold_sums }
}
