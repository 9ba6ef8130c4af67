//! The backends `--compare` starts, and one run against each.
//!
//! A vhost-user backend is started fresh for every configuration (queues
//! and O_DIRECT are start-up options anyway), pinned with taskset, and
//! driven by `ringblk-bench --socket` in a child process: a client stuck in
//! a dead backend is then killed after a timeout instead of hanging the
//! comparison, and its pinning cannot leak into the orchestrator.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::BenchError;
use super::args::{CowBase, RwMode, default_queue_size};
use super::fio::FioJob;
use super::images::{Image, Qcow2};
use super::proc::{self, Guard};
use super::rbd::RbdImage;
use super::report::RunResult;

/// One point of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Config {
    pub rw: RwMode,
    pub iodepth: u32,
    pub queues: u16,
    pub direct: bool,
    /// What is served: `"format"` and, for qcow2, `"qcow2"` in the JSON.
    /// Raw in results from before the format axis.
    #[serde(flatten)]
    pub image: Image,
}

impl Config {
    /// Short name for file names and progress lines.
    pub fn tag(&self) -> String {
        format!(
            "{}-qd{}-q{}-{}{}",
            self.rw.name(),
            self.iodepth,
            self.queues,
            if self.direct { "direct" } else { "cached" },
            self.image.tag()
        )
    }

    /// The same point on the raw image.
    pub fn on_raw(&self) -> Config {
        Config {
            image: Image::Raw,
            ..*self
        }
    }

    /// Whether the clients write.
    pub fn writes(&self) -> bool {
        !matches!(self.rw, RwMode::Randread | RwMode::Read)
    }
}

/// What a backend is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `ringblk serve` with these extra arguments (after --ringblk-arg).
    Ringblk(Vec<String>),
    Qsd,
    Host,
}

/// A named backend of the comparison.
#[derive(Clone, Debug)]
pub struct Backend {
    pub name: String,
    pub kind: Kind,
    /// ringblk command lines run against the started daemon before the
    /// client, `{api}` standing for its control socket (--setup).
    pub setup: Vec<Vec<String>>,
}

/// What the backends serve.
#[derive(Clone, Debug)]
pub enum Target {
    /// An image file or block device.
    File(PathBuf),
    /// A Ceph RBD image: ringblk on `rbd:`, qsd's rbd driver, fio's rbd
    /// engine. Always without a client cache (librbd's is off in ringblk).
    Rbd(RbdImage),
}

impl Target {
    /// How the report names it.
    pub fn describe(&self) -> String {
        match self {
            Target::File(p) => p.display().to_string(),
            Target::Rbd(r) => r.spec(),
        }
    }
}

/// Everything that stays the same over one comparison.
pub struct Env {
    pub target: Target,
    /// Its size in bytes.
    pub image_bytes: u64,
    /// Sockets live here.
    pub run_dir: PathBuf,
    pub logs: PathBuf,
    /// This executable: the client of every vhost-user backend's run.
    pub self_exe: PathBuf,
    pub ringblk_bin: PathBuf,
    pub qsd_bin: PathBuf,
    pub fio_bin: PathBuf,
    pub ringblk_args: Vec<String>,
    /// The image is LUKS1 with its passphrase in this file (--luks-key-file).
    pub luks_key_file: Option<PathBuf>,
    pub fio_args: Vec<String>,
    pub bs: u64,
    pub mix: u8,
    pub runtime: Duration,
    pub ramp: Duration,
    pub poll: bool,
    pub connect_timeout: Duration,
    pub backend_cpu: Option<usize>,
    pub client_cpu: Option<usize>,
}

impl Env {
    /// Longest a client (or fio) may take before it is declared hung.
    fn run_timeout(&self) -> Duration {
        self.ramp + self.runtime + self.connect_timeout + Duration::from_secs(20)
    }
}

/// A successful run, with anything odd that happened around it.
pub struct Run {
    pub result: RunResult,
    pub note: Option<String>,
}

impl Backend {
    /// Whether this backend can serve `image`: fio has no qcow2.
    pub fn serves(&self, image: Image) -> bool {
        image.is_raw() || self.kind != Kind::Host
    }

    /// Runs `cfg` against this backend, starting and stopping it; `qcow2`
    /// is what a qcow2 row serves (the target's file otherwise).
    pub fn run(&self, env: &Env, cfg: &Config, qcow2: Option<&Qcow2>) -> Result<Run, BenchError> {
        let log = env.logs.join(format!("{}-{}.log", cfg.tag(), self.name));
        match &self.kind {
            Kind::Host => {
                let json = env.run_dir.join("fio.json");
                let job = FioJob {
                    fio: &env.fio_bin,
                    target: &env.target,
                    device_bytes: env.image_bytes,
                    rw: cfg.rw,
                    mix: env.mix,
                    bs: env.bs,
                    iodepth: cfg.iodepth,
                    jobs: cfg.queues,
                    direct: cfg.direct,
                    runtime: env.runtime,
                    ramp: env.ramp,
                    // fio is client and backend at once: it goes where the
                    // other backends' clients go.
                    cpu: env.client_cpu,
                    extra: &env.fio_args,
                    json_out: &json,
                    log: &log,
                };
                Ok(Run {
                    result: job.run(env.run_timeout())?,
                    note: None,
                })
            }
            Kind::Ringblk(_) | Kind::Qsd => self.run_vhost(env, cfg, qcow2, &log),
        }
    }

    fn run_vhost(
        &self,
        env: &Env,
        cfg: &Config,
        qcow2: Option<&Qcow2>,
        log: &Path,
    ) -> Result<Run, BenchError> {
        let sock = env.run_dir.join(format!("{}.sock", self.name));
        let metrics = env.run_dir.join(format!("{}.metrics", self.name));
        let api = env.run_dir.join(format!("{}.api", self.name));
        for stale in [&sock, &metrics, &api] {
            let _ = std::fs::remove_file(stale);
        }
        let qsize = default_queue_size(cfg.iodepth);
        let mut cmd = pinned(env.backend_cpu, self.bin(env));
        match &self.kind {
            Kind::Ringblk(extra) => {
                cmd.arg("serve").arg("--socket").arg(&sock);
                match (&env.target, qcow2) {
                    (Target::File(image), q) => {
                        match q {
                            Some(q) => cmd.arg("--image").arg(&q.file).args(["--format", "qcow2"]),
                            None => cmd.arg("--image").arg(image),
                        };
                        if let Some(key) = &env.luks_key_file {
                            cmd.args(["--format", "luks", "--key-file"]).arg(key);
                        }
                        if cfg.direct {
                            cmd.arg("--direct");
                        }
                    }
                    // librbd's cache is always off in ringblk: `direct`.
                    (Target::Rbd(r), _) => {
                        cmd.args(["--image", &r.spec(), "--ceph-id", &r.id]);
                        cmd.arg("--ceph-conf").arg(&r.conf);
                    }
                }
                cmd.args([
                    "--queues",
                    &cfg.queues.to_string(),
                    "--queue-size",
                    &qsize.to_string(),
                ]);
                cmd.arg("--metrics").arg(&metrics);
                if !self.setup.is_empty() {
                    cmd.arg("--api").arg(&api);
                }
                cmd.args(&env.ringblk_args).args(extra);
            }
            Kind::Qsd => {
                let direct = if cfg.direct { "on" } else { "off" };
                let nodes = match (&env.target, qcow2) {
                    (Target::File(_), Some(q)) => qsd_qcow2_nodes(q, direct),
                    (Target::File(image), None) => vec![format!(
                        "driver=file,node-name=f,filename={},cache.direct={direct},aio=io_uring",
                        qemu_opt(image)
                    )],
                    // cache.direct=on turns librbd's cache off, as in ringblk.
                    (Target::Rbd(r), _) => vec![format!(
                        "driver=rbd,node-name=f,pool={},image={},conf={},user={},cache.direct={direct}",
                        r.pool,
                        r.image,
                        qemu_opt(&r.conf),
                        r.id
                    )],
                };
                let mut nodes = nodes;
                if let (Some(key), Target::File(_)) = (&env.luks_key_file, &env.target) {
                    // The file node becomes `p`, under a luks node `f`.
                    nodes[0] = nodes[0].replacen("node-name=f,", "node-name=p,", 1);
                    nodes.push("driver=luks,node-name=f,file=p,key-secret=sec0".into());
                    cmd.arg("--object")
                        .arg(format!("secret,id=sec0,file={}", qemu_opt(key)));
                }
                for node in nodes {
                    cmd.arg("--blockdev").arg(node);
                }
                cmd.arg("--export").arg(format!(
                    "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=on,num-queues={}",
                    qemu_opt(&sock),
                    cfg.queues
                ));
            }
            Kind::Host => unreachable!("fio is not a vhost-user backend"),
        }
        let mut backend = Guard(spawn_logged(&mut cmd, log)?);
        let pid = backend.0.id();
        wait_for_socket(&sock, &mut backend, env.connect_timeout, log)?;
        if !self.setup.is_empty() {
            wait_for_socket(&api, &mut backend, env.connect_timeout, log)?;
            for (i, line) in self.setup.iter().enumerate() {
                let setup_log = log.with_extension(format!("setup{i}.log"));
                run_setup(env, line, &api, &setup_log)?;
            }
        }

        let client_log = log.with_extension("client.log");
        let json = env.run_dir.join(format!("{}.json", self.name));
        let _ = std::fs::remove_file(&json);
        let mut client = Command::new(&env.self_exe);
        client.arg("--socket").arg(&sock);
        client.args([
            "--rw",
            cfg.rw.name(),
            "--mix",
            &env.mix.to_string(),
            "--bs",
            &env.bs.to_string(),
        ]);
        client.args([
            "--iodepth",
            &cfg.iodepth.to_string(),
            "--queues",
            &cfg.queues.to_string(),
        ]);
        client.arg(format!("--runtime={}ms", env.runtime.as_millis()));
        client.arg(format!("--ramp={}ms", env.ramp.as_millis()));
        client.arg(format!(
            "--connect-timeout={}ms",
            env.connect_timeout.as_millis()
        ));
        client.args([
            "--queue-size",
            &qsize.to_string(),
            "--pid",
            &pid.to_string(),
        ]);
        client.arg("--json").arg(&json);
        match env.client_cpu {
            Some(cpu) => client.args(["--client-cpu", &cpu.to_string()]),
            None => client.arg("--no-pin"),
        };
        if env.poll {
            client.arg("--poll");
        }
        // On an empty overlay, a cluster of its own for every request, so
        // that each write allocates one; the window ends when none is left
        // (see --distinct). Reads allocate nothing and run as elsewhere.
        if let Some(q) = qcow2.filter(|q| q.backing.is_some() && cfg.writes()) {
            client.arg(format!("--distinct={}", q.cluster));
        }
        if matches!(self.kind, Kind::Ringblk(_)) {
            client.arg("--metrics").arg(&metrics);
        }
        let mut client = Guard(spawn_logged(&mut client, &client_log)?);
        let status = proc::wait_timeout(&mut client.0, env.run_timeout())
            .map_err(BenchError::io("waiting for the client"))?;
        let died = backend.0.try_wait().ok().flatten();
        let Some(status) = status else {
            return Err(BenchError::Timeout {
                who: "client",
                timeout: env.run_timeout(),
                log: proc::tail(log, 3),
            });
        };
        if !status.success() {
            let client = proc::tail(&client_log, 3);
            return Err(match died {
                Some(status) => BenchError::BackendDied {
                    status,
                    log: proc::tail(log, 3),
                    client,
                },
                None => BenchError::Failed {
                    who: "client",
                    status,
                    log: client,
                },
            });
        }
        let text = std::fs::read_to_string(&json)
            .map_err(BenchError::io(format!("reading {}", json.display())))?;
        let result: RunResult = serde_json::from_str(&text).map_err(|e| BenchError::Parse {
            who: "client",
            msg: e.to_string(),
        })?;
        let (status, killed) = backend
            .stop(Duration::from_secs(5))
            .map_err(BenchError::io("stopping the backend"))?;
        let note = if killed {
            Some("backend ignored SIGTERM for 5 s and was killed".to_string())
        } else if died.is_some() {
            Some(format!("backend exited on its own ({status})"))
        } else {
            None
        };
        Ok(Run { result, note })
    }

    fn bin<'a>(&self, env: &'a Env) -> &'a Path {
        match self.kind {
            Kind::Ringblk(_) => &env.ringblk_bin,
            Kind::Qsd => &env.qsd_bin,
            Kind::Host => &env.fio_bin,
        }
    }
}

/// Runs one --setup command line (`ringblk ARGS`, `{api}` replaced by the
/// daemon's control socket) to its end, killing it after a while.
fn run_setup(env: &Env, line: &[String], api: &Path, log: &Path) -> Result<(), BenchError> {
    let api = api.to_string_lossy();
    let args: Vec<String> = line.iter().map(|a| a.replace("{api}", &api)).collect();
    let shown = format!("ringblk {}", args.join(" "));
    let mut child = Guard(spawn_logged(
        Command::new(&env.ringblk_bin).args(&args),
        log,
    )?);
    let timeout = env.connect_timeout + Duration::from_secs(10);
    let status = proc::wait_timeout(&mut child.0, timeout)
        .map_err(BenchError::io("waiting for a setup command"))?;
    match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => Err(BenchError::Setup {
            cmd: shown,
            why: format!("{s}: {}", proc::tail(log, 3)),
        }),
        None => Err(BenchError::Setup {
            cmd: shown,
            why: format!("did not finish in {timeout:?}"),
        }),
    }
}

/// qsd's nodes for a qcow2 image, the exported one named `f`: the image
/// on a file node with io_uring, and an overlay's base as nodes of its own
/// (read-only, io_uring too: a base qsd opened from the image's header
/// would read through its thread pool). cache.direct follows --direct on
/// every file, as ringblk's O_DIRECT does.
fn qsd_qcow2_nodes(q: &Qcow2, direct: &str) -> Vec<String> {
    let file = |p: &Path| {
        format!(
            "file.driver=file,file.filename={},file.aio=io_uring",
            qemu_opt(p)
        )
    };
    let mut nodes = Vec::new();
    let mut top = format!(
        "driver=qcow2,node-name=f,{},cache.direct={direct}",
        file(&q.file)
    );
    if let Some((base, fmt)) = &q.backing {
        let driver = match fmt {
            CowBase::Raw => "raw",
            CowBase::Qcow2 => "qcow2",
        };
        nodes.push(format!(
            "driver={driver},node-name=base,{},cache.direct={direct},read-only=on",
            file(base)
        ));
        top.push_str(",backing=base");
    }
    nodes.push(top);
    nodes
}

/// A path as the value of a QEMU option: a comma is doubled.
fn qemu_opt(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

/// `bin`, under `taskset -c CPU` when pinning.
fn pinned(cpu: Option<usize>, bin: &Path) -> Command {
    match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpu.to_string()).arg(bin);
            c
        }
        None => Command::new(bin),
    }
}

/// Starts `cmd` with standard output and error going to the file `log`.
pub fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<std::process::Child, BenchError> {
    let out = std::fs::File::create(log)
        .map_err(BenchError::io(format!("creating {}", log.display())))?;
    let err = out
        .try_clone()
        .map_err(BenchError::io("duplicating the log fd"))?;
    cmd.stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|source| BenchError::Spawn {
            program: cmd.get_program().to_string_lossy().into_owned(),
            source,
        })
}

/// Waits until the backend has created its socket; the client then retries
/// connecting while it is not yet listening. Fails early if the backend
/// exits, with the end of its log as the reason.
fn wait_for_socket(
    sock: &Path,
    backend: &mut Guard,
    timeout: Duration,
    log: &Path,
) -> Result<(), BenchError> {
    let deadline = Instant::now() + timeout;
    while !sock.exists() {
        if let Ok(Some(status)) = backend.0.try_wait() {
            return Err(BenchError::StartupExit {
                status,
                log: proc::reason(log),
            });
        }
        if Instant::now() > deadline {
            return Err(BenchError::NoSocket {
                socket: sock.to_path_buf(),
                timeout,
                log: proc::tail(log, 3),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
