//! `Request::parse` on well-formed chains: every request type, and every
//! rule checked against the device limits.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_SECURE_ERASE, VIRTIO_BLK_T_WRITE_ZEROES,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use vm_memory::GuestAddress;

use super::*;
use crate::virtio::Status;
use crate::virtio::testing::*;

const IOERR: Status = Status::IoErr;
const UNSUPP: Status = Status::Unsupp;

/// Parses `descs` as one chain after writing a header of `req_type` at `sector`.
fn parse(
    limits: &DeviceLimits,
    req_type: u32,
    sector: u64,
    descs: &[Desc],
) -> Result<Request, Rejected> {
    parse_at(limits, CAPACITY, req_type, sector, descs)
}

/// [`parse`] for a device of `capacity` sectors.
fn parse_at(
    limits: &DeviceLimits,
    capacity: u64,
    req_type: u32,
    sector: u64,
    descs: &[Desc],
) -> Result<Request, Rejected> {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(req_type, sector);
    d.post(descs);
    d.parse_at(limits, capacity)
}

/// Asserts a rejection with a status byte at `STATUS`, and returns its error.
fn rejected(res: Result<Request, Rejected>) -> RequestError {
    let rej = res.expect_err("request should be refused");
    assert_eq!(rej.status, Some(GuestAddress(STATUS)));
    rej.error
}

#[test]
fn read_translates_every_buffer() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_IN, 8);
    let head = d.post_at(
        3,
        &[r(HDR, 16), w(DATA, 4096), w(DATA + 0x8000, 512), status()],
    );
    let req = d.parse(&limits()).unwrap();
    assert_eq!(req.head(), head);
    assert_eq!(req.kind(), RequestKind::Read { sector: 8 });
    assert_eq!(req.data_len(), 4608);
    assert_iovecs(&mem, &req, &[(DATA, 4096), (DATA + 0x8000, 512)]);
    assert_eq!(req.status_addr(), GuestAddress(STATUS));
    assert_eq!(req.offset(), 8 * 512);
    assert_eq!(req.written_len(), 4608);
}

#[test]
fn write_takes_readable_data() {
    let req = parse(
        &limits(),
        VIRTIO_BLK_T_OUT,
        100,
        &[r(HDR, 16), r(DATA, 1024), status()],
    )
    .unwrap();
    assert_eq!(req.kind(), RequestKind::Write { sector: 100 });
    assert_eq!(req.data_len(), 1024);
    assert_eq!(req.data().iovecs().len(), 1);
    assert_eq!(req.written_len(), 0);
    assert_eq!(req.offset(), 100 * 512);
}

#[test]
fn write_data_may_share_the_header_descriptor() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_OUT, 0);
    let req = d
        .parse_chain(&limits(), &[r(HDR, 16 + 512), status()])
        .unwrap();
    assert_eq!(req.data_len(), 512);
    assert_iovecs(&mem, &req, &[(HDR + 16, 512)]);
}

#[test]
fn status_is_the_last_byte_of_the_last_writable_descriptor() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_IN, 0);
    let req = d
        .parse_chain(&limits(), &[r(HDR, 16), w(DATA, 513)])
        .unwrap();
    assert_eq!(req.status_addr(), GuestAddress(DATA + 512));
    assert_eq!(req.data_len(), 512);
    assert_iovecs(&mem, &req, &[(DATA, 512)]);
}

#[test]
fn header_may_span_two_descriptors() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    // The two halves are far apart: the header is gathered, not read in one go.
    let (lo, hi) = (HDR, HDR + 0x100);
    d.header_at(lo, VIRTIO_BLK_T_IN, 24);
    let mut tail = [0u8; 6];
    vm_memory::Bytes::read_slice(&mem, &mut tail, GuestAddress(lo + 10)).unwrap();
    vm_memory::Bytes::write_slice(&mem, &tail, GuestAddress(hi)).unwrap();
    let req = d
        .parse_chain(&limits(), &[r(lo, 10), r(hi, 6), w(DATA, 512), status()])
        .unwrap();
    assert_eq!(req.kind(), RequestKind::Read { sector: 24 });
    assert_eq!(req.data_len(), 512);
}

#[test]
fn header_across_two_adjacent_regions_is_read() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header_at(C - 8, VIRTIO_BLK_T_IN, 0x1234);
    let req = d
        .parse_chain(&limits(), &[r(C - 8, 16), w(DATA, 512), status()])
        .unwrap();
    assert_eq!(req.kind(), RequestKind::Read { sector: 0x1234 });
}

#[test]
fn buffer_across_two_adjacent_regions_gives_two_iovecs() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_IN, 0);
    let req = d
        .parse_chain(&limits(), &[r(HDR, 16), w(C - 1024, 4096), status()])
        .unwrap();
    assert_iovecs(&mem, &req, &[(C - 1024, 1024), (C, 3072)]);
}

#[test]
fn zero_length_writable_buffers_are_dropped() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_IN, 0);
    let req = d
        .parse_chain(
            &limits(),
            &[r(HDR, 16), w(DATA, 0), w(DATA + 512, 512), status()],
        )
        .unwrap();
    assert_iovecs(&mem, &req, &[(DATA + 512, 512)]);
}

#[test]
fn flush_has_no_data() {
    let req = parse(&limits(), VIRTIO_BLK_T_FLUSH, 0, &[r(HDR, 16), status()]).unwrap();
    assert_eq!(req.kind(), RequestKind::Flush);
    assert_eq!((req.data_len(), req.data().iovecs().len()), (0, 0));
    assert_eq!(req.written_len(), 0);
}

#[test]
fn get_id_writes_at_most_twenty_bytes() {
    let req = parse(
        &limits(),
        VIRTIO_BLK_T_GET_ID,
        0,
        &[r(HDR, 16), w(DATA, 20), status()],
    )
    .unwrap();
    assert_eq!(req.kind(), RequestKind::GetId);
    assert_eq!(req.data_len(), 20);
    assert_eq!(req.written_len(), 20);
    let req = parse(
        &limits(),
        VIRTIO_BLK_T_GET_ID,
        0,
        &[r(HDR, 16), w(DATA, 64), status()],
    )
    .unwrap();
    assert_eq!((req.data_len(), req.written_len()), (64, 20));
    let req = parse(
        &limits(),
        VIRTIO_BLK_T_GET_ID,
        0,
        &[r(HDR, 16), w(DATA, 8), status()],
    )
    .unwrap();
    assert_eq!(req.written_len(), 8);
}

/// Parses a discard or write-zeroes with one range.
fn parse_range(
    limits: &DeviceLimits,
    req_type: u32,
    sector: u64,
    n: u32,
    flags: u32,
) -> Result<Request, Rejected> {
    parse_range_at(limits, CAPACITY, req_type, sector, n, flags)
}

/// [`parse_range`] for a device of `capacity` sectors.
fn parse_range_at(
    limits: &DeviceLimits,
    capacity: u64,
    req_type: u32,
    sector: u64,
    n: u32,
    flags: u32,
) -> Result<Request, Rejected> {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(req_type, 0);
    d.range_at(RANGE, sector, n, flags);
    d.post(&[r(HDR, 16), r(RANGE, 16), status()]);
    d.parse_at(limits, capacity)
}

#[test]
fn discard_parses_its_range() {
    let req = parse_range(&limits(), VIRTIO_BLK_T_DISCARD, 64, 128, 0).unwrap();
    let range = DiscardRange {
        sector: 64,
        num_sectors: 128,
        unmap: false,
    };
    assert_eq!(req.kind(), RequestKind::Discard(range));
    assert_eq!((range.offset(), range.len()), (64 * 512, 128 * 512));
    assert!(!range.is_empty());
    assert_eq!(req.offset(), 64 * 512);
    assert_eq!((req.data_len(), req.written_len()), (0, 0));
}

#[test]
fn empty_range_is_valid() {
    let req = parse_range(&limits(), VIRTIO_BLK_T_DISCARD, 64, 0, 0).unwrap();
    assert!(matches!(req.kind(), RequestKind::Discard(r) if r.is_empty()));
}

#[test]
fn write_zeroes_with_and_without_unmap() {
    let unmap = VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;
    for (flags, want) in [(0, false), (unmap, true)] {
        let req = parse_range(&limits(), VIRTIO_BLK_T_WRITE_ZEROES, 8, 16, flags).unwrap();
        let range = DiscardRange {
            sector: 8,
            num_sectors: 16,
            unmap: want,
        };
        assert_eq!(req.kind(), RequestKind::WriteZeroes(range));
    }
}

#[test]
fn range_may_span_two_descriptors() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_DISCARD, 0);
    d.range_at(RANGE, 32, 8, 0);
    let req = d
        .parse_chain(
            &limits(),
            &[r(HDR, 16), r(RANGE, 8), r(RANGE + 8, 8), status()],
        )
        .unwrap();
    assert!(matches!(req.kind(), RequestKind::Discard(r) if r.sector == 32 && r.num_sectors == 8));
}

#[test]
fn unknown_types_are_unsupported() {
    for t in [2, 3, VIRTIO_BLK_T_SECURE_ERASE, 0x8000_0000, u32::MAX] {
        let rej = parse(&limits(), t, 0, &[r(HDR, 16), w(DATA, 512), status()]).unwrap_err();
        assert_eq!(rej.error, RequestError::UnsupportedType(t));
        assert_eq!(rej.error.status(), UNSUPP);
        assert_eq!(rej.status, Some(GuestAddress(STATUS)));
    }
}

#[test]
fn range_must_fit_the_capacity() {
    let l = limits();
    let cap = CAPACITY;
    let read = |sector, len| {
        parse(
            &l,
            VIRTIO_BLK_T_IN,
            sector,
            &[r(HDR, 16), w(DATA, len), status()],
        )
    };
    // Ending exactly at the capacity is fine, one sector more is not.
    assert!(read(cap - 2, 1024).is_ok());
    assert_eq!(rejected(read(cap - 1, 1024)), RequestError::OutOfRange);
    assert_eq!(rejected(read(cap, 512)), RequestError::OutOfRange);
    assert!(read(cap, 0).is_ok());
    assert_eq!(rejected(read(cap + 1, 0)), RequestError::OutOfRange);
    assert_eq!(RequestError::OutOfRange.status(), IOERR);
}

#[test]
fn sector_arithmetic_must_not_overflow() {
    // With the capacity at the maximum, only the overflow check can refuse.
    let (l, max) = (limits(), u64::MAX);
    let res = parse_at(
        &l,
        max,
        VIRTIO_BLK_T_OUT,
        u64::MAX,
        &[r(HDR, 16), r(DATA, 512), status()],
    );
    assert_eq!(rejected(res), RequestError::OutOfRange);
    let res = parse_at(
        &l,
        max,
        VIRTIO_BLK_T_IN,
        u64::MAX - 1,
        &[r(HDR, 16), w(DATA, 1024), status()],
    );
    assert_eq!(rejected(res), RequestError::OutOfRange);
    let res = parse_range_at(&l, max, VIRTIO_BLK_T_DISCARD, u64::MAX - 3, 8, 0);
    assert_eq!(rejected(res), RequestError::OutOfRange);
    let res = parse_range_at(&l, max, VIRTIO_BLK_T_WRITE_ZEROES, u64::MAX, 1, 0);
    assert_eq!(rejected(res), RequestError::OutOfRange);
}

#[test]
fn data_length_must_be_whole_sectors() {
    let res = parse(
        &limits(),
        VIRTIO_BLK_T_OUT,
        0,
        &[r(HDR, 16), r(DATA, 700), status()],
    );
    assert_eq!(rejected(res), RequestError::BadLength);
    // Two buffers that add up to whole sectors are fine.
    let res = parse(
        &limits(),
        VIRTIO_BLK_T_OUT,
        0,
        &[r(HDR, 16), r(DATA, 100), r(DATA + 0x1000, 412), status()],
    );
    assert_eq!(res.unwrap().data_len(), 512);
    let res = parse(
        &limits(),
        VIRTIO_BLK_T_IN,
        0,
        &[r(HDR, 16), w(DATA, 511), status()],
    );
    assert_eq!(rejected(res), RequestError::BadLength);
    assert_eq!(RequestError::BadLength.status(), IOERR);
}

#[test]
fn four_k_blocks_want_whole_aligned_blocks() {
    let l = DeviceLimits {
        block_size: 4096,
        ..limits()
    };
    let read = |sector, len| {
        parse(
            &l,
            VIRTIO_BLK_T_IN,
            sector,
            &[r(HDR, 16), w(DATA, len), status()],
        )
    };
    assert_eq!(read(8, 4096).unwrap().kind, RequestKind::Read { sector: 8 });
    assert_eq!(rejected(read(0, 512)), RequestError::BadLength);
    assert_eq!(rejected(read(0, 4096 + 512)), RequestError::BadLength);
    assert_eq!(rejected(read(1, 4096)), RequestError::Misaligned);
    assert_eq!(rejected(read(4, 4096)), RequestError::Misaligned);
    assert_eq!(RequestError::Misaligned.status(), IOERR);
    // Discard ranges follow the same alignment.
    assert!(parse_range(&l, VIRTIO_BLK_T_DISCARD, 16, 8, 0).is_ok());
    assert_eq!(
        rejected(parse_range(&l, VIRTIO_BLK_T_DISCARD, 16, 4, 0)),
        RequestError::Misaligned
    );
    assert_eq!(
        rejected(parse_range(&l, VIRTIO_BLK_T_WRITE_ZEROES, 3, 8, 0)),
        RequestError::Misaligned
    );
}

#[test]
fn read_only_refuses_every_write() {
    let l = DeviceLimits {
        readonly: true,
        ..limits()
    };
    let res = parse(
        &l,
        VIRTIO_BLK_T_OUT,
        0,
        &[r(HDR, 16), r(DATA, 512), status()],
    );
    assert_eq!(rejected(res), RequestError::ReadOnly);
    assert_eq!(
        rejected(parse_range(&l, VIRTIO_BLK_T_DISCARD, 0, 8, 0)),
        RequestError::ReadOnly
    );
    assert_eq!(
        rejected(parse_range(&l, VIRTIO_BLK_T_WRITE_ZEROES, 0, 8, 0)),
        RequestError::ReadOnly
    );
    assert_eq!(RequestError::ReadOnly.status(), IOERR);
    // Reads, flushes and GET_ID are still served.
    assert!(
        parse(
            &l,
            VIRTIO_BLK_T_IN,
            0,
            &[r(HDR, 16), w(DATA, 512), status()]
        )
        .is_ok()
    );
    assert!(parse(&l, VIRTIO_BLK_T_FLUSH, 0, &[r(HDR, 16), status()]).is_ok());
    assert!(
        parse(
            &l,
            VIRTIO_BLK_T_GET_ID,
            0,
            &[r(HDR, 16), w(DATA, 20), status()]
        )
        .is_ok()
    );
}

#[test]
fn data_in_the_wrong_direction() {
    let l = limits();
    let cases: [(u32, &[Desc]); 4] = [
        (VIRTIO_BLK_T_IN, &[r(HDR, 16), r(DATA, 512), status()]),
        (VIRTIO_BLK_T_OUT, &[r(HDR, 16), w(DATA, 512), status()]),
        (VIRTIO_BLK_T_GET_ID, &[r(HDR, 16), r(DATA, 20), status()]),
        (VIRTIO_BLK_T_IN, &[r(HDR, 16 + 512), w(DATA, 512), status()]),
    ];
    for (t, descs) in cases {
        assert_eq!(
            rejected(parse(&l, t, 0, descs)),
            RequestError::WrongDirection,
            "type {t}"
        );
    }
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_DISCARD, 0);
    d.range_at(RANGE, 0, 8, 0);
    let res = d.parse_chain(&l, &[r(HDR, 16), r(RANGE, 16), w(DATA, 16), status()]);
    assert_eq!(rejected(res), RequestError::WrongDirection);
    assert_eq!(RequestError::WrongDirection.status(), IOERR);
}

/// One request carries at most MAX_DATA_BYTES (seg_max x size_max), however
/// its segments are laid out: all of them may point at one buffer.
#[test]
fn data_past_the_request_maximum_is_refused() {
    use crate::virtio::request::MAX_DATA_BYTES;
    let l = DeviceLimits {
        seg_max: 254,
        ..limits()
    };
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_OUT, 0);
    let seg = 1 << 20; // inside region A, the same buffer each time
    let mut post = |n: usize| {
        let mut table = vec![r(HDR, 16)];
        table.extend((0..n).map(|_| r(DATA, seg)));
        table.push(status());
        d.write_table(TABLE, &table);
        d.parse_chain(&l, &[indirect(TABLE, 16 * table.len() as u32)])
    };
    let n = (MAX_DATA_BYTES / seg) as usize;
    assert!(post(n).is_ok());
    assert_eq!(rejected(post(n + 1)), RequestError::TooLarge);
    assert_eq!(RequestError::TooLarge.status(), IOERR);
}

#[test]
fn at_most_seg_max_data_segments() {
    let l = limits();
    let chain = |n: u64| {
        let mut v = vec![r(HDR, 16)];
        v.extend((0..n).map(|i| w(DATA + i * 0x1000, 512)));
        v.push(status());
        v
    };
    let req = parse(&l, VIRTIO_BLK_T_IN, 0, &chain(8)).unwrap();
    assert_eq!(req.data().iovecs().len(), 8);
    assert_eq!(
        rejected(parse(&l, VIRTIO_BLK_T_IN, 0, &chain(9))),
        RequestError::TooManySegments
    );
    // The status byte sharing the last data descriptor is not a segment of its own.
    let mut v = chain(8);
    v.pop();
    v.last_mut().unwrap().len += 1;
    assert_eq!(
        parse(&l, VIRTIO_BLK_T_IN, 0, &v)
            .unwrap()
            .data()
            .iovecs()
            .len(),
        8
    );
    assert_eq!(RequestError::TooManySegments.status(), IOERR);
}

#[test]
fn discard_flags_are_checked() {
    let l = limits();
    // UNMAP is a write-zeroes flag: on a discard it is UNSUPP (virtio 1.2, 5.2.6.2).
    let unmap = VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;
    let rej = parse_range(&l, VIRTIO_BLK_T_DISCARD, 0, 8, unmap).unwrap_err();
    assert_eq!(rej.error, RequestError::UnsupportedFlags);
    assert_eq!(rej.error.status(), UNSUPP);
    for flags in [2, 0x8000_0000, unmap | 4] {
        let res = parse_range(&l, VIRTIO_BLK_T_WRITE_ZEROES, 0, 8, flags);
        assert_eq!(
            rejected(res),
            RequestError::UnsupportedFlags,
            "flags {flags:#x}"
        );
        let res = parse_range(&l, VIRTIO_BLK_T_DISCARD, 0, 8, flags);
        assert_eq!(
            rejected(res),
            RequestError::UnsupportedFlags,
            "flags {flags:#x}"
        );
    }
}

#[test]
fn ranges_are_bounded() {
    let l = limits();
    assert!(parse_range(&l, VIRTIO_BLK_T_DISCARD, 0, 1024, 0).is_ok());
    assert_eq!(
        rejected(parse_range(&l, VIRTIO_BLK_T_DISCARD, 0, 1025, 0)),
        RequestError::RangeTooLong
    );
    assert!(parse_range(&l, VIRTIO_BLK_T_WRITE_ZEROES, 0, 2048, 0).is_ok());
    let res = parse_range(&l, VIRTIO_BLK_T_WRITE_ZEROES, 0, 2049, 0);
    assert_eq!(rejected(res), RequestError::RangeTooLong);
    assert_eq!(RequestError::RangeTooLong.status(), IOERR);
    // Within the maximum but past the capacity.
    let cap = CAPACITY;
    assert_eq!(
        rejected(parse_range(&l, VIRTIO_BLK_T_DISCARD, cap - 4, 8, 0)),
        RequestError::OutOfRange
    );
}

#[test]
fn range_payload_must_be_one_whole_range() {
    let l = limits();
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.range_at(RANGE, 0, 8, 0);
    d.range_at(RANGE + 16, 8, 8, 0);
    // As qemu-storage-daemon answers: short of one range is IOERR, more
    // than the one range advertised is UNSUPP (not a failed disk).
    for t in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
        d.header(t, 0);
        for (len, want, code) in [
            (0, RequestError::BadLength, IOERR),
            (8, RequestError::BadLength, IOERR),
            (24, RequestError::TooManyRanges, UNSUPP),
            (32, RequestError::TooManyRanges, UNSUPP),
        ] {
            let res = d.parse_chain(&l, &[r(HDR, 16), r(RANGE, len), status()]);
            let err = rejected(res);
            assert_eq!(err, want, "type {t}, {len} bytes");
            assert_eq!(err.status(), code, "type {t}, {len} bytes");
        }
        // Two ranges in two descriptors are two ranges too.
        let res = d.parse_chain(&l, &[r(HDR, 16), r(RANGE, 16), r(RANGE + 16, 16), status()]);
        assert_eq!(rejected(res), RequestError::TooManyRanges, "type {t}");
    }
}

#[test]
fn buffers_outside_guest_memory() {
    let l = limits();
    let cases: [(u32, &[Desc]); 6] = [
        // Past the end of memory.
        (VIRTIO_BLK_T_IN, &[r(HDR, 16), w(C_END, 512), status()]),
        // In the hole.
        (
            VIRTIO_BLK_T_OUT,
            &[r(HDR, 16), r(A_END + 0x1000, 512), status()],
        ),
        // Starting in memory, running into the hole.
        (
            VIRTIO_BLK_T_IN,
            &[r(HDR, 16), w(A_END - 256, 512), status()],
        ),
        // Ending in memory, starting in the hole (the second buffer).
        (
            VIRTIO_BLK_T_IN,
            &[r(HDR, 16), w(DATA, 512), w(B - 512, 1024), status()],
        ),
        // Wrapping around the address space.
        (
            VIRTIO_BLK_T_OUT,
            &[r(HDR, 16), r(u64::MAX - 255, 512), status()],
        ),
        // GET_ID's buffer counts too.
        (
            VIRTIO_BLK_T_GET_ID,
            &[r(HDR, 16), w(C_END - 8, 20), status()],
        ),
    ];
    for (i, (t, descs)) in cases.into_iter().enumerate() {
        assert_eq!(
            rejected(parse(&l, t, 0, descs)),
            RequestError::BadAddress,
            "case {i}"
        );
    }
    assert_eq!(RequestError::BadAddress.status(), IOERR);
}

#[test]
fn header_or_range_outside_guest_memory() {
    let l = limits();
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    let res = d.parse_chain(&l, &[r(A_END - 8, 16), w(DATA, 512), status()]);
    assert_eq!(rejected(res), RequestError::BadAddress);
    let res = d.parse_chain(&l, &[r(C_END, 16), status()]);
    assert_eq!(rejected(res), RequestError::BadAddress);
    d.header(VIRTIO_BLK_T_DISCARD, 0);
    let res = d.parse_chain(&l, &[r(HDR, 16), r(A_END - 8, 16), status()]);
    assert_eq!(rejected(res), RequestError::BadAddress);
}

#[test]
fn header_must_be_sixteen_readable_bytes() {
    let l = limits();
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.header(VIRTIO_BLK_T_FLUSH, 0);
    for descs in [
        &[r(HDR, 8), status()][..],
        &[r(HDR, 8), r(HDR + 8, 7), status()][..],
        // Header in a writable descriptor: the device may not read it.
        &[w(HDR, 16), status()][..],
        &[w(HDR, 16), w(DATA, 512), status()][..],
        &[status()][..],
    ] {
        let res = d.parse_chain(&l, descs);
        assert_eq!(rejected(res), RequestError::ShortHeader, "{descs:?}");
    }
    assert_eq!(RequestError::ShortHeader.status(), IOERR);
}
