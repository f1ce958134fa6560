//! `gardenet`: the CNI plugin binary. Reads the environment and stdin, answers on stdout
//! (a result, or the spec's error object with a non-zero exit), never panics outward.
use std::io::{Read, Write};

use gardenet_cni::{
    config::reply_version,
    env::Env,
    spec::{CniError, Code},
};

fn main() {
    let mut stdin = Vec::new();
    let read = std::io::stdin().read_to_end(&mut stdin).map_err(|e| e.to_string());
    let version = reply_version(&stdin);
    // A panic (a bug) still reaches the runtime as an error object, not as a bare crash.
    std::panic::set_hook(Box::new(|info| eprintln!("gardenet: internal error: {info}")));
    let outcome = std::panic::catch_unwind(move || {
        read.map_err(|e| CniError::new(Code::Io, format!("reading the network configuration from stdin: {e}")))?;
        let env = Env::from_process()?;
        gardenet_cni::run(&env, &stdin)
    })
    .unwrap_or_else(|_| Err(CniError::new(Code::Internal, "internal error (a bug in the gardenet plugin; its stderr has the details)")));
    let mut out = std::io::stdout().lock();
    let code = match outcome {
        Ok(Some(v)) => {
            let _ = writeln!(out, "{v}");
            0
        }
        Ok(None) => 0,
        Err(e) => {
            let _ = writeln!(out, "{}", e.to_json(version));
            1
        }
    };
    let _ = out.flush();
    std::process::exit(code);
}
