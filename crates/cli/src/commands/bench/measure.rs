//! `deltaserve bench`'s measurements: the device's ceilings, the chunked DeltaNet kernels alone, and
//! timed prefills, decode steps (plain, launched ahead, speculative) and cache operations of a backend.

use super::*;

/// The chunked DeltaNet prefill kernels alone (prep + walk, one layer) at the model's per-card shape:
/// one prompt of 4K, 16K and 64K tokens and four of 1K, as far as the free memory allows (each case
/// allocates its own buffers, freed before the backend starts).
pub(super) fn measure_deltanet(
    rt: &Runtime,
    k: &Kernels,
    card: &ModelConfig,
    skipped: &mut Vec<String>,
) -> Result<Vec<deltaserve_cuda::gdn_bench::GdnTiming>> {
    use deltaserve_cuda::gdn_bench::{GdnCase, gdn_bench_bytes, time_gdn_prefill};
    use deltaserve_cuda::ops::gdn_overlap::piece_for;
    let d = card.dims();
    if d.num_deltanet_layers == 0 {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for (t, seqs) in [(4096usize, 1usize), (16384, 1), (65536, 1), (4096, 4)] {
        let need = gdn_bench_bytes(k, t, seqs, d.gdn_k_heads, d.gdn_v_heads) as u64;
        let free = rt.free_memory()?;
        if need > free - free / 10 {
            skipped.push(format!("DeltaNet kernels at {t} tokens: need {}, {} free", fmt_bytes(need), fmt_bytes(free)));
            continue;
        }
        tracing::info!("bench: DeltaNet prefill kernels, {seqs} × {} tokens", fmt_count((t / seqs) as u64));
        let prec = deltaserve_cuda::ops::gdn_chunk::Precision::Split;
        let (hk, hv) = (d.gdn_k_heads, d.gdn_v_heads);
        let case = GdnCase { hk, hv, tokens: t, seqs, prec, walk: k.gdn_walk, piece: 0, runs: 10 };
        // As a step runs them, and where that overlaps pieces, the single prep and walk beside it.
        let piece = piece_for(k, t, seqs, hv);
        if piece > 0 {
            out.push(time_gdn_prefill(rt, k, GdnCase { piece, ..case })?);
        }
        out.push(time_gdn_prefill(rt, k, case)?);
    }
    Ok(out)
}

/// bf16 GEMM rate (8192³, median of 10) and device copy rate (1 GiB, read + write bytes per second);
/// with `host`, the rate of copies from pinned host memory to the device (128 MiB, median of 10).
pub(super) fn measure_ceilings(rt: &Runtime, k: &Kernels, host: bool) -> Result<Ceilings> {
    let n = 8192usize;
    let mut arena = Arena::new(rt.context().clone());
    let r = arena.add_region("bench ceilings", 3 * n * n * 2 + (32 << 20))?;
    let (x, w, y) = (arena.alloc(r, n * n * 2)?, arena.alloc(r, n * n * 2)?, arena.alloc(r, n * n * 2)?);
    let ws = arena.alloc(r, 32 << 20)?;
    init_random(k, rt.stream(), x.ptr, n * n, 1, Init::Normal(1.0), false)?;
    init_random(k, rt.stream(), w.ptr, n * n, 2, Init::Normal(1.0), false)?;
    let g = deltaserve_cuda::gemm::Gemm::new(rt, ws)?;
    let gemm_s = time_median(rt, 12, || g.linear(rt.stream(), x.ptr, w.ptr, y.ptr, n, n, n))?;
    // The copy reuses the GEMM buffers: 2 × 128 MiB, several copies per timing.
    let bytes = n * n * 2;
    let copy_s = time_median(rt, 12, || {
        for _ in 0..8 {
            rt.copy_device(y.ptr, x.ptr, bytes)?;
        }
        Ok(())
    })? / 8.0;
    let host_read_gbs = if host {
        let pinned = deltaserve_cuda::runtime::PinnedHost::new(rt, bytes)?;
        // SAFETY: the pinned block holds `bytes` bytes; written before it is read as a slice.
        let src = unsafe {
            std::ptr::write_bytes(pinned.ptr(), 0x5a, bytes);
            std::slice::from_raw_parts(pinned.ptr() as *const u8, bytes)
        };
        let s = time_median(rt, 10, || rt.upload(x.ptr, src))?;
        Some(bytes as f64 / s / 1e9)
    } else {
        None
    };
    drop(g);
    drop(arena);
    Ok(Ceilings {
        gemm_tflops: 2.0 * (n as f64).powi(3) / gemm_s / 1e12,
        copy_gbs: 2.0 * bytes as f64 / copy_s / 1e9,
        host_read_gbs,
    })
}

/// Median wall time of `f` (synchronised), after 2 warm-up runs.
pub(super) fn time_median(
    rt: &Runtime,
    runs: usize,
    mut f: impl FnMut() -> Result<(), deltaserve_cuda::CudaError>,
) -> Result<f64> {
    let mut times = Vec::new();
    for i in 0..runs + 2 {
        rt.synchronize()?;
        let t0 = Instant::now();
        f()?;
        rt.synchronize()?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One prompt through the backend in chunks of `chunk` tokens (slot 0, state from zero); seconds.
pub(super) fn prefill(be: &mut dyn Backend, pages: &[u32], tokens: &[u32], chunk: usize) -> Result<f64> {
    let mut out = StepOut::default();
    let t0 = Instant::now();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let start = i * chunk;
        let last = start + c.len() == tokens.len();
        let batch = StepBatch {
            seqs: vec![SeqChunk {
                seq_id: 0,
                slot: 0,
                pages: pages.to_vec(),
                start,
                tokens: c.to_vec(),
                want_logits: last,
                ..Default::default()
            }],
            ..Default::default()
        };
        out.clear();
        be.step(&batch, Want::Logits, &mut out)?;
    }
    let s = t0.elapsed().as_secs_f64();
    if !out.logits.iter().all(|x| x.is_finite()) {
        bail!("prefill of {} tokens produced non-finite logits", tokens.len());
    }
    Ok(s)
}

/// What a timed decode step hands back.
#[derive(Clone, Copy, Debug)]
pub(super) enum Pick<'a> {
    /// Every row's logits.
    Logits,
    /// Every row's argmax, picked on the device ([`Want::Tokens`], greedy decoding).
    Argmax,
    /// Every row's token sampled by this rule on the device ([`Want::Tokens`]).
    Sample(&'a RowSampling),
    /// The logits, then the host's pick by this rule (the engine's path without device sampling).
    HostSample(&'a RowSampling),
}

/// `--sample temperature,top_k,top_p,min_p`.
pub(super) fn parse_sampling(s: &str) -> Result<RowSampling, String> {
    let v: Vec<&str> = s.split(',').map(str::trim).collect();
    let bad = || format!("`{s}`: expected temperature,top_k,top_p,min_p (e.g. 0.6,20,0.95,0)");
    let [t, k, p, m] = v[..] else { return Err(bad()) };
    let f = |x: &str| x.parse::<f32>().map_err(|_| bad());
    let row = RowSampling {
        temperature: f(t)?,
        top_k: k.parse().map_err(|_| bad())?,
        top_p: f(p)?,
        min_p: f(m)?,
        ..RowSampling::greedy()
    };
    let ok = row.temperature > 0.0 && row.temperature.is_finite() && row.top_p > 0.0 && row.top_p <= 1.0;
    if !ok || !(0.0..=1.0).contains(&row.min_p) {
        return Err(format!("`{s}`: temperature > 0, top_p in (0, 1], min_p in [0, 1]"));
    }
    Ok(row)
}

/// `--sample`'s rule in words.
pub(super) fn sampling_label(r: &RowSampling) -> String {
    format!("temperature {}, top-k {}, top-p {}, min-p {}", r.temperature, r.top_k, r.top_p, r.min_p)
}

/// `b` sequences of `n` tokens each per step at positions `ctx..` (n = 1: decode): median ms per step over
/// `steps` steps, each handing back what `pick` says.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode(
    be: &mut dyn Backend,
    b: usize,
    n: usize,
    ctx: usize,
    per_seq: usize,
    steps: usize,
    vocab: usize,
    pick: Pick<'_>,
) -> Result<f64> {
    let mut out = StepOut::default();
    let mut times = Vec::new();
    for step in 0..steps + 3 {
        let batch = StepBatch { seqs: step_seqs(b, n, ctx + step * n, per_seq, step, vocab), ..Default::default() };
        let rows: Vec<RowSampling> = match pick {
            Pick::Sample(r) | Pick::HostSample(r) => step_rows(r, b, step),
            _ => Vec::new(),
        };
        out.clear();
        let t0 = Instant::now();
        let tokens = |pick| Want::Tokens { valid: vocab, pick };
        match pick {
            Pick::Logits => be.step(&batch, Want::Logits, &mut out)?,
            Pick::Argmax => be.step(&batch, tokens(deltaserve_backend::Pick::Argmax), &mut out)?,
            Pick::Sample(_) => be.step(&batch, tokens(deltaserve_backend::Pick::Sample(&rows)), &mut out)?,
            Pick::HostSample(_) => {
                be.step(&batch, Want::Logits, &mut out)?;
                out.tokens.extend(out.logits.chunks_exact_mut(vocab).zip(&rows).map(|(l, r)| r.pick(l)));
            }
        }
        if step >= 3 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

/// Step `step`'s sampling rows of `b` sequences: `rule` with a fixed spread of draws.
pub(super) fn step_rows(rule: &RowSampling, b: usize, step: usize) -> Vec<RowSampling> {
    (0..b)
        .map(|i| RowSampling { uniform: ((i * 7919 + step * 104_729) % 1000) as f32 / 1000.0, ..rule.clone() })
        .collect()
}

/// [`decode`]'s greedy (`rule` None) or sampled steps launched ahead: each step is launched, fed the
/// previous one's picks on the device, before the previous one is collected. Median ms between
/// consecutive collections (the time per token the engine's look-ahead gives).
pub(super) fn decode_ahead(
    be: &mut dyn Backend,
    b: usize,
    ctx: usize,
    per_seq: usize,
    steps: usize,
    vocab: usize,
    rule: Option<&RowSampling>,
) -> Result<f64> {
    let feed = Feed { from: (0..b).collect(), stops: vec![Vec::new(); b] };
    let mut picked = Picked::default();
    let mut times = Vec::new();
    let mut last: Option<Instant> = None;
    for step in 0..steps + 4 {
        let batch = StepBatch { seqs: step_seqs(b, 1, ctx + step, per_seq, step, vocab), ..Default::default() };
        let rows: Vec<RowSampling> = rule.map_or_else(Vec::new, |r| step_rows(r, b, step));
        let pick =
            if rule.is_some() { deltaserve_backend::Pick::Sample(&rows) } else { deltaserve_backend::Pick::Argmax };
        be.launch(&batch, vocab, pick, (step > 0).then_some(&feed))?;
        if step > 0 {
            picked.tokens.clear();
            picked.on_device.clear();
            be.collect(&mut picked)?;
            let now = Instant::now();
            if let Some(t) = last
                && step > 3
            {
                times.push((now - t).as_secs_f64() * 1e3);
            }
            last = Some(now);
        }
    }
    be.collect(&mut picked)?;
    Ok(median(times))
}

/// Step `step`'s chunks of `b` sequences (slot i, pages `i·per_seq..`), `n` tokens each from position
/// `start`, each wanting its logits.
pub(super) fn step_seqs(b: usize, n: usize, start: usize, per_seq: usize, step: usize, vocab: usize) -> Vec<SeqChunk> {
    (0..b)
        .map(|i| SeqChunk {
            seq_id: i as u64,
            slot: i as u32,
            pages: ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect(),
            start,
            tokens: (0..n).map(|j| ((i * 131 + step * 17 + j * 7) % vocab) as u32).collect(),
            want_logits: true,
            ..Default::default()
        })
        .collect()
}

/// Speculative steps of `b` sequences drafting `k` tokens from context `ctx`, committing all `k + 1`
/// positions: median ms of (draft, verify, commit).
pub(super) fn speculative(
    be: &mut CudaBackend,
    b: usize,
    k: usize,
    ctx: usize,
    per_seq: usize,
    steps: usize,
    vocab: usize,
) -> Result<(f64, f64, f64)> {
    let (mut draft, mut verify, mut commit) = (Vec::new(), Vec::new(), Vec::new());
    let mut pick = |_: u64, _: usize, row: &[f32]| deltaserve_backend::argmax(row);
    let mut out = StepOut::default();
    for step in 0..steps + 3 {
        let mut seqs = step_seqs(b, 1, ctx + step * (k + 1), per_seq, step, vocab);
        for c in &mut seqs {
            (c.draft, c.greedy_draft_vocab) = (k, vocab);
        }
        let commits: Vec<deltaserve_backend::SpecCommit> = seqs
            .iter()
            .map(|c| deltaserve_backend::SpecCommit {
                seq_id: c.seq_id,
                slot: c.slot,
                pages: c.pages.clone(),
                start: c.start,
                accepted: k + 1,
            })
            .collect();
        let batch = StepBatch { seqs, ..Default::default() };
        out.clear();
        let t0 = Instant::now();
        // Greedy rows, as the engine runs them: every verified row's argmax picked on the GPU.
        be.step(&batch, Want::DraftsArgmax { valid: vocab, pick: &mut pick }, &mut out)?;
        let t1 = Instant::now();
        be.commit_speculative(&commits)?;
        if step >= 3 {
            let d = be.last_draft_s() * 1e3;
            draft.push(d);
            verify.push((t1 - t0).as_secs_f64() * 1e3 - d);
            commit.push(t1.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok((median(draft), median(verify), median(commit)))
}

/// Median ms of a step that only runs `op` (10 runs after 2 warm-ups), synchronised.
pub(super) fn time_cache_op(be: &mut dyn Backend, op: CacheOp) -> Result<f64> {
    let batch = StepBatch { pre: vec![op], ..Default::default() };
    let mut out = StepOut::default();
    let mut times = Vec::new();
    for i in 0..12 {
        let t0 = Instant::now();
        be.step(&batch, Want::Logits, &mut out)?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

/// Bytes a step of `b` sequences at context `ctx` reads at least, (in device memory, in pinned host
/// memory): one card's device weights (less the embedding table, of which a step reads only its rows; of
/// a mixture of experts only the experts `b` tokens pick, read from the host with `--experts-on-host`),
/// the sequences' KV and their DeltaNet state (read and written).
pub(super) fn step_bytes(plan: &Plan, cfg: &ModelConfig, b: usize, ctx: usize) -> (f64, f64) {
    let parts = &plan.weight_parts;
    let embed_on_device = if plan.options.embed_on_host { 0 } else { parts.embed };
    let experts_on_device = if parts.experts_on_host { 0 } else { parts.experts };
    let experts_read = cfg.moe.as_ref().map_or(0.0, |m| parts.experts_read(m.num_experts, m.top_k, b));
    let rest = (plan.weights_bytes - embed_on_device - experts_on_device) as f64;
    let cache = (b * ctx) as f64 * plan.kv_bytes_per_token as f64 + 2.0 * b as f64 * plan.state_bytes_per_seq as f64;
    if parts.experts_on_host { (rest + cache, experts_read) } else { (rest + experts_read + cache, 0.0) }
}

/// The least time (s) a step reading `(device, host)` bytes takes: the device bytes at the copy rate, the
/// host bytes at the host-to-device rate.
pub(super) fn bytes_floor_s((device, host): (f64, f64), c: &Ceilings) -> f64 {
    device / (c.copy_gbs * 1e9) + c.host_read_gbs.map_or(0.0, |r| host / (r * 1e9))
}

/// (total FLOPs, attention FLOPs) of a `t`-token prompt from position 0 (`docs/architecture.md` §6). A
/// mixture of experts' token runs its `top_k` routed experts, not all of them.
pub(super) fn prefill_flops(cfg: &ModelConfig, linear_params: u64, t: usize) -> (f64, f64) {
    chunk_flops(cfg, linear_params, t, 0)
}

/// [`prefill_flops`] of a chunk of `t` tokens after `ctx` tokens already in the cache (its rows
/// attend to `ctx + 1 … ctx + t` keys).
pub(super) fn chunk_flops(cfg: &ModelConfig, linear_params: u64, t: usize, ctx: usize) -> (f64, f64) {
    let d = cfg.dims();
    let (t, ctx) = (t as f64, ctx as f64);
    let unrouted = cfg.moe.as_ref().map_or(0.0, |m| {
        let per_expert = 3.0 * (m.expert_intermediate * d.hidden) as f64;
        (m.num_sparse_layers() * m.num_experts.saturating_sub(m.top_k)) as f64 * per_expert
    });
    let linears = 2.0 * (linear_params as f64 - unrouted) * t;
    let gdn = 180e3 * (d.gdn_k_dim * d.gdn_v_dim) as f64 / 16384.0 * (d.gdn_v_heads * d.num_deltanet_layers) as f64 * t;
    let attn = 4.0 * (d.head_dim * d.q_heads * d.num_attention_layers) as f64 * (t * ctx + t * (t + 1.0) / 2.0);
    let lm_head = 2.0 * (d.vocab * d.hidden) as f64;
    (linears + gdn + attn + lm_head, attn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_flops_match_the_architecture_doc() {
        // §6: a T-token prompt of the 27B costs about T·49.1e9 + 196,608·T² + 2.5e9 FLOPs.
        let json = deltaserve_model::synth::Preset::Qwen36_27b.config_json(None);
        let cfg = ModelConfig::from_json_str(&json.to_string()).unwrap();
        for t in [4096usize, 32768, 131072] {
            let (total, attn) = prefill_flops(&cfg, 24_350_556_160, t);
            let doc = t as f64 * 49.1e9 + 196_608.0 * (t as f64).powi(2) + 2.5e9;
            assert!((total / doc - 1.0).abs() < 0.01, "{t}: {total:e} vs {doc:e}");
            assert!(attn < total);
        }
        let (total, attn) = prefill_flops(&cfg, 24_350_556_160, 131072);
        assert!((attn / total - 0.34).abs() < 0.01, "§6: attention is 34% at 128K");
    }

    #[test]
    fn sampling_flag_parses_and_checks() {
        let r = parse_sampling("0.7, 0, 0.9, 0.05").unwrap();
        assert_eq!((r.temperature, r.top_k, r.top_p, r.min_p), (0.7, 0, 0.9, 0.05));
        assert_eq!(sampling_label(&r), "temperature 0.7, top-k 0, top-p 0.9, min-p 0.05");
        for bad in ["0.7,20,0.9", "0,20,0.9,0", "0.7,20,1.5,0", "0.7,x,0.9,0", "0.7,20,0.9,2"] {
            assert!(parse_sampling(bad).is_err(), "{bad}");
        }
    }
}
