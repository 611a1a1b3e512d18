//! Human-readable numbers for the command line's tables.

/// `124439808` → `124,439,808`.
pub fn thousands(n: u128) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1.24e8` → `124.4 M`: SI prefixes for counts and FLOPs.
pub fn si(x: f64) -> String {
    const PREFIXES: [(f64, &str); 5] =
        [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")];
    for (scale, p) in PREFIXES {
        if x.abs() >= scale {
            return format!("{:.1} {p}", x / scale);
        }
    }
    format!("{x:.0} ")
}

/// Bytes in binary units: `1536` → `1.50 KiB`.
pub fn bytes(x: f64) -> String {
    const UNITS: [(f64, &str); 4] = [
        (1_099_511_627_776.0, "TiB"),
        (1_073_741_824.0, "GiB"),
        (1_048_576.0, "MiB"),
        (1024.0, "KiB"),
    ];
    for (scale, unit) in UNITS {
        if x.abs() >= scale {
            return format!("{:.2} {unit}", x / scale);
        }
    }
    format!("{x:.0} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_counts_and_bytes() {
        assert_eq!(thousands(124_439_808), "124,439,808");
        assert_eq!(thousands(999), "999");
        assert_eq!(si(1.2444e8), "124.4 M");
        assert_eq!(bytes(1536.0), "1.50 KiB");
        assert_eq!(bytes(12.0), "12 B");
    }
}
