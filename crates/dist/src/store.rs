//! PyTorch's TCPStore protocol: the key-value store the ranks of a job meet in.
//!
//! The wire format is c10d's (`torch/csrc/distributed/c10d/TCPStore.cpp` and its backends): a
//! request is a one-byte query type followed by its fields; integers are little-endian
//! (the machine's order in c10d, which every platform PyTorch supports shares), strings and
//! byte vectors are a u64 length then the bytes. A client first sends VALIDATE with c10d's magic
//! number, then PING with a nonce the server echoes. [`StoreClient`] speaks it to torchrun's
//! agent store (or any TCPStore); [`StoreServer`] is a small server of the same protocol that
//! rank 0 runs when no launcher provides one.
//!
//! A client's `get` with a timeout polls CHECK until the key exists, then GETs it: waiting
//! stays on the client, so a timed-out wait leaves nothing pending on the server.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{DistError, Result};

/// c10d's `validationMagicNumber`, the first thing a client sends.
const MAGIC: u32 = 0x3C85_F7CE;

/// c10d's `QueryType` (the values this module sends or serves).
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const PING: u8 = 13;
}
/// c10d's `CheckResponseType::READY` and `WaitResponseType::STOP_WAITING`.
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;

/// What the rendezvous needs of a store.
pub trait Store {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Adds `delta` to the integer under `key` (0 when absent) and returns the sum.
    fn add(&mut self, key: &str, delta: i64) -> Result<i64>;
    /// The address this process reaches the store from: where the others can reach it.
    fn local_ip(&self) -> IpAddr;
}

/// A connection to a TCPStore (torchrun's agent's, or a [`StoreServer`]).
pub struct StoreClient {
    stream: TcpStream,
    address: String,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `address` (`host:port`), retrying while nothing listens there yet (rank 0
    /// may start after the others), for up to `timeout`.
    pub fn connect(address: &str, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no address");
        loop {
            let candidates: Vec<SocketAddr> = match address.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => {
                    last = format!("cannot resolve it: {e}");
                    Vec::new()
                }
            };
            for addr in candidates {
                let left = deadline.saturating_duration_since(Instant::now());
                let attempt =
                    TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(50)));
                match attempt.and_then(|s| Self::handshake(s, address, timeout)) {
                    Ok(client) => return Ok(client),
                    Err(e) => last = format!("{addr}: {e}"),
                }
            }
            if Instant::now() >= deadline {
                return Err(DistError::Rendezvous {
                    address: address.to_string(),
                    timeout,
                    message: format!("no store answered ({last})"),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn handshake(stream: TcpStream, address: &str, timeout: Duration) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut client = Self {
            stream,
            address: address.to_string(),
            timeout,
        };
        let mut hello = vec![query::VALIDATE];
        hello.extend(MAGIC.to_le_bytes());
        let nonce = std::process::id();
        hello.push(query::PING);
        hello.extend(nonce.to_le_bytes());
        client.stream.write_all(&hello)?;
        let echoed = u32::from_le_bytes(read_array(&mut client.stream)?);
        if echoed != nonce {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!("PING {nonce} answered with {echoed}: not a TCPStore"),
            ));
        }
        Ok(client)
    }

    fn fail(&self, what: &str, e: std::io::Error) -> DistError {
        DistError::io(format!("store at {}: {what}", self.address), e)
    }

    fn request(&mut self, bytes: &[u8], what: &str) -> Result<()> {
        self.stream.write_all(bytes).map_err(|e| self.fail(what, e))
    }

    /// Whether every key is set (CHECK).
    pub fn check(&mut self, keys: &[&str]) -> Result<bool> {
        let mut req = vec![query::CHECK];
        put_u64(&mut req, keys.len() as u64);
        for key in keys {
            put_bytes(&mut req, key.as_bytes());
        }
        self.request(&req, "CHECK")?;
        let [answer] = read_array::<1>(&mut self.stream).map_err(|e| self.fail("CHECK", e))?;
        match answer {
            READY => Ok(true),
            NOT_READY => Ok(false),
            other => Err(DistError::Protocol(format!(
                "store at {}: CHECK answered {other}",
                self.address
            ))),
        }
    }
}

impl Store for StoreClient {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![query::SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.request(&req, "SET")
    }

    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        while !self.check(&[key])? {
            if Instant::now() >= deadline {
                return Err(DistError::Rendezvous {
                    address: self.address.clone(),
                    timeout,
                    message: format!("nobody set {key:?} in the store"),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut req = vec![query::GET];
        put_bytes(&mut req, key.as_bytes());
        self.request(&req, "GET")?;
        read_bytes(&mut self.stream).map_err(|e| self.fail("GET", e))
    }

    fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![query::ADD];
        put_bytes(&mut req, key.as_bytes());
        req.extend(delta.to_le_bytes());
        self.request(&req, "ADD")?;
        let sum = read_array(&mut self.stream).map_err(|e| self.fail("ADD", e))?;
        Ok(i64::from_le_bytes(sum))
    }

    fn local_ip(&self) -> IpAddr {
        (self.stream.local_addr())
            .map(|a| a.ip())
            .unwrap_or(IpAddr::from([127, 0, 0, 1]))
    }
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StoreClient({}, timeout {:?})",
            self.address, self.timeout
        )
    }
}

fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend(v.to_le_bytes());
}

fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    put_u64(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

fn read_array<const N: usize>(stream: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut buf = [0u8; N];
    stream.read_exact(&mut buf)?;
    Ok(buf)
}

/// The largest key or value either side accepts (a guard against garbage lengths).
const MAX_FIELD: u64 = 1 << 30;

fn read_bytes(stream: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let len = u64::from_le_bytes(read_array(stream)?);
    if len > MAX_FIELD {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a {len}-byte field"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    stream.read_exact(&mut buf)?;
    Ok(buf)
}

/// The keys and values, and a condition variable for WAIT.
#[derive(Default)]
struct Table {
    entries: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

/// A TCPStore server for the requests ranks make (VALIDATE, PING, SET, GET, ADD, CHECK, WAIT,
/// COMPARE_SET, GETNUMKEYS, DELETE_KEY), one thread per connection; a connection that sends
/// anything else is closed. Stops accepting when dropped.
pub struct StoreServer {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on every interface at `address`'s port (as c10d's master store does); port 0
    /// picks a free one ([`StoreServer::address`] tells which).
    pub fn bind(address: &str) -> Result<Self> {
        let port = address
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .ok_or_else(|| DistError::Usage(format!("store address {address:?} has no port")))?;
        let listener = TcpListener::bind(("::", port))
            .or_else(|_| TcpListener::bind(("0.0.0.0", port)))
            .map_err(|e| DistError::io(format!("serving the store on port {port}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| DistError::io("the store's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| DistError::io("a non-blocking store listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let stopping = stop.clone();
        let acceptor = std::thread::Builder::new()
            .name("redline-store".into())
            .spawn(move || accept(listener, table, stopping))
            .map_err(|e| DistError::io("starting the store thread", e))?;
        Ok(Self {
            address: SocketAddr::new(IpAddr::from([127, 0, 0, 1]), local.port()),
            stop,
            acceptor: Some(acceptor),
        })
    }

    /// A loopback address of the server (its port is the one bound).
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn accept(listener: TcpListener, table: Arc<Table>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let table = table.clone();
                let _ = std::thread::Builder::new()
                    .name("redline-store-conn".into())
                    .spawn(move || {
                        let _ = serve(stream, &table);
                    });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Answers one connection's requests until it closes or breaks the protocol.
fn serve(mut stream: TcpStream, table: &Table) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let bad = |m: String| std::io::Error::new(ErrorKind::InvalidData, m);
    let [first] = read_array::<1>(&mut stream)?;
    let magic = u32::from_le_bytes(read_array(&mut stream)?);
    if first != query::VALIDATE || magic != MAGIC {
        return Err(bad("not a TCPStore client".into()));
    }
    let lock = || table.entries.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let [kind] = match read_array::<1>(&mut stream) {
            Ok(k) => k,
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut reply = Vec::new();
        match kind {
            query::PING => reply.extend(read_array::<4>(&mut stream)?),
            query::SET => {
                let (key, value) = (read_bytes(&mut stream)?, read_bytes(&mut stream)?);
                lock().insert(key, value);
                table.changed.notify_all();
            }
            query::COMPARE_SET => {
                let key = read_bytes(&mut stream)?;
                let (expected, desired) = (read_bytes(&mut stream)?, read_bytes(&mut stream)?);
                let mut entries = lock();
                let current = match entries.get(&key) {
                    None if expected.is_empty() => {
                        entries.insert(key, desired.clone());
                        desired
                    }
                    None => expected,
                    Some(v) if *v == expected => {
                        entries.insert(key, desired.clone());
                        desired
                    }
                    Some(v) => v.clone(),
                };
                drop(entries);
                table.changed.notify_all();
                put_bytes(&mut reply, &current);
            }
            query::GET => {
                let key = read_bytes(&mut stream)?;
                let Some(value) = lock().get(&key).cloned() else {
                    return Err(bad(format!(
                        "GET of a missing key {:?}",
                        String::from_utf8_lossy(&key)
                    )));
                };
                put_bytes(&mut reply, &value);
            }
            query::ADD => {
                let key = read_bytes(&mut stream)?;
                let delta = i64::from_le_bytes(read_array(&mut stream)?);
                let mut entries = lock();
                let old = (entries.get(&key))
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                    .unwrap_or(0);
                let sum = old.wrapping_add(delta);
                // c10d keeps counters as decimal strings (a GET of a counter reads "3").
                entries.insert(key, sum.to_string().into_bytes());
                drop(entries);
                table.changed.notify_all();
                reply.extend(sum.to_le_bytes());
            }
            query::CHECK | query::WAIT => {
                let n = u64::from_le_bytes(read_array(&mut stream)?);
                if n > MAX_FIELD {
                    return Err(bad(format!("{n} keys")));
                }
                let keys: Vec<Vec<u8>> = (0..n)
                    .map(|_| read_bytes(&mut stream))
                    .collect::<std::io::Result<_>>()?;
                let mut entries = lock();
                let all = |e: &HashMap<Vec<u8>, Vec<u8>>| keys.iter().all(|k| e.contains_key(k));
                if kind == query::CHECK {
                    reply.push(if all(&entries) { READY } else { NOT_READY });
                } else {
                    while !all(&entries) {
                        entries = table
                            .changed
                            .wait(entries)
                            .unwrap_or_else(|p| p.into_inner());
                    }
                    reply.push(STOP_WAITING);
                }
            }
            query::GETNUMKEYS => reply.extend((lock().len() as i64).to_le_bytes()),
            query::DELETE_KEY => {
                let key = read_bytes(&mut stream)?;
                let removed = lock().remove(&key).is_some() as i64;
                reply.extend(removed.to_le_bytes());
            }
            other => return Err(bad(format!("query type {other} is not served here"))),
        }
        stream.write_all(&reply)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_sets_gets_adds_and_waits_on_the_server() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let address = server.address().to_string();
        let t = Duration::from_secs(5);
        let mut a = StoreClient::connect(&address, t).unwrap();
        let mut b = StoreClient::connect(&address, t).unwrap();
        assert!(!a.check(&["k"]).unwrap());
        let waiter = std::thread::spawn(move || b.get("k", Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        a.set("k", b"value").unwrap();
        assert_eq!(waiter.join().unwrap(), b"value");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(a.add("n", 5).unwrap(), 7);
        assert_eq!(a.get("n", t).unwrap(), b"7");
    }

    #[test]
    fn a_missing_key_or_store_times_out_naming_it() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let t = Duration::from_millis(200);
        let mut a = StoreClient::connect(&server.address().to_string(), t).unwrap();
        let err = a.get("never", t).unwrap_err().to_string();
        assert!(
            err.contains("\"never\"") && err.contains("timed out"),
            "{err}"
        );
        let port = server.address().port();
        drop(server);
        drop(a);
        // Nothing listens on a port just released (the server stopped accepting).
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = StoreClient::connect(&free.to_string(), t)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&free.to_string()) && err.contains("no store answered"),
            "{err} ({port})"
        );
    }
}
