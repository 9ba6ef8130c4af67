//! The logic of the `nbd` fuzz target (`fuzz/fuzz_targets/nbd.rs`), kept in
//! the crate so that `tests/layers/fuzz_corpus.rs` replays its corpus with a plain
//! `cargo test`.
//!
//! The input steers a generator of client streams rather than being one:
//! mostly well-formed sessions (client flags, options of every kind, GO or
//! EXPORT_NAME, then requests of every kind, some past the end or with
//! odd flags), so most inputs reach transmission. About one message in 32
//! gets a byte flipped. The session is served from memory, and its output
//! is parsed as a client would: for an uncorrupted stream every reply must
//! be well formed, answer its option or request in order, and read data
//! must be the export's.

use std::collections::BTreeSet;
use std::io::{self, Read, Write};
use std::time::Duration;

use super::proto::*;
use super::{End, Export, Limits, MAX_EXTENTS, MetaContext, READ_PIECE, Transport};

/// Reads the fuzz input; zeroes past its end.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }
    fn below(&mut self, n: u32) -> u32 {
        if n <= 256 {
            u32::from(self.byte()) % n
        } else {
            self.u32() % n
        }
    }
}

/// The fuzz export: content a function of the offset, allocation in
/// 64 KiB runs, one bitmap.
struct Fake {
    size: u64,
}

impl Fake {
    fn byte_at(off: u64) -> u8 {
        (off.wrapping_mul(7) ^ (off >> 9)) as u8
    }
}

impl Export for Fake {
    fn size(&self) -> u64 {
        self.size
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        assert!(
            buf.len() <= READ_PIECE && offset + buf.len() as u64 <= self.size,
            "read outside the export or over a piece: {offset}+{}",
            buf.len()
        );
        if offset % 65536 == 4096 {
            return Err(io::Error::other("injected read error"));
        }
        for (i, b) in buf.iter_mut().enumerate() {
            *b = Fake::byte_at(offset + i as u64);
        }
        Ok(())
    }
    fn bitmaps(&self) -> Vec<String> {
        vec!["b0".into()]
    }
    fn block_status(&self, ctx: &MetaContext, offset: u64, max: u64) -> io::Result<(u64, u32)> {
        assert!(offset < self.size && max > 0 && offset + max <= self.size);
        let run = (65536 - offset % 65536).min(max);
        let k = offset / 65536;
        Ok(match ctx {
            MetaContext::Allocation => (
                run,
                if k % 2 == 1 {
                    STATE_HOLE | STATE_ZERO
                } else {
                    0
                },
            ),
            MetaContext::DirtyBitmap(_) => (run, u32::from(k.is_multiple_of(3))),
        })
    }
}

/// A session in memory: the generated client stream in, the server's out.
struct Mem {
    input: Vec<u8>,
    pos: usize,
    output: Vec<u8>,
}

impl Read for Mem {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.input.len() - self.pos);
        buf[..n].copy_from_slice(&self.input[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for Mem {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for Mem {
    fn set_read_limit(&mut self, _: Duration) -> io::Result<()> {
        Ok(())
    }
    fn set_write_limit(&mut self, _: Duration) -> io::Result<()> {
        Ok(())
    }
}

/// What the client sent, to check the replies against.
enum Sent {
    Option(u32),
    ExportName,
    Request {
        cmd: u16,
        flags: u16,
        handle: u64,
        offset: u64,
        len: u32,
    },
}

const QUERIES: [&str; 6] = [
    "base:allocation",
    "qemu:dirty-bitmap:b0",
    "qemu:dirty-bitmap:zz",
    "base:",
    "qemu:",
    "x-other:thing",
];

fn option_msg(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fn meta_data(input: &mut Input<'_>) -> Vec<u8> {
    let mut d = 0u32.to_be_bytes().to_vec();
    let n = input.below(4);
    d.extend_from_slice(&n.to_be_bytes());
    for _ in 0..n {
        let q = QUERIES[input.below(QUERIES.len() as u32) as usize];
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// Builds a client stream; returns it, what it holds, and whether a byte
/// of it was corrupted.
fn generate(input: &mut Input<'_>, size: u64) -> (Vec<u8>, Vec<Sent>, bool, u32) {
    let mut stream = Vec::new();
    let mut sent = Vec::new();
    let mut corrupted = false;
    let flags = match input.below(16) {
        0..=12 => FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES,
        13 => FLAG_C_FIXED_NEWSTYLE,
        14 => 0,
        _ => input.u32(),
    };
    stream.extend_from_slice(&flags.to_be_bytes());
    let mut msg = Vec::new();
    let mut finish = |stream: &mut Vec<u8>, msg: &mut Vec<u8>, input: &mut Input<'_>| {
        if input.below(32) == 0 && !msg.is_empty() {
            let i = input.below(msg.len() as u32) as usize;
            msg[i] ^= 1 << input.below(8);
            corrupted = true;
        }
        stream.append(msg);
    };
    for _ in 0..input.below(8) {
        let opt = match input.below(10) {
            0 | 7..=9 => {
                option_msg(&mut msg, OPT_STRUCTURED_REPLY, &[]);
                OPT_STRUCTURED_REPLY
            }
            1 => {
                option_msg(&mut msg, OPT_SET_META_CONTEXT, &meta_data(input));
                OPT_SET_META_CONTEXT
            }
            2 => {
                option_msg(&mut msg, OPT_LIST_META_CONTEXT, &meta_data(input));
                OPT_LIST_META_CONTEXT
            }
            3 => {
                option_msg(&mut msg, OPT_LIST, &[]);
                OPT_LIST
            }
            4 => {
                let mut d = 0u32.to_be_bytes().to_vec();
                let n = input.below(5) as u16;
                d.extend_from_slice(&n.to_be_bytes());
                for _ in 0..n {
                    d.extend_from_slice(&(input.below(5) as u16).to_be_bytes());
                }
                option_msg(&mut msg, OPT_INFO, &d);
                OPT_INFO
            }
            5 => {
                let opt = 12 + input.below(100);
                let len = input.below(64) as usize;
                option_msg(&mut msg, opt, &vec![0xab; len]);
                opt
            }
            _ => {
                option_msg(&mut msg, OPT_ABORT, &[]);
                OPT_ABORT
            }
        };
        finish(&mut stream, &mut msg, input);
        sent.push(Sent::Option(opt));
        if opt == OPT_ABORT {
            return (stream, sent, corrupted, flags);
        }
    }
    if input.below(8) == 0 {
        option_msg(&mut msg, OPT_EXPORT_NAME, &[]);
        sent.push(Sent::ExportName);
    } else {
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        option_msg(&mut msg, OPT_GO, &d);
        sent.push(Sent::Option(OPT_GO));
    }
    finish(&mut stream, &mut msg, input);
    for handle in 0..u64::from(input.below(16)) {
        let cmd = match input.below(12) {
            0..=3 => CMD_READ,
            4..=6 => CMD_BLOCK_STATUS,
            7 => CMD_WRITE,
            8 => CMD_FLUSH,
            9 => CMD_TRIM,
            10 => CMD_WRITE_ZEROES,
            _ => 5 + input.below(20) as u16 * 3,
        };
        let flags = match input.below(8) {
            0 => CMD_FLAG_REQ_ONE,
            1 => CMD_FLAG_DF,
            2 => input.below(65536) as u16,
            _ => 0,
        };
        let blocks = size / 512;
        let (offset, len) = match input.below(8) {
            0 => (u64::from(input.u32()), input.u32()),
            1 => (size - 512, 1024),
            2 => (0, 0),
            _ => {
                let o = u64::from(input.below(blocks as u32)) * 512;
                let l = (u64::from(input.below(4096)) * 512 + 1).min(size - o) as u32;
                (o, l)
            }
        };
        // Writes carry their payload: only small ones, so that the stream
        // stays in step.
        let len = if cmd == CMD_WRITE { len.min(4096) } else { len };
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&flags.to_be_bytes());
        msg.extend_from_slice(&cmd.to_be_bytes());
        msg.extend_from_slice(&handle.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        if cmd == CMD_WRITE {
            msg.extend(std::iter::repeat_n(0xee, len as usize));
        }
        finish(&mut stream, &mut msg, input);
        sent.push(Sent::Request {
            cmd,
            flags,
            handle,
            offset,
            len,
        });
    }
    if input.below(4) != 0 {
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&[0, 0]);
        msg.extend_from_slice(&CMD_DISC.to_be_bytes());
        msg.extend_from_slice(&[0; 20]);
        stream.append(&mut msg);
    }
    (stream, sent, corrupted, flags)
}

fn opt_name(opt: u32) -> String {
    match opt {
        OPT_LIST => "list".into(),
        OPT_INFO => "info".into(),
        OPT_GO => "go".into(),
        OPT_STRUCTURED_REPLY => "structured".into(),
        OPT_LIST_META_CONTEXT => "list-meta".into(),
        OPT_SET_META_CONTEXT => "set-meta".into(),
        OPT_ABORT => "abort".into(),
        _ => "unknown-option".into(),
    }
}

fn cmd_name(cmd: u16) -> &'static str {
    match cmd {
        CMD_READ => "read",
        CMD_WRITE => "write",
        CMD_FLUSH => "flush",
        CMD_TRIM => "trim",
        CMD_WRITE_ZEROES => "write-zeroes",
        CMD_BLOCK_STATUS => "block-status",
        _ => "unknown-command",
    }
}

/// Reads the server's output.
struct Out<'a>(&'a [u8]);

impl Out<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        assert!(
            self.0.len() >= n,
            "output ends {} bytes short",
            n - self.0.len()
        );
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.take(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take(8).try_into().unwrap())
    }
}

/// Runs one fuzz input; returns what the session came to (for the corpus
/// replay's coverage check). Panics on a broken promise.
pub fn session_one(data: &[u8]) -> BTreeSet<String> {
    let mut input = Input(data);
    let size = 512 * (1 + u64::from(input.below(8192)));
    let export = Fake { size };
    let (stream, sent, corrupted, flags) = generate(&mut input, size);
    let limits = Limits {
        max_connections: 1,
        handshake: Duration::from_secs(3600),
        idle: Duration::from_secs(3600),
        io: Duration::from_secs(3600),
    };
    let mut mem = Mem {
        input: stream,
        pos: 0,
        output: Vec::new(),
    };
    let end = super::serve_connection(&mut mem, &export, &limits);
    let mut seen = BTreeSet::new();
    seen.insert(
        match &end {
            End::Disconnect => "end:disconnect",
            End::Abort => "end:abort",
            End::Closed => "end:closed",
            End::TimedOut => panic!("a session in memory timed out"),
            End::Protocol(_) => "end:protocol",
            End::Io(e) => panic!("a session in memory failed: {e}"),
        }
        .to_string(),
    );
    if corrupted {
        seen.insert("corrupted".into());
    } else {
        check(&mem.output, &sent, flags, &export, &mut seen);
    }
    seen
}

impl Transport for &mut Mem {
    fn set_read_limit(&mut self, d: Duration) -> io::Result<()> {
        (**self).set_read_limit(d)
    }
    fn set_write_limit(&mut self, d: Duration) -> io::Result<()> {
        (**self).set_write_limit(d)
    }
}

/// Checks an uncorrupted session's output against what was sent.
fn check(output: &[u8], sent: &[Sent], flags: u32, export: &Fake, seen: &mut BTreeSet<String>) {
    let mut out = Out(output);
    assert_eq!(out.u64(), NBDMAGIC);
    assert_eq!(out.u64(), IHAVEOPT);
    assert_eq!(out.u16(), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    if flags & !3 != 0 {
        assert!(out.0.is_empty(), "unknown client flags not refused");
        seen.insert("bad-client-flags".into());
        return;
    }
    let fixed = flags & FLAG_C_FIXED_NEWSTYLE != 0;
    let mut structured = false;
    let mut contexts: Vec<(u32, String)> = Vec::new();
    let mut transmission = false;
    for s in sent {
        match s {
            Sent::Option(opt) if !transmission => {
                if !fixed {
                    assert!(
                        out.0.is_empty(),
                        "option {opt} of a non-fixed client answered"
                    );
                    seen.insert("non-fixed-refused".into());
                    return;
                }
                let mut got_export = false;
                let mut new_contexts = Vec::new();
                loop {
                    assert_eq!(out.u64(), REP_MAGIC);
                    assert_eq!(out.u32(), *opt, "reply to another option");
                    let ty = out.u32();
                    let len = out.u32() as usize;
                    let data = out.take(len).to_vec();
                    match ty {
                        REP_SERVER => assert_eq!(data, [0, 0, 0, 0]),
                        REP_INFO => {
                            let info = u16::from_be_bytes([data[0], data[1]]);
                            if info == INFO_EXPORT {
                                assert_eq!(data.len(), 12);
                                assert_eq!(
                                    u64::from_be_bytes(data[2..10].try_into().unwrap()),
                                    export.size
                                );
                                let tf = u16::from_be_bytes([data[10], data[11]]);
                                assert!(tf & FLAG_READ_ONLY != 0);
                                got_export = true;
                            }
                        }
                        REP_META_CONTEXT => {
                            let id = u32::from_be_bytes(data[0..4].try_into().unwrap());
                            let name = String::from_utf8(data[4..].to_vec()).unwrap();
                            assert!(
                                name == CONTEXT_ALLOCATION || name == "qemu:dirty-bitmap:b0",
                                "context {name}"
                            );
                            new_contexts.push((id, name));
                        }
                        REP_ACK => {
                            seen.insert(format!("{}:ack", opt_name(*opt)));
                            break;
                        }
                        t if t & (1 << 31) != 0 => {
                            assert!(
                                [
                                    REP_ERR_UNSUP,
                                    REP_ERR_INVALID,
                                    REP_ERR_UNKNOWN,
                                    REP_ERR_TOO_BIG
                                ]
                                .contains(&t),
                                "error reply {t:#x}"
                            );
                            if *opt == OPT_SET_META_CONTEXT {
                                contexts.clear();
                            }
                            seen.insert(format!("{}:err{}", opt_name(*opt), t & 0xff));
                            new_contexts.clear();
                            got_export = true;
                            break;
                        }
                        t => panic!("unknown option reply type {t}"),
                    }
                }
                assert!(
                    got_export || !matches!(*opt, OPT_GO | OPT_INFO),
                    "INFO_EXPORT missing"
                );
                match *opt {
                    OPT_STRUCTURED_REPLY => structured = true,
                    OPT_SET_META_CONTEXT => contexts = new_contexts,
                    OPT_ABORT => {
                        assert!(out.0.is_empty());
                        return;
                    }
                    OPT_GO => transmission = true,
                    _ => {}
                }
            }
            Sent::ExportName => {
                assert_eq!(out.u64(), export.size);
                assert!(out.u16() & FLAG_READ_ONLY != 0);
                if flags & FLAG_C_NO_ZEROES == 0 {
                    assert_eq!(out.take(124), [0u8; 124]);
                }
                seen.insert("export-name".into());
                transmission = true;
            }
            Sent::Request { .. } if !transmission => break,
            Sent::Request {
                cmd,
                flags,
                handle,
                offset,
                len,
            } => check_reply(
                &mut out,
                (*cmd, *flags, *handle, *offset, *len),
                structured,
                &contexts,
                seen,
            ),
            Sent::Option(_) => unreachable!(),
        }
    }
    assert!(
        out.0.is_empty(),
        "{} bytes of output left over",
        out.0.len()
    );
}

fn check_reply(
    out: &mut Out<'_>,
    (cmd, flags, handle, offset, len): (u16, u16, u64, u64, u32),
    structured: bool,
    contexts: &[(u32, String)],
    seen: &mut BTreeSet<String>,
) {
    let magic = out.u32();
    if magic == SIMPLE_REPLY_MAGIC {
        let error = out.u32();
        assert_eq!(out.u64(), handle);
        if cmd == CMD_READ && error == 0 {
            assert!(
                !structured,
                "a simple reply to a read with structured replies on"
            );
            let data = out.take(len as usize);
            for (i, &b) in data.iter().enumerate() {
                assert_eq!(
                    b,
                    Fake::byte_at(offset + i as u64),
                    "read data at {}",
                    offset + i as u64
                );
            }
        }
        assert!(
            !(cmd == CMD_BLOCK_STATUS && error == 0),
            "block status in a simple reply"
        );
        seen.insert(format!("{}:simple:{error}", cmd_name(cmd)));
        return;
    }
    assert!(structured, "a structured reply without negotiation");
    assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
    let mut covered = 0u64;
    let mut statuses = 0;
    let mut first = true;
    let mut chunks = Vec::new();
    let mut errored = false;
    loop {
        if !first {
            assert_eq!(out.u32(), STRUCTURED_REPLY_MAGIC);
        }
        first = false;
        let cflags = out.u16();
        let ty = out.u16();
        assert_eq!(out.u64(), handle);
        let plen = out.u32() as usize;
        let payload = out.take(plen).to_vec();
        match ty {
            REPLY_TYPE_NONE => assert_eq!(plen, 0),
            REPLY_TYPE_OFFSET_DATA => {
                assert_eq!(cmd, CMD_READ);
                let o = u64::from_be_bytes(payload[0..8].try_into().unwrap());
                let n = (plen - 8) as u64;
                assert!(n > 0 && o >= offset && o + n <= offset + u64::from(len));
                covered += n;
                chunks.push((o, payload[8..].to_vec()));
                seen.insert("read:data".into());
            }
            REPLY_TYPE_BLOCK_STATUS => {
                assert_eq!(cmd, CMD_BLOCK_STATUS);
                let id = u32::from_be_bytes(payload[0..4].try_into().unwrap());
                assert!(
                    contexts.iter().any(|c| c.0 == id),
                    "unknown context id {id}"
                );
                let descs = &payload[4..];
                assert!(!descs.is_empty() && descs.len().is_multiple_of(8));
                let n = descs.len() / 8;
                assert!(n <= MAX_EXTENTS && (flags & CMD_FLAG_REQ_ONE == 0 || n == 1));
                let sum: u64 = descs
                    .chunks(8)
                    .map(|d| u64::from(u32::from_be_bytes(d[0..4].try_into().unwrap())))
                    .inspect(|&l| assert!(l > 0, "empty extent"))
                    .sum();
                assert!(sum <= u64::from(len), "extents past the request");
                statuses += 1;
                seen.insert("block-status".into());
            }
            REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                let mlen = usize::from(u16::from_be_bytes([payload[4], payload[5]]));
                let extra = if ty == REPLY_TYPE_ERROR { 6 } else { 14 };
                assert_eq!(plen, extra + mlen);
                let error = u32::from_be_bytes(payload[0..4].try_into().unwrap());
                seen.insert(format!("{}:error:{error}", cmd_name(cmd)));
                covered = u64::from(len);
                statuses = contexts.len();
                errored = true;
            }
            t => panic!("unknown chunk type {t}"),
        }
        if cflags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    if cmd == CMD_READ {
        assert!(
            covered >= u64::from(len),
            "read reply covers {covered} of {len}"
        );
        if !errored {
            assert_eq!(covered, u64::from(len), "chunks overlap");
            for (o, data) in chunks {
                for (i, &b) in data.iter().enumerate() {
                    assert_eq!(
                        b,
                        Fake::byte_at(o + i as u64),
                        "read data at {}",
                        o + i as u64
                    );
                }
            }
        }
    }
    if cmd == CMD_BLOCK_STATUS {
        assert_eq!(statuses, contexts.len(), "one chunk per context");
    }
}

/// The logic of the `nbd_client` fuzz target (`fuzz/fuzz_targets/nbd_client.rs`):
/// `data` is everything a server sends. The client's handshake, a block
/// status and a read must each end in an answer or an error, never a
/// panic, and what they hand back must be what was asked (a read's length,
/// runs that are not empty). Returns what the session reached, for the
/// corpus replay to check.
pub fn client_one(data: &[u8]) -> Vec<&'static str> {
    /// The server's bytes, from memory; what the client sends is dropped.
    struct Replay<'a>(&'a [u8]);
    impl Read for Replay<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }
    impl Write for Replay<'_> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let bitmap = format!("{CONTEXT_BITMAP_PREFIX}b");
    let contexts = [CONTEXT_ALLOCATION, bitmap.as_str()];
    let mut reached = Vec::new();
    let Ok(mut c) = super::client::Client::over(Replay(data), &contexts) else {
        return reached;
    };
    reached.push("handshake");
    let size = c.size();
    if size == 0 {
        return reached;
    }
    let asked = size.min(1 << 30) as u32;
    if let Ok(status) = c.block_status(0, asked, &contexts) {
        assert_eq!(status.len(), 2, "a status per context asked for");
        assert!(
            status
                .iter()
                .all(|runs| !runs.is_empty() && runs.iter().all(|r| r.0 > 0))
        );
        reached.push("block-status");
    }
    let len = size.min(64 << 10) as u32;
    let read = c.read_ranges(&[(0, len)], |offset, d| {
        assert_eq!(
            (offset, d.len()),
            (0, len as usize),
            "a read is handed back whole"
        );
        Ok(())
    });
    if read.is_ok() {
        reached.push("read");
    }
    reached
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A few thousand generated sessions: no broken promise, and between
    /// them they reach transmission, reads, block status and errors.
    #[test]
    fn generated_sessions_keep_the_protocol() {
        let mut all = BTreeSet::new();
        let mut x = 0x1234_5678_9abc_def1u64;
        for _ in 0..400 {
            let data: Vec<u8> = (0..96)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            all.extend(session_one(&data));
        }
        for want in [
            "read:data",
            "block-status",
            "end:disconnect",
            "end:closed",
            "corrupted",
        ] {
            assert!(all.contains(want), "never saw {want}: {all:?}");
        }
    }
}
