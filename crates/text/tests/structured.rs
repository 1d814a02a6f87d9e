//! Grammars on the fixture vocabulary: random walks through the masks (a stand-in for a model with
//! random weights) always produce JSON valid for the schema, and tool calls the parser reads back with
//! arguments valid for the tool; schemas llguidance cannot compile are errors.

mod common;

use std::sync::Arc;

use common::Rng;
use deltaserve_text::{Grammar, GrammarCompiler, Tokenizer, parse_complete};
use serde_json::{Value, json};

fn compiler() -> (Arc<Tokenizer>, GrammarCompiler, u32) {
    let tok = Arc::new(common::synth_tokenizer());
    let eos = tok.token_id("<|im_end|>").unwrap();
    // A logits row wider than the vocabulary, as a model's padded embedding gives.
    let c = GrammarCompiler::new(tok.clone(), tok.vocab_size() + 16, &[eos]).unwrap();
    (tok, c, eos)
}

/// Picks random allowed tokens until the end token; returns the text before it.
fn walk(tok: &Tokenizer, c: &GrammarCompiler, g: &Grammar, eos: u32, seed: u64) -> String {
    let mut m = c.compile(g).unwrap();
    let mut rng = Rng(seed);
    let mut ids = Vec::new();
    for _ in 0..2000 {
        let mut row = vec![0.0f32; tok.vocab_size() + 16];
        assert!(m.mask(&mut row), "the grammar allows nothing before the end token");
        assert!(row[tok.vocab_size()..].iter().all(|l| l.is_infinite()), "ids past the vocabulary are never allowed");
        let allowed: Vec<u32> = (0..row.len() as u32).filter(|&i| row[i as usize].is_finite()).collect();
        // Lean towards ending once it is allowed, so walks stay short.
        let t = if allowed.contains(&eos) && rng.below(3) == 0 { eos } else { allowed[rng.below(allowed.len())] };
        if t == eos {
            return tok.decode(&ids, false).unwrap();
        }
        m.accept(t).unwrap();
        ids.push(t);
    }
    panic!("no end after 2000 tokens: {:?}", tok.decode(&ids, false));
}

#[test]
fn json_schema_walks_are_valid() {
    let (tok, c, eos) = compiler();
    let schema = json!({"type": "object", "properties": {
        "color": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "name": {"type": "string", "maxLength": 4},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "required": ["color", "n", "name", "tags"], "additionalProperties": false});
    for seed in 1..6 {
        let text = walk(&tok, &c, &Grammar::JsonSchema(schema.clone()), eos, seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(["red", "green"].contains(&v["color"].as_str().unwrap()), "{text}");
        assert!(v["n"].as_u64().unwrap() <= 9, "{text}");
        assert!(v["name"].as_str().unwrap().chars().count() <= 4, "{text}");
        assert!(v["tags"].as_array().unwrap().len() <= 2, "{text}");
    }
    let text = walk(&tok, &c, &Grammar::JsonObject, eos, 7);
    assert!(serde_json::from_str::<Value>(&text).unwrap().is_object(), "{text}");
}

#[test]
fn tool_call_walks_parse_into_valid_calls() {
    let (tok, c, eos) = compiler();
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 5},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "days"]}}}),
        json!({"name": "noop", "input_schema": {"type": "object", "properties": {}}}),
    ];
    for seed in 1..6 {
        let g = Grammar::ToolCalls { tools: tools.clone(), at_most_one: seed % 2 == 0 };
        let text = walk(&tok, &c, &g, eos, seed);
        let (content, calls) = parse_complete(&text, &tools);
        assert_eq!(content, "", "{text:?}");
        assert!(!calls.is_empty() && (seed % 2 == 1 || calls.len() == 1), "{text:?}");
        for call in calls {
            let args: Value = serde_json::from_str(&call.arguments).unwrap();
            if call.name == "noop" {
                assert_eq!(args, json!({}));
                continue;
            }
            assert_eq!(call.name, "get_weather");
            assert!(args["city"].as_str().unwrap().chars().count() <= 5, "{text:?}");
            assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{text:?}");
            assert!(args.get("unit").is_none_or(|u| u == "c" || u == "f"), "{text:?}");
        }
    }
    // Only the named tool.
    let g = Grammar::ToolCalls { tools: tools[1..].to_vec(), at_most_one: true };
    let (_, calls) = parse_complete(&walk(&tok, &c, &g, eos, 9), &tools);
    assert_eq!(calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["noop"]);
}

#[test]
fn a_schema_that_does_not_compile_is_an_error() {
    let (_, c, _) = compiler();
    for bad in [json!({"type": "nonsense"}), json!({"$ref": "#/definitions/missing"})] {
        assert!(c.compile(&Grammar::JsonSchema(bad.clone())).is_err(), "{bad}");
    }
    assert!(c.compile(&Grammar::ToolCalls { tools: vec![], at_most_one: true }).is_err());
}

#[test]
fn a_string_parameter_pattern_is_enforced() {
    let (tok, c, eos) = compiler();
    let tools = vec![json!({"type": "function", "function": {"name": "call", "parameters": {"type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}/x$", "maxLength": 12}},
        "required": ["phone"]}}})];
    let re = regex::Regex::new("^[0-9]{3}-[0-9]{2}/x$").unwrap();
    for seed in 1..5 {
        let text = walk(&tok, &c, &Grammar::ToolCalls { tools: tools.clone(), at_most_one: true }, eos, seed);
        let (_, calls) = parse_complete(&text, &tools);
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert!(re.is_match(args["phone"].as_str().unwrap()), "{text:?}");
    }
    let bad = vec![json!({"name": "f", "input_schema": {"type": "object",
        "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}})];
    assert!(c.compile(&Grammar::ToolCalls { tools: bad, at_most_one: true }).is_err());
}

#[test]
fn regex_and_choice_grammars() {
    let (tok, c, eos) = compiler();
    let re = regex::Regex::new("^(yes|no)-[a-c]{2,4}$").unwrap();
    for seed in 1..5 {
        let text = walk(&tok, &c, &Grammar::Regex("(yes|no)-[a-c]{2,4}".into()), eos, seed);
        assert!(re.is_match(&text), "{text:?}");
        let choices = vec!["red".to_string(), "green light".to_string(), "a \"quoted\" one".to_string()];
        let text = walk(&tok, &c, &Grammar::Choice(choices.clone()), eos, seed);
        assert!(choices.contains(&text), "{text:?}");
    }
    assert!(c.compile(&Grammar::Regex("(unclosed".into())).is_err());
    assert!(c.compile(&Grammar::Choice(vec![])).is_err());
}

/// The bitmask of a matcher is its mask (ids past the vocabulary refused), and a walk's tokens checked
/// ahead from the start are all allowed, up to the first refused one; checking follows nothing.
#[test]
fn bitmasks_and_tokens_checked_ahead_agree_with_the_mask() {
    let (tok, c, eos) = compiler();
    let g = Grammar::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}));
    let width = tok.vocab_size() + 16;
    let mut m = c.compile(&g).unwrap();
    let mut rng = Rng(5);
    let mut ids = Vec::new();
    for _ in 0..12 {
        let mut row = vec![0.0f32; width];
        let mut bits = vec![0u32; width.div_ceil(32)];
        assert!(m.mask(&mut row) && m.allowed(&mut bits));
        for (id, l) in row.iter().enumerate() {
            assert_eq!(bits[id / 32] >> (id % 32) & 1 == 1, l.is_finite(), "id {id}");
        }
        let allowed: Vec<u32> = (0..width as u32).filter(|&i| row[i as usize].is_finite() && i != eos).collect();
        if allowed.is_empty() {
            break;
        }
        let t = allowed[rng.below(allowed.len())];
        m.accept(t).unwrap();
        ids.push(t);
    }
    let mut fresh = c.compile(&g).unwrap();
    assert_eq!(fresh.allows_prefix(&ids), ids.len());
    let refused = tok.token_id("<|im_end|>").unwrap();
    let mut broken = ids[..3].to_vec();
    broken.extend([refused, ids[3]]);
    assert_eq!(fresh.allows_prefix(&broken), 3, "the first refused token ends the prefix");
    assert_eq!(fresh.allows_prefix(&[width as u32 + 1]), 0, "an id past the vocabulary is refused");
    assert_eq!(fresh.allows_prefix(&ids), ids.len(), "checking followed nothing");
}

#[test]
fn a_forked_matcher_goes_its_own_way() {
    let (tok, c, eos) = compiler();
    let g = Grammar::JsonSchema(json!({"type": "object", "properties": {
        "a": {"enum": ["xy", "zw"]}, "b": {"type": "integer"}}, "required": ["a", "b"]}));
    let width = tok.vocab_size() + 16;
    let allowed = |m: &mut deltaserve_text::GrammarMatcher| {
        let mut row = vec![0.0f32; width];
        assert!(m.mask(&mut row));
        (0..width as u32).filter(|&i| row[i as usize].is_finite() && i != eos).collect::<Vec<u32>>()
    };
    let mut m = c.compile(&g).unwrap();
    let first = allowed(&mut m)[0];
    m.accept(first).unwrap();
    // The fork stands where its parent stands, then each follows its own tokens.
    let mut f = m.fork();
    assert_eq!(allowed(&mut f), allowed(&mut m));
    let mut rng = Rng(11);
    let (mut a, mut b) = (vec![first], vec![first]);
    for _ in 0..6 {
        for (m, ids) in [(&mut m, &mut a), (&mut f, &mut b)] {
            let next = allowed(m);
            if let Some(&t) = next.get(rng.below(next.len().max(1))) {
                m.accept(t).unwrap();
                ids.push(t);
            }
        }
    }
    assert_ne!(a, b, "the two walks diverged (seeded)");
    // Each is still a valid prefix of the grammar, checked from a fresh matcher.
    assert_eq!(c.compile(&g).unwrap().allows_prefix(&a), a.len());
    assert_eq!(c.compile(&g).unwrap().allows_prefix(&b), b.len());
}
