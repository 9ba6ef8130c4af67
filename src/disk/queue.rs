//! One queue's view of a served chain ([`Live`], of any format): the
//! per-queue side of the seam ([`crate::disk::seam::Format`]), which maps
//! from the queue's thread through the image's [`crate::disk::Mapper`]
//! (for qcow2, its map cache) and hands what needs metadata work to the
//! image's metadata thread ([`super::meta`]).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::meta::{self, Inbox, Job, Meta, Work};
use crate::disk::live::Gate;
use crate::disk::luks::Crypt;
use crate::disk::seam::{
    Completions, Extent, Format, Mapping, Piece, Place, Resolved, Slow, place,
};
use crate::disk::{Commit, Dir, Live, Served, Where, WriteData};
use crate::metrics::RateLimiter;
use crate::virtio::{GuestBuffers, Op};
use crate::warn_limited;

/// One queue's view of a served chain ([`Live`]): the chain it maps
/// against, its gate, and its line to the image's metadata thread.
pub struct ChainQueue {
    live: Arc<Live>,
    served: Arc<Served>,
    generation: u64,
    /// The chain changed since the engine last registered its files.
    files_changed: bool,
    meta: Meta,
    /// Set up by `completions` (it needs the engine's eventfd).
    inbox: Option<Arc<Inbox>>,
    gate: Option<Arc<Gate>>,
    /// Requests at the metadata thread, and in `now`.
    slow: usize,
    /// Write-back writes resolved on this thread
    /// ([`crate::disk::Image::resolve_write_now`]; None: failed), answered
    /// in `reap_slow` after one commit for all of them.
    now: Vec<(u32, Option<Resolved>)>,
    log_limit: RateLimiter,
    /// The format layer's pieces of the last `map`, and ours.
    scratch: Vec<crate::disk::Piece>,
    pieces: Vec<Piece>,
    answers: Vec<(u32, Slow)>,
}

impl ChainQueue {
    /// A queue's view of `live`, whose metadata thread is `meta`.
    pub fn new(live: Arc<Live>, meta: Meta) -> ChainQueue {
        let served = live.current();
        ChainQueue {
            generation: served.generation,
            served,
            live,
            files_changed: false,
            meta,
            inbox: None,
            gate: None,
            slow: 0,
            now: Vec::new(),
            log_limit: RateLimiter::new(10, Duration::from_secs(5)),
            scratch: Vec::new(),
            pieces: Vec::new(),
            answers: Vec::new(),
        }
    }

    fn send(&mut self, tag: u32, work: Work) {
        let Some(inbox) = self.inbox.clone() else {
            // `completions` sets it up when the core is made, always
            // before a request.
            unreachable!("a chain's queue without its inbox");
        };
        self.slow += 1;
        self.meta.send(Job {
            served: self.served.clone(),
            work,
            tag,
            inbox,
        });
    }

    /// A write-back write resolved here rather than by the metadata
    /// thread, if the image can do it now ([`crate::disk::Image::resolve_write_now`]):
    /// an allocating write on a cached image then costs no hand-off to
    /// that thread and back (two wake-ups, which on a busy CPU cost more
    /// than the allocation). False: the caller sends it.
    fn resolve_now(&mut self, tag: u32, offset: u64, len: u64, data: &GuestBuffers) -> bool {
        let image = &self.served.image;
        let write = WriteData {
            iovecs: data.iovecs(),
            direct: self.served.direct_top(),
        };
        self.scratch.clear();
        // SAFETY: the iovecs are the request's, validated when it was
        // parsed, into guest memory whose mapping `data` holds for the
        // call.
        let Some(resolved) =
            (unsafe { image.resolve_write_now(offset, len, write, &mut self.scratch) })
        else {
            return false;
        };
        let out = std::mem::take(&mut self.scratch);
        let answer = match resolved.and_then(|ticket| meta::answer(&**image, offset, out, ticket)) {
            Ok(r) => Some(r),
            Err(e) => {
                let top = meta::name(&self.served);
                warn_limited!(self.log_limit, "{top}: {len} bytes at {offset}: {e}");
                None
            }
        };
        self.slow += 1;
        self.now.push((tag, answer));
        true
    }

    /// Answers the writes resolved here: one commit of the metadata they
    /// changed first (group commit, as the metadata thread does), so that
    /// their completion needs no trip to it. Where that thread is at work
    /// on the image, the commit is left to it: the answers keep their
    /// ticket, and the requests' completions wait for it.
    fn answer_now(&mut self, f: &mut dyn FnMut(u32, Slow)) {
        let highest = self
            .now
            .iter()
            .filter_map(|(_, r)| r.as_ref()?.ticket)
            .max();
        let committed = match highest {
            Some(ticket) => self.served.image.commit_now(ticket),
            None => Some(Ok(())),
        };
        if let Some(Err(e)) = &committed {
            let top = meta::name(&self.served);
            warn_limited!(self.log_limit, "{top}: committing metadata: {e}");
        }
        self.slow -= self.now.len();
        for (tag, r) in self.now.drain(..) {
            let answer = match (r, &committed) {
                (Some(mut r), Some(Ok(()))) => {
                    r.ticket = None;
                    Slow::Resolved(r)
                }
                (Some(r), None) => Slow::Resolved(r),
                (None, _) | (_, Some(Err(_))) => Slow::Failed,
            };
            f(tag, answer);
        }
    }
}

impl Format for ChainQueue {
    fn map(&mut self, op: Op, offset: u64, len: u64) -> Mapping {
        let Some(gate) = &self.gate else {
            unreachable!("a chain's queue without its gate");
        };
        if !self.live.enter(gate) {
            return Mapping::Busy;
        }
        if self.live.generation() != self.generation {
            // Nothing of this queue is in flight (a snapshot waited for
            // that): take the new chain.
            self.served = self.live.current();
            self.generation = self.served.generation;
            self.files_changed = true;
        }
        let dir = match op {
            Op::Read => Dir::Read,
            Op::Write => Dir::Write,
            Op::Flush if self.served.image.holds_back() => return Mapping::Slow,
            Op::Flush => return Mapping::Host(Extent::default()),
            Op::Discard(_) | Op::WriteZeroes(_) => return Mapping::Slow,
        };
        self.scratch.clear();
        self.served.image.map(offset, len, dir, &mut self.scratch);
        if let [one] = self.scratch[..] {
            return match place(one.at) {
                Some(Place::Host(at)) => Mapping::Host(at),
                Some(_) => Mapping::Zero,
                None => Mapping::Slow,
            };
        }
        if self.scratch.iter().any(|p| p.at == Where::Slow) {
            return Mapping::Slow;
        }
        self.pieces.clear();
        for p in &self.scratch {
            self.pieces.push(Piece {
                at: (p.guest - offset) as u32,
                len: p.len as u32,
                // Not slow: those went to the metadata thread above.
                place: place(p.at).unwrap_or(Place::Zero),
            });
        }
        Mapping::Pieces
    }

    fn pieces(&mut self, out: &mut Vec<Piece>) {
        out.append(&mut self.pieces);
    }

    #[inline]
    fn finished(&mut self) {
        if let Some(gate) = &self.gate {
            self.live.leave(gate);
        }
    }

    fn files_changed(&mut self) -> Option<Vec<RawFd>> {
        std::mem::take(&mut self.files_changed).then(|| self.served.io_fds())
    }

    fn crypts(&self) -> Vec<Option<Arc<Crypt>>> {
        self.served.image.crypts()
    }

    fn completions(&mut self, engine: Completions) -> io::Result<Completions> {
        let (signal, completions) = match engine {
            Completions::Signalled { fd, polling_pays } => {
                // SAFETY: dup(2) of the engine's eventfd, which it keeps
                // open; the duplicate is ours.
                let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
                if dup < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: `dup` was just made and is owned by nothing else.
                let efd = unsafe { <EventFd as std::os::fd::FromRawFd>::from_raw_fd(dup) };
                (efd, Completions::Signalled { fd, polling_pays })
            }
            Completions::Immediate => {
                let efd = EventFd::new(EFD_NONBLOCK)?;
                let fd = efd.as_raw_fd();
                (
                    efd,
                    Completions::Signalled {
                        fd,
                        polling_pays: true,
                    },
                )
            }
            Completions::Polled => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "an image with metadata work (qcow2) cannot be served with IOPOLL",
                ));
            }
        };
        let inbox = Arc::new(Inbox::new(signal));
        let waker = inbox.clone();
        self.gate = Some(self.live.gate(Box::new(move || waker.wake())));
        self.inbox = Some(inbox);
        Ok(completions)
    }

    fn start_slow(
        &mut self,
        tag: u32,
        op: Op,
        offset: u64,
        len: u64,
        durable: bool,
        data: Option<GuestBuffers>,
    ) {
        if let (Op::Write, false, Some(d)) = (op, durable, &data)
            && self.resolve_now(tag, offset, len, d)
        {
            return;
        }
        let work = match op {
            Op::Read => Work::Resolve {
                offset,
                len,
                dir: Dir::Read,
                durable: false,
                data: None,
            },
            Op::Write => Work::Resolve {
                offset,
                len,
                dir: Dir::Write,
                durable,
                data,
            },
            Op::WriteZeroes(r) => Work::Zero {
                offset,
                len,
                unmap: r.unmap,
                durable,
            },
            Op::Discard(_) => Work::Discard {
                offset,
                len,
                durable,
            },
            Op::Flush => Work::Flush,
        };
        self.send(tag, work);
    }

    fn start_commit(&mut self, tag: u32, ticket: Commit, durable: bool) {
        self.send(tag, Work::Commit { ticket, durable });
    }

    #[inline]
    fn slow_in_flight(&self) -> usize {
        self.slow
    }

    fn reap_slow(&mut self, f: &mut dyn FnMut(u32, Slow)) {
        if !self.now.is_empty() {
            self.answer_now(f);
        }
        let Some(inbox) = &self.inbox else { return };
        if self.slow == 0 || !inbox.ready() {
            return;
        }
        inbox.take(&mut self.answers);
        self.slow -= self.answers.len();
        for (tag, answer) in self.answers.drain(..) {
            f(tag, answer);
        }
    }

    fn wait(&mut self) {
        const A_WHILE: Duration = Duration::from_millis(50);
        if !self.now.is_empty() {
            // Answered at the next reap.
        } else if self.slow > 0 {
            if let Some(inbox) = &self.inbox {
                inbox.wait(A_WHILE);
            }
        } else if self.live.paused() {
            self.live.wait_resumed(A_WHILE);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use std::time::Instant;

    use std::sync::mpsc::Receiver;

    use super::*;
    use crate::disk::seam::Format as _;
    use crate::disk::{Format, OpenOptions, SnapshotDir, SnapshotError};
    use crate::virtio::DiscardRange;

    /// Waits for the metadata thread's answer to `tag`.
    fn answer(q: &mut ChainQueue, tag: u32) -> Slow {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = None;
        while got.is_none() {
            assert!(
                Instant::now() < deadline,
                "no answer from the metadata thread"
            );
            q.wait();
            q.reap_slow(&mut |t, slow| {
                assert_eq!(t, tag);
                got = Some(slow);
            });
        }
        got.unwrap()
    }

    /// A qcow2 overlay (64 KiB clusters) over a raw base of 1 MiB whose
    /// first `data` bytes are 0xa5 (the rest a hole), served as a chain
    /// through a queue and a metadata thread of its own.
    fn overlay_queue(dir: &std::path::Path, data: usize) -> (std::path::PathBuf, ChainQueue) {
        overlay_queue_served(dir, data, false)
    }

    /// [`overlay_queue`], `direct`: served as with `--direct`.
    fn overlay_queue_served(
        dir: &std::path::Path,
        data: usize,
        direct: bool,
    ) -> (std::path::PathBuf, ChainQueue) {
        overlay_queue_with(dir, data, direct, Meta::spawn().unwrap())
    }

    /// [`overlay_queue_served`], its jobs sent through `meta`.
    fn overlay_queue_with(
        dir: &std::path::Path,
        data: usize,
        direct: bool,
        meta: Meta,
    ) -> (std::path::PathBuf, ChainQueue) {
        let base = dir.join("base.raw");
        let f = std::fs::File::create(&base).unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(&vec![0xa5u8; data], 0).unwrap();
        let top = dir.join("top.qcow2");
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&top)
            .unwrap();
        crate::disk::qcow2::create(&file, &top, 1 << 20, 64 << 10, Some(("base.raw", "raw")))
            .unwrap();
        drop(file);
        let live = Live::open(&top, Format::Qcow2, OpenOptions::default(), direct, None);
        let live = Arc::new(live.unwrap());
        live.claim().unwrap();
        let mut q = ChainQueue::new(live, meta);
        q.completions(Completions::Immediate).unwrap();
        (top, q)
    }

    /// What keeps a write off the queue's thread in [`write_without_meta_thread`].
    #[derive(Clone, Copy, PartialEq)]
    enum Busy {
        No,
        /// The metadata lock is held (the metadata thread at work).
        Meta,
        /// The base's pages are not in the page cache.
        BaseUncached,
    }

    /// The queue's first cluster, written with `bytes` at 12288 (over a
    /// base with data in every byte), with no one at the metadata thread:
    /// what reaches it stays in the receiver returned. Also returns the
    /// top's length before the write.
    fn write_without_meta_thread(
        dir: &std::path::Path,
        bytes: &[u8],
        busy: Busy,
    ) -> (ChainQueue, Receiver<Job>, Option<Slow>, u64) {
        let (meta, rx) = Meta::detached();
        let (top, mut q) = overlay_queue_with(dir, 1 << 20, false, meta);
        if busy == Busy::BaseUncached {
            let base = std::fs::File::open(dir.join("base.raw")).unwrap();
            base.sync_all().unwrap();
            // SAFETY: fadvise on a descriptor `base` owns; no memory passed.
            let r =
                unsafe { libc::posix_fadvise(base.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            assert_eq!(r, 0);
            assert_eq!(
                resident_pages(&base, 0, 65536),
                0,
                "the base's first cluster dropped from the page cache"
            );
        }
        let len_before = std::fs::metadata(&top).unwrap().len();
        let mem = Arc::new(
            crate::virtio::GuestMem::from_ranges(&[(vm_memory::GuestAddress(0), 0x1000)]).unwrap(),
        );
        // SAFETY: `bytes` outlives the buffers (dropped by `start_slow`
        // or with the job), and nothing writes it meanwhile.
        let data =
            unsafe { GuestBuffers::private(&mem, Vec::new(), bytes.as_ptr(), bytes.len() as u32) };
        let len = bytes.len() as u64;
        assert_eq!(q.map(Op::Write, 12288, len), Mapping::Slow);
        q.finished();
        let served = q.served.clone();
        let image = served.image.as_qcow2().unwrap();
        let held = (busy == Busy::Meta).then(|| image.hold_meta());
        q.start_slow(1, Op::Write, 12288, len, false, Some(data));
        drop(held);
        let mut got = None;
        q.reap_slow(&mut |tag, slow| {
            assert_eq!(tag, 1);
            got = Some(slow);
        });
        (q, rx, got, len_before)
    }

    /// A write-back write that allocates takes one trip to the metadata
    /// thread: its answer comes committed, with no ticket, and the
    /// cluster is writable in the queue's cache at once; a write-through
    /// one keeps its ticket (its commit is the fdatasync after its data).
    /// Over a base with no data, the copy-on-write writes nothing: the
    /// new cluster lies past the end of the file, which reads as zeroes,
    /// and the engine writes the data.
    #[test]
    fn a_write_back_allocation_takes_one_trip() {
        let dir = tempfile::tempdir().unwrap();
        let (top, mut q) = overlay_queue(dir.path(), 0);
        let len_before = std::fs::metadata(&top).unwrap().len();

        assert_eq!(q.map(Op::Write, 4096, 4096), Mapping::Slow);
        q.start_slow(1, Op::Write, 4096, 4096, false, None);
        let Slow::Resolved(r) = answer(&mut q, 1) else {
            panic!("the write resolves");
        };
        q.finished();
        assert_eq!(r.ticket, None, "committed before the answer");
        let [
            Piece {
                place: Place::Host(at),
                ..
            },
        ] = r.pieces[..]
        else {
            panic!("one piece in the top: {:?}", r.pieces);
        };
        assert_eq!(at.file, 0);
        assert!(at.offset >= len_before, "a new cluster at the end");
        // Nothing of the cluster was written but its last byte (`cover`,
        // which sets the file's length): head and tail are a hole.
        let cluster = at.offset - 4096;
        let f = std::fs::File::open(&top).unwrap();
        // SAFETY: lseek on a descriptor `f` owns; no memory is passed.
        let data = unsafe { libc::lseek(f.as_raw_fd(), cluster as i64, libc::SEEK_DATA) };
        assert!(
            data >= (cluster + (60 << 10)) as i64,
            "data at {data}, in the cluster at {cluster}"
        );
        assert_eq!(
            q.map(Op::Write, 8192, 4096),
            Mapping::Host(Extent {
                file: 0,
                offset: cluster + 8192,
            }),
            "the allocated cluster is in the cache, writable"
        );
        q.finished();

        assert_eq!(q.map(Op::Write, 128 << 10, 4096), Mapping::Slow);
        q.start_slow(2, Op::Write, 128 << 10, 4096, true, None);
        let Slow::Resolved(r) = answer(&mut q, 2) else {
            panic!("the write resolves");
        };
        q.finished();
        assert!(r.ticket.is_some(), "a write-through write keeps its ticket");
    }

    /// Over a base with data, an allocating write's buffers go with the
    /// copy-on-write: the metadata thread writes head, data and tail as
    /// one write (the piece comes back done), and the cluster holds them.
    /// A write into a cluster the top has already is left to the engine.
    #[test]
    fn an_allocating_write_goes_with_its_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (top, mut q) = overlay_queue(dir.path(), 1 << 20);
        let mem = Arc::new(
            crate::virtio::GuestMem::from_ranges(&[(vm_memory::GuestAddress(0), 0x1000)]).unwrap(),
        );
        let bytes = vec![0x5au8; 8192];
        // SAFETY: `bytes` outlives the buffers and every use of them
        // below, and nothing writes it meanwhile.
        let data = unsafe { GuestBuffers::private(&mem, Vec::new(), bytes.as_ptr(), 8192) };

        assert_eq!(q.map(Op::Write, 12288, 8192), Mapping::Slow);
        q.finished();
        let at = written_with_its_copy(&mut q, data, 12288, 8192);
        let f = std::fs::File::open(&top).unwrap();
        let mut cluster = vec![0u8; 65536];
        f.read_exact_at(&mut cluster, at.offset).unwrap();
        assert!(cluster[..12288].iter().all(|&b| b == 0xa5), "the head");
        assert!(cluster[12288..20480].iter().all(|&b| b == 0x5a), "the data");
        assert!(cluster[20480..].iter().all(|&b| b == 0xa5), "the tail");

        // SAFETY: as above.
        let again = unsafe { GuestBuffers::private(&mem, Vec::new(), bytes.as_ptr(), 4096) };
        assert_eq!(q.map(Op::Write, 0, 4096), Mapping::Host(at));
        q.finished();
        q.start_slow(2, Op::Write, 0, 4096, false, Some(again));
        let Slow::Resolved(r) = answer(&mut q, 2) else {
            panic!("the write resolves");
        };
        q.finished();
        assert_eq!(r.pieces.len(), 1);
        assert_eq!(r.pieces[0].place, Place::Host(at));
    }

    /// Served with `--direct`, an allocating write goes with its copy
    /// too, as one O_DIRECT write through the engine's descriptor: the
    /// piece comes back done, the cluster holds head, data and tail, and
    /// none of its pages is in the page cache (a write through the image's
    /// own descriptor would have left them there, dirty). The write is
    /// 512-byte aligned only, from an unaligned buffer: the image gathers
    /// it in an aligned one and writes whole 4 KiB blocks around it.
    #[test]
    fn with_direct_an_allocating_write_goes_with_its_copy_o_direct() {
        let dir = tempfile::tempdir().unwrap();
        let (top, mut q) = overlay_queue_served(dir.path(), 1 << 20, true);
        let mem = Arc::new(
            crate::virtio::GuestMem::from_ranges(&[(vm_memory::GuestAddress(0), 0x1000)]).unwrap(),
        );
        let bytes = vec![0x5au8; 1025];
        let unaligned = &bytes[1..];
        // SAFETY: `bytes` outlives the buffers and every use of them
        // below, and nothing writes it meanwhile.
        let data = unsafe { GuestBuffers::private(&mem, Vec::new(), unaligned.as_ptr(), 1024) };
        let at = written_with_its_copy(&mut q, data, 12800, 1024);
        let f = std::fs::File::open(&top).unwrap();
        assert_eq!(resident_pages(&f, at.offset, 65536), 0, "written O_DIRECT");
        let mut cluster = vec![0u8; 65536];
        f.read_exact_at(&mut cluster, at.offset).unwrap();
        assert!(cluster[..12800].iter().all(|&b| b == 0xa5), "the head");
        assert!(cluster[12800..13824].iter().all(|&b| b == 0x5a), "the data");
        assert!(cluster[13824..].iter().all(|&b| b == 0xa5), "the tail");
    }

    /// Writes `data` (`len` bytes at `offset`, in the disk's first
    /// cluster, which the top does not have): the metadata thread writes
    /// it with the cluster's copy, and answers committed (no ticket) and
    /// done (one piece, nothing for the engine). Returns where the cluster
    /// is, from the cache.
    fn written_with_its_copy(
        q: &mut ChainQueue,
        data: GuestBuffers,
        offset: u64,
        len: u32,
    ) -> Extent {
        q.start_slow(1, Op::Write, offset, u64::from(len), false, Some(data));
        let Slow::Resolved(r) = answer(q, 1) else {
            panic!("the write resolves");
        };
        q.finished();
        assert_eq!(r.ticket, None);
        assert_eq!(
            r.pieces,
            vec![Piece {
                at: 0,
                len,
                place: Place::Done
            }]
        );
        let Mapping::Host(at) = q.map(Op::Read, 0, 65536) else {
            panic!("the cluster is cached");
        };
        q.finished();
        at
    }

    /// How many of the pages of `len` bytes at `offset` of `f` are in the
    /// page cache (mincore over a mapping, which faults nothing in).
    fn resident_pages(f: &std::fs::File, offset: u64, len: usize) -> usize {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh read-only shared mapping of the file, unmapped
        // below; mincore writes one byte per page of it into `vec`, which
        // has that many.
        unsafe {
            let addr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                offset as libc::off_t,
            );
            assert_ne!(addr, libc::MAP_FAILED);
            let mut vec = vec![0u8; len.div_ceil(4096)];
            assert_eq!(libc::mincore(addr, len, vec.as_mut_ptr()), 0);
            libc::munmap(addr, len);
            vec.iter().filter(|&&b| b & 1 != 0).count()
        }
    }

    /// On a cached image whose metadata no one is working on, a
    /// write-back write allocates on the queue's own thread: its answer is
    /// there at the first reap, committed (no ticket) and done, the
    /// cluster holds head, data and tail and is in the cache, and nothing
    /// went to the metadata thread.
    #[test]
    fn an_allocating_write_is_done_on_the_queue_thread() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = vec![0x5au8; 8192];
        let (mut q, rx, got, _) = write_without_meta_thread(dir.path(), &bytes, Busy::No);
        let Some(Slow::Resolved(r)) = got else {
            panic!("answered at once: {got:?}");
        };
        assert_eq!(r.ticket, None, "committed before the answer");
        assert_eq!(r.pieces.len(), 1);
        assert_eq!(r.pieces[0].place, Place::Done);
        assert_eq!(q.slow_in_flight(), 0);
        assert!(rx.try_recv().is_err(), "nothing for the metadata thread");
        let Mapping::Host(at) = q.map(Op::Read, 0, 65536) else {
            panic!("the cluster is cached");
        };
        q.finished();
        let f = std::fs::File::open(dir.path().join("top.qcow2")).unwrap();
        let mut cluster = vec![0u8; 65536];
        f.read_exact_at(&mut cluster, at.offset).unwrap();
        assert!(cluster[..12288].iter().all(|&b| b == 0xa5), "the head");
        assert!(cluster[12288..20480].iter().all(|&b| b == 0x5a), "the data");
        assert!(cluster[20480..].iter().all(|&b| b == 0xa5), "the tail");
    }

    /// While the metadata thread holds the image's metadata (a commit's
    /// fdatasync may take milliseconds), the queue does not wait for it:
    /// the write goes to that thread, as a resolve with its buffers.
    #[test]
    fn while_the_metadata_is_busy_a_write_goes_to_its_thread() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = vec![0x5au8; 4096];
        let (q, rx, got, _) = write_without_meta_thread(dir.path(), &bytes, Busy::Meta);
        assert!(got.is_none(), "no answer without the metadata thread");
        assert_eq!(q.slow_in_flight(), 1);
        let job = rx.try_recv().expect("sent to the metadata thread");
        assert!(matches!(
            job.work,
            Work::Resolve {
                offset: 12288,
                len: 4096,
                dir: Dir::Write,
                durable: false,
                data: Some(_),
            }
        ));
    }

    /// Where the copy-on-write's head or tail is not in the page cache,
    /// the queue does not wait for the device either: the write goes to
    /// the metadata thread, and nothing of it was allocated. (On a file
    /// system with a page cache to drop: under /var/tmp.)
    #[test]
    fn a_copy_not_in_the_page_cache_goes_to_the_metadata_thread() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let bytes = vec![0x5au8; 4096];
        let (_q, rx, got, len_before) =
            write_without_meta_thread(dir.path(), &bytes, Busy::BaseUncached);
        assert!(got.is_none(), "not answered on the queue's thread");
        let job = rx.try_recv().expect("sent to the metadata thread");
        assert!(matches!(job.work, Work::Resolve { data: Some(_), .. }));
        let top = dir.path().join("top.qcow2");
        assert_eq!(
            std::fs::metadata(&top).unwrap().len(),
            len_before,
            "nothing allocated"
        );
    }

    /// A miss caches ahead: once the metadata thread has answered a read
    /// that missed, and has nothing else to do, the rest of what the L2
    /// table there maps enters the cache, and a read elsewhere in it maps
    /// at once (here, the last granule of a 1 MiB disk read through from
    /// its base).
    #[test]
    fn a_miss_caches_the_rest_of_its_table() {
        let dir = tempfile::tempdir().unwrap();
        let (_top, mut q) = overlay_queue(dir.path(), 1 << 20);
        let last = (1 << 20) - 65536;
        assert_eq!(q.map(Op::Read, last, 4096), Mapping::Slow);
        q.finished();
        assert_eq!(q.map(Op::Read, 0, 4096), Mapping::Slow);
        q.finished();
        q.start_slow(1, Op::Read, 0, 4096, false, None);
        let Slow::Resolved(_) = answer(&mut q, 1) else {
            panic!("the read resolves");
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = q.map(Op::Read, last, 4096);
            q.finished();
            if let Mapping::Host(at) = m {
                assert_eq!(at.file, 1, "the base's data");
                break;
            }
            assert!(Instant::now() < deadline, "never cached ahead: {m:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The chain machinery (`Live`, this view, the metadata thread) serves
    /// any format's `Image`, not only qcow2's: a raw file opened through
    /// `disk::open` and served as a chain maps in place, has its
    /// write-zeroes done by the metadata thread through `Image`, flushes
    /// as a plain fdatasync, and refuses a live snapshot (whose overlay
    /// needs a qcow2 top) with the one line for that.
    #[test]
    fn a_format_other_than_qcow2_is_served_as_a_chain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.raw");
        std::fs::write(&path, vec![0xa5u8; 1 << 20]).unwrap();
        let snapshots = SnapshotDir::open(dir.path()).unwrap();
        let live = Live::open(
            &path,
            Format::Raw,
            OpenOptions::default(),
            false,
            Some(snapshots),
        );
        let live = Arc::new(live.unwrap());
        assert_eq!(live.size(), 1 << 20);
        assert_eq!(live.chain(), vec![std::fs::canonicalize(&path).unwrap()]);
        let mut q = ChainQueue::new(live.clone(), Meta::spawn().unwrap());
        q.completions(Completions::Immediate).unwrap();

        let at = |offset| Mapping::Host(Extent { file: 0, offset });
        assert_eq!(q.map(Op::Read, 8192, 4096), at(8192));
        q.finished();
        assert_eq!(q.map(Op::Flush, 0, 0), at(0));
        q.finished();

        let zeroes = Op::WriteZeroes(DiscardRange {
            sector: 8,
            num_sectors: 16,
            unmap: false,
        });
        assert_eq!(q.map(zeroes, 4096, 8192), Mapping::Slow);
        q.start_slow(7, zeroes, 4096, 8192, true, None);
        assert_eq!(q.slow_in_flight(), 1);
        assert!(matches!(answer(&mut q, 7), Slow::Done));
        assert_eq!(q.slow_in_flight(), 0);
        q.finished();
        let file = std::fs::File::open(&path).unwrap();
        let mut buf = vec![0u8; 16384];
        file.read_exact_at(&mut buf, 0).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 0xa5));
        assert!(buf[4096..12288].iter().all(|&b| b == 0), "the zeroes");
        assert!(buf[12288..].iter().all(|&b| b == 0xa5));

        live.grow(2 << 20).unwrap();
        assert_eq!(live.size(), 2 << 20);
        let overlay = dir.path().join("top.qcow2");
        let refused = live.snapshot(&overlay, |_| Ok(()), || {});
        assert!(
            matches!(refused, Err(SnapshotError::NotQcow2)),
            "{refused:?}"
        );
        assert!(!overlay.exists(), "the overlay made for it is removed");
        assert_eq!(live.generation(), 0);
    }
}
