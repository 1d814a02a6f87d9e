//! A request's tokens on their way out: streamed with their text and logprobs under the stop rules,
//! and the end of the request with its usage and timing.

use std::time::{Duration, Instant};

use deltaserve_sched::SeqId;

use super::*;

impl Worker {
    /// Counts a step of `step_seconds` that ran `seqs` against the requests still in their prompt, and
    /// tells those that asked for it how far their prompt has come ([`Event::Prefill`]).
    pub(super) fn prompt_steps(&mut self, seqs: &[SeqChunk], step_seconds: f64) {
        for c in seqs {
            let Some(live) = self.reqs.get_mut(&c.seq_id) else { continue };
            if live.first_token.is_some() {
                continue;
            }
            live.prefill_steps += 1;
            live.prefill_step_s += step_seconds;
            if c.draft > 0 {
                continue;
            }
            let (processed, total) = ((c.start + c.tokens.len()).min(live.req.prompt.len()), live.req.prompt.len());
            let elapsed = live.admitted.map_or(Duration::ZERO, |a| a.elapsed());
            if live.req.progress {
                let event = Event::Prefill {
                    processed,
                    total,
                    cached: self.sched.cached_prefix(c.seq_id),
                    elapsed_ms: elapsed.as_secs_f64() * 1e3,
                };
                let _ = live.tx.send(event);
            }
            let since = live.progress_logged.or(live.admitted).map_or(Duration::ZERO, |t| t.elapsed());
            if since >= PROGRESS_LOG_EVERY && processed < total {
                live.progress_logged = Some(Instant::now());
                let done = 100.0 * processed as f64 / total.max(1) as f64;
                tracing::info!(
                    id = c.seq_id,
                    processed,
                    total,
                    "prompt {done:.1}% after {:.1} s ({} steps)",
                    elapsed.as_secs_f64(),
                    live.prefill_steps
                );
            }
        }
    }

    /// Streams a chosen token of `id` (with its logprobs from the `raw` row) and applies the stop rules.
    pub(super) fn emit(&mut self, id: SeqId, token: u32, raw: Option<Vec<f32>>) -> Emit {
        let Some(live) = self.reqs.get_mut(&id) else { return Emit::Gone };
        let logprob = raw.zip(live.req.logprobs).map(|(raw, k)| token_logprob(&raw, self.valid_vocab, token, k));
        // Stop strings end the reply only once `min_tokens` are out (as in vLLM): before, the text passes.
        let stops_armed = !live.sampler.below_min_tokens();
        live.sampler.observe(token);
        if let Some(c) = &live.req.constraint {
            c.with(|c| c.accept(token));
        }
        live.generated += 1;
        live.first_token.get_or_insert_with(Instant::now);
        let at_length = self.sched.append_token(id, token);
        let mut text = String::new();
        let mut reason = None;
        if let Some(tok) = &self.tokenizer {
            match live.decoder.push(tok, token) {
                Ok(piece) if !stops_armed => text = piece,
                Ok(piece) => {
                    let out = live.stops.push(&piece);
                    text = out.emit;
                    if let Some(s) = out.stopped {
                        reason = Some(FinishReason::StopString(s));
                    }
                }
                Err(e) => tracing::warn!(error = %e, "detokenisation failed"),
            }
        }
        if reason.is_none() && live.req.stop_token_ids.contains(&token) {
            reason = Some(FinishReason::Stop);
        }
        if reason.is_none() && at_length {
            reason = Some(FinishReason::Length);
        }
        if let Some(r) = &reason
            && !matches!(r, FinishReason::StopString(_))
            && let Some(tok) = &self.tokenizer
        {
            // Flush what the decoder and the stop matcher held back.
            let tail = live.decoder.finish(tok).unwrap_or_default();
            let out = live.stops.push(&tail);
            text.push_str(&out.emit);
            match out.stopped {
                Some(s) => reason = Some(FinishReason::StopString(s)),
                None => text.push_str(&live.stops.flush()),
            }
        }
        if let Some(FinishReason::StopString(s)) = &reason
            && live.req.include_stop_str
        {
            text.push_str(s);
        }
        if live.tx.send(Event::Token { id: token, text, logprob }).is_err() {
            self.cancel(id);
            return Emit::Gone;
        }
        match reason {
            Some(r) => Emit::Finish(r),
            None => Emit::Continue,
        }
    }

    /// Ends request `id` with `reason`: its sequence leaves the scheduler, its usage and timing go to
    /// the client and the engine's counters.
    pub(super) fn finish(&mut self, id: SeqId, reason: FinishReason) {
        let Some(live) = self.reqs.remove(&id) else { return };
        let cached_tokens = self.sched.cached_prefix(id);
        self.sched.finish(id);
        let now = Instant::now();
        let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1e3;
        let first = live.first_token.unwrap_or(now);
        let decode_s = now.duration_since(first).as_secs_f64();
        let timing = Timing {
            queue_ms: live.admitted.map_or(0.0, |a| ms(live.submitted, a)),
            ttft_ms: ms(live.submitted, first),
            total_ms: ms(live.submitted, now),
            decode_tokens_per_s: if decode_s > 0.0 { (live.generated - 1) as f64 / decode_s } else { 0.0 },
            preemptions: live.preemptions,
            prefill_steps: live.prefill_steps,
            prefill_step_ms: live.prefill_step_s * 1e3,
            draft_tokens: live.drafted,
            accepted_tokens: live.accepted,
        };
        let usage = Usage { prompt_tokens: live.req.prompt.len(), completion_tokens: live.generated, cached_tokens };
        tracing::debug!(
            id,
            prompt = usage.prompt_tokens,
            cached = cached_tokens,
            generated = usage.completion_tokens,
            queue_ms = format!("{:.1}", timing.queue_ms),
            ttft_ms = format!("{:.1}", timing.ttft_ms),
            prefill_steps = timing.prefill_steps,
            prefill_step_ms = format!("{:.1}", timing.prefill_step_ms),
            total_ms = format!("{:.1}", timing.total_ms),
            "request finished"
        );
        if let Ok(mut s) = self.shared.stats.lock() {
            s.requests_finished += 1;
            s.prompt_tokens += if live.forked { 0 } else { usage.prompt_tokens as u64 };
            s.generated_tokens += usage.completion_tokens as u64;
        }
        let _ = live.tx.send(Event::Finished { reason, usage, timing });
    }
}
