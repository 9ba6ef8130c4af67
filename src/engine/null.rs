//! The null engine: every request completes at once without touching the
//! image (reads return zeroes). It measures the ring path alone.

use std::io;

use super::{Completions, Engine, Io, Op, Start};
use crate::virtio::Status;

pub struct NullEngine {
    /// Requests a queue may have in flight at once.
    capacity: usize,
}

impl NullEngine {
    /// An engine for up to `capacity` requests in flight.
    pub fn new(capacity: usize) -> NullEngine {
        NullEngine { capacity }
    }
}

impl Engine for NullEngine {
    fn start(&mut self, io: Io) -> Start {
        if io.op() == Op::Read {
            // A read's buffers are device-writable.
            io.data().zero();
        }
        Start::Done(io, Status::Ok)
    }

    fn commit(&mut self) -> io::Result<u32> {
        Ok(0)
    }

    fn reap(&mut self, _f: impl FnMut(Io, Status)) -> u32 {
        0
    }

    fn room(&self) -> usize {
        self.capacity
    }

    fn in_flight(&self) -> usize {
        0
    }

    fn wait(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn completions(&self) -> Completions {
        Completions::Immediate
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// It touches no file.
    fn set_files(&mut self, _fds: &[std::os::fd::RawFd]) -> io::Result<()> {
        Ok(())
    }
}
