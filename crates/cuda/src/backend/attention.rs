//! The gated attention mixer of a layer: its q/k/v projections, the q/k norms and RoPE with the K/V
//! cache write, paged prefill attention and split-K decode attention (long-context verify rows as
//! decode queries), the output gate and the o projection.

use crate::arena::DevSpan;
use crate::error::CudaError;
use crate::ops::kv_quant::LayerKv;
use crate::ops::w4a16::Fold;
use crate::ops::{self, attention, elementwise, kv_cache};

use super::CudaBackend;
use super::forward::b2;
use super::layout::Ws;
use super::linear::{OutNorm, ProjOut, po};
use super::step::StepShape;
use super::weights::AttnLayer;

impl CudaBackend {
    /// An attention layer's mixer over the step `sh`: its input `x` (the input norm's output, or
    /// folded: [`Fold::Norm`]) into `mixer_out` (or with `out_fold` the post-attention norm too:
    /// [`OutNorm`]). `kv_only`: stop once the K/V of the step's rows are in the cache `l`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        ws: &Ws,
        aw: &AttnLayer,
        l: LayerKv,
        sh: &StepShape,
        (x_in, in_fold): (u64, Fold),
        kv_only: bool,
        out_fold: Option<OutNorm>,
    ) -> Result<(), CudaError> {
        let (k, s, d) = (&self.k, self.rt.stream().as_ref(), &self.d);
        let StepShape { t, n, tp, .. } = *sh;
        let h = d.hidden;
        let eps = self.eps;
        let (nh, nkv, hd, ad, kvd) = (d.q_heads, d.kv_heads, d.head_dim, d.attn_dim, d.kv_dim);
        self.proj_fold(s, x_in, t, h, &self.attn_in_outs(ws, aw), in_fold)?;
        self.tick("attn q/k/v GEMMs")?;
        let qkr = ops::rope::QkNormRope {
            q: ws.attn_qg,
            q_tok: 2 * ad,
            q_head: 2 * hd,
            q_heads: nh,
            q_norm: aw.q_norm,
            k: ws.attn_k,
            k_tok: kvd,
            kv_heads: nkv,
            k_norm: aw.k_norm,
            positions: ws.positions,
            rope_pos: ws.rope_pos,
            mrope_section: self.mrope_section,
            t,
            head_dim: hd,
            rotary_dim: d.rotary_dim,
            theta: self.rope_theta,
            eps,
        };
        let w = self.table_width;
        let kvw = kv_cache::KvWrite {
            k: ws.attn_k,
            k_stride: kvd,
            v: ws.attn_v,
            v_stride: kvd,
            k_cache: l.k.data,
            v_cache: l.v.data,
            block_tables: self.block_tables.ptr,
            max_blocks: w,
            cu_seqlens: ws.cu_seqlens,
            positions: ws.positions,
            n_seqs: n,
            t,
            page: self.page_size,
            kv_heads: nkv,
            head_dim: hd,
        };
        // The q/k norms, RoPE and the K/V rows into the cache, one launch.
        ops::rope::qk_norm_rope_kv(k, s, &qkr, &kvw, &l)?;
        self.tick("attn norms + rope + kv write")?;
        if kv_only {
            return Ok(());
        }
        self.attn_core(ws, &l, sh)?;
        // The output gate of the rows the prefill kernel attended (decode-attended rows, the
        // last tvd verify rows and the decode rows, were gated in the combine step).
        let gated_rows = tp - sh.tvd;
        elementwise::sigmoid_gate_mul(k, s, ws.attn_out, ws.attn_qg + b2(hd), gated_rows, nh, hd, 2 * ad, 2 * hd)?;
        self.mixer_out_proj(s, ws, ws.attn_out, t, ad, &aw.o, out_fold)?;
        self.tick("attn gate + o GEMM")?;
        Ok(())
    }

    /// The input projections, each into its workspace buffer: q and gate, k, v.
    pub(super) fn attn_in_outs<'a>(&self, ws: &Ws, aw: &'a AttnLayer) -> [ProjOut<'a>; 3] {
        let (ad, kvd) = (self.d.attn_dim, self.d.kv_dim);
        [po(&aw.q, ws.attn_qg, 2 * ad), po(&aw.k, ws.attn_k, kvd), po(&aw.v, ws.attn_v, kvd)]
    }

    /// Whether short chunks run the prefill kernel split over the keys (else their rows attend as
    /// decode queries): [`crate::CudaOptions::short_chunk_split_keys`] where the wide kernels run.
    pub fn short_chunks_split(&self) -> bool {
        self.opts.short_chunk_split_keys && attention::prefill_split_supported(&self.k)
    }

    /// The most tokens of one short chunk, the way [`Self::short_chunks_split`] says they run:
    /// [`crate::CudaOptions::short_chunk_split_max_tokens`] split over the keys, else
    /// [`super::SHORT_CHUNK_TOKENS`].
    pub fn short_chunk_max_tokens(&self) -> usize {
        if self.short_chunks_split() { self.opts.short_chunk_split_max_tokens } else { super::SHORT_CHUNK_TOKENS }
    }

    /// The most tokens of one short chunk and the most rows of a step's short chunks: split over the
    /// keys, [`crate::CudaOptions::short_chunk_split_max_tokens`] and half the split scratch's units
    /// (at least two splits a row); as decode queries, [`super::SHORT_CHUNK_TOKENS`] and what the
    /// index arrays and the decode rows' partials hold (one partition a row). (0, 0) when the option
    /// is off or the model has no attention layer.
    pub(super) fn short_chunk_bounds(&self) -> (usize, usize) {
        if self.opts.short_chunk_decode_attention_from == usize::MAX || self.d.num_attention_layers == 0 {
            return (0, 0);
        }
        let rows = if self.short_chunks_split() {
            self.split_units() / 2
        } else {
            // (a row's length and table row, with row groups also a group's offset and the last offset)
            let (per_row, last) = if self.row_group_rows() > 0 { (3, 1) } else { (2, 0) };
            ((self.ws.decode_rows.bytes / 4).saturating_sub(last) / per_row)
                .min(self.partial_rows() * self.decode_partitions)
        };
        (self.short_chunk_max_tokens(), rows)
    }

    /// The split prefill's partials: the larger of the decode rows' partials and the chunked DeltaNet
    /// workspace, which no kernel of an attention layer uses (the DeltaNet layers' chunk kernels fill
    /// it afresh).
    fn split_scratch(&self) -> DevSpan {
        let (a, g) = (self.ws.attn_partials, self.ws.gdn_ws);
        if g.bytes > a.bytes { g } else { a }
    }

    /// Rows × splits of partials [`Self::split_scratch`] holds.
    fn split_units(&self) -> usize {
        partial_units(self.split_scratch().bytes, self.d.q_heads, self.d.head_dim)
    }

    /// Rows of the decode attention's split-K partials (`plan::cuda::SHORT_CHUNK_PARTIAL_ROWS` at least).
    fn partial_rows(&self) -> usize {
        deltaserve_plan::cuda::decode_partial_rows(self.max_seqs)
    }

    /// Key splits of the prefill kernel over `tiles` tiles of short chunks (`rows` rows, contexts up
    /// to `max_end` keys): about two waves of blocks, each split at least 4 KV tiles, as many as the
    /// decode partials hold for the rows.
    pub(super) fn short_prefill_splits(&self, tiles: usize, rows: usize, max_end: usize) -> usize {
        let blocks = tiles * self.d.kv_heads;
        let kv_tiles = max_end.div_ceil(self.k.attn.keys.max(1));
        let units = self.split_units();
        prefill_key_splits(self.k.sm_count, blocks, kv_tiles, units, rows)
    }

    /// Rows of a group of one chunk's rows that attend together (attention::attn_verify_q); 0 where the
    /// kernels take none (the rows attend one by one and no group offsets are built).
    pub(super) fn row_group_rows(&self) -> usize {
        if self.k.verify_mma { attention::verify_group_rows(&self.k.dims) } else { 0 }
    }

    /// Key splits of a grouped launch (attention::attn_verify_q) of the groups `g` over `rows` rows whose
    /// partials get `bytes` of scratch: whole waves of its blocks (two an SM), as many as the partials
    /// hold, at most 64. A function of the step's shape: a graph replays it at any context.
    fn group_splits(&self, g: &attention::RowGroups, rows: usize, bytes: usize) -> usize {
        let units = partial_units(bytes, self.d.q_heads, self.d.head_dim);
        let sms = attention::VERIFY_BLOCKS_PER_SM * self.k.sm_count;
        attention::wave_splits(sms, g.n * self.d.kv_heads, (units / rows.max(1)).clamp(1, 64))
    }

    /// Attention of the step's queries over the paged K/V of `l`: the prefill kernel's tiles (prefill
    /// chunks and short-context verify chunks), long-context verify rows and decode rows split-K.
    fn attn_core(&self, ws: &Ws, l: &LayerKv, sh: &StepShape) -> Result<(), CudaError> {
        let (k, s, d) = (&self.k, self.rt.stream().as_ref(), &self.d);
        let StepShape { n, n_pre, tp, .. } = *sh;
        let n_dec = n - n_pre;
        let (nh, nkv, hd, ad) = (d.q_heads, d.kv_heads, d.head_dim, d.attn_dim);
        let w = self.table_width;
        let sc = l.scales();
        let kv = attention::KvPages {
            k_cache: l.k.data,
            v_cache: l.v.data,
            block_tables: self.block_tables.ptr,
            max_blocks: w,
            page: self.page_size,
            kv_heads: nkv,
            rows: self.num_pages * self.page_size,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        // The prefill kernel's tiles: the prefill chunks and the short-context verify chunks.
        let pf = attention::AttnPrefill {
            q: ws.attn_qg,
            q_tok: 2 * ad,
            q_head: 2 * hd,
            o: ws.attn_out,
            kv,
            cu_seqlens: ws.cu_seqlens,
            seq_lens: ws.seq_lens,
            tile_table: ws.tile_table.ptr,
            n_tiles: sh.n_tiles,
            q_heads: nh,
            scale,
        };
        attention::attn_prefill_q(k, s, &pf, &sc)?;
        let dec = attention::AttnDecode {
            q: ws.attn_qg + b2(tp * 2 * ad),
            q_tok: 2 * ad,
            q_head: 2 * hd,
            o: ws.attn_out + b2(tp * ad),
            kv: attention::KvPages { block_tables: self.block_tables.ptr + (4 * n_pre * w) as u64, ..kv },
            seq_lens: ws.seq_lens + 4 * n_pre as u64,
            table_rows: 0,
            n_seqs: n_dec,
            q_heads: nh,
            n_split: self.decode_partitions,
            scratch: ws.attn_partials.ptr,
            scratch_bytes: ws.attn_partials.bytes,
            scale,
            // The output gate (the q|gate layout's second half) rides on the combine step.
            gate: ws.attn_qg + b2(tp * 2 * ad) + b2(hd),
        };
        if let (true, Some(sp)) = (sh.tvd > 0, &self.spec) {
            // Long-context verify rows as decode queries (split-K over the keys: a few queries
            // over a long context), each with its causal length and its chunk's block-table row;
            // each chunk's rows in groups that read every K/V tile once (or row by row where the
            // kernels cannot: attn_verify_q falls back).
            let g = attention::RowGroups { starts: sp.idx_at(9), n: sh.tvd_groups, max_rows: sh.tvd_group_rows };
            let n_split = if attention::verify_groups_run(k, &g) {
                self.group_splits(&g, sh.tvd, sp.partials.bytes)
            } else {
                sp.partitions
            };
            let r0 = tp - sh.tvd;
            let a = attention::AttnDecode {
                q: ws.attn_qg + b2(r0 * 2 * ad),
                gate: ws.attn_qg + b2(r0 * 2 * ad) + b2(hd),
                o: ws.attn_out + b2(r0 * ad),
                kv,
                seq_lens: sp.idx_at(7),
                table_rows: sp.idx_at(8),
                n_seqs: sh.tvd,
                n_split,
                scratch: sp.partials.ptr,
                scratch_bytes: sp.partials.bytes,
                ..dec
            };
            attention::attn_verify_q(k, s, &a, &sc, &g)?;
        }
        if sh.short_tiles > 0 {
            // Short prefill chunks over a long context: the prefill kernel over their tiles with the
            // keys split (a few tiles alone would leave most SMs idle, each streaming the whole
            // context), the splits merged into their rows (ungated: the gate kernel after this covers
            // them with the prefill rows). Their partials use the decode rows' scratch: the decode
            // launch below runs after this one's combine.
            let a = attention::AttnPrefill {
                tile_table: ws.tile_table.ptr + (8 * sh.n_tiles) as u64,
                n_tiles: sh.short_tiles,
                ..pf
            };
            let scratch = self.split_scratch();
            let sp = attention::PrefillSplit {
                n_split: sh.short_splits,
                row0: sh.short_row0,
                rows: sh.short_rows,
                scratch: scratch.ptr,
                scratch_bytes: scratch.bytes,
            };
            attention::attn_prefill_split(k, s, &a, &sc, &sp)?;
        } else if sh.short_rows > 0 {
            // Short prefill chunks over a long context as decode queries, each row with its causal
            // length and its chunk's block-table row; ungated (the gate kernel after this covers
            // them with the prefill rows). Their partials use the decode rows' scratch, split so
            // that they fit it: the decode launch below runs after this one's combine.
            // A chunk's rows in groups that read each K/V tile once, as verify chunks' (or row by row).
            let (r0, rows) = (sh.short_row0, sh.short_rows);
            let g = attention::RowGroups {
                starts: ws.decode_rows.ptr + 8 * rows as u64,
                n: sh.short_groups,
                max_rows: sh.short_group_rows,
            };
            let n_split = if attention::verify_groups_run(k, &g) {
                self.group_splits(&g, rows, ws.attn_partials.bytes)
            } else {
                short_chunk_splits(self.partial_rows(), self.decode_partitions, rows)
            };
            let a = attention::AttnDecode {
                q: ws.attn_qg + b2(r0 * 2 * ad),
                gate: 0,
                o: ws.attn_out + b2(r0 * ad),
                kv,
                seq_lens: ws.decode_rows.ptr,
                table_rows: ws.decode_rows.ptr + 4 * rows as u64,
                n_seqs: rows,
                n_split,
                ..dec
            };
            attention::attn_verify_q(k, s, &a, &sc, &g)?;
        }
        if n_dec > 0 {
            attention::attn_decode_q(k, s, &dec, &sc)?;
        }
        self.tick("attn core (prefill / decode)")?;
        Ok(())
    }
}

/// Key splits of a prefill launch of `blocks` blocks (tiles × kv heads) whose longest tile has
/// `kv_tiles` KV tiles, its `rows` rows' partials in `units` (rows × splits) of scratch, on `sms` SMs
/// holding one block each (the wide kernel's shared memory at the 27B's head dim): the fewest splits
/// whose waves of blocks take within 5% of the least time any split count up to the cap gives (time ∝
/// waves / splits: 96 blocks split 3 ways are 3 waves of a third, no faster than 1 wave), at most 64,
/// at least 4 KV tiles a split, no more than the scratch holds; at least 1.
fn prefill_key_splits(sms: usize, blocks: usize, kv_tiles: usize, units: usize, rows: usize) -> usize {
    attention::wave_splits(sms, blocks, (kv_tiles / 4).min(units / rows.max(1)).clamp(1, 64))
}

/// Rows × splits of decode-layout partials (`q_heads` heads of `head_dim`) that `bytes` of scratch hold
/// ([`attention::decode_scratch_bytes`] of them fits).
fn partial_units(bytes: usize, q_heads: usize, head_dim: usize) -> usize {
    bytes.saturating_sub(256) / (q_heads * (4 * head_dim + 8)).max(1)
}

/// Split-K partitions of `rows` short-chunk rows attending as decode queries: as many as the decode
/// rows' partials (`partial_rows` rows of `partitions`) hold for them, at least 1 and at most `partitions`.
fn short_chunk_splits(partial_rows: usize, partitions: usize, rows: usize) -> usize {
    (partial_rows * partitions / rows.max(1)).clamp(1, partitions.max(1))
}

#[cfg(test)]
mod tests {
    use super::{partial_units, prefill_key_splits, short_chunk_splits};
    use crate::ops::attention::decode_scratch_bytes;

    #[test]
    fn partial_units_fit_their_scratch() {
        for bytes in [0, 255, 256, 25_000, 12_582_912, 253_000_000] {
            let u = partial_units(bytes, 24, 256);
            assert!(u == 0 || decode_scratch_bytes(u, 24, 1, 256) <= bytes, "{bytes}");
            assert!(decode_scratch_bytes(u + 1, 24, 1, 256) > bytes - bytes.min(256), "{bytes}: {u} is not the most");
        }
        // The 27B's chunked DeltaNet workspace at 4,096 tokens a step (48 value heads): ~10K units.
        let gdn = deltaserve_plan::cuda::gdn_chunk_workspace_bytes(4096, 48, 128, 128);
        assert_eq!(partial_units(gdn, 24, 256), gdn.saturating_sub(256) / (24 * 1032));
    }

    #[test]
    fn short_chunk_partials_fit_the_decode_scratch() {
        for (seqs, parts) in [(1, 32), (4, 32), (64, 32), (2, 128)] {
            let have = decode_scratch_bytes(seqs, 24, parts, 256);
            for rows in 1..=(seqs * parts).min(256) {
                let n = short_chunk_splits(seqs, parts, rows);
                assert!((1..=parts).contains(&n), "{seqs} seqs, {parts} parts, {rows} rows: {n}");
                assert!(decode_scratch_bytes(rows, 24, n, 256) <= have, "{seqs} seqs, {parts} parts, {rows} rows");
            }
        }
        assert_eq!(short_chunk_splits(4, 32, 38), 3);
        assert_eq!(short_chunk_splits(4, 32, 1), 32);
    }

    /// The 27B's short chunks on the H200 (132 SMs, 4 kv heads, 64-key tiles, 128 packed rows a tile:
    /// 21 tokens): the fewest splits within 5% of the best waves; a short context or a full scratch
    /// limits them; a split never goes below 1.
    #[test]
    fn prefill_key_splits_fill_whole_waves_within_the_scratch() {
        let units = 16 * 32;
        // 16 tokens (96 packed rows: one tile per kv head) after 131,072 keys (2048 KV tiles): 31 × 4
        // blocks, one wave; the scratch holds 32.
        assert_eq!(prefill_key_splits(132, 4, 2048, units, 16), 31);
        // The scratch: 64 rows hold 8 splits.
        assert_eq!(prefill_key_splits(132, 12, 2048, units, 64), 8);
        // A short context: 2,048 keys are 32 KV tiles, 8 splits of 4.
        assert_eq!(prefill_key_splits(132, 4, 32, units, 16), 8);
        // 256 tokens (48 blocks): 8 splits are 3 waves (0.375 of the unsplit wave; 6 would be 3 waves
        // too, 0.5); 512 tokens (96 blocks: one wave at 73%): 4 splits, 3 waves (2 or 3 splits are 2 or 3
        // waves: no faster); 300 blocks (2.3 waves): 3 splits, 7 waves.
        assert_eq!(prefill_key_splits(132, 48, 2048, 10_000, 256), 8);
        assert_eq!(prefill_key_splits(132, 96, 2048, 10_000, 512), 4);
        assert_eq!(prefill_key_splits(132, 300, 2048, 10_000, 16), 3);
        // Whole waves already, a context shorter than 4 tiles, more rows than the scratch has units.
        assert_eq!(prefill_key_splits(132, 528, 2048, units, 16), 1);
        assert_eq!(prefill_key_splits(132, 4, 3, units, 16), 1);
        assert_eq!(prefill_key_splits(132, 4, 2048, units, 1000), 1);
    }
}
