//! Random numbers: the counter-based uniform stream (Philox-4x32-10, the same numbers on every
//! backend), dropout, and [`RandomStream`], a stream whose position lives on the device so a
//! step captured as a graph draws fresh numbers on every replay.

use crate::backend::{NnOp, Op};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Result, TensorError};
use crate::layout::Layout;
use crate::tensor::Tensor;

impl Tensor {
    /// Uniform [0, 1) numbers of `shape` from the counter-based generator: element `i`
    /// (row-major) is a pure function of (`seed`, `offset + i`), the same on every backend.
    pub fn random_uniform(
        shape: &[usize],
        dtype: DType,
        seed: u64,
        offset: u64,
        device: &Device,
    ) -> Result<Tensor> {
        device.check(Op::Nn(NnOp::RandomUniform), dtype)?;
        let numel = shape.iter().product();
        let storage = device
            .backend()
            .random_uniform(dtype, numel, seed, offset)?;
        Ok(Tensor::from_storage(
            storage,
            Layout::contiguous(shape),
            device.clone(),
        ))
    }

    /// Inverted dropout: zeroes each element with probability `p` and scales the rest by
    /// `1 / (1 - p)`. The mask is keyed by (`seed`, `offset` + position), so replays and every
    /// backend drop the same elements. Identity when not training.
    pub fn dropout(&self, p: f64, seed: u64, offset: u64, training: bool) -> Result<Tensor> {
        self.dropout_by(p, training, || {
            Tensor::random_uniform(self.shape(), self.dtype(), seed, offset, self.device())
        })
    }

    /// [`dropout`](Self::dropout) with its mask drawn from `stream`, which advances past it
    /// on the device: the form a step captured as a graph uses (a host `offset` would be baked
    /// into the graph, and every replay would drop the same elements).
    pub fn dropout_with(&self, p: f64, stream: &RandomStream, training: bool) -> Result<Tensor> {
        self.dropout_by(p, training, || stream.uniform(self.shape(), self.dtype()))
    }

    /// Inverted dropout with the uniform numbers `draw` makes: `self / (1 - p)` where they are
    /// at least `p`, else 0.
    fn dropout_by(
        &self,
        p: f64,
        training: bool,
        draw: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(TensorError::shape(format!(
                "dropout probability {p} is not in [0, 1)"
            )));
        }
        if !training || p == 0.0 {
            return Ok(self.clone());
        }
        let u = draw()?;
        let keep = u.ge(&u.scalar_like(p)?)?;
        let zero = self.scalar_like(0.0)?;
        Tensor::where_(&keep, &self.mul_scalar(1.0 / (1.0 - p))?, &zero)
    }
}

/// A counter-based random stream whose position is a device scalar (i64 `[1]`): each draw
/// reads it on the device and advances it there by the numbers drawn, so a training step
/// captured as a graph draws fresh numbers on every replay, as PyTorch's graph-safe Philox
/// state does. A draw of `n` numbers is [`Tensor::random_uniform`]'s at the stream's offset,
/// on every backend.
#[derive(Clone)]
pub struct RandomStream {
    seed: u64,
    offset: Tensor,
}

impl RandomStream {
    /// The stream of `seed` from position 0, on `device`.
    pub fn new(seed: u64, device: &Device) -> Result<Self> {
        Ok(Self {
            seed,
            offset: Tensor::from_slice(&[0i64], &[1], device)?,
        })
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The device scalar holding the next draw's position (i64 `[1]`, its own storage): save
    /// it with a checkpoint, [`Tensor::assign`] it back to resume the stream where it was.
    pub fn offset(&self) -> &Tensor {
        &self.offset
    }

    /// `shape` uniform [0, 1) numbers in `dtype` from the stream's position, which then
    /// advances by their count (on a device that captures graphs, both on the device).
    pub fn uniform(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let device = self.offset.device();
        device.check(Op::Nn(NnOp::RandomUniform), dtype)?;
        let numel: usize = shape.iter().product();
        let storage =
            device
                .backend()
                .random_uniform_at(dtype, numel, self.seed, self.offset.view())?;
        Ok(Tensor::from_storage(
            storage,
            Layout::contiguous(shape),
            device.clone(),
        ))
    }
}

/// The reference generator: Philox-4x32-10.
pub(crate) mod reference {
    const M0: u32 = 0xD251_1F53;
    const M1: u32 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;

    /// Philox-4x32 with 10 rounds on a 128-bit counter and 64-bit key.
    pub fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
        let (mut c, mut k) = (counter, key);
        for round in 0..10 {
            if round > 0 {
                k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
            }
            let p0 = M0 as u64 * c[0] as u64;
            let p1 = M1 as u64 * c[2] as u64;
            c = [
                (p1 >> 32) as u32 ^ c[1] ^ k[0],
                p1 as u32,
                (p0 >> 32) as u32 ^ c[3] ^ k[1],
                p0 as u32,
            ];
        }
        c
    }

    /// Element `n` of the uniform stream of `seed`.
    pub fn uniform(seed: u64, n: u64) -> f64 {
        let block = n / 4;
        let words = philox(
            [block as u32, (block >> 32) as u32, 0, 0],
            [seed as u32, (seed >> 32) as u32],
        );
        (words[(n % 4) as usize] >> 8) as f64 / (1u32 << 24) as f64
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn philox_matches_the_random123_known_answer() {
            // Random123's kat_vectors: philox4x32_10, counter and key all zero.
            assert_eq!(
                super::philox([0; 4], [0; 2]),
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
            );
            // ... and all ones.
            assert_eq!(
                super::philox([u32::MAX; 4], [u32::MAX; 2]),
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
            );
        }
    }
}
