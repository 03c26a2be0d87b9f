//! A minimal PNG decoder for the tests, written apart from the encoder so it can disagree:
//! its own CRC-32 and Adler-32, inflate of stored and fixed-Huffman blocks, all five filters.

#![allow(dead_code)]

/// A decoded 8-bit RGB PNG.
pub struct Decoded {
    pub width: u32,
    pub height: u32,
    pub rgb: Vec<u8>,
    /// Chunk types in file order.
    pub chunks: Vec<[u8; 4]>,
}

impl Decoded {
    pub fn pixel(&self, x: i32, y: i32) -> [u8; 3] {
        let i = (y as usize * self.width as usize + x as usize) * 3;
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }
}

pub fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn adler32(bytes: &[u8]) -> u32 {
    let (mut a, mut b) = (1u64, 0u64);
    for &x in bytes {
        a = (a + u64::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    ((b << 16) | a) as u32
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub fn decode(png: &[u8]) -> Result<Decoded, String> {
    if png.get(..8) != Some(&[0x89, b'P', b'N', b'G', 13, 10, 26, 10][..]) {
        return Err("bad signature".into());
    }
    let (mut pos, mut chunks, mut idat, mut header) = (8, Vec::new(), Vec::new(), None);
    loop {
        let len = be32(png.get(pos..pos + 4).ok_or("truncated chunk length")?) as usize;
        let body = png.get(pos + 4..pos + 8 + len).ok_or("truncated chunk")?;
        let crc = be32(
            png.get(pos + 8 + len..pos + 12 + len)
                .ok_or("truncated crc")?,
        );
        if crc32(body) != crc {
            return Err(format!("crc mismatch in chunk at byte {pos}"));
        }
        let kind: [u8; 4] = body[..4].try_into().unwrap();
        let data = &body[4..];
        chunks.push(kind);
        match &kind {
            b"IHDR" => header = Some(data.to_vec()),
            b"IDAT" => idat.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        pos += 12 + len;
    }
    if chunks.first() != Some(b"IHDR") || pos + 12 != png.len() {
        return Err("IHDR must come first and IEND last".into());
    }
    let h = header.unwrap();
    let (width, height) = (be32(&h[0..4]), be32(&h[4..8]));
    if h[8..13] != [8, 2, 0, 0, 0] {
        return Err(format!("unsupported format {:?}", &h[8..13]));
    }
    let raw = zlib_decompress(&idat)?;
    let stride = width as usize * 3;
    if raw.len() != height as usize * (stride + 1) {
        return Err(format!(
            "{} bytes of image data for {width}x{height}",
            raw.len()
        ));
    }
    Ok(Decoded {
        width,
        height,
        rgb: unfilter(&raw, stride)?,
        chunks,
    })
}

fn unfilter(raw: &[u8], stride: usize) -> Result<Vec<u8>, String> {
    let mut out: Vec<u8> = Vec::with_capacity(raw.len());
    for (y, row) in raw.chunks(stride + 1).enumerate() {
        let start = out.len();
        for (i, &x) in row[1..].iter().enumerate() {
            let a = if i >= 3 { out[start + i - 3] } else { 0 };
            let b = if y > 0 { out[start + i - stride] } else { 0 };
            let c = if y > 0 && i >= 3 {
                out[start + i - stride - 3]
            } else {
                0
            };
            let predictor = match row[0] {
                0 => 0,
                1 => a,
                2 => b,
                3 => ((u16::from(a) + u16::from(b)) / 2) as u8,
                4 => {
                    let p = i16::from(a) + i16::from(b) - i16::from(c);
                    let (pa, pb, pc) = (
                        (p - i16::from(a)).abs(),
                        (p - i16::from(b)).abs(),
                        (p - i16::from(c)).abs(),
                    );
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    }
                }
                f => return Err(format!("row {y}: filter type {f}")),
            };
            out.push(x.wrapping_add(predictor));
        }
    }
    Ok(out)
}

struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bits<'_> {
    fn bit(&mut self) -> Result<u32, String> {
        let byte = self
            .data
            .get(self.pos / 8)
            .ok_or("deflate stream ends early")?;
        let b = u32::from(byte >> (self.pos % 8)) & 1;
        self.pos += 1;
        Ok(b)
    }
    /// `n` bits, least significant first (ordinary fields).
    fn bits(&mut self, n: u32) -> Result<u32, String> {
        (0..n).try_fold(0, |acc, i| Ok(acc | (self.bit()? << i)))
    }
    /// `n` more bits appended to a Huffman code, most significant first.
    fn code(&mut self, prefix: u32, n: u32) -> Result<u32, String> {
        (0..n).try_fold(prefix, |acc, _| Ok((acc << 1) | self.bit()?))
    }
}

const LEN_BASE: [u32; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LEN_EXTRA: [u32; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];
const DIST_BASE: [u32; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
    2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
];
const DIST_EXTRA: [u32; 30] = [
    0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13,
    13,
];

/// The fixed literal/length code of RFC 1951 §3.2.6, read bit by bit.
fn fixed_symbol(bits: &mut Bits) -> Result<u32, String> {
    let c7 = bits.code(0, 7)?;
    if c7 <= 0b001_0111 {
        return Ok(256 + c7);
    }
    let c8 = bits.code(c7, 1)?;
    match c8 {
        0x30..=0xbf => Ok(c8 - 0x30),
        0xc0..=0xc7 => Ok(280 + c8 - 0xc0),
        _ => Ok(144 + bits.code(c8, 1)? - 0x190),
    }
}

pub fn zlib_decompress(z: &[u8]) -> Result<Vec<u8>, String> {
    if z.len() < 6
        || z[0] & 0x0f != 8
        || (u32::from(z[0]) * 256 + u32::from(z[1])) % 31 != 0
        || z[1] & 0x20 != 0
    {
        return Err("bad zlib header".into());
    }
    let mut bits = Bits {
        data: &z[2..z.len() - 4],
        pos: 0,
    };
    let mut out = Vec::new();
    loop {
        let last = bits.bit()? == 1;
        match bits.bits(2)? {
            0 => {
                bits.pos = bits.pos.div_ceil(8) * 8;
                let len = bits.bits(16)? as usize;
                if bits.bits(16)? as usize != !len & 0xffff {
                    return Err("stored block length check failed".into());
                }
                let start = bits.pos / 8;
                out.extend_from_slice(
                    bits.data
                        .get(start..start + len)
                        .ok_or("stored block overruns")?,
                );
                bits.pos += len * 8;
            }
            1 => loop {
                let symbol = fixed_symbol(&mut bits)?;
                if symbol < 256 {
                    out.push(symbol as u8);
                    continue;
                }
                if symbol == 256 {
                    break;
                }
                let i = (symbol - 257) as usize;
                let length =
                    LEN_BASE.get(i).ok_or("bad length symbol")? + bits.bits(LEN_EXTRA[i])?;
                let d = bits.code(0, 5)? as usize;
                let distance = (DIST_BASE.get(d).ok_or("bad distance code")?
                    + bits.bits(DIST_EXTRA[d])?) as usize;
                if distance > out.len() {
                    return Err(format!("distance {distance} reaches before the start"));
                }
                for _ in 0..length {
                    out.push(out[out.len() - distance]);
                }
            },
            t => return Err(format!("block type {t} not supported by the test decoder")),
        }
        if last {
            break;
        }
    }
    if bits.pos.div_ceil(8) != bits.data.len() {
        return Err("bytes left after the final block".into());
    }
    if adler32(&out) != be32(&z[z.len() - 4..]) {
        return Err("adler32 mismatch".into());
    }
    Ok(out)
}
