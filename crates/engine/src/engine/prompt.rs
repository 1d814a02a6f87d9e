//! Prompt log-probabilities: the rows of a chunk that wants every row's logits, turned into each
//! prompt token's log-probability and its most likely alternatives, sent in prompt order.

use deltaserve_backend::SeqChunk;
use deltaserve_backend::sampling::{PARALLEL_PICK_VOCAB, map_rows};

use super::{Event, Worker, token_logprob};

impl Worker {
    /// Sends what `rows` — chunk `c`'s logits rows, row i the distribution of the token after position
    /// `c.start + i` — give for the prompt tokens its request has not been sent yet: each one's
    /// log-probability, its request's number of most likely ids, and its rank among the valid ids.
    pub(super) fn send_prompt_logprobs(&mut self, c: &SeqChunk, rows: &[&mut [f32]]) {
        let valid = self.valid_vocab;
        let Some(live) = self.reqs.get_mut(&c.seq_id) else { return };
        let Some(top) = live.req.prompt_logprobs else { return };
        let prompt = &live.req.prompt;
        let first = live.prompt_scored.max(c.start + 1);
        let end = (c.start + 1 + rows.len()).min(prompt.len());
        if first >= end {
            return;
        }
        let mut items: Vec<(&[f32], u32)> = (first..end).map(|p| (&*rows[p - 1 - c.start], prompt[p])).collect();
        let parallel = self.vocab >= PARALLEL_PICK_VOCAB;
        let scored = map_rows(&mut items, parallel, |(row, token)| {
            let row = &row[..valid.min(row.len())];
            let rank = 1 + row.get(*token as usize).map_or(row.len(), |&x| row.iter().filter(|&&y| y > x).count());
            (token_logprob(row, valid, *token, top), rank)
        });
        let (logprobs, ranks) = scored.into_iter().unzip();
        let tokens = prompt[first..end].to_vec();
        live.prompt_scored = end;
        let _ = live.tx.send(Event::PromptLogprobs { from: first, tokens, logprobs, ranks });
    }
}
