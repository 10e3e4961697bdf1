//! The NVRTC hardware suite: every kernel family compiled to CUBIN for every target
//! architecture, with ptxas's registers, shared memory and spills per kernel printed as a table.
//! A compile error fails, and so does a spill in a family marked hot, and a `*_packed` kernel
//! whose PTX moves its 16-byte packs otherwise than by 128-bit loads and stores (loads only for
//! batch norm's sums, which store no packs), and a conversion between 32- and 16-bit floats
//! that goes through double arithmetic (1/64 of the float rate on consumer GPUs), and a
//! multi-tensor kernel with a stack frame of 1 KiB or more (its tensor list copied into local
//! memory rather than read from the parameter bank). Ignored in a plain
//! `cargo test`; `cargo xtask test` runs it with `--ignored`
//! (`REDLINE_NVRTC_FAMILIES=norm.cu,pool.cu` compiles only the families named). Without NVRTC it prints the skip
//! marker xtask reports as "skipped" — or fails when `REDLINE_HARDWARE_REQUIRED=1` (CI,
//! `--require nvrtc`). NVRTC comes from PyPI: `pip install nvidia-cuda-nvrtc nvidia-cuda-runtime`.

use std::collections::BTreeMap;

use redline_cuda::compile;
use redline_cuda::kernels::{self, ARCHITECTURES, HEADERS};
use redline_cuda::nvrtc::{Nvrtc, Resources};

#[test]
#[ignore = "hardware suite: cargo xtask test runs it"]
fn every_kernel_compiles_for_every_architecture_without_spills_where_hot() {
    let nvrtc = match Nvrtc::load() {
        Ok(n) => n,
        Err(e) if std::env::var("REDLINE_HARDWARE_REQUIRED").is_ok_and(|v| v == "1") => {
            panic!("the NVRTC suite is required but: {e}")
        }
        Err(e) => {
            println!("redline-hardware-skip: {e}");
            return;
        }
    };
    println!(
        "NVRTC {}.{} from {} (headers {})",
        nvrtc.version.0,
        nvrtc.version.1,
        nvrtc.path.display(),
        nvrtc.include_dir.display()
    );
    // REDLINE_NVRTC_FAMILIES=norm.cu,pool.cu compiles only those families (while tuning one).
    let only = std::env::var("REDLINE_NVRTC_FAMILIES").ok();
    let families: Vec<_> = kernels::families()
        .into_iter()
        .filter(|f| {
            only.as_deref()
                .is_none_or(|names| names.split(',').any(|n| n.trim() == f.source.name))
        })
        .collect();
    assert!(!families.is_empty(), "no kernel family named {only:?}");
    // Every (family, architecture) compile on its own thread: NVRTC programs are independent.
    let results: Vec<(String, &str, Result<redline_cuda::nvrtc::Cubin, String>)> =
        std::thread::scope(|s| {
            let handles: Vec<_> = families
                .iter()
                .flat_map(|f| ARCHITECTURES.iter().map(move |&arch| (f, arch)))
                .map(|(f, arch)| {
                    let nvrtc = &nvrtc;
                    s.spawn(move || {
                        (
                            f.source.name.to_string(),
                            arch,
                            nvrtc.compile(f, HEADERS, arch),
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a compile thread panicked"))
                .collect()
        });

    let mut failures = Vec::new();
    // kernel → arch → resources
    let mut table: BTreeMap<(String, String), BTreeMap<&str, Resources>> = BTreeMap::new();
    for (family, arch, result) in &results {
        match result {
            Err(e) => failures.push(format!("{family} for {arch}: {e}")),
            Ok(cubin) => {
                assert!(!cubin.image.is_empty(), "{family} for {arch}: empty CUBIN");
                let hot = families.iter().any(|f| f.source.name == family && f.hot);
                for (kernel, r) in &cubin.resources {
                    // Kernels over 16-byte packs must load them as 128-bit loads, and store
                    // them so too unless all they write is a sum (batch norm's statistics).
                    if kernel.contains("_packed<") {
                        let ptx = cubin.kernel_ptx(kernel).unwrap_or_default();
                        let sums = kernel.starts_with("batch_norm_stats");
                        if !moves_128_bits(ptx, "ld.global")
                            || !(sums || moves_128_bits(ptx, "st.global"))
                        {
                            failures.push(format!(
                                "{kernel} on {arch}: no 128-bit load (or store) in its PTX"
                            ));
                        }
                    }
                    if narrow_float_conversion(kernel) {
                        let ptx = cubin.kernel_ptx(kernel).unwrap_or_default();
                        if ptx.contains(".f64") {
                            failures
                                .push(format!("{kernel} on {arch}: double arithmetic in its PTX"));
                        }
                    }
                    // The multi-tensor kernels index their 22 KiB tensor list where the
                    // launch put it (the parameter bank); a copy would be local memory.
                    if family == "optim.cu" && r.stack_bytes >= 1024 {
                        failures.push(format!(
                            "{kernel} on {arch}: a {}-byte stack frame (its tensor list copied?)",
                            r.stack_bytes
                        ));
                    }
                    if hot && r.spills() {
                        failures.push(format!(
                            "{kernel} spills on {arch} ({} bytes stored, {} loaded)",
                            r.spill_stores, r.spill_loads
                        ));
                    }
                    table
                        .entry((family.clone(), kernel.clone()))
                        .or_default()
                        .insert(arch, r.clone());
                }
            }
        }
    }
    let mut out = format!("{:<52}", "kernel (registers / shared bytes / spill bytes)");
    for arch in ARCHITECTURES {
        out.push_str(&format!("{arch:>14}"));
    }
    out.push('\n');
    for ((_, kernel), per_arch) in &table {
        out.push_str(&format!("{kernel:<52}"));
        for arch in ARCHITECTURES {
            let cell = per_arch.get(arch).map_or("-".to_string(), |r| {
                format!(
                    "{}/{}/{}",
                    r.registers,
                    r.shared_bytes,
                    r.spill_stores + r.spill_loads
                )
            });
            out.push_str(&format!("{cell:>14}"));
        }
        out.push('\n');
    }
    println!("{out}");
    let expected: usize = families.iter().map(|f| f.instantiations.len()).sum();
    println!(
        "{} kernels × {} architectures compiled to CUBIN",
        table.len(),
        ARCHITECTURES.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(
        table.len(),
        expected,
        "every instantiation has a ptxas report"
    );

    // As the gpu-check pack ships them: written, then read back whole.
    let dir = std::env::temp_dir().join(format!("redline-aot-{}", std::process::id()));
    for (name, arch, result) in results {
        let family = families
            .iter()
            .find(|f| f.source.name == name)
            .expect("family");
        let compiled = compile::Compiled::from(result.expect("compiled"));
        compile::write(&dir, family, arch, &compiled, true).expect("write");
        assert_eq!(compile::read(&dir, family, arch).as_ref(), Some(&compiled));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `convert<A, B>` between float, __half and __nv_bfloat16 (exact in float: no double needed).
fn narrow_float_conversion(kernel: &str) -> bool {
    let narrow = ["float", "__half", "__nv_bfloat16"];
    let types = kernel
        .strip_prefix("convert<")
        .and_then(|k| k.strip_suffix('>'))
        .and_then(|k| k.split_once(", "));
    types.is_some_and(|(a, b)| narrow.contains(&a) && narrow.contains(&b))
}

/// Whether some `op` (`ld.global`, `st.global`, with any qualifiers such as `.nc`) in `ptx`
/// moves 128 bits at once: four 32-bit or two 64-bit values.
fn moves_128_bits(ptx: &str, op: &str) -> bool {
    ptx.lines().any(|line| {
        line.split_whitespace().next().is_some_and(|i| {
            i.starts_with(op)
                && [
                    ".v4.b32", ".v4.u32", ".v4.f32", ".v2.b64", ".v2.u64", ".v2.f64",
                ]
                .iter()
                .any(|w| i.ends_with(w))
        })
    })
}
