//! Progress of a command made of long steps (`probe`'s rungs and turns): a bar with the step running and
//! its elapsed time when stderr is a terminal, `info` log lines numbered `[step/total]` otherwise.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    total: usize,
    done: usize,
}

impl Progress {
    /// `total` steps; the bar only on a terminal.
    pub(crate) fn new(total: usize) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total as u64);
            if let Ok(style) = ProgressStyle::with_template("[{pos}/{len}] {bar:30} {msg} ({elapsed})") {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self { bar, total, done: 0 }
    }

    /// A step begins: shown on the bar, or logged as `[n/total] step`.
    pub(crate) fn start(&mut self, step: &str) {
        match &self.bar {
            Some(bar) => bar.set_message(step.to_string()),
            None => tracing::info!("{}", self.line(step)),
        }
    }

    /// A step ended with `summary` (a log line either way, above the bar on a terminal).
    pub(crate) fn finish_step(&mut self, summary: &str) {
        self.done += 1;
        self.log(summary);
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    /// A log line that does not break the bar.
    pub(crate) fn log(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| tracing::info!("{line}")),
            None => tracing::info!("{line}"),
        }
    }

    /// `[n/total] step`, n the step about to run.
    fn line(&self, step: &str) -> String {
        format!("[{}/{}] {step}", (self.done + 1).min(self.total), self.total)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_numbered() {
        let mut p = Progress { bar: None, total: 3, done: 0 };
        assert_eq!(p.line("rung 25%"), "[1/3] rung 25%");
        p.finish_step("rung 25%: done");
        p.finish_step("rung 50%: done");
        assert_eq!(p.line("turn 1"), "[3/3] turn 1");
    }
}
