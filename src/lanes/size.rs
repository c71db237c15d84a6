//! Human-readable byte sizes: `parse_size("512MiB")`, `format_size(n)`.

use std::fmt;

/// Why a size string was not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size `{input}`: {reason}")]
pub struct SizeError {
    pub input: String,
    pub reason: &'static str,
}

/// Parses a byte count: a number (integer or decimal) and an optional unit.
/// `KiB`, `MiB`, `GiB`, `TiB` and the short `K`, `M`, `G`, `T` are powers
/// of 1024; `KB`, `MB`, `GB`, `TB` are powers of 1000; `B` or no unit is
/// bytes. Case-insensitive; blanks between number and unit are allowed.
/// Fractions are rounded down to whole bytes.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError {
        input: input.to_string(),
        reason,
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(err("expected a number"));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(err(
                "unknown unit (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)",
            ))
        }
    };
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if frac.contains('.') || (int.is_empty() && frac.is_empty()) {
        return Err(err("expected a number"));
    }
    let whole: u64 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| err("number too large"))?
    };
    let mut bytes = whole
        .checked_mul(mult)
        .ok_or_else(|| err("size does not fit in 64 bits"))?;
    // Fraction: exact rational arithmetic on up to 18 digits, rounded down.
    let digits = &frac[..frac.len().min(18)];
    if !digits.is_empty() {
        let num: u128 = digits.parse().map_err(|_| err("expected a number"))?;
        let den = 10u128.pow(digits.len() as u32);
        let part = u64::try_from(num * u128::from(mult) / den)
            .map_err(|_| err("size does not fit in 64 bits"))?;
        bytes = bytes
            .checked_add(part)
            .ok_or_else(|| err("size does not fit in 64 bits"))?;
    }
    Ok(bytes)
}

/// Formats a byte count with a binary unit: `512.00 MiB`, `37 B`.
pub fn format_size(bytes: u64) -> String {
    ByteSize(bytes).to_string()
}

/// A byte count that displays with a binary unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut v = self.0 as f64 / 1024.0;
        let mut u = 0;
        while v >= 1024.0 && u + 1 < UNITS.len() {
            v /= 1024.0;
            u += 1;
        }
        write!(f, "{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("512 mib").unwrap(), 512 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        assert_eq!(parse_size(".5k").unwrap(), 512);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10 B").unwrap(), 10);
        assert_eq!(parse_size("0.001KB").unwrap(), 1);
    }

    #[test]
    fn errors() {
        for bad in [
            "",
            "MiB",
            "12XB",
            "1.2.3G",
            "-1G",
            ".",
            "99999999999999999999",
            "20000000T",
        ] {
            let e = parse_size(bad).unwrap_err();
            assert_eq!(e.input, bad);
        }
    }

    #[test]
    fn format() {
        assert_eq!(format_size(37), "37 B");
        assert_eq!(format_size(512 << 20), "512.00 MiB");
        assert_eq!(format_size(1536), "1.50 KiB");
    }
}
