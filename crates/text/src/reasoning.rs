//! Streaming split of Qwen3.5/3.6 output into reasoning (`<think>` … `</think>`) and content.
//!
//! # Format
//!
//! With thinking on (the default), the generation prompt ends in `<|im_start|>assistant\n<think>\n`,
//! so generated text starts *inside* the reasoning block: `REASONING\n</think>\n\nCONTENT`. With
//! `enable_thinking=false` the prompt already holds `<think>\n\n</think>\n\n` and everything
//! generated is content. Older-style outputs may also open with `<think>` themselves.
//!
//! # Rules (streaming and one-shot give the same result for every split of the input)
//!
//! * `<think>` is recognised only as the first non-whitespace text of the output (in either mode);
//!   it and the whitespace before it are dropped and reasoning starts. Anywhere else `<think>` is
//!   plain text (vLLM's qwen3 parser likewise strips a generated `<think>`).
//! * In reasoning, the first `</think>` ends reasoning; everything after it is content (a later
//!   `</think>` or `<think>` is plain content text), as in vLLM's qwen3 parser.
//! * Implicit end (Qwen3.5 sometimes opens a tool call without closing its thinking; vLLM's qwen3
//!   parser handles it the same way): in reasoning, `<tool_call>` followed by optional whitespace
//!   and `<function=` ends reasoning, and content starts *at* `<tool_call>` (the tag is kept, for
//!   the tool-call parser). A `<tool_call>` not followed by `<function=` stays reasoning text.
//!   Switch off with [`ReasoningParser::with_tool_call_ends_reasoning`].
//! * Newlines: unlike vLLM (which returns the raw text around the tags), we strip the newlines the
//!   format puts around the tags, the way the chat template does when it re-renders history
//!   (`reasoning | trim`, `content.lstrip('\n')`): reasoning never starts or ends with `\n`
//!   (leading `\n`s are dropped, and a run of `\n`s is held back until other text follows; at
//!   `</think>`, at the implicit end or at [`ReasoningParser::finish`] it is dropped), and content
//!   never starts with `\n` (leading `\n`s of the content phase are dropped, whether the phase
//!   starts at `</think>` or at the start of the output). Other whitespace is kept.
//! * Nothing is ever emitted as part of a tag: a possible partial tag at the end of the pushed
//!   text is held back until it is decided. [`ReasoningParser::finish`] flushes held text (a
//!   partial tag left at the end is plain text of the current phase).
//! * If the output ends while still in reasoning (truncated, or no `</think>`), all of it is
//!   reasoning and the content is empty — vLLM's behaviour with thinking on.

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_CALL_OPEN: &str = "<tool_call>";
const FUNCTION_OPEN: &str = "<function=";

/// Text split off by one [`ReasoningParser::push`] / [`ReasoningParser::finish`] call. Either or
/// both fields may be empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningDelta {
    /// Reasoning text (inside `<think>` … `</think>`), tags and format newlines removed.
    pub reasoning: String,
    /// Content text (after `</think>`).
    pub content: String,
}

impl ReasoningDelta {
    /// Whether both parts are empty.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace seen yet: a `<think>` may still open the output.
    Start,
    Reasoning,
    Content,
}

/// Streaming reasoning/content splitter; see the module docs for the exact rules.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    phase: Phase,
    starts_in_reasoning: bool,
    tool_call_ends_reasoning: bool,
    /// Pushed text not yet emitted.
    pending: String,
    /// Leading `\n`s of the current phase are still to be dropped.
    at_phase_start: bool,
}

/// Outcome of scanning reasoning text for its end.
enum Scan {
    /// No tag or possible tag start in the text.
    None,
    /// A tag may start at this byte offset; more text is needed to decide.
    Undecided(usize),
    /// Reasoning ends at `end`; content resumes at `resume`.
    End { end: usize, resume: usize },
}

impl ReasoningParser {
    /// A parser for one generated output. `starts_in_reasoning` is true when the prompt ends inside
    /// an open `<think>` block (Qwen3.5/3.6 with thinking on), false when thinking is off.
    pub fn new(starts_in_reasoning: bool) -> Self {
        Self {
            phase: Phase::Start,
            starts_in_reasoning,
            tool_call_ends_reasoning: true,
            pending: String::new(),
            at_phase_start: true,
        }
    }

    /// Whether `<tool_call>` + `<function=` inside reasoning ends it (default true).
    pub fn with_tool_call_ends_reasoning(mut self, on: bool) -> Self {
        self.tool_call_ends_reasoning = on;
        self
    }

    /// Whether the parser is (still) in the reasoning phase. Before the first non-whitespace text
    /// this reports the phase the output starts in.
    pub fn in_reasoning(&self) -> bool {
        match self.phase {
            Phase::Start => self.starts_in_reasoning,
            Phase::Reasoning => true,
            Phase::Content => false,
        }
    }

    /// Feed the next piece of generated text; returns what can be emitted now.
    pub fn push(&mut self, text: &str) -> ReasoningDelta {
        self.pending.push_str(text);
        let mut out = ReasoningDelta::default();
        self.process(&mut out, false);
        out
    }

    /// End of output: flush everything still held back.
    pub fn finish(&mut self) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        self.process(&mut out, true);
        out
    }

    /// One-shot split of a complete output: `(reasoning, content)`.
    pub fn split(text: &str, starts_in_reasoning: bool) -> (String, String) {
        let mut p = Self::new(starts_in_reasoning);
        let mut a = p.push(text);
        let b = p.finish();
        a.reasoning.push_str(&b.reasoning);
        a.content.push_str(&b.content);
        (a.reasoning, a.content)
    }

    fn enter(&mut self, phase: Phase) {
        self.phase = phase;
        self.at_phase_start = true;
    }

    /// At a phase's start, drops the newlines that open it; false while nothing else has come yet.
    fn past_opening_newlines(&mut self) -> bool {
        if self.at_phase_start {
            let n = self.pending.len() - self.pending.trim_start_matches('\n').len();
            self.pending.drain(..n);
            if self.pending.is_empty() {
                return false;
            }
            self.at_phase_start = false;
        }
        true
    }

    fn process(&mut self, out: &mut ReasoningDelta, eof: bool) {
        loop {
            match self.phase {
                Phase::Start => {
                    let t = self.pending.trim_start();
                    if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                        self.pending = rest.to_string();
                        self.enter(Phase::Reasoning);
                    } else if !eof && THINK_OPEN.starts_with(t) {
                        // Whitespace only, or a partial `<think>`: wait.
                        return;
                    } else {
                        let initial = if self.starts_in_reasoning { Phase::Reasoning } else { Phase::Content };
                        self.enter(initial);
                    }
                }
                Phase::Reasoning => {
                    if !self.past_opening_newlines() {
                        return;
                    }
                    match self.scan_reasoning() {
                        Scan::End { end, resume } => {
                            let r = self.pending[..end].trim_end_matches('\n');
                            out.reasoning.push_str(r);
                            self.pending.drain(..resume);
                            self.enter(Phase::Content);
                        }
                        Scan::Undecided(i) if !eof => {
                            let safe = self.pending[..i].trim_end_matches('\n').len();
                            out.reasoning.push_str(&self.pending[..safe]);
                            self.pending.drain(..safe);
                            return;
                        }
                        _ => {
                            if eof {
                                out.reasoning.push_str(self.pending.trim_end_matches('\n'));
                                self.pending.clear();
                            } else {
                                let safe = self.pending.trim_end_matches('\n').len();
                                out.reasoning.push_str(&self.pending[..safe]);
                                self.pending.drain(..safe);
                            }
                            return;
                        }
                    }
                }
                Phase::Content => {
                    if !self.past_opening_newlines() {
                        return;
                    }
                    out.content.push_str(&self.pending);
                    self.pending.clear();
                    return;
                }
            }
        }
    }

    /// Find the end of reasoning in `pending` (or the first place a tag may still start).
    fn scan_reasoning(&self) -> Scan {
        let s = self.pending.as_str();
        let mut pos = 0;
        while let Some(off) = s[pos..].find('<') {
            let i = pos + off;
            let rest = &s[i..];
            if rest.starts_with(THINK_CLOSE) {
                return Scan::End { end: i, resume: i + THINK_CLOSE.len() };
            }
            if THINK_CLOSE.starts_with(rest) {
                return Scan::Undecided(i);
            }
            if self.tool_call_ends_reasoning {
                if let Some(after) = rest.strip_prefix(TOOL_CALL_OPEN) {
                    let t = after.trim_start();
                    if t.starts_with(FUNCTION_OPEN) {
                        return Scan::End { end: i, resume: i };
                    }
                    if FUNCTION_OPEN.starts_with(t) {
                        return Scan::Undecided(i);
                    }
                } else if TOOL_CALL_OPEN.starts_with(rest) {
                    return Scan::Undecided(i);
                }
            }
            pos = i + 1;
        }
        Scan::None
    }
}
