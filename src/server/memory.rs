//! `lanes serve --memory`: how much memory lane admission shares among jobs.
//! The default, `auto`, is a safe share of the device the service runs on,
//! read at start-up; `none` turns admission off; a size is taken as given.

use std::fmt;
use std::str::FromStr;

use super::{ByteSize, ServerError};
use crate::lanes::format_size;
use crate::session::Backend;

/// What `--memory` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryChoice {
    /// A safe share of the device, read at start-up (see [`auto_memory`]).
    Auto,
    /// No lane admission: every job is loaded, and jobs together can run
    /// the device out of memory.
    Off,
    /// Exactly this many bytes.
    Size(ByteSize),
}

/// Why a `--memory` value could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot read `{input}` as --memory: give auto, none or a size (e.g. 512MiB, 8GiB = 8G, 8GB = 8e9 bytes)")]
pub struct MemoryChoiceError {
    pub input: String,
}

impl FromStr for MemoryChoice {
    type Err = MemoryChoiceError;
    fn from_str(s: &str) -> Result<Self, MemoryChoiceError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(MemoryChoice::Auto),
            "none" => Ok(MemoryChoice::Off),
            _ => s
                .parse()
                .map(MemoryChoice::Size)
                .map_err(|_| MemoryChoiceError { input: s.into() }),
        }
    }
}

impl fmt::Display for MemoryChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryChoice::Auto => f.write_str("auto"),
            MemoryChoice::Off => f.write_str("none"),
            MemoryChoice::Size(b) => write!(f, "{}", b.0),
        }
    }
}

/// `--memory auto` on the GPU gives the lanes this percentage of the
/// device's free memory (read after the service's CUDA context is made and
/// its kernels are loaded, so those are already not free): the rest is
/// left to other processes' growth and to fragmentation.
pub const CUDA_FREE_SHARE_PERCENT: u64 = 90;

/// Then subtracts this much (never going below 0) for device memory that
/// lives outside the lanes' books: what the driver, cuBLAS and cuDNN take
/// per program (handles, streams, instantiated CUDA graphs) and while
/// loading. A device whose share is not larger gets an error at start-up.
pub const CUDA_HEADROOM_BYTES: u64 = 1 << 30;

/// `--memory auto` on the CPU backend gives the lanes this percentage of
/// the host's available memory (`MemAvailable` in `/proc/meminfo`): jobs'
/// tensors live in host memory there, next to everything else the host
/// runs.
pub const HOST_AVAILABLE_SHARE_PERCENT: u64 = 50;

/// Auto sizes are whole MiB.
const ROUND: u64 = 1 << 20;

fn percent(bytes: u64, pct: u64) -> u64 {
    // u128: no overflow for any u64 byte count.
    (u128::from(bytes) * u128::from(pct) / 100) as u64
}

/// The rule of `--memory auto` on the GPU: [`CUDA_FREE_SHARE_PERCENT`] of
/// `free` (at most `total`) less [`CUDA_HEADROOM_BYTES`], rounded down to
/// whole MiB; 0 when nothing is left.
pub fn cuda_share(free: u64, total: u64) -> u64 {
    let share = percent(free.min(total), CUDA_FREE_SHARE_PERCENT);
    let left = share.saturating_sub(CUDA_HEADROOM_BYTES);
    left - left % ROUND
}

/// The rule of `--memory auto` on the CPU backend:
/// [`HOST_AVAILABLE_SHARE_PERCENT`] of `available`, rounded down to whole
/// MiB.
pub fn host_share(available: u64) -> u64 {
    let share = percent(available, HOST_AVAILABLE_SHARE_PERCENT);
    share - share % ROUND
}

/// `MemAvailable` from the text of `/proc/meminfo`, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let mut words = line.split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        _ => None,
    }
}

/// What `--memory auto` chose, and how (for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoMemory {
    pub bytes: u64,
    /// E.g. `90% of 79.10 GiB free − 1.00 GiB headroom`.
    pub derivation: String,
}

/// The GPU's rule applied to its memory now.
pub fn auto_cuda(free: u64, total: u64) -> AutoMemory {
    AutoMemory {
        bytes: cuda_share(free, total),
        derivation: format!(
            "{CUDA_FREE_SHARE_PERCENT}% of {} free (of {}) − {} headroom",
            format_size(free),
            format_size(total),
            format_size(CUDA_HEADROOM_BYTES)
        ),
    }
}

/// The CPU backend's rule applied to the host's available memory.
pub fn auto_host(available: u64) -> AutoMemory {
    AutoMemory {
        bytes: host_share(available),
        derivation: format!(
            "{HOST_AVAILABLE_SHARE_PERCENT}% of {} available host memory",
            format_size(available)
        ),
    }
}

fn auto_error(reason: impl Into<String>) -> ServerError {
    ServerError::AutoMemory {
        reason: reason.into(),
    }
}

/// `--memory auto` for the service's backend: on the GPU its free memory
/// now (through the service's own CUDA context), on the CPU the host's
/// available memory. An error when the memory cannot be read or the share
/// comes to 0.
pub fn auto_memory(backend: Backend) -> Result<AutoMemory, ServerError> {
    let auto = match backend {
        Backend::Cuda => {
            let (free, total) = crate::exec::cuda::memory_info()
                .map_err(|e| auto_error(format!("cannot read the GPU's free memory: {e}")))?;
            auto_cuda(free, total)
        }
        Backend::Cpu => {
            let text = std::fs::read_to_string("/proc/meminfo")
                .map_err(|e| auto_error(format!("cannot read /proc/meminfo: {e}")))?;
            let available = mem_available(&text)
                .ok_or_else(|| auto_error("no MemAvailable line in /proc/meminfo"))?;
            auto_host(available)
        }
    };
    if auto.bytes == 0 {
        return Err(auto_error(format!("{} leaves no memory", auto.derivation)));
    }
    Ok(auto)
}

/// Resolves `--memory` to [`ServerConfig::memory_bytes`](super::ServerConfig)
/// for the service's resolved `device` (see [`super::resolve_device`]), and
/// logs the choice.
pub fn resolve_memory(choice: MemoryChoice, device: &str) -> Result<Option<u64>, ServerError> {
    match choice {
        MemoryChoice::Off => {
            tracing::warn!(
                "memory: none = no lane admission; jobs together can run the device out of memory"
            );
            Ok(None)
        }
        MemoryChoice::Size(b) => {
            tracing::info!(bytes = b.0, "memory: {} (given)", format_size(b.0));
            Ok(Some(b.0))
        }
        MemoryChoice::Auto => {
            let auto = auto_memory(super::backend_of(device))?;
            tracing::info!(
                bytes = auto.bytes,
                "memory: auto = {} = {}",
                auto.derivation,
                format_size(auto.bytes)
            );
            Ok(Some(auto.bytes))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn choices_parse() {
        let p = |s: &str| s.parse::<MemoryChoice>();
        assert_eq!(p("auto"), Ok(MemoryChoice::Auto));
        assert_eq!(p("AUTO"), Ok(MemoryChoice::Auto));
        assert_eq!(p("none"), Ok(MemoryChoice::Off));
        assert_eq!(p(" None "), Ok(MemoryChoice::Off));
        assert_eq!(p("8GiB"), Ok(MemoryChoice::Size(ByteSize(8 * GIB))));
        assert_eq!(p("512MiB"), Ok(MemoryChoice::Size(ByteSize(512 * MIB))));
        assert_eq!(p("4096"), Ok(MemoryChoice::Size(ByteSize(4096))));
        for bad in ["", "autox", "off", "lots", "-1GiB", "12XB"] {
            let e = p(bad).unwrap_err();
            assert_eq!(e.input, bad);
            assert!(e.to_string().contains("auto, none or a size"), "{e}");
        }
        for c in [
            MemoryChoice::Auto,
            MemoryChoice::Off,
            MemoryChoice::Size(ByteSize(12345)),
        ] {
            assert_eq!(c.to_string().parse::<MemoryChoice>(), Ok(c));
        }
    }

    #[test]
    fn cuda_share_is_ninety_percent_of_free_less_headroom() {
        // An 80 GiB device with 79 GiB free: 71.1 GiB − 1 GiB, whole MiB.
        let got = cuda_share(79 * GIB, 80 * GIB);
        let want = (79 * GIB * 9 / 10 - GIB) / MIB * MIB;
        assert_eq!(got, want);
        assert!(got < 79 * GIB - GIB && got > 69 * GIB);
        assert_eq!(got % MIB, 0);
        // Only free memory counts, however large the device.
        assert_eq!(cuda_share(10 * GIB, 80 * GIB), 8 * GIB);
        // A free figure above total is held to total.
        assert_eq!(
            cuda_share(20 * GIB, 10 * GIB),
            cuda_share(10 * GIB, 10 * GIB)
        );
    }

    #[test]
    fn cuda_share_on_tiny_and_empty_devices() {
        // 2 GiB free: 1.8 GiB − 1 GiB.
        assert_eq!(
            cuda_share(2 * GIB, 2 * GIB),
            (2 * GIB * 9 / 10 - GIB) / MIB * MIB
        );
        // Exactly the headroom's worth after the share: nothing left.
        assert_eq!(cuda_share(GIB * 10 / 9, 4 * GIB), 0);
        assert_eq!(cuda_share(GIB, 4 * GIB), 0);
        assert_eq!(cuda_share(512 * MIB, 512 * MIB), 0);
        assert_eq!(cuda_share(0, 80 * GIB), 0);
        assert_eq!(cuda_share(0, 0), 0);
        // Never overflows.
        assert!(cuda_share(u64::MAX, u64::MAX) > 0);
    }

    #[test]
    fn host_share_is_half_of_available() {
        assert_eq!(host_share(64 * GIB), 32 * GIB);
        assert_eq!(host_share(3 * MIB), MIB); // 1.5 MiB, rounded down
        assert_eq!(host_share(MIB), 0);
        assert_eq!(host_share(0), 0);
        assert!(host_share(u64::MAX) > 0);
    }

    #[test]
    fn meminfo_available() {
        let text = "MemTotal:       16318480 kB\n\
                    MemFree:         1010040 kB\n\
                    MemAvailable:   11946132 kB\n\
                    Buffers:          518340 kB\n";
        assert_eq!(mem_available(text), Some(11946132 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
        assert_eq!(mem_available("MemAvailable: 12 MB\n"), None);
    }

    #[test]
    fn derivations_say_how() {
        let a = auto_cuda(79 * GIB, 80 * GIB);
        assert_eq!(a.bytes, cuda_share(79 * GIB, 80 * GIB));
        assert_eq!(
            a.derivation,
            "90% of 79.00 GiB free (of 80.00 GiB) − 1.00 GiB headroom"
        );
        let h = auto_host(10 * GIB);
        assert_eq!(h.bytes, 5 * GIB);
        assert_eq!(h.derivation, "50% of 10.00 GiB available host memory");
    }

    /// On this machine the CPU rule gives a positive figure (Linux), or a
    /// clear error naming the way out.
    #[test]
    fn auto_on_the_cpu() {
        match resolve_memory(MemoryChoice::Auto, "cpu") {
            Ok(Some(b)) => assert!(b > 0 && b % MIB == 0),
            Ok(None) => panic!("auto never turns admission off"),
            Err(e) => {
                assert!(matches!(e, ServerError::AutoMemory { .. }));
                assert!(e.to_string().contains("--memory SIZE"), "{e}");
            }
        }
        assert_eq!(resolve_memory(MemoryChoice::Off, "cpu").unwrap(), None);
        assert_eq!(
            resolve_memory(MemoryChoice::Size(ByteSize(MIB)), "cpu").unwrap(),
            Some(MIB)
        );
    }
}
