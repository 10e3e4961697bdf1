//! Training recipes' schedules that are not the learning rate's.

/// FFCV's progressive resizing: `min_res` until `start` (an epoch), then a linear ramp to
/// `max_res` at `end`, in steps of 32 pixels (FFCV's `get_resolution`).
pub fn progressive_res(
    epoch: usize,
    start: usize,
    end: usize,
    min_res: usize,
    max_res: usize,
) -> usize {
    if epoch >= end {
        return max_res;
    }
    if epoch <= start {
        return min_res;
    }
    let t = (epoch - start) as f64 / (end - start) as f64;
    let res = min_res as f64 + t * (max_res as f64 - min_res as f64);
    ((res / 32.0).round() as usize * 32).clamp(min_res.min(max_res), max_res.max(min_res))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolution_ramps_like_ffcv() {
        // FFCV's ResNet-50 16-epoch config: 160 → 192 between epochs 11 and 13.
        let res: Vec<usize> = (0..16)
            .map(|e| progressive_res(e, 11, 13, 160, 192))
            .collect();
        assert_eq!(&res[..12], &[160; 12]);
        assert_eq!(res[12], 192, "halfway (176) rounds to a multiple of 32");
        assert_eq!(&res[13..], &[192; 3]);
        let long: Vec<usize> = (0..10)
            .map(|e| progressive_res(e, 2, 8, 128, 256))
            .collect();
        assert_eq!(long, [128, 128, 128, 160, 160, 192, 224, 224, 256, 256]);
        // No ramp: the final resolution from `end` on.
        assert_eq!(progressive_res(0, 0, 0, 64, 96), 96);
    }
}
