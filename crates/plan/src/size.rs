//! Byte sizes as people write them (`24GiB`, `24G`, `512MiB`, `1.5GiB`, `1000000`) and as the plan prints them.

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Parses a memory size. Units are binary and case-insensitive: `K`/`KiB`/`KB`, `M`/`MiB`/`MB`, `G`/`GiB`/`GB`,
/// `T`/`TiB`/`TB` all mean powers of 1024; no unit (or `B`) means bytes. Fractions are allowed with a unit.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_')).unwrap_or(t.len());
    let (num, unit) = (t[..split].replace('_', ""), t[split..].trim());
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => GIB,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("`{s}`: unknown size unit `{unit}` (use e.g. 24GiB, 512MiB, 1.5G or plain bytes)")),
    };
    if num.is_empty() {
        return Err(format!("`{s}`: expected a number with an optional unit, e.g. 24GiB"));
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| format!("`{s}` is too large"));
    }
    let x: f64 = num.parse().map_err(|_| format!("`{s}`: `{num}` is not a number"))?;
    let bytes = x * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is too large"));
    }
    Ok(bytes.round() as u64)
}

/// `16.43 GiB`, `146.8 MiB`, `32.3 KiB`, `17 B`.
pub fn fmt_bytes(b: u64) -> String {
    let x = b as f64;
    if b >= GIB {
        format!("{:.2} GiB", x / GIB as f64)
    } else if b >= MIB {
        format!("{:.1} MiB", x / MIB as f64)
    } else if b >= KIB {
        format!("{:.1} KiB", x / KIB as f64)
    } else {
        format!("{b} B")
    }
}

/// `117,760`.
pub fn fmt_count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("24GiB"), Ok(24 * GIB));
        assert_eq!(parse_size("24G"), Ok(24 * GIB));
        assert_eq!(parse_size("24 gb"), Ok(24 * GIB));
        assert_eq!(parse_size("512MiB"), Ok(512 * MIB));
        assert_eq!(parse_size("1.5GiB"), Ok(3 * GIB / 2));
        assert_eq!(parse_size("123456"), Ok(123_456));
        assert!(parse_size("12 parsecs").unwrap_err().contains("unit"));
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1.2.3G").is_err());
        assert!(parse_size("99999999999999T").is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(fmt_count(117_760), "117,760");
        assert_eq!(fmt_count(999), "999");
        assert_eq!(fmt_count(1_000_000), "1,000,000");
        assert_eq!(fmt_bytes(24 * GIB), "24.00 GiB");
        assert_eq!(fmt_bytes(600 * MIB), "600.0 MiB");
        assert_eq!(fmt_bytes(17), "17 B");
    }
}
