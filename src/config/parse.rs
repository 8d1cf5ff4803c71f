//! Value syntaxes shared by the knobs: sizes, durations, tristates, selection lists, host:port.
//!
//! Every parser returns `Err(reason)` where `reason` says what was expected; the caller prefixes
//! it with `NAME="value": ` so that all messages have one shape. Parsers never see the variable
//! name, which keeps them reusable and the messages uniform.

use std::time::Duration;

pub(crate) const SIZE_EXPECTED: &str = "expected a size such as 8192, 64K or 4M";
pub(crate) const DURATION_EXPECTED: &str = "expected a duration such as 10s, 100ms, 250us or 2m";
pub(crate) const DURATION_INF_EXPECTED: &str = "expected a duration such as 10s, 100ms, 250us or 2m, or inf";
pub(crate) const TRISTATE_EXPECTED: &str = "expected auto, on/yes/y/true/1 or off/no/n/false/0";

/// Parse a byte count: decimal digits and an optional binary unit (K, M, G, T; 1K = 1024), the
/// unit optionally followed by `B` or `iB`, case-insensitive. `inf` is deliberately not a size:
/// every size knob bounds a buffer that is really allocated.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    if digits.is_empty() {
        return Err(SIZE_EXPECTED.to_string());
    }
    let shift = match unit.trim_start().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(SIZE_EXPECTED.to_string()),
    };
    let number: u64 = digits.parse().map_err(|_| format!("{SIZE_EXPECTED} (value too large)"))?;
    number.checked_mul(1u64 << shift).ok_or_else(|| format!("{SIZE_EXPECTED} (value too large)"))
}

/// Parse a size that must also fit the address space of this process.
pub(crate) fn parse_usize(text: &str) -> Result<usize, String> {
    let v = parse_size(text)?;
    usize::try_from(v).map_err(|_| format!("{SIZE_EXPECTED} (value too large)"))
}

/// The shortest exact text for a size: the largest binary unit that divides it.
pub(crate) fn format_size(v: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "T"), (30, "G"), (20, "M"), (10, "K")];
    if v != 0 {
        for (shift, suffix) in UNITS {
            if v.trailing_zeros() >= shift {
                return format!("{}{suffix}", v >> shift);
            }
        }
    }
    v.to_string()
}

/// Parse a duration: a decimal number (fraction allowed: `1.5s`) with an optional unit `ns`,
/// `us`, `ms`, `s`, `m`/`min` or `h`; a bare number is seconds. `inf` is handled by the callers
/// that allow it, so that knobs which need a finite bound reject it with the right message.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let number_end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(number_end);
    let unit_ns: u128 = match unit.trim_start().to_ascii_lowercase().as_str() {
        "ns" => 1,
        "us" | "\u{b5}s" => 1_000,
        "ms" => 1_000_000,
        "" | "s" | "sec" => 1_000_000_000,
        "m" | "min" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return Err(DURATION_EXPECTED.to_string()),
    };
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    // "." alone, "1.2.3" or more than 18 fraction digits (beyond any unit's resolution and a
    // risk of overflowing the scale below) are not durations.
    if (int_part.is_empty() && frac_part.is_empty()) || frac_part.contains('.') || frac_part.len() > 18 {
        return Err(DURATION_EXPECTED.to_string());
    }
    let too_large = || format!("{DURATION_EXPECTED} (value too large)");
    let int: u128 = if int_part.is_empty() { 0 } else { int_part.parse().map_err(|_| too_large())? };
    let mut nanos = int.checked_mul(unit_ns).ok_or_else(too_large)?;
    if !frac_part.is_empty() {
        let frac: u128 = frac_part.parse().map_err(|_| DURATION_EXPECTED.to_string())?;
        // frac < 10^18 and unit_ns <= 3.6e12, so the product fits in u128 easily; the sum
        // may not, when the integer part was already huge.
        let frac_ns = frac * unit_ns / 10u128.pow(frac_part.len() as u32);
        nanos = nanos.checked_add(frac_ns).ok_or_else(too_large)?;
    }
    let nanos = u64::try_from(nanos).map_err(|_| too_large())?;
    Ok(Duration::from_nanos(nanos))
}

/// The shortest exact text for a duration, in the largest of s, ms, us, ns that divides it.
pub(crate) fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_string();
    }
    for (unit_ns, suffix) in [(1_000_000_000u128, "s"), (1_000_000, "ms"), (1_000, "us")] {
        if nanos % unit_ns == 0 {
            return format!("{}{suffix}", nanos / unit_ns);
        }
    }
    format!("{nanos}ns")
}

/// `auto`, or a boolean in any of the usual spellings. `None` means auto.
pub(crate) fn parse_tristate(text: &str) -> Result<Option<bool>, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "auto" | "try" => Ok(None),
        "on" | "yes" | "y" | "true" | "1" => Ok(Some(true)),
        "off" | "no" | "n" | "false" | "0" => Ok(Some(false)),
        _ => Err(TRISTATE_EXPECTED.to_string()),
    }
}

/// Parse a selection out of a fixed set of named items: `all`, `a,b,c` (only those), or `^a,b`
/// (all but those). The result is in the order of `all`, without duplicates, and never empty.
/// `what` names one item for messages ("lane", "subsystem").
pub(crate) fn parse_selection<T: Copy + PartialEq>(
    text: &str,
    all: &[T],
    name_of: fn(T) -> &'static str,
    what: &str,
) -> Result<Vec<T>, String> {
    let text = text.trim();
    let known = || all.iter().map(|&t| name_of(t)).collect::<Vec<_>>().join(", ");
    if text.eq_ignore_ascii_case("all") {
        return Ok(all.to_vec());
    }
    let (exclude, list) = match text.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let mut named = Vec::new();
    for item in list.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(format!(
                "expected all, a comma-separated list of {what}s or ^list to exclude some \
                 (known {what}s: {})",
                known()
            ));
        }
        match all.iter().copied().find(|&t| name_of(t).eq_ignore_ascii_case(item)) {
            Some(t) => named.push(t),
            None => {
                return Err(format!("unknown {what} \"{item}\" (known {what}s: {})", known()));
            }
        }
    }
    let selected: Vec<T> = all.iter().copied().filter(|t| named.contains(t) != exclude).collect();
    if selected.is_empty() {
        return Err(format!("selects no {what}s"));
    }
    Ok(selected)
}

/// The canonical text of a selection: `all` when everything is selected, else the names.
pub(crate) fn format_selection<T: Copy + PartialEq>(selected: &[T], all: &[T], name_of: fn(T) -> &'static str) -> String {
    if all.iter().all(|t| selected.contains(t)) {
        return "all".to_string();
    }
    selected.iter().map(|&t| name_of(t)).collect::<Vec<_>>().join(",")
}

/// Check `host:port` (IPv6 hosts in brackets: `[::1]:5000`). The port must be non-zero because
/// this names a peer to connect to, not a socket to bind.
pub(crate) fn check_host_port(text: &str) -> Result<(), String> {
    const EXPECTED: &str = "expected host:port such as node01:5000, 10.0.0.1:5000 or [::1]:5000";
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(EXPECTED.to_string());
    };
    let host_ok = match host.strip_prefix('[') {
        Some(inner) => inner.strip_suffix(']').is_some_and(|h| !h.is_empty() && h.contains(':')),
        None => !host.is_empty() && !host.contains(':') && !host.contains(char::is_whitespace),
    };
    if !host_ok {
        return Err(EXPECTED.to_string());
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(()),
        _ => Err(format!("{EXPECTED} (port must be 1..=65535)")),
    }
}

/// Levenshtein distance over bytes; knob names are ASCII so bytes are characters.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, &ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let subst = prev[j] + usize::from(ca != cb);
            cur[j + 1] = subst.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// The closest candidate to `name`, if close enough to be a plausible typo. Comparison ignores
/// case (`GSC_Log_Level`) and the `GSC_` prefix, and the allowed distance grows with the length
/// of the name so that short unrelated names (`GSC_FOO`) get no suggestion.
pub(crate) fn suggest(name: &str, candidates: &[&'static str]) -> Option<&'static str> {
    let strip = |s: &str| -> String {
        let upper = s.to_ascii_uppercase();
        upper.strip_prefix("GSC_").map(str::to_string).unwrap_or(upper)
    };
    let wanted = strip(name);
    if wanted.is_empty() {
        return None;
    }
    let limit = (wanted.len() / 3).clamp(1, 3);
    candidates.iter().map(|&c| (edit_distance(&wanted, &strip(c)), c)).filter(|&(d, _)| d <= limit).min_by_key(|&(d, _)| d).map(|(_, c)| c)
}
