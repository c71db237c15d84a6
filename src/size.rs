//! Byte sizes: the one parser behind every size the user writes (`lanes
//! serve --memory`, `--max-frame`, `lanes simulate --memory`, `lanes replay
//! --memory`, the byte columns of a trace file) and the one human format
//! for the sizes Lanes prints.
//!
//! A size is a number (integer or decimal) and an optional unit,
//! case-insensitive, blanks allowed between the two:
//!
//! | unit | meaning |
//! |---|---|
//! | none, `B` | bytes |
//! | `KiB`, `MiB`, `GiB`, `TiB`, `PiB` | powers of 1024 (binary) |
//! | `K`, `M`, `G`, `T`, `P` (bare) | **binary** too: `16G` is 16 GiB = 17,179,869,184 bytes |
//! | `kB`, `MB`, `GB`, `TB`, `PB` | powers of 1000 (decimal): `16GB` is 16,000,000,000 bytes |
//!
//! A bare letter is binary, as in `free -g`, `docker run --memory 16g` and
//! the JVM's `-Xmx16g`: device memory comes in powers of two. Fractions
//! (`1.5GiB`) are exact and rounded down to whole bytes.

use std::fmt;
use std::str::FromStr;

/// Why a size string was not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a size: {reason} (e.g. 512MiB, 16GiB, 1.5GB, 4096)")]
pub struct SizeError {
    /// The text as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// The units [`parse_size`] knows, lower-case, with their multipliers.
const UNITS: [(&str, u64); 17] = [
    ("", 1),
    ("b", 1),
    ("k", 1 << 10),
    ("kib", 1 << 10),
    ("m", 1 << 20),
    ("mib", 1 << 20),
    ("g", 1 << 30),
    ("gib", 1 << 30),
    ("t", 1 << 40),
    ("tib", 1 << 40),
    ("p", 1 << 50),
    ("pib", 1 << 50),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("pb", 1_000_000_000_000_000),
];

fn multiplier(unit: &str) -> Option<u64> {
    let unit = unit.to_ascii_lowercase();
    UNITS.iter().find(|(u, _)| *u == unit).map(|&(_, m)| m)
}

/// Parses a byte count (see the module docs for the units).
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError {
        input: input.to_string(),
        reason,
    };
    let s = input.trim();
    if s.starts_with('-') {
        return Err(err("a size cannot be negative"));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(err("expected a number"));
    }
    let mult = multiplier(unit.trim()).ok_or_else(|| {
        err("unknown unit (use B, KiB, MiB, GiB, TiB, PiB, or K, M, G, T, P for the same; kB, MB, GB, TB, PB for powers of 1000)")
    })?;
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if frac.contains('.') || (int.is_empty() && frac.is_empty()) {
        return Err(err("expected a number"));
    }
    let whole: u64 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| err("too large"))?
    };
    let mut bytes = whole
        .checked_mul(mult)
        .ok_or_else(|| err("too large for 64 bits"))?;
    // The fraction in exact rational arithmetic on up to 18 digits (more
    // cannot change a whole byte of a 64-bit size), rounded down.
    let digits = &frac[..frac.len().min(18)];
    if !digits.is_empty() {
        let n: u128 = digits.parse().map_err(|_| err("expected a number"))?;
        let den = 10u128.pow(digits.len() as u32);
        let part =
            u64::try_from(n * u128::from(mult) / den).map_err(|_| err("too large for 64 bits"))?;
        bytes = bytes
            .checked_add(part)
            .ok_or_else(|| err("too large for 64 bits"))?;
    }
    Ok(bytes)
}

/// Formats a byte count with a binary unit and two decimals: `512.00 MiB`,
/// `37 B` (what [`ByteSize`] displays).
pub fn format_size(bytes: u64) -> String {
    ByteSize(bytes).to_string()
}

/// A byte count: parsed with [`parse_size`] (so clap flags of this type
/// take `16GiB`), displayed with a binary unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Self, SizeError> {
        parse_size(s).map(ByteSize)
    }
}

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
    use proptest::prelude::*;

    #[test]
    fn units() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("512 mib").unwrap(), 512 << 20);
        assert_eq!(parse_size(" 2 kib ").unwrap(), 2048);
        assert_eq!(parse_size("16G").unwrap(), 16 << 30);
        assert_eq!(parse_size("16g").unwrap(), 17_179_869_184);
        assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_size("16GB").unwrap(), 16_000_000_000);
        assert_eq!(parse_size("1kB").unwrap(), 1000);
        assert_eq!(parse_size("2TB").unwrap(), 2_000_000_000_000);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        assert_eq!(parse_size(".5k").unwrap(), 512);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10 B").unwrap(), 10);
        assert_eq!(parse_size("0.001KB").unwrap(), 1);
        assert_eq!(parse_size("1.0009765625K").unwrap(), 1025);
        assert_eq!(
            parse_size("18446744073709551615").unwrap(),
            u64::MAX,
            "the largest u64"
        );
    }

    #[test]
    fn errors_name_the_input_and_say_why() {
        for (bad, why) in [
            ("", "expected a number"),
            ("lots", "expected a number"),
            ("MiB", "expected a number"),
            ("12XB", "unknown unit"),
            ("12 GiBs", "unknown unit"),
            ("1.2.3G", "expected a number"),
            ("-1G", "negative"),
            (".", "expected a number"),
            ("99999999999999999999", "too large"),
            ("20000000T", "too large"),
            ("16777216T", "too large"),
            ("16385P", "too large"),
        ] {
            let e = parse_size(bad).unwrap_err();
            assert_eq!(e.input, bad);
            assert!(e.reason.contains(why), "{bad}: {}", e.reason);
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
        assert!("lots".parse::<ByteSize>().is_err());
    }

    #[test]
    fn format() {
        assert_eq!(format_size(37), "37 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(512 << 20), "512.00 MiB");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(ByteSize(16 << 30).to_string(), "16.00 GiB");
    }

    fn unit() -> impl Strategy<Value = (&'static str, u64)> {
        prop::sample::select(vec![
            ("", 1),
            ("B", 1),
            ("K", 1 << 10),
            ("KiB", 1 << 10),
            ("M", 1 << 20),
            ("MiB", 1 << 20),
            ("G", 1 << 30),
            ("GiB", 1 << 30),
            ("T", 1 << 40),
            ("TiB", 1 << 40),
            ("kB", 1_000),
            ("MB", 1_000_000),
            ("GB", 1_000_000_000),
            ("TB", 1_000_000_000_000),
            ("P", 1 << 50),
            ("PiB", 1 << 50),
            ("PB", 1_000_000_000_000_000),
        ])
    }

    proptest! {
        /// An integer and a unit read back as their product, or as "too
        /// large" exactly when the product overflows.
        #[test]
        fn integer_with_unit(n in 0u64..=u64::MAX, (u, m) in unit(), blank in any::<bool>()) {
            let text = format!("{n}{}{u}", if blank { " " } else { "" });
            match n.checked_mul(m) {
                Some(b) => prop_assert_eq!(parse_size(&text).unwrap(), b),
                None => prop_assert!(parse_size(&text).is_err()),
            }
        }

        /// A plain byte count round-trips exactly.
        #[test]
        fn bytes_round_trip(n in any::<u64>()) {
            prop_assert_eq!(parse_size(&n.to_string()).unwrap(), n);
            prop_assert_eq!(n.to_string().parse::<ByteSize>().unwrap(), ByteSize(n));
        }

        /// What Lanes prints reads back within the rounding of two decimals.
        #[test]
        fn format_round_trips(n in 0u64..(1 << 60)) {
            let back = parse_size(&format_size(n)).unwrap();
            let err = back.abs_diff(n) as f64;
            prop_assert!(err <= n as f64 * 0.005 + 1.0, "{n} -> {} -> {back}", format_size(n));
        }

        /// Decimals are exact: `k.f` units is floor((k + f) * unit).
        #[test]
        fn fractions_are_exact(k in 0u64..1000, f in 0u32..1000, (u, m) in unit()) {
            let text = format!("{k}.{f:03}{u}");
            let want = (u128::from(k) * 1000 + u128::from(f)) * u128::from(m) / 1000;
            prop_assert_eq!(u128::from(parse_size(&text).unwrap()), want);
        }

        /// Nothing typed makes it panic.
        #[test]
        fn never_panics(s in "\\PC{0,24}") {
            let _ = parse_size(&s);
        }
    }
}
