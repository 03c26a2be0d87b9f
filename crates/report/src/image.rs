//! An RGB canvas with the few primitives a plot needs: rectangles, lines, discs and text.
//!
//! Coordinates are signed pixels with the origin at the top left; anything outside the image
//! is clipped, so callers never check bounds.

use std::path::Path;

use crate::error::ReportError;
use crate::font;

/// A colour, 8 bits per channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    /// White.
    pub const WHITE: Self = Self(255, 255, 255);
    /// Black.
    pub const BLACK: Self = Self(0, 0, 0);
}

/// An 8-bit RGB raster, rows top to bottom, pixels left to right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    width: u32,
    height: u32,
    rgb: Vec<u8>,
}

impl Image {
    /// An image filled with `background`.
    ///
    /// # Panics
    /// If a side is 0 (PNG has no empty images) or above 2^15 (a plot, not a poster).
    pub fn new(width: u32, height: u32, background: Rgb) -> Self {
        assert!(
            (1..=1 << 15).contains(&width) && (1..=1 << 15).contains(&height),
            "image sides must be in 1..=32768, got {width}×{height}"
        );
        let rgb = [background.0, background.1, background.2].repeat((width * height) as usize);
        Self { width, height, rgb }
    }

    /// Width in pixels.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// The raw pixels: `height` rows of `width` × (r, g, b).
    pub fn rgb(&self) -> &[u8] {
        &self.rgb
    }

    /// The colour at (x, y), or `None` outside the image.
    pub fn pixel(&self, x: i32, y: i32) -> Option<Rgb> {
        let i = self.index(x, y)?;
        Some(Rgb(self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]))
    }

    /// Paints one pixel (ignored outside the image).
    pub fn set(&mut self, x: i32, y: i32, colour: Rgb) {
        if let Some(i) = self.index(x, y) {
            self.rgb[i..i + 3].copy_from_slice(&[colour.0, colour.1, colour.2]);
        }
    }

    fn index(&self, x: i32, y: i32) -> Option<usize> {
        let (x, y) = (u32::try_from(x).ok()?, u32::try_from(y).ok()?);
        (x < self.width && y < self.height)
            .then(|| (y as usize * self.width as usize + x as usize) * 3)
    }

    /// Fills the `width` × `height` rectangle whose top-left pixel is (x, y).
    pub fn fill_rect(&mut self, x: i32, y: i32, width: i32, height: i32, colour: Rgb) {
        for py in y.max(0)..(y + height).min(self.height as i32) {
            for px in x.max(0)..(x + width).min(self.width as i32) {
                self.set(px, py, colour);
            }
        }
    }

    /// Draws a straight line from `from` to `to` (both ends included) with a square brush of
    /// `thickness` pixels whose top-left corner follows the line.
    pub fn line(&mut self, from: (i32, i32), to: (i32, i32), colour: Rgb, thickness: u32) {
        let t = thickness.max(1) as i32;
        // Bresenham over all octants: error term tracks distance to the ideal line.
        let (mut x, mut y) = from;
        let (dx, dy) = ((to.0 - x).abs(), -(to.1 - y).abs());
        let (sx, sy) = ((to.0 - x).signum(), (to.1 - y).signum());
        let mut err = dx + dy;
        loop {
            self.fill_rect(x, y, t, t, colour);
            if (x, y) == to {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// A vertical dashed line at column `x` from row `y0` to `y1`: `dash` pixels on, `gap` off.
    pub fn dashed_vline(
        &mut self,
        x: i32,
        (y0, y1): (i32, i32),
        (dash, gap): (u32, u32),
        colour: Rgb,
    ) {
        let period = (dash + gap).max(1) as i32;
        for y in y0.min(y1)..=y0.max(y1) {
            if (y - y0.min(y1)) % period < dash as i32 {
                self.set(x, y, colour);
            }
        }
    }

    /// A filled disc centred on (cx, cy).
    pub fn fill_disc(&mut self, (cx, cy): (i32, i32), radius: u32, colour: Rgb) {
        let r = radius as i32;
        // r² + r rounds the rim outwards, so small discs look round rather than diamond-shaped.
        for dy in -r..=r {
            for dx in -r..=r {
                if dx * dx + dy * dy <= r * r + r {
                    self.set(cx + dx, cy + dy, colour);
                }
            }
        }
    }

    /// Writes `text` with its top-left corner at (x, y), each font pixel drawn as a
    /// `scale` × `scale` square; returns the width drawn in pixels. Tails of g, j, p, q, y reach
    /// one font pixel below the [`text_height`] box.
    pub fn text(&mut self, (x, y): (i32, i32), text: &str, colour: Rgb, scale: u32) -> i32 {
        let s = scale.max(1) as i32;
        for (i, c) in text.chars().enumerate() {
            let left = x + i as i32 * font::ADVANCE as i32 * s;
            let top = if font::descends(c) {
                y + font::DESCENT as i32 * s
            } else {
                y
            };
            for (row, bits) in font::glyph(c).iter().enumerate() {
                for col in 0..font::GLYPH_WIDTH as i32 {
                    if bits & (1 << (font::GLYPH_WIDTH as i32 - 1 - col)) != 0 {
                        self.fill_rect(left + col * s, top + row as i32 * s, s, s, colour);
                    }
                }
            }
        }
        text_width(text, scale)
    }

    /// Encodes the image as PNG.
    pub fn to_png(&self) -> Vec<u8> {
        crate::png::encode(self)
    }

    /// Writes the image to `path` as PNG (through a temporary file beside it, so a reader never
    /// sees half a picture).
    pub fn write_png(&self, path: impl AsRef<Path>) -> Result<(), ReportError> {
        let path = path.as_ref();
        let tmp = path.with_extension("png.tmp");
        // Errors name the file the caller asked for; the temporary name would only puzzle.
        std::fs::write(&tmp, self.to_png()).map_err(|e| ReportError::io(path, e))?;
        std::fs::rename(&tmp, path).map_err(|e| ReportError::io(path, e))
    }
}

/// Width in pixels of `text` drawn by [`Image::text`] at `scale`.
pub fn text_width(text: &str, scale: u32) -> i32 {
    (font::text_width(text) * scale.max(1)) as i32
}

/// Height in pixels of a line of text at `scale`.
pub fn text_height(scale: u32) -> i32 {
    (font::GLYPH_HEIGHT * scale.max(1)) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawing_outside_the_image_is_clipped() {
        let mut image = Image::new(4, 3, Rgb::WHITE);
        image.fill_rect(-10, -10, 100, 100, Rgb::BLACK);
        image.line((-5, 1), (50, 1), Rgb(255, 0, 0), 1);
        assert_eq!(image.pixel(3, 1), Some(Rgb(255, 0, 0)));
        assert_eq!(image.pixel(0, 0), Some(Rgb::BLACK));
        assert_eq!(image.pixel(4, 0), None);
        assert_eq!(image.pixel(-1, 0), None);
    }

    #[test]
    fn lines_reach_both_ends_in_every_direction() {
        let ends = [
            ((1, 1), (8, 3)),
            ((8, 8), (2, 1)),
            ((5, 0), (5, 9)),
            ((0, 9), (9, 0)),
        ];
        for (from, to) in ends {
            let mut image = Image::new(10, 10, Rgb::WHITE);
            image.line(from, to, Rgb::BLACK, 1);
            assert_eq!(image.pixel(from.0, from.1), Some(Rgb::BLACK), "{from:?}");
            assert_eq!(image.pixel(to.0, to.1), Some(Rgb::BLACK), "{to:?}");
            // A 1-pixel line touches exactly max(|dx|, |dy|) + 1 pixels.
            let black = image.rgb().chunks(3).filter(|p| p == &[0, 0, 0]).count() as i32;
            assert_eq!(black, (to.0 - from.0).abs().max((to.1 - from.1).abs()) + 1);
        }
    }

    #[test]
    fn text_draws_the_glyph_pixels() {
        let mut image = Image::new(20, 20, Rgb::WHITE);
        let width = image.text((1, 2), "-", Rgb::BLACK, 2);
        assert_eq!(width, 10);
        // '-' is the fourth row, full width: rows 2 + 3×2 .. +2, columns 1..11.
        assert_eq!(image.pixel(1, 8), Some(Rgb::BLACK));
        assert_eq!(image.pixel(10, 9), Some(Rgb::BLACK));
        assert_eq!(image.pixel(11, 8), Some(Rgb::WHITE));
        assert_eq!(image.pixel(1, 7), Some(Rgb::WHITE));
    }
}
