//! Reasoning split and XML tool-call parsing: scripted outputs, every split position, random
//! multi-way splits, and property tests on arbitrary text.

use deltaserve_text::{ReasoningParser, ToolCall, ToolCallParser, ToolEvent, collect_events, parse_complete};
use proptest::prelude::*;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// All char boundaries of `s` strictly inside it.
fn inner_boundaries(s: &str) -> Vec<usize> {
    (1..s.len()).filter(|&i| s.is_char_boundary(i)).collect()
}

/// Split `s` at the given (sorted, char-boundary) positions.
fn pieces<'a>(s: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut last = 0;
    for &c in cuts {
        out.push(&s[last..c]);
        last = c;
    }
    out.push(&s[last..]);
    out
}

/// Tiny deterministic generator for random splits.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn random_cuts(s: &str, rng: &mut Lcg) -> Vec<usize> {
    let b = inner_boundaries(s);
    let mut cuts: Vec<usize> = b.into_iter().filter(|_| rng.next().is_multiple_of(4)).collect();
    cuts.dedup();
    cuts
}

fn reason_stream(parts: &[&str], starts_in_reasoning: bool) -> (String, String) {
    let mut p = ReasoningParser::new(starts_in_reasoning);
    let (mut r, mut c) = (String::new(), String::new());
    for part in parts {
        let d = p.push(part);
        r.push_str(&d.reasoning);
        c.push_str(&d.content);
    }
    let d = p.finish();
    r.push_str(&d.reasoning);
    c.push_str(&d.content);
    (r, c)
}

/// Check the event stream is well formed and fold it.
fn check_events(events: &[ToolEvent]) -> (String, Vec<ToolCall>) {
    let mut open: Option<usize> = None;
    let mut next = 0;
    for ev in events {
        match ev {
            ToolEvent::Content(s) => {
                assert!(!s.is_empty(), "empty content event");
                assert!(open.is_none(), "content inside a call");
            }
            ToolEvent::Start { index, id, name } => {
                assert!(open.is_none(), "nested start");
                assert_eq!(*index, next);
                assert!(!name.is_empty());
                assert_eq!(id.len(), 29, "{id}");
                assert!(id.starts_with("call_"));
                assert!(id[5..].chars().all(|c| c.is_ascii_alphanumeric()));
                open = Some(*index);
                next += 1;
            }
            ToolEvent::ArgumentsDelta { index, delta } => {
                assert_eq!(open, Some(*index), "delta outside its call");
                assert!(!delta.is_empty(), "empty delta");
            }
            ToolEvent::End { index } => {
                assert_eq!(open, Some(*index));
                open = None;
            }
        }
    }
    assert!(open.is_none(), "call left open after finish");
    let (content, calls) = collect_events(events.iter().cloned());
    for c in &calls {
        let v: Value = serde_json::from_str(&c.arguments)
            .unwrap_or_else(|e| panic!("arguments not JSON ({e}): {:?}", c.arguments));
        assert!(v.is_object(), "arguments not an object: {}", c.arguments);
    }
    (content, calls)
}

fn tool_stream(parts: &[&str], tools: &[Value]) -> (String, Vec<ToolCall>) {
    let mut p = ToolCallParser::new_with_seed(tools, 42);
    let mut events = Vec::new();
    for part in parts {
        events.extend(p.push(part));
    }
    events.extend(p.finish());
    check_events(&events)
}

/// Reasoning parser first, then the tool parser on its content.
fn pipeline(parts: &[&str], starts_in_reasoning: bool, tools: &[Value]) -> (String, String, Vec<ToolCall>) {
    let mut rp = ReasoningParser::new(starts_in_reasoning);
    let mut tp = ToolCallParser::new_with_seed(tools, 7);
    let mut reasoning = String::new();
    let mut events = Vec::new();
    for part in parts {
        let d = rp.push(part);
        reasoning.push_str(&d.reasoning);
        events.extend(tp.push(&d.content));
    }
    let d = rp.finish();
    reasoning.push_str(&d.reasoning);
    events.extend(tp.push(&d.content));
    events.extend(tp.finish());
    let (content, calls) = check_events(&events);
    (reasoning, content, calls)
}

/// Assert every 2-way split, the 1-char-per-push split and random multi-way splits all equal
/// the one-shot result.
fn assert_split_invariant<T: PartialEq + std::fmt::Debug>(s: &str, f: impl Fn(&[&str]) -> T) -> T {
    let whole = f(&[s]);
    for c in inner_boundaries(s) {
        assert_eq!(f(&pieces(s, &[c])), whole, "2-way split at {c} of {s:?}");
    }
    let all = inner_boundaries(s);
    assert_eq!(f(&pieces(s, &all)), whole, "per-char split of {s:?}");
    let mut rng = Lcg(s.len() as u64 + 1);
    for _ in 0..50 {
        let cuts = random_cuts(s, &mut rng);
        assert_eq!(f(&pieces(s, &cuts)), whole, "split {cuts:?} of {s:?}");
    }
    // Empty pushes in between change nothing.
    let mut with_empty = vec![""];
    for p in pieces(s, &all) {
        with_empty.push(p);
        with_empty.push("");
    }
    assert_eq!(f(&with_empty), whole);
    whole
}

fn reason(s: &str, start: bool) -> (String, String) {
    let r = assert_split_invariant(s, |p| reason_stream(p, start));
    assert_eq!(ReasoningParser::split(s, start), r);
    r
}

fn tools_parse(s: &str, tools: &[Value]) -> (String, Vec<(String, Value)>) {
    let (content, calls) = assert_split_invariant(s, |p| tool_stream(p, tools));
    let (c2, calls2) = parse_complete(s, tools);
    assert_eq!(c2, content);
    let simple = |cs: &[ToolCall]| -> Vec<(String, String)> {
        cs.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect()
    };
    assert_eq!(simple(&calls2), simple(&calls));
    let typed = calls.iter().map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap())).collect();
    (content, typed)
}

fn tools() -> Vec<Value> {
    vec![
        json!({
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a place",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string"},
                        "days": {"type": "integer"},
                        "metric": {"type": "boolean"},
                        "ratio": {"type": "number"},
                        "opts": {"type": "object"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                        "maybe_n": {"type": ["integer", "null"]}
                    },
                    "required": ["location"]
                }
            }
        }),
        json!({
            "type": "function",
            "function": {
                "name": "write_file",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string"},
                        "content": {"type": "string"}
                    }
                }
            }
        }),
        // Anthropic-style entry.
        json!({"name": "add", "input_schema": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}}}}),
    ]
}

fn call(name: &str, params: &[(&str, &str)]) -> String {
    let mut s = format!("<tool_call>\n<function={name}>\n");
    for (k, v) in params {
        s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
    }
    s.push_str("</function>\n</tool_call>");
    s
}

// ---------------------------------------------------------------------------------------------
// Reasoning
// ---------------------------------------------------------------------------------------------

#[test]
fn reasoning_thinking_on() {
    let out = "Let me think.\n\nThe user wants 2+2.\n</think>\n\nThe answer is **4**.\n";
    assert_eq!(
        reason(out, true),
        ("Let me think.\n\nThe user wants 2+2.".to_string(), "The answer is **4**.\n".to_string())
    );
}

#[test]
fn reasoning_thinking_off() {
    let out = "\nHello\n\nworld </think> <think>";
    assert_eq!(reason(out, false), (String::new(), "Hello\n\nworld </think> <think>".into()));
    assert_eq!(reason("", false), (String::new(), String::new()));
    assert_eq!(reason("", true), (String::new(), String::new()));
    assert_eq!(reason("  hi", false), (String::new(), "  hi".into()));
}

#[test]
fn reasoning_generated_think_tag() {
    for start in [true, false] {
        assert_eq!(reason("<think>\nfoo\n</think>\n\nbar", start), ("foo".into(), "bar".into()));
        assert_eq!(reason(" \n<think>foo</think>bar", start), ("foo".into(), "bar".into()));
    }
    // `<think>` later in the text is literal.
    assert_eq!(reason("a <think> b</think>c", true), ("a <think> b".into(), "c".into()));
    assert_eq!(reason("a <think>", false), (String::new(), "a <think>".into()));
}

#[test]
fn reasoning_truncated_and_partial_tags() {
    assert_eq!(reason("thinking... </thi", true), ("thinking... </thi".into(), String::new()));
    assert_eq!(reason("thinking\n\n", true), ("thinking".into(), String::new()));
    assert_eq!(reason("<thin", false), (String::new(), "<thin".into()));
    assert_eq!(reason("<thin", true), ("<thin".into(), String::new()));
    assert_eq!(reason("</think>", true), (String::new(), String::new()));
    assert_eq!(reason("</think>\n\n\nx\n", true), (String::new(), "x\n".into()));
    // Only the first `</think>` ends reasoning.
    assert_eq!(reason("r</think>c</think>d", true), ("r".into(), "c</think>d".into()));
    // `<` and look-alikes inside reasoning.
    assert_eq!(
        reason("a < b </thinker> <tool_call> x\n</think>\nok", true),
        ("a < b </thinker> <tool_call> x".into(), "ok".into())
    );
}

#[test]
fn reasoning_streaming_never_emits_partial_tag() {
    let out = "abc</think>\n\ndef";
    let mut p = ReasoningParser::new(true);
    let mut r = String::new();
    for ch in out.chars() {
        let d = p.push(&ch.to_string());
        r.push_str(&d.reasoning);
        assert!(!r.contains('<'), "partial tag leaked: {r:?}");
    }
    assert!(!p.in_reasoning());
    assert_eq!(r, "abc");
}

#[test]
fn reasoning_implicit_end_at_tool_call() {
    let out = "I should call it.\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>\n</tool_call>";
    let (r, c) = reason(out, true);
    assert_eq!(r, "I should call it.");
    assert!(c.starts_with("<tool_call>\n<function=get_weather>"));
    // A bare mention does not end reasoning.
    let out2 = "Use <tool_call> blocks. <tool_call>x</think>done";
    assert_eq!(reason(out2, true), ("Use <tool_call> blocks. <tool_call>x".into(), "done".into()));
    // Can be switched off.
    let mut p = ReasoningParser::new(true).with_tool_call_ends_reasoning(false);
    let d = p.push(out);
    let f = p.finish();
    assert_eq!(d.reasoning + &f.reasoning, out);
}

// ---------------------------------------------------------------------------------------------
// Tool calls
// ---------------------------------------------------------------------------------------------

#[test]
fn tool_single_call_typed() {
    let t = tools();
    let out = format!(
        "Let me check.\n\n{}",
        call(
            "get_weather",
            &[
                ("location", "Paris, \"FR\" <b>bold</b> & 'x'"),
                ("days", "3"),
                ("metric", "True"),
                ("ratio", "2.5"),
                ("opts", "{\"a\": [1, 2], \"b\": null}"),
                ("tags", "[\"x\", \"y\"]"),
            ]
        )
    );
    let (content, calls) = tools_parse(&out, &t);
    assert_eq!(content, "Let me check.");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, "get_weather");
    assert_eq!(
        calls[0].1,
        json!({
            "location": "Paris, \"FR\" <b>bold</b> & 'x'",
            "days": 3, "metric": true, "ratio": 2.5,
            "opts": {"a": [1, 2], "b": null}, "tags": ["x", "y"]
        })
    );
}

#[test]
fn tool_type_fallbacks() {
    let t = tools();
    let out = call(
        "get_weather",
        &[
            ("days", "three"),
            ("metric", "yes"),
            ("ratio", "nan"),
            ("opts", "{not json"),
            ("note", "None"),
            ("maybe_n", "null"),
            ("location", "null"),
            ("extra", "42"),
        ],
    );
    let (content, calls) = tools_parse(&out, &t);
    assert_eq!(content, "");
    assert_eq!(
        calls[0].1,
        json!({
            "days": "three", "metric": "yes", "ratio": "nan", "opts": "{not json",
            "note": null, "maybe_n": null, "location": "null", "extra": "42"
        })
    );
    // Numbers: integer given as float text, number with exponent, Anthropic schema.
    let out = format!(
        "{}{}",
        call("get_weather", &[("days", "4.0"), ("ratio", "1e3")]),
        call("add", &[("a", " 1 "), ("b", "-0.25")])
    );
    let (_, calls) = tools_parse(&out, &t);
    assert_eq!(calls[0].1, json!({"days": 4, "ratio": 1000.0}));
    assert_eq!(calls[1].1, json!({"a": 1, "b": -0.25}));
}

#[test]
fn tool_string_values_are_raw() {
    let t = tools();
    let code = "fn main() {\n    // </parameter is not the end\n    let s = \"</parameter> nope\";\n    if a < b && c > d { println!(\"{s}\\n\"); }\n}\n\n";
    let out = call("write_file", &[("path", "src/main.rs"), ("content", code)]);
    let (_, calls) = tools_parse(&out, &t);
    assert_eq!(calls[0].1, json!({"path": "src/main.rs", "content": code}));

    // Unicode, tabs, control characters, leading/trailing blank lines beyond the format's own.
    let v = "\n\tΓειά σου 🌍 — «quotes» \u{1}\r\n\n";
    let out = call("write_file", &[("content", v)]);
    let (_, calls) = tools_parse(&out, &t);
    assert_eq!(calls[0].1, json!({"content": v}));

    // Empty value, and one that is only a newline.
    let out = "<tool_call>\n<function=write_file>\n<parameter=path>\n</parameter>\n<parameter=content>\n\n\n</parameter>\n</function>\n</tool_call>";
    let (_, calls) = tools_parse(out, &t);
    assert_eq!(calls[0].1, json!({"path": "", "content": "\n"}));

    // Look-alike closers inside a value: `</function>` not followed by `</tool_call>`, and
    // `</parameter>` followed by something that is not a tag.
    let v = "a</function>b\n</parameter>x\n</parameter>\n\n<parameterized>";
    let out = call("write_file", &[("content", v)]);
    let (_, calls) = tools_parse(&out, &t);
    assert_eq!(calls[0].1, json!({"content": v}));
}

#[test]
fn tool_multiple_calls_and_text() {
    let t = tools();
    let out = format!(
        "First I check the weather.\n\n{}\n{}\n\nAnd then some text.\n\n{}",
        call("get_weather", &[("location", "Oslo")]),
        call("get_weather", &[("location", "Rome"), ("days", "2")]),
        call("add", &[("a", "1"), ("b", "2")]),
    );
    let (content, calls) = tools_parse(&out, &t);
    assert_eq!(content, "First I check the weather.And then some text.");
    let names: Vec<_> = calls.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(names, ["get_weather", "get_weather", "add"]);
    assert_eq!(calls[1].1, json!({"location": "Rome", "days": 2}));
    assert_eq!(calls[2].1, json!({"a": 1, "b": 2}));

    // Several functions inside one <tool_call>, no parameters, unknown function (all strings).
    let out = "<tool_call>\n<function=now>\n</function>\n<function=mystery>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>";
    let (content, calls) = tools_parse(out, &t);
    assert_eq!(content, "");
    assert_eq!(calls, vec![("now".into(), json!({})), ("mystery".into(), json!({"n": "5"}))]);
}

#[test]
fn tool_ids_unique_and_seeded() {
    let t = tools();
    let out = format!("{}{}", call("add", &[]), call("add", &[]));
    let mut p = ToolCallParser::new_with_seed(&t, 1);
    let mut ev = p.push(&out);
    ev.extend(p.finish());
    let (_, calls) = check_events(&ev);
    assert_ne!(calls[0].id, calls[1].id);
    let mut p2 = ToolCallParser::new_with_seed(&t, 1);
    let (_, calls2) = collect_events(p2.push(&out).into_iter().chain(p2.finish()));
    assert_eq!(calls[0].id, calls2[0].id);
    let (_, a) = parse_complete(&out, &t);
    let (_, b) = parse_complete(&out, &t);
    assert_ne!(a[0].id, b[0].id);
}

#[test]
fn tool_streaming_granularity() {
    let t = tools();
    let out = call("write_file", &[("path", "a.txt"), ("content", "hello world")]);
    let mut p = ToolCallParser::new_with_seed(&t, 3);
    let upto = out.find("world").unwrap();
    let ev = p.push(&out[..upto]);
    // Start and the partial string value are out before the call completes.
    assert!(matches!(&ev[0], ToolEvent::Start { name, .. } if name == "write_file"));
    let args: String = ev
        .iter()
        .filter_map(|e| match e {
            ToolEvent::ArgumentsDelta { delta, .. } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(args, "{\"path\": \"a.txt\", \"content\": \"hello ");
    assert!(p.in_call());
    let ev = p.push(&out[upto..]);
    assert!(matches!(ev.last(), Some(ToolEvent::End { index: 0 })));
    assert!(!p.in_call());
    assert_eq!(p.calls_started(), 1);

    // Content before a tool call is streamed at once (no holding beyond a possible tag).
    let mut p = ToolCallParser::new_with_seed(&t, 3);
    assert_eq!(p.push("Hi there <tool"), vec![ToolEvent::Content("Hi there".into())]);
    assert_eq!(p.push("box> x"), vec![ToolEvent::Content(" <toolbox> x".into())]);
}

#[test]
fn tool_malformed_becomes_content() {
    let t = tools();
    // Unrendered template name, newline in name, non-function after <tool_call>.
    for s in [
        "text <tool_call>\n<function={{ tc.name }}>\n</function>\n</tool_call> end",
        "<tool_call>\n<function=bad\nname>",
        "<tool_call> I would call a tool here. </tool_call>",
        "<tool_call>",
        "<tool_call>\n<function=get_wea",
        "<tool_call>\n<func",
        "look: <function=get_weather> is how you call",
    ] {
        let (content, calls) = tools_parse(s, &t);
        assert!(calls.is_empty(), "{s:?}");
        assert_eq!(content, s, "{s:?}");
    }
    // Text is kept even when a real call follows a broken one.
    let s = format!("<tool_call> oops\n\n{}", call("add", &[("a", "1")]));
    let (content, calls) = tools_parse(&s, &t);
    assert_eq!(content, "<tool_call> oops");
    assert_eq!(calls, vec![("add".into(), json!({"a": 1}))]);
}

#[test]
fn tool_unterminated_call_is_closed() {
    let t = tools();
    let s = "<tool_call>\n<function=get_weather>\n<parameter=location>\nPar";
    let (_, calls) = tools_parse(s, &t);
    assert_eq!(calls, vec![("get_weather".into(), json!({"location": "Par"}))]);
    let s = "<tool_call>\n<function=get_weather>\n<parameter=days>\n12\n</parameter>\n<param";
    let (_, calls) = tools_parse(s, &t);
    assert_eq!(calls, vec![("get_weather".into(), json!({"days": 12}))]);
    let s = "<tool_call>\n<function=get_weather>\n<parameter=location>\nX\n</parameter>\n</fun";
    let (_, calls) = tools_parse(s, &t);
    assert_eq!(calls, vec![("get_weather".into(), json!({"location": "X"}))]);
    let s = "<tool_call>\n<function=get_weather>";
    let (content, calls) = tools_parse(s, &t);
    assert_eq!((content.as_str(), calls), ("", vec![("get_weather".into(), json!({}))]));
}

#[test]
fn tool_missing_closers_tolerated() {
    let t = tools();
    // Missing </parameter> before </function></tool_call>.
    let s = "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</function>\n</tool_call>after";
    let (content, calls) = tools_parse(s, &t);
    assert_eq!(content, "after");
    assert_eq!(calls, vec![("get_weather".into(), json!({"location": "Paris"}))]);
    // Missing </function>.
    let s = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>";
    let (_, calls) = tools_parse(s, &t);
    assert_eq!(calls, vec![("add".into(), json!({"a": 1}))]);
    // JSON body instead of parameters.
    let s = "<tool_call>\n<function=add>\n{\"a\": 1, \"b\": 2}\n</function>\n</tool_call>";
    let (_, calls) = tools_parse(s, &t);
    assert_eq!(calls, vec![("add".into(), json!({"a": 1, "b": 2}))]);
    // Junk before the parameters is dropped.
    let s = "<tool_call>\n<function=add>\nhmm <x> \n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>";
    let (_, calls) = tools_parse(s, &t);
    assert_eq!(calls, vec![("add".into(), json!({"a": 1, "b": 2}))]);
    // Junk after a parameter: a `</parameter>` not followed by a tag is taken as
    // part of the value (the look-alike rule), up to `</function>` + `</tool_call>`.
    let s = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\nmore\n</function>\n</tool_call>";
    let (_, calls) = tools_parse(s, &t);
    assert_eq!(calls, vec![("add".into(), json!({"a": "1\n</parameter>\nmore"}))]);
}

#[test]
fn no_tools_plain_text_passthrough() {
    let s = "Plain answer with <tags>, </tool_call>, trailing spaces   \n\n";
    let (content, calls) = tools_parse(s, &[]);
    assert!(calls.is_empty());
    assert_eq!(content, s);
}

// ---------------------------------------------------------------------------------------------
// Reasoning + tool calls
// ---------------------------------------------------------------------------------------------

#[test]
fn pipeline_reasoning_then_tool_calls() {
    let t = tools();
    let out = format!(
        "The user asks for weather in Paris.\nI'll call get_weather.\n</think>\n\nChecking.\n\n{}\n{}",
        call("get_weather", &[("location", "Paris"), ("days", "2")]),
        call("write_file", &[("path", "/tmp/x"), ("content", "<think>not reasoning</think>")]),
    );
    let (r, c, calls) = assert_split_invariant(&out, |p| pipeline(p, true, &t));
    assert_eq!(r, "The user asks for weather in Paris.\nI'll call get_weather.");
    assert_eq!(c, "Checking.");
    assert_eq!(calls.len(), 2);
    assert_eq!(serde_json::from_str::<Value>(&calls[0].arguments).unwrap(), json!({"location": "Paris", "days": 2}));
    assert_eq!(
        serde_json::from_str::<Value>(&calls[1].arguments).unwrap(),
        json!({"path": "/tmp/x", "content": "<think>not reasoning</think>"})
    );

    // Tool call inside unclosed thinking (implicit end).
    let out = format!("Need weather.\n{}", call("get_weather", &[("location", "Oslo")]));
    let (r, c, calls) = assert_split_invariant(&out, |p| pipeline(p, true, &t));
    assert_eq!((r.as_str(), c.as_str()), ("Need weather.", ""));
    assert_eq!(calls[0].name, "get_weather");

    // Thinking off.
    let out = format!("Sure.\n\n{}", call("add", &[("a", "1"), ("b", "2")]));
    let (r, c, calls) = assert_split_invariant(&out, |p| pipeline(p, false, &t));
    assert_eq!((r.as_str(), c.as_str()), ("", "Sure."));
    assert_eq!(calls[0].arguments, "{\"a\": 1, \"b\": 2}");
}

// ---------------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------------

const FRAGMENTS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<think>",
    "</think>",
    "<",
    ">",
    "/",
    "=",
    "\n",
    "\n\n",
    " ",
    "\t",
    "get_weather",
    "add",
    "location",
    "days",
    "a",
    "b",
    "1",
    "2.5",
    "true",
    "null",
    "{",
    "}",
    "\"",
    "é",
    "😀",
    "Ж",
    "x",
    "<tool",
    "</par",
    "{\"k\": [1]}",
    "{{ n }}",
];

fn fragment_text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40).prop_map(|v| v.concat())
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        fragment_text(),
        "[ -~\n]{0,60}",
        any::<String>(),
        prop::collection::vec(prop_oneof![fragment_text(), any::<String>()], 0..4).prop_map(|v| v.concat()),
    ]
}

fn cuts_for(s: &str, seed: u64) -> Vec<usize> {
    random_cuts(s, &mut Lcg(seed))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn prop_reasoning_split_invariant(s in any_text(), seed in any::<u64>(), start in any::<bool>()) {
        let whole = reason_stream(&[&s], start);
        let cuts = cuts_for(&s, seed);
        prop_assert_eq!(reason_stream(&pieces(&s, &cuts), start), whole.clone());
        let all = inner_boundaries(&s);
        prop_assert_eq!(reason_stream(&pieces(&s, &all), start), whole.clone());
        // Nothing but tags and format newlines is removed.
        let (r, c) = whole;
        prop_assert!(r.len() + c.len() <= s.len());
        if !start && !s.trim_start().starts_with("<think>") {
            prop_assert_eq!(c, s.trim_start_matches('\n'));
            prop_assert_eq!(r, "");
        }
    }

    #[test]
    fn prop_tools_split_invariant(s in any_text(), seed in any::<u64>()) {
        let t = tools();
        let whole = tool_stream(&[&s], &t);
        let cuts = cuts_for(&s, seed);
        prop_assert_eq!(tool_stream(&pieces(&s, &cuts), &t), whole.clone());
        let all = inner_boundaries(&s);
        prop_assert_eq!(tool_stream(&pieces(&s, &all), &t), whole.clone());
        if !s.contains("<tool_call>") {
            prop_assert_eq!(&whole.0, &s);
            prop_assert!(whole.1.is_empty());
        }
    }

    #[test]
    fn prop_pipeline_split_invariant(s in any_text(), seed in any::<u64>(), start in any::<bool>()) {
        let t = tools();
        let whole = pipeline(&[&s], start, &t);
        let cuts = cuts_for(&s, seed);
        prop_assert_eq!(pipeline(&pieces(&s, &cuts), start, &t), whole);
    }

    #[test]
    fn prop_generated_calls_roundtrip(
        text in "[a-zA-Z .,!?]{0,20}",
        vals in prop::collection::vec(prop_oneof![any::<String>(), fragment_text()], 1..4),
        seed in any::<u64>(),
    ) {
        // String values (any unicode, possibly containing look-alikes) survive unchanged when
        // they do not themselves contain a structural closer.
        let t = tools();
        let vals: Vec<String> = vals
            .into_iter()
            .map(|v| v.replace("</parameter>", "</param>").replace("</function>", "</func>"))
            .collect();
        let params: Vec<(String, String)> = vals
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("p{i}"), v.clone()))
            .collect();
        let refs: Vec<(&str, &str)> = params.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let s = format!("{text}\n\n{}", call("write_file", &refs));
        let whole = tool_stream(&[&s], &t);
        prop_assert_eq!(tool_stream(&pieces(&s, &cuts_for(&s, seed)), &t), whole.clone());
        let (content, calls) = whole;
        prop_assert_eq!(content, text.trim_end());
        prop_assert_eq!(calls.len(), 1);
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        let expected: serde_json::Map<String, Value> = params
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect();
        prop_assert_eq!(args, Value::Object(expected));
    }
}

#[test]
fn tool_json_form_is_a_call() {
    let tools = tools();
    // The JSON form some Qwen fine-tunes write.
    let s = "Checking.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
    let (content, calls) = tools_parse(s, &tools);
    assert_eq!(content, "Checking.");
    assert_eq!(
        calls,
        vec![
            ("get_weather".to_string(), json!({"location": "Paris", "days": 3})),
            ("add".to_string(), json!({"a": 1})),
        ]
    );
    // `parameters` for `arguments`, no closing tag at the end of the output.
    let (content, calls) = tools_parse("<tool_call>{\"name\": \"f\", \"parameters\": {\"x\": [1]}}", &tools);
    assert_eq!((content.as_str(), calls), ("", vec![("f".to_string(), json!({"x": [1]}))]));
    // Not a call object: the text stays content, verbatim.
    for text in [
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{not json}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>",
    ] {
        let (content, calls) = tools_parse(text, &tools);
        assert_eq!((content.as_str(), calls.len()), (text, 0), "{text}");
    }
}

/// A string value holding the text `</function>` + `</tool_call>`: read by the format's rules the
/// call ends there and the rest leaks into content; under the tool-call grammar (forced tool
/// calls) the value ends where the grammar ends it, at the first `\n</parameter>\n`.
#[test]
fn tool_grammar_values_keep_closing_tags_inside_a_value() {
    let t = tools();
    let value = "Close it with </function>\n</tool_call> and go on.";
    let out = call("write_file", &[("path", "notes.md"), ("content", value)]);
    let (leaked, _) = tools_parse(&out, &t);
    assert!(leaked.contains("and go on."), "{leaked:?}");
    let grammar_stream = |parts: &[&str]| {
        let mut p = ToolCallParser::new_with_seed(&t, 42).grammar_values();
        let mut events: Vec<ToolEvent> = parts.iter().flat_map(|part| p.push(part)).collect();
        events.extend(p.finish());
        check_events(&events)
    };
    let (content, calls) = assert_split_invariant(&out, grammar_stream);
    assert_eq!(content, "");
    assert_eq!(calls.len(), 1);
    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert_eq!(args, json!({"path": "notes.md", "content": value}));
    // A value cut off by the end of the output keeps what arrived.
    let (_, cut) = grammar_stream(&[&out[..out.find(" and go on").unwrap()]]);
    let args: Value = serde_json::from_str(&cut[0].arguments).unwrap();
    assert_eq!(args["content"], "Close it with </function>\n</tool_call>");
}
