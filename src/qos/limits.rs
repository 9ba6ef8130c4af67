//! The QoS limits, each named once: [`qos_limits!`] below makes from one
//! table the limits in force ([`QosLimits`], the JSON that `GET
//! /api/v1/qos` answers) and a change to them ([`QosChanges`]: the
//! `serve`/`ctl qos` flags and the JSON that `PUT /api/v1/qos` takes).
//! The field name is the JSON name; the flag is given next to it.

use serde::{Deserialize, Serialize};

use super::bucket::VALUE_MAX;

/// One table, two structs. Each entry: the doc (the flag's `--help`
/// line), the field (the JSON name), the flag, its value name and parser.
macro_rules! qos_limits {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $flag:literal, $value_name:literal, $parser:expr;
    )*) => {
        /// A device's limits. Every value is a number a second (requests,
        /// or bytes); 0 is no limit. `*_max` is a burst rate, allowed for
        /// `max_length` seconds (0 is no burst beyond a tenth of a second's
        /// worth of the base rate).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct QosLimits {
            $($(#[doc = $doc])* pub $field: u64,)*
        }

        /// Limits to change, each one given or not: a limit not given
        /// keeps its value (none, at start); 0 removes one. Rates are per
        /// second; bandwidths take size suffixes (K, M, G). The flags
        /// follow qemu-storage-daemon's throttle limits (docs/qos.md).
        #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
        #[serde(deny_unknown_fields)]
        #[command(next_help_heading = "QoS (per device, 0 = no limit)")]
        pub struct QosChanges {
            $(
                $(#[doc = $doc])*
                #[arg(long = $flag, value_name = $value_name, value_parser = $parser)]
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<u64>,
            )*
        }

        impl QosLimits {
            /// These limits with the ones given in `changes` replaced.
            /// Not validated.
            pub fn with(&self, changes: &QosChanges) -> QosLimits {
                QosLimits {
                    $($field: changes.$field.unwrap_or(self.$field),)*
                }
            }
        }

        impl QosChanges {
            /// Whether no limit is given.
            pub fn is_empty(&self) -> bool {
                true $(&& self.$field.is_none())*
            }

            /// The flag that sets the limit named `name` (its field and
            /// JSON name); `name` itself for any other.
            pub fn flag(name: &str) -> &str {
                match name {
                    $(stringify!($field) => concat!("--", $flag),)*
                    other => other,
                }
            }
        }
    };
}

qos_limits! {
    /// Requests a second, reads and writes together (qsd: iops-total).
    iops_total: "iops", "N", clap::value_parser!(u64);
    /// Burst rate for --iops, allowed for --qos-max-length seconds.
    iops_total_max: "iops-max", "N", clap::value_parser!(u64);
    /// Read requests a second (qsd: iops-read).
    iops_read: "read-iops", "N", clap::value_parser!(u64);
    /// Burst rate for --read-iops.
    iops_read_max: "read-iops-max", "N", clap::value_parser!(u64);
    /// Write requests a second (qsd: iops-write); discard and
    /// write-zeroes count as writes.
    iops_write: "write-iops", "N", clap::value_parser!(u64);
    /// Burst rate for --write-iops.
    iops_write_max: "write-iops-max", "N", clap::value_parser!(u64);
    /// Bytes a second, reads and writes together (qsd: bps-total).
    bps_total: "bps", "SIZE", parse_rate;
    /// Burst rate for --bps.
    bps_total_max: "bps-max", "SIZE", parse_rate;
    /// Bytes read a second (qsd: bps-read).
    bps_read: "read-bps", "SIZE", parse_rate;
    /// Burst rate for --read-bps.
    bps_read_max: "read-bps-max", "SIZE", parse_rate;
    /// Bytes written a second (qsd: bps-write).
    bps_write: "write-bps", "SIZE", parse_rate;
    /// Burst rate for --write-bps.
    bps_write_max: "write-bps-max", "SIZE", parse_rate;
    /// Seconds a *-max burst lasts, for all of them (qsd: the
    /// *-max-length of each limit). 0 counts as 1.
    max_length: "qos-max-length", "SECONDS", clap::value_parser!(u64);
}

/// A rate and its burst, named by the rate's field (and JSON) name.
macro_rules! pair {
    ($l:ident, $rate:ident, $max:ident) => {
        (stringify!($rate), $l.$rate, $l.$max)
    };
}

impl QosLimits {
    /// (name, rate, burst) in the order of the buckets: IOPS total, read,
    /// write, then bytes total, read, write.
    pub(super) fn pairs(&self) -> [(&'static str, u64, u64); 6] {
        let l = self;
        [
            pair!(l, iops_total, iops_total_max),
            pair!(l, iops_read, iops_read_max),
            pair!(l, iops_write, iops_write_max),
            pair!(l, bps_total, bps_total_max),
            pair!(l, bps_read, bps_read_max),
            pair!(l, bps_write, bps_write_max),
        ]
    }

    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.pairs().iter().any(|&(_, avg, _)| avg > 0)
    }

    /// Refuses what qsd refuses: a burst without a rate, a burst below its
    /// rate, values past [`VALUE_MAX`], a burst length with no burst.
    /// Errors name the limits by their JSON names (the flags' are in
    /// [`QosChanges`]).
    pub fn validate(&self) -> Result<(), QosError> {
        let mut any_max = false;
        for (name, avg, max) in self.pairs() {
            if avg > VALUE_MAX || max > VALUE_MAX {
                return Err(QosError::TooLarge { name });
            }
            if max > 0 && avg == 0 {
                return Err(QosError::MaxWithoutRate { name });
            }
            if max > 0 && max < avg {
                return Err(QosError::MaxBelowRate { name, avg, max });
            }
            any_max |= max > 0;
        }
        if self.max_length > 1 && !any_max {
            return Err(QosError::LengthWithoutMax);
        }
        if self.max_length > 86_400 {
            return Err(QosError::LengthTooLong(self.max_length));
        }
        Ok(())
    }

    /// The limits that are set, as `name=value` pairs (for the log).
    pub fn summary(&self) -> String {
        let Ok(serde_json::Value::Object(map)) = serde_json::to_value(self) else {
            return String::new();
        };
        map.iter()
            .filter(|(_, v)| v.as_u64().is_some_and(|n| n > 0))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Why limits are refused. One line each.
#[derive(Debug, thiserror::Error)]
pub enum QosError {
    #[error("unknown QoS limit: {0}")]
    Unknown(String),
    #[error("bad QoS value: {0}")]
    BadValue(String),
    #[error("{name}_max needs {name} set too")]
    MaxWithoutRate { name: &'static str },
    #[error("{name}_max ({max}) cannot be lower than {name} ({avg})")]
    MaxBelowRate {
        name: &'static str,
        avg: u64,
        max: u64,
    },
    #[error("{name} and {name}_max are at most {VALUE_MAX}")]
    TooLarge { name: &'static str },
    #[error("max_length needs a *_max burst to apply to")]
    LengthWithoutMax,
    #[error("max_length is at most 86400 seconds, not {0}")]
    LengthTooLong(u64),
}

impl QosChanges {
    /// `base` with the limits given here, checked; an error names the
    /// flags, not the JSON fields (for `serve` and `ctl qos`).
    pub fn check(&self, base: QosLimits) -> Result<QosLimits, String> {
        let limits = base.with(self);
        limits.validate().map_err(|e| e.in_flags())?;
        Ok(limits)
    }
}

impl QosError {
    /// This error as the command line says it: `--iops-max needs --iops
    /// set too`.
    pub fn in_flags(&self) -> String {
        let flag = QosChanges::flag;
        let max = |name: &str| flag(&format!("{name}_max")).to_string();
        match self {
            QosError::MaxWithoutRate { name } => {
                format!("{} needs {} set too", max(name), flag(name))
            }
            QosError::MaxBelowRate { name, avg, max: m } => format!(
                "{} ({m}) cannot be lower than {} ({avg})",
                max(name),
                flag(name)
            ),
            QosError::TooLarge { name } => {
                format!("{} and {} are at most {VALUE_MAX}", flag(name), max(name))
            }
            QosError::LengthWithoutMax => {
                "--qos-max-length needs a burst rate to apply to (--iops-max, --bps-max, ...)"
                    .into()
            }
            QosError::LengthTooLong(n) => {
                format!("--qos-max-length is at most 86400 seconds, not {n}")
            }
            other => other.to_string(),
        }
    }

    /// Why JSON of the right syntax is not a [`QosChanges`]: a name that
    /// is not a limit, or a value that is not a count.
    pub fn from_json(e: serde_json::Error) -> QosError {
        let msg = e.to_string();
        // serde's own wording for `deny_unknown_fields`.
        if msg.starts_with("unknown field") {
            QosError::Unknown(msg)
        } else {
            QosError::BadValue(msg)
        }
    }
}

/// A bandwidth: a size (64K, 100M) a second, or 0 for no limit.
fn parse_rate(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    ringblk_metrics::parse_size(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        qos: QosChanges,
    }

    /// Every limit has its flag and its JSON name, and a change given
    /// either way lands in the same field.
    #[test]
    fn flags_and_json_fill_the_same_fields() {
        let flags = Flags::try_parse_from([
            "x",
            "--iops",
            "1",
            "--iops-max",
            "2",
            "--read-iops",
            "3",
            "--read-iops-max",
            "4",
            "--write-iops",
            "5",
            "--write-iops-max",
            "6",
            "--bps",
            "7",
            "--bps-max",
            "8",
            "--read-bps",
            "9",
            "--read-bps-max",
            "10",
            "--write-bps",
            "11",
            "--write-bps-max",
            "1K",
            "--qos-max-length",
            "13",
        ])
        .unwrap()
        .qos;
        let all = QosLimits::default().with(&flags);
        let json = serde_json::to_string(&all).unwrap();
        assert_eq!(
            json,
            r#"{"iops_total":1,"iops_total_max":2,"iops_read":3,"iops_read_max":4,"iops_write":5,"iops_write_max":6,"bps_total":7,"bps_total_max":8,"bps_read":9,"bps_read_max":10,"bps_write":11,"bps_write_max":1024,"max_length":13}"#
        );
        let back = QosLimits::default().with(&serde_json::from_str(&json).unwrap());
        assert_eq!(back, all);
        assert_eq!(serde_json::to_string(&flags).unwrap(), json);
    }

    #[test]
    fn changes_are_partial_and_names_are_checked() {
        let c: QosChanges = serde_json::from_str(r#"{"bps_read": 0}"#).unwrap();
        assert_eq!(c.bps_read, Some(0));
        assert!(!c.is_empty());
        assert!(QosChanges::default().is_empty());
        let base = QosLimits {
            bps_read: 5,
            iops_total: 9,
            ..QosLimits::default()
        };
        let l = base.with(&c);
        assert_eq!((l.bps_read, l.iops_total), (0, 9));
        let e = serde_json::from_str::<QosChanges>(r#"{"iops": 1}"#).unwrap_err();
        assert!(
            QosError::from_json(e)
                .to_string()
                .starts_with("unknown QoS limit: unknown field `iops`")
        );
        let e = serde_json::from_str::<QosChanges>(r#"{"iops_total": -1}"#).unwrap_err();
        assert!(matches!(QosError::from_json(e), QosError::BadValue(_)));
    }
}
