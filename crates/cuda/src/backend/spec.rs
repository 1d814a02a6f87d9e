//! Speculative decoding (MTP) on the CUDA backend: the head's weights and state ([`Spec`]), the draft
//! steps, the checks of speculative chunks, the commit, and the head's forward. The verify itself is the
//! backend's forward over chunks flagged as verify chunks (`run_chunks`, `layer`).

use super::step::StepOut;
use super::*;
use crate::ops::gdn_gate;

/// The MTP head (arch doc §2.5): `fc([norm_e(embed(x)) | norm_h(hidden)])`, one attention decoder
/// layer with its own KV, then `norm`; logits through the shared lm_head.
pub(super) struct MtpHead {
    pub(super) fc: Proj,
    pub(super) pre_fc_norm_embedding: u64,
    pub(super) pre_fc_norm_hidden: u64,
    pub(super) norm: u64,
    pub(super) layer: Layer,
}

/// Speculative decoding state: the head's KV layer, the pending hidden rows, the verify trace.
///
/// Every step writes the head's cache entries of its positions (entry p = the head's K/V of
/// (post-norm hidden of p − 1, token p)) and each plain chunk's last hidden becomes its slot's pending
/// hidden. A speculative chunk drafts with the head, then runs through the main model as a short
/// prefill whose DeltaNet layers leave the committed state untouched (conv without state update,
/// [`ops::gdn_decode::gdn_recurrent`] without write-back) while each DeltaNet layer's inputs (the
/// in-projection rows `qkv` and `ba`) are kept in the trace; the commit recomputes conv and gates from
/// the trace and runs the recurrence over the accepted rows with write-back — the per-token arithmetic
/// of decode.
pub(super) struct Spec {
    pub(super) max_draft: usize,
    pub(super) kv: LayerKv,
    /// `[slots, hidden]` bf16 in `state_slots` (byte offset), and in `snapshots`.
    pub(super) pending: usize,
    pub(super) snap_pending: usize,
    /// Rows the verify buffers hold: `max_seqs · (1 + max_draft)`.
    pub(super) rows: usize,
    /// `[rows, hidden]` bf16: the main model's post-norm hidden of the last step's verify rows.
    pub(super) verify_hidden: u64,
    /// `[max_seqs, hidden]` bf16: the head's output rows of the previous draft step.
    pub(super) draft_hidden: u64,
    /// The head's activation buffers (the plan's `mtp_*` workspace buffers: they live after the
    /// layers, so they never alias what the main forward still needs), and its input rows and fc input.
    pub(super) ws: Ws,
    pub(super) rows_in: u64,
    pub(super) cat: u64,
    /// Per DeltaNet layer `[rows, conv_channels]` and `[rows, 2·Hv]` bf16: in-projection rows of the
    /// last step's verify rows.
    pub(super) trace_x: u64,
    pub(super) trace_ba: u64,
    /// i32 index arrays, `rows + 1` entries each: pending stores (rows, slots), commit (starts, lens,
    /// slots), the verify group's cu_seqlens and slots, and its rows' attention lengths, block-table
    /// rows and groups.
    pub(super) idx: DevSpan,
    /// Split-K partials of the verify rows' decode attention (`rows` queries), `partitions` per row.
    pub(super) partials: DevSpan,
    pub(super) partitions: usize,
    /// Speculative chunks of the last step, awaiting their commit.
    pub(super) verified: Vec<Verified>,
    /// The verify group of the last step: its rows, and its chunks' row offsets and slots.
    pub(super) verify_cu: Vec<i32>,
    pub(super) verify_slots: Vec<i32>,
    /// Wall time of the last step's draft phase (it ends synchronised: its logits are on the host).
    pub(super) draft_s: f64,
}

/// A verified speculative chunk: its `n` rows start at row `row0` of the verify group.
pub(super) struct Verified {
    pub(super) seq_id: u64,
    pub(super) slot: u32,
    pub(super) start: usize,
    pub(super) n: usize,
    pub(super) row0: usize,
}

impl Spec {
    /// Index array `which` inside `idx`: 0 pending rows, 1 pending slots, 2 commit starts, 3 commit
    /// lens, 4 commit slots, 5 verify cu_seqlens, 6 verify slots, 7 verify rows' attention lengths,
    /// 8 verify rows' block-table rows, 9 their groups' row offsets (attention::attn_verify_q).
    pub(super) fn idx_at(&self, which: usize) -> u64 {
        self.idx.ptr + 4 * (which * (self.rows + 1)) as u64
    }
    pub(super) fn idx_bytes(rows: usize) -> usize {
        4 * 10 * (rows + 1)
    }
}

impl CudaBackend {
    /// A step that wants drafts ([`deltaserve_backend::Want::Drafts`]): drafts with the MTP head (one
    /// head forward per draft position, its logits picked on the host), then one forward of the main
    /// model over every chunk, speculative chunks as short prefills whose DeltaNet state stays committed
    /// (see [`Spec`]); every wanted row handed back as `out` asks (its logits, or its argmax picked on the
    /// device).
    pub(super) fn step_speculative(
        &mut self,
        batch: &StepBatch,
        pick: &mut DraftPicker<'_>,
        out: StepOut<'_>,
        drafts: &mut Vec<Vec<u32>>,
    ) -> Result<(), BackendError> {
        if !batch.seqs.iter().any(|c| c.draft > 0) {
            return self.step_to(batch, out);
        }
        self.check_speculative(batch)?;
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        if let Some(sp) = &mut self.spec {
            sp.verified.clear();
        }
        for op in &batch.pre {
            self.apply(op)?;
        }
        let t0 = std::time::Instant::now();
        let mut dtoks = self.draft(batch, pick)?;
        if let Some(sp) = &mut self.spec {
            sp.draft_s = t0.elapsed().as_secs_f64();
        }
        let verify: Vec<bool> = batch.seqs.iter().map(|c| c.draft > 0).collect();
        let mut ex = StepBatch { pre: Vec::new(), seqs: batch.seqs.clone(), post: Vec::new() };
        for (c, d) in ex.seqs.iter_mut().zip(&dtoks) {
            c.tokens.extend_from_slice(d);
            c.draft = 0;
        }
        self.run_chunks(&ex, &verify, out)?;
        for op in &batch.post {
            self.apply(op)?;
        }
        self.rt.synchronize().map_err(device_error)?;
        drafts.extend(verify.iter().zip(dtoks.iter_mut()).filter(|(v, _)| **v).map(|(_, d)| std::mem::take(d)));
        Ok(())
    }

    /// Drafts with the MTP head for the speculative chunks of `batch` (draft step i runs every chunk
    /// with more than i drafts at position `start + i`): returns each chunk's drafts (empty for plain
    /// chunks), picked by `pick` from the head's logits.
    pub(super) fn draft(
        &mut self,
        batch: &StepBatch,
        pick: &mut DraftPicker<'_>,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        let mut order: Vec<usize> = (0..batch.seqs.len()).filter(|&i| batch.seqs[i].draft > 0).collect();
        // Longest first: the chunks of draft step i are the first rows of step i − 1.
        order.sort_by_key(|&i| std::cmp::Reverse(batch.seqs[i].draft));
        let mut out = vec![Vec::new(); batch.seqs.len()];
        let Some(&first) = order.first() else { return Ok(out) };
        let (v, h, ps) = (self.d.vocab, self.d.hidden, self.page_size);
        let slots: Vec<i32> = order.iter().map(|&i| batch.seqs[i].slot as i32).collect();
        let (ws_slots, ws_last) = (self.ws.slots, self.ws.last_idx);
        let all: Vec<i32> = (0..order.len() as i32).collect();
        (|| -> Result<(), CudaError> {
            for (r, &i) in order.iter().enumerate() {
                let c = &batch.seqs[i];
                self.put_table_row(r, &c.pages[..(c.start + c.draft).div_ceil(ps)])?;
            }
            self.upload_i32(ws_slots, &slots)?;
            self.upload_i32(ws_last, &all)
        })()
        .map_err(device_error)?;
        let mut rows = Vec::new();
        for i in 0..batch.seqs[first].draft {
            let m = order.iter().take_while(|&&j| batch.seqs[j].draft > i).count();
            let (mut ids, mut pos, mut lens) = (Vec::with_capacity(m), Vec::with_capacity(m), Vec::with_capacity(m));
            let mut rope = Vec::new();
            for &j in &order[..m] {
                let c = &batch.seqs[j];
                ids.push(if i == 0 { c.tokens[0] } else { out[j][i - 1] } as i32);
                pos.push((c.start + i) as i32);
                lens.push((c.start + i + 1) as i32);
                rope.extend(super::images::draft_rope(c, i));
            }
            let cu: Vec<i32> = (0..=m as i32).collect();
            let shape = StepShape {
                t: m,
                n: m,
                n_pre: 0,
                tp: 0,
                n_ver: 0,
                tv: 0,
                tvd: 0,
                tvd_groups: 0,
                tvd_group_rows: 0,
                short_groups: 0,
                short_group_rows: 0,
                short_row0: 0,
                short_rows: 0,
                short_tiles: 0,
                short_splits: 0,
                n_chunks: 0,
                n_tiles: 0,
                n_logits: m,
                n_pend: 0,
            };
            // Draft 0 continues from the slot's pending hidden; later drafts from the head's own rows.
            let work = |be: &Self| -> Result<(), CudaError> {
                let sp = be.spec.as_ref().ok_or_else(|| CudaError::Plan("no speculation".into()))?;
                let (ws, k, s) = (&be.ws, &be.k, be.rt.stream().as_ref());
                let hidden_in = if i == 0 {
                    let pending = be.states.ptr + sp.pending as u64;
                    mtp::shift_rows(k, s, sp.rows_in, pending, ws.cu_seqlens, ws.slots, m, sp.rows_in, m, h)?;
                    sp.rows_in
                } else {
                    sp.draft_hidden
                };
                be.mtp_forward(&shape, hidden_in, false)?;
                be.copy(Place::Dev(sp.draft_hidden), Place::Dev(sp.ws.x_norm), 2 * m * h)
            };
            let ws = self.ws;
            (|| -> Result<(), CudaError> {
                self.upload_i32(ws.token_ids, &ids)?;
                self.upload_i32(ws.positions, &pos)?;
                if ws.rope_pos != 0 {
                    // Drafts rotate at their position plus the sequence's rope delta.
                    self.upload_i32(ws.rope_pos, &rope)?;
                }
                self.upload_i32(ws.cu_seqlens, &cu)?;
                self.upload_i32(ws.seq_lens, &lens)
            })()
            .map_err(device_error)?;
            self.run_graphed(GraphKey::Draft(m, i == 0), &work).map_err(device_error)?;
            // Greedy drafts of one vocabulary bound: picked by the argmax kernel, 4 bytes a row come back.
            let n0 = batch.seqs[order[0]].greedy_draft_vocab;
            if n0 > 0 && order[..m].iter().all(|&j| batch.seqs[j].greedy_draft_vocab == n0) {
                let sp = self.spec.as_ref().ok_or_else(|| BackendError::Unsupported("speculative decoding".into()))?;
                // Into the commit's arrays: free until the commit uploads them.
                let got = self.logits_argmax(m, n0, sp.idx_at(2)).map_err(device_error)?;
                for (&j, t) in order[..m].iter().zip(got) {
                    out[j].push(t);
                }
                continue;
            }
            rows.resize(m * v, 0.0);
            self.rt.download(&mut rows[..m * v], self.logits.ptr).map_err(device_error)?;
            for (r, &j) in order[..m].iter().enumerate() {
                let c = &batch.seqs[j];
                let t = c.pick_draft(pick, i, &rows[r * v..(r + 1) * v]);
                if t as usize >= v {
                    return Err(BackendError::InvalidStep(format!(
                        "seq {}: draft token {t} outside the vocabulary",
                        c.seq_id
                    )));
                }
                out[j].push(t);
            }
        }
        Ok(out)
    }

    /// Checks a step's speculative chunks: one decode token after the prompt, 1..=max_draft drafts,
    /// pages for every verified position.
    pub(super) fn check_speculative(&self, batch: &StepBatch) -> Result<(), BackendError> {
        let max_draft = self.spec.as_ref().map_or(0, |sp| sp.max_draft);
        for c in batch.seqs.iter().filter(|c| c.draft > 0) {
            if max_draft == 0 {
                return Err(BackendError::Unsupported(format!(
                    "speculative decoding (backend {} was started without --speculative-tokens)",
                    self.capabilities().name
                )));
            }
            if c.draft > max_draft || c.tokens.len() != 1 || c.start == 0 {
                return Err(BackendError::InvalidStep(format!(
                    "seq {}: a speculative chunk is one decode token after the prompt with 1..={max_draft} drafts \
                     (got {} tokens at {} with {} drafts)",
                    c.seq_id,
                    c.tokens.len(),
                    c.start,
                    c.draft
                )));
            }
            let need = (c.start + 1 + c.draft).div_ceil(self.page_size);
            if c.pages.len() < need
                || need > self.table_width
                || c.pages[..need].iter().any(|&p| p as usize >= self.num_pages)
            {
                return Err(BackendError::InvalidStep(format!(
                    "seq {}: pages do not cover {} positions",
                    c.seq_id,
                    c.start + 1 + c.draft
                )));
            }
            if c.slot as usize >= self.num_slots || c.tokens[0] as usize >= self.d.vocab {
                return Err(BackendError::InvalidStep(format!("seq {}: slot or token out of range", c.seq_id)));
            }
        }
        Ok(())
    }

    /// Advances the committed DeltaNet state of each commit by its accepted rows of the last verify
    /// (conv and gates recomputed from the trace, the recurrence with write-back: decode's arithmetic)
    /// and sets its slot's pending hidden to the main model's row of its last accepted position.
    pub(super) fn commit(&mut self, commits: &[SpecCommit]) -> Result<(), BackendError> {
        let inv = |m: String| BackendError::InvalidStep(m);
        let Some(sp) = self.spec.as_mut() else {
            return Err(BackendError::Unsupported(format!(
                "speculative decoding (backend {})",
                self.capabilities().name
            )));
        };
        let (mut starts, mut lens, mut slots, mut hid) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for c in commits {
            let Some(i) = sp.verified.iter().position(|v| v.seq_id == c.seq_id && v.slot == c.slot) else {
                return Err(inv(format!("seq {}: no speculative chunk to commit", c.seq_id)));
            };
            let v = sp.verified.swap_remove(i);
            if c.start != v.start || c.accepted == 0 || c.accepted > v.n {
                return Err(inv(format!(
                    "seq {}: commit of {} positions at {} does not match the verified chunk ({} positions at {})",
                    c.seq_id, c.accepted, c.start, v.n, v.start
                )));
            }
            starts.push(v.row0 as i32);
            lens.push(c.accepted as i32);
            slots.push(c.slot as i32);
            hid.push((v.row0 + c.accepted - 1) as i32);
        }
        let n = commits.len();
        let sp = self.spec.as_ref().ok_or_else(|| inv("no speculation".into()))?;
        let (tv, nv) = (*sp.verify_cu.last().unwrap_or(&0) as usize, sp.verify_slots.len());
        // Index arrays 0 ..= 6 in one copy (7 and 8, the verify rows' own, are kept).
        let stride = sp.rows + 1;
        let mut idx = vec![0i32; 7 * stride];
        for (at, v) in [&hid, &slots, &starts, &lens, &slots, &sp.verify_cu, &sp.verify_slots].into_iter().enumerate() {
            if v.len() > stride {
                return Err(inv(format!("{} index entries for {stride} rows", v.len())));
            }
            idx[at * stride..at * stride + v.len()].copy_from_slice(v);
        }
        let upload = || -> Result<(), CudaError> {
            self.rt.context().bind_to_thread().map_err(CudaError::driver("cuCtxSetCurrent"))?;
            self.upload_i32(sp.idx_at(0), &idx)
        };
        upload().map_err(device_error)?;
        self.run_graphed(GraphKey::Commit(n, tv, nv), &|be: &Self| be.commit_kernels(n, tv, nv))
            .map_err(device_error)?;
        self.rt.synchronize().map_err(device_error)
    }

    /// The commit's work (inputs uploaded by [`CudaBackend::commit`]): per DeltaNet layer, conv and gates
    /// of the accepted rows of the `n` commits from the trace, the recurrence with write-back and the
    /// conv window's shift (every layer in one `gdn_commit_layers` launch where the layers' dims allow;
    /// else per layer conv and gates of the `tv` verify rows of `nv` chunks, then the other two); then
    /// the pending hidden rows.
    pub(super) fn commit_kernels(&self, n: usize, tv: usize, nv: usize) -> Result<(), CudaError> {
        let sp = self.spec.as_ref().ok_or_else(|| CudaError::Plan("no speculation".into()))?;
        let (k, s, ws, d) = (&self.k, self.rt.stream().as_ref(), &self.ws, &self.d);
        let (cc, hv, kw) = (d.conv_channels, d.gdn_v_heads, d.gdn_key_width);
        let b2 = |x: usize| (2 * x) as u64;
        let gdn = self.w.layers.iter().zip(&self.caches).filter_map(|(l, c)| match (&l.mixer, *c) {
            (Mixer::Gdn(gw), LayerCache::Gdn { rec, conv, .. }) => Some((gw, rec, conv)),
            _ => None,
        });
        if gdn_decode::rows_supported(&k.dims, cc, d.gdn_k_heads, hv) {
            // Conv, gates and recurrence of the accepted rows, both states advanced, every layer in one
            // launch (the layers' commits are independent: each reads its own trace rows and states).
            let layers: Vec<gdn_decode::GdnLayerPtrs> = gdn
                .map(|(gw, rec, conv)| gdn_decode::GdnLayerPtrs {
                    conv_w: gw.conv,
                    conv_state: self.states.ptr + conv as u64,
                    a_log: gw.a_log,
                    dt_bias: gw.dt_bias,
                    state: self.states.ptr + rec as u64,
                })
                .collect();
            let all = gdn_decode::GdnCommitLayers {
                layers: &layers,
                x: sp.trace_x,
                x_layer: sp.rows * cc,
                x_stride: cc,
                ba: sp.trace_ba,
                ba_layer: sp.rows * 2 * hv,
                ba_stride: 2 * hv,
                slots: sp.idx_at(4),
                starts: sp.idx_at(2),
                lens: sp.idx_at(3),
                n_seqs: n,
                hk: d.gdn_k_heads,
                hv,
            };
            gdn_decode::gdn_commit_layers(k, s, &all)?;
            let pending = self.states.ptr + sp.pending as u64;
            return mtp::scatter_rows(k, s, sp.verify_hidden, sp.idx_at(0), pending, sp.idx_at(1), n, d.hidden);
        }
        for (gi, (gw, rec, conv)) in gdn.enumerate() {
            let mut cp = conv::ConvPrefill {
                x: sp.trace_x + b2(gi * sp.rows * cc),
                x_stride: cc,
                w: gw.conv,
                y: ws.gdn_conv_out,
                state: self.states.ptr + conv as u64,
                cu_seqlens: sp.idx_at(5),
                slots: sp.idx_at(6),
                n_seqs: nv,
                t: tv,
                channels: cc,
            };
            let ba = sp.trace_ba + b2(gi * sp.rows * 2 * hv);
            let (q, kk) = if gdn_gate::conv_gate_decode_supported(&k.dims, cc, d.gdn_k_heads, hv) {
                // Conv and gates of the verify rows in one launch.
                let (q, kk) = (ws.gdn_qk, ws.gdn_qk + b2(tv * kw));
                let f = gdn_gate::GdnConvGateRows::of_conv(&cp, self.gate_args(gw, ws.gdn_conv_out, ba, (q, kk), tv));
                gdn_gate::gdn_conv_gate_rows(k, s, &f)?;
                (q, kk)
            } else {
                conv::conv_prefill_only(k, s, &cp)?;
                self.gdn_gates(gw, ba, tv, tv)?
            };
            let dec = gdn_decode::GdnDecode {
                q,
                k: kk,
                v: ws.gdn_conv_out + b2(2 * kw),
                v_stride: cc,
                g: ws.gdn_g,
                beta: ws.gdn_beta,
                state: self.states.ptr + rec as u64,
                slots: sp.idx_at(4),
                o: ws.gdn_core_out,
                n_seqs: n,
                hk: d.gdn_k_heads,
                hv,
            };
            let r = gdn_decode::GdnRecurrent { d: dec, starts: sp.idx_at(2), lens: sp.idx_at(3), write_state: true };
            gdn_decode::gdn_recurrent(k, s, &r)?;
            cp.cu_seqlens = sp.idx_at(2);
            cp.slots = sp.idx_at(4);
            cp.n_seqs = n;
            conv::conv_state_update(k, s, &cp, n, sp.idx_at(3))?;
        }
        let pending = self.states.ptr + sp.pending as u64;
        mtp::scatter_rows(k, s, sp.verify_hidden, sp.idx_at(0), pending, sp.idx_at(1), n, d.hidden)
    }

    /// The MTP head over the step's rows (inputs uploaded for `sh`): row r combines `hidden_in` row r
    /// (`[t, hidden]` bf16) with the embedding of token r at its position. `kv_only`: only the head's
    /// cache entries are written; else its post-norm rows end in `x_norm` and the logits of the rows
    /// `last_idx[..n_logits]` in the logits region.
    pub(super) fn mtp_forward(&self, sh: &StepShape, hidden_in: u64, kv_only: bool) -> Result<(), CudaError> {
        let (k, s, d) = (&self.k, self.rt.stream().as_ref(), &self.d);
        let (Some(sp), Some(m)) = (&self.spec, &self.w.mtp) else {
            return Err(CudaError::Plan("the MTP head is not loaded".into()));
        };
        let (t, h, eps) = (sh.t, d.hidden, self.eps);
        let ws = &sp.ws;
        // fc input rows: [normed embedding | normed hidden].
        let cat = sp.cat;
        embed::embed_gather(k, s, self.embed_table(), ws.token_ids, ws.residual, t, h)?;
        norm::rms_norm_1p(k, s, ws.residual, h, m.pre_fc_norm_embedding, cat, 2 * h, t, h, eps)?;
        norm::rms_norm_1p(k, s, hidden_in, h, m.pre_fc_norm_hidden, cat + (2 * h) as u64, 2 * h, t, h, eps)?;
        self.proj(s, cat, t, 2 * h, &[po(&m.fc, ws.residual, h)], false)?;
        self.layer(ws, &m.layer, LayerCache::Attn(sp.kv), true, sh, None, kv_only, None)?;
        if kv_only {
            return Ok(());
        }
        norm::add_rms_norm_1p(k, s, ws.mlp_out, Some(ws.residual), m.norm, Some(ws.residual), ws.x_norm, t, h, eps)?;
        if sh.n_logits > 0 {
            embed::embed_gather(k, s, ws.x_norm, ws.last_idx, ws.final_hidden, sh.n_logits, h)?;
            self.proj(s, ws.final_hidden, sh.n_logits, h, &[po(&self.w.lm_head, self.logits.ptr, d.vocab)], true)?;
        }
        Ok(())
    }
}
