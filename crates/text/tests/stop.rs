//! Stop strings over streamed text, with the text and the stop split at every position.

use deltaserve_text::{StopMatcher, StopOutput};

/// Feeds `text` cut at the char boundaries `cuts`; returns (emitted text, stop matched).
fn run(stops: &[&str], text: &str, cuts: &[usize]) -> (String, Option<String>) {
    let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
    let mut emitted = String::new();
    let mut prev = 0;
    let mut stopped = None;
    for &c in cuts.iter().chain(std::iter::once(&text.len())) {
        let StopOutput { emit, stopped: s } = m.push(&text[prev..c]);
        emitted.push_str(&emit);
        if s.is_some() {
            assert!(stopped.is_none(), "stop reported twice");
            stopped = s;
        }
        prev = c;
    }
    emitted.push_str(&m.flush());
    (emitted, stopped)
}

fn boundaries(text: &str) -> Vec<usize> {
    (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect()
}

#[test]
fn stop_split_at_every_position_pair() {
    let cases: [(&[&str], &str, &str, Option<&str>); 6] = [
        (&["STOP"], "Hello STOP world", "Hello ", Some("STOP")),
        (&["<|im_end|>", "\n\nUser:"], "answer\n\nUse it\n\nUser: more", "answer\n\nUse it", Some("\n\nUser:")),
        (&["终止", "😀!"], "数据 😀 ok 终止 rest", "数据 😀 ok ", Some("终止")),
        (&["abcd", "bc"], "xxabce", "xxa", Some("bc")),
        (&["STOP"], "no stop here ST", "no stop here ST", None),
        (&["aab"], "aaaab", "aa", Some("aab")),
    ];
    for (stops, text, want, want_stop) in cases {
        let b = boundaries(text);
        // Every single cut and every pair of cuts.
        let mut cut_sets: Vec<Vec<usize>> = vec![vec![]];
        for (i, &x) in b.iter().enumerate() {
            cut_sets.push(vec![x]);
            for &y in &b[i + 1..] {
                cut_sets.push(vec![x, y]);
            }
        }
        cut_sets.push(b.clone()); // one char at a time
        for cuts in cut_sets {
            let (emitted, stopped) = run(stops, text, &cuts);
            assert_eq!(emitted, want, "text {text:?} cuts {cuts:?}");
            assert_eq!(stopped.as_deref(), want_stop, "text {text:?} cuts {cuts:?}");
        }
    }
}

#[test]
fn holds_back_only_possible_prefixes() {
    let mut m = StopMatcher::new(vec!["</tool>".into()]);
    assert_eq!(m.push("abc</to").emit, "abc");
    assert_eq!(m.push("x").emit, "</tox");
    assert_eq!(m.push("<").emit, "");
    let out = m.push("/tool> tail");
    assert_eq!(out, StopOutput { emit: String::new(), stopped: Some("</tool>".into()) });
    assert!(m.is_stopped());
    assert_eq!(m.push("more").emit, "");
    assert_eq!(m.flush(), "");
}

#[test]
fn no_stops_passes_everything_through() {
    let mut m = StopMatcher::new(vec![String::new()]);
    assert_eq!(m.push("anything").emit, "anything");
    assert_eq!(m.flush(), "");
}
