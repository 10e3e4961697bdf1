//! The decoder on real files, with every codec this build has: JPEGs and PNGs encoded here, CMYK
//! and grayscale JPEGs made by PIL (committed, with PIL's own RGB decoding), truncated and
//! garbage bytes, cropped and DCT-scaled regions against the full-size decode.

use std::path::Path;

use image::{ImageFormat, RgbImage};
use redline_loader::{Codec, Crop, Decoder, Region};

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name),
    )
    .unwrap()
}

fn gradient(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x * 3) as u8, (y * 5) as u8, ((x + y) * 2) as u8])
    })
}

fn encode(img: &RgbImage, format: ImageFormat) -> Vec<u8> {
    let mut bytes = std::io::Cursor::new(Vec::new());
    img.write_to(&mut bytes, format).unwrap();
    bytes.into_inner()
}

fn mean_abs(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as i32 - y as i32).abs() as f64)
        .sum::<f64>()
        / a.len() as f64
}

#[test]
fn jpeg_and_png_decode_to_their_pixels() {
    for &codec in Codec::available() {
        jpeg_and_png(codec);
    }
}

fn jpeg_and_png(codec: Codec) {
    let img = gradient(67, 45);
    let mut decoder = Decoder::with_codec(codec);
    let png = decoder.decode(&encode(&img, ImageFormat::Png)).unwrap();
    assert_eq!((png.width, png.height), (67, 45));
    assert_eq!(png.pixels, img.as_raw().as_slice(), "PNG is lossless");
    let jpeg = decoder.decode(&encode(&img, ImageFormat::Jpeg)).unwrap();
    assert_eq!((jpeg.width, jpeg.height), (67, 45));
    let err = mean_abs(jpeg.pixels, img.as_raw());
    assert!(
        err < 4.0,
        "{codec:?}: JPEG round trip off by {err} levels on average"
    );
    assert_eq!(decoder.decodes(), 2);
}

#[test]
fn cmyk_and_grayscale_jpegs_decode_like_pil() {
    for (&codec, name) in Codec::available()
        .iter()
        .flat_map(|c| [(c, "cmyk"), (c, "gray")])
    {
        let mut decoder = Decoder::with_codec(codec);
        let image = decoder.decode(&fixture(&format!("{name}.jpg"))).unwrap();
        assert_eq!((image.width, image.height), (48, 32), "{name}");
        let err = mean_abs(image.pixels, &fixture(&format!("{name}.pil.rgb")));
        assert!(
            err < 3.0,
            "{codec:?} {name}: {err} levels from PIL's decoding on average"
        );
    }
}

#[test]
fn truncated_and_garbage_bytes_are_errors_that_say_why() {
    for &codec in Codec::available() {
        truncated_and_garbage(codec);
    }
}

fn truncated_and_garbage(codec: Codec) {
    let jpeg = encode(&gradient(40, 30), ImageFormat::Jpeg);
    let mut decoder = Decoder::with_codec(codec);
    let err = decoder.decode(&jpeg[..jpeg.len() / 2]).unwrap_err();
    assert!(err.to_string().contains("truncated JPEG"), "{err}");
    let err = decoder.decode(b"definitely not an image").unwrap_err();
    assert!(err.to_string().contains("not a decodable image"), "{err}");
    // Garbage inside the entropy-coded data (markers intact) never panics: an error, or an
    // image of the size its header gives (decoders cannot tell damaged coefficients apart).
    let mut broken = jpeg.clone();
    let middle = broken.len() / 2;
    for b in &mut broken[middle - 200..middle] {
        *b = 0xFF;
    }
    match decoder.decode(&broken) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(img) => assert_eq!((img.width, img.height), (40, 30)),
    }
    // After errors the decoder still works.
    assert!(decoder.decode(&jpeg).is_ok());
}

/// A photo-like texture: smooth gradients plus fine detail, so crops and scales show errors.
fn texture(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let (fx, fy) = (x as f64, y as f64);
        let wave = ((fx * 0.21).sin() * (fy * 0.17).cos() * 60.0) as i32;
        image::Rgb([
            (90 + wave + (x % 50) as i32) as u8,
            (120 - wave / 2 + (y % 40) as i32) as u8,
            (40 + ((x + y) % 150) as i32) as u8,
        ])
    })
}

fn crop_of(pixels: &[u8], width: usize, c: Crop) -> Vec<u8> {
    (c.top..c.top + c.height)
        .flat_map(|y| &pixels[(y * width + c.left) * 3..(y * width + c.left + c.width) * 3])
        .copied()
        .collect()
}

#[test]
fn cropped_regions_equal_the_full_decode_at_full_scale() {
    let jpeg = encode(&texture(301, 217), ImageFormat::Jpeg);
    let gray = fixture("gray.jpg");
    for &codec in Codec::available() {
        for bytes in [&jpeg, &gray] {
            let mut full = Decoder::with_codec(codec);
            let whole = full.decode(bytes).unwrap();
            let (w, h) = (whole.width, whole.height);
            let reference = whole.pixels.to_vec();
            let mut decoder = Decoder::with_codec(codec);
            // Crops at every alignment against 8- and 16-pixel iMCUs, and the edges.
            for (i, c) in [
                (0, 0, w, h),
                (1, 1, w - 1, h - 1),
                (7, 3, 17, 9),
                (15, 16, 33, 15),
                (w - 9, h - 5, 9, 5),
                (23, 0, 1, 1),
            ]
            .into_iter()
            .map(|(left, top, width, height)| Crop {
                left,
                top,
                width,
                height,
            })
            .enumerate()
            {
                let region = Region {
                    crop: c,
                    min_width: c.width,
                    min_height: c.height,
                };
                let d = decoder.decode_region(bytes, |_, _| region).unwrap();
                assert_eq!((d.scale, d.full), (1, (w, h)), "{codec:?} crop {i}");
                assert_eq!((d.crop.width, d.crop.height), (c.width, c.height));
                let got = crop_of(d.image.pixels, d.image.width, d.crop);
                let want = crop_of(&reference, w, c);
                let err = mean_abs(&got, &want);
                // libjpeg-turbo reconstructs a cropped region bit for bit as in the full image
                // (fancy upsampling keeps its context across the iMCU-aligned edges).
                assert!(
                    err == 0.0,
                    "{codec:?} crop {i} {c:?}: {err} levels off the full decode"
                );
            }
        }
    }
}

#[test]
fn dct_scaling_halves_quarters_and_eighths_when_the_crop_is_large_enough() {
    let img = texture(640, 480);
    let jpeg = encode(&img, ImageFormat::Jpeg);
    let crop = Crop {
        left: 37,
        top: 21,
        width: 500,
        height: 420,
    };
    for &codec in Codec::available() {
        let mut decoder = Decoder::with_codec(codec);
        for (min, scale) in [(210, 2), (105, 4), (52, 8), (211, 1)] {
            let d = decoder
                .decode_region(&jpeg, |w, h| {
                    assert_eq!((w, h), (640, 480));
                    Region {
                        crop,
                        min_width: min,
                        min_height: min,
                    }
                })
                .unwrap();
            let expected = if codec == Codec::Zune { 1 } else { scale };
            assert_eq!(d.scale, expected, "{codec:?} min {min}");
            let s = d.scale;
            assert!(d.crop.width >= crop.width / s && d.crop.width <= crop.width / s + 2);
            assert!(d.crop.height >= crop.height / s && d.crop.height <= crop.height / s + 2);
            assert!(d.crop.left + d.crop.width <= d.image.width);
            assert!(d.crop.top + d.crop.height <= d.image.height);
            // The scaled crop against an s×s box average of the source's crop.
            let (cw, ch) = (crop.width / s, crop.height / s);
            let (ox, oy) = (crop.left / s, crop.top / s);
            let mut err = 0.0;
            for y in 0..ch {
                for x in 0..cw {
                    for ch_i in 0..3 {
                        let mut sum = 0u32;
                        for v in 0..s {
                            for u in 0..s {
                                sum += img.get_pixel(
                                    (((ox + x) * s) + u) as u32,
                                    (((oy + y) * s) + v) as u32,
                                )[ch_i] as u32;
                            }
                        }
                        let want = sum as f64 / (s * s) as f64;
                        let got = d.image.pixels
                            [((d.crop.top + y) * d.image.width + d.crop.left + x) * 3 + ch_i]
                            as f64;
                        err += (got - want).abs();
                    }
                }
            }
            let err = err / (cw * ch * 3) as f64;
            assert!(
                err < 3.0,
                "{codec:?} 1/{s}: {err} levels from a box-filtered source"
            );
        }
    }
}
