//! Several choices of one prompt (`n` > 1): the prompt runs once as the first choice's sequence;
//! when its last chunk has run, the other choices fork from it (the scheduler shares its KV pages
//! and copies its state slot) and each samples its first token from its own copy of that logits
//! row, then decodes as a request of its own.

use deltaserve_backend::SeqChunk;
use deltaserve_sched::{SeqId, SeqOptions};
use tokio::sync::mpsc as tmpsc;

use super::{Command, EngineError, Event, Live, Request, RequestStream, Worker};

/// A choice waiting for its prompt to run.
pub(super) struct Choice {
    pub id: SeqId,
    pub req: Box<Request>,
    pub tx: tmpsc::UnboundedSender<Event>,
}

/// The requests of choices `1..n` of `req`: choice `i` samples with seed `seed + i` (its own random
/// seed without one) and under its own copy of the constraint.
pub(super) fn requests(req: &Request, n: usize) -> Result<Vec<Request>, EngineError> {
    (1..n)
        .map(|i| {
            let mut r = Request { constraint: None, ..req.clone() };
            r.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(i as u64));
            r.snapshot_on_finish = false;
            if let Some(c) = &req.constraint {
                let own = c.fork().ok_or_else(|| {
                    EngineError::Invalid("this request's output constraint allows one choice only".into())
                })?;
                r.constraint = Some(own);
            }
            Ok(r)
        })
        .collect()
}

/// The streams of choice `id` and of choices `id + 1..` (`reqs`), in order; the first choice's
/// sender; the other choices, to fork once the prompt has run.
pub(super) fn channels(
    id: SeqId,
    reqs: Vec<Request>,
    cmd: &std::sync::mpsc::Sender<Command>,
) -> (Vec<RequestStream>, tmpsc::UnboundedSender<Event>, Vec<Choice>) {
    let (tx, rx) = tmpsc::unbounded_channel();
    let mut streams = vec![RequestStream { id, rx, cancel: Some(cmd.clone()) }];
    let mut forks = Vec::with_capacity(reqs.len());
    for (i, req) in reqs.into_iter().enumerate() {
        let (tx, rx) = tmpsc::unbounded_channel();
        let cid = id + 1 + i as u64;
        forks.push(Choice { id: cid, req: Box::new(req), tx });
        streams.push(RequestStream { id: cid, rx, cancel: Some(cmd.clone()) });
    }
    (streams, tx, forks)
}

impl Worker {
    /// Forks the choices waiting on the sequences whose logits rows `logits` holds (the rows of
    /// `seqs`, in order): each gets a sequence of its own and a copy of its parent's row, returned.
    pub(super) fn fork_choices(&mut self, seqs: &[SeqChunk], logits: &[f32]) -> Vec<(SeqId, Vec<f32>)> {
        let mut out = Vec::new();
        let mut row = 0;
        for c in seqs {
            // A plain chunk's last row is the one its choices fork from.
            let at = row + c.logits_rows().saturating_sub(1);
            row += c.logits_rows();
            let Some(parent) = self.reqs.get_mut(&c.seq_id).filter(|l| c.want_logits && !l.forks.is_empty()) else {
                continue;
            };
            let forks = std::mem::take(&mut parent.forks);
            let (submitted, admitted, steps, step_s) =
                (parent.submitted, parent.admitted, parent.prefill_steps, parent.prefill_step_s);
            let images = parent.images.clone();
            let Some(parent_row) = logits.get(at * self.vocab..(at + 1) * self.vocab) else { continue };
            for f in forks {
                let opts =
                    SeqOptions { no_drafts: !super::drafts_under(f.req.constraint.as_ref()), ..SeqOptions::default() };
                if let Err(e) = self.sched.fork(c.seq_id, f.id, opts) {
                    let _ = f.tx.send(Event::Error(e.into()));
                    continue;
                }
                let mut live = Live::new(*f.req, f.tx, submitted, self.valid_vocab);
                (live.admitted, live.prefill_steps, live.prefill_step_s, live.forked) = (admitted, steps, step_s, true);
                live.images = images.clone();
                self.reqs.insert(f.id, live);
                out.push((f.id, parent_row.to_vec()));
            }
        }
        out
    }

    /// Forgets choice `id` if it is still waiting for its prompt (its client went away).
    pub(super) fn drop_pending_choice(&mut self, id: SeqId) {
        for live in self.reqs.values_mut() {
            live.forks.retain(|c| c.id != id);
        }
    }
}
