//! From engine events to API-neutral output events: the text stream is split into reasoning and
//! content (`<think>` … `</think>`), the content into plain text and tool calls (Qwen3 XML format →
//! JSON arguments), and timing goes to the metrics. Both the OpenAI and the Anthropic handlers,
//! streaming or not, consume the same [`OutputStream`].

use std::sync::Arc;
use std::time::Instant;

use deltaserve_engine::{Event, FinishReason, RequestStream, Timing, TokenLogprob, Usage};
use deltaserve_text::{ReasoningDelta, ReasoningParser, Tokenizer, ToolCallParser, ToolEvent};

use crate::error::ApiError;
use crate::metrics::Metrics;

/// A prompt token scored given the tokens before it: its log-probability, the most likely ids there,
/// and its rank among them (1: the most likely).
#[derive(Clone, Debug)]
pub struct PromptToken {
    pub id: u32,
    pub logprob: TokenLogprob,
    pub rank: usize,
}

/// How to interpret the generated text.
#[derive(Clone, Debug, Default)]
pub struct Parsing {
    /// `Some(starts_inside)`: split reasoning; `starts_inside` when the prompt opened `<think>`.
    pub reasoning: Option<bool>,
    /// Tools offered to the model (OpenAI `tools` or Anthropic tools converted to that shape).
    pub tools: Option<Vec<serde_json::Value>>,
    /// Tool calls are written under the tool-call grammar: a parameter value ends where the
    /// grammar ends it ([`ToolCallParser::grammar_values`]).
    pub grammar_values: bool,
}

/// Why the output ended, in API-neutral terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token.
    Stop,
    /// A stop string matched (given).
    StopString(String),
    Length,
    /// The model ended its turn after calling tools.
    ToolCalls,
}

impl Finish {
    /// The matched stop string as JSON (`null` for other reasons).
    pub fn stop_string(&self) -> serde_json::Value {
        match self {
            Self::StopString(s) => serde_json::Value::String(s.clone()),
            _ => serde_json::Value::Null,
        }
    }
}

/// One piece of parsed output.
#[derive(Clone, Debug)]
pub enum OutEvent {
    Reasoning(String),
    Content(String),
    ToolStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolArgs {
        index: usize,
        delta: String,
    },
    ToolEnd {
        index: usize,
    },
    /// A generated token with its logprobs (only when requested).
    Token {
        id: u32,
        text: String,
        logprob: TokenLogprob,
    },
    /// Prompt tokens' log-probabilities, in prompt order from token 1 (only for requests that asked;
    /// see [`deltaserve_engine::Event::PromptLogprobs`]).
    PromptLogprobs(Vec<PromptToken>),
    /// The prompt has advanced (only for requests that asked; see [`deltaserve_engine::Event::Prefill`]).
    Progress {
        processed: usize,
        total: usize,
        cached: usize,
        elapsed_ms: f64,
    },
    Done {
        finish: Finish,
        usage: Usage,
        timing: Timing,
    },
}

pub struct OutputStream {
    inner: RequestStream,
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolCallParser>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    started: Instant,
    last_token: Option<Instant>,
    calls: usize,
    done: bool,
    /// Count the prompt's tokens in the metrics (all but the first of several choices do not).
    count_prompt: bool,
}

impl OutputStream {
    pub fn new(inner: RequestStream, parsing: Parsing, tokenizer: Arc<Tokenizer>, metrics: Arc<Metrics>) -> Self {
        Self {
            inner,
            reasoning: parsing.reasoning.map(ReasoningParser::new),
            tools: parsing.tools.as_deref().map(|t| {
                let p = ToolCallParser::new(t);
                if parsing.grammar_values { p.grammar_values() } else { p }
            }),
            tokenizer,
            metrics,
            started: Instant::now(),
            last_token: None,
            calls: 0,
            done: false,
            count_prompt: true,
        }
    }

    /// The same, not counting the prompt's tokens in the metrics (another choice of a prompt).
    pub fn without_prompt(mut self) -> Self {
        self.count_prompt = false;
        self
    }

    pub fn tokenizer(&self) -> Arc<Tokenizer> {
        self.tokenizer.clone()
    }

    /// The next batch of output events; `None` after `Done` (or an error).
    pub async fn next(&mut self) -> Option<Result<Vec<OutEvent>, ApiError>> {
        if self.done {
            return None;
        }
        let event = self.inner.next().await;
        Some(self.on_event(event))
    }

    fn on_event(&mut self, event: Option<Event>) -> Result<Vec<OutEvent>, ApiError> {
        let mut out = Vec::new();
        match event {
            Some(Event::Token { id, text, logprob }) => {
                let now = Instant::now();
                match self.last_token {
                    None => self.metrics.ttft(now.duration_since(self.started).as_secs_f64()),
                    Some(t) => self.metrics.inter_token(now.duration_since(t).as_secs_f64()),
                }
                self.last_token = Some(now);
                if let Some(lp) = logprob {
                    let piece = self.tokenizer.decode(&[id], false).unwrap_or_default();
                    out.push(OutEvent::Token { id, text: piece, logprob: lp });
                }
                let delta = self.split_reasoning(&text, false);
                self.route(delta, &mut out, false);
            }
            Some(Event::Finished { reason, usage, timing }) => {
                let delta = self.split_reasoning("", true);
                self.route(delta, &mut out, true);
                self.metrics.finished(&timing);
                let (prompt, cached) =
                    if self.count_prompt { (usage.prompt_tokens, usage.cached_tokens) } else { (0, 0) };
                self.metrics.tokens(prompt, usage.completion_tokens, cached);
                let finish = match reason {
                    FinishReason::Stop if self.calls > 0 => Finish::ToolCalls,
                    FinishReason::Stop => Finish::Stop,
                    FinishReason::StopString(s) => Finish::StopString(s),
                    FinishReason::Length => Finish::Length,
                };
                out.push(OutEvent::Done { finish, usage, timing });
                self.done = true;
            }
            Some(Event::Prefill { processed, total, cached, elapsed_ms }) => {
                out.push(OutEvent::Progress { processed, total, cached, elapsed_ms });
            }
            Some(Event::PromptLogprobs { tokens, logprobs, ranks, .. }) => {
                let scored = tokens.into_iter().zip(logprobs).zip(ranks);
                out.push(OutEvent::PromptLogprobs(
                    scored.map(|((id, logprob), rank)| PromptToken { id, logprob, rank }).collect(),
                ));
            }
            Some(Event::Error(e)) => {
                self.done = true;
                return Err(e.into());
            }
            None => {
                self.done = true;
                return Err(ApiError::Unavailable("the engine stopped".into()));
            }
        }
        Ok(out)
    }

    fn split_reasoning(&mut self, text: &str, finish: bool) -> ReasoningDelta {
        match &mut self.reasoning {
            Some(p) => {
                let mut d = p.push(text);
                if finish {
                    let f = p.finish();
                    d.reasoning.push_str(&f.reasoning);
                    d.content.push_str(&f.content);
                }
                d
            }
            None => ReasoningDelta { reasoning: String::new(), content: text.to_string() },
        }
    }

    fn route(&mut self, delta: ReasoningDelta, out: &mut Vec<OutEvent>, finish: bool) {
        if !delta.reasoning.is_empty() {
            out.push(OutEvent::Reasoning(delta.reasoning));
        }
        let events = match &mut self.tools {
            Some(p) => {
                let mut ev = p.push(&delta.content);
                if finish {
                    ev.extend(p.finish());
                }
                ev
            }
            None if delta.content.is_empty() => Vec::new(),
            None => vec![ToolEvent::Content(delta.content)],
        };
        for e in events {
            out.push(match e {
                ToolEvent::Content(s) => OutEvent::Content(s),
                ToolEvent::Start { index, id, name } => {
                    self.calls += 1;
                    OutEvent::ToolStart { index, id, name }
                }
                ToolEvent::ArgumentsDelta { index, delta } => OutEvent::ToolArgs { index, delta },
                ToolEvent::End { index } => OutEvent::ToolEnd { index },
            });
        }
    }
}

/// The usage of several choices of one prompt: the prompt counted once, the completions summed.
pub fn combined_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>) -> Usage {
    let mut total: Option<Usage> = None;
    for u in usages {
        match &mut total {
            None => total = Some(u.clone()),
            Some(t) => t.completion_tokens += u.completion_tokens,
        }
    }
    total.unwrap_or_default()
}

/// The output batches of several choices as they come, each with its choice's index; a choice's
/// last batch is its `Done` or its error. Dropping the receiver cancels every choice (each choice's
/// task ends, dropping its stream, at its next batch).
pub fn merged(outs: Vec<OutputStream>) -> tokio::sync::mpsc::Receiver<(usize, Result<Vec<OutEvent>, ApiError>)> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    for (i, mut out) in outs.into_iter().enumerate() {
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(batch) = out.next().await {
                if tx.send((i, batch)).await.is_err() {
                    return;
                }
            }
        });
    }
    rx
}

/// A whole output, for non-streaming responses.
#[derive(Clone, Debug, Default)]
pub struct Collected {
    pub reasoning: String,
    pub content: String,
    /// (id, name, JSON arguments)
    pub tool_calls: Vec<(String, String, String)>,
    pub tokens: Vec<(u32, String, TokenLogprob)>,
    /// The prompt's tokens' log-probabilities from token 1 on, when asked.
    pub prompt_logprobs: Vec<PromptToken>,
    pub finish: Option<Finish>,
    pub usage: Usage,
    pub timing: Timing,
}

impl Collected {
    pub fn add(&mut self, e: OutEvent) {
        match e {
            OutEvent::Reasoning(s) => self.reasoning.push_str(&s),
            OutEvent::Content(s) => self.content.push_str(&s),
            OutEvent::ToolStart { id, name, .. } => self.tool_calls.push((id, name, String::new())),
            OutEvent::ToolArgs { index, delta } => {
                if let Some(c) = self.tool_calls.get_mut(index) {
                    c.2.push_str(&delta);
                }
            }
            OutEvent::ToolEnd { .. } => {}
            OutEvent::Token { id, text, logprob } => self.tokens.push((id, text, logprob)),
            OutEvent::Progress { .. } => {}
            OutEvent::PromptLogprobs(p) => self.prompt_logprobs.extend(p),
            OutEvent::Done { finish, usage, timing } => {
                self.finish = Some(finish);
                self.usage = usage;
                self.timing = timing;
            }
        }
    }

    /// Runs a stream to its end.
    pub async fn collect(mut stream: OutputStream) -> Result<Self, ApiError> {
        let mut c = Self::default();
        while let Some(events) = stream.next().await {
            for e in events? {
                c.add(e);
            }
        }
        Ok(c)
    }

    /// Runs the streams of several choices to their ends (the engine runs them together; each
    /// buffers its events until read).
    pub async fn collect_all(streams: Vec<OutputStream>) -> Result<Vec<Self>, ApiError> {
        let mut all = Vec::with_capacity(streams.len());
        for s in streams {
            all.push(Self::collect(s).await?);
        }
        Ok(all)
    }
}
