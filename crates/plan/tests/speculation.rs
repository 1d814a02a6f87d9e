//! Speculative decoding in the plan: the MTP head's weights (`docs/architecture.md` §5.2), its KV in every page, the pending
//! hidden per slot, K + 1 logit rows per sequence and the verify workspace; refused without a head.

use deltaserve_model::ModelConfig;
use deltaserve_model::synth::Preset;
use deltaserve_plan::{Plan, PlanError, PlanOptions};

const GIB: u64 = 1 << 30;

fn cfg(mtp: bool) -> ModelConfig {
    let mut json = Preset::Qwen36_27b.config_json(None);
    if !mtp {
        json["text_config"]["mtp_num_hidden_layers"] = serde_json::json!(0);
    }
    ModelConfig::from_json_str(&json.to_string()).unwrap()
}

#[test]
fn speculation_accounts_for_the_head_its_kv_and_the_verify_workspace() {
    let c = cfg(true);
    let off = Plan::new(&c, &PlanOptions::gpu_defaults(80 * GIB)).unwrap();
    let on = Plan::new(&c, &PlanOptions { speculative_tokens: 3, ..PlanOptions::gpu_defaults(80 * GIB) }).unwrap();
    // §6: the MTP head has 424,699,392 parameters; bf16 linears + norms (each tensor 256-B aligned).
    let mtp = on.weights_bytes - off.weights_bytes;
    assert_eq!(on.weight_parts.mtp, mtp);
    assert!((424_699_392 * 2..424_699_392 * 2 + 16 * 256).contains(&mtp), "{mtp}");
    // 16 attention layers + the head's.
    assert_eq!(on.kv_bytes_per_token * 16, off.kv_bytes_per_token * 17);
    // The pending hidden row (bf16) per slot and snapshot.
    assert_eq!(on.state_bytes_per_seq, off.state_bytes_per_seq + 5120 * 2);
    // 1 + K logit rows per sequence.
    assert_eq!(on.logits_bytes, off.logits_bytes * 4);
    let ws = on.region("speculation").expect("a speculation region");
    // Per verified position: hidden row, DeltaNet recurrence inputs, attention partials (16 splits × 24
    // heads × (256 + 2)).
    let per_pos = 5120 + 48 * (10240 + 2 * 2048 + 6144 + 2 * 48) + 16 * 24 * 258;
    assert_eq!(ws.bytes, 16 * (4 * per_pos + 3 * 248_320) * 4);
    assert!(off.region("speculation").is_none());
    assert!(on.num_kv_pages < off.num_kv_pages);
}

#[test]
fn speculation_needs_a_head_and_at_most_four_drafts() {
    let e = Plan::new(&cfg(false), &PlanOptions { speculative_tokens: 2, ..PlanOptions::gpu_defaults(80 * GIB) });
    assert!(matches!(&e, Err(PlanError::InvalidOption { reason, .. }) if reason.contains("no MTP head")), "{e:?}");
    let e = Plan::new(&cfg(true), &PlanOptions { speculative_tokens: 5, ..PlanOptions::gpu_defaults(80 * GIB) });
    assert!(matches!(&e, Err(PlanError::InvalidOption { .. })), "{e:?}");
}
