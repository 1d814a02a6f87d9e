//! Chunk boundaries never change results: a prompt fed in pieces of random sizes, then decoded token
//! by token, gives the logits of one full pass (within f32 rounding), and the recurrent-only mode
//! gives the same as the chunked mode.

use std::sync::OnceLock;

use deltaserve_cpu::{CpuModel, GdnMode, Logits};
use deltaserve_model::synth::{Preset, write_model};
use proptest::prelude::*;

fn model() -> &'static CpuModel {
    static M: OnceLock<CpuModel> = OnceLock::new();
    M.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ds-chunking-{}", std::process::id()));
        write_model(&dir, Preset::Tiny, None, 11, |_, _| {}).unwrap();
        CpuModel::load(&dir).unwrap()
    })
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_split_points_equal_one_pass(
        tokens in prop::collection::vec(0u32..1024, 2..260),
        cuts in prop::collection::vec(1usize..90, 1..12),
        decode in 0usize..6,
    ) {
        let m = model();
        let n = tokens.len() - decode.min(tokens.len() - 1);
        let mut st = m.new_sequence();
        let full = m.forward(&mut st, &tokens, GdnMode::Auto, Logits::All).unwrap();

        let mut st = m.new_sequence();
        let mut got = Vec::new();
        let mut at = 0;
        for c in cuts.iter().cycle() {
            if at >= n { break; }
            let end = (at + c).min(n);
            got.extend(m.forward(&mut st, &tokens[at..end], GdnMode::Auto, Logits::All).unwrap());
            at = end;
        }
        for &t in &tokens[n..] {
            got.extend(m.forward(&mut st, &[t], GdnMode::Auto, Logits::All).unwrap());
        }
        prop_assert_eq!(st.len, tokens.len());
        let e = rel_err(&got, &full);
        prop_assert!(e < 1e-4, "pieces vs one pass: {e:.3e}");

        let mut st = m.new_sequence();
        let rec = m.forward(&mut st, &tokens, GdnMode::Recurrent, Logits::All).unwrap();
        let e = rel_err(&rec, &full);
        prop_assert!(e < 1e-4, "recurrent vs chunked: {e:.3e}");
    }
}

#[test]
fn last_logits_equal_the_last_row_of_all() {
    let m = model();
    let tokens: Vec<u32> = (0..70).map(|i| (i * 37 % 1024) as u32).collect();
    let all = m.forward(&mut m.new_sequence(), &tokens, GdnMode::Auto, Logits::All).unwrap();
    let last = m.forward(&mut m.new_sequence(), &tokens, GdnMode::Auto, Logits::Last).unwrap();
    assert_eq!(&all[69 * 1024..], &last[..]);
}
