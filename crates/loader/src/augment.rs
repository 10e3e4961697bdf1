//! The transforms' geometry: torchvision's `RandomResizedCrop` + `RandomHorizontalFlip` for
//! training, `Resize(res / 0.875)` + `CenterCrop(res)` for evaluation.
//!
//! Training draws come from a generator keyed by (seed, epoch, sample index) alone, so a sample's
//! crop is the same whichever worker decodes it and however many workers there are.

use crate::order::SplitMix;
use crate::resize::Crop;

/// torchvision's defaults: `scale = (0.08, 1.0)`, `ratio = (3/4, 4/3)`.
pub const SCALE: (f64, f64) = (0.08, 1.0);
pub const RATIO: (f64, f64) = (3.0 / 4.0, 4.0 / 3.0);

/// A training sample's random geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainParams {
    pub crop: Crop,
    pub flip: bool,
}

/// The draws for sample `sample` of `epoch` of an image `width × height`.
pub fn train_params(
    seed: u64,
    epoch: u64,
    sample: u64,
    width: usize,
    height: usize,
) -> TrainParams {
    let mut rng = SplitMix::new(seed ^ 0x7261_6E64_5F63_726F, epoch).fork(sample);
    let crop = random_resized_crop(width, height, SCALE, RATIO, &mut rng);
    TrainParams {
        crop,
        flip: rng.unit() < 0.5,
    }
}

/// torchvision's `RandomResizedCrop.get_params`: ten tries at an area fraction uniform in
/// `scale` and a log-uniform aspect ratio in `ratio`, then a central crop clamped to `ratio`.
fn random_resized_crop(
    width: usize,
    height: usize,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut SplitMix,
) -> Crop {
    let area = (width * height) as f64;
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * (scale.0 + (scale.1 - scale.0) * rng.unit());
        let aspect = (log_lo + (log_hi - log_lo) * rng.unit()).exp();
        // Python's round(): half to even.
        let w = (target * aspect).sqrt().round_ties_even() as usize;
        let h = (target / aspect).sqrt().round_ties_even() as usize;
        if w > 0 && w <= width && h > 0 && h <= height {
            let top = rng.below((height - h + 1) as u64) as usize;
            let left = rng.below((width - w + 1) as u64) as usize;
            return Crop {
                left,
                top,
                width: w,
                height: h,
            };
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (w, h) = if in_ratio < ratio.0 {
        (
            width,
            ((width as f64 / ratio.0).round_ties_even() as usize).max(1),
        )
    } else if in_ratio > ratio.1 {
        (
            ((height as f64 * ratio.1).round_ties_even() as usize).max(1),
            height,
        )
    } else {
        (width, height)
    };
    Crop {
        left: (width - w) / 2,
        top: (height - h) / 2,
        width: w,
        height: h,
    }
}

/// Evaluation geometry: the whole image resized so its shorter side is `res / 0.875` (256 for
/// 224), then the centred `res × res` crop of that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalGeometry {
    pub resized_width: usize,
    pub resized_height: usize,
    /// In the resized image.
    pub crop: Crop,
}

/// torchvision's `Resize(int(res / 0.875))` + `CenterCrop(res)` sizes.
pub fn eval_geometry(width: usize, height: usize, res: usize) -> EvalGeometry {
    let short = (res as f64 / 0.875) as usize;
    let (rw, rh) = if width <= height {
        (
            short,
            (short as f64 * height as f64 / width as f64) as usize,
        )
    } else {
        (
            (short as f64 * width as f64 / height as f64) as usize,
            short,
        )
    };
    let side =
        |total: usize| (((total as f64 - res as f64) / 2.0).round_ties_even()).max(0.0) as usize;
    EvalGeometry {
        resized_width: rw,
        resized_height: rh,
        crop: Crop {
            left: side(rw),
            top: side(rh),
            width: res.min(rw),
            height: res.min(rh),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crops_fit_follow_the_distribution_and_repeat_per_sample() {
        let (w, h) = (500, 375);
        let mut fractions = Vec::new();
        for sample in 0..4000 {
            let p = train_params(1, 0, sample, w, h);
            let c = p.crop;
            assert!(c.width > 0 && c.height > 0 && c.left + c.width <= w && c.top + c.height <= h);
            assert_eq!(p, train_params(1, 0, sample, w, h));
            fractions.push((c.width * c.height) as f64 / (w * h) as f64);
        }
        // Large areas with tall ratios do not fit a 4:3 image and are redrawn, so the mean area
        // fraction is below the 0.54 of uniform [0.08, 1]: torchvision's algorithm, simulated
        // with Python's random (200k draws), gives 0.433 for 500 × 375.
        let mean = fractions.iter().sum::<f64>() / fractions.len() as f64;
        assert!((0.415..0.45).contains(&mean), "mean area fraction {mean}");
        let flips = (0..4000)
            .filter(|&s| train_params(1, 0, s, w, h).flip)
            .count();
        assert!((1800..2200).contains(&flips), "{flips} flips of 4000");
        assert_ne!(train_params(1, 0, 5, w, h), train_params(1, 1, 5, w, h));
    }

    #[test]
    fn a_strip_falls_back_to_the_clamped_central_crop() {
        // 1000 × 10 never fits a 3/4..4/3 crop of 8..100% area: torchvision's fallback.
        let p = train_params(3, 0, 0, 1000, 10);
        assert_eq!(
            p.crop,
            Crop {
                left: 493,
                top: 0,
                width: 13,
                height: 10
            }
        );
    }

    #[test]
    fn eval_resizes_the_short_side_and_centres_the_crop() {
        let g = eval_geometry(500, 375, 224);
        assert_eq!((g.resized_width, g.resized_height), (341, 256));
        // round(58.5) = 58 and round(16.0) = 16, as Python rounds.
        assert_eq!(
            g.crop,
            Crop {
                left: 58,
                top: 16,
                width: 224,
                height: 224
            }
        );
        let g = eval_geometry(300, 600, 160);
        assert_eq!((g.resized_width, g.resized_height), (182, 364));
    }
}
