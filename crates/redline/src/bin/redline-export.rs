//! `redline-export --checkpoint CKPT --out MODEL.safetensors`: the model weights of a training
//! checkpoint alone (no optimizer or scaler state), under torchvision's names, as
//! `safetensors.torch.load_file` + `load_state_dict` expect them.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
    };
    let (Some(from), Some(to)) = (get("--checkpoint"), get("--out")) else {
        eprintln!("usage: redline-export --checkpoint CKPT --out MODEL.safetensors");
        return ExitCode::from(2);
    };
    match redline_train::checkpoint::export_weights(&from, &to) {
        Ok(n) => {
            println!("wrote {n} weight tensors to {}", to.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("redline-export: {e}");
            ExitCode::FAILURE
        }
    }
}
