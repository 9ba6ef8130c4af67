//! One connection: the handshake, then requests until the client leaves,
//! breaks the protocol or runs out of time. Generic over the transport so
//! that the fuzz target drives it from memory.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::proto::*;
use super::{
    Export, Limits, MAX_EXTENTS, MAX_OPTION_LEN, MAX_OPTIONS, MAX_QUERIES, MAX_REQUEST,
    MAX_STATUS_CALLS, MetaContext, READ_PIECE,
};

/// A byte stream whose blocking calls can be bounded in time.
pub trait Transport: Read + Write {
    /// Bounds how long the next reads may block.
    fn set_read_limit(&mut self, limit: Duration) -> io::Result<()>;
    /// Bounds how long the next writes may block.
    fn set_write_limit(&mut self, limit: Duration) -> io::Result<()>;
}

impl Transport for UnixStream {
    fn set_read_limit(&mut self, limit: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(limit.max(Duration::from_millis(1))))
    }

    fn set_write_limit(&mut self, limit: Duration) -> io::Result<()> {
        self.set_write_timeout(Some(limit.max(Duration::from_millis(1))))
    }
}

/// How a connection ended.
#[derive(Debug)]
pub enum End {
    /// `NBD_CMD_DISC`.
    Disconnect,
    /// `NBD_OPT_ABORT`.
    Abort,
    /// The client closed the connection.
    Closed,
    /// A deadline passed.
    TimedOut,
    /// The client broke the protocol in a way that leaves the stream
    /// unusable (a bad magic, an unskippable payload).
    Protocol(String),
    /// The socket failed, or the export failed in the middle of a simple
    /// reply (the spec's hard disconnect).
    Io(io::Error),
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Disconnect => write!(f, "client disconnected"),
            End::Abort => write!(f, "client aborted the handshake"),
            End::Closed => write!(f, "client closed the connection"),
            End::TimedOut => write!(f, "client too slow: deadline passed"),
            End::Protocol(why) => write!(f, "protocol error: {why}"),
            End::Io(e) => write!(f, "I/O error: {e}"),
        }
    }
}

type Res<T> = Result<T, End>;

/// Room before the read buffer's data for a reply header, so that a header
/// and its data leave in one write.
const HDR_ROOM: usize = 32;

/// Serves one connection until it ends, and says how.
pub fn serve_connection<T: Transport>(io: T, export: &dyn Export, limits: &Limits) -> End {
    let mut offered = vec![MetaContext::Allocation];
    offered.extend(export.bitmaps().into_iter().map(MetaContext::DirtyBitmap));
    let mut s = Session {
        io,
        export,
        limits,
        size: export.size(),
        deadline: Instant::now() + limits.handshake,
        structured: false,
        offered,
        selected: Vec::new(),
        out: Vec::with_capacity(256),
        buf: Vec::new(),
    };
    match s.handshake() {
        Ok(()) => {}
        Err(end) => return end,
    }
    match s.transmission() {
        Ok(never) => match never {},
        Err(end) => end,
    }
}

/// Reads big-endian fields off an option's payload.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.bytes(4)
            .map(|b| u32::from_be_bytes(b.try_into().unwrap()))
    }
    /// A length-prefixed string of at most MAX_STRING bytes.
    fn string(&mut self) -> Option<&'a str> {
        let n = self.u32()? as usize;
        if n > MAX_STRING {
            return None;
        }
        std::str::from_utf8(self.bytes(n)?).ok()
    }
}

/// The reply to an option that failed: its type and a message.
struct OptError(u32, String);

fn invalid(what: &str) -> OptError {
    OptError(REP_ERR_INVALID, what.to_string())
}

struct Session<'a, T> {
    io: T,
    export: &'a dyn Export,
    limits: &'a Limits,
    size: u64,
    /// When the current phase (handshake, wait, request) must be over.
    deadline: Instant,
    structured: bool,
    /// Contexts the export offers; a context's id is its index.
    offered: Vec<MetaContext>,
    /// Ids of the contexts selected by the last SET_META_CONTEXT.
    selected: Vec<u32>,
    /// A reply being assembled.
    out: Vec<u8>,
    /// Read data, after HDR_ROOM bytes of room; allocated at the first read.
    buf: Vec<u8>,
}

impl<T: Transport> Session<'_, T> {
    fn left(&self) -> Res<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(End::TimedOut)
        } else {
            Ok(left)
        }
    }

    fn read_exact(&mut self, mut buf: &mut [u8]) -> Res<()> {
        while !buf.is_empty() {
            let left = self.left()?;
            self.io.set_read_limit(left).map_err(End::Io)?;
            match self.io.read(buf) {
                Ok(0) => return Err(End::Closed),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(End::TimedOut);
                }
                Err(e) => return Err(End::Io(e)),
            }
        }
        Ok(())
    }

    fn write_all(io: &mut T, deadline: Instant, mut buf: &[u8]) -> Res<()> {
        while !buf.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(End::TimedOut);
            }
            io.set_write_limit(left).map_err(End::Io)?;
            match io.write(buf) {
                Ok(0) => return Err(End::Closed),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(End::TimedOut);
                }
                Err(e) => return Err(End::Io(e)),
            }
        }
        Ok(())
    }

    /// Sends `self.out` and empties it.
    fn flush_out(&mut self) -> Res<()> {
        let r = Self::write_all(&mut self.io, self.deadline, &self.out);
        self.out.clear();
        r
    }

    /// Skips `n` bytes of input (an option's or a write's payload).
    fn skip(&mut self, mut n: u64) -> Res<()> {
        let mut scratch = [0u8; 4096];
        while n > 0 {
            let k = n.min(scratch.len() as u64) as usize;
            self.read_exact(&mut scratch[..k])?;
            n -= k as u64;
        }
        Ok(())
    }

    fn transmission_flags(&self) -> u16 {
        let mut f = FLAG_HAS_FLAGS | FLAG_READ_ONLY | FLAG_SEND_FLUSH | FLAG_CAN_MULTI_CONN;
        if self.structured {
            f |= FLAG_SEND_DF;
        }
        f
    }

    // ---- Handshake ----

    fn handshake(&mut self) -> Res<()> {
        self.out.extend_from_slice(&NBDMAGIC.to_be_bytes());
        self.out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        self.out
            .extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        self.flush_out()?;
        let mut cf = [0u8; 4];
        self.read_exact(&mut cf)?;
        let client_flags = u32::from_be_bytes(cf);
        if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return Err(End::Protocol(format!(
                "unknown client flags {client_flags:#x}"
            )));
        }
        let fixed = client_flags & FLAG_C_FIXED_NEWSTYLE != 0;
        let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;
        for _ in 0..MAX_OPTIONS {
            let mut h = [0u8; 16];
            self.read_exact(&mut h)?;
            let magic = u64::from_be_bytes(h[0..8].try_into().unwrap());
            let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
            let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
            if magic != IHAVEOPT {
                return Err(End::Protocol(format!("bad option magic {magic:#x}")));
            }
            if !fixed && opt != OPT_EXPORT_NAME {
                return Err(End::Protocol(format!(
                    "option {opt} from a client without fixed newstyle"
                )));
            }
            if len > MAX_OPTION_LEN {
                return Err(End::Protocol(format!(
                    "option {opt} of {len} bytes (at most {MAX_OPTION_LEN})"
                )));
            }
            let mut data = vec![0u8; len as usize];
            self.read_exact(&mut data)?;
            match opt {
                OPT_EXPORT_NAME => {
                    if !data.is_empty() {
                        return Err(End::Protocol(
                            "NBD_OPT_EXPORT_NAME of an unknown export (only \"\" is served)".into(),
                        ));
                    }
                    self.out.extend_from_slice(&self.size.to_be_bytes());
                    self.out
                        .extend_from_slice(&self.transmission_flags().to_be_bytes());
                    if !no_zeroes {
                        self.out.extend_from_slice(&[0u8; 124]);
                    }
                    return self.flush_out();
                }
                OPT_ABORT => {
                    // The client may already be gone: its problem.
                    let _ = self.option_reply(opt, REP_ACK, &[]);
                    return Err(End::Abort);
                }
                _ => {}
            }
            let result = match opt {
                OPT_LIST => self.opt_list(&data)?,
                OPT_INFO | OPT_GO => self.opt_info(opt, &data)?,
                OPT_STRUCTURED_REPLY => {
                    if data.is_empty() {
                        self.structured = true;
                        Ok(())
                    } else {
                        Err(invalid("NBD_OPT_STRUCTURED_REPLY takes no data"))
                    }
                }
                OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.opt_meta(opt, &data)?,
                _ => Err(OptError(
                    REP_ERR_UNSUP,
                    format!("option {opt} is not supported"),
                )),
            };
            match result {
                Ok(()) => {
                    self.option_reply(opt, REP_ACK, &[])?;
                    if opt == OPT_GO {
                        return Ok(());
                    }
                }
                Err(OptError(rep, msg)) => self.option_reply(opt, rep, msg.as_bytes())?,
            }
        }
        Err(End::Protocol(format!(
            "more than {MAX_OPTIONS} options in one handshake"
        )))
    }

    fn option_reply(&mut self, opt: u32, rep: u32, data: &[u8]) -> Res<()> {
        self.out.extend_from_slice(&REP_MAGIC.to_be_bytes());
        self.out.extend_from_slice(&opt.to_be_bytes());
        self.out.extend_from_slice(&rep.to_be_bytes());
        self.out
            .extend_from_slice(&(data.len() as u32).to_be_bytes());
        self.out.extend_from_slice(data);
        self.flush_out()
    }

    fn opt_list(&mut self, data: &[u8]) -> Res<Result<(), OptError>> {
        if !data.is_empty() {
            return Ok(Err(invalid("NBD_OPT_LIST takes no data")));
        }
        // One export, the default: a name of length 0.
        self.option_reply(OPT_LIST, REP_SERVER, &0u32.to_be_bytes())?;
        Ok(Ok(()))
    }

    fn unknown_export(name: &str) -> OptError {
        OptError(
            REP_ERR_UNKNOWN,
            format!(
                "no export '{}': the backup is the default export \"\"",
                name.escape_debug()
            ),
        )
    }

    /// NBD_OPT_INFO and NBD_OPT_GO: the outer error ends the connection,
    /// the inner one is the option's error reply.
    fn opt_info(&mut self, opt: u32, data: &[u8]) -> Res<Result<(), OptError>> {
        let (name, wanted) = match Self::parse_info(data) {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        if !name.is_empty() {
            return Ok(Err(Self::unknown_export(name)));
        }
        let mut export = Vec::with_capacity(12);
        export.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        export.extend_from_slice(&self.size.to_be_bytes());
        export.extend_from_slice(&self.transmission_flags().to_be_bytes());
        self.option_reply(opt, REP_INFO, &export)?;
        for info in wanted {
            let mut r = info.to_be_bytes().to_vec();
            match info {
                INFO_NAME => {}
                INFO_DESCRIPTION => {
                    let mut d = self.export.description();
                    d.truncate(MAX_STRING);
                    r.extend_from_slice(d.as_bytes());
                }
                INFO_BLOCK_SIZE => {
                    for v in [1u32, 4096, MAX_REQUEST] {
                        r.extend_from_slice(&v.to_be_bytes());
                    }
                }
                _ => continue,
            }
            self.option_reply(opt, REP_INFO, &r)?;
        }
        Ok(Ok(()))
    }

    /// An INFO or GO payload: the export name and the information asked
    /// for (sorted, once each).
    fn parse_info(data: &[u8]) -> Result<(&str, Vec<u16>), OptError> {
        let mut c = Cursor(data);
        let name = c
            .string()
            .ok_or_else(|| invalid("bad export name length"))?;
        let n = c
            .u16()
            .ok_or_else(|| invalid("missing information count"))?;
        let mut wanted = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            wanted.push(c.u16().ok_or_else(|| invalid("short information list"))?);
        }
        if !c.0.is_empty() {
            return Err(invalid("trailing bytes"));
        }
        wanted.sort_unstable();
        wanted.dedup();
        Ok((name, wanted))
    }

    /// The contexts a query names. For LIST, `base:`, `qemu:` and
    /// `qemu:dirty-bitmap:` are wildcards, as in QEMU; SET takes exact
    /// names only. A query of an unknown namespace names nothing.
    fn matches(&self, query: &str, list: bool) -> Result<Vec<u32>, OptError> {
        if !query.contains(':') {
            return Err(invalid("a query must start with a namespace and a colon"));
        }
        let ids = self.offered.iter().enumerate().filter_map(|(i, ctx)| {
            let name = ctx.name();
            let hit = name == query
                || (list
                    && match ctx {
                        MetaContext::Allocation => query == "base:",
                        MetaContext::DirtyBitmap(_) => {
                            query == "qemu:" || query == CONTEXT_BITMAP_PREFIX
                        }
                    });
            hit.then_some(i as u32)
        });
        Ok(ids.collect())
    }

    /// LIST_META_CONTEXT and SET_META_CONTEXT, errors as for
    /// [`opt_info`](Self::opt_info).
    fn opt_meta(&mut self, opt: u32, data: &[u8]) -> Res<Result<(), OptError>> {
        let set = opt == OPT_SET_META_CONTEXT;
        if set {
            // Replaced even when the option fails.
            self.selected.clear();
        }
        let ids = match self.meta_ids(set, data) {
            Ok(ids) => ids,
            Err(e) => return Ok(Err(e)),
        };
        for &id in &ids {
            let mut r = (if set { id } else { 0 }).to_be_bytes().to_vec();
            r.extend_from_slice(self.offered[id as usize].name().as_bytes());
            self.option_reply(opt, REP_META_CONTEXT, &r)?;
        }
        if set {
            self.selected = ids;
        }
        Ok(Ok(()))
    }

    /// The ids of the contexts a LIST or SET option names.
    fn meta_ids(&self, set: bool, data: &[u8]) -> Result<Vec<u32>, OptError> {
        if !self.structured {
            return Err(invalid(
                "metadata contexts need NBD_OPT_STRUCTURED_REPLY first",
            ));
        }
        let mut c = Cursor(data);
        let name = c
            .string()
            .ok_or_else(|| invalid("bad export name length"))?;
        let n = c.u32().ok_or_else(|| invalid("missing query count"))?;
        if n > MAX_QUERIES {
            return Err(OptError(
                REP_ERR_TOO_BIG,
                format!("{n} queries (at most {MAX_QUERIES})"),
            ));
        }
        let mut queries = Vec::with_capacity(n as usize);
        for _ in 0..n {
            queries.push(c.string().ok_or_else(|| invalid("bad query length"))?);
        }
        if !c.0.is_empty() {
            return Err(invalid("trailing bytes"));
        }
        if !name.is_empty() {
            return Err(Self::unknown_export(name));
        }
        let mut ids = Vec::new();
        if queries.is_empty() {
            if !set {
                ids = (0..self.offered.len() as u32).collect();
            }
        } else {
            for q in queries {
                ids.extend(self.matches(q, !set)?);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    // ---- Transmission ----

    fn transmission(&mut self) -> Res<std::convert::Infallible> {
        loop {
            self.deadline = Instant::now() + self.limits.idle;
            let mut h = [0u8; REQUEST_LEN];
            self.read_exact(&mut h)?;
            self.deadline = Instant::now() + self.limits.io;
            let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
            if magic != REQUEST_MAGIC {
                return Err(End::Protocol(format!("bad request magic {magic:#x}")));
            }
            let flags = u16::from_be_bytes([h[4], h[5]]);
            let cmd = u16::from_be_bytes([h[6], h[7]]);
            let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
            let offset = u64::from_be_bytes(h[16..24].try_into().unwrap());
            let len = u32::from_be_bytes(h[24..28].try_into().unwrap());
            let in_range = offset
                .checked_add(u64::from(len))
                .is_some_and(|end| end <= self.size);
            match cmd {
                CMD_READ => {
                    let allowed = CMD_FLAG_FUA | if self.structured { CMD_FLAG_DF } else { 0 };
                    if flags & !allowed != 0 {
                        self.error(handle, EINVAL, "unknown flags for NBD_CMD_READ")?;
                    } else if len > MAX_REQUEST {
                        self.error(handle, EINVAL, "read longer than 32 MiB")?;
                    } else if !in_range {
                        self.error(handle, EINVAL, "read past the end of the export")?;
                    } else if self.structured {
                        self.read_structured(handle, offset, len)?;
                    } else {
                        self.read_simple(handle, offset, len)?;
                    }
                }
                CMD_WRITE => {
                    if len > MAX_REQUEST {
                        return Err(End::Protocol(format!(
                            "write of {len} bytes to a read-only export"
                        )));
                    }
                    self.skip(u64::from(len))?;
                    self.error(handle, EPERM, "the export is read-only")?;
                }
                CMD_TRIM | CMD_WRITE_ZEROES => {
                    self.error(handle, EPERM, "the export is read-only")?
                }
                CMD_DISC => return Err(End::Disconnect),
                CMD_FLUSH => {
                    if flags & !CMD_FLAG_FUA != 0 {
                        self.error(handle, EINVAL, "unknown flags for NBD_CMD_FLUSH")?;
                    } else {
                        self.simple(handle, 0)?;
                    }
                }
                CMD_BLOCK_STATUS => {
                    if !self.structured || self.selected.is_empty() {
                        self.error(handle, EINVAL, "no metadata context was selected")?;
                    } else if flags & !(CMD_FLAG_FUA | CMD_FLAG_REQ_ONE) != 0 {
                        self.error(handle, EINVAL, "unknown flags for NBD_CMD_BLOCK_STATUS")?;
                    } else if len == 0 || !in_range {
                        self.error(
                            handle,
                            EINVAL,
                            "block status of an empty range or past the end",
                        )?;
                    } else {
                        self.block_status(handle, offset, len, flags & CMD_FLAG_REQ_ONE != 0)?;
                    }
                }
                _ => self.error(handle, EINVAL, "unknown command")?,
            }
        }
    }

    fn simple(&mut self, handle: u64, error: u32) -> Res<()> {
        self.out
            .extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        self.out.extend_from_slice(&error.to_be_bytes());
        self.out.extend_from_slice(&handle.to_be_bytes());
        self.flush_out()
    }

    fn chunk_header(out: &mut Vec<u8>, flags: u16, ty: u16, handle: u64, len: u32) {
        out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&handle.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
    }

    /// An error reply: an error chunk with a message when structured
    /// replies are on, a simple reply otherwise.
    fn error(&mut self, handle: u64, error: u32, msg: &str) -> Res<()> {
        if !self.structured {
            return self.simple(handle, error);
        }
        Self::chunk_header(
            &mut self.out,
            REPLY_FLAG_DONE,
            REPLY_TYPE_ERROR,
            handle,
            6 + msg.len() as u32,
        );
        self.out.extend_from_slice(&error.to_be_bytes());
        self.out
            .extend_from_slice(&(msg.len() as u16).to_be_bytes());
        self.out.extend_from_slice(msg.as_bytes());
        self.flush_out()
    }

    fn piece(&mut self) -> &mut [u8] {
        if self.buf.is_empty() {
            self.buf = vec![0u8; HDR_ROOM + READ_PIECE];
        }
        &mut self.buf[HDR_ROOM..]
    }

    /// Reads `len` bytes at `offset` into the buffer's data part.
    fn fill(&mut self, offset: u64, len: usize) -> io::Result<()> {
        let export = self.export;
        export.read(offset, &mut self.piece()[..len])
    }

    /// Sends `hdr` and `len` bytes of data as one write.
    fn send_with_header(&mut self, hdr_len: usize, len: usize) -> Res<()> {
        let start = HDR_ROOM - hdr_len;
        self.buf[start..HDR_ROOM].copy_from_slice(&self.out[..hdr_len]);
        self.out.clear();
        Self::write_all(
            &mut self.io,
            self.deadline,
            &self.buf[start..HDR_ROOM + len],
        )
    }

    /// A structured read reply: one data chunk, streamed a piece at a
    /// time from the export so the buffer stays at 1 MiB whatever `len`.
    fn read_structured(&mut self, handle: u64, offset: u64, len: u32) -> Res<()> {
        if len == 0 {
            Self::chunk_header(&mut self.out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, handle, 0);
            return self.flush_out();
        }
        let total = len as usize;
        if total <= READ_PIECE {
            // Read first, so the one chunk can say it is the last.
            if let Err(e) = self.fill(offset, total) {
                return self.error(handle, EIO, &format!("read failed: {e}"));
            }
            Self::chunk_header(
                &mut self.out,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                handle,
                8 + len,
            );
            self.out.extend_from_slice(&offset.to_be_bytes());
            return self.send_with_header(28, total);
        }
        Self::chunk_header(&mut self.out, 0, REPLY_TYPE_OFFSET_DATA, handle, 8 + len);
        self.out.extend_from_slice(&offset.to_be_bytes());
        let mut failed: Option<(u64, io::Error)> = None;
        let mut done = 0usize;
        while done < total {
            let n = (total - done).min(READ_PIECE);
            let at = offset + done as u64;
            if failed.is_none()
                && let Err(e) = self.fill(at, n)
            {
                failed = Some((at, e));
            }
            if failed.is_some() {
                // The chunk was promised whole: pad it with zeroes.
                self.piece()[..n].fill(0);
            }
            let hdr = if done == 0 { 28 } else { 0 };
            self.send_with_header(hdr, n)?;
            done += n;
        }
        match failed {
            None => {
                Self::chunk_header(&mut self.out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, handle, 0);
            }
            Some((at, e)) => {
                let msg = format!("read failed: {e}");
                Self::chunk_header(
                    &mut self.out,
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_ERROR_OFFSET,
                    handle,
                    14 + msg.len() as u32,
                );
                self.out.extend_from_slice(&EIO.to_be_bytes());
                self.out
                    .extend_from_slice(&(msg.len() as u16).to_be_bytes());
                self.out.extend_from_slice(msg.as_bytes());
                self.out.extend_from_slice(&at.to_be_bytes());
            }
        }
        self.flush_out()
    }

    /// A simple read reply: the header says success before all the data
    /// is read, so an export error after the first piece can only end the
    /// connection (the spec's hard disconnect).
    fn read_simple(&mut self, handle: u64, offset: u64, len: u32) -> Res<()> {
        let total = len as usize;
        let first = total.min(READ_PIECE);
        if let Err(e) = self.fill(offset, first) {
            log::debug!("nbd: read at {offset} failed: {e}");
            return self.simple(handle, EIO);
        }
        self.out
            .extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        self.out.extend_from_slice(&0u32.to_be_bytes());
        self.out.extend_from_slice(&handle.to_be_bytes());
        self.send_with_header(16, first)?;
        let mut done = first;
        while done < total {
            let n = (total - done).min(READ_PIECE);
            self.fill(offset + done as u64, n).map_err(End::Io)?;
            self.send_with_header(0, n)?;
            done += n;
        }
        Ok(())
    }

    /// The extents of one context over `[offset, offset + len)`, merged
    /// where neighbours share a status.
    fn extents(
        &self,
        ctx: &MetaContext,
        offset: u64,
        len: u32,
        max: usize,
    ) -> io::Result<Vec<(u32, u32)>> {
        let end = offset + u64::from(len);
        let mut out: Vec<(u32, u32)> = Vec::new();
        let mut pos = offset;
        // Each call's work is bounded by the export; the calls are bounded
        // here, so a reply may cover less than was asked (the spec allows
        // it: the client asks again from where it stops).
        for _ in 0..MAX_STATUS_CALLS {
            if pos >= end {
                break;
            }
            let (n, flags) = self.export.block_status(ctx, pos, end - pos)?;
            if n == 0 {
                return Err(io::Error::other("the export reported an empty extent"));
            }
            let n = n.min(end - pos);
            // n ≤ len, and the sum stays ≤ len, a u32.
            if let Some(last) = out.last_mut()
                && last.1 == flags
            {
                last.0 += n as u32;
            } else if out.len() == max {
                break;
            } else {
                out.push((n as u32, flags));
            }
            pos += n;
        }
        Ok(out)
    }

    fn block_status(&mut self, handle: u64, offset: u64, len: u32, req_one: bool) -> Res<()> {
        let max = if req_one { 1 } else { MAX_EXTENTS };
        let mut replies = Vec::with_capacity(self.selected.len());
        for &id in &self.selected {
            match self.extents(&self.offered[id as usize], offset, len, max) {
                Ok(e) => replies.push((id, e)),
                Err(e) => return self.error(handle, EIO, &format!("block status failed: {e}")),
            }
        }
        let last = replies.len() - 1;
        for (i, (id, extents)) in replies.into_iter().enumerate() {
            let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
            let plen = 4 + 8 * extents.len() as u32;
            Self::chunk_header(&mut self.out, flags, REPLY_TYPE_BLOCK_STATUS, handle, plen);
            self.out.extend_from_slice(&id.to_be_bytes());
            for (n, f) in extents {
                self.out.extend_from_slice(&n.to_be_bytes());
                self.out.extend_from_slice(&f.to_be_bytes());
            }
        }
        self.flush_out()
    }
}
