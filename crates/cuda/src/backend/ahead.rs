//! Launched steps on the CUDA backend ([`Backend::launch`] / [`Backend::collect`]): a step's picks are
//! made on the device into the sampling scratch's `out` (where the next launched step's `feed_rows`
//! reads them), copied into one of two pinned slots and marked by that slot's event; `collect` waits for
//! the event. Rows the device sampler leaves to the host have their logits copied to a pinned stash, as
//! a later step overwrites the logits region before they are collected.

use std::collections::VecDeque;

use deltaserve_backend::ahead::FEED_STOPS;

use super::*;

/// The pinned slots, their events and the launched steps not collected yet.
pub(super) struct Launches {
    /// `[2, max_seqs]` × 8 B: each slot's picks (i32 ids, or (token, flag) pairs).
    picks: PinnedHost,
    /// `[2, max_seqs, vocab]` f32: each slot's rows left to the host.
    stash: PinnedHost,
    done: [cudarc::driver::CudaEvent; 2],
    queue: VecDeque<Pending>,
    /// The slot of the next launch.
    next: usize,
    /// The last launched step's picks in the scratch's `out`: (stride, rows). None when a step run since
    /// (or an error) may have overwritten them.
    pub(super) last: Option<(usize, usize)>,
    /// A step launched with [`Pick::Later`] whose picks are not made yet: (wanted rows, valid).
    pub(super) unpicked: Option<(usize, usize)>,
}

/// A launched step not collected yet.
struct Pending {
    slot: usize,
    rows: usize,
    /// 1: argmax ids; 2: (token, flag) pairs.
    stride: usize,
    valid: usize,
    /// Sampling steps: each row's rule (for rows picked on the host from the stash).
    sampling: Vec<RowSampling>,
    /// Picks already on the host (a step the device could not pick for).
    ready: Option<Picked>,
}

impl Launches {
    pub(super) fn new(rt: &Runtime, max_seqs: usize, vocab: usize) -> Result<Self, CudaError> {
        let event = || rt.context().new_event(None).map_err(CudaError::driver("cuEventCreate"));
        Ok(Launches {
            picks: PinnedHost::new(rt, 2 * max_seqs * 8)?,
            stash: PinnedHost::new(rt, 2 * max_seqs * vocab * 4)?,
            done: [event()?, event()?],
            queue: VecDeque::new(),
            next: 0,
            last: None,
            unpicked: None,
        })
    }

    pub(super) fn pinned(&self) -> [&PinnedHost; 2] {
        [&self.picks, &self.stash]
    }

    pub(super) fn busy(&self) -> bool {
        !self.queue.is_empty()
    }

    pub(super) fn queue_len(&self) -> usize {
        self.queue.len()
    }
}

/// How a launched step's picks are made (`StepOut::Launch`).
pub(super) struct LaunchOut<'a> {
    pub(super) valid: usize,
    pub(super) pick: Pick<'a>,
    pub(super) feed: Option<&'a Feed>,
}

impl CudaBackend {
    /// Whether steps launch ahead: not under tensor parallelism (rows are picked on the host) nor with
    /// speculative decoding.
    pub(super) fn launches_ahead(&self) -> bool {
        self.tp.is_none() && self.spec.is_none()
    }

    /// Before the forward of a fed step (rows in batch order): uploads the feed and runs `feed_rows`.
    pub(super) fn feed_inputs(&self, feed: &Feed, valid: usize) -> Result<(), CudaError> {
        let Some((stride, _)) = self.launches.last else {
            return Err(CudaError::Plan("no launched step's picks to feed from".into()));
        };
        let rows = feed.from.len();
        let mut words: Vec<i32> = feed.from.iter().map(|&f| f as i32).collect();
        for stops in &feed.stops {
            words.extend(stops.iter().map(|&t| t as i32));
            words.extend(std::iter::repeat_n(-1, FEED_STOPS - stops.len()));
        }
        let (sc, base) = (&self.ws.sampling_layout, self.ws.sampling);
        // The penalties' region: the previous step's sampling has read it (stream order), this step's
        // sampling uploads its own after the feed.
        self.upload_i32(base + sc.penalties, &words)?;
        let ws = &self.ws;
        let to = ops::feed::FeedTargets {
            token_ids: ws.token_ids,
            positions: ws.positions,
            slots: ws.slots,
            seq_lens: ws.seq_lens,
            table: self.host_embed.as_ref().map_or(0, |_| self.embed_table()),
            residual: ws.residual,
            hidden: self.d.hidden,
        };
        let s = self.rt.stream();
        ops::feed::feed_rows(&self.k, s, base + sc.out, stride, base + sc.penalties, rows, FEED_STOPS, valid, &to)
    }

    /// After the forward of a launched step: picks its `rows` wanted rows into the scratch's `out`, copies
    /// them (and the stash of rows left to the host) to the next pinned slot and records its event.
    pub(super) fn launch_picks(&mut self, rows: usize, o: LaunchOut<'_>) -> Result<(), CudaError> {
        let (v, valid) = (self.d.vocab, o.valid.min(self.d.vocab));
        let (sc, base) = (self.ws.sampling_layout, self.ws.sampling);
        let slot = self.launches.next;
        let s = self.rt.stream().clone();
        let mut pending = Pending { slot, rows, stride: 1, valid, sampling: Vec::new(), ready: None };
        match o.pick {
            Pick::Argmax => {
                ops::argmax::argmax_rows(&self.k, &s, self.logits.ptr, v, valid, rows, base + sc.out)?;
            }
            Pick::Sample(rs) => {
                pending.stride = 2;
                let e = ops::sample::encode(rs, valid, sc.penalty_words);
                if ops::sample::penalties_fit(e.pens.len(), rows) {
                    ops::sample::sample_rows(&self.k, &s, &sc, base, self.logits.ptr, v, valid, rows, &e)?;
                    let stash = self.launches.stash.ptr() as u64 + (slot * self.max_seqs * v * 4) as u64;
                    ops::sample::stash_host_rows(&self.k, &s, &sc, base, self.logits.ptr, v, valid, rows, stash)?;
                    pending.sampling = rs.to_vec();
                } else {
                    // Too many penalty entries for the scratch: picked on the host now; flagged in `out`
                    // so that a fed row does not run.
                    let tokens = self.pick_on_host(valid, rs)?;
                    let flagged: Vec<[i32; 2]> = tokens.iter().map(|&t| [t as i32, 1]).collect();
                    self.upload_i32(base + sc.out, flagged.as_flattened())?;
                    pending.ready = Some(Picked { tokens, on_device: vec![false; rows] });
                }
            }
            Pick::Later => {
                // The forward is queued; its logits wait in the logits region for `pick_launched`.
                self.launches.unpicked = Some((rows, o.valid));
                self.launches.last = None;
                return Ok(());
            }
        }
        let bytes = rows * 4 * pending.stride;
        if bytes > 0 {
            // SAFETY: slot `slot` of the pinned picks holds max_seqs × 8 bytes >= bytes (rows <= max_seqs,
            // checked by run_chunks); it is not read before the event below fires, nor written again
            // before it is collected (at most two launches are pending, one per slot).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(self.launches.picks.ptr().add(slot * self.max_seqs * 8), bytes)
            };
            unsafe { result::memcpy_dtoh_async(dst, base + sc.out, s.cu_stream()) }
                .map_err(CudaError::driver("cuMemcpyDtoHAsync"))?;
        }
        self.launches.done[slot].record(&s).map_err(CudaError::driver("cuEventRecord"))?;
        self.launches.next = 1 - slot;
        self.launches.last = Some((pending.stride, rows));
        self.launches.queue.push_back(pending);
        Ok(())
    }

    /// Waits for the oldest launched step and appends its picks.
    pub(super) fn collect_picks(&mut self, out: &mut Picked) -> Result<(), BackendError> {
        let Some(p) = self.launches.queue.pop_front() else {
            return Err(BackendError::InvalidStep("no launched step to collect".into()));
        };
        if let Some(r) = p.ready {
            out.tokens.extend(r.tokens);
            out.on_device.extend(r.on_device);
            return Ok(());
        }
        self.launches.done[p.slot]
            .synchronize()
            .map_err(CudaError::driver("cuEventSynchronize"))
            .map_err(device_error)?;
        let v = self.d.vocab;
        // SAFETY: the slot's copy has completed (its event); it holds `rows` entries of `stride` i32.
        let got = unsafe {
            std::slice::from_raw_parts(
                self.launches.picks.ptr().add(p.slot * self.max_seqs * 8) as *const i32,
                p.rows * p.stride,
            )
        };
        for r in 0..p.rows {
            let t = got[r * p.stride];
            let flag = if p.stride == 2 { got[r * p.stride + 1] } else { 0 };
            let on_device = flag == 0 && t >= 0 && (t as usize) < p.valid;
            let token = if on_device {
                t as u32
            } else {
                let Some(rule) = p.sampling.get(r) else {
                    return Err(BackendError::Device(format!("the device picked no token for row {r}")));
                };
                // SAFETY: the stash's slot holds max_seqs rows of v f32; row r < rows <= max_seqs was
                // copied before the event fired.
                let row = unsafe {
                    std::slice::from_raw_parts_mut(
                        (self.launches.stash.ptr() as *mut f32).add((p.slot * self.max_seqs + r) * v),
                        v,
                    )
                };
                pick_rows(row, v, p.valid, std::slice::from_ref(rule), true)[0]
            };
            out.tokens.push(token);
            out.on_device.push(on_device);
        }
        Ok(())
    }

    /// Forgets every launched step (after an error): waits for the stream, so no copy into a slot is in
    /// flight.
    pub(super) fn abandon_launches(&mut self) {
        let _ = self.rt.synchronize();
        self.launches.queue.clear();
        self.launches.last = None;
        self.launches.unpicked = None;
    }
}
