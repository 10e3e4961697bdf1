//! The embedded default dataset: ImageNet-like JPEGs with a class signal that needs a CNN.
//!
//! Each image (~500×375, aspect 3:4..4:3) is a photo-like scene — multi-octave "cloud" noise
//! through a random two-colour palette, a few translucent blobs, sensor grain — so at quality 90 it
//! is about 100 KB and decodes about as slowly as a real photo. The class lives in an oriented
//! texture (a grating) laid over the scene: its angle, and for sets with more than 12 classes its
//! period band and waveform. Colour is drawn independently of the class, so a linear model on the
//! mean colour stays at chance while a small convolutional network learns the orientation (both
//! are tested). Everything is a pure function of (seed, split, index).

use image::RgbImage;

use crate::rng::Rng;

/// Distinct class signals: 12 orientations × 4 period bands × 2 waveforms. Sets with more
/// classes reuse signals (class `c` looks like class `c % 96`), so they cannot be fully learned.
pub const DISTINCT_SIGNALS: usize = 96;

/// How to make one image of the synthetic set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthImage {
    pub seed: u64,
    /// 0 for train, 1 for val: the two splits draw different images.
    pub split: u64,
    pub index: u64,
    pub class: u32,
    pub classes: u32,
}

/// The class signal of `class` in a set of `classes`: (angle in radians, period band, square wave).
fn signal(class: u32, classes: u32) -> (f32, Option<u32>, bool) {
    let orientations = classes.clamp(1, 12);
    let c = class % DISTINCT_SIGNALS as u32;
    let angle = (c % orientations) as f32 * std::f32::consts::PI / orientations as f32;
    if classes <= orientations {
        return (angle, None, false);
    }
    let band = (c / orientations) % 4;
    let square = (c / (orientations * 4)) % 2 == 1;
    (angle, Some(band), square)
}

/// A lattice of random values, sampled with smooth interpolation ("value noise").
struct Lattice {
    cell: f32,
    cols: usize,
    values: Vec<f32>,
}

impl Lattice {
    fn new(rng: &mut Rng, width: u32, height: u32, cell: f32) -> Self {
        let cols = (width as f32 / cell) as usize + 2;
        let rows = (height as f32 / cell) as usize + 2;
        let values = (0..cols * rows).map(|_| rng.unit()).collect();
        Self { cell, cols, values }
    }

    fn at(&self, x: f32, y: f32) -> f32 {
        let (fx, fy) = (x / self.cell, y / self.cell);
        let (ix, iy) = (fx as usize, fy as usize);
        let smooth = |t: f32| t * t * (3.0 - 2.0 * t);
        let (tx, ty) = (smooth(fx - ix as f32), smooth(fy - iy as f32));
        let v = |dx: usize, dy: usize| self.values[(iy + dy) * self.cols + ix + dx];
        let top = v(0, 0) + (v(1, 0) - v(0, 0)) * tx;
        let bottom = v(0, 1) + (v(1, 1) - v(0, 1)) * tx;
        top + (bottom - top) * ty
    }
}

struct Blob {
    cx: f32,
    cy: f32,
    /// Inverse squared radii and rotation, for the ellipse test.
    inv_rx2: f32,
    inv_ry2: f32,
    cos: f32,
    sin: f32,
    color: [f32; 3],
    alpha: f32,
}

impl SynthImage {
    /// Renders the image.
    pub fn render(&self) -> RgbImage {
        let mut rng = Rng::new(Rng::key(&[self.seed, self.split, self.index]));
        // ImageNet-like size: longer side 400..=560, aspect ratio 1..4/3, mostly landscape.
        let long = rng.range(400.0, 560.0);
        let short = long / rng.range(1.0, 4.0 / 3.0);
        let (width, height) = if rng.unit() < 0.75 {
            (long as u32, short as u32)
        } else {
            (short as u32, long as u32)
        };

        let palette = [0, 1].map(|_| [0, 1, 2].map(|_| rng.range(30.0, 225.0)));
        let octaves: Vec<(Lattice, f32)> = [(160.0, 0.5), (64.0, 0.25), (24.0, 0.15), (8.0, 0.1)]
            .iter()
            .map(|&(cell, weight)| (Lattice::new(&mut rng, width, height, cell), weight))
            .collect();
        let blobs: Vec<Blob> = (0..3 + rng.below(6))
            .map(|_| {
                let angle = rng.range(0.0, std::f32::consts::PI);
                let rx = rng.range(20.0, 120.0);
                let ry = rng.range(20.0, 120.0);
                Blob {
                    cx: rng.range(0.0, width as f32),
                    cy: rng.range(0.0, height as f32),
                    inv_rx2: 1.0 / (rx * rx),
                    inv_ry2: 1.0 / (ry * ry),
                    cos: angle.cos(),
                    sin: angle.sin(),
                    color: [0, 1, 2].map(|_| rng.range(0.0, 255.0)),
                    alpha: rng.range(0.4, 0.85),
                }
            })
            .collect();

        let (angle, band, square) = signal(self.class, self.classes);
        let angle = angle + rng.range(-0.03, 0.03);
        let period = match band {
            None => rng.range(24.0, 60.0),
            Some(b) => [22.0, 33.0, 50.0, 75.0][b as usize] * rng.range(0.9, 1.1),
        };
        let (kx, ky) = (
            angle.cos() * std::f32::consts::TAU / period,
            angle.sin() * std::f32::consts::TAU / period,
        );
        let phase = rng.range(0.0, std::f32::consts::TAU);
        let amplitude = rng.range(28.0, 48.0);
        let grain = rng.range(9.0, 13.0);
        let grain_key = rng.next_u64();

        let mut img = RgbImage::new(width, height);
        for (x, y, pixel) in img.enumerate_pixels_mut() {
            let (fx, fy) = (x as f32, y as f32);
            let n: f32 = octaves.iter().map(|(l, w)| l.at(fx, fy) * w).sum();
            let t = n.clamp(0.0, 1.0);
            let mut rgb = [0, 1, 2].map(|c| palette[0][c] + (palette[1][c] - palette[0][c]) * t);
            let mut texture = 1.0;
            for b in &blobs {
                let (dx, dy) = (fx - b.cx, fy - b.cy);
                let (u, v) = (dx * b.cos + dy * b.sin, dy * b.cos - dx * b.sin);
                if u * u * b.inv_rx2 + v * v * b.inv_ry2 <= 1.0 {
                    for (channel, color) in rgb.iter_mut().zip(b.color) {
                        *channel += (color * (0.7 + 0.6 * n) - *channel) * b.alpha;
                    }
                    texture *= 0.5;
                }
            }
            let wave = (kx * fx + ky * fy + phase).sin();
            let wave = if square {
                (wave * 4.0).clamp(-1.0, 1.0)
            } else {
                wave
            };
            let shade = amplitude * texture * wave;
            let noise = crate::rng::mix(grain_key ^ ((y as u64) << 32 | x as u64));
            for (c, out) in pixel.0.iter_mut().enumerate() {
                let bits = (noise >> (c * 20)) & 0xFFFFF;
                // Sum of two uniforms: a cheap bell-shaped grain.
                let g = ((bits & 0x3FF) + (bits >> 10)) as f32 / 1023.0 - 1.0;
                *out = (rgb[c] + shade + grain * g * 1.7).clamp(0.0, 255.0) as u8;
            }
        }
        img
    }
}

/// Class names of a synthetic set: what each class looks like.
pub fn class_names(classes: u32) -> Vec<String> {
    (0..classes)
        .map(|c| {
            let (angle, band, square) = signal(c, classes);
            let degrees = (angle.to_degrees()).round() as u32;
            match band {
                None => format!("c{c:03}_{degrees:03}deg"),
                Some(b) => format!(
                    "c{c:03}_{degrees:03}deg_band{b}_{}",
                    if square { "square" } else { "sine" }
                ),
            }
        })
        .collect()
}

/// Encodes an image as a baseline JPEG.
pub fn encode_jpeg(img: &RgbImage, quality: u8) -> Result<Vec<u8>, image::ImageError> {
    let mut out = Vec::with_capacity(img.len() / 2);
    let encoder = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality);
    img.write_with_encoder(encoder)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_deterministic_and_imagenet_sized() {
        let spec = SynthImage {
            seed: 3,
            split: 0,
            index: 17,
            class: 4,
            classes: 10,
        };
        let a = spec.render();
        assert_eq!(a, spec.render());
        let other = SynthImage { index: 18, ..spec }.render();
        assert_ne!(a.as_raw(), other.as_raw());
        let (w, h) = a.dimensions();
        let (long, short) = (w.max(h) as f32, w.min(h) as f32);
        assert!((400.0..=560.0).contains(&long), "{w}x{h}");
        assert!(long / short <= 4.0 / 3.0 + 0.01, "{w}x{h}");
    }

    #[test]
    fn classes_get_distinct_signals_up_to_96() {
        let names = class_names(96);
        let unique: std::collections::HashSet<_> =
            names.iter().map(|n| n.split_once('_').unwrap().1).collect();
        assert_eq!(unique.len(), 96);
        assert_eq!(class_names(10)[5], "c005_090deg");
    }
}
