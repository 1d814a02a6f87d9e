//! A thinking budget: the reply's reasoning is closed after a number of tokens, so a thinking model cannot
//! spend the whole `max_tokens` inside `<think>` and leave no answer. As vLLM's `thinking_token_budget`
//! does it, the sampler forces the end of the reasoning once the budget is spent (here `\n</think>`; what
//! follows, the template's blank line and the answer, is the model's or a structured output's) and the model
//! goes on to answer. Asked as vLLM's `thinking_token_budget`
//! (SGLang's `thinking_budget`, llama.cpp's `thinking_budget_tokens`) on chat completions, and as Anthropic's
//! `thinking.budget_tokens`.

use deltaserve_engine::{Request, SharedConstraint, TokenConstraint};

use crate::error::ApiError;
use crate::output::Parsing;
use crate::state::AppState;

/// The budget's state over the reply, with the constraint it was put over (a structured output, allowed
/// ids), which keeps deciding every token the budget does not force.
pub struct ThinkingBudget {
    /// Reasoning tokens still allowed before the close is forced.
    left: usize,
    /// The close: its tokens, and how many of them have been emitted once forcing began.
    close: Vec<u32>,
    forced: usize,
    /// `</think>`: the reasoning is over once it is emitted, forced or not.
    think_end: u32,
    done: bool,
    inner: Option<SharedConstraint>,
}

impl ThinkingBudget {
    /// A budget of `budget` reasoning tokens, closing with `close` (which holds `think_end`).
    pub fn new(budget: usize, close: Vec<u32>, think_end: u32, inner: Option<SharedConstraint>) -> Self {
        Self { left: budget, close, forced: 0, think_end, done: false, inner }
    }

    /// The token the budget forces next, if it forces one.
    fn forcing(&self) -> Option<u32> {
        if self.done || self.left > 0 { None } else { self.close.get(self.forced).copied() }
    }

    /// Follows `token` (the budget's part of [`TokenConstraint::accept`]).
    fn step(&mut self, token: u32) {
        if self.done {
            return;
        }
        if token == self.think_end {
            self.done = true;
        } else if self.forcing().is_some() {
            self.forced += 1;
        } else {
            self.left = self.left.saturating_sub(1);
        }
    }
}

impl TokenConstraint for ThinkingBudget {
    fn mask(&mut self, row: &mut [f32]) {
        match self.forcing() {
            Some(t) => {
                for (id, l) in row.iter_mut().enumerate() {
                    if id as u32 != t {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            None => {
                if let Some(c) = &self.inner {
                    c.with(|c| c.mask(row));
                }
            }
        }
    }

    fn allowed(&mut self, bits: &mut [u32]) {
        match (self.forcing(), &self.inner) {
            (Some(t), _) => {
                bits.fill(0);
                if let Some(w) = bits.get_mut(t as usize / 32) {
                    *w |= 1 << (t % 32);
                }
            }
            (None, Some(c)) => c.with(|c| c.allowed(bits)),
            (None, None) => bits.fill(u32::MAX),
        }
    }

    fn accept(&mut self, token: u32) {
        self.step(token);
        if let Some(c) = &self.inner {
            c.with(|c| c.accept(token));
        }
    }

    fn allows_prefix(&mut self, tokens: &[u32]) -> Option<usize> {
        let inner = match &self.inner {
            Some(c) => c.with(|c| c.allows_prefix(tokens))?,
            None => tokens.len(),
        };
        // The budget's own rule, followed on a copy of its state.
        let mut sim = Self { close: self.close.clone(), inner: None, ..*self };
        let mut n = 0;
        for &t in &tokens[..inner] {
            if sim.forcing().is_some_and(|f| f != t) {
                break;
            }
            sim.step(t);
            n += 1;
        }
        Some(n)
    }

    fn fork(&self) -> Option<SharedConstraint> {
        let inner = match &self.inner {
            Some(c) => Some(c.fork()?),
            None => None,
        };
        Some(SharedConstraint::new(Self { close: self.close.clone(), inner, ..*self }))
    }
}

/// Puts the budget over `req`'s constraint where its reply starts inside `<think>` (`parsing`) and may run
/// past the budget (`max_tokens`); any other request is left as it is (a constrained request gives up the
/// plain greedy picks on the device). `field`: the field that asked (for errors).
pub fn budget(st: &AppState, budget: usize, req: &mut Request, parsing: &Parsing, field: &str) -> Result<(), ApiError> {
    if parsing.reasoning != Some(true) || budget >= req.max_tokens {
        return Ok(());
    }
    let think_end = st.tokenizer.token_id("</think>").ok_or_else(|| {
        ApiError::bad_param(field, format!("`{field}` needs a model whose vocabulary has `</think>`"))
    })?;
    let close = st
        .tokenizer
        .encode("\n</think>")
        .map_err(|e| ApiError::bad_param(field, format!("the close of the reasoning does not tokenize: {e}")))?;
    if !close.contains(&think_end) {
        return Err(ApiError::bad_param(field, "the close of the reasoning does not hold `</think>` as one token"));
    }
    let inner = req.constraint.take();
    req.constraint = Some(SharedConstraint::new(ThinkingBudget::new(budget, close, think_end, inner)));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const END: u32 = 9;

    fn budget(n: usize) -> ThinkingBudget {
        ThinkingBudget::new(n, vec![1, END, 2], END, None)
    }

    fn allowed(b: &mut ThinkingBudget) -> Vec<u32> {
        let mut bits = [0u32; 1];
        b.allowed(&mut bits);
        (0..32).filter(|i| bits[0] >> i & 1 == 1).collect()
    }

    #[test]
    fn the_close_is_forced_once_the_budget_is_spent() {
        let mut b = budget(2);
        assert_eq!(allowed(&mut b).len(), 32, "free while the budget lasts");
        b.accept(5);
        b.accept(6);
        assert_eq!(allowed(&mut b), [1]);
        let mut row = vec![0.0f32; 12];
        b.mask(&mut row);
        assert!(row.iter().enumerate().all(|(i, &l)| (i == 1) == l.is_finite()));
        b.accept(1);
        assert_eq!(allowed(&mut b), [END]);
        b.accept(END);
        assert_eq!(allowed(&mut b).len(), 32, "free again once the reasoning is closed");
        b.accept(4);
        assert_eq!(allowed(&mut b).len(), 32);
    }

    #[test]
    fn a_reasoning_closed_in_time_is_left_alone() {
        let mut b = budget(3);
        b.accept(5);
        b.accept(END);
        for t in [4, 4, 4, 4] {
            assert_eq!(allowed(&mut b).len(), 32);
            b.accept(t);
        }
    }

    #[test]
    fn drafts_follow_the_forced_tokens() {
        let mut b = budget(2);
        assert_eq!(b.allows_prefix(&[5, 6, 1, END, 2, 7]), Some(6));
        assert_eq!(b.allows_prefix(&[5, 6, 7]), Some(2), "the draft after the budget must be the close");
        assert_eq!(b.allows_prefix(&[5, END, 7, 7]), Some(4), "the model closed it itself");
        // Following nothing: the state is unchanged.
        assert_eq!(allowed(&mut b).len(), 32);
        let f = b.fork().unwrap();
        b.accept(5);
        b.accept(6);
        assert_eq!(allowed(&mut b), [1]);
        f.with(|c| {
            let mut bits = [0u32; 1];
            c.allowed(&mut bits);
            assert_eq!(bits[0], u32::MAX, "the fork keeps its own count");
        });
    }
}
