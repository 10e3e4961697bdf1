//! Evaluation metrics: loss, top-1 and top-5 accuracy over a whole split.

/// How many rows of `logits` (`[n, classes]`, row-major) have their label among the `k`
/// largest values. Labels below zero (samples the loader skipped) count as neither right nor
/// seen; ties go against the label, so a constant model scores zero.
pub fn top_k_correct(logits: &[f32], classes: usize, labels: &[i64], k: usize) -> usize {
    labels
        .iter()
        .enumerate()
        .filter(|&(row, &label)| {
            let Ok(label) = usize::try_from(label) else {
                return false;
            };
            let scores = &logits[row * classes..(row + 1) * classes];
            let Some(&mine) = scores.get(label) else {
                return false;
            };
            let above = scores
                .iter()
                .enumerate()
                .filter(|&(c, &s)| c != label && s >= mine)
                .count();
            above < k
        })
        .count()
}

/// A pass over an evaluation split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    /// Mean cross-entropy (without label smoothing).
    pub loss: f64,
    /// Fractions 0..1.
    pub top1: f64,
    pub top5: f64,
    /// Images counted (skipped samples are not).
    pub images: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_counts_ranks_skips_and_ties() {
        // Row 0: label 2 is the best; row 1: label 0 is third; row 2: skipped; row 3: a tie.
        let logits = [
            0.1, 0.2, 0.9, 0.0, //
            0.3, 0.5, 0.4, 0.1, //
            1.0, 0.0, 0.0, 0.0, //
            0.5, 0.5, 0.5, 0.5,
        ];
        let labels = [2, 0, -1, 1];
        assert_eq!(top_k_correct(&logits, 4, &labels, 1), 1);
        assert_eq!(top_k_correct(&logits, 4, &labels, 2), 1);
        assert_eq!(top_k_correct(&logits, 4, &labels, 3), 2);
        assert_eq!(
            top_k_correct(&logits, 4, &labels, 4),
            3,
            "a 4-way tie is in the top 4"
        );
        assert_eq!(
            top_k_correct(&logits, 4, &[7, 9, -1, 4], 1),
            0,
            "labels out of range"
        );
    }
}
