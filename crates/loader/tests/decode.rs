//! The decoder on real files: JPEGs and PNGs encoded here, CMYK and grayscale JPEGs made by PIL
//! (committed, with PIL's own RGB decoding), truncated and garbage bytes.

use std::path::Path;

use image::{ImageFormat, RgbImage};
use redline_loader::Decoder;

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
    let img = gradient(67, 45);
    let mut decoder = Decoder::new();
    let png = decoder.decode(&encode(&img, ImageFormat::Png)).unwrap();
    assert_eq!((png.width, png.height), (67, 45));
    assert_eq!(png.pixels, img.as_raw().as_slice(), "PNG is lossless");
    let jpeg = decoder.decode(&encode(&img, ImageFormat::Jpeg)).unwrap();
    assert_eq!((jpeg.width, jpeg.height), (67, 45));
    let err = mean_abs(jpeg.pixels, img.as_raw());
    assert!(err < 4.0, "JPEG round trip off by {err} levels on average");
    assert_eq!(decoder.decodes(), 2);
}

#[test]
fn cmyk_and_grayscale_jpegs_decode_like_pil() {
    let mut decoder = Decoder::new();
    for name in ["cmyk", "gray"] {
        let image = decoder.decode(&fixture(&format!("{name}.jpg"))).unwrap();
        assert_eq!((image.width, image.height), (48, 32), "{name}");
        let err = mean_abs(image.pixels, &fixture(&format!("{name}.pil.rgb")));
        assert!(
            err < 3.0,
            "{name}: {err} levels from PIL's decoding on average"
        );
    }
}

#[test]
fn truncated_and_garbage_bytes_are_errors_that_say_why() {
    let jpeg = encode(&gradient(40, 30), ImageFormat::Jpeg);
    let mut decoder = Decoder::new();
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
