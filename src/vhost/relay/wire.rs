//! The vhost-user message header, in the one place it is encoded and
//! decoded (vhost-user spec, "Message Specification"): the relay reads and
//! writes it ([`super`]), the back-end channel writes and reads it
//! ([`super::channel`]), and the tests' hand-written front-end uses it
//! too. The `vhost` crate keeps its own header type private; request codes
//! and payloads are its types.

use vhost::vhost_user::message::VhostUserHeaderFlag;
use vm_memory::ByteValued;

/// `struct VhostUserMsgHeader`: request, flags, payload size, each a
/// little-endian u32.
pub const HEADER_LEN: usize = 12;
/// The only protocol version there is, in the low bits of the flags.
pub const VERSION: u32 = 0x1;
/// The message is a reply.
pub const REPLY: u32 = VhostUserHeaderFlag::REPLY.bits();
/// The sender wants an answer (REPLY_ACK, or a GET_* message).
pub const NEED_REPLY: u32 = VhostUserHeaderFlag::NEED_REPLY.bits();

/// A message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub request: u32,
    pub flags: u32,
    /// Bytes of payload that follow.
    pub size: u32,
}

impl Header {
    /// A request (or a message passed on) of `size` payload bytes.
    pub fn new(request: impl Into<u32>, flags: u32, size: usize) -> Header {
        Header {
            request: request.into(),
            flags,
            // Payloads are bounded far below 4 GiB by whoever builds them.
            size: size as u32,
        }
    }

    /// The reply to `request`, with `size` payload bytes.
    pub fn reply(request: impl Into<u32>, size: usize) -> Header {
        Header::new(request, VERSION | REPLY, size)
    }

    pub fn to_bytes(self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&self.request.to_le_bytes());
        h[4..8].copy_from_slice(&self.flags.to_le_bytes());
        h[8..12].copy_from_slice(&self.size.to_le_bytes());
        h
    }

    pub fn from_bytes(h: &[u8; HEADER_LEN]) -> Header {
        let le32 = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        Header {
            request: le32(0),
            flags: le32(4),
            size: le32(8),
        }
    }

    pub fn needs_reply(&self) -> bool {
        self.flags & NEED_REPLY != 0
    }

    pub fn is_reply(&self) -> bool {
        self.flags & REPLY != 0
    }
}

/// A payload's first bytes as a `T` (a `vhost` crate message type);
/// `None` if it is shorter than one.
pub fn payload_as<T: ByteValued + Default>(p: &[u8]) -> Option<T> {
    let mut v = T::default();
    let bytes = p.get(..std::mem::size_of::<T>())?;
    v.as_mut_slice().copy_from_slice(bytes);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_bytes_round_trip_little_endian() {
        let h = Header::new(8u32, VERSION | NEED_REPLY, 8);
        let b = h.to_bytes();
        assert_eq!(b, [8, 0, 0, 0, 9, 0, 0, 0, 8, 0, 0, 0]);
        assert_eq!(Header::from_bytes(&b), h);
        assert!(h.needs_reply() && !h.is_reply());
        let r = Header::reply(8u32, 8);
        assert_eq!(r.flags, 5);
        assert!(r.is_reply());
    }
}
