//! `strftime_now(format)` for chat templates: the current UTC time formatted with the common
//! C `strftime` directives (HF exposes the same global; it uses local time, servers run in UTC).

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DateTime {
    pub year: i64,
    pub month: u32, // 1..=12
    pub day: u32,   // 1..=31
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    pub weekday: u32, // 0 = Monday
    pub yday: u32,    // 1..=366
}

impl DateTime {
    /// Converts seconds since the Unix epoch (UTC).
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        // Civil-from-days (proleptic Gregorian), era-based.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = cum[(month - 1) as usize] + day + u32::from(leap && month > 2);
        // 1970-01-01 was a Thursday (weekday 3 with Monday = 0).
        let weekday = (days + 3).rem_euclid(7) as u32;
        Self { year, month, day, hour: rem / 3600, minute: rem / 60 % 60, second: rem % 60, weekday, yday }
    }

    pub fn now() -> Self {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        Self::from_unix(secs)
    }

    /// Formats with strftime directives; `%-X` drops zero padding (glibc extension).
    pub fn format(&self, fmt: &str) -> String {
        let mut out = String::new();
        let mut chars = fmt.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let mut spec = chars.next();
            let pad = if spec == Some('-') {
                spec = chars.next();
                false
            } else {
                true
            };
            let num = |out: &mut String, v: i64, width: usize| {
                if pad {
                    let _ = write!(out, "{v:0width$}");
                } else {
                    let _ = write!(out, "{v}");
                }
            };
            let hour12 = if self.hour.is_multiple_of(12) { 12 } else { self.hour % 12 };
            match spec {
                Some('Y') => {
                    let _ = write!(out, "{}", self.year);
                }
                Some('y') => num(&mut out, self.year.rem_euclid(100), 2),
                Some('m') => num(&mut out, self.month.into(), 2),
                Some('d') => num(&mut out, self.day.into(), 2),
                Some('e') => {
                    let _ = write!(out, "{:>2}", self.day);
                }
                Some('H') => num(&mut out, self.hour.into(), 2),
                Some('I') => num(&mut out, hour12.into(), 2),
                Some('M') => num(&mut out, self.minute.into(), 2),
                Some('S') => num(&mut out, self.second.into(), 2),
                Some('j') => num(&mut out, self.yday.into(), 3),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('A') => out.push_str(DAYS[self.weekday as usize]),
                Some('a') => out.push_str(&DAYS[self.weekday as usize][..3]),
                Some('B') => out.push_str(MONTHS[(self.month - 1) as usize]),
                Some('b') | Some('h') => out.push_str(&MONTHS[(self.month - 1) as usize][..3]),
                Some('u') => num(&mut out, (self.weekday + 1).into(), 1),
                Some('w') => num(&mut out, ((self.weekday + 1) % 7).into(), 1),
                Some('F') => out.push_str(&self.format("%Y-%m-%d")),
                Some('T') => out.push_str(&self.format("%H:%M:%S")),
                Some('D') => out.push_str(&self.format("%m/%d/%y")),
                Some('Z') => out.push_str("UTC"),
                Some('z') => out.push_str("+0000"),
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    if !pad {
                        out.push('-');
                    }
                    out.push(other);
                }
                None => out.push('%'),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = DateTime::from_unix(1_709_211_909);
        assert_eq!(t.format("%Y-%m-%d %H:%M:%S"), "2024-02-29 13:05:09");
        assert_eq!(t.format("%d %b %Y, %A %-I%p, day %j"), "29 Feb 2024, Thursday 1PM, day 060");
        let t = DateTime::from_unix(0);
        assert_eq!(t.format("%a %B %-d %y %%"), "Thu January 1 70 %");
    }
}
