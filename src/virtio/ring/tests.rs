//! `RingShadow` against virtio-queue's mock driver: batched publication,
//! notification decisions, kick suppression and the lost-wakeup re-check.

use virtio_bindings::virtio_ring::{VRING_AVAIL_F_NO_INTERRUPT, VRING_USED_F_NO_NOTIFY};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::virtio::testing::*;

const NO_NOTIFY: u16 = VRING_USED_F_NO_NOTIFY as u16;
const NO_INTERRUPT: u16 = VRING_AVAIL_F_NO_INTERRUPT as u16;

/// The driver's rings, as the worker sees them.
fn view<'m>(d: &Driver<'m>) -> RingView<'m> {
    RingView::new(&d.queue, d.mem)
}

/// Posts `n` flush-like two-descriptor chains at table indices 0, 2, 4...
fn post(d: &mut Driver, n: u16) -> Vec<u16> {
    (0..n)
        .map(|k| d.post_at((2 * k) % d.size(), &[r(HDR, 16), status()]))
        .collect()
}

/// Pops everything and returns the heads in order.
fn pop_all(shadow: &mut RingShadow, d: &mut Driver) -> Vec<u16> {
    let mut heads = Vec::new();
    let v = view(d);
    shadow
        .pop(&mut d.queue, &v, usize::MAX, |c| heads.push(c.head_index()))
        .unwrap();
    heads
}

/// Completes `heads` (used length = 100 + position) without publishing.
fn add_all(shadow: &mut RingShadow, d: &mut Driver, heads: &[u16]) {
    for (i, &h) in heads.iter().enumerate() {
        let v = view(d);
        shadow
            .add_used(&mut d.queue, &v, h, 100 + i as u32)
            .unwrap();
    }
}

#[test]
fn pop_takes_a_batch_up_to_the_limit() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    let mut shadow = RingShadow::default();
    let heads = post(&mut d, 5);
    let mut got = Vec::new();
    let v = view(&d);
    let n = shadow
        .pop(&mut d.queue, &v, 3, |c| got.push(c.head_index()))
        .unwrap();
    assert_eq!((n, &got[..]), (3, &heads[..3]));
    assert!(shadow.more_avail());
    let v = view(&d);
    let n = shadow
        .pop(&mut d.queue, &v, 3, |c| got.push(c.head_index()))
        .unwrap();
    assert_eq!((n, &got[..]), (2, &heads[..]));
    assert!(!shadow.more_avail());
    assert_eq!(d.queue.next_avail(), 5);
    let v = view(&d);
    assert_eq!(shadow.pop(&mut d.queue, &v, 0, |_| panic!()).unwrap(), 0);
}

#[test]
fn pop_refuses_an_avail_index_too_far_ahead() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.mock.avail().idx().store(17);
    let v = view(&d);
    let res = RingShadow::default().pop(&mut d.queue, &v, 64, |_| {});
    assert!(matches!(res, Err(RingError::Queue(_))));
}

#[test]
fn publish_writes_all_elements_then_the_index_once() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    let mut shadow = RingShadow::default();
    post(&mut d, 3);
    let heads = pop_all(&mut shadow, &mut d);
    add_all(&mut shadow, &mut d, &heads);
    // Written but not visible to the driver yet.
    assert_eq!(d.used_idx(), 0);
    assert_eq!(d.used_elem(2), (u32::from(heads[2]), 102));
    assert_eq!(shadow.publish(&d.queue, &view(&d)).unwrap(), 3);
    assert_eq!(d.used_idx(), 3);
    for (i, &h) in heads.iter().enumerate() {
        assert_eq!(d.used_elem(i as u16), (u32::from(h), 100 + i as u32));
    }
    // Nothing new: used->idx is not stored again.
    mem.write_obj(0xdeadu16, GuestAddress(USED + 2)).unwrap();
    assert_eq!(shadow.publish(&d.queue, &view(&d)).unwrap(), 0);
    assert_eq!(d.used_idx(), 0xdead);
}

#[test]
fn used_ring_wraps() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 4);
    d.start_at(u16::MAX - 1);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    let heads = post(&mut d, 4);
    assert_eq!(pop_all(&mut shadow, &mut d), heads);
    add_all(&mut shadow, &mut d, &heads);
    assert_eq!(shadow.publish(&d.queue, &view(&d)).unwrap(), 4);
    assert_eq!(d.used_idx(), 2);
    // Slots 2, 3, 0, 1 in that order.
    assert_eq!(d.used_elem(u16::MAX - 1), (u32::from(heads[0]), 100));
    assert_eq!(d.used_elem(1), (u32::from(heads[3]), 103));
}

/// Publishes `n` elements starting at used index `start` with EVENT_IDX,
/// the driver's `used_event` set to `used_event`, and returns the decision.
fn event_idx_decision(start: u16, n: u16, used_event: u16) -> bool {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.queue.set_event_idx(true);
    d.start_at(start);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    let heads = post(&mut d, n);
    assert_eq!(pop_all(&mut shadow, &mut d).len(), usize::from(n));
    add_all(&mut shadow, &mut d, &heads);
    shadow.publish(&d.queue, &view(&d)).unwrap();
    d.set_used_event(used_event);
    shadow.needs_notification(&d.queue, &view(&d)).unwrap()
}

#[test]
fn event_idx_notifies_when_used_event_was_passed() {
    // Published 10..13: the driver asked for an interrupt after used_event
    // if used_event is in [10, 13).
    for (used_event, want) in [
        (10, true),
        (12, true),
        (13, false),
        (9, false),
        (0, false),
        (200, false),
    ] {
        assert_eq!(
            event_idx_decision(10, 3, used_event),
            want,
            "used_event {used_event}"
        );
    }
}

#[test]
fn event_idx_decision_wraps_around() {
    // Published 0xfffe..=0x0001.
    for (used_event, want) in [
        (0xfffe, true),
        (0xffff, true),
        (0, true),
        (1, true),
        (2, false),
        (0xfffd, false),
        (0x8000, false),
    ] {
        assert_eq!(
            event_idx_decision(0xfffe, 4, used_event),
            want,
            "used_event {used_event:#x}"
        );
    }
}

#[test]
fn each_decision_covers_only_what_was_published_since_the_last() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.queue.set_event_idx(true);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    let heads = post(&mut d, 2);
    pop_all(&mut shadow, &mut d);
    add_all(&mut shadow, &mut d, &heads);
    shadow.publish(&d.queue, &view(&d)).unwrap();
    d.set_used_event(0);
    assert!(shadow.needs_notification(&d.queue, &view(&d)).unwrap());
    // Nothing new since: no second interrupt, whatever used_event says.
    assert!(!shadow.needs_notification(&d.queue, &view(&d)).unwrap());
    // Two more (2..4): used_event 0 is behind them now.
    let heads = post(&mut d, 2);
    pop_all(&mut shadow, &mut d);
    add_all(&mut shadow, &mut d, &heads);
    shadow.publish(&d.queue, &view(&d)).unwrap();
    assert!(!shadow.needs_notification(&d.queue, &view(&d)).unwrap());
    d.set_used_event(3);
    let heads = post(&mut d, 1);
    pop_all(&mut shadow, &mut d);
    add_all(&mut shadow, &mut d, &heads);
    shadow.publish(&d.queue, &view(&d)).unwrap();
    assert!(
        !shadow.needs_notification(&d.queue, &view(&d)).unwrap(),
        "used_event 3 is behind [4, 5)"
    );
}

#[test]
fn reset_starts_deciding_from_next_used() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.queue.set_event_idx(true);
    d.start_at(500);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    // Nothing published since the reset.
    d.set_used_event(100);
    assert!(!shadow.needs_notification(&d.queue, &view(&d)).unwrap());
}

#[test]
fn without_event_idx_the_no_interrupt_flag_decides() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    for (flags, want) in [(0, true), (NO_INTERRUPT, false)] {
        d.set_avail_flags(flags);
        let heads = post(&mut d, 1);
        pop_all(&mut shadow, &mut d);
        add_all(&mut shadow, &mut d, &heads);
        shadow.publish(&d.queue, &view(&d)).unwrap();
        assert_eq!(
            shadow.needs_notification(&d.queue, &view(&d)).unwrap(),
            want
        );
    }
    d.set_avail_flags(0);
    assert!(
        !shadow.needs_notification(&d.queue, &view(&d)).unwrap(),
        "nothing new"
    );
}

#[test]
fn kicks_without_event_idx_use_used_flags() {
    let mem = guest_memory();
    let d = Driver::new(&mem, 16);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    shadow.disable_kicks(&d.queue, &view(&d)).unwrap();
    assert_eq!(d.used_flags(), NO_NOTIFY);
    // The flag is shadowed: disabling again writes nothing.
    mem.write_obj(0x5a5au16, d.used_addr()).unwrap();
    shadow.disable_kicks(&d.queue, &view(&d)).unwrap();
    assert_eq!(d.used_flags(), 0x5a5a);
    assert!(!shadow.enable_kicks(&d.queue, &view(&d)).unwrap());
    assert_eq!(d.used_flags(), 0);
    // avail_event is an EVENT_IDX field: left alone.
    assert_eq!(d.avail_event(), 0);
}

#[test]
fn kicks_with_event_idx_use_avail_event() {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.queue.set_event_idx(true);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    // The driver's vring_need_event(): kick iff avail_event is in [old, new).
    let kicks = |d: &Driver, old: u16, new: u16| {
        new.wrapping_sub(d.avail_event()).wrapping_sub(1) < new.wrapping_sub(old)
    };
    shadow.disable_kicks(&d.queue, &view(&d)).unwrap();
    // used->flags stays clear; avail_event goes one behind next_avail, so
    // that no request the driver can add kicks, the first one included.
    assert_eq!((d.used_flags(), d.avail_event()), (0, 0xffff));
    assert!((1..=16).all(|n| !kicks(&d, 0, n)));
    post(&mut d, 3);
    pop_all(&mut shadow, &mut d);
    assert!(!shadow.enable_kicks(&d.queue, &view(&d)).unwrap());
    assert_eq!(d.avail_event(), 3);
    assert_eq!(d.used_flags(), 0);
    assert!(kicks(&d, 3, 4), "enabled: the next request kicks");
    // Unchanged next_avail: not written again.
    mem.write_obj(0x5a5au16, d.avail_event_addr()).unwrap();
    assert!(!shadow.enable_kicks(&d.queue, &view(&d)).unwrap());
    assert_eq!(d.avail_event(), 0x5a5a);
    mem.write_obj(3u16, d.avail_event_addr()).unwrap();
    shadow.disable_kicks(&d.queue, &view(&d)).unwrap();
    assert_eq!(d.avail_event(), 2);
    assert!(!kicks(&d, 3, 4) && !kicks(&d, 3, 19));
    // Popping while off leaves it behind, unwritten.
    post(&mut d, 2);
    pop_all(&mut shadow, &mut d);
    shadow.disable_kicks(&d.queue, &view(&d)).unwrap();
    assert_eq!(d.avail_event(), 2);
    assert!(!kicks(&d, 5, 6));
}

/// The driver posts between the device's last pop and its re-enabling
/// kicks, and does not kick (kicks were off): `enable_kicks` must see it.
fn no_lost_wakeup(event_idx: bool) {
    let mem = guest_memory();
    let mut d = Driver::new(&mem, 16);
    d.queue.set_event_idx(event_idx);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    shadow.disable_kicks(&d.queue, &view(&d)).unwrap();
    post(&mut d, 2);
    assert_eq!(pop_all(&mut shadow, &mut d).len(), 2);
    let late = d.post_at(8, &[r(HDR, 16), status()]);
    assert!(
        shadow.enable_kicks(&d.queue, &view(&d)).unwrap(),
        "request posted in the window"
    );
    assert_eq!(pop_all(&mut shadow, &mut d), [late]);
    assert!(
        !shadow.enable_kicks(&d.queue, &view(&d)).unwrap(),
        "ring drained"
    );
    assert!(!shadow.avail_pending(&d.queue, &view(&d)).unwrap());
}

#[test]
fn enable_kicks_reports_work_posted_in_the_window() {
    no_lost_wakeup(false);
    no_lost_wakeup(true);
}
