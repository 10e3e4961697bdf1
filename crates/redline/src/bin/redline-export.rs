//! `redline-export --checkpoint CKPT --out MODEL.safetensors`: the model weights of a training
//! checkpoint alone (no optimizer or scaler state), under torchvision's names, as
//! `safetensors.torch.load_file` + `load_state_dict` expect them.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Writes the model weights of a training checkpoint alone, as PyTorch loads them.
#[derive(Parser)]
#[command(name = "redline-export")]
struct Cli {
    /// A checkpoint written by redline-train.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The weights file to write (safetensors).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match redline_train::checkpoint::export_weights(&cli.checkpoint, &cli.out) {
        Ok(n) => {
            println!("wrote {n} weight tensors to {}", cli.out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("redline-export: {e}");
            ExitCode::FAILURE
        }
    }
}
