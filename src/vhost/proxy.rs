//! A relay between the front-end's connection and vhost-user-backend's,
//! which answers the two messages the crate does not implement:
//! GET_INFLIGHT_FD and SET_INFLIGHT_FD, and refuses the SET_VRING_NUM the
//! crate would acknowledge without applying. Everything else, fds
//! included, passes through untouched, so the rest of the protocol stays
//! the crate's.
//!
//! Only control messages cross it; the data path is shared memory and
//! eventfds, so the relay costs nothing per I/O.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::inflight::InflightRegion;

const HDR: usize = 12;
/// Larger than any message the protocol defines; a front-end announcing
/// more is broken or hostile and is disconnected.
const MAX_PAYLOAD: usize = 64 * 1024;
/// vhost-user allows at most 8 fds per message.
const MAX_FDS: usize = 8;
const SET_VRING_NUM: u32 = 8;
const GET_INFLIGHT_FD: u32 = 31;
const SET_INFLIGHT_FD: u32 = 32;
const FLAG_VERSION: u32 = 0x1;
const FLAG_REPLY: u32 = 0x4;
const FLAG_NEED_REPLY: u32 = 0x8;
/// `struct VhostUserInflight`: u64 mmap_size, u64 mmap_offset, u16
/// num_queues, u16 queue_size, padded to 24 bytes.
const INFLIGHT_LEN: usize = 24;

/// Where the relay gets and puts inflight regions: the device.
pub trait InflightHost: Send + Sync + 'static {
    /// The device's queue count and maximum queue size.
    fn limits(&self) -> (u16, u16);
    /// Installs the region for the workers.
    fn set_inflight(&self, region: Arc<InflightRegion>);
}

struct Msg {
    request: u32,
    flags: u32,
    payload: Vec<u8>,
    fds: Vec<File>,
}

impl Msg {
    fn encode_header(request: u32, flags: u32, size: usize) -> [u8; HDR] {
        let mut h = [0u8; HDR];
        h[0..4].copy_from_slice(&request.to_le_bytes());
        h[4..8].copy_from_slice(&flags.to_le_bytes());
        h[8..12].copy_from_slice(&(size as u32).to_le_bytes());
        h
    }

    fn send(&self, to: &UnixStream) -> io::Result<()> {
        let hdr = Self::encode_header(self.request, self.flags, self.payload.len());
        let fds: Vec<RawFd> = self.fds.iter().map(|f| f.as_raw_fd()).collect();
        send_all(to, &hdr, &self.payload, &fds)
    }
}

fn send_all(to: &UnixStream, hdr: &[u8], payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(hdr.len() + payload.len());
    buf.extend_from_slice(hdr);
    buf.extend_from_slice(payload);
    let mut sent = to
        .send_with_fds(&[&buf[..]], fds)
        .map_err(io::Error::from)?;
    while sent < buf.len() {
        let n = to
            .send_with_fds(&[&buf[sent..]], &[])
            .map_err(io::Error::from)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        sent += n;
    }
    Ok(())
}

/// Reads one message; `None` at a clean end of stream.
fn read_msg(from: &UnixStream) -> io::Result<Option<Msg>> {
    let mut hdr = [0u8; HDR];
    let mut fds = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: HDR,
    }];
    // SAFETY: the iovec points at `hdr`, which outlives the call; `fds` has
    // room for MAX_FDS descriptors.
    let (n, nfds) = unsafe { from.recv_with_fds(&mut iov, &mut fds) }.map_err(io::Error::from)?;
    // SAFETY: the kernel installed `nfds` new descriptors we now own.
    let files: Vec<File> = fds[..nfds]
        .iter()
        .map(|fd| unsafe { File::from_raw_fd(*fd) })
        .collect();
    if n == 0 {
        return Ok(None);
    }
    (&*from).read_exact(&mut hdr[n..])?;
    let request = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let flags = u32::from_le_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
    let size = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as usize;
    if size > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message of {size} bytes"),
        ));
    }
    let mut payload = vec![0u8; size];
    (&*from).read_exact(&mut payload)?;
    Ok(Some(Msg {
        request,
        flags,
        payload,
        fds: files,
    }))
}

/// Relays `front` <-> `back` until either side closes.
pub fn relay(
    front: UnixStream,
    back: UnixStream,
    host: Arc<dyn InflightHost>,
) -> io::Result<Vec<JoinHandle<()>>> {
    let front_w = Arc::new(Mutex::new(front.try_clone()?));
    let (front_r, back_w, back_r) = (front.try_clone()?, back.try_clone()?, back);
    // Either direction ending ends both, so neither thread outlives the
    // connection and the crate's handler sees the disconnect.
    let ends = Arc::new((front.try_clone()?, back_w.try_clone()?));
    let ends2 = ends.clone();
    let shut = move || {
        let _ = ends.0.shutdown(std::net::Shutdown::Both);
        let _ = ends.1.shutdown(std::net::Shutdown::Both);
    };
    let shut2 = move || {
        let _ = ends2.0.shutdown(std::net::Shutdown::Both);
        let _ = ends2.1.shutdown(std::net::Shutdown::Both);
    };
    let fw = front_w.clone();
    let to_back = std::thread::Builder::new()
        .name("vu-relay-in".into())
        .spawn(move || {
            loop {
                let msg = match read_msg(&front_r) {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        log::warn!("front-end message: {e}; disconnecting");
                        break;
                    }
                };
                log::debug!(
                    "front-end request {} ({} bytes, {} fds)",
                    msg.request,
                    msg.payload.len(),
                    msg.fds.len()
                );
                let r = match msg.request {
                    GET_INFLIGHT_FD => get_inflight(&msg, &*host, &fw),
                    SET_INFLIGHT_FD => set_inflight(msg, &*host, &fw),
                    SET_VRING_NUM if !vring_num_ok(&msg.payload) => {
                        // The crate answers an error with a disconnect too.
                        log::warn!("SET_VRING_NUM refused: not a power of two; disconnecting");
                        let _ = refuse(&msg, &fw);
                        break;
                    }
                    _ => msg.send(&back_w),
                };
                if let Err(e) = r {
                    log::warn!("relaying to the back-end: {e}");
                    break;
                }
            }
            shut();
        })?;
    let from_back = std::thread::Builder::new()
        .name("vu-relay-out".into())
        .spawn(move || {
            while let Ok(Some(msg)) = read_msg(&back_r) {
                let w = front_w.lock().unwrap_or_else(|p| p.into_inner());
                if msg.send(&w).is_err() {
                    break;
                }
            }
            shut2();
        })?;
    Ok(vec![to_back, from_back])
}

/// A split virtqueue's size is a power of two. vhost-user-backend checks
/// only 0 and the maximum, and `Queue::set_size` ignores any other bad
/// size with a log line: the front-end would get a success and a device
/// still using the previous size (for a ring laid out for the new one,
/// used elements written past the end of the front-end's used ring).
/// Malformed payloads are left to the crate, which refuses them.
fn vring_num_ok(p: &[u8]) -> bool {
    match p {
        [_, _, _, _, a, b, c, d] => u32::from_le_bytes([*a, *b, *c, *d]).is_power_of_two(),
        _ => true,
    }
}

/// Answers `msg` with an error status if it asked for a reply.
fn refuse(msg: &Msg, to: &Mutex<UnixStream>) -> io::Result<()> {
    if msg.flags & FLAG_NEED_REPLY == 0 {
        return Ok(());
    }
    reply(to, msg.request, &1u64.to_le_bytes(), &[])
}

fn inflight_args(p: &[u8]) -> Option<(u64, u64, u16, u16)> {
    if p.len() < INFLIGHT_LEN {
        return None;
    }
    let u64_at = |o: usize| u64::from_le_bytes(p[o..o + 8].try_into().unwrap_or_default());
    let u16_at = |o: usize| u16::from_le_bytes([p[o], p[o + 1]]);
    Some((u64_at(0), u64_at(8), u16_at(16), u16_at(18)))
}

fn reply(to: &Mutex<UnixStream>, request: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let hdr = Msg::encode_header(request, FLAG_VERSION | FLAG_REPLY, payload.len());
    send_all(
        &to.lock().unwrap_or_else(|p| p.into_inner()),
        &hdr,
        payload,
        fds,
    )
}

fn get_inflight(msg: &Msg, host: &dyn InflightHost, to: &Mutex<UnixStream>) -> io::Result<()> {
    let (queues, max_size) = host.limits();
    let region = inflight_args(&msg.payload)
        .filter(|&(_, _, n, qs)| n >= 1 && n <= queues && qs.is_power_of_two() && qs <= max_size)
        .map(|(_, _, n, qs)| InflightRegion::create(n, qs));
    let mut out = [0u8; INFLIGHT_LEN];
    match region {
        Some(Ok(r)) => {
            out[0..8].copy_from_slice(&(r.size() as u64).to_le_bytes());
            out[16..18].copy_from_slice(&r.num_queues.to_le_bytes());
            out[18..20].copy_from_slice(&r.queue_size.to_le_bytes());
            log::info!(
                "inflight tracking: {} bytes for {} queue(s) of {}",
                r.size(),
                r.num_queues,
                r.queue_size
            );
            reply(to, GET_INFLIGHT_FD, &out, &[r.file.as_raw_fd()])
        }
        // mmap_size 0 tells the front-end we could not provide one.
        other => {
            log::warn!(
                "GET_INFLIGHT_FD refused: {}",
                match other {
                    Some(Err(e)) => e.to_string(),
                    _ => "bad queue count or size".into(),
                }
            );
            reply(to, GET_INFLIGHT_FD, &out, &[])
        }
    }
}

fn set_inflight(mut msg: Msg, host: &dyn InflightHost, to: &Mutex<UnixStream>) -> io::Result<()> {
    let (queues, _) = host.limits();
    let result = match (inflight_args(&msg.payload), msg.fds.len()) {
        (Some((size, offset, n, qs)), 1) if n <= queues => {
            InflightRegion::from_front_end(msg.fds.remove(0), size, offset, n, qs)
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "malformed SET_INFLIGHT_FD",
        )),
    };
    let ok = match result {
        Ok(region) => {
            log::info!(
                "inflight region installed ({} queue(s) of {})",
                region.num_queues,
                region.queue_size
            );
            host.set_inflight(Arc::new(region));
            true
        }
        Err(e) => {
            log::warn!("SET_INFLIGHT_FD refused: {e}");
            false
        }
    };
    if msg.flags & FLAG_NEED_REPLY != 0 {
        reply(to, SET_INFLIGHT_FD, &u64::from(!ok).to_le_bytes(), &[])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Duration;

    use super::*;

    struct NoDevice;

    impl InflightHost for NoDevice {
        fn limits(&self) -> (u16, u16) {
            (1, 256)
        }
        fn set_inflight(&self, _region: Arc<InflightRegion>) {}
    }

    /// A relay between two socket pairs: (front-end's end, back-end's end).
    fn relayed() -> (UnixStream, UnixStream, Vec<JoinHandle<()>>) {
        let (front, relay_front) = UnixStream::pair().unwrap();
        let (relay_back, back) = UnixStream::pair().unwrap();
        for s in [&front, &back] {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        let threads = relay(relay_front, relay_back, Arc::new(NoDevice)).unwrap();
        (front, back, threads)
    }

    fn vring_num(num: u32) -> Vec<u8> {
        let mut m = Msg::encode_header(SET_VRING_NUM, FLAG_VERSION | FLAG_NEED_REPLY, 8).to_vec();
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(&num.to_le_bytes());
        m
    }

    #[test]
    fn set_vring_num_must_be_a_power_of_two() {
        let (mut front, mut back, threads) = relayed();
        // A valid size passes through untouched.
        front.write_all(&vring_num(128)).unwrap();
        let mut got = [0u8; 20];
        back.read_exact(&mut got).unwrap();
        assert_eq!(got.to_vec(), vring_num(128));
        // Another is refused here, not forwarded, and the connection ends.
        front.write_all(&vring_num(100)).unwrap();
        let mut reply = [0u8; 20];
        front.read_exact(&mut reply).unwrap();
        assert_eq!(
            u32::from_le_bytes(reply[0..4].try_into().unwrap()),
            SET_VRING_NUM
        );
        assert_ne!(
            u32::from_le_bytes(reply[4..8].try_into().unwrap()) & FLAG_REPLY,
            0
        );
        assert_eq!(u64::from_le_bytes(reply[12..20].try_into().unwrap()), 1);
        let mut rest = Vec::new();
        assert_eq!(
            back.read_to_end(&mut rest).unwrap(),
            0,
            "forwarded: {rest:?}"
        );
        assert_eq!(front.read_to_end(&mut rest).unwrap(), 0);
        for t in threads {
            t.join().unwrap();
        }
    }
}
