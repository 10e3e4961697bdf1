//! redline's benchmarks. Criterion benchmarks of hot paths live in `benches/`; the op benchmark
//! (`ops`, run by the `bench-ops` binary) times whole ops through the tensor API; reference
//! scripts for side-by-side runs live in `benches/pytorch/`. `cargo xtask bench …` runs them and
//! prints their tables.

pub mod ops;

/// Writes every record of `set` as `folder/<class>/<index>.jpg` (or `.png`): the same bytes,
/// as an ImageFolder tree for the PyTorch and FFCV sides of a comparison.
pub fn export_folder(
    set: &redline_shard::ShardSet,
    folder: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let classes = set.classes();
    for i in 0..set.len() {
        let r = set.record(i)?;
        let class = classes
            .get(r.label.max(0) as usize)
            .cloned()
            .unwrap_or_else(|| format!("{}", r.label));
        let dir = folder.join(class);
        std::fs::create_dir_all(&dir)?;
        let ext = if r.bytes.starts_with(&[0xFF, 0xD8]) {
            "jpg"
        } else {
            "png"
        };
        std::fs::write(dir.join(format!("{i:08}.{ext}")), r.bytes)?;
    }
    Ok(())
}
