//! The CPU collective: every rank connected to rank 0 over TCP (a star), rank 0 combining the
//! contributions in rank order and sending the result back.
//!
//! For tests, CPU training and the handful of small collectives of a GPU job's start — not a
//! performance claim: a star moves `2 (world - 1)` buffers through one process where NCCL's
//! ring moves `2 (world - 1) / world` per rank. What it does guarantee: every rank gets the
//! same bits (one rank computes the result for all, in rank order), and no rank ever hangs on
//! a dead or stuck peer — every read has the group's timeout, a closed connection is noticed at
//! once, and rank 0 tells the others which rank failed before it gives up.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redline_tensor::{DType, Event, Tensor};

use crate::collective::{
    after_writes, check_root, download_all, pieces, reduce_piece, signature, upload_all,
    Collective, Reduce,
};
use crate::error::{DistError, Result};
use crate::store::Store;

const MAGIC: u32 = 0x5244_4C43; // "RDLC"
/// The largest message a rank accepts (a guard against a stray peer's garbage length).
const MAX_PAYLOAD: u64 = 1 << 40;
/// The size of the pieces a collective's result streams in: rank 0 combines and sends piece
/// `k` while the others are still sending piece `k + 1`.
const PIECE_BYTES: usize = 1 << 20;
/// A piece length that announces an abort instead of data.
const ABORT_PIECE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Welcome = 2,
    AllReduce = 3,
    Broadcast = 4,
    Barrier = 5,
    Result = 6,
    Abort = 7,
    /// Rank 0 sends a new group's address (the others contribute nothing).
    Split = 8,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        [
            Kind::Hello,
            Kind::Welcome,
            Kind::AllReduce,
            Kind::Broadcast,
            Kind::Barrier,
            Kind::Result,
            Kind::Abort,
            Kind::Split,
        ]
        .into_iter()
        .find(|k| *k as u8 == v)
    }
}

/// One message: what it is, which collective of the sequence it belongs to, a word of detail
/// (the reduction and the tensors' digest, a rank) and the bytes.
struct Frame {
    kind: Kind,
    seq: u64,
    aux: u64,
    payload: Vec<u8>,
}

/// A connection to one other rank.
struct Link {
    rank: usize,
    stream: TcpStream,
}

/// Why a link failed, before it is turned into an error naming the rank.
enum LinkFailure {
    Closed,
    Silent,
    Io(std::io::Error),
    Garbled(String),
    /// The other side aborted the group, blaming `rank`.
    Aborted {
        rank: usize,
        message: String,
    },
}

impl Link {
    fn new(rank: usize, stream: TcpStream, timeout: Duration) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Self { rank, stream })
    }

    fn send(&mut self, kind: Kind, seq: u64, aux: u64, payload: &[u8]) -> Result<(), LinkFailure> {
        send_frame(&mut self.stream, kind, seq, aux, payload)
    }

    /// A message's head: what it is, and how many bytes follow (`Abort`s are read whole and
    /// returned as the failure they report).
    fn recv_head(&mut self) -> Result<(Kind, u64, u64, u64), LinkFailure> {
        let mut head = [0u8; 29];
        self.stream.read_exact(&mut head).map_err(failure)?;
        let word =
            |r: std::ops::Range<usize>| u64::from_le_bytes(head[r].try_into().unwrap_or([0; 8]));
        if head[0..4] != MAGIC.to_le_bytes() {
            return Err(LinkFailure::Garbled(
                "not a redline collective message".into(),
            ));
        }
        let kind = Kind::from_u8(head[4])
            .ok_or_else(|| LinkFailure::Garbled(format!("unknown message kind {}", head[4])))?;
        let (seq, aux, len) = (word(5..13), word(13..21), word(21..29));
        if len > MAX_PAYLOAD {
            return Err(LinkFailure::Garbled(format!("a {len}-byte message")));
        }
        if kind == Kind::Abort {
            let mut message = vec![0u8; len as usize];
            self.stream.read_exact(&mut message).map_err(failure)?;
            return Err(LinkFailure::Aborted {
                rank: aux as usize,
                message: String::from_utf8_lossy(&message).into_owned(),
            });
        }
        Ok((kind, seq, aux, len))
    }

    fn recv(&mut self) -> Result<Frame, LinkFailure> {
        let (kind, seq, aux, len) = self.recv_head()?;
        let mut payload = vec![0u8; len as usize];
        self.stream.read_exact(&mut payload).map_err(failure)?;
        Ok(Frame {
            kind,
            seq,
            aux,
            payload,
        })
    }

    /// The next message's head, which must be `kind` for collective `seq`: its detail word and
    /// how many bytes follow.
    fn expect_head(&mut self, kind: Kind, seq: u64) -> Result<(u64, usize), LinkFailure> {
        let (got, their_seq, aux, len) = self.recv_head()?;
        check_order(got, their_seq, kind, seq)?;
        Ok((aux, len as usize))
    }

    /// One piece of a streamed result: its length, then its bytes.
    fn send_piece(&mut self, bytes: &[u8]) -> Result<(), LinkFailure> {
        (self.stream.write_all(&(bytes.len() as u32).to_le_bytes()))
            .and_then(|_| self.stream.write_all(bytes))
            .map_err(failure)
    }

    /// In place of the next piece: the group failed, `rank` is to blame.
    fn send_abort_piece(&mut self, rank: usize, message: &str) -> Result<(), LinkFailure> {
        let mut bytes = ABORT_PIECE.to_le_bytes().to_vec();
        bytes.extend((rank as u64).to_le_bytes());
        bytes.extend((message.len() as u32).to_le_bytes());
        bytes.extend(message.as_bytes());
        self.stream.write_all(&bytes).map_err(failure)
    }

    /// Appends the next piece of a streamed result to `out`.
    fn recv_piece(&mut self, out: &mut Vec<u8>) -> Result<(), LinkFailure> {
        let mut word = [0u8; 4];
        self.stream.read_exact(&mut word).map_err(failure)?;
        let len = u32::from_le_bytes(word);
        if len == ABORT_PIECE {
            let mut rank = [0u8; 8];
            self.stream.read_exact(&mut rank).map_err(failure)?;
            self.stream.read_exact(&mut word).map_err(failure)?;
            let mut message = vec![0u8; u32::from_le_bytes(word) as usize];
            self.stream.read_exact(&mut message).map_err(failure)?;
            return Err(LinkFailure::Aborted {
                rank: u64::from_le_bytes(rank) as usize,
                message: String::from_utf8_lossy(&message).into_owned(),
            });
        }
        let start = out.len();
        out.resize(start + len as usize, 0);
        self.stream.read_exact(&mut out[start..]).map_err(failure)
    }

    /// The next frame, which must be `kind` for collective `seq`.
    fn expect(&mut self, kind: Kind, seq: u64) -> Result<Frame, LinkFailure> {
        let frame = self.recv()?;
        check_order(frame.kind, frame.seq, kind, seq)?;
        Ok(frame)
    }
}

/// A message's head and payload.
fn send_frame(
    stream: &mut TcpStream,
    kind: Kind,
    seq: u64,
    aux: u64,
    payload: &[u8],
) -> Result<(), LinkFailure> {
    (stream.write_all(&head_bytes(kind, seq, aux, payload.len())))
        .and_then(|_| stream.write_all(payload))
        .map_err(failure)
}

/// Errors unless a message of `got` #`their_seq` is the `kind` #`seq` this rank is at.
fn check_order(got: Kind, their_seq: u64, kind: Kind, seq: u64) -> Result<(), LinkFailure> {
    match got == kind && their_seq == seq {
        true => Ok(()),
        false => Err(LinkFailure::Garbled(format!(
            "sent {got:?} #{their_seq} while this rank is at {kind:?} #{seq} (ranks issued \
             different collectives)"
        ))),
    }
}

fn failure(e: std::io::Error) -> LinkFailure {
    match e.kind() {
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe => LinkFailure::Closed,
        ErrorKind::WouldBlock | ErrorKind::TimedOut => LinkFailure::Silent,
        _ => LinkFailure::Io(e),
    }
}

/// The links and where the group is in its sequence of collectives.
struct Group {
    /// Rank 0: one link per other rank (rank r at r - 1). Others: the link to rank 0.
    links: Vec<Link>,
    seq: u64,
    /// Set when the group failed: every later call fails the same way, at once.
    broken: Option<(usize, String)>,
}

/// A [`Collective`] over TCP: see the module docs.
pub struct TcpCollective {
    rank: usize,
    world: usize,
    timeout: Duration,
    group: Mutex<Group>,
    /// The store rank 0 serves, kept as long as the group (ranks read it while joining).
    _store: Option<crate::store::StoreServer>,
}

/// The store key under which rank 0 publishes its collective's address.
fn root_key(prefix: &str) -> String {
    format!("{prefix}collective/root")
}

impl TcpCollective {
    /// Forms the group: rank 0 listens on an ephemeral port of the address it reaches the
    /// store from and publishes it under `prefix`; the others read it and connect. Returns
    /// once all `world` ranks are connected; a rank that has not joined within `timeout` is
    /// named in the error every rank gets.
    pub fn connect(
        store: &mut dyn Store,
        prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if rank >= world {
            return Err(DistError::Usage(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        let key = root_key(prefix);
        let links = match rank {
            0 => {
                let ip = store.local_ip();
                let publish = |addr: &str| store.set(&key, addr.as_bytes());
                Self::accept_all(ip, publish, world, timeout)?
            }
            _ => {
                // Only rank 0 publishes the address: a wait that times out is rank 0's absence.
                let published = store.get(&key, timeout).map_err(|e| match e {
                    DistError::Rendezvous { message, .. } => DistError::Peer {
                        rank: 0,
                        during: "the rendezvous".into(),
                        message: format!(
                            "it never published its address within {timeout:?} ({message})"
                        ),
                    },
                    other => other,
                })?;
                let address = String::from_utf8_lossy(&published).into_owned();
                vec![Self::join(&address, rank, world, timeout)?]
            }
        };
        Ok(Self::from_links(rank, world, timeout, links))
    }

    fn from_links(rank: usize, world: usize, timeout: Duration, links: Vec<Link>) -> Self {
        Self {
            rank,
            world,
            timeout,
            group: Mutex::new(Group {
                links,
                seq: 0,
                broken: None,
            }),
            _store: None,
        }
    }

    /// Keeps the store this rank serves alive as long as the group.
    pub(crate) fn keeping(mut self, server: Option<crate::store::StoreServer>) -> Self {
        self._store = server;
        self
    }

    /// Rank 0's side: listens on an ephemeral port of `ip`, tells the others where
    /// (`publish`), and accepts them.
    fn accept_all(
        ip: IpAddr,
        publish: impl FnOnce(&str) -> Result<()>,
        world: usize,
        timeout: Duration,
    ) -> Result<Vec<Link>> {
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| DistError::io(format!("rank 0: listening on {ip}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| DistError::io("rank 0: its listening address", e))?;
        publish(&addr.to_string())?;
        listener
            .set_nonblocking(true)
            .map_err(|e| DistError::io("rank 0: a non-blocking listener", e))?;
        let deadline = Instant::now() + timeout;
        let mut joined: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        let mut missing: Vec<usize> = (1..world).collect();
        while !missing.is_empty() {
            if Instant::now() >= deadline {
                let message = format!(
                    "rank(s) {missing:?} of {world} did not join within {timeout:?} (not started, \
                     or started with another MASTER_ADDR/MASTER_PORT)"
                );
                for link in joined.iter_mut().flatten() {
                    let _ = link.send(Kind::Abort, 0, missing[0] as u64, message.as_bytes());
                }
                return Err(DistError::Rendezvous {
                    address: addr.to_string(),
                    timeout,
                    message,
                });
            }
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(DistError::io("rank 0: accepting a rank", e)),
            };
            // A connection that does not say who it is within a second is not one of ours.
            let hello = (stream.set_nonblocking(false))
                .and_then(|_| Link::new(usize::MAX, stream, Duration::from_secs(1)));
            let Ok(mut link) = hello else { continue };
            let Ok(frame) = link.expect(Kind::Hello, 0) else {
                continue;
            };
            let (r, their_world) = (frame.aux as usize, read_u64(&frame.payload));
            if their_world != Some(world as u64) || r == 0 || r >= world {
                let message = format!(
                    "a process claiming rank {r} of a world of {their_world:?} joined a world of {world}"
                );
                let _ = link.send(Kind::Abort, 0, r as u64, message.as_bytes());
                return Err(DistError::Protocol(message));
            }
            if joined[r].is_some() {
                let message = format!("two processes claim rank {r}");
                let _ = link.send(Kind::Abort, 0, r as u64, message.as_bytes());
                return Err(DistError::Protocol(message));
            }
            link.rank = r;
            (link.stream.set_read_timeout(Some(timeout)))
                .and_then(|_| link.stream.set_write_timeout(Some(timeout)))
                .map_err(|e| DistError::io(format!("rank 0: the link to rank {r}"), e))?;
            joined[r] = Some(link);
            missing.retain(|&m| m != r);
        }
        let mut links: Vec<Link> = joined.into_iter().flatten().collect();
        for link in &mut links {
            let r = link.rank;
            link.send(Kind::Welcome, 0, world as u64, &[])
                .map_err(|f| peer_error(r, "the rendezvous", f, timeout))?;
        }
        Ok(links)
    }

    /// The other ranks' side: connects to rank 0 at `address` and waits for the group.
    fn join(address: &str, rank: usize, world: usize, timeout: Duration) -> Result<Link> {
        let address = address.to_string();
        let addr: SocketAddr = address.parse().map_err(|_| {
            DistError::Protocol(format!("rank 0 published {address:?} as its address"))
        })?;
        let stream =
            TcpStream::connect_timeout(&addr, timeout).map_err(|e| DistError::Rendezvous {
                address: address.clone(),
                timeout,
                message: format!("rank {rank} could not connect to rank 0: {e}"),
            })?;
        // Rank 0 gathers every contribution within one timeout and may itself arrive up to a
        // timeout late: the others wait twice as long for its answer, so that a stalled rank is
        // blamed by rank 0 (which knows who it is) before anyone blames rank 0.
        let mut link = Link::new(0, stream, 2 * timeout).map_err(|e| {
            DistError::io(format!("rank {rank}: the link to rank 0 at {address}"), e)
        })?;
        let during = "the rendezvous";
        link.send(Kind::Hello, 0, rank as u64, &(world as u64).to_le_bytes())
            .map_err(|f| peer_error(0, during, f, timeout))?;
        // Rank 0 answers once everyone has joined, within its own timeout, which began before
        // it published the address this rank just used.
        link.expect(Kind::Welcome, 0)
            .map_err(|f| peer_error(0, during, f, timeout))?;
        Ok(link)
    }

    /// Runs one collective: each rank sends `own` (its bytes, or nothing when only one rank
    /// contributes) to rank 0, which streams the result back piece by piece — each piece of
    /// `plan` (a byte range and the dtype of its elements) combined by `combine` from every
    /// contributing rank's bytes (rank order; empty for a rank that contributes nothing) as
    /// soon as it has arrived, while the rest is still in flight.
    fn exchange(
        &self,
        kind: Kind,
        aux: u64,
        own: Vec<u8>,
        plan: &[(std::ops::Range<usize>, DType)],
        combine: impl FnMut(&[&[u8]], DType) -> Vec<u8>,
    ) -> Result<Vec<u8>> {
        let mut group = self.group.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((rank, message)) = &group.broken {
            return Err(DistError::Peer {
                rank: *rank,
                during: format!("an earlier collective ({kind:?} is refused)"),
                message: message.clone(),
            });
        }
        group.seq += 1;
        let seq = group.seq;
        let during = format!("{kind:?} #{seq}");
        let head = Head { kind, seq, aux };
        let result = match self.rank {
            0 => self.gather_and_answer(&mut group.links, head, &own, plan, combine, &during),
            _ => self.send_and_receive(&mut group.links[0], head, &own, &during),
        };
        if let Err(DistError::Peer { rank, message, .. }) = &result {
            group.broken = Some((*rank, message.clone()));
        }
        result
    }

    /// A non-root rank's side: sends its bytes on a second thread while it reads rank 0's
    /// answer (rank 0 starts answering before it has everything).
    fn send_and_receive(
        &self,
        link: &mut Link,
        head: Head,
        own: &[u8],
        during: &str,
    ) -> Result<Vec<u8>> {
        let fail = |f| peer_error(0, during, f, 2 * self.timeout);
        let mut writer = link
            .stream
            .try_clone()
            .map_err(|e| fail(LinkFailure::Io(e)))?;
        std::thread::scope(|scope| {
            let sending =
                scope.spawn(move || send_frame(&mut writer, head.kind, head.seq, head.aux, own));
            let received = (|| {
                let (_, total) = link.expect_head(Kind::Result, head.seq)?;
                let mut out = Vec::with_capacity(total);
                while out.len() < total {
                    link.recv_piece(&mut out)?;
                }
                Ok(out)
            })();
            if received.is_err() {
                // Unblocks the sending thread: the group is over.
                let _ = link.stream.shutdown(std::net::Shutdown::Both);
            }
            let sent = (sending.join()).unwrap_or_else(|_| {
                Err(LinkFailure::Garbled("the sending thread panicked".into()))
            });
            match (received, sent) {
                (Ok(out), Ok(())) => Ok(out),
                (Err(f), _) | (Ok(_), Err(f)) => Err(fail(f)),
            }
        })
    }

    /// Rank 0's side; on a rank's failure it tells every other rank who failed (in place of
    /// the next piece once it has begun answering), so they stop waiting now.
    fn gather_and_answer(
        &self,
        links: &mut [Link],
        head: Head,
        own: &[u8],
        plan: &[(std::ops::Range<usize>, DType)],
        combine: impl FnMut(&[&[u8]], DType) -> Vec<u8>,
        during: &str,
    ) -> Result<Vec<u8>> {
        let mut answering = false;
        let result = self.combine_pieces(links, head, own, plan, combine, during, &mut answering);
        if let Err(DistError::Peer { rank, message, .. }) = &result {
            for link in links.iter_mut() {
                let _ = match answering {
                    true => link.send_abort_piece(*rank, message),
                    false => link.send(Kind::Abort, head.seq, *rank as u64, message.as_bytes()),
                };
            }
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn combine_pieces(
        &self,
        links: &mut [Link],
        head: Head,
        own: &[u8],
        plan: &[(std::ops::Range<usize>, DType)],
        mut combine: impl FnMut(&[&[u8]], DType) -> Vec<u8>,
        during: &str,
        answering: &mut bool,
    ) -> Result<Vec<u8>> {
        let total = plan.last().map_or(0, |(bytes, _)| bytes.end);
        // Broadcast and Split carry one rank's bytes; the others send nothing.
        let one_sided = matches!(head.kind, Kind::Broadcast | Kind::Split);
        let fits = |len: usize| len == total || (one_sided && len == 0);
        if !fits(own.len()) {
            return Err(DistError::Usage(format!(
                "{during}: {} bytes for a collective of {total}",
                own.len()
            )));
        }
        // Every rank's head within one timeout from now, however many ranks are silent.
        let deadline = Instant::now() + self.timeout;
        let mut lens = Vec::with_capacity(links.len());
        for link in links.iter_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            let waited = (link.stream)
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(LinkFailure::Io)
                .and_then(|_| link.expect_head(head.kind, head.seq));
            let (aux, len) = waited.map_err(|f| peer_error(link.rank, during, f, self.timeout))?;
            if aux != head.aux || !fits(len) {
                let message = format!(
                    "sent {len} bytes (detail {aux:#x}) where rank 0 has {} (detail {:#x}): the \
                     ranks passed different tensors",
                    own.len(),
                    head.aux
                );
                return Err(DistError::Peer {
                    rank: link.rank,
                    during: during.to_string(),
                    message,
                });
            }
            lens.push(len);
        }
        *answering = true;
        for link in links.iter_mut() {
            let answer = (link.stream.set_read_timeout(Some(self.timeout)))
                .map_err(LinkFailure::Io)
                .and_then(|_| send_head(&mut link.stream, Kind::Result, head.seq, total));
            answer.map_err(|f| peer_error(link.rank, during, f, self.timeout))?;
        }
        let mut bufs: Vec<Vec<u8>> = links.iter().map(|_| Vec::new()).collect();
        let mut result = Vec::with_capacity(total);
        for (bytes, dtype) in plan {
            for ((link, buf), &len) in links.iter_mut().zip(&mut bufs).zip(&lens) {
                buf.resize(if len == 0 { 0 } else { bytes.len() }, 0);
                (link.stream.read_exact(buf))
                    .map_err(|e| peer_error(link.rank, during, failure(e), self.timeout))?;
            }
            let mine: &[u8] = if own.is_empty() {
                &[]
            } else {
                &own[bytes.clone()]
            };
            let pieces: Vec<&[u8]> = std::iter::once(mine)
                .chain(bufs.iter().map(Vec::as_slice))
                .collect();
            let out = combine(&pieces, *dtype);
            for link in links.iter_mut() {
                (link.send_piece(&out))
                    .map_err(|f| peer_error(link.rank, during, f, self.timeout))?;
            }
            result.extend_from_slice(&out);
        }
        Ok(result)
    }
}

/// Which collective a message belongs to.
#[derive(Clone, Copy)]
struct Head {
    kind: Kind,
    seq: u64,
    aux: u64,
}

/// A message's head alone, announcing `len` bytes that follow as pieces.
fn send_head(stream: &mut TcpStream, kind: Kind, seq: u64, len: usize) -> Result<(), LinkFailure> {
    stream
        .write_all(&head_bytes(kind, seq, 0, len))
        .map_err(failure)
}

/// A message's 29-byte head: magic, kind, sequence number, detail word, payload length.
fn head_bytes(kind: Kind, seq: u64, aux: u64, len: usize) -> [u8; 29] {
    let mut head = [0u8; 29];
    head[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    head[4] = kind as u8;
    head[5..13].copy_from_slice(&seq.to_le_bytes());
    head[13..21].copy_from_slice(&aux.to_le_bytes());
    head[21..29].copy_from_slice(&(len as u64).to_le_bytes());
    head
}

fn read_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}

fn peer_error(rank: usize, during: &str, failure: LinkFailure, timeout: Duration) -> DistError {
    let (rank, message) = match failure {
        LinkFailure::Closed => (
            rank,
            "closed its connection (the process exited or was killed)".into(),
        ),
        LinkFailure::Silent => (
            rank,
            format!("sent nothing for {timeout:?} (stuck, or far behind)"),
        ),
        LinkFailure::Io(e) => (rank, format!("connection error: {e}")),
        LinkFailure::Garbled(m) => (rank, m),
        LinkFailure::Aborted { rank, message } => (rank, format!("{message} (reported by rank 0)")),
    };
    DistError::Peer {
        rank,
        during: during.to_string(),
        message,
    }
}

/// A 56-bit digest of the tensors' dtypes and sizes and the reduction, compared across ranks.
fn digest(tensors: &[Tensor], op: u8) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (dtype, n) in signature(tensors) {
        (dtype.to_string(), n).hash(&mut h);
    }
    (h.finish() & 0x00FF_FFFF_FFFF_FFFF) | ((op as u64) << 56)
}

impl TcpCollective {
    /// An all-reduce whose contribution is downloaded after every op so far, or after `ready`.
    fn reduce_from(&self, tensors: &[Tensor], op: Reduce, ready: Option<&Event>) -> Result<()> {
        let own = download_all(tensors, ready)?;
        let plan = pieces(&signature(tensors), PIECE_BYTES);
        let code = match op {
            Reduce::Sum => 1,
            Reduce::Avg => 2,
            Reduce::Max => 3,
        };
        let world = self.world as f64;
        let result = self.exchange(
            Kind::AllReduce,
            digest(tensors, code),
            own,
            &plan,
            |all, dtype| reduce_piece(all, dtype, op, world),
        )?;
        upload_all(tensors, &result)
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, tensors: &[Tensor], op: Reduce) -> Result<()> {
        self.reduce_from(tensors, op, None)
    }

    fn all_reduce_after(&self, tensors: &[Tensor], op: Reduce, ready: &Event) -> Result<Event> {
        self.reduce_from(tensors, op, Some(ready))?;
        after_writes(tensors)
    }

    fn broadcast(&self, tensors: &[Tensor], root: usize) -> Result<()> {
        check_root(root, self.world)?;
        // Only the root's bytes travel in: the others send an empty contribution.
        let own = match self.rank == root {
            true => download_all(tensors, None)?,
            false => Vec::new(),
        };
        let aux = digest(tensors, 0x10 | root as u8);
        let plan = pieces(&signature(tensors), PIECE_BYTES);
        let result = self.exchange(Kind::Broadcast, aux, own, &plan, |all, _| {
            all[root].to_vec()
        })?;
        if self.rank != root {
            upload_all(tensors, &result)?;
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange(Kind::Barrier, 0, Vec::new(), &[], |_, _| Vec::new())
            .map(|_| ())
    }

    fn split(&self) -> Result<Arc<dyn Collective>> {
        let timeout = self.timeout;
        let links = match self.rank {
            0 => {
                // Where the others reach this rank already: the same interface.
                let ip = {
                    let group = self.group.lock().unwrap_or_else(|p| p.into_inner());
                    (group.links.first())
                        .and_then(|l| l.stream.local_addr().ok())
                        .map_or(IpAddr::from([127, 0, 0, 1]), |a| a.ip())
                };
                let publish = |addr: &str| {
                    let bytes = addr.as_bytes().to_vec();
                    let plan = pieces(&[(DType::U8, bytes.len())], PIECE_BYTES);
                    self.exchange(Kind::Split, 0, bytes, &plan, |all, _| all[0].to_vec())
                        .map(|_| ())
                };
                Self::accept_all(ip, publish, self.world, timeout)?
            }
            _ => {
                // The address's length is rank 0's to know: it is announced in the answer.
                let bytes =
                    self.exchange(Kind::Split, 0, Vec::new(), &[], |all, _| all[0].to_vec())?;
                let address = String::from_utf8_lossy(&bytes).into_owned();
                vec![Self::join(&address, self.rank, self.world, timeout)?]
            }
        };
        Ok(Arc::new(Self::from_links(
            self.rank, self.world, timeout, links,
        )))
    }
}
