//! TensorBoard event files: every scalar of a [`StepRecord`] as a TensorBoard scalar summary, so
//! a run can be followed in TensorBoard like a run of any other trainer.
//!
//! The format is TensorFlow's record file of `Event` protocol buffers, written by hand (three
//! messages, a handful of fields: no protobuf dependency):
//!
//! - a record is `length: u64 LE`, `masked_crc32c(length bytes): u32 LE`, the payload, and
//!   `masked_crc32c(payload): u32 LE`, where `masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8`;
//! - the first event of a file carries `file_version = "brain.Event:2"`;
//! - each step is one `Event { wall_time, step, summary: Summary { value: [Value { tag,
//!   simple_value }] } }`, its values tagged with the `metrics.jsonl` key names;
//! - a writer opened for a resumed run first writes `SessionLog { status: START }` at the first
//!   step it will log again: TensorBoard then drops the older files' events from that step on, as
//!   `metrics.jsonl` drops its lines after the checkpoint.
//!
//! Each writer starts its own file, `events.out.tfevents.<unix seconds>.<host>.<pid>`, as
//! TensorBoard's own writers do; a directory of several (a resumed run) reads as one run.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::ReportError;
use crate::log::StepRecord;

/// The directory inside a run's output dir that `[metrics] tensorboard = true` writes to.
pub const TENSORBOARD_DIR: &str = "tensorboard";

/// Appends TensorBoard events to one new file in a directory.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    writer: BufWriter<File>,
    event: Vec<u8>,
    record: Vec<u8>,
}

impl EventWriter {
    /// Starts a new event file in `dir` (created if absent). `purge_from`: the first step a
    /// resumed run logs again; TensorBoard forgets what earlier files logged from it on.
    pub fn create(dir: impl AsRef<Path>, purge_from: Option<u64>) -> Result<Self, ReportError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| ReportError::io(dir, e))?;
        let now = unix_now();
        let host = hostname();
        let pid = std::process::id();
        // A second writer in the same second and process gets the next free name.
        let mut path = dir.join(format!("events.out.tfevents.{}.{host}.{pid}", now as u64));
        let mut n = 1;
        let file = loop {
            match File::options().write(true).create_new(true).open(&path) {
                Ok(file) => break file,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    path = dir.join(format!(
                        "events.out.tfevents.{}.{host}.{pid}.{n}",
                        now as u64
                    ));
                    n += 1;
                }
                Err(e) => return Err(ReportError::io(&path, e)),
            }
        };
        let mut writer = Self {
            path,
            writer: BufWriter::new(file),
            event: Vec::new(),
            record: Vec::new(),
        };
        writer.write_event(now, 0, |e| put_bytes(e, 3, b"brain.Event:2"))?;
        if let Some(step) = purge_from {
            // SessionLog { status = START (1) }.
            writer.write_event(now, step, |e| {
                put_message(e, 7, |s| put_varint_field(s, 1, 1))
            })?;
        }
        writer.flush()?;
        Ok(writer)
    }

    /// Writes every finite scalar of `record` (its fields and its extra keys, tagged with their
    /// `metrics.jsonl` names) as one event at `record.step`, and flushes it to the OS.
    pub fn append(&mut self, record: &StepRecord) -> Result<(), ReportError> {
        let scalars = scalars(record);
        if scalars.is_empty() {
            return Ok(());
        }
        self.write_event(unix_now(), record.step, |event| {
            put_message(event, 5, |summary| {
                for (tag, value) in &scalars {
                    put_message(summary, 1, |v| {
                        put_bytes(v, 1, tag.as_bytes());
                        put_f32(v, 2, *value as f32);
                    });
                }
            });
        })?;
        self.flush()
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_event(
        &mut self,
        wall_time: f64,
        step: u64,
        what: impl FnOnce(&mut Vec<u8>),
    ) -> Result<(), ReportError> {
        self.event.clear();
        put_f64(&mut self.event, 1, wall_time);
        // int64 on the wire; steps never reach 2^63.
        put_varint_field(&mut self.event, 2, step);
        what(&mut self.event);
        self.record.clear();
        let len = (self.event.len() as u64).to_le_bytes();
        self.record.extend_from_slice(&len);
        self.record
            .extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        self.record.extend_from_slice(&self.event);
        self.record
            .extend_from_slice(&masked_crc32c(&self.event).to_le_bytes());
        self.writer
            .write_all(&self.record)
            .map_err(|e| ReportError::io(&self.path, e))
    }

    fn flush(&mut self) -> Result<(), ReportError> {
        self.writer
            .flush()
            .map_err(|e| ReportError::io(&self.path, e))
    }
}

/// The scalars of one record with their tags: the named fields first, then the extra keys in
/// order. Absent and non-finite values are left out (TensorBoard would draw a NaN as a gap
/// anyway, and `metrics.jsonl` writes it as `null`).
pub fn scalars(record: &StepRecord) -> Vec<(&str, f64)> {
    let named = [
        ("wall_s", Some(record.wall_s)),
        ("reward_mean", Some(record.reward_mean)),
        ("eval_accuracy", record.eval_accuracy),
        ("version_lag_mean", Some(record.version_lag_mean)),
        ("tokens_per_s", record.tokens_per_s),
        ("loss", record.loss),
        ("policy_version", record.policy_version.map(|v| v.0 as f64)),
    ];
    named
        .into_iter()
        .filter_map(|(tag, value)| value.map(|v| (tag, v)))
        .chain(record.extra.iter().map(|(k, v)| (k.as_str(), *v)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The host name for the file name (as TensorBoard's writers put it there), file-name safe.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let clean: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(63)
        .collect();
    if clean.is_empty() {
        "localhost".to_owned()
    } else {
        clean
    }
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

fn put_varint_field(out: &mut Vec<u8>, field: u32, value: u64) {
    put_key(out, field, 0);
    put_varint(out, value);
}

fn put_f64(out: &mut Vec<u8>, field: u32, value: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_f32(out: &mut Vec<u8>, field: u32, value: f32) {
    put_key(out, field, 5);
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A nested message, written into a scratch buffer first for its length prefix.
fn put_message(out: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    body(&mut inner);
    put_bytes(out, field, &inner);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven.
fn crc32c(bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 == 1 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !bytes.iter().fold(!0u32, |crc, &b| {
        TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// The record format's masked CRC (a CRC of data that holds CRCs stays distinguishable).
fn masked_crc32c(bytes: &[u8]) -> u32 {
    let crc = crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The check value of CRC-32C over "123456789" (RFC 3720, appendix B.4).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn varints_are_little_endian_groups_of_seven_bits() {
        let mut out = Vec::new();
        put_varint(&mut out, 300);
        assert_eq!(out, [0xAC, 0x02]);
        out.clear();
        put_varint(&mut out, 1);
        assert_eq!(out, [1]);
    }
}
