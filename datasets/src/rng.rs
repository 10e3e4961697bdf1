//! Counter-based randomness: every value is a pure function of (key, counter), so results do not
//! depend on thread count or scheduling (DESIGN.md, contract 9).

/// SplitMix64's finaliser: a fast, well-mixed 64-bit hash.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A stream of random numbers keyed by a seed; `Rng::new(key)` twice gives the same stream.
#[derive(Debug, Clone)]
pub struct Rng {
    key: u64,
    counter: u64,
}

impl Rng {
    pub fn new(key: u64) -> Self {
        Self { key, counter: 0 }
    }

    /// A key derived from several parts (seed, set, index, …).
    pub fn key(parts: &[u64]) -> u64 {
        parts.iter().fold(0x5EED, |k, &p| mix(k ^ mix(p)))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.counter += 1;
        mix(self.key ^ mix(self.counter))
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u32) -> u32 {
        (((self.next_u64() >> 32) * n as u64) >> 32) as u32
    }
}
