//! A step end to end: checking and ordering its chunks, building its inputs, running its forward (eagerly or
//! from a graph), and handing back its logits or picks.

use deltaserve_backend::sampling::pick_rows;
use deltaserve_backend::{BackendError, RowSampling, SnapshotLoc, StepBatch};

use crate::error::CudaError;
use crate::ops::{self, attention, gdn_chunk, gdn_overlap};

use super::CudaBackend;
use super::ahead::LaunchOut;
use super::device_error;
use super::graphs::GraphKey;
use super::inputs::HOST_EMBED_GPU_ROWS;
use super::phases::Mark;
use super::saves::HostSaves;
use super::spec::Verified;

/// What a step hands back: every wanted row's logits, its argmax over ids `< valid`, or its token
/// picked by its [`RowSampling`].
pub(super) enum StepOut<'a> {
    Logits(&'a mut Vec<f32>),
    /// A launched step: picked on the device, collected later.
    Launch(LaunchOut<'a>),
    Argmax {
        valid: usize,
        tokens: &'a mut Vec<u32>,
    },
    Sample {
        valid: usize,
        rows: &'a [RowSampling],
        tokens: &'a mut Vec<u32>,
    },
}

#[derive(Clone, Copy, Debug)]
pub(super) struct StepShape {
    /// Rows (tokens) and sequences of the step.
    pub(super) t: usize,
    pub(super) n: usize,
    /// The multi-token group (first): its sequences and rows; the verify chunks of speculative
    /// decoding are its last `n_ver` sequences (`tv` rows).
    pub(super) n_pre: usize,
    pub(super) tp: usize,
    pub(super) n_ver: usize,
    pub(super) tv: usize,
    /// The last `tvd` verify rows attend as decode queries (long contexts), in `tvd_groups` groups of
    /// at most `tvd_group_rows` consecutive rows of one chunk (attention::attn_verify_q).
    pub(super) tvd: usize,
    pub(super) tvd_groups: usize,
    pub(super) tvd_group_rows: usize,
    /// Rows `short_row0..short_row0 + short_rows` (the last prefill chunks': short chunks over a long
    /// context) attend as decode queries.
    pub(super) short_row0: usize,
    pub(super) short_rows: usize,
    /// As decode queries: those rows in `short_groups` groups of at most `short_group_rows` rows of one
    /// chunk (attention::attn_verify_q).
    pub(super) short_groups: usize,
    pub(super) short_group_rows: usize,
    /// With the prefill kernel split over the keys (the wide kernels): the short chunks' tiles (after
    /// the `n_tiles` others in the tile table) and the key splits of each.
    pub(super) short_tiles: usize,
    pub(super) short_splits: usize,
    pub(super) n_chunks: usize,
    pub(super) n_tiles: usize,
    pub(super) n_logits: usize,
    /// Pending-hidden stores (speculative decoding): entries of the index arrays.
    pub(super) n_pend: usize,
}

/// The order a step's chunks run in: prefill chunks (those attending as decode queries last), verify
/// chunks (short contexts, then long ones), decode chunks, each group in batch order.
struct StepOrder {
    order: Vec<usize>,
    /// Prefill chunks (the first `n_real`, of which the last `n_short` attend as decode queries),
    /// short-context verify chunks (`n_ver_pf`), multi-token chunks in all (`n_pre`: prefill and
    /// verify) and verify chunks (`n_ver`).
    n_real: usize,
    n_short: usize,
    n_ver_pf: usize,
    n_pre: usize,
    n_ver: usize,
}

/// A step's inputs built on the host, once per step: `rows` rows (graph padding included).
struct HostInputs<'b> {
    rows: usize,
    ids: Vec<i32>,
    pos: Vec<i32>,
    cu: Vec<i32>,
    lens: Vec<i32>,
    slots: Vec<i32>,
    /// Each row's block-table entries.
    table_rows: Vec<&'b [u32]>,
    /// The wanted rows' gather indices (`n_want` of them, then graph padding).
    last: Vec<i32>,
    n_want: usize,
    /// Speculative decoding: pending-hidden stores (rows, slots).
    pend: (Vec<i32>, Vec<i32>),
    chunk_table: Vec<i32>,
    tile_table: Vec<i32>,
    /// Snapshots inside the prefill chunks: the chunks cut there (the chunk table is of their segments).
    saves: Option<HostSaves>,
    /// The prefill chunks cut into pieces whose walks run beside the next pieces' prep (their tables take
    /// the chunk table's place).
    rounds: Option<gdn_overlap::Rounds>,
    /// Long-context verify rows: attention lengths and block-table rows, and their groups' row offsets.
    ver_lens: Vec<i32>,
    ver_tables: Vec<i32>,
    ver_groups: Vec<i32>,
    /// Short prefill chunks attending as decode queries: their rows' attention lengths, then their
    /// block-table rows, then their groups' row offsets (one upload); the first such row.
    short_rows: Vec<i32>,
    short_row0: usize,
    /// Rows of the short chunks (either way).
    short_count: usize,
    /// Tile-table entries of the short chunks (last in `tile_table`) and their key splits: 0 and 0 where
    /// they attend as decode queries.
    short_tiles: usize,
    short_splits: usize,
    /// Each row's (t, h, w) rotary position `[rows, 3]` (with the vision tower; else empty).
    rope: Vec<i32>,
    /// Rows of the multi-token group, of its verify chunks, of its long-context verify chunks.
    tp: usize,
    tv: usize,
    tvd: usize,
}

impl CudaBackend {
    /// Runs the step's chunks (validated) and appends the wanted logits rows.
    /// A step: its `pre` ops, its chunks (their wanted rows into `out`), its `post` ops.
    pub(super) fn step_to(&mut self, batch: &StepBatch, out: StepOut<'_>) -> Result<(), BackendError> {
        if batch.seqs.iter().any(|c| c.draft > 0) {
            return Err(BackendError::InvalidStep("speculative chunks need a draft picker".into()));
        }
        if self.launches.busy() {
            return Err(BackendError::InvalidStep("a launched step is not collected yet".into()));
        }
        // This step's picks (or its sampling) may overwrite the launched picks a feed would read.
        self.launches.last = None;
        self.rt.context().bind_to_thread().map_err(|e| BackendError::Device(e.to_string()))?;
        self.enqueue_step(batch, out)?;
        self.rt.synchronize().map_err(device_error)
    }

    /// Enqueues a step of plain chunks: its `pre` ops, its chunks (their wanted rows into `out`), its
    /// `post` ops. Returns without waiting.
    pub(super) fn enqueue_step(&mut self, batch: &StepBatch, out: StepOut<'_>) -> Result<(), BackendError> {
        for op in &batch.pre {
            self.apply(op)?;
        }
        if let Some(sp) = &mut self.spec {
            sp.verified.clear();
        }
        self.run_chunks(batch, &[], out)?;
        for op in &batch.post {
            self.apply(op)?;
        }
        Ok(())
    }

    /// `verify[i]`: chunk i is the verify pass of a speculative chunk (its token and drafts; missing
    /// entries: false). Its DeltaNet state is left as it was, every row's logits are returned, and it
    /// is recorded for [`Backend::commit_speculative`].
    pub(super) fn run_chunks(
        &mut self,
        batch: &StepBatch,
        verify: &[bool],
        out: StepOut<'_>,
    ) -> Result<(), BackendError> {
        self.prof_begin().map_err(device_error)?;
        let r = self.run_chunks_timed(batch, verify, out);
        let p = self.prof_end().map_err(device_error);
        r.and(p)
    }

    /// [`CudaBackend::run_chunks`] between the profiler's step marks.
    pub(super) fn run_chunks_timed(
        &mut self,
        batch: &StepBatch,
        verify: &[bool],
        out: StepOut<'_>,
    ) -> Result<(), BackendError> {
        self.phase(Mark::Entry).map_err(device_error)?;
        let inv = |m: String| Err(BackendError::InvalidStep(m));
        let chunks: Vec<usize> = (0..batch.seqs.len()).filter(|&i| !batch.seqs[i].tokens.is_empty()).collect();
        for c in &batch.seqs {
            if c.tokens.is_empty() && c.want_logits {
                return inv(format!("seq {}: logits wanted for an empty chunk", c.seq_id));
            }
        }
        if chunks.is_empty() {
            // A launched step of cache ops alone is collected too (no picks).
            if let StepOut::Launch(o) = out {
                self.launch_picks(0, o).map_err(device_error)?;
            }
            return Ok(());
        }
        let t = self.check_chunks(batch, &chunks)?;
        let ord = self.order_chunks(batch, verify, &chunks);
        let inp = self.host_inputs(batch, verify, &ord)?;
        let fills = self.image_fills(batch, &ord.order, &inp.cu)?;
        let images = !fills.is_empty();
        self.phase(Mark::Uploads).map_err(device_error)?;
        self.upload_step(batch, &ord, &inp, &out).map_err(device_error)?;
        let StepOrder { ref order, n_real, n_pre, n_ver, .. } = ord;
        let HostInputs { rows, tp, tv, tvd, .. } = inp;
        let (tvd_groups, tvd_group_rows) = group_shape(&inp.ver_groups);
        // (the short rows' lengths and table rows, then their groups' offsets, if any)
        let (short_groups, short_group_rows) = group_shape(inp.short_rows.get(2 * inp.short_count..).unwrap_or(&[]));
        let n = order.len();
        let shape = StepShape {
            t: t + (rows - n),
            n: rows,
            n_pre,
            tp,
            n_ver,
            tv,
            tvd,
            tvd_groups,
            tvd_group_rows,
            short_row0: inp.short_row0,
            short_rows: inp.short_count,
            short_groups,
            short_group_rows,
            short_tiles: inp.short_tiles,
            short_splits: inp.short_splits,
            n_chunks: inp.chunk_table.len() / 2,
            n_tiles: inp.tile_table.len() / 2 - inp.short_tiles,
            n_logits: inp.last.len(),
            n_pend: inp.pend.0.len(),
        };
        // Decode steps replay the graph of their bucket; steps of verify chunks (and decode rows) the
        // graph of their shape; steps with a prefill chunk run eagerly.
        // Steps with image rows (the tower runs in them) run eagerly.
        let key = if images {
            None
        } else if n_pre == 0 {
            Some(GraphKey::Decode(rows))
        } else if n_real == 0 {
            let lens = order[..n_pre].iter().map(|&i| batch.seqs[i].tokens.len()).collect();
            Some(GraphKey::Verify(n - n_pre, tvd, lens))
        } else {
            None
        };
        self.phase(Mark::Forward).map_err(device_error)?;
        self.set_image_fills(fills);
        match key {
            Some(key) => self.run_graphed(key, &|be: &Self| be.forward(&shape)).map_err(device_error)?,
            None => self.forward(&shape).map_err(device_error)?,
        }
        self.phase(Mark::Forwarded).map_err(device_error)?;
        self.retain_images(batch);
        self.record_verified(batch, &ord, &inp.cu, &inp.slots);
        self.step_outputs(inp.n_want, out)?;
        self.phase(Mark::Outputs).map_err(device_error)?;
        Ok(())
    }

    /// Checks the step's non-empty `chunks` against the plan (tokens, sequences, slots, pages, token
    /// ids); returns the step's tokens.
    fn check_chunks(&self, batch: &StepBatch, chunks: &[usize]) -> Result<usize, BackendError> {
        let inv = |m: String| Err(BackendError::InvalidStep(m));
        let t: usize = chunks.iter().map(|&i| batch.seqs[i].tokens.len()).sum();
        if t > self.max_tokens || chunks.len() > self.max_seqs {
            return inv(format!(
                "{t} tokens in {} chunks exceed the plan ({} tokens, {} sequences per step)",
                chunks.len(),
                self.max_tokens,
                self.max_seqs
            ));
        }
        self.check_saves(batch)?;
        let mut used_slots = std::collections::HashSet::new();
        for &i in chunks {
            let c = &batch.seqs[i];
            if c.slot as usize >= self.num_slots || !used_slots.insert(c.slot) {
                return inv(format!("seq {}: slot {} out of range or used twice in the step", c.seq_id, c.slot));
            }
            let end = c.start + c.tokens.len();
            // Without attention layers pages are never read: a sequence needs none.
            let need = if self.d.num_attention_layers > 0 { end.div_ceil(self.page_size) } else { 0 };
            if c.pages.len() < need || need > self.table_width {
                return inv(format!(
                    "seq {}: {} pages do not cover {end} positions (table width {})",
                    c.seq_id,
                    c.pages.len(),
                    self.table_width
                ));
            }
            if c.pages[..need].iter().any(|&p| p as usize >= self.num_pages) {
                return inv(format!("seq {}: page id out of range ({} pages)", c.seq_id, self.num_pages));
            }
            if let Some(&id) = c.tokens.iter().find(|&&id| id as usize >= self.full_vocab()) {
                return inv(format!("seq {}: token id {id} outside the vocabulary", c.seq_id));
            }
        }
        Ok(t)
    }

    /// The order the step's non-empty `chunks` run in (`verify[i]`: chunk i is a verify chunk).
    fn order_chunks(&self, batch: &StepBatch, verify: &[bool], chunks: &[usize]) -> StepOrder {
        let is_ver = |i: usize| verify.get(i).copied().unwrap_or(false);
        // Prefill chunks (> 1 token) first, then verify chunks, then decode chunks, each group in batch
        // order.
        let multi = |i: &usize| batch.seqs[*i].tokens.len() > 1;
        let prefill = chunks.iter().copied().filter(|i| multi(i) && !is_ver(*i));
        // Short prefill chunks over a long context take the short-chunk attention (the prefill kernel
        // split over the keys, or their rows as decode queries): after the other prefill chunks, as
        // many rows as the scratch holds.
        let from = self.opts.short_chunk_decode_attention_from;
        let (limit, mut room) = self.short_chunk_bounds();
        let (mut order, mut short) = (Vec::new(), Vec::new());
        for i in prefill {
            let c = &batch.seqs[i];
            if c.tokens.len() <= limit && c.start >= from && c.tokens.len() <= room {
                room -= c.tokens.len();
                short.push(i);
            } else {
                order.push(i);
            }
        }
        let n_short = short.len();
        order.extend(short);
        let n_real = order.len();
        // Verify chunks: those over a short context attend with the prefill kernel, the others (last)
        // as decode queries, split-K over their long context.
        let from = self.opts.verify_decode_attention_from;
        let long_ctx = |i: &usize| batch.seqs[*i].start >= from;
        order.extend(chunks.iter().copied().filter(|i| is_ver(*i) && !long_ctx(i)));
        let n_ver_pf = order.len() - n_real;
        order.extend(chunks.iter().copied().filter(|i| is_ver(*i) && long_ctx(i)));
        let n_pre = order.len();
        let n_ver = n_pre - n_real;
        order.extend(chunks.iter().copied().filter(|i| !multi(i) && !is_ver(*i)));
        StepOrder { order, n_real, n_short, n_ver_pf, n_pre, n_ver }
    }

    /// The step's inputs on the host, in the order `ord` (with graph padding rows), its wanted rows,
    /// pending-hidden stores and varlen tables.
    fn host_inputs<'b>(
        &self,
        batch: &'b StepBatch,
        verify: &[bool],
        ord: &StepOrder,
    ) -> Result<HostInputs<'b>, BackendError> {
        let is_ver = |i: usize| verify.get(i).copied().unwrap_or(false);
        let StepOrder { ref order, n_real, n_short, n_ver_pf, n_pre, .. } = *ord;
        let n = order.len();
        // Decode steps replay the graph of their batch size. With graph_pad the
        // rows past n are padding: token 0 at position −1 (no KV write), state slot −1 (no state
        // update), one key of the page its table row starts with (put_table_row), logits computed and not returned.
        // Steps with image rows run eagerly (the tower runs in them).
        let images = batch.seqs.iter().any(|c| !c.images.is_empty());
        let graph = self.opts.cuda_graphs && n_pre == 0 && self.prof.borrow().is_none() && !images;
        let rows = if graph { self.graph_bucket(n) } else { n };
        let (mut ids, mut pos, mut cu, mut lens, mut slots) =
            (Vec::with_capacity(rows), Vec::with_capacity(rows), vec![0i32], Vec::new(), Vec::new());
        let mut table_rows: Vec<&[u32]> = Vec::with_capacity(n);
        let mut row_of = vec![0usize; batch.seqs.len()];
        for (r, &i) in order.iter().enumerate() {
            let c = &batch.seqs[i];
            ids.extend(c.tokens.iter().map(|&x| x as i32));
            pos.extend((c.start..c.start + c.tokens.len()).map(|p| p as i32));
            let end = c.start + c.tokens.len();
            cu.push(cu[r] + c.tokens.len() as i32);
            lens.push(end as i32);
            slots.push(c.slot as i32);
            let need = if self.d.num_attention_layers > 0 { end.div_ceil(self.page_size) } else { 0 };
            table_rows.push(&c.pages[..need]);
            row_of[i] = cu[r + 1] as usize - 1;
        }
        for _ in n..rows {
            ids.push(0);
            pos.push(-1);
            cu.push(cu[cu.len() - 1] + 1);
            lens.push(1);
            slots.push(-1);
        }
        // A tensor-parallel rank embeds the ids of its vocabulary shard (−1: a row of zeros, the
        // all-reduce after the embedding sums the ranks' rows).
        if let Some(r) = &self.tp {
            let v = &r.spec.vocab;
            for id in &mut ids {
                *id = if v.contains(&(*id as usize)) { *id - v.start as i32 } else { -1 };
            }
        }
        let tp = cu[n_pre] as usize;
        let tv = tp - cu[n_real] as usize;
        // Wanted rows in batch order: a verify chunk's every row (and an all-logits chunk's), another
        // chunk's last.
        let mut last: Vec<i32> = Vec::new();
        for (i, c) in batch.seqs.iter().enumerate() {
            if is_ver(i) || c.all_logits {
                let n = c.tokens.len() as i32;
                last.extend(row_of[i] as i32 + 1 - n..=row_of[i] as i32);
            } else if c.want_logits {
                last.push(row_of[i] as i32);
            }
        }
        let n_want = last.len();
        if graph {
            last.resize(rows, 0);
        }
        // Speculative decoding: each plain chunk's last row becomes its slot's pending hidden (graph
        // padding rows: none).
        let mut pend: (Vec<i32>, Vec<i32>) = (Vec::new(), Vec::new());
        if self.spec.is_some() {
            for (r, &i) in order.iter().enumerate() {
                if !is_ver(i) {
                    pend.0.push(cu[r + 1] - 1);
                    pend.1.push(slots[r]);
                }
            }
            pend.0.resize(pend.0.len() + rows - n, -1);
            pend.1.resize(pend.1.len() + rows - n, -1);
        }
        let saves = HostSaves::new(batch, order, n_real, &cu, &slots);
        let chunk_table = gdn_chunk::chunk_table(saves.as_ref().map_or(&cu[..=n_real], |s| &s.segments.cu));
        let rounds = self.gdn_rounds(saves.is_none(), &cu[..=n_real], &slots[..n_real]);
        // Prefill attention covers the prefill chunks and the short-context verify chunks; the other
        // verify rows run as decode queries.
        // Short chunks over a long context: their tiles last, for the prefill kernel split over the keys
        // (the wide kernels), else none (their rows attend as decode queries).
        let short_seqs = (n_real - n_short) as i32..n_real as i32;
        let all_tiles = attention::tile_table(&self.k, &cu[..=n_real + n_ver_pf]);
        let is_short = |e: &&[i32]| short_seqs.contains(&e[0]);
        let mut tile_table: Vec<i32> = all_tiles.chunks_exact(2).filter(|e| !is_short(e)).flatten().copied().collect();
        let (mut short_tiles, mut short_splits) = (0, 0);
        let split = self.short_chunks_split();
        let short_row0 = cu[n_real - n_short] as usize;
        let short_count = (cu[n_real] - cu[n_real - n_short]) as usize;
        if n_short > 0 && split {
            let before = tile_table.len();
            tile_table.extend(all_tiles.chunks_exact(2).filter(is_short).flatten().copied());
            short_tiles = (tile_table.len() - before) / 2;
            let ends =
                order[n_real - n_short..n_real].iter().map(|&i| batch.seqs[i].start + batch.seqs[i].tokens.len());
            short_splits = self.short_prefill_splits(short_tiles, short_count, ends.max().unwrap_or(0));
        }
        let tvd = tp - cu[n_real + n_ver_pf] as usize;
        let (ver_lens, ver_tables) = decode_query_rows(batch, order, n_real + n_ver_pf..n_pre);
        let group_rows = self.row_group_rows();
        let ver_groups = row_groups(batch, order, n_real + n_ver_pf..n_pre, group_rows);
        let rope = self.rope_rows(batch, order, rows);
        // Rows attending as decode queries: their lengths and block-table rows.
        let mut short_rows = Vec::new();
        if !split {
            let (lens, tables) = decode_query_rows(batch, order, n_real - n_short..n_real);
            let groups = row_groups(batch, order, n_real - n_short..n_real, group_rows);
            short_rows.extend(lens.into_iter().chain(tables).chain(groups));
        }
        if chunk_table.len() * 4 > self.ws.chunk_table.bytes
            || tile_table.len() * 4 > self.ws.tile_table.bytes
            || short_rows.len() * 4 > self.ws.decode_rows.bytes
        {
            return Err(BackendError::Device("varlen tables exceed the scratch region".into()));
        }
        Ok(HostInputs {
            rows,
            ids,
            pos,
            cu,
            lens,
            slots,
            table_rows,
            last,
            n_want,
            pend,
            chunk_table,
            tile_table,
            saves,
            rounds,
            ver_lens,
            ver_tables,
            ver_groups,
            short_rows,
            short_row0,
            short_count,
            short_tiles,
            short_splits,
            rope,
            tp,
            tv,
            tvd,
        })
    }

    /// Uploads the step's inputs (one copy of the block, the changed block-table entries, the varlen
    /// tables, speculative decoding's index arrays, the host embedding rows or a fed step's rows) and
    /// zeroes the state of chunks starting at position 0.
    fn upload_step(
        &self,
        batch: &StepBatch,
        ord: &StepOrder,
        inp: &HostInputs<'_>,
        out: &StepOut<'_>,
    ) -> Result<(), CudaError> {
        let ws = &self.ws;
        self.upload_inputs([&inp.ids, &inp.pos, &inp.cu, &inp.lens, &inp.slots, &inp.last])?;
        for (r, pages) in inp.table_rows.iter().enumerate() {
            self.put_table_row(r, pages)?;
        }
        if ws.rope_pos != 0 {
            self.upload_i32(ws.rope_pos, &inp.rope)?;
        }
        match &inp.rounds {
            Some(r) => self.upload_i32(ws.chunk_table.ptr, &r.image())?,
            None => self.upload_i32(ws.chunk_table.ptr, &inp.chunk_table)?,
        }
        *self.rounds.borrow_mut() = inp.rounds.as_ref().map_or(Vec::new(), |r| r.on_device(ws.chunk_table.ptr));
        self.upload_i32(ws.tile_table.ptr, &inp.tile_table)?;
        self.upload_i32(ws.decode_rows.ptr, &inp.short_rows)?;
        self.set_saves(inp.saves.as_ref())?;
        if let Some(sp) = &self.spec {
            self.upload_i32(sp.idx_at(0), &inp.pend.0)?;
            self.upload_i32(sp.idx_at(1), &inp.pend.1)?;
            self.upload_i32(sp.idx_at(7), &inp.ver_lens)?;
            self.upload_i32(sp.idx_at(8), &inp.ver_tables)?;
            self.upload_i32(sp.idx_at(9), &inp.ver_groups)?;
        }
        match (out, &self.host_embed) {
            // A fed step's rows come from the device (feed_rows, below).
            (StepOut::Launch(LaunchOut { feed: Some(_), .. }), _) | (_, None) => {}
            // Longer steps gather on the GPU from the mapped table (forward).
            (_, Some(he)) if inp.ids.len() < HOST_EMBED_GPU_ROWS => self.upload_host_embedding(he, &inp.ids)?,
            (_, Some(_)) => {}
        }
        if let StepOut::Launch(LaunchOut { feed: Some(f), valid, .. }) = out {
            self.feed_inputs(f, *valid)?;
        }
        // A chunk starting at position 0 begins from a zeroed state.
        for &i in &ord.order {
            let c = &batch.seqs[i];
            if c.start == 0 {
                for (sa, _, len) in self.state_parts(Some(c.slot), SnapshotLoc::Device(0)) {
                    self.rt.memset(sa, 0, len)?;
                }
            }
        }
        Ok(())
    }

    /// Speculative decoding: records the step's verify group (its rows, slots and chunks) for the commit.
    fn record_verified(&mut self, batch: &StepBatch, ord: &StepOrder, cu: &[i32], slots: &[i32]) {
        let StepOrder { ref order, n_real, n_pre, .. } = *ord;
        if let Some(sp) = &mut self.spec {
            let base = cu[n_real];
            sp.verify_cu = cu[n_real..=n_pre].iter().map(|&x| x - base).collect();
            sp.verify_slots = slots[n_real..n_pre].to_vec();
            sp.verified = order[n_real..n_pre]
                .iter()
                .enumerate()
                .map(|(j, &i)| {
                    let c = &batch.seqs[i];
                    let row0 = sp.verify_cu[j] as usize;
                    Verified { seq_id: c.seq_id, slot: c.slot, start: c.start, n: c.tokens.len(), row0 }
                })
                .collect();
        }
    }

    /// Hands back the step's `n_want` wanted rows as `out` asks: logits, argmax or sampled ids, or (a
    /// launched step) the device picks' copy.
    fn step_outputs(&mut self, n_want: usize, out: StepOut<'_>) -> Result<(), BackendError> {
        if let StepOut::Launch(o) = out {
            self.launch_picks(n_want, o).map_err(device_error)?;
        } else if n_want > 0 {
            let v = self.d.vocab;
            match out {
                StepOut::Logits(logits) => {
                    // Straight into the caller's (pageable) memory: the driver stages it. Through a pinned buffer
                    // and a host copy was no faster at batch 1 and up to 0.4 ms slower at batch 8 (measured on an H200).
                    let at = logits.len();
                    logits.resize(at + n_want * v, 0.0);
                    self.rt.download(&mut logits[at..], self.logits.ptr).map_err(device_error)?;
                }
                StepOut::Argmax { valid, tokens } => {
                    // The ids land in `last_idx` (the step's gather indices, read by the forward only).
                    tokens.extend(self.logits_argmax(n_want, valid, self.ws.last_idx).map_err(device_error)?);
                }
                StepOut::Sample { valid, rows, tokens } => {
                    tokens.extend(self.logits_sample(valid, rows).map_err(device_error)?);
                }
                StepOut::Launch(_) => {}
            }
        }
        Ok(())
    }

    /// The argmax over ids `< valid` of each of the first `rows` rows of the logits region, picked on the
    /// device into the i32 array at `ids` (4 bytes a row come back).
    pub(super) fn logits_argmax(&self, rows: usize, valid: usize, ids: u64) -> Result<Vec<u32>, CudaError> {
        let v = self.d.vocab;
        ops::argmax::argmax_rows(&self.k, self.rt.stream(), self.logits.ptr, v, valid.min(v), rows, ids)?;
        let mut got = vec![0i32; rows];
        self.rt.download(&mut got, ids)?;
        Ok(got.into_iter().map(|t| t as u32).collect())
    }

    /// The token of each of the first `rows` rows of the logits region picked by its [`RowSampling`]
    /// over ids `< valid` on the device: token masks and penalties applied in place, then greedy or the
    /// draw. Rows whose
    /// sorted bin holds more ids than the scratch's candidates, and steps with more presence / frequency
    /// entries than the scratch holds, are picked on the host from their (penalised) logits.
    pub(super) fn logits_sample(&self, valid: usize, rows: &[RowSampling]) -> Result<Vec<u32>, CudaError> {
        let (v, n) = (self.d.vocab, rows.len());
        let valid = valid.min(v);
        let (sc, base) = (&self.ws.sampling_layout, self.ws.sampling);
        let e = ops::sample::encode(rows, valid, sc.penalty_words);
        if !ops::sample::penalties_fit(e.pens.len(), n) {
            return self.pick_on_host(valid, rows);
        }
        let s = self.rt.stream();
        ops::sample::sample_rows(&self.k, s, sc, base, self.logits.ptr, v, valid, n, &e)?;
        let mut got = vec![[0i32; 2]; n];
        self.rt.download(&mut got, base + sc.out)?;
        let mut tokens: Vec<u32> = got.iter().map(|&[t, _]| t as u32).collect();
        // Rows the device could not cut: the host's rule over their penalised logits.
        let left: Vec<usize> =
            (0..n).filter(|&r| got[r][1] != 0 || got[r][0] < 0 || got[r][0] as usize >= valid).collect();
        if !left.is_empty() {
            let mut logits = vec![0f32; left.len() * v];
            for (row, &r) in logits.chunks_exact_mut(v).zip(&left) {
                self.rt.download(row, self.logits.ptr + (4 * r * v) as u64)?;
            }
            let picks: Vec<RowSampling> = left.iter().map(|&r| rows[r].clone()).collect();
            for (&r, t) in left.iter().zip(pick_rows(&mut logits, v, valid, &picks, true)) {
                tokens[r] = t;
            }
        }
        Ok(tokens)
    }

    /// The first `rows.len()` logits rows downloaded and picked on the host by their rules (penalties
    /// included): for steps whose penalty entries exceed the sampling scratch.
    pub(super) fn pick_on_host(&self, valid: usize, rows: &[RowSampling]) -> Result<Vec<u32>, CudaError> {
        let v = self.d.vocab;
        let mut logits = vec![0f32; rows.len() * v];
        self.rt.download(&mut logits, self.logits.ptr)?;
        Ok(pick_rows(&mut logits, v, valid, rows, false))
    }
}

/// Rows of the chunks `order[range]` attending as decode queries: each row's causal attention length and
/// its chunk's block-table row (the chunk's place in `order`).
/// Row offsets of groups of at most `max_rows` consecutive rows of one chunk over the chunks `range` of
/// `order` (rows counted from the range's first): `[groups + 1]`; none with `max_rows` 0 (no groups).
fn row_groups(batch: &StepBatch, order: &[usize], range: std::ops::Range<usize>, max_rows: usize) -> Vec<i32> {
    if max_rows == 0 {
        return Vec::new();
    }
    let mut starts = vec![0i32];
    let mut at = 0;
    for r in range {
        let n = batch.seqs[order[r]].tokens.len();
        for k in (0..n).step_by(max_rows) {
            at += (n - k).min(max_rows) as i32;
            starts.push(at);
        }
    }
    starts
}

/// (groups, the most rows of one) of the row offsets `starts` ([`row_groups`]).
fn group_shape(starts: &[i32]) -> (usize, usize) {
    let rows = starts.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
    (starts.len().saturating_sub(1), rows)
}

fn decode_query_rows(batch: &StepBatch, order: &[usize], range: std::ops::Range<usize>) -> (Vec<i32>, Vec<i32>) {
    let (mut lens, mut tables) = (Vec::new(), Vec::new());
    for r in range {
        let c = &batch.seqs[order[r]];
        lens.extend((1..=c.tokens.len()).map(|j| (c.start + j) as i32));
        tables.extend(std::iter::repeat_n(r as i32, c.tokens.len()));
    }
    (lens, tables)
}
