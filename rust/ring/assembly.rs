//! Assembling a peer's ring and starting all-reduces over it, in plain Rust: the Python
//! handles (`py/ring.rs`) and the ring benchmark (`bin/ring_bench.rs`) are both thin
//! layers over this.
//!
//! A [`Ring`] holds the links of the current epoch. [`Ring::install`] closes the old
//! links and builds new ones from the pools of the node ([`build_links`]: the pool we
//! dialed to the next peer, the pool the previous peer dialed to us).
//! [`Ring::start_all_reduce`] binds an input buffer and a [`ReduceSpec`] to the current
//! links as a [`RingOp`], which runs once and can be aborted from anywhere; its result
//! stays in scratch memory until it is committed.

use crate::error::{CoreError, CoreResult};
use crate::net::handshake::Purpose;
use crate::net::node::{Node, NodeConfig, PoolKey};
use crate::quant::{QuantAlgorithm, WireType};
use crate::reduce::{DType, ReduceOp};
use crate::ring::allreduce::{
    ring_all_reduce, Armed, OpMemory, ReduceSpec, ReduceStats, ScratchPool,
};
use crate::ring::gather::{GatherMemory, GatherOp, GatherSpec};
use crate::ring::links::{LinkConfig, RingLinks};
use crate::ring::mesh::{mesh_all_reduce, Mesh};
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The ring links of `epoch` from `node`'s pools: the outbound pool dialed to `next`
/// (it must exist) and the inbound pool that `prev` dials to us (awaited for up to
/// `cfg.pool_timeout`). Both pools leave the node.
pub async fn build_links(
    node: &Node,
    epoch: u64,
    next: u64,
    prev: u64,
    cfg: LinkConfig,
) -> CoreResult<Arc<RingLinks>> {
    let to_next = node
        .take_outbound(PoolKey {
            peer: next,
            epoch,
            purpose: Purpose::Ring,
        })
        .ok_or_else(|| {
            CoreError::PeerConnection(format!("no pool to peer {next} for epoch {epoch}"))
        })?;
    let from_prev = node
        .take_inbound(
            PoolKey {
                peer: prev,
                epoch,
                purpose: Purpose::Ring,
            },
            cfg.pool_timeout,
        )
        .await?;
    Ok(RingLinks::new(
        epoch,
        next,
        prev,
        to_next,
        from_prev,
        cfg.max_piece,
        cfg.io_timeout,
    ))
}

/// `k` peers in this process (ids `1..=k`), each with its own listener on loopback,
/// joined into the ring 1 -> 2 -> ... -> k -> 1 of `epoch` with `lanes` streams per
/// link: what the ring benchmark and the ring tests run on. A ring of one has no links.
pub async fn loopback_ring(
    k: usize,
    lanes: u16,
    epoch: u64,
    cfg: LinkConfig,
) -> CoreResult<Vec<(Arc<Node>, Ring)>> {
    loopback_ring_with(k, lanes, epoch, cfg, false).await
}

/// `loopback_ring` with encrypted streams (the default) or clear ones (`insecure`).
pub async fn loopback_ring_with(
    k: usize,
    lanes: u16,
    epoch: u64,
    cfg: LinkConfig,
    insecure: bool,
) -> CoreResult<Vec<(Arc<Node>, Ring)>> {
    let nodes = loopback_nodes(k, lanes, epoch, insecure).await?;
    install_loopback(&nodes, epoch, cfg, None).await
}

/// `loopback_ring_with`, plus the mesh of the same epoch (one stream per direction and
/// partner): all-reduces of up to `mesh_max_bytes` run on the mesh.
pub async fn loopback_mesh(
    k: usize,
    lanes: u16,
    epoch: u64,
    cfg: LinkConfig,
    insecure: bool,
    mesh_max_bytes: usize,
) -> CoreResult<Vec<(Arc<Node>, Ring)>> {
    let nodes = loopback_nodes(k, lanes, epoch, insecure).await?;
    for (i, node) in nodes.iter().enumerate() {
        for r in crate::ring::mesh::mesh_partners(i, k) {
            let to = &nodes[r];
            node.connect_pool(to.local_addr(), to.peer_id(), epoch, 1, Purpose::Mesh)
                .await?;
        }
    }
    let ids: Vec<u64> = nodes.iter().map(|n| n.peer_id()).collect();
    let mesh = MeshConfig {
        ring: ids,
        max_bytes: mesh_max_bytes,
    };
    install_loopback(&nodes, epoch, cfg, Some(mesh)).await
}

/// `k` nodes on loopback (ids `1..=k`), each with its pool of `lanes` streams dialed to
/// the next one for `epoch`.
async fn loopback_nodes(
    k: usize,
    lanes: u16,
    epoch: u64,
    insecure: bool,
) -> CoreResult<Vec<Arc<Node>>> {
    let any: SocketAddr = (Ipv4Addr::LOCALHOST, 0).into();
    let mut nodes = Vec::with_capacity(k);
    for i in 0..k {
        let node_cfg = NodeConfig {
            peer_id: i as u64 + 1,
            secret: None,
            identity: crate::net::identity::Identity::ephemeral(),
            handshake_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            insecure,
        };
        nodes.push(Node::bind(node_cfg, any).await?);
    }
    // The roster a master would hand out.
    let roster: Vec<_> = nodes
        .iter()
        .map(|n| (n.peer_id(), n.public_key()))
        .collect();
    for node in &nodes {
        node.set_peer_keys(&roster)?;
    }
    if k > 1 {
        for (i, node) in nodes.iter().enumerate() {
            let next = &nodes[(i + 1) % k];
            node.connect_pool(
                next.local_addr(),
                next.peer_id(),
                epoch,
                lanes,
                Purpose::Ring,
            )
            .await?;
        }
    }
    Ok(nodes)
}

/// Installs the ring 1 -> 2 -> ... -> k -> 1 (and the mesh) on every node.
async fn install_loopback(
    nodes: &[Arc<Node>],
    epoch: u64,
    cfg: LinkConfig,
    mesh: Option<MeshConfig>,
) -> CoreResult<Vec<(Arc<Node>, Ring)>> {
    let k = nodes.len();
    let mut peers = Vec::with_capacity(k);
    for (i, node) in nodes.iter().enumerate() {
        let neighbours = (k > 1).then(|| {
            let next = nodes[(i + 1) % k].peer_id();
            let prev = nodes[(i + k - 1) % k].peer_id();
            (next, prev)
        });
        let ring = Ring::new(1 << 30);
        ring.install_with_mesh(node, epoch, neighbours, mesh.clone(), cfg)
            .await?;
        peers.push((node.clone(), ring));
    }
    Ok(peers)
}

/// The ring of one peer: the links of the current epoch (none in a ring of one, or
/// before the first install) and the scratch buffers its ops recycle.
pub struct Ring {
    links: Mutex<Option<Arc<RingLinks>>>,
    /// The mesh of the same epoch, if one was installed with the links.
    mesh: Mutex<Option<Arc<Mesh>>>,
    scratch: Arc<ScratchPool>,
}

/// What [`Ring::install`] needs for the mesh of an epoch besides the ring links: the
/// ring's peer ids in the mesh's rank order and the largest collective (bytes) to run
/// on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshConfig {
    /// Peer ids by mesh rank: a permutation of the ring (its own order by default).
    pub ring: Vec<u64>,
    pub max_bytes: usize,
}

impl Ring {
    /// No links yet; at most `scratch_cache_bytes` of freed scratch memory kept for reuse.
    pub fn new(scratch_cache_bytes: usize) -> Ring {
        Ring {
            links: Mutex::new(None),
            mesh: Mutex::new(None),
            scratch: ScratchPool::new(scratch_cache_bytes),
        }
    }

    /// Closes the current links, then builds those of `epoch` to `next` / from `prev`
    /// (`neighbours`; `None`: a ring of one, which has no links). On failure the ring is
    /// left without links. Returns the new links, if any.
    pub async fn install(
        &self,
        node: &Node,
        epoch: u64,
        neighbours: Option<(u64, u64)>,
        cfg: LinkConfig,
    ) -> CoreResult<Option<Arc<RingLinks>>> {
        self.install_with_mesh(node, epoch, neighbours, None, cfg)
            .await
    }

    /// [`Ring::install`], and with `mesh` (and neighbours) the mesh links of the same
    /// epoch (see [`Mesh::build`]), so that collectives of up to `mesh.max_bytes` run
    /// on them. Without the mesh every collective takes the ring.
    pub async fn install_with_mesh(
        &self,
        node: &Node,
        epoch: u64,
        neighbours: Option<(u64, u64)>,
        mesh: Option<MeshConfig>,
        cfg: LinkConfig,
    ) -> CoreResult<Option<Arc<RingLinks>>> {
        self.close().await;
        let Some((next, prev)) = neighbours else {
            return Ok(None);
        };
        let links = build_links(node, epoch, next, prev, cfg).await?;
        let mesh = match mesh.filter(|m| m.max_bytes > 0) {
            Some(m) => {
                let built =
                    Mesh::build(node, epoch, m.ring, node.peer_id(), m.max_bytes, cfg).await;
                match built {
                    Ok(mesh) => Some(Arc::new(mesh)),
                    Err(e) => {
                        links.close().await;
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        *self.mesh.lock().unwrap() = mesh;
        *self.links.lock().unwrap() = Some(links.clone());
        Ok(Some(links))
    }

    /// The mesh of the current epoch, if any.
    pub fn mesh(&self) -> Option<Arc<Mesh>> {
        self.mesh.lock().unwrap().clone()
    }

    /// The mesh if an all-reduce of `len` bytes under `spec` runs on it (see
    /// [`Mesh::takes`]); `None`: it runs on the ring.
    pub fn mesh_for(&self, spec: &ReduceSpec, len: usize) -> Option<Arc<Mesh>> {
        self.mesh().filter(|m| m.takes(spec, len))
    }

    /// Takes the current links out of the ring (they stay open until closed).
    pub fn take(&self) -> Option<Arc<RingLinks>> {
        self.links.lock().unwrap().take()
    }

    /// Closes and forgets the current links (and mesh), if any.
    pub async fn close(&self) {
        let old = self.take();
        let mesh = self.mesh.lock().unwrap().take();
        if let Some(old) = old {
            old.close().await;
        }
        if let Some(mesh) = mesh {
            mesh.close().await;
        }
    }

    /// The current links, if any (poisoned or not).
    pub fn links(&self) -> Option<Arc<RingLinks>> {
        self.links.lock().unwrap().clone()
    }

    /// The current links if they are usable: a `PeerConnection` error when there are
    /// none or they failed.
    pub fn usable_links(&self) -> CoreResult<Arc<RingLinks>> {
        let links = self.links().ok_or_else(|| {
            CoreError::PeerConnection("no ring links: call update_topology()".into())
        })?;
        if links.is_poisoned() {
            return Err(links.poison_error());
        }
        Ok(links)
    }

    /// `(receiving lanes from prev, sending lanes to next)`, `(0, 0)` without links.
    pub fn lanes(&self) -> (usize, usize) {
        self.links
            .lock()
            .unwrap()
            .as_ref()
            .map_or((0, 0), |l| (l.recv_lanes(), l.send_lanes()))
    }

    /// The pool the scratch memory of this ring's ops comes from.
    pub fn scratch(&self) -> Arc<ScratchPool> {
        self.scratch.clone()
    }

    /// Whether there are links and they are usable (false after any link failure,
    /// the mesh's included).
    pub fn is_ok(&self) -> bool {
        self.links
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|l| !l.is_poisoned())
            && !self.mesh().is_some_and(|m| m.is_poisoned())
    }

    /// Binds an all-reduce of the `len` bytes at `input` to the current links (see
    /// [`Ring::usable_links`] for the errors). Nothing runs until [`RingOp::run`].
    ///
    /// # Safety
    /// `input..input+len` must stay valid and unmodified while `keepalive` lives; the op
    /// keeps `keepalive` until it is dropped.
    pub unsafe fn start_all_reduce(
        &self,
        spec: ReduceSpec,
        input: *const u8,
        len: usize,
        keepalive: Box<dyn Send + Sync>,
    ) -> CoreResult<RingOp> {
        let links = self.usable_links()?;
        let mesh = self.mesh_for(&spec, len);
        // SAFETY: forwarded to the caller.
        let op =
            unsafe { RingOp::with_input(links, spec, input, len, keepalive, Some(self.scratch())) };
        Ok(op.with_mesh(mesh))
    }

    /// [`Ring::start_all_reduce`] of bytes the op shares (and nobody can modify while it
    /// holds them).
    pub fn start_all_reduce_shared(
        &self,
        spec: ReduceSpec,
        input: Arc<Vec<u8>>,
    ) -> CoreResult<RingOp> {
        let (ptr, len) = (input.as_ptr(), input.len());
        // SAFETY: the keep-alive owns a reference to the Vec, which cannot be modified or
        // freed while it is shared.
        unsafe { self.start_all_reduce(spec, ptr, len, Box::new(input)) }
    }

    /// Binds an all-gather to the current links: `contribution` is copied into slot
    /// `spec.rank` of the `spec.world * contribution.len()` bytes at `out`, where the
    /// other peers' contributions land. Nothing runs until [`GatherOp::run`].
    ///
    /// # Safety
    /// `out..out + world * len` must stay valid while `keepalive` lives (the op keeps
    /// it until dropped), and nothing else may read or write it while the op runs.
    pub unsafe fn start_all_gather(
        &self,
        spec: GatherSpec,
        contribution: &[u8],
        out: *mut u8,
        keepalive: Box<dyn Send + Sync>,
        armed: bool,
    ) -> CoreResult<GatherOp> {
        let links = self.usable_links()?;
        // SAFETY: forwarded to the caller.
        let mem = unsafe {
            GatherMemory::with_contribution(contribution, spec.rank, out, spec.world, keepalive)?
        };
        Ok(GatherOp::new(links, spec, Arc::new(mem), armed))
    }
}

/// One all-reduce bound to a ring's links: `run()` drives it (once), `abort()` stops it
/// from anywhere, and after success `result()` / `commit_into()` hand out the reduced
/// bytes (never written to the caller's memory before that).
pub struct RingOp {
    links: Arc<RingLinks>,
    /// Runs on this mesh instead of the ring links.
    mesh: Option<Arc<Mesh>>,
    spec: ReduceSpec,
    mem: Arc<OpMemory>,
    cancel: CancellationToken,
    armed: Arc<Armed>,
    started: AtomicBool,
}

impl RingOp {
    /// An armed op (see [`RingOp::with_armed`]).
    pub fn new(links: Arc<RingLinks>, spec: ReduceSpec, mem: Arc<OpMemory>) -> RingOp {
        RingOp {
            links,
            mesh: None,
            spec,
            mem,
            cancel: CancellationToken::new(),
            armed: Armed::new(true),
            started: AtomicBool::new(false),
        }
    }

    /// Unarmed (`false`), the op never takes silence from the previous peer for a
    /// stall until [`RingOp::arm`]: for an op started before every peer is known to
    /// have started it.
    pub fn with_armed(self, armed: bool) -> RingOp {
        RingOp {
            armed: Armed::new(armed),
            ..self
        }
    }

    /// The op runs on `mesh` (recursive doubling) instead of the ring links, if any.
    pub fn with_mesh(self, mesh: Option<Arc<Mesh>>) -> RingOp {
        RingOp { mesh, ..self }
    }

    /// Whether the op runs on the mesh.
    pub fn is_mesh(&self) -> bool {
        self.mesh.is_some()
    }

    /// Lets the op declare a stall from now on (idempotent; harmless once it ended).
    pub fn arm(&self) {
        self.armed.arm();
    }

    /// An op over `links` reducing the `len` bytes at `input`; its scratch memory comes
    /// from `pool` (or a fresh allocation).
    ///
    /// # Safety
    /// As for [`OpMemory::new`]: `input..input+len` must stay valid and unmodified while
    /// `keepalive` lives (the op keeps it until dropped).
    pub unsafe fn with_input(
        links: Arc<RingLinks>,
        spec: ReduceSpec,
        input: *const u8,
        len: usize,
        keepalive: Box<dyn Send + Sync>,
        pool: Option<Arc<ScratchPool>>,
    ) -> RingOp {
        // SAFETY: forwarded to the caller.
        let mem = unsafe { OpMemory::new(input, len, keepalive, pool) };
        RingOp::new(links, spec, Arc::new(mem))
    }

    /// An op over `links` reducing the `len` bytes at `input` into the `len` bytes at
    /// `output` directly (no scratch memory, no copy at commit); `input` is only read.
    ///
    /// # Safety
    /// As for [`OpMemory::with_output`]: both ranges stay valid while `keepalive`
    /// lives, nothing else writes `output` meanwhile, and the two do not overlap.
    pub unsafe fn with_output(
        links: Arc<RingLinks>,
        spec: ReduceSpec,
        input: *const u8,
        output: *mut u8,
        len: usize,
        keepalive: Box<dyn Send + Sync>,
    ) -> RingOp {
        // SAFETY: forwarded to the caller.
        let mem = unsafe { OpMemory::with_output(input, output, len, keepalive) };
        RingOp::new(links, spec, Arc::new(mem))
    }

    /// An op over `links` reducing the `len` bytes at `tensor` in place: the results
    /// land there as the ring computes them, its original bytes move to a backup from
    /// `pool`. A failed run puts them back before it returns; after a successful run,
    /// [`RingOp::commit_into`] the tensor itself keeps the result and
    /// [`RingOp::rollback`] puts the original back.
    ///
    /// # Safety
    /// As for [`OpMemory::in_place`]: the range stays valid while `keepalive` lives,
    /// and nothing else reads or writes it until the op is committed or rolled back.
    pub unsafe fn in_place(
        links: Arc<RingLinks>,
        spec: ReduceSpec,
        tensor: *mut u8,
        len: usize,
        keepalive: Box<dyn Send + Sync>,
        pool: Option<Arc<ScratchPool>>,
    ) -> RingOp {
        // SAFETY: forwarded to the caller.
        let mem = unsafe { OpMemory::in_place(tensor, len, keepalive, pool) };
        RingOp::new(links, spec, Arc::new(mem))
    }

    pub fn spec(&self) -> &ReduceSpec {
        &self.spec
    }

    /// The op's future, which resolves to its byte counts; an `InvalidUsage` error if it
    /// was already asked for (an op runs once).
    pub fn run(
        &self,
    ) -> CoreResult<impl Future<Output = CoreResult<ReduceStats>> + Send + 'static> {
        if self.started.swap(true, Ordering::AcqRel) {
            return Err(CoreError::InvalidUsage("RingOp.run() called twice".into()));
        }
        let (links, mesh, spec) = (self.links.clone(), self.mesh.clone(), self.spec.clone());
        let (mem, cancel, armed) = (self.mem.clone(), self.cancel.clone(), self.armed.clone());
        Ok(async move {
            match mesh {
                Some(mesh) => mesh_all_reduce(mesh, spec, mem, cancel, armed).await,
                None => ring_all_reduce(links, spec, mem, cancel, armed).await,
            }
        })
    }

    /// Stops the op (its run fails). The links are poisoned if a frame was cut.
    pub fn abort(&self) {
        self.cancel.cancel();
    }

    /// Bytes of the input (and of the result).
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// The reduced bytes (meaningful once `run()` succeeded).
    pub fn result(&self) -> &[u8] {
        self.mem.result()
    }

    /// Copies the reduced bytes into `out`, which must be exactly as long (nothing to
    /// copy when the results already landed there: an op made by `with_output` or
    /// `in_place`; an in-place op committed elsewhere puts its tensor back).
    pub fn commit_into(&self, out: &mut [u8]) -> CoreResult<()> {
        if out.len() != self.len() {
            return Err(CoreError::InvalidArgument(format!(
                "output has {} bytes, the result {}",
                out.len(),
                self.len()
            )));
        }
        // (Compared before borrowing the result: `out` may be that very memory.)
        if !std::ptr::eq(out.as_ptr(), self.mem.result_ptr()) {
            out.copy_from_slice(self.result());
            self.mem.rollback();
        } else {
            self.mem.keep();
        }
        Ok(())
    }

    /// An in-place op that ran: puts the tensor's original bytes back (the group's
    /// outcome was a failure). A no-op for other ops, before `run()` ended, after a
    /// commit, and the second time.
    pub fn rollback(&self) {
        self.mem.rollback();
    }
}

/// Decodes the quantization codes of the wire protocol: `None` for algorithm 0 (values
/// travel in their own dtype), else the algorithm and the wire type it encodes into.
pub fn quant_from_codes(algorithm: u8, wire: u8) -> CoreResult<Option<(QuantAlgorithm, WireType)>> {
    match QuantAlgorithm::from_u8(algorithm) {
        None => Err(CoreError::InvalidArgument(format!(
            "unknown quantization algorithm code {algorithm}"
        ))),
        Some(QuantAlgorithm::None) => Ok(None),
        Some(alg) => {
            let wire = WireType::from_u8(wire).ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "data type code {wire} cannot carry quantized values \
                     (use UINT8, INT8, FLOAT8_E4M3 or FLOAT8_E5M2)"
                ))
            })?;
            Ok(Some((alg, wire)))
        }
    }
}

/// Decodes a dtype code of the wire protocol.
pub fn dtype_from_code(code: u8) -> CoreResult<DType> {
    DType::from_u8(code)
        .ok_or_else(|| CoreError::InvalidArgument(format!("unknown dtype code {code}")))
}

/// Decodes a reduce-op code of the wire protocol.
pub fn op_from_code(code: u8) -> CoreResult<ReduceOp> {
    ReduceOp::from_u8(code)
        .ok_or_else(|| CoreError::InvalidArgument(format!("unknown reduce op code {code}")))
}
