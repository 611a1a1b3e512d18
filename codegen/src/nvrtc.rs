//! NVRTC compilation of generated CUDA C to PTX, through cudarc with the
//! library loaded at run time, and an on-disk PTX cache.
//!
//! cudarc's loader panics when it finds no library, so [`Nvrtc::load`] first
//! opens the library itself (from `DPLC_NVRTC_LIB`, else by the usual sonames)
//! and keeps it loaded: cudarc's later `dlopen` by soname then finds the same
//! library already in the process instead of searching (and panicking).

use crate::cuda::CudaSource;
use crate::kernel::fnv1a;
use crate::CodegenError;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A GPU architecture to compile for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// A100 (Ampere).
    Sm80,
    /// H100 / H200 (Hopper).
    Sm90,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Sm80, Arch::Sm90];

    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }

    fn option(self) -> &'static str {
        match self {
            Arch::Sm80 => "compute_80",
            Arch::Sm90 => "compute_90",
        }
    }
}

/// Compiled PTX text of one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ptx {
    /// The kernel's symbol.
    pub name: String,
    pub arch: Arch,
    pub text: String,
}

/// A loaded NVRTC with a PTX cache directory.
#[derive(Debug)]
pub struct Nvrtc {
    cache: Option<PathBuf>,
    version: (i32, i32),
}

static LOADED: OnceLock<Result<(), String>> = OnceLock::new();

const SONAMES: [&str; 3] = ["libnvrtc.so.12", "libnvrtc.so", "nvrtc64_120_0.dll"];

fn open_library() -> Result<(), String> {
    let explicit = std::env::var_os("DPLC_NVRTC_LIB").filter(|p| !p.is_empty());
    let lib = match &explicit {
        Some(path) => {
            if !Path::new(path).is_file() {
                return Err(format!(
                    "DPLC_NVRTC_LIB={} is not a file",
                    Path::new(path).display()
                ));
            }
            // SAFETY: loading NVRTC runs only its (side-effect free) initialisers.
            unsafe { libloading::Library::new(path) }
                .map_err(|e| format!("cannot open {}: {e}", Path::new(path).display()))?
        }
        None => SONAMES
            .iter()
            // SAFETY: as above.
            .find_map(|name| unsafe { libloading::Library::new(*name) }.ok())
            .ok_or_else(|| {
                format!("none of {SONAMES:?} is on the library path and DPLC_NVRTC_LIB is unset")
            })?,
    };
    // Kept loaded for the life of the process so that cudarc finds it by soname.
    std::mem::forget(lib);
    // SAFETY: only probes with dlopen; the library is already resident.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(
            "the library was opened but cudarc cannot find it by soname (libnvrtc.so.12)".into(),
        );
    }
    Ok(())
}

impl Nvrtc {
    /// Load NVRTC, or say clearly why it is unavailable. Never panics.
    ///
    /// The PTX cache is `$DPLC_PTX_CACHE`, else `$XDG_CACHE_HOME/dplc/ptx`,
    /// else `$HOME/.cache/dplc/ptx`.
    pub fn load() -> Result<Nvrtc, CodegenError> {
        LOADED
            .get_or_init(open_library)
            .clone()
            .map_err(|reason| CodegenError::NvrtcUnavailable { reason })?;
        let version = std::panic::catch_unwind(|| {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: both pointers are live locals; the library is loaded above.
            let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            (status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
        })
        .ok()
        .flatten()
        .ok_or_else(|| CodegenError::NvrtcUnavailable {
            reason: "nvrtcVersion is missing or failed".into(),
        })?;
        let cache = std::env::var_os("DPLC_PTX_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("dplc/ptx"))
            })
            .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/dplc/ptx")));
        Ok(Nvrtc { cache, version })
    }

    /// Use `dir` as the PTX cache (`None`: no cache).
    pub fn with_cache(mut self, dir: Option<PathBuf>) -> Nvrtc {
        self.cache = dir;
        self
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Where the PTX of `src` for `arch` is cached: keyed by the source's hash,
    /// the architecture and the NVRTC version.
    pub fn cache_path(&self, src: &CudaSource, arch: Arch) -> Option<PathBuf> {
        let h = fnv1a(src.source.as_bytes());
        let (major, minor) = self.version;
        self.cache.as_ref().map(|d| {
            d.join(format!(
                "{}-{h:016x}-{}-nvrtc{major}.{minor}.ptx",
                src.name,
                arch.name()
            ))
        })
    }

    /// Compile to PTX, or read it from the cache.
    pub fn compile(&self, src: &CudaSource, arch: Arch) -> Result<Ptx, CodegenError> {
        let path = self.cache_path(src, arch);
        if let Some(p) = &path {
            if let Ok(text) = std::fs::read_to_string(p) {
                return Ok(Ptx {
                    name: src.name.clone(),
                    arch,
                    text,
                });
            }
        }
        let text = self.compile_uncached(src, arch)?;
        if let Some(p) = &path {
            write_atomic(p, &text)?;
        }
        Ok(Ptx {
            name: src.name.clone(),
            arch,
            text,
        })
    }

    /// Compile to PTX, ignoring the cache.
    pub fn compile_uncached(&self, src: &CudaSource, arch: Arch) -> Result<String, CodegenError> {
        self.compile_with(src, arch, &[])
    }

    /// Whether `src` compiles for `arch`, without NVVM's optimizer (`-G`):
    /// the C++ checked and PTX emitted for it, several times faster than
    /// [`Nvrtc::compile`] on the tensor-core kernels, and nothing kept. What
    /// the tests run over every kernel; the optimizer's own failures show
    /// only in [`Nvrtc::compile`].
    pub fn check(&self, src: &CudaSource, arch: Arch) -> Result<(), CodegenError> {
        self.compile_with(src, arch, &["-G"]).map(drop)
    }

    fn compile_with(
        &self,
        src: &CudaSource,
        arch: Arch,
        extra: &[&str],
    ) -> Result<String, CodegenError> {
        let mut options = vec!["--std=c++17".to_string()];
        options.extend(extra.iter().map(|o| o.to_string()));
        let opts = CompileOptions {
            arch: Some(arch.option()),
            name: Some(format!("{}.cu", src.name)),
            options,
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(&src.source, opts).map_err(|e| match e {
            CompileError::CompileError { log, .. } => CodegenError::Compile {
                kernel: src.name.clone(),
                arch: arch.name().into(),
                log: log.to_string_lossy().into_owned(),
                code: src.source.clone(),
            },
            other => CodegenError::Nvrtc {
                kernel: src.name.clone(),
                detail: format!("{other:?}"),
            },
        })?;
        Ok(ptx.to_src())
    }
}

fn write_atomic(path: &Path, text: &str) -> Result<(), CodegenError> {
    let err = |e: std::io::Error| CodegenError::Cache {
        path: path.to_path_buf(),
        detail: e.to_string(),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    // A temporary name of this write alone: ranks that share a process
    // (threads) compile the same kernels at once, and a name per process
    // let one rename away the file another had just written.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(e)
    })
}

#[cfg(test)]
mod tests {
    use super::write_atomic;

    /// Ranks on threads of one process write the same cache entry at once:
    /// every write succeeds and the entry is one writer's whole text (a
    /// temporary name per process made the GPU's tp=2 run over one GPU fail
    /// with "No such file or directory").
    #[test]
    fn concurrent_writers_of_one_cache_entry_all_succeed() {
        let dir = std::env::temp_dir().join(format!("dplc-ptx-race-{}", std::process::id()));
        let path = dir.join("k.ptx");
        std::thread::scope(|s| {
            for t in 0..8 {
                let path = &path;
                s.spawn(move || {
                    for _ in 0..50 {
                        write_atomic(path, &format!("writer {t}\n").repeat(100)).unwrap();
                    }
                });
            }
        });
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.lines().count() == 100 && text.lines().all(|l| l == text.lines().next().unwrap())
        );
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
