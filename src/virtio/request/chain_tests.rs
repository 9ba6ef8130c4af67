//! The malformed-chain catalogue: every way a guest can break a descriptor
//! chain, and what `Request::parse` answers. Whether the guest gets a
//! status byte (`Rejected::status`) matters as much as the error: with
//! `None`, the used element carries length 0 and nothing is written.

use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use vm_memory::GuestAddress;

use super::*;
use crate::virtio::chain_writer::WRITE;
use crate::virtio::testing::*;

fn ill_formed(res: Result<Request, Rejected>, status: Option<u64>) {
    let rej = res.expect_err("chain should be refused");
    assert_eq!(rej.error, RequestError::IllFormedChain);
    assert_eq!(rej.status, status.map(GuestAddress));
    assert_eq!(rej.error.status(), crate::virtio::Status::IoErr);
}

fn setup(mem: &GuestMem) -> Driver<'_> {
    let d = Driver::new(mem, 16);
    d.header(VIRTIO_BLK_T_IN, 0);
    d
}

#[test]
fn status_descriptor_readable() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    ill_formed(d.parse_chain(&limits(), &[r(HDR, 16), r(STATUS, 1)]), None);
    // Writable data first, then a readable "status": the status byte would
    // land in the data buffer, and the chain is out of order anyway.
    let res = d.parse_chain(&limits(), &[r(HDR, 16), w(DATA, 512), r(STATUS, 1)]);
    ill_formed(res, Some(DATA + 511));
}

#[test]
fn status_descriptor_empty() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    ill_formed(d.parse_chain(&limits(), &[r(HDR, 16), w(STATUS, 0)]), None);
    ill_formed(
        d.parse_chain(&limits(), &[r(HDR, 16), w(DATA, 512), w(STATUS, 0)]),
        None,
    );
}

#[test]
fn status_byte_outside_guest_memory() {
    // Nothing can report this request's status: refuse it before any I/O
    // rather than run a write the guest can never see complete.
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_OUT, 0);
    for status in [w(C_END, 1), w(A_END + 0x100, 1), w(A_END - 4, 8)] {
        let res = d.parse_chain(&limits(), &[r(HDR, 16), r(DATA, 512), status]);
        let rej = res.expect_err("status outside memory");
        assert_eq!(
            (rej.status, rej.error),
            (None, RequestError::BadAddress),
            "{status:?}"
        );
    }
}

#[test]
fn readable_after_writable() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    let res = d.parse_chain(
        &limits(),
        &[r(HDR, 16), w(DATA, 512), r(DATA + 0x1000, 512), status()],
    );
    ill_formed(res, Some(STATUS));
    let res = d.parse_chain(&limits(), &[w(DATA, 512), r(HDR, 16), status()]);
    ill_formed(res, Some(STATUS));
}

#[test]
fn next_pointing_back_is_a_loop() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    // 0 -> 1 -> 2 -> 0 -> ...
    d.post_raw(
        0,
        &[
            r(HDR, 16).with_next(1),
            w(DATA, 512).with_next(2),
            w(STATUS, 1).with_next(0),
        ],
    );
    ill_formed(d.parse(&limits()), Some(STATUS));
    // A descriptor pointing at itself, readable only: no status byte.
    d.post_raw(5, &[r(HDR, 16).with_next(5)]);
    ill_formed(d.parse(&limits()), None);
}

#[test]
fn next_outside_the_table() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    d.post_raw(0, &[r(HDR, 16).with_next(1), w(STATUS, 1).with_next(16)]);
    ill_formed(d.parse(&limits()), Some(STATUS));
}

#[test]
fn head_outside_the_table() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    d.post_head(200);
    let rej = d.parse(&limits()).unwrap_err();
    assert_eq!(rej.head, 200);
    ill_formed(Err(rej), None);
}

#[test]
fn chain_using_the_whole_table_is_fine() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    let mut descs = vec![r(HDR, 16)];
    descs.extend((0..14).map(|i| w(DATA + i * 0x1000, 512)));
    descs.push(status());
    let l = DeviceLimits {
        seg_max: 16,
        ..limits()
    };
    let req = d.parse_chain(&l, &descs).unwrap();
    assert_eq!(req.data().iovecs().len(), 14);
}

#[test]
fn chain_of_more_than_two_gigabytes_is_refused() {
    // virtio-queue stops at 2^32 bytes in total; the chain looks cut short.
    let mem = guest_memory();
    let mut d = setup(&mem);
    let res = d.parse_chain(
        &limits(),
        &[r(HDR, 16), w(DATA, 0x1000), w(DATA, 0xffff_f000), status()],
    );
    ill_formed(res, Some(DATA + 0xfff));
}

#[test]
fn indirect_table_is_followed() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    let table = [r(HDR, 16), w(DATA, 4096), w(DATA + 0x2000, 1024), status()];
    d.write_table(TABLE, &table);
    let req = d
        .parse_chain(&limits(), &[indirect(TABLE, 4 * 16)])
        .unwrap();
    assert_eq!(req.kind(), RequestKind::Read { sector: 0 });
    assert_eq!(req.data_len(), 5120);
    assert_iovecs(&mem, &req, &[(DATA, 4096), (DATA + 0x2000, 1024)]);
    assert_eq!(req.status_addr(), GuestAddress(STATUS));
    // The indirect descriptor's WRITE flag is ignored (virtio 1.2, 2.7.5.3.2).
    let mut desc = indirect(TABLE, 4 * 16);
    desc.flags |= WRITE;
    assert!(d.parse_chain(&limits(), &[desc]).is_ok());
}

#[test]
fn indirect_table_nested() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    d.write_table(TABLE + 0x100, &[w(DATA, 512), status()]);
    d.write_table(TABLE, &[r(HDR, 16), indirect(TABLE + 0x100, 2 * 16)]);
    ill_formed(d.parse_chain(&limits(), &[indirect(TABLE, 2 * 16)]), None);
}

#[test]
fn indirect_table_bad_size() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    d.write_table(TABLE, &[r(HDR, 16), w(DATA, 512), status()]);
    for len in [0, 8, 40, 47] {
        ill_formed(d.parse_chain(&limits(), &[indirect(TABLE, len)]), None);
    }
    // A table shorter than its chain: the last entry points out of it.
    ill_formed(
        d.parse_chain(&limits(), &[indirect(TABLE, 2 * 16)]),
        Some(DATA + 511),
    );
}

#[test]
fn indirect_table_outside_guest_memory() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    ill_formed(
        d.parse_chain(&limits(), &[indirect(A_END + 0x1000, 3 * 16)]),
        None,
    );
    ill_formed(
        d.parse_chain(&limits(), &[indirect(A_END - 16, 3 * 16)]),
        None,
    );
}

/// QEMU's default queue size (128) is below the seg_max we advertise (254),
/// and Linux puts up to seg_max + 2 descriptors in one indirect table: such
/// a chain is longer than the queue and must still be served.
#[test]
fn indirect_chain_longer_than_the_queue_within_seg_max() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    let l = DeviceLimits {
        seg_max: 64,
        ..limits()
    };
    let chain = |n: u64| {
        let mut v = vec![r(HDR, 16)];
        v.extend((0..n).map(|i| w(DATA + i * 0x1000, 512)));
        v.push(status());
        v
    };
    // 66 descriptors on a queue of 16: header, 64 segments, status.
    d.write_table(TABLE, &chain(64));
    let req = d
        .parse_chain(&l, &[indirect(TABLE, 66 * 16)])
        .expect("a valid request");
    assert_eq!(req.data_len(), 64 * 512);
}

/// Past both the queue size and seg_max + 2, the chain is ill-formed,
/// whatever it holds: the walk stops there.
#[test]
fn chain_longer_than_the_queue_and_seg_max() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    let l = limits(); // seg_max 8: the bound is the queue size, 16
    let chain = |n: u64| {
        let mut v = vec![r(HDR, 16)];
        v.extend((0..n).map(|i| w(DATA + i * 0x1000, 512)));
        v.push(status());
        v
    };
    d.write_table(TABLE, &chain(15));
    ill_formed(d.parse_chain(&l, &[indirect(TABLE, 17 * 16)]), Some(STATUS));
}

#[test]
fn indirect_loop() {
    let mem = guest_memory();
    let mut d = setup(&mem);
    DescTable::at(TABLE)
        .write(
            &mem,
            0,
            &[r(HDR, 16).with_next(1), w(STATUS, 1).with_next(0)],
        )
        .unwrap();
    ill_formed(
        d.parse_chain(&limits(), &[indirect(TABLE, 2 * 16)]),
        Some(STATUS),
    );
}
