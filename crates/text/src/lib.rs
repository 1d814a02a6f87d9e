//! deltaserve-text: everything between text and token ids for Qwen3.5/3.6 models — the HF
//! tokenizer wrapper, HF-parity chat-template rendering, per-message prompt encoding with a cache,
//! streaming detokenisation, stop strings, a synthetic tokenizer for test models, and complete synthetic
//! model directories ([`synth_model`]: weights from `deltaserve-model`, this crate's tokenizer; the
//! built-in demo model).

mod bytelevel;
mod error;
mod incremental;
mod prompt_cache;
mod pyjson;
mod pyloads;
mod reasoning;
mod stop;
mod strftime;
mod structured;
mod synth;
pub mod synth_model;
mod template;
mod tokenizer;
mod toolcall;

pub use error::TextError;
pub use incremental::IncrementalDecoder;
pub use prompt_cache::{PromptCacheStats, PromptEncoder};
pub use pyloads::check_json_object;
pub use reasoning::{ReasoningDelta, ReasoningParser};
pub use stop::{StopMatcher, StopOutput};
pub use structured::{Grammar, GrammarCompiler, GrammarMatcher};
pub use synth::{
    QWEN35_SPLIT_REGEX, SPECIAL_TOKENS, is_special_token, synthetic_tokenizer_config_json,
    synthetic_tokenizer_config_json_for, synthetic_tokenizer_json,
};
pub use template::{ChatRequest, ChatTemplate};
pub use tokenizer::Tokenizer;
pub use toolcall::{ToolCall, ToolCallParser, ToolEvent, collect_events, parse_complete};

/// deltaserve's chat template in the Qwen3.5/3.6 format (ChatML, tools block with XML tool-call
/// instructions, `<think>` handling with `enable_thinking` / `preserve_thinking`, tool results
/// merged into user turns). Written for this project from the format description.
pub const QWEN35_CHAT_TEMPLATE: &str = include_str!("qwen35_chat_template.jinja");
