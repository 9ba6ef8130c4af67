//! Byte sizes as command lines write them. Here because this is the one
//! crate the daemon (`serve --size`) and the bench (`--bs`) both use.

/// Parses a byte size with an optional binary suffix: 4096, 64K, 512M, 1G, 2T.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let not_a_size = || format!("'{s}' is not a size like 4096, 64K, 512M or 1G");
    let (num, shift) = match t.char_indices().last() {
        // A suffix only after a number: `garbage` is not a size with the
        // unknown suffix 'e'.
        Some((i, c)) if c.is_ascii_alphabetic() => {
            if t[..i].trim().parse::<u64>().is_err() {
                return Err(not_a_size());
            }
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => {
                    return Err(format!(
                        "'{s}': unknown size suffix '{c}' (use K, M, G or T)"
                    ));
                }
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = num.trim().parse().map_err(|_| not_a_size())?;
    n.checked_mul(1u64 << shift)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("'{s}' is not a usable size"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(
            parse_size("garbage"),
            Err("'garbage' is not a size like 4096, 64K, 512M or 1G".into())
        );
        assert_eq!(
            parse_size("1X"),
            Err("'1X': unknown size suffix 'X' (use K, M, G or T)".into())
        );
    }
}
