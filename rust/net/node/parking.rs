//! Where reverse and punched streams wait for their link (`ParkingLot`), and the
//! node's side of it: parking what the listener took, waiting for a parked stream.

use super::{
    Node, EARLY_KEEP, LOG, MAX_EARLY, MAX_EARLY_PER_SOURCE, MAX_POOL, PUNCH_SLOT, TOKEN_LEN,
};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// A reverse stream waiting for its pool: (token, stream index).
type ParkKey = ([u8; TOKEN_LEN], u16);

/// Where reverse and punch streams wait for their link; they come before any
/// authentication, so a stranger can send any number of them with made-up tokens.
///
/// Their tokens come from the master, which hands them to both ends of a link in
/// EstablishP2P; a stranger cannot guess one. The end that waits for the link's streams
/// says so (`want`) as soon as it starts (`connect_pool_via` on a reverse route, `punch`
/// on either end), and from then on a stream with that token is kept for it (`parked`)
/// whatever strangers do: at most one per valid stream number, so at most a pool's worth
/// per wanted token, until the waiter takes it or gives up (`unwant` drops the rest).
///
/// A stream whose token nobody here wants yet is either a stranger's or an honest one
/// that beat its link (the other end processed its EstablishP2P first). It waits in the
/// `early` area: small (`MAX_EARLY`), at most `MAX_EARLY_PER_SOURCE` per source address,
/// kept `EARLY_KEEP` at most, and moved to `parked` when its token becomes wanted. When
/// that area is full the newcomer is refused (closed), never anyone already kept; an
/// honest dialer that was refused dials again (`Node::open_inbound`), and by then its
/// token is normally wanted.
///
/// A stream whose (token, stream number) is already kept is refused as well: the first
/// one stays (a later one could only be a repeat or a replay).
pub(super) struct ParkingLot<T> {
    /// Tokens that a link here waits for, with how many waiters.
    wanted: HashMap<[u8; TOKEN_LEN], usize>,
    /// Streams of wanted tokens.
    parked: HashMap<ParkKey, T>,
    /// Streams of tokens not wanted (yet): (stream, source, kept until).
    early: HashMap<ParkKey, (T, IpAddr, Instant)>,
}

/// Why the parking lot did not keep a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// No link uses that stream number.
    BadSlot,
    /// A stream with the same token and number is kept already.
    Duplicate,
    /// The early area is full.
    Full,
    /// The early area holds its share of streams from this source address.
    SourceFull,
}

/// Where the parking lot put a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placed {
    /// For a link that waits for it.
    Parked,
    /// In the early area, until the returned deadline.
    Early(Instant),
}

impl<T> ParkingLot<T> {
    pub(super) fn new() -> Self {
        ParkingLot {
            wanted: HashMap::new(),
            parked: HashMap::new(),
            early: HashMap::new(),
        }
    }

    /// Stream numbers in use: those of a pool, and the two punch roles.
    fn valid_slot(slot: u16) -> bool {
        slot < MAX_POOL || slot == PUNCH_SLOT || slot == PUNCH_SLOT + 1
    }

    /// Keeps `item` (from `source`) for (token, slot), or gives it back with the reason.
    fn offer(
        &mut self,
        token: [u8; TOKEN_LEN],
        slot: u16,
        item: T,
        source: IpAddr,
        now: Instant,
    ) -> Result<Placed, (T, Refusal)> {
        if !Self::valid_slot(slot) {
            return Err((item, Refusal::BadSlot));
        }
        self.purge(now);
        let key = (token, slot);
        if self.parked.contains_key(&key) || self.early.contains_key(&key) {
            return Err((item, Refusal::Duplicate));
        }
        if self.wanted.contains_key(&token) {
            self.parked.insert(key, item);
            return Ok(Placed::Parked);
        }
        if self.early.len() >= MAX_EARLY {
            return Err((item, Refusal::Full));
        }
        let source = source.to_canonical();
        if self.early.values().filter(|e| e.1 == source).count() >= MAX_EARLY_PER_SOURCE {
            return Err((item, Refusal::SourceFull));
        }
        let until = now + EARLY_KEEP;
        self.early.insert(key, (item, source, until));
        Ok(Placed::Early(until))
    }

    /// A link starts waiting for streams with `token`: those that came early are kept
    /// for it from now on.
    fn want(&mut self, token: [u8; TOKEN_LEN]) {
        *self.wanted.entry(token).or_default() += 1;
        let keys: Vec<ParkKey> = self
            .early
            .keys()
            .filter(|k| k.0 == token)
            .copied()
            .collect();
        for key in keys {
            if let Some((item, _, _)) = self.early.remove(&key) {
                self.parked.insert(key, item);
            }
        }
    }

    /// A waiter for `token` is done; with the last one, the streams still kept for the
    /// token are of no use: they are returned (to be closed).
    fn unwant(&mut self, token: [u8; TOKEN_LEN]) -> Vec<T> {
        match self.wanted.get_mut(&token) {
            Some(n) if *n > 1 => {
                *n -= 1;
                return Vec::new();
            }
            Some(_) => {
                self.wanted.remove(&token);
            }
            None => return Vec::new(),
        }
        let keys: Vec<ParkKey> = self
            .parked
            .keys()
            .filter(|k| k.0 == token)
            .copied()
            .collect();
        keys.iter().filter_map(|k| self.parked.remove(k)).collect()
    }

    /// The stream kept for (token, slot), if any.
    fn take(&mut self, token: &[u8; TOKEN_LEN], slot: u16) -> Option<T> {
        let key = (*token, slot);
        self.parked
            .remove(&key)
            .or_else(|| self.early.remove(&key).map(|e| e.0))
    }

    /// Drops early streams whose time is up (closing them).
    pub(super) fn purge(&mut self, now: Instant) {
        self.early.retain(|_, e| e.2 > now);
    }

    /// (streams kept for links that wait for them, streams in the early area).
    fn counts(&self) -> (usize, usize) {
        (self.parked.len(), self.early.len())
    }

    /// Drops everything (the node is closing).
    pub(super) fn clear(&mut self) {
        self.wanted.clear();
        self.parked.clear();
        self.early.clear();
    }
}

/// A link of ours waits for streams with `token` while this lives (`Node::want`).
pub(super) struct Wanted<'a> {
    node: &'a Node,
    token: [u8; TOKEN_LEN],
}

impl Drop for Wanted<'_> {
    fn drop(&mut self) {
        let unused = self.node.parked.lock().unwrap().unwant(self.token);
        drop(unused); // closed outside the lock
    }
}

impl Node {
    /// Keeps a reverse (or punch) connection until its link asks for (token, slot), or
    /// refuses it (closes it). Returns the deadline of one kept in the early area.
    pub(super) fn park(
        &self,
        token: [u8; TOKEN_LEN],
        slot: u16,
        tcp: TcpStream,
        remote: SocketAddr,
    ) -> Option<Instant> {
        let now = Instant::now();
        let offered = self
            .parked
            .lock()
            .unwrap()
            .offer(token, slot, tcp, remote.ip(), now);
        // (A refused stream is closed here, outside the lock.)
        let why = match offered {
            Ok(placed) => {
                self.parked_changed.notify_waiters();
                return match placed {
                    Placed::Parked => None,
                    Placed::Early(until) => Some(until),
                };
            }
            Err((_closed, why)) => why,
        };
        // Never logged louder than info: a stranger may send thousands of these.
        let why = match why {
            Refusal::BadSlot => format!("stream number {slot} is not one a link uses"),
            Refusal::Duplicate => "a stream with its token and number is waiting already".into(),
            Refusal::Full => format!("{MAX_EARLY} streams of links not asked for yet wait already"),
            Refusal::SourceFull => format!(
                "{MAX_EARLY_PER_SOURCE} streams from {} for links not asked for yet wait \
                 already",
                remote.ip()
            ),
        };
        let kind = if slot >= PUNCH_SLOT {
            "punched"
        } else {
            "reverse"
        };
        log::info!(
            target: LOG,
            "peer {}: {kind} p2p stream from {remote} refused: {why}",
            self.peer_id()
        );
        None
    }

    /// Streams with `token` are kept for a link of ours from now on, until the guard is
    /// dropped (see `ParkingLot`).
    pub(super) fn want(&self, token: [u8; TOKEN_LEN]) -> Wanted<'_> {
        self.parked.lock().unwrap().want(token);
        self.parked_changed.notify_waiters();
        Wanted { node: self, token }
    }

    /// (streams kept for links that wait for them, streams of links not asked for yet).
    pub fn parked_counts(&self) -> (usize, usize) {
        self.parked.lock().unwrap().counts()
    }

    /// A parked stream for (token, slot), waiting for it until `deadline`.
    pub(super) async fn wait_parked(
        &self,
        token: &[u8; TOKEN_LEN],
        slot: u16,
        deadline: tokio::time::Instant,
    ) -> Option<TcpStream> {
        loop {
            let notified = self.parked_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let taken = self.parked.lock().unwrap().take(token, slot);
            if let Some(tcp) = taken {
                let _ = tcp.set_nodelay(true);
                return Some(tcp);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return None,
                _ = notified => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn strangers_fill_only_the_early_area_and_a_wanted_token_still_parks() {
        let now = Instant::now();
        let mut lot = ParkingLot::new();
        let mine = [1u8; TOKEN_LEN];
        lot.want(mine);
        // One source gets its share, then is refused; many sources fill the area.
        let mut kept = 0;
        for i in 0..(MAX_EARLY_PER_SOURCE + 5) {
            let token = [0, 0, 0, (i + 1) as u8].repeat(4).try_into().unwrap();
            match lot.offer(token, 0, i, ip(1), now) {
                Ok(Placed::Early(until)) => {
                    assert_eq!(until, now + EARLY_KEEP);
                    kept += 1;
                }
                Err((_, why)) => assert_eq!(why, Refusal::SourceFull),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(kept, MAX_EARLY_PER_SOURCE);
        for i in 0..2 * MAX_EARLY {
            let token: [u8; TOKEN_LEN] = [(i >> 8) as u8 + 1, i as u8, 7, 7]
                .repeat(4)
                .try_into()
                .unwrap();
            match lot.offer(token, 1, i, ip(2 + (i / MAX_EARLY_PER_SOURCE) as u8), now) {
                Ok(Placed::Early(_)) => {}
                Err((_, why)) => assert_eq!(why, Refusal::Full),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(lot.counts(), (0, MAX_EARLY));
        // Nothing was evicted for the newcomers, and the wanted token is kept anyway.
        for slot in 0..MAX_POOL {
            assert_eq!(
                lot.offer(mine, slot, 1000, ip(1), now).unwrap(),
                Placed::Parked
            );
        }
        assert_eq!(lot.counts(), (MAX_POOL as usize, MAX_EARLY));
        assert_eq!(lot.take(&mine, 3), Some(1000));
        assert_eq!(lot.take(&mine, 3), None);
    }

    #[test]
    fn a_repeated_token_and_stream_is_refused_and_the_first_stays() {
        let now = Instant::now();
        let mut lot = ParkingLot::new();
        let (early, wanted) = ([2u8; TOKEN_LEN], [3u8; TOKEN_LEN]);
        lot.want(wanted);
        assert!(lot.offer(early, 0, "first", ip(1), now).is_ok());
        assert!(lot.offer(wanted, 0, "first", ip(1), now).is_ok());
        for token in [early, wanted] {
            let (back, why) = lot.offer(token, 0, "second", ip(9), now).unwrap_err();
            assert_eq!((back, why), ("second", Refusal::Duplicate));
        }
        // The early one, moved when its token is wanted, stays the first as well.
        lot.want(early);
        assert_eq!(lot.counts(), (2, 0));
        assert_eq!(
            lot.offer(early, 0, "third", ip(1), now).unwrap_err().1,
            Refusal::Duplicate
        );
        assert_eq!(lot.take(&early, 0), Some("first"));
        assert_eq!(lot.take(&wanted, 0), Some("first"));
        // Stream numbers no link uses are refused.
        for slot in [MAX_POOL, PUNCH_SLOT - 1, PUNCH_SLOT + 2, u16::MAX] {
            assert_eq!(
                lot.offer(wanted, slot, "x", ip(1), now).unwrap_err().1,
                Refusal::BadSlot
            );
        }
        for slot in [PUNCH_SLOT, PUNCH_SLOT + 1] {
            assert_eq!(
                lot.offer(wanted, slot, "x", ip(1), now).unwrap(),
                Placed::Parked
            );
        }
    }

    #[test]
    fn early_streams_expire_and_unwanted_leftovers_are_dropped() {
        let now = Instant::now();
        let mut lot = ParkingLot::new();
        for i in 0..4u8 {
            lot.offer([i; TOKEN_LEN], 0, i, ip(i), now).unwrap();
        }
        lot.purge(now + EARLY_KEEP - Duration::from_millis(1));
        assert_eq!(lot.counts(), (0, 4));
        lot.purge(now + EARLY_KEEP);
        assert_eq!(lot.counts(), (0, 0));
        // An expired one no longer blocks the same key, and space is free again.
        let later = now + EARLY_KEEP;
        lot.offer([0; TOKEN_LEN], 0, 10, ip(0), now).unwrap();
        assert!(lot.offer([0; TOKEN_LEN], 0, 11, ip(0), later).is_ok());
        assert_eq!(lot.take(&[0; TOKEN_LEN], 0), Some(11));
        // Two waiters for one token: the streams stay until the last one is done.
        let token = [5u8; TOKEN_LEN];
        lot.want(token);
        lot.want(token);
        lot.offer(token, 0, 50, ip(5), later).unwrap();
        lot.offer(token, 1, 51, ip(5), later).unwrap();
        assert!(lot.unwant(token).is_empty());
        let mut left = lot.unwant(token);
        left.sort();
        assert_eq!(left, vec![50, 51]);
        assert!(lot.unwant(token).is_empty()); // one too many: harmless
                                               // Not wanted any more: a stream for it waits early again (and expires).
        assert!(matches!(
            lot.offer(token, 0, 52, ip(5), later),
            Ok(Placed::Early(_))
        ));
        lot.clear();
        assert_eq!(lot.counts(), (0, 0));
    }
}
