//! A hostile front-end over a real socket (issue 5, items 4 and 5).
//!
//! A. Malformed vhost-user messages, written byte by byte: each must get an
//!    error reply (REPLY_ACK status != 0) or a disconnect, never a crash.
//! B. Malformed descriptor chains from a hostile guest, on a device set up
//!    by a raw front-end on memory it shares itself: each must come back
//!    with VIRTIO_BLK_S_IOERR or S_UNSUPP, or with used length 0, and the
//!    same queue must serve a valid request posted right after.
//!
//! After every case the hostile connection is closed and the daemon must
//! still serve: it is running, and a fresh blkio client writes 4 KiB and
//! reads the same bytes back (`frontend::assert_serves`).
//!
//! Each catalogue prints what the daemon answered to each case (run with
//! `--nocapture` to see it).

use std::os::fd::{AsRawFd, RawFd};
use std::thread;
use std::time::{Duration, Instant};

use ringblk::virtio::chain_writer::{Desc, indirect as ind, link, readable as r, writable as w};
use ringblk_testkit::frontend::*;
use ringblk_testkit::{Daemon, MIB};
use vmm_sys_util::eventfd::EventFd;

/// The daemon's default queue count and maximum queue size.
const MAX_QUEUE_SIZE: u32 = 256;

// ---------------------------------------------------------------------------
// Connections come and go

/// Every connection's fds are released when it ends: reconnects (raw
/// front-ends that only negotiate, and blkio clients) leave the daemon
/// with the fds it had. vhost-user-backend used to leak an eventfd per
/// queue per connection (see `ExitEvents` in src/vhost/backend.rs).
#[test]
fn reconnects_release_their_fds() {
    let mut d = Daemon::start(64 * MIB, &["--queues", "2"]);
    assert_serves(&mut d, "the first connection", 0, 0);
    thread::sleep(Duration::from_millis(200));
    let baseline = fd_count(d.pid());
    for i in 0..10u8 {
        let c = Conn::connect(&d.socket);
        c.handshake(0);
        drop(c);
        assert_serves(&mut d, "a reconnect", 8192 * (u64::from(i) + 1), i);
    }
    assert_no_fd_leak(&d, baseline);
}

/// Waits (up to 10 s) until the daemon has no more open fds than
/// `baseline`: every connection's fds are released when it ends.
fn assert_no_fd_leak(d: &Daemon, baseline: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = fd_count(d.pid());
        if n <= baseline {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon holds {n} fds once idle again, {baseline} before: a leak"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------
// A. Malformed vhost-user messages

/// What a connection goes through before the hostile message.
#[derive(Clone, Copy, Debug)]
enum Setup {
    /// Nothing: the hostile bytes are the first on the connection.
    Raw,
    /// Features and protocol features negotiated (REPLY_ACK on), no
    /// SET_OWNER: what QEMU does before SET_OWNER.
    Negotiated,
    /// SET_OWNER and the negotiation (`Conn::handshake`).
    Owned,
    /// `Owned`, then the standard guest memory shared.
    Memory,
}

/// What the daemon must answer.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// An error reply (status != 0) or a disconnect.
    Refused,
    /// Success: allowed by the protocol (documented, not hostile per se).
    Accepted,
    /// GET_INFLIGHT_FD refused: mmap_size 0 and no fd, or a disconnect.
    NoInflight,
    /// GET_CONFIG refused: a reply with size 0, or a disconnect.
    NoConfig,
}

impl Expect {
    fn holds(self, out: &Outcome) -> bool {
        match (self, out) {
            (Expect::Refused, o) => o.is_refusal(),
            (Expect::Accepted, Outcome::Reply(m)) => m.payload.len() == 8 && m.u64() == Some(0),
            (Expect::NoInflight | Expect::NoConfig, Outcome::Closed) => true,
            (Expect::NoInflight, Outcome::Reply(m)) => {
                m.payload.len() == 24 && m.u64() == Some(0) && m.fd.is_none()
            }
            (Expect::NoConfig, Outcome::Reply(m)) => {
                m.payload.len() == 12 && m.payload[4..8] == [0; 4]
            }
            _ => false,
        }
    }
}

type Run = Box<dyn Fn(&Conn, &Guest) -> Outcome>;

struct Case {
    name: String,
    setup: Setup,
    expect: Expect,
    run: Run,
}

fn case(
    name: impl Into<String>,
    setup: Setup,
    expect: Expect,
    run: impl Fn(&Conn, &Guest) -> Outcome + 'static,
) -> Case {
    Case {
        name: name.into(),
        setup,
        expect,
        run: Box::new(run),
    }
}

/// Runs each case on a fresh connection, closes it, and checks that the
/// daemon still serves. Every case runs even if an earlier one answered
/// wrongly (they are reported together); a daemon that stops serving
/// fails at once.
fn run_catalogue(d: &mut Daemon, group: &str, cases: Vec<Case>) {
    assert_serves(d, "the first connection", 0, 0);
    thread::sleep(Duration::from_millis(200));
    let baseline = fd_count(d.pid());
    let mut report = Vec::new();
    let mut wrong = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let conn = Conn::connect(&d.socket);
        let g = Guest::new();
        match c.setup {
            Setup::Raw => {}
            Setup::Negotiated => negotiate(&conn),
            Setup::Owned => {
                conn.handshake(0);
            }
            Setup::Memory => {
                conn.handshake(0);
                g.share(&conn);
            }
        }
        let out = (c.run)(&conn, &g);
        report.push(format!("  {:<66} {}", c.name, out.describe()));
        if !c.expect.holds(&out) {
            wrong.push(format!(
                "{}: expected {:?}, got {}",
                c.name,
                c.expect,
                out.describe()
            ));
        }
        drop(conn);
        let what = format!("{group}: {}", c.name);
        assert_serves(d, &what, (i as u64 + 1) * 8192, i as u8 + 1);
    }
    eprintln!("{group}:\n{}", report.join("\n"));
    assert!(
        wrong.is_empty(),
        "{group}: {} case(s) answered wrongly:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    assert_no_fd_leak(d, baseline);
}

/// GET/SET_FEATURES and GET/SET_PROTOCOL_FEATURES without SET_OWNER.
fn negotiate(conn: &Conn) {
    let offered = conn.get(GET_FEATURES, &[]).u64().expect("GET_FEATURES");
    let want = F_VERSION_1 | F_PROTOCOL_FEATURES;
    assert_eq!(offered & want, want);
    conn.send(SET_FEATURES, FLAG_VERSION, &u64_payload(want), &[])
        .expect("SET_FEATURES");
    conn.get(GET_PROTOCOL_FEATURES, &[]);
    conn.send(
        SET_PROTOCOL_FEATURES,
        FLAG_VERSION,
        &u64_payload(PROTOCOL),
        &[],
    )
    .expect("SET_PROTOCOL_FEATURES");
}

/// A well-framed message with NEED_REPLY.
fn ask(request: u32, payload: Vec<u8>) -> impl Fn(&Conn, &Guest) -> Outcome {
    move |c: &Conn, _: &Guest| c.ask(request, &payload, &[])
}

/// Raw bytes, then the answer to `request`.
fn raw(request: u32, bytes: Vec<u8>, close: bool) -> impl Fn(&Conn, &Guest) -> Outcome {
    move |c: &Conn, _: &Guest| {
        let _ = c.send_raw(&bytes, &[]);
        if close {
            c.shutdown_write();
        }
        c.answer(request)
    }
}

fn hdr_and(request: u32, size: u32, payload: &[u8]) -> Vec<u8> {
    [
        &header(request, FLAG_VERSION | FLAG_NEED_REPLY, size)[..],
        payload,
    ]
    .concat()
}

#[test]
fn malformed_framing() {
    use Expect::*;
    use Setup::*;
    let mut d = Daemon::start(64 * MIB, &[]);
    let cases = vec![
        case(
            "SET_FEATURES with a 4-byte payload (too short)",
            Owned,
            Refused,
            ask(SET_FEATURES, vec![0; 4]),
        ),
        case(
            "SET_VRING_NUM with a 4-byte payload (too short)",
            Owned,
            Refused,
            ask(SET_VRING_NUM, vec![0; 4]),
        ),
        case(
            "GET_FEATURES with an 8-byte payload (too long)",
            Owned,
            Refused,
            ask(GET_FEATURES, vec![0; 8]),
        ),
        case(
            "SET_VRING_NUM with a 16-byte payload (too long)",
            Owned,
            Refused,
            ask(SET_VRING_NUM, [vring_state(0, 64), vec![0; 8]].concat()),
        ),
        case(
            "SET_OWNER with an 8-byte payload",
            Negotiated,
            Refused,
            ask(SET_OWNER, vec![0; 8]),
        ),
        case(
            "size field 64, 8 bytes sent, then close",
            Owned,
            Refused,
            raw(SET_FEATURES, hdr_and(SET_FEATURES, 64, &[0; 8]), true),
        ),
        case(
            "header cut after 6 bytes, then close",
            Owned,
            Refused,
            raw(
                GET_FEATURES,
                header(GET_FEATURES, FLAG_VERSION, 0)[..6].to_vec(),
                true,
            ),
        ),
        case(
            "size field of 1 MiB (4 KiB sent)",
            Owned,
            Refused,
            raw(SET_CONFIG, hdr_and(SET_CONFIG, 1 << 20, &[0; 4096]), false),
        ),
        case(
            "size field of 4 GiB - 1",
            Owned,
            Refused,
            raw(SET_CONFIG, hdr_and(SET_CONFIG, u32::MAX, &[0; 64]), false),
        ),
        case(
            "SET_CONFIG of 8 KiB (over the protocol's 4 KiB)",
            Owned,
            Refused,
            ask(SET_CONFIG, config(0, 8192 - 12, &[0; 8192 - 12])),
        ),
        case("unknown request code 0", Owned, Refused, ask(0, vec![])),
        case(
            "unknown request code 99",
            Owned,
            Refused,
            ask(99, vec![0; 8]),
        ),
        case(
            "unknown request code 0xffffffff",
            Owned,
            Refused,
            ask(u32::MAX, vec![]),
        ),
        case(
            "unknown request code 99 as the first message",
            Raw,
            Refused,
            ask(99, vec![]),
        ),
        case(
            "version 0 in the flags",
            Owned,
            Refused,
            |c: &Conn, _: &Guest| {
                c.ask_flags(SET_VRING_NUM, FLAG_NEED_REPLY, &vring_state(0, 64), &[])
            },
        ),
        case(
            "REPLY flag set on a request",
            Owned,
            Refused,
            |c: &Conn, _: &Guest| {
                let flags = FLAG_VERSION | FLAG_NEED_REPLY | FLAG_REPLY;
                c.ask_flags(SET_VRING_NUM, flags, &vring_state(0, 64), &[])
            },
        ),
        case(
            "three fds on GET_FEATURES, which takes none",
            Owned,
            Refused,
            |c: &Conn, g: &Guest| {
                let fd = g.file.as_raw_fd();
                c.ask_flags(GET_FEATURES, FLAG_VERSION, &[], &[fd, fd, fd])
            },
        ),
        case(
            "SET_OWNER a second time",
            Owned,
            Refused,
            ask(SET_OWNER, vec![]),
        ),
        // QEMU negotiates (protocol) features before SET_OWNER, so those
        // must work; what follows is accepted too: the protocol gives
        // SET_OWNER no gatekeeping role and the crate keeps none.
        case(
            "SET_MEM_TABLE before SET_OWNER (accepted)",
            Negotiated,
            Accepted,
            |c: &Conn, g: &Guest| {
                let fds = [g.file.as_raw_fd(); 2];
                c.ask(SET_MEM_TABLE, &mem_table(2, &g.regions), &fds)
            },
        ),
        case(
            "SET_VRING_NUM before SET_OWNER (accepted)",
            Negotiated,
            Accepted,
            ask(SET_VRING_NUM, vring_state(0, 64)),
        ),
    ];
    run_catalogue(&mut d, "malformed framing", cases);
}

/// SET_MEM_TABLE with `regions` and `nfds` copies of the guest memfd.
fn table(regions: Vec<Region>, nfds: usize) -> impl Fn(&Conn, &Guest) -> Outcome {
    move |c: &Conn, g: &Guest| {
        let fds = vec![g.file.as_raw_fd(); nfds];
        c.ask(
            SET_MEM_TABLE,
            &mem_table(regions.len() as u32, &regions),
            &fds,
        )
    }
}

#[test]
fn malformed_memory_tables() {
    use Expect::*;
    use Setup::*;
    let mut d = Daemon::start(64 * MIB, &[]);
    const VA: u64 = 0x7000_0000_0000;
    let many = |n: u64| -> Vec<Region> {
        (0..n)
            .map(|i| region(i * MIB, MIB, VA + i * MIB, i * MIB))
            .collect()
    };
    let cases = vec![
        case(
            "overlapping regions",
            Owned,
            Refused,
            table(
                vec![
                    region(0, 2 * MIB, VA, 0),
                    region(MIB, 2 * MIB, VA + 4 * MIB, 4 * MIB),
                ],
                2,
            ),
        ),
        case(
            "two regions at the same guest address",
            Owned,
            Refused,
            table(
                vec![region(0, MIB, VA, 0), region(0, MIB, VA + 2 * MIB, 2 * MIB)],
                2,
            ),
        ),
        case(
            "a region of size 0",
            Owned,
            Refused,
            table(vec![region(0, 0, VA, 0)], 1),
        ),
        case(
            "a region whose guest address + size overflows",
            Owned,
            Refused,
            table(vec![region(u64::MAX - 4095, MIB, VA, 0)], 1),
        ),
        case("num_regions 0", Owned, Refused, |c: &Conn, g: &Guest| {
            c.ask(SET_MEM_TABLE, &mem_table(0, &[]), &[g.file.as_raw_fd()])
        }),
        case("9 regions with 9 fds", Owned, Refused, table(many(9), 9)),
        case(
            "33 regions (more than the protocol's 32)",
            Owned,
            Refused,
            table(many(33), 8),
        ),
        case(
            "num_regions 2, one region sent",
            Owned,
            Refused,
            |c: &Conn, g: &Guest| {
                let fds = [g.file.as_raw_fd(); 2];
                c.ask(SET_MEM_TABLE, &mem_table(2, &g.regions[..1]), &fds)
            },
        ),
        case(
            "one region, no fd",
            Owned,
            Refused,
            table(vec![region(0, MIB, VA, 0)], 0),
        ),
        case(
            "one region, two fds",
            Owned,
            Refused,
            table(vec![region(0, MIB, VA, 0)], 2),
        ),
        case(
            "a region backed by an eventfd (not mappable)",
            Owned,
            Refused,
            |c: &Conn, _: &Guest| {
                let e = EventFd::new(0).expect("eventfd");
                let t = mem_table(1, &[region(0, MIB, VA, 0)]);
                c.ask(SET_MEM_TABLE, &t, &[e.as_raw_fd()])
            },
        ),
        case(
            "ADD_MEM_REG without an fd",
            Owned,
            Refused,
            ask(ADD_MEM_REG, single_region(&region(0, MIB, VA, 0))),
        ),
        case(
            "ADD_MEM_REG of size 0",
            Owned,
            Refused,
            |c: &Conn, g: &Guest| {
                let p = single_region(&region(0, 0, VA, 0));
                c.ask(ADD_MEM_REG, &p, &[g.file.as_raw_fd()])
            },
        ),
        case(
            "ADD_MEM_REG overlapping the shared memory",
            Memory,
            Refused,
            |c: &Conn, g: &Guest| {
                let p = single_region(&region(MIB, MIB, VA, 0));
                c.ask(ADD_MEM_REG, &p, &[g.file.as_raw_fd()])
            },
        ),
    ];
    run_catalogue(&mut d, "malformed memory tables", cases);
}

/// SET_VRING_ADDR of queue 0 with front-end virtual addresses.
fn addr(desc: u64, used: u64, avail: u64) -> impl Fn(&Conn, &Guest) -> Outcome {
    move |c: &Conn, _: &Guest| c.ask(SET_VRING_ADDR, &vring_addr(0, desc, used, avail), &[])
}

/// SET_VRING_KICK/CALL/ERR payload `value` with `nfds` eventfds.
fn vring_fd(request: u32, value: u64, nfds: usize) -> impl Fn(&Conn, &Guest) -> Outcome {
    move |c: &Conn, _: &Guest| {
        let evs: Vec<EventFd> = (0..nfds)
            .map(|_| EventFd::new(0).expect("eventfd"))
            .collect();
        let fds: Vec<RawFd> = evs.iter().map(|e| e.as_raw_fd()).collect();
        c.ask(request, &u64_payload(value), &fds)
    }
}

#[test]
fn malformed_vring_messages() {
    use Expect::*;
    use Setup::*;
    let mut d = Daemon::start(64 * MIB, &[]);
    let mut cases = vec![
        case(
            "SET_VRING_ADDR outside the shared memory",
            Memory,
            Refused,
            addr(0x10, 0x2000, 0x1000),
        ),
        case(
            "SET_VRING_ADDR with only the used ring outside",
            Memory,
            Refused,
            |c: &Conn, g: &Guest| {
                let a = vring_addr(0, g.va(0), 0x10, g.va(0x1000));
                c.ask(SET_VRING_ADDR, &a, &[])
            },
        ),
        case(
            "SET_VRING_ADDR before any memory table",
            Owned,
            Refused,
            addr(0x7000_0000_0000, 0x7000_0000_2000, 0x7000_0000_1000),
        ),
        case(
            "SET_VRING_ADDR with a misaligned descriptor table",
            Memory,
            Refused,
            |c: &Conn, g: &Guest| {
                let a = vring_addr(0, g.va(0) + 8, g.va(0x2000), g.va(0x1000));
                c.ask(SET_VRING_ADDR, &a, &[])
            },
        ),
        case(
            "SET_VRING_ADDR with unknown flags",
            Memory,
            Refused,
            |c: &Conn, g: &Guest| {
                let mut a = vring_addr(0, g.va(0), g.va(0x2000), g.va(0x1000));
                a[4..8].copy_from_slice(&0xffu32.to_le_bytes());
                c.ask(SET_VRING_ADDR, &a, &[])
            },
        ),
    ];
    for index in [1u32, 64, 255, 256, u32::MAX] {
        let name = |what: &str| format!("{what} of queue {index:#x}");
        cases.push(case(
            name("SET_VRING_NUM"),
            Memory,
            Refused,
            ask(SET_VRING_NUM, vring_state(index, 64)),
        ));
        cases.push(case(
            name("SET_VRING_ADDR"),
            Memory,
            Refused,
            move |c: &Conn, g: &Guest| {
                let a = vring_addr(index, g.va(0), g.va(0x2000), g.va(0x1000));
                c.ask(SET_VRING_ADDR, &a, &[])
            },
        ));
        cases.push(case(
            name("SET_VRING_BASE"),
            Memory,
            Refused,
            ask(SET_VRING_BASE, vring_state(index, 0)),
        ));
        cases.push(case(
            name("SET_VRING_ENABLE"),
            Memory,
            Refused,
            ask(SET_VRING_ENABLE, vring_state(index, 1)),
        ));
        cases.push(case(
            name("GET_VRING_BASE"),
            Memory,
            Refused,
            ask(GET_VRING_BASE, vring_state(index, 0)),
        ));
    }
    // KICK/CALL/ERR carry the index in bits 0-7 and "no fd" in bit 8.
    for (request, what) in [
        (SET_VRING_KICK, "SET_VRING_KICK"),
        (SET_VRING_CALL, "SET_VRING_CALL"),
        (SET_VRING_ERR, "SET_VRING_ERR"),
    ] {
        let name = |s: &str| format!("{what} {s}");
        cases.push(case(
            name("of queue 1, with an fd"),
            Memory,
            Refused,
            vring_fd(request, 1, 1),
        ));
        cases.push(case(
            name("of queue 0xff, with an fd"),
            Memory,
            Refused,
            vring_fd(request, 0xff, 1),
        ));
        cases.push(case(
            name("of queue 0xffffffff, no fd"),
            Memory,
            Refused,
            vring_fd(request, 0xffff_ffff, 0),
        ));
        cases.push(case(
            name("of queue 0xffffffff, with an fd"),
            Memory,
            Refused,
            vring_fd(request, 0xffff_ffff, 1),
        ));
        cases.push(case(
            name("with the fd missing"),
            Memory,
            Refused,
            vring_fd(request, 0, 0),
        ));
        cases.push(case(
            name("with two fds"),
            Memory,
            Refused,
            vring_fd(request, 0, 2),
        ));
        cases.push(case(
            name("with \"no fd\" and an fd"),
            Memory,
            Refused,
            vring_fd(request, VRING_NOFD, 1),
        ));
    }
    for num in [
        0u32,
        3,
        100,
        MAX_QUEUE_SIZE + 1,
        2 * MAX_QUEUE_SIZE,
        0x1_0000,
        u32::MAX,
    ] {
        cases.push(case(
            format!("SET_VRING_NUM {num:#x}"),
            Memory,
            Refused,
            ask(SET_VRING_NUM, vring_state(0, num)),
        ));
    }
    cases.push(case(
        "SET_VRING_ENABLE with state 2",
        Memory,
        Refused,
        ask(SET_VRING_ENABLE, vring_state(0, 2)),
    ));
    run_catalogue(&mut d, "malformed vring messages", cases);
}

/// GET_INFLIGHT_FD with `payload`.
fn get_inflight(payload: Vec<u8>) -> impl Fn(&Conn, &Guest) -> Outcome {
    move |c: &Conn, _: &Guest| c.ask_flags(GET_INFLIGHT_FD, FLAG_VERSION, &payload, &[])
}

/// SET_INFLIGHT_FD with `payload` and the fds `make` returns.
fn set_inflight(
    payload: Vec<u8>,
    make: impl Fn() -> Vec<std::fs::File> + 'static,
) -> impl Fn(&Conn, &Guest) -> Outcome {
    move |c: &Conn, _: &Guest| {
        let files = make();
        let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        c.ask(SET_INFLIGHT_FD, &payload, &fds)
    }
}

fn sealed(size: u64) -> std::fs::File {
    let f = memfd(size);
    seal(&f);
    f
}

#[test]
fn malformed_inflight_messages() {
    use Expect::*;
    use Setup::*;
    let mut d = Daemon::start(64 * MIB, &[]);
    // One queue of 256: the region is 16 + 16 * 256 bytes, rounded up to 64.
    let need = (16 + 16 * 256u64).div_ceil(64) * 64;
    let cases = vec![
        case(
            "GET_INFLIGHT_FD with an empty payload",
            Owned,
            NoInflight,
            get_inflight(vec![]),
        ),
        case(
            "GET_INFLIGHT_FD with a 12-byte payload",
            Owned,
            NoInflight,
            get_inflight(vec![0; 12]),
        ),
        case(
            "GET_INFLIGHT_FD for 0 queues",
            Owned,
            NoInflight,
            get_inflight(inflight(0, 0, 0, 256)),
        ),
        case(
            "GET_INFLIGHT_FD for 65535 queues",
            Owned,
            NoInflight,
            get_inflight(inflight(0, 0, u16::MAX, 256)),
        ),
        case(
            "GET_INFLIGHT_FD for queues of 0",
            Owned,
            NoInflight,
            get_inflight(inflight(0, 0, 1, 0)),
        ),
        case(
            "GET_INFLIGHT_FD for queues of 100",
            Owned,
            NoInflight,
            get_inflight(inflight(0, 0, 1, 100)),
        ),
        case(
            "GET_INFLIGHT_FD for queues of 32768 (over the maximum)",
            Owned,
            NoInflight,
            get_inflight(inflight(0, 0, 1, 0x8000)),
        ),
        case(
            "SET_INFLIGHT_FD with an empty payload",
            Owned,
            Refused,
            set_inflight(vec![], move || vec![sealed(need)]),
        ),
        case(
            "SET_INFLIGHT_FD with the fd missing",
            Owned,
            Refused,
            set_inflight(inflight(need, 0, 1, 256), Vec::new),
        ),
        case(
            "SET_INFLIGHT_FD with two fds",
            Owned,
            Refused,
            set_inflight(inflight(need, 0, 1, 256), move || {
                vec![sealed(need), sealed(need)]
            }),
        ),
        case(
            "SET_INFLIGHT_FD with an unsealed memfd",
            Owned,
            Refused,
            set_inflight(inflight(need, 0, 1, 256), move || vec![memfd(need)]),
        ),
        case(
            "SET_INFLIGHT_FD with /dev/null (not a memfd)",
            Owned,
            Refused,
            set_inflight(inflight(need, 0, 1, 256), || {
                vec![std::fs::File::open("/dev/null").expect("/dev/null")]
            }),
        ),
        case(
            "SET_INFLIGHT_FD with mmap_size larger than the fd",
            Owned,
            Refused,
            set_inflight(inflight(MIB, 0, 1, 256), || vec![sealed(4096)]),
        ),
        case(
            "SET_INFLIGHT_FD for more queues than the fd holds",
            Owned,
            Refused,
            set_inflight(inflight(need, 0, 1, 256 * 8), move || vec![sealed(need)]),
        ),
        case(
            "SET_INFLIGHT_FD with mmap_offset past the fd",
            Owned,
            Refused,
            set_inflight(inflight(need, 1 << 20, 1, 256), move || vec![sealed(need)]),
        ),
        case(
            "SET_INFLIGHT_FD with a huge mmap_offset",
            Owned,
            Refused,
            set_inflight(inflight(need, !4095, 1, 256), move || vec![sealed(need)]),
        ),
        case(
            "SET_INFLIGHT_FD for 2 queues (the device has 1)",
            Owned,
            Refused,
            set_inflight(inflight(2 * need, 0, 2, 256), move || {
                vec![sealed(2 * need)]
            }),
        ),
        case(
            "SET_INFLIGHT_FD for 0 queues",
            Owned,
            Refused,
            set_inflight(inflight(need, 0, 0, 256), move || vec![sealed(need)]),
        ),
        case(
            "SET_INFLIGHT_FD for queues of 100",
            Owned,
            Refused,
            set_inflight(inflight(need, 0, 1, 100), move || vec![sealed(need)]),
        ),
    ];
    run_catalogue(&mut d, "malformed inflight messages", cases);
}

#[test]
fn malformed_config_messages() {
    use Expect::*;
    use Setup::*;
    let mut d = Daemon::start(64 * MIB, &[]);
    let cases = vec![
        case(
            "SET_CONFIG of the capacity (offset 0)",
            Owned,
            Refused,
            ask(SET_CONFIG, config(0, 8, &[0xff; 8])),
        ),
        case(
            "SET_CONFIG at offset 0x1000",
            Owned,
            Refused,
            ask(SET_CONFIG, config(0x1000, 1, &[0])),
        ),
        case(
            "SET_CONFIG at offset 0xffffffff",
            Owned,
            Refused,
            ask(SET_CONFIG, config(u32::MAX, 1, &[0])),
        ),
        case(
            "SET_CONFIG of wce with 2 bytes",
            Owned,
            Refused,
            ask(SET_CONFIG, config(32, 2, &[0, 0])),
        ),
        case(
            "SET_CONFIG whose size field disagrees with its data",
            Owned,
            Refused,
            ask(SET_CONFIG, config(32, 4, &[0])),
        ),
        case(
            "SET_CONFIG of size 0",
            Owned,
            Refused,
            ask(SET_CONFIG, config(32, 0, &[])),
        ),
        case(
            "GET_CONFIG of size 0x1000",
            Owned,
            NoConfig,
            |c: &Conn, _: &Guest| {
                let p = config(0, 0x1000, &vec![0; 0x1000]);
                c.ask_flags(GET_CONFIG, FLAG_VERSION, &p, &[])
            },
        ),
        case(
            "GET_CONFIG of size 0",
            Owned,
            NoConfig,
            |c: &Conn, _: &Guest| c.ask_flags(GET_CONFIG, FLAG_VERSION, &config(0, 0, &[]), &[]),
        ),
        case(
            "GET_CONFIG across the end of the config space",
            Owned,
            NoConfig,
            |c: &Conn, _: &Guest| {
                let p = config(0xff0, 0x20, &[0; 0x20]);
                c.ask_flags(GET_CONFIG, FLAG_VERSION, &p, &[])
            },
        ),
    ];
    run_catalogue(&mut d, "malformed config messages", cases);
}

// ---------------------------------------------------------------------------
// A. Messages whose damage shows later: memory the daemon maps but cannot
// touch, rings that run out of guest memory.

/// Where the hostile region sits in guest physical memory.
const HOSTILE_GPA: u64 = 0x400_0000;

/// How a region beyond its file is handed over.
#[derive(Clone, Copy, Debug)]
enum PastEof {
    /// SET_MEM_TABLE: a 1 MiB region backed by a 4 KiB memfd.
    SmallFd,
    /// SET_MEM_TABLE: a 1 MiB region at an offset past the end of its fd.
    OffsetPastEnd,
    /// ADD_MEM_REG: a 1 MiB region backed by a 4 KiB memfd.
    AddSmallFd,
}

/// Shares guest memory plus a region whose pages past the end of its file
/// would SIGBUS the process touching them. If the daemon accepts it, a
/// request reads its header from there. The daemon must refuse the
/// region, or survive the access (and refuse the request).
fn region_past_eof(how: PastEof) -> String {
    let mut d = Daemon::start(64 * MIB, &[]);
    assert_serves(&mut d, "the first connection", 0, 0);
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let g = Guest::new();
    const VA: u64 = 0x7100_0000_0000;
    let small = memfd(4096);
    let hostile = match how {
        PastEof::SmallFd | PastEof::AddSmallFd => region(HOSTILE_GPA, MIB, VA, 0),
        PastEof::OffsetPastEnd => region(HOSTILE_GPA, MIB, VA, 32 * MIB),
    };
    let hostile_fd = match how {
        PastEof::OffsetPastEnd => g.file.as_raw_fd(),
        _ => small.as_raw_fd(),
    };
    let out = match how {
        PastEof::AddSmallFd => {
            g.share(&conn);
            conn.ask(ADD_MEM_REG, &single_region(&hostile), &[hostile_fd])
        }
        _ => {
            let mut regions = g.regions.clone();
            regions.push(hostile);
            let fds = [g.file.as_raw_fd(), g.file.as_raw_fd(), hostile_fd];
            conn.ask(SET_MEM_TABLE, &mem_table(3, &regions), &fds)
        }
    };
    let answer = out.describe();
    if !out.is_refusal() {
        // Accepted: the daemon now maps pages that do not exist. Make it
        // read one: a request whose header is 8 KiB into the region.
        let mut q = Vq::new(0, 64, 0);
        q.setup(&conn, &g);
        let (hdr, st) = (HOSTILE_GPA + 0x2000, 0x5000);
        g.write(st, &[0xff]);
        q.post(&g, &[r(hdr, 16), w(0x2_0000, 512), w(st, 1)]);
        let used = q.take_used(&g, 1, Duration::from_secs(3));
        thread::sleep(Duration::from_millis(200));
        d.assert_running();
        assert_eq!(
            used.len(),
            1,
            "{how:?}: the request reading past the end of the fd never completed"
        );
        assert_eq!(g.byte(st), 1, "{how:?}: status of that request");
    }
    drop(conn);
    assert_serves(&mut d, &format!("{how:?}"), 8192, 1);
    answer
}

#[test]
fn memory_region_past_the_end_of_its_fd() {
    for how in [
        PastEof::SmallFd,
        PastEof::OffsetPastEnd,
        PastEof::AddSmallFd,
    ] {
        let answer = region_past_eof(how);
        eprintln!("region past the end of its fd, {how:?}: {answer}");
    }
}

/// The daemon checks a region against its file's size when the table
/// arrives (`check_backing`), but a front-end can shrink an unsealed memfd
/// afterwards. The next access of ours to a page past the new end raises
/// SIGBUS; the daemon replaces that page with a zero page of its own
/// (`src/vhost/sigbus.rs`), the request completes, and the daemon serves
/// the next front-end. Without that handler it died (exit 159 under the
/// filter: std's SIGBUS handler calls rt_sigaction).
#[test]
fn memory_shrunk_after_the_table() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let g = Guest::new();
    g.share(&conn);
    let mut q = Vq::new(0, 64, 0);
    q.setup(&conn, &g);
    g.file.set_len(4 * MIB).expect("shrinking the memfd");
    // The header lies past the new end: reading it faults.
    q.post(&g, &[r(6 * MIB, 16), w(0x2_0000, 512), w(0x5000, 1)]);
    let used = q.take_used(&g, 1, Duration::from_secs(2));
    thread::sleep(Duration::from_millis(200));
    d.assert_running();
    assert_eq!(used.len(), 1, "the request never completed");
    drop(conn);
    d.wait_for_log("page(s) past the end of their file were replaced with zero pages");
    assert_serves(&mut d, "memory shrunk after the table", 8192, 1);
}

/// How a dirty-page log that a mark could fault on is handed over.
#[derive(Clone, Copy, Debug)]
enum BadLog {
    /// An unsealed, empty memfd for a log of 4 KiB.
    ShortUnsealed,
    /// An unsealed memfd of the right size, shrunk once it was taken.
    ShrunkAfter,
    /// A sealed, empty memfd for a log of 4 KiB.
    ShortSealed,
    /// A sealed 4 KiB memfd, mapped from offset 4 KiB.
    OffsetPastEnd,
}

/// SET_LOG_BASE with a log a mark could fault on. If the daemon takes it,
/// a read (logging on) marks its pages in it. The daemon must refuse the
/// log (vhost-user-backend mapped it unchecked, and the mark killed the
/// daemon with SIGBUS), and serve the next front-end.
fn log_past_eof(how: BadLog) -> String {
    let mut d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake_with(F_LOG_ALL, P_LOG_SHMFD);
    let g = Guest::new();
    g.share(&conn);
    let (file, offset) = match how {
        BadLog::ShortUnsealed => (memfd(0), 0),
        BadLog::ShrunkAfter => (memfd(4096), 0),
        BadLog::ShortSealed => (sealed(0), 0),
        BadLog::OffsetPastEnd => (sealed(4096), 4096),
    };
    let mut base = u64_payload(4096);
    base.extend_from_slice(&u64_payload(offset));
    let out = conn.ask_flags(SET_LOG_BASE, FLAG_VERSION, &base, &[file.as_raw_fd()]);
    let answer = out.describe();
    if let Outcome::Reply(_) = out {
        if let BadLog::ShrunkAfter = how {
            file.set_len(0).expect("shrinking the log");
        }
        // Taken: a read now marks guest page 0x40 in the log's byte 8.
        let mut q = Vq::new(0, 64, 0);
        q.setup(&conn, &g);
        g.write(0x5000, &[0xff]);
        q.post(&g, &[r(0x1_0000, 16), w(0x4_0000, 4096), w(0x5000, 1)]);
        let used = q.take_used(&g, 1, Duration::from_secs(3));
        thread::sleep(Duration::from_millis(200));
        d.assert_running();
        assert_eq!(used.len(), 1, "{how:?}: the read never completed");
    }
    drop(conn);
    assert_serves(&mut d, &format!("SET_LOG_BASE, {how:?}"), 8192, 1);
    answer
}

#[test]
fn a_log_that_can_be_shorter_than_its_size_is_refused() {
    for how in [
        BadLog::ShortUnsealed,
        BadLog::ShrunkAfter,
        BadLog::ShortSealed,
        BadLog::OffsetPastEnd,
    ] {
        let answer = log_past_eof(how);
        eprintln!("SET_LOG_BASE, {how:?}: {answer}");
        assert_eq!(answer, "disconnect", "{how:?}: the log was taken");
    }
}

/// A ring that starts in guest memory and runs past its end: the crate
/// checks only the rings' first bytes at SET_VRING_ADDR. A kick must not
/// make the daemon touch what lies past the region.
#[test]
fn ring_running_out_of_guest_memory() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let g = Guest::new();
    g.share(&conn);
    // 256 descriptors from 16 bytes before the end of region 0: the table
    // runs into the hole.
    let mut q = Vq::new(0, 256, 0);
    q.desc = REGION0_END - 16;
    conn.ok(SET_VRING_NUM, &vring_state(0, 256), &[]);
    let a = vring_addr(0, g.va(q.desc), g.va(q.used), g.va(q.avail));
    let out = conn.ask(SET_VRING_ADDR, &a, &[]);
    eprintln!("descriptor table running into the hole: {}", out.describe());
    if !out.is_refusal() {
        conn.ok(SET_VRING_BASE, &vring_state(0, 0), &[]);
        conn.ok(SET_VRING_CALL, &u64_payload(0), &[q.call.as_raw_fd()]);
        conn.ok(SET_VRING_KICK, &u64_payload(0), &[q.kick.as_raw_fd()]);
        conn.ok(SET_VRING_ENABLE, &vring_state(0, 1), &[]);
        // Descriptor 0 is the table's last entry in guest memory; it
        // chains to descriptor 1, in the hole.
        g.write(0x4000, &[0; 16]);
        g.write_descs(q.desc, 0, &[r(0x4000, 16).with_next(1)]);
        q.publish(&g, &[0]);
        let used = q.take_used(&g, 1, Duration::from_secs(1));
        eprintln!("  a chain into the hole on that ring: {used:?}");
        // Skipped, or returned with used length 0: nothing was served.
        assert!(
            matches!(used.as_slice(), [] | [(0, 0)]),
            "a queue whose table leaves guest memory served {used:?}"
        );
        d.assert_running();
    }
    drop(conn);
    assert_serves(&mut d, "a ring running out of guest memory", 8192, 1);
}

// ---------------------------------------------------------------------------
// B. Malformed descriptor chains from a hostile guest

const VIRTIO_BLK_T_IN: u32 = 0;
const VIRTIO_BLK_T_OUT: u32 = 1;
const VIRTIO_BLK_T_GET_ID: u32 = 8;
const VIRTIO_BLK_T_DISCARD: u32 = 11;
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;
/// Untouched-status marker.
const SENTINEL: u8 = 0xff;
/// Where every malformed write aims: it must stay zero in the image.
const HOSTILE_SECTOR: u64 = 16384;
/// Fill of every malformed write's data.
const HOSTILE_FILL: u8 = 0xee;

/// Where one queue's driver keeps things in guest memory.
#[derive(Clone, Copy, Debug)]
struct Layout {
    /// Rings (see `Vq::new`).
    base: u64,
    hdr: u64,
    status: u64,
    table: u64,
    table2: u64,
    /// Data buffers in region 0 (512 KiB).
    data: u64,
    /// Read-back buffers in region 0 (256 KiB).
    back: u64,
    /// Data buffers in region 1 (1 MiB).
    far: u64,
}

impl Layout {
    fn of(q: usize) -> Layout {
        let base = q as u64 * 0x20_0000;
        Layout {
            base,
            hdr: base + 0x4000,
            status: base + 0x5000,
            table: base + 0x8000,
            table2: base + 0x1_8000,
            data: base + 0x10_0000,
            back: base + 0x18_0000,
            far: REGION1 + q as u64 * 0x10_0000,
        }
    }
}

/// A device set up by the raw front-end: features, memory, queues.
struct Dev {
    /// Kept open: the device lives as long as the connection.
    _conn: Conn,
    g: Guest,
    qs: Vec<Vq>,
    capacity: u64,
    seg_max: u32,
    report: Vec<String>,
    checks: u64,
}

impl Dev {
    /// A device of `queues` queues of `size`, with INDIRECT_DESC and
    /// `features` negotiated.
    fn open(d: &Daemon, queues: usize, size: u16, features: u64) -> Dev {
        let conn = Conn::connect(&d.socket);
        conn.handshake(F_INDIRECT_DESC | features);
        let cfg = conn.config(0, 16);
        let capacity = u64::from_le_bytes(cfg[0..8].try_into().unwrap());
        let seg_max = u32::from_le_bytes(cfg[12..16].try_into().unwrap());
        assert!(capacity > HOSTILE_SECTOR + 64, "capacity {capacity}");
        assert!(seg_max >= 2, "seg_max {seg_max}");
        let g = Guest::new();
        g.share(&conn);
        let qs: Vec<Vq> = (0..queues)
            .map(|i| {
                let mut q = Vq::new(i as u32, size, Layout::of(i).base);
                q.event_idx = features & F_EVENT_IDX != 0;
                q.setup(&conn, &g);
                q
            })
            .collect();
        Dev {
            _conn: conn,
            g,
            qs,
            capacity,
            seg_max,
            report: Vec::new(),
            checks: 0,
        }
    }

    fn header(&self, at: u64, req_type: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&req_type.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.g.write(at, &h);
    }

    /// Writes an indirect table at `at`, its entries linked with NEXT.
    fn table(&self, at: u64, descs: &[Desc]) {
        self.g.write_descs(at, 0, &link(descs, 0));
    }

    /// Checks the answer to a malformed chain with head `head` on queue
    /// `q`: VIRTIO_BLK_S_IOERR or S_UNSUPP in the byte at `status` (the
    /// last byte of the chain's last writable descriptor, where the device
    /// puts the status) with used length 1, or used length 0. Returns
    /// what it was.
    #[track_caller]
    fn expect_refused(&mut self, q: usize, name: &str, head: u16, status: Option<u64>) {
        let (id, len) = self.qs[q].one_used(&self.g);
        assert_eq!(u32::from(head), id, "{name}: used element for another head");
        let got = match (len, status) {
            (0, _) => "used length 0".to_string(),
            (1, Some(at)) => match self.g.byte(at) {
                S_IOERR => "IOERR".to_string(),
                S_UNSUPP => "UNSUPP".to_string(),
                other => {
                    // Where did it go? Bytes of the data area that are
                    // neither the hostile fill nor zero.
                    let data = self.g.read(Layout::of(q).data, 0x8_0000);
                    let odd: Vec<(usize, u8)> = (data.iter().enumerate())
                        .filter(|&(_, &b)| b != HOSTILE_FILL && b != 0)
                        .map(|(i, &b)| (i, b))
                        .take(8)
                        .collect();
                    panic!(
                        "{name}: status {other} at {at:#x} with used length 1 \
                         (data area bytes at offsets {odd:?})"
                    )
                }
            },
            (len, at) => panic!(
                "{name}: used length {len}, status {:?}: the device served it",
                at.map(|a| self.g.byte(a))
            ),
        };
        if len == 0
            && let Some(at) = status
        {
            assert_ne!(self.g.byte(at), S_OK, "{name}: OK with used length 0");
        }
        self.report.push(format!("  {name:<64} {got}"));
    }

    /// A valid write of 8 KiB (two segments: one in each region) at
    /// `sector` on queue `q`, read back in one segment and compared, in
    /// guest memory and in the image.
    #[track_caller]
    fn roundtrip(&mut self, d: &Daemon, q: usize, what: &str) {
        self.checks += 1;
        let seed = self.checks as u8;
        // Each check writes a sector of its own, away from HOSTILE_SECTOR.
        let sector = 64 + 16 * (self.checks % 1000) + 2048 * q as u64;
        let l = Layout::of(q);
        let pattern: Vec<u8> = (0..8192u32)
            .map(|i| (i as u8) ^ seed.wrapping_mul(37) ^ (i >> 9) as u8)
            .collect();
        self.g.write(l.data, &pattern[..4096]);
        self.g.write(l.far, &pattern[4096..]);
        self.header(l.hdr, VIRTIO_BLK_T_OUT, sector);
        self.g.write(l.status, &[SENTINEL]);
        let chain = [
            r(l.hdr, 16),
            r(l.data, 4096),
            r(l.far, 4096),
            w(l.status, 1),
        ];
        let head = self.qs[q].post(&self.g, &chain);
        let (id, len) = self.qs[q].one_used(&self.g);
        let status = self.g.byte(l.status);
        assert_eq!(
            (id, len, status),
            (u32::from(head), 1, S_OK),
            "after {what}: a valid write on queue {q}"
        );
        self.g.write(l.back, &[0u8; 8192]);
        self.header(l.hdr, VIRTIO_BLK_T_IN, sector);
        self.g.write(l.status, &[SENTINEL]);
        let chain = [r(l.hdr, 16), w(l.back, 8192), w(l.status, 1)];
        let head = self.qs[q].post(&self.g, &chain);
        let (id, len) = self.qs[q].one_used(&self.g);
        let status = self.g.byte(l.status);
        assert_eq!(
            (id, len, status),
            (u32::from(head), 8193, S_OK),
            "after {what}: a valid read on queue {q}"
        );
        assert!(
            self.g.read(l.back, 8192) == pattern,
            "after {what}: queue {q} read back other data"
        );
        assert!(
            d.read_image(sector * 512, 8192) == pattern,
            "after {what}: the image does not hold what queue {q} wrote"
        );
    }
}

/// Posts a chain on a queue of the device; returns its head and where its
/// status byte would go (`None`: nowhere to check).
type Post = dyn Fn(&mut Dev, usize) -> (u16, Option<u64>);

/// One malformed chain: how to post it, and where its status would go.
struct Bad {
    name: &'static str,
    /// Posts the chain (header, tables, descriptors) and returns its head
    /// and the status address to check (`None`: used length 0 expected or
    /// no byte to check).
    post: Box<Post>,
    /// The one status the answer must carry, where QEMU's is fixed (the
    /// catalogue otherwise takes IOERR, UNSUPP or used length 0).
    want: Option<u8>,
}

impl Bad {
    /// The answer must be `status` with used length 1.
    fn answered(self, status: u8) -> Bad {
        Bad {
            want: Some(status),
            ..self
        }
    }
}

fn bad(name: &'static str, post: impl Fn(&mut Dev, usize) -> (u16, Option<u64>) + 'static) -> Bad {
    Bad {
        name,
        post: Box::new(post),
        want: None,
    }
}

/// Posts a direct chain after writing a header of `req_type` at `sector`;
/// the status to check is the last byte of the last writable descriptor.
fn direct(
    req_type: u32,
    sector: u64,
    chain: impl Fn(&Layout) -> Vec<Desc> + 'static,
) -> impl Fn(&mut Dev, usize) -> (u16, Option<u64>) {
    move |dev: &mut Dev, q: usize| {
        let l = Layout::of(q);
        dev.header(l.hdr, req_type, sector);
        let descs = chain(&l);
        let status = descs
            .iter()
            .rev()
            .find(|d| d.is_writable())
            .filter(|d| d.len > 0)
            .map(|d| d.addr + u64::from(d.len) - 1);
        if let Some(at) = status {
            // Only where guest memory is.
            if at < REGION0_END {
                dev.g.write(at, &[SENTINEL]);
            }
        }
        let head = dev.qs[q].post(&dev.g, &descs);
        (head, status.filter(|&a| a < REGION0_END))
    }
}

/// Posts a one-descriptor chain naming an indirect table of `entries`,
/// written at the queue's table address.
fn indirect(
    req_type: u32,
    sector: u64,
    entries: impl Fn(&Layout, u32) -> Vec<Desc> + 'static,
) -> impl Fn(&mut Dev, usize) -> (u16, Option<u64>) {
    move |dev: &mut Dev, q: usize| {
        let l = Layout::of(q);
        dev.header(l.hdr, req_type, sector);
        dev.g.write(l.status, &[SENTINEL]);
        let t = entries(&l, dev.seg_max);
        dev.table(l.table, &t);
        let head = dev.qs[q].post(&dev.g, &[ind(l.table, 16 * t.len() as u32)]);
        (head, Some(l.status))
    }
}

/// Writes table entries exactly as given (flags and `next` included) from
/// index 0 and posts descriptor 0; `status` says where a status would go.
fn raw_table(
    table: impl Fn(&Layout) -> Vec<Desc> + 'static,
    status: impl Fn(&Layout) -> Option<u64> + 'static,
) -> impl Fn(&mut Dev, usize) -> (u16, Option<u64>) {
    move |dev: &mut Dev, q: usize| {
        let l = Layout::of(q);
        dev.header(l.hdr, VIRTIO_BLK_T_IN, 0);
        let at = status(&l);
        if let Some(at) = at {
            dev.g.write(at, &[SENTINEL]);
        }
        dev.qs[q].write_table(&dev.g, 0, &table(&l));
        dev.qs[q].publish(&dev.g, &[0]);
        (0, at)
    }
}

fn hostile_data(dev: &Dev, l: &Layout, len: usize) {
    dev.g.write(l.data, &vec![HOSTILE_FILL; len]);
}

fn catalogue_b() -> Vec<Bad> {
    let hs = HOSTILE_SECTOR;
    let out = VIRTIO_BLK_T_OUT;
    let inn = VIRTIO_BLK_T_IN;
    vec![
        // Addresses outside guest memory.
        bad(
            "write from a buffer beyond guest memory",
            direct(out, hs, |l| {
                vec![r(l.hdr, 16), r(1 << 40, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "read into a buffer beyond guest memory",
            direct(inn, 0, |l| {
                vec![r(l.hdr, 16), w(1 << 40, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "header beyond guest memory",
            direct(inn, 0, |l| {
                vec![r(0xdead_0000_0000, 16), w(l.data, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "status byte beyond guest memory",
            direct(inn, 0, |l| {
                vec![r(l.hdr, 16), w(l.data, 512), w(1 << 40, 1)]
            }),
        ),
        bad(
            "buffer whose address + length wraps around 2^64",
            direct(out, hs, |l| {
                vec![r(l.hdr, 16), r(u64::MAX - 255, 512), w(l.status, 1)]
            }),
        ),
        // The hole between the regions.
        bad(
            "write from a buffer inside the hole",
            direct(out, hs, |l| {
                vec![r(l.hdr, 16), r(REGION0_END + 0x1000, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "write from a buffer straddling region 0's end and the hole",
            direct(out, hs, |l| {
                vec![r(l.hdr, 16), r(REGION0_END - 256, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "read into a buffer straddling the hole and region 1",
            direct(inn, 0, |l| {
                vec![r(l.hdr, 16), w(REGION1 - 256, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "read into a buffer straddling region 1's end",
            direct(inn, 0, |l| {
                vec![r(l.hdr, 16), w(REGION1_END - 256, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "header straddling region 0's end",
            direct(inn, 0, |l| {
                vec![r(REGION0_END - 8, 16), w(l.data, 512), w(l.status, 1)]
            }),
        ),
        // Loops and lengths.
        bad(
            "descriptor loop 0 -> 1 -> 0",
            // 0: header, 1: writable data looping back to 0; the status
            // would be the data's last byte.
            raw_table(
                |l| vec![r(l.hdr, 16).with_next(1), w(l.data, 512).with_next(0)],
                |l| Some(l.data + 511),
            ),
        ),
        bad(
            "descriptor looping on itself",
            raw_table(|l| vec![r(l.hdr, 16).with_next(0)], |_| None),
        ),
        bad(
            "chain through every descriptor, then NEXT past the table",
            |dev: &mut Dev, q: usize| {
                let l = Layout::of(q);
                let size = dev.qs[q].size;
                dev.header(l.hdr, VIRTIO_BLK_T_OUT, HOSTILE_SECTOR);
                dev.g.write(l.status, &[SENTINEL]);
                hostile_data(dev, &l, 512);
                let mut t = vec![r(l.hdr, 16)];
                t.extend((1..size - 1).map(|_| r(l.data, 512)));
                t.push(w(l.status, 1));
                let mut t = link(&t, 0);
                let last = t.len() - 1;
                t[last] = t[last].with_next(size);
                dev.qs[q].write_table(&dev.g, 0, &t);
                dev.qs[q].publish(&dev.g, &[0]);
                (0, Some(l.status))
            },
        ),
        bad(
            "indirect table longer than max(queue size, seg_max + 2)",
            indirect(out, hs, |l, seg_max| {
                let mut t = vec![r(l.hdr, 16)];
                t.extend((0..seg_max + 40).map(|_| r(l.data, 512)));
                t.push(w(l.status, 1));
                t
            }),
        ),
        bad(
            "write of seg_max + 1 segments",
            indirect(out, hs, |l, seg_max| {
                let mut t = vec![r(l.hdr, 16)];
                t.extend((0..seg_max + 1).map(|i| r(l.data + 512 * u64::from(i), 512)));
                t.push(w(l.status, 1));
                t
            }),
        ),
        bad(
            "read of seg_max + 1 segments",
            indirect(inn, 0, |l, seg_max| {
                let mut t = vec![r(l.hdr, 16)];
                t.extend((0..seg_max + 1).map(|i| w(l.data + 512 * u64::from(i), 512)));
                t.push(w(l.status, 1));
                t
            }),
        ),
        // Status descriptor.
        bad(
            "write with a readable status descriptor",
            direct(out, hs, |l| {
                vec![r(l.hdr, 16), r(l.data, 512), r(l.status, 1)]
            }),
        ),
        bad(
            "read with a readable status after the writable data",
            direct(inn, 0, |l| {
                vec![r(l.hdr, 16), w(l.data, 512), r(l.status, 1)]
            }),
        ),
        bad(
            "zero-length status descriptor",
            direct(inn, 0, |l| {
                vec![r(l.hdr, 16), w(l.data, 512), w(l.status, 0)]
            }),
        ),
        bad(
            "chain of one writable descriptor",
            direct(inn, 0, |l| vec![w(l.status, 1)]),
        ),
        // Header.
        bad(
            "header in a writable descriptor",
            direct(inn, 0, |l| {
                vec![w(l.hdr, 16), w(l.data, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "header of 8 bytes",
            direct(inn, 0, |l| vec![r(l.hdr, 8), w(l.status, 1)]),
        ),
        // Sectors.
        bad(
            "write at sector 2^64 - 1 (sector + length overflows)",
            direct(out, u64::MAX, |l| {
                vec![r(l.hdr, 16), r(l.data, 1024), w(l.status, 1)]
            }),
        ),
        bad(
            "read at sector 2^55 (the byte offset overflows)",
            direct(inn, 1 << 55, |l| {
                vec![r(l.hdr, 16), w(l.data, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "read of 2 sectors from the last one",
            |dev: &mut Dev, q: usize| {
                let last = dev.capacity - 1;
                direct(VIRTIO_BLK_T_IN, last, |l| {
                    vec![r(l.hdr, 16), w(l.data, 1024), w(l.status, 1)]
                })(dev, q)
            },
        ),
        bad("write at the capacity", |dev: &mut Dev, q: usize| {
            let cap = dev.capacity;
            direct(VIRTIO_BLK_T_OUT, cap, |l| {
                vec![r(l.hdr, 16), r(l.data, 512), w(l.status, 1)]
            })(dev, q)
        }),
        bad(
            "write of 100 bytes",
            direct(out, hs, |l| {
                vec![r(l.hdr, 16), r(l.data, 100), w(l.status, 1)]
            }),
        ),
        // Indirect tables.
        bad(
            "indirect table inside an indirect table",
            |dev: &mut Dev, q: usize| {
                let l = Layout::of(q);
                dev.header(l.hdr, VIRTIO_BLK_T_IN, 0);
                dev.g.write(l.status, &[SENTINEL]);
                dev.table(l.table2, &[w(l.data, 512), w(l.status, 1)]);
                dev.table(l.table, &[r(l.hdr, 16), ind(l.table2, 32)]);
                let head = dev.qs[q].post(&dev.g, &[ind(l.table, 32)]);
                (head, Some(l.status))
            },
        ),
        bad(
            "indirect table of 24 bytes (not a multiple of 16)",
            |dev: &mut Dev, q: usize| {
                let l = Layout::of(q);
                dev.header(l.hdr, VIRTIO_BLK_T_IN, 0);
                dev.g.write(l.status, &[SENTINEL]);
                dev.table(l.table, &[r(l.hdr, 16), w(l.status, 1)]);
                let head = dev.qs[q].post(&dev.g, &[ind(l.table, 24)]);
                (head, Some(l.status))
            },
        ),
        bad("indirect table of 0 bytes", |dev: &mut Dev, q: usize| {
            let l = Layout::of(q);
            let head = dev.qs[q].post(&dev.g, &[ind(l.table, 0)]);
            (head, None)
        }),
        bad(
            "indirect table beyond guest memory",
            |dev: &mut Dev, q: usize| {
                let head = dev.qs[q].post(&dev.g, &[ind(1 << 40, 48)]);
                (head, None)
            },
        ),
        bad(
            "indirect table running into the hole",
            |dev: &mut Dev, q: usize| {
                let l = Layout::of(q);
                dev.header(l.hdr, VIRTIO_BLK_T_IN, 0);
                let at = REGION0_END - 16;
                dev.g.write_descs(at, 0, &[r(l.hdr, 16).with_next(1)]);
                let head = dev.qs[q].post(&dev.g, &[ind(at, 48)]);
                (head, None)
            },
        ),
        // Types.
        bad(
            "unknown request type 0x7777",
            direct(0x7777, 0, |l| {
                vec![r(l.hdr, 16), w(l.data, 512), w(l.status, 1)]
            }),
        ),
        bad(
            "GET_ID with a readable buffer",
            direct(VIRTIO_BLK_T_GET_ID, 0, |l| {
                vec![r(l.hdr, 16), r(l.data, 20), w(l.status, 1)]
            }),
        ),
        bad("discard of two ranges", |dev: &mut Dev, q: usize| {
            let l = Layout::of(q);
            let mut ranges = Vec::new();
            for s in [HOSTILE_SECTOR, HOSTILE_SECTOR + 8] {
                ranges.extend_from_slice(&s.to_le_bytes());
                ranges.extend_from_slice(&8u32.to_le_bytes());
                ranges.extend_from_slice(&0u32.to_le_bytes());
            }
            dev.g.write(l.data, &ranges);
            direct(VIRTIO_BLK_T_DISCARD, 0, |l| {
                vec![r(l.hdr, 16), r(l.data, 32), w(l.status, 1)]
            })(dev, q)
        })
        // As QEMU answers: the request is unsupported, the disk has not failed.
        .answered(S_UNSUPP),
    ]
}

/// Posts every malformed chain of the catalogue on queue `q`, each followed
/// by a valid write + read on the same queue.
fn run_catalogue_b(dev: &mut Dev, d: &mut Daemon, q: usize) {
    for b in catalogue_b() {
        let l = Layout::of(q);
        hostile_data(dev, &l, 512 * (dev.seg_max as usize + 2));
        let (head, status) = (b.post)(dev, q);
        dev.expect_refused(q, b.name, head, status);
        if let (Some(want), Some(at)) = (b.want, status) {
            assert_eq!(dev.g.byte(at), want, "{}: status", b.name);
        }
        d.assert_running();
        dev.roundtrip(d, q, b.name);
    }
}

/// Heads the driver puts on the avail ring that name no descriptor: the
/// device must skip them (no used element, or one of length 0) and go on.
fn bad_heads(dev: &mut Dev, d: &mut Daemon, q: usize) {
    let size = dev.qs[q].size;
    for head in [size, size + 1, u16::MAX] {
        let name = format!("head index {head} on a queue of {size}");
        dev.qs[q].publish(&dev.g, &[head]);
        let used = dev.qs[q].take_used(&dev.g, 1, Duration::from_millis(500));
        match used.as_slice() {
            [] => dev
                .report
                .push(format!("  {name:<64} skipped (no used element)")),
            [(id, 0)] => dev
                .report
                .push(format!("  {name:<64} used length 0 (id {id})")),
            other => panic!("{name}: used {other:?}"),
        }
        d.assert_running();
        dev.roundtrip(d, q, &name);
    }
}

/// Neither a refused write nor a skipped chain wrote the hostile sector.
fn assert_hostile_sector_untouched(d: &Daemon, seg_max: u32) {
    let len = 512 * (seg_max as usize + 2);
    assert!(
        d.read_image(HOSTILE_SECTOR * 512, len)
            .iter()
            .all(|&b| b == 0),
        "a refused request wrote the image at sector {HOSTILE_SECTOR}"
    );
}

#[test]
fn malformed_chains_on_one_queue() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let mut dev = Dev::open(&d, 1, 64, 0);
    dev.roundtrip(&d, 0, "setting up");
    run_catalogue_b(&mut dev, &mut d, 0);
    bad_heads(&mut dev, &mut d, 0);
    // A legitimate chain at the limit is still served: seg_max segments.
    let l = Layout::of(0);
    let seg_max = dev.seg_max;
    dev.header(l.hdr, VIRTIO_BLK_T_OUT, 4096);
    let pattern: Vec<u8> = (0..512 * seg_max).map(|i| (i % 251) as u8).collect();
    dev.g.write(l.data, &pattern);
    let mut t = vec![r(l.hdr, 16)];
    t.extend((0..seg_max).map(|i| r(l.data + 512 * u64::from(i), 512)));
    t.push(w(l.status, 1));
    dev.table(l.table, &t);
    dev.g.write(l.status, &[SENTINEL]);
    let head = dev.qs[0].post(&dev.g, &[ind(l.table, 16 * t.len() as u32)]);
    let (id, len) = dev.qs[0].one_used(&dev.g);
    assert_eq!((id, len, dev.g.byte(l.status)), (u32::from(head), 1, S_OK));
    assert!(d.read_image(4096 * 512, pattern.len()) == pattern);
    eprintln!(
        "malformed chains (queue of 64, seg_max {seg_max}):\n{}",
        dev.report.join("\n")
    );
    assert_hostile_sector_untouched(&d, seg_max);
    drop(dev);
    assert_serves(&mut d, "the malformed chains", 8192, 1);
}

#[test]
fn malformed_chains_on_a_full_size_queue() {
    // The queue size at the maximum (256 = seg_max + 2): the chain-length
    // limits meet. With EVENT_IDX, so notification suppression sees the
    // refused chains too.
    let mut d = Daemon::start(64 * MIB, &[]);
    let mut dev = Dev::open(&d, 1, MAX_QUEUE_SIZE as u16, F_EVENT_IDX);
    run_catalogue_b(&mut dev, &mut d, 0);
    bad_heads(&mut dev, &mut d, 0);
    eprintln!(
        "malformed chains (queue of 256, EVENT_IDX):\n{}",
        dev.report.join("\n")
    );
    assert_hostile_sector_untouched(&d, dev.seg_max);
    drop(dev);
    assert_serves(&mut d, "the malformed chains", 8192, 1);
}

#[test]
fn malformed_chains_on_queue_0_leave_queue_1_alone() {
    let mut d = Daemon::start(64 * MIB, &["--queues", "2"]);
    let mut dev = Dev::open(&d, 2, 128, F_EVENT_IDX);
    // Malformed chains on queue 0 while queue 1 has valid requests in
    // flight: both posted before either is waited for.
    for b in catalogue_b() {
        let (head, status) = (b.post)(&mut dev, 0);
        dev.roundtrip(&d, 1, b.name);
        dev.expect_refused(0, b.name, head, status);
    }
    // Queue 0's ring itself broken: avail->idx 1000 ahead of the device.
    let idx = dev.qs[0].used_idx(&dev.g).wrapping_add(1000);
    dev.qs[0].set_avail_idx(&dev.g, idx);
    dev.qs[0].kick.write(1).expect("kick");
    for i in 0..8 {
        dev.roundtrip(&d, 1, &format!("queue 0's avail->idx jumping ahead ({i})"));
    }
    let used = dev.qs[0].take_used(&dev.g, 1, Duration::from_millis(300));
    assert!(used.is_empty(), "a broken queue 0 served {used:?}");
    eprintln!(
        "malformed chains on queue 0 of 2 (queue 1 served in between):\n{}",
        dev.report.join("\n")
    );
    d.assert_running();
    assert_hostile_sector_untouched(&d, dev.seg_max);
    drop(dev);
    assert_serves(&mut d, "a broken queue 0", 8192, 1);
}
