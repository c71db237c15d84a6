//! A real `lanes serve` as a child process of a benchmark (this binary,
//! started with `serve`), and the client helpers the benchmarks that drive
//! it share (`bench colocate`, `bench sweep`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanes::server::{DeviceChoice, PolicyChoice};
use lanes_adaptor::wire::{Reply, Request, SessionId};
use lanes_adaptor::{Client, ClientOptions, Limits, SessionSpec};

use super::paths::progress;

/// `--device`'s value as `lanes serve` takes it.
pub fn device_arg(d: DeviceChoice) -> &'static str {
    match d {
        DeviceChoice::Auto => "auto",
        DeviceChoice::Cuda => "cuda",
        DeviceChoice::Cpu => "cpu",
    }
}

/// How the child service is started (flattened into the arguments of the
/// benchmarks that drive one).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeOpts {
    /// The service's `--device`: `auto` (the default, the GPU when one is
    /// usable), `cuda` or `cpu`.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// The service's `--policy`.
    #[arg(long, value_enum, default_value_t = PolicyChoice::Priority)]
    pub policy: PolicyChoice,
    /// The service's endpoint (default: a free loopback port).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Where the service's log goes (default: this process's stderr).
    #[arg(long = "serve-log")]
    pub log: Option<PathBuf>,
    /// More arguments for `lanes serve`, e.g. `--serve-arg=--max-lanes=2`.
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// The `lanes serve` child; killed when dropped.
#[derive(Debug)]
pub struct Service {
    child: Child,
}

impl Drop for Service {
    /// Kills the child; one that had already died says how first (the
    /// bench's own error, a lost connection, follows it).
    fn drop(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            if let Some(note) = exit_note(self.child.id(), status) {
                eprintln!("lanes bench: {note}");
            }
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What to say about a child service that ended on its own with `status`
/// (`None` for a clean exit).
fn exit_note(pid: u32, status: std::process::ExitStatus) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    if status.success() {
        return None;
    }
    let how = match (status.code(), status.signal()) {
        (_, Some(sig)) => format!(
            "was killed by signal {sig}{}{}",
            match sig {
                6 => " (SIGABRT)",
                9 => " (SIGKILL: out of memory?)",
                11 => " (SIGSEGV)",
                _ => "",
            },
            if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            }
        ),
        (Some(code), None) => format!("exited with status {code}"),
        (None, None) => format!("ended: {status}"),
    };
    Some(format!(
        "the lanes serve child (pid {pid}) {how} before the bench ended; its log (--serve-log) has what it said last"
    ))
}

/// How long the child may take to answer its first Hello (the GPU service
/// opens the device and reserves its memory first).
const READY_WITHIN: Duration = Duration::from_secs(120);

impl Service {
    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts `lanes serve` (on `o.endpoint`, or a free loopback port) and
    /// waits until it answers; returns it with its endpoint.
    pub fn start(o: &ServeOpts, since: Instant) -> anyhow::Result<(Service, String)> {
        let endpoint = match &o.endpoint {
            Some(e) => e.clone(),
            None => free_endpoint()?,
        };
        let service = Self::start_on(o, &endpoint, device_arg(o.device), since)?;
        Ok((service, endpoint))
    }

    /// [`Service::start`] on a free loopback port with `--device device`
    /// (`cuda:1`) instead of `o.device`.
    pub fn start_with_device(
        o: &ServeOpts,
        device: &str,
        since: Instant,
    ) -> anyhow::Result<(Service, String)> {
        let endpoint = free_endpoint()?;
        let service = Self::start_on(o, &endpoint, device, since)?;
        Ok((service, endpoint))
    }

    fn start_on(
        o: &ServeOpts,
        endpoint: &str,
        device: &str,
        since: Instant,
    ) -> anyhow::Result<Service> {
        let exe = std::env::current_exe().context("locating the lanes binary")?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .arg("--endpoint")
            .arg(endpoint)
            .arg("--device")
            .arg(device)
            .arg("--policy")
            .arg(o.policy.name())
            .arg("--max-nodes")
            .arg(limits().max_nodes.to_string())
            .args(&o.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(path) = &o.log {
            let f = std::fs::File::create(path)
                .with_context(|| format!("creating the service log {}", path.display()))?;
            cmd.stderr(f);
        }
        progress(
            &format!(
                "starting lanes serve on {endpoint} (--device {device} --policy {} {})",
                o.policy.name(),
                o.args.join(" ")
            ),
            since,
        );
        let mut service = Service {
            child: cmd.spawn().context("starting lanes serve")?,
        };
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(status) = service.child.try_wait()? {
                bail!("lanes serve exited at start-up ({status}); see its log");
            }
            match connect(endpoint, "lanes-bench-probe", Duration::from_secs(2)) {
                Ok(_) => return Ok(service),
                Err(e) if Instant::now() > deadline => {
                    return Err(e.context(format!(
                        "lanes serve did not answer within {} s",
                        READY_WITHIN.as_secs()
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
}

/// A loopback endpoint on a port free now.
pub fn free_endpoint() -> anyhow::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(format!("tcp://127.0.0.1:{}", l.local_addr()?.port()))
}

/// Message limits of the benchmarks' clients and services: the large
/// graphs cross the wire in one header frame.
pub fn limits() -> Limits {
    Limits {
        max_nodes: 1 << 20,
        ..Limits::default()
    }
}

pub fn connect(endpoint: &str, name: &str, timeout: Duration) -> anyhow::Result<Client> {
    Client::connect_with(
        endpoint,
        ClientOptions {
            timeout,
            limits: limits(),
            name: name.into(),
            ..ClientOptions::default()
        },
    )
    .with_context(|| format!("connecting to lanes serve at {endpoint}"))
}

/// Opens a session and keeps it open (a dropped `Session` handle would
/// close it).
pub fn open(client: &mut Client, spec: SessionSpec) -> anyhow::Result<SessionId> {
    match client.request(&Request::OpenSession(spec))? {
        Reply::SessionOpened { session } => Ok(session),
        other => bail!("unexpected reply to OpenSession: {other:?}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A child that died of a signal or a failing status is described; a
    /// clean exit is not.
    #[test]
    fn a_dead_childs_status_is_told() {
        let run = |script: &str| {
            let mut c = Command::new("sh").args(["-c", script]).spawn().unwrap();
            let status = c.wait().unwrap();
            exit_note(c.id(), status)
        };
        let segv = run("kill -SEGV $$").unwrap();
        assert!(segv.contains("signal 11 (SIGSEGV)"), "{segv}");
        let code = run("exit 3").unwrap();
        assert!(code.contains("exited with status 3"), "{code}");
        assert_eq!(run("exit 0"), None);
    }
}
