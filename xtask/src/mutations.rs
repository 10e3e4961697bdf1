//! Proof that the CUDA kernels' host-emulated suite can fail: each mutation plants one bug a
//! GPU would hide or show only by chance — a tail off by one, a missing `__syncthreads()`, a
//! shuffle from the wrong lane — in a copy of `crates/cuda/kernels`, and the emulated suite
//! (`crates/cuda/tests/emulated.rs`, pointed at the copy by `REDLINE_CUDA_KERNELS`) must fail
//! on it. A mutation whose text no longer occurs exactly once fails too, so the list keeps up
//! with the kernels.

use std::fs;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::run;

struct Mutation {
    name: &'static str,
    file: &'static str,
    original: &'static str,
    mutated: &'static str,
}

const MUTATIONS: &[Mutation] = &[
    Mutation {
        name: "tail off by one",
        file: "elementwise.cu",
        original: "i < n; i += grid_step()) {\n        out[position(os, i)] = unary_element",
        mutated: "i <= n; i += grid_step()) {\n        out[position(os, i)] = unary_element",
    },
    Mutation {
        name: "packed binary op reading the neighbouring pack of its second operand",
        file: "elementwise.cu",
        original: "const Pack16<T> ap = a[p], bp = b[p];",
        mutated: "const Pack16<T> ap = a[p], bp = b[p ^ 1];",
    },
    Mutation {
        name: "missing __syncthreads",
        file: "block.cuh",
        original: "    if (lane == 0) partial[warp] = v;\n    __syncthreads();\n",
        mutated: "    if (lane == 0) partial[warp] = v;\n",
    },
    Mutation {
        name: "wrong shuffle lane",
        file: "block.cuh",
        original: "v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));",
        // Not `offset + 1`: partners 17, 9, 5, 3, 2 still span all 32 lanes, so that butterfly
        // sums correctly (an equivalent mutant, which this check once caught). Halving the
        // partner leaves lane bit 4 out and pairs each lane with itself last.
        mutated: "v = op(v, __shfl_xor_sync(FULL_MASK, v, offset / 2));",
    },
    Mutation {
        name: "batch-norm shift of the wrong sign",
        file: "norm.cu",
        original: "coef[C + c] = (bias != nullptr ? bias[c] : (S)0) - mean * scale;",
        mutated: "coef[C + c] = (bias != nullptr ? bias[c] : (S)0) + mean * scale;",
    },
    Mutation {
        name: "packed batch-norm affine stepping the channel one element late",
        file: "norm.cu",
        original: "if (++r == cstride) {",
        mutated: "if (++r > cstride) {",
    },
    Mutation {
        name: "channels-last batch-norm sums missing the last row",
        file: "norm.cu",
        original: "r < rows; r += (i64)gridDim.y * blockDim.y) {\n            const Run xv",
        mutated: "r < rows - 1; r += (i64)gridDim.y * blockDim.y) {\n            const Run xv",
    },
    Mutation {
        name: "channels-last batch-norm sums halving their rows one step short",
        file: "norm.cu",
        original: "for (unsigned half = blockDim.y / 2; half > 0; half /= 2) {",
        mutated: "for (unsigned half = blockDim.y / 2; half > 1; half /= 2) {",
    },
    Mutation {
        name: "channels-last batch-norm affine reading its neighbour's coefficients",
        file: "norm.cu",
        original: "const i64 c = q * K + k;",
        mutated: "const i64 c = q * K + (k + 1) % K;",
    },
    Mutation {
        name: "thread-per-output reduction skipping its last element",
        file: "reduce.cu",
        original: "for (i64 j = 0; j < r; j++) acc +=",
        mutated: "for (i64 j = 0; j < r - 1; j++) acc +=",
    },
    Mutation {
        name: "channels-last pooling walk stepping rows by the wrong width",
        file: "pool.cu",
        original: "        y = (i / (C * W)) % H;",
        mutated: "        y = (i / (C * H)) % H;",
    },
    Mutation {
        name: "cross-entropy gradient without its label smoothing",
        file: "softmax.cu",
        original: "exp(v - lse) - hot - eps / (A)c)",
        mutated: "exp(v - lse) - hot)",
    },
    Mutation {
        name: "packed channels-last max pool reading the next pack of channels",
        file: "pool.cu",
        original: "x[((b * H + iy) * W + ix) * cols + j];",
        mutated: "x[((b * H + iy) * W + ix) * cols + (j + 1) % cols];",
    },
    Mutation {
        name: "packed max pool losing the position of a window of -inf alone",
        file: "pool.cu",
        original: "if (beats(e, best[k]) || where[k] < 0) {",
        mutated: "if (beats(e, best[k])) {",
    },
    Mutation {
        name: "packed max-pool gradient adding its neighbour channel's gradient",
        file: "pool.cu",
        original: "here ? Num<T>::load(v.v[k]) : (A)0;",
        mutated: "here ? Num<T>::load(v.v[(k + 1) % K]) : (A)0;",
    },
    Mutation {
        name: "input table leaving its last channel unwritten",
        file: "input.cu",
        original: "k < C * 256; k += blockDim.x",
        mutated: "k < (C - 1) * 256; k += blockDim.x",
    },
    Mutation {
        name: "packed input op storing its first outputs' bytes in every store",
        file: "input.cu",
        original: "table[c * 256 + bytes.v[j * K + k]]",
        mutated: "table[c * 256 + bytes.v[k]]",
    },
    Mutation {
        // Not a wrong divisor: its remainders run past the axis and the reads past the
        // buffer, which crashes the suite rather than failing a test.
        name: "32-bit index walk dropping the outermost coordinate",
        file: "common.cuh",
        original: "return at + (i64)j * s.stride[0];\n    }",
        mutated: "return at;\n    }",
    },
    Mutation {
        name: "stem padding leaving its zero channels unwritten",
        file: "conv.cu",
        original: "for (i64 c = 0; c < to_c; c++)",
        mutated: "for (i64 c = 0; c < (from_c < to_c ? from_c : to_c); c++)",
    },
    Mutation {
        name: "batch-norm partial sums combined without their last chunk",
        file: "norm.cu",
        original: "for (i64 k = threadIdx.x; k < chunks; k += blockDim.x)",
        mutated:
            "for (i64 k = threadIdx.x; k < (chunks > 1 ? chunks - 1 : chunks); k += blockDim.x)",
    },
    Mutation {
        name: "channels-last batch-norm backward sums not centred on the mean",
        file: "norm.cu",
        original: "dot[k] += (xk - mid[k]) * other;",
        mutated: "dot[k] += xk * other;",
    },
    Mutation {
        name: "batch-norm forward coefficients forgetting the centre of their sums",
        file: "norm.cu",
        original: "const S offset = sum_x / n, mean = k + offset;",
        mutated: "const S offset = sum_x / n, mean = offset;",
    },
    Mutation {
        name: "multi-tensor block map giving a tensor's first block to the tensor before it",
        file: "optim.cu",
        original: "if (list.first_block[mid] <= b) lo = mid;",
        mutated: "if (list.first_block[mid] < b) lo = mid;",
    },
    Mutation {
        name: "multi-tensor walk striding by one block, not by the tensor's blocks",
        file: "optim.cu",
        original: "const i64 blocks = end - list.first_block[lo];",
        mutated: "const i64 blocks = 1;",
    },
    // Two that only the emulator's shared-memory poison shows: on a GPU another block's shared
    // memory is out of reach, and an unwritten slot holds whatever its SM left there.
    Mutation {
        name: "AdamW bias corrections computed by the first block alone",
        file: "optim.cu",
        original: "    if (threadIdx.x == 0) {\n        const double steps",
        mutated: "    if (threadIdx.x == 0 && blockIdx.x == 0) {\n        const double steps",
    },
    Mutation {
        name: "block reduction reading every warp's slot, written or not",
        file: "block.cuh",
        original: "for (unsigned w = 1; w < warps; w++) total = op(total, partial[w]);",
        mutated: "for (unsigned w = 1; w < 32; w++) total = op(total, partial[w]);",
    },
];

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// Runs every mutation; Ok with a one-line summary when each one failed the emulated suite.
pub fn run() -> Result<String> {
    let kernels = run::root().join("crates/cuda/kernels");
    let work = run::target_dir().join("xtask/kernel-mutations");
    let mut caught = Vec::new();
    for m in MUTATIONS {
        let dir = work.join(m.name.replace(' ', "-"));
        let _ = fs::remove_dir_all(&dir);
        copy_dir(&kernels, &dir).with_context(|| format!("copying {}", kernels.display()))?;
        let path = dir.join(m.file);
        let text = fs::read_to_string(&path)?;
        let found = text.matches(m.original).count();
        if found != 1 {
            bail!(
                "mutation '{}': its text occurs {found} times in {} (expected once); update xtask/src/mutations.rs",
                m.name,
                m.file
            );
        }
        fs::write(&path, text.replace(m.original, m.mutated))?;
        let mut cmd = run::cargo();
        cmd.args(["test", "--package", "redline-cuda", "--test", "emulated"])
            .env("REDLINE_CUDA_KERNELS", &dir);
        eprintln!("mutation '{}' in {}:", m.name, m.file);
        eprintln!(
            "$ REDLINE_CUDA_KERNELS={} {}",
            dir.display(),
            run::describe(&cmd)
        );
        let output = cmd.output().context("could not start cargo")?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        // The failing tests' names, from libtest's summary.
        let failed: Vec<&str> = stdout
            .lines()
            .filter_map(|l| l.strip_prefix("test ")?.strip_suffix(" ... FAILED"))
            .collect();
        if output.status.success() {
            eprint!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
            bail!(
                "mutation '{}' in {} passed the emulated suite: the suite cannot see this bug",
                m.name,
                m.file
            );
        }
        if failed.is_empty() {
            // Failed, but not in a test: a build error is no proof.
            eprint!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
            bail!("mutation '{}': the emulated suite did not run", m.name);
        }
        eprintln!(
            "  caught by {} test(s): {}",
            failed.len(),
            failed.join(", ")
        );
        caught.push(format!("{} ({} tests)", m.name, failed.len()));
    }
    Ok(format!("each caught: {}", caught.join("; ")))
}
