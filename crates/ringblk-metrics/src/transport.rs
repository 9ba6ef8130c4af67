//! Where the endpoint listens: a Unix socket path or a TCP HOST:PORT, and a
//! stream type over both so the HTTP code is written once.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// A parsed `--metrics` address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricsAddr {
    /// Any address containing '/': a Unix socket path (use `./name` for a
    /// relative one). Access is then governed by file permissions.
    Unix(PathBuf),
    /// HOST:PORT, e.g. `127.0.0.1:9100` or `[::1]:9100`.
    Tcp(String),
}

impl MetricsAddr {
    pub fn parse(s: &str) -> MetricsAddr {
        if s.contains('/') {
            MetricsAddr::Unix(PathBuf::from(s))
        } else {
            MetricsAddr::Tcp(s.to_string())
        }
    }

    /// Connects with `timeout` on connect (TCP), reads and writes.
    pub fn connect(&self, timeout: Duration) -> io::Result<Stream> {
        let stream = match self {
            MetricsAddr::Unix(p) => Stream::Unix(UnixStream::connect(p)?),
            MetricsAddr::Tcp(a) => {
                let mut last = io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("'{a}' resolves to nothing"),
                );
                let mut found = None;
                for sa in a.to_socket_addrs()? {
                    match TcpStream::connect_timeout(&sa, timeout) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                Stream::Tcp(found.ok_or(last)?)
            }
        };
        stream.set_timeouts(timeout)?;
        Ok(stream)
    }
}

impl std::fmt::Display for MetricsAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetricsAddr::Unix(p) => write!(f, "{}", p.display()),
            MetricsAddr::Tcp(a) => f.write_str(a),
        }
    }
}

/// A connected stream of either kind.
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Non-blocking mode (std does this with ioctl(FIONBIO)).
    pub fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(true),
            Stream::Unix(s) => s.set_nonblocking(true),
        }
    }

    pub fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
            Stream::Unix(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}
