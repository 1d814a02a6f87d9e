//! Paged attention: kv_write of every position through scrambled block tables, then prefill (the
//! wide and the warp-pair kernels, at several tilings) or decode (the tensor-core and the split
//! kernels, gated, through table rows) against the CPU's causal GQA attention. The paged rows, the
//! launch arguments and the reference here serve the quantised cache's cases too.

use deltaserve_cpu as cpu;
use deltaserve_cuda::ops::{attention, kv_cache};
use deltaserve_cuda::{Kernels, KvFormats};
use half::bf16;
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, compare, cu_of, randv};
use crate::{EXACT, Env, Op};

/// Sequences of (cached, new) positions in a paged cache of `hkv` heads of `hd`: block tables
/// handed out of the physical blocks in a scrambled order, and random K and V rows for every
/// position.
pub struct PagedRows {
    pub seqs: Vec<(usize, usize)>,
    /// Positions per sequence (cached + new), and their offsets in `k` and `v`.
    pub totals: Vec<usize>,
    pub cu: Vec<i32>,
    /// The block tables, `max_blocks` per sequence, out of `num_blocks` physical blocks.
    pub bt: Vec<i32>,
    pub max_blocks: usize,
    pub num_blocks: usize,
    pub page: usize,
    pub hkv: usize,
    pub hd: usize,
    /// K and V rows, [positions, hkv · hd].
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl PagedRows {
    pub fn random(rng: &mut StdRng, seqs: &[(usize, usize)], page: usize, hkv: usize, hd: usize) -> Self {
        let width = hkv * hd;
        let nb = seqs.len();
        let totals: Vec<usize> = seqs.iter().map(|&(p, n)| p + n).collect();
        let max_blocks = totals.iter().map(|t| t.div_ceil(page)).max().unwrap_or(1);
        let num_blocks = nb * max_blocks + 3;
        // Physical blocks handed out in a scrambled order.
        let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..perm.len()).rev() {
            let j = rng.random_range(0..=i);
            perm.swap(i, j);
        }
        let bt: Vec<i32> = perm[..nb * max_blocks].to_vec();
        let t_all: usize = totals.iter().sum();
        let k = randv(rng, t_all * width, 2.0);
        let v = randv(rng, t_all * width, 1.0);
        let cu = cu_of(&totals);
        PagedRows { seqs: seqs.to_vec(), totals, cu, bt, max_blocks, num_blocks, page, hkv, hd, k, v }
    }

    /// The values of one position's K or V row.
    pub fn width(&self) -> usize {
        self.hkv * self.hd
    }

    /// The cache row (physical block · page + offset) of position `p` of sequence `b`.
    pub fn row(&self, b: usize, p: usize) -> usize {
        self.bt[b * self.max_blocks + p / self.page] as usize * self.page + p % self.page
    }

    /// kv_write arguments writing every position into `k_cache` / `v_cache` (0 where the cache's
    /// layer tensors say where): the rows, positions, offsets and block tables uploaded.
    pub fn write_args(&self, d: &mut Dev, (k_cache, v_cache): (u64, u64)) -> R<kv_cache::KvWrite> {
        let width = self.width();
        let pos_all: Vec<i32> = self.totals.iter().flat_map(|&t| 0..t as i32).collect();
        let (kp, vp, pp, cap, btp) =
            (d.bf16(&self.k)?, d.bf16(&self.v)?, d.i32s(&pos_all)?, d.i32s(&self.cu)?, d.i32s(&self.bt)?);
        Ok(kv_cache::KvWrite {
            k: kp,
            k_stride: width,
            v: vp,
            v_stride: width,
            k_cache,
            v_cache,
            block_tables: btp,
            max_blocks: self.max_blocks,
            cu_seqlens: cap,
            positions: pp,
            n_seqs: self.seqs.len(),
            t: self.totals.iter().sum(),
            page: self.page,
            kv_heads: self.hkv,
            head_dim: self.hd,
        })
    }

    /// Random queries of the new tokens (`hq` heads), uploaded with a poisoned output and the
    /// sequences' lengths.
    pub fn queries(&self, rng: &mut StdRng, d: &mut Dev, hq: usize) -> R<Queries> {
        let news: Vec<usize> = self.seqs.iter().map(|&(_, n)| n).collect();
        let t_new: usize = news.iter().sum();
        let q = randv(rng, t_new * hq * self.hd, 2.0);
        let qp = d.bf16(&q)?;
        let o = d.poison(2 * q.len())?;
        let lens: Vec<i32> = self.totals.iter().map(|&t| t as i32).collect();
        let seq_lens = d.i32s(&lens)?;
        Ok(Queries { cu: cu_of(&news), q, qp, o, seq_lens, hq, hd: self.hd })
    }

    /// The CPU's causal GQA attention of the new tokens' queries `q` over every position.
    pub fn attention(&self, q: &Queries) -> Vec<f32> {
        let (hq, hkv, hd, width) = (q.hq, self.hkv, self.hd, self.width());
        let mut r = Vec::new();
        let mut qo = 0;
        for (b, &(_, n)) in self.seqs.iter().enumerate() {
            let t0 = self.cu[b] as usize;
            let kc = &self.k[t0 * width..][..self.totals[b] * width];
            let vc = &self.v[t0 * width..][..self.totals[b] * width];
            r.extend(cpu::attention::causal_gqa_attention(&q.q[qo * hq * hd..][..n * hq * hd], kc, vc, hq, hkv, hd));
            qo += n;
        }
        r
    }
}

/// The new tokens' queries `q` ([new tokens, hq, hd]; `qp` on the device) at offsets `cu`, their
/// poisoned output `o` and the sequences' lengths `seq_lens` on the device.
pub struct Queries {
    pub q: Vec<f32>,
    pub qp: u64,
    pub o: u64,
    pub seq_lens: u64,
    pub cu: Vec<i32>,
    pub hq: usize,
    pub hd: usize,
}

/// The paged geometry of the cache `kv_write` wrote, its K and V at `k_cache` / `v_cache`, each
/// `num_blocks` pages.
pub fn pages(w: &kv_cache::KvWrite, (k_cache, v_cache): (u64, u64), num_blocks: usize) -> attention::KvPages {
    let (block_tables, max_blocks, page, kv_heads) = (w.block_tables, w.max_blocks, w.page, w.kv_heads);
    let rows = num_blocks * page;
    attention::KvPages { k_cache, v_cache, block_tables, max_blocks, page, kv_heads, rows }
}

/// Prefill launch arguments for the queries `q` over `kv` into `o`, with the tile table of the
/// kernels `k` for the queries' offsets (uploaded here).
pub fn prefill_args(
    d: &mut Dev,
    k: &Kernels,
    q: &Queries,
    o: u64,
    kv: attention::KvPages,
) -> R<attention::AttnPrefill> {
    let table = attention::tile_table(k, &q.cu);
    let (cu_seqlens, tile_table) = (d.i32s(&q.cu)?, d.i32s(&table)?);
    Ok(attention::AttnPrefill {
        q: q.qp,
        q_tok: q.hq * q.hd,
        q_head: q.hd,
        o,
        kv,
        cu_seqlens,
        seq_lens: q.seq_lens,
        tile_table,
        n_tiles: table.len() / 2,
        q_heads: q.hq,
        scale: 1.0 / (q.hd as f32).sqrt(),
    })
}

/// Decode launch arguments for the queries `q` (one token per sequence) over `kv` into their output,
/// `n_split` partitions per sequence, with a poisoned scratch.
pub fn decode_args(d: &mut Dev, q: &Queries, kv: attention::KvPages, n_split: usize) -> R<attention::AttnDecode> {
    let nb = q.cu.len() - 1;
    let bytes = attention::decode_scratch_bytes(nb, q.hq, n_split, q.hd);
    let sc = d.poison(bytes)?;
    Ok(attention::AttnDecode {
        q: q.qp,
        q_tok: q.hq * q.hd,
        q_head: q.hd,
        o: q.o,
        kv,
        seq_lens: q.seq_lens,
        table_rows: 0,
        n_seqs: nb,
        q_heads: q.hq,
        n_split,
        scratch: sc,
        scratch_bytes: bytes,
        scale: 1.0 / (q.hd as f32).sqrt(),
        gate: 0,
    })
}

/// Decode launch arguments for speculative-verify-shaped queries: every new token of `q` a decode
/// query row with its own causal length and its sequence's block-table row, and the sequences' rows in
/// groups of at most `group_rows` (attention::attn_verify_q).
pub fn verify_args(
    d: &mut Dev,
    q: &Queries,
    seqs: &[(usize, usize)],
    kv: attention::KvPages,
    n_split: usize,
    group_rows: usize,
) -> R<(attention::AttnDecode, attention::RowGroups)> {
    let (mut lens, mut tables, mut starts) = (Vec::new(), Vec::new(), vec![0i32]);
    for (b, &(p, n)) in seqs.iter().enumerate() {
        lens.extend((1..=n).map(|j| (p + j) as i32));
        tables.extend(std::iter::repeat_n(b as i32, n));
        for k in (0..n).step_by(group_rows.max(1)) {
            starts.push(starts[starts.len() - 1] + (n - k).min(group_rows.max(1)) as i32);
        }
    }
    let rows = lens.len();
    let bytes = attention::decode_scratch_bytes(rows, q.hq, n_split, q.hd);
    let a = attention::AttnDecode {
        q: q.qp,
        q_tok: q.hq * q.hd,
        q_head: q.hd,
        o: q.o,
        kv,
        seq_lens: d.i32s(&lens)?,
        table_rows: d.i32s(&tables)?,
        n_seqs: rows,
        q_heads: q.hq,
        n_split,
        scratch: d.poison(bytes)?,
        scratch_bytes: bytes,
        scale: 1.0 / (q.hd as f32).sqrt(),
        gate: 0,
    };
    let max_rows = starts.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
    let g = attention::RowGroups { starts: d.i32s(&starts)?, n: starts.len() - 1, max_rows };
    Ok((a, g))
}

/// [`Op::AttnPrefill`]: on the kernels of the case's dims.
pub fn prefill(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Op::AttnPrefill { ref seqs, hq, hkv, page } = *op else { unreachable!() };
    attn_case(e, d, rng, seqs, (hq, hkv, page), None)
}

/// [`Op::AttnPrefillTiled`]: on kernels compiled for the case's tiling.
pub fn prefill_tiled(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Op::AttnPrefillTiled { ref seqs, hq, hkv, page, tiling } = *op else { unreachable!() };
    let kt = Kernels::load_tiled(e.rt, e.k.dims, KvFormats::BF16, tiling)?;
    let mut out = attn_case(Env { k: &kt, ..e }, d, rng, seqs, (hq, hkv, page), None)?;
    // Which kernel the tiling resolved to on this device (the warpgroup kernel on Hopper alone).
    for o in &mut out {
        o.detail = format!("{}: {}", attention::prefill_kernel_at(&kt, page), o.detail);
    }
    Ok(out)
}

/// [`Op::AttnDecode`]: one new token after `lens[b] − 1` cached ones per sequence, on the
/// tensor-core kernel and (where that ran) on the split kernel too.
pub fn decode(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Op::AttnDecode { ref lens, hq, hkv, page, n_split } = *op else { unreachable!() };
    let seqs: Vec<(usize, usize)> = lens.iter().map(|&l| (l - 1, 1)).collect();
    let mut out = attn_case(e, d, rng, &seqs, (hq, hkv, page), Some(n_split))?;
    if e.k.decode_mma {
        // attn_decode_mma ran; the same case on attn_decode_split (its A/B switch).
        let mut ks = Kernels::load(e.rt, e.k.dims)?;
        ks.decode_mma = false;
        for mut o in attn_case(Env { k: &ks, ..e }, d, rng, &seqs, (hq, hkv, page), Some(n_split))? {
            o.detail = format!("attn_decode_split: {}", o.detail);
            out.push(o);
        }
    }
    Ok(out)
}

/// Paged attention: random K/V for every position written with kv_write through shuffled block
/// tables, then prefill attention of the `new` queries (or decode with `n_split`).
fn attn_case(
    e: Env,
    d: &mut Dev,
    rng: &mut StdRng,
    seqs: &[(usize, usize)],
    (hq, hkv, page): (usize, usize, usize),
    n_split: Option<usize>,
) -> R<Vec<Outcome>> {
    let Env { k, s, tol, .. } = e;
    let paged = PagedRows::random(rng, seqs, page, hkv, k.dims.attn_head_dim);
    let (nb, width, max_blocks) = (seqs.len(), paged.width(), paged.max_blocks);
    let cache_bytes = 2 * paged.num_blocks * page * width;
    let (kc, vc) = (d.poison(cache_bytes)?, d.poison(cache_bytes)?);
    let w = paged.write_args(d, (kc, vc))?;
    kv_cache::kv_write(k, s, &w)?;
    let q = paged.queries(rng, d, hq)?;
    let n = q.q.len();
    let kv = pages(&w, (kc, vc), paged.num_blocks);
    let mut indirect = None;
    let mut gated: Option<(u64, Vec<f32>)> = None;
    let mut split_outs: Vec<(usize, u64)> = Vec::new();
    match n_split {
        None => {
            let a = prefill_args(d, k, &q, q.o, kv)?;
            attention::attn_prefill(k, s, &a)?;
            // The same launch split over the keys (wide kernels): 3 splits, and 64 (more than most
            // tiles have KV tiles: empty splits), merged by the decode combine.
            if attention::prefill_split_supported(k) {
                let rows = *q.cu.last().unwrap() as usize;
                for n_split in [3, 64] {
                    let bytes = attention::decode_scratch_bytes(rows, hq, n_split, k.dims.attn_head_dim);
                    let (scratch, o) = (d.poison(bytes)?, d.poison(2 * n)?);
                    let sp = attention::PrefillSplit { n_split, row0: 0, rows, scratch, scratch_bytes: bytes };
                    attention::attn_prefill_split(k, s, &attention::AttnPrefill { o, ..a }, &Default::default(), &sp)?;
                    split_outs.push((n_split, o));
                }
            }
        }
        Some(n_split) => {
            let a = decode_args(d, &q, kv, n_split)?;
            attention::attn_decode(k, s, &a)?;
            // The same queries with the output gate applied in the combine step (gate rows with q's
            // strides).
            let g = randv(rng, n, 2.0);
            let gp = d.bf16(&g)?;
            let op3 = d.poison(2 * n)?;
            attention::attn_decode(k, s, &attention::AttnDecode { o: op3, gate: gp, ..a })?;
            gated = Some((op3, g));
            // The same queries through `table_rows` (the speculative verify's indirection), the block
            // table rows stored in reverse order.
            let bt = &paged.bt;
            let mut bt_rev = vec![0i32; nb * max_blocks];
            for b in 0..nb {
                bt_rev[(nb - 1 - b) * max_blocks..][..max_blocks].copy_from_slice(&bt[b * max_blocks..][..max_blocks]);
            }
            let rows: Vec<i32> = (0..nb as i32).rev().collect();
            let op2 = d.poison(2 * n)?;
            let kv2 = attention::KvPages { block_tables: d.i32s(&bt_rev)?, ..kv };
            attention::attn_decode(k, s, &attention::AttnDecode { o: op2, kv: kv2, table_rows: d.i32s(&rows)?, ..a })?;
            indirect = Some(op2);
        }
    }
    let r = paged.attention(&q);
    let mut out = vec![compare("o", &r, &d.get_bf16(q.o, n)?, tol)];
    if let Some(op2) = indirect {
        out.push(compare("o via table_rows", &r, &d.get_bf16(op2, n)?, tol));
    }
    for (n_split, o) in split_outs {
        out.push(compare(&format!("o split {n_split} ways over the keys"), &r, &d.get_bf16(o, n)?, tol));
    }
    if let Some((op3, g)) = gated {
        let want: Vec<f32> = r
            .iter()
            .zip(&g)
            .map(|(o, g)| {
                let g = bf16::from_f32(*g).to_f32();
                bf16::from_f32(*o).to_f32() / (1.0 + (-g).exp())
            })
            .collect();
        out.push(compare("o gated in the combine step", &want, &d.get_bf16(op3, n)?, tol));
    }
    // kv_write check: read back every written row through the block table.
    let kc_h = d.get_bf16(kc, cache_bytes / 2)?;
    let mut got = Vec::with_capacity(paged.k.len());
    for (b, &tot) in paged.totals.iter().enumerate() {
        for p in 0..tot {
            got.extend_from_slice(&kc_h[paged.row(b, p) * width..][..width]);
        }
    }
    out.push(compare("k_cache", &paged.k, &got, EXACT));
    Ok(out)
}
