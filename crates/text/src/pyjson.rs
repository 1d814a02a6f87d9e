//! Python-compatible value formatting for chat templates: `json.dumps` (the HF `tojson` filter),
//! `repr(float)`, and `str()` of template values, so renders match transformers byte for byte.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};

/// Options of Python's `json.dumps` that HF's `tojson` filter forwards.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None` = single line; `Some(s)` = newline + `s` per nesting level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl DumpOptions {
    /// Python defaults: `separators` default to `(", ", ": ")`, or `(",", ": ")` with an indent.
    pub fn new(
        ensure_ascii: bool,
        indent: Option<String>,
        separators: Option<(String, String)>,
        sort_keys: bool,
    ) -> Self {
        let (item_sep, key_sep) = match separators {
            Some(s) => s,
            None if indent.is_some() => (",".to_string(), ": ".to_string()),
            None => (", ".to_string(), ": ".to_string()),
        };
        Self { ensure_ascii, indent, item_sep, key_sep, sort_keys }
    }
}

/// `json.dumps(value, ...)` of a template value.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    dump(value, opts, 0, &mut out)?;
    Ok(out)
}

fn newline(opts: &DumpOptions, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn dump(v: &Value, opts: &DumpOptions, level: usize, out: &mut String) -> Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(v)),
        ValueKind::String => json_string(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in v.try_iter()? {
                let item = v.get_item(&key)?;
                entries.push((key_string(&key), item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(opts, level + 1, out);
                json_string(k, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                dump(item, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(opts, level + 1, out);
                dump(item, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push(']');
        }
        _ => json_string(&v.to_string(), opts.ensure_ascii, out),
    }
    Ok(())
}

/// Python converts non-string dict keys with `str()`-like rules (True -> "true" in JSON keys).
fn key_string(key: &Value) -> String {
    match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
        ValueKind::None | ValueKind::Undefined => "null".to_string(),
        ValueKind::Number => json_number(key),
        _ => key.to_string(),
    }
}

fn json_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) if f.is_nan() => "NaN".to_string(),
        Ok(f) if f.is_infinite() => (if f > 0.0 { "Infinity" } else { "-Infinity" }).to_string(),
        Ok(f) => float_repr(f),
        Err(_) => v.to_string(),
    }
}

/// JSON string literal with Python's escaping (`ensure_ascii` escapes everything outside ASCII
/// printable, using surrogate pairs above U+FFFF).
pub(crate) fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation when the decimal exponent is
/// in [-4, 16), otherwise `d.ddde+XX`.
pub(crate) fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return (if f > 0.0 { "inf" } else { "-inf" }).to_string();
    }
    let sci = format!("{f:e}"); // e.g. "-1.2345e-7", shortest round-trip digits
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            for _ in 0..(-point) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let point = point as usize;
            if digits.len() <= point {
                out.push_str(&digits);
                for _ in digits.len()..point {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// Python's `str(value)` for template output and the `string` filter.
pub(crate) fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python's `repr(value)` (containers print their items with repr).
fn py_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".to_string(),
        ValueKind::Bool => (if v.is_true() { "True" } else { "False" }).to_string(),
        ValueKind::Number if v.is_integer() => v.to_string(),
        ValueKind::Number => f64::try_from(v.clone()).map(float_repr).unwrap_or_else(|_| v.to_string()),
        ValueKind::String => str_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let items: Vec<String> = v.try_iter().map(|it| it.map(|x| py_repr(&x)).collect()).unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let mut parts = Vec::new();
            if let Ok(keys) = v.try_iter() {
                for k in keys {
                    let item = v.get_item(&k).unwrap_or_default();
                    parts.push(format!("{}: {}", py_repr(&k), py_repr(&item)));
                }
            }
            format!("{{{}}}", parts.join(", "))
        }
        _ => v.to_string(),
    }
}

fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::new();
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123456.789, "123456.789"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.0, "0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_default_separators_and_indent() {
        let v = Value::from(minijinja::value::Serde(serde_json::json!({"b": [1, 2.5, "x<y>&'"], "a": {}, "c": null})));
        let opts = DumpOptions::new(false, None, None, false);
        assert_eq!(dumps(&v, &opts).unwrap(), r#"{"b": [1, 2.5, "x<y>&'"], "a": {}, "c": null}"#);
        let opts = DumpOptions::new(false, Some("  ".into()), None, true);
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    \"x<y>&'\"\n  ],\n  \"c\": null\n}"
        );
        let s = Value::from("é😀\u{1}");
        assert_eq!(dumps(&s, &DumpOptions::new(true, None, None, false)).unwrap(), r#""\u00e9\ud83d\ude00\u0001""#);
        assert_eq!(dumps(&s, &DumpOptions::new(false, None, None, false)).unwrap(), "\"é😀\\u0001\"");
    }
}
