//! Synthetic agent-session texts for the load tools (`soak`, `probe`), deterministic from a seed: a system
//! prompt with tools, tasks, log-like tool output and user follow-ups of chosen sizes.

use serde_json::{Value, json};
/// splitmix64.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed ^ 0x5eed_50a4_d311_7a5e)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(crate) fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

pub(crate) const DIRS: &[&str] = &["sched", "engine", "server", "text", "model", "cpu", "plan", "backend"];
pub(crate) const FILES: &[&str] =
    &["lib", "state", "cache", "request", "output", "metrics", "routes", "config", "worker"];
pub(crate) const IDENTS: &[&str] = &[
    "prefix", "snapshot", "page", "slot", "tokens", "budget", "queue", "stream", "request", "batch", "chunk", "state",
    "window", "usage", "cursor", "limit", "entry", "handle",
];
pub(crate) const LEVELS: &[&str] = &["INFO", "INFO", "INFO", "DEBUG", "WARN"];

pub(crate) fn system_prompt() -> String {
    "You are a coding agent working in a Rust repository. Use the tools to inspect files, run commands and search \
     the code. Think step by step, keep answers short, and call one tool at a time. When the task is done, reply \
     with a summary of the change."
        .into()
}

pub(crate) fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "description": "Path relative to the repository root."},
                "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
                "required": ["path"]}}},
        {"type": "function", "function": {
            "name": "run_command",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string"}, "timeout_s": {"type": "integer"}},
                "required": ["command"]}}},
        {"type": "function", "function": {
            "name": "search_code",
            "description": "Search the repository for a regular expression.",
            "parameters": {"type": "object", "properties": {
                "pattern": {"type": "string"}, "path": {"type": "string"}},
                "required": ["pattern"]}}}
    ])
}

pub(crate) fn task(rng: &mut Rng) -> String {
    let (d, f, i) = (rng.pick(DIRS), rng.pick(FILES), rng.pick(IDENTS));
    format!(
        "The test `{d}::{f}::tests::{i}_is_restored` fails after the last change to crates/{d}/src/{f}.rs. Find out \
         why and fix it without changing the public API."
    )
}

/// One line of synthetic tool output.
pub(crate) fn line(rng: &mut Rng) -> String {
    let (d, f, a, b) = (rng.pick(DIRS), rng.pick(FILES), rng.pick(IDENTS), rng.pick(IDENTS));
    match rng.below(4) {
        0 => format!("crates/{d}/src/{f}.rs:{}:    let {a}_{b} = self.{a}.get(&{b})?;", 1 + rng.below(900)),
        1 => format!(
            "2026-03-{:02}T{:02}:{:02}:{:02}Z {} {d}::{f}: {a} {b}={} took {}ms",
            1 + rng.below(28),
            rng.below(24),
            rng.below(60),
            rng.below(60),
            rng.pick(LEVELS),
            rng.below(100_000),
            rng.below(500)
        ),
        2 => format!("test {d}::{f}::tests::{a}_{b} ... {}", if rng.below(9) == 0 { "FAILED" } else { "ok" }),
        _ => format!(
            "    fn {a}_{b}(&mut self, {b}: usize) -> Result<{}, Error> {{",
            if rng.below(2) == 0 { "()" } else { "usize" }
        ),
    }
}

/// Lines of synthetic text of about `chars` characters.
pub(crate) fn lines(rng: &mut Rng, chars: usize) -> String {
    let mut s = String::new();
    while s.len() < chars {
        s.push_str(&line(rng));
        s.push('\n');
    }
    s.truncate(s.trim_end().len());
    s
}

pub(crate) fn tool_output(rng: &mut Rng, turn: usize, chars: usize) -> String {
    let head = match turn % 3 {
        0 => format!("$ cargo test -p deltaserve-{} 2>&1 | tail", rng.pick(DIRS)),
        1 => format!("$ rg -n '{}' crates/", rng.pick(IDENTS)),
        _ => format!("$ sed -n 1,200p crates/{}/src/{}.rs", rng.pick(DIRS), rng.pick(FILES)),
    };
    format!("{head}\n{}", lines(rng, chars.saturating_sub(head.len() + 1)))
}

pub(crate) fn follow_up(rng: &mut Rng, chars: usize) -> String {
    let head = format!(
        "Before you go on: the `{}` path in crates/{}/src/{}.rs matters too. Here is the log from CI:",
        rng.pick(IDENTS),
        rng.pick(DIRS),
        rng.pick(FILES)
    );
    format!("{head}\n{}", lines(rng, chars.saturating_sub(head.len() + 1)))
}
