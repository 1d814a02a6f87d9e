//! `StopMatcher`: finds stop strings in streamed text, holding back any tail that could still
//! grow into a stop string so that no part of a stop string is ever emitted.

/// Result of one [`StopMatcher::push`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text that is safe to show now.
    pub emit: String,
    /// The stop string that matched, if any; `emit` then holds the text before it.
    pub stopped: Option<String>,
}

/// Streaming stop-string matcher.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    done: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self { stops, held: String::new(), done: false }
    }

    /// Adds text. After a stop has matched, further pushes emit nothing.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.done {
            return StopOutput::default();
        }
        self.held.push_str(text);
        // Earliest match wins; on equal starts the longer stop string wins.
        let mut best: Option<(usize, &String)> = None;
        for stop in &self.stops {
            if let Some(pos) = self.held.find(stop.as_str()) {
                let better = match best {
                    None => true,
                    Some((p, s)) => pos < p || (pos == p && stop.len() > s.len()),
                };
                if better {
                    best = Some((pos, stop));
                }
            }
        }
        if let Some((pos, stop)) = best {
            let stopped = Some(stop.clone());
            let emit = self.held[..pos].to_string();
            self.held.clear();
            self.done = true;
            return StopOutput { emit, stopped };
        }
        let keep = self.partial_suffix_len();
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutput { emit, stopped: None }
    }

    /// Ends the stream: returns the held-back text (empty after a stop matched).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// True once a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.done
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_suffix_len(&self) -> usize {
        let mut keep = 0;
        for stop in &self.stops {
            let max = stop.len().saturating_sub(1).min(self.held.len());
            for len in (keep + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start) && stop.starts_with(&self.held[start..]) {
                    keep = len;
                    break;
                }
            }
        }
        keep
    }
}
