//! A small PNG encoder: 8-bit RGB, no interlacing, one `IDAT` chunk.
//!
//! Each row gets the PNG filter (None, Sub or Up) whose output has the smallest sum of
//! magnitudes, the usual heuristic; plots are mostly flat colour, so filtered rows are long runs
//! of zeros. The zlib stream is one fixed-Huffman deflate block whose only back-references are
//! runs at distance 1 (a repeated byte) or 3 (a repeated pixel): a few dozen lines of code that
//! shrink a 960×540 plot from 1.5 MB to tens of kilobytes. Output is deterministic.

use crate::image::Image;

/// The eight bytes every PNG file starts with.
pub const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

/// Encodes an image as a complete PNG file.
pub fn encode(image: &Image) -> Vec<u8> {
    let (width, height) = (image.width(), image.height());
    let mut header = Vec::with_capacity(13);
    header.extend_from_slice(&width.to_be_bytes());
    header.extend_from_slice(&height.to_be_bytes());
    // Bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace.
    header.extend_from_slice(&[8, 2, 0, 0, 0]);

    let filtered = filter_rows(image.rgb(), width as usize * 3);
    let mut out = Vec::with_capacity(filtered.len() / 16 + 64);
    out.extend_from_slice(&SIGNATURE);
    write_chunk(&mut out, b"IHDR", &header);
    write_chunk(&mut out, b"IDAT", &zlib(&filtered));
    write_chunk(&mut out, b"IEND", &[]);
    out
}

fn write_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    let len = u32::try_from(data.len()).expect("a PNG chunk holds less than 4 GiB");
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut crc = crc32fast::Hasher::new();
    crc.update(kind);
    crc.update(data);
    out.extend_from_slice(&crc.finalize().to_be_bytes());
}

/// Prefixes each row with its filter type byte and filters it (`stride` = bytes per row).
fn filter_rows(rgb: &[u8], stride: usize) -> Vec<u8> {
    const BPP: usize = 3;
    let mut out = Vec::with_capacity(rgb.len() + rgb.len() / stride.max(1));
    let zeros = vec![0u8; stride];
    let mut sub = vec![0u8; stride];
    let mut up = vec![0u8; stride];
    for (y, row) in rgb.chunks_exact(stride).enumerate() {
        let above = if y > 0 {
            &rgb[(y - 1) * stride..y * stride]
        } else {
            &zeros[..]
        };
        for i in 0..stride {
            let left = if i >= BPP { row[i - BPP] } else { 0 };
            sub[i] = row[i].wrapping_sub(left);
            up[i] = row[i].wrapping_sub(above[i]);
        }
        // Plain loops, not iterator chains: the workspace builds its own crates unoptimized.
        let (kind, bytes) = [(0u8, row), (1, &sub[..]), (2, &up[..])]
            .into_iter()
            .min_by_key(|(_, bytes)| cost(bytes))
            .expect("three candidates");
        out.push(kind);
        out.extend_from_slice(bytes);
    }
    out
}

/// Sum of the bytes read as signed magnitudes: small when a filter predicts well.
fn cost(bytes: &[u8]) -> u32 {
    let mut sum = 0u32;
    for &b in bytes {
        sum += u32::from((b as i8).unsigned_abs());
    }
    sum
}

/// A zlib stream (RFC 1950) around one fixed-Huffman deflate block (RFC 1951).
fn zlib(data: &[u8]) -> Vec<u8> {
    // CMF 0x78: deflate with a 32 KiB window; FLG 0x01 makes the header a multiple of 31.
    let mut bits = BitWriter {
        out: vec![0x78, 0x01],
        acc: 0,
        len: 0,
    };
    bits.put(1, 1); // BFINAL
    bits.put(1, 2); // BTYPE = 01, fixed Huffman codes
    let mut i = 0;
    while i < data.len() {
        // A repeated byte first; a repeated pixel only when that run is not already maximal.
        let (mut length, mut distance) = (run_length(data, i, 1), 1);
        if length < MAX_MATCH {
            let pixel = run_length(data, i, 3);
            if pixel > length {
                (length, distance) = (pixel, 3);
            }
        }
        if length >= 3 {
            bits.put_length(length);
            // Distances 1..=4 are fixed codes 0..=3 with no extra bits.
            bits.put_huffman(distance as u32 - 1, 5);
            i += length;
        } else {
            bits.put_literal(u16::from(data[i]));
            i += 1;
        }
    }
    bits.put_literal(256); // end of block
    let mut out = bits.finish();
    out.extend_from_slice(&adler32(data).to_be_bytes());
    out
}

/// Deflate's longest match.
const MAX_MATCH: usize = 258;

/// How many bytes from `i` on repeat the bytes `distance` earlier (at most [`MAX_MATCH`]; 0
/// when `i` is closer than `distance` to the start).
fn run_length(data: &[u8], i: usize, distance: usize) -> usize {
    if i < distance {
        return 0;
    }
    let end = data.len().min(i + MAX_MATCH);
    let mut j = i;
    while j < end && data[j] == data[j - distance] {
        j += 1;
    }
    j - i
}

/// The zlib checksum of the uncompressed data.
fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65_521;
    let (mut a, mut b) = (1u32, 0u32);
    // 5552 bytes is the most that can be summed before `b` may overflow a u32.
    for chunk in data.chunks(5552) {
        for &byte in chunk {
            a += u32::from(byte);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

/// Deflate length symbols 257..=285: the shortest length of each, and its extra bits.
const LENGTH_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LENGTH_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];

/// Packs bits least-significant first, as deflate requires.
struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    len: u32,
}

impl BitWriter {
    fn put(&mut self, value: u32, count: u32) {
        self.acc |= u64::from(value) << self.len;
        self.len += count;
        while self.len >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.len -= 8;
        }
    }

    /// Huffman codes are stored most-significant bit first, unlike every other field.
    fn put_huffman(&mut self, code: u32, count: u32) {
        self.put(code.reverse_bits() >> (32 - count), count);
    }

    fn put_literal(&mut self, symbol: u16) {
        let s = u32::from(symbol);
        match symbol {
            0..=143 => self.put_huffman(0x30 + s, 8),
            144..=255 => self.put_huffman(0x190 + s - 144, 9),
            256..=279 => self.put_huffman(s - 256, 7),
            _ => self.put_huffman(0xc0 + s - 280, 8),
        }
    }

    fn put_length(&mut self, length: usize) {
        let index = LENGTH_BASE
            .iter()
            .rposition(|&base| usize::from(base) <= length)
            .expect("match lengths are at least 3");
        self.put_literal(257 + index as u16);
        let extra = u32::from(LENGTH_EXTRA[index]);
        if extra > 0 {
            self.put((length - usize::from(LENGTH_BASE[index])) as u32, extra);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        if self.len > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adler32_of_known_strings() {
        // Values from RFC 1950's definition, computed by hand for short inputs.
        assert_eq!(adler32(b""), 1);
        assert_eq!(adler32(b"a"), 0x0062_0062);
        assert_eq!(adler32(b"Wikipedia"), 0x11e6_0398);
    }

    #[test]
    fn huffman_codes_are_bit_reversed() {
        let mut bits = BitWriter {
            out: Vec::new(),
            acc: 0,
            len: 0,
        };
        // Literal 0 has the 8-bit code 00110000, sent MSB first: 0,0,1,1,0,0,0,0.
        bits.put_literal(0);
        assert_eq!(bits.finish(), vec![0b0000_1100]);
    }
}
