//! Tensor transfer between peers for shared-state sync: a peer *serves* named byte
//! ranges (its tensors, read in place); another peer *fetches* one into a buffer of its
//! own over an authenticated p2p stream (`Purpose::Transfer`).
//!
//! Request (one frame, <= 4 KiB): the byte range as u64 big-endian offset and length,
//! then the key, UTF-8. Reply: a status byte (0 = found, 1 = not served, 2 = the range
//! lies outside the tensor), then for status 0 the tensor's whole length as u64
//! big-endian and the range's bytes. A connection serves requests until the fetcher
//! closes it. The fetcher verifies the content hash itself, so a wrong or stale tensor
//! is caught there, not trusted; ranges start on hash leaves, so a tensor fetched in
//! ranges from several sources is hashed while it lands too.

use crate::error::{CoreError, CoreResult};
use crate::hash::{LeafHasher, LEAF_SIZE};
use crate::net::frame::{read_frame, write_frame};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const MAX_REQUEST: usize = 4096;
/// Bytes moved per read/write call, so stalls are noticed within one timeout.
const SLICE: usize = 4 << 20;
// Slices are hashed as they land, so each must be whole hash leaves.
const _: () = assert!(SLICE.is_multiple_of(LEAF_SIZE));

/// A byte range served in place. `keepalive` owns whatever backs the memory.
pub struct Served {
    ptr: usize,
    len: usize,
    _keepalive: Box<dyn Send + Sync>,
}

impl Served {
    /// # Safety
    /// `ptr..ptr+len` must stay valid and unmodified while `keepalive` lives.
    pub unsafe fn new(ptr: *const u8, len: usize, keepalive: Box<dyn Send + Sync>) -> Self {
        Served {
            ptr: ptr as usize,
            len,
            _keepalive: keepalive,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: see `new`.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

#[derive(Default)]
pub struct TransferRegistry {
    served: Mutex<HashMap<String, Arc<Served>>>,
    sent: AtomicU64,
}

impl TransferRegistry {
    pub fn serve(&self, key: String, item: Served) {
        self.served.lock().unwrap().insert(key, Arc::new(item));
    }

    pub fn unserve_all(&self) {
        self.served.lock().unwrap().clear();
    }

    /// Payload bytes served so far (for `SyncInfo.tx_bytes`).
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn get(&self, key: &str) -> Option<Arc<Served>> {
        self.served.lock().unwrap().get(key).cloned()
    }
}

/// Serves requests on an accepted transfer stream until the fetcher hangs up.
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    registry: &TransferRegistry,
    mut stream: S,
    io_timeout: Duration,
) -> CoreResult<()> {
    let mut buf = Vec::new();
    loop {
        let got = read_frame(&mut stream, &mut buf, MAX_REQUEST).await?;
        if !got {
            return Ok(());
        }
        if buf.len() < 16 {
            return Err(CoreError::Protocol(
                "transfer request without a range".into(),
            ));
        }
        let offset = u64::from_be_bytes(buf[..8].try_into().unwrap());
        let len = u64::from_be_bytes(buf[8..16].try_into().unwrap());
        let key = std::str::from_utf8(&buf[16..])
            .map_err(|_| CoreError::Protocol("transfer request key is not UTF-8".into()))?;
        let Some(item) = registry.get(key) else {
            timed(io_timeout, stream.write_all(&[1u8])).await?;
            timed(io_timeout, stream.flush()).await?;
            continue;
        };
        let end = offset.checked_add(len).filter(|&e| e <= item.len as u64);
        let Some(end) = end else {
            timed(io_timeout, stream.write_all(&[2u8])).await?;
            timed(io_timeout, stream.flush()).await?;
            continue;
        };
        let mut head = [0u8; 9];
        head[1..].copy_from_slice(&(item.len as u64).to_be_bytes());
        timed(io_timeout, stream.write_all(&head)).await?;
        for part in item.bytes()[offset as usize..end as usize].chunks(SLICE) {
            timed(io_timeout, stream.write_all(part)).await?;
            registry
                .sent
                .fetch_add(part.len() as u64, Ordering::Relaxed);
        }
        timed(io_timeout, stream.flush()).await?;
    }
}

/// `f`, failing with `PeerConnection` if it takes longer than `t`.
async fn timed_core<T>(
    t: Duration,
    f: impl std::future::Future<Output = CoreResult<T>>,
) -> CoreResult<T> {
    match tokio::time::timeout(t, f).await {
        Ok(r) => r,
        Err(_) => Err(CoreError::PeerConnection(format!(
            "transfer stalled for {:.1}s",
            t.as_secs_f64()
        ))),
    }
}

async fn timed<T>(
    t: Duration,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> CoreResult<T> {
    timed_core(t, async {
        f.await.map_err(|e| CoreError::io("transfer", e))
    })
    .await
}

/// Counts the payload bytes a fetch lands, as they land (progress reports, and how
/// much of a failed fetch is worth keeping).
pub trait Tally: Sync {
    fn add(&self, bytes: u64);
}

impl Tally for AtomicU64 {
    fn add(&self, bytes: u64) {
        self.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Asks the kernel to back `buf` with writable pages now (Linux `MADV_POPULATE_WRITE`),
/// which is several times faster than faulting them in one by one as data arrives;
/// a no-op where unsupported. Fresh scratch buffers are the common case here.
pub fn prefault(ptr: usize, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        const HUGE: usize = 2 << 20;
        let page = 4096usize;
        let start = ptr & !(page - 1);
        let span = len + (ptr - start);
        // Whole 2 MiB pages inside the range may be backed by transparent huge pages
        // (where the kernel allows it on request): 512x fewer faults to populate.
        let huge_start = (ptr + HUGE - 1) & !(HUGE - 1);
        let huge_end = (ptr + len) & !(HUGE - 1);
        if len > 0 {
            // SAFETY: the ranges lie within one live allocation of the caller's; the
            // advice only changes how pages are backed and populates them, never their
            // contents.
            unsafe {
                if huge_end > huge_start {
                    libc::madvise(
                        huge_start as *mut libc::c_void,
                        huge_end - huge_start,
                        libc::MADV_HUGEPAGE,
                    );
                }
                libc::madvise(start as *mut libc::c_void, span, MADV_POPULATE_WRITE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// Fetches bytes `offset..offset + dst.len()` of `key`, a tensor of `total` bytes, over
/// an already authenticated transfer stream into `dst`. `offset` must start a hash leaf
/// and the range must end on one or at `total`. Returns the range's leaf digests (see
/// [`crate::hash::root_of_digests`]), computed slice by slice while the bytes land (no
/// second pass over `dst`). `landed` counts the payload bytes received so far (for
/// progress reports).
pub async fn fetch<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &str,
    offset: u64,
    total: u64,
    dst: &mut [u8],
    io_timeout: Duration,
    landed: &impl Tally,
) -> CoreResult<Vec<u8>> {
    let request = request(key, offset, dst.len(), total)?;
    write_frame(stream, &request).await?;
    receive(stream, key, offset, total, dst, io_timeout, landed).await?
}

/// Whole tensors fetched by [`fetch_many`]: `dst` receives all of `key`.
pub struct Wanted<'a> {
    pub key: &'a str,
    pub dst: &'a mut [u8],
}

/// Fetches several whole tensors over one stream, every request sent up front while the
/// replies are read (pipelined: one round trip for the lot, not one per tensor; the
/// server answers in order). One result per item, in order, as [`fetch`] returns: an
/// item the source refuses (not served, another size) fails alone, the stream stays in
/// step; an I/O error or a stall fails that item and every later one. The flag says
/// whether the stream is still in step (fit for the next request).
pub async fn fetch_many<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    items: &mut [Wanted<'_>],
    io_timeout: Duration,
    landed: &impl Tally,
) -> (Vec<CoreResult<Vec<u8>>>, bool) {
    let mut requests = Vec::with_capacity(items.len());
    for w in items.iter() {
        match request(w.key, 0, w.dst.len(), w.dst.len() as u64) {
            Ok(r) => requests.push(r),
            Err(e) => return (items.iter().map(|_| Err(e.clone())).collect(), true),
        }
    }
    let (mut rd, mut wr) = tokio::io::split(stream);
    // Requests go out while replies come in: a large reply cannot block the requests
    // behind it (and them it).
    let send = async {
        for r in &requests {
            timed_core(io_timeout, write_frame(&mut wr, r)).await?;
        }
        Ok::<(), CoreError>(())
    };
    let read = async {
        let mut out = Vec::with_capacity(items.len());
        let mut broken: Option<CoreError> = None;
        // (Requests that never went out fail with the writer's error below.)
        for w in items.iter_mut() {
            if let Some(e) = &broken {
                out.push(Err(e.clone()));
                continue;
            }
            let total = w.dst.len() as u64;
            match receive(&mut rd, w.key, 0, total, w.dst, io_timeout, landed).await {
                Ok(r) => out.push(r), // a refusal leaves the stream in step
                Err(e) => {
                    broken = Some(e.clone());
                    out.push(Err(e));
                }
            }
        }
        (out, broken.is_none())
    };
    let (sent, (mut out, in_step)) = tokio::join!(send, read);
    if let Err(e) = &sent {
        for r in out.iter_mut().filter(|r| r.is_err()) {
            *r = Err(e.clone());
        }
    }
    (out, in_step && sent.is_ok())
}

fn request(key: &str, offset: u64, len: usize, total: u64) -> CoreResult<Vec<u8>> {
    let leaf = LEAF_SIZE as u64;
    let end = offset.checked_add(len as u64);
    if !offset.is_multiple_of(leaf)
        || end.is_none_or(|e| e > total || (e < total && !e.is_multiple_of(leaf)))
    {
        return Err(CoreError::InvalidArgument(format!(
            "fetch range {offset}+{len} of {total} bytes does not lie on hash leaves"
        )));
    }
    if 16 + key.len() > MAX_REQUEST {
        return Err(CoreError::InvalidArgument(format!(
            "shared state key of {} bytes is too long for a transfer request",
            key.len()
        )));
    }
    let mut request = Vec::with_capacity(16 + key.len());
    request.extend_from_slice(&offset.to_be_bytes());
    request.extend_from_slice(&(len as u64).to_be_bytes());
    request.extend_from_slice(key.as_bytes());
    Ok(request)
}

/// Reads one reply (see the module docs) into `dst`, hashing it leaf by leaf. The
/// outer error leaves the stream out of step; the inner one is the source's refusal of
/// this request (no payload follows).
async fn receive<R: AsyncRead + Unpin>(
    stream: &mut R,
    key: &str,
    offset: u64,
    total: u64,
    dst: &mut [u8],
    io_timeout: Duration,
    landed: &impl Tally,
) -> CoreResult<CoreResult<Vec<u8>>> {
    let leaf = LEAF_SIZE as u64;
    let mut status = [0u8; 1];
    timed(io_timeout, stream.read_exact(&mut status)).await?;
    match status[0] {
        0 => {}
        1 => {
            return Ok(Err(CoreError::PeerConnection(format!(
                "the source does not serve {key:?}"
            ))))
        }
        2 => {
            return Ok(Err(CoreError::InvalidUsage(format!(
                "the source's {key:?} is shorter than {total} bytes"
            ))))
        }
        s => return Err(CoreError::Protocol(format!("unknown transfer status {s}"))),
    }
    let mut len = [0u8; 8];
    timed(io_timeout, stream.read_exact(&mut len)).await?;
    let len = u64::from_be_bytes(len);
    if len != total {
        return Err(CoreError::InvalidUsage(format!(
            "the source serves {key:?} with {len} bytes, expected {total}"
        )));
    }
    let mut hasher = LeafHasher::starting_at((offset / leaf) as usize);
    for part in dst.chunks_mut(SLICE) {
        let mut got = 0;
        while got < part.len() {
            // Any progress within `io_timeout` keeps a slow link going.
            let n = timed(io_timeout, stream.read(&mut part[got..])).await?;
            if n == 0 {
                let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                return Err(CoreError::io("transfer", eof));
            }
            got += n;
            landed.add(n as u64);
        }
        hasher.update(part);
    }
    Ok(Ok(hasher.into_digests()))
}

/// Bandwidth probe, listener side: counts what the prober sends until it half-closes,
/// then answers the count (u64 big-endian). Bounded by `limit` bytes and `io_timeout`.
pub async fn absorb_probe<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    limit: u64,
    io_timeout: Duration,
) -> CoreResult<()> {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = timed(io_timeout, stream.read(&mut buf)).await?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > limit {
            return Err(CoreError::Protocol("probe exceeded its byte limit".into()));
        }
    }
    timed(io_timeout, stream.write_all(&total.to_be_bytes())).await?;
    // An authenticated end (and the flush of the count before it).
    timed(io_timeout, stream.shutdown()).await?;
    Ok(())
}

/// Bandwidth probe, prober side: sends for `duration` (or `max_bytes`), half-closes,
/// and returns bytes/s as acknowledged by the listener.
pub async fn run_probe<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    duration: Duration,
    max_bytes: u64,
    io_timeout: Duration,
) -> CoreResult<f64> {
    let block = vec![0u8; 256 << 10];
    let start = tokio::time::Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < duration && sent < max_bytes {
        let n = (block.len() as u64).min(max_bytes - sent) as usize;
        timed(io_timeout, stream.write_all(&block[..n])).await?;
        sent += n as u64;
    }
    timed(io_timeout, stream.shutdown()).await?;
    let mut ack = [0u8; 8];
    timed(io_timeout, stream.read_exact(&mut ack)).await?;
    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    Ok(u64::from_be_bytes(ack) as f64 / elapsed)
}
