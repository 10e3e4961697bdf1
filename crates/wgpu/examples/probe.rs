//! Lists the wgpu adapters this machine offers (`cargo xtask test` runs it to decide whether the
//! wgpu suite can run). Exit code 0 when there is at least one, 2 when there is none.

fn main() {
    let adapters = redline_wgpu::adapters();
    for a in &adapters {
        println!(
            "{} ({}{}{})",
            a.name,
            a.backend,
            if a.software { ", software" } else { "" },
            if a.f16 { ", f16" } else { "" }
        );
    }
    if adapters.is_empty() {
        eprintln!("no wgpu adapter (install a Vulkan driver, e.g. mesa-vulkan-drivers)");
        std::process::exit(2);
    }
}
