//! The resampler against PIL: committed fixtures of `crop(...).resize(..., BILINEAR)` made by
//! `benches/pytorch/resize_fixtures.py` (PIL 13) from a formula image both sides compute.

use std::path::Path;

use redline_loader::{flip_horizontal, Crop, Resizer};

const W: usize = 173;
const H: usize = 131;

/// The fixture script's image.
fn pixel(x: usize, y: usize, c: usize) -> u8 {
    ((x * 7 + y * 13 + c * 50 + (x * y) % 31 + ((x / 3 + y / 2) % 2) * 40) % 256) as u8
}

fn image() -> Vec<u8> {
    (0..H)
        .flat_map(|y| (0..W).flat_map(move |x| (0..3).map(move |c| pixel(x, y, c))))
        .collect()
}

#[test]
fn crop_and_resize_match_pil_within_two_levels() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let src = image();
    let mut resizer = Resizer::new();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let n = |v: &serde_json::Value, i: usize| v[i].as_u64().unwrap() as usize;
        let (c, o) = (&case["crop"], &case["out"]);
        let crop = Crop {
            left: n(c, 0),
            top: n(c, 1),
            width: n(c, 2),
            height: n(c, 3),
        };
        let (ow, oh) = (n(o, 0), n(o, 1));
        let want = std::fs::read(dir.join(case["file"].as_str().unwrap())).unwrap();
        let mut got = vec![0u8; ow * oh * 3];
        resizer.resize(&src, W * 3, crop, ow, oh, &mut got);
        let diffs: Vec<i32> = got
            .iter()
            .zip(&want)
            .map(|(&a, &b)| (a as i32 - b as i32).abs())
            .collect();
        let mae = diffs.iter().sum::<i32>() as f64 / diffs.len() as f64;
        let max = diffs.iter().max().copied().unwrap_or(0);
        println!("{crop:?} -> {ow}x{oh}: mean abs error {mae:.4}, max {max}");
        assert!(mae <= 2.0, "{crop:?} -> {ow}x{oh}: mean abs error {mae}");
        // Implementing PIL's fixed-point arithmetic exactly, we expect (nearly) identical bytes.
        assert!(max <= 1, "{crop:?} -> {ow}x{oh}: max abs error {max}");
    }
}

#[test]
fn flip_mirrors_rows() {
    let mut img = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
    flip_horizontal(&mut img, 2, 2);
    assert_eq!(img, [4, 5, 6, 1, 2, 3, 10, 11, 12, 7, 8, 9]);
}
