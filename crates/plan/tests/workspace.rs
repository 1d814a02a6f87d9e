//! The workspace layout never puts two buffers that are live at the same op at overlapping addresses.

use deltaserve_model::synth::Preset;
use deltaserve_plan::workspace::{STEP_INPUTS, StepShape, WorkspaceBuffer, place_first_fit, plan_workspace};
use proptest::prelude::*;

fn check(bufs: &[WorkspaceBuffer], bytes: u64) -> Result<(), TestCaseError> {
    for (i, a) in bufs.iter().enumerate() {
        prop_assert_eq!(a.offset % 256, 0, "{} misaligned", a.name);
        prop_assert!(a.offset + a.bytes <= bytes, "{} past the end", a.name);
        prop_assert!(a.first_op <= a.last_op);
        for b in &bufs[i + 1..] {
            prop_assert!(
                !(a.lifetime_overlaps(b) && a.address_overlaps(b)),
                "{} [{}..{} @{}+{}] and {} [{}..{} @{}+{}] collide",
                a.name,
                a.first_op,
                a.last_op,
                a.offset,
                a.bytes,
                b.name,
                b.first_op,
                b.last_op,
                b.offset,
                b.bytes
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn planned_step_has_no_collisions(
        tokens in 1usize..9000,
        seq_frac in 0.0f64..1.0,
        f32_act in any::<bool>(),
        host_embed in any::<bool>(),
        partitions in 1usize..33,
        layers in 1usize..9,
        tiny in any::<bool>(),
        speculative in any::<bool>(),
    ) {
        let preset = Preset::parse(if tiny { "tiny" } else { "qwen3.6-27b" }).unwrap();
        let cfg = preset.config(Some(layers));
        let seqs = 1 + ((tokens.min(256) - 1) as f64 * seq_frac) as usize;
        let shape = StepShape {
            tokens,
            seqs,
            act_bytes: if f32_act { 4 } else { 2 },
            host_embed_elem: host_embed.then_some(2),
            decode_partitions: partitions,
            speculative,
        };
        let ws = plan_workspace(&cfg, &shape).unwrap();
        check(&ws.buffers, ws.bytes)?;
        prop_assert!(ws.bytes >= ws.peak_live_bytes());
        // The residual stream and step inputs are live across the whole layer section.
        let res = ws.get("residual").unwrap();
        let last_layer_op = ws.ops.iter().position(|o| *o == "mlp_residual").unwrap();
        prop_assert!(res.last_op > last_layer_op);
        for name in ["positions", "cu_seqlens", "seq_lens", "state_slot_ids"] {
            prop_assert!(ws.get(name).unwrap().last_op >= last_layer_op, "{}", name);
        }
        // The fused conv + gate launches (decode and verify rows) read the in-projection rows while they write
        // the conv output and the gates' outputs: never at the same bytes.
        if let Some(x) = ws.get("gdn_qkv") {
            for name in ["gdn_conv_out", "gdn_g", "gdn_beta", "gdn_qk"] {
                prop_assert!(!x.address_overlaps(ws.get(name).unwrap()), "gdn_qkv and {} share bytes", name);
            }
        }
        // The step inputs are one block from offset 0, in order, with one lifetime (one upload fills them).
        let mut at = 0;
        for name in STEP_INPUTS {
            let b = ws.get(name).unwrap();
            prop_assert_eq!(b.offset, at, "{}", name);
            prop_assert_eq!((b.first_op, b.last_op), (0, ws.get("last_token_idx").unwrap().last_op));
            at += b.bytes.next_multiple_of(256);
        }
        // With speculative decoding the MTP head reads the step's inputs and the final-normed rows after
        // the logits: they stay live until it does.
        if speculative {
            let at = |op: &str| ws.ops.iter().position(|o| *o == op).unwrap();
            for (name, op) in [
                ("token_ids", "mtp_embed"),
                ("positions", "mtp_rope_kv_append"),
                ("cu_seqlens", "mtp_attention"),
                ("seq_lens", "mtp_attention"),
                ("state_slot_ids", "mtp_shift"),
            ] {
                prop_assert!(ws.get(name).unwrap().last_op >= at(op), "{}", name);
            }
            prop_assert!(ws.get("final_normed").unwrap().last_op >= at("mtp_shift"));
        }
    }

    #[test]
    fn first_fit_never_collides(specs in prop::collection::vec((1u64..100_000, 0usize..40, 0usize..10), 1..60)) {
        let mut bufs: Vec<WorkspaceBuffer> = specs
            .iter()
            .map(|&(bytes, first, len)| WorkspaceBuffer {
                name: "b",
                bytes,
                offset: 0,
                first_op: first,
                last_op: first + len,
                shape: String::new(),
            })
            .collect();
        let end = place_first_fit(&mut bufs);
        check(&bufs, end)?;
        let total: u64 = bufs.iter().map(|b| b.bytes.next_multiple_of(256)).sum();
        prop_assert!(end <= total);
    }
}

/// Device sampling's scratch: aligned parts in order, one zeroing over the histogram, the candidate
/// counts and the row states, candidates a power of two at most the vocabulary's, a bitmap word per 32 ids;
/// the 27B workspace holds it for its step.
#[test]
fn sampling_scratch_layout() {
    use deltaserve_plan::SamplingScratch;
    use deltaserve_plan::workspace::{SAMPLE_BINS, SAMPLE_CANDIDATES};
    for (seqs, vocab) in [(1usize, 7usize), (8, 1000), (64, 248_320)] {
        let s = SamplingScratch::new(seqs, vocab);
        let parts = [
            s.params,
            s.partials,
            s.hist_count,
            s.hist_mass,
            s.cand_count,
            s.state,
            s.cand,
            s.out,
            s.penalties,
            s.penalty_bits,
        ];
        assert!(parts.windows(2).all(|w| w[0] < w[1]), "{parts:?}");
        assert!(parts.iter().all(|p| p % 256 == 0));
        assert!(s.hist_mass - s.hist_count >= (seqs * SAMPLE_BINS * 4) as u64);
        assert!(s.hist_count + s.zeroed_bytes >= s.state + 32 * seqs as u64 && s.hist_count + s.zeroed_bytes <= s.cand);
        assert!(s.candidates.is_power_of_two() && s.candidates <= SAMPLE_CANDIDATES);
        assert!(s.candidates >= vocab.min(SAMPLE_CANDIDATES));
        assert_eq!(s.penalty_words, vocab.div_ceil(32));
        assert!(s.bytes >= s.penalty_bits + (seqs * s.penalty_words * 4) as u64);
        assert!((1..=64).contains(&s.blocks));
    }
    let preset = Preset::parse("qwen3.6-27b").unwrap();
    let cfg = preset.config(None);
    let shape = StepShape {
        tokens: 2048,
        seqs: 8,
        act_bytes: 2,
        host_embed_elem: None,
        decode_partitions: 32,
        speculative: false,
    };
    let ws = plan_workspace(&cfg, &shape).unwrap();
    let buf = ws.get("sampling").unwrap();
    assert_eq!(buf.bytes, SamplingScratch::new(8, cfg.vocab_size).bytes);
    assert!(buf.offset + buf.bytes <= ws.bytes);
}
