//! Where this process sits in a multi-process run, read from the launcher's
//! environment: torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//! MASTER_PORT), Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
//! SLURM_JOB_NODELIST) or Open MPI's mpirun (OMPI_COMM_WORLD_*).

use super::error::{GpuError, GpuResult};

/// The port rank 0 listens on when the launcher names none (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher the variables came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Plain, or torchrun / torch.distributed style variables.
    Torchrun,
    Slurm,
    OpenMpi,
    /// No launcher variables: one process, rank 0 of 1.
    Single,
}

/// This process's place in the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the processes of this node: the GPU ordinal it uses.
    pub local_rank: usize,
    /// Host and port of rank 0's rendezvous.
    pub master_addr: String,
    pub master_port: u16,
    pub launcher: Launcher,
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> GpuResult<T> {
    value
        .trim()
        .parse()
        .map_err(|_| GpuError::LaunchEnv(format!("{name}={value:?} is not a number")))
}

/// The first host of a Slurm node list: `gpu[01-04,07],login1` gives `gpu01`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inside = &list[end + 1..list[end..].find(']').map(|i| end + i)?];
        let first = inside.split([',', '-']).next()?;
        Some(format!("{prefix}{first}"))
    } else {
        Some(prefix.to_string())
    }
}

impl LaunchEnv {
    /// Read this process's environment.
    pub fn from_env() -> GpuResult<LaunchEnv> {
        LaunchEnv::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// Read from `var` (a stand-in for the environment, for tests). Explicit
    /// torchrun variables win over Slurm's, which win over Open MPI's.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> GpuResult<LaunchEnv> {
        let num = |name: &str| -> GpuResult<Option<usize>> {
            var(name).map(|v| parse(name, &v)).transpose()
        };
        let (launcher, rank, world, local) = if var("RANK").is_some() || var("WORLD_SIZE").is_some()
        {
            let rank = num("RANK")?
                .ok_or_else(|| GpuError::LaunchEnv("WORLD_SIZE is set but RANK is not".into()))?;
            let world = num("WORLD_SIZE")?
                .ok_or_else(|| GpuError::LaunchEnv("RANK is set but WORLD_SIZE is not".into()))?;
            // Without LOCAL_RANK every rank is taken to be on its own node.
            let local = num("LOCAL_RANK")?.unwrap_or(0);
            (Launcher::Torchrun, rank, world, local)
        } else if let Some(rank) = num("SLURM_PROCID")? {
            let world = num("SLURM_NTASKS")?
                .or(num("SLURM_NPROCS")?)
                .ok_or_else(|| {
                    GpuError::LaunchEnv("SLURM_PROCID is set but SLURM_NTASKS is not".into())
                })?;
            let local = num("SLURM_LOCALID")?.unwrap_or(0);
            (Launcher::Slurm, rank, world, local)
        } else if let Some(rank) = num("OMPI_COMM_WORLD_RANK")? {
            let world = num("OMPI_COMM_WORLD_SIZE")?.ok_or_else(|| {
                GpuError::LaunchEnv(
                    "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not".into(),
                )
            })?;
            let local = num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0);
            (Launcher::OpenMpi, rank, world, local)
        } else {
            (Launcher::Single, 0, 1, 0)
        };
        if world == 0 || rank >= world {
            return Err(GpuError::LaunchEnv(format!(
                "rank {rank} is outside a world of {world}"
            )));
        }
        let master_addr = match var("MASTER_ADDR") {
            Some(a) => a,
            None => match launcher {
                Launcher::Slurm => var("SLURM_JOB_NODELIST")
                    .or_else(|| var("SLURM_NODELIST"))
                    .and_then(|l| first_slurm_host(&l))
                    .ok_or_else(|| {
                        GpuError::LaunchEnv(
                            "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set".into(),
                        )
                    })?,
                _ if world == 1 => "127.0.0.1".into(),
                _ => {
                    return Err(GpuError::LaunchEnv(format!(
                        "MASTER_ADDR is not set (needed for a world of {world})"
                    )))
                }
            },
        };
        let master_port = match var("MASTER_PORT") {
            Some(p) => parse("MASTER_PORT", &p)?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(LaunchEnv {
            rank,
            world_size: world,
            local_rank: local,
            master_addr,
            master_port,
            launcher,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> GpuResult<LaunchEnv> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 5,
                world_size: 16,
                local_rank: 1,
                master_addr: "node0".into(),
                master_port: 1234,
                launcher: Launcher::Torchrun
            }
        );
    }

    #[test]
    fn slurm_variables_and_nodelist() {
        let e = env(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[03-06,09],cpu1"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (9, 16, 1));
        assert_eq!(e.master_addr, "gpu03");
        assert_eq!(e.master_port, DEFAULT_MASTER_PORT);
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!(first_slurm_host("a1,b2").as_deref(), Some("a1"));
        assert_eq!(first_slurm_host("node7").as_deref(), Some("node7"));
    }

    #[test]
    fn torchrun_wins_over_slurm_and_mpi_is_read() {
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.launcher), (0, Launcher::Torchrun));
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank), (3, 4, 3));
    }

    #[test]
    fn no_launcher_is_one_process() {
        let e = env(&[]).unwrap();
        assert_eq!((e.rank, e.world_size, e.launcher), (0, 1, Launcher::Single));
    }

    #[test]
    fn bad_environments_say_what_is_wrong() {
        let msg = |pairs: &[(&str, &str)]| env(pairs).unwrap_err().to_string();
        assert!(msg(&[("RANK", "1")]).contains("WORLD_SIZE is not"));
        assert!(msg(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\" is not a number"));
        assert!(msg(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("outside a world of 2"));
        assert!(msg(&[("RANK", "0"), ("WORLD_SIZE", "2")]).contains("MASTER_ADDR is not set"));
        assert!(msg(&[("SLURM_PROCID", "0")]).contains("SLURM_NTASKS"));
    }
}
