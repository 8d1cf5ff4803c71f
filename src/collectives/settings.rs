//! The collective settings every rank of a communicator must share, compared when it is made.
//!
//! Which kernel, round layout or path a call takes is decided by each rank on its own from its
//! configuration (`GSC_COLL_*`): ranks that disagree would run different kernels against each
//! other's flags, or one would enter an exchange inside a call that the others never join —
//! a hang until the timeout, or wrong data. So the ranks send their settings with the
//! workspace exchange and every rank refuses a communicator whose ranks differ, naming the
//! first rank and knob that differ. The workspace entry's format is here too.

use crate::config::Config;
use crate::error::{Error, Result, Status};

/// What a rank sends when a communicator is made: its workspace's base, its settings
/// (`encode`, length first) and its workspace's IPC key.
pub(crate) fn encode_workspace_entry(base: u64, settings: &[u8], key: &[u8]) -> Vec<u8> {
    let mut v = base.to_le_bytes().to_vec();
    v.extend_from_slice(&(settings.len() as u32).to_le_bytes());
    v.extend_from_slice(settings);
    v.extend_from_slice(key);
    v
}

/// The inverse of `encode_workspace_entry` for rank `rank`'s entry: (base, settings, key), or
/// an error naming the rank.
pub(crate) fn decode_workspace_entry(rank: usize, entry: &[u8]) -> Result<(u64, &[u8], &[u8])> {
    let short = || Error::new(Status::ConnectionReset, format!("rank {rank} sent a workspace entry of {} bytes", entry.len()));
    let (base, rest) = entry.split_at_checked(8).ok_or_else(short)?;
    let (len, rest) = rest.split_at_checked(4).ok_or_else(short)?;
    let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
    let (settings, key) = rest.split_at_checked(len).ok_or_else(short)?;
    Ok((u64::from_le_bytes(base.try_into().expect("8 bytes")), settings, key))
}

/// The knobs compared (the rest — timeouts, logging, caches — may differ between ranks).
/// `GSC_COLL_LARGE_ROUND` is the value the process uses (`cuda::coll::big_round_max`, read once).
const SHARED_KNOBS: [&str; 17] = [
    "GSC_COLL_LARGE_MIN",
    "GSC_COLL_LARGE_ALGO",
    "GSC_COLL_LARGE_BLOCKS",
    "GSC_COLL_LARGE_THREADS",
    "GSC_COLL_LARGE_STAGES",
    "GSC_COLL_LARGE_WARPS",
    "GSC_COLL_LARGE_ROUND",
    "GSC_COLL_CE",
    "GSC_COLL_CE_MIN",
    "GSC_COLL_SM",
    "GSC_COLL_SM_MIN",
    "GSC_COLL_RING",
    "GSC_COLL_RING_MIN",
    "GSC_COLL_RING_PIECES",
    "GSC_COLL_TRIGGER_MAX",
    "GSC_COLL_P2P_MAX",
    "GSC_COLL_CHECK",
];

/// This rank's settings as `NAME=value` lines; `round`: the workspace round this process uses.
pub(crate) fn encode(config: &Config, round: usize) -> Vec<u8> {
    let mut c = config.clone();
    c.coll_large_round = round;
    SHARED_KNOBS.iter().map(|k| format!("{k}={}\n", c.get(k).expect("a knob of the table"))).collect::<String>().into_bytes()
}

/// Every rank's settings (`encode`) agree, or an error naming the first rank that differs from
/// rank 0 and how.
pub(crate) fn agree(all: &[&[u8]]) -> Result<()> {
    let lines = |b: &[u8]| -> Vec<String> { String::from_utf8_lossy(b).lines().map(str::to_string).collect() };
    let Some(first) = all.first() else { return Ok(()) };
    let ours = lines(first);
    for (r, other) in all.iter().enumerate().skip(1) {
        let theirs = lines(other);
        if theirs == ours {
            continue;
        }
        let diff = ours.iter().zip(&theirs).find(|(a, b)| a != b);
        let what = match diff {
            Some((a, b)) => format!("{b} where rank 0 has {a}"),
            None => format!("{} settings where rank 0 has {} (a different gscomm version?)", theirs.len(), ours.len()),
        };
        return Err(Error::invalid_param(format!(
            "rank {r} runs collectives with {what}: every rank of a communicator needs the same collective settings"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Tristate;

    #[test]
    fn the_same_settings_agree_and_a_different_one_is_named_with_its_rank() {
        let c = Config::default();
        let a = encode(&c, 8 << 20);
        agree(&[&a, &a, &a]).unwrap();
        agree(&[]).unwrap();
        let mut d = c.clone();
        d.coll_sm = Tristate::On;
        let b = encode(&d, 8 << 20);
        let e = agree(&[&a, &a, &b, &a]).unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("GSC_COLL_SM=on where rank 0 has GSC_COLL_SM=auto"), "{e}");
        let r = encode(&c, 16 << 20);
        let e = agree(&[&a, &r]).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("GSC_COLL_LARGE_ROUND"), "{e}");
        let e = agree(&[&a, &a[..a.len() / 2]]).unwrap_err().to_string();
        assert!(e.contains("rank 1"), "{e}");
    }

    #[test]
    fn workspace_entries_round_trip_and_short_ones_name_the_rank() {
        let e = encode_workspace_entry(0x7000, b"GSC_COLL_SM=on\n", &[9; 40]);
        assert_eq!(decode_workspace_entry(3, &e).unwrap(), (0x7000, &b"GSC_COLL_SM=on\n"[..], &[9u8; 40][..]));
        for cut in [0, 7, 11, 12 + 14] {
            let err = decode_workspace_entry(3, &e[..cut]).unwrap_err().to_string();
            assert!(err.contains("rank 3 sent a workspace entry"), "{cut}: {err}");
        }
    }

    #[test]
    fn every_shared_knob_is_in_the_table_and_timeouts_are_not_compared() {
        let s = String::from_utf8(encode(&Config::default(), 8 << 20)).unwrap();
        assert_eq!(s.lines().count(), SHARED_KNOBS.len());
        assert!(!s.contains("GSC_TIMEOUT"));
    }
}
