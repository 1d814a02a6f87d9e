//! The token pickers: argmax over rows of logits (ties, NaNs, infinities, unaligned rows) and the
//! sampler under a cycle of sampling parameters and token masks, against the host's rule.

use deltaserve_backend::sampling::{is_allowed, mask_words};
use deltaserve_backend::{Penalty, RowSampling};
use deltaserve_cuda::ops;
use rand::RngExt;
use rand::rngs::StdRng;

use crate::harness::{Dev, Outcome, R, randv};
use crate::{Env, Op};

/// [`Op::Argmax`]: the device's ids against `deltaserve_backend::argmax` over the first `valid`.
pub fn argmax(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { k, s, .. } = e;
    let Op::Argmax { rows, vocab, valid, special } = *op else { unreachable!() };
    let mut x = randv(rng, rows * vocab, 4.0);
    if special {
        // Row r: a maximum repeated at several ids (the lowest must win), and per row kind a NaN
        // at 0, a NaN elsewhere, +inf, all -inf, all NaN, a maximum past `valid`.
        for (r, row) in x.chunks_exact_mut(vocab).enumerate() {
            let m = 50.0;
            for i in [vocab / 2, vocab / 3, vocab - 1, 1] {
                if i < valid {
                    row[i] = m;
                }
            }
            match r % 6 {
                0 => row[0] = f32::NAN,
                1 => row[vocab / 4] = f32::NAN,
                2 => row[vocab / 5] = f32::INFINITY,
                3 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                4 => row.iter_mut().for_each(|v| *v = f32::NAN),
                _ => row[vocab - 1] = 1e9,
            }
        }
    }
    let (xp, ip) = (d.f32s(&x)?, d.poison(4 * rows)?);
    ops::argmax::argmax_rows(k, s, xp, vocab, valid, rows, ip)?;
    let mut got = vec![0i32; rows];
    d.rt.download(&mut got, ip)?;
    let want: Vec<i32> = x.chunks_exact(vocab).map(|row| deltaserve_backend::argmax(&row[..valid]) as i32).collect();
    Ok(vec![Outcome { ok: got == want, detail: format!("ids {got:?} (host argmax {want:?})") }])
}

/// The sampling parameters of draw `i` (cycled): greedy with penalties, plain draws, cuts.
fn sample_params(i: usize, valid: usize, rng: &mut StdRng) -> RowSampling {
    let row = |temperature: f32, top_k: usize, top_p: f32, min_p: f32| RowSampling {
        temperature,
        top_k,
        top_p,
        min_p,
        uniform: 0.0,
        ..RowSampling::greedy()
    };
    let mut r = match i % 11 {
        0 => row(0.0, 0, 1.0, 0.0),
        1 => row(1.0, 0, 1.0, 0.0),
        2 => row(0.7, 0, 1.0, 0.0),
        3 => row(0.6, 20, 0.95, 0.0),
        4 => row(1.0, 20, 0.95, 0.0),
        5 => row(0.7, 0, 0.8, 0.0),
        6 => row(1.0, 0, 1.0, 0.05),
        7 => row(1.0, 1, 1.0, 0.0),
        8 => row(1.3, 200, 1.0, 0.02),
        9 => row(0.8, 0, 0.3, 0.0),
        _ => row(1.5, 0, 0.999, 0.0),
    };
    r.uniform = rng.random::<f32>();
    if matches!(i % 11, 0 | 4) {
        // Penalties on the low ids (where the test rows put their peaks): repeated (a long context: the
        // first 20,000 ids, more than the entries a row holds, or 64), every 8th also generated.
        r.repetition_penalty = 1.3;
        let repeated = if i % 11 == 4 { 20_000u32 } else { 64 };
        r.penalties = (0..repeated.min(valid as u32))
            .map(|id| Penalty {
                id,
                repeated: true,
                subtract: if id % 8 == 0 && id < 64 { 0.5 + 0.25 * id as f32 } else { 0.0 },
            })
            .collect();
    }
    // Token masks (structured outputs) on every 7th draw and the 5th after it: half the ids, or 5
    // random ids (a top-k above them is cut to them), never the peaks' on purpose.
    if matches!(i % 7, 2 | 5) {
        let mut bits = vec![0u32; mask_words(valid)];
        let allowed: Vec<u32> = if i % 7 == 2 {
            (0..valid as u32).filter(|_| rng.random::<bool>()).collect()
        } else {
            (0..5).map(|_| rng.random_range(0..valid as u32)).collect()
        };
        for id in allowed {
            bits[id as usize / 32] |= 1 << (id % 32);
        }
        r.allowed = Some(bits);
    }
    r
}

/// [`Op::Sample`]: rows of peaked, flat and tied logits, each picked `rounds` times with fresh
/// uniforms; the device's token must be the host's (greedy) or land where the draw lands in the
/// host's walk over its kept candidates.
pub fn sample(e: Env, d: &mut Dev, rng: &mut StdRng, op: &Op) -> R<Vec<Outcome>> {
    let Env { rt, k, s, .. } = e;
    let Op::Sample { rows, vocab, valid, rounds } = *op else { unreachable!() };
    // Row kinds: peaked (a body of width ~2.5, a few ids at +7..+12 among the low ids, every 97th id
    // masked to −inf), flat (width 0.5), a coarse grid (ties).
    let mut x = vec![0f32; rows * vocab];
    for (r, row) in x.chunks_exact_mut(vocab).enumerate() {
        for v in row.iter_mut() {
            let n: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
            *v = match r % 3 {
                0 => 2.5 * n,
                1 => 0.5 * n,
                _ => (2.0 * n * 4.0).round() / 4.0,
            };
        }
        if r % 3 == 0 {
            for j in 0..6.min(vocab) {
                row[j * 7 % vocab.min(64)] = 12.0 - j as f32;
            }
            // Masked ids (−inf): never drawn, at the bottom of every order.
            for j in (5..vocab).step_by(97) {
                row[j] = f32::NEG_INFINITY;
            }
        }
    }
    let sc = deltaserve_plan::SamplingScratch::new(rows, vocab);
    let (xp, base) = (d.f32s(&x)?, d.poison(sc.bytes as usize)?);
    let (mut equal, mut host, mut outside, mut off, mut greedy_diff, mut draws) = (0, 0, 0, 0, 0, 0);
    let (mut masked, mut refused) = (0, 0);
    let mut offs = Vec::new();
    let mut modes = [0usize; 3];
    for round in 0..rounds {
        let sets: Vec<RowSampling> = (0..rows).map(|r| sample_params(r + round * rows, valid, rng)).collect();
        rt.upload(xp, &x)?;
        let e = ops::sample::encode(&sets, valid, sc.penalty_words);
        ops::sample::sample_rows(k, s, &sc, base, xp, vocab, valid, rows, &e)?;
        let mut got = vec![[0i32; 2]; rows];
        rt.download(&mut got, base + sc.out)?;
        for ((row, set), [token, flag]) in x.chunks_exact(vocab).zip(&sets).zip(got) {
            draws += 1;
            modes[ops::sample::mode(set, valid) as usize] += 1;
            if flag == 1 {
                host += 1;
                continue;
            }
            if let Some(bits) = &set.allowed {
                masked += 1;
                refused += usize::from(token < 0 || !is_allowed(bits, token as u32));
            }
            let mut adjusted = row[..valid].to_vec();
            set.apply_penalties(&mut adjusted);
            let want = set.pick_adjusted(&adjusted);
            equal += usize::from(token as u32 == want);
            if set.is_greedy() {
                greedy_diff += usize::from(token as u32 != want);
                continue;
            }
            // The device's token must be where the draw lands in the host's walk (its kept candidates in
            // the host's order) up to the rounding of sums over up to 248K terms: u within 1e-4 of the
            // token's share of the mass. (Equal tokens are counted; over a flat row of 248K ids a
            // share is ~4e-6, so the f32 sums' order alone moves the token.)
            let (cand, probs) = set.candidates(&adjusted);
            let Some(j) = cand[..probs.len()].iter().position(|c| token >= 0 && c.0 == token as u32) else {
                outside += 1;
                continue;
            };
            let total: f64 = probs.iter().map(|&p| p as f64).sum();
            let before = probs[..j].iter().map(|&p| p as f64).sum::<f64>() / total;
            let after = before + probs[j] as f64 / total;
            let u = set.uniform as f64;
            if u < before - 1e-4 || u > after + 1e-4 {
                off += 1;
                if offs.len() < 3 {
                    let host_at = cand.iter().position(|c| c.0 == want);
                    offs.push(format!(
                        "[t {} k {} p {} min_p {} u {u:.6}: device {token} at {j} ({before:.6}..{after:.6}), host {want} at \
                         {host_at:?}, {} kept]",
                        set.temperature,
                        set.top_k,
                        set.top_p,
                        set.min_p,
                        probs.len()
                    ));
                }
            }
        }
    }
    let picked = draws - host;
    // A top-p prefix whose mass lands within rounding of p (the device sums in f32, the host in f64) may
    // end one candidate apart, which moves the draw's scale: allow 1 in 100 such draws.
    Ok(vec![Outcome {
        ok: outside == 0 && off <= 1 + picked / 100 && greedy_diff == 0 && host < draws / 2 && refused == 0,
        detail: format!(
            "{draws} draws (modes greedy/plain/cut {modes:?}): {equal} of {picked} picked on the device equal to the \
             host rule, {off} away from the draw's place in the host's walk, {outside} outside the host's kept set, \
             {greedy_diff} greedy differences, {host} left to the host; {masked} masked, {refused} outside their \
             mask {}",
            offs.join(" ")
        ),
    }])
}
