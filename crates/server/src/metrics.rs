//! Prometheus metrics in the text exposition format: request counters by endpoint and status, token
//! counters, TTFT / inter-token / end-to-end latency histograms and a finished request's phases (queue,
//! prefill, decode), the engine's compute of prompt steps, and gauges read from the engine at
//! scrape time (queue depth, running requests, KV pages, state slots, arena counters, speculative
//! decoding: drafted / accepted tokens, acceptance rate, tokens per step).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use deltaserve_engine::{EngineStats, Timing};
use deltaserve_text::PromptCacheStats;

/// Upper bounds (seconds) of the latency histograms.
const LATENCY_BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

#[derive(Default)]
struct Histogram {
    counts: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (c, b) in self.counts.iter_mut().zip(LATENCY_BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }
    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(LATENCY_BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

#[derive(Default)]
struct Inner {
    requests: BTreeMap<(String, u16), u64>,
    prompt_tokens: u64,
    generation_tokens: u64,
    cached_tokens: u64,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    prefill: Histogram,
    decode: Histogram,
    prefill_steps: u64,
    prefill_step_seconds: f64,
}

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.inner.lock() {
            *m.requests.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
    }
    pub fn tokens(&self, prompt: usize, generated: usize, cached: usize) {
        if let Ok(mut m) = self.inner.lock() {
            m.prompt_tokens += prompt as u64;
            m.generation_tokens += generated as u64;
            m.cached_tokens += cached as u64;
        }
    }
    pub fn ttft(&self, seconds: f64) {
        if let Ok(mut m) = self.inner.lock() {
            m.ttft.observe(seconds);
        }
    }
    pub fn inter_token(&self, seconds: f64) {
        if let Ok(mut m) = self.inner.lock() {
            m.itl.observe(seconds);
        }
    }
    /// A finished request's latency and its phases: queue (arrival → admission), prefill (admission → first
    /// token, with the engine steps that ran its prompt) and decode (first token → finish).
    pub fn finished(&self, t: &Timing) {
        if let Ok(mut m) = self.inner.lock() {
            m.e2e.observe(t.total_ms / 1e3);
            m.queue.observe(t.queue_ms / 1e3);
            m.prefill.observe((t.ttft_ms - t.queue_ms).max(0.0) / 1e3);
            m.decode.observe((t.total_ms - t.ttft_ms).max(0.0) / 1e3);
            m.prefill_steps += u64::from(t.prefill_steps);
            m.prefill_step_seconds += t.prefill_step_ms / 1e3;
        }
    }

    /// The exposition text, with engine gauges read now.
    pub fn render(&self, engine: &EngineStats) -> String {
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| sample(out, name, help, "gauge", v);
        let s = &engine.sched;
        gauge(&mut out, "deltaserve_requests_running", "Sequences holding a state slot.", s.running as f64);
        gauge(&mut out, "deltaserve_requests_waiting", "Requests queued for admission.", s.waiting as f64);
        gauge(&mut out, "deltaserve_kv_pages_used", "KV-cache pages in use.", s.pages_in_use as f64);
        gauge(&mut out, "deltaserve_kv_pages_total", "KV-cache pages in the static plan.", s.pages_total as f64);
        gauge(&mut out, "deltaserve_state_slots_used", "DeltaNet state slots in use.", s.slots_in_use as f64);
        gauge(
            &mut out,
            "deltaserve_state_slots_total",
            "DeltaNet state slots in the static plan.",
            s.slots_total as f64,
        );
        gauge(
            &mut out,
            "deltaserve_arena_allocations",
            "Backend memory allocations since start-up.",
            engine.arena.allocations as f64,
        );
        gauge(
            &mut out,
            "deltaserve_arena_high_water_bytes",
            "Backend arena high-water mark.",
            engine.arena.high_water_bytes as f64,
        );
        gauge(
            &mut out,
            "deltaserve_arena_capacity_bytes",
            "Backend arena capacity.",
            engine.arena.capacity_bytes as f64,
        );
        let counter = |out: &mut String, name: &str, help: &str, v: u64| sample(out, name, help, "counter", v);
        counter(&mut out, "deltaserve_preemptions_total", "Sequences preempted (recomputed later).", s.preemptions);
        let p = &s.prefix;
        gauge(
            &mut out,
            "deltaserve_prefix_cache_entries_device",
            "Cached prefixes with their state snapshot in the device pool.",
            p.entries_device as f64,
        );
        gauge(
            &mut out,
            "deltaserve_prefix_cache_entries_host",
            "Cached prefixes with their state snapshot in the host pool.",
            p.entries_host as f64,
        );
        counter(&mut out, "deltaserve_prefix_cache_lookups_total", "Prefix-cache lookups at admission.", p.lookups);
        counter(&mut out, "deltaserve_prefix_cache_hits_total", "Admissions that restored a cached prefix.", p.hits);
        counter(&mut out, "deltaserve_prefix_cache_evictions_total", "Cached prefixes dropped.", p.evictions);
        counter(
            &mut out,
            "deltaserve_prefix_cache_demotions_total",
            "Snapshots moved from the device pool to the host pool.",
            p.demotions,
        );
        counter(&mut out, "deltaserve_engine_steps_total", "Engine steps run.", engine.steps);
        counter(
            &mut out,
            "deltaserve_engine_steps_ahead_total",
            "Engine steps launched before the previous step's tokens were read (look-ahead).",
            engine.steps_ahead,
        );
        let seconds = engine.step_seconds;
        sample(
            &mut out,
            "deltaserve_engine_step_seconds_total",
            "Wall time of the backend's steps.",
            "counter",
            seconds,
        );
        counter(
            &mut out,
            "deltaserve_spec_decode_steps_total",
            "Speculative decode steps (per sequence): drafts verified in one forward.",
            engine.spec_steps,
        );
        counter(
            &mut out,
            "deltaserve_spec_decode_draft_tokens_total",
            "Tokens drafted by the MTP head.",
            engine.spec_drafted,
        );
        counter(
            &mut out,
            "deltaserve_spec_decode_accepted_tokens_total",
            "Drafted tokens accepted (and emitted).",
            engine.spec_accepted,
        );
        counter(
            &mut out,
            "deltaserve_spec_decode_emitted_tokens_total",
            "Tokens emitted by speculative decode steps.",
            engine.spec_emitted,
        );
        gauge(
            &mut out,
            "deltaserve_spec_decode_acceptance_rate",
            "Accepted / drafted tokens since start (0 without speculation).",
            engine.acceptance_rate(),
        );
        gauge(
            &mut out,
            "deltaserve_spec_decode_tokens_per_step",
            "Tokens emitted per speculative decode step since start (0 without speculation).",
            engine.tokens_per_spec_step(),
        );
        let Ok(m) = self.inner.lock() else { return out };
        counter(&mut out, "deltaserve_prompt_tokens_total", "Prompt tokens of finished requests.", m.prompt_tokens);
        counter(
            &mut out,
            "deltaserve_generation_tokens_total",
            "Generated tokens of finished requests.",
            m.generation_tokens,
        );
        counter(
            &mut out,
            "deltaserve_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache.",
            m.cached_tokens,
        );
        let _ = writeln!(
            out,
            "# HELP deltaserve_requests_total HTTP requests by endpoint and status.\n# TYPE deltaserve_requests_total counter"
        );
        for ((endpoint, status), v) in &m.requests {
            let _ = writeln!(out, "deltaserve_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {v}");
        }
        m.ttft.render(&mut out, "deltaserve_request_ttft_seconds", "Time to first token.");
        m.itl.render(&mut out, "deltaserve_inter_token_latency_seconds", "Time between generated tokens.");
        m.e2e.render(&mut out, "deltaserve_request_e2e_seconds", "Request latency, submission to finish.");
        m.queue.render(&mut out, "deltaserve_request_queue_seconds", "Time a request waited for admission.");
        m.prefill.render(&mut out, "deltaserve_request_prefill_seconds", "Admission to the first token: the prompt.");
        m.decode.render(&mut out, "deltaserve_request_decode_seconds", "First token to finish: the generation.");
        counter(
            &mut out,
            "deltaserve_request_prefill_steps_total",
            "Engine steps that ran finished requests' prompts (a step counts once per request it ran).",
            m.prefill_steps,
        );
        sample(
            &mut out,
            "deltaserve_request_prefill_step_seconds_total",
            "Wall time of those steps, per request: against the prefill histogram, the share outside the steps.",
            "counter",
            m.prefill_step_seconds,
        );
        out
    }
}

/// The prompt encoder's counters: prompt tokens taken from its per-message cache vs tokenised, and
/// the tokens it holds (see `deltaserve_text::PromptEncoder`).
pub fn render_prompt_encoder(out: &mut String, s: &PromptCacheStats) {
    for (name, help, kind, v) in [
        ("deltaserve_prompt_tokens_tokenized_total", "Prompt tokens tokenised.", "counter", s.miss_tokens),
        (
            "deltaserve_prompt_tokens_tokenizer_reused_total",
            "Prompt tokens taken from the tokenizer's per-message cache instead of tokenised again.",
            "counter",
            s.hit_tokens,
        ),
        ("deltaserve_prompt_tokenizer_cache_tokens", "Tokens held by the per-message cache.", "gauge", s.tokens as u64),
    ] {
        sample(out, name, help, kind, v);
    }
}

/// The processed-image cache's counters (`--image-cache`): images taken from it vs decoded and patched, and
/// what it holds.
pub fn render_image_cache(out: &mut String, c: &deltaserve_media::ImageCache) {
    let (hits, misses, images, bytes) = c.stats();
    for (name, help, kind, v) in [
        ("deltaserve_image_cache_hits_total", "Images taken from the processed-image cache.", "counter", hits),
        ("deltaserve_image_cache_misses_total", "Images decoded and patched.", "counter", misses),
        ("deltaserve_image_cache_images", "Images held by the processed-image cache.", "gauge", images as u64),
        ("deltaserve_image_cache_bytes", "Bytes of patches held by the processed-image cache.", "gauge", bytes as u64),
    ] {
        sample(out, name, help, kind, v);
    }
}

/// One unlabelled sample with its HELP and TYPE lines.
fn sample(out: &mut String, name: &str, help: &str, kind: &str, v: impl std::fmt::Display) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
}
