//! The null engine: every request completes at once without touching the
//! image (reads return zeroes). It measures the ring path alone.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::{Completion, Engine, Full, Io};
use crate::virtio::{GuestMem, RequestKind, Status};

pub struct NullEngine {
    /// Completed, not yet reaped; never grows past its first capacity.
    done: VecDeque<Completion>,
    capacity: usize,
}

impl NullEngine {
    /// An engine that holds up to `capacity` unreaped completions.
    pub fn new(capacity: usize) -> NullEngine {
        NullEngine {
            done: VecDeque::with_capacity(capacity),
            capacity,
        }
    }
}

impl Engine for NullEngine {
    fn submit(&mut self, io: Io) -> Result<(), Full> {
        if self.done.len() >= self.capacity {
            return Err(Full(io));
        }
        let written = match io.req.kind() {
            RequestKind::Read { .. } => {
                // A read's buffers are device-writable.
                io.req.data().zero();
                io.req.data_len()
            }
            _ => 0,
        };
        self.done.push_back(Completion {
            io,
            status: Status::Ok,
            written,
        });
        Ok(())
    }

    fn commit(&mut self) -> io::Result<u32> {
        Ok(0)
    }

    fn reap(&mut self, mut f: impl FnMut(Completion)) -> u32 {
        let n = self.done.len() as u32;
        self.done.drain(..).for_each(&mut f);
        n
    }

    fn room(&self) -> usize {
        self.capacity - self.done.len()
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    fn wait(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn has_completions(&mut self) -> bool {
        !self.done.is_empty()
    }

    fn completion_fd(&self) -> Option<RawFd> {
        None
    }

    fn clear_completion_fd(&self) {}

    fn must_poll(&self) -> bool {
        false
    }

    fn set_memory(&mut self, _mem: &Arc<GuestMem>) {}

    fn make_durable(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn reset(&mut self) {}
}
