//! The metadata thread of a served chain ([`crate::disk::Live`], of any
//! format): the format's blocking work (for qcow2: tables, allocations,
//! copy-on-write), off the queue threads.
//!
//! A queue hands it a [`Job`] (resolve a range that missed the mapping
//! cache or needs an allocation, commit a write's metadata, zero or
//! discard a range) and goes on with its other requests. The thread does
//! the work on the chain the request was mapped against, puts the answer
//! in the queue's [`Inbox`] and writes the queue's completion eventfd: the
//! one its engine signals, which the worker already watches (as librbd's
//! callbacks do for the RBD engine). It writes guest memory never:
//! compressed data it reads comes back as bytes, which the queue copies
//! into the request's buffers. It reads it for one thing: a write that
//! allocates a cluster with a copy-on-write hands its buffers along
//! ([`Work::Resolve`]'s `data`), and the image may write them with the
//! copied head and tail as one write: through the page cache, or with
//! `--direct` O_DIRECT through the engine's own descriptor
//! ([`Served::direct_top`]), as the engine would have written them; the
//! request is in flight, and its buffers mapped, until the answer is
//! reaped.
//!
//! A queue does a write-back write's resolve itself where that cannot
//! wait ([`crate::disk::Image::resolve_write_now`]: a cached image, the
//! metadata lock free, the copy-on-write's head and tail in the page
//! cache), and commits the metadata of all such writes of its pass once
//! ([`crate::disk::Image::commit_now`], if the commit lock is free too):
//! [`answer`] is the one place a resolve's pieces become the answer the
//! queue takes, whoever resolved. On a busy CPU the hand-off here and the
//! wake-up back cost more than an allocation in the page cache.
//!
//! When no job waits, the thread caches mappings ahead: after a miss,
//! the rest of what the L2 table there maps, a step at a time
//! ([`crate::disk::Image::warm_step`]), so that the next requests there
//! take the fast path.
//!
//! One thread per image, so one metadata operation at a time, which the
//! format needs anyway (its `meta` lock). Jobs come in batches: the
//! thread takes every job waiting, answers the resolves, zeroes and
//! discards first (their requests' data I/O can start at once), then does
//! one commit for all the commit jobs of the batch (group commit: one
//! round of metadata writes and fdatasyncs for every write waiting, and
//! one more fdatasync after them when a write of the batch is
//! write-through).
//!
//! A write-back write that allocated is committed before its answer, one
//! commit for every such write of the batch, and comes back with no
//! ticket: its completion then needs no second trip here. The cluster's
//! copy-on-write data is written already (synchronously, in the resolve;
//! with the write's own data where the image wrote that too). Where the
//! engine writes the data after the answer, the L2 entry is in the file
//! (or the L2 log) before it, and a kill -9 or power loss before the data
//! write completes leaves the guest's own range reading as the new
//! cluster did, a range whose write was never acknowledged (which another
//! write's commit could always do too: imago's cache has the entry from
//! the allocation on). A write-through write keeps its ticket: its commit
//! ends with the fdatasync that must follow its data.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

use crate::disk::reader::read_piece;
use crate::disk::seam::{Piece, Place, Resolved, Slow, place};
use crate::disk::{Commit, Dir, FormatError, Image, Served, WriteData};
use crate::metrics::RateLimiter;
use crate::virtio::GuestBuffers;
use crate::warn_limited;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a queue asks of the metadata thread.
pub enum Work {
    /// Where `len` bytes at `offset` are, allocating for a write;
    /// `durable`: a write-through write; `data`: a write's buffers, which
    /// the image may write from itself ([`crate::disk::Image::resolve_write`]).
    Resolve {
        offset: u64,
        len: u64,
        dir: Dir,
        durable: bool,
        data: Option<GuestBuffers>,
    },
    /// The metadata a write's allocation needs, in the file; `durable`
    /// (a write-through write): on the disk too.
    Commit { ticket: Commit, durable: bool },
    /// Write-zeroes of the range, whole; `durable` (write-through): on
    /// the disk when done.
    Zero {
        offset: u64,
        len: u64,
        unmap: bool,
        durable: bool,
    },
    /// Discard of the range; `durable` as for `Zero`.
    Discard {
        offset: u64,
        len: u64,
        durable: bool,
    },
    /// A FLUSH while the image holds metadata back: written out, synced.
    Flush,
}

/// One piece of work for request `tag` of the queue whose inbox this is.
pub struct Job {
    pub served: Arc<Served>,
    pub work: Work,
    pub tag: u32,
    pub inbox: Arc<Inbox>,
}

/// Where a queue's answers wait: a list, a flag the queue can check
/// without locking, a condition variable for a queue that drains, and the
/// queue's completion eventfd (a duplicate of its engine's).
pub struct Inbox {
    done: Mutex<Vec<(u32, Slow)>>,
    ready: AtomicBool,
    cv: Condvar,
    signal: EventFd,
}

impl Inbox {
    pub fn new(signal: EventFd) -> Inbox {
        Inbox {
            done: Mutex::new(Vec::new()),
            ready: AtomicBool::new(false),
            cv: Condvar::new(),
            signal,
        }
    }

    /// Wakes the queue (after a post, or a snapshot's end).
    pub fn wake(&self) {
        let _ = self.signal.write(1);
    }

    fn post(&self, tag: u32, answer: Slow) {
        lock(&self.done).push((tag, answer));
        self.ready.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    /// Whether answers are waiting (no lock taken).
    #[inline]
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Moves the answers waiting into `out`.
    pub fn take(&self, out: &mut Vec<(u32, Slow)>) {
        let mut done = lock(&self.done);
        self.ready.store(false, Ordering::Release);
        out.append(&mut done);
    }

    /// Blocks until an answer waits, or `timeout`.
    pub fn wait(&self, timeout: Duration) {
        let done = lock(&self.done);
        if done.is_empty() {
            let _ = self.cv.wait_timeout_while(done, timeout, |d| d.is_empty());
        }
    }
}

/// The handle queues send jobs through.
#[derive(Clone)]
pub struct Meta {
    tx: Sender<Job>,
}

impl Meta {
    /// Starts the thread (at start-up, before the seccomp filter).
    pub fn spawn() -> std::io::Result<Meta> {
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name("disk-meta".into())
            .spawn(move || run(rx))?;
        Ok(Meta { tx })
    }

    pub fn send(&self, job: Job) {
        // The thread ends only when every sender is gone.
        let _ = self.tx.send(job);
    }
}

#[cfg(test)]
impl Meta {
    /// A handle whose jobs only go to the receiver returned: for a test
    /// that looks at what a queue sends, and answers nothing.
    pub fn detached() -> (Meta, Receiver<Job>) {
        let (tx, rx) = channel();
        (Meta { tx }, rx)
    }
}

fn run(rx: Receiver<Job>) {
    let mut log_limit = RateLimiter::new(10, Duration::from_secs(5));
    let mut batch = Vec::new();
    let mut commits = Vec::new();
    let mut allocated: Vec<(Resolved, Job)> = Vec::new();
    let mut woken: Vec<Arc<Inbox>> = Vec::new();
    // Chains with mappings to cache ahead ([`Image::missed`]), worked on
    // a step at a time while no job waits.
    let mut warming: Vec<Arc<Served>> = Vec::new();
    loop {
        let first = if warming.is_empty() {
            match rx.recv() {
                Ok(job) => job,
                Err(_) => break,
            }
        } else {
            match rx.try_recv() {
                Ok(job) => job,
                Err(TryRecvError::Empty) => {
                    warming.retain(|s| s.image.warm_step());
                    continue;
                }
                Err(TryRecvError::Disconnected) => break,
            }
        };
        batch.push(first);
        batch.extend(rx.try_iter());
        for job in batch.drain(..) {
            if let Work::Commit { ticket, durable } = job.work {
                commits.push(((ticket, durable), job));
                continue;
            }
            if let Work::Resolve { offset, .. } = job.work
                && job.served.image.missed(offset)
                && !warming.iter().any(|s| Arc::ptr_eq(s, &job.served))
            {
                warming.push(job.served.clone());
            }
            let answer = work(&job, &mut log_limit);
            match answer {
                Slow::Resolved(r)
                    if r.ticket.is_some()
                        && matches!(job.work, Work::Resolve { durable: false, .. }) =>
                {
                    allocated.push((r, job));
                }
                answer => {
                    job.inbox.post(job.tag, answer);
                    note(&mut woken, &job.inbox);
                }
            }
        }
        // The answers that need no commit go at once.
        for inbox in woken.drain(..) {
            inbox.wake();
        }
        // The write-back writes that allocated: one commit per image, then
        // their answers, without a ticket.
        commit_by_image(
            &mut allocated,
            |r| r.ticket.map(|t| (t, false)),
            |mut r, committed| {
                if committed {
                    r.ticket = None;
                    Slow::Resolved(r)
                } else {
                    Slow::Failed
                }
            },
            &mut woken,
            &mut log_limit,
        );
        for inbox in woken.drain(..) {
            inbox.wake();
        }
        // The commits asked for after data I/O.
        commit_by_image(
            &mut commits,
            |&t| Some(t),
            |_, committed| {
                if committed { Slow::Done } else { Slow::Failed }
            },
            &mut woken,
            &mut log_limit,
        );
        for inbox in woken.drain(..) {
            inbox.wake();
        }
    }
}

/// Group commit: for each image among `group`'s jobs, one commit of its
/// highest ticket (`ticket` of each item; durable if any is), then every
/// one of its jobs answered with `answer(item, committed)`.
fn commit_by_image<T>(
    group: &mut Vec<(T, Job)>,
    ticket: impl Fn(&T) -> Option<(Commit, bool)>,
    answer: impl Fn(T, bool) -> Slow,
    woken: &mut Vec<Arc<Inbox>>,
    log_limit: &mut RateLimiter,
) {
    while let Some((_, first)) = group.first() {
        let served = first.served.clone();
        let same = |j: &Job| Arc::ptr_eq(&j.served, &served);
        let highest = group
            .iter()
            .filter(|(_, j)| same(j))
            .filter_map(|(t, _)| ticket(t))
            .reduce(|(a, da), (b, db)| (a.max(b), da || db));
        let result = match highest {
            Some((t, durable)) => served.image.commit(t, durable),
            None => Ok(()),
        };
        if let Err(e) = &result {
            warn_limited!(log_limit, "{}: committing metadata: {e}", name(&served));
        }
        let mut rest = Vec::new();
        for (t, job) in group.drain(..) {
            if same(&job) {
                job.inbox.post(job.tag, answer(t, result.is_ok()));
                note(woken, &job.inbox);
            } else {
                rest.push((t, job));
            }
        }
        *group = rest;
    }
}

fn note(woken: &mut Vec<Arc<Inbox>>, inbox: &Arc<Inbox>) {
    if !woken.iter().any(|i| Arc::ptr_eq(i, inbox)) {
        woken.push(inbox.clone());
    }
}

/// The served chain's top, for a log line.
pub fn name(served: &Served) -> String {
    served
        .image
        .chain()
        .first()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// Does one job (not a commit).
fn work(job: &Job, log_limit: &mut RateLimiter) -> Slow {
    let image = &job.served.image;
    let result = match job.work {
        Work::Resolve {
            offset,
            len,
            dir,
            ref data,
            ..
        } => return resolve(job, offset, len, dir, data.as_ref(), log_limit),
        Work::Zero {
            offset,
            len,
            unmap,
            durable,
        } => image
            .zero_range(offset, len, unmap)
            .and_then(|()| durable_if(&**image, durable)),
        Work::Discard {
            offset,
            len,
            durable,
        } => image
            .discard(offset, len)
            .and_then(|()| durable_if(&**image, durable)),
        Work::Flush => image.flush(),
        Work::Commit { .. } => unreachable!("commits are grouped"),
    };
    match result {
        Ok(()) => Slow::Done,
        Err(e) => {
            warn_limited!(log_limit, "{}: {e}", name(&job.served));
            Slow::Failed
        }
    }
}

/// A write-through write-zeroes or discard: its metadata (and the zeroes
/// written through the format) on the disk before it completes.
fn durable_if(image: &dyn Image, durable: bool) -> Result<(), FormatError> {
    if durable { image.flush() } else { Ok(()) }
}

fn resolve(
    job: &Job,
    offset: u64,
    len: u64,
    dir: Dir,
    data: Option<&GuestBuffers>,
    log_limit: &mut RateLimiter,
) -> Slow {
    let image = &job.served.image;
    let mut out = Vec::new();
    let failed = |e: &dyn std::fmt::Display, log_limit: &mut RateLimiter| {
        warn_limited!(
            log_limit,
            "{}: {len} bytes at {offset}: {e}",
            name(&job.served)
        );
        Slow::Failed
    };
    let resolved = match data {
        // SAFETY: the iovecs are the request's, validated when it was
        // parsed, into guest memory whose mapping `data` holds; the
        // request stays in flight (its buffers the guest's to read) until
        // this answer is reaped.
        Some(data) if dir == Dir::Write => unsafe {
            let data = WriteData {
                iovecs: data.iovecs(),
                direct: job.served.direct_top(),
            };
            image.resolve_write(offset, len, data, &mut out)
        },
        _ => image.resolve(offset, len, dir, &mut out),
    };
    match resolved.and_then(|ticket| answer(&**image, offset, out, ticket)) {
        Ok(r) => Slow::Resolved(r),
        Err(e) => failed(&e, log_limit),
    }
}

/// The answer to a resolve of a range at `offset`: the format's pieces
/// `out` as the queue takes them, compressed data read here into bytes
/// (which the queue copies into the guest's buffers).
pub fn answer(
    image: &dyn Image,
    offset: u64,
    out: Vec<crate::disk::Piece>,
    ticket: Option<Commit>,
) -> Result<Resolved, FormatError> {
    let mut pieces = Vec::with_capacity(out.len());
    let files = image.files();
    for p in out {
        let at = (p.guest - offset) as u32;
        let place = match place(p.at) {
            Some(place) => place,
            None => {
                let mut bytes = vec![0u8; p.len as usize];
                read_piece(image, &files, &p, &mut bytes)
                    .map_err(FormatError::io("reading compressed data"))?;
                Place::Bytes(bytes)
            }
        };
        pieces.push(Piece {
            at,
            len: p.len as u32,
            place,
        });
    }
    Ok(Resolved { pieces, ticket })
}
