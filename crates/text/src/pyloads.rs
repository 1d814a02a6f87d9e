//! Python's `json.loads` into template values: tool-call arguments sent as a JSON string are read
//! the way the reference (transformers / vLLM, in Python) reads them — integers of any size up to
//! 128 bits stay exact integers, `-0` is the integer 0, `1e400` is infinity, `NaN` / `Infinity`
//! are accepted, a repeated key keeps its first place and its last value.

use minijinja::value::Value;

/// Nesting deeper than this is refused (Python's own limit is the recursion limit, ~1000).
const MAX_DEPTH: usize = 512;

/// Checks that `text` is a JSON object as Python's `json.loads` reads it (tool-call arguments the
/// template can render). The error says what is wrong and at which byte.
pub fn check_json_object(text: &str) -> Result<(), String> {
    match python_json_loads(text)?.kind() {
        minijinja::value::ValueKind::Map => Ok(()),
        _ => Err("not a JSON object".into()),
    }
}

/// Parses `text` as Python's `json.loads` does. The error says what is wrong and at which byte.
pub(crate) fn python_json_loads(text: &str) -> Result<Value, String> {
    let mut p = Parser { s: text.as_bytes(), pos: 0 };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    if p.pos != p.s.len() {
        return Err(p.err("extra data"));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> String {
        format!("{what} at byte {}", self.pos)
    }

    fn ws(&mut self) {
        while self.s.get(self.pos).is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.s[self.pos..].starts_with(lit.as_bytes()) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err(self.err("nesting too deep"));
        }
        match self.s.get(self.pos) {
            None => Err(self.err("expecting a value")),
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => self.string().map(Value::from),
            _ if self.eat("null") => Ok(Value::from(())),
            _ if self.eat("true") => Ok(Value::from(true)),
            _ if self.eat("false") => Ok(Value::from(false)),
            _ if self.eat("NaN") => Ok(Value::from(f64::NAN)),
            _ if self.eat("Infinity") => Ok(Value::from(f64::INFINITY)),
            _ if self.eat("-Infinity") => Ok(Value::from(f64::NEG_INFINITY)),
            _ => self.number(),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, String> {
        self.pos += 1;
        let mut entries: Vec<(String, Value)> = Vec::new();
        self.ws();
        if self.eat("}") {
            return Ok(Value::from_pairs(entries));
        }
        loop {
            self.ws();
            if self.s.get(self.pos) != Some(&b'"') {
                return Err(self.err("expecting a property name in double quotes"));
            }
            let key = self.string()?;
            self.ws();
            if !self.eat(":") {
                return Err(self.err("expecting ':' delimiter"));
            }
            self.ws();
            let v = self.value(depth + 1)?;
            match entries.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = v,
                None => entries.push((key, v)),
            }
            self.ws();
            if self.eat("}") {
                return Ok(Value::from_pairs(entries));
            }
            if !self.eat(",") {
                return Err(self.err("expecting ',' delimiter"));
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, String> {
        self.pos += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat("]") {
            return Ok(Value::from(items));
        }
        loop {
            self.ws();
            items.push(self.value(depth + 1)?);
            self.ws();
            if self.eat("]") {
                return Ok(Value::from(items));
            }
            if !self.eat(",") {
                return Err(self.err("expecting ',' delimiter"));
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while self.s.get(self.pos).is_some_and(u8::is_ascii_digit) {
            self.pos += 1;
        }
        self.pos - start
    }

    /// `-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?`: an integer without fraction or exponent, else a float.
    fn number(&mut self) -> Result<Value, String> {
        let start = self.pos;
        self.eat("-");
        let int_start = self.pos;
        let n = self.digits();
        if n == 0 || (n > 1 && self.s[int_start] == b'0') {
            self.pos = start;
            return Err(self.err("expecting a value"));
        }
        let mut float = false;
        let mark = self.pos;
        if self.eat(".") {
            if self.digits() == 0 {
                self.pos = mark;
            } else {
                float = true;
            }
        }
        let mark = self.pos;
        if self.eat("e") || self.eat("E") {
            if !self.eat("-") {
                self.eat("+");
            }
            if self.digits() == 0 {
                self.pos = mark;
            } else {
                float = true;
            }
        }
        let text = std::str::from_utf8(&self.s[start..self.pos]).map_err(|_| self.err("bad number"))?;
        if !float {
            if let Ok(i) = text.parse::<i64>() {
                return Ok(Value::from(i));
            }
            if let Ok(i) = text.parse::<i128>() {
                return Ok(Value::from(i));
            }
            if let Ok(u) = text.parse::<u128>() {
                return Ok(Value::from(u));
            }
        }
        // A float, or an integer beyond 128 bits (kept as the nearest float).
        text.parse::<f64>().map(Value::from).map_err(|_| self.err("bad number"))
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let hex = self.s.get(self.pos..self.pos + 4).ok_or_else(|| self.err("invalid \\uXXXX escape"))?;
        let hex = std::str::from_utf8(hex).map_err(|_| self.err("invalid \\uXXXX escape"))?;
        let v = u32::from_str_radix(hex, 16).map_err(|_| self.err("invalid \\uXXXX escape"))?;
        self.pos += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<String, String> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            let start = self.pos;
            while self.s.get(self.pos).is_some_and(|&c| c != b'"' && c != b'\\' && c >= 0x20) {
                self.pos += 1;
            }
            out.push_str(std::str::from_utf8(&self.s[start..self.pos]).map_err(|_| self.err("invalid UTF-8"))?);
            match self.s.get(self.pos) {
                None => return Err(self.err("unterminated string")),
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let c = *self.s.get(self.pos).ok_or_else(|| self.err("unterminated string"))?;
                    self.pos += 1;
                    match c {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => out.push(self.unicode_escape()?),
                        _ => return Err(self.err("invalid \\escape")),
                    }
                }
                Some(_) => return Err(self.err("invalid control character")),
            }
        }
    }

    /// After `\u`: one code point, joining a surrogate pair; a lone surrogate becomes U+FFFD.
    fn unicode_escape(&mut self) -> Result<char, String> {
        let hi = self.hex4()?;
        if (0xd800..0xdc00).contains(&hi) && self.s[self.pos..].starts_with(b"\\u") {
            let mark = self.pos;
            self.pos += 2;
            let lo = self.hex4()?;
            if (0xdc00..0xe000).contains(&lo) {
                return Ok(char::from_u32(0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00)).unwrap_or('\u{fffd}'));
            }
            self.pos = mark;
        }
        Ok(char::from_u32(hi).unwrap_or('\u{fffd}'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pyjson::{DumpOptions, dumps, py_str};

    fn dumped(text: &str) -> String {
        dumps(&python_json_loads(text).unwrap(), &DumpOptions::new(true, None, None, false)).unwrap()
    }

    #[test]
    fn numbers_read_as_python_reads_them() {
        // json.dumps(json.loads(x)) in Python, for each x.
        for (text, python) in [
            ("123456789012345678901234567890", "123456789012345678901234567890"),
            ("-170141183460469231731687303715884105728", "-170141183460469231731687303715884105728"),
            ("18446744073709551616", "18446744073709551616"),
            ("-0", "0"),
            ("-0.0", "-0.0"),
            ("1e400", "Infinity"),
            ("-1e400", "-Infinity"),
            ("1E2", "100.0"),
            ("2.50", "2.5"),
            ("NaN", "NaN"),
            ("Infinity", "Infinity"),
        ] {
            assert_eq!(dumped(text), python, "{text}");
        }
        // str() of the same values, as the template's `| string` prints a scalar argument.
        assert_eq!(py_str(&python_json_loads("1e400").unwrap()), "inf");
        assert_eq!(py_str(&python_json_loads("-0").unwrap()), "0");
        assert_eq!(py_str(&python_json_loads("99999999999999999999").unwrap()), "99999999999999999999");
    }

    #[test]
    fn containers_strings_and_duplicate_keys() {
        assert_eq!(
            dumped(r#" {"a": [1, {"b": null}], "s": "x\"\u00e9\ud83d\ude00\n", "a": true, "t": false} "#),
            r#"{"a": true, "s": "x\"\u00e9\ud83d\ude00\n", "t": false}"#
        );
        assert_eq!(dumped("[]"), "[]");
        assert_eq!(dumped("{}"), "{}");
    }

    #[test]
    fn malformed_input_is_an_error_naming_the_byte() {
        for bad in ["", "{", "[1,]", "{\"a\" 1}", "01", "1.", "\"a\nb\"", "tru", "{} x", "\"\\q\"", "-"] {
            let err = python_json_loads(bad).unwrap_err();
            assert!(err.contains("at byte"), "{bad:?}: {err}");
        }
        assert!(check_json_object("[1]").is_err() && check_json_object(r#"{"n": 1e400}"#).is_ok());
        let deep = "[".repeat(MAX_DEPTH + 2) + &"]".repeat(MAX_DEPTH + 2);
        assert!(python_json_loads(&deep).unwrap_err().contains("too deep"));
    }
}
