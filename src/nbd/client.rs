//! The client side, for `ringblk backup` (docs/backup.md): the fixed
//! newstyle handshake with structured replies and metadata contexts
//! (`base:allocation`, `qemu:dirty-bitmap:NAME`), then `NBD_CMD_READ` with
//! several requests in flight and `NBD_CMD_BLOCK_STATUS`. It speaks to
//! the daemon's own export ([`super::Server`]) and to any server that
//! speaks the same (qemu-nbd, nbdkit).
//!
//! The server is half-trusted: every length in a reply is checked against
//! what was asked before anything is read into memory (a chunk never
//! longer than its request, a description at most [`MAX_DESCRIPTORS`]),
//! every reply matched to a request in flight, and a socket deadline
//! bounds every wait. A reply that breaks the protocol ends the
//! connection with [`ClientError::Protocol`].

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::proto::*;

/// The longest read request sent (the server cuts its reply into pieces).
pub const MAX_READ: u32 = 4 << 20;
/// Read requests in flight at most.
pub const DEPTH: usize = 8;
/// Block-status runs taken per context for one request (the server's
/// chunks together).
pub const MAX_DESCRIPTORS: usize = 1 << 16;
/// How long one reply (or the handshake) may take.
const DEADLINE: Duration = Duration::from_secs(120);

/// Why the client stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("NBD: {0}")]
    Io(#[from] io::Error),
    /// The server broke the protocol (or sent what this client never
    /// asked for).
    #[error("NBD: the server broke the protocol: {0}")]
    Protocol(String),
    /// The server refused an option or a request.
    #[error("NBD: {0}")]
    Refused(String),
}

type Res<T> = Result<T, ClientError>;

fn bad<T>(why: impl Into<String>) -> Res<T> {
    Err(ClientError::Protocol(why.into()))
}

/// A connection in transmission, over a Unix socket or (the fuzz target)
/// any byte stream.
pub struct Client<S: Read + Write = UnixStream> {
    sock: S,
    size: u64,
    /// The ids of the contexts asked for, by name.
    contexts: HashMap<String, u32>,
    next_handle: u64,
}

/// What one block-status request answered for one context: runs of
/// `(length, flags)` from the request's offset on.
pub type Extents = Vec<(u64, u32)>;

impl Client {
    /// Connects to the export at `socket` (a Unix socket) and selects the
    /// metadata contexts `contexts` (names such as `base:allocation`);
    /// the server must agree to every one.
    pub fn connect(socket: &Path, contexts: &[&str]) -> Res<Client> {
        let sock = UnixStream::connect(socket)?;
        sock.set_read_timeout(Some(DEADLINE))?;
        sock.set_write_timeout(Some(DEADLINE))?;
        Client::over(sock, contexts)
    }
}

impl<S: Read + Write> Client<S> {
    /// The handshake over `sock`, a stream to the server already open
    /// (bounded in time by its owner): see [`Client::connect`].
    pub fn over(sock: S, contexts: &[&str]) -> Res<Client<S>> {
        let mut c = Client {
            sock,
            size: 0,
            contexts: HashMap::new(),
            next_handle: 1,
        };
        c.handshake(contexts)?;
        Ok(c)
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn handshake(&mut self, contexts: &[&str]) -> Res<()> {
        if self.u64()? != NBDMAGIC || self.u64()? != IHAVEOPT {
            return bad("not a newstyle NBD server");
        }
        let flags = self.u16()?;
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            return bad("the server is not fixed newstyle");
        }
        let mut client_flags = FLAG_C_FIXED_NEWSTYLE;
        if flags & FLAG_NO_ZEROES != 0 {
            client_flags |= FLAG_C_NO_ZEROES;
        }
        self.sock.write_all(&client_flags.to_be_bytes())?;
        // Structured replies: block status needs them.
        self.option(OPT_STRUCTURED_REPLY, &[])?;
        match self.option_reply(OPT_STRUCTURED_REPLY)? {
            (REP_ACK, _) => {}
            (t, _) => return Err(refused("structured replies", t)),
        }
        if !contexts.is_empty() {
            let mut data = Vec::new();
            data.extend_from_slice(&0u32.to_be_bytes()); // export name ""
            data.extend_from_slice(&(contexts.len() as u32).to_be_bytes());
            for c in contexts {
                data.extend_from_slice(&(c.len() as u32).to_be_bytes());
                data.extend_from_slice(c.as_bytes());
            }
            self.option(OPT_SET_META_CONTEXT, &data)?;
            loop {
                match self.option_reply(OPT_SET_META_CONTEXT)? {
                    (REP_ACK, _) => break,
                    (REP_META_CONTEXT, d) if d.len() >= 4 => {
                        let id = u32::from_be_bytes([d[0], d[1], d[2], d[3]]);
                        let name = String::from_utf8_lossy(&d[4..]).into_owned();
                        if !contexts.contains(&name.as_str()) {
                            return bad(format!("a context not asked for: {name}"));
                        }
                        self.contexts.insert(name, id);
                    }
                    (t, _) => return Err(refused("metadata contexts", t)),
                }
            }
            if let Some(missing) = contexts.iter().find(|c| !self.contexts.contains_key(**c)) {
                return Err(ClientError::Refused(format!(
                    "the server does not offer the metadata context {missing}"
                )));
            }
        }
        // NBD_OPT_GO, export "", no information asked for beyond the size.
        self.option(OPT_GO, &[0, 0, 0, 0, 0, 0])?;
        let mut got_size = false;
        loop {
            match self.option_reply(OPT_GO)? {
                (REP_ACK, _) => break,
                (REP_INFO, d) if d.len() >= 2 => {
                    if u16::from_be_bytes([d[0], d[1]]) == INFO_EXPORT {
                        if d.len() != 12 {
                            return bad("NBD_INFO_EXPORT of the wrong length");
                        }
                        self.size = u64::from_be_bytes(d[2..10].try_into().unwrap_or([0; 8]));
                        got_size = true;
                    }
                }
                (t, _) => return Err(refused("the export", t)),
            }
        }
        if !got_size {
            return bad("no NBD_INFO_EXPORT before the ACK");
        }
        Ok(())
    }

    fn option(&mut self, opt: u32, data: &[u8]) -> Res<()> {
        let mut msg = Vec::with_capacity(16 + data.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&opt.to_be_bytes());
        msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
        msg.extend_from_slice(data);
        self.sock.write_all(&msg)?;
        Ok(())
    }

    /// One option reply to `opt`: its type and data (at most 64 KiB).
    fn option_reply(&mut self, opt: u32) -> Res<(u32, Vec<u8>)> {
        if self.u64()? != REP_MAGIC {
            return bad("an option reply without its magic");
        }
        if self.u32()? != opt {
            return bad("a reply to another option");
        }
        let kind = self.u32()?;
        let len = self.u32()?;
        if len > 64 << 10 {
            return bad(format!("an option reply of {len} bytes"));
        }
        let mut data = vec![0u8; len as usize];
        self.sock.read_exact(&mut data)?;
        Ok((kind, data))
    }

    fn request(&mut self, cmd: u16, flags: u16, offset: u64, len: u32) -> Res<u64> {
        let handle = self.next_handle;
        self.next_handle += 1;
        let mut msg = [0u8; REQUEST_LEN];
        msg[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg[4..6].copy_from_slice(&flags.to_be_bytes());
        msg[6..8].copy_from_slice(&cmd.to_be_bytes());
        msg[8..16].copy_from_slice(&handle.to_be_bytes());
        msg[16..24].copy_from_slice(&offset.to_be_bytes());
        msg[24..28].copy_from_slice(&len.to_be_bytes());
        self.sock.write_all(&msg)?;
        Ok(handle)
    }

    /// Reads `ranges` (each inside the export, at most [`MAX_READ`]
    /// bytes), [`DEPTH`] requests in flight, and hands each to `sink`
    /// whole, with its offset, in the order they complete.
    pub fn read_ranges(
        &mut self,
        ranges: &[(u64, u32)],
        mut sink: impl FnMut(u64, &[u8]) -> Res<()>,
    ) -> Res<()> {
        let mut pending: HashMap<u64, (u64, Vec<u8>)> = HashMap::new();
        let mut next = 0;
        while next < ranges.len() || !pending.is_empty() {
            while next < ranges.len() && pending.len() < DEPTH {
                let (offset, len) = ranges[next];
                if len == 0 || len > MAX_READ || offset.saturating_add(u64::from(len)) > self.size {
                    return Err(ClientError::Refused(format!(
                        "a read of {len} bytes at {offset} (the export has {})",
                        self.size
                    )));
                }
                let h = self.request(CMD_READ, 0, offset, len)?;
                pending.insert(h, (offset, vec![0u8; len as usize]));
                next += 1;
            }
            let (handle, done) = self.chunk(
                |pending, handle, chunk, data_len| {
                    let Some((offset, buf)) = pending.get_mut(&handle) else {
                        return bad("a reply to no request in flight");
                    };
                    chunk.read_into(*offset, buf, data_len)
                },
                &mut pending,
            )?;
            if done && let Some((offset, buf)) = pending.remove(&handle) {
                sink(offset, &buf)?;
            }
        }
        Ok(())
    }

    /// Block status of `[offset, offset + len)` for each context in
    /// `contexts` (names given to [`Client::connect`]): the runs from
    /// `offset` on, which may stop short of `len` (ask again from where
    /// they end).
    pub fn block_status(&mut self, offset: u64, len: u32, contexts: &[&str]) -> Res<Vec<Extents>> {
        let ids: Vec<u32> = contexts
            .iter()
            .map(|c| {
                self.contexts.get(*c).copied().ok_or_else(|| {
                    ClientError::Refused(format!("the context {c} was not selected"))
                })
            })
            .collect::<Res<_>>()?;
        let h = self.request(CMD_BLOCK_STATUS, 0, offset, len)?;
        // The server answers for every context selected, asked for or not.
        let selected: Vec<u32> = self.contexts.values().copied().collect();
        let mut out: HashMap<u32, Extents> = HashMap::new();
        loop {
            let mut one = HashMap::from([(h, ())]);
            let (_, done) = self.chunk(
                |_, _, chunk, data_len| chunk.status_into(&mut out, &selected, data_len),
                &mut one,
            )?;
            if done {
                break;
            }
        }
        ids.iter()
            .zip(contexts)
            .map(|(id, name)| {
                out.remove(id).filter(|e| !e.is_empty()).ok_or_else(|| {
                    ClientError::Protocol(format!("no block status for the context {name}"))
                })
            })
            .collect()
    }

    /// Reads one reply chunk (or simple reply) and hands its payload to
    /// `take` with the requests in flight; returns its handle and whether
    /// it ended its request.
    fn chunk<P>(
        &mut self,
        take: impl FnOnce(&mut HashMap<u64, P>, u64, &mut Chunk<'_, S>, u32) -> Res<()>,
        pending: &mut HashMap<u64, P>,
    ) -> Res<(u64, bool)> {
        let magic = self.u32()?;
        match magic {
            STRUCTURED_REPLY_MAGIC => {
                let flags = self.u16()?;
                let kind = self.u16()?;
                let handle = self.u64()?;
                let len = self.u32()?;
                if !pending.contains_key(&handle) {
                    return bad("a reply to no request in flight");
                }
                let mut c = Chunk {
                    sock: &mut self.sock,
                    kind,
                };
                match kind {
                    REPLY_TYPE_NONE if len == 0 => {}
                    REPLY_TYPE_NONE => return bad("a NONE chunk with a payload"),
                    REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                        return Err(c.error(len)?);
                    }
                    _ => take(pending, handle, &mut c, len)?,
                }
                Ok((handle, flags & REPLY_FLAG_DONE != 0))
            }
            SIMPLE_REPLY_MAGIC => {
                let error = self.u32()?;
                let handle = self.u64()?;
                if error != 0 {
                    return Err(ClientError::Refused(format!(
                        "the server answered error {error}"
                    )));
                }
                if !pending.contains_key(&handle) {
                    return bad("a reply to no request in flight");
                }
                let mut c = Chunk {
                    sock: &mut self.sock,
                    kind: u16::MAX,
                };
                take(pending, handle, &mut c, u32::MAX)?;
                Ok((handle, true))
            }
            _ => bad(format!("a reply magic of {magic:#x}")),
        }
    }

    fn u16(&mut self) -> Res<u16> {
        Ok(u16::from_be_bytes(take(&mut self.sock)?))
    }

    fn u32(&mut self) -> Res<u32> {
        Ok(u32::from_be_bytes(take(&mut self.sock)?))
    }

    fn u64(&mut self) -> Res<u64> {
        Ok(u64::from_be_bytes(take(&mut self.sock)?))
    }
}

/// The next `N` bytes of `r`.
fn take<const N: usize>(r: &mut impl Read) -> Res<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

impl<S: Read + Write> Drop for Client<S> {
    fn drop(&mut self) {
        // NBD_CMD_DISC: the server may close cleanly. Best effort.
        let _ = self.request(CMD_DISC, 0, 0, 0);
    }
}

/// The reply type OFFSET_HOLE (NBD's spec; our server sends none).
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;

/// One reply chunk whose payload is still on the socket.
struct Chunk<'a, S> {
    sock: &'a mut S,
    /// The structured reply's type, or `u16::MAX` for a simple reply.
    kind: u16,
}

impl<S: Read> Chunk<'_, S> {
    fn u32(&mut self) -> Res<u32> {
        Ok(u32::from_be_bytes(take(self.sock)?))
    }

    fn u64(&mut self) -> Res<u64> {
        Ok(u64::from_be_bytes(take(self.sock)?))
    }

    /// A read's chunk into `buf`, the request's buffer (from `offset`).
    fn read_into(&mut self, offset: u64, buf: &mut [u8], len: u32) -> Res<()> {
        match self.kind {
            u16::MAX => {
                // A simple reply: the whole buffer.
                self.sock.read_exact(buf)?;
                Ok(())
            }
            REPLY_TYPE_OFFSET_DATA => {
                if len < 8 {
                    return bad("an OFFSET_DATA chunk without its offset");
                }
                let at = self.u64()?;
                let n = u64::from(len - 8);
                let start = at.checked_sub(offset).filter(|s| s + n <= buf.len() as u64);
                let Some(start) = start else {
                    return bad("an OFFSET_DATA chunk outside its request");
                };
                self.sock
                    .read_exact(&mut buf[start as usize..(start + n) as usize])?;
                Ok(())
            }
            REPLY_TYPE_OFFSET_HOLE => {
                if len != 12 {
                    return bad("an OFFSET_HOLE chunk of the wrong length");
                }
                let at = self.u64()?;
                let n = u64::from(self.u32()?);
                let start = at.checked_sub(offset).filter(|s| s + n <= buf.len() as u64);
                let Some(start) = start else {
                    return bad("an OFFSET_HOLE chunk outside its request");
                };
                buf[start as usize..(start + n) as usize].fill(0);
                Ok(())
            }
            k => bad(format!("a chunk of type {k} for a read")),
        }
    }

    /// A block-status chunk: its context's runs, appended to `out`.
    fn status_into(&mut self, out: &mut HashMap<u32, Extents>, ids: &[u32], len: u32) -> Res<()> {
        if self.kind != REPLY_TYPE_BLOCK_STATUS {
            return bad(format!("a chunk of type {} for block status", self.kind));
        }
        if len < 4 || !(len - 4).is_multiple_of(8) || ((len - 4) / 8) as usize > MAX_DESCRIPTORS {
            return bad(format!("a block-status chunk of {len} bytes"));
        }
        let id = self.u32()?;
        if !ids.contains(&id) {
            return bad(format!("block status for the context {id}, not selected"));
        }
        let runs = out.entry(id).or_default();
        if runs.len() + ((len - 4) / 8) as usize > MAX_DESCRIPTORS {
            return bad("more block-status runs for one request than a client takes");
        }
        for _ in 0..(len - 4) / 8 {
            let n = self.u32()?;
            let flags = self.u32()?;
            if n == 0 {
                return bad("a block-status run of length 0");
            }
            runs.push((u64::from(n), flags));
        }
        Ok(())
    }

    /// An error chunk: the server's message.
    fn error(&mut self, len: u32) -> Res<ClientError> {
        if !(6..=MAX_STRING as u32 + 14).contains(&len) {
            return bad(format!("an error chunk of {len} bytes"));
        }
        let code = self.u32()?;
        let mut rest = vec![0u8; (len - 4) as usize];
        self.sock.read_exact(&mut rest)?;
        let msg_len = u16::from_be_bytes([rest[0], rest[1]]) as usize;
        let msg = String::from_utf8_lossy(rest.get(2..2 + msg_len).unwrap_or_default());
        Ok(ClientError::Refused(format!(
            "the server answered error {code}: {msg}"
        )))
    }
}

fn refused(what: &str, kind: u32) -> ClientError {
    ClientError::Refused(format!("the server refused {what} (reply {kind:#x})"))
}
