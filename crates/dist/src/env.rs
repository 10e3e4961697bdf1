//! The launch environment torchrun defines, which `srun` wrappers, Kubernetes jobs and
//! `cargo xtask train --nproc` set the same way: one process per device, told its place by
//! RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.

use std::collections::HashMap;

use crate::error::{DistError, Result};

/// Where this process stands in a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank, 0..world.
    pub rank: usize,
    pub world: usize,
    /// This process's index on its own host: the device it drives (`cuda:{local_rank}`).
    pub local_rank: usize,
    /// Where rank 0 (or torchrun's agent) serves the rendezvous store.
    pub master_addr: String,
    pub master_port: u16,
    /// torchrun's elastic agent already serves a TCPStore on MASTER_PORT
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): connect to it as a client instead of binding.
    pub agent_store: bool,
    /// Which attempt of an elastic job this is (`TORCHELASTIC_RESTART_COUNT`, 0 without one):
    /// keys in the store are scoped by it, so a restarted job never reads its failed
    /// predecessor's entries.
    pub restart: u64,
}

impl Launch {
    /// A job of one process: no variables needed, no networking done.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            agent_store: false,
            restart: 0,
        }
    }

    /// Reads the process environment: `None` when neither WORLD_SIZE nor an srun step's
    /// SLURM_STEP_NUM_TASKS is set (not launched as part of a job), an error naming the
    /// variable when one is missing or malformed.
    pub fn from_env() -> Result<Option<Self>> {
        let vars: HashMap<String, String> = std::env::vars().collect();
        Self::from_vars(&vars)
    }

    /// [`from_env`](Self::from_env) over a given set of variables.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Option<Self>> {
        // Under `srun` without a wrapper, Slurm's own variables say the same thing: the tasks
        // of the job step srun started. Not SLURM_NTASKS: the batch script itself has it (and
        // SLURM_PROCID 0), and a process started there is no rank of a step.
        let slurm = !vars.contains_key("WORLD_SIZE")
            && vars.contains_key("SLURM_STEP_NUM_TASKS")
            && vars.contains_key("SLURM_PROCID");
        let (world_var, rank_var, local_var) = match slurm {
            true => ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID"),
            false => ("WORLD_SIZE", "RANK", "LOCAL_RANK"),
        };
        if !vars.contains_key(world_var) {
            return Ok(None);
        }
        let world: usize = number(vars, world_var)?;
        if world == 0 {
            return Err(env_error(world_var, "must be at least 1 (got 0)"));
        }
        let rank: usize = number(vars, rank_var)?;
        if rank >= world {
            return Err(env_error(
                rank_var,
                format!("{rank} is not below {world_var} {world} (ranks count from 0)"),
            ));
        }
        let local_rank = match vars.contains_key(local_var) {
            true => number(vars, local_var)?,
            false => rank,
        };
        let master_addr = match (vars.get("MASTER_ADDR"), world) {
            (Some(a), _) if !a.trim().is_empty() => a.trim().to_string(),
            (_, 1) => "127.0.0.1".to_string(),
            _ => return Err(env_error("MASTER_ADDR", "unset: where does rank 0 listen?")),
        };
        let master_port = match (vars.contains_key("MASTER_PORT"), world) {
            (true, _) => number(vars, "MASTER_PORT")?,
            (false, 1) => 0,
            _ => {
                return Err(env_error(
                    "MASTER_PORT",
                    "unset: which port does rank 0 serve?",
                ))
            }
        };
        let agent_store = vars
            .get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        let restart = match vars.contains_key("TORCHELASTIC_RESTART_COUNT") {
            true => number(vars, "TORCHELASTIC_RESTART_COUNT")?,
            false => 0,
        };
        Ok(Some(Self {
            rank,
            world,
            local_rank,
            master_addr,
            master_port,
            agent_store,
            restart,
        }))
    }

    /// The variables that place process `rank` of a local job of `world` (what
    /// `cargo xtask train --nproc` sets for each process it starts).
    pub fn local_vars(rank: usize, world: usize, port: u16) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", world.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.to_string()),
        ]
    }
}

fn number<T: std::str::FromStr>(vars: &HashMap<String, String>, var: &'static str) -> Result<T> {
    let raw = vars.get(var).ok_or_else(|| {
        env_error(
            var,
            "unset (torchrun, srun wrappers and `cargo xtask train --nproc` set it)",
        )
    })?;
    raw.trim()
        .parse()
        .map_err(|_| env_error(var, format!("{raw:?} is not a non-negative integer")))
}

fn env_error(var: &'static str, message: impl Into<String>) -> DistError {
    DistError::Env {
        var,
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn torchrun_variables_place_the_process() {
        let launch = Launch::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            launch,
            Launch {
                rank: 3,
                world: 8,
                local_rank: 1,
                master_addr: "node0".into(),
                master_port: 29500,
                agent_store: true,
                restart: 2,
            }
        );
    }

    #[test]
    fn no_world_size_is_no_job_and_a_world_of_one_needs_no_master() {
        assert_eq!(Launch::from_vars(&vars(&[("RANK", "0")])).unwrap(), None);
        let one = Launch::from_vars(&vars(&[("RANK", "0"), ("WORLD_SIZE", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!((one.world, one.local_rank, one.agent_store), (1, 0, false));
    }

    #[test]
    fn slurm_variables_stand_in_for_torchruns() {
        let launch = Launch::from_vars(&vars(&[
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "16"),
            ("SLURM_PROCID", "9"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "gpu-node-3"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((launch.rank, launch.world, launch.local_rank), (9, 16, 1));
        let step = [("SLURM_STEP_NUM_TASKS", "4"), ("SLURM_PROCID", "4")];
        let err = Launch::from_vars(&vars(&step)).unwrap_err().to_string();
        assert!(
            err.contains("SLURM_PROCID: 4 is not below SLURM_STEP_NUM_TASKS 4"),
            "{err}"
        );
        // A batch script of `sbatch --ntasks 4` has SLURM_NTASKS and SLURM_PROCID 0 but is
        // no task of a step: a process started there runs alone, not waiting for 3 peers.
        let batch = [
            ("SLURM_NTASKS", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
        ];
        assert_eq!(Launch::from_vars(&vars(&batch)).unwrap(), None);
    }

    #[test]
    fn a_bad_variable_is_named() {
        let cases: [(&[(&str, &str)], &str); 5] = [
            (&[("WORLD_SIZE", "2")], "RANK: unset"),
            (
                &[("WORLD_SIZE", "two"), ("RANK", "0")],
                "WORLD_SIZE: \"two\"",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "2")],
                "RANK: 2 is not below",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_PORT", "1")],
                "MASTER_ADDR: unset",
            ),
            (
                &[
                    ("WORLD_SIZE", "2"),
                    ("RANK", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT: \"99999\"",
            ),
        ];
        for (pairs, expected) in cases {
            let err = Launch::from_vars(&vars(pairs)).unwrap_err().to_string();
            assert!(err.contains(expected), "{pairs:?}: {err}");
        }
    }
}
